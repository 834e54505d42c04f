/*
 * sync/nocancel.h - the library's calls are not cancellation points.
 *
 * A thread cancelled (pthread_cancel, deferred) acts on it at the next cancellation point it
 * reaches: inside the library, a condition wait holding the queue's lock, a sleep holding the
 * rank administration lock or inside an RCU read section, liburcu's grace-period wait holding
 * its own lock, a join or a close halfway through a teardown.  The thread then ended with those
 * held or half done, and the next call that needed them waited for good
 * (tests/unit/test_cancel.c).  Every public call that can reach one disables cancellation for
 * its duration instead; a cancel that arrives meanwhile takes effect at the caller's next
 * cancellation point after the call returns.  kvr_route and the lifecycle calls, whose fast
 * paths reach none, disable it only around the waits they may meet (a full lane's sleep, the
 * queue): a disable and restore costs ~13 ns (glibc 2.36), 5-10 % of a lifecycle call.
 */
#ifndef KVR_SYNC_NOCANCEL_H
#define KVR_SYNC_NOCANCEL_H

#include <pthread.h>

static inline int kvr_nocancel_begin(void)
{
	int old = PTHREAD_CANCEL_ENABLE;
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	return old;
}

static inline void kvr_nocancel_end(int *old)
{
	pthread_setcancelstate(*old, NULL);
}

/* Disables cancellation until the enclosing block is left, by any return. */
#define KVR_NOCANCEL()                                                                             \
	int kvr_nocancel_state_ __attribute__((cleanup(kvr_nocancel_end), unused)) =               \
	    kvr_nocancel_begin()

#endif
