/*
 * tests/common/oom_loop.h - an out-of-memory loop for Criterion tests (SQLite style, as
 * tests/unit/test_oom_contracts.c): one call with its Nth allocation failed, N = 1, 2, ...
 */
#ifndef KVR_TESTS_OOM_LOOP_H
#define KVR_TESTS_OOM_LOOP_H

#include <criterion/criterion.h>
#include <stdint.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/rcu.h"

/* Runs call(ctx) with its nth allocation failed for nth = 1, 2, ... (below 100) until it
 * returns something else than KVR_ENOMEM; after each KVR_ENOMEM asserts that the library's live
 * bytes are what they were and runs check(ctx, nth) (NULL: none).  Returns the last result;
 * *failed: how many failed.  Context: a test's single thread of control. */
static inline int kvr_oom_loop(int (*call)(void *ctx), void (*check)(void *ctx, uint64_t nth),
                               void *ctx, uint64_t *failed)
{
	/* Frees deferred by earlier calls (call_rcu: an old live-rank list, index nodes) run on
	 * liburcu's thread whenever a grace period ends; one landing between live0 and a check
	 * looked like a failed call keeping bytes (seen once under ASan on a loaded machine). */
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	int rc = KVR_ENOMEM;
	*failed = 0;
	for (uint64_t nth = 1; nth < 100 && rc == KVR_ENOMEM; nth++) {
		kvr_alloc_fail_after(nth);
		rc = call(ctx);
		kvr_alloc_fail_after(0);
		if (rc != KVR_ENOMEM)
			break;
		(*failed)++;
		cr_assert_eq(kvr_alloc_live_bytes(), live0, "nth %lu", (unsigned long)nth);
		if (check)
			check(ctx, nth);
	}
	return rc;
}

#endif
