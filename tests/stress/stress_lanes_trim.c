/*
 * stress_lanes_trim: the routing lane's idle trim (sync/lane.h, kvr_lanes_trim) racing producers.
 * P producer threads post sequence-numbered messages (a pattern derived from the number in
 * every payload byte) to one struct kvr_lanes with a small ring, in bursts with pauses so the
 * lane often runs empty; the consumer pops them and, each time it finds the lanes empty, trims
 * (madvise(MADV_DONTNEED) of the whole ring).  A producer's write that raced a discard of its
 * page would arrive as zeros or not at all.  Checks: every message arrives exactly once, in
 * order per producer, with its payload whole; trims happened while producers were posting.
 * argv[1] = duration in ms (default 1500).  Exit 0 pass, 1 fail.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sync/lane.h"

#define P   3
#define CAP 255 /* 256 slots, 4 pages: the indices come round to a discarded page often */

static struct kvr_lanes lanes;
static int stop;
static uint32_t sent[P];
static uint32_t finished; /* producers that returned */

static void nop(void)
{
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static unsigned char pattern(uint32_t producer, uint32_t seq)
{
	return (unsigned char)(seq * 13u + producer * 101u + 1u);
}

static void *producer(void *arg)
{
	uint32_t id = (uint32_t)(uintptr_t)arg, seq = 0;
	unsigned char p[KVR_MSG_PAYLOAD];
	unsigned rnd = id * 2654435761u + 1;
	while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
		rnd = rnd * 1103515245u + 12345u;
		uint32_t burst = 1 + (rnd >> 16) % 96;
		for (uint32_t i = 0; i < burst; i++, seq++) {
			memset(p, pattern(id, seq), sizeof(p));
			memcpy(p, &seq, sizeof(seq));
			while (kvr_lanes_push(&lanes, KVR_LANE_ROUTING, nop, p, sizeof(p), id, 0))
				sched_yield();
		}
		__atomic_store_n(&sent[id], seq, __ATOMIC_RELEASE);
		/* A pause now and then, so the consumer empties the lane and trims. */
		if ((rnd >> 8) % 4 == 0) {
			struct timespec ts = {0, (long)((rnd >> 4) % 50000)};
			nanosleep(&ts, NULL);
		} else {
			sched_yield();
		}
	}
	__atomic_fetch_add(&finished, 1, __ATOMIC_RELEASE);
	return NULL;
}

int main(int argc, char **argv)
{
	double ms = argc > 1 ? atof(argv[1]) : 1500;
	if (kvr_lanes_init(&lanes, CAP, 64, 200000, NULL, NULL)) {
		fprintf(stderr, "init failed\n");
		return 1;
	}
	pthread_t th[P];
	for (uint32_t i = 0; i < P; i++)
		if (pthread_create(&th[i], NULL, producer, (void *)(uintptr_t)i)) {
			fprintf(stderr, "pthread_create failed\n");
			return 1;
		}
	uint32_t next[P] = {0};
	uint64_t errors = 0, trims = 0, trims_busy = 0, received = 0;
	/* The race needs the consumer to find the lane empty while producers still post; under
	 * TSan on a loaded 2-core machine that took 1.5 s to happen once (CI: 1 trim, none while
	 * producers ran), so the run goes on past its duration until 3 trims raced producers, up
	 * to 8x the duration (at least 12 s). */
	uint64_t t_start = now_ns(), end = t_start + (uint64_t)(ms * 1e6);
	uint64_t hard_end = t_start + (uint64_t)(ms * 8e6 > 12e9 ? ms * 8e6 : 12e9);
	int stopped = 0;
	struct kvr_msg m;
	for (;;) {
		if (kvr_lanes_pop(&lanes, &m) < 0) {
			if (kvr_lanes_trim(&lanes)) {
				trims++;
				trims_busy += !stopped;
			}
			if (stopped) {
				/* Every producer has returned: the lane is empty once all its
				 * messages are counted.  The consumer keeps draining until then:
				 * joining at once could wait on a producer whose burst found the
				 * lane full (3 bursts of up to 96 > 255 slots: CI's ASan run hung).
				 */
				uint32_t all = __atomic_load_n(&finished, __ATOMIC_ACQUIRE) == P;
				for (uint32_t i = 0; i < P; i++)
					all &=
					    next[i] == __atomic_load_n(&sent[i], __ATOMIC_ACQUIRE);
				if (all)
					break;
			} else if (now_ns() >= end && (trims_busy >= 3 || now_ns() >= hard_end)) {
				__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
				stopped = 1;
			}
			continue;
		}
		received++;
		uint32_t id = m.aux, seq;
		memcpy(&seq, m.payload, sizeof(seq));
		int bad = id >= P || m.fn != nop || m.len != KVR_MSG_PAYLOAD;
		if (!bad && seq != next[id])
			bad = 1;
		for (size_t b = sizeof(seq); !bad && b < sizeof(m.payload); b++)
			bad = m.payload[b] != pattern(id, seq);
		if (bad) {
			if (errors++ < 5)
				fprintf(
				    stderr,
				    "bad message: producer %u seq %u (expected %u) len %u fn %s\n",
				    id, seq, id < P ? next[id] : 0, m.len,
				    m.fn == nop ? "ok" : "wrong");
			if (id < P)
				next[id] = seq + 1;
			continue;
		}
		next[id]++;
	}
	for (uint32_t i = 0; i < P; i++)
		pthread_join(th[i], NULL);
	uint64_t total = 0;
	for (uint32_t i = 0; i < P; i++)
		total += sent[i];
	printf("stress_lanes_trim: %llu messages from %d producers, %llu trims (%llu while "
	       "producers ran), %llu bytes given back, %llu bad\n",
	       (unsigned long long)received, P, (unsigned long long)trims,
	       (unsigned long long)trims_busy, (unsigned long long)lanes.trimmed_bytes,
	       (unsigned long long)errors);
	kvr_lanes_fini(&lanes);
	if (errors || received != total) {
		fprintf(stderr, "FAIL: %llu bad, %llu received of %llu sent\n",
		        (unsigned long long)errors, (unsigned long long)received,
		        (unsigned long long)total);
		return 1;
	}
	if (!trims_busy) {
		fprintf(stderr, "FAIL: no trim while producers ran (the race was not exercised)\n");
		return 1;
	}
	return 0;
}
