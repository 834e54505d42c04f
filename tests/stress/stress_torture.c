/*
 * tests/stress/stress_torture.c - the router under everything at once, for ThreadSanitizer.
 *
 * Two routing threads send prompts that share prefixes to a cluster that saturates, so the
 * admission queue fills; each queued ticket is cancelled at once, waited for with a short
 * deadline (then cancelled or collected later), or left to on_admit.  Two finisher threads take
 * every admitted attempt (from kvr_route, kvr_route_wait or on_admit) and end it from a thread
 * other than the one that routed it: prefill done, some output, the engine's cached tokens
 * (kvr_request_cached), then finish or abort.  An admin thread churns the ranks (remove and
 * re-add with another max_batched_tokens, capacity changes, resets, engine observations with
 * resident counts up to 2^64 - 1), and a sync thread calls kvr_router_sync from a fresh thread each
 * time (a thread the library has never seen).
 *
 * Checked at the end, after every thread is joined, every attempt ended and every ticket
 * resolved: each attempt ended at most once (a second finish/abort returning 0 is a failure),
 * no ticket was both cancelled and admitted, every queued ticket had exactly one outcome, and
 * every rank still present is idle (no request, no prefill token, no active block).
 * Exit 0 pass, 1 fail.  argv[1]: duration in ms (default 2000).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "tests/common/xorshift.h"

#define N_IDS       6
#define MAX_SEQ     (1u << 22) /* attempt sequence numbers tracked */
#define MAX_TICKETS (1u << 20)
#define RING        8192

static struct kvr_router *R;
static atomic_int stop;
static atomic_int failed;
static _Atomic uint8_t *attempt_ends; /* by attempt sequence: times ended by a 0 return */
static _Atomic uint8_t *ticket_state; /* 1 cancelled, 2 outcome delivered */
static atomic_uint_fast64_t n_routed, n_queued, n_cancelled, n_admitted_cb, n_waited, n_syncs,
    n_admin, n_ended, n_stale, n_wait_admitted, n_full, n_noent, n_dropped;

#define FAIL(...)                                                                                  \
	do {                                                                                       \
		fprintf(stderr, "stress_torture: " __VA_ARGS__);                                   \
		fputc('\n', stderr);                                                               \
		atomic_store(&failed, 1);                                                          \
	} while (0)

/* ---------------------------------------------------------------- attempts to finish */

static pthread_mutex_t ring_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t ring[RING];
static size_t ring_head, ring_len;

static void push_attempt(uint64_t a)
{
	pthread_mutex_lock(&ring_mu);
	if (ring_len < RING) {
		ring[(ring_head + ring_len++) % RING] = a;
		pthread_mutex_unlock(&ring_mu);
		return;
	}
	pthread_mutex_unlock(&ring_mu);
	/* full: end it here */
	int rc = kvr_request_finish(R, a);
	if (rc == 0)
		atomic_fetch_add(&attempt_ends[(a >> 16) % MAX_SEQ], 1);
	else if (rc != KVR_ESTALE)
		FAIL("finish: %d", rc);
}

static bool pop_attempt(uint64_t *a)
{
	pthread_mutex_lock(&ring_mu);
	bool ok = ring_len > 0;
	if (ok) {
		*a = ring[ring_head];
		ring_head = (ring_head + 1) % RING;
		ring_len--;
	}
	pthread_mutex_unlock(&ring_mu);
	return ok;
}

static void outcome(uint64_t ticket, const struct kvr_decision *d, int rc)
{
	if (ticket >= MAX_TICKETS)
		return;
	uint8_t prev = atomic_exchange(&ticket_state[ticket], 2);
	if (prev == 1)
		FAIL("ticket %" PRIu64 " cancelled and then admitted", ticket);
	if (prev == 2)
		FAIL("ticket %" PRIu64 " has two outcomes", ticket);
	if (rc == 0 && d->status == KVR_DECIDED)
		push_attempt(d->attempt);
	else if (d->status != KVR_FAILED || d->error != rc)
		FAIL("ticket %" PRIu64 " outcome rc %d status %d", ticket, rc, d->status);
}

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	atomic_fetch_add(&n_admitted_cb, 1);
	outcome(ticket, d, d->status == KVR_FAILED ? d->error : 0);
}

/* A ticket nobody waited on when the pump admitted it is collected by on_admit, which the pump
 * calls right after it unlinks the entry: a cancel or a wait in that window says KVR_ENOENT
 * (kvrouter.h: collected once, by kvr_route_wait or by on_admit), and on_admit must follow. */
static void await_on_admit(uint64_t t, const char *who)
{
	for (int i = 0; i < 20000 && atomic_load(&ticket_state[t]) != 2; i++) {
		struct timespec ts = {0, 100000};
		nanosleep(&ts, NULL);
	}
	if (atomic_load(&ticket_state[t]) != 2)
		FAIL("ticket %" PRIu64 ": %s said not queued, on_admit never told", t, who);
}

/* A ticket nobody waits on: cancelled now, or else on_admit delivers (or is delivering) it. */
static void cancel_now(uint64_t t)
{
	int rc = kvr_route_cancel(R, t);
	if (rc == 0) {
		if (atomic_exchange(&ticket_state[t], 1) != 0)
			FAIL("ticket %" PRIu64 " cancelled after an outcome", t);
		atomic_fetch_add(&n_cancelled, 1);
		return;
	}
	if (rc != KVR_ENOENT)
		FAIL("cancel: %d", rc);
	await_on_admit(t, "cancel");
}

/* Tickets whose wait timed out (so on_admit will not report them): cancelled or collected
 * later by their router thread. */
struct pending {
	uint64_t t[64];
	int n;
};

static void resolve(struct pending *p, int k, bool block)
{
	uint64_t t = p->t[k];
	/* Collected first now and then, as a caller that would take a late admission does; a
	 * cancel then takes what it finds (queued, or admitted with nobody told: it ends that
	 * attempt). */
	if (k % 2) {
		struct kvr_decision d = {.status = KVR_QUEUED};
		int wrc = kvr_route_wait(R, t, block ? 0 : kvr_router_now(R) + 1, &d);
		if (wrc != KVR_ETIMEDOUT && !(wrc == KVR_ENOENT && d.status == KVR_QUEUED)) {
			atomic_fetch_add(&n_waited, 1);
			outcome(t, &d, wrc);
			p->t[k] = p->t[--p->n];
			return;
		}
	}
	int rc = kvr_route_cancel(R, t);
	if (rc == 0) {
		if (atomic_exchange(&ticket_state[t], 1) != 0)
			FAIL("ticket %" PRIu64 " cancelled after an outcome", t);
		atomic_fetch_add(&n_cancelled, 1);
	} else if (rc == KVR_ENOENT) {
		/* Its outcome, nobody collecting it, was dropped: its attempt ended (a rank's
		 * removal or reset here), or it failed two lease intervals ago. */
		if (atomic_exchange(&ticket_state[t], 1) != 0)
			FAIL("ticket %" PRIu64 " dropped after an outcome", t);
		atomic_fetch_add(&n_dropped, 1);
	} else {
		FAIL("cancel: %d", rc);
	}
	p->t[k] = p->t[--p->n];
}

/* Keeps a timed-out ticket to resolve later; when the list is full the oldest goes first. */
static void pend_add(struct pending *p, uint64_t t)
{
	if (p->n == 64)
		resolve(p, 0, false);
	p->t[p->n++] = t;
}

/* ---------------------------------------------------------------- threads */

static void *router_thread(void *arg)
{
	uint64_t seed = (uintptr_t)arg * 0x9e3779b97f4a7c15ull + 1;
	uint32_t tok[1024];
	struct pending pend = {.n = 0};
	while (!atomic_load(&stop)) {
		size_t n = 16 + xorshift64(&seed) % 1000;
		uint32_t fam = (uint32_t)(xorshift64(&seed) % 8),
		         salt = (uint32_t)xorshift64(&seed);
		for (size_t i = 0; i < n; i++)
			tok[i] = i < n / 2 ? fam * 7919u + (uint32_t)i : salt + (uint32_t)i;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n;
		struct kvr_rank_id pin = {xorshift64(&seed) % (N_IDS / 2),
		                          (uint32_t)(xorshift64(&seed) % 2)};
		if (xorshift64(&seed) % 8 == 0)
			q.pinned = &pin;
		uint32_t how = (uint32_t)(xorshift64(&seed) % 4);
		if (how == 0) {
			q.flags = KVR_ROUTE_WAIT;
			q.deadline_ns = kvr_router_now(R) + 2000000;
		}
		struct kvr_decision d;
		int rc = kvr_route(R, &q, &d);
		atomic_fetch_add(&n_routed, 1);
		if (rc == 0 && d.status == KVR_DECIDED) {
			if (d.ticket) {
				/* queued, then admitted within the wait */
				atomic_fetch_add(&n_wait_admitted, 1);
				outcome(d.ticket, &d, 0);
			} else
				push_attempt(d.attempt);
		} else if (rc == 0 && d.status == KVR_QUEUED) {
			atomic_fetch_add(&n_queued, 1);
			if (how == 1) {
				cancel_now(d.ticket);
			} else if (how == 2) {
				/* d is written only when the wait collects the ticket: a KVR_ENOENT
				 * with d untouched is a ticket on_admit collected, one with status
				 * KVR_FAILED a failed admission (its ranks went away). */
				struct kvr_decision w = {.status = KVR_QUEUED};
				int wrc =
				    kvr_route_wait(R, d.ticket, kvr_router_now(R) + 1000000, &w);
				if (wrc == KVR_ETIMEDOUT)
					pend_add(&pend, d.ticket);
				else if (wrc == KVR_ENOENT && w.status == KVR_QUEUED)
					await_on_admit(d.ticket, "wait");
				else
					outcome(d.ticket, &w, wrc);
			}
			/* else: on_admit tells the outcome */
		} else if (rc == KVR_ETIMEDOUT) {
			atomic_fetch_add(&n_queued, 1);
			pend_add(&pend, d.ticket);
		} else if (rc == KVR_EAGAIN) {
			atomic_fetch_add(&n_full, 1);
		} else if (rc == KVR_ENOENT) {
			atomic_fetch_add(&n_noent, 1);
		} else if (rc != KVR_EINVAL) {
			FAIL("route: %d", rc);
		} else if (rc == KVR_EINVAL) {
			FAIL("route: a well-formed request got KVR_EINVAL");
		}
		if (pend.n && xorshift64(&seed) % 4 == 0)
			resolve(&pend, (int)(xorshift64(&seed) % (uint64_t)pend.n), false);
	}
	while (pend.n)
		resolve(&pend, 0, false);
	return NULL;
}

static void end_one(uint64_t a, uint64_t *seed)
{
	uint32_t out[40];
	for (int i = 0; i < 40; i++)
		out[i] = (uint32_t)xorshift64(seed);
	int rc = kvr_request_prefill_done(R, a);
	if (rc != 0 && rc != KVR_ESTALE)
		FAIL("prefill_done: %d", rc);
	rc = kvr_request_output(R, a, out, 1 + xorshift64(seed) % 40);
	if (rc != 0 && rc != KVR_ESTALE)
		FAIL("output: %d", rc);
	/* the engine's cached tokens (above a short prompt: KVR_EINVAL), while the admin thread
	 * resets and removes the rank and observes it */
	rc = kvr_request_cached(R, a, xorshift64(seed) % 96);
	if (rc != 0 && rc != KVR_ESTALE && rc != KVR_EINVAL)
		FAIL("cached: %d", rc);
	rc = xorshift64(seed) % 4 ? kvr_request_finish(R, a) : kvr_request_abort(R, a);
	if (rc == 0) {
		atomic_fetch_add(&attempt_ends[(a >> 16) % MAX_SEQ], 1);
		atomic_fetch_add(&n_ended, 1);
	} else if (rc == KVR_ESTALE) {
		atomic_fetch_add(&n_stale, 1);
	} else {
		FAIL("finish/abort: %d", rc);
	}
	/* a second end must be stale */
	rc = kvr_request_finish(R, a);
	if (rc != KVR_ESTALE)
		FAIL("second finish of %" PRIx64 ": %d", a, rc);
}

static void *finisher_thread(void *arg)
{
	uint64_t seed = (uintptr_t)arg * 0x2545f4914f6cdd1dull + 7;
	uint64_t a;
	for (;;) {
		if (pop_attempt(&a))
			end_one(a, &seed);
		else if (atomic_load(&stop))
			break; /* main ends what is left */
		else {
			struct timespec ts = {0, 100000};
			nanosleep(&ts, NULL);
		}
	}
	return NULL;
}

static void *admin_thread(void *arg)
{
	(void)arg;
	uint64_t seed = 99, inc[N_IDS] = {0};
	while (!atomic_load(&stop)) {
		int i = (int)(xorshift64(&seed) % N_IDS);
		struct kvr_rank_id id = {(uint64_t)(i / 2), (uint32_t)(i % 2)};
		int rc;
		switch (xorshift64(&seed) % 6) {
		case 0:
			rc = kvr_rank_remove(R, id);
			if (rc != 0 && rc != KVR_ENOENT)
				FAIL("remove: %d", rc);
			break;
		case 1:
		case 2:
			/* another budget each time: max_batched_tokens is rewritten on re-add */
			rc = kvr_rank_add(R, id, ++inc[i], 2000,
			                  1000 + (uint32_t)(xorshift64(&seed) % 3000));
			if (rc != 0 && rc != KVR_EEXIST && rc != KVR_ERANGE)
				FAIL("add: %d", rc);
			break;
		case 3:
			rc = kvr_rank_set_capacity(R, id, inc[i],
			                           xorshift64(&seed) % 2 ? 500 : 4000);
			if (rc != 0 && rc != KVR_ENOENT && rc != KVR_ESTALE)
				FAIL("set_capacity: %d", rc);
			break;
		case 4: {
			/* engine truth, absurd counts included (they must cost no memory) */
			static const uint64_t res[] = {0, 100, 3000, UINT64_MAX};
			struct kvr_rank_observation ob = {
			    .flags = KVR_OBSERVE_RESIDENT |
			             (xorshift64(&seed) % 2 ? KVR_OBSERVE_WATERMARK : 0),
			    .incarnation = inc[i] - xorshift64(&seed) % 2,
			    .resident_blocks = res[xorshift64(&seed) % 4],
			    .watermark_hash = xorshift64(&seed)};
			rc = kvr_rank_observe(R, id, &ob);
			if (rc != 0 && rc != KVR_ENOENT && rc != KVR_ESTALE)
				FAIL("observe: %d", rc);
			break;
		}
		default:
			rc = kvr_rank_reset(R, id, ++inc[i]);
			if (rc != 0 && rc != KVR_ENOENT && rc != KVR_ESTALE)
				FAIL("reset: %d", rc);
			break;
		}
		atomic_fetch_add(&n_admin, 1);
		struct timespec ts = {0, 5000000};
		nanosleep(&ts, NULL);
	}
	return NULL;
}

static void *fresh_sync(void *arg)
{
	(void)arg;
	int rc = kvr_router_sync(R, 5000); /* this thread's only library call */
	if (rc != 0 && rc != KVR_ETIMEDOUT)
		FAIL("sync from a fresh thread: %d", rc);
	atomic_fetch_add(&n_syncs, 1);
	return NULL;
}

static void *sync_thread(void *arg)
{
	(void)arg;
	while (!atomic_load(&stop)) {
		pthread_t t;
		if (pthread_create(&t, NULL, fresh_sync, NULL) == 0)
			pthread_join(t, NULL);
		struct timespec ts = {0, 5000000};
		nanosleep(&ts, NULL);
	}
	return NULL;
}

/* Phase 2: one slot reused over and over (max_ranks 1: every re-add waits for the removed
 * slot's grace period and takes it again, with another max_batched_tokens) while two threads
 * route with the queue on, so the saturation check reads the budget of a slot being re-added
 * (issue 12 defect 7: that read was plain, the store atomic). */
static struct kvr_router *R2;

static void *churn_one(void *arg)
{
	(void)arg;
	uint64_t inc = 0, seed = 3;
	struct kvr_rank_id id = {0, 0};
	while (!atomic_load(&stop)) {
		if (kvr_rank_remove(R2, id) != 0)
			FAIL("phase 2: remove");
		if (kvr_rank_add(R2, id, ++inc, 100, 1 + (uint32_t)(xorshift64(&seed) % 64)) != 0)
			FAIL("phase 2: re-add at max_ranks 1");
	}
	return NULL;
}

static void *route_one(void *arg)
{
	uint64_t seed = (uintptr_t)arg;
	uint32_t tok[64];
	while (!atomic_load(&stop)) {
		for (int i = 0; i < 64; i++)
			tok[i] = (uint32_t)xorshift64(&seed);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 64;
		struct kvr_decision d;
		int rc = kvr_route(R2, &q, &d);
		if (rc == 0 && d.status == KVR_DECIDED)
			kvr_request_finish(R2, d.attempt);
		else if (rc == 0)
			kvr_route_cancel(R2, d.ticket);
	}
	return NULL;
}

static void phase_slot_reuse(long ms)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.max_ranks = 1;
	c.queue_threshold = 0.5;
	c.shard_idle_spin_ns = 0;
	if (kvr_router_create(&c, &R2) != 0 ||
	    kvr_rank_add(R2, (struct kvr_rank_id){0, 0}, 0, 100, 32) != 0) {
		FAIL("phase 2: setup");
		return;
	}
	atomic_store(&stop, 0);
	pthread_t a, b, ch;
	pthread_create(&a, NULL, route_one, (void *)11);
	pthread_create(&b, NULL, route_one, (void *)12);
	pthread_create(&ch, NULL, churn_one, NULL);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
	atomic_store(&stop, 1);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	pthread_join(ch, NULL);
	kvr_router_destroy(R2);
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 2000;
	attempt_ends = calloc(MAX_SEQ, 1);
	ticket_state = calloc(MAX_TICKETS, 1);
	if (!attempt_ends || !ticket_state)
		return 1;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.queue_capacity = 64;
	c.on_admit = on_admit;
	c.shard_idle_spin_ns = 0;
	if (kvr_router_create(&c, &R) != 0)
		return 1;
	for (int i = 0; i < 4; i++)
		kvr_rank_add(R, (struct kvr_rank_id){(uint64_t)(i / 2), (uint32_t)(i % 2)}, 0, 2000,
		             2000);
	pthread_t rt[2], ft[2], at, st;
	for (uintptr_t i = 0; i < 2; i++) {
		pthread_create(&rt[i], NULL, router_thread, (void *)(i + 1));
		pthread_create(&ft[i], NULL, finisher_thread, (void *)(i + 1));
	}
	pthread_create(&at, NULL, admin_thread, NULL);
	pthread_create(&st, NULL, sync_thread, NULL);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
	atomic_store(&stop, 1);
	pthread_join(at, NULL);
	pthread_join(st, NULL);
	for (int i = 0; i < 2; i++)
		pthread_join(rt[i], NULL);
	for (int i = 0; i < 2; i++)
		pthread_join(ft[i], NULL);
	/* Queued requests left to on_admit: end attempts until the queue has admitted them all
	 * (on_admit runs on this thread now, inside the pumps these calls trigger). */
	for (int round = 0; round < 200; round++) {
		uint64_t a, seed = 5;
		bool any = false;
		while (pop_attempt(&a)) {
			end_one(a, &seed);
			any = true;
		}
		kvr_router_sync(R, 5000);
		if (!any && round > 2)
			break;
	}
	for (uint32_t s = 0; s < MAX_SEQ; s++)
		if (atomic_load(&attempt_ends[s]) > 1)
			FAIL("attempt sequence %u ended %u times", s,
			     atomic_load(&attempt_ends[s]));
	/* Every ticket handed out has one resolution: cancelled, or an outcome (failed admissions
	 * included). */
	uint64_t resolved = 0;
	for (uint32_t t = 1; t < MAX_TICKETS; t++)
		resolved += atomic_load(&ticket_state[t]) != 0;
	uint64_t issued = atomic_load(&n_queued) + atomic_load(&n_wait_admitted);
	if (resolved != issued)
		FAIL("%" PRIu64 " tickets issued, %" PRIu64 " resolved", issued, resolved);
	for (int i = 0; i < N_IDS; i++) {
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(
		        R, (struct kvr_rank_id){(uint64_t)(i / 2), (uint32_t)(i % 2)}, &s) != 0)
			continue;
		if (s.active_requests || s.active_prefill_tokens || s.active_blocks)
			FAIL("idle rank %d: requests %" PRIu64 " prefill %" PRIu64
			     " blocks %" PRIu64,
			     i, s.active_requests, s.active_prefill_tokens, s.active_blocks);
	}
	static char buf[1 << 17];
	size_t len;
	kvr_metrics_render(R, buf, sizeof(buf), &len);
	const char *qd = strstr(buf, "\nkvr_queue_depth ");
	if (qd && strtoull(qd + 17, NULL, 10) != 0)
		FAIL("queue not empty at the end: %s", qd + 1);
	const char *qu = strstr(buf, "\nkvr_queue_uncollected ");
	if (!qu || strtoull(qu + 23, NULL, 10) != 0)
		FAIL("outcomes left uncollected at the end: %s", qu ? qu + 1 : "(no gauge)");
	kvr_router_destroy(R);
	printf("stress_torture: %" PRIu64 " routes (%" PRIu64 " queue full, %" PRIu64
	       " no rank), %" PRIu64 " queued (%" PRIu64 " cancelled, %" PRIu64
	       " by on_admit, %" PRIu64 " collected, %" PRIu64 " dropped), %" PRIu64
	       " resolved tickets, %" PRIu64 " ended, %" PRIu64 " stale, %" PRIu64
	       " admin ops, %" PRIu64 " syncs from fresh threads: %s\n",
	       atomic_load(&n_routed), atomic_load(&n_full), atomic_load(&n_noent),
	       atomic_load(&n_queued), atomic_load(&n_cancelled), atomic_load(&n_admitted_cb),
	       atomic_load(&n_waited), atomic_load(&n_dropped), issued, atomic_load(&n_ended),
	       atomic_load(&n_stale), atomic_load(&n_admin), atomic_load(&n_syncs),
	       atomic_load(&failed) ? "FAIL" : "ok");
	phase_slot_reuse(ms / 2);
	free(attempt_ends);
	free(ticket_state);
	return atomic_load(&failed) ? 1 : 0;
}
