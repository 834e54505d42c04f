/*
 * Adversarial differential test of the index without its block locator (kvr_index_set_locator,
 * core/index_tops.c) against the same index WITH it, fed the same calls.
 *
 * test_index_diff draws hashes from a tiny universe and removes at most 4 blocks a call; the
 * approximate modes write long prompt chains and remove whole evicted runs.  Here every rank
 * writes long chains of a few shared prompts (first blocks shared across ranks, forks at any
 * interior position), and removals name stretches of them in every shape the end maps must
 * survive: chain tails in order, heads (TTL-like expiries), interior stretches, reversed and
 * shuffled lists, blocks never stored or of other ranks, duplicates, split into runs at random.
 * Ranks are cleared, removed and re-added (slot reuse: a new rank in a slot whose end map held
 * entries), stores fail their k-th allocation (the locator-less index must then be unchanged,
 * so the twin with the locator, which skips that call, still agrees).  After every step both
 * indexes must answer every prompt's query alike (per rank: score and tree size), hold the same
 * blocks per rank and the same copies.  A crafter rank stores root blocks whose hash (a root's
 * sequence hash is its local hash) is an interior block's of a query, which only the locator
 * detects and rejects: the rank that holds that block then removes it, and must find it in both
 * (root_store_on_interior_hash below); or it stores such a chain FIRST and keeps it while a rank's
 * chain is appended over its root's hash, then removes and re-stores its root (crafted_chain).
 * KVR_SEED=N reruns one seed with more steps.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/index.h"
#include "tests/common/splitmix.h"
#include "kvrouter.h"
#include "sync/rcu.h"

enum { NR = 4, NP = 6, LMAX = 5000, NQ = NP + 8 };

static uint64_t rng;
static uint32_t rnd(uint32_t n)
{
	return (uint32_t)(splitmix64(&rng) % n);
}

/* The prompts: local hashes and their sequence hashes; prompt k > 0 shares a prefix with an
 * earlier one.  Extra queries (outputs' branches) are kept as well. */
static uint64_t loc[NQ][LMAX], seq[NQ][LMAX];
static size_t qlen[NQ];
static int nq;
static uint32_t lmax; /* the longest chain this run (<= LMAX) */

struct twin {
	struct kvr_index *a, *b; /* a: with the locator (the oracle), b: without */
	uint32_t sa[NR], sb[NR];
	uint32_t ca, cb; /* a crafter rank: root blocks on other chains' interior hashes */
	uint32_t ck;     /* the crafter's kept chain: its blocks, 0 for none */
	uint64_t cl[4];  /* its local hashes (cl[0]: an interior block's sequence hash) */
};

static void make_prompts(void)
{
	for (int k = 0; k < NP; k++) {
		size_t share = k > 0 && rnd(3) ? rnd(lmax / 2) : 0;
		int from = k > 0 ? (int)rnd((uint32_t)k) : 0;
		qlen[k] = 8 + rnd(lmax - 8);
		if (share > qlen[k])
			share = qlen[k];
		for (size_t i = 0; i < qlen[k]; i++)
			loc[k][i] = i < share && i < qlen[from]
			                ? loc[from][i]
			                : ((uint64_t)rng << 8 | (uint64_t)i);
		kvr_hash_chain_locals(NULL, loc[k], qlen[k], seq[k]);
	}
	nq = NP;
}

static void blocks_of(struct kvr_index_block *b, int q, size_t from, size_t to)
{
	for (size_t i = from; i < to; i++)
		b[i - from] = (struct kvr_index_block){seq[q][i], loc[q][i]};
}

static int cmp_u64(const void *x, const void *y)
{
	uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
	return a < b ? -1 : a > b;
}

static int cmp_match(const void *x, const void *y)
{
	const struct kvr_index_match *a = x, *b = y;
	return a->slot < b->slot ? -1 : a->slot > b->slot;
}

/* Both indexes answer every query and hold every rank's blocks alike. */
static void check(struct twin *t, unsigned seed, int step)
{
	static uint64_t ba[NR * NQ * LMAX], bb[NR * NQ * LMAX];
	for (int q = 0; q < nq; q++) {
		struct kvr_index_match ma[NR], mb[NR];
		size_t na = 0, nb = 0;
		kvr_rcu_read_lock();
		int ra = kvr_index_find_matches(t->a, seq[q], qlen[q], NULL, ma, NR, &na);
		int rb = kvr_index_find_matches(t->b, seq[q], qlen[q], NULL, mb, NR, &nb);
		kvr_rcu_read_unlock();
		cr_assert_eq(ra, 0);
		cr_assert_eq(rb, 0);
		cr_assert_eq(na, nb, "seed=%u step=%d query %d: %zu ranks vs %zu", seed, step, q,
		             na, nb);
		qsort(ma, na, sizeof(ma[0]), cmp_match);
		qsort(mb, nb, sizeof(mb[0]), cmp_match);
		for (size_t i = 0; i < na; i++) {
			cr_assert_eq(ma[i].slot, mb[i].slot, "seed=%u step=%d", seed, step);
			cr_assert_eq(ma[i].score, mb[i].score,
			             "seed=%u step=%d query %d slot %u: score %u (locator) vs %u",
			             seed, step, q, ma[i].slot, ma[i].score, mb[i].score);
			/* Exact sizes equal; the published ones within 1/64 of them (each
			 * index publishes at its own calls: core/index_internal.h). */
			const uint64_t xa = kvr_index_tree_size(t->a, ma[i].slot),
			               xb = kvr_index_tree_size(t->b, mb[i].slot);
			cr_assert_eq(xa, xb, "seed=%u step=%d", seed, step);
			cr_assert((ma[i].tree_size > xa ? ma[i].tree_size - xa
			                                : xa - ma[i].tree_size) <= xa / 64 &&
			              (mb[i].tree_size > xb ? mb[i].tree_size - xb
			                                    : xb - mb[i].tree_size) <= xb / 64,
			          "seed=%u step=%d", seed, step);
		}
	}
	for (int r = 0; r < NR; r++) {
		size_t na = kvr_index_rank_blocks(t->a, t->sa[r], ba, NR * NQ * LMAX);
		size_t nb = kvr_index_rank_blocks(t->b, t->sb[r], bb, NR * NQ * LMAX);
		cr_assert_eq(na, nb, "seed=%u step=%d rank %d: %zu blocks vs %zu", seed, step, r,
		             na, nb);
		qsort(ba, na, sizeof(ba[0]), cmp_u64);
		qsort(bb, nb, sizeof(bb[0]), cmp_u64);
		cr_assert(memcmp(ba, bb, na * sizeof(ba[0])) == 0, "seed=%u step=%d rank %d", seed,
		          step, r);
	}
	struct kvr_index_stats sa, sb;
	kvr_index_stats_get(t->a, &sa);
	kvr_index_stats_get(t->b, &sb);
	/* The crafter's root blocks: accepted without the locator where it rejects them. */
	const size_t xa = kvr_index_rank_blocks(t->a, t->ca, NULL, 0);
	const size_t xb = kvr_index_rank_blocks(t->b, t->cb, NULL, 0);
	cr_assert_eq(sa.copies - xa, sb.copies - xb, "seed=%u step=%d copies", seed, step);
	cr_assert_eq(sa.parent_not_found, sb.parent_not_found, "seed=%u step=%d", seed, step);
	cr_assert_eq(sa.block_not_found, sb.block_not_found, "seed=%u step=%d", seed, step);
}

/* A removal list: a stretch of query q in one of the shapes evictions and expiries take. */
static size_t removal_list(uint64_t *e, size_t cap, const size_t *depth)
{
	int q = (int)rnd((uint32_t)nq);
	for (int k = 0; k < 4 && !depth[q]; k++) /* mostly a chain the rank stored */
		q = (int)rnd((uint32_t)nq);
	const size_t L = depth[q] && rnd(4) ? depth[q] : qlen[q];
	size_t a = rnd((uint32_t)L), b = a + 1 + rnd((uint32_t)(L - a));
	switch (rnd(4)) {
	case 0: /* a tail */
		b = L;
		break;
	case 1: /* a head (TTL) */
		a = 0;
		break;
	default: /* interior */
		break;
	}
	if (b - a > cap / 2)
		b = a + cap / 2;
	size_t n = 0;
	for (size_t i = a; i < b; i++)
		e[n++] = seq[q][i];
	switch (rnd(4)) {
	case 0: /* reversed */
		for (size_t i = 0; i < n / 2; i++) {
			uint64_t x = e[i];
			e[i] = e[n - 1 - i];
			e[n - 1 - i] = x;
		}
		break;
	case 1: /* shuffled */
		for (size_t i = n; i > 1; i--) {
			size_t j = rnd((uint32_t)i);
			uint64_t x = e[i - 1];
			e[i - 1] = e[j];
			e[j] = x;
		}
		break;
	default:
		break;
	}
	/* Strangers: never stored, other queries' blocks, duplicates. */
	for (uint32_t k = rnd(4); k > 0 && n < cap; k--) {
		const size_t at = rnd((uint32_t)n + 1);
		memmove(&e[at + 1], &e[at], (n - at) * sizeof(e[0]));
		const uint32_t kind = rnd(3);
		e[at] = kind == 0   ? (uint64_t)rng | 1
		        : kind == 1 ? seq[rnd((uint32_t)nq)][0]
		        : n         ? e[rnd((uint32_t)n)]
		                    : 7;
		n++;
	}
	return n;
}

/* Rank r removes e[0..n) from both (without the locator as runs split at random, failing an
 * allocation it must not need): the same blocks not found. */
static void remove_step(struct twin *t, int r, const uint64_t *e, size_t n, unsigned seed, int step)
{
	static uint32_t rl[2 * LMAX];
	uint32_t nr = 0;
	for (size_t left = n; left > 0 && rnd(4); nr++) {
		rl[nr] = 1 + rnd((uint32_t)left);
		left -= rl[nr];
	}
	size_t fa, fb;
	kvr_alloc_fail_after(1 + rnd(3)); /* a removal never needs memory */
	cr_assert_eq(kvr_index_remove_runs(t->b, t->sb[r], e, n, rl, nr, &fb), 0);
	kvr_alloc_fail_after(0);
	cr_assert_eq(kvr_index_remove(t->a, t->sa[r], e, n, &fa), 0);
	cr_assert_eq(fa, fb, "seed=%u step=%d remove: %zu not found vs %zu", seed, step, fa, fb);
}

/*
 * The crafted root FIRST: the crafter stores a chain of 1-4 blocks whose root's hash is an
 * interior block's of a query, and keeps it while the ranks go on (their chains appended later
 * put that hash at a second place, inside a run, without a probe: rank r's removals of it must
 * find their own copy, forks onto it are refused alike).  At its next turn it removes its root
 * and stores it again: with its chain going on below the root, the root run is still the
 * block's place and both must accept (the locator met the interior copy first at a run's end
 * and refused it); with nothing below, the locator refuses what the index without it cannot
 * see (a root on a hash the tree has inside a chain).  Then it is cleared.
 */
static void crafted_chain(struct twin *t, int r, size_t *depth, unsigned seed, int step)
{
	struct kvr_index_block c[4];
	uint64_t cs[4];
	if (!t->ck) {
		const int q = (int)rnd((uint32_t)nq);
		const size_t j = 1 + rnd((uint32_t)qlen[q] - 1);
		t->cl[0] = seq[q][j];
		for (int i = 1; i < 4; i++)
			t->cl[i] = (uint64_t)rng << 10 | (uint64_t)i;
		kvr_hash_chain_locals(NULL, t->cl, 4, cs);
		const uint32_t k = 1 + rnd(4);
		for (uint32_t i = 0; i < k; i++)
			c[i] = (struct kvr_index_block){cs[i], t->cl[i]};
		const int ga = kvr_index_store(t->a, t->ca, NULL, c, k);
		const int gb = kvr_index_store(t->b, t->cb, NULL, c, k);
		cr_assert(gb == ga || (ga == KVR_EINVAL && gb == 0), "seed=%u step=%d: %d %d", seed,
		          step, ga, gb);
		if (ga == 0 && gb == 0) {
			/* Rank r stores q down to block j, mostly: the hash at a run's end (where
			 * the locator looks first) unless a rank held more of q. */
			static struct kvr_index_block blk[LMAX];
			const size_t d = rnd(4) ? j + 1 : 1 + rnd((uint32_t)qlen[q]);
			blocks_of(blk, q, 0, d);
			const int ra = kvr_index_store(t->a, t->sa[r], NULL, blk, d);
			const int rb = kvr_index_store(t->b, t->sb[r], NULL, blk, d);
			cr_assert_eq(ra, rb, "seed=%u step=%d: store %d (locator) vs %d", seed,
			             step, ra, rb);
			if (ra == 0 && d > depth[q])
				depth[q] = d;
			t->ck = k;
			return;
		}
	} else {
		kvr_hash_chain_locals(NULL, t->cl, 1, cs);
		size_t fa = 9, fb = 9;
		cr_assert_eq(kvr_index_remove(t->a, t->ca, cs, 1, &fa), 0);
		cr_assert_eq(kvr_index_remove(t->b, t->cb, cs, 1, &fb), 0);
		cr_assert(fa == 0 && fb == 0,
		          "seed=%u step=%d: the crafter's root not found: %zu %zu", seed, step, fa,
		          fb);
		c[0] = (struct kvr_index_block){cs[0], t->cl[0]};
		const int ga = kvr_index_store(t->a, t->ca, NULL, c, 1);
		const int gb = kvr_index_store(t->b, t->cb, NULL, c, 1);
		if (t->ck > 1)
			cr_assert_eq(
			    ga, gb,
			    "seed=%u step=%d: the crafter's re-store of its root (%u blocks): "
			    "%d (locator) vs %d",
			    seed, step, t->ck, ga, gb);
		else
			cr_assert(gb == ga || (ga == KVR_EINVAL && gb == 0), "seed=%u step=%d",
			          seed, step);
		if (ga == 0 && gb == 0) {
			const size_t ka = kvr_index_rank_blocks(t->a, t->ca, NULL, 0);
			cr_assert_eq(ka, t->ck, "seed=%u step=%d", seed, step);
			cr_assert_eq(kvr_index_rank_blocks(t->b, t->cb, NULL, 0), ka);
		}
	}
	cr_assert_eq(kvr_index_clear_rank(t->a, t->ca), 0);
	cr_assert_eq(kvr_index_clear_rank(t->b, t->cb), 0);
	t->ck = 0;
}

static void run(unsigned seed, int steps)
{
	struct twin t;
	rng = seed * 0x9e3779b97f4a7c15ull + 12345;
	make_prompts();
	const bool copies = seed % 3 == 0;
	cr_assert_eq(kvr_index_create(NR * 2, &t.a), 0);
	cr_assert_eq(kvr_index_create(NR * 2, &t.b), 0);
	cr_assert_eq(kvr_index_set_locator(t.b, false), 0);
	kvr_index_set_count_copies(t.a, copies);
	kvr_index_set_count_copies(t.b, copies);
	for (int r = 0; r < NR; r++) {
		cr_assert_eq(kvr_index_rank_add(t.a, (uint64_t)r, 0, &t.sa[r]), 0);
		cr_assert_eq(kvr_index_rank_add(t.b, (uint64_t)r, 0, &t.sb[r]), 0);
	}
	cr_assert_eq(kvr_index_rank_add(t.a, NR, 0, &t.ca), 0);
	cr_assert_eq(kvr_index_rank_add(t.b, NR, 0, &t.cb), 0);
	t.ck = 0;
	static struct kvr_index_block blk[LMAX];
	static uint64_t e[2 * LMAX];
	size_t depth[NR][NQ]; /* how deep each rank stored each query last (0: not) */
	memset(depth, 0, sizeof(depth));
	for (int step = 0; step < steps; step++) {
		const int r = (int)rnd(NR);
		const uint32_t op = rnd(100);
		if (op < 45) {
			/* An admission: query q's blocks [p0, d) below its path [0, p0). */
			const int q = (int)rnd((uint32_t)nq);
			const size_t d = 1 + rnd((uint32_t)qlen[q]);
			const size_t p0 = rnd(3) ? rnd((uint32_t)d) : 0;
			blocks_of(blk, q, p0, d);
			const bool oom = rnd(5) == 0;
			if (oom)
				kvr_alloc_fail_after(1 + rnd(6));
			int gb =
			    rnd(2) ? kvr_index_store_path(t.b, t.sb[r], seq[q], 1, p0, blk, d - p0)
			           : kvr_index_store(t.b, t.sb[r], p0 ? &seq[q][p0 - 1] : NULL, blk,
			                             d - p0);
			kvr_alloc_fail_after(0);
			if (gb == KVR_ENOMEM) {
				cr_assert(oom, "seed=%u step=%d", seed, step);
			} else {
				int ga = kvr_index_store(t.a, t.sa[r], p0 ? &seq[q][p0 - 1] : NULL,
				                         blk, d - p0);
				cr_assert_eq(ga, gb, "seed=%u step=%d store: %d (locator) vs %d",
				             seed, step, ga, gb);
				if (ga == 0 && d > depth[r][q])
					depth[r][q] = d;
			}
		} else if (op < 55 && nq < NQ) {
			/* An output: a new branch below an arbitrary block of a query (held or
			 * not: then both say KVR_ENOENT), named by its hash. */
			const int q = (int)rnd((uint32_t)nq);
			const size_t at = rnd((uint32_t)(qlen[q] < lmax - 1 ? qlen[q] : lmax - 1));
			const size_t n = 1 + rnd(lmax - 1 - (uint32_t)at);
			const int nqi = nq;
			memcpy(loc[nqi], loc[q], (at + 1) * sizeof(uint64_t));
			for (size_t i = at + 1; i < at + 1 + n; i++)
				loc[nqi][i] = (uint64_t)rng << 9 | i;
			qlen[nqi] = at + 1 + n;
			kvr_hash_chain_locals(NULL, loc[nqi], qlen[nqi], seq[nqi]);
			blocks_of(blk, nqi, at + 1, qlen[nqi]);
			int gb = kvr_index_store(t.b, t.sb[r], &seq[q][at], blk, n);
			int ga = kvr_index_store(t.a, t.sa[r], &seq[q][at], blk, n);
			cr_assert_eq(ga, gb, "seed=%u step=%d output", seed, step);
			if (ga == 0)
				depth[r][nq++] = qlen[nqi];
		} else if (op < 90) {
			remove_step(&t, r, e, removal_list(e, 2 * LMAX, depth[r]), seed, step);
		} else if (op < 92 && (t.ck || rnd(2))) {
			crafted_chain(&t, r, depth[r], seed, step);
		} else if (op < 92) {
			/* The crafter stores a root block whose hash is an interior block's of a
			 * query (rejected with the locator when the tree has it; accepted
			 * without), rank r then removes a list naming that block (its own
			 * removal must find its copy), and the crafter is cleared. */
			int q = (int)rnd((uint32_t)nq);
			for (int k = 0; k < 4 && depth[r][q] < 2; k++) /* mostly r's own */
				q = (int)rnd((uint32_t)nq);
			const size_t L = depth[r][q] >= 2 ? depth[r][q] : qlen[q];
			const uint64_t x = seq[q][1 + rnd((uint32_t)L - 1)];
			const struct kvr_index_block xb = {x, x};
			const int ga = kvr_index_store(t.a, t.ca, NULL, &xb, 1);
			const int gb = kvr_index_store(t.b, t.cb, NULL, &xb, 1);
			cr_assert(gb == ga || (ga == KVR_EINVAL && gb == 0),
			          "seed=%u step=%d: %d %d", seed, step, ga, gb);
			size_t n = removal_list(e, 2 * LMAX - 1, depth[r]);
			const size_t at = rnd((uint32_t)n + 1);
			memmove(&e[at + 1], &e[at], (n - at) * sizeof(e[0]));
			e[at] = x;
			remove_step(&t, r, e, n + 1, seed, step);
			check(&t, seed, step);
			cr_assert_eq(kvr_index_clear_rank(t.a, t.ca), 0);
			cr_assert_eq(kvr_index_clear_rank(t.b, t.cb), 0);
		} else if (op < 96) {
			cr_assert_eq(kvr_index_clear_rank(t.a, t.sa[r]), 0);
			cr_assert_eq(kvr_index_clear_rank(t.b, t.sb[r]), 0);
			memset(depth[r], 0, sizeof(depth[r]));
		} else {
			/* Remove the rank and add it back: a slot whose end map had entries,
			 * reused (after its grace period) by a rank that stores other chains. */
			cr_assert_eq(kvr_index_rank_remove(t.a, t.sa[r]), 0);
			cr_assert_eq(kvr_index_rank_remove(t.b, t.sb[r]), 0);
			kvr_index_quiesce(t.a);
			kvr_index_quiesce(t.b);
			cr_assert_eq(kvr_index_rank_add(t.a, (uint64_t)r, 0, &t.sa[r]), 0);
			cr_assert_eq(kvr_index_rank_add(t.b, (uint64_t)r, 0, &t.sb[r]), 0);
			memset(depth[r], 0, sizeof(depth[r]));
		}
		check(&t, seed, step);
	}
	if (getenv("KVR_VERBOSE")) {
		struct kvr_index_stats v;
		kvr_index_stats_get(t.b, &v);
		fprintf(stderr,
		        "seed %u: stored %lu removed %lu not found %lu parent nf %lu scans %lu "
		        "nodes %lu\n",
		        seed, (unsigned long)v.stored_blocks, (unsigned long)v.removed_blocks,
		        (unsigned long)v.block_not_found, (unsigned long)v.parent_not_found,
		        (unsigned long)v.rank_scans, (unsigned long)v.nodes);
	}
	for (int r = 0; r < NR; r++) {
		kvr_index_rank_remove(t.a, t.sa[r]);
		kvr_index_rank_remove(t.b, t.sb[r]);
	}
	kvr_index_rank_remove(t.a, t.ca);
	kvr_index_rank_remove(t.b, t.cb);
	kvr_index_quiesce(t.b);
	struct kvr_index_stats st;
	kvr_index_stats_get(t.b, &st);
	cr_assert_eq(st.nodes, 0, "seed=%u", seed);
	cr_assert_eq(st.copies, 0, "seed=%u", seed);
	cr_assert_eq(st.bytes_shared, 0, "seed=%u", seed);
	cr_assert_eq(st.bytes_per_rank, 0, "seed=%u", seed);
	kvr_index_destroy(t.a);
	kvr_index_destroy(t.b);
}

/* Seeds 1..n (KVR_SEEDS overrides n) of steps each, or KVR_SEED alone for one_steps (a failing
 * seed rerun longer), with chains of up to max_len blocks. */
static void run_seeds(uint32_t max_len, unsigned n, int steps, int one_steps)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	lmax = max_len;
	const char *env = getenv("KVR_SEED"), *hi = getenv("KVR_SEEDS");
	if (env) {
		run((unsigned)strtoul(env, NULL, 10), one_steps);
		return;
	}
	if (hi)
		n = (unsigned)strtoul(hi, NULL, 10);
	for (unsigned seed = 1; seed <= n; seed++)
		run(seed, steps);
}

Test(index_nolocator, twin_streams)
{
	run_seeds(320, 12, 400, 4000);
}

/* Chains past a run's 2,048 blocks (IDX_RUN_MAX): a chain continues in a child run at the
 * boundary, so tails, heads and interior stretches are removed across runs, walks cross them,
 * and the lookups next to the last block step over a run's first position to its parent's. */
Test(index_nolocator, twin_streams_long)
{
	run_seeds(LMAX, 3, 120, 1000);
}

/* A fresh index, the locator on or off, with ranks (0, 0) and (1, 0) at *s0 and *s1. */
static struct kvr_index *two_ranks(bool locator, uint32_t *s0, uint32_t *s1)
{
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(4, &idx), 0);
	cr_assert_eq(kvr_index_set_locator(idx, locator), 0);
	cr_assert_eq(kvr_index_rank_add(idx, 0, 0, s0), 0);
	cr_assert_eq(kvr_index_rank_add(idx, 1, 0, s1), 0);
	return idx;
}

/* b: the chain of n blocks with local hashes 1000, 1001, ..., named by their sequence hashes
 * s. */
static void chain_1000(struct kvr_index_block *b, uint64_t *s, size_t n)
{
	uint64_t l[200];
	cr_assert_leq(n, 200);
	for (size_t i = 0; i < n; i++)
		l[i] = 1000 + (uint64_t)i;
	kvr_hash_chain_locals(NULL, l, n, s);
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_index_block){s[i], l[i]};
}

/* A root block's sequence hash is its local hash, so a caller may store a root block whose
 * hash is an interior block's elsewhere (or a 64-bit collision does).  With the locator the
 * store finds that hash in the tree and is rejected; without it only a run's first block is
 * found, so the root store is accepted and the hash sits at two places.  What must not differ:
 * the other rank's removal of its own block finds it (an answer "not held" taken from the
 * crafted copy left it indexed: its rank credited with a block it removed), and so every other
 * rank's scores and blocks.  (order 0: the root store after the chain; 1: before it, so the
 * chain's interior block is appended onto a hash the tree has as a run's first.) */
struct collide {
	int rc_chain, rc_root, rc_rm;
	size_t nf, held0, score0;
	uint64_t blocks0[8];
};

static void collide_run(bool locator, int order, struct collide *o)
{
	uint32_t s0, s1;
	struct kvr_index *idx = two_ranks(locator, &s0, &s1);
	uint64_t l[3] = {11, 22, 33}, s[3];
	kvr_hash_chain_locals(NULL, l, 3, s);
	const struct kvr_index_block b[3] = {{s[0], l[0]}, {s[1], l[1]}, {s[2], l[2]}};
	const struct kvr_index_block x = {s[1], s[1]}; /* rank 1: a root block, local = s[1] */
	if (order == 1)
		o->rc_root = kvr_index_store(idx, s1, NULL, &x, 1);
	o->rc_chain = kvr_index_store(idx, s0, NULL, b, 3);
	if (order == 0)
		o->rc_root = kvr_index_store(idx, s1, NULL, &x, 1);
	o->rc_rm = kvr_index_remove(idx, s0, &s[1], 1, &o->nf); /* rank 0 evicts its block 1 */
	struct kvr_index_match m[4];
	size_t n = 0;
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_index_find_matches(idx, s, 3, NULL, m, 4, &n), 0);
	kvr_rcu_read_unlock();
	o->score0 = 0;
	for (size_t i = 0; i < n; i++)
		if (m[i].slot == s0)
			o->score0 = m[i].score;
	o->held0 = kvr_index_rank_blocks(idx, s0, o->blocks0, 8);
	cr_assert_leq(o->held0, 8);
	qsort(o->blocks0, o->held0, sizeof(uint64_t), cmp_u64);
	kvr_index_destroy(idx);
}

Test(index_nolocator, root_store_on_interior_hash)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	for (int order = 0; order < 2; order++) {
		struct collide a, b;
		memset(&a, 0, sizeof(a));
		memset(&b, 0, sizeof(b));
		collide_run(true, order, &a);
		collide_run(false, order, &b);
		cr_assert_eq(a.rc_chain, b.rc_chain, "order %d: chain %d vs %d", order, a.rc_chain,
		             b.rc_chain);
		cr_assert_eq(a.rc_rm, b.rc_rm);
		cr_assert_eq(a.nf, b.nf, "order %d: removal not found %zu (locator) vs %zu", order,
		             a.nf, b.nf);
		cr_assert_eq(a.score0, b.score0, "order %d: rank 0 score %zu (locator) vs %zu",
		             order, a.score0, b.score0);
		cr_assert_eq(a.held0, b.held0, "order %d: rank 0 holds %zu vs %zu", order, a.held0,
		             b.held0);
		cr_assert(memcmp(a.blocks0, b.blocks0, a.held0 * sizeof(uint64_t)) == 0);
		cr_assert_eq(b.nf, 0, "order %d", order);
		fprintf(stderr, "order %d: root store %d (locator) %d (without), chain %d\n", order,
		        a.rc_root, b.rc_root, a.rc_chain);
	}
}

/* The same with the crafted root stored first and the interior block deep in a long chain, where
 * the locator's first look (the hint, a run's ends) does not find it: its lookup met the
 * crafted run's first block in the run table, which the rank does not hold, and answered "not
 * found", so rank 0 stayed credited with the block it removed (score 200 instead of 100).  And
 * the crafter's removal of its own root block, whose hash the locator finds first at rank 0's
 * interior position (short chain: a run's end), must find the root.  Both modes. */
static void deep_collide(bool locator)
{
	enum { N = 200, X = 100 };
	uint32_t s0, s1;
	struct kvr_index *idx = two_ranks(locator, &s0, &s1);
	uint64_t s[N];
	struct kvr_index_block b[N];
	chain_1000(b, s, N);
	const struct kvr_index_block x = {s[X], s[X]}; /* rank 1: a root block, local = s[X] */
	cr_assert_eq(kvr_index_store(idx, s1, NULL, &x, 1), 0);
	cr_assert_eq(kvr_index_store(idx, s0, NULL, b, N), 0);
	size_t nf = 9;
	cr_assert_eq(kvr_index_remove(idx, s0, &s[X], 1, &nf), 0); /* rank 0 evicts block X */
	struct kvr_index_match m[4];
	size_t n = 0;
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_index_find_matches(idx, s, N, NULL, m, 4, &n), 0);
	kvr_rcu_read_unlock();
	size_t score0 = 0;
	for (size_t i = 0; i < n; i++)
		if (m[i].slot == s0)
			score0 = m[i].score;
	cr_assert_eq(nf, 0, "locator %d: rank 0's removal of its block %d not found", locator, X);
	cr_assert_eq(score0, X, "locator %d: rank 0 credited %zu blocks, holds %d", locator, score0,
	             X);
	cr_assert_eq(kvr_index_tree_size(idx, s0), N - 1);
	kvr_index_destroy(idx);

	/* Short chain: the crafted root first, then rank 0's 3 blocks (the hash at its position
	 * 1, a run's end, where the locator looks first); the crafter removes its root. */
	idx = two_ranks(locator, &s0, &s1);
	const struct kvr_index_block y = {s[1], s[1]};
	cr_assert_eq(kvr_index_store(idx, s1, NULL, &y, 1), 0);
	cr_assert_eq(kvr_index_store(idx, s0, NULL, b, 3), 0);
	nf = 9;
	cr_assert_eq(kvr_index_remove(idx, s1, &s[1], 1, &nf), 0);
	cr_assert_eq(nf, 0, "locator %d: the crafter's removal of its root not found", locator);
	cr_assert_eq(kvr_index_tree_size(idx, s1), 0);
	cr_assert_eq(kvr_index_rank_blocks(idx, s1, NULL, 0), 0);
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_index_find_matches(idx, &s[1], 1, NULL, m, 4, &n), 0);
	kvr_rcu_read_unlock();
	for (size_t i = 0; i < n; i++)
		cr_assert_neq(m[i].slot, s1, "locator %d: the crafter still credited", locator);
	kvr_index_destroy(idx);
}

Test(index_nolocator, crafted_root_first_deep_interior)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	deep_collide(true);
	deep_collide(false);
}

/*
 * The crafter's own re-store of its root block, the crafted root first: rank 1 stores a chain
 * whose root's hash is s[X] (local = s[X]), then rank 0 stores a chain of n blocks, whose block X
 * is appended without a probe, so s[X] sits at two places; rank 1 removes its root and stores it
 * again.  With rank 1's chain going on below the root (kids > 0) its root run is still there:
 * the re-store is of a block that exists at its place, and must be accepted wherever the
 * lookup meets s[X] first.  The locator met rank 0's copy first where it is a run's end (its
 * first look: the last store's hint, a run's len - 1 and hw - 1; trim: rank 0's tail from X
 * removed, the position kept for a re-store) and rejected the store as a 64-bit collision
 * (KVR_EINVAL); deep in the run the run table's root came first and it was accepted.  With no
 * root run left (kids 0) the tree has s[X] only inside rank 0's chain, as when the chain came
 * first: a root block there names another prefix by the same hash, which the locator mode
 * refuses (nothing applied) and the index without it cannot see (root_store_on_interior_hash).
 */
static void crafted_restore(bool locator, uint32_t n, uint32_t x, uint32_t kids, bool trim)
{
	enum { NMAX = 200 };
	uint32_t s0, s1;
	struct kvr_index *idx = two_ranks(locator, &s0, &s1);
	uint64_t s[NMAX], cl[4], cs[4];
	struct kvr_index_block b[NMAX], c[4];
	chain_1000(b, s, n);
	cl[0] = s[x]; /* rank 1's root: its sequence hash is its local hash */
	for (uint32_t i = 1; i < 4; i++)
		cl[i] = 5000 + (uint64_t)i;
	kvr_hash_chain_locals(NULL, cl, 4, cs);
	for (uint32_t i = 0; i < 4; i++)
		c[i] = (struct kvr_index_block){cs[i], cl[i]};
	cr_assert_eq(cs[0], s[x]);
	cr_assert_eq(kvr_index_store(idx, s1, NULL, c, 1 + kids), 0);
	cr_assert_eq(kvr_index_store(idx, s0, NULL, b, n), 0);
	const uint32_t held0 = trim ? x : n; /* rank 0 keeps [0, x) after the trim */
	size_t nf = 9;
	if (trim) {
		cr_assert_eq(kvr_index_remove(idx, s0, &s[x], n - x, &nf), 0);
		cr_assert_eq(nf, 0);
	}
	nf = 9;
	cr_assert_eq(kvr_index_remove(idx, s1, &cs[0], 1, &nf), 0);
	cr_assert_eq(nf, 0, "locator %d n %u x %u: rank 1's removal of its root not found", locator,
	             n, x);
	struct kvr_index_stats st0, st1;
	kvr_index_stats_get(idx, &st0);
	const int rc = kvr_index_store(idx, s1, NULL, c, 1);
	kvr_index_stats_get(idx, &st1);
	struct kvr_index_match m[4];
	size_t nm = 0, score0 = 0, score1 = 0;
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_index_find_matches(idx, s, n, NULL, m, 4, &nm), 0);
	for (size_t i = 0; i < nm; i++)
		if (m[i].slot == s0)
			score0 = m[i].score;
	cr_assert_eq(kvr_index_find_matches(idx, cs, 1 + kids, NULL, m, 4, &nm), 0);
	for (size_t i = 0; i < nm; i++)
		if (m[i].slot == s1)
			score1 = m[i].score;
	kvr_rcu_read_unlock();
	cr_assert_eq(score0, held0, "locator %d n %u x %u: rank 0 credited %zu, holds %u", locator,
	             n, x, score0, held0);
	cr_assert_eq(kvr_index_tree_size(idx, s0), held0);
	if (kids > 0 || !locator) {
		cr_assert_eq(
		    rc, 0,
		    "locator %d n %u x %u kids %u trim %d: rank 1's re-store of its root: %d",
		    locator, n, x, kids, trim, rc);
		cr_assert_eq(score1, 1 + kids, "locator %d n %u x %u: rank 1 credited %zu", locator,
		             n, x, score1);
		cr_assert_eq(kvr_index_tree_size(idx, s1), 1 + kids);
		cr_assert_eq(st1.stored_blocks, st0.stored_blocks + 1);
	} else {
		/* Refused, and nothing applied: the collision counted, nothing stored. */
		cr_assert_eq(rc, KVR_EINVAL, "locator n %u x %u trim %d: %d", n, x, trim, rc);
		cr_assert_eq(score1, 0);
		cr_assert_eq(kvr_index_tree_size(idx, s1), 0);
		cr_assert_eq(kvr_index_rank_blocks(idx, s1, NULL, 0), 0);
		cr_assert_eq(st1.invalid, st0.invalid + 1);
		cr_assert_eq(st1.stored_blocks, st0.stored_blocks);
		cr_assert_eq(st1.nodes, st0.nodes);
	}
	/* Both removable again, each where it is. */
	nf = 9;
	cr_assert_eq(kvr_index_remove(idx, s0, s, held0, &nf), 0);
	cr_assert_eq(nf, 0);
	cr_assert_eq(kvr_index_tree_size(idx, s0), 0);
	cr_assert_eq(kvr_index_clear_rank(idx, s1), 0);
	kvr_index_quiesce(idx);
	kvr_index_stats_get(idx, &st1);
	cr_assert_eq(st1.nodes, 0);
	kvr_index_destroy(idx);
}

Test(index_nolocator, crafted_root_restored_over_interior)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	for (int loc = 0; loc < 2; loc++)
		for (uint32_t kids = 0; kids < 4; kids += 3)
			for (int trim = 0; trim < 2; trim++) {
				crafted_restore(loc, 2, 1, kids, trim);      /* a run's end */
				crafted_restore(loc, 200, 199, kids, trim);  /* a run's end */
				crafted_restore(loc, 200, 100, kids, trim);  /* deep */
				crafted_restore(loc, 200, 198, kids, false); /* near the end */
			}
}
