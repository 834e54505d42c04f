/* Approximate LRU (shards/lru): the reference lifecycle, then each command, including
 * every duplicate, unknown and out-of-memory case. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/load.h"
#include "shards/lru.h"
#include "lru_out_util.h"
#include "tests/common/splitmix.h"

static void blocks(struct kvr_lru_block *b, const uint64_t *v, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		b[i].seq = v[i];
		b[i].local = v[i] + 1000;
	}
}

static uint64_t resident(struct kvr_lru *lru)
{
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	return st.resident;
}

Test(lru, reference_lifecycle)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[9];
	struct kvr_lru_stats st;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(10, &lru), 0);

	blocks(b, (uint64_t[]){10, 11, 12}, 3);
	cr_assert_eq(kvr_lru_acquire(lru, 1 /* A */, b, 3, 1, &out), 0);
	cr_assert_eq(resident(lru), 4);
	cr_assert_eq(out.n_stored, 3);
	cr_assert_eq(out_stored(&out, b, 0)->seq, 10);
	cr_assert_eq(out_stored(&out, b, 2)->local, 1012);
	cr_assert_eq(out.n_evicted, 0);

	blocks(b, (uint64_t[]){13}, 1);
	cr_assert_eq(kvr_lru_materialize(lru, 1, 12, b, 1, 3, 1, &out), 0);
	cr_assert_eq(resident(lru), 5);
	cr_assert_eq(out.n_stored, 1);
	cr_assert_eq(out_stored(&out, b, 0)->seq, 13);

	blocks(b, (uint64_t[]){10, 11, 20}, 3);
	cr_assert_eq(kvr_lru_acquire(lru, 2 /* B */, b, 3, 1, &out), 0);
	cr_assert_eq(resident(lru), 7, "10 and 11 are shared");
	cr_assert_eq(out.n_stored, 1);
	cr_assert_eq(out_stored(&out, b, 0)->seq, 20);

	cr_assert_eq(kvr_lru_release(lru, 1, &out), 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.resident, 6);
	cr_assert_eq(st.inactive, 2, "12 and 13");
	cr_assert_eq(out.n_evicted, 0);

	cr_assert_eq(kvr_lru_release(lru, 2, &out), 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.resident, 5);
	cr_assert_eq(st.inactive, 5, "all inactive");

	blocks(b, (uint64_t[]){100, 101, 102, 103, 104, 105, 106, 107, 108}, 9);
	cr_assert_eq(kvr_lru_acquire(lru, 3, b, 9, 0, &out), 0);
	cr_assert_eq(out.n_stored, 9);
	cr_assert_eq(out.n_evicted, 4);
	cr_assert_eq(out_evicted(&out, 0), 13, "A's release, deepest first");
	cr_assert_eq(out_evicted(&out, 1), 12);
	cr_assert_eq(out_evicted(&out, 2), 20, "then B's");
	cr_assert_eq(out_evicted(&out, 3), 11);
	cr_assert_eq(resident(lru), 10);
	uint64_t q[2] = {10, 11};
	cr_assert_eq(kvr_lru_overlap(lru, q, 2), 1);

	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

/* A crafted prompt (kvr_request does not check that a caller's hashes chain) repeating hashes its
 * walk already took: the second hit split the first hit's segment after the walk, and only the
 * first segment of each piece took a reference while the release dropped one from each, so lease
 * 1's copies 12 and 13 went inactive while it held them, and set_capacity(0) evicted them twice
 * (ASan: SEGV in head_del).  Found through fuzz_api_seeds --craft's cases, on the LRU alone. */
Test(lru, crafted_prompt_repeating_a_hash)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[9];
	struct kvr_lru_stats st;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(100, &lru), 0);
	blocks(b, (uint64_t[]){10, 11, 12, 13}, 4);
	cr_assert_eq(kvr_lru_acquire(lru, 1, b, 4, 0, &out), 0);
	blocks(b, (uint64_t[]){10, 11, 12, 13, 10, 11}, 6);
	cr_assert_eq(kvr_lru_acquire(lru, 2, b, 6, 0, &out), 0);
	cr_assert_eq(kvr_lru_release(lru, 2, &out), 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.inactive, st.copies - 4, "lease 1 still holds its 4 copies");
	blocks(b, (uint64_t[]){10, 11, 12, 13, 10, 11, 12, 13, 10}, 9);
	cr_assert_eq(kvr_lru_acquire(lru, 3, b, 9, 0, &out), 0);
	cr_assert_eq(kvr_lru_release(lru, 1, &out), 0);
	cr_assert_eq(kvr_lru_release(lru, 3, &out), 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.inactive, st.copies);
	cr_assert_eq(kvr_lru_set_capacity(lru, 0, &out), 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.resident, 0);
	cr_assert_eq(st.copies, 0);
	cr_assert_eq(st.hashes, 0);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

/* Crafted sequences on an LRU and a load tracker side by side (the two run structures a booking
 * feeds): prompts over an alphabet of 3-22 hashes, so hashes repeat within prompts and roots land
 * on interior hashes, with output blocks, releases and capacity changes.  ASan judges the
 * memory; the counts must stay sane and return to zero.  Before the fixes: the walk sets
 * overflowed (more uncounted copies of a hash than 1 + dups: seed 3, ASan write past nxt in
 * step), a hit ending past its first run after another hit split it was left unsplit (release
 * walked off the split chain), and the load tracker's head map named a freed run.
 * LRU_CRAFT_SEEDS=N runs more seeds. */
static uint64_t craft_x;
static uint64_t craft_rnd(void)
{
	return splitmix64(&craft_x);
}

Test(lru, crafted_sequences_on_lru_and_load)
{
	const char *env = getenv("LRU_CRAFT_SEEDS");
	uint64_t seeds = env ? strtoull(env, NULL, 0) : 150;
	for (uint64_t seed = 1; seed <= seeds; seed++) {
		craft_x = seed * 7919;
		uint64_t alpha = 3 + craft_rnd() % 20;
		struct kvr_lru *lru;
		struct kvr_load *ld;
		struct kvr_lru_out out;
		kvr_lru_out_init(&out);
		cr_assert_eq(kvr_lru_create(5 + craft_rnd() % 40, &lru), 0);
		cr_assert_eq(kvr_load_create(0, &ld), 0);
		uint64_t live[64], last[64], next = 1;
		int nlive = 0;
		for (int step = 0; step < 400; step++) {
			int op = (int)(craft_rnd() % 10), n = 1 + (int)(craft_rnd() % 16);
			struct kvr_lru_block b[16];
			uint64_t s[16];
			for (int i = 0; i < n; i++) {
				s[i] = 1 + craft_rnd() % alpha;
				b[i] = (struct kvr_lru_block){.local = s[i] * 3, .seq = s[i]};
			}
			int r1 = 0, r2 = 0;
			if (op < 4 && nlive < 64) {
				r1 = kvr_lru_acquire(lru, next, b, (size_t)n,
				                     (uint32_t)(craft_rnd() % 2), &out);
				r2 = kvr_load_add(ld, next, s, 1, (size_t)n, 10, 0);
				live[nlive] = next++;
				last[nlive++] = s[n - 1];
			} else if (op < 6 && nlive) {
				int k = (int)(craft_rnd() % (uint64_t)nlive);
				r1 = kvr_lru_materialize(lru, live[k], last[k], b, (size_t)n, 0, 0,
				                         &out);
				r2 = kvr_load_add_output(ld, live[k], s, 1, (size_t)n);
				last[k] = s[n - 1];
			} else if (op < 9 && nlive) {
				int k = (int)(craft_rnd() % (uint64_t)nlive);
				r1 = kvr_lru_release(lru, live[k], &out);
				r2 = kvr_load_finish(ld, live[k]);
				live[k] = live[--nlive];
				last[k] = last[nlive];
			} else {
				r1 = kvr_lru_set_capacity(lru, 5 + craft_rnd() % 40, &out);
			}
			cr_assert(r1 == 0 && r2 == 0, "seed %" PRIu64 " step %d op %d: %d %d", seed,
			          step, op, r1, r2);
			struct kvr_lru_stats st;
			kvr_lru_stats(lru, &st);
			cr_assert_leq(st.inactive, st.copies, "seed %" PRIu64 " step %d", seed,
			              step);
			struct kvr_load_stats ls;
			kvr_load_stats(ld, &ls);
			cr_assert_eq(ls.active_requests, (uint64_t)nlive, "seed %" PRIu64, seed);
		}
		while (nlive--) {
			cr_assert_eq(kvr_lru_release(lru, live[nlive], &out), 0);
			cr_assert_eq(kvr_load_finish(ld, live[nlive]), 0);
		}
		struct kvr_lru_stats st;
		kvr_lru_stats(lru, &st);
		cr_assert_eq(st.inactive, st.copies, "seed %" PRIu64 ": nothing held", seed);
		cr_assert_eq(kvr_lru_set_capacity(lru, 0, &out), 0);
		kvr_lru_stats(lru, &st);
		cr_assert(st.resident == 0 && st.copies == 0 && st.hashes == 0,
		          "seed %" PRIu64 ": resident %" PRIu64 " copies %" PRIu64, seed,
		          st.resident, st.copies);
		struct kvr_load_stats ls;
		kvr_load_stats(ld, &ls);
		cr_assert_eq(ls.active_blocks, 0, "seed %" PRIu64, seed);
		kvr_lru_destroy(lru);
		kvr_load_destroy(ld);
		kvr_lru_out_fini(&out);
	}
}

Test(lru, acquire_duplicate_attempt_refused)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[2];
	kvr_lru_out_init(&out);
	kvr_lru_create(100, &lru);
	blocks(b, (uint64_t[]){1, 2}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 7, b, 2, 0, &out), 0);
	blocks(b, (uint64_t[]){3, 4}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 7, b, 2, 5, &out), KVR_EEXIST);
	cr_assert_eq(out.n_stored, 0);
	cr_assert_eq(resident(lru), 2, "a refused command changes nothing");
	cr_assert_eq(kvr_lru_acquire(lru, 8, NULL, 1, 0, &out), KVR_EINVAL);
	cr_assert_eq(kvr_lru_acquire(lru, 8, NULL, 0, 0, &out), 0, "empty prompt is fine");
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

/* Two leases on one prompt both complete the same output block: two copies of one hash (the
 * second is not new to the index); a hit takes the oldest copy; the hash is reported evicted
 * when its LAST copy goes; evictions come out in runs, parent first. */
Test(lru, copies_of_one_hash)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[3];
	struct kvr_lru_stats st;
	kvr_lru_out_init(&out);
	kvr_lru_create(100, &lru);
	blocks(b, (uint64_t[]){1, 2}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 1, b, 2, 0, &out), 0);
	cr_assert_eq(kvr_lru_acquire(lru, 2, b, 2, 0, &out), 0);
	cr_assert_eq(out.n_stored, 0, "a full hit stores nothing");
	blocks(b, (uint64_t[]){3}, 1);
	cr_assert_eq(kvr_lru_materialize(lru, 1, 2, b, 1, 2, 0, &out), 0);
	cr_assert_eq(out.n_stored, 1);
	cr_assert_eq(kvr_lru_materialize(lru, 2, 2, b, 1, 2, 0, &out), 0);
	cr_assert_eq(out.n_stored, 0, "a second copy of 3 is not new to the index");
	kvr_lru_stats(lru, &st);
	cr_assert(st.copies == 4 && st.hashes == 3);
	kvr_lru_release(lru, 1, &out); /* inactive: 3 (lease 1's) */
	kvr_lru_release(lru, 2, &out); /* inactive: 3, 3', 2, 1 */
	blocks(b, (uint64_t[]){1, 2, 3}, 3);
	cr_assert_eq(kvr_lru_acquire(lru, 3, b, 3, 0, &out), 0); /* hits 1, 2 and the older 3 */
	cr_assert_eq(kvr_lru_set_capacity(lru, 3, &out), 0);
	cr_assert_eq(out.n_evicted, 0, "3' went, but 3 still has a copy");
	kvr_lru_stats(lru, &st);
	cr_assert(st.copies == 3 && st.hashes == 3 && st.evictions == 1);
	kvr_lru_release(lru, 3, &out);
	cr_assert_eq(kvr_lru_set_capacity(lru, 0, &out), 0);
	cr_assert_eq(out.n_evicted, 3);
	cr_assert_eq(out.n_evicted_runs, 2, "a run per segment: [3], then [1 2]");
	cr_assert(out.evicted_seq[0] == 3 && out.evicted_seq[1] == 1 && out.evicted_seq[2] == 2,
	          "deeper run first, each parent first");
	cr_assert_eq(out_evicted(&out, 0), 3, "deepest evicted first");
	cr_assert_eq(resident(lru), 0);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

Test(lru, hit_takes_copy_out_of_inactive)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[3];
	kvr_lru_out_init(&out);
	kvr_lru_create(3, &lru);
	blocks(b, (uint64_t[]){1, 2, 3}, 3);
	kvr_lru_acquire(lru, 1, b, 3, 0, &out);
	kvr_lru_release(lru, 1, &out);
	blocks(b, (uint64_t[]){1, 2}, 2);
	kvr_lru_acquire(lru, 2, b, 2, 0, &out); /* 1, 2 active again */
	blocks(b, (uint64_t[]){7, 8}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 3, b, 2, 0, &out), 0);
	cr_assert_eq(out.n_evicted, 1, "only 3 is evictable");
	cr_assert_eq(out_evicted(&out, 0), 3);
	cr_assert_eq(resident(lru), 4, "over capacity with active blocks is tolerated");
	cr_assert_eq(kvr_lru_release(lru, 2, &out), 0);
	cr_assert_eq(out.n_evicted, 1);
	cr_assert_eq(out_evicted(&out, 0), 2, "deepest of the release goes first");
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

Test(lru, shared_copy_epoch_from_last_holder)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[2];
	kvr_lru_out_init(&out);
	kvr_lru_create(10, &lru);
	blocks(b, (uint64_t[]){1, 2}, 2);
	kvr_lru_acquire(lru, 1, b, 2, 0, &out);
	blocks(b, (uint64_t[]){1}, 1);
	kvr_lru_acquire(lru, 2, b, 1, 0, &out); /* shares 1 */
	blocks(b, (uint64_t[]){5}, 1);
	kvr_lru_acquire(lru, 3, b, 1, 0, &out);
	kvr_lru_release(lru, 1, &out); /* 2 inactive (epoch 1); 1 still held */
	kvr_lru_release(lru, 3, &out); /* 5 inactive (epoch 2) */
	kvr_lru_release(lru, 2, &out); /* 1 inactive (epoch 3) */
	cr_assert_eq(kvr_lru_set_capacity(lru, 0, &out), 0);
	cr_assert_eq(out.n_evicted, 3);
	cr_assert_eq(out_evicted(&out, 0), 2);
	cr_assert_eq(out_evicted(&out, 1), 5);
	cr_assert_eq(out_evicted(&out, 2), 1);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

Test(lru, materialize_rules)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[2];
	struct kvr_lru_stats st;
	kvr_lru_out_init(&out);
	kvr_lru_create(10, &lru);
	blocks(b, (uint64_t[]){1, 2}, 2);
	cr_assert_eq(kvr_lru_materialize(lru, 1, 0, b, 1, 0, 0, &out), KVR_ENOENT, "no lease");
	kvr_lru_acquire(lru, 1, b, 2, 2, &out);
	blocks(b, (uint64_t[]){3}, 1);
	cr_assert_eq(kvr_lru_materialize(lru, 1, 1, b, 1, 2, 0, &out), KVR_ENOENT,
	             "parent must be the lease's last block");
	cr_assert_eq(kvr_lru_materialize(lru, 1, 2, b, 1, 2, 1, &out), 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.private_blocks, 1, "private count is replaced, not added");
	cr_assert_eq(st.resident, 4);
	blocks(b, (uint64_t[]){1}, 1); /* a hash already present: new copy, not stored */
	cr_assert_eq(kvr_lru_materialize(lru, 1, 3, b, 1, 3, 0, &out), 0);
	cr_assert_eq(out.n_stored, 0);
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.copies, 4);
	cr_assert_eq(kvr_lru_release(lru, 1, &out), 0);
	cr_assert_eq(kvr_lru_materialize(lru, 1, 1, b, 1, 4, 0, &out), KVR_ENOENT, "released");
	/* A lease without blocks accepts any parent. */
	kvr_lru_acquire(lru, 2, NULL, 0, 1, &out);
	cr_assert_eq(kvr_lru_materialize(lru, 2, 12345, b, 1, 0, 0, &out), 0);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

Test(lru, release_unknown_and_twice)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[1];
	kvr_lru_out_init(&out);
	kvr_lru_create(10, &lru);
	cr_assert_eq(kvr_lru_release(lru, 5, &out), KVR_ENOENT);
	blocks(b, (uint64_t[]){1}, 1);
	kvr_lru_acquire(lru, 5, b, 1, 3, &out);
	cr_assert_eq(kvr_lru_release(lru, 5, &out), 0);
	cr_assert_eq(kvr_lru_release(lru, 5, &out), KVR_ENOENT);
	cr_assert_eq(resident(lru), 1);
	cr_assert_eq(kvr_lru_release(NULL, 5, &out), KVR_EINVAL);
	kvr_lru_destroy(lru);
	kvr_lru_destroy(NULL);
	kvr_lru_out_fini(&out);
}

Test(lru, many_leases_swap_remove)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[4];
	kvr_lru_out_init(&out);
	kvr_lru_create(1000, &lru);
	for (uint64_t a = 1; a <= 200; a++) {
		blocks(b, (uint64_t[]){1, a * 10, a * 10 + 1, a * 10 + 2}, 4);
		cr_assert_eq(kvr_lru_acquire(lru, a, b, 4, 0, &out), 0);
	}
	for (uint64_t a = 1; a <= 200; a += 2)
		cr_assert_eq(kvr_lru_release(lru, a, &out), 0);
	for (uint64_t a = 2; a <= 200; a += 2)
		cr_assert(kvr_lru_has_lease(lru, a));
	for (uint64_t a = 1; a <= 200; a += 2)
		cr_assert_not(kvr_lru_has_lease(lru, a));
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.leases, 100);
	cr_assert_eq(st.copies, 601);
	cr_assert_eq(st.inactive, 300);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

/* SQLite-style: fail the Nth allocation for N = 1, 2, ...; a failed command changes nothing. */
Test(lru, out_of_memory_changes_nothing)
{
	struct kvr_lru_block b[40];
	for (uint64_t nth = 1; nth < 200; nth++) {
		struct kvr_lru *lru;
		struct kvr_lru_out out;
		kvr_lru_out_init(&out);
		cr_assert_eq(kvr_lru_create(30, &lru), 0);
		kvr_alloc_fail_after(nth);
		int failures = 0;
		for (uint64_t a = 1; a <= 6; a++) {
			for (size_t i = 0; i < 40; i++) {
				b[i].seq = (i < 10) ? i : a * 100 + i;
				b[i].local = b[i].seq;
			}
			struct kvr_lru_stats before, after;
			kvr_lru_stats(lru, &before);
			int rc = kvr_lru_acquire(lru, a, b, 40, 1, &out);
			kvr_lru_stats(lru, &after);
			if (rc) {
				cr_assert_eq(rc, KVR_ENOMEM);
				cr_assert_eq(memcmp(&before, &after, sizeof(before)), 0);
				failures++;
				continue;
			}
			kvr_lru_stats(lru, &before);
			rc = kvr_lru_release(lru, a, &out);
			kvr_lru_stats(lru, &after);
			if (rc) {
				cr_assert_eq(rc, KVR_ENOMEM);
				cr_assert_eq(memcmp(&before, &after, sizeof(before)), 0);
				failures++;
			}
		}
		kvr_alloc_fail_after(0);
		kvr_lru_destroy(lru);
		kvr_lru_out_fini(&out);
		if (failures == 0 && nth > 20)
			break;
	}
}

/* Persistent failures (every allocation from the Nth on fails, kvr_alloc_fail_from): a command's
 * clean-up after a failure may allocate too (a shrink back), and must leave nothing behind.  The
 * walk sets' reservation resized cur, then failed on nxt and shrank cur back; the shrink failing
 * as well lost cur's 32 bytes on a fresh LRU (oom_api --threads 3 saw it once, another thread's
 * failure armed between the two). */
Test(lru, persistent_out_of_memory_leaks_nothing)
{
	struct kvr_lru_block b[40];
	for (uint64_t nth = 1; nth < 60; nth++) {
		int64_t live0 = kvr_alloc_live_bytes();
		struct kvr_lru *lru;
		struct kvr_lru_out out;
		kvr_lru_out_init(&out);
		cr_assert_eq(kvr_lru_create(30, &lru), 0);
		kvr_alloc_fail_from(nth);
		for (uint64_t a = 1; a <= 3; a++) {
			for (size_t i = 0; i < 40; i++) {
				b[i].seq = (i < 10) ? i : a * 100 + i;
				b[i].local = b[i].seq;
			}
			int rc = kvr_lru_acquire(lru, a, b, 40, 1, &out);
			cr_assert(rc == 0 || rc == KVR_ENOMEM, "acquire: %d", rc);
			if (rc == 0) {
				rc = kvr_lru_release(lru, a, &out);
				cr_assert(rc == 0 || rc == KVR_ENOMEM, "release: %d", rc);
			}
		}
		kvr_alloc_fail_after(0);
		kvr_lru_destroy(lru);
		kvr_lru_out_fini(&out);
		cr_assert_eq(kvr_alloc_live_bytes(), live0,
		             "nth %" PRIu64 ": %" PRId64 " bytes left", nth,
		             kvr_alloc_live_bytes() - live0);
	}
}

/* keep_private (vLLM's free queue): a released partial block keeps its pool slot, queued
 * deepest of its release, so a later allocation evicts OLDER cached blocks before it reuses
 * that unhashed slot.  In the default (reference) mode the slot is free at once. */
static void keep_private_case(bool keep, const uint64_t *want, size_t n_want)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(5, &lru), 0);
	kvr_lru_set_keep_private(lru, keep);
	struct kvr_lru_block b[2];
	blocks(b, (uint64_t[]){1, 2}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 1, b, 2, 0, &out), 0);
	cr_assert_eq(kvr_lru_release(lru, 1, &out), 0); /* inactive: 2, 1 */
	blocks(b, (uint64_t[]){3}, 1);
	cr_assert_eq(kvr_lru_acquire(lru, 2, b, 1, 1, &out), 0); /* + one partial block */
	cr_assert_eq(kvr_lru_release(lru, 2, &out), 0);          /* inactive: 2, 1, (partial), 3 */
	cr_assert_eq(resident(lru), keep ? 4 : 3);
	blocks(b, (uint64_t[]){7, 8}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 3, b, 2, 0, &out), 0);
	cr_assert_eq(out.n_evicted, n_want);
	for (size_t i = 0; i < n_want; i++)
		cr_assert_eq(out_evicted(&out, i), want[i]);
	cr_assert_eq(resident(lru), 5);
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	cr_assert_eq(st.phantoms, keep ? 1 : 0);
	cr_assert_eq(st.hashes, keep ? 4 : 5);
	kvr_lru_out_fini(&out);
	kvr_lru_destroy(lru);
}

Test(lru, keep_private_evicts_older_blocks_first)
{
	keep_private_case(true, (uint64_t[]){2}, 1);
	keep_private_case(false, NULL, 0);
}

Test(lru, keep_private_phantom_evicted_silently)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(3, &lru), 0);
	kvr_lru_set_keep_private(lru, true);
	struct kvr_lru_block b[3];
	blocks(b, (uint64_t[]){1, 2}, 2);
	cr_assert_eq(kvr_lru_acquire(lru, 1, b, 2, 1, &out), 0);
	cr_assert_eq(kvr_lru_release(lru, 1, &out), 0); /* inactive: (partial), 2, 1 */
	blocks(b, (uint64_t[]){5}, 1);
	cr_assert_eq(kvr_lru_acquire(lru, 2, b, 1, 0, &out), 0);
	cr_assert_eq(out.n_evicted, 0, "the partial block's slot is reused first, silently");
	cr_assert_eq(kvr_lru_overlap(lru, (uint64_t[]){1, 2}, 2), 2);
	cr_assert_eq(kvr_lru_release(lru, 2, &out), 0);
	kvr_lru_out_fini(&out);
	kvr_lru_destroy(lru);
}

/* A prompt whose hit spans more segments than the acquire's piece array held (16 at first): the
 * walk runs out of room, the array grows and the walk runs again; every block is a hit and the
 * release puts them back in the order they were taken (deepest first). */
Test(lru, hit_over_many_segments)
{
	enum { SEGS = 40, PER = 2 };
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	struct kvr_lru_block b[SEGS * PER];
	uint64_t v[SEGS * PER];
	for (int i = 0; i < SEGS * PER; i++)
		v[i] = 100 + (uint64_t)i;
	blocks(b, v, SEGS * PER);
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(SEGS * PER, &lru), 0);
	cr_assert_eq(kvr_lru_acquire(lru, 1, b, PER, 0, &out), 0);
	for (int s = 1; s < SEGS; s++) /* one segment per materialize */
		cr_assert_eq(kvr_lru_materialize(lru, 1, v[s * PER - 1], b + s * PER, PER,
		                                 (uint32_t)(s * PER), 0, &out),
		             0);
	cr_assert_eq(kvr_lru_release(lru, 1, &out), 0);
	cr_assert_eq(kvr_lru_acquire(lru, 2, b, SEGS * PER, 0, &out), 0);
	cr_assert_eq(out.n_stored, 0, "every block was a hit");
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	cr_assert(st.copies == SEGS * PER && st.inactive == 0);
	cr_assert_eq(kvr_lru_release(lru, 2, &out), 0);
	cr_assert_eq(kvr_lru_set_capacity(lru, 1, &out), 0);
	cr_assert_eq(out.n_evicted, SEGS * PER - 1);
	for (int i = 0; i < SEGS * PER - 1; i++)
		cr_assert_eq(out_evicted(&out, i), v[SEGS * PER - 1 - i], "deepest first");
	cr_assert_eq(kvr_lru_overlap(lru, v, SEGS * PER), 1);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}
