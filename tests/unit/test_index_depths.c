/*
 * kvr_index_find_depths (kvr_route's lookup) with many ranks, against a reference model and
 * with both of its loop sets (core/index_match.h: the AVX2 loops where the CPU has them, and the
 * SSE2 / scalar ones), which must give the same answer bit for bit: depth[], the slots listed
 * in the same order, their count and *best.
 *
 * test_index_diff checks the index's rules against a model with 4 ranks, where no holder set
 * has 8 words; here 72 ranks (a slot count that is not a multiple of 8) store random prefixes
 * and sub-ranges of session-like prompts (each keeps a prefix of an earlier one, so runs branch
 * and holder sets of every size from 1 to 72 words occur, consecutive slots and scattered ones)
 * and remove random blocks (holes, which lower cuts), and clear ranks now and then.  The model
 * keeps, per rank, which of the prompts' blocks it holds (a block is its sequence hash, the ext
 * hash the approximate modes store); a rank's depth for a query is the length of the query's
 * prefix it holds without a gap.  The seed is printed on failure; KVR_SEED=N runs seed N only.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/hash.h"
#include "core/index.h"
#include "core/index_match.h"
#include "kvrouter.h"
#include "sync/rcu.h"
#include "tests/common/xorshift.h"

enum { NR = 72, NP = 24, LMAX = 80, NB = NP * LMAX, QMAX = LMAX + 8, TAB = 4096 };

static uint64_t rng;
static uint32_t rnd(uint32_t n)
{
	return (uint32_t)(xorshift64(&rng) % n);
}

/* The prompts: local hashes, chained into sequence hashes, and each block's id in the model. */
static uint64_t loc[NP][LMAX], seq[NP][LMAX];
static int bid[NP][LMAX];
static size_t plen[NP];
static uint64_t tab_key[TAB]; /* sequence hash -> id (open addressing; 0: empty) */
static int tab_id[TAB], nids;
static bool held[NR][NB]; /* the model: rank r holds block id */
static uint32_t slot_of[NR];

static int intern(uint64_t h)
{
	size_t i = (size_t)(h * 0x9e3779b97f4a7c15ull >> 52) % TAB;
	while (tab_key[i] && tab_key[i] != h)
		i = (i + 1) % TAB;
	if (!tab_key[i]) {
		tab_key[i] = h;
		tab_id[i] = nids++;
	}
	return tab_id[i];
}

static void make_prompts(void)
{
	memset(tab_key, 0, sizeof(tab_key));
	nids = 0;
	for (int p = 0; p < NP; p++) {
		plen[p] = 8 + rnd(LMAX - 7);
		size_t keep = 0;
		if (p > 0) { /* a prefix of an earlier prompt, then its own blocks */
			const int o = (int)rnd((uint32_t)p);
			keep = rnd((uint32_t)(plen[o] < plen[p] ? plen[o] : plen[p]) + 1);
			memcpy(loc[p], loc[o], keep * sizeof(uint64_t));
		}
		for (size_t j = keep; j < plen[p]; j++)
			loc[p][j] = ((uint64_t)p << 32 | j) * 0x2545f4914f6cdd1dull + 1;
		kvr_hash_chain_locals(NULL, loc[p], plen[p], seq[p]);
		for (size_t j = 0; j < plen[p]; j++)
			bid[p][j] = intern(seq[p][j]);
	}
}

/* Rank r stores blocks [a, d) of prompt p below block a - 1 (the root when a == 0). */
static void store(struct kvr_index *idx, int r, int p, size_t a, size_t d)
{
	struct kvr_index_block b[LMAX] = {{0}};
	for (size_t j = a; j < d; j++)
		b[j - a] = (struct kvr_index_block){.ext_hash = seq[p][j], .local_hash = loc[p][j]};
	int rc = kvr_index_store(idx, slot_of[r], a ? &seq[p][a - 1] : NULL, b, d - a);
	if (a > 0 && !held[r][bid[p][a - 1]]) {
		cr_assert_eq(rc, KVR_ENOENT, "store below a block the rank does not hold");
		return;
	}
	cr_assert_eq(rc, 0);
	for (size_t j = a; j < d; j++)
		held[r][bid[p][j]] = true;
}

static void step(struct kvr_index *idx)
{
	const int r = (int)rnd(NR), p = (int)rnd(NP);
	const uint32_t op = rnd(100);
	if (op < 55) { /* a prefix of a prompt */
		store(idx, r, p, 0, 1 + rnd((uint32_t)plen[p]));
	} else if (op < 70) { /* a sub-range: extends, or refills holes */
		const size_t a = rnd((uint32_t)plen[p]);
		store(idx, r, p, a, a + 1 + rnd((uint32_t)(plen[p] - a)));
	} else if (op < 97) { /* holes */
		uint64_t ext[4];
		size_t n = 1 + rnd(4);
		for (size_t i = 0; i < n; i++) {
			const size_t j = rnd((uint32_t)plen[p]);
			ext[i] = seq[p][j];
			held[r][bid[p][j]] = false;
		}
		cr_assert_eq(kvr_index_remove(idx, slot_of[r], ext, n, NULL), 0);
	} else {
		cr_assert_eq(kvr_index_clear_rank(idx, slot_of[r]), 0);
		memset(held[r], 0, sizeof(held[r]));
	}
}

static uint32_t model_depth(int r, const int *ids, size_t n)
{
	size_t d = 0;
	while (d < n && ids[d] >= 0 && held[r][ids[d]])
		d++;
	return (uint32_t)d;
}

static void query(struct kvr_index *idx, unsigned seed, int st)
{
	const int p = (int)rnd(NP);
	const size_t m = 1 + rnd((uint32_t)plen[p]);
	uint64_t q[QMAX];
	int ids[QMAX];
	size_t n = m;
	memcpy(q, seq[p], m * sizeof(uint64_t));
	for (size_t j = 0; j < m; j++)
		ids[j] = bid[p][j];
	for (size_t x = rnd(3) ? 0 : 1 + rnd(8); x > 0; x--, n++) { /* a tail nobody holds */
		q[n] = 0x9e3779b97f4a7c15ull * (n + 7) ^ seed;
		ids[n] = -1;
	}
	uint32_t depth[2][NR] = {{0}}, slots[2][NR], best[2] = {7, 7};
	size_t nd[2];
	kvr_rcu_read_lock();
	nd[0] = kvr_index_find_depths_impl(idx, q, n, depth[0], slots[0], &best[0],
	                                   KVR_INDEX_DEPTHS_AUTO);
	nd[1] = kvr_index_find_depths_impl(idx, q, n, depth[1], slots[1], &best[1],
	                                   KVR_INDEX_DEPTHS_BASE);
	kvr_rcu_read_unlock();
	cr_assert_eq(nd[0], nd[1], "seed=%u step=%d: slot counts", seed, st);
	cr_assert_eq(memcmp(slots[0], slots[1], nd[0] * sizeof(uint32_t)), 0,
	             "seed=%u step=%d: slots", seed, st);
	cr_assert_eq(memcmp(depth[0], depth[1], sizeof(depth[0])), 0, "seed=%u step=%d: depths",
	             seed, st);
	cr_assert_eq(best[0], best[1], "seed=%u step=%d: best", seed, st);
	uint32_t top = 0;
	for (int r = 0; r < NR; r++) {
		const uint32_t want = model_depth(r, ids, n);
		cr_assert_eq(depth[0][slot_of[r]], want,
		             "seed=%u step=%d rank %d: depth %u, model %u", seed, st, r,
		             depth[0][slot_of[r]], want);
		top = want > top ? want : top;
	}
	cr_assert_eq(best[0], top, "seed=%u step=%d: best %u, model %u", seed, st, best[0], top);
	for (size_t j = 0; j < nd[0]; j++) /* every slot set is listed */
		depth[0][slots[0][j]] = 0;
	for (int r = 0; r < NR; r++)
		cr_assert_eq(depth[0][r], 0, "seed=%u step=%d: slot %d set but not listed", seed,
		             st, r);
}

static void run(unsigned seed, int steps)
{
	rng = seed * 2654435761u + 1;
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(NR, &idx), 0);
	cr_assert_eq(kvr_index_set_locator(idx, seed % 2 == 0), 0);
	for (int r = 0; r < NR; r++)
		cr_assert_eq(kvr_index_rank_add(idx, (uint64_t)r, 0, &slot_of[r]), 0);
	memset(held, 0, sizeof(held));
	make_prompts();
	/* Most ranks hold the first prompt's start: the hot prefix, every slot in its set. */
	for (int r = 0; r < NR; r++)
		if (rnd(8))
			store(idx, r, 0, 0, 1 + rnd((uint32_t)plen[0]));
	for (int st = 0; st < steps; st++) {
		step(idx);
		if (st % 4 == 0)
			for (int t = 0; t < 4; t++)
				query(idx, seed, st);
	}
	kvr_index_destroy(idx);
}

Test(index_depths, many_ranks_both_loops)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	const char *one = getenv("KVR_SEED");
	if (one) {
		run((unsigned)atoi(one), 3000);
	} else {
		for (unsigned seed = 1; seed <= 24; seed++)
			run(seed, 3000);
	}
	kvr_rcu_thread_offline();
}
