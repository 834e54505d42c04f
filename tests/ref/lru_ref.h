/*
 * tests/ref/lru_ref.h - the per-block reference LRU (tests/ref/lru_ref.c): the oracle of
 * tests/unit/test_lru_diff.c and the baseline of perf/bench_lru.  Same contract as shards/lru.h
 * (see there), functions named ref_lru_*.  Its evicted runs are runs of one block, its stored
 * ranges per block (merged when consecutive).
 * Context (all functions): the owning thread; no locks, no atomics.
 */
#ifndef KVR_TESTS_REF_LRU_REF_H
#define KVR_TESTS_REF_LRU_REF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shards/lru.h"

struct ref_lru;

/* Creates an empty LRU of capacity_blocks (0 is allowed: nothing inactive is ever kept).
 * Returns 0, KVR_EINVAL (out NULL) or KVR_ENOMEM. */
int ref_lru_create(uint64_t capacity_blocks, struct ref_lru **out);
/* Frees everything.  NULL is a no-op. */
void ref_lru_destroy(struct ref_lru *lru);

/*
 * A request attempt is admitted with prompt blocks b[0..n) (borrowed) and private_blocks
 * partial/unhashed blocks.  Leading blocks whose hash is present reuse the oldest copy of the
 * hash (taking it out of the inactive set), refs + 1, position = i; from the first miss on every
 * block gets a NEW copy (even if its hash exists elsewhere on the rank).  Then reconcile.
 * Returns 0, KVR_EINVAL (b NULL with n > 0, lru/out NULL), KVR_EEXIST (attempt live),
 * KVR_ERANGE (more than 2^32-2 copies), KVR_ENOMEM.
 */
int ref_lru_acquire(struct ref_lru *lru, uint64_t attempt, const struct kvr_lru_block *b, size_t n,
                    uint32_t private_blocks, struct kvr_lru_out *out);

/*
 * Output blocks b[0..n) of a live attempt completed: each gets a new copy at position
 * start_pos + i, appended to the lease; the lease's private count is REPLACED by private_blocks.
 * parent_seq: if the lease holds blocks, it must be the seq of the last one appended (the chain
 * the new blocks continue), else KVR_ENOENT; ignored for a lease without blocks.
 * Returns 0, KVR_EINVAL, KVR_ENOENT (attempt not live, parent mismatch), KVR_ERANGE, KVR_ENOMEM.
 */
int ref_lru_materialize(struct ref_lru *lru, uint64_t attempt, uint64_t parent_seq,
                        const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                        uint32_t private_blocks, struct kvr_lru_out *out);

/*
 * Ends an attempt: one new release epoch; its private blocks go; each copy refs - 1, and the
 * copies reaching 0 become inactive stamped with this epoch (ordered deepest first); reconcile.
 * Returns 0, KVR_EINVAL, KVR_ENOENT (unknown or already released attempt: the LRU keeps no
 * memory of finished attempts; shards/lease.h tells stale from unknown), KVR_ENOMEM.
 */
int ref_lru_release(struct ref_lru *lru, uint64_t attempt, struct kvr_lru_out *out);

/* Sets the capacity (blocks) and evicts inactive copies down to it.  0, KVR_EINVAL, KVR_ENOMEM. */
int ref_lru_set_capacity(struct ref_lru *lru, uint64_t capacity, struct kvr_lru_out *out);

/* How many leading hashes of seq[0..n) are present on the rank (any copy). */
size_t ref_lru_overlap(const struct ref_lru *lru, const uint64_t *seq, size_t n);

/* keep_private mode (see lru.c): a released private block keeps its slot as an unhashed
 * inactive block, evicted first of its release, as vLLM's free queue does.  Default off (the
 * issue's reference model).  Only takes effect on an empty LRU. */
void ref_lru_set_keep_private(struct ref_lru *lru, bool on);

/* Whether the attempt holds a live lease. */
bool ref_lru_has_lease(const struct ref_lru *lru, uint64_t attempt);

/* Fills *st.  Cheap (counters). */
void ref_lru_stats(const struct ref_lru *lru, struct kvr_lru_stats *st);

/* Bytes of memory held per live copy (slab + hash table + lease entry), for the benchmark. */
double ref_lru_bytes_per_copy(const struct ref_lru *lru);

/* The distinct hashes present (up to cap written to out); returns how many there are. */
size_t ref_lru_hashes(const struct ref_lru *lru, uint64_t *out, size_t cap);

#endif /* KVR_TESTS_REF_LRU_REF_H */
