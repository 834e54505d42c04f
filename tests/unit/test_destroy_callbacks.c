/* Destroying (or waiting for) an object from a callback that the object's own machinery runs:
 * kvrouter.h now says what each call does there, and none of them hangs or frees under its
 * caller any more (the feed's own thread: tests/unit/test_feed_callbacks.c).
 *
 * router_destroy_from_on_admit, _from_on_event_gap: kvr_router_destroy from the callback freed
 * the router under the call that ran it (kvr_queue_destroy waited for the pump that was running
 * it; the events call went on in freed memory).
 * router_destroy_from_the_clock_on_a_shard: the shard joined and freed itself.
 * replica_drain_ / replica_destroy_from_on_admit_on_the_apply_thread: on_admit runs on the
 * replica's apply thread when a peer's finish freed room; kvr_replica_drain (kvr_sync_drain) from
 * it waited out its whole timeout for the message it was itself applying, and kvr_replica_destroy
 * (kvr_sync_detach) joined its own thread, then waited for the handling lock it held: for good.
 * Now drain answers KVR_EBUSY at once, wait_ready 0 (ready), and both destroys do nothing there. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/mono_clock.h"
#include "tests/common/pinned_router.h"
#include "tests/common/router_prompts.h"
#include "tests/unit/bus_hog.h"
#include "tests/unit/replica_bus.h"

/* Waits up to 10 s for *flag. */
static bool came_back(atomic_int *flag)
{
	for (int t = 0; t < 1000 && !atomic_load(flag); t++) {
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	return atomic_load(flag);
}

/* ---------------------------------------------------------------- the router */

static struct kvr_router *victim;
static atomic_int returned;
static int on_shard;

static void destroy_victim(void)
{
	kvr_router_destroy(victim); /* returns at once, destroys nothing */
	atomic_store(&returned, 1);
}

static void on_admit_destroy(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket, (void)d;
	destroy_victim();
}

Test(destroy_callbacks, router_destroy_from_on_admit, .timeout = 60)
{
	atomic_store(&returned, 0);
	victim = queue_router(on_admit_destroy);
	struct kvr_decision hog, q;
	cr_assert_eq(route_pinned(victim, 1, 200, &hog), 0);
	cr_assert_eq(hog.status, KVR_DECIDED);
	cr_assert_eq(route_pinned(victim, 2, 64, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(kvr_request_finish(victim, hog.attempt), 0); /* pumps: on_admit here */
	cr_assert(atomic_load(&returned), "on_admit was not called, or did not return");
	/* The router is whole: it routes and finishes, then is destroyed from here. */
	struct kvr_decision d;
	cr_assert_eq(route_pinned(victim, 3, 16, &d), 0);
	cr_assert_eq(kvr_router_sync(victim, 10000), 0);
	kvr_router_destroy(victim);
}

static void on_gap_destroy(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	destroy_victim();
}

Test(destroy_callbacks, router_destroy_from_on_event_gap, .timeout = 60)
{
	atomic_store(&returned, 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap_destroy;
	cr_assert_eq(kvr_router_create(&c, &victim), 0);
	cr_assert_eq(kvr_rank_add(victim, X, 1, KVR_CAPACITY_NONE, 0), 0);
	struct kvr_event_block b = {.ext_hash = 11, .local_hash = 11};
	struct kvr_event ev = {
	    .type = KVR_EVENT_STORED, .event_id = 1, .blocks = &b, .n_blocks = 1};
	cr_assert_eq(kvr_events_apply(victim, X, &ev), 0);
	b = (struct kvr_event_block){.ext_hash = 12, .local_hash = 12};
	ev.event_id = 5; /* 2..4 lost: on_event_gap on this thread */
	cr_assert_eq(kvr_events_apply(victim, X, &ev), 0);
	cr_assert(atomic_load(&returned));
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(victim, X, &st), 0);
	cr_assert_eq(kvr_router_sync(victim, 10000), 0);
	kvr_router_destroy(victim);
}

static atomic_int armed;

static uint64_t shard_clock(void *ctx)
{
	(void)ctx;
	if (kvr_shard_current() && atomic_exchange(&armed, 0)) {
		on_shard = 1;
		destroy_victim();
	}
	return mono_ns();
}

Test(destroy_callbacks, router_destroy_from_the_clock_on_a_shard, .timeout = 60)
{
	atomic_store(&returned, 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.now_ns = shard_clock;
	cr_assert_eq(kvr_router_create(&c, &victim), 0);
	cr_assert_eq(kvr_rank_add(victim, X, 7, 1000, 100), 0);
	atomic_store(&armed, 1);
	cr_assert_eq(kvr_router_sync(victim, 10000), 0); /* the shards read the clock */
	cr_assert(came_back(&returned), "kvr_router_destroy on a shard never returned");
	cr_assert(on_shard);
	struct kvr_decision d;
	cr_assert_eq(route_pinned(victim, 4, 64, &d), 0);
	cr_assert_eq(kvr_router_sync(victim, 10000), 0);
	kvr_router_destroy(victim);
}

/* ---------------------------------------------------------------- the replica */

static atomic_int apply_admitted;
static int apply_destroys; /* 1: on_admit also destroys the replica and the router */
static int apply_named, drain_rc = 1, ready_rc = 1;
static uint64_t drain_ns;

static void on_admit_apply(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket, (void)d;
	char name[17] = {0};
	prctl(PR_GET_NAME, name);
	apply_named = strcmp(name, "kvr-sync-apply") == 0;
	uint64_t t0 = mono_ns();
	drain_rc = kvr_replica_drain(bus.rep[1], 5000);
	drain_ns = mono_ns() - t0;
	ready_rc = kvr_replica_wait_ready(bus.rep[1], 5000);
	if (apply_destroys) {
		kvr_replica_destroy(bus.rep[1]); /* does nothing here */
		kvr_router_destroy(victim);      /* nor this */
	}
	atomic_store(&apply_admitted, 1);
}

static void replica_calls_from_on_admit(int destroys)
{
	apply_destroys = destroys;
	struct kvr_router *r[2];
	bus_hog_pair(r, on_admit_apply);
	victim = r[1];
	uint64_t hog = bus_hog(r);
	/* A's finish, applied by B's apply thread, frees room: on_admit there. */
	cr_assert_eq(kvr_request_finish(r[0], hog), 0);
	cr_assert(came_back(&apply_admitted), "on_admit on the apply thread never returned");
	cr_assert(apply_named, "on_admit did not run on the apply thread");
	cr_assert_eq(drain_rc, KVR_EBUSY, "drain from the apply thread: %d", drain_rc);
	cr_assert_lt(drain_ns, 1000000000ull, "drain took %lu ns", (unsigned long)drain_ns);
	cr_assert_eq(ready_rc, 0);
	/* Both go on: B drains and routes; then everything is torn down from here. */
	bus_quiet(r, 2);
	struct kvr_decision d;
	cr_assert_eq(route_pinned(r[1], 3, 16, &d), 0);
	bus_teardown(r, 2);
}

Test(destroy_callbacks, replica_drain_from_on_admit_on_the_apply_thread, .timeout = 60)
{
	replica_calls_from_on_admit(0);
}

Test(destroy_callbacks, replica_destroy_from_on_admit_on_the_apply_thread, .timeout = 60)
{
	replica_calls_from_on_admit(1);
}
