/*
 * tools/replay/sweep.h - kvr-replay --sweep: the same trace replayed over a grid of settings.
 *
 * Each `--sweep NAME=v1,v2,...` adds an axis; several axes form their full grid (the first
 * axis varies slowest).  Every grid point is replayed once per chosen policy, on the same
 * arrivals, each replay on a fresh simulated cluster (tools/replay/replay.h), with up to
 * `jobs` replays running at once on their own threads (each replay is independent: its own
 * simulator and router; the trace is shared read-only).  The results are written as CSV, JSON
 * and one chart per swept parameter (hit rate and TTFT p50/p99 against the parameter).
 *
 * Parameters (NAME, unit, what it changes):
 *   blocks           blocks/rank  the engines' GPU KV blocks, and the capacity approx_lru registers
 *   capacity_factor  x            approx_lru registers factor x blocks (mis-registered capacity)
 *   overlap_credit   -            kvr_config.overlap_credit (cached block vs prefill block)
 *   prefill_load_scale -          kvr_config.prefill_load_scale (prefill term vs decode blocks)
 *   temperature      -            kvr_config.temperature (softmax selection; 0 = argmin)
 *   ttl              s            kvr_config.ttl_ns (approx_ttl retention)
 *   queue_threshold  x budget     kvr_config.queue_threshold (0 = never queue)
 *   time_scale       x            arrival times multiplied (0.5 = twice the request rate)
 *
 * Context: single-threaded callers; sweep_run starts and joins its own threads.
 */
#ifndef KVR_TOOLS_REPLAY_SWEEP_H
#define KVR_TOOLS_REPLAY_SWEEP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "tools/replay/policy.h"
#include "tools/replay/replay.h"
#include "tools/trace.h"

enum sweep_param {
	SWEEP_BLOCKS,
	SWEEP_CAPACITY_FACTOR,
	SWEEP_OVERLAP_CREDIT,
	SWEEP_TEMPERATURE,
	SWEEP_TTL,
	SWEEP_QUEUE_THRESHOLD,
	SWEEP_TIME_SCALE,
	SWEEP_FOREIGN, /* foreign_traffic: replay_config.foreign_share */
	SWEEP_PREFILL_LOAD_SCALE,
	SWEEP_N_PARAMS
};

#define SWEEP_MAX_AXES   4
#define SWEEP_MAX_VALUES 64

struct sweep_axis {
	enum sweep_param param;
	size_t n;
	double v[SWEEP_MAX_VALUES];
};

struct sweep {
	struct sweep_axis ax[SWEEP_MAX_AXES];
	size_t n_axes;
};

/* One replay of the grid: the point's values (one per axis) and the replay's summary. */
struct sweep_cell {
	size_t point;
	const struct replay_policy_ops *ops;
	double v[SWEEP_MAX_AXES];
	struct replay_config cfg;
	struct replay_result res; /* series freed: scalars only */
	int rc;
	bool keep; /* res keeps its series */
	char err[256];
};

/* Parses one NAME=v1,v2,... and appends it as an axis.  Returns 0, or -1 with a message in err
 * (unknown name, with the list of known ones; empty list or empty value; a value that is not
 * a number or is out of the parameter's range; a name given twice; too many axes/values). */
int sweep_parse(struct sweep *s, const char *arg, char *err, size_t errlen);

const char *sweep_param_name(enum sweep_param p);
const char *sweep_param_unit(enum sweep_param p);

/* Grid points (the product of the axis lengths; 1 with no axis). */
size_t sweep_points(const struct sweep *s);

/* Sets point's values into cfg (which holds the base settings). */
void sweep_apply(const struct sweep *s, size_t point, struct replay_config *cfg, double *values);

/*
 * Replays t with every policy at every point, jobs at a time (>= 1).  *cells_out gets
 * points x n_ops cells (point-major; free with free()).  Agreement sampling (base's
 * sample_every) stays on where replay_samples_agreement says, as in a plain kvr-replay run.
 * keep_series: the cells keep their results' series (the caller frees them with
 * replay_result_free); else only the scalars are kept.  progress (may be NULL) is called with
 * (done, total) from the calling thread only.  Returns 0 (each cell has its own rc), or KVR_ENOMEM.
 */
int sweep_run(const struct sweep *s, const struct trace *t, const struct replay_config *base,
              const struct replay_policy_ops *const *ops, size_t n_ops, unsigned jobs,
              bool keep_series, void (*progress)(void *ctx, size_t done, size_t total), void *ctx,
              struct sweep_cell **cells_out);

/* Outputs.  Each returns 0, or -1 with a message in err. */
void sweep_report_table(FILE *f, const struct sweep *s, const struct sweep_cell *c, size_t n);
int sweep_report_csv(const char *path, const struct sweep *s, const struct sweep_cell *c, size_t n,
                     char *err, size_t errlen);
int sweep_report_json(const char *path, const struct sweep *s, const struct sweep_cell *c, size_t n,
                      const char *trace_names, char *err, size_t errlen);
/* DIR/sweep_NAME.png per axis of two values or more (hit rate and TTFT p50/p99 against NAME;
 * one line per policy and combination of the other axes), with its .dat and sweep.gp. */
int sweep_report_plot(const char *dir, const struct sweep *s, const struct sweep_cell *c, size_t n,
                      size_t n_ops, const char *title, char *err, size_t errlen);

#endif /* KVR_TOOLS_REPLAY_SWEEP_H */
