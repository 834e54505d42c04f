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

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* A run's hash array: the hashes are mem[start ..], mem holds cap. */
struct kvr_hashes {
	uint64_t *mem;
	uint32_t start, cap;
};

/* How many hashes splitting a run of len before off copies: the smaller side. */
static inline uint32_t kvr_hashes_split_copy(uint32_t len, uint32_t off)
{
	return len - off <= off ? len - off : off;
}

/* Splits run a's hashes (len of them) before off: afterwards a holds the first off and b the
 * rest.  The smaller side moves into m (room for kvr_hashes_split_copy(len, off), transferred),
 * the larger side keeps the array, so every array stays owned by exactly one run.  Returns true
 * if the right side was copied (the left one then keeps a larger array than it needs). */
static inline bool kvr_hashes_split(struct kvr_hashes *a, struct kvr_hashes *b, uint32_t len,
                                    uint32_t off, uint64_t *m)
{
	uint32_t rest = len - off;
	if (rest <= off) {
		memcpy(m, a->mem + a->start + off, (size_t)rest * sizeof(uint64_t));
		*b = (struct kvr_hashes){m, 0, rest};
		return true;
	}
	memcpy(m, a->mem + a->start, (size_t)off * sizeof(uint64_t));
	*b = (struct kvr_hashes){a->mem, a->start + off, a->cap};
	*a = (struct kvr_hashes){m, 0, off};
	return false;
}

/* A stretch of a walk that lies in one run: positions [off, off + len) of run `run`. */
struct kvr_run_hit {
	uint32_t run, off, len;
};

/* A run store whose runs split in place: the left part keeps its index, the right part follows
 * it on the run's split chain (next). */
struct kvr_run_ops {
	uint32_t (*len)(const void *store, uint32_t run);
	uint32_t (*next)(const void *store, uint32_t run);
	int (*split)(void *store, uint32_t run, uint32_t off); /* 0 < off < len */
};

/* Makes every hit of a walk whole runs, splitting where a hit starts or ends inside one: a hit
 * then covers its first run and the runs after it on the split chain, exactly.  A hit recorded
 * before an earlier hit's split may now lie further down the split chain: it is followed there.
 * Hits of one walk are disjoint for chained hashes, so a hit is then one run; a crafted prompt
 * repeating a hash (kvr_request does not check that a caller's hashes chain) walks back into a
 * run it took, and a later hit splits an earlier one's run inside it: the earlier hit then spans
 * several runs and its end is found down the chain (it used to be looked for in its first run
 * only, and a hit ending past it was left ending inside a run: shards/lru.c's release walked
 * the piece off the end of its split chain, test_lru crafted_sequences_on_lru_and_load).  The
 * caller takes each run of a hit (shards/lru.c's acquire), or keeps hits disjoint (shards/load.c).
 * Returns 0 or the first split's error (splits change nothing observable, so the caller may
 * fail without undoing them).  Context: the store's owner. */
static inline int kvr_hits_whole(void *store, const struct kvr_run_ops *ops,
                                 struct kvr_run_hit *hits, size_t nh)
{
	for (size_t k = 0; k < nh; k++) {
		struct kvr_run_hit *p = &hits[k];
		uint32_t len;
		while (p->off >= (len = ops->len(store, p->run))) {
			p->off -= len;
			p->run = ops->next(store, p->run);
		}
		int rc;
		if (p->off > 0) {
			if ((rc = ops->split(store, p->run, p->off)))
				return rc;
			p->run = ops->next(store, p->run);
			p->off = 0;
		}
		uint32_t r = p->run, left = p->len;
		while (left > (len = ops->len(store, r))) { /* crafted hashes only */
			left -= len;
			r = ops->next(store, r);
		}
		if (left < len && (rc = ops->split(store, r, left)))
			return rc;
	}
	return 0;
}

#endif /* KVR_SHARDS_CHAIN_H */
