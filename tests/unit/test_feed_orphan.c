/* A KV event feed still alive when its router is destroyed.
 *
 * kvrouter.h asks for the feeds to be destroyed first; a program that got the order wrong (a
 * shutdown path that destroys the router, then its feeds) read the freed router in
 * kvr_feed_destroy (ASan: heap-use-after-free in kvr_fork_inherited), and the feed's thread
 * kept posting to shards that were gone.  kvr_router_destroy now stops such feeds and releases
 * all they hold, as their own destroy would, but the handle: the other feed calls on it then
 * return KVR_ESHUTDOWN, and kvr_feed_destroy frees it. */
#include <criterion/criterion.h>
#include <string.h>

#include "kvrouter.h"
#include "tests/common/feed_pub.h"

Test(feed_orphan, router_destroyed_before_its_feeds, .timeout = 60)
{
	/* The process-wide threads a first router starts (the RCU reclaimer), and the
	 * publisher's, are there before the count. */
	kvr_router_destroy(test_events_router(NULL));
	struct test_pub pub;
	test_pub_open(&pub);
	int threads_before = test_n_threads();
	struct kvr_router *r = test_events_router(NULL);
	struct kvr_feed *f = test_feed_on(r, &pub, 0, NULL, NULL);
	struct kvr_feed *g;
	cr_assert_eq(kvr_feed_create(r, NULL, &g), 0); /* a second one, with no endpoint */
	/* Traffic in flight while the router goes. */
	for (uint64_t seq = 0; seq < 50; seq++)
		test_pub_send_empty(&pub, seq, 0);
	kvr_router_destroy(r);
	/* The feeds' threads and ZeroMQ's are gone with the router. */
	cr_expect_eq(test_n_threads(), threads_before, "%d threads, %d before", test_n_threads(),
	             threads_before);
	for (uint64_t seq = 50; seq < 60; seq++) /* nobody reads these */
		test_pub_send_empty(&pub, seq, 0);
	struct kvr_feed_stats st;
	struct kvr_feed_endpoint fe = {.endpoint = pub.ep, .worker_id = 0};
	uint32_t id;
	uint64_t out[4];
	size_t n;
	cr_expect_eq(kvr_feed_get_stats(f, 0, &st), KVR_ESHUTDOWN);
	cr_expect(strstr(kvr_last_error(), "router was destroyed"), "%s", kvr_last_error());
	cr_expect_eq(kvr_feed_add(g, &fe, &id), KVR_ESHUTDOWN);
	cr_expect_eq(kvr_feed_remove(f, 0), KVR_ESHUTDOWN);
	n = 12345;
	cr_expect_eq(kvr_feed_other_medium_blocks(f, 0, 0, out, 4, &n), KVR_ESHUTDOWN);
	cr_expect_eq(n, 0, "*n_out on a failure: %zu (left as it was)", n);
	kvr_feed_destroy(f);
	kvr_feed_destroy(g);
	test_pub_close(&pub);
}
