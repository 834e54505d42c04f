/* The KV event feed's API called from the callbacks the feed thread runs: the router's
 * on_event_gap for a gap the feed reports, and the feed's log.  kvrouter.h forbids neither, and
 * an embedder reacting to a gap naturally looks at the feed's counters.  Such a call posted its
 * command to the feed thread and waited for the answer, on the feed thread itself: the feed
 * stopped for good (and every later call on it, kvr_feed_destroy included, waited behind it).
 * Now reads answer at once there, and add / remove return KVR_EBUSY. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/rcu.h"
#include "tests/common/feed_pub.h"

static struct kvr_feed *feed;
static atomic_int gap_done, log_done;
static int gap_stats_rc = 1, gap_remove_rc = 1, gap_other_rc = 1, log_stats_rc = 1;
static uint64_t gap_seen_gaps;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	struct kvr_feed_stats st;
	gap_stats_rc = kvr_feed_get_stats(feed, KVR_FEED_ALL, &st);
	gap_seen_gaps = st.gaps;
	size_t n;
	gap_other_rc = kvr_feed_other_medium_blocks(feed, 0, 0, NULL, 0, &n);
	gap_remove_rc = kvr_feed_remove(feed, 0);
	atomic_store(&gap_done, 1);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	struct kvr_feed_stats st;
	log_stats_rc = kvr_feed_get_stats(feed, 0, &st);
	atomic_store(&log_done, 1);
}

Test(feed_callbacks, feed_calls_from_its_callbacks, .timeout = 60)
{
	struct kvr_router *r = test_events_router(on_gap);
	struct test_pub pub;
	test_pub_open(&pub);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log;
	cr_assert_eq(kvr_feed_create(r, &fc, &feed), 0);
	struct kvr_feed_endpoint fe = {.endpoint = pub.ep, .worker_id = 0, .dp_rank = 0};
	uint32_t id;
	cr_assert_eq(kvr_feed_add(feed, &fe, &id), 0);
	cr_assert_eq(id, 0);
	test_pub_subscribed(&pub);
	test_pub_send_empty(&pub, 0, 0);
	test_pub_send_empty(&pub, 5, 0); /* 1..4 lost, no replay endpoint */
	cr_assert(came_back(&gap_done), "on_event_gap's kvr_feed_get_stats never returned");
	cr_assert_eq(gap_stats_rc, 0);
	cr_assert_eq(gap_other_rc, 0);
	cr_assert_eq(gap_remove_rc, KVR_EBUSY, "remove from the feed's own thread: %d",
	             gap_remove_rc);
	cr_assert(came_back(&log_done), "the log callback's kvr_feed_get_stats never returned");
	cr_assert_eq(log_stats_rc, 0);
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(feed, id, &st), 0, "the feed still answers");
	cr_assert_eq(st.gaps, 1);
	cr_assert_eq(st.batches, 2);
	cr_assert_eq(kvr_feed_remove(feed, id), 0);
	kvr_feed_destroy(feed);
	test_pub_close(&pub);
	kvr_router_destroy(r);
}

/* kvr_feed_destroy from the feed's own callbacks.  Before, it posted its stop to the feed thread
 * (KVR_EBUSY there, ignored), then joined its own thread (EDEADLK, ignored) and freed the feed,
 * its sockets and its ZeroMQ context under the callback's caller: a crash or a hang in
 * zmq_ctx_term.  Now the call marks the feed and returns; the thread frees everything once the
 * callback returned, and calls the log no more.  No leak: the library's live bytes come back to
 * what they were before the router (kvr_router_destroy waits for the feed's teardown). */
static atomic_int destroyed, destroy_returned, log_after;
static int destroy_from; /* 1: the gap callback, 2: the log */

static void destroy_here(void)
{
	if (atomic_load(&destroyed))
		return;
	atomic_store(&destroyed, 1);
	kvr_feed_destroy(feed);
	kvr_feed_destroy(feed); /* a second call meanwhile: a no-op */
	atomic_store(&destroy_returned, 1);
}

static void on_gap_destroy(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	if (destroy_from == 1)
		destroy_here();
}

static void on_log_destroy(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	if (atomic_load(&destroyed))
		atomic_fetch_add(&log_after, 1);
	if (destroy_from == 2)
		destroy_here();
}

static void destroy_from_callback(int from)
{
	destroy_from = from;
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	struct kvr_router *r = test_events_router(on_gap_destroy);
	struct test_pub pub;
	test_pub_open(&pub);
	int threads0 = test_n_threads();
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log_destroy;
	cr_assert_eq(kvr_feed_create(r, &fc, &feed), 0);
	struct kvr_feed_endpoint fe = {.endpoint = pub.ep, .worker_id = 0, .dp_rank = 0};
	cr_assert_eq(kvr_feed_add(feed, &fe, NULL), 0);
	test_pub_subscribed(&pub);
	test_pub_send_empty(&pub, 0, 0);
	test_pub_send_empty(&pub, 5, 0); /* a gap: logged, and on_event_gap */
	cr_assert(came_back(&destroy_returned), "kvr_feed_destroy from a callback never returned");
	/* The feed's thread (and ZeroMQ's, with its context) goes away by itself. */
	int n = 0;
	for (int t = 0; t < 1000 && (n = test_n_threads()) > threads0; t++) {
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_leq(n, threads0, "threads: %d, %d before the feed", n, threads0);
	test_pub_send_empty(&pub, 9, 0); /* nobody listens: nothing logged */
	cr_assert_eq(atomic_load(&log_after), 0, "the log was called after kvr_feed_destroy");
	kvr_router_destroy(r);
	test_pub_close(&pub);
	kvr_rcu_barrier();
	int64_t live = kvr_alloc_live_bytes();
	for (int t = 0; t < 500 && live != live0; t++) { /* thread-exit destructors */
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
		live = kvr_alloc_live_bytes();
	}
	cr_assert_eq(live, live0, "live bytes %ld, %ld before", (long)live, (long)live0);
}

Test(feed_callbacks, feed_destroy_from_on_event_gap, .timeout = 60)
{
	destroy_from_callback(1);
}

Test(feed_callbacks, feed_destroy_from_its_log, .timeout = 60)
{
	destroy_from_callback(2);
}
