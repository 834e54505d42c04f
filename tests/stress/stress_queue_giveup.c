/*
 * tests/stress/stress_queue_giveup.c - giving up on queued requests while leases expire, for
 * ThreadSanitizer: kvr_route_wait with short deadlines, kvr_route_cancel racing those waits from
 * another thread and racing the admission passes (the frontends', the admission thread's),
 * on_admit, idle attempts whose short leases expire, and a rank removed and added again.
 *
 * Three ranks on two shards; every request saturates its rank, so most queue.  Frontend threads
 * route, and give up on each queued ticket one way: cancel at once; wait with a short deadline,
 * then cancel; wait, then cancel 20 ms later (its outcome reclaimed meanwhile once its lease
 * expired, by the admission thread or a push, or taken by the cancel); hand it to the canceller
 * thread and wait for it meanwhile (the cancel and the wait race for one outcome); or leave it to
 * on_admit.  Attempts they get are finished or aborted by a
 * frontend later, or left to vanish (their leases expire within two 5 ms intervals).  An admin
 * thread removes and re-adds one rank (ending its attempts, failing the requests pinned to it).
 *
 * Checked at the end: no ticket has two outcomes (a cancel that returned 0 and a delivered
 * decision, two decisions); every ticket left to on_admit is told; every rank is idle (so every
 * attempt ended, and none twice: a double end would wrap its rank's counters); the queue is empty
 * and holds no uncollected outcome, within a bound (10 s against leases of 10 ms: a leak, not a
 * timing).  stress_torture's leases last 120 s and stress_queue_expire neither waits nor cancels:
 * neither reaches the reclaim of an outcome whose lease expired.  It found nothing in the review
 * of 34997ac (TSan, 12 runs).  Exit 0 pass, 1 fail.
 * argv[1]: duration in ms (default 1500); argv[2]: frontend threads (3).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "core/router_internal.h"

#define MAXT   (1u << 18)
#define NRANKS 3

enum { T_NONE, T_CANCELLED, T_DECIDED, T_DROPPED };

static struct kvr_router *R;
static uint64_t base_ticket;
static _Atomic uint8_t state[MAXT];    /* T_* per ticket */
static _Atomic uint8_t to_admit[MAXT]; /* left to on_admit */
static atomic_int stop, failed;
static atomic_uint_fast64_t n_queued, n_cancelled, n_decided, n_dropped, n_cb, n_raced;

#define FAIL(...)                                                                                  \
	do {                                                                                       \
		fprintf(stderr, "stress_queue_giveup: " __VA_ARGS__);                              \
		fputc('\n', stderr);                                                               \
		atomic_store(&failed, 1);                                                          \
	} while (0)

static void sleep_us(unsigned us)
{
	struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000L};
	nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------- attempts ended later */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t keep[1 << 14];
static size_t n_keep;

static void keep_or_vanish(uint64_t attempt, unsigned coin)
{
	if (coin % 3 == 0)
		return; /* vanishes: its lease expires */
	pthread_mutex_lock(&mu);
	if (n_keep < sizeof(keep) / sizeof(keep[0]))
		keep[n_keep++] = attempt;
	pthread_mutex_unlock(&mu);
}

static void end_one(unsigned *seed)
{
	uint64_t a = 0;
	pthread_mutex_lock(&mu);
	if (n_keep) {
		size_t i = (size_t)rand_r(seed) % n_keep;
		a = keep[i];
		keep[i] = keep[--n_keep];
	}
	pthread_mutex_unlock(&mu);
	if (!a)
		return;
	int rc = rand_r(seed) & 1 ? kvr_request_finish(R, a) : kvr_request_abort(R, a);
	if (rc && rc != KVR_ESTALE)
		FAIL("ending attempt %" PRIu64 ": %d (%s)", a, rc, kvr_last_error());
}

/* ---------------------------------------------------------------- ticket outcomes */

static uint64_t slot(uint64_t t)
{
	uint64_t i = t - base_ticket;
	if (i >= MAXT) {
		FAIL("ticket %" PRIu64 " out of range", t);
		return 0;
	}
	return i;
}

static void mark(uint64_t t, uint8_t st)
{
	uint8_t prev = atomic_exchange(&state[slot(t)], st);
	if (prev != T_NONE)
		FAIL("ticket %" PRIu64 ": outcome %d after outcome %d", t, st, prev);
}

static void decided(uint64_t t, const struct kvr_decision *d, int rc, unsigned coin)
{
	mark(t, T_DECIDED);
	atomic_fetch_add(&n_decided, 1);
	if (d->ticket != t)
		FAIL("ticket %" PRIu64 ": decision names ticket %" PRIu64, t, d->ticket);
	if (rc == 0 && d->status == KVR_DECIDED)
		keep_or_vanish(d->attempt, coin);
	else if (d->status != KVR_FAILED || d->error != rc)
		FAIL("ticket %" PRIu64 ": rc %d, status %d error %d", t, rc, d->status, d->error);
}

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	atomic_fetch_add(&n_cb, 1);
	if (d->status == KVR_FAILED && d->error == KVR_ESHUTDOWN)
		return; /* the destroy at the end */
	decided(ticket, d, d->status == KVR_FAILED ? d->error : 0, (unsigned)ticket);
}

/* A cancel of t, waited on before (so never told to on_admit), whose outcome nobody else may take:
 * 0, or KVR_ENOENT (dropped: its attempt ended before anyone collected it). */
static void cancel_given_up(uint64_t t)
{
	int rc = kvr_route_cancel(R, t);
	if (rc == 0) {
		mark(t, T_CANCELLED);
		atomic_fetch_add(&n_cancelled, 1);
	} else if (rc == KVR_ENOENT) {
		mark(t, T_DROPPED);
		atomic_fetch_add(&n_dropped, 1);
	} else {
		FAIL("cancel %" PRIu64 ": %d", t, rc);
	}
}

/* Waits for t until deadline; true when the wait took its outcome. */
static bool wait_for(uint64_t t, uint64_t deadline, unsigned coin, bool raced)
{
	struct kvr_decision d = {.status = KVR_QUEUED};
	int rc = kvr_route_wait(R, t, deadline, &d);
	if (rc == KVR_ETIMEDOUT)
		return false;
	if (rc == KVR_ENOENT && d.status == KVR_QUEUED) {
		/* Gone before this wait found it: on_admit has it (kvr_route returned the ticket
		 * with nobody waiting), or the canceller's cancel took it. */
		if (!raced)
			atomic_store(&to_admit[slot(t)], 1);
		return true;
	}
	if (rc == KVR_ESHUTDOWN || rc == KVR_EBUSY || rc == KVR_EINVAL)
		FAIL("wait %" PRIu64 ": %d", t, rc);
	decided(t, &d, rc, coin);
	return true;
}

/* ---------------------------------------------------------------- the canceller's tickets */

#define RACE 9
static _Atomic uint64_t race[RACE]; /* per frontend: the ticket it waits on, for the canceller */

static void *canceller(void *arg)
{
	unsigned seed = (unsigned)(uintptr_t)arg;
	while (!atomic_load(&stop)) {
		uint64_t t = atomic_exchange(&race[(unsigned)rand_r(&seed) % RACE], 0);
		if (!t) {
			sleep_us(50);
			continue;
		}
		int rc = kvr_route_cancel(R, t);
		if (rc == 0) {
			mark(t, T_CANCELLED);
			atomic_fetch_add(&n_cancelled, 1);
			atomic_fetch_add(&n_raced, 1);
		} else if (rc != KVR_ENOENT) { /* ENOENT: the wait took it, or it was dropped */
			FAIL("raced cancel %" PRIu64 ": %d", t, rc);
		}
	}
	return NULL;
}

/* ---------------------------------------------------------------- frontends, admin */

static void *frontend(void *arg)
{
	const unsigned me = (unsigned)(uintptr_t)arg;
	enum { LATE = 64 };
	struct late {
		uint64_t t, at;
	} late[LATE];
	size_t n_late = 0;
	unsigned seed = me * 7919u + 1;
	uint32_t tok[64];
	while (!atomic_load(&stop)) {
		for (int i = 0; i < 64; i++)
			tok[i] = (uint32_t)rand_r(&seed);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 64;
		struct kvr_rank_id pin = {(uint64_t)(rand_r(&seed) % NRANKS) + 1, 0};
		if (rand_r(&seed) % 3 == 0)
			q.pinned = &pin;
		struct kvr_decision d;
		int rc = kvr_route(R, &q, &d);
		if (rc == 0 && d.status == KVR_DECIDED) {
			keep_or_vanish(d.attempt, (unsigned)rand_r(&seed));
		} else if (rc == 0 && d.status == KVR_QUEUED) {
			uint64_t t = d.ticket;
			atomic_fetch_add(&n_queued, 1);
			uint64_t now = kvr_router_now(R);
			switch (rand_r(&seed) % 5) {
			case 0: /* never waited on: a cancel that finds it gone leaves it to
			           on_admit */
				if ((rc = kvr_route_cancel(R, t)) == 0) {
					mark(t, T_CANCELLED);
					atomic_fetch_add(&n_cancelled, 1);
				} else if (rc == KVR_ENOENT) {
					atomic_store(&to_admit[slot(t)], 1);
				} else {
					FAIL("cancel %" PRIu64 ": %d", t, rc);
				}
				break;
			case 1:
				if (!wait_for(t, now + (uint64_t)(rand_r(&seed) % 3000) * 1000,
				              (unsigned)rand_r(&seed), false))
					cancel_given_up(t);
				break;
			case 2: {
				/* The canceller may take it while this wait runs: one of the two
				 * gets the outcome, never both. */
				atomic_store(&race[me], t);
				bool took =
				    wait_for(t, now + 2000000, (unsigned)rand_r(&seed), true);
				uint64_t mine = t;
				if (atomic_compare_exchange_strong(&race[me], &mine, 0) && !took)
					cancel_given_up(t);
				break;
			}
			case 3: /* given up, cancelled long after: reclaimed meanwhile, or not */
				if (!wait_for(t, now + 500000, (unsigned)rand_r(&seed), false)) {
					if (n_late == LATE)
						cancel_given_up(late[--n_late].t);
					late[n_late++] = (struct late){t, now + 20000000};
				}
				break;
			default:
				atomic_store(&to_admit[slot(t)], 1);
				break;
			}
		} else if (rc && rc != KVR_EAGAIN && rc != KVR_ENOENT) {
			FAIL("kvr_route: %d (%s)", rc, kvr_last_error());
		}
		end_one(&seed);
		for (size_t i = 0; i < n_late;)
			if (kvr_router_now(R) >= late[i].at)
				cancel_given_up(late[i].t), late[i] = late[--n_late];
			else
				i++;
	}
	while (n_late)
		cancel_given_up(late[--n_late].t);
	return NULL;
}

static void *admin(void *arg)
{
	(void)arg;
	uint64_t inc = 2;
	while (!atomic_load(&stop)) {
		sleep_us(4000);
		struct kvr_rank_id id = {NRANKS, 0};
		if (kvr_rank_remove(R, id) == 0) {
			sleep_us(1000);
			if (kvr_rank_add(R, id, inc++, 100000, 16))
				FAIL("kvr_rank_add: %s", kvr_last_error());
		}
	}
	return NULL;
}

int main(int argc, char **argv)
{
	unsigned ms = argc > 1 ? (unsigned)atoi(argv[1]) : 1500;
	unsigned nf = argc > 2 ? (unsigned)atoi(argv[2]) : 3;
	if (nf < 1 || nf > 8)
		nf = 3;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit;
	c.lease_scan_interval_ns = 5000000; /* idle attempts expire after 5 to 10 ms */
	if (kvr_router_create(&c, &R)) {
		fprintf(stderr, "kvr_router_create: %s\n", kvr_last_error());
		return 1;
	}
	for (uint64_t w = 1; w <= NRANKS; w++)
		if (kvr_rank_add(R, (struct kvr_rank_id){w, 0}, 1, 100000, 16)) {
			fprintf(stderr, "kvr_rank_add: %s\n", kvr_last_error());
			return 1;
		}
	base_ticket = 1; /* one process-wide sequence, from 1 (core/queue.c) */
	pthread_t th[8], ca, ad;
	for (unsigned i = 0; i < nf; i++)
		pthread_create(&th[i], NULL, frontend, (void *)(uintptr_t)(i + 1));
	pthread_create(&ca, NULL, canceller, (void *)(uintptr_t)99);
	pthread_create(&ad, NULL, admin, NULL);
	sleep_us(ms * 1000u);
	atomic_store(&stop, 1);
	for (unsigned i = 0; i < nf; i++)
		pthread_join(th[i], NULL);
	pthread_join(ca, NULL);
	pthread_join(ad, NULL);
	unsigned seed = 7;
	/* Nothing calls the router now: the expiries admit what waits, and outcomes nobody
	 * collects go once their attempts ended. */
	size_t depth = 1, unc = 1;
	for (int i = 0; i < 10000 && (depth || unc); i++) {
		sleep_us(1000);
		pthread_mutex_lock(&mu);
		size_t left = n_keep;
		pthread_mutex_unlock(&mu);
		while (left--)
			end_one(&seed);
		depth = kvr_queue_depth(R);
		unc = kvr_queue_uncollected(R);
	}
	if (depth || unc)
		FAIL("after 10 s idle: %zu queued, %zu outcomes uncollected", depth, unc);
	for (uint64_t w = 1; w <= NRANKS; w++) {
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(R, (struct kvr_rank_id){w, 0}, &s))
			continue;
		for (int i = 0; i < 2000 && s.active_requests; i++) { /* leases still expiring */
			sleep_us(1000);
			kvr_rank_get_stats(R, (struct kvr_rank_id){w, 0}, &s);
		}
		if (s.active_requests || s.active_prefill_tokens || s.active_blocks)
			FAIL("rank %" PRIu64 " not idle: %" PRIu64 " requests, %" PRIu64
			     " prefill tokens, %" PRIu64 " blocks",
			     w, s.active_requests, s.active_prefill_tokens, s.active_blocks);
	}
	uint64_t told = 0, untold = 0;
	for (uint64_t i = 0; i < MAXT; i++)
		if (atomic_load(&to_admit[i])) {
			if (atomic_load(&state[i]) == T_DECIDED)
				told++;
			else if (untold++ < 5)
				FAIL("ticket %" PRIu64 " left to on_admit, state %d",
				     base_ticket + i, atomic_load(&state[i]));
		}
	kvr_router_destroy(R);
	printf("stress_queue_giveup: %" PRIu64 " queued: %" PRIu64 " cancelled (%" PRIu64
	       " racing a wait), %" PRIu64 " decided (%" PRIu64 " by on_admit), %" PRIu64
	       " dropped; %" PRIu64 " left to on_admit told, %" PRIu64 " not: %s\n",
	       atomic_load(&n_queued), atomic_load(&n_cancelled), atomic_load(&n_raced),
	       atomic_load(&n_decided), atomic_load(&n_cb), atomic_load(&n_dropped), told, untold,
	       atomic_load(&failed) ? "FAIL" : "ok");
	return atomic_load(&failed) ? 1 : 0;
}
