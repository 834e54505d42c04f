/*
 * stress_replica_start_fail - kvr_replica_start failing (the sender's or the apply thread's
 * start refused, by wrapping kvr_thread_start) and retried while a thread routes and finishes
 * on the router, many rounds.  Under TSan: no data race between a failed start (hooks unset,
 * sender stopped, notes dropped), the routing thread's notes and the retried start's sender
 * (out_stop / out_go reset).  After each retried start the drain returns and nothing is kept.
 *
 * usage: stress_replica_start_fail [rounds]   exit 0 pass, 1 fail
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h"

int __real_kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg);
int __wrap_kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg);

static struct kvr_router *r;
static atomic_int stop;
static pthread_t main_th;
static int fail_nth, calls;

int __wrap_kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg)
{
	if (fail_nth && pthread_equal(pthread_self(), main_th) && ++calls == fail_nth)
		return KVR_ENOMEM;
	return __real_kvr_thread_start(t, detached, fn, arg);
}

static void *route_main(void *arg)
{
	uint32_t seed = (uint32_t)(uintptr_t)arg, t[64];
	while (!atomic_load(&stop)) {
		for (int j = 0; j < 64; j++)
			t[j] = seed * 1000003u + (uint32_t)j;
		seed++;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 64;
		q.expected_output_tokens = 64;
		struct kvr_decision d;
		if (kvr_route(r, &q, &d) == 0 && d.status == KVR_DECIDED)
			(void)kvr_request_finish(r, d.attempt);
	}
	return NULL;
}

static int publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx;
	(void)buf;
	(void)len;
	return 0;
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 20; /* ~1 min under TSan */
	main_th = pthread_self();
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	if (kvr_router_create(&c, &r))
		return 1;
	for (uint64_t w = 0; w < 2; w++)
		if (kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 7, 1000, 4096))
			return 1;
	pthread_t rt;
	if (pthread_create(&rt, NULL, route_main, (void *)(uintptr_t)1))
		return 1;
	int port = 0;
	for (int round = 0; round < rounds; round++) {
		struct kvr_replica_config rc = {
		    .replica_id = 1,
		    .heartbeat_ms = 50,
		    .dead_after = 1000,
		    .snapshot_timeout_ms = 1000,
		};
		struct kvr_replica_transport t = {.ctx = &port, .publish = publish};
		struct kvr_replica *rep;
		if (kvr_replica_create(r, &rc, &t, &rep))
			return 1;
		for (int k = 0; k < 3; k++) {
			calls = 0;
			fail_nth = (round + k) % 2 + 1; /* 1: the sender, 2: the apply thread */
			int rc_ = kvr_replica_start(rep);
			fail_nth = 0;
			if (rc_ != KVR_ENOMEM) {
				fprintf(stderr, "round %d: failed start rc %d\n", round, rc_);
				return 1;
			}
		}
		if (kvr_replica_start(rep) || kvr_replica_wait_ready(rep, 10000)) {
			fprintf(stderr, "round %d: retried start\n", round);
			return 1;
		}
		if (kvr_replica_drain(rep, 10000)) {
			fprintf(stderr, "round %d: drain timed out\n", round);
			return 1;
		}
		kvr_replica_stop(rep);
		kvr_replica_destroy(rep);
	}
	atomic_store(&stop, 1);
	pthread_join(rt, NULL);
	kvr_router_destroy(r);
	printf("stress_replica_start_fail: %d rounds\n", rounds);
	return 0;
}
