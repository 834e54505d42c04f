/*
 * sync/msgpack.h - a bounds-checked msgpack reader over one contiguous buffer.
 *
 * Why our own and not msgpack-c's unpacker: the feed decodes every vLLM KV event batch on one
 * thread at >= 1M blocks/s, and msgpack-c builds a tree of msgpack_object in a zone first (one
 * allocation per batch, two passes over the data).  What we need is a cursor: read a header,
 * check it against the bytes left, move on; nothing allocated, nothing recursive, every length
 * compared with what remains before it is used.  msgpack-c stays the encoder of the tests, the
 * benchmark and the replay tool's publishers, so the two implementations check each other.
 *
 * Invariants: c->p <= c->end always; a failed read returns false and leaves the cursor where
 * it was (callers then drop the whole message).  A container header of n items is accepted
 * only when n <= bytes left (each item takes at least one byte), so a hostile length cannot
 * make a caller reserve more than O(message size).  kvr_mp_skip() walks nested containers
 * with a counter, not recursion.
 * Reference: https://github.com/msgpack/msgpack/blob/master/spec.md
 */
#ifndef KVR_SYNC_MSGPACK_H
#define KVR_SYNC_MSGPACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct kvr_mp {
	const uint8_t *p, *end;
};

/* Kinds of the next item (kvr_mp_peek). */
enum kvr_mp_kind {
	KVR_MP_NONE = 0, /* end of buffer or a reserved byte (0xc1) */
	KVR_MP_NIL,
	KVR_MP_BOOL,
	KVR_MP_UINT,
	KVR_MP_INT, /* negative */
	KVR_MP_FLOAT,
	KVR_MP_STR,
	KVR_MP_BIN,
	KVR_MP_ARRAY,
	KVR_MP_MAP,
	KVR_MP_EXT,
};

static inline void kvr_mp_init(struct kvr_mp *c, const void *buf, size_t len)
{
	c->p = buf;
	c->end = c->p + len;
}

static inline size_t kvr_mp_left(const struct kvr_mp *c)
{
	return (size_t)(c->end - c->p);
}

static inline uint64_t kvr_mp_be(const uint8_t *p, unsigned n)
{
	uint64_t v = 0;
	for (unsigned i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

/* Context: any thread; pure. */
static inline enum kvr_mp_kind kvr_mp_peek(const struct kvr_mp *c)
{
	if (c->p >= c->end)
		return KVR_MP_NONE;
	uint8_t b = *c->p;
	if (b <= 0x7f)
		return KVR_MP_UINT;
	if (b <= 0x8f)
		return KVR_MP_MAP;
	if (b <= 0x9f)
		return KVR_MP_ARRAY;
	if (b <= 0xbf)
		return KVR_MP_STR;
	if (b >= 0xe0)
		return KVR_MP_INT;
	switch (b) {
	case 0xc0:
		return KVR_MP_NIL;
	case 0xc2:
	case 0xc3:
		return KVR_MP_BOOL;
	case 0xc4:
	case 0xc5:
	case 0xc6:
		return KVR_MP_BIN;
	case 0xc7:
	case 0xc8:
	case 0xc9:
	case 0xd4:
	case 0xd5:
	case 0xd6:
	case 0xd7:
	case 0xd8:
		return KVR_MP_EXT;
	case 0xca:
	case 0xcb:
		return KVR_MP_FLOAT;
	case 0xcc:
	case 0xcd:
	case 0xce:
	case 0xcf:
		return KVR_MP_UINT;
	case 0xd0:
	case 0xd1:
	case 0xd2:
	case 0xd3:
		return KVR_MP_INT;
	case 0xd9:
	case 0xda:
	case 0xdb:
		return KVR_MP_STR;
	case 0xdc:
	case 0xdd:
		return KVR_MP_ARRAY;
	case 0xde:
	case 0xdf:
		return KVR_MP_MAP;
	default:
		return KVR_MP_NONE;
	}
}

static inline bool kvr_mp_nil(struct kvr_mp *c)
{
	if (c->p < c->end && *c->p == 0xc0) {
		c->p++;
		return true;
	}
	return false;
}

/* Container header: n items (a map's n is its pair count).  n <= bytes left. */
static inline bool kvr_mp_container(struct kvr_mp *c, bool map, uint32_t *n)
{
	size_t left = kvr_mp_left(c);
	if (!left)
		return false;
	uint8_t b = c->p[0];
	uint32_t v;
	unsigned hdr;
	if (!map && (b & 0xf0) == 0x90) {
		v = b & 0x0f;
		hdr = 1;
	} else if (map && (b & 0xf0) == 0x80) {
		v = b & 0x0f;
		hdr = 1;
	} else if (b == (map ? 0xde : 0xdc) && left >= 3) {
		v = (uint32_t)kvr_mp_be(c->p + 1, 2);
		hdr = 3;
	} else if (b == (map ? 0xdf : 0xdd) && left >= 5) {
		v = (uint32_t)kvr_mp_be(c->p + 1, 4);
		hdr = 5;
	} else {
		return false;
	}
	if ((uint64_t)v * (map ? 2u : 1u) > left - hdr)
		return false;
	c->p += hdr;
	*n = v;
	return true;
}

static inline bool kvr_mp_array(struct kvr_mp *c, uint32_t *n)
{
	return kvr_mp_container(c, false, n);
}

static inline bool kvr_mp_map(struct kvr_mp *c, uint32_t *n)
{
	return kvr_mp_container(c, true, n);
}

/* str (bin = false) or bin (bin = true): *ptr points into the buffer, *len bytes. */
static inline bool kvr_mp_bytes(struct kvr_mp *c, bool bin, const uint8_t **ptr, uint32_t *len)
{
	size_t left = kvr_mp_left(c);
	if (!left)
		return false;
	uint8_t b = c->p[0];
	unsigned hdr;
	uint32_t v;
	if (!bin && (b & 0xe0) == 0xa0) {
		v = b & 0x1f;
		hdr = 1;
	} else {
		unsigned w;
		if (b == (bin ? 0xc4 : 0xd9))
			w = 1;
		else if (b == (bin ? 0xc5 : 0xda))
			w = 2;
		else if (b == (bin ? 0xc6 : 0xdb))
			w = 4;
		else
			return false;
		if (left < 1 + w)
			return false;
		v = (uint32_t)kvr_mp_be(c->p + 1, w);
		hdr = 1 + w;
	}
	if (v > left - hdr)
		return false;
	*ptr = c->p + hdr;
	*len = v;
	c->p += hdr + v;
	return true;
}

/* Any integer as 64 bits: unsigned as is, negative as two's complement (*neg set). */
static inline bool kvr_mp_int(struct kvr_mp *c, uint64_t *v, bool *neg)
{
	size_t left = kvr_mp_left(c);
	if (!left)
		return false;
	uint8_t b = c->p[0];
	if (b <= 0x7f) {
		*v = b;
		*neg = false;
		c->p++;
		return true;
	}
	if (b >= 0xe0) {
		*v = (uint64_t)(int64_t)(int8_t)b;
		*neg = true;
		c->p++;
		return true;
	}
	unsigned w;
	bool is_signed;
	switch (b) {
	case 0xcc:
		w = 1, is_signed = false;
		break;
	case 0xcd:
		w = 2, is_signed = false;
		break;
	case 0xce:
		w = 4, is_signed = false;
		break;
	case 0xcf:
		w = 8, is_signed = false;
		break;
	case 0xd0:
		w = 1, is_signed = true;
		break;
	case 0xd1:
		w = 2, is_signed = true;
		break;
	case 0xd2:
		w = 4, is_signed = true;
		break;
	case 0xd3:
		w = 8, is_signed = true;
		break;
	default:
		return false;
	}
	if (left < 1 + w)
		return false;
	uint64_t x = kvr_mp_be(c->p + 1, w);
	if (is_signed && w < 8 && (x >> (8 * w - 1)) & 1)
		x |= ~UINT64_C(0) << (8 * w); /* sign-extend */
	*v = x;
	*neg = is_signed && (x >> 63);
	c->p += 1 + w;
	return true;
}

/* A number (int or float) as a double. */
static inline bool kvr_mp_number(struct kvr_mp *c, double *out)
{
	if (c->p >= c->end)
		return false;
	uint8_t b = c->p[0];
	if (b == 0xca || b == 0xcb) {
		unsigned w = b == 0xca ? 4 : 8;
		if (kvr_mp_left(c) < 1 + w)
			return false;
		uint64_t x = kvr_mp_be(c->p + 1, w);
		if (w == 4) {
			uint32_t x32 = (uint32_t)x;
			float f;
			memcpy(&f, &x32, 4);
			*out = f;
		} else {
			memcpy(out, &x, 8);
		}
		c->p += 1 + w;
		return true;
	}
	uint64_t v;
	bool neg;
	if (!kvr_mp_int(c, &v, &neg))
		return false;
	*out = neg ? (double)(int64_t)v : (double)v;
	return true;
}

/* Size of the item starting at c->p, excluding the contents of a container (whose item count
 * goes to *items).  0 if malformed or truncated. */
static inline size_t kvr_mp_item_hdr(const struct kvr_mp *c, uint64_t *items)
{
	size_t left = kvr_mp_left(c);
	*items = 0;
	if (!left)
		return 0;
	uint8_t b = c->p[0];
	size_t n;
	if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
		return 1;
	if ((b & 0xf0) == 0x80) {
		*items = 2u * (b & 0x0f);
		return 1;
	}
	if ((b & 0xf0) == 0x90) {
		*items = b & 0x0f;
		return 1;
	}
	if ((b & 0xe0) == 0xa0)
		n = 1 + (size_t)(b & 0x1f);
	else {
		switch (b) {
		case 0xcc:
		case 0xd0:
			n = 2;
			break;
		case 0xcd:
		case 0xd1:
			n = 3;
			break;
		case 0xce:
		case 0xd2:
		case 0xca:
			n = 5;
			break;
		case 0xcf:
		case 0xd3:
		case 0xcb:
			n = 9;
			break;
		case 0xd4:
			n = 3;
			break;
		case 0xd5:
			n = 4;
			break;
		case 0xd6:
			n = 6;
			break;
		case 0xd7:
			n = 10;
			break;
		case 0xd8:
			n = 18;
			break;
		case 0xc4:
		case 0xd9:
			if (left < 2)
				return 0;
			n = 2 + (size_t)c->p[1];
			break;
		case 0xc5:
		case 0xda:
			if (left < 3)
				return 0;
			n = 3 + (size_t)kvr_mp_be(c->p + 1, 2);
			break;
		case 0xc6:
		case 0xdb:
			if (left < 5)
				return 0;
			n = 5 + (size_t)kvr_mp_be(c->p + 1, 4);
			break;
		case 0xc7:
			if (left < 2)
				return 0;
			n = 3 + (size_t)c->p[1];
			break;
		case 0xc8:
			if (left < 3)
				return 0;
			n = 4 + (size_t)kvr_mp_be(c->p + 1, 2);
			break;
		case 0xc9:
			if (left < 5)
				return 0;
			n = 6 + (size_t)kvr_mp_be(c->p + 1, 4);
			break;
		case 0xdc:
		case 0xde:
			if (left < 3)
				return 0;
			*items = kvr_mp_be(c->p + 1, 2) * (b == 0xde ? 2u : 1u);
			n = 3;
			break;
		case 0xdd:
		case 0xdf:
			if (left < 5)
				return 0;
			*items = kvr_mp_be(c->p + 1, 4) * (b == 0xdf ? 2u : 1u);
			n = 5;
			break;
		default:
			return 0; /* 0xc1: never used */
		}
	}
	return n <= left ? n : 0;
}

/* Skips one complete item (nested containers included).  Iterative: a counter of items still
 * to skip, bounded by the bytes left, so no recursion and no overflow. */
static inline bool kvr_mp_skip(struct kvr_mp *c)
{
	struct kvr_mp t = *c;
	uint64_t pending = 1;
	while (pending) {
		uint64_t items;
		size_t n = kvr_mp_item_hdr(&t, &items);
		if (!n)
			return false;
		t.p += n;
		pending--;
		if (pending + items > kvr_mp_left(&t))
			return false; /* cannot all fit (one byte each at least): truncated or
			                 hostile */
		pending += items;
	}
	*c = t;
	return true;
}

/* Whether the bytes p[0..len) spell the C string s. */
static inline bool kvr_mp_str_eq(const uint8_t *p, uint32_t len, const char *s)
{
	size_t n = strlen(s);
	return len == n && memcmp(p, s, n) == 0;
}

#endif /* KVR_SYNC_MSGPACK_H */
