/*
 * core/index_match.h - the choice of find_depths' loops (core/index_match.c), for tests and
 * benchmarks that run both on the same index.
 */
#ifndef KVR_CORE_INDEX_MATCH_H
#define KVR_CORE_INDEX_MATCH_H

#include <stddef.h>
#include <stdint.h>

#include "core/index.h"

enum kvr_index_depths_impl {
	KVR_INDEX_DEPTHS_AUTO, /* the AVX2 loops where the CPU has AVX2 (kvr_index_find_depths) */
	KVR_INDEX_DEPTHS_BASE, /* the SSE2 and scalar loops, whatever the CPU */
};

/*
 * kvr_index_find_depths with its loops chosen: the same answer either way (depth[], slots[]
 * in the same order, *best, the count).  Context: as kvr_index_find_depths.
 */
size_t kvr_index_find_depths_impl(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                                  uint32_t *depth, uint32_t *slots, uint32_t *best,
                                  enum kvr_index_depths_impl impl);

#endif /* KVR_CORE_INDEX_MATCH_H */
