/* libFuzzer target: the vLLM KV event payload decoder (outside input from the network) must
 * never crash, leak or read out of bounds, whatever the bytes; a decode that succeeds must be
 * self-consistent (every event's slices inside the batch's arrays), and decoding into a
 * reused batch must give the same result as into a fresh one. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sync/feed_decode.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(const struct kvr_feed_batch *b)
{
	for (uint32_t i = 0; i < b->n_ev; i++) {
		const struct kvr_fev *e = &b->ev[i];
		if (e->type > KVR_FEV_CLEARED)
			abort();
		if ((uint64_t)e->hash_off + e->n_hashes > b->n_hashes ||
		    (uint64_t)e->tok_off + e->n_tokens > b->n_tokens)
			abort();
		if (e->lora_off >= 0 &&
		    ((uint32_t)e->lora_off >= b->n_strs ||
		     memchr(b->strs + e->lora_off, 0, b->n_strs - (uint32_t)e->lora_off) == NULL))
			abort();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct kvr_feed_batch reused;
	struct kvr_feed_batch fresh = {0};
	int rc1 = kvr_feed_decode(&fresh, data, size);
	int rc2 = kvr_feed_decode(&reused, data, size);
	if (rc1 != rc2 && rc1 != -2 && rc2 != -2)
		abort();
	if (rc1 == 0) {
		check(&fresh);
		if (rc2 == 0 && (fresh.n_ev != reused.n_ev || fresh.n_hashes != reused.n_hashes ||
		                 (fresh.n_hashes && memcmp(fresh.hashes, reused.hashes,
		                                           fresh.n_hashes * sizeof(uint64_t))) ||
		                 fresh.n_tokens != reused.n_tokens ||
		                 (fresh.n_tokens && memcmp(fresh.tokens, reused.tokens,
		                                           fresh.n_tokens * sizeof(uint32_t)))))
			abort();
	} else if (fresh.n_ev) {
		abort(); /* all or nothing */
	}
	kvr_feed_batch_fini(&fresh);
	if (size == 0)
		kvr_feed_batch_fini(&reused); /* keep the leak checker quiet at exit */
	return 0;
}
