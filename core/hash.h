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

/* Sequence hashes of precomputed local hashes, chaining after *parent (NULL: a new chain). */
void kvr_hash_chain_locals(const uint64_t *parent, const uint64_t *local, size_t n,
                           uint64_t *seq_out);

#endif
