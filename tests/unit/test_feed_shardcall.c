/* The feed API called on a shard thread: the router's clock runs there (kvr_config.now_ns), and a
 * clock that asks a feed for its stats reaches the feed's loop, which settles before every
 * command it runs, i.e. waits for the shards to apply what it posted them, this shard included:
 * before, the call and the feed's thread waited for each other for good (the shard stopped; so
 * did the feed).  Now the feed calls that wait for a feed's thread answer KVR_EBUSY at once on a
 * shard thread (sync/feed.c, call()), and the batch the shard was holding up is applied. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/mono_clock.h"

enum { BS = TEST_BLOCK_TOKENS, PER = 8 };

static struct kvr_feed *xfeed;
static atomic_int armed, in_clock, sent, out;
static int call_rc = 1;
static char call_detail[256];

/* The router's clock; once armed, its first call on a shard thread holds the shard until a
 * batch is on its way to it, then asks the feed for its stats. */
static uint64_t clock_asks_feed(void *ctx)
{
	(void)ctx;
	if (atomic_load(&armed) && kvr_shard_current() && !atomic_exchange(&in_clock, 1)) {
		for (int t = 0; t < 1000 && !atomic_load(&sent); t++)
			sleep_ms(10);
		sleep_ms(300); /* the feed takes the batch and posts it to this shard */
		struct kvr_feed_stats st;
		call_rc = kvr_feed_get_stats(xfeed, KVR_FEED_ALL, &st);
		snprintf(call_detail, sizeof(call_detail), "%s", kvr_last_error());
		atomic_store(&out, 1);
	}
	return mono_ns();
}

Test(feed_shardcall, stats_from_the_clock_on_a_shard_thread, .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.now_ns = clock_asks_feed;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	struct test_pub pub;
	test_pub_open(&pub);
	xfeed = test_feed_on(r, &pub, 0, NULL, NULL);

	/* A route's booking makes the shard read the clock. */
	atomic_store(&armed, 1);
	uint32_t tok[64];
	for (uint32_t i = 0; i < 64; i++)
		tok[i] = 7 * i + 1;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	for (int t = 0; t < 500 && !atomic_load(&in_clock); t++)
		sleep_ms(10);
	cr_assert(atomic_load(&in_clock), "the shard never read the clock");

	uint64_t h[PER];
	for (int i = 0; i < PER; i++)
		h[i] = 1000 + (uint64_t)i;
	struct kvr_fenc e;
	kvr_fenc_init(&e);
	kvr_fenc_begin(&e, 1.0, 1);
	kvr_fenc_stored_on(&e, "GPU", h, PER, NULL, BS, test_block_tokens, h);
	kvr_fenc_end(&e, 0);
	cr_assert_eq(kvr_fenc_send(pub.pub, 0, e.sb.data, e.sb.size), 0);
	atomic_store(&sent, 1);

	cr_assert(came_back(&out), "the clock's call on the feed never returned");
	cr_assert_eq(call_rc, KVR_EBUSY, "the call returned %d", call_rc);
	cr_assert(strstr(call_detail, "kvr_feed_get_stats: ") == call_detail &&
	              strstr(call_detail, "shard"),
	          "detail \"%s\"", call_detail);
	/* The feed goes on: the batch is applied. */
	struct kvr_feed_stats st;
	for (int t = 0; t < 500; t++) {
		cr_assert_eq(kvr_feed_get_stats(xfeed, KVR_FEED_ALL, &st), 0);
		if (st.batches >= 1)
			break;
		sleep_ms(10);
	}
	cr_assert_geq(st.batches, 1);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	kvr_fenc_fini(&e);
	kvr_feed_destroy(xfeed);
	kvr_router_destroy(r);
	test_pub_close(&pub);
}
