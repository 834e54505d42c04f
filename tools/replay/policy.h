/*
 * tools/replay/policy.h - the routing policies kvr-replay compares, behind one vtable.
 *
 * A policy is told everything a real frontend would see and nothing more: the prompt tokens
 * when it routes (route), and then what the engines report about the request it placed
 * (admitted, first token, output tokens, finished, aborted).  A policy that listens to KV
 * events (the events oracle) also gets every event of the simulated cluster (kv_event).
 * Nothing else of the simulator is visible to it, so its prediction is honest: predicted
 * overlap is what it believed at routing time, compared by the replay with the cached prefix
 * the simulator actually found at admission.
 *
 * Policies:
 *  - round_robin, random (seeded), least_loaded (fewest outstanding prompt + decode tokens as
 *    the policy itself counts them from the happenings): tools/replay/policy_basic.c; they do
 *    not predict overlap (predicts = false).
 *  - events, approx_lru, approx_ttl: the kvrouter router (tools/replay/policy_router.c).
 *
 * Handles: route() returns a 64-bit handle (the router's attempt id, or the request id); the
 * replay passes it back with every happening of that request.
 *
 * Context: single-threaded (the replay's thread); happenings arrive in virtual-time order,
 * from inside sim_cluster_run_until/drain.
 */
#ifndef KVR_TOOLS_REPLAY_POLICY_H
#define KVR_TOOLS_REPLAY_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tools/sim/engine.h"

/* What a policy is created with. */
struct replay_env {
	uint32_t n_ranks;
	uint32_t block_size;         /* router = simulator block size, tokens */
	uint32_t blocks_per_rank;    /* each rank's GPU KV blocks */
	uint32_t max_batched_tokens; /* each rank's token budget per step */
	uint64_t seed;
	/* Router settings (replay_config's; NAN = the router's default). */
	double overlap_credit, temperature, ttl_s, queue_threshold, capacity_factor;
	double prefill_load_scale;
	bool free_tail_first; /* the engines' free order (replay_config) */
	/* The simulator's virtual clock, ns. */
	uint64_t (*now_ns)(void *ctx);
	void *clock_ctx;
};

struct replay_route_req {
	uint64_t id;            /* request index in the trace */
	const uint32_t *tokens; /* prompt, borrowed */
	uint32_t n_tokens;
	uint32_t output_len; /* expected output tokens */
	uint64_t now_ns;     /* arrival (virtual) */
	uint32_t session;    /* the conversation it belongs to (the trace file) */
};

/* CPU time a policy spent, ns, cumulative since create.  The replay times route() itself on its
 * thread; these are the rest of the router's work per decision: the happenings it is told on the
 * replay's thread (lifecycle calls: first token, output, finish, abort, feedback, observations,
 * events, sync) and its own threads (a router's shards: CLOCK of each thread, split into busy
 * work and idle polling, the agreement check's introspection calls left out). */
struct replay_cpu {
	uint64_t happenings_ns;   /* replay thread, inside the policy's happening calls */
	uint64_t happenings;      /* those calls */
	uint64_t threads_busy_ns; /* the policy's own threads, less their idle polling */
	uint64_t threads_spin_ns; /* the policy's own threads' idle polling */
	/* kvr_route's stages, wall time summed over the decisions it timed (one in 16 on each
	 * thread, the agreement check's queries included): hashing, lookup (find_matches and
	 * pinned depths; with sync_booking also the wait, if any, for the work earlier calls
	 * posted), selection, admission (the booking posted). */
	uint64_t stage_ns[4], stage_n[4];
	/* A frontend that keeps each session's chain (approx_lru+chain), inside route(): checking
	 * the new prompt against the previous one, hashing (and keeping) what it adds; complete
	 * blocks reused from the previous prompt, and all routed. */
	uint64_t verify_ns, suffix_ns, kept_blocks, all_blocks;
};

struct replay_route_out {
	bool queued; /* held back: the request goes out later, through dequeue() */
	uint32_t rank;
	uint32_t predicted_blocks; /* predicted cached prefix on rank, blocks (0 if !predicts) */
	uint64_t handle;           /* passed back with every happening of this request */
};

/*
 * The vtable.  Every function returns 0 or a negative KVR_E* code; the replay counts errors
 * of happenings (policy_errors) and stops on a route() error.  Optional entries may be NULL.
 */
struct replay_policy_ops {
	const char *name;
	bool predicts;     /* predicted_blocks is meaningful */
	bool wants_events; /* kv_event is used: the simulator runs with dedup_events = true */
	bool sampled;      /* agreement sampled every sample_every (replay_samples_agreement) */
	int (*create)(const struct replay_env *env, void **state);
	void (*destroy)(void *state);
	int (*route)(void *state, const struct replay_route_req *q, struct replay_route_out *out);
	/* Happenings (optional). */
	int (*kv_event)(void *state, const struct sim_kv_event *ev);
	int (*admitted)(void *state, uint64_t handle, const struct sim_admit_info *info);
	int (*first_token)(void *state, uint64_t handle, uint32_t rank, uint64_t time_ns);
	/* A rank's engine metrics, as a frontend scraping them would see (optional): its oldest
	 * cached evictable block (has_watermark; kvrouter's sequence hash) and how many blocks
	 * hold something (resident: in use or cached).  Reported at each first admission on the
	 * rank. */
	int (*observe)(void *state, uint32_t rank, bool has_watermark, uint64_t watermark,
	               uint64_t resident);
	/* Output tokens as sampled, the final one included (a streaming frontend's view); final:
	 * the last of them is the request's final token (else it is known not to be). */
	int (*output)(void *state, uint64_t handle, const uint32_t *tokens, size_t n, bool final);
	int (*finished)(void *state, uint64_t handle, const struct sim_finish_info *info);
	/* A request route() held back (queued) was admitted: returns 1 with its id (the route
	 * request's id) and *out filled, 0 when none is ready, or an error.  Optional. */
	int (*dequeue)(void *state, uint64_t *id, struct replay_route_out *out);
	/* The simulator refused the request (it can never fit a rank). */
	int (*aborted)(void *state, uint64_t handle);
	/* Virtual time moved to now_ns: fire due timers (TTL expiry, lease reaper). */
	int (*sync)(void *state, uint64_t now_ns);
	/* Introspection for the agreement check (optional): blocks the policy believes resident
	 * on rank, and the predicted cached prefix of a chain of local block hashes on rank. */
	int (*resident)(void *state, uint32_t rank, uint64_t *blocks);
	int (*predict)(void *state, uint32_t rank, const uint64_t *local, size_t n,
	               uint32_t *overlap);
	/* The exact predicted set (optional; preferred when present): writes the rank's block
	 * hashes into a malloc'ed *out (the caller frees it) and their count into *n. */
	int (*blocks)(void *state, uint32_t rank, uint64_t **out, size_t *n);
	/* CPU time the policy spent so far, outside route() (optional): see struct replay_cpu. */
	void (*cpu)(void *state, struct replay_cpu *out);
	/* Runs the walk of the chain seq[0..n) (kvr_hash_blocks' sequence hashes) crosses in the
	 * policy's index now (optional; --path-runs). */
	size_t (*path_runs)(void *state, const uint64_t *seq, size_t n);
};

/* Baselines (policy_basic.c). */
extern const struct replay_policy_ops replay_policy_round_robin;
extern const struct replay_policy_ops replay_policy_random;
extern const struct replay_policy_ops replay_policy_least_loaded;
/* The router (policy_router.c). */
extern const struct replay_policy_ops replay_policy_events;
extern const struct replay_policy_ops replay_policy_approx_lru;
extern const struct replay_policy_ops replay_policy_approx_ttl;
extern const struct replay_policy_ops replay_policy_approx_lru_feedback;
extern const struct replay_policy_ops replay_policy_approx_lru_watermark;
/* approx_lru behind a frontend that keeps each session's hash chain and hashes only what a
 * turn adds (policy_router.c). */
extern const struct replay_policy_ops replay_policy_approx_lru_chain;
/* The events policy with its events through the real KV event feed (ZeroMQ + vLLM msgpack on
 * loopback; tools/replay/policy_feed.c, built with -Dzmq).  Not in the default list. */
extern const struct replay_policy_ops replay_policy_events_feed;
/* N approx_lru replicas, synced or not (policy_replicas.c, kvr-replay --routers N). */
extern const struct replay_policy_ops replay_policy_replicas_sync;
extern const struct replay_policy_ops replay_policy_replicas_nosync;
extern uint32_t replay_n_routers;
/* The router behind a router-backed policy's state (policy_router.c). */
struct kvr_router *replay_policy_router(void *state);

#endif /* KVR_TOOLS_REPLAY_POLICY_H */
