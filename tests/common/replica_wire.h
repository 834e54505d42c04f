/*
 * tests/common/replica_wire.h - replica sync messages written by hand (sync/replica_msg.h), for
 * the tests that deliver a peer's words without a peer.
 */
#ifndef KVR_TESTS_COMMON_REPLICA_WIRE_H
#define KVR_TESTS_COMMON_REPLICA_WIRE_H

#include "sync/replica_msg.h"

/* Appends a RANK add of worker w (dp rank 0, incarnation 1, capacity 1,000 blocks, 8,192 max
 * batched tokens) from replica `from`, life `epoch`, at stream position seq to b. */
static inline void kvr_test_put_rank(struct kvr_msg_buf *b, uint64_t from, uint64_t epoch,
                                     uint64_t seq, uint64_t w)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_RANK, from, epoch, seq);
	kvr_msg_put_u32(b, 1); /* add */
	kvr_msg_put_u32(b, 8192);
	kvr_msg_put_u64(b, w);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u64(b, 1);
	kvr_msg_put_u64(b, 1000);
	kvr_msg_end(b, off);
}

/* Appends a RANK message (op: KVR_REPL_RANK_*) of worker w (dp rank 0, 8,192 max batched
 * tokens) with incarnation inc and capacity cap from replica `from`, life `epoch`, at stream
 * position seq to b. */
static inline void kvr_test_put_rank_op(struct kvr_msg_buf *b, uint64_t from, uint64_t epoch,
                                        uint64_t seq, uint32_t op, uint64_t w, uint64_t inc,
                                        uint64_t cap)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_RANK, from, epoch, seq);
	kvr_msg_put_u32(b, op);
	kvr_msg_put_u32(b, 8192);
	kvr_msg_put_u64(b, w);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u64(b, inc);
	kvr_msg_put_u64(b, cap);
	kvr_msg_end(b, off);
}

/* The same, versioned (sync/replica_msg.h, RANK flags): the change's version is (clock,
 * writer). */
static inline void kvr_test_put_rank_ver(struct kvr_msg_buf *b, uint64_t from, uint64_t epoch,
                                         uint64_t seq, uint32_t op, uint64_t w, uint64_t inc,
                                         uint64_t cap, uint64_t clock, uint64_t writer)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_RANK, from, epoch, seq);
	kvr_msg_put_u32(b, op);
	kvr_msg_put_u32(b, 8192);
	kvr_msg_put_u64(b, w);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u32(b, KVR_MSG_RANK_VERSIONED);
	kvr_msg_put_u64(b, inc);
	kvr_msg_put_u64(b, cap);
	kvr_msg_put_u64(b, clock);
	kvr_msg_put_u64(b, writer);
	kvr_msg_end(b, off);
}

/* Appends an ADMIT or a live ATTEMPT (type) from replica `from`, life `epoch`, at stream position
 * seq to b: origin attempt id `attempt` on worker w (dp rank 0, incarnation inc), four blocks
 * given as hashes (an unknown chain: seed x 1000 + 1..4) of a prompt of four blocks of bs
 * tokens, 64 expected output tokens. */
static inline void kvr_test_put_attempt(struct kvr_msg_buf *b, unsigned type, uint64_t from,
                                        uint64_t epoch, uint64_t seq, uint64_t attempt, uint64_t w,
                                        uint64_t inc, uint64_t seed, uint32_t bs)
{
	size_t off = kvr_msg_begin(b, type, from, epoch, seq);
	kvr_msg_put_u64(b, w);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u32(b, 0); /* flags */
	kvr_msg_put_u64(b, inc);
	kvr_msg_put_u64(b, attempt);
	kvr_msg_put_u64(b, 4ull * bs); /* prompt tokens */
	kvr_msg_put_u64(b, 0);         /* lora seed */
	kvr_msg_put_u32(b, 0);         /* overlap */
	kvr_msg_put_u32(b, 64);        /* expected output */
	kvr_msg_put_u32(b, 4);         /* blocks */
	kvr_msg_put_u32(b, 0);         /* tail */
	kvr_msg_put_u32(b, 0);         /* output */
	kvr_msg_put_u32(b, 0);
	for (uint64_t i = 0; i < 4; i++)
		kvr_msg_put_u64(b, seed * 1000 + i + 1);
	kvr_msg_end(b, off);
}

/* Appends a snapshot's FENCE record (provider `from`, life `epoch`) to b: origin id is at
 * (life ep, stream position sq). */
static inline void kvr_test_put_fence(struct kvr_msg_buf *b, uint64_t from, uint64_t epoch,
                                      uint64_t id, uint64_t ep, uint64_t sq)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_FENCE, from, epoch, 0);
	kvr_msg_put_u64(b, id);
	kvr_msg_put_u64(b, ep);
	kvr_msg_put_u64(b, sq);
	kvr_msg_end(b, off);
}

/* Appends a snapshot chunk from `from` (life `epoch`) to b: number `chunk`, flags
 * (KVR_MSG_CHUNK_*), then n records, recs (each a u32 length and the record), if any. */
static inline void kvr_test_put_chunk(struct kvr_msg_buf *b, uint64_t from, uint64_t epoch,
                                      uint32_t chunk, uint32_t flags,
                                      const struct kvr_msg_buf *recs, uint32_t n)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_SNAP_CHUNK, from, epoch, 0);
	kvr_msg_put_u32(b, chunk);
	kvr_msg_put_u32(b, flags);
	kvr_msg_put_u32(b, n);
	kvr_msg_put_u32(b, 0);
	if (recs)
		kvr_msg_put_bytes(b, recs->p, recs->len);
	kvr_msg_end(b, off);
}

/* Appends record rec to recs as a snapshot chunk carries it (its length, then it). */
static inline void kvr_test_put_record(struct kvr_msg_buf *recs, const struct kvr_msg_buf *rec)
{
	kvr_msg_put_u32(recs, (uint32_t)rec->len);
	kvr_msg_put_bytes(recs, rec->p, rec->len);
}

#endif
