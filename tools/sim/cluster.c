/*
 * tools/sim/cluster.c - N engines on one virtual clock.
 *
 * A discrete-event loop with one kind of event: a rank's step boundary (a step due to start,
 * or one in flight ending, which also schedules the next).  Arrivals are not queued here: the
 * caller owns them and interleaves them with sim_cluster_run_until(), so the router's decision
 * for a request is taken at exactly its arrival time.  The next boundary is found by a linear
 * scan over the ranks: O(ranks) per step, which for the tens of ranks a replay uses costs less
 * than the step itself (a heap would pay off past a few hundred ranks).  Ties go to the lower
 * rank, so the order of callbacks is a function of the inputs alone (determinism).
 *
 * Invariant: every engine's last event time <= c->now <= every engine's next time, except
 * during run_until, where the clock moves to each boundary as it is run.
 */
#include "tools/sim/cluster.h"

#include "core/alloc.h"
#include "kvrouter.h"

struct sim_cluster {
	struct sim_cluster_config cfg;
	struct sim_engine **engines;
	uint64_t now;
};

void sim_cluster_config_init(struct sim_cluster_config *cfg)
{
	if (!cfg)
		return;
	cfg->n_ranks = 8;
	sim_engine_config_init(&cfg->engine);
}

int sim_cluster_create(const struct sim_cluster_config *cfg, const struct sim_callbacks *cb,
                       struct sim_cluster **out)
{
	if (!cfg || !out || cfg->n_ranks == 0)
		return KVR_EINVAL;
	if (cfg->n_ranks > 65536)
		return KVR_ERANGE;
	struct sim_cluster *c = kvr_calloc(1, sizeof(*c));
	if (!c)
		return KVR_ENOMEM;
	c->cfg = *cfg;
	c->engines = kvr_calloc(cfg->n_ranks, sizeof(*c->engines));
	if (!c->engines) {
		kvr_free(c, sizeof(*c));
		return KVR_ENOMEM;
	}
	for (uint32_t i = 0; i < cfg->n_ranks; i++) {
		int rc = sim_engine_create(&cfg->engine, i, cb, &c->engines[i]);
		if (rc != 0) {
			sim_cluster_destroy(c);
			return rc;
		}
	}
	*out = c;
	return 0;
}

void sim_cluster_destroy(struct sim_cluster *c)
{
	if (!c)
		return;
	for (uint32_t i = 0; i < c->cfg.n_ranks; i++)
		sim_engine_destroy(c->engines[i]);
	kvr_free(c->engines, c->cfg.n_ranks * sizeof(*c->engines));
	kvr_free(c, sizeof(*c));
}

uint64_t sim_cluster_now(const struct sim_cluster *c)
{
	return c->now;
}

/* The rank with the earliest boundary (lowest rank on ties), or UINT32_MAX. */
static uint32_t next_rank(const struct sim_cluster *c, uint64_t *t)
{
	uint32_t best = UINT32_MAX;
	uint64_t bt = UINT64_MAX;
	for (uint32_t i = 0; i < c->cfg.n_ranks; i++) {
		uint64_t ti = sim_engine_next_time(c->engines[i]);
		if (ti < bt) {
			bt = ti;
			best = i;
		}
	}
	*t = bt;
	return best;
}

uint64_t sim_cluster_next_time(const struct sim_cluster *c)
{
	uint64_t t;
	next_rank(c, &t);
	return t;
}

int sim_cluster_step(struct sim_cluster *c)
{
	uint64_t t;
	uint32_t r = next_rank(c, &t);
	if (r == UINT32_MAX)
		return KVR_ENOENT;
	if (t > c->now)
		c->now = t;
	return sim_engine_advance(c->engines[r]);
}

int sim_cluster_run_until(struct sim_cluster *c, uint64_t t_ns)
{
	if (t_ns < c->now)
		return KVR_EINVAL;
	for (;;) {
		uint64_t t;
		uint32_t r = next_rank(c, &t);
		if (r == UINT32_MAX || t >= t_ns)
			break;
		c->now = t;
		int rc = sim_engine_advance(c->engines[r]);
		if (rc != 0)
			return rc;
	}
	c->now = t_ns;
	return 0;
}

int sim_cluster_drain(struct sim_cluster *c)
{
	int rc;
	while ((rc = sim_cluster_step(c)) == 0)
		;
	return rc == KVR_ENOENT ? 0 : rc;
}

int sim_cluster_submit(struct sim_cluster *c, uint32_t rank, const struct sim_request *req)
{
	if (rank >= c->cfg.n_ranks)
		return KVR_ENOENT;
	return sim_engine_submit(c->engines[rank], req, c->now);
}

int sim_cluster_reset_cache(struct sim_cluster *c, uint32_t rank)
{
	if (rank >= c->cfg.n_ranks)
		return KVR_ENOENT;
	return sim_engine_reset_cache(c->engines[rank], c->now);
}

size_t sim_cluster_cached_hashes(const struct sim_cluster *c, uint32_t rank, uint64_t *out,
                                 size_t cap)
{
	if (rank >= c->cfg.n_ranks)
		return 0;
	return sim_engine_cached_hashes(c->engines[rank], out, cap);
}

bool sim_cluster_is_cached(const struct sim_cluster *c, uint32_t rank, uint64_t seq)
{
	return rank < c->cfg.n_ranks && sim_engine_is_cached(c->engines[rank], seq);
}

int sim_cluster_stats(const struct sim_cluster *c, uint32_t rank, struct sim_engine_stats *out)
{
	if (rank >= c->cfg.n_ranks || !out)
		return KVR_ENOENT;
	sim_engine_get_stats(c->engines[rank], out);
	return 0;
}

uint32_t sim_cluster_n_ranks(const struct sim_cluster *c)
{
	return c->cfg.n_ranks;
}

const struct sim_engine *sim_cluster_engine(const struct sim_cluster *c, uint32_t rank)
{
	return rank < c->cfg.n_ranks ? c->engines[rank] : NULL;
}
