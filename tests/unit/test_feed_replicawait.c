/* A feed's callback waiting for a replica (kvr_replica_drain, as kvr_sync_drain) while that
 * replica's apply thread, in on_admit, calls the feed API on the same feed.  The call waits for
 * the feed's loop, i.e. for the callback, which waits for the apply thread: before, each waited
 * for the other until the drain's timeout (5 s here: the drain returned KVR_ETIMEDOUT, then the
 * call went through).  Now whichever of the two waits comes second is refused with KVR_EBUSY at
 * once (sync/feed.c, "A feed's callback waiting for a replica"), and the other goes on: the
 * drain returns 0 once on_admit returned, or the call is answered once the callback returned.
 * Both orders are tried; which one happens is up to the scheduler, so each test takes either. */
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

static struct kvr_feed *xfeed;
static atomic_int admit_in, log_in, admit_out, log_out;
static bool drain_first; /* the order the test asks for (a hint to the scheduler) */
static int drain_rc = 1, call_rc = 1;
static uint64_t drain_ns, call_ns;
static char call_detail[256];

static void on_admit_calls_feed(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket, (void)d;
	if (atomic_exchange(&admit_in, 1))
		return;
	for (int t = 0; t < 1000 && !atomic_load(&log_in); t++)
		sleep_ms(10);
	if (drain_first)
		sleep_ms(200); /* the feed's callback into its drain */
	struct kvr_feed_stats st;
	uint64_t t0 = mono_ns();
	call_rc = kvr_feed_get_stats(xfeed, KVR_FEED_ALL, &st);
	call_ns = mono_ns() - t0;
	snprintf(call_detail, sizeof(call_detail), "%s", kvr_last_error());
	atomic_store(&admit_out, 1);
}

static bool stop_instead; /* the log stops the replica (as kvr_sync_detach) instead */

static void on_log_drains(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	if (atomic_exchange(&log_in, 1))
		return;
	for (int t = 0; t < 1000 && !atomic_load(&admit_in); t++)
		sleep_ms(10);
	if (!drain_first)
		sleep_ms(200); /* on_admit into its call */
	uint64_t t0 = mono_ns();
	if (stop_instead) {
		kvr_replica_stop(bus.rep[1]);
		drain_rc = 0;
	} else {
		drain_rc = kvr_replica_drain(bus.rep[1], 5000);
	}
	drain_ns = mono_ns() - t0;
	atomic_store(&log_out, 1);
}

/* Replicas A and B on the bus (B's request waiting behind A's), an events router with a feed
 * whose log drains or stops (stop) B: B's apply thread goes into on_admit (A's finish) while the
 * feed's thread is in its log (a gap), log_first hinting which of the two waits comes first. */
struct rig {
	struct kvr_router *r[2], *ev;
	struct test_pub pub;
};

static void rig_run(struct rig *g, bool log_first, bool stop)
{
	drain_first = log_first;
	stop_instead = stop;
	bus_hog_pair(g->r, on_admit_calls_feed);
	g->ev = test_events_router(NULL);
	test_pub_open(&g->pub);
	xfeed = test_feed_on(g->ev, &g->pub, 0, on_log_drains, NULL);
	uint64_t hog = bus_hog(g->r);
	test_pub_send_empty(&g->pub, 0, 0);
	test_pub_send_empty(&g->pub, 5, 0);
	cr_assert_eq(kvr_request_finish(g->r[0], hog), 0);
	cr_assert(came_back(&admit_out), "on_admit's call on the feed never returned");
	cr_assert(came_back(&log_out), "the feed's log (its %s) never returned",
	          stop ? "stop" : "drain");
	cr_log_info("%s first %d: %s %d after %lu ms, call %d after %lu ms",
	            stop ? "stop" : "drain", drain_first, stop ? "stop" : "drain", drain_rc,
	            (unsigned long)(drain_ns / 1000000), call_rc,
	            (unsigned long)(call_ns / 1000000));
	cr_assert_lt(call_ns, 2000000000ull, "the call took %lu ms (%d)",
	             (unsigned long)(call_ns / 1000000), call_rc);
	if (call_rc == KVR_EBUSY)
		cr_assert(strstr(call_detail, "kvr_feed_get_stats: ") == call_detail &&
		              strstr(call_detail, "replica"),
		          "detail \"%s\"", call_detail);
}

/* Everything goes, from the test's thread; quiet: the bus drained first (both replicas up). */
static void rig_close(struct rig *g, bool quiet)
{
	kvr_feed_destroy(xfeed);
	kvr_router_destroy(g->ev);
	test_pub_close(&g->pub);
	if (quiet)
		bus_quiet(g->r, 2);
	bus_teardown(g->r, 2);
}

static void drain_against_call(bool drain_goes_first)
{
	struct rig g;
	rig_run(&g, drain_goes_first, false);
	cr_assert_lt(drain_ns, 2000000000ull, "the drain took %lu ms (%d)",
	             (unsigned long)(drain_ns / 1000000), drain_rc);
	cr_assert((drain_rc == KVR_EBUSY) != (call_rc == KVR_EBUSY),
	          "one of the two is refused: drain %d, call %d", drain_rc, call_rc);
	cr_assert_eq(drain_rc == KVR_EBUSY ? call_rc : drain_rc, 0);
	/* Both go on. */
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(xfeed, 0, &st), 0);
	cr_assert_eq(st.gaps, 1);
	cr_assert_eq(kvr_replica_drain(bus.rep[1], 5000), 0);
	rig_close(&g, true);
}

Test(feed_replicawait, drain_from_a_feed_log_then_on_admit_calls_the_feed, .timeout = 60)
{
	drain_against_call(true);
}

Test(feed_replicawait, on_admit_calls_the_feed_then_its_log_drains, .timeout = 60)
{
	drain_against_call(false);
}

/* The feed's log stops replica B (kvr_replica_stop, which kvr_sync_detach begins with) while
 * B's apply thread, in on_admit, calls the feed.  The stop joins the apply thread, which waits
 * for the feed's loop, i.e. for the log: before, both waited for good.  Now a stop that finds
 * the apply thread waiting in a call on the feed does nothing (it returns at once), and one that
 * comes first makes that call KVR_EBUSY and stops the replica. */
static void stop_against_call(bool stop_goes_first)
{
	struct rig g;
	rig_run(&g, stop_goes_first, true);
	cr_assert(call_rc == 0 || call_rc == KVR_EBUSY, "the call returned %d", call_rc);
	if (call_rc == 0) /* the stop found the call waiting and did nothing: it returned at once */
		cr_assert_lt(drain_ns, 2000000000ull, "the stop took %lu ms",
		             (unsigned long)(drain_ns / 1000000));
	/* Stopped or not, B's replica goes down from this thread, and everything is freed. */
	rig_close(&g, false);
}

Test(feed_replicawait, stop_from_a_feed_log_then_on_admit_calls_the_feed, .timeout = 60)
{
	stop_against_call(true);
}

Test(feed_replicawait, on_admit_calls_the_feed_then_its_log_stops_the_replica, .timeout = 60)
{
	stop_against_call(false);
}
