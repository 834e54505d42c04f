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
 * that dropped out at the back, moved together at the end.
 *
 * Context: any registered thread inside kvr_rcu_read_lock(); no lock, no allocation, no retry.
 * Ordering: len with seqs (one word) and hs are acquire loads (pairing with the writers' release
 * stores), the holder words relaxed: a cut covers positions whose content is permanent
 * (write-once), so crediting min(cut, k) never credits a block the rank did not store.
 */
#include <string.h>

#include "core/index_internal.h"
#include "kvrouter.h"

static inline uint32_t wslot(uint64_t w)
{
	return (uint32_t)(w >> 32);
}

/* Keeps in out[0..a) the ranks whose cut in hs is >= k; moves the others to
 * out[cap-*f-d .. cap-*f) with score q + cut (0 when absent).  Returns the new active count. */
static size_t intersect(struct kvr_index_match *out, size_t a, const uint64_t *hw, uint32_t n,
                        size_t k, size_t q, size_t cap, size_t *f)
{
	size_t keep = 0;
	uint32_t j = 0;
	for (size_t i = 0; i < a; i++) {
		uint32_t want = out[i].slot, cut = 0;
		for (; j < n; j++) {
			uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
			if (wslot(w) > want)
				break;
			if (wslot(w) == want && (uint32_t)w > cut) /* duplicates: the largest */
				cut = (uint32_t)w;
		}
		if (cut >= k) {
			struct kvr_index_match t = out[keep];
			out[keep++] = out[i];
			out[i] = t;
		} else {
			out[i].score = (uint32_t)(q + cut);
		}
	}
	size_t d = a - keep;
	if (d) {
		memmove(&out[cap - *f - d], &out[keep], d * sizeof(*out));
		*f += d;
	}
	return keep;
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
		/* Ordering: acquire; pairs with idx_run_set_len / idx_run_set_seqs (release): len
		 * and the array come in one word, and a len covering a position was released after
		 * its hash was written into that array. */
		const uint64_t sl = __atomic_load_n(&R->sl, __ATOMIC_ACQUIRE);
		const uint32_t len = (uint32_t)(sl >> IDX_HI_SHIFT);
		const uint64_t *sq = (const uint64_t *)(uintptr_t)idx_lo_ptr(sl);
		/* A tagged hs (low bit) or NULL: the single holder's word is inline (0: none). */
		const struct idx_hset *hs = __atomic_load_n(&R->hs, __ATOMIC_ACQUIRE);
		const uint64_t *hw = &R->h1;
		uint32_t hn = 1;
		if (hs && !((uintptr_t)hs & 1)) {
			__builtin_prefetch(hs);
			hw = hs->e;
			hn = hs->n;
		}
		size_t m = len < n - q ? len : n - q, k;
		if (m == 0) {
			k = 0;
		} else if (sq[m - 1] == seq[q + m - 1]) {
			k = m; /* one comparison at the far end */
		} else {
			size_t lo = 1,
			       hi = m - 1; /* s[0] matched (R was found by it), s[m-1] did not */
			while (lo < hi) {
				size_t mid = (lo + hi + 1) / 2;
				if (sq[mid - 1] == seq[q + mid - 1])
					lo = mid;
				else
					hi = mid - 1;
			}
			k = lo;
		}
		if (first) {
			/* The ranks holding seq[0]: cut >= 1 (duplicates adjacent: largest cut). */
			first = false;
			size_t holding = 0;
			for (uint32_t j = 0; j < hn;) {
				uint64_t w = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
				uint32_t s = wslot(w), cut = (uint32_t)w;
				for (j++; j < hn; j++) {
					uint64_t x = __atomic_load_n(&hw[j], __ATOMIC_RELAXED);
					if (wslot(x) != s)
						break;
					if ((uint32_t)x > cut)
						cut = (uint32_t)x;
				}
				if (cut == 0)
					continue;
				if (holding++ >= cap)
					continue;
				if (cut >= k) {
					out[a++] = (struct kvr_index_match){.slot = s};
				} else {
					f++;
					out[cap - f] =
					    (struct kvr_index_match){.slot = s, .score = cut};
				}
			}
			if (holding > cap) {
				*n_out = holding;
				return KVR_ERANGE;
			}
		} else {
			a = intersect(out, a, hw, hn, k, q, cap, &f);
		}
		q += k;
		if (a == 0 || q == n || k == 0 || (early && a == 1))
			break;
		const struct idx_run *C = idx_find_run(idx, seq[q], R, (uint32_t)k);
		if (!C)
			break;
		R = C;
	}
	for (size_t i = 0; i < a; i++)
		out[i].score = (uint32_t)q;
	if (f)
		memmove(&out[a], &out[cap - f], f * sizeof(*out));
	*n_out = a + f;
	for (size_t i = 0; i < a + f; i++)
		out[i].tree_size = __atomic_load_n(&idx->tsize[out[i].slot], __ATOMIC_RELAXED);
	return 0;
}
