/* Attempts on their shard (shards/owner_attempts.c) seen through the router: what makes a
 * sync_booking admission wait for its shard, counted (kvr_booking_waits_total), not timed. */
#include <criterion/criterion.h>

#include "kvrouter.h"
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
