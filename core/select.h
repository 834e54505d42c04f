/*
 * core/select.h - the selector: scores every candidate rank by predicted cache overlap and load,
 * and picks one.
 *
 * Cost per candidate (lower is better), as in NVIDIA Dynamo's KV router:
 *   cost = prefill_load_scale * ((active_prefill_tokens + prompt_tokens) / block_size
 *                                - overlap_credit * overlap_blocks)
 *          + potential_decode_blocks
 * With credit 1 the first term is the rank's potential prefill in blocks: what it is already
 * prefilling plus the part of this prompt it does not hold.
 *
 * Temperature 0: argmin, ties broken uniformly at random (reservoir sampling over the tied set).
 * Temperature t > 0: softmax over the negated costs normalised to [0, 1] by the cost range, so
 * t means the same thing whatever the absolute load; p_i ~ exp(-(c_i - min) / (range * t)).
 * Randomness comes from the caller's 64-bit state (splitmix64), so a router seeded the same way
 * and called in the same order decides the same way.
 *
 * Shape, for the routing fast path (64 or 1024 candidates per decision): the caller computes
 * each candidate's cost with the inline kvr_select_cost_of straight from its own arrays (no
 * candidate structs), feeds it to a running scan (minimum, its first index, ties, maximum),
 * keeps the costs in an array, and kvr_select_pick chooses from the scan and that array.  The
 * cost is computed in the same order of operations whatever the path, so the same inputs give
 * bit-identical costs and the same ties.
 */
#ifndef KVR_CORE_SELECT_H
#define KVR_CORE_SELECT_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_select_params {
	double overlap_credit;
	double prefill_load_scale;
	double temperature;
	uint32_t block_size;
	uint64_t prompt_tokens;
};

/* splitmix64 step: advances *state, returns 64 random bits. */
static inline uint64_t kvr_rand64(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform double in [0, 1). */
static inline double kvr_rand_unit(uint64_t *state)
{
	return (double)(kvr_rand64(state) >> 11) * (1.0 / 9007199254740992.0);
}

/* No contraction into fused multiply-adds in the cost, whatever -march says: every path (the
 * scalar one, the AVX2 one, a caller's own) must round each operation as the formula is
 * written, or the same inputs could cost different doubles and tie differently. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* The cost's per-decision constants (kvr_select_coef_of), so a loop over candidates converts and
 * divides nothing that does not change. */
struct kvr_select_coef {
	double prompt; /* prompt tokens */
	double bs;     /* block size */
	double inv_bs; /* 1 / block size, exact when pow2 */
	double credit; /* overlap credit */
	double scale;  /* prefill load scale */
	bool pow2;     /* power-of-two block size: multiply by inv_bs */
};

static inline struct kvr_select_coef kvr_select_coef_of(const struct kvr_select_params *p)
{
	uint32_t b = p->block_size;
	return (struct kvr_select_coef){.prompt = (double)p->prompt_tokens,
	                                .bs = (double)b,
	                                .inv_bs = 1.0 / (double)b,
	                                /* No prefill weight, no credit: 0 x (t - inf) was NaN
	                                 * for a credit whose product overflows, and the scan
	                                 * passed such a rank over. */
	                                .credit =
	                                    p->prefill_load_scale != 0.0 ? p->overlap_credit : 0.0,
	                                .scale = p->prefill_load_scale,
	                                .pow2 = (b & (b - 1)) == 0};
}

/*
 * Cost of one candidate (see the essay above): prefill_tokens the rank's current prefill load,
 * overlap_blocks its predicted cached prefix of the prompt, decode_blocks its active blocks plus
 * this request's blocks not already pinned there.  A power-of-two block size divides by
 * multiplying with its reciprocal (exact: the same double as the division; a division per
 * candidate was a third of the scoring time at 64 candidates).  Context: any thread.
 */
static inline double kvr_select_cost_of(const struct kvr_select_coef *k, uint64_t prefill_tokens,
                                        uint32_t overlap_blocks, uint64_t decode_blocks)
{
	double t = (double)prefill_tokens + k->prompt;
	t = k->pow2 ? t * k->inv_bs : t / k->bs;
	double prefill = t - k->credit * (double)overlap_blocks;
	return k->scale * prefill + (double)decode_blocks;
}

static inline double kvr_select_cost(const struct kvr_select_params *p, uint64_t prefill_tokens,
                                     uint32_t overlap_blocks, uint64_t decode_blocks)
{
	struct kvr_select_coef k = kvr_select_coef_of(p);
	return kvr_select_cost_of(&k, prefill_tokens, overlap_blocks, decode_blocks);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#elif defined(__clang__)
#pragma STDC FP_CONTRACT DEFAULT
#endif

/* The running scan over the costs, in candidate order. */
struct kvr_select_scan {
	double lo, hi; /* minimum and maximum cost so far */
	size_t first;  /* index of the first minimum */
	size_t ties;   /* candidates whose cost equals lo */
};

static inline void kvr_select_scan_init(struct kvr_select_scan *s)
{
	s->lo = INFINITY;
	s->hi = -INFINITY;
	s->first = 0;
	s->ties = 0;
}

/* Candidate i (the next one, in order) costs x. */
static inline void kvr_select_scan_add(struct kvr_select_scan *s, size_t i, double x)
{
	if (x < s->lo) {
		s->lo = x;
		s->first = i;
		s->ties = 1;
	} else if (x == s->lo) {
		s->ties++;
	}
	if (x > s->hi)
		s->hi = x;
}

/*
 * The cost inputs of every rank, by slot (borrowed arrays): for slot s, booked[2s] and prov[2s]
 * are its prefill tokens, booked[2s+1] and prov[2s+1] its decode blocks (a rank's load is the
 * sum: the booked word its shard writes plus the provisional word routing threads add to, read
 * booked first with acquire, see shards/owner.h), overlap[s] its cached depth of the prompt and
 * pinned[s] the prompt blocks already pinned there.  foot: the request's decode footprint in
 * blocks, so a rank's decode blocks are its load's + foot - pinned[s].
 */
struct kvr_select_inputs {
	const uint64_t *booked, *prov;
	const uint32_t *overlap, *pinned;
	uint64_t foot;
};

enum kvr_select_impl {
	KVR_SELECT_AUTO = 0,   /* the fastest this CPU runs */
	KVR_SELECT_SCALAR = 1, /* one candidate at a time */
	KVR_SELECT_AVX2 = 2,   /* four at a time (x86-64 with AVX2; else the scalar one) */
};

/*
 * Scores the candidates slot[0..n) (borrowed): cost[i] (caller's array, n entries) is
 * kvr_select_cost of candidate i's inputs, and *scan the scan of cost[0..n) in order, ready for
 * kvr_select_pick.  Every implementation gives bit-identical costs and scan (the same operations
 * in the same order on each candidate; AVX2 takes the scalar path for four candidates whose
 * integers reach 2^52, where its exact conversion stops).  Context: any thread, inside the
 * read section that keeps the arrays alive; no allocation.
 */
void kvr_select_score(enum kvr_select_impl impl, const struct kvr_select_params *p,
                      const struct kvr_select_inputs *in, const uint32_t *slot, size_t n,
                      double *cost, struct kvr_select_scan *scan);

/*
 * Chooses among n candidates whose costs are cost[0..n) (borrowed) and were scanned, in order,
 * into s.  Returns the chosen index, or -1 when n == 0.  rng: the caller's random state
 * (advanced only when a random choice is made).  Context: any thread; no allocation.
 */
long kvr_select_pick(const struct kvr_select_params *p, const double *cost, size_t n,
                     const struct kvr_select_scan *s, uint64_t *rng);

#endif
