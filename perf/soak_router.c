/*
 * soak_router - does anything a long-running router holds grow with time, requests served,
 * ranks churned, attempts expired, tickets queued, feeds or threads churned?
 *
 * perf/soak.c keeps steady traffic at a rate and watches the live bytes; this program instead
 * drives every kind of churn the public API allows in a cycle of phases that repeats, as fast
 * as it can, and prints every size the process and the API expose after each cycle, so a table
 * that grows by a few entries per rank removed (or per attempt expired, per ticket...) shows as
 * a figure that climbs cycle after cycle instead of staying flat.  That kind of growth is no
 * leak ASan reports: everything is still reachable, and freed at destroy.
 *
 * Two routers:
 *   A  approx_lru, a queue (queue_threshold 1, on_admit), ranks with capacities and one TTL
 *      rank (KVR_CAPACITY_NONE), short lease scans (idle attempts expire within the cycle).
 *   B  events mode, the same lifecycle, its cache fed by kvr_events_apply; a feed (ZeroMQ,
 *      when built) whose endpoints come and go.
 * Before the cycles, each router mints 2^20 + 2^15 attempts (prewarm): its lease table
 * (shards/lease.c) allocates its 8 MiB as the attempt ids walk through it, which reads as 8
 * bytes of growth a route for a router's first million routes, then stops (bounded; its pages
 * are given back behind the minter, so RSS does not follow).
 * One cycle:
 *   routes    --routes prompts on A and half as many on B: a few shared system prompts with
 *             distinct session tails (a global counter: the predicted caches evict), each then
 *             prefill done, outputs, finish; or abort; or kvr_request_cached; or left to the
 *             lease reaper (vanished after an output); some query-only, pinned, allowed, with
 *             a LoRA name.
 *   queue     A saturated by held prompts, then more routed: KVR_QUEUED; each queued one
 *             cancelled, waited for with a past deadline (KVR_ETIMEDOUT) then cancelled,
 *             waited for with KVR_ROUTE_WAIT and a short deadline, left to on_admit, or (one a
 *             cycle) waited for and abandoned (the router reclaims it with the attempt's
 *             lease); then the held ones finish, the queue drains.
 *   ranks     A: one rank removed and added back (same id, next incarnation), one replaced by
 *             a new worker id (ids grow as over weeks), one reset, one capacity switched
 *             (finite <-> TTL), a new worker with two dp ranks added, routed to and removed,
 *             attempts live across all of it (their calls then KVR_ESTALE), an observation;
 *             B: the same remove / re-add / new id churn.
 *   events    B: stored chains (with parents), removals of the oldest, a cleared event now and
 *             then, a numbered gap now and then.
 *   feed      B: an endpoint added for a new worker id, then removed (no publisher).
 *   threads   4 short-lived threads, each routing on both routers then exiting (a frontend's
 *             pool growing and shrinking: per-thread registrations must be handed back).
 *   replica   only with --nats URL (a NATS server, e.g. nats-server -a 127.0.0.1 -p 4333):
 *             A is attached as replica 1; each cycle a peer router attaches under a new
 *             replica id (a rolling deploy's new process), routes 16 prompts and detaches.
 *   routers   a router made, given 4 ranks, routed to 16 times and destroyed (an embedder that
 *             makes one per configuration): the process-wide state must not keep its trace.
 * After each cycle (every --report-every; kvr_router_sync first, so posted work is applied)
 * one line: RSS (statm), jemalloc stats.allocated after an epoch bump (-1 without jemalloc),
 * kvr_alloc_live_bytes, what no part of kvr_router_get_memory counts (unattrib: library minus
 * both routers' parts), each router's parts, its metrics text size and line count
 * (kvr_metrics_render), and the sums of its ranks' stats.  At the end a SUMMARY with each
 * figure at the end of warm-up, at the end, and its growth per report after warm-up (least
 * squares): flat is ~0 against the figure's noise.
 *
 * usage: soak_router [--seconds S] [--cycles N] [--warmup-cycles W] [--routes R] [--ranks K]
 *                    [--seed X] [--report-every C] [--phases LIST] [--nats URL] [--settle-ms M]
 *                    [--no-prewarm] [--quiet]
 *   --seconds: stop after S seconds (default 60) or N cycles (default 0 = no bound), whichever
 *   comes first (the prewarm, ~10-20 s, not counted).  --phases: which phases a cycle runs,
 *   comma-separated (default all: routes,queue,ranks,events,feed,threads,replica,routers,
 *   replica with --nats only): to find which one a
 *   growth comes from.  --report-every: a line every C cycles (--warmup-cycles counts
 *   reports).  --settle-ms: the pause before each report's figures (default 150: past the
 *   100 ms after which an idle router gives its attempt pool and lanes' pages back).  Not a test:
 * run it by hand, nice'd (two shards per router).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVR_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "core/alloc.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "tests/common/xorshift.h"

#define BLOCK       16
#define CAP_BLOCKS  4096 /* per rank of A: small, so a cycle's traffic evicts */
#define EV_CAP      2048 /* per rank of B: its events keep it below this */
#define MAX_RANKS   64
#define MAX_HELD    1024
#define N_FIGS      32
#define MAX_BATCHED 16384 /* per rank: the routes phase stays below it, the queue phase not */

/* phases (--phases) */
enum {
	P_ROUTES = 1,
	P_QUEUE = 2,
	P_RANKS = 4,
	P_EVENTS = 8,
	P_FEED = 16,
	P_THREADS = 32,
	P_REPLICA = 64, /* only with --nats */
	P_ROUTERS = 128,
	P_ALL = 255
};
static const char *nats_url; /* --nats: the replica phase's server */
static unsigned phases = P_ALL;

static uint64_t seed = 0x5eed;
static unsigned long n_errors;
static bool quiet;

/* An unexpected return code: counted, the first few printed. */
static void bad(const char *what, int rc)
{
	if (++n_errors <= 20)
		fprintf(stderr, "soak_router: %s: %s (%s)\n", what, kvr_strerror(rc),
		        kvr_last_error());
}

/* ---------------------------------------------------------------- figures */

static long rss_kib(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	long size = 0, res = -1;
	if (!f)
		return -1;
	if (fscanf(f, "%ld %ld", &size, &res) != 2)
		res = -1;
	fclose(f);
	return res < 0 ? -1 : res * (sysconf(_SC_PAGESIZE) / 1024);
}

struct fig {
	const char *name;
	double v[4096]; /* per cycle */
};
static struct fig figs[N_FIGS];
static int n_figs, n_cycles_rec;

static void rec(int k, const char *name, double v)
{
	figs[k].name = name;
	if (k >= n_figs)
		n_figs = k + 1;
	if (n_cycles_rec < 4096)
		figs[k].v[n_cycles_rec] = v;
}

/* Least-squares slope of v[from..to), per cycle. */
static double slope(const double *v, int from, int to)
{
	double n = to - from, sx = 0, sy = 0, sxx = 0, sxy = 0;
	if (n < 2)
		return 0;
	for (int i = from; i < to; i++) {
		sx += i;
		sy += v[i];
		sxx += (double)i * i;
		sxy += (double)i * v[i];
	}
	double d = n * sxx - sx * sx;
	return d == 0 ? 0 : (n * sxy - sx * sy) / d;
}

static char *metrics_buf;
static size_t metrics_cap = 1 << 20;

/* Renders r's metrics; *lines gets their line count.  Returns the text's size. */
static size_t render(struct kvr_router *r, size_t *lines)
{
	size_t len = 0;
	int rc = kvr_metrics_render(r, metrics_buf, metrics_cap, &len);
	if (rc == KVR_ERANGE) {
		free(metrics_buf);
		metrics_cap = len * 2;
		metrics_buf = malloc(metrics_cap);
		if (!metrics_buf)
			exit(1);
		rc = kvr_metrics_render(r, metrics_buf, metrics_cap, &len);
	}
	*lines = 0;
	if (rc) {
		bad("kvr_metrics_render", rc);
		return 0;
	}
	for (const char *p = metrics_buf; *p; p++)
		*lines += *p == '\n';
	return len;
}

/* ---------------------------------------------------------------- ranks */

struct rank {
	struct kvr_rank_id id;
	uint64_t inc;
	uint64_t cap;
	/* B: the blocks its events stored (a FIFO of external hashes), its last event id */
	uint64_t *ext;
	size_t head, n;
	uint64_t event_id;
	uint64_t parent; /* last stored block, 0 = none */
};

struct side {
	const char *name;
	struct kvr_router *r;
	struct rank ranks[MAX_RANKS];
	int n_ranks;
	uint64_t next_worker;
};

static struct side A = {.name = "A", .next_worker = 1000};
static struct side B = {.name = "B", .next_worker = 2000000};

static int rank_add(struct side *s, struct kvr_rank_id id, uint64_t inc, uint64_t cap)
{
	int rc = kvr_rank_add(s->r, id, inc, cap, MAX_BATCHED);
	if (rc) {
		bad("kvr_rank_add", rc);
		return rc;
	}
	struct rank *k = &s->ranks[s->n_ranks++];
	free(k->ext);
	*k = (struct rank){.id = id, .inc = inc, .cap = cap};
	if (s == &B) {
		k->ext = calloc(EV_CAP, sizeof(uint64_t));
		if (!k->ext)
			exit(1);
	}
	return 0;
}

static void rank_drop(struct side *s, int i)
{
	int rc = kvr_rank_remove(s->r, s->ranks[i].id);
	if (rc)
		bad("kvr_rank_remove", rc);
	free(s->ranks[i].ext);
	s->ranks[i] = s->ranks[--s->n_ranks];
	s->ranks[s->n_ranks].ext = NULL;
}

/* ---------------------------------------------------------------- requests */

static uint32_t tok[16384];
static uint64_t session; /* grows: every prompt's tail is new */

static size_t make_prompt(size_t tail_min, size_t tail_span)
{
	uint32_t fam = (uint32_t)(xorshift64(&seed) % 16);
	size_t sys = 256 + 64 * fam, tail = tail_min + xorshift64(&seed) % tail_span;
	uint64_t sess = ++session;
	for (size_t i = 0; i < sys; i++)
		tok[i] = fam * 1000003u + (uint32_t)i;
	for (size_t i = 0; i < tail; i++)
		tok[sys + i] = (uint32_t)(sess * 2654435761u) ^ (uint32_t)(i * 40503u);
	return sys + tail;
}

/* admitted by the queue, for on_admit: finished at the end of the queue phase */
static pthread_mutex_t adm_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t admitted[4096];
static size_t n_admitted;
static unsigned long n_on_admit, n_on_admit_failed;

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	pthread_mutex_lock(&adm_mu);
	if (d->status == KVR_DECIDED) {
		n_on_admit++;
		if (n_admitted < 4096)
			admitted[n_admitted++] = d->attempt;
	} else {
		n_on_admit_failed++;
	}
	pthread_mutex_unlock(&adm_mu);
}

struct counts {
	unsigned long routes, finished, aborted, vanished, cached, stale, queued, query, cancelled,
	    waited, timed_out, abandoned, events, feeds, threads, replicas, routers;
};
static struct counts cnt;

static int end_rc(int rc, const char *what)
{
	if (rc == KVR_ESTALE)
		cnt.stale++;
	else if (rc)
		bad(what, rc);
	return rc;
}

/* Runs one admitted attempt's whole life (or part of it: vanished). */
static void lifecycle(struct kvr_router *r, uint64_t attempt, size_t prompt)
{
	uint32_t out[40];
	unsigned how = (unsigned)(xorshift64(&seed) % 100);
	if (how < 8) {
		end_rc(kvr_request_abort(r, attempt), "kvr_request_abort");
		cnt.aborted++;
		return;
	}
	if (end_rc(kvr_request_prefill_done(r, attempt), "kvr_request_prefill_done"))
		return;
	if (how < 14) {
		int rc = kvr_request_cached(r, attempt, (prompt / 2) & ~(uint64_t)(BLOCK - 1));
		if (rc && rc != KVR_ESTALE)
			bad("kvr_request_cached", rc);
		cnt.cached++;
	}
	int n_out = 1 + (int)(xorshift64(&seed) % 3);
	for (int k = 0; k < n_out; k++) {
		for (int i = 0; i < 40; i++)
			out[i] = (uint32_t)xorshift64(&seed);
		int rc = k == n_out - 1 && how % 2
		             ? kvr_request_output_ex(r, attempt, out, 17, KVR_OUTPUT_FINAL)
		             : kvr_request_output(r, attempt, out, 8 + xorshift64(&seed) % 33);
		if (end_rc(rc, "kvr_request_output"))
			return;
	}
	if (how >= 96) {
		cnt.vanished++; /* never ended: the lease reaper's */
		return;
	}
	end_rc(kvr_request_finish(r, attempt), "kvr_request_finish");
	cnt.finished++;
}

static const char *loras[] = {NULL, NULL, NULL, "adapter-a", "adapter-b"};

/* One routed prompt on s, its lifecycle run at once (or *held gets it). */
static void route_one(struct side *s, bool lifecycle_now, uint64_t *held)
{
	size_t n = make_prompt(64, 1024);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = n;
	q.request_id = session;
	q.expected_output_tokens = 64;
	q.lora_name = loras[xorshift64(&seed) % 5];
	unsigned opt = (unsigned)(xorshift64(&seed) % 40);
	struct kvr_rank_id allow[3];
	if (opt == 0 && s->n_ranks) {
		q.pinned = &s->ranks[xorshift64(&seed) % (uint64_t)s->n_ranks].id;
	} else if (opt == 1 && s->n_ranks) {
		for (int i = 0; i < 3; i++)
			allow[i] = s->ranks[xorshift64(&seed) % (uint64_t)s->n_ranks].id;
		allow[2].worker_id = 999999999; /* unknown: ignored */
		q.allow = allow;
		q.n_allow = 3;
	} else if (opt == 2) {
		q.flags = KVR_ROUTE_QUERY_ONLY;
	}
	struct kvr_decision d;
	int rc = kvr_route(s->r, &q, &d);
	cnt.routes++;
	if (rc == KVR_EAGAIN || rc == KVR_ENOENT)
		return;
	if (rc) {
		bad("kvr_route", rc);
		return;
	}
	if (q.flags & KVR_ROUTE_QUERY_ONLY) {
		cnt.query++;
		return;
	}
	if (d.status == KVR_QUEUED) {
		cnt.queued++;
		if (kvr_route_cancel(s->r, d.ticket) == 0)
			cnt.cancelled++;
		return;
	}
	if (held)
		*held = d.attempt;
	else if (lifecycle_now)
		lifecycle(s->r, d.attempt, n);
}

/* ---------------------------------------------------------------- phases */

static void phase_routes(int n)
{
	for (int i = 0; i < n; i++)
		route_one(&A, true, NULL);
	for (int i = 0; i < n / 2; i++)
		route_one(&B, true, NULL);
}

static void finish_admitted(void)
{
	for (;;) {
		pthread_mutex_lock(&adm_mu);
		if (!n_admitted) {
			pthread_mutex_unlock(&adm_mu);
			return;
		}
		uint64_t a = admitted[--n_admitted];
		pthread_mutex_unlock(&adm_mu);
		end_rc(kvr_request_finish(A.r, a), "kvr_request_finish (admitted)");
	}
}

static void phase_queue(void)
{
	static uint64_t held[MAX_HELD];
	int n_held = 0, n_q = 0;
	uint64_t tickets[256];
	/* saturate: long prompts whose prefill never ends while they are held */
	for (int i = 0; i < 4 * A.n_ranks + 8 && n_held < MAX_HELD; i++) {
		size_t n = make_prompt(8192, 4096);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n;
		struct kvr_decision d;
		int rc = kvr_route(A.r, &q, &d);
		cnt.routes++;
		if (rc) {
			if (rc != KVR_EAGAIN)
				bad("kvr_route (saturate)", rc);
			continue;
		}
		if (d.status == KVR_DECIDED)
			held[n_held++] = d.attempt;
		else if (n_q < 256)
			tickets[n_q++] = d.ticket;
		else
			end_rc(kvr_route_cancel(A.r, d.ticket), "kvr_route_cancel");
	}
	/* more: these queue */
	for (int i = 0; i < 24 && n_q < 256; i++) {
		size_t n = make_prompt(256, 512);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n;
		bool wait = i % 6 == 5;
		if (wait) {
			q.flags = KVR_ROUTE_WAIT;
			q.deadline_ns = kvr_router_now(A.r) + 2000000; /* 2 ms */
		}
		struct kvr_decision d;
		int rc = kvr_route(A.r, &q, &d);
		cnt.routes++;
		if (rc == KVR_ETIMEDOUT) {
			cnt.timed_out++;
			tickets[n_q++] = d.ticket;
			continue;
		}
		if (rc) {
			if (rc != KVR_EAGAIN)
				bad("kvr_route (queue)", rc);
			continue;
		}
		if (d.status == KVR_DECIDED)
			held[n_held++] = d.attempt;
		else {
			cnt.queued++;
			tickets[n_q++] = d.ticket;
		}
	}
	/* every queued one: cancelled, waited out then cancelled, or left to on_admit; one a
	 * cycle waited for and then abandoned */
	bool abandoned = false;
	for (int i = 0; i < n_q; i++) {
		struct kvr_decision d;
		int rc;
		switch (i % 4) {
		case 0:
			rc = kvr_route_cancel(A.r, tickets[i]);
			if (rc == 0)
				cnt.cancelled++;
			else if (rc != KVR_ENOENT)
				bad("kvr_route_cancel", rc);
			break;
		case 1:
			rc = kvr_route_wait(A.r, tickets[i], 1, &d); /* deadline passed */
			if (rc == KVR_ETIMEDOUT) {
				cnt.waited++;
				if (!abandoned) {
					abandoned = true; /* nobody collects it: the router's */
					cnt.abandoned++;
					break;
				}
				rc = kvr_route_cancel(A.r, tickets[i]);
				if (rc == 0)
					cnt.cancelled++;
				else if (rc != KVR_ENOENT)
					bad("kvr_route_cancel (after wait)", rc);
			} else if (rc == 0 && d.status == KVR_DECIDED) {
				held[n_held++] = d.attempt;
			} else if (rc != KVR_ENOENT) {
				bad("kvr_route_wait", rc);
			}
			break;
		default:
			break; /* on_admit's */
		}
	}
	/* release: prefill done for half, then finish / abort all */
	for (int i = 0; i < n_held; i++)
		if (i % 2)
			end_rc(kvr_request_prefill_done(A.r, held[i]), "kvr_request_prefill_done");
	for (int i = 0; i < n_held; i++) {
		if (i % 3)
			end_rc(kvr_request_finish(A.r, held[i]), "kvr_request_finish");
		else
			end_rc(kvr_request_abort(A.r, held[i]), "kvr_request_abort");
	}
	kvr_router_sync(A.r, 5000);
	finish_admitted();
	kvr_router_sync(A.r, 5000);
	finish_admitted();
}

static void phase_ranks(void)
{
	uint64_t live[8];
	int n_live = 0;
	/* attempts live across the churn: their later calls may be KVR_ESTALE */
	for (int i = 0; i < 8; i++) {
		live[n_live] = 0;
		route_one(&A, false, &live[n_live]);
		if (live[n_live])
			n_live++;
	}
	/* A: remove and re-add the same id, next incarnation */
	int i = (int)(xorshift64(&seed) % (uint64_t)A.n_ranks);
	struct rank k = A.ranks[i];
	k.ext = NULL;
	rank_drop(&A, i);
	rank_add(&A, k.id, k.inc + 1, k.cap);
	/* A: replace one by a new worker id (ids only grow) */
	i = (int)(xorshift64(&seed) % (uint64_t)A.n_ranks);
	uint64_t cap = A.ranks[i].cap;
	rank_drop(&A, i);
	rank_add(&A, (struct kvr_rank_id){A.next_worker++, 0}, 1, cap);
	/* A: reset one, switch one's capacity (finite <-> TTL, same incarnation) */
	i = (int)(xorshift64(&seed) % (uint64_t)A.n_ranks);
	int rc = kvr_rank_reset(A.r, A.ranks[i].id, ++A.ranks[i].inc);
	if (rc)
		bad("kvr_rank_reset", rc);
	i = (int)(xorshift64(&seed) % (uint64_t)A.n_ranks);
	A.ranks[i].cap = A.ranks[i].cap == KVR_CAPACITY_NONE ? CAP_BLOCKS : KVR_CAPACITY_NONE;
	rc = kvr_rank_set_capacity(A.r, A.ranks[i].id, A.ranks[i].inc, A.ranks[i].cap);
	if (rc)
		bad("kvr_rank_set_capacity", rc);
	/* A: a new worker with two dp ranks, routed to, then gone */
	uint64_t w = A.next_worker++;
	int n0 = A.n_ranks;
	rank_add(&A, (struct kvr_rank_id){w, 0}, 1, CAP_BLOCKS);
	rank_add(&A, (struct kvr_rank_id){w, 1}, 1, CAP_BLOCKS);
	for (int j = 0; j < 16; j++)
		route_one(&A, true, NULL);
	while (A.n_ranks > n0)
		rank_drop(&A, A.n_ranks - 1);
	/* A: the engine's numbers now and then */
	struct kvr_rank_observation obs = {.flags = KVR_OBSERVE_RESIDENT,
	                                   .incarnation = A.ranks[0].inc,
	                                   .resident_blocks = CAP_BLOCKS / 2};
	rc = kvr_rank_observe(A.r, A.ranks[0].id, &obs);
	if (rc && rc != KVR_ESTALE)
		bad("kvr_rank_observe", rc);
	/* the held attempts end now */
	for (int j = 0; j < n_live; j++)
		lifecycle(A.r, live[j], 512);
	/* B: remove and re-add the same id (its events start over), and a new id */
	i = (int)(xorshift64(&seed) % (uint64_t)B.n_ranks);
	struct kvr_rank_id id = B.ranks[i].id;
	uint64_t inc = B.ranks[i].inc;
	rank_drop(&B, i);
	rank_add(&B, id, inc + 1, EV_CAP);
	i = (int)(xorshift64(&seed) % (uint64_t)B.n_ranks);
	rank_drop(&B, i);
	rank_add(&B, (struct kvr_rank_id){B.next_worker++, (uint32_t)(xorshift64(&seed) % 4)}, 1,
	         EV_CAP);
}

static uint64_t ext_counter = 1;

static void apply(struct rank *k, struct kvr_event *ev, bool gap)
{
	k->event_id += gap ? 3 : 1;
	ev->event_id = k->event_id;
	int rc = kvr_events_apply(B.r, k->id, ev);
	cnt.events++;
	if (rc && rc != KVR_ENOENT)
		bad("kvr_events_apply", rc);
}

static void phase_events(void)
{
	struct kvr_event_block blk[32];
	uint32_t btok[32][BLOCK];
	for (int r = 0; r < B.n_ranks; r++) {
		struct rank *k = &B.ranks[r];
		for (int e = 0; e < 12; e++) {
			/* removals first, so the rank stays under EV_CAP */
			size_t want = 1 + xorshift64(&seed) % 32;
			if (k->n + want > EV_CAP || (k->n > 64 && xorshift64(&seed) % 3 == 0)) {
				size_t m = k->n < 48 ? k->n : 48;
				uint64_t rem[48];
				for (size_t j = 0; j < m; j++)
					rem[j] = k->ext[(k->head + j) % EV_CAP];
				k->head = (k->head + m) % EV_CAP;
				k->n -= m;
				struct kvr_event ev = {
				    .type = KVR_EVENT_REMOVED, .removed = rem, .n_removed = m};
				if (m)
					apply(k, &ev, false);
				if (k->n == 0)
					k->parent = 0;
			}
			/* a chain: after the last stored block (its parent) or a new root */
			bool root = !k->parent || xorshift64(&seed) % 4 == 0;
			for (size_t j = 0; j < want; j++) {
				for (int t = 0; t < BLOCK; t++)
					btok[j][t] = (uint32_t)(ext_counter * 31 + (uint64_t)t);
				blk[j] = (struct kvr_event_block){.ext_hash = ext_counter++,
				                                  .tokens = btok[j],
				                                  .n_tokens = BLOCK};
			}
			struct kvr_event ev = {.type = KVR_EVENT_STORED,
			                       .has_parent = !root,
			                       .parent_ext_hash = root ? 0 : k->parent,
			                       .blocks = blk,
			                       .n_blocks = want};
			apply(k, &ev, xorshift64(&seed) % 50 == 0);
			for (size_t j = 0; j < want; j++)
				k->ext[(k->head + k->n++) % EV_CAP] = blk[j].ext_hash;
			k->parent = blk[want - 1].ext_hash;
		}
		if (xorshift64(&seed) % 8 == 0) {
			struct kvr_event ev = {.type = KVR_EVENT_CLEARED};
			apply(k, &ev, false);
			/* a cleared event drops every dp rank of the worker */
			for (int o = 0; o < B.n_ranks; o++)
				if (B.ranks[o].id.worker_id == k->id.worker_id) {
					B.ranks[o].n = B.ranks[o].head = 0;
					B.ranks[o].parent = 0;
				}
		}
	}
}

/* A short-lived thread (a frontend's pool growing and shrinking): its first call registers it
 * with the library (RCU, metrics block, scratch buffers), its exit hands that back. */
static void *thread_main(void *arg)
{
	(void)arg;
	uint64_t tseed = seed ^ 0x9e3779b97f4a7c15ull;
	uint32_t t[256];
	for (int i = 0; i < 8; i++) {
		for (int j = 0; j < 256; j++)
			t[j] = (uint32_t)(i * 7 + j);
		t[255] = (uint32_t)xorshift64(&tseed);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 256;
		struct kvr_decision d;
		struct side *s = i % 2 ? &B : &A;
		if (kvr_route(s->r, &q, &d) == 0 && d.status == KVR_DECIDED)
			(void)kvr_request_finish(s->r, d.attempt);
		else if (d.status == KVR_QUEUED)
			(void)kvr_route_cancel(s->r, d.ticket);
	}
	struct kvr_rank_stats st;
	(void)kvr_rank_get_stats(B.r, B.ranks[0].id, &st);
	return NULL;
}

static void phase_threads(void)
{
	for (int i = 0; i < 4; i++) {
		pthread_t th;
		if (pthread_create(&th, NULL, thread_main, NULL) != 0) {
			bad("pthread_create", 0);
			return;
		}
		pthread_join(th, NULL);
		cnt.threads++;
	}
}

static struct kvr_feed *feed;
static struct kvr_sync *sync_a; /* A's replica attachment (--nats) */
static uint64_t next_replica = 100;

static struct kvr_sync *attach(struct kvr_router *r, uint64_t id)
{
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = nats_url;
	c.cluster = "soak";
	c.replica_id = id;
	c.heartbeat_ms = 50;
	c.dead_after = 20; /* a loaded machine must not fake deaths */
	struct kvr_sync *sy = NULL;
	int rc = kvr_sync_attach(r, &c, &sy);
	if (rc) {
		bad("kvr_sync_attach", rc);
		return NULL;
	}
	if ((rc = kvr_sync_wait_ready(sy, 5000)))
		bad("kvr_sync_wait_ready", rc);
	return sy;
}

/* A peer replica comes (a new replica id: a frontend's rolling deploy), routes, and goes; or,
 * with replica false, a router alone (an embedder that makes a router per configuration). */
static void phase_peer(bool replica)
{
	if (replica && !sync_a)
		return;
	struct kvr_config c;
	kvr_config_init(&c);
	c.block_size = BLOCK;
	c.n_shards = 1;
	c.shard_idle_spin_ns = 0;
	struct side C = {.name = "C"};
	if (kvr_router_create(&c, &C.r)) {
		bad("kvr_router_create (peer)", 0);
		return;
	}
	for (int i = 0; i < A.n_ranks && i < 4; i++)
		if (kvr_rank_add(C.r, A.ranks[i].id, A.ranks[i].inc, CAP_BLOCKS, MAX_BATCHED) == 0)
			C.ranks[C.n_ranks++].id = A.ranks[i].id;
	struct kvr_sync *sy = replica ? attach(C.r, next_replica++) : NULL;
	for (int i = 0; i < 16 && (sy || !replica); i++)
		route_one(&C, true, NULL);
	if (sy)
		(void)kvr_sync_drain(sy, 1000);
	kvr_sync_detach(sy);
	kvr_router_destroy(C.r);
	if (replica)
		cnt.replicas++;
	else
		cnt.routers++;
}

static void phase_feed(int cycle)
{
	if (!feed)
		return;
	char ep[128];
	snprintf(ep, sizeof(ep), "ipc:///tmp/soak_router_%d_%d", (int)getpid(), cycle % 4);
	struct kvr_feed_endpoint e = {
	    .endpoint = ep, .worker_id = B.next_worker + 1000000 + (uint64_t)cycle, .dp_rank = 0};
	uint32_t id;
	int rc = kvr_feed_add(feed, &e, &id);
	if (rc) {
		bad("kvr_feed_add", rc);
		return;
	}
	struct kvr_feed_stats st;
	if ((rc = kvr_feed_get_stats(feed, KVR_FEED_ALL, &st)))
		bad("kvr_feed_get_stats", rc);
	if ((rc = kvr_feed_remove(feed, id)))
		bad("kvr_feed_remove", rc);
	cnt.feeds++;
}

/* Mints 2^20 + 2^15 attempts on s (one-block prompts, aborted at once), so that the lease
 * table (shards/lease.c: 2^20 words, 8 MiB allocated as the ids walk through them, whose pages
 * are given back behind the minter) has reached its full size before the cycles measure: else it
 * reads as 8 bytes of growth per route for the first million routes of each router. */
static void prewarm(struct side *s)
{
	uint32_t t[BLOCK];
	for (int i = 0; i < BLOCK; i++)
		t[i] = 7u + (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = BLOCK;
	q.pinned = &s->ranks[0].id;
	for (uint32_t i = 0; i < (1u << 20) + (1u << 15); i++) {
		struct kvr_decision d;
		int rc = kvr_route(s->r, &q, &d);
		if (rc == KVR_EAGAIN)
			continue;
		if (rc || d.status != KVR_DECIDED) {
			bad("kvr_route (prewarm)", rc);
			return;
		}
		end_rc(kvr_request_abort(s->r, d.attempt), "kvr_request_abort (prewarm)");
	}
	kvr_router_sync(s->r, 5000);
}

/* ---------------------------------------------------------------- report */

struct sums {
	uint64_t resident, indexed, active_req, active_blocks, prefill;
};

static struct sums rank_sums(struct side *s)
{
	struct sums x = {0};
	for (int i = 0; i < s->n_ranks; i++) {
		struct kvr_rank_stats st;
		int rc = kvr_rank_get_stats(s->r, s->ranks[i].id, &st);
		if (rc) {
			bad("kvr_rank_get_stats", rc);
			continue;
		}
		x.resident += st.resident_blocks;
		x.indexed += st.indexed_blocks;
		x.active_req += st.active_requests;
		x.active_blocks += st.active_blocks;
		x.prefill += st.active_prefill_tokens;
	}
	return x;
}

static unsigned settle_ms = 150;

static void report(int cycle, double t)
{
	kvr_router_sync(A.r, 5000);
	kvr_router_sync(B.r, 5000);
	/* Let what is transient settle: memory retired behind an RCU grace period, the attempt
	 * pools and the lanes' pages that an idle router gives back after 100 ms, the leases that
	 * expire within two scans (40 ms).  Without it the figures swing by megabytes with what
	 * happened to be in flight. */
	if (settle_ms) {
		nanosleep(&(struct timespec){settle_ms / 1000, (long)(settle_ms % 1000) * 1000000},
		          NULL);
		kvr_router_sync(A.r, 5000);
		kvr_router_sync(B.r, 5000);
	}
	struct kvr_memory ma, mb;
	int rc;
	if ((rc = kvr_router_get_memory(A.r, &ma)))
		bad("kvr_router_get_memory A", rc);
	if ((rc = kvr_router_get_memory(B.r, &mb)))
		bad("kvr_router_get_memory B", rc);
	size_t la, lb;
	size_t ta = render(A.r, &la), tb = render(B.r, &lb);
	struct sums sa = rank_sums(&A), sb = rank_sums(&B);
	long rss = rss_kib();
	long long je = bench_jemalloc_allocated();
	int64_t live = kvr_alloc_live_bytes();
	int f = 0;
	rec(f++, "rss_kib", (double)rss);
	rec(f++, "je_allocated", (double)je);
	rec(f++, "lib_live", (double)live);
	rec(f++, "A.index", (double)ma.index);
	rec(f++, "A.caches", (double)ma.caches);
	rec(f++, "A.load", (double)ma.load);
	rec(f++, "A.lanes", (double)ma.lanes);
	rec(f++, "A.rank_tables", (double)ma.rank_tables);
	rec(f++, "A.attempt_pool", (double)ma.attempt_pool);
	rec(f++, "A.metrics_bytes", (double)ta);
	rec(f++, "A.metrics_lines", (double)la);
	rec(f++, "A.resident", (double)sa.resident);
	rec(f++, "A.indexed", (double)sa.indexed);
	rec(f++, "A.active_req", (double)sa.active_req);
	rec(f++, "B.index", (double)mb.index);
	rec(f++, "B.load", (double)mb.load);
	rec(f++, "B.lanes", (double)mb.lanes);
	rec(f++, "B.attempt_pool", (double)mb.attempt_pool);
	rec(f++, "B.metrics_bytes", (double)tb);
	rec(f++, "B.metrics_lines", (double)lb);
	rec(f++, "B.indexed", (double)sb.indexed);
	rec(f++, "B.active_req", (double)sb.active_req);
	rec(f++, "A.replica_ranks", (double)ma.replica_ranks);
	rec(f++, "library", (double)ma.library);
	/* what no part counts (both routers): leases, pinned-run maps, tickets, metrics... */
	double other = (double)ma.library -
	               (double)(ma.index + ma.caches + ma.load + ma.lanes + ma.rank_tables +
	                        ma.attempt_pool + ma.replica_ranks) -
	               (double)(mb.index + mb.caches + mb.load + mb.lanes + mb.rank_tables +
	                        mb.attempt_pool + mb.replica_ranks);
	rec(f++, "unattributed", other);
	rec(f++, "arena", (double)ma.arena);
	struct kvr_sync_stats ss = {0};
	if (sync_a && (rc = kvr_sync_get_stats(sync_a, &ss)))
		bad("kvr_sync_get_stats", rc);
	rec(f++, "A.peers_alive", (double)ss.peers_alive);
	rec(f++, "A.mirrored", (double)ss.mirrored);
	if (n_cycles_rec < 4096)
		n_cycles_rec++;
	if (quiet)
		return;
	if (cycle == 0)
		printf("%5s %6s %8s %11s %11s %10s | %9s %9s %8s %8s %7s %7s %7s %6s %5s %6s %5s | "
		       "%9s "
		       "%8s "
		       "%8s %6s %5s %6s %4s\n",
		       "cycle", "t_s", "rss_kib", "je_alloc", "lib_live", "unattrib", "A.index",
		       "A.caches", "A.load", "A.lanes", "A.ranktb", "A.pool", "A.reprk", "A.metB",
		       "A.metL", "A.res", "A.act", "B.index", "B.load", "B.lanes", "B.metB",
		       "B.metL", "B.idx", "B.act");
	printf("%5d %6.1f %8ld %11lld %11" PRId64 " %10.0f | %9" PRIu64 " %9" PRIu64 " %8" PRIu64
	       " %8" PRIu64 " %7" PRIu64 " %7" PRIu64 " %7" PRIu64 " %6zu %5zu %6" PRIu64
	       " %5" PRIu64 " | %9" PRIu64 " %8" PRIu64 " %8" PRIu64 " %6zu %5zu %6" PRIu64
	       " %4" PRIu64 "\n",
	       cycle, t, rss, je, live, other, ma.index, ma.caches, ma.load, ma.lanes,
	       ma.rank_tables, ma.attempt_pool, ma.replica_ranks, ta, la, sa.resident,
	       sa.active_req, mb.index, mb.load, mb.lanes, tb, lb, sb.indexed, sb.active_req);
	fflush(stdout);
}

int main(int argc, char **argv)
{
	double seconds = 60;
	uint64_t max_cycles = 0, warmup = 10, routes = 1500;
	int n_ranks = 8, report_every = 1;
	bool do_prewarm = true;
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--seconds"))
			seconds = opt_f64(argc, argv, i, 0.001, 1e7);
		else if (!strcmp(argv[i], "--cycles"))
			max_cycles = opt_u64(argc, argv, i, 0, 1000000000);
		else if (!strcmp(argv[i], "--warmup-cycles"))
			warmup = opt_u64(argc, argv, i, 0, 4000);
		else if (!strcmp(argv[i], "--routes"))
			routes = opt_u64(argc, argv, i, 1, 1000000);
		else if (!strcmp(argv[i], "--ranks"))
			n_ranks = (int)opt_u64(argc, argv, i, 2, 32);
		else if (!strcmp(argv[i], "--seed"))
			seed = opt_u64(argc, argv, i, 1, UINT64_MAX);
		else if (!strcmp(argv[i], "--report-every"))
			report_every = (int)opt_u64(argc, argv, i, 1, 1000000);
		else if (!strcmp(argv[i], "--phases")) {
			const char *v = opt_str(argc, argv, i);
			static const char *names[] = {"routes", "queue",   "ranks",   "events",
			                              "feed",   "threads", "replica", "routers"};
			phases = 0;
			for (const char *p = v; *p;) {
				size_t len = strcspn(p, ",");
				int k = 0;
				while (k < 8 &&
				       (strlen(names[k]) != len || strncmp(p, names[k], len)))
					k++;
				if (k == 8)
					opt_bad(argv, i,
					        "a comma-separated list of routes, queue, ranks, "
					        "events, feed, threads, replica, routers",
					        v);
				phases |= 1u << k;
				p += len + (p[len] == ',');
			}
		} else if (!strcmp(argv[i], "--settle-ms")) {
			settle_ms = (unsigned)opt_u64(argc, argv, i, 0, 10000);
		} else if (!strcmp(argv[i], "--nats")) {
			nats_url = opt_str(argc, argv, i);
		} else if (!strcmp(argv[i], "--no-prewarm")) {
			do_prewarm = false;
			i--;
		} else if (!strcmp(argv[i], "--quiet")) {
			quiet = true;
			i--;
		} else
			opt_unknown(argv, i);
	}
	metrics_buf = malloc(metrics_cap);
	if (!metrics_buf)
		return 1;
	struct kvr_config c;
	kvr_config_init(&c);
	c.block_size = BLOCK;
	c.n_shards = 2;
	c.shard_idle_spin_ns = 0;            /* a shared machine: park when idle */
	c.lease_scan_interval_ns = 20000000; /* vanished attempts expire within 20-40 ms */
	c.ttl_ns = 200000000;                /* TTL ranks forget within the run */
	c.max_ranks = 256;
	c.queue_threshold = 1.0;
	c.queue_capacity = 512;
	c.on_admit = on_admit;
	int rc = kvr_router_create(&c, &A.r);
	if (rc) {
		fprintf(stderr, "soak_router: create A: %s\n", kvr_last_error());
		return 1;
	}
	kvr_config_init(&c);
	c.block_size = BLOCK;
	c.n_shards = 2;
	c.shard_idle_spin_ns = 0;
	c.lease_scan_interval_ns = 20000000;
	c.max_ranks = 256;
	c.mode = KVR_MODE_EVENTS;
	if ((rc = kvr_router_create(&c, &B.r))) {
		fprintf(stderr, "soak_router: create B: %s\n", kvr_last_error());
		return 1;
	}
	for (int i = 0; i < n_ranks; i++)
		rank_add(&A, (struct kvr_rank_id){(uint64_t)(i / 2 + 1), (uint32_t)(i % 2)}, 1,
		         i == n_ranks - 1 ? KVR_CAPACITY_NONE : CAP_BLOCKS);
	for (int i = 0; i < n_ranks / 2; i++)
		rank_add(&B, (struct kvr_rank_id){1000000 + (uint64_t)i, 0}, 1, EV_CAP);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	rc = kvr_feed_create(B.r, &fc, &feed);
	if (rc) {
		feed = NULL;
		if (rc != KVR_ENOTSUP)
			bad("kvr_feed_create", rc);
	}
	if (do_prewarm) {
		uint64_t p0 = now_ns();
		prewarm(&A);
		prewarm(&B);
		printf(
		    "soak_router: prewarm (2 x 2^20 + 2^15 attempts minted and aborted) %.1f s\n",
		    (double)(now_ns() - p0) / 1e9);
	}
	if (nats_url && (phases & P_REPLICA))
		sync_a = attach(A.r, 1);
	printf("soak_router: %.0f s or %" PRIu64 " cycles, %" PRIu64
	       " routes a cycle, %d ranks on A, %d on B, warm-up %" PRIu64 " cycles, feed %s, "
	       "jemalloc stats %s\n",
	       seconds, max_cycles, routes, n_ranks, n_ranks / 2, warmup, feed ? "on" : "off",
	       bench_jemalloc_allocated() >= 0 ? "on" : "off");
	uint64_t t0 = now_ns();
	int cycle = 0;
	for (;; cycle++) {
		double t = (double)(now_ns() - t0) / 1e9;
		if (t >= seconds || (max_cycles && (uint64_t)cycle >= max_cycles))
			break;
		if (phases & P_ROUTES)
			phase_routes((int)routes);
		if (phases & P_QUEUE)
			phase_queue();
		if (phases & P_RANKS)
			phase_ranks();
		if (phases & P_EVENTS)
			phase_events();
		if (phases & P_FEED)
			phase_feed(cycle);
		if (phases & P_THREADS)
			phase_threads();
		if (phases & P_REPLICA)
			phase_peer(true);
		if (phases & P_ROUTERS)
			phase_peer(false);
		if (cycle % report_every == 0)
			report(cycle / report_every, (double)(now_ns() - t0) / 1e9);
	}
	if (feed)
		kvr_feed_destroy(feed);
	kvr_sync_detach(sync_a);
	int nc = n_cycles_rec;
	int w = (int)warmup < nc - 1 ? (int)warmup : 0;
	printf("soak_router: %d cycles, %lu routes (%lu query-only, %lu queued, %lu cancelled, %lu "
	       "waited out, %lu route-waits timed out, %lu abandoned), %lu finished, %lu aborted, "
	       "%lu cached, %lu vanished, %lu stale, %lu on_admit (%lu failed), %lu events, %lu "
	       "feed endpoints, %lu threads, %lu peer replicas, %lu routers made and destroyed, "
	       "%lu errors\n",
	       cycle, cnt.routes, cnt.query, cnt.queued, cnt.cancelled, cnt.waited, cnt.timed_out,
	       cnt.abandoned, cnt.finished, cnt.aborted, cnt.cached, cnt.vanished, cnt.stale,
	       n_on_admit, n_on_admit_failed, cnt.events, cnt.feeds, cnt.threads, cnt.replicas,
	       cnt.routers, n_errors);
	/* each figure: at the end of warm-up, at the end, and its slope per cycle after warm-up */
	printf("SUMMARY soak_router cycles=%d warmup=%d errors=%lu", nc, w, n_errors);
	for (int k = 0; k < n_figs && nc; k++)
		printf(" %s=%.0f/%.0f/%+.1f", figs[k].name, figs[k].v[w], figs[k].v[nc - 1],
		       slope(figs[k].v, w, nc));
	printf("\n");
	kvr_router_destroy(A.r);
	kvr_router_destroy(B.r);
	free(metrics_buf);
	for (int i = 0; i < MAX_RANKS; i++)
		free(B.ranks[i].ext);
	return n_errors ? 1 : 0;
}
