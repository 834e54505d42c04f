/*
 * stress_park: the parker's wake-ups under the race they must close, in two phases.
 *  1. asymmetric (sync/park.h kvr_parker_prepare_asym / wake_asym): P producers each push one
 *     message into a kvr_ring (reserve, commit, wake without a fence), then wait until the
 *     consumer has taken it; the consumer parks as soon as the ring is empty, with no timeout.
 *  2. lazy (kvr_parker_prepare_bounded / wake_lazy, as the shards run lifecycle posts): the
 *     producers wake lazily; the consumer's first park after taking messages is BOUNDED (a
 *     50 us timed wait, which lazy producers leave asleep), the next ones PARKED with no
 *     timeout, which a lazy producer must wake.
 * So nearly every message arrives while the consumer is parking, and a lost wake-up leaves a
 * producer waiting: the test fails if any waits 2 s.  Also checks every message is delivered
 * once and each producer's in order, and that phase 2 both deferred wakes and woke.
 * argv[1] = duration in ms (default 1500, split between the phases).  Exit 0 pass, 1 fail.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sync/park.h"
#include "sync/ring.h"
#include "tests/common/mono_clock.h"

#define P 3

static struct kvr_ring ring;
static struct kvr_parker park;
static uint64_t taken[P];  /* atomic: messages of producer p the consumer took */
static uint64_t expect[P]; /* consumer only: the next sequence number of producer p */
static int stop, failed;   /* atomic */
static uint64_t deadline_ns;
static int lazy; /* phase 2: written between the phases only */

#define BOUND_NS 50000ull /* the consumer's bounded park in phase 2 */

static void *producer(void *arg)
{
	uint32_t p = (uint32_t)(uintptr_t)arg, rnd = p * 2654435761u + 1;
	uint64_t seq = 0;
	while (mono_ns() < deadline_ns && !__atomic_load_n(&failed, __ATOMIC_RELAXED)) {
		uint32_t ticket;
		struct kvr_msg *slot = kvr_ring_reserve(&ring, &ticket);
		if (!slot) {
			sched_yield();
			continue;
		}
		uint64_t payload[2] = {p, seq};
		KVR_RING_IGNORE_BEGIN();
		slot->fn = NULL;
		slot->len = sizeof(payload);
		slot->aux = 0;
		memcpy(slot->payload, payload, sizeof(payload));
		KVR_RING_IGNORE_END();
		kvr_ring_commit_nowait(&ring, ticket, 0);
		if (lazy)
			kvr_parker_wake_lazy(&park);
		else
			kvr_parker_wake_asym(&park);
		seq++;
		uint64_t t0 = mono_ns();
		while (__atomic_load_n(&taken[p], __ATOMIC_ACQUIRE) < seq) {
			if (mono_ns() - t0 > 2000000000ull) {
				fprintf(stderr,
				        "stress_park: producer %u waited 2 s for message %lu: "
				        "lost wake-up\n",
				        p, (unsigned long)seq - 1);
				__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
				kvr_parker_wake(&park);
				return NULL;
			}
			sched_yield();
		}
		rnd = rnd * 1103515245u + 12345u;
		if ((rnd >> 16) % 4 == 0) { /* sometimes a pause: the consumer parks for good */
			/* (phase 2: up to 400 us, so all producers pause past BOUND_NS at times and
			 * the consumer goes on to an unbounded park) */
			struct timespec ts = {0, (long)((rnd >> 8) % (lazy ? 400000 : 20000))};
			nanosleep(&ts, NULL);
		}
	}
	return NULL;
}

static void *consumer(void *arg)
{
	(void)arg;
	struct kvr_msg m;
	int bounded = 0; /* phase 2: the next park is bounded (messages came since the last) */
	for (;;) {
		while (kvr_ring_dequeue(&ring, &m)) {
			bounded = lazy;
			uint64_t payload[2];
			memcpy(payload, m.payload, sizeof(payload));
			uint64_t p = payload[0];
			if (p >= P || payload[1] != expect[p]) {
				fprintf(stderr,
				        "stress_park: producer %lu: got %lu, expected %lu\n",
				        (unsigned long)p, (unsigned long)payload[1],
				        (unsigned long)(p < P ? expect[p] : 0));
				__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
				return NULL;
			}
			expect[p]++;
			__atomic_store_n(&taken[p], expect[p], __ATOMIC_RELEASE);
		}
		if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE) ||
		    __atomic_load_n(&failed, __ATOMIC_RELAXED))
			return NULL;
		if (bounded)
			kvr_parker_prepare_bounded(&park);
		else if (lazy)
			kvr_parker_prepare(&park);
		else
			kvr_parker_prepare_asym(&park);
		if (kvr_ring_depth(&ring) || __atomic_load_n(&stop, __ATOMIC_ACQUIRE) ||
		    __atomic_load_n(&failed, __ATOMIC_RELAXED)) {
			kvr_parker_cancel(&park);
			continue;
		}
		kvr_parker_wait(&park, bounded ? BOUND_NS : UINT64_MAX);
		bounded = 0;
	}
}

/* One phase: the consumer and P producers until deadline; returns the messages taken. */
static uint64_t phase(uint64_t ms)
{
	memset(taken, 0, sizeof(taken));
	memset(expect, 0, sizeof(expect));
	__atomic_store_n(&stop, 0, __ATOMIC_RELAXED);
	deadline_ns = mono_ns() + ms * 1000000ull;
	pthread_t c, pr[P];
	pthread_create(&c, NULL, consumer, NULL);
	for (uintptr_t p = 0; p < P; p++)
		pthread_create(&pr[p], NULL, producer, (void *)p);
	for (int p = 0; p < P; p++)
		pthread_join(pr[p], NULL);
	__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	kvr_parker_wake(&park);
	pthread_join(c, NULL);
	uint64_t total = 0;
	for (int p = 0; p < P; p++)
		total += taken[p];
	return total;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 0) : 1500;
	if (kvr_ring_init(&ring, 64))
		return 1;
	kvr_parker_init(&park);
	kvr_parker_asym_init();
	uint64_t total = phase(ms / 2);
	printf("stress_park asym: %lu messages, %lu futex sleeps, %lu wakes\n",
	       (unsigned long)total, (unsigned long)park.parks, (unsigned long)park.wakes);
	if (!failed) {
		kvr_parker_init(&park);
		lazy = 1;
		total = phase(ms - ms / 2);
		printf(
		    "stress_park lazy: %lu messages, %lu futex sleeps, %lu wakes, %lu deferred\n",
		    (unsigned long)total, (unsigned long)park.parks, (unsigned long)park.wakes,
		    (unsigned long)park.deferred);
		if (!failed && (!park.deferred || !park.wakes)) {
			/* Each producer pauses up to 20 us a quarter of the time: both kinds of
			 * park happen in any run longer than a few milliseconds. */
			fprintf(stderr, "stress_park: lazy phase never deferred or never woke\n");
			failed = 1;
		}
	}
	kvr_ring_fini(&ring);
	return failed ? 1 : 0;
}
