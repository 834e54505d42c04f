/* perf/bench_util.h - the clocks, pinning and sort order every benchmark here needs, once.
 * Header-only (static inline): each bench is one program, and perf/meson.build lists one
 * source per program. */
#ifndef KVR_PERF_BENCH_UTIL_H
#define KVR_PERF_BENCH_UTIL_H

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* CLOCK_MONOTONIC in ns: wall time, for latencies and durations. */
static inline uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* This thread's CPU time in ns: what a call cost without the time the (shared) machine ran
 * others. */
static inline uint64_t cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Pins the calling thread to cpu (modulo the CPUs online). */
static inline void pin(int cpu)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	CPU_SET(cpu % (n > 0 ? (int)n : 1), &set);
	pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* qsort order of uint64_t values, ascending. */
static inline int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

#endif
