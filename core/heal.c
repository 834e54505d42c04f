/*
 * core/heal.c - the public calls that feed engine ground truth back into the prediction
 * (issue 15): kvr_request_cached (per request) and kvr_rank_observe (per rank).  The caller's
 * side only validates, checks the attempt's lease word (stale stays stale, as for the other
 * lifecycle calls) and finds the rank; the reconciliation runs on the rank's shard
 * (shards/owner_heal.c), with a synchronous call: this is the feedback path, not the routing
 * path, and the return code must say whether the report was applied.
 */
#include "core/router_internal.h"
#include "sync/rcu.h"

int kvr_request_cached(struct kvr_router *r, uint64_t attempt, uint64_t cached_tokens)
{
	uint32_t slot;
	int rc = kvr_router_attempt_slot(r, attempt, &slot);
	if (rc || (rc = kvr_rcu_thread_online()))
		return rc;
	kvr_router_settle(r); /* sync_booking: the lease word as earlier calls left it */
	if (kvr_lease_touch(r->leases, attempt)) { /* claimed, ended, never issued */
		kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_STALE_CALLS, 1);
		return KVR_ESTALE;
	}
	struct kvr_heal_args a = {.attempt = attempt, .cached_tokens = cached_tokens};
	return kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING, kvr_owner_cached_call,
	                      &a);
}

int kvr_rank_observe(struct kvr_router *r, struct kvr_rank_id rank,
                     const struct kvr_rank_observation *obs)
{
	if (!r || !obs)
		return KVR_EINVAL;
	const uint32_t known = KVR_OBSERVE_RESIDENT | KVR_OBSERVE_WATERMARK;
	if ((obs->flags & known) == 0 || (obs->flags & ~known))
		return KVR_EINVAL;
	uint32_t slot;
	int rc = kvr_router_enter_rank(r, rank, &slot);
	if (rc)
		return rc;
	struct kvr_heal_args a = {.slot = slot, .gen = kvr_router_gen_of(r, slot), .obs = obs};
	return kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING,
	                      kvr_owner_observe_call, &a);
}
