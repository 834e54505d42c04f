/*
 * sync/lane.h - the two-lane biased scheduler of a shard.
 *
 * Idea: every shard has two bounded MPSC rings (sync/ring.h).  The routing lane carries work on
 * a request's latency path; the maintenance lane carries work that may wait a little (eviction
 * batches, TTL expiry, reaper scans).  The consumer drains the routing lane first, but once the
 * maintenance lane is seen non-empty it starts a "starvation window": if the window lasts for
 * every_tasks routing tasks or every_ns nanoseconds (on a monotonic clock, not the router's
 * possibly virtual clock), the next task taken is a maintenance task.  A new window starts after
 * each maintenance task if the lane is still non-empty.
 *
 * Invariants (proven by tests/unit/test_shards.c and tests/stress/stress_lanes.c):
 *  - between two consecutive maintenance tasks, while the maintenance lane stays non-empty,
 *    at most every_tasks routing tasks run;
 *  - a window lasts at most every_ns plus the duration of one routing task;
 *  - when the routing lane is empty, a pending maintenance task runs at once;
 *  - each lane is FIFO per producer (routing messages are taken from the ring in bursts of up to
 *    KVR_LANE_BURST, then handed out one by one in order; they count as queued until then).
 *
 * Soft depth (routing lane; kvr_lanes_soft_check): a ring keeps its capacity as the hard bound,
 * but a producer that finds soft_depth or more messages in it holds back while the consumer is
 * making progress (its count of messages taken moves), so an overloaded consumer's lane stays
 * about soft_depth deep and what it books is fresh when the next decisions are made; once the
 * consumer has taken nothing for a stall interval (one long task, a preempted thread), the
 * producer spills into the ring's room above the soft depth instead: a stalled consumer makes
 * producers wait at most that interval, never fail while the ring has room.  The first producer
 * to see a stall marks it at the consumer's progress count; later ones spill at once until the
 * consumer takes its next message.  The waiting itself is the caller's (shards/runtime.c); this
 * file decides.
 *
 * Stats are written by the consumer only (relaxed atomic stores) and may be read anywhere,
 * except the producer-written counters marked below.
 */
#ifndef KVR_SYNC_LANE_H
#define KVR_SYNC_LANE_H

#include <stdbool.h>
#include <stdint.h>

#include "sync/ring.h"

enum kvr_lane { KVR_LANE_ROUTING = 0, KVR_LANE_MAINT = 1 };
#define KVR_LANE_COUNT 2
/* Routing messages the consumer takes from its ring at once. */
#define KVR_LANE_BURST 16

struct kvr_lanes {
	struct kvr_ring ring[KVR_LANE_COUNT];
	/* configuration */
	uint32_t every_tasks;
	uint64_t every_ns;
	uint32_t soft_depth; /* routing lane; 0 = none (kvr_lanes_set_soft_depth) */
	uint64_t (*now)(void *ctx);
	void *now_ctx;
	/* consumer state */
	uint32_t burst_head;  /* next routing message in burst[] */
	uint32_t burst_n;     /* routing messages left in burst[] (atomic: read by depth) */
	uint32_t streak;      /* routing tasks run in the current starvation window */
	uint64_t window_from; /* start of the window (now()), 0 = no window */
	/* Routing messages taken from the ring in one burst (kvr_ring_dequeue_burst), still
	 * counted as queued.  Consumer-only. */
	struct kvr_msg burst[KVR_LANE_BURST];
	/* stats: consumer-written */
	_Alignas(64) uint64_t run[KVR_LANE_COUNT];
	uint64_t maint_wait_max_ns;   /* longest starvation window closed by a maint task */
	uint32_t routing_between_max; /* most routing tasks run in one window */
	/* stats: producer-written (atomic add) */
	_Alignas(64) uint64_t stalls[KVR_LANE_COUNT];
	uint64_t throttles;  /* routing posts that waited at the soft depth */
	uint64_t spills;     /* routing posts that went past it (the consumer stalled) */
	uint64_t stall_mark; /* atomic: progress + 1 at which a producer saw a stall; 0 = none */
};

/* A producer's throttle at the soft depth, for kvr_lanes_soft_check (zero it before the first
 * check of a post). */
struct kvr_lane_soft {
	uint64_t progress; /* the consumer's messages taken, when last seen moving */
	uint64_t seen_ns;  /* when that was */
	uint64_t start_ns; /* when this post began to throttle; 0 = not yet */
};

/* What a producer at the soft depth does next (kvr_lanes_soft_check). */
enum kvr_lane_soft_step {
	KVR_SOFT_POST = 0,     /* below the soft depth: push */
	KVR_SOFT_THROTTLE = 1, /* wait a little and check again */
	KVR_SOFT_SPILL = 2,    /* the consumer stalled (or the wait hit its bound): push anyway */
};

/*
 * Initializes both rings (capacity messages each; the routing lane can hold up to
 * KVR_LANE_BURST more, taken out of its ring into the consumer's burst buffer) and the policy.  now
 * = NULL uses CLOCK_MONOTONIC.  Returns 0, KVR_EINVAL (every_tasks or every_ns 0), KVR_ERANGE,
 * KVR_ENOMEM. Context: before sharing.
 */
int kvr_lanes_init(struct kvr_lanes *l, uint32_t capacity, uint32_t every_tasks, uint64_t every_ns,
                   uint64_t (*now)(void *), void *now_ctx);

/* As kvr_lanes_init, with a capacity per lane (routing, maintenance).  Context: before
 * sharing. */
int kvr_lanes_init_sized(struct kvr_lanes *l, uint32_t routing_capacity, uint32_t maint_capacity,
                         uint32_t every_tasks, uint64_t every_ns, uint64_t (*now)(void *),
                         void *now_ctx);

/* Sets the routing lane's soft depth (0 = none: producers fill the ring).  A soft depth at or
 * above the ring's capacity is never reached before the ring is full.  Context: before
 * sharing. */
void kvr_lanes_set_soft_depth(struct kvr_lanes *l, uint32_t soft_depth);

/* True if a routing post should check the soft depth first: the lane has one and its ring holds
 * at least that many messages now (the consumer's burst, taken out of the ring, is not
 * counted: the read is the ring's own indices, which a post touches anyway).  Context: any
 * thread. */
static inline bool kvr_lanes_over_soft(const struct kvr_lanes *l, enum kvr_lane lane)
{
	return lane == KVR_LANE_ROUTING && l->soft_depth &&
	       kvr_ring_depth(&l->ring[KVR_LANE_ROUTING]) >= l->soft_depth;
}

/*
 * One look of a producer throttled at the routing lane's soft depth, at monotonic time now_ns.
 * POST: the ring is below the soft depth.  SPILL: the consumer has taken no message for
 * stall_ns of this post's looks (it is marked stalled at that count, so other producers spill
 * at once until it takes one), or one was marked already at the current count, or this post has
 * throttled max_ns in all (a bound between producers that keep refilling the lane: the consumer
 * moves but this one never finds room).  THROTTLE otherwise: wait a little, look again.  Each
 * post that throttles counts once in throttles, each that spills once in spills; *w is this
 * post's state (zeroed before its first look).  Context: any producer but the consumer.
 * Ordering: relaxed loads of the consumer's counts (a snapshot is all a guess needs).
 */
enum kvr_lane_soft_step kvr_lanes_soft_check(struct kvr_lanes *l, struct kvr_lane_soft *w,
                                             uint64_t now_ns, uint64_t stall_ns, uint64_t max_ns);

/* Messages the consumer has taken from both lanes so far (its progress).  Context: any
 * thread. */
uint64_t kvr_lanes_progress(const struct kvr_lanes *l);

/* Frees the rings.  Context: nobody uses the lanes any more. */
void kvr_lanes_fini(struct kvr_lanes *l);

/*
 * Enqueues one message on a lane (len <= KVR_MSG_PAYLOAD).  Returns 0, KVR_EINVAL (bad lane or
 * len), or KVR_EAGAIN if the lane is full (counted as a stall unless count_stall is 0).
 * Context: any thread.  Ordering: see kvr_ring_enqueue().
 */
int kvr_lanes_push(struct kvr_lanes *l, enum kvr_lane lane, void (*fn)(void), const void *payload,
                   uint32_t len, uint32_t aux, int count_stall);

/* Counts one stall on a lane (a blocking producer found it full).  Context: any thread. */
void kvr_lanes_count_stall(struct kvr_lanes *l, enum kvr_lane lane);

/*
 * Takes the next message by the biased policy into *out.  Returns the lane it came from, or -1
 * if both lanes are empty.  Context: the single consumer.
 */
int kvr_lanes_pop(struct kvr_lanes *l, struct kvr_msg *out);

/* True if both lanes are empty (a snapshot).  Context: any thread. */
int kvr_lanes_empty(const struct kvr_lanes *l);

/* Messages queued on a lane now (a snapshot).  Context: any thread. */
uint32_t kvr_lanes_depth(const struct kvr_lanes *l, enum kvr_lane lane);

#endif /* KVR_SYNC_LANE_H */
