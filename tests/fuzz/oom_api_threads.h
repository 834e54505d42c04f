/* tests/fuzz/oom_api_threads.h - oom_api's threaded mode (tests/fuzz/oom_api_threads.c). */
#ifndef KVR_TESTS_FUZZ_OOM_API_THREADS_H
#define KVR_TESTS_FUZZ_OOM_API_THREADS_H

#include <stdint.h>

/* Runs seeds first .. first + seeds - 1, each with `threads` (2 or 3) frontend threads making
 * `ops` calls on one router while allocations fail; aborts with the seed on the first broken
 * promise.  Context: the program's main thread. */
void oom_api_threads(uint64_t first, uint64_t seeds, int ops, int threads);

#endif
