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

#include <stdint.h>

#include "sync/rcu.h" /* KVR_TSAN */

enum { KVR_PARK_RUNNING = 0, KVR_PARK_PARKED = 1 };

struct kvr_parker {
	_Alignas(64) uint32_t state; /* futex word: KVR_PARK_* */
	uint64_t parks;              /* futex sleeps entered (consumer-written) */
	uint64_t wakes;              /* FUTEX_WAKEs issued by wakers (atomic add) */
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

/* Abandons a prepared park.  Context: the consumer thread. */
void kvr_parker_cancel(struct kvr_parker *p);

/*
 * Step 2: sleeps until woken or timeout_ns passes (UINT64_MAX = no timeout).  Returns with
 * state RUNNING.  Spurious returns are possible; the caller re-checks for work anyway.
 * Context: the consumer thread, after kvr_parker_prepare(); not in an RCU read section.
 */
void kvr_parker_wait(struct kvr_parker *p, uint64_t timeout_ns);

/*
 * Wakes the consumer if it is parked or about to park.  Call after publishing work.
 * Context: any thread.  Ordering: full barrier between the caller's publication and the load
 * of state; pairs with kvr_parker_prepare().  No syscall unless the consumer is parked.
 */
void kvr_parker_wake(struct kvr_parker *p);

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
