/*
 * core/events.h - the events path's internal entry points for the outside-world adapters
 * (sync/feed.c); the public one is kvr_events_apply in kvrouter.h.
 */
#ifndef KVR_CORE_EVENTS_H
#define KVR_CORE_EVENTS_H

#include <stdbool.h>

#include "kvrouter.h"
#include "sync/park.h"

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
 * kvr_events_apply_many without the wait: validates and hashes on the calling thread, posts the
 * events to the rank's shard and returns.  What the shard reads lives in *a (arguments, local
 * hashes) and in evs and what it points to (the caller's, untouched until
 * kvr_events_post_wait).  Tasks one thread posts to one shard lane run in order, so a later
 * post or kvr_events_clear_rank / kvr_events_apply_many of the rank runs after it.
 * Returns 0 (posted; the shard's result and each event's rc come from kvr_events_post_wait),
 * or as kvr_events_apply_many (nothing posted; rcs filled where validation ran).
 * Context: any thread but a shard's; one post in flight per struct.
 */
struct kvr_events_post {
	struct kvr_reply reply;
	bool in_flight;
	uint64_t
	    done_ns; /* CLOCK_REALTIME when the shard had applied them (kvr_events_post_wait) */
	int *rcs;
	size_t n;
	struct kvr_event_args *args;
	size_t cap_args;
	uint64_t *local;
	size_t cap_local;
	struct kvr_router *r; /* kvr_events_post_wait reports the gaps found */
	struct kvr_rank_id rank;
};
int kvr_events_post_many(struct kvr_router *r, struct kvr_rank_id rank, const struct kvr_event *evs,
                         size_t n, int *rcs, struct kvr_events_post *a);
/* Waits until a's posted events are applied (at once if nothing is in flight).  Returns 0.
 * Context: the thread that posted. */
int kvr_events_post_wait(struct kvr_events_post *a);
/* Frees a's buffers (after kvr_events_post_wait). */
void kvr_events_post_fini(struct kvr_events_post *a);

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
