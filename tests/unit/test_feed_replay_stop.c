/* A feed destroyed while it waits for a replay that does not come.
 *
 * A gap makes the feed's thread ask the publisher's replay endpoint and wait for the answer,
 * replay_timeout_ms at most, serving nothing else.  kvr_feed_destroy (and kvr_router_destroy,
 * which stops the feeds still alive) waited that whole time for the thread: a second at the
 * default, and as long as the embedder configured (20 s here).  Now the wait gives up as soon
 * as a destroy waits for it.  Each destroy must return within 8 s.  What the abandoned replay did
 * not bring is no gap: the feed is going away, it missed nothing of the publisher's, so nothing
 * is reported through on_event_gap or counted (before, it was taken as at a timeout: the gap
 * reported, the rank cleared; for the resync's replay too).  A rank the replay left short of
 * the publisher is cleared all the same, unreported ("what a destroy leaves", below). */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/feed_replayer.h"
#include "tests/common/realtime_shift.h"

static double mono_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int gaps;
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx, (void)worker, (void)dp, (void)expected, (void)got;
	__atomic_add_fetch(&gaps, 1, __ATOMIC_RELAXED);
}

static uint32_t ep_id; /* feed_in_a_replay's endpoint */

/* A feed on r whose replay endpoint takes requests and never answers, waiting for one. */
static struct kvr_feed *feed_in_a_replay(struct kvr_router *r, struct test_pub *pub, void **mute,
                                         uint32_t timeout_ms)
{
	*mute = zmq_socket(pub->zctx, ZMQ_ROUTER);
	cr_assert_not_null(*mute);
	cr_assert_eq(zmq_bind(*mute, "tcp://127.0.0.1:*"), 0);
	char rep[256];
	size_t cap = sizeof(rep);
	cr_assert_eq(zmq_getsockopt(*mute, ZMQ_LAST_ENDPOINT, rep, &cap), 0);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = timeout_ms;
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, &fc, &f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = pub->ep, .replay_endpoint = rep, .worker_id = 0};
	cr_assert_eq(kvr_feed_add(f, &fe, &ep_id), 0);
	test_pub_subscribed(pub);
	test_pub_send_empty(pub, 0, 0);
	test_pub_send_empty(pub, 5, 0); /* a gap: the feed asks the mute endpoint */
	/* The request reached the mute endpoint: the feed's thread now waits for its answer. */
	zmq_msg_t m;
	zmq_msg_init(&m);
	cr_assert_geq(zmq_msg_recv(&m, *mute, 0), 0);
	zmq_msg_close(&m);
	return f;
}

Test(feed_replay_stop, destroy_ends_a_replay_wait, .timeout = 60)
{
	for (int how = 0; how < 2; how++) { /* 0: kvr_feed_destroy; 1: the router first */
		gaps = 0;
		struct test_pub pub;
		test_pub_open(&pub);
		struct kvr_router *r = test_events_router(on_gap);
		void *mute;
		struct kvr_feed *f = feed_in_a_replay(r, &pub, &mute, 20000);
		double t0 = mono_ms();
		if (how == 0)
			kvr_feed_destroy(f);
		else
			kvr_router_destroy(r);
		double took = mono_ms() - t0;
		cr_expect_lt(took, 8000, "%s waited %.0f ms for the replay",
		             how ? "kvr_router_destroy" : "kvr_feed_destroy", took);
		cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 0,
		             "%s: a gap reported for a replay the destroy ended",
		             how ? "kvr_router_destroy" : "kvr_feed_destroy");
		if (how == 0)
			kvr_router_destroy(r);
		else
			kvr_feed_destroy(f);
		zmq_close(mute);
		test_pub_close(&pub);
	}
}

/* The replay's wait is timed on the monotonic clock: the wall clock stepped back during it (NTP,
 * `date -s`, a VM resumed) stretched it by the step, the feed's thread serving nothing (no other
 * endpoint, no kvr_feed_get_stats) for as long: 15.3 s here for a 300 ms timeout. */
Test(feed_replay_stop, a_wall_clock_step_does_not_stretch_the_wait, .timeout = 60)
{
	gaps = 0;
	struct test_pub pub;
	test_pub_open(&pub);
	struct kvr_router *r = test_events_router(on_gap);
	void *mute;
	struct kvr_feed *f = feed_in_a_replay(r, &pub, &mute, 300);
	atomic_store(&kvr_test_realtime_shift_ns, -15ll * 1000000000ll);
	double t0 = mono_ms();
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(f, ep_id, &st), 0); /* served once the replay gave up */
	double took = mono_ms() - t0;
	atomic_store(&kvr_test_realtime_shift_ns, 0);
	cr_expect_lt(took, 5000, "the stats waited %.0f ms behind a 300 ms replay", took);
	cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 1, "the gap is reported");
	kvr_feed_destroy(f);
	kvr_router_destroy(r);
	zmq_close(mute);
	test_pub_close(&pub);
}

/* The resync's replay (a rank added after its batches went by) interrupted by a destroy: the
 * feed is going away, not missing batches, so nothing is reported.  Before, the replay's
 * abandonment was taken for a hole: on_event_gap called for the rank, the gap counted. */
Test(feed_replay_stop, destroy_during_a_resync_reports_no_gap, .timeout = 60)
{
	for (int how = 0; how < 2; how++) { /* 0: kvr_feed_destroy; 1: the router first */
		gaps = 0;
		struct test_replayer t; /* its ROUTER never answers; rank (0, 0) not there yet */
		test_replayer_open(&t, on_gap, 20000, NULL);
		for (uint64_t s = 0; s < 3; s++)
			test_pub_send_empty(&t.pub, s, 0);
		test_replayer_feed_at(&t, 3);
		cr_assert_eq(kvr_rank_add(t.r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0),
		             0);
		uint64_t from; /* the resync's request: the feed's thread waits for its answer */
		cr_assert(test_replayer_next_ask(&t, 5000, &from));
		if (how == 0)
			kvr_feed_destroy(t.f);
		else
			kvr_router_destroy(t.r);
		cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 0,
		             "%s: a gap reported for a replay the destroy ended",
		             how ? "kvr_router_destroy" : "kvr_feed_destroy");
		if (how == 0)
			kvr_router_destroy(t.r);
		else
			kvr_feed_destroy(t.f);
		zmq_msg_close(&t.asker);
		zmq_close(t.router);
		test_pub_close(&t.pub);
	}
}

/* ---------------------------------------------------------------- what a destroy leaves
 *
 * A replay a destroy ends may leave the index behind what the publisher had sent: a gap being
 * healed (the feed saw a batch past the one it expected) or a rank added late being rebuilt,
 * when the batches it needed did not all come.  The feed is going away, so no later event will
 * bring those batches' removals: the rank must not keep a block the engine removed in them.
 * Before, it was left as the replay had left it (blocks the engine removed stayed credited for
 * good in events mode, which has no TTL).  Destroyed from the test's thread once the feed asked
 * again (so it has read the first answer), and from the feed's own log at a bad reply that the
 * test sends after the batches (the feed's thread tears itself down: the test waits for that).
 * Nothing is reported either way: the feed missed nothing of the publisher's. */

static const uint64_t A[2] = {0xa1, 0xa2}, B[3] = {0xb1, 0xb2, 0xb3}, C[1] = {0xc1}, D[1] = {0xd1};

/* The feed destroyed by its own log at the bad replay reply (NULL: none). */
static struct kvr_feed *destroy_at_bad_reply;
static void log_destroys(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level;
	struct kvr_feed *f = __atomic_load_n(&destroy_at_bad_reply, __ATOMIC_ACQUIRE);
	if (f && strstr(msg, "bad replay reply")) {
		__atomic_store_n(&destroy_at_bad_reply, NULL, __ATOMIC_RELAXED);
		kvr_feed_destroy(f);
	}
}

/* A GPU BlockStored of h[0..n) (one root chain) or a BlockRemoved of them, for dp rank 0. */
static void batch(struct kvr_fenc *enc, bool store, const uint64_t *h, size_t n)
{
	kvr_fenc_init(enc);
	kvr_fenc_begin(enc, 1.0, 1);
	if (store)
		kvr_fenc_stored(enc, h, n, NULL, TEST_BLOCK_TOKENS, test_block_tokens, (void *)h);
	else
		kvr_fenc_removed(enc, h, n);
	kvr_fenc_end(enc, 0);
}

static void send_batch(struct test_replayer *t, uint64_t seq, const struct kvr_fenc *enc)
{
	test_pub_send(&t->pub, seq, (const uint8_t *)enc->sb.data, enc->sb.size);
}

static void answer_batch(struct test_replayer *t, uint64_t seq, const struct kvr_fenc *enc)
{
	test_replayer_answer(t, seq, enc->sb.data, enc->sb.size);
}

/* A reply the feed skips as malformed (two frames): its log says "bad replay reply". */
static void answer_bad(struct test_replayer *t)
{
	zmq_msg_t id;
	zmq_msg_init(&id);
	zmq_msg_copy(&id, &t->asker);
	cr_assert_geq(zmq_msg_send(&id, t->router, ZMQ_SNDMORE), 0);
	zmq_send(t->router, "", 0, ZMQ_SNDMORE);
	zmq_send(t->router, "x", 1, 0);
}

static void expect_ask(struct test_replayer *t, uint64_t from)
{
	uint64_t got = UINT64_MAX;
	cr_assert(test_replayer_next_ask(t, 5000, &got), "the feed asks from seq %llu",
	          (unsigned long long)from);
	cr_assert_eq(got, from, "asked from seq %llu, not %llu", (unsigned long long)got,
	             (unsigned long long)from);
}

/* How a test ends the replay the feed waits in: how 0, kvr_feed_destroy from this thread once
 * the feed asked again from again_from (it has read the answer so far); how 1, from the feed's
 * own log at a bad reply sent right after the answer's batches (before the answer can go quiet
 * and be asked again), then waits until the feed's thread has torn down (threads fewer than
 * threads0, taken before: what the feed posted is applied before any of its threads ends). */
struct ending {
	int how;
	int threads0;
};

static struct ending arm(struct test_replayer *t, int how)
{
	struct ending x = {.how = how, .threads0 = test_n_threads()};
	if (how == 1)
		__atomic_store_n(&destroy_at_bad_reply, t->f, __ATOMIC_RELEASE);
	return x;
}

static void destroy_mid_replay(struct test_replayer *t, struct ending x, uint64_t again_from)
{
	if (x.how == 0) {
		expect_ask(t, again_from);
		kvr_feed_destroy(t->f);
		return;
	}
	answer_bad(t);
	int n = x.threads0;
	for (int k = 0; k < 1000 && (n = test_n_threads()) >= x.threads0; k++)
		sleep_ms(10);
	cr_assert_lt(n, x.threads0, "the feed destroyed from its log never tore down");
}

/* Whether rank (0, 0) holds hash h. */
static bool holds(struct kvr_router *r, uint64_t h)
{
	uint64_t out[64];
	size_t n = 0;
	cr_assert_eq(kvr_router_sync(r, 1000), 0);
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, out, 64, &n), 0);
	for (size_t i = 0; i < n; i++)
		if (out[i] == h)
			return true;
	return false;
}

static void expect_only(struct kvr_router *r, const uint64_t *ok, size_t n_ok, const char *what)
{
	uint64_t out[64];
	size_t n = 0;
	cr_assert_eq(kvr_router_sync(r, 1000), 0);
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, out, 64, &n), 0);
	for (size_t i = 0; i < n; i++) {
		bool in = false;
		for (size_t k = 0; k < n_ok; k++)
			in |= out[i] == ok[k];
		cr_expect(in, "%s: the rank holds %#llx, which its engine does not", what,
		          (unsigned long long)out[i]);
	}
}

static void close_replayer(struct test_replayer *t)
{
	kvr_router_destroy(t->r);
	zmq_msg_close(&t->asker);
	zmq_close(t->router);
	test_pub_close(&t->pub);
}

/* The engine: seq 0 stores A, 1 stores B, 2 stores C, 3 removes A, 4 stores D; it holds B, C,
 * D.  The feed takes 0 and 1, then 4 live (2 and 3 lost): a gap, healed by replay from 2. */
struct heal {
	struct test_replayer t;
	struct kvr_fenc enc[5];
};

static void heal_open(struct heal *w, void (*log)(void *, int, const char *))
{
	gaps = 0;
	test_replayer_open(&w->t, on_gap, 20000, log);
	cr_assert_eq(kvr_rank_add(w->t.r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	batch(&w->enc[0], true, A, 2);
	batch(&w->enc[1], true, B, 3);
	batch(&w->enc[2], true, C, 1);
	batch(&w->enc[3], false, A, 2);
	batch(&w->enc[4], true, D, 1);
	send_batch(&w->t, 0, &w->enc[0]);
	send_batch(&w->t, 1, &w->enc[1]);
	test_replayer_feed_at(&w->t, 2);
	cr_assert(holds(w->t.r, A[0]) && holds(w->t.r, B[0]));
	send_batch(&w->t, 4, &w->enc[4]);
	expect_ask(&w->t, 2);
}

static void heal_close(struct heal *w)
{
	close_replayer(&w->t);
	for (int i = 0; i < 5; i++)
		kvr_fenc_fini(&w->enc[i]);
}

Test(feed_replay_stop, a_heal_a_destroy_ends_leaves_no_removed_block, .timeout = 60)
{
	static const uint64_t engine[] = {0xb1, 0xb2, 0xb3, 0xc1, 0xd1};
	for (int how = 0; how < 2; how++) {
		struct heal w;
		heal_open(&w, log_destroys);
		struct ending x = arm(&w.t, how);
		answer_batch(&w.t, 2, &w.enc[2]); /* then not seq 3, which removes A */
		destroy_mid_replay(&w.t, x, 3);
		cr_expect(!holds(w.t.r, A[0]) && !holds(w.t.r, A[1]),
		          "%s: the rank keeps A, which the engine removed in a batch the destroyed "
		          "feed never applied",
		          how ? "from the log" : "kvr_feed_destroy");
		expect_only(w.t.r, engine, 5, how ? "from the log" : "kvr_feed_destroy");
		cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 0, "no gap reported");
		heal_close(&w);
	}
}

/* A replay that brought every batch the gap lacked when the destroy ended its wait (for the end
 * marker) left nothing missed: the rank is kept, with the live batch that showed the gap.
 * Before, that batch was dropped.  (From the log only: the test's own destroy could come after
 * the answer's quiet ended the wait anyway.) */
Test(feed_replay_stop, a_heal_that_brought_everything_keeps_the_rank, .timeout = 60)
{
	struct heal w;
	heal_open(&w, log_destroys);
	struct ending x = arm(&w.t, 1);
	answer_batch(&w.t, 2, &w.enc[2]);
	answer_batch(&w.t, 3, &w.enc[3]);
	destroy_mid_replay(&w.t, x, 0);
	cr_expect(!holds(w.t.r, A[0]), "A was removed by seq 3");
	cr_expect(holds(w.t.r, B[0]) && holds(w.t.r, C[0]), "the rank is not cleared");
	cr_expect(holds(w.t.r, D[0]), "seq 4, the live batch in hand, is applied");
	cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 0, "no gap reported");
	heal_close(&w);
}

/* The publisher sends seq 0..2 (the engine stores A, removes A, stores B), the feed sees them
 * for a rank the router does not have, the rank is added and the feed asks for a replay from
 * seq 0: the ending `how` armed, the answer still to give. */
static struct ending late_rank_resync(struct test_replayer *t, struct kvr_fenc enc[3], int how)
{
	gaps = 0;
	test_replayer_open(t, on_gap, 20000, log_destroys);
	batch(&enc[0], true, A, 2);
	batch(&enc[1], false, A, 2);
	batch(&enc[2], true, B, 3);
	for (uint64_t s = 0; s < 3; s++)
		send_batch(t, s, &enc[s]);
	test_replayer_feed_at(t, 3); /* seen, for a rank the router does not have */
	cr_assert_eq(kvr_rank_add(t->r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	expect_ask(t, 0);
	return arm(t, how);
}

/* A rank added late, rebuilt by replay from seq 0: the engine stores A (0), removes A (1),
 * stores B (2); it holds B.  The answer brings seq 0 only, then the destroy: the half-rebuilt
 * rank held A. */
Test(feed_replay_stop, a_resync_a_destroy_ends_leaves_no_removed_block, .timeout = 60)
{
	static const uint64_t engine[] = {0xb1, 0xb2, 0xb3};
	for (int how = 0; how < 2; how++) {
		struct test_replayer t;
		struct kvr_fenc enc[3];
		struct ending x = late_rank_resync(&t, enc, how);
		answer_batch(&t, 0, &enc[0]);
		destroy_mid_replay(&t, x, 1);
		cr_expect(!holds(t.r, A[0]) && !holds(t.r, A[1]),
		          "%s: the half-rebuilt rank keeps A, which the engine removed in seq 1",
		          how ? "from the log" : "kvr_feed_destroy");
		expect_only(t.r, engine, 3, how ? "from the log" : "kvr_feed_destroy");
		cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 0, "no gap reported");
		close_replayer(&t);
		for (int i = 0; i < 3; i++)
			kvr_fenc_fini(&enc[i]);
	}
}

/* The same resync whose answer brought seq 0..2 before the destroy: rebuilt whole, kept. */
Test(feed_replay_stop, a_resync_that_brought_everything_keeps_the_rank, .timeout = 60)
{
	struct test_replayer t;
	struct kvr_fenc enc[3];
	struct ending x = late_rank_resync(&t, enc, 1);
	for (uint64_t s = 0; s < 3; s++)
		answer_batch(&t, s, &enc[s]);
	destroy_mid_replay(&t, x, 0);
	cr_expect(!holds(t.r, A[0]), "A was removed by seq 1");
	cr_expect(holds(t.r, B[0]) && holds(t.r, B[2]), "the rebuilt rank is kept");
	cr_expect_eq(__atomic_load_n(&gaps, __ATOMIC_RELAXED), 0, "no gap reported");
	close_replayer(&t);
	for (int i = 0; i < 3; i++)
		kvr_fenc_fini(&enc[i]);
}
