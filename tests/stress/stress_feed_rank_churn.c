/*
 * stress_feed_rank_churn - ranks removed and added back under a running feed with a replay
 * endpoint.  A publisher thread plays RANKS vLLM workers (one XPUB and one replay ROUTER each,
 * every batch kept for replay from seq 0): each batch stores a chain of 3 root blocks and one
 * block below it, removes the chain stored WINDOW batches before, and every CLEAR_EVERY-th
 * batch is an AllBlocksCleared.  Meanwhile an admin thread removes a random rank and adds it
 * back (at once, or after a few ms), routing threads call kvr_route on the stored prompts, and
 * a replay thread answers the feed's replay requests.
 *
 * The feed rebuilds a rank added back by replay from where what the index held of it began;
 * at the end (the admin stopped with every rank present, the publisher quiet after a few more
 * batches per rank, the feed caught up) every rank's index must equal what its engine holds
 * (the publisher's model), with no gap reported, nothing malformed, no restart.
 *
 * SFC_QUIET=1: the publisher goes quiet and the feed takes all it sent; then the admin removes
 * and adds ranks back for 100 ms more: a rank added back then gets no batch, and nothing is in
 * flight, that would tell the feed its removal took its blocks; only the add does
 * (kvr_rank_add wakes the router's feeds).  SFC_DEBUG=1: the feed's log and the replay requests
 * on stderr.  SFC_ROUTER_HWM=1: the replay ROUTERs keep ZeroMQ's default send bound (1,000), as
 * vLLM's publisher does, past which a ROUTER drops: long answers then have holes, or lose their
 * tail, which the feed asks for again (sync/feed_seq.c, replay()); before, they were reported as
 * gaps, or the feed's thread waited out the replay timeout for a dropped end marker.
 *
 * Run under TSan (no race) and ASan (no leak) in CI.
 * Plain program: exit 0 pass, 1 fail, 77 skip (built without zmq).  argv[1]: duration, ms.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/mono_clock.h"
#include "tests/common/splitmix.h"
#include "tests/common/vllm_batch.h"

#define RANKS       3
#define WINDOW      24    /* a chain is removed this many batches after it was stored */
#define CLEAR_EVERY 700   /* every this-many-th batch clears the worker's cache */
#define MAXB        16384 /* batches a worker keeps (and so publishes at most) */
#define CHAIN       4     /* blocks a batch stores: 3 roots in one event, 1 below them */

static struct kvr_router *R;
static struct kvr_feed *F;

struct worker {
	void *pub, *rep; /* pub: the publisher thread's; rep: the replay thread's */
	char ep[256], rep_ep[256];
	uint32_t id;             /* the endpoint's id in F */
	struct kvr_fenc *enc;    /* batch seq i, immutable once n > i */
	atomic_size_t n;         /* batches published (in enc before sent) */
	bool *held;              /* the model: batch i's chain held by the engine (publisher's) */
	atomic_int replays;      /* replay requests answered */
	atomic_size_t max_reply; /* most batches one answer carried */
};
static struct worker W[RANKS];

static atomic_bool pub_stop, admin_stop, route_stop, replay_stop;
static atomic_int gap_calls, failures;
static atomic_long removes, routed, overlapped;

static uint64_t hash_of(uint32_t rank, uint64_t b, int i)
{
	return 0x4000000000000000ull | (uint64_t)rank << 52 | b << 4 | (uint64_t)i;
}

static void chain_of(uint32_t rank, uint64_t b, uint64_t h[CHAIN])
{
	for (int i = 0; i < CHAIN; i++)
		h[i] = hash_of(rank, b, i);
}

static void fail(const char *what, int rc)
{
	if (atomic_fetch_add(&failures, 1) < 8)
		fprintf(stderr, "stress_feed_rank_churn: %s: %s\n", what, kvr_strerror(rc));
}

/* Batch b of worker r into its enc[b], the model updated as the engine would. */
static void encode(uint32_t r, uint64_t b)
{
	struct worker *w = &W[r];
	struct kvr_fenc *e = &w->enc[b];
	kvr_fenc_init(e);
	if (b % CLEAR_EVERY == CLEAR_EVERY - 1) {
		kvr_fenc_begin(e, 1.0, 1);
		kvr_fenc_cleared(e);
		memset(w->held, 0, b * sizeof(*w->held));
		kvr_fenc_end(e, 0);
		return;
	}
	uint64_t h[CHAIN], old[CHAIN];
	chain_of(r, b, h);
	bool rm = b >= WINDOW && w->held[b - WINDOW];
	kvr_fenc_begin(e, 1.0, rm ? 3 : 2);
	kvr_fenc_stored(e, h, CHAIN - 1, NULL, TEST_BLOCK_TOKENS, test_block_tokens, h);
	kvr_fenc_stored(e, &h[CHAIN - 1], 1, &h[CHAIN - 2], TEST_BLOCK_TOKENS, test_block_tokens,
	                &h[CHAIN - 1]);
	w->held[b] = true;
	if (rm) {
		chain_of(r, b - WINDOW, old);
		uint64_t rev[CHAIN]; /* leaves first, as vLLM evicts */
		for (int i = 0; i < CHAIN; i++)
			rev[i] = old[CHAIN - 1 - i];
		kvr_fenc_removed(e, rev, CHAIN);
		w->held[b - WINDOW] = false;
	}
	kvr_fenc_end(e, 0);
}

static void *publisher(void *arg)
{
	(void)arg;
	for (uint64_t b = 0; b < MAXB && !atomic_load(&pub_stop); b++) {
		for (uint32_t r = 0; r < RANKS; r++) {
			struct worker *w = &W[r];
			encode(r, b);
			atomic_store(&w->n, b + 1); /* replayable before it goes out */
			if (kvr_fenc_send(w->pub, b, w->enc[b].sb.data, w->enc[b].sb.size))
				fail("publisher send", KVR_EINVAL);
		}
		usleep(200);
	}
	return NULL;
}

static void be64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* Answers ["", start] on each worker's ROUTER with every batch published from start on, then
 * the end marker (seq UINT64_MAX, empty payload), as vLLM's replay does. */
static void *replayer(void *arg)
{
	(void)arg;
	zmq_pollitem_t it[RANKS];
	for (uint32_t r = 0; r < RANKS; r++)
		it[r] = (zmq_pollitem_t){.socket = W[r].rep, .events = ZMQ_POLLIN};
	while (!atomic_load(&replay_stop)) {
		if (zmq_poll(it, RANKS, 10) <= 0)
			continue;
		for (uint32_t r = 0; r < RANKS; r++) {
			if (!(it[r].revents & ZMQ_POLLIN))
				continue;
			struct worker *w = &W[r];
			zmq_msg_t id;
			zmq_msg_init(&id);
			uint8_t empty[8], start[8];
			if (zmq_msg_recv(&id, w->rep, 0) < 0 ||
			    zmq_recv(w->rep, empty, 8, 0) != 0 ||
			    zmq_recv(w->rep, start, 8, 0) != 8) {
				zmq_msg_close(&id);
				continue;
			}
			uint64_t from = 0;
			for (int i = 0; i < 8; i++)
				from = from << 8 | start[i];
			size_t n = atomic_load(&w->n);
			if (getenv("SFC_DEBUG"))
				fprintf(stderr, "replay r%u from %" PRIu64 " n %zu\n", r, from, n);
			for (uint64_t q = from; q <= n; q++) {
				zmq_msg_t to;
				zmq_msg_init(&to);
				zmq_msg_copy(&to, &id);
				zmq_msg_send(&to, w->rep, ZMQ_SNDMORE);
				uint8_t s[8];
				be64(s, q < n ? q : UINT64_MAX);
				zmq_send(w->rep, "", 0, ZMQ_SNDMORE);
				zmq_send(w->rep, s, 8, ZMQ_SNDMORE);
				if (q < n)
					zmq_send(w->rep, w->enc[q].sb.data, w->enc[q].sb.size, 0);
				else
					zmq_send(w->rep, "", 0, 0);
			}
			zmq_msg_close(&id);
			atomic_fetch_add(&w->replays, 1);
			if (n > from && n - from > atomic_load(&w->max_reply))
				atomic_store(&w->max_reply, n - from);
		}
	}
	return NULL;
}

static void nap_us(uint64_t us)
{
	struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
	nanosleep(&ts, NULL);
}

/* Removes a random rank and adds it back: at once (the feed may see nothing of either), or
 * after up to 3 ms (its batches meanwhile are for no rank); then waits up to 4 ms.  Every rank
 * is present whenever this thread is between two rounds. */
static void *admin(void *arg)
{
	uint64_t seed = (uintptr_t)arg;
	while (!atomic_load(&admin_stop)) {
		uint64_t x = splitmix64(&seed);
		struct kvr_rank_id id = {(uint32_t)(x % RANKS), 0};
		int rc = kvr_rank_remove(R, id);
		if (rc)
			fail("kvr_rank_remove", rc);
		atomic_fetch_add(&removes, 1);
		if (x >> 8 & 1)
			nap_us((x >> 16) % 3000);
		if ((rc = kvr_rank_add(R, id, 1, KVR_CAPACITY_NONE, 0)))
			fail("kvr_rank_add", rc);
		nap_us((x >> 32) % 4000);
	}
	return NULL;
}

/* Routes the prompt of a recent chain of a random worker, and ends the attempt. */
static void *router_user(void *arg)
{
	uint64_t seed = (uintptr_t)arg;
	uint32_t tokens[CHAIN * TEST_BLOCK_TOKENS];
	while (!atomic_load(&route_stop)) {
		uint64_t x = splitmix64(&seed);
		uint32_t r = (uint32_t)(x % RANKS);
		size_t n = atomic_load(&W[r].n);
		uint64_t b = n > 4 ? n - 1 - (x >> 8) % (n < WINDOW ? n : WINDOW) : 0;
		uint64_t h[CHAIN];
		chain_of(r, b, h);
		for (int i = 0; i < CHAIN; i++)
			memcpy(&tokens[i * TEST_BLOCK_TOKENS], test_block_tokens(h, (size_t)i),
			       sizeof(uint32_t) * TEST_BLOCK_TOKENS);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tokens;
		q.n_tokens = CHAIN * TEST_BLOCK_TOKENS;
		q.request_id = x;
		struct kvr_decision d;
		int rc = kvr_route(R, &q, &d);
		if (rc == KVR_EAGAIN ||
		    rc == KVR_ENOENT) { /* overloaded; every rank gone at once */
			nap_us(100);
			continue;
		}
		if (rc || d.status != KVR_DECIDED) {
			fail("kvr_route", rc ? rc : KVR_EINVAL);
			continue;
		}
		atomic_fetch_add(&routed, 1);
		if (d.overlap_blocks)
			atomic_fetch_add(&overlapped, 1);
		/* KVR_ESTALE: the rank was removed since (its attempts went with it). */
		if ((rc = kvr_request_finish(R, d.attempt)) && rc != KVR_ESTALE)
			fail("kvr_request_finish", rc);
	}
	return NULL;
}

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx;
	if (atomic_fetch_add(&gap_calls, 1) < 8)
		fprintf(stderr,
		        "stress_feed_rank_churn: gap reported for rank (%" PRIu64 ", %u): %" PRIu64
		        "..%" PRIu64 "\n",
		        worker, dp, from, to);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx;
	fprintf(stderr, "feed log %d: %s\n", level, msg);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* What the engine of worker r holds, sorted, into *out (n returned). */
static size_t model_blocks(uint32_t r, uint64_t **out)
{
	struct worker *w = &W[r];
	size_t n = atomic_load(&w->n), k = 0;
	uint64_t *v = malloc((n * CHAIN + 1) * sizeof(*v));
	for (size_t b = 0; b < n; b++)
		if (w->held[b])
			for (int i = 0; i < CHAIN; i++)
				v[k++] = hash_of(r, b, i);
	qsort(v, k, sizeof(*v), cmp_u64);
	*out = v;
	return k;
}

/* Whether rank r's index equals its engine's blocks now; *got, *want: their counts. */
static bool rank_matches(uint32_t r, size_t *got, size_t *want)
{
	uint64_t *m;
	*want = model_blocks(r, &m);
	size_t n = 0;
	struct kvr_rank_id id = {r, 0};
	bool ok = false;
	int rc = kvr_router_sync(R, 1000);
	if (rc == 0 && ((rc = kvr_rank_blocks(R, id, NULL, 0, &n)) == 0 || rc == KVR_ERANGE)) {
		uint64_t *v = malloc((n + 1) * sizeof(*v));
		if (kvr_rank_blocks(R, id, v, n, &n) == 0) {
			qsort(v, n, sizeof(*v), cmp_u64);
			ok = n == *want && !memcmp(v, m, n * sizeof(*v));
		}
		free(v);
	}
	*got = n;
	free(m);
	return ok;
}

/* Rank r's endpoint stats once the feed took every batch published and the index equals the
 * engine (a resync of a rank added back may still be replaying), or after a minute and 30 s. */
static struct kvr_feed_stats caught_up(uint32_t r)
{
	struct kvr_feed_stats st = {0};
	size_t n = atomic_load(&W[r].n), got, want;
	uint64_t end = now_ms() + 60000;
	while (now_ms() < end && kvr_feed_get_stats(F, W[r].id, &st) == 0 && st.next_seq < n)
		usleep(1000);
	for (end = now_ms() + 30000; !rank_matches(r, &got, &want) && now_ms() < end;)
		usleep(5000);
	return st;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 1500;
	const char *quiet_env = getenv("SFC_QUIET");
	bool quiet = quiet_env && *quiet_env == '1';
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.mode = KVR_MODE_EVENTS;
	cfg.block_size = TEST_BLOCK_TOKENS;
	cfg.n_shards = 2;
	cfg.on_event_gap = on_gap;
	if (kvr_router_create(&cfg, &R))
		return 1;
	for (uint32_t r = 0; r < RANKS; r++)
		if (kvr_rank_add(R, (struct kvr_rank_id){r, 0}, 1, KVR_CAPACITY_NONE, 0))
			return 1;
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = 60000; /* a replay under TSan on a loaded machine is no gap */
	if (getenv("SFC_DEBUG"))
		fc.log = on_log;
	int rc = kvr_feed_create(R, &fc, &F);
	if (rc == KVR_ENOTSUP) {
		kvr_router_destroy(R);
		return 77;
	}
	if (rc)
		return 1;
	void *zctx = zmq_ctx_new();
	for (uint32_t r = 0; r < RANKS; r++) {
		struct worker *w = &W[r];
		w->enc = calloc(MAXB, sizeof(*w->enc));
		w->held = calloc(MAXB, sizeof(*w->held));
		if (!w->enc || !w->held || test_xpub_open(zctx, &w->pub, w->ep, sizeof(w->ep)))
			return 1;
		int zero = 0;
		zmq_setsockopt(w->pub, ZMQ_LINGER, &zero, sizeof(zero));
		w->rep = zmq_socket(zctx, ZMQ_ROUTER);
		size_t cap = sizeof(w->rep_ep);
		/* No send high-water mark: a ROUTER drops what goes past it, and an answer of
		 * thousands of batches would then have holes (asked for again: SFC_ROUTER_HWM). */
		if (!w->rep || zmq_setsockopt(w->rep, ZMQ_LINGER, &zero, sizeof(zero)) ||
		    (!getenv("SFC_ROUTER_HWM") &&
		     zmq_setsockopt(w->rep, ZMQ_SNDHWM, &zero, sizeof(zero))) ||
		    zmq_bind(w->rep, "tcp://127.0.0.1:*") ||
		    zmq_getsockopt(w->rep, ZMQ_LAST_ENDPOINT, w->rep_ep, &cap))
			return 1;
		struct kvr_feed_endpoint e = {
		    .endpoint = w->ep, .replay_endpoint = w->rep_ep, .worker_id = r, .dp_rank = 0};
		if (kvr_feed_add(F, &e, &w->id))
			return 1;
		char sub[64];
		if (zmq_recv(w->pub, sub, sizeof(sub), 0) < 1) /* the feed subscribed */
			return 1;
	}
	pthread_t pt, rt, at, ut[2];
	pthread_create(&rt, NULL, replayer, NULL);
	pthread_create(&pt, NULL, publisher, NULL);
	pthread_create(&at, NULL, admin, (void *)(uintptr_t)now_ms());
	for (int i = 0; i < 2; i++)
		pthread_create(&ut[i], NULL, router_user, (void *)(uintptr_t)(now_ms() * 31 + i));
	usleep((useconds_t)(ms * 1000));
	/* The admin stops (every rank present). */
	atomic_store(&admin_stop, true);
	pthread_join(at, NULL);
	if (quiet) {
		/* The publisher quiet, and the feed through with everything it sent; then ranks
		 * removed and added back for 100 ms with no batch after. */
		atomic_store(&pub_stop, true);
		pthread_join(pt, NULL);
		for (uint32_t r = 0; r < RANKS; r++)
			caught_up(r);
		atomic_store(&admin_stop, false);
		pthread_create(&at, NULL, admin, (void *)(uintptr_t)(now_ms() * 7));
		usleep(100000);
		atomic_store(&admin_stop, true);
		pthread_join(at, NULL);
	} else {
		/* A few more batches for every rank, so that each rank's last removal shows in a
		 * batch after it. */
		size_t n0 = atomic_load(&W[RANKS - 1].n);
		for (uint64_t end = now_ms() + 60000;
		     atomic_load(&W[RANKS - 1].n) < n0 + 8 && n0 + 8 <= MAXB && now_ms() < end;)
			usleep(1000);
		atomic_store(&pub_stop, true);
		pthread_join(pt, NULL);
	}
	atomic_store(&route_stop, true);
	for (int i = 0; i < 2; i++)
		pthread_join(ut[i], NULL);

	int bad = atomic_load(&failures) ? 1 : 0;
	uint64_t total = 0;
	for (uint32_t r = 0; r < RANKS; r++) {
		struct worker *w = &W[r];
		size_t n = atomic_load(&w->n), got = 0, want = 0;
		total += n;
		struct kvr_feed_stats st = caught_up(r);
		bool ok = rank_matches(r, &got, &want);
		if (!ok || st.next_seq != n || st.malformed || st.gaps || st.restarts ||
		    st.duplicates || st.lost) {
			fprintf(stderr,
			        "stress_feed_rank_churn: rank %u: index %zu blocks, engine %zu; "
			        "next_seq "
			        "%" PRIu64 " of %zu, malformed %" PRIu64 ", gaps %" PRIu64
			        ", restarts %" PRIu64 ", duplicates %" PRIu64 ", lost %" PRIu64
			        "\n",
			        r, got, want, st.next_seq, n, st.malformed, st.gaps, st.restarts,
			        st.duplicates, st.lost);
			bad = 1;
		}
		printf("stress_feed_rank_churn: rank %u: %zu batches, %zu blocks held, %" PRIu64
		       " refused, %" PRIu64 " unknown-rank batches, %d replays (longest %zu "
		       "batches, %" PRIu64 " asked again), %" PRIu64 " replayed batches\n",
		       r, n, want, st.refused, st.unknown_rank, atomic_load(&w->replays),
		       atomic_load(&w->max_reply), st.reasks, st.replayed_batches);
	}
	if (atomic_load(&gap_calls))
		bad = 1;
	kvr_feed_destroy(F);
	kvr_router_destroy(R);
	atomic_store(&replay_stop, true);
	pthread_join(rt, NULL);
	for (uint32_t r = 0; r < RANKS; r++) {
		struct worker *w = &W[r];
		zmq_close(w->pub);
		zmq_close(w->rep);
		for (size_t b = 0; b < atomic_load(&w->n); b++)
			kvr_fenc_fini(&w->enc[b]);
		free(w->enc);
		free(w->held);
	}
	zmq_ctx_term(zctx);
	printf("stress_feed_rank_churn: %" PRIu64 " batches on %d ranks, %ld removes and adds, %ld "
	       "routed (%ld with an overlap), %d gaps: %s\n",
	       total, RANKS, atomic_load(&removes), atomic_load(&routed), atomic_load(&overlapped),
	       atomic_load(&gap_calls), bad ? "FAILED" : "index == engine");
	return bad;
}
