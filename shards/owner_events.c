/*
 * shards/owner_events.c - KV events from the engines (events mode), applied on the rank's shard:
 * the event id cursor (stale ids dropped, gaps counted and reported), then the index write.
 * The caller's thread has validated the event and computed its local hashes (core/events.c).
 */
#include "core/alloc.h"
#include "shards/owner_internal.h"

int kvr_owner_event(struct kvr_shard *sh, void *arg)
{
	kvr_owner_retry_timers(sh);
	struct kvr_event_args *a = arg;
	a->gap_to = 0;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss)
		return KVR_ENOMEM;
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own = kvr_owner_rank(c, a->slot, a->gen);
	const struct kvr_event *ev = a->ev;
	struct kvr_metrics_block *mb = kvr_owner_mb(c);
	if (!own)
		return KVR_ENOENT;
	if (ev->event_id && own->have_event && ev->event_id <= own->last_event_id) {
		kvr_metrics_add(mb, KVR_C_EV_STALE, 1);
		return KVR_ESTALE;
	}
	int rc = 0;
	switch (ev->type) {
	case KVR_EVENT_STORED:
		if (kvr_grow((void **)&ss->blk, &ss->blk_cap, ev->n_blocks ? ev->n_blocks : 1,
		             sizeof(*ss->blk)))
			return KVR_ENOMEM;
		for (size_t i = 0; i < ev->n_blocks; i++)
			ss->blk[i] = (struct kvr_index_block){.ext_hash = ev->blocks[i].ext_hash,
			                                      .local_hash = a->local[i]};
		rc =
		    kvr_index_store(c->index, a->slot, ev->has_parent ? &ev->parent_ext_hash : NULL,
		                    ss->blk, ev->n_blocks);
		if (rc == KVR_ENOENT)
			kvr_metrics_add(mb, KVR_C_EV_PARENT_NOT_FOUND, 1);
		kvr_metrics_add(mb, rc ? KVR_C_EV_STORED_ERR : KVR_C_EV_STORED_OK, 1);
		break;
	case KVR_EVENT_REMOVED: {
		size_t nf = 0;
		rc = kvr_index_remove(c->index, a->slot, ev->removed, ev->n_removed, &nf);
		kvr_metrics_add(mb, KVR_C_EV_BLOCK_NOT_FOUND, nf);
		kvr_metrics_add(mb, rc ? KVR_C_EV_REMOVED_ERR : KVR_C_EV_REMOVED_OK, 1);
		break;
	}
	case KVR_EVENT_CLEARED:
		rc = a->rank_only ? kvr_index_clear_rank(c->index, a->slot)
		                  : kvr_index_clear_worker(c->index, c->ranks[a->slot].worker_id);
		kvr_metrics_add(mb, rc ? KVR_C_EV_CLEARED_ERR : KVR_C_EV_CLEARED_OK, 1);
		break;
	default:
		return KVR_EINVAL;
	}
	/* The cursor moves only past an event that was applied or refused for good: KVR_ENOMEM
	 * changed nothing (the index takes back a failed write), so the same event may come
	 * again (oom_contracts numbered_event_out_of_memory_changes_nothing). */
	if (ev->event_id && rc != KVR_ENOMEM) {
		if (own->have_event && ev->event_id > own->last_event_id + 1) {
			own->gaps++;
			kvr_metrics_add(mb, KVR_C_EV_GAPS, 1);
			/* Reported by the caller once the call returns, not from here: the
			 * embedder may call the API from on_event_gap, and on a shard thread a
			 * call on this rank ran inline under this function (a removal freed own)
			 * and one on another shard's rank waited for that shard, which could be
			 * waiting for this one the same way (test_callbacks). */
			a->gap_from = own->last_event_id + 1;
			a->gap_to = ev->event_id;
		}
		own->have_event = true;
		own->last_event_id = ev->event_id;
	}
	kvr_owner_publish(ss, own);
	return rc;
}
