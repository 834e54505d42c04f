/*
 * kvr-replay's engine (tools/replay): the accounting of a replay, the baselines, determinism,
 * and, with requests run one at a time, that approx_lru's prediction equals the simulator's
 * cached set block for block after every request (the strongest check that the router's LRU
 * mirrors vLLM's block pool).
 *
 * The trace is synthetic (built in memory, Mooncake format): multi-turn conversations whose
 * turns extend the previous turn's prompt, so prefixes repeat and a small pool evicts.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/replay/policy.h"
#include "tools/replay/replay.h"
#include "tools/replay/report.h"
#include "tools/replay/sweep.h"
#include "tools/trace.h"

/* sessions x turns requests; turn k of session s holds 2 + k ids (s's own), arrival gap_ms
 * apart, sessions interleaved.  aligned: every request occupies only full blocks (prompt a
 * multiple of 16 tokens, 17 output tokens of which 16 are computed), so no block is partial. */
static void make_trace_x(struct trace *t, int sessions, int turns, int gap_ms, bool aligned)
{
	size_t cap = 1 << 20, len = 0;
	char *buf = malloc(cap);
	cr_assert_not_null(buf);
	int n = 0;
	for (int k = 0; k < turns; k++) {
		for (int s = 0; s < sessions; s++, n++) {
			int ids = 2 + k;
			len += (size_t)snprintf(buf + len, cap - len,
			                        "{\"timestamp\": %d, \"input_length\": %d, "
			                        "\"output_length\": %d, \"hash_ids\": [",
			                        n * gap_ms,
			                        aligned ? ids * 512 - 96 : ids * 512 - 100 + 7 * s,
			                        aligned ? 17 : 20 + 13 * (n % 5));
			for (int i = 0; i < ids; i++)
				len += (size_t)snprintf(buf + len, cap - len, "%s%d", i ? ", " : "",
				                        s * 1000 + i);
			len += (size_t)snprintf(buf + len, cap - len, "]}\n");
		}
	}
	char err[256];
	cr_assert_eq(trace_load_mem(t, "synthetic", buf, len, false, 0, err, sizeof(err)), 0, "%s",
	             err);
	trace_finish(t);
	free(buf);
}

static void make_trace(struct trace *t, int sessions, int turns, int gap_ms)
{
	make_trace_x(t, sessions, turns, gap_ms, false);
}

static struct replay_config base_cfg(void)
{
	struct replay_config c;
	replay_config_init(&c);
	c.n_ranks = 4;
	c.blocks_per_rank = 1024;
	return c;
}

static void run(const struct trace *t, const struct replay_policy_ops *ops,
                const struct replay_config *c, struct replay_result *res)
{
	char err[256];
	int rc = replay_run(t, ops, c, res, err, sizeof(err));
	cr_assert_eq(rc, 0, "%s: %s", ops->name, err);
}

Test(replay, baselines_account_every_request)
{
	struct trace t = {0};
	make_trace(&t, 6, 8, 200);
	struct replay_config c = base_cfg();
	const struct replay_policy_ops *ops[] = {&replay_policy_round_robin, &replay_policy_random,
	                                         &replay_policy_least_loaded};
	for (size_t i = 0; i < 3; i++) {
		struct replay_result r;
		run(&t, ops[i], &c, &r);
		cr_assert_eq(r.n_requests, t.n);
		cr_assert_eq(r.n_refused, 0);
		cr_assert_eq(r.policy_errors, 0);
		cr_assert_eq(r.n_ttft, t.n, "%s: every request finished", ops[i]->name);
		cr_assert(r.hit_blocks <= r.prompt_blocks);
		cr_assert(r.prompt_blocks > 0);
		cr_assert(r.ttft_p50_ms > 0 && r.ttft_p50_ms <= r.ttft_p99_ms);
		cr_assert(r.e2e_p50_ms >= r.ttft_p50_ms);
		cr_assert(r.imbalance_busy >= 1.0);
		cr_assert_eq(r.n_pred, 0, "baselines do not predict");
		uint64_t hb = 0, pb = 0;
		for (uint32_t b = 0; b < r.n_buckets; b++) {
			hb += r.bucket_hit[b];
			pb += r.bucket_prompt[b];
		}
		cr_assert_eq(hb, r.hit_blocks, "buckets sum to the totals");
		cr_assert_eq(pb, r.prompt_blocks);
		replay_result_free(&r);
	}
	trace_free(&t);
}

/* queue_threshold > 0 under overload: the router holds requests back, the replay submits each
 * when on_admit fires, and every request is still accounted for, its TTFT counted from its
 * trace arrival (so a queued request's wait is in it); with the queue off nothing is held. */
Test(replay, queued_requests_are_submitted_and_accounted)
{
	struct trace t = {0};
	make_trace(&t, 12, 6, 1); /* 72 requests one ms apart: far past saturation */
	struct replay_config c = base_cfg();
	c.n_ranks = 2;
	c.max_batched_tokens = 1024;
	struct replay_result off, on;
	run(&t, &replay_policy_approx_lru, &c, &off);
	c.queue_threshold = 0.5;
	run(&t, &replay_policy_approx_lru, &c, &on);
	cr_assert_eq(off.n_queued, 0);
	cr_assert_gt(on.n_queued, 0, "the router held requests back");
	for (int k = 0; k < 2; k++) {
		const struct replay_result *r = k ? &on : &off;
		cr_assert_eq(r->policy_errors, 0, "first error %d", r->first_policy_error);
		cr_assert_eq(r->n_refused, 0);
		cr_assert_eq(r->n_ttft, t.n, "every request finished");
		cr_assert_eq(r->n_adm, t.n, "every request admitted once");
		cr_assert_eq(r->n_pred, t.n);
		cr_assert(r->ttft_p50_ms > 0 && r->ttft_p50_ms <= r->ttft_p99_ms);
	}
	cr_log_info("queue off: TTFT p50 %.1f p99 %.1f ms; threshold 0.5: %zu queued, p50 %.1f p99 "
	            "%.1f ms",
	            off.ttft_p50_ms, off.ttft_p99_ms, on.n_queued, on.ttft_p50_ms, on.ttft_p99_ms);
	replay_result_free(&off);
	replay_result_free(&on);
	trace_free(&t);
}

/* Round robin over 4 ranks with sessions = 4: every session always lands on the same rank,
 * so a pool big enough for everything hits every repeated prefix block. */
Test(replay, sticky_round_robin_hits_repeats)
{
	struct trace t = {0};
	make_trace(&t, 4, 5, 2000);
	struct replay_config c = base_cfg();
	c.blocks_per_rank = 8192;
	struct replay_result r;
	run(&t, &replay_policy_round_robin, &c, &r);
	/* Turn k (k >= 1) of session s repeats turn k - 1's prompt: its k full ids (32 blocks
	 * each) and the full blocks of the partial last id (412 + 7 s tokens). */
	uint64_t want = 0;
	for (int k = 1; k < 5; k++)
		for (int s = 0; s < 4; s++)
			want += (uint64_t)k * 32 + (uint64_t)(412 + 7 * s) / 16;
	cr_assert_eq(r.hit_blocks, want, "hits %llu want %llu", (unsigned long long)r.hit_blocks,
	             (unsigned long long)want);
	replay_result_free(&r);
	trace_free(&t);
}

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	cr_assert_not_null(f);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *s = calloc(1, (size_t)n + 1);
	cr_assert_eq(fread(s, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	return s;
}

/* The JSON report of result r (freed) of n_requests under c, as text (the caller frees it). */
static char *json_text(const struct replay_config *c, struct replay_result *r, size_t n_requests)
{
	char path[] = "/tmp/test_replay_XXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0);
	close(fd);
	const char *names[] = {"synthetic"};
	struct replay_meta meta = {
	    .traces = names, .n_traces = 1, .n_requests = n_requests, .cfg = c};
	char err[256];
	cr_assert_eq(replay_report_json(path, &meta, r, 1, false, err, sizeof(err)), 0, "%s", err);
	replay_result_free(r);
	char *s = slurp(path);
	unlink(path);
	return s;
}

static char *json_of(const struct trace *t, const struct replay_policy_ops *ops, uint64_t seed)
{
	struct replay_config c = base_cfg();
	c.seed = seed;
	struct replay_result r;
	run(t, ops, &c, &r);
	return json_text(&c, &r, t->n);
}

Test(replay, same_seed_same_json)
{
	struct trace t = {0};
	make_trace(&t, 6, 8, 150);
	char *a = json_of(&t, &replay_policy_random, 7);
	char *b = json_of(&t, &replay_policy_random, 7);
	char *d = json_of(&t, &replay_policy_random, 8);
	cr_assert_str_eq(a, b);
	cr_assert(strcmp(a, d) != 0, "another seed routes differently");
	free(a);
	free(b);
	free(d);
	trace_free(&t);
}

Test(replay, rejects_bad_config)
{
	struct trace t = {0};
	make_trace(&t, 1, 1, 1);
	struct replay_config c = base_cfg();
	c.blocks_per_rank = 0;
	struct replay_result r;
	char err[256];
	cr_assert_lt(replay_run(&t, &replay_policy_round_robin, &c, &r, err, sizeof(err)), 0);
	/* A pool too small for a request: the simulator refuses it, the replay counts it. */
	c.blocks_per_rank = 16;
	cr_assert_eq(replay_run(&t, &replay_policy_least_loaded, &c, &r, err, sizeof(err)), 0, "%s",
	             err);
	cr_assert_eq(r.n_refused, 1);
	replay_result_free(&r);
	trace_free(&t);
}

Test(replay, default_blocks_fit_the_longest_request)
{
	struct trace t = {0};
	make_trace(&t, 3, 4, 100);
	struct replay_config c = base_cfg();
	char why[256];
	uint32_t b = replay_default_blocks(&t, &c, why, sizeof(why));
	uint32_t longest = 0;
	for (size_t i = 0; i < t.n; i++) {
		uint32_t need = (t.reqs[i].input_len + t.reqs[i].output_len + 15) / 16;
		longest = need > longest ? need : longest;
	}
	cr_assert_geq(b, 2 * longest, "%u: %s", b, why);
	cr_assert(strstr(why, "working set") != NULL);
	trace_free(&t);
}

/*
 * The strongest check: one request at a time (each finishes before the next arrives, nothing
 * preempted), after every request, the simulator's cached set on every rank equals the
 * router's prediction block for block, and every routing decision predicted the cached prefix
 * the engine found exactly.  Checked without eviction (big pool) and with it (small pool).
 *
 * The replay passes every sampled token to kvr_request_output_ex, the final one included and
 * flagged KVR_OUTPUT_FINAL, as a streaming frontend can; the router leaves out the block only the
 * final token would complete (vLLM never computes that token's KV).  strict = false asserts only
 * the one-sided properties (every cached block predicted, never under-predicted).
 */
static void serial_check(const struct replay_policy_ops *ops, uint32_t blocks, bool aligned,
                         bool strict)
{
	struct trace t = {0};
	make_trace_x(&t, 5, 8, 100, aligned);
	struct replay_config c = base_cfg();
	c.n_ranks = 2;
	c.blocks_per_rank = blocks;
	c.serial = true;
	struct replay_result r;
	run(&t, ops, &c, &r);
	cr_log_info("%s, %u blocks%s: %llu/%llu predictions exact (over %llu, under %llu); "
	            "%llu/%llu samples exact, %llu with sim inside predicted; mean sim %.1f "
	            "predicted %.1f",
	            ops->name, blocks, aligned ? ", aligned" : "", (unsigned long long)r.n_exact,
	            (unsigned long long)r.n_pred, (unsigned long long)r.n_over,
	            (unsigned long long)r.n_under, (unsigned long long)r.agree_exact,
	            (unsigned long long)r.agree_samples, (unsigned long long)r.agree_subset,
	            (double)r.sim_cached_sum / (double)r.agree_samples,
	            (double)r.pred_resident_sum / (double)r.agree_samples);
	cr_assert_eq(r.policy_errors, 0, "%s: first error %d", ops->name, r.first_policy_error);
	cr_assert_eq(r.preemptions, 0);
	cr_assert_eq(r.agree_samples, (uint64_t)t.n * c.n_ranks);
	cr_assert_eq(r.agree_subset, r.agree_samples, "%s: every cached block predicted",
	             ops->name);
	cr_assert_eq(r.n_under, 0, "%s: never under-predicts", ops->name);
	if (strict) {
		cr_assert_eq(r.n_exact, r.n_pred, "%s: every prediction exact", ops->name);
		cr_assert_eq(r.agree_exact, r.agree_samples, "%s: equal sets after every request",
		             ops->name);
	}
	if (blocks < 1000)
		cr_assert_gt(r.evicted_blocks, 0, "the pool must evict");
	else
		cr_assert_eq(r.evicted_blocks, 0);
	replay_result_free(&r);
	trace_free(&t);
}

Test(replay, serial_lru_equals_sim_without_eviction)
{
	serial_check(&replay_policy_approx_lru, 8192, false, true);
}

Test(replay, serial_lru_equals_sim_under_eviction)
{
	serial_check(&replay_policy_approx_lru, 700, true, true);
}

Test(replay, serial_lru_partial_blocks_under_eviction)
{
	serial_check(&replay_policy_approx_lru, 700, false, false);
}

Test(replay, serial_lru_exact_partial_blocks_under_eviction)
{
	serial_check(&replay_policy_approx_lru, 700, false, true);
}

Test(replay, serial_events_equal_sim)
{
	serial_check(&replay_policy_events, 700, false, true);
}

/*
 * Concurrent replay, one rank: a decode block the engine takes must reach the router before the
 * next arrival that its eviction concerns.  R0 leaves its 32 blocks cached; A (33 blocks, 8
 * tokens in its last) decodes, and with the pool full (68 blocks, R1's 2 released behind R0's)
 * each new block of A evicts R0's deepest.  A's block 34 is taken as output token 24 (position
 * 544) is sampled, 177.8 ms in, and evicts R0's block 31; C asks for R0's prefix at 190 ms.
 * Output batches counted from A's first output token went out at tokens 15 and 31 (213 ms):
 * the router still counted block 31 and predicted 32 where the engine held 31.  Batches that
 * end one token past a block boundary (token 25, 183 ms) predict 31.  The same as the Mooncake
 * sample's request 1035, seed 3 (tools/replay/testdata/decode_boundary.jsonl is this trace).
 */
Test(replay, decode_block_reaches_router_before_next_arrival)
{
	static const char trace_text[] =
	    "{\"timestamp\":0,\"input_length\":512,\"output_length\":1,\"hash_ids\":[0]}\n"
	    "{\"timestamp\":0,\"input_length\":520,\"output_length\":100,\"hash_ids\":[1,3]}\n"
	    "{\"timestamp\":60,\"input_length\":32,\"output_length\":1,\"hash_ids\":[5]}\n"
	    "{\"timestamp\":190,\"input_length\":520,\"output_length\":1,\"hash_ids\":[0,2]}\n";
	struct trace t = {0};
	char err[256];
	cr_assert_eq(trace_load_mem(&t, "decode_boundary", trace_text, sizeof(trace_text) - 1,
	                            false, 0, err, sizeof(err)),
	             0, "%s", err);
	trace_finish(&t);
	struct replay_config c = base_cfg();
	c.n_ranks = 1;
	c.blocks_per_rank = 68;
	struct replay_result r;
	run(&t, &replay_policy_approx_lru, &c, &r);
	cr_assert_eq(r.policy_errors, 0);
	cr_assert_eq(r.n_pred, 4);
	cr_assert_gt(r.evicted_blocks, 0, "A's decode blocks must evict R0's");
	cr_assert_eq(r.n_exact, r.n_pred, "over %llu under %llu", (unsigned long long)r.n_over,
	             (unsigned long long)r.n_under);
	replay_result_free(&r);
	trace_free(&t);
}

/* Router CPU per decision counts decisions: under foreign traffic the mean divided by every
 * arrival and the p99 ran over them too, foreign ones counting 0 (at a 99.5 % share the p99 was
 * 0 and the mean 1/200 of a decision's), while the hashing floor divided by routes made. */
Test(replay, route_cpu_counts_decisions_only)
{
	struct trace t = {0};
	make_trace(&t, 10, 40, 50);
	struct replay_config c = base_cfg();
	c.foreign_share = 0.995;
	struct replay_result r;
	run(&t, &replay_policy_approx_lru, &c, &r);
	cr_assert(r.n_foreign > 0 && r.n_foreign < t.n, "%llu foreign of %zu",
	          (unsigned long long)r.n_foreign, t.n);
	cr_assert_gt(r.route_cpu_ns_p99, 0);
	cr_assert_leq(r.route_cpu_ns_mean, r.route_cpu_ns_p99 * 1.000001,
	              "mean %.0f ns above the p99 %.0f over %zu decisions", r.route_cpu_ns_mean,
	              r.route_cpu_ns_p99, t.n - (size_t)r.n_foreign);
	replay_result_free(&r);
	trace_free(&t);
}

/* A request no rank can hold is refused before routing, as vLLM's frontend refuses one over
 * max_model_len (kvr-replay --max-model-len adds that check): routed and then aborted, its prompt
 * stayed in approx_lru's predicted cache (the engine never held it; no lifecycle call takes an
 * admitted request's blocks back), and the predicted set differed from the engine's from then on.
 */
Test(replay, serial_lru_stays_exact_when_requests_are_refused)
{
	struct trace t = {0};
	make_trace_x(&t, 5, 8, 100, true);
	struct replay_config c = base_cfg();
	c.n_ranks = 2;
	c.blocks_per_rank = 200; /* turns of 7 ids and more (224 blocks) never fit */
	c.serial = true;
	struct replay_result r;
	run(&t, &replay_policy_approx_lru, &c, &r);
	cr_assert_eq(r.n_refused, 15);
	cr_assert_eq(r.n_refused_routed, 0);
	cr_assert_eq(r.n_pred, t.n - 15);
	cr_assert_eq(r.n_exact, r.n_pred);
	cr_assert_eq(r.agree_samples, (uint64_t)(t.n - 15) * c.n_ranks);
	cr_assert_eq(r.agree_exact, r.agree_samples, "%llu of %llu sets equal",
	             (unsigned long long)r.agree_exact, (unsigned long long)r.agree_samples);
	cr_assert_gt(r.evicted_blocks, 0);
	replay_result_free(&r);
	trace_free(&t);
}

/* The JSON says how many refused requests the policy under test had routed (their blocks stay
 * in its prediction): the text table's note said it, the JSON did not.  The simulator refuses
 * after routing only when it and sim_engine_fits disagree, so the count is set here by hand. */
Test(replay, json_counts_refused_after_routing)
{
	struct trace t = {0};
	make_trace_x(&t, 5, 8, 100, true);
	struct replay_config c = base_cfg();
	c.n_ranks = 2;
	c.blocks_per_rank = 200; /* 15 requests never fit */
	struct replay_result r;
	run(&t, &replay_policy_round_robin, &c, &r);
	cr_assert_eq(r.n_refused, 15);
	r.n_refused_routed = 3;
	char *text = json_text(&c, &r, t.n);
	json_error_t je;
	json_t *root = json_loads(text, 0, &je);
	free(text);
	cr_assert_not_null(root, "%s", je.text);
	json_t *p = json_array_get(json_object_get(root, "policies"), 0);
	cr_assert_eq(json_integer_value(json_object_get(p, "refused")), 15);
	json_t *ar = json_object_get(p, "refused_after_routing");
	cr_assert(json_is_integer(ar), "no \"refused_after_routing\" in the JSON");
	cr_assert_eq(json_integer_value(ar), 3);
	json_decref(root);
	trace_free(&t);
}

/* A refused arrival drawn into the foreign share counted in n_foreign and in n_refused both, so
 * requests - foreign - refused (this router's requests) came out short by those: every arrival
 * is this router's (and predicted, approx_lru), foreign or refused, exactly once. */
Test(replay, a_refused_foreign_arrival_counts_once)
{
	struct trace t = {0};
	make_trace_x(&t, 5, 8, 100, true);
	struct replay_config c = base_cfg();
	c.n_ranks = 2;
	c.blocks_per_rank = 200; /* 15 requests never fit */
	c.foreign_share = 0.3;
	c.foreign_ops = &replay_policy_approx_lru;
	const enum replay_foreign_as modes[] = {REPLAY_FOREIGN_CLIENTS, REPLAY_FOREIGN_ROUTER,
	                                        REPLAY_FOREIGN_SELF};
	for (size_t m = 0; m < 3; m++) {
		c.foreign_as = modes[m];
		struct replay_result r;
		run(&t, &replay_policy_approx_lru, &c, &r);
		cr_assert_eq(r.policy_errors, 0);
		cr_assert_eq(r.n_refused, 15, "mode %zu", m);
		cr_assert(r.n_foreign > 0, "mode %zu", m);
		cr_assert_eq(
		    r.n_pred + r.n_foreign + r.n_refused, (uint64_t)t.n,
		    "mode %zu: %llu predicted + %llu foreign + %zu refused != %zu arrivals", m,
		    (unsigned long long)r.n_pred, (unsigned long long)r.n_foreign, r.n_refused,
		    t.n);
		replay_result_free(&r);
	}
	trace_free(&t);
}

/* --sweep's refusal of a value out of range names the whole range: "ttl: 1e30 is out of range
 * (> 0)" named only the lower bound, which 1e30 is well within, and left the user guessing at
 * the upper one. */
Test(replay, sweep_range_error_names_both_bounds)
{
	struct sweep s = {0};
	char err[256];
	cr_assert_eq(sweep_parse(&s, "ttl=1e30", err, sizeof(err)), -1);
	cr_assert(strstr(err, "1e30 is out of range (> 0 and <= 1000000000)"), "%s", err);
	cr_assert_eq(sweep_parse(&s, "blocks=0", err, sizeof(err)), -1);
	cr_assert(strstr(err, "0 is out of range (>= 1 and <= 4294967295, a whole number)"), "%s",
	          err);
	cr_assert_eq(sweep_parse(&s, "foreign_traffic=1", err, sizeof(err)), -1);
	cr_assert(strstr(err, "(>= 0 and <= 0.99)"), "%s", err);
	cr_assert_eq(sweep_parse(&s, "ttl=30,60", err, sizeof(err)), 0);
}

/* The verdict's text for results res[0..n) (and ceil, may be NULL), as one string (freed by the
 * caller). */
static char *verdict_of(const struct replay_result *res, size_t n,
                        const struct replay_ceiling *ceil)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	cr_assert_not_null(f);
	replay_report_verdict(f, res, n, "t", ceil);
	fclose(f);
	return buf;
}

static void fake(struct replay_result *r, const char *name, bool predicts, uint64_t hit, double p50,
                 double p99)
{
	memset(r, 0, sizeof(*r));
	snprintf(r->policy, sizeof(r->policy), "%s", name);
	r->predicts = predicts;
	r->prompt_tokens = 1000;
	r->hit_tokens = hit;
	r->ttft_p50_ms = p50;
	r->ttft_p99_ms = p99;
}

/* TTFTs 1 % apart (approx_lru vs least_loaded p99 on the Mooncake sample read "1.01x faster" at
 * seed 1, "1.01x slower" at seed 2): "about the same", the ratio kept; 10 % apart: a
 * direction.  Before, anything past 0.5 % was "faster" or "slower". */
Test(replay, verdict_calls_a_ttft_within_noise_the_same)
{
	struct replay_result r[3];
	fake(&r[0], "approx_lru", true, 100, 100.0, 1000.0);
	fake(&r[1], "round_robin", false, 50, 110.0, 1010.0);
	fake(&r[2], "least_loaded", false, 60, 99.0, 990.0);
	char *v = verdict_of(r, 3, NULL);
	cr_assert(strstr(v, "p50 100.0 ms vs 110.0 ms (1.10x faster)"), "%s", v);
	cr_assert(
	    strstr(v, "p99 1000.0 ms vs 1010.0 ms (about the same: 1.010x faster, within 3 %)"),
	    "%s", v);
	cr_assert(
	    strstr(v, "p99 1000.0 ms vs 990.0 ms (about the same: 1.010x slower, within 3 %)"),
	    "%s", v);
	cr_assert(strstr(v, "p50 100.0 ms vs 99.0 ms (about the same: 1.010x slower"), "%s", v);
	free(v);
}

/* The last line states what was measured (points and ratio) and names a cause only from the
 * reuse ceiling: far above the best policy, capacity or placement; near it, the traffic;
 * unknown, none.  Before, under 50 % and 5 points it blamed the traffic ("shares few
 * prefixes") whatever the ceiling. */
Test(replay, verdict_names_a_cause_only_from_the_ceiling)
{
	struct replay_result r[3];
	fake(&r[0], "approx_lru", true, 98, 1, 1);
	fake(&r[1], "round_robin", false, 52, 1, 1);
	fake(&r[2], "events", true, 101, 1, 1);
	r[2].evicted_blocks = 77;
	struct replay_ceiling hi = {.prompt_tokens = 1000, .hit_tokens = 400};
	struct replay_ceiling lo = {.prompt_tokens = 1000, .hit_tokens = 110};
	char *v = verdict_of(r, 3, &hi);
	cr_assert(strstr(v, "cache-aware routing buys little here: approx_lru 9.8 % vs round_robin "
	                    "5.2 % (the best cache-blind policy): +4.6 points, 1.88x"),
	          "%s", v);
	cr_assert(strstr(v, "an unbounded cache would serve 40.0 % (the trace's reuse ceiling), "
	                    "the best policy (events) 10.1 %: 25 % of the ceiling, so the "
	                    "shortfall is capacity or placement (77 blocks evicted under events"),
	          "%s", v);
	cr_assert_null(strstr(v, "few prefixes"), "%s", v);
	free(v);
	v = verdict_of(r, 3, &lo);
	cr_assert(strstr(v, "92 % of the ceiling, so what limits the share is the traffic's reuse"),
	          "%s", v);
	free(v);
	v = verdict_of(r, 3, NULL);
	cr_assert(strstr(v, "the trace's reuse ceiling was not measured, so no cause is named"),
	          "%s", v);
	cr_assert_null(strstr(v, "capacity"), "%s", v);
	free(v);
	fake(&r[0], "approx_lru", true, 200, 1, 1);
	v = verdict_of(r, 3, &hi);
	cr_assert(strstr(v, "cache-aware routing pays off here: approx_lru 20.0 % vs round_robin "
	                    "5.2 %"),
	          "%s", v);
	free(v);
}

/* The reuse ceiling of the synthetic trace (turn k of a session repeats turn k - 1's prompt, and
 * each prompt is a whole number of blocks): every earlier turn's blocks hit, the first turn's
 * none; one rank that never evicts, one request at a time, serves exactly that.  With
 * max_model_len, the requests over it are refused before routing by the replay and left out of
 * the ceiling; without it the same requests are served. */
Test(replay, reuse_ceiling_and_max_model_len)
{
	struct trace t = {0};
	make_trace_x(&t, 3, 4, 100, true);
	struct replay_config c = base_cfg();
	c.n_ranks = 1;
	c.blocks_per_rank = 100000;
	c.serial = true;
	struct replay_ceiling ce;
	cr_assert_eq(replay_reuse_ceiling(&t, &c, &ce), 0);
	uint64_t want = 0; /* turn k: ids = 2 + k, prompt (2 + k) * 32 - 6 blocks */
	for (int k = 1; k < 4; k++)
		want += 3 * (uint64_t)((1 + k) * 32 - 6);
	cr_assert_eq(ce.n_requests, 12);
	cr_assert_eq(ce.hit_blocks, want, "%llu", (unsigned long long)ce.hit_blocks);
	cr_assert_eq(ce.hit_tokens, want * 16);
	struct replay_result r;
	run(&t, &replay_policy_round_robin, &c, &r);
	cr_assert_eq(r.n_refused, 0);
	cr_assert_eq(r.hit_tokens, ce.hit_tokens, "%llu vs %llu", (unsigned long long)r.hit_tokens,
	             (unsigned long long)ce.hit_tokens);
	cr_assert_eq(r.prompt_tokens, ce.prompt_tokens);
	replay_result_free(&r);
	/* Turns 2 and 3 (4 and 5 ids: 2,048 - 96 and 2,560 - 96 prompt tokens, + 17 output) are
	 * over 1,900 tokens, turn 1 (1,440 + 17) is not. */
	c.max_model_len = 1900;
	run(&t, &replay_policy_round_robin, &c, &r);
	cr_assert_eq(r.n_refused, 6);
	cr_assert_eq(r.n_refused_len, 6);
	cr_assert_eq(r.n_ttft, 6);
	cr_assert_eq(replay_reuse_ceiling(&t, &c, &ce), 0);
	cr_assert_eq(ce.n_requests, 6);
	cr_assert_eq(ce.hit_blocks, 3 * (uint64_t)(2 * 32 - 6));
	cr_assert_eq(r.hit_tokens, ce.hit_tokens);
	replay_result_free(&r);
	trace_free(&t);
}
