/*
 * libFuzzer target: a vLLM KV event payload DECODED AND APPLIED (sync/feed_apply.c, the
 * validation of its events, the pending batches, the shard's index writes), where fuzz_feed.c
 * only decodes.  The payload is applied twice, as batches 0 and 1 of an endpoint that takes
 * its dp rank from the batch (so stores add copies and removals find what the first pass
 * stored), on a fresh events-mode router (block size 16, 2 shards, dp ranks 0-3 of worker 0).
 * The feed's per-thread state is built here, without sockets or a feed thread: this thread
 * plays the feed thread.
 *
 * Properties: no crash, no undefined behaviour, no out-of-bounds access (ASan, UBSan); nothing
 * counted lost (there is memory); once every rank the batches named is cleared (an
 * AllBlocksCleared batch), the index holds nothing of them.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/router_internal.h"
#include "kvrouter.h"
#include "sync/feed_decode.h"
#include "sync/feed_internal.h"

#define DPS 4

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.block_size = 16; /* the corpus's (tests/fuzz/make_feed_corpus.py) */
	c.n_shards = 2;
	c.shard_idle_spin_ns = 0;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r))
		abort();
	for (uint32_t dp = 0; dp < DPS; dp++)
		if (kvr_rank_add(r, (struct kvr_rank_id){0, dp}, 1, KVR_CAPACITY_NONE, 0))
			abort();
	static struct kvr_feed f;
	static struct ep e;
	memset(&f, 0, sizeof(f));
	memset(&e, 0, sizeof(e));
	f.r = r;
	f.pend = &f.bufs[0];
	f.mb = kvr_metrics_local(r->metrics);
	e.endpoint = "fuzz";
	e.dp_rank = KVR_FEED_DP_FROM_BATCH;
	struct kvr_feed_batch b = {0};
	if (kvr_feed_decode(&b, data, size) == 0) {
		kvr_feed_apply_batch(&f, &e, 0, &b);
		kvr_feed_apply_batch(&f, &e, 1, &b);
	}
	kvr_feed_settle(&f);
	if (getenv("FUZZ_FEED_APPLY_TRACE"))
		fprintf(stderr, "events %lu stored %lu removed %lu refused %lu unknown_rank %lu\n",
		        (unsigned long)e.st.events, (unsigned long)e.st.blocks_stored,
		        (unsigned long)e.st.blocks_removed, (unsigned long)e.st.refused,
		        (unsigned long)e.st.unknown_rank);
	if (e.st.lost)
		abort(); /* no allocation failed: nothing may be counted lost */
	/* AllBlocksCleared for every rank the endpoint fed. */
	static const uint8_t cleared[] = {0x82, 0xa6, 'e', 'v', 'e', 'n',  't',  's', 0x91,
	                                  0x81, 0xa4, 't', 'y', 'p', 'e',  0xb0, 'A', 'l',
	                                  'l',  'B',  'l', 'o', 'c', 'k',  's',  'C', 'l',
	                                  'e',  'a',  'r', 'e', 'd', 0xa2, 't',  's', 0x00};
	struct kvr_feed_batch clr = {0};
	if (kvr_feed_decode(&clr, cleared, sizeof(cleared)) != 0 || clr.n_ev != 1)
		abort();
	for (uint32_t i = 0; i < e.n_rs; i++) {
		clr.has_dp = true;
		clr.dp = e.rs[i].dp;
		kvr_feed_apply_batch(&f, &e, 2 + i, &clr);
	}
	kvr_feed_settle(&f);
	for (uint32_t i = 0; i < e.n_rs; i++) {
		size_t n = 0;
		int rc = kvr_rank_blocks(r, (struct kvr_rank_id){0, e.rs[i].dp}, NULL, 0, &n);
		if ((rc == 0 || rc == KVR_ERANGE) && n)
			abort(); /* cleared, yet blocks left */
	}
	kvr_feed_batch_fini(&b);
	kvr_feed_batch_fini(&clr);
	kvr_feed_pending_fini(&f.bufs[0]);
	kvr_feed_pending_fini(&f.bufs[1]);
	for (uint32_t i = 0; i < e.n_rs; i++)
		kvr_u64map_fini(&e.rs[i].other);
	kvr_free(e.rs, (size_t)e.cap_rs * sizeof(*e.rs));
	kvr_router_destroy(r);
	return 0;
}
