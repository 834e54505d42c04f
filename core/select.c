/*
 * core/select.c - cost and choice; see select.h for the model.
 *
 * Scoring (kvr_select_score) runs once per decision over every candidate: 64 to 1024 of them,
 * each a handful of integer loads and adds, three integer-to-double conversions and six
 * dependent floating-point operations, then the argmin scan's data-dependent branches: ~38
 * instructions a candidate one at a time.  The AVX2 path reads the inputs with the same scalar
 * atomic loads (their ordering is the contract, shards/owner.h), then converts and computes
 * four candidates per instruction: integers below 2^52 become doubles exactly by the
 * magic-number trick (OR into the mantissa of 2^52, subtract 2^52: the same double as the
 * scalar conversion), and the arithmetic is the scalar expression, operation for operation, so
 * every cost is bit-identical (FMA is not enabled for it, so nothing is contracted).  The scan
 * becomes two passes: a vector min/max (order-independent: costs are never -0, NaN operands are
 * ignored the way the scalar comparisons ignore them), then the first minimum and the ties by
 * comparing every cost with the minimum.  ~20 instructions a candidate; measured, the select
 * stage at 1024 ranks went from 2.0-2.6 us to 1.8 us (bench_route --ranks 1024), and at 64 ranks
 * it is no faster: there it waits on the one or two load lines a shard wrote since the thread's
 * last decision (cache misses, not arithmetic).
 */
#include "core/select.h"

#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#endif

/* As in select.h: no fused multiply-adds in this file's cost arithmetic, whatever -march. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* Candidate i's cost (inputs read in the contract's order: booked with acquire, then prov). */
static inline double score_one(const struct kvr_select_coef *k, const struct kvr_select_inputs *in,
                               uint32_t s)
{
	uint64_t prefill = __atomic_load_n(&in->booked[2 * (size_t)s], __ATOMIC_ACQUIRE);
	prefill += __atomic_load_n(&in->prov[2 * (size_t)s], __ATOMIC_RELAXED);
	uint64_t blocks = __atomic_load_n(&in->booked[2 * (size_t)s + 1], __ATOMIC_ACQUIRE);
	blocks += __atomic_load_n(&in->prov[2 * (size_t)s + 1], __ATOMIC_RELAXED);
	return kvr_select_cost_of(k, prefill, in->overlap[s], blocks + in->foot - in->pinned[s]);
}

static void score_scalar(const struct kvr_select_coef *k, const struct kvr_select_inputs *in,
                         const uint32_t *slot, size_t n, double *cost, struct kvr_select_scan *scan)
{
	struct kvr_select_scan run; /* in registers: scan's address escapes */
	kvr_select_scan_init(&run);
	for (size_t i = 0; i < n; i++) {
		double x = score_one(k, in, slot[i]);
		cost[i] = x;
		kvr_select_scan_add(&run, i, x);
	}
	*scan = run;
}

#ifdef HAVE_AVX2_PATH
/* Exact for 0 <= v < 2^52: the double whose bits are 2^52's with v in the mantissa, less 2^52. */
__attribute__((target("avx2"))) static inline __m256d exact_pd(__m256i v)
{
	const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
	return _mm256_sub_pd(_mm256_or_pd(_mm256_castsi256_pd(v), two52), two52);
}

__attribute__((target("avx2"))) static void score_avx2(const struct kvr_select_coef *k,
                                                       const struct kvr_select_inputs *in,
                                                       const uint32_t *slot, size_t n, double *cost,
                                                       struct kvr_select_scan *scan)
{
	const __m256d prompt = _mm256_set1_pd(k->prompt), inv = _mm256_set1_pd(k->inv_bs),
	              bs = _mm256_set1_pd(k->bs), credit = _mm256_set1_pd(k->credit),
	              scale = _mm256_set1_pd(k->scale);
	__m256d lo4 = _mm256_set1_pd(INFINITY), hi4 = _mm256_set1_pd(-INFINITY);
	size_t i = 0;
	const uint64_t *booked = in->booked, *prov = in->prov;
	const uint32_t *overlap = in->overlap, *pinned = in->pinned;
	const uint64_t foot = in->foot;
	for (; i + 4 <= n; i += 4) {
		/* Unrolled by hand into scalars: the inputs stay in registers (a loop over arrays
		 * reloaded every pointer from *in per candidate, and a 16-byte vector load of four
		 * 4-byte stores missed store forwarding: 1024 candidates ran slower than scalar).
		 */
#define LOAD(j)                                                                                    \
	size_t w##j = 2 * (size_t)slot[i + (j)];                                                   \
	uint64_t p##j = __atomic_load_n(&booked[w##j], __ATOMIC_ACQUIRE);                          \
	p##j += __atomic_load_n(&prov[w##j], __ATOMIC_RELAXED);                                    \
	uint64_t d##j = __atomic_load_n(&booked[w##j + 1], __ATOMIC_ACQUIRE);                      \
	d##j += __atomic_load_n(&prov[w##j + 1], __ATOMIC_RELAXED) + foot - pinned[w##j / 2];      \
	uint32_t o##j = overlap[w##j / 2]
		LOAD(0);
		LOAD(1);
		LOAD(2);
		LOAD(3);
#undef LOAD
		__m256i P =
		    _mm256_set_epi64x((long long)p3, (long long)p2, (long long)p1, (long long)p0);
		__m256i D =
		    _mm256_set_epi64x((long long)d3, (long long)d2, (long long)d1, (long long)d0);
		__m256d x;
		if (_mm256_testz_si256(_mm256_or_si256(P, D), _mm256_set1_epi64x(-(1ll << 52)))) {
			__m256d t = _mm256_add_pd(exact_pd(P), prompt);
			t = k->pow2 ? _mm256_mul_pd(t, inv) : _mm256_div_pd(t, bs);
			__m256i O = _mm256_set_epi64x(o3, o2, o1, o0);
			__m256d pre = _mm256_sub_pd(t, _mm256_mul_pd(credit, exact_pd(O)));
			x = _mm256_add_pd(_mm256_mul_pd(scale, pre), exact_pd(D));
		} else { /* an integer at or past 2^52: the scalar conversions, same result */
			x = _mm256_set_pd(
			    kvr_select_cost_of(k, p3, o3, d3), kvr_select_cost_of(k, p2, o2, d2),
			    kvr_select_cost_of(k, p1, o1, d1), kvr_select_cost_of(k, p0, o0, d0));
		}
		_mm256_storeu_pd(cost + i, x);
		/* min(x, lo): a NaN x leaves lo (MINPD returns the second operand), as x < lo
		 * ignores it; likewise max. */
		lo4 = _mm256_min_pd(x, lo4);
		hi4 = _mm256_max_pd(x, hi4);
	}
	double l[4], h[4];
	_mm256_storeu_pd(l, lo4);
	_mm256_storeu_pd(h, hi4);
	double lo = l[0], hi = h[0];
	for (int j = 1; j < 4; j++) {
		lo = l[j] < lo ? l[j] : lo;
		hi = h[j] > hi ? h[j] : hi;
	}
	for (size_t t = i; t < n; t++) {
		double x = cost[t] = score_one(k, in, slot[t]);
		lo = x < lo ? x : lo;
		hi = x > hi ? x : hi;
	}
	/* The first minimum and the ties.  The scalar scan never moves first while lo is still
	 * +inf (an +inf cost only counts as a tie of the initial lo), so neither does this. */
	size_t first = SIZE_MAX, ties = 0;
	const __m256d lov = _mm256_set1_pd(lo);
	for (i = 0; i + 4 <= n; i += 4) {
		unsigned m = (unsigned)_mm256_movemask_pd(
		    _mm256_cmp_pd(_mm256_loadu_pd(cost + i), lov, _CMP_EQ_OQ));
		ties += (size_t)__builtin_popcount(m);
		if (m && first == SIZE_MAX)
			first = i + (size_t)__builtin_ctz(m);
	}
	for (; i < n; i++) {
		if (cost[i] == lo) {
			ties++;
			first = first == SIZE_MAX ? i : first;
		}
	}
	scan->lo = lo;
	scan->hi = hi;
	scan->first = first == SIZE_MAX || lo == INFINITY ? 0 : first;
	scan->ties = ties;
}

static int have_avx2(void)
{
	static int have = -1; /* racing first calls compute the same answer */
	int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
	if (h < 0) {
		__builtin_cpu_init();
		h = __builtin_cpu_supports("avx2") ? 1 : 0;
		__atomic_store_n(&have, h, __ATOMIC_RELAXED);
	}
	return h;
}
#endif

void kvr_select_score(enum kvr_select_impl impl, const struct kvr_select_params *p,
                      const struct kvr_select_inputs *in, const uint32_t *slot, size_t n,
                      double *cost, struct kvr_select_scan *scan)
{
	const struct kvr_select_coef k = kvr_select_coef_of(p);
#ifdef HAVE_AVX2_PATH
	if (impl != KVR_SELECT_SCALAR && have_avx2()) {
		score_avx2(&k, in, slot, n, cost, scan);
		return;
	}
#else
	(void)impl;
#endif
	score_scalar(&k, in, slot, n, cost, scan);
}

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
