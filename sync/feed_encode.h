/*
 * sync/feed_encode.h - vLLM KV event batches as a vLLM publisher sends them, for the programs
 * that play one: perf/bench_feed and kvr-replay's events_feed policy.
 *
 * vLLM's current form (vllm/distributed/kv_events.py, msgspec with map encoding):
 *   payload {ts: float64, events: [{type: "BlockStored", block_hashes, parent_block_hash,
 *            token_ids, block_size, lora_id, medium, lora_name} | {type: "BlockRemoved",
 *            block_hashes, medium} | {type: "AllBlocksCleared"}], data_parallel_rank}
 *   frames  [topic, seq (8 bytes big-endian), payload]
 * Header-only on purpose: the library decodes (sync/feed_decode.c, its own msgpack reader) and
 * never encodes, so msgpack-c stays a dependency of these programs only.
 *
 * Use: kvr_fenc_begin, one kvr_fenc_stored / _removed / _cleared per event (as many as begin
 * announced), kvr_fenc_end, then kvr_fenc_send.  Context: any thread; one encoder per thread.
 */
#ifndef KVR_SYNC_FEED_ENCODE_H
#define KVR_SYNC_FEED_ENCODE_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <zmq.h>

struct kvr_fenc {
	msgpack_sbuffer sb; /* the payload after kvr_fenc_end */
	msgpack_packer pk;
};

static inline void kvr_fenc_init(struct kvr_fenc *e)
{
	msgpack_sbuffer_init(&e->sb);
	msgpack_packer_init(&e->pk, &e->sb, msgpack_sbuffer_write);
}

static inline void kvr_fenc_fini(struct kvr_fenc *e)
{
	msgpack_sbuffer_destroy(&e->sb);
}

static inline void kvr_fenc_str(struct kvr_fenc *e, const char *s)
{
	msgpack_pack_str(&e->pk, strlen(s));
	msgpack_pack_str_body(&e->pk, s, strlen(s));
}

/* Starts a batch stamped ts (seconds since the epoch, the publisher's wall clock) that will
 * hold n_events events. */
static inline void kvr_fenc_begin(struct kvr_fenc *e, double ts, size_t n_events)
{
	msgpack_sbuffer_clear(&e->sb);
	msgpack_pack_map(&e->pk, 3);
	kvr_fenc_str(e, "ts");
	msgpack_pack_double(&e->pk, ts);
	kvr_fenc_str(e, "events");
	msgpack_pack_array(&e->pk, n_events);
}

/* A BlockStored of n blocks (hashes as uint64) on medium ("GPU", "CPU", ...), parent NULL for
 * a root chain; the tokens of block i (bs of them) are tokens(ctx, i). */
static inline void kvr_fenc_stored_on(struct kvr_fenc *e, const char *medium,
                                      const uint64_t *hashes, size_t n, const uint64_t *parent,
                                      uint32_t bs, const uint32_t *(*tokens)(void *ctx, size_t i),
                                      void *ctx)
{
	msgpack_packer *pk = &e->pk;
	msgpack_pack_map(pk, 8);
	kvr_fenc_str(e, "type");
	kvr_fenc_str(e, "BlockStored");
	kvr_fenc_str(e, "block_hashes");
	msgpack_pack_array(pk, n);
	for (size_t i = 0; i < n; i++)
		msgpack_pack_uint64(pk, hashes[i]);
	kvr_fenc_str(e, "parent_block_hash");
	if (parent)
		msgpack_pack_uint64(pk, *parent);
	else
		msgpack_pack_nil(pk);
	kvr_fenc_str(e, "token_ids");
	msgpack_pack_array(pk, n * bs);
	for (size_t i = 0; i < n; i++) {
		const uint32_t *tok = tokens(ctx, i);
		for (uint32_t j = 0; j < bs; j++)
			msgpack_pack_uint32(pk, tok[j]);
	}
	kvr_fenc_str(e, "block_size");
	msgpack_pack_uint32(pk, bs);
	kvr_fenc_str(e, "lora_id");
	msgpack_pack_nil(pk);
	kvr_fenc_str(e, "medium");
	kvr_fenc_str(e, medium);
	kvr_fenc_str(e, "lora_name");
	msgpack_pack_nil(pk);
}

/* A GPU BlockStored (kvr_fenc_stored_on). */
static inline void kvr_fenc_stored(struct kvr_fenc *e, const uint64_t *hashes, size_t n,
                                   const uint64_t *parent, uint32_t bs,
                                   const uint32_t *(*tokens)(void *ctx, size_t i), void *ctx)
{
	kvr_fenc_stored_on(e, "GPU", hashes, n, parent, bs, tokens, ctx);
}

/* A GPU BlockRemoved of n hashes (one copy each). */
static inline void kvr_fenc_removed(struct kvr_fenc *e, const uint64_t *hashes, size_t n)
{
	msgpack_pack_map(&e->pk, 3);
	kvr_fenc_str(e, "type");
	kvr_fenc_str(e, "BlockRemoved");
	kvr_fenc_str(e, "block_hashes");
	msgpack_pack_array(&e->pk, n);
	for (size_t i = 0; i < n; i++)
		msgpack_pack_uint64(&e->pk, hashes[i]);
	kvr_fenc_str(e, "medium");
	kvr_fenc_str(e, "GPU");
}

static inline void kvr_fenc_cleared(struct kvr_fenc *e)
{
	msgpack_pack_map(&e->pk, 1);
	kvr_fenc_str(e, "type");
	kvr_fenc_str(e, "AllBlocksCleared");
}

static inline void kvr_fenc_end(struct kvr_fenc *e, int dp_rank)
{
	kvr_fenc_str(e, "data_parallel_rank");
	msgpack_pack_int(&e->pk, dp_rank);
}

/* Sends [topic "", seq, payload] (len bytes at data) on a PUB/XPUB socket.  Returns 0, or -1
 * as zmq_send does (zmq_errno() says why). */
static inline int kvr_fenc_send(void *sock, uint64_t seq, const void *data, size_t len)
{
	uint8_t s[8];
	for (int i = 0; i < 8; i++)
		s[i] = (uint8_t)(seq >> (56 - 8 * i));
	if (zmq_send(sock, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(sock, s, 8, ZMQ_SNDMORE) < 0 ||
	    zmq_send(sock, data, len, 0) < 0)
		return -1;
	return 0;
}

#endif
