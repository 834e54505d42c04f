/* A feed destroyed while it waits for a replay that does not come.
 *
 * A gap makes the feed's thread ask the publisher's replay endpoint and wait for the answer,
 * replay_timeout_ms at most, serving nothing else.  kvr_feed_destroy (and kvr_router_destroy,
 * which stops the feeds still alive) waited that whole time for the thread: a second at the
 * default, and as long as the embedder configured (20 s here).  Now the wait gives up as soon
 * as a destroy waits for it.  Each destroy must return within 8 s.  What the abandoned replay did
 * not bring is no gap: the feed is going away, it missed nothing of the publisher's, so nothing
 * is reported through on_event_gap or counted, and no rank is cleared for it (before, it was
 * taken as at a timeout: the gap reported, the rank cleared; for the resync's replay too). */
#include <criterion/criterion.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
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
