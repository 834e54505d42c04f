/*
 * tests/stress/stress_queue_expire.c - requests queued behind attempts that vanish, for
 * ThreadSanitizer: the router's admission thread (core/queue_thread.c) admits them when the
 * shards' lease reaper expires the vanished attempts, racing the frontends' own passes.
 *
 * Three small ranks on two shards; every request saturates its rank (64 prefill tokens against
 * a budget of 16), so most queue.  Frontend threads route (a third pinned to one rank), and of
 * the attempts they get, from kvr_route or on_admit, half vanish (never finished: their leases
 * expire within 2 lease intervals) and half are finished or aborted by a frontend later, each
 * such call running a pass of its own.  Then the frontends stop and nothing calls the router:
 * every queued ticket must be admitted through on_admit (by the admission thread, as the
 * expiries free the ranks), exactly once, within a bound (10 s against expiries of ~20 ms: a
 * hang, not a timing), and every rank's load must return to zero.  A second such round adds
 * expected_prefill_ns, whose decay steps (a shard timer) lower load as well.  A last round
 * destroys the router while expiries still wake the admission thread and requests still wait:
 * each ticket is answered exactly once (admitted, or KVR_ESHUTDOWN).  Before the admission thread,
 * the first check failed: the queued requests stayed queued on idle ranks.  Exit 0 pass, 1 fail.
 * argv[1]: duration in ms of each round (default 400); argv[2]: frontend threads (3).
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kvrouter.h"

#define MAXT   (1u << 18)
#define NRANKS 3

static struct kvr_router *R;
static uint64_t base_ticket;
static unsigned char res[MAXT]; /* on_admit calls per ticket (atomic) */
static unsigned char queued[MAXT];
static uint64_t n_queued, n_resolved, n_shut; /* atomic */
static unsigned long bad;                     /* atomic */
static int stop;                              /* atomic */

/* Attempts a frontend ends later (the other half vanish). */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t keep[1 << 16];
static size_t n_keep;

static uint64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

/* Half the attempts vanish; the rest a frontend finishes or aborts later. */
static void keep_or_vanish(uint64_t attempt, uint64_t coin)
{
	if (coin & 1)
		return; /* vanishes: its lease expires */
	pthread_mutex_lock(&mu);
	if (n_keep < (1 << 16))
		keep[n_keep++] = attempt;
	pthread_mutex_unlock(&mu);
}

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	uint64_t i = ticket - base_ticket;
	if (i >= MAXT || __atomic_add_fetch(&res[i], 1, __ATOMIC_RELAXED) != 1) {
		fprintf(stderr, "ticket %llu answered twice (or out of range)\n",
		        (unsigned long long)ticket);
		__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
		return;
	}
	if (d->status == KVR_DECIDED) {
		keep_or_vanish(d->attempt, ticket >> 1);
	} else if (d->error == KVR_ESHUTDOWN) {
		__atomic_add_fetch(&n_shut, 1, __ATOMIC_RELAXED);
	} else {
		fprintf(stderr, "ticket %llu failed: %s\n", (unsigned long long)ticket,
		        kvr_strerror(d->error));
		__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
	}
	__atomic_add_fetch(&n_resolved, 1, __ATOMIC_SEQ_CST);
}

static void *frontend(void *arg)
{
	unsigned seed = (unsigned)(uintptr_t)arg * 7919u + 1;
	uint32_t tok[64];
	while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
		/* Keep the queue short enough to drain by expiries at the end. */
		uint64_t waiting = __atomic_load_n(&n_queued, __ATOMIC_RELAXED) -
		                   __atomic_load_n(&n_resolved, __ATOMIC_RELAXED);
		if (waiting < 48) {
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
			if (rc == 0 && d.status == KVR_QUEUED) {
				uint64_t i = d.ticket - base_ticket;
				if (i < MAXT) {
					__atomic_store_n(&queued[i], 1, __ATOMIC_RELAXED);
					__atomic_add_fetch(&n_queued, 1, __ATOMIC_SEQ_CST);
				} else {
					__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
				}
			} else if (rc == 0) {
				keep_or_vanish(d.attempt, (uint64_t)rand_r(&seed));
			} else if (rc != KVR_EAGAIN) {
				fprintf(stderr, "kvr_route: %s\n", kvr_last_error());
				__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
			}
		}
		/* End one kept attempt (a pass of its own), or let time pass. */
		uint64_t a = 0;
		pthread_mutex_lock(&mu);
		if (n_keep) {
			size_t i = (size_t)rand_r(&seed) % n_keep;
			a = keep[i];
			keep[i] = keep[--n_keep];
		}
		pthread_mutex_unlock(&mu);
		if (a) {
			int rc =
			    rand_r(&seed) & 1 ? kvr_request_finish(R, a) : kvr_request_abort(R, a);
			(void)rc; /* KVR_ESTALE when its lease expired first */
		} else {
			sleep_ms(1);
		}
	}
	return NULL;
}

static int make_router(uint64_t expected_prefill_ns)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit;
	c.lease_scan_interval_ns = 10000000; /* idle attempts expire after 10 to 20 ms */
	c.expected_prefill_ns = expected_prefill_ns;
	if (kvr_router_create(&c, &R)) {
		fprintf(stderr, "kvr_router_create: %s\n", kvr_last_error());
		return 1;
	}
	for (uint64_t w = 1; w <= NRANKS; w++)
		if (kvr_rank_add(R, (struct kvr_rank_id){w, 0}, 1, 100000, 16)) {
			fprintf(stderr, "kvr_rank_add: %s\n", kvr_last_error());
			return 1;
		}
	return 0;
}

static void reset_counts(void)
{
	memset(res, 0, sizeof(res));
	memset(queued, 0, sizeof(queued));
	n_queued = n_resolved = n_shut = 0;
	n_keep = 0;
	stop = 0;
}

static void run_frontends(unsigned nthreads, unsigned ms)
{
	pthread_t th[16];
	for (unsigned i = 0; i < nthreads; i++)
		pthread_create(&th[i], NULL, frontend, (void *)(uintptr_t)(i + 1));
	sleep_ms(ms);
	__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	for (unsigned i = 0; i < nthreads; i++)
		pthread_join(th[i], NULL);
}

/* Every queued ticket answered exactly once, and nothing answered that was not queued. */
static int check_tickets(const char *round)
{
	int fail = 0;
	for (uint64_t i = 0; i < MAXT; i++) {
		unsigned q = __atomic_load_n(&queued[i], __ATOMIC_RELAXED);
		unsigned n = __atomic_load_n(&res[i], __ATOMIC_RELAXED);
		if (q != n) {
			if (fail++ < 5)
				fprintf(stderr, "%s: ticket %llu queued %u, answered %u times\n",
				        round, (unsigned long long)(base_ticket + i), q, n);
		}
	}
	return fail != 0;
}

/* The first ticket a request queued now would get, less one (tickets grow process-wide). */
static int learn_base(void)
{
	/* A one-rank router (no on_admit), saturated, queues one request and is destroyed: its
	 * ticket is the last issued; this round's come after it. */
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r) || kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 100000, 16))
		return 1;
	uint32_t tok[64];
	for (int i = 0; i < 64; i++)
		tok[i] = (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	struct kvr_decision d;
	int rc = kvr_route(r, &q, &d);
	tok[0] = 99;
	if (rc == 0)
		rc = kvr_route(r, &q, &d);
	kvr_router_destroy(r);
	if (rc || d.status != KVR_QUEUED)
		return 1;
	base_ticket = d.ticket + 1;
	return 0;
}

/* Frontends for ms, then no call on the router: every queued ticket is admitted by the
 * admission thread, once, and the load returns to zero.  Returns 1 on failure. */
static int drain_round(const char *round, unsigned nthreads, unsigned ms,
                       uint64_t expected_prefill_ns)
{
	int fail = 0;
	reset_counts();
	if (learn_base() || make_router(expected_prefill_ns))
		return 1;
	run_frontends(nthreads, ms);
	uint64_t t0 = mono_ms();
	while (__atomic_load_n(&n_resolved, __ATOMIC_SEQ_CST) <
	           __atomic_load_n(&n_queued, __ATOMIC_SEQ_CST) &&
	       mono_ms() - t0 < 10000)
		sleep_ms(2); /* no call on the router: only its own threads admit */
	uint64_t nq = __atomic_load_n(&n_queued, __ATOMIC_SEQ_CST);
	uint64_t nr = __atomic_load_n(&n_resolved, __ATOMIC_SEQ_CST);
	printf("%s: %llu queued, %llu admitted in %llu ms with no call on the router\n", round,
	       (unsigned long long)nq, (unsigned long long)nr,
	       (unsigned long long)(mono_ms() - t0));
	if (nr != nq) {
		fprintf(stderr, "%s: %llu of %llu queued requests never admitted\n", round,
		        (unsigned long long)(nq - nr), (unsigned long long)nq);
		fail = 1;
	}
	if (nq == 0) {
		fprintf(stderr, "%s: nothing queued: the test tested nothing\n", round);
		fail = 1;
	}
	fail |= check_tickets(round);
	/* Every admitted attempt vanishes or was ended: all load returns to zero. */
	t0 = mono_ms();
	uint64_t load;
	do {
		load = 0;
		for (uint64_t w = 1; w <= NRANKS; w++) {
			struct kvr_rank_stats s;
			if (kvr_rank_get_stats(R, (struct kvr_rank_id){w, 0}, &s) == 0)
				load += s.active_prefill_tokens + s.active_requests;
		}
		if (load)
			sleep_ms(2);
	} while (load && mono_ms() - t0 < 10000);
	if (load) {
		fprintf(stderr, "%s: load %llu left on the ranks\n", round,
		        (unsigned long long)load);
		fail = 1;
	}
	if (n_shut) {
		fprintf(stderr, "%s: %llu answered KVR_ESHUTDOWN before the destroy\n", round,
		        (unsigned long long)n_shut);
		fail = 1;
	}
	kvr_router_destroy(R);
	return fail;
}

int main(int argc, char **argv)
{
	unsigned ms = argc > 1 ? (unsigned)atoi(argv[1]) : 400;
	unsigned nthreads = argc > 2 ? (unsigned)atoi(argv[2]) : 3;
	if (nthreads < 1 || nthreads > 16)
		nthreads = 3;
	int fail = 0;

	/* Round 1: drained by lease expiries alone; round 2: by expiries and the prefill decay's
	 * steps (expected_prefill_ns). */
	fail |= drain_round("drain", nthreads, ms, 0);
	fail |= drain_round("drain_decay", nthreads, ms, 5000000);

	/* Round 3: destroyed while expiries wake the admission thread. */
	reset_counts();
	if (learn_base() || make_router(0))
		return 1;
	run_frontends(nthreads, ms);
	sleep_ms(15); /* some leases expire, some are still to */
	kvr_router_destroy(R);
	printf("destroy: %llu queued, %llu answered (%llu KVR_ESHUTDOWN)\n",
	       (unsigned long long)n_queued, (unsigned long long)n_resolved,
	       (unsigned long long)n_shut);
	if (n_resolved != n_queued)
		fail = 1;
	fail |= check_tickets("destroy");

	if (__atomic_load_n(&bad, __ATOMIC_RELAXED))
		fail = 1;
	printf("%s\n", fail ? "FAIL" : "ok");
	return fail;
}
