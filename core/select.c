/* core/select.c - cost and choice; see select.h for the model. */
#include "core/select.h"

#include <math.h>

double kvr_select_cost(const struct kvr_select_params *p, const struct kvr_candidate *c)
{
	double bs = (double)p->block_size;
	double prefill = ((double)c->active_prefill_tokens + (double)p->prompt_tokens) / bs -
	                 p->overlap_credit * (double)c->overlap_blocks;
	return p->prefill_load_scale * prefill + (double)c->potential_decode_blocks;
}

long kvr_select(const struct kvr_select_params *p, struct kvr_candidate *c, size_t n, uint64_t *rng)
{
	if (n == 0)
		return -1;
	double lo = INFINITY, hi = -INFINITY;
	size_t first = 0, ties = 0; /* the first minimum and how many candidates tie with it */
	for (size_t i = 0; i < n; i++) {
		double x = c[i].cost = kvr_select_cost(p, &c[i]);
		if (x < lo) {
			lo = x;
			first = i;
			ties = 1;
		} else if (x == lo) {
			ties++;
		}
		if (x > hi)
			hi = x;
	}
	double range = hi - lo;
	if (p->temperature <= 0.0 || range <= 0.0) {
		/* argmin; uniform among ties: ONE draw picks the j-th tie (multiply-shift, no
		 * division; idle ranks all tie, and a division per tie cost more than the rest of
		 * the selection at 64 candidates). */
		if (ties <= 1)
			return (long)first;
		uint64_t j = (uint64_t)(((unsigned __int128)kvr_rand64(rng) * ties) >> 64);
		for (size_t i = first;; i++)
			if (c[i].cost == lo && j-- == 0)
				return (long)i;
	}
	/* softmax over normalised negative cost: weights in (0, 1], the best rank weighs 1. */
	double inv = 1.0 / (range * p->temperature), total = 0.0;
	for (size_t i = 0; i < n; i++)
		total += exp(-(c[i].cost - lo) * inv);
	double u = kvr_rand_unit(rng) * total, acc = 0.0;
	for (size_t i = 0; i < n; i++) {
		acc += exp(-(c[i].cost - lo) * inv);
		if (u < acc)
			return (long)i;
	}
	/* Rounding left u at the very top: the last candidate with a non-zero weight. */
	for (size_t i = n; i-- > 0;)
		if (exp(-(c[i].cost - lo) * inv) > 0.0)
			return (long)i;
	return 0;
}
