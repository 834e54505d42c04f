/*
 * tools/replay/replay.h - replays one trace with one policy over a fresh simulated cluster
 * (tools/sim/cluster.h) and measures what the policy achieved and how well it predicted.
 *
 * The loop, per request in arrival order: run the cluster up to the arrival (its KV events,
 * admissions, first tokens, outputs and completions reach the policy as they happen), let the
 * policy's timers catch up (sync), ask it for a rank (timed with CLOCK_THREAD_CPUTIME_ID),
 * submit there.  Then drain.  Everything is a function of (trace, config, policy): the same
 * inputs give the same numbers, except the CPU/wall times.
 *
 * Agreement (sample_every > 0, policies with resident+predict): every sample_every requests
 * (just before routing the next one, when router and engines have seen the same arrivals),
 * per rank, the simulator's cached set S against the policy's predicted set R: Jaccard
 * |S n R| / |S u R| with |R| from resident() and |S n R| = blocks of S whose whole prefix the
 * policy predicts (one predict() per chain leaf of S; a block the policy holds without its
 * parent is not counted, so this is a lower bound).  With serial = true each request is
 * submitted only when the cluster is idle, and the sample is taken after every request: the
 * sets must be equal (exact_samples == samples) if the policy mirrors vLLM.  Note: predict()
 * is a query-only route, which advances the router's tie-break random stream, so sampling
 * changes which of several equal-cost ranks later requests get (not the distribution).
 */
#ifndef KVR_TOOLS_REPLAY_REPLAY_H
#define KVR_TOOLS_REPLAY_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tools/replay/policy.h"
#include "tools/trace.h"

struct replay_config {
	uint32_t n_ranks;            /* default 8 */
	uint32_t block_size;         /* router and simulator, tokens; default 16 */
	uint32_t blocks_per_rank;    /* GPU blocks per rank; 0 = replay_default_blocks() */
	uint32_t max_batched_tokens; /* default 8192 */
	double step_base_ns;         /* default 5e6 */
	double step_per_token_ns;    /* default 5e4 */
	double step_per_kv_block_ns; /* default 0 (tools/sim/engine.h) */
	double time_scale;           /* arrival times are multiplied by it; default 1 */
	uint64_t seed;               /* policies and simulator; default 1 */
	uint32_t sample_every;       /* agreement sample interval, requests; 0 = off */
	bool serial;                 /* one request at a time, agreement after each */
	uint32_t n_buckets;          /* hit rate over time; default 40 */
	/* Output tokens reach the policy every output_every * block_size tokens (and at finish),
	 * each batch ending at a sequence position 1 (mod that): see replay.c, "When a batch goes
	 * out".
	 * 1 (default) tells the router each block as it completes, like a frontend streaming
	 * tokens; larger values save router calls (each is a synchronous shard round trip). */
	uint32_t output_every;
	/* Router settings for the router-backed policies (see struct kvr_config); NAN (the
	 * default) leaves the router's own default.  ttl_s: approx_ttl retention, seconds.
	 * queue_threshold > 0 lets the router hold requests back while every rank is saturated:
	 * the replay submits a queued request when the router admits it (on_admit). */
	double overlap_credit, temperature, ttl_s, queue_threshold, prefill_load_scale;
	/* --free-order tail-first: the engines free as vLLM's 2025 block pool did, and the router
	 * is told so (kvr_config.free_order); default false, both as vLLM's 2026 one. */
	bool free_tail_first;
	/* --max-model-len: a request whose prompt + output tokens exceed it is refused before
	 * routing, as vLLM's API server refuses one over max_model_len (which defaults to the
	 * model's context length, not to the KV pool).  0 (default) = no limit but the pool. */
	uint32_t max_model_len;
	/* approx_lru registers capacity_factor x blocks_per_rank blocks per rank, while the engine
	 * has blocks_per_rank (a mis-registered capacity).  Default 1. */
	double capacity_factor;
	/* --decisions FILE: append each decision and healing report to it (decisions.h); NULL
	 * (default) = off. */
	const char *decisions;
	/* --path-runs: before each decision, count the runs the prompt's walk crosses in the
	 * router's index (policies with a path_runs hook); the walk warms the lines the decision
	 * then reads, so that run's timings are not comparable.  Default false. */
	bool path_runs;
	/* A share (0..1) of the arrivals is foreign: it reaches the engines without passing the
	 * policy (issue 15), sent as foreign_as says.  Which arrivals are foreign depends only on
	 * (seed, request index), so every mode and policy measures the same set of "this
	 * router's requests".  The results (hit_tokens, prediction, TTFT, own hit rate) count this
	 * router's requests; hit_rate counts all arrivals.  Default 0. */
	double foreign_share;
	enum replay_foreign_as {
		REPLAY_FOREIGN_CLIENTS, /* cache-unaware clients: a uniformly random rank (default)
		                         */
		/* another cache-aware router this one cannot see: foreign_ops (a fresh instance,
		 * its own state, seed + 1, the right capacity), told only its own requests */
		REPLAY_FOREIGN_ROUTER,
		/* no error: the policy under test routes the foreign share too (the baseline for
		 * the same set of this router's requests) */
		REPLAY_FOREIGN_SELF,
	} foreign_as;
	const struct replay_policy_ops *foreign_ops; /* REPLAY_FOREIGN_ROUTER; no queue */
	/* Called after each routed request (progress bar); may be NULL. */
	void (*progress)(void *ctx, size_t done, size_t total);
	void *progress_ctx;
};

struct replay_result {
	char policy[32];
	bool predicts;
	/* refused: the simulator can never fit it (refused before routing); refused_routed: of
	 * those, the ones the policy under test routed all the same (none unless the simulator
	 * and sim_engine_fits disagree): the prediction diverges after one */
	size_t n_requests, n_refused, n_refused_routed;
	size_t n_refused_len; /* of n_refused, those over max_model_len (a rank could hold them) */
	size_t n_queued;      /* held back by the router's queue (queue_threshold) */
	uint64_t prompt_tokens, hit_tokens; /* first admissions, tokens (hit: whole blocks) */
	uint64_t policy_errors;             /* happenings the policy answered with an error */
	int first_policy_error;
	uint64_t prompt_blocks, hit_blocks; /* first admissions (simulator) */
	double hit_rate;
	/* Prediction vs the simulator's cached prefix at first admission. */
	uint64_t n_pred, n_exact, n_over, n_under;
	uint64_t predicted_blocks; /* sum of predicted overlaps: the router's own hit estimate */
	double mae_blocks;
	double ttft_p50_ms, ttft_p99_ms, e2e_p50_ms, e2e_p99_ms;
	double throughput_tok_s, makespan_s;
	double imbalance_busy, imbalance_tokens; /* max / mean over ranks */
	uint64_t preemptions;
	uint64_t evicted_blocks; /* simulator, copies included */
	/* route()'s CPU time over the decisions it made (foreign arrivals make none). */
	double route_cpu_ns_mean, route_cpu_ns_p99;
	/* The rest of the router's CPU per decision (policies with a cpu hook: has_cpu): the
	 * happenings on the replay's thread, its own threads busy and idle-polling (struct
	 * replay_cpu over the decisions routed); and the floor, kvr_hash_blocks on the same
	 * prompts on the replay's thread (every policy). */
	bool has_cpu;
	double happen_cpu_ns_mean, threads_busy_ns_mean, threads_spin_ns_mean;
	double happenings_mean;  /* happening calls per decision */
	double stage_ns_mean[4]; /* kvr_route's stages (struct replay_cpu), wall, per timed one */
	/* approx_lru+chain (struct replay_cpu): per decision, part of route_cpu_ns_mean */
	double verify_ns_mean, suffix_ns_mean, kept_share;
	double hash_cpu_ns_mean;
	/* --path-runs: runs crossed per decision (mean, max); path_runs_n decisions counted. */
	double path_runs_mean;
	uint64_t path_runs_max, path_runs_n;
	/* Agreement (see above). */
	/* Arrivals in the foreign share (foreign_share), refused ones left out: those count in
	 * n_refused alone, so n_requests = this router's requests + n_foreign + n_refused. */
	uint64_t n_foreign;
	/* First admissions by share, blocks: [0] this router's requests, [1] the foreign ones
	 * (hit_rate = both together; own_hit_rate = [0]). */
	uint64_t share_prompt_blocks[2], share_hit_blocks[2];
	double own_hit_rate;
	/* This router's requests at routing time (queued ones excluded): their cached prefix on
	 * the rank chosen and on the best rank, blocks (replay_reach; best > chosen: a longer
	 * prefix was cached where the policy did not look). */
	uint64_t reach_chosen_blocks, reach_best_blocks;
	uint64_t agree_samples, agree_exact;
	uint64_t
	    agree_subset; /* samples where S is inside R (the policy holds every cached block) */
	double jaccard_mean, jaccard_min;
	uint64_t sim_cached_sum, pred_resident_sum;
	uint64_t agree_inter_sum; /* blocks both cached and predicted, summed over samples */
	/* Series: hit rate per bucket of first-admission time; sorted TTFTs. */
	uint32_t n_buckets;
	double bucket_s;
	uint64_t *bucket_prompt, *bucket_hit;
	double *ttft_ms;
	size_t n_ttft;
	/* First admissions in time order: time (s), prompt blocks, hit blocks (moving average). */
	double *adm_s;
	uint32_t *adm_prompt, *adm_hit;
	size_t n_adm;
	double wall_s;
};

void replay_config_init(struct replay_config *cfg);

/* Whether a replay of ops keeps cfg's agreement sampling: policies marked sampled (approx_lru and
 * its healing variants), and every policy with serial.  kvr-replay's sequential and --jobs /
 * --sweep paths both ask it, so they give the same results. */
bool replay_samples_agreement(const struct replay_policy_ops *ops, const struct replay_config *cfg);

/* A GPU block budget per rank that puts the trace under capacity pressure and still fits every
 * request: a quarter of the working set (the distinct prompt blocks asked for in the busiest
 * 5 minutes of trace time, at cfg's block size and time scale) spread over the ranks, but at
 * least twice the longest request (prompt + output).  why (may be NULL) gets a one-line
 * explanation. */
uint32_t replay_default_blocks(const struct trace *t, const struct replay_config *cfg, char *why,
                               size_t whylen);

/* The trace's reuse ceiling: what one unbounded prefix cache would have served.  In arrival
 * order, over the requests a replay admits (those that fit a rank and max_model_len), a prompt
 * block (cfg's block size, chained hash) is a hit when an earlier prompt held it, a miss the
 * first time; hits are a prefix capped as the engine's are (the last prompt token is always
 * computed).  Output blocks are never asked for again (their tokens are unique to a request),
 * so they add nothing.  Policy-independent: an upper bound for every policy's cached share. */
struct replay_ceiling {
	uint64_t prompt_tokens, hit_tokens; /* hit: whole blocks, as replay_result's */
	uint64_t prompt_blocks, hit_blocks;
	size_t n_requests; /* admitted (not refused) */
};
/* Returns 0, or KVR_ENOMEM. */
int replay_reuse_ceiling(const struct trace *t, const struct replay_config *cfg,
                         struct replay_ceiling *out);

/*
 * Replays t (finished, borrowed) with ops.  Returns 0 and fills *res (free with
 * replay_result_free), or a negative KVR_E* code (bad config, out of memory, a route() error)
 * with err set.
 */
int replay_run(const struct trace *t, const struct replay_policy_ops *ops,
               const struct replay_config *cfg, struct replay_result *res, char *err,
               size_t errlen);
void replay_result_free(struct replay_result *res);

#endif /* KVR_TOOLS_REPLAY_REPLAY_H */
