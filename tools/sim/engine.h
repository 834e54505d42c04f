/*
 * tools/sim/engine.h - one simulated vLLM rank: the v1 scheduler's continuous batching over a
 * prefix-caching block pool (tools/sim/block_pool.h), in virtual time.
 *
 * A request is submitted with its prompt tokens; the engine hashes the prompt's full blocks
 * with kvrouter's own kvr_hash_blocks() (same block size as the router, so the engine's
 * hashes are the router's sequence hashes), queues it, and runs steps: each step schedules
 * running requests first (decode, or the next prefill chunk), then admits waiting requests
 * (prefix-cache hit at admission, chunked prefill), under a token budget.  A step lasts
 * step_base_ns + step_per_token_ns * scheduled tokens + step_per_kv_block_ns * the KV blocks
 * the scheduled requests' attention reads (each one's blocks up to the end of what it computes
 * in the step: what makes a GPU's decode step slower as contexts grow; 0 by default, so the
 * guide's figures stay comparable).  When blocks run out, the newest running
 * request is preempted: its blocks are freed and it recomputes later.  Output tokens extend the
 * sequence and complete new blocks, which are hashed (kvr_hash_extend) and cached.
 *
 * The engine reports KV events (stored with parent, removed, cleared) in the router's terms:
 * external hash = sequence hash, plus local hashes, plus request admission (with the cached
 * prefix it actually found), first token (TTFT) and completion, through callbacks.
 *
 * Defaults (sim_engine_config_init) and where they come from:
 *  - block_size 16: vLLM's default and the router's default.
 *  - max_batched_tokens 8192, max_num_seqs 256: vLLM v1's max_num_batched_tokens for the
 *    OpenAI server is 8192 on large GPUs; max_num_seqs 256 is vLLM's long-standing default.
 *  - step 5 ms + 0.05 ms/token: not from one published measurement; the order of magnitude
 *    of an 8B model on one H100 (~5 ms fixed decode-step overhead, ~20k prefill tokens/s).
 *  - n_blocks 8192 (131072 tokens of KV at block 16): deliberately below a real 8B/H100 pool
 *    (~29k blocks) so traces feel capacity pressure; tools/kvr-replay sets it by flag.  A
 *    request needing more blocks than the pool is refused (KVR_ERANGE): the coding-agent traces
 *    (prompts up to ~150k tokens) need n_blocks >= ~10k at block 16.
 *  Measured (throwaway driver, round robin, 8 ranks, 2-core box): the whole Mooncake
 *  conversation trace (12,031 requests, 3,543 virtual s) simulates in 1.2-2.5 s of wall time.
 *
 * Context: single-threaded; callbacks run synchronously on the caller's thread, inside
 * sim_engine_submit/advance, and must not call back into the same engine.
 */
#ifndef KVR_TOOLS_SIM_ENGINE_H
#define KVR_TOOLS_SIM_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sim_engine_config {
	uint32_t n_blocks;           /* GPU KV blocks of the rank.  Default 8192. */
	uint32_t block_size;         /* tokens per block, as the router's.  Default 16. */
	uint32_t max_batched_tokens; /* token budget per step.  Default 8192. */
	uint32_t max_num_seqs;       /* most running requests.  Default 256. */
	bool chunked_prefill;        /* split prefills over steps.  Default true (vLLM v1). */
	double step_base_ns;         /* a: fixed cost of a step, ns.  Default 5e6. */
	double step_per_token_ns;    /* b: cost per scheduled token, ns.  Default 5e4. */
	double step_per_kv_block_ns; /* c: cost per KV block read in a step, ns.  Default 0.  An
	                              * 8B model on an H100 (2 MiB of KV per 16-token block, 3.35
	                              * TB/s): ~600. */
	/* a, b, c >= 0 and the longest step they allow (a + b x max_batched_tokens + c x n_blocks)
	 * at most SIM_STEP_MAX_NS, or sim_engine_create refuses them (KVR_EINVAL): virtual time is
	 * 64-bit nanoseconds, and a step of 1e308 ns wrapped it. */
	/* false (default, vLLM): one stored event per physical copy cached and one removed
	 * event per physical copy evicted.  true: stored only for a hash's first copy, removed
	 * only when its last copy goes, so a set-semantics consumer stays exact. */
	bool dedup_events;
	uint64_t seed; /* seeds the default output tokens.  Default 0x73696d. */
	/* The free order (kvrouter.h, enum kvr_free_order): false (default) vLLM's 2026 block
	 * pool, a freed block without a hash reused first; true vLLM's of 2025, queued behind the
	 * older cached blocks (sim_pool_set_tail_first). */
	bool free_tail_first;
};

/* The longest engine step a configuration may allow: an hour of virtual time. */
#define SIM_STEP_MAX_NS 3.6e12

/* a + b x max_batched_tokens + c x n_blocks: the longest step cfg allows, ns (NaN when a step
 * time is negative or NaN). */
double sim_engine_longest_step_ns(const struct sim_engine_config *cfg);

enum sim_event_kind {
	SIM_EV_STORED = 0,  /* blocks cached, a chain extending parent_seq */
	SIM_EV_REMOVED = 1, /* blocks evicted (lazy: when reused) */
	SIM_EV_CLEARED = 2, /* every block dropped (prefix cache reset) */
};

/* A KV event.  Arrays are borrowed for the callback only. */
struct sim_kv_event {
	enum sim_event_kind kind;
	uint32_t rank;
	uint64_t time_ns;
	uint64_t event_id;     /* per rank, from 0, +1 per event */
	bool has_parent;       /* STORED: the chain's parent block is known (seq[0] not a root) */
	uint64_t parent_seq;   /* STORED: sequence hash of the block before seq[0] */
	size_t n;              /* hashes in seq (and local) */
	const uint64_t *seq;   /* external hashes = sequence hashes */
	const uint64_t *local; /* STORED and REMOVED: each block's local hash */
	uint32_t block_size;
};

/* A request as submitted.  Everything borrowed for the call (tokens are hashed, not kept). */
struct sim_request {
	uint64_t id;            /* caller's id, reported back */
	void *user;             /* caller's pointer, reported back and passed to output_token */
	const uint32_t *prompt; /* prompt_len token ids */
	uint32_t prompt_len;    /* >= 1 */
	uint32_t output_len;    /* tokens to generate; 0 is treated as 1 (vLLM max_tokens >= 1) */
};

/* Reported when a request leaves the waiting queue for the running batch. */
struct sim_admit_info {
	uint32_t rank;
	uint64_t id;
	void *user;
	uint64_t time_ns;
	uint32_t prompt_blocks; /* full blocks of the prompt */
	/* Longest cached prefix of the prompt's full blocks at admission (what a perfect router
	 * would predict), before vLLM's cap that recomputes at least the last token. */
	uint32_t cached_blocks;
	uint32_t hit_blocks;  /* blocks actually reused (cap applied; may include output blocks
	                       * after a preemption) */
	uint32_t preemptions; /* times preempted before this admission (0: first admission) */
};

/* Reported when a request completes (its last output token was sampled). */
struct sim_finish_info {
	uint32_t rank;
	uint64_t id;
	void *user;
	uint64_t arrival_ns;     /* submission time */
	uint64_t admit_ns;       /* first admission */
	uint64_t first_token_ns; /* TTFT = first_token_ns - arrival_ns */
	uint64_t finish_ns;      /* end-to-end latency = finish_ns - arrival_ns */
	uint32_t prompt_len, output_len;
	uint32_t prompt_blocks, hit_blocks; /* at first admission */
	uint32_t preemptions;
};

struct sim_callbacks {
	void *ctx; /* passed to every callback */
	void (*kv_event)(void *ctx, const struct sim_kv_event *ev);
	void (*admitted)(void *ctx, const struct sim_admit_info *info);
	void (*first_token)(void *ctx, uint32_t rank, uint64_t id, void *user, uint64_t time_ns);
	void (*finished)(void *ctx, const struct sim_finish_info *info);
	/* Output token i (from 0) of the request whose user pointer is given; NULL = a
	 * deterministic mix of (seed, request id, i).  tools/kvr-replay passes trace_output_token.
	 */
	uint32_t (*output_token)(void *user, uint64_t id, uint32_t i);
};

/* Counters of one rank since creation. */
struct sim_engine_stats {
	uint64_t steps;
	uint64_t busy_ns;        /* sum of step durations */
	uint64_t tokens;         /* scheduled tokens (prefill + decode) */
	uint64_t prefill_tokens; /* scheduled tokens that were not decode tokens */
	uint64_t submitted, admitted, finished, preemptions;
	uint64_t prompt_blocks;  /* sum over first admissions */
	uint64_t hit_blocks;     /* sum over first admissions */
	uint64_t stored_blocks;  /* block hashes cached (copies included) */
	uint64_t evicted_blocks; /* block hashes dropped (copies included) */
	uint32_t running, waiting;
	uint32_t free_blocks, cached_hashes;
};

struct sim_engine;

/* Fills cfg with the defaults above. */
void sim_engine_config_init(struct sim_engine_config *cfg);

/*
 * Creates rank `rank`'s engine.  cfg and cb are copied (cb may be NULL: no callbacks).
 * Returns 0, KVR_EINVAL (a zero size, out NULL, negative step costs), KVR_ENOMEM.
 */
int sim_engine_create(const struct sim_engine_config *cfg, uint32_t rank,
                      const struct sim_callbacks *cb, struct sim_engine **out);
/* Frees the engine and every request it still holds (no callbacks).  NULL is a no-op. */
void sim_engine_destroy(struct sim_engine *e);

/*
 * Queues a request at now_ns (>= the engine's last event time).  If the engine is idle, a step
 * is due at now_ns (scheduled by the next sim_engine_advance, so that requests submitted at the
 * same instant share the step).  Returns 0, KVR_EINVAL (bad request, time going backwards),
 * KVR_ERANGE (prompt + output needs more blocks than the pool has, or, without chunked
 * prefill, more tokens than one step's budget: it could never run),
 * KVR_ENOMEM.
 */
int sim_engine_submit(struct sim_engine *e, const struct sim_request *req, uint64_t now_ns);

/* Whether an engine configured so could ever run a request of prompt_len (> 0) and output_len
 * tokens: sim_engine_submit refuses it with KVR_ERANGE when not.  For a frontend that refuses
 * such a request before routing it.  This is the pool's bound, not vLLM's max_model_len (the
 * model's context length by default, which the API server checks; vLLM only refuses to start
 * when one max_model_len request would not fit the pool): kvr-replay --max-model-len adds that
 * check (tools/replay/replay.h). */
bool sim_engine_fits(const struct sim_engine_config *cfg, uint32_t prompt_len, uint32_t output_len);

/* When the engine next has something to do (a step to schedule or complete), or UINT64_MAX
 * when idle. */
uint64_t sim_engine_next_time(const struct sim_engine *e);

/*
 * Does the engine's next thing at sim_engine_next_time(): completes the running step
 * (outputs, first tokens, completions) and/or schedules the next one (admissions, allocation,
 * preemption, KV events).  Returns 0, KVR_ENOENT (idle), KVR_ENOMEM (the engine stays
 * consistent but the request being grown was not advanced).
 */
int sim_engine_advance(struct sim_engine *e);

/* Drops every cached hash if no request holds blocks, emitting SIM_EV_CLEARED at now_ns.
 * Returns 0 or KVR_EBUSY. */
int sim_engine_reset_cache(struct sim_engine *e, uint64_t now_ns);

/* The rank's cached (resident, hashed) sequence hashes: up to cap written, count returned. */
size_t sim_engine_cached_hashes(const struct sim_engine *e, uint64_t *out, size_t cap);
/* True if seq is cached on the rank. */
bool sim_engine_is_cached(const struct sim_engine *e, uint64_t seq);

void sim_engine_get_stats(const struct sim_engine *e, struct sim_engine_stats *out);
/* The rank's pool, read-only (tests). */
const struct sim_pool *sim_engine_pool(const struct sim_engine *e);

#endif /* KVR_TOOLS_SIM_ENGINE_H */
