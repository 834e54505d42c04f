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
};

void replay_report_table(FILE *f, const struct replay_result *res, size_t n);
/* Each returns 0, or -1 with a message in err. */
int replay_report_json(const char *path, const struct replay_meta *meta,
                       const struct replay_result *res, size_t n, bool timing, char *err,
                       size_t errlen);
int replay_report_csv(const char *path, const struct replay_result *res, size_t n, bool timing,
                      char *err, size_t errlen);
/* Writes DIR/hit_rate.png and DIR/ttft_cdf.png (plus their .dat and plots.gp) with gnuplot. */
int replay_report_plot(const char *dir, const struct replay_result *res, size_t n, char *err,
                       size_t errlen);

#endif /* KVR_TOOLS_REPLAY_REPORT_H */
