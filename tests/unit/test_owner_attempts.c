/* Attempts on their shard (shards/owner_attempts.c) seen through the router: what makes an
 * admission wait or allocate, counted (kvr_booking_waits_total, the thread's record
 * allocations), not timed. */
#include <criterion/criterion.h>

#include "kvrouter.h"
#include "shards/owner.h"
#include "tests/common/metric.h"

/* Each shard's room (the attempts it can track without allocating, which a deferred booking
 * takes) is made when the shard starts and when a rank is created on it: the first bookings
 * are posted, not waited for.  The room started at zero, so each shard's first booking was a
 * round trip (2 of the first 4 here, one per shard).  Then 300 live attempts and their
 * finishes: the shard grows the room ahead of the bookings, none waits. */
Test(owner_attempts, sync_booking_first_bookings_do_not_wait)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (uint64_t w = 0; w < 4; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 100000, 4096), 0);
	static uint32_t t[300][64];
	static uint64_t attempt[300];
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = 64;
	int n = 0;
	for (; n < 300; n++) {
		for (uint32_t i = 0; i < 64; i++)
			t[n][i] = (uint32_t)n * 1000003u + i; /* no shared prefix */
		q.tokens = t[n];
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(d.status, KVR_DECIDED);
		attempt[n] = d.attempt;
		if (n == 3) /* four ranks, two shards, an idle router: each rank took one */
			cr_assert_eq(kvr_test_metric(r, "kvr_booking_waits_total"), 0,
			             "the first bookings were posted");
	}
	for (int i = 0; i < n; i++)
		cr_assert_eq(kvr_request_finish(r, attempt[i]), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(kvr_test_metric(r, "kvr_booking_waits_total"), 0);
	cr_assert_eq(kvr_test_metric(r, "kvr_routes_total"), 300);
	kvr_router_destroy(r);
}

/* The attempt record of a prompt of 64..16384 blocks comes from the pool once an earlier one of
 * its size class ended; only then does a route allocate none (kvr_owner_thread_record_allocs,
 * what bench_route attributes route tails to). */
Test(owner_attempts, records_are_recycled_not_allocated)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 4096), 0);
	static uint32_t t[2][1024]; /* 64 blocks */
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = 1024;
	uint64_t allocs[3];
	for (int k = 0; k < 2; k++) {
		for (uint32_t i = 0; i < 1024; i++)
			t[k][i] = (uint32_t)k * 1000003u + i;
		allocs[k] = kvr_owner_thread_record_allocs();
		q.tokens = t[k];
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		cr_assert_eq(kvr_router_sync(r, 5000), 0); /* the record is back in the pool */
	}
	allocs[2] = kvr_owner_thread_record_allocs();
	cr_assert_eq(allocs[1], allocs[0] + 1, "the first record was allocated");
	cr_assert_eq(allocs[2], allocs[1], "the second came from the pool");
	kvr_router_destroy(r);
}
