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
	for (size_t i = 0; i < n; i++) {
		c[i].cost = kvr_select_cost(p, &c[i]);
		if (c[i].cost < lo)
			lo = c[i].cost;
		if (c[i].cost > hi)
			hi = c[i].cost;
	}
	double range = hi - lo;
	if (p->temperature <= 0.0 || range <= 0.0) {
		/* argmin; uniform among ties by reservoir sampling (one pass, no allocation). */
		long pick = -1;
		uint64_t ties = 0;
		for (size_t i = 0; i < n; i++) {
			if (c[i].cost != lo)
				continue;
			ties++;
			if (ties == 1 || kvr_rand64(rng) % ties == 0)
				pick = (long)i;
		}
		return pick;
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
