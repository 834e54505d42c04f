/*
 * core/heal.c - the public calls that feed engine ground truth back into the prediction
 * (issue 15): kvr_request_cached (per request) and kvr_rank_observe (per rank).  The caller's
 * side only validates, checks the attempt's lease word (stale stays stale, as for the other
 * lifecycle calls) and finds the rank; the reconciliation runs on the rank's shard
 * (shards/owner_heal.c), with a synchronous call: this is the feedback path, not the routing
 * path, and the return code must say whether the report was applied.
 */
#include <inttypes.h>

#include "core/router_internal.h"
#include "sync/rcu.h"
#include "sync/nocancel.h"

/* The detail of a failure found below the argument checks (core/error.h): every code has one
 * cause per call here. */
static __attribute__((cold, noinline)) int heal_fail(const struct kvr_router *r, int rc,
                                                     const char *fn, uint64_t attempt,
                                                     struct kvr_rank_id rank, uint64_t value)
{
	const bool cached = attempt != 0; /* kvr_request_cached; else kvr_rank_observe */
	switch (rc) {
	case KVR_EINVAL: /* the shard's: the prompt is shorter than what the engine says */
		if (!cached)
			return kvr_fail_code(rc, fn);
		return kvr_fail(rc,
		                "%s: cached_tokens %" PRIu64 " exceeds the prompt's token count "
		                "(attempt %" PRIu64 ")",
		                fn, value, attempt);
	case KVR_ENOENT:
		if (cached)
			return kvr_fail(rc,
			                "%s: attempt %" PRIu64
			                " was not issued by this router (its "
			                "rank slot is beyond max_ranks)",
			                fn, attempt);
		return kvr_fail(rc, "%s: no rank (worker %" PRIu64 ", dp %" PRIu32 ")", fn,
		                rank.worker_id, rank.dp_rank);
	case KVR_ESTALE:
		if (cached)
			return kvr_fail(rc,
			                "%s: attempt %" PRIu64
			                " has ended (finished, aborted, expired, "
			                "or its rank was reset or removed) or was never issued",
			                fn, attempt);
		return kvr_fail(rc,
		                "%s: obs->incarnation %" PRIu64 " is not rank (worker %" PRIu64
		                ", dp %" PRIu32 ")'s current incarnation",
		                fn, value, rank.worker_id, rank.dp_rank);
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "%s: %s", fn, kvr_router_gone(r));
	case KVR_EBUSY:
		return kvr_fail(rc, "%s: %s", fn, KVR_SHARD_CYCLE_DETAIL);
	default:
		return kvr_fail_code(rc, fn);
	}
}

int kvr_request_cached(struct kvr_router *r, uint64_t attempt, uint64_t cached_tokens)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	static const char fn[] = "kvr_request_cached";
	if (!r)
		return kvr_fail(KVR_EINVAL, "%s: router is NULL", fn);
	if (attempt == 0)
		return kvr_fail(KVR_EINVAL, "%s: attempt is 0, which no decision carries", fn);
	const struct kvr_rank_id none = {0, 0};
	uint32_t slot;
	int rc = kvr_router_attempt_slot(r, attempt, &slot);
	if (rc || (rc = kvr_rcu_thread_online()))
		return heal_fail(r, rc, fn, attempt, none, cached_tokens);
	kvr_router_settle(r); /* sync_booking: the lease word as earlier calls left it */
	if (kvr_lease_touch(r->leases, attempt)) { /* claimed, ended, never issued */
		kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_STALE_CALLS, 1);
		return heal_fail(r, KVR_ESTALE, fn, attempt, none, cached_tokens);
	}
	struct kvr_heal_args a = {.attempt = attempt, .cached_tokens = cached_tokens};
	rc = kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING, kvr_owner_cached_call,
	                    &a);
	return rc ? heal_fail(r, rc, fn, attempt, none, cached_tokens) : 0;
}

int kvr_rank_observe(struct kvr_router *r, struct kvr_rank_id rank,
                     const struct kvr_rank_observation *obs)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	static const char fn[] = "kvr_rank_observe";
	if (!r || !obs)
		return kvr_fail(KVR_EINVAL, "%s: %s is NULL", fn, !r ? "router" : "obs");
	const uint32_t known = KVR_OBSERVE_RESIDENT | KVR_OBSERVE_WATERMARK;
	if ((obs->flags & known) == 0 || (obs->flags & ~known))
		return kvr_fail(KVR_EINVAL,
		                "%s: obs->flags 0x%x must have KVR_OBSERVE_RESIDENT or "
		                "KVR_OBSERVE_WATERMARK and no other bit",
		                fn, obs->flags);
	uint32_t slot;
	uint64_t gen;
	int rc = kvr_router_enter_rank(r, rank, &slot, &gen);
	if (rc)
		return heal_fail(r, rc, fn, 0, rank, obs->incarnation);
	struct kvr_heal_args a = {.slot = slot, .gen = gen, .obs = obs};
	rc = kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING, kvr_owner_observe_call,
	                    &a);
	return rc ? heal_fail(r, rc, fn, 0, rank, obs->incarnation) : 0;
}
