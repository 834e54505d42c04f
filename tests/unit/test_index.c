/* The RCU radix index (core/index): every rule of stored/removed/cleared/remove-rank, error
 * paths, dp ranks, LoRA chains, 8k-block events and queries, memory given back.  Run with the
 * block locator and, KVR_INDEX_NO_LOCATOR set (meson's unit_index_no_locator), without. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/index.h"
#include "core/index_internal.h"
#include "kvrouter.h"
#include "shards/owner.h"
#include "sync/rcu.h"

static struct kvr_index *idx;
static size_t idx_slots; /* its slots (find_depths' arrays) */

static void setup(void)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	idx_slots = 64;
	cr_assert_eq(kvr_index_create((uint32_t)idx_slots, &idx), 0);
	/* meson runs the suite twice: with the block locator, and without (unit_index_no_locator)
	 */
	if (getenv("KVR_INDEX_NO_LOCATOR"))
		cr_assert_eq(kvr_index_set_locator(idx, false), 0);
}

static void teardown(void)
{
	kvr_index_destroy(idx);
	idx = NULL;
}

TestSuite(index, .init = setup, .fini = teardown);

/* Blocks ext = base + i, local = local0 + i (a chain). */
static void chain(struct kvr_index_block *b, size_t n, uint64_t ext0, uint64_t local0)
{
	for (size_t i = 0; i < n; i++) {
		b[i].ext_hash = ext0 + i;
		b[i].local_hash = local0 + i;
	}
}

static int match(const uint64_t *local, size_t n, bool early, struct kvr_index_match *out,
                 size_t cap, size_t *n_out)
{
	struct kvr_index_match_opts o = {.early_exit = early};
	kvr_rcu_read_lock();
	/* The index matches sequence hashes: chain the test's local hashes as the router does. */
	uint64_t *seq = local ? malloc((n ? n : 1) * sizeof(*seq)) : NULL;
	if (local)
		kvr_hash_chain_locals(NULL, local, n, seq);
	int rc = kvr_index_find_matches(idx, seq, n, &o, out, cap, n_out);
	if (rc == 0 && !early && seq && n_out) { /* find_depths: the same scores, by slot */
		uint32_t *depth = calloc(idx_slots, sizeof(*depth)),
		         *slots = malloc(idx_slots * sizeof(*slots)), best = 7;
		size_t nd = kvr_index_find_depths(idx, seq, n, depth, slots, &best);
		size_t nonzero = 0; /* the ranks holding seq[0]: those find_matches lists */
		for (size_t i = 0; i < idx_slots; i++)
			nonzero += depth[i] != 0;
		cr_assert_eq(nonzero, *n_out);
		cr_assert_geq(nd, *n_out);
		uint32_t top = 0;
		for (size_t i = 0; i < *n_out; i++) {
			cr_assert_eq(depth[out[i].slot], out[i].score, "slot %u", out[i].slot);
			top = out[i].score > top ? out[i].score : top;
		}
		cr_assert_eq(best, top);
		for (size_t i = 0; i < nd; i++)
			depth[slots[i]] = 0;
		for (size_t i = 0; i < idx_slots; i++)
			cr_assert_eq(depth[i], 0, "slot %zu set but not listed", i);
		free(depth);
		free(slots);
	}
	free(seq);
	kvr_rcu_read_unlock();
	return rc;
}

/* Score of slot in a query, -1 if absent. */
static int score_of(const uint64_t *local, size_t n, uint32_t slot)
{
	struct kvr_index_match out[64];
	size_t k;
	cr_assert_eq(match(local, n, false, out, 64, &k), 0);
	for (size_t i = 0; i < k; i++)
		if (out[i].slot == slot)
			return (int)out[i].score;
	return -1;
}

Test(index, create_errors)
{
	struct kvr_index *x = (void *)1;
	cr_assert_eq(kvr_index_create(0, &x), KVR_ERANGE);
	cr_assert_null(x);
	cr_assert_eq(kvr_index_create(KVR_INDEX_MAX_RANKS + 1, &x), KVR_ERANGE);
	cr_assert_eq(kvr_index_create(4, NULL), KVR_EINVAL);
	kvr_index_destroy(NULL);
	kvr_alloc_fail_after(1);
	cr_assert_eq(kvr_index_create(4, &x), KVR_ENOMEM);
	kvr_alloc_fail_after(2);
	cr_assert_eq(kvr_index_create(4, &x), KVR_ENOMEM);
	kvr_alloc_fail_after(0);
}

Test(index, rank_slots)
{
	uint32_t a, b, c, s;
	uint64_t w;
	uint32_t dp;
	cr_assert_eq(kvr_index_rank_add(idx, 7, 0, &a), 0);
	cr_assert_eq(kvr_index_rank_add(idx, 7, 1, &b), 0);
	cr_assert_neq(a, b);
	cr_assert_eq(kvr_index_rank_add(idx, 7, 0, &c), KVR_EEXIST);
	cr_assert_eq(c, a);
	cr_assert_eq(kvr_index_rank_find(idx, 7, 1, &s), 0);
	cr_assert_eq(s, b);
	cr_assert_eq(kvr_index_rank_find(idx, 7, 2, &s), KVR_ENOENT);
	cr_assert_eq(kvr_index_rank_get(idx, b, &w, &dp), 0);
	cr_assert(w == 7 && dp == 1);
	cr_assert_eq(kvr_index_rank_get(idx, 63, &w, &dp), KVR_ENOENT);
	cr_assert_eq(kvr_index_rank_get(idx, 64, &w, &dp), KVR_EINVAL);
	cr_assert_eq(kvr_index_rank_add(NULL, 1, 0, &s), KVR_EINVAL);
	cr_assert_eq(kvr_index_rank_add(idx, 1, 0, NULL), KVR_EINVAL);
	cr_assert_eq(kvr_index_rank_find(NULL, 1, 0, &s), KVR_EINVAL);
	cr_assert_eq(kvr_index_rank_remove(idx, a), 0);
	cr_assert_eq(kvr_index_rank_remove(idx, a), KVR_ENOENT);
	cr_assert_eq(kvr_index_rank_remove(idx, 9999), KVR_ENOENT);
	cr_assert_eq(kvr_index_rank_find(idx, 7, 0, &s), KVR_ENOENT);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.ranks, 1);
}

Test(index, slots_full_and_reused_after_grace_period)
{
	uint32_t s[64], extra;
	for (uint32_t i = 0; i < 64; i++) {
		cr_assert_eq(kvr_index_rank_add(idx, 100 + i, 0, &s[i]), 0);
		/* Dense from 0: a router's slot-indexed tables touch only the first pages. */
		cr_assert_eq(s[i], i);
	}
	cr_assert_eq(kvr_index_rank_add(idx, 999, 0, &extra), KVR_ERANGE);
	struct kvr_index_block b[3];
	chain(b, 3, 10, 500);
	cr_assert_eq(kvr_index_store(idx, s[5], NULL, b, 3), 0);
	cr_assert_eq(kvr_index_rank_remove(idx, s[5]), 0);
	/* Until a grace period passes the slot is not reused. */
	kvr_index_quiesce(idx);
	cr_assert_eq(kvr_index_rank_add(idx, 999, 0, &extra), 0);
	cr_assert_eq(extra, s[5]);
	uint64_t q[3] = {500, 501, 502};
	cr_assert_eq(score_of(q, 3, extra), -1, "a new rank must not inherit the old blocks");
	cr_assert_eq(kvr_index_tree_size(idx, extra), 0);
	/* Many add/remove cycles: tombstones in the lookup table are purged. */
	for (int k = 0; k < 300; k++) {
		uint32_t t;
		cr_assert_eq(kvr_index_rank_remove(idx, extra), 0);
		kvr_index_quiesce(idx);
		cr_assert_eq(kvr_index_rank_add(idx, 5000 + (uint64_t)k, 3, &t), 0);
		extra = t;
		cr_assert_eq(kvr_index_rank_find(idx, 5000 + (uint64_t)k, 3, &t), 0);
		cr_assert_eq(t, extra);
	}
}

Test(index, store_and_match_scores)
{
	uint32_t r0, r1;
	kvr_index_rank_add(idx, 1, 0, &r0);
	kvr_index_rank_add(idx, 2, 0, &r1);
	struct kvr_index_block b[5];
	chain(b, 5, 100, 1);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 5), 0);
	chain(b, 3, 900, 1); /* same tokens, another engine's ext hashes */
	cr_assert_eq(kvr_index_store(idx, r1, NULL, b, 3), 0);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 5, "same local path shares nodes across ext hashes");
	cr_assert_eq(st.copies, 8);
	cr_assert_eq(st.stored_blocks, 8);
	uint64_t q[6] = {1, 2, 3, 4, 5, 6};
	struct kvr_index_match out[8];
	size_t n;
	cr_assert_eq(match(q, 6, false, out, 8, &n), 0);
	cr_assert_eq(n, 2);
	cr_assert_eq(out[0].slot, r0);
	cr_assert_eq(out[0].score, 5);
	cr_assert_eq(out[0].tree_size, 5);
	cr_assert_eq(out[1].slot, r1);
	cr_assert_eq(out[1].score, 3);
	cr_assert_eq(out[1].tree_size, 3);
	/* Early exit: stops when r0 is alone, after block 3. */
	cr_assert_eq(match(q, 6, true, out, 8, &n), 0);
	cr_assert_eq(n, 2);
	cr_assert(out[0].score >= 4 && out[0].score <= 5, "early exit: a floor");
	/* Not holding block 0 -> nothing. */
	uint64_t q2[2] = {2, 3};
	cr_assert_eq(match(q2, 2, false, out, 8, &n), 0);
	cr_assert_eq(n, 0);
	/* cap too small. */
	cr_assert_eq(match(q, 6, false, out, 1, &n), KVR_ERANGE);
	cr_assert_eq(n, 2);
	cr_assert_eq(match(NULL, 1, false, out, 8, &n), KVR_EINVAL);
	cr_assert_eq(match(q, 1, false, NULL, 8, &n), KVR_EINVAL);
	cr_assert_eq(match(q, 0, false, out, 8, &n), 0);
	cr_assert_eq(n, 0);
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_index_find_matches(idx, q, 6, NULL, out, 8, NULL), KVR_EINVAL);
	cr_assert_eq(kvr_index_find_matches(NULL, q, 6, NULL, out, 8, &n), KVR_EINVAL);
	kvr_rcu_read_unlock();
}

Test(index, parent_rules)
{
	uint32_t r;
	kvr_index_rank_add(idx, 1, 0, &r);
	struct kvr_index_block b[4];
	chain(b, 2, 100, 1);
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, 2), 0);
	/* Continue from parent 101. */
	chain(b, 2, 102, 3);
	uint64_t parent = 101;
	cr_assert_eq(kvr_index_store(idx, r, &parent, b, 2), 0);
	uint64_t q[4] = {1, 2, 3, 4};
	cr_assert_eq(score_of(q, 4, r), 4);
	/* Unknown parent: the whole event rejected and counted. */
	uint64_t bad = 555;
	chain(b, 2, 200, 50);
	cr_assert_eq(kvr_index_store(idx, r, &bad, b, 2), KVR_ENOENT);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.parent_not_found, 1);
	cr_assert_eq(st.nodes, 4);
	/* Self-parent: first block's ext equals the parent's -> invalid, nothing after it. */
	b[0].ext_hash = 103;
	parent = 103;
	cr_assert_eq(kvr_index_store(idx, r, &parent, b, 2), KVR_EINVAL);
	/* Self-parent in the middle: the prefix stays applied. */
	chain(b, 3, 300, 70);
	b[2].ext_hash = 301;
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, 3), KVR_EINVAL);
	uint64_t q2[3] = {70, 71, 72};
	cr_assert_eq(score_of(q2, 3, r), 2);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.invalid, 2);
	/* Bad arguments. */
	cr_assert_eq(kvr_index_store(idx, r, NULL, NULL, 1), KVR_EINVAL);
	cr_assert_eq(kvr_index_store(NULL, r, NULL, b, 1), KVR_EINVAL);
	cr_assert_eq(kvr_index_store(idx, 40, NULL, b, 1), KVR_ENOENT);
	cr_assert_eq(kvr_index_store(idx, 4000, NULL, b, 1), KVR_ENOENT);
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, 0), 0);
	cr_assert_eq(kvr_index_store(idx, r, NULL, NULL, 0), 0);
}

Test(index, idempotent_and_conflicts)
{
	uint32_t r;
	kvr_index_rank_add(idx, 1, 0, &r);
	struct kvr_index_block b[3];
	chain(b, 3, 100, 1);
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, 3), 0);
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, 3), 0);
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, 2), 0);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 3);
	cr_assert_eq(kvr_index_tree_size(idx, r), 3);
	/* Same ext hash for another block -> invalid. */
	struct kvr_index_block c[1] = {{.ext_hash = 100, .local_hash = 42}};
	cr_assert_eq(kvr_index_store(idx, r, NULL, c, 1), KVR_EINVAL);
	/* Same block under another ext hash -> invalid. */
	c[0] = (struct kvr_index_block){.ext_hash = 777, .local_hash = 1};
	cr_assert_eq(kvr_index_store(idx, r, NULL, c, 1), KVR_EINVAL);
	/* Duplicate hashes inside one event: [a, b, a]. */
	struct kvr_index_block d[3] = {{500, 9}, {501, 10}, {500, 11}};
	cr_assert_eq(kvr_index_store(idx, r, NULL, d, 3), KVR_EINVAL);
	uint64_t q[3] = {9, 10, 11};
	cr_assert_eq(score_of(q, 3, r), 2);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.invalid, 3);
	cr_assert_eq(st.copies, 5);
}

Test(index, remove_no_cascade)
{
	uint32_t r;
	kvr_index_rank_add(idx, 1, 0, &r);
	struct kvr_index_block b[4];
	chain(b, 4, 100, 1);
	kvr_index_store(idx, r, NULL, b, 4);
	uint64_t rm[3] = {101, 999, 101};
	size_t nf = 0;
	cr_assert_eq(kvr_index_remove(idx, r, rm, 3, &nf), 0);
	cr_assert_eq(nf, 2);
	uint64_t q[4] = {1, 2, 3, 4};
	cr_assert_eq(score_of(q, 4, r), 1);
	cr_assert_eq(kvr_index_tree_size(idx, r), 3);
	/* The descendants are still held: continuing from 102 works. */
	struct kvr_index_block c[1] = {{104, 5}};
	uint64_t parent = 103;
	cr_assert_eq(kvr_index_store(idx, r, &parent, c, 1), 0);
	/* Re-store block 1: the path is whole again. */
	parent = 100;
	struct kvr_index_block e[1] = {{101, 2}};
	cr_assert_eq(kvr_index_store(idx, r, &parent, e, 1), 0);
	uint64_t q2[5] = {1, 2, 3, 4, 5};
	cr_assert_eq(score_of(q2, 5, r), 5);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.block_not_found, 2);
	cr_assert_eq(st.removed_blocks, 1);
	cr_assert_eq(kvr_index_remove(idx, r, NULL, 1, &nf), KVR_EINVAL);
	cr_assert_eq(kvr_index_remove(idx, r, NULL, 0, &nf), 0);
	cr_assert_eq(kvr_index_remove(idx, 33, rm, 1, &nf), KVR_ENOENT);
	cr_assert_eq(kvr_index_remove(NULL, r, rm, 1, NULL), KVR_EINVAL);
}

Test(index, dp_ranks_and_cleared)
{
	uint32_t a0, a1, b0;
	kvr_index_rank_add(idx, 10, 0, &a0);
	kvr_index_rank_add(idx, 10, 1, &a1);
	kvr_index_rank_add(idx, 11, 0, &b0);
	struct kvr_index_block b[3];
	chain(b, 3, 100, 1);
	kvr_index_store(idx, a0, NULL, b, 3);
	kvr_index_store(idx, b0, NULL, b, 3);
	chain(b, 2, 200, 1);
	kvr_index_store(idx, a1, NULL, b, 2);
	uint64_t q[3] = {1, 2, 3};
	cr_assert_eq(score_of(q, 3, a0), 3);
	cr_assert_eq(score_of(q, 3, a1), 2, "dp ranks are distinct ranks");
	cr_assert_eq(kvr_index_clear_worker(idx, 10), 0);
	cr_assert_eq(score_of(q, 3, a0), -1);
	cr_assert_eq(score_of(q, 3, a1), -1);
	cr_assert_eq(score_of(q, 3, b0), 3);
	cr_assert_eq(kvr_index_tree_size(idx, a0), 0);
	cr_assert_eq(kvr_index_clear_worker(idx, 12345), KVR_ENOENT);
	/* The slots stay: storing again works. */
	cr_assert_eq(kvr_index_store(idx, a0, NULL, b, 2), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, a0), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, a0), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, 50), KVR_ENOENT);
	cr_assert_eq(kvr_index_clear_rank(NULL, 0), KVR_EINVAL);
	/* Remove rank drops its blocks. */
	cr_assert_eq(kvr_index_rank_remove(idx, b0), 0);
	cr_assert_eq(score_of(q, 3, b0), -1);
	kvr_index_quiesce(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 0);
	cr_assert_eq(st.copies, 0);
}

Test(index, lora_chains_do_not_mix)
{
	uint32_t base, lora;
	kvr_index_rank_add(idx, 1, 0, &base);
	kvr_index_rank_add(idx, 2, 0, &lora);
	uint32_t tok[64];
	for (int i = 0; i < 64; i++)
		tok[i] = (uint32_t)i * 7;
	uint64_t lb[4], sb[4], ll[4], sl[4];
	kvr_hash_blocks(tok, 64, 16, NULL, lb, sb);
	kvr_hash_blocks(tok, 64, 16, "adapter-a", ll, sl);
	struct kvr_index_block b[4];
	for (int i = 0; i < 4; i++)
		b[i] = (struct kvr_index_block){sb[i], lb[i]};
	kvr_index_store(idx, base, NULL, b, 4);
	for (int i = 0; i < 4; i++)
		b[i] = (struct kvr_index_block){sl[i], ll[i]};
	kvr_index_store(idx, lora, NULL, b, 4);
	cr_assert_eq(score_of(lb, 4, base), 4);
	cr_assert_eq(score_of(lb, 4, lora), -1);
	cr_assert_eq(score_of(ll, 4, lora), 4);
	cr_assert_eq(score_of(ll, 4, base), -1);
}

Test(index, count_copies)
{
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	uint64_t q[3] = {1, 2, 3};
	struct kvr_index_block b[3];
	chain(b, 3, 100, 1);
	/* Off (approximate modes): a re-store is a no-op, one remove drops the block. */
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 3), 0);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 2), 0);
	uint64_t e1 = 101;
	cr_assert_eq(kvr_index_remove(idx, r0, &e1, 1, NULL), 0);
	cr_assert_eq(score_of(q, 3, r0), 1);
	cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
	/* On (events mode): two copies of blocks 0 and 1; a block goes with its last copy. */
	kvr_index_set_count_copies(idx, true);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 3), 0);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 2), 0);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 5);
	cr_assert_eq(kvr_index_tree_size(idx, r0), 3, "tree size counts distinct blocks");
	size_t nf;
	cr_assert_eq(kvr_index_remove(idx, r0, &e1, 1, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(score_of(q, 3, r0), 3, "one copy of block 1 is left");
	cr_assert_eq(kvr_index_remove(idx, r0, &e1, 1, &nf), 0);
	cr_assert_eq(score_of(q, 3, r0), 1, "the last copy went");
	cr_assert_eq(kvr_index_remove(idx, r0, &e1, 1, &nf), 0);
	cr_assert_eq(nf, 1);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 3);
	cr_assert_eq(kvr_index_tree_size(idx, r0), 2);
	/* A copy re-stored below a held parent. */
	uint64_t e0 = 100;
	struct kvr_index_block c = {.ext_hash = 101, .local_hash = 2};
	cr_assert_eq(kvr_index_store(idx, r0, &e0, &c, 1), 0);
	cr_assert_eq(kvr_index_store(idx, r0, &e0, &c, 1), 0);
	cr_assert_eq(kvr_index_remove(idx, r0, &e1, 1, &nf), 0);
	cr_assert_eq(score_of(q, 3, r0), 3);
	cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 0, "clear drops every copy");
}

/* One store of a very long chain (100,000 blocks): kvr_index_memory_bytes counts the store's
 * scratch array while the index keeps it, and it is not kept past the call (before, the 2 MiB
 * array stayed for the index's life, counted nowhere). */
Test(index, long_store_scratch_given_back)
{
	enum { N = 100000 };
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	struct kvr_index_block *b = malloc(N * sizeof(*b));
	cr_assert_not_null(b);
	chain(b, N, 1000000, 1);
	const int64_t live0 = kvr_alloc_live_bytes();
	const uint64_t mem0 = kvr_index_memory_bytes(idx);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, N), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
	kvr_index_quiesce(idx);
	const int64_t live1 = kvr_alloc_live_bytes();
	const uint64_t mem1 = kvr_index_memory_bytes(idx);
	cr_assert_lt(live1, live0 + 64 * 1024, "kept %ld bytes", (long)(live1 - live0));
	cr_assert_lt(mem1, mem0 + 64 * 1024);
	/* A short store keeps its scratch, and memory_bytes has it. */
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 100), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
	kvr_index_quiesce(idx);
	cr_assert_geq(kvr_index_memory_bytes(idx), mem1 + 200 * sizeof(uint64_t));
	free(b);
}

/* Retired objects gathered below a full batch are handed to RCU by kvr_index_flush_retired (the
 * router's idle hook) and by kvr_index_quiesce, whose counters are then exact: 40 of 1,040
 * 8-block chains removed, the memory counter and the live bytes fall by their runs and hash
 * arrays.  Before, the 80 retired objects waited in the batch for the next write, and a quiesce
 * left memory_bytes and kvr_alloc_live_bytes where they were before the removals. */
static void store_chains(uint32_t r0, int from, int to)
{
	struct kvr_index_block b[8];
	for (int k = from; k < to; k++) {
		chain(b, 8, 1000003ull * (uint64_t)(k + 1), 77ull * (uint64_t)(k + 1));
		cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 8), 0);
	}
}

static void remove_chains(uint32_t r0, int from, int to)
{
	uint64_t h[8];
	for (int k = from; k < to; k++) {
		for (int i = 0; i < 8; i++)
			h[i] = 1000003ull * (uint64_t)(k + 1) + (uint64_t)i;
		size_t nf = 1;
		cr_assert_eq(kvr_index_remove(idx, r0, h, 8, &nf), 0);
		cr_assert_eq(nf, 0);
	}
}

Test(index, retired_below_a_full_batch_are_freed_when_idle)
{
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	store_chains(r0, 0, 1040);
	kvr_index_quiesce(idx);
	const uint64_t mem0 = kvr_index_memory_bytes(idx);
	const int64_t live0 = kvr_alloc_live_bytes();
	remove_chains(r0, 1000, 1040);
	kvr_index_flush_retired(idx);
	kvr_index_flush_retired(idx); /* nothing left: a no-op */
	kvr_index_quiesce(idx);
	/* 40 runs and 40 hash arrays of 8 words at least */
	const uint64_t gone = 40 * (64 + 64);
	cr_assert_leq(kvr_index_memory_bytes(idx) + gone, mem0, "memory_bytes %llu -> %llu",
	              (unsigned long long)mem0, (unsigned long long)kvr_index_memory_bytes(idx));
	cr_assert_leq(kvr_alloc_live_bytes() + (int64_t)gone, live0, "live %lld -> %lld",
	              (long long)live0, (long long)kvr_alloc_live_bytes());
	/* The same through quiesce alone. */
	const uint64_t mem1 = kvr_index_memory_bytes(idx);
	remove_chains(r0, 960, 1000);
	kvr_index_quiesce(idx);
	cr_assert_leq(kvr_index_memory_bytes(idx) + gone, mem1, "memory_bytes %llu -> %llu",
	              (unsigned long long)mem1, (unsigned long long)kvr_index_memory_bytes(idx));
	cr_assert_eq(kvr_index_tree_size(idx, r0), 960 * 8);
	kvr_index_flush_retired(NULL); /* a no-op */
}

/* Holds the index writers' lock, as another shard's long write does, until told to let go. */
struct writer_hold {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool held, release;
};

static void *hold_writers_lock(void *p)
{
	struct writer_hold *h = p;
	pthread_mutex_lock(&idx->wlock);
	pthread_mutex_lock(&h->mu);
	h->held = true;
	pthread_cond_broadcast(&h->cv);
	while (!h->release)
		pthread_cond_wait(&h->cv, &h->mu);
	pthread_mutex_unlock(&h->mu);
	pthread_mutex_unlock(&idx->wlock);
	return NULL;
}

/* A shard's idle hook (kvr_owner_shard_idle) flushes the retired batch, which is the writers':
 * it took their mutex, so an idle shard waited behind another shard's write, however long, and
 * was late for its next message (here: for good, the write never ends until the hook returns;
 * the test's timeout fails it).  The hook only tries the lock now: the writer holding it goes
 * idle after its write and flushes then (every writer of a router's index is a shard task).
 * kvr_index_flush_retired and kvr_index_quiesce still wait for it. */
Test(index, the_idle_hook_does_not_wait_for_a_writer, .timeout = 30)
{
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	store_chains(r0, 0, 1040);
	kvr_index_quiesce(idx);
	const uint64_t mem0 = kvr_index_memory_bytes(idx);
	remove_chains(r0, 1000, 1040); /* 80 retired objects: below a full batch */
	struct kvr_owner_ctx c = {.index = idx};
	struct writer_hold h = {.held = false};
	pthread_mutex_init(&h.mu, NULL);
	pthread_cond_init(&h.cv, NULL);
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, hold_writers_lock, &h), 0);
	pthread_mutex_lock(&h.mu);
	while (!h.held)
		pthread_cond_wait(&h.cv, &h.mu);
	pthread_mutex_unlock(&h.mu);
	kvr_owner_shard_idle(NULL, &c); /* returns: the batch stays for a later idle period */
	cr_assert_gt(idx->rt.n, 0, "the hook flushed under another writer's lock");
	pthread_mutex_lock(&h.mu);
	h.release = true;
	pthread_cond_broadcast(&h.cv);
	pthread_mutex_unlock(&h.mu);
	pthread_join(t, NULL);
	kvr_owner_shard_idle(NULL, &c); /* the lock free: flushed */
	cr_assert_eq(idx->rt.n, 0);
	kvr_index_quiesce(idx);
	cr_assert_lt(kvr_index_memory_bytes(idx), mem0);
	pthread_cond_destroy(&h.cv);
	pthread_mutex_destroy(&h.mu);
}

/* A full run-id space (2^25 - 1 located runs of two blocks or more; lowered here to 100 through
 * the directory's id_limit, which only tests set) refuses the store that needs one more as
 * KVR_ERANGE, and changes nothing: the blocks it stored before the refusal are taken back.  A
 * store that needs no id still works, and a run that dies gives its id back.  Before, the
 * refusal read KVR_ENOMEM, which says memory would help. */
/* n blocks with local hashes local0.., each named by its sequence hash (as the approximate
 * modes store them: such runs are in the block locator), below *parent_seq (NULL: the root). */
static void plain_chain(struct kvr_index_block *b, size_t n, const uint64_t *parent_seq,
                        uint64_t local0)
{
	uint64_t local[8], seq[8];
	for (size_t i = 0; i < n; i++)
		local[i] = local0 + i;
	kvr_hash_chain_locals(parent_seq, local, n, seq);
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_index_block){.ext_hash = seq[i], .local_hash = local[i]};
}

Test(index, full_run_id_space_is_erange_and_changes_nothing)
{
	if (getenv("KVR_INDEX_NO_LOCATOR"))
		cr_skip_test("ids are the block locator's: without it a run needs none");
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	idx->blk.id_limit = 100;
	struct kvr_index_block b[4];
	uint64_t first = 0;
	for (int k = 0; k < 100; k++) {
		plain_chain(b, 2, NULL, 77ull * (uint64_t)(k + 1));
		if (k == 0)
			first = b[0].ext_hash;
		cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 2), 0, "chain %d", k);
	}
	const uint64_t h99[2] = {b[0].ext_hash, b[1].ext_hash};
	kvr_index_quiesce(idx);
	const uint64_t size0 = kvr_index_tree_size(idx, r0), mem0 = kvr_index_memory_bytes(idx);
	struct kvr_index_stats st0, st1;
	kvr_index_stats_get(idx, &st0);
	/* Below chain 0's first block, a fork of 3 blocks: its first goes in, then the second
	 * needs an id. */
	plain_chain(b, 3, &first, 500);
	int rc = kvr_index_store(idx, r0, &first, b, 3);
	cr_assert_eq(rc, KVR_ERANGE, "rc %d, ids %u of %u", rc, idx->blk.live, idx->blk.dir_cap);
	plain_chain(b, 4, NULL, 600); /* a new root chain */
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 4), KVR_ERANGE);
	kvr_index_quiesce(idx);
	kvr_index_stats_get(idx, &st1);
	cr_assert_eq(kvr_index_tree_size(idx, r0), size0);
	/* Room reserved for the refused blocks (a table segment's growth) may stay, as after
	 * KVR_ENOMEM; what is held may not. */
	cr_assert_lt(kvr_index_memory_bytes(idx), mem0 + 4096);
	cr_assert_eq(st1.stored_blocks, st0.stored_blocks);
	cr_assert_eq(st1.nodes, st0.nodes);
	cr_assert_eq(st1.copies, st0.copies);
	cr_assert_eq(st1.invalid, st0.invalid);
	struct kvr_index_match m[4];
	size_t nm = 9;
	cr_assert_eq(match((const uint64_t[]){600, 601, 602, 603}, 4, false, m, 4, &nm), 0);
	cr_assert_eq(nm, 0, "a refused block is held");
	/* One block needs no id (its hash is the run header's). */
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 1), 0);
	/* Chain 99 goes: its id is reused. */
	cr_assert_eq(kvr_index_remove(idx, r0, h99, 2, NULL), 0);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 4), 0);
	cr_assert_eq(kvr_index_tree_size(idx, r0), size0 - 2 + 4);
}

/* Copy counting switched off by the only writer while blocks have extra copies: a block is then
 * one copy (the extras are dropped and counted removed), so one removal drops it and the gauges
 * say nothing is left; switched on again, a block stored once goes with one removal (no extra
 * copy survives its record).  Before, the extras stayed in the rank's copy map: copies stayed 1
 * with nothing held, and the entry outlived its record. */
Test(index, count_copies_switched_off_drops_extra_copies)
{
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	uint64_t q[2] = {1, 2}, e[2] = {100, 101};
	struct kvr_index_block b[2];
	chain(b, 2, 100, 1);
	kvr_index_set_count_copies(idx, true);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 2), 0);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 2), 0);
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 1), 0);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 5);
	kvr_index_set_count_copies(idx, false);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 2, "one copy a block");
	cr_assert_eq(st.stored_blocks - st.removed_blocks, st.copies);
	size_t nf;
	cr_assert_eq(kvr_index_remove(idx, r0, &e[1], 1, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(score_of(q, 2, r0), 1);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 1);
	cr_assert_eq(st.stored_blocks - st.removed_blocks, st.copies);
	/* On again: block 1 stored once goes with one removal; block 0 with one as well. */
	kvr_index_set_count_copies(idx, true);
	cr_assert_eq(kvr_index_store(idx, r0, &e[0], &b[1], 1), 0);
	cr_assert_eq(kvr_index_remove(idx, r0, e, 2, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(score_of(q, 2, r0), -1, "nothing held");
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.copies, 0);
	cr_assert_eq(st.nodes, 0);
	cr_assert_eq(kvr_index_tree_size(idx, r0), 0);
	kvr_index_quiesce(idx);
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.bytes_per_rank, 0, "no copy map left");
}

/* A run's first holder's record lives in the run header; when that holder leaves and one with
 * a record of its own stays, the stayer moves into the header (its bitmap, its copy counts):
 * the index then takes what it takes with the stayer alone, and the stayer's holes, copies and
 * score are what they were. */
Test(index, embedded_holder_leaves_and_the_stayer_moves_in)
{
	kvr_index_set_count_copies(idx, true);
	uint32_t a, b, c;
	kvr_index_rank_add(idx, 1, 0, &a);
	kvr_index_rank_add(idx, 2, 0, &b);
	kvr_index_rank_add(idx, 3, 0, &c);
	enum { N = 100 }; /* a bitmap of two words: a pointer in the record */
	struct kvr_index_block blk[N];
	chain(blk, N, 1000, 1);
	uint64_t q[N];
	for (int i = 0; i < N; i++)
		q[i] = 1 + (uint64_t)i;
	const uint64_t mem0 = kvr_index_memory_bytes(idx);
	cr_assert_eq(kvr_index_store(idx, b, NULL, blk, N), 0);
	kvr_index_quiesce(idx);
	const uint64_t alone = kvr_index_memory_bytes(idx) - mem0;
	cr_assert_eq(kvr_index_clear_rank(idx, b), 0);
	/* a first (the embedded record), then b and c; b keeps two copies of block 70, a hole
	 * at 40 */
	cr_assert_eq(kvr_index_store(idx, a, NULL, blk, N), 0);
	cr_assert_eq(kvr_index_store(idx, b, NULL, blk, N), 0);
	cr_assert_eq(kvr_index_store(idx, c, NULL, blk, 30), 0);
	cr_assert_eq(kvr_index_store(idx, b, &blk[69].ext_hash, &blk[70], 1), 0);
	uint64_t e40 = blk[40].ext_hash, e70 = blk[70].ext_hash;
	cr_assert_eq(kvr_index_remove(idx, b, &e40, 1, NULL), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, a), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, c), 0); /* b alone, in its own record: moves */
	cr_assert_eq(score_of(q, N, b), 40);
	cr_assert_eq(score_of(q, N, a), -1);
	cr_assert_eq(kvr_index_rank_blocks(idx, b, NULL, 0), N - 1);
	/* the copy count moved with the record: one remove of 70 keeps the block */
	cr_assert_eq(kvr_index_remove(idx, b, &e70, 1, NULL), 0);
	cr_assert_eq(kvr_index_rank_blocks(idx, b, NULL, 0), N - 1);
	cr_assert_eq(kvr_index_remove(idx, b, &e70, 1, NULL), 0);
	cr_assert_eq(kvr_index_rank_blocks(idx, b, NULL, 0), N - 2);
	/* the hole refilled: the cut runs on to the next hole (70) */
	cr_assert_eq(kvr_index_store(idx, b, &blk[39].ext_hash, &blk[40], 1), 0);
	cr_assert_eq(score_of(q, N, b), 70);
	cr_assert_eq(kvr_index_store(idx, b, &blk[69].ext_hash, &blk[70], 1), 0);
	cr_assert_eq(score_of(q, N, b), N);
	kvr_index_quiesce(idx);
	cr_assert_eq(kvr_index_memory_bytes(idx) - mem0, alone,
	             "the stayer in the header: %lu bytes, %lu for b alone",
	             (unsigned long)(kvr_index_memory_bytes(idx) - mem0), (unsigned long)alone);
	/* a new holder takes a record of its own, the header's being b's */
	cr_assert_eq(kvr_index_store(idx, a, NULL, blk, 10), 0);
	cr_assert_eq(score_of(q, N, a), 10);
	cr_assert_eq(kvr_index_clear_rank(idx, b), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, a), 0);
	kvr_index_quiesce(idx);
	/* Room reserved for the refused blocks (a table segment's growth) may stay, as after
	 * KVR_ENOMEM; what is held may not. */
	cr_assert_lt(kvr_index_memory_bytes(idx), mem0 + 4096);
}

Test(index, long_events_and_queries)
{
	enum { N = 8192 };
	uint32_t r0, r1;
	kvr_index_rank_add(idx, 1, 0, &r0);
	kvr_index_rank_add(idx, 2, 0, &r1);
	struct kvr_index_block *b = malloc(sizeof(*b) * N);
	uint64_t *q = malloc(sizeof(*q) * (N + 1));
	chain(b, N, 1000000, 77);
	for (size_t i = 0; i < N; i++)
		q[i] = 77 + i;
	q[N] = 5;
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, N), 0);
	cr_assert_eq(kvr_index_store(idx, r1, NULL, b, N / 2), 0);
	cr_assert_eq(score_of(q, N + 1, r0), N);
	cr_assert_eq(score_of(q, N + 1, r1), N / 2);
	/* Remove every other block of r0 from the back half. */
	uint64_t *rm = malloc(sizeof(*rm) * N);
	size_t k = 0;
	for (size_t i = N / 2 + 100; i < N; i += 2)
		rm[k++] = 1000000 + i;
	size_t nf;
	cr_assert_eq(kvr_index_remove(idx, r0, rm, k, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(score_of(q, N + 1, r0), N / 2 + 100);
	cr_assert_eq(kvr_index_tree_size(idx, r0), N - k);
	free(b);
	free(q);
	free(rm);
}

Test(index, memory_goes_back)
{
	int64_t live0 = kvr_alloc_live_bytes();
	uint64_t mem0 = kvr_index_memory_bytes(idx);
	uint32_t r[8];
	for (int i = 0; i < 8; i++)
		kvr_index_rank_add(idx, (uint64_t)i, 0, &r[i]);
	struct kvr_index_block b[256];
	for (int k = 0; k < 200; k++) {
		chain(b, 256, (uint64_t)k << 20, (uint64_t)k * 100000);
		for (int i = 0; i < 8; i++)
			if ((k + i) % 3 == 0)
				cr_assert_eq(kvr_index_store(idx, r[i], NULL, b, 256), 0);
	}
	uint64_t mem1 = kvr_index_memory_bytes(idx);
	cr_assert_gt(mem1, mem0 + 1000000);
	for (int i = 0; i < 8; i++)
		cr_assert_eq(kvr_index_clear_rank(idx, r[i]), 0);
	kvr_index_quiesce(idx);
	uint64_t mem2 = kvr_index_memory_bytes(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 0);
	cr_assert_lt(mem2, mem0 + 64 * 1024, "mem0=%lu mem1=%lu mem2=%lu", (unsigned long)mem0,
	             (unsigned long)mem1, (unsigned long)mem2);
	cr_assert_lt(kvr_alloc_live_bytes(), live0 + 64 * 1024);
}

/* 20,000 one-block chains (as many runs, all in one run-table segment: a root run's key is its
 * local hash, and these small ones share the top bits that pick the segment): the segment grows
 * through every capacity (16, 24, 32, 48, ... 49,152, steps of 1.5x and 2x), purges tombstones
 * and shrinks, and every run stays findable (score 1 for the holder) until removed. */
Test(index, many_runs_through_every_table_size)
{
	enum { N = 20000 };
	uint64_t mem0 = kvr_index_memory_bytes(idx);
	uint32_t r;
	cr_assert_eq(kvr_index_rank_add(idx, 1, 0, &r), 0);
	struct kvr_index_block b;
	for (uint64_t k = 0; k < N; k++) {
		chain(&b, 1, k + 1, k * 7919 + 13);
		cr_assert_eq(kvr_index_store(idx, r, NULL, &b, 1), 0);
	}
	for (uint64_t k = 0; k < N; k += 97) {
		uint64_t l = k * 7919 + 13;
		cr_assert_eq(score_of(&l, 1, r), 1, "run %lu", (unsigned long)k);
	}
	for (uint64_t k = 0; k < N; k += 2) { /* every other: tombstones, purges, shrinks */
		uint64_t e = k + 1;
		size_t nf = 1;
		cr_assert_eq(kvr_index_remove(idx, r, &e, 1, &nf), 0);
		cr_assert_eq(nf, 0);
	}
	for (uint64_t k = 0; k < N; k += 1 + k % 7) {
		uint64_t l = k * 7919 + 13;
		cr_assert_eq(score_of(&l, 1, r), k % 2 ? 1 : -1, "run %lu", (unsigned long)k);
	}
	for (uint64_t k = 1; k < N; k += 2) {
		uint64_t e = k + 1;
		cr_assert_eq(kvr_index_remove(idx, r, &e, 1, NULL), 0);
	}
	for (uint64_t k = 0; k < N; k += 97) {
		uint64_t l = k * 7919 + 13;
		cr_assert_eq(score_of(&l, 1, r), -1);
	}
	kvr_index_quiesce(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 0);
	cr_assert_lt(kvr_index_memory_bytes(idx), mem0 + 4096);
}

/* The packed fields at their limits: slots above 65,535 (their top 4 bits live apart from the
 * low 16 in a record), cuts and tops of 2,048 (a full run) and 32-word bitmaps.  Slots 65,537
 * and 1 share their low 16 bits, so a record that lost the high ones would mix them up. */
Test(index, packed_fields_at_their_limits)
{
	enum { RANKS = 65600, N = 2100 };
	kvr_index_destroy(idx);
	idx_slots = RANKS;
	cr_assert_eq(kvr_index_create(RANKS, &idx), 0);
	uint32_t a = UINT32_MAX, b = UINT32_MAX;
	for (uint32_t i = 0; i < RANKS; i++) {
		uint32_t s;
		cr_assert_eq(kvr_index_rank_add(idx, i, 0, &s), 0);
		if (s == 65537)
			a = s;
		if (s == 1)
			b = s;
	}
	cr_assert(a != UINT32_MAX && b != UINT32_MAX);
	struct kvr_index_block *c = malloc(sizeof(*c) * N);
	uint64_t *q = malloc(sizeof(*q) * N);
	chain(c, N, 1u << 30, 77);
	for (size_t i = 0; i < N; i++)
		q[i] = 77 + i;
	cr_assert_eq(kvr_index_store(idx, a, NULL, c, N), 0);
	cr_assert_eq(kvr_index_store(idx, b, NULL, c, 1000), 0);
	cr_assert_eq(score_of(q, N, a), N);
	cr_assert_eq(score_of(q, N, b), 1000);
	uint64_t e = c[2047].ext_hash; /* the last block of the first run: cut 2,047 */
	cr_assert_eq(kvr_index_remove(idx, a, &e, 1, NULL), 0);
	cr_assert_eq(score_of(q, N, a), 2047);
	cr_assert_eq(score_of(q, N, b), 1000);
	cr_assert_eq(kvr_index_store(idx, a, &c[2046].ext_hash, &c[2047], 1), 0);
	cr_assert_eq(score_of(q, N, a), N, "refilled: the cut is 2,048 again");
	e = c[5].ext_hash;
	cr_assert_eq(kvr_index_remove(idx, b, &e, 1, NULL), 0);
	cr_assert_eq(score_of(q, N, b), 5);
	cr_assert_eq(score_of(q, N, a), N);
	cr_assert_eq(kvr_index_rank_blocks(idx, a, NULL, 0), N);
	cr_assert_eq(kvr_index_rank_blocks(idx, b, NULL, 0), 999);
	cr_assert_eq(kvr_index_clear_rank(idx, a), 0);
	cr_assert_eq(score_of(q, N, a), -1);
	cr_assert_eq(score_of(q, N, b), 5);
	cr_assert_eq(kvr_index_tree_size(idx, a), 0);
	cr_assert_eq(kvr_index_tree_size(idx, b), 999);
	free(c);
	free(q);
}

Test(index, out_of_memory_loop)
{
	uint32_t r0, r1;
	kvr_index_rank_add(idx, 1, 0, &r0);
	kvr_index_rank_add(idx, 2, 0, &r1);
	struct kvr_index_block b[40];
	chain(b, 40, 100, 1);
	kvr_index_store(idx, r1, NULL, b, 20);
	/* Fail the nth allocation for n = 1, 2, ...: a clean error, the prefix applied, and the
	 * index still consistent (a full retry succeeds, removal never fails). */
	for (uint64_t nth = 1; nth < 200; nth++) {
		kvr_alloc_fail_after(nth);
		int rc = kvr_index_store(idx, r0, NULL, b, 40);
		kvr_alloc_fail_after(0);
		cr_assert(rc == 0 || rc == KVR_ENOMEM, "nth=%lu rc=%d", (unsigned long)nth, rc);
		cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 40), 0);
		uint64_t q[40];
		for (int i = 0; i < 40; i++)
			q[i] = 1 + (uint64_t)i;
		cr_assert_eq(score_of(q, 40, r0), 40);
		kvr_alloc_fail_after(nth);
		cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
		kvr_alloc_fail_after(0);
		cr_assert_eq(score_of(q, 40, r0), -1);
		cr_assert_eq(score_of(q, 40, r1), 20);
	}
}

struct snap {
	struct kvr_index_stats st;
	uint64_t blocks[128];
	size_t n;
	int score;
};

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void take(struct snap *sn, uint32_t slot, const uint64_t *q, size_t nq)
{
	kvr_index_stats_get(idx, &sn->st);
	sn->n = kvr_index_rank_blocks(idx, slot, sn->blocks, 128);
	cr_assert_leq(sn->n, 128);
	qsort(sn->blocks, sn->n, sizeof(uint64_t), cmp_u64);
	sn->score = score_of(q, nq, slot);
}

/* After a write refused when its nth allocation failed: takes *after and asserts the rank's
 * blocks, q's score and the copy count are what before had. */
static void same_as_before(const struct snap *before, struct snap *after, uint32_t slot,
                           const uint64_t *q, size_t nq, uint64_t nth)
{
	take(after, slot, q, nq);
	cr_assert_eq(after->n, before->n, "nth=%lu", (unsigned long)nth);
	cr_assert_arr_eq(after->blocks, before->blocks, before->n * sizeof(uint64_t));
	cr_assert_eq(after->score, before->score, "nth=%lu", (unsigned long)nth);
	cr_assert_eq(after->st.copies, before->st.copies, "nth=%lu", (unsigned long)nth);
}

/* The write of the SQLite-style tests below, which count copies: r1 holds a's 20 blocks (ext
 * 100.., local 1..), r0 its first `held` (*before: r0 as q sees it, scoring `held`); b (nb
 * blocks): copies of a's blocks 5 .. held-1, then new ones (ext 5000.., local 1000..) forking
 * off block held-1, stored below parent ext 104 (block 4); q (nq): a's first 5 local hashes,
 * then b's. */
static void oom_write_setup(uint32_t *r0, uint32_t *r1, size_t held, struct kvr_index_block *b,
                            size_t nb, uint64_t *q, size_t nq, struct snap *before)
{
	kvr_index_set_count_copies(idx, true);
	kvr_index_rank_add(idx, 1, 0, r0);
	kvr_index_rank_add(idx, 2, 0, r1);
	struct kvr_index_block a[20];
	chain(a, 20, 100, 1);
	cr_assert_eq(kvr_index_store(idx, *r1, NULL, a, 20), 0);
	cr_assert_eq(kvr_index_store(idx, *r0, NULL, a, held), 0);
	chain(b, held - 5, 105, 6);
	chain(b + held - 5, nb - (held - 5), 5000, 1000);
	for (size_t i = 0; i < 5; i++)
		q[i] = 1 + (uint64_t)i;
	for (size_t i = 5; i < nq; i++)
		q[i] = b[i - 5].local_hash;
	take(before, *r0, q, nq);
	cr_assert_eq(before->score, (int)held);
}

/* Stores b (n blocks, below parent ext 104) into r0 with its nth allocation failed for nth = 1,
 * 2, ... until it succeeds: every failure must return KVR_ENOMEM, leave r0 as before had it
 * (same_as_before, which takes *after) and pass also(r0, before, after, nth), the test's own
 * checks.  Returns the nth that succeeded. */
static uint64_t store_until_ok(uint32_t r0, const struct kvr_index_block *b, size_t n,
                               const uint64_t *q, size_t nq, const struct snap *before,
                               struct snap *after,
                               void (*also)(uint32_t r0, const struct snap *before,
                                            const struct snap *after, uint64_t nth))
{
	uint64_t nth, parent = 104;
	int rc = KVR_ENOMEM;
	for (nth = 1; nth < 1000 && rc != 0; nth++) {
		kvr_alloc_fail_after(nth);
		rc = kvr_index_store(idx, r0, &parent, b, n);
		kvr_alloc_fail_after(0);
		if (rc == 0)
			break;
		cr_assert_eq(rc, KVR_ENOMEM, "nth=%lu", (unsigned long)nth);
		same_as_before(before, after, r0, q, nq, nth);
		also(r0, before, after, nth);
	}
	cr_assert_eq(rc, 0);
	return nth;
}

/* out_of_memory_changes_nothing's own checks after a failure: no node, the tree's size. */
static void nodes_and_size_kept(uint32_t r0, const struct snap *before, const struct snap *after,
                                uint64_t nth)
{
	cr_assert_eq(after->st.nodes, before->st.nodes, "nth=%lu", (unsigned long)nth);
	cr_assert_eq(kvr_index_tree_size(idx, r0), before->n);
}

/* SQLite-style: fail the nth allocation of one store that forks a run, adds copies, grows
 * maps, holder sets and the table, for n = 1, 2, ... until it succeeds; every failure must
 * return KVR_ENOMEM and leave the index exactly as it was. */
Test(index, out_of_memory_changes_nothing)
{
	uint32_t r0, r1;
	struct kvr_index_block b[40];
	uint64_t q[45];
	struct snap before, after;
	/* The write: copies of blocks 5..9, then 35 new ones forking off block 9. */
	oom_write_setup(&r0, &r1, 10, b, 40, q, 45, &before);
	uint64_t nth = store_until_ok(r0, b, 40, q, 45, &before, &after, nodes_and_size_kept);
	cr_assert_gt(nth, 4, "the write allocates at several sites");
	cr_assert_eq(score_of(q, 45, r0), 45);
	take(&after, r0, q, 45);
	cr_assert_eq(after.n, 10 + 35);
	cr_assert_eq(after.st.copies, 20 + 10 + 5 + 35);
}

/* Chains longer than one run (IDX_RUN_MAX blocks) continue in a child run: matched, trimmed
 * and removed across the boundary like any other. */
Test(index, chains_longer_than_a_run)
{
	enum { N = 70000 };
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	struct kvr_index_block *b = malloc(sizeof(*b) * N);
	uint64_t *q = malloc(sizeof(*q) * N);
	chain(b, N, 1u << 30, 5);
	for (size_t i = 0; i < N; i++)
		q[i] = 5 + i;
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, N), 0);
	cr_assert_eq(score_of(q, N, r0), N);
	/* Drop the tail back to 30000 (across two run boundaries), then store it again. */
	uint64_t *rm = malloc(sizeof(*rm) * N);
	for (size_t i = 30000; i < N; i++)
		rm[i - 30000] = b[i].ext_hash;
	size_t nf;
	cr_assert_eq(kvr_index_remove(idx, r0, rm, N - 30000, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(score_of(q, N, r0), 30000);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 30000, "the trimmed blocks left the tree");
	cr_assert_eq(kvr_index_store(idx, r0, &b[29999].ext_hash, b + 30000, N - 30000), 0);
	cr_assert_eq(score_of(q, N, r0), N);
	cr_assert_eq(kvr_index_tree_size(idx, r0), N);
	free(b);
	free(q);
	free(rm);
}

/* Positions of a run are write-once: after a trim, a different block at a trimmed position
 * forks a child run, and the old block stored again re-extends the run in place. */
Test(index, trim_then_fork_then_reextend)
{
	uint32_t a, bb;
	kvr_index_rank_add(idx, 1, 0, &a);
	kvr_index_rank_add(idx, 2, 0, &bb);
	struct kvr_index_block x[10], y[3];
	chain(x, 10, 100, 1); /* X: locals 1..10 */
	chain(y, 3, 900, 50); /* Y: locals 50..52, below X[4] */
	cr_assert_eq(kvr_index_store(idx, a, NULL, x, 10), 0);
	uint64_t rm[5] = {105, 106, 107, 108, 109};
	cr_assert_eq(kvr_index_remove(idx, a, rm, 5, NULL), 0);
	uint64_t p4 = 104;
	cr_assert_eq(kvr_index_store(idx, a, &p4, y, 3), 0);
	cr_assert_eq(kvr_index_store(idx, bb, NULL, x, 10), 0);
	uint64_t qx[10], qy[8];
	for (int i = 0; i < 10; i++)
		qx[i] = 1 + (uint64_t)i;
	for (int i = 0; i < 5; i++)
		qy[i] = 1 + (uint64_t)i;
	for (int i = 0; i < 3; i++)
		qy[5 + i] = 50 + (uint64_t)i;
	cr_assert_eq(score_of(qx, 10, a), 5);
	cr_assert_eq(score_of(qx, 10, bb), 10);
	cr_assert_eq(score_of(qy, 8, a), 8);
	cr_assert_eq(score_of(qy, 8, bb), 5);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 13);
	/* A hole in the middle cuts a's match there; filling it raises it back. */
	uint64_t h = 102;
	cr_assert_eq(kvr_index_remove(idx, bb, &h, 1, NULL), 0);
	cr_assert_eq(score_of(qx, 10, bb), 2);
	uint64_t p1 = 101;
	cr_assert_eq(kvr_index_store(idx, bb, &p1, &x[2], 1), 0);
	cr_assert_eq(score_of(qx, 10, bb), 10);
}

/* Blocks removed in random order from chains longer than a run: every removal finds its block
 * (through the block locator, whose entries do not record positions: the writer finds them in
 * the run's hashes), scores stop at the first hole, tree sizes count exactly, and the blocks
 * stored again in chain order bring the score back.  Rank a stores with ext = seq (the
 * approximate modes), rank b with engine hashes (events mode: ext -> seq first). */
Test(index, random_removals_in_long_chains)
{
	enum { N = 5000, K = 3000 };
	uint32_t a, bb;
	kvr_index_rank_add(idx, 1, 0, &a);
	kvr_index_rank_add(idx, 2, 0, &bb);
	struct kvr_index_block *ba = malloc(sizeof(*ba) * N), *bx = malloc(sizeof(*bx) * N);
	uint64_t *q = malloc(sizeof(*q) * N), *seq = malloc(sizeof(*seq) * N);
	for (size_t i = 0; i < N; i++)
		q[i] = 7000 + i;
	kvr_hash_chain_locals(NULL, q, N, seq);
	chain(bx, N, 1ull << 40, 7000);
	for (size_t i = 0; i < N; i++)
		ba[i] = (struct kvr_index_block){.ext_hash = seq[i], .local_hash = q[i]};
	cr_assert_eq(kvr_index_store(idx, a, NULL, ba, N), 0);
	cr_assert_eq(kvr_index_store(idx, bb, NULL, bx, N), 0);
	uint32_t slot[2] = {a, bb};
	struct kvr_index_block *blk[2] = {ba, bx};
	uint64_t rng = 12345;
	for (int r = 0; r < 2; r++) {
		uint32_t *perm = malloc(sizeof(*perm) * N);
		bool *gone = calloc(N, sizeof(bool));
		for (uint32_t i = 0; i < N; i++)
			perm[i] = i;
		for (uint32_t i = N - 1; i > 0; i--) {
			rng = rng * 6364136223846793005ull + 1442695040888963407ull;
			uint32_t j = (uint32_t)((rng >> 33) % (i + 1)), t = perm[i];
			perm[i] = perm[j];
			perm[j] = t;
		}
		size_t first_gone = N;
		for (size_t k = 0; k < K; k++) {
			size_t nf = 9;
			cr_assert_eq(
			    kvr_index_remove(idx, slot[r], &blk[r][perm[k]].ext_hash, 1, &nf), 0);
			cr_assert_eq(nf, 0, "rank %d removal %zu (position %u)", r, k, perm[k]);
			gone[perm[k]] = true;
			if (perm[k] < first_gone)
				first_gone = perm[k];
			if (k % 500 == 499) {
				cr_assert_eq(score_of(q, N, slot[r]),
				             first_gone ? (int)first_gone : -1);
				cr_assert_eq(kvr_index_tree_size(idx, slot[r]), N - k - 1);
			}
		}
		size_t nf = 0;
		kvr_index_remove(idx, slot[r], &blk[r][perm[0]].ext_hash, 1, &nf);
		cr_assert_eq(nf, 1, "a removed block is not found again");
		for (size_t i = 0; i < N; i++)
			if (gone[i])
				cr_assert_eq(kvr_index_store(idx, slot[r],
				                             i ? &blk[r][i - 1].ext_hash : NULL,
				                             &blk[r][i], 1),
				             0, "rank %d position %zu", r, i);
		cr_assert_eq(score_of(q, N, slot[r]), N,
		             "a refilled hole raises the cut back over every word");
		cr_assert_eq(kvr_index_tree_size(idx, slot[r]), N);
		free(perm);
		free(gone);
	}
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, N);
	free(ba);
	free(bx);
	free(q);
	free(seq);
}

/* The first store into an empty index allocates at every site a store can (the run, its hash
 * array, the run table, the block locator and its id directory, the holder record): failing
 * the nth allocation for n = 1, 2, ... must return KVR_ENOMEM and leave the index empty, memory
 * included, until the store succeeds. */
Test(index, out_of_memory_first_store)
{
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	struct kvr_index_block b[40];
	chain(b, 40, 100, 1);
	uint64_t q[40];
	for (int i = 0; i < 40; i++)
		q[i] = 1 + (uint64_t)i;
	kvr_index_quiesce(idx);
	const uint64_t mem0 = kvr_index_memory_bytes(idx);
	int rc = KVR_ENOMEM;
	uint64_t nth;
	for (nth = 1; nth < 100 && rc != 0; nth++) {
		kvr_alloc_fail_after(nth);
		/* one block first: the run must grow past one position (the locator id) */
		rc = kvr_index_store(idx, r0, NULL, b, 1);
		if (rc == 0)
			rc = kvr_index_store(idx, r0, &b[0].ext_hash, b + 1, 39);
		kvr_alloc_fail_after(0);
		if (rc == 0)
			break;
		cr_assert_eq(rc, KVR_ENOMEM, "nth=%lu", (unsigned long)nth);
		if (kvr_index_tree_size(idx, r0) == 1) /* the one-block store went in */
			cr_assert_eq(kvr_index_remove(idx, r0, &b[0].ext_hash, 1, NULL), 0);
		cr_assert_eq(kvr_index_tree_size(idx, r0), 0, "nth=%lu", (unsigned long)nth);
		kvr_index_quiesce(idx);
		cr_assert_eq(kvr_index_memory_bytes(idx), mem0, "nth=%lu mem %lu vs %lu",
		             (unsigned long)nth, (unsigned long)kvr_index_memory_bytes(idx),
		             (unsigned long)mem0);
	}
	cr_assert_eq(rc, 0);
	cr_assert_gt(nth, 5, "the first stores allocate at several sites");
	cr_assert_eq(score_of(q, 40, r0), 40);
}

/* 64 ranks on one hot prefix P (8 blocks), then branches below it: B_x (x = rank % 8, a random
 * depth of 16 blocks each: few holders for many active ranks, the galloping search of
 * core/index_match.c), C (every rank but one, all whole: the lined-up loop) and D (odd ranks:
 * the merge).  Rank 62 holds only P[0, 5), rank 63 has a hole at position 12.  Every rank's
 * score and tree size must be exact on every path. */
static void store_path(uint32_t slot, uint64_t branch, size_t n)
{
	struct kvr_index_block b[24];
	for (size_t i = 0; i < 24; i++) {
		b[i].local_hash = i < 8 ? 1 + i : branch + i;
		b[i].ext_hash = i < 8 ? 1000 + i : branch * 1000 + i;
	}
	cr_assert_eq(kvr_index_store(idx, slot, NULL, b, n), 0);
}

static uint32_t depth_of(int r)
{
	return r == 62 ? 5 : 9 + (uint32_t)(r * 7 % 16);
}

Test(index, many_holders_every_intersection_path)
{
	uint32_t s[64];
	for (int r = 0; r < 64; r++)
		cr_assert_eq(kvr_index_rank_add(idx, (uint64_t)r + 1, 0, &s[r]), 0);
	for (int r = 0; r < 64; r++)
		store_path(s[r], 100 * (uint64_t)(r % 8 + 1), depth_of(r));
	uint64_t hole = 100 * 8 * 1000 + 12; /* rank 63: x = 7 */
	size_t nf = 0;
	kvr_index_remove(idx, s[63], &hole, 1, &nf);
	cr_assert_eq(nf, 0);
	for (int r = 0; r < 64; r++) {
		if (r != 62)
			store_path(s[r], 5000, 24);
		if (r % 2)
			store_path(s[r], 7000, 24);
	}
	struct kvr_index_match out[64];
	for (int path = 0; path < 10; path++) { /* B_0 .. B_7, C, D */
		const uint64_t br = path < 8 ? 100 * (uint64_t)(path + 1) : path == 8 ? 5000 : 7000;
		uint64_t q[25];
		for (size_t i = 0; i < 24; i++)
			q[i] = i < 8 ? 1 + i : br + i;
		q[24] = 99999; /* a tail nobody holds */
		size_t n = 0;
		cr_assert_eq(match(q, 25, false, out, 64, &n), 0);
		cr_assert_eq(n, 64, "path %d", path);
		bool seen[64] = {false};
		for (size_t i = 0; i < n; i++) {
			int r = -1;
			for (int j = 0; j < 64; j++)
				if (s[j] == out[i].slot)
					r = j;
			cr_assert(r >= 0 && !seen[r], "path %d: slot %u once", path, out[i].slot);
			seen[r] = true;
			uint32_t want = 8;
			if (r == 62)
				want = 5;
			else if (path < 8 && r % 8 == path)
				want = r == 63 ? 12 : depth_of(r);
			else if ((path == 8) || (path == 9 && r % 2))
				want = 24;
			cr_assert_eq(out[i].score, want, "path %d rank %d", path, r);
			uint64_t ts = r == 62 ? 5 : depth_of(r) - (r == 63) + 16 + (r % 2 ? 16 : 0);
			cr_assert_eq(out[i].tree_size, ts, "path %d rank %d", path, r);
		}
		/* The ranks still matching at the end (score 24: the whole branch) come first. */
		bool dropped = false;
		for (size_t i = 0; i < n; i++) {
			cr_assert(!(dropped && out[i].score == 24), "path %d", path);
			dropped = dropped || out[i].score != 24;
		}
	}
}

/* A run's hash array is a size class exactly (its header word is s[0], position 0's hash is the
 * run's first): a chain stored one block at a time grows its array through every class step
 * (2, 4, 6, 8, 10, ... words) and stays matchable at every length, including overlaps of one
 * block (which find_matches credits without reading s[0]); a fork entered with one block of
 * overlap scores it; a 512-block chain of one holder costs at most 16 bytes per block. */
Test(index, hash_arrays_grow_through_size_classes)
{
	enum { N = 300 };
	uint32_t r0, r1;
	kvr_index_rank_add(idx, 1, 0, &r0);
	kvr_index_rank_add(idx, 2, 0, &r1);
	struct kvr_index_block b[N];
	uint64_t q[N + 1];
	chain(b, N, 1000, 7);
	for (size_t i = 0; i < N; i++)
		q[i] = 7 + i;
	q[N] = 99999;
	for (size_t i = 0; i < N; i++) {
		cr_assert_eq(kvr_index_store(idx, r0, i ? &b[i - 1].ext_hash : NULL, &b[i], 1), 0);
		cr_assert_eq(score_of(q, i + 1, r0), (int)(i + 1));
		cr_assert_eq(score_of(q, 1, r0), 1);
		cr_assert_eq(score_of(q, i + 2, r0), (int)(i + 1));
	}
	uint64_t miss[2] = {7, 12345};
	cr_assert_eq(score_of(miss, 2, r0), 1);
	/* r1 forks below position 4 (blocks 7..11, then 500, 501): entered with one block. */
	struct kvr_index_block f[7];
	chain(f, 5, 1000, 7);
	chain(f + 5, 2, 5000, 500);
	cr_assert_eq(kvr_index_store(idx, r1, NULL, f, 7), 0);
	uint64_t qf[6] = {7, 8, 9, 10, 11, 500};
	cr_assert_eq(score_of(qf, 6, r1), 6);
	cr_assert_eq(score_of(qf, 6, r0), 5);
	uint64_t qf2[7] = {7, 8, 9, 10, 11, 500, 501};
	cr_assert_eq(score_of(qf2, 7, r1), 7);
	/* Memory of 64 chains of 512 blocks of one holder, in a fresh index (what the issue's
	 * target counts: bench_index_runs' index_memory). */
	kvr_index_destroy(idx);
	cr_assert_eq(kvr_index_create(64, &idx), 0);
	kvr_index_rank_add(idx, 1, 0, &r0);
	const uint64_t mem0 = kvr_index_memory_bytes(idx);
	struct kvr_index_block c[512];
	uint64_t loc[512], sq[512];
	for (uint64_t k = 0; k < 64; k++) {
		for (size_t i = 0; i < 512; i++)
			loc[i] = ((k + 1) << 20) + i;
		kvr_hash_chain_locals(NULL, loc, 512, sq);
		for (size_t i = 0; i < 512; i++) /* ext = seq: no per-rank ext maps */
			c[i] = (struct kvr_index_block){.ext_hash = sq[i], .local_hash = loc[i]};
		cr_assert_eq(kvr_index_store(idx, r0, NULL, c, 512), 0);
	}
	const uint64_t mem = kvr_index_memory_bytes(idx) - mem0;
	cr_assert_leq(mem, 16 * 64 * 512, "%.2f bytes per held block", (double)mem / (64 * 512));
}

/* The walk guesses where a query leaves a run at the run's largest child offset (a session's
 * next turn leaves its previous turn's run there) and checks the guess with two comparisons:
 * every divergence point, before, at and after the children's offsets, with the guess right,
 * wrong, 1 (a child below position 0) and stale (the deepest child gone, the bound kept), must
 * score exactly the matched prefix. */
/* Runs the walk of a query (local hashes, chained here) crosses: kvr_index_path_runs. */
static size_t path_runs(const uint64_t *local, size_t n)
{
	uint64_t *seq = malloc(n * sizeof(*seq));
	kvr_hash_chain_locals(NULL, local, n, seq);
	kvr_rcu_read_lock();
	size_t runs = kvr_index_path_runs(idx, seq, n);
	kvr_rcu_read_unlock();
	free(seq);
	return runs;
}

Test(index, walk_guesses_at_child_offsets)
{
	uint32_t a;
	kvr_index_rank_add(idx, 1, 0, &a);
	struct kvr_index_block x[64], y1[5], y2[7], z[30], z1[3];
	chain(x, 64, 100, 1);    /* X: locals 1..64 */
	chain(y1, 5, 300, 200);  /* below X[19]: offset 20 */
	chain(y2, 7, 400, 250);  /* below X[39]: offset 40, the largest */
	chain(z, 30, 500, 600);  /* Z: locals 600..629 */
	chain(z1, 3, 700, 1000); /* below Z[0]: offset 1 */
	cr_assert_eq(kvr_index_store(idx, a, NULL, x, 64), 0);
	uint64_t p = 119;
	cr_assert_eq(kvr_index_store(idx, a, &p, y1, 5), 0);
	p = 139;
	cr_assert_eq(kvr_index_store(idx, a, &p, y2, 7), 0);
	cr_assert_eq(kvr_index_store(idx, a, NULL, z, 30), 0);
	p = 500;
	cr_assert_eq(kvr_index_store(idx, a, &p, z1, 3), 0);
	uint64_t q[80];
	for (int round = 0; round < 2; round++) {
		for (int d = 1; d <= 64; d++) { /* X's first d blocks, then a block nobody has */
			for (int i = 0; i < d; i++)
				q[i] = 1 + (uint64_t)i;
			for (int i = d; i < 70; i++)
				q[i] = 5000 + (uint64_t)i;
			cr_assert_eq(score_of(q, 70, a), d, "round %d d %d", round, d);
			cr_assert_eq(score_of(q, (size_t)d, a), d, "round %d d %d", round, d);
		}
		for (int i = 0; i < 20; i++)
			q[i] = 1 + (uint64_t)i;
		for (int i = 0; i < 5; i++)
			q[20 + i] = 200 + (uint64_t)i;
		q[25] = 5000;
		cr_assert_eq(score_of(q, 26, a), 25, "round %d", round);
		cr_assert_eq(path_runs(q, 26), 2); /* X, then Y1 */
		cr_assert_eq(path_runs(q, 20), 1);
		for (int i = 0; i < 40; i++)
			q[i] = 1 + (uint64_t)i;
		for (int i = 0; i < 7; i++)
			q[40 + i] = 250 + (uint64_t)i;
		cr_assert_eq(score_of(q, 47, a), round == 0 ? 47 : 40, "round %d", round);
		cr_assert_eq(path_runs(q, 47), round == 0 ? 2 : 1);
		for (int d = 1; d <= 30; d++) { /* Z: the guess is 1 */
			for (int i = 0; i < d; i++)
				q[i] = 600 + (uint64_t)i;
			q[d] = 5000;
			cr_assert_eq(score_of(q, (size_t)d + 1, a), d, "round %d z %d", round, d);
		}
		q[0] = 600;
		for (int i = 0; i < 3; i++)
			q[1 + i] = 1000 + (uint64_t)i;
		cr_assert_eq(score_of(q, 4, a), 4, "round %d", round);
		/* Round 1: Y2 gone; X's largest child offset stays 40 (a bound kept while X's
		 * holder needs the whole run), so the guess is stale. */
		uint64_t rm[7];
		for (int i = 0; i < 7; i++)
			rm[i] = 400 + (uint64_t)i;
		cr_assert_eq(kvr_index_remove(idx, a, rm, 7, NULL), 0);
	}
}

/* The tree sizes find_matches reports are published in steps (core/index_internal.h:
 * idx_size_set): exact below 64 blocks and at 0, within 1/64 of the exact count above, exact
 * after kvr_index_quiesce; kvr_index_tree_size is always exact. */
static uint64_t reported_size(const uint64_t *local, size_t n, uint32_t slot)
{
	struct kvr_index_match out[4];
	size_t k = 0;
	cr_assert_eq(match(local, n, false, out, 4, &k), 0);
	for (size_t i = 0; i < k; i++)
		if (out[i].slot == slot)
			return out[i].tree_size;
	cr_assert_fail("slot %u not reported", slot);
	return 0;
}

Test(index, tree_sizes_published_in_steps)
{
	enum { N = 1000 };
	uint32_t r0;
	kvr_index_rank_add(idx, 1, 0, &r0);
	struct kvr_index_block b[N];
	uint64_t q[N];
	chain(b, N, 5000, 300);
	for (size_t i = 0; i < N; i++)
		q[i] = 300 + i;
	/* Small: every change is published. */
	cr_assert_eq(kvr_index_store(idx, r0, NULL, b, 40), 0);
	cr_assert_eq(reported_size(q, N, r0), 40);
	uint64_t e = 5039;
	cr_assert_eq(kvr_index_remove(idx, r0, &e, 1, NULL), 0);
	cr_assert_eq(reported_size(q, N, r0), 39);
	/* Large: a change within 1/64 is not published (the readers' line stays), a larger one
	 * is. */
	cr_assert_eq(kvr_index_store(idx, r0, &b[38].ext_hash, b + 39, N - 39), 0);
	cr_assert_eq(reported_size(q, N, r0), N);
	uint64_t tail[10];
	for (int i = 0; i < 10; i++)
		tail[i] = 5000 + N - 10 + (uint64_t)i;
	cr_assert_eq(kvr_index_remove(idx, r0, tail, 10, NULL), 0);
	cr_assert_eq(kvr_index_tree_size(idx, r0), N - 10, "exact for the writer");
	cr_assert_eq(reported_size(q, N, r0), N, "10 of 990: within 1/64, not published");
	cr_assert_eq(kvr_index_store(idx, r0, &b[N - 11].ext_hash, b + N - 10, 10), 0);
	cr_assert_eq(reported_size(q, N, r0), N, "back where it was: nothing stored");
	uint64_t more[40];
	for (int i = 0; i < 40; i++)
		more[i] = 5000 + N - 40 + (uint64_t)i;
	cr_assert_eq(kvr_index_remove(idx, r0, more, 40, NULL), 0);
	cr_assert_eq(reported_size(q, N, r0), N - 40, "40 of 960: published");
	cr_assert_eq(kvr_index_store(idx, r0, &b[N - 41].ext_hash, b + N - 40, 10), 0);
	cr_assert_eq(kvr_index_tree_size(idx, r0), N - 30);
	cr_assert_eq(reported_size(q, N, r0), N - 40);
	kvr_index_quiesce(idx);
	cr_assert_eq(reported_size(q, N, r0), N - 30, "exact after quiesce");
	cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
	cr_assert_eq(kvr_index_tree_size(idx, r0), 0);
}

/* Events mode's names (core/index_xmap.c): a block stored under an ext hash that is not its
 * sequence hash is named by that alias only.  Named by its sequence hash it is unknown to a
 * removal and a parent, and storing it again under that name (or another) is refused; a plain
 * block's sequence hash cannot become another block's alias.  kvr_index_rank_blocks lists the
 * aliases and the plain blocks' hashes.  The alias bits follow a record that moves into its
 * run's header when the run's other holder leaves. */
Test(index, aliases_refused_and_listed)
{
	uint32_t r, o;
	kvr_index_rank_add(idx, 1, 0, &r);
	kvr_index_rank_add(idx, 2, 0, &o);
	enum { N = 70 }; /* two bitmap words: alias bits in both */
	struct kvr_index_block b[N], p[N];
	uint64_t local[N], seq[N];
	for (int i = 0; i < N; i++)
		local[i] = 1 + (uint64_t)i;
	kvr_hash_chain_locals(NULL, local, N, seq);
	for (int i = 0; i < N; i++) {
		/* even positions under an alias, odd ones plain */
		b[i] = (struct kvr_index_block){.ext_hash = i % 2 ? seq[i] : 900000 + (uint64_t)i,
		                                .local_hash = local[i]};
		p[i] = (struct kvr_index_block){.ext_hash = seq[i], .local_hash = local[i]};
	}
	cr_assert_eq(kvr_index_store(idx, o, NULL, p, N), 0); /* o first: r gets a record */
	cr_assert_eq(kvr_index_store(idx, r, NULL, b, N), 0);
	cr_assert_eq(score_of(local, N, r), N);
	for (int pass = 0; pass < 2; pass++) { /* pass 1: after r's record moved */
		uint64_t got[N], want[N];
		cr_assert_eq(kvr_index_rank_blocks(idx, r, got, N), N);
		for (int i = 0; i < N; i++)
			want[i] = b[i].ext_hash;
		qsort(got, N, sizeof(uint64_t), cmp_u64);
		qsort(want, N, sizeof(uint64_t), cmp_u64);
		cr_assert_arr_eq(got, want, sizeof(got), "pass %d", pass);
		for (int i = 0; i < N; i += 2) {
			/* the aliased block under its sequence hash: held under another name */
			cr_assert_eq(
			    kvr_index_store(idx, r, i ? &b[i - 1].ext_hash : NULL, &p[i], 1),
			    KVR_EINVAL, "pass %d block %d", pass, i);
			size_t nf = 0;
			cr_assert_eq(kvr_index_remove(idx, r, &seq[i], 1, &nf), 0);
			cr_assert_eq(nf, 1, "pass %d block %d: removed by its sequence hash", pass,
			             i);
			struct kvr_index_block c = {.ext_hash = 777000 + (uint64_t)i,
			                            .local_hash = 99};
			cr_assert_eq(kvr_index_store(idx, r, &seq[i], &c, 1), KVR_ENOENT,
			             "pass %d block %d: a parent named by its sequence hash", pass,
			             i);
		}
		for (int i = 1; i < N; i += 2) { /* a plain block's hash as another's alias */
			struct kvr_index_block c = {.ext_hash = seq[i], .local_hash = 12345};
			cr_assert_eq(kvr_index_store(idx, r, NULL, &c, 1), KVR_EINVAL);
		}
		cr_assert_eq(kvr_index_tree_size(idx, r), N);
		cr_assert_eq(score_of(local, N, r), N);
		if (pass == 0) /* r alone: its record moves into the run's header */
			cr_assert_eq(kvr_index_clear_rank(idx, o), 0);
	}
	/* Removed by its alias, a block can come back under its sequence hash. */
	cr_assert_eq(kvr_index_remove(idx, r, &b[N - 2].ext_hash, 1, NULL), 0);
	cr_assert_eq(kvr_index_store(idx, r, &b[N - 3].ext_hash, &p[N - 2], 1), 0);
	uint64_t got[N];
	cr_assert_eq(kvr_index_rank_blocks(idx, r, got, N), N);
	bool seen = false;
	for (int i = 0; i < N; i++)
		seen |= got[i] == seq[N - 2];
	cr_assert(seen);
	size_t nf = 0;
	cr_assert_eq(kvr_index_remove(idx, r, &seq[N - 2], 1, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(kvr_index_clear_rank(idx, r), 0);
	kvr_index_quiesce(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.bytes_per_rank, 0, "the ext maps and alias bits freed");
}

/* out_of_memory_with_aliases_changes_nothing's own check after a failure: the names still
 * refuse and resolve as before. */
static void names_kept(uint32_t r0, const struct snap *before, const struct snap *after,
                       uint64_t nth)
{
	(void)before, (void)after, (void)nth;
	struct kvr_index_block c = {.ext_hash = 100, .local_hash = 4242};
	cr_assert_eq(kvr_index_store(idx, r0, NULL, &c, 1), KVR_EINVAL);
}

/* SQLite-style over a write that grows the ext map and the alias bits' map (new records, new
 * bitmap words) while forking and copying: every failure returns KVR_ENOMEM and leaves the
 * rank's blocks, names, score and copies as they were. */
Test(index, out_of_memory_with_aliases_changes_nothing)
{
	uint32_t r0, r1;
	struct kvr_index_block b[100];
	uint64_t q[100];
	struct snap before, after;
	/* a's ext 100.. != the sequence hashes: aliases.  The write: copies of 5..12, then 92 new
	 * aliased blocks forking off block 12 (two bitmap words). */
	oom_write_setup(&r0, &r1, 13, b, 100, q, 100, &before);
	uint64_t nth = store_until_ok(r0, b, 100, q, 100, &before, &after, names_kept);
	cr_assert_gt(nth, 6, "the write allocates at several sites");
	take(&after, r0, q, 100);
	cr_assert_eq(after.n, 13 + 92);
	cr_assert_eq(after.score, 100);
	cr_assert_eq(kvr_index_clear_rank(idx, r0), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, r1), 0);
	kvr_index_quiesce(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.bytes_per_rank, 0);
}

/* A rank whose blocks are all aliased (vLLM's: engine hashes) keeps no alias bits; the first
 * plain block it takes gives every held position its bit (one allocation, so an OOM site) and a
 * failed write gives that back: the rank's bytes as before, names and refusals unchanged. */
Test(index, all_aliased_rank_turns_mixed)
{
	uint32_t r;
	kvr_index_rank_add(idx, 1, 0, &r);
	enum { N = 150, M = 75 }; /* the plain blocks fork below block M - 1: new run, record */
	struct kvr_index_block a[N], p[4];
	chain(a, N, 70000, 1); /* aliases */
	cr_assert_eq(kvr_index_store(idx, r, NULL, a, N), 0);
	uint64_t local[N], seq[N], plocal[4], pseq[4];
	for (int i = 0; i < N; i++)
		local[i] = 1 + (uint64_t)i;
	kvr_hash_chain_locals(NULL, local, N, seq);
	for (int i = 0; i < 4; i++)
		plocal[i] = 5000 + (uint64_t)i;
	kvr_hash_chain_locals(&seq[M - 1], plocal, 4, pseq);
	for (int i = 0; i < 4; i++)
		p[i] = (struct kvr_index_block){.ext_hash = pseq[i], .local_hash = plocal[i]};
	struct kvr_index_stats st0, st;
	kvr_index_quiesce(idx);
	kvr_index_stats_get(idx, &st0);
	uint64_t nth;
	int rc = KVR_ENOMEM;
	for (nth = 1; nth < 100 && rc != 0; nth++) {
		kvr_alloc_fail_after(nth);
		rc = kvr_index_store(idx, r, &a[M - 1].ext_hash, p, 4);
		kvr_alloc_fail_after(0);
		if (rc == 0)
			break;
		cr_assert_eq(rc, KVR_ENOMEM, "nth=%lu", (unsigned long)nth);
		kvr_index_quiesce(idx);
		kvr_index_stats_get(idx, &st);
		cr_assert_eq(st.bytes_per_rank, st0.bytes_per_rank, "nth=%lu", (unsigned long)nth);
		cr_assert_eq(kvr_index_tree_size(idx, r), N);
		cr_assert_eq(kvr_index_rank_blocks(idx, r, NULL, 0), N);
	}
	cr_assert_eq(rc, 0);
	cr_assert_gt(nth, 2, "the alias bits and the fork allocate");
	uint64_t q[M + 4];
	memcpy(q, local, M * sizeof(uint64_t));
	memcpy(q + M, plocal, sizeof(plocal));
	cr_assert_eq(score_of(q, M + 4, r), M + 4);
	uint64_t got[N + 4];
	cr_assert_eq(kvr_index_rank_blocks(idx, r, got, N + 4), N + 4);
	qsort(got, N + 4, sizeof(uint64_t), cmp_u64);
	for (int i = 0; i < N; i++)
		cr_assert(bsearch(&a[i].ext_hash, got, N + 4, sizeof(uint64_t), cmp_u64));
	for (int i = 0; i < 4; i++)
		cr_assert(bsearch(&pseq[i], got, N + 4, sizeof(uint64_t), cmp_u64));
	/* the aliased blocks still refuse their sequence hashes, the plain ones their aliases */
	size_t nf = 0;
	cr_assert_eq(kvr_index_remove(idx, r, &seq[7], 1, &nf), 0);
	cr_assert_eq(nf, 1);
	struct kvr_index_block c = {.ext_hash = pseq[1], .local_hash = 31337};
	cr_assert_eq(kvr_index_store(idx, r, NULL, &c, 1), KVR_EINVAL);
	cr_assert_eq(kvr_index_remove(idx, r, &pseq[1], 1, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(kvr_index_tree_size(idx, r), N + 3);
}

/* Rank add/remove churn while every allocation fails: the slot table cannot purge its
 * tombstones, and an add that would take an empty entry is refused (KVR_ENOMEM) so that a
 * quarter of the table stays empty.  Before, the churn used every empty entry up (145 pairs on
 * an 8-rank index), and the next lookup of an absent rank spun for good. */
Test(index, slot_table_keeps_empty_entries_without_memory, .timeout = 30)
{
	struct kvr_index *x;
	cr_assert_eq(kvr_index_create(8, &x), 0);
	kvr_alloc_fail_from(1);
	int step = 0, rc = 0;
	for (; step < 1000; step++) {
		uint32_t s;
		if ((rc = kvr_index_rank_add(x, 1000 + (uint64_t)step, 0, &s)) != 0)
			break;
		cr_assert_eq(kvr_index_rank_remove(x, s), 0);
	}
	kvr_alloc_fail_after(0);
	cr_assert_eq(rc, KVR_ENOMEM, "churn of %d pairs", step);
	uint32_t s;
	cr_assert_eq(kvr_index_rank_find(x, 5, 0, &s), KVR_ENOENT, "an absent rank's lookup ends");
	cr_assert_eq(kvr_index_rank_add(x, 5, 0, &s), 0, "with memory back, adds go on");
	cr_assert_eq(kvr_index_rank_find(x, 5, 0, &s), 0);
	kvr_index_destroy(x);
}
