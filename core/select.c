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
 * stage at 1024 ranks went from 2.0-2.6 us to 1.8 us (bench_route --ranks 1024).
 *
 * Most of those instructions were the inputs' gathering: six scalar loads a candidate and the
 * inserts that build vectors from them (callgrind, bench_route at 2k tokens, 64 ranks: 2,026
 * instructions a decision, ~32 a candidate, and it was instruction-bound: ~110 ns of the ~620 ns
 * the route spends beyond hashing, timed per stage with rdtsc).  A live list of ranks added in
 * order is runs of consecutive slots, and four consecutive slots' load words are 64 consecutive
 * bytes in each array: run4 recognises such a group with one vector compare, and load_run4 reads
 * it with two vector loads per array, two unpacks and two permutes (the order of the scalar
 * path's candidates).  Groups of any other shape take the scalar gather.  1,097 instructions a
 * decision (~12.5 a candidate and the tie pass), the stage ~40 ns faster.
 */
#include "core/cpu.h"
#include "core/select.h"

#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#endif

/* ThreadSanitizer sees the load words only through the scalar atomic loads (gcc says so with
 * __SANITIZE_THREAD__, clang with __has_feature): no vector loads of them (see run4). */
#if defined(__SANITIZE_THREAD__)
#define SELECT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SELECT_TSAN 1
#endif
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

/*
 * Whether candidates slot[0..4) are four consecutive slots s, s+1, s+2, s+3: a live list of
 * ranks added in order is one such run, and then the four ranks' load words are 64 consecutive
 * bytes in each array, read with two vector loads per array instead of eight scalar loads and
 * the inserts that build vectors from them (the scoring's instructions at 64 ranks went from
 * ~32 to ~12 a candidate).  A vector load is not a C11 atomic load: on x86-64 each aligned
 * 8-byte element of it is read whole (single-copy atomic, as a MOV of it is), which is what the
 * scalar path's atomic loads give, and the ordering is kept (load_run4 says how).  Not under
 * ThreadSanitizer, which could not see the pairing with the shards' release stores.
 */
__attribute__((target("avx2"))) static inline bool run4(const uint32_t *slot)
{
#ifdef SELECT_TSAN
	(void)slot;
	return false;
#else
	__m128i v = _mm_loadu_si128((const __m128i *)(const void *)slot);
	__m128i d = _mm_sub_epi32(v, _mm_set1_epi32((int)slot[0]));
	return _mm_movemask_epi8(_mm_cmpeq_epi32(d, _mm_setr_epi32(0, 1, 2, 3))) == 0xFFFF;
#endif
}

/* Whether the candidates slot[0..n) are ALL one run of consecutive slots (the live list of
 * ranks added in order): then no group of four is asked run4, eight slots checked per compare
 * instead of four per run4 and its branch (~6 instructions a group at 64 ranks).  Not under
 * ThreadSanitizer (see run4). */
__attribute__((target("avx2"))) static inline bool all_run(const uint32_t *slot, size_t n)
{
#ifdef SELECT_TSAN
	(void)slot;
	(void)n;
	return false;
#else
	if (n == 0)
		return false;
	const uint32_t s0 = slot[0];
	__m256i want =
	    _mm256_add_epi32(_mm256_set1_epi32((int)s0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
	const __m256i step = _mm256_set1_epi32(8);
	__m256i bad = _mm256_setzero_si256();
	size_t i = 0;
	for (; i + 8 <= n; i += 8) {
		__m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(slot + i));
		bad = _mm256_or_si256(bad, _mm256_xor_si256(v, want));
		want = _mm256_add_epi32(want, step);
	}
	bool ok = _mm256_testz_si256(bad, bad);
	for (; ok && i < n; i++)
		ok = slot[i] == s0 + (uint32_t)i;
	return ok;
#endif
}

/* Candidates slot[0..4)'s prefill tokens, decode blocks and overlaps into v[0], v[1], v[2], read
 * with the scalar path's atomic loads (slots in any order).  Not inlined: the loop keeps its
 * registers for the runs of consecutive slots, the common case. */
__attribute__((target("avx2"), noinline)) static void gather4(const struct kvr_select_inputs *in,
                                                              const uint32_t *slot, __m256i v[3])
{
	const uint64_t *booked = in->booked, *prov = in->prov;
	const uint32_t *overlap = in->overlap, *pinned = in->pinned;
	const uint64_t foot = in->foot;
	/* Unrolled by hand into scalars: the inputs stay in registers (a loop over arrays
	 * reloaded every pointer from *in per candidate). */
#define LOAD(j)                                                                                    \
	size_t w##j = 2 * (size_t)slot[j];                                                         \
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
	v[0] = _mm256_set_epi64x((long long)p3, (long long)p2, (long long)p1, (long long)p0);
	v[1] = _mm256_set_epi64x((long long)d3, (long long)d2, (long long)d1, (long long)d0);
	v[2] = _mm256_set_epi64x(o3, o2, o1, o0);
}

/* The costs of four candidates whose integers reach 2^52, with the scalar conversions (rare:
 * not inlined, so the loop keeps its registers). */
__attribute__((target("avx2"), noinline)) static __m256d
cost4_scalar(const struct kvr_select_coef *k, __m256i P, __m256i D, __m256i O)
{
	uint64_t p[4], d[4], o[4];
	_mm256_storeu_si256((__m256i *)(void *)p, P);
	_mm256_storeu_si256((__m256i *)(void *)d, D);
	_mm256_storeu_si256((__m256i *)(void *)o, O);
	return _mm256_set_pd(kvr_select_cost_of(k, p[3], (uint32_t)o[3], d[3]),
	                     kvr_select_cost_of(k, p[2], (uint32_t)o[2], d[2]),
	                     kvr_select_cost_of(k, p[1], (uint32_t)o[1], d[1]),
	                     kvr_select_cost_of(k, p[0], (uint32_t)o[0], d[0]));
}

/* Slots s..s+3's prefill tokens, decode blocks and overlaps: their load words are 64 consecutive
 * bytes in each array (see run4). */
__attribute__((target("avx2"), always_inline)) static inline void
load_run4(const struct kvr_select_inputs *in, size_t s, __m256i footv, __m256i *P, __m256i *D,
          __m256i *O)
{
	const __m256i *bw = (const __m256i *)(const void *)(in->booked + 2 * s);
	const __m256i *pw = (const __m256i *)(const void *)(in->prov + 2 * s);
	const uint32_t *overlap = in->overlap + s, *pinned = in->pinned + s;
	__m256i b01 = _mm256_loadu_si256(bw), b23 = _mm256_loadu_si256(bw + 1);
	/* Ordering: every booked word before any prov word (the scalar path's acquire per word).
	 * x86 does not reorder loads with loads, so keeping the compiler from it is all this
	 * needs: the prov address comes out of an empty asm that takes the booked words in (a
	 * dependency, not a memory clobber, which would reload every pointer from the stack). */
	__asm__("" : "+r"(pw) : "x"(b01), "x"(b23));
	__m256i s01 = _mm256_add_epi64(b01, _mm256_loadu_si256(pw));
	__m256i s23 = _mm256_add_epi64(b23, _mm256_loadu_si256(pw + 1));
	/* [p0 d0 p1 d1] [p2 d2 p3 d3] -> [p0 p2 p1 p3], [d0 d2 d1 d3] -> in order */
	*P = _mm256_permute4x64_epi64(_mm256_unpacklo_epi64(s01, s23), 0xD8);
	__m256i d = _mm256_permute4x64_epi64(_mm256_unpackhi_epi64(s01, s23), 0xD8);
	*O = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(const void *)overlap));
	__m256i pin = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(const void *)pinned));
	*D = _mm256_sub_epi64(_mm256_add_epi64(d, footv), pin);
}

/* The cost's constants, broadcast. */
struct vcoef {
	__m256d prompt, inv, bs, credit, scale;
	bool pow2;
};

/* Four candidates' costs, the scalar expression operation for operation (all integers below
 * 2^52). */
__attribute__((target("avx2"), always_inline)) static inline __m256d
cost4(const struct vcoef *c, __m256i P, __m256i D, __m256i O)
{
	__m256d t = _mm256_add_pd(exact_pd(P), c->prompt);
	t = c->pow2 ? _mm256_mul_pd(t, c->inv) : _mm256_div_pd(t, c->bs);
	__m256d pre = _mm256_sub_pd(t, _mm256_mul_pd(c->credit, exact_pd(O)));
	return _mm256_add_pd(_mm256_mul_pd(c->scale, pre), exact_pd(D));
}

/* Slots s..s+3 (a run): their costs into cost[0..4) and the running minimum and maximum, unless
 * an integer reaches 2^52 (then false, nothing written: the general loop takes the group). */
__attribute__((target("avx2"), always_inline)) static inline bool
fast4(const struct vcoef *c, const struct kvr_select_inputs *in, size_t s, __m256i footv,
      __m256i big, double *cost, __m256d *lo4, __m256d *hi4)
{
	__m256i P, D, O;
	load_run4(in, s, footv, &P, &D, &O);
	if (!_mm256_testz_si256(_mm256_or_si256(P, D), big))
		return false;
	__m256d x = cost4(c, P, D, O);
	_mm256_storeu_pd(cost, x);
	/* min(x, lo): a NaN x leaves lo (MINPD returns the second operand), as x < lo ignores
	 * it; likewise max. */
	*lo4 = _mm256_min_pd(x, *lo4);
	*hi4 = _mm256_max_pd(x, *hi4);
	return true;
}

__attribute__((target("avx2"))) static void score_avx2(const struct kvr_select_coef *k,
                                                       const struct kvr_select_inputs *in,
                                                       const uint32_t *slot, size_t n, double *cost,
                                                       struct kvr_select_scan *scan)
{
	const struct vcoef c = {.prompt = _mm256_set1_pd(k->prompt),
	                        .inv = _mm256_set1_pd(k->inv_bs),
	                        .bs = _mm256_set1_pd(k->bs),
	                        .credit = _mm256_set1_pd(k->credit),
	                        .scale = _mm256_set1_pd(k->scale),
	                        .pow2 = k->pow2};
	const struct kvr_select_inputs inl = *in; /* a copy the stores to cost[] cannot alias */
	in = &inl;
	const __m256i footv = _mm256_set1_epi64x((long long)in->foot),
	              big = _mm256_set1_epi64x(-(1ll << 52));
	__m256d lo4 = _mm256_set1_pd(INFINITY), hi4 = _mm256_set1_pd(-INFINITY);
	size_t i = 0;
	/* Runs of consecutive slots whose integers are below 2^52 (the common case): no call in
	 * this loop, so its constants and the running minimum and maximum stay in registers
	 * (calls clobber every vector register).  A group that is neither ends it. */
	if (all_run(slot, n)) {
		const size_t s0 = slot[0];
		for (; i + 4 <= n; i += 4)
			if (!fast4(&c, in, s0 + i, footv, big, cost + i, &lo4, &hi4))
				break;
	} else {
		for (; i + 4 <= n && run4(slot + i); i += 4)
			if (!fast4(&c, in, slot[i], footv, big, cost + i, &lo4, &hi4))
				break;
	}
	/* The rest: groups in any order, integers of any size. */
	for (; i + 4 <= n; i += 4) {
		__m256i P, D, O;
		if (run4(slot + i)) {
			load_run4(in, slot[i], footv, &P, &D, &O);
		} else {
			__m256i v[3];
			gather4(in, slot + i, v);
			P = v[0];
			D = v[1];
			O = v[2];
		}
		__m256d x;
		if (_mm256_testz_si256(_mm256_or_si256(P, D), big))
			x = cost4(&c, P, D, O);
		else /* an integer at or past 2^52: the scalar conversions, same result */
			x = cost4_scalar(k, P, D, O);
		_mm256_storeu_pd(cost + i, x);
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
		/* Branch-free (a conditional move): where the first minimum falls is data, and
		 * its branch was mispredicted about once a decision. */
		size_t at = m ? i + (size_t)__builtin_ctz(m) : SIZE_MAX;
		first = at < first ? at : first;
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

#endif

void kvr_select_score(enum kvr_select_impl impl, const struct kvr_select_params *p,
                      const struct kvr_select_inputs *in, const uint32_t *slot, size_t n,
                      double *cost, struct kvr_select_scan *scan)
{
	const struct kvr_select_coef k = kvr_select_coef_of(p);
#ifdef HAVE_AVX2_PATH
	if (impl != KVR_SELECT_SCALAR && kvr_cpu_has_avx2()) {
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
	/* A temperature so small that 1 / (range x temperature) overflows is the argmin's limit:
	 * computed, the best rank's weight was NaN (inf x 0), and so the total, and the first
	 * candidate was picked whatever its cost. */
	double inv =
	    p->temperature > 0.0 && range > 0.0 ? 1.0 / (range * p->temperature) : INFINITY;
	if (!(inv < INFINITY)) {
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
	double total = 0.0;
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
