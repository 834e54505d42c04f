/* Metrics: per-thread blocks summed on read, histogram buckets and quantiles, thread churn. */
#include <criterion/criterion.h>
#include <pthread.h>

#include "core/alloc.h"
#include "core/metrics.h"

Test(metrics, buckets_monotonic_and_bounded)
{
	unsigned prev = 0;
	for (uint64_t v = 0; v < 100000; v++) {
		unsigned b = kvr_hist_bucket(v);
		cr_assert(b >= prev && b < KVR_HIST_BUCKETS);
		cr_assert(kvr_hist_bucket_low(b) <= v, "v=%lu b=%u", (unsigned long)v, b);
		if (b + 1 < KVR_HIST_BUCKETS)
			cr_assert(kvr_hist_bucket_low(b + 1) > v);
		prev = b;
	}
	cr_assert(kvr_hist_bucket(UINT64_MAX) < KVR_HIST_BUCKETS);
}

Test(metrics, quantiles)
{
	uint64_t h[KVR_HIST_BUCKETS] = {0};
	for (uint64_t v = 1; v <= 1000; v++)
		h[kvr_hist_bucket(v)]++;
	uint64_t p50 = kvr_hist_quantile(h, 0.5), p99 = kvr_hist_quantile(h, 0.99);
	cr_assert(p50 >= 500 && p50 <= 600, "p50 %lu", (unsigned long)p50);
	cr_assert(p99 >= 990 && p99 <= 1200, "p99 %lu", (unsigned long)p99);
}

static struct kvr_metrics *M;
static void *worker(void *arg)
{
	(void)arg;
	for (int i = 0; i < 10000; i++) {
		struct kvr_metrics_block *b = kvr_metrics_local(M);
		kvr_metrics_add(b, KVR_C_ROUTES, 1);
		kvr_metrics_observe(b, KVR_H_ROUTE_NS, 100);
	}
	return NULL;
}

Test(metrics, threads_sum_and_churn)
{
	cr_assert_eq(kvr_metrics_create(&M), 0);
	for (int round = 0; round < 5; round++) {
		pthread_t t[4];
		for (int i = 0; i < 4; i++)
			pthread_create(&t[i], NULL, worker, NULL);
		for (int i = 0; i < 4; i++)
			pthread_join(t[i], NULL);
	}
	cr_assert_eq(kvr_metrics_counter(M, KVR_C_ROUTES), 200000);
	uint64_t h[KVR_HIST_BUCKETS], sum;
	kvr_metrics_hist(M, KVR_H_ROUTE_NS, h, &sum);
	cr_assert_eq(sum, 100u * 200000u);
	cr_assert_eq(h[kvr_hist_bucket(100)], 200000);
	kvr_metrics_destroy(M);
	/* a second registry at maybe the same address must not see the old thread cache */
	cr_assert_eq(kvr_metrics_create(&M), 0);
	worker(NULL);
	cr_assert_eq(kvr_metrics_counter(M, KVR_C_ROUTES), 10000);
	kvr_metrics_destroy(M);
}

/* A thread recording into many registries (a gateway routing for many models, a router each)
 * counts in every one: with a fixed 8 per thread, the ninth and later counted nothing. */
static void *many_registries(void *arg)
{
	struct kvr_metrics **m = arg;
	for (int round = 0; round < 3; round++)
		for (int i = 0; i < 40; i++)
			kvr_metrics_add(kvr_metrics_local(m[i]), KVR_C_ROUTES, 1);
	return NULL;
}

Test(metrics, a_thread_counts_in_any_number_of_registries)
{
	struct kvr_metrics *m[40];
	for (int i = 0; i < 40; i++)
		cr_assert_eq(kvr_metrics_create(&m[i]), 0);
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, many_registries, m), 0);
	cr_assert_eq(pthread_join(t, NULL), 0);
	for (int i = 0; i < 40; i++)
		cr_assert_eq(kvr_metrics_counter(m[i], KVR_C_ROUTES), 3, "registry %d", i);
	/* Registries destroyed between a thread's uses make room for new ones. */
	for (int i = 0; i < 40; i++) {
		kvr_metrics_destroy(m[i]);
		cr_assert_eq(kvr_metrics_create(&m[i]), 0);
	}
	cr_assert_eq(pthread_create(&t, NULL, many_registries, m), 0);
	cr_assert_eq(pthread_join(t, NULL), 0);
	for (int i = 0; i < 40; i++) {
		cr_assert_eq(kvr_metrics_counter(m[i], KVR_C_ROUTES), 3, "registry %d", i);
		kvr_metrics_destroy(m[i]);
	}
}

/* A thread whose first use of a registry grows its refs array and then finds no memory for its
 * block leaks nothing at its exit (before, the exit handler was registered only once a block was
 * taken: the array leaked, 192 bytes under ASan in test_oom_contracts). */
static void *block_fails(void *p)
{
	kvr_alloc_fail_after(2); /* the refs array, then the block */
	void *b = kvr_metrics_local(p);
	kvr_alloc_fail_after(0);
	return b;
}

Test(metrics, a_thread_without_memory_for_its_block_leaks_nothing)
{
	struct kvr_metrics *m;
	cr_assert_eq(kvr_metrics_create(&m), 0);
	int64_t before = kvr_alloc_live_bytes();
	pthread_t t;
	void *b = (void *)1;
	cr_assert_eq(pthread_create(&t, NULL, block_fails, m), 0);
	cr_assert_eq(pthread_join(t, &b), 0);
	cr_assert_null(b, "the block's allocation failed");
	cr_assert_eq(kvr_alloc_live_bytes(), before, "the thread's refs array freed at its exit");
	kvr_metrics_destroy(m);
}

/* ---------------------------------------------------------------- the rendered page */

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"

/* A page rendered after two decisions: one with no predicted overlap, then one with exactly 1
 * block (the first prompt's block, finished and cached). */
static char *render_two_decisions(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 1000, 0), 0);
	uint32_t t[32];
	for (uint32_t i = 0; i < 32; i++)
		t[i] = 100 + i;
	struct kvr_request q;
	struct kvr_decision d;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 17;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	q.n_tokens = 32;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, 1);
	size_t len = 0;
	cr_assert_eq(kvr_metrics_render(r, NULL, 0, &len), KVR_ERANGE);
	char *buf = malloc(len + 4096);
	cr_assert_eq(kvr_metrics_render(r, buf, len + 4096, NULL), 0);
	kvr_router_destroy(r);
	return buf;
}

/* Prometheus' le is inclusive: bucket{le="x"} counts the observations <= x.  The page's bounds
 * were powers of two holding the observations BELOW them, so a decision with exactly 1 block of
 * overlap was missing from le="1" (and 2, 4, 8 ... likewise): the bounds are now the largest
 * value each cumulative count holds, 2^k - 1. */
Test(metrics, histogram_le_bounds_are_inclusive)
{
	char *buf = render_two_decisions();
	cr_assert(strstr(buf, "kvr_predicted_overlap_blocks_bucket{le=\"0\"} 1\n"), "%s", buf);
	cr_assert(strstr(buf, "kvr_predicted_overlap_blocks_bucket{le=\"1\"} 2\n"), "%s", buf);
	cr_assert(strstr(buf, "kvr_predicted_overlap_blocks_bucket{le=\"3\"} 2\n"));
	cr_assert(strstr(buf, "kvr_predicted_overlap_blocks_sum 1\n"));
	cr_assert(strstr(buf, "kvr_predicted_overlap_blocks_count 2\n"));
	free(buf);
}

/* Every histogram on the page: le bounds increase, counts are cumulative, +Inf is _count; the
 * seconds bounds are the exact values (2^k - 1 ns) in decimal. */
Test(metrics, histograms_are_cumulative_and_consistent)
{
	char *buf = render_two_decisions();
	unsigned hists = 0;
	for (const char *h = strstr(buf, "# TYPE "); h; h = strstr(h + 1, "# TYPE ")) {
		char name[128];
		if (sscanf(h, "# TYPE %127s histogram", name) != 1 || !strstr(h, " histogram\n") ||
		    strstr(h, " histogram\n") > strchr(h, '\n'))
			continue;
		hists++;
		bool seconds = strstr(name, "_seconds") != NULL;
		char key[160];
		snprintf(key, sizeof(key), "%s_bucket{le=\"", name);
		const char *p = h;
		uint64_t prev = 0, k = 0;
		double prev_le = -1;
		while ((p = strstr(p, key)) != NULL) {
			p += strlen(key);
			char *end;
			if (strncmp(p, "+Inf", 4) == 0) {
				uint64_t inf = strtoull(p + 6, NULL, 10), count;
				char ckey[160];
				snprintf(ckey, sizeof(ckey), "%s_count ", name);
				const char *c = strstr(p, ckey);
				cr_assert(c, "%s has a _count", name);
				count = strtoull(c + strlen(ckey), NULL, 10);
				cr_assert_eq(inf, count, "%s: +Inf %" PRIu64 ", _count %" PRIu64,
				             name, inf, count);
				cr_assert_geq(inf, prev);
				break;
			}
			double le = strtod(p, &end);
			cr_assert_gt(le, prev_le, "%s: le %g after %g", name, le, prev_le);
			/* n / 1e9 is correctly rounded, as strtod of the exact decimal is */
			double want = (double)((UINT64_C(1) << k) - 1) / (seconds ? 1e9 : 1.0);
			cr_assert_eq(le, want, "%s: bound %" PRIu64 " is %.17g, want %.17g", name,
			             k, le, want);
			uint64_t v = strtoull(end + 3, NULL, 10);
			cr_assert_geq(v, prev, "%s: bucket counts must be cumulative", name);
			prev = v;
			prev_le = le;
			k++;
		}
		cr_assert_gt(k, 0, "%s has buckets", name);
	}
	cr_assert_eq(hists, 8, "every histogram checked (%u)", hists);
	free(buf);
}

static void *observe_big(void *arg)
{
	(void)arg;
	kvr_metrics_observe(kvr_metrics_local(M), KVR_H_FEED_LAG_NS, UINT64_MAX - 5);
	return NULL;
}

/* A histogram's sum never goes down.  Feed lag from a publisher whose batch ts is not Unix
 * wall-clock seconds (a monotonic clock) is ~1.7e18 ns a batch: the uint64 sum wrapped after
 * 11 of them and the page's _sum fell from 17 s x 1e9 to 0.25 s x 1e9.  It saturates instead. */
Test(metrics, histogram_sum_never_goes_down)
{
	struct kvr_metrics *m;
	cr_assert_eq(kvr_metrics_create(&m), 0);
	struct kvr_metrics_block *b = kvr_metrics_local(m);
	uint64_t h[KVR_HIST_BUCKETS], prev = 0, sum;
	for (int i = 1; i <= 12; i++) {
		kvr_metrics_observe(b, KVR_H_FEED_LAG_NS, UINT64_C(1700000000000000000));
		kvr_metrics_hist(m, KVR_H_FEED_LAG_NS, h, &sum);
		cr_assert_geq(sum, prev, "after %d observations", i);
		prev = sum;
	}
	cr_assert_eq(sum, UINT64_MAX);
	kvr_metrics_destroy(m);
	/* Across threads' blocks too: two blocks near the top sum to the top, not past it. */
	cr_assert_eq(kvr_metrics_create(&M), 0);
	pthread_t t;
	for (int i = 0; i < 2; i++) {
		cr_assert_eq(pthread_create(&t, NULL, observe_big, NULL), 0);
		cr_assert_eq(pthread_join(t, NULL), 0);
		/* the block of a thread gone is reused: make the second thread's a new one */
		if (i == 0)
			kvr_metrics_observe(kvr_metrics_local(M), KVR_H_FEED_LAG_NS, 0);
	}
	kvr_metrics_hist(M, KVR_H_FEED_LAG_NS, h, &sum);
	cr_assert_eq(sum, UINT64_MAX);
	kvr_metrics_destroy(M);
}

/* The top bucket's quantile is the largest value, not 0 (its upper bound was computed with a
 * shift by 64). */
Test(metrics, quantile_of_the_top_bucket)
{
	uint64_t h[KVR_HIST_BUCKETS] = {0};
	h[kvr_hist_bucket(UINT64_MAX)] = 1;
	cr_assert_eq(kvr_hist_quantile(h, 0.5), UINT64_MAX);
	h[kvr_hist_bucket(UINT64_C(1) << 62)] = 1;
	cr_assert_eq(kvr_hist_quantile(h, 0.0),
	             kvr_hist_bucket_low(kvr_hist_bucket(UINT64_C(1) << 62) + 1) - 1);
	cr_assert_eq(kvr_hist_quantile(h, 1.0), UINT64_MAX);
}
