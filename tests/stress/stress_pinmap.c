/*
 * stress_pinmap - routers read every rank's pinned depth (kvr_pinmap_depths) while two shard
 * threads, each owning one rank's load tracker, pin and unpin chains that split and extend the
 * published runs, and the shared table grows, shrinks and purges.  Each writer cycles through
 * known states and brackets every command with a phase counter (odd while it runs), so a reader
 * knows which states a query overlapped: each rank's depth must be one of theirs (a torn run, a
 * split seen as a gap, a rank credited with blocks it never pinned all fail).  Plain program for
 * TSan: exit 0 pass, 1 fail.  argv[1] = duration in ms (default 1500).
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/load.h"
#include "shards/pinmap.h"
#include "sync/rcu.h"
#include "tests/common/mono_clock.h"

#define L      64 /* chain C; D leaves C after 32 blocks; E continues D */
#define BRANCH 32
#define OUT    16
#define NOISE  40 /* other chains per cycle: the table grows and shrinks */

static struct kvr_pinmap *pm;
static uint64_t C[L], D[L], E[OUT], Q2[L + OUT];
static int stop, failed;
static uint64_t phase[3];    /* per writer slot: 2 x commands done, +1 while one runs */
#define CMDS (2 * NOISE + 5) /* commands per cycle */
static unsigned long reads, cycles;

static uint64_t mix(uint64_t x)
{
	x ^= x >> 31;
	x *= 0x9E3779B97F4A7C15ull;
	return x ^ (x >> 29);
}

/* A shard: rank `slot`'s load goes {} -> {A} -> {A,B} -> {B} -> {B+E} -> {} over and over,
 * with NOISE unrelated chains pinned and unpinned around it. */
static void *writer(void *arg)
{
	uint32_t slot = (uint32_t)(uintptr_t)arg;
	struct kvr_load *l;
	if (kvr_rcu_thread_online() || kvr_load_create(0, &l) || kvr_load_publish(l, pm, slot)) {
		__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
		return NULL;
	}
	uint64_t noise[8], id = 100;
	uint64_t *ph = &phase[slot];
/* One command, bracketed: the phase is odd while it runs (seqlock-style). */
#define CMD(call)                                                                                  \
	do {                                                                                       \
		__atomic_fetch_add(ph, 1, __ATOMIC_SEQ_CST);                                       \
		bad |= (call);                                                                     \
		__atomic_fetch_add(ph, 1, __ATOMIC_RELEASE);                                       \
	} while (0)
	while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
		int bad = 0;
		CMD(kvr_load_add(l, 1, C, 1, L, 0, 0));
		for (uint64_t k = 0; k < NOISE; k++) { /* chains nobody queries */
			for (int i = 0; i < 8; i++)
				noise[i] = mix(slot * 1000003ull + id * 131 + (uint64_t)i + 1);
			CMD(kvr_load_add(l, id + k, noise, 1, 8, 0, 0));
		}
		CMD(kvr_load_add(l, 2, D, 1, L, 0, 0));
		for (uint64_t k = 0; k < NOISE; k++)
			CMD(kvr_load_finish(l, id + k));
		id += NOISE;
		CMD(kvr_load_finish(l, 1));
		CMD(kvr_load_add_output(l, 2, E, 1, OUT));
		CMD(kvr_load_finish(l, 2));
		if (bad) {
			fprintf(stderr, "stress_pinmap: writer %u: a load command failed\n", slot);
			__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
			break;
		}
		__atomic_add_fetch(&cycles, 1, __ATOMIC_RELAXED);
	}
	kvr_load_destroy(l);
	return NULL;
}

/* Query q's depth on a rank after c commands of its cycle: states {} {A} {A,B} {B} {B+E}. */
static uint32_t state_depth(int q, uint64_t c)
{
	c %= CMDS;
	int st = c == 0               ? 0
	         : c <= NOISE + 1     ? 1
	         : c <= 2 * NOISE + 2 ? 2
	         : c == 2 * NOISE + 3 ? 3
	                              : 4;
	static const uint32_t dc[5] = {0, L, L, BRANCH, BRANCH};   /* query C */
	static const uint32_t dq2[5] = {0, BRANCH, L, L, L + OUT}; /* query D + E */
	return q ? dq2[st] : dc[st];
}

/* Was depth d possible for a query that overlapped phases p0..p1 of a writer?  Each command
 * in flight allows the depths before and after it; a finish unpins its runs one at a time, so a
 * walk racing with one may also stop anywhere in between. */
static int allowed(int q, uint64_t p0, uint64_t p1, uint32_t d)
{
	if (p1 - p0 > 2 * CMDS)
		p1 = p0 + 2 * CMDS; /* a whole cycle: every state */
	uint64_t last = (p1 + 1) / 2;
	for (uint64_t c = p0 / 2; c <= last; c++) {
		uint32_t before = state_depth(q, c), after = state_depth(q, c + 1);
		uint64_t ci = c % CMDS;
		bool finish = ci == 2 * NOISE + 2 || ci == 2 * NOISE + 4;
		if (d == before || (c < last && d == after))
			return 1;
		if (c < last && finish && d <= before && d >= after)
			return 1;
	}
	return 0;
}

static void *reader(void *arg)
{
	(void)arg;
	uint32_t depth[4] = {0}, slots[4];
	if (kvr_rcu_thread_online()) {
		__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
		return NULL;
	}
	unsigned long n = 0;
	while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
		for (int q = 0; q < 2; q++) {
			uint64_t p0[3], p1[3];
			for (int s = 1; s <= 2; s++)
				p0[s] = __atomic_load_n(&phase[s], __ATOMIC_ACQUIRE);
			kvr_rcu_read_lock();
			size_t ns = q ? kvr_pinmap_depths(pm, Q2, L + OUT, depth, slots)
			              : kvr_pinmap_depths(pm, C, L, depth, slots);
			kvr_rcu_read_unlock();
			/* A seq_cst read-modify-write, not a fence: ThreadSanitizer models it. */
			for (int s = 1; s <= 2; s++)
				p1[s] = __atomic_fetch_add(&phase[s], 0, __ATOMIC_SEQ_CST);
			for (size_t i = 0; i < ns; i++)
				if (slots[i] != 1 && slots[i] != 2)
					__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
			for (uint32_t s = 1; s <= 2; s++) {
				if (!allowed(q, p0[s], p1[s], depth[s])) {
					fprintf(
					    stderr,
					    "stress_pinmap: query %d: slot %u depth %u in phases "
					    "%llu..%llu\n",
					    q, s, depth[s], (unsigned long long)p0[s],
					    (unsigned long long)p1[s]);
					__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
				}
				depth[s] = 0;
			}
		}
		n++;
	}
	__atomic_add_fetch(&reads, n, __ATOMIC_RELAXED);
	return NULL;
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 1500;
	for (int i = 0; i < L; i++) { /* chained: each hash names its prefix */
		C[i] = mix((i ? C[i - 1] : 7) + 1);
		D[i] = i < BRANCH ? C[i] : mix(D[i - 1] + 2);
		Q2[i] = D[i];
	}
	for (int i = 0; i < OUT; i++)
		Q2[L + i] = E[i] = mix((i ? E[i - 1] : D[L - 1]) + 3);
	if (kvr_pinmap_create(&pm))
		return 1;
	pthread_t w[2], r[2];
	for (int i = 0; i < 2; i++) {
		pthread_create(&w[i], NULL, writer, (void *)(uintptr_t)(i + 1));
		pthread_create(&r[i], NULL, reader, NULL);
	}
	uint64_t end = now_ms() + (uint64_t)ms;
	while (now_ms() < end && !__atomic_load_n(&failed, __ATOMIC_RELAXED)) {
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	for (int i = 0; i < 2; i++) {
		pthread_join(w[i], NULL);
		pthread_join(r[i], NULL);
	}
	size_t left = kvr_pinmap_runs(pm);
	kvr_rcu_barrier();
	kvr_pinmap_destroy(pm);
	printf("stress_pinmap: %lu writer cycles, %lu reader rounds, %zu runs left\n", cycles,
	       reads, left);
	if (left || !cycles || !reads)
		failed = 1;
	return failed ? 1 : 0;
}
