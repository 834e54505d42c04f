/*
 * bench_route - the whole route decision against its floor, on session-like prompts.
 *
 * Workload (issue 11, Targets): 64 ranks; prompts of 2k, 8k, 32k and 128k tokens from a
 * session-like mix: every prompt after the first of its length keeps a 50-100 % prefix of an
 * earlier prompt (a conversation or agent growing its context) and fills the rest with fresh
 * tokens.  Each iteration, on each frontend thread (1 and 2 threads):
 *     floor:   kvr_hash_blocks on the prompt (the hashing kvr_route must do anyway),
 *     route:   kvr_route on the same prompt,
 *     finish:  kvr_request_finish on its attempt (a lifecycle call),
 * each timed on its own.  The shards run (they book what the frontends post); sync_booking is
 * off unless --sync-booking 1.  A sampler thread reads every shard's routing-lane depth every
 * 100 us (--sample-us: its period, 0 = none; its wake-ups preempt frontends on a machine with
 * no idle core: with it off, 2k routes switched out 1.9 -> 0.75-1.16 %).  After the run the
 * router is synced and the routing-lane tasks the shards ran
 * (bookings and finishes) are divided by the time until the lanes were empty.
 *
 * Also timed, after the finish: the index lookup kvr_route makes (kvr_index_find_matches on the
 * prompt's sequence hashes, in a read section), so a route splits into hashing (the floor), the
 * lookup (core/index*.c) and the router's own work: `own` = route - lookup, per iteration.
 * Quantiles are exact (every sample kept, sorted), not histogram buckets: the 4-per-octave
 * buckets of core/metrics.h moved a ratio by up to 25 %.
 *
 * SUMMARY per (length, threads): route p50/p99 and their ratios to the floor's p50/p99 (same
 * thread, same prompts, same run), lookup p50 and own p50 with their ratios to the floor's p50
 * (own_ratio: what the route would cost against the floor if the lookup were free), finish
 * p99, shard tasks/s per shard (wall clock until the
 * lanes drained: what the frontends offered when the shards keep up) and per second of shard
 * thread CPU (the shards' capacity, which the wall figure hides once the frontends are the
 * bottleneck), lane depth max and mean, how many routes found the lane full (KVR_EAGAIN
 * after the bounded wait), and how often per route a post had to wake a parked shard (a futex
 * wake on the caller's thread: what the p99s of an idle-enough router pay) or left the wake to
 * the shard's own bounded park (a lazy lifecycle post), and the shards' CPU per route, busy
 * and idle-polling (the drain after the run included); blocks evicted per route and the
 * predicted overlap's share of the routed blocks (a lane deep enough to make decisions stale
 * shows in both); how often a post waited for lane room, and how often a route allocated its
 * attempt record (the pool had none).
 *
 * Tails, counted not timed: around every route and finish the thread's own counters are read
 * (kvr_shard_thread_costs: lane waits, their sleeps, FUTEX_WAKEs, waits at the soft depth;
 * records allocated), and of
 * the calls at or above the 99th percentile the SUMMARY gives the share that paid each of
 * those costs and the share that paid none of them (route_tail_* / finish_tail_*).  Also
 * whether the thread was switched out during the call (route_tail_switched,
 * finish_tail_switched, and of all calls route_switched_frac / finish_switched_frac: a store
 * and a load of the thread's rseq area around each call, see switch_arm): a switch the
 * library caused (a sched_yield, a sleep, a wake that preempts its caller) or plain
 * preemption.  "none" is what is left: cache misses, interrupts, page faults, the machine.
 *
 * --rate R paces each frontend thread at R routes/s (open loop), below what the shards can book,
 * so the latencies are those of a router that keeps up rather than of full lanes.
 *
 * usage: bench_route [--ms N per config] [--lengths 2048,8192,...] [--ranks N] [--shards N]
 *                    [--capacity BLOCKS] [--sync-booking 0|1] [--threads-max N] [--rate R]
 *                    [--lane-capacity N] (kvr_config.lane_capacity)
 *                    [--soft-depth N] (kvr_config.lane_soft_depth; 0 = off; SUMMARY: the
 *                    bookings per route that waited at it and that spilled past it)
 *                    [--spin-us US] (shard_idle_spin_ns: how long an idle shard polls before it
 *                    parks; paced runs with a spin longer than the gap never wake a shard)
 *                    [--iters N] (each thread stops after N routes, or at --ms: the same work
 *                    for callgrind, whose speed would otherwise set how many routes it counts)
 *                    [--cpus C0,C1,...] (frontend thread t pinned to C[t % n]; the shards take
 *                    CPUs 0, 1, ... in order: --shards 1 --cpus 1 puts the frontend on the
 *                    other core, as a deployment would, instead of wherever the scheduler
 *                    puts it, sometimes the shard's core, where no line crosses cores)
 *                    [--booking-lazy-us US] (kvr_config.booking_lazy_ns; 0 = every booking
 *                    wakes a parked shard; SUMMARY: soon_parks_per_route, the short parks
 *                    the shards took, each ended by a self-wake or a post)
 *                    [--sample-us US] (the lane-depth sampler's period, default 100; 0 = no
 *                    sampling: lane_depth_max and _mean read 0)
 *                    [--burst N [--burst-gap-us G] [--burst-rest-us R] [--burst-prefilled
 *                    0|1]] (instead of the runs above: the booking delay's effect on the next
 *                    decisions, see burst() below)
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <sys/rseq.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/index.h"
#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "shards/owner.h"
#include "shards/runtime.h"
#include "sync/rcu.h"
#include "tests/common/mono_clock.h"
#include "tests/common/xorshift.h"

#define MAX_THREADS 8

static uint32_t **prompts;
static size_t n_prompts, prompt_len;
static atomic_int go, stop;
static uint64_t pace_ns; /* --rate: ns between one thread's routes; 0 = as fast as possible */
static uint64_t iters;   /* --iters: routes per thread, then stop (callgrind: equal work) */
static atomic_int done;  /* threads that reached --iters */
static int front_cpus[MAX_THREADS]; /* --cpus: frontend thread t runs on front_cpus[t % n] */
static int n_front_cpus;            /* 0: not pinned (the scheduler places them) */

/* Session-like prompts of len tokens: each keeps a 50-100 % prefix of one of the previous 16. */
static void make_prompts(size_t len, size_t n)
{
	prompts = calloc(n, sizeof(*prompts));
	uint64_t s = 0x9e3779b97f4a7c15ull ^ len;
	uint32_t fresh = 1u << 30;
	for (size_t i = 0; i < n; i++) {
		uint32_t *p = malloc(len * sizeof(uint32_t));
		size_t keep = 0;
		if (i > 0) {
			size_t from = i - 1 - (size_t)(xorshift64(&s) % (i < 16 ? i : 16));
			keep = len / 2 + (size_t)(xorshift64(&s) % (len / 2 + 1));
			if (keep > len)
				keep = len;
			memcpy(p, prompts[from], keep * sizeof(uint32_t));
		}
		for (size_t k = keep; k < len; k++)
			p[k] = fresh++;
		prompts[i] = p;
	}
	n_prompts = n;
	prompt_len = len;
}

static void free_prompts(void)
{
	for (size_t i = 0; i < n_prompts; i++)
		free(prompts[i]);
	free(prompts);
	prompts = NULL;
	n_prompts = 0;
}

/* Every sample of one quantity, for exact quantiles. */
struct samples {
	uint64_t *v;
	size_t n, cap;
};

static void sample(struct samples *s, uint64_t x)
{
	if (s->n == s->cap) {
		size_t nc = s->cap ? 2 * s->cap : 1 << 16;
		uint64_t *v = realloc(s->v, nc * sizeof(*v));
		if (!v)
			return; /* out of memory: the quantiles come from what was kept */
		s->v = v;
		s->cap = nc;
	}
	s->v[s->n++] = x;
}

/* Appends src to dst (merging threads), frees src. */
static void merge(struct samples *dst, struct samples *src)
{
	for (size_t i = 0; i < src->n; i++)
		sample(dst, src->v[i]);
	free(src->v);
	*src = (struct samples){0};
}

/* The q-quantile (0..1) of s (sorted here); 0 when empty. */
static uint64_t quantile(struct samples *s, double q)
{
	if (!s->n)
		return 0;
	qsort(s->v, s->n, sizeof(*s->v), cmp_u64);
	size_t i = (size_t)(q * (double)(s->n - 1) + 0.5);
	return s->v[i < s->n ? i : s->n - 1];
}

/* Reads every token of p[0..n) once (one load per cache line would do; the sum keeps it). */
static uint64_t touch_tokens(const uint32_t *p, size_t n)
{
	uint64_t s = 0;
	for (size_t i = 0; i < n; i++)
		s += __atomic_load_n(&p[i], __ATOMIC_RELAXED);
	return s;
}

struct worker {
	pthread_t th;
	struct kvr_router *r;
	int id;
	struct samples floor, route, fin, lookup, own;
	struct samples route_why, fin_why; /* per sample: what the call's thread paid (COST_*) */
	uint64_t n, full, errors, allocs;
	uint64_t touched; /* keeps touch_tokens' reads */
	uint64_t end_ns;  /* when it stopped routing (--iters: before --ms) */
	uint64_t *local, *seq;
	struct kvr_index_match *match;
};

/* What slowed a call, counted on its thread around it (bits of a route_why / fin_why sample). */
#define COST_LANE_WAIT    1u  /* a post found its lane full and waited for room */
#define COST_WAIT_SLEEP   2u  /* ... and slept (nanosleep) in that wait */
#define COST_FUTEX_WAKE   4u  /* a post woke a parked shard (FUTEX_WAKE) */
#define COST_RECORD_ALLOC 8u  /* the attempt record was allocated (the pool had none) */
#define COST_THROTTLE     16u /* the booking waited at the lane's soft depth */
#define COST_SWITCHED     32u /* the thread was switched out (or signalled) during the call */
#define COST_KINDS        6

/* Switched out during a call, for nearly nothing: glibc registers every thread's rseq area,
 * and on the way back to user space after the thread was switched out (or a signal) the
 * kernel rewrites its cpu_id_start (linux/rseq.h).  So a sentinel stored there before a call
 * and found replaced after it says the call was descheduled: a store and a load, where
 * getrusage(RUSAGE_THREAD) around every call is two system calls (~0.5 us each here).
 * switch_probe_ok() checks that this kernel does it (a sleep must replace the sentinel);
 * without rseq (valgrind, glibc.pthread.rseq=0) the columns read -1.  Checked against
 * getrusage's ru_nivcsw around every finish in a temporary build (docs/measurements.md,
 * "Finish tails with two frontends"): no sentinel replaced without a context switch.  Nothing
 * else in this process reads cpu_id_start (glibc's sched_getcpu reads cpu_id; jemalloc and
 * liburcu use no rseq). */
#define SWITCH_SENTINEL 0xfffffffeu

static volatile struct rseq *rseq_area(void)
{
	if (__rseq_size < 8)
		return NULL;
	return (volatile struct rseq *)((char *)__builtin_thread_pointer() + __rseq_offset);
}

static bool switch_probe_ok(void)
{
	volatile struct rseq *rs = rseq_area();
	if (!rs)
		return false;
	rs->cpu_id_start = SWITCH_SENTINEL;
	struct timespec ts = {0, 1000};
	nanosleep(&ts, NULL);
	return rs->cpu_id_start != SWITCH_SENTINEL;
}

static inline void switch_arm(volatile struct rseq *rs)
{
	if (rs)
		rs->cpu_id_start = SWITCH_SENTINEL;
}

static inline uint64_t switch_seen(volatile struct rseq *rs)
{
	return rs && rs->cpu_id_start != SWITCH_SENTINEL ? COST_SWITCHED : 0;
}

static void costs_now(struct kvr_post_costs *c, uint64_t *allocs)
{
	kvr_shard_thread_costs(c);
	*allocs = kvr_owner_thread_record_allocs();
}

static uint64_t costs_between(const struct kvr_post_costs *a, uint64_t aa,
                              const struct kvr_post_costs *b, uint64_t ba)
{
	return (b->full_waits > a->full_waits ? COST_LANE_WAIT : 0) |
	       (b->wait_sleeps > a->wait_sleeps ? COST_WAIT_SLEEP : 0) |
	       (b->futex_wakes > a->futex_wakes ? COST_FUTEX_WAKE : 0) |
	       (ba > aa ? COST_RECORD_ALLOC : 0) |
	       (b->soft_throttles > a->soft_throttles ? COST_THROTTLE : 0);
}

static bool switch_ok; /* switch_probe_ok(), once */

static void *run(void *arg)
{
	struct worker *w = arg;
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = prompt_len;
	size_t i = (size_t)w->id * 7919;
	if (n_front_cpus) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(front_cpus[w->id % n_front_cpus], &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	volatile struct rseq *rs = switch_ok ? rseq_area() : NULL;
	while (!atomic_load(&go))
		;
	uint64_t next = mono_ns();
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		if (pace_ns) { /* open loop at --rate: sleep to the next arrival */
			next += pace_ns;
			uint64_t now = mono_ns();
			if (next > now) {
				struct timespec ts = {(time_t)((next - now) / 1000000000u),
				                      (long)((next - now) % 1000000000u)};
				nanosleep(&ts, NULL);
			}
		}
		const uint32_t *p = prompts[i++ % n_prompts];
		q.tokens = p;
		struct kvr_decision d;
		struct kvr_post_costs c0, c1, c2;
		uint64_t a0, a1, a2;
		/* The prompt's tokens are read first, as a frontend that has just tokenized it has
		 * them: the floor, timed first, used to pay their cache misses alone (8 KB at 2k;
		 * on a host whose caches did not keep the prompts, floor p50 1,262 ns against 895
		 * for the same hashing inside kvr_route right after it), which flattered the
		 * ratios. */
		w->touched += touch_tokens(p, prompt_len);
		costs_now(&c0, &a0); /* outside the floor's and the route's times */
		uint64_t t0 = mono_ns();
		kvr_hash_blocks(p, prompt_len, 16, NULL, w->local, w->seq);
		switch_arm(rs); /* around the route's time, outside it but for a store */
		uint64_t t1 = mono_ns();
		int rc = kvr_route(w->r, &q, &d);
		uint64_t t2 = mono_ns();
		uint64_t route_sw = switch_seen(rs);
		costs_now(&c1, &a1);
		if (rc == KVR_EAGAIN) {
			w->full++;
			continue;
		}
		if (rc) {
			w->errors++;
			continue;
		}
		/* The floor with the route or not at all: its quantiles and the ratios to it are
		 * over the same iterations (it was sampled before a full lane or an error skipped
		 * the route's). */
		sample(&w->floor, t1 - t0);
		sample(&w->route, t2 - t1);
		sample(&w->route_why, costs_between(&c0, a0, &c1, a1) | route_sw);
		switch_arm(rs);
		uint64_t t2b = mono_ns();
		kvr_request_finish(w->r, d.attempt);
		uint64_t t3 = mono_ns();
		uint64_t fin_sw = switch_seen(rs);
		costs_now(&c2, &a2);
		sample(&w->fin, t3 - t2b);
		sample(&w->fin_why, costs_between(&c1, a1, &c2, a2) | fin_sw);
		/* The lookup alone, on the hashes the floor computed (the same as kvr_route's). */
		size_t nm;
		kvr_rcu_read_lock();
		uint64_t t4 = mono_ns();
		kvr_index_find_matches(w->r->index, w->seq, prompt_len / 16, NULL, w->match,
		                       w->r->cfg.max_ranks, &nm);
		uint64_t t5 = mono_ns();
		kvr_rcu_read_unlock();
		sample(&w->lookup, t5 - t4);
		sample(&w->own, t2 - t1 > t5 - t4 ? (t2 - t1) - (t5 - t4) : 0);
		w->allocs += a1 > a0;
		if (++w->n == iters) {
			atomic_fetch_add(&done, 1);
			break;
		}
	}
	w->end_ns = mono_ns();
	return NULL;
}

/* Of the calls at or above the 99th percentile of v (why: the same calls' COST_* bits), the
 * share that paid each cost and that paid none (out[0..6]: lane wait, wait sleep, futex wake,
 * record allocation, soft throttle, switched out, none).  Before quantile() sorts v. */
static void tail_why(const struct samples *v, const struct samples *why, double out[COST_KINDS + 1])
{
	for (int k = 0; k <= COST_KINDS; k++)
		out[k] = 0;
	if (!v->n || why->n != v->n)
		return;
	uint64_t *c = malloc(v->n * sizeof(uint64_t));
	if (!c)
		return;
	memcpy(c, v->v, v->n * sizeof(uint64_t));
	qsort(c, v->n, sizeof(uint64_t), cmp_u64);
	size_t i99 = (size_t)(0.99 * (double)(v->n - 1) + 0.5);
	uint64_t thr = c[i99 < v->n ? i99 : v->n - 1];
	free(c);
	size_t n = 0;
	for (size_t i = 0; i < v->n; i++) {
		if (v->v[i] < thr)
			continue;
		n++;
		for (int k = 0; k < COST_KINDS; k++)
			out[k] += (why->v[i] >> k) & 1;
		out[COST_KINDS] += why->v[i] == 0;
	}
	for (int k = 0; k <= COST_KINDS; k++)
		out[k] /= (double)n;
}

/* The share of all calls (why: their COST_* bits) that were switched out. */
static double switched_frac(const struct samples *why)
{
	size_t k = 0;
	for (size_t i = 0; i < why->n; i++)
		k += (why->v[i] & COST_SWITCHED) != 0;
	return why->n ? (double)k / (double)why->n : 0.0;
}

static bool sync_booking;
static long sample_us = 100;      /* --sample-us: the lane-depth sampler's period; 0 = off */
static long spin_us = -1;         /* --spin-us: kvr_config.shard_idle_spin_ns in us; -1 = default */
static uint64_t capacity;         /* 0: 8 prompts' worth of blocks per rank */
static uint32_t lane_cap;         /* --lane-capacity: kvr_config.lane_capacity; 0 = default */
static long soft_depth = -1;      /* --soft-depth: kvr_config.lane_soft_depth; -1 = default */
static long booking_lazy_us = -1; /* --booking-lazy-us: kvr_config.booking_lazy_ns; -1 = default */
static uint32_t n_ranks = 64, n_shards = 2;
static int threads_max = 2;

/* What the shards did so far: CPU busy (less the idle polling) and polling, the times a
 * producer had to wake a parked shard and the lazy posts that left one asleep. */
struct shard_totals {
	uint64_t busy_ns, spin_ns, wakes, deferred, soon_parks;
};

/* Routing-lane tasks run so far, and the totals above. */
static uint64_t routing_tasks(struct kvr_router *r, struct shard_totals *o)
{
	uint64_t t = 0;
	*o = (struct shard_totals){0};
	for (uint32_t i = 0; i < kvr_shards_count(r->shards); i++) {
		struct kvr_shard_stats st;
		kvr_shard_get_stats(kvr_shards_get(r->shards, i), &st);
		t += st.tasks[KVR_LANE_ROUTING];
		o->busy_ns += st.cpu_ns > st.spin_ns ? st.cpu_ns - st.spin_ns : 0;
		o->spin_ns += st.spin_ns;
		o->wakes += st.wakes;
		o->deferred += st.wakes_deferred;
		o->soon_parks += st.soon_parks;
	}
	return t;
}

/* The bench's router, its config in *c: the command line's shard settings, n_ranks ranks of
 * --capacity blocks (default: 8 prompts' worth).  lanes: also sync_booking and the lane sizes
 * (the burst keeps their defaults). */
static struct kvr_router *new_router(struct kvr_config *c, bool lanes)
{
	kvr_config_init(c);
	c->n_shards = n_shards;
	if (spin_us >= 0)
		c->shard_idle_spin_ns = (uint64_t)spin_us * 1000;
	if (booking_lazy_us >= 0)
		c->booking_lazy_ns = (uint64_t)booking_lazy_us * 1000;
	if (lanes) {
		c->sync_booking = sync_booking;
		if (lane_cap)
			c->lane_capacity = lane_cap;
		if (soft_depth >= 0)
			c->lane_soft_depth = (uint32_t)soft_depth;
	}
	struct kvr_router *r;
	if (kvr_router_create(c, &r)) {
		fprintf(stderr, "bench_route: create failed\n");
		exit(1);
	}
	uint64_t cap = capacity ? capacity : 8 * prompt_len / 16;
	for (uint32_t k = 0; k < n_ranks; k++)
		kvr_rank_add(r, (struct kvr_rank_id){k, 0}, 1, cap, 16384);
	return r;
}

static void bench(int threads, double ms)
{
	struct kvr_config c;
	struct kvr_router *r = new_router(&c, true);
	/* Warm-up: every prompt routed once (synchronously drained), so lookups find prefixes. */
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = prompt_len;
	for (size_t i = 0; i < n_prompts; i++) {
		q.tokens = prompts[i];
		struct kvr_decision d;
		if (kvr_route(r, &q, &d) == 0)
			kvr_request_finish(r, d.attempt);
		if (i % 16 == 15)
			kvr_router_sync(r, 60000);
	}
	kvr_router_sync(r, 60000);
	/* The router's own stage histograms, minus the warm-up. */
	enum kvr_hist stages[4] = {KVR_H_HASH_NS, KVR_H_MATCH_NS, KVR_H_SELECT_NS, KVR_H_ADMIT_NS};
	uint64_t warm[4][KVR_HIST_BUCKETS];
	for (int k = 0; k < 4; k++)
		kvr_metrics_hist(r->metrics, stages[k], warm[k], NULL);
	struct worker *w = calloc((size_t)threads, sizeof(*w));
	atomic_store(&go, 0);
	atomic_store(&stop, 0);
	size_t nb = prompt_len / 16;
	for (int t = 0; t < threads; t++) {
		w[t].r = r;
		w[t].id = t;
		w[t].local = malloc(nb * sizeof(uint64_t));
		w[t].seq = malloc(nb * sizeof(uint64_t));
		w[t].match = malloc(c.max_ranks * sizeof(*w[t].match));
		pthread_create(&w[t].th, NULL, run, &w[t]);
	}
	struct shard_totals s0, s1;
	uint64_t tasks0 = routing_tasks(r, &s0);
	uint64_t ev0 = kvr_metrics_counter(r->metrics, KVR_C_EVICTIONS);
	uint64_t rb0 = kvr_metrics_counter(r->metrics, KVR_C_ROUTED_BLOCKS);
	uint64_t ov0 = kvr_metrics_counter(r->metrics, KVR_C_PREDICTED_OVERLAP_BLOCKS);
	uint64_t lw0 = kvr_metrics_counter(r->metrics, KVR_C_LANE_FULL_WAITS);
	uint64_t th0 = kvr_metrics_counter(r->metrics, KVR_C_LANE_SOFT_THROTTLES);
	uint64_t sp0 = kvr_metrics_counter(r->metrics, KVR_C_LANE_SOFT_SPILLS);
	uint64_t t0 = mono_ns(), end = t0 + (uint64_t)(ms * 1e6);
	atomic_store(&done, 0);
	atomic_store(&go, 1);
	uint64_t depth_max = 0, depth_sum = 0, samples = 0;
	while (mono_ns() < end && atomic_load(&done) < threads) {
		/* --sample-us 0: no sampling, a wake-up every 10 ms to see the end (each of the
		 * sampler's wake-ups may preempt a frontend: part of the route's tail). */
		long sleep_ns = sample_us > 0 ? sample_us * 1000 : 10000000;
		struct timespec ts = {sleep_ns / 1000000000, sleep_ns % 1000000000};
		nanosleep(&ts, NULL);
		for (uint32_t i = 0; sample_us > 0 && i < kvr_shards_count(r->shards); i++) {
			struct kvr_shard_stats st;
			kvr_shard_get_stats(kvr_shards_get(r->shards, i), &st);
			uint64_t dep = st.depth[KVR_LANE_ROUTING];
			depth_sum += dep;
			depth_max = dep > depth_max ? dep : depth_max;
			samples++;
		}
	}
	atomic_store(&stop, 1);
	struct samples floor = {0}, route = {0}, fin = {0}, lookup = {0}, own = {0};
	struct samples route_why = {0}, fin_why = {0};
	uint64_t n = 0, full = 0, errors = 0, allocs = 0, ran_end = t0;
	for (int t = 0; t < threads; t++) {
		pthread_join(w[t].th, NULL);
		ran_end = w[t].end_ns > ran_end ? w[t].end_ns : ran_end;
		merge(&floor, &w[t].floor);
		merge(&route, &w[t].route);
		merge(&fin, &w[t].fin);
		merge(&route_why, &w[t].route_why);
		merge(&fin_why, &w[t].fin_why);
		merge(&lookup, &w[t].lookup);
		merge(&own, &w[t].own);
		n += w[t].n;
		full += w[t].full;
		errors += w[t].errors;
		allocs += w[t].allocs;
		free(w[t].local);
		free(w[t].seq);
		free(w[t].match);
	}
	kvr_router_sync(r, 600000); /* the backlog drains: part of the shards' time */
	uint64_t drained = mono_ns() - t0;
	/* routes_s: over the time the frontends routed.  Over --ms, as it was, --iters (threads
	 * done long before) read 667 routes/s for 2,000 routes in 30 ms. */
	double ran_s = (double)(ran_end - t0) * 1e-9;
	uint64_t tasks = routing_tasks(r, &s1) - tasks0;
	uint64_t evicted = kvr_metrics_counter(r->metrics, KVR_C_EVICTIONS) - ev0;
	uint64_t routed_blocks = kvr_metrics_counter(r->metrics, KVR_C_ROUTED_BLOCKS) - rb0;
	uint64_t overlap = kvr_metrics_counter(r->metrics, KVR_C_PREDICTED_OVERLAP_BLOCKS) - ov0;
	uint64_t lane_waits = kvr_metrics_counter(r->metrics, KVR_C_LANE_FULL_WAITS) - lw0;
	uint64_t throttles = kvr_metrics_counter(r->metrics, KVR_C_LANE_SOFT_THROTTLES) - th0;
	uint64_t spills = kvr_metrics_counter(r->metrics, KVR_C_LANE_SOFT_SPILLS) - sp0;
	uint64_t cpu0 = s0.busy_ns, cpu1 = s1.busy_ns;
	/* What one shard core books per second of its own busy CPU (all its work: lanes,
	 * maintenance, parking, but not the idle polling before it parks): the shards' capacity,
	 * whether or not the frontends kept them busy. */
	double per_cpu_s = cpu1 > cpu0 ? (double)tasks / ((double)(cpu1 - cpu0) * 1e-9) : 0.0;
	uint32_t ns = kvr_shards_count(r->shards);
	uint64_t sp[4];
	for (int k = 0; k < 4; k++) {
		uint64_t h[KVR_HIST_BUCKETS];
		kvr_metrics_hist(r->metrics, stages[k], h, NULL);
		for (int b = 0; b < KVR_HIST_BUCKETS; b++)
			h[b] -= warm[k][b];
		sp[k] = kvr_hist_quantile(h, 0.5);
	}
	double rt[COST_KINDS + 1], ft[COST_KINDS + 1];
	tail_why(&route, &route_why, rt);
	tail_why(&fin, &fin_why, ft);
	uint64_t f50 = quantile(&floor, 0.5), f99 = quantile(&floor, 0.99);
	uint64_t r50 = quantile(&route, 0.5), r99 = quantile(&route, 0.99);
	uint64_t l50 = quantile(&lookup, 0.5), o50 = quantile(&own, 0.5);
	uint64_t fin50 = quantile(&fin, 0.5), fin99 = quantile(&fin, 0.99);
	printf("SUMMARY bench=route booking=%s rate=%.0f tokens=%zu ranks=%u threads=%d shards=%u "
	       "sample_us=%ld "
	       "route_p50_ns=%llu route_p99_ns=%llu floor_p50_ns=%llu floor_p99_ns=%llu "
	       "p50_ratio=%.2f p99_ratio=%.2f lookup_p50_ns=%llu lookup_ratio=%.2f own_p50_ns=%llu "
	       "own_ratio=%.2f finish_p50_ns=%llu finish_p99_ns=%llu "
	       "routes_s=%.0f shard_tasks_s_per_shard=%.0f shard_tasks_per_cpu_s=%.0f "
	       "lane_depth_max=%llu "
	       "lane_depth_mean=%.1f lane_full=%llu lane_waits_per_route=%.3f soft_depth=%u "
	       "soft_throttles_per_route=%.4f soft_spills_per_route=%.4f "
	       "shard_wakes_per_route=%.3f "
	       "shard_wakes_deferred_per_route=%.3f soon_parks_per_route=%.3f "
	       "booking_lazy_ns=%llu shard_busy_us_per_route=%.2f "
	       "shard_spin_us_per_route=%.2f evicted_per_route=%.1f overlap_frac=%.3f "
	       "errors=%llu hash_p50_ns=%llu match_p50_ns=%llu "
	       "select_p50_ns=%llu admit_p50_ns=%llu record_allocs_per_route=%.3f "
	       "route_tail_lane_wait=%.2f "
	       "route_tail_wait_sleep=%.2f route_tail_wake=%.2f route_tail_record_alloc=%.2f "
	       "route_tail_soft_throttle=%.2f route_tail_switched=%.2f route_tail_none=%.2f "
	       "finish_tail_lane_wait=%.2f finish_tail_wait_sleep=%.2f "
	       "finish_tail_wake=%.2f finish_tail_switched=%.2f finish_tail_none=%.2f "
	       "route_switched_frac=%.4f finish_switched_frac=%.4f\n",
	       c.sync_booking ? "sync" : "async", pace_ns ? 1e9 / (double)pace_ns : 0.0, prompt_len,
	       n_ranks, threads, ns, sample_us, (unsigned long long)r50, (unsigned long long)r99,
	       (unsigned long long)f50, (unsigned long long)f99,
	       f50 ? (double)r50 / (double)f50 : 0.0, f99 ? (double)r99 / (double)f99 : 0.0,
	       (unsigned long long)l50, f50 ? (double)l50 / (double)f50 : 0.0,
	       (unsigned long long)o50, f50 ? (double)o50 / (double)f50 : 0.0,
	       (unsigned long long)fin50, (unsigned long long)fin99,
	       ran_s > 0 ? (double)n / ran_s : 0.0, (double)tasks / ((double)drained * 1e-9) / ns,
	       per_cpu_s, (unsigned long long)depth_max,
	       samples ? (double)depth_sum / (double)samples : 0.0, (unsigned long long)full,
	       n ? (double)lane_waits / (double)n : 0.0, c.lane_soft_depth,
	       n ? (double)throttles / (double)n : 0.0, n ? (double)spills / (double)n : 0.0,
	       n ? (double)(s1.wakes - s0.wakes) / (double)n : 0.0,
	       n ? (double)(s1.deferred - s0.deferred) / (double)n : 0.0,
	       n ? (double)(s1.soon_parks - s0.soon_parks) / (double)n : 0.0,
	       (unsigned long long)c.booking_lazy_ns,
	       n ? (double)(s1.busy_ns - s0.busy_ns) * 1e-3 / (double)n : 0.0,
	       n ? (double)(s1.spin_ns - s0.spin_ns) * 1e-3 / (double)n : 0.0,
	       n ? (double)evicted / (double)n : 0.0,
	       routed_blocks ? (double)overlap / (double)routed_blocks : 0.0,
	       (unsigned long long)errors, (unsigned long long)sp[0], (unsigned long long)sp[1],
	       (unsigned long long)sp[2], (unsigned long long)sp[3],
	       n ? (double)allocs / (double)n : 0.0, rt[0], rt[1], rt[2], rt[3], rt[4],
	       switch_ok ? rt[5] : -1.0, rt[6], ft[0], ft[1], ft[2], switch_ok ? ft[5] : -1.0,
	       ft[6], switch_ok ? switched_frac(&route_why) : -1.0,
	       switch_ok ? switched_frac(&fin_why) : -1.0);
	fflush(stdout);
	free(floor.v);
	free(route.v);
	free(fin.v);
	free(lookup.v);
	free(own.v);
	free(route_why.v);
	free(fin_why.v);
	free(w);
	kvr_router_destroy(r);
}

/* --burst N: the decision-quality side of a booking's delay.  A booking posted to a parked
 * shard runs after the shard wakes (a FUTEX_WAKE from the poster, or the end of its short park
 * when kvr_config.booking_lazy_ns leaves it asleep); until then no decision sees the prompt's
 * blocks or pinned runs (it sees its provisional load).  Rounds, each after --burst-rest-us of
 * rest (default 2000: the shards, which booked within 10 ms, sit in short parks, and even the
 * first booking of a round is left to one: the worst case for lazy bookings; after more than
 * 10 ms the first booking wakes its shard):
 *   burst:      N prompts sharing a fresh prefix (all but their last 2 blocks), routed from one
 *               thread --burst-gap-us apart (0: back to back), each marked prefilled at once
 *               (kvr_request_prefill_done: the worst case again; --burst-prefilled 0: not,
 *               and then, on idle ranks, a follower avoids the leader's rank for its pending
 *               prefill whether or not it sees the prefix): seen_frac is the share of the
 *               N - 1 followers routed with the whole shared prefix predicted cached where
 *               they went, same_rank_frac the share that went to the leader's rank;
 *   visibility: one fresh prompt routed, then the index polled until its rank holds the
 *               whole prompt: visible_us, the booking's delay as the next decision sees it.
 * The SUMMARY bench=route_burst line gives both, and the wakes per route in the bursts. */
static int burst_n;
static double burst_gap_us;
static int burst_prefilled = 1;   /* --burst-prefilled 0|1 */
static long burst_rest_us = 2000; /* --burst-rest-us */

static void burst(double ms)
{
	struct kvr_config c;
	struct kvr_router *r = new_router(&c, false);
	size_t nb = prompt_len / 16, pb = nb - 2;
	uint32_t **p = calloc((size_t)burst_n, sizeof(*p));
	uint64_t *att = calloc((size_t)burst_n, sizeof(*att));
	uint64_t *local = malloc(nb * sizeof(uint64_t)), *seq = malloc(nb * sizeof(uint64_t));
	struct kvr_index_match *m = malloc(c.max_ranks * sizeof(*m));
	for (int k = 0; k < burst_n; k++)
		p[k] = malloc(prompt_len * sizeof(uint32_t));
	uint32_t fresh = 1u << 31;
	struct kvr_request q;
	kvr_request_init(&q);
	q.n_tokens = prompt_len;
	struct samples vis = {0}, rt = {0};
	uint64_t followers = 0, seen = 0, same = 0, routes = 0, vis_lost = 0;
	struct shard_totals s0, s1;
	uint64_t ov0 = kvr_metrics_counter(r->metrics, KVR_C_PREDICTED_OVERLAP_BLOCKS);
	uint64_t rb0 = kvr_metrics_counter(r->metrics, KVR_C_ROUTED_BLOCKS);
	(void)routing_tasks(r, &s0);
	uint64_t end = mono_ns() + (uint64_t)(ms * 1e6);
	for (uint32_t round = 0; mono_ns() < end || round < 4; round++) {
		struct timespec rest = {(time_t)(burst_rest_us / 1000000),
		                        (long)(burst_rest_us % 1000000) * 1000};
		nanosleep(&rest, NULL);
		struct kvr_decision d;
		if (round & 1) { /* visibility */
			for (size_t i = 0; i < prompt_len; i++)
				p[0][i] = fresh++;
			kvr_hash_blocks(p[0], prompt_len, 16, NULL, local, seq);
			q.tokens = p[0];
			if (kvr_route(r, &q, &d))
				continue;
			uint64_t t0 = mono_ns();
			uint32_t slot;
			kvr_router_find_rank(r, d.rank, &slot);
			bool ok = false;
			while (!ok && mono_ns() - t0 < 50000000) {
				size_t n = 0;
				kvr_rcu_read_lock();
				kvr_index_find_matches(r->index, seq, nb, NULL, m, c.max_ranks, &n);
				kvr_rcu_read_unlock();
				for (size_t i = 0; i < n; i++)
					ok |= m[i].slot == slot && m[i].score >= nb;
			}
			if (ok)
				sample(&vis, mono_ns() - t0);
			else
				vis_lost++;
			kvr_request_finish(r, d.attempt);
			kvr_router_sync(r, 60000);
			continue;
		}
		for (size_t i = 0; i < pb * 16; i++)
			p[0][i] = fresh++;
		for (int k = 0; k < burst_n; k++) {
			if (k)
				memcpy(p[k], p[0], pb * 16 * sizeof(uint32_t));
			for (size_t i = pb * 16; i < prompt_len; i++)
				p[k][i] = fresh++;
		}
		uint64_t t0 = mono_ns(), rank0 = 0;
		int n_att = 0;
		for (int k = 0; k < burst_n; k++) {
			while (burst_gap_us > 0 &&
			       mono_ns() < t0 + (uint64_t)(k * burst_gap_us * 1e3))
				;
			q.tokens = p[k];
			uint64_t a = mono_ns();
			int rc = kvr_route(r, &q, &d);
			sample(&rt, mono_ns() - a);
			routes++;
			if (rc)
				continue;
			att[n_att++] = d.attempt;
			if (burst_prefilled)
				kvr_request_prefill_done(r, d.attempt);
			if (k == 0) {
				rank0 = d.rank.worker_id;
				continue;
			}
			followers++;
			seen += d.overlap_blocks >= pb;
			same += d.rank.worker_id == rank0;
		}
		for (int k = 0; k < n_att; k++)
			kvr_request_finish(r, att[k]);
		kvr_router_sync(r, 60000);
	}
	(void)routing_tasks(r, &s1);
	uint64_t ov = kvr_metrics_counter(r->metrics, KVR_C_PREDICTED_OVERLAP_BLOCKS) - ov0;
	uint64_t rb = kvr_metrics_counter(r->metrics, KVR_C_ROUTED_BLOCKS) - rb0;
	printf(
	    "SUMMARY bench=route_burst tokens=%zu ranks=%u shards=%u booking_lazy_ns=%llu "
	    "burst=%d gap_us=%.0f prefilled=%d rest_us=%ld followers=%llu seen_frac=%.3f "
	    "same_rank_frac=%.3f "
	    "overlap_frac=%.3f route_p50_ns=%llu route_p99_ns=%llu wakes_per_route=%.3f "
	    "visible_n=%zu visible_p10_us=%.1f visible_p50_us=%.1f visible_p90_us=%.1f "
	    "visible_max_us=%.1f visible_lost=%llu\n",
	    prompt_len, n_ranks, kvr_shards_count(r->shards), (unsigned long long)c.booking_lazy_ns,
	    burst_n, burst_gap_us, burst_prefilled, burst_rest_us, (unsigned long long)followers,
	    followers ? (double)seen / (double)followers : 0.0,
	    followers ? (double)same / (double)followers : 0.0, rb ? (double)ov / (double)rb : 0.0,
	    (unsigned long long)quantile(&rt, 0.5), (unsigned long long)quantile(&rt, 0.99),
	    routes ? (double)(s1.wakes - s0.wakes) / (double)routes : 0.0, vis.n,
	    (double)quantile(&vis, 0.1) * 1e-3, (double)quantile(&vis, 0.5) * 1e-3,
	    (double)quantile(&vis, 0.9) * 1e-3, (double)quantile(&vis, 1.0) * 1e-3,
	    (unsigned long long)vis_lost);
	fflush(stdout);
	for (int k = 0; k < burst_n; k++)
		free(p[k]);
	free(p);
	free(att);
	free(local);
	free(seq);
	free(m);
	free(vis.v);
	free(rt.v);
	kvr_router_destroy(r);
}

int main(int argc, char **argv)
{
	double ms = 1000;
	/* Every option takes a value; an unknown one, a missing or bad value is an error (they
	 * were skipped or read as 0: --rate 0 cast an infinite gap to an integer, --threads for
	 * --threads-max ran the default). */
	uint64_t len_list[16] = {2048, 8192, 32768, 131072};
	size_t n_lengths = 4;
#define U(lo, hi) opt_u64(argc, argv, i, lo, hi)
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--ms"))
			ms = opt_f64(argc, argv, i, 1e-3, 1e9);
		else if (!strcmp(argv[i], "--lengths"))
			n_lengths = opt_list(argc, argv, i, 0, 1u << 24, len_list, 16);
		else if (!strcmp(argv[i], "--ranks"))
			n_ranks = (uint32_t)U(1, 65536);
		else if (!strcmp(argv[i], "--shards"))
			n_shards = (uint32_t)U(1, 1024);
		else if (!strcmp(argv[i], "--capacity"))
			capacity = U(0, 1000000000000000ull);
		else if (!strcmp(argv[i], "--sync-booking"))
			sync_booking = U(0, 1) != 0;
		else if (!strcmp(argv[i], "--threads-max"))
			threads_max = (int)U(1, MAX_THREADS);
		else if (!strcmp(argv[i], "--spin-us"))
			spin_us = (long)U(0, 1000000000);
		else if (!strcmp(argv[i], "--lane-capacity"))
			lane_cap = (uint32_t)U(0, UINT32_MAX);
		else if (!strcmp(argv[i], "--soft-depth"))
			soft_depth = (long)U(0, UINT32_MAX);
		else if (!strcmp(argv[i], "--iters"))
			iters = U(0, 1000000000000000ull);
		else if (!strcmp(argv[i], "--booking-lazy-us"))
			booking_lazy_us = (long)U(0, 1000000000);
		else if (!strcmp(argv[i], "--burst"))
			burst_n = (int)U(0, 1000000);
		else if (!strcmp(argv[i], "--burst-rest-us"))
			burst_rest_us = (long)U(0, 1000000000);
		else if (!strcmp(argv[i], "--burst-prefilled"))
			burst_prefilled = (int)U(0, 1);
		else if (!strcmp(argv[i], "--burst-gap-us"))
			burst_gap_us = opt_f64(argc, argv, i, 0, 1e9);
		else if (!strcmp(argv[i], "--sample-us"))
			sample_us = (long)U(0, 1000000000);
		else if (!strcmp(argv[i], "--rate"))
			pace_ns = (uint64_t)(1e9 / opt_f64(argc, argv, i, 1e-3, 1e9));
		else if (!strcmp(argv[i], "--cpus")) {
			uint64_t c[MAX_THREADS];
			n_front_cpus = (int)opt_list(argc, argv, i, 0, 4095, c, MAX_THREADS);
			for (int k = 0; k < n_front_cpus; k++)
				front_cpus[k] = (int)c[k];
		} else
			opt_unknown(argv, i);
	}
#undef U
	switch_ok = switch_probe_ok();
	for (size_t k = 0; k < n_lengths; k++) {
		size_t len = (size_t)len_list[k];
		if (len < 32)
			continue;
		/* about 64 MiB of prompts at most */
		size_t n = (64u << 20) / (len * sizeof(uint32_t));
		if (burst_n > 1) {
			prompt_len = len; /* fresh prompts of this length, none made ahead */
			burst(ms);
			continue;
		}
		make_prompts(len, n > 512 ? 512 : n);
		for (int th = 1; th <= threads_max; th++)
			bench(th, ms);
		free_prompts();
	}
	return 0;
}
