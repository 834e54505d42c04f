/*
 * stress_replica_keep - replica sync's outbound queue full while routing threads go on (run
 * under TSan in CI).  Two replicas over an in-process bus; the origin's sender is stalled
 * (kvr_replica_stall) while FRONTENDS threads route and stream output concurrently, until its
 * ring is full and every thread has made KEPT_NOTES more notes with notes kept aside
 * (sync/replica_note.c, note_keep: a note that found the ring full for 100 ms, and every note
 * after it until the ring drains).  Then the stall ends while the threads go on, AFTER_NOTES
 * more each: the sender drains the ring, then the kept notes, while new notes come.
 *
 * Checks: nothing is unpublished; the peer agrees with the origin on every rank's load and on
 * its predicted blocks (no eviction: the capacity is large, so the blocks are a set, but output
 * tokens make blocks in their order, so a note published out of order, or lost, shows); after
 * every attempt ends, nothing is mirrored and no load is left on either router.
 *
 * Then the same with the kept notes capped at CAP_BYTES (kept_bytes_max) and the threads also
 * ending attempts (and routing new ones) all along: notes past the cap are dropped while the
 * threads race the sender's reconcile (kept_reconcile: ends told as aborts from the router's
 * leases).  Checks: what is kept stays under the cap (plus a note per thread in flight); once
 * every attempt ended, nothing is mirrored and no load is left on either router.  Predictions
 * are not compared: what dropped admissions and output told is lost by design.
 *
 * usage: stress_replica_keep   exit 0 pass, 1 fail
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h" /* the outbound ring and the kept notes, to see them fill */
#include "tests/common/replica_pair.h"

#define FRONTENDS   3
#define MAX_ATT     64
#define KEPT_NOTES  300    /* notes each thread makes while notes are kept */
#define AFTER_NOTES 3000   /* notes each thread makes after the stall ended */
#define MAX_NOTES   400000 /* per thread: the ring (32767) must have filled long before */
#define RANKS       2
#define MAX_BLOCKS  (1 << 20)
#define CAP_BYTES   16384
#define END_EVERY   50 /* capped run: a thread ends an attempt (and routes one) every 50 calls */

static struct kvr_router *r[2];
static atomic_int failures;
static atomic_int stop;   /* the threads stop */
static uint64_t cap;      /* kept_bytes_max of the run (0: the default) */
static atomic_ulong most; /* the most kept bytes a thread saw */

#define CHECK(c, ...)                                                                              \
	do {                                                                                       \
		if (!(c)) {                                                                        \
			fprintf(stderr, "stress_replica_keep: " __VA_ARGS__);                      \
			fprintf(stderr, "\n");                                                     \
			atomic_fetch_add(&failures, 1);                                            \
		}                                                                                  \
	} while (0)

static struct kvr_router *make_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	struct kvr_router *x;
	if (kvr_router_create(&c, &x))
		exit(1);
	for (uint64_t w = 0; w < RANKS; w++)
		if (kvr_rank_add(x, (struct kvr_rank_id){w, 0}, 7, 1u << 22, 4096))
			exit(1);
	return x;
}

static struct kvr_replica *make_replica(int i)
{
	struct kvr_replica_config c = pair_config(i); /* nobody is given up during the stall */
	c.kept_bytes_max = cap;
	return pair_attach(i, r[i], &c);
}

struct frontend {
	int id;
	uint64_t att[MAX_ATT];
	int n_att;
	uint32_t tok[64];
	_Atomic uint64_t notes, kept_notes;
};

static uint64_t route(struct frontend *f, uint32_t seed)
{
	uint32_t t[200];
	for (uint32_t j = 0; j < 200; j++)
		t[j] = (uint32_t)f->id * 100000000u + seed * 1000u + j;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 200;
	q.expected_output_tokens = 64;
	struct kvr_decision d;
	int rc = kvr_route(r[0], &q, &d);
	CHECK(rc == 0 && d.status == KVR_DECIDED, "route: %d", rc);
	return rc == 0 ? d.attempt : 0;
}

static bool ring_full_seen;

static void *frontend_main(void *arg)
{
	struct frontend *f = arg;
	struct kvr_replica *o = atomic_load(&pair_rep[0]);
	uint32_t next = 0;
	for (uint64_t i = 0; i < MAX_NOTES && !atomic_load(&stop); i++) {
		if (__atomic_load_n(&o->kept, __ATOMIC_RELAXED))
			f->kept_notes++;
		unsigned long kb = __atomic_load_n(&o->kept_bytes, __ATOMIC_RELAXED);
		for (unsigned long m = atomic_load(&most); kb > m;)
			atomic_compare_exchange_weak(&most, &m, kb);
		/* Reserved, not depth: a note left tagged behind a descheduled one is not in
		 * the depth until the sender passes it (sync/ring.h kvr_ring_commit_or_tag). */
		if (kvr_ring_reserved(&o->outq) >= kvr_ring_capacity(&o->outq))
			__atomic_store_n(&ring_full_seen, true, __ATOMIC_RELAXED);
		int rc;
		if (cap &&
		    i % END_EVERY == END_EVERY - 1) { /* an end, and a new attempt in its place */
			int k = (int)(i / END_EVERY % (uint64_t)f->n_att);
			rc = kvr_request_finish(r[0], f->att[k]);
			uint64_t a = route(f, (uint32_t)(1000 + i));
			if (!a)
				break;
			f->att[k] = a;
			f->notes += 2;
		} else if (i % 500 == 0 &&
		           f->n_att < MAX_ATT) { /* an admission, then its prefill */
			uint64_t a = route(f, (uint32_t)f->n_att);
			if (!a)
				break;
			f->att[f->n_att++] = a;
			rc = kvr_request_prefill_done(r[0], a);
			f->notes += 2;
		} else { /* output: 1-7 tokens, distinct per thread and call */
			size_t n = 1 + i % 7;
			for (size_t j = 0; j < n; j++)
				f->tok[j] = (uint32_t)f->id * 100000000u + 50000000u + next++;
			rc = kvr_request_output(r[0], f->att[i % (uint64_t)f->n_att], f->tok, n);
			f->notes++;
		}
		CHECK(rc == 0, "frontend %d: call %" PRIu64 ": %d", f->id, i, rc);
	}
	return NULL;
}

static int cmp(const void *p, const void *q)
{
	uint64_t a = *(const uint64_t *)p, b = *(const uint64_t *)q;
	return a < b ? -1 : a > b;
}

/* Every rank's load and predicted blocks (as sets) equal on both routers. */
static bool same_state(void)
{
	static uint64_t x[MAX_BLOCKS], y[MAX_BLOCKS];
	for (uint64_t w = 0; w < RANKS; w++) {
		struct kvr_rank_id rk = {w, 0};
		struct kvr_rank_stats a, b;
		if (kvr_rank_get_stats(r[0], rk, &a) || kvr_rank_get_stats(r[1], rk, &b))
			return false;
		if (a.active_blocks != b.active_blocks || a.active_requests != b.active_requests ||
		    a.active_prefill_tokens != b.active_prefill_tokens)
			return false;
		size_t nx, ny;
		if (kvr_rank_blocks(r[0], rk, x, MAX_BLOCKS, &nx) ||
		    kvr_rank_blocks(r[1], rk, y, MAX_BLOCKS, &ny) || nx != ny)
			return false;
		qsort(x, nx, 8, cmp);
		qsort(y, ny, 8, cmp);
		if (memcmp(x, y, nx * 8))
			return false;
	}
	return true;
}

/* Every rank's load equal on both routers. */
static bool same_load(void)
{
	for (uint64_t w = 0; w < RANKS; w++) {
		struct kvr_rank_stats a, b;
		struct kvr_rank_id rk = {w, 0};
		if (kvr_rank_get_stats(r[0], rk, &a) || kvr_rank_get_stats(r[1], rk, &b) ||
		    a.active_requests != b.active_requests || a.active_blocks != b.active_blocks)
			return false;
	}
	return true;
}

static void quiet(void)
{
	for (int pass = 0; pass < 2; pass++)
		for (int i = 0; i < 2; i++)
			CHECK(kvr_replica_drain(atomic_load(&pair_rep[i]), 60000) == 0, "drain %d",
			      i);
	for (int i = 0; i < 2; i++)
		CHECK(kvr_router_sync(r[i], 60000) == 0, "sync %d", i);
}

/* Waits (up to 20 s, quieting between looks) until the peer agrees with the origin. */
static bool agree(void)
{
	for (int k = 0; k < 200; k++) {
		quiet();
		if (same_state())
			return true;
		struct timespec ts = {0, 100000000};
		nanosleep(&ts, NULL);
	}
	return false;
}

/* One run: the stall, the threads, the checks. */
static void run(void)
{
	atomic_store(&stop, 0);
	atomic_store(&most, 0);
	__atomic_store_n(&ring_full_seen, false, __ATOMIC_RELAXED);
	r[0] = make_router();
	r[1] = make_router();
	struct kvr_replica *o = make_replica(0), *p = make_replica(1);
	static struct frontend f[FRONTENDS];
	for (int i = 0; i < FRONTENDS; i++) {
		f[i].id = i + 1;
		f[i].att[f[i].n_att] = route(&f[i], 999);
		f[i].n_att++;
	}
	quiet();
	CHECK(agree(), "the peer disagrees before the stall");
	struct kvr_sync_stats s0, s1;
	kvr_replica_get_stats(o, &s0);
	kvr_replica_stall(o, 600000, true); /* ended below */
	pthread_t th[FRONTENDS];
	for (int i = 0; i < FRONTENDS; i++)
		if (pthread_create(&th[i], NULL, frontend_main, &f[i]))
			exit(1);
	/* Until every thread made KEPT_NOTES notes while notes were kept, then AFTER_NOTES more
	 * once the stall ended (or 60 s, each). */
	uint64_t after[FRONTENDS];
	for (int phase = 0; phase < 2; phase++) {
		for (int k = 0; k < 6000; k++) {
			int done = 0;
			for (int i = 0; i < FRONTENDS; i++)
				done += phase ? atomic_load(&f[i].notes) >= after[i] + AFTER_NOTES
				              : atomic_load(&f[i].kept_notes) >= KEPT_NOTES;
			if (done == FRONTENDS)
				break;
			struct timespec ts = {0, 10000000};
			nanosleep(&ts, NULL);
		}
		if (phase == 0) {
			kvr_replica_stall(o, 0, true);
			for (int i = 0; i < FRONTENDS; i++)
				after[i] = atomic_load(&f[i].notes);
		}
	}
	atomic_store(&stop, 1);
	for (int i = 0; i < FRONTENDS; i++)
		pthread_join(th[i], NULL);
	uint64_t notes = 0, kept = 0;
	for (int i = 0; i < FRONTENDS; i++) {
		notes += f[i].notes;
		kept += f[i].kept_notes;
		CHECK(f[i].kept_notes >= KEPT_NOTES, "frontend %d: no notes kept (%" PRIu64 ")",
		      f[i].id, f[i].kept_notes);
	}
	CHECK(__atomic_load_n(&ring_full_seen, __ATOMIC_RELAXED), "the ring never filled");
	kvr_replica_get_stats(o, &s1);
	if (!cap) {
		CHECK(agree(), "the peer disagrees with the origin after the stall");
		CHECK(s1.unpublished == s0.unpublished, "%" PRIu64 " notes unpublished",
		      s1.unpublished - s0.unpublished);
	} else {
		/* a note per thread may be counted in before it is taken back */
		CHECK(atomic_load(&most) <= cap + FRONTENDS * 4096,
		      "kept %lu bytes past the cap (%" PRIu64 ")", atomic_load(&most), cap);
		CHECK(s1.notes_over_cap > 0, "no note went past the cap");
	}
	for (int i = 0; i < FRONTENDS; i++)
		for (int k = 0; k < f[i].n_att; k++)
			CHECK(kvr_request_finish(r[0], f[i].att[k]) == 0, "finish");
	quiet();
	if (!cap)
		CHECK(agree(), "the peer disagrees after the ends");
	else
		for (int k = 0; k < 200 && !same_load(); k++) { /* the reconcile's aborts */
			struct timespec ts = {0, 10000000};
			nanosleep(&ts, NULL);
			quiet();
		}
	struct kvr_sync_stats sp;
	kvr_replica_get_stats(p, &sp);
	CHECK(sp.mirrored == 0, "%u attempts still mirrored", sp.mirrored);
	for (int i = 0; i < 2; i++)
		for (uint64_t w = 0; w < RANKS; w++) {
			struct kvr_rank_stats s;
			CHECK(kvr_rank_get_stats(r[i], (struct kvr_rank_id){w, 0}, &s) == 0 &&
			          s.active_requests == 0 && s.active_blocks == 0,
			      "router %d rank %" PRIu64 ": load left", i, w);
		}
	kvr_replica_get_stats(o, &s1);
	printf("stress_replica_keep%s: %" PRIu64 " notes (%" PRIu64
	       " made while notes were kept), published %" PRIu64 ", over the cap %" PRIu64
	       ", ends reconciled %" PRIu64 ", kept at most %lu bytes, %d failures\n",
	       cap ? " (capped)" : "", notes, kept, s1.published - s0.published, s1.notes_over_cap,
	       s1.ends_reconciled, atomic_load(&most), atomic_load(&failures));
	pair_detach(); /* the next run's first replica publishes to nobody */
	kvr_router_destroy(r[1]);
	kvr_router_destroy(r[0]);
	memset(f, 0, sizeof(f));
}

int main(void)
{
	run();
	cap = CAP_BYTES;
	run();
	return atomic_load(&failures) ? 1 : 0;
}
