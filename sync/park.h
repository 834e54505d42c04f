/*
 * sync/park.h - parking an idle consumer, and one-shot reply slots for synchronous calls.
 *
 * Parker (one consumer, many wakers).  The consumer announces that it is about to sleep
 * (state PARKED), re-checks for work, and only then sleeps in futex(2) on the state word.
 * A producer publishes its work first, then looks at the state; if it sees PARKED it flips it
 * back to RUNNING and issues FUTEX_WAKE.  The classic lost-wake-up race is closed by a full
 * barrier on both sides (store-buffer / Dekker pattern): either the producer sees PARKED, or the
 * consumer's re-check sees the work.  A busy consumer costs a producer one fence and one load
 * of a line the consumer rarely writes: no syscall.
 *
 * Bounded parks and lazy wakers.  A consumer that will sleep at most a bound it chose (a timed
 * wait) may announce BOUNDED instead of PARKED; a producer whose work may wait that long
 * (kvr_parker_wake_lazy) then leaves it asleep and saves the FUTEX_WAKE (a syscall on the
 * producer's thread: tens of microseconds on a loaded VM) - the consumer finds the work when its
 * timed wait ends.  Only PARKED (a sleep with no bound the producer knows) is woken by a lazy
 * producer; an ordinary wake wakes both.  The same Dekker pair covers the lazy producer: it
 * publishes, fences and loads state; a consumer that goes from a bounded park to an unbounded
 * one announces PARKED and re-checks before sleeping again, so either the producer sees PARKED
 * and wakes it, or the re-check sees the work.  So nothing waits longer than the bound.
 *
 * Reply slot (one waiter, one poster).  The caller spins briefly on the slot, then marks it
 * WAITING and sleeps in futex(2).  The poster writes the result, swaps the state to DONE and
 * calls FUTEX_WAKE only if the waiter went to sleep, so the hot round trip makes no syscall.
 * After the swap the waiter may return and its stack slot vanish: the poster never touches the
 * slot again except as a futex key (a stale FUTEX_WAKE is at worst a spurious wake-up, which
 * every futex waiter tolerates).
 *
 * Reference: Ulrich Drepper, "Futexes Are Tricky" (2011); Linux futex(2).
 */
#ifndef KVR_SYNC_PARK_H
#define KVR_SYNC_PARK_H

#include <stdbool.h>
#include <stdint.h>

#include "sync/rcu.h" /* KVR_TSAN */

/* RUNNING: awake.  PARKED: asleep, or about to be, with no bound a producer may rely on.
 * BOUNDED: asleep, or about to be, for at most the consumer's own bound (see above). */
enum { KVR_PARK_RUNNING = 0, KVR_PARK_PARKED = 1, KVR_PARK_BOUNDED = 2 };

struct kvr_parker {
	_Alignas(64) uint32_t state; /* futex word: KVR_PARK_* */
	uint64_t parks;              /* futex sleeps entered (consumer-written) */
	uint64_t wakes;              /* FUTEX_WAKEs issued by wakers (atomic add) */
	uint64_t deferred;           /* lazy wakes left to a bounded park (atomic add) */
};

/* Makes a parker in state RUNNING.  Context: before sharing. */
void kvr_parker_init(struct kvr_parker *p);

/*
 * Step 1 of parking: announce PARKED.  The caller must then re-check every source of work and
 * call kvr_parker_cancel() if it finds some, else kvr_parker_wait().
 * Context: the consumer thread.
 * Ordering: seq_cst store plus full barrier; pairs with the barrier in kvr_parker_wake().
 */
void kvr_parker_prepare(struct kvr_parker *p);

/*
 * As kvr_parker_prepare, announcing BOUNDED: the caller promises that its kvr_parker_wait()
 * that follows has a timeout no longer than the bound its lazy producers were told, so they
 * need not wake it.  Context: the consumer thread.  Ordering: as kvr_parker_prepare; pairs with
 * the barriers of kvr_parker_wake() and kvr_parker_wake_lazy().
 */
void kvr_parker_prepare_bounded(struct kvr_parker *p);

/* Abandons a prepared park.  Context: the consumer thread. */
void kvr_parker_cancel(struct kvr_parker *p);

/*
 * Step 2: sleeps until woken or timeout_ns passes (UINT64_MAX = no timeout).  Returns with
 * state RUNNING: true if a waker ended the park, false if it ended by itself (the timeout, or a
 * spurious return; the caller re-checks for work anyway).
 * Context: the consumer thread, after kvr_parker_prepare() or kvr_parker_prepare_bounded();
 * not in an RCU read section.
 */
bool kvr_parker_wait(struct kvr_parker *p, uint64_t timeout_ns);

/*
 * Wakes the consumer if it is parked or about to park.  Call after publishing work.
 * Context: any thread.  Ordering: full barrier between the caller's publication and the load
 * of state; pairs with kvr_parker_prepare().  No syscall unless the consumer is parked.
 */
void kvr_parker_wake(struct kvr_parker *p);
/* How many FUTEX_WAKEs the calling thread has issued so far through kvr_parker_wake and
 * kvr_parker_wake_lazy (each a syscall on the waker's thread).  Context: any thread. */
uint64_t kvr_parker_thread_wakes(void);

/*
 * The producer's barrier when its publication ended with a locked read-modify-write (a
 * successful kvr_lanes_push: sync/ring.h's kvr_ring_commit_nowait ends with a locked RMW): on x86
 * that instruction is already a full barrier, so this is a compiler barrier only (an mfence costs
 * ~10 ns of a ~25 ns post on the EPYC VMs of docs/measurements.md); elsewhere a seq_cst fence.
 * Follow it with kvr_parker_wake_fenced / kvr_parker_wake_lazy_fenced, or any seq_cst-fenced
 * protocol of the caller's (sync/lane.c's trim check relies on the same property).
 */
static inline void kvr_barrier_after_rmw(void)
{
#if defined(__x86_64__) || defined(__i386__) /* TSan too: it models no fence either way */
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
#else
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/*
 * As kvr_parker_wake and kvr_parker_wake_lazy, for a caller that has just passed a full barrier
 * after its publication (kvr_barrier_after_rmw, or a fence): they only load the state, leaving
 * out their own fence.  Under TSan they are the fenced ones (TSan's barrier is an RMW on the
 * state).  Context, ordering: as kvr_parker_wake / kvr_parker_wake_lazy, the barrier the
 * caller's.
 */
void kvr_parker_wake_fenced(struct kvr_parker *p);
bool kvr_parker_wake_lazy_fenced(struct kvr_parker *p);

/*
 * Wakes the consumer only if it is PARKED (no bound); one in a BOUNDED park is left to wake by
 * itself, and true is returned (the wake was deferred: counted in `deferred`).  Call after
 * publishing work that may wait for the consumer's bound.  Returns false when the consumer runs
 * or was woken.  Context: any thread.  Ordering: as kvr_parker_wake().
 */
bool kvr_parker_wake_lazy(struct kvr_parker *p);

/*
 * The asymmetric variant, for a consumer that parks rarely and producers on a hot path (the
 * replica sender, sync/replica_out.c).  The producer's side of the Dekker pair costs a full
 * barrier per wake (mfence, which also waits for every store the producer still has in flight,
 * such as a 4 KiB copy into lines the consumer holds); here the consumer pays it instead, once
 * per park, with membarrier(2) MEMBARRIER_CMD_PRIVATE_EXPEDITED: it runs a full barrier on every
 * CPU that runs a thread of this process, so a producer needs only a compiler barrier between
 * its publication and its load of state (the liburcu-memb pattern: Desnoyers et al., "User-Level
 * Implementations of Read-Copy Update", 2012, section on sys_membarrier).  When membarrier is
 * not available (old kernel, seccomp) or under TSan, both sides fall back to the fences above.
 * kvr_parker_asym_init() registers the process once; 0 (always: the fallback is correct).
 * Context: prepare_asym: the consumer thread (a syscall, IPIs to the process's running CPUs);
 * wake_asym: any thread.  Pair prepare_asym only with wake_asym or kvr_parker_wake.
 */
int kvr_parker_asym_init(void);
void kvr_parker_prepare_asym(struct kvr_parker *p);
void kvr_parker_wake_asym(struct kvr_parker *p);

/* ------------------------------------------------------------------ reply slots */

enum { KVR_REPLY_PENDING = 0, KVR_REPLY_WAITING = 1, KVR_REPLY_DONE = 2 };

struct kvr_reply {
	uint32_t state; /* futex word: KVR_REPLY_* */
	int result;
};

static inline void kvr_reply_init(struct kvr_reply *r)
{
	r->state = KVR_REPLY_PENDING;
	r->result = 0;
}

/*
 * Delivers result to the waiter.  After this call the slot must not be touched.
 * Context: the poster (a shard thread), exactly once per slot.
 * Ordering: release exchange of state; pairs with the acquire loads in kvr_reply_wait().
 */
void kvr_reply_post(struct kvr_reply *r, int result);

/*
 * Waits for the result: spins up to spin_ns (no syscall; 0: not at all), then sleeps on a futex.
 * Returns the posted result.  Sets *parked (if not NULL) to 1 if it had to sleep.
 * Context: the caller thread that owns the slot.
 */
int kvr_reply_wait(struct kvr_reply *r, uint64_t spin_ns, int *parked);

/* CPU relax hint for spin loops. */
static inline void kvr_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield" ::: "memory");
#endif
}

#endif /* KVR_SYNC_PARK_H */
