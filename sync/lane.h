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
 * Stats are written by the consumer only (relaxed atomic stores) and may be read anywhere.
 */
#ifndef KVR_SYNC_LANE_H
#define KVR_SYNC_LANE_H

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
