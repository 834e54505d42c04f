/*
 * tests/common/realtime_shift.h - a wall clock the test moves: this header DEFINES
 * clock_gettime, so include it in one file of a test program that links the library in
 * statically (the library's calls then come here).  CLOCK_REALTIME reads
 * kvr_test_realtime_shift_ns (signed, ns) off the kernel's: what a thread sees when the wall
 * clock is stepped by minus that much just after it read it (NTP stepping an offset, `date -s`,
 * a VM resumed from a snapshot), or a process on a host whose clock is off.  The other clocks
 * are the kernel's.  Users: tests/unit/test_clock_step.c, tests/unit/test_replica_epoch.c.
 */
#ifndef KVR_TESTS_COMMON_REALTIME_SHIFT_H
#define KVR_TESTS_COMMON_REALTIME_SHIFT_H

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

static _Atomic int64_t kvr_test_realtime_shift_ns;

int clock_gettime(clockid_t id, struct timespec *ts)
{
	static int (*real)(clockid_t, struct timespec *);
	if (!real)
		real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
	int rc = real(id, ts);
	int64_t s = atomic_load(&kvr_test_realtime_shift_ns);
	if (rc == 0 && s && id == CLOCK_REALTIME) {
		int64_t ns = (int64_t)ts->tv_sec * 1000000000ll + ts->tv_nsec + s;
		ts->tv_sec = (time_t)(ns / 1000000000ll);
		ts->tv_nsec = (long)(ns % 1000000000ll);
	}
	return rc;
}

#endif
