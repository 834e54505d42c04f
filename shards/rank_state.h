/*
 * shards/rank_state.h - one rank's predicted cache with its lifecycle and fencing (issue 5,
 * part A, "rank lifecycle and fencing").
 *
 * A rank slot is ABSENT until the first set_capacity; then it runs either the capacity-bounded
 * LRU (capacity > 0) or TTL retention (capacity none/0) for that incarnation.  Every command
 * returns, in struct kvr_lru_out, what the index must do; the router applies it in this order:
 * cleared (drop everything of the rank), then the evicted runs (remove), then the stored runs
 * (add; ranges of the command's input blocks, see shards/lru.h).
 *
 * Refusals never change state and never emit anything: a command on an ABSENT rank gets
 * KVR_ENOENT; a command carrying an incarnation other than the current one gets KVR_ESTALE
 * (set_capacity is the exception: a different incarnation on a known rank means the worker
 * restarted, so it clears the rank and starts fresh); an attempt that is not live (unknown,
 * released, or lost with an older incarnation) gets KVR_ENOENT.
 *
 * Context (all functions): the shard thread that owns the rank; no locks, no atomics.
 */
#ifndef KVR_SHARDS_RANK_STATE_H
#define KVR_SHARDS_RANK_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "shards/lru.h"

enum kvr_rank_mode {
	KVR_RANK_ABSENT = 0, /* never configured, or reset */
	KVR_RANK_LRU = 1,    /* capacity-bounded approximate LRU */
	KVR_RANK_TTL = 2,    /* TTL retention (capacity unknown) */
};

struct kvr_rank_state;

/* Creates an ABSENT rank slot.  ttl_ns (> 0) and bucket_ns configure TTL mode (see
 * shards/ttl.h).  Returns 0, KVR_EINVAL or KVR_ENOMEM. */
int kvr_rank_state_create(uint64_t ttl_ns, uint64_t bucket_ns, struct kvr_rank_state **out);
/* LRUs this rank creates from now on run in keep_private mode (see shards/lru.c): how vLLM's
 * 2025 block pool treats a request's partial block at release.  The router turns it on for
 * kvr_config.free_order KVR_FREE_TAIL_FIRST only. */
void kvr_rank_state_set_keep_private(struct kvr_rank_state *rs, bool on);

/* NULL is a no-op. */
void kvr_rank_state_destroy(struct kvr_rank_state *rs);

/*
 * Sets the rank's capacity in blocks (0 = none: TTL retention) for an incarnation.
 *  - ABSENT: the rank becomes known (LRU or TTL); nothing to emit.
 *  - a different incarnation: out->cleared, fresh state for the new incarnation.
 *  - same incarnation, LRU: capacity > 0 resizes (shrinking evicts); 0 clears (out->cleared)
 *    and switches to TTL.
 *  - same incarnation, TTL: 0 is a no-op; capacity > 0 is refused with KVR_EBUSY (a rank runs
 *    on TTL for that incarnation until it is reset).
 * Returns 0, KVR_EINVAL, KVR_EBUSY, KVR_ENOMEM (nothing changed).
 */
int kvr_rank_state_set_capacity(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t capacity,
                                struct kvr_lru_out *out);

/* Starts a new life: replaces the store, whatever the mode, with an empty one for (incarnation,
 * capacity) (0 = TTL retention), out->cleared unless the rank was ABSENT.  The new store is made
 * before the old one goes, so a rank command that ends the rank's attempts only after this
 * returned 0 changes nothing on KVR_ENOMEM.  Returns 0, KVR_EINVAL, KVR_ENOMEM (nothing changed).
 * Context: the rank's shard. */
int kvr_rank_state_renew(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t capacity,
                         struct kvr_lru_out *out);

/* kvr_lru_acquire (LRU) or a TTL record of the prompt at positions 0.. (TTL), fenced.
 * Returns 0, KVR_ENOENT (absent), KVR_ESTALE (incarnation), KVR_EEXIST, KVR_EINVAL,
 * KVR_ERANGE, KVR_ENOMEM. */
int kvr_rank_state_acquire(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                           const struct kvr_lru_block *b, size_t n, uint32_t private_blocks,
                           uint64_t now, struct kvr_lru_out *out);

/* kvr_lru_materialize (LRU) or a TTL record at start_pos.. (TTL), fenced.  The attempt must be
 * live (KVR_ENOENT). */
int kvr_rank_state_materialize(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                               uint64_t parent_seq, const struct kvr_lru_block *b, size_t n,
                               uint32_t start_pos, uint32_t private_blocks, uint64_t now,
                               struct kvr_lru_out *out);

/* kvr_lru_release (LRU) or forgetting the attempt (TTL), fenced. */
int kvr_rank_state_release(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                           struct kvr_lru_out *out);

/*
 * Healing from engine ground truth (issue 15), fenced like every command.  LRU mode: the rules
 * of shards/lru.h (kvr_lru_heal_cached / _resident / _watermark).  TTL mode keeps no order, so
 * nothing is provable: 0 with an empty result (the attempt must still be live for
 * heal_cached).  Absent: KVR_ENOENT; other incarnation: KVR_ESTALE.  The results (res,
 * evicted, raised) are emptied first, whatever the return.
 */
int kvr_rank_state_heal_cached(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t attempt,
                               uint32_t true_depth, uint64_t unallocated, struct kvr_lru_heal *res,
                               struct kvr_lru_out *out);
int kvr_rank_state_heal_resident(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t resident,
                                 uint64_t unallocated, uint64_t *evicted, bool *raised,
                                 struct kvr_lru_out *out);
/* kvr_lru_lease_unallocated in LRU mode; 0 otherwise or when absent / another incarnation. */
uint64_t kvr_rank_state_lease_unallocated(const struct kvr_rank_state *rs, uint64_t incarnation,
                                          uint64_t attempt);
/* KVR_ENOENT also when no inactive copy of seq is predicted (nothing changed). */
int kvr_rank_state_heal_watermark(struct kvr_rank_state *rs, uint64_t incarnation, uint64_t seq,
                                  uint64_t *evicted, struct kvr_lru_out *out);

/* Maintenance: TTL expiry at now (evicted runs); nothing in LRU mode or when absent.
 * Returns 0, KVR_EINVAL, KVR_ENOMEM. */
int kvr_rank_state_tick(struct kvr_rank_state *rs, uint64_t now, struct kvr_lru_out *out);

/* When tick has work next (TTL), UINT64_MAX if never. */
uint64_t kvr_rank_state_next_deadline(const struct kvr_rank_state *rs);

/* Leading hashes of seq[0..n) the rank is predicted to hold (0 when absent). */
size_t kvr_rank_state_overlap(const struct kvr_rank_state *rs, const uint64_t *seq, size_t n);

enum kvr_rank_mode kvr_rank_state_mode(const struct kvr_rank_state *rs);
/* The current incarnation (meaningless when absent). */
uint64_t kvr_rank_state_incarnation(const struct kvr_rank_state *rs);
/* The LRU (NULL unless in LRU mode), for stats.  Borrowed. */
const struct kvr_lru *kvr_rank_state_lru(const struct kvr_rank_state *rs);

#endif /* KVR_SHARDS_RANK_STATE_H */
