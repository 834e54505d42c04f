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

#include "core/index_internal.h"
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

size_t kvr_index_find_depths(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                             uint32_t *depth, uint32_t *slots, uint32_t *best)
{

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
	bool any = first_words(hw, hn, (uint32_t)k, depth, slots);
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
		any = false;
		const uint32_t qq = (uint32_t)q, kk = (uint32_t)k;
		for (uint32_t j = 0; j < hn; j++) {
			const uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
			const uint32_t s = wslot(w), cut = (uint32_t)w;
			if (depth[s] != qq)
				continue; /* dropped out before, or never held seq[0] */
			depth[s] = qq + (cut < kk ? cut : kk);
			any |= cut >= kk;
		}
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
