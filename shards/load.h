/*
 * shards/load.h - active load of one rank (issue 5, part D): what the rank is busy with now,
 * and what it would be busy with if a candidate request were added.  See load.c.
 *
 * Context (all functions): the shard thread that owns the instance; no locks.  (The router
 * publishes the numbers to other threads as snapshots; the pinned runs are published through
 * shards/pinmap.h when kvr_load_publish was called.)
 * Input requirement: chained sequence hashes (core/hash), add_output continuing the request's
 * chain.  The pinned set is kept in runs: pinning/unpinning costs O(runs) writes plus one
 * sequential compare per block (see load.c).
 */
#ifndef KVR_SHARDS_LOAD_H
#define KVR_SHARDS_LOAD_H

#include <stddef.h>
#include <stdint.h>

struct kvr_load;
struct kvr_pinmap;

/* Potential load of a rank for a candidate request (cost inputs of core/select). */
struct kvr_load_potential {
	uint64_t decode_blocks;  /* active blocks + the request's blocks not already pinned */
	uint64_t prefill_tokens; /* active prefill tokens (with decay) + the request's uncached */
};

struct kvr_load_stats {
	uint64_t active_blocks;   /* distinct pinned blocks */
	uint64_t prefill_tokens;  /* undecayed sum over requests still in prefill */
	uint64_t active_requests; /* added, not finished */
	uint64_t in_prefill;      /* of which still in prefill */
	uint64_t publish_errors;  /* runs the pinmap could not take (no memory) */
};

/* Creates an empty load tracker.  expected_prefill_ns: if > 0, the OLDEST request still in
 * prefill counts its tokens * max(0, 1 - elapsed / expected_prefill_ns) (linear decay: it is
 * being processed); 0 = no decay.  Returns 0, KVR_EINVAL or KVR_ENOMEM. */
int kvr_load_create(uint64_t expected_prefill_ns, struct kvr_load **out);
/* NULL is a no-op.  A publishing load unpublishes its runs and frees them after a grace period
 * (Context then: an RCU-registered thread, outside a read-side section). */
void kvr_load_destroy(struct kvr_load *load);

/* From now on every pinned run is published in pm (shards/pinmap.h) for rank `slot`, so
 * routers read this rank's pinned depth with kvr_pinmap_depths.  Call on an empty load.
 * Commands that free runs then need an RCU-registered thread.  0 or KVR_EINVAL. */
int kvr_load_publish(struct kvr_load *load, struct kvr_pinmap *pm, uint32_t slot);

/*
 * A request attempt starts on the rank at time now: pins blocks seq[0], seq[stride], ...
 * (n of them, borrowed; a block pinned by several requests counts once) and adds
 * prefill_tokens (its prompt tokens minus its predicted cached tokens) until prefill_done or
 * finish.  stride: 1 for a plain array, 2 for the .seq fields of struct kvr_lru_block (the
 * booking's record): only the blocks nobody pinned yet are read in full, the rest at run
 * boundaries (shards/chain.h).
 * Returns 0, KVR_EINVAL, KVR_EEXIST (attempt active), KVR_ENOMEM (nothing changed).
 */
int kvr_load_add(struct kvr_load *load, uint64_t attempt, const uint64_t *seq, size_t stride,
                 size_t n, uint64_t prefill_tokens, uint64_t now);

/* The attempt's prefill finished: its prefill tokens stop counting.  Idempotent.
 * Returns 0, KVR_ENOENT (not active). */
int kvr_load_prefill_done(struct kvr_load *load, uint64_t attempt);

/* Optional output-block tracking: the attempt now also pins seq[0], seq[stride], ... (n decode
 * output blocks).  Returns 0, KVR_EINVAL, KVR_ENOENT, KVR_ENOMEM (nothing changed). */
int kvr_load_add_output(struct kvr_load *load, uint64_t attempt, const uint64_t *seq, size_t stride,
                        size_t n);

/* The attempt finished (or was aborted / expired): unpins its blocks, drops its prefill tokens.
 * Returns 0, KVR_ENOENT (not active: unknown or already finished). */
int kvr_load_finish(struct kvr_load *load, uint64_t attempt);

/* Active prefill tokens at time now, with the oldest in-prefill request decayed. */
uint64_t kvr_load_prefill_tokens(const struct kvr_load *load, uint64_t now);

/* When the oldest in-prefill request's decay ends (its start plus expected_prefill_ns), or 0
 * when nothing decays (no expected_prefill_ns, nobody in prefill). */
uint64_t kvr_load_decay_end(const struct kvr_load *load);

/*
 * Potential load if a request with blocks seq[0..n) (borrowed; may be NULL if n == 0) and
 * uncached_tokens were added at time now.  Returns 0 or KVR_EINVAL.
 */
int kvr_load_potential(const struct kvr_load *load, const uint64_t *seq, size_t n,
                       uint64_t uncached_tokens, uint64_t now, struct kvr_load_potential *out);

/* How many leading blocks of seq[0..n) (a chain from the root, borrowed) are pinned: the
 * request's blocks already pinned on this rank form this prefix.  O(runs) probes plus a
 * sequential compare. */
size_t kvr_load_pinned_depth(const struct kvr_load *load, const uint64_t *seq, size_t n);

/* Bytes the tracker holds (runs, hash arrays, maps, requests), for benchmarks.  O(runs). */
size_t kvr_load_bytes(const struct kvr_load *load);

void kvr_load_stats(const struct kvr_load *load, struct kvr_load_stats *st);

#endif /* KVR_SHARDS_LOAD_H */
