/*
 * sync/feed_decode.c - vLLM KV event batches, msgpack -> flat arrays.
 *
 * vLLM (vllm/distributed/kv_events.py) encodes with msgspec.  Two generations are on the wire:
 *  - legacy: EventBatch and KVCacheEvent are `array_like` structs, so a batch is
 *    [ts, events, data_parallel_rank?] and an event a tagged array whose first item is the
 *    class name and the rest the fields by position: BlockStored [hashes, parent, token_ids,
 *    block_size, lora_id, medium?, lora_name?, extra_keys?, group_idx?, ...], BlockRemoved
 *    [hashes, medium?, group_idx?], AllBlocksCleared [].  Fields vLLM added later appear at the
 *    end and are optional here (older publishers stop after lora_id or block_hashes).
 *  - current (vLLM >= PR #42892): plain structs, so a batch is a map {ts, events,
 *    data_parallel_rank} and an event a map with a "type" key naming the class.  Key order is
 *    free, unknown keys are skipped, keys with default values may be absent (omit_defaults).
 * Both are decoded by the same field setters; the tagged array maps position i to the key the
 * map form would use.
 *
 * Rules: a batch decodes completely or not at all (nothing of a malformed batch is applied);
 * every length is checked against the bytes left before anything is reserved (sync/msgpack.h),
 * so a hostile header costs at most O(payload) memory; token ids must fit u32; block_size,
 * dp rank must fit u32; trailing bytes after the batch are malformed.  An event of an unknown
 * type is well-formed but skipped (counted): vLLM may add types, which must not stop the feed.
 * What the values mean (block size against the router's, medium, lora) is the feed's business
 * (sync/feed.c), not the decoder's.
 */
#include "sync/feed_decode.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/msgpack.h"

int kvr_feed_grow(void **arr, uint32_t *cap, uint64_t need, size_t item)
{
	if (need <= *cap)
		return 0;
	if (need > UINT32_MAX / 2)
		return KVR_ERANGE;
	uint32_t nc = *cap ? *cap : 16;
	while (nc < need)
		nc *= 2;
	void *p = kvr_realloc(*arr, (size_t)*cap * item, (size_t)nc * item);
	if (!p)
		return KVR_ENOMEM;
	*arr = p;
	*cap = nc;
	return 0;
}

/* Room for need more items after used.  Sizes are u32: a payload large enough to overflow
 * them is refused (KVR_EINVAL). */
static int reserve(void **arr, uint32_t *cap, uint32_t used, uint64_t need, size_t item)
{
	int rc = kvr_feed_grow(arr, cap, (uint64_t)used + need, item);
	return rc == KVR_ERANGE ? KVR_EINVAL : rc;
}

/* One hash: int or bin (digest folded to its last 8 bytes, big-endian). */
static bool read_hash(struct kvr_mp *c, uint64_t *out)
{
	enum kvr_mp_kind k = kvr_mp_peek(c);
	if (k == KVR_MP_UINT || k == KVR_MP_INT) {
		bool neg;
		return kvr_mp_int(c, out, &neg);
	}
	if (k == KVR_MP_BIN) {
		const uint8_t *p;
		uint32_t n;
		if (!kvr_mp_bytes(c, true, &p, &n) || n == 0)
			return false;
		*out = n >= 8 ? kvr_mp_be(p + n - 8, 8) : kvr_mp_be(p, n);
		return true;
	}
	return false;
}

static int read_hashes(struct kvr_feed_batch *b, struct kvr_mp *c, struct kvr_fev *e)
{
	uint32_t n;
	if (!kvr_mp_array(c, &n))
		return KVR_EINVAL;
	int rc = reserve((void **)&b->hashes, &b->cap_hashes, b->n_hashes, n, sizeof(uint64_t));
	if (rc)
		return rc;
	e->hash_off = b->n_hashes;
	e->n_hashes = n;
	for (uint32_t i = 0; i < n; i++)
		if (!read_hash(c, &b->hashes[b->n_hashes + i]))
			return KVR_EINVAL;
	b->n_hashes += n;
	return 0;
}

static int read_tokens(struct kvr_feed_batch *b, struct kvr_mp *c, struct kvr_fev *e)
{
	uint32_t n;
	if (!kvr_mp_array(c, &n))
		return KVR_EINVAL;
	int rc = reserve((void **)&b->tokens, &b->cap_tokens, b->n_tokens, n, sizeof(uint32_t));
	if (rc)
		return rc;
	e->tok_off = b->n_tokens;
	e->n_tokens = n;
	if (n == 0)
		return 0; /* b->tokens may be NULL: NULL + 0 is undefined in C (UBSan, fuzz_feed) */
	uint32_t *t = b->tokens + b->n_tokens;
	for (uint32_t i = 0; i < n; i++) {
		/* Fast path: positive fixint and uint16/uint32 cover every vocabulary. */
		const uint8_t *p = c->p;
		if (p < c->end && *p <= 0x7f) {
			t[i] = *p;
			c->p++;
			continue;
		}
		uint64_t v;
		bool neg;
		if (!kvr_mp_int(c, &v, &neg) || neg || v > UINT32_MAX)
			return KVR_EINVAL;
		t[i] = (uint32_t)v;
	}
	b->n_tokens += n;
	return 0;
}

static bool read_u32(struct kvr_mp *c, uint32_t *out)
{
	uint64_t v;
	bool neg;
	if (!kvr_mp_int(c, &v, &neg) || neg || v > UINT32_MAX)
		return false;
	*out = (uint32_t)v;
	return true;
}

/* A string kept NUL-terminated in b->strs; *off = its offset.  NUL bytes inside are refused
 * (the name becomes a C string for kvr_hash_lora_seed). */
static int read_str(struct kvr_feed_batch *b, struct kvr_mp *c, int32_t *off)
{
	const uint8_t *p;
	uint32_t n;
	if (!kvr_mp_bytes(c, false, &p, &n) || memchr(p, 0, n))
		return KVR_EINVAL;
	int rc = reserve((void **)&b->strs, &b->cap_strs, b->n_strs, (uint64_t)n + 1, 1);
	if (rc)
		return rc;
	memcpy(b->strs + b->n_strs, p, n);
	b->strs[b->n_strs + n] = '\0';
	*off = (int32_t)b->n_strs;
	b->n_strs += n + 1;
	return 0;
}

/* Field keys shared by both forms; the legacy array maps positions onto them. */
enum field {
	F_SKIP,
	F_HASHES,
	F_PARENT,
	F_TOKENS,
	F_BLOCK_SIZE,
	F_LORA_ID,
	F_MEDIUM,
	F_LORA_NAME,
};

/* Sets one field from the cursor.  nil is "absent" for every optional field. */
static int set_field(struct kvr_feed_batch *b, struct kvr_mp *c, struct kvr_fev *e, enum field f,
                     bool *have_hashes)
{
	switch (f) {
	case F_HASHES:
		*have_hashes = true;
		return read_hashes(b, c, e);
	case F_PARENT:
		if (kvr_mp_nil(c))
			return 0;
		e->has_parent = true;
		return read_hash(c, &e->parent) ? 0 : KVR_EINVAL;
	case F_TOKENS:
		if (kvr_mp_nil(c))
			return 0;
		return read_tokens(b, c, e);
	case F_BLOCK_SIZE:
		if (kvr_mp_nil(c))
			return 0;
		e->has_block_size = true;
		return read_u32(c, &e->block_size) ? 0 : KVR_EINVAL;
	case F_MEDIUM: {
		if (kvr_mp_nil(c))
			return 0;
		const uint8_t *p;
		uint32_t n;
		if (!kvr_mp_bytes(c, false, &p, &n))
			return KVR_EINVAL;
		e->gpu = kvr_mp_str_eq(p, n, "GPU");
		return 0;
	}
	case F_LORA_NAME:
		if (kvr_mp_nil(c))
			return 0;
		return read_str(b, c, &e->lora_off);
	case F_LORA_ID:
		/* Deprecated in vLLM in favour of lora_name (see sync/feed.c for its use). */
		if (kvr_mp_nil(c))
			return 0;
		{
			bool neg;
			e->has_lora_id = true;
			return kvr_mp_int(c, &e->lora_id, &neg) ? 0 : KVR_EINVAL;
		}
	case F_SKIP:
	default:
		return kvr_mp_skip(c) ? 0 : KVR_EINVAL;
	}
}

static enum kvr_fev_type type_of(const uint8_t *p, uint32_t n)
{
	if (kvr_mp_str_eq(p, n, "BlockStored"))
		return KVR_FEV_STORED;
	if (kvr_mp_str_eq(p, n, "BlockRemoved"))
		return KVR_FEV_REMOVED;
	if (kvr_mp_str_eq(p, n, "AllBlocksCleared"))
		return KVR_FEV_CLEARED;
	return KVR_FEV_UNKNOWN;
}

static enum field field_of(const uint8_t *p, uint32_t n)
{
	static const struct {
		const char *key;
		enum field f;
	} keys[] = {
	    {"block_hashes", F_HASHES},   {"parent_block_hash", F_PARENT}, {"token_ids", F_TOKENS},
	    {"block_size", F_BLOCK_SIZE}, {"lora_id", F_LORA_ID},          {"medium", F_MEDIUM},
	    {"lora_name", F_LORA_NAME},
	};
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
		if (kvr_mp_str_eq(p, n, keys[i].key))
			return keys[i].f;
	return F_SKIP;
}

/* Legacy positions (after the tag) of each type. */
static const enum field stored_pos[] = {F_HASHES,  F_PARENT, F_TOKENS,   F_BLOCK_SIZE,
                                        F_LORA_ID, F_MEDIUM, F_LORA_NAME};
static const enum field removed_pos[] = {F_HASHES, F_MEDIUM};

/* Checks a decoded event's required fields; the type's leftovers are reset. */
static int finish_event(struct kvr_fev *e, bool have_hashes)
{
	switch (e->type) {
	case KVR_FEV_STORED:
	case KVR_FEV_REMOVED:
		return have_hashes ? 0 : KVR_EINVAL;
	default:
		return 0;
	}
}

static int read_event(struct kvr_feed_batch *b, struct kvr_mp *c, struct kvr_fev *e)
{
	*e = (struct kvr_fev){.gpu = true, .lora_off = -1, .type = KVR_FEV_UNKNOWN};
	bool have_hashes = false;
	uint32_t n;
	int rc;
	if (kvr_mp_peek(c) == KVR_MP_ARRAY) {
		const uint8_t *p;
		uint32_t tl;
		if (!kvr_mp_array(c, &n) || n == 0 || !kvr_mp_bytes(c, false, &p, &tl))
			return KVR_EINVAL;
		e->type = (uint8_t)type_of(p, tl);
		const enum field *pos = NULL;
		size_t npos = 0, need = 0;
		if (e->type == KVR_FEV_STORED) {
			pos = stored_pos;
			npos = sizeof(stored_pos) / sizeof(stored_pos[0]);
			need = 4; /* hashes, parent, token_ids, block_size */
		} else if (e->type == KVR_FEV_REMOVED) {
			pos = removed_pos;
			npos = sizeof(removed_pos) / sizeof(removed_pos[0]);
			need = 1;
		}
		if (n - 1 < need)
			return KVR_EINVAL;
		for (uint32_t i = 1; i < n; i++) {
			enum field f = i - 1 < npos ? pos[i - 1] : F_SKIP;
			if ((rc = set_field(b, c, e, f, &have_hashes)))
				return rc;
		}
		return finish_event(e, have_hashes);
	}
	if (!kvr_mp_map(c, &n))
		return KVR_EINVAL;
	/* The type may come after the fields: read them all, check the type's needs after. */
	bool have_type = false;
	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *k;
		uint32_t kl;
		if (!kvr_mp_bytes(c, false, &k, &kl))
			return KVR_EINVAL;
		if (kvr_mp_str_eq(k, kl, "type")) {
			const uint8_t *p;
			uint32_t tl;
			if (have_type || !kvr_mp_bytes(c, false, &p, &tl))
				return KVR_EINVAL;
			e->type = (uint8_t)type_of(p, tl);
			have_type = true;
			continue;
		}
		if ((rc = set_field(b, c, e, field_of(k, kl), &have_hashes)))
			return rc;
	}
	if (!have_type)
		return KVR_EINVAL;
	return finish_event(e, have_hashes);
}

static int read_events(struct kvr_feed_batch *b, struct kvr_mp *c)
{
	uint32_t n;
	if (!kvr_mp_array(c, &n))
		return KVR_EINVAL;
	int rc = reserve((void **)&b->ev, &b->cap_ev, 0, n, sizeof(struct kvr_fev));
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		struct kvr_fev *e = &b->ev[b->n_ev];
		uint32_t h = b->n_hashes, t = b->n_tokens, s = b->n_strs;
		if ((rc = read_event(b, c, e)))
			return rc;
		if (e->type == KVR_FEV_UNKNOWN) {
			b->n_hashes = h; /* drop what it left in the arrays */
			b->n_tokens = t;
			b->n_strs = s;
			b->n_unknown++;
			continue;
		}
		b->n_ev++;
	}
	return 0;
}

static int read_dp(struct kvr_feed_batch *b, struct kvr_mp *c)
{
	if (kvr_mp_nil(c))
		return 0;
	if (!read_u32(c, &b->dp))
		return KVR_EINVAL;
	b->has_dp = true;
	return 0;
}

static int decode(struct kvr_feed_batch *b, struct kvr_mp *c)
{
	uint32_t n;
	int rc;
	if (kvr_mp_peek(c) == KVR_MP_ARRAY) {
		if (!kvr_mp_array(c, &n) || n < 2)
			return KVR_EINVAL;
		if (!kvr_mp_number(c, &b->ts))
			return KVR_EINVAL;
		if ((rc = read_events(b, c)))
			return rc;
		if (n >= 3 && (rc = read_dp(b, c)))
			return rc;
		for (uint32_t i = 3; i < n; i++)
			if (!kvr_mp_skip(c))
				return KVR_EINVAL;
		return 0;
	}
	if (!kvr_mp_map(c, &n))
		return KVR_EINVAL;
	bool have_events = false, have_ts = false;
	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *k;
		uint32_t kl;
		if (!kvr_mp_bytes(c, false, &k, &kl))
			return KVR_EINVAL;
		if (kvr_mp_str_eq(k, kl, "ts")) {
			if (have_ts || !kvr_mp_number(c, &b->ts))
				return KVR_EINVAL;
			have_ts = true;
		} else if (kvr_mp_str_eq(k, kl, "events")) {
			if (have_events)
				return KVR_EINVAL;
			if ((rc = read_events(b, c)))
				return rc;
			have_events = true;
		} else if (kvr_mp_str_eq(k, kl, "data_parallel_rank")) {
			if ((rc = read_dp(b, c)))
				return rc;
		} else if (!kvr_mp_skip(c)) {
			return KVR_EINVAL;
		}
	}
	return have_events ? 0 : KVR_EINVAL;
}

int kvr_feed_decode(struct kvr_feed_batch *b, const void *payload, size_t len)
{
	if (!b || (!payload && len))
		return KVR_EINVAL;
	b->ts = 0;
	b->has_dp = false;
	b->dp = 0;
	b->n_unknown = 0;
	b->n_ev = b->n_hashes = b->n_tokens = b->n_strs = 0;
	struct kvr_mp c;
	kvr_mp_init(&c, payload, len);
	int rc = decode(b, &c);
	if (rc == 0 && kvr_mp_left(&c))
		rc = KVR_EINVAL; /* trailing bytes: not one msgpack object */
	if (rc) {
		b->n_ev = b->n_hashes = b->n_tokens = b->n_strs = 0;
		b->has_dp = false;
	}
	return rc;
}

void kvr_feed_batch_fini(struct kvr_feed_batch *b)
{
	if (!b)
		return;
	kvr_free(b->ev, (size_t)b->cap_ev * sizeof(*b->ev));
	kvr_free(b->hashes, (size_t)b->cap_hashes * sizeof(*b->hashes));
	kvr_free(b->tokens, (size_t)b->cap_tokens * sizeof(*b->tokens));
	kvr_free(b->strs, b->cap_strs);
	*b = (struct kvr_feed_batch){0};
}
