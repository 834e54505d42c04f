/*
 * core/index.h - the run-compressed RCU index: which ranks hold how long a prefix of a prompt.
 *
 * Internal to kvrouter (not in kvrouter.h).  The router and the shard threads call it:
 *  - readers (any registered thread, inside kvr_rcu_read_lock()) call kvr_index_find_matches();
 *    it takes no lock, allocates nothing, never waits for a writer and never retries;
 *  - writers are shard threads, several at once, each writing only for its own rank slots.
 *    Writer calls serialise on the index's writer mutex (readers never take it) and queue
 *    frees through call_rcu, so a writer thread must be registered (kvr_rcu_thread_online())
 *    and must NOT hold a read-side section when it calls a writer function (deferred frees may
 *    have to wait for a grace period when memory is short).
 * Several indexes coexist independently (each router has one; tests and benchmarks make more).
 * The pinned depth of a prompt (deduplicated decode load) does not come from here: the shards
 * publish their pinned runs in shards/pinmap.c.
 * Costs: find_matches O(runs on the query's path + log L) table probes and comparisons plus
 * the per-rank intersection; store O(1) amortised per run plus hashing its blocks; removing a
 * tail of a chain in chain order one table probe plus O(blocks) word operations.
 * Semantics follow NVIDIA Dynamo's KV router; see core/index.c for the design essay.
 */
#ifndef KVR_CORE_INDEX_H
#define KVR_CORE_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_index;

/* One stored block: the engine's external hash and the router's local block hash. */
struct kvr_index_block {
	uint64_t ext_hash;
	uint64_t local_hash;
};

/* Counters since creation (monotonic unless said otherwise); a relaxed snapshot. */
struct kvr_index_stats {
	uint64_t parent_not_found; /* stored events rejected: the rank does not hold the parent */
	uint64_t block_not_found;  /* removed hashes the rank did not hold (skipped) */
	uint64_t invalid;          /* blocks rejected: self-parent, ext hash naming another block */
	uint64_t stored_blocks;    /* (block, rank) copies added */
	uint64_t removed_blocks;   /* (block, rank) copies dropped (remove, clear, remove rank) */
	uint64_t nodes;            /* distinct blocks in the tree (positions of runs) now, gauge */
	uint64_t copies;           /* (block, rank) copies now, gauge */
	uint64_t ranks;            /* active rank slots now, gauge */
	uint64_t bytes_shared;     /* bytes of runs, hash arrays, run table, locator, gauge (real
	                            * allocator sizes, as kvr_index_memory_bytes) */
	uint64_t bytes_per_rank;   /* bytes of holder sets and records, per-rank ext maps and end
	                            * maps, gauge */
	uint64_t rank_scans;       /* without the locator: lookups that scanned a rank's records */
};

/* Per-rank answer of find_matches. */
struct kvr_index_match {
	uint32_t slot;      /* the rank's slot */
	uint32_t score;     /* longest contiguous prefix of the query the rank holds, in blocks */
	uint64_t tree_size; /* blocks indexed for the rank (tie-breaking), as last published:
	                     * within 1/64 of the exact count, exact below 64 blocks, at 0 and
	                     * after kvr_index_quiesce (core/index_internal.h: idx_size_set) */
};

struct kvr_index_match_opts {
	bool early_exit; /* stop the walk as soon as one rank remains (its score is then a floor) */
};

/* Most rank slots one index supports. */
#define KVR_INDEX_MAX_RANKS (1u << 20)

/*
 * Creates an empty index with slots 0..max_ranks-1 (1..KVR_INDEX_MAX_RANKS).
 * Returns 0 and *out, KVR_EINVAL (out NULL), KVR_ERANGE (max_ranks), KVR_ENOMEM.
 * Context: any thread.
 */
int kvr_index_create(uint32_t max_ranks, struct kvr_index **out);

/*
 * Frees everything; waits for the index's pending deferred frees (rcu_barrier).  NULL is a no-op.
 * Context: after every reader and writer of this index has stopped; outside a read section.
 */
void kvr_index_destroy(struct kvr_index *idx);

/*
 * Gives rank (worker_id, dp_rank) a slot.  Slots are dense; a removed slot is reused only after
 * an RCU grace period, so a reader never credits a removed rank's blocks to a new one.
 * Returns 0 and *slot, KVR_EINVAL, KVR_EEXIST (already added; *slot is set to it), KVR_ERANGE
 * (no free slot), KVR_ENOMEM (the calling thread cannot be registered as an RCU reader,
 * kvr_rcu_thread_online: nothing added).  Context: a writer (shard) thread, outside a read
 * section.
 */
int kvr_index_rank_add(struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank, uint32_t *slot);

/*
 * Finds the slot of (worker_id, dp_rank).  Lock-free.  Returns 0, KVR_EINVAL or KVR_ENOENT.
 * Context: any thread registered with kvr_rcu_thread_online() (it takes a nested read lock).
 */
int kvr_index_rank_find(const struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank,
                        uint32_t *slot);

/*
 * The (worker_id, dp_rank) of an active slot.  Returns 0, KVR_EINVAL or KVR_ENOENT.
 * Context: any thread; a relaxed read (call inside a read section to pin the slot's identity).
 */
int kvr_index_rank_get(const struct kvr_index *idx, uint32_t slot, uint64_t *worker_id,
                       uint32_t *dp_rank);

/*
 * Drops every block of the slot, then frees the slot (reusable after a grace period).
 * Returns 0, KVR_EINVAL, KVR_ENOENT or KVR_ENOMEM (as kvr_index_clear_rank: nothing done).
 * Context: the slot's writer thread, outside a read section.
 */
int kvr_index_rank_remove(struct kvr_index *idx, uint32_t slot);

/*
 * Stored event for a rank: blocks[0..n) hang below the parent (the block with external hash
 * *parent_ext the rank holds; NULL = the root), each block below the previous one.
 * Rules: parent not held -> KVR_ENOENT, nothing applied (counted parent_not_found).  A block
 * whose ext hash equals its parent's, or whose ext hash the rank already uses for another block,
 * or that the rank already holds under another ext hash -> KVR_EINVAL (counted invalid); the
 * blocks before it stay applied, the rest is dropped.  Re-storing what the rank holds is a no-op,
 * or with kvr_index_set_count_copies() on, adds one copy of the block.
 * The index keys a block by the router's sequence hash (core/hash.c: seq = local for a block
 * below the root, else XXH3(parent seq, local)), computed here from local_hash; find_matches is
 * given the same sequence hashes.
 * n == 0 is a no-op (0).  KVR_ENOMEM: nothing of this call is applied (a failed write
 * changes nothing: what the call applied before the failure is taken back).  KVR_ERANGE: the
 * index holds the most runs it can name (2^25 - 1 runs of two blocks or more that the block
 * locator finds; ids of dead runs are reused), nothing of this call applied, as KVR_ENOMEM; a
 * retry succeeds only once runs have died.
 * Context: the slot's writer thread, outside a read section.
 */
int kvr_index_store(struct kvr_index *idx, uint32_t slot, const uint64_t *parent_ext,
                    const struct kvr_index_block *blocks, size_t n);

/*
 * kvr_index_store with the parent named by its path: path[0], path[stride], ...,
 * path[(np - 1) * stride] are the sequence hashes of the chain from the root to the parent (np
 * 0: the root), the parent's ext hash being its sequence hash (as the approximate modes store).
 * The same rules and results as kvr_index_store(idx, slot, &path[(np - 1) * stride], blocks, n);
 * the parent is found by a walk from the root (O(runs + log np) probes), which an index without
 * the block locator needs for a parent that is not where the rank's last write ended.
 * Returns as kvr_index_store, and KVR_EINVAL for path NULL or stride 0 with np > 0.
 * Context: the slot's writer thread, outside a read section.
 */
int kvr_index_store_path(struct kvr_index *idx, uint32_t slot, const uint64_t *path, size_t stride,
                         size_t np, const struct kvr_index_block *blocks, size_t n);

/*
 * Removed event: drops ext[0..n) from the rank (with count_copies on: drops one copy each; the
 * block leaves the rank with its last copy).  Unknown hashes are skipped and counted
 * (block_not_found; *n_not_found if non-NULL).  No cascade to descendants.  Allocates nothing.
 * Returns 0, KVR_EINVAL (idx NULL, ext NULL with n > 0), KVR_ENOENT (bad slot) or KVR_ENOMEM
 * (n > 0 and the calling thread cannot be registered as an RCU reader, kvr_rcu_thread_online:
 * pthread keys exhausted; nothing removed).
 * Context: the slot's writer thread, outside a read section.
 */
int kvr_index_remove(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                     size_t *n_not_found);

/*
 * kvr_index_remove with ext[] split into runs: run k is the next run_len[k] hashes (lengths past
 * n are cut; hashes past the runs are one more run).  The outcome is kvr_index_remove's exactly;
 * the split tells an index without the block locator where each chain ends (the predicted
 * cache's evicted runs, shards/lru.h: each one a chain in chain order), so it looks each run up
 * from an end.  Returns 0, KVR_EINVAL (also run_len NULL with n_runs > 0), KVR_ENOENT or
 * KVR_ENOMEM (as kvr_index_remove).
 * Context: the slot's writer thread, outside a read section.
 */
int kvr_index_remove_runs(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                          const uint32_t *run_len, size_t n_runs, size_t *n_not_found);

/* Drops every block of one rank, keeps the slot.  Returns 0, KVR_EINVAL, KVR_ENOENT or
 * KVR_ENOMEM (the calling thread cannot be registered as an RCU reader: nothing cleared).
 * Context: the slot's writer thread, outside a read section. */
int kvr_index_clear_rank(struct kvr_index *idx, uint32_t slot);

/* Cleared event: every block of every dp rank of worker_id.  Returns 0, KVR_EINVAL, KVR_ENOENT
 * (no rank of that worker) or KVR_ENOMEM (as kvr_index_clear_rank: no rank cleared).  Context: the
 * writer thread of all those slots, outside a read section. */
int kvr_index_clear_worker(struct kvr_index *idx, uint64_t worker_id);

/*
 * Copy counting (events mode: vLLM can hold two physical copies of one block hash and sends one
 * BlockRemoved per copy).  When on, a store of an ext hash the rank already holds (same block)
 * adds a copy, a remove drops one copy, and the block leaves the rank when its last copy goes;
 * stored_blocks / removed_blocks / copies count copies, tree_size counts distinct blocks.
 * Off (the default, approximate modes): re-storing is a no-op and one remove drops the block;
 * switching it off drops every extra copy held (counted in removed_blocks).
 * Context: before the index is shared (right after create), or by the only writer (takes the
 * writer mutex).
 */
void kvr_index_set_count_copies(struct kvr_index *idx, bool on);

/*
 * The block locator (on by default): writers find any block by its hash through it (4-6 bytes
 * per distinct block).  Off, they find a rank's blocks next to the last one written, through the
 * run table and per-rank end maps (a word per (rank, run)), and last by a scan of the rank's
 * records (core/index_tops.c): every call keeps its results, and what it costs depends on the
 * writes' shape: chains stored below parents named by path (kvr_index_store_path) or where
 * the rank's last write ended, and removals of chain tails or heads (kvr_index_remove_runs), as
 * the approximate modes write, cost what they cost with it; a parent or block named anywhere
 * else may cost a scan of the rank's blocks (counted: kvr_index_stats.rank_scans).
 * Returns 0, KVR_EINVAL (idx NULL) or KVR_EBUSY (the index holds blocks: switch before the
 * first store).  Context: before the index is shared, or by its only writer.
 */
int kvr_index_set_locator(struct kvr_index *idx, bool on);

/*
 * For each rank holding seq[0]: its score (longest contiguous prefix of seq[0..n) it holds)
 * and tree size, into out[0..*n_out), ranks still matching at the end first.  seq[] are the
 * query's SEQUENCE hashes (kvr_hash_blocks' seq_out; a sequence hash names its whole prefix
 * and is trusted to, as Dynamo does).  opts may be NULL (no early exit).
 * Returns 0; KVR_EINVAL (idx/n_out NULL, seq NULL with n > 0, out NULL with cap > 0);
 * KVR_ERANGE when more ranks hold seq[0] than cap (then *n_out = how many; out is garbage).
 * Context: any registered thread, INSIDE kvr_rcu_read_lock(); no lock, no allocation.
 */
int kvr_index_find_matches(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                           const struct kvr_index_match_opts *opts, struct kvr_index_match *out,
                           size_t cap, size_t *n_out);

/*
 * find_matches' scores by slot, for the router's fast path: depth[slot] (caller's array, an
 * entry for every slot, ZERO on entry) is set to the score of each rank holding seq[0], 0 for
 * every other; *best = the greatest score.  The slots whose entries it wrote (those, and maybe
 * a few of score 0, some twice) are appended to slots[] (room for every slot); returns how many.
 * The caller zeroes those depth[] entries before the next call.  The scores are find_matches'
 * (no early exit) exactly; racing a writer, *best may exceed every score by what the writer
 * changed.  No argument checks (a NULL is a crash).  Context: as kvr_index_find_matches.
 */
size_t kvr_index_find_depths(const struct kvr_index *idx, const uint64_t *seq, size_t n,
                             uint32_t *depth, uint32_t *slots, uint32_t *best);

/*
 * How many runs the walk of seq[0..n) crosses when it follows the query as far as the tree
 * has it, whoever holds the blocks (find_matches stops earlier once no rank matches): what a
 * lookup of that prompt costs in run steps (one child look-up, one run header, a compare or
 * two each).  For benchmarks and the replay's diagnostics.  No argument checks.
 * Context: as kvr_index_find_matches.
 */
size_t kvr_index_path_runs(const struct kvr_index *idx, const uint64_t *seq, size_t n);

/*
 * Hands what the writers retired and have not handed to RCU yet to call_rcu now.  Writers
 * gather retired objects (runs, hash arrays, holder sets) into one batch and hand it over at
 * IDX_RETIRE_BATCH objects, so an index that goes idle after a burst of writes kept up to 255
 * of them (about 4 MB of hash arrays at worst) in its memory counter and in RSS until some later
 * write: this is the idle hook's call (the router's shards make it when idle, shards/owner_ranks.c
 * kvr_owner_shard_idle).  One mutex and at most one call_rcu; readers never see it.
 * Context: a writer thread (registered with RCU: kvr_rcu_thread_online(); an unregistered one
 * waits out a grace period here instead), outside a read section; takes the writers' mutex.
 */
void kvr_index_flush_retired(struct kvr_index *idx);
/*
 * kvr_index_flush_retired if the writers' mutex is free now, for an idle hook: true when it
 * flushed (or idx is NULL), false, nothing done, when a writer holds the mutex.  The idle hook
 * took the mutex, so an idle shard waited behind another shard's long write and was late for
 * its next message.  Leaving the batch to the holder is safe only because every writer of a
 * router's index is a shard task (bookings, events, rank changes, and timers that note their
 * removals as work: shards/owner_ranks.c), so its shard goes idle after it and flushes then;
 * the last writer finds the mutex free.  A writer that never goes idle (a test, a tool) calls
 * kvr_index_flush_retired or kvr_index_quiesce, which wait.
 * Context: as kvr_index_flush_retired, but it never waits.
 */
bool kvr_index_flush_retired_try(struct kvr_index *idx);

/*
 * Hands the writers' pending retired objects to RCU (kvr_index_flush_retired), then waits until
 * every deferred free and slot release this index queued so far has run (memory counters are
 * then exact, released slots reusable), and makes the tree sizes find_matches reports exact.
 * Polls; no rcu_barrier().
 * Context: any registered thread outside a read section, no writer of this index concurrently.
 */
void kvr_index_quiesce(struct kvr_index *idx);

/* Blocks indexed for a slot (0 for a free slot), exact (find_matches' tree_size may lag by up
 * to 1/64).  Context: any thread, relaxed read. */
uint64_t kvr_index_tree_size(const struct kvr_index *idx, uint32_t slot);

/* The external hashes the slot holds: up to cap written to out (may be NULL), the total count
 * returned (0 for a free slot).  Context: the slot's writer thread (takes the writer mutex). */
size_t kvr_index_rank_blocks(struct kvr_index *idx, uint32_t slot, uint64_t *out, size_t cap);

/* A snapshot of the counters.  Context: any thread. */
void kvr_index_stats_get(const struct kvr_index *idx, struct kvr_index_stats *st);

/* Bytes the index holds now (nodes, tables, rank sets, ext maps, slot table, the writers' store
 * scratch), each allocation
 * at the allocator's real size (its size class, core/alloc.h: a 144-byte array takes 160).
 * Context: any thread; memory retired but not yet past its grace period is still counted. */
uint64_t kvr_index_memory_bytes(const struct kvr_index *idx);

#endif /* KVR_CORE_INDEX_H */
