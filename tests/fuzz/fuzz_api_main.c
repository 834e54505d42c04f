/*
 * tests/fuzz/fuzz_api_main.c - the API fuzzer as a plain, seeded program (no libFuzzer needed):
 * each seed expands (splitmix64) into one program for fuzz_api.c.  Registered in meson test
 * with a short run, so it runs in every build, ASan+UBSan and TSan included.
 *
 *   fuzz_api_seeds [--first S] [--seeds N] [--runs R] [--seconds T] [--bytes B] [--write FILE]
 *                  [--craft] [--events] [--limits] [--clock-back] [--slow-admit] [--stall-admit]
 *   fuzz_api_seeds FILE...        (program files: a libFuzzer input, tests/fuzz/corpus/api/)
 *
 * A failure prints its seed; `--first S --seeds 1` replays it alone (`--runs R`: R times, for a
 * failure that depends on timing), and `--write FILE` saves
 * that seed's program bytes as a libFuzzer input (build-fuzz/tests/fuzz/fuzz_api FILE).
 * --craft (before FILE... too) crafts hash-given prompts (fuzz_api.c, craft_hashes): other
 * programs than without it, so a seed replays with the same flag.  --events likewise: every router
 * in events mode, engine hashes as vLLM sends them, and probes of the overlap (fuzz_api.h).
 * --limits: configuration values at the ends of their ranges (fuzz_api.h).  --clock-back: the
 * router's clock also steps back (fuzz_api.h).  --slow-admit: on_admit on the admission thread
 * reports late (fuzz_api.h); the same programs as without it.  --stall-admit: the admission
 * thread's clock reads stall and the program pauses after a refused route (fuzz_api.h); the same
 * programs too.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fuzz_api.h"
#include "tests/common/splitmix.h"

static double mono_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The program bytes of one seed: its length and content both come from the seed. */
static size_t expand(uint64_t seed, size_t max_bytes, uint8_t *buf)
{
	uint64_t x = seed;
	size_t n = 256 + (size_t)(splitmix64(&x) % (max_bytes - 255));
	for (size_t i = 0; i < n; i += 8) {
		uint64_t v = splitmix64(&x);
		memcpy(buf + i, &v, n - i < 8 ? n - i : 8);
	}
	return n;
}

/* Runs program files (a libFuzzer crash input, the corpus) instead of seeds. */
static int run_files(int n, char **paths)
{
	for (int i = 0; i < n; i++) {
		FILE *f = fopen(paths[i], "rb");
		if (!f) {
			fprintf(stderr, "cannot open %s\n", paths[i]);
			return 1;
		}
		static uint8_t buf[1 << 20];
		size_t len = fread(buf, 1, sizeof(buf), f);
		fclose(f);
		fuzz_api_run(buf, len, &fuzz_api_totals.calls);
	}
	printf("fuzz_api: %d files, %" PRIu64 " API operations\n", n, fuzz_api_totals.calls);
	return 0;
}

int main(int argc, char **argv)
{
	uint64_t first = 1, seeds = 20, runs = 1;
	double seconds = 0;
	size_t max_bytes = 6000;
	const char *write = NULL;
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(argv[i], "--first") && v)
			first = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--seeds") && v)
			seeds = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--runs") && v)
			runs = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--seconds") && v)
			seconds = atof(argv[++i]);
		else if (!strcmp(argv[i], "--bytes") && v)
			max_bytes = (size_t)strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--write") && v)
			write = argv[++i];
		else if (!strcmp(argv[i], "--craft"))
			fuzz_api_craft = true;
		else if (!strcmp(argv[i], "--events"))
			fuzz_api_events = true;
		else if (!strcmp(argv[i], "--limits"))
			fuzz_api_limits = true;
		else if (!strcmp(argv[i], "--clock-back"))
			fuzz_api_clock_back = true;
		else if (!strcmp(argv[i], "--slow-admit"))
			fuzz_api_slow_admit = true;
		else if (!strcmp(argv[i], "--stall-admit"))
			fuzz_api_stall_admit = true;
		else if (argv[i][0] != '-')
			return run_files(argc - i, argv + i);
		else {
			fprintf(stderr,
			        "usage: %s [--first S] [--seeds N] [--runs R] [--seconds T] "
			        "[--bytes B] [--write FILE] [--craft] [--events] [--limits] "
			        "[--clock-back] [--slow-admit] [--stall-admit]\n",
			        argv[0]);
			return 2;
		}
	}
	if (max_bytes < 512)
		max_bytes = 512;
	uint8_t *buf = malloc(max_bytes + 8);
	if (!buf)
		return 1;
	double t0 = mono_s();
	uint64_t done = 0;
	for (uint64_t s = first; s < first + seeds; s++) {
		size_t n = expand(s, max_bytes, buf);
		if (write) {
			FILE *f = fopen(write, "wb");
			if (!f || fwrite(buf, 1, n, f) != n) {
				fprintf(stderr, "cannot write %s\n", write);
				return 1;
			}
			fclose(f);
		}
		fuzz_api_current_seed = s;
		for (uint64_t k = 0; k < runs; k++)
			fuzz_api_run(buf, n, &fuzz_api_totals.calls);
		done++;
		if (seconds > 0 && mono_s() - t0 >= seconds)
			break;
	}
	double dt = mono_s() - t0;
	printf("fuzz_api: %" PRIu64 " seeds (%" PRIu64 "..%" PRIu64 "), %" PRIu64
	       " API operations in %.1f s\n",
	       done, first, first + done - 1, fuzz_api_totals.calls, dt);
	free(buf);
	return 0;
}
