/*
 * shards/runtime.c - shard threads, placement, the shard loop, calls and shutdown.
 *
 * The loop of one shard thread:
 *     g = kick generation; now = router clock; fire timers due at now; publish "seen g";
 *     run up to BATCH tasks by the biased policy (sync/lane.c);
 *     if nothing ran and no timer is due: poll briefly (idle_spin_ns; adaptive, up to
 *     idle_spin_max_ns: see idle_spin; not after a park that ended by itself), IDLE_PURGE_NS
 *     after its last task
 *     return the library arena's dirty pages (idle_purge), announce BOUNDED (within
 *     IDLE_PURGE_NS of its last task) or PARKED (later),
 *     re-check lanes / kick / stop,
 *     then sleep on the futex until a producer wakes it, the next timer deadline, the purge's
 *     or, when BOUNDED, lazy_wake_ns.
 * Producers enqueue into the lane ring and then wake the parker (no syscall when the shard is
 * running).  Lazy producers (kvr_shard_post_lazy: lifecycle work, whose effect - load released -
 * may lag) wake only a PARKED shard: a BOUNDED one wakes by itself within lazy_wake_ns and finds
 * their tasks, so a finish right after a shard parked costs its caller no FUTEX_WAKE (55-75 us
 * of the caller's time on the VM of docs/measurements.md).  The price: such a task may run up to
 * lazy_wake_ns late, and a shard that had work lately wakes by itself every lazy_wake_ns for up to
 * IDLE_PURGE_NS after it (at most 100 self-wakes per idle period, each a few microseconds of
 * its CPU; none on a busy shard, which never parks).  Invariants:
 *  - only the shard thread dequeues its lanes, fires its timers and touches its userdata;
 *  - a shard never parks with a due timer, a queued message, an unseen kick or a stop request
 *    (sync/park.h explains why no wake-up is lost);
 *  - a BOUNDED park lasts at most lazy_wake_ns, so a lazy task waits at most that long (plus
 *    the shard's scheduling delay) for a shard that sleeps; a PARKED shard is woken by it;
 *  - a soon task is left only to a park bounded by soon_wake_ns (park_soon set before the
 *    park's announcement, read by the poster after its push and a fence), so it waits at most
 *    that long for a shard that sleeps; any other park is woken by it;
 *  - a message whose commit was left to a later one (its producer was descheduled between
 *    reserve and commit: sync/ring.h's tagged slots) is woken for as its own post would have,
 *    by the post whose commit publishes it;
 *  - shutdown: `closed` is set, then an RCU grace period passes, so no producer is still inside
 *    a post (every post runs in an RCU read section that checks `closed` first); after that
 *    the rings only shrink, each thread drains them and exits, and the memory can go.
 *
 * Soon producers (kvr_shard_post_soon: admissions, whose bookings the next decisions read, so
 * they may lag a little but not lazy_wake_ns) wake a shard in any park but a short one: a
 * shard that ran a soon message within SOON_WARM_NS (10 ms) parks for at most soon_wake_ns at
 * a time and says so (park_soon), and soon posts leave such a park asleep.  So a stream of
 * admissions costs its callers no FUTEX_WAKE (bench_route, 128k tokens, 2 shards on 2 cores:
 * 0.6-0.9 wakes per route, 10-40 us each, route p50 median 2.0x the hashing floor -> 0.001
 * wakes, median 1.16x at soon_wake_ns 250 us), the first admission after a lull still wakes it,
 * and a booking waits at most soon_wake_ns (plus the scheduling delay) for a shard that
 * sleeps; the price is a self-wake every soon_wake_ns for 10 ms after the last admission.
 *
 * Paced producers (kvr_shard_post_paced: admissions) first wait at the routing lane's soft
 * depth while the shard keeps taking messages, and spill past it once it has taken none for
 * stall_ns (sync/lane.h decides, pace() below waits): a deep lane makes the decisions that cannot
 * see its bookings stale, a short ring makes a stalled shard fail calls, and a soft depth over a
 * deep ring does neither.
 *
 * Placement: an open-addressing table (linear probing, backward-shift deletion, load <= 1/2)
 * written under a mutex and read without locks under a sequence counter (a seqlock whose
 * readers use acquire loads only, so it is well defined in C11 and visible to TSan).
 */
#include "shards/runtime.h"
#include "shards/cpu_quota.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/limits.h"
#include "sync/park.h"
#include "sync/thread.h"
#include "sync/rcu.h"
#include "sync/nocancel.h"

#define MAX_SHARDS      KVR_LIMIT_SHARDS_MAX
#define BATCH           64
#define TIMER_BATCH     4096
#define PARK_MAX_NS     1000000000ull
#define DEF_CAPACITY    KVR_DEFAULT_LANE_CAPACITY
#define DEF_EVERY       KVR_DEFAULT_MAINT_EVERY_TASKS
#define DEF_EVERY_NS    KVR_DEFAULT_MAINT_EVERY_NS
#define DEF_WORKERS     KVR_DEFAULT_MAX_WORKERS
#define DEF_SPIN_NS     20000ull
#define DEF_IDLE_SPIN   KVR_DEFAULT_SHARD_IDLE_SPIN_NS
#define SLOT_USED       (1ull << 63)
#define CALL_KINDS      8   /* call functions whose reply delay each shard remembers */
#define SPIN_MAX_FACTOR 8   /* idle_spin_max_ns = 0: this many idle_spin_ns */
#define SHORT_NEED      192 /* short_frac (1/256) at which a shard spins spin_max_ns / 2 */

/* A timer-bound park's floor while the router's clock stands still (a virtual clock,
 * kvr_config.now_ns, stopped short of a timer: see shard_loop), doubling from the first up to
 * the second. */
#define STALL_PARK_MIN_NS 1000000ull
#define STALL_PARK_MAX_NS 16000000ull

/* A shard that has run no message for this long returns the library arena's dirty pages
 * (kvr_alloc_purge_idle), so an idle router's RSS follows what it has allocated; a busy one
 * never waits that long and leaves the pages to jemalloc's decay (purging on every free, decay
 * 0, halved the shards' tasks per CPU second at 32k-token prompts in bench_route). */
#define IDLE_PURGE_NS 100000000ull

/* A shard that ran a soon message (kvr_shard_post_soon) within this long parks for at most
 * soon_wake_ns at a time.  See kvr_shards_config.soon_wake_ns for why this long. */
#define SOON_WARM_NS 10000000ull

/* What a synchronous call's reply delay has been (post to reply posted), per call function:
 * see kvr_shard_call.  Written by callers with relaxed atomics; a racy pair (fn of one caller,
 * delay of another) only makes one guess wrong. */
struct call_kind {
	uintptr_t fn;
	uint64_t delay_ns; /* moving average, 1/8 weight per call */
};

/* A post a shard's thread made on a full lane and must neither drop nor wait for
 * (kvr_shard_post_later): kept by that thread, oldest first, and pushed from its loop. */
struct later_post {
	struct later_post *next;
	struct kvr_shard *to;
	enum kvr_lane lane;
	kvr_task_fn fn;
	uint32_t len;
	unsigned char payload[KVR_SHARD_PAYLOAD];
};

struct kvr_shard {
	/* read by producers on every post; written once at shutdown */
	_Alignas(64) struct kvr_shards *rt;
	uint32_t index;
	uint32_t closed;
	struct kvr_lanes lanes;
	struct kvr_parker park;
	/* written by synchronous callers (kvr_shard_call) */
	_Alignas(64) struct call_kind calls[CALL_KINDS];
	/* shard-thread state */
	_Alignas(64) struct kvr_timers timers;
	void *userdata;
	uint64_t seen_kick; /* atomic: last kick generation whose clock reading was processed */
	uint32_t stopping;  /* atomic: set by shutdown after the grace period */
	uint64_t calls_inline;
	bool worked;         /* shard thread: ran a message since it last went idle */
	uint64_t idle_ns;    /* shard thread: mono_ns() when it went idle after work, 0 = purged */
	uint64_t spin_ns;    /* time spent in idle_spin (atomic: stats read it) */
	uint64_t spin_now;   /* shard thread: this idle period's spin (adaptive, <= spin_max_ns) */
	uint32_t short_frac; /* shard thread: idle periods ended by work within spin_max_ns / 2,
	                      * a moving average in 1/256 (see idle_spin) */
	bool self_woke;      /* shard thread: its last park ended by itself, no message since */
	uint64_t park_now;   /* shard thread: the clock read before its last timer-bound park */
	uint64_t stall_ns;   /* shard thread: that park's floor while the clock stands still */
	bool ran_soon;       /* shard thread: ran a soon message since it last went idle */
	uint64_t soon_last;  /* shard thread: mono_ns() when it went idle after one, 0 = never */
	uint32_t park_soon;  /* atomic: the park being entered is bounded by soon_ns (see post) */
	bool has_held;       /* shard thread: held is the next message (see shard_loop) */
	/* The latest router time its timers and tasks ran at: written by the shard thread, read
	 * (atomic) by kvr_shard_settle_timers, where it bounds what queued work may run at. */
	uint64_t time_hw;
	/* The shard whose reply this shard's thread waits for in kvr_shard_call (a router callback
	 * on it, the clock, calling the API), NULL otherwise.  Written by the thread, read by other
	 * shards' threads looking for a cycle (wait_edge_add); seq_cst both. */
	struct kvr_shard *waits_for;
	struct kvr_msg held;
	struct later_post *later, *later_last; /* shard thread: kvr_shard_post_later's */
	uint32_t later_n; /* atomic: how many (written by the shard thread; quiesce reads it) */
	/* Timed posts (kvr_shard_post_at): counted by producers before the push, by the shard
	 * after the task ran (or by a producer whose push failed); kvr_shard_settle compares. */
	_Alignas(64) uint64_t timed_posted;
	uint64_t timed_last_at; /* the latest time a timed post carried (producers, atomic max) */
	_Alignas(64) uint64_t timed_applied;
	uint64_t timer_next;    /* atomic: the shard's next timer deadline (UINT64_MAX: none) */
	uint64_t bounded_parks; /* atomic (stats): parks bounded by lazy_wake_ns */
	uint64_t lazy_found;    /* atomic (stats): ... that ended by themselves and found work */
	uint64_t soon_parks;    /* atomic (stats): parks bounded by soon_wake_ns */
	uint64_t timers_fired;  /* atomic copies of the timer set's counters, for stats */
	uint32_t timers_pending;
	pthread_t thread;
	int cpu;
	bool pinned;
	bool started;
};

struct place_slot {
	uint64_t key;
	uint64_t val; /* 0 = empty; else SLOT_USED | ranks << 32 | shard */
};

struct kvr_shards {
	uint32_t n;
	struct kvr_shard **shard;
	struct kvr_clock clock;
	uint64_t spin_ns;
	uint64_t idle_spin_ns;
	uint64_t spin_max_ns; /* >= idle_spin_ns: see idle_spin */
	uint64_t lazy_ns;     /* bound of a BOUNDED park; 0 = lazy posts wake like any */
	uint64_t soon_ns;     /* bound of a park after soon work; 0 = soon posts wake like any */
	uint64_t stall_ns;    /* paced posts spill after the shard took nothing this long */
	void (*on_start)(struct kvr_shard *, void *);
	void (*on_stop)(struct kvr_shard *, void *);
	void (*on_idle)(struct kvr_shard *, void *);
	void *ctx;
	_Alignas(64) uint64_t kick_gen;
	uint32_t closed;
	uint32_t shut_done;
	pthread_mutex_t shut_mu;
	/* start-up handshake */
	pthread_mutex_t start_mu;
	pthread_cond_t start_cv;
	uint32_t n_started;
	uint32_t n_offline; /* shards that could not register with RCU */
	/* placement */
	struct place_slot *slots;
	uint32_t place_mask;
	uint32_t n_workers;
	uint32_t max_workers;
	uint32_t *ranks;   /* per shard, atomic */
	uint32_t *workers; /* per shard, atomic */
	pthread_mutex_t place_mu;
};

static _Thread_local struct kvr_shard *tls_shard;
/* The shard this (shard) thread said it will wait for (kvr_shard_wait_intent), until
 * kvr_shard_wait_intent_end: the edge every call in between leaves behind when it ends. */
static _Thread_local struct kvr_shard *tls_intent;
static _Thread_local uint32_t tls_intent_depth; /* intents begun on this thread, not ended */
static _Thread_local uint32_t tls_inline_calls; /* calls run inline, inside a task, not ended */
/* This thread's posts that found a lane full and waited, paced posts that waited at the soft
 * depth or spilled past it, and the sleeps of those waits. */
static _Thread_local uint64_t tls_full_waits, tls_wait_sleeps, tls_throttles, tls_spills;
/* While a timed task (and the timers due before it) runs: its time, and tls_task_timed set (a
 * flag of its own: with 0 for "none", a task timed at 0, a virtual clock's start, read 1). */
static _Thread_local uint64_t tls_task_ns;
static _Thread_local bool tls_task_timed;

/* aux of a timed message: its payload starts with the router time it was posted at. */
#define MSG_TIMED 1u
/* aux of a soon message (kvr_shard_post_soon): running one keeps the shard's parks short. */
#define MSG_SOON 2u

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ the shard loop */

static void run_msg(struct kvr_shard *sh, struct kvr_msg *m)
{
	kvr_task_fn fn = (kvr_task_fn)m->fn; /* posted as kvr_task_fn, cast back */
	fn(sh, m->payload);
}

static void publish_timers(struct kvr_shard *sh)
{
	__atomic_store_n(&sh->timers_fired, sh->timers.fired, __ATOMIC_RELAXED);
	__atomic_store_n(&sh->timers_pending, sh->timers.n_heap, __ATOMIC_RELAXED);
	__atomic_store_n(&sh->timer_next, kvr_timers_next(&sh->timers), __ATOMIC_RELEASE);
}

/* A timed message (kvr_shard_post_at) runs at the time it was posted at, as if its poster had
 * waited for it: the timers due by then fire first, at that time, and the task reads that time
 * (kvr_shard_task_time).  A time older than one the shard already ran at (posters on several
 * threads) is taken as that one, so the shard's time never goes back.  Returns the timers
 * fired. */
static uint32_t run_timed(struct kvr_shard *sh, struct kvr_msg *m)
{
	uint64_t at;
	memcpy(&at, m->payload, sizeof(at));
	if (at < sh->time_hw)
		at = sh->time_hw;
	__atomic_store_n(&sh->time_hw, at, __ATOMIC_RELEASE);
	tls_task_ns = at;
	tls_task_timed = true;
	uint32_t fired = 0, f;
	do {
		f = kvr_timers_run(&sh->timers, at, sh, TIMER_BATCH);
		fired += f;
	} while (f == TIMER_BATCH);
	if (fired)
		publish_timers(sh);
	kvr_task_fn fn = (kvr_task_fn)m->fn;
	fn(sh, m->payload + sizeof(at));
	tls_task_timed = false;
	/* Release: kvr_shard_settle's acquire load then sees the task's writes. */
	__atomic_fetch_add(&sh->timed_applied, 1, __ATOMIC_RELEASE);
	return fired;
}

/* The next message: the one held back, else the lanes' next. */
static bool take(struct kvr_shard *sh, struct kvr_msg *m)
{
	if (sh->has_held) {
		*m = sh->held;
		sh->has_held = false;
		return true;
	}
	return kvr_lanes_pop(&sh->lanes, m) >= 0;
}

static bool may_park(struct kvr_shard *sh, uint64_t g)
{
	return !sh->has_held && kvr_lanes_empty(&sh->lanes) &&
	       __atomic_load_n(&sh->rt->kick_gen, __ATOMIC_ACQUIRE) == g &&
	       !__atomic_load_n(&sh->stopping, __ATOMIC_ACQUIRE);
}

/* The calling thread's CPU time (a syscall: once per idle period, off the busy path). */
static uint64_t thread_cpu_ns(void)
{
	struct timespec ts;
	if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts))
		return 0;
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Polls for work for spin ns from t0.  Returns true if still idle (go park).
 *
 * Adaptive: a spin pays only when work comes before it ends.  One that ran out halves the next
 * (below an eighth of idle_spin_ns: none), so a shard whose idle periods outlast the spin (a
 * steady 5000 admissions/s is one every 200 us against the 50 us default) stops burning CPU on
 * it; an idle period shorter than idle_spin_ns (spun through, or seen after a park: a wake-up
 * that a spin would have spared) restores the full spin.  A parked shard costs its producer a
 * FUTEX_WAKE either way once the gap outlasts the spin.
 *
 * Longer, while traffic keeps coming close together: when at least 3/4 of the recent idle
 * periods (a moving average, 1/8 weight: note_idle) ended with work within idle_spin_max_ns / 2
 * - caught by a spin, or a producer's wake after a park - the shard spins that long (200 us by
 * default), so the next message finds it awake.  That is a stream a little sparser than the
 * spin: long prompts, whose hashing takes the frontend 40-100 us, over few shards.  A sparser
 * or irregular stream mostly does not qualify.  The first version (1.5x the last short idle
 * period, up to idle_spin_max_ns, after two in a row) spun 60-140 us per route at 5,000
 * routes/s paced over 2 shards; this one 2-60 us, with the same gain at 128k tokens
 * (docs/measurements.md, "Admissions of long prompts"); requiring 7/8 instead spun less still but
 * kept half of the 128k wakes.  Past idle_spin_ns the spin yields the CPU (sched_yield) between
 * polls, so a frontend that shares the core is not kept off it. */
static bool idle_spin(struct kvr_shard *sh, uint64_t g, uint64_t t0, uint64_t spin)
{
	uint64_t c0 = thread_cpu_ns();
	uint64_t base = sh->rt->idle_spin_ns;
	bool idle = false;
	while (may_park(sh, g)) {
		uint64_t t = mono_ns() - t0;
		if (t >= base)
			sched_yield();
		else
			for (int i = 0; i < 16; i++)
				kvr_cpu_relax();
		if (t >= spin) {
			idle = true;
			break;
		}
	}
	/* CPU, not wall time: a spinning shard preempted on a busy machine burns none. */
	__atomic_store_n(&sh->spin_ns, sh->spin_ns + (thread_cpu_ns() - c0), __ATOMIC_RELAXED);
	return idle;
}

/* The late purge: the frees that reach the arenas from the RCU callback thread (index runs
 * and pinned runs the shards' last commands retired) can come after the shard's idle purge and
 * would stay dirty until the next one (bench_footprint: 3-4 B per (block, rank) at read time,
 * some runs).  So the idle purge also queues a purge behind them on that thread: call_rcu runs
 * callbacks in the order they were queued, after a grace period.  One in flight at a time. */
static struct rcu_head late_purge_head;
static int late_purge_queued;

static void late_purge_cb(struct rcu_head *h)
{
	KVR_RCU_CALLBACK_ENTER();
	(void)h;
	kvr_alloc_purge();
	__atomic_store_n(&late_purge_queued, 0, __ATOMIC_RELEASE);
}

/* One idle period ended after d ns (UINT64_MAX: by itself, with no producer's work). */
static void note_idle(struct kvr_shard *sh, uint64_t d)
{
	bool short_idle = d <= sh->rt->spin_max_ns / 2;
	sh->short_frac = sh->short_frac - sh->short_frac / 8 + (short_idle ? 32 : 0);
}

/* Called before each park: IDLE_PURGE_NS after the shard last went idle following work, it
 * purges (kvr_alloc_purge_idle) and returns 0; otherwise the nanoseconds left until then
 * (UINT64_MAX: nothing to purge, no work since the last purge). */
static uint64_t idle_purge(struct kvr_shard *sh)
{
	uint64_t t = mono_ns();
	if (sh->worked) {
		sh->worked = false;
		sh->idle_ns = t ? t : 1;
	}
	if (!sh->idle_ns)
		return UINT64_MAX;
	if (t - sh->idle_ns < IDLE_PURGE_NS)
		return IDLE_PURGE_NS - (t - sh->idle_ns);
	sh->idle_ns = 0;
	if (sh->rt->on_idle)
		sh->rt->on_idle(sh, sh->rt->ctx); /* before the purge, which takes what it frees */
	kvr_lanes_trim(&sh->lanes);     /* the routing ring's pages (sync/lane.h: idle trim) */
	kvr_alloc_flush_thread_cache(); /* first: the purge can then take their pages */
	kvr_alloc_purge_idle(t);
	if (!__atomic_exchange_n(&late_purge_queued, 1, __ATOMIC_ACQ_REL))
		kvr_rcu_call(&late_purge_head, late_purge_cb);
	return 0;
}

static bool later_flush(struct kvr_shard *self);

/* How long a shard with posts kept on full lanes parks at most before it tries them again. */
#define LATER_RETRY_NS 20000u

static void shard_loop(struct kvr_shard *sh)
{
	struct kvr_shards *rt = sh->rt;
	struct kvr_msg m;
	for (;;) {
		uint64_t g = __atomic_load_n(&rt->kick_gen, __ATOMIC_ACQUIRE);
		uint64_t now = kvr_clock_now(&rt->clock);
		/* The clock first, then the lanes: a timed message posted before a clock advance
		 * this reading saw is in the lanes now (see run_timed).  If the next message is
		 * timed, the timers wait for its time: firing them at now would run them ahead of
		 * work posted earlier, at an earlier time. */
		bool have = take(sh, &m);
		uint32_t fired = 0;
		if (!have || !(m.aux & MSG_TIMED)) {
			fired = kvr_timers_run(&sh->timers, now, sh, TIMER_BATCH);
			if (fired)
				publish_timers(sh);
			if (now > sh->time_hw)
				__atomic_store_n(&sh->time_hw, now, __ATOMIC_RELEASE);
			__atomic_store_n(&sh->seen_kick, g, __ATOMIC_RELEASE);
		}
		uint32_t n = 0;
		while (have) {
			bool timed = m.aux & MSG_TIMED;
			sh->ran_soon |= (m.aux & MSG_SOON) != 0;
			if (timed)
				fired += run_timed(sh, &m);
			else
				run_msg(sh, &m);
			if (++n >= BATCH || !(have = take(sh, &m)))
				break;
			if (timed && !(m.aux & MSG_TIMED)) {
				/* An untimed message (a synchronous call) after timed work: it runs
				 * after a fresh clock reading and the timers due by then, as it
				 * would have had the timed work been waited for. */
				sh->held = m;
				sh->has_held = true;
				break;
			}
		}
		if (__atomic_load_n(&sh->stopping, __ATOMIC_ACQUIRE))
			return;
		/* Posts kept on full lanes (kvr_shard_post_later): while some are left, parks
		 * are short (the full shard may be waiting for this one's answer meanwhile). */
		bool owed = sh->later && later_flush(sh);
		if (n) {
			sh->worked = true;
			sh->self_woke = false;
		}
		if (n || fired)
			continue;
		uint64_t next = kvr_timers_next(&sh->timers);
		if (next <= now)
			continue;
		uint64_t idle0 = rt->idle_spin_ns ? mono_ns() : 0;
		/* After a park that ended by itself (a timeout: lazy_wake_ns, a timer, the purge)
		 * nobody is waiting on a quick answer: no spin. */
		uint64_t spin = sh->spin_now;
		if (sh->short_frac >= SHORT_NEED && spin < rt->spin_max_ns / 2)
			spin = rt->spin_max_ns / 2; /* a close stream: see idle_spin */
		/* The spin polls the lanes, not the timers: it ends at the next one (a spin of
		 * hours, which shard_idle_spin_ns allows, kept the lease reaper and TTL expiry
		 * from running while no message came: test_limits). */
		if (next != UINT64_MAX && spin > next - now)
			spin = next - now;
		if (spin && !sh->self_woke) {
			if (!idle_spin(sh, g, idle0, spin)) {
				note_idle(sh, mono_ns() - idle0);
				if (sh->spin_now < rt->idle_spin_ns)
					sh->spin_now = rt->idle_spin_ns; /* it paid */
				continue;
			}
			sh->spin_now /= 2;
			if (sh->spin_now < rt->idle_spin_ns / 8)
				sh->spin_now = 0;
		}
		uint64_t purge_in = idle_purge(sh);
		if (purge_in == 0)
			continue; /* it purged: look at the lanes again before parking */
		/* Within IDLE_PURGE_NS of its last message (purge_in finite) the shard parks for at
		 * most lazy_ns at a time, and lazy posts need not wake it; within SOON_WARM_NS of
		 * a soon message, for at most soon_ns, and soon posts need not wake it either.  The
		 * store comes before the parker's announcement (a full barrier): a soon post that
		 * reads the flag after its push (and a fence) reads this park's, or the lanes
		 * check below finds its message (post() says why). */
		bool bounded = rt->lazy_ns && purge_in != UINT64_MAX;
		bool soon = false;
		if (bounded && rt->soon_ns) {
			uint64_t t = mono_ns();
			if (sh->ran_soon) {
				sh->ran_soon = false;
				sh->soon_last = t ? t : 1;
			}
			soon = sh->soon_last && t - sh->soon_last < SOON_WARM_NS;
		}
		if (soon != (bool)__atomic_load_n(&sh->park_soon, __ATOMIC_RELAXED))
			__atomic_store_n(&sh->park_soon, soon, __ATOMIC_SEQ_CST);
		if (bounded)
			kvr_parker_prepare_bounded(&sh->park);
		else
			kvr_parker_prepare(&sh->park);
		if (!may_park(sh, g)) {
			kvr_parker_cancel(&sh->park);
			continue;
		}
		uint64_t timeout = UINT64_MAX;
		if (next != UINT64_MAX) {
			timeout = next - now < PARK_MAX_NS ? next - now : PARK_MAX_NS;
			/* A virtual clock stopped short of the timer (a paused simulation) left the
			 * same few ns each time: parks of the timer slack, 13,000 clock reads and
			 * 20 % of a core per second (tests/unit/test_regress.c
			 * a_stopped_virtual_clock_short_of_a_timer_does_not_spin_the_shard).  So
			 * while the clock stands still across parks that ended by themselves, the
			 * park is 1 ms at least and doubles up to 16 ms: nothing wakes a shard when
			 * a virtual clock moves, so that is how late its timers may then fire (a
			 * message, such as kvr_router_sync's, wakes it at once).  A clock that
			 * moves never stalls. */
			if (sh->self_woke && now == sh->park_now) {
				sh->stall_ns = !sh->stall_ns ? STALL_PARK_MIN_NS
				               : sh->stall_ns < STALL_PARK_MAX_NS
				                   ? 2 * sh->stall_ns
				                   : STALL_PARK_MAX_NS;
				if (timeout < sh->stall_ns)
					timeout = sh->stall_ns;
			} else {
				sh->stall_ns = 0;
			}
			sh->park_now = now;
		}
		if (purge_in < timeout)
			timeout = purge_in;
		if (bounded && rt->lazy_ns < timeout)
			timeout = rt->lazy_ns;
		if (soon && rt->soon_ns < timeout)
			timeout = rt->soon_ns;
		if (owed && timeout > LATER_RETRY_NS)
			timeout = LATER_RETRY_NS;
		bool woken = kvr_parker_wait(&sh->park, timeout);
		sh->self_woke = !woken;
		if (soon)
			__atomic_store_n(&sh->soon_parks, sh->soon_parks + 1, __ATOMIC_RELAXED);
		if (bounded) {
			__atomic_store_n(&sh->bounded_parks, sh->bounded_parks + 1,
			                 __ATOMIC_RELAXED);
			if (!woken && !kvr_lanes_empty(&sh->lanes))
				__atomic_store_n(&sh->lazy_found, sh->lazy_found + 1,
				                 __ATOMIC_RELAXED);
		}
		if (rt->idle_spin_ns) {
			uint64_t d = woken ? mono_ns() - idle0 : UINT64_MAX;
			note_idle(sh, d); /* a spin of d would have spared the wake-up */
			if (d < rt->idle_spin_ns)
				sh->spin_now = rt->idle_spin_ns;
		}
	}
}

static void *shard_main(void *arg)
{
	struct kvr_shard *sh = arg;
	struct kvr_shards *rt = sh->rt;
	tls_shard = sh;
	kvr_alloc_thread_cache_begin(); /* the shard allocates and frees all the time */
	sh->spin_now = rt->idle_spin_ns;
	/* A shard writes the index, whose frees need a registered thread (call_rcu): one that
	 * cannot be registered (pthread keys exhausted) fails kvr_shards_create. */
	bool offline = kvr_rcu_thread_online() != 0;
	if (sh->cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(sh->cpu, &set);
		sh->pinned = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
	}
	if (rt->on_start)
		rt->on_start(sh, rt->ctx);
	pthread_mutex_lock(&rt->start_mu);
	rt->n_started++;
	rt->n_offline += offline;
	pthread_cond_broadcast(&rt->start_cv);
	pthread_mutex_unlock(&rt->start_mu);

	shard_loop(sh);

	/* Drain: every post after `closed` fails, so the rings only shrink. */
	struct kvr_msg m;
	while (take(sh, &m)) {
		if (m.aux & MSG_TIMED)
			run_timed(sh, &m);
		else
			run_msg(sh, &m);
	}
	/* Posts kept on full lanes: pushed, or dropped once their shard is closed (as every
	 * shard is by now, whose posts fail: the router goes away with their work). */
	while (sh->later && later_flush(sh)) {
		struct timespec ts = {0, 10000};
		nanosleep(&ts, NULL);
	}
	if (rt->on_stop)
		rt->on_stop(sh, rt->ctx);
	kvr_timers_fini(&sh->timers); /* pending timers are dropped unfired */
	tls_shard = NULL;
	kvr_alloc_thread_cache_end();
	kvr_rcu_thread_offline();
	return NULL;
}

/* ------------------------------------------------------------------ create / destroy */

static uint32_t default_cpus(int *cpus, uint32_t max)
{
	cpu_set_t set;
	uint32_t n = 0;
	if (sched_getaffinity(0, sizeof(set), &set) != 0)
		return 0;
	for (int c = 0; c < CPU_SETSIZE && n < max; c++)
		if (CPU_ISSET(c, &set))
			cpus[n++] = c;
	return n;
}

static void free_all(struct kvr_shards *s)
{
	for (uint32_t i = 0; s->shard && i < s->n; i++) {
		struct kvr_shard *sh = s->shard[i];
		if (!sh)
			continue;
		kvr_lanes_fini(&sh->lanes);
		kvr_timers_fini(&sh->timers);
		kvr_free_aligned(sh, sizeof(*sh));
	}
	kvr_free(s->shard, (size_t)s->n * sizeof(*s->shard));
	kvr_free(s->slots, ((size_t)s->place_mask + 1) * sizeof(*s->slots));
	kvr_free(s->ranks, (size_t)s->n * sizeof(*s->ranks));
	kvr_free(s->workers, (size_t)s->n * sizeof(*s->workers));
	pthread_mutex_destroy(&s->place_mu);
	pthread_mutex_destroy(&s->start_mu);
	pthread_mutex_destroy(&s->shut_mu);
	pthread_cond_destroy(&s->start_cv);
	kvr_free_aligned(s, sizeof(*s));
}

uint64_t kvr_shards_memory_bytes(const struct kvr_shards *s)
{
	if (!s)
		return 0;
	uint64_t b = kvr_alloc_real_size_aligned(sizeof(*s)) +
	             kvr_alloc_real_size(((size_t)s->place_mask + 1) * sizeof(*s->slots)) +
	             kvr_alloc_real_size(s->n * sizeof(*s->shard)) +
	             kvr_alloc_real_size(s->n * sizeof(*s->ranks)) +
	             kvr_alloc_real_size(s->n * sizeof(*s->workers));
	for (uint32_t i = 0; i < s->n; i++) {
		const struct kvr_shard *sh = s->shard[i];
		b += kvr_alloc_real_size_aligned(sizeof(*sh));
		for (int k = 0; k < KVR_LANE_COUNT; k++)
			b += kvr_alloc_real_size_aligned((size_t)sh->lanes.ring[k].size *
			                                 sizeof(struct kvr_msg));
	}
	return b;
}

int kvr_shards_create(const struct kvr_shards_config *cfg, struct kvr_shards **out)
{
	if (out)
		*out = NULL;
	if (!cfg || !out || (cfg->n_cpus && !cfg->cpus))
		return KVR_EINVAL;
	if (cfg->n_shards > MAX_SHARDS || cfg->lane_capacity > KVR_LIMIT_LANE_CAPACITY_MAX ||
	    cfg->maint_capacity > KVR_LIMIT_LANE_CAPACITY_MAX ||
	    cfg->lane_soft_depth > KVR_LIMIT_LANE_CAPACITY_MAX ||
	    cfg->max_workers > KVR_LIMIT_WORKERS_MAX)
		return KVR_ERANGE;
	int dcpus[CPU_SETSIZE];
	uint32_t n_dcpus = 0;
	const int *cpus = cfg->cpus;
	size_t n_cpus = cfg->n_cpus;
	if (!cpus) {
		n_dcpus = default_cpus(dcpus, CPU_SETSIZE);
		cpus = dcpus;
		n_cpus = n_dcpus;
	}
	uint32_t n = cfg->n_shards;
	if (!n) {
		/* One per CPU listed or in the affinity mask, but no more than the cgroups' CPU
		 * quota (cpu_quota.h says why; before, a given cpu_list made it one shard). */
		uint32_t quota = kvr_cpu_quota_at(kvr_cpu_quota_root);
		n = n_cpus ? (uint32_t)(n_cpus > MAX_SHARDS ? MAX_SHARDS : n_cpus) : 1;
		if (quota && quota < n)
			n = quota;
	}

	struct kvr_shards *s = kvr_alloc_aligned(sizeof(*s));
	if (!s)
		return KVR_ENOMEM;
	memset(s, 0, sizeof(*s));
	pthread_mutex_init(&s->place_mu, NULL);
	pthread_mutex_init(&s->start_mu, NULL);
	pthread_mutex_init(&s->shut_mu, NULL);
	pthread_cond_init(&s->start_cv, NULL);
	s->n = n;
	s->clock.fn = cfg->now_ns ? cfg->now_ns : kvr_clock_monotonic;
	s->clock.ctx = cfg->clock_ctx;
	s->spin_ns = cfg->call_spin_ns ? cfg->call_spin_ns : DEF_SPIN_NS;
	s->idle_spin_ns = cfg->idle_spin_ns == KVR_SHARDS_NO_SPIN ? 0
	                  : cfg->idle_spin_ns                     ? cfg->idle_spin_ns
	                                                          : DEF_IDLE_SPIN;
	s->spin_max_ns = cfg->idle_spin_max_ns == KVR_SHARDS_NO_SPIN ? s->idle_spin_ns
	                 : cfg->idle_spin_max_ns                     ? cfg->idle_spin_max_ns
	                 : s->idle_spin_ns > UINT64_MAX / SPIN_MAX_FACTOR
	                     ? UINT64_MAX - 1 /* saturated: 8x a spin of centuries */
	                     : SPIN_MAX_FACTOR * s->idle_spin_ns;
	if (s->spin_max_ns < s->idle_spin_ns)
		s->spin_max_ns = s->idle_spin_ns;
	s->lazy_ns = cfg->lazy_wake_ns == KVR_SHARDS_NO_SPIN ? 0
	             : cfg->lazy_wake_ns                     ? cfg->lazy_wake_ns
	                                                     : KVR_DEFAULT_SHARD_LAZY_WAKE_NS;
	s->soon_ns = cfg->soon_wake_ns == KVR_SHARDS_NO_SPIN ? 0 : cfg->soon_wake_ns;
	if (!s->lazy_ns || s->soon_ns > s->lazy_ns)
		s->soon_ns = s->lazy_ns; /* a bounded park is the soon park: never longer */
	s->on_start = cfg->on_thread_start;
	s->on_stop = cfg->on_thread_stop;
	s->on_idle = cfg->on_idle;
	s->ctx = cfg->ctx;
	s->stall_ns = cfg->lane_stall_ns ? cfg->lane_stall_ns : KVR_DEFAULT_LANE_STALL_NS;
	s->max_workers = cfg->max_workers ? cfg->max_workers : DEF_WORKERS;
	uint32_t tsize = 4;
	while (tsize < 2 * s->max_workers)
		tsize <<= 1;
	s->place_mask = tsize - 1;
	s->slots = kvr_calloc(tsize, sizeof(*s->slots));
	s->shard = kvr_calloc(n, sizeof(*s->shard));
	s->ranks = kvr_calloc(n, sizeof(*s->ranks));
	s->workers = kvr_calloc(n, sizeof(*s->workers));
	if (!s->slots || !s->shard || !s->ranks || !s->workers) {
		free_all(s);
		return KVR_ENOMEM;
	}
	uint32_t cap = cfg->lane_capacity ? cfg->lane_capacity : DEF_CAPACITY;
	uint32_t maint_cap = cfg->maint_capacity ? cfg->maint_capacity : cap;
	uint32_t every = cfg->maint_every_tasks ? cfg->maint_every_tasks : DEF_EVERY;
	uint64_t every_ns = cfg->maint_every_ns ? cfg->maint_every_ns : DEF_EVERY_NS;
	for (uint32_t i = 0; i < n; i++) {
		struct kvr_shard *sh = kvr_alloc_aligned(sizeof(*sh));
		if (!sh) {
			free_all(s);
			return KVR_ENOMEM;
		}
		memset(sh, 0, sizeof(*sh));
		s->shard[i] = sh;
		sh->rt = s;
		sh->index = i;
		sh->cpu = n_cpus ? cpus[i % n_cpus] : -1;
		sh->timer_next = UINT64_MAX;
		kvr_parker_init(&sh->park);
		kvr_timers_init(&sh->timers);
		int rc =
		    kvr_lanes_init_sized(&sh->lanes, cap, maint_cap, every, every_ns, NULL, NULL);
		if (rc) {
			free_all(s);
			return rc;
		}
		kvr_lanes_set_soft_depth(&sh->lanes, cfg->lane_soft_depth);
	}
	for (uint32_t i = 0; i < n; i++) {
		if (kvr_thread_start(&s->shard[i]->thread, false, shard_main, s->shard[i]) != 0) {
			kvr_shards_destroy(s);
			return KVR_EAGAIN; /* the process's thread limit, most likely */
		}
		s->shard[i]->started = true;
	}
	pthread_mutex_lock(&s->start_mu);
	while (s->n_started < n)
		pthread_cond_wait(&s->start_cv, &s->start_mu);
	uint32_t offline = s->n_offline;
	pthread_mutex_unlock(&s->start_mu);
	if (offline) {
		kvr_shards_destroy(s);
		return KVR_ENOMEM;
	}
	*out = s;
	return 0;
}

void kvr_shards_shutdown(struct kvr_shards *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&s->shut_mu);
	if (s->shut_done) {
		pthread_mutex_unlock(&s->shut_mu);
		return;
	}
	__atomic_store_n(&s->closed, 1, __ATOMIC_SEQ_CST);
	for (uint32_t i = 0; i < s->n; i++)
		__atomic_store_n(&s->shard[i]->closed, 1, __ATOMIC_SEQ_CST);
	/* Every post checks `closed` inside a read section: after this, none is in flight. */
	kvr_rcu_synchronize();
	KVR_TSAN_ACQUIRE(&kvr_rcu_tsan_token);
	for (uint32_t i = 0; i < s->n; i++) {
		struct kvr_shard *sh = s->shard[i];
		__atomic_store_n(&sh->stopping, 1, __ATOMIC_SEQ_CST);
		kvr_parker_wake(&sh->park);
	}
	for (uint32_t i = 0; i < s->n; i++)
		if (s->shard[i]->started)
			pthread_join(s->shard[i]->thread, NULL);
	s->shut_done = 1;
	pthread_mutex_unlock(&s->shut_mu);
}

void kvr_shards_orphan(struct kvr_shards *s)
{
	if (!s)
		return;
	/* No grace period, no join: the threads are not in this process, and nothing else is. */
	__atomic_store_n(&s->closed, 1, __ATOMIC_SEQ_CST);
	for (uint32_t i = 0; i < s->n; i++)
		__atomic_store_n(&s->shard[i]->closed, 1, __ATOMIC_SEQ_CST);
}

void kvr_shards_destroy(struct kvr_shards *s)
{
	if (!s)
		return;
	kvr_shards_shutdown(s);
	free_all(s);
}

uint32_t kvr_shards_count(const struct kvr_shards *s)
{
	return s ? s->n : 0;
}

struct kvr_shard *kvr_shards_get(struct kvr_shards *s, uint32_t i)
{
	return s && i < s->n ? s->shard[i] : NULL;
}

uint32_t kvr_shard_index(const struct kvr_shard *sh)
{
	return sh->index;
}

struct kvr_shards *kvr_shard_runtime(struct kvr_shard *sh)
{
	return sh->rt;
}

struct kvr_shard *kvr_shard_current(void)
{
	return tls_shard;
}

void kvr_shard_note_work(struct kvr_shard *sh)
{
	if (sh)
		sh->worked = true; /* read by idle_purge, on this thread */
}

void *kvr_shard_userdata(struct kvr_shard *sh)
{
	return sh->userdata;
}

void kvr_shard_set_userdata(struct kvr_shard *sh, void *data)
{
	sh->userdata = data;
}

uint64_t kvr_shards_now(const struct kvr_shards *s)
{
	return kvr_clock_now(&s->clock);
}

/* ------------------------------------------------------------------ placement */

static uint32_t slot_of(const struct kvr_shards *s, uint64_t key)
{
	return (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 32) & s->place_mask;
}

/* Index of worker_id's slot or of the empty slot ending its probe.  Writer side (mutex). */
static uint32_t find_slot(const struct kvr_shards *s, uint64_t key)
{
	uint32_t i = slot_of(s, key);
	while (s->slots[i].val && s->slots[i].key != key)
		i = (i + 1) & s->place_mask;
	return i;
}

static void add_u32(uint32_t *p, int32_t d)
{
	__atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + (uint32_t)d, __ATOMIC_RELAXED);
}

int kvr_shards_place(struct kvr_shards *s, uint64_t worker_id, uint32_t *shard_out)
{
	if (!s || !shard_out)
		return KVR_EINVAL;
	if (__atomic_load_n(&s->closed, __ATOMIC_ACQUIRE))
		return KVR_ESHUTDOWN;
	pthread_mutex_lock(&s->place_mu);
	int rc = 0;
	uint32_t i = find_slot(s, worker_id);
	struct place_slot *sl = &s->slots[i];
	uint32_t shard;
	if (sl->val) {
		/* Another rank of a placed worker: same shard, one more rank (the shard bits do
		 * not change, so readers need no sequence bump). */
		shard = (uint32_t)sl->val;
		if (((sl->val >> 32) & 0x7fffffffu) == 0x7fffffffu) {
			rc = KVR_ERANGE;
			goto out;
		}
		__atomic_store_n(&sl->val, sl->val + (1ull << 32), __ATOMIC_RELEASE);
	} else {
		if (s->n_workers >= s->max_workers) {
			rc = KVR_ERANGE;
			goto out;
		}
		shard = 0;
		for (uint32_t k = 1; k < s->n; k++)
			if (s->ranks[k] < s->ranks[shard])
				shard = k;
		/* Filling an empty slot cannot confuse a reader (key is stored before val). */
		__atomic_store_n(&sl->key, worker_id, __ATOMIC_RELEASE);
		__atomic_store_n(&sl->val, SLOT_USED | (1ull << 32) | shard, __ATOMIC_RELEASE);
		s->n_workers++;
		add_u32(&s->workers[shard], 1);
	}
	add_u32(&s->ranks[shard], 1);
	*shard_out = shard;
out:
	pthread_mutex_unlock(&s->place_mu);
	return rc;
}

int kvr_shards_unplace(struct kvr_shards *s, uint64_t worker_id)
{
	if (!s)
		return KVR_EINVAL;
	pthread_mutex_lock(&s->place_mu);
	uint32_t i = find_slot(s, worker_id);
	struct place_slot *sl = &s->slots[i];
	if (!sl->val) {
		pthread_mutex_unlock(&s->place_mu);
		return KVR_ENOENT;
	}
	uint32_t shard = (uint32_t)sl->val;
	add_u32(&s->ranks[shard], -1);
	if (((sl->val >> 32) & 0x7fffffffu) > 1) {
		__atomic_store_n(&sl->val, sl->val - (1ull << 32), __ATOMIC_RELEASE);
		pthread_mutex_unlock(&s->place_mu);
		return 0;
	}
	/* Last rank: backward-shift deletion (the table is read and written under place_mu only:
	 * the router keeps each rank's shard in its rank table, so nobody looks a worker up). */
	uint32_t hole = i, j = i;
	for (;;) {
		j = (j + 1) & s->place_mask;
		uint64_t v = s->slots[j].val;
		if (!v)
			break;
		uint32_t home = slot_of(s, s->slots[j].key);
		/* Move j into the hole if its home is not cyclically in (hole, j]. */
		bool in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
		if (!in_range) {
			__atomic_store_n(&s->slots[hole].key, s->slots[j].key, __ATOMIC_RELEASE);
			__atomic_store_n(&s->slots[hole].val, v, __ATOMIC_RELEASE);
			hole = j;
		}
	}
	__atomic_store_n(&s->slots[hole].val, 0, __ATOMIC_RELEASE);
	s->n_workers--;
	add_u32(&s->workers[shard], -1);
	pthread_mutex_unlock(&s->place_mu);
	return 0;
}

/* ------------------------------------------------------------------ posting and calls */

static int check_post(struct kvr_shard *sh, enum kvr_lane lane, const void *fn, const void *payload,
                      size_t len)
{
	if (!sh || !fn || (unsigned)lane >= KVR_LANE_COUNT || len > KVR_SHARD_PAYLOAD ||
	    (len && !payload))
		return KVR_EINVAL;
	return kvr_rcu_thread_online();
}

/* One step of a poster's wait, the k-th: a spin first, then yields (the shard may share the
 * core), then sleeps doubling from 1 us while below sleep_cap_ns. */
static void wait_step(uint32_t k, uint64_t *sleep_ns, uint64_t sleep_cap_ns)
{
	if (k < 64) {
		kvr_cpu_relax();
	} else if (k < 96) {
		sched_yield();
	} else {
		struct timespec ts = {0, (long)*sleep_ns};
		tls_wait_sleeps++;
		/* Not a cancellation point here: a poster (kvr_route, a lifecycle call) sleeps
		 * inside its RCU read section with an attempt half booked (sync/nocancel.h). */
		int old = kvr_nocancel_begin();
		nanosleep(&ts, NULL);
		kvr_nocancel_end(&old);
		if (*sleep_ns < sleep_cap_ns)
			*sleep_ns *= 2;
	}
}

/* A throttle's sleeps stop doubling at 64 us, about the default stall interval: past it the
 * shard is slow, not stalled (it keeps taking messages), and a poster that sleeps longer only
 * adds to its own wait. */
#define THROTTLE_SLEEP_CAP 50000ull

/* kvr_shard_post_paced's wait at the soft depth (kvr_lanes_soft_check decides; see sync/lane.h).
 * A shard that keeps taking messages makes room within a burst of tasks, so the wait spins,
 * then yields (the shard may share the poster's core: a spin would keep it off) for a stall
 * interval, by whose end a stopped shard has been seen, and sleeps only after that (a slow
 * one): a nanosleep lasts 50 us or more (timer slack).  Neither a yield nor a sleep is short on
 * a machine with more runnable threads than cores (bench_route, 2k tokens, load 5-10 on 2
 * cores: a throttled route's p50 80-400 us); a spin-only wait, tried, kept the shard that shares
 * the poster's core off it, so posts spilled (0.74-0.97 per route) and the lane filled as if
 * there were no soft depth.  Returns 0 (post now: below the soft depth, or spill) or
 * KVR_ESHUTDOWN.  Context: post(), inside its RCU read section, off the shard threads. */
static int pace(struct kvr_shard *sh, unsigned *how)
{
	struct kvr_lane_soft w = {0};
	uint64_t sleep_ns = 1000, stall_ns = sh->rt->stall_ns;
	for (uint32_t k = 0;; k++) {
		/* The lanes' clock: the one the shard stamps its takes with. */
		uint64_t now = sh->lanes.now(sh->lanes.now_ctx);
		enum kvr_lane_soft_step st = kvr_lanes_soft_check(
		    &sh->lanes, &w, now, stall_ns, stall_ns * KVR_LANE_THROTTLE_MAX_STALLS);
		if (st == KVR_SOFT_SPILL) {
			*how |= KVR_POST_SPILLED;
			tls_spills++;
			return 0;
		}
		if (st == KVR_SOFT_POST)
			return 0;
		if (k == 0) {
			*how |= KVR_POST_THROTTLED;
			tls_throttles++;
			/* Lazy posts (lifecycle work) may have filled the lane of a shard that
			 * sleeps in a bounded park: waiting for it to wake by itself would look
			 * like a stall. */
			kvr_parker_wake(&sh->park);
		}
		if (k >= 64 && now - w.start_ns < stall_ns)
			sched_yield();
		else
			wait_step(k, &sleep_ns, THROTTLE_SLEEP_CAP);
		if (__atomic_load_n(&sh->closed, __ATOMIC_ACQUIRE))
			return KVR_ESHUTDOWN;
	}
}

/* The wake a post asks for (kvr_lanes_push_wake's level; larger is more urgent): a lazy post
 * leaves a bounded park asleep, a soon post a soon park, any other post wakes every park. */
enum { WAKE_LAZY = 0, WAKE_SOON = 1, WAKE_ANY = 2 };

static int wait_edge_add(struct kvr_shard *self, struct kvr_shard *sh);
static void wait_edge_drop(struct kvr_shard *self);

/* Post with an optional bounded wait.  Inside an RCU read section for the whole call, so
 * shutdown's grace period waits for it.  timeout_ns 0 = try once.  deferred non-NULL: a lazy
 * post (kvr_shard_post_lazy), which leaves a shard in a bounded park asleep and says so.  how
 * non-NULL: a paced post (kvr_shard_post_paced), which waits at the routing lane's soft depth
 * first; posts from shard threads never do. */
static int post(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn, const void *payload,
                size_t len, uint32_t aux, uint64_t timeout_ns, bool *deferred, unsigned *how)
{
	int rc;
	kvr_rcu_read_lock();
	if (__atomic_load_n(&sh->closed, __ATOMIC_ACQUIRE)) {
		rc = KVR_ESHUTDOWN;
		goto out;
	}
	if (how && !tls_shard && kvr_lanes_over_soft(&sh->lanes, lane) && (rc = pace(sh, how)))
		goto out;
	/* rc >= 0 after a push: the wake level of other posts' messages its commit published. */
	uint32_t wake = !deferred ? WAKE_ANY : (aux & MSG_SOON) ? WAKE_SOON : WAKE_LAZY;
	rc = kvr_lanes_push_wake(&sh->lanes, lane, (void (*)(void))fn, payload, (uint32_t)len, aux,
	                         timeout_ns == 0 || tls_shard == sh, wake);
	if (rc == KVR_EAGAIN && timeout_ns && tls_shard != sh) {
		kvr_lanes_count_stall(&sh->lanes, lane);
		tls_full_waits++;
		kvr_parker_wake(&sh->park); /* lazy posts alone may have filled it */
		/* On a shard's thread (a router callback there, the clock) this waits for sh as a
		 * call does: sh may be waiting for this very shard (its clock's call here), and
		 * then neither would ever move (stress_admin_clock: a finish waited for room in
		 * shard B's lane while B's clock waited for A's answer).  Recorded as a call's
		 * edge, and refused with KVR_EBUSY when it closes a cycle (see wait_edge_add). */
		struct kvr_shard *self = tls_shard;
		/* (kvr_shard_call's post, or an intent's, has the edge already: kept as it is) */
		if (self && __atomic_load_n(&self->waits_for, __ATOMIC_SEQ_CST) == sh)
			self = NULL;
		if (self && wait_edge_add(self, sh)) {
			rc = KVR_EBUSY;
			goto out;
		}
		uint64_t start = mono_ns();
		uint64_t sleep_ns = 1000;
		/* The waits are made outside the read section when it is this post's own: a
		 * shard that waits for a grace period (a deferred free or an index callback that
		 * found no memory, synchronous then) waited for this thread, which waited for
		 * that shard to make room, and neither ever moved.  Each try enters it again and
		 * looks at closed again, as the first one did.  (Inside a caller's section the
		 * waits are bounded: the route's admission, KVR_LANE_FULL_WAIT_NS.) */
		const bool own = kvr_rcu_read_depth() == 1;
		for (uint32_t k = 0;; k++) {
			if (own)
				kvr_rcu_read_unlock();
			wait_step(k, &sleep_ns, 100000);
			if (own)
				kvr_rcu_read_lock();
			if (__atomic_load_n(&sh->closed, __ATOMIC_ACQUIRE)) {
				rc = KVR_ESHUTDOWN;
				break;
			}
			rc = kvr_lanes_push_wake(&sh->lanes, lane, (void (*)(void))fn, payload,
			                         (uint32_t)len, aux, 0, wake);
			if (rc != KVR_EAGAIN)
				break;
			if (timeout_ns != UINT64_MAX && mono_ns() - start >= timeout_ns) {
				rc = KVR_ETIMEDOUT;
				break;
			}
		}
		wait_edge_drop(self);
		if (rc == KVR_ESHUTDOWN || rc == KVR_ETIMEDOUT)
			goto out;
	}
	if (rc >= 0) {
		/* The push's commit ended with a locked RMW (kvr_ring_commit_nowait), the barrier
		 * of the Dekker pairs below on x86, so no second fence there (park.h). */
		kvr_barrier_after_rmw();
		/* Our commit may have published other posts' messages, left to it by producers that
		 * found our slot unpublished (sync/ring.h): their wake checks came before the shard
		 * could see them, so ours wakes as the most urgent of them would have (an admission
		 * behind a lazy post would otherwise wait out a bounded park). */
		if ((uint32_t)rc > wake)
			wake = (uint32_t)rc;
		rc = 0;
		/* A soon post leaves the shard asleep only in a park bounded by soon_ns.  Store
		 * buffering with the shard's park_soon store before its parker announcement: the
		 * push, the barrier, then the flag; the shard stores the flag, fences (in
		 * kvr_parker_prepare*), then checks the lanes.  So a flag read as set belongs to
		 * the park now entered, or to one whose lanes check finds this message; read as
		 * clear, the shard is woken as by any post (a lazy wake would also leave it in a
		 * longer bounded park).  So it does for the soon messages our commit published. */
		if (wake == WAKE_SOON && !__atomic_load_n(&sh->park_soon, __ATOMIC_RELAXED))
			wake = WAKE_ANY;
		/* deferred is non-NULL whenever wake is below WAKE_ANY: only lazy and soon posts
		 * (which pass it) start there. */
		if (wake == WAKE_ANY)
			kvr_parker_wake_fenced(&sh->park);
		else
			*deferred = kvr_parker_wake_lazy_fenced(&sh->park);
	} else if (rc == KVR_EAGAIN) {
		kvr_parker_wake(&sh->park); /* a full lane: lazy posts alone may have filled it */
	}
out:
	kvr_rcu_read_unlock();
	return rc;
}

int kvr_shard_post(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn, const void *payload,
                   size_t len)
{
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	return rc ? rc : post(sh, lane, fn, payload, len, 0, 0, NULL, NULL);
}

int kvr_shard_post_paced(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                         const void *payload, size_t len, unsigned *how)
{
	unsigned h = 0;
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	if (!rc)
		rc = post(sh, lane, fn, payload, len, 0, 0, NULL, &h);
	if (how)
		*how = h;
	return rc;
}

int kvr_shard_post_soon(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                        const void *payload, size_t len, unsigned *how, bool *deferred)
{
	unsigned h = 0;
	bool d = false;
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	if (!rc)
		rc = post(sh, lane, fn, payload, len, sh->rt->soon_ns ? MSG_SOON : 0, 0,
		          sh->rt->soon_ns ? &d : NULL, &h);
	if (how)
		*how = h;
	if (deferred)
		*deferred = d;
	return rc;
}

int kvr_shard_post_lazy(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                        const void *payload, size_t len, bool *deferred)
{
	bool d = false;
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	if (!rc)
		rc = post(sh, lane, fn, payload, len, 0, 0, sh->rt->lazy_ns ? &d : NULL, NULL);
	if (deferred)
		*deferred = d;
	return rc;
}

int kvr_shard_post_wait(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                        const void *payload, size_t len, uint64_t timeout_ns)
{
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	if (rc)
		return rc;
	rc = post(sh, lane, fn, payload, len, 0, timeout_ns ? timeout_ns : 1, NULL, NULL);
	return rc;
}

int kvr_shard_post_later(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                         const void *payload, size_t len)
{
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	if (rc)
		return rc;
	struct kvr_shard *self = tls_shard;
	if (!self)
		return post(sh, lane, fn, payload, len, 0, UINT64_MAX, NULL, NULL);
	/* Behind what this thread keeps already: posts to one shard land in order. */
	if (!self->later) {
		rc = post(sh, lane, fn, payload, len, 0, 0, NULL, NULL);
		if (rc != KVR_EAGAIN)
			return rc;
	}
	struct later_post *p = kvr_alloc_transient(sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	*p = (struct later_post){.to = sh, .lane = lane, .fn = fn, .len = (uint32_t)len};
	if (len)
		memcpy(p->payload, payload, len);
	if (self->later)
		self->later_last->next = p;
	else
		self->later = p;
	self->later_last = p;
	__atomic_store_n(&self->later_n, self->later_n + 1, __ATOMIC_RELEASE);
	return 0;
}

/* Pushes what kvr_shard_post_later kept, in order, until a lane is full; a post to a shard that
 * stopped is dropped with it (its work goes with the router).  Returns whether some are left.
 * Context: the shard's thread, between tasks. */
static bool later_flush(struct kvr_shard *self)
{
	while (self->later) {
		struct later_post *p = self->later;
		int rc = post(p->to, p->lane, p->fn, p->payload, p->len, 0, 0, NULL, NULL);
		if (rc == KVR_EAGAIN)
			return true;
		self->later = p->next;
		kvr_free_transient(p, sizeof(*p));
		/* Ordering: release, after the push; kvr_shards_quiesce's acquire load of it, then
		 * of the target's lanes, sees the message there (or its task run). */
		__atomic_store_n(&self->later_n, self->later_n - 1, __ATOMIC_RELEASE);
	}
	return false;
}

int kvr_shard_post_at(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn, const void *payload,
                      size_t len, uint64_t at_ns)
{
	if (len > KVR_SHARD_TIMED_PAYLOAD)
		return KVR_EINVAL;
	int rc = check_post(sh, lane, (const void *)fn, payload, len);
	if (rc)
		return rc;
	unsigned char buf[KVR_SHARD_PAYLOAD];
	memcpy(buf, &at_ns, sizeof(at_ns));
	if (len)
		memcpy(buf + sizeof(at_ns), payload, len);
	/* Counted before the push: a settle that begins after this post returned waits for it
	 * (kvr_shard_settle says why the counts suffice). */
	uint64_t last = __atomic_load_n(&sh->timed_last_at, __ATOMIC_RELAXED);
	while (last < at_ns && !__atomic_compare_exchange_n(&sh->timed_last_at, &last, at_ns, true,
	                                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
	__atomic_fetch_add(&sh->timed_posted, 1, __ATOMIC_SEQ_CST);
	/* Lazy: a shard in a bounded park is left asleep (it wakes within lazy_ns, or the
	 * poster's settle wakes it): kvr-replay's sessions (sync_booking), three runs each,
	 * route CPU 29.0-35.3 -> 26.2-28.4 us per decision, the shard's idle polling
	 * 39-246 -> 1.4-2.7 us (its spin no longer catches posts it was woken for). */
	bool lazy;
	rc = post(sh, lane, fn, buf, sizeof(at_ns) + len, MSG_TIMED, UINT64_MAX,
	          sh->rt->lazy_ns ? &lazy : NULL, NULL);
	if (rc)
		__atomic_fetch_add(&sh->timed_applied, 1, __ATOMIC_RELEASE); /* never runs */
	return rc;
}

void kvr_shard_thread_costs(struct kvr_post_costs *out)
{
	out->full_waits = tls_full_waits;
	out->wait_sleeps = tls_wait_sleeps;
	out->futex_wakes = kvr_parker_thread_wakes();
	out->soft_throttles = tls_throttles;
	out->soft_spills = tls_spills;
}

bool kvr_shard_task_time(uint64_t *at)
{
	*at = tls_task_ns;
	return tls_task_timed;
}

struct call_rec {
	kvr_call_fn fn;
	void *arg;
	uint64_t done_ns; /* when the reply was posted (written before it, read after it) */
	struct kvr_reply reply;
};

static void call_task(struct kvr_shard *sh, void *payload)
{
	struct call_rec *c;
	memcpy(&c, payload, sizeof(c));
	int rc = c->fn(sh, c->arg);
	c->done_ns = mono_ns();
	kvr_reply_post(&c->reply, rc);
}

/* How long a caller of fn spins before it sleeps on the reply.
 *
 * Spinning costs the caller's CPU for the whole wait; sleeping costs a futex sleep and wake-up
 * (a few microseconds of CPU on each side, and the caller's wake-up latency).  A spin is worth
 * it only for a reply expected within it, so each shard remembers, per call function, the
 * moving average of the delay from post to reply posted (the shard's wake-up, the queue ahead
 * and the work), and a call expected to take longer than spin_ns sleeps after a short probe
 * (spin_ns / 16, for a reply that turns out to be ready).  Measured on kvr-replay's sessions
 * (bookings of ~9,000-block prompts take ~60 us on the shard): the routing thread had spun
 * 20 us per booking and then slept anyway. */
static uint64_t call_spin(struct kvr_shard *sh, kvr_call_fn fn, struct call_kind **kind)
{
	uintptr_t f = (uintptr_t)fn;
	uint64_t spin = sh->rt->spin_ns;
	for (int i = 0; i < CALL_KINDS; i++) {
		struct call_kind *k = &sh->calls[i];
		if (__atomic_load_n(&k->fn, __ATOMIC_RELAXED) == f) {
			*kind = k;
			return __atomic_load_n(&k->delay_ns, __ATOMIC_RELAXED) <= spin ? spin
			                                                               : spin / 16;
		}
	}
	/* Not seen (or evicted): spin as before, and take a slot (the function's address picks
	 * it; another function's there is forgotten). */
	*kind = &sh->calls[(((f >> 4) * 0x9E3779B97F4A7C15ull) >> 32) % CALL_KINDS];
	return spin;
}

static void call_learn(struct call_kind *k, kvr_call_fn fn, uint64_t delay_ns)
{
	uintptr_t f = (uintptr_t)fn;
	uint64_t avg = delay_ns;
	if (__atomic_load_n(&k->fn, __ATOMIC_RELAXED) == f) {
		uint64_t old = __atomic_load_n(&k->delay_ns, __ATOMIC_RELAXED);
		avg = old - old / 8 + delay_ns / 8;
	} else {
		__atomic_store_n(&k->fn, f, __ATOMIC_RELAXED);
	}
	__atomic_store_n(&k->delay_ns, avg, __ATOMIC_RELAXED);
}

/*
 * A shard's thread about to wait for sh's reply (a callback on it called the API): records the
 * edge, then follows the edges from sh.  Reaching self is a cycle (A waits for B waits for A, or
 * longer): the edge is dropped and the call refused, KVR_EBUSY.  Why this cannot miss one: the
 * stores and loads are seq_cst, so of the threads whose edges close a cycle, the one whose store
 * comes last in that single order reads every other edge of it afterwards (each is still there:
 * its thread waits), and refuses.  Two may both refuse (each saw the other's edge first); a
 * cycle that already broke up while it was followed may be refused too: a spurious KVR_EBUSY,
 * never a wait for good.  Edges that cross routers are followed like any (they are shards).
 */
/* Whether following the recorded edges from sh (sh itself first) reaches self. */
static bool edges_reach(struct kvr_shard *sh, const struct kvr_shard *self)
{
	struct kvr_shard *p = sh;
	/* Bounded: a cycle ahead that does not run through self is some other thread's to find. */
	for (uint32_t i = 0; p && i < 4u * KVR_LIMIT_SHARDS_MAX; i++) {
		if (p == self)
			return true;
		p = __atomic_load_n(&p->waits_for, __ATOMIC_SEQ_CST);
	}
	return false;
}

static int wait_edge_add(struct kvr_shard *self, struct kvr_shard *sh)
{
	__atomic_store_n(&self->waits_for, sh, __ATOMIC_SEQ_CST);
	if (!edges_reach(sh, self))
		return 0;
	__atomic_store_n(&self->waits_for, tls_intent, __ATOMIC_SEQ_CST);
	return KVR_EBUSY;
}

/* A call's edge goes when the call ends, back to the intent's edge while one is held. */
static void wait_edge_drop(struct kvr_shard *self)
{
	if (self)
		__atomic_store_n(&self->waits_for, tls_intent, __ATOMIC_SEQ_CST);
}

bool kvr_shard_waits_for_current(struct kvr_shard *sh)
{
	return tls_shard && edges_reach(sh, tls_shard);
}

int kvr_shard_wait_intent(struct kvr_shard *sh)
{
	struct kvr_shard *self = tls_shard;
	if (!self)
		return 0;
	if (tls_intent_depth == 0 && sh && self != sh) {
		int rc = wait_edge_add(self, sh);
		if (rc)
			return rc;
		tls_intent = sh;
	}
	tls_intent_depth++; /* a nested one keeps the outer edge */
	return 0;
}

void kvr_shard_wait_intent_end(void)
{
	if (!tls_shard || tls_intent_depth == 0 || --tls_intent_depth > 0)
		return;
	tls_intent = NULL;
	wait_edge_drop(tls_shard);
}

enum call_kind_flags { CALL_REFUSE_CYCLES = 1, CALL_READ = 2 };

static int shard_call(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg,
                      unsigned how)
{
	const bool refuse_cycles = how & CALL_REFUSE_CYCLES;
	int rc = check_post(sh, lane, (const void *)fn, NULL, 0);
	if (rc)
		return rc;
	struct kvr_shard *self = tls_shard;
	if (self == sh) {
		/* Inline: queueing behind ourselves would deadlock.  The shard is inside a task
		 * (the call comes from a router callback it runs: its clock), which holds pointers
		 * into the state fn would change (a booking reading the clock, then its rank,
		 * which the clock's kvr_rank_remove freed): only reads run here. */
		if (refuse_cycles && !(how & CALL_READ))
			return KVR_EBUSY;
		__atomic_store_n(&sh->calls_inline, sh->calls_inline + 1, __ATOMIC_RELAXED);
		tls_inline_calls++;
		rc = fn(sh, arg);
		tls_inline_calls--;
		return rc;
	}
	if (self && !refuse_cycles) /* the edge, so that the others in a cycle refuse */
		__atomic_store_n(&self->waits_for, sh, __ATOMIC_SEQ_CST);
	else if (self && (rc = wait_edge_add(self, sh)))
		return rc;
	struct call_rec c = {.fn = fn, .arg = arg};
	struct call_rec *cp = &c;
	kvr_reply_init(&c.reply);
	struct call_kind *kind;
	uint64_t spin = call_spin(sh, fn, &kind);
	/* A parked shard answers after its wake-up (tens of microseconds on a loaded VM, more than
	 * the spin): spinning on that reply would only burn the spin. */
	if (__atomic_load_n(&sh->park.state, __ATOMIC_RELAXED) != KVR_PARK_RUNNING)
		spin = 0;
	uint64_t t0 = mono_ns();
	rc = post(sh, lane, call_task, &cp, sizeof(cp), 0, UINT64_MAX, NULL, NULL);
	if (rc) {
		wait_edge_drop(self);
		return rc;
	}
	rc = kvr_reply_wait(&c.reply, spin, NULL);
	wait_edge_drop(self);
	call_learn(kind, fn, c.done_ns > t0 ? c.done_ns - t0 : 0);
	return rc;
}

int kvr_shard_call(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg)
{
	return shard_call(sh, lane, fn, arg, CALL_REFUSE_CYCLES);
}

int kvr_shard_call_read(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg)
{
	return shard_call(sh, lane, fn, arg, CALL_REFUSE_CYCLES | CALL_READ);
}

int kvr_shard_call_always(struct kvr_shard *sh, enum kvr_lane lane, kvr_call_fn fn, void *arg)
{
	return shard_call(sh, lane, fn, arg, 0);
}

bool kvr_shard_is_current(const struct kvr_shard *sh)
{
	return sh && tls_shard == sh;
}

bool kvr_shard_in_inline_call(void)
{
	return tls_inline_calls > 0;
}

static int settle_call(struct kvr_shard *sh, void *arg)
{
	(void)sh;
	(void)arg;
	return 0;
}

/* Why comparing two counts is enough: every timed post is counted (timed_posted) before its
 * push, and counted again (timed_applied, a release) after its task ran, or after its push
 * failed.  The settle reads timed_applied first (acquire), then timed_posted (want).  Every
 * count in the applied value it reads happens before its read of want (the release sequence of
 * the increments; a task's posted count comes before its push, its push before its run, its
 * run before its applied count), so want counts each of them, and also every post P that
 * returned before the settle began.  If P has not run, want exceeds what it read as applied,
 * and the settle waits.  (Posts still in flight when it reads may be waited for too; a failed
 * push counts itself as applied, so nothing waits for it forever.)
 * Applied first: read the other way round, the argument needed each run task's posted count
 * to reach this thread before P's reservation did (the lane being FIFO), and nothing orders
 * those for another thread: the ring's reservation is ck's CAS, relaxed on weakly ordered
 * CPUs (AArch64, POWER: ldxr/stxr, lwarx/stwcx. without barriers).  So want could miss a task T
 * that reserved ahead of P while its count was still in flight (2+2W: P counted before T,
 * T reserved before P); T then ran, applied reached want, and the settle returned before P
 * ran: a kvr_router_settle that returned with its booking not yet applied.  The order of the
 * two loads costs nothing on any CPU. */
int kvr_shard_settle(struct kvr_shard *sh)
{
	if (!sh)
		return KVR_EINVAL;
	uint64_t applied = __atomic_load_n(&sh->timed_applied, __ATOMIC_ACQUIRE);
	uint64_t want = __atomic_load_n(&sh->timed_posted, __ATOMIC_SEQ_CST);
	if (applied >= want || tls_shard == sh)
		return 0;
	/* Behind: a call queues behind the timed work (FIFO) and returns once the shard has
	 * run it, so the wait is the call's (a short spin, then a futex sleep). */
	int rc = kvr_shard_call(sh, KVR_LANE_ROUTING, settle_call, NULL);
	return rc == KVR_ESHUTDOWN ? 0 : rc; /* stopping: the drain runs what is left */
}

/* Why the shard's time bounds what queued work arms: every task still queued runs at its own
 * time or the shard's, whichever is later (run_timed), so at or after the shard's time as read
 * here (it only grows), and at or before the later of that and the latest time posted.  Timers
 * fire in that work only at those times: one already armed if its deadline is within them, one
 * the work arms (at least armed_after_ns after its task's time) only if the shard's time plus
 * armed_after_ns is.  Reading the deadline after the shard's time pairs the two: a task that
 * armed a timer and then let the shard's time move published the deadline first. */
int kvr_shard_settle_timers(struct kvr_shard *sh, uint64_t armed_after_ns)
{
	if (!sh)
		return KVR_EINVAL;
	/* Applied first, then want: see kvr_shard_settle. */
	uint64_t applied = __atomic_load_n(&sh->timed_applied, __ATOMIC_ACQUIRE);
	uint64_t want = __atomic_load_n(&sh->timed_posted, __ATOMIC_SEQ_CST);
	if (applied >= want)
		return 0;
	/* Read after the count: covers every post counted (each records its time first). */
	uint64_t last = __atomic_load_n(&sh->timed_last_at, __ATOMIC_RELAXED);
	uint64_t hw = __atomic_load_n(&sh->time_hw, __ATOMIC_ACQUIRE);
	uint64_t end = last > hw ? last : hw;
	uint64_t armed = hw + armed_after_ns < hw ? UINT64_MAX : hw + armed_after_ns;
	if (end < __atomic_load_n(&sh->timer_next, __ATOMIC_ACQUIRE) && end < armed)
		return 0;
	return kvr_shard_settle(sh);
}

/* ------------------------------------------------------------------ timers, time, stats */

int kvr_shard_timer_add(struct kvr_shard *sh, uint64_t deadline_ns, kvr_shard_timer_fn fn,
                        void *arg, uint64_t *timer_id)
{
	if (!sh || !fn || tls_shard != sh)
		return KVR_EINVAL;
	int rc = kvr_timers_add(&sh->timers, deadline_ns, fn, arg, timer_id);
	publish_timers(sh);
	return rc;
}

int kvr_shard_timer_cancel(struct kvr_shard *sh, uint64_t timer_id)
{
	if (!sh || tls_shard != sh)
		return KVR_EINVAL;
	int rc = kvr_timers_cancel(&sh->timers, timer_id);
	publish_timers(sh);
	return rc;
}

void kvr_shards_kick(struct kvr_shards *s)
{
	if (!s)
		return;
	__atomic_fetch_add(&s->kick_gen, 1, __ATOMIC_SEQ_CST);
	for (uint32_t i = 0; i < s->n; i++)
		kvr_parker_wake(&s->shard[i]->park);
}

/* True if shard i looks idle after kick g; adds its work counter to *sum. */
static bool idle_after(struct kvr_shard *sh, uint64_t g, uint64_t *sum)
{
	bool parked = __atomic_load_n(&sh->park.state, __ATOMIC_ACQUIRE) != KVR_PARK_RUNNING;
	bool seen = __atomic_load_n(&sh->seen_kick, __ATOMIC_ACQUIRE) >= g;
	*sum += __atomic_load_n(&sh->lanes.run[0], __ATOMIC_RELAXED) +
	        __atomic_load_n(&sh->lanes.run[1], __ATOMIC_RELAXED);
	/* Posts it keeps (kvr_shard_post_later) are work not yet in any lane, and so is a post
	 * whose commit was tagged behind another producer's reservation: it returned, but the
	 * lane counts it only once that producer commits, and a sync then returned before it ran
	 * (unreserved, not empty). */
	return parked && seen && __atomic_load_n(&sh->later_n, __ATOMIC_ACQUIRE) == 0 &&
	       kvr_lanes_unreserved(&sh->lanes);
}

int kvr_shards_quiesce(struct kvr_shards *s, uint64_t timeout_ns)
{
	if (!s || tls_shard)
		return KVR_EINVAL;
	if (__atomic_load_n(&s->closed, __ATOMIC_ACQUIRE))
		return KVR_ESHUTDOWN;
	kvr_shards_kick(s);
	uint64_t g = __atomic_load_n(&s->kick_gen, __ATOMIC_ACQUIRE);
	uint64_t start = mono_ns();
	for (;;) {
		uint64_t sum1 = 0, sum2 = 0;
		bool idle = true;
		for (uint32_t i = 0; i < s->n; i++)
			idle = idle_after(s->shard[i], g, &sum1) && idle;
		if (idle) {
			for (uint32_t i = 0; i < s->n; i++)
				idle = idle_after(s->shard[i], g, &sum2) && idle;
			if (idle && sum1 == sum2)
				return 0;
		}
		if (mono_ns() - start >= timeout_ns)
			return KVR_ETIMEDOUT;
		struct timespec ts = {0, 20000};
		nanosleep(&ts, NULL);
	}
}

void kvr_shard_get_stats(struct kvr_shard *sh, struct kvr_shard_stats *o)
{
	if (!sh || !o)
		return;
	memset(o, 0, sizeof(*o));
	struct kvr_lanes *l = &sh->lanes;
	o->index = sh->index;
	o->cpu = sh->cpu;
	o->pinned = sh->pinned;
	for (int k = 0; k < KVR_LANE_COUNT; k++) {
		o->depth[k] = kvr_lanes_depth(l, (enum kvr_lane)k);
		o->tasks[k] = __atomic_load_n(&l->run[k], __ATOMIC_RELAXED);
		o->stalls[k] = __atomic_load_n(&l->stalls[k], __ATOMIC_RELAXED);
	}
	o->throttles = __atomic_load_n(&l->throttles, __ATOMIC_RELAXED);
	o->spills = __atomic_load_n(&l->spills, __ATOMIC_RELAXED);
	o->lane_trimmed_bytes = __atomic_load_n(&l->trimmed_bytes, __ATOMIC_RELAXED);
	o->maint_wait_max_ns = __atomic_load_n(&l->maint_wait_max_ns, __ATOMIC_RELAXED);
	o->routing_between_maint_max = __atomic_load_n(&l->routing_between_max, __ATOMIC_RELAXED);
	o->calls_inline = __atomic_load_n(&sh->calls_inline, __ATOMIC_RELAXED);
	o->spin_ns = __atomic_load_n(&sh->spin_ns, __ATOMIC_RELAXED);
	o->parks = __atomic_load_n(&sh->park.parks, __ATOMIC_RELAXED);
	o->wakes = __atomic_load_n(&sh->park.wakes, __ATOMIC_RELAXED);
	o->wakes_deferred = __atomic_load_n(&sh->park.deferred, __ATOMIC_RELAXED);
	o->bounded_parks = __atomic_load_n(&sh->bounded_parks, __ATOMIC_RELAXED);
	o->lazy_found = __atomic_load_n(&sh->lazy_found, __ATOMIC_RELAXED);
	o->soon_parks = __atomic_load_n(&sh->soon_parks, __ATOMIC_RELAXED);
	o->timers_fired = __atomic_load_n(&sh->timers_fired, __ATOMIC_RELAXED);
	o->timers_pending = __atomic_load_n(&sh->timers_pending, __ATOMIC_RELAXED);
	o->workers = __atomic_load_n(&sh->rt->workers[sh->index], __ATOMIC_RELAXED);
	o->ranks = __atomic_load_n(&sh->rt->ranks[sh->index], __ATOMIC_RELAXED);
	clockid_t cid;
	struct timespec ts;
	if (sh->started && pthread_getcpuclockid(sh->thread, &cid) == 0 &&
	    clock_gettime(cid, &ts) == 0)
		o->cpu_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
