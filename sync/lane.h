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
 * making progress, so an overloaded consumer's lane stays about soft_depth deep and what it
 * books is fresh when the next decisions are made; once the consumer has taken nothing for a
 * stall interval (one long task, a preempted thread), the producer spills into the ring's room
 * above the soft depth instead: a stalled consumer makes producers wait at most that interval,
 * never fail while the ring has room.  Progress is the time the consumer last took a message
 * (last_take_ns, stamped on every take while a soft depth is set: one clock read per task), so
 * a producer sees a stall at its first look, without waiting to watch for one: a lane usually
 * crosses its soft depth only after its consumer has stopped for a while (preempted on a busy
 * machine), and those posts then spill at once.  (A first version watched the consumer's count
 * of messages taken from the producer's side: every stall cost the post that found it a whole
 * stall interval, 200 us then; in bench_route at 2k tokens 0.66 % of routes paid it, nearly all
 * of them ending in a spill.)  The waiting itself is the caller's (shards/runtime.c); this file
 * decides.
 *
 * The stamp's price, measured (2026-12-01): 22-23 ns a take with a soft depth against 3.3 ns
 * without (bench_lanes' take_ns_*: a bare struct kvr_lanes, one thread, CLOCK_MONOTONIC through
 * the vDSO on a TSC clocksource), and in place 1.2 % of the shard threads' samples (perf over
 * bench_route --lengths 2048, 1 frontend, lanes ~47 deep: kvr_lanes_pop's clock reads; a 2k
 * route is a booking and a finish, 676k shard tasks per busy CPU second there: 22 ns is 1.5 %
 * of a task).  Kept, because the cheaper forms cost more than that: the TSC alone (rdtsc 9.9 ns
 * on the same VM, so ~13 ns saved) needs a calibrated invariant TSC, which the lanes'
 * replaceable clock (virtual time in tests) is not; a stamp per burst, or only while a
 * producer watches, is stale exactly when it matters (an overloaded lane is watched on every
 * take, so nothing is saved there, and a shard stopped inside a burst whose take was not
 * stamped costs the post that finds it a whole stall interval, as the first version's count
 * did).
 *
 * Idle trim (kvr_lanes_trim): a ring's indices pass through every slot, so after capacity
 * messages the whole routing ring is resident (4,096 slots of 64 B, 256 KiB a shard by default)
 * however shallow the lane stays; a router at rest kept it (bench_footprint, 8 ranks, 2k
 * prompts: 3.5 B of its ~37 B per tracked (block, rank)).  So an idle consumer gives the ring's
 * pages back (madvise(MADV_DONTNEED): they read as zeros and come back one at a time as posts
 * reach them).  A producer may reserve a slot at any moment, and a write racing the discard
 * of its page would be lost, so the two exclude each other Dekker-style: the consumer sets
 * trimming (a sequentially consistent store), then looks at p_head and discards only if no slot
 * is reserved and not yet dequeued; a producer reserves (ck's CAS, a full barrier), then reads
 * trimming and, if it is set, waits for its release before writing its slot.  Either the
 * consumer sees the reservation (and gives nothing back) or the producer sees the flag (and
 * writes after the discard).  Deeper rings cost nothing at rest this way, so the capacity
 * stays sized for a shard's stalls (core/limits.h); a busy router still holds the whole ring.
 *
 * Stats are written by the consumer only (relaxed atomic stores) and may be read anywhere,
 * except the producer-written counters marked below.
 */
#ifndef KVR_SYNC_LANE_H
#define KVR_SYNC_LANE_H

#include <stdbool.h>
#include <stddef.h>
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
	/* Atomic, consumer-written: 1 while kvr_lanes_trim may be discarding the routing ring's
	 * pages; a routing post that reserved a slot waits for 0 before writing it. */
	uint32_t trimming;
	uint64_t (*now)(void *ctx);
	void *now_ctx;
	/* consumer state, on lines of its own: producers read the configuration above on every
	 * routing post (trimming; soft_depth when paced), the consumer writes burst_n on every
	 * take */
	_Alignas(64) uint32_t burst_head; /* next routing message in burst[] */
	uint32_t burst_n;     /* routing messages left in burst[] (atomic: read by depth) */
	uint32_t streak;      /* routing tasks run in the current starvation window */
	uint64_t window_from; /* start of the window (now()), 0 = no window */
	/* Routing messages taken from the ring in one burst (kvr_ring_dequeue_burst), still
	 * counted as queued.  Consumer-only. */
	struct kvr_msg burst[KVR_LANE_BURST];
	/* stats: consumer-written */
	_Alignas(64) uint64_t run[KVR_LANE_COUNT];
	/* atomic: now() when it last took a message, 0 = it found its lanes empty since (both
	 * only while a soft depth is set) */
	uint64_t last_take_ns;
	uint64_t maint_wait_max_ns;   /* longest starvation window closed by a maint task */
	uint32_t routing_between_max; /* most routing tasks run in one window */
	uint64_t trimmed_bytes;       /* routing ring bytes given back by kvr_lanes_trim, total */
	/* stats: producer-written (atomic add) */
	_Alignas(64) uint64_t stalls[KVR_LANE_COUNT];
	uint64_t throttles; /* routing posts that waited at the soft depth */
	uint64_t spills;    /* routing posts that went past it (the consumer stalled) */
};

/* A producer's throttle at the soft depth, for kvr_lanes_soft_check (zero it before the first
 * check of a post). */
struct kvr_lane_soft {
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

/* Sets the routing lane's soft depth (0 = none: producers fill the ring, the consumer reads no
 * clock for it).  A soft depth at or above the ring's capacity is never reached before the ring
 * is full.  Context: before sharing. */
void kvr_lanes_set_soft_depth(struct kvr_lanes *l, uint32_t soft_depth);

/* True if a routing post should check the soft depth first: the lane has one and its ring holds
 * at least that many messages now.  The ring alone, without the consumer's burst (up to
 * KVR_LANE_BURST taken out of it at once): room then comes a burst at a time, so in an overload
 * one post in a burst waits about a burst of tasks and the rest go straight in, where counting
 * the burst too makes nearly every post wait about one task.  A route's p99 sees the share of
 * routes that wait more than how long the few wait (bench_route --lengths 2048, 1 thread,
 * unpaced: 0.3-1.6 % of routes waited with the ring alone, 1.0-2.6 % counting the burst, 1 and
 * 2 shards, a loaded machine).  And the ring's indices are what a post reads anyway.
 * Context: any thread. */
static inline bool kvr_lanes_over_soft(const struct kvr_lanes *l, enum kvr_lane lane)
{
	return lane == KVR_LANE_ROUTING && l->soft_depth &&
	       kvr_ring_depth(&l->ring[KVR_LANE_ROUTING]) >= l->soft_depth;
}

/*
 * One look of a producer at the routing lane's soft depth, at time now_ns of the lanes' clock
 * (now(), as the consumer stamps it).  POST: the ring is below the soft depth.  SPILL: the
 * consumer has taken no message for stall_ns (timed from this post's first look if it found
 * its lanes empty since: it is waking up), or this post has throttled max_ns in all (a
 * bound between producers that keep taking the room the consumer makes).  THROTTLE otherwise:
 * wait a little, look again.  Each post that throttles counts once in throttles, each that
 * spills once in spills; *w is this post's state (zeroed before its first look).
 * Context: any producer but the consumer.  Ordering: a relaxed load of the consumer's stamp (a
 * snapshot is all a guess needs; a stamp newer than now_ns is no stall).
 */
enum kvr_lane_soft_step kvr_lanes_soft_check(struct kvr_lanes *l, struct kvr_lane_soft *w,
                                             uint64_t now_ns, uint64_t stall_ns, uint64_t max_ns);

/*
 * Gives the routing ring's pages back to the system if no routing message is queued, reserved
 * or in the consumer's burst (see "Idle trim" above); a routing post that comes meanwhile waits
 * for the discard (a madvise of up to the ring's size) before it writes its slot.  Returns the
 * bytes given back, 0 if the lane was not empty.  Context: the single consumer, when idle (the
 * shard runtime calls it with its idle purge).  Ordering: a sequentially consistent store of
 * trimming, then p_head; pairs with the producer's CAS and load of trimming in
 * kvr_lanes_push_wake; the store that clears trimming (release) pairs with that load (acquire).
 */
size_t kvr_lanes_trim(struct kvr_lanes *l);

/* Frees the rings.  Context: nobody uses the lanes any more. */
void kvr_lanes_fini(struct kvr_lanes *l);

/*
 * Enqueues one message on a lane (len <= KVR_MSG_PAYLOAD).  wake (0 .. KVR_RING_WAKE_MAX) is how
 * urgently the caller will wake the consumer after the push, larger is more urgent: if the
 * commit must leave the slot to an earlier producer's commit, whoever publishes it learns that
 * level (sync/ring.h: the wake a tagged slot needs).  Returns the highest level among the other
 * producers' slots this push's commit published (0 if none; the caller must wake the consumer at
 * least that urgently), or KVR_EINVAL (bad lane or len), or KVR_EAGAIN if the lane is full
 * (counted as a stall unless count_stall is 0).  The level is returned, not stored through a
 * pointer, because this is every post's path (a pointer cost the post ~5 instructions).
 * Context: any thread.  Ordering: see kvr_ring_commit_nowait(); the push ends with a locked RMW
 * (kvr_barrier_after_rmw).
 */
int kvr_lanes_push_wake(struct kvr_lanes *l, enum kvr_lane lane, void (*fn)(void),
                        const void *payload, uint32_t len, uint32_t aux, int count_stall,
                        uint32_t wake);

/* Enqueues one message on a lane for a consumer nobody wakes (a bare struct kvr_lanes: tests,
 * benches): kvr_lanes_push_wake, returning 0 instead of a level.  Returns 0, KVR_EINVAL,
 * KVR_EAGAIN. */
static inline int kvr_lanes_push(struct kvr_lanes *l, enum kvr_lane lane, void (*fn)(void),
                                 const void *payload, uint32_t len, uint32_t aux, int count_stall)
{
	int rc = kvr_lanes_push_wake(l, lane, fn, payload, len, aux, count_stall, 0);
	return rc < 0 ? rc : 0;
}

/* Counts one stall on a lane (a blocking producer found it full).  Context: any thread. */
void kvr_lanes_count_stall(struct kvr_lanes *l, enum kvr_lane lane);

/*
 * Takes the next message by the biased policy into *out.  Returns the lane it came from, or -1
 * if both lanes are empty.  Context: the single consumer.
 */
int kvr_lanes_pop(struct kvr_lanes *l, struct kvr_msg *out);

/* True if both lanes are empty (a snapshot).  Context: any thread. */
int kvr_lanes_empty(const struct kvr_lanes *l);

/* True if no slot of either lane is reserved (a snapshot): empty, and no post in flight, nor
 * one whose commit was left tagged behind an earlier producer's reservation (its post returned,
 * and the message is not in kvr_lanes_empty's count until that producer commits).  Context:
 * any thread. */
int kvr_lanes_unreserved(const struct kvr_lanes *l);

/* Messages queued on a lane now (a snapshot).  Context: any thread. */
uint32_t kvr_lanes_depth(const struct kvr_lanes *l, enum kvr_lane lane);

#endif /* KVR_SYNC_LANE_H */
