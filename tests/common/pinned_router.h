/*
 * tests/common/pinned_router.h - the teardown tests' rig (test_destroy_callbacks,
 * test_destroy_clock, test_feed_crossdestroy): one rank X, requests pinned to it, and a
 * one-shard router whose queue holds what X's 100-token budget cannot take.
 */
#ifndef KVR_TESTS_COMMON_PINNED_ROUTER_H
#define KVR_TESTS_COMMON_PINNED_ROUTER_H

#include <criterion/criterion.h>

#include "kvrouter.h"
#include "tests/common/router_prompts.h"

static const struct kvr_rank_id X = {0, 0};

/* Routes prompt `salt` (n <= 256 tokens) pinned to X. */
static inline int route_pinned(struct kvr_router *r, uint32_t salt, size_t n,
                               struct kvr_decision *d)
{
	cr_assert(n <= 256);
	return route_salt_pinned(r, &X, salt, n, d);
}

/* One shard, the queue on (threshold 1.0), rank X with a 100-token budget: a 200-token prompt
 * saturates it and the next request waits. */
static inline struct kvr_router *queue_router(void (*on_admit)(void *, uint64_t,
                                                               const struct kvr_decision *))
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	c.on_admit = on_admit;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, X, 7, 1000, 100), 0);
	return r;
}

#endif
