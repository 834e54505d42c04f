/*
 * sync/feed_decode.h - decodes one vLLM KV event batch (the msgpack payload frame of
 * vllm/distributed/kv_events.py) into flat arrays, before anything is applied.
 *
 * Accepted forms (see sync/feed_decode.c for the field by field rules):
 *   batch:  [ts, events] | [ts, events, data_parallel_rank] | {ts, events, data_parallel_rank}
 *   event:  tagged map {"type": "BlockStored", ...} (key order free, unknown keys ignored) or
 *           tagged array ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
 *           lora_id, medium, lora_name, ...] / ["BlockRemoved", block_hashes, medium, ...] /
 *           ["AllBlocksCleared", ...] (by position, with length guards).
 *   hash:   msgpack int (uint64 incl. >= 2^63, or negative int64 taken as its two's complement)
 *           or bin (a sha256 / xxh3_128 digest): folded to its LAST 8 bytes read big-endian,
 *           i.e. int.from_bytes(digest, "big") & (2^64 - 1) - the same value vLLM publishes
 *           for that block with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
 */
#ifndef KVR_SYNC_FEED_DECODE_H
#define KVR_SYNC_FEED_DECODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvr_fev_type {
	KVR_FEV_STORED = 0,
	KVR_FEV_REMOVED = 1,
	KVR_FEV_CLEARED = 2,
	KVR_FEV_UNKNOWN = 3, /* a well-formed event of a type we do not know: skipped, counted */
};

/* One decoded event; arrays are offsets into the batch's flat arrays. */
struct kvr_fev {
	uint8_t type;        /* enum kvr_fev_type */
	bool has_parent;     /* stored: parent_block_hash was not nil */
	bool gpu;            /* medium nil, absent or "GPU" */
	bool has_block_size; /* stored: block_size present */
	uint32_t block_size;
	uint64_t parent;
	uint32_t hash_off, n_hashes; /* batch->hashes[hash_off ..] */
	uint32_t tok_off, n_tokens;  /* batch->tokens[tok_off ..] */
	int32_t lora_off;            /* batch->strs + lora_off (NUL-terminated), or -1: none */
	bool has_lora_id;            /* lora_id present and not nil (deprecated by vLLM) */
	uint64_t lora_id;            /* as two's complement when negative */
};

/* A decoded batch.  The arrays are reused from one decode to the next (grown, never shrunk). */
struct kvr_feed_batch {
	double ts;          /* publisher's wall clock, seconds since the epoch */
	bool has_dp;        /* data_parallel_rank present and not nil */
	uint32_t dp;        /* data_parallel_rank */
	uint32_t n_unknown; /* events of unknown type skipped */
	struct kvr_fev *ev;
	uint32_t n_ev, cap_ev;
	uint64_t *hashes;
	uint32_t n_hashes, cap_hashes;
	uint32_t *tokens;
	uint32_t n_tokens, cap_tokens;
	char *strs;
	uint32_t n_strs, cap_strs;
};

/*
 * Decodes payload[0..len) into *b (previous contents dropped).  All or nothing: on error *b
 * holds no event (n_ev = 0).  Returns 0, KVR_EINVAL (malformed: truncated, wrong type, out of
 * range value, trailing bytes) or KVR_ENOMEM.
 * Context: any thread; b is owned by the caller (one per thread).
 */
int kvr_feed_decode(struct kvr_feed_batch *b, const void *payload, size_t len);

/* Frees the batch's arrays; the batch can be decoded into again.  Context: its owner. */
void kvr_feed_batch_fini(struct kvr_feed_batch *b);

/* Grows *arr (of *cap items of item bytes, kvr_alloc'd) to hold need items, doubling.  Returns
 * 0, KVR_ERANGE (need above UINT32_MAX / 2) or KVR_ENOMEM (*arr unchanged either way).  The
 * decoder's and the feed's arrays all grow this way.  Context: any thread, on its own array. */
int kvr_feed_grow(void **arr, uint32_t *cap, uint64_t need, size_t item);

#endif /* KVR_SYNC_FEED_DECODE_H */
