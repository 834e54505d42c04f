/*
 * sync/lane.c - the biased two-lane scheduler (policy and invariants in lane.h).
 *
 * The clock is read while a starvation window is open (the maintenance lane is non-empty while
 * routing work keeps coming), and on every take when a soft depth is set (the stamp producers
 * judge a stall by), so a routing-only flood without one pays no clock reads.
 */
#include "sync/lane.h"

#include <sched.h>
#include <time.h>

#include "core/alloc.h"

static uint64_t mono_now(void *ctx)
{
	(void)ctx;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int kvr_lanes_init(struct kvr_lanes *l, uint32_t capacity, uint32_t every_tasks, uint64_t every_ns,
                   uint64_t (*now)(void *), void *now_ctx)
{
	return kvr_lanes_init_sized(l, capacity, capacity, every_tasks, every_ns, now, now_ctx);
}

int kvr_lanes_init_sized(struct kvr_lanes *l, uint32_t routing_capacity, uint32_t maint_capacity,
                         uint32_t every_tasks, uint64_t every_ns, uint64_t (*now)(void *),
                         void *now_ctx)
{
	if (!l || every_tasks == 0 || every_ns == 0)
		return KVR_EINVAL;
	memset(l, 0, sizeof(*l));
	int rc = kvr_ring_init(&l->ring[0], routing_capacity);
	if (rc)
		return rc;
	rc = kvr_ring_init(&l->ring[1], maint_capacity);
	if (rc) {
		kvr_ring_fini(&l->ring[0]);
		return rc;
	}
	l->every_tasks = every_tasks;
	l->every_ns = every_ns;
	l->now = now ? now : mono_now;
	l->now_ctx = now_ctx;
	return 0;
}

void kvr_lanes_fini(struct kvr_lanes *l)
{
	if (!l)
		return;
	kvr_ring_fini(&l->ring[0]);
	kvr_ring_fini(&l->ring[1]);
}

void kvr_lanes_count_stall(struct kvr_lanes *l, enum kvr_lane lane)
{
	__atomic_fetch_add(&l->stalls[lane], 1, __ATOMIC_RELAXED);
}

void kvr_lanes_set_soft_depth(struct kvr_lanes *l, uint32_t soft_depth)
{
	l->soft_depth = soft_depth;
}

static enum kvr_lane_soft_step spill(struct kvr_lanes *l)
{
	__atomic_fetch_add(&l->spills, 1, __ATOMIC_RELAXED);
	return KVR_SOFT_SPILL;
}

enum kvr_lane_soft_step kvr_lanes_soft_check(struct kvr_lanes *l, struct kvr_lane_soft *w,
                                             uint64_t now_ns, uint64_t stall_ns, uint64_t max_ns)
{
	if (!kvr_lanes_over_soft(l, KVR_LANE_ROUTING))
		return KVR_SOFT_POST;
	/* 0: the consumer found its lanes empty last, so it is waking up (or about to: a post
	 * woke it) rather than stuck in a task; its stall is timed from this post's first look. */
	uint64_t from = __atomic_load_n(&l->last_take_ns, __ATOMIC_RELAXED);
	if (!from)
		from = w->start_ns ? w->start_ns : now_ns;
	if (now_ns > from && now_ns - from >= stall_ns)
		return spill(l);
	if (!w->start_ns) {
		w->start_ns = now_ns ? now_ns : 1;
		__atomic_fetch_add(&l->throttles, 1, __ATOMIC_RELAXED);
		return KVR_SOFT_THROTTLE;
	}
	if (now_ns - w->start_ns >= max_ns)
		return spill(l);
	return KVR_SOFT_THROTTLE;
}

/* A routing post that reserved a slot while kvr_lanes_trim may be discarding the ring's pages
 * waits for it (a madvise: microseconds, once per idle period) before writing. */
static __attribute__((noinline, cold)) void wait_trim(struct kvr_lanes *l)
{
	for (unsigned spins = 0; __atomic_load_n(&l->trimming, __ATOMIC_ACQUIRE); spins++) {
		if (spins < 256)
			ck_pr_stall();
		else
			sched_yield();
	}
}

int kvr_lanes_push_wake(struct kvr_lanes *l, enum kvr_lane lane, void (*fn)(void),
                        const void *payload, uint32_t len, uint32_t aux, int count_stall,
                        uint32_t wake)
{
	if ((unsigned)lane >= KVR_LANE_COUNT || len > KVR_MSG_PAYLOAD || (len && !payload))
		return KVR_EINVAL;
	struct kvr_ring *r = &l->ring[lane];
	uint32_t ticket;
	struct kvr_msg *slot = kvr_ring_reserve(r, &ticket);
	if (__builtin_expect(!slot, 0)) {
		if (count_stall)
			kvr_lanes_count_stall(l, lane);
		return KVR_EAGAIN;
	}
	if (lane == KVR_LANE_ROUTING) {
		/* The reservation (ck's CAS: lock cmpxchg, a full barrier on x86) comes before
		 * this load; elsewhere a fence makes it so.  Pairs with kvr_lanes_trim. */
#if !defined(__x86_64__) && !defined(__i386__)
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
		if (__builtin_expect(__atomic_load_n(&l->trimming, __ATOMIC_ACQUIRE), 0))
			wait_trim(l);
	}
	kvr_ring_write(slot, fn, payload, len, aux);
	/* Never waits for another producer (sync/ring.h): lane posts come from every frontend. */
	return (int)kvr_ring_commit_nowait(r, ticket, wake);
}

size_t kvr_lanes_trim(struct kvr_lanes *l)
{
	struct kvr_ring *r = &l->ring[KVR_LANE_ROUTING];
	if (__atomic_load_n(&l->burst_n, __ATOMIC_RELAXED) || !kvr_ring_unreserved(r))
		return 0;
	/* Dekker with kvr_lanes_push_wake: the flag first, then p_head.  A producer whose
	 * reservation this load misses reads the flag after it. */
	__atomic_store_n(&l->trimming, 1, __ATOMIC_SEQ_CST);
	__atomic_thread_fence(__ATOMIC_SEQ_CST); /* a store then a load: x86 and ARM need it */
	size_t done = 0;
	if (kvr_ring_unreserved(r))
		done = kvr_alloc_discard(r->buf, (size_t)r->size * sizeof(struct kvr_msg));
	__atomic_store_n(&l->trimming, 0, __ATOMIC_RELEASE);
	if (done)
		__atomic_store_n(&l->trimmed_bytes, l->trimmed_bytes + done, __ATOMIC_RELAXED);
	return done;
}

static void bump(uint64_t *c)
{
	__atomic_store_n(c, __atomic_load_n(c, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
}

/* Runs when a maintenance message was taken: closes the window, opens the next one if the lane
 * is still non-empty. */
static void took_maint(struct kvr_lanes *l, uint64_t now)
{
	if (l->window_from) {
		uint64_t wait = now > l->window_from ? now - l->window_from : 0;
		if (wait > l->maint_wait_max_ns)
			__atomic_store_n(&l->maint_wait_max_ns, wait, __ATOMIC_RELAXED);
	}
	if (l->streak > l->routing_between_max)
		__atomic_store_n(&l->routing_between_max, l->streak, __ATOMIC_RELAXED);
	l->streak = 0;
	l->window_from = kvr_ring_depth(&l->ring[KVR_LANE_MAINT]) ? now : 0;
	bump(&l->run[KVR_LANE_MAINT]);
}

/* Next routing message, refilling the burst buffer from the ring when it is empty. */
static bool take_routing(struct kvr_lanes *l, struct kvr_msg *out)
{
	if (!l->burst_n) {
		uint32_t n =
		    kvr_ring_dequeue_burst(&l->ring[KVR_LANE_ROUTING], l->burst, KVR_LANE_BURST);
		if (!n)
			return false;
		l->burst_head = 0;
		__atomic_store_n(&l->burst_n, n, __ATOMIC_RELAXED);
	}
	*out = l->burst[l->burst_head++];
	__atomic_store_n(&l->burst_n, l->burst_n - 1, __ATOMIC_RELAXED);
	return true;
}

/* The stamp of a take (soft depth set): producers at the soft depth judge a stall by it. */
static void stamp(struct kvr_lanes *l, uint64_t now)
{
	if (l->soft_depth)
		__atomic_store_n(&l->last_take_ns, now ? now : l->now(l->now_ctx),
		                 __ATOMIC_RELAXED);
}

int kvr_lanes_pop(struct kvr_lanes *l, struct kvr_msg *out)
{
	struct kvr_ring *maint = &l->ring[KVR_LANE_MAINT];
	if (l->window_from || kvr_ring_depth(maint)) {
		uint64_t now = l->now(l->now_ctx);
		if (!l->window_from) {
			l->window_from = now ? now : 1;
			l->streak = 0;
		}
		uint64_t open_ns = now > l->window_from ? now - l->window_from : 0;
		if (l->streak >= l->every_tasks || open_ns >= l->every_ns) {
			if (kvr_ring_dequeue(maint, out)) {
				took_maint(l, now);
				stamp(l, now);
				return KVR_LANE_MAINT;
			}
		}
	}
	if (take_routing(l, out)) {
		if (l->window_from)
			l->streak++;
		bump(&l->run[KVR_LANE_ROUTING]);
		stamp(l, 0);
		return KVR_LANE_ROUTING;
	}
	if (kvr_ring_dequeue(maint, out)) {
		uint64_t now = l->window_from ? l->now(l->now_ctx) : 0;
		took_maint(l, now);
		stamp(l, now);
		return KVR_LANE_MAINT;
	}
	if (l->soft_depth && __atomic_load_n(&l->last_take_ns, __ATOMIC_RELAXED))
		__atomic_store_n(&l->last_take_ns, 0, __ATOMIC_RELAXED); /* idle: no stall */
	return -1;
}

int kvr_lanes_empty(const struct kvr_lanes *l)
{
	return __atomic_load_n(&l->burst_n, __ATOMIC_RELAXED) == 0 &&
	       kvr_ring_depth(&l->ring[0]) == 0 && kvr_ring_depth(&l->ring[1]) == 0;
}

int kvr_lanes_unreserved(const struct kvr_lanes *l)
{
	return __atomic_load_n(&l->burst_n, __ATOMIC_RELAXED) == 0 &&
	       kvr_ring_reserved(&l->ring[0]) == 0 && kvr_ring_reserved(&l->ring[1]) == 0;
}

uint32_t kvr_lanes_depth(const struct kvr_lanes *l, enum kvr_lane lane)
{
	if ((unsigned)lane >= KVR_LANE_COUNT)
		return 0;
	uint32_t d = kvr_ring_depth(&l->ring[lane]);
	if (lane == KVR_LANE_ROUTING)
		d += __atomic_load_n(&l->burst_n, __ATOMIC_RELAXED);
	return d;
}
