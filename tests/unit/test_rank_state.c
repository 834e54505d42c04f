/* Rank lifecycle and fencing (shards/rank_state): incarnations, capacity none -> TTL, shrink,
 * reset, and every refusal (stale incarnation, unknown rank, released attempt) changing nothing
 * and emitting nothing. */
#include <criterion/criterion.h>

#include "kvrouter.h"
#include "shards/rank_state.h"

#define TTL 1000

static struct kvr_lru_block B[4] = {{1, 10}, {2, 11}, {3, 12}, {4, 13}};

static struct kvr_rank_state *rs;
static struct kvr_lru_out out;

static void setup(void)
{
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_rank_state_create(TTL, 0, &rs), 0);
}

static void teardown(void)
{
	kvr_rank_state_destroy(rs);
	kvr_lru_out_fini(&out);
}

static void assert_empty_out(void)
{
	cr_assert(out.n_stored == 0 && out.n_evicted == 0 && !out.cleared);
}

TestSuite(rank_state, .init = setup, .fini = teardown);

Test(rank_state, unknown_rank_refused_and_not_resurrected)
{
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_ABSENT);
	cr_assert_eq(kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 0, &out), KVR_ENOENT);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_materialize(rs, 1, 1, 0, B, 1, 0, 0, 0, &out), KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_reset(rs, &out), KVR_ENOENT);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_ABSENT, "never resurrected");
	uint64_t q[1] = {10};
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 1), 0);
}

Test(rank_state, lru_lifecycle_and_stale_incarnation)
{
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 7, 3, &out), 0);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_LRU);
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 1, B, 4, 0, 0, &out), 0);
	cr_assert_eq(out.n_stored, 4);
	cr_assert_eq(kvr_rank_state_acquire(rs, 6, 2, B, 2, 0, 0, &out), KVR_ESTALE);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 1, B, 2, 0, 0, &out), KVR_EEXIST);
	cr_assert_eq(kvr_rank_state_materialize(rs, 6, 1, 13, B, 1, 4, 0, 0, &out), KVR_ESTALE);
	cr_assert_eq(kvr_rank_state_release(rs, 8, 1, &out), KVR_ESTALE);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_release(rs, 7, 1, &out), 0);
	cr_assert_eq(out.n_evicted, 1, "4 blocks over capacity 3: the deepest goes");
	cr_assert_eq(out.evicted_seq[0], 13);
	cr_assert_eq(kvr_rank_state_release(rs, 7, 1, &out), KVR_ENOENT, "released attempt");
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 7, 1, &out), 0, "shrinking evicts");
	cr_assert_eq(out.n_evicted, 2);
	cr_assert_not(out.cleared);
	uint64_t q[3] = {10, 11, 12};
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 3), 1);
	/* A new incarnation clears the rank and starts fresh. */
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 8, 5, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_incarnation(rs), 8);
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 3), 0);
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 3, B, 1, 0, 0, &out), KVR_ESTALE);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_reset(rs, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_ABSENT);
	cr_assert_eq(kvr_rank_state_acquire(rs, 8, 3, B, 1, 0, 0, &out), KVR_ENOENT,
	             "reset rank is gone");
}

Test(rank_state, capacity_none_runs_ttl_until_reset)
{
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 0, &out), 0);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 100, &out), 0);
	cr_assert_eq(out.n_stored, 2);
	cr_assert_eq(kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 100, &out), KVR_EEXIST);
	cr_assert_eq(kvr_rank_state_materialize(rs, 1, 1, 11, B + 2, 1, 2, 0, 200, &out), 0);
	cr_assert_eq(out.n_stored, 1);
	cr_assert_eq(kvr_rank_state_materialize(rs, 1, 9, 11, B + 3, 1, 3, 0, 200, &out),
	             KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 100, &out), KVR_EBUSY);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 0, &out), 0);
	cr_assert_eq(kvr_rank_state_next_deadline(rs), 100 + TTL);
	cr_assert_eq(kvr_rank_state_tick(rs, 100 + TTL, &out), 0);
	cr_assert_eq(out.n_evicted, 2);
	cr_assert_eq(kvr_rank_state_tick(rs, 200 + TTL, &out), 0);
	cr_assert_eq(out.n_evicted, 1);
	cr_assert_eq(out.evicted_seq[0], 12);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), 0);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_release(rs, 2, 1, &out), KVR_ESTALE);
	/* Reset, then the rank may come back with a capacity. */
	cr_assert_eq(kvr_rank_state_reset(rs, &out), 0);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 100, &out), 0);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_LRU);
	cr_assert_not(out.cleared, "already cleared by the reset");
}

Test(rank_state, lru_to_capacity_zero_clears_to_ttl)
{
	kvr_rank_state_set_capacity(rs, 1, 10, &out);
	kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 0, &out);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 0, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), KVR_ENOENT,
	             "leases of the LRU are gone with it");
	cr_assert_eq(kvr_rank_state_tick(rs, 5, &out), 0);
	cr_assert_eq(kvr_rank_state_next_deadline(rs), UINT64_MAX);
	cr_assert_eq(kvr_rank_state_set_capacity(NULL, 1, 0, &out), KVR_EINVAL);
	kvr_rank_state_destroy(NULL);
}
