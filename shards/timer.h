/*
 * shards/timer.h - per-shard timers on the router's clock.
 *
 * Idea: a binary min-heap of timer records ordered by (deadline, id); ids grow with every add,
 * so timers with equal deadlines fire in the order they were added, which makes virtual-time
 * runs deterministic.  Records live in a slab (array + free list); a timer id carries the slab
 * index and a generation, so cancelling a fired or cancelled timer is detected (KVR_ENOENT) in
 * O(1) and a live cancel is O(log n) through the record's heap position.
 *
 * Single-threaded: only the owning shard thread touches a kvr_timers.  Callbacks may add and
 * cancel timers (also themselves) while kvr_timers_run() is firing.
 */
#ifndef KVR_SHARDS_TIMER_H
#define KVR_SHARDS_TIMER_H

#include <stdint.h>

struct kvr_shard;
typedef void (*kvr_timer_fn)(struct kvr_shard *owner, void *arg);

struct kvr_timer_rec;

struct kvr_timers {
	struct kvr_timer_rec *rec; /* slab */
	uint32_t *heap;            /* slab indices, min-heap by (deadline, seq) */
	uint32_t n_heap;
	uint32_t cap;
	uint32_t free_head; /* free list through rec[i].heap_pos, UINT32_MAX = none */
	uint64_t seq;       /* add counter: tie-break and id generation */
	uint64_t fired;
};

/* Empty timer set.  Context: the owner thread (or before it starts). */
void kvr_timers_init(struct kvr_timers *t);

/* Frees everything; pending timers are dropped without firing.  Context: the owner thread or
 * after it stopped. */
void kvr_timers_fini(struct kvr_timers *t);

/*
 * Schedules fn(owner, arg) at deadline_ns (router clock).  *id_out (if not NULL) receives an id
 * for kvr_timers_cancel(); ids are never 0 and never reused.  Returns 0 or KVR_ENOMEM, or
 * KVR_EINVAL (fn NULL).  Context: the owner thread.
 */
int kvr_timers_add(struct kvr_timers *t, uint64_t deadline_ns, kvr_timer_fn fn, void *arg,
                   uint64_t *id_out);

/* Cancels a pending timer.  Returns 0, or KVR_ENOENT if it already fired or was cancelled.
 * Context: the owner thread. */
int kvr_timers_cancel(struct kvr_timers *t, uint64_t id);

/*
 * Fires, in (deadline, add order), every timer with deadline <= now_ns, including timers that
 * callbacks add with a due deadline, but at most max_fire of them.  Returns the number fired.
 * Context: the owner thread.
 */
uint32_t kvr_timers_run(struct kvr_timers *t, uint64_t now_ns, struct kvr_shard *owner,
                        uint32_t max_fire);

/* Earliest pending deadline, or UINT64_MAX if none.  Context: the owner thread. */
uint64_t kvr_timers_next(const struct kvr_timers *t);

/* Pending timers.  Context: the owner thread. */
static inline uint32_t kvr_timers_pending(const struct kvr_timers *t)
{
	return t->n_heap;
}

#endif /* KVR_SHARDS_TIMER_H */
