/* kvr_feed_destroy called on one feed from a thread the library runs for something else: another
 * feed's callbacks, a replica's apply thread (on_admit), a shard (the clock).  Before, it posted
 * its stop to the target feed's thread and joined it, so two feeds whose callbacks destroyed
 * each other waited for each other for good (each feed thread waited in the other's join), and a
 * feed thread's callback waiting for the replica whose apply thread destroyed the feed waited out
 * its whole timeout.  Now such a destroy marks the feed, wakes its thread and returns; the feed's
 * thread tears itself down (as after a destroy from its own callback), and kvr_router_destroy
 * waits for it.  Each test checks that the feeds' threads go away and, via the library's live
 * bytes, that nothing leaks.  (The same under ThreadSanitizer: stress_feed_crossdestroy.) */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/runtime.h"
#include "sync/rcu.h"
#include "tests/common/feed_pub.h"
#include "tests/common/mono_clock.h"
#include "tests/common/pinned_router.h"
#include "tests/common/router_prompts.h"
#include "tests/unit/bus_hog.h"
#include "tests/unit/replica_bus.h"

/* Waits up to 10 s for the process to be back to at most n threads. */
static void threads_back_to(int n)
{
	int now = 0;
	for (int t = 0; t < 1000 && (now = test_n_threads()) > n; t++)
		sleep_ms(10);
	cr_assert_leq(now, n, "threads: %d, %d before the feeds", now, n);
}

/* Waits (thread-exit destructors) for the library's live bytes to be back to live0. */
static void live_back_to(int64_t live0)
{
	kvr_rcu_barrier();
	int64_t live = kvr_alloc_live_bytes();
	for (int t = 0; t < 500 && live != live0; t++) {
		sleep_ms(10);
		live = kvr_alloc_live_bytes();
	}
	cr_assert_eq(live, live0, "live bytes %ld, %ld before", (long)live, (long)live0);
}

/* A feed on r for worker w fed by pub, logging to log with ctx. */
/* ---------------------------------------------------------------- feed against feed */

static struct kvr_feed *feeds[2];
static atomic_int entered[2], returned[2];
static int mutual; /* 1: each destroys the other; 0: feed 0 destroys feed 1 */

/* Feed i's log: on its first call (the gap below), once both feeds are inside their logs (so
 * that each thread is busy in its callback when the other's destroy comes), destroys the other
 * feed. */
static void on_log_other(void *ctx, int level, const char *msg)
{
	(void)level, (void)msg;
	int i = (int)(intptr_t)ctx;
	if (atomic_exchange(&entered[i], 1))
		return;
	if (!mutual && i == 1)
		return;
	for (int t = 0; mutual && t < 1000 && !atomic_load(&entered[1 - i]); t++)
		sleep_ms(10);
	kvr_feed_destroy(feeds[1 - i]);
	atomic_store(&returned[i], 1);
}

static void feed_destroys_feed(int both)
{
	mutual = both;
	for (int i = 0; i < 2; i++) {
		atomic_store(&entered[i], 0);
		atomic_store(&returned[i], 0);
	}
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	struct kvr_router *r = test_events_router(NULL);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	struct test_pub pub[2];
	for (int i = 0; i < 2; i++)
		test_pub_open(&pub[i]);
	int threads0 = test_n_threads();
	for (int i = 0; i < 2; i++)
		feeds[i] = test_feed_on(r, &pub[i], (uint64_t)i, on_log_other, (void *)(intptr_t)i);
	for (int i = 0; i < 2; i++) {
		test_pub_send_empty(&pub[i], 0, 0);
		test_pub_send_empty(&pub[i], 5, 0); /* a gap: logged */
	}
	for (int i = 0; i < (both ? 2 : 1); i++)
		cr_assert(came_back(&returned[i]), "feed %d's destroy of feed %d never returned", i,
		          1 - i);
	if (!both) {
		/* Feed 0 goes on: another gap is reported (and logged, not destroying again). */
		test_pub_send_empty(&pub[0], 9, 0);
		struct kvr_feed_stats st;
		for (int t = 0; t < 1000; t++) {
			cr_assert_eq(kvr_feed_get_stats(feeds[0], KVR_FEED_ALL, &st), 0);
			if (st.gaps == 2)
				break;
			sleep_ms(10);
		}
		cr_assert_eq(st.gaps, 2, "feed 0 after destroying feed 1: %lu gaps",
		             (unsigned long)st.gaps);
		kvr_feed_destroy(feeds[0]);
	}
	threads_back_to(threads0);
	kvr_router_destroy(r);
	for (int i = 0; i < 2; i++)
		test_pub_close(&pub[i]);
	live_back_to(live0);
}

Test(feed_crossdestroy, feeds_destroy_each_other_from_their_logs, .timeout = 60)
{
	feed_destroys_feed(1);
}

Test(feed_crossdestroy, feed_destroys_another_from_its_log, .timeout = 60)
{
	feed_destroys_feed(0);
}

/* The same with the router destroyed at once after the callbacks returned: it waits for both
 * feeds' teardowns (feeds_closing). */
Test(feed_crossdestroy, router_destroy_right_after_the_feeds_destroyed_each_other, .timeout = 60)
{
	mutual = 1;
	for (int i = 0; i < 2; i++) {
		atomic_store(&entered[i], 0);
		atomic_store(&returned[i], 0);
	}
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	struct kvr_router *r = test_events_router(NULL);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	struct test_pub pub[2];
	for (int i = 0; i < 2; i++)
		test_pub_open(&pub[i]);
	for (int i = 0; i < 2; i++)
		feeds[i] = test_feed_on(r, &pub[i], (uint64_t)i, on_log_other, (void *)(intptr_t)i);
	for (int i = 0; i < 2; i++) {
		test_pub_send_empty(&pub[i], 0, 0);
		test_pub_send_empty(&pub[i], 5, 0);
	}
	for (int i = 0; i < 2; i++)
		cr_assert(came_back(&returned[i]));
	kvr_router_destroy(r);
	for (int i = 0; i < 2; i++)
		test_pub_close(&pub[i]);
	live_back_to(live0);
}

/* ---------------------------------------------------------------- a replica's apply thread */

/* Replica B's apply thread runs on_admit (a peer's finish freed room for B's queued request),
 * which destroys the feed; meanwhile the feed's thread, in its log, drains B (waits until B's
 * apply thread has applied what B received, the message running on_admit included).  Before,
 * the destroy waited for the feed's thread and the drain for the apply thread: the drain ran out
 * its 5 s (KVR_ETIMEDOUT) before either went on. */
static struct kvr_feed *xfeed;
static atomic_int admit_in, log_in, admit_out, log_out;
static int xdrain_rc = 1;
static uint64_t xdrain_ns;

static void on_admit_destroy_feed(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket, (void)d;
	if (atomic_exchange(&admit_in, 1))
		return;
	for (int t = 0; t < 1000 && !atomic_load(&log_in); t++)
		sleep_ms(10);
	kvr_feed_destroy(xfeed);
	atomic_store(&admit_out, 1);
}

static void on_log_drain(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	if (atomic_exchange(&log_in, 1))
		return;
	for (int t = 0; t < 1000 && !atomic_load(&admit_in); t++)
		sleep_ms(10);
	uint64_t t0 = mono_ns();
	xdrain_rc = kvr_replica_drain(bus.rep[1], 5000);
	xdrain_ns = mono_ns() - t0;
	atomic_store(&log_out, 1);
}

Test(feed_crossdestroy, feed_destroyed_from_on_admit_on_a_replica_apply_thread, .timeout = 60)
{
	/* This thread's routing scratch (core/route.c, kept until the thread exits) first. */
	struct kvr_router *warm = queue_router(NULL);
	struct kvr_decision d0;
	cr_assert_eq(route_pinned(warm, 9, 64, &d0), 0);
	kvr_router_destroy(warm);
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	struct kvr_router *r[2];
	bus_hog_pair(r, on_admit_destroy_feed);
	struct kvr_router *ev = test_events_router(NULL);
	struct test_pub pub;
	test_pub_open(&pub);
	int threads0 = test_n_threads();
	xfeed = test_feed_on(ev, &pub, 0, on_log_drain, NULL);
	uint64_t hog = bus_hog(r);
	/* The feed's thread into its log (a gap), B's apply thread into on_admit (A's finish). */
	test_pub_send_empty(&pub, 0, 0);
	test_pub_send_empty(&pub, 5, 0);
	cr_assert_eq(kvr_request_finish(r[0], hog), 0);
	cr_assert(came_back(&admit_out), "kvr_feed_destroy from on_admit never returned");
	cr_assert(came_back(&log_out), "the feed's log never returned");
	cr_assert_eq(xdrain_rc, 0, "drain from the feed's log: %d after %lu ms", xdrain_rc,
	             (unsigned long)(xdrain_ns / 1000000));
	cr_assert_lt(xdrain_ns, 2000000000ull, "drain took %lu ms",
	             (unsigned long)(xdrain_ns / 1000000));
	threads_back_to(threads0);
	kvr_router_destroy(ev);
	test_pub_close(&pub);
	bus_quiet(r, 2);
	bus_teardown(r, 2);
	live_back_to(live0);
}

/* ---------------------------------------------------------------- a shard thread */

/* The clock of the feed's own router, on one of its shard threads, destroys the feed.  Before,
 * the destroy waited for the feed's thread, which (were a batch of its in flight to that very
 * shard) settled what it had posted first. */
static struct kvr_feed *sfeed;
static atomic_int armed, shard_out;

static uint64_t shard_clock(void *ctx)
{
	(void)ctx;
	if (kvr_shard_current() && atomic_exchange(&armed, 0)) {
		kvr_feed_destroy(sfeed);
		atomic_store(&shard_out, 1);
	}
	return mono_ns();
}

Test(feed_crossdestroy, feed_destroyed_from_the_clock_on_a_shard, .timeout = 60)
{
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.now_ns = shard_clock;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, X, 1, KVR_CAPACITY_NONE, 0), 0);
	struct test_pub pub;
	test_pub_open(&pub);
	int threads0 = test_n_threads();
	sfeed = test_feed_on(r, &pub, 0, NULL, NULL);
	atomic_store(&armed, 1);
	test_pub_send_empty(&pub, 0, 0); /* the feed's post wakes the shard */
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	cr_assert(came_back(&shard_out), "kvr_feed_destroy on a shard never returned");
	threads_back_to(threads0);
	kvr_router_destroy(r);
	test_pub_close(&pub);
	live_back_to(live0);
}
