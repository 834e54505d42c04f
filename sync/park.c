/*
 * sync/park.c - futex parking and reply slots (see park.h for the protocol and its proof).
 *
 * Full barriers: outside TSan a seq_cst fence; under TSan (which does not model fences, and
 * GCC warns about them with -Wtsan) a seq_cst read-modify-write on the state word instead,
 * which is equally strong for this pattern (RMWs on one word are totally ordered and each
 * synchronizes with the previous one).
 */
#include "sync/park.h"

#include <limits.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <stdbool.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long futex(uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts)
{
	return syscall(SYS_futex, uaddr, op, val, ts, NULL, 0);
}

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kvr_parker_init(struct kvr_parker *p)
{
	p->state = KVR_PARK_RUNNING;
	p->parks = 0;
	p->wakes = 0;
	p->deferred = 0;
}

static void prepare(struct kvr_parker *p, uint32_t state)
{
	/* An RMW: under TSan the barrier itself; elsewhere followed by the fence below. */
	__atomic_exchange_n(&p->state, state, __ATOMIC_SEQ_CST);
#ifndef KVR_TSAN
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

void kvr_parker_prepare(struct kvr_parker *p)
{
	prepare(p, KVR_PARK_PARKED);
}

void kvr_parker_prepare_bounded(struct kvr_parker *p)
{
	prepare(p, KVR_PARK_BOUNDED);
}

void kvr_parker_cancel(struct kvr_parker *p)
{
	__atomic_store_n(&p->state, KVR_PARK_RUNNING, __ATOMIC_RELAXED);
}

bool kvr_parker_wait(struct kvr_parker *p, uint64_t timeout_ns)
{
	struct timespec ts, *tsp = NULL;
	if (timeout_ns != UINT64_MAX) {
		ts.tv_sec = (time_t)(timeout_ns / 1000000000ull);
		ts.tv_nsec = (long)(timeout_ns % 1000000000ull);
		tsp = &ts;
	}
	__atomic_store_n(&p->parks, __atomic_load_n(&p->parks, __ATOMIC_RELAXED) + 1,
	                 __ATOMIC_RELAXED);
	/* Sleeps only if state is still what the consumer announced (only wakers change it, to
	 * RUNNING): a waker that flipped it first makes this return at once (EAGAIN). */
	uint32_t s = __atomic_load_n(&p->state, __ATOMIC_RELAXED);
	if (s != KVR_PARK_RUNNING)
		futex(&p->state, FUTEX_WAIT_PRIVATE, s, tsp);
	/* Acquire: pairs with the waker's exchange, so its published work is visible. */
	return __atomic_exchange_n(&p->state, KVR_PARK_RUNNING, __ATOMIC_ACQ_REL) ==
	       KVR_PARK_RUNNING;
}

/* The waker's half of the Dekker pair: a full barrier after the caller's publication, then the
 * state. */
static uint32_t fenced_state(struct kvr_parker *p)
{
#ifdef KVR_TSAN
	return __atomic_fetch_add(&p->state, 0, __ATOMIC_SEQ_CST);
#else
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	return __atomic_load_n(&p->state, __ATOMIC_RELAXED);
#endif
}

/* FUTEX_WAKEs this thread issued as a waker (kvr_parker_thread_wakes). */
static _Thread_local uint64_t tls_wakes;

uint64_t kvr_parker_thread_wakes(void)
{
	return tls_wakes;
}

/* The waker's half after its barrier, s the state it loaded. */
static void wake_from(struct kvr_parker *p, uint32_t s)
{
	if (__builtin_expect(s == KVR_PARK_RUNNING, 1))
		return;
	if (__atomic_exchange_n(&p->state, KVR_PARK_RUNNING, __ATOMIC_ACQ_REL) !=
	    KVR_PARK_RUNNING) {
		__atomic_fetch_add(&p->wakes, 1, __ATOMIC_RELAXED);
		tls_wakes++;
		futex(&p->state, FUTEX_WAKE_PRIVATE, 1, NULL);
	}
}

static bool wake_lazy_from(struct kvr_parker *p, uint32_t s)
{
	if (__builtin_expect(s == KVR_PARK_RUNNING, 1))
		return false;
	if (s == KVR_PARK_BOUNDED) {
		/* Our work was published before the load that saw BOUNDED: the consumer finds it
		 * when its timed wait ends, or in the re-check before any unbounded park. */
		__atomic_fetch_add(&p->deferred, 1, __ATOMIC_RELAXED);
		return true;
	}
	/* PARKED: take it to RUNNING unless it changed meanwhile (another waker did, or the
	 * consumer woke and announced again: its re-check then sees our work). */
	if (__atomic_compare_exchange_n(&p->state, &s, KVR_PARK_RUNNING, false, __ATOMIC_ACQ_REL,
	                                __ATOMIC_RELAXED)) {
		__atomic_fetch_add(&p->wakes, 1, __ATOMIC_RELAXED);
		tls_wakes++;
		futex(&p->state, FUTEX_WAKE_PRIVATE, 1, NULL);
	}
	return false;
}

void kvr_parker_wake(struct kvr_parker *p)
{
	wake_from(p, fenced_state(p));
}

bool kvr_parker_wake_lazy(struct kvr_parker *p)
{
	return wake_lazy_from(p, fenced_state(p));
}

/* The state after the caller's own barrier (under TSan the RMW of fenced_state). */
static uint32_t state_after_barrier(struct kvr_parker *p)
{
#ifdef KVR_TSAN
	return fenced_state(p);
#else
	return __atomic_load_n(&p->state, __ATOMIC_RELAXED);
#endif
}

void kvr_parker_wake_fenced(struct kvr_parker *p)
{
	wake_from(p, state_after_barrier(p));
}

bool kvr_parker_wake_lazy_fenced(struct kvr_parker *p)
{
	return wake_lazy_from(p, state_after_barrier(p));
}

/* ------------------------------------------------------------------ asymmetric barrier */

static pthread_once_t asym_once = PTHREAD_ONCE_INIT;
static bool asym_ok; /* written once under asym_once, then read-only */

static void asym_register(void)
{
#ifndef KVR_TSAN
	long q = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
	asym_ok = q > 0 && (q & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
	          syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
#endif
}

int kvr_parker_asym_init(void)
{
	pthread_once(&asym_once, asym_register);
	return 0;
}

void kvr_parker_prepare_asym(struct kvr_parker *p)
{
	if (!asym_ok) {
		kvr_parker_prepare(p);
		return;
	}
	__atomic_exchange_n(&p->state, KVR_PARK_PARKED, __ATOMIC_SEQ_CST);
	/* Every producer running now passes a full barrier: one whose load of state came before
	 * it has its publication visible to our re-check; one after it sees PARKED.  (The call
	 * cannot fail once the process is registered: membarrier(2) lists EPERM for an
	 * unregistered process only.) */
	syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0);
}

void kvr_parker_wake_asym(struct kvr_parker *p)
{
	uint32_t s;
	if (__builtin_expect(asym_ok, 1)) {
		__atomic_signal_fence(__ATOMIC_SEQ_CST); /* compiler only: see prepare_asym */
		s = __atomic_load_n(&p->state, __ATOMIC_RELAXED);
		if (__builtin_expect(s == KVR_PARK_RUNNING, 1))
			return;
	}
	kvr_parker_wake(p);
}

void kvr_reply_post(struct kvr_reply *r, int result)
{
	__atomic_store_n(&r->result, result, __ATOMIC_RELAXED);
	uint32_t old = __atomic_exchange_n(&r->state, KVR_REPLY_DONE, __ATOMIC_ACQ_REL);
	if (old == KVR_REPLY_WAITING)
		futex(&r->state, FUTEX_WAKE_PRIVATE, INT_MAX, NULL);
}

int kvr_reply_wait(struct kvr_reply *r, uint64_t spin_ns, int *parked)
{
	if (parked)
		*parked = 0;
	/* Spin: check the clock every 16 rounds from the start (a pause is ~23 ns on the AMD EPYC
	 * VMs of docs/measurements.md's figures: the first check at round 64 made every wait,
	 * spin_ns 0 included, spin 128 rounds, ~3 us, before it could sleep); spin_ns 0: no spin at
	 * all. */
	const uint64_t start = spin_ns ? mono_ns() : 0;
	for (uint32_t i = 0; spin_ns; i++) {
		if (__atomic_load_n(&r->state, __ATOMIC_ACQUIRE) == KVR_REPLY_DONE)
			return __atomic_load_n(&r->result, __ATOMIC_RELAXED);
		kvr_cpu_relax();
		if ((i & 15) == 15 && mono_ns() - start >= spin_ns)
			break;
	}
	uint32_t expect = KVR_REPLY_PENDING;
	if (__atomic_compare_exchange_n(&r->state, &expect, KVR_REPLY_WAITING, false,
	                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		if (parked)
			*parked = 1;
		while (__atomic_load_n(&r->state, __ATOMIC_ACQUIRE) != KVR_REPLY_DONE)
			futex(&r->state, FUTEX_WAIT_PRIVATE, KVR_REPLY_WAITING, NULL);
	}
	/* expect == DONE, or we waited for DONE. */
	return __atomic_load_n(&r->result, __ATOMIC_RELAXED);
}
