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

#endif
