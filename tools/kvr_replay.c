/*
 * kvr-replay - replays real request traces over a simulated vLLM cluster (tools/sim) once per
 * routing policy, on the same arrivals, and reports what each achieved: prefix-cache hit rate,
 * how exactly the router predicted the cached prefix, TTFT, latency, throughput, load
 * imbalance and router CPU time per decision.  See tools/replay/replay.h for the loop.
 *
 * usage: kvr-replay [--policies a,b,..] [--ranks N] [--blocks-per-rank N] [--block-size 16]
 *                   [--max-requests N] [--time-scale X] [--seed S] [--skip-bad]
 *                   [router settings] [--sweep NAME=v1,v2,...]... [--jobs N]
 *                   [--out FILE.json] [--csv FILE.csv] [--plot DIR] [--quiet] TRACE...
 * With --sweep, every policy is replayed at every point of the grid (tools/replay/sweep.h) and
 * the outputs describe the sweep.  Without it, the table is followed by a plain-words verdict
 * (lines starting "verdict [LABEL]:").
 * Exit: 0 done, 1 a trace or a replay failed, 2 usage.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvrouter.h"
#include "tools/replay/policy.h"
#include "tools/replay/replay.h"
#include "tools/replay/report.h"
#include "tools/replay/sweep.h"
#include "tools/trace.h"

static const struct replay_policy_ops *const all_policies[] = {
    &replay_policy_events,
    &replay_policy_approx_lru,
    &replay_policy_approx_ttl,
    &replay_policy_round_robin,
    &replay_policy_random,
    &replay_policy_least_loaded,
    &replay_policy_approx_lru_feedback,
    &replay_policy_approx_lru_watermark,
    &replay_policy_approx_lru_chain,
};
#define N_ALL (sizeof(all_policies) / sizeof(all_policies[0]))

static void usage(FILE *f)
{
	fprintf(
	    f,
	    "usage: kvr-replay [options] TRACE...\n"
	    "  --policies LIST        comma-separated, default all: events,approx_lru,"
	    "approx_ttl,round_robin,random,least_loaded;\n"
	    "                         also approx_lru+feedback: approx_lru told each request's\n"
	    "                         cached tokens at admission (kvr_request_cached);\n"
	    "                         also approx_lru+watermark: that, and each rank's oldest\n"
	    "                         cached block and resident block count at admission\n"
	    "                         (kvr_rank_observe);\n"
	    "                         also approx_lru+chain: approx_lru behind a frontend that\n"
	    "                         keeps each session's hash chain and hashes only the\n"
	    "                         tokens a turn adds (checked against the previous prompt's,\n"
	    "                         timed with the decision);\n"
	    "                         also events_feed: events through the real KV event "
	    "feed\n"
	    "                         (vLLM msgpack over ZeroMQ on loopback, real lag; -Dzmq "
	    "builds)\n"
	    "  --ranks N              simulated ranks, 1..65536 (default 8)\n"
	    "  --blocks-per-rank N    GPU KV blocks per rank (default: chosen for capacity "
	    "pressure, printed)\n"
	    "  --block-size N         router and engine block size, tokens, 1..65536 (default "
	    "16)\n"
	    "  --max-requests N       replay only the first N requests, N >= 1 (default: "
	    "all)\n"
	    "  --time-scale X         multiply arrival times by X (0.5 = twice the rate; "
	    "default 1)\n"
	    "  --seed S               seed of random choices (default 1)\n"
	    "  --max-batched-tokens N engine token budget per step (default 8192)\n"
	    "  --step-base-ms X       engine step time a (default 5 ms)\n"
	    "  --step-per-token-us X  engine step time b per token (default 50 us)\n"
	    "  --free-order O         where an engine queues a freed block without a hash, as\n"
	    "                         the router is told (kvr_config.free_order): fresh-first\n"
	    "                         (vLLM 2026, default) or tail-first (vLLM 2025)\n"
	    "  --step-per-kv-block-us X engine step time c per KV block its attention reads\n"
	    "                         (default 0; ~0.6 for an 8B model on an H100)\n"
	    "  --sample-every N       approx_lru agreement sample every N requests (default "
	    "500, 0 = off)\n"
	    "  --serial               one request at a time (agreement after every request)\n"
	    "  --output-every N       tell the router output tokens every N blocks (default 1)\n"
	    "  --skip-bad             skip malformed trace entries (counted)\n"
	    "router settings (router-backed policies; default: the router's own):\n"
	    "  --overlap-credit X     weight of a cached block against a prefill block (1)\n"
	    "  --prefill-load-scale X weight of the prefill term against decode blocks (1)\n"
	    "  --temperature X        softmax selection temperature (0 = argmin)\n"
	    "  --ttl S                approx_ttl retention, seconds (120)\n"
	    "  --queue-threshold X    hold requests while every rank's prefill exceeds X x its "
	    "token budget (0 = never)\n"
	    "  --capacity-factor X    approx_lru registers X x the engine's blocks (1)\n"
	    "  --max-model-len N      refuse before routing a request whose prompt + output\n"
	    "                         tokens exceed N, as vLLM's max_model_len (0 = no limit but\n"
	    "                         a rank's KV pool; default)\n"
	    "  --foreign-traffic F    a share F (0..1) of arrivals bypasses the policy (0)\n"
	    "  --foreign-as MODE      how that share is sent: clients (cache-unaware, a random\n"
	    "                         rank; default), router (another approx_lru router this one\n"
	    "                         cannot see), self (routed by the policy too: the no-error\n"
	    "                         baseline over the same requests).  hit%% counts this\n"
	    "                         router's requests, all%% every arrival\n"
	    "  --decisions FILE       append every decision (engine and predicted overlap per\n"
	    "                         rank) and what each healing report evicted (and the engine\n"
	    "                         still held) to FILE; tools/replay/decisions.py compares two\n"
	    "                         policies\n"
	    "  --sweep NAME=v1,v2,... replay every policy at each value; repeat for a grid.\n"
	    "                         NAME: blocks, capacity_factor, overlap_credit, "
	    "temperature, ttl,\n"
	    "                         queue_threshold, time_scale, foreign_traffic,\n"
	    "                         prefill_load_scale\n"
	    "  --jobs N               replays run at once, each on its own thread (default 1)\n"
	    "  --label TEXT           name of the trace in the verdict and chart titles\n"
	    "  --routers N            N router replicas (arrivals round-robin): approx_lru (one\n"
	    "                         router) vs replicas_sync (replica sync, in-process) vs\n"
	    "                         replicas_nosync; --no-sync leaves replicas_sync out;\n"
	    "                         not with --policies\n"
	    "  --out FILE.json  --csv FILE.csv  --plot DIR (PNG charts with gnuplot)\n"
	    "  --no-timing            leave host-clock timings out of JSON/CSV (reproducible "
	    "files)\n"
	    "  --quiet                no table, no progress bar\n"
	    "  --path-runs            count the runs each prompt's lookup crosses in the router's\n"
	    "                         index (printed per policy; perturbs that run's timings)\n");
}

struct progress {
	const char *name;
	size_t last;
};

static void progress_cb(void *ctx, size_t done, size_t total)
{
	struct progress *p = ctx;
	size_t pct = total ? done * 100 / total : 100;
	if (pct == p->last && done != total)
		return;
	p->last = pct;
	int w = 40, fill = (int)(pct * (size_t)w / 100);
	fprintf(stderr, "\r%-13s [%.*s%*s] %3zu%%", p->name, fill,
	        "########################################", w - fill, "", pct);
	if (done == total)
		fprintf(stderr, "\r%*s\r", 70, "");
}

/* A whole decimal number.  strtoull alone skipped leading space, so " -1" passed a check of
 * s[0] for '-' and wrapped to 2^64 - 1 (--max-requests " -1": no limit), and its base 0 read
 * "010" as 8. */
static int parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (s[0] < '0' || s[0] > '9')
		return -1;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end)
		return -1;
	*out = v;
	return 0;
}

static int parse_u32(const char *s, uint32_t *out)
{
	uint64_t v;
	if (parse_u64(s, &v) || v > UINT32_MAX)
		return -1;
	*out = (uint32_t)v;
	return 0;
}

static int parse_double(const char *s, double *out)
{
	char *end;
	double v = strtod(s, &end);
	if (end == s || *end || !(v >= 0) || !isfinite(v))
		return -1;
	*out = v;
	return 0;
}

int main(int argc, char **argv)
{
	struct replay_config cfg;
	replay_config_init(&cfg);
	cfg.foreign_ops = &replay_policy_approx_lru;
	cfg.sample_every = 500;
	const char *policies = NULL, *out = NULL, *csv = NULL, *plot = NULL;
	bool skip_bad = false, quiet = false, timing = true;
	uint64_t max_req = 0;
	enum {
		O_BATCH = 256,
		O_BASE,
		O_PER_TOK,
		O_PER_KV,
		O_SAMPLE,
		O_SERIAL,
		O_PATHRUNS,
		O_NOTIME,
		O_OUTEVERY,
		O_CREDIT,
		O_PLS,
		O_TEMP,
		O_TTL,
		O_QTHR,
		O_CAPF,
		O_FOREIGN,
		O_FOREIGN_AS,
		O_DECISIONS,
		O_SWEEP,
		O_JOBS,
		O_LABEL,
		O_ROUTERS,
		O_NOSYNC,
		O_MAXLEN,
		O_FREE_ORDER
	};
	uint32_t routers = 1;
	bool nosync = false;
	struct sweep sw = {0};
	uint32_t jobs = 1;
	const char *label = NULL;
	char serr[512];
	static const struct option opts[] = {
	    {"policies", required_argument, 0, 'p'},
	    {"ranks", required_argument, 0, 'r'},
	    {"blocks-per-rank", required_argument, 0, 'B'},
	    {"block-size", required_argument, 0, 'b'},
	    {"max-requests", required_argument, 0, 'n'},
	    {"time-scale", required_argument, 0, 't'},
	    {"seed", required_argument, 0, 's'},
	    {"skip-bad", no_argument, 0, 'k'},
	    {"out", required_argument, 0, 'o'},
	    {"csv", required_argument, 0, 'c'},
	    {"plot", required_argument, 0, 'P'},
	    {"quiet", no_argument, 0, 'q'},
	    {"max-batched-tokens", required_argument, 0, O_BATCH},
	    {"step-base-ms", required_argument, 0, O_BASE},
	    {"step-per-token-us", required_argument, 0, O_PER_TOK},
	    {"step-per-kv-block-us", required_argument, 0, O_PER_KV},
	    {"free-order", required_argument, 0, O_FREE_ORDER},
	    {"sample-every", required_argument, 0, O_SAMPLE},
	    {"serial", no_argument, 0, O_SERIAL},
	    {"path-runs", no_argument, 0, O_PATHRUNS},
	    {"no-timing", no_argument, 0, O_NOTIME},
	    {"output-every", required_argument, 0, O_OUTEVERY},
	    {"overlap-credit", required_argument, 0, O_CREDIT},
	    {"prefill-load-scale", required_argument, 0, O_PLS},
	    {"temperature", required_argument, 0, O_TEMP},
	    {"ttl", required_argument, 0, O_TTL},
	    {"queue-threshold", required_argument, 0, O_QTHR},
	    {"capacity-factor", required_argument, 0, O_CAPF},
	    {"foreign-traffic", required_argument, 0, O_FOREIGN},
	    {"foreign-as", required_argument, 0, O_FOREIGN_AS},
	    {"decisions", required_argument, 0, O_DECISIONS},
	    {"sweep", required_argument, 0, O_SWEEP},
	    {"jobs", required_argument, 0, O_JOBS},
	    {"label", required_argument, 0, O_LABEL},
	    {"routers", required_argument, 0, O_ROUTERS},
	    {"no-sync", no_argument, 0, O_NOSYNC},
	    {"max-model-len", required_argument, 0, O_MAXLEN},
	    {"help", no_argument, 0, 'h'},
	    {0, 0, 0, 0}};
	int c;
	double d;
	while ((c = getopt_long(argc, argv, "p:r:B:b:n:t:s:ko:c:P:qh", opts, NULL)) != -1) {
		int bad = 0;
		switch (c) {
		case 'p':
			policies = optarg;
			break;
		case 'r':
			bad = parse_u32(optarg, &cfg.n_ranks) || cfg.n_ranks == 0 ||
			      cfg.n_ranks > 65536; /* the router's max_ranks limit */
			break;
		case 'B':
			bad = parse_u32(optarg, &cfg.blocks_per_rank) || cfg.blocks_per_rank == 0;
			break;
		case 'b':
			bad = parse_u32(optarg, &cfg.block_size) || cfg.block_size == 0 ||
			      cfg.block_size > 65536; /* the router's block_size limit */
			break;
		case 'n':
			/* 0 replayed every request: "the first 0" read as no limit */
			bad = parse_u64(optarg, &max_req) || max_req == 0;
			break;
		case 't':
			bad = parse_double(optarg, &cfg.time_scale) || cfg.time_scale == 0;
			break;
		case 's': /* the JSON report's integers are signed 64-bit: 2^64 - 1 read -1 */
			bad = parse_u64(optarg, &cfg.seed) || cfg.seed > INT64_MAX;
			break;
		case 'k':
			skip_bad = true;
			break;
		case 'o':
			out = optarg;
			break;
		case 'c':
			csv = optarg;
			break;
		case 'P':
			plot = optarg;
			break;
		case 'q':
			quiet = true;
			break;
		case O_BATCH:
			bad = parse_u32(optarg, &cfg.max_batched_tokens) ||
			      cfg.max_batched_tokens == 0;
			break;
		case O_BASE:
			bad = parse_double(optarg, &d);
			cfg.step_base_ns = d * 1e6;
			break;
		case O_PER_TOK:
			bad = parse_double(optarg, &d);
			cfg.step_per_token_ns = d * 1e3;
			break;
		case O_PER_KV:
			bad = parse_double(optarg, &d);
			cfg.step_per_kv_block_ns = d * 1e3;
			break;
		case O_FREE_ORDER:
			bad =
			    strcmp(optarg, "fresh-first") != 0 && strcmp(optarg, "tail-first") != 0;
			cfg.free_tail_first = strcmp(optarg, "tail-first") == 0;
			break;
		case O_SAMPLE:
			bad = parse_u32(optarg, &cfg.sample_every);
			break;
		case O_SERIAL:
			cfg.serial = true;
			break;
		case O_PATHRUNS:
			cfg.path_runs = true;
			break;
		case O_NOTIME:
			timing = false;
			break;
		case O_OUTEVERY:
			bad = parse_u32(optarg, &cfg.output_every) || cfg.output_every == 0;
			break;
		case O_CREDIT:
			bad = parse_double(optarg, &cfg.overlap_credit);
			break;
		case O_PLS:
			bad = parse_double(optarg, &cfg.prefill_load_scale);
			break;
		case O_TEMP:
			bad = parse_double(optarg, &cfg.temperature);
			break;
		case O_TTL:
			/* the router's ttl_ns: at least 1 ns, and within 64 bits */
			bad = parse_double(optarg, &cfg.ttl_s) || !(cfg.ttl_s >= 1e-9) ||
			      cfg.ttl_s > 9e9;
			break;
		case O_QTHR:
			bad = parse_double(optarg, &cfg.queue_threshold);
			break;
		case O_FOREIGN:
			bad = parse_double(optarg, &cfg.foreign_share) || cfg.foreign_share < 0 ||
			      cfg.foreign_share >= 1;
			break;
		case O_FOREIGN_AS:
			if (!strcmp(optarg, "clients"))
				cfg.foreign_as = REPLAY_FOREIGN_CLIENTS;
			else if (!strcmp(optarg, "router"))
				cfg.foreign_as = REPLAY_FOREIGN_ROUTER;
			else if (!strcmp(optarg, "self"))
				cfg.foreign_as = REPLAY_FOREIGN_SELF;
			else
				bad = 1;
			break;
		case O_DECISIONS:
			cfg.decisions = optarg;
			break;
		case O_CAPF:
			bad =
			    parse_double(optarg, &cfg.capacity_factor) || cfg.capacity_factor == 0;
			break;
		case O_SWEEP:
			if (sweep_parse(&sw, optarg, serr, sizeof(serr))) {
				fprintf(stderr, "kvr-replay: %s\n", serr);
				return 2;
			}
			break;
		case O_JOBS:
			bad = parse_u32(optarg, &jobs) || jobs == 0 || jobs > 64;
			break;
		case O_LABEL:
			label = optarg;
			break;
		case O_ROUTERS:
			bad = parse_u32(optarg, &routers) || routers == 0 || routers > 16;
			break;
		case O_MAXLEN:
			bad = parse_u32(optarg, &cfg.max_model_len);
			break;
		case O_NOSYNC:
			nosync = true;
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
		if (bad) {
			const struct option *o = opts;
			while (o->name && o->val != c)
				o++;
			fprintf(stderr, "kvr-replay: bad value for --%s: '%s'\n",
			        o->name ? o->name : "?", optarg);
			return 2;
		}
	}
	if (optind >= argc) {
		usage(stderr);
		return 2;
	}

	/* Policies. */
	const struct replay_policy_ops *sel[N_ALL + 3]; /* + events_feed, replicas */
	size_t n_sel = 0;
	if (routers > 1) { /* one router vs N replicas synced (unless --no-sync) vs unsynced */
		/* Its policies are fixed: a list given too was dropped without a word, unknown
		 * names included. */
		if (policies) {
			fprintf(
			    stderr,
			    "kvr-replay: --policies does not apply with --routers %u (it replays "
			    "approx_lru, replicas_sync and replicas_nosync; --no-sync leaves "
			    "replicas_sync out)\n",
			    routers);
			return 2;
		}
		replay_n_routers = routers;
		sel[n_sel++] = &replay_policy_approx_lru;
		if (!nosync)
			sel[n_sel++] = &replay_policy_replicas_sync;
		sel[n_sel++] = &replay_policy_replicas_nosync;
	} else if (!policies) { /* the feedback variants (last two) only when asked for */
		for (size_t i = 0; i + 3 < N_ALL; i++)
			sel[n_sel++] = all_policies[i];
	} else {
		char *list = strdup(policies), *save = NULL;
		for (char *tok = strtok_r(list, ",", &save); tok;
		     tok = strtok_r(NULL, ",", &save)) {
			size_t i = 0;
			while (i < N_ALL && strcmp(all_policies[i]->name, tok))
				i++;
			const struct replay_policy_ops *pick = i < N_ALL ? all_policies[i] : NULL;
#ifdef KVR_REPLAY_FEED
			if (!pick && !strcmp(tok, replay_policy_events_feed.name))
				pick = &replay_policy_events_feed;
#endif
			if (!pick) {
				fprintf(stderr, "kvr-replay: unknown policy '%s'\n", tok);
				free(list);
				return 2;
			}
			/* Named twice, it ran twice: two rows and two JSON entries of one name
			 * (and past the array's room, names were dropped without a word). */
			for (size_t k = 0; k < n_sel; k++)
				if (sel[k] == pick) {
					fprintf(
					    stderr,
					    "kvr-replay: policy '%s' named twice in --policies\n",
					    tok);
					free(list);
					return 2;
				}
			sel[n_sel++] = pick;
		}
		free(list);
		if (!n_sel) {
			fprintf(stderr, "kvr-replay: --policies is empty\n");
			return 2;
		}
	}

	/* Traces. */
	struct trace t = {0};
	char err[1024];
	for (int i = optind; i < argc; i++) {
		if (trace_load(&t, argv[i], skip_bad, (size_t)max_req, err, sizeof(err))) {
			fprintf(stderr, "kvr-replay: %s\n", err);
			trace_free(&t);
			return 1;
		}
		if (err[0]) /* a file skipped whole (--skip-bad) */
			fprintf(stderr, "kvr-replay: %s\n", err);
	}
	trace_finish(&t);
	if (max_req && t.n > max_req)
		t.n = (size_t)max_req;
	/* Nothing to replay is an error: a table of zeros and a verdict of 0.0 % said otherwise. */
	if (t.n == 0) {
		fprintf(stderr, "kvr-replay: no requests to replay (%zu malformed skipped)\n",
		        t.n_bad);
		trace_free(&t);
		return 1;
	}
	if (t.block_size % cfg.block_size) {
		fprintf(stderr,
		        "kvr-replay: --block-size %u must divide the trace's block size %u\n",
		        cfg.block_size, t.block_size);
		trace_free(&t);
		return 2;
	}
	char why[512] = "";
	bool chosen = cfg.blocks_per_rank == 0;
	if (chosen)
		cfg.blocks_per_rank = replay_default_blocks(&t, &cfg, why, sizeof(why));
	char lab[256];
	if (!label) { /* the trace's directory when several files, else its file name */
		const char *a = argv[optind];
		const char *slash = strrchr(a, '/');
		if (argc - optind > 1 && slash) {
			size_t dl = (size_t)(slash - a);
			const char *d0 = a;
			for (const char *q = a; q < slash; q++)
				if (*q == '/')
					d0 = q + 1;
			snprintf(lab, sizeof(lab), "%.*s", (int)(dl - (size_t)(d0 - a)), d0);
		} else {
			snprintf(lab, sizeof(lab), "%s", slash ? slash + 1 : a);
		}
		label = lab;
	} else {
		snprintf(lab, sizeof(lab), "%s", label);
		label = lab;
	}
	for (char *q = lab; *q; q++) /* it goes into gnuplot's single-quoted strings */
		if (*q == '\'' || *q == '\\')
			*q = '`';
	if (!quiet) {
		printf("kvr-replay: %zu requests (%zu malformed skipped), trace block size %u, "
		       "%u ranks, block size %u\n",
		       t.n, t.n_bad, t.block_size, cfg.n_ranks, cfg.block_size);
		if (chosen)
			printf("  GPU blocks per rank: %s\n", why);
		else
			printf("  GPU blocks per rank: %u (given)\n", cfg.blocks_per_rank);
		printf("  engine: %u tokens/step, step = %.2f ms + %.1f us/token",
		       cfg.max_batched_tokens, cfg.step_base_ns / 1e6, cfg.step_per_token_ns / 1e3);
		if (cfg.step_per_kv_block_ns > 0)
			printf(" + %.2f us/KV block read", cfg.step_per_kv_block_ns / 1e3);
		printf("; free order %s; time scale %g; seed %llu\n",
		       cfg.free_tail_first ? "tail-first (vLLM 2025)" : "fresh-first (vLLM 2026)",
		       cfg.time_scale, (unsigned long long)cfg.seed);
		if (!isnan(cfg.overlap_credit) || !isnan(cfg.prefill_load_scale) ||
		    !isnan(cfg.temperature) || !isnan(cfg.ttl_s) || !isnan(cfg.queue_threshold) ||
		    cfg.capacity_factor != 1)
			printf(
			    "  router: overlap_credit %g, prefill_load_scale %g, temperature %g, "
			    "ttl %g s, queue_threshold %g, capacity_factor %g (nan = the router's "
			    "default)\n",
			    cfg.overlap_credit, cfg.prefill_load_scale, cfg.temperature, cfg.ttl_s,
			    cfg.queue_threshold, cfg.capacity_factor);
		if (cfg.max_model_len)
			printf("  max_model_len %u: a request whose prompt + output exceed it is "
			       "refused before routing\n",
			       cfg.max_model_len);
		if (cfg.foreign_share > 0)
			printf(
			    "  foreign traffic: %.0f %% of the arrivals (the same ones for every "
			    "policy) %s; hit%% and the prediction count this router's requests, "
			    "all%% every arrival\n",
			    cfg.foreign_share * 100,
			    cfg.foreign_as == REPLAY_FOREIGN_SELF
			        ? "routed by the policy itself (no error: the baseline)"
			    : cfg.foreign_as == REPLAY_FOREIGN_ROUTER
			        ? "routed by another approx_lru router this one cannot see"
			        : "sent to a random rank by cache-unaware clients");
		fflush(stdout);
	}

	bool bar = !quiet && isatty(2);
	if (sw.n_axes) {
		struct progress pr = {.name = "sweep", .last = (size_t)-1};
		struct sweep_cell *cells = NULL;
		size_t np = sweep_points(&sw), nc = np * n_sel;
		if (!quiet)
			printf("  sweep: %zu points x %zu policies = %zu replays, %u at a time\n",
			       np, n_sel, nc, jobs);
		if (sweep_run(&sw, &t, &cfg, sel, n_sel, jobs, false, bar ? progress_cb : NULL, &pr,
		              &cells)) {
			fprintf(stderr, "kvr-replay: out of memory\n");
			trace_free(&t);
			return 1;
		}
		int st = 0;
		for (size_t i = 0; i < nc; i++) {
			if (cells[i].rc) {
				fprintf(stderr, "kvr-replay: %s: %s\n", cells[i].ops->name,
				        cells[i].err);
				st = 1;
			}
		}
		if (!quiet)
			sweep_report_table(stdout, &sw, cells, nc);
		if (out && sweep_report_json(out, &sw, cells, nc, label, err, sizeof(err))) {
			fprintf(stderr, "kvr-replay: %s\n", err);
			st = 1;
		}
		if (csv && sweep_report_csv(csv, &sw, cells, nc, err, sizeof(err))) {
			fprintf(stderr, "kvr-replay: %s\n", err);
			st = 1;
		}
		if (plot) {
			if (sweep_report_plot(plot, &sw, cells, nc, n_sel, label, err,
			                      sizeof(err))) {
				fprintf(stderr, "kvr-replay: %s\n", err);
				st = 1;
			} else if (!quiet) {
				for (size_t a = 0; a < sw.n_axes; a++)
					if (sw.ax[a].n > 1)
						printf("chart: %s/sweep_%s.png\n", plot,
						       sweep_param_name(sw.ax[a].param));
			}
		}
		free(cells);
		trace_free(&t);
		return st;
	}

	struct replay_result *res = calloc(n_sel, sizeof(*res));
	if (!res) {
		fprintf(stderr, "kvr-replay: out of memory\n");
		trace_free(&t);
		return 1;
	}
	int status = 0;
	size_t done = 0;
	if (jobs > 1) { /* the policies side by side: a one-point sweep that keeps the series */
		struct sweep none = {0};
		struct sweep_cell *cells = NULL;
		struct progress pr = {.name = "replays", .last = (size_t)-1};
		if (sweep_run(&none, &t, &cfg, sel, n_sel, jobs, true, bar ? progress_cb : NULL,
		              &pr, &cells)) {
			fprintf(stderr, "kvr-replay: out of memory\n");
			free(res);
			trace_free(&t);
			return 1;
		}
		for (size_t i = 0; i < n_sel; i++) {
			if (cells[i].rc) {
				fprintf(stderr, "kvr-replay: %s\n", cells[i].err);
				status = 1;
				break;
			}
			res[done++] = cells[i].res;
		}
		for (size_t i = done; i < n_sel; i++)
			replay_result_free(&cells[i].res);
		free(cells);
	} else {
		for (size_t i = 0; i < n_sel; i++) {
			struct progress pr = {.name = sel[i]->name, .last = (size_t)-1};
			struct replay_config pc = cfg;
			if (bar) {
				pc.progress = progress_cb;
				pc.progress_ctx = &pr;
			}
			if (!replay_samples_agreement(sel[i], &cfg))
				pc.sample_every = 0;
			if (replay_run(&t, sel[i], &pc, &res[i], err, sizeof(err))) {
				fprintf(stderr, "kvr-replay: %s\n", err);
				status = 1;
				break;
			}
			done++;
		}
	}
	/* The trace's reuse ceiling, for the verdict's cause and the JSON: over every arrival, so
	 * not with foreign traffic (the shares then count this router's requests alone). */
	struct replay_ceiling ceil;
	bool has_ceil =
	    done && cfg.foreign_share == 0 && replay_reuse_ceiling(&t, &cfg, &ceil) == 0;
	if (!quiet && done) {
		replay_report_table(stdout, res, done);
		replay_report_verdict(stdout, res, done, label, has_ceil ? &ceil : NULL);
	}
	/* Every trace (past the 64th they were left out of the JSON without a word). */
	struct replay_meta meta = {.traces = (const char *const *)(argv + optind),
	                           .n_traces = (size_t)(argc - optind),
	                           .n_requests = t.n,
	                           .n_bad = t.n_bad,
	                           .trace_block_size = t.block_size,
	                           .blocks_why = chosen ? why : NULL,
	                           .cfg = &cfg,
	                           .ceiling = has_ceil ? &ceil : NULL};
	if (done && out && replay_report_json(out, &meta, res, done, timing, err, sizeof(err))) {
		fprintf(stderr, "kvr-replay: %s\n", err);
		status = 1;
	}
	if (done && csv && replay_report_csv(csv, res, done, timing, err, sizeof(err))) {
		fprintf(stderr, "kvr-replay: %s\n", err);
		status = 1;
	}
	if (done && plot) {
		if (replay_report_plot(plot, res, done, label, err, sizeof(err))) {
			fprintf(stderr, "kvr-replay: %s\n", err);
			status = 1;
		} else if (!quiet) {
			printf("charts: %s/summary.png %s/hit_rate.png %s/ttft_cdf.png\n", plot,
			       plot, plot);
		}
	}
	for (size_t i = 0; i < done; i++)
		replay_result_free(&res[i]);
	free(res);
	trace_free(&t);
	return status;
}
