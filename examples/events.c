/*
 * examples/events.c - README.md "Using the library", events mode: a router that learns what a
 * rank caches from its engine's KV events (stored, removed, cleared) instead of predicting it,
 * fed by hand with kvr_events_apply; then the ZeroMQ feed's calls as README.md shows them.
 *
 * Built against kvrouter.h and the shared library alone.  The marked regions, read in order
 * (each without its indentation), are README.md's events-mode C block word for word
 * (examples/check_excerpts.py).  Exit 0 when every check holds, 1 otherwise.
 */
#include <stdio.h>
#include <string.h>

#include <kvrouter.h>

#include "check.h"

/* What on_event_gap was told last (it runs on the thread that called kvr_events_apply). */
static int gaps;
static uint64_t gap_expected, gap_got;

static void on_gap(void *ctx, uint64_t worker_id, uint32_t dp_rank, uint64_t expected, uint64_t got)
{
	(void)ctx;
	(void)worker_id;
	(void)dp_rank;
	gaps++;
	gap_expected = expected;
	gap_got = got;
}

/* The predicted cached prefix of tokens on the router's best rank, booking nothing. */
static uint32_t overlap(struct kvr_router *r, const uint32_t *tokens, size_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tokens;
	q.n_tokens = n;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	struct kvr_decision d;
	memset(&d, 0, sizeof(d));
	int rc = kvr_route(r, &q, &d);
	CHECK(rc == 0, "query-only route: %d", rc);
	return d.overlap_blocks;
}

int main(void)
{
	static uint32_t prompt[40]; /* two complete blocks of 16, 8 tokens over */
	for (size_t i = 0; i < 40; i++)
		prompt[i] = 500 + (uint32_t)i * 3;
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.on_event_gap = on_gap;
	int rc;

	// clang-format off
	/* README.md excerpt */
	cfg.mode = KVR_MODE_EVENTS;            /* then kvr_router_create and kvr_rank_add as above */
	/* README.md excerpt end */
	// clang-format on
	struct kvr_router *r;
	if (kvr_router_create(&cfg, &r) != 0) {
		fprintf(stderr, "kvr_router_create: %s\n", kvr_last_error());
		return 1;
	}
	CHECK(kvr_rank_add(r, (struct kvr_rank_id){.worker_id = 7, .dp_rank = 0}, 1, 65536, 8192) ==
	          0,
	      "kvr_rank_add");
	CHECK(overlap(r, prompt, 40) == 0, "a fresh rank holds nothing");

	// clang-format off
	/* README.md excerpt */
	struct kvr_rank_id rank = {.worker_id = 7, .dp_rank = 0};
	/* the engine stored the prompt's first two blocks, under its own hashes 0xa1 and 0xa2 */
	struct kvr_event_block stored[2] = {
	    {.ext_hash = 0xa1, .tokens = prompt, .n_tokens = 16},
	    {.ext_hash = 0xa2, .tokens = prompt + 16, .n_tokens = 16},
	};
	struct kvr_event ev = {.type = KVR_EVENT_STORED, .event_id = 1, .blocks = stored, .n_blocks = 2};
	rc = kvr_events_apply(r, rank, &ev);   /* a prompt that starts with them: overlap 2 blocks */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "stored: %d", rc);
	CHECK(overlap(r, prompt, 40) == 2, "after stored: overlap %u, want 2",
	      overlap(r, prompt, 40));
	uint64_t held[4];
	size_t n_held = 0;
	CHECK(kvr_rank_blocks(r, rank, held, 4, &n_held) == 0 && n_held == 2,
	      "kvr_rank_blocks: %zu, want 2", n_held);

	// clang-format off
	/* README.md excerpt */

	/* then it evicted the second; event ids increase per rank (an old one: KVR_ESTALE) */
	uint64_t gone[1] = {0xa2};
	ev = (struct kvr_event){.type = KVR_EVENT_REMOVED, .event_id = 2, .removed = gone, .n_removed = 1};
	rc = kvr_events_apply(r, rank, &ev);   /* overlap 1 now */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "removed: %d", rc);
	CHECK(overlap(r, prompt, 40) == 1, "after removed: overlap %u, want 1",
	      overlap(r, prompt, 40));
	rc = kvr_events_apply(r, rank, &ev);
	CHECK(rc == KVR_ESTALE, "event id 2 again: %d, want KVR_ESTALE", rc);

	/* A block stored below one the rank holds names its parent (the engine's hash). */
	struct kvr_event_block again = {.ext_hash = 0xa3, .tokens = prompt + 16, .n_tokens = 16};
	ev = (struct kvr_event){.type = KVR_EVENT_STORED,
	                        .event_id = 3,
	                        .has_parent = true,
	                        .parent_ext_hash = 0xa1,
	                        .blocks = &again,
	                        .n_blocks = 1};
	CHECK(kvr_events_apply(r, rank, &ev) == 0, "stored below 0xa1");
	CHECK(overlap(r, prompt, 40) == 2, "after stored with parent: overlap %u, want 2",
	      overlap(r, prompt, 40));
	/* Below a parent the rank does not hold: KVR_ENOENT, nothing applied. */
	ev.event_id = 4;
	ev.parent_ext_hash = 0xdead;
	CHECK(kvr_events_apply(r, rank, &ev) == KVR_ENOENT, "unknown parent not KVR_ENOENT");

	/* Ids that jump ahead are applied and reported as a gap through on_event_gap, on this
	 * thread, before kvr_events_apply returns. */
	ev = (struct kvr_event){.type = KVR_EVENT_CLEARED, .event_id = 9};
	CHECK(kvr_events_apply(r, rank, &ev) == 0, "cleared");
	CHECK(gaps == 1 && gap_expected == 5 && gap_got == 9,
	      "on_event_gap: %d calls, expected %llu got %llu (want 1, 5, 9)", gaps,
	      (unsigned long long)gap_expected, (unsigned long long)gap_got);
	CHECK(overlap(r, prompt, 40) == 0, "after cleared: overlap %u, want 0",
	      overlap(r, prompt, 40));
	struct kvr_rank_stats st;
	CHECK(kvr_rank_get_stats(r, rank, &st) == 0 && st.event_id == 9 && st.event_gaps == 1,
	      "rank stats: event_id %llu, event_gaps %llu", (unsigned long long)st.event_id,
	      (unsigned long long)st.event_gaps);

	/* The ZeroMQ feed as README.md calls it (no publisher runs: the socket connects in the
	 * background and retries, so nothing arrives).  Without -Dzmq every call is
	 * KVR_ENOTSUP. */
	if (kvr_feed_create(NULL, NULL, NULL) == KVR_ENOTSUP) {
		printf("examples/events: built without the KV event feed, feed calls skipped\n");
	} else {
		struct kvr_feed *f;
		uint32_t id = 0;
		CHECK(kvr_feed_create(r, NULL, &f) == 0, "kvr_feed_create");
		CHECK(kvr_feed_add(
		          f,
		          &(struct kvr_feed_endpoint){.endpoint = "tcp://127.0.0.1:5557",
		                                      .replay_endpoint = "tcp://127.0.0.1:5558",
		                                      .worker_id = 7,
		                                      .dp_rank = 0},
		          &id) == 0,
		      "kvr_feed_add");
		struct kvr_feed_stats fs;
		CHECK(kvr_feed_get_stats(f, id, &fs) == 0 && fs.batches == 0, "kvr_feed_get_stats");
		CHECK(kvr_feed_remove(f, id) == 0, "kvr_feed_remove");
		CHECK(kvr_feed_remove(f, id) == KVR_ENOENT, "second remove not KVR_ENOENT");
		kvr_feed_destroy(f); /* before the router */
	}
	kvr_router_destroy(r);

	if (fails)
		fprintf(stderr, "examples/events: %d checks failed\n", fails);
	else
		printf("examples/events: ok\n");
	return fails ? 1 : 0;
}
