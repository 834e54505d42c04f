/*
 * core/router.c - the router object: configuration, clock and (as the other modules land) the
 * index, the shard runtime and per-rank state behind the public API.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "kvrouter.h"

struct kvr_router {
	struct kvr_config cfg;
	struct kvr_clock clock;
};

int kvr_router_create(const struct kvr_config *cfg, struct kvr_router **out)
{
	if (!out)
		return KVR_EINVAL;
	*out = NULL;
	struct kvr_config def;
	if (!cfg) {
		kvr_config_init(&def);
		cfg = &def;
	}
	int rc = kvr_config_validate(cfg);
	if (rc)
		return rc;
	struct kvr_router *r = kvr_calloc(1, sizeof(*r));
	if (!r)
		return KVR_ENOMEM;
	r->cfg = *cfg;
	r->cfg.cpu_list = NULL; /* borrowed by create only; the shard runtime keeps its copy */
	r->cfg.n_cpus = 0;
	r->clock.fn = cfg->now_ns ? cfg->now_ns : kvr_clock_monotonic;
	r->clock.ctx = cfg->now_ns ? cfg->clock_ctx : NULL;
	*out = r;
	return 0;
}

void kvr_router_destroy(struct kvr_router *r)
{
	if (!r)
		return;
	kvr_free(r, sizeof(*r));
}

uint64_t kvr_router_now(const struct kvr_router *r)
{
	return r ? kvr_clock_now(&r->clock) : 0;
}

int kvr_router_get_config(const struct kvr_router *r, struct kvr_config *out)
{
	if (!r || !out)
		return KVR_EINVAL;
	*out = r->cfg;
	return 0;
}
