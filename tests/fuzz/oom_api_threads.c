/*
 * tests/fuzz/oom_api_threads.c - oom_api's threaded mode (oom_api --threads N): 2-3 frontend
 * threads on one router route, report output, and finish or abort attempts, their own and each
 * other's, while any of them arms an allocation failure a few allocations ahead before about a
 * third of its calls (the failure lands on whichever thread allocates next: a frontend, a shard,
 * the lease reaper).
 *
 * The reference model is the set of attempts the router admitted, shared by the threads under
 * the model's own lock (never held across a router call).  Ends race on purpose: a thread picks
 * an attempt, marks that it is ending it, and calls finish or abort without taking it out of the
 * set, so two threads often end the same attempt at once.  What kvrouter.h promises, checked:
 *  - each call returns a documented code: route 0 / KVR_ENOMEM; output 0 / KVR_ENOMEM /
 *    KVR_EAGAIN; prefill_done 0 / KVR_EAGAIN; cached 0 / KVR_ENOMEM; set_capacity 0 / KVR_ENOMEM;
 *    finish and abort 0 / KVR_ESTALE, never KVR_ENOMEM;
 *  - KVR_ESTALE only for an attempt that some thread has started to end (the ranks are never
 *    removed, reset or given a new incarnation here, and the lease interval is never reached);
 *    with posted bookings (sync_booking off) also for one whose booking the shard dropped for
 *    memory (kvr_route's contract), which no end call then wins;
 *  - what each call leaves in its own thread's kvr_last_error(), as oom_api.c checks it;
 *  - every attempt is ended exactly once: of all the finish and abort calls made on it, exactly
 *    one returned 0 (at most one with posted bookings, where a dropped booking ended it);
 *  - once the threads are done and the failures stop: every rank's load is zero, the router
 *    still routes, and after destroy the allocation counter is back where it was.
 */
#include "oom_api_threads.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "fuzz_api.h"
#include "kvrouter.h"
#include "tests/common/fresh_thread.h"
#include "tests/common/splitmix.h"

#define T_RANKS 3
#define T_MAX   4096 /* attempts per seed (the model keeps every one until the end) */

static uint64_t t_seed;

#define TFAIL(...)                                                                                 \
	do {                                                                                       \
		fprintf(stderr, "oom_api --threads: seed %" PRIu64 ": ", t_seed);                  \
		fprintf(stderr, __VA_ARGS__);                                                      \
		fprintf(stderr, "\n");                                                             \
		abort();                                                                           \
	} while (0)
#define TCHECK(c, ...)                                                                             \
	do {                                                                                       \
		if (!(c))                                                                          \
			TFAIL(__VA_ARGS__);                                                        \
	} while (0)

/* Every int-returning call of the API goes through API(fn, args...): it returns fn(args...),
 * after checking what the call left in kvr_last_error() (fuzz_api.h, fuzz_err_verdict): a
 * KVR_ENOMEM carries its detail too, and each thread reads only its own. */
static int api_checked(const char *fn, int rc)
{
	const char *why = fuzz_err_verdict(fn, NULL, rc);
	TCHECK(!why, "kvr_last_error(): %s", why);
	return rc;
}
#define API(fn, ...) api_checked(#fn, (fuzz_err_arm(#fn, NULL), fn(__VA_ARGS__)))

struct tatt {
	uint64_t id;
	int enders; /* atomic: end calls started on it */
	int wins;   /* atomic: end calls that returned 0 */
	int stale;  /* atomic: calls that returned KVR_ESTALE */
};

struct shared {
	struct kvr_router *r;
	struct kvr_config cfg;
	pthread_mutex_t mu; /* the model's lock: att, n, live, n_live */
	struct tatt att[T_MAX];
	uint32_t n;
	uint32_t live[T_MAX]; /* indices of attempts nobody has started to end */
	uint32_t n_live;
	int ops;
};

struct worker {
	struct shared *s;
	uint64_t rng;
	uint32_t toks[512];
};

static uint32_t trnd(struct worker *w, uint32_t n)
{
	return (uint32_t)(splitmix64(&w->rng) % n);
}

/* Half the armed failures are persistent (kvr_alloc_fail_from: every allocation fails until a
 * thread disarms), so a clean-up that allocates after a failure fails too, as it does only rarely
 * when another thread re-arms in between: reserve_cursors' shrink back lost 32 bytes once in
 * ~16,000 seeds that way; persistent failures found it within 10 seeds. */
static void maybe_arm(struct worker *w)
{
	if (trnd(w, 3) == 0 && kvr_alloc_fail_pending() == 0) {
		uint64_t nth = 1 + trnd(w, 8);
		if (trnd(w, 2))
			kvr_alloc_fail_from(nth);
		else
			kvr_alloc_fail_after(nth);
	}
}

/* An attempt index: a live one most of the time, else any (ended ones too: their calls must
 * say KVR_ESTALE).  -1 when there is none. */
static int pick(struct worker *w, bool live_only)
{
	struct shared *s = w->s;
	pthread_mutex_lock(&s->mu);
	int k = -1;
	if (s->n_live && (live_only || trnd(w, 4)))
		k = (int)s->live[trnd(w, s->n_live)];
	else if (s->n && !live_only)
		k = (int)trnd(w, s->n);
	pthread_mutex_unlock(&s->mu);
	return k;
}

/* Whether a KVR_ESTALE on attempt a is allowed: someone started to end it, or (posted
 * bookings) its booking may have been dropped for memory. */
static bool stale_ok(const struct shared *s, struct tatt *a)
{
	return __atomic_load_n(&a->enders, __ATOMIC_SEQ_CST) > 0 || !s->cfg.sync_booking;
}

static void op_route(struct worker *w)
{
	struct shared *s = w->s;
	struct kvr_request q;
	kvr_request_init(&q);
	uint32_t fam = trnd(w, 4), n = 1 + trnd(w, 400), shared_len = trnd(w, n + 1);
	for (uint32_t i = 0; i < n; i++)
		w->toks[i] = i < shared_len ? fam * 100003u + i : (uint32_t)splitmix64(&w->rng);
	q.tokens = w->toks;
	q.n_tokens = n;
	q.expected_output_tokens = trnd(w, 64);
	struct kvr_decision d;
	int rc = API(kvr_route, s->r, &q, &d);
	TCHECK(rc == 0 || rc == KVR_ENOMEM, "route: %d", rc);
	if (rc)
		return;
	TCHECK(d.status == KVR_DECIDED && d.attempt, "status %d attempt %" PRIx64, d.status,
	       d.attempt);
	pthread_mutex_lock(&s->mu);
	if (s->n == T_MAX) { /* the model is full: this one is ended at once */
		pthread_mutex_unlock(&s->mu);
		rc = API(kvr_request_finish, s->r, d.attempt);
		TCHECK(rc == 0 || (rc == KVR_ESTALE && !s->cfg.sync_booking), "finish: %d", rc);
		return;
	}
	for (uint32_t i = 0; i < s->n; i++)
		TCHECK(s->att[i].id != d.attempt, "attempt %" PRIx64 " issued twice", d.attempt);
	s->att[s->n] = (struct tatt){.id = d.attempt};
	s->live[s->n_live++] = s->n++;
	pthread_mutex_unlock(&s->mu);
}

/* Finish or abort: marks the attempt as being ended (taking it off the live list if it is
 * still there), then calls without any lock, so another thread may be ending it too. */
static void op_end(struct worker *w)
{
	struct shared *s = w->s;
	int k = pick(w, trnd(w, 3) != 0);
	if (k < 0)
		return;
	pthread_mutex_lock(&s->mu);
	for (uint32_t i = 0; i < s->n_live; i++)
		if (s->live[i] == (uint32_t)k) {
			s->live[i] = s->live[--s->n_live];
			break;
		}
	struct tatt *a = &s->att[k];
	pthread_mutex_unlock(&s->mu);
	__atomic_add_fetch(&a->enders, 1, __ATOMIC_SEQ_CST);
	bool fin = trnd(w, 2);
	int rc = fin ? API(kvr_request_finish, s->r, a->id) : API(kvr_request_abort, s->r, a->id);
	TCHECK(rc == 0 || rc == KVR_ESTALE, "%s %" PRIx64 ": %d", fin ? "finish" : "abort", a->id,
	       rc);
	__atomic_add_fetch(rc == 0 ? &a->wins : &a->stale, 1, __ATOMIC_SEQ_CST);
}

static void op_progress(struct worker *w)
{
	struct shared *s = w->s;
	int k = pick(w, false);
	if (k < 0)
		return;
	struct tatt *a = &s->att[k];
	uint32_t what = trnd(w, 4);
	int rc;
	const char *call;
	if (what < 2) {
		uint32_t out[40];
		size_t n = 1 + trnd(w, 40);
		for (size_t i = 0; i < n; i++)
			out[i] = (uint32_t)(a->id * 31 + i);
		call = "output";
		rc = API(kvr_request_output_ex, s->r, a->id, out, n,
		         trnd(w, 2) ? KVR_OUTPUT_FINAL : 0);
		TCHECK(rc == 0 || rc == KVR_ENOMEM || rc == KVR_EAGAIN || rc == KVR_ESTALE,
		       "output: %d", rc);
	} else if (what < 3) {
		call = "prefill_done";
		rc = API(kvr_request_prefill_done, s->r, a->id);
		TCHECK(rc == 0 || rc == KVR_EAGAIN || rc == KVR_ESTALE, "prefill_done: %d", rc);
	} else {
		call = "cached";
		rc = API(kvr_request_cached, s->r, a->id, trnd(w, 2));
		TCHECK(rc == 0 || rc == KVR_ENOMEM || rc == KVR_ESTALE, "cached: %d", rc);
	}
	if (rc == KVR_ESTALE) {
		TCHECK(stale_ok(s, a), "%s %" PRIx64 ": KVR_ESTALE, and nobody ended it", call,
		       a->id);
		__atomic_add_fetch(&a->stale, 1, __ATOMIC_SEQ_CST);
	}
}

static void op_capacity(struct worker *w)
{
	static const uint64_t caps[] = {KVR_CAPACITY_NONE, 8, 64, 4096};
	struct kvr_rank_id id = {trnd(w, T_RANKS), 0};
	int rc = API(kvr_rank_set_capacity, w->s->r, id, 1, caps[trnd(w, 4)]);
	TCHECK(rc == 0 || rc == KVR_ENOMEM, "set_capacity: %d", rc);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	for (int i = 0; i < w->s->ops; i++) {
		maybe_arm(w);
		uint32_t op = trnd(w, 20);
		if (op < 7)
			op_route(w);
		else if (op < 12)
			op_end(w);
		else if (op < 19)
			op_progress(w);
		else
			op_capacity(w);
		if (trnd(w, 2))
			kvr_alloc_fail_after(0);
	}
	return NULL;
}

static uint64_t vclock(void *ctx)
{
	return __atomic_load_n((uint64_t *)ctx, __ATOMIC_RELAXED);
}

static void run_seed(uint64_t seed, int ops, int threads)
{
	struct shared *s = calloc(1, sizeof(*s));
	if (!s)
		abort();
	uint64_t rng = seed * 0x9e3779b97f4a7c15ull + 1, now = 1000;
	kvr_config_init(&s->cfg);
	s->cfg.mode = (enum kvr_mode)(splitmix64(&rng) % 2); /* approx_ttl, approx_lru */
	s->cfg.block_size = splitmix64(&rng) % 2 ? 4 : 16;
	s->cfg.n_shards = 1 + splitmix64(&rng) % 2;
	s->cfg.sync_booking = splitmix64(&rng) % 2;
	s->cfg.lease_scan_interval_ns = 1000ull * 1000000000ull;
	s->cfg.shard_idle_spin_ns = 0;
	s->cfg.seed = splitmix64(&rng);
	s->cfg.now_ns = vclock;
	s->cfg.clock_ctx = &now;
	s->ops = ops;
	pthread_mutex_init(&s->mu, NULL);
	TCHECK(API(kvr_router_create, &s->cfg, &s->r) == 0, "create");
	for (int i = 0; i < T_RANKS; i++)
		TCHECK(API(kvr_rank_add, s->r, (struct kvr_rank_id){(uint64_t)i, 0}, 1, 4096, 0) ==
		           0,
		       "rank_add");
	struct worker w[3];
	pthread_t th[3];
	for (int i = 0; i < threads; i++) {
		w[i] = (struct worker){.s = s, .rng = splitmix64(&rng)};
		if (pthread_create(&th[i], NULL, worker_main, &w[i]))
			abort();
	}
	for (int i = 0; i < threads; i++)
		pthread_join(th[i], NULL);
	kvr_alloc_fail_after(0);
	/* Every attempt nobody ended is ended now; then each was ended exactly once. */
	uint32_t dropped = 0;
	for (uint32_t i = 0; i < s->n; i++) {
		struct tatt *a = &s->att[i];
		if (a->enders == 0) {
			a->enders = 1;
			int rc = API(kvr_request_finish, s->r, a->id);
			TCHECK(rc == 0 || (rc == KVR_ESTALE && !s->cfg.sync_booking),
			       "finish at the end %" PRIx64 ": %d", a->id, rc);
			a->wins += rc == 0;
		}
		TCHECK(a->wins <= 1, "attempt %" PRIx64 " ended %d times", a->id, a->wins);
		TCHECK(a->wins == 1 || !s->cfg.sync_booking,
		       "attempt %" PRIx64 " never ended (%d end calls, all KVR_ESTALE)", a->id,
		       a->enders);
		dropped += a->wins == 0;
	}
	TCHECK(API(kvr_router_sync, s->r, 20000) == 0, "sync");
	for (int i = 0; i < T_RANKS; i++) {
		struct kvr_rank_stats st;
		TCHECK(API(kvr_rank_get_stats, s->r, (struct kvr_rank_id){(uint64_t)i, 0}, &st) ==
		           0,
		       "stats");
		TCHECK(st.active_requests == 0 && st.active_prefill_tokens == 0 &&
		           st.active_blocks == 0,
		       "idle rank %d: requests %" PRIu64 " prefill %" PRIu64 " blocks %" PRIu64, i,
		       st.active_requests, st.active_prefill_tokens, st.active_blocks);
	}
	struct kvr_request q;
	kvr_request_init(&q);
	uint32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
	q.tokens = t;
	q.n_tokens = 8;
	struct kvr_decision d;
	TCHECK(API(kvr_route, s->r, &q, &d) == 0, "route after the failures");
	TCHECK(API(kvr_request_finish, s->r, d.attempt) == 0, "finish after the failures");
	kvr_router_destroy(s->r);
	pthread_mutex_destroy(&s->mu);
	if (getenv("OOM_API_TRACE"))
		fprintf(stderr, "seed %" PRIu64 ": %u attempts, %u ended by a dropped booking\n",
		        seed, s->n, dropped);
	free(s);
}

struct seed_arg {
	uint64_t seed;
	int ops, threads;
};

static void *seed_main(void *arg)
{
	struct seed_arg *a = arg;
	run_seed(a->seed, a->ops, a->threads);
	return NULL;
}

/* Each seed runs on a thread of its own: the router's per-thread scratch (kept until a thread
 * exits) is given back before the allocation counter is compared. */
void oom_api_threads(uint64_t first, uint64_t seeds, int ops, int threads)
{
	if (threads < 2 || threads > 3) {
		fprintf(stderr, "oom_api: --threads takes 2 or 3\n");
		exit(2);
	}
	for (uint64_t s = first; s < first + seeds; s++) {
		t_seed = s;
		struct seed_arg a = {.seed = s, .ops = ops, .threads = threads};
		int64_t left = kvr_test_run_fresh_thread(seed_main, &a);
		TCHECK(left == 0, "leak: %" PRId64 " bytes", left);
	}
}
