/*
 * tools/replay/report.c - see report.h.  JSON through jansson (keys in insertion order, reals
 * printed with 17 significant digits, so equal results give equal bytes); PNGs through the
 * gnuplot program (Debian gnuplot-nox), fed a script written beside the data files.
 */
#include "tools/replay/report.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int replay_json_write(json_t *root, const char *path, char *err, size_t errlen)
{
	int rc = json_dump_file(root, path,
	                        JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
	json_decref(root);
	if (rc) {
		snprintf(err, errlen, "%s: cannot write", path);
		return -1;
	}
	return 0;
}

json_t *replay_json_text(const char *s)
{
	json_t *j = json_string(s);
	if (j)
		return j;
	size_t len = strlen(s), k = 0;
	char *buf = malloc(3 * len + 1); /* at most U+FFFD (3 bytes) a byte */
	if (!buf)
		return NULL;
	for (size_t i = 0; i < len;) {
		unsigned char c = (unsigned char)s[i];
		size_t n = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
		/* jansson judges the sequence (overlong forms, surrogates, past U+10FFFF) */
		json_t *one = n && i + n <= len ? json_stringn(s + i, n) : NULL;
		if (one) {
			json_decref(one);
			memcpy(buf + k, s + i, n);
			k += n;
			i += n;
		} else {
			memcpy(buf + k, "\xef\xbf\xbd", 3);
			k += 3;
			i++;
		}
	}
	j = json_stringn(buf, k);
	free(buf);
	return j;
}

int replay_io_error(const char *what, char *err, size_t errlen)
{
	snprintf(err, errlen, "%s: %s", what, strerror(errno));
	return -1;
}

int replay_plot_dir(const char *dir, char *err, size_t errlen)
{
	if (mkdir(dir, 0777) && errno != EEXIST)
		return replay_io_error(dir, err, errlen);
	return 0;
}

int replay_plot_run(const char *dir, const char *script, char *err, size_t errlen)
{
	char cmd[4200];
	snprintf(cmd, sizeof(cmd), "cd '%s' && gnuplot %s", dir, script);
	int rc = system(cmd);
	if (rc != 0) {
		snprintf(err, errlen, "gnuplot failed (exit %d); data and script are in %s", rc,
		         dir);
		return -1;
	}
	return 0;
}

static double share(uint64_t a, uint64_t b)
{
	return b ? (double)a / (double)b : 0.0;
}

void replay_report_table(FILE *f, const struct replay_result *res, size_t n)
{
	fprintf(f, "%-13s %7s %6s %7s %6s %6s %6s %9s %9s %9s %9s %9s %6s %8s %8s\n", "policy",
	        "hit%", "all%", "exact%", "MAE", "over%", "under%", "TTFTp50", "TTFTp99", "E2Ep50",
	        "E2Ep99", "tok/s", "imbal", "cpu_us", "jaccard");
	fprintf(f, "%-13s %7s %6s %7s %6s %6s %6s %9s %9s %9s %9s %9s %6s %8s %8s\n", "", "blocks",
	        "blocks", "", "blocks", "", "", "ms", "ms", "ms", "ms", "virtual", "busy", "/route",
	        "mean");
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		char exact[16] = "-", mae[16] = "-", over[16] = "-", under[16] = "-", jac[16] = "-";
		if (r->predicts && r->n_pred) {
			snprintf(exact, sizeof(exact), "%.1f", 100 * share(r->n_exact, r->n_pred));
			snprintf(mae, sizeof(mae), "%.2f", r->mae_blocks);
			snprintf(over, sizeof(over), "%.1f", 100 * share(r->n_over, r->n_pred));
			snprintf(under, sizeof(under), "%.1f", 100 * share(r->n_under, r->n_pred));
		}
		if (r->agree_samples)
			snprintf(jac, sizeof(jac), "%.3f", r->jaccard_mean);
		fprintf(f,
		        "%-13s %7.2f %6.2f %7s %6s %6s %6s %9.1f %9.1f %9.1f %9.1f %9.0f %6.2f "
		        "%8.2f %8s\n",
		        r->policy, 100 * r->own_hit_rate, 100 * r->hit_rate, exact, mae, over,
		        under, r->ttft_p50_ms, r->ttft_p99_ms, r->e2e_p50_ms, r->e2e_p99_ms,
		        r->throughput_tok_s, r->imbalance_busy, r->route_cpu_ns_mean / 1e3, jac);
	}
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		if (r->has_cpu) {
			double total = r->route_cpu_ns_mean + r->happen_cpu_ns_mean +
			               r->threads_busy_ns_mean + r->threads_spin_ns_mean;
			fprintf(
			    f,
			    "cpu %s: per decision, us: route %.1f (kvr_hash_blocks on the same "
			    "prompt alone: %.1f), lifecycle calls %.1f (%.1f calls), shard threads "
			    "%.1f busy + "
			    "%.1f idle polling; all router threads %.1f\n",
			    r->policy, r->route_cpu_ns_mean / 1e3, r->hash_cpu_ns_mean / 1e3,
			    r->happen_cpu_ns_mean / 1e3, r->happenings_mean,
			    r->threads_busy_ns_mean / 1e3, r->threads_spin_ns_mean / 1e3,
			    total / 1e3);
			fprintf(
			    f,
			    "cpu %s: kvr_route's stages, wall us (1 decision in 16): hash %.1f, "
			    "lookup %.1f, select %.1f, admit %.1f\n",
			    r->policy, r->stage_ns_mean[0] / 1e3, r->stage_ns_mean[1] / 1e3,
			    r->stage_ns_mean[2] / 1e3, r->stage_ns_mean[3] / 1e3);
			if (r->kept_share > 0)
				fprintf(
				    f,
				    "cpu %s: the frontend's chain, inside route: checking the "
				    "prompt against the session's previous one %.1f us, hashing "
				    "what it adds %.1f us; %.1f %% of the blocks reused\n",
				    r->policy, r->verify_ns_mean / 1e3, r->suffix_ns_mean / 1e3,
				    100 * r->kept_share);
		}
		if (r->path_runs_n)
			fprintf(
			    f,
			    "lookup path %s: runs the prompt's walk crosses (before each decision, "
			    "--path-runs): mean %.1f, max %lu over %lu decisions\n",
			    r->policy, r->path_runs_mean, (unsigned long)r->path_runs_max,
			    (unsigned long)r->path_runs_n);
		if (r->n_refused || r->policy_errors) {
			char why[96] = "too large for a rank";
			if (r->n_refused_len)
				snprintf(why, sizeof(why),
				         "%zu over --max-model-len, %zu too large for a rank",
				         r->n_refused_len, r->n_refused - r->n_refused_len);
			fprintf(
			    f,
			    "note: %s: %zu requests refused (%s; %zu of them after routing), %llu "
			    "policy errors (first: %d)\n",
			    r->policy, r->n_refused, why, r->n_refused_routed,
			    (unsigned long long)r->policy_errors, r->first_policy_error);
		}
		if (r->n_foreign && r->predicts)
			fprintf(
			    f,
			    "reach %s: at routing, this router's requests found %.2f %% of their "
			    "prompt blocks cached on the rank chosen, %.2f %% on the best rank\n",
			    r->policy,
			    100 * share(r->reach_chosen_blocks, r->share_prompt_blocks[0]),
			    100 * share(r->reach_best_blocks, r->share_prompt_blocks[0]));
		if (r->agree_samples)
			fprintf(
			    f,
			    "agreement %s: %llu samples (rank x time), Jaccard mean %.3f min "
			    "%.3f, %llu exact, %llu with every cached block predicted; mean "
			    "cached blocks per rank sim %.1f vs "
			    "predicted %.1f, both %.1f (cached, not predicted: %.1f; predicted, "
			    "not cached: %.1f)\n",
			    r->policy, (unsigned long long)r->agree_samples, r->jaccard_mean,
			    r->jaccard_min, (unsigned long long)r->agree_exact,
			    (unsigned long long)r->agree_subset,
			    share(r->sim_cached_sum, r->agree_samples),
			    share(r->pred_resident_sum, r->agree_samples),
			    share(r->agree_inter_sum, r->agree_samples),
			    share(r->sim_cached_sum - r->agree_inter_sum, r->agree_samples),
			    share(r->pred_resident_sum - r->agree_inter_sum, r->agree_samples));
	}
}

static json_t *result_json(const struct replay_result *r, bool timing)
{
	json_t *o = json_object();
	json_object_set_new(o, "policy", json_string(r->policy));
	json_object_set_new(o, "requests", json_integer((json_int_t)r->n_requests));
	json_object_set_new(o, "refused", json_integer((json_int_t)r->n_refused));
	/* Of refused, those the policy under test had routed (its prediction diverges after one):
	 * the table's note said it, the JSON did not. */
	json_object_set_new(o, "refused_after_routing",
	                    json_integer((json_int_t)r->n_refused_routed));
	json_object_set_new(o, "refused_over_max_model_len",
	                    json_integer((json_int_t)r->n_refused_len));
	json_object_set_new(o, "policy_errors", json_integer((json_int_t)r->policy_errors));
	json_object_set_new(o, "prompt_blocks", json_integer((json_int_t)r->prompt_blocks));
	json_object_set_new(o, "hit_blocks", json_integer((json_int_t)r->hit_blocks));
	json_object_set_new(o, "hit_rate", json_real(r->hit_rate));
	json_object_set_new(o, "own_hit_rate", json_real(r->own_hit_rate));
	json_object_set_new(o, "foreign_requests", json_integer((json_int_t)r->n_foreign));
	json_object_set_new(o, "reach_chosen_blocks",
	                    json_integer((json_int_t)r->reach_chosen_blocks));
	json_object_set_new(o, "reach_best_blocks", json_integer((json_int_t)r->reach_best_blocks));
	json_object_set_new(o, "prompt_tokens", json_integer((json_int_t)r->prompt_tokens));
	json_object_set_new(o, "cached_tokens", json_integer((json_int_t)r->hit_tokens));
	json_object_set_new(o, "cached_token_share",
	                    json_real(share(r->hit_tokens, r->prompt_tokens)));
	json_object_set_new(o, "queued", json_integer((json_int_t)r->n_queued));
	if (r->predicts) {
		json_t *p = json_object();
		json_object_set_new(p, "requests", json_integer((json_int_t)r->n_pred));
		json_object_set_new(p, "exact_share", json_real(share(r->n_exact, r->n_pred)));
		json_object_set_new(p, "mae_blocks", json_real(r->mae_blocks));
		json_object_set_new(p, "over_share", json_real(share(r->n_over, r->n_pred)));
		json_object_set_new(p, "under_share", json_real(share(r->n_under, r->n_pred)));
		/* Over this router's requests, which alone it predicts: over every arrival's
		 * blocks (prompt_blocks), a foreign share of 0.5 halved it. */
		json_object_set_new(
		    p, "predicted_hit_rate",
		    json_real(share(r->predicted_blocks, r->share_prompt_blocks[0])));
		json_object_set_new(o, "prediction", p);
	}
	json_object_set_new(o, "ttft_p50_ms", json_real(r->ttft_p50_ms));
	json_object_set_new(o, "ttft_p99_ms", json_real(r->ttft_p99_ms));
	json_object_set_new(o, "e2e_p50_ms", json_real(r->e2e_p50_ms));
	json_object_set_new(o, "e2e_p99_ms", json_real(r->e2e_p99_ms));
	json_object_set_new(o, "throughput_tok_s", json_real(r->throughput_tok_s));
	json_object_set_new(o, "makespan_s", json_real(r->makespan_s));
	json_object_set_new(o, "imbalance_busy", json_real(r->imbalance_busy));
	json_object_set_new(o, "imbalance_tokens", json_real(r->imbalance_tokens));
	json_object_set_new(o, "preemptions", json_integer((json_int_t)r->preemptions));
	json_object_set_new(o, "evicted_blocks", json_integer((json_int_t)r->evicted_blocks));
	if (r->agree_samples) {
		json_t *a = json_object();
		json_object_set_new(a, "samples", json_integer((json_int_t)r->agree_samples));
		json_object_set_new(a, "exact", json_integer((json_int_t)r->agree_exact));
		json_object_set_new(a, "sim_inside_predicted",
		                    json_integer((json_int_t)r->agree_subset));
		json_object_set_new(a, "jaccard_mean", json_real(r->jaccard_mean));
		json_object_set_new(a, "jaccard_min", json_real(r->jaccard_min));
		json_object_set_new(a, "sim_cached_mean",
		                    json_real(share(r->sim_cached_sum, r->agree_samples)));
		json_object_set_new(a, "predicted_resident_mean",
		                    json_real(share(r->pred_resident_sum, r->agree_samples)));
		json_object_set_new(o, "agreement", a);
	}
	json_t *hr = json_array();
	for (uint32_t b = 0; b < r->n_buckets; b++)
		json_array_append_new(hr, json_real(share(r->bucket_hit[b], r->bucket_prompt[b])));
	json_object_set_new(o, "hit_rate_bucket_s", json_real(r->bucket_s));
	json_object_set_new(o, "hit_rate_over_time", hr);
	if (timing) {
		json_object_set_new(o, "route_cpu_ns_mean", json_real(r->route_cpu_ns_mean));
		json_object_set_new(o, "route_cpu_ns_p99", json_real(r->route_cpu_ns_p99));
		json_object_set_new(o, "hash_cpu_ns_mean", json_real(r->hash_cpu_ns_mean));
		if (r->has_cpu) {
			json_object_set_new(o, "happenings_cpu_ns_mean",
			                    json_real(r->happen_cpu_ns_mean));
			json_object_set_new(o, "shard_busy_cpu_ns_mean",
			                    json_real(r->threads_busy_ns_mean));
			json_object_set_new(o, "shard_spin_cpu_ns_mean",
			                    json_real(r->threads_spin_ns_mean));
			json_t *st = json_object();
			static const char *const names[4] = {"hash", "lookup", "select", "admit"};
			for (int k = 0; k < 4; k++)
				json_object_set_new(st, names[k], json_real(r->stage_ns_mean[k]));
			json_object_set_new(o, "route_stage_wall_ns_mean", st);
			if (r->kept_share > 0) {
				json_object_set_new(o, "chain_verify_cpu_ns_mean",
				                    json_real(r->verify_ns_mean));
				json_object_set_new(o, "chain_suffix_cpu_ns_mean",
				                    json_real(r->suffix_ns_mean));
				json_object_set_new(o, "chain_kept_share",
				                    json_real(r->kept_share));
			}
		}
		json_object_set_new(o, "wall_s", json_real(r->wall_s));
	}
	return o;
}

int replay_report_json(const char *path, const struct replay_meta *meta,
                       const struct replay_result *res, size_t n, bool timing, char *err,
                       size_t errlen)
{
	json_t *root = json_object();
	json_t *tr = json_array();
	for (size_t i = 0; i < meta->n_traces; i++)
		json_array_append_new(tr, replay_json_text(meta->traces[i]));
	json_object_set_new(root, "traces", tr);
	json_object_set_new(root, "requests", json_integer((json_int_t)meta->n_requests));
	json_object_set_new(root, "skipped_bad", json_integer((json_int_t)meta->n_bad));
	json_object_set_new(root, "trace_block_size", json_integer(meta->trace_block_size));
	const struct replay_config *c = meta->cfg;
	json_t *cfg = json_object();
	json_object_set_new(cfg, "ranks", json_integer(c->n_ranks));
	json_object_set_new(cfg, "block_size", json_integer(c->block_size));
	json_object_set_new(cfg, "blocks_per_rank", json_integer(c->blocks_per_rank));
	if (meta->blocks_why)
		json_object_set_new(cfg, "blocks_per_rank_why", replay_json_text(meta->blocks_why));
	json_object_set_new(cfg, "max_batched_tokens", json_integer(c->max_batched_tokens));
	json_object_set_new(cfg, "step_base_ns", json_real(c->step_base_ns));
	json_object_set_new(cfg, "step_per_token_ns", json_real(c->step_per_token_ns));
	json_object_set_new(cfg, "step_per_kv_block_ns", json_real(c->step_per_kv_block_ns));
	json_object_set_new(cfg, "time_scale", json_real(c->time_scale));
	json_object_set_new(cfg, "seed", json_integer((json_int_t)c->seed));
	json_object_set_new(cfg, "sample_every", json_integer(c->sample_every));
	json_object_set_new(cfg, "output_every", json_integer(c->output_every));
	json_object_set_new(cfg, "capacity_factor", json_real(c->capacity_factor));
	json_object_set_new(cfg, "free_order",
	                    json_string(c->free_tail_first ? "tail-first" : "fresh-first"));
	json_object_set_new(cfg, "max_model_len", json_integer(c->max_model_len));
	const struct {
		const char *k;
		double v;
	} knobs[] = {{"overlap_credit", c->overlap_credit},
	             {"prefill_load_scale", c->prefill_load_scale},
	             {"temperature", c->temperature},
	             {"ttl_s", c->ttl_s},
	             {"queue_threshold", c->queue_threshold}};
	for (size_t i = 0; i < sizeof(knobs) / sizeof(knobs[0]); i++)
		if (!isnan(knobs[i].v)) /* else the router's default */
			json_object_set_new(cfg, knobs[i].k, json_real(knobs[i].v));
	json_object_set_new(root, "config", cfg);
	if (meta->ceiling) { /* replay_reuse_ceiling: what an unbounded cache would serve */
		const struct replay_ceiling *ce = meta->ceiling;
		json_t *rc = json_object();
		json_object_set_new(rc, "requests", json_integer((json_int_t)ce->n_requests));
		json_object_set_new(rc, "prompt_tokens",
		                    json_integer((json_int_t)ce->prompt_tokens));
		json_object_set_new(rc, "cached_tokens", json_integer((json_int_t)ce->hit_tokens));
		json_object_set_new(rc, "cached_token_share",
		                    json_real(share(ce->hit_tokens, ce->prompt_tokens)));
		json_object_set_new(rc, "prompt_blocks",
		                    json_integer((json_int_t)ce->prompt_blocks));
		json_object_set_new(rc, "hit_blocks", json_integer((json_int_t)ce->hit_blocks));
		json_object_set_new(root, "reuse_ceiling", rc);
	}
	json_t *pol = json_array();
	for (size_t i = 0; i < n; i++)
		json_array_append_new(pol, result_json(&res[i], timing));
	json_object_set_new(root, "policies", pol);
	return replay_json_write(root, path, err, errlen);
}

int replay_report_csv(const char *path, const struct replay_result *res, size_t n, bool timing,
                      char *err, size_t errlen)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return replay_io_error(path, err, errlen);
	fprintf(f,
	        "policy,requests,refused,policy_errors,prompt_blocks,hit_blocks,hit_rate,"
	        "exact_share,mae_blocks,over_share,under_share,ttft_p50_ms,ttft_p99_ms,"
	        "e2e_p50_ms,e2e_p99_ms,throughput_tok_s,makespan_s,imbalance_busy,"
	        "imbalance_tokens,preemptions,jaccard_mean,own_hit_rate%s\n",
	        timing ? ",route_cpu_ns_mean,route_cpu_ns_p99,wall_s" : "");
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		fprintf(f, "%s,%zu,%zu,%llu,%llu,%llu,%.6f,", r->policy, r->n_requests,
		        r->n_refused, (unsigned long long)r->policy_errors,
		        (unsigned long long)r->prompt_blocks, (unsigned long long)r->hit_blocks,
		        r->hit_rate);
		if (r->predicts)
			fprintf(f, "%.6f,%.4f,%.6f,%.6f,", share(r->n_exact, r->n_pred),
			        r->mae_blocks, share(r->n_over, r->n_pred),
			        share(r->n_under, r->n_pred));
		else
			fprintf(f, ",,,,");
		fprintf(f, "%.3f,%.3f,%.3f,%.3f,%.1f,%.3f,%.4f,%.4f,%llu,", r->ttft_p50_ms,
		        r->ttft_p99_ms, r->e2e_p50_ms, r->e2e_p99_ms, r->throughput_tok_s,
		        r->makespan_s, r->imbalance_busy, r->imbalance_tokens,
		        (unsigned long long)r->preemptions);
		if (r->agree_samples)
			fprintf(f, "%.6f", r->jaccard_mean);
		fprintf(f, ",%.6f", r->own_hit_rate);
		if (timing)
			fprintf(f, ",%.1f,%.1f,%.3f", r->route_cpu_ns_mean, r->route_cpu_ns_p99,
			        r->wall_s);
		fprintf(f, "\n");
	}
	return fclose(f) ? replay_io_error(path, err, errlen) : 0;
}

/* Index of the policy named name in res, or -1. */
static int find_policy(const struct replay_result *res, size_t n, const char *name)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(res[i].policy, name))
			return (int)i;
	return -1;
}

/* "2.35x faster" / "1.10x slower" (lower is better), or within REPLAY_SAME_WITHIN of each
 * other "about the same: 1.012x faster, within 3 %": the ratio stays visible (to 3 decimals, so
 * that 1.025 does not read 1.03 "within 3 %"), its direction is not claimed.  approx_lru vs
 * least_loaded TTFT p99 on the Mooncake sample (8 ranks x 25,600 blocks) read 1.01x faster at
 * seed 1 and 1.01x slower at seed 2: a difference under the spread between seeds (report.h) is
 * noise, not a result. */
static const char *compare(double base, double x, char *buf, size_t len)
{
	if (!(x > 0) || !(base > 0))
		snprintf(buf, len, "n/a");
	else if (base / x >= 1 + REPLAY_SAME_WITHIN)
		snprintf(buf, len, "%.2fx faster", base / x);
	else if (x / base >= 1 + REPLAY_SAME_WITHIN)
		snprintf(buf, len, "%.2fx slower", x / base);
	else
		snprintf(buf, len, "about the same: %.3fx %s, within %.0f %%",
		         base >= x ? base / x : x / base, base >= x ? "faster" : "slower",
		         100 * REPLAY_SAME_WITHIN);
	return buf;
}

void replay_report_verdict(FILE *f, const struct replay_result *res, size_t n, const char *label,
                           const struct replay_ceiling *ceil)
{
	if (!n)
		return;
	/* The router as deployed without events is approx_lru; else the first predicting policy. */
	int rt = find_policy(res, n, "approx_lru");
	for (size_t i = 0; rt < 0 && i < n; i++)
		if (res[i].predicts)
			rt = (int)i;
	int rr = find_policy(res, n, "round_robin"), ll = find_policy(res, n, "least_loaded");
	fprintf(f, "verdict [%s]: share of prompt tokens (not blocks) served from cache:", label);
	size_t order[64];
	size_t m = n < 64 ? n : 64;
	for (size_t i = 0; i < m; i++)
		order[i] = i;
	for (size_t i = 1; i < m; i++) /* by share, highest first (stable) */
		for (size_t j = i;
		     j > 0 &&
		     share(res[order[j]].hit_tokens, res[order[j]].prompt_tokens) >
		         share(res[order[j - 1]].hit_tokens, res[order[j - 1]].prompt_tokens);
		     j--) {
			size_t t = order[j];
			order[j] = order[j - 1];
			order[j - 1] = t;
		}
	for (size_t i = 0; i < m; i++)
		fprintf(f, "%s %s %.1f %%", i ? "," : "", res[order[i]].policy,
		        100 * share(res[order[i]].hit_tokens, res[order[i]].prompt_tokens));
	fprintf(f, "\n");
	if (rt < 0)
		return;
	const struct replay_result *r = &res[rt];
	for (int b = 0; b < 2; b++) {
		int k = b ? ll : rr;
		if (k < 0)
			continue;
		const struct replay_result *o = &res[k];
		char c50[64], c99[64];
		fprintf(
		    f,
		    "verdict [%s]: TTFT with %s vs %s: p50 %.1f ms vs %.1f ms (%s), p99 %.1f ms "
		    "vs %.1f ms (%s)\n",
		    label, r->policy, o->policy, r->ttft_p50_ms, o->ttft_p50_ms,
		    compare(o->ttft_p50_ms, r->ttft_p50_ms, c50, sizeof(c50)), r->ttft_p99_ms,
		    o->ttft_p99_ms, compare(o->ttft_p99_ms, r->ttft_p99_ms, c99, sizeof(c99)));
	}
	if (r->n_pred) {
		fprintf(
		    f,
		    "verdict [%s]: %s predicted the cached prefix exactly for %.1f %% of requests "
		    "(mean error %.2f blocks; over %.1f %%, under %.1f %%)",
		    label, r->policy, 100 * share(r->n_exact, r->n_pred), r->mae_blocks,
		    100 * share(r->n_over, r->n_pred), 100 * share(r->n_under, r->n_pred));
		/* The share counts admitted requests: say what it leaves out. */
		if (r->n_refused > r->n_refused_routed + r->n_refused_len)
			fprintf(f,
			        "; %zu requests too large for a rank were refused before routing, "
			        "not counted",
			        r->n_refused - r->n_refused_routed - r->n_refused_len);
		if (r->n_refused_len)
			fprintf(f,
			        "; %zu requests over --max-model-len were refused before routing, "
			        "not counted",
			        r->n_refused_len);
		if (r->n_refused_routed)
			fprintf(f,
			        "; %zu refused by the engine after routing, not counted: their "
			        "blocks stayed in the prediction, which diverges from the engines' "
			        "from the first",
			        r->n_refused_routed);
		fprintf(f, "\n");
	}
	/* The plain-words line: what was measured (the router against the best cache-blind
	 * policy, in points and as a ratio) and, when the trace's reuse ceiling is known, whether
	 * the shortfall is the traffic's (the ceiling itself low) or the cluster's (the best
	 * policy far under the ceiling: blocks evicted, or cached on another rank).  A cause is
	 * named only from these measures. */
	double best_blind = -1;
	const char *blind = NULL;
	int best = 0;
	for (size_t i = 0; i < n; i++) {
		double x = share(res[i].hit_tokens, res[i].prompt_tokens);
		if (!res[i].predicts && x > best_blind) {
			best_blind = x;
			blind = res[i].policy;
		}
		if (x > share(res[best].hit_tokens, res[best].prompt_tokens))
			best = (int)i;
	}
	double mine = share(r->hit_tokens, r->prompt_tokens);
	if (!blind)
		return;
	double gain = 100 * (mine - best_blind);
	char ratio[48] = "";
	if (best_blind > 0)
		snprintf(ratio, sizeof(ratio), ", %.2fx", mine / best_blind);
	fprintf(f,
	        "verdict [%s]: cache-aware routing %s here: %s %.1f %% vs %s %.1f %% (the best "
	        "cache-blind policy): %+.1f points%s",
	        label, gain >= REPLAY_PAYS_OFF_POINTS ? "pays off" : "buys little", r->policy,
	        100 * mine, blind, 100 * best_blind, gain, ratio);
	const struct replay_result *b = &res[best];
	double top = share(b->hit_tokens, b->prompt_tokens);
	double c = ceil ? share(ceil->hit_tokens, ceil->prompt_tokens) : NAN;
	if (isnan(c)) {
		fprintf(f, "; the trace's reuse ceiling was not measured, so no cause is named\n");
		return;
	}
	fprintf(f,
	        "; an unbounded cache would serve %.1f %% (the trace's reuse ceiling), the best "
	        "policy (%s) %.1f %%",
	        100 * c, b->policy, 100 * top);
	if (c <= 0)
		fprintf(f,
		        ": no prompt repeats an earlier one's prefix, the traffic shares none\n");
	else if (top >= REPLAY_NEAR_CEILING * c)
		fprintf(f,
		        ": %.0f %% of the ceiling, so what limits the share is the traffic's "
		        "reuse, not capacity\n",
		        100 * top / c);
	else
		fprintf(f,
		        ": %.0f %% of the ceiling, so the shortfall is capacity or placement "
		        "(%llu blocks evicted under %s; or a prefix cached on another rank), not "
		        "the traffic\n",
		        100 * top / c, (unsigned long long)b->evicted_blocks, b->policy);
}

/* Opens dir/name for writing, its path left in p (what the error message names). */
static FILE *plot_file(char *p, size_t cap, const char *dir, const char *name)
{
	snprintf(p, cap, "%s/%s", dir, name);
	return fopen(p, "w");
}

/* The plot command's lines for dat, one per policy (its gnuplot index i): events first and
 * wide, as approx_lru often lies exactly on it. */
static void plot_policies(FILE *f, const char *dat, const struct replay_result *res, size_t n)
{
	for (size_t i = 0; i < n; i++)
		fprintf(f, "%s'%s' index %zu using 1:2 with lines lw %d title '%s'", i ? ", " : "",
		        dat, i, i == 0 && n > 1 ? 5 : 2, res[i].policy);
}

int replay_report_plot(const char *dir, const struct replay_result *res, size_t n,
                       const char *title, char *err, size_t errlen)
{
	char p[4096];
	const char *tt = title ? title : "";
	const char *sep = title ? ": " : "";
	if (replay_plot_dir(dir, err, errlen))
		return -1;
	/* hit_rate.dat: per policy (gnuplot index), the hit rate of the last W first admissions'
	 * prompt blocks, at each admission time (sampled to ~400 points). */
	FILE *f = plot_file(p, sizeof(p), dir, "hit_rate.dat");
	if (!f)
		goto ioerr;
	size_t w = 0;
	for (size_t i = 0; i < n; i++)
		w = res[i].n_adm > w ? res[i].n_adm : w;
	w = w / 20 < 25 ? 25 : w / 20;
	/* Log time axis when half the requests come in the first tenth of the span (coding
	 * sessions that resume hours later), so the busy start is not squeezed to the left. */
	bool logx = false;
	if (n && res[0].n_adm > 1) {
		double med = res[0].adm_s[res[0].n_adm / 2], last = res[0].adm_s[res[0].n_adm - 1];
		logx = med > 0 && med < last / 10;
	}
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		fprintf(f, "# %s\n", r->policy);
		uint64_t sp = 0, sh = 0;
		size_t step = r->n_adm > 400 ? r->n_adm / 400 : 1;
		for (size_t k = 0; k < r->n_adm; k++) {
			sp += r->adm_prompt[k];
			sh += r->adm_hit[k];
			if (k >= w) {
				sp -= r->adm_prompt[k - w];
				sh -= r->adm_hit[k - w];
			}
			if (k + 1 >= (w < r->n_adm ? w : r->n_adm) &&
			    (k % step == 0 || k + 1 == r->n_adm))
				fprintf(f, "%.3f %.4f\n", r->adm_s[k],
				        sp ? 100.0 * (double)sh / (double)sp : 0);
		}
		fprintf(f, "\n\n");
	}
	fclose(f);
	/* ttft_cdf.dat: one block per policy (gnuplot index), at most ~1000 points each. */
	f = plot_file(p, sizeof(p), dir, "ttft_cdf.dat");
	if (!f)
		goto ioerr;
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		fprintf(f, "# %s\n", r->policy);
		size_t step = r->n_ttft > 1000 ? r->n_ttft / 1000 : 1;
		for (size_t k = 0; k < r->n_ttft; k += step)
			fprintf(f, "%.4f %.5f\n", r->ttft_ms[k] / 1e3,
			        (double)(k + 1) / (double)r->n_ttft);
		if (r->n_ttft)
			fprintf(f, "%.4f 1\n", r->ttft_ms[r->n_ttft - 1] / 1e3);
		fprintf(f, "\n\n");
	}
	fclose(f);
	/* summary.dat: policy, cached token share %, block hit rate %, TTFT p50 s, TTFT p99 s. */
	f = plot_file(p, sizeof(p), dir, "summary.dat");
	if (!f)
		goto ioerr;
	fprintf(f, "# policy cached_token_pct hit_block_pct ttft_p50_s ttft_p99_s\n");
	for (size_t i = 0; i < n; i++)
		fprintf(f, "%s %.3f %.3f %.4f %.4f\n", res[i].policy,
		        100 * share(res[i].hit_tokens, res[i].prompt_tokens), 100 * res[i].hit_rate,
		        res[i].ttft_p50_ms / 1e3, res[i].ttft_p99_ms / 1e3);
	fclose(f);
	f = plot_file(p, sizeof(p), dir, "plots.gp");
	if (!f)
		goto ioerr;
	fprintf(f,
	        "set terminal pngcairo size 1100,600 noenhanced font ',11'\n"
	        "set datafile missing 'NaN'\n"
	        "set key outside right top\nset grid\n"
	        "set output 'hit_rate.png'\n"
	        "set title '%s%sprefix-cache hit rate over time (moving average over the last %zu "
	        "requests)'\n"
	        "set xlabel 'virtual time (s%s)'\n%s\n"
	        "set ylabel 'prompt blocks served from cache (%%)'\nset yrange [0:*]\n"
	        "plot ",
	        tt, sep, w, logx ? ", log scale" : "",
	        logx ? "set logscale x" : "unset logscale x");
	plot_policies(f, "hit_rate.dat", res, n);
	fprintf(
	    f,
	    "\nset output 'ttft_cdf.png'\nset xrange [*:*]\n"
	    "set title '%s%sTTFT distribution'\nset logscale x\nset xlabel 'TTFT (s, log scale)'\n"
	    "set ylabel 'fraction of requests'\nset yrange [0:1]\n"
	    "plot ",
	    tt, sep);
	plot_policies(f, "ttft_cdf.dat", res, n);
	/* Grouped bars: left, cached share per policy; right, TTFT p50 and p99 per policy. */
	fprintf(
	    f,
	    "\nunset logscale\nset terminal pngcairo size 1300,560 noenhanced font ',11'\n"
	    "set output 'summary.png'\n"
	    "set multiplot layout 1,2 title '%s%sper routing policy, same arrivals' font ',13'\n"
	    "set style data histograms\nset style histogram clustered gap 1\n"
	    "set style fill solid 0.85 border -1\nset boxwidth 0.9\nset xtics rotate by -30\n"
	    "set grid ytics\nunset grid\nset grid ytics\n"
	    "set key outside top center horizontal\n"
	    "set title 'share of prompt served from cache'\nset xlabel ''\n"
	    "set ylabel 'percent'\nset yrange [0:105]\n"
	    "plot 'summary.dat' using 2:xtic(1) title 'prompt tokens (%%)' lc rgb '#1f77b4', "
	    "'' using 3 title 'full prompt blocks (%%)' lc rgb '#aec7e8', "
	    "'' using 0:($2+4):(sprintf('%%.1f',$2)) with labels offset -1.2,0 notitle\n"
	    "set title 'time to first token'\nset ylabel 'seconds (log scale)'\n"
	    "set logscale y\nset yrange [*:*]\n"
	    "plot 'summary.dat' using 4:xtic(1) title 'p50' lc rgb '#2ca02c', "
	    "'' using 5 title 'p99' lc rgb '#d62728'\n"
	    "unset multiplot\n",
	    tt, sep);
	fclose(f);
	return replay_plot_run(dir, "plots.gp", err, errlen);
ioerr:
	return replay_io_error(p, err, errlen);
}
