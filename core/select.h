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
 */
#ifndef KVR_CORE_SELECT_H
#define KVR_CORE_SELECT_H

#include <stddef.h>
#include <stdint.h>

struct kvr_candidate {
	uint32_t slot;                  /* the rank's index slot */
	uint32_t overlap_blocks;        /* predicted cached prefix blocks on this rank */
	uint64_t active_prefill_tokens; /* the rank's current prefill load */
	uint64_t
	    potential_decode_blocks; /* active blocks + this request's blocks not pinned there */
	double cost;                 /* out: filled by kvr_select */
	uint64_t gen;                /* the slot generation when read (not used by the selector) */
};

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

/* Cost of one candidate (see the essay above). */
double kvr_select_cost(const struct kvr_select_params *p, const struct kvr_candidate *c);

/*
 * Computes every candidate's cost and returns the index (into c[]) of the chosen one, or -1 when
 * n == 0.  rng: the caller's random state (advanced).  Context: any thread; no allocation.
 */
long kvr_select(const struct kvr_select_params *p, struct kvr_candidate *c, size_t n,
                uint64_t *rng);

#endif
