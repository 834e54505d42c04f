/*
 * tests/unit/test_timer.c - shards/timer.c: deadline order with ties in add order, cancel of a
 * fired or cancelled timer refused, and ids never reused (timer.h), also once a record's 32-bit
 * generation is used up.
 *
 * The file is included, not linked: reaching the last generation takes 2^32 - 1 reuses of one
 * record (33 s of add and cancel at -O2), so the test sets the generation there.
 * Before: it wrapped to 1, the record's first id came back, and a cancel of that stale id
 * cancelled the live timer that now had it.
 */
#include "shards/timer.c"

#include <criterion/criterion.h>

static int fired[8], n_fired;

static void note(struct kvr_shard *owner, void *arg)
{
	(void)owner;
	fired[n_fired++] = (int)(intptr_t)arg;
}

Test(timer, deadline_order_ties_in_add_order_and_stale_cancel)
{
	struct kvr_timers t;
	kvr_timers_init(&t);
	uint64_t a, b, c;
	n_fired = 0;
	cr_assert_eq(kvr_timers_add(&t, 20, note, (void *)1, &a), 0);
	cr_assert_eq(kvr_timers_add(&t, 10, note, (void *)2, &b), 0);
	cr_assert_eq(kvr_timers_add(&t, 20, note, (void *)3, &c), 0);
	cr_assert_eq(kvr_timers_next(&t), 10);
	cr_assert_eq(kvr_timers_run(&t, 20, NULL, 8), 3);
	cr_assert(fired[0] == 2 && fired[1] == 1 && fired[2] == 3);
	cr_assert_eq(kvr_timers_cancel(&t, a), KVR_ENOENT, "fired");
	cr_assert_eq(kvr_timers_add(&t, 5, note, (void *)4, &a), 0);
	cr_assert_eq(kvr_timers_cancel(&t, a), 0);
	cr_assert_eq(kvr_timers_cancel(&t, a), KVR_ENOENT, "cancelled");
	cr_assert_eq(kvr_timers_cancel(&t, 0), KVR_ENOENT);
	cr_assert_eq(kvr_timers_pending(&t), 0);
	kvr_timers_fini(&t);
}

Test(timer, ids_not_reused_when_a_generation_runs_out)
{
	struct kvr_timers t;
	kvr_timers_init(&t);
	uint64_t first, id, live;
	cr_assert_eq(kvr_timers_add(&t, 10, note, NULL, &first), 0);
	cr_assert_eq(kvr_timers_cancel(&t, first), 0);
	uint32_t slot = (uint32_t)(first & 0xffffffffu) - 1;
	t.rec[slot].gen = UINT32_MAX; /* as after 2^32 - 2 more reuses */
	cr_assert_eq(kvr_timers_add(&t, 10, note, NULL, &id), 0);
	cr_assert_eq(id, ((uint64_t)UINT32_MAX << 32) | (slot + 1));
	cr_assert_eq(kvr_timers_cancel(&t, id), 0);
	for (int i = 0; i < 64; i++) { /* whichever records these take, none has an old id */
		cr_assert_eq(kvr_timers_add(&t, 10, note, NULL, &live), 0);
		cr_assert_neq(live, first, "the first id came back");
		cr_assert_neq(live, id);
	}
	cr_assert_eq(kvr_timers_cancel(&t, first), KVR_ENOENT, "a stale id cancelled a live timer");
	cr_assert_eq(kvr_timers_pending(&t), 64);
	kvr_timers_fini(&t);
}
