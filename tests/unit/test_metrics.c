/* Metrics: per-thread blocks summed on read, histogram buckets and quantiles, thread churn. */
#include <criterion/criterion.h>
#include <pthread.h>

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
