/*
 * tools/replay/decisions.h - kvr-replay --decisions FILE: one line per routing decision and per
 * healing report, to trace WHY two policies' hit rates differ (issue 15: which requests lose,
 * what a healing rule evicted, whether the engine still held it).  tools/replay/decisions.py
 * reads the file.
 *
 * Lines (space-separated; appended, so several runs can share a file):
 *   R <policy> <seed> <request> <rank> <predicted> | <engine cached blocks on rank 0..n-1> |
 *     <policy's predicted overlap on rank 0..n-1, after the decision> | <prompt blocks>
 *   H <policy> <seed> <request> <rank> <blocks the report evicted> <of them still in the engine>
 * Only this router's requests (not the foreign share) of policies that predict.
 *
 * Context: the replay's thread of one run; several runs (--jobs) append under one lock.
 */
#ifndef KVR_TOOLS_REPLAY_DECISIONS_H
#define KVR_TOOLS_REPLAY_DECISIONS_H

#include <stddef.h>
#include <stdint.h>

#include "tools/replay/policy.h"
#include "tools/sim/cluster.h"

/* A decision: request `request` (trace index) went to `rank` with `predicted` blocks. */
int replay_decisions_route(const char *path, const struct replay_policy_ops *ops, void *ps,
                           struct sim_cluster *sim, uint32_t n_ranks, uint64_t seed, size_t request,
                           uint32_t rank, uint32_t predicted, const uint32_t *tokens,
                           uint32_t n_tokens, uint32_t block_size);

/* The policy's predicted blocks of `rank` (*out: malloc'd, the caller frees), before a
 * healing report. */
int replay_decisions_before(const struct replay_policy_ops *ops, void *ps, uint32_t rank,
                            uint64_t **out, size_t *n);

/* After the report: the blocks of before[0..n) the policy no longer predicts, and how many of
 * them the engine still holds.  Frees before. */
int replay_decisions_healed(const char *path, const struct replay_policy_ops *ops, void *ps,
                            struct sim_cluster *sim, uint64_t seed, size_t request, uint32_t rank,
                            uint64_t *before, size_t n);

#endif /* KVR_TOOLS_REPLAY_DECISIONS_H */
