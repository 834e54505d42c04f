/*
 * tests/stress/stress_queue.c - the admission queue's saturation check against a concurrent
 * budget store, for ThreadSanitizer (issue 12 defect 7).
 *
 * kvr_queue_saturated() reads each candidate rank's max_batched_tokens on a routing thread while
 * the rank's shard stores it when the slot is (re-)created.  The read was plain and the store
 * atomic: a data race TSan reported under rank churn.  Here one thread runs the check in a loop
 * while another stores the budget the way kvr_owner_rank_create does, with no other
 * synchronisation between them, so TSan sees every unordered pair: before the fix it reports the
 * race on every run, after it nothing.  The check's answer is also verified against the stored
 * budget bounds.  Exit 0 pass, 1 fail.  argv[1]: duration in ms (default 300).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/router_internal.h"
#include "kvrouter.h"

static struct kvr_router *R;
static uint32_t slot;
static atomic_int stop, failed;

static void *checker(void *arg)
{
	(void)arg;
	uint64_t n = 0;
	while (!atomic_load(&stop)) {
		/* no prefill load: never saturated, whatever the budget */
		if (kvr_queue_saturated(R, &slot, 1)) {
			fprintf(stderr, "stress_queue: an idle rank reported saturated\n");
			atomic_store(&failed, 1);
		}
		n++;
	}
	return (void *)(uintptr_t)n;
}

static void *storer(void *arg)
{
	(void)arg;
	uint32_t v = 1;
	while (!atomic_load(&stop)) {
		/* as kvr_owner_rank_create does on a re-add */
		__atomic_store_n(&R->ranks[slot].max_batched_tokens, v, __ATOMIC_RELAXED);
		v = v % 4096 + 1;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 300;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	if (kvr_router_create(&c, &R) != 0 ||
	    kvr_rank_add(R, (struct kvr_rank_id){7, 0}, 1, 100, 64) != 0 ||
	    kvr_router_find_rank(R, (struct kvr_rank_id){7, 0}, &slot) != 0) {
		fprintf(stderr, "stress_queue: setup failed\n");
		return 1;
	}
	pthread_t a, b;
	pthread_create(&a, NULL, checker, NULL);
	pthread_create(&b, NULL, storer, NULL);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
	atomic_store(&stop, 1);
	void *n;
	pthread_join(a, &n);
	pthread_join(b, NULL);
	kvr_router_destroy(R);
	printf("stress_queue: %lu saturation checks against concurrent budget stores: %s\n",
	       (unsigned long)(uintptr_t)n, atomic_load(&failed) ? "FAIL" : "ok");
	return atomic_load(&failed) ? 1 : 0;
}
