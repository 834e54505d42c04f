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
 * to the moment a query-only kvr_route (hash + find_matches) sees the batch's 16 blocks: after
 * every `sample`-th send the publishing thread probes until it does (probe_visible).  In the
 * same run, to tell where lag comes from:
 *   - the same through kvr_events_apply on the publishing thread (no ZeroMQ, no feed thread);
 *   - both again without probing, measured where the batch is applied (in process: when
 *     kvr_events_apply returns; feed: its own publish -> applied histogram, bucket bounds);
 *   - the bare ZeroMQ hop: a plain SUB thread, publish -> zmq_recv returned, no router;
 *   - a hand-written subscriber: that SUB thread decoding and applying each batch with
 *     kvr_events_apply, no feed code (what the feed must not be worse than).
 * The applied and ZeroMQ figures cover every batch, the probed ones every sample-th.  Prints
 * p50/p99/p999 against the rate's period.  --rt 1 runs the lag part under SCHED_FIFO (every thread
 * it starts inherits it): what the path costs when each woken thread runs at once, i.e. without the
 * scheduler's share of the tail.
 *
 * usage: bench_feed [--batches N] [--window N] [--lag-batches N] [--rate N] [--sample N]
 *                   [--spin-us N]   (kvr_feed_config.idle_spin_ns, default 0)
 *                   [--rt 0|1]      (--batches 0 or --lag-batches 0 skip that part)
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

#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "sync/feed_decode.h"
#include "sync/feed_encode.h"

#define BS      16
#define NBLK    16
#define PER_BAT (NBLK * BS)

static double wall_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t hash_of(uint64_t batch, int i)
{
	return 0x8000000000000000ull | (batch << 8) | (uint64_t)i;
}

static uint32_t token_of(uint64_t batch, int j)
{
	return (uint32_t)(batch * PER_BAT + (uint64_t)j) & 0x7fffffff;
}

struct toks {
	uint32_t t[PER_BAT];
};

static const uint32_t *block_tokens(void *ctx, size_t i)
{
	return ((struct toks *)ctx)->t + i * BS;
}

/* vLLM's current form: {ts, events: [{type: BlockStored, ...}, {type: BlockRemoved}?], dp}. */
static void encode(struct kvr_fenc *enc, uint64_t batch, uint64_t window, double ts)
{
	bool rm = window && batch >= window;
	uint64_t h[NBLK];
	struct toks tk;
	for (int j = 0; j < PER_BAT; j++)
		tk.t[j] = token_of(batch, j);
	for (int i = 0; i < NBLK; i++)
		h[i] = hash_of(batch, i);
	kvr_fenc_begin(enc, ts, rm ? 2 : 1);
	kvr_fenc_stored(enc, h, NBLK, NULL, BS, block_tokens, &tk);
	if (rm) {
		for (int i = 0; i < NBLK; i++)
			h[i] = hash_of(batch - window, i);
		kvr_fenc_removed(enc, h, NBLK);
	}
	kvr_fenc_end(enc, 0);
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

/* Decodes a payload and applies it through kvr_events_apply on the calling thread: the feed's
 * work minus ZeroMQ and the feed thread (the in-process baselines).  Returns the blocks
 * stored, or -1 on a failure. */
static int64_t apply_inproc(struct kvr_router *r, struct kvr_feed_batch *fb, const void *data,
                            size_t len)
{
	struct kvr_event_block blk[NBLK];
	int64_t stored = 0;
	if (kvr_feed_decode(fb, data, len))
		return -1;
	for (uint32_t k = 0; k < fb->n_ev; k++) {
		const struct kvr_fev *v = &fb->ev[k];
		struct kvr_event ev = {.type = v->type == KVR_FEV_STORED ? KVR_EVENT_STORED
		                                                         : KVR_EVENT_REMOVED};
		if (v->type == KVR_FEV_STORED) {
			for (uint32_t i = 0; i < v->n_hashes && i < NBLK; i++)
				blk[i] = (struct kvr_event_block){
				    .ext_hash = fb->hashes[v->hash_off + i],
				    .tokens = fb->tokens + v->tok_off + i * BS,
				    .n_tokens = BS};
			ev.blocks = blk;
			ev.n_blocks = v->n_hashes < NBLK ? v->n_hashes : NBLK;
			stored += ev.n_blocks;
		} else {
			ev.removed = fb->hashes + v->hash_off;
			ev.n_removed = v->n_hashes;
		}
		if (kvr_events_apply(r, (struct kvr_rank_id){1, 0}, &ev))
			return -1;
	}
	return stored;
}

/* ---------------------------------------------------------------- lag */

/* How batches reach the router in a lag run:
 *   INPROC  the publishing thread decodes and applies (apply_inproc): no ZeroMQ, no feed thread;
 *   ZMQ     a bare SUB thread receives them, no router: the ZeroMQ hop alone (its I/O threads
 *           and the receiver's wake-up), measured publish -> zmq_recv returned;
 *   ZMQ_APPLY  that SUB thread also decodes and applies each (apply_inproc), measured when
 *           kvr_events_apply returns: a subscriber written by hand, without the feed;
 *   FEED    a kvr_feed over loopback TCP. */
enum lag_mode { LAG_INPROC, LAG_ZMQ, LAG_ZMQ_APPLY, LAG_FEED };

struct lag {
	struct kvr_router *r;
	uint64_t n, sample, period, start;
	uint64_t *sent_ns; /* per batch, 0 until sent (atomic) */
	uint64_t *lag_ns;
	uint64_t n_lag, timeouts;
	void *sub, *sub_ctx; /* LAG_ZMQ: in a context of its own, as the feed's */
};

static void sleep_until(uint64_t t)
{
	struct timespec ts = {.tv_sec = (time_t)(t / 1000000000u),
	                      .tv_nsec = (long)(t % 1000000000u)};
	clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
}

/* After sending a sampled batch, the publishing thread itself probes with kvr_route (query
 * only: hash + find_matches) until the batch's 16 blocks are visible: publish -> visible, with
 * no checker thread to wake (on 2 shared cores a separate checker measured its own wake-ups,
 * or, spinning, held a CPU that the feed, its shard and ZeroMQ's I/O threads need).  Probing
 * delays the next sends when visibility takes longer than the period; late_sends says so. */
static uint64_t probe_visible(struct lag *L, uint64_t b, uint64_t t0)
{
	uint32_t tok[PER_BAT];
	struct kvr_request rq;
	kvr_request_init(&rq);
	rq.tokens = tok;
	rq.n_tokens = PER_BAT;
	rq.flags = KVR_ROUTE_QUERY_ONLY;
	for (int j = 0; j < PER_BAT; j++)
		tok[j] = token_of(b, j);
	struct kvr_decision d;
	for (;;) {
		uint64_t t = now_ns();
		if (kvr_route(L->r, &rq, &d) == 0 && d.overlap_blocks == NBLK)
			return t - t0;
		if (t - t0 > 1000000000u) { /* lost: counted, never waited for forever */
			L->timeouts++;
			return t - t0;
		}
		sched_yield();
	}
}

/* LAG_ZMQ's receiver: stamps each batch's arrival against its send. */
static void *bare_sub(void *arg)
{
	struct lag *L = arg;
	uint8_t buf[1 << 16];
	struct kvr_feed_batch fb = {0};
	for (uint64_t got = 0; got < L->n;) {
		uint8_t s[8];
		int len;
		if (zmq_recv(L->sub, buf, sizeof(buf), 0) < 0 || zmq_recv(L->sub, s, 8, 0) != 8 ||
		    (len = zmq_recv(L->sub, buf, sizeof(buf), 0)) < 0)
			break;
		if (L->r && apply_inproc(L->r, &fb, buf, (size_t)len) < 0)
			exit(1);
		uint64_t t = now_ns(), seq = 0;
		for (int i = 0; i < 8; i++)
			seq = seq << 8 | s[i];
		if (seq < L->n)
			L->lag_ns[L->n_lag++] =
			    t - __atomic_load_n(&L->sent_ns[seq], __ATOMIC_ACQUIRE);
		got = seq + 1;
	}
	kvr_feed_batch_fini(&fb);
	return NULL;
}

struct lag_result {
	double p50, p99, p999, achieved;
	uint64_t n, late, timeouts;
};

static void quantiles(struct lag_result *res, uint64_t *v, uint64_t n)
{
	qsort(v, n, sizeof(uint64_t), cmp_u64);
	res->n = n;
	if (!n)
		return;
	res->p50 = (double)v[n / 2];
	res->p99 = (double)v[n * 99 / 100];
	res->p999 = (double)v[n * 999 / 1000];
}

/* The feed's own publish -> applied lag (batch ts to the shard's reply, KVR_H_FEED_LAG_NS):
 * bucket upper bounds, so up to 25 % high. */
static void feed_quantiles(struct lag_result *res, struct kvr_router *r)
{
	uint64_t h[KVR_HIST_BUCKETS], sum;
	kvr_metrics_hist(r->metrics, KVR_H_FEED_LAG_NS, h, &sum);
	res->p50 = (double)kvr_hist_quantile(h, 0.5);
	res->p99 = (double)kvr_hist_quantile(h, 0.99);
	res->p999 = (double)kvr_hist_quantile(h, 0.999);
	res->n = 0;
	for (unsigned i = 0; i < KVR_HIST_BUCKETS; i++)
		res->n += h[i];
}

/* Publishes nb batches at rate through mode.  checked: publish -> visible in find_matches
 * (probe_visible); else the lag is measured where the batch is applied (INPROC: when
 * kvr_events_apply returns on the publishing thread; FEED: the feed's lag histogram; ZMQ:
 * always at the receiver). */
static struct lag_result run_lag(enum lag_mode mode, bool checked, const struct kvr_feed_config *fc,
                                 uint64_t nb, uint64_t rate, uint64_t sample, uint64_t window)
{
	bool bare = mode == LAG_ZMQ || mode == LAG_ZMQ_APPLY;
	struct kvr_router *r = mode == LAG_ZMQ ? NULL : make_router();
	struct kvr_feed *f = NULL;
	void *zctx = NULL, *pub = NULL;
	uint32_t id = 0;
	if (mode != LAG_INPROC)
		zctx =
		    zmq_ctx_new(); /* its I/O thread made now: under --rt it inherits the policy */
	if (mode == LAG_FEED) {
		if (kvr_feed_create(r, fc, &f))
			exit(1);
		pub = make_pub(zctx, f, &id);
	}
	struct lag L = {.r = r,
	                .n = nb,
	                .sample = sample,
	                .period = 1000000000u / rate,
	                .sent_ns = calloc(nb, sizeof(uint64_t)),
	                .lag_ns = calloc(nb + 1, sizeof(uint64_t))};
	pthread_t th;
	bool thread = bare;
	if (bare) {
		pub = zmq_socket(zctx, ZMQ_XPUB);
		L.sub_ctx = zmq_ctx_new();
		L.sub = zmq_socket(L.sub_ctx, ZMQ_SUB);
		int zero = 0;
		zmq_setsockopt(pub, ZMQ_SNDHWM, &zero, sizeof(zero));
		zmq_setsockopt(pub, ZMQ_LINGER, &zero, sizeof(zero));
		zmq_setsockopt(L.sub, ZMQ_LINGER, &zero, sizeof(zero));
		zmq_setsockopt(L.sub, ZMQ_SUBSCRIBE, "", 0);
		char ep[256], s[64];
		size_t len = sizeof(ep);
		if (zmq_bind(pub, "tcp://127.0.0.1:*") ||
		    zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, ep, &len) || zmq_connect(L.sub, ep) ||
		    zmq_recv(pub, s, sizeof(s), 0) < 1)
			exit(1);
	}
	struct kvr_fenc enc;
	kvr_fenc_init(&enc);
	struct kvr_feed_batch fb = {0};
	uint64_t late = 0;
	L.start = now_ns();
	if (thread)
		pthread_create(&th, NULL, bare_sub, &L);
	for (uint64_t b = 0; b < nb; b++) {
		uint64_t due = L.start + b * L.period;
		if (now_ns() < due) /* sleep, not spin: the feed and its shard need the CPUs */
			sleep_until(due);
		if (now_ns() > due + L.period)
			late++;
		encode(&enc, b + (1ull << 32), window, wall_s()); /* other hashes than run 1 */
		uint64_t ts = now_ns();
		__atomic_store_n(&L.sent_ns[b], ts, __ATOMIC_RELEASE);
		if (mode != LAG_INPROC)
			kvr_fenc_send(pub, b, enc.sb.data, enc.sb.size);
		else if (apply_inproc(r, &fb, enc.sb.data, enc.sb.size) < 0)
			exit(1);
		if (b % sample || bare)
			continue;
		if (checked)
			L.lag_ns[L.n_lag++] = probe_visible(&L, b + (1ull << 32), ts);
		else if (mode == LAG_INPROC)
			L.lag_ns[L.n_lag++] = now_ns() - ts;
	}
	struct lag_result res = {.late = late};
	res.achieved = (double)nb / ((double)(now_ns() - L.start) * 1e-9);
	if (thread)
		pthread_join(th, NULL);
	if (mode == LAG_FEED)
		wait_applied(f, id, nb);
	if (mode == LAG_FEED && !checked)
		feed_quantiles(&res, r);
	else
		quantiles(&res, L.lag_ns, L.n_lag);
	res.timeouts = L.timeouts;
	kvr_feed_batch_fini(&fb);
	kvr_fenc_fini(&enc);
	free(L.sent_ns);
	free(L.lag_ns);
	if (pub)
		zmq_close(pub);
	if (L.sub) {
		zmq_close(L.sub);
		zmq_ctx_term(L.sub_ctx);
	}
	kvr_feed_destroy(f);
	if (zctx)
		zmq_ctx_term(zctx);
	kvr_router_destroy(r);
	return res;
}

/* SCHED_FIFO for this thread and every thread it starts from now on (--rt): shows what the
 * path costs when the kernel runs each woken thread at once. */
static void set_rt(bool on)
{
	struct sched_param sp = {.sched_priority = on ? 1 : 0};
	if (pthread_setschedparam(pthread_self(), on ? SCHED_FIFO : SCHED_OTHER, &sp))
		fprintf(stderr, "bench_feed: SCHED_FIFO refused; --rt ignored\n");
}

int main(int argc, char **argv)
{
	uint64_t batches = 40000, window = 4096, lag_batches = 20000, rate = 10000, sample = 4;
	uint64_t spin_us = 0, rt = 0;
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--batches"))
			batches = opt_u64(argc, argv, i, 0, 100000000);
		else if (!strcmp(argv[i], "--window"))
			window = opt_u64(argc, argv, i, 1, 1u << 20);
		else if (!strcmp(argv[i], "--lag-batches"))
			lag_batches = opt_u64(argc, argv, i, 0, 100000000);
		else if (!strcmp(argv[i], "--rate"))
			rate = opt_u64(argc, argv, i, 1, 1000000000);
		else if (!strcmp(argv[i], "--sample"))
			sample = opt_u64(argc, argv, i, 1, 1000000000);
		else if (!strcmp(argv[i], "--spin-us"))
			spin_us = opt_u64(argc, argv, i, 0, 1000000000);
		else if (!strcmp(argv[i], "--rt"))
			rt = opt_u64(argc, argv, i, 0, 99);
		else
			opt_unknown(argv, i);
	}
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.rcv_hwm = 1u << 30;
	fc.idle_spin_ns = spin_us * 1000;
	if (batches) {
		/* Pre-encode the throughput run's payloads. */
		msgpack_sbuffer *pl = calloc(batches, sizeof(*pl));
		struct kvr_fenc enc;
		kvr_fenc_init(&enc);
		for (uint64_t b = 0; b < batches; b++) {
			encode(&enc, b, window, wall_s());
			msgpack_sbuffer_init(&pl[b]);
			msgpack_sbuffer_write(&pl[b], enc.sb.data, enc.sb.size);
		}
		kvr_fenc_fini(&enc);
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
		t0 = now_ns();
		for (uint64_t b = 0; b < batches; b++)
			if (apply_inproc(r, &fb, pl[b].data, pl[b].size) < 0) {
				fprintf(stderr, "apply\n");
				return 1;
			}
		double direct_bps = (double)blocks / ((double)(now_ns() - t0) * 1e-9);
		kvr_router_destroy(r);
		kvr_feed_batch_fini(&fb);

		/* The feed over loopback TCP. */
		r = make_router();
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
			kvr_fenc_send(pub, b, pl[b].data, pl[b].size);
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
		printf("SUMMARY bench=feed_throughput batches=%" PRIu64 " blocks_per_batch=%d "
		       "feed_blocks_per_s=%.0f direct_apply_blocks_per_s=%.0f "
		       "decode_only_blocks_per_s=%.0f ratio_feed_vs_direct=%.3f "
		       "target_blocks_per_s=1000000 %s\n",
		       batches, NBLK, feed_bps, direct_bps, decode_bps, feed_bps / direct_bps,
		       feed_bps >= 1e6 ? "PASS" : "BELOW_TARGET");
		for (uint64_t b = 0; b < batches; b++)
			msgpack_sbuffer_destroy(&pl[b]);
		free(pl);
		zmq_close(pub);
		kvr_feed_destroy(f);
		zmq_ctx_term(zctx);
		kvr_router_destroy(r);
	}
	if (!lag_batches)
		return 0;

	/* Lag at a fixed rate, every mode in this run (the machine's load is the same for all):
	 * publish -> visible (probed) through the feed and in process; publish -> applied
	 * without probing; the bare ZeroMQ hop. */
	if (rt)
		set_rt(true);
	struct lag_result fl = run_lag(LAG_FEED, true, &fc, lag_batches, rate, sample, window);
	struct lag_result base = run_lag(LAG_INPROC, true, &fc, lag_batches, rate, sample, window);
	struct lag_result fa = run_lag(LAG_FEED, false, &fc, lag_batches, rate, sample, window);
	struct lag_result ba = run_lag(LAG_INPROC, false, &fc, lag_batches, rate, sample, window);
	struct lag_result zq = run_lag(LAG_ZMQ, false, &fc, lag_batches, rate, sample, window);
	struct lag_result za =
	    run_lag(LAG_ZMQ_APPLY, false, &fc, lag_batches, rate, sample, window);
	if (rt)
		set_rt(false);
	printf("SUMMARY bench=feed_lag rate=%" PRIu64 " spin_us=%" PRIu64 " rt=%" PRIu64
	       " achieved_rate=%.0f late_sends=%" PRIu64 " samples=%" PRIu64 " timeouts=%" PRIu64
	       " p50_us=%.1f p99_us=%.1f p999_us=%.1f inproc_p50_us=%.1f inproc_p99_us=%.1f"
	       " applied_p50_us=%.1f applied_p99_us=%.1f inproc_applied_p50_us=%.1f"
	       " inproc_applied_p99_us=%.1f zmq_hop_p50_us=%.1f zmq_hop_p99_us=%.1f"
	       " zmq_apply_p50_us=%.1f zmq_apply_p99_us=%.1f"
	       " ratio_p99_vs_inproc=%.3f target_p99_us=200 %s\n",
	       rate, spin_us, rt, fl.achieved, fl.late, fl.n, fl.timeouts + base.timeouts,
	       fl.p50 / 1e3, fl.p99 / 1e3, fl.p999 / 1e3, base.p50 / 1e3, base.p99 / 1e3,
	       fa.p50 / 1e3, fa.p99 / 1e3, ba.p50 / 1e3, ba.p99 / 1e3, zq.p50 / 1e3, zq.p99 / 1e3,
	       za.p50 / 1e3, za.p99 / 1e3, fl.p99 / (base.p99 > 0 ? base.p99 : 1),
	       fl.p99 <= 200000 ? "PASS" : "ABOVE_TARGET");
	return 0;
}
