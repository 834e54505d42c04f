/* Attempts on their shard (shards/owner_attempts.c) seen through the router: what makes an
 * admission wait or allocate, counted (kvr_booking_waits_total, the thread's record
 * allocations), not timed. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
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

/* Routes a 64-block prompt (distinct per k) and finishes it; returns the records this thread
 * allocated meanwhile. */
static uint64_t route_64(struct kvr_router *r, uint32_t k)
{
	static uint32_t t[1024]; /* 64 blocks */
	for (uint32_t i = 0; i < 1024; i++)
		t[i] = k * 1000003u + i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = 1024;
	q.tokens = t;
	uint64_t a0 = kvr_owner_thread_record_allocs();
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	uint64_t a1 = kvr_owner_thread_record_allocs();
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0); /* the record is back in the pool */
	return a1 - a0;
}

static struct kvr_router *one_rank_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 4096), 0);
	return r;
}

/* The attempt record of a prompt of 64..16384 blocks comes from the pool once an earlier one of
 * its size class ended; only then does a route allocate none (kvr_owner_thread_record_allocs,
 * what bench_route attributes route tails to).  An idle shard empties the pool after 100 ms
 * (below), so a try whose thread was held up that long between its two routes is made again. */
Test(owner_attempts, records_are_recycled_not_allocated)
{
	struct kvr_router *r = one_rank_router();
	uint64_t second = 1;
	for (uint32_t k = 0; k < 6 && second; k += 2) {
		cr_assert_eq(route_64(r, k), 1, "the first record was allocated");
		second = route_64(r, k + 1);
	}
	cr_assert_eq(second, 0, "the second came from the pool");
	kvr_router_destroy(r);
}

/* A shard idle for 100 ms gives the pooled records back (kvr_owner_shard_idle): the pool's
 * bytes fall to the empty pool's, and the next route allocates its record again. */
Test(owner_attempts, idle_router_keeps_no_records)
{
	struct kvr_router *r = one_rank_router();
	struct kvr_memory m0, m1;
	cr_assert_eq(kvr_router_get_memory(r, &m0), 0);
	route_64(r, 0);
	cr_assert_eq(kvr_router_get_memory(r, &m1), 0);
	cr_assert_gt(m1.attempt_pool, m0.attempt_pool, "the record is kept");
	/* The shard's idle purge comes 100 ms after its last task, and a reading is a task. */
	for (int i = 0; i < 20 && m1.attempt_pool > m0.attempt_pool; i++) {
		struct timespec ts = {0, 250 * 1000 * 1000};
		nanosleep(&ts, NULL);
		cr_assert_eq(kvr_router_get_memory(r, &m1), 0);
	}
	cr_assert_eq(m1.attempt_pool, m0.attempt_pool, "the idle shard freed the pooled record");
	cr_assert_eq(route_64(r, 1), 1, "so the next route allocates one");
	kvr_router_destroy(r);
}

/* Routes `count` 128-block prompts (2k tokens; distinct per base + i) without finishing them,
 * then finishes them all; returns the records this thread allocated for the routes. */
static uint64_t route_2k_burst(struct kvr_router *r, uint32_t base, int count)
{
	static uint32_t t[2048];
	static uint64_t att[256];
	cr_assert_leq(count, 256);
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = 2048;
	q.tokens = t;
	uint64_t a0 = kvr_owner_thread_record_allocs();
	for (int k = 0; k < count; k++) {
		for (uint32_t i = 0; i < 2048; i++)
			t[i] = (base + (uint32_t)k) * 1000003u + i;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(d.status, KVR_DECIDED);
		att[k] = d.attempt;
	}
	uint64_t a1 = kvr_owner_thread_record_allocs();
	for (int k = 0; k < count; k++)
		cr_assert_eq(kvr_request_finish(r, att[k]), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0); /* every record is back */
	return a1 - a0;
}

/* The 2k-token class keeps 256 records: a burst of 200 attempts in flight at once (what an
 * unpaced frontend leaves in the lanes) comes back whole, and the next burst allocates none.
 * With 16 a class (before) the second burst allocated 184: bench_route's frontends allocated
 * in 40-73 % of their routes.  An idle shard empties the pool after 100 ms, so a try whose
 * thread was held up that long is made again. */
Test(owner_attempts, a_burst_of_2k_records_is_recycled_whole)
{
	struct kvr_router *r = one_rank_router();
	uint64_t second = 1;
	for (uint32_t k = 0; k < 3 && second; k++) {
		cr_assert_gt(route_2k_burst(r, 1000 * k, 200), 0);
		second = route_2k_burst(r, 1000 * k + 500, 200);
	}
	cr_assert_eq(second, 0, "the second burst's records came from the pool");
	kvr_router_destroy(r);
}

/* Reports `rounds` x 1,600 output tokens for one 160-token prompt on a rank of `capacity`
 * blocks (KVR_CAPACITY_NONE: TTL retention); returns the most blocks the rank held meanwhile,
 * and its resident blocks after the finish in *after. */
static uint64_t long_output(uint64_t capacity, int rounds, uint64_t *after)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {1, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, capacity, 0), 0);
	static uint32_t p[160], out[1600];
	for (uint32_t i = 0; i < 160; i++)
		p[i] = i + 1;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = p;
	q.n_tokens = 160;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	uint64_t most = 0;
	for (int k = 0; k < rounds; k++) {
		for (uint32_t i = 0; i < 1600; i++)
			out[i] = 1000000u + (uint32_t)k * 1600u + i;
		cr_assert_eq(kvr_request_output(r, d.attempt, out, 1600), 0);
		struct kvr_rank_stats s;
		cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
		if (s.resident_blocks > most)
			most = s.resident_blocks;
	}
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
	*after = s.resident_blocks;
	cr_assert_eq(s.active_blocks, 0);
	cr_assert_eq(kvr_test_metric(r, "kvr_output_over_bound_total"), capacity == 100 ? 1 : 0);
	kvr_router_destroy(r);
	return most;
}

/* One attempt's output stops being predicted at the attempt bound, twice the rank's capacity
 * plus 1,024 blocks (shards/owner_attempts.c, attempt_bound): 160,000 output tokens on a
 * 100-block rank held 10,009 blocks while the attempt lived (pinned blocks are never evicted),
 * now 1,224; counted once.  A rank large enough predicts every block, and a TTL rank (whose
 * blocks expire whether or not an attempt lives) has no bound. */
Test(owner_attempts, output_past_the_attempt_bound_is_not_predicted)
{
	uint64_t after;
	cr_assert_eq(long_output(100, 100, &after), 2 * 100 + 1024);
	cr_assert_eq(after, 100, "the finish released it down to the capacity");
	/* the blocks the 160 + 160,000 tokens fill, less the last one held back (no KV yet) */
	uint64_t big = long_output(100000, 100, &after);
	cr_assert_eq(big, (160 + 160000 - 1) / 16, "%llu", (unsigned long long)big);
	big = long_output(KVR_CAPACITY_NONE, 100, &after);
	cr_assert_eq(big, (160 + 160000 - 1) / 16, "%llu", (unsigned long long)big);
}

/* Output the shard could not take for memory (here its first, whose block buffer it could not
 * make): its tokens are gone, so the attempt's later blocks, hashed on a chain that skips them,
 * were predicted where no prompt will match them, taking the rank's capacity from real blocks.
 * Now the attempt's output is no longer predicted once some of it was lost (counted in
 * kvr_shard_errors_total); the attempt lives on and ends as before. */
Test(owner_attempts, output_lost_for_memory_stops_predicting_the_attempt)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {1, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 0), 0);
	static uint32_t p[32], out[45];
	for (uint32_t i = 0; i < 32; i++)
		p[i] = i + 1;
	for (uint32_t i = 0; i < 45; i++)
		out[i] = 5000 + i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = p;
	q.n_tokens = 32;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	kvr_alloc_fail_after(1); /* the shard's first output allocation */
	cr_assert_eq(kvr_request_output(r, d.attempt, out, 5), 0); /* inline: posted as is */
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(kvr_alloc_fail_pending(), 0, "the failure fired");
	kvr_alloc_fail_after(0);
	cr_assert_eq(kvr_test_metric(r, "kvr_shard_errors_total{what=\"index_write\"}"), 1,
	             "in the output");
	cr_assert_eq(kvr_request_output(r, d.attempt, out + 5, 40), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
	cr_assert_eq(s.resident_blocks, 2, "the prompt's blocks only, not %llu",
	             (unsigned long long)s.resident_blocks);
	cr_assert_eq(s.active_blocks, 0);
	kvr_router_destroy(r);
}

/* sync_booking's lifecycle calls see the lease as the work posted before them left it, the
 * reaper's scans due meanwhile included.  Before, a touch or claim waited only when queued work
 * was timed past the shard's next timer deadline as published, and a booking still queued had
 * not armed the reaper yet (no deadline at all): the fuzzer's seed 8801369 --limits, an output
 * at t1 succeeded while the booking (t0) and a prefill done (t0 + 1) were queued, then those ran
 * and the scans they made due (t0 + 1, t0 + 2) expired the attempt, so the next call at the same
 * t1 returned KVR_ESTALE.  The shard is held in the router's clock while the calls are made. */
static uint64_t hc_now = 1000;
static int hc_hold, hc_held;
static pthread_t hc_test_thread;
static _Thread_local bool hc_never_held; /* the test's syncing thread */
static uint64_t holding_vclock(void *ctx)
{
	(void)ctx;
	if (!pthread_equal(pthread_self(), hc_test_thread) && !hc_never_held &&
	    __atomic_load_n(&hc_hold, __ATOMIC_ACQUIRE)) {
		__atomic_store_n(&hc_held, 1, __ATOMIC_RELEASE);
		while (__atomic_load_n(&hc_hold, __ATOMIC_ACQUIRE))
			nanosleep(&(struct timespec){0, 100000}, NULL);
	}
	return __atomic_load_n(&hc_now, __ATOMIC_ACQUIRE);
}

static void *hc_sync(void *arg)
{
	hc_never_held = true;
	(void)kvr_router_sync(arg, 5000); /* returns once the shard is let go */
	return NULL;
}

static void *hc_release_later(void *arg)
{
	(void)arg;
	nanosleep(&(struct timespec){0, 200000000}, NULL);
	__atomic_store_n(&hc_hold, 0, __ATOMIC_RELEASE);
	return NULL;
}

Test(owner_attempts, sync_booking_calls_see_the_scans_queued_work_makes_due, .timeout = 60)
{
	hc_test_thread = pthread_self();
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.now_ns = holding_vclock;
	c.lease_scan_interval_ns = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {1, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 0), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	static uint32_t w[16], p[32];
	for (uint32_t i = 0; i < 16; i++)
		w[i] = 900 + i;
	for (uint32_t i = 0; i < 32; i++)
		p[i] = i + 1;
	struct kvr_request q;
	struct kvr_decision d;
	/* An attempt routed and finished, and its scan run: the reaper is disarmed (nothing to
	 * scan), so nothing but a booking arms it again. */
	kvr_request_init(&q);
	q.tokens = w;
	q.n_tokens = 16;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	__atomic_store_n(&hc_now, 1001, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	/* Another thread's sync wakes the shard, which then stays in the clock. */
	__atomic_store_n(&hc_hold, 1, __ATOMIC_RELEASE);
	pthread_t syncer;
	cr_assert_eq(pthread_create(&syncer, NULL, hc_sync, r), 0);
	while (!__atomic_load_n(&hc_held, __ATOMIC_ACQUIRE))
		nanosleep(&(struct timespec){0, 100000}, NULL);
	pthread_t rel;
	cr_assert_eq(pthread_create(&rel, NULL, hc_release_later, NULL), 0);
	/* The attempt: booked at t0 = 1001, prefill done at t0 + 1, then the clock jumps. */
	q.tokens = p;
	q.n_tokens = 32;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	__atomic_store_n(&hc_now, 1002, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_request_prefill_done(r, d.attempt), 0);
	__atomic_store_n(&hc_now, 2000000, __ATOMIC_RELEASE);
	static const uint32_t out[1] = {77};
	int rc = kvr_request_output(r, d.attempt, out, 1);
	/* Idle for far more than two scan intervals: KVR_ESTALE is right here, and so is 0 if no
	 * scan has run; but once the output succeeded at this time, the attempt is live at it. */
	if (rc == 0)
		cr_assert_eq(kvr_request_output(r, d.attempt, out, 1), 0,
		             "an output succeeded at this time, then the next found it expired");
	else
		cr_assert_eq(rc, KVR_ESTALE);
	pthread_join(rel, NULL);
	pthread_join(syncer, NULL);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	int again = kvr_request_finish(r, d.attempt);
	cr_assert(rc == 0 ? again == 0 : again == KVR_ESTALE,
	          "output %d, then a finish at the same time %d", rc, again);
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- a waited-for booking fails */

struct gate {
	int held; /* the shard thread is inside stall() */
	int open; /* stall() may return */
};

/* Holds the shard thread until the test opens the gate.  It tags the shard thread so that the
 * armed allocation failures fail its allocations only (core/alloc.h). */
static void stall(struct kvr_shard *sh, void *payload)
{
	(void)sh;
	struct gate *g;
	memcpy(&g, payload, sizeof(g));
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	__atomic_store_n(&g->held, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&g->open, __ATOMIC_ACQUIRE))
		sched_yield();
}

/* Posts stall() to sh and returns once the shard thread is inside it. */
static void hold(struct kvr_shard *sh, struct gate *g)
{
	cr_assert_eq(kvr_shard_post(sh, KVR_LANE_ROUTING, stall, &g, sizeof(g)), 0);
	while (!__atomic_load_n(&g->held, __ATOMIC_ACQUIRE))
		sched_yield();
}

struct admits {
	int n;
	uint64_t ticket;
};

static void count_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)d;
	struct admits *a = ctx;
	__atomic_store_n(&a->ticket, ticket, __ATOMIC_RELAXED);
	__atomic_add_fetch(&a->n, 1, __ATOMIC_RELEASE);
}

struct routed {
	struct kvr_router *r;
	const uint32_t *t;
	int rc;
};

static void *route_thread(void *p)
{
	struct routed *x = p;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = x->t;
	q.n_tokens = 64;
	struct kvr_decision d;
	x->rc = kvr_route(x->r, &q, &d);
	return NULL;
}

/* With sync_booking, a booking that finds no room waits for its shard (kvr_owner_book_call); if
 * it fails there for memory, the shard takes its provisional load back and kvr_route returns
 * KVR_ENOMEM.  A request queued behind that load was left queued on an idle rank until the
 * embedder's next call: nothing woke the admission thread, as a posted booking's failure does
 * (the shard's hook).  Here: the shard held, its booking room used up and its allocations
 * failing, one thread's route waits for its booking while the test queues a second request
 * behind the first one's provisional load; then the shard runs the booking, which fails. */
Test(owner_attempts, sync_booking_waited_booking_failed_for_memory_wakes_the_queue, .timeout = 60)
{
	struct admits seen = {0};
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.queue_threshold = 1.0;
	c.on_admit = count_admit;
	c.callback_ctx = &seen;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	/* A prefill budget of 32 tokens: one uncached 64-token prompt saturates the rank. */
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 32), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	struct kvr_shard *sh = kvr_shards_get(r->shards, 0);
	struct gate g = {0};
	hold(sh, &g);
	long taken = 0;
	while (kvr_owner_book_room_take(sh))
		taken++;
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_from(1);

	static uint32_t a[64], b[64];
	for (uint32_t i = 0; i < 64; i++) {
		a[i] = 1000 + i;
		b[i] = 5000 + i;
	}
	struct routed x = {.r = r, .t = a};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, route_thread, &x), 0);
	/* Its provisional load is published before its booking waits. */
	while (!__atomic_load_n(&r->prov[0].prefill_tokens, __ATOMIC_ACQUIRE))
		sched_yield();
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = b;
	q.n_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED, "saturated by the first request's provisional load");

	__atomic_store_n(&g.open, 1, __ATOMIC_RELEASE);
	cr_assert_eq(pthread_join(th, NULL), 0);
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
	cr_assert_eq(x.rc, KVR_ENOMEM, "the waited-for booking failed on the shard");
	for (long i = 0; i < taken; i++)
		kvr_owner_book_room_give(sh);
	/* No call on the router from here: only the admission thread can admit it. */
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do {
		struct timespec ms = {0, 1000000};
		nanosleep(&ms, NULL);
		clock_gettime(CLOCK_MONOTONIC, &t);
	} while (!__atomic_load_n(&seen.n, __ATOMIC_ACQUIRE) && t.tv_sec - t0.tv_sec < 5);
	cr_assert_eq(__atomic_load_n(&seen.n, __ATOMIC_ACQUIRE), 1,
	             "the queued request stayed queued on an idle rank");
	cr_assert_eq(seen.ticket, d.ticket);
	kvr_router_destroy(r);
}

/* End notes per attempt, as replica sync would hear them (struct kvr_repl_hooks): every end
 * (finish, abort, expiry, a rank's end) counted by the attempt's lease sequence number. */
#define ENDS_MAX 4096
static struct ends {
	uint64_t base; /* the first attempt's sequence number */
	int n[ENDS_MAX];
} ends;

static void ends_admitted(void *ctx, const struct kvr_repl_admission *a)
{
	(void)ctx;
	(void)a;
}

static void ends_progressed(void *ctx, uint64_t attempt, int op, const uint32_t *t, size_t n,
                            bool not_final)
{
	(void)ctx;
	(void)t;
	(void)n;
	(void)not_final;
	if (op == KVR_OP_PREFILL_DONE || op == KVR_OP_OUTPUT)
		return;
	uint64_t i = (attempt >> KVR_LEASE_TAG_BITS) - ends.base;
	if (i < ENDS_MAX)
		__atomic_add_fetch(&ends.n[i], 1, __ATOMIC_RELAXED);
}

static int ends_of(uint64_t attempt)
{
	return __atomic_load_n(&ends.n[(attempt >> KVR_LEASE_TAG_BITS) - ends.base],
	                       __ATOMIC_RELAXED);
}

/* A posted booking dropped for memory is told as an expiry (the attempt's one end note), but
 * only when the drop won the lease's claim and the attempt is the router's own: a caller whose
 * abort claimed the lease while the booking was still posted has told its end already, and a
 * peer's mirror's end is its origin's to tell.  Before, every such drop told an expiry: a
 * second end note for an aborted attempt, and one for a mirror (an id the replica layer has no
 * record of), each left in the sender's early set (sync/replica_early.c) for 60 s.  Here: the
 * shard held, N own attempts routed (the even ones aborted at once) and N mirrors admitted,
 * then the shard's allocations fail: the bookings past its tracking room are dropped. */
Test(owner_attempts, a_booking_dropped_for_memory_tells_one_end_and_none_for_a_mirror,
     .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = false; /* posted bookings */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	const struct kvr_rank_id rk = {0, 0};
	cr_assert_eq(kvr_rank_add(r, rk, 1, 100000, 4096), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	memset(&ends, 0, sizeof(ends));
	struct kvr_repl_hooks h = {.admitted = ends_admitted, .progressed = ends_progressed};
	cr_assert_eq(kvr_repl_set_hooks(r, &h), 0);
	struct kvr_shard *sh = kvr_shards_get(r->shards, 0);
	struct gate g = {0};
	hold(sh, &g);

	enum { N = 400 };
	static uint64_t own[N], peer[N];
	static uint32_t t[64];
	for (size_t i = 0; i < N; i++) {
		for (uint32_t k = 0; k < 64; k++)
			t[k] = (uint32_t)(i * 64 + k);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 64;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		own[i] = d.attempt;
		if (i == 0)
			ends.base = own[0] >> KVR_LEASE_TAG_BITS;
		if (i % 2 == 0)
			cr_assert_eq(kvr_request_abort(r, own[i]), 0, "the caller claims first");
		uint64_t local[2] = {0x1000 + i, 0x2000 + i};
		struct kvr_repl_admission m = {.rank = rk,
		                               .incarnation = 1,
		                               .local = local,
		                               .n = 2,
		                               .prompt_tokens = 2 * c.block_size,
		                               .chain_known = false};
		kvr_repl_applying = true; /* as the apply thread admits a peer's attempt */
		cr_assert_eq(kvr_repl_admit(r, &m), 0);
		kvr_repl_applying = false;
		peer[i] = m.attempt;
		cr_assert_lt((m.attempt >> KVR_LEASE_TAG_BITS) - ends.base, ENDS_MAX);
	}
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER); /* the shard thread alone (stall) */
	kvr_alloc_fail_from(1);
	__atomic_store_n(&g.open, 1, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);

	size_t own_dropped = 0;
	for (size_t i = 0; i < N; i++) {
		if (i % 2 == 0) {
			cr_assert_eq(ends_of(own[i]), 1, "aborted attempt %zu: %d end notes", i,
			             ends_of(own[i]));
		} else {
			/* dropped: told once, as an expiry (its abort is stale); booked: its abort
			 * tells the one end */
			int before = ends_of(own[i]);
			int rc = kvr_request_abort(r, own[i]);
			cr_assert(rc == 0 || rc == KVR_ESTALE);
			own_dropped += rc == KVR_ESTALE;
			cr_assert_eq(before, rc == KVR_ESTALE ? 1 : 0, "attempt %zu", i);
			cr_assert_eq(ends_of(own[i]), 1, "attempt %zu", i);
		}
		cr_assert_eq(ends_of(peer[i]), 0, "mirror %zu: %d end notes", i, ends_of(peer[i]));
	}
	/* The shard's room (a few dozen attempts) was spent long before the last booking. */
	cr_assert_gt(own_dropped, N / 4, "bookings dropped for memory: %zu of %d", own_dropped,
	             N / 2);
	cr_assert_eq(kvr_repl_set_hooks(r, NULL), 0);
	kvr_router_destroy(r);
}

/* The lease reaper's expiry of a peer's mirror tells nothing (its end is its origin's to tell):
 * told, its local id was no record of the replica layer's and sat in the sender's early set for
 * 60 s.  An own attempt's expiry is told once (the control). */
Test(owner_attempts, a_mirrors_lease_expiry_is_not_told, .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = false;
	c.lease_scan_interval_ns = 2000000; /* idle attempts expire after 2-4 ms */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	const struct kvr_rank_id rk = {0, 0};
	cr_assert_eq(kvr_rank_add(r, rk, 1, 100000, 4096), 0);
	memset(&ends, 0, sizeof(ends));
	struct kvr_repl_hooks h = {.admitted = ends_admitted, .progressed = ends_progressed};
	cr_assert_eq(kvr_repl_set_hooks(r, &h), 0);
	static uint32_t t[64];
	for (uint32_t k = 0; k < 64; k++)
		t[k] = k;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	ends.base = d.attempt >> KVR_LEASE_TAG_BITS;
	uint64_t local[2] = {0x1000, 0x2000};
	struct kvr_repl_admission m = {.rank = rk,
	                               .incarnation = 1,
	                               .local = local,
	                               .n = 2,
	                               .prompt_tokens = 2 * c.block_size,
	                               .chain_known = false};
	kvr_repl_applying = true;
	cr_assert_eq(kvr_repl_admit(r, &m), 0);
	kvr_repl_applying = false;
	for (int ms = 0; ms < 20000 && kvr_test_metric(r, "kvr_lease_expiries_total") < 2; ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(kvr_test_metric(r, "kvr_lease_expiries_total"), 2);
	cr_assert_eq(ends_of(d.attempt), 1, "the own attempt's expiry: told once");
	cr_assert_eq(ends_of(m.attempt), 0, "the mirror's expiry: %d end notes",
	             ends_of(m.attempt));
	cr_assert_eq(kvr_repl_set_hooks(r, NULL), 0);
	kvr_router_destroy(r);
}
