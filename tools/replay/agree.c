/*
 * tools/replay/agree.c - prediction agreement (see agree.h): Jaccard of the simulator's cached
 * set S and the policy's predicted set R per rank.  With the policy's exact set (blocks()) the
 * two sorted lists are merged.  Without it, |S n R| counts the blocks of S whose whole prefix
 * the policy predicts: one predict() per chain leaf of S (a block of S that is no other block's
 * parent), the chain rebuilt root-first from the replay's chain map; a block the policy holds
 * without its parent is not counted, so this is a lower bound.
 */
#include "tools/replay/agree.h"

#include <stdbool.h>
#include <stdlib.h>

#include "kvrouter.h"
#include "tools/sim/block_pool.h"

/* What one sample reads. */
struct agree_src {
	struct sim_cluster *sim;
	const struct replay_policy_ops *ops;
	void *ps;
	struct replay_chains *map;
	struct replay_result *res;
};

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return (x > y) - (x < y);
}

static bool in_sorted(const uint64_t *s, size_t n, uint64_t h)
{
	return bsearch(&h, s, n, sizeof(*s), cmp_u64) != NULL;
}

static void agree_record(struct replay_result *res, uint64_t n, uint64_t pred, uint64_t inter)
{
	uint64_t uni = n + pred - (inter < pred ? inter : pred);
	double j = uni ? (double)inter / (double)uni : 1.0;
	res->agree_samples++;
	res->agree_exact += inter == n && pred == n;
	res->agree_subset += inter == n;
	res->jaccard_mean += j;
	if (j < res->jaccard_min)
		res->jaccard_min = j;
	res->sim_cached_sum += n;
	res->pred_resident_sum += pred;
	res->agree_inter_sum += inter < pred ? inter : pred;
}

/* Exact agreement from the policy's predicted set: |sim|, |pred| and |sim & pred|. */
static int agree_rank_exact(const struct agree_src *src, uint32_t rank)
{
	size_t n = sim_cluster_cached_hashes(src->sim, rank, NULL, 0), np = 0;
	uint64_t *s = malloc((n + 1) * sizeof(*s)), *pred = NULL;
	if (!s)
		return KVR_ENOMEM;
	n = sim_cluster_cached_hashes(src->sim, rank, s, n);
	int rc = src->ops->blocks(src->ps, rank, &pred, &np);
	if (rc) {
		free(s);
		return rc;
	}
	qsort(s, n, sizeof(*s), cmp_u64);
	if (np) /* pred may be NULL when empty: qsort's pointer must not be (UBSan) */
		qsort(pred, np, sizeof(*pred), cmp_u64);
	uint64_t inter = 0;
	for (size_t i = 0, k = 0; i < n && k < np;) {
		if (s[i] == pred[k]) {
			inter++;
			i++;
			k++;
		} else if (s[i] < pred[k]) {
			i++;
		} else {
			k++;
		}
	}
	agree_record(src->res, n, np, inter);
	free(s);
	free(pred);
	return 0;
}

/* One agreement sample of one rank; returns 0 or an error. */
static int agree_rank(const struct agree_src *src, uint32_t rank)
{
	if (src->ops->blocks)
		return agree_rank_exact(src, rank);
	size_t n = sim_cluster_cached_hashes(src->sim, rank, NULL, 0);
	uint64_t *s = malloc((n + 1) * sizeof(*s)), *par = malloc((n + 1) * sizeof(*par));
	uint8_t *held = calloc(n + 1, 1);
	uint64_t *chain = NULL, *local = NULL;
	size_t ccap = 0;
	int rc = KVR_ENOMEM;
	if (!s || !par || !held)
		goto out;
	n = sim_cluster_cached_hashes(src->sim, rank, s, n);
	qsort(s, n, sizeof(*s), cmp_u64);
	size_t np = 0;
	for (size_t i = 0; i < n; i++) {
		const struct replay_chain_ent *e = replay_chains_get(src->map, s[i]);
		if (e && e->parent)
			par[np++] = e->parent;
	}
	qsort(par, np, sizeof(*par), cmp_u64);
	for (size_t i = 0; i < n; i++) {
		if (in_sorted(par, np, s[i]))
			continue; /* not a leaf */
		size_t d = 0;
		for (const struct replay_chain_ent *e = replay_chains_get(src->map, s[i]); e;
		     e = e->parent ? replay_chains_get(src->map, e->parent) : NULL) {
			if (d == ccap) {
				ccap = ccap ? ccap * 2 : 256;
				uint64_t *nc = realloc(chain, ccap * sizeof(*nc));
				uint64_t *nl = realloc(local, ccap * sizeof(*nl));
				if (nc)
					chain = nc;
				if (nl)
					local = nl;
				if (!nc || !nl)
					goto out;
			}
			chain[d] = e->seq;
			local[d] = e->local;
			d++;
		}
		/* Reverse to root-first. */
		for (size_t a = 0, b = d; a + 1 < b; a++, b--) {
			uint64_t t = chain[a];
			chain[a] = chain[b - 1];
			chain[b - 1] = t;
			t = local[a];
			local[a] = local[b - 1];
			local[b - 1] = t;
		}
		uint32_t o = 0;
		if (d) {
			rc = src->ops->predict(src->ps, rank, local, d, &o);
			if (rc)
				goto out;
		}
		for (size_t j = 0; j < o && j < d; j++) {
			uint64_t *hit = bsearch(&chain[j], s, n, sizeof(*s), cmp_u64);
			if (hit)
				held[hit - s] = 1;
		}
	}
	uint64_t inter = 0, pred = 0;
	for (size_t i = 0; i < n; i++)
		inter += held[i];
	rc = src->ops->resident(src->ps, rank, &pred);
	if (rc)
		goto out;
	agree_record(src->res, n, pred, inter);
	rc = 0;
out:
	free(s);
	free(par);
	free(held);
	free(chain);
	free(local);
	return rc;
}

int replay_agree(struct sim_cluster *sim, const struct replay_policy_ops *ops, void *ps,
                 struct replay_chains *map, uint32_t n_ranks, struct replay_result *res)
{
	const struct agree_src src = {sim, ops, ps, map, res};
	if (ops->sync) {
		int rc = ops->sync(ps, sim_cluster_now(sim));
		if (rc)
			return rc;
	}
	for (uint32_t r = 0; r < n_ranks; r++) {
		int rc = agree_rank(&src, r);
		if (rc)
			return rc;
	}
	return 0;
}

int replay_reach(struct sim_cluster *sim, uint32_t n_ranks, const uint32_t *tokens,
                 uint32_t n_tokens, uint32_t block_size, uint32_t rank, uint64_t *chosen,
                 uint64_t *best)
{
	size_t nb = n_tokens / block_size;
	uint64_t *h = malloc((2 * nb + 1) * sizeof(*h));
	if (!h)
		return KVR_ENOMEM;
	nb = kvr_hash_blocks(tokens, n_tokens, block_size, NULL, h + nb, h);
	*chosen = *best = 0;
	for (uint32_t r = 0; r < n_ranks; r++) {
		const struct sim_pool *pool = sim_engine_pool(sim_cluster_engine(sim, r));
		uint64_t m = sim_pool_match_prefix(pool, h, nb, NULL);
		if (r == rank)
			*chosen = m;
		if (m > *best)
			*best = m;
	}
	free(h);
	return 0;
}
