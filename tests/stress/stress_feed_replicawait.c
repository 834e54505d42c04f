/*
 * stress_feed_replicawait - a feed's callbacks wait for a replica (kvr_replica_drain, as
 * kvr_sync_drain) while that replica's apply thread, in on_admit, calls the feed API on the same
 * feed at random (reads, add and remove of endpoints).  Each waited for the other until the
 * drain's timeout; now whichever wait comes second is refused with KVR_EBUSY at once (sync/feed.c,
 * "A feed's callback waiting for a replica").  Two routers A and B over an in-process bus, each
 * with a queue and rank X on a 100-token budget; the main thread routes a 200-token request on A,
 * which B mirrors, routes one on B, which waits, and finishes A's: B's apply thread admits B's in
 * on_admit.  Meanwhile a publisher's batches, every third seq skipped, run the feed's log and
 * on_event_gap, each of which drains B's replica.  A second feed, G (another events router,
 * another publisher), closes longer cycles: its callbacks call the first feed at random (reads,
 * add, remove), and on_admit's calls go to either feed (reads only on G): B's call on G waits for
 * G's callback, whose call on the first feed waits for that feed's drain of B.
 * Checked: every call returns (a hang fails by SIGALRM), with a documented code (on_admit's and
 * G's: 0 or KVR_EBUSY; the drains: 0 or KVR_EBUSY, never KVR_ETIMEDOUT, which a missed cycle
 * would give), and an endpoint whose add returned 0 is there until its remove returned 0.  Under
 * TSan this checks the records of the waits (the feed's waits_replica, the callers' rep_waiter
 * on their stacks, G's calling) against each other and against the feeds' loops.
 * Plain program: exit 0 pass, 1 fail, 77 skip.  argv[1]: duration, ms.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "tests/common/mono_clock.h"
#include "tests/common/replica_pair.h"
#include "tests/common/vllm_batch.h"
#include "tests/common/xorshift.h"

#define SLOTS    3
#define BUSY     (1u << 31)
#define RESERVED BUSY
#define DRAIN_MS 5000

static const struct kvr_rank_id X = {0, 0};
static struct kvr_feed *feed, *feed_g;
static uint32_t feed_pub_id, feed_g_pub_id; /* their publishers' endpoint ids */
static atomic_uint slot[SLOTS];             /* 0 free, RESERVED, an added id, or id | BUSY */
static atomic_int quiet;                    /* the callbacks call nothing */
static atomic_int active;                   /* callbacks inside a call */
static atomic_int failed;
static _Atomic uint64_t admitted; /* B's attempt on_admit got, for the main thread to end */
static atomic_ulong n_call_ok, n_call_busy, n_drain_ok, n_drain_busy, n_admits, n_g_ok, n_g_busy;
static _Thread_local bool on_g; /* this thread runs G's callbacks */

static void fail(const char *what, int rc)
{
	fprintf(stderr, "stress_feed_replicawait: %s: %d (%s)\n", what, rc, kvr_strerror(rc));
	atomic_store(&failed, 1);
}

static void count(int rc, const char *what)
{
	if (rc == 0)
		atomic_fetch_add(on_g ? &n_g_ok : &n_call_ok, 1);
	else if (rc == KVR_EBUSY)
		atomic_fetch_add(on_g ? &n_g_busy : &n_call_busy, 1);
	else
		fail(what, rc);
}

/* One random call on feed f (the first feed, or G: reads only), from on_admit on B's apply
 * thread or from G's callbacks. */
static void one_call(uint64_t *s, struct kvr_feed *f)
{
	int k = (int)(xorshift64(s) % SLOTS), rc;
	switch (xorshift64(s) % (f == feed ? 4 : 2)) {
	case 0: {
		struct kvr_feed_stats st;
		count(kvr_feed_get_stats(f, KVR_FEED_ALL, &st), "get_stats");
		break;
	}
	case 1: {
		size_t n;
		uint64_t out[4];
		count(kvr_feed_other_medium_blocks(f, f == feed ? feed_pub_id : feed_g_pub_id, 0,
		                                   out, 4, &n),
		      "other_medium_blocks");
		break;
	}
	case 2: {
		unsigned free_ = 0;
		if (!atomic_compare_exchange_strong(&slot[k], &free_, RESERVED))
			break;
		char ep[64];
		snprintf(ep, sizeof(ep), "tcp://127.0.0.1:%d", 9 + k); /* never answers */
		struct kvr_feed_endpoint fe = {.endpoint = ep, .worker_id = 99};
		uint32_t id = 0;
		rc = kvr_feed_add(feed, &fe, &id);
		atomic_store(&slot[k], rc == 0 ? id : 0);
		if (rc == 0 && (id == 0 || id >= BUSY))
			fail("add: id", (int)id);
		count(rc, "add");
		break;
	}
	case 3: {
		unsigned id = atomic_load(&slot[k]);
		if (id == 0 || (id & BUSY) ||
		    !atomic_compare_exchange_strong(&slot[k], &id, id | BUSY))
			break;
		rc = kvr_feed_remove(feed, id);
		atomic_store(&slot[k], rc == 0 ? 0 : id);
		count(rc, "remove");
		break;
	}
	}
}

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket;
	static _Thread_local uint64_t seed;
	if (!seed)
		seed = 0x9e3779b97f4a7c15ull;
	if (d->status == KVR_DECIDED)
		atomic_store(&admitted, d->attempt);
	atomic_fetch_add(&n_admits, 1);
	if (atomic_load(&quiet))
		return;
	atomic_fetch_add(&active, 1);
	if (!atomic_load(&quiet) && kvr_replica_handling(atomic_load(&pair_rep[1])))
		for (int n = 1 + (int)(xorshift64(&seed) % 3); n > 0; n--)
			one_call(&seed, xorshift64(&seed) % 2 ? feed : feed_g);
	atomic_fetch_add(&active, -1);
}

/* G's callbacks: calls on the first feed. */
static void g_calls(void)
{
	static _Thread_local uint64_t seed;
	if (!seed)
		seed = 0x2545f4914f6cdd1dull;
	if (atomic_load(&quiet))
		return;
	atomic_fetch_add(&active, 1);
	on_g = true;
	if (!atomic_load(&quiet))
		for (int n = 1 + (int)(xorshift64(&seed) % 2); n > 0; n--)
			one_call(&seed, feed);
	atomic_fetch_add(&active, -1);
}

static void on_log_g(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	g_calls();
}

static void on_gap_g(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)w, (void)dp, (void)from, (void)to;
	g_calls();
}

/* The feed's callbacks: drain B's replica. */
static void drain_b(void)
{
	if (atomic_load(&quiet))
		return;
	atomic_fetch_add(&active, 1);
	struct kvr_replica *b = atomic_load(&pair_rep[1]);
	if (!atomic_load(&quiet) && b) {
		int rc = kvr_replica_drain(b, DRAIN_MS);
		if (rc == 0)
			atomic_fetch_add(&n_drain_ok, 1);
		else if (rc == KVR_EBUSY)
			atomic_fetch_add(&n_drain_busy, 1);
		else
			fail("drain from the feed's callback", rc);
	}
	atomic_fetch_add(&active, -1);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	drain_b();
}

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)w, (void)dp, (void)from, (void)to;
	drain_b();
}

/* One shard, the queue on, rank X with a 100-token budget: a 200-token request saturates it. */
static struct kvr_router *queue_router(bool b)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	c.on_admit = b ? on_admit : NULL;
	struct kvr_router *x;
	if (kvr_router_create(&c, &x) || kvr_rank_add(x, X, 7, 1000, 100))
		exit(1);
	return x;
}

static int route(struct kvr_router *x, uint32_t salt, size_t n, struct kvr_decision *d)
{
	uint32_t t[256];
	for (size_t j = 0; j < n; j++)
		t[j] = salt * 1000u + (uint32_t)j;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.pinned = &X;
	q.expected_output_tokens = 16;
	return kvr_route(x, &q, d);
}

static void quiet_both(struct kvr_router **r)
{
	for (int i = 0; i < 2; i++)
		if (kvr_replica_drain(atomic_load(&pair_rep[i]), 10000) ||
		    kvr_router_sync(r[i], 5000))
			fail("quiet", 0);
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000;
	/* A wait that is never refused fails the test (SIGALRM) instead of meson's timeout. */
	alarm((unsigned)(ms / 1000) + 90);
	struct kvr_router *r[2] = {queue_router(false), queue_router(true)};
	for (int i = 0; i < 2; i++) {
		struct kvr_replica_config c = pair_config(i);
		pair_attach(i, r[i], &c);
	}
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	struct kvr_router *ev, *evg;
	if (kvr_router_create(&c, &ev) || kvr_rank_add(ev, X, 1, KVR_CAPACITY_NONE, 0))
		return 1;
	c.on_event_gap = on_gap_g;
	if (kvr_router_create(&c, &evg) || kvr_rank_add(evg, X, 1, KVR_CAPACITY_NONE, 0))
		return 1;
	void *zctx = zmq_ctx_new();
	void *pub, *pubg;
	char ep[256], epg[256];
	if (test_xpub_open(zctx, &pub, ep, sizeof(ep)) ||
	    test_xpub_open(zctx, &pubg, epg, sizeof(epg)))
		return 77;
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log;
	if (test_feed_subscribed(ev, &fc, pub, ep, 0, &feed, &feed_pub_id))
		return 1;
	fc.log = on_log_g;
	if (test_feed_subscribed(evg, &fc, pubg, epg, 0, &feed_g, &feed_g_pub_id))
		return 1;
	uint64_t t0 = now_ms(), seq = 0, rounds = 0, not_queued = 0;
	uint32_t salt = 1;
	while (now_ms() - t0 < ms && !atomic_load(&failed)) {
		/* A's request, mirrored on B, saturates X there: B's waits, until A's finish. */
		struct kvr_decision hog, q;
		if (route(r[0], salt++, 200, &hog) || hog.status != KVR_DECIDED) {
			fail("A's route", hog.status);
			break;
		}
		quiet_both(r);
		atomic_store(&admitted, 0);
		if (route(r[1], salt++, 64, &q)) {
			fail("B's route", 0);
			break;
		}
		if (q.status == KVR_DECIDED) {
			not_queued++;
			atomic_store(&admitted, q.attempt);
		}
		/* Gaps for the feed's callbacks while B's apply thread admits. */
		for (int k = 0; k < 3; k++) {
			test_batch_send_empty(pub, seq);
			test_batch_send_empty(pubg, seq);
			seq += seq % 3 == 2 ? 2 : 1;
		}
		if (kvr_request_finish(r[0], hog.attempt))
			fail("A's finish", 0);
		uint64_t a = 0;
		for (int t = 0; t < 10000 && !(a = atomic_load(&admitted)); t++)
			sleep_us(1000);
		if (!a) {
			fail("B's request never admitted", 0);
			break;
		}
		if (kvr_request_finish(r[1], a))
			fail("B's finish", 0);
		quiet_both(r);
		rounds++;
	}
	/* No call on the feed may race its destroy (kvrouter.h). */
	atomic_store(&quiet, 1);
	while (atomic_load(&active))
		sleep_us(1000);
	kvr_feed_destroy(feed_g);
	kvr_feed_destroy(feed);
	kvr_router_destroy(evg);
	kvr_router_destroy(ev);
	zmq_close(pubg);
	zmq_close(pub);
	zmq_ctx_term(zctx);
	pair_detach();
	for (int i = 0; i < 2; i++)
		kvr_router_destroy(r[i]);
	printf(
	    "stress_feed_replicawait: %lu rounds (%lu not queued), %lu admits; on_admit's "
	    "calls ok %lu busy %lu; G's ok %lu busy %lu; the feed's drains ok %lu busy %lu; %s\n",
	    (unsigned long)rounds, (unsigned long)not_queued, atomic_load(&n_admits),
	    atomic_load(&n_call_ok), atomic_load(&n_call_busy), atomic_load(&n_g_ok),
	    atomic_load(&n_g_busy), atomic_load(&n_drain_ok), atomic_load(&n_drain_busy),
	    atomic_load(&failed) ? "FAILED" : "ok");
	return atomic_load(&failed);
}
