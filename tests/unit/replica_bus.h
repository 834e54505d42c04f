/*
 * tests/unit/replica_bus.h - what the replica sync unit tests share: routers made alike, and the
 * replica core (sync/replica*.c) over an in-process bus, no server: a publish is delivered to
 * every other replica at once (kvr_replica_deliver), snapshot requests are answered through
 * per-replica inboxes.  Context: Criterion tests, one at a time (the bus is a static).
 */
#ifndef KVR_TESTS_UNIT_REPLICA_BUS_H
#define KVR_TESTS_UNIT_REPLICA_BUS_H

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "sync/replica.h"

static inline struct kvr_router *make(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	return r;
}

/* Routes a prompt of n tokens (64 expected output tokens) on r; returns the decision. */
static inline struct kvr_decision route(struct kvr_router *r, const uint32_t *t, size_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.expected_output_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	return d;
}

static inline int cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static inline void same_blocks(struct kvr_router *a, struct kvr_router *b, struct kvr_rank_id rk)
{
	static uint64_t x[1 << 16], y[1 << 16];
	size_t nx, ny;
	cr_assert_eq(kvr_rank_blocks(a, rk, x, 1 << 16, &nx), 0);
	cr_assert_eq(kvr_rank_blocks(b, rk, y, 1 << 16, &ny), 0);
	cr_assert_eq(nx, ny, "rank %lu: %zu vs %zu blocks", (unsigned long)rk.worker_id, nx, ny);
	qsort(x, nx, 8, cmp);
	qsort(y, ny, 8, cmp);
	cr_assert_eq(memcmp(x, y, nx * 8), 0);
}

#define BUS_N 3

struct bus_chunk {
	struct bus_chunk *next;
	size_t len;
	uint8_t data[];
};

static struct bus {
	struct kvr_replica *rep[BUS_N];
	bool ready[BUS_N];
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct bus_chunk *inbox[BUS_N]; /* snapshot chunks for replica i, newest first */
	unsigned asking[BUS_N];         /* replica i's snapshot request waiting, 0 if none */
	unsigned asked;                 /* snapshot requests so far */
} bus = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static int port[BUS_N] = {0, 1, 2};
/* kept_bytes_max of the replicas bus_router makes (0: the default). */
static uint64_t bus_kept_max;
/* tombstone_ms of the replicas bus_router makes (0: the default). */
static uint64_t bus_tombstone_ms;
/* dead_after of the replicas bus_router makes (0: 1000, nobody given up for silence during a
 * test unless the test judges its peers itself). */
static uint32_t bus_dead_after;
/* snapshot_timeout_ms of the replicas bus_router makes (0: 5000). */
static uint32_t bus_snapshot_ms;
/* Replica i's publishes fail (KVR_EAGAIN: a transport that refuses) while bus_down[i]. */
static bool bus_down[BUS_N];
/* Replica i's publishes are taken and lost (a connection that died unnoticed) while
 * bus_lose[i]. */
static bool bus_lose[BUS_N];
/* Nothing published reaches replica j (cut off, or its stream far behind) while bus_deaf[j];
 * snapshot requests and replies still go. */
static bool bus_deaf[BUS_N];
/* While bus_spread, replica i's snapshot requests go to the ready peers in turn (the last ready
 * one first, then the one before it, ...), as a NATS queue group spreads them among its
 * members; else always to the last ready one.  bus_turn[i]: replica i's requests so far. */
static bool bus_spread;
static unsigned bus_turn[BUS_N];
/* A snapshot request's copy picked for replica j reaches it bus_slow_ms[j] after it was sent
 * (a peer slow to answer, every time), if the asker still waits then. */
static unsigned bus_slow_ms[BUS_N];
/* Replica i's snapshot requests reach nobody while bus_unheard[i] (its resync waits out its
 * snapshot_timeout_ms, serving the others' requests meanwhile as a resyncing replica does). */
static bool bus_unheard[BUS_N];
/* Replica j's bus_reply_fail[j]-th reply from now fails (KVR_EAGAIN: a transport that refuses
 * it), once; 0: none. */
static unsigned bus_reply_fail[BUS_N];

static inline int bus_publish(void *ctx, const void *buf, size_t len)
{
	int i = *(int *)ctx;
	if (__atomic_load_n(&bus_down[i], __ATOMIC_ACQUIRE))
		return KVR_EAGAIN;
	if (__atomic_load_n(&bus_lose[i], __ATOMIC_ACQUIRE))
		return 0;
	for (int j = 0; j < BUS_N; j++) {
		/* atomic: a test may create a replica while the others publish (bus_create_as) */
		struct kvr_replica *to = __atomic_load_n(&bus.rep[j], __ATOMIC_ACQUIRE);
		if (j != i && to && !__atomic_load_n(&bus_deaf[j], __ATOMIC_ACQUIRE))
			kvr_replica_deliver(to, buf, len, NULL);
	}
	return 0;
}

static inline int bus_reply(void *ctx, const char *to, const void *buf, size_t len)
{
	int from = *(int *)ctx;
	if (__atomic_load_n(&bus_reply_fail[from], __ATOMIC_ACQUIRE) &&
	    __atomic_sub_fetch(&bus_reply_fail[from], 1, __ATOMIC_ACQ_REL) == 0)
		return KVR_EAGAIN;
	int j = to[0] - '0';
	struct bus_chunk *c = malloc(sizeof(*c) + len);
	cr_assert(c && j >= 0 && j < BUS_N);
	c->len = len;
	memcpy(c->data, buf, len);
	pthread_mutex_lock(&bus.mu);
	/* "<i>.<n>" is bus_request's n-th request's own inbox, gone once it returned (as a NATS
	 * request's inbox is); a bare "<i>" (a test's own delivery) always takes the chunk. */
	if (to[1] == '.' && strtoul(to + 2, NULL, 10) != bus.asking[j]) {
		pthread_mutex_unlock(&bus.mu);
		free(c);
		return 0;
	}
	c->next = bus.inbox[j];
	bus.inbox[j] = c;
	pthread_cond_broadcast(&bus.cv);
	pthread_mutex_unlock(&bus.mu);
	return 0;
}

/* The oldest chunk for replica i, waiting up to 10 ms; NULL if none. */
static inline struct bus_chunk *bus_take(int i)
{
	pthread_mutex_lock(&bus.mu);
	if (!bus.inbox[i]) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += 10000000;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		pthread_cond_timedwait(&bus.cv, &bus.mu, &ts);
	}
	struct bus_chunk **pp = &bus.inbox[i], *c = NULL;
	while (*pp && (*pp)->next)
		pp = &(*pp)->next;
	c = *pp;
	*pp = NULL;
	pthread_mutex_unlock(&bus.mu);
	return c;
}

/* The ready peer replica i's next snapshot request goes to, -1 if none. */
static inline int bus_pick(int i)
{
	int peer = -1, ready[BUS_N], n = 0;
	pthread_mutex_lock(&bus.mu);
	for (int j = BUS_N - 1; j >= 0; j--) /* the last ready one: a replica serving its mirrors */
		if (j != i && bus.rep[j] && bus.ready[j])
			ready[n++] = j;
	if (n)
		peer = ready[bus_spread ? bus_turn[i]++ % (unsigned)n : 0];
	pthread_mutex_unlock(&bus.mu);
	return peer;
}

/* Replica i's inbox emptied; what comes to it later for request n is dropped (n = 0: all). */
static inline void bus_asking(int i, unsigned n)
{
	pthread_mutex_lock(&bus.mu);
	bus.asking[i] = n;
	for (struct bus_chunk *c; (c = bus.inbox[i]);) {
		bus.inbox[i] = c->next;
		free(c);
	}
	pthread_mutex_unlock(&bus.mu);
}

static inline int bus_request(void *ctx, const void *req, size_t len, uint64_t timeout_ns,
                              uint64_t hedge_ns,
                              int (*on_chunk)(void *cb, const void *buf, size_t len),
                              bool (*poll)(void *cb), void *cb)
{
	int i = *(int *)ctx, peer = bus_pick(i), rc = KVR_ETIMEDOUT;
	if (peer < 0)
		return KVR_ENOENT;
	unsigned n = __atomic_add_fetch(&bus.asked, 1, __ATOMIC_RELAXED);
	char inbox[16];
	snprintf(inbox, sizeof(inbox), "%d.%u", i, n);
	bus_asking(i, n);
	/* Copies sent, declined, and each one's peer and when it reaches it (ns of the wait). */
	enum { COPIES = 64 };
	int to[COPIES];
	uint64_t due[COPIES];
	bool delivered[COPIES] = {false};
	unsigned sent = 0, declined = 0;
	const bool unheard = __atomic_load_n(&bus_unheard[i], __ATOMIC_ACQUIRE);
	to[sent] = peer;
	due[sent++] = (uint64_t)bus_slow_ms[peer] * 1000000;
	bool taken = false;
	for (uint64_t waited = 0, hedged = 0; waited < timeout_ns; waited += 10000000) {
		for (unsigned k = 0; k < sent; k++)
			if (!delivered[k] && due[k] <= waited) {
				delivered[k] = true;
				if (!unheard)
					kvr_replica_deliver(bus.rep[to[k]], req, len, inbox);
			}
		struct bus_chunk *c = bus_take(i);
		if (!c) {
			if (poll(cb)) {
				rc = KVR_ESHUTDOWN;
				break;
			}
			/* As a NATS queue group would, the request sent again may reach another. */
			if (!taken && hedge_ns && waited - hedged >= hedge_ns && sent < COPIES &&
			    (peer = bus_pick(i)) >= 0) {
				to[sent] = peer;
				due[sent++] = waited + (uint64_t)bus_slow_ms[peer] * 1000000;
				hedged = waited;
			}
			continue;
		}
		int r = on_chunk(cb, c->data, c->len);
		free(c);
		if (r == KVR_REP_CHUNK_IGNORED)
			continue;
		if (r == KVR_REP_CHUNK_DECLINED) {
			if (++declined < sent)
				continue;
			rc = KVR_EAGAIN;
			break;
		}
		if (r != KVR_REP_CHUNK_MORE) {
			rc = r == KVR_REP_CHUNK_LAST ? 0 : r;
			break;
		}
		taken = true;
	}
	bus_asking(i, 0);
	return rc;
}

static inline void bus_ready(void *ctx)
{
	pthread_mutex_lock(&bus.mu);
	bus.ready[*(int *)ctx] = true;
	pthread_mutex_unlock(&bus.mu);
}

/* Creates replica `id` on port i (bus.rep[i]) for router r, not started (its epoch, the wall
 * clock, is read here). */
static inline void bus_create_as(int i, struct kvr_router *r, uint64_t id)
{
	struct kvr_replica_config c = {
	    .replica_id = id,
	    .heartbeat_ms = 50,
	    .dead_after = bus_dead_after ? bus_dead_after : 1000,
	    .snapshot_timeout_ms = bus_snapshot_ms ? bus_snapshot_ms : 5000,
	    .kept_bytes_max = bus_kept_max,
	    .tombstone_ms = bus_tombstone_ms,
	};
	struct kvr_replica_transport t = {.ctx = &port[i],
	                                  .publish = bus_publish,
	                                  .reply = bus_reply,
	                                  .request = bus_request,
	                                  .ready = bus_ready};
	struct kvr_replica *rep;
	cr_assert_eq(kvr_replica_create(r, &c, &t, &rep), 0);
	__atomic_store_n(&bus.rep[i], rep, __ATOMIC_RELEASE); /* read by bus_publish */
}

/* Starts replica i and waits until it is ready. */
static inline void bus_start_one(int i)
{
	cr_assert_eq(kvr_replica_start(bus.rep[i]), 0);
	cr_assert_eq(kvr_replica_wait_ready(bus.rep[i], 10000), 0);
}

/* Attaches replica i + 1 (bus.rep[i], on port i) to router r, started and ready. */
static inline void bus_attach(int i, struct kvr_router *r)
{
	bus_create_as(i, r, (uint64_t)i + 1);
	bus_start_one(i);
}

/* A router with the bus's two ranks (workers 0 and 1, incarnation 7). */
static inline struct kvr_router *bus_ranks_router(void)
{
	struct kvr_router *r = make();
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 7, 1000, 4096), 0);
	return r;
}

static inline struct kvr_router *bus_router(int i)
{
	struct kvr_router *r = bus_ranks_router();
	bus_attach(i, r);
	return r;
}

/* Starts replicas 1..n (n <= BUS_N) on an emptied bus, their routers in r[0..n-1]. */
static inline void bus_start(struct kvr_router **r, int n)
{
	memset(&bus.rep, 0, sizeof(bus.rep));
	for (int i = 0; i < n; i++)
		r[i] = bus_router(i);
}

/* Every replica has applied everything, and every router has run what it was told. */
static inline void bus_quiet(struct kvr_router **r, int n)
{
	for (int pass = 0; pass < 2; pass++)
		for (int i = 0; i < n; i++)
			cr_assert_eq(kvr_replica_drain(bus.rep[i], 10000), 0);
	for (int i = 0; i < n; i++)
		cr_assert_eq(kvr_router_sync(r[i], 5000), 0);
}

static inline size_t n_blocks(struct kvr_router *r, struct kvr_rank_id rk)
{
	static uint64_t x[4096];
	size_t n;
	cr_assert_eq(kvr_rank_blocks(r, rk, x, 4096, &n), 0);
	return n;
}

/* Active requests on r's ranks 0 and 1 (the ranks bus_router adds). */
static inline uint64_t bus_active_requests(struct kvr_router *r)
{
	uint64_t n = 0;
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats s;
		cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0);
		n += s.active_requests;
	}
	return n;
}

/* Routes a prompt of n tokens (distinct per seed) on r; returns the decision. */
static inline struct kvr_decision bus_route(struct kvr_router *r, uint32_t seed, size_t n)
{
	uint32_t t[256];
	cr_assert(n <= 256);
	for (size_t j = 0; j < n; j++)
		t[j] = seed * 1000003u + (uint32_t)j;
	return route(r, t, n);
}

/* Stops and destroys the first n replicas and their routers; empties every inbox. */
static inline void bus_teardown(struct kvr_router **r, int n)
{
	for (int i = n - 1; i >= 0; i--)
		kvr_replica_stop(bus.rep[i]);
	for (int i = 0; i < n; i++) {
		kvr_replica_destroy(bus.rep[i]);
		bus.rep[i] = NULL;
		kvr_router_destroy(r[i]);
	}
	for (int i = 0; i < BUS_N; i++) {
		for (struct bus_chunk *c; (c = bus_take(i));)
			free(c);
		bus_down[i] = bus_lose[i] = bus_deaf[i] = false;
		bus_turn[i] = 0;
		bus_slow_ms[i] = 0;
		bus_unheard[i] = false;
		bus_reply_fail[i] = 0;
	}
	bus_spread = false;
}

static inline void all_agree(struct kvr_router **r, int n, const char *when)
{
	for (int i = 1; i < n; i++)
		for (uint64_t w = 0; w < 2; w++) {
			struct kvr_rank_id rk = {w, 0};
			struct kvr_rank_stats s0, si;
			cr_assert_eq(kvr_rank_get_stats(r[0], rk, &s0), 0);
			cr_assert_eq(kvr_rank_get_stats(r[i], rk, &si), 0);
			cr_assert_eq(s0.active_blocks, si.active_blocks, "%s: replica %d rank %d",
			             when, i + 1, (int)w);
			same_blocks(r[0], r[i], rk);
		}
}

static inline uint64_t metric(struct kvr_router *r, const char *key)
{
	static char buf[1 << 16];
	size_t len = 0;
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf) - 1, &len), 0);
	buf[len] = 0;
	const char *e = strstr(buf, key);
	cr_assert_not_null(e, "%s not rendered", key);
	return strtoull(e + strlen(key), NULL, 10);
}

#endif
