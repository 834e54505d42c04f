/*
 * sync/cond.h - condition variables whose timed waits run on CLOCK_MONOTONIC.
 *
 * A pthread condition variable times its waits on CLOCK_REALTIME unless told otherwise, so a
 * wait meant to last a millisecond lasted as long as the wall clock was stepped back meanwhile
 * (NTP stepping an offset, an operator's `date -s`, a VM resumed from a snapshot): a
 * kvr_route_wait stopped re-reading its deadline, a replica stopped sending heartbeats, a bounded
 * close was not bounded.  Every timed wait of the library goes through these.
 */
#ifndef KVR_SYNC_COND_H
#define KVR_SYNC_COND_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* pthread_cond_init on CLOCK_MONOTONIC.  Linux's condition variables allocate nothing and
 * accept that clock, so this cannot fail there. */
static inline void kvr_cond_init(pthread_cond_t *cv)
{
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(cv, &ca);
	pthread_condattr_destroy(&ca);
}

/* Waits on cv (initialised by kvr_cond_init, mu held) at most wait_ns, or until signalled;
 * callers loop and re-check their condition. */
static inline void kvr_cond_wait_ns(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t wait_ns)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	uint64_t ns = (uint64_t)ts.tv_nsec + wait_ns;
	ts.tv_sec += (time_t)(ns / 1000000000ull);
	ts.tv_nsec = (long)(ns % 1000000000ull);
	pthread_cond_timedwait(cv, mu, &ts);
}

#endif
