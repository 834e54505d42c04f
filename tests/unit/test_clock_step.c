/*
 * tests/unit/test_clock_step.c - the library's timed waits do not stretch when the wall clock
 * is stepped back.
 *
 * The program defines clock_gettime (tests/common/realtime_shift.h), so the library's calls
 * (linked in statically) come there: with the shift set, CLOCK_REALTIME reads that much ahead
 * of the kernel's, which is what a thread sees when the wall clock is stepped back by that much
 * just after it read it (NTP stepping an offset, `date -s`, a VM resumed from a snapshot).  A
 * condition variable timed on CLOCK_REALTIME then waits that much longer than asked; one on
 * CLOCK_MONOTONIC does not. Before sync/cond.h, a kvr_route_wait with a 50 ms deadline waited the
 * whole step (10 s here) and a replica sent no heartbeat for as long, so its peers gave it up. A
 * plain program: exit 0 pass, 1 fail.
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"
#include "tests/common/check.h"
#include "sync/replica.h"

#include "tests/common/realtime_shift.h"

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#define STEP_NS (10ull * 1000000000ull) /* a step of 10 s: before, each wait below took it all */

/* kvr_route_wait re-reads its deadline about every millisecond: it returns KVR_ETIMEDOUT soon
 * after a 50 ms deadline, whatever the wall clock does. */
static void queue_wait(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	struct kvr_router *r;
	CHECK(kvr_router_create(&c, &r) == 0, "create");
	CHECK(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 100000, 16) == 0, "rank_add");
	static uint32_t tok[2048];
	for (unsigned i = 0; i < 2048; i++)
		tok[i] = i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 2048;
	struct kvr_decision d1, d2;
	CHECK(kvr_route(r, &q, &d1) == 0 && d1.status == KVR_DECIDED, "first route");
	tok[0] = 99999; /* another prompt: the rank is saturated now, it queues */
	CHECK(kvr_route(r, &q, &d2) == 0 && d2.status == KVR_QUEUED, "second route queues");
	atomic_store(&kvr_test_realtime_shift_ns, (int64_t)STEP_NS);
	uint64_t t0 = mono_ns();
	int rc = kvr_route_wait(r, d2.ticket, t0 + 50000000ull, &d2);
	uint64_t took = mono_ns() - t0;
	atomic_store(&kvr_test_realtime_shift_ns, 0);
	CHECK(rc == KVR_ETIMEDOUT, "kvr_route_wait: %s", kvr_strerror(rc));
	CHECK(took < 5000000000ull, "a 50 ms deadline took %.3f s", took / 1e9);
	printf("queue_wait: a 50 ms deadline returned after %.1f ms\n", took / 1e6);
	CHECK(kvr_route_cancel(r, d2.ticket) == 0, "cancel");
	CHECK(kvr_request_finish(r, d1.attempt) == 0, "finish");
	kvr_router_destroy(r);
}

/* One replica on a transport that counts what it publishes: with no traffic, that is its
 * heartbeats, one per 20 ms period. */
static _Atomic unsigned published;

static int count_publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx, (void)buf, (void)len;
	atomic_fetch_add(&published, 1);
	return 0;
}

static int no_reply(void *ctx, const char *to, const void *buf, size_t len)
{
	(void)ctx, (void)to, (void)buf, (void)len;
	return 0;
}

static int no_peer(void *ctx, const void *req, size_t len, uint64_t timeout_ns, uint64_t hedge_ns,
                   int (*on_chunk)(void *cb, const void *buf, size_t len), bool (*poll)(void *cb),
                   void *cb)
{
	(void)ctx, (void)req, (void)len, (void)timeout_ns, (void)hedge_ns, (void)on_chunk,
	    (void)poll, (void)cb;
	return KVR_ENOENT; /* nobody else: this replica starts the cluster's knowledge */
}

static void replica_heartbeats(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r;
	CHECK(kvr_router_create(&c, &r) == 0, "create");
	struct kvr_replica_config rc = {
	    .replica_id = 1, .heartbeat_ms = 20, .dead_after = 5, .snapshot_timeout_ms = 1000};
	struct kvr_replica_transport t = {
	    .publish = count_publish, .reply = no_reply, .request = no_peer};
	struct kvr_replica *rep;
	CHECK(kvr_replica_create(r, &rc, &t, &rep) == 0, "replica_create");
	CHECK(kvr_replica_start(rep) == 0, "replica_start");
	CHECK(kvr_replica_wait_ready(rep, 10000) == 0, "ready");
	usleep(60000); /* settle: the thread's current wait was timed before the step */
	atomic_store(&kvr_test_realtime_shift_ns, (int64_t)STEP_NS);
	usleep(60000);
	unsigned before = atomic_load(&published);
	usleep(400000);
	unsigned sent = atomic_load(&published) - before;
	atomic_store(&kvr_test_realtime_shift_ns, 0);
	/* 20 periods; a loaded machine may lose some, but not most. */
	CHECK(sent >= 8, "%u heartbeats in 400 ms of 20 ms periods", sent);
	printf("replica_heartbeats: %u messages in 400 ms (20 ms heartbeats)\n", sent);
	kvr_replica_destroy(rep);
	kvr_router_destroy(r);
}

int main(void)
{
	check_deadline(60);
	queue_wait();
	replica_heartbeats();
	if (failures)
		fprintf(stderr, "test_clock_step: %d failures\n", failures);
	else
		printf("test_clock_step: ok\n");
	return failures != 0;
}
