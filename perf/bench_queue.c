/*
 * perf/bench_queue.c - what one queued kvr_route costs against the admission queue's depth.
 *
 * A queued route runs under the queue's mutex: the push, the admission pass before and after
 * it (which ends at the first saturated unrestricted entry), the settle by ticket, and the
 * reclaim of outcomes nobody collects.  Any of those that walks the list makes a queued route
 * O(queue depth), paid by every frontend that queues while the cluster is saturated (probe:
 * 0.5 ms at 8,000 waiting, one failed outcome uncollected).
 *
 * One router (one shard, one rank of 1,000 batched tokens, queue_threshold 1, a frozen virtual
 * clock: nothing expires) is saturated by a 2,000-token request; then requests (distinct
 * prompts of 64 to 1,023 tokens, so WSPT's keys vary and its inserts land all along the list)
 * queue one after another up to the largest depth plus a window, each kvr_route timed.  For each
 * depth D it prints the p50/p99/p999 of the routes made at depths D..D+window, and the ratio of
 * their p50 to that of the first window (depth 0): the baseline, measured in the same run
 * (flat = 1.0).  Run for FCFS and WSPT, each with no outcome uncollected and with one failed
 * outcome uncollected (a request pinned to a second rank, waited on past its deadline, then the
 * rank removed: kept for its collector; the clock frozen, never reclaimed).
 *
 * Usage: bench_queue [--depths 1000,4000,8000,16000] [--window 512] [--policy fcfs|wspt|both]
 *                    [--uncollected 0|1|both]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "perf/bench_util.h"

#define MAX_DEPTHS 8
#define MAX_TOKENS 1024

static uint64_t frozen(void *ctx)
{
	(void)ctx;
	return 1000000000ull;
}

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t rnd(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static void prompt(uint32_t *t, size_t n, uint32_t salt)
{
	for (size_t i = 0; i < n; i++)
		t[i] = (uint32_t)(i * 7 + salt * 1000003u);
}

static int route(struct kvr_router *r, uint32_t salt, size_t n, const struct kvr_rank_id *pin,
                 struct kvr_decision *d)
{
	static uint32_t t[2048];
	prompt(t, n, salt);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.pinned = pin;
	q.expected_output_tokens = 16;
	return kvr_route(r, &q, d);
}

static void die(const char *what, int rc)
{
	fprintf(stderr, "bench_queue: %s: %s\n", what, kvr_strerror(rc));
	exit(1);
}

static double pct(uint64_t *v, size_t n, double p)
{
	qsort(v, n, sizeof(*v), cmp_u64);
	size_t i = (size_t)(p * (double)(n - 1));
	return (double)v[i] / 1000.0;
}

static void run(bool wspt, bool uncollected, const uint64_t *depths, size_t n_depths,
                uint64_t window)
{
	uint64_t total = depths[n_depths - 1] + window;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = frozen;
	c.queue_threshold = 1.0;
	c.queue_policy = wspt ? KVR_QUEUE_WSPT : KVR_QUEUE_FCFS;
	c.queue_capacity = (uint32_t)(total + 16);
	c.max_ranks = 16;
	struct kvr_router *r;
	int rc;
	if ((rc = kvr_router_create(&c, &r)))
		die("kvr_router_create", rc);
	struct kvr_rank_id main_rank = {1, 0}, gone = {2, 0};
	struct kvr_decision d, hog;
	uint32_t salt = 1;
	if ((rc = kvr_rank_add(r, main_rank, 1, 1000000, 1000)))
		die("kvr_rank_add", rc);
	if (uncollected) {
		if ((rc = kvr_rank_add(r, gone, 1, 1000000, 1000)))
			die("kvr_rank_add", rc);
		if ((rc = route(r, salt++, 2000, &gone, &d)) || d.status != KVR_DECIDED)
			die("the second rank's hog", rc);
		if ((rc = route(r, salt++, 64, &gone, &d)) || d.status != KVR_QUEUED)
			die("the pinned request", rc ? rc : KVR_EINVAL);
		if ((rc = kvr_route_wait(r, d.ticket, 1, &d)) != KVR_ETIMEDOUT)
			die("the pinned request's wait", rc);
		if ((rc = kvr_rank_remove(r, gone)) || (rc = kvr_router_sync(r, 10000)))
			die("kvr_rank_remove", rc);
	}
	if ((rc = route(r, salt++, 2000, NULL, &hog)) || hog.status != KVR_DECIDED)
		die("the hog", rc ? rc : KVR_EINVAL);
	uint64_t *ns = calloc(total, sizeof(*ns));
	if (!ns)
		die("calloc", KVR_ENOMEM);
	for (uint64_t i = 0; i < total; i++) {
		size_t n = 64 + (size_t)(rnd() % (MAX_TOKENS - 64));
		uint64_t t0 = now_ns();
		rc = route(r, salt++, n, NULL, &d);
		ns[i] = now_ns() - t0;
		if (rc || d.status != KVR_QUEUED)
			die("a queued route", rc ? rc : KVR_EINVAL);
	}
	uint64_t w = window < total ? window : total;
	uint64_t *tmp = malloc(w * sizeof(*tmp));
	if (!tmp)
		die("malloc", KVR_ENOMEM);
	memcpy(tmp, ns, w * sizeof(*tmp));
	double base = pct(tmp, w, 0.5);
	printf("policy=%s uncollected=%d depth=0 window=%" PRIu64 " p50_us=%.2f\n",
	       wspt ? "wspt" : "fcfs", uncollected, w, base);
	for (size_t k = 0; k < n_depths; k++) {
		memcpy(tmp, ns + depths[k], w * sizeof(*tmp));
		double p50 = pct(tmp, w, 0.5), p99 = pct(tmp, w, 0.99), p999 = pct(tmp, w, 0.999);
		printf("SUMMARY bench=queue policy=%s uncollected=%d depth=%" PRIu64
		       " p50_us=%.2f p99_us=%.2f p999_us=%.2f p50_ratio_to_depth0=%.2f\n",
		       wspt ? "wspt" : "fcfs", uncollected, depths[k], p50, p99, p999,
		       base > 0 ? p50 / base : 0.0);
	}
	fflush(stdout);
	free(tmp);
	free(ns);
	kvr_router_destroy(r);
}

int main(int argc, char **argv)
{
	uint64_t depths[MAX_DEPTHS] = {1000, 4000, 8000, 16000};
	size_t n_depths = 4;
	uint64_t window = 512;
	int policy = 2, unc = 2; /* 0, 1 or both */
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--depths")) {
			n_depths = opt_list(argc, argv, i, 1, 1000000, depths, MAX_DEPTHS);
		} else if (!strcmp(argv[i], "--window")) {
			window = opt_u64(argc, argv, i, 1, 100000);
		} else if (!strcmp(argv[i], "--policy")) {
			const char *s = opt_str(argc, argv, i);
			if (!strcmp(s, "fcfs"))
				policy = 0;
			else if (!strcmp(s, "wspt"))
				policy = 1;
			else if (!strcmp(s, "both"))
				policy = 2;
			else
				opt_bad(argv, i, "fcfs, wspt or both", s);
		} else if (!strcmp(argv[i], "--uncollected")) {
			const char *s = opt_str(argc, argv, i);
			if (!strcmp(s, "0"))
				unc = 0;
			else if (!strcmp(s, "1"))
				unc = 1;
			else if (!strcmp(s, "both"))
				unc = 2;
			else
				opt_bad(argv, i, "0, 1 or both", s);
		} else {
			opt_unknown(argv, i);
		}
	}
	/* Ascending, so that one fill serves every depth. */
	qsort(depths, n_depths, sizeof(depths[0]), cmp_u64);
	for (int p = 0; p < 2; p++)
		for (int u = 0; u < 2; u++)
			if ((policy == 2 || policy == p) && (unc == 2 || unc == u))
				run(p == 1, u == 1, depths, n_depths, window);
	return 0;
}
