/* Healing the approximate LRU from engine ground truth (shards/lru.h, issue 15), on hand-worked
 * states: the engine's cached depth below the prediction evicts everything ordered before the
 * first missing block (older releases, deeper blocks of the same release, released private
 * blocks), nothing when that block was held by a live request, all copies of a hash; a resident
 * count trims the oldest; a watermark evicts what is older than it. */
#include <criterion/criterion.h>
#include <string.h>

#include "kvrouter.h"
#include "lru_out_util.h"
#include "shards/lru.h"

static struct kvr_lru *lru;
static struct kvr_lru_out out;

static void setup(void)
{
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(100, &lru), 0);
}

static void teardown(void)
{
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

TestSuite(lru_heal, .init = setup, .fini = teardown);

/* Chained test hashes: a prompt is given as its block hashes (parents implied by order). */
static void acq(uint64_t attempt, const uint64_t *v, size_t n, uint32_t priv)
{
	struct kvr_lru_block b[16];
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_lru_block){.local = v[i] + 1000, .seq = v[i]};
	cr_assert_eq(kvr_lru_acquire(lru, attempt, b, n, priv, &out), 0);
}

static void rel(uint64_t attempt)
{
	cr_assert_eq(kvr_lru_release(lru, attempt, &out), 0);
}

static size_t ov(const uint64_t *v, size_t n)
{
	return kvr_lru_overlap(lru, v, n);
}

static uint64_t stat_copies(void)
{
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	return st.copies;
}

Test(lru_heal, fewer_cached_evicts_everything_older)
{
	acq(1, (uint64_t[]){1, 2, 3}, 3, 0);
	rel(1); /* inactive: [1 2 3] */
	acq(2, (uint64_t[]){10, 11}, 2, 0);
	rel(2); /* inactive: [1 2 3], [10 11] */
	acq(3, (uint64_t[]){20}, 1, 0);
	rel(3);                                 /* inactive: [1 2 3], [10 11], [20] */
	acq(4, (uint64_t[]){10, 11, 12}, 3, 0); /* predicted 2 cached */
	struct kvr_lru_heal h;
	/* The engine found only 10: it had evicted 11, so everything released before 11 went. */
	cr_assert_eq(kvr_lru_heal_cached(lru, 4, 1, 0, &h, &out), 0);
	cr_assert(h.predicted == 2 && h.actual == 1 && !h.unprovable);
	cr_assert_eq(h.evicted, 3);
	cr_assert_eq(out.n_evicted, 3);
	cr_assert(out_evicted(&out, 0) == 3 && out_evicted(&out, 2) == 1, "deepest first");
	cr_assert_eq(ov((uint64_t[]){1}, 1), 0);
	cr_assert_eq(ov((uint64_t[]){20}, 1), 1, "released later: still predicted");
	cr_assert_eq(ov((uint64_t[]){10, 11, 12}, 3), 3, "the attempt's own blocks stay");
	/* As many as predicted, or more: nothing to evict. */
	cr_assert_eq(kvr_lru_heal_cached(lru, 4, 2, 0, &h, &out), 0);
	cr_assert(h.evicted == 0 && out.n_evicted == 0);
	cr_assert_eq(kvr_lru_heal_cached(lru, 4, 3, 0, &h, &out), 0);
	cr_assert_eq(h.evicted, 0);
	/* Errors change nothing. */
	cr_assert_eq(kvr_lru_heal_cached(lru, 4, 4, 0, &h, &out), KVR_EINVAL, "beyond the prompt");
	cr_assert_eq(kvr_lru_heal_cached(lru, 99, 0, 0, &h, &out), KVR_ENOENT);
	cr_assert_eq(stat_copies(), 4);
}

Test(lru_heal, same_release_deeper_siblings_go_shallower_stay)
{
	acq(1, (uint64_t[]){1, 2, 3, 4, 5}, 5, 0);
	rel(1);                                 /* inactive: [1 2 3 4 5] */
	acq(2, (uint64_t[]){1, 2, 3, 9}, 4, 0); /* hits 1 2 3: [4 5] stays inactive */
	struct kvr_lru_heal h;
	/* The engine found 1 only: 2 was gone, so were 3, 4, 5 (deeper, same release). */
	cr_assert_eq(kvr_lru_heal_cached(lru, 2, 1, 0, &h, &out), 0);
	cr_assert_eq(h.evicted, 2, "4 and 5 (2 and 3 are the attempt's now)");
	cr_assert(out_evicted(&out, 0) == 5 && out_evicted(&out, 1) == 4);
	cr_assert_eq(ov((uint64_t[]){1, 2, 3, 4}, 4), 3);
}

Test(lru_heal, shared_prefix_held_by_another_request_is_unprovable)
{
	acq(1, (uint64_t[]){1, 2}, 2, 0); /* live */
	acq(9, (uint64_t[]){30}, 1, 0);
	rel(9);                              /* inactive: [30] */
	acq(2, (uint64_t[]){1, 2, 5}, 3, 0); /* hits 1 2, held by 1 at the time */
	struct kvr_lru_heal h;
	cr_assert_eq(kvr_lru_heal_cached(lru, 2, 0, 0, &h, &out), 0);
	cr_assert(h.unprovable && h.evicted == 0 && out.n_evicted == 0);
	cr_assert_eq(ov((uint64_t[]){30}, 1), 1);
}

Test(lru_heal, released_private_blocks_go_first)
{
	kvr_lru_destroy(lru);
	cr_assert_eq(kvr_lru_create(100, &lru), 0);
	kvr_lru_set_keep_private(lru, true);
	acq(1, (uint64_t[]){1, 2}, 2, 1);
	rel(1); /* inactive: (partial), [1 2] */
	acq(2, (uint64_t[]){1, 2, 3}, 3, 0);
	struct kvr_lru_heal h;
	cr_assert_eq(kvr_lru_heal_cached(lru, 2, 0, 0, &h, &out), 0);
	cr_assert_eq(h.evicted, 1, "the partial block's slot, reported to nobody");
	cr_assert_eq(out.n_evicted, 0);
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.phantoms, 0);
}

Test(lru_heal, every_copy_of_the_missing_hash_goes)
{
	acq(1, (uint64_t[]){1, 2}, 2, 0);
	acq(2, (uint64_t[]){1, 2}, 2, 0);
	struct kvr_lru_block b = {.local = 1003, .seq = 3};
	cr_assert_eq(kvr_lru_materialize(lru, 1, 2, &b, 1, 2, 0, &out), 0);
	cr_assert_eq(kvr_lru_materialize(lru, 2, 2, &b, 1, 2, 0, &out), 0); /* a second copy */
	acq(7, (uint64_t[]){40}, 1, 0);
	rel(1);                                 /* inactive: [3] (1's) */
	rel(2);                                 /* inactive: [3], [3'], [1 2] */
	rel(7);                                 /* inactive: [3], [3'], [1 2], [40] */
	acq(3, (uint64_t[]){1, 2, 3, 4}, 4, 0); /* hits 1 2 and the OLDER copy of 3 */
	struct kvr_lru_heal h;
	/* The engine found 1 2 but not 3: no copy of 3 was left, so 3' went, and all before it. */
	cr_assert_eq(kvr_lru_heal_cached(lru, 3, 2, 0, &h, &out), 0);
	cr_assert_eq(h.evicted, 1);
	cr_assert_eq(out.n_evicted, 0, "3 is still the attempt's: no hash left the rank");
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	cr_assert(st.copies == 5 && st.hashes == 5, "1 2 3 4 40, one copy each");
	cr_assert_eq(ov((uint64_t[]){40}, 1), 1);
}

Test(lru_heal, resident_count_trims_the_oldest)
{
	acq(1, (uint64_t[]){1, 2, 3}, 3, 0);
	rel(1);
	acq(2, (uint64_t[]){10, 11}, 2, 0);
	rel(2);
	acq(3, (uint64_t[]){20}, 1, 0); /* live */
	uint64_t ev = 0;
	cr_assert_eq(kvr_lru_heal_resident(lru, 100, 0, &ev, NULL, &out), 0);
	cr_assert(ev == 0 && out.n_evicted == 0, "the engine holds at least as much");
	cr_assert_eq(kvr_lru_heal_resident(lru, 3, 0, &ev, NULL, &out), 0);
	cr_assert_eq(ev, 3, "6 predicted, 3 resident: the 3 oldest go");
	cr_assert(out_evicted(&out, 0) == 3 && out_evicted(&out, 2) == 1);
	cr_assert_eq(kvr_lru_heal_resident(lru, 0, 0, &ev, NULL, &out), 0);
	cr_assert_eq(ev, 2, "never a held block");
	cr_assert_eq(stat_copies(), 1);
}

Test(lru_heal, watermark_evicts_what_is_older)
{
	acq(1, (uint64_t[]){1, 2, 3}, 3, 0);
	rel(1);
	acq(2, (uint64_t[]){10, 11, 12}, 3, 0);
	rel(2); /* eviction order: 3 2 1 12 11 10 */
	uint64_t ev = 0;
	cr_assert_eq(kvr_lru_heal_watermark(lru, 99, &ev, &out), KVR_ENOENT);
	cr_assert_eq(stat_copies(), 6, "an unknown watermark proves nothing");
	cr_assert_eq(kvr_lru_heal_watermark(lru, 11, &ev, &out), 0);
	cr_assert_eq(ev, 4, "3 2 1 12 went before 11");
	cr_assert_eq(ov((uint64_t[]){10, 11, 12}, 3), 2);
	cr_assert_eq(ov((uint64_t[]){1}, 1), 0);
}

Test(lru_heal, resident_above_capacity_raises_it)
{
	cr_assert_eq(kvr_lru_set_capacity(lru, 4, &out),
	             0); /* under-registered: the engine has 6 */
	acq(1, (uint64_t[]){1, 2, 3}, 3, 0);
	rel(1);
	acq(2, (uint64_t[]){10, 11}, 2, 0);
	rel(2); /* 5 resident, capacity 4: 3 (the deepest of the oldest release) goes */
	cr_assert_eq(ov((uint64_t[]){1, 2, 3}, 3), 2);
	cr_assert_eq(stat_copies(), 4);
	uint64_t ev = 9;
	bool raised = false;
	cr_assert_eq(kvr_lru_heal_resident(lru, 6, 0, &ev, &raised, &out), 0);
	cr_assert(raised && ev == 0 && out.n_evicted == 0,
	          "6 held > 4 registered: raised, no eviction");
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.capacity, 6);
	acq(3, (uint64_t[]){20, 21}, 2, 0);
	rel(3); /* 6 resident, capacity 6: nothing goes (at 4, 2 and 1 would have) */
	cr_assert_eq(out.n_evicted, 0);
	cr_assert_eq(ov((uint64_t[]){1, 2}, 2), 2);
	cr_assert_eq(ov((uint64_t[]){10, 11}, 2), 2);
	cr_assert_eq(ov((uint64_t[]){20, 21}, 2), 2);
	/* At or below the capacity the count only evicts, and the capacity is never lowered. */
	cr_assert_eq(kvr_lru_heal_resident(lru, 6, 0, &ev, &raised, &out), 0);
	cr_assert(!raised && ev == 0);
	cr_assert_eq(kvr_lru_heal_resident(lru, 5, 0, &ev, &raised, &out), 0);
	cr_assert(!raised && ev == 1, "the oldest, 2, goes");
	cr_assert_eq(ov((uint64_t[]){1, 2}, 2), 1);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.capacity, 6);
}

Test(lru_heal, resident_count_spares_what_the_engine_has_not_allocated)
{
	acq(1, (uint64_t[]){1, 2, 3}, 3, 0);
	rel(1); /* inactive: 3 2 1 (the engine holds them, cached) */
	/* Routed, still waiting in the engine's queue: shares 1 2, adds 30 31 and a private
	 * block.  The prediction holds 3 + 2 + 1 = 6, the engine 3. */
	acq(2, (uint64_t[]){1, 2, 30, 31}, 4, 1);
	cr_assert_eq(kvr_lru_lease_unallocated(lru, 2), 3, "30 31 and the private block");
	cr_assert_eq(kvr_lru_lease_unallocated(lru, 1), 0, "no lease");
	uint64_t ev = 9;
	cr_assert_eq(kvr_lru_heal_resident(lru, 3, 3, &ev, NULL, &out), 0);
	cr_assert(ev == 0 && out.n_evicted == 0, "3 resident + 3 not allocated: all is there");
	cr_assert_eq(ov((uint64_t[]){1, 2, 3}, 3), 3);
	/* Without that allowance the count reads as 3 over-predicted and 3 (inactive) goes. */
	cr_assert_eq(kvr_lru_heal_resident(lru, 3, 0, &ev, NULL, &out), 0);
	cr_assert(ev == 1 && out_evicted(&out, 0) == 3);
	/* 40 released, then evicted by the engine: it holds 1 2 (2 resident), the prediction
	 * 1 2 30 31 40 and the private block (6); 2 + 3 not allocated: 40 goes, nothing held. */
	acq(3, (uint64_t[]){40}, 1, 0);
	rel(3);
	cr_assert_eq(kvr_lru_heal_resident(lru, 2, 3, &ev, NULL, &out), 0);
	cr_assert(ev == 1 && out_evicted(&out, 0) == 40 && stat_copies() == 4);
}

static uint64_t stat_phantoms(void)
{
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	return st.phantoms;
}

/* Released private blocks (keep_private) sit in the eviction order at their release: a heal
 * takes those of older releases with the copies, and leaves a newer release's. */
Test(lru_heal, private_blocks_go_in_release_order)
{
	kvr_lru_destroy(lru);
	cr_assert_eq(kvr_lru_create(100, &lru), 0);
	kvr_lru_set_keep_private(lru, true);
	acq(1, (uint64_t[]){1, 2, 3}, 3, 1);
	rel(1);
	acq(2, (uint64_t[]){10, 11, 12}, 3, 1);
	rel(2);
	acq(3, (uint64_t[]){20}, 1, 1);
	rel(3); /* eviction order: (1's partial) 3 2 1 (2's) 12 11 10 (3's) 20 */
	uint64_t ev = 0;
	cr_assert_eq(kvr_lru_heal_watermark(lru, 11, &ev, &out), 0);
	cr_assert_eq(ev, 6, "the two older partial blocks, 3 2 1 and 12 went before 11");
	cr_assert(stat_copies() == 3 && stat_phantoms() == 1);
	cr_assert_eq(kvr_lru_heal_resident(lru, 2, 0, &ev, NULL, &out), 0);
	cr_assert(ev == 2 && out_evicted(&out, 0) == 11 && out_evicted(&out, 1) == 10);
	cr_assert_eq(stat_phantoms(), 1, "release 3's partial block is newer than 11 and 10");
	cr_assert_eq(kvr_lru_heal_resident(lru, 1, 0, &ev, NULL, &out), 0);
	cr_assert(ev == 1 && out.n_evicted == 0 && stat_phantoms() == 0 && stat_copies() == 1);
}

Test(lru_heal, fewer_cached_takes_older_private_blocks_only)
{
	kvr_lru_destroy(lru);
	cr_assert_eq(kvr_lru_create(100, &lru), 0);
	kvr_lru_set_keep_private(lru, true);
	acq(1, (uint64_t[]){1, 2}, 2, 1);
	rel(1);
	acq(2, (uint64_t[]){5}, 1, 1);
	rel(2);
	acq(3, (uint64_t[]){7}, 1, 1);
	rel(3);                           /* eviction order: (1's) 2 1 (2's) 5 (3's) 7 */
	acq(4, (uint64_t[]){5, 6}, 2, 0); /* hits 5 */
	struct kvr_lru_heal h;
	cr_assert_eq(kvr_lru_heal_cached(lru, 4, 0, 0, &h, &out), 0);
	cr_assert_eq(h.evicted, 4,
	             "1's partial block, 2 1 and 2's partial block were older than 5");
	cr_assert_eq(stat_phantoms(), 1, "3's partial block is newer");
	cr_assert_eq(ov((uint64_t[]){7}, 1), 1);
	cr_assert_eq(ov((uint64_t[]){1}, 1), 0);
}

/* A cached-tokens answer covering the whole prompt says nothing of the output after it: the
 * first output block (a ghost, once evicted) was taken for the block the engine missed, and
 * gave an upper bound on the capacity (11 here) that the same answer without output does not
 * give (0: none). */
static struct kvr_lru_out wo;
static void wacq(struct kvr_lru *l, uint64_t a, uint64_t v0)
{
	struct kvr_lru_block b[2] = {{.local = v0 + 1000, .seq = v0},
	                             {.local = v0 + 1001, .seq = v0 + 1}};
	cr_assert_eq(kvr_lru_acquire(l, a, b, 2, 0, &wo), 0);
}

static uint64_t whole_prompt_upper(bool with_output)
{
	struct kvr_lru *l;
	struct kvr_lru_heal h;
	kvr_lru_out_init(&wo);
	cr_assert_eq(kvr_lru_create(4, &l), 0);
	wacq(l, 1, 100);
	cr_assert_eq(kvr_lru_heal_cached(l, 1, 0, 0, &h, &wo), 0); /* ghosts on */
	struct kvr_lru_block ob = {.local = 1102, .seq = 102};
	cr_assert_eq(kvr_lru_materialize(l, 1, 101, &ob, 1, 2, 0, &wo), 0);
	cr_assert_eq(kvr_lru_release(l, 1, &wo), 0);
	for (uint64_t k = 0; k < 3; k++) { /* evict the first attempt's blocks: ghosts */
		wacq(l, 10 + k, 200 + 10 * k);
		cr_assert_eq(kvr_lru_release(l, 10 + k, &wo), 0);
	}
	wacq(l, 3, 100);
	if (with_output)
		cr_assert_eq(kvr_lru_materialize(l, 3, 101, &ob, 1, 2, 0, &wo), 0);
	cr_assert_eq(kvr_lru_heal_cached(l, 3, 2, 0, &h, &wo), 0); /* the whole prompt cached */
	kvr_lru_destroy(l);
	kvr_lru_out_fini(&wo);
	return h.upper;
}

Test(lru_heal, a_whole_prompt_cached_says_nothing_of_its_output)
{
	uint64_t without = whole_prompt_upper(false);
	cr_assert_eq(whole_prompt_upper(true), without,
	             "the output's first block taken for a miss");
}
