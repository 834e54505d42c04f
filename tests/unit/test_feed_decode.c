/* The vLLM KV event payload decoder: both wire forms encoded with msgpack-c (an independent
 * encoder), hashes >= 2^63, negative and bin hashes, and malformed input that must decode to
 * nothing. */
#include <criterion/criterion.h>
#include <msgpack.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/feed_decode.h"

static msgpack_sbuffer sb;
static msgpack_packer pk;

static bool sb_live;

static void begin(void)
{
	if (sb_live)
		msgpack_sbuffer_destroy(&sb);
	sb_live = true;
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
}

static void str(const char *s)
{
	msgpack_pack_str(&pk, strlen(s));
	msgpack_pack_str_body(&pk, s, strlen(s));
}

static void u64s(const uint64_t *v, size_t n)
{
	msgpack_pack_array(&pk, n);
	for (size_t i = 0; i < n; i++)
		msgpack_pack_uint64(&pk, v[i]);
}

static void toks(uint32_t first, size_t n)
{
	msgpack_pack_array(&pk, n);
	for (size_t i = 0; i < n; i++)
		msgpack_pack_uint32(&pk, first + (uint32_t)i);
}

static struct kvr_feed_batch b;

static int decode(void)
{
	int rc = kvr_feed_decode(&b, sb.data, sb.size);
	return rc;
}

static void fini(void)
{
	kvr_feed_batch_fini(&b);
	if (sb_live)
		msgpack_sbuffer_destroy(&sb);
	sb_live = false;
}

TestSuite(feed_decode, .fini = fini);

static const uint64_t H[3] = {UINT64_MAX, UINT64_C(1) << 63, 42};

Test(feed_decode, map_form_any_key_order)
{
	begin();
	msgpack_pack_map(&pk, 3);
	str("data_parallel_rank");
	msgpack_pack_int(&pk, 3);
	str("events");
	msgpack_pack_array(&pk, 3);
	/* BlockStored with the type last, unknown keys, lora_name */
	msgpack_pack_map(&pk, 9);
	str("block_hashes");
	u64s(H, 2);
	str("parent_block_hash");
	msgpack_pack_uint64(&pk, 7);
	str("token_ids");
	toks(100, 32);
	str("block_size");
	msgpack_pack_int(&pk, 16);
	str("extra_keys");
	msgpack_pack_array(&pk, 2);
	msgpack_pack_nil(&pk);
	msgpack_pack_map(&pk, 1);
	str("x");
	msgpack_pack_bin(&pk, 2);
	msgpack_pack_bin_body(&pk, "ab", 2);
	str("lora_id");
	msgpack_pack_nil(&pk);
	str("medium");
	str("GPU");
	str("lora_name");
	str("adapter");
	str("type");
	str("BlockStored");
	msgpack_pack_map(&pk, 3);
	str("type");
	str("BlockRemoved");
	str("block_hashes");
	u64s(H + 2, 1);
	str("medium");
	str("CPU");
	msgpack_pack_map(&pk, 1);
	str("type");
	str("AllBlocksCleared");
	str("ts");
	msgpack_pack_double(&pk, 1234.5);
	cr_assert_eq(decode(), 0);
	cr_assert(b.has_dp);
	cr_assert_eq(b.dp, 3);
	cr_assert_eq(b.ts, 1234.5);
	cr_assert_eq(b.n_ev, 3);
	const struct kvr_fev *e = &b.ev[0];
	cr_assert_eq(e->type, KVR_FEV_STORED);
	cr_assert_eq(e->n_hashes, 2);
	cr_assert_eq(b.hashes[e->hash_off], UINT64_MAX);
	cr_assert_eq(b.hashes[e->hash_off + 1], UINT64_C(1) << 63);
	cr_assert(e->has_parent);
	cr_assert_eq(e->parent, 7);
	cr_assert_eq(e->n_tokens, 32);
	cr_assert_eq(b.tokens[e->tok_off + 31], 131);
	cr_assert_eq(e->block_size, 16);
	cr_assert(e->gpu);
	cr_assert_str_eq(b.strs + e->lora_off, "adapter");
	cr_assert_eq(b.ev[1].type, KVR_FEV_REMOVED);
	cr_assert_not(b.ev[1].gpu);
	cr_assert_eq(b.hashes[b.ev[1].hash_off], 42);
	cr_assert_eq(b.ev[2].type, KVR_FEV_CLEARED);
}

Test(feed_decode, legacy_array_form_by_position)
{
	begin();
	msgpack_pack_array(&pk, 3);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 4);
	/* oldest: no medium, no lora_name */
	msgpack_pack_array(&pk, 6);
	str("BlockStored");
	u64s(H, 1);
	msgpack_pack_nil(&pk);
	toks(0, 16);
	msgpack_pack_int(&pk, 16);
	msgpack_pack_nil(&pk);
	/* newer: medium, lora_name, extra_keys, group_idx */
	msgpack_pack_array(&pk, 10);
	str("BlockStored");
	u64s(H + 1, 2);
	msgpack_pack_uint64(&pk, UINT64_MAX);
	toks(5, 32);
	msgpack_pack_int(&pk, 16);
	msgpack_pack_int(&pk, 9);
	str("CPU");
	str("lx");
	msgpack_pack_nil(&pk);
	msgpack_pack_int(&pk, 0);
	msgpack_pack_array(&pk, 2);
	str("BlockRemoved");
	u64s(H, 3);
	msgpack_pack_array(&pk, 1);
	str("AllBlocksCleared");
	msgpack_pack_nil(&pk); /* dp rank nil */
	cr_assert_eq(decode(), 0);
	cr_assert_not(b.has_dp);
	cr_assert_eq(b.n_ev, 4);
	cr_assert_not(b.ev[0].has_parent);
	cr_assert(b.ev[0].gpu);
	cr_assert_eq(b.ev[0].lora_off, -1);
	cr_assert(b.ev[1].has_parent);
	cr_assert_eq(b.ev[1].parent, UINT64_MAX);
	cr_assert_not(b.ev[1].gpu);
	cr_assert(b.ev[1].has_lora_id);
	cr_assert_eq(b.ev[1].lora_id, 9);
	cr_assert_str_eq(b.strs + b.ev[1].lora_off, "lx");
	cr_assert_eq(b.ev[2].n_hashes, 3);
	cr_assert_eq(b.ev[3].type, KVR_FEV_CLEARED);
}

Test(feed_decode, bin_and_negative_hashes)
{
	uint8_t d32[32], d16[16];
	for (int i = 0; i < 32; i++)
		d32[i] = (uint8_t)(i + 1);
	for (int i = 0; i < 16; i++)
		d16[i] = (uint8_t)(0xF0 + i);
	begin();
	msgpack_pack_array(&pk, 2);
	msgpack_pack_int(&pk, 0);
	msgpack_pack_array(&pk, 1);
	msgpack_pack_array(&pk, 2);
	str("BlockRemoved");
	msgpack_pack_array(&pk, 3);
	msgpack_pack_bin(&pk, 32);
	msgpack_pack_bin_body(&pk, d32, 32);
	msgpack_pack_bin(&pk, 16);
	msgpack_pack_bin_body(&pk, d16, 16);
	msgpack_pack_int64(&pk, -2);
	cr_assert_eq(decode(), 0);
	const uint64_t *h = b.hashes + b.ev[0].hash_off;
	/* int.from_bytes(digest, "big") & (2^64 - 1): the last 8 bytes */
	cr_assert_eq(h[0], UINT64_C(0x191a1b1c1d1e1f20));
	cr_assert_eq(h[1], UINT64_C(0xf8f9fafbfcfdfeff));
	cr_assert_eq(h[2], UINT64_MAX - 1);
}

Test(feed_decode, unknown_event_type_is_skipped)
{
	begin();
	msgpack_pack_array(&pk, 2);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 2);
	msgpack_pack_map(&pk, 2);
	str("type");
	str("BlockPinned");
	str("block_hashes");
	u64s(H, 3);
	msgpack_pack_array(&pk, 2);
	str("BlockRemoved");
	u64s(H + 2, 1);
	cr_assert_eq(decode(), 0);
	cr_assert_eq(b.n_ev, 1);
	cr_assert_eq(b.n_unknown, 1);
	cr_assert_eq(b.n_hashes, 1);
	cr_assert_eq(b.hashes[b.ev[0].hash_off], 42);
}

/* Every prefix of a good payload, and a few hostile shapes, decode to nothing. */
Test(feed_decode, malformed_is_all_or_nothing)
{
	begin();
	msgpack_pack_array(&pk, 3);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 2);
	msgpack_pack_array(&pk, 6);
	str("BlockStored");
	u64s(H, 3);
	msgpack_pack_nil(&pk);
	toks(1000, 48);
	msgpack_pack_int(&pk, 16);
	msgpack_pack_nil(&pk);
	msgpack_pack_array(&pk, 2);
	str("BlockRemoved");
	u64s(H, 2);
	msgpack_pack_int(&pk, 0);
	cr_assert_eq(decode(), 0);
	cr_assert_eq(b.n_ev, 2);
	for (size_t n = 0; n < sb.size; n++) {
		cr_assert_eq(kvr_feed_decode(&b, sb.data, n), KVR_EINVAL, "prefix %zu", n);
		cr_assert_eq(b.n_ev, 0);
	}
	/* trailing byte */
	char *more = malloc(sb.size + 1);
	memcpy(more, sb.data, sb.size);
	more[sb.size] = 0;
	cr_assert_eq(kvr_feed_decode(&b, more, sb.size + 1), KVR_EINVAL);
	free(more);
	/* an array32 header claiming 2^32-1 items in a tiny message */
	const uint8_t huge[] = {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff};
	cr_assert_eq(kvr_feed_decode(&b, huge, sizeof(huge)), KVR_EINVAL);
	/* wrong types: a string hash, a negative token id, dp rank out of u32 */
	begin();
	msgpack_pack_array(&pk, 2);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 1);
	msgpack_pack_array(&pk, 2);
	str("BlockRemoved");
	msgpack_pack_array(&pk, 1);
	str("deadbeef");
	cr_assert_eq(decode(), KVR_EINVAL);
	begin();
	msgpack_pack_array(&pk, 2);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 1);
	msgpack_pack_array(&pk, 5);
	str("BlockStored");
	u64s(H, 1);
	msgpack_pack_nil(&pk);
	msgpack_pack_array(&pk, 1);
	msgpack_pack_int(&pk, -5);
	msgpack_pack_int(&pk, 1);
	cr_assert_eq(decode(), KVR_EINVAL);
	begin();
	msgpack_pack_array(&pk, 3);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 0);
	msgpack_pack_uint64(&pk, UINT64_C(1) << 40);
	cr_assert_eq(decode(), KVR_EINVAL);
	/* a legacy BlockStored cut short of its block_size */
	begin();
	msgpack_pack_array(&pk, 2);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 1);
	msgpack_pack_array(&pk, 4);
	str("BlockStored");
	u64s(H, 1);
	msgpack_pack_nil(&pk);
	toks(0, 16);
	cr_assert_eq(decode(), KVR_EINVAL);
	cr_assert_eq(b.n_ev, 0);
}

/* SQLite-style: fail the Nth allocation for N = 1, 2, ...: each decode either succeeds whole or
 * fails with KVR_ENOMEM holding nothing, and nothing leaks. */
Test(feed_decode, out_of_memory_loop)
{
	begin();
	msgpack_pack_array(&pk, 3);
	msgpack_pack_double(&pk, 1.0);
	msgpack_pack_array(&pk, 2);
	msgpack_pack_array(&pk, 8);
	str("BlockStored");
	u64s(H, 3);
	msgpack_pack_nil(&pk);
	toks(7, 48);
	msgpack_pack_int(&pk, 16);
	msgpack_pack_nil(&pk);
	str("GPU");
	str("lora");
	msgpack_pack_array(&pk, 2);
	str("BlockRemoved");
	u64s(H, 2);
	msgpack_pack_int(&pk, 1);
	int64_t live0 = kvr_alloc_live_bytes();
	bool ok = false;
	for (uint64_t n = 1; n < 64 && !ok; n++) {
		struct kvr_feed_batch fresh = {0};
		kvr_alloc_fail_after(n);
		int rc = kvr_feed_decode(&fresh, sb.data, sb.size);
		kvr_alloc_fail_after(0);
		if (rc == 0) {
			cr_assert_eq(fresh.n_ev, 2);
			ok = true;
		} else {
			cr_assert_eq(rc, KVR_ENOMEM, "n=%lu rc=%d", (unsigned long)n, rc);
			cr_assert_eq(fresh.n_ev, 0);
		}
		kvr_feed_batch_fini(&fresh);
		cr_assert_eq(kvr_alloc_live_bytes(), live0, "n=%lu leaked", (unsigned long)n);
	}
	cr_assert(ok);
}
