/* The allocation seam (core/alloc.c): sizes whose arithmetic overflows fail, never come back
 * smaller than asked. */
#include <criterion/criterion.h>
#include <stdint.h>

#include "core/alloc.h"
#include "kvrouter.h"

/* The 64-byte rounding wrapped: kvr_alloc_aligned(SIZE_MAX - 10) returned a 64-byte block. */
Test(alloc, aligned_size_that_cannot_round_fails)
{
	int64_t live = kvr_alloc_live_bytes();
	cr_assert_null(kvr_alloc_aligned(SIZE_MAX - 10));
	cr_assert_null(kvr_alloc_aligned(SIZE_MAX));
	cr_assert_eq(kvr_alloc_live_bytes(), live, "nothing counted");
	cr_assert_geq(kvr_alloc_real_size_aligned(SIZE_MAX - 10), SIZE_MAX - 10);
	void *p = kvr_alloc_aligned(100);
	cr_assert_not_null(p);
	cr_assert_eq((uintptr_t)p % 64, 0);
	kvr_free_aligned(p, 100);
}

/* need * elem wrapped: kvr_grow returned 0 with a capacity of 2^60 over a 16-byte buffer. */
Test(alloc, grow_past_size_max_fails)
{
	uint64_t *a = NULL;
	size_t cap = 0;
	cr_assert_eq(kvr_grow((void **)&a, &cap, SIZE_MAX / 16 + 2, 16), KVR_ENOMEM);
	cr_assert_null(a);
	cr_assert_eq(cap, 0);
	cr_assert_eq(kvr_grow((void **)&a, &cap, 20, sizeof(*a)), 0);
	cr_assert_geq(cap, 20);
	size_t had = cap;
	uint64_t *was = a;
	/* a need past SIZE_MAX / elem from a live array: refused, nothing changed */
	cr_assert_eq(kvr_grow((void **)&a, &cap, SIZE_MAX / sizeof(*a) + 1, sizeof(*a)),
	             KVR_ENOMEM);
	cr_assert_eq(cap, had);
	cr_assert_eq(a, was);
	kvr_free(a, cap * sizeof(*a));
}
