/*
 * core/index_match.c - find_matches, the run index's read side.
 *
 * The walk, given the query's sequence hashes seq[0..n): the run whose first block is seq[0]
 * (below the root) starts it.  At a run R entered at query position q, the overlap is
 * m = min(len, n - q) blocks; since a sequence hash names its whole prefix, ONE comparison of
 * R's hash at position m-1 with seq[q+m-1] decides whether all m match, and where it differs a
 * binary search finds the matched length k (R's position 0 matched already: it is how R was
 * found).  Then R's holders are intersected with the ranks still active: a rank whose cut (its
 * gap-free prefix of R) is below k scores q + cut and drops out; the others go on to the child
 * of R at offset k, found by one table probe for seq[q+k].  So a query costs one probe and
 * O(log run) comparisons per run on its path, plus the per-rank intersection; holes only lower
 * cuts, they add no run.
 *
 * Ranks are kept in the caller's out array: the active set sorted by slot at the front, ranks
 * that dropped out at the back, moved together at the end.  The per-rank work is what a query
 * with many holders pays (64 ranks on a hot prefix: it was ~70 % of find_matches), so each
 * case has its own tight loop: the first run places its holders with their tree sizes in one
 * pass; a later run whose words line up one for one with the active ranks, all past the match
 * (the hot prefix's shape), keeps them with one compare each; the merge keeps the current word
 * in a register; and a run with few holders for many active ranks (a branch that only some
 * took) finds each holder by a galloping search after scoring every rank absent in one loop.
 * callgrind (bench_index_runs --cg, instructions per query, before -> after): L=512 b
 * 3,022 -> 1,490, L=8192 b 7,042 -> 4,831, sessions (pattern d) L=128 4,766 -> 3,038.
 * A per-run minimum cut published by the writers would save the compare of cuts in the
 * lined-up loop only (the slots must be compared anyway: a run's holders are not the active
 * set in general), for a writer scan of the run's holders whenever its lowest cut rises.
 *
 * Context: any registered thread inside kvr_rcu_read_lock(); no lock, no allocation, no retry.
 * Ordering: len with seqs (one word) and hs are acquire loads (pairing with the writers' release
 * stores), the holder words relaxed: a cut covers positions whose content is permanent
 * (write-once), so crediting min(cut, k) never credits a block the rank did not store.
 */
#include <string.h>

#include "core/cpu.h"
#include "core/index_internal.h"
#include "core/index_match.h"
#include "kvrouter.h"

/* ThreadSanitizer sees the holder words only through the scalar atomic loads (gcc says so with
 * __SANITIZE_THREAD__, clang with __has_feature): no vector loads of them there. */
#if defined(__SANITIZE_THREAD__)
#define MATCH_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MATCH_TSAN 1
#endif
#endif
#if defined(__x86_64__) && defined(__SSE2__) && !defined(MATCH_TSAN)
#define MATCH_SSE2 1
#include <emmintrin.h>
#endif
/* find_depths' AVX2 loops: compiled with target("avx2") whatever -march, taken where the CPU
 * has AVX2 (checked once, as core/select.c does). */
#if defined(MATCH_SSE2) && defined(__GNUC__)
#define MATCH_AVX2 1
#include <immintrin.h>
#endif

static inline uint32_t wslot(uint64_t w)
{
	return (uint32_t)(w >> 32);
}

static inline void swap_match(struct kvr_index_match *x, struct kvr_index_match *y)
{
	struct kvr_index_match t = *x;
	*x = *y;
	*y = t;
}

/* The merge of out[i..a) with the words hw[j..n): w is the current word (~0 past the end: a
 * slot above every rank's), kept in a register, so a rank absent from the run costs a compare
 * and its score.  A duplicate word of a slot (equal: see the first run's loop) is passed over
 * as a smaller slot by the next rank's search.  Kept ranks are swapped to the front from
 * out[i] on; returns the kept end. */
static size_t part_merge(struct kvr_index_match *out, size_t i, size_t a, const uint64_t *hw,
                         size_t j, uint32_t n, size_t k, size_t q)
{
	const uint64_t *hp = hw + j, *const he = hw + n;
	uint64_t w = hp < he ? __atomic_load_n(hp, __ATOMIC_RELAXED) : ~0ull;
	struct kvr_index_match *kp = out + i;
	for (struct kvr_index_match *ip = kp, *const ie = out + a; ip < ie; ip++) {
		const uint32_t want = ip->slot;
		while (wslot(w) < want)
			w = ++hp < he ? __atomic_load_n(hp, __ATOMIC_RELAXED) : ~0ull;
		uint32_t cut = 0;
		if (wslot(w) == want) {
			cut = (uint32_t)w;
			w = ++hp < he ? __atomic_load_n(hp, __ATOMIC_RELAXED) : ~0ull;
		}
		if (cut >= k) {
			if (kp != ip)
				swap_match(kp, ip);
			kp++;
		} else {
			ip->score = (uint32_t)(q + cut);
		}
	}
	return (size_t)(kp - out);
}

/* The same partition when the run has few words left for many ranks (a branch that only some
 * ranks took): every rank scores q (absent) in one tight loop, then each word's rank is found
 * by a galloping search in the sorted out[..a) (O(words * log(ranks / words))) and gets its
 * cut, or is swapped to the front when it keeps going.  The order of the ranks that drop out
 * is not the merge's (the contract leaves it open; route.c scatters them by slot). */
static size_t part_search(struct kvr_index_match *out, size_t i, size_t a, const uint64_t *hw,
                          size_t j, uint32_t n, size_t k, size_t q)
{
	for (size_t x = i; x < a; x++)
		out[x].score = (uint32_t)q;
	size_t kp = i, lo = i;
	uint32_t prev = UINT32_MAX;
	for (; j < n && lo < a; j++) {
		const uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
		const uint32_t want = wslot(w);
		if (want == prev)
			continue;
		prev = want;
		/* Gallop: out[lo + step/2 - 1] < want <= out[lo + step - 1] (or the end). */
		size_t step = 1;
		while (lo + step - 1 < a && out[lo + step - 1].slot < want)
			step *= 2;
		size_t l = lo + step / 2, h = lo + step - 1 < a ? lo + step - 1 : a;
		if (step == 1)
			l = lo;
		while (l < h) { /* first position in [l, h) with slot >= want, else h */
			size_t mid = (l + h) / 2;
			if (out[mid].slot < want)
				l = mid + 1;
			else
				h = mid;
		}
		lo = l;
		if (lo == a || out[lo].slot != want)
			continue;
		const uint32_t cut = (uint32_t)w;
		if (cut >= k) {
			if (kp != lo)
				swap_match(&out[kp], &out[lo]);
			kp++;
		} else {
			out[lo].score = (uint32_t)(q + cut);
		}
		lo++;
	}
	return kp;
}

/* Keeps in out[0..a) the ranks whose cut in hw[0..n) is >= k; moves the others to
 * out[cap-*f-d .. cap-*f) with score q + cut (0 when absent).  Returns the new active count.
 *
 * The common case on a hot prefix is that the run's holders ARE the active ranks and all hold
 * it past k: then word i is active rank i's, so a first loop compares them one for one (slot
 * and cut in one load, no swap) and keeps what lines up; the rest is partitioned by the merge,
 * or by searches when few words remain for many ranks (the words before are the kept ranks',
 * all of smaller slots). */
static size_t intersect(struct kvr_index_match *out, size_t a, const uint64_t *hw, uint32_t n,
                        size_t k, size_t q, size_t cap, size_t *f)
{
	const size_t lim = a < n ? a : n;
	size_t keep = 0;
	for (; keep < lim; keep++) {
		uint64_t w = __atomic_load_n(&hw[keep], __ATOMIC_RELAXED);
		if (wslot(w) != out[keep].slot || (uint32_t)w < k)
			break;
	}
	if (keep == a)
		return a;
	if ((n - keep) * 4 <= a - keep)
		keep = part_search(out, keep, a, hw, keep, n, k, q);
	else
		keep = part_merge(out, keep, a, hw, keep, n, k, q);
	size_t d = a - keep;
	if (d) {
		memmove(&out[cap - *f - d], &out[keep], d * sizeof(*out));
		*f += d;
	}
	return keep;
}

/* The ranks holding seq[0] (cut >= 1) in the first run's words hw[0..hn), in slot order, each
 * placed with its tree size at once (it moves with the entry): those whose cut is >= k at
 * out[0..*a), the others (score = cut) from out[cap) down, *f of them.  Duplicate words of a
 * slot (a leave without memory, core/index_hold.c) are adjacent and equal (writers store every
 * copy, first to last): the first one counts.  Returns how many ranks did not fit (checked
 * only when hn > cap: a constant per call site, so the common loop has no check). */
static inline __attribute__((always_inline)) size_t
place_first(const struct kvr_index *idx, struct kvr_index_match *out, size_t cap,
            const uint64_t *hw, uint32_t hn, size_t k, bool checked, size_t *a, size_t *f)
{
	uint32_t prev = UINT32_MAX; /* slots are < KVR_INDEX_MAX_RANKS */
	size_t over = 0;
	struct kvr_index_match *fr = out, *bk = out + cap;
	for (uint32_t j = 0; j < hn; j++) {
		uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
		uint32_t s = wslot(w), cut = (uint32_t)w;
		if (s == prev || cut == 0)
			continue;
		prev = s;
		if (checked && fr == bk) {
			over++;
			continue;
		}
		const struct kvr_index_match e = {
		    .slot = s,
		    .score = cut,
		    .tree_size = __atomic_load_n(&idx->tsize[s], __ATOMIC_RELAXED)};
		if (cut >= k)
			*fr++ = e;
		else
			*--bk = e;
	}
	*a = (size_t)(fr - out);
	*f = (size_t)(out + cap - bk);
	return over;
}

/* One run of the walk: R entered at query position q.  Its holder words (*hw, *hn: the set's,
 * or *one, where the single holder's word is copied: R->hs may become a set's address right
 * after it was loaded) and the matched length *k: m = min(len, n - q) blocks checked by one
 * comparison at the far end, a binary search inside where it differs (R's position 0 matched
 * already: it is how R was found). */
static inline __attribute__((always_inline)) void run_step(const struct idx_run *R,
                                                           const uint64_t *seq, size_t n, size_t q,
                                                           const uint64_t **hw, uint32_t *hn,
                                                           uint64_t *one, size_t *k)
{
	/* Ordering: acquire; pairs with idx_run_set_len / idx_run_set_seqs (release): len and the
	 * array come in one word, and a len covering a position was released after its hash was
	 * written into that array. */
	const uint64_t sl = __atomic_load_n(&R->sl, __ATOMIC_ACQUIRE);
	const uint32_t len = (uint32_t)(sl >> IDX_HI_SHIFT);
	const uint64_t *sq = (const uint64_t *)(uintptr_t)idx_lo_ptr(sl);
	/* Ordering: acquire; pairs with the release stores of hs (core/index_hold.c): a set's
	 * words and n are written before its address.  Untagged: the single holder's word (0:
	 * none). */
	const uint64_t hv = __atomic_load_n(&R->hs, __ATOMIC_ACQUIRE);
	*one = hv;
	*hw = one;
	*hn = 1;
	if (hv & IDX_HS_SET) {
		const struct idx_hset *hs = (const struct idx_hset *)(uintptr_t)idx_lo_ptr(hv);
		__builtin_prefetch(hs);
		*hw = hs->e;
		*hn = hs->n;
	}
	const size_t m = len < n - q ? len : n - q;
	if (m <= 1) {
		*k = m; /* position 0 matched: R was found by it (s[0] is not a hash) */
		return;
	}
	/* Positions [0, k) match and none after (a hash names its prefix).  lo: known to match,
	 * hi: known bound.  First the guess g = the largest child offset: where a session's next
	 * turn leaves its previous turn's run (the rest of that run is the previous reply), so a
	 * path of many turns pays two compares per run on one line, not a binary search over the
	 * reply's blocks.  A wrong or stale guess costs those two compares. */
	size_t lo = 1, hi = m, g = idx_run_mco_hint(R);
	if (g > 0 && g < m) {
		if (sq[g] != seq[q + g]) {
			hi = g;
			if (g == 1 || sq[g - 1] == seq[q + g - 1])
				lo = g;
			else
				hi = g - 1;
		} else {
			lo = g + 1;
		}
	}
	if (lo < hi) {
		if (sq[hi - 1] == seq[q + hi - 1]) {
			lo = hi; /* one comparison at the far end */
		} else {
			hi--; /* s[hi-1] did not match */
			while (lo < hi) {
				size_t mid = (lo + hi + 1) / 2;
				if (sq[mid - 1] == seq[q + mid - 1])
					lo = mid;
				else
					hi = mid - 1;
			}
		}
	}
	*k = lo;
}

int kvr_index_find_matches(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                           const struct kvr_index_match_opts *opts, struct kvr_index_match *out,
                           size_t cap, size_t *n_out)
{
	if (!idx || !n_out || (!seq && n > 0) || (!out && cap > 0))
		return KVR_EINVAL;
	*n_out = 0;
	if (n == 0)
		return 0;
	const bool early = opts && opts->early_exit;
	const struct idx_run *R = idx_find_run(idx, seq[0], NULL, 0);
	if (!R)
		return 0;
	size_t a = 0, f = 0, q = 0;
	bool first = true;
	for (;;) {
		const uint64_t *hw;
		uint64_t one;
		uint32_t hn;
		size_t k;
		run_step(R, seq, n, q, &hw, &hn, &one, &k);
		if (first) {
			first = false;
			size_t over = hn <= cap
			                  ? place_first(idx, out, cap, hw, hn, k, false, &a, &f)
			                  : place_first(idx, out, cap, hw, hn, k, true, &a, &f);
			if (over) {
				*n_out = cap + over;
				return KVR_ERANGE;
			}
		} else {
			a = intersect(out, a, hw, hn, k, q, cap, &f);
		}
		q += k;
		if (a == 0 || q == n || k == 0 || (early && a == 1))
			break;
		const struct idx_run *C = idx_find_child(idx, seq[q], R, (uint32_t)k);
		if (!C)
			break;
		R = C;
	}
	for (size_t i = 0; i < a; i++)
		out[i].score = (uint32_t)q;
	if (f)
		memmove(&out[a], &out[cap - f], f * sizeof(*out));
	*n_out = a + f;
	return 0;
}

/*
 * find_depths: the same walk, its answer by slot, for kvr_route (no match entries to partition
 * and scatter, no tree sizes).  The depth array itself is the active set: a rank still matching
 * at a run entered at q has depth[slot] == q exactly (the q' + k' its previous run gave it),
 * while one that dropped out has less (q' + cut with cut < k', or q' where it was absent, and
 * q' + k' <= q) and one that never held seq[0] has 0 < q.  So a run's holder word costs one
 * load of depth[slot], a compare, and for an active rank one store of q + min(cut, k): no
 * bitmap, no partition, no slot order needed.
 */
/* (always_inline: with first_words inlined gcc stopped inlining it, +34 instructions a run.)
 * The child run the walk goes to after R (entered at q, matched k), looked up BEFORE R's
 * holders are read (the walk is the same: the child depends on seq, R and k only), and asked
 * for the lines run_step will read of it: the table probe and the header, then its holder set
 * and the hash at its far end are misses that now overlap the holder loop instead of following
 * it (the shards rewrite those lines as they book). */
static inline __attribute__((always_inline)) const struct idx_run *
next_run(const struct kvr_index *idx, const uint64_t *seq, size_t n, const struct idx_run *R,
         size_t q, size_t k)
{
	if (k == 0 || q + k >= n)
		return NULL;
	const struct idx_run *C = idx_find_child(idx, seq[q + k], R, (uint32_t)k);
	if (C) {
		const uint64_t hv = __atomic_load_n(&C->hs, __ATOMIC_RELAXED);
		if (hv & IDX_HS_SET)
			__builtin_prefetch((const void *)(uintptr_t)idx_lo_ptr(hv));
		const uint64_t sl = __atomic_load_n(&C->sl, __ATOMIC_RELAXED);
		const size_t len = (size_t)(sl >> IDX_HI_SHIFT), left = n - q - k;
		const size_t m = len < left ? len : left, g = idx_run_mco_hint(C);
		const uint64_t *sq = (const uint64_t *)(uintptr_t)idx_lo_ptr(sl);
		if (sq && m > 1) {
			if (g > 0 && g < m) { /* run_step's guess: s[g - 1] and s[g] */
				__builtin_prefetch(&sq[g - 1]);
				__builtin_prefetch(&sq[g]);
			} else {
				__builtin_prefetch(&sq[m - 1]);
			}
		}
	}
	return C;
}

/*
 * The first run's holder words hw[0..hn): slots[j] = word j's slot, depth[slot] = min(cut, k);
 * returns whether a cut reaches k.  A word of cut 0 writes depth 0 (as if absent) and duplicate
 * words of a slot (adjacent and equal, see place_first) write the same depth twice, so no test
 * is needed per word.  On a hot prefix this is every rank's word (64 at 64 ranks: ~900 of a 2k
 * prompt's ~1,670 instructions at 14 a word), so four words go at a time through SSE2 (x86-64's
 * baseline): two loads split into the slots (stored as they are, in order) and the cuts (min
 * with k, and the running max that tells whether one reached k), then four scalar stores into
 * depth[], the only scattered part: ~6 instructions a word.  Each 8-byte word is still one
 * aligned access (x86 splits a 16-byte load no finer), so a reader sees each word whole, as
 * with the scalar atomic loads; ThreadSanitizer builds take the scalar loop.
 */
static inline bool first_words(const uint64_t *hw, uint32_t hn, uint32_t k, uint32_t *depth,
                               uint32_t *slots)
{
	uint32_t j = 0;
	bool any = false;
#ifdef MATCH_SSE2
	/* cut and k are below 2^15 (IDX_RUN_MAX), so the 16-bit signed min and max of SSE2 are
	 * exact on their 32-bit lanes (the high halves are 0 on both sides). */
	if (hn >= 4) {
		const __m128i kv = _mm_set1_epi32((int)k);
		/* The largest min(cut, k): k iff a cut reaches k. */
		__m128i top = _mm_setzero_si128();
		const uint64_t *h = hw;
		uint32_t *sp = slots;
		for (const uint64_t *const he = hw + (hn & ~3u); h < he; h += 4, sp += 4) {
			const __m128 a = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)h));
			const __m128 b =
			    _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(h + 2)));
			const __m128i sl = _mm_castps_si128(_mm_shuffle_ps(a, b, 0xdd));
			const __m128i v =
			    _mm_min_epi16(_mm_castps_si128(_mm_shuffle_ps(a, b, 0x88)), kv);
			top = _mm_max_epi16(top, v);
			_mm_storeu_si128((__m128i *)sp, sl);
			depth[sp[0]] = (uint32_t)_mm_cvtsi128_si32(v);
			depth[sp[1]] = (uint32_t)_mm_cvtsi128_si32(_mm_shuffle_epi32(v, 0x55));
			depth[sp[2]] = (uint32_t)_mm_cvtsi128_si32(_mm_shuffle_epi32(v, 0xaa));
			depth[sp[3]] = (uint32_t)_mm_cvtsi128_si32(_mm_shuffle_epi32(v, 0xff));
		}
		j = (uint32_t)(h - hw);
		any = _mm_movemask_epi8(_mm_cmpeq_epi32(top, kv)) != 0;
	}
#endif
	for (; j < hn; j++) {
		const uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
		const uint32_t s = wslot(w), cut = (uint32_t)w;
		slots[j] = s;
		depth[s] = cut < k ? cut : k;
		any |= cut >= k;
	}
	return any;
}

/* A later run's holder words hw[0..hn), the walk at q with k matched: each word whose rank is
 * still active (depth[slot] == q) sets depth[slot] = q + min(cut, k); returns whether a cut
 * reaches k.  The scalar loop: a load, a compare and a branch per word. */
static inline bool later_words(const uint64_t *hw, uint32_t hn, uint32_t q, uint32_t k,
                               uint32_t *depth)
{
	bool any = false;
	for (uint32_t j = 0; j < hn; j++) {
		const uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
		const uint32_t s = wslot(w), cut = (uint32_t)w;
		if (depth[s] != q)
			continue; /* dropped out before, or never held seq[0] */
		depth[s] = q + (cut < k ? cut : k);
		any |= cut >= k;
	}
	return any;
}

#ifdef MATCH_AVX2
/*
 * The same two loops eight words at a time (AVX2), for CPUs that have it (checked once, as
 * core/select.c does; the whole walk is compiled twice, depths_avx2 and depths_base, so neither
 * pays a test per run).  Each word is still read whole (an aligned 8-byte element of the vector
 * load, which x86 splits no finer), as with the scalar atomic loads; ThreadSanitizer builds
 * never get here (MATCH_TSAN).
 *
 * On bench_route's 2k prompts a lookup met ~52 first-run words and ~37 later-run words (64
 * ranks; 3.4 later runs, of 1 to 41 words), and nearly every later-run word was an active
 * rank's, so the scalar loop's branch was predicted and its cost was its ~15 instructions a
 * word.  Here a later run's step is a function of the depth array alone: a word sets depth[s] =
 * q + min(cut, k) only where depth[s] == q, and that value is q again only when min(cut, k) ==
 * 0, so doing a word twice changes nothing (nor the "a cut reaches k" answer, which its first
 * pass gave).  So the eight depths are gathered (vpgatherdd), compared with q and blended with
 * q + min(cut, k) without a branch, all eight stored back (an inactive rank's unchanged depth
 * included: the array is the caller's, no other thread reads it), and a run whose word count is
 * not a multiple of eight ends with the group of its LAST eight words, overlapping the previous
 * group, instead of a scalar tail; 4 to 7 words take one masked group, fewer the scalar loop.
 * The first run's step (depth[s] = min(cut, k), slots stored in order) is idempotent as well.
 * Where a group's eight slots are consecutive (92 % of the first run's groups there: ranks are
 * added in order and all hold the hot prefix), their depths are one 32-byte stretch: one vector
 * load and store instead of the gather and eight scalar stores.  Duplicate words of a slot
 * (adjacent and equal) compute equal values; racing a writer that is rewriting them, the answer
 * may take either copy's cut (the scalar loop takes the first), both values a writer stored.
 */

/* Eight holder words from h: their slots (*sl) and cuts (*ct), each in word order. */
__attribute__((target("avx2"), always_inline)) static inline void split8(__m256i a, __m256i b,
                                                                         __m256i *sl, __m256i *ct)
{
	/* Per 128-bit half, a's two words then b's: words 0 1 4 5 | 2 3 6 7, put back in order
	 * by one permute of 64-bit pairs. */
	const __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
	*sl = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xdd)), 0xd8);
	*ct = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88)), 0xd8);
}

/* The eight depth stores of a group: depth[s_i] = v_i, in word order. */
__attribute__((target("avx2"), always_inline)) static inline void scatter8(uint32_t *depth,
                                                                           __m256i sl, __m256i v)
{
	uint32_t s[8] __attribute__((aligned(32))), x[8] __attribute__((aligned(32)));
	_mm256_store_si256((__m256i *)s, sl);
	_mm256_store_si256((__m256i *)x, v);
#pragma GCC unroll 8
	for (int i = 0; i < 8; i++)
		depth[s[i]] = x[i];
}

/* Whether the eight slots are consecutive (s, s + 1, ..., s + 7): then their depths are one
 * 32-byte line segment, read and written with one vector access each (a rank list added in
 * order is runs of consecutive slots, and a hot prefix's first run holds them all). */
__attribute__((target("avx2"), always_inline)) static inline bool consecutive8(__m256i sl)
{
	const __m256i s0 = _mm256_broadcastd_epi32(_mm256_castsi256_si128(sl));
	const __m256i want = _mm256_add_epi32(s0, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
	return _mm256_movemask_epi8(_mm256_cmpeq_epi32(sl, want)) == -1;
}

/* One later-run group: returns the lanes whose rank was active and whose cut reaches k. */
__attribute__((target("avx2"), always_inline)) static inline __m256i
later8(uint32_t *depth, __m256i sl, __m256i ct, __m256i qv, __m256i kv)
{
	const bool line = consecutive8(sl);
	uint32_t *const d0 = depth + (uint32_t)_mm256_cvtsi256_si32(sl);
	const __m256i d = line ? _mm256_loadu_si256((const __m256i *)d0)
	                       : _mm256_i32gather_epi32((const int *)depth, sl, 4);
	const __m256i act = _mm256_cmpeq_epi32(d, qv);
	const __m256i mn = _mm256_min_epu32(ct, kv);
	const __m256i nd = _mm256_blendv_epi8(d, _mm256_add_epi32(qv, mn), act);
	if (line)
		_mm256_storeu_si256((__m256i *)d0, nd);
	else
		scatter8(depth, sl, nd);
	return _mm256_and_si256(act, _mm256_cmpeq_epi32(mn, kv));
}

/* later_words for hn >= 4 (below, the scalar loop is shorter).  Fewer than eight words are read
 * with a masked load (nothing past hw[hn) is touched) and the last word's lane repeated into the
 * lanes past it. */
__attribute__((target("avx2"))) static inline bool
later_words_avx2(const uint64_t *hw, uint32_t hn, uint32_t q, uint32_t k, uint32_t *depth)
{
	const __m256i qv = _mm256_set1_epi32((int)q), kv = _mm256_set1_epi32((int)k);
	__m256i hit = _mm256_setzero_si256(), sl, ct;
	if (hn < 8) {
		const __m256i iota = _mm256_setr_epi64x(0, 1, 2, 3), nv = _mm256_set1_epi64x(hn);
		const __m256i m0 = _mm256_cmpgt_epi64(nv, iota),
		              m1 = _mm256_cmpgt_epi64(
		                  nv, _mm256_add_epi64(iota, _mm256_set1_epi64x(4)));
		split8(_mm256_maskload_epi64((const long long *)hw, m0),
		       _mm256_maskload_epi64((const long long *)(hw + 4), m1), &sl, &ct);
		const __m256i rep = _mm256_min_epu32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
		                                     _mm256_set1_epi32((int)hn - 1));
		hit = later8(depth, _mm256_permutevar8x32_epi32(sl, rep),
		             _mm256_permutevar8x32_epi32(ct, rep), qv, kv);
	} else {
		for (const uint64_t *h = hw, *const he = hw + hn;; h += 8) {
			/* The last eight words: a word done twice changes nothing. */
			if (h + 8 > he)
				h = he - 8;
			split8(_mm256_loadu_si256((const __m256i *)h),
			       _mm256_loadu_si256((const __m256i *)(h + 4)), &sl, &ct);
			hit = _mm256_or_si256(hit, later8(depth, sl, ct, qv, kv));
			if (h + 8 == he)
				break;
		}
	}
	return !_mm256_testz_si256(hit, hit);
}

/* first_words for hn >= 8: slots stored in order (the last group may overlap the one before
 * it, storing the same slots again), depth[s] = min(cut, k). */
__attribute__((target("avx2"))) static inline bool
first_words_avx2(const uint64_t *hw, uint32_t hn, uint32_t k, uint32_t *depth, uint32_t *slots)
{
	const __m256i kv = _mm256_set1_epi32((int)k);
	__m256i top = _mm256_setzero_si256(), sl, ct;
	for (uint32_t j = 0;; j += 8) {
		if (j + 8 > hn)
			j = hn - 8;
		split8(_mm256_loadu_si256((const __m256i *)(hw + j)),
		       _mm256_loadu_si256((const __m256i *)(hw + j + 4)), &sl, &ct);
		const __m256i v = _mm256_min_epu32(ct, kv);
		top = _mm256_max_epu32(top, v);
		_mm256_storeu_si256((__m256i *)(slots + j), sl);
		if (consecutive8(sl))
			_mm256_storeu_si256((__m256i *)(depth + slots[j]), v);
		else
			scatter8(depth, sl, v);
		if (j + 8 == hn)
			break;
	}
	return !_mm256_testz_si256(_mm256_cmpeq_epi32(top, kv), _mm256_cmpeq_epi32(top, kv));
}
#endif

/* The walk of find_depths (its essay above), with the AVX2 loops or without: always inlined
 * into one function of each kind, so the avx2 test is a constant in each. */
static inline __attribute__((always_inline)) size_t depths_walk(const struct kvr_index *idx,
                                                                const uint64_t *seq, size_t n,
                                                                uint32_t *depth, uint32_t *slots,
                                                                uint32_t *best, const bool avx2)
{
	(void)avx2; /* builds without MATCH_AVX2 have one kind */
	*best = 0;
	if (n == 0)
		return 0;
	const struct idx_run *R = idx_find_run(idx, seq[0], NULL, 0);
	if (!R)
		return 0;
	const uint64_t *hw;
	uint64_t one;
	uint32_t hn;
	size_t k;
	run_step(R, seq, n, 0, &hw, &hn, &one, &k);
	const struct idx_run *C = next_run(idx, seq, n, R, 0, k);
	/* The first run: every word, as it comes (first_words); a set has at most one word per
	 * slot of the index (joins compact duplicates), so slots[] has room. */
	if (hn > idx->max_ranks)
		return 0; /* not a set this index makes */
	bool any;
#ifdef MATCH_AVX2
	if (avx2 && hn >= 8)
		any = first_words_avx2(hw, hn, (uint32_t)k, depth, slots);
	else
#endif
		any = first_words(hw, hn, (uint32_t)k, depth, slots);
	const size_t ns = hn;
	size_t q = 0, qr = 0; /* qr: where the last run walked was entered */
	while (any) {
		q += k; /* every rank still matching is at depth q */
		if (!C)
			break; /* the prompt's end, or no run goes on */
		R = C;
		qr = q;
		run_step(R, seq, n, q, &hw, &hn, &one, &k);
		C = next_run(idx, seq, n, R, q, k);
#ifdef MATCH_AVX2
		if (avx2 && hn >= 4)
			any = later_words_avx2(hw, hn, (uint32_t)q, (uint32_t)k, depth);
		else
#endif
			any = later_words(hw, hn, (uint32_t)q, (uint32_t)k, depth);
	}
	/* The deepest: q for the ranks still matching, else the last run's deepest holder (or qr,
	 * where the ranks active there but absent from it stayed). */
	uint32_t top = (uint32_t)(any ? q : qr);
	for (uint32_t j = 0; !any && j < hn; j++) {
		const uint32_t d = depth[wslot(__atomic_load_n(&hw[j], __ATOMIC_RELAXED))];
		top = d > top ? d : top;
	}
	*best = top;
	return ns;
}

static size_t depths_base(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                          uint32_t *depth, uint32_t *slots, uint32_t *best)
{
	return depths_walk(idx, seq, n, depth, slots, best, false);
}

#ifdef MATCH_AVX2
__attribute__((target("avx2"))) static size_t depths_avx2(const struct kvr_index *idx,
                                                          const uint64_t *seq, size_t n,
                                                          uint32_t *depth, uint32_t *slots,
                                                          uint32_t *best)
{
	return depths_walk(idx, seq, n, depth, slots, best, true);
}
#endif

size_t kvr_index_find_depths_impl(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                                  uint32_t *depth, uint32_t *slots, uint32_t *best,
                                  enum kvr_index_depths_impl impl)
{
#ifdef MATCH_AVX2
	if (impl == KVR_INDEX_DEPTHS_AUTO && kvr_cpu_has_avx2())
		return depths_avx2(idx, seq, n, depth, slots, best);
#else
	(void)impl;
#endif
	return depths_base(idx, seq, n, depth, slots, best);
}

size_t kvr_index_find_depths(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                             uint32_t *depth, uint32_t *slots, uint32_t *best)
{
	return kvr_index_find_depths_impl(idx, seq, n, depth, slots, best, KVR_INDEX_DEPTHS_AUTO);
}

size_t kvr_index_path_runs(const struct kvr_index *idx, const uint64_t *seq, size_t n)
{
	const struct idx_run *R = n ? idx_find_run(idx, seq[0], NULL, 0) : NULL;
	size_t runs = 0, q = 0;
	while (R) {
		const uint64_t *hw;
		uint64_t one;
		uint32_t hn;
		size_t k;
		run_step(R, seq, n, q, &hw, &hn, &one, &k);
		runs++;
		q += k;
		if (k == 0 || q == n)
			break;
		R = idx_find_child(idx, seq[q], R, (uint32_t)k);
	}
	return runs;
}
