/*
 * core/events.h - the events path's internal entry points for the outside-world adapters
 * (sync/feed.c); the public one is kvr_events_apply in kvrouter.h.
 */
#ifndef KVR_CORE_EVENTS_H
#define KVR_CORE_EVENTS_H

#include "kvrouter.h"

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
