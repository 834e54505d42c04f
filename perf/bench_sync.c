/*
 * perf/bench_sync.c - what replica sync costs and how fast it propagates (issue 14 targets).
 *
 *  1. overhead on the routing path: kvr_route p50 on a router attached to NATS against the same
 *     call on an identical unattached router, alternating request by request in one thread so
 *     both see the same machine.  Target: ratio <= 1.1.  Measured twice: with no peer on this
 *     machine (what attaching adds to the routing path), and with peer B in this process
 *     (B's index work for A's admissions then competes for the same cores).
 *  2. propagation: replica A admits `rate` requests/s of `tokens`-token prompts (each a new
 *     prefix); a prober thread asks replica B (query-only, pinned to A's chosen rank, by local
 *     hashes) until B predicts the whole prompt cached there, and records A's admit -> B
 *     visible.  Target: p99 <= 2 ms at 5000/s of 8k-token prompts.
 *     --stages: every admission of phase 2 is also stamped at each stage on its way
 *     (sync/replica_trace.h) and the bench prints each stage's p50/p99 and the mean stages of
 *     the slowest 1%, plus each thread's CPU and run-queue wait over the phase
 *     (/proc/self/task/N/schedstat, threads labelled A:/B:/plain: by the router or replica
 *     that started them) and nats-server's: where the tail comes from; and the CPU the two
 *     replicas and the server spend per admission (cpu_us_per_admission_sync: every thread
 *     but the bench's own main thread and prober, from the phase's start until B showed the
 *     last admission, so a pipeline that fell behind is charged all its work).
 *  --fronts S: only this: two frontend threads route and finish back to back on the attached
 *     router and on the unattached one, alternated, S seconds each, 4 rounds (fronts_phase).
 * A nats-server is started on a free 127.0.0.1 port and stopped at the end (exit 77 without).
 *     --shard-spin-ns NS: the routers' kvr_config.shard_idle_spin_ns (0: never spin; default:
 *     the library's).  --route-rounds N: N no-peer rounds of part 1 before the in-process one
 *     (does the no-peer ratio depend on being first?).  --blk-grow-at PERMILLE: the block
 *     locator's migration start (kvr_index_blk_grow_at; the tombstone locator's purges set the tail
 * at 5000/s; the chunked one only migrates to grow or shrink). usage: bench_sync [--tokens N]
 * [--rate R] [--seconds S] [--ranks K] [--capacity BLOCKS]
 *                   [--stages] [--shard-spin-ns NS] [--route-rounds N] [--fronts S]
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <dirent.h>
#include <unistd.h>

#include "core/index_internal.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "sync/replica_trace.h"
#include "tests/common/nats_server.h"

static size_t tokens = 8192;
static double rate = 5000;
static double seconds = 2;
static uint32_t n_ranks = 8;
static uint64_t capacity = 65536; /* blocks per rank: 1M tokens at block size 16 */
static long shard_spin_ns = -1;   /* -1: the library's default */
static int route_rounds = 1;      /* rounds of the no-peer route phase (order/warm-up check) */
static double fronts_s;           /* --fronts S: the two-frontend phase alone (see fronts_phase) */

static uint64_t pct(uint64_t *v, size_t n, double q)
{
	if (!n)
		return 0;
	qsort(v, n, 8, cmp_u64);
	size_t i = (size_t)(q * (double)(n - 1));
	return v[i];
}

/* ---------------------------------------------------------------- thread labels
 *
 * Every thread of a router or a replica inherits "bench-main"; --stages' per-thread CPU needs
 * to say whose it is.  After each router / attach, the threads it started are renamed
 * PREFIX:oldname (/proc/self/task/N/comm, 15 characters), or PREFIX:inherited for the threads
 * that kept the name they inherited (a router's shards, nats.c's threads).  liburcu's call_rcu
 * thread, started by the first router, also keeps its name: it is the second "A:shard" (it
 * sleeps in poll(2) between callback batches; an off-CPU trace shows it on retire_cb). */
#define MAX_LABELED 256
static long labeled[MAX_LABELED];
static size_t n_labeled;

static bool was_labeled(long tid)
{
	for (size_t i = 0; i < n_labeled; i++)
		if (labeled[i] == tid)
			return true;
	return false;
}

static void label_new_threads(const char *prefix, const char *inherited)
{
	DIR *d = opendir("/proc/self/task");
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d))) {
		long tid = atol(e->d_name);
		if (tid <= 0 || was_labeled(tid) || n_labeled >= MAX_LABELED)
			continue;
		labeled[n_labeled++] = tid;
		if (!prefix)
			continue;
		char path[64], comm[32] = "", name[32];
		snprintf(path, sizeof(path), "/proc/self/task/%ld/comm", tid);
		FILE *f = fopen(path, "r");
		if (!f)
			continue;
		if (fgets(comm, sizeof(comm), f))
			comm[strcspn(comm, "\n")] = 0;
		fclose(f);
		const char *base = strncmp(comm, "bench-main", 10) ? comm : inherited;
		if (!strncmp(base, "kvr-sync-", 9))
			base += 9;
		snprintf(name, sizeof(name), "%s:%s", prefix, base);
		name[15] = 0;
		if ((f = fopen(path, "w"))) {
			fputs(name, f);
			fclose(f);
		}
	}
	closedir(d);
}

/* ---------------------------------------------------------------- routers */

static struct kvr_router *make_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	if (shard_spin_ns >= 0)
		c.shard_idle_spin_ns = (uint64_t)shard_spin_ns; /* 0: shards never spin */
	struct kvr_router *r;
	if (kvr_router_create(&c, &r))
		return NULL;
	for (uint64_t w = 0; w < n_ranks; w++)
		kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, capacity, 1u << 20);
	return r;
}

static struct kvr_sync *attach(struct kvr_router *r, uint64_t id)
{
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = kvr_test_nats_url();
	c.cluster = "bench";
	c.replica_id = id;
	c.heartbeat_ms = 200;
	c.dead_after = 25; /* a loaded benchmark machine must not fake deaths */
	struct kvr_sync *s;
	if (kvr_sync_attach(r, &c, &s) || kvr_sync_wait_ready(s, 5000))
		return NULL;
	return s;
}

static void prompt(uint32_t *t, size_t n, uint64_t k)
{
	for (size_t i = 0; i < n; i++)
		t[i] = (uint32_t)(k * 2654435761u + i * 40503u + (i >> 5) * 977u);
}

/* ---------------------------------------------------------------- --fronts: two frontends
 *
 * Two unpinned frontend threads route and finish back to back on one router (their notes go to
 * the replica sender's ring on the attached router A, whose commit waits for earlier producers),
 * S seconds a round, 4 rounds, A and the unattached router alternated (A first in even rounds).
 * Per router: route and finish p50/p99 and the share of calls over 10 us (a frontend's call
 * that waited for the other, descheduled between its reserve and commit, is tens of us or
 * more: docs/measurements.md, "Finish tails with two frontends"). */
#define FRONT_MAX 4000000
struct front {
	struct kvr_router *r;
	uint32_t id;
	uint64_t *route, *fin;
	size_t n;
};
static int fronts_stop; /* atomic */

static void *front_main(void *arg)
{
	struct front *f = arg;
	uint32_t *t = malloc(tokens * sizeof(uint32_t));
	for (uint64_t i = 0; !__atomic_load_n(&fronts_stop, __ATOMIC_ACQUIRE) && f->n < FRONT_MAX;
	     i++) {
		prompt(t, tokens, (i * 2 + f->id) % 64); /* 64 conversations, as phase 1 */
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = tokens;
		struct kvr_decision d;
		uint64_t t0 = now_ns();
		int rc = kvr_route(f->r, &q, &d);
		uint64_t t1 = now_ns();
		if (rc)
			continue;
		kvr_request_finish(f->r, d.attempt);
		uint64_t t2 = now_ns();
		f->route[f->n] = t1 - t0;
		f->fin[f->n++] = t2 - t1;
	}
	free(t);
	return NULL;
}

static size_t over(const uint64_t *v, size_t n, uint64_t ns)
{
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		k += v[i] > ns;
	return k;
}

static void fronts_phase(struct kvr_router *ra, struct kvr_router *plain)
{
	struct front f[2];
	uint64_t *route = malloc(2 * FRONT_MAX * 8), *fin = malloc(2 * FRONT_MAX * 8);
	for (int k = 0; k < 2; k++) {
		f[k].route = malloc(FRONT_MAX * 8);
		f[k].fin = malloc(FRONT_MAX * 8);
	}
	for (int round = 0; round < 4; round++) {
		for (int j = 0; j < 2; j++) {
			bool synced = (j == 0) == (round % 2 == 0);
			__atomic_store_n(&fronts_stop, 0, __ATOMIC_RELEASE);
			pthread_t th[2];
			for (int k = 0; k < 2; k++) {
				f[k].r = synced ? ra : plain;
				f[k].id = (uint32_t)k;
				f[k].n = 0;
				pthread_create(&th[k], NULL, front_main, &f[k]);
			}
			usleep((useconds_t)(fronts_s * 1e6));
			__atomic_store_n(&fronts_stop, 1, __ATOMIC_RELEASE);
			size_t n = 0;
			for (int k = 0; k < 2; k++) {
				pthread_join(th[k], NULL);
				memcpy(route + n, f[k].route, f[k].n * 8);
				memcpy(fin + n, f[k].fin, f[k].n * 8);
				n += f[k].n;
			}
			size_t ro = over(route, n, 10000), fo = over(fin, n, 10000);
			printf(
			    "SUMMARY bench=sync_fronts attached=%d round=%d tokens=%zu calls=%zu "
			    "route_p50_ns=%lu route_p99_ns=%lu finish_p50_ns=%lu "
			    "finish_p99_ns=%lu finish_p999_ns=%lu route_over_10us=%.4f "
			    "finish_over_10us=%.4f\n",
			    synced, round, tokens, n, (unsigned long)pct(route, n, 0.5),
			    (unsigned long)pct(route, n, 0.99), (unsigned long)pct(fin, n, 0.5),
			    (unsigned long)pct(fin, n, 0.99), (unsigned long)pct(fin, n, 0.999),
			    n ? (double)ro / (double)n : 0.0, n ? (double)fo / (double)n : 0.0);
			fflush(stdout);
		}
	}
	for (int k = 0; k < 2; k++) {
		free(f[k].route);
		free(f[k].fin);
	}
	free(route);
	free(fin);
}

/* ---------------------------------------------------------------- 2: propagation */

struct probe {
	uint64_t t0;
	struct kvr_rank_id rank;
	uint64_t *local;
	size_t nb;
	uint64_t no; /* admission number: index into obs */
};

/* What the prober saw of admission i (phase 2), for --stages. */
struct obs {
	uint64_t attempt, t0, routed; /* A's attempt; before kvr_route; after it returned */
	uint64_t miss, seen;          /* last probe that did not see it; first that did */
	bool inferred;                /* seen only through a later admission (evicted first) */
};
static struct obs *obs;
static size_t n_obs;
static bool stages;

#define RING 65536
static struct probe ring[RING];
static uint64_t head, tail; /* producer writes head, prober reads tail */
static uint64_t lat[RING * 4];
static size_t n_lat;
static int stop;
static struct kvr_router *rb;
static uint32_t block_size = 16;

/* Whether B predicts p's whole prompt cached on p's rank. */
static bool visible(const struct probe *p)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.local_hashes = p->local;
	q.n_hashes = p->nb;
	q.n_tokens = p->nb * block_size;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	q.pinned = &p->rank;
	struct kvr_decision d;
	return kvr_route(rb, &q, &d) == 0 && d.overlap_blocks == p->nb;
}

/* Probes the oldest admission not seen yet until B shows it, recording its latency, then the
 * next; sleeps 50 us between failed probes (the resolution; a probe of a 512-block prompt
 * hashes the chain, ~15 us, so probing every outstanding admission per pass took most of a
 * core from B at 5000/s).  B applies A's admissions in order (one stream, one shard), so:
 *  - when the oldest does not show and the next one does, the oldest was shown and already
 *    evicted: it is counted at the time this was noticed (an upper bound) instead of waiting
 *    for a visibility that will not come;
 *  - when the oldest shows and the prober is behind (over CATCH_UP admissions waiting), every
 *    admission between it and the newest one that shows already shows too: a binary search
 *    finds that one and all of them are counted now (an upper bound, marked "caught up" in
 *    --stages), so a prober that fell behind (descheduled on a busy machine) catches up in a
 *    few probes instead of adding its own backlog to every later admission. */
#define CATCH_UP 8 /* admissions waiting (1.6 ms at 5000/s) before the prober searches */

static void record(uint64_t t, uint64_t now, bool seen, bool inferred)
{
	struct probe *p = &ring[t % RING];
	struct obs *o = p->no < n_obs ? &obs[p->no] : NULL;
	uint64_t lat_ns = seen ? now - p->t0 : 2000000000ull; /* never seen: counted as 2 s */
	if (o) {
		o->seen = seen ? now : 0;
		o->inferred = inferred;
	}
	if (n_lat < sizeof(lat) / sizeof(lat[0]))
		lat[n_lat++] = lat_ns;
	free(p->local);
}

static void *prober(void *arg)
{
	(void)arg;
	prctl(PR_SET_TIMERSLACK, 1000UL); /* 50 us sleeps, not 50 us + the default 50 us slack */
	for (;;) {
		uint64_t t = __atomic_load_n(&tail, __ATOMIC_RELAXED);
		uint64_t h = __atomic_load_n(&head, __ATOMIC_ACQUIRE);
		if (t == h) {
			if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE))
				break;
		} else {
			struct probe *p = &ring[t % RING];
			bool seen = visible(p);
			uint64_t now = now_ns();
			if (seen) {
				record(t, now, true, false);
				/* lo shows; hi-1 is the newest admission.  Only when behind: the
				 * search's probes cost CPU that B and the pipeline share. */
				uint64_t lo = t, hi = h - t > CATCH_UP ? h : t + 1;
				while (hi - lo > 1) {
					uint64_t mid = lo + (hi - lo) / 2;
					if (visible(&ring[mid % RING]))
						lo = mid;
					else
						hi = mid;
				}
				for (uint64_t k = t + 1; k <= lo; k++)
					record(k, now, true, true);
				__atomic_store_n(&tail, lo + 1, __ATOMIC_RELEASE);
				continue;
			}
			if (h - t > 1 && visible(&ring[(t + 1) % RING])) {
				record(t, now, true, true); /* shown and evicted before we looked */
				__atomic_store_n(&tail, t + 1, __ATOMIC_RELEASE);
				continue;
			}
			if (now - p->t0 > 2000000000ull) {
				record(t, now, false, false);
				__atomic_store_n(&tail, t + 1, __ATOMIC_RELEASE);
				continue;
			}
			if (p->no < n_obs)
				obs[p->no].miss = now;
		}
		struct timespec ts = {0, 50000};
		nanosleep(&ts, NULL);
	}
	return NULL;
}

/* ---------------------------------------------------------------- --stages */

/* Every thread's CPU and run-queue wait (ns, /proc/.../schedstat), this process's and
 * nats-server's (our child). */
#define MAX_TH 128
struct cpu_snap {
	size_t n;
	struct {
		long tid;
		char comm[20];
		uint64_t run, wait;
	} th[MAX_TH];
};

static void snap_dir(struct cpu_snap *c, const char *dir, const char *prefix)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d)) && c->n < MAX_TH) {
		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		char path[300], comm[20] = "";
		unsigned long long run = 0, wait = 0;
		snprintf(path, sizeof(path), "%s/%s/schedstat", dir, e->d_name);
		FILE *f = fopen(path, "r");
		if (!f)
			continue;
		int ok = fscanf(f, "%llu %llu", &run, &wait) == 2;
		fclose(f);
		snprintf(path, sizeof(path), "%s/%s/comm", dir, e->d_name);
		if ((f = fopen(path, "r"))) {
			if (fgets(comm, sizeof(comm), f))
				comm[strcspn(comm, "\n")] = 0;
			fclose(f);
		}
		if (!ok)
			continue;
		c->th[c->n].tid = atol(e->d_name);
		snprintf(c->th[c->n].comm, sizeof(c->th[c->n].comm), "%s%s", prefix, comm);
		c->th[c->n].run = run;
		c->th[c->n].wait = wait;
		c->n++;
	}
	closedir(d);
}

static void cpu_snap(struct cpu_snap *c)
{
	c->n = 0;
	snap_dir(c, "/proc/self/task", "");
	char path[64], buf[256];
	snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)getpid());
	FILE *f = fopen(path, "r");
	if (f) {
		if (fgets(buf, sizeof(buf), f)) {
			snprintf(path, sizeof(path), "/proc/%ld/task", atol(buf));
			snap_dir(c, path, "server:");
		}
		fclose(f);
	}
}

static void cpu_report(const struct cpu_snap *a, const struct cpu_snap *b, double wall_s,
                       uint64_t admissions)
{
	double sum = 0, sum_wait = 0, srv = 0;
	for (size_t i = 0; i < b->n; i++) {
		uint64_t run = b->th[i].run, wait = b->th[i].wait;
		for (size_t j = 0; j < a->n; j++)
			if (a->th[j].tid == b->th[i].tid) {
				run -= a->th[j].run;
				wait -= a->th[j].wait;
			}
		double cores = (double)run * 1e-9 / wall_s;
		sum += cores;
		sum_wait += (double)wait * 1e-9 / wall_s;
		if (!strncmp(b->th[i].comm, "server:", 7))
			srv += cores;
		if (cores >= 0.005)
			printf("bench_sync: thread %ld %-22s cpu=%.3f cores runq_wait=%.3f\n",
			       b->th[i].tid, b->th[i].comm, cores, (double)wait * 1e-9 / wall_s);
	}
	/* CPU per admission: both replicas, their pipeline and the server, less the bench's own
	 * threads (the prober's probes and the main thread's hashing of each new prompt). */
	double bench = 0;
	for (size_t i = 0; i < b->n; i++) {
		if (strncmp(b->th[i].comm, "bench-", 6))
			continue;
		uint64_t run = b->th[i].run;
		for (size_t j = 0; j < a->n; j++)
			if (a->th[j].tid == b->th[i].tid)
				run -= a->th[j].run;
		bench += (double)run * 1e-9 / wall_s;
	}
	printf("SUMMARY bench=sync_cpu rate_asked=%.0f cores_total=%.2f cores_nats_server=%.2f "
	       "cores_bench_threads=%.2f cpu_us_per_admission_sync=%.1f runq_wait_total=%.2f "
	       "online_cpus=%ld\n",
	       rate, sum, srv, bench,
	       admissions ? (sum - bench) * wall_s * 1e6 / (double)admissions : 0.0, sum_wait,
	       sysconf(_SC_NPROCESSORS_ONLN));
}

/* Stage deltas of the traced admissions: p50/p99 each, and the mean of each over the slowest
 * 1% end to end (what the tail is made of). */
static void stage_report(size_t n)
{
	enum {
		S_ROUTE,
		S_NOTE_POP,
		S_POP_PUB,
		S_PUB_RX,
		S_RX_HANDLE,
		S_HANDLE_POSTED,
		S_POSTED_SEEN,
		S_RESOLUTION,
		S_END,
		S_N
	};
	static const char *names[S_N] = {"route_to_note", "ring_wait",        "encode",
	                                 "publish_to_rx", "apply_queue",      "apply_post",
	                                 "shard_to_seen", "probe_resolution", "end_to_end"};
	uint64_t *d[S_N], *end = malloc((n ? n : 1) * 8);
	for (int k = 0; k < S_N; k++)
		d[k] = malloc((n ? n : 1) * 8);
	size_t m = 0, inferred = 0, incomplete = 0;
	uint64_t(*row)[S_N + 1] = malloc((n ? n : 1) * sizeof(*row)); /* [S_N]: t0 */
	for (size_t i = 0; i < n; i++) {
		const struct obs *o = &obs[i];
		uint64_t t[KVR_TR_N];
		if (!o->seen) /* skipped, or never seen */
			continue;
		if (o->inferred) {
			inferred++;
			continue;
		}
		if (kvr_rep_trace_get(o->attempt, t)) {
			incomplete++;
			continue;
		}
		bool ok = true;
		for (int k = 0; k < KVR_TR_N; k++)
			ok = ok && t[k];
		if (!ok) {
			incomplete++;
			continue;
		}
		if (t[KVR_TR_POSTED] > o->seen) /* seen before the apply thread stamped it */
			t[KVR_TR_POSTED] = o->seen;
		uint64_t v[S_N] = {
		    t[KVR_TR_NOTE] - o->t0,
		    t[KVR_TR_POP] - t[KVR_TR_NOTE],
		    t[KVR_TR_ENCODED] - t[KVR_TR_POP],
		    t[KVR_TR_RECEIVED] - t[KVR_TR_ENCODED],
		    t[KVR_TR_HANDLE] - t[KVR_TR_RECEIVED],
		    t[KVR_TR_POSTED] - t[KVR_TR_HANDLE],
		    o->seen - t[KVR_TR_POSTED],
		    o->seen - (o->miss > t[KVR_TR_POSTED] ? o->miss : t[KVR_TR_POSTED]),
		    o->seen - o->t0,
		};
		for (int k = 0; k < S_N; k++) {
			row[m][k] = v[k];
			d[k][m] = v[k];
		}
		row[m][S_N] = o->t0;
		end[m] = v[S_END];
		m++;
	}
	printf("bench_sync: phase 2 began at CLOCK_MONOTONIC %.6f s (perf record -k mono aligns)\n",
	       n ? (double)obs[0].t0 * 1e-9 : 0.0);
	printf("bench_sync: stages of %zu admissions (%zu left out: seen only via another one, an "
	       "upper bound; %zu without every stamp)\n",
	       m, inferred, incomplete);
	uint64_t cut = pct(end, m, 0.99);
	double tail[S_N] = {0};
	size_t nt = 0;
	for (size_t i = 0; i < m; i++) {
		if (row[i][S_END] < cut)
			continue;
		if (nt < 40)
			printf("bench_sync: slow #%zu at %.1f ms: end_to_end=%.0f us "
			       "shard_to_seen=%.0f us "
			       "probe_resolution=%.0f us\n",
			       i, (double)(row[i][S_N] - obs[0].t0) / 1e6, row[i][S_END] / 1e3,
			       row[i][S_POSTED_SEEN] / 1e3, row[i][S_RESOLUTION] / 1e3);
		nt++;
		for (int k = 0; k < S_N; k++)
			tail[k] += (double)row[i][k];
	}
	for (int k = 0; k < S_N; k++) {
		uint64_t p50 = pct(d[k], m, 0.5), p99 = pct(d[k], m, 0.99);
		printf("SUMMARY bench=sync_stage stage=%s p50_us=%.1f p99_us=%.1f "
		       "mean_in_slowest_1pct_us=%.1f\n",
		       names[k], p50 / 1e3, p99 / 1e3, nt ? tail[k] / (double)nt / 1e3 : 0.0);
		free(d[k]);
	}
	free(end);
	free(row);
}

int main(int argc, char **argv)
{
	/* usage: bench_sync [--tokens N] [--rate R] [--seconds S] [--ranks K]
	 *                   [--capacity BLOCKS] [--stages] [--shard-spin-ns NS]
	 *                   [--route-rounds N] [--blk-grow-at PERMILLE] [--fronts S] */
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--stages")) {
			stages = true;
			i--;
		} else if (!strcmp(argv[i], "--tokens"))
			tokens = opt_u64(argc, argv, i, 16, 1u << 24);
		else if (!strcmp(argv[i], "--rate"))
			rate = opt_f64(argc, argv, i, 1e-3, 1e9);
		else if (!strcmp(argv[i], "--seconds"))
			seconds = opt_f64(argc, argv, i, 1e-3, 1e7);
		else if (!strcmp(argv[i], "--capacity"))
			capacity = opt_u64(argc, argv, i, 1, 1ull << 40);
		else if (!strcmp(argv[i], "--shard-spin-ns"))
			shard_spin_ns = (long)opt_u64(argc, argv, i, 0, 1000000000);
		else if (!strcmp(argv[i], "--route-rounds"))
			route_rounds = (int)opt_u64(argc, argv, i, 1, 1000000);
		else if (!strcmp(argv[i], "--ranks"))
			n_ranks = (uint32_t)opt_u64(argc, argv, i, 1, 65536);
		else if (!strcmp(argv[i], "--fronts"))
			fronts_s = opt_f64(argc, argv, i, 0, 1e7);
		else if (!strcmp(argv[i], "--blk-grow-at"))
			kvr_index_blk_grow_at = opt_u64(argc, argv, i, 1, 1000);
		else
			opt_unknown(argv, i);
	}
	if (!kvr_test_nats_installed()) {
		printf("bench_sync: nats-server not installed: skipped\n");
		return 77;
	}
	signal(SIGPIPE, SIG_IGN);
	pthread_setname_np(pthread_self(), "bench-main");
	if (kvr_test_nats_start()) {
		fprintf(stderr, "bench_sync: could not start nats-server\n");
		return 1;
	}
	label_new_threads(NULL, NULL); /* this thread and the server's reaper, if any */
	struct kvr_router *ra = make_router();
	label_new_threads("A", "shard");
	struct kvr_router *plain = make_router();
	label_new_threads("plain", "shard");
	rb = make_router();
	label_new_threads("B", "shard");
	struct kvr_sync *sa = attach(ra, 1), *sb = NULL;
	label_new_threads("A", "nats");
	if (!ra || !rb || !plain || !sa) {
		fprintf(stderr, "bench_sync: setup failed\n");
		kvr_test_nats_stop();
		return 1;
	}
	if (fronts_s > 0) {
		fronts_phase(ra, plain);
		kvr_sync_detach(sa);
		kvr_router_destroy(ra);
		kvr_router_destroy(rb);
		kvr_router_destroy(plain);
		kvr_test_nats_stop();
		return 0;
	}
	uint32_t *t = malloc(tokens * sizeof(uint32_t));

	/* 1. Route p50 with sync attached vs without, alternating: first with no peer on this
	 * machine (the routing path's own cost: note, encode, publish), then with peer B in this
	 * process applying everything A routes (B's index work competes for the same cores). */
	size_t n1 = 4000, warmup = 3000;
	uint64_t *with = malloc(n1 * 8), *without = malloc(n1 * 8);
	uint64_t *with_cpu = malloc(n1 * 8), *without_cpu = malloc(n1 * 8);
	uint64_t *with_rf = malloc(n1 * 8), *without_rf = malloc(n1 * 8);
	for (int round = 0; round <= route_rounds; round++) {
		int phase = round == route_rounds; /* the last round has peer B attached */
		if (phase == 1 && !(sb = attach(rb, 2))) {
			fprintf(stderr, "bench_sync: setup failed\n");
			kvr_test_nats_stop();
			return 1;
		}
		if (phase == 1)
			label_new_threads("B", "nats");
		for (size_t i = 0; i < n1 + warmup; i++) {
			prompt(t, tokens, i % 64); /* 64 conversations: hits and new blocks both */
			struct kvr_request q;
			kvr_request_init(&q);
			q.tokens = t;
			q.n_tokens = tokens;
			for (int k = 0; k < 2; k++) {
				bool synced = (k == 0) == (i % 2 == 0);
				struct kvr_router *r = synced ? ra : plain;
				struct kvr_decision d;
				uint64_t c0 = cpu_ns(), t0 = now_ns();
				int rc = kvr_route(r, &q, &d);
				uint64_t dt = now_ns() - t0, dc = cpu_ns() - c0;
				uint64_t t1 = now_ns();
				if (rc == 0)
					kvr_request_finish(r, d.attempt);
				uint64_t df = now_ns() - t1;
				if (i >=
				    warmup) { /* warm-up: journals and caches reach steady state */
					(synced ? with : without)[i - warmup] = dt;
					(synced ? with_cpu : without_cpu)[i - warmup] = dc;
					(synced ? with_rf : without_rf)[i - warmup] = dt + df;
				}
			}
		}
		uint64_t w50 = pct(with, n1, 0.5), o50 = pct(without, n1, 0.5);
		uint64_t w99 = pct(with, n1, 0.99), o99 = pct(without, n1, 0.99);
		printf(
		    "SUMMARY bench=sync_route peer=%s tokens=%zu ranks=%u n=%zu route_p50_ns=%lu "
		    "route_p50_nosync_ns=%lu ratio_p50=%.3f route_p99_ns=%lu "
		    "route_p99_nosync_ns=%lu ratio_p99=%.3f target_ratio_p50<=1.1 %s\n",
		    phase ? "in_process" : "none", tokens, n_ranks, n1, (unsigned long)w50,
		    (unsigned long)o50, (double)w50 / (double)o50, (unsigned long)w99,
		    (unsigned long)o99, (double)w99 / (double)o99,
		    (double)w50 / (double)o50 <= 1.1 ? "MET" : "MISSED");
		/* The same routes in the routing thread's own CPU time: what attaching costs the
		 * routing path itself, without the time the thread waited for a core (the wall
		 * ratio above also carries the sync threads' competition for the same cores). */
		uint64_t wc = pct(with_cpu, n1, 0.5), oc = pct(without_cpu, n1, 0.5);
		printf("SUMMARY bench=sync_route_cpu peer=%s tokens=%zu n=%zu route_cpu_p50_ns=%lu "
		       "route_cpu_p50_nosync_ns=%lu added_ns=%ld ratio_cpu_p50=%.3f\n",
		       phase ? "in_process" : "none", tokens, n1, (unsigned long)wc,
		       (unsigned long)oc, (long)wc - (long)oc, (double)wc / (double)oc);
		/* Route plus finish (wall): a cost the note defers on the caller's thread (stores
		 * still draining, paid at its next locked instruction) shows here if the finish
		 * pays it. */
		uint64_t wf = pct(with_rf, n1, 0.5), of = pct(without_rf, n1, 0.5);
		printf("SUMMARY bench=sync_route_finish peer=%s tokens=%zu n=%zu p50_ns=%lu "
		       "p50_nosync_ns=%lu added_ns=%ld ratio_p50=%.3f\n",
		       phase ? "in_process" : "none", tokens, n1, (unsigned long)wf,
		       (unsigned long)of, (long)wf - (long)of, (double)wf / (double)of);
	}
	/* B catches up with everything A sent before the propagation phase starts. */
	uint64_t catch0 = now_ns();
	for (;;) {
		struct kvr_sync_stats sta;
		uint64_t at = 0;
		kvr_sync_get_stats(sa, &sta);
		if (kvr_sync_peer_seq(sb, 1, &at) == 0 && at >= sta.seq)
			break;
		if (now_ns() - catch0 > 60000000000ull)
			break;
		usleep(1000);
	}
	kvr_router_sync(rb, 60000); /* and B's shards booked what its apply thread posted */
	double catch_s = (double)(now_ns() - catch0) * 1e-9;
	printf("bench_sync: B applied A's %zu routes + finishes %.2f s after A sent the last\n", n1,
	       catch_s);

	/* 2. Propagation at `rate` admissions/s. */
	struct kvr_config rc;
	kvr_router_get_config(ra, &rc);
	block_size = rc.block_size;
	n_obs = (size_t)(rate * seconds) + 16;
	obs = calloc(n_obs, sizeof(*obs));
	if (stages)
		__atomic_store_n(&kvr_rep_trace_origin, 1, __ATOMIC_RELAXED); /* A's id */
	struct cpu_snap cs0, cs1;
	cpu_snap(&cs0);
	pthread_t th;
	pthread_create(&th, NULL, prober, NULL);
	pthread_setname_np(th, "bench-prober");
	uint64_t period = (uint64_t)(1e9 / rate), start = now_ns(), n2 = 0, behind = 0;
	uint64_t end = start + (uint64_t)(seconds * 1e9);
	size_t nb = tokens / block_size;
	while (now_ns() < end) {
		uint64_t slot = start + n2 * period;
		uint64_t now = now_ns();
		if (now < slot) {
			struct timespec ts = {(time_t)((slot - now) / 1000000000ull),
			                      (long)((slot - now) % 1000000000ull)};
			nanosleep(&ts, NULL);
		}
		if (head - __atomic_load_n(&tail, __ATOMIC_ACQUIRE) >= RING) {
			behind++;
			n2++;
			continue;
		}
		prompt(t, tokens, 1000000 + n2);
		uint64_t *local = malloc(nb * 8);
		kvr_hash_blocks(t, tokens, block_size, NULL, local, NULL);
		struct kvr_request q;
		kvr_request_init(&q);
		q.local_hashes = local;
		q.n_hashes = nb;
		q.n_tokens = tokens;
		struct kvr_decision d;
		uint64_t t0 = now_ns();
		if (kvr_route(ra, &q, &d) != 0) {
			free(local);
			n2++;
			continue;
		}
		uint64_t routed = now_ns();
		kvr_request_finish(ra, d.attempt);
		if (n2 < n_obs)
			obs[n2] = (struct obs){.attempt = d.attempt, .t0 = t0, .routed = routed};
		struct probe *p = &ring[head % RING];
		p->no = n2;
		p->t0 = t0;
		p->rank = d.rank;
		p->local = local;
		p->nb = nb;
		__atomic_store_n(&head, head + 1, __ATOMIC_RELEASE);
		n2++;
	}
	double achieved = (double)head / ((double)(now_ns() - start) * 1e-9);
	__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	pthread_join(th, NULL); /* returns once B showed every admission (or gave up on it) */
	/* CPU from the start of the phase until B booked the last admission: all the work the
	 * admissions caused, even when the pipeline fell behind the rate.  The prober has exited
	 * by then: its CPU is not in the report. */
	cpu_snap(&cs1);
	double cpu_wall_s = (double)(now_ns() - start) * 1e-9;
	__atomic_store_n(&kvr_rep_trace_origin, 0, __ATOMIC_RELAXED);
	uint64_t p50 = pct(lat, n_lat, 0.5), p99 = pct(lat, n_lat, 0.99),
	         p999 = pct(lat, n_lat, 0.999);
	struct kvr_sync_stats st, sta;
	kvr_sync_get_stats(sb, &st);
	kvr_sync_get_stats(sa, &sta);
	printf("SUMMARY bench=sync_propagation tokens=%zu rate_asked=%.0f rate_achieved=%.0f "
	       "admissions=%lu skipped=%lu propagation_p50_us=%.1f p99_us=%.1f p999_us=%.1f "
	       "b_applied=%lu b_dropped=%lu a_published=%lu a_batches=%lu target_p99<=2000us %s\n",
	       tokens, rate, achieved, (unsigned long)head, (unsigned long)behind, p50 / 1e3,
	       p99 / 1e3, p999 / 1e3, (unsigned long)st.applied, (unsigned long)st.dropped,
	       (unsigned long)sta.published, (unsigned long)sta.batches,
	       p99 <= 2000000 ? "MET" : "MISSED");
	/* A's kvr_route at the paced rate (sync attached): what a note costs the routing path when
	 * the sender may be asleep between admissions (compare binaries; phase 1 routes back to
	 * back, where it never is). */
	size_t n_rt = n2 < n_obs ? n2 : n_obs, m_rt = 0;
	uint64_t *rt = malloc((n_rt ? n_rt : 1) * 8);
	for (size_t i = 0; i < n_rt; i++)
		if (obs[i].routed)
			rt[m_rt++] = obs[i].routed - obs[i].t0;
	printf("SUMMARY bench=sync_route_paced rate_asked=%.0f n=%zu route_p50_ns=%lu "
	       "route_p99_ns=%lu\n",
	       rate, m_rt, (unsigned long)pct(rt, m_rt, 0.5), (unsigned long)pct(rt, m_rt, 0.99));
	free(rt);
	if (stages) {
		cpu_report(&cs0, &cs1, cpu_wall_s, head);
		stage_report(n2 < n_obs ? n2 : n_obs);
	}
	kvr_sync_detach(sa);
	kvr_sync_detach(sb);
	kvr_router_destroy(ra);
	kvr_router_destroy(rb);
	kvr_router_destroy(plain);
	kvr_test_nats_stop();
	free(t);
	free(with);
	free(without);
	free(with_cpu);
	free(without_cpu);
	free(with_rf);
	free(without_rf);
	free(obs);
	return 0;
}
