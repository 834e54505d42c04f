/*
 * tools/replay/policy_basic.c - the baselines kvr-replay measures the router against.
 *
 *  - round_robin: rank = arrivals mod ranks.  What a plain L4 balancer does.
 *  - random: uniform rank from a SplitMix64 stream seeded by --seed (same seed, same picks).
 *  - least_loaded: the rank with the fewest outstanding tokens, as the policy counts them from
 *    what a frontend sees: routing adds prompt + output tokens; the first token removes the
 *    prompt (prefill done); each output token batch removes its tokens; finish or abort
 *    removes what is left.  Ties go to the lowest rank.  Blind to caching, like a "least
 *    outstanding requests" balancer with token weights.
 * None predicts overlap.  The handle is the request id; per-request state lives in an array
 * indexed by it (grown on demand).
 */
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "tools/replay/policy.h"

struct basic {
	struct replay_env env;
	uint64_t next;     /* round_robin counter */
	uint64_t rng;      /* random state */
	uint64_t *load;    /* least_loaded: outstanding tokens per rank */
	uint32_t *rank_of; /* per request id */
	uint64_t *left;    /* per request id: outstanding tokens */
	uint32_t *prompt;  /* per request id: prompt tokens not yet prefilled */
	size_t cap;
};

static uint64_t splitmix(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static int basic_create(const struct replay_env *env, void **state)
{
	if (!env || !state || env->n_ranks == 0)
		return KVR_EINVAL;
	struct basic *b = calloc(1, sizeof(*b));
	if (!b)
		return KVR_ENOMEM;
	b->env = *env;
	b->rng = env->seed;
	b->load = calloc(env->n_ranks, sizeof(*b->load));
	if (!b->load) {
		free(b);
		return KVR_ENOMEM;
	}
	*state = b;
	return 0;
}

static void basic_destroy(void *state)
{
	struct basic *b = state;
	if (!b)
		return;
	free(b->load);
	free(b->rank_of);
	free(b->left);
	free(b->prompt);
	free(b);
}

static int rr_route(void *state, const struct replay_route_req *q, struct replay_route_out *out)
{
	struct basic *b = state;
	out->rank = (uint32_t)(b->next++ % b->env.n_ranks);
	out->predicted_blocks = 0;
	out->handle = q->id;
	return 0;
}

static int random_route(void *state, const struct replay_route_req *q, struct replay_route_out *out)
{
	struct basic *b = state;
	/* Multiply-shift: unbiased enough for a handful of ranks, and deterministic. */
	out->rank = (uint32_t)(((unsigned __int128)splitmix(&b->rng) * b->env.n_ranks) >> 64);
	out->predicted_blocks = 0;
	out->handle = q->id;
	return 0;
}

/* Makes room for request id in the per-request arrays. */
static int grow(struct basic *b, uint64_t id)
{
	if (id < b->cap)
		return 0;
	size_t nc = b->cap ? b->cap : 1024;
	while (nc <= id)
		nc *= 2;
	uint32_t *r = realloc(b->rank_of, nc * sizeof(*r));
	if (!r)
		return KVR_ENOMEM;
	b->rank_of = r;
	uint64_t *l = realloc(b->left, nc * sizeof(*l));
	if (!l)
		return KVR_ENOMEM;
	b->left = l;
	uint32_t *p = realloc(b->prompt, nc * sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	b->prompt = p;
	memset(b->left + b->cap, 0, (nc - b->cap) * sizeof(*l));
	memset(b->prompt + b->cap, 0, (nc - b->cap) * sizeof(*p));
	b->cap = nc;
	return 0;
}

static int ll_route(void *state, const struct replay_route_req *q, struct replay_route_out *out)
{
	struct basic *b = state;
	int rc = grow(b, q->id);
	if (rc)
		return rc;
	uint32_t best = 0;
	for (uint32_t i = 1; i < b->env.n_ranks; i++)
		if (b->load[i] < b->load[best])
			best = i;
	uint64_t add = (uint64_t)q->n_tokens + q->output_len;
	b->load[best] += add;
	b->rank_of[q->id] = best;
	b->left[q->id] = add;
	b->prompt[q->id] = q->n_tokens;
	out->rank = best;
	out->predicted_blocks = 0;
	out->handle = q->id;
	return 0;
}

/* Removes up to n outstanding tokens of request id from its rank. */
static void take(struct basic *b, uint64_t id, uint64_t n)
{
	if (id >= b->cap)
		return;
	if (n > b->left[id])
		n = b->left[id];
	b->left[id] -= n;
	b->load[b->rank_of[id]] -= n;
}

static int ll_first_token(void *state, uint64_t handle, uint32_t rank, uint64_t time_ns)
{
	(void)rank;
	(void)time_ns;
	struct basic *b = state;
	if (handle >= b->cap)
		return KVR_ENOENT;
	take(b, handle, b->prompt[handle]);
	b->prompt[handle] = 0;
	return 0;
}

static int ll_output(void *state, uint64_t handle, const uint32_t *tokens, size_t n, bool final)
{
	(void)tokens;
	(void) final;
	take(state, handle, n);
	return 0;
}

static int ll_finished(void *state, uint64_t handle, const struct sim_finish_info *info)
{
	(void)info;
	take(state, handle, UINT64_MAX);
	return 0;
}

static int ll_aborted(void *state, uint64_t handle)
{
	take(state, handle, UINT64_MAX);
	return 0;
}

const struct replay_policy_ops replay_policy_round_robin = {
    .name = "round_robin",
    .create = basic_create,
    .destroy = basic_destroy,
    .route = rr_route,
};

const struct replay_policy_ops replay_policy_random = {
    .name = "random",
    .create = basic_create,
    .destroy = basic_destroy,
    .route = random_route,
};

const struct replay_policy_ops replay_policy_least_loaded = {
    .name = "least_loaded",
    .create = basic_create,
    .destroy = basic_destroy,
    .route = ll_route,
    .first_token = ll_first_token,
    .output = ll_output,
    .finished = ll_finished,
    .aborted = ll_aborted,
};
