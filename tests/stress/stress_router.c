/*
 * stress_router - many frontend threads routing and streaming output, half of the attempts
 * finished or aborted by other threads (finishers) right after kvr_route returned, while an
 * admin thread resets, resizes, removes and re-adds ranks and an engine thread feeds KV events
 * to an events-mode router.  Routing and lifecycle calls do not wait for the shards
 * (sync_booking off), but for a third router that books synchronously (sync_booking on: a
 * rank removed between the decision and its booking makes the route decide again, from the
 * hashes the thread kept, the record it hashed into being gone with the booking).  Bounded
 * in time.  At the end every rank's load must be back to zero and no attempt may be live;
 * every attempt must end exactly once (finish/abort returns 0 exactly once, or KVR_ESTALE
 * when a reset ended it first).
 *
 * usage: stress_router [duration_ms]   exit 0 pass, 1 fail
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/router_internal.h" /* the pinned-block index, to check it empties */
#include "kvrouter.h"
#include "tests/common/xorshift.h"

#define RANKS     6
#define FRONTENDS 3
#define FINISHERS 2

/* Attempts handed from the frontend that routed them to a finisher thread (a mutex-protected
 * ring: the test's plumbing, not under test). */
struct handoff {
	struct kvr_router *r;
	uint64_t attempt;
};
#define HANDOFF_CAP 1024
static struct handoff ring[HANDOFF_CAP];
static size_t ring_head, ring_n;
static pthread_mutex_t ring_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int frontends_done;

static struct kvr_router *approx, *events, *syncb;
static atomic_int stop;
static atomic_long routed, ended, stale_ends, failures, events_applied, lane_full;
/* Per router (0 approx, 1 events, 2 syncb): what the frontends saw, to check against its
 * metrics. */
static atomic_long routed_by[3], ended_by[3];

static int which(const struct kvr_router *r)
{
	return r == events ? 1 : r == syncb ? 2 : 0;
}

static int handoff_push(struct kvr_router *r, uint64_t attempt)
{
	pthread_mutex_lock(&ring_lock);
	int ok = ring_n < HANDOFF_CAP;
	if (ok)
		ring[(ring_head + ring_n++) % HANDOFF_CAP] = (struct handoff){r, attempt};
	pthread_mutex_unlock(&ring_lock);
	return ok;
}

static int handoff_pop(struct handoff *h)
{
	pthread_mutex_lock(&ring_lock);
	int ok = ring_n > 0;
	if (ok) {
		*h = ring[ring_head];
		ring_head = (ring_head + 1) % HANDOFF_CAP;
		ring_n--;
	}
	pthread_mutex_unlock(&ring_lock);
	return ok;
}

static void end_attempt(struct kvr_router *r, uint64_t attempt, uint64_t coin);

static void fail(const char *what, int rc)
{
	fprintf(stderr, "stress_router: %s: %s (%d)\n", what, kvr_strerror(rc), rc);
	atomic_fetch_add(&failures, 1);
}

static void make_prompt(uint32_t *t, size_t n, uint64_t family, uint64_t variant)
{
	for (size_t i = 0; i < n; i++)
		t[i] = (uint32_t)(family * 100003u + i + (i >= n / 2 ? variant * 7919u : 0));
}

static void *frontend(void *arg)
{
	uint64_t s = (uint64_t)(uintptr_t)arg * 0x9e3779b97f4a7c15ull + 1;
	uint32_t t[2400], out[40];
	while (!atomic_load(&stop)) {
		uint64_t pick = xorshift64(&s) & 7;
		struct kvr_router *r = pick < 2 ? events : pick < 4 ? syncb : approx;
		/* one in eight long enough for recycled attempt records (>= 64 blocks) */
		size_t n =
		    (xorshift64(&s) & 7) ? 16 + xorshift64(&s) % 600 : 1024 + xorshift64(&s) % 1300;
		make_prompt(t, n, xorshift64(&s) % 8, xorshift64(&s) % 4);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = n;
		q.request_id = xorshift64(&s);
		struct kvr_decision d;
		int rc = kvr_route(r, &q, &d);
		if (rc == KVR_ENOENT)
			continue;       /* every candidate was being reset at that instant */
		if (rc == KVR_EAGAIN) { /* the shard's lane stayed full (overload): documented */
			atomic_fetch_add(&lane_full, 1);
			continue;
		}
		if (rc) {
			fail("route", rc);
			continue;
		}
		atomic_fetch_add(&routed, 1);
		atomic_fetch_add(&routed_by[which(r)], 1);
		rc = kvr_request_prefill_done(r, d.attempt);
		if (rc == KVR_EAGAIN)
			atomic_fetch_add(&lane_full, 1);
		else if (rc && rc != KVR_ESTALE)
			fail("prefill_done", rc);
		int outs = (int)(xorshift64(&s) % 3);
		for (int k = 0; k < outs; k++) {
			for (int i = 0; i < 40; i++)
				out[i] = (uint32_t)xorshift64(&s);
			rc = kvr_request_output(r, d.attempt, out, 1 + xorshift64(&s) % 40);
			if (rc == KVR_EAGAIN)
				atomic_fetch_add(&lane_full, 1);
			else if (rc && rc != KVR_ESTALE)
				fail("output", rc);
		}
		/* Half the attempts end on another thread, right after kvr_route returned here. */
		if ((xorshift64(&s) & 1) && handoff_push(r, d.attempt))
			continue;
		end_attempt(r, d.attempt, xorshift64(&s));
	}
	return NULL;
}

static void end_attempt(struct kvr_router *r, uint64_t attempt, uint64_t coin)
{
	int rc = (coin & 1) ? kvr_request_finish(r, attempt) : kvr_request_abort(r, attempt);
	if (rc == 0) {
		atomic_fetch_add(&ended, 1);
		atomic_fetch_add(&ended_by[which(r)], 1);
	} else if (rc == KVR_ESTALE)
		atomic_fetch_add(&stale_ends, 1);
	else
		fail("finish", rc);
	rc = kvr_request_finish(r, attempt);
	if (rc != KVR_ESTALE)
		fail("second finish must be stale", rc);
}

static void *finisher(void *arg)
{
	uint64_t s = (uint64_t)(uintptr_t)arg * 0x2545f4914f6cdd1dull + 7;
	struct handoff h;
	for (;;) {
		if (handoff_pop(&h)) {
			end_attempt(h.r, h.attempt, xorshift64(&s));
			continue;
		}
		if (atomic_load(&frontends_done))
			return NULL; /* drained after every producer stopped */
		struct timespec ts = {0, 20000};
		nanosleep(&ts, NULL);
	}
}

static void *admin(void *arg)
{
	(void)arg;
	uint64_t s = 77, inc = 2;
	while (!atomic_load(&stop)) {
		struct kvr_rank_id id = {xorshift64(&s) % RANKS, 0};
		int rc;
		switch (xorshift64(&s) % 5) {
		case 0:
			rc = kvr_rank_reset(approx, id, inc++);
			break;
		case 1:
			rc = kvr_rank_set_capacity(approx, id, inc++, 50 + xorshift64(&s) % 200);
			break;
		case 2:
			/* removal and re-addition: the slot is reused under routing traffic */
			rc = kvr_rank_remove(approx, id);
			if (rc == 0)
				rc = kvr_rank_add(approx, id, inc++, 100 + xorshift64(&s) % 200,
				                  4096);
			break;
		case 3:
			rc = kvr_rank_remove(syncb, id);
			if (rc == 0)
				rc = kvr_rank_add(syncb, id, inc++, 100 + xorshift64(&s) % 200,
				                  4096);
			break;
		default:
			rc = kvr_rank_reset(events, id, inc++);
			break;
		}
		if (rc && rc != KVR_ESTALE)
			fail("admin", rc);
		struct timespec ts = {0, 2000000};
		nanosleep(&ts, NULL);
	}
	return NULL;
}

static void *engine(void *arg)
{
	(void)arg;
	uint64_t s = 99;
	uint64_t ids[RANKS] = {0};
	uint32_t t[64];
	while (!atomic_load(&stop)) {
		int w = (int)(xorshift64(&s) % RANKS);
		struct kvr_rank_id id = {(uint64_t)w, 0};
		make_prompt(t, 64, xorshift64(&s) % 8, xorshift64(&s) % 4);
		uint64_t local[4], seq[4];
		kvr_hash_blocks(t, 64, 16, NULL, local, seq);
		struct kvr_event_block b[4];
		for (int i = 0; i < 4; i++)
			b[i] = (struct kvr_event_block){.ext_hash = seq[i], .local_hash = local[i]};
		struct kvr_event e = {.event_id = ++ids[w]};
		if (xorshift64(&s) % 4) {
			e.type = KVR_EVENT_STORED;
			e.blocks = b;
			e.n_blocks = 4;
		} else {
			e.type = KVR_EVENT_REMOVED;
			e.removed = seq + 2;
			e.n_removed = 2;
		}
		int rc = kvr_events_apply(events, id, &e);
		if (rc == 0)
			atomic_fetch_add(&events_applied, 1);
		else if (rc != KVR_ESTALE && rc != KVR_ENOENT)
			fail("events_apply", rc);
	}
	return NULL;
}

static struct kvr_router *make(enum kvr_mode mode, bool sync_booking)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.mode = mode;
	c.sync_booking = sync_booking;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r))
		return NULL;
	for (int w = 0; w < RANKS; w++)
		if (kvr_rank_add(r, (struct kvr_rank_id){(uint64_t)w, 0}, 1, 100 + 50 * (uint64_t)w,
		                 4096))
			return NULL;
	return r;
}

/* Sum of a metric's samples (all label sets) in the Prometheus text. */
static long metric(struct kvr_router *r, const char *name)
{
	static char buf[1 << 16];
	size_t len;
	if (kvr_metrics_render(r, buf, sizeof(buf), &len))
		return -1;
	long sum = 0;
	size_t nl = strlen(name);
	for (char *p = buf; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		if (strncmp(p, name, nl) == 0 && (p[nl] == ' ' || p[nl] == '{'))
			sum += atol(strchr(p, ' ') + 1);
	}
	return sum;
}

/* Exactly once, counted by the router itself: every attempt a frontend saw admitted is in the
 * router's route count, and every finish/abort that returned 0 is one (and the only) end the
 * router counted for it; lease expiry (120 s interval) cannot have ended any. */
static int check_counts(struct kvr_router *r, int which, const char *name)
{
	long rt = metric(r, "kvr_routes_total"), en = metric(r, "kvr_requests_ended_total");
	long ex = metric(r, "kvr_lease_expiries_total");
	if (rt != atomic_load(&routed_by[which]) || en != atomic_load(&ended_by[which]) || ex) {
		fprintf(stderr,
		        "stress_router: %s: router counted %ld routes, %ld ends, %ld expiries; "
		        "frontends saw %ld routes, %ld ends\n",
		        name, rt, en, ex, atomic_load(&routed_by[which]),
		        atomic_load(&ended_by[which]));
		return 1;
	}
	return 0;
}

/* After quiescing, the index holds exactly what the predicted cache holds, within capacity. */
static int check_cache(struct kvr_router *r, const char *name)
{
	int bad = 0;
	if (kvr_router_sync(r, 10000))
		return 1;
	for (int w = 0; w < RANKS; w++) {
		struct kvr_rank_stats st;
		if (kvr_rank_get_stats(r, (struct kvr_rank_id){(uint64_t)w, 0}, &st)) {
			bad++;
			continue;
		}
		if (st.indexed_blocks != st.resident_blocks ||
		    (st.capacity_blocks != KVR_CAPACITY_NONE &&
		     st.resident_blocks > st.capacity_blocks)) {
			fprintf(
			    stderr,
			    "stress_router: %s rank %d: %lu indexed, %lu predicted, capacity %lu\n",
			    name, w, (unsigned long)st.indexed_blocks,
			    (unsigned long)st.resident_blocks, (unsigned long)st.capacity_blocks);
			bad++;
		}
	}
	return bad;
}

static int check_idle(struct kvr_router *r, const char *name)
{
	int bad = 0;
	if (kvr_router_sync(r, 10000))
		bad++;
	for (int w = 0; w < RANKS; w++) {
		struct kvr_rank_stats st;
		if (kvr_rank_get_stats(r, (struct kvr_rank_id){(uint64_t)w, 0}, &st)) {
			bad++;
			continue;
		}
		if (st.active_requests || st.active_blocks || st.active_prefill_tokens) {
			fprintf(stderr,
			        "stress_router: %s rank %d not idle: %lu req %lu blk %lu tok\n",
			        name, w, (unsigned long)st.active_requests,
			        (unsigned long)st.active_blocks,
			        (unsigned long)st.active_prefill_tokens);
			bad++;
		}
	}
	/* Every pin went with its attempt: no pinned run is published any more. */
	size_t runs = kvr_pinmap_runs(r->pinmap);
	if (runs) {
		fprintf(stderr, "stress_router: %s: %zu pinned runs left in the pinmap\n", name,
		        runs);
		bad++;
	}
	return bad;
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 2000;
	approx = make(KVR_MODE_APPROX_LRU, false);
	events = make(KVR_MODE_EVENTS, false);
	syncb = make(KVR_MODE_APPROX_LRU, true);
	if (!approx || !events || !syncb) {
		fprintf(stderr, "stress_router: setup failed\n");
		return 1;
	}
	pthread_t th[FRONTENDS + 2], fin[FINISHERS];
	for (int i = 0; i < FRONTENDS; i++)
		pthread_create(&th[i], NULL, frontend, (void *)(uintptr_t)(i + 1));
	pthread_create(&th[FRONTENDS], NULL, admin, NULL);
	pthread_create(&th[FRONTENDS + 1], NULL, engine, NULL);
	for (int i = 0; i < FINISHERS; i++)
		pthread_create(&fin[i], NULL, finisher, (void *)(uintptr_t)(i + 1));
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
	atomic_store(&stop, 1);
	for (int i = 0; i < FRONTENDS + 2; i++)
		pthread_join(th[i], NULL);
	atomic_store(&frontends_done, 1);
	for (int i = 0; i < FINISHERS; i++)
		pthread_join(fin[i], NULL);
	int bad = check_idle(approx, "approx_lru") + check_idle(events, "events") +
	          check_idle(syncb, "sync_booking");
	bad += check_counts(approx, 0, "approx_lru") + check_counts(events, 1, "events") +
	       check_counts(syncb, 2, "sync_booking");
	bad += check_cache(approx, "approx_lru") + check_cache(syncb, "sync_booking");
	long r = atomic_load(&routed), e = atomic_load(&ended), st = atomic_load(&stale_ends);
	printf("stress_router: %ld routed, %ld ended, %ld ended by reset, %ld events, %ld calls "
	       "refused on a full lane, %ld failures\n",
	       r, e, st, atomic_load(&events_applied), atomic_load(&lane_full),
	       atomic_load(&failures));
	kvr_router_destroy(approx);
	kvr_router_destroy(events);
	kvr_router_destroy(syncb);
	return (bad || atomic_load(&failures) || r == 0) ? 1 : 0;
}
