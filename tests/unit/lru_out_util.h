/* Test helpers: read a struct kvr_lru_out (shards/lru.h) block by block. */
#ifndef KVR_TESTS_LRU_OUT_UTIL_H
#define KVR_TESTS_LRU_OUT_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "shards/lru.h"

/* The i-th stored block (in input order) of a command whose input blocks were b[]. */
static inline const struct kvr_lru_block *out_stored(const struct kvr_lru_out *o,
                                                     const struct kvr_lru_block *b, size_t i)
{
	for (size_t k = 0; k < o->n_stored_runs; k++) {
		if (i < o->stored[k].n)
			return &b[o->stored[k].first + i];
		i -= o->stored[k].n;
	}
	return NULL;
}

/* The i-th evicted hash in per-block eviction order (deepest first): each run read backwards,
 * run after run. */
static inline uint64_t out_evicted(const struct kvr_lru_out *o, size_t i)
{
	size_t base = 0;
	for (size_t k = 0; k < o->n_evicted_runs; k++) {
		size_t n = o->evicted_run_len[k];
		if (i < n)
			return o->evicted_seq[base + n - 1 - i];
		i -= n;
		base += n;
	}
	return UINT64_MAX;
}

#endif /* KVR_TESTS_LRU_OUT_UTIL_H */
