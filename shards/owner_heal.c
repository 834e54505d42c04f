/*
 * shards/owner_heal.c - engine ground truth applied on the rank's shard (issue 15): a request's
 * cached-token report and a rank's observations reconcile the predicted cache (shards/lru.h's
 * healing rules, through shards/rank_state.h's fencing), and the index follows.
 *
 * Why on the shard: the predicted cache, the attempt records and the rank's index entries are
 * owned by the rank's shard thread (ARCHITECTURE.md); the caller (core/heal.c) reaches it with
 * a synchronous call on the routing lane, which is FIFO behind the attempt's booking, so a
 * report made right after kvr_route returned finds the attempt booked.
 */
#include <string.h>

#include "shards/owner_internal.h"
#include "shards/rank_state.h"

static struct kvr_attempt *find_attempt(struct kvr_shard_state *ss, uint64_t attempt)
{
	uint32_t *i = kvr_u64map_find(&ss->by_id, attempt);
	return i ? ss->recs[*i] : NULL;
}

/* Blocks the prediction holds for the rank's attempts whose prefill has not finished (no first
 * token or output reported): the engine has not allocated them yet (see kvr_lru_heal_resident).
 * O(live attempts on the rank). */
static uint64_t unallocated(const struct kvr_rank_owned *own)
{
	uint64_t n = 0;
	for (const struct kvr_attempt *a = own->attempts; a; a = a->next)
		if (a->booked && a->in_prefill && a->incarnation == own->incarnation)
			n +=
			    kvr_rank_state_lease_unallocated(own->rs, own->incarnation, a->attempt);
	return n;
}

int kvr_owner_cached_call(struct kvr_shard *sh, void *arg)
{
	struct kvr_heal_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss)
		return KVR_ENOMEM;
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_attempt *rec = find_attempt(ss, a->attempt);
	if (!rec)
		return KVR_ESTALE; /* ended, expired, or its rank reset or removed */
	if (a->cached_tokens > rec->prompt_tokens)
		return KVR_EINVAL;
	struct kvr_rank_owned *own = c->ranks[rec->slot].own;
	struct kvr_metrics_block *mb = kvr_owner_mb(c);
	if (!own || !own->rs || !rec->booked || rec->incarnation != own->incarnation)
		return 0; /* events mode, or no prediction holds the attempt: nothing to heal */
	uint64_t depth = a->cached_tokens / c->block_size;
	if (depth > rec->n_prompt)
		depth = rec->n_prompt;
	/* The other attempts' blocks the engine has not allocated (see lru_cap.c). */
	uint64_t unalloc = unallocated(own);
	if (rec->in_prefill)
		unalloc -=
		    kvr_rank_state_lease_unallocated(own->rs, own->incarnation, rec->attempt);
	struct kvr_lru_heal res;
	int rc = kvr_rank_state_heal_cached(own->rs, own->incarnation, rec->attempt,
	                                    (uint32_t)depth, unalloc, &res, &ss->out);
	if (rc == KVR_ENOENT)
		return 0; /* the prediction lost the lease (capacity moved to none): nothing to do
		           */
	if (rc)
		return rc;
	kvr_metrics_add(mb, KVR_C_HEAL_FEEDBACK, 1);
	/* TTL mode has no hit depth: the decision's overlap is the prediction there. */
	uint64_t predicted =
	    kvr_rank_state_mode(own->rs) == KVR_RANK_LRU ? res.predicted : rec->overlap;
	if (depth < predicted)
		kvr_metrics_add(mb, KVR_C_HEAL_OVER, 1);
	else if (depth > predicted)
		kvr_metrics_add(mb, KVR_C_HEAL_UNDER, 1);
	if (res.unprovable)
		kvr_metrics_add(mb, KVR_C_HEAL_UNPROVABLE, 1);
	if (res.evicted || ss->out.n_evicted) {
		kvr_metrics_add(mb, KVR_C_HEAL_EVICTED, ss->out.n_evicted);
		kvr_owner_apply_removals(ss, own, &ss->out);
		kvr_owner_publish(ss, own);
	}
	return 0;
}

int kvr_owner_observe_call(struct kvr_shard *sh, void *arg)
{
	struct kvr_heal_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss)
		return KVR_ENOMEM;
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own = kvr_owner_rank(c, a->slot, a->gen);
	if (!own)
		return KVR_ENOENT;
	const struct kvr_rank_observation *obs = a->obs;
	if (obs->incarnation != own->incarnation)
		return KVR_ESTALE; /* numbers about another life of the rank */
	struct kvr_metrics_block *mb = kvr_owner_mb(c);
	kvr_metrics_add(mb, KVR_C_HEAL_OBSERVE, 1);
	if (!own->rs)
		return 0; /* events mode */
	uint64_t evicted = 0, ev = 0;
	int rc;
	if (obs->flags & KVR_OBSERVE_WATERMARK) {
		rc = kvr_rank_state_heal_watermark(own->rs, own->incarnation, obs->watermark_hash,
		                                   &ev, &ss->out);
		if (rc == KVR_ENOENT) {
			kvr_metrics_add(mb, KVR_C_HEAL_WM_UNKNOWN, 1);
		} else if (rc) {
			return rc;
		} else {
			evicted += ss->out.n_evicted;
			kvr_owner_apply_removals(ss, own, &ss->out);
		}
	}
	if (obs->flags & KVR_OBSERVE_RESIDENT) {
		bool raised = false;
		rc = kvr_rank_state_heal_resident(own->rs, own->incarnation, obs->resident_blocks,
		                                  unallocated(own), &ev, &raised, &ss->out);
		if (rc) {
			/* The watermark part stays applied (it was true on its own), and is
			 * published as on success: before, its evictions waited for the rank's
			 * next publish to show in the decisions' view. */
			if (evicted) {
				kvr_metrics_add(mb, KVR_C_HEAL_EVICTED, evicted);
				kvr_owner_publish(ss, own);
			}
			return rc;
		}
		if (raised)
			kvr_metrics_add(mb, KVR_C_HEAL_CAP_RAISED, 1);
		evicted += ss->out.n_evicted;
		kvr_owner_apply_removals(ss, own, &ss->out);
	}
	if (evicted)
		kvr_metrics_add(mb, KVR_C_HEAL_EVICTED, evicted);
	kvr_owner_publish(ss, own);
	return 0;
}
