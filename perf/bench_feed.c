/*
 * bench_feed - the vLLM KV event feed end to end over loopback TCP.
 *
 * Question 1 (throughput): how many blocks per second does one feed thread decode and apply,
 * with vLLM-shaped batches of one 16-block BlockStored each (plus, once the window is full, a
 * BlockRemoved of the batch stored `window` batches earlier, so the index stays bounded)?
 * The publisher (a thread here, msgpack-c encoding the current map form, payloads encoded
 * before the clock starts) sends everything as fast as ZeroMQ takes it; the clock stops when
 * the feed has applied the last batch.  Baselines in the same run: the same payloads decoded
 * only (kvr_feed_decode, one thread), and decoded + applied through kvr_events_apply on the
 * calling thread of another router (no ZeroMQ).  Ratio = feed / in-process apply.
 *
 * Question 2 (lag): at a fixed rate (default 10k batches/s), the time from the publisher's send
 * to the moment a query-only kvr_route (hash + find_matches) sees the batch's 16 blocks.  A
 * checker thread follows the publisher and probes every `sample`-th batch until it is visible.
 * Prints p50/p99/p999 against the rate's period.
 *
 * usage: bench_feed [--batches N] [--window N] [--lag-batches N] [--rate N] [--sample N]
 *                   [--spin-us N]   (kvr_feed_config.idle_spin_ns, default 0)
 */
#include <inttypes.h>
#include <msgpack.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_decode.h"

#define BS      16
#define NBLK    16
#define PER_BAT (NBLK * BS)

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double wall_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void pstr(msgpack_packer *pk, const char *s)
{
	msgpack_pack_str(pk, strlen(s));
	msgpack_pack_str_body(pk, s, strlen(s));
}

static uint64_t hash_of(uint64_t batch, int i)
{
	return 0x8000000000000000ull | (batch << 8) | (uint64_t)i;
}

static uint32_t token_of(uint64_t batch, int j)
{
	return (uint32_t)(batch * PER_BAT + (uint64_t)j) & 0x7fffffff;
}

/* vLLM's current form: {ts, events: [{type: BlockStored, ...}, {type: BlockRemoved}?], dp}. */
static void encode(msgpack_sbuffer *sb, uint64_t batch, uint64_t window, double ts)
{
	msgpack_packer pk;
	msgpack_sbuffer_clear(sb);
	msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
	msgpack_pack_map(&pk, 3);
	pstr(&pk, "ts");
	msgpack_pack_double(&pk, ts);
	pstr(&pk, "events");
	bool rm = window && batch >= window;
	msgpack_pack_array(&pk, rm ? 2 : 1);
	msgpack_pack_map(&pk, 8);
	pstr(&pk, "type");
	pstr(&pk, "BlockStored");
	pstr(&pk, "block_hashes");
	msgpack_pack_array(&pk, NBLK);
	for (int i = 0; i < NBLK; i++)
		msgpack_pack_uint64(&pk, hash_of(batch, i));
	pstr(&pk, "parent_block_hash");
	msgpack_pack_nil(&pk);
	pstr(&pk, "token_ids");
	msgpack_pack_array(&pk, PER_BAT);
	for (int j = 0; j < PER_BAT; j++)
		msgpack_pack_uint32(&pk, token_of(batch, j));
	pstr(&pk, "block_size");
	msgpack_pack_int(&pk, BS);
	pstr(&pk, "lora_id");
	msgpack_pack_nil(&pk);
	pstr(&pk, "medium");
	pstr(&pk, "GPU");
	pstr(&pk, "lora_name");
	msgpack_pack_nil(&pk);
	if (rm) {
		msgpack_pack_map(&pk, 3);
		pstr(&pk, "type");
		pstr(&pk, "BlockRemoved");
		pstr(&pk, "block_hashes");
		msgpack_pack_array(&pk, NBLK);
		for (int i = 0; i < NBLK; i++)
			msgpack_pack_uint64(&pk, hash_of(batch - window, i));
		pstr(&pk, "medium");
		pstr(&pk, "GPU");
	}
	pstr(&pk, "data_parallel_rank");
	msgpack_pack_int(&pk, 0);
}

static void send_batch(void *pub, uint64_t seq, const void *payload, size_t len)
{
	uint8_t s[8];
	for (int i = 0; i < 8; i++)
		s[i] = (uint8_t)(seq >> (56 - 8 * i));
	zmq_send(pub, "", 0, ZMQ_SNDMORE);
	zmq_send(pub, s, 8, ZMQ_SNDMORE);
	zmq_send(pub, payload, len, 0);
}

static struct kvr_router *make_router(void)
{
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.mode = KVR_MODE_EVENTS;
	cfg.block_size = BS;
	cfg.n_shards = 1;
	struct kvr_router *r;
	if (kvr_router_create(&cfg, &r) ||
	    kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, KVR_CAPACITY_NONE, 0)) {
		fprintf(stderr, "router\n");
		exit(1);
	}
	return r;
}

/* An XPUB (PUB on the wire) bound on loopback; a feed subscribed to it, connection awaited. */
static void *make_pub(void *zctx, struct kvr_feed *f, uint32_t *id)
{
	void *pub = zmq_socket(zctx, ZMQ_XPUB);
	int zero = 0;
	zmq_setsockopt(pub, ZMQ_SNDHWM, &zero, sizeof(zero));
	zmq_setsockopt(pub, ZMQ_LINGER, &zero, sizeof(zero));
	if (zmq_bind(pub, "tcp://127.0.0.1:*")) {
		fprintf(stderr, "bind: %s\n", zmq_strerror(zmq_errno()));
		exit(1);
	}
	char ep[256];
	size_t len = sizeof(ep);
	zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, ep, &len);
	struct kvr_feed_endpoint e = {.endpoint = ep, .worker_id = 1, .dp_rank = 0};
	if (kvr_feed_add(f, &e, id)) {
		fprintf(stderr, "feed add\n");
		exit(1);
	}
	char sub[64];
	if (zmq_recv(pub, sub, sizeof(sub), 0) < 1) /* the subscription: the SUB is connected */
		exit(1);
	return pub;
}

static void wait_applied(struct kvr_feed *f, uint32_t id, uint64_t n)
{
	struct kvr_feed_stats st;
	uint64_t end = now_ns() + 60ull * 1000000000u;
	do {
		if (kvr_feed_get_stats(f, id, &st) == 0 && st.next_seq >= n)
			return;
		usleep(200);
	} while (now_ns() < end);
	fprintf(stderr, "feed stuck at %" PRIu64 " of %" PRIu64 "\n", st.next_seq, n);
	exit(1);
}

/* ---------------------------------------------------------------- lag */

struct lag {
	struct kvr_router *r;
	uint64_t n, sample, rate;
	uint64_t *sent_ns; /* per batch, 0 until sent (atomic) */
	uint64_t *lag_ns;
	uint64_t n_lag;
};

static void *checker(void *arg)
{
	struct lag *L = arg;
	uint32_t tok[PER_BAT];
	struct kvr_request rq;
	kvr_request_init(&rq);
	rq.tokens = tok;
	rq.n_tokens = PER_BAT;
	rq.flags = KVR_ROUTE_QUERY_ONLY;
	for (uint64_t b = 0; b < L->n; b += L->sample) {
		for (int j = 0; j < PER_BAT; j++)
			tok[j] = token_of(b, j);
		uint64_t t0;
		while (!(t0 = __atomic_load_n(&L->sent_ns[b], __ATOMIC_ACQUIRE)))
			;
		struct kvr_decision d;
		for (;;) {
			if (kvr_route(L->r, &rq, &d) == 0 && d.overlap_blocks == NBLK)
				break;
			sched_yield();
		}
		L->lag_ns[L->n_lag++] = now_ns() - t0;
	}
	return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

struct lag_result {
	double p50, p99, p999, achieved;
	uint64_t n, late;
};

/* Publishes lag_batches at rate; zctx NULL: each batch decoded and applied in process on the
 * publishing thread (kvr_feed_decode + kvr_events_apply, the feed's work minus ZeroMQ and the
 * thread hop), else sent to a feed over loopback TCP. */
static struct lag_result run_lag(void *zctx, const struct kvr_feed_config *fc, uint64_t nb,
                                 uint64_t rate, uint64_t sample, uint64_t window)
{
	struct kvr_router *r = make_router();
	struct kvr_feed *f = NULL;
	void *pub = NULL;
	uint32_t id = 0;
	if (zctx) {
		if (kvr_feed_create(r, fc, &f))
			exit(1);
		pub = make_pub(zctx, f, &id);
	}
	struct lag L = {.r = r,
	                .n = nb,
	                .sample = sample,
	                .rate = rate,
	                .sent_ns = calloc(nb, sizeof(uint64_t)),
	                .lag_ns = calloc(nb / sample + 1, sizeof(uint64_t))};
	pthread_t th;
	pthread_create(&th, NULL, checker, &L);
	msgpack_sbuffer sb;
	msgpack_sbuffer_init(&sb);
	struct kvr_feed_batch fb = {0};
	struct kvr_event_block blk[NBLK];
	uint64_t period = 1000000000u / rate, start = now_ns(), late = 0;
	for (uint64_t b = 0; b < nb; b++) {
		uint64_t due = start + b * period;
		uint64_t t = now_ns();
		if (t < due) { /* sleep, not spin: the feed, its shard and the checker need CPUs */
			struct timespec ts = {.tv_sec = (time_t)(due / 1000000000u),
			                      .tv_nsec = (long)(due % 1000000000u)};
			clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
			t = now_ns();
		}
		if (t > due + period)
			late++;
		encode(&sb, b + (1ull << 32), window, wall_s()); /* other hashes than run 1 */
		uint64_t ts = now_ns();
		__atomic_store_n(&L.sent_ns[b], ts, __ATOMIC_RELEASE);
		if (zctx) {
			send_batch(pub, b, sb.data, sb.size);
			continue;
		}
		kvr_feed_decode(&fb, sb.data, sb.size);
		for (uint32_t k = 0; k < fb.n_ev; k++) {
			const struct kvr_fev *v = &fb.ev[k];
			struct kvr_event ev = {.type = v->type == KVR_FEV_STORED
			                                   ? KVR_EVENT_STORED
			                                   : KVR_EVENT_REMOVED};
			if (v->type == KVR_FEV_STORED) {
				for (uint32_t i = 0; i < v->n_hashes; i++)
					blk[i] = (struct kvr_event_block){
					    .ext_hash = fb.hashes[v->hash_off + i],
					    .tokens = fb.tokens + v->tok_off + i * BS,
					    .n_tokens = BS};
				ev.blocks = blk;
				ev.n_blocks = v->n_hashes;
			} else {
				ev.removed = fb.hashes + v->hash_off;
				ev.n_removed = v->n_hashes;
			}
			kvr_events_apply(r, (struct kvr_rank_id){1, 0}, &ev);
		}
	}
	struct lag_result res = {.late = late};
	res.achieved = (double)nb / ((double)(now_ns() - start) * 1e-9);
	pthread_join(th, NULL);
	if (zctx)
		wait_applied(f, id, nb);
	qsort(L.lag_ns, L.n_lag, sizeof(uint64_t), cmp_u64);
	res.n = L.n_lag;
	res.p50 = (double)L.lag_ns[L.n_lag / 2];
	res.p99 = (double)L.lag_ns[L.n_lag * 99 / 100];
	res.p999 = (double)L.lag_ns[L.n_lag * 999 / 1000];
	kvr_feed_batch_fini(&fb);
	msgpack_sbuffer_destroy(&sb);
	free(L.sent_ns);
	free(L.lag_ns);
	if (pub)
		zmq_close(pub);
	kvr_feed_destroy(f);
	kvr_router_destroy(r);
	return res;
}

int main(int argc, char **argv)
{
	uint64_t batches = 40000, window = 4096, lag_batches = 20000, rate = 10000, sample = 4;
	uint64_t spin_us = 0;
	for (int i = 1; i + 1 < argc; i += 2) {
		uint64_t v = strtoull(argv[i + 1], NULL, 10);
		if (!strcmp(argv[i], "--batches"))
			batches = v;
		else if (!strcmp(argv[i], "--window"))
			window = v;
		else if (!strcmp(argv[i], "--lag-batches"))
			lag_batches = v;
		else if (!strcmp(argv[i], "--rate"))
			rate = v;
		else if (!strcmp(argv[i], "--sample"))
			sample = v ? v : 1;
		else if (!strcmp(argv[i], "--spin-us"))
			spin_us = v;
	}
	/* Pre-encode the throughput run's payloads. */
	msgpack_sbuffer *pl = calloc(batches, sizeof(*pl));
	for (uint64_t b = 0; b < batches; b++) {
		msgpack_sbuffer_init(&pl[b]);
		encode(&pl[b], b, window, wall_s());
	}
	/* Baseline 1: decode only. */
	struct kvr_feed_batch fb = {0};
	uint64_t t0 = now_ns(), blocks = 0;
	for (uint64_t b = 0; b < batches; b++) {
		if (kvr_feed_decode(&fb, pl[b].data, pl[b].size)) {
			fprintf(stderr, "decode\n");
			return 1;
		}
		blocks += fb.ev[0].n_hashes;
	}
	double decode_bps = (double)blocks / ((double)(now_ns() - t0) * 1e-9);
	/* Baseline 2: decode + kvr_events_apply on this thread (no ZeroMQ). */
	struct kvr_router *r = make_router();
	struct kvr_event_block blk[NBLK];
	t0 = now_ns();
	for (uint64_t b = 0; b < batches; b++) {
		kvr_feed_decode(&fb, pl[b].data, pl[b].size);
		for (uint32_t k = 0; k < fb.n_ev; k++) {
			const struct kvr_fev *v = &fb.ev[k];
			struct kvr_event ev = {.type = v->type == KVR_FEV_STORED
			                                   ? KVR_EVENT_STORED
			                                   : KVR_EVENT_REMOVED};
			if (v->type == KVR_FEV_STORED) {
				for (uint32_t i = 0; i < v->n_hashes; i++)
					blk[i] = (struct kvr_event_block){
					    .ext_hash = fb.hashes[v->hash_off + i],
					    .tokens = fb.tokens + v->tok_off + i * BS,
					    .n_tokens = BS};
				ev.blocks = blk;
				ev.n_blocks = v->n_hashes;
			} else {
				ev.removed = fb.hashes + v->hash_off;
				ev.n_removed = v->n_hashes;
			}
			if (kvr_events_apply(r, (struct kvr_rank_id){1, 0}, &ev)) {
				fprintf(stderr, "apply\n");
				return 1;
			}
		}
	}
	double direct_bps = (double)blocks / ((double)(now_ns() - t0) * 1e-9);
	kvr_router_destroy(r);
	kvr_feed_batch_fini(&fb);

	/* The feed over loopback TCP. */
	r = make_router();
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.rcv_hwm = 1u << 30;
	fc.idle_spin_ns = spin_us * 1000;
	struct kvr_feed *f;
	if (kvr_feed_create(r, &fc, &f)) {
		fprintf(stderr, "feed\n");
		return 1;
	}
	void *zctx = zmq_ctx_new();
	uint32_t id;
	void *pub = make_pub(zctx, f, &id);
	t0 = now_ns();
	for (uint64_t b = 0; b < batches; b++)
		send_batch(pub, b, pl[b].data, pl[b].size);
	wait_applied(f, id, batches);
	double feed_bps = (double)blocks / ((double)(now_ns() - t0) * 1e-9);
	struct kvr_feed_stats st;
	kvr_feed_get_stats(f, id, &st);
	if (st.blocks_stored != blocks || st.malformed || st.gaps || st.refused) {
		fprintf(stderr,
		        "feed applied %" PRIu64 " of %" PRIu64 " blocks (malformed %" PRIu64
		        ", gaps %" PRIu64 ", refused %" PRIu64 ")\n",
		        st.blocks_stored, blocks, st.malformed, st.gaps, st.refused);
		return 1;
	}
	printf(
	    "SUMMARY bench=feed_throughput batches=%" PRIu64 " blocks_per_batch=%d "
	    "feed_blocks_per_s=%.0f direct_apply_blocks_per_s=%.0f decode_only_blocks_per_s=%.0f "
	    "ratio_feed_vs_direct=%.3f target_blocks_per_s=1000000 %s\n",
	    batches, NBLK, feed_bps, direct_bps, decode_bps, feed_bps / direct_bps,
	    feed_bps >= 1e6 ? "PASS" : "BELOW_TARGET");
	for (uint64_t b = 0; b < batches; b++)
		msgpack_sbuffer_destroy(&pl[b]);
	free(pl);
	zmq_close(pub);
	kvr_feed_destroy(f);
	kvr_router_destroy(r);

	/* Lag at a fixed rate: in-process delivery (the baseline), then through the feed. */
	struct lag_result base = run_lag(NULL, &fc, lag_batches, rate, sample, window);
	struct lag_result fl = run_lag(zctx, &fc, lag_batches, rate, sample, window);
	printf("SUMMARY bench=feed_lag rate=%" PRIu64 " spin_us=%" PRIu64
	       " achieved_rate=%.0f late_sends=%" PRIu64 " samples=%" PRIu64
	       " p50_us=%.1f p99_us=%.1f p999_us=%.1f inproc_p50_us=%.1f inproc_p99_us=%.1f "
	       "ratio_p99_vs_inproc=%.3f target_p99_us=200 %s\n",
	       rate, spin_us, fl.achieved, fl.late, fl.n, fl.p50 / 1e3, fl.p99 / 1e3, fl.p999 / 1e3,
	       base.p50 / 1e3, base.p99 / 1e3, fl.p99 / (base.p99 > 0 ? base.p99 : 1),
	       fl.p99 <= 200000 ? "PASS" : "ABOVE_TARGET");
	zmq_ctx_term(zctx);
	return 0;
}
