/*
 * soak - hours of mixed traffic at a steady rate: does anything grow that should not?
 *
 * Frontend threads send session-like requests at a fixed total rate (prompts of 256 to 8k
 * tokens that share prefixes, as agents re-sending a growing conversation do); each request
 * lives a few tens of milliseconds: prefill done, some output tokens, then finish (5 % abort,
 * 0.5 % simply vanish and are left to the lease reaper).  The cluster saturates now and then,
 * so the admission queue is used (on_admit).  An admin step every few seconds resets, resizes,
 * or removes and re-adds a rank.
 *
 * Every report interval (default 60 s) it prints one line: routes/s, requests in flight, queue
 * depth, the router's live allocation counter (kvr_alloc_live_bytes), the process RSS, and the
 * invariants: resident <= capacity on every rank, the router's active requests equal the ones
 * the soak holds (once the vanished ones are expired).  At the end it drains everything and
 * checks all load is zero, then prints a SUMMARY line with the RSS and live bytes after warm-up
 * and at the end, and their ratio (flat = 1.00).
 *
 * usage: soak [--seconds N] [--rate R] [--threads T] [--ranks K] [--report-s S] [--warmup-s W]
 * Not a test: run it by hand (it takes as long as you ask).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "tests/common/xorshift.h"

#define MAX_INFLIGHT 4096
#define CAPACITY     30000 /* blocks per rank */

static struct kvr_router *R;
static atomic_int stop;
static atomic_uint_fast64_t n_routes, n_queued, n_aborted, n_vanished, n_finished, n_stale,
    n_errors, n_admin, n_admitted_later;
static atomic_int failed;
static int n_ranks = 8;

static uint64_t rss_kib(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	unsigned long size = 0, res = 0;
	if (f) {
		if (fscanf(f, "%lu %lu", &size, &res) != 2)
			res = 0;
		fclose(f);
	}
	return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE) / 1024;
}

/* Admitted later by the queue: handed to the frontend that owns the slot table (any frontend). */
static pthread_mutex_t late_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t late[MAX_INFLIGHT];
static size_t n_late;

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	if (d->status != KVR_DECIDED)
		return; /* failed admission (its rank went away): nothing to finish */
	atomic_fetch_add(&n_admitted_later, 1);
	pthread_mutex_lock(&late_mu);
	if (n_late < MAX_INFLIGHT)
		late[n_late++] = d->attempt;
	else if (kvr_request_finish(R, d->attempt) != 0)
		atomic_fetch_add(&n_errors, 1);
	pthread_mutex_unlock(&late_mu);
}

struct req {
	uint64_t attempt;
	uint64_t next_ns; /* next step due */
	int step;         /* 0: prefill done due, 1..k: output, then finish */
	int outputs;
	bool vanish;
};

struct frontend {
	pthread_t th;
	int id;
	double rate; /* requests per second */
	struct req live[MAX_INFLIGHT];
	int n_live;
	atomic_int n_live_pub; /* for the reporter */
};

static void step(struct frontend *f, int k, uint64_t now, uint64_t *seed)
{
	struct req *q = &f->live[k];
	int rc = 0;
	uint32_t out[32];
	if (q->step == 0) {
		rc = kvr_request_prefill_done(R, q->attempt);
	} else if (q->step <= q->outputs) {
		for (int i = 0; i < 32; i++)
			out[i] = (uint32_t)xorshift64(seed);
		rc = kvr_request_output(R, q->attempt, out, 16 + xorshift64(seed) % 17);
	} else {
		if (xorshift64(seed) % 20 == 0) {
			rc = kvr_request_abort(R, q->attempt);
			atomic_fetch_add(&n_aborted, 1);
		} else {
			rc = kvr_request_finish(R, q->attempt);
			atomic_fetch_add(&n_finished, 1);
		}
		if (rc == KVR_ESTALE)
			atomic_fetch_add(&n_stale, 1); /* its rank was reset or removed */
		else if (rc)
			atomic_fetch_add(&n_errors, 1);
		f->live[k] = f->live[--f->n_live];
		return;
	}
	if (rc == KVR_ESTALE) {
		atomic_fetch_add(&n_stale, 1);
		f->live[k] = f->live[--f->n_live];
		return;
	}
	if (rc)
		atomic_fetch_add(&n_errors, 1);
	q->step++;
	q->next_ns = now + 2000000 + xorshift64(seed) % 8000000;
}

static void adopt(struct frontend *f, uint64_t attempt, uint64_t now, uint64_t *seed)
{
	if (f->n_live == MAX_INFLIGHT) {
		if (kvr_request_finish(R, attempt) != 0)
			atomic_fetch_add(&n_errors, 1);
		return;
	}
	bool vanish = xorshift64(seed) % 200 == 0;
	if (vanish) {
		atomic_fetch_add(&n_vanished, 1); /* never touched again: the reaper's */
		return;
	}
	f->live[f->n_live++] = (struct req){.attempt = attempt,
	                                    .next_ns = now + 5000000 + xorshift64(seed) % 20000000,
	                                    .outputs = 1 + (int)(xorshift64(seed) % 6)};
}

static void *frontend_main(void *arg)
{
	struct frontend *f = arg;
	uint64_t seed = 0x9e3779b97f4a7c15ull * (uint64_t)(f->id + 1);
	static _Thread_local uint32_t tok[8192];
	uint64_t period = (uint64_t)(1e9 / f->rate), next = now_ns();
	while (!atomic_load(&stop)) {
		uint64_t now = now_ns();
		for (int k = 0; k < f->n_live;)
			if (f->live[k].next_ns <= now) {
				int before = f->n_live;
				step(f, k, now, &seed);
				if (f->n_live == before)
					k++;
			} else {
				k++;
			}
		pthread_mutex_lock(&late_mu);
		while (n_late && f->n_live < MAX_INFLIGHT) {
			uint64_t a = late[--n_late];
			pthread_mutex_unlock(&late_mu);
			adopt(f, a, now, &seed);
			pthread_mutex_lock(&late_mu);
		}
		pthread_mutex_unlock(&late_mu);
		if (now < next) {
			uint64_t wait = next - now;
			struct timespec ts = {0, (long)(wait < 1000000 ? wait : 1000000)};
			nanosleep(&ts, NULL);
			continue;
		}
		next += period;
		if (now > next + 1000000000ull)
			next = now; /* fell behind by a second: do not burst */
		/* a session: family (shared system prompt + history), grows turn by turn */
		uint32_t fam = (uint32_t)(xorshift64(&seed) % 64);
		size_t turn = 1 + xorshift64(&seed) % 16;
		size_t n = 256 + turn * 480 + xorshift64(&seed) % 64;
		for (size_t i = 0; i < n; i++)
			tok[i] =
			    i < n - 64 ? fam * 1000003u + (uint32_t)i : (uint32_t)xorshift64(&seed);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n;
		q.request_id = xorshift64(&seed);
		q.expected_output_tokens = 128;
		struct kvr_decision d;
		int rc = kvr_route(R, &q, &d);
		atomic_fetch_add(&n_routes, 1);
		if (rc == 0 && d.status == KVR_DECIDED)
			adopt(f, d.attempt, now, &seed);
		else if (rc == 0)
			atomic_fetch_add(&n_queued, 1); /* on_admit hands it over */
		else if (rc != KVR_EAGAIN && rc != KVR_ENOENT)
			atomic_fetch_add(&n_errors, 1);
		atomic_store(&f->n_live_pub, f->n_live);
	}
	/* drain: finish what this frontend holds */
	for (int k = 0; k < f->n_live; k++) {
		int rc = kvr_request_finish(R, f->live[k].attempt);
		if (rc && rc != KVR_ESTALE)
			atomic_fetch_add(&n_errors, 1);
	}
	f->n_live = 0;
	atomic_store(&f->n_live_pub, 0);
	return NULL;
}

static void admin_step(uint64_t *seed, uint64_t *inc)
{
	int i = (int)(xorshift64(seed) % (uint64_t)n_ranks);
	struct kvr_rank_id id = {(uint64_t)i, 0};
	switch (xorshift64(seed) % 3) {
	case 0:
		kvr_rank_reset(R, id, ++inc[i]);
		break;
	case 1:
		kvr_rank_set_capacity(R, id, inc[i],
		                      xorshift64(seed) % 2 ? CAPACITY : CAPACITY / 2);
		break;
	default:
		kvr_rank_remove(R, id);
		if (kvr_rank_add(R, id, ++inc[i], CAPACITY, 2048) != 0)
			atomic_fetch_add(&n_errors, 1);
		break;
	}
	atomic_fetch_add(&n_admin, 1);
}

/* resident <= capacity on every rank; returns the sum of active requests. */
static uint64_t check_ranks(uint64_t *resident_max)
{
	uint64_t active = 0;
	*resident_max = 0;
	for (int i = 0; i < n_ranks; i++) {
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(R, (struct kvr_rank_id){(uint64_t)i, 0}, &s) != 0)
			continue;
		if (s.resident_blocks > s.capacity_blocks) {
			fprintf(stderr,
			        "soak: rank %d resident %" PRIu64 " > capacity %" PRIu64 "\n", i,
			        s.resident_blocks, s.capacity_blocks);
			atomic_store(&failed, 1);
		}
		if (s.resident_blocks > *resident_max)
			*resident_max = s.resident_blocks;
		active += s.active_requests;
	}
	return active;
}

static uint64_t queue_depth(void)
{
	static char buf[1 << 16];
	size_t len;
	if (kvr_metrics_render(R, buf, sizeof(buf), &len) != 0)
		return 0;
	const char *p = strstr(buf, "\nkvr_queue_depth ");
	return p ? strtoull(p + 17, NULL, 10) : 0;
}

int main(int argc, char **argv)
{
	double seconds = 60, rate = 1000;
	int threads = 2, report_s = 60, warmup_s = -1;
	/* usage: soak [--seconds N] [--rate R] [--threads T 1..16] [--ranks K 1..256]
	 *             [--report-s S] [--warmup-s W] */
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--seconds"))
			seconds = opt_f64(argc, argv, i, 0, 1e7);
		else if (!strcmp(argv[i], "--rate"))
			rate = opt_f64(argc, argv, i, 1e-3, 1e9);
		else if (!strcmp(argv[i], "--threads"))
			threads = (int)opt_u64(argc, argv, i, 1, 16);
		else if (!strcmp(argv[i], "--ranks"))
			n_ranks = (int)opt_u64(argc, argv, i, 1, 256);
		else if (!strcmp(argv[i], "--report-s"))
			report_s = (int)opt_u64(argc, argv, i, 1, 10000000);
		else if (!strcmp(argv[i], "--warmup-s"))
			warmup_s = (int)opt_u64(argc, argv, i, 0, 10000000);
		else
			opt_unknown(argv, i);
	}
	if (warmup_s < 0)
		warmup_s = seconds >= 600 ? 300 : (int)(seconds / 3);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.queue_capacity = 256;
	c.on_admit = on_admit;
	c.lease_scan_interval_ns = 5000000000ull; /* vanished requests expire in 5-10 s */
	c.shard_idle_spin_ns = 0;                 /* a shared machine: park when idle */
	if (kvr_router_create(&c, &R) != 0)
		return 1;
	uint64_t inc[256] = {0};
	for (int i = 0; i < n_ranks; i++)
		kvr_rank_add(R, (struct kvr_rank_id){(uint64_t)i, 0}, 0, CAPACITY, 2048);
	struct frontend *fe = calloc((size_t)threads, sizeof(*fe));
	if (!fe)
		return 1;
	for (int i = 0; i < threads; i++) {
		fe[i].id = i;
		fe[i].rate = rate / threads;
		pthread_create(&fe[i].th, NULL, frontend_main, &fe[i]);
	}
	printf("soak: %.0f s at %.0f requests/s, %d frontends, %d ranks, report every %d s, "
	       "warm-up %d s\n",
	       seconds, rate, threads, n_ranks, report_s, warmup_s);
	printf("%8s %9s %9s %8s %7s %10s %12s %9s %s\n", "t_s", "routes/s", "inflight", "router",
	       "queue", "res_max", "live_bytes", "rss_kib", "errors");
	uint64_t t0 = now_ns(), last = t0, last_routes = 0, seed = 42;
	uint64_t warm_rss = 0, warm_live = 0;
	int64_t live_min = INT64_MAX, live_max = 0;
	uint64_t next_admin = t0 + 3000000000ull;
	for (;;) {
		struct timespec ts = {0, 200000000};
		nanosleep(&ts, NULL);
		uint64_t now = now_ns();
		if (now >= next_admin) {
			admin_step(&seed, inc);
			next_admin = now + 3000000000ull;
		}
		bool end = now - t0 >= (uint64_t)(seconds * 1e9);
		if (now - last < (uint64_t)report_s * 1000000000ull && !end)
			continue;
		uint64_t routes = atomic_load(&n_routes);
		uint64_t inflight = 0;
		for (int i = 0; i < threads; i++)
			inflight += (uint64_t)atomic_load(&fe[i].n_live_pub);
		uint64_t res_max;
		uint64_t active = check_ranks(&res_max);
		int64_t live = kvr_alloc_live_bytes();
		uint64_t rss = rss_kib();
		double t = (double)(now - t0) / 1e9;
		printf("%8.0f %9.0f %9" PRIu64 " %8" PRIu64 " %7" PRIu64 " %10" PRIu64 " %12" PRId64
		       " %9" PRIu64 " %" PRIu64 "\n",
		       t, (double)(routes - last_routes) / ((double)(now - last) / 1e9), inflight,
		       active, queue_depth(), res_max, live, rss, atomic_load(&n_errors));
		fflush(stdout);
		if (t >= warmup_s) {
			if (!warm_rss) {
				warm_rss = rss;
				warm_live = (uint64_t)live;
			}
			if (live < live_min)
				live_min = live;
			if (live > live_max)
				live_max = live;
		}
		last = now;
		last_routes = routes;
		if (end)
			break;
	}
	atomic_store(&stop, 1);
	for (int i = 0; i < threads; i++)
		pthread_join(fe[i].th, NULL);
	/* Whatever the queue admits while draining lands in late[]: finish it, until quiet.  The
	 * vanished requests are the reaper's: wait two scan intervals for them. */
	for (int round = 0; round < 100; round++) {
		pthread_mutex_lock(&late_mu);
		while (n_late) {
			uint64_t a = late[--n_late];
			pthread_mutex_unlock(&late_mu);
			int rc = kvr_request_finish(R, a);
			if (rc && rc != KVR_ESTALE)
				atomic_fetch_add(&n_errors, 1);
			pthread_mutex_lock(&late_mu);
		}
		pthread_mutex_unlock(&late_mu);
		kvr_router_sync(R, 5000);
		uint64_t res_max;
		if (check_ranks(&res_max) == 0 && queue_depth() == 0)
			break;
		struct timespec ts = {0, 200000000};
		nanosleep(&ts, NULL);
	}
	uint64_t res_max;
	uint64_t active = check_ranks(&res_max);
	bool idle = active == 0 && queue_depth() == 0;
	for (int i = 0; i < n_ranks && idle; i++) {
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(R, (struct kvr_rank_id){(uint64_t)i, 0}, &s) == 0 &&
		    (s.active_prefill_tokens || s.active_blocks))
			idle = false;
	}
	uint64_t end_rss = rss_kib();
	int64_t end_live = kvr_alloc_live_bytes();
	printf("soak: %" PRIu64 " routes (%" PRIu64 " queued, %" PRIu64 " admitted later), %" PRIu64
	       " finished, %" PRIu64 " aborted, %" PRIu64 " vanished (reaped), %" PRIu64
	       " stale, %" PRIu64 " admin steps, %" PRIu64 " errors; after draining: %s\n",
	       atomic_load(&n_routes), atomic_load(&n_queued), atomic_load(&n_admitted_later),
	       atomic_load(&n_finished), atomic_load(&n_aborted), atomic_load(&n_vanished),
	       atomic_load(&n_stale), atomic_load(&n_admin), atomic_load(&n_errors),
	       idle ? "all load zero" : "LOAD LEFT");
	printf("SUMMARY soak seconds=%.0f rate=%.0f rss_warm_kib=%" PRIu64 " rss_end_kib=%" PRIu64
	       " rss_ratio=%.3f live_warm=%" PRIu64 " live_min=%" PRId64 " live_max=%" PRId64
	       " live_end=%" PRId64 " live_ratio=%.3f errors=%" PRIu64 " idle=%d\n",
	       seconds, rate, warm_rss, end_rss, warm_rss ? (double)end_rss / (double)warm_rss : 0,
	       warm_live, live_min == INT64_MAX ? 0 : live_min, live_max, end_live,
	       warm_live ? (double)end_live / (double)warm_live : 0, atomic_load(&n_errors), idle);
	kvr_router_destroy(R);
	free(fe);
	return atomic_load(&failed) || !idle || atomic_load(&n_errors) ? 1 : 0;
}
