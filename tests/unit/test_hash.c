/* Block hashing: Dynamo-compatible vectors, tails, LoRA, block sizes, long inputs, bad input. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/hash.h"
#include "kvrouter.h"

/* Source of the vectors: NVIDIA Dynamo's own tests, so kvrouter's hashes are checked against the
 * implementation it claims compatibility with (not against itself):
 *  - ai-dynamo/dynamo lib/tokens/src/lib.rs, the TokenBlockSequence tests with salt 1337:
 *    HASH_1_4 = 14643705804678351452 (hash([1,2,3,4], 1337)), HASH_5_8, SEQ_HASH_5_8 =
 *    4945711292740353085, HASH_9_12 = 483935686894639516, SEQ_HASH_9_12 = 12583592247330656132;
 *  - ai-dynamo/dynamo lib/llm/src/kv_router/indexer.rs, test_router_event_new:
 *    LocalBlockHash(13226331709069118873), XXH3-64 of "test data" with seed 1337. */
Test(hash, known_vectors_block4)
{
	uint32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
	uint64_t local[3], seq[3];
	cr_assert_eq(kvr_hash_blocks(tok, 12, 4, NULL, local, seq), 3);
	cr_assert_eq(local[0], 14643705804678351452ull);
	cr_assert_eq(local[1], 16777012769546811212ull);
	cr_assert_eq(local[2], 483935686894639516ull);
	cr_assert_eq(seq[0], local[0]);
	cr_assert_eq(seq[1], 4945711292740353085ull);
	cr_assert_eq(seq[2], 12583592247330656132ull);
}

Test(hash, xxh3_seed_vector)
{
	cr_assert_eq(XXH3_64bits_withSeed("test data", 9, 1337), 13226331709069118873ull);
}

Test(hash, partial_tail_ignored)
{
	uint32_t tok[11] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
	uint64_t seq[3] = {0, 0, 777};
	cr_assert_eq(kvr_hash_blocks(tok, 11, 4, NULL, NULL, seq), 2);
	cr_assert_eq(seq[1], 4945711292740353085ull);
	cr_assert_eq(seq[2], 777, "must not write past the complete blocks");
	cr_assert_eq(kvr_hash_blocks(tok, 3, 4, NULL, NULL, seq), 0);
	cr_assert_eq(kvr_hash_blocks(tok, 0, 4, NULL, NULL, seq), 0);
}

Test(hash, outputs_optional_and_consistent)
{
	uint32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
	uint64_t l1[2], s1[2], l2[2], s2[2];
	cr_assert_eq(kvr_hash_blocks(tok, 8, 4, NULL, l1, NULL), 2);
	cr_assert_eq(kvr_hash_blocks(tok, 8, 4, NULL, NULL, s1), 2);
	cr_assert_eq(kvr_hash_blocks(tok, 8, 4, NULL, NULL, NULL), 2);
	kvr_hash_blocks(tok, 8, 4, NULL, l2, s2);
	cr_assert_eq(memcmp(l1, l2, sizeof(l1)), 0);
	cr_assert_eq(memcmp(s1, s2, sizeof(s1)), 0);
}

Test(hash, lora_changes_local_not_chain_seed)
{
	uint32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
	uint64_t base[2], lora[2], lseq[2], empty[2];
	kvr_hash_blocks(tok, 8, 4, NULL, base, NULL);
	kvr_hash_blocks(tok, 8, 4, "", empty, NULL);
	cr_assert_eq(memcmp(base, empty, sizeof(base)), 0, "empty name means no adapter");
	kvr_hash_blocks(tok, 8, 4, "my-adapter", lora, lseq);
	uint64_t seed = 1337ull + XXH3_64bits_withSeed("my-adapter", 10, 0);
	cr_assert_eq(kvr_hash_lora_seed("my-adapter"), seed);
	cr_assert_eq(kvr_hash_lora_seed(NULL), 1337);
	cr_assert_eq(lora[0], XXH3_64bits_withSeed(tok, 16, seed));
	cr_assert_neq(lora[0], base[0]);
	uint64_t buf[2] = {lseq[0], lora[1]};
	cr_assert_eq(lseq[1], XXH3_64bits_withSeed(buf, 16, 1337), "chain seed stays 1337");
	uint64_t other[2];
	kvr_hash_blocks(tok, 8, 4, "other", other, NULL);
	cr_assert_neq(other[0], lora[0]);
}

/* Reference: the definition written out with a copy to a little-endian byte buffer. */
static void reference(const uint32_t *tok, size_t n, uint32_t bs, uint64_t *seq)
{
	size_t nb = n / bs;
	unsigned char *buf = malloc((size_t)bs * 4);
	uint64_t prev = 0;
	for (size_t i = 0; i < nb; i++) {
		for (uint32_t j = 0; j < bs; j++) {
			uint32_t t = tok[i * bs + j];
			for (int k = 0; k < 4; k++)
				buf[j * 4 + k] = (unsigned char)(t >> (8 * k));
		}
		uint64_t local = XXH3_64bits_withSeed(buf, (size_t)bs * 4, 1337);
		if (i == 0) {
			prev = local;
		} else {
			unsigned char pair[16];
			for (int k = 0; k < 8; k++) {
				pair[k] = (unsigned char)(prev >> (8 * k));
				pair[8 + k] = (unsigned char)(local >> (8 * k));
			}
			prev = XXH3_64bits_withSeed(pair, 16, 1337);
		}
		seq[i] = prev;
	}
	free(buf);
}

Test(hash, block_sizes_1_to_1024)
{
	size_t n = 4096 + 7;
	uint32_t *tok = malloc(n * sizeof(*tok));
	for (size_t i = 0; i < n; i++)
		tok[i] = (uint32_t)(i * 2654435761u);
	uint64_t *a = malloc(n * sizeof(*a)), *b = malloc(n * sizeof(*b));
	for (uint32_t bs = 1; bs <= 1024; bs = bs < 16 ? bs + 1 : bs * 2 + (bs == 512 ? 0 : 0)) {
		size_t nb = kvr_hash_blocks(tok, n, bs, NULL, NULL, a);
		cr_assert_eq(nb, n / bs, "block size %u", bs);
		reference(tok, n, bs, b);
		cr_assert_eq(memcmp(a, b, nb * sizeof(*a)), 0, "block size %u", bs);
	}
	free(tok);
	free(a);
	free(b);
}

Test(hash, prefix_sharing_and_long_input)
{
	/* 128k tokens at block size 16 = 8192 blocks; a prompt sharing the first 100 blocks shares
	 * exactly 100 sequence hashes. */
	size_t n = 131072, nb = n / 16;
	uint32_t *t1 = malloc(n * 4), *t2 = malloc(n * 4);
	for (size_t i = 0; i < n; i++)
		t1[i] = t2[i] = (uint32_t)i;
	t2[100 * 16 + 3] ^= 1;
	uint64_t *s1 = malloc(nb * 8), *s2 = malloc(nb * 8);
	cr_assert_eq(kvr_hash_blocks(t1, n, 16, NULL, NULL, s1), nb);
	cr_assert_eq(kvr_hash_blocks(t2, n, 16, NULL, NULL, s2), nb);
	for (size_t i = 0; i < nb; i++)
		cr_assert_eq(s1[i] == s2[i], i < 100, "block %zu", i);
	free(t1);
	free(t2);
	free(s1);
	free(s2);
}

Test(hash, extend_continues_chain)
{
	uint32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
	uint64_t full[3], ext[3], loc[3];
	size_t nb = 99;
	kvr_hash_blocks(tok, 12, 4, NULL, NULL, full);
	cr_assert_eq(kvr_hash_extend(&full[0], tok + 4, 8, 4, NULL, loc, ext, &nb), 0);
	cr_assert_eq(nb, 2);
	cr_assert_eq(ext[0], full[1]);
	cr_assert_eq(ext[1], full[2]);
	cr_assert_eq(loc[1], 483935686894639516ull);
	/* NULL parent starts a new chain. */
	cr_assert_eq(kvr_hash_extend(NULL, tok, 12, 4, NULL, NULL, ext, &nb), 0);
	cr_assert_eq(ext[1], full[1]);
}

Test(hash, bad_arguments)
{
	uint64_t out[4];
	size_t nb = 5;
	uint32_t tok[4] = {1, 2, 3, 4};
	cr_assert_eq(kvr_hash_blocks(NULL, 8, 4, NULL, out, out), 0);
	cr_assert_eq(kvr_hash_blocks(tok, 4, 0, NULL, out, out), 0);
	cr_assert_eq(kvr_hash_blocks(NULL, 0, 4, NULL, out, out), 0);
	cr_assert_eq(kvr_hash_extend(NULL, NULL, 8, 4, NULL, out, out, &nb), KVR_EINVAL);
	cr_assert_eq(nb, 0);
	cr_assert_eq(kvr_hash_extend(NULL, tok, 4, 0, NULL, out, out, &nb), KVR_EINVAL);
	cr_assert_eq(kvr_hash_extend(NULL, tok, 4, 4, NULL, out, out, NULL), KVR_EINVAL);
	cr_assert_eq(kvr_hash_extend(NULL, NULL, 0, 4, NULL, out, out, &nb), 0);
	cr_assert_eq(nb, 0);
}

/* The streaming form (for records another thread reads) writes what the plain form writes, as
 * (local, seq) pairs and to each copy asked for, from the root or after a parent, for the
 * flattened block size and the generic loop, at lengths that do and do not fill whole cache
 * lines. */
Test(hash, stream_matches_plain)
{
	size_t n = 255 * 32 + 5; /* tokens for the largest case, hashes to spare */
	uint32_t *tok = malloc(n * sizeof(*tok));
	for (size_t i = 0; i < n; i++)
		tok[i] = (uint32_t)(i * 2246822519u);
	uint64_t *pl = malloc(n * 8), *ps = malloc(n * 8), *pairs = malloc(2 * n * 8);
	uint64_t *kl = malloc(n * 8), *ks = malloc(n * 8);
	uint32_t sizes[] = {16, 4, 32};
	size_t counts[] = {0, 1, 7, 8, 9, 255};
	uint64_t parent = 0x0123456789abcdefull;
	for (size_t b = 0; b < sizeof(sizes) / sizeof(sizes[0]); b++) {
		for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
			for (int withp = 0; withp < 2; withp++) {
				uint32_t bs = sizes[b];
				size_t nb = counts[c];
				const uint64_t *par = withp ? &parent : NULL;
				memset(pairs, 0, 2 * n * 8);
				memset(kl, 0, n * 8);
				memset(ks, 0, n * 8);
				kvr_hash_chain_tokens(par, tok, nb, bs, 1337, pl, ps);
				kvr_hash_chain_tokens_stream(par, tok, nb, bs, 1337, pairs,
				                             c % 2 ? kl : NULL, ks);
				for (size_t i = 0; i < nb; i++) {
					cr_assert_eq(pairs[2 * i], pl[i], "bs %u n %zu", bs, nb);
					cr_assert_eq(pairs[2 * i + 1], ps[i], "bs %u n %zu", bs,
					             nb);
				}
				cr_assert_eq(memcmp(ps, ks, nb * 8), 0, "bs %u n %zu", bs, nb);
				if (c % 2)
					cr_assert_eq(memcmp(pl, kl, nb * 8), 0, "bs %u n %zu", bs,
					             nb);
				cr_assert_eq(pairs[2 * nb], 0, "nothing written past n");
				cr_assert_eq(pairs[2 * nb + 1], 0);
				cr_assert_eq(ks[nb], 0);
			}
		}
	}
	free(tok);
	free(pl);
	free(ps);
	free(pairs);
	free(kl);
	free(ks);
}
