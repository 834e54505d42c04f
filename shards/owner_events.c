/*
 * shards/owner_events.c - KV events from the engines (events mode), applied on the rank's shard:
 * the event id cursor (stale ids dropped, gaps counted and reported), then the index write.
 * The caller's thread has validated the event and computed its local hashes (core/events.c).
 *
 * The stored-block bound.  In events mode the index holds what the publishers say, so a
 * publisher whose removals are lost (or a buggy or hostile one) could grow the router's memory
 * without limit.  Each rank may hold at most bound() distinct blocks: twice its registered
 * capacity plus KVR_EVENTS_BOUND_FLOOR_BLOCKS, or kvr_config.events_max_blocks without one.
 *  - Why no honest engine reaches it: vLLM queues a block's BlockRemoved when it evicts the
 *    block to reuse it (BlockPool.get_new_blocks -> _maybe_evict_cached_block), before
 *    cache_full_blocks can queue the BlockStored of its new hash, in the same event queue and
 *    so the same or an earlier batch; the feed applies batches in seq order (the replay's
 *    simulated engine emits the same order).  So a rank never holds more distinct hashes than
 *    the engine has physical blocks (copies of one hash are one block here), and a store of n
 *    blocks finds at most capacity - n held: the check below (held + n, copies counted as if
 *    new) cannot refuse an in-order stream of an engine no larger than its registration.
 *    Measured: kvr-replay --policies events,events_feed on both shipped traces never held
 *    more than the capacity (docs/measurements.md, "Events-mode memory bound").
 *  - The slack is for a capacity registered too low, not for ordering: the router's own
 *    healing expects engines a third larger than registered (tests/unit/test_heal.c), so twice
 *    the capacity tolerates that with room; the floor keeps toy capacities (1-64 blocks in
 *    tests and small setups) usable.  It costs memory only when something is wrong.
 *  - At the bound a stored event is refused whole (KVR_ERANGE; nothing applied, so the index
 *    stays a consistent set of chains), counted (kvr_events_total{status="over_bound"},
 *    kvr_event_over_bound_blocks_total), and the rank is treated as out of sync, as after a gap
 *    in its event ids: reported through on_event_gap once per episode (the refused event's id
 *    as lost: expected = its id, got = id + 1, merged with an id gap of the same event), and
 *    counted in its event_gaps and kvr_event_over_bound_episodes_total.  Refusing rather than
 *    clearing follows the gap path's contract: kvr_events_apply applies and reports, the
 *    embedder (or the feed, for its own gaps) decides how to resync (a cleared event,
 *    kvr_rank_reset); what the rank holds stays what its publisher said, nothing is dropped
 *    behind the embedder's back.  Removals and clears are never refused (they only shrink it).
 *  - An episode ends once the rank holds at most half its bound (a resync cleared it, or
 *    removals came), checked at its next store: so a publisher hovering at the bound, each
 *    removal letting one store through, is reported once, not once per store.
 *
 * A full run-id space.  The index names each run of two blocks or more that its block locator
 * tracks (blocks named by the router's own sequence hash) by an id, 2^25 - 1 of them at most
 * (~4 GB of index; core/index_blocks.c kvr_index_blk_id_new).  A store that needs one more is
 * refused whole (KVR_ERANGE from kvr_index_store, a->index_full for the caller's detail):
 * memory would not help, and the rank's bound has nothing to do with it.  The event is lost as
 * at the bound, so it is reported the same way: on_event_gap (its id, id + 1, merged with an
 * id gap of the same event), the rank's event_gaps, counted per event under
 * kvr_events_total{status="index_full"}.  Once per episode: refusals in a row are one, ended by
 * the rank's next applied store (the index had room again) or a clear or reset (a resync; a
 * cleared event of kvr_events_apply clears, and so ends, every dp rank's), so an index that stays
 * full does not call on_event_gap for every store of every rank.
 */
#include <assert.h>

#include "core/alloc.h"
#include "core/limits.h"
#include "shards/owner_internal.h"

/* The most distinct blocks the rank may hold (see the top of the file). */
static uint64_t bound(const struct kvr_owner_ctx *c, const struct kvr_rank_owned *own)
{
	uint64_t cap = own->capacity;
	if (cap == 0 || cap == KVR_CAPACITY_NONE)
		return c->events_max_blocks;
	return kvr_owner_capacity_bound(cap);
}

/* Whether a store of n blocks must be refused: the rank would hold more than its bound if each
 * block were new.  Opens an episode (true in *report) when none is open; closes the open one
 * first if the rank is back to half its bound.  O(1): one relaxed load of the tree size. */
static bool over_bound(const struct kvr_owner_ctx *c, struct kvr_rank_owned *own, size_t n,
                       bool *report)
{
	uint64_t held = kvr_index_tree_size(c->index, own->slot), b = bound(c, own);
	if (own->over_bound && held <= b / 2)
		own->over_bound = false;
	if (held <= b && n <= b - held)
		return false;
	*report = !own->over_bound;
	own->over_bound = true;
	return true;
}

/* A cleared event for the whole worker cleared every dp rank of it, and each of them is
 * resynced: each one's run-id episode ends, so its next refusal is reported again (ending the
 * named rank's alone left the others' refusals after the clear unreported), and each one's
 * snapshot is published (the caller publishes own's: the others' resident_blocks gauge kept
 * what they held before the clear until their next event).  The worker's ranks all live on
 * this shard (core/ranks.c places by worker id), so they are all in ss->ranks.
 * O(ranks of the shard), once per worker-wide clear. */
static void worker_resynced(struct kvr_shard_state *ss, const struct kvr_rank_owned *own,
                            uint64_t worker_id)
{
	const struct kvr_owner_ctx *c = ss->c;
	for (struct kvr_rank_owned *o = ss->ranks; o; o = o->next)
		if (c->ranks[o->slot].worker_id == worker_id) {
			o->index_full = false;
			if (o != own)
				kvr_owner_publish(ss, o);
		}
}

int kvr_owner_event(struct kvr_shard *sh, void *arg)
{
	kvr_owner_retry_timers(sh);
	struct kvr_event_args *a = arg;
	a->gap_to = 0;
	a->index_full = false;
	a->rank_gone = false;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss)
		return KVR_ENOMEM;
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own = kvr_owner_rank(c, a->slot, a->gen);
	const struct kvr_event *ev = a->ev;
	struct kvr_metrics_block *mb = kvr_owner_mb(c);
	if (!own) {
		/* Removed since the caller found it.  Told apart from a parent not held (also
		 * KVR_ENOENT, from the index below) for the caller's detail and the feed's log. */
		a->rank_gone = true;
		kvr_metrics_add(mb, KVR_C_EV_RANK_GONE, 1);
		return KVR_ENOENT;
	}
	if (ev->event_id && own->have_event && ev->event_id <= own->last_event_id) {
		kvr_metrics_add(mb, KVR_C_EV_STALE, 1);
		return KVR_ESTALE;
	}
	int rc = 0;
	bool report_over = false, report_lost = false;
	switch (ev->type) {
	case KVR_EVENT_STORED:
		if (over_bound(c, own, ev->n_blocks, &report_over)) {
			rc = KVR_ERANGE;
			kvr_metrics_add(mb, KVR_C_EV_STORED_OVER, 1);
			kvr_metrics_add(mb, KVR_C_EV_OVER_BLOCKS, ev->n_blocks);
			if (report_over) {
				own->gaps++;
				report_lost = true;
				kvr_metrics_add(mb, KVR_C_EV_OVER_EPISODES, 1);
			}
			break;
		}
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
		if (rc == KVR_ERANGE) { /* no run id left (see the top of the file) */
			a->index_full = true;
			kvr_metrics_add(mb, KVR_C_EV_STORED_FULL, 1);
			if (!own->index_full) {
				own->index_full = true;
				own->gaps++;
				report_lost = true;
			}
			break;
		}
		if (!rc)
			own->index_full = false;
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
		if (a->rank_only) {
			rc = kvr_index_clear_rank(c->index, a->slot);
			if (!rc)
				own->index_full = false; /* resynced: the next refusal is news */
		} else {
			rc = kvr_index_clear_worker(c->index, c->ranks[a->slot].worker_id);
			if (!rc)
				worker_resynced(ss, own, c->ranks[a->slot].worker_id);
		}
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
	if (report_lost) {
		/* The refused event is lost too: an id gap before it (set above) runs through it,
		 * else it alone; an unnumbered one reads (0, 1).  id + 1 does not wrap: UINT64_MAX
		 * is no event id (core/events.c validate). */
		assert(ev->event_id < UINT64_MAX);
		if (!a->gap_to)
			a->gap_from = ev->event_id;
		a->gap_to = ev->event_id + 1;
	}
	kvr_owner_publish(ss, own);
	return rc;
}
