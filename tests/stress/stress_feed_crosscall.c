/*
 * stress_feed_crosscall - four feeds of one router whose callbacks (the router's on_event_gap on
 * every gap, the feeds' logs) call the feed API on each other at random while batches flow:
 * reads (kvr_feed_get_stats, kvr_feed_other_medium_blocks), kvr_feed_add of an endpoint and
 * kvr_feed_remove of one added before, on any feed, their own included; an ordinary thread does
 * the same meanwhile.  Before, two callbacks calling each other's feeds (or around a longer
 * cycle, or through an ordinary caller holding a feed's ctl_lock) waited for good; now a feed
 * thread waiting for another serves its own feed's calls (sync/feed.c, "Calls between feeds").
 * Checked: every call returns, with a documented code (reads 0; from a callback add / remove 0 or
 * KVR_EBUSY, from the ordinary thread 0), and an endpoint whose add returned 0 is there until its
 * remove returned 0 (each slot below is owned by one call at a time).  Under TSan this checks
 * the boxes, the deferred lists and the wait-for graph; a hang fails by SIGALRM.  The ranks are
 * bounded (events_max_blocks) and every batch stores blocks, with a clear every few: the
 * refusals are logged and each episode reported (on_event_gap) when the feed next settles, which
 * it does before every command it runs, so callbacks also run inside other feeds' and the
 * ordinary thread's calls (test_feed_crossserve: such a callback's add on its caller waited for
 * good before).
 * Plain program: exit 0 pass, 1 fail, 77 skip.  argv[1]: duration, ms.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/mono_clock.h"
#include "tests/common/vllm_batch.h"
#include "tests/common/xorshift.h"

#define NF       4
#define SLOTS    3 /* endpoints added per feed at most, besides the publisher's (pub_id) */
#define BUSY     (1u << 31)
#define RESERVED BUSY

static struct kvr_feed *F[NF];
static uint32_t pub_id[NF]; /* the id of feed i's publisher endpoint */
/* Per feed, the ids of endpoints added: 0 free, RESERVED (an add in flight), id, or id | BUSY
 * (a remove in flight).  The publishers' endpoints were added first, so added ones are >= 1. */
static atomic_uint slot[NF][SLOTS];
static atomic_int quiet;  /* the callbacks call nothing */
static atomic_int active; /* callbacks inside random_ops */
static atomic_int failed;
static atomic_ulong n_reads, n_add_ok, n_add_busy, n_rm_ok, n_rm_busy, n_ord;

static void fail(const char *what, int from, int to, int rc)
{
	fprintf(stderr, "%s from %d on feed %d: %d (%s)\n", what, from, to, rc, kvr_strerror(rc));
	atomic_store(&failed, 1);
}

/* One random call on a random feed; from: the calling feed, or -1 (ordinary thread). */
static void one_op(int from, uint64_t *s)
{
	int t = (int)(xorshift64(s) % NF);
	bool cb = from >= 0;
	int rc;
	switch (xorshift64(s) % 4) {
	case 0: {
		struct kvr_feed_stats st;
		uint32_t id = xorshift64(s) & 1 ? KVR_FEED_ALL : pub_id[t];
		if ((rc = kvr_feed_get_stats(F[t], id, &st)) != 0)
			fail("get_stats", from, t, rc);
		atomic_fetch_add(&n_reads, 1);
		break;
	}
	case 1: {
		size_t n;
		uint64_t out[4];
		rc = kvr_feed_other_medium_blocks(F[t], pub_id[t], 0, out, 4, &n);
		if (rc != 0)
			fail("other_medium_blocks", from, t, rc);
		atomic_fetch_add(&n_reads, 1);
		break;
	}
	case 2: {
		int k = (int)(xorshift64(s) % SLOTS);
		unsigned free_ = 0;
		if (!atomic_compare_exchange_strong(&slot[t][k], &free_, RESERVED))
			break;
		char ep[64];
		snprintf(ep, sizeof(ep), "tcp://127.0.0.1:%d", 9 + k); /* never answers */
		struct kvr_feed_endpoint fe = {.endpoint = ep, .worker_id = 99};
		uint32_t id = 0;
		rc = kvr_feed_add(F[t], &fe, &id);
		if (rc == 0 && id >= 1 && id < BUSY) {
			atomic_store(&slot[t][k], id);
			atomic_fetch_add(&n_add_ok, 1);
		} else {
			atomic_store(&slot[t][k], 0);
			if (rc == KVR_EBUSY && cb)
				atomic_fetch_add(&n_add_busy, 1);
			else
				fail("add", from, t, rc);
		}
		break;
	}
	case 3: {
		int k = (int)(xorshift64(s) % SLOTS);
		unsigned id = atomic_load(&slot[t][k]);
		if (id == 0 || (id & BUSY) ||
		    !atomic_compare_exchange_strong(&slot[t][k], &id, id | BUSY))
			break;
		rc = kvr_feed_remove(F[t], id);
		if (rc == 0) {
			atomic_store(&slot[t][k], 0);
			atomic_fetch_add(&n_rm_ok, 1);
		} else {
			atomic_store(&slot[t][k], id);
			if (rc == KVR_EBUSY && cb)
				atomic_fetch_add(&n_rm_busy, 1);
			else
				fail("remove", from, t, rc);
		}
		break;
	}
	}
}

static _Thread_local uint64_t cb_seed;
static uint64_t round_no; /* written before the feeds' threads start */

static void random_ops(int i)
{
	if (atomic_load(&quiet))
		return;
	atomic_fetch_add(&active, 1);
	if (!atomic_load(&quiet)) {
		if (!cb_seed)
			cb_seed = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1) + round_no;
		int n = 1 + (int)(xorshift64(&cb_seed) % 3);
		for (int k = 0; k < n; k++)
			one_op(i, &cb_seed);
	}
	atomic_fetch_sub(&active, 1);
}

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)dp, (void)from, (void)to;
	if (w < NF)
		random_ops((int)w);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)level, (void)msg;
	random_ops((int)(intptr_t)ctx);
}

/* Events per rank at most: a third stored batch in a row is refused (BOUND / PER). */
#define BOUND 4
#define PER   2
#define BS    TEST_BLOCK_TOKENS

/* Batch seq for feed i: PER new blocks, or (every eighth) a clear, which ends the episode. */
static int send_batch(void *pub, struct kvr_fenc *e, uint64_t seq, int i)
{
	kvr_fenc_begin(e, 1.0, 1);
	if (seq % 8 == 7) {
		kvr_fenc_cleared(e);
	} else {
		uint64_t h[PER];
		for (int k = 0; k < PER; k++)
			h[k] = ((uint64_t)i << 40) + seq * PER + (uint64_t)k + 1;
		kvr_fenc_stored(e, h, PER, NULL, BS, test_block_tokens, h);
	}
	kvr_fenc_end(e, 0);
	return kvr_fenc_send(pub, seq, e->sb.data, e->sb.size);
}

static atomic_int ord_stop;

static void *ordinary(void *arg)
{
	uint64_t s = (uint64_t)(uintptr_t)arg | 1;
	while (!atomic_load(&ord_stop)) {
		one_op(-1, &s);
		atomic_fetch_add(&n_ord, 1);
		sleep_us(200);
	}
	return NULL;
}

static int round_once(uint64_t ms, uint64_t seed)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	c.events_max_blocks = BOUND;
	c.block_size = BS;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r)) {
		fprintf(stderr, "router\n");
		return 1;
	}
	for (int i = 0; i < NF; i++)
		if (kvr_rank_add(r, (struct kvr_rank_id){(uint64_t)i, 0}, 1, KVR_CAPACITY_NONE,
		                 0)) {
			fprintf(stderr, "rank\n");
			return 1;
		}
	memset(slot, 0, sizeof(slot));
	atomic_store(&quiet, 1); /* until every feed is in F (the batches that wake the
	                          * callbacks come through ZeroMQ, which TSan does not see) */
	round_no = seed;
	void *zctx = zmq_ctx_new();
	void *pub[NF];
	for (int i = 0; i < NF; i++) {
		char ep[256];
		if (test_xpub_open(zctx, &pub[i], ep, sizeof(ep))) {
			fprintf(stderr, "bind\n");
			return 1;
		}
		struct kvr_feed_config fc;
		kvr_feed_config_init(&fc);
		fc.log = on_log;
		fc.log_ctx = (void *)(intptr_t)i;
		if (test_feed_subscribed(r, &fc, pub[i], ep, (uint64_t)i, &F[i], &pub_id[i])) {
			fprintf(stderr, "feed\n");
			return 1;
		}
	}
	atomic_store(&quiet, 0);
	atomic_store(&ord_stop, 0);
	pthread_t ord;
	if (pthread_create(&ord, NULL, ordinary, (void *)(uintptr_t)seed)) {
		fprintf(stderr, "thread\n");
		return 1;
	}
	/* Batches to every feed, every third seq skipped: a gap, on_event_gap, random calls; and
	 * the refusals past the bound (see the top of the file). */
	struct kvr_fenc enc;
	kvr_fenc_init(&enc);
	uint64_t seq = 0, t0 = now_ms();
	while (now_ms() - t0 < ms && !atomic_load(&failed)) {
		for (int i = 0; i < NF; i++)
			if (send_batch(pub[i], &enc, seq, i)) {
				fprintf(stderr, "send\n");
				return 1;
			}
		seq += seq % 3 == 2 ? 2 : 1;
		sleep_us(500);
	}
	kvr_fenc_fini(&enc);
	atomic_store(&ord_stop, 1);
	pthread_join(ord, NULL);
	/* No call on a feed may race its destroy (kvrouter.h): the callbacks stop calling, and
	 * those inside return, first. */
	atomic_store(&quiet, 1);
	while (atomic_load(&active))
		sleep_us(1000);
	for (int i = 0; i < NF; i++)
		kvr_feed_destroy(F[i]);
	kvr_router_destroy(r);
	for (int i = 0; i < NF; i++)
		zmq_close(pub[i]);
	zmq_ctx_term(zctx);
	return atomic_load(&failed);
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000;
	/* A deadlock fails the test (SIGALRM) instead of waiting for meson's timeout. */
	alarm((unsigned)(ms / 1000) + 60);
	uint64_t t0 = now_ms();
	int rounds = 0;
	do {
		if (round_once(ms < 1000 ? ms : 500, 0x2545f4914f6cdd1dull + (uint64_t)rounds)) {
			fprintf(stderr, "stress_feed_crosscall: failed in round %d\n", rounds);
			return 1;
		}
		rounds++;
	} while (now_ms() - t0 < ms);
	printf(
	    "stress_feed_crosscall: %d rounds; reads %lu, add ok %lu busy %lu, remove ok %lu busy "
	    "%lu, ordinary calls %lu; ok\n",
	    rounds, atomic_load(&n_reads), atomic_load(&n_add_ok), atomic_load(&n_add_busy),
	    atomic_load(&n_rm_ok), atomic_load(&n_rm_busy), atomic_load(&n_ord));
	return 0;
}
