/*
 * tools/replay/sweep.c - see sweep.h.
 *
 * Parallel replays: a replay is a pure function of (trace, config, policy) apart from host
 * timings, so the grid is a bag of independent jobs.  Worker threads take the next cell index
 * from an atomic counter, run it, and bump a done counter; the calling thread only waits and
 * draws the progress bar (a condition variable wakes it after each cell), so the progress
 * callback never runs concurrently with itself.  Results land in their own cells: no sharing.
 */
#include "tools/replay/sweep.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "tools/replay/report.h"

static const struct {
	const char *name, *unit;
	double lo, hi; /* valid range, inclusive */
	bool lo_open;  /* lo itself excluded */
	bool integer;
} params[SWEEP_N_PARAMS] = {
    [SWEEP_BLOCKS] = {"blocks", "GPU KV blocks per rank", 1, 4294967295.0, false, true},
    [SWEEP_CAPACITY_FACTOR] = {"capacity_factor", "x the engine blocks", 0, 1e6, true, false},
    [SWEEP_OVERLAP_CREDIT] = {"overlap_credit", "", 0, 1e6, false, false},
    [SWEEP_TEMPERATURE] = {"temperature", "", 0, 1e6, false, false},
    [SWEEP_TTL] = {"ttl", "s", 0, 1e9, true, false},
    [SWEEP_QUEUE_THRESHOLD] = {"queue_threshold", "x max batched tokens", 0, 1e6, false, false},
    [SWEEP_TIME_SCALE] = {"time_scale", "x arrival times", 0, 1e6, true, false},
    [SWEEP_FOREIGN] = {"foreign_traffic", "share of arrivals", 0, 0.99, false, false},
    [SWEEP_PREFILL_LOAD_SCALE] = {"prefill_load_scale", "", 0, 1e6, false, false},
};

const char *sweep_param_name(enum sweep_param p)
{
	return p < SWEEP_N_PARAMS ? params[p].name : "?";
}

const char *sweep_param_unit(enum sweep_param p)
{
	return p < SWEEP_N_PARAMS ? params[p].unit : "";
}

static void known_names(char *buf, size_t len)
{
	size_t off = 0;
	buf[0] = 0;
	for (int i = 0; i < SWEEP_N_PARAMS && off < len; i++)
		off +=
		    (size_t)snprintf(buf + off, len - off, "%s%s", i ? ", " : "", params[i].name);
}

int sweep_parse(struct sweep *s, const char *arg, char *err, size_t errlen)
{
	char names[256];
	known_names(names, sizeof(names));
	const char *eq = strchr(arg, '=');
	if (!eq) {
		snprintf(err, errlen, "--sweep '%s': expected NAME=v1,v2,... (NAME one of %s)", arg,
		         names);
		return -1;
	}
	size_t nl = (size_t)(eq - arg);
	int p = -1;
	for (int i = 0; i < SWEEP_N_PARAMS; i++)
		if (strlen(params[i].name) == nl && !strncmp(arg, params[i].name, nl))
			p = i;
	if (p < 0) {
		snprintf(err, errlen, "--sweep: unknown parameter '%.*s' (known: %s)", (int)nl, arg,
		         names);
		return -1;
	}
	for (size_t a = 0; a < s->n_axes; a++) {
		if ((int)s->ax[a].param == p) {
			snprintf(err, errlen, "--sweep: %s given twice", params[p].name);
			return -1;
		}
	}
	if (s->n_axes == SWEEP_MAX_AXES) {
		snprintf(err, errlen, "--sweep: at most %d parameters", SWEEP_MAX_AXES);
		return -1;
	}
	struct sweep_axis ax = {.param = (enum sweep_param)p};
	const char *v = eq + 1;
	if (!*v) {
		snprintf(err, errlen, "--sweep %s: empty list of values", params[p].name);
		return -1;
	}
	for (;;) {
		const char *end = strchr(v, ',');
		size_t len = end ? (size_t)(end - v) : strlen(v);
		char tok[64];
		if (len == 0 || len >= sizeof(tok)) {
			snprintf(err, errlen, "--sweep %s: %s value in '%s'", params[p].name,
			         len ? "overlong" : "empty", eq + 1);
			return -1;
		}
		memcpy(tok, v, len);
		tok[len] = 0;
		char *stop;
		errno = 0;
		double x = strtod(tok, &stop);
		if (stop == tok || *stop || errno || !isfinite(x)) {
			snprintf(err, errlen, "--sweep %s: '%s' is not a number", params[p].name,
			         tok);
			return -1;
		}
		if (x < params[p].lo || (params[p].lo_open && x == params[p].lo) ||
		    x > params[p].hi || (params[p].integer && x != floor(x))) {
			snprintf(err, errlen,
			         "--sweep %s: %s is out of range (%s %.10g and <= %.10g%s)",
			         params[p].name, tok, params[p].lo_open ? ">" : ">=", params[p].lo,
			         params[p].hi, params[p].integer ? ", a whole number" : "");
			return -1;
		}
		if (ax.n == SWEEP_MAX_VALUES) {
			snprintf(err, errlen, "--sweep %s: at most %d values", params[p].name,
			         SWEEP_MAX_VALUES);
			return -1;
		}
		ax.v[ax.n++] = x;
		if (!end)
			break;
		v = end + 1;
	}
	s->ax[s->n_axes++] = ax;
	return 0;
}

size_t sweep_points(const struct sweep *s)
{
	size_t n = 1;
	for (size_t a = 0; a < s->n_axes; a++)
		n *= s->ax[a].n;
	return n;
}

void sweep_apply(const struct sweep *s, size_t point, struct replay_config *cfg, double *values)
{
	for (size_t a = s->n_axes; a-- > 0;) {
		const struct sweep_axis *ax = &s->ax[a];
		double x = ax->v[point % ax->n];
		point /= ax->n;
		if (values)
			values[a] = x;
		switch (ax->param) {
		case SWEEP_BLOCKS:
			cfg->blocks_per_rank = (uint32_t)x;
			break;
		case SWEEP_CAPACITY_FACTOR:
			cfg->capacity_factor = x;
			break;
		case SWEEP_OVERLAP_CREDIT:
			cfg->overlap_credit = x;
			break;
		case SWEEP_TEMPERATURE:
			cfg->temperature = x;
			break;
		case SWEEP_TTL:
			cfg->ttl_s = x;
			break;
		case SWEEP_QUEUE_THRESHOLD:
			cfg->queue_threshold = x;
			break;
		case SWEEP_TIME_SCALE:
			cfg->time_scale = x;
			break;
		case SWEEP_FOREIGN:
			cfg->foreign_share = x;
			break;
		case SWEEP_PREFILL_LOAD_SCALE:
			cfg->prefill_load_scale = x;
			break;
		default:
			break;
		}
	}
}

/* ---------------------------------------------------------------- running */

struct pool {
	const struct trace *t;
	struct sweep_cell *cells;
	size_t n;
	size_t next, done; /* under lock */
	pthread_mutex_t lock;
	pthread_cond_t cond;
};

static void run_cell(const struct trace *t, struct sweep_cell *c)
{
	c->rc = replay_run(t, c->ops, &c->cfg, &c->res, c->err, sizeof(c->err));
	if (c->rc == 0 && !c->keep) {
		/* Keep the scalars only: a big grid would hold every TTFT otherwise. */
		replay_result_free(&c->res);
	}
}

static void *worker(void *arg)
{
	struct pool *p = arg;
	pthread_mutex_lock(&p->lock);
	while (p->next < p->n) {
		size_t i = p->next++;
		pthread_mutex_unlock(&p->lock);
		run_cell(p->t, &p->cells[i]);
		pthread_mutex_lock(&p->lock);
		p->done++;
		pthread_cond_signal(&p->cond);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

int sweep_run(const struct sweep *s, const struct trace *t, const struct replay_config *base,
              const struct replay_policy_ops *const *ops, size_t n_ops, unsigned jobs,
              bool keep_series, void (*progress)(void *ctx, size_t done, size_t total), void *ctx,
              struct sweep_cell **cells_out)
{
	size_t np = sweep_points(s), n = np * n_ops;
	struct sweep_cell *cells = calloc(n ? n : 1, sizeof(*cells));
	if (!cells)
		return KVR_ENOMEM;
	for (size_t pt = 0; pt < np; pt++) {
		for (size_t k = 0; k < n_ops; k++) {
			struct sweep_cell *c = &cells[pt * n_ops + k];
			c->point = pt;
			c->ops = ops[k];
			c->cfg = *base;
			c->cfg.progress = NULL;
			c->cfg.progress_ctx = NULL;
			c->keep = keep_series;
			/* It kept sampling for "approx_lru" alone: --jobs 2 dropped the healing
			 * variants' agreement that --jobs 1 reports. */
			if (!replay_samples_agreement(ops[k], base))
				c->cfg.sample_every = 0;
			sweep_apply(s, pt, &c->cfg, c->v);
		}
	}
	struct pool p = {.t = t, .cells = cells, .n = n};
	pthread_mutex_init(&p.lock, NULL);
	pthread_cond_init(&p.cond, NULL);
	if (jobs < 1)
		jobs = 1;
	if (jobs > n)
		jobs = (unsigned)(n ? n : 1);
	pthread_t th[64];
	unsigned started = 0;
	for (unsigned j = 0; j < jobs && j < 64; j++)
		if (pthread_create(&th[j], NULL, worker, &p) == 0)
			started++;
	if (started == 0)
		worker(&p); /* no thread: run them here */
	pthread_mutex_lock(&p.lock);
	size_t shown = (size_t)-1;
	while (p.done < n) {
		if (progress && shown != p.done) {
			shown = p.done;
			pthread_mutex_unlock(&p.lock);
			progress(ctx, shown, n);
			pthread_mutex_lock(&p.lock);
			continue;
		}
		pthread_cond_wait(&p.cond, &p.lock);
	}
	pthread_mutex_unlock(&p.lock);
	for (unsigned j = 0; j < started; j++)
		pthread_join(th[j], NULL);
	if (progress)
		progress(ctx, n, n);
	pthread_mutex_destroy(&p.lock);
	pthread_cond_destroy(&p.cond);
	*cells_out = cells;
	return 0;
}

/* ---------------------------------------------------------------- outputs */

static double token_share(const struct replay_result *r)
{
	return r->prompt_tokens ? (double)r->hit_tokens / (double)r->prompt_tokens : 0;
}

static double exact_share(const struct replay_result *r)
{
	return r->n_pred ? (double)r->n_exact / (double)r->n_pred : NAN;
}

/* The router's own hit estimate: predicted overlap over the prompt blocks of the requests it
 * routed (what kvr_predicted_overlap_blocks_total / kvr_routed_blocks_total says in
 * production).  Over every arrival's blocks, as it was, foreign traffic scaled it down: at
 * foreign_traffic 0.5, half the hit rate of an exact prediction. */
static double pred_rate(const struct replay_result *r)
{
	const uint64_t own = r->share_prompt_blocks[0];
	return own ? (double)r->predicted_blocks / (double)own : NAN;
}

void sweep_report_table(FILE *f, const struct sweep *s, const struct sweep_cell *c, size_t n)
{
	for (size_t a = 0; a < s->n_axes; a++)
		fprintf(f, "%-16s ", params[s->ax[a].param].name);
	fprintf(f, "%-13s %7s %6s %7s %8s %7s %10s %10s %6s %7s\n", "policy", "blkhit%", "blkall%",
	        "pred%", "tokhit%", "exact%", "TTFTp50ms", "TTFTp99ms", "queued", "refused");
	for (size_t i = 0; i < n; i++) {
		for (size_t a = 0; a < s->n_axes; a++)
			fprintf(f, "%-16g ", c[i].v[a]);
		if (c[i].rc) {
			fprintf(f, "%-13s failed: %s\n", c[i].ops->name, c[i].err);
			continue;
		}
		const struct replay_result *r = &c[i].res;
		char ex[16] = "-", pr[16] = "-";
		if (r->predicts && r->n_pred) {
			snprintf(ex, sizeof(ex), "%.1f", 100 * exact_share(r));
			snprintf(pr, sizeof(pr), "%.2f", 100 * pred_rate(r));
		}
		fprintf(f, "%-13s %7.2f %6.2f %7s %8.2f %7s %10.1f %10.1f %6zu %7zu\n", r->policy,
		        100 * r->own_hit_rate, 100 * r->hit_rate, pr, 100 * token_share(r), ex,
		        r->ttft_p50_ms, r->ttft_p99_ms, r->n_queued, r->n_refused);
	}
}

int sweep_report_csv(const char *path, const struct sweep *s, const struct sweep_cell *c, size_t n,
                     char *err, size_t errlen)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return replay_io_error(path, err, errlen);
	for (size_t a = 0; a < s->n_axes; a++)
		fprintf(f, "%s,", params[s->ax[a].param].name);
	fprintf(f, "policy,status,blocks_per_rank,hit_rate,cached_token_share,exact_share,"
	           "mae_blocks,predicted_hit_rate,ttft_p50_ms,ttft_p99_ms,e2e_p50_ms,e2e_p99_ms,"
	           "throughput_tok_s,"
	           "preemptions,queued,refused,own_hit_rate\n");
	for (size_t i = 0; i < n; i++) {
		for (size_t a = 0; a < s->n_axes; a++)
			fprintf(f, "%g,", c[i].v[a]);
		const struct replay_result *r = &c[i].res;
		if (c[i].rc) {
			fprintf(f, "%s,error,%u,,,,,,,,,,,,,,\n", c[i].ops->name,
			        c[i].cfg.blocks_per_rank);
			continue;
		}
		fprintf(f, "%s,ok,%u,%.6f,%.6f,", r->policy, c[i].cfg.blocks_per_rank, r->hit_rate,
		        token_share(r));
		if (r->predicts && r->n_pred)
			fprintf(f, "%.6f,%.4f,%.6f,", exact_share(r), r->mae_blocks, pred_rate(r));
		else
			fprintf(f, ",,,");
		fprintf(f, "%.3f,%.3f,%.3f,%.3f,%.1f,%llu,%zu,%zu,%.6f\n", r->ttft_p50_ms,
		        r->ttft_p99_ms, r->e2e_p50_ms, r->e2e_p99_ms, r->throughput_tok_s,
		        (unsigned long long)r->preemptions, r->n_queued, r->n_refused,
		        r->own_hit_rate);
	}
	return fclose(f) ? replay_io_error(path, err, errlen) : 0;
}

int sweep_report_json(const char *path, const struct sweep *s, const struct sweep_cell *c, size_t n,
                      const char *trace_names, char *err, size_t errlen)
{
	json_t *root = json_object();
	json_object_set_new(root, "traces", replay_json_text(trace_names ? trace_names : ""));
	json_t *axes = json_array();
	for (size_t a = 0; a < s->n_axes; a++) {
		json_t *ax = json_object();
		json_object_set_new(ax, "name", json_string(params[s->ax[a].param].name));
		json_object_set_new(ax, "unit", json_string(params[s->ax[a].param].unit));
		json_t *vals = json_array();
		for (size_t k = 0; k < s->ax[a].n; k++)
			json_array_append_new(vals, json_real(s->ax[a].v[k]));
		json_object_set_new(ax, "values", vals);
		json_array_append_new(axes, ax);
	}
	json_object_set_new(root, "axes", axes);
	json_t *runs = json_array();
	for (size_t i = 0; i < n; i++) {
		json_t *o = json_object();
		json_t *at = json_object();
		for (size_t a = 0; a < s->n_axes; a++)
			json_object_set_new(at, params[s->ax[a].param].name, json_real(c[i].v[a]));
		json_object_set_new(o, "at", at);
		json_object_set_new(o, "policy", json_string(c[i].ops->name));
		json_object_set_new(o, "blocks_per_rank", json_integer(c[i].cfg.blocks_per_rank));
		if (c[i].rc) {
			json_object_set_new(o, "error", replay_json_text(c[i].err));
			json_array_append_new(runs, o);
			continue;
		}
		const struct replay_result *r = &c[i].res;
		json_object_set_new(o, "hit_rate", json_real(r->hit_rate));
		json_object_set_new(o, "own_hit_rate", json_real(r->own_hit_rate));
		json_object_set_new(o, "cached_token_share", json_real(token_share(r)));
		if (r->predicts && r->n_pred) {
			json_object_set_new(o, "exact_share", json_real(exact_share(r)));
			json_object_set_new(o, "mae_blocks", json_real(r->mae_blocks));
			json_object_set_new(o, "predicted_hit_rate", json_real(pred_rate(r)));
		}
		json_object_set_new(o, "ttft_p50_ms", json_real(r->ttft_p50_ms));
		json_object_set_new(o, "ttft_p99_ms", json_real(r->ttft_p99_ms));
		json_object_set_new(o, "e2e_p50_ms", json_real(r->e2e_p50_ms));
		json_object_set_new(o, "e2e_p99_ms", json_real(r->e2e_p99_ms));
		json_object_set_new(o, "throughput_tok_s", json_real(r->throughput_tok_s));
		json_object_set_new(o, "preemptions", json_integer((json_int_t)r->preemptions));
		json_object_set_new(o, "queued", json_integer((json_int_t)r->n_queued));
		json_object_set_new(o, "refused", json_integer((json_int_t)r->n_refused));
		json_object_set_new(o, "refused_after_routing",
		                    json_integer((json_int_t)r->n_refused_routed));
		json_array_append_new(runs, o);
	}
	json_object_set_new(root, "runs", runs);
	return replay_json_write(root, path, err, errlen);
}

int sweep_report_plot(const char *dir, const struct sweep *s, const struct sweep_cell *c, size_t n,
                      size_t n_ops, const char *title, char *err, size_t errlen)
{
	char p[4096];
	if (replay_plot_dir(dir, err, errlen))
		return -1;
	snprintf(p, sizeof(p), "%s/sweep.gp", dir);
	FILE *gp = fopen(p, "w");
	if (!gp)
		goto ioerr;
	fprintf(gp, "set datafile missing 'NaN'\nset grid\n");
	size_t np = sweep_points(s);
	for (size_t a = 0; a < s->n_axes; a++) {
		if (s->ax[a].n < 2)
			continue; /* one value: nothing to draw against */
		const struct sweep_axis *ax = &s->ax[a];
		const char *name = params[ax->param].name, *unit = params[ax->param].unit;
		/* Series: policy x combination of the other axes' values (points with the same
		 * other values share a series).  Block per series, rows in axis order. */
		snprintf(p, sizeof(p), "%s/sweep_%s.dat", dir, name);
		FILE *f = fopen(p, "w");
		if (!f) {
			fclose(gp);
			goto ioerr;
		}
		size_t others = np / ax->n, n_series = 0;
		char labels[256][96];
		/* Whether a later series lies exactly on the first (events and approx_lru often
		 * do): then the first is drawn wide, so that it still shows. */
		double first[SWEEP_MAX_VALUES], cur[SWEEP_MAX_VALUES];
		bool covered = false;
		double lo = INFINITY, hi = -INFINITY;
		for (size_t k = 0; k < ax->n; k++) {
			lo = fmin(lo, ax->v[k]);
			hi = fmax(hi, ax->v[k]);
		}
		for (size_t o = 0; o < others; o++) {
			for (size_t pol = 0; pol < n_ops; pol++) {
				char lab[96] = "";
				size_t off = 0;
				bool any = false;
				for (size_t k = 0; k < ax->n; k++)
					cur[k] = NAN;
				for (size_t k = 0; k < ax->n; k++) {
					/* point index with axis a = k and the others from o */
					size_t rest = o, pt = 0, mul = 1;
					for (size_t b = s->n_axes; b-- > 0;) {
						size_t idx;
						if (b == a) {
							idx = k;
						} else {
							idx = rest % s->ax[b].n;
							rest /= s->ax[b].n;
						}
						pt += idx * mul;
						mul *= s->ax[b].n;
					}
					if (pt * n_ops + pol >= n)
						continue;
					const struct sweep_cell *cl = &c[pt * n_ops + pol];
					if (k == 0) {
						off +=
						    (size_t)snprintf(lab + off, sizeof(lab) - off,
						                     "%s", cl->ops->name);
						for (size_t b = 0; b < s->n_axes; b++)
							if (b != a && off < sizeof(lab))
								off += (size_t)snprintf(
								    lab + off, sizeof(lab) - off,
								    " %s=%g",
								    params[s->ax[b].param].name,
								    cl->v[b]);
						fprintf(f, "# %s\n", lab);
					}
					if (cl->rc) {
						fprintf(f, "%g NaN NaN NaN\n", ax->v[k]);
						continue;
					}
					any = true;
					cur[k] = cl->res.own_hit_rate;
					fprintf(f, "%g %.4f %.3f %.3f\n", ax->v[k],
					        100 * cl->res.own_hit_rate,
					        cl->res.ttft_p50_ms / 1e3,
					        cl->res.ttft_p99_ms / 1e3);
				}
				fprintf(f, "\n\n");
				if (n_series == 0) {
					memcpy(first, cur, ax->n * sizeof(*cur));
				} else if (!covered) {
					covered = true;
					for (size_t k = 0; k < ax->n; k++)
						covered &= cur[k] == first[k];
				}
				if (n_series < 256)
					snprintf(labels[n_series], sizeof(labels[0]), "%s%s", lab,
					         any ? "" : " (failed)");
				n_series++;
			}
		}
		fclose(f);
		bool logx = lo > 0 && hi / lo >= 20;
		char xl[160];
		snprintf(xl, sizeof(xl), "%s%s%s%s", name, *unit ? " (" : "", unit,
		         *unit ? ")" : "");
		/* The legend goes below both panels, two entries a row, with room kept for it. */
		size_t ns = n_series < 256 ? n_series : 256, rows = (ns + 1) / 2;
		fprintf(
		    gp,
		    "set terminal pngcairo size 1400,%zu noenhanced font ',11'\n"
		    "set output 'sweep_%s.png'\n"
		    "set multiplot layout 1,2 title '%s%s%s' font ',13'\n"
		    "%s\nset bmargin %zu\n"
		    "set xlabel '%s'\nset ylabel 'prefix-cache hit rate (%% of prompt blocks)'\n"
		    "set yrange [0:*]\nunset logscale y\n"
		    "set key at screen 0.5, screen 0.01 center bottom horizontal maxrows %zu\n"
		    "set title 'hit rate'\n"
		    "plot ",
		    (size_t)580 + 22 * rows, name, title ? title : "", title ? ": " : "", xl,
		    logx ? "set logscale x" : "unset logscale x", 5 + rows, xl, rows);
		/* The first series wide, so one that coincides with it (events and approx_lru
		 * often do) still shows. */
		for (size_t i = 0; i < ns; i++)
			fprintf(gp,
			        "%s'sweep_%s.dat' index %zu using 1:2 with linespoints lw %d pt 7 "
			        "ps %.1f lc %zu title '%s'",
			        i ? ", " : "", name, i, i == 0 && covered ? 6 : 2,
			        i == 0 && covered ? 1.6 : 1.0, i + 1, labels[i]);
		fprintf(gp, "\nset ylabel 'TTFT (s, log)'\nset logscale y\nset yrange [*:*]\n"
		            "set title 'TTFT p99 (solid) and p50 (dashed)'\nset key off\n"
		            "plot ");
		for (size_t i = 0; i < ns; i++) {
			int lw = i == 0 && covered ? 6 : 2;
			fprintf(
			    gp,
			    "%s'sweep_%s.dat' index %zu using 1:4 with linespoints lw %d pt 7 "
			    "lc %zu notitle, 'sweep_%s.dat' index %zu using 1:3 with linespoints "
			    "lw %d dt 2 pt 6 lc %zu notitle",
			    i ? ", " : "", name, i, lw, i + 1, name, i, lw, i + 1);
		}
		fprintf(gp, "\nunset multiplot\nunset logscale\nset bmargin\n");
	}
	fclose(gp);
	return replay_plot_run(dir, "sweep.gp", err, errlen);
ioerr:
	return replay_io_error(p, err, errlen);
}
