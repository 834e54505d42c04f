/* A cycle of waits through a replica and two feeds.  Feed F's log drains (or stops) replica B;
 * B's apply thread, in on_admit, calls feed G (kvr_feed_get_stats: it waits for G's loop); G's
 * log calls F (it waits for F's thread, which serves nothing while it waits for B).  Each waits
 * for the next: before, the drain waited out its timeout (5 s here) and the stop joined B's
 * apply thread for good.  test_feed_replicawait has the cycle of two (B calls F itself).  Now
 * whichever of the three waits closes the cycle is refused with KVR_EBUSY at once (sync/feed.c,
 * "A feed's callback waiting for a replica"), and the other two go on.  Each order is hinted
 * to the scheduler (the last of the three sleeps longest before it waits); the checks take any
 * order. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "tests/common/feed_pub.h"
#include "tests/common/mono_clock.h"
#include "tests/common/pinned_router.h"
#include "tests/common/router_prompts.h"
#include "tests/unit/bus_hog.h"
#include "tests/unit/replica_bus.h"

enum who { DRAIN, B_CALL, G_CALL, N_WHO };

static struct kvr_feed *feed_f, *feed_g;
static atomic_int in[N_WHO], out[N_WHO];
static int rc[N_WHO];
static uint64_t took_ns[N_WHO];
static char detail[N_WHO][256];
static enum who last;     /* the wait the test hints to come last */
static bool stop_instead; /* F's log stops B (as kvr_sync_detach) instead of draining it */

/* Enters the wait `me` once the other two are in their callbacks, the hinted last one 300 ms
 * after them, the middle one 150 ms after the first. */
static bool enter(enum who me)
{
	if (atomic_exchange(&in[me], 1))
		return false;
	for (int t = 0; t < 1000; t++) {
		bool all = true;
		for (int i = 0; i < N_WHO; i++)
			all = all && atomic_load(&in[i]);
		if (all)
			break;
		sleep_ms(10);
	}
	int rank = me == last ? 2 : (me == (last + 1) % N_WHO ? 0 : 1);
	sleep_ms(150 * rank);
	return true;
}

static void leave(enum who me, int code, uint64_t t0)
{
	rc[me] = code;
	took_ns[me] = mono_ns() - t0;
	snprintf(detail[me], sizeof(detail[me]), "%s", code ? kvr_last_error() : "");
	atomic_store(&out[me], 1);
}

/* B's on_admit (its apply thread): a call on G. */
static void on_admit_calls_g(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket, (void)d;
	if (!enter(B_CALL))
		return;
	struct kvr_feed_stats st;
	uint64_t t0 = mono_ns();
	leave(B_CALL, kvr_feed_get_stats(feed_g, KVR_FEED_ALL, &st), t0);
}

/* G's log: a call on F. */
static void on_log_g_calls_f(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	if (!enter(G_CALL))
		return;
	struct kvr_feed_stats st;
	uint64_t t0 = mono_ns();
	leave(G_CALL, kvr_feed_get_stats(feed_f, KVR_FEED_ALL, &st), t0);
}

/* F's log: a drain (or stop) of B. */
static void on_log_f_waits_b(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	if (!enter(DRAIN))
		return;
	uint64_t t0 = mono_ns();
	if (stop_instead) {
		kvr_replica_stop(bus.rep[1]);
		leave(DRAIN, 0, t0);
	} else {
		leave(DRAIN, kvr_replica_drain(bus.rep[1], 5000), t0);
	}
}

static const char *const names[N_WHO] = {"F's wait for B", "B's call on G", "G's call on F"};

static void cycle(enum who hinted_last, bool stop)
{
	last = hinted_last;
	stop_instead = stop;
	for (int i = 0; i < N_WHO; i++) {
		atomic_store(&in[i], 0);
		atomic_store(&out[i], 0);
		rc[i] = 1;
	}
	struct kvr_router *r[2];
	bus_hog_pair(r, on_admit_calls_g);
	struct kvr_router *ev_f = test_events_router(NULL), *ev_g = test_events_router(NULL);
	struct test_pub pub_f, pub_g;
	test_pub_open(&pub_f);
	test_pub_open(&pub_g);
	feed_f = test_feed_on(ev_f, &pub_f, 0, on_log_f_waits_b, NULL);
	feed_g = test_feed_on(ev_g, &pub_g, 0, on_log_g_calls_f, NULL);
	uint64_t hog = bus_hog(r);
	/* A gap on each feed: each logs it. */
	test_pub_send_empty(&pub_f, 0, 0);
	test_pub_send_empty(&pub_f, 5, 0);
	test_pub_send_empty(&pub_g, 0, 0);
	test_pub_send_empty(&pub_g, 5, 0);
	cr_assert_eq(kvr_request_finish(r[0], hog), 0); /* B's on_admit */
	for (int i = 0; i < N_WHO; i++)
		cr_assert(came_back(&out[i]), "%s never returned", names[i]);
	int refused = 0;
	for (int i = 0; i < N_WHO; i++) {
		cr_log_info("%s %s last: %s %d after %lu ms%s%s", stop ? "stop" : "drain",
		            names[hinted_last], names[i], rc[i],
		            (unsigned long)(took_ns[i] / 1000000), rc[i] ? ": " : "", detail[i]);
		cr_assert(rc[i] == 0 || rc[i] == KVR_EBUSY, "%s returned %d", names[i], rc[i]);
		refused += rc[i] == KVR_EBUSY;
		/* (the replica core's drain, which the bus drives, sets no detail; kvr_sync_drain
		 * does) */
		if (rc[i] == KVR_EBUSY && i != DRAIN)
			cr_assert(strstr(detail[i], "cycle") && strstr(detail[i], "replica"),
			          "%s: detail \"%s\"", names[i], detail[i]);
	}
	/* A stop refused does nothing and reports nothing (rc 0): then B's call went through,
	 * and G's too. */
	cr_assert(refused >= 1 || stop, "one of the three is refused");
	cr_assert(took_ns[DRAIN] < 2000000000ull, "%s took %lu ms", names[DRAIN],
	          (unsigned long)(took_ns[DRAIN] / 1000000));
	cr_assert(took_ns[G_CALL] < 2000000000ull, "%s took %lu ms", names[G_CALL],
	          (unsigned long)(took_ns[G_CALL] / 1000000));
	/* The feeds go on: each serves an ordinary call. */
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(feed_f, pub_f.id, &st), 0);
	cr_assert_eq(st.gaps, 1);
	cr_assert_eq(kvr_feed_get_stats(feed_g, pub_g.id, &st), 0);
	cr_assert_eq(st.gaps, 1);
	if (!stop)
		cr_assert_eq(kvr_replica_drain(bus.rep[1], 5000), 0);
	kvr_feed_destroy(feed_f);
	kvr_feed_destroy(feed_g);
	kvr_router_destroy(ev_f);
	kvr_router_destroy(ev_g);
	test_pub_close(&pub_f);
	test_pub_close(&pub_g);
	if (!stop)
		bus_quiet(r, 2);
	bus_teardown(r, 2);
}

Test(feed_replicacycle, drain_closes_it, .timeout = 60)
{
	cycle(DRAIN, false);
}

Test(feed_replicacycle, replica_call_closes_it, .timeout = 60)
{
	cycle(B_CALL, false);
}

Test(feed_replicacycle, feed_call_closes_it, .timeout = 60)
{
	cycle(G_CALL, false);
}

Test(feed_replicacycle, stop_closes_it, .timeout = 60)
{
	cycle(DRAIN, true);
}

Test(feed_replicacycle, replica_call_closes_it_against_a_stop, .timeout = 60)
{
	cycle(B_CALL, true);
}

Test(feed_replicacycle, feed_call_closes_it_against_a_stop, .timeout = 60)
{
	cycle(G_CALL, true);
}
