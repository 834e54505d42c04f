/*
 * kvrouter.h - the one public header of kvrouter.
 *
 * kvrouter decides which LLM inference worker rank should serve each request so that the
 * rank's KV cache already holds as much of the prompt's prefix as possible, without
 * overloading anyone.  Prompts are cut into fixed-size token blocks; each block gets a chained
 * 64-bit XXH3 hash, so one hash names one whole prefix (compatible with NVIDIA Dynamo's router).
 *
 * Conventions (see STYLE.md):
 *  - every function that can fail returns 0 (KVR_OK) or a negative KVR_E* code;
 *    kvr_strerror() explains a code.  Nothing aborts, exits or prints on bad input.
 *  - pointer parameters are borrowed for the duration of the call unless documented otherwise.
 *  - whatever the library allocates, the library frees; destroy(NULL) is a no-op.
 *  - usable from C11 and C++ (extern "C"); no third-party type appears here.
 */
#ifndef KVROUTER_H
#define KVROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) && !defined(KVR_STATIC_BUILD)
#define KVR_API __attribute__((visibility("default")))
#else
#define KVR_API
#endif

/* ---------------------------------------------------------------- version */

#define KVR_VERSION_MAJOR  0
#define KVR_VERSION_MINOR  1
#define KVR_VERSION_PATCH  0
#define KVR_VERSION_STRING "0.1.0"
/* Encoded as MAJOR*10000 + MINOR*100 + PATCH, for #if comparisons. */
#define KVR_VERSION_NUMBER (KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH)

/* The library's version string at run time (may differ from the header it was built with). */
KVR_API const char *kvr_version(void);

/* ---------------------------------------------------------------- errors */

enum kvr_error {
	KVR_OK = 0,
	KVR_EINVAL = -1,     /* an argument is invalid (NULL with a length, block size 0, ...) */
	KVR_ENOMEM = -2,     /* an allocation failed; nothing was changed */
	KVR_ENOENT = -3,     /* the named rank, attempt, parent block or object does not exist */
	KVR_ESTALE = -4,     /* stale incarnation or attempt already finished/aborted/expired */
	KVR_EAGAIN = -5,     /* a bounded queue is full; try again later */
	KVR_EEXIST = -6,     /* the object already exists (duplicate rank or attempt) */
	KVR_EBUSY = -7,      /* the object is in use or the router is shutting down */
	KVR_ERANGE = -8,     /* a value is outside its allowed range (too many ranks, too long) */
	KVR_ETIMEDOUT = -9,  /* a deadline passed before the operation could complete */
	KVR_ESHUTDOWN = -10, /* the router or shard runtime is being destroyed */
};

/* A static, human-readable message for a KVR_* code (or "unknown error"). Never NULL. */
KVR_API const char *kvr_strerror(int code);

/* ---------------------------------------------------------------- hashing */

/* Seed of every XXH3 call in the block hash chain (Dynamo compatible). */
#define KVR_HASH_SEED 1337u

/*
 * Hashes the complete blocks of a token sequence.
 *   tokens      borrowed; n_tokens token ids, each hashed as a little-endian u32.
 *   block_size  tokens per block, >= 1.  A partial tail block is ignored.
 *   lora_name   borrowed, may be NULL or "" (no adapter).  A non-empty name changes every local
 *               hash (block seed = 1337 + XXH3_64(name, seed 0)); the chain seed stays 1337.
 *   local_out   may be NULL; else n_tokens / block_size entries: each block's own hash.
 *   seq_out     may be NULL; else n_tokens / block_size entries: seq[0] = local[0],
 *               seq[i] = XXH3_64(LE64(seq[i-1]) || LE64(local[i]), 1337); names the whole prefix.
 * Returns the number of complete blocks written; 0 on bad arguments (tokens NULL with
 * n_tokens > 0, block_size 0) - use kvr_hash_extend() to get an error code.
 * Context: any thread; no allocation, no lock.
 */
KVR_API size_t kvr_hash_blocks(const uint32_t *tokens, size_t n_tokens, uint32_t block_size,
                               const char *lora_name, uint64_t *local_out, uint64_t *seq_out);

/*
 * Like kvr_hash_blocks(), but continues a chain: with parent_seq non-NULL, the first block's
 * sequence hash is XXH3_64(LE64(*parent_seq) || LE64(local[0]), 1337) - used for output tokens
 * that complete new blocks during decode.  With parent_seq NULL it starts a new chain.
 * *n_blocks_out (required) receives the number of complete blocks written.
 * Returns 0, or KVR_EINVAL (tokens NULL with n_tokens > 0, block_size 0, n_blocks_out NULL).
 * Context: any thread; no allocation, no lock.
 */
KVR_API int kvr_hash_extend(const uint64_t *parent_seq, const uint32_t *tokens, size_t n_tokens,
                            uint32_t block_size, const char *lora_name, uint64_t *local_out,
                            uint64_t *seq_out, size_t *n_blocks_out);

/* The XXH3-64 block seed for a LoRA adapter name (1337 for NULL or ""). */
KVR_API uint64_t kvr_hash_lora_seed(const char *lora_name);

/* ---------------------------------------------------------------- configuration */

/* How the index learns what each rank caches. */
enum kvr_mode {
	KVR_MODE_APPROX_LRU = 0, /* predict: capacity-bounded LRU mirroring vLLM (default) */
	KVR_MODE_APPROX_TTL = 1, /* predict: forget a routed block after ttl_ns */
	KVR_MODE_EVENTS = 2,     /* workers publish KV events (kvr_events_apply) */
};

/* Order in which queued requests are admitted when every rank is saturated. */
enum kvr_queue_policy {
	KVR_QUEUE_FCFS = 0, /* first come, first served */
	KVR_QUEUE_WSPT = 1, /* weighted shortest processing time: fewest uncached tokens first */
};

/* The router's clock: monotonic nanoseconds.  Replace it for virtual time. */
typedef uint64_t (*kvr_clock_fn)(void *ctx);

struct kvr_config {
	/* Tokens per block.  Default 16.  Range 1..65536. */
	uint32_t block_size;
	/* Shard threads.  Default 0 = one per CPU available to the process.  Max 256. */
	uint32_t n_shards;
	/* CPUs to pin shard i to (cpu_list[i % n_cpus]); borrowed, copied at create.
	 * Default NULL = CPUs of the process affinity mask, in order. */
	const int *cpu_list;
	size_t n_cpus;
	/* Where cache knowledge comes from.  Default KVR_MODE_APPROX_LRU. */
	enum kvr_mode mode;
	/* Weight of one predicted cached block against one block of prefill.  Default 1.0; >= 0. */
	double overlap_credit;
	/* Weight of prefill load against decode load.  Default 1.0; >= 0. */
	double prefill_load_scale;
	/* Selection temperature; 0 = argmin (ties uniformly at random).  Default 0; >= 0. */
	double temperature;
	/* TTL retention (approx_ttl mode, or a rank without capacity), ns.  Default 120 s. */
	uint64_t ttl_ns;
	/* Lease reaper scan interval, ns; an idle attempt expires after one to two.  Default 120 s.
	 */
	uint64_t lease_scan_interval_ns;
	/* Queue when every eligible rank's active prefill tokens exceed threshold * its max
	 * batched tokens.  Default 0 = never queue.  >= 0. */
	double queue_threshold;
	/* Admission order of queued requests.  Default KVR_QUEUE_FCFS. */
	enum kvr_queue_policy queue_policy;
	/* Bound of the waiting queue, requests.  Default 4096; >= 1. */
	uint32_t queue_capacity;
	/* Most ranks the router holds at once.  Default 4096.  Range 1..65536. */
	uint32_t max_ranks;
	/* Seed of every random choice (tie-breaks, softmax).  Default 0x6b76726f75746572. */
	uint64_t seed;
	/* Clock.  Default NULL = CLOCK_MONOTONIC.  clock_ctx is passed to it unchanged. */
	kvr_clock_fn now_ns;
	void *clock_ctx;
	/* Capacity of each shard lane ring, messages (rounded up to a power of two).
	 * Default 4096.  Range 2..1<<22. */
	uint32_t lane_capacity;
	/* Biased scheduler: run one maintenance task at least every maint_every_tasks routing
	 * tasks (default 64, >= 1) or every maint_every_ns of continuous routing work
	 * (default 200 us, >= 1). */
	uint32_t maint_every_tasks;
	uint64_t maint_every_ns;
};

/* Fills *cfg with the documented defaults.  NULL is a no-op. */
KVR_API void kvr_config_init(struct kvr_config *cfg);

/* Checks a configuration.  Returns 0 or KVR_EINVAL / KVR_ERANGE for an impossible value. */
KVR_API int kvr_config_validate(const struct kvr_config *cfg);

/* ---------------------------------------------------------------- router */

struct kvr_router;

/*
 * Creates a router.  cfg is borrowed (copied); NULL means all defaults.
 * Returns 0 and *out, or KVR_EINVAL (out NULL, bad config), KVR_ERANGE, KVR_ENOMEM.
 * Context: any thread; starts the shard threads.
 */
KVR_API int kvr_router_create(const struct kvr_config *cfg, struct kvr_router **out);

/* Stops the shard threads, frees everything.  NULL is a no-op.  No other call on this router
 * may start after destroy begins; calls already in flight get KVR_ESHUTDOWN. */
KVR_API void kvr_router_destroy(struct kvr_router *router);

/* The router's current time on its clock, ns. */
KVR_API uint64_t kvr_router_now(const struct kvr_router *router);

/* Copies the router's effective configuration (defaults resolved) into *out. */
KVR_API int kvr_router_get_config(const struct kvr_router *router, struct kvr_config *out);

#ifdef __cplusplus
}
#endif
#endif /* KVROUTER_H */
