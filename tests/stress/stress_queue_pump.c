/*
 * tests/stress/stress_queue_pump.c - the admission queue's pass against everything that races it,
 * for ThreadSanitizer: routes (pinned to one of three small ranks or not, a quarter with
 * KVR_ROUTE_WAIT and a short deadline, so some queue behind an admissible waiter while another
 * thread pumps), prefill_done and finish (each runs a pass), kvr_route_cancel and kvr_route_wait,
 * with on_admit answering the rest.  Every queued ticket must be resolved exactly once: by
 * on_admit, by a wait's collection (or its failed admission) or by a cancel that returned 0;
 * none twice, none left once everything is finished and every waited ticket collected (a lost
 * wake-up or an entry lost while the pass dropped its lock).  Exit 0 pass, 1 fail.  argv[1]:
 * duration in ms (default 500); argv[2]: threads (4); argv[3]: queue policy (0 FCFS, 1 WSPT;
 * both run when absent).
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kvrouter.h"

#define MAXT (1u << 20)
static struct kvr_router *R;
/* Resolutions per ticket: atomic, as on_admit runs on the admission thread meanwhile. */
static unsigned char res[MAXT];
static unsigned char queued[MAXT];
static volatile int stop;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t att[1 << 16];
static size_t n_att;
static uint64_t pend[1 << 16];
static size_t n_pend;
static unsigned long bad;
static uint64_t base_ticket;

static void push(uint64_t *a, size_t *n, uint64_t v)
{
	pthread_mutex_lock(&mu);
	if (*n < (1 << 16))
		a[(*n)++] = v;
	pthread_mutex_unlock(&mu);
}
static int pop(uint64_t *a, size_t *n, unsigned *seed, uint64_t *v)
{
	pthread_mutex_lock(&mu);
	int ok = *n > 0;
	if (ok) {
		size_t i = rand_r(seed) % *n;
		*v = a[i];
		a[i] = a[--(*n)];
	}
	pthread_mutex_unlock(&mu);
	return ok;
}
/* The count of a, under the lock: the admission thread's on_admit still pushes attempts
 * while the drain below reads it (every finish is applied on its shard later, whose hook wakes
 * that thread: core/queue_thread.c). */
static size_t count(const size_t *n)
{
	pthread_mutex_lock(&mu);
	size_t v = *n;
	pthread_mutex_unlock(&mu);
	return v;
}
static void resolve(uint64_t t)
{
	if (t - base_ticket >= MAXT) {
		__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
		return;
	}
	if (__atomic_add_fetch(&res[t - base_ticket], 1, __ATOMIC_RELAXED) != 1) {
		fprintf(stderr, "ticket %lu resolved twice\n", (unsigned long)t);
		__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
	}
}
static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	resolve(ticket);
	if (d->status == KVR_DECIDED)
		push(att, &n_att, d->attempt);
}
static void finish_one(unsigned *seed)
{
	uint64_t a;
	if (pop(att, &n_att, seed, &a)) {
		kvr_request_prefill_done(R, a);
		kvr_request_finish(R, a);
	}
}
static void *worker(void *arg)
{
	unsigned seed = (unsigned)(uintptr_t)arg * 7919u + 1;
	uint32_t t[600];
	struct kvr_rank_id ids[3] = {{0, 0}, {1, 0}, {2, 0}};
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
		int op = rand_r(&seed) % 8;
		if (op < 4) {
			size_t n = 300 + rand_r(&seed) % 300;
			uint32_t s = rand_r(&seed);
			for (size_t i = 0; i < n; i++)
				t[i] = s + (uint32_t)i;
			struct kvr_request q;
			kvr_request_init(&q);
			q.tokens = t;
			q.n_tokens = n;
			int pin = rand_r(&seed) % 4;
			if (pin < 3)
				q.pinned = &ids[pin];
			bool wait = rand_r(&seed) % 4 == 0;
			if (wait) {
				q.flags = KVR_ROUTE_WAIT;
				q.deadline_ns = kvr_router_now(R) + 2000000;
			}
			struct kvr_decision d;
			int rc = kvr_route(R, &q, &d);
			if (rc == 0 && d.status == KVR_DECIDED) {
				if (d.ticket) { /* queued behind, admitted at once */
					if (d.ticket - base_ticket < MAXT)
						queued[d.ticket - base_ticket] = 1;
					resolve(d.ticket);
				}
				push(att, &n_att, d.attempt);
			} else if (rc == 0 && d.status == KVR_QUEUED) {
				queued[d.ticket - base_ticket] = 1;
				push(pend, &n_pend, d.ticket | (wait ? 1ull << 63 : 0));
			} else if (rc == KVR_ETIMEDOUT) {
				queued[d.ticket - base_ticket] = 1;
				push(pend, &n_pend, d.ticket | 1ull << 63);
			} else if (rc != KVR_EAGAIN) {
				fprintf(stderr, "route rc %d\n", rc);
				__atomic_add_fetch(&bad, 1, __ATOMIC_RELAXED);
			}
		} else if (op < 7) {
			finish_one(&seed);
		} else {
			uint64_t p;
			if (!pop(pend, &n_pend, &seed, &p))
				continue;
			uint64_t tk = p & ~(1ull << 63);
			if (rand_r(&seed) % 2) {
				if (kvr_route_cancel(R, tk) == 0)
					resolve(tk);
				else if (p >> 63)
					push(pend, &n_pend, p); /* waited: admitted, collect */
			} else {
				struct kvr_decision d;
				int rc = kvr_route_wait(R, tk, kvr_router_now(R) + 1000000, &d);
				if (rc == 0) {
					resolve(tk);
					push(att, &n_att, d.attempt);
				} else if (rc == KVR_ETIMEDOUT)
					push(pend, &n_pend, p | 1ull << 63);
				else if (rc != KVR_ENOENT) {
					resolve(tk);
				}
				/* ENOENT: on_admit collected it (not waited before) */
			}
		}
	}
	return NULL;
}
static int run(int ms, int nthr, enum kvr_queue_policy pol)
{
	memset(res, 0, sizeof(res));
	memset(queued, 0, sizeof(queued));
	n_att = n_pend = 0;
	bad = 0;
	stop = 0;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.queue_capacity = 64;
	c.on_admit = on_admit;
	c.queue_policy = pol;
	if (kvr_router_create(&c, &R))
		return 1;
	for (uint64_t w = 0; w < 3; w++)
		if (kvr_rank_add(R, (struct kvr_rank_id){w, 0}, 1, 100000, 1000))
			return 1;
	/* The first ticket of this run: one queued behind a hog, cancelled. */
	static uint32_t h[3000];
	for (int i = 0; i < 3000; i++)
		h[i] = 9000000 + i;
	struct kvr_rank_id id = {0, 0};
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = h;
	q.n_tokens = 3000;
	q.pinned = &id;
	struct kvr_decision d, d2;
	if (kvr_route(R, &q, &d) || d.status != KVR_DECIDED)
		return 1;
	q.n_tokens = 10;
	if (kvr_route(R, &q, &d2) || d2.status != KVR_QUEUED)
		return 1;
	base_ticket = d2.ticket;
	kvr_route_cancel(R, d2.ticket);
	kvr_request_finish(R, d.attempt);
	pthread_t th[16];
	for (long i = 0; i < nthr; i++)
		pthread_create(&th[i], NULL, worker, (void *)i);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
	for (int i = 0; i < nthr; i++)
		pthread_join(th[i], NULL);
	/* Drain: finish everything, collect every waited ticket, until nothing is left. */
	unsigned seed = 1;
	for (int round = 0; round < 5000; round++) {
		uint64_t a, p;
		while (pop(att, &n_att, &seed, &a)) {
			kvr_request_prefill_done(R, a);
			kvr_request_finish(R, a);
		}
		kvr_router_sync(R, 1000);
		size_t n = count(&n_pend);
		for (size_t k = 0; k < n && pop(pend, &n_pend, &seed, &p); k++) {
			uint64_t tk = p & ~(1ull << 63);
			if (!(p >> 63))
				continue; /* on_admit's */
			int rc = kvr_route_wait(R, tk, kvr_router_now(R) + 1000000, &d);
			if (rc == 0) {
				resolve(tk);
				push(att, &n_att, d.attempt);
			} else if (rc == KVR_ETIMEDOUT) {
				push(pend, &n_pend, p);
			} else if (rc != KVR_ENOENT) {
				resolve(tk);
			}
		}
		if (!count(&n_att) && !count(&n_pend)) {
			size_t left = 0;
			for (uint64_t t = 0; t < MAXT; t++)
				left += queued[t] && !__atomic_load_n(&res[t], __ATOMIC_RELAXED);
			if (!left)
				break;
		}
		struct timespec s = {0, 1000000};
		nanosleep(&s, NULL);
	}
	unsigned long nq = 0, lost = 0;
	for (uint64_t t = 0; t < MAXT; t++) {
		if (!queued[t])
			continue;
		nq++;
		if (!__atomic_load_n(&res[t], __ATOMIC_RELAXED) && ++lost < 5)
			fprintf(stderr, "stress_queue_pump: ticket %lu never resolved\n",
			        (unsigned long)(t + base_ticket));
	}
	kvr_router_destroy(R);
	printf("stress_queue_pump: %s, %d threads: %lu queued, %lu unresolved, %lu faults\n",
	       pol == KVR_QUEUE_WSPT ? "WSPT" : "FCFS", nthr, nq, lost, bad);
	return lost || bad;
}

int main(int argc, char **argv)
{
	int ms = argc > 1 ? atoi(argv[1]) : 500, nthr = argc > 2 ? atoi(argv[2]) : 4;
	if (nthr < 1 || nthr > 16)
		nthr = 4;
	if (argc > 3)
		return run(ms, nthr, (enum kvr_queue_policy)atoi(argv[3]));
	return run(ms, nthr, KVR_QUEUE_FCFS) || run(ms, nthr, KVR_QUEUE_WSPT);
}
