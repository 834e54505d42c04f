/* The selector: cost formula, argmin with uniform ties, softmax temperature, determinism. */
#include <criterion/criterion.h>

#include "core/select.h"

static struct kvr_select_params P = {.overlap_credit = 1.0,
                                     .prefill_load_scale = 1.0,
                                     .temperature = 0.0,
                                     .block_size = 16,
                                     .prompt_tokens = 160};

Test(select, cost_formula)
{
	struct kvr_candidate c = {
	    .overlap_blocks = 4, .active_prefill_tokens = 32, .potential_decode_blocks = 100};
	/* (32 + 160)/16 - 4 = 8 prefill blocks, + 100 decode */
	cr_assert_float_eq(kvr_select_cost(&P, &c), 108.0, 1e-9);
	struct kvr_select_params q = P;
	q.overlap_credit = 0.5;
	q.prefill_load_scale = 2.0;
	cr_assert_float_eq(kvr_select_cost(&q, &c), 2.0 * (12.0 - 2.0) + 100.0, 1e-9);
}

Test(select, overlap_wins_when_loads_equal)
{
	struct kvr_candidate c[3] = {
	    {.slot = 0, .overlap_blocks = 1, .potential_decode_blocks = 10},
	    {.slot = 1, .overlap_blocks = 9, .potential_decode_blocks = 10},
	    {.slot = 2, .overlap_blocks = 3, .potential_decode_blocks = 10}};
	uint64_t rng = 1;
	cr_assert_eq(kvr_select(&P, c, 3, &rng), 1);
}

Test(select, load_wins_when_overloaded)
{
	struct kvr_candidate c[2] = {{.slot = 0,
	                              .overlap_blocks = 9,
	                              .active_prefill_tokens = 16000,
	                              .potential_decode_blocks = 5000},
	                             {.slot = 1,
	                              .overlap_blocks = 0,
	                              .active_prefill_tokens = 0,
	                              .potential_decode_blocks = 10}};
	uint64_t rng = 1;
	cr_assert_eq(kvr_select(&P, c, 2, &rng), 1);
}

Test(select, ties_uniform)
{
	int hits[4] = {0};
	uint64_t rng = 12345;
	for (int i = 0; i < 40000; i++) {
		struct kvr_candidate c[4] = {{.slot = 0}, {.slot = 1}, {.slot = 2}, {.slot = 3}};
		c[3].potential_decode_blocks = 1; /* never the minimum */
		long k = kvr_select(&P, c, 4, &rng);
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
		struct kvr_candidate c1[5], c2[5];
		for (int k = 0; k < 5; k++)
			c1[k] = c2[k] =
			    (struct kvr_candidate){.slot = (uint32_t)k,
			                           .overlap_blocks = (uint32_t)(k * i % 7),
			                           .potential_decode_blocks = 50};
		cr_assert_eq(kvr_select(&q, c1, 5, &a), kvr_select(&q, c2, 5, &b));
	}
}

Test(select, temperature_spreads_choice)
{
	struct kvr_select_params q = P;
	q.temperature = 1.0;
	int hits[2] = {0};
	uint64_t rng = 7;
	for (int i = 0; i < 20000; i++) {
		struct kvr_candidate c[2] = {{.slot = 0, .potential_decode_blocks = 0},
		                             {.slot = 1, .potential_decode_blocks = 10}};
		hits[kvr_select(&q, c, 2, &rng)]++;
	}
	/* weights 1 and e^-1: p(best) = 1/(1+e^-1) = 0.731 */
	cr_assert(hits[0] > 14200 && hits[0] < 15000, "best chosen %d/20000", hits[0]);
	/* temperature 0 -> always the best */
	cr_assert_eq(kvr_select(&P,
	                        (struct kvr_candidate[]){{.potential_decode_blocks = 0},
	                                                 {.potential_decode_blocks = 10}},
	                        2, &rng),
	             0);
	cr_assert_eq(kvr_select(&P, NULL, 0, &rng), -1);
}
