/*
 * shards/runtime.h - shard threads: pinned, RCU-registered, fed by two biased lanes.
 *
 * A shard is one OS thread pinned to one CPU that alone owns some state (the router puts a
 * worker's ranks there).  Other threads talk to it only through messages: fire-and-forget
 * tasks (kvr_shard_post*) and synchronous calls (kvr_shard_call).  Each shard also runs its own
 * timers on the router's clock, which may be virtual (kvr_shards_kick / kvr_shards_quiesce).
 * Nothing here knows about routing; see sync/lane.h for the scheduling policy and
 * sync/park.h for idle parking and reply slots.
 *
 * Lifetime contract: kvr_shards_destroy() may run while other threads are inside any call on
 * these shards; those calls return KVR_ESHUTDOWN (or complete).  A call that *starts* after
 * destroy returned is a use-after-free, as for any destroyed object: to stop producers that
 * loop, call kvr_shards_shutdown() first (every later call returns KVR_ESHUTDOWN, the memory
 * stays valid), join them, then destroy.
 */
#ifndef KVR_SHARDS_RUNTIME_H
#define KVR_SHARDS_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvrouter.h"
#include "shards/timer.h"
#include "sync/lane.h"

struct kvr_shards;
struct kvr_shard;

#define KVR_SHARDS_NO_SPIN UINT64_MAX

/* Inline payload of a posted task, bytes; of a timed one (kvr_shard_post_at), which carries
 * its time in the rest. */
#define KVR_SHARD_PAYLOAD       KVR_MSG_PAYLOAD
#define KVR_SHARD_TIMED_PAYLOAD (KVR_MSG_PAYLOAD - 8)

struct kvr_shards_config {
	/* Shard threads.  0 = one per CPU in the process affinity mask.  Max 256. */
	uint32_t n_shards;
	/* Shard i is pinned to cpus[i % n_cpus]; borrowed, copied.  NULL = the CPUs of the
	 * process affinity mask in order.  A CPU that cannot be used leaves the shard unpinned. */
	const int *cpus;
	size_t n_cpus;
	/* Capacity of the routing lane, messages.  0 = KVR_DEFAULT_LANE_CAPACITY.  Max 1 << 22. */
	uint32_t lane_capacity;
	/* Soft depth of the routing lane, messages; 0 = none (posts fill the ring).  Paced posts
	 * (kvr_shard_post_paced) that find this many messages in the ring wait while the shard is
	 * taking messages, and spill into the ring's room above it once the shard has taken none
	 * for lane_stall_ns.  At or above the ring's capacity: never reached.  Max 1 << 22. */
	uint32_t lane_soft_depth;
	/* How long a shard may take no message before paced posts spill past the soft depth.
	 * 0 = KVR_DEFAULT_LANE_STALL_NS (50 us). */
	uint64_t lane_stall_ns;
	/* Capacity of the maintenance lane.  0 = lane_capacity.  Max 1 << 22.  (The router sets
	 * 255, a 16 KiB ring: it posts nothing there, its timers run in the loop.) */
	uint32_t maint_capacity;
	/* Biased scheduler bound: a maintenance task at least every maint_every_tasks routing tasks
	 * (0 = 64) or maint_every_ns of continuous routing work (0 = 200 us). */
	uint32_t maint_every_tasks;
	uint64_t maint_every_ns;
	/* Clock for timers.  NULL = CLOCK_MONOTONIC.  clock_ctx passed unchanged.  Called from
	 * every shard thread concurrently: it must be thread-safe.  For virtual time, advance it
	 * and then call kvr_shards_kick() (or kvr_shards_quiesce()). */
	kvr_clock_fn now_ns;
	void *clock_ctx;
	/* Most distinct workers placed at once.  0 = 4096.  Max 1 << 20. */
	uint32_t max_workers;
	/* Synchronous calls spin this long on the reply before sleeping.  0 = 20 us.  A call
	 * whose replies have lately taken longer spins a sixteenth of it, and one that finds the
	 * shard parked (it wakes it) hardly at all: the wake-up alone outlasts the spin. */
	uint64_t call_spin_ns;
	/* An idle shard polls its lanes this long before parking, so back-to-back work (a
	 * caller's next call) finds it awake.  0 = 50 us (KVR_DEFAULT_SHARD_IDLE_SPIN_NS, as the
	 * router's default); KVR_SHARDS_NO_SPIN = park at once. */
	uint64_t idle_spin_ns;
	/* While 3/4 of its recent idle periods ended with work within half of this, the shard
	 * polls for half of this (see idle_spin in runtime.c; the part past idle_spin_ns yields
	 * the CPU between polls).  0 = 8 x idle_spin_ns (400 us, so 200 us polls, by default);
	 * KVR_SHARDS_NO_SPIN = idle_spin_ns (never longer). */
	uint64_t idle_spin_max_ns;
	/* The bound on how long a lazy post (kvr_shard_post_lazy) may wait for an idle shard: a
	 * shard that ran a message within the last 100 ms (IDLE_PURGE_NS) parks for at most this
	 * long at a time, and lazy posts leave it asleep.  0 = 1 ms
	 * (KVR_DEFAULT_SHARD_LAZY_WAKE_NS); KVR_SHARDS_NO_SPIN = lazy posts wake like any post. */
	uint64_t lazy_wake_ns;
	/* The bound on how long a soon post (kvr_shard_post_soon) may wait for an idle shard: a
	 * shard that ran a soon message within the last 10 ms (SOON_WARM_NS) parks for at most
	 * this long at a time, and soon posts leave such a park asleep (they wake a shard in any
	 * other).  0 (the default) or KVR_SHARDS_NO_SPIN = soon posts wake like any post.  At most
	 * lazy_wake_ns (a longer value is taken as that).  The price: while soon work flows, each
	 * idle shard wakes by itself every soon_wake_ns (for 10 ms after the last soon message),
	 * a few microseconds of its CPU each.  Why 10 ms: long enough that a stream of soon posts
	 * a few milliseconds apart finds short parks, short enough that a shard whose soon work
	 * stopped goes back to lazy_wake_ns parks after at most 10 ms / soon_wake_ns self-wakes. */
	uint64_t soon_wake_ns;
	/* Run on each shard thread at start (after pinning and RCU registration) and at stop
	 * (after the lanes are drained).  Either may be NULL.  ctx passed unchanged. */
	void (*on_thread_start)(struct kvr_shard *shard, void *ctx);
	void (*on_thread_stop)(struct kvr_shard *shard, void *ctx);
	/* Run on a shard thread that has been idle IDLE_PURGE_NS (100 ms) after work, before it
	 * flushes its caches and purges (kvr_alloc_purge_idle), so what it frees here is purged
	 * too: a place to give back what only a busy router needs.  May be NULL. */
	void (*on_idle)(struct kvr_shard *shard, void *ctx);
	void *ctx;
};

struct kvr_shard_stats {
	uint32_t index;
	int cpu;                         /* CPU asked for, -1 = none */
	bool pinned;                     /* pthread_setaffinity_np succeeded */
	uint32_t depth[KVR_LANE_COUNT];  /* messages queued now */
	uint64_t tasks[KVR_LANE_COUNT];  /* tasks run */
	uint64_t stalls[KVR_LANE_COUNT]; /* posts that found the lane full */
	uint64_t throttles;              /* paced posts that waited at the soft depth */
	uint64_t spills;                 /* ... that went past it (the shard had stalled) */
	uint64_t lane_trimmed_bytes; /* routing ring bytes given back while idle (kvr_lanes_trim) */
	uint64_t maint_wait_max_ns;  /* longest time maintenance waited behind routing */
	uint32_t routing_between_maint_max; /* most routing tasks run while maintenance waited */
	uint64_t calls_inline;              /* kvr_shard_call run inline (caller was the shard) */
	uint64_t parks;                     /* times the shard thread slept */
	uint64_t wakes;                     /* times a producer woke it */
	uint64_t wakes_deferred;            /* lazy posts that left it asleep (bounded park) */
	uint64_t bounded_parks;             /* parks bounded by lazy_wake_ns */
	uint64_t lazy_found;                /* ... that ended by themselves and found work */
	uint64_t soon_parks;                /* parks bounded by soon_wake_ns */
	uint64_t timers_fired;
	uint32_t timers_pending;
	uint32_t workers; /* workers placed here */
	uint32_t ranks;   /* ranks (placements) here */
	uint64_t cpu_ns;  /* CPU time the shard thread used so far (0 if unknown) */
	uint64_t spin_ns; /* of which polling for work before parking (idle_spin_ns) */
};

typedef void (*kvr_task_fn)(struct kvr_shard *shard, void *payload);
typedef int (*kvr_call_fn)(struct kvr_shard *shard, void *arg);
typedef kvr_timer_fn kvr_shard_timer_fn; /* void (*)(struct kvr_shard *, void *arg) */

/*
 * Starts the shard threads.  cfg is borrowed.  Returns 0 and *out, or KVR_EINVAL (NULL args),
 * KVR_ERANGE (too many shards, bad capacity), KVR_ENOMEM (also: a shard thread could not be
 * registered as an RCU reader), or KVR_EAGAIN (a thread could not be created).  Context: any
 * thread. The threads have called on_thread_start when it returns.
 */
int kvr_shards_create(const struct kvr_shards_config *cfg, struct kvr_shards **out);

/*
 * Makes every later call fail with KVR_ESHUTDOWN, waits for calls in flight (an RCU grace
 * period), then stops the threads: each drains both lanes (runs every queued task; their own
 * posts fail with KVR_ESHUTDOWN), drops its pending timers unfired, runs on_thread_stop and
 * exits.  Idempotent.  Memory stays valid until kvr_shards_destroy().
 * Context: any thread except a shard thread, outside an RCU read section.
 */
void kvr_shards_shutdown(struct kvr_shards *s);

/*
 * In a child process forked while s was live: its threads stayed in the parent, so every later
 * post and call fails with KVR_ESHUTDOWN at once (a call would wait for a reply for good).
 * Nothing is joined or freed: s is the parent's copy, left as it is.
 * Context: core/fork.c's child handler (the child's only thread).
 */
void kvr_shards_orphan(struct kvr_shards *s);

/* kvr_shards_shutdown() then frees everything.  NULL is a no-op.  Context: as shutdown. */
void kvr_shards_destroy(struct kvr_shards *s);

/* Bytes the runtime holds (its record, the worker placement table, every shard's record and
 * lane rings), at the allocator's real sizes.  Context: any thread. */
uint64_t kvr_shards_memory_bytes(const struct kvr_shards *s);

/* Number of shards.  Context: any thread. */
uint32_t kvr_shards_count(const struct kvr_shards *s);

/* Shard i, or NULL if i is out of range.  Context: any thread. */
struct kvr_shard *kvr_shards_get(struct kvr_shards *s, uint32_t i);

/* The shard's index, its runtime, and the shard whose thread is calling (NULL elsewhere). */
uint32_t kvr_shard_index(const struct kvr_shard *sh);
struct kvr_shards *kvr_shard_runtime(struct kvr_shard *sh);
struct kvr_shard *kvr_shard_current(void);

/* Says the calling shard did work outside a message (a timer callback that freed or retired
 * memory: a TTL expiry's index removals; or its idle hook left work for the next idle period), so
 * its idle hook and purge run once it has been idle IDLE_PURGE_NS, as after a message.  Timers
 * alone do not count: a shard whose only work was an expiry long after its last message had run its
 * idle hook already, and what the expiry retired waited for the next message (NULL is a no-op).
 * Context: the shard's own thread. */
void kvr_shard_note_work(struct kvr_shard *sh);

/* Owner state pointer (the router's per-shard state).  Set it from on_thread_start or a task;
 * read it on the shard thread.  Context: the shard thread (or before/after it runs). */
void *kvr_shard_userdata(struct kvr_shard *sh);
void kvr_shard_set_userdata(struct kvr_shard *sh, void *data);

/*
 * Placement: a worker id -> a shard.  The first placement of a worker chooses the shard with the
 * fewest ranks (lowest index on ties); later placements of the same worker (its other dp ranks)
 * return the same shard and count one more rank.  Stable until the worker's last rank is
 * unplaced.  Returns 0 and *shard_out, KVR_EINVAL, KVR_ERANGE (max_workers reached),
 * KVR_ESHUTDOWN.  Context: any thread (writers serialize on a mutex).
 */
int kvr_shards_place(struct kvr_shards *s, uint64_t worker_id, uint32_t *shard_out);

/* Removes one rank of the worker; the worker is forgotten at its last.  Returns 0,
 * KVR_ENOENT (not placed), KVR_EINVAL.  Context: any thread. */
int kvr_shards_unplace(struct kvr_shards *s, uint64_t worker_id);

/*
 * Posts fn(shard, copy of payload) on a lane; payload (len <= KVR_SHARD_PAYLOAD bytes) is
 * copied, so it may be a struct or a pointer.  Returns 0, KVR_EAGAIN (lane full, counted as a
 * stall), KVR_EINVAL (fn NULL, len too big), KVR_ESHUTDOWN.  Tasks posted by one thread on one
 * lane run in the order posted.
 * Context: any thread, including shard threads (also to themselves); the caller is made an RCU
 * reader if it is not one yet (kvr_rcu_thread_online) and must not be in a read section that
 * spans kvr_shards_shutdown().
 */
int kvr_shard_post(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn, const void *payload,
                   size_t len);

/* How a paced post went (kvr_shard_post_paced's *how, bits).  SPILLED: it went past the soft
 * depth (the shard had stalled, or the wait reached its bound). */
#define KVR_POST_THROTTLED 1u /* it waited at the soft depth */
#define KVR_POST_SPILLED   2u

/*
 * Like kvr_shard_post, for work that makes the shard's lane run ahead of what decisions see
 * (admissions): on the routing lane, a post that finds lane_soft_depth or more messages in the
 * ring first waits (a spin, yields, then sleeps of up to 64 us) while the shard keeps taking
 * messages, until the ring is below the soft depth.  Once the shard has taken none for
 * lane_stall_ns (a long task, a preempted thread; judged by the time of its last take, so a
 * post that finds the shard stalled that long already does not wait), the post goes into the
 * ring's room above the soft depth; a wait also ends in a spill after KVR_LANE_THROTTLE_MAX_STALLS
 * (10) stall intervals in all.  So a stalled shard makes no post fail while the ring has room, and
 * a progressing one keeps its lane about soft-depth deep.  A full ring returns KVR_EAGAIN (counted
 * as a stall) as kvr_shard_post does.  Posts from shard threads do not wait (a shard waiting on a
 * lane would stop draining its own).  Sets *how (may be NULL) to KVR_POST_* bits; counted per shard
 * (kvr_shard_stats throttles, spills) and per thread (kvr_shard_thread_costs).  Returns as
 * kvr_shard_post. Context: as kvr_shard_post; while waiting the caller is in an RCU read section
 * (at most lane_stall_ns without progress, 10 x lane_stall_ns in all, plus one sleep).
 */
int kvr_shard_post_paced(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                         const void *payload, size_t len, unsigned *how);

/*
 * Like kvr_shard_post, for work that may wait up to lazy_wake_ns (plus the shard's scheduling
 * delay) before it runs: a shard in a bounded park (it ran a message lately, see lazy_wake_ns)
 * is left asleep and finds the task when its timed wait ends, so the caller makes no FUTEX_WAKE.
 * A shard parked without a bound is woken as by kvr_shard_post.  Order: as kvr_shard_post (a
 * later post of any kind on the lane runs after it; a woken shard runs it first).  Sets
 * *deferred (may be NULL) to whether the wake was left to the shard.  A full lane wakes the
 * shard and returns KVR_EAGAIN.  It never waits at the soft depth (kvr_shard_post_paced): lazy
 * posts are lifecycle work, a finish or abort already claimed on its caller's thread, which
 * must never be refused or held while the ring has room, and whose work (load and blocks
 * released) is what the next decisions need; they do not make decisions stale as queued
 * bookings do (the load they release lags, no prefix is recomputed elsewhere), and their number
 * follows the paced admissions (one end per attempt, outputs at the engine's pace).  Returns as
 * kvr_shard_post.  Context: as kvr_shard_post.
 */
int kvr_shard_post_lazy(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                        const void *payload, size_t len, bool *deferred);

/*
 * kvr_shard_post_paced for work that may wait up to soon_wake_ns (plus the shard's scheduling
 * delay) for a shard that sleeps, and should not wait longer (admissions: the next decisions
 * miss what a booking writes until it runs): a shard in a park bounded by soon_wake_ns (it ran
 * a soon message within the last 10 ms) is left asleep and finds the task when its timed wait
 * ends, so the caller makes no FUTEX_WAKE; a shard in any other park (a lazy_wake_ns one, or
 * unbounded) is woken as by kvr_shard_post.  So the first soon post after a lull wakes the
 * shard and later ones, while they keep coming, ride its short parks.  With soon_wake_ns 0 it
 * is kvr_shard_post_paced.  Sets *how as kvr_shard_post_paced does and *deferred (may be
 * NULL) to whether the wake was left to the shard.  Returns as kvr_shard_post_paced.
 * Context: as kvr_shard_post_paced.
 */
int kvr_shard_post_soon(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                        const void *payload, size_t len, unsigned *how, bool *deferred);

/*
 * Like kvr_shard_post, but if the lane is full waits (spin, yield, then short sleeps) up to
 * timeout_ns for room: KVR_ETIMEDOUT then.  A wait counts one stall.  From the shard's own thread
 * it does not wait (it would wait for itself): KVR_EAGAIN.  From another shard's thread (a
 * router callback there) the wait is recorded as kvr_shard_call's is, and refused with KVR_EBUSY
 * when sh waits for that shard, directly or through others.  Context: as kvr_shard_post; while
 * waiting the caller is in an RCU read section, delaying grace periods by at most timeout_ns.
 */
int kvr_shard_post_wait(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                        const void *payload, size_t len, uint64_t timeout_ns);

/*
 * A post that must neither be dropped nor wait, from a shard's thread (a claimed finish or abort
 * from a router callback there): pushed now if the lane has room and this thread keeps no
 * earlier one, else kept by this thread and pushed from its loop, in order, once there is room
 * (the full shard may be waiting for this one).  Returns 0 (posted or kept), KVR_ENOMEM (not
 * kept), KVR_ESHUTDOWN, KVR_EINVAL.  Off a shard's thread it is kvr_shard_post_wait without a
 * timeout.  Context: any thread.
 */
int kvr_shard_post_later(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                         const void *payload, size_t len);

/*
 * Posts fn(shard, copy of payload) to run as if at router time at_ns, for a poster that would
 * otherwise wait for it (kvr_shard_call) and instead settles before it next reads what the task
 * changes (kvr_shard_settle): the shard fires the timers due by at_ns first, at at_ns (not at
 * its own later reading of the clock, which a virtual clock may have moved meanwhile), and the
 * task and those timers read at_ns from kvr_shard_task_time; an untimed message after it runs
 * only after a fresh reading of the clock and the timers due by then.  So a poster whose every
 * state-reading call settles first observes what it would have observed had it waited for each
 * task.  A time older than one the shard already ran at is taken as that one.  The post is lazy
 * (kvr_shard_post_lazy): its poster settles before it needs the work, and the settle wakes the
 * shard if it is still asleep, so the post makes no FUTEX_WAKE.  len <=
 * KVR_SHARD_TIMED_PAYLOAD.  A full lane is waited on without bound (as kvr_shard_call).
 * Returns 0, KVR_EINVAL, KVR_ESHUTDOWN.  Context: any thread but the shard's own (which would
 * wait for itself on a full lane).
 */
int kvr_shard_post_at(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn, const void *payload,
                      size_t len, uint64_t at_ns);

/* Whether the calling shard thread runs a timed task (kvr_shard_post_at) or a timer for one,
 * and then its time in *at.  Context: any thread (false off a shard thread). */
bool kvr_shard_task_time(uint64_t *at);

/*
 * Returns once the shard has run every timed task (kvr_shard_post_at) posted before this call
 * began, the caller's own included: at once (two loads) when it has; otherwise it waits as a
 * kvr_shard_call does (queued behind them).  Returns 0 (also when the runtime is shutting down:
 * the drain runs them), KVR_EINVAL.  Context: any thread; on the shard's own thread it returns
 * at once.
 */
int kvr_shard_settle(struct kvr_shard *sh);

/*
 * kvr_shard_settle for a caller that reads only what a timer of the shard writes (the lease
 * reaper), not what its tasks write: it also returns at once when no timer can fire in the timed
 * work still queued, that is when that work runs at times before the shard's next timer deadline
 * as last published and before the shard's time plus armed_after_ns, the least delay after its
 * own time at which a task of that work may arm such a timer (the reaper: one scan interval).
 * Before it counted only the published deadline, and a queued booking arms the reaper itself:
 * a touch then succeeded ahead of scans due before it (test_owner_attempts,
 * sync_booking_calls_see_the_scans_queued_work_makes_due).  Context: as kvr_shard_settle.
 */
int kvr_shard_settle_timers(struct kvr_shard *sh, uint64_t armed_after_ns);

/*
 * Runs fn(shard, arg) on the shard thread and returns its result; arg is borrowed for the call.
 * From the shard's own thread it is KVR_EBUSY, not run: that thread is inside a task (a router
 * callback there calls the API), and fn would change state under it (kvr_shard_call_read runs
 * a fn that only reads inline there).  Otherwise it posts (waiting for room like
 * kvr_shard_post_wait with no timeout, unless shutdown), then spins call_spin_ns on a reply
 * slot (no syscall on a busy shard) and then sleeps on a futex; a call function whose replies
 * have lately taken longer than call_spin_ns (a moving average per shard) spins only
 * call_spin_ns / 16 before it sleeps.  Returns fn's result, or
 * KVR_EINVAL / KVR_ESHUTDOWN (not run).  Calls queued when shutdown begins still run.
 * From another shard's thread (a router callback there, the clock, calling the API), a call
 * that would close a cycle of shards waiting for each other (A waits for B waits for A, or
 * longer, across routers too) is refused: KVR_EBUSY, not run (see wait_edge_add; a cycle that
 * broke up while it was being followed may be refused as well).  Use posts between shards.
 * Context: any thread.
 */
int kvr_shard_call(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg);
/* kvr_shard_call for a fn that only reads the shard's state: from the shard's own thread it
 * runs inline (queueing behind itself would deadlock). */
int kvr_shard_call_read(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg);
/* Whether the calling thread is sh's (then a kvr_shard_call on sh is refused). */
bool kvr_shard_is_current(const struct kvr_shard *sh);
/* Whether this thread runs a call inline inside another task (kvr_shard_call_read or
 * kvr_shard_call_always from the shard's own thread): a fn there must not change what that
 * task may hold. */
bool kvr_shard_in_inline_call(void);

/*
 * From a shard's thread: records that this thread may wait for sh from now on (a
 * kvr_shard_call_always to come, e.g. a rollback, after work that must not begin if that wait
 * closes a cycle): KVR_EBUSY when it would, nothing recorded; else 0, and the edge stays until
 * kvr_shard_wait_intent_end, through the calls made in between (each call's own edge goes back
 * to it when the call ends), so that a kvr_shard_call closing a cycle with it meanwhile is the
 * one refused.  The calls in between should be to sh: a thread records one edge, and while a
 * call to another shard waits, that call's edge stands in for the intent's.  0 at once, nothing
 * recorded, on other threads and for the thread's own shard; nested in another intent, 0 and
 * the outer edge stays.  Context: any thread; every 0 is matched by one
 * kvr_shard_wait_intent_end on the same thread (a no-op on other threads).
 */
int kvr_shard_wait_intent(struct kvr_shard *sh);
/* On a shard's thread: whether sh is that shard, or waits for it through the recorded edges
 * (sh waits for a shard that waits ... for it).  false on other threads.  For a thread that
 * waits for sh outside the edges (a lock held across a call to sh) to tell that this shard
 * must not wait for it.  Context: any thread.  Ordering: seq_cst loads of the edges. */
bool kvr_shard_waits_for_current(struct kvr_shard *sh);
void kvr_shard_wait_intent_end(void);

/*
 * kvr_shard_call for a step that cannot be refused once begun (a removal's teardown after
 * kvr_shard_wait_intent, a rollback): from another shard's thread it waits even when that
 * closes a cycle.  Its edge is
 * recorded, so a kvr_shard_call that closes the cycle after it is refused; one already waiting
 * when this call closes it waits for good with it, as every call did before cycles were refused
 * (the router's rule for its clock is to read a time only).
 * Context: as kvr_shard_call.
 */
int kvr_shard_call_always(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg);

/*
 * Schedules fn(shard, arg) on the shard at deadline_ns of the router clock.  Returns 0 and
 * *timer_id (may be NULL), KVR_EINVAL (fn NULL, or not called from this shard's thread),
 * KVR_ENOMEM.  Context: the shard's own thread only (use a posted task from elsewhere).
 */
int kvr_shard_timer_add(struct kvr_shard *sh, uint64_t deadline_ns, kvr_shard_timer_fn fn,
                        void *arg, uint64_t *timer_id);

/* Cancels a pending timer: 0, KVR_ENOENT (fired, cancelled, unknown), KVR_EINVAL (wrong
 * thread).  Context: the shard's own thread. */
int kvr_shard_timer_cancel(struct kvr_shard *sh, uint64_t timer_id);

/* The router clock's time now.  Context: any thread. */
uint64_t kvr_shards_now(const struct kvr_shards *s);

/*
 * Virtual time: wakes every shard so it re-reads the clock and fires exactly the timers due.
 * Context: any thread.
 */
void kvr_shards_kick(struct kvr_shards *s);

/*
 * Kicks, then waits until every shard has re-read the clock since the kick, fired its due
 * timers, emptied both lanes and parked, with no task run in between (so work that shards post
 * to each other is finished too).  For tests and the simulator: the caller must have stopped
 * producing.  Returns 0, KVR_ETIMEDOUT, KVR_ESHUTDOWN, or KVR_EINVAL (s NULL, or called from
 * a shard thread).  Context: any thread but a shard's.
 */
int kvr_shards_quiesce(struct kvr_shards *s, uint64_t timeout_ns);

/* What the calling thread's posts to shards have cost it so far, counted (the steps that make a
 * post slow, for attributing a caller's latency tail without timing it): posts that found a
 * lane full and waited for room, paced posts that waited at the soft depth and those that
 * spilled past it, the sleeps (nanosleep) of all those waits, and the FUTEX_WAKEs it issued to
 * wake a parked shard (sync/park.h).  Monotonic per thread.  Context: any thread. */
struct kvr_post_costs {
	uint64_t full_waits;
	uint64_t wait_sleeps;
	uint64_t futex_wakes;
	uint64_t soft_throttles;
	uint64_t soft_spills;
};
void kvr_shard_thread_costs(struct kvr_post_costs *out);

/* A snapshot of a shard's counters.  Context: any thread. */
void kvr_shard_get_stats(struct kvr_shard *sh, struct kvr_shard_stats *out);

#endif /* KVR_SHARDS_RUNTIME_H */
