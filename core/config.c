/* core/config.c - configuration defaults and validation. */
#include <math.h>
#include <string.h>

#include "kvrouter.h"

#define NS_PER_S 1000000000ull

void kvr_config_init(struct kvr_config *cfg)
{
	if (!cfg)
		return;
	memset(cfg, 0, sizeof(*cfg));
	cfg->block_size = 16;
	cfg->n_shards = 0;
	cfg->mode = KVR_MODE_APPROX_LRU;
	cfg->overlap_credit = 1.0;
	cfg->prefill_load_scale = 1.0;
	cfg->temperature = 0.0;
	cfg->ttl_ns = 120 * NS_PER_S;
	cfg->lease_scan_interval_ns = 120 * NS_PER_S;
	cfg->queue_threshold = 0.0;
	cfg->queue_policy = KVR_QUEUE_FCFS;
	cfg->queue_capacity = 4096;
	cfg->max_ranks = 4096;
	cfg->seed = 0x6b76726f75746572ull;
	cfg->lane_capacity = 4096;
	cfg->maint_every_tasks = 64;
	cfg->maint_every_ns = 200000;
	cfg->shard_idle_spin_ns = 50000;
}

static int finite_nonneg(double v)
{
	return isfinite(v) && v >= 0.0;
}

int kvr_config_validate(const struct kvr_config *cfg)
{
	if (!cfg)
		return KVR_EINVAL;
	if (cfg->block_size == 0 || cfg->block_size > 65536)
		return KVR_ERANGE;
	if (cfg->n_shards > 256)
		return KVR_ERANGE;
	if (cfg->n_cpus > 0 && !cfg->cpu_list)
		return KVR_EINVAL;
	for (size_t i = 0; i < cfg->n_cpus; i++)
		if (cfg->cpu_list[i] < 0 || cfg->cpu_list[i] >= 4096)
			return KVR_ERANGE;
	if (cfg->mode != KVR_MODE_APPROX_LRU && cfg->mode != KVR_MODE_APPROX_TTL &&
	    cfg->mode != KVR_MODE_EVENTS)
		return KVR_EINVAL;
	if (!finite_nonneg(cfg->overlap_credit) || !finite_nonneg(cfg->prefill_load_scale) ||
	    !finite_nonneg(cfg->temperature) || !finite_nonneg(cfg->queue_threshold))
		return KVR_EINVAL;
	if (cfg->ttl_ns == 0 || cfg->lease_scan_interval_ns == 0)
		return KVR_EINVAL;
	if (cfg->queue_policy != KVR_QUEUE_FCFS && cfg->queue_policy != KVR_QUEUE_WSPT)
		return KVR_EINVAL;
	if (cfg->queue_capacity == 0)
		return KVR_ERANGE;
	if (cfg->max_ranks == 0 || cfg->max_ranks > 65536)
		return KVR_ERANGE;
	if (cfg->lane_capacity < 2 || cfg->lane_capacity > (1u << 22))
		return KVR_ERANGE;
	if (cfg->maint_every_tasks == 0 || cfg->maint_every_ns == 0)
		return KVR_EINVAL;
	return 0;
}
