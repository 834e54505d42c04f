/*
 * core/router_internal.h - the router's shape, shared by core/'s caller side (route, lifecycle,
 * events, ranks, queue, metrics).  The shards see only struct kvr_owner_ctx (shards/owner.h).
 *
 * Who owns what (ARCHITECTURE.md):
 *  - struct kvr_rank_pub, one per index slot: identity fields are written by the admin path
 *    under admin_lock before the slot is published in `live`; the load snapshot is written only
 *    by the rank's shard thread (relaxed atomics: single writer, readers want a recent value,
 *    not a consistent set).  Any thread reads them.
 *  - struct kvr_rank_owned (pub->own): the rank's predicted cache (rank_state: LRU or TTL), its
 *    load, its event cursor and its live attempts.  Only the rank's shard thread touches it.
 *  - struct kvr_shard_state (shard userdata): the shard's attempt records, scratch buffers,
 *    timers.  Only that shard thread touches it.
 *  - the lease table: one word per live attempt, claimed by CAS from any thread.
 *  - struct kvr_rank_load / struct kvr_rank_prov, one each per slot in arrays of their own: the
 *    load routing reads, booked (the rank's shard writes it) and provisional (routing threads
 *    add to it); see shards/owner.h.
 *  - `live`: the array of routable slots with their generations, RCU-published copy-on-write by
 *    the admin path; routers read it inside a read section.
 * Attempt ids: (sequence << 16) | slot, so any thread finds an attempt's rank, shard and lease
 * word with no lookup; the sequence part is never reused, so an id is never reused either.
 */
#ifndef KVR_CORE_ROUTER_INTERNAL_H
#define KVR_CORE_ROUTER_INTERNAL_H

/* The bounded wait for room in a full shard lane (kvr_route's booking, lifecycle work). */
#define KVR_LANE_FULL_WAIT_NS UINT64_C(10000000) /* 10 ms */

/* The detail of a KVR_EBUSY from kvr_shard_call: a call on a shard thread (a callback there, the
 * clock) whose wait would close a cycle of shards waiting for each other. */
#define KVR_SHARD_CYCLE_DETAIL                                                                     \
	"called on a shard thread (the router's clock), waiting for another shard would close a "  \
	"cycle of shards waiting for each other, or the call would change its own shard's state "  \
	"under the task that read the clock; nothing done"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/fork.h"
#include "core/index.h"
#include "core/metrics.h"
#include "kvrouter.h"
#include "shards/lease.h"
#include "shards/owner.h"
#include "shards/pinmap.h"
#include "shards/runtime.h"
#include "sync/park.h"
#include "sync/rcu.h"

/* The router whose own machinery runs the calling thread: set around the embedder's callbacks
 * (on_admit, on_event_gap, a clock of the embedder's: kvr_router_callback_enter; core/router.c
 * clock_guarded) and for the life of a feed's thread and of
 * a replica's apply thread (and around its inline handling on a transport thread).
 * kvr_router_destroy refuses to run on such a thread: it would wait for, or free under, the very
 * call that is running it.  Context: the thread itself. */
extern _Thread_local const struct kvr_router *kvr_router_cb_self;

/* Marks the calling thread as running r's callback; returns what to restore afterwards
 * (kvr_router_callback_leave).  Nestable. */
static inline const struct kvr_router *kvr_router_callback_enter(const struct kvr_router *r)
{
	const struct kvr_router *prev = kvr_router_cb_self;
	kvr_router_cb_self = r;
	return prev;
}
static inline void kvr_router_callback_leave(const struct kvr_router *prev)
{
	kvr_router_cb_self = prev;
}

/* Whether the calling thread runs inside r: one of its callbacks (its clock, on_admit,
 * on_event_gap), one of the threads that set kvr_router_cb_self, or one of its shards.  A call
 * that waits for r's progress there can wait for the very call it runs in.  Context: any
 * thread. */
bool kvr_router_runs_thread(const struct kvr_router *r);

/* The routable slots and the generation each had when it became routable (a decision taken on
 * this list books with that generation, so a rank removed since is a stale booking).  gen[]
 * first, slot[] after it in the same allocation, both cap long.  An add appends in place: the
 * entry is written, then n is stored (release), so a reader that loads n (kvr_live_n: acquire)
 * reads only entries written before it; a removal, or an add to a full list, publishes a new
 * list (core/router.c, kvr_router_live_update).  Copying the list on every add made 65,536
 * adds take 9 s (218 us an add at 60k ranks, docs/measurements.md). */
struct kvr_live {
	struct rcu_head rcu;
	uint32_t n; /* atomic: grows in place under admin_lock; readers use kvr_live_n */
	uint32_t cap;
	uint32_t *slot;
	uint64_t gen[];
};

/* How many entries of l a reader may read.  Context: inside the read section that loaded l. */
static inline uint32_t kvr_live_n(const struct kvr_live *l)
{
	return __atomic_load_n(&l->n, __ATOMIC_ACQUIRE);
}

struct kvr_queue; /* core/queue.c */

/* The admission thread (core/queue_thread.c), a router with a queue only: it runs the admission
 * pass for load a shard lowered by itself (a lease expiry, a decay step).  wanted and stop are
 * atomic; the rest is kvr_router_create's and kvr_router_destroy's. */
struct kvr_admitter {
	struct kvr_parker park; /* the thread sleeps here */
	uint32_t wanted;        /* a shard lowered load by itself while requests were queued */
	uint32_t failed;        /* a pass kept a failed admission: time its reclaim */
	uint32_t ended;         /* attempts ended with no call: reap the outcomes kept */
	uint32_t stop;          /* kvr_router_destroy: the thread returns */
	bool started;
	pthread_t thread;
};
struct kvr_repl_hooks; /* core/replica_hooks.h */

struct kvr_router {
	struct kvr_config cfg;
	struct kvr_clock clock;
	struct kvr_index *index;
	struct kvr_pinmap *pinmap; /* every rank's pinned runs (shards/pinmap.h, see route.c) */
	struct kvr_shards *shards;
	struct kvr_metrics *metrics;
	struct kvr_leases *leases;     /* attempt ids and their lease words */
	struct kvr_attempt_pool *pool; /* recycled attempt records (shards/owner.h) */
	struct kvr_owner_ctx owner;    /* what the shards see of the router */
	struct kvr_rank_pub *ranks;    /* [cfg.max_ranks], indexed by index slot */
	struct kvr_rank_load *load;    /* [cfg.max_ranks]: booked load (shards/owner.h) */
	struct kvr_rank_prov *prov;    /* [cfg.max_ranks]: provisional load (shards/owner.h) */
	struct kvr_live *live;         /* RCU */
	pthread_mutex_t admin_lock;    /* rank add / remove / reset, live list writers */
	struct kvr_queue *queue;       /* NULL unless queue_threshold > 0 */
	uint32_t shutting_down;        /* atomic */
	/* The shard admin_lock's holder is calling (waiting for), else NULL; admin_barrier: the
	 * holder waits in kvr_rcu_barrier.  A shard's thread that finds the lock taken refuses
	 * instead of waiting when either waits for it (core/ranks.c admin_lock).  seq_cst. */
	struct kvr_shard *admin_waits;
	uint32_t admin_barrier;
	/* Feeds destroyed from their own thread (sync/feed.c) whose thread still tears them down
	 * (atomic): kvr_router_destroy waits for them, as it may be called as soon as
	 * kvr_feed_destroy returned. */
	uint32_t feeds_closing;
	/* Feeds not destroyed yet (sync/feed.c, linked through kvr_feed.live_next; under
	 * feeds_lock): kvr_router_destroy stops and releases those left (kvr_feeds_orphan). */
	pthread_mutex_t feeds_lock;
	struct kvr_feed *feeds;
	/* core/fork.c: the process generation r was created in, and its link in the list of live
	 * routers a fork's child marks inherited (under fork.c's lock). */
	uint32_t fork_gen;
	struct kvr_router *fork_next;
	struct kvr_repl_hooks *repl;  /* replica sync hooks, NULL = none (RCU, acquire) */
	struct kvr_admitter admitter; /* started only with a queue */
	/* Per-decision random stream (atomic): written by every decision, so last, on a line of
	 * its own (the struct's size rounds up to it), away from what shard threads read on every
	 * task (the owner context) and routers read on every decision. */
	uint64_t rng_counter __attribute__((aligned(64)));
};

/*
 * core/route.c: admits an attempt on a chosen rank without selection (kvr_route after its
 * decision; the replica layer for a peer's admission).  Mints the attempt id lock-free into
 * a->attempt, adds the request to the rank's provisional load (a->pend_blocks set by the
 * caller; a->pend_prefill_tokens filled here), and posts the booking to the rank's shard
 * (routing lane); with sync, waits for the booking instead.  full_wait (without sync): a full
 * lane is waited on for KVR_LANE_FULL_WAIT_NS (counted in KVR_C_LANE_FULL_WAITS, and
 * KVR_C_LANE_FULL_DROPS when it stays full); false: refused at once, counted in
 * KVR_C_LANE_FULL_REFUSALS (a frontend's admission pass, whose retry is the admission
 * thread's).
 * Returns 0; KVR_ENOENT (sync: the rank went away since the decision; nothing booked, or a
 * posted booking the shard drops or ends with the rank, noted as withdrawn if a->noted:
 * KVR_OP_WITHDRAWN, so the caller must not note its admission);
 * KVR_EAGAIN (the lane stayed full for KVR_LANE_FULL_WAIT_NS, or was full and !full_wait, or
 * too many live attempts); KVR_ERANGE (attempt ids used up); KVR_ENOMEM; KVR_ESHUTDOWN.
 * Context: any thread but a shard's, outside a read section.
 */
int kvr_admit(struct kvr_router *r, struct kvr_admit_args *a, bool sync, bool full_wait);

/* core/queue.c */
int kvr_queue_create(struct kvr_router *r, struct kvr_queue **out);
void kvr_queue_destroy(struct kvr_queue *q);
/* Whether every eligible rank is saturated (see kvr_config.queue_threshold). */
bool kvr_queue_saturated(struct kvr_router *r, const uint32_t *slots, size_t n);
/* Queues a copy of req (key: WSPT weight, predicted uncached tokens).  Returns 0 with
 * d->status KVR_QUEUED, KVR_ENOENT (pinned or allow-listed, and none of its ranks is live any
 * more: nothing queued, whether or not the queue is full), KVR_EAGAIN (full), KVR_ENOMEM,
 * KVR_ESHUTDOWN. */
int kvr_queue_push(struct kvr_router *r, const struct kvr_request *req, uint64_t key,
                   struct kvr_decision *d);
/* Tries to admit waiting requests (after load dropped), in the policy's order, passing over
 * those whose ranks are all saturated.  Returns false when another thread was pumping (which then
 * walks the list again), or when this pass ended at a refused booking and left its retry to the
 * admission thread (the request may still be admissible); true otherwise.  Context: any thread,
 * no shard's. */
bool kvr_queue_pump(struct kvr_router *r);
/* Whether the calling thread runs r's admission pass (it is inside that pass's on_admit or
 * clock): no other thread pumps until it returns, so a ticket it waits for is admitted by
 * nobody.  Context: any thread. */
bool kvr_queue_pumped_here(struct kvr_router *r);
/* Whether a waiting request could be admitted now (one of its ranks is not saturated) or is
 * being admitted, and the queue has room: a new request then queues behind it.  Context: any
 * thread, an RCU reader. */
bool kvr_queue_admissible(struct kvr_router *r);
/* A rank was removed: pumps with a pass that looks past a saturated unrestricted entry, so that
 * entries restricted to gone ranks fail now.  Context: as kvr_queue_pump. */
void kvr_queue_rank_gone(struct kvr_router *r);
/* After kvr_route queued a request (marked waited by kvr_queue_push) and pumped: if it was
 * admitted meanwhile, its outcome into *d (its admission's return code); else it stays queued,
 * collected by a waiter only if wait (otherwise on_admit answers it), and with wait held (never
 * reclaimed) until the caller's kvr_route_wait watches it.  Returns 0 or the admission's
 * code. */
int kvr_queue_settle(struct kvr_router *r, uint64_t ticket, bool wait, struct kvr_decision *d);
/* kvr_route_wait's wait, on a router with a queue: `late` says whether deadline_ns had passed
 * at the caller's reading of the clock (a wait that is late from the start never sleeps, nor
 * refuses inside the router; kvr_route reads the clock once for both its check and the wait, as a
 * clock read again may have gone back).  Context: as kvr_route_wait. */
int kvr_queue_wait(struct kvr_router *r, uint64_t ticket, uint64_t deadline_ns, bool late,
                   struct kvr_decision *d);
size_t kvr_queue_depth(struct kvr_router *r);
/* Queued requests admitted (or failed) whose outcome nobody collected yet.  Context: any thread,
 * no lock (a relaxed load). */
size_t kvr_queue_uncollected(struct kvr_router *r);
/* Frees the uncollected outcomes that can be of no use any more: an admission whose attempt
 * ended (its lease expired: the list is bounded by the live leases), a failed one older than two
 * lease scan intervals.  Returns when (router clock) the next failed outcome left comes due
 * (UINT64_MAX: none), and with one, the clock it read in *now (may be NULL).  Context: any
 * thread but a shard's, no router lock held (reads the clock); the admission thread (after a
 * shard lowered load, and when a failed outcome comes due), kvr_queue_rank_gone. */
uint64_t kvr_queue_reap(struct kvr_router *r, uint64_t *now);

/* core/queue_thread.c.  Starts r's admission thread: 0 or pthread_create's error.  Context:
 * kvr_router_create, after the queue and the shards. */
int kvr_admitter_start(struct kvr_router *r);
/* Stops and joins it (nothing if it never started).  Context: kvr_router_destroy, after no
 * shard runs its hook (on_unloaded) past its shutdown check, before the queue is freed; never on
 * the thread itself. */
void kvr_admitter_stop(struct kvr_router *r);
/* The shards' hook for load they lowered by themselves (kvr_owner_ctx.on_unloaded, ctx: the
 * router) of a router with a queue: wakes the admission thread when requests are queued, or when
 * attempts ended with no call (ended) while outcomes wait uncollected (it reaps them).  Never
 * blocks, allocates or takes a lock.  Context: r's shard threads.  Ordering: a seq_cst fence
 * between the shard's publication of the lowered load and the read of the depth; pairs with the
 * route's fence after its push (kvr_queue_catch_up). */
void kvr_admitter_note_unloaded(void *ctx, bool ended);
/* A pass kept a failed admission nobody collects: wakes the admission thread, which then
 * reclaims it when due (kvr_queue_reap).  Never blocks, allocates or takes a lock.  Context: the
 * thread that ran the pass, off the queue's lock.  Ordering: the flag's seq_cst store, then
 * kvr_parker_wake's barrier; pairs with the thread's park (sync/park.h). */
void kvr_admitter_note_failed(struct kvr_router *r);
/* A frontend's pass ended at a refused booking and left the retry to the admission thread:
 * wakes it for a pass.  Never blocks, allocates or takes a lock.  Context: the thread that ran
 * the pass, off the queue's lock. */
void kvr_admitter_wake(struct kvr_router *r);
/* On a router's admission thread, that router (it takes the retries of refused bookings);
 * else NULL.  A router, not a flag: an on_admit that routes on another router runs that
 * router's pass as a frontend would. */
extern _Thread_local const struct kvr_router *kvr_admitter_of;
/* After a route's push, before its pump: a seq_cst fence that pairs with the shard hook's (its
 * pairing: core/queue.c).  Context: the routing thread. */
void kvr_queue_catch_up(void);
/* Threads inside kvr_route_wait (or kvr_route_cancel) now.  For tests. */
uint32_t kvr_queue_waiters(struct kvr_router *r);

/* How kvr_route_internal treats saturation. */
enum kvr_queue_mode {
	KVR_QUEUE_IF_SATURATED = 0, /* kvr_route: queue the request */
	KVR_QUEUE_FROM_PUMP = 1,    /* the pump: KVR_QUEUE_SATURATED, the request stays queued */
	KVR_QUEUE_BEHIND = 2,       /* kvr_route behind an admissible waiter: queue it anyway */
};

/* kvr_route_internal's return to the pump (KVR_QUEUE_FROM_PUMP) for a request whose eligible
 * ranks are all saturated: it stays queued.  Positive, never a kvr_strerror code: the pump tells
 * it from KVR_EAGAIN, a booking refused (its rank's lane stayed full, too many live attempts). */
#define KVR_QUEUE_SATURATED 1

/* core/route.c: the decision and admission for an already validated request (also used by the
 * queue pump). */
int kvr_route_internal(struct kvr_router *r, const struct kvr_request *req, struct kvr_decision *d,
                       int queue_mode);

/* core/config.c: kvr_config_validate's checks; a failure's detail (kvr_last_error) names fn,
 * the entry point that asked.  Context: any thread. */
int kvr_config_check(const struct kvr_config *cfg, const char *fn);

/* core/router.c: replaces the live list (slot added or removed); an add to a list with room
 * (kvr_router_live_reserve) cannot fail.  Context: under admin_lock. */
int kvr_router_live_update(struct kvr_router *r, uint32_t slot, bool add);
/* Makes room for one more entry in the live list (a copy published if it is full): 0 or
 * KVR_ENOMEM.  Context: under admin_lock. */
int kvr_router_live_reserve(struct kvr_router *r);

/* The rank behind a (worker, dp); 0 and *slot or KVR_ENOENT.  Context: any thread. */
int kvr_router_find_rank(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot);
/* The same, and *gen (may be NULL) the slot's generation as the found rank had it, for a shard
 * call's stale check: a rank removed and another added into its slot between the lookup and a
 * later kvr_router_gen_of would hand the call to the other rank.  Context: any thread. */
int kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                             uint64_t *gen);

static inline bool kvr_router_stopping(const struct kvr_router *r)
{
	return __atomic_load_n(&r->shutting_down, __ATOMIC_ACQUIRE) != 0;
}

/*
 * The checks every call on an attempt id starts with: 0 and the slot of the attempt's rank in
 * *slot, or KVR_EINVAL (no router, attempt 0), KVR_ESHUTDOWN, KVR_ENOENT (a slot this router
 * never had: not an id it issued).  Whether the attempt is still live is the lease word's to say.
 * Context: any thread.
 */
static inline int kvr_router_attempt_slot(const struct kvr_router *r, uint64_t attempt,
                                          uint32_t *slot)
{
	if (!r || attempt == 0)
		return KVR_EINVAL;
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	*slot = kvr_attempt_slot(attempt);
	if (*slot >= r->cfg.max_ranks)
		return KVR_ENOENT; /* not an id this router issued */
	return 0;
}

/* The rank behind id for a call that reads the index: KVR_ESHUTDOWN, KVR_ENOMEM (this thread
 * could not become an RCU reader), or kvr_router_find_rank_gen's answer (*gen: the slot's
 * generation for the shard call).  Context: any thread but a shard's, outside a read-side
 * section. */
static inline int kvr_router_enter_rank(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                        uint64_t *gen)
{
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	int rc = kvr_rcu_thread_online();
	if (rc)
		return rc;
	return kvr_router_find_rank_gen(r, id, slot, gen);
}

/* slot's generation, for the shard call's stale check.  Ordering: acquire, pairs with the
 * release increments of kvr_rank_add / kvr_rank_remove.  Context: any thread. */
static inline uint64_t kvr_router_gen_of(const struct kvr_router *r, uint32_t slot)
{
	return __atomic_load_n(&r->ranks[slot].gen, __ATOMIC_ACQUIRE);
}

/* The shard that owns slot's rank.  Relaxed: set when the rank is created, before its slot is
 * published; a caller with a stale attempt id may read it while the slot is reused, and that
 * shard then answers KVR_ESTALE (shards/owner_ranks.c).  Context: any thread. */
static inline struct kvr_shard *kvr_router_shard_of(struct kvr_router *r, uint32_t slot)
{
	return kvr_shards_get(r->shards, __atomic_load_n(&r->ranks[slot].shard, __ATOMIC_RELAXED));
}

/*
 * sync_booking: returns once every shard has applied the work posted to it before this call
 * (the bookings and lifecycle work that sync_booking posts instead of waiting for: see
 * kvr_shard_post_at), so what the caller reads next - the index, the load words, lease words,
 * counters - is what it would have read had each of those calls waited.  Usually two loads per
 * shard (the shards run the work while the caller goes on).  No-op without sync_booking.
 * Context: any thread but a shard's (it would wait for itself: it returns then).
 */
void kvr_router_settle(struct kvr_router *r);

/* Stops and releases the feeds of r not destroyed yet, all but their handles, which
 * kvr_feed_destroy still frees (sync/feed.c; nothing in a build without ZeroMQ).  Context:
 * kvr_router_destroy, before the shards stop. */
void kvr_feeds_orphan(struct kvr_router *r);

/* A rank was added to r: wakes every feed of r not destroyed yet, which then looks for the ranks
 * it fed that are another life now (removed and added back while their publisher was quiet:
 * their removal took their blocks) and rebuilds them by replay (sync/feed_seq.c,
 * kvr_feed_note_lives).  Nothing in a build without ZeroMQ.  Context: kvr_rank_add, no lock
 * held; takes r->feeds_lock (a leaf here: held for an eventfd write per feed). */
void kvr_feeds_rank_added(struct kvr_router *r);

#endif
