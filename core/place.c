/*
 * core/place.c - the process's placement key (core/place.h says why).
 */
#include <stdbool.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core/place.h"

uint64_t kvr_place_key_;

static uint64_t splitmix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

uint64_t kvr_place_key_draw(void)
{
	uint64_t k = 0;
	/* GRND_NONBLOCK: early in boot the pool may not be ready; the fallback below is not
	 * secret against a local observer but is unknown to a remote one, which is the threat. */
	if (getrandom(&k, sizeof(k), GRND_NONBLOCK) != (ssize_t)sizeof(k)) {
		struct timespec a, b;
		clock_gettime(CLOCK_REALTIME, &a);
		clock_gettime(CLOCK_MONOTONIC, &b);
		k = splitmix((uint64_t)a.tv_nsec ^ (uint64_t)a.tv_sec << 30 ^
		             (uint64_t)getpid() << 48 ^
		             splitmix((uint64_t)b.tv_nsec ^ (uint64_t)(uintptr_t)&a));
	}
	k |= 1; /* odd: multiply-shift's family (a multiplier that loses no bit) */
	uint64_t expected = 0;
	if (!__atomic_compare_exchange_n(&kvr_place_key_, &expected, k, false, __ATOMIC_RELAXED,
	                                 __ATOMIC_RELAXED))
		return expected; /* another thread's came first */
	return k;
}
