/*
 * shards/chain.h - how far a stored run of chained sequence hashes agrees with a prompt.
 *
 * A sequence hash names its whole prefix (core/hash), so along a chain, agreement at position
 * j implies agreement at every position before it: the overlap of a stored run and a prompt is
 * decided by ONE compare at its far end, and where that differs, a binary search finds the
 * divergence.  Used by the per-rank run structures (shards/lru.c, shards/load.c,
 * shards/pinmap.c), whose inputs must be chained (their headers say so).
 */
#ifndef KVR_SHARDS_CHAIN_H
#define KVR_SHARDS_CHAIN_H

#include <stddef.h>
#include <stdint.h>

/* a[0] and q[0] are the same block.  Returns the largest j <= min(avail, m) such that a[1..j]
 * equals q[stride], q[2 * stride], ..., q[j * stride] (a: avail more hashes; q: m more).
 * O(1) when the whole overlap agrees, O(log) otherwise.  Context: any. */
static inline uint32_t kvr_chain_agree(const uint64_t *a, size_t avail, const uint64_t *q,
                                       size_t stride, size_t m)
{
	size_t lim = avail < m ? avail : m;
	if (lim == 0 || a[lim] == q[lim * stride])
		return (uint32_t)lim;
	size_t lo = 0, hi = lim; /* a[lo] agrees, a[hi] does not */
	while (hi - lo > 1) {
		size_t mid = lo + (hi - lo) / 2;
		if (a[mid] == q[mid * stride])
			lo = mid;
		else
			hi = mid;
	}
	return (uint32_t)lo;
}

#endif /* KVR_SHARDS_CHAIN_H */
