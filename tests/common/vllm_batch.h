/*
 * tests/common/vllm_batch.h - an empty vLLM KV event batch and its three ZeroMQ frames (topic,
 * 8-byte big-endian seq, msgpack payload), without Criterion: the feed's unit tests reach it
 * through feed_pub.h, the feed's stress tests (no Criterion under TSan) directly.
 */
#ifndef KVR_TESTS_COMMON_VLLM_BATCH_H
#define KVR_TESTS_COMMON_VLLM_BATCH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <zmq.h>

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

#endif
