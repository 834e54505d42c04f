/*
 * bench_lru - the per-rank approximate LRU at capacity pressure: acquire + release of 64-block
 * requests with a few requests in flight, so every acquire evicts, with and without prefix
 * sharing (shared: the first half of each request is one of 256 common prefixes).
 * Single-threaded by design (one shard thread owns a rank).  The floor, measured in the same
 * run: a bare hash probe of the request's 64 hashes in a table of the same size
 * (shards/u64map.h); acquire_ratio = acquire p50 / floor p50.
 * Prints one SUMMARY line per mode; never asserts timings.
 *
 * usage: bench_lru [--ms N per mode (default 1500)] [--capacity BLOCKS (65536)]
 *                  [--blocks N (64)] [--inflight N (8)] [--cpu N (pin; default none)]
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/lru.h"
#include "shards/u64map.h"

#define MAX_SAMPLES (1u << 21)

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t rng(uint64_t *s)
{
	uint64_t x = *s += 0x9E3779B97F4A7C15ull;
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
	x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
	return x ^ (x >> 31);
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static uint32_t pct(uint32_t *v, size_t n, double p)
{
	if (n == 0)
		return 0;
	size_t i = (size_t)(p * (double)(n - 1));
	return v[i];
}

static volatile uint64_t sink;

static void run(int shared, double ms, uint64_t capacity, size_t nb, size_t inflight)
{
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	if (kvr_lru_create(capacity, &lru))
		return;
	struct kvr_lru_block *b = malloc(nb * sizeof(*b));
	uint64_t *ring = calloc(inflight, sizeof(uint64_t));
	uint32_t *acq = malloc(MAX_SAMPLES * sizeof(uint32_t));
	uint32_t *rel = malloc(MAX_SAMPLES * sizeof(uint32_t));
	uint32_t *flo = malloc(MAX_SAMPLES * sizeof(uint32_t));
	struct kvr_u64map floor_map;
	kvr_u64map_init(&floor_map);
	kvr_u64map_reserve(&floor_map, capacity);
	uint64_t r = 42, attempt = 0, uniq = 1ull << 40;
	for (uint64_t i = 0; i < capacity; i++)
		kvr_u64map_insert(&floor_map, rng(&r), 1);
	size_t na = 0, nr = 0, nf = 0;
	uint64_t evicted = 0, warm = capacity / nb * 2, done = 0;
	uint64_t t_start = 0, t_end_target = 0;
	for (;;) {
		/* Build the next request. */
		uint64_t prefix = rng(&r) % 256;
		for (size_t i = 0; i < nb; i++) {
			uint64_t s = (shared && i < nb / 2) ? (prefix << 20) + i + 1 : uniq++;
			b[i].seq = s * 0x9E3779B97F4A7C15ull;
			b[i].local = s;
		}
		size_t slot = attempt % inflight;
		uint64_t t0, t1;
		if (ring[slot]) {
			t0 = now_ns();
			kvr_lru_release(lru, ring[slot], &out);
			t1 = now_ns();
			evicted += out.n_evicted;
			if (done > warm && nr < MAX_SAMPLES)
				rel[nr++] = (uint32_t)(t1 - t0);
		}
		attempt++;
		t0 = now_ns();
		kvr_lru_acquire(lru, attempt, b, nb, 1, &out);
		t1 = now_ns();
		evicted += out.n_evicted;
		ring[slot] = attempt;
		if (done > warm && na < MAX_SAMPLES)
			acq[na++] = (uint32_t)(t1 - t0);
		if (done > warm && (done & 7) == 0 && nf < MAX_SAMPLES) {
			t0 = now_ns();
			uint64_t hits = 0;
			for (size_t i = 0; i < nb; i++)
				hits += kvr_u64map_find(&floor_map, b[i].seq) != NULL;
			t1 = now_ns();
			sink += hits;
			flo[nf++] = (uint32_t)(t1 - t0);
		}
		done++;
		if (done == warm) {
			t_start = now_ns();
			t_end_target = t_start + (uint64_t)(ms * 1e6);
			evicted = 0;
		}
		if (done > warm && (done & 63) == 0 && now_ns() >= t_end_target)
			break;
	}
	double secs = (double)(now_ns() - t_start) / 1e9;
	uint64_t ops = done - warm;
	qsort(acq, na, sizeof(uint32_t), cmp_u32);
	qsort(rel, nr, sizeof(uint32_t), cmp_u32);
	qsort(flo, nf, sizeof(uint32_t), cmp_u32);
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	printf("SUMMARY bench=lru sharing=%s blocks=%zu capacity=%llu inflight=%zu ops_s=%.0f "
	       "acquire_p50_ns=%u acquire_p99_ns=%u acquire_p999_ns=%u release_p50_ns=%u "
	       "release_p99_ns=%u release_p999_ns=%u evictions_per_acquire=%.1f "
	       "floor_probe_p50_ns=%u acquire_ratio=%.2f bytes_per_copy=%.1f\n",
	       shared ? "yes" : "no", nb, (unsigned long long)capacity, inflight,
	       (double)ops / secs, pct(acq, na, 0.5), pct(acq, na, 0.99), pct(acq, na, 0.999),
	       pct(rel, nr, 0.5), pct(rel, nr, 0.99), pct(rel, nr, 0.999),
	       (double)st.evictions / (double)attempt, pct(flo, nf, 0.5),
	       (double)pct(acq, na, 0.5) / (double)(pct(flo, nf, 0.5) ? pct(flo, nf, 0.5) : 1),
	       kvr_lru_bytes_per_copy(lru));
	(void)evicted;
	kvr_u64map_fini(&floor_map);
	free(acq);
	free(rel);
	free(flo);
	free(ring);
	free(b);
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

int main(int argc, char **argv)
{
	double ms = 1500;
	uint64_t capacity = 65536;
	size_t nb = 64, inflight = 8;
	int cpu = -1;
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--ms"))
			ms = atof(argv[i + 1]);
		else if (!strcmp(argv[i], "--capacity"))
			capacity = strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "--blocks"))
			nb = strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "--inflight"))
			inflight = strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "--cpu"))
			cpu = atoi(argv[i + 1]);
	}
	if (nb == 0 || inflight == 0 || capacity < nb * inflight) {
		fprintf(stderr, "need blocks > 0, inflight > 0, capacity >= blocks * inflight\n");
		return 2;
	}
	if (cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	run(0, ms, capacity, nb, inflight);
	run(1, ms, capacity, nb, inflight);
	return 0;
}
