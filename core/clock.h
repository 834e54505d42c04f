/* core/clock.h - the router's replaceable clock. */
#ifndef KVR_CORE_CLOCK_H
#define KVR_CORE_CLOCK_H

#include <stdint.h>

#include "kvrouter.h"

/* CLOCK_MONOTONIC in ns; the default kvr_clock_fn (ctx unused). */
uint64_t kvr_clock_monotonic(void *ctx);

struct kvr_clock {
	kvr_clock_fn fn;
	void *ctx;
};

static inline uint64_t kvr_clock_now(const struct kvr_clock *c)
{
	return c->fn(c->ctx);
}

#endif
