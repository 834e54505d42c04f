/*
 * tools/sim/block_pool.h - a model of vLLM v1's prefix-caching KV block pool, for the simulator
 * behind tools/kvr-replay.
 *
 * One pool is one rank's GPU KV cache: n_blocks physical blocks, each with a reference count
 * and, once full and cached, the sequence hash (and local hash) of the prefix it completes.
 * Blocks with ref == 0 sit in the free queue, a doubly-linked list ordered by eviction
 * priority: allocation pops from the head; releasing a request appends its blocks tail first,
 * so a finished prompt's last blocks are evicted before its first ones.  A free block keeps its
 * hash until it is popped for reuse (lazy eviction); only then is the hash dropped and
 * reported.  A prefix-cache hit "touches" a block: ref++, and if it was free it leaves the
 * queue.  One hash may have several physical copies (two requests computed the same block
 * concurrently); a lookup returns the oldest surviving copy.
 *
 * Single-threaded: Context for every function is "the simulator's thread"; no RCU involved.
 */
#ifndef KVR_TOOLS_SIM_BLOCK_POOL_H
#define KVR_TOOLS_SIM_BLOCK_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SIM_NO_BLOCK UINT32_MAX

/* One physical block.  Read-only for callers (sim_pool_block()). */
struct sim_block {
	uint64_t seq;                  /* sequence hash (names the whole prefix); valid if hashed */
	uint64_t local;                /* the block's own hash; valid if hashed */
	uint32_t ref;                  /* requests using the block */
	uint32_t prev, next;           /* free-queue links (SIM_NO_BLOCK at the ends) */
	uint32_t copy_prev, copy_next; /* other physical copies of the same hash */
	bool hashed;                   /* full and registered in the hash map */
	bool queued;                   /* in the free queue (iff ref == 0) */
};

/* A hash dropped by an allocation (lazy eviction). */
struct sim_evicted {
	uint64_t seq;
	uint64_t local;
	bool last_copy; /* no other physical copy of this hash remains */
};

struct sim_pool;

/*
 * Creates a pool of n_blocks (>= 1) free, unhashed blocks, queued in block-id order (as vLLM
 * builds its queue).  Returns 0, KVR_EINVAL (out NULL, n_blocks 0 or > 1<<30), KVR_ENOMEM.
 */
int sim_pool_create(uint32_t n_blocks, struct sim_pool **out);
/* Frees the pool.  NULL is a no-op. */
void sim_pool_destroy(struct sim_pool *p);

/* Total physical blocks. */
uint32_t sim_pool_size(const struct sim_pool *p);
/* Blocks in the free queue (free, possibly still cached): what an allocation may take. */
uint32_t sim_pool_num_free(const struct sim_pool *p);
/* Distinct hashes currently cached (resident, any ref count). */
size_t sim_pool_num_cached(const struct sim_pool *p);
/* The oldest cached block still evictable: the first hashed block from the free queue's head
 * (what vLLM evicts next among cached blocks).  Writes its sequence hash to *seq and returns
 * true, or false when no free block holds a hash.  O(unhashed blocks ahead of it). */
bool sim_pool_oldest_cached(const struct sim_pool *p, uint64_t *seq);
/* Block id's state; NULL for an id out of range.  Borrowed until the next mutating call. */
const struct sim_block *sim_pool_block(const struct sim_pool *p, uint32_t id);

/* The oldest surviving physical copy holding seq, or SIM_NO_BLOCK. */
uint32_t sim_pool_lookup(const struct sim_pool *p, uint64_t seq);

/*
 * Longest cached prefix: for i = 0.. while seq[i] is cached, writes its block id to
 * blocks_out[i] (may be NULL).  Returns the number of leading hits (<= n).  Does not touch.
 */
size_t sim_pool_match_prefix(const struct sim_pool *p, const uint64_t *seq, size_t n,
                             uint32_t *blocks_out);

/* Of the n blocks, how many are free (ref 0): a hit on them costs a free-queue slot, which
 * vLLM counts against the allocation (num_evictable_computed_blocks). */
size_t sim_pool_count_free(const struct sim_pool *p, const uint32_t *blocks, size_t n);

/* A prefix-cache hit: ref++ on each block, and a block that was free leaves the free queue
 * (vLLM BlockPool.touch).  ids must be valid. */
void sim_pool_touch(struct sim_pool *p, const uint32_t *blocks, size_t n);

/*
 * Takes n blocks from the head of the free queue (vLLM get_new_blocks): each gets ref 1, and a
 * block that still held a hash drops it now; each dropped hash is written to evicted (capacity
 * n, may be NULL) and counted in *n_evicted (may be NULL).
 * Returns 0, or KVR_EAGAIN (fewer than n free blocks; nothing changed).
 */
int sim_pool_alloc(struct sim_pool *p, size_t n, uint32_t *out, struct sim_evicted *evicted,
                   size_t *n_evicted);

/*
 * Registers a full block's hashes (vLLM cache_full_blocks for one block).  The block must be
 * held (ref > 0) and unhashed; a block already hashed is left alone.  Another copy of the same
 * seq may already exist: this one is appended as a further copy.
 * Returns true when seq was not cached before (the first copy), false otherwise.
 */
bool sim_pool_cache_block(struct sim_pool *p, uint32_t id, uint64_t seq, uint64_t local);

/*
 * Releases one request's blocks (vLLM KVCacheManager.free): ref-- on each, in REVERSE order
 * (blocks[n-1] first), and those reaching 0 are appended to the free-queue tail in that order,
 * keeping their hashes (lazy eviction), except, in fresh-first order, those without a hash,
 * which go to the head (sim_pool_set_tail_first).  blocks is in the request's order (block 0
 * first); a block may appear once only.
 */
void sim_pool_release(struct sim_pool *p, const uint32_t *blocks, size_t n);
/* The free order of sim_pool_release (kvrouter.h, enum kvr_free_order): false (the default),
 * vLLM's 2026 block pool, the blocks reaching ref 0 without a hash go to the queue's head,
 * reused first; true, vLLM's of 2025, appended with the others. */
void sim_pool_set_tail_first(struct sim_pool *p, bool on);

/*
 * Drops every hash (vLLM reset_prefix_cache, the AllBlocksCleared event) if no block is held.
 * Returns 0, or KVR_EBUSY (some block has ref > 0; nothing changed).
 */
int sim_pool_reset(struct sim_pool *p);

/* Writes up to cap distinct cached sequence hashes to out (any order); returns how many
 * exist (which may exceed cap).  out may be NULL with cap 0 to count. */
size_t sim_pool_cached_hashes(const struct sim_pool *p, uint64_t *out, size_t cap);

/* Writes up to cap block ids of the free queue, head (next evicted) first; returns the queue
 * length.  For tests and debugging. */
size_t sim_pool_free_order(const struct sim_pool *p, uint32_t *out, size_t cap);

#endif /* KVR_TOOLS_SIM_BLOCK_POOL_H */
