/*
 * core/events.h - the events path's internal entry points for the outside-world adapters
 * (sync/feed.c); the public one is kvr_events_apply in kvrouter.h.
 */
#ifndef KVR_CORE_EVENTS_H
#define KVR_CORE_EVENTS_H

#include "kvrouter.h"

/*
 * Applies evs[0..n) of one rank, in order, with ONE round trip to the rank's shard (the feed
 * applies everything a drain of its sockets brought in one call, instead of a round trip per
 * event).  Each event goes through the same validation and shard function as
 * kvr_events_apply, except that KVR_EVENT_CLEARED clears this rank only (as
 * kvr_events_clear_rank); rcs (may be NULL) gets each event's result (a refused event does not
 * stop the others).  The events and what they point to are borrowed for the call.
 * Returns 0, or for the whole call KVR_ENOENT (unknown rank), KVR_EINVAL (not events mode),
 * KVR_ENOMEM (nothing applied), KVR_ESHUTDOWN.  Context: any thread.
 */
int kvr_events_apply_many(struct kvr_router *r, struct kvr_rank_id rank,
                          const struct kvr_event *evs, size_t n, int *rcs);

/*
 * Forgets every block the index holds for one rank (not the other dp ranks of its worker, as
 * a KVR_EVENT_CLEARED event does): a vLLM AllBlocksCleared from that rank's publisher, or a
 * gap or publisher restart after which the router can no longer trust what it knew.
 * Attempts, load and the event id cursor are untouched.  Returns 0, KVR_ENOENT (unknown rank),
 * KVR_EINVAL (not events mode), KVR_ESHUTDOWN.  Context: any thread; one round trip to the
 * rank's shard.
 */
int kvr_events_clear_rank(struct kvr_router *r, struct kvr_rank_id rank);

#endif /* KVR_CORE_EVENTS_H */
