/*
 * The feed's control calls under allocation failure (sync/feed.c), as out-of-memory loops: the
 * Nth allocation of one call fails for N = 1, 2, ... until the call succeeds; each failure
 * returns KVR_ENOMEM and changes nothing (every byte given back, no endpoint added, the next
 * endpoint's id unchanged).  kvr_feed_add's allocations run on the feed thread (one round trip):
 * the failure armed here lands there.
 */
#include <criterion/criterion.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "tests/common/oom_loop.h"

static struct kvr_router *events_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	return r;
}

struct feed_ctx {
	struct kvr_router *r;
	struct kvr_feed *f;
	struct kvr_feed_endpoint ep;
	uint32_t id0, id;
};

static int create_call(void *p)
{
	struct feed_ctx *x = p;
	x->f = NULL;
	return kvr_feed_create(x->r, NULL, &x->f);
}

static void create_check(void *p, uint64_t nth)
{
	cr_assert_null(((struct feed_ctx *)p)->f, "nth %lu", (unsigned long)nth);
}

Test(feed_oom, create)
{
	struct feed_ctx x = {.r = events_router()};
	/* One feed first: its thread's first count takes a metrics block (core/metrics.c:
	 * 16896 bytes here), handed back at thread exit for the next thread, freed with the
	 * router. */
	cr_assert_eq(create_call(&x), 0);
	kvr_feed_destroy(x.f);
	int64_t live0 = kvr_alloc_live_bytes();
	uint64_t failed;
	cr_assert_eq(kvr_oom_loop(create_call, create_check, &x, &failed), 0);
	kvr_feed_destroy(x.f);
	cr_assert_eq(kvr_alloc_live_bytes(), live0);
	cr_assert_geq(failed, 2, "the feed, its command slots: %lu", (unsigned long)failed);
	kvr_router_destroy(x.r);
}

static int add_call(void *p)
{
	struct feed_ctx *x = p;
	return kvr_feed_add(x->f, &x->ep, &x->id);
}

static void add_check(void *p, uint64_t nth)
{
	struct feed_ctx *x = p;
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(x->f, x->id0 + 1, &st), KVR_ENOENT, "nth %lu",
	             (unsigned long)nth);
}

Test(feed_oom, add)
{
	struct feed_ctx x = {
	    .r = events_router(),
	    .ep = {.endpoint = "tcp://127.0.0.1:1",
	           .topic = "kv",
	           .replay_endpoint = "tcp://127.0.0.1:2"},
	};
	cr_assert_eq(kvr_feed_create(x.r, NULL, &x.f), 0);
	/* One add and remove first: the endpoint tables have their room (capacity is not state). */
	cr_assert_eq(kvr_feed_add(x.f, &x.ep, &x.id0), 0);
	cr_assert_eq(kvr_feed_remove(x.f, x.id0), 0);
	uint64_t failed;
	cr_assert_eq(kvr_oom_loop(add_call, add_check, &x, &failed), 0);
	cr_assert_eq(x.id, x.id0 + 1, "a failed add took no id");
	cr_assert_geq(failed, 4, "the endpoint, its three strings: %lu", (unsigned long)failed);
	cr_assert_eq(kvr_feed_remove(x.f, x.id), 0);
	cr_assert_eq(kvr_feed_remove(x.f, x.id), KVR_ENOENT);
	kvr_feed_destroy(x.f);
	kvr_router_destroy(x.r);
}
