/*
 * tests/common/metric.h - one unlabelled counter of a router, read as kvr_metrics_render prints
 * it (for Criterion tests).
 */
#ifndef KVR_TESTS_METRIC_H
#define KVR_TESTS_METRIC_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"

/* The value of counter `name` (no labels); fails the test if it is not rendered.
 * Context: a test's single thread of control (a static buffer). */
static inline uint64_t kvr_test_metric(struct kvr_router *r, const char *name)
{
	static char buf[1 << 16];
	size_t len = 0;
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf), &len), 0);
	char key[128];
	snprintf(key, sizeof(key), "\n%s ", name);
	const char *p = strstr(buf, key);
	cr_assert(p, "%s rendered", name);
	return strtoull(p + strlen(key), NULL, 10);
}

#endif /* KVR_TESTS_METRIC_H */
