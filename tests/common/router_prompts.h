/*
 * tests/common/router_prompts.h - what the router's end-to-end tests (tests/unit/test_router.c,
 * tests/unit/test_regress.c) share: a virtual clock the test moves by hand, and prompts that are
 * the same for the same salt and share no block across salts.
 */
#ifndef KVR_TESTS_COMMON_ROUTER_PROMPTS_H
#define KVR_TESTS_COMMON_ROUTER_PROMPTS_H

#include <stddef.h>
#include <stdint.h>

/* The virtual time in ns (kvr_config.now_ns = vclock); the test advances vnow. */
static uint64_t vnow = 1000;
static inline uint64_t vclock(void *ctx)
{
	(void)ctx;
	return __atomic_load_n(&vnow, __ATOMIC_RELAXED);
}

/* Prompt `salt`: n tokens. */
static inline void prompt(uint32_t *t, size_t n, uint32_t salt)
{
	for (size_t i = 0; i < n; i++)
		t[i] = (uint32_t)(i * 7 + salt * 1000003u);
}

#endif
