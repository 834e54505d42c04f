/* The run index's block locator (core/index_blocks.c) under admission churn: deletions leave no
 * tombstones, so a steady live count never rebuilds the locator, and every live position stays
 * findable with exact counts through any number of insert / drop cycles.  And the writers'
 * one-step stretches (a store going on along a run, a removal of a run's next blocks) leave the
 * state the same blocks stored and removed one call each leave. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/hash.h"
#include "core/index.h"
#include "core/index_internal.h"
#include "core/select.h"
#include "kvrouter.h"
#include "sync/rcu.h"

enum { RANKS = 8, HELD = 24, L = 96, ADM = 4000 };

static uint64_t rng = 0x2545f4914f6cdd1dull;

/* A prompt of L random blocks stored as the approximate modes do (ext hash = sequence hash). */
static void make(struct kvr_index_block *b, uint64_t *seq)
{
	uint64_t local[L];
	for (size_t i = 0; i < L; i++)
		local[i] = kvr_rand64(&rng);
	kvr_hash_chain_locals(NULL, local, L, seq);
	for (size_t i = 0; i < L; i++)
		b[i] = (struct kvr_index_block){.ext_hash = seq[i], .local_hash = local[i]};
}

/* Every position past the first of every held prompt is in the locator, at its run's position
 * (the first is the run table's), and the locator counts exactly these. */
static void check_all(const struct kvr_index *idx, const uint64_t *seqs, int a)
{
	for (int k = 0; k < RANKS * HELD; k++) {
		const uint64_t *s = &seqs[(size_t)k * L];
		for (uint32_t p = 1; p < L; p++) {
			struct idx_run *r = NULL;
			uint32_t pos = 0;
			cr_assert(kvr_index_blk_find(idx, s[p], NULL, 0, &r, &pos),
			          "admission %d prompt %d position %u not found", a, k, p);
			cr_assert_eq(pos, p);
			cr_assert_eq(idx_run_seqs(r)[pos], s[p]);
		}
	}
	const struct idx_blocks *b = &idx->blk;
	cr_assert_eq(b->count + b->old_count, (uint64_t)RANKS * HELD * (L - 1),
	             "admission %d: the locator counts %lu entries", a,
	             (unsigned long)(b->count + b->old_count));
}

/* Whether every block past the first of the n prompts (prompt k: len[k] blocks at
 * seqs[k * stride]) is in the locator at its position; if not, the first that is not. */
static bool all_findable(const struct kvr_index *idx, const uint64_t *seqs, size_t stride,
                         const uint32_t *len, int n, int *pk, uint32_t *pj)
{
	for (int k = 0; k < n; k++)
		for (uint32_t j = 1; j < len[k]; j++) {
			struct idx_run *r = NULL;
			uint32_t pos = 0;
			if (!kvr_index_blk_find(idx, seqs[(size_t)k * stride + j], NULL, 0, &r,
			                        &pos) ||
			    pos != j) {
				*pk = k;
				*pj = j;
				return false;
			}
		}
	return true;
}

/* Each admission evicts a rank's oldest prompt (one removal: the run dies and drops its
 * entries) and stores a new one (one store: L - 1 inserts).  After the fill and one round of
 * evictions (the locator's growth to the steady count), 4000 admissions delete 380,000 entries,
 * over 10 times the locator's capacity: the old locator (tombstones) purged every 0.25 x cap
 * deletions, this one must not rebuild at all. */
Test(index_blocks, churn_at_steady_count_never_rebuilds)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(64, &idx), 0);
	uint32_t slot[RANKS];
	for (uint32_t r = 0; r < RANKS; r++)
		cr_assert_eq(kvr_index_rank_add(idx, 100 + r, 0, &slot[r]), 0);
	struct kvr_index_block *held = malloc(sizeof(*held) * RANKS * HELD * L);
	uint64_t *seqs = malloc(sizeof(*seqs) * RANKS * HELD * L);
	cr_assert(held && seqs);
	for (int k = 0; k < RANKS * HELD; k++) {
		make(&held[(size_t)k * L], &seqs[(size_t)k * L]);
		cr_assert_eq(kvr_index_store(idx, slot[k % RANKS], NULL, &held[(size_t)k * L], L),
		             0);
	}
	uint64_t rebuilds = 0;
	for (int a = 0; a < RANKS * HELD + ADM; a++) {
		if (a == RANKS * HELD) { /* every prompt replaced once: the steady state */
			check_all(idx, seqs, a);
			rebuilds = idx->blk.rebuilds;
		}
		const int k = a % (RANKS * HELD);
		struct kvr_index_block *h = &held[(size_t)k * L];
		uint64_t ext[L];
		for (size_t j = 0; j < L; j++)
			ext[j] = h[j].ext_hash;
		size_t nf = 1;
		cr_assert_eq(kvr_index_remove(idx, slot[k % RANKS], ext, L, &nf), 0);
		cr_assert_eq(nf, 0, "admission %d: an evicted block was not found", a);
		make(h, &seqs[(size_t)k * L]);
		cr_assert_eq(kvr_index_store(idx, slot[k % RANKS], NULL, h, L), 0);
		if (a % 997 == 0)
			check_all(idx, seqs, a);
	}
	check_all(idx, seqs, -1);
	cr_assert_eq(idx->blk.rebuilds, rebuilds, "%lu rebuilds at a steady live count",
	             (unsigned long)(idx->blk.rebuilds - rebuilds));
	cr_assert_null(idx->blk.old_e, "no migration left running");
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	cr_assert_eq(st.nodes, (uint64_t)RANKS * HELD * L);
	kvr_index_destroy(idx);
	free(held);
	free(seqs);
}

/* Shrinking is the other rebuild: evicting almost everything migrates to a smaller array, and
 * evicting the rest gives the locator back. */
Test(index_blocks, mass_removal_shrinks_then_frees)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(64, &idx), 0);
	uint32_t slot;
	cr_assert_eq(kvr_index_rank_add(idx, 1, 0, &slot), 0);
	enum { N = 256 };
	struct kvr_index_block *held = malloc(sizeof(*held) * N * L);
	uint64_t *seqs = malloc(sizeof(*seqs) * N * L);
	cr_assert(held && seqs);
	for (int k = 0; k < N; k++) {
		make(&held[(size_t)k * L], &seqs[(size_t)k * L]);
		cr_assert_eq(kvr_index_store(idx, slot, NULL, &held[(size_t)k * L], L), 0);
	}
	const uint64_t big = idx->blk.cap, r0 = idx->blk.rebuilds;
	for (int k = 0; k < N; k++) {
		uint64_t ext[L];
		for (size_t j = 0; j < L; j++)
			ext[j] = held[(size_t)k * L + j].ext_hash;
		size_t nf = 1;
		cr_assert_eq(kvr_index_remove(idx, slot, ext, L, &nf), 0);
		cr_assert_eq(nf, 0);
		if (k == N - 5) {
			cr_assert_gt(idx->blk.rebuilds, r0, "no shrink");
			cr_assert_lt(idx->blk.cap, big / 8, "cap %lu of %lu, count %lu old %p",
			             (unsigned long)idx->blk.cap, (unsigned long)big,
			             (unsigned long)idx->blk.count, (void *)idx->blk.old_e);
			for (int j = k + 1; j < N; j++) /* the last prompts are still findable */
				for (uint32_t p = 1; p < L; p++) {
					struct idx_run *r;
					uint32_t pos;
					cr_assert(kvr_index_blk_find(idx, seqs[(size_t)j * L + p],
					                             NULL, 0, &r, &pos));
					cr_assert_eq(pos, p);
				}
		}
	}
	cr_assert_null(idx->blk.e, "an empty locator holds no array");
	cr_assert_null(idx->blk.old_e);
	kvr_index_destroy(idx);
	free(held);
	free(seqs);
}

/* Runs created while a growth migration is still zeroing the new array, when the id directory
 * grows with them, get ids past the migration's end: their entries went to the old array (the
 * new one was not usable yet), and once zeroing ended nothing looked there for them (the old
 * array answers only for ids in [mig, mig_end), and only those move): the blocks were held but
 * not findable, a store below them failed (KVR_ENOENT), and the rank's index lost what its
 * predicted cache held (test_sync_nats, test_false_death: index_write errors, Jaccard 0.9985).
 * trial * 7 prompts of four blocks, then two-block prompts (one entry and one new id each): the
 * directory's growth falls at a different point of the table's growth each trial; with the
 * least slices (kvr_index_blk_step_min 0) zeroing spans many stores (trial 29 lost a block). */
Test(index_blocks, runs_born_while_zeroing_stay_findable)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	enum { N = 12000, M = 4 };
	uint64_t *seqs = malloc(sizeof(*seqs) * N * M);
	uint32_t *len = malloc(sizeof(*len) * N);
	cr_assert(seqs && len);
	uint64_t step_min = kvr_index_blk_step_min;
	kvr_index_blk_step_min = 0; /* the least slices: zeroing spans many stores */
	for (int trial = 0; trial < 300; trial++) {
		struct kvr_index *idx;
		cr_assert_eq(kvr_index_create(64, &idx), 0);
		uint32_t slot;
		cr_assert_eq(kvr_index_rank_add(idx, 100, 0, &slot), 0);
		for (int k = 0; k < N; k++) {
			uint64_t local[M];
			len[k] = k < trial * 7 ? M : 2;
			struct kvr_index_block b[M];
			for (uint32_t j = 0; j < len[k]; j++)
				local[j] = kvr_rand64(&rng);
			kvr_hash_chain_locals(NULL, local, len[k], &seqs[(size_t)k * M]);
			for (uint32_t j = 0; j < len[k]; j++)
				b[j] = (struct kvr_index_block){seqs[(size_t)k * M + j], local[j]};
			cr_assert_eq(kvr_index_store(idx, slot, NULL, b, len[k]), 0);
		}
		int k;
		uint32_t j;
		cr_assert(all_findable(idx, seqs, M, len, N, &k, &j),
		          "trial %d: prompt %d of %d: block %u is not found at its position "
		          "(rebuilds %lu)",
		          trial, k, N, j, (unsigned long)idx->blk.rebuilds);
		kvr_index_destroy(idx);
	}
	kvr_index_blk_step_min = step_min;
	free(seqs);
	free(len);
}

/* The locator's memory: filled run by run (16 blocks each, 15 entries), its load never passes
 * the growth threshold, and once past the small sizes it never sits below 0.6 while no
 * migration runs (a growth sizes the new array for load 0.8, rounded up to a size class: at
 * most 1.25x; it grew to 0.57 before), so a settled index pays at most 4 / 0.6 bytes per
 * entry.  Every block stays findable through the growths, first blocks through the run table. */
Test(index_blocks, load_stays_between_growths)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	enum { N = 6000, M = 16 };
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(64, &idx), 0);
	uint32_t slot;
	cr_assert_eq(kvr_index_rank_add(idx, 1, 0, &slot), 0);
	uint64_t *seqs = malloc(sizeof(*seqs) * N * M);
	cr_assert(seqs);
	const struct idx_blocks *b = &idx->blk;
	uint64_t settled = 0, grows = 0, cap0 = 0;
	for (int k = 0; k < N; k++) {
		uint64_t local[M];
		struct kvr_index_block blk[M];
		for (uint32_t j = 0; j < M; j++)
			local[j] = kvr_rand64(&rng);
		kvr_hash_chain_locals(NULL, local, M, &seqs[(size_t)k * M]);
		for (uint32_t j = 0; j < M; j++)
			blk[j] = (struct kvr_index_block){seqs[(size_t)k * M + j], local[j]};
		cr_assert_eq(kvr_index_store(idx, slot, NULL, blk, M), 0);
		const uint64_t live = b->count + b->old_count;
		cr_assert_leq(live * 1000, b->cap * kvr_index_blk_grow_at, "run %d: load %.3f", k,
		              (double)live / (double)b->cap);
		grows += b->cap != cap0;
		cap0 = b->cap;
		if (b->old_e || b->cap < 4096)
			continue;
		settled++;
		cr_assert_geq(live * 10, b->cap * 6, "run %d: load %.3f at cap %lu", k,
		              (double)live / (double)b->cap, (unsigned long)b->cap);
	}
	cr_assert_gt(settled, N / 2);
	cr_assert_gt(grows, 10);
	for (int k = 0; k < N; k++)
		for (uint32_t j = 0; j < M; j++) {
			struct idx_run *r = NULL;
			uint32_t pos = 99;
			cr_assert(
			    kvr_index_blk_find(idx, seqs[(size_t)k * M + j], NULL, 0, &r, &pos),
			    "run %d block %u not found", k, j);
			cr_assert_eq(pos, j);
			cr_assert_eq(idx_run_hash(r, pos), seqs[(size_t)k * M + j]);
		}
	kvr_index_destroy(idx);
	free(seqs);
}

/* The chunk walks (a tag's stride over a prime number of chunks) under random stores and
 * removals of prompts of up to 40 blocks that grow over several stores while others die, so
 * that runs hold many equal pairs (one run, one tag: equal entries, deleted in either order) and
 * a later block's entry can sit nearer an earlier one's home than the earlier one's own (a slot
 * freed meanwhile): every held block stays findable at its position and the locator counts
 * exactly the held positions past the first; emptying the index gives the array back.  Least
 * migration slices (step_min 0), so calls also meet a migrating locator.  3 prompts keep the
 * array at a few chunks (walks wrap, most entries have an equal twin), 400 spread them.  A
 * stride from the hash instead of the tag (equal entries on different cycles) fails it at the
 * first hundred operations. */
static void random_runs(int NP, int OPS)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	enum { M = 40 };
	uint64_t step_min = kvr_index_blk_step_min;
	kvr_index_blk_step_min = 0;
	struct kvr_index *idx;
	cr_assert_eq(kvr_index_create(64, &idx), 0);
	uint32_t slot;
	cr_assert_eq(kvr_index_rank_add(idx, 7, 0, &slot), 0);
	uint64_t *seqs = calloc((size_t)NP * M, sizeof(*seqs));
	uint32_t *len = calloc(NP, sizeof(*len)); /* 0: not held */
	cr_assert(seqs && len);
	uint64_t held = 0; /* positions past the first of held prompts */
	for (int op = 0; op < OPS; op++) {
		const int k = (int)(kvr_rand64(&rng) % NP);
		uint64_t *s = &seqs[(size_t)k * M];
		if (len[k] && (len[k] == M || kvr_rand64(&rng) % 3 == 0)) {
			size_t nf = 1;
			cr_assert_eq(kvr_index_remove(idx, slot, s, len[k], &nf), 0);
			cr_assert_eq(nf, 0, "op %d: prompt %d lost a block", op, k);
			held -= len[k] - 1;
			len[k] = 0;
		} else {
			/* A new prompt, or the next blocks of a held one (its run grows while
			 * others die: a later block's entry can land nearer an earlier one's
			 * home than the earlier one's own, in a slot freed meanwhile) */
			const uint32_t at = len[k], room = M - at;
			const uint32_t n =
			    (at ? 1 : 2) + (uint32_t)(kvr_rand64(&rng) % (room < 8 ? room : 8));
			uint64_t local[M];
			struct kvr_index_block b[M];
			for (uint32_t j = 0; j < n; j++)
				local[j] = kvr_rand64(&rng);
			kvr_hash_chain_locals(at ? &s[at - 1] : NULL, local, n, &s[at]);
			for (uint32_t j = 0; j < n; j++)
				b[j] = (struct kvr_index_block){s[at + j], local[j]};
			cr_assert_eq(kvr_index_store(idx, slot, at ? &s[at - 1] : NULL, b, n), 0);
			len[k] = at + n;
			held += at ? n : n - 1;
		}
		cr_assert_eq(
		    idx->blk.count + idx->blk.old_count, held, "op %d: %lu entries, %lu held", op,
		    (unsigned long)(idx->blk.count + idx->blk.old_count), (unsigned long)held);
		if (NP > 10 && op % 250 != 0)
			continue;
		int q;
		uint32_t j;
		cr_assert(all_findable(idx, seqs, M, len, NP, &q, &j),
		          "op %d: prompt %d block %u not found at its position", op, q, j);
	}
	for (int k = 0; k < NP; k++)
		if (len[k]) {
			size_t nf = 1;
			cr_assert_eq(kvr_index_remove(idx, slot, &seqs[(size_t)k * M], len[k], &nf),
			             0);
			cr_assert_eq(nf, 0);
		}
	cr_assert_null(idx->blk.e, "an empty locator holds no array");
	cr_assert_null(idx->blk.old_e);
	kvr_index_blk_step_min = step_min;
	kvr_index_destroy(idx);
	free(seqs);
	free(len);
}

Test(index_blocks, random_runs_with_equal_pairs_stay_findable)
{
	for (int i = 0; i < 200; i++)
		random_runs(3, 300);
	random_runs(400, 6000);
}

/* ---- a stretch in one call equals the same blocks one call each (core/index_write.c:
 * extend_run, shorten_run: the store's and the removal's one-step paths). */

enum { SP = 6, SL = 300, SR = 4, SOPS = 1500 };

/* Ranks' scores on every prompt and their block sets are equal in a and b. */
static void same_state(struct kvr_index *a, struct kvr_index *b, const uint32_t *sa,
                       const uint32_t *sb, const uint64_t *seqs, int op, uint64_t seed)
{
	for (int k = 0; k < SP; k++) {
		struct kvr_index_match ma[SR], mb[SR];
		size_t na = 0, nb = 0;
		kvr_rcu_read_lock();
		cr_assert_eq(
		    kvr_index_find_matches(a, &seqs[(size_t)k * SL], SL, NULL, ma, SR, &na), 0);
		cr_assert_eq(
		    kvr_index_find_matches(b, &seqs[(size_t)k * SL], SL, NULL, mb, SR, &nb), 0);
		kvr_rcu_read_unlock();
		uint32_t sca[SR] = {0}, scb[SR] = {0};
		for (size_t i = 0; i < na; i++)
			for (int r = 0; r < SR; r++)
				if (ma[i].slot == sa[r])
					sca[r] = ma[i].score;
		for (size_t i = 0; i < nb; i++)
			for (int r = 0; r < SR; r++)
				if (mb[i].slot == sb[r])
					scb[r] = mb[i].score;
		for (int r = 0; r < SR; r++)
			cr_assert_eq(sca[r], scb[r],
			             "seed %lu op %d prompt %d rank %d: score %u in one call, %u "
			             "block by block",
			             (unsigned long)seed, op, k, r, sca[r], scb[r]);
	}
	for (int r = 0; r < SR; r++) {
		cr_assert_eq(kvr_index_tree_size(a, sa[r]), kvr_index_tree_size(b, sb[r]),
		             "seed %lu op %d rank %d: tree sizes differ", (unsigned long)seed, op,
		             r);
		cr_assert_eq(kvr_index_rank_blocks(a, sa[r], NULL, 0),
		             kvr_index_rank_blocks(b, sb[r], NULL, 0));
	}
	struct kvr_index_stats x, y;
	kvr_index_stats_get(a, &x);
	kvr_index_stats_get(b, &y);
	cr_assert_eq(x.nodes, y.nodes, "seed %lu op %d: %lu blocks in the tree, %lu block by block",
	             (unsigned long)seed, op, (unsigned long)x.nodes, (unsigned long)y.nodes);
}

Test(index_blocks, stretches_equal_block_by_block)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	for (uint64_t seed = 1; seed <= 6; seed++) {
		rng = seed * 0x9e3779b97f4a7c15ull;
		/* Prompt k > 0 keeps a random prefix of an earlier one: ranks meet on runs another
		 * rank stored (the P_EXISTS stretches). */
		uint64_t *seqs = malloc(sizeof(uint64_t) * SP * SL),
		         *local = malloc(sizeof(uint64_t) * SP * SL);
		for (int k = 0; k < SP; k++) {
			uint32_t keep = k ? (uint32_t)(kvr_rand64(&rng) % SL) : 0;
			const int o = k ? (int)(kvr_rand64(&rng) % (uint64_t)k) : 0;
			for (uint32_t j = 0; j < SL; j++)
				local[k * SL + j] = j < keep ? local[o * SL + j] : kvr_rand64(&rng);
			kvr_hash_chain_locals(NULL, &local[k * SL], SL, &seqs[k * SL]);
		}
		struct kvr_index *a, *b;
		uint32_t sa[SR], sb[SR];
		cr_assert_eq(kvr_index_create(16, &a), 0);
		cr_assert_eq(kvr_index_create(16, &b), 0);
		for (int r = 0; r < SR; r++) {
			cr_assert_eq(kvr_index_rank_add(a, (uint64_t)r, 0, &sa[r]), 0);
			cr_assert_eq(kvr_index_rank_add(b, (uint64_t)r, 0, &sb[r]), 0);
		}
		for (int op = 0; op < SOPS; op++) {
			const int k = (int)(kvr_rand64(&rng) % SP),
			          r = (int)(kvr_rand64(&rng) % SR);
			const uint32_t x = (uint32_t)(kvr_rand64(&rng) % SL),
			               y = (uint32_t)(kvr_rand64(&rng) % SL);
			const uint32_t lo = x < y ? x : y, hi = (x < y ? y : x) + 1;
			const uint64_t *s = &seqs[(size_t)k * SL];
			const uint64_t what = kvr_rand64(&rng) % 8;
			if (what < 4) { /* store [lo, hi) below lo - 1 */
				struct kvr_index_block blk[SL];
				for (uint32_t j = lo; j < hi; j++)
					blk[j - lo] =
					    (struct kvr_index_block){s[j], local[k * SL + j]};
				const int ra =
				    kvr_index_store(a, sa[r], lo ? &s[lo - 1] : NULL, blk, hi - lo);
				int rb = 0;
				for (uint32_t j = lo; j < hi && rb == 0; j++)
					rb = kvr_index_store(b, sb[r], j ? &s[j - 1] : NULL,
					                     &blk[j - lo], 1);
				cr_assert_eq(ra, rb, "seed %lu op %d: store [%u, %u) rc %d, %d",
				             (unsigned long)seed, op, lo, hi, ra, rb);
			} else if (what < 7) { /* remove [lo, hi) in chain order (a tail if held) */
				size_t na = 0, nb = 0, nf = 0;
				cr_assert_eq(kvr_index_remove(a, sa[r], &s[lo], hi - lo, &na), 0);
				for (uint32_t j = lo; j < hi; j++) {
					cr_assert_eq(kvr_index_remove(b, sb[r], &s[j], 1, &nf), 0);
					nb += nf;
				}
				cr_assert_eq(na, nb,
				             "seed %lu op %d: remove [%u, %u) not found %zu, %zu",
				             (unsigned long)seed, op, lo, hi, na, nb);
			} else { /* an interior hole */
				cr_assert_eq(kvr_index_remove(a, sa[r], &s[x], 1, NULL), 0);
				cr_assert_eq(kvr_index_remove(b, sb[r], &s[x], 1, NULL), 0);
			}
			same_state(a, b, sa, sb, seqs, op, seed);
		}
		kvr_index_destroy(a);
		kvr_index_destroy(b);
		free(seqs);
		free(local);
	}
}

/* ---- runs only ever held under engine hashes are not in the locator (core/index_blocks.c:
 * "Located runs"): their holders find their blocks through the ext maps' places. */

/* Slot's score on the chain seq[0..n) (0: not listed). */
static uint32_t score_in(struct kvr_index *idx, const uint64_t *seq, size_t n, uint32_t slot)
{
	struct kvr_index_match m[8];
	size_t k = 0;
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_index_find_matches(idx, seq, n, NULL, m, 8, &k), 0);
	kvr_rcu_read_unlock();
	for (size_t i = 0; i < k; i++)
		if (m[i].slot == slot)
			return m[i].score;
	return 0;
}

/* A chain of n blocks: local[i], seq[i] (below parent *pseq, NULL: the root); ext[i] = seq[i]
 * (plain) or an engine hash of rank tag (aliased). */
static void names(struct kvr_index_block *b, const uint64_t *local, const uint64_t *seq, size_t n,
                  uint64_t tag)
{
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_index_block){
		    .ext_hash = tag ? (seq[i] ^ tag * 0x9e3779b97f4a7c15ull) : seq[i],
		    .local_hash = local[i]};
}

/* A run an aliased rank alone holds has no locator entry and no id; the first plain holder
 * puts its positions in (P_EXISTS: a rank storing the same chain plainly; P_APPEND: the aliased
 * rank itself appending plain blocks at the run's end).  SQLite-style: every allocation of that
 * store fails once, and each failure changes nothing a caller sees (sizes, scores, names);
 * after the success every position is in the locator at its place, removals by sequence hash
 * and by alias find their blocks, and everything dropped gives every byte back. */
Test(index_blocks, plain_holder_locates_an_aliased_run)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	enum { N = 150, K = 4 };
	uint64_t local[N + K], seq[N + K];
	for (int i = 0; i < N + K; i++)
		local[i] = 0x5000 + (uint64_t)i;
	kvr_hash_chain_locals(NULL, local, N + K, seq);
	struct kvr_index_block a[N + K], p[N + K];
	names(a, local, seq, N + K, 1);
	names(p, local, seq, N + K, 0);
	for (int how = 0; how < 2; how++) { /* 0: another rank (P_EXISTS), 1: P_APPEND */
		struct kvr_index *idx;
		uint32_t ra, rp;
		cr_assert_eq(kvr_index_create(8, &idx), 0);
		cr_assert_eq(kvr_index_rank_add(idx, 1, 0, &ra), 0);
		cr_assert_eq(kvr_index_rank_add(idx, 2, 0, &rp), 0);
		cr_assert_eq(kvr_index_store(idx, ra, NULL, a, N), 0);
		cr_assert_eq(idx->blk.count + idx->blk.old_count, 0, "an aliased run is located");
		cr_assert_null(idx->blk.dir, "an aliased run has an id");
		const uint32_t who = how ? ra : rp;
		const uint64_t *parent = how ? &a[N - 1].ext_hash : NULL;
		const struct kvr_index_block *w = how ? &p[N] : p;
		const size_t wn = how ? K : N;
		int rc = KVR_ENOMEM;
		uint64_t nth;
		for (nth = 1; nth < 200 && rc != 0; nth++) {
			kvr_alloc_fail_after(nth);
			rc = kvr_index_store(idx, who, parent, w, wn);
			kvr_alloc_fail_after(0);
			if (rc == 0)
				break;
			cr_assert_eq(rc, KVR_ENOMEM, "how %d nth=%lu", how, (unsigned long)nth);
			cr_assert_eq(kvr_index_tree_size(idx, ra), N, "nth=%lu",
			             (unsigned long)nth);
			cr_assert_eq(kvr_index_tree_size(idx, rp), 0, "nth=%lu",
			             (unsigned long)nth);
			cr_assert_eq(kvr_index_rank_blocks(idx, ra, NULL, 0), N);
			cr_assert_eq(score_in(idx, seq, N + K, ra), N);
			cr_assert_eq(score_in(idx, seq, N + K, rp), 0);
		}
		cr_assert_eq(rc, 0, "how %d", how);
		cr_assert_gt(nth, 2, "how %d: the locator's entries and id allocate", how);
		cr_assert_eq(score_in(idx, seq, N + K, ra), how ? N + K : N);
		cr_assert_eq(score_in(idx, seq, N + K, rp), how ? 0 : N);
		const uint32_t hi = how ? N + K : N;
		cr_assert_eq(idx->blk.count + idx->blk.old_count, hi - 1);
		for (uint32_t j = 1; j < hi; j++) {
			struct idx_run *r = NULL;
			uint32_t pos = 0;
			cr_assert(kvr_index_blk_find(idx, seq[j], NULL, 0, &r, &pos), "how %d %u",
			          how, j);
			cr_assert_eq(idx_run_hash(r, pos), seq[j]);
		}
		/* Removals by sequence hash (plain) and by alias find their blocks. */
		size_t nf = 9;
		cr_assert_eq(kvr_index_remove(idx, who, &w[1].ext_hash, 1, &nf), 0);
		cr_assert_eq(nf, 0);
		cr_assert_eq(kvr_index_remove(idx, ra, &a[70].ext_hash, 1, &nf), 0);
		cr_assert_eq(nf, 0);
		cr_assert_eq(kvr_index_remove(idx, ra, &seq[71], 1, &nf), 0);
		cr_assert_eq(nf, 1, "an aliased block named by its sequence hash");
		cr_assert_eq(score_in(idx, seq, N + K, ra), 70);
		cr_assert_eq(score_in(idx, seq, N + K, rp), how ? 0 : 1);
		cr_assert_eq(kvr_index_clear_rank(idx, ra), 0);
		cr_assert_eq(kvr_index_clear_rank(idx, rp), 0);
		kvr_index_quiesce(idx);
		struct kvr_index_stats st;
		kvr_index_stats_get(idx, &st);
		cr_assert_eq(st.bytes_shared, 0);
		cr_assert_eq(st.bytes_per_rank, 0);
		kvr_index_destroy(idx);
	}
}

/*
 * A crafted root on a hash that only an aliased run has inside: the locator does not see it,
 * so the root is accepted (as in an index without the locator), and so is a chain the crafter
 * copies below it (appended without a probe).  A plain rank that then stores the aliased chain
 * would put that run into the locator with positions a located run (the crafter's copy) has
 * too: refused as a collision, nothing applied.  Without the copy below the crafted root (the
 * root alone: its first block is in the run table, a place the locator's lookups already
 * tell apart), or once the crafter is gone, the plain rank's store is accepted, and each
 * rank's removals find its own block.
 */
Test(index_blocks, crafted_root_over_an_aliased_run)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	enum { N = 10, X = 4 };
	uint64_t local[N], seq[N];
	for (int i = 0; i < N; i++)
		local[i] = 0x7000 + (uint64_t)i;
	kvr_hash_chain_locals(NULL, local, N, seq);
	struct kvr_index_block a[N], p[N];
	names(a, local, seq, N, 3);
	names(p, local, seq, N, 0);
	for (int copy = 0; copy < 2; copy++) {
		struct kvr_index *idx;
		uint32_t ra, rp, rc_;
		cr_assert_eq(kvr_index_create(8, &idx), 0);
		cr_assert_eq(kvr_index_rank_add(idx, 1, 0, &ra), 0);
		cr_assert_eq(kvr_index_rank_add(idx, 2, 0, &rp), 0);
		cr_assert_eq(kvr_index_rank_add(idx, 3, 0, &rc_), 0);
		cr_assert_eq(kvr_index_store(idx, ra, NULL, a, N), 0);
		/* The crafter's root: its sequence hash (its local hash) is seq[X]. */
		const struct kvr_index_block root = {.ext_hash = seq[X], .local_hash = seq[X]};
		cr_assert_eq(kvr_index_store(idx, rc_, NULL, &root, 1), 0);
		if (copy) { /* seq[X + 1] below it: chain(seq[X], local[X + 1]) */
			cr_assert_eq(kvr_index_store(idx, rc_, &seq[X], &p[X + 1], 1), 0);
		}
		struct kvr_index_stats st0, st;
		kvr_index_stats_get(idx, &st0);
		const int want = copy ? KVR_EINVAL : 0;
		cr_assert_eq(kvr_index_store(idx, rp, NULL, p, N), want, "copy %d", copy);
		kvr_index_stats_get(idx, &st);
		cr_assert_eq(st.invalid, st0.invalid + (copy ? 1 : 0));
		cr_assert_eq(kvr_index_tree_size(idx, rp), copy ? 0 : N);
		cr_assert_eq(score_in(idx, seq, N, ra), N);
		cr_assert_eq(score_in(idx, &seq[X], 1, rc_), 1);
		/* Each rank's removal of the shared hash finds its own block. */
		size_t nf = 9;
		cr_assert_eq(kvr_index_remove(idx, rc_, &seq[X], 1, &nf), 0);
		cr_assert_eq(nf, 0);
		if (!copy) {
			cr_assert_eq(kvr_index_remove(idx, rp, &seq[X], 1, &nf), 0);
			cr_assert_eq(nf, 0);
			cr_assert_eq(score_in(idx, seq, N, rp), X);
		}
		cr_assert_eq(kvr_index_remove(idx, ra, &a[X].ext_hash, 1, &nf), 0);
		cr_assert_eq(nf, 0);
		cr_assert_eq(score_in(idx, seq, N, ra), X);
		/* The crafter gone, the plain chain is accepted; a crafted root on a hash of a
		 * located run is refused again. */
		cr_assert_eq(kvr_index_clear_rank(idx, rc_), 0);
		cr_assert_eq(kvr_index_store(idx, rp, NULL, p, N), 0);
		cr_assert_eq(score_in(idx, seq, N, rp), N);
		const struct kvr_index_block r2 = {.ext_hash = seq[X + 2],
		                                   .local_hash = seq[X + 2]};
		cr_assert_eq(kvr_index_store(idx, rc_, NULL, &r2, 1), KVR_EINVAL);
		kvr_index_destroy(idx);
	}
}
