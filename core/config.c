/* core/config.c - configuration defaults and validation (numbers from core/limits.h). */
#include <math.h>
#include <string.h>

#include "core/limits.h"
#include "kvrouter.h"

void kvr_config_init(struct kvr_config *cfg)
{
	if (!cfg)
		return;
	memset(cfg, 0, sizeof(*cfg));
	cfg->block_size = KVR_DEFAULT_BLOCK_SIZE;
	cfg->n_shards = 0;
	cfg->mode = KVR_MODE_APPROX_LRU;
	cfg->overlap_credit = 1.0;
	cfg->prefill_load_scale = 1.0;
	cfg->temperature = 0.0;
	cfg->ttl_ns = KVR_DEFAULT_TTL_NS;
	cfg->lease_scan_interval_ns = KVR_DEFAULT_LEASE_SCAN_INTERVAL_NS;
	cfg->queue_threshold = 0.0;
	cfg->queue_policy = KVR_QUEUE_FCFS;
	cfg->queue_capacity = KVR_DEFAULT_QUEUE_CAPACITY;
	cfg->max_ranks = KVR_DEFAULT_MAX_RANKS;
	cfg->seed = KVR_DEFAULT_SEED;
	cfg->lane_capacity = KVR_DEFAULT_LANE_CAPACITY;
	cfg->lane_soft_depth = KVR_DEFAULT_LANE_SOFT_DEPTH;
	cfg->maint_every_tasks = KVR_DEFAULT_MAINT_EVERY_TASKS;
	cfg->maint_every_ns = KVR_DEFAULT_MAINT_EVERY_NS;
	cfg->shard_idle_spin_ns = KVR_DEFAULT_SHARD_IDLE_SPIN_NS;
	cfg->booking_lazy_ns = KVR_DEFAULT_BOOKING_LAZY_NS;
	cfg->events_max_blocks = KVR_DEFAULT_EVENTS_MAX_BLOCKS;
}

static int finite_nonneg(double v)
{
	return isfinite(v) && v >= 0.0;
}

int kvr_config_validate(const struct kvr_config *cfg)
{
	if (!cfg)
		return KVR_EINVAL;
	if (cfg->block_size == 0 || cfg->block_size > KVR_LIMIT_BLOCK_SIZE_MAX)
		return KVR_ERANGE;
	if (cfg->n_shards > KVR_LIMIT_SHARDS_MAX)
		return KVR_ERANGE;
	if (cfg->n_cpus > 0 && !cfg->cpu_list)
		return KVR_EINVAL;
	for (size_t i = 0; i < cfg->n_cpus; i++)
		if (cfg->cpu_list[i] < 0 || cfg->cpu_list[i] > KVR_LIMIT_CPU_ID_MAX)
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
	if (cfg->max_ranks == 0 || cfg->max_ranks > KVR_LIMIT_MAX_RANKS_MAX)
		return KVR_ERANGE;
	if (cfg->lane_capacity < KVR_LIMIT_LANE_CAPACITY_MIN ||
	    cfg->lane_capacity > KVR_LIMIT_LANE_CAPACITY_MAX ||
	    cfg->lane_soft_depth > KVR_LIMIT_LANE_CAPACITY_MAX)
		return KVR_ERANGE;
	if (cfg->maint_every_tasks == 0 || cfg->maint_every_ns == 0)
		return KVR_EINVAL;
	if (cfg->booking_lazy_ns > KVR_DEFAULT_SHARD_LAZY_WAKE_NS)
		return KVR_ERANGE;
	/* 0 would refuse every store of a rank without a capacity: a config mistake, not a bound
	 * (checked in every mode, like the fields that apply to one mode only). */
	if (cfg->events_max_blocks == 0)
		return KVR_ERANGE;
	return 0;
}
