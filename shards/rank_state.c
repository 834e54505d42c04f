/*
 * shards/rank_state.c - one rank's predicted cache, its incarnation, and fencing.
 *
 * The idea.  A worker rank can restart (a new incarnation) or be removed; commands about it
 * travel through queues and can arrive late.  Each command carries the incarnation it was
 * decided under; a mismatch is refused before any state is touched, so a late message can never
 * resurrect a rank, emit stored blocks for a dead cache, or release a lease of the new life.
 * The store itself is either the LRU (shards/lru.c) or the TTL store (shards/ttl.c); this file
 * only picks, fences and reports.
 *
 * In TTL mode leases are not reference counted (TTL forgets by time), but attempts are still
 * tracked (a u64map of live attempts) so that duplicate and unknown attempts are refused the
 * same way in both modes.
 *
 * Failure model: a new store is created before the old one is dropped, so KVR_ENOMEM leaves the
 * rank exactly as it was.
 */
#include "shards/rank_state.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/ttl.h"
#include "shards/u64map.h"

struct kvr_rank_state {
	bool keep_private; /* LRUs created keep released private blocks (lru.c) */
	enum kvr_rank_mode mode;
	uint64_t incarnation;
	uint64_t ttl_ns, bucket_ns;
	struct kvr_lru *lru;
	struct kvr_ttl *ttl;
	struct kvr_u64map ttl_attempts; /* live attempts in TTL mode */
};

int kvr_rank_state_create(uint64_t ttl_ns, uint64_t bucket_ns, struct kvr_rank_state **out)
{
	if (!out || ttl_ns == 0)
		return KVR_EINVAL;
	struct kvr_rank_state *rs = kvr_calloc(1, sizeof(*rs));
	if (!rs)
		return KVR_ENOMEM;
	rs->ttl_ns = ttl_ns;
	rs->bucket_ns = bucket_ns;
	kvr_u64map_init(&rs->ttl_attempts);
	*out = rs;
	return 0;
}

static void drop_store(struct kvr_rank_state *rs)
{
	kvr_lru_destroy(rs->lru);
	kvr_ttl_destroy(rs->ttl);
	rs->lru = NULL;
	rs->ttl = NULL;
	kvr_u64map_clear(&rs->ttl_attempts);
}

void kvr_rank_state_destroy(struct kvr_rank_state *rs)
{
	if (!rs)
		return;
	drop_store(rs);
	kvr_u64map_fini(&rs->ttl_attempts);
	kvr_free(rs, sizeof(*rs));
}

/* Replaces the store with a fresh one for (incarnation, capacity).  0 or KVR_ENOMEM (unchanged). */
static int fresh(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t capacity)
{
	struct kvr_lru *lru = NULL;
	struct kvr_ttl *ttl = NULL;
	int rc = capacity > 0 ? kvr_lru_create(capacity, &lru)
	                      : kvr_ttl_create(rs->ttl_ns, rs->bucket_ns, &ttl);
	if (rc)
		return rc;
	if (lru)
		kvr_lru_set_keep_private(lru, rs->keep_private);
	drop_store(rs);
	rs->lru = lru;
	rs->ttl = ttl;
	rs->mode = capacity > 0 ? KVR_RANK_LRU : KVR_RANK_TTL;
	rs->incarnation = incarnation;
	return 0;
}

int kvr_rank_state_set_capacity(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t capacity,
                                struct kvr_lru_out *out)
{
	if (!rs || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	if (rs->mode == KVR_RANK_ABSENT)
		return fresh(rs, incarnation, capacity);
	if (incarnation != rs->incarnation || (rs->mode == KVR_RANK_LRU && capacity == 0)) {
		int rc = fresh(rs, incarnation, capacity);
		if (rc == 0)
			out->cleared = true;
		return rc;
	}
	if (rs->mode == KVR_RANK_TTL)
		return capacity == 0 ? 0 : KVR_EBUSY;
	return kvr_lru_set_capacity(rs->lru, capacity, out);
}

int kvr_rank_state_renew(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t capacity,
                         struct kvr_lru_out *out)
{
	if (!rs || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	bool known = rs->mode != KVR_RANK_ABSENT;
	int rc = fresh(rs, incarnation, capacity);
	if (rc == 0)
		out->cleared = known;
	return rc;
}

/* The fence every command passes first. */
static int fence(const struct kvr_rank_state *rs, uint64_t incarnation)
{
	if (rs->mode == KVR_RANK_ABSENT)
		return KVR_ENOENT;
	if (incarnation != rs->incarnation)
		return KVR_ESTALE;
	return 0;
}

/* How every command of a life begins: the arguments checked, out emptied, the fence. */
static inline int begin(const struct kvr_rank_state *rs, uint64_t incarnation,
                        struct kvr_lru_out *out)
{
	if (!rs || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	return fence(rs, incarnation);
}

/* begin() for a command that brings n blocks at b. */
static inline int begin_blocks(const struct kvr_rank_state *rs, uint64_t incarnation,
                               const struct kvr_lru_block *b, size_t n, struct kvr_lru_out *out)
{
	if (n > 0 && !b)
		return KVR_EINVAL;
	return begin(rs, incarnation, out);
}

int kvr_rank_state_acquire(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                           const struct kvr_lru_block *b, size_t n, uint32_t private_blocks,
                           uint64_t now, struct kvr_lru_out *out)
{
	int rc = begin_blocks(rs, incarnation, b, n, out);
	if (rc)
		return rc;
	if (rs->mode == KVR_RANK_LRU)
		return kvr_lru_acquire(rs->lru, attempt, b, n, private_blocks, out);
	if (kvr_u64map_find(&rs->ttl_attempts, attempt))
		return KVR_EEXIST;
	if ((rc = kvr_u64map_reserve(&rs->ttl_attempts, 1)))
		return rc;
	if ((rc = kvr_ttl_record(rs->ttl, b, n, 0, now, out)))
		return rc;
	kvr_u64map_insert(&rs->ttl_attempts, attempt, 1);
	return 0;
}

int kvr_rank_state_materialize(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                               uint64_t parent_seq, const struct kvr_lru_block *b, size_t n,
                               uint32_t start_pos, uint32_t private_blocks, uint64_t now,
                               struct kvr_lru_out *out)
{
	int rc = begin_blocks(rs, incarnation, b, n, out);
	if (rc)
		return rc;
	if (rs->mode == KVR_RANK_LRU)
		return kvr_lru_materialize(rs->lru, attempt, parent_seq, b, n, start_pos,
		                           private_blocks, out);
	if (!kvr_u64map_find(&rs->ttl_attempts, attempt))
		return KVR_ENOENT;
	/* Output below a parent that expired meanwhile (a decode that outlived its prompt's TTL):
	 * not predicted, as no prompt can match it without the prefix.  Entered, the store held it
	 * while the index could not (no parent there to hang it below), and a later prompt that
	 * entered the prefix again only refreshed it: the index never got it (an overlap of 2
	 * where the store held 3). */
	if (n > 0 && start_pos > 0 && !kvr_ttl_holds_at(rs->ttl, parent_seq, start_pos - 1))
		return 0;
	return kvr_ttl_record(rs->ttl, b, n, start_pos, now, out);
}

int kvr_rank_state_release(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                           struct kvr_lru_out *out)
{
	int rc = begin(rs, incarnation, out);
	if (rc)
		return rc;
	if (rs->mode == KVR_RANK_LRU)
		return kvr_lru_release(rs->lru, attempt, out);
	return kvr_u64map_remove(&rs->ttl_attempts, attempt) ? 0 : KVR_ENOENT;
}

int kvr_rank_state_heal_cached(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                               uint32_t true_depth, uint64_t unallocated, struct kvr_lru_heal *res,
                               struct kvr_lru_out *out)
{
	if (!res)
		return KVR_EINVAL;
	memset(res, 0, sizeof(*res));
	int rc = begin(rs, incarnation, out);
	if (rc)
		return rc;
	if (rs->mode == KVR_RANK_LRU)
		return kvr_lru_heal_cached(rs->lru, attempt, true_depth, unallocated, res, out);
	return kvr_u64map_find(&rs->ttl_attempts, attempt) ? 0 : KVR_ENOENT;
}

int kvr_rank_state_heal_resident(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t resident,
                                 uint64_t unallocated, uint64_t *evicted, bool *raised,
                                 struct kvr_lru_out *out)
{
	if (evicted)
		*evicted = 0;
	if (raised)
		*raised = false;
	int rc = begin(rs, incarnation, out);
	if (rc)
		return rc;
	return rs->mode == KVR_RANK_LRU
	           ? kvr_lru_heal_resident(rs->lru, resident, unallocated, evicted, raised, out)
	           : 0;
}

uint64_t kvr_rank_state_lease_unallocated(const struct kvr_rank_state *rs, uint64_t incarnation,
                                          uint64_t attempt)
{
	if (!rs || rs->mode != KVR_RANK_LRU || fence(rs, incarnation))
		return 0;
	return kvr_lru_lease_unallocated(rs->lru, attempt);
}

int kvr_rank_state_heal_watermark(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t seq,
                                  uint64_t *evicted, struct kvr_lru_out *out)
{
	if (evicted)
		*evicted = 0;
	int rc = begin(rs, incarnation, out);
	if (rc)
		return rc;
	return rs->mode == KVR_RANK_LRU ? kvr_lru_heal_watermark(rs->lru, seq, evicted, out) : 0;
}

int kvr_rank_state_tick(struct kvr_rank_state *rs, uint64_t now, struct kvr_lru_out *out)
{
	if (!rs || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	if (rs->mode != KVR_RANK_TTL)
		return 0;
	return kvr_ttl_expire(rs->ttl, now, out);
}

uint64_t kvr_rank_state_next_deadline(const struct kvr_rank_state *rs)
{
	return (rs && rs->mode == KVR_RANK_TTL) ? kvr_ttl_next_expiry(rs->ttl) : UINT64_MAX;
}

size_t kvr_rank_state_overlap(const struct kvr_rank_state *rs, const uint64_t *seq, size_t n)
{
	if (!rs)
		return 0;
	if (rs->mode == KVR_RANK_LRU)
		return kvr_lru_overlap(rs->lru, seq, n);
	if (rs->mode == KVR_RANK_TTL)
		return kvr_ttl_overlap(rs->ttl, seq, n);
	return 0;
}

enum kvr_rank_mode kvr_rank_state_mode(const struct kvr_rank_state *rs)
{
	return rs ? rs->mode : KVR_RANK_ABSENT;
}

uint64_t kvr_rank_state_incarnation(const struct kvr_rank_state *rs)
{
	return rs ? rs->incarnation : 0;
}

const struct kvr_lru *kvr_rank_state_lru(const struct kvr_rank_state *rs)
{
	return rs ? rs->lru : NULL;
}

void kvr_rank_state_set_keep_private(struct kvr_rank_state *rs, bool on)
{
	if (rs)
		rs->keep_private = on;
}
