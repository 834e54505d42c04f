/* libFuzzer target: the replica sync wire decoder (sync/replica_msg.c), network input: one
 * message, and a batch of them (wire version 2).
 * Properties: never crashes or reads out of bounds; an accepted message's arrays lie inside the
 * buffer; every record of an accepted SNAP_CHUNK decodes on its own; re-encoding an accepted
 * ADMIT/ATTEMPT or OUTPUT (with its flags) with the encoder gives back the same bytes. */
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "sync/replica_msg.h"

static void check_inside(const uint8_t *buf, size_t len, const uint8_t *p, size_t n)
{
	if (n && (p < buf || p + n > buf + len))
		abort();
}

/* A batch (wire version 2): accepted only when every message in it decodes and they fill the
 * buffer; each message the iterator returns then decodes on its own from its own bytes, and a
 * single accepted message is a batch of one. */
static void check_batch(const uint8_t *data, size_t size)
{
	size_t n = 0, pos = 0, k = 0;
	int rc = kvr_msg_batch_check(data, size, &n);
	struct kvr_wmsg m, one;
	if (rc != 0) {
		if (rc > 0)
			abort();
		return;
	}
	if (n < 1)
		abort();
	for (;;) {
		size_t at = pos;
		int r = kvr_msg_batch_next(data, size, &pos, &m);
		if (r == 0)
			break;
		if (r != 1 || pos <= at || pos > size)
			abort();
		if (kvr_msg_decode(data + at, pos - at, &one) != 0 || one.h.type != m.h.type ||
		    one.h.seq != m.h.seq)
			abort();
		k++;
	}
	if (k != n || pos != size)
		abort();
}

/* Ends the message re-encoded in b from off and checks it is the input, byte for byte (unless
 * the encoder ran out of memory); frees b. */
static void same_bytes(struct kvr_msg_buf *b, size_t off, const uint8_t *data, size_t size)
{
	kvr_msg_end(b, off);
	if (!b->oom && (b->len != size || memcmp(b->p, data, size) != 0))
		abort();
	kvr_msg_buf_fini(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kvr_wmsg m;
	check_batch(data, size);
	if (kvr_msg_decode(data, size, &m) != 0)
		return 0;
	size_t n = 0;
	if (kvr_msg_batch_check(data, size, &n) != 0 || n != 1)
		abort(); /* one message is a batch of one */
	switch (m.h.type) {
	case KVR_MSG_ADMIT:
	case KVR_MSG_ATTEMPT: {
		check_inside(data, size, m.blocks, (size_t)m.n_blocks * 8);
		check_inside(data, size, m.tail, (size_t)m.tail_n * 4);
		check_inside(data, size, m.out, (size_t)m.n_out * 4);
		struct kvr_msg_buf b = {0};
		size_t off = kvr_msg_begin(&b, m.h.type, m.h.replica, m.h.epoch, m.h.seq);
		kvr_msg_put_u64(&b, m.worker_id);
		kvr_msg_put_u32(&b, m.dp_rank);
		kvr_msg_put_u32(&b, m.flags);
		kvr_msg_put_u64(&b, m.incarnation);
		kvr_msg_put_u64(&b, m.attempt);
		kvr_msg_put_u64(&b, m.prompt_tokens);
		kvr_msg_put_u64(&b, m.lora_seed);
		kvr_msg_put_u32(&b, m.overlap);
		kvr_msg_put_u32(&b, m.expected_output);
		kvr_msg_put_u32(&b, m.n_blocks);
		kvr_msg_put_u32(&b, m.tail_n);
		kvr_msg_put_u32(&b, m.n_out);
		kvr_msg_put_u32(&b, 0);
		kvr_msg_put_bytes(&b, m.blocks,
		                  (size_t)m.n_blocks * 8 + (size_t)m.tail_n * 4 +
		                      (size_t)m.n_out * 4);
		same_bytes(&b, off, data, size);
		break;
	}
	case KVR_MSG_OUTPUT: {
		check_inside(data, size, m.out, (size_t)m.n_out * 4);
		if (m.flags & ~KVR_MSG_OUT_NOT_FINAL || (m.flags && !m.n_out))
			abort(); /* unknown flags, or "not final" with no token, are refused */
		struct kvr_msg_buf b = {0};
		size_t off = kvr_msg_begin(&b, m.h.type, m.h.replica, m.h.epoch, m.h.seq);
		kvr_msg_put_u64(&b, m.attempt);
		kvr_msg_put_u32(&b, m.n_out);
		kvr_msg_put_u32(&b, m.flags);
		kvr_msg_put_bytes(&b, m.out, (size_t)m.n_out * 4);
		same_bytes(&b, off, data, size);
		break;
	}
	case KVR_MSG_SNAP_CHUNK: {
		size_t pos = 0, rl, n = 0;
		const uint8_t *rp;
		while (kvr_msg_next_record(&m, &pos, &rp, &rl)) {
			struct kvr_wmsg r;
			check_inside(data, size, rp, rl);
			if (kvr_msg_decode(rp, rl, &r) != 0)
				abort(); /* the chunk was accepted: every record must be */
			n++;
		}
		if (n != m.n_records)
			abort();
		break;
	}
	default:
		break;
	}
	return 0;
}
