/* core/select.c - cost and choice; see select.h for the model. */
#include "core/select.h"

#include <math.h>

long kvr_select_pick(const struct kvr_select_params *p, const double *cost, size_t n,
                     const struct kvr_select_scan *s, uint64_t *rng)
{
	if (n == 0)
		return -1;
	double lo = s->lo, hi = s->hi;
	size_t first = s->first, ties = s->ties;
	double range = hi - lo;
	if (p->temperature <= 0.0 || range <= 0.0) {
		/* argmin; uniform among ties: ONE draw picks the j-th tie (multiply-shift, no
		 * division; idle ranks all tie, and a division per tie cost more than the rest of
		 * the selection at 64 candidates). */
		if (ties <= 1)
			return (long)first;
		uint64_t j = (uint64_t)(((unsigned __int128)kvr_rand64(rng) * ties) >> 64);
		for (size_t i = first;; i++)
			if (cost[i] == lo && j-- == 0)
				return (long)i;
	}
	/* softmax over normalised negative cost: weights in (0, 1], the best rank weighs 1. */
	double inv = 1.0 / (range * p->temperature), total = 0.0;
	for (size_t i = 0; i < n; i++)
		total += exp(-(cost[i] - lo) * inv);
	double u = kvr_rand_unit(rng) * total, acc = 0.0;
	for (size_t i = 0; i < n; i++) {
		acc += exp(-(cost[i] - lo) * inv);
		if (u < acc)
			return (long)i;
	}
	/* Rounding left u at the very top: the last candidate with a non-zero weight. */
	for (size_t i = n; i-- > 0;)
		if (exp(-(cost[i] - lo) * inv) > 0.0)
			return (long)i;
	return 0;
}
