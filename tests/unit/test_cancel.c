/*
 * tests/unit/test_cancel.c - threads cancelled (pthread_cancel, deferred) while they call the
 * library.
 *
 * A thread that routes (queueing, with KVR_ROUTE_WAIT), finishes, cancels tickets, adds and
 * removes ranks and waits in kvr_router_sync is cancelled at a random moment, 300 times.  The
 * library's calls are not cancellation points: a cancel takes effect once the call returns.
 * Before, it took effect at the first cancellation point inside (a condition wait holding the
 * queue's lock, a sleep holding the rank administration lock or inside an RCU read section,
 * a grace-period wait holding liburcu's own lock), the thread ended with them held, and the
 * next call that needed them waited for good.
 * After every cancel the test ends what the thread left live (its attempts, its tickets); at
 * the end every rank's load is zero.  A plain program: exit 0 pass, 1 fail (or 60 s: a hang).
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"
#include "tests/common/check.h"

static struct kvr_router *r;

/* What the worker has live: written before the call that could leave it live returns to the
 * worker's code, so a cancel anywhere after leaves it here for main to end. */
#define LIVE 4
static _Atomic uint64_t live_attempt[LIVE], live_ticket;

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Not instrumented by AddressSanitizer: the cancel unwinds this frame without its epilogue, so
 * its poisoned redzones stayed behind, and the thread-exit destructors that run below
 * (liburcu's) were reported writing into them: a false report of ASan's, whatever the library
 * does. */
__attribute__((no_sanitize_address)) static void *worker(void *arg)
{
	unsigned seed = (unsigned)(uintptr_t)arg;
	static _Thread_local uint32_t tok[2048];
	for (unsigned i = 0; i < 2048; i++)
		tok[i] = i;
	for (unsigned k = 0;; k++) {
		unsigned slot = k % LIVE;
		uint64_t a = atomic_exchange(&live_attempt[slot], 0);
		if (a)
			kvr_request_finish(r, a);
		tok[0] = rand_r(&seed) % 64;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 1024 + rand_r(&seed) % 1024;
		q.flags = KVR_ROUTE_WAIT;
		q.deadline_ns = mono_ns() + 2000000;
		struct kvr_decision d;
		/* A cancel inside kvr_route could leave a decision unrecorded; the call is not a
		 * cancellation point, so the records below always run. */
		int rc = kvr_route(r, &q, &d);
		if (rc == 0 && d.status == KVR_DECIDED)
			atomic_store(&live_attempt[slot], d.attempt);
		else if (rc == KVR_ETIMEDOUT) {
			atomic_store(&live_ticket, d.ticket);
			kvr_route_cancel(r, d.ticket);
			atomic_store(&live_ticket, 0);
		}
		switch (k % 8) {
		case 3:
			kvr_rank_add(r, (struct kvr_rank_id){100 + k % 3, 0}, 1, 4096, 2048);
			break;
		case 5:
			kvr_rank_remove(r, (struct kvr_rank_id){100 + (k + 1) % 3, 0});
			break;
		case 7:
			kvr_router_sync(r, 100);
			break;
		default:
			break;
		}
		pthread_testcancel();
	}
	return NULL;
}

/* A replaced clock that is a cancellation point (it may sleep, log, or read a file): a cancel
 * pending when kvr_route reads it took effect inside the call (the clock read outside any
 * cancellation guard: the queue's push, and since 59efad3 the waited route's deadline check),
 * the thread gone with its ticket settled and nothing recorded.  Now the library reads a
 * replaced clock with cancellation disabled, and the cancel takes effect after the call. */
static _Thread_local bool cancel_in_clock;
static atomic_int routed_and_returned;

static uint64_t cancelling_clock(void *ctx)
{
	(void)ctx;
	if (cancel_in_clock) {
		cancel_in_clock = false;
		pthread_cancel(pthread_self());
		pthread_testcancel(); /* a cancellation point, as a clock's sleep or write is */
	}
	return mono_ns();
}

static struct kvr_router *rc_router;

__attribute__((no_sanitize_address)) static void *clock_worker(void *arg)
{
	(void)arg;
	static _Thread_local uint32_t tok[64];
	for (unsigned i = 0; i < 64; i++)
		tok[i] = 7000 + i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	q.flags = KVR_ROUTE_WAIT;
	q.deadline_ns = 1; /* passed: the wait reads the clock and returns */
	struct kvr_decision d;
	cancel_in_clock = true;
	int rc = kvr_route(rc_router, &q, &d);
	atomic_store(&routed_and_returned, 1);
	if (rc == KVR_ETIMEDOUT)
		kvr_route_cancel(rc_router, d.ticket);
	else if (rc == 0 && d.status == KVR_DECIDED)
		kvr_request_finish(rc_router, d.attempt);
	pthread_testcancel();
	return NULL;
}

static void cancel_inside_the_clock(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.now_ns = cancelling_clock;
	CHECK(kvr_router_create(&c, &rc_router) == 0, "create (replaced clock)");
	CHECK(kvr_rank_add(rc_router, (struct kvr_rank_id){9, 0}, 1, 4096, 16) == 0, "rank_add");
	/* The rank saturated, so the worker's route queues and its wait reads the clock. */
	uint32_t busy[64];
	for (unsigned i = 0; i < 64; i++)
		busy[i] = i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = busy;
	q.n_tokens = 64;
	struct kvr_decision d;
	CHECK(kvr_route(rc_router, &q, &d) == 0 && d.status == KVR_DECIDED, "the first route");
	pthread_t t;
	CHECK(pthread_create(&t, NULL, clock_worker, NULL) == 0, "thread");
	pthread_join(t, NULL);
	CHECK(atomic_load(&routed_and_returned),
	      "the thread was cancelled inside kvr_route, in the router's clock");
	CHECK(kvr_request_finish(rc_router, d.attempt) == 0, "finish");
	CHECK(kvr_router_sync(rc_router, 10000) == 0, "sync after the cancel");
	kvr_router_destroy(rc_router);
}

int main(void)
{
	check_deadline(60);
	cancel_inside_the_clock();
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	CHECK(kvr_router_create(&c, &r) == 0, "create");
	for (uint64_t w = 0; w < 2; w++)
		CHECK(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 4096, 2048) == 0, "rank_add");
	unsigned seed = 7;
	for (int i = 0; i < 300; i++) {
		pthread_t t;
		CHECK(pthread_create(&t, NULL, worker, (void *)(uintptr_t)(i + 1)) == 0, "thread");
		usleep(200 + rand_r(&seed) % 3000);
		pthread_cancel(t);
		pthread_join(t, NULL);
		for (int s = 0; s < LIVE; s++) {
			uint64_t a = atomic_exchange(&live_attempt[s], 0);
			if (a)
				kvr_request_finish(r, a);
		}
		uint64_t tk = atomic_exchange(&live_ticket, 0);
		if (tk)
			kvr_route_cancel(r, tk);
	}
	for (uint64_t w = 100; w < 103; w++)
		kvr_rank_remove(r, (struct kvr_rank_id){w, 0});
	CHECK(kvr_router_sync(r, 10000) == 0, "sync");
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats st;
		CHECK(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &st) == 0, "stats");
		CHECK(st.active_requests == 0 && st.active_prefill_tokens == 0 &&
		          st.active_blocks == 0,
		      "rank %lu: %lu requests, %lu tokens, %lu blocks still active",
		      (unsigned long)w, (unsigned long)st.active_requests,
		      (unsigned long)st.active_prefill_tokens, (unsigned long)st.active_blocks);
	}
	kvr_router_destroy(r);
	if (failures)
		fprintf(stderr, "test_cancel: %d failures\n", failures);
	else
		printf("test_cancel: ok (300 threads cancelled)\n");
	return failures != 0;
}
