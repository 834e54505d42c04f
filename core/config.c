/* core/config.c - configuration defaults and validation (numbers from core/limits.h). */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "core/error.h"
#include "core/limits.h"
#include "core/router_internal.h"
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
	cfg->free_order = KVR_FREE_FRESH_FIRST;
}

static int finite_nonneg(double v)
{
	return isfinite(v) && v >= 0.0;
}

int kvr_config_check(const struct kvr_config *cfg, const char *fn)
{
	if (!cfg)
		return kvr_fail(KVR_EINVAL, "%s: config is NULL", fn);
	if (cfg->block_size == 0 || cfg->block_size > KVR_LIMIT_BLOCK_SIZE_MAX)
		return kvr_fail(KVR_ERANGE, "%s: config.block_size %u is out of range [1, %u]", fn,
		                cfg->block_size, KVR_LIMIT_BLOCK_SIZE_MAX);
	if (cfg->n_shards > KVR_LIMIT_SHARDS_MAX)
		return kvr_fail(KVR_ERANGE, "%s: config.n_shards %u is out of range [0, %u]", fn,
		                cfg->n_shards, KVR_LIMIT_SHARDS_MAX);
	if (cfg->n_cpus > 0 && !cfg->cpu_list)
		return kvr_fail(KVR_EINVAL, "%s: config.cpu_list is NULL with n_cpus %zu", fn,
		                cfg->n_cpus);
	for (size_t i = 0; i < cfg->n_cpus; i++)
		if (cfg->cpu_list[i] < 0 || cfg->cpu_list[i] > KVR_LIMIT_CPU_ID_MAX)
			return kvr_fail(KVR_ERANGE,
			                "%s: config.cpu_list[%zu] %d is out of range [0, %d]", fn,
			                i, cfg->cpu_list[i], KVR_LIMIT_CPU_ID_MAX);
	if (cfg->mode != KVR_MODE_APPROX_LRU && cfg->mode != KVR_MODE_APPROX_TTL &&
	    cfg->mode != KVR_MODE_EVENTS)
		return kvr_fail(KVR_EINVAL,
		                "%s: config.mode %d is not KVR_MODE_APPROX_LRU, _APPROX_TTL or "
		                "_EVENTS",
		                fn, (int)cfg->mode);
	static const char *const dnames[] = {"overlap_credit", "prefill_load_scale", "temperature",
	                                     "queue_threshold"};
	const double dvals[] = {cfg->overlap_credit, cfg->prefill_load_scale, cfg->temperature,
	                        cfg->queue_threshold};
	for (size_t i = 0; i < sizeof(dvals) / sizeof(dvals[0]); i++)
		if (!finite_nonneg(dvals[i]))
			return kvr_fail(KVR_EINVAL, "%s: config.%s %g is not a finite number >= 0",
			                fn, dnames[i], dvals[i]);
	if (cfg->ttl_ns == 0)
		return kvr_fail(KVR_EINVAL, "%s: config.ttl_ns is 0; it must be >= 1", fn);
	if (cfg->lease_scan_interval_ns == 0)
		return kvr_fail(KVR_EINVAL,
		                "%s: config.lease_scan_interval_ns is 0; it must be >= 1", fn);
	if (cfg->free_order != KVR_FREE_FRESH_FIRST && cfg->free_order != KVR_FREE_TAIL_FIRST)
		return kvr_fail(KVR_EINVAL,
		                "%s: config.free_order %d is not KVR_FREE_FRESH_FIRST or "
		                "KVR_FREE_TAIL_FIRST",
		                fn, (int)cfg->free_order);
	if (cfg->queue_policy != KVR_QUEUE_FCFS && cfg->queue_policy != KVR_QUEUE_WSPT)
		return kvr_fail(
		    KVR_EINVAL,
		    "%s: config.queue_policy %d is not KVR_QUEUE_FCFS or KVR_QUEUE_WSPT", fn,
		    (int)cfg->queue_policy);
	if (cfg->queue_capacity == 0)
		return kvr_fail(KVR_ERANGE, "%s: config.queue_capacity is 0; it must be >= 1", fn);
	if (cfg->max_ranks == 0 || cfg->max_ranks > KVR_LIMIT_MAX_RANKS_MAX)
		return kvr_fail(KVR_ERANGE, "%s: config.max_ranks %u is out of range [1, %u]", fn,
		                cfg->max_ranks, KVR_LIMIT_MAX_RANKS_MAX);
	if (cfg->lane_capacity < KVR_LIMIT_LANE_CAPACITY_MIN ||
	    cfg->lane_capacity > KVR_LIMIT_LANE_CAPACITY_MAX)
		return kvr_fail(KVR_ERANGE, "%s: config.lane_capacity %u is out of range [%u, %u]",
		                fn, cfg->lane_capacity, KVR_LIMIT_LANE_CAPACITY_MIN,
		                KVR_LIMIT_LANE_CAPACITY_MAX);
	if (cfg->lane_soft_depth > KVR_LIMIT_LANE_CAPACITY_MAX)
		return kvr_fail(KVR_ERANGE, "%s: config.lane_soft_depth %u is out of range [0, %u]",
		                fn, cfg->lane_soft_depth, KVR_LIMIT_LANE_CAPACITY_MAX);
	if (cfg->maint_every_tasks == 0)
		return kvr_fail(KVR_EINVAL, "%s: config.maint_every_tasks is 0; it must be >= 1",
		                fn);
	if (cfg->maint_every_ns == 0)
		return kvr_fail(KVR_EINVAL, "%s: config.maint_every_ns is 0; it must be >= 1", fn);
	if (cfg->booking_lazy_ns > KVR_DEFAULT_SHARD_LAZY_WAKE_NS)
		return kvr_fail(KVR_ERANGE,
		                "%s: config.booking_lazy_ns %" PRIu64
		                " is out of range [0, %" PRIu64 "]",
		                fn, cfg->booking_lazy_ns, KVR_DEFAULT_SHARD_LAZY_WAKE_NS);
	/* 0 would refuse every store of a rank without a capacity: a config mistake, not a bound
	 * (checked in every mode, like the fields that apply to one mode only). */
	if (cfg->events_max_blocks == 0)
		return kvr_fail(KVR_ERANGE, "%s: config.events_max_blocks is 0; it must be >= 1",
		                fn);
	return 0;
}

int kvr_config_validate(const struct kvr_config *cfg)
{
	return kvr_config_check(cfg, "kvr_config_validate");
}
