/* The selector: cost formula, argmin with uniform ties, softmax temperature, determinism. */
#include <criterion/criterion.h>
#include <string.h>

#include "core/select.h"

/* The reference formulas below round every operation as written, like the library (select.h). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* A candidate's inputs, as the router reads them. */
struct cand {
	uint32_t slot, overlap_blocks;
	uint64_t active_prefill_tokens, potential_decode_blocks;
};

/* Scores c[0..n) and picks, as kvr_route does. */
static long select_of(const struct kvr_select_params *p, const struct cand *c, size_t n,
                      uint64_t *rng)
{
	double cost[8];
	struct kvr_select_scan s;
	kvr_select_scan_init(&s);
	for (size_t i = 0; i < n; i++) {
		cost[i] = kvr_select_cost(p, c[i].active_prefill_tokens, c[i].overlap_blocks,
		                          c[i].potential_decode_blocks);
		kvr_select_scan_add(&s, i, cost[i]);
	}
	return kvr_select_pick(p, cost, n, &s, rng);
}

static struct kvr_select_params P = {.overlap_credit = 1.0,
                                     .prefill_load_scale = 1.0,
                                     .temperature = 0.0,
                                     .block_size = 16,
                                     .prompt_tokens = 160};

Test(select, cost_formula)
{
	/* (32 + 160)/16 - 4 = 8 prefill blocks, + 100 decode */
	cr_assert_float_eq(kvr_select_cost(&P, 32, 4, 100), 108.0, 1e-9);
	struct kvr_select_params q = P;
	q.overlap_credit = 0.5;
	q.prefill_load_scale = 2.0;
	cr_assert_float_eq(kvr_select_cost(&q, 32, 4, 100), 2.0 * (12.0 - 2.0) + 100.0, 1e-9);
	q.block_size = 12; /* not a power of two: a division */
	cr_assert_float_eq(kvr_select_cost(&q, 32, 4, 100), 2.0 * (16.0 - 2.0) + 100.0, 1e-9);
}

/* The reciprocal a power-of-two block size multiplies by gives bit for bit the division's cost
 * (the decisions, ties included, are those of the formula as written). */
Test(select, power_of_two_block_size_is_the_division)
{
	uint64_t x = 88172645463325252ull;
	for (int i = 0; i < 200000; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		struct kvr_select_params q = {.overlap_credit = (double)(x % 1000) / 300.0,
		                              .prefill_load_scale = (double)(x >> 40 & 255) / 64.0,
		                              .block_size = 1u << (x >> 20 & 7),
		                              .prompt_tokens = x >> 44};
		uint64_t prefill = (x >> 3) >> (x & 63), decode = x >> 37;
		uint32_t ov = (uint32_t)(x >> 50);
		double want = q.prefill_load_scale * (((double)prefill + (double)q.prompt_tokens) /
		                                          (double)q.block_size -
		                                      q.overlap_credit * (double)ov) +
		              (double)decode;
		double got = kvr_select_cost(&q, prefill, ov, decode);
		cr_assert(memcmp(&want, &got, sizeof(got)) == 0, "i %d: %.17g vs %.17g", i, want,
		          got);
	}
}

Test(select, overlap_wins_when_loads_equal)
{
	struct cand c[3] = {{.slot = 0, .overlap_blocks = 1, .potential_decode_blocks = 10},
	                    {.slot = 1, .overlap_blocks = 9, .potential_decode_blocks = 10},
	                    {.slot = 2, .overlap_blocks = 3, .potential_decode_blocks = 10}};
	uint64_t rng = 1;
	cr_assert_eq(select_of(&P, c, 3, &rng), 1);
}

Test(select, load_wins_when_overloaded)
{
	struct cand c[2] = {{.slot = 0,
	                     .overlap_blocks = 9,
	                     .active_prefill_tokens = 16000,
	                     .potential_decode_blocks = 5000},
	                    {.slot = 1,
	                     .overlap_blocks = 0,
	                     .active_prefill_tokens = 0,
	                     .potential_decode_blocks = 10}};
	uint64_t rng = 1;
	cr_assert_eq(select_of(&P, c, 2, &rng), 1);
}

Test(select, ties_uniform)
{
	int hits[4] = {0};
	uint64_t rng = 12345;
	for (int i = 0; i < 40000; i++) {
		struct cand c[4] = {{.slot = 0}, {.slot = 1}, {.slot = 2}, {.slot = 3}};
		c[3].potential_decode_blocks = 1; /* never the minimum */
		long k = select_of(&P, c, 4, &rng);
		cr_assert(k >= 0 && k < 3);
		hits[k]++;
	}
	for (int k = 0; k < 3; k++)
		cr_assert(hits[k] > 12500 && hits[k] < 14200, "tie %d chosen %d times", k, hits[k]);
	cr_assert_eq(hits[3], 0);
}

Test(select, deterministic_under_seed)
{
	struct kvr_select_params q = P;
	q.temperature = 0.7;
	uint64_t a = 99, b = 99;
	for (int i = 0; i < 1000; i++) {
		struct cand c1[5], c2[5];
		for (int k = 0; k < 5; k++)
			c1[k] = c2[k] = (struct cand){.slot = (uint32_t)k,
			                              .overlap_blocks = (uint32_t)(k * i % 7),
			                              .potential_decode_blocks = 50};
		cr_assert_eq(select_of(&q, c1, 5, &a), select_of(&q, c2, 5, &b));
	}
}

Test(select, temperature_spreads_choice)
{
	struct kvr_select_params q = P;
	q.temperature = 1.0;
	int hits[2] = {0};
	uint64_t rng = 7;
	for (int i = 0; i < 20000; i++) {
		struct cand c[2] = {{.slot = 0, .potential_decode_blocks = 0},
		                    {.slot = 1, .potential_decode_blocks = 10}};
		hits[select_of(&q, c, 2, &rng)]++;
	}
	/* weights 1 and e^-1: p(best) = 1/(1+e^-1) = 0.731 */
	cr_assert(hits[0] > 14200 && hits[0] < 15000, "best chosen %d/20000", hits[0]);
	/* temperature 0 -> always the best */
	cr_assert_eq(select_of(&P,
	                       (struct cand[]){{.potential_decode_blocks = 0},
	                                       {.potential_decode_blocks = 10}},
	                       2, &rng),
	             0);
	cr_assert_eq(select_of(&P, NULL, 0, &rng), -1);
}

/* Every scoring implementation gives the same costs bit for bit and the same scan, on random
 * inputs: loads from zero to past 2^52 (where AVX2 falls back to scalar conversions), candidate
 * counts that are not multiples of four, slots in any order or in runs of consecutive slots
 * (which AVX2 reads with vector loads), repeated costs (ties), and
 * parameters that make costs infinite or NaN. */
Test(select, implementations_agree)
{
	enum { SLOTS = 96 };
	uint64_t booked[2 * SLOTS], prov[2 * SLOTS];
	uint32_t overlap[SLOTS], pinned[SLOTS], slot[SLOTS];
	double c1[SLOTS], c2[SLOTS];
	uint64_t x = 0x9e3779b97f4a7c15ull;
#define NEXT (x ^= x << 13, x ^= x >> 7, x ^= x << 17)
	for (int round = 0; round < 4000; round++) {
		int mag = (int)(NEXT % 60); /* load magnitudes up to 2^60 */
		for (int s = 0; s < SLOTS; s++) {
			bool same = NEXT % 3 == 0; /* many equal inputs: ties */
			booked[2 * s] = same ? 1000 : NEXT >> (64 - 1 - mag);
			booked[2 * s + 1] = same ? 50 : NEXT >> (64 - 1 - mag);
			prov[2 * s] = same ? 0 : NEXT % 5000;
			prov[2 * s + 1] = same ? 0 : NEXT % 300;
			overlap[s] = same ? 0 : (uint32_t)(NEXT % 200);
			pinned[s] = same ? 0 : (uint32_t)(NEXT % 100);
			slot[s] = (uint32_t)s;
		}
		/* The order: a random one, ranks in slot order (one run of consecutive slots, read
		 * with vector loads by AVX2), or runs of consecutive slots at any offset, broken
		 * here and there (groups of four that are a run and groups that are not). */
		int order = round % 3;
		for (int s = SLOTS - 1; order == 0 && s > 0; s--) {
			uint32_t j = (uint32_t)(NEXT % (uint64_t)(s + 1)), t = slot[s];
			slot[s] = slot[j];
			slot[j] = t;
		}
		if (order == 2) {
			int start =
			    (int)(NEXT % 7); /* runs start at any slot, not a multiple of 4 */
			for (int s = 0; s < SLOTS; s++)
				slot[s] = (uint32_t)((start + s) % SLOTS);
			for (int k = 0; k < 6; k++) { /* a few swaps break some runs */
				uint32_t a = (uint32_t)(NEXT % SLOTS), b = (uint32_t)(NEXT % SLOTS),
				         t = slot[a];
				slot[a] = slot[b];
				slot[b] = t;
			}
		}
		struct kvr_select_params q = {
		    .overlap_credit = NEXT % 8 == 0 ? 1e308 : (double)(NEXT % 1000) / 250.0,
		    .prefill_load_scale = NEXT % 8 == 0   ? 0.0
		                          : NEXT % 8 == 0 ? 1e300
		                                          : (double)(NEXT % 1000) / 300.0,
		    .block_size = NEXT % 4 == 0 ? 12 : 16,
		    .prompt_tokens = NEXT % 100000};
		const struct kvr_select_inputs in = {booked, prov, overlap, pinned, NEXT % 400};
		size_t n = (size_t)(NEXT % SLOTS) + 1;
		struct kvr_select_scan s1, s2;
		kvr_select_score(KVR_SELECT_SCALAR, &q, &in, slot, n, c1, &s1);
		kvr_select_score(KVR_SELECT_AVX2, &q, &in, slot, n, c2, &s2);
		cr_assert(memcmp(c1, c2, n * sizeof(double)) == 0, "round %d: costs differ", round);
		cr_assert(memcmp(&s1.lo, &s2.lo, sizeof(double)) == 0 &&
		              memcmp(&s1.hi, &s2.hi, sizeof(double)) == 0 && s1.first == s2.first &&
		              s1.ties == s2.ties,
		          "round %d: scan lo %g/%g hi %g/%g first %zu/%zu ties %zu/%zu", round,
		          s1.lo, s2.lo, s1.hi, s2.hi, s1.first, s2.first, s1.ties, s2.ties);
		for (size_t i = 0; i < n; i++) { /* and the scalar scan is the formula's */
			uint32_t s = slot[i];
			double want = kvr_select_cost(&q, booked[2 * s] + prov[2 * s], overlap[s],
			                              booked[2 * s + 1] + prov[2 * s + 1] +
			                                  in.foot - pinned[s]);
			cr_assert(memcmp(&want, &c1[i], sizeof(double)) == 0, "round %d i %zu",
			          round, i);
		}
	}
#undef NEXT
}

/* Extreme but valid weights: a temperature so small that 1 / (range x temperature) overflows
 * is the argmin (the best rank's weight was NaN, and the first candidate was picked whatever its
 * cost: the loaded one 200 times of 200); an overlap credit whose product overflows, with no
 * prefill weight, costs nothing (0 x -inf was NaN, and the scan passed that rank over). */
Test(select, extreme_weights_pick_the_best)
{
	uint64_t rng = 11;
	struct kvr_select_params q = P;
	q.temperature = 1e-310;
	for (int i = 0; i < 50; i++)
		cr_assert_eq(select_of(&q,
		                       (struct cand[]){{.potential_decode_blocks = 10},
		                                       {.potential_decode_blocks = 0}},
		                       2, &rng),
		             1);
	q = P;
	q.overlap_credit = 1e308;
	q.prefill_load_scale = 0.0;
	cr_assert_eq(
	    select_of(&q,
	              (struct cand[]){{.overlap_blocks = 0, .potential_decode_blocks = 80},
	                              {.overlap_blocks = 16, .potential_decode_blocks = 16}},
	              2, &rng),
	    1);
}
