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
#include <stdio.h>
#include <string.h>
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

/* A feed's ZeroMQ context allows 1,023 sockets, and an endpoint with a replay address takes
 * four (SUB, DEALER, the monitor's pair): adds past that fail, and must say why.  They failed
 * as "out of memory" with no word of sockets, or, when the DEALER or a connect was the one
 * refused, as a refused address (KVR_EINVAL, "not a tcp://, ipc:// or inproc:// address"),
 * which a burst of adds and removes of one good endpoint also met (ZeroMQ closes removed
 * sockets in the background): 1,577 in a tight loop.  Now KVR_ENOMEM naming the sockets, and
 * a removal makes room again. */
Test(feed_limits, running_out_of_sockets_is_not_a_bad_address, .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, NULL, &f), 0);
	static uint32_t ids[1024];
	int n = 0, rc = 0;
	for (; n < 1024; n++) {
		char ep[64], rep[64];
		snprintf(ep, sizeof(ep), "tcp://127.0.0.1:%d", 20000 + n);
		snprintf(rep, sizeof(rep), "tcp://127.0.0.1:%d", 30000 + n);
		struct kvr_feed_endpoint e = {.endpoint = ep, .replay_endpoint = rep};
		if ((rc = kvr_feed_add(f, &e, &ids[n])) != 0)
			break;
	}
	cr_assert(n > 100 && n < 1024, "%d endpoints added", n);
	cr_assert_eq(rc, KVR_ENOMEM, "add %d: %s (%s)", n, kvr_strerror(rc), kvr_last_error());
	cr_assert(strstr(kvr_last_error(), "sockets"), "%s", kvr_last_error());
	cr_assert_eq(kvr_feed_remove(f, ids[0]), 0);
	struct kvr_feed_endpoint e = {.endpoint = "tcp://127.0.0.1:19999"};
	for (int k = 0; k < 200 && (rc = kvr_feed_add(f, &e, NULL)) == KVR_ENOMEM; k++) {
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL); /* the removed endpoint's sockets close in the background */
	}
	cr_assert_eq(rc, 0, "room after a removal: %s", kvr_last_error());
	kvr_feed_destroy(f);
	kvr_router_destroy(r);
}
