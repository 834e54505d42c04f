/*
 * tools/replay/decisions.c - kvr-replay --decisions FILE (see decisions.h).
 *
 * Tracing costs a prediction query per rank per decision and two copies of a rank's predicted
 * blocks per healing report, so it is off unless asked for; the routing itself is unchanged
 * (query-only decisions draw no random numbers, so the run makes the same choices).
 */
#include "tools/replay/decisions.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvrouter.h"
#include "tools/sim/block_pool.h"

/* Runs of one kvr-replay (--jobs) append to one file. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int replay_decisions_route(const char *path, const struct replay_policy_ops *ops, void *ps,
                           struct sim_cluster *sim, uint32_t n_ranks, uint64_t seed, size_t request,
                           uint32_t rank, uint32_t predicted, const uint32_t *tokens,
                           uint32_t n_tokens, uint32_t block_size)
{
	if (!ops->predict)
		return 0;
	size_t nb = n_tokens / block_size;
	uint64_t *h = malloc((2 * nb + 1) * sizeof(*h));
	uint64_t *eng = malloc(((size_t)n_ranks + 1) * sizeof(*eng));
	uint32_t *pred = malloc(((size_t)n_ranks + 1) * sizeof(*pred));
	int rc = KVR_ENOMEM;
	if (!h || !eng || !pred)
		goto out;
	nb = kvr_hash_blocks(tokens, n_tokens, block_size, NULL, h + nb, h);
	for (uint32_t r = 0; r < n_ranks; r++) {
		eng[r] =
		    sim_pool_match_prefix(sim_engine_pool(sim_cluster_engine(sim, r)), h, nb, NULL);
		if ((rc = ops->predict(ps, r, h + nb, nb, &pred[r])))
			goto out;
	}
	pthread_mutex_lock(&lock);
	FILE *f = fopen(path, "a");
	if (f) {
		fprintf(f, "R %s %llu %zu %u %u |", ops->name, (unsigned long long)seed, request,
		        rank, predicted);
		for (uint32_t r = 0; r < n_ranks; r++)
			fprintf(f, " %llu", (unsigned long long)eng[r]);
		fprintf(f, " |");
		for (uint32_t r = 0; r < n_ranks; r++)
			fprintf(f, " %u", pred[r]);
		fprintf(f, " | %zu\n", nb);
		rc = fclose(f) ? KVR_EINVAL : 0;
	} else {
		rc = KVR_EINVAL;
	}
	pthread_mutex_unlock(&lock);
out:
	free(h);
	free(eng);
	free(pred);
	return rc;
}

int replay_decisions_before(const struct replay_policy_ops *ops, void *ps, uint32_t rank,
                            uint64_t **out, size_t *n)
{
	*out = NULL;
	*n = 0;
	return ops->blocks ? ops->blocks(ps, rank, out, n) : 0;
}

int replay_decisions_healed(const char *path, const struct replay_policy_ops *ops, void *ps,
                            struct sim_cluster *sim, uint64_t seed, size_t request, uint32_t rank,
                            uint64_t *before, size_t n)
{
	uint64_t *after = NULL;
	size_t na = 0;
	int rc = ops->blocks ? ops->blocks(ps, rank, &after, &na) : 0;
	if (rc || !ops->blocks) {
		free(before);
		return rc;
	}
	qsort(after, na, sizeof(uint64_t), cmp_u64);
	const struct sim_pool *pool = sim_engine_pool(sim_cluster_engine(sim, rank));
	size_t gone = 0, held = 0;
	for (size_t k = 0; k < n; k++)
		if (!bsearch(&before[k], after, na, sizeof(uint64_t), cmp_u64)) {
			gone++;
			held += sim_pool_lookup(pool, before[k]) != SIM_NO_BLOCK;
		}
	free(after);
	free(before);
	if (!gone)
		return 0;
	pthread_mutex_lock(&lock);
	FILE *f = fopen(path, "a");
	if (f) {
		fprintf(f, "H %s %llu %zu %u %zu %zu\n", ops->name, (unsigned long long)seed,
		        request, rank, gone, held);
		rc = fclose(f) ? KVR_EINVAL : 0;
	} else {
		rc = KVR_EINVAL;
	}
	pthread_mutex_unlock(&lock);
	return rc;
}
