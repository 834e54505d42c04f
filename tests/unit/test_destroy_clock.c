/* kvr_router_destroy from the embedder's clock (kvr_config.now_ns) on the embedder's own thread,
 * inside kvr_route: kvrouter.h forbids it, and it freed the router under kvr_route (under ASan a
 * heap-use-after-free in kvr_route; plain, whatever the freed memory then held).  The clock the
 * embedder gives is now called with the thread marked as running the router's callback
 * (core/router.c clock_guarded), so the destroy returns at once and destroys nothing, as from
 * on_admit or on_event_gap (tests/unit/test_destroy_callbacks.c); the router routes on and is
 * destroyed from here afterwards.  The routes with the clock's reading in them: a sync_booking
 * post (core/route.c) and a queued request's enqueue time (core/queue.c). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/pinned_router.h"
#include "tests/common/router_prompts.h"

static struct kvr_router *victim;
static pthread_t frontend;
static atomic_int armed, returned, on_frontend;

static uint64_t frontend_clock(void *ctx)
{
	(void)ctx;
	if (!kvr_shard_current() && pthread_equal(pthread_self(), frontend) &&
	    atomic_exchange(&armed, 0)) {
		atomic_store(&on_frontend, 1);
		kvr_router_destroy(victim); /* returns at once, destroys nothing */
		atomic_store(&returned, 1);
	}
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static struct kvr_router *clock_router(double queue_threshold)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.queue_threshold = queue_threshold;
	c.now_ns = frontend_clock;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, X, 7, 1000, 100), 0);
	return r;
}

/* Routes on, then finishes, syncs and destroys from here. */
static void still_whole(struct kvr_decision *done, int n_done)
{
	struct kvr_decision d;
	cr_assert_eq(route_pinned(victim, 3, 16, &d), 0);
	cr_assert_eq(d.status, n_done > 1 ? KVR_QUEUED : KVR_DECIDED);
	for (int i = 0; i < n_done; i++)
		if (done[i].status == KVR_DECIDED)
			cr_assert_eq(kvr_request_finish(victim, done[i].attempt), 0);
	cr_assert_eq(kvr_router_sync(victim, 10000), 0);
	kvr_router_destroy(victim);
}

Test(destroy_clock, router_destroy_from_the_clock_in_kvr_route, .timeout = 60)
{
	frontend = pthread_self();
	atomic_store(&returned, 0);
	atomic_store(&on_frontend, 0);
	victim = clock_router(0);
	atomic_store(&armed, 1);
	struct kvr_decision d;
	cr_assert_eq(route_pinned(victim, 1, 64, &d), 0); /* the booking's post reads the clock */
	cr_assert(atomic_load(&on_frontend), "the clock was not read on this thread");
	cr_assert(atomic_load(&returned));
	cr_assert_eq(d.status, KVR_DECIDED);
	still_whole(&d, 1);
}

Test(destroy_clock, router_destroy_from_the_clock_queueing_a_request, .timeout = 60)
{
	frontend = pthread_self();
	atomic_store(&returned, 0);
	atomic_store(&on_frontend, 0);
	victim = clock_router(1.0);
	struct kvr_decision d[2];
	cr_assert_eq(route_pinned(victim, 1, 200, &d[0]), 0); /* saturates X */
	cr_assert_eq(d[0].status, KVR_DECIDED);
	atomic_store(&armed, 1);
	cr_assert_eq(route_pinned(victim, 2, 64, &d[1]), 0); /* queued: its time read */
	cr_assert(atomic_load(&on_frontend), "the clock was not read on this thread");
	cr_assert(atomic_load(&returned));
	cr_assert_eq(d[1].status, KVR_QUEUED);
	still_whole(d, 2);
}

/* The clock on the shard making a lifecycle call (kvrouter.h allows it: "lifecycle calls post
 * their work") while kvr_router_destroy runs on another thread: the call began before the
 * destroy, so it passed its shutdown check, and with requests queued it pumps the queue once
 * its work is posted.  The destroy freed the queue before it stopped the shards, so that call
 * read the freed queue (under ASan a heap-use-after-free in kvr_queue_depth; plain, the queued
 * request was answered KVR_ESHUTDOWN through on_admit while the call still held the queue).
 * Now the shards are joined first: the queued request is answered only once the call returned
 * from the queue.  The call is held in its own clock reading (the post's) while the destroy
 * goes on. */
static struct kvr_router *shard_victim;
static uint64_t shard_attempt;
static atomic_int shard_armed, shard_go, shard_holding, shard_admits, shard_admit_early;
static _Thread_local bool shard_in_finish;

static uint64_t shard_clock(void *ctx)
{
	(void)ctx;
	if (shard_in_finish) { /* the finish's post reads the clock: the destroy starts now */
		shard_in_finish = false;
		atomic_store(&shard_holding, 1);
		atomic_store(&shard_go, 1);
		struct timespec hold = {0, 200000000};
		nanosleep(&hold, NULL);
		atomic_store(&shard_holding, 0);
	} else if (kvr_shard_current() && atomic_exchange(&shard_armed, 0)) {
		shard_in_finish = true;
		(void)kvr_request_finish(shard_victim, shard_attempt); /* 0 or KVR_ESHUTDOWN */
		shard_in_finish = false;
	}
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void shard_on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	(void)d;
	atomic_fetch_add(&shard_admits, 1);
	if (atomic_load(&shard_holding))
		atomic_store(&shard_admit_early, 1);
}

Test(destroy_clock, router_destroy_while_the_clock_on_a_shard_finishes_with_requests_queued,
     .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.queue_threshold = 1.0;
	c.on_admit = shard_on_admit;
	c.now_ns = shard_clock;
	c.lease_scan_interval_ns = 2000000; /* the shard reads the clock every few ms */
	struct kvr_decision d[2];
	/* The first attempt expires after 2-4 ms idle: a test thread off its CPU that long
	 * between the two routes (a loaded machine) finds X free again; set up again then. */
	for (int tries = 0;; tries++) {
		cr_assert_eq(kvr_router_create(&c, &shard_victim), 0);
		cr_assert_eq(kvr_rank_add(shard_victim, X, 7, 1000, 100), 0);
		cr_assert_eq(route_pinned(shard_victim, 1, 200, &d[0]), 0); /* saturates X */
		cr_assert_eq(d[0].status, KVR_DECIDED);
		cr_assert_eq(route_pinned(shard_victim, 2, 64, &d[1]), 0);
		if (d[1].status == KVR_QUEUED)
			break;
		cr_assert_eq(d[1].status, KVR_DECIDED);
		cr_assert_eq(kvr_request_finish(shard_victim, d[0].attempt), KVR_ESTALE,
		             "the second request was not queued, and not because the first "
		             "expired");
		kvr_router_destroy(shard_victim);
		cr_assert_lt(tries, 50,
		             "the first attempt expired before the second route 50 "
		             "times");
	}
	shard_attempt = d[0].attempt;
	atomic_store(&shard_armed, 1);
	for (int ms = 0; ms < 10000 && !atomic_load(&shard_go); ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	cr_assert(atomic_load(&shard_go), "the shard never read the clock");
	kvr_router_destroy(shard_victim);
	cr_assert_eq(atomic_load(&shard_admits), 1, "the queued request answered %d times",
	             atomic_load(&shard_admits));
	cr_assert_not(atomic_load(&shard_admit_early),
	              "the destroy answered the queued request (freed the queue) while a call "
	              "on a shard still used it");
}
