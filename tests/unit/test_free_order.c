/* approx_lru's free order (kvr_config.free_order): where a finished request's partial block,
 * which holds a pool slot but no hash, goes in the engine's free queue.
 *
 * A rank of 4 blocks; A = one full block + a partial one, then B the same, each finished; then C
 * needs 2 new blocks.  vLLM's 2026 block pool (KVR_FREE_FRESH_FIRST) reuses the two partial
 * blocks' slots first, so A's and B's cached blocks stay; vLLM's 2025 one (KVR_FREE_TAIL_FIRST)
 * queued A's partial block behind nothing older and A's cached block right after it, so C's
 * allocation evicts A's cached block.  tools/sim's block pool does the same for both orders
 * (test_sim_pool a_released_block_without_a_hash_is_reused_first), and kvr-replay's serial
 * replay checks the router against it block for block in both (tools/replay/test_cli.sh). */
#include <criterion/criterion.h>
#include <string.h>

#include "kvrouter.h"

static uint32_t overlap_of(struct kvr_router *r, const uint32_t *tok, uint64_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = n;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0, "%s", kvr_last_error());
	return d.overlap_blocks;
}

static void serve(struct kvr_router *r, const uint32_t *tok, uint64_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = n;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0, "%s", kvr_last_error());
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
}

/* A's cached block after C: 1 (kept) or 0 (evicted). */
static uint32_t scene(enum kvr_free_order order)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.free_order = order;
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), 0, "%s", kvr_last_error());
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 4, 0), 0);
	uint32_t a[24], b[24], cc[32];
	for (uint32_t i = 0; i < 32; i++) {
		if (i < 24) {
			a[i] = 1000 + i;
			b[i] = 2000 + i;
		}
		cc[i] = 3000 + i;
	}
	serve(r, a, 24); /* one full block + 8 tokens */
	serve(r, b, 24);
	cr_assert_eq(overlap_of(r, a, 24), 1);
	cr_assert_eq(overlap_of(r, b, 24), 1);
	serve(r, cc, 32); /* two full blocks, no partial one */
	cr_assert_eq(overlap_of(r, b, 24), 1, "B's cached block was evicted");
	cr_assert_eq(overlap_of(r, cc, 32), 2);
	uint32_t kept = overlap_of(r, a, 24);
	kvr_router_destroy(r);
	return kept;
}

Test(free_order, fresh_first_reuses_the_partial_blocks_slots_first)
{
	cr_expect_eq(scene(KVR_FREE_FRESH_FIRST), 1, "A's cached block was evicted");
}

Test(free_order, tail_first_evicts_the_cached_block_queued_after_a_partial_one)
{
	cr_expect_eq(scene(KVR_FREE_TAIL_FIRST), 0, "A's cached block was kept");
}

Test(free_order, the_default_is_fresh_first_and_other_values_are_refused)
{
	struct kvr_config c;
	kvr_config_init(&c);
	cr_assert_eq(c.free_order, KVR_FREE_FRESH_FIRST);
	c.free_order = (enum kvr_free_order)2;
	cr_assert_eq(kvr_config_validate(&c), KVR_EINVAL);
	cr_assert(strstr(kvr_last_error(), "free_order"), "%s", kvr_last_error());
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), KVR_EINVAL);
	cr_assert_null(r);
}
