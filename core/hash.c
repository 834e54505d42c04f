/*
 * core/hash.c - block hashing, bit-compatible with NVIDIA Dynamo's KV router.
 *
 * A prompt is cut into block_size-token blocks; a partial tail is not hashed (it cannot be
 * shared as a KV block).  Each block gets
 *   local[i] = XXH3_64(tokens of block i as little-endian u32, seed)   seed = 1337, or
 *              1337 + XXH3_64(lora name, 0) for a LoRA adapter (wrapping add)
 *   seq[0]   = local[0] (or XXH3_64(LE64(parent) || LE64(local[0]), 1337) when extending),
 *   seq[i]   = XXH3_64(LE64(seq[i-1]) || LE64(local[i]), 1337)
 * so one sequence hash names a whole prefix, and two prompts share sequence hashes exactly as
 * far as they share complete blocks.
 *
 * On little-endian hosts the token array already is the byte stream to hash, so we hash it in
 * place: no copy, no allocation.  Big-endian hosts byte-swap through a small stack buffer.
 */
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* Sanitizers see ordinary stores only (gcc says so with __SANITIZE_*, clang with __has_feature). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HASH_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define HASH_SANITIZED 1
#endif
#endif

#if defined(__x86_64__) && defined(__SSE2__) && !defined(HASH_SANITIZED)
#include <immintrin.h>
#define STREAM_STORE(p, v) _mm_stream_si64((long long *)(p), (long long)(v))
#define STREAM_FENCE()     _mm_sfence()
#else /* ordinary stores; the caller's release store orders them */
#define STREAM_STORE(p, v) (*(p) = (v))
#define STREAM_FENCE()     ((void)0)
#endif

#include "core/error.h"
#include "core/hash.h"
#include "kvrouter.h"

static inline uint64_t lora_seed(const char *lora_name)
{
	if (!lora_name || !lora_name[0])
		return KVR_HASH_SEED;
	return (uint64_t)KVR_HASH_SEED + XXH3_64bits_withSeed(lora_name, strlen(lora_name), 0);
}

uint64_t kvr_hash_lora_seed(const char *lora_name)
{
	return lora_seed(lora_name);
}

static inline uint64_t chain(uint64_t parent, uint64_t local)
{
	uint64_t buf[2];
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	buf[0] = parent;
	buf[1] = local;
#else
	buf[0] = __builtin_bswap64(parent);
	buf[1] = __builtin_bswap64(local);
#endif
	return XXH3_64bits_withSeed(buf, sizeof(buf), KVR_HASH_SEED);
}

static inline uint64_t block_hash(const uint32_t *tok, uint32_t block_size, uint64_t seed)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	return XXH3_64bits_withSeed(tok, (size_t)block_size * sizeof(uint32_t), seed);
#else
	XXH3_state_t st;
	uint32_t tmp[256];
	XXH3_64bits_reset_withSeed(&st, seed);
	for (uint32_t off = 0; off < block_size;) {
		uint32_t n = block_size - off < 256 ? block_size - off : 256;
		for (uint32_t j = 0; j < n; j++)
			tmp[j] = __builtin_bswap32(tok[off + j]);
		XXH3_64bits_update(&st, tmp, n * sizeof(uint32_t));
		off += n;
	}
	return XXH3_64bits_digest(&st);
#endif
}

/*
 * One pass: block i's local hash is independent of the chain, so the CPU overlaps it with the
 * latency-bound chain step of block i-1 (measured: a two-pass split was 20% slower).
 *
 * The common block sizes get a flattened copy of the loop in which XXH3's length dispatch is
 * folded away and nothing is called, so the chain value stays in a register: with a call per
 * block it was spilled to the stack and every chain step paid a store-to-load round trip.
 */
#define HASH_BODY(BLOCK_BYTES, PUT_LOCAL, PUT_SEQ)                                                 \
	do {                                                                                       \
		size_t i = 0;                                                                      \
		uint64_t prev = parent ? *parent : 0;                                              \
		if (n_blocks && !parent) { /* the chain starts with the first local hash */        \
			prev = block_hash_bytes(tokens, (BLOCK_BYTES), seed);                      \
			PUT_LOCAL(0, prev);                                                        \
			PUT_SEQ(0, prev);                                                          \
			i = 1;                                                                     \
		}                                                                                  \
		for (; i < n_blocks; i++) {                                                        \
			uint64_t local = block_hash_bytes(tokens + i * (size_t)block_size,         \
			                                  (BLOCK_BYTES), seed);                    \
			PUT_LOCAL(i, local);                                                       \
			prev = chain(prev, local);                                                 \
			PUT_SEQ(i, prev);                                                          \
		}                                                                                  \
	} while (0)

/* The stores of kvr_hash_chain_tokens / kvr_hash_blocks: either output may be NULL. */
#define PUT_LOCAL_OPT(i, v)                                                                        \
	do {                                                                                       \
		if (local_out)                                                                     \
			local_out[i] = (v);                                                        \
	} while (0)
#define PUT_SEQ_OPT(i, v)                                                                          \
	do {                                                                                       \
		if (seq_out)                                                                       \
			seq_out[i] = (v);                                                          \
	} while (0)
#define HASH_CHAIN_BODY(BLOCK_BYTES) HASH_BODY(BLOCK_BYTES, PUT_LOCAL_OPT, PUT_SEQ_OPT)

static inline uint64_t block_hash_bytes(const uint32_t *tok, size_t bytes, uint64_t seed)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	return XXH3_64bits_withSeed(tok, bytes, seed);
#else
	return block_hash(tok, (uint32_t)(bytes / 4), seed);
#endif
}

__attribute__((flatten)) static void chain_64(const uint64_t *parent, const uint32_t *tokens,
                                              size_t n_blocks, uint32_t block_size, uint64_t seed,
                                              uint64_t *local_out, uint64_t *seq_out)
{
	HASH_CHAIN_BODY(64);
}

__attribute__((flatten)) static void chain_128(const uint64_t *parent, const uint32_t *tokens,
                                               size_t n_blocks, uint32_t block_size, uint64_t seed,
                                               uint64_t *local_out, uint64_t *seq_out)
{
	HASH_CHAIN_BODY(128);
}

/* The stores of kvr_hash_chain_tokens_stream: the pairs streamed, the kept copies written as
 * well when asked for. */
#define PUT_STREAM_LOCAL(i, v)                                                                     \
	do {                                                                                       \
		STREAM_STORE(&out[2 * (i)], (v));                                                  \
		if (local_keep)                                                                    \
			local_keep[i] = (v);                                                       \
	} while (0)
#define PUT_STREAM_SEQ(i, v)                                                                       \
	do {                                                                                       \
		STREAM_STORE(&out[2 * (i) + 1], (v));                                              \
		if (seq_keep)                                                                      \
			seq_keep[i] = (v);                                                         \
	} while (0)

__attribute__((flatten)) static void stream_64(const uint64_t *parent, const uint32_t *tokens,
                                               size_t n_blocks, uint32_t block_size, uint64_t seed,
                                               uint64_t *out, uint64_t *local_keep,
                                               uint64_t *seq_keep)
{
	HASH_BODY(64, PUT_STREAM_LOCAL, PUT_STREAM_SEQ);
}

void kvr_hash_chain_tokens_stream_part(const uint64_t *parent, const uint32_t *tokens,
                                       size_t n_blocks, uint32_t block_size, uint64_t seed,
                                       uint64_t *out, uint64_t *local_keep, uint64_t *seq_keep)
{
	if (block_size == 16)
		stream_64(parent, tokens, n_blocks, block_size, seed, out, local_keep, seq_keep);
	else
		HASH_BODY((size_t)block_size * sizeof(uint32_t), PUT_STREAM_LOCAL, PUT_STREAM_SEQ);
}

void kvr_hash_stream_fence(void)
{
	STREAM_FENCE();
}

void kvr_hash_chain_tokens_stream(const uint64_t *parent, const uint32_t *tokens, size_t n_blocks,
                                  uint32_t block_size, uint64_t seed, uint64_t *out,
                                  uint64_t *local_keep, uint64_t *seq_keep)
{
	kvr_hash_chain_tokens_stream_part(parent, tokens, n_blocks, block_size, seed, out,
	                                  local_keep, seq_keep);
	STREAM_FENCE();
}

void kvr_hash_pairs_stream_part(const uint64_t *local, const uint64_t *seq, size_t n, uint64_t *out)
{
	for (size_t i = 0; i < n; i++) {
		STREAM_STORE(&out[2 * i], local[i]);
		STREAM_STORE(&out[2 * i + 1], seq[i]);
	}
}

void kvr_hash_pairs_stream(const uint64_t *local, const uint64_t *seq, size_t n, uint64_t *out)
{
	kvr_hash_pairs_stream_part(local, seq, n, out);
	STREAM_FENCE();
}

static size_t hash_chain(const uint64_t *parent, const uint32_t *tokens, size_t n_blocks,
                         uint32_t block_size, uint64_t seed, uint64_t *local_out, uint64_t *seq_out)
{
	if (block_size == 16)
		chain_64(parent, tokens, n_blocks, block_size, seed, local_out, seq_out);
	else if (block_size == 32)
		chain_128(parent, tokens, n_blocks, block_size, seed, local_out, seq_out);
	else
		HASH_CHAIN_BODY((size_t)block_size * sizeof(uint32_t));
	return n_blocks;
}

size_t kvr_hash_blocks(const uint32_t *tokens, size_t n_tokens, uint32_t block_size,
                       const char *lora_name, uint64_t *local_out, uint64_t *seq_out)
{
	if (block_size == 0 || (!tokens && n_tokens > 0))
		return 0;
	return hash_chain(NULL, tokens, n_tokens / block_size, block_size, lora_seed(lora_name),
	                  local_out, seq_out);
}

int kvr_hash_extend(const uint64_t *parent_seq, const uint32_t *tokens, size_t n_tokens,
                    uint32_t block_size, const char *lora_name, uint64_t *local_out,
                    uint64_t *seq_out, size_t *n_blocks_out)
{
	if (!n_blocks_out)
		return kvr_fail(KVR_EINVAL, "kvr_hash_extend: n_blocks_out is NULL");
	*n_blocks_out = 0;
	if (block_size == 0)
		return kvr_fail(KVR_EINVAL, "kvr_hash_extend: block_size is 0; it must be >= 1");
	if (!tokens && n_tokens > 0)
		return kvr_fail(KVR_EINVAL, "kvr_hash_extend: tokens is NULL with n_tokens %zu",
		                n_tokens);
	*n_blocks_out = hash_chain(parent_seq, tokens, n_tokens / block_size, block_size,
	                           lora_seed(lora_name), local_out, seq_out);
	return 0;
}

void kvr_hash_chain_tokens(const uint64_t *parent, const uint32_t *tokens, size_t n_blocks,
                           uint32_t block_size, uint64_t seed, uint64_t *local_out,
                           uint64_t *seq_out)
{
	hash_chain(parent, tokens, n_blocks, block_size, seed, local_out, seq_out);
}

void kvr_hash_chain_locals(const uint64_t *parent, const uint64_t *local, size_t n,
                           uint64_t *seq_out)
{
	uint64_t prev = parent ? *parent : 0;
	for (size_t i = 0; i < n; i++) {
		prev = (i == 0 && !parent) ? local[0] : chain(prev, local[i]);
		seq_out[i] = prev;
	}
}
