/*
 * tools/replay/replay.c - one policy, one trace, one fresh simulated cluster (see replay.h).
 *
 * Output tokens: the simulator asks for each output token through output_token(user, id, i);
 * the replay answers with trace_output_token() and buffers the token for the policy, which
 * gets them output_every blocks at a time (one router call per output_every * block_size
 * tokens, not per token), after the first token, and the rest at finish.  Every sampled token is
 * sent, the final one included, as a streaming frontend does, and flagged as a frontend can
 * (finish_reason comes with the last token): the batch sent at finish ends with the final
 * token, every earlier batch ends with a token known not to be final.  The router, told so
 * (kvr_request_output_ex in kvrouter.h), counts a non-final token's KV slot at once and never
 * the final one's; the simulator caches floor((prompt + output - 1) / block size) blocks the
 * same way.
 *
 * When a batch goes out.  The engine (as vLLM's scheduler, allocate_slots at schedule time)
 * takes a sequence's block k in the step right after it sampled the token at position k*B, and
 * that allocation may evict a cached block.  So a batch is sent as the token at a sequence
 * position = 0 (mod output_every * B) is sampled: the router learns of every (output_every-th)
 * new block in the step the engine takes it, as it would with one call per token.  Batches
 * counted from the first output token instead were up to B - 1 steps late: an arrival in
 * between found the engine had evicted a block the router still counted (Mooncake sample, seed
 * 3, request 1035: predicted 1226 blocks, the engine held 1225;
 * tools/replay/testdata/decode_boundary.jsonl is the same thing in four requests).  With
 * kvr_request_output, which holds the last token back because it cannot know it is not the
 * final one, the router was one step late still (seed 12, request 514, over by a block), and
 * batches went out at position 1 (mod output_every * B).
 *
 * Chains for the agreement check: every block hash the replay sees (prompt blocks at routing,
 * output blocks as they complete) is recorded as seq -> (parent seq, local hash), so a chain
 * of the simulator's cached set can be handed back to the policy as local hashes.
 */
#include "tools/replay/replay.h"
#include "tools/sim/block_pool.h"
#include "tools/replay/agree.h"
#include "tools/replay/decisions.h"
#include "tools/replay/chains.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "tools/sim/cluster.h"

/* ---------------------------------------------------------------- the run */

struct rq {
	struct run *run;
	const struct trace_req *tr;
	uint64_t handle;
	uint64_t last_seq; /* last block hash of the sequence so far (chains) */
	uint32_t rank, predicted, n_blocks;
	uint32_t out_len, nbuf, nctail;
	uint32_t n_out;      /* output tokens sampled so far */
	uint64_t arrival_ns; /* trace arrival (a queued request is submitted later) */
	bool routed, first_seen, admitted_once;
	bool due;        /* a buffered token is at a batch boundary: send at first token */
	bool foreign;    /* in the foreign share (foreign_share): not this router's request */
	bool around;     /* foreign and not routed by the policy under test (foreign_as != SELF) */
	uint32_t *buf;   /* output tokens not yet sent (run->out_chunk at most) */
	uint32_t *ctail; /* chains: tokens after the last complete block */
};

struct run {
	const struct replay_config *cfg;
	const struct replay_policy_ops *ops;
	void *ps;
	const struct replay_policy_ops *fops; /* foreign_as == ROUTER: the other router */
	void *fps;
	struct sim_cluster *sim;
	struct replay_result *res;
	struct rq *rq;
	uint32_t *bufs;
	bool chains;
	struct replay_chains map;
	double *e2e_ms;
	size_t n_e2e;
	uint64_t tokens_done, first_arrival, last_finish;
	uint32_t out_chunk; /* output tokens per policy output() call */
	int oom;
	const struct trace *t;
	uint32_t *tok; /* prompt tokens of the request being submitted */
	size_t tok_cap;
	size_t n_held; /* queued by the policy, not admitted yet */
	double *cpu_ns;
	uint64_t *hl, *hs; /* kvr_hash_blocks' output for the hashing floor */
	size_t h_cap;
	double hash_ns;  /* the floor, summed */
	size_t n_routes; /* route() calls of the policy under test */
};

static double now_s(clockid_t id);

/* The floor of a decision: kvr_hash_blocks on the same prompt on this thread, CPU time. */
static int hash_floor(struct run *run, const uint32_t *tok, size_t n)
{
	size_t nb = n / run->cfg->block_size;
	if (nb > run->h_cap) {
		uint64_t *a = realloc(run->hl, nb * sizeof(*a));
		if (!a)
			return KVR_ENOMEM;
		run->hl = a;
		uint64_t *b = realloc(run->hs, nb * sizeof(*b));
		if (!b)
			return KVR_ENOMEM;
		run->hs = b;
		run->h_cap = nb;
	}
	double c0 = now_s(CLOCK_THREAD_CPUTIME_ID);
	kvr_hash_blocks(tok, n, run->cfg->block_size, NULL, run->hl, run->hs);
	run->hash_ns += (now_s(CLOCK_THREAD_CPUTIME_ID) - c0) * 1e9;
	return 0;
}

static void perr(struct run *run, int rc)
{
	if (rc == 0)
		return;
	if (run->res->policy_errors++ == 0)
		run->res->first_policy_error = rc;
}

/* The policy that routed q and hears of its happenings (NULL: a cache-unaware client).  Whether
 * that is the policy under test is !q->around, not o == run->ops: the other router of
 * --foreign-as router has the same ops (approx_lru) as the policy under test may. */
static const struct replay_policy_ops *owner_of(const struct run *run, const struct rq *q,
                                                void **ps)
{
	*ps = q->around ? run->fps : run->ps;
	return q->around ? run->fops : run->ops;
}

static uint64_t sim_clock(void *ctx)
{
	return sim_cluster_now(ctx);
}

/* Records n blocks of tokens continuing q's chain. */
static void record_blocks(struct run *run, struct rq *q, const uint32_t *tokens, size_t n_tokens)
{
	uint32_t bs = run->cfg->block_size;
	size_t nb = n_tokens / bs;
	uint64_t local[64], seq[64];
	for (size_t b = 0; b < nb; b += 64) {
		size_t k = nb - b < 64 ? nb - b : 64, got = 0;
		const uint64_t *parent = q->n_blocks ? &q->last_seq : NULL;
		kvr_hash_extend(parent, tokens + b * bs, k * bs, bs, NULL, local, seq, &got);
		for (size_t i = 0; i < got; i++) {
			uint64_t p = q->n_blocks ? q->last_seq : 0;
			if (replay_chains_put(&run->map, seq[i], p, local[i]))
				run->oom = 1;
			q->last_seq = seq[i];
			q->n_blocks++;
		}
	}
}

/* Sends the buffered tokens; final: the last of them is the request's final token (at finish;
 * a batch sent earlier never ends with it). */
static void flush(struct run *run, struct rq *q, bool final)
{
	if (!q->nbuf)
		return;
	void *ps;
	const struct replay_policy_ops *o = owner_of(run, q, &ps);
	if (o && o->output)
		perr(run, o->output(ps, q->handle, q->buf, q->nbuf, final));
	q->nbuf = 0;
	q->due = false;
}

static uint32_t on_output_token(void *user, uint64_t id, uint32_t i)
{
	(void)id;
	struct rq *q = user;
	uint32_t tok = trace_output_token(q->tr, i);
	if (q->run->chains) {
		q->ctail[q->nctail++] = tok;
		if (q->nctail == q->run->cfg->block_size) {
			record_blocks(q->run, q, q->ctail, q->nctail);
			q->nctail = 0;
		}
	}
	/* Batch boundary: this token sits at sequence position 0 (mod out_chunk), see the top.  The
	 * final token waits for the finish, which sends it flagged final. */
	uint32_t chunk = q->run->out_chunk;
	q->n_out = i + 1;
	bool final = q->n_out >= q->out_len;
	if ((q->tr->input_len + i) % chunk == 0 && !final)
		q->due = true;
	q->buf[q->nbuf++] = tok;
	if ((q->due || q->nbuf == chunk) && q->first_seen && !final)
		flush(q->run, q, false);
	return tok;
}

static void on_kv_event(void *ctx, const struct sim_kv_event *ev)
{
	struct run *run = ctx;
	if (run->ops->wants_events && run->ops->kv_event)
		perr(run, run->ops->kv_event(run->ps, ev));
}

static void on_admitted(void *ctx, const struct sim_admit_info *info)
{
	struct run *run = ctx;
	struct rq *q = info->user;
	struct replay_result *res = run->res;
	bool first = !q->admitted_once;
	q->admitted_once = true;
	if (first) { /* per share: this router's requests, the foreign ones (all = both) */
		res->share_prompt_blocks[q->foreign] += info->prompt_blocks;
		res->share_hit_blocks[q->foreign] += info->hit_blocks;
	}
	void *ps;
	const struct replay_policy_ops *o = owner_of(run, q, &ps);
	if (!o)
		return;
	if (first && !q->foreign) {
		res->prompt_tokens += q->tr->input_len;
		res->hit_tokens += (uint64_t)info->hit_blocks * run->cfg->block_size;
		if (res->n_adm < res->n_requests) {
			res->adm_s[res->n_adm] = (double)info->time_ns / 1e9;
			res->adm_prompt[res->n_adm] = info->prompt_blocks;
			res->adm_hit[res->n_adm++] = info->hit_blocks;
		}
		if (run->ops->predicts) {
			int64_t d = (int64_t)q->predicted - (int64_t)info->cached_blocks;
			res->n_pred++;
			res->predicted_blocks += q->predicted;
			res->n_exact += d == 0;
			res->n_over += d > 0;
			res->n_under += d < 0;
			res->mae_blocks += (double)(d < 0 ? -d : d);
		}
		uint32_t b = (uint32_t)((double)info->time_ns / 1e9 / res->bucket_s);
		if (b >= res->n_buckets)
			b = res->n_buckets - 1;
		res->bucket_prompt[b] += info->prompt_blocks;
		res->bucket_hit[b] += info->hit_blocks;
	}
	/* --decisions: what the healing hooks below evict, and whether the engine still held it. */
	uint64_t *before = NULL;
	size_t n_before = 0;
	bool trace = run->cfg->decisions && !q->around && info->preemptions == 0 &&
	             (o->admitted || o->observe);
	if (trace)
		perr(run, replay_decisions_before(o, ps, info->rank, &before, &n_before));
	if (o->admitted)
		perr(run, o->admitted(ps, q->handle, info));
	/* The rank's metrics, scraped when the policy under test sees one of its requests admitted.
	 */
	if (!q->around && run->ops->observe && info->preemptions == 0) {
		uint64_t wm = 0;
		const struct sim_pool *pool =
		    sim_engine_pool(sim_cluster_engine(run->sim, info->rank));
		bool has = sim_pool_oldest_cached(pool, &wm);
		/* Blocks in use or cached (vLLM: num_gpu_blocks less the free, unhashed ones). */
		uint64_t resident = 0;
		for (uint32_t b = 0, n = sim_pool_size(pool); b < n; b++) {
			const struct sim_block *blk = sim_pool_block(pool, b);
			resident += blk->ref > 0 || blk->hashed;
		}
		perr(run, run->ops->observe(run->ps, info->rank, has, wm, resident));
	}
	if (trace)
		perr(run,
		     replay_decisions_healed(run->cfg->decisions, o, ps, run->sim, run->cfg->seed,
		                             (size_t)(q - run->rq), info->rank, before, n_before));
}

static void on_first_token(void *ctx, uint32_t rank, uint64_t id, void *user, uint64_t t)
{
	(void)id;
	struct run *run = ctx;
	struct rq *q = user;
	q->first_seen = true;
	void *ps;
	const struct replay_policy_ops *o = owner_of(run, q, &ps);
	if (o && o->first_token)
		perr(run, o->first_token(ps, q->handle, rank, t));
	if ((q->due || q->nbuf == run->out_chunk) && q->n_out < q->out_len)
		flush(run, q, false);
}

static void on_finished(void *ctx, const struct sim_finish_info *info)
{
	struct run *run = ctx;
	struct rq *q = info->user;
	struct replay_result *res = run->res;
	flush(run, q, true);
	run->tokens_done += (uint64_t)info->prompt_len + info->output_len;
	if (info->finish_ns > run->last_finish)
		run->last_finish = info->finish_ns;
	void *ps;
	const struct replay_policy_ops *o = owner_of(run, q, &ps);
	if (o && o->finished)
		perr(run, o->finished(ps, q->handle, info));
	if (q->foreign)
		return;
	/* From the trace arrival: time spent in the router's queue counts. */
	res->ttft_ms[res->n_ttft++] = (double)(info->first_token_ns - q->arrival_ns) / 1e6;
	run->e2e_ms[run->n_e2e++] = (double)(info->finish_ns - q->arrival_ns) / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double pct(const double *sorted, size_t n, double p)
{
	if (!n)
		return 0;
	size_t i = (size_t)ceil(p * (double)n) - 1;
	if (i >= n)
		i = n - 1;
	return sorted[i];
}

static int agree(struct run *run)
{
	if (!run->chains)
		return 0;
	return replay_agree(run->sim, run->ops, run->ps, &run->map, run->cfg->n_ranks, run->res);
}

/* ---------------------------------------------------------------- submission */

static int want_tokens(struct run *run, size_t n)
{
	if (n <= run->tok_cap)
		return 0;
	uint32_t *nt = realloc(run->tok, n * sizeof(*nt));
	if (!nt)
		return KVR_ENOMEM;
	run->tok = nt;
	run->tok_cap = n;
	return 0;
}

/* Submits routed request i to its rank at the simulator's current time (prompt in run->tok). */
static int submit(struct run *run, size_t i)
{
	struct rq *q = &run->rq[i];
	struct sim_request sr = {.id = i,
	                         .user = q,
	                         .prompt = run->tok,
	                         .prompt_len = q->tr->input_len,
	                         .output_len = q->tr->output_len};
	int rc = sim_cluster_submit(run->sim, q->rank, &sr);
	if (rc == KVR_ERANGE || rc == KVR_EINVAL) {
		/* Not for a request too large for a rank (refused before routing): the router
		 * keeps an aborted request's prompt blocks as cached, which the engine never
		 * held, and no lifecycle call takes them back. */
		run->res->n_refused++;
		void *ps;
		const struct replay_policy_ops *o = owner_of(run, q, &ps);
		if (!q->around)
			run->res->n_refused_routed++;
		if (o && o->aborted)
			perr(run, o->aborted(ps, q->handle));
		return 0;
	}
	return rc;
}

/* Submits every held request the policy's queue admitted since the last call, now. */
static int release_held(struct run *run, char *err, size_t errlen)
{
	while (run->n_held) {
		uint64_t id = 0;
		struct replay_route_out ro = {0};
		int rc = run->ops->dequeue(run->ps, &id, &ro);
		if (rc == 0)
			return 0;
		if (rc > 0 && (id >= run->t->n || run->rq[id].routed || !run->rq[id].tr ||
		               ro.rank >= run->cfg->n_ranks))
			rc = KVR_ERANGE;
		if (rc < 0) {
			snprintf(err, errlen, "policy %s: dequeue: %s", run->ops->name,
			         kvr_strerror(rc));
			return rc;
		}
		struct rq *q = &run->rq[id];
		q->rank = ro.rank;
		q->predicted = ro.predicted_blocks;
		q->handle = ro.handle;
		q->routed = true;
		run->n_held--;
		if ((rc = want_tokens(run, q->tr->input_len))) {
			snprintf(err, errlen, "out of memory");
			return rc;
		}
		trace_tokens(run->t, q->tr, run->tok);
		if ((rc = submit(run, (size_t)id))) {
			snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
			return rc;
		}
	}
	return 0;
}

/* Runs the cluster up to t_ns.  While the policy holds requests in its queue, one step boundary
 * at a time, so that each is submitted at the instant the router admits it. */
static int advance(struct run *run, uint64_t t_ns, char *err, size_t errlen)
{
	int rc;
	while (run->n_held && sim_cluster_next_time(run->sim) < t_ns) {
		if ((rc = sim_cluster_step(run->sim))) {
			snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
			return rc;
		}
		if ((rc = release_held(run, err, errlen)))
			return rc;
	}
	if ((rc = sim_cluster_run_until(run->sim, t_ns))) {
		snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
		return rc;
	}
	return 0;
}

/* Runs until every request, held ones included, has finished. */
static int drain_all(struct run *run, char *err, size_t errlen)
{
	int rc;
	while (run->n_held) {
		rc = sim_cluster_step(run->sim);
		if (rc == KVR_ENOENT) { /* every rank idle: the router must admit now */
			size_t before = run->n_held;
			if (run->ops->sync &&
			    (rc = run->ops->sync(run->ps, sim_cluster_now(run->sim)))) {
				snprintf(err, errlen, "policy %s: sync: %s", run->ops->name,
				         kvr_strerror(rc));
				return rc;
			}
			if ((rc = release_held(run, err, errlen)))
				return rc;
			if (run->n_held == before) {
				snprintf(err, errlen,
				         "policy %s: %zu requests stay queued with every rank idle",
				         run->ops->name, run->n_held);
				return KVR_EAGAIN;
			}
			continue;
		}
		if (rc) {
			snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
			return rc;
		}
		if ((rc = release_held(run, err, errlen)))
			return rc;
	}
	if ((rc = sim_cluster_drain(run->sim))) {
		snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
		return rc;
	}
	return 0;
}

static bool over_max_model_len(const struct replay_config *cfg, const struct trace_req *tr)
{
	return cfg->max_model_len &&
	       (uint64_t)tr->input_len + tr->output_len > (uint64_t)cfg->max_model_len;
}

/* The engine configuration replay_run gives every rank (ops: the policy, for its events). */
static void engine_config(const struct replay_config *cfg, bool events,
                          struct sim_cluster_config *scfg)
{
	sim_cluster_config_init(scfg);
	scfg->n_ranks = cfg->n_ranks;
	scfg->engine.n_blocks = cfg->blocks_per_rank;
	scfg->engine.block_size = cfg->block_size;
	scfg->engine.max_batched_tokens = cfg->max_batched_tokens;
	scfg->engine.step_base_ns = cfg->step_base_ns;
	scfg->engine.step_per_token_ns = cfg->step_per_token_ns;
	scfg->engine.step_per_kv_block_ns = cfg->step_per_kv_block_ns;
	scfg->engine.dedup_events = events;
	scfg->engine.free_tail_first = cfg->free_tail_first;
	scfg->engine.seed = cfg->seed;
}

int replay_reuse_ceiling(const struct trace *t, const struct replay_config *cfg,
                         struct replay_ceiling *out)
{
	memset(out, 0, sizeof(*out));
	struct sim_cluster_config scfg;
	engine_config(cfg, false, &scfg);
	uint32_t bs = cfg->block_size;
	struct replay_chains seen = {0};
	uint32_t *tok = NULL;
	uint64_t *hl = NULL, *hs = NULL;
	size_t tcap = 0, hcap = 0;
	int rc = 0;
	for (size_t i = 0; i < t->n && !rc; i++) {
		const struct trace_req *tr = &t->reqs[i];
		if (over_max_model_len(cfg, tr) ||
		    !sim_engine_fits(&scfg.engine, tr->input_len, tr->output_len))
			continue;
		size_t nb = tr->input_len / bs;
		if (tr->input_len > tcap) {
			uint32_t *a = realloc(tok, tr->input_len * sizeof(*a));
			if (!a) {
				rc = KVR_ENOMEM;
				break;
			}
			tok = a;
			tcap = tr->input_len;
		}
		if (nb > hcap) {
			uint64_t *a = realloc(hl, nb * sizeof(*a)), *b;
			if (a)
				hl = a;
			b = a ? realloc(hs, nb * sizeof(*b)) : NULL;
			if (!b) {
				rc = KVR_ENOMEM;
				break;
			}
			hs = b;
			hcap = nb;
		}
		trace_tokens(t, tr, tok);
		if (nb)
			kvr_hash_blocks(tok, tr->input_len, bs, NULL, hl, hs);
		/* As the engine: at most (prompt - 1) / bs blocks hit, a prefix. */
		size_t max_hit = (tr->input_len - 1) / bs, hit = 0;
		while (hit < max_hit && hit < nb && replay_chains_get(&seen, hs[hit]))
			hit++;
		for (size_t b = 0; b < nb && !rc; b++)
			rc = replay_chains_put(&seen, hs[b], 0, 0);
		out->n_requests++;
		out->prompt_tokens += tr->input_len;
		out->hit_tokens += (uint64_t)hit * bs;
		out->prompt_blocks += nb; /* full blocks, as the engine counts */
		out->hit_blocks += hit;
	}
	replay_chains_free(&seen);
	free(tok);
	free(hl);
	free(hs);
	return rc;
}

void replay_config_init(struct replay_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->n_ranks = 8;
	cfg->block_size = 16;
	cfg->max_batched_tokens = 8192;
	cfg->step_base_ns = 5e6;
	cfg->step_per_token_ns = 5e4;
	cfg->step_per_kv_block_ns = 0;
	cfg->time_scale = 1.0;
	cfg->seed = 1;
	cfg->n_buckets = 40;
	cfg->output_every = 1;
	cfg->overlap_credit = cfg->temperature = cfg->ttl_s = cfg->queue_threshold = NAN;
	cfg->prefill_load_scale = NAN;
	cfg->capacity_factor = 1.0;
}

bool replay_samples_agreement(const struct replay_policy_ops *ops, const struct replay_config *cfg)
{
	return ops->sampled || cfg->serial;
}

uint32_t replay_default_blocks(const struct trace *t, const struct replay_config *cfg, char *why,
                               size_t whylen)
{
	const double window_s = 300;
	uint32_t bs = cfg->block_size ? cfg->block_size : 16, tbs = t->block_size;
	double scale = cfg->time_scale > 0 ? cfg->time_scale : 1;
	/* seq = prefix hash of trace ids, parent = the window it was last counted in + 1. */
	struct replay_chains seen = {0};
	uint64_t longest = 0, cur = 0, busiest = 0, win = 0;
	for (size_t i = 0; i < t->n; i++) {
		const struct trace_req *r = &t->reqs[i];
		uint64_t need = ((uint64_t)r->input_len + r->output_len + bs - 1) / bs;
		if (need > longest)
			longest = need;
		uint64_t w = (uint64_t)(r->arrival_s * scale / window_s) + 1;
		if (w != win) {
			busiest = cur > busiest ? cur : busiest;
			cur = 0;
			win = w;
		}
		uint64_t h = 0x243f6a8885a308d3ull;
		for (uint32_t k = 0; k < r->n_ids; k++) {
			h = (h ^ r->ids[k]) * 0x100000001b3ull;
			h ^= h >> 29;
			struct replay_chain_ent *e = replay_chains_get(&seen, h);
			if (e && e->parent == w)
				continue;
			cur++;
			if (e)
				e->parent = w;
			else if (replay_chains_put(&seen, h, w, 0))
				break;
		}
	}
	busiest = cur > busiest ? cur : busiest;
	replay_chains_free(&seen);
	uint64_t ws = busiest * (tbs / bs ? tbs / bs : 1);
	uint32_t nr = cfg->n_ranks ? cfg->n_ranks : 1;
	uint64_t quarter = ws / 4 / nr, floor = 2 * longest, b = quarter > floor ? quarter : floor;
	if (b < 64)
		b = 64;
	if (b > UINT32_MAX)
		b = UINT32_MAX;
	if (why)
		snprintf(why, whylen,
		         "%llu = max(a quarter of the working set over %u ranks = %llu, twice the "
		         "longest request = %llu); working set = %llu distinct prompt blocks asked "
		         "for in the busiest %.0f s of the trace",
		         (unsigned long long)b, nr, (unsigned long long)quarter,
		         (unsigned long long)floor, (unsigned long long)ws, window_s);
	return (uint32_t)b;
}

/* The foreign-share draw of request i: a function of (seed, i) only, so every policy and mode
 * marks the same arrivals (bits 11.. the share test, bits 7.. a client's rank). */
static uint64_t foreign_draw(uint64_t seed, size_t i)
{
	uint64_t x = (seed ^ 0xF0F0F0F0ull) + (uint64_t)i * 0x9E3779B97F4A7C15ull;
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
	x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
	return x ^ (x >> 31);
}

static double now_s(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int replay_run(const struct trace *t, const struct replay_policy_ops *ops,
               const struct replay_config *cfg, struct replay_result *res, char *err, size_t errlen)
{
	memset(res, 0, sizeof(*res));
	if (!t || !ops || !cfg || cfg->n_ranks == 0 || cfg->block_size == 0 ||
	    cfg->blocks_per_rank == 0 || !(cfg->time_scale > 0) || cfg->n_buckets == 0 ||
	    !(cfg->capacity_factor > 0)) {
		snprintf(err, errlen, "bad replay configuration");
		return KVR_EINVAL;
	}
	double wall0 = now_s(CLOCK_MONOTONIC);
	snprintf(res->policy, sizeof(res->policy), "%s", ops->name);
	res->predicts = ops->predicts;
	res->n_requests = t->n;
	res->jaccard_min = 1.0;
	res->n_buckets = cfg->n_buckets;
	double last_arr = t->n ? t->reqs[t->n - 1].arrival_s * cfg->time_scale : 0;
	/* Arrivals are 64-bit nanoseconds of virtual time: a time scale of 1e308 put every one at
	 * the same saturated instant. */
	if (!(last_arr <= 3.2e9)) {
		snprintf(err, errlen,
		         "bad replay configuration: the last arrival at time scale %g is %.3g s, "
		         "over 100 years of virtual time",
		         cfg->time_scale, last_arr);
		return KVR_EINVAL;
	}
	res->bucket_s = last_arr > 0 ? last_arr / (double)cfg->n_buckets * 1.0001 : 1.0;
	res->bucket_prompt = calloc(cfg->n_buckets, sizeof(uint64_t));
	res->bucket_hit = calloc(cfg->n_buckets, sizeof(uint64_t));
	res->ttft_ms = calloc(t->n + 1, sizeof(double));
	res->adm_s = calloc(t->n + 1, sizeof(double));
	res->adm_prompt = calloc(t->n + 1, sizeof(uint32_t));
	res->adm_hit = calloc(t->n + 1, sizeof(uint32_t));

	struct run run = {.cfg = cfg, .ops = ops, .res = res};
	run.e2e_ms = calloc(t->n + 1, sizeof(double));
	run.rq = calloc(t->n + 1, sizeof(*run.rq));
	run.out_chunk = cfg->block_size * (cfg->output_every ? cfg->output_every : 1);
	size_t per = (size_t)run.out_chunk + cfg->block_size;
	run.bufs = calloc((t->n + 1) * per, sizeof(uint32_t));
	double *cpu_ns = calloc(t->n + 1, sizeof(double));
	int rc = KVR_ENOMEM;
	if (!res->bucket_prompt || !res->bucket_hit || !res->ttft_ms || !res->adm_s ||
	    !res->adm_prompt || !res->adm_hit || !run.e2e_ms || !run.rq || !run.bufs || !cpu_ns) {
		snprintf(err, errlen, "out of memory");
		goto out;
	}
	run.chains = (cfg->sample_every > 0 || cfg->serial) && ops->predict && ops->resident;

	struct sim_cluster_config scfg;
	engine_config(cfg, ops->wants_events, &scfg);
	struct sim_callbacks cb = {.ctx = &run,
	                           .kv_event = on_kv_event,
	                           .admitted = on_admitted,
	                           .first_token = on_first_token,
	                           .finished = on_finished,
	                           .output_token = on_output_token};
	if (!(sim_engine_longest_step_ns(&scfg.engine) <= SIM_STEP_MAX_NS)) {
		snprintf(
		    err, errlen,
		    "simulator: the longest engine step (step base + per token x %u tokens + per "
		    "KV block x %u blocks) is %.3g s, over an hour of virtual time",
		    scfg.engine.max_batched_tokens, scfg.engine.n_blocks,
		    sim_engine_longest_step_ns(&scfg.engine) / 1e9);
		goto out;
	}
	rc = sim_cluster_create(&scfg, &cb, &run.sim);
	if (rc) {
		snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
		goto out;
	}
	struct replay_env env = {.n_ranks = cfg->n_ranks,
	                         .block_size = cfg->block_size,
	                         .blocks_per_rank = cfg->blocks_per_rank,
	                         .max_batched_tokens = cfg->max_batched_tokens,
	                         .seed = cfg->seed,
	                         .now_ns = sim_clock,
	                         .clock_ctx = run.sim,
	                         .overlap_credit = cfg->overlap_credit,
	                         .temperature = cfg->temperature,
	                         .ttl_s = cfg->ttl_s,
	                         .queue_threshold = cfg->queue_threshold,
	                         .prefill_load_scale = cfg->prefill_load_scale,
	                         .capacity_factor = cfg->capacity_factor,
	                         .free_tail_first = cfg->free_tail_first};
	run.t = t;
	run.cpu_ns = cpu_ns;
	rc = ops->create(&env, &run.ps);
	if (rc) {
		snprintf(err, errlen, "policy %s: create: %s", ops->name, kvr_strerror(rc));
		goto out;
	}
	if (cfg->foreign_share > 0 && cfg->foreign_as == REPLAY_FOREIGN_ROUTER) {
		/* The other router: its own state, the right capacity, no queue, no events. */
		struct replay_env fenv = env;
		fenv.seed = cfg->seed + 1;
		fenv.capacity_factor = 1.0;
		fenv.queue_threshold = NAN;
		run.fops = cfg->foreign_ops;
		rc = run.fops && !run.fops->wants_events ? run.fops->create(&fenv, &run.fps)
		                                         : KVR_EINVAL;
		if (rc) {
			snprintf(err, errlen, "foreign router: create: %s", kvr_strerror(rc));
			run.fops = NULL;
			goto out;
		}
	}

	for (size_t i = 0; i < t->n; i++) {
		const struct trace_req *tr = &t->reqs[i];
		struct rq *q = &run.rq[i];
		*q = (struct rq){.run = &run,
		                 .tr = tr,
		                 .buf = run.bufs + i * per,
		                 .ctail = run.bufs + i * per + run.out_chunk};
		q->out_len = tr->output_len ? tr->output_len : 1;
		uint64_t at = (uint64_t)llround(tr->arrival_s * cfg->time_scale * 1e9);
		if (cfg->serial && (rc = drain_all(&run, err, errlen)))
			goto out;
		if (at < sim_cluster_now(run.sim))
			at = sim_cluster_now(run.sim);
		if (i == 0)
			run.first_arrival = at;
		q->arrival_ns = at;
		if ((rc = advance(&run, at, err, errlen)))
			goto out;
		if (run.fops && run.fops->sync && (rc = run.fops->sync(run.fps, at))) {
			snprintf(err, errlen, "foreign router: sync: %s", kvr_strerror(rc));
			goto out;
		}
		if (ops->sync) {
			rc = ops->sync(run.ps, at);
			if (rc) {
				snprintf(err, errlen, "policy %s: sync: %s", ops->name,
				         kvr_strerror(rc));
				goto out;
			}
			if ((rc = release_held(&run, err, errlen)))
				goto out;
		}
		/* Concurrent sample: before routing, when router and engines have seen the same
		 * arrivals (after it, the router would be one admission ahead of the engine). */
		if (run.chains && !cfg->serial && i > 0 && i % cfg->sample_every == 0) {
			rc = agree(&run);
			if (rc) {
				snprintf(err, errlen, "policy %s: agreement: %s", ops->name,
				         kvr_strerror(rc));
				goto out;
			}
		}
		if ((rc = want_tokens(&run, tr->input_len))) {
			snprintf(err, errlen, "out of memory");
			goto out;
		}
		uint32_t *tok = run.tok;
		trace_tokens(t, tr, tok);
		if (run.chains) {
			record_blocks(&run, q, tok, tr->input_len);
			q->nctail = tr->input_len % cfg->block_size;
			memcpy(q->ctail, tok + tr->input_len - q->nctail, q->nctail * sizeof(*tok));
		}
		struct replay_route_req rq = {.id = i,
		                              .tokens = tok,
		                              .n_tokens = tr->input_len,
		                              .output_len = tr->output_len,
		                              .now_ns = at,
		                              .session = tr->session};
		struct replay_route_out ro = {0};
		/* A request no rank can ever hold, or one over --max-model-len, is refused before
		 * routing, as vLLM's API server refuses a prompt + max_tokens over max_model_len
		 * (which defaults to the model's context length: vLLM does not size it to the KV
		 * cache, it only refuses to start when one max_model_len request would not fit):
		 * routed and aborted, its prompt stayed in the router's predicted cache (nothing in
		 * the library takes back an admitted request's blocks: kvr_request_cached with 0
		 * and kvr_rank_observe evict the oldest blocks, these are the newest), so the
		 * prediction diverged from the engines' for good (--serial, 2 ranks x 4,000 blocks,
		 * the sample's first 150 requests: 265 of 300 sets equal, 5 refused). */
		if (over_max_model_len(cfg, tr) ||
		    !sim_engine_fits(&scfg.engine, tr->input_len, tr->output_len)) {
			res->n_refused++;
			res->n_refused_len += over_max_model_len(cfg, tr);
			if (cfg->progress)
				cfg->progress(cfg->progress_ctx, i + 1, t->n);
			continue;
		}
		/* Foreign traffic: this arrival goes around the policy (unless foreign_as is SELF).
		 * Drawn after the refusal, so that a refused arrival counts in n_refused alone: one
		 * in the foreign share counted in n_foreign too, and requests - foreign - refused
		 * (this router's decisions) came out short by those (Mooncake sample, 300 requests,
		 * 1,200 blocks per rank, 30 % foreign: 153 where approx_lru made 168). */
		uint64_t x = foreign_draw(cfg->seed, i);
		if (cfg->foreign_share > 0 &&
		    (double)(x >> 11) / 9007199254740992.0 < cfg->foreign_share) {
			q->foreign = true;
			res->n_foreign++;
		}
		if (q->foreign && cfg->foreign_as != REPLAY_FOREIGN_SELF) {
			q->around = true;
			q->rank = (uint32_t)((x >> 7) % cfg->n_ranks);
			if (run.fops) {
				rc = run.fops->route(run.fps, &rq, &ro);
				if (rc || ro.queued || ro.rank >= cfg->n_ranks) {
					snprintf(err, errlen,
					         "foreign router: route request %zu: %s", i,
					         rc ? kvr_strerror(rc) : "queued or out of range");
					rc = rc ? rc : KVR_ERANGE;
					goto out;
				}
				q->rank = ro.rank;
				q->handle = ro.handle;
			}
			q->routed = true;
			if ((rc = submit(&run, i)))
				goto sim_err;
			if (cfg->progress)
				cfg->progress(cfg->progress_ctx, i + 1, t->n);
			continue;
		}
		if ((rc = hash_floor(&run, tok, tr->input_len))) {
			snprintf(err, errlen, "out of memory");
			goto out;
		}
		if (cfg->path_runs && ops->path_runs) {
			const size_t pr =
			    ops->path_runs(run.ps, run.hs, tr->input_len / cfg->block_size);
			res->path_runs_mean += (double)pr;
			res->path_runs_max = pr > res->path_runs_max ? pr : res->path_runs_max;
			res->path_runs_n++;
		}
		double c0 = now_s(CLOCK_THREAD_CPUTIME_ID);
		rc = ops->route(run.ps, &rq, &ro);
		/* One entry per decision: foreign arrivals make none (they once counted 0 in the
		 * mean and p99, which divided by every arrival). */
		cpu_ns[run.n_routes++] = (now_s(CLOCK_THREAD_CPUTIME_ID) - c0) * 1e9;
		if (rc || (ro.queued && !ops->dequeue) || (!ro.queued && ro.rank >= cfg->n_ranks)) {
			snprintf(err, errlen, "policy %s: route request %zu: %s", ops->name, i,
			         rc ? kvr_strerror(rc) : "rank out of range");
			rc = rc ? rc : KVR_ERANGE;
			goto out;
		}
		if (ro.queued) {
			res->n_queued++;
			run.n_held++;
		} else {
			q->rank = ro.rank;
			q->predicted = ro.predicted_blocks;
			q->handle = ro.handle;
			q->routed = true;
			uint64_t chosen = 0, best = 0;
			if (!q->foreign &&
			    (rc = replay_reach(run.sim, cfg->n_ranks, tok, tr->input_len,
			                       cfg->block_size, q->rank, &chosen, &best)))
				goto sim_err;
			res->reach_chosen_blocks += chosen;
			res->reach_best_blocks += best;
			if (cfg->decisions && !q->foreign && ops->predicts &&
			    (rc = replay_decisions_route(
			         cfg->decisions, ops, run.ps, run.sim, cfg->n_ranks, cfg->seed, i,
			         q->rank, q->predicted, tok, tr->input_len, cfg->block_size)))
				goto sim_err;
			rc = submit(&run, i);
			if (rc)
				goto sim_err;
		}
		/* Routing pumps the router's queue first: those it admitted go now too. */
		if ((rc = release_held(&run, err, errlen)))
			goto out;
		if (cfg->serial && (rc = drain_all(&run, err, errlen)))
			goto out;
		if (run.chains && cfg->serial) {
			rc = agree(&run);
			if (rc) {
				snprintf(err, errlen, "policy %s: agreement: %s", ops->name,
				         kvr_strerror(rc));
				goto out;
			}
		}
		if (cfg->progress)
			cfg->progress(cfg->progress_ctx, i + 1, t->n);
	}
	if ((rc = drain_all(&run, err, errlen)))
		goto out;
	if (run.oom) {
		rc = KVR_ENOMEM;
		snprintf(err, errlen, "out of memory (chains)");
		goto out;
	}

	/* Totals. */
	double busy_max = 0, busy_sum = 0, tok_max = 0, tok_sum = 0;
	for (uint32_t r = 0; r < cfg->n_ranks; r++) {
		struct sim_engine_stats st;
		sim_cluster_stats(run.sim, r, &st);
		res->prompt_blocks += st.prompt_blocks;
		res->hit_blocks += st.hit_blocks;
		res->preemptions += st.preemptions;
		res->evicted_blocks += st.evicted_blocks;
		busy_sum += (double)st.busy_ns;
		tok_sum += (double)st.tokens;
		if ((double)st.busy_ns > busy_max)
			busy_max = (double)st.busy_ns;
		if ((double)st.tokens > tok_max)
			tok_max = (double)st.tokens;
	}
	res->hit_rate =
	    res->prompt_blocks ? (double)res->hit_blocks / (double)res->prompt_blocks : 0;
	res->own_hit_rate = res->share_prompt_blocks[0] ? (double)res->share_hit_blocks[0] /
	                                                      (double)res->share_prompt_blocks[0]
	                                                : 0;
	res->imbalance_busy = busy_sum > 0 ? busy_max * cfg->n_ranks / busy_sum : 0;
	res->imbalance_tokens = tok_sum > 0 ? tok_max * cfg->n_ranks / tok_sum : 0;
	if (res->n_pred)
		res->mae_blocks /= (double)res->n_pred;
	if (res->agree_samples)
		res->jaccard_mean /= (double)res->agree_samples;
	qsort(res->ttft_ms, res->n_ttft, sizeof(double), cmp_double);
	qsort(run.e2e_ms, run.n_e2e, sizeof(double), cmp_double);
	res->ttft_p50_ms = pct(res->ttft_ms, res->n_ttft, 0.50);
	res->ttft_p99_ms = pct(res->ttft_ms, res->n_ttft, 0.99);
	res->e2e_p50_ms = pct(run.e2e_ms, run.n_e2e, 0.50);
	res->e2e_p99_ms = pct(run.e2e_ms, run.n_e2e, 0.99);
	res->makespan_s = (double)(run.last_finish - run.first_arrival) / 1e9;
	res->throughput_tok_s = res->makespan_s > 0 ? (double)run.tokens_done / res->makespan_s : 0;
	double cpu_sum = 0;
	for (size_t i = 0; i < run.n_routes; i++)
		cpu_sum += cpu_ns[i];
	res->route_cpu_ns_mean = run.n_routes ? cpu_sum / (double)run.n_routes : 0;
	double per_route = run.n_routes ? 1.0 / (double)run.n_routes : 0;
	res->hash_cpu_ns_mean = run.hash_ns * per_route;
	if (res->path_runs_n)
		res->path_runs_mean /= (double)res->path_runs_n;
	if (ops->cpu) {
		struct replay_cpu c = {0};
		ops->cpu(run.ps, &c);
		res->has_cpu = true;
		res->happen_cpu_ns_mean = (double)c.happenings_ns * per_route;
		res->happenings_mean = (double)c.happenings * per_route;
		res->verify_ns_mean = (double)c.verify_ns * per_route;
		res->suffix_ns_mean = (double)c.suffix_ns * per_route;
		res->kept_share = c.all_blocks ? (double)c.kept_blocks / (double)c.all_blocks : 0;
		for (int k = 0; k < 4; k++)
			res->stage_ns_mean[k] =
			    c.stage_n[k] ? (double)c.stage_ns[k] / (double)c.stage_n[k] : 0;
		res->threads_busy_ns_mean = (double)c.threads_busy_ns * per_route;
		res->threads_spin_ns_mean = (double)c.threads_spin_ns * per_route;
	}
	qsort(cpu_ns, run.n_routes, sizeof(double), cmp_double);
	res->route_cpu_ns_p99 = pct(cpu_ns, run.n_routes, 0.99);
	rc = 0;
	goto out;
sim_err:
	snprintf(err, errlen, "simulator: %s", kvr_strerror(rc));
out:
	if (run.ps)
		ops->destroy(run.ps);
	if (run.fps)
		run.fops->destroy(run.fps);
	sim_cluster_destroy(run.sim);
	replay_chains_free(&run.map);
	free(run.e2e_ms);
	free(run.rq);
	free(run.bufs);
	free(cpu_ns);
	free(run.tok);
	free(run.hl);
	free(run.hs);
	res->wall_s = now_s(CLOCK_MONOTONIC) - wall0;
	if (rc)
		replay_result_free(res);
	return rc;
}

void replay_result_free(struct replay_result *res)
{
	if (!res)
		return;
	free(res->bucket_prompt);
	free(res->bucket_hit);
	free(res->ttft_ms);
	free(res->adm_s);
	free(res->adm_prompt);
	free(res->adm_hit);
	res->bucket_prompt = res->bucket_hit = NULL;
	res->ttft_ms = NULL;
	res->adm_s = NULL;
	res->adm_prompt = res->adm_hit = NULL;
}
