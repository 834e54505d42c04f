/*
 * tests/common/xorshift.h - xorshift64 (Marsaglia 2003, shifts 13, 7, 17): the small, fast
 * stream the stress tests, differential tests and benchmarks draw their workloads from (one
 * seed, one reproducible stream; splitmix.h is the other one).  *s must not be 0.
 */
#ifndef KVR_TESTS_COMMON_XORSHIFT_H
#define KVR_TESTS_COMMON_XORSHIFT_H

#include <stdint.h>

static inline uint64_t xorshift64(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

#endif
