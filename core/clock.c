/* core/clock.c - the default monotonic clock. */
#include "core/clock.h"

#include <time.h>

uint64_t kvr_clock_monotonic(void *ctx)
{
	(void)ctx;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
