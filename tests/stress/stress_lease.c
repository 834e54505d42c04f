/*
 * stress_lease - attempts minted on several threads while finish, abort and the reaper race to
 * claim them from others; every attempt must be claimed exactly once, and a stale id (its word
 * released and minted again for a newer attempt) must never win.  Plain program for TSan:
 * exit 0 pass, 1 fail.  argv[1] = duration in ms (default 1500).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/lease.h"
#include "tests/common/mono_clock.h"

#define K        512 /* attempts per round */
#define MINTERS  2
#define CLAIMERS 2

static struct kvr_leases *table;
static uint64_t cur[K], old[K];
static int wins[K];
static int stale_wins;
static pthread_barrier_t start_b, done_b;
static int stop;

/* Thread roles per round: minters fill cur[] (disjoint halves) before the claim barrier is
 * passed, then everybody claims, touches and ages in its own order. */
static void *worker(void *arg)
{
	unsigned id = (unsigned)(uintptr_t)arg;
	for (;;) {
		pthread_barrier_wait(&start_b);
		if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE))
			return NULL;
		if (id < MINTERS)
			for (unsigned i = id; i < K; i += MINTERS)
				if (kvr_lease_mint(table, i & KVR_LEASE_TAG_MASK, &cur[i]))
					__atomic_store_n(&stop, 2, __ATOMIC_RELEASE);
		pthread_barrier_wait(&done_b);
		for (unsigned j = 0; j < K; j++) {
			unsigned i = (j * (2 * id + 1) + id * 97) % K;
			if ((i + id) % 5 == 0)
				kvr_lease_touch(table, cur[i]);
			if (id == 0 && kvr_lease_age(table, cur[i]) == KVR_LEASE_CLAIMED)
				__atomic_add_fetch(&wins[i], 1, __ATOMIC_RELAXED);
			if (kvr_lease_claim(table, cur[i]) == 0)
				__atomic_add_fetch(&wins[i], 1, __ATOMIC_RELAXED);
			/* A late finish of the previous round's attempt (its word was released). */
			if (old[i] && kvr_lease_claim(table, old[i]) == 0)
				__atomic_add_fetch(&stale_wins, 1, __ATOMIC_RELAXED);
		}
		pthread_barrier_wait(&done_b);
	}
}

int main(int argc, char **argv)
{
	uint64_t dur = argc > 1 ? strtoull(argv[1], NULL, 10) : 1500;
	if (kvr_leases_create(&table))
		return 1;
	enum { N = MINTERS + CLAIMERS };
	pthread_barrier_init(&start_b, NULL, N + 1);
	pthread_barrier_init(&done_b, NULL, N + 1);
	pthread_t th[N];
	for (uintptr_t i = 0; i < N; i++)
		pthread_create(&th[i], NULL, worker, (void *)i);
	uint64_t end = now_ms() + dur, rounds = 0;
	int fail = 0;
	for (;;) {
		for (int i = 0; i < K; i++)
			wins[i] = 0;
		if (now_ms() >= end)
			__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
		pthread_barrier_wait(&start_b);
		if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE))
			break;
		pthread_barrier_wait(&done_b); /* minted */
		pthread_barrier_wait(&done_b); /* claimed */
		if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE) == 2) {
			fprintf(stderr, "stress_lease: mint failed\n");
			fail = 1;
		}
		for (int i = 0; i < K; i++) {
			if (wins[i] != 1) {
				fprintf(stderr, "stress_lease: attempt %d claimed %d times\n", i,
				        wins[i]);
				fail = 1;
			}
			if (kvr_lease_release(table, cur[i])) {
				fprintf(stderr, "stress_lease: release failed\n");
				fail = 1;
			}
			old[i] = cur[i];
		}
		rounds++;
		if (fail)
			__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	}
	for (int i = 0; i < N; i++)
		pthread_join(th[i], NULL);
	if (stale_wins) {
		fprintf(stderr, "stress_lease: %d stale ids won a claim\n", stale_wins);
		fail = 1;
	}
	printf("stress_lease: %lu rounds of %d attempts\n", (unsigned long)rounds, K);
	kvr_leases_destroy(table);
	return fail;
}
