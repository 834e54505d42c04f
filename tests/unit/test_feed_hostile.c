/* The KV event feed against a publisher that misbehaves on the wire (a real ZeroMQ PUB socket in
 * this process, payloads hand-encoded): what it sends must cost the feed bounded memory and
 * bounded work per message.
 *
 * gaps_naming_unknown_ranks: every batch skips a sequence number and names a dp rank the router
 * does not have, a new one each time.  The gap rule cleared and reported (on_event_gap) the
 * batch's rank after remembering it, so each such batch added a rank state the feed kept for
 * good, and every later gap reported all of them: O(n) memory and O(n^2) callbacks for n
 * batches (600 batches: 180,300 callbacks).  Ranks the router does not have are remembered only
 * as missed (at most MISSED_MAX, for a resync once added), so a gap reports at most those and
 * the known ones. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <time.h>

#include "kvrouter.h"
#include "tests/common/feed_pub.h"
#include "sync/feed_internal.h"

static atomic_uint_fast64_t gap_calls;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	atomic_fetch_add(&gap_calls, 1);
}

Test(feed_hostile, gaps_naming_unknown_ranks, .timeout = 120)
{
	struct kvr_router *r = test_events_router(on_gap);
	struct test_pub pub;
	test_pub_open(&pub);
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, NULL, &f), 0);
	struct kvr_feed_endpoint fe = {
	    .endpoint = pub.ep, .worker_id = 0, .dp_rank = KVR_FEED_DP_FROM_BATCH};
	uint32_t id;
	cr_assert_eq(kvr_feed_add(f, &fe, &id), 0);
	test_pub_subscribed(&pub);
	const uint32_t n = 600;
	for (uint32_t k = 0; k < n; k++)
		test_pub_send_empty(&pub, 2 * (uint64_t)k + 1,
		                    1000 + k); /* seq 1, 3, 5, ...: gaps */
	struct kvr_feed_stats st;
	for (int t = 0; t < 6000; t++) {
		cr_assert_eq(kvr_feed_get_stats(f, id, &st), 0);
		if (st.unknown_rank >= n)
			break;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(st.unknown_rank, n, "every batch named an unknown rank");
	cr_assert_eq(st.gaps, n);
	uint64_t calls = atomic_load(&gap_calls);
	cr_log_info("%u gapped batches for unknown ranks: %lu gap callbacks", n,
	            (unsigned long)calls);
	cr_assert_leq(calls, (uint64_t)n * (MISSED_MAX + 1),
	              "%lu callbacks for %u gaps: the unknown ranks were all kept",
	              (unsigned long)calls, n);
	kvr_feed_destroy(f);
	test_pub_close(&pub);
	kvr_router_destroy(r);
}
