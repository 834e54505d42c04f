/* tests/fuzz/fuzz_api.h - the API fuzzer's entry points, shared by the libFuzzer target and the
 * seeded driver (fuzz_api_main.c). */
#ifndef KVR_TESTS_FUZZ_API_H
#define KVR_TESTS_FUZZ_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct fuzz_api_stats {
	uint64_t calls;
};

extern struct fuzz_api_stats fuzz_api_totals;
extern uint64_t fuzz_api_current_seed;
/* Crafted hash-given prompts (fuzz_api.c, craft_hashes; also FUZZ_API_CRAFT=1): off by default,
 * so a seed or a corpus file runs the same program as before. */
extern bool fuzz_api_craft;
/* Events mode as engines feed it (fuzz_api.c, events_ext and op_ev_probe; also
 * FUZZ_API_EVENTS=1): every router in events mode, engine hashes equal to the router's, per rank
 * and per rank life, or crafted, and query-only routes whose overlap the model knows.  Off by
 * default, like fuzz_api_craft. */
extern bool fuzz_api_events;
/* Configuration values at their limits (fuzz_api.c, limit_config; also FUZZ_API_LIMITS=1): block
 * sizes 3..65536, lanes of 2-4 messages, scheduler and time settings of 1 ns or near 2^64, one or
 * 65536 ranks, extreme selection weights.  Off by default, like fuzz_api_craft. */
extern bool fuzz_api_limits;

/* Runs one program (on a fresh thread); aborts with a message on any violation.  *calls (may be
 * NULL) is increased by the number of API operations it ran. */
void fuzz_api_run(const uint8_t *data, size_t size, uint64_t *calls);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
