/* core/hash.h - internal forms of the block hash chain (see hash.c for the definition). */
#ifndef KVR_CORE_HASH_H
#define KVR_CORE_HASH_H

#include <stddef.h>
#include <stdint.h>

/* Hashes n_blocks complete blocks with a precomputed block seed (kvr_hash_lora_seed), chaining
 * after *parent (NULL: a new chain).  Either output may be NULL.  Context: any thread. */
void kvr_hash_chain_tokens(const uint64_t *parent, const uint32_t *tokens, size_t n_blocks,
                           uint32_t block_size, uint64_t seed, uint64_t *local_out,
                           uint64_t *seq_out);

/*
 * kvr_hash_chain_tokens for a chain handed to ANOTHER thread: the hashes go to out[] as
 * (local, seq) pairs (out[2i] = local[i], out[2i + 1] = seq[i]: the shards' struct
 * kvr_lru_block) with non-temporal stores, which write whole lines to memory without first
 * taking ownership of them, and, with ordinary stores, to local_keep and seq_keep too when not
 * NULL (the caller's warm copy, for the caller's own reads).  Why: a router
 * reuses records whose lines the booking shard has just read; an ordinary store to such a line
 * must first take it back from the shard's core, one serialized round trip per 64-byte line
 * (bench_route, frontend and shard on different cores: the hashing of an 8k-token prompt into a
 * record took 2.5x the same hashing into a warm buffer, 32k 2.3x, 128k 2.5x).  Non-temporal
 * stores skip that and, as the reader is another core, cost it nothing it was not paying (its
 * reads missed its cache either way).  Ends with a store fence: the outputs are visible to any
 * thread that reads them after a later release store of the caller (a lane post).  Other
 * architectures and sanitizer builds use ordinary stores (same results).  Context: any thread.
 */
void kvr_hash_chain_tokens_stream(const uint64_t *parent, const uint32_t *tokens, size_t n_blocks,
                                  uint32_t block_size, uint64_t seed, uint64_t *out,
                                  uint64_t *local_keep, uint64_t *seq_keep);

/* kvr_hash_chain_tokens_stream without its store fence: the caller calls
 * kvr_hash_stream_fence() before any other thread may read the outputs (before the release
 * store that hands them over, e.g. a lane post, or giving the buffer back to a shared pool).
 * Why: loads issued right after the fence wait while the streamed lines drain (AMD EPYC VM,
 * rdtsc: kvr_route's index lookup after a 2k-token prompt's hashing took 728-780 cycles right
 * after the fence, 520-544 with the fence moved after it), so kvr_route fences once it has
 * done its reads.  Context: any thread. */
void kvr_hash_chain_tokens_stream_part(const uint64_t *parent, const uint32_t *tokens,
                                       size_t n_blocks, uint32_t block_size, uint64_t seed,
                                       uint64_t *out, uint64_t *local_keep, uint64_t *seq_keep);
/* The store fence that makes kvr_hash_chain_tokens_stream_part's stores visible in order with
 * the caller's later stores (a no-op where the streamed stores are ordinary ones). */
void kvr_hash_stream_fence(void);

/* Writes chains already computed into out as (local, seq) pairs, out[2i] = local[i], out[2i+1] =
 * seq[i], with the streaming stores and the fence of kvr_hash_chain_tokens_stream, for the same
 * reason (a record the shard last read: a loop of ordinary stores took 8-24 us of a 9,000-block
 * booking's 146 KB, against 2.3-2.9 us for the two memcpy of separate arrays before).
 * Context: any thread. */
void kvr_hash_pairs_stream(const uint64_t *local, const uint64_t *seq, size_t n, uint64_t *out);
/* kvr_hash_pairs_stream without its store fence (see kvr_hash_chain_tokens_stream_part). */
void kvr_hash_pairs_stream_part(const uint64_t *local, const uint64_t *seq, size_t n,
                                uint64_t *out);

/* Sequence hashes of precomputed local hashes, chaining after *parent (NULL: a new chain). */
void kvr_hash_chain_locals(const uint64_t *parent, const uint64_t *local, size_t n,
                           uint64_t *seq_out);

#endif
