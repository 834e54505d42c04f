/*
 * sync/replica_msg.c - encoder and decoder of the replica sync wire format (layout: see
 * sync/replica_msg.h).  The decoder is the one place where bytes from the network become
 * numbers, so it checks every length against the buffer before reading, never allocates, and
 * accepts a message only when the lengths add up exactly (fuzzed: tests/fuzz/fuzz_replica_msg).
 */
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/replica_msg.h"

#define RANK_FIXED  40u
#define RANK_VER    56u /* a versioned RANK: the fixed part, clock, writer */
#define CHUNK_FIXED 16u
#define FENCE_FIXED 24u

static uint64_t rd64(const uint8_t *p)
{
	return kvr_msg_u64(p, 0);
}

static uint32_t rd32(const uint8_t *p)
{
	return kvr_msg_u32(p, 0);
}

static int decode(const uint8_t *p, size_t len, struct kvr_wmsg *m, int depth)
{
	memset(m, 0, sizeof(*m));
	if (len < KVR_MSG_HEADER)
		return len >= 2 && (p[0] | p[1] << 8) != KVR_MSG_MAGIC ? KVR_EINVAL : KVR_ENOENT;
	if ((p[0] | p[1] << 8) != KVR_MSG_MAGIC)
		return KVR_EINVAL;
	m->h.version = p[2];
	m->h.type = p[3];
	m->h.body_len = rd32(p + 4);
	m->h.replica = rd64(p + 8);
	m->h.epoch = rd64(p + 16);
	m->h.seq = rd64(p + 24);
	if (m->h.version != KVR_MSG_VERSION)
		return KVR_ERANGE;
	if ((size_t)m->h.body_len > len - KVR_MSG_HEADER)
		return KVR_ENOENT; /* truncated */
	if ((size_t)m->h.body_len != len - KVR_MSG_HEADER)
		return KVR_EINVAL; /* trailing bytes */
	if (m->h.replica == 0 || m->h.epoch == 0)
		return KVR_EINVAL;
	const uint8_t *b = p + KVR_MSG_HEADER;
	size_t bl = m->h.body_len;
	switch (m->h.type) {
	case KVR_MSG_ADMIT:
	case KVR_MSG_ATTEMPT: {
		if (bl < KVR_MSG_ADMIT_FIXED)
			return KVR_EINVAL;
		m->worker_id = rd64(b);
		m->dp_rank = rd32(b + 8);
		m->flags = rd32(b + 12);
		m->incarnation = rd64(b + 16);
		m->attempt = rd64(b + 24);
		m->prompt_tokens = rd64(b + 32);
		m->lora_seed = rd64(b + 40);
		m->overlap = rd32(b + 48);
		m->expected_output = rd32(b + 52);
		m->n_blocks = rd32(b + 56);
		m->tail_n = rd32(b + 60);
		m->n_out = rd32(b + 64);
		if (rd32(b + 68) != 0 || m->flags & ~15u || m->attempt == 0)
			return KVR_EINVAL;
		if ((m->flags & KVR_MSG_F_OUT_COUNTED) && m->n_out == 0)
			return KVR_EINVAL;
		if (m->n_blocks > KVR_MSG_MAX_BLOCKS || m->tail_n > KVR_MSG_MAX_TAIL ||
		    m->n_out > KVR_MSG_MAX_BLOCKS || m->overlap > m->n_blocks)
			return KVR_EINVAL;
		if (m->h.type == KVR_MSG_ADMIT && (m->n_out || (m->flags & ~1u)))
			return KVR_EINVAL;
		if (m->tail_n && !(m->flags & KVR_MSG_F_CHAIN_KNOWN))
			return KVR_EINVAL;
		uint64_t need = KVR_MSG_ADMIT_FIXED + (uint64_t)m->n_blocks * 8 +
		                (uint64_t)m->tail_n * 4 + (uint64_t)m->n_out * 4;
		if (need != bl)
			return KVR_EINVAL;
		m->blocks = b + KVR_MSG_ADMIT_FIXED;
		m->tail = m->blocks + (size_t)m->n_blocks * 8;
		m->out = m->tail + (size_t)m->tail_n * 4;
		return 0;
	}
	case KVR_MSG_OUTPUT:
		if (bl < KVR_MSG_OUTPUT_FIXED)
			return KVR_EINVAL;
		m->attempt = rd64(b);
		m->n_out = rd32(b + 8);
		m->flags = rd32(b + 12);
		if (m->flags & ~KVR_MSG_OUT_NOT_FINAL || m->attempt == 0 ||
		    m->n_out > KVR_MSG_MAX_BLOCKS ||
		    KVR_MSG_OUTPUT_FIXED + (uint64_t)m->n_out * 4 != bl)
			return KVR_EINVAL;
		if ((m->flags & KVR_MSG_OUT_NOT_FINAL) && m->n_out == 0)
			return KVR_EINVAL;
		m->out = b + KVR_MSG_OUTPUT_FIXED;
		return 0;
	case KVR_MSG_PREFILL_DONE:
	case KVR_MSG_FINISH:
	case KVR_MSG_ABORT:
		if (bl != 8)
			return KVR_EINVAL;
		m->attempt = rd64(b);
		return m->attempt ? 0 : KVR_EINVAL;
	case KVR_MSG_RANK: {
		if (bl < RANK_FIXED)
			return KVR_EINVAL;
		uint32_t flags = rd32(b + 20);
		if (flags & ~KVR_MSG_RANK_VERSIONED ||
		    bl != (flags & KVR_MSG_RANK_VERSIONED ? RANK_VER : RANK_FIXED))
			return KVR_EINVAL;
		m->op = rd32(b);
		m->max_batched_tokens = rd32(b + 4);
		m->worker_id = rd64(b + 8);
		m->dp_rank = rd32(b + 16);
		m->incarnation = rd64(b + 24);
		m->capacity = rd64(b + 32);
		if (flags & KVR_MSG_RANK_VERSIONED) {
			m->rank_clock = rd64(b + 40);
			m->rank_writer = rd64(b + 48);
			/* A clock past 2^63 (wall-clock ns reach it in 2262) is no peer's: taken,
			 * it made every later own version of this replica (one past the highest
			 * seen) wrap to 0, an unversioned change. */
			if (!m->rank_clock || m->rank_clock > INT64_MAX || !m->rank_writer)
				return KVR_EINVAL;
		}
		if (m->op < 1 || m->op > 4)
			return KVR_EINVAL;
		return 0;
	}
	case KVR_MSG_HEARTBEAT:
		if (bl != 8)
			return KVR_EINVAL;
		m->live = rd64(b);
		return 0;
	case KVR_MSG_GOODBYE:
	case KVR_MSG_RESET:
		return bl == 0 ? 0 : KVR_EINVAL;
	case KVR_MSG_SNAP_REQ:
		if (bl != 8)
			return KVR_EINVAL;
		m->target = rd64(b);
		return 0;
	case KVR_MSG_FENCE:
		if (bl != FENCE_FIXED)
			return KVR_EINVAL;
		m->fence_replica = rd64(b);
		m->fence_epoch = rd64(b + 8);
		m->fence_seq = rd64(b + 16);
		return m->fence_replica && m->fence_epoch ? 0 : KVR_EINVAL;
	case KVR_MSG_SNAP_CHUNK: {
		if (depth > 0 || bl < CHUNK_FIXED)
			return KVR_EINVAL;
		m->chunk = rd32(b);
		m->chunk_flags = rd32(b + 4);
		m->n_records = rd32(b + 8);
		if (rd32(b + 12) != 0 ||
		    m->chunk_flags & ~(KVR_MSG_CHUNK_LAST | KVR_MSG_CHUNK_GIVEN_UP |
		                       KVR_MSG_CHUNK_FLOOR | KVR_MSG_CHUNK_RESYNCING))
			return KVR_EINVAL;
		if ((m->chunk_flags & KVR_MSG_CHUNK_RESYNCING) &&
		    !(m->chunk_flags & KVR_MSG_CHUNK_GIVEN_UP))
			return KVR_EINVAL; /* why a snapshot is given up: only with given up */
		if ((m->chunk_flags & KVR_MSG_CHUNK_GIVEN_UP) &&
		    ((m->chunk_flags & ~KVR_MSG_CHUNK_RESYNCING) != KVR_MSG_CHUNK_GIVEN_UP ||
		     m->n_records || bl != CHUNK_FIXED))
			return KVR_EINVAL; /* given up: nothing else */
		size_t fixed = CHUNK_FIXED;
		if (m->chunk_flags & KVR_MSG_CHUNK_FLOOR) {
			/* On the last chunk alone, as providers send it: one floor a snapshot. */
			if (!(m->chunk_flags & KVR_MSG_CHUNK_LAST) || bl < CHUNK_FIXED + 16)
				return KVR_EINVAL;
			m->floor_clock = rd64(b + 16);
			m->floor_writer = rd64(b + 24);
			/* As a RANK's version (its clock bounded for the same reason). */
			if (!m->floor_clock || m->floor_clock > INT64_MAX || !m->floor_writer)
				return KVR_EINVAL;
			fixed += 16;
		}
		m->records = b + fixed;
		m->records_len = bl - fixed;
		/* Framing and every record checked now, so applying never meets a bad one. */
		size_t pos = 0;
		uint32_t k = 0;
		while (pos < m->records_len) {
			if (m->records_len - pos < 4)
				return KVR_EINVAL;
			uint32_t rl = rd32(m->records + pos);
			pos += 4;
			if (rl > m->records_len - pos)
				return KVR_EINVAL;
			struct kvr_wmsg r;
			if (decode(m->records + pos, rl, &r, depth + 1))
				return KVR_EINVAL;
			if (r.h.type != KVR_MSG_ADMIT && r.h.type != KVR_MSG_ATTEMPT &&
			    r.h.type != KVR_MSG_RANK && r.h.type != KVR_MSG_FENCE)
				return KVR_EINVAL;
			pos += rl;
			k++;
		}
		return k == m->n_records ? 0 : KVR_EINVAL;
	}
	default:
		return KVR_EINVAL;
	}
}

int kvr_msg_decode(const void *buf, size_t len, struct kvr_wmsg *m)
{
	if (!m || (!buf && len))
		return KVR_EINVAL;
	return decode(buf, len, m, 0);
}

int kvr_msg_batch_next(const void *buf, size_t len, size_t *pos, struct kvr_wmsg *m)
{
	const uint8_t *p = buf;
	if (*pos >= len)
		return 0;
	size_t left = len - *pos;
	/* Shorter than a header, or than its header says: decode names the error (bad magic,
	 * unknown version, truncated) and cannot accept it. */
	if (left < KVR_MSG_HEADER)
		return decode(p + *pos, left, m, 0);
	uint64_t mlen = (uint64_t)KVR_MSG_HEADER + rd32(p + *pos + 4);
	if (mlen > left)
		return decode(p + *pos, left, m, 0);
	int rc = decode(p + *pos, (size_t)mlen, m, 0);
	if (rc)
		return rc;
	*pos += (size_t)mlen;
	return 1;
}

int kvr_msg_batch_check(const void *buf, size_t len, size_t *count)
{
	size_t pos = 0, n = 0;
	struct kvr_wmsg m;
	int rc;
	if (!buf || !len)
		return KVR_EINVAL;
	while ((rc = kvr_msg_batch_next(buf, len, &pos, &m)) == 1)
		n++;
	if (rc)
		return rc;
	if (count)
		*count = n;
	return 0;
}

int kvr_msg_next_record(const struct kvr_wmsg *c, size_t *pos, const uint8_t **rec, size_t *rec_len)
{
	if (*pos + 4 > c->records_len)
		return 0;
	uint32_t rl = rd32(c->records + *pos);
	*rec = c->records + *pos + 4;
	*rec_len = rl;
	*pos += 4 + (size_t)rl;
	return 1;
}

/* ---------------------------------------------------------------- encoding */

static bool reserve(struct kvr_msg_buf *b, size_t more)
{
	if (b->oom)
		return false;
	if (b->len + more <= b->cap)
		return true;
	size_t nc = b->cap ? b->cap : 256;
	while (nc < b->len + more)
		nc *= 2;
	uint8_t *p = kvr_realloc(b->p, b->cap, nc);
	if (!p) {
		b->oom = true;
		return false;
	}
	b->p = p;
	b->cap = nc;
	return true;
}

void kvr_msg_buf_fini(struct kvr_msg_buf *b)
{
	kvr_free(b->p, b->cap);
	memset(b, 0, sizeof(*b));
}

void kvr_msg_put_bytes(struct kvr_msg_buf *b, const void *v, size_t n)
{
	if (n && reserve(b, n)) {
		memcpy(b->p + b->len, v, n);
		b->len += n;
	}
}

/* v at p, little-endian (the wire's order; kvr_msg_u32 reads it back). */
static void wr32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
	p[2] = (uint8_t)(v >> 16);
	p[3] = (uint8_t)(v >> 24);
}

void kvr_msg_put_u32(struct kvr_msg_buf *b, uint32_t v)
{
	uint8_t x[4];
	wr32(x, v);
	kvr_msg_put_bytes(b, x, 4);
}

void kvr_msg_put_u64(struct kvr_msg_buf *b, uint64_t v)
{
	kvr_msg_put_u32(b, (uint32_t)v);
	kvr_msg_put_u32(b, (uint32_t)(v >> 32));
}

/* n words of w bytes at v in the wire's order (little-endian): as they are in memory on a
 * little-endian host, each word's bytes reversed on a big-endian one. */
static void put_words(struct kvr_msg_buf *b, const void *v, size_t n, size_t w)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	kvr_msg_put_bytes(b, v, n * w);
#else
	const uint8_t *s = v;
	for (size_t i = 0; i < n * w; i += w)
		for (size_t j = w; j-- > 0;)
			kvr_msg_put_bytes(b, s + i + j, 1);
#endif
}

void kvr_msg_put_u64s(struct kvr_msg_buf *b, const uint64_t *v, size_t n)
{
	put_words(b, v, n, 8);
}

void kvr_msg_put_u32s(struct kvr_msg_buf *b, const uint32_t *v, size_t n)
{
	put_words(b, v, n, 4);
}

size_t kvr_msg_begin(struct kvr_msg_buf *b, unsigned type, uint64_t replica, uint64_t epoch,
                     uint64_t seq)
{
	size_t off = b->len;
	uint8_t h[8] = {KVR_MSG_MAGIC & 0xff, KVR_MSG_MAGIC >> 8, KVR_MSG_VERSION, (uint8_t)type};
	kvr_msg_put_bytes(b, h, 8);
	kvr_msg_put_u64(b, replica);
	kvr_msg_put_u64(b, epoch);
	kvr_msg_put_u64(b, seq);
	return off;
}

void kvr_msg_end(struct kvr_msg_buf *b, size_t off)
{
	if (b->oom || b->len < off + KVR_MSG_HEADER)
		return;
	wr32(b->p + off + 4, (uint32_t)(b->len - off - KVR_MSG_HEADER));
}
