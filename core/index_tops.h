/*
 * core/index_tops.h - the run index's writers without the block locator (core/index_tops.c):
 * the ranks' end maps, the exact lookup built on them, the walk from the root.  For core/index*.c
 * only; the essays are at the top of core/index.c and core/index_tops.c.
 */
#ifndef KVR_CORE_INDEX_TOPS_H
#define KVR_CORE_INDEX_TOPS_H

#include "core/index_internal.h"

/* A record's end-map keys at one moment: the hash of its deepest held position (has_top: top
 * >= 2) and of its lowest (has_lo: cut 0, lowest held position in [1, top - 1)). */
struct idx_tkey {
	uint64_t top, lo;
	bool has_top, has_lo;
};

/* ---- without the locator (core/index_tops.c).  Context: writer (wlock), idx->no_locator. */
/* The record's end-map keys now. */
void kvr_index_tops_key(const struct idx_hold *h, struct idx_tkey *k);
/* Replaces h's entries for the keys it had (old, taken before h changed) by those it has now
 * (an insert without room is skipped).  Never fails, never allocates. */
void kvr_index_tops_update(struct kvr_index *idx, struct idx_hold *h, const struct idx_tkey *old);
/* Deletes h's entries (its keys are k). */
void kvr_index_tops_del(struct kvr_index *idx, const struct idx_hold *h, const struct idx_tkey *k);
/* Inserts h's entries for keys k (skipped without room). */
void kvr_index_tops_put(struct kvr_index *idx, struct idx_hold *h, const struct idx_tkey *k);
/* Room for k more entries in the slot's map at its growth load.  Returns 0 or KVR_ENOMEM
 * (unchanged).  Only where every record's entries match its keys. */
int kvr_index_tops_reserve(struct kvr_index *idx, uint32_t slot, uint32_t k);
/* Whether k more entries fit without a growth. */
bool kvr_index_tops_room(const struct kvr_index *idx, uint32_t slot, uint32_t k);
/* Frees an empty map or shrinks a sparse one (when memory allows).  Only where every record's
 * entries match its keys. */
void kvr_index_tops_shrink(struct kvr_index *idx, uint32_t slot);
/* Frees the slot's map (destroy, or its records are all gone). */
void kvr_index_tops_free(struct kvr_index *idx, uint32_t slot);
/* Where the slot holds block seq: *r, *pos and its record *h, or false (the slot does not hold
 * it).  Exact: tries the positions next to (hr, hp) (hr NULL: none), then the run table, the
 * slot's end map, and last a scan of the slot's records (counted in c_rank_scans). */
bool kvr_index_find_held(struct kvr_index *idx, uint32_t slot, uint64_t seq,
                         const struct idx_run *hr, uint32_t hp, struct idx_run **r, uint32_t *pos,
                         struct idx_hold **h);
/* The same without the scan: false may also mean "not found cheaply". */
bool kvr_index_find_held_fast(struct kvr_index *idx, uint32_t slot, uint64_t seq,
                              const struct idx_run *hr, uint32_t hp, struct idx_run **r,
                              uint32_t *pos, struct idx_hold **h);
/* Where the block below (R, p) with sequence hash s sits in the tree (R NULL: a root block):
 * R's position p + 1, trimmed or not, or the first block of a run, or false. */
bool kvr_index_next_at(const struct kvr_index *idx, const struct idx_run *R, uint32_t p, uint64_t s,
                       struct idx_run **c, uint32_t *q);
/* Where block path[(np - 1) * stride] sits, walking from the root along the sequence hashes
 * path[0], path[stride], ... (np > 0): O(runs + log np) table probes and compares.  False when
 * the tree does not hold the whole path. */
bool kvr_index_walk(const struct kvr_index *idx, const uint64_t *path, size_t stride, size_t np,
                    struct idx_run **r, uint32_t *pos);

/* Wrappers for the writers: end-map keys taken before a record changes, updated after. */
static inline void idx_tops_before(const struct kvr_index *idx, const struct idx_hold *h,
                                   struct idx_tkey *k)
{
	if (idx->no_locator)
		kvr_index_tops_key(h, k);
}

static inline void idx_tops_after(struct kvr_index *idx, struct idx_hold *h,
                                  const struct idx_tkey *k)
{
	if (idx->no_locator)
		kvr_index_tops_update(idx, h, k);
}

#endif /* KVR_CORE_INDEX_TOPS_H */
