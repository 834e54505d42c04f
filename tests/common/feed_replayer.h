/*
 * tests/common/feed_replayer.h - what the feed's replay tests (test_feed_resync,
 * test_feed_replay_reask) share: a vLLM-like publisher (tests/common/feed_pub.h), a replay
 * endpoint the test answers itself as a scripted replayer (a ROUTER bound to a free local port),
 * an events-mode router with no rank yet, and a feed on the publisher with that replay endpoint.
 *
 * The replay protocol (vllm/distributed/kv_events.py; sync/feed_seq.c): the feed's DEALER sends
 * ["", start_seq]; the answer is ["", seq, payload] per batch, then the end marker
 * ["", 2^64 - 1, ""].
 */
#ifndef KVR_TESTS_COMMON_FEED_REPLAYER_H
#define KVR_TESTS_COMMON_FEED_REPLAYER_H

#include <criterion/criterion.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"
#include "tests/common/feed_pub.h"

struct test_replayer {
	struct test_pub pub;
	void *router; /* the replay endpoint: the test answers it */
	struct kvr_router *r;
	struct kvr_feed *f;
	uint32_t id;     /* the publisher's endpoint in f */
	zmq_msg_t asker; /* the identity of the DEALER that asked last */
	int asks;        /* replay requests received */
};

/* Opens t: the publisher; the replay ROUTER; a router in KVR_MODE_EVENTS on one shard with
 * block_size TEST_BLOCK_TOKENS, on_gap as its on_event_gap and no rank; a feed with
 * replay_timeout_ms and log (NULL: none) on the publisher's endpoint (worker 0, dp 0), once
 * subscribed. */
static inline void test_replayer_open(struct test_replayer *t, test_gap_fn on_gap,
                                      uint32_t replay_timeout_ms,
                                      void (*log)(void *, int, const char *))
{
	memset(t, 0, sizeof(*t));
	test_pub_open(&t->pub);
	t->router = zmq_socket(t->pub.zctx, ZMQ_ROUTER);
	cr_assert_not_null(t->router);
	cr_assert_eq(zmq_bind(t->router, "tcp://127.0.0.1:*"), 0);
	char rep[256];
	size_t cap = sizeof(rep);
	cr_assert_eq(zmq_getsockopt(t->router, ZMQ_LAST_ENDPOINT, rep, &cap), 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.block_size = TEST_BLOCK_TOKENS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	cr_assert_eq(kvr_router_create(&c, &t->r), 0);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = replay_timeout_ms;
	fc.log = log;
	cr_assert_eq(kvr_feed_create(t->r, &fc, &t->f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = t->pub.ep, .replay_endpoint = rep};
	cr_assert_eq(kvr_feed_add(t->f, &fe, &t->id), 0);
	test_pub_subscribed(&t->pub);
	zmq_msg_init(&t->asker);
}

/* The next replay request, within ms; its start in *from.  false: none came (the last asker is
 * then forgotten: answer nothing before the next request). */
static inline bool test_replayer_next_ask(struct test_replayer *t, int ms, uint64_t *from)
{
	zmq_setsockopt(t->router, ZMQ_RCVTIMEO, &ms, sizeof(ms));
	zmq_msg_close(&t->asker);
	zmq_msg_init(&t->asker);
	if (zmq_msg_recv(&t->asker, t->router, 0) < 0)
		return false;
	uint8_t empty[8], start[8];
	cr_assert_eq(zmq_recv(t->router, empty, sizeof(empty), 0), 0);
	cr_assert_eq(zmq_recv(t->router, start, sizeof(start), 0), 8);
	*from = 0;
	for (int i = 0; i < 8; i++)
		*from = *from << 8 | start[i];
	t->asks++;
	return true;
}

/* One message of the answer to the last request: batch seq with payload body[0..n), or the end
 * marker (seq UINT64_MAX; body unused). */
static inline void test_replayer_answer(struct test_replayer *t, uint64_t seq, const void *body,
                                        size_t n)
{
	zmq_msg_t id;
	zmq_msg_init(&id);
	zmq_msg_copy(&id, &t->asker);
	cr_assert_geq(zmq_msg_send(&id, t->router, ZMQ_SNDMORE), 0);
	uint8_t s[8];
	for (int i = 0; i < 8; i++)
		s[i] = (uint8_t)(seq >> (56 - 8 * i));
	zmq_send(t->router, "", 0, ZMQ_SNDMORE);
	zmq_send(t->router, s, 8, ZMQ_SNDMORE);
	if (seq == UINT64_MAX)
		zmq_send(t->router, "", 0, 0);
	else
		zmq_send(t->router, body, n, 0);
}

/* Waits (5 s at most) until the feed took every batch before seq next. */
static inline void test_replayer_feed_at(struct test_replayer *t, uint64_t next)
{
	struct kvr_feed_stats st;
	for (int k = 0; k < 500; k++) {
		cr_assert_eq(kvr_feed_get_stats(t->f, t->id, &st), 0);
		if (st.next_seq == next)
			return;
		sleep_ms(10);
	}
	cr_assert_fail("the feed took %llu batches, not %llu", (unsigned long long)st.next_seq,
	               (unsigned long long)next);
}

/* Destroys the feed, then the router, then the sockets. */
static inline void test_replayer_close(struct test_replayer *t)
{
	kvr_feed_destroy(t->f);
	kvr_router_destroy(t->r);
	zmq_msg_close(&t->asker);
	zmq_close(t->router);
	test_pub_close(&t->pub);
}

#endif
