/*
 * tests/common/feed_pub.h - what the feed's unit tests (test_feed_callbacks, test_feed_limits,
 * test_feed_hostile, test_feed_bound) share: an events-mode router with one rank for the feed to
 * feed, a vLLM-like ZeroMQ publisher bound to a free local port, sending vLLM's three frames
 * (topic, 8-byte big-endian seq, msgpack payload), and an empty batch.
 */
#ifndef KVR_TESTS_COMMON_FEED_PUB_H
#define KVR_TESTS_COMMON_FEED_PUB_H

#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "kvrouter.h"
#include "tests/common/vllm_batch.h"

typedef void (*test_gap_fn)(void *, uint64_t, uint32_t, uint64_t, uint64_t);

/* An events-mode router on one shard with rank {0, 0} added (no capacity); on_gap is its
 * on_event_gap, max_blocks its events_max_blocks (0: the default). */
static inline struct kvr_router *test_events_router_max(test_gap_fn on_gap, uint64_t max_blocks)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	if (max_blocks)
		c.events_max_blocks = max_blocks;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	return r;
}

static inline struct kvr_router *test_events_router(test_gap_fn on_gap)
{
	return test_events_router_max(on_gap, 0);
}

struct test_pub {
	void *zctx;
	void *pub;    /* XPUB: the feed's subscription can be awaited (test_pub_subscribed) */
	char ep[256]; /* the endpoint it is bound to, for kvr_feed_endpoint.endpoint */
	uint32_t id;  /* its endpoint's id in the feed test_feed_on subscribed */
};

/* No send high-water mark: every batch must reach the feed. */
static inline void test_pub_open(struct test_pub *p)
{
	p->zctx = zmq_ctx_new();
	cr_assert_eq(test_xpub_open(p->zctx, &p->pub, p->ep, sizeof(p->ep)), 0);
}

/* Waits for the feed's subscription, so nothing sent after it is dropped. */
static inline void test_pub_subscribed(struct test_pub *p)
{
	uint8_t sub[64];
	cr_assert_geq(zmq_recv(p->pub, sub, sizeof(sub), 0), 1, "the feed subscribes");
}

/* A later subscriber (a feed taking over from one destroyed or removed): call
 * test_pub_verbose before it subscribes, then test_pub_resubscribed.  The XPUB passes a
 * subscription on only when nobody held it, so one that came before the earlier subscriber's
 * unsubscription was processed was never seen, and the wait hung (test_feed_takeover, 1 run
 * in a few); verbose passes every subscription on.  Unsubscriptions (first byte 0) are
 * skipped. */
static inline void test_pub_verbose(struct test_pub *p)
{
	int one = 1;
	cr_assert_eq(zmq_setsockopt(p->pub, ZMQ_XPUB_VERBOSE, &one, sizeof(one)), 0);
}

static inline void test_pub_resubscribed(struct test_pub *p)
{
	uint8_t sub[64];
	int n;
	do
		n = zmq_recv(p->pub, sub, sizeof(sub), 0);
	while (n >= 1 && sub[0] != 1);
	cr_assert_geq(n, 1, "the later feed subscribes");
}

static inline void test_pub_send(struct test_pub *p, uint64_t seq, const uint8_t *body, size_t n)
{
	cr_assert_eq(test_batch_send(p->pub, seq, body, n), 0, "the publisher sends the batch");
}

static inline void test_pub_send_empty(struct test_pub *p, uint64_t seq, uint32_t dp)
{
	uint8_t body[64];
	test_pub_send(p, seq, body, test_pub_empty_batch(body, dp));
}

/* A feed on r whose log is log(ctx), with pub's endpoint as worker w's (dp 0; its id in
 * pub->id), once subscribed. */
static inline struct kvr_feed *test_feed_on(struct kvr_router *r, struct test_pub *pub, uint64_t w,
                                            void (*log)(void *, int, const char *), void *ctx)
{
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = log;
	fc.log_ctx = ctx;
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, &fc, &f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = pub->ep, .worker_id = w, .dp_rank = 0};
	cr_assert_eq(kvr_feed_add(f, &fe, &pub->id), 0);
	test_pub_subscribed(pub);
	return f;
}

/* Blocks the index holds for rank (0, 0), once the router applied what it was given. */
static inline uint64_t test_indexed_blocks(struct kvr_router *r)
{
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_router_sync(r, 1000), 0);
	cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){0, 0}, &st), 0);
	return st.indexed_blocks;
}

static inline void test_pub_close(struct test_pub *p)
{
	zmq_close(p->pub);
	zmq_ctx_term(p->zctx);
}

static inline void sleep_ms(long ms)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
}

/* Waits up to 10 s for *flag (a feed's thread came back from a callback). */
static inline bool came_back(atomic_int *flag)
{
	for (int t = 0; t < 1000 && !atomic_load(flag); t++)
		sleep_ms(10);
	return atomic_load(flag);
}

/* Threads of this process (a feed's thread must be gone in the end). */
static inline int test_n_threads(void)
{
	int n = -1;
	FILE *f = fopen("/proc/self/stat", "r");
	if (f) {
		/* field 20: num_threads; comm (field 2) has no spaces here */
		cr_assert_eq(fscanf(f,
		                    "%*d %*s %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u "
		                    "%*d %*d %*d %*d %d",
		                    &n),
		             1);
		fclose(f);
	}
	return n;
}

#endif
