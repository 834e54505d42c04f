/*
 * stress_admin_clock: the router's clock calling the API (a router callback on the shards'
 * threads, inside their tasks, and on the frontends') while an admin thread adds and removes
 * ranks and frontends route and finish.  On one read in 32 the clock makes one call of 13 kinds
 * (rank add / remove / reset / set_capacity / blocks / stats, events, a route and its finish, a
 * recent attempt's finish or cached tokens, router sync, memory, metrics) on one of a few extra
 * ranks or a recent attempt.  Before core/ranks.c's admin_lock the admin thread, holding the
 * router's admin lock while it waited for a shard, and that shard's clock asking for the lock
 * waited for good; before kvr_shard_call refused a call on the thread's own shard, a clock's
 * kvr_rank_remove freed the rank under the booking that read the clock (ASan:
 * heap-use-after-free in book()).
 * Checks: nothing waits for good (alarm), every call returns one of its documented codes or
 * KVR_EBUSY (refused there), and at the end every attempt ended and all load is back to zero.
 * The clock acts on the frontends' threads too (their calls read it with sync_booking).
 * Environment: SAC_SYNC=1 books synchronously, SAC_EVENTS=1 runs an events-mode router,
 * SAC_LANE=n gives each shard a routing lane of n messages and no soft depth (full lanes: a
 * clock's finish on a full lane is kept by its shard thread, a shard thread's wait for room in
 * another's lane is a wait edge; shards/runtime.c).
 *
 * usage: stress_admin_clock [duration_ms]   exit 0 pass, 1 fail
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/mono_clock.h"
#include "tests/common/router_prompts.h"
#include "tests/common/xorshift.h"

enum { BASE = 4, EXTRA = 4, ADMIN_RANKS = 4, FRONTENDS = 2 };

static struct kvr_router *r;
static atomic_int armed, stop, failed;
static atomic_long clock_calls, clock_ok, clock_busy, admin_calls, routes, busy_routes;

static bool admin_rc_ok(int rc)
{
	return rc == 0 || rc == KVR_EEXIST || rc == KVR_ENOENT;
}

static void fail(const char *what, int rc)
{
	fprintf(stderr, "FAIL: %s returned %d (%s)\n", what, rc, kvr_last_error());
	atomic_store(&failed, 1);
}

/* Attempts the frontends routed lately, for the clock's lifecycle and heal calls. */
enum { RECENT = 64 };
static _Atomic uint64_t recent[RECENT];

/* The return codes a clock's call may give: its documented ones, KVR_EBUSY (refused there)
 * and, for a rank the admin thread or another clock removed meanwhile, KVR_ENOENT /
 * KVR_ESTALE. */
static bool clock_rc_ok(int rc, unsigned op)
{
	if (rc == 0 || rc == KVR_EBUSY || rc == KVR_ENOENT || rc == KVR_ESTALE)
		return true;
	switch (op) {
	case 0:
		return rc == KVR_EEXIST; /* add */
	case 4:
		return rc == KVR_ERANGE; /* rank blocks, cap too small */
	case 6:
		return rc == KVR_EINVAL || rc == KVR_ERANGE; /* events: approx mode, bound */
	case 7:
		return rc == KVR_EAGAIN; /* route: a lane full */
	case 9:
		return rc == KVR_ETIMEDOUT || rc == KVR_EINVAL; /* router sync: none from a shard */
	case 11:
		return rc == KVR_EINVAL; /* cached tokens past the prompt */
	default:
		return false;
	}
}

static const char *const op_name[] = {
    "kvr_rank_add",       "kvr_rank_remove",    "kvr_rank_reset",        "kvr_rank_set_capacity",
    "kvr_rank_blocks",    "kvr_rank_get_stats", "kvr_events_apply",      "kvr_route",
    "kvr_request_finish", "kvr_router_sync",    "kvr_router_get_memory", "kvr_request_cached",
    "kvr_metrics_render"};
enum { OPS = sizeof(op_name) / sizeof(op_name[0]) };

/* One API call of kind op on one of the extra ranks (workers 100..) or a recent attempt. */
static int clock_call(unsigned op, uint64_t x)
{
	struct kvr_rank_id id = {100 + (x >> 8) % EXTRA, 0};
	uint64_t att = atomic_load_explicit(&recent[(x >> 24) % RECENT], memory_order_relaxed);
	switch (op) {
	case 0:
		return kvr_rank_add(r, id, 1, 256, 0);
	case 1:
		return kvr_rank_remove(r, id);
	case 2:
		return kvr_rank_reset(r, id, 1 + (x >> 30) % 2);
	case 3:
		return kvr_rank_set_capacity(r, id, 1, (x >> 30) % 2 ? 128 : 256);
	case 4: {
		uint64_t b[8];
		size_t n;
		return kvr_rank_blocks(r, id, b, 8, &n);
	}
	case 5: {
		struct kvr_rank_stats st;
		return kvr_rank_get_stats(r, id, &st);
	}
	case 6: {
		struct kvr_event_block blk = {.ext_hash = 1000 + (x >> 32) % 64,
		                              .local_hash = 5000 + (x >> 32) % 64};
		struct kvr_event ev = {.type = (x >> 40) % 4 ? KVR_EVENT_STORED : KVR_EVENT_REMOVED,
		                       .blocks = &blk,
		                       .n_blocks = 1};
		return kvr_events_apply(r, id, &ev);
	}
	case 7: {
		struct kvr_decision d;
		int rc = route_salt_pinned(r, NULL, (uint32_t)(x >> 48), 32, &d);
		if (rc == 0 && d.status == KVR_DECIDED) {
			int f = kvr_request_finish(r, d.attempt);
			if (f && f != KVR_ESTALE)
				return f;
		}
		return rc;
	}
	case 8:
		return att ? kvr_request_finish(r, att) : 0;
	case 9:
		return kvr_router_sync(r, 0);
	case 10: {
		struct kvr_memory m;
		return kvr_router_get_memory(r, &m);
	}
	case 11:
		return att ? kvr_request_cached(r, att, 16 * ((x >> 30) % 8)) : 0;
	default: {
		char buf[256];
		size_t len;
		int rc = kvr_metrics_render(r, buf, sizeof(buf), &len);
		return rc == KVR_ERANGE ? 0 : rc; /* buf too small: expected */
	}
	}
}

/* One in 32 reads calls the API (clock_call), on a shard's thread or a frontend's. */
static uint64_t admin_clock(void *ctx)
{
	(void)ctx;
	static _Thread_local uint64_t rnd;
	static _Thread_local bool inside; /* the calls read the clock too */
	if (!inside && atomic_load_explicit(&armed, memory_order_relaxed)) {
		if (!rnd)
			rnd = 0x9e3779b97f4a7c15ull * ((uintptr_t)&rnd | 1);
		uint64_t x = xorshift64(&rnd);
		if (x % 32 == 0) {
			inside = true;
			unsigned op = (unsigned)((x >> 5) % OPS);
			int rc = clock_call(op, x);
			atomic_fetch_add(&clock_calls, 1);
			atomic_fetch_add(rc == KVR_EBUSY ? &clock_busy : &clock_ok, 1);
			if (!clock_rc_ok(rc, op)) {
				char what[64];
				snprintf(what, sizeof(what), "a clock's %s", op_name[op]);
				fail(what, rc);
			}
			inside = false;
		}
	}
	return mono_ns();
}

static void *admin(void *arg)
{
	(void)arg;
	uint64_t rnd = 77;
	while (!atomic_load(&stop)) {
		uint64_t x = xorshift64(&rnd);
		struct kvr_rank_id id = {200 + x % ADMIN_RANKS, 0};
		int rc = (x >> 8) & 1 ? kvr_rank_add(r, id, 1, 256, 0) : kvr_rank_remove(r, id);
		if (!admin_rc_ok(rc))
			fail("the admin thread's add or remove", rc);
		atomic_fetch_add(&admin_calls, 1);
		if ((x >> 12) % 4 == 0)
			sleep_us(200);
	}
	return NULL;
}

static void *frontend(void *arg)
{
	uint64_t rnd = 1000 + (uintptr_t)arg;
	uint32_t tok[256];
	while (!atomic_load(&stop)) {
		uint64_t x = xorshift64(&rnd);
		uint32_t n = 64 + (uint32_t)(x % 192);
		for (uint32_t i = 0; i < n; i++)
			tok[i] =
			    i < 64 ? i : (uint32_t)(x >> 20) + i; /* a shared 64-token prefix */
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n;
		struct kvr_decision d;
		int rc = kvr_route(r, &q, &d);
		if (rc == KVR_EAGAIN || rc == KVR_ENOENT) { /* a full lane; every rank gone */
			atomic_fetch_add(&busy_routes, 1);
			continue;
		}
		if (rc) {
			fail("kvr_route", rc);
			break;
		}
		atomic_fetch_add(&routes, 1);
		atomic_store_explicit(&recent[x % RECENT], d.attempt, memory_order_relaxed);
		rc = kvr_request_finish(r, d.attempt);
		if (rc && rc != KVR_ESTALE) /* stale: its rank was removed meanwhile */
			fail("kvr_request_finish", rc);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 2000;
	alarm((unsigned)(ms / 1000 + 60)); /* a wait for good becomes a failure */
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.now_ns = admin_clock;
	c.lease_scan_interval_ns = 2000000; /* the reapers read the clock too */
	if (getenv("SAC_SYNC"))
		c.sync_booking = true;
	if (getenv("SAC_EVENTS"))
		c.mode = KVR_MODE_EVENTS;
	if (getenv("SAC_LANE")) {
		c.lane_capacity = (uint32_t)atoi(getenv("SAC_LANE"));
		c.lane_soft_depth = 0;
	}
	if (kvr_router_create(&c, &r)) {
		fprintf(stderr, "FAIL: kvr_router_create: %s\n", kvr_last_error());
		return 1;
	}
	for (uint64_t w = 0; w < BASE; w++)
		if (kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 256, 0)) {
			fprintf(stderr, "FAIL: kvr_rank_add: %s\n", kvr_last_error());
			return 1;
		}
	atomic_store(&armed, 1);
	pthread_t a, f[FRONTENDS];
	pthread_create(&a, NULL, admin, NULL);
	for (uintptr_t i = 0; i < FRONTENDS; i++)
		pthread_create(&f[i], NULL, frontend, (void *)i);
	sleep_us(ms * 1000);
	atomic_store(&stop, 1);
	pthread_join(a, NULL);
	for (int i = 0; i < FRONTENDS; i++)
		pthread_join(f[i], NULL);
	atomic_store(&armed, 0);
	if (kvr_router_sync(r, 10000))
		fail("kvr_router_sync", -1);
	struct kvr_rank_id ids[BASE + EXTRA + ADMIN_RANKS];
	size_t n = 0;
	for (uint64_t w = 0; w < BASE; w++)
		ids[n++] = (struct kvr_rank_id){w, 0};
	for (uint64_t w = 0; w < EXTRA; w++)
		ids[n++] = (struct kvr_rank_id){100 + w, 0};
	for (uint64_t w = 0; w < ADMIN_RANKS; w++)
		ids[n++] = (struct kvr_rank_id){200 + w, 0};
	for (size_t i = 0; i < n; i++) {
		struct kvr_rank_stats st;
		int rc = kvr_rank_get_stats(r, ids[i], &st);
		if (rc == KVR_ENOENT)
			continue;
		if (rc)
			fail("kvr_rank_get_stats", rc);
		else if (st.active_requests || st.active_prefill_tokens) {
			fprintf(stderr, "FAIL: rank %llu: %u live attempts, %llu prefill tokens\n",
			        (unsigned long long)ids[i].worker_id, (unsigned)st.active_requests,
			        (unsigned long long)st.active_prefill_tokens);
			atomic_store(&failed, 1);
		}
	}
	kvr_router_destroy(r);
	printf("stress_admin_clock: %ld routes (%ld refused), %ld admin-thread calls, %ld clock "
	       "calls (%ld done, %ld KVR_EBUSY)\n",
	       atomic_load(&routes), atomic_load(&busy_routes), atomic_load(&admin_calls),
	       atomic_load(&clock_calls), atomic_load(&clock_ok), atomic_load(&clock_busy));
	if (!atomic_load(&failed) && atomic_load(&clock_calls) == 0) {
		fprintf(stderr, "FAIL: the clock made no admin call\n");
		return 1;
	}
	return atomic_load(&failed) ? 1 : 0;
}
