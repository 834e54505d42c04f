/*
 * tests/common/router_prompts.h - what the router's end-to-end tests (tests/unit/test_router.c,
 * tests/unit/test_regress.c; the teardown tests through tests/common/pinned_router.h and
 * tests/sync/test_sync_nats.c's callbacks test) share: a virtual clock the test moves by hand, and
 * prompts that are the same for the same salt and share no block across salts.  No Criterion:
 * test_sync_nats is a plain program.
 */
#ifndef KVR_TESTS_COMMON_ROUTER_PROMPTS_H
#define KVR_TESTS_COMMON_ROUTER_PROMPTS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvrouter.h"

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

/* Routes prompt `salt` (n <= 256 tokens; more aborts: the test is wrong) pinned to rank *x, 16
 * expected output tokens; kvr_route's code, its decision in *d. */
static inline int route_salt_pinned(struct kvr_router *r, const struct kvr_rank_id *x,
                                    uint32_t salt, size_t n, struct kvr_decision *d)
{
	uint32_t t[256];
	if (n > 256)
		abort();
	prompt(t, n, salt);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.pinned = x;
	q.expected_output_tokens = 16;
	return kvr_route(r, &q, d);
}

#endif
