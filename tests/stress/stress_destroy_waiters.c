/*
 * stress_destroy_waiters - kvr_router_destroy while threads wait in kvr_route_wait (kvrouter.h:
 * "Threads blocked in kvr_route_wait are woken with KVR_ESHUTDOWN before anything is freed").
 * A waiter pumps the queue every millisecond, and a pump admits on the shards: it must be over
 * before the shards stop (a pump after that read a stopped shard's freed state, seen when the
 * destroy was reordered to join the shards before it freed the queue).  Each round: one rank
 * saturated by a first request, four more queued behind it, a waiter on each, then the destroy;
 * every waiter returns KVR_ESHUTDOWN.  Rounds alternate sync_booking.  Run under TSan in CI.
 *
 * usage: stress_destroy_waiters [rounds (40)]   exit 0 pass, 1 fail
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/router_internal.h"
#include "kvrouter.h"

#define WAITERS 4

static struct kvr_router *router;
static uint64_t tickets[WAITERS];
static int rcs[WAITERS];

static void *waiter(void *p)
{
	long i = (long)p;
	struct kvr_decision d;
	rcs[i] = kvr_route_wait(router, tickets[i], 0, &d);
	return NULL;
}

static int route(uint32_t salt, struct kvr_decision *d)
{
	uint32_t tok[64];
	for (uint32_t i = 0; i < 64; i++)
		tok[i] = salt * 64 + i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	return kvr_route(router, &q, d);
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 40;
	for (int round = 0; round < rounds; round++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 2;
		c.queue_threshold = 1.0;
		c.sync_booking = round & 1;
		if (kvr_router_create(&c, &router) ||
		    kvr_rank_add(router, (struct kvr_rank_id){1, 0}, 1, 1000, 16)) {
			fprintf(stderr, "round %d: setup: %s\n", round, kvr_last_error());
			return 1;
		}
		struct kvr_decision d;
		if (route(1000 + round, &d) || d.status != KVR_DECIDED) { /* saturates the rank */
			fprintf(stderr, "round %d: first route: %s\n", round, kvr_last_error());
			return 1;
		}
		for (int i = 0; i < WAITERS; i++) {
			if (route((uint32_t)(round * WAITERS + i), &d) || d.status != KVR_QUEUED) {
				fprintf(stderr, "round %d: request %d not queued (%d)\n", round, i,
				        d.status);
				return 1;
			}
			tickets[i] = d.ticket;
		}
		pthread_t t[WAITERS];
		for (long i = 0; i < WAITERS; i++)
			pthread_create(&t[i], NULL, waiter, (void *)i);
		/* Every waiter inside the wait first: one that enters after the destroy calls on
		 * a freed router (a use-after-free of the test's own making, which ASan saw on a
		 * loaded machine when this was a 3 ms sleep). */
		while (kvr_queue_waiters(router) < WAITERS)
			sched_yield();
		struct timespec ts = {0, 3000000}; /* the waiters pump meanwhile */
		nanosleep(&ts, NULL);
		kvr_router_destroy(router);
		for (int i = 0; i < WAITERS; i++) {
			pthread_join(t[i], NULL);
			if (rcs[i] != KVR_ESHUTDOWN) {
				fprintf(stderr,
				        "round %d: waiter %d returned %d, not KVR_ESHUTDOWN\n",
				        round, i, rcs[i]);
				return 1;
			}
		}
	}
	printf("stress_destroy_waiters: %d rounds, %d waiters each woken with KVR_ESHUTDOWN: ok\n",
	       rounds, WAITERS);
	return 0;
}
