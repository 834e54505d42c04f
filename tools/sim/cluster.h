/*
 * tools/sim/cluster.h - N simulated vLLM ranks (tools/sim/engine.h) on one virtual clock, the
 * cluster that tools/kvr-replay routes a trace onto.
 *
 * The caller drives time by arrivals: for each request, sim_cluster_run_until(arrival) runs
 * every step boundary strictly before the arrival (in time order, ties by rank), delivering
 * KV events, admissions, first tokens and completions through the callbacks; the caller then
 * asks its router for a rank (at the arrival time, having seen everything before it) and calls
 * sim_cluster_submit().  sim_cluster_drain() runs the rest.  Requests arriving at the same
 * instant share the step they start.  No randomness: the same calls give the same outputs
 * (the seed only picks default output tokens).
 *
 * Defaults: n_ranks 8; engine defaults as in tools/sim/engine.h.
 * Context: single-threaded; callbacks run on the caller's thread inside run_until / drain /
 * reset_cache and must not call back into the cluster except the read-only queries
 * (sim_cluster_now, sim_cluster_cached_hashes, sim_cluster_is_cached, sim_cluster_stats).
 */
#ifndef KVR_TOOLS_SIM_CLUSTER_H
#define KVR_TOOLS_SIM_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tools/sim/engine.h"

struct sim_cluster_config {
	uint32_t n_ranks;                /* Default 8.  Range 1..65536. */
	struct sim_engine_config engine; /* every rank alike */
};

struct sim_cluster;

void sim_cluster_config_init(struct sim_cluster_config *cfg);

/* cfg and cb are copied (cb may be NULL).  Returns 0, KVR_EINVAL, KVR_ERANGE, KVR_ENOMEM. */
int sim_cluster_create(const struct sim_cluster_config *cfg, const struct sim_callbacks *cb,
                       struct sim_cluster **out);
/* NULL is a no-op. */
void sim_cluster_destroy(struct sim_cluster *c);

/* Current virtual time, ns (starts at 0). */
uint64_t sim_cluster_now(const struct sim_cluster *c);
/* Time of the next step boundary on any rank, or UINT64_MAX when all are idle. */
uint64_t sim_cluster_next_time(const struct sim_cluster *c);

/*
 * Runs every step boundary with time < t_ns, in time order (ties: lower rank first), then sets
 * the clock to t_ns.  t_ns below the clock is KVR_EINVAL.  Returns 0 or the first error of an
 * engine (KVR_ENOMEM).
 */
int sim_cluster_run_until(struct sim_cluster *c, uint64_t t_ns);
/* Runs the single next step boundary.  Returns 0 or KVR_ENOENT when all ranks are idle. */
int sim_cluster_step(struct sim_cluster *c);
/* Runs until every rank is idle (every submitted request finished). */
int sim_cluster_drain(struct sim_cluster *c);

/* Submits req to rank at the current time.  Returns 0, KVR_ENOENT (no such rank), or the
 * engine's error (KVR_EINVAL, KVR_ERANGE: can never fit the rank's pool, KVR_ENOMEM). */
int sim_cluster_submit(struct sim_cluster *c, uint32_t rank, const struct sim_request *req);

/* Prefix-cache reset on a rank with nothing running (SIM_EV_CLEARED).  0, KVR_ENOENT,
 * KVR_EBUSY. */
int sim_cluster_reset_cache(struct sim_cluster *c, uint32_t rank);

/* The rank's cached (resident, hashed) sequence hashes: up to cap written to out, the count
 * returned (0 for a bad rank).  Compare with the router's prediction for the rank. */
size_t sim_cluster_cached_hashes(const struct sim_cluster *c, uint32_t rank, uint64_t *out,
                                 size_t cap);
bool sim_cluster_is_cached(const struct sim_cluster *c, uint32_t rank, uint64_t seq);
/* Returns 0 or KVR_ENOENT. */
int sim_cluster_stats(const struct sim_cluster *c, uint32_t rank, struct sim_engine_stats *out);
uint32_t sim_cluster_n_ranks(const struct sim_cluster *c);
/* The rank's engine, read-only (tests); NULL for a bad rank. */
const struct sim_engine *sim_cluster_engine(const struct sim_cluster *c, uint32_t rank);

#endif /* KVR_TOOLS_SIM_CLUSTER_H */
