/*
 * tests/common/splitmix.h - splitmix64 (Steele, Lea, Flood 2014), the one random stream of the
 * tests, fuzz drivers and benchmarks: one seed, one reproducible stream.
 */
#ifndef KVR_TESTS_COMMON_SPLITMIX_H
#define KVR_TESTS_COMMON_SPLITMIX_H

#include <stdint.h>

static inline uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

#endif
