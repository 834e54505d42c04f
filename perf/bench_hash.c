/*
 * bench_hash - block hashing throughput (kvr_hash_blocks, local + sequence hashes) against raw
 * XXH3 over the same bytes, in the same run.  Prints one SUMMARY line per prompt size.
 *
 * usage: bench_hash [--ms N] [--block-size N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvrouter.h"
#include "perf/bench_util.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static volatile uint64_t sink;

int main(int argc, char **argv)
{
	double ms = 300;
	uint32_t bs = 16;
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--ms"))
			ms = opt_f64(argc, argv, i, 1e-3, 1e9);
		else if (!strcmp(argv[i], "--block-size"))
			bs = (uint32_t)opt_u64(argc, argv, i, 1, 2048);
		else
			opt_unknown(argv, i);
	}
	static const size_t sizes[] = {2048, 8192, 131072};
	for (size_t s = 0; s < 3; s++) {
		size_t n = sizes[s];
		uint32_t *tok = malloc(n * sizeof(*tok));
		uint64_t *local = malloc((n / bs) * sizeof(uint64_t));
		uint64_t *seq = malloc((n / bs) * sizeof(uint64_t));
		for (size_t i = 0; i < n; i++)
			tok[i] = (uint32_t)(i * 2654435761u) & 0x7ffff;
		double best_kvr = 1e30, best_raw = 1e30;
		/* Alternate the two in rounds so both see the same machine conditions. */
		for (int round = 0; round < 10; round++) {
			double deadline = now_s() + ms / 20000.0;
			uint64_t iters = 0;
			double t0 = now_s(), t;
			do {
				kvr_hash_blocks(tok, n, bs, NULL, local, seq);
				sink += seq[n / bs - 1];
				iters++;
			} while ((t = now_s()) < deadline);
			if ((t - t0) / (double)iters < best_kvr)
				best_kvr = (t - t0) / (double)iters;
			deadline = now_s() + ms / 20000.0;
			iters = 0;
			t0 = now_s();
			do {
				/* The floor: one XXH3 per block over the same bytes, no chain. */
				uint64_t acc = 0;
				for (size_t b = 0; b < n / bs; b++)
					acc ^= XXH3_64bits_withSeed(tok + b * bs, bs * 4, 1337);
				sink += acc;
				iters++;
			} while ((t = now_s()) < deadline);
			if ((t - t0) / (double)iters < best_raw)
				best_raw = (t - t0) / (double)iters;
		}
		double bytes = (double)n * 4;
		double gbps = bytes / best_kvr / 1e9, raw = bytes / best_raw / 1e9;
		printf("SUMMARY bench=hash tokens=%zu block_size=%u gbps=%.3f raw_gbps=%.3f "
		       "ratio=%.3f\n",
		       n, bs, gbps, raw, gbps / raw);
		free(tok);
		free(local);
		free(seq);
	}
	return 0;
}
