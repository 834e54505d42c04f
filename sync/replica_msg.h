/*
 * sync/replica_msg.h - the wire format of router replica sync (issue 14): a compact, versioned,
 * fixed little-endian layout.  Why not msgpack: every field is a fixed-width integer or an
 * array of them, the hot message (an admission) is mostly an array of u64 hashes, and a fixed
 * layout decodes with bounds checks and memcpy only: no allocation, no recursion, no schema
 * drift between peers.  The version byte is the compatibility switch: a peer drops (and counts)
 * any message whose version it does not know.
 *
 * Versions.  1: one message per transport message.  2 (this build): a transport message on the
 * stream carries one or more whole messages back to back, each framed by its own header
 * (body_len), in stream order: the sender publishes every message of a burst of notes at once,
 * so the server, the receiving library and the apply side pay their per-message costs
 * (syscalls, wake-ups, allocations) once per burst; a receiver checks that every message of a
 * batch decodes before it applies any (kvr_msg_batch_check), and drops the whole transport
 * message otherwise.  Snapshot requests and chunks stay one per transport message.  Version 1
 * messages are dropped and counted like any unknown version (a cluster upgrades all at once).
 * Within version 2, OUTPUT's flags (bit0 not final) and ATTEMPT's flag bit3 (out counted) came
 * later (kvr_request_output_ex): they take a field that had to be 0 (OUTPUT's reserved word) and
 * a bit that had to be 0, so a newer decoder reads every older message as before (flag clear:
 * the last token held back), and an older one drops (and counts) only a message that sets them.
 *
 * Every message starts with this 32-byte header:
 *     off size field
 *       0    2 magic     0x534b ("KS" little-endian)
 *       2    1 version   KVR_MSG_VERSION (2)
 *       3    1 type      enum kvr_msg_type
 *       4    4 body_len  bytes after the header (the message is exactly 32 + body_len bytes)
 *       8    8 replica   the sender's replica id (nonzero)
 *      16    8 epoch     the sender's life (nonzero; a restart with the same id changes it)
 *      24    8 seq       the sender's message number in this epoch (1, 2, ...) for stream
 *                        messages; for HEARTBEAT the last stream seq sent; else 0
 * Bodies (all integers little-endian; arrays packed, no padding between fields):
 *   ADMIT / ATTEMPT (an admission; ATTEMPT is a whole attempt's state in a snapshot or a resync):
 *       0  8 worker_id      8 4 dp_rank       12 4 flags (bit0 chain_known, bit1 prefill done,
 *      16  8 incarnation   24 8 attempt                   bit2 finished: replay and release,
 *                                                         bit3 out counted: the last of the
 *                                                         n_out tokens came as not final, its
 *                                                         slot is counted; only with n_out > 0)
 *      32  8 prompt_tokens 40 8 lora_seed
 *      48  4 overlap       52 4 expected_output
 *      56  4 n_blocks      60 4 tail_n (< 65536)   64 4 n_out (ADMIT: 0)   68 4 reserved (0)
 *      72  then n_blocks u64 local hashes, tail_n u32 tail tokens, n_out u32 output tokens
 *   OUTPUT:      0 8 attempt  8 4 n_tokens  12 4 flags   16 then n_tokens u32 tokens
 *                flags bit0 not final: the last token is known not to be the request's final
 *                one (kvr_request_output_ex without KVR_OUTPUT_FINAL): the origin counted its
 *                KV slot at once, and so does the receiver; clear (kvr_request_output, or the
 *                final token): it is held back until a later one comes.  Only with n_tokens > 0.
 *   PREFILL_DONE, FINISH, ABORT:   0 8 attempt
 *   RANK:        0 4 op (1 add, 2 remove, 3 capacity, 4 reset)  4 4 max_batched_tokens
 *                8 8 worker_id  16 4 dp_rank  20 4 flags  24 8 incarnation  32 8 capacity
 *                flags bit0 versioned (KVR_MSG_RANK_VERSIONED): 16 more bytes follow,
 *                40 8 clock  48 8 writer: the change's version, (clock, writer replica id),
 *                compared clock first, then writer; both nonzero, the clock at most
 *                2^63 - 1 (and a receiver refuses one over an hour ahead of its wall clock:
 *                sync/replica_ranks.c, "A clock far ahead").  Without it (the body is
 *                exactly 40 bytes) the message is unversioned, as every RANK was before.
 *                Why versions: a rank's state is a register several replicas write (any may
 *                add, remove or reset a rank), and what a replica tells again (its
 *                re-announce after an outage, a snapshot it serves) may be older than what
 *                the receiver holds: a removal it missed while cut off, a removal its stream
 *                had not reached when it served.  Without an order, a stale add and a real
 *                re-add read alike and the removed rank came back; with one, the receiver
 *                keeps the newer (last writer wins; sync/replica_ranks.c).  The flag took a
 *                field that had to be 0 (as OUTPUT's flags did): a newer decoder reads an
 *                older message as unversioned, and an older one drops (and counts) a
 *                versioned one (with the batch it came in), like any message it cannot read.
 *   HEARTBEAT:   0 8 live attempts of the sender
 *   GOODBYE, RESET (the sender forgets everything peers hold from it; ATTEMPTs follow):  empty
 *   SNAP_REQ:    0 8 target replica.  Sent to the snapshot subject (a queue group, with a reply
 *                inbox): asks for a snapshot, the field then flags: bit0
 *                (KVR_MSG_SNAP_ASKER_SERVES) the asker serves snapshots itself (it resyncs
 *                after a reconnect, not at its join); older askers send 0, which a provider
 *                reads as a joiner's (sync/replica_snap.c, "Serving while resyncing").  Bit1
 *                (KVR_MSG_SNAP_SETTLED_ONLY, with bit0): the asker wants a table from a
 *                replica that is not resyncing itself; one that is declines it (a given-up
 *                chunk with KVR_MSG_CHUNK_RESYNCING) instead of serving its table from before
 *                its own resync.  Clear (older askers, or an asker that every peer declined
 *                so), a provider serves what it has.  An older provider ignores the bit (it
 *                read the field as flags, bit0 alone) and serves at once, as before.  Sent on
 *                the stream: asks replica
 *                `target` to send RESET and its live attempts again (it was thought gone, or
 *                messages were lost), plus the attempts it finished in the last `seq` ms.
 *   SNAP_CHUNK:  0 4 chunk index  4 4 flags (bit0 last, bit1 given up)  8 4 n_records
 *                12 4 reserved  16 then n_records x { 4 len, len bytes: one whole message of
 *                type ADMIT, ATTEMPT, RANK or FENCE }.  Given up (KVR_MSG_CHUNK_GIVEN_UP): the
 *                provider could not build the snapshot whole (no memory), or declines a
 *                joiner while it resyncs itself, and sends no more; no records, not last; the
 *                asker asks again.  Flags bit3 resyncing (KVR_MSG_CHUNK_RESYNCING), only with
 *                given up: the provider declines because it resyncs itself, and was asked
 *                with KVR_MSG_SNAP_SETTLED_ONLY (so only by an asker that reads the bit: an
 *                older one is never sent it).  Flags bit2 floor
 *                (KVR_MSG_CHUNK_FLOOR): 16 more bytes follow the fixed part, before the
 *                records, 16 8 clock  24 8 writer: the provider's rank floor, the newest
 *                removal whose tombstone it has forgotten (sync/replica_ranks.c, "Forgetting"),
 *                a version as a RANK's (both nonzero, the clock at most 2^63 - 1); on the
 *                last chunk alone (malformed elsewhere), never with given up.  Sent only by a
 *                provider that forgot one, so a snapshot of a cluster that forgot nothing reads
 *                as before; an older asker drops a chunk that carries it (the flag took bits
 *                that had to be 0) and goes on without the snapshot, as when none came.
 *   FENCE:       0 8 replica  8 8 epoch  16 8 seq   (the snapshot includes that origin's
 *                stream up to seq; the receiver applies only later messages of that origin)
 * A decoder accepts a message only if every length adds up exactly; anything else is an error
 * and nothing of the message is applied.
 */
#ifndef KVR_SYNC_REPLICA_MSG_H
#define KVR_SYNC_REPLICA_MSG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVR_MSG_MAGIC      0x534bu
#define KVR_MSG_VERSION    2u
#define KVR_MSG_HEADER     32u
#define KVR_MSG_MAX_BLOCKS (1u << 24)
#define KVR_MSG_MAX_TAIL   65535u
/* The fixed part of a body before its arrays: ADMIT / ATTEMPT, OUTPUT. */
#define KVR_MSG_ADMIT_FIXED  72u
#define KVR_MSG_OUTPUT_FIXED 16u

enum kvr_msg_type {
	KVR_MSG_ADMIT = 1,
	KVR_MSG_OUTPUT = 2,
	KVR_MSG_PREFILL_DONE = 3,
	KVR_MSG_FINISH = 4,
	KVR_MSG_ABORT = 5,
	KVR_MSG_RANK = 6,
	KVR_MSG_HEARTBEAT = 7,
	KVR_MSG_GOODBYE = 8,
	KVR_MSG_RESET = 9,
	KVR_MSG_SNAP_REQ = 10,
	KVR_MSG_SNAP_CHUNK = 11,
	KVR_MSG_ATTEMPT = 12,
	KVR_MSG_FENCE = 13,
};

/* SNAP_REQ flags (a snapshot request's). */
#define KVR_MSG_SNAP_ASKER_SERVES 1u
#define KVR_MSG_SNAP_SETTLED_ONLY 2u

/* SNAP_CHUNK flags. */
#define KVR_MSG_CHUNK_LAST      1u
#define KVR_MSG_CHUNK_GIVEN_UP  2u
#define KVR_MSG_CHUNK_FLOOR     4u
#define KVR_MSG_CHUNK_RESYNCING 8u

#define KVR_MSG_F_CHAIN_KNOWN 1u
#define KVR_MSG_F_PREFILLED   2u
#define KVR_MSG_F_FINISHED    4u
#define KVR_MSG_F_OUT_COUNTED 8u

/* OUTPUT flags */
#define KVR_MSG_OUT_NOT_FINAL 1u

/* RANK flags */
#define KVR_MSG_RANK_VERSIONED 1u

struct kvr_msg_header {
	uint8_t version, type;
	uint32_t body_len;
	uint64_t replica, epoch, seq;
};

/* A decoded message.  Array pointers point INTO the buffer given to kvr_msg_decode (borrowed,
 * unaligned: read them with kvr_msg_u64 / kvr_msg_u32). */
struct kvr_wmsg {
	struct kvr_msg_header h;
	/* ADMIT / ATTEMPT */
	uint64_t worker_id;
	uint32_t dp_rank, flags;
	uint64_t incarnation, attempt, prompt_tokens, lora_seed;
	uint32_t overlap, expected_output, n_blocks, tail_n, n_out;
	const uint8_t *blocks, *tail, *out; /* u64 x n_blocks, u32 x tail_n, u32 x n_out */
	/* OUTPUT: attempt, n_out/out, flags (KVR_MSG_OUT_*).  PREFILL_DONE, FINISH, ABORT:
	 * attempt. */
	/* RANK; rank_clock and rank_writer are 0 in an unversioned one */
	uint32_t op, max_batched_tokens;
	uint64_t capacity, rank_clock, rank_writer;
	/* HEARTBEAT */
	uint64_t live;
	/* SNAP_REQ: target; FENCE: fence_replica/epoch/seq */
	uint64_t target, fence_replica, fence_epoch, fence_seq;
	/* SNAP_CHUNK; floor_clock and floor_writer are 0 without KVR_MSG_CHUNK_FLOOR */
	uint32_t chunk, chunk_flags, n_records;
	uint64_t floor_clock, floor_writer;
	const uint8_t *records;
	size_t records_len;
};

/*
 * Decodes one message of exactly len bytes.  Returns 0 and *m, or a negative error:
 * KVR_EINVAL (garbage: bad magic, unknown type, lengths that do not add up, a zero replica id or
 * epoch, out-of-range counts), KVR_ERANGE (a version this build does not know), KVR_ENOENT
 * (truncated: shorter than its own header says).  Nothing is allocated; m borrows buf.
 * SNAP_CHUNK records are checked for framing (each length within the chunk, each record a
 * decodable message of an allowed type) but returned undecoded: iterate with
 * kvr_msg_next_record.  Context: any thread; pure.
 */
int kvr_msg_decode(const void *buf, size_t len, struct kvr_wmsg *m);

/*
 * Iterates the messages of a batch (a stream transport message, version 2): *pos starts at 0;
 * returns 1 and the next message decoded into *m (its bytes: buf + *pos before the call, *len
 * bytes), 0 at the end, or the decoding error of the next message (framing: a header that says
 * more bytes than are left is KVR_ENOENT).  Context: any thread; pure.
 */
int kvr_msg_batch_next(const void *buf, size_t len, size_t *pos, struct kvr_wmsg *m);

/*
 * Checks a whole batch: 0 and *count (>= 1) when every message in it decodes and they fill the
 * buffer exactly, else the first error (KVR_EINVAL for an empty buffer).  A receiver applies a
 * batch only after this accepted it, so a bad message never leaves a batch half applied.
 * Context: any thread; pure.
 */
int kvr_msg_batch_check(const void *buf, size_t len, size_t *count);

/* Iterates a decoded SNAP_CHUNK's records: *pos starts at 0; returns 1 with rec/rec_len set,
 * 0 at the end.  Only call on a chunk kvr_msg_decode accepted.  Context: any thread. */
int kvr_msg_next_record(const struct kvr_wmsg *chunk, size_t *pos, const uint8_t **rec,
                        size_t *rec_len);

static inline uint64_t kvr_msg_u64(const uint8_t *p, size_t i)
{
	uint64_t v = 0;
	for (int k = 7; k >= 0; k--)
		v = v << 8 | p[i * 8 + (size_t)k];
	return v;
}

static inline uint32_t kvr_msg_u32(const uint8_t *p, size_t i)
{
	return (uint32_t)p[i * 4] | (uint32_t)p[i * 4 + 1] << 8 | (uint32_t)p[i * 4 + 2] << 16 |
	       (uint32_t)p[i * 4 + 3] << 24;
}

/* ---------------------------------------------------------------- encoding */

/* A growable output buffer (kvr_alloc).  Context: the owner's thread. */
struct kvr_msg_buf {
	uint8_t *p;
	size_t len, cap;
	bool oom; /* an allocation failed: the content is incomplete, do not send */
};

void kvr_msg_buf_fini(struct kvr_msg_buf *b);
/* Starts a message at the end of b (a header with body_len 0); returns its offset. */
size_t kvr_msg_begin(struct kvr_msg_buf *b, unsigned type, uint64_t replica, uint64_t epoch,
                     uint64_t seq);
/* Patches the header's body_len of the message started at off. */
void kvr_msg_end(struct kvr_msg_buf *b, size_t off);
void kvr_msg_put_u32(struct kvr_msg_buf *b, uint32_t v);
void kvr_msg_put_u64(struct kvr_msg_buf *b, uint64_t v);
void kvr_msg_put_u64s(struct kvr_msg_buf *b, const uint64_t *v, size_t n);
void kvr_msg_put_u32s(struct kvr_msg_buf *b, const uint32_t *v, size_t n);
void kvr_msg_put_bytes(struct kvr_msg_buf *b, const void *v, size_t n);

#endif
