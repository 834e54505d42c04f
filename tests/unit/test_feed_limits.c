/* The KV event feed's configuration at the ends of its ranges.
 *
 * idle_spin_still_resyncs_added_ranks: kvr_feed_config.idle_spin_ns has no upper bound.  While
 * ranks that missed batches wait to be added, the feed thread looks every 10 ms whether the
 * router has them now (then it replays or reports what they missed); but its idle spin polled
 * the sockets only, for the whole setting: with a long spin a rank added while the publisher
 * was quiet was not resynced (nor its gap reported) until the next message came.  The spin now
 * ends after 10 ms while ranks wait. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <time.h>

#include "kvrouter.h"
#include "tests/common/feed_pub.h"

static atomic_int gaps;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)from, (void)to;
	if (dp == 1)
		atomic_fetch_add(&gaps, 1);
}

Test(feed_limits, idle_spin_still_resyncs_added_ranks, .timeout = 60)
{
	struct kvr_router *r = test_events_router(on_gap);
	struct test_pub pub;
	test_pub_open(&pub);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.idle_spin_ns = UINT64_C(1) << 62;
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, &fc, &f), 0);
	struct kvr_feed_endpoint fe = {
	    .endpoint = pub.ep, .worker_id = 0, .dp_rank = KVR_FEED_DP_FROM_BATCH};
	uint32_t id;
	cr_assert_eq(kvr_feed_add(f, &fe, &id), 0);
	test_pub_subscribed(&pub);
	test_pub_send_empty(&pub, 0, 0);
	test_pub_send_empty(&pub, 1, 1); /* dp rank 1: not added yet, remembered as missed */
	test_pub_send_empty(&pub, 2, 0);
	struct kvr_feed_stats st;
	for (int t = 0; t < 500; t++) {
		cr_assert_eq(kvr_feed_get_stats(f, id, &st), 0);
		if (st.unknown_rank == 1 && st.batches == 2)
			break;
		sleep_ms(10);
	}
	cr_assert_eq(st.unknown_rank, 1);
	cr_assert_eq(st.batches, 2);
	sleep_ms(50); /* the feed is spinning now; no command or message comes from here on */
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 1}, 1, KVR_CAPACITY_NONE, 0), 0);
	for (int t = 0; t < 200 && !atomic_load(&gaps); t++)
		sleep_ms(10);
	cr_assert_eq(atomic_load(&gaps), 1,
	             "rank (0, 1), added while the publisher was quiet, was not resynced in 2 s");
	kvr_feed_destroy(f);
	test_pub_close(&pub);
	kvr_router_destroy(r);
}
