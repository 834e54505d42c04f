/* Lifecycle calls (core/lifecycle.c) and the admission queue. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/router_internal.h"
#include "kvrouter.h"

static int admitted, reported;
static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	__atomic_add_fetch(&reported, 1, __ATOMIC_RELAXED);
	if (d->status == KVR_DECIDED)
		__atomic_add_fetch(&admitted, 1, __ATOMIC_RELAXED);
}

/* Whether admitted reached n within 5 s: without sync_booking the shard applies the call's work
 * after the call returned and the router's admission thread runs the pass. */
static bool admitted_soon(int n)
{
	for (int i = 0; i < 50000 && __atomic_load_n(&admitted, __ATOMIC_RELAXED) < n; i++)
		nanosleep(&(struct timespec){0, 100000}, NULL);
	return __atomic_load_n(&admitted, __ATOMIC_RELAXED) >= n;
}

/* One rank with a 16-token budget at queue_threshold 1: A (64 prompt tokens) saturates it and B
 * queues behind it.  clock: the router's (NULL: the default), with the lease scan every 20 ms
 * (the shard reads it at least that often).  Returns A's attempt; *r the router. */
static uint64_t saturate_clocked(bool sync, uint64_t (*clock)(void *), struct kvr_router **r)
{
	admitted = 0;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = sync;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit;
	if (clock) {
		c.now_ns = clock;
		c.lease_scan_interval_ns = 20000000;
	}
	cr_assert_eq(kvr_router_create(&c, r), 0);
	cr_assert_eq(kvr_rank_add(*r, (struct kvr_rank_id){0, 0}, 1, 1000, 16), 0);
	static uint32_t t[64], u[64];
	for (uint32_t i = 0; i < 64; i++)
		t[i] = 5 + i, u[i] = 900 + i;
	struct kvr_request q;
	struct kvr_decision a, b;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	cr_assert_eq(kvr_route(*r, &q, &a), 0);
	cr_assert_eq(a.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(*r, 5000), 0);
	q.tokens = u;
	cr_assert_eq(kvr_route(*r, &q, &b), 0);
	cr_assert_eq(b.status, KVR_QUEUED);
	cr_assert_eq(admitted, 0);
	return a.attempt;
}

static uint64_t saturate(bool sync, struct kvr_router **r)
{
	return saturate_clocked(sync, NULL, r);
}

/* Output implies the prefill is done: the attempt's prefill tokens leave its rank's load, as at
 * kvr_request_prefill_done.  The request queued behind that load is admitted, as after
 * prefill_done: before the call returns with sync_booking, by the admission thread a moment
 * later without.  Before, output ran no admission pass: B stayed queued on an idle rank (0
 * prefill tokens) until another call ran one (a finish, a new route). */
static void output_admits(bool sync, bool ex)
{
	struct kvr_router *r;
	uint64_t a = saturate(sync, &r);
	uint32_t tok[2] = {1, 2};
	if (ex)
		cr_assert_eq(kvr_request_output_ex(r, a, tok, 2, 0), 0);
	else
		cr_assert_eq(kvr_request_output(r, a, tok, 1), 0);
	if (sync)
		cr_assert_eq(admitted, 1, "the queued request is admitted by the output call");
	else
		cr_assert(admitted_soon(1), "the queued request is admitted after the output call");
	kvr_router_destroy(r);
}

Test(lifecycle, first_output_admits_queued)
{
	output_admits(false, false);
}

Test(lifecycle, first_output_admits_queued_sync_booking)
{
	output_admits(true, false);
}

Test(lifecycle, first_output_ex_admits_queued)
{
	output_admits(false, true);
}

/* The reference: prefill_done admits it. */
Test(lifecycle, prefill_done_admits_queued)
{
	struct kvr_router *r;
	uint64_t a = saturate(false, &r);
	cr_assert_eq(kvr_request_prefill_done(r, a), 0);
	cr_assert(admitted_soon(1));
	kvr_router_destroy(r);
}

/* A lifecycle call never waits for a shard, a router that queues included.  Before, while
 * requests were queued (or the rank was saturated), finish, abort and prefill done waited one
 * round trip to the rank's shard and ran the admission pass themselves: behind a shard held up
 * (here in the router's clock; in production, a long booking or eviction) the caller waited for
 * all of it.  Now the finish returns while the shard is held, and the queued request is admitted
 * once the shard has applied it. */
static int clock_hold, clock_held;
static pthread_t test_thread;
static _Thread_local bool never_held; /* the test's own threads */
static uint64_t holding_clock(void *ctx)
{
	(void)ctx;
	if (!pthread_equal(pthread_self(), test_thread) && !never_held &&
	    __atomic_load_n(&clock_hold, __ATOMIC_ACQUIRE)) {
		__atomic_store_n(&clock_held, 1, __ATOMIC_RELEASE);
		while (__atomic_load_n(&clock_hold, __ATOMIC_ACQUIRE))
			nanosleep(&(struct timespec){0, 100000}, NULL);
	}
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *release_later(void *arg)
{
	(void)arg;
	nanosleep(&(struct timespec){2, 0}, NULL);
	__atomic_store_n(&clock_hold, 0, __ATOMIC_RELEASE);
	return NULL;
}

Test(lifecycle, finish_on_a_saturated_rank_does_not_wait_for_its_shard, .timeout = 60)
{
	test_thread = pthread_self();
	struct kvr_router *r;
	uint64_t a = saturate_clocked(false, holding_clock, &r);
	/* Hold the shard in the clock, released 2 s later by another thread (so that a call that
	 * waits for the shard returns too, late, and the test reports it instead of hanging). */
	__atomic_store_n(&clock_hold, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&clock_held, __ATOMIC_ACQUIRE))
		nanosleep(&(struct timespec){0, 100000}, NULL);
	pthread_t rel;
	cr_assert_eq(pthread_create(&rel, NULL, release_later, NULL), 0);
	cr_assert_eq(kvr_request_finish(r, a), 0);
	bool held = __atomic_load_n(&clock_hold, __ATOMIC_ACQUIRE);
	int early = __atomic_load_n(&admitted, __ATOMIC_RELAXED);
	pthread_join(rel, NULL);
	cr_assert(held, "the finish returned only once the shard was released");
	cr_assert_eq(early, 0, "admitted while the shard was held");
	cr_assert(admitted_soon(1), "the queued request is admitted once the shard applied it");
	kvr_router_destroy(r);
}

/* A booking whose post fails (its shard's lane stayed full) takes its provisional load back
 * on the routing thread, and that load may be what a request queued behind: B, routed to X
 * while A's load was on it, queued; A's post then failed and its load went.  Nothing else lowers
 * X's load, so only that take-back can wake the admission thread.  Before, it did not: B stayed
 * queued on an idle rank for good (on_admit never came).  The lane is filled with bookings for Y
 * while the shard is held in the router's clock. */
static struct kvr_router *tb_router;
static int tb_rc[2], tb_status[2];
static void *tb_route_x(void *arg)
{
	int i = (int)(intptr_t)arg;
	never_held = true;
	static uint32_t t[2][64];
	for (uint32_t k = 0; k < 64; k++)
		t[i][k] = 7000u * (uint32_t)(i + 1) + k;
	struct kvr_rank_id x = {0, 0};
	struct kvr_request q;
	struct kvr_decision d;
	kvr_request_init(&q);
	q.tokens = t[i];
	q.n_tokens = 64;
	q.pinned = &x;
	tb_rc[i] = kvr_route(tb_router, &q, &d);
	tb_status[i] = tb_rc[i] == 0 ? (int)d.status : -1;
	return NULL;
}

Test(lifecycle, a_failed_booking_post_wakes_the_admission_of_what_queued_behind_it, .timeout = 60)
{
	test_thread = pthread_self();
	bool shown = false;
	for (int round = 0; round < 20 && !shown; round++) {
		admitted = 0;
		reported = 0;
		clock_held = 0;
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.lane_capacity = 2;
		c.lane_soft_depth = 0;
		c.queue_threshold = 1.0;
		c.on_admit = on_admit;
		c.now_ns = holding_clock;
		c.lease_scan_interval_ns = 60000000000ull; /* no expiry lowers X's load meanwhile */
		cr_assert_eq(kvr_router_create(&c, &tb_router), 0);
		struct kvr_rank_id x = {0, 0}, y = {1, 0};
		cr_assert_eq(kvr_rank_add(tb_router, x, 1, 1000, 16), 0);
		cr_assert_eq(kvr_rank_add(tb_router, y, 1, 1000000, 1 << 20), 0);
		cr_assert_eq(kvr_router_sync(tb_router, 5000), 0);
		/* The first booking for Y holds the shard in the clock; the next ones fill its
		 * routing lane. */
		__atomic_store_n(&clock_hold, 1, __ATOMIC_RELEASE);
		static uint32_t u[16];
		struct kvr_request q;
		struct kvr_decision d;
		int rc = 0;
		for (uint32_t n = 0; n < 64 && rc == 0; n++) {
			while (n == 1 && !__atomic_load_n(&clock_held, __ATOMIC_ACQUIRE))
				nanosleep(&(struct timespec){0, 100000}, NULL);
			for (uint32_t k = 0; k < 16; k++)
				u[k] = 100000u + 16u * n + k;
			kvr_request_init(&q);
			q.tokens = u;
			q.n_tokens = 16;
			q.pinned = &y;
			rc = kvr_route(tb_router, &q, &d);
		}
		cr_assert_eq(rc, KVR_EAGAIN, "the held shard's lane filled");
		/* The refused decision does not read as admitted (it read KVR_DECIDED with its
		 * rank: the header-contract audit). */
		cr_assert(d.status == KVR_FAILED && d.error == KVR_EAGAIN && d.attempt == 0,
		          "a refused route's decision reads status %d error %d attempt %llu",
		          d.status, d.error, (unsigned long long)d.attempt);
		/* Two routes to X at once: the first to publish its load saturates X, so the other
		 * queues behind it; the first's post then fails on the full lane. */
		pthread_t th[2];
		for (int i = 0; i < 2; i++)
			cr_assert_eq(pthread_create(&th[i], NULL, tb_route_x, (void *)(intptr_t)i),
			             0);
		for (int i = 0; i < 2; i++)
			pthread_join(th[i], NULL);
		__atomic_store_n(&clock_hold, 0, __ATOMIC_RELEASE);
		int queued = (tb_status[0] == KVR_QUEUED) + (tb_status[1] == KVR_QUEUED);
		int failed = (tb_rc[0] == KVR_EAGAIN) + (tb_rc[1] == KVR_EAGAIN);
		if (queued == 1 && failed == 1) {
			shown = true;
			/* Any outcome will do (its own booking may find the lane still full): what
			 * matters is that the queued request is not left waiting on an idle rank.
			 */
			bool told = false;
			for (int i = 0; i < 50000 && !told; i++) {
				told = __atomic_load_n(&reported, __ATOMIC_RELAXED) > 0;
				if (!told)
					nanosleep(&(struct timespec){0, 100000}, NULL);
			}
			cr_assert(told, "the request queued behind the failed booking's load is "
			                "still queued on an idle rank");
		}
		kvr_router_destroy(tb_router);
	}
	cr_assert(shown, "no round had one route queue behind another's failed post");
}

/* An outcome nobody collects (a queued request admitted while nobody waits for it and no
 * on_admit is set) lives until its lease expires, two lease scan intervals (4 minutes by
 * default).  Meanwhile, with nothing queued, the shard's hook woke the admission thread after
 * every lifecycle message, to look at that outcome again (its attempt can only end by an
 * expiry or its rank's reset or removal, which reap themselves): a FUTEX_WAKE and a pass over
 * every uncollected outcome per call.  Now the hook wakes it only when requests are queued or
 * an attempt ended without a call (an expiry, a booking dropped).  Counted as the admission
 * thread's voluntary context switches ("kvr-admit" in /proc/self/task). */
static long admitter_switches(void)
{
	DIR *d = opendir("/proc/self/task");
	if (!d)
		return -1;
	long n = -1;
	struct dirent *de;
	while ((de = readdir(d)) && n < 0) {
		char path[288], buf[64] = {0};
		snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
		FILE *f = fopen(path, "r");
		if (!f)
			continue;
		bool ours = fgets(buf, sizeof(buf), f) && strncmp(buf, "kvr-admit", 9) == 0;
		fclose(f);
		if (!ours)
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/status", de->d_name);
		if (!(f = fopen(path, "r")))
			continue;
		char line[256];
		while (fgets(line, sizeof(line), f))
			if (sscanf(line, "voluntary_ctxt_switches: %ld", &n) == 1)
				break;
		fclose(f);
	}
	closedir(d);
	return n;
}

Test(lifecycle, an_uncollected_outcome_does_not_wake_the_admission_thread_per_call, .timeout = 60)
{
	admitted = 0;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id x = {0, 0}, y = {1, 0};
	cr_assert_eq(kvr_rank_add(r, x, 1, 1000, 16), 0);
	cr_assert_eq(kvr_rank_add(r, y, 1, 1000000, 1 << 20), 0);
	static uint32_t t[64], u[64], v[16];
	for (uint32_t i = 0; i < 64; i++)
		t[i] = 5 + i, u[i] = 900 + i;
	struct kvr_request q;
	struct kvr_decision a, b, e;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	q.pinned = &x;
	cr_assert_eq(kvr_route(r, &q, &a), 0);
	cr_assert_eq(a.status, KVR_DECIDED);
	q.tokens = u;
	cr_assert_eq(kvr_route(r, &q, &b), 0);
	cr_assert_eq(b.status, KVR_QUEUED);
	/* B is admitted once A is done, and nobody collects it. */
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
	/* (Polled: a pass lowers the depth and then counts the outcome, both under the queue's
	 * lock, which these reads do not take.) */
	for (int i = 0; i < 50000 && (kvr_queue_depth(r) > 0 || kvr_queue_uncollected(r) != 1); i++)
		nanosleep(&(struct timespec){0, 100000}, NULL);
	cr_assert_eq(kvr_queue_depth(r), 0);
	cr_assert_eq(kvr_queue_uncollected(r), 1);
	nanosleep(&(struct timespec){0, 20000000}, NULL);
	long s0 = admitter_switches();
	cr_assert_geq(s0, 0, "no kvr-admit thread");
	for (uint32_t n = 0; n < 100; n++) {
		for (uint32_t k = 0; k < 16; k++)
			v[k] = 100000u + 16u * n + k;
		kvr_request_init(&q);
		q.tokens = v;
		q.n_tokens = 16;
		q.pinned = &y;
		cr_assert_eq(kvr_route(r, &q, &e), 0);
		cr_assert_eq(e.status, KVR_DECIDED);
		cr_assert_eq(kvr_request_finish(r, e.attempt), 0);
		nanosleep(&(struct timespec){0, 1000000}, NULL); /* the shard applies it */
	}
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	long s1 = admitter_switches();
	cr_assert_lt(s1 - s0, 20,
	             "the admission thread woke %ld times for 100 finishes with nothing queued",
	             s1 - s0);
	cr_assert_eq(kvr_queue_uncollected(r), 1, "the outcome stays until its lease ends");
	kvr_router_destroy(r);
}
