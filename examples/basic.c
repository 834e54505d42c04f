/*
 * examples/basic.c - README.md "Using the library", as a whole program: a router with one rank,
 * one request routed, prefilled, given output and finished; what the router then predicts; the
 * detail of a failing call; the metrics.
 *
 * Built against kvrouter.h and the shared library alone, as an application is.  The marked
 * regions, read in order (each without its indentation), are README.md's first C block word for
 * word: examples/check_excerpts.py fails the suite when the two differ, so an edit to one
 * needs the same edit to the other.  Everything between the regions checks what README.md and
 * kvrouter.h say the calls do.  Exit 0 when every check holds, 1 otherwise.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// clang-format off
/* README.md excerpt */
#include <kvrouter.h>

/* README.md excerpt end */
// clang-format on
#include "check.h"

/* The decision the router would take for tokens now, booking nothing (KVR_ROUTE_QUERY_ONLY). */
static struct kvr_decision query(struct kvr_router *r, const uint32_t *tokens, size_t n)
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
	CHECK(d.attempt == 0, "query-only route minted attempt %llu",
	      (unsigned long long)d.attempt);
	return d;
}

int main(void)
{
	/* A 100-token prompt (6 complete blocks of 16, 4 tokens over) and its 20 output tokens,
	 * the last of them the final one. */
	static uint32_t conversation[120];
	for (size_t i = 0; i < 120; i++)
		conversation[i] = 1000 + (uint32_t)i * 7;
	const uint32_t *prompt = conversation;
	size_t n = 100;
	const uint32_t *new_tokens = conversation + 100;
	size_t k = 20;
	bool last = true;

	// clang-format off
	/* README.md excerpt */
	struct kvr_config cfg;
	kvr_config_init(&cfg);                 /* block size 16, approx_lru, one shard per CPU, ... */
	struct kvr_router *r;
	int rc = kvr_router_create(&cfg, &r);  /* every call: 0 or a negative KVR_E* code */
	if (rc) { fprintf(stderr, "%s\n", kvr_last_error()); return 1; }
	/* README.md excerpt end */
	// clang-format on

	/* The defaults the comment names, as the router resolved them. */
	struct kvr_config eff;
	CHECK(kvr_router_get_config(r, &eff) == 0, "get_config");
	CHECK(eff.block_size == 16, "block_size %u", eff.block_size);
	CHECK(eff.mode == KVR_MODE_APPROX_LRU, "mode %d", (int)eff.mode);
	CHECK(cfg.n_shards == 0, "n_shards default %u, not 0 (one per CPU)", cfg.n_shards);
	CHECK(eff.lane_capacity == 4095 && eff.lane_soft_depth == 127,
	      "lane_capacity %u, lane_soft_depth %u (README: 4,095 and 127)", eff.lane_capacity,
	      eff.lane_soft_depth);
	CHECK(eff.shard_idle_spin_ns == 50000 && eff.booking_lazy_ns == 250000,
	      "shard_idle_spin_ns %llu, booking_lazy_ns %llu (README: 50 us and 250 us)",
	      (unsigned long long)eff.shard_idle_spin_ns, (unsigned long long)eff.booking_lazy_ns);

	// clang-format off
	/* README.md excerpt */

	/* ranks: (worker id, dp rank), incarnation, KV capacity in blocks, max batched tokens */
	rc = kvr_rank_add(r, (struct kvr_rank_id){.worker_id = 7, .dp_rank = 0}, 1, 65536, 8192);
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "kvr_rank_add: %d", rc);
	const struct kvr_rank_id rank = {.worker_id = 7, .dp_rank = 0};
	struct kvr_rank_stats st;
	CHECK(kvr_rank_get_stats(r, rank, &st) == 0 && st.capacity_blocks == 65536 &&
	          st.incarnation == 1,
	      "rank stats after add: capacity %llu, incarnation %llu",
	      (unsigned long long)st.capacity_blocks, (unsigned long long)st.incarnation);

	// clang-format off
	/* README.md excerpt */

	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = prompt;  q.n_tokens = n;    /* borrowed for the call */
	struct kvr_decision d;
	rc = kvr_route(r, &q, &d);             /* d.rank, d.overlap_blocks, d.attempt */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0 && d.status == KVR_DECIDED, "kvr_route: %d, status %d", rc, d.status);
	CHECK(d.rank.worker_id == 7 && d.rank.dp_rank == 0, "routed to %llu/%u",
	      (unsigned long long)d.rank.worker_id, d.rank.dp_rank);
	CHECK(d.overlap_blocks == 0 && d.required_blocks == 6 && d.attempt != 0,
	      "first decision: overlap %u, required %u, attempt %llu", d.overlap_blocks,
	      d.required_blocks, (unsigned long long)d.attempt);

	/* Engine ground truth (README.md, "Engine ground truth heals the prediction"): the engine
	 * found nothing cached, as predicted; nothing to heal. */
	CHECK(kvr_request_cached(r, d.attempt, 0) == 0, "kvr_request_cached");

	// clang-format off
	/* README.md excerpt */

	rc = kvr_request_prefill_done(r, d.attempt);
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "prefill_done: %d", rc);
	// clang-format off
	/* README.md excerpt */
	rc = kvr_request_output_ex(r, d.attempt, new_tokens, k, /* completed output blocks are */
	                           last ? KVR_OUTPUT_FINAL : 0); /* predicted; the final token gets no KV */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "output_ex: %d", rc);
	// clang-format off
	/* README.md excerpt */
	rc = kvr_request_finish(r, d.attempt); /* or kvr_request_abort; later calls: KVR_ESTALE */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "finish: %d", rc);
	CHECK(kvr_request_finish(r, d.attempt) == KVR_ESTALE, "second finish not KVR_ESTALE");
	CHECK(kvr_request_abort(r, d.attempt) == KVR_ESTALE, "abort after finish not KVR_ESTALE");
	CHECK(kvr_request_output(r, d.attempt, new_tokens, 1) == KVR_ESTALE,
	      "output after finish not KVR_ESTALE");

	/* The finish is posted to the rank's shard; kvr_router_sync waits until it is applied. */
	CHECK(kvr_router_sync(r, 5000) == 0, "kvr_router_sync");
	CHECK(kvr_rank_get_stats(r, rank, &st) == 0 && st.active_requests == 0 &&
	          st.active_prefill_tokens == 0,
	      "load left after finish: %llu requests, %llu prefill tokens",
	      (unsigned long long)st.active_requests, (unsigned long long)st.active_prefill_tokens);

	/* What the rank now caches, as kvr_request_output documents it: 100 prompt + 20 output
	 * tokens, the final one without KV, so floor(119 / 16) = 7 blocks: the prompt's 6 and one
	 * completed by output. */
	struct kvr_decision again = query(r, conversation, 120);
	CHECK(again.overlap_blocks == 7 && again.cached_tokens == 7 * 16,
	      "prompt + output: predicted overlap %u blocks, want 7", again.overlap_blocks);
	again = query(r, prompt, n);
	CHECK(again.overlap_blocks == 6, "prompt again: predicted overlap %u blocks, want 6",
	      again.overlap_blocks);
	uint64_t held[16];
	size_t n_held = 0;
	CHECK(kvr_rank_blocks(r, rank, held, 16, &n_held) == 0 && n_held == 7,
	      "kvr_rank_blocks: %zu blocks, want 7", n_held);

	/* A failing call: a code, and the detail README.md quotes; a success leaves it. */
	struct kvr_request empty;
	kvr_request_init(&empty);
	empty.tokens = prompt;
	empty.n_tokens = 0;
	rc = kvr_route(r, &empty, &d);
	CHECK(rc == KVR_EINVAL, "route of 0 tokens: %d", rc);
	const char *want = "kvr_route: req.n_tokens is 0; a prompt needs at least one token";
	CHECK(strcmp(kvr_last_error(), want) == 0, "detail \"%s\", README.md says \"%s\"",
	      kvr_last_error(), want);
	(void)query(r, prompt, n);
	CHECK(strcmp(kvr_last_error(), want) == 0, "a success changed the detail");
	CHECK(strcmp(kvr_strerror(KVR_ESTALE), kvr_strerror(KVR_EINVAL)) != 0,
	      "kvr_strerror says the same for two codes");
	CHECK(kvr_rank_add(r, rank, 1, 65536, 8192) == KVR_EEXIST, "second add not KVR_EEXIST");

	/* Metrics: ask for the size, then render (README.md, "Metrics"). */
	size_t len = 0;
	rc = kvr_metrics_render(r, NULL, 0, &len);
	CHECK(rc == KVR_ERANGE && len > 1, "size query: %d, len %zu", rc, len);
	char *text = malloc(len);
	CHECK(text && kvr_metrics_render(r, text, len, &len) == 0, "metrics render");
	static const char *const series[] = {"kvr_route_hash_seconds",
	                                     "kvr_route_match_seconds",
	                                     "kvr_events_total",
	                                     "kvr_evictions_total",
	                                     "kvr_lease_expiries_total",
	                                     "kvr_queue_depth",
	                                     "kvr_queue_wait_seconds",
	                                     "kvr_rank_active_requests",
	                                     "kvr_lane_full_waits_total",
	                                     "kvr_lane_soft_throttles_total",
	                                     "kvr_allocator"};
	for (size_t i = 0; text && i < sizeof(series) / sizeof(series[0]); i++)
		CHECK(strstr(text, series[i]) != NULL, "metric %s missing", series[i]);
	/* The allocator the link line gave the library (meson and link_installed.sh say which to
	 * expect: jemalloc where the build has it, README.md "Link after `meson install`"). */
	const char *alloc_want = getenv("KVR_EXPECT_ALLOCATOR");
	if (text && alloc_want) {
		char line[64];
		snprintf(line, sizeof(line), "kvr_allocator{name=\"%s\"} 1\n", alloc_want);
		CHECK(strstr(text, line) != NULL, "metrics: no %s", line);
	}
	free(text);

	// clang-format off
	/* README.md excerpt */
	kvr_router_destroy(r);
	/* README.md excerpt end */
	// clang-format on
	kvr_router_destroy(NULL); /* a no-op */

	if (fails)
		fprintf(stderr, "examples/basic: %d checks failed\n", fails);
	else
		printf("examples/basic: ok\n");
	return fails ? 1 : 0;
}
