/*
 * stress_lease - finish, abort and expiry race to claim leases from several threads; every
 * attempt must be cleaned up exactly once, and stale handles (slots recycled for new attempts)
 * must never win.  Plain program for TSan: exit 0 pass, 1 fail.  argv[1] = duration in ms
 * (default 1500).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/lease.h"

#define K        512 /* leases per round */
#define CLAIMERS 3

struct handle {
	uint64_t attempt;
	uint32_t slot;
};

static struct kvr_lease_table *table;
static struct handle cur[K], old[K];
static int wins[K];
static int stale_wins;
static pthread_barrier_t start_b, done_b;
static int stop;

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void *claimer(void *arg)
{
	unsigned id = (unsigned)(uintptr_t)arg;
	for (;;) {
		pthread_barrier_wait(&start_b);
		if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE))
			return NULL;
		/* Each claimer walks the round in its own order; some only touch. */
		for (unsigned j = 0; j < K; j++) {
			unsigned i = (j * (2 * id + 1) + id * 97) % K;
			if ((i + id) % 5 == 0)
				kvr_lease_touch(table, cur[i].slot, cur[i].attempt);
			if (kvr_lease_claim(table, cur[i].slot, cur[i].attempt) == 0)
				__atomic_add_fetch(&wins[i], 1, __ATOMIC_RELAXED);
			/* A late finish of the previous round's attempt on a recycled slot. */
			if (old[i].attempt &&
			    kvr_lease_claim(table, old[i].slot, old[i].attempt) == 0)
				__atomic_add_fetch(&stale_wins, 1, __ATOMIC_RELAXED);
		}
		pthread_barrier_wait(&done_b);
	}
}

int main(int argc, char **argv)
{
	uint64_t dur = argc > 1 ? strtoull(argv[1], NULL, 10) : 1500;
	struct kvr_attempt_ids ids;
	kvr_attempt_ids_init(&ids);
	if (kvr_lease_table_create(1, 0, &table))
		return 1;
	pthread_barrier_init(&start_b, NULL, CLAIMERS + 1);
	pthread_barrier_init(&done_b, NULL, CLAIMERS + 1);
	pthread_t th[CLAIMERS];
	for (uintptr_t i = 0; i < CLAIMERS; i++)
		pthread_create(&th[i], NULL, claimer, (void *)i);
	uint64_t end = now_ms() + dur, rounds = 0, expired = 0;
	int fail = 0;
	struct kvr_lease_expired exp[K];
	while (!fail) {
		for (int i = 0; i < K; i++) {
			cur[i].attempt = kvr_attempt_id_next(&ids);
			wins[i] = 0;
			if (kvr_lease_begin(table, cur[i].attempt, &cur[i].slot)) {
				fprintf(stderr, "begin failed\n");
				fail = 1;
			}
		}
		if (now_ms() >= end || fail)
			__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
		pthread_barrier_wait(&start_b);
		if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE))
			break;
		/* The owner's reaper races the claimers (expiry). */
		for (int pass = 0; pass < 3; pass++) {
			size_t n = 0;
			kvr_lease_scan(table, exp, K, &n);
			for (size_t e = 0; e < n; e++) {
				for (int i = 0; i < K; i++)
					if (cur[i].attempt == exp[e].attempt) {
						__atomic_add_fetch(&wins[i], 1, __ATOMIC_RELAXED);
						break;
					}
			}
			expired += n;
		}
		pthread_barrier_wait(&done_b);
		for (int i = 0; i < K; i++) {
			if (wins[i] != 1) {
				fprintf(stderr, "attempt %llu claimed %d times\n",
				        (unsigned long long)cur[i].attempt, wins[i]);
				fail = 1;
			}
			if (kvr_lease_end(table, cur[i].attempt) != 0) {
				fprintf(stderr, "end failed\n");
				fail = 1;
			}
			old[i] = cur[i];
		}
		rounds++;
	}
	for (int i = 0; i < CLAIMERS; i++)
		pthread_join(th[i], NULL);
	if (stale_wins) {
		fprintf(stderr, "stale handles won %d claims\n", stale_wins);
		fail = 1;
	}
	printf("stress_lease: %llu rounds of %d leases, %llu expired by the reaper, %s\n",
	       (unsigned long long)rounds, K, (unsigned long long)expired, fail ? "FAIL" : "ok");
	kvr_lease_table_destroy(table);
	return fail;
}
