/*
 * tests/common/fresh_thread.h - run one program of a fuzz driver on a thread of its own and
 * count what it left allocated (tests/fuzz/fuzz_api.c, tests/fuzz/oom_api.c).
 */
#ifndef KVR_TESTS_COMMON_FRESH_THREAD_H
#define KVR_TESTS_COMMON_FRESH_THREAD_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/alloc.h"

/* Runs fn(arg) on a fresh thread and joins it: the thread's thread-local scratch and RCU
 * registration go with it, so the library's allocation counter must be back to its start.
 * Returns the bytes still allocated (kvr_alloc_live_bytes after minus before; 0: no leak);
 * aborts if the thread cannot be created.  Context: a driver's thread, no other thread of it
 * calling the library meanwhile. */
static inline int64_t kvr_test_run_fresh_thread(void *(*fn)(void *), void *arg)
{
	int64_t before = kvr_alloc_live_bytes();
	pthread_t th;
	if (pthread_create(&th, NULL, fn, arg) != 0)
		abort();
	pthread_join(th, NULL);
	return kvr_alloc_live_bytes() - before;
}

#endif
