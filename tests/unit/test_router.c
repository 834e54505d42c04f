/* The router end to end: affinity, load, pinning, query-only, lifecycle, stale attempts, rank
 * reset, events vs approx_lru agreement, the queue, TTL and lease expiry on virtual time, and
 * every bad input the API can be given. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <string.h>
#include <stdlib.h>

#include "kvrouter.h"
#include "tests/common/router_prompts.h"

static void sync_config(struct kvr_config *c, enum kvr_mode mode, kvr_clock_fn clk)
{
	kvr_config_init(c);
	c->n_shards = 2;
	c->mode = mode;
	c->now_ns = clk;
	c->sync_booking = true; /* back-to-back decisions see each other's blocks */
}

static struct kvr_router *make(enum kvr_mode mode, int n_ranks, uint64_t cap, double qthr)
{
	struct kvr_config c;
	sync_config(&c, mode, vclock);
	c.queue_threshold = qthr;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (int w = 0; w < n_ranks; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, cap, 1024), 0);
	return r;
}

static struct kvr_decision route(struct kvr_router *r, const uint32_t *t, size_t n, uint32_t flags)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.flags = flags;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	return d;
}

static struct kvr_rank_stats stats(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0);
	return s;
}

Test(router, prefix_affinity_when_loads_equal)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 4, 100000, 0);
	uint32_t t[512];
	prompt(t, 512, 1);
	struct kvr_decision first = route(r, t, 512, 0);
	cr_assert_eq(first.overlap_blocks, 0);
	cr_assert_eq(first.required_blocks, 32);
	cr_assert_eq(kvr_request_finish(r, first.attempt), 0);
	for (int i = 0; i < 20; i++) {
		struct kvr_decision d = route(r, t, 512, 0);
		cr_assert_eq(d.rank.worker_id, first.rank.worker_id);
		cr_assert_eq(d.overlap_blocks, 32);
		cr_assert_eq(d.cached_tokens, 512);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	}
	kvr_router_destroy(r);
}

Test(router, load_wins_when_one_rank_overloaded)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 2, 100000, 0);
	uint32_t t[256], big[16000];
	prompt(t, 256, 2);
	struct kvr_decision a = route(r, t, 256, 0);
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
	/* Overload a's rank with in-flight prefill pinned there. */
	struct kvr_request q;
	kvr_request_init(&q);
	prompt(big, 16000, 3);
	q.tokens = big;
	q.n_tokens = 16000;
	q.pinned = &a.rank;
	struct kvr_decision hog;
	cr_assert_eq(kvr_route(r, &q, &hog), 0);
	cr_assert_eq(hog.rank.worker_id, a.rank.worker_id);
	struct kvr_decision d = route(r, t, 256, 0);
	cr_assert_neq(d.rank.worker_id, a.rank.worker_id, "16 cached blocks must not beat 1000");
	kvr_router_destroy(r);
}

Test(router, pinned_and_allow_list)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 4, 100000, 0);
	uint32_t t[64];
	prompt(t, 64, 4);
	struct kvr_rank_id allow[2] = {{2, 0}, {3, 0}};
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	q.allow = allow;
	q.n_allow = 2;
	for (int i = 0; i < 30; i++) {
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert(d.rank.worker_id == 2 || d.rank.worker_id == 3);
		kvr_request_finish(r, d.attempt);
	}
	q.pinned = &allow[0];
	for (int i = 0; i < 5; i++) {
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(d.rank.worker_id, 2);
		kvr_request_finish(r, d.attempt);
	}
	struct kvr_rank_id outside = {0, 0}, unknown = {99, 0};
	q.pinned = &outside;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "pinned outside the allow-list");
	q.allow = NULL;
	q.n_allow = 0;
	q.pinned = &unknown;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_ENOENT);
	q.pinned = NULL;
	q.allow = &unknown;
	q.n_allow = 1;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_ENOENT, "no known rank in the allow-list");
	kvr_router_destroy(r);
}

Test(router, query_only_changes_nothing)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 2, 100000, 0);
	uint32_t t[320];
	prompt(t, 320, 5);
	struct kvr_decision d = route(r, t, 320, KVR_ROUTE_QUERY_ONLY);
	cr_assert_eq(d.attempt, 0);
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats s = stats(r, w);
		cr_assert_eq(s.indexed_blocks, 0);
		cr_assert_eq(s.active_requests, 0);
	}
	d = route(r, t, 320, 0);
	cr_assert_eq(d.overlap_blocks, 0, "the query-only call stored nothing");
	kvr_router_destroy(r);
}

Test(router, finish_and_abort_return_load_to_zero)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 100000, 0);
	uint32_t t[333];
	prompt(t, 333, 6);
	struct kvr_decision a = route(r, t, 333, 0), b = route(r, t, 333, 0);
	struct kvr_rank_stats s = stats(r, 0);
	cr_assert_eq(s.active_requests, 2);
	cr_assert_eq(s.active_blocks, 20, "shared blocks count once");
	cr_assert_eq(s.active_prefill_tokens, 333 + (333 - 320));
	cr_assert_eq(kvr_request_prefill_done(r, a.attempt), 0);
	cr_assert_eq(stats(r, 0).active_prefill_tokens, 333 - 320);
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
	cr_assert_eq(kvr_request_abort(r, b.attempt), 0);
	s = stats(r, 0);
	cr_assert_eq(s.active_requests, 0);
	cr_assert_eq(s.active_blocks, 0);
	cr_assert_eq(s.active_prefill_tokens, 0);
	cr_assert_eq(s.indexed_blocks, 20, "released blocks stay cached");
	kvr_router_destroy(r);
}

Test(router, stale_attempts)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 100000, 0);
	uint32_t t[64];
	prompt(t, 64, 7);
	struct kvr_decision d = route(r, t, 64, 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), KVR_ESTALE);
	cr_assert_eq(kvr_request_abort(r, d.attempt), KVR_ESTALE);
	cr_assert_eq(kvr_request_prefill_done(r, d.attempt), KVR_ESTALE);
	cr_assert_eq(kvr_request_output(r, d.attempt, t, 16), KVR_ESTALE);
	cr_assert_eq(kvr_request_finish(r, 0), KVR_EINVAL);
	cr_assert_eq(kvr_request_finish(r, (12345ull << 16) | 0), KVR_ESTALE, "never issued");
	cr_assert_eq(kvr_request_output(r, d.attempt, NULL, 3), KVR_EINVAL);
	kvr_router_destroy(r);
}

/* Two routers of one process (one per model, or a router and the one created to replace it)
 * with the same ranks: a finish given the wrong handle must be refused, not end the other
 * router's attempt that happens to carry the same id (every router counted its ids from 1). */
#define XR_N 64
static int refused(int rc)
{
	return rc == KVR_ESTALE || rc == KVR_ENOENT;
}

static void route_all(struct kvr_router *r, uint64_t *ids)
{
	uint32_t t[64];
	for (int i = 0; i < XR_N; i++) {
		prompt(t, 64, 100 + (uint32_t)i);
		ids[i] = route(r, t, 64, 0).attempt;
	}
}

static void check_refuses(struct kvr_router *r, const uint64_t *foreign, uint64_t live)
{
	uint32_t t[16];
	prompt(t, 16, 5);
	for (int i = 0; i < XR_N; i++) {
		cr_assert(refused(kvr_request_prefill_done(r, foreign[i])), "prefill_done %d", i);
		cr_assert(refused(kvr_request_output(r, foreign[i], t, 16)), "output %d", i);
		cr_assert(refused(kvr_request_finish(r, foreign[i])), "finish %d", i);
		cr_assert(refused(kvr_request_abort(r, foreign[i])), "abort %d", i);
	}
	cr_assert_eq(stats(r, 0).active_requests + stats(r, 1).active_requests, live,
	             "another router's ids ended attempts here");
}

static void finish_all(struct kvr_router *r, const uint64_t *ids)
{
	for (int i = 0; i < XR_N; i++)
		cr_assert_eq(kvr_request_finish(r, ids[i]), 0, "own attempt %d", i);
}

Test(router, attempts_of_another_router_are_refused)
{
	struct kvr_router *a = make(KVR_MODE_APPROX_LRU, 2, 100000, 0);
	struct kvr_router *b = make(KVR_MODE_APPROX_LRU, 2, 100000, 0);
	uint64_t ia[XR_N], ib[XR_N], ic[XR_N];
	route_all(a, ia);
	route_all(b, ib);
	check_refuses(b, ia, XR_N);
	check_refuses(a, ib, XR_N);
	finish_all(b, ib);
	/* a is replaced by c while a's requests are still in flight: their late calls reach c. */
	kvr_router_destroy(a);
	struct kvr_router *c = make(KVR_MODE_APPROX_LRU, 2, 100000, 0);
	route_all(c, ic);
	check_refuses(c, ia, XR_N);
	check_refuses(c, ib, XR_N);
	finish_all(c, ic);
	kvr_router_destroy(b);
	kvr_router_destroy(c);
}

Test(router, output_blocks_extend_the_prefix)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 3, 100000, 0);
	uint32_t full[200];
	prompt(full, 200, 8);
	/* prompt = first 40 tokens (2 blocks + 8), output = the next 120 tokens */
	struct kvr_decision d = route(r, full, 40, 0);
	cr_assert_eq(kvr_request_output(r, d.attempt, full + 40, 50), 0);
	cr_assert_eq(kvr_request_output(r, d.attempt, full + 90, 70), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	struct kvr_decision e = route(r, full, 200, 0);
	cr_assert_eq(e.rank.worker_id, d.rank.worker_id);
	cr_assert_eq(e.overlap_blocks, 9,
	             "2 prompt + 7 output blocks cached: the final token never gets KV, so the "
	             "block it completes (160 = 10 blocks) is not, as in vLLM: floor(159 / 16)");
	kvr_router_destroy(r);
}

static size_t rank_blocks(struct kvr_router *r, uint64_t w)
{
	uint64_t h[64];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){w, 0}, h, 64, &n), 0);
	return n;
}

/* vLLM computes a token's KV when it feeds the token back, so after P prompt and O output tokens
 * it caches floor((P + O - 1) / B) blocks.  Hand-worked at B = 16, tokens reported one at a time
 * as a streaming frontend does; `end` finishes (0) or aborts (1). */
static void vllm_rule(uint32_t p, uint32_t o, size_t want, int end)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
	uint32_t full[128];
	prompt(full, 128, 17);
	struct kvr_decision d = route(r, full, p, 0);
	for (uint32_t i = 0; i < o; i++) {
		cr_assert_eq(kvr_request_output(r, d.attempt, full + p + i, 1), 0);
		/* after output i + 1: p + i tokens have KV */
		cr_assert_eq(rank_blocks(r, 0), (p + i) / 16, "P %u, after output %u", p, i + 1);
	}
	cr_assert_eq(end ? kvr_request_abort(r, d.attempt) : kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(rank_blocks(r, 0), want, "P %u + O %u: floor((P+O-1)/16) = %zu blocks", p, o,
	             want);
	struct kvr_decision e = route(r, full, p + o, 0);
	cr_assert_eq(e.overlap_blocks, want);
	cr_assert_eq(kvr_request_finish(r, e.attempt), 0);
	kvr_router_destroy(r);
}

Test(router, vllm_final_token_has_no_kv)
{
	vllm_rule(10, 6, 0, 0);  /* P + O = 16: the only block is completed by the final token */
	vllm_rule(10, 7, 1, 0);  /* 16 tokens have KV: one block */
	vllm_rule(10, 6, 0, 1);  /* abort drops the final token the same way */
	vllm_rule(32, 1, 2, 0);  /* prompt blocks are computed by the prefill */
	vllm_rule(32, 0, 2, 0);  /* with no output too: floor(P / B), not floor((P - 1) / B) */
	vllm_rule(32, 0, 2, 1);  /* and at an abort */
	vllm_rule(32, 16, 2, 0); /* 47 tokens with KV */
	vllm_rule(32, 17, 3, 0); /* 48 */
	vllm_rule(5, 60, 4, 0);  /* 64 */
}

/* kvr_request_output_ex: the frontend says which token is final, so a token known not to be
 * final has KV at once (vLLM allocates its slot as it schedules the next step): after P prompt
 * and i + 1 output tokens, P + i + 1 tokens have KV (kvr_request_output: P + i), and the final
 * one still never gets KV. */
static void vllm_rule_exact(uint32_t p, uint32_t o, size_t want)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
	uint32_t full[128];
	prompt(full, 128, 17);
	struct kvr_decision d = route(r, full, p, 0);
	for (uint32_t i = 0; i < o; i++) {
		bool final = i + 1 == o;
		cr_assert_eq(kvr_request_output_ex(r, d.attempt, full + p + i, 1,
		                                   final ? KVR_OUTPUT_FINAL : 0),
		             0);
		size_t with_kv = p + i + (final ? 0 : 1);
		cr_assert_eq(rank_blocks(r, 0), with_kv / 16, "P %u, after output %u", p, i + 1);
	}
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(rank_blocks(r, 0), want, "P %u + O %u", p, o);
	struct kvr_decision e = route(r, full, p + o, 0);
	cr_assert_eq(e.overlap_blocks, want);
	cr_assert_eq(kvr_request_finish(r, e.attempt), 0);
	kvr_router_destroy(r);
}

Test(router, output_final_flag_is_exact)
{
	vllm_rule_exact(10, 6, 0);  /* the only block is completed by the final token */
	vllm_rule_exact(10, 7, 1);  /* counted as token 6 is reported, not as token 7 is */
	vllm_rule_exact(32, 17, 3); /* 48 */
	vllm_rule_exact(5, 60, 4);  /* 64 */
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
	uint32_t t[64];
	prompt(t, 64, 19);
	struct kvr_decision d = route(r, t, 15, 0);
	cr_assert_eq(kvr_request_output_ex(r, d.attempt, t + 15, 1, 2), KVR_EINVAL, "bad flags");
	cr_assert_eq(kvr_request_output_ex(r, d.attempt, NULL, 1, 0), KVR_EINVAL);
	cr_assert_eq(kvr_request_output_ex(r, d.attempt, NULL, 0, KVR_OUTPUT_FINAL), 0);
	cr_assert_eq(rank_blocks(r, 0), 0);
	/* mixed: token 15 of unknown finality is held back, then joins with token 16 (not final) */
	cr_assert_eq(kvr_request_output(r, d.attempt, t + 15, 1), 0);
	cr_assert_eq(rank_blocks(r, 0), 0);
	cr_assert_eq(kvr_request_output_ex(r, d.attempt, t + 16, 1, 0), 0);
	cr_assert_eq(rank_blocks(r, 0), 1);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_request_output_ex(r, d.attempt, t + 17, 1, 0), KVR_ESTALE);
	kvr_router_destroy(r);
}

/* The block a non-final token opens is taken at once, evicting on a full rank, as vLLM's
 * scheduler does in the step after sampling it (kvr-replay's Mooncake seed 12 request 514 was
 * over-predicted by that block with kvr_request_output). */
Test(router, output_not_final_evicts_at_once)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 4, 0);
	uint32_t x[32], a[40];
	prompt(x, 32, 21);
	prompt(a, 40, 22);
	struct kvr_decision dx = route(r, x, 32, 0);
	cr_assert_eq(kvr_request_finish(r, dx.attempt), 0);
	cr_assert_eq(rank_blocks(r, 0), 2, "x cached");
	struct kvr_decision da = route(r, a, 32, 0);
	cr_assert_eq(rank_blocks(r, 0), 4, "full: x's 2 and a's 2");
	cr_assert_eq(kvr_request_output_ex(r, da.attempt, a + 32, 1, 0), 0);
	cr_assert_eq(rank_blocks(r, 0), 3, "a's third block (token 32's slot) evicted one of x's");
	cr_assert_eq(kvr_request_output_ex(r, da.attempt, a + 33, 1, KVR_OUTPUT_FINAL), 0);
	cr_assert_eq(kvr_request_finish(r, da.attempt), 0);
	struct kvr_decision e = route(r, x, 32, 0);
	cr_assert_eq(e.overlap_blocks, 1);
	cr_assert_eq(kvr_request_finish(r, e.attempt), 0);
	kvr_router_destroy(r);
}

Test(router, output_chunking_does_not_change_the_prediction)
{
	/* 10 + 23 output tokens (32 with KV: 2 blocks) in chunks of 1, 7, 16 and 23 tokens */
	const uint32_t chunks[] = {1, 7, 16, 23};
	for (size_t c = 0; c < 4; c++) {
		struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
		uint32_t full[64];
		prompt(full, 64, 18);
		struct kvr_decision d = route(r, full, 10, 0);
		for (uint32_t i = 0; i < 23; i += chunks[c]) {
			uint32_t k = 23 - i < chunks[c] ? 23 - i : chunks[c];
			cr_assert_eq(kvr_request_output(r, d.attempt, full + 10 + i, k), 0);
		}
		cr_assert_eq(kvr_request_output(r, d.attempt, full, 0), 0, "an empty report");
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		cr_assert_eq(rank_blocks(r, 0), 2, "chunk %u", chunks[c]);
		struct kvr_decision e = route(r, full, 33, 0);
		cr_assert_eq(e.overlap_blocks, 2, "chunk %u", chunks[c]);
		kvr_router_destroy(r);
	}
}

Test(router, rank_reset_mid_request)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 100000, 0);
	uint32_t t[160];
	prompt(t, 160, 9);
	struct kvr_decision d = route(r, t, 160, 0);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_reset(r, id, 0), KVR_ESTALE, "older incarnation");
	cr_assert_eq(kvr_rank_reset(r, id, 2), 0);
	struct kvr_rank_stats s = stats(r, 0);
	cr_assert_eq(s.incarnation, 2);
	cr_assert_eq(s.indexed_blocks, 0);
	cr_assert_eq(s.active_requests, 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), KVR_ESTALE, "attempt of the old life");
	cr_assert_eq(route(r, t, 160, 0).overlap_blocks, 0);
	cr_assert_eq(kvr_rank_set_capacity(r, id, 1, 50), KVR_ESTALE);
	cr_assert_eq(kvr_rank_set_capacity(r, id, 3, 50), 0, "new incarnation: fresh life");
	cr_assert_eq(stats(r, 0).indexed_blocks, 0);
	kvr_router_destroy(r);
}

Test(router, capacity_bounds_the_prediction)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 30, 0);
	uint32_t a[320], b[320];
	prompt(a, 320, 10);
	prompt(b, 320, 11);
	struct kvr_decision d = route(r, a, 320, 0); /* 20 blocks */
	kvr_request_finish(r, d.attempt);
	d = route(r, b, 320, 0); /* 20 more: 10 of a's evicted, deepest first */
	kvr_request_finish(r, d.attempt);
	struct kvr_rank_stats s = stats(r, 0);
	cr_assert_eq(s.resident_blocks, 30);
	cr_assert_eq(s.evictions, 10);
	cr_assert_eq(route(r, a, 320, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 10);
	/* the predicted set itself: b's 20 blocks and a's first 10 */
	uint64_t got[64], sa[20], sb[20];
	size_t n = 0;
	kvr_hash_blocks(a, 320, 16, NULL, NULL, sa);
	kvr_hash_blocks(b, 320, 16, NULL, NULL, sb);
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, got, 4, &n), KVR_ERANGE);
	cr_assert_eq(n, 30);
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, got, 64, &n), 0);
	cr_assert_eq(n, 30);
	for (int i = 0; i < 20; i++) {
		int in_a = 0, in_b = 0;
		for (size_t k = 0; k < n; k++) {
			in_a |= got[k] == sa[i];
			in_b |= got[k] == sb[i];
		}
		cr_assert_eq(in_a, i < 10, "a block %d", i);
		cr_assert(in_b, "b block %d", i);
	}
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){5, 0}, got, 64, &n), KVR_ENOENT);
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, NULL, 64, &n), KVR_EINVAL);
	cr_assert_eq(kvr_rank_set_capacity(r, (struct kvr_rank_id){0, 0}, 1, 20), 0);
	cr_assert_eq(stats(r, 0).resident_blocks, 20);
	kvr_router_destroy(r);
}

Test(router, ttl_mode_forgets_on_virtual_time)
{
	vnow = 1000;
	struct kvr_router *r = make(KVR_MODE_APPROX_TTL, 1, 100000, 0);
	uint32_t t[64];
	prompt(t, 64, 12);
	struct kvr_decision d = route(r, t, 64, 0);
	kvr_request_finish(r, d.attempt);
	cr_assert_eq(route(r, t, 64, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 4);
	__atomic_store_n(&vnow, vnow + 60ull * 1000000000ull, __ATOMIC_RELAXED);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(route(r, t, 64, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 4, "not yet expired");
	__atomic_store_n(&vnow, vnow + 61ull * 1000000000ull, __ATOMIC_RELAXED);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(route(r, t, 64, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 0,
	             "expired after 120 s");
	kvr_router_destroy(r);
}

/* Output completed after its prompt's blocks expired (a decode that outlived the TTL) is not
 * predicted: no prompt can match it without its prefix.  Before, the TTL store took it while the
 * index could not (no parent there to hang it below), and a later prompt that entered the prefix
 * again only refreshed it in the store: the index held 4 of the 5 blocks the store held, and the
 * decision saw an overlap of 4. */
Test(router, ttl_output_after_its_prefix_expired)
{
	vnow = 1000;
	struct kvr_config c;
	sync_config(&c, KVR_MODE_APPROX_TTL, vclock);
	c.ttl_ns = 1000000000ull;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 1024), 0);
	uint32_t t[96];
	prompt(t, 96, 12);
	struct kvr_decision d = route(r, t, 64, 0); /* 4 blocks */
	cr_assert_eq(kvr_request_prefill_done(r, d.attempt), 0);
	__atomic_store_n(&vnow, vnow + 1300000000ull, __ATOMIC_RELAXED);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(stats(r, 0).indexed_blocks, 0, "the prompt expired");
	cr_assert_eq(kvr_request_output(r, d.attempt, t + 64, 17), 0); /* completes block 5 */
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(stats(r, 0).indexed_blocks, 0);
	d = route(r, t, 80, 0); /* the whole chain again */
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(route(r, t, 80, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 5);
	cr_assert_eq(stats(r, 0).indexed_blocks, 5);
	kvr_router_destroy(r);
}

/* A clock that holds every thread but the test's while the gate is up (at most 5 s): the shard
 * reads it at the top of its loop, so it is held before it runs what the test posts. */
static int clock_gate;
static pthread_t test_thread;
static uint64_t gated_clock(void *ctx)
{
	(void)ctx;
	if (!pthread_equal(pthread_self(), test_thread)) {
		struct timespec ts = {0, 100000};
		for (int i = 0; i < 50000 && __atomic_load_n(&clock_gate, __ATOMIC_ACQUIRE); i++)
			nanosleep(&ts, NULL);
	}
	return __atomic_load_n(&vnow, __ATOMIC_RELAXED);
}

/* sync_booking posts the booking and the finish; the shard applies them at their calls' time
 * even when it gets to them after the clock moved on: here 121 s later (held at the gate), so a
 * shard that read its own clock would see the blocks used then, not 121 s ago. */
Test(router, sync_booking_work_runs_at_its_calls_time)
{
	vnow = 1000;
	test_thread = pthread_self();
	struct kvr_config c;
	sync_config(&c, KVR_MODE_APPROX_TTL, gated_clock);
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 1024), 0);
	uint32_t t[64];
	prompt(t, 64, 20); /* the shard's first booking waits (it grows room to track more) */
	cr_assert_eq(kvr_request_finish(r, route(r, t, 64, 0).attempt), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	prompt(t, 64, 21);
	__atomic_store_n(&clock_gate, 1, __ATOMIC_RELEASE);
	struct kvr_decision d = route(r, t, 64, 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0); /* no reaper due: does not wait */
	__atomic_store_n(&vnow, vnow + 121ull * 1000000000ull, __ATOMIC_RELAXED);
	__atomic_store_n(&clock_gate, 0, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(route(r, t, 64, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 0,
	             "used at 1000 ns, expired 120 s later");
	kvr_router_destroy(r);
}

Test(router, lease_expires_idle_attempts)
{
	vnow = 1000;
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 100000, 0);
	uint32_t t[64];
	prompt(t, 64, 13);
	struct kvr_decision idle = route(r, t, 64, 0), busy = route(r, t, 64, 0);
	/* Each interval: the scan runs (sync fires due timers), then the busy attempt progresses,
	 * so it is TOUCHED at every scan while the idle one goes QUIET, then expires. */
	for (int k = 1; k <= 3; k++) {
		__atomic_store_n(&vnow, 1000 + k * 121ull * 1000000000ull, __ATOMIC_RELAXED);
		cr_assert_eq(kvr_router_sync(r, 5000), 0);
		int orc = kvr_request_output(r, busy.attempt, t, 1);
		cr_assert_eq(orc, 0, "scan %d rc %d", k, orc);
	}
	cr_assert_eq(kvr_request_finish(r, idle.attempt), KVR_ESTALE, "reaped");
	cr_assert_eq(stats(r, 0).active_requests, 1);
	cr_assert_eq(kvr_request_finish(r, busy.attempt), 0);
	cr_assert_eq(stats(r, 0).active_requests, 0);
	kvr_router_destroy(r);
}

/* Events mode fed the same blocks the approx_lru router predicts gives the same overlaps. */
Test(router, events_and_approx_agree_without_eviction)
{
	struct kvr_router *ev = make(KVR_MODE_EVENTS, 3, 100000, 0);
	struct kvr_router *ap = make(KVR_MODE_APPROX_LRU, 3, 100000, 0);
	uint32_t t[6][256];
	for (int p = 0; p < 6; p++) {
		prompt(t[p], 256, 20 + (uint32_t)(p % 3));
		t[p][200] += (uint32_t)p; /* share 12 blocks in pairs, differ after */
	}
	for (int p = 0; p < 6; p++) {
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t[p];
		q.n_tokens = 256;
		struct kvr_decision da;
		cr_assert_eq(kvr_route(ap, &q, &da), 0);
		kvr_request_finish(ap, da.attempt);
		/* the engine of da.rank stores the prompt's blocks: tell the events router */
		q.pinned = &da.rank;
		struct kvr_decision de;
		cr_assert_eq(kvr_route(ev, &q, &de), 0);
		cr_assert_eq(de.overlap_blocks, da.overlap_blocks, "prompt %d", p);
		kvr_request_finish(ev, de.attempt);
		uint64_t local[16], seq[16];
		kvr_hash_blocks(t[p], 256, 16, NULL, local, seq);
		struct kvr_event_block blocks[16];
		for (int i = 0; i < 16; i++)
			blocks[i] =
			    (struct kvr_event_block){.ext_hash = seq[i], .local_hash = local[i]};
		struct kvr_event e = {.type = KVR_EVENT_STORED, .blocks = blocks, .n_blocks = 16};
		cr_assert_eq(kvr_events_apply(ev, da.rank, &e), 0);
	}
	for (int p = 0; p < 6; p++) {
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t[p];
		q.n_tokens = 256;
		q.flags = KVR_ROUTE_QUERY_ONLY;
		for (uint64_t w = 0; w < 3; w++) {
			struct kvr_rank_id id = {w, 0};
			q.pinned = &id;
			struct kvr_decision a, b;
			cr_assert_eq(kvr_route(ap, &q, &a), 0);
			cr_assert_eq(kvr_route(ev, &q, &b), 0);
			cr_assert_eq(a.overlap_blocks, b.overlap_blocks, "prompt %d rank %lu", p,
			             (unsigned long)w);
		}
	}
	kvr_router_destroy(ev);
	kvr_router_destroy(ap);
}

Test(router, events_cursor_gaps_and_errors)
{
	struct kvr_router *r = make(KVR_MODE_EVENTS, 2, 100000, 0);
	struct kvr_rank_id id = {0, 0};
	uint32_t tok[32];
	prompt(tok, 32, 30);
	struct kvr_event_block b[2] = {{.ext_hash = 111, .tokens = tok, .n_tokens = 16},
	                               {.ext_hash = 222, .tokens = tok + 16, .n_tokens = 16}};
	struct kvr_event e = {.type = KVR_EVENT_STORED, .event_id = 5, .blocks = b, .n_blocks = 2};
	cr_assert_eq(kvr_events_apply(r, id, &e), 0);
	cr_assert_eq(kvr_events_apply(r, id, &e), KVR_ESTALE, "same id again");
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 32;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	q.pinned = &id;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, 2, "token ids hashed like a prompt");
	uint64_t rm[2] = {222, 999};
	struct kvr_event x = {
	    .type = KVR_EVENT_REMOVED, .event_id = 9, .removed = rm, .n_removed = 2};
	cr_assert_eq(kvr_events_apply(r, id, &x), 0, "unknown hashes are skipped");
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
	cr_assert_eq(s.event_gaps, 1);
	cr_assert_eq(s.event_id, 9);
	cr_assert_eq(s.indexed_blocks, 1);
	/* bad input */
	b[1].n_tokens = 15;
	e.event_id = 10;
	cr_assert_eq(kvr_events_apply(r, id, &e), KVR_EINVAL, "block size mismatch");
	b[1].n_tokens = 16;
	b[1].ext_hash = 111;
	cr_assert_eq(kvr_events_apply(r, id, &e), KVR_EINVAL, "self-parent");
	e.n_blocks = 0;
	cr_assert_eq(kvr_events_apply(r, id, &e), KVR_EINVAL, "zero-length");
	struct kvr_event_block c = {.ext_hash = 5, .local_hash = 6};
	struct kvr_event orphan = {.type = KVR_EVENT_STORED,
	                           .event_id = 11,
	                           .has_parent = true,
	                           .parent_ext_hash = 777,
	                           .blocks = &c,
	                           .n_blocks = 1};
	cr_assert_eq(kvr_events_apply(r, id, &orphan), KVR_ENOENT, "parent not held");
	struct kvr_event clr = {.type = KVR_EVENT_CLEARED, .event_id = 12};
	cr_assert_eq(kvr_events_apply(r, id, &clr), 0);
	cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
	cr_assert_eq(s.indexed_blocks, 0);
	cr_assert_eq(kvr_rank_remove(r, id), 0);
	clr.event_id = 13;
	cr_assert_eq(kvr_events_apply(r, id, &clr), KVR_ENOENT, "removed rank");
	cr_assert_eq(kvr_events_apply(r, (struct kvr_rank_id){1, 0}, NULL), KVR_EINVAL);
	kvr_router_destroy(r);
	struct kvr_router *ap = make(KVR_MODE_APPROX_LRU, 1, 10, 0);
	cr_assert_eq(kvr_events_apply(ap, (struct kvr_rank_id){0, 0}, &clr), KVR_EINVAL,
	             "events need events mode");
	kvr_router_destroy(ap);
}

static uint64_t admitted[16], admitted_attempt[16];
static int admitted_error[16];
static int n_admitted;
static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	admitted_attempt[n_admitted] = d->attempt;
	admitted_error[n_admitted] = d->error;
	admitted[n_admitted++] = ticket;
}

/* A router that queues while a rank's prefill exceeds its budget (threshold 1.0): one shard,
 * the virtual clock, sync_booking, on_admit cb, and n ranks (workers 0..n-1) of 1,000 tokens. */
static struct kvr_router *budget_router(void (*cb)(void *, uint64_t, const struct kvr_decision *),
                                        enum kvr_queue_policy pol, uint32_t queue_capacity, int n)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = vclock;
	c.queue_threshold = 1.0;
	c.queue_policy = pol;
	if (queue_capacity)
		c.queue_capacity = queue_capacity;
	c.on_admit = cb;
	c.sync_booking = true;
	n_admitted = 0;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (int w = 0; w < n; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){(uint64_t)w, 0}, 1, 100000, 1000),
		             0);
	return r;
}

/* One rank with a 1000-token budget and threshold 1.0: it is saturated while more than 1000
 * prefill tokens are in flight.  A hog saturates it, three requests queue, and each prefill_done
 * lets the queue admit in policy order until the rank is saturated again. */
static void queue_order(enum kvr_queue_policy pol, const uint64_t *expect)
{
	struct kvr_router *r = budget_router(on_admit, pol, 0, 1);
	static uint32_t hog[2000], p[3][1600];
	prompt(hog, 2000, 40);
	struct kvr_decision h = route(r, hog, 2000, 0);
	cr_assert_eq(h.status, KVR_DECIDED);
	size_t len[3] = {1600, 400, 900};
	uint64_t tickets[3];
	for (int i = 0; i < 3; i++) {
		prompt(p[i], len[i], 41 + (uint32_t)i);
		struct kvr_decision d = route(r, p[i], len[i], 0);
		cr_assert_eq(d.status, KVR_QUEUED);
		tickets[i] = d.ticket;
	}
	cr_assert_eq(n_admitted, 0, "nothing admitted while saturated");
	cr_assert_eq(kvr_request_prefill_done(r, h.attempt), 0);
	int done = 0;
	while (n_admitted < 3 && done < n_admitted) {
		/* end the prefill of the oldest admitted request to make room */
		cr_assert_eq(kvr_request_prefill_done(r, admitted_attempt[done++]), 0);
	}
	cr_assert_eq(n_admitted, 3);
	for (int k = 0; k < 3; k++)
		cr_assert_eq(admitted[k], tickets[expect[k]], "policy %d position %d", pol, k);
	kvr_router_destroy(r);
}

Test(router, queue_fcfs_order)
{
	static const uint64_t order[3] = {0, 1, 2};
	queue_order(KVR_QUEUE_FCFS, order);
}

Test(router, queue_wspt_order)
{
	static const uint64_t order[3] = {1, 2, 0}; /* fewest uncached tokens first */
	queue_order(KVR_QUEUE_WSPT, order);
}

/* Two ranks with a 1000-token budget, threshold 1.0, both saturated by a pinned hog each. */
static struct kvr_router *two_hogged_ranks(struct kvr_decision *hog0, struct kvr_decision *hog1)
{
	struct kvr_router *r = budget_router(on_admit, KVR_QUEUE_FCFS, 0, 2);
	static uint32_t hog[2][2000];
	struct kvr_decision *h[2] = {hog0, hog1};
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_id id = {w, 0};
		struct kvr_request q;
		kvr_request_init(&q);
		prompt(hog[w], 2000, 60 + (uint32_t)w);
		q.tokens = hog[w];
		q.n_tokens = 2000;
		q.pinned = &id;
		cr_assert_eq(kvr_route(r, &q, h[w]), 0);
		cr_assert_eq(h[w]->status, KVR_DECIDED);
	}
	return r;
}

/* A request pinned to a saturated rank no longer holds back a later one that an idle rank can
 * take (before, the pump stopped at the queue's head: B waited behind A while rank 1 idled, and
 * a new arrival went straight to rank 1 past B). */
Test(router, queue_passes_over_a_request_whose_ranks_are_saturated)
{
	struct kvr_decision hog0, hog1;
	struct kvr_router *r = two_hogged_ranks(&hog0, &hog1);
	static uint32_t a[400], b[1600], c[400];
	prompt(a, 400, 70);
	prompt(b, 1600, 71);
	prompt(c, 400, 72);
	struct kvr_rank_id rank0 = {0, 0};
	struct kvr_request qa;
	kvr_request_init(&qa);
	qa.tokens = a;
	qa.n_tokens = 400;
	qa.pinned = &rank0;
	struct kvr_decision da, db;
	cr_assert_eq(kvr_route(r, &qa, &da), 0);
	cr_assert_eq(da.status, KVR_QUEUED);
	db = route(r, b, 1600, 0);
	cr_assert_eq(db.status, KVR_QUEUED);
	cr_assert_eq(kvr_request_prefill_done(r, hog1.attempt), 0); /* rank 1 frees */
	cr_assert_eq(n_admitted, 1, "B is admitted onto rank 1 past A, pinned to busy rank 0");
	cr_assert_eq(admitted[0], db.ticket);
	/* B saturates rank 1 until its prefill ends; then a new request may take rank 1, which A
	 * cannot use. */
	cr_assert_eq(kvr_request_prefill_done(r, admitted_attempt[0]), 0);
	struct kvr_decision dc = route(r, c, 400, 0);
	cr_assert_eq(dc.status, KVR_DECIDED);
	cr_assert_eq(dc.rank.worker_id, 1);
	cr_assert_eq(n_admitted, 1, "A still waits for rank 0");
	cr_assert_eq(kvr_request_prefill_done(r, hog0.attempt), 0);
	cr_assert_eq(n_admitted, 2);
	cr_assert_eq(admitted[1], da.ticket);
	kvr_router_destroy(r);
}

/* A request pinned to a rank that is removed while every rank is saturated fails at once, told
 * through on_admit (before, the removal ran no pass, and a pass stopped at the saturated
 * unrestricted request ahead of it: it learned of its failure only once load eased). */
Test(router, queue_request_pinned_to_a_removed_rank_fails_at_once)
{
	struct kvr_decision hog0, hog1;
	struct kvr_router *r = two_hogged_ranks(&hog0, &hog1);
	static uint32_t u[400], p[400];
	prompt(u, 400, 73);
	prompt(p, 400, 74);
	struct kvr_decision du = route(r, u, 400, 0);
	cr_assert_eq(du.status, KVR_QUEUED);
	struct kvr_rank_id rank1 = {1, 0};
	struct kvr_request qp;
	kvr_request_init(&qp);
	qp.tokens = p;
	qp.n_tokens = 400;
	qp.pinned = &rank1;
	struct kvr_decision dp;
	cr_assert_eq(kvr_route(r, &qp, &dp), 0);
	cr_assert_eq(dp.status, KVR_QUEUED);
	cr_assert_eq(kvr_rank_remove(r, rank1), 0);
	cr_assert_eq(n_admitted, 1, "the pinned request is told");
	cr_assert_eq(admitted[0], dp.ticket);
	cr_assert_eq(admitted_error[0], KVR_ENOENT);
	cr_assert_eq(kvr_request_prefill_done(r, hog0.attempt), 0);
	cr_assert_eq(n_admitted, 2, "the unrestricted one once rank 0 frees");
	cr_assert_eq(admitted[1], du.ticket);
	kvr_router_destroy(r);
}

/* A request that arrives while another thread's pump is admitting, with a waiting request that
 * could be admitted too, queues behind it (before, it was decided at once, ahead of it).  The
 * arrival is made from on_admit, inside the pump. */
static struct kvr_router *behind_r;
static uint32_t behind_c[400];
static struct kvr_decision behind_d;
static int behind_rc = -1;
static void on_admit_route(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	on_admit(ctx, ticket, d);
	if (n_admitted == 1)
		behind_rc = kvr_route(behind_r,
		                      &(struct kvr_request){.tokens = behind_c,
		                                            .n_tokens = 400,
		                                            .overlap_credit = -1.0,
		                                            .prefill_load_scale = -1.0,
		                                            .temperature = -1.0},
		                      &behind_d);
}

Test(router, queue_arrival_during_a_pump_goes_behind_the_admissible)
{
	struct kvr_router *r = behind_r = budget_router(on_admit_route, KVR_QUEUE_FCFS, 0, 1);
	static uint32_t hog[2000], a[400], b[400];
	prompt(hog, 2000, 80);
	prompt(a, 400, 81);
	prompt(b, 400, 82);
	prompt(behind_c, 400, 83);
	struct kvr_decision h = route(r, hog, 2000, 0);
	struct kvr_decision da = route(r, a, 400, 0), db = route(r, b, 400, 0);
	cr_assert_eq(da.status, KVR_QUEUED);
	cr_assert_eq(db.status, KVR_QUEUED);
	cr_assert_eq(kvr_request_prefill_done(r, h.attempt), 0);
	cr_assert_eq(behind_rc, 0);
	cr_assert_eq(behind_d.status, KVR_QUEUED, "the arrival queued behind B");
	cr_assert_eq(n_admitted, 3);
	cr_assert_eq(admitted[0], da.ticket);
	cr_assert_eq(admitted[1], db.ticket, "B before the later arrival");
	cr_assert_eq(admitted[2], behind_d.ticket);
	kvr_router_destroy(r);
}

/* A KVR_ROUTE_WAIT arrival from on_admit, inside the pass, with a waiting request that could be
 * admitted: it must not queue behind it, since nothing admits its ticket while the pass waits
 * for it (before, it waited out its deadline for a free rank, and without one hung).  The
 * router's own clock, so that the deadline passes. */
static struct kvr_router *inside_r;
static struct kvr_decision inside_d;
static int inside_rc = -1;
static void on_admit_route_wait(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	on_admit(ctx, ticket, d);
	if (n_admitted != 1)
		return;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = behind_c;
	q.n_tokens = 400;
	q.flags = KVR_ROUTE_WAIT;
	q.deadline_ns = kvr_router_now(inside_r) + 2000000000ull; /* 2 s */
	inside_rc = kvr_route(inside_r, &q, &inside_d);
}

Test(router, queue_wait_from_on_admit_is_not_queued_behind)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit_route_wait;
	c.sync_booking = true;
	n_admitted = 0;
	inside_rc = -1;
	cr_assert_eq(kvr_router_create(&c, &inside_r), 0);
	struct kvr_router *r = inside_r;
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 1000), 0);
	static uint32_t hog[2000], a[400], b[400];
	prompt(hog, 2000, 84);
	prompt(a, 400, 85);
	prompt(b, 400, 86);
	prompt(behind_c, 400, 87);
	struct kvr_decision h = route(r, hog, 2000, 0);
	struct kvr_decision da = route(r, a, 400, 0), db = route(r, b, 400, 0);
	cr_assert_eq(da.status, KVR_QUEUED);
	cr_assert_eq(db.status, KVR_QUEUED);
	cr_assert_eq(kvr_request_prefill_done(r, h.attempt), 0); /* admits A; B could follow */
	cr_assert_eq(inside_rc, 0, "the waiting arrival: %d (%s)", inside_rc,
	             kvr_strerror(inside_rc));
	cr_assert_eq(inside_d.status, KVR_DECIDED);
	cr_assert_eq(n_admitted, 2, "A, then B after the callback");
	cr_assert_eq(admitted[1], db.ticket);
	kvr_router_destroy(r);
}

/* An arrival during a pass when the queue is full: with no room behind the admissible waiter, it
 * takes the free rank (before, it was refused with KVR_EAGAIN, "queue full", though rank 0 had
 * room for it).  From on_admit, inside the pass: A admitted onto rank 0, B could follow; D fills
 * the queue waiting for rank 1; E may use any rank. */
static uint32_t full_d[400], full_e[400];
static int full_rc_d = -1, full_rc_e = -1;
static struct kvr_decision full_dd, full_de;
static void on_admit_fill(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	on_admit(ctx, ticket, d);
	if (n_admitted != 1)
		return;
	struct kvr_rank_id rank1 = {1, 0};
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = full_d;
	q.n_tokens = 400;
	q.pinned = &rank1;
	full_rc_d = kvr_route(behind_r, &q, &full_dd);
	q.tokens = full_e;
	q.pinned = NULL;
	full_rc_e = kvr_route(behind_r, &q, &full_de);
}

Test(router, queue_full_during_a_pump_routes_to_the_free_rank)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = vclock;
	c.queue_threshold = 1.0;
	c.queue_capacity = 3;
	c.on_admit = on_admit_fill;
	c.sync_booking = true;
	n_admitted = 0;
	cr_assert_eq(kvr_router_create(&c, &behind_r), 0);
	struct kvr_router *r = behind_r;
	static uint32_t hog[2][2000], a[400], b[400], w1[400];
	struct kvr_decision h[2];
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_id id = {w, 0};
		cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 1000), 0);
		struct kvr_request q;
		kvr_request_init(&q);
		prompt(hog[w], 2000, 100 + (uint32_t)w);
		q.tokens = hog[w];
		q.n_tokens = 2000;
		q.pinned = &id;
		cr_assert_eq(kvr_route(r, &q, &h[w]), 0);
		cr_assert_eq(h[w].status, KVR_DECIDED);
	}
	prompt(a, 400, 102);
	prompt(b, 400, 103);
	prompt(w1, 400, 104);
	prompt(full_d, 400, 105);
	prompt(full_e, 400, 106);
	const uint32_t *t[3] = {a, b, w1};
	struct kvr_decision dq[3];
	for (uint64_t k = 0; k < 3; k++) {
		struct kvr_rank_id id = {k == 2, 0};
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t[k];
		q.n_tokens = 400;
		q.pinned = &id;
		cr_assert_eq(kvr_route(r, &q, &dq[k]), 0);
		cr_assert_eq(dq[k].status, KVR_QUEUED);
	}
	cr_assert_eq(kvr_request_prefill_done(r, h[0].attempt), 0); /* rank 0 frees */
	cr_assert_eq(full_rc_d, 0);
	cr_assert_eq(full_dd.status, KVR_QUEUED, "D waits for rank 1; the queue is full");
	cr_assert_eq(full_rc_e, 0, "E: %d (%s)", full_rc_e, kvr_strerror(full_rc_e));
	cr_assert_eq(full_de.status, KVR_DECIDED);
	cr_assert_eq(full_de.rank.worker_id, 0);
	kvr_router_destroy(r);
}

Test(router, queue_wait_deadline_cancel_and_full)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = vclock;
	c.queue_threshold = 0.5;
	c.queue_capacity = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 100), 0);
	uint32_t t[200];
	prompt(t, 200, 50);
	route(r, t, 200, 0);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 200;
	q.flags = KVR_ROUTE_WAIT;
	q.deadline_ns = vnow; /* already passed */
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_ETIMEDOUT);
	cr_assert_eq(kvr_route_cancel(r, d.ticket), 0, "a timed-out request stays queued");
	q.flags = 0;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	struct kvr_decision d2;
	cr_assert_eq(kvr_route(r, &q, &d2), KVR_EAGAIN, "queue full");
	cr_assert_eq(kvr_route_cancel(r, d.ticket), 0);
	cr_assert_eq(kvr_route_cancel(r, d.ticket), KVR_ENOENT);
	cr_assert_eq(kvr_route_wait(r, d.ticket, 0, &d2), KVR_ENOENT);
	kvr_router_destroy(r);
}

/* A ticket given to the wrong router (or to the one created to replace the router that issued
 * it) must not cancel or collect that router's own queued request: every router numbered its
 * tickets from 1. */
static struct kvr_router *queue_router(uint64_t *ticket)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = vclock;
	c.queue_threshold = 0.5;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 100), 0);
	uint32_t t[200];
	prompt(t, 200, 51);
	route(r, t, 200, 0); /* saturates the rank */
	struct kvr_decision d = route(r, t, 200, 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	*ticket = d.ticket;
	return r;
}

Test(router, tickets_of_another_router_are_refused)
{
	uint64_t ta, tb, tc;
	struct kvr_router *a = queue_router(&ta), *b = queue_router(&tb);
	struct kvr_decision d;
	cr_assert_eq(kvr_route_cancel(b, ta), KVR_ENOENT, "a's ticket cancelled b's request");
	cr_assert_eq(kvr_route_wait(b, ta, vnow + 1, &d), KVR_ENOENT, "a's ticket on b");
	cr_assert_eq(kvr_route_cancel(a, tb), KVR_ENOENT, "b's ticket cancelled a's request");
	kvr_router_destroy(a); /* a's queued request is dropped; its ticket may still be around */
	struct kvr_router *c = queue_router(&tc);
	cr_assert_eq(kvr_route_cancel(c, ta), KVR_ENOENT, "the replaced router's ticket");
	cr_assert_eq(kvr_route_cancel(c, tb), KVR_ENOENT);
	cr_assert_eq(kvr_route_cancel(b, tb), 0, "b's own request was still queued");
	cr_assert_eq(kvr_route_cancel(c, tc), 0, "c's own request was still queued");
	kvr_router_destroy(b);
	kvr_router_destroy(c);
}

Test(router, bad_input)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
	uint32_t t[40];
	prompt(t, 40, 60);
	struct kvr_request q;
	struct kvr_decision d;
	kvr_request_init(&q);
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "no prompt");
	q.tokens = t;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "empty prompt");
	q.tokens = NULL;
	q.n_tokens = 40;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "tokens NULL with a length");
	uint64_t h[4] = {1, 2, 3, 4};
	q.local_hashes = h;
	q.n_hashes = 4;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "more hashes than the prompt has blocks");
	q.n_hashes = 2;
	cr_assert_eq(kvr_route(r, &q, &d), 0, "precomputed hashes");
	q.local_hashes = NULL;
	q.tokens = t;
	q.n_tokens = 5; /* shorter than a block: routed on load alone */
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.required_blocks, 0);
	cr_assert_eq(d.overlap_blocks, 0);
	q.n_tokens = 40;
	q.temperature = NAN;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL);
	q.temperature = -1;
	q.flags = 1u << 7;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "unknown flag");
	q.flags = 0;
	cr_assert_eq(kvr_route(NULL, &q, &d), KVR_EINVAL);
	cr_assert_eq(kvr_route(r, &q, NULL), KVR_EINVAL);
	struct kvr_rank_id id = {0, 0}, unk = {7, 7};
	cr_assert_eq(kvr_rank_add(r, id, 1, 10, 0), KVR_EEXIST);
	cr_assert_eq(kvr_rank_remove(r, unk), KVR_ENOENT);
	cr_assert_eq(kvr_rank_set_capacity(r, unk, 1, 10), KVR_ENOENT);
	cr_assert_eq(kvr_rank_reset(r, unk, 1), KVR_ENOENT);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, unk, &s), KVR_ENOENT);
	cr_assert_eq(kvr_rank_get_stats(r, id, NULL), KVR_EINVAL);
	cr_assert_eq(kvr_rank_remove(r, id), 0);
	cr_assert_eq(kvr_route(r, &q, &d), KVR_ENOENT, "no rank left");
	char small[16];
	size_t need = 0;
	cr_assert_eq(kvr_metrics_render(r, small, sizeof(small), &need), KVR_ERANGE);
	cr_assert_gt(need, sizeof(small));
	cr_assert_eq(strlen(small), sizeof(small) - 1);
	kvr_router_destroy(r);
}

Test(router, metrics_render_prometheus)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 2, 1000, 0);
	uint32_t t[64];
	prompt(t, 64, 70);
	struct kvr_decision d = route(r, t, 64, 0);
	kvr_request_finish(r, d.attempt);
	static char buf[1 << 16];
	size_t len;
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf), &len), 0);
	cr_assert_eq(strlen(buf) + 1, len);
	cr_assert(strstr(buf, "kvr_routes_total 1\n"));
	cr_assert(strstr(buf, "kvr_requests_ended_total{how=\"finish\"} 1\n"));
	cr_assert(strstr(buf, "# TYPE kvr_route_seconds histogram\n"));
	cr_assert(strstr(buf, "kvr_route_seconds_count 1\n"));
	cr_assert(strstr(buf, "kvr_rank_resident_blocks{worker=\"0\",dp_rank=\"0\"}") ||
	          strstr(buf, "kvr_rank_resident_blocks{worker=\"1\",dp_rank=\"0\"} 4"));
	kvr_router_destroy(r);
}

static uint64_t route_errors(struct kvr_router *r)
{
	static char buf[1 << 16];
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf), NULL), 0);
	const char *p = strstr(buf, "\nkvr_route_errors_total ");
	cr_assert(p);
	return strtoull(p + strlen("\nkvr_route_errors_total "), NULL, 10);
}

/* kvr_route_errors_total ("Route calls that failed") counts a call refused for a bad request
 * as well as one that found no rank: it counted only the failures after the request was found
 * valid, so a frontend sending empty prompts or NaN overrides saw KVR_EINVAL on every call
 * and the counter stayed at 0. */
Test(router, route_errors_count_bad_requests)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
	uint32_t t[40];
	prompt(t, 40, 61);
	struct kvr_request q;
	struct kvr_decision d;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 40;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(route_errors(r), 0);
	q.n_tokens = 0;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "empty prompt");
	q.n_tokens = 40;
	q.temperature = NAN;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "NaN override");
	q.temperature = -1;
	cr_assert_eq(kvr_route(r, &q, NULL), KVR_EINVAL, "d NULL");
	cr_assert_eq(kvr_route(r, NULL, &d), KVR_EINVAL, "req NULL");
	cr_assert_eq(route_errors(r), 4, "every refused call counts");
	struct kvr_rank_id unk = {7, 7};
	q.pinned = &unk;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_ENOENT);
	cr_assert_eq(route_errors(r), 5);
	q.pinned = NULL;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(route_errors(r), 5, "a decision is no error");
	kvr_router_destroy(r);
}

/* kvr_route_errors_total ("Route calls that failed") counts the KVR_ROUTE_WAIT route refused
 * with KVR_EBUSY inside the admission pass (on_admit), as it counts every other refused call;
 * it did not (the refusal returned without a count).  A route from on_admit that queues (0,
 * KVR_QUEUED) is no failed call and is not counted. */
static uint64_t pass_errors[3];
static int pass_wait_rc = 1, pass_queue_rc = 1, pass_queue_status = -1;
static void on_admit_counted(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	on_admit(ctx, ticket, d);
	if (n_admitted != 1)
		return;
	static uint32_t t[400];
	prompt(t, 400, 97);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 400;
	q.flags = KVR_ROUTE_WAIT;
	struct kvr_decision dd;
	pass_errors[0] = route_errors(inside_r);
	pass_wait_rc = kvr_route(inside_r, &q, &dd);
	pass_errors[1] = route_errors(inside_r);
	q.flags = 0;
	pass_queue_rc = kvr_route(inside_r, &q, &dd);
	pass_queue_status = dd.status;
	pass_errors[2] = route_errors(inside_r);
	if (pass_queue_rc == 0 && dd.status == KVR_QUEUED)
		cr_assert_eq(kvr_route_cancel(inside_r, dd.ticket), 0);
}

Test(router, a_wait_refused_inside_the_admission_pass_counts_as_a_route_error, .timeout = 20)
{
	struct kvr_router *r = inside_r = budget_router(on_admit_counted, KVR_QUEUE_FCFS, 0, 1);
	static uint32_t hog[2000], a[1600];
	prompt(hog, 2000, 92);
	prompt(a, 1600, 96);
	struct kvr_decision h = route(r, hog, 2000, 0);
	struct kvr_decision da = route(r, a, 1600, 0);
	cr_assert_eq(da.status, KVR_QUEUED);
	cr_assert_eq(route_errors(r), 0);
	cr_assert_eq(kvr_request_prefill_done(r, h.attempt), 0); /* A admitted; A saturates */
	cr_assert_eq(n_admitted, 1);
	cr_assert_eq(pass_wait_rc, KVR_EBUSY, "the waited route inside the pass");
	cr_assert_eq(pass_errors[1], pass_errors[0] + 1,
	             "kvr_route_errors_total %llu before the refused route, %llu after",
	             (unsigned long long)pass_errors[0], (unsigned long long)pass_errors[1]);
	cr_assert_eq(pass_queue_rc, 0);
	cr_assert_eq(pass_queue_status, KVR_QUEUED);
	cr_assert_eq(pass_errors[2], pass_errors[1], "a queued route is no failed call");
	cr_assert_eq(route_errors(r), 1, "the one refused call");
	cr_assert_eq(kvr_request_finish(r, admitted_attempt[0]), 0);
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
	cr_assert_eq(route_errors(r), 1);
	kvr_router_destroy(r);
}

Test(router, async_booking_becomes_visible)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 1000, 0), 0);
	uint32_t t[160];
	prompt(t, 160, 80);
	struct kvr_decision d = route(r, t, 160, 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	struct kvr_rank_stats s = stats(r, 0);
	cr_assert_eq(s.active_blocks, 10);
	cr_assert_eq(s.indexed_blocks, 10);
	cr_assert_eq(route(r, t, 160, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 10);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(stats(r, 0).active_blocks, 0);
	kvr_router_destroy(r);
}

/* SQLite-style: fail the Nth allocation for N = 1, 2, ... through create, add, route, output,
 * finish and destroy.  Every call must either succeed or say KVR_ENOMEM (or an error that
 * follows from an earlier refusal), and nothing may crash or leak (ASan checks leaks). */
#include "core/alloc.h"

Test(router, out_of_memory_loop)
{
	uint32_t t[100];
	prompt(t, 100, 90);
	int completed = 0;
	uint64_t nth;
	for (nth = 1; nth < 400 && !completed; nth++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.sync_booking = true;
		kvr_alloc_fail_after(nth);
		struct kvr_router *r = NULL;
		int rc = kvr_router_create(&c, &r);
		if (rc) {
			cr_assert_eq(rc, KVR_ENOMEM, "create at %lu: %d", (unsigned long)nth, rc);
			cr_assert_null(r);
			continue;
		}
		int ok = 1;
		rc = kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100, 0);
		cr_assert(rc == 0 || rc == KVR_ENOMEM, "add: %d", rc);
		ok &= rc == 0;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 100;
		struct kvr_decision d;
		rc = kvr_route(r, &q, &d);
		cr_assert(rc == 0 || rc == KVR_ENOMEM || (!ok && rc == KVR_ENOENT), "route: %d",
		          rc);
		if (rc == 0) {
			rc = kvr_request_output(r, d.attempt, t, 40);
			cr_assert(rc == 0 || rc == KVR_ENOMEM, "output: %d", rc);
			rc = kvr_request_finish(r, d.attempt);
			cr_assert_eq(rc, 0, "finish never needs memory: %d", rc);
		} else {
			ok = 0;
		}
		int fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		if (ok) {
			struct kvr_rank_stats s;
			cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){0, 0}, &s), 0);
			cr_assert_eq(s.active_requests, 0);
			cr_assert_eq(s.active_blocks, 0);
			completed = !fired; /* a run in which no allocation failed: the end */
		}
		kvr_router_destroy(r);
	}
	kvr_alloc_fail_after(0);
	cr_assert(completed, "the loop reached a run with enough memory");
	cr_assert_gt(nth, 20, "failures were injected along the way (%lu)", (unsigned long)nth);
}

static struct kvr_router *wait_router;
static uint32_t wait_prompt[300];
static struct kvr_decision wait_decision;
static int wait_rc = 99;
static void *waiter(void *arg)
{
	(void)arg;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = wait_prompt;
	q.n_tokens = 300;
	q.flags = KVR_ROUTE_WAIT; /* no deadline */
	wait_rc = kvr_route(wait_router, &q, &wait_decision);
	return NULL;
}

Test(router, queue_blocking_wait_is_admitted)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	cr_assert_eq(kvr_router_create(&c, &wait_router), 0);
	cr_assert_eq(kvr_rank_add(wait_router, (struct kvr_rank_id){0, 0}, 1, 10000, 100), 0);
	uint32_t hog[400];
	prompt(hog, 400, 100);
	prompt(wait_prompt, 300, 101);
	struct kvr_decision h = route(wait_router, hog, 400, 0); /* 400 > 1.0 x 100 */
	pthread_t th;
	pthread_create(&th, NULL, waiter, NULL);
	/* wait until it is queued, then let it in */
	for (int i = 0; i < 5000; i++) {
		static char text[1 << 16];
		kvr_metrics_render(wait_router, text, sizeof(text), NULL);
		if (strstr(text, "kvr_queue_depth 1\n"))
			break;
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(wait_rc, 99, "still waiting");
	cr_assert_eq(kvr_request_prefill_done(wait_router, h.attempt), 0);
	pthread_join(th, NULL);
	cr_assert_eq(wait_rc, 0);
	cr_assert_eq(wait_decision.status, KVR_DECIDED);
	cr_assert_neq(wait_decision.attempt, 0);
	cr_assert_eq(kvr_request_finish(wait_router, wait_decision.attempt), 0);
	static char text[1 << 16];
	cr_assert_eq(kvr_metrics_render(wait_router, text, sizeof(text), NULL), 0);
	cr_assert(strstr(text, "kvr_queue_enqueued_total 1\n"));
	cr_assert(strstr(text, "kvr_queue_admitted_total 1\n"));
	cr_assert(strstr(text, "kvr_queue_wait_seconds_count 1\n"));
	kvr_router_destroy(wait_router);
}

static uint64_t gap_expected, gap_got;
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx;
	(void)worker;
	(void)dp;
	gap_expected = expected;
	gap_got = got;
}

Test(router, event_gap_callback)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.mode = KVR_MODE_EVENTS;
	c.on_event_gap = on_gap;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {3, 1};
	cr_assert_eq(kvr_rank_add(r, id, 1, KVR_CAPACITY_NONE, 0), 0);
	struct kvr_event e = {.type = KVR_EVENT_CLEARED, .event_id = 1};
	cr_assert_eq(kvr_events_apply(r, id, &e), 0);
	e.event_id = 2;
	cr_assert_eq(kvr_events_apply(r, id, &e), 0);
	cr_assert_eq(gap_got, 0, "no gap yet");
	e.event_id = 7;
	cr_assert_eq(kvr_events_apply(r, id, &e), 0);
	cr_assert_eq(gap_expected, 3);
	cr_assert_eq(gap_got, 7);
	kvr_router_destroy(r);
}

Test(router, lora_prompts_do_not_share_blocks)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 100000, 0);
	uint32_t t[160];
	prompt(t, 160, 110);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 160;
	q.lora_name = "adapter-a";
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	q.flags = KVR_ROUTE_QUERY_ONLY;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, 10, "same adapter: whole prefix");
	q.lora_name = NULL;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, 0, "base model: nothing shared");
	q.lora_name = "adapter-b";
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, 0, "another adapter: nothing shared");
	kvr_router_destroy(r);
}

/* Issue 12 item 4: a rank added without a capacity (TTL retention) learns its capacity later,
 * same incarnation: that must take effect (it was KVR_EBUSY and the capacity stayed unset). */
Test(router, capacity_none_or_zero_to_finite_same_incarnation)
{
	uint64_t start[2] = {KVR_CAPACITY_NONE, 0};
	for (int k = 0; k < 2; k++) {
		struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, start[k], 0);
		struct kvr_rank_id id = {0, 0};
		uint32_t t[160];
		prompt(t, 160, 100 + k);
		struct kvr_decision d = route(r, t, 160, 0);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		cr_assert_eq(kvr_rank_set_capacity(r, id, 1, 4), 0, "start %d", k);
		struct kvr_rank_stats s = stats(r, 0);
		cr_assert_eq(s.capacity_blocks, 4);
		cr_assert_leq(s.resident_blocks, 4);
		d = route(r, t, 160, 0); /* 10 blocks into a 4-block cache */
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		s = stats(r, 0);
		cr_assert_leq(s.resident_blocks, 4, "the capacity bounds the prediction now");
		cr_assert_eq(s.indexed_blocks, s.resident_blocks);
		kvr_router_destroy(r);
	}
}

/* kvr_rank_stats.capacity_blocks is KVR_CAPACITY_NONE for a rank without a capacity, and 0 is
 * documented as the same "no capacity" as KVR_CAPACITY_NONE (kvr_rank_add, _set_capacity): a
 * rank registered or set with 0 read back 0, which a caller comparing with KVR_CAPACITY_NONE
 * took for a finite, zero-block cache. */
Test(router, stats_capacity_of_a_rank_without_one_reads_none)
{
	for (int mode = 0; mode < 2; mode++) {
		struct kvr_router *r = make(mode ? KVR_MODE_EVENTS : KVR_MODE_APPROX_LRU, 0, 0, 0);
		struct kvr_rank_id a = {0, 0}, b = {1, 0};
		cr_assert_eq(kvr_rank_add(r, a, 1, 0, 0), 0);
		cr_assert_eq(kvr_rank_add(r, b, 1, 8, 0), 0);
		cr_assert_eq(stats(r, 0).capacity_blocks, KVR_CAPACITY_NONE,
		             "mode %d: added with 0", mode);
		cr_assert_eq(kvr_rank_set_capacity(r, b, 1, 0), 0);
		cr_assert_eq(stats(r, 1).capacity_blocks, KVR_CAPACITY_NONE, "mode %d: set to 0",
		             mode);
		cr_assert_eq(kvr_rank_set_capacity(r, b, 2, 0), 0);
		cr_assert_eq(stats(r, 1).capacity_blocks, KVR_CAPACITY_NONE,
		             "mode %d: a new life with 0", mode);
		cr_assert_eq(kvr_rank_set_capacity(r, a, 1, 4), 0);
		cr_assert_eq(stats(r, 0).capacity_blocks, 4, "mode %d", mode);
		kvr_router_destroy(r);
	}
}

/* Issue 12 item 5: set_capacity (same incarnation) moving an LRU rank to TTL retention keeps its
 * live attempts live: output must not say KVR_ENOENT. */
Test(router, output_after_capacity_moved_to_ttl)
{
	uint64_t to[2] = {KVR_CAPACITY_NONE, 0};
	for (int k = 0; k < 2; k++) {
		struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 1, 1000, 0);
		struct kvr_rank_id id = {0, 0};
		uint32_t t[200];
		prompt(t, 200, 110 + k);
		struct kvr_decision d = route(r, t, 40, 0);
		cr_assert_eq(kvr_rank_set_capacity(r, id, 1, to[k]), 0);
		cr_assert_eq(kvr_request_prefill_done(r, d.attempt), 0);
		cr_assert_eq(kvr_request_output(r, d.attempt, t + 40, 50), 0, "to %d", k);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		struct kvr_rank_stats s = stats(r, 0);
		cr_assert_eq(s.active_requests, 0);
		cr_assert_eq(s.active_blocks, 0);
		/* and back to a capacity, same incarnation */
		cr_assert_eq(kvr_rank_set_capacity(r, id, 1, 1000), 0);
		d = route(r, t, 40, 0);
		cr_assert_eq(kvr_request_output(r, d.attempt, t + 40, 50), 0);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		cr_assert_eq(route(r, t, 80, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 5);
		kvr_router_destroy(r);
	}
}

/* Issue 12 item 9: an allow-list longer than max_ranks made of duplicates is valid (it was
 * KVR_ERANGE, undocumented); a hash-given prompt cannot claim more than KVR_MAX_PROMPT_TOKENS
 * (two such requests wrapped the rank's prefill load to 0). */
Test(router, allow_duplicates_and_prompt_length_bound)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.max_ranks = 2;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id a = {5, 0};
	cr_assert_eq(kvr_rank_add(r, a, 1, 1000, 0), 0);
	uint32_t t[64];
	prompt(t, 64, 120);
	struct kvr_rank_id allow[5] = {a, a, a, {9, 9}, a};
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	q.allow = allow;
	q.n_allow = 5;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.rank.worker_id, 5);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);

	uint64_t h[2] = {1, 2};
	kvr_request_init(&q);
	q.local_hashes = h;
	q.n_hashes = 2;
	q.n_tokens = (size_t)(UINT64_C(1) << 63) + 8;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL);
	q.n_tokens = (size_t)KVR_MAX_PROMPT_TOKENS + 1;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL);
	q.n_tokens = (size_t)KVR_MAX_PROMPT_TOKENS;
	struct kvr_decision d1, d2;
	cr_assert_eq(kvr_route(r, &q, &d1), 0);
	cr_assert_eq(kvr_route(r, &q, &d2), 0);
	struct kvr_rank_stats s = stats(r, 5);
	cr_assert_eq(s.active_requests, 2);
	cr_assert_geq(s.active_prefill_tokens, KVR_MAX_PROMPT_TOKENS, "no wrap");
	cr_assert_eq(kvr_request_finish(r, d1.attempt), 0);
	cr_assert_eq(kvr_request_finish(r, d2.attempt), 0);
	kvr_router_destroy(r);
}

/* A prompt's complete blocks number fewer than 2^32: with block_size 1, KVR_MAX_PROMPT_TOKENS
 * tokens were 2^32 blocks, accepted, and the 32-bit block counts wrapped (a query of 2^32 hashes
 * got required_blocks 0; its booking a record of 0 blocks).  Refused now, with a detail that
 * says why; one token less, or block_size 2, is a prompt like any other. */
Test(router, block_count_stays_below_2_to_the_32)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.block_size = 1;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id a = {5, 0};
	cr_assert_eq(kvr_rank_add(r, a, 1, 1000, 0), 0);
	uint64_t h[2] = {1, 2};
	struct kvr_request q;
	kvr_request_init(&q);
	q.local_hashes = h;
	q.n_hashes = 2;
	q.n_tokens = (size_t)KVR_MAX_PROMPT_TOKENS;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL);
	cr_assert(strstr(kvr_last_error(), "2^32 blocks"), "%s", kvr_last_error());
	q.n_tokens = (size_t)KVR_MAX_PROMPT_TOKENS - 1;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.required_blocks, 2);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	kvr_router_destroy(r);

	c.block_size = 2;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, a, 1, 1000, 0), 0);
	q.n_tokens = (size_t)KVR_MAX_PROMPT_TOKENS;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	kvr_router_destroy(r);
}

/* sync_booking decides again when the chosen rank goes away before its booking; a rank replaced
 * (removed and added again) at every decision exhausts the retries, and the KVR_ENOENT's detail
 * says so: it said "no routable rank (none added, or all removed)" with the rank there. */
static struct kvr_router *churn_r;
static bool churn_on;
static uint64_t churn_inc = 1;
static uint64_t churn_clock(void *ctx)
{
	(void)ctx;
	if (churn_on) {
		struct kvr_rank_id a = {1, 0};
		kvr_rank_remove(churn_r, a);
		kvr_rank_add(churn_r, a, ++churn_inc, 100, 0);
	}
	return 1000;
}

Test(router, retries_exhausted_by_a_replaced_rank_say_so)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.block_size = 4;
	c.sync_booking = true;
	c.now_ns = churn_clock;
	cr_assert_eq(kvr_router_create(&c, &churn_r), 0);
	cr_assert_eq(kvr_rank_add(churn_r, (struct kvr_rank_id){1, 0}, 1, 100, 0), 0);
	uint32_t t[16];
	prompt(t, 16, 7);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 16;
	struct kvr_decision d;
	churn_on = true;
	int rc = kvr_route(churn_r, &q, &d);
	churn_on = false;
	cr_assert_eq(rc, KVR_ENOENT);
	cr_assert(strstr(kvr_last_error(), "before its booking"), "%s", kvr_last_error());
	/* The next plain failure names its own cause. */
	cr_assert_eq(kvr_rank_remove(churn_r, (struct kvr_rank_id){1, 0}), 0);
	cr_assert_eq(kvr_route(churn_r, &q, &d), KVR_ENOENT);
	cr_assert(strstr(kvr_last_error(), "no routable rank"), "%s", kvr_last_error());
	kvr_router_destroy(churn_r);
}

/* A frontend's own chain (local and sequence hashes, the suffix hashed with kvr_hash_extend)
 * routes exactly as the tokens do; sequence hashes alone are refused. */
Test(router, precomputed_sequence_hashes)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 4, 1 << 16, 0);
	enum { N = 16 * 40 + 5, B = N / 16, K = 25 };
	static uint32_t t[N];
	prompt(t, N, 3);
	struct kvr_decision a = route(r, t, 16 * K, 0); /* the first turn: K blocks */
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
	uint64_t local[B], seq[B];
	cr_assert_eq(kvr_hash_blocks(t, 16 * K, 16, NULL, local, seq), K);
	size_t got = 0;
	cr_assert_eq(kvr_hash_extend(&seq[K - 1], t + 16 * K, N - 16 * K, 16, NULL, local + K,
	                             seq + K, &got),
	             0);
	cr_assert_eq(got, B - K);
	struct kvr_request q;
	kvr_request_init(&q);
	q.local_hashes = local;
	q.seq_hashes = seq;
	q.n_hashes = B;
	q.n_tokens = N;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.rank.worker_id, a.rank.worker_id);
	cr_assert_eq(d.overlap_blocks, K, "the first turn's blocks, found by the given chain");
	cr_assert_eq(d.required_blocks, B);
	struct kvr_decision e = route(r, t, N, KVR_ROUTE_QUERY_ONLY);
	cr_assert_eq(e.overlap_blocks, B, "the given chain booked the blocks the tokens name");
	/* The sequence hashes name the blocks (local ones only feed the predicted cache's own
	 * bookkeeping): with other local hashes the lookup still finds every block. */
	uint64_t other[B];
	for (size_t i = 0; i < B; i++)
		other[i] = local[i] ^ 0x5555;
	q.local_hashes = other;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, B, "looked up by the given sequence hashes");
	/* Tokens with the hashes of every complete block: looked up by the hashes. */
	q.tokens = t;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.overlap_blocks, B);
	q.n_hashes = B - 1;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "with tokens: every complete block's");
	q.n_hashes = B;
	q.local_hashes = NULL;
	cr_assert_eq(kvr_route(r, &q, &d), KVR_EINVAL, "sequence hashes without local ones");
	kvr_router_destroy(r);
}

/* ---- issue 11: routing and lifecycle calls that do not wait for the shard ---- */
#include "core/router_internal.h"

static struct kvr_router *async_router(int n_ranks, uint64_t cap)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = false;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (int w = 0; w < n_ranks; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, cap, 0), 0);
	return r;
}

static int gate_open;
static void gate_task(struct kvr_shard *sh, void *payload)
{
	(void)sh;
	(void)payload;
	while (!__atomic_load_n(&gate_open, __ATOMIC_ACQUIRE)) {
		struct timespec ts = {0, 100000};
		nanosleep(&ts, NULL);
	}
}

/* Holds the rank's shard busy until gate_open is set. */
static void close_gate(struct kvr_router *r, uint64_t w)
{
	uint32_t slot;
	cr_assert_eq(kvr_router_find_rank(r, (struct kvr_rank_id){w, 0}, &slot), 0);
	__atomic_store_n(&gate_open, 0, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_shard_post(kvr_shards_get(r->shards, r->ranks[slot].shard),
	                            KVR_LANE_ROUTING, gate_task, NULL, 0),
	             0);
}

/* The decision, its attempt id, its return code and its load are all there while the shard has
 * not run anything yet; the next decision sees that load. */
Test(router, route_and_lifecycle_complete_while_the_shard_is_busy)
{
	struct kvr_router *r = async_router(2, 1000);
	uint32_t t[320];
	prompt(t, 320, 130);
	close_gate(r, 0);
	close_gate(r, 1);
	struct kvr_decision a = route(r, t, 320, 0);
	cr_assert_neq(a.attempt, 0);
	/* rank a is now 320 prefill tokens and 20 blocks busier: an unrelated prompt goes to the
	 * other rank, decided on the provisional load alone */
	uint32_t u[320];
	prompt(u, 320, 131);
	struct kvr_decision b = route(r, u, 320, 0);
	cr_assert_neq(b.rank.worker_id, a.rank.worker_id, "the provisional load was seen");
	cr_assert_eq(kvr_request_prefill_done(r, a.attempt), 0);
	cr_assert_eq(kvr_request_output(r, a.attempt, t, 20), 0, "heap-copied tokens");
	cr_assert_eq(kvr_request_output(r, a.attempt, t, 3), 0, "inline tokens");
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
	cr_assert_eq(kvr_request_finish(r, a.attempt), KVR_ESTALE,
	             "decided on the caller's thread");
	cr_assert_eq(kvr_request_abort(r, b.attempt), 0);
	cr_assert_eq(kvr_request_output(r, b.attempt, t, 3), KVR_ESTALE);
	__atomic_store_n(&gate_open, 1, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	for (int w = 0; w < 2; w++) {
		struct kvr_rank_stats s = stats(r, w);
		cr_assert_eq(s.active_requests, 0);
		cr_assert_eq(s.active_blocks, 0);
		cr_assert_eq(s.active_prefill_tokens, 0);
		/* booked, then released: cached; a's output (23 tokens, the last without KV)
		 * completed one more block */
		cr_assert_eq(s.indexed_blocks, (uint64_t)w == a.rank.worker_id ? 21 : 20);
	}
	kvr_router_destroy(r);
}

/* A finish posted by another thread right after kvr_route returned is applied after the
 * booking: nothing is left behind, every time. */
static struct kvr_router *xr;
static uint64_t handed[256];
static int n_handed;
static void *finish_elsewhere(void *arg)
{
	(void)arg;
	for (int i = 0; i < 256; i++) {
		uint64_t at;
		while (!(at = __atomic_load_n(&handed[i], __ATOMIC_ACQUIRE)))
			;
		cr_assert_eq(kvr_request_finish(xr, at), 0);
	}
	return NULL;
}
Test(router, finish_from_another_thread_comes_after_the_booking)
{
	xr = async_router(3, 100000);
	pthread_t th;
	pthread_create(&th, NULL, finish_elsewhere, NULL);
	uint32_t t[200];
	for (n_handed = 0; n_handed < 256; n_handed++) {
		prompt(t, 200, 140 + (uint32_t)n_handed % 5);
		struct kvr_decision d = route(xr, t, 200, 0);
		__atomic_store_n(&handed[n_handed], d.attempt, __ATOMIC_RELEASE);
	}
	pthread_join(th, NULL);
	cr_assert_eq(kvr_router_sync(xr, 5000), 0);
	for (int w = 0; w < 3; w++) {
		struct kvr_rank_stats s = stats(xr, w);
		cr_assert_eq(s.active_requests, 0);
		cr_assert_eq(s.active_blocks, 0);
		cr_assert_eq(s.active_prefill_tokens, 0);
		cr_assert_eq(s.indexed_blocks, s.resident_blocks);
	}
	kvr_router_destroy(xr);
}

/* A rank removed between the decision and the booking: the attempt is stale, nothing is left
 * behind, and the provisional load is taken back. */
static struct kvr_router *rr;
static void *remove_rank0(void *arg)
{
	(void)arg;
	cr_assert_eq(kvr_rank_remove(rr, (struct kvr_rank_id){0, 0}), 0);
	return NULL;
}
Test(router, rank_removed_before_the_booking_makes_the_attempt_stale)
{
	rr = async_router(1, 1000);
	uint32_t t[160];
	prompt(t, 160, 150);
	uint32_t slot;
	cr_assert_eq(kvr_router_find_rank(rr, (struct kvr_rank_id){0, 0}, &slot), 0);
	uint64_t gen = __atomic_load_n(&rr->ranks[slot].gen, __ATOMIC_ACQUIRE);
	close_gate(rr, 0);
	struct kvr_decision d = route(rr, t, 160, 0);
	pthread_t th;
	pthread_create(&th, NULL, remove_rank0, NULL);
	while (__atomic_load_n(&rr->ranks[slot].gen, __ATOMIC_ACQUIRE) == gen)
		; /* the removal has made the slot unroutable and waits for the busy shard */
	__atomic_store_n(&gate_open, 1, __ATOMIC_RELEASE);
	pthread_join(th, NULL);
	cr_assert_eq(kvr_router_sync(rr, 5000), 0);
	cr_assert_eq(kvr_request_finish(rr, d.attempt), KVR_ESTALE);
	cr_assert_eq(kvr_request_output(rr, d.attempt, t, 3), KVR_ESTALE);
	/* The removed rank's routing words: its snapshot zeroed, the provisional load taken back.
	 */
	cr_assert_eq(kvr_rank_load_prefill(&rr->load[slot], &rr->prov[slot]), 0);
	cr_assert_eq(kvr_rank_load_blocks(&rr->load[slot], &rr->prov[slot]), 0);
	cr_assert_eq(kvr_rank_add(rr, (struct kvr_rank_id){0, 0}, 2, 1000, 0), 0);
	cr_assert_eq(stats(rr, 0).active_requests, 0);
	cr_assert_eq(route(rr, t, 160, KVR_ROUTE_QUERY_ONLY).overlap_blocks, 0);
	char buf[1 << 15];
	size_t len;
	cr_assert_eq(kvr_metrics_render(rr, buf, sizeof(buf), &len), 0);
	cr_assert(strstr(buf, "kvr_stale_bookings_total 1"), "counted");
	kvr_router_destroy(rr);
}

/* Without sync_booking, a booking posted to a shard that booked within the last 10 ms is left
 * to the shard's short park (booking_lazy_ns): the caller makes no FUTEX_WAKE, and the next
 * decisions see the prompt's blocks once the park ends, with no kvr_router_sync.  With
 * booking_lazy_ns 0 every booking wakes the parked shard. */
static int routes_that_woke(uint64_t lazy_ns, int *deferred_seen)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = false;
	c.shard_idle_spin_ns = 0; /* parks at once: every gap between routes is a park */
	c.booking_lazy_ns = lazy_ns;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 0), 0);
	static uint32_t t[21][320];
	for (int k = 0; k < 21; k++)
		prompt(t[k], 320, 700 + (uint32_t)k);
	route(r, t[0], 320, 0); /* the first booking after the lull wakes the shard */
	int woke = 0;
	for (int k = 1; k < 21; k++) {
		struct timespec gap = {0, 2000000}; /* 2 ms: parked again, within 10 ms */
		nanosleep(&gap, NULL);
		struct kvr_post_costs c0, c1;
		kvr_shard_thread_costs(&c0);
		route(r, t[k], 320, 0);
		kvr_shard_thread_costs(&c1);
		woke += c1.futex_wakes != c0.futex_wakes;
		/* The booking reaches the index without a sync (within 5 s: never lost). */
		uint64_t t0 = kvr_router_now(r);
		while (route(r, t[k], 320, KVR_ROUTE_QUERY_ONLY).overlap_blocks != 20) {
			cr_assert_lt(kvr_router_now(r) - t0, 5000000000ull, "booking %d never ran",
			             k);
			struct timespec ts = {0, 20000};
			nanosleep(&ts, NULL);
		}
	}
	struct kvr_shard_stats st; /* bookings only: no lifecycle call was made */
	kvr_shard_get_stats(kvr_shards_get(r->shards, 0), &st);
	*deferred_seen = (int)st.wakes_deferred;
	kvr_router_destroy(r);
	return woke;
}

Test(router, booking_rides_the_shards_short_park)
{
	int deferred;
	int woke = routes_that_woke(1000000, &deferred);
	cr_assert_leq(woke, 10, "bookings left to a short park made no FUTEX_WAKE (%d of 20 did)",
	              woke);
	cr_assert_geq(deferred, 10, "%d deferred", deferred);
	woke = routes_that_woke(0, &deferred);
	cr_assert_geq(woke, 10, "booking_lazy_ns 0: bookings wake the parked shard (%d of 20)",
	              woke);
}

/* ---- issue 11 item 4: Dynamo's deduplicated decode load (pinned depth) ---- */

/* The pinned depth on slot x of tok[0..n)'s complete blocks, as kvr_route reads it (after the
 * shards applied everything posted). */
static uint32_t pinned_depth(struct kvr_router *r, const uint32_t *tok, size_t n, uint32_t x)
{
	static uint64_t local[512], seq[512];
	static uint32_t depth[1024], slots[1024];
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	size_t nb = kvr_hash_blocks(tok, n, 16, NULL, local, seq);
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	kvr_rcu_read_lock();
	size_t ns = kvr_pinmap_depths(r->pinmap, seq, nb, depth, slots);
	kvr_rcu_read_unlock();
	uint32_t d = depth[x];
	for (size_t i = 0; i < ns; i++)
		depth[slots[i]] = 0;
	return d;
}

/* A follow-up that shares a long prefix with a request still decoding on rank X goes to X: X's
 * decode cost counts only the follow-up's blocks not already pinned there.  (Counting every
 * block as new, X looked 135 blocks busier than an idle rank and the follow-up went there to
 * recompute the whole prefix.) */
Test(router, follow_up_sibling_joins_the_decoding_prefix)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 2, 100000, 0);
	static uint32_t t[2000 + 161], b[2000 + 80];
	prompt(t, 2000 + 161, 160);
	struct kvr_decision a = route(r, t, 2000, 0); /* 125 blocks */
	cr_assert_eq(kvr_request_prefill_done(r, a.attempt), 0);
	/* decoding: 161 output tokens, 160 with KV: 10 more blocks pinned on X */
	cr_assert_eq(kvr_request_output(r, a.attempt, t + 2000, 161), 0);
	cr_assert_eq(stats(r, a.rank.worker_id).active_blocks, 135);
	memcpy(b, t, 2000 * sizeof(uint32_t));
	for (int i = 0; i < 80; i++)
		b[2000 + i] = 900000 + (uint32_t)i; /* its own question, not A's answer */
	struct kvr_decision f = route(r, b, 2080, 0);
	cr_assert_eq(f.rank.worker_id, a.rank.worker_id, "the follow-up joins its sibling");
	cr_assert_eq(f.overlap_blocks, 125);
	/* X's load counts the shared 125 blocks once */
	cr_assert_eq(stats(r, a.rank.worker_id).active_blocks, 135 + 5);
	/* What routers read: X's pinned depth of A's chain (125 prompt + 10 output blocks). */
	uint32_t x;
	cr_assert_eq(kvr_router_find_rank(r, a.rank, &x), 0);
	cr_assert_eq(pinned_depth(r, t, 2160, x), 135, "the published runs mirror the pins");
	cr_assert_eq(pinned_depth(r, b, 2080, x), 130, "the follow-up's own 5 blocks too");
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
	cr_assert_eq(pinned_depth(r, t, 2160, x), 125,
	             "A's 10 output blocks went; the prefix stays");
	cr_assert_eq(kvr_request_finish(r, f.attempt), 0);
	cr_assert_eq(pinned_depth(r, t, 2160, x), 0);
	kvr_router_destroy(r);
}

/* Many agents on one system prompt (125 blocks), each with a 2-block question, all decoding:
 * the prefix stays on its rank while the rank's extra decode load (2 blocks per agent) is below
 * what recomputing the prefix elsewhere costs (125 blocks of prefill and decode), then spills.
 * cost(X) = 2 + (125 + 2k) + 2 against cost(idle) = 127 + 127: the k-th agent (k from 0) stays
 * while 2k <= 123, so 62 stay and the 63rd spills. */
Test(router, hot_prefix_burst_stays_until_its_load_outweighs_the_recompute)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 2, 1000000, 0);
	static uint32_t q[2000 + 32];
	prompt(q, 2000, 170);
	uint64_t home = UINT64_MAX;
	int spilled_at = -1;
	uint64_t attempts[80];
	for (int k = 0; k < 80; k++) {
		for (int i = 0; i < 32; i++)
			q[2000 + i] = 500000 + (uint32_t)k * 64 + (uint32_t)i;
		struct kvr_decision d = route(r, q, 2032, 0);
		attempts[k] = d.attempt;
		cr_assert_eq(kvr_request_prefill_done(r, d.attempt), 0);
		if (home == UINT64_MAX)
			home = d.rank.worker_id;
		else if (d.rank.worker_id != home && spilled_at < 0)
			spilled_at = k;
		if (spilled_at < 0)
			cr_assert_eq(d.overlap_blocks, k ? 125 : 0);
	}
	cr_assert_geq(spilled_at, 60, "stayed while the shared prefix was cheaper (%d)",
	              spilled_at);
	cr_assert_leq(spilled_at, 64, "spilled once the load outweighed the recompute (%d)",
	              spilled_at);
	for (int k = 0; k < 80; k++)
		cr_assert_eq(kvr_request_finish(r, attempts[k]), 0);
	for (int w = 0; w < 2; w++)
		cr_assert_eq(stats(r, w).active_blocks, 0);
	kvr_router_destroy(r);
}

/* A router made from another's kvr_router_get_config pins its shards to the same CPUs.  Before,
 * get_config gave cpu_list NULL and n_cpus 0 (the list was borrowed for the create only), so a
 * configuration read back to make a replacement router (a reload) lost the pinning. */
Test(router, config_read_back_keeps_the_cpu_list)
{
	cpu_set_t set;
	cr_assert_eq(sched_getaffinity(0, sizeof(set), &set), 0);
	int cpus[2], n = 0;
	for (int c = CPU_SETSIZE - 1; c >= 0 && n < 2; c--) /* the mask's last CPUs, reversed */
		if (CPU_ISSET(c, &set))
			cpus[n++] = c;
	struct kvr_config c;
	kvr_config_init(&c);
	c.cpu_list = cpus;
	c.n_cpus = (size_t)n;
	c.n_shards = 2;
	struct kvr_router *a, *b;
	cr_assert_eq(kvr_router_create(&c, &a), 0, "%s", kvr_last_error());
	cpus[0] = cpus[1] = -1; /* borrowed for the create only */
	struct kvr_config got;
	cr_assert_eq(kvr_router_get_config(a, &got), 0);
	cr_assert_eq(got.n_cpus, (size_t)n);
	cr_assert_not_null(got.cpu_list);
	cr_assert_eq(kvr_router_create(&got, &b), 0, "%s", kvr_last_error());
	for (uint32_t i = 0; i < 2; i++) {
		struct kvr_shard_stats sa, sb;
		kvr_shard_get_stats(kvr_shards_get(a->shards, i), &sa);
		kvr_shard_get_stats(kvr_shards_get(b->shards, i), &sb);
		cr_assert_eq(sb.cpu, sa.cpu, "shard %u: cpu %d, the original's %d", i, sb.cpu,
		             sa.cpu);
		cr_assert_eq(got.cpu_list[i % (uint32_t)n], sa.cpu);
	}
	kvr_router_destroy(b);
	kvr_router_destroy(a);
}

/* The live list grows in place (core/router_internal.h, struct kvr_live): every rank added is
 * routable at the very next decision, on the thread that scored the list before it grew, across
 * the list's growths and after removals copied it.  Each rank keeps one request in prefill, so
 * the rank just added, the only idle one, must win. */
Test(router, each_rank_added_is_routable_at_once)
{
	struct kvr_router *r = make(KVR_MODE_APPROX_LRU, 0, 100000, 0);
	uint32_t t[64];
	uint64_t att[200];
	for (uint64_t w = 0; w < 200; w++) {
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 100000, 1024), 0);
		prompt(t, 64, (int)w + 1);
		struct kvr_decision d = route(r, t, 64, 0);
		cr_assert_eq(d.rank.worker_id, w, "rank %" PRIu64 " added, routed to %" PRIu64, w,
		             d.rank.worker_id);
		att[w] = d.attempt;
	}
	for (uint64_t w = 0; w < 200; w += 3)
		cr_assert_eq(kvr_rank_remove(r, (struct kvr_rank_id){w, 0}), 0);
	for (uint64_t w = 0; w < 200; w += 3) {
		cr_assert_eq(kvr_request_finish(r, att[w]), KVR_ESTALE);
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 2, 100000, 1024), 0);
		prompt(t, 64, 1000 + (int)w);
		struct kvr_decision d = route(r, t, 64, 0);
		cr_assert_eq(d.rank.worker_id, w, "rank %" PRIu64 " re-added, routed to %" PRIu64,
		             w, d.rank.worker_id);
	}
	kvr_router_destroy(r);
}

/* With expected_prefill_ns, a decision sees the oldest prefill decay as time passes, not only
 * at the rank's next event (before, a 1,024-token prefill of 1,000 ns still counted whole at
 * 5,000 ns: cost 130 where the stats and an idle rank say 66; it is published again every
 * 1/16 of the time, so at 500 ns it reads within 1/16 of the stats' 512). */
static double query_cost(struct kvr_router *r)
{
	static uint32_t t[16];
	prompt(t, 16, 90);
	return route(r, t, 16, KVR_ROUTE_QUERY_ONLY).cost;
}

Test(router, decisions_see_the_oldest_prefill_decay)
{
	for (int sync = 0; sync < 2; sync++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.now_ns = vclock;
		c.expected_prefill_ns = 1000;
		c.sync_booking = sync;
		vnow = 1000;
		struct kvr_router *r;
		cr_assert_eq(kvr_router_create(&c, &r), 0);
		struct kvr_rank_id id = {1, 0};
		cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 0), 0);
		static uint32_t t[1024];
		prompt(t, 1024, 91);
		struct kvr_decision d = route(r, t, 1024, 0);
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		cr_assert_eq(query_cost(r), 130.0, "1024 + 16 tokens of prefill, 2 decode blocks");
		__atomic_store_n(&vnow, 1500, __ATOMIC_RELAXED);
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		double half = query_cost(r);
		cr_assert(half >= 98.0 && half <= 98.0 + 64.0 / 16 + 1, "sync %d: cost %f at half",
		          sync, half);
		__atomic_store_n(&vnow, 6000, __ATOMIC_RELAXED);
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		cr_assert_eq(query_cost(r), 66.0, "sync %d: the prefill decayed away", sync);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		kvr_router_destroy(r);
	}
	vnow = 1000;
}

/* From on_admit, inside the admission pass: a KVR_ROUTE_WAIT request whose ranks are all
 * saturated, and kvr_route_wait on a ticket not admitted yet, return KVR_EBUSY at once (only the
 * pass they would block could admit them; before, both waited for good without a deadline).
 * The waited-for ticket stays queued and on_admit tells its admission later. */
static struct kvr_router *inside_r;
static uint64_t inside_ticket;
static int inside_route_rc = 1, inside_wait_rc = 1;
static size_t inside_depth;
static void on_admit_inside(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	on_admit(ctx, ticket, d);
	if (n_admitted != 1)
		return;
	static uint32_t t[400];
	prompt(t, 400, 95);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 400;
	q.flags = KVR_ROUTE_WAIT;
	struct kvr_decision dd;
	inside_route_rc = kvr_route(inside_r, &q, &dd);
	inside_wait_rc = kvr_route_wait(inside_r, inside_ticket, 0, &dd);
	char text[1 << 16];
	size_t len;
	cr_assert_eq(kvr_metrics_render(inside_r, text, sizeof(text), &len), 0);
	inside_depth = strstr(text, "kvr_queue_depth 1\n") ? 1 : 0;
}

Test(router, waits_inside_the_admission_pass_are_refused, .timeout = 20)
{
	struct kvr_router *r = inside_r = budget_router(on_admit_inside, KVR_QUEUE_FCFS, 0, 1);
	static uint32_t hog[2000], a[1600], b[400];
	prompt(hog, 2000, 92);
	prompt(a, 1600, 93);
	prompt(b, 400, 94);
	struct kvr_decision h = route(r, hog, 2000, 0);
	struct kvr_decision da = route(r, a, 1600, 0), db = route(r, b, 400, 0);
	cr_assert_eq(da.status, KVR_QUEUED);
	cr_assert_eq(db.status, KVR_QUEUED);
	inside_ticket = db.ticket;
	cr_assert_eq(kvr_request_prefill_done(r, h.attempt), 0); /* A admitted; A saturates */
	cr_assert_eq(n_admitted, 1);
	cr_assert_eq(inside_route_rc, KVR_EBUSY, "the waited route inside the pass");
	cr_assert_eq(inside_wait_rc, KVR_EBUSY, "the wait inside the pass");
	cr_assert_eq(inside_depth, 1, "only B queued: the refused route left nothing");
	cr_assert_eq(kvr_request_prefill_done(r, admitted_attempt[0]), 0);
	cr_assert_eq(n_admitted, 2, "B told through on_admit");
	cr_assert_eq(admitted[1], db.ticket);
	kvr_router_destroy(r);
}
