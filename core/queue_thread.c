/*
 * core/queue_thread.c - the router's admission thread: the admission pass (kvr_queue_pump) for
 * load the shards lower by themselves.
 *
 * Queued requests are admitted by a pass that frontend threads run inside the calls that route
 * or change ranks (rank changes, kvr_router_sync), and by this thread.  The load that lets a
 * request in is lowered on a shard, after the call that asked for it returned: a lifecycle
 * call's posted work (finish, abort, prefill done, an output that ends the prefill; none of them
 * waits for its shard, a router that queues included), a lease expiry (an attempt that
 * vanished), the end of an attempt whose ending call's work never came, a booking dropped for
 * memory, a step of the prefill decay (expected_prefill_ns).  With nothing else happening the
 * request then waited on an idle rank until the embedder's next call, for good on a quiet
 * system.  The shard cannot run the pass itself: the pass takes the queue's mutex and runs
 * on_admit, and a frontend that holds a lock on_admit wants may be waiting for that very shard
 * (a synchronous call such as kvr_rank_get_stats).  So the shard's hook
 * (kvr_owner_ctx.on_unloaded) only raises a flag and wakes this thread, which runs the pass as
 * any frontend would.
 *
 * The wake is a Dekker pair twice over.  Against a route: the shard publishes the lowered load,
 * fences and reads the queue's depth; a route pushes, fences (kvr_queue_catch_up) and reads the
 * load in its pass; one of them sees the other, so either the route admits the request itself or
 * the hook sees it queued.  Against the thread's park: the hook stores `wanted` and then
 * kvr_parker_wake (full barrier, loads the state); the thread announces its park (full barrier)
 * and then reads `wanted` (sync/park.h).  The hook never blocks, allocates or takes a lock: a
 * fence, a load, and with requests queued a store and a FUTEX_WAKE only when the thread sleeps.
 *
 * It also reclaims a failed admission nobody collects once it is due (two lease scan intervals
 * after it failed, core/queue.c): a pass that keeps one raises `failed` and wakes it, and while
 * one waits the thread parks with a timeout (REAP_PARK_MAX_NS at most), reading the clock again
 * after each; nothing else came back for it on an idle router, where it stayed for good.
 *
 * Started only for a router with a queue (kvr_config.queue_threshold > 0): a router without one
 * installs no hook and has no thread.  Shutdown: kvr_router_destroy sets the router's shutdown
 * flag and waits for a call on every shard, after which no hook runs past its shutdown check,
 * then stops and joins this thread before the queue goes.  The thread runs with
 * kvr_router_cb_self set (as a feed's and a replica's threads do): a destroy from its on_admit
 * or clock returns at once instead of joining the thread that calls it.
 */
#include <stdbool.h>
#include <sys/prctl.h>

#include "core/router_internal.h"
#include "sync/rcu.h"
#include "sync/thread.h"

/* The longest park while a failed outcome waits for its reclaim: the router clock may be
 * virtual (kvr_config.now_ns), and only reading it again tells how far it moved.  As the
 * shards' own timers do (shards/runtime.c, PARK_MAX_NS). */
#define REAP_PARK_MAX_NS 1000000000ull
/* The shortest park, and the one while a due one is held or watched (its holder collects it at
 * once): a reclaim this late costs nothing, and a virtual clock stopped just short of the due
 * time (a paused simulation) made the thread park for the few ns left, again and again (probe:
 * 1 us short, ~12,000 wakes and ~20% of a core per second). */
#define REAP_HELD_NS 1000000ull

/* How long to park for a failed outcome due at due (router clock), read at now; prev_now and
 * prev_park are the previous reap's clock and park (UINT64_MAX: none).  A clock that did not
 * move over a whole park is virtual and stopped: the park doubles (to REAP_PARK_MAX_NS), as
 * its gap says nothing of when it moves again. */
static uint64_t reap_park_ns(uint64_t due, uint64_t now, uint64_t prev_now, uint64_t prev_park)
{
	uint64_t p = due <= now ? REAP_HELD_NS : due - now;
	p = p < REAP_HELD_NS ? REAP_HELD_NS : p;
	if (prev_park != UINT64_MAX && now == prev_now && p < 2 * prev_park)
		p = 2 * prev_park;
	return p < REAP_PARK_MAX_NS ? p : REAP_PARK_MAX_NS;
}

_Thread_local const struct kvr_router *kvr_admitter_of;

static void *admitter_main(void *arg)
{
	struct kvr_router *r = arg;
	struct kvr_admitter *a = &r->admitter;
	kvr_admitter_of = r;
	kvr_router_cb_self = r;          /* kvr_router_destroy refuses to run here */
	prctl(PR_SET_NAME, "kvr-admit"); /* for top, perf and the tests (as replica threads) */
	/* UINT64_MAX while no failed outcome waits: the park then costs nothing but the wakes. */
	uint64_t park_ns = UINT64_MAX, reap_now = 0;
	for (;;) {
		/* Ordering: acquire; pairs with the release store in kvr_admitter_stop. */
		if (__atomic_load_n(&a->stop, __ATOMIC_ACQUIRE))
			break;
		/* Cleared before the pass: load a shard lowers during it raises the flag again and
		 * the pass runs once more.  Ordering: seq_cst, after the park's barrier below. */
		bool pass = __atomic_exchange_n(&a->wanted, 0, __ATOMIC_SEQ_CST);
		if (pass)
			kvr_queue_pump(r); /* false: another thread's pass walks the list again */
		/* Attempts that ended with no call (a lease expiry, a dropped booking: `ended`)
		 * may be those of admissions nobody collected: their records go, so the list is
		 * bounded by the live leases.  And a failed outcome, which no expiry marks, goes
		 * once due: this thread is the one that comes back for it (`failed` says a pass
		 * kept one; the same ordering).  Not after every pass, as before: a pass ends no
		 * attempt whose outcome waits (nobody collected it, so nobody knows its attempt to
		 * end it), and a reap looks at every outcome kept. */
		bool ended = __atomic_exchange_n(&a->ended, 0, __ATOMIC_SEQ_CST);
		if (ended || __atomic_exchange_n(&a->failed, 0, __ATOMIC_SEQ_CST) ||
		    park_ns != UINT64_MAX) {
			uint64_t now = 0, due = kvr_queue_reap(r, &now);
			park_ns = due == UINT64_MAX ? UINT64_MAX
			                            : reap_park_ns(due, now, reap_now, park_ns);
			reap_now = now;
		}
		if (pass)
			continue;
		kvr_parker_prepare(&a->park);
		if (__atomic_load_n(&a->stop, __ATOMIC_ACQUIRE) ||
		    __atomic_load_n(&a->wanted, __ATOMIC_SEQ_CST) ||
		    __atomic_load_n(&a->failed, __ATOMIC_SEQ_CST)) {
			kvr_parker_cancel(&a->park);
			continue;
		}
		(void)kvr_parker_wait(&a->park, park_ns);
	}
	kvr_rcu_thread_offline(); /* the pass made this thread a reader */
	return NULL;
}

int kvr_admitter_start(struct kvr_router *r)
{
	kvr_parker_init(&r->admitter.park);
	int err = kvr_thread_start(&r->admitter.thread, false, admitter_main, r);
	if (err)
		return err;
	r->admitter.started = true;
	return 0;
}

void kvr_admitter_stop(struct kvr_router *r)
{
	struct kvr_admitter *a = &r->admitter;
	if (!a->started)
		return;
	__atomic_store_n(&a->stop, 1, __ATOMIC_RELEASE);
	kvr_parker_wake(&a->park);
	pthread_join(a->thread, NULL);
	a->started = false;
}

void kvr_admitter_note_unloaded(void *ctx, bool ended)
{
	struct kvr_router *r = ctx;
	/* Past kvr_router_destroy's call on this shard, the queue may be freed: the flag is set
	 * before that call, which orders it before this shard's later tasks and timers. */
	if (kvr_router_stopping(r))
		return;
	/* Raised before the fence: a pass that counts an outcome after it and then judges it
	 * (core/queue.c, the fence after outcome_link) sees the attempt ended, or this reads the
	 * count and wakes the thread, whose reap then sees it. */
	if (ended)
		__atomic_store_n(&r->admitter.ended, 1, __ATOMIC_RELAXED);
	/* The lowered load is published (relaxed stores); pairs with the route's fence between
	 * its push and its pass (kvr_queue_catch_up). */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	/* An outcome nobody collected ends only with its attempt (an expiry, a reset or removal
	 * of its rank, which reap themselves): with nothing queued, a lifecycle message's work
	 * is no news for it.  Before, every one woke the thread to look at them all again, for
	 * as long as one waited (two lease scan intervals: test_lifecycle
	 * an_uncollected_outcome_does_not_wake_the_admission_thread_per_call). */
	if (kvr_queue_depth(r) == 0 && (!ended || kvr_queue_uncollected(r) == 0))
		return;
	__atomic_store_n(&r->admitter.wanted, 1, __ATOMIC_SEQ_CST);
	kvr_parker_wake(&r->admitter.park); /* a full barrier, then the state; no syscall unless
	                                       the thread sleeps */
}

void kvr_admitter_note_failed(struct kvr_router *r)
{
	/* Past kvr_router_destroy's stop the thread is gone (a waiter's pass may still run). */
	if (kvr_router_stopping(r))
		return;
	__atomic_store_n(&r->admitter.failed, 1, __ATOMIC_SEQ_CST);
	kvr_parker_wake(&r->admitter.park);
}

void kvr_admitter_wake(struct kvr_router *r)
{
	if (kvr_router_stopping(r)) /* as kvr_admitter_note_failed */
		return;
	__atomic_store_n(&r->admitter.wanted, 1, __ATOMIC_SEQ_CST);
	kvr_parker_wake(&r->admitter.park);
}
