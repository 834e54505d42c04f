/*
 * tools/replay/report.c - see report.h.  JSON through jansson (keys in insertion order, reals
 * printed with 17 significant digits, so equal results give equal bytes); PNGs through the
 * gnuplot program (Debian gnuplot-nox), fed a script written beside the data files.
 */
#include "tools/replay/report.h"

#include <errno.h>
#include <jansson.h>
#include <string.h>
#include <sys/stat.h>

static double share(uint64_t a, uint64_t b)
{
	return b ? (double)a / (double)b : 0.0;
}

void replay_report_table(FILE *f, const struct replay_result *res, size_t n)
{
	fprintf(f, "%-13s %7s %7s %6s %6s %6s %9s %9s %9s %9s %9s %6s %8s %8s\n", "policy", "hit%",
	        "exact%", "MAE", "over%", "under%", "TTFTp50", "TTFTp99", "E2Ep50", "E2Ep99",
	        "tok/s", "imbal", "cpu_us", "jaccard");
	fprintf(f, "%-13s %7s %7s %6s %6s %6s %9s %9s %9s %9s %9s %6s %8s %8s\n", "", "", "",
	        "blocks", "", "", "ms", "ms", "ms", "ms", "virtual", "busy", "/route", "mean");
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
		        "%-13s %7.2f %7s %6s %6s %6s %9.1f %9.1f %9.1f %9.1f %9.0f %6.2f %8.2f "
		        "%8s\n",
		        r->policy, 100 * r->hit_rate, exact, mae, over, under, r->ttft_p50_ms,
		        r->ttft_p99_ms, r->e2e_p50_ms, r->e2e_p99_ms, r->throughput_tok_s,
		        r->imbalance_busy, r->route_cpu_ns_mean / 1e3, jac);
	}
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		if (r->n_refused || r->policy_errors)
			fprintf(f,
			        "note: %s: %zu requests refused by the simulator, %llu policy "
			        "errors (first: %d)\n",
			        r->policy, r->n_refused, (unsigned long long)r->policy_errors,
			        r->first_policy_error);
		if (r->agree_samples)
			fprintf(f,
			        "agreement %s: %llu samples (rank x time), Jaccard mean %.3f min "
			        "%.3f, %llu exact, %llu with every cached block predicted; mean "
			        "cached blocks per rank sim %.1f vs "
			        "predicted %.1f\n",
			        r->policy, (unsigned long long)r->agree_samples, r->jaccard_mean,
			        r->jaccard_min, (unsigned long long)r->agree_exact,
			        (unsigned long long)r->agree_subset,
			        share(r->sim_cached_sum, r->agree_samples),
			        share(r->pred_resident_sum, r->agree_samples));
	}
}

static json_t *result_json(const struct replay_result *r, bool timing)
{
	json_t *o = json_object();
	json_object_set_new(o, "policy", json_string(r->policy));
	json_object_set_new(o, "requests", json_integer((json_int_t)r->n_requests));
	json_object_set_new(o, "refused", json_integer((json_int_t)r->n_refused));
	json_object_set_new(o, "policy_errors", json_integer((json_int_t)r->policy_errors));
	json_object_set_new(o, "prompt_blocks", json_integer((json_int_t)r->prompt_blocks));
	json_object_set_new(o, "hit_blocks", json_integer((json_int_t)r->hit_blocks));
	json_object_set_new(o, "hit_rate", json_real(r->hit_rate));
	if (r->predicts) {
		json_t *p = json_object();
		json_object_set_new(p, "requests", json_integer((json_int_t)r->n_pred));
		json_object_set_new(p, "exact_share", json_real(share(r->n_exact, r->n_pred)));
		json_object_set_new(p, "mae_blocks", json_real(r->mae_blocks));
		json_object_set_new(p, "over_share", json_real(share(r->n_over, r->n_pred)));
		json_object_set_new(p, "under_share", json_real(share(r->n_under, r->n_pred)));
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
		json_array_append_new(tr, json_string(meta->traces[i]));
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
		json_object_set_new(cfg, "blocks_per_rank_why", json_string(meta->blocks_why));
	json_object_set_new(cfg, "max_batched_tokens", json_integer(c->max_batched_tokens));
	json_object_set_new(cfg, "step_base_ns", json_real(c->step_base_ns));
	json_object_set_new(cfg, "step_per_token_ns", json_real(c->step_per_token_ns));
	json_object_set_new(cfg, "time_scale", json_real(c->time_scale));
	json_object_set_new(cfg, "seed", json_integer((json_int_t)c->seed));
	json_object_set_new(cfg, "sample_every", json_integer(c->sample_every));
	json_object_set_new(cfg, "output_every", json_integer(c->output_every));
	json_object_set_new(root, "config", cfg);
	json_t *pol = json_array();
	for (size_t i = 0; i < n; i++)
		json_array_append_new(pol, result_json(&res[i], timing));
	json_object_set_new(root, "policies", pol);
	int rc = json_dump_file(root, path,
	                        JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
	json_decref(root);
	if (rc) {
		snprintf(err, errlen, "%s: cannot write", path);
		return -1;
	}
	return 0;
}

int replay_report_csv(const char *path, const struct replay_result *res, size_t n, bool timing,
                      char *err, size_t errlen)
{
	FILE *f = fopen(path, "w");
	if (!f) {
		snprintf(err, errlen, "%s: %s", path, strerror(errno));
		return -1;
	}
	fprintf(f,
	        "policy,requests,refused,policy_errors,prompt_blocks,hit_blocks,hit_rate,"
	        "exact_share,mae_blocks,over_share,under_share,ttft_p50_ms,ttft_p99_ms,"
	        "e2e_p50_ms,e2e_p99_ms,throughput_tok_s,makespan_s,imbalance_busy,"
	        "imbalance_tokens,preemptions,jaccard_mean%s\n",
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
		if (timing)
			fprintf(f, ",%.1f,%.1f,%.3f", r->route_cpu_ns_mean, r->route_cpu_ns_p99,
			        r->wall_s);
		fprintf(f, "\n");
	}
	if (fclose(f)) {
		snprintf(err, errlen, "%s: %s", path, strerror(errno));
		return -1;
	}
	return 0;
}

int replay_report_plot(const char *dir, const struct replay_result *res, size_t n, char *err,
                       size_t errlen)
{
	char p[4096];
	if (mkdir(dir, 0777) && errno != EEXIST) {
		snprintf(err, errlen, "%s: %s", dir, strerror(errno));
		return -1;
	}
	/* hit_rate.dat: time, then one column per policy (NaN where a bucket is empty). */
	snprintf(p, sizeof(p), "%s/hit_rate.dat", dir);
	FILE *f = fopen(p, "w");
	if (!f)
		goto ioerr;
	fprintf(f, "# t_s");
	for (size_t i = 0; i < n; i++)
		fprintf(f, " %s", res[i].policy);
	fprintf(f, "\n");
	uint32_t nb = n ? res[0].n_buckets : 0;
	for (uint32_t b = 0; b < nb; b++) {
		fprintf(f, "%.3f", (b + 0.5) * res[0].bucket_s);
		for (size_t i = 0; i < n; i++) {
			if (res[i].bucket_prompt[b])
				fprintf(f, " %.5f",
				        100 * share(res[i].bucket_hit[b], res[i].bucket_prompt[b]));
			else
				fprintf(f, " NaN");
		}
		fprintf(f, "\n");
	}
	fclose(f);
	/* ttft_cdf.dat: one block per policy (gnuplot index), at most ~1000 points each. */
	snprintf(p, sizeof(p), "%s/ttft_cdf.dat", dir);
	f = fopen(p, "w");
	if (!f)
		goto ioerr;
	for (size_t i = 0; i < n; i++) {
		const struct replay_result *r = &res[i];
		fprintf(f, "# %s\n", r->policy);
		size_t step = r->n_ttft > 1000 ? r->n_ttft / 1000 : 1;
		for (size_t k = 0; k < r->n_ttft; k += step)
			fprintf(f, "%.4f %.5f\n", r->ttft_ms[k],
			        (double)(k + 1) / (double)r->n_ttft);
		if (r->n_ttft)
			fprintf(f, "%.4f 1\n", r->ttft_ms[r->n_ttft - 1]);
		fprintf(f, "\n\n");
	}
	fclose(f);
	snprintf(p, sizeof(p), "%s/plots.gp", dir);
	f = fopen(p, "w");
	if (!f)
		goto ioerr;
	fprintf(f, "set terminal pngcairo size 1000,600 noenhanced\n"
	           "set datafile missing 'NaN'\n"
	           "set key outside right\nset grid\n"
	           "set output 'hit_rate.png'\n"
	           "set title 'Prefix-cache hit rate over time (prompt blocks served from cache)'\n"
	           "set xlabel 'virtual time (s)'\nset ylabel 'hit rate (%%)'\nset yrange [0:100]\n"
	           "plot ");
	for (size_t i = 0; i < n; i++)
		fprintf(f, "%s'hit_rate.dat' using 1:%zu with linespoints title '%s'",
		        i ? ", " : "", i + 2, res[i].policy);
	fprintf(f,
	        "\nset output 'ttft_cdf.png'\n"
	        "set title 'TTFT CDF'\nset logscale x\nset xlabel 'TTFT (ms, log)'\n"
	        "set ylabel 'fraction of requests'\nset yrange [0:1]\nset key bottom right inside\n"
	        "plot ");
	for (size_t i = 0; i < n; i++)
		fprintf(f, "%s'ttft_cdf.dat' index %zu using 1:2 with lines lw 2 title '%s'",
		        i ? ", " : "", i, res[i].policy);
	fprintf(f, "\n");
	fclose(f);
	char cmd[4200];
	snprintf(cmd, sizeof(cmd), "cd '%s' && gnuplot plots.gp", dir);
	int rc = system(cmd);
	if (rc != 0) {
		snprintf(err, errlen, "gnuplot failed (exit %d); data and script are in %s", rc,
		         dir);
		return -1;
	}
	return 0;
ioerr:
	snprintf(err, errlen, "%s: %s", p, strerror(errno));
	return -1;
}
