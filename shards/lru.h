/*
 * shards/lru.h - capacity-bounded approximate LRU of one rank's KV cache (issue 5, part A),
 * kept in runs of blocks (issue 11 item 3).
 *
 * The router predicts what a rank's engine (vLLM) holds from its own routing decisions: copies
 * of blocks are reference counted by leases (one per request attempt); a released copy becomes
 * evictable; eviction takes the least recently released first and, within one release, the
 * deepest position first.  See lru.c for the algorithm (segments of consecutive copies) and
 * tests/ref/lru_ref.c for the per-block oracle it is tested against.
 *
 * Input requirement: sequence hashes are CHAINED (a seq hash names its whole prefix, as
 * core/hash makes them), and a materialize continues its lease's chain.  Work per command is
 * O(runs) writes plus one sequential compare per prompt block.
 *
 * Outputs are RUN-SHAPED (issue 11 item 3), so the index is written in O(runs), not O(blocks).
 * Every command RESETS *out first, then fills it with what the index must do:
 *  - stored runs: ranges [first, first + n) of the command's INPUT blocks b[] whose hashes became
 *    present on the rank (absent before the command, first copy now).  The index stores each
 *    range as one chain run below b[first - 1], or, when first == 0, below the command's parent
 *    (the root for acquire and for a TTL record at position 0; parent_seq for materialize; the
 *    block before start_pos for a TTL record).  The local hashes come from b[] too.  With
 *    chained sequence hashes (core/hash; a seq hash names its whole prefix) an acquire or a
 *    materialize stores at most one range, a suffix of b[].
 *  - evicted runs: hashes whose LAST copy went, as runs of consecutive chain blocks:
 *    evicted_seq[0..n_evicted) is the concatenation of n_evicted_runs runs, run i being the next
 *    evicted_run_len[i] hashes, each run in chain order (parent before child), runs listed in
 *    the order they were evicted.  Every run is a tail at the moment it goes: no child of its
 *    last block is present any more (eviction is deepest first within a release and releases go
 *    oldest first, so a block's last copy never goes before its children's), so the index may
 *    trim each run as a tail, in order.  Reading each run backwards, run after run, gives the
 *    exact per-block eviction order (deepest first).
 *  - cleared: used by shards/rank_state.h (the whole rank must be cleared from the index before
 *    the rest).
 * Within one command the stored and evicted sets are disjoint, so the router may apply them in
 * any order (it applies cleared, then evicted, then stored).  On any error *out is empty and
 * the state is unchanged.
 *
 * Context (all functions): the shard thread that owns the instance; no locks, no atomics.
 */
#ifndef KVR_SHARDS_LRU_H
#define KVR_SHARDS_LRU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_lru;

/* One block of a request: its own (local) hash and its chained sequence hash. */
struct kvr_lru_block {
	uint64_t local;
	uint64_t seq;
};
/* The .seq fields of an array of blocks as a strided array of uint64_t (shards/load.h, and the
 * routing thread that hashes into a record's blocks: local at [2i], seq at [2i + 1]). */
#define KVR_LRU_BLOCK_STRIDE (sizeof(struct kvr_lru_block) / sizeof(uint64_t))
_Static_assert(sizeof(struct kvr_lru_block) == 2 * sizeof(uint64_t) &&
                   offsetof(struct kvr_lru_block, seq) == sizeof(uint64_t),
               "blocks are (local, seq) pairs of 64-bit words");

/* A range [first, first + n) of a command's input blocks (see "Outputs" above). */
struct kvr_lru_range {
	uint32_t first;
	uint32_t n;
};

/* Output buffers, owned by the caller's struct but grown by the library (kvr_alloc).
 * Initialise with kvr_lru_out_init, free with kvr_lru_out_fini. */
struct kvr_lru_out {
	struct kvr_lru_range *stored; /* stored runs (ranges of the input b[]) */
	size_t n_stored_runs, cap_stored_runs;
	size_t n_stored;       /* blocks in all stored runs */
	uint64_t *evicted_seq; /* all evicted hashes, run after run, each run parent first */
	size_t n_evicted, cap_evicted;
	uint32_t *evicted_run_len; /* length of each evicted run */
	size_t n_evicted_runs, cap_evicted_runs;
	bool cleared; /* the whole rank must be cleared from the index first */
};

struct kvr_lru_stats {
	uint64_t capacity; /* blocks */
	uint64_t resident; /* copies + private blocks */
	uint64_t copies;   /* physical hashed blocks */
	uint64_t hashes;   /* distinct sequence hashes present */
	uint64_t private_blocks;
	uint64_t phantoms;  /* released private blocks still holding a slot (keep_private mode) */
	uint64_t inactive;  /* copies with no holder (evictable) */
	uint64_t leases;    /* live attempts */
	uint64_t evictions; /* copies evicted since create */
	uint64_t epoch;     /* releases since create */
};

void kvr_lru_out_init(struct kvr_lru_out *out);
void kvr_lru_out_fini(struct kvr_lru_out *out);
/* Empties *out (keeps its memory). */
void kvr_lru_out_reset(struct kvr_lru_out *out);
/* Makes room for `stored_runs` more stored runs and `evicted` more evicted hashes (in up to
 * `evicted` more runs).  0 or KVR_ENOMEM (nothing emitted is lost). */
int kvr_lru_out_reserve(struct kvr_lru_out *out, size_t stored_runs, size_t evicted);
/* Appends b-range [first, first + n) to the stored runs, merging with the last run when it
 * ends at first.  Room must be reserved. */
void kvr_lru_out_stored(struct kvr_lru_out *out, uint32_t first, uint32_t n);
/* Appends evicted hashes seq[0..n) (chain order, parent first) as one NEW run.  Room must be
 * reserved.  n == 0 is a no-op. */
void kvr_lru_out_evicted_run(struct kvr_lru_out *out, const uint64_t *seq, size_t n);

/* Creates an empty LRU of capacity_blocks (0 is allowed: nothing inactive is ever kept).
 * Returns 0, KVR_EINVAL (out NULL) or KVR_ENOMEM. */
int kvr_lru_create(uint64_t capacity_blocks, struct kvr_lru **out);
/* Frees everything.  NULL is a no-op. */
void kvr_lru_destroy(struct kvr_lru *lru);

/*
 * A request attempt is admitted with prompt blocks b[0..n) (borrowed) and private_blocks
 * partial/unhashed blocks.  Leading blocks whose hash is present reuse the oldest copy of the
 * hash (taking it out of the inactive set), refs + 1, position = i; from the first miss on every
 * block gets a NEW copy (even if its hash exists elsewhere on the rank).  Then reconcile.
 * Returns 0, KVR_EINVAL (b NULL with n > 0, lru/out NULL), KVR_EEXIST (attempt live),
 * KVR_ERANGE (more than 2^32-2 blocks or segments), KVR_ENOMEM.
 */
int kvr_lru_acquire(struct kvr_lru *lru, uint64_t attempt, const struct kvr_lru_block *b, size_t n,
                    uint32_t private_blocks, struct kvr_lru_out *out);

/*
 * Output blocks b[0..n) of a live attempt completed: each gets a new copy at position
 * start_pos + i (implied by the chain; the argument is not needed), appended to the lease; the
 * lease's private count is REPLACED by private_blocks.
 * parent_seq: if the lease holds blocks, it must be the seq of the last one appended (the chain
 * the new blocks continue), else KVR_ENOENT; ignored for a lease without blocks.
 * Returns 0, KVR_EINVAL, KVR_ENOENT (attempt not live, parent mismatch), KVR_ERANGE, KVR_ENOMEM.
 */
int kvr_lru_materialize(struct kvr_lru *lru, uint64_t attempt, uint64_t parent_seq,
                        const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                        uint32_t private_blocks, struct kvr_lru_out *out);

/*
 * Ends an attempt: one new release epoch; its private blocks go; each copy refs - 1, and the
 * copies reaching 0 become inactive stamped with this epoch (ordered deepest first); reconcile.
 * Returns 0, KVR_EINVAL, KVR_ENOENT (unknown or already released attempt: the LRU keeps no
 * memory of finished attempts; shards/lease.h tells stale from unknown), KVR_ENOMEM.
 */
int kvr_lru_release(struct kvr_lru *lru, uint64_t attempt, struct kvr_lru_out *out);

/* Sets the capacity (blocks; a registration: it replaces the estimate of lru_cap.c) and evicts
 * inactive copies down to it.  0, KVR_EINVAL, KVR_ENOMEM. */
int kvr_lru_set_capacity(struct kvr_lru *lru, uint64_t capacity, struct kvr_lru_out *out);

/*
 * Healing from engine ground truth (issue 15).  Eviction is ordered, so one fact about what the
 * engine no longer holds says that everything ordered before it went too.  Each rule evicts only
 * INACTIVE copies (what no live request holds), reports them like any eviction in *out, and
 * never allocates beyond *out.
 */
struct kvr_lru_heal {
	uint32_t predicted; /* blocks the acquire found present (the predicted cached depth) */
	uint32_t actual;    /* the engine's cached depth, as given */
	uint64_t evicted;   /* copies (and released private blocks) the rule evicted */
	bool unprovable;    /* the first missing block was held by another live request: the
	                     * engine diverged in a way the order cannot explain; nothing evicted */
	uint64_t lower;     /* a lower bound on the engine's capacity the answer proves, or 0 */
	uint64_t upper;     /* an upper bound it proves, or 0 */
	uint64_t capacity;  /* the capacity estimate after the answer (lru_cap.c) */
};

/*
 * The engine found true_depth leading blocks of the attempt's prompt cached at admission.
 * Less than predicted: the copy the acquire hit at depth true_depth had been evicted by the
 * engine, so every inactive copy ordered before it (older releases; the same release and
 * deeper) is evicted now.  The attempt's own copies stay: the engine recomputed them for it.
 * More than or as predicted: nothing to evict; the blocks the engine proved present are held by
 * the attempt already (an acquire takes a copy of every prompt block), so nothing needs
 * re-admitting.  Either way the answer bounds the engine's capacity (lru_cap.c: the first call
 * turns on the ghosts it needs), the capacity estimate moves toward the bound, and a lower one
 * evicts the oldest copies.  unallocated: blocks of OTHER attempts the engine has not allocated
 * yet (kvr_lru_lease_unallocated of those whose prefill has not finished).  Returns 0,
 * KVR_EINVAL (true_depth > the attempt's blocks), KVR_ENOENT (no live lease), KVR_ENOMEM
 * (nothing changed).
 */
int kvr_lru_heal_cached(struct kvr_lru *lru, uint64_t attempt, uint32_t true_depth,
                        uint64_t unallocated, struct kvr_lru_heal *res, struct kvr_lru_out *out);

/* The engine holds `resident` blocks: the oldest inactive copies go until the prediction holds
 * no more than resident + unallocated (it may hold fewer: the engine's other blocks are
 * unknown).  unallocated: blocks the prediction holds that the engine cannot have allocated yet
 * (kvr_lru_lease_unallocated of the leases whose prefill has not finished: a routed request
 * waiting in the engine's queue, or part way through a chunked prefill); without it a queue
 * in front of the engine makes the rule evict copies the engine still holds.  *evicted (may be
 * NULL) counts them.  resident above the capacity proves the capacity under-registered: the
 * capacity estimate becomes resident (nothing is evicted; *raised, may be NULL, says so).  0,
 * KVR_EINVAL, KVR_ENOMEM (nothing changed). */
int kvr_lru_heal_resident(struct kvr_lru *lru, uint64_t resident, uint64_t unallocated,
                          uint64_t *evicted, bool *raised, struct kvr_lru_out *out);

/* The blocks the attempt's acquire added to the prediction (its prompt blocks that were not
 * present, and its private block): what the engine allocates for it only when it schedules the
 * prefill.  0 when the attempt holds no lease.  O(1). */
uint64_t kvr_lru_lease_unallocated(const struct kvr_lru *lru, uint64_t attempt);

/* The engine's oldest resident block is seq: every inactive copy ordered before its inactive
 * copy nearest the head (including the deeper blocks of its segment) is evicted.  O(blocks
 * scanned up to it).  0, KVR_EINVAL, KVR_ENOENT (no inactive copy of seq: nothing provable,
 * nothing changed), KVR_ENOMEM. */
int kvr_lru_heal_watermark(struct kvr_lru *lru, uint64_t seq, uint64_t *evicted,
                           struct kvr_lru_out *out);

/* How many leading hashes of seq[0..n) are present on the rank (any copy). */
size_t kvr_lru_overlap(const struct kvr_lru *lru, const uint64_t *seq, size_t n);

/* keep_private mode (see lru.c): a released private block keeps its slot as an unhashed
 * inactive block, evicted first of its release, as vLLM's free queue does.  Default off (the
 * issue's reference model).  Only takes effect on an empty LRU. */
void kvr_lru_set_keep_private(struct kvr_lru *lru, bool on);

/* Whether the attempt holds a live lease. */
bool kvr_lru_has_lease(const struct kvr_lru *lru, uint64_t attempt);

/* Fills *st.  Cheap (counters). */
void kvr_lru_stats(const struct kvr_lru *lru, struct kvr_lru_stats *st);
/* The capacity eviction keeps to now (the estimate, lru_cap.c); 0 for NULL. */
uint64_t kvr_lru_capacity(const struct kvr_lru *lru);

/* Bytes of memory the instance holds (segments, hash arrays, maps, leases, scratch arrays), as
 * allocated: the allocator's size classes (kvr_alloc_real_size).
 * O(segments): for benchmarks and tests. */
size_t kvr_lru_bytes(const struct kvr_lru *lru);
/* kvr_lru_bytes / live copies (0 when empty). */
double kvr_lru_bytes_per_copy(const struct kvr_lru *lru);

#endif /* KVR_SHARDS_LRU_H */
