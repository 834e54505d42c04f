/*
 * Differential test of core/index against an obviously-correct reference model.
 *
 * The model interns every block path as (parent id, local hash) -> id in a flat array and keeps,
 * per rank, a plain list of (ext hash, id).  It implements the index's documented rules
 * literally (core/index.h).  Random stored / removed / cleared / clear-rank / remove-rank
 * operations over a tiny universe of hashes (so conflicts, duplicates, self-parents and missing
 * parents are frequent) run against both; after every step, random queries must get the same
 * (rank, score, tree size) sets, and the counters (copies, nodes, memory) must be exact
 * (check_stats).  The seed is printed on failure; KVR_SEED=N reruns one seed.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/index.h"
#include "core/index_internal.h"
#include "core/index_tops.h"
#include "kvrouter.h"
#include "sync/rcu.h"
#include "tests/common/xorshift.h"

/* DEEPN: the deep mode's longest store, past a run's IDX_RUN_MAX blocks. */
enum { NR = 4, MAXP = 1 << 17, MAXX = 8192, LONGN = 130, DEEPN = 2300 };

struct path {
	int parent; /* -1 = root */
	uint64_t local;
};
static struct path paths[MAXP];
static int npaths;

struct mrank {
	uint64_t worker;
	uint32_t dp;
	uint32_t slot;
	int nx;
	uint64_t ext[MAXX];
	int node[MAXX];
	int copies[MAXX]; /* count_copies mode: physical copies of ext (>= 1) */
	int last_rm;      /* the block (path id) whose last copy was removed last, -1 */
	uint64_t last_rm_ext;
};
static bool count_copies;
static bool longc;      /* long chains: stores of up to LONGN blocks, holes refilled */
static bool deep;       /* with longc: stores of up to DEEPN blocks, runs at their longest, tails
                         * removed */
static int maxx = 1024; /* blocks a rank of the model holds at most (MAXX in deep mode) */
static uint8_t mheld[NR][MAXP]; /* mheld[rank][path id]: the rank holds it (mholds in O(1)) */
/* (parent, local) -> path id + 1: open addressing, so that intern is O(1) for deep chains. */
enum { PH = 1 << 18 };
static int phash[PH];
static bool no_loc; /* the index without its block locator (kvr_index_set_locator) */
static struct mrank mr[NR];

static uint64_t rng;
static uint32_t rnd(uint32_t n)
{
	return (uint32_t)(xorshift64(&rng) % n);
}

static int intern(int parent, uint64_t local, bool create)
{
	uint64_t x = ((uint64_t)(uint32_t)parent << 32 ^ local) * 0x9e3779b97f4a7c15ull;
	uint32_t i = (uint32_t)(x >> 46) & (PH - 1);
	for (; phash[i]; i = (i + 1) & (PH - 1)) {
		const int id = phash[i] - 1;
		if (paths[id].parent == parent && paths[id].local == local)
			return id;
	}
	if (!create)
		return -2;
	cr_assert_lt(npaths, MAXP);
	paths[npaths] = (struct path){parent, local};
	phash[i] = npaths + 1;
	return npaths++;
}

static int mfind(const struct mrank *r, uint64_t ext)
{
	for (int i = 0; i < r->nx; i++)
		if (r->ext[i] == ext)
			return i;
	return -1;
}

static bool mholds(const struct mrank *r, int node)
{
	return mheld[r - mr][node];
}

static void mclear(struct mrank *r)
{
	for (int i = 0; i < r->nx; i++)
		mheld[r - mr][r->node[i]] = 0;
	r->nx = 0;
}

static int mstore(struct mrank *r, const uint64_t *parent, const struct kvr_index_block *b,
                  size_t n)
{
	int p = -1;
	if (n == 0)
		return 0;
	if (parent) {
		int k = mfind(r, *parent);
		if (k < 0)
			return KVR_ENOENT;
		p = r->node[k];
	}
	bool has_prev = parent != NULL;
	uint64_t prev = parent ? *parent : 0;
	for (size_t i = 0; i < n; i++) {
		if (has_prev && b[i].ext_hash == prev)
			return KVR_EINVAL;
		int c = intern(p, b[i].local_hash, true);
		int k = mfind(r, b[i].ext_hash);
		if (k >= 0) {
			if (r->node[k] != c)
				return KVR_EINVAL;
			if (count_copies)
				r->copies[k]++;
		} else {
			if (mholds(r, c))
				return KVR_EINVAL;
			cr_assert_lt(r->nx, maxx);
			mheld[r - mr][c] = 1;
			r->ext[r->nx] = b[i].ext_hash;
			r->copies[r->nx] = 1;
			r->node[r->nx++] = c;
		}
		p = c;
		prev = b[i].ext_hash;
		has_prev = true;
	}
	return 0;
}

static size_t mremove(struct mrank *r, const uint64_t *ext, size_t n)
{
	size_t nf = 0;
	for (size_t i = 0; i < n; i++) {
		int k = mfind(r, ext[i]);
		if (k < 0) {
			nf++;
			continue;
		}
		if (--r->copies[k] > 0)
			continue;
		r->last_rm = r->node[k];
		mheld[r - mr][r->node[k]] = 0;
		r->last_rm_ext = r->ext[k];
		r->ext[k] = r->ext[r->nx - 1];
		r->copies[k] = r->copies[r->nx - 1];
		r->node[k] = r->node[r->nx - 1];
		r->nx--;
	}
	return nf;
}

/* Model score of rank r for a query: -1 if it does not hold block 0. */
static int mscore(const struct mrank *r, const uint64_t *q, size_t n)
{
	int p = -1, s = 0;
	for (size_t i = 0; i < n; i++) {
		int c = intern(p, q[i], false);
		if (c < 0 || !mholds(r, c))
			break;
		s++;
		p = c;
	}
	return s ? s : -1;
}

/* The router's sequence hash of path id. */
static uint64_t mseq(int id)
{
	if (paths[id].parent < 0)
		return paths[id].local;
	uint64_t ps = mseq(paths[id].parent), out;
	kvr_hash_chain_locals(&ps, &paths[id].local, 1, &out);
	return out;
}

enum { QMAX = DEEPN + 40 };

static int cmp_u64(const void *a, const void *b)
{
	const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Without the locator: every end-map entry names a live record of its rank under the key the
 * record has now, reachable from that key's home (no stale entry, none a lookup or a backward
 * shift would miss), and the counts add up. */
static void check_tops(struct kvr_index *idx, unsigned seed, int step)
{
	for (int i = 0; i < NR; i++) {
		const struct idx_rank *rk = &idx->rank[mr[i].slot];
		const struct idx_tmap *m = &rk->tops;
		uint32_t used = 0;
		for (uint32_t j = 0; m->e && j < m->cap; j++) {
			const uint64_t e = m->e[j];
			if (!e)
				continue;
			used++;
			const struct idx_hold *h =
			    (const struct idx_hold *)(uintptr_t)(e & 0xfffffffffffeull);
			bool live = false;
			for (const struct idx_hold *c = rk->holds; c && !live; c = idx_hold_next(c))
				live = c == h;
			cr_assert(live, "seed=%u step=%d: an end-map entry of a dead record", seed,
			          step);
			struct idx_tkey k;
			kvr_index_tops_key(h, &k);
			cr_assert((e & 1) ? k.has_lo : k.has_top, "seed=%u step=%d: a stale entry",
			          seed, step);
			const uint64_t key = (e & 1) ? k.lo : k.top, mix = kvr_place(key);
			cr_assert_eq(e >> 48, (mix >> 16) & 0xffff, "seed=%u step=%d: a stale key",
			             seed, step);
			uint32_t x = (uint32_t)(((mix >> 32) * m->cap) >> 32);
			for (; x != j; x = x + 1 == m->cap ? 0 : x + 1)
				cr_assert_neq(m->e[x], 0, "seed=%u step=%d: an entry past a hole",
				              seed, step);
		}
		cr_assert_eq(used, m->count, "seed=%u step=%d", seed, step);
	}
}

/* The counters after every operation: copies as the model has them, stored - removed == copies,
 * the rejections (parent not found, invalid, block not found) as the model counts them, nodes ==
 * the positions of the live runs (a walk of the run table), the ranks; and with every
 * deferred free done, kvr_index_memory_bytes equal to what the allocator has handed out (the
 * same difference as right after create).  That last check only where the allocator's real
 * sizes are the sizes asked (no jemalloc: the counters count size classes, kvr_alloc_live_bytes
 * the sizes asked). */
static uint64_t m_pnf, m_inv, m_bnf; /* the model's parent_not_found, invalid, block_not_found */
static int64_t live_base; /* live bytes minus kvr_index_memory_bytes, right after create */
static void check_stats(struct kvr_index *idx, unsigned seed, int step, bool quiesced)
{
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	uint64_t copies = 0;
	for (int i = 0; i < NR; i++)
		for (int j = 0; j < mr[i].nx; j++)
			copies += count_copies ? (uint64_t)mr[i].copies[j] : 1;
	cr_assert_eq(st.copies, copies, "seed=%u step=%d: copies %lu vs %lu", seed, step,
	             (unsigned long)st.copies, (unsigned long)copies);
	cr_assert_eq(st.stored_blocks - st.removed_blocks, st.copies, "seed=%u step=%d", seed,
	             step);
	cr_assert_eq(st.ranks, (uint64_t)NR, "seed=%u step=%d", seed, step);
	cr_assert_eq(st.parent_not_found, m_pnf, "seed=%u step=%d", seed, step);
	cr_assert_eq(st.invalid, m_inv, "seed=%u step=%d", seed, step);
	cr_assert_eq(st.block_not_found, m_bnf, "seed=%u step=%d", seed, step);
	uint64_t nodes = 0;
	for (uint32_t g = 0; g < IDX_SEGS; g++)
		for (uint64_t j = 0; idx->seg[g].tab && j < idx->seg[g].cap; j++)
			if (idx->seg[g].tab[j] > IDX_TOMB)
				nodes += idx_run_len(idx_ent_run(idx->seg[g].tab[j]));
	cr_assert_eq(st.nodes, nodes, "seed=%u step=%d: nodes %lu vs %lu", seed, step,
	             (unsigned long)st.nodes, (unsigned long)nodes);
	if (!quiesced || kvr_alloc_real_size(72) != 72 || kvr_alloc_real_size(136) != 136)
		return;
	const int64_t d = kvr_alloc_live_bytes() - (int64_t)kvr_index_memory_bytes(idx);
	cr_assert_eq(d, live_base, "seed=%u step=%d: live bytes - memory_bytes %ld vs %ld", seed,
	             step, (long)d, (long)live_base);
}

static void check(struct kvr_index *idx, unsigned seed, int step)
{
	if (no_loc)
		check_tops(idx, seed, step);
	for (int t = 0; t < 4; t++) {
		static uint64_t q[QMAX];
		size_t n = 0;
		const struct mrank *hr = &mr[rnd(NR)];
		if (t % 2 == 0 && hr->nx > 0) { /* a held path, then a random tail */
			static int stack[QMAX];
			int d = 0;
			for (int id = hr->node[rnd((uint32_t)hr->nx)]; id >= 0 && d < QMAX - 4;
			     id = paths[id].parent)
				stack[d++] = id;
			while (d > 0)
				q[n++] = paths[stack[--d]].local;
			for (uint32_t x = rnd(4); x > 0; x--)
				q[n++] = 1 + rnd(4);
		}
		if (n == 0) {
			n = 1 + rnd(12);
			for (size_t i = 0; i < n; i++)
				q[i] = 1 + rnd(4);
		}
		struct kvr_index_match out[NR];
		size_t k;
		kvr_rcu_read_lock();
		static uint64_t qs[QMAX];
		kvr_hash_chain_locals(NULL, q, n, qs);
		int rc = kvr_index_find_matches(idx, qs, n, NULL, out, NR, &k);
		/* find_depths: the same scores, by slot. */
		uint32_t depth[NR * 2] = {0}, dslots[NR * 2], best = 7;
		size_t nd = kvr_index_find_depths(idx, qs, n, depth, dslots, &best);
		kvr_rcu_read_unlock();
		cr_assert_eq(rc, 0, "seed=%u step=%d", seed, step);
		int seen = 0;
		for (int i = 0; i < NR; i++) {
			int want = mscore(&mr[i], q, n);
			int got = -1;
			uint64_t ts = 0;
			for (size_t j = 0; j < k; j++)
				if (out[j].slot == mr[i].slot) {
					got = (int)out[j].score;
					ts = out[j].tree_size;
				}
			cr_assert_eq(got, want, "seed=%u step=%d rank=%d (locator %d)", seed, step,
			             i, !no_loc);
			if (got >= 0) {
				seen++;
				/* The exact size, and the published one within 1/64 of it
				 * (core/index_internal.h: idx_size_set). */
				const uint64_t nx = (uint64_t)mr[i].nx;
				cr_assert_eq(kvr_index_tree_size(idx, mr[i].slot), nx,
				             "seed=%u step=%d", seed, step);
				cr_assert((ts > nx ? ts - nx : nx - ts) <= nx / 64,
				          "seed=%u step=%d tree size %lu vs %lu", seed, step,
				          (unsigned long)ts, (unsigned long)nx);
			}
		}
		cr_assert_eq((int)k, seen, "seed=%u step=%d", seed, step);
		size_t nonzero = 0; /* the ranks holding seq[0]: those find_matches lists */
		for (size_t j = 0; j < NR * 2; j++)
			nonzero += depth[j] != 0;
		cr_assert_eq(nonzero, k, "seed=%u step=%d: find_depths' scores", seed, step);
		cr_assert_geq(nd, k, "seed=%u step=%d: find_depths' slots", seed, step);
		uint32_t top = 0;
		for (size_t j = 0; j < k; j++) {
			cr_assert_eq(depth[out[j].slot], out[j].score, "seed=%u step=%d slot %u",
			             seed, step, out[j].slot);
			top = out[j].score > top ? out[j].score : top;
		}
		for (size_t j = 0; j < nd; j++)
			depth[dslots[j]] = 0;
		for (size_t j = 0; j < NR * 2; j++)
			cr_assert_eq(depth[j], 0, "seed=%u step=%d: a slot set but not listed",
			             seed, step);
		cr_assert_eq(best, top, "seed=%u step=%d: best", seed, step);
	}
	/* kvr_index_rank_blocks: the ext hashes each rank holds, as the model has them (blocks
	 * held under an alias by their alias, the others by their sequence hash). */
	for (int i = 0; i < NR; i++) {
		static uint64_t got[MAXX], want[MAXX];
		const struct mrank *r = &mr[i];
		const size_t n = kvr_index_rank_blocks(idx, r->slot, got, MAXX);
		cr_assert_eq(n, (size_t)r->nx, "seed=%u step=%d rank %d: rank_blocks %zu vs %d",
		             seed, step, i, n, r->nx);
		memcpy(want, r->ext, (size_t)r->nx * sizeof(uint64_t));
		qsort(got, n, sizeof(uint64_t), cmp_u64);
		qsort(want, n, sizeof(uint64_t), cmp_u64);
		cr_assert_arr_eq(got, want, n * sizeof(uint64_t), "seed=%u step=%d rank %d", seed,
		                 step, i);
	}
}

static void run(unsigned seed, int steps)
{
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(NR * 2, &idx), 0);
	count_copies = seed % 2 == 0; /* events mode on even seeds */
	bool plain = seed % 4 >= 2;   /* ext = the sequence hash, as approximate modes store */
	kvr_index_set_count_copies(idx, count_copies);
	cr_assert_eq(kvr_index_set_locator(idx, !no_loc), 0);
	rng = seed * 2654435761u + 1;
	npaths = 0;
	memset(phash, 0, sizeof(phash));
	memset(mheld, 0, sizeof(mheld));
	maxx = deep ? MAXX : 1024;
	for (int i = 0; i < NR; i++) {
		mr[i] =
		    (struct mrank){.worker = (uint64_t)i / 2, .dp = (uint32_t)i % 2, .last_rm = -1};
		cr_assert_eq(kvr_index_rank_add(idx, mr[i].worker, mr[i].dp, &mr[i].slot), 0);
	}
	live_base = kvr_alloc_live_bytes() - (int64_t)kvr_index_memory_bytes(idx);
	m_pnf = m_inv = m_bnf = 0;
	for (int step = 0; step < steps; step++) {
		struct mrank *r = &mr[rnd(NR)];
		uint32_t op = rnd(100);
		const uint32_t xr = longc ? 100000 : 40; /* ext hashes drawn from 1..xr */
		if (longc && op < 15 && r->nx > 0) {
			/* Refill: store again a block below one the rank holds that some rank
			 * stored before (a hole the rank made, or another rank's block). */
			int k = (int)rnd((uint32_t)r->nx), c = -1;
			for (int id = npaths; id-- > 0;)
				if (paths[id].parent == r->node[k] && !mholds(r, id)) {
					c = id;
					break;
				}
			if (c >= 0) {
				struct kvr_index_block b1 = {plain ? mseq(c) : 1 + rnd(xr),
				                             paths[c].local};
				int got = kvr_index_store(idx, r->slot, &r->ext[k], &b1, 1);
				int want = mstore(r, &r->ext[k], &b1, 1);
				m_inv += want == KVR_EINVAL;
				cr_assert_eq(got, want, "seed=%u step=%d refill", seed, step);
				if (step % 8 == 0)
					check(idx, seed, step);
				continue;
			}
		}
		if (op < 55) {
			static struct kvr_index_block b[DEEPN];
			size_t n = deep && rnd(4) == 0    ? rnd(DEEPN)
			           : longc && rnd(8) == 0 ? rnd(LONGN)
			           : rnd(8) == 0          ? rnd(24)
			                                  : rnd(6);
			if (r->nx + (int)n >= maxx || npaths + (int)n >= MAXP)
				n = 0;
			uint64_t pext = 1 + rnd(xr);
			bool root = rnd(3) == 0 || r->nx == 0;
			int pn = -1;
			if (!root && rnd(4) != 0) {
				int k = (int)rnd((uint32_t)r->nx);
				pext = r->ext[k];
				pn = r->node[k];
			}
			const int pnode = pn; /* the parent's path id (-1: none known) */
			for (size_t i = 0; i < n; i++) {
				b[i] = (struct kvr_index_block){1 + rnd(xr), 1 + rnd(4)};
				if (plain && (root || pn >= 0)) {
					pn = intern(pn, b[i].local_hash, true);
					/* Mostly plain; on seeds 6, 7, 14, 15, .. ranks 0 and 1
					 * mostly aliased (engine hashes): runs they alone held
					 * are not in the locator until a plain block joins
					 * them (core/index_blocks.c). */
					if (rnd(10) < (seed % 8 >= 4 && r < &mr[2] ? 1u : 9u))
						b[i].ext_hash = mseq(pn);
				}
			}
			/* Sometimes fail the k-th allocation: a failed store changes nothing (deep
			 * stores allocate at more sites: bitmaps and hash arrays grow). */
			bool oom = rnd(6) == 0;
			if (oom)
				kvr_alloc_fail_after(1 + rnd(deep ? 64 : 8));
			int got;
			if (plain && !root && pnode >= 0 && pext == mseq(pnode) && rnd(2)) {
				/* The parent named by its path from the root. */
				static uint64_t path[MAXP];
				size_t np = 0;
				for (int id = pnode; id >= 0; id = paths[id].parent)
					np++;
				cr_assert_lt(np, MAXP);
				size_t d = np;
				for (int id = pnode; id >= 0; id = paths[id].parent)
					path[--d] = mseq(id);
				got = kvr_index_store_path(idx, r->slot, path, 1, np, b, n);
			} else {
				got = kvr_index_store(idx, r->slot, root ? NULL : &pext, b, n);
			}
			kvr_alloc_fail_after(0);
			if (got == KVR_ENOMEM) {
				cr_assert(oom, "seed=%u step=%d", seed, step);
			} else {
				int want = mstore(r, root ? NULL : &pext, b, n);
				m_pnf += want == KVR_ENOENT;
				m_inv += want == KVR_EINVAL;
				cr_assert_eq(got, want,
				             "seed=%u step=%d store (locator %d) got %d want %d",
				             seed, step, !no_loc, got, want);
			}
		} else if (op < 90 && deep && r->nx > 0 && rnd(3) == 0) {
			/* A chain's tail (or all of it) evicted, in chain order: the held blocks
			 * above a held block, up to 600 of them (a cut lowered across a run's end,
			 * a run trimmed at IDX_RUN_MAX). */
			static uint64_t e[600];
			size_t n = 0, nf;
			for (int id = r->node[rnd((uint32_t)r->nx)]; id >= 0 && n < 600;
			     id = paths[id].parent) {
				int k = 0;
				while (k < r->nx && r->node[k] != id)
					k++;
				if (k == r->nx)
					break;
				e[n++] = r->ext[k];
			}
			for (size_t i = 0; i < n / 2; i++) {
				const uint64_t t = e[i];
				e[i] = e[n - 1 - i];
				e[n - 1 - i] = t;
			}
			const size_t cut = rnd((uint32_t)n), nf_m = mremove(r, e + cut, n - cut);
			m_bnf += nf_m;
			const uint32_t rl = (uint32_t)(n - cut);
			cr_assert_eq(
			    kvr_index_remove_runs(idx, r->slot, e + cut, n - cut, &rl, 1, &nf), 0);
			cr_assert_eq(nf, nf_m, "seed=%u step=%d tail (locator %d)", seed, step,
			             !no_loc);
		} else if (op < 90) {
			uint64_t e[5];
			size_t n = rnd(5);
			for (size_t i = 0; i < n; i++)
				e[i] =
				    (r->nx && rnd(3)) ? r->ext[rnd((uint32_t)r->nx)] : 1 + rnd(xr);
			size_t nf_m = mremove(r, e, n), nf;
			m_bnf += nf_m;
			kvr_alloc_fail_after(rnd(4)); /* a removal never needs memory */
			if (rnd(2)) {
				uint32_t rl[5] = {0}, nr = 0;
				for (size_t left = n; left > 0; nr++) {
					rl[nr] = 1 + rnd((uint32_t)left);
					left -= rl[nr];
				}
				cr_assert_eq(kvr_index_remove_runs(idx, r->slot, e, n, rl, nr, &nf),
				             0);
			} else {
				cr_assert_eq(kvr_index_remove(idx, r->slot, e, n, &nf), 0);
			}
			kvr_alloc_fail_after(0);
			cr_assert_eq(nf, nf_m, "seed=%u step=%d remove (locator %d)", seed, step,
			             !no_loc);
		} else if (op < 94) {
			cr_assert_eq(kvr_index_clear_rank(idx, r->slot), 0);
			mclear(r);
		} else if (op < 97) {
			cr_assert_eq(kvr_index_clear_worker(idx, r->worker), 0);
			for (int i = 0; i < NR; i++)
				if (mr[i].worker == r->worker)
					mclear(&mr[i]);
		} else {
			cr_assert_eq(kvr_index_rank_remove(idx, r->slot), 0);
			mclear(r);
			int rc = kvr_index_rank_add(idx, r->worker, r->dp, &r->slot);
			if (rc == KVR_ERANGE) { /* every spare slot waits for its grace period */
				kvr_index_quiesce(idx);
				rc = kvr_index_rank_add(idx, r->worker, r->dp, &r->slot);
			}
			cr_assert_eq(rc, 0, "seed=%u step=%d", seed, step);
		}
		if (!longc || step % 8 == 0)
			check(idx, seed, step);
		const bool q = step % 256 == 0;
		if (q)
			kvr_index_quiesce(idx);
		check_stats(idx, seed, step, q);
	}
	/* Everything dropped -> no node left, memory back. */
	for (int i = 0; i < NR; i++)
		kvr_index_rank_remove(idx, mr[i].slot);
	kvr_index_quiesce(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, 0, "seed=%u", seed);
	cr_assert_eq(st.copies, 0, "seed=%u", seed);
	cr_assert_eq(st.bytes_shared, 0, "seed=%u", seed);
	cr_assert_eq(st.bytes_per_rank, 0, "seed=%u", seed);
	kvr_index_destroy(idx);
}

Test(index_diff, random_sequences)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	const char *env = getenv("KVR_SEED");
	if (env) {
		run((unsigned)strtoul(env, NULL, 10), 20000);
		return;
	}
	for (unsigned seed = 1; seed <= 24; seed++)
		run(seed, 3000);
}

/* Long chains: runs with bitmaps of several words, holes in them refilled (a refill must raise
 * a rank's cut back over every word it held past the hole). */
Test(index_diff, long_chains)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	longc = true;
	const char *env = getenv("KVR_SEED");
	if (env) {
		run((unsigned)strtoul(env, NULL, 10), 1500); /* more steps outgrow the model */
		return;
	}
	for (unsigned seed = 1; seed <= 8; seed++)
		run(seed, 1500);
}

/* Deep chains: stores of up to DEEPN blocks, so runs reach IDX_RUN_MAX and chain on in a child at
 * its end; holes, refills and tails evicted across that boundary, with and without the
 * locator.  KVR_SEED=N reruns one seed (KVR_STEPS steps). */
Test(index_diff, deep_chains, .timeout = 600)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	longc = deep = true;
	const char *env = getenv("KVR_SEED"), *st = getenv("KVR_STEPS");
	const int steps = st ? atoi(st) : 300;
	if (env) {
		run((unsigned)strtoul(env, NULL, 10), steps);
		no_loc = true;
		run((unsigned)strtoul(env, NULL, 10), steps);
		return;
	}
	for (unsigned seed = 1; seed <= 4; seed++)
		run(seed, steps);
	no_loc = true;
	for (unsigned seed = 1; seed <= 4; seed++)
		run(seed, steps);
}

/* The block locator's resizes migrate a slice per writer call; with nothing on top of
 * the least slice that keeps up, even this small locator spends several calls migrating, so stores
 * (inserts into both arrays), removals (drops from both), run ids freed and reused, and lookups
 * (both arrays) interleave with migrations. */
Test(index_diff, locator_migrating)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	kvr_index_blk_step_min = 0;
	const char *env = getenv("KVR_SEED");
	if (env) {
		run((unsigned)strtoul(env, NULL, 10), 20000);
		return;
	}
	for (unsigned seed = 1; seed <= 12; seed++)
		run(seed, 3000);
	longc = true;
	for (unsigned seed = 1; seed <= 4; seed++)
		run(seed, 1500);
}

/* The same streams in an index without the block locator (core/index_tops.c): every lookup a
 * write makes goes through the positions next to the last one, the run table, the ranks' end
 * maps, or the exact scan; the results must not change.  KVR_SEED=N reruns one seed. */
Test(index_diff, no_locator)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	no_loc = true;
	const char *env = getenv("KVR_SEED");
	if (env) {
		run((unsigned)strtoul(env, NULL, 10), 20000);
		longc = true;
		run((unsigned)strtoul(env, NULL, 10), 1500);
		return;
	}
	for (unsigned seed = 1; seed <= 24; seed++)
		run(seed, 3000);
	longc = true;
	for (unsigned seed = 1; seed <= 8; seed++)
		run(seed, 1500);
}
