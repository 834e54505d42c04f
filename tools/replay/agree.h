/*
 * tools/replay/agree.h - prediction agreement: a policy's predicted cached set against the
 * simulator's, per rank (the replay's sample_every / serial check; see replay.h for what is
 * measured and when).
 */
#ifndef KVR_TOOLS_REPLAY_AGREE_H
#define KVR_TOOLS_REPLAY_AGREE_H

#include <stdint.h>

#include "tools/replay/chains.h"
#include "tools/replay/policy.h"
#include "tools/replay/replay.h"
#include "tools/sim/cluster.h"

/*
 * One agreement sample of every rank: lets the policy's timers catch up to the simulator's
 * time (ops->sync), then, per rank, compares the simulator's cached set with the policy's
 * prediction (ops->blocks when present: exact; else ops->predict per chain leaf of the
 * simulator's set, through map, and ops->resident: a lower bound) and adds the sample to res
 * (agree_*, jaccard_*, sim_cached_sum, pred_resident_sum; jaccard_mean is a sum until the
 * replay divides it).  Returns 0, KVR_ENOMEM, or the policy's error.
 * Context: the replay's thread, between simulator steps.
 */
int replay_agree(struct sim_cluster *sim, const struct replay_policy_ops *ops, void *ps,
                 struct replay_chains *map, uint32_t n_ranks, struct replay_result *res);

/*
 * Reach of one routed request (a diagnostic of what the policy could not know): its prompt's
 * cached prefix, in blocks, on the rank it was sent to (*chosen) and on the rank holding the
 * longest one (*best), read from the simulator at routing time.  best > chosen: a longer
 * prefix was cached elsewhere (e.g. put there by traffic the policy never saw).  Returns 0 or
 * KVR_ENOMEM.  Context: the replay's thread, between simulator steps.
 */
int replay_reach(struct sim_cluster *sim, uint32_t n_ranks, const uint32_t *tokens,
                 uint32_t n_tokens, uint32_t block_size, uint32_t rank, uint64_t *chosen,
                 uint64_t *best);

#endif /* KVR_TOOLS_REPLAY_AGREE_H */
