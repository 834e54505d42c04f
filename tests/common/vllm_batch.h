/*
 * tests/common/vllm_batch.h - an empty vLLM KV event batch and its three ZeroMQ frames (topic,
 * 8-byte big-endian seq, msgpack payload), without Criterion: the feed's unit tests reach it
 * through feed_pub.h, the feed's stress tests (no Criterion under TSan) directly.  Also the
 * publisher's socket and a feed subscribed to it.
 */
#ifndef KVR_TESTS_COMMON_VLLM_BATCH_H
#define KVR_TESTS_COMMON_VLLM_BATCH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"

/* {"ts": 1.0, "events": [], "data_parallel_rank": dp} into body[64]; returns its length. */
static inline size_t test_pub_empty_batch(uint8_t *body, uint32_t dp)
{
	static const uint8_t head[] = {0x83, 0xa2, 't', 's', 0xcb, 0x3f, 0xf0, 0,   0,    0,   0, 0,
	                               0,    0xa6, 'e', 'v', 'e',  'n',  't',  's', 0x90, 0xb2};
	size_t n = sizeof(head);
	memcpy(body, head, n);
	memcpy(body + n, "data_parallel_rank", 18);
	n += 18;
	body[n++] = 0xce; /* uint32 */
	for (int i = 3; i >= 0; i--)
		body[n++] = (uint8_t)(dp >> (8 * i));
	return n;
}

/* Sends the batch's three frames on pub; 0, or -1 if a frame was not sent whole. */
static inline int test_batch_send(void *pub, uint64_t seq, const uint8_t *body, size_t n)
{
	uint8_t s[8];
	for (int i = 0; i < 8; i++)
		s[i] = (uint8_t)(seq >> (56 - 8 * i));
	return zmq_send(pub, "", 0, ZMQ_SNDMORE) == 0 && zmq_send(pub, s, 8, ZMQ_SNDMORE) == 8 &&
	               zmq_send(pub, body, n, 0) == (int)n
	           ? 0
	           : -1;
}

/* An empty batch for dp rank 0. */
static inline int test_batch_send_empty(void *pub, uint64_t seq)
{
	uint8_t body[64];
	return test_batch_send(pub, seq, body, test_pub_empty_batch(body, 0));
}

/* An XPUB bound to a free local port, its endpoint in ep[cap], with no send high-water mark
 * (every batch must reach the feed; XPUB: the feed's subscription can be awaited).  0, or -1. */
static inline int test_xpub_open(void *zctx, void **pub, char *ep, size_t cap)
{
	*pub = zmq_socket(zctx, ZMQ_XPUB);
	int hwm = 0;
	if (!*pub || zmq_setsockopt(*pub, ZMQ_SNDHWM, &hwm, sizeof(hwm)) ||
	    zmq_bind(*pub, "tcp://127.0.0.1:*"))
		return -1;
	return zmq_getsockopt(*pub, ZMQ_LAST_ENDPOINT, ep, &cap) ? -1 : 0;
}

/* Tokens of 16-token blocks for kvr_fenc_stored / kvr_fenc_stored_on: block i's are derived
 * from the i-th of the hashes at ctx (the buffer is the calling thread's, valid until its next
 * call). */
#define TEST_BLOCK_TOKENS 16
static inline const uint32_t *test_block_tokens(void *ctx, size_t i)
{
	static _Thread_local uint32_t t[TEST_BLOCK_TOKENS];
	const uint64_t *h = ctx;
	for (uint32_t j = 0; j < TEST_BLOCK_TOKENS; j++)
		t[j] = (uint32_t)(h[i] * 2654435761u) + j;
	return t;
}

/* A feed on r (config fc) with the endpoint ep of worker, once subscribed to pub, so that nothing
 * sent after this returns is dropped.  0, or -1. */
static inline int test_feed_subscribed(struct kvr_router *r, const struct kvr_feed_config *fc,
                                       void *pub, const char *ep, uint64_t worker,
                                       struct kvr_feed **out, uint32_t *id_out)
{
	struct kvr_feed_endpoint fe = {.endpoint = ep, .worker_id = worker};
	uint8_t sub[64];
	if (kvr_feed_create(r, fc, out) || kvr_feed_add(*out, &fe, id_out) ||
	    zmq_recv(pub, sub, sizeof(sub), 0) < 1)
		return -1;
	return 0;
}

#endif
