/*
 * tests/unit/test_replica_early.c - the sender's early set (sync/replica_early.c) holds only ends
 * whose admission note is still to come.  An end a shard tells (a lease expiry, a rank's end) of
 * an attempt whose admission was never noted, and never will be, found no record on the sender
 * and waited in the set until its 60 s prune: the attempts routed before the replica attached,
 * and the attempt of a sync_booking route whose posted booking found its rank gone (kvr_admit's
 * KVR_ENOENT after the post: kvr_route decides again and never notes it).  Each test checks the
 * set is empty once everything is applied, and that an attempt routed after the attach is still
 * mirrored and released by its end (an end never lost).
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h"
#include "tests/unit/replica_bus.h"

static uint32_t early_left(int i)
{
	pthread_mutex_lock(&bus.rep[i]->mu);
	uint32_t n = bus.rep[i]->early_n;
	pthread_mutex_unlock(&bus.rep[i]->mu);
	return n;
}

/* Routes n attempts of 64 tokens (prompts distinct per seed) on r; their ids in out. */
static void route_n(struct kvr_router *r, uint32_t seed, uint64_t *out, size_t n)
{
	for (size_t i = 0; i < n; i++)
		out[i] = bus_route(r, seed + (uint32_t)i, 64).attempt;
}

/* Attempts routed before the attach, ended by their ranks' ends after it (rank 0 removed and
 * added back, rank 1 reset): the shard tells each end (KVR_OP_RANK_ENDED), with no record on the
 * sender.  The one routed after the attach is mirrored, and its rank's end releases the mirror. */
Test(replica_early, rank_ends_of_attempts_routed_before_attach_are_not_kept, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	enum { N = 200 };
	static uint64_t pre[N];
	route_n(r[0], 1, pre, N);
	bus_attach(0, r[0]);
	uint64_t post = bus_route(r[0], 900000, 64).attempt;
	(void)post;
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 1, "the attempt routed after attach is mirrored");
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){0, 0}), 0);
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){0, 0}, 8, 1000, 4096), 0);
	cr_assert_eq(kvr_rank_reset(r[0], (struct kvr_rank_id){1, 0}, 9), 0);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[0]), 0);
	cr_assert_eq(bus_active_requests(r[1]), 0, "the mirror's end was told");
	uint32_t left = early_left(0);
	cr_assert_eq(left, 0, "rank ends of attempts routed before attach kept: %u of %d", left, N);
	bus_teardown(r, 2);
}

/* A virtual clock: the lease reaper expires attempts when the test moves it. */
static uint64_t vnow = 1000000000;
static uint64_t vclock(void *ctx)
{
	(void)ctx;
	return __atomic_load_n(&vnow, __ATOMIC_ACQUIRE);
}

/* Attempts routed before the attach, expired by the lease reaper after it (KVR_OP_EXPIRED). */
Test(replica_early, expiries_of_attempts_routed_before_attach_are_not_kept, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	c.now_ns = vclock;
	c.lease_scan_interval_ns = 1000000; /* 1 ms of the virtual clock */
	cr_assert_eq(kvr_router_create(&c, &r[0]), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){w, 0}, 7, 1000, 4096), 0);
	enum { N = 200 };
	static uint64_t pre[N];
	route_n(r[0], 1, pre, N);
	bus_attach(0, r[0]);
	(void)bus_route(r[0], 900000, 64);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 1, "the attempt routed after attach is mirrored");
	for (int i = 0; i < 20 && bus_active_requests(r[0]); i++) {
		__atomic_add_fetch(&vnow, 10000000, __ATOMIC_RELEASE);
		cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	}
	cr_assert_eq(bus_active_requests(r[0]), 0, "every attempt expired");
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 0, "the mirror's expiry was told");
	uint32_t left = early_left(0);
	cr_assert_eq(left, 0, "expiries of attempts routed before attach kept: %u of %d", left, N);
	bus_teardown(r, 2);
}

/* ---------------------------------------------------------------- sync_booking, rank gone */

/* The router's clock, read on the routing thread as kvr_admit posts a sync_booking booking
 * (kvr_shard_post_at's time): armed, it has the rank removed there, by another thread, before
 * the post, so the booking is posted for a rank whose generation moved.  kvr_admit then returns
 * KVR_ENOENT after the post (its generation check) and kvr_route decides again; the shard drops
 * the booking as stale and tells its rank's end. */
static _Thread_local bool gone_armed;
static int gone_go, gone_done;
static uint64_t gone_clock(void *ctx)
{
	(void)ctx;
	if (gone_armed) {
		gone_armed = false;
		__atomic_store_n(&gone_go, 1, __ATOMIC_RELEASE);
		while (!__atomic_load_n(&gone_done, __ATOMIC_ACQUIRE))
			sched_yield();
	}
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *gone_remover(void *arg)
{
	struct kvr_router *r = arg;
	while (!__atomic_load_n(&gone_go, __ATOMIC_ACQUIRE))
		sched_yield();
	cr_assert_eq(kvr_rank_remove(r, (struct kvr_rank_id){0, 0}), 0);
	__atomic_store_n(&gone_done, 1, __ATOMIC_RELEASE);
	return NULL;
}

Test(replica_early, a_sync_booking_route_that_decides_again_leaves_nothing_kept, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	/* One rank on both (the peer's ranks reach r[0] at its start): the decision is for it,
	 * and the route decides again with none left. */
	r[1] = make();
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){0, 0}, 7, 1000, 4096), 0);
	bus_attach(1, r[1]);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	c.now_ns = gone_clock;
	cr_assert_eq(kvr_router_create(&c, &r[0]), 0);
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){0, 0}, 7, 1000, 4096), 0);
	bus_attach(0, r[0]);
	uint64_t before = metric(r[0], "\nkvr_stale_bookings_total ");
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, gone_remover, r[0]), 0);
	uint32_t t[64];
	for (uint32_t k = 0; k < 64; k++)
		t[k] = 777000 + k;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	struct kvr_decision d;
	gone_armed = true;
	int rc = kvr_route(r[0], &q, &d);
	pthread_join(th, NULL);
	cr_assert(__atomic_load_n(&gone_done, __ATOMIC_ACQUIRE), "the clock was read at the post");
	cr_assert_neq(rc, 0,
	              "routed on a rank removed before its booking was posted: status %d rank %lu "
	              "attempt %lx",
	              (int)d.status, (unsigned long)d.rank.worker_id, (unsigned long)d.attempt);
	bus_quiet(r, 2);
	cr_assert_eq(metric(r[0], "\nkvr_stale_bookings_total ") - before, 1,
	             "the posted booking was dropped as stale");
	/* A route on the rank added back is mirrored and released by its finish (the control). */
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){0, 0}, 8, 1000, 4096), 0);
	bus_quiet(r, 2);
	struct kvr_decision ok = bus_route(r[0], 5, 64);
	bus_quiet(r, 2);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r[1], (struct kvr_rank_id){0, 0}, &s), 0);
	cr_assert_eq(s.active_requests, 1, "the control is mirrored");
	cr_assert_eq(kvr_request_finish(r[0], ok.attempt), 0);
	bus_quiet(r, 2);
	cr_assert_eq(kvr_rank_get_stats(r[1], (struct kvr_rank_id){0, 0}, &s), 0);
	cr_assert_eq(s.active_requests, 0);
	uint32_t left = early_left(0);
	cr_assert_eq(left, 0, "the rank end of the attempt the route gave up is kept");
	bus_teardown(r, 2);
}
