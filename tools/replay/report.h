/*
 * tools/replay/report.h - kvr-replay's outputs: the stdout table, JSON, CSV and gnuplot PNGs.
 *
 * timing = false leaves out every field measured on the host clock (route CPU time, wall
 * time), so that two runs with the same seed give byte-identical files (the determinism test).
 * Context: single-threaded.
 */
#ifndef KVR_TOOLS_REPLAY_REPORT_H
#define KVR_TOOLS_REPLAY_REPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "tools/replay/replay.h"

struct replay_meta {
	const char *const *traces; /* file names */
	size_t n_traces;
	size_t n_requests, n_bad;
	uint32_t trace_block_size;
	const char *blocks_why; /* how blocks_per_rank was chosen, or NULL (given) */
	const struct replay_config *cfg;
	const struct replay_ceiling *ceiling; /* replay_reuse_ceiling, or NULL (not measured) */
};

/* The verdict's thresholds.  REPLAY_SAME_WITHIN: two TTFT percentiles closer than this (a
 * ratio under 1.03) are "about the same".  round_robin and least_loaded do not depend on the
 * seed; approx_lru does (its tie-breaks): on the Mooncake sample at 8 ranks x 25,600 blocks
 * (tools/quickstart.sh's main job), seeds 1, 2 and 3 gave approx_lru TTFT p50 480.4, 470.1,
 * 479.6 ms (2.2 % apart) and p99 4975.0, 5059.2, 4989.1 ms (1.7 % apart), so its p99 against
 * least_loaded's 5011.5 ms read 1.01x faster, 1.01x slower, 1.00x.  3 % is above that spread.
 * REPLAY_PAYS_OFF_POINTS: the router's cached share this many points over the best cache-blind
 * policy's "pays off".  REPLAY_NEAR_CEILING: the best policy's share at this fraction of the
 * trace's reuse ceiling or more puts the limit on the traffic, under it on capacity or
 * placement. */
#define REPLAY_SAME_WITHIN     0.03
#define REPLAY_PAYS_OFF_POINTS 5.0
#define REPLAY_NEAR_CEILING    0.8

void replay_report_table(FILE *f, const struct replay_result *res, size_t n);

/* The plumbing every writer of kvr-replay's files shares (this file's and tools/replay/sweep.c's);
 * each returns 0, or -1 with a message in err. */
struct json_t;
/* Writes root to path (indented, keys in insertion order, 10 significant digits) and frees it. */
int replay_json_write(struct json_t *root, const char *path, char *err, size_t errlen);
/* A JSON string of s (a path, a label, a message) whatever its bytes: each byte that does not
 * start a valid UTF-8 sequence becomes U+FFFD.  jansson's json_string() returns NULL for such
 * text, and setting NULL dropped the member without a word.  NULL only out of memory. */
struct json_t *replay_json_text(const char *s);
/* "what: strerror(errno)" into err; returns -1. */
int replay_io_error(const char *what, char *err, size_t errlen);
/* Creates the chart directory dir (an existing one is fine). */
int replay_plot_dir(const char *dir, char *err, size_t errlen);
/* Runs gnuplot on dir/script, in dir, where the script expects its data files. */
int replay_plot_run(const char *dir, const char *script, char *err, size_t errlen);

/* Each returns 0, or -1 with a message in err. */
int replay_report_json(const char *path, const struct replay_meta *meta,
                       const struct replay_result *res, size_t n, bool timing, char *err,
                       size_t errlen);
int replay_report_csv(const char *path, const struct replay_result *res, size_t n, bool timing,
                      char *err, size_t errlen);
/* Writes DIR/hit_rate.png (moving average over time), DIR/ttft_cdf.png and DIR/summary.png
 * (grouped bars per policy: cached share, TTFT p50/p99), plus their .dat and plots.gp, with
 * gnuplot.  title (may be NULL) prefixes each chart's title (the trace's name). */
int replay_report_plot(const char *dir, const struct replay_result *res, size_t n,
                       const char *title, char *err, size_t errlen);
/* The plain-words verdict, five lines starting "verdict [label]: ": the share of prompt tokens
 * (not blocks) served from cache per policy (highest first); TTFT p50/p99 of approx_lru (else
 * the first predicting policy) against round_robin and least_loaded, a direction claimed only
 * past REPLAY_SAME_WITHIN; its prediction exactness; and what was measured of cache-aware
 * routing: its share against the best cache-blind policy's (points and ratio; "pays off" at
 * REPLAY_PAYS_OFF_POINTS or more) and, with ceil (may be NULL: then no cause is named), the
 * trace's reuse ceiling against the best policy's share, which names the limit: the traffic
 * (at REPLAY_NEAR_CEILING of the ceiling or more) or capacity/placement. */
void replay_report_verdict(FILE *f, const struct replay_result *res, size_t n, const char *label,
                           const struct replay_ceiling *ceil);

#endif /* KVR_TOOLS_REPLAY_REPORT_H */
