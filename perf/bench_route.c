/*
 * bench_route - the whole route decision (hash, index match, load snapshot, select, admission on
 * the shard) on 8k-token prompts from the shared traces, for 64 and 1024 ranks and 1 and 2
 * frontend threads, with the per-stage breakdown from the router's own histograms.
 *
 * Each measured iteration is kvr_route (timed) then kvr_request_finish (not timed), so the load
 * stays steady and the predicted caches keep evicting at capacity.  Prints one SUMMARY line per
 * configuration; never asserts timings.
 *
 * usage: bench_route [--ms N] [--trace FILE] [--prompts N] [--shards N] [--capacity BLOCKS]
 *                    [--sync-booking 0|1]
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "tools/trace.h"

#define PROMPT_TOKENS 8192

static uint32_t **prompts;
static size_t n_prompts;
static atomic_int go, stop;

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct worker {
	pthread_t th;
	struct kvr_router *r;
	int id;
	uint64_t hist[KVR_HIST_BUCKETS];
	uint64_t n;
	int cpu;
};

static void *run(void *arg)
{
	struct worker *w = arg;
	if (w->cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(w->cpu, &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = PROMPT_TOKENS;
	size_t i = (size_t)w->id * 7919;
	while (!atomic_load(&go))
		;
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		q.tokens = prompts[i++ % n_prompts];
		struct kvr_decision d;
		uint64_t t0 = mono_ns();
		int rc = kvr_route(w->r, &q, &d);
		uint64_t t1 = mono_ns();
		if (rc) {
			fprintf(stderr, "bench_route: route: %s\n", kvr_strerror(rc));
			exit(1);
		}
		w->hist[kvr_hist_bucket(t1 - t0)]++;
		w->n++;
		kvr_request_finish(w->r, d.attempt);
	}
	return NULL;
}

static bool sync_booking;
static uint64_t capacity = 4 * PROMPT_TOKENS / 16; /* blocks per rank: a few prompts */

static void bench(uint32_t ranks, int threads, uint32_t shards, double ms)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = shards;
	c.max_ranks = ranks > 4096 ? ranks : 4096;
	c.sync_booking = sync_booking;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r)) {
		fprintf(stderr, "bench_route: create failed\n");
		exit(1);
	}
	/* Capacity per rank: enough for a few prompts, so admissions evict as in production. */
	for (uint32_t k = 0; k < ranks; k++)
		kvr_rank_add(r, (struct kvr_rank_id){k, 0}, 1, capacity, 16384);
	/* Warm-up: every prompt routed once, so lookups find real prefixes. */
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = PROMPT_TOKENS;
	for (size_t i = 0; i < n_prompts; i++) {
		q.tokens = prompts[i];
		struct kvr_decision d;
		if (kvr_route(r, &q, &d) == 0)
			kvr_request_finish(r, d.attempt);
	}
	/* Reset the router's histograms by measuring deltas: simplest is a fresh metrics view, so
	 * we subtract the warm-up counts. */
	uint64_t warm[KVR_H__COUNT][KVR_HIST_BUCKETS];
	for (int h = 0; h < KVR_H__COUNT; h++)
		kvr_metrics_hist(r->metrics, (enum kvr_hist)h, warm[h], NULL);
	struct worker *w = calloc((size_t)threads, sizeof(*w));
	atomic_store(&go, 0);
	atomic_store(&stop, 0);
	for (int t = 0; t < threads; t++) {
		w[t].r = r;
		w[t].id = t;
		w[t].cpu = -1;
		pthread_create(&w[t].th, NULL, run, &w[t]);
	}
	uint64_t t0 = mono_ns();
	atomic_store(&go, 1);
	struct timespec ts = {(time_t)(ms / 1000), (long)((long)ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
	atomic_store(&stop, 1);
	uint64_t elapsed = mono_ns() - t0;
	uint64_t hist[KVR_HIST_BUCKETS] = {0}, n = 0;
	for (int t = 0; t < threads; t++) {
		pthread_join(w[t].th, NULL);
		for (int b = 0; b < KVR_HIST_BUCKETS; b++)
			hist[b] += w[t].hist[b];
		n += w[t].n;
	}
	uint64_t sp[4];
	enum kvr_hist stages[4] = {KVR_H_HASH_NS, KVR_H_MATCH_NS, KVR_H_SELECT_NS, KVR_H_ADMIT_NS};
	for (int s = 0; s < 4; s++) {
		uint64_t h[KVR_HIST_BUCKETS];
		kvr_metrics_hist(r->metrics, stages[s], h, NULL);
		for (int b = 0; b < KVR_HIST_BUCKETS; b++)
			h[b] -= warm[stages[s]][b];
		sp[s] = kvr_hist_quantile(h, 0.5);
	}
	printf(
	    "SUMMARY bench=route booking=%s ranks=%u threads=%d shards=%u p50_ns=%llu p99_ns=%llu "
	    "p999_ns=%llu hash_p50_ns=%llu match_p50_ns=%llu select_p50_ns=%llu "
	    "admit_p50_ns=%llu routes_s=%.0f\n",
	    c.sync_booking ? "sync" : "async", ranks, threads, kvr_shards_count(r->shards),
	    (unsigned long long)kvr_hist_quantile(hist, 0.5),
	    (unsigned long long)kvr_hist_quantile(hist, 0.99),
	    (unsigned long long)kvr_hist_quantile(hist, 0.999), (unsigned long long)sp[0],
	    (unsigned long long)sp[1], (unsigned long long)sp[2], (unsigned long long)sp[3],
	    (double)n / ((double)elapsed * 1e-9));
	fflush(stdout);
	free(w);
	kvr_router_destroy(r);
}

int main(int argc, char **argv)
{
	double ms = 1000;
	const char *path = NULL;
	size_t want = 1000;
	uint32_t shards = 1;
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--ms"))
			ms = atof(argv[i + 1]);
		else if (!strcmp(argv[i], "--trace"))
			path = argv[i + 1];
		else if (!strcmp(argv[i], "--prompts"))
			want = (size_t)atol(argv[i + 1]);
		else if (!strcmp(argv[i], "--shards"))
			shards = (uint32_t)atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--capacity"))
			capacity = strtoull(argv[i + 1], NULL, 10);
		else if (!strcmp(argv[i], "--sync-booking"))
			sync_booking = atoi(argv[i + 1]) != 0;
	}
	static const char *defaults[] = {"/work/shared/traces/mooncake/conversation_trace.jsonl",
	                                 "../shared/traces/mooncake/conversation_trace.jsonl",
	                                 "data/traces/mooncake/conversation_sample.jsonl"};
	struct trace t = {0};
	char err[512];
	int loaded = -1;
	if (path)
		loaded = trace_load(&t, path, true, 0, err, sizeof(err));
	for (int i = 0; loaded && !path && i < 3; i++)
		loaded = trace_load(&t, defaults[i], true, 0, err, sizeof(err));
	if (loaded) {
		fprintf(stderr, "bench_route: no trace: %s\n", err);
		return 1;
	}
	trace_finish(&t);
	/* 8k-token prompts: the first 8192 tokens of requests at least that long. */
	prompts = calloc(want, sizeof(*prompts));
	uint32_t *buf = NULL;
	size_t cap = 0;
	for (size_t i = 0; i < t.n && n_prompts < want; i++) {
		const struct trace_req *q = &t.reqs[i];
		if (q->input_len < PROMPT_TOKENS)
			continue;
		if (q->input_len > cap) {
			cap = q->input_len;
			buf = realloc(buf, cap * sizeof(*buf));
		}
		trace_tokens(&t, q, buf);
		prompts[n_prompts] = malloc(PROMPT_TOKENS * sizeof(uint32_t));
		memcpy(prompts[n_prompts++], buf, PROMPT_TOKENS * sizeof(uint32_t));
	}
	free(buf);
	trace_free(&t);
	fprintf(stderr, "bench_route: %zu prompts of %d tokens\n", n_prompts, PROMPT_TOKENS);
	static const uint32_t rank_counts[2] = {64, 1024};
	for (int a = 0; a < 2; a++)
		for (int th = 1; th <= 2; th++)
			bench(rank_counts[a], th, shards, ms);
	for (size_t i = 0; i < n_prompts; i++)
		free(prompts[i]);
	free(prompts);
	return 0;
}
