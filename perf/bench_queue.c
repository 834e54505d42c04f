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
 *
 * --life-ms MS runs the lifecycle mode instead: what the lifecycle calls cost on a saturated
 * router that queues, and how long queued requests wait.  --fronts frontend threads (4) loop
 * over: route a 2,048-token prompt of its own with KVR_ROUTE_WAIT, sleep --prefill-us (200,
 * the engine's prefill), prefill done, three outputs, sleep --decode-us (500), finish; every call
 * timed.  --ranks ranks (2) of 1,024 batched tokens each, so one prompt saturates a rank.
 * Prints the calls' p50/p99, the routes that queued and their wait, and the routes per second.
 * Lifecycle calls used to wait one round trip to their shard on such a router (prefill done
 * p99 0.4-2.6 ms on this project's 2-vCPU VM); they post now (docs/measurements.md).
 *
 * Usage: bench_queue --life-ms 3000 [--fronts 4] [--ranks 2] [--prefill-us 200]
 *                    [--decode-us 500]
 *
 * --restricted pin|allow runs the restricted mode instead: what a queued route costs while N
 * requests restricted to a saturated rank wait (pinned to it, or allow-listed to it alone),
 * for N in --depths.  Every route made while requests wait runs an admission pass and the
 * admissible check, and both used to look at each such request (~318 us a route at 8,000).
 * Per N, a fresh router: ranks A and B of 1,000 batched tokens, each saturated by a pinned
 * 2,000-token request; a one-token unrestricted request queued first (every pass ends at it,
 * so the N restricted requests queue in O(N)) and then cancelled; then --window unrestricted
 * routes, each timed (longer prompts: they queue behind the restricted ones, whose ranks are
 * all saturated).
 * Prints their p50/p99 for each N and the p50's ratio to N = 0, run first in the same process.
 *
 * Usage: bench_queue --restricted pin [--depths 1000,8000] [--window 512] [--policy fcfs]
 */
#include <pthread.h>
#include <time.h>
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

static int route_allow(struct kvr_router *r, uint32_t salt, size_t n, const struct kvr_rank_id *pin,
                       const struct kvr_rank_id *allow, struct kvr_decision *d)
{
	static uint32_t t[2048];
	prompt(t, n, salt);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.pinned = pin;
	q.allow = allow;
	q.n_allow = allow ? 1 : 0;
	q.expected_output_tokens = 16;
	return kvr_route(r, &q, d);
}

static int route(struct kvr_router *r, uint32_t salt, size_t n, const struct kvr_rank_id *pin,
                 struct kvr_decision *d)
{
	return route_allow(r, salt, n, pin, NULL, d);
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

/* ---------------------------------------------------------------- restricted mode */

/* The p50 and p99 (us) of `window` unrestricted queued routes made while n requests restricted
 * to a saturated rank wait (see the top). */
static void restricted_cost(bool wspt, bool allow, uint64_t n, uint64_t window, double *p50,
                            double *p99)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = frozen;
	c.queue_threshold = 1.0;
	c.queue_policy = wspt ? KVR_QUEUE_WSPT : KVR_QUEUE_FCFS;
	c.queue_capacity = (uint32_t)(n + window + 16);
	struct kvr_router *r;
	int rc;
	if ((rc = kvr_router_create(&c, &r)))
		die("kvr_router_create", rc);
	struct kvr_rank_id a = {1, 0}, b = {2, 0};
	struct kvr_decision d, marker;
	uint32_t salt = 1;
	if ((rc = kvr_rank_add(r, a, 1, 1000000, 1000)) ||
	    (rc = kvr_rank_add(r, b, 1, 1000000, 1000)))
		die("kvr_rank_add", rc);
	if ((rc = route(r, salt++, 2000, &a, &d)) || d.status != KVR_DECIDED ||
	    (rc = route(r, salt++, 2000, &b, &d)) || d.status != KVR_DECIDED)
		die("the hogs", rc ? rc : KVR_EINVAL);
	if ((rc = route(r, salt++, 1, NULL, &marker)) || marker.status != KVR_QUEUED)
		die("the marker", rc ? rc : KVR_EINVAL);
	for (uint64_t i = 0; i < n; i++) {
		size_t len = 64 + (size_t)(rnd() % (MAX_TOKENS - 128));
		rc = route_allow(r, salt++, len, allow ? NULL : &b, allow ? &b : NULL, &d);
		if (rc || d.status != KVR_QUEUED)
			die("a restricted route", rc ? rc : KVR_EINVAL);
	}
	if ((rc = kvr_route_cancel(r, marker.ticket)))
		die("the marker's cancel", rc);
	uint64_t *ns = calloc(window, sizeof(*ns));
	if (!ns)
		die("calloc", KVR_ENOMEM);
	for (uint64_t i = 0; i < window; i++) {
		/* Longer than every restricted one: under WSPT too, they all come first. */
		uint64_t t0 = now_ns();
		rc = route(r, salt++, MAX_TOKENS - 1, NULL, &d);
		ns[i] = now_ns() - t0;
		if (rc || d.status != KVR_QUEUED)
			die("a queued route", rc ? rc : KVR_EINVAL);
	}
	*p50 = pct(ns, window, 0.5);
	*p99 = pct(ns, window, 0.99);
	free(ns);
	kvr_router_destroy(r);
}

static void run_restricted(bool wspt, bool allow, const uint64_t *depths, size_t n_depths,
                           uint64_t window)
{
	double base, p50, p99;
	restricted_cost(wspt, allow, 0, window, &base, &p99);
	printf("policy=%s restricted=%s n=0 window=%" PRIu64 " p50_us=%.2f p99_us=%.2f\n",
	       wspt ? "wspt" : "fcfs", allow ? "allow" : "pin", window, base, p99);
	for (size_t k = 0; k < n_depths; k++) {
		restricted_cost(wspt, allow, depths[k], window, &p50, &p99);
		printf("SUMMARY bench=queue_restricted policy=%s restricted=%s n=%" PRIu64
		       " p50_us=%.2f p99_us=%.2f p50_ratio_to_n0=%.2f\n",
		       wspt ? "wspt" : "fcfs", allow ? "allow" : "pin", depths[k], p50, p99,
		       base > 0 ? p50 / base : 0.0);
		fflush(stdout);
	}
}

/* ---------------------------------------------------------------- lifecycle mode */

enum { L_ROUTE, L_QUEUED, L_PREFILL, L_OUTPUT, L_FINISH, L_KINDS };
static const char *const life_name[L_KINDS] = {"route", "queued_route", "prefill_done", "output",
                                               "finish"};
#define LIFE_MAX 4000000 /* samples kept per kind and thread (later ones overwrite) */

struct life_front {
	struct kvr_router *r;
	int id;
	uint64_t prefill_ns, decode_ns;
	const int *stop;
	uint64_t *v[L_KINDS];
	size_t n[L_KINDS];
	uint64_t errors;
};

static void life_sleep(uint64_t ns)
{
	if (ns)
		nanosleep(&(struct timespec){(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)},
		          NULL);
}

static void life_note(struct life_front *f, int k, uint64_t ns)
{
	f->v[k][f->n[k]++ % LIFE_MAX] = ns;
}

static void *life_main(void *arg)
{
	struct life_front *f = arg;
	static _Thread_local uint32_t t[2048];
	uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(f->id + 1);
	while (!__atomic_load_n(f->stop, __ATOMIC_RELAXED)) {
		for (size_t i = 0; i < 2048; i++) {
			x = x * 6364136223846793005ull + 1442695040888963407ull;
			t[i] = (uint32_t)(x >> 33);
		}
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 2048;
		q.flags |= KVR_ROUTE_WAIT;
		q.deadline_ns = kvr_router_now(f->r) + 5000000000ull;
		struct kvr_decision d;
		uint64_t t0 = now_ns();
		int rc = kvr_route(f->r, &q, &d);
		uint64_t t1 = now_ns();
		if (rc || d.status != KVR_DECIDED) {
			f->errors++;
			continue;
		}
		life_note(f, L_ROUTE, t1 - t0);
		if (d.ticket) /* queued first */
			life_note(f, L_QUEUED, t1 - t0);
		life_sleep(f->prefill_ns);
		t0 = now_ns();
		f->errors += kvr_request_prefill_done(f->r, d.attempt) != 0;
		life_note(f, L_PREFILL, now_ns() - t0);
		uint32_t tok = 7;
		for (int k = 0; k < 3; k++) {
			t0 = now_ns();
			f->errors += kvr_request_output(f->r, d.attempt, &tok, 1) != 0;
			life_note(f, L_OUTPUT, now_ns() - t0);
		}
		life_sleep(f->decode_ns);
		t0 = now_ns();
		f->errors += kvr_request_finish(f->r, d.attempt) != 0;
		life_note(f, L_FINISH, now_ns() - t0);
	}
	return NULL;
}

static void run_life(uint64_t ms, int fronts, int ranks, uint64_t prefill_us, uint64_t decode_us)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.queue_capacity = 4096;
	struct kvr_router *r;
	int rc;
	if ((rc = kvr_router_create(&c, &r)))
		die("kvr_router_create", rc);
	for (int i = 0; i < ranks; i++)
		if ((rc = kvr_rank_add(r, (struct kvr_rank_id){(uint64_t)i, 0}, 1, 100000, 1024)))
			die("kvr_rank_add", rc);
	int stop = 0;
	struct life_front *f = calloc((size_t)fronts, sizeof(*f));
	pthread_t *th = calloc((size_t)fronts, sizeof(*th));
	if (!f || !th)
		die("calloc", KVR_ENOMEM);
	for (int i = 0; i < fronts; i++) {
		f[i] = (struct life_front){.r = r,
		                           .id = i,
		                           .prefill_ns = prefill_us * 1000,
		                           .decode_ns = decode_us * 1000,
		                           .stop = &stop};
		for (int k = 0; k < L_KINDS; k++)
			if (!(f[i].v[k] = malloc(LIFE_MAX * sizeof(uint64_t))))
				die("malloc", KVR_ENOMEM);
		if (pthread_create(&th[i], NULL, life_main, &f[i]))
			die("pthread_create", KVR_ENOMEM);
	}
	life_sleep(ms * 1000000);
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
	uint64_t errors = 0;
	for (int i = 0; i < fronts; i++) {
		pthread_join(th[i], NULL);
		errors += f[i].errors;
	}
	for (int k = 0; k < L_KINDS; k++) {
		size_t n = 0;
		for (int i = 0; i < fronts; i++)
			n += f[i].n[k] < LIFE_MAX ? f[i].n[k] : LIFE_MAX;
		uint64_t *all = malloc((n ? n : 1) * sizeof(*all));
		if (!all)
			die("malloc", KVR_ENOMEM);
		size_t m = 0;
		for (int i = 0; i < fronts; i++) {
			size_t c2 = f[i].n[k] < LIFE_MAX ? f[i].n[k] : LIFE_MAX;
			memcpy(all + m, f[i].v[k], c2 * sizeof(*all));
			m += c2;
		}
		if (k == L_ROUTE)
			printf("SUMMARY bench=queue_life fronts=%d ranks=%d prefill_us=%" PRIu64
			       " decode_us=%" PRIu64 " routes_s=%.0f errors=%" PRIu64 "\n",
			       fronts, ranks, prefill_us, decode_us,
			       (double)n * 1000.0 / (double)ms, errors);
		if (n)
			printf("SUMMARY bench=queue_life call=%s n=%zu p50_us=%.2f p99_us=%.2f "
			       "max_us=%.2f\n",
			       life_name[k], n, pct(all, n, 0.5), pct(all, n, 0.99),
			       pct(all, n, 1.0));
		free(all);
	}
	for (int i = 0; i < fronts; i++)
		for (int k = 0; k < L_KINDS; k++)
			free(f[i].v[k]);
	free(f);
	free(th);
	kvr_router_destroy(r);
}

int main(int argc, char **argv)
{
	uint64_t life_ms = 0, prefill_us = 200, decode_us = 500;
	int fronts = 4, ranks = 2;
	uint64_t depths[MAX_DEPTHS] = {1000, 4000, 8000, 16000};
	size_t n_depths = 4;
	uint64_t window = 512;
	int policy = 2, unc = 2; /* 0, 1 or both */
	int restricted = -1;     /* 0 pin, 1 allow */
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
		} else if (!strcmp(argv[i], "--restricted")) {
			const char *s = opt_str(argc, argv, i);
			if (!strcmp(s, "pin"))
				restricted = 0;
			else if (!strcmp(s, "allow"))
				restricted = 1;
			else
				opt_bad(argv, i, "pin or allow", s);
		} else if (!strcmp(argv[i], "--life-ms")) {
			life_ms = opt_u64(argc, argv, i, 1, 3600000);
		} else if (!strcmp(argv[i], "--fronts")) {
			fronts = (int)opt_u64(argc, argv, i, 1, 64);
		} else if (!strcmp(argv[i], "--ranks")) {
			ranks = (int)opt_u64(argc, argv, i, 1, 64);
		} else if (!strcmp(argv[i], "--prefill-us")) {
			prefill_us = opt_u64(argc, argv, i, 0, 1000000);
		} else if (!strcmp(argv[i], "--decode-us")) {
			decode_us = opt_u64(argc, argv, i, 0, 1000000);
		} else {
			opt_unknown(argv, i);
		}
	}
	if (life_ms) {
		run_life(life_ms, fronts, ranks, prefill_us, decode_us);
		return 0;
	}
	if (restricted >= 0) {
		for (int p = 0; p < 2; p++)
			if (policy == 2 || policy == p)
				run_restricted(p == 1, restricted == 1, depths, n_depths, window);
		return 0;
	}
	/* Ascending, so that one fill serves every depth. */
	qsort(depths, n_depths, sizeof(depths[0]), cmp_u64);
	for (int p = 0; p < 2; p++)
		for (int u = 0; u < 2; u++)
			if ((policy == 2 || policy == p) && (unc == 2 || unc == u))
				run(p == 1, u == 1, depths, n_depths, window);
	return 0;
}
