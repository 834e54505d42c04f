/*
 * tools/sim/engine.c - one vLLM v1 rank in virtual time: the scheduler (vllm/v1/core/sched/
 * scheduler.py) and KV cache manager (kv_cache_manager.py, single_type_kv_cache_manager.py)
 * over the block pool of tools/sim/block_pool.c, re-implemented from their behaviour.
 *
 * The step.  schedule() runs at a step boundary, exactly as vLLM's schedule():
 *  1. running requests, oldest admission first: each asks for its remaining tokens (decode: 1;
 *     an unfinished prefill: the rest of it), capped by the step's token budget; its new blocks
 *     come from the pool; if the pool is short, the NEWEST running request is preempted (blocks
 *     freed tail first, computed tokens forgotten, put back at the FRONT of the waiting queue)
 *     and the allocation is retried; if the request preempts itself, the loop stops.
 *  2. only if nothing was preempted: waiting requests, FCFS, while budget and max_num_seqs
 *     allow: a request with no computed tokens looks up its longest cached prefix (capped so at
 *     least the last token is recomputed, vLLM's num_tokens - 1 rule), asks for the rest
 *     (chunked to the budget), and is admitted only if new blocks + hit blocks that are still
 *     in the free queue fit in the free queue (vLLM counts evictable hits against the
 *     allocation); otherwise admission stops (head-of-line, as vLLM's FCFS).
 *  After allocation, every block now fully covered by computed + scheduled tokens gets its
 *  hash cached (vLLM caches at schedule time, in allocate_slots), emitting BlockStored with
 *  the parent hash; blocks evicted from the free-queue head emit BlockRemoved first.
 * The step then lasts a + b * scheduled tokens.  At its end, every scheduled request adds its
 * tokens to num_computed; one that has caught up with its sequence samples one output token
 * (the first one is its TTFT), which may complete a block (hashed by chaining onto the previous
 * block with kvr_hash_extend) to be cached by the next schedule.  A request that has all its
 * output tokens finishes: its blocks are freed in reverse order (tail first).
 *
 * Invariants: running holds at most max_num_seqs requests in admission order; a waiting
 * request holds no blocks and has num_computed == 0; r->n_cached <= r->n_blocks and
 * r->n_cached <= r->n_hashes; a step is in flight iff state == BUSY.
 *
 * Simplified against vLLM: no long_prefill_token_threshold, no speculative decoding, no
 * priority scheduling, no structured output / encoder inputs, no async scheduling (the next
 * schedule waits for the step to end), no KV connector, no max_model_len check beyond "fits
 * in the pool" (the frontend's: kvr-replay --max-model-len); events are delivered synchronously
 * when vLLM would queue them (at schedule time), not batched per step; token ids are not carried in
 * events; the step time is linear in scheduled tokens (real kernels are not: attention grows with
 * context).
 */
#include "tools/sim/engine.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "tools/sim/block_pool.h"

enum state { IDLE, DUE, BUSY };

struct req {
	uint64_t id;
	void *user;
	uint64_t arrival_ns, admit_ns, first_token_ns;
	uint32_t prompt_len, output_len, n_out;
	uint32_t num_computed; /* tokens whose KV is computed (or scheduled this step) */
	uint32_t sched;        /* tokens scheduled in the step in flight */
	uint32_t n_hashes;     /* full blocks of the known sequence, hashed */
	uint32_t n_blocks;     /* physical blocks held */
	uint32_t n_cached;     /* leading blocks registered in the pool's hash map */
	uint32_t tail_len;     /* tokens of the partial last block */
	uint32_t prompt_blocks, first_hit;
	uint32_t preemptions;
	bool admitted_once;
	uint64_t *seq, *local; /* n_hashes used */
	uint32_t *blocks;      /* n_blocks used */
	uint32_t *tail;        /* block_size */
	size_t mem_size;       /* of this struct plus its arrays */
};

struct sim_engine {
	struct sim_engine_config cfg;
	struct sim_callbacks cb;
	uint32_t rank;
	struct sim_pool *pool;
	enum state state;
	uint64_t now, t_next, event_id;
	struct req **waiting; /* ring */
	size_t w_head, w_len, w_cap;
	struct req **running;
	size_t n_running;
	uint64_t step_kv; /* KV blocks the step being scheduled reads */
	/* scratch, n_blocks each */
	struct sim_evicted *evicted;
	uint64_t *ev_seq, *ev_local;
	uint32_t *hits;
	struct sim_engine_stats st;
};

void sim_engine_config_init(struct sim_engine_config *cfg)
{
	if (!cfg)
		return;
	*cfg = (struct sim_engine_config){
	    .n_blocks = 8192,
	    .block_size = 16,
	    .max_batched_tokens = 8192,
	    .max_num_seqs = 256,
	    .chunked_prefill = true,
	    .step_base_ns = 5e6,
	    .step_per_token_ns = 5e4,
	    .step_per_kv_block_ns = 0,
	    .dedup_events = false,
	    .seed = 0x73696d,
	};
}

static uint32_t num_tokens(const struct req *r)
{
	return r->prompt_len + r->n_out;
}

static uint32_t cdiv(uint64_t a, uint32_t b)
{
	return (uint32_t)((a + b - 1) / b);
}

static void req_free(struct req *r)
{
	if (r)
		kvr_free(r, r->mem_size);
}

/* ---------------------------------------------------------------- events */

static void emit(struct sim_engine *e, struct sim_kv_event *ev)
{
	ev->rank = e->rank;
	ev->time_ns = e->now;
	ev->event_id = e->event_id++;
	ev->block_size = e->cfg.block_size;
	if (e->cb.kv_event)
		e->cb.kv_event(e->cb.ctx, ev);
}

static void emit_stored(struct sim_engine *e, const struct req *r, uint32_t from, uint32_t to)
{
	struct sim_kv_event ev = {
	    .kind = SIM_EV_STORED,
	    .has_parent = from > 0,
	    .parent_seq = from > 0 ? r->seq[from - 1] : 0,
	    .n = to - from,
	    .seq = r->seq + from,
	    .local = r->local + from,
	};
	emit(e, &ev);
}

/* Allocates n blocks onto r (caller checked the free count) and reports evictions. */
static void alloc_blocks(struct sim_engine *e, struct req *r, uint32_t n)
{
	size_t ne = 0, k = 0;
	int rc = sim_pool_alloc(e->pool, n, r->blocks + r->n_blocks, e->evicted, &ne);
	assert(rc == 0);
	(void)rc;
	r->n_blocks += n;
	e->st.evicted_blocks += ne;
	for (size_t i = 0; i < ne; i++) {
		if (e->cfg.dedup_events && !e->evicted[i].last_copy)
			continue;
		e->ev_seq[k] = e->evicted[i].seq;
		e->ev_local[k] = e->evicted[i].local;
		k++;
	}
	if (k > 0) {
		struct sim_kv_event ev = {
		    .kind = SIM_EV_REMOVED, .n = k, .seq = e->ev_seq, .local = e->ev_local};
		emit(e, &ev);
	}
}

/* Caches r's blocks fully covered by its first `tokens` tokens (vLLM cache_blocks). */
static void cache_blocks(struct sim_engine *e, struct req *r, uint32_t tokens)
{
	uint32_t full = tokens / e->cfg.block_size;
	if (full > r->n_hashes)
		full = r->n_hashes;
	if (full > r->n_blocks)
		full = r->n_blocks;
	uint32_t run = UINT32_MAX;
	for (uint32_t i = r->n_cached; i < full; i++) {
		bool first = sim_pool_cache_block(e->pool, r->blocks[i], r->seq[i], r->local[i]);
		bool show = first || !e->cfg.dedup_events;
		e->st.stored_blocks++;
		if (show && run == UINT32_MAX)
			run = i;
		if (!show && run != UINT32_MAX) {
			emit_stored(e, r, run, i);
			run = UINT32_MAX;
		}
	}
	if (run != UINT32_MAX)
		emit_stored(e, r, run, full);
	if (full > r->n_cached)
		r->n_cached = full;
}

/* ---------------------------------------------------------------- queues */

static int waiting_grow(struct sim_engine *e)
{
	size_t ncap = e->w_cap ? e->w_cap * 2 : 64;
	struct req **n = kvr_alloc(ncap * sizeof(*n));
	if (!n)
		return KVR_ENOMEM;
	for (size_t i = 0; i < e->w_len; i++)
		n[i] = e->waiting[(e->w_head + i) % e->w_cap];
	kvr_free(e->waiting, e->w_cap * sizeof(*e->waiting));
	e->waiting = n;
	e->w_cap = ncap;
	e->w_head = 0;
	return 0;
}

static struct req *waiting_peek(const struct sim_engine *e)
{
	return e->w_len ? e->waiting[e->w_head] : NULL;
}

static void waiting_pop(struct sim_engine *e)
{
	e->w_head = (e->w_head + 1) % e->w_cap;
	e->w_len--;
}

/* The ring has a slot for every request the engine holds, running ones included (grown at
 * submit, the only place that number grows), so this cannot fail even when one step preempts
 * several running requests. */
static void waiting_push_front(struct sim_engine *e, struct req *r)
{
	assert(e->w_len < e->w_cap);
	e->w_head = (e->w_head + e->w_cap - 1) % e->w_cap;
	e->waiting[e->w_head] = r;
	e->w_len++;
}

/* ---------------------------------------------------------------- scheduling */

static void preempt(struct sim_engine *e, struct req *r)
{
	sim_pool_release(e->pool, r->blocks, r->n_blocks);
	r->n_blocks = 0;
	r->n_cached = 0;
	r->num_computed = 0;
	r->sched = 0;
	r->preemptions++;
	e->st.preemptions++;
	waiting_push_front(e, r);
}

/* Phase 1: running requests.  Returns tokens scheduled; *preempted set if any preemption. */
static uint32_t schedule_running(struct sim_engine *e, uint32_t budget, bool *preempted)
{
	uint32_t used = 0, bs = e->cfg.block_size;
	for (size_t i = 0; i < e->n_running && used < budget; i++) {
		struct req *r = e->running[i];
		uint32_t want = num_tokens(r) - r->num_computed;
		if (want > budget - used)
			want = budget - used;
		if (want == 0)
			continue;
		uint32_t total = r->num_computed + want;
		uint32_t need = cdiv(total, bs) > r->n_blocks ? cdiv(total, bs) - r->n_blocks : 0;
		bool ok = true;
		while (need > sim_pool_num_free(e->pool)) {
			struct req *victim = e->running[--e->n_running];
			preempt(e, victim);
			*preempted = true;
			if (victim == r) {
				ok = false;
				break;
			}
		}
		if (!ok)
			break;
		alloc_blocks(e, r, need);
		cache_blocks(e, r, total);
		if (!(r->n_out > 0 && want == 1 && total == num_tokens(r)))
			e->st.prefill_tokens += want;
		r->sched = want;
		r->num_computed = total;
		e->step_kv += cdiv(total, bs);
		used += want;
	}
	return used;
}

/* Phase 2: admissions.  Returns tokens scheduled. */
static uint32_t schedule_waiting(struct sim_engine *e, uint32_t budget)
{
	uint32_t used = 0, bs = e->cfg.block_size;
	struct req *r;
	while ((r = waiting_peek(e)) && used < budget && e->n_running < e->cfg.max_num_seqs) {
		assert(r->num_computed == 0 && r->n_blocks == 0);
		uint32_t n_tok = num_tokens(r);
		uint32_t max_hit = (n_tok - 1) / bs;
		if (max_hit > r->n_hashes)
			max_hit = r->n_hashes;
		uint32_t hits = (uint32_t)sim_pool_match_prefix(e->pool, r->seq, max_hit, e->hits);
		uint32_t want = n_tok - hits * bs;
		if (want > budget - used) {
			if (!e->cfg.chunked_prefill)
				break;
			want = budget - used;
		}
		uint32_t total = hits * bs + want;
		uint32_t need = cdiv(total, bs) - hits;
		size_t evictable = sim_pool_count_free(e->pool, e->hits, hits);
		if (need + evictable > sim_pool_num_free(e->pool))
			break;
		/* Uncapped cached prefix of the prompt, for the router's accuracy report. */
		uint32_t cached =
		    (uint32_t)sim_pool_match_prefix(e->pool, r->seq, r->prompt_blocks, NULL);
		waiting_pop(e);
		sim_pool_touch(e->pool, e->hits, hits);
		memcpy(r->blocks, e->hits, hits * sizeof(*r->blocks));
		r->n_blocks = hits;
		r->n_cached = hits;
		alloc_blocks(e, r, need);
		cache_blocks(e, r, total);
		r->num_computed = total;
		r->sched = want;
		e->step_kv += cdiv(total, bs);
		used += want;
		e->st.prefill_tokens += want;
		e->running[e->n_running++] = r;
		e->st.admitted++;
		if (!r->admitted_once) {
			r->admitted_once = true;
			r->admit_ns = e->now;
			r->first_hit = hits;
			e->st.prompt_blocks += r->prompt_blocks;
			e->st.hit_blocks += hits;
		}
		if (e->cb.admitted) {
			struct sim_admit_info info = {
			    .rank = e->rank,
			    .id = r->id,
			    .user = r->user,
			    .time_ns = e->now,
			    .prompt_blocks = r->prompt_blocks,
			    .cached_blocks = cached,
			    .hit_blocks = hits,
			    .preemptions = r->preemptions,
			};
			e->cb.admitted(e->cb.ctx, &info);
		}
	}
	return used;
}

static void schedule(struct sim_engine *e)
{
	for (;;) {
		bool preempted = false;
		e->step_kv = 0;
		uint32_t budget = e->cfg.max_batched_tokens;
		uint32_t used = schedule_running(e, budget, &preempted);
		if (!preempted)
			used += schedule_waiting(e, budget - used);
		if (used > 0) {
			double d = e->cfg.step_base_ns + e->cfg.step_per_token_ns * used +
			           e->cfg.step_per_kv_block_ns * (double)e->step_kv;
			uint64_t dns = (uint64_t)llround(d);
			if (dns == 0)
				dns = 1;
			e->state = BUSY;
			e->t_next = e->now + dns;
			e->st.steps++;
			e->st.busy_ns += dns;
			e->st.tokens += used;
			return;
		}
		/* Nothing scheduled.  After a self-preemption the waiting queue is retried at once
		 * (vLLM's busy loop calls schedule() again); running shrank, so this ends. */
		if (!(preempted && (e->n_running > 0 || e->w_len > 0))) {
			e->state = IDLE;
			e->t_next = UINT64_MAX;
			return;
		}
	}
}

static uint32_t default_token(const struct sim_engine *e, uint64_t id, uint32_t i)
{
	uint64_t x = e->cfg.seed ^ (id * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)i << 32 | i);
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return (uint32_t)x;
}

/* Samples r's next output token; hashes the block it completes, if any. */
static void append_token(struct sim_engine *e, struct req *r)
{
	uint32_t bs = e->cfg.block_size;
	uint32_t tok = e->cb.output_token ? e->cb.output_token(r->user, r->id, r->n_out)
	                                  : default_token(e, r->id, r->n_out);
	r->tail[r->tail_len++] = tok;
	r->n_out++;
	if (r->tail_len == bs) {
		size_t nb = 0;
		const uint64_t *parent = r->n_hashes ? &r->seq[r->n_hashes - 1] : NULL;
		kvr_hash_extend(parent, r->tail, bs, bs, NULL, &r->local[r->n_hashes],
		                &r->seq[r->n_hashes], &nb);
		assert(nb == 1);
		r->n_hashes++;
		r->tail_len = 0;
	}
}

static void complete_step(struct sim_engine *e)
{
	size_t keep = 0;
	for (size_t i = 0; i < e->n_running; i++) {
		struct req *r = e->running[i];
		bool done = false;
		if (r->sched > 0 && r->num_computed >= num_tokens(r)) {
			append_token(e, r);
			if (r->n_out == 1) {
				r->first_token_ns = e->now;
				if (e->cb.first_token)
					e->cb.first_token(e->cb.ctx, e->rank, r->id, r->user,
					                  e->now);
			}
			done = r->n_out >= r->output_len;
		}
		r->sched = 0;
		if (!done) {
			e->running[keep++] = r;
			continue;
		}
		sim_pool_release(e->pool, r->blocks, r->n_blocks);
		e->st.finished++;
		if (e->cb.finished) {
			struct sim_finish_info info = {
			    .rank = e->rank,
			    .id = r->id,
			    .user = r->user,
			    .arrival_ns = r->arrival_ns,
			    .admit_ns = r->admit_ns,
			    .first_token_ns = r->first_token_ns,
			    .finish_ns = e->now,
			    .prompt_len = r->prompt_len,
			    .output_len = r->output_len,
			    .prompt_blocks = r->prompt_blocks,
			    .hit_blocks = r->first_hit,
			    .preemptions = r->preemptions,
			};
			e->cb.finished(e->cb.ctx, &info);
		}
		req_free(r);
	}
	e->n_running = keep;
}

/* ---------------------------------------------------------------- public */

double sim_engine_longest_step_ns(const struct sim_engine_config *cfg)
{
	double a = cfg->step_base_ns, b = cfg->step_per_token_ns, c = cfg->step_per_kv_block_ns;
	if (!(a >= 0) || !(b >= 0) || !(c >= 0)) /* NaN or negative */
		return NAN;
	/* A step schedules at most max_batched_tokens and its requests hold at most the pool. */
	return a + b * (double)cfg->max_batched_tokens + c * (double)cfg->n_blocks;
}

int sim_engine_create(const struct sim_engine_config *cfg, uint32_t rank,
                      const struct sim_callbacks *cb, struct sim_engine **out)
{
	if (!cfg || !out || cfg->n_blocks == 0 || cfg->block_size == 0 ||
	    cfg->max_batched_tokens == 0 || cfg->max_num_seqs == 0 ||
	    !(sim_engine_longest_step_ns(cfg) <= SIM_STEP_MAX_NS))
		return KVR_EINVAL;
	struct sim_engine *e = kvr_calloc(1, sizeof(*e));
	if (!e)
		return KVR_ENOMEM;
	e->cfg = *cfg;
	if (cb)
		e->cb = *cb;
	e->rank = rank;
	e->state = IDLE;
	e->t_next = UINT64_MAX;
	size_t n = cfg->n_blocks;
	int rc = sim_pool_create(cfg->n_blocks, &e->pool);
	if (rc == 0)
		sim_pool_set_tail_first(e->pool, cfg->free_tail_first);
	e->running = kvr_alloc(cfg->max_num_seqs * sizeof(*e->running));
	e->evicted = kvr_alloc(n * sizeof(*e->evicted));
	e->ev_seq = kvr_alloc(n * sizeof(*e->ev_seq));
	e->ev_local = kvr_alloc(n * sizeof(*e->ev_local));
	e->hits = kvr_alloc(n * sizeof(*e->hits));
	if (rc == 0 && (!e->running || !e->evicted || !e->ev_seq || !e->ev_local || !e->hits ||
	                waiting_grow(e) != 0))
		rc = KVR_ENOMEM;
	if (rc != 0) {
		sim_engine_destroy(e);
		return rc;
	}
	*out = e;
	return 0;
}

void sim_engine_destroy(struct sim_engine *e)
{
	if (!e)
		return;
	for (size_t i = 0; i < e->n_running; i++)
		req_free(e->running[i]);
	for (size_t i = 0; i < e->w_len; i++)
		req_free(e->waiting[(e->w_head + i) % e->w_cap]);
	size_t n = e->cfg.n_blocks;
	kvr_free(e->waiting, e->w_cap * sizeof(*e->waiting));
	kvr_free(e->running, e->running ? e->cfg.max_num_seqs * sizeof(*e->running) : 0);
	kvr_free(e->evicted, e->evicted ? n * sizeof(*e->evicted) : 0);
	kvr_free(e->ev_seq, e->ev_seq ? n * sizeof(*e->ev_seq) : 0);
	kvr_free(e->ev_local, e->ev_local ? n * sizeof(*e->ev_local) : 0);
	kvr_free(e->hits, e->hits ? n * sizeof(*e->hits) : 0);
	sim_pool_destroy(e->pool);
	kvr_free(e, sizeof(*e));
}

bool sim_engine_fits(const struct sim_engine_config *cfg, uint32_t prompt_len, uint32_t output_len)
{
	uint32_t bs = cfg->block_size;
	uint64_t max_tok = (uint64_t)prompt_len + (output_len ? output_len : 1);
	if (max_tok > UINT32_MAX - bs)
		return false;
	/* The last output token is sampled but never computed. */
	if (cdiv(max_tok - 1, bs) > cfg->n_blocks)
		return false;
	/* Without chunked prefill a (re)computation must fit one step's budget. */
	return cfg->chunked_prefill || max_tok - 1 <= cfg->max_batched_tokens;
}

int sim_engine_submit(struct sim_engine *e, const struct sim_request *q, uint64_t now_ns)
{
	if (!e || !q || !q->prompt || q->prompt_len == 0)
		return KVR_EINVAL;
	/* Time never goes backwards, and a due step must be run before later arrivals. */
	if (now_ns < e->now || (e->state != IDLE && now_ns > e->t_next))
		return KVR_EINVAL;
	if (!sim_engine_fits(&e->cfg, q->prompt_len, q->output_len))
		return KVR_ERANGE;
	uint32_t bs = e->cfg.block_size;
	uint32_t out_len = q->output_len ? q->output_len : 1;
	uint64_t max_tok = (uint64_t)q->prompt_len + out_len;
	/* The last output token is sampled but never computed. */
	uint32_t cap_blocks = cdiv(max_tok - 1, bs);
	uint32_t cap_hashes = (uint32_t)(max_tok / bs);
	/* Room for this request and for every running one, which preemption may put back. */
	if (e->w_len + e->n_running + 1 >= e->w_cap && waiting_grow(e) != 0)
		return KVR_ENOMEM;
	size_t size =
	    sizeof(struct req) + (size_t)cap_hashes * 16 + (size_t)cap_blocks * 4 + (size_t)bs * 4;
	struct req *r = kvr_calloc(1, size);
	if (!r)
		return KVR_ENOMEM;
	r->mem_size = size;
	r->seq = (uint64_t *)(r + 1);
	r->local = r->seq + cap_hashes;
	r->blocks = (uint32_t *)(r->local + cap_hashes);
	r->tail = r->blocks + cap_blocks;
	r->id = q->id;
	r->user = q->user;
	r->arrival_ns = now_ns;
	r->prompt_len = q->prompt_len;
	r->output_len = out_len;
	r->n_hashes =
	    (uint32_t)kvr_hash_blocks(q->prompt, q->prompt_len, bs, NULL, r->local, r->seq);
	r->prompt_blocks = r->n_hashes;
	r->tail_len = q->prompt_len - r->n_hashes * bs;
	memcpy(r->tail, q->prompt + (size_t)r->n_hashes * bs, r->tail_len * sizeof(*r->tail));

	e->waiting[(e->w_head + e->w_len) % e->w_cap] = r;
	e->w_len++;
	e->st.submitted++;
	e->now = now_ns;
	if (e->state == IDLE) {
		e->state = DUE;
		e->t_next = now_ns;
	}
	return 0;
}

uint64_t sim_engine_next_time(const struct sim_engine *e)
{
	return e->state == IDLE ? UINT64_MAX : e->t_next;
}

int sim_engine_advance(struct sim_engine *e)
{
	if (!e)
		return KVR_EINVAL;
	if (e->state == IDLE)
		return KVR_ENOENT;
	e->now = e->t_next;
	if (e->state == BUSY)
		complete_step(e);
	schedule(e);
	return 0;
}

int sim_engine_reset_cache(struct sim_engine *e, uint64_t now_ns)
{
	if (!e)
		return KVR_EINVAL;
	int rc = sim_pool_reset(e->pool);
	if (rc != 0)
		return rc;
	if (now_ns > e->now)
		e->now = now_ns;
	struct sim_kv_event ev = {.kind = SIM_EV_CLEARED};
	emit(e, &ev);
	return 0;
}

size_t sim_engine_cached_hashes(const struct sim_engine *e, uint64_t *out, size_t cap)
{
	return sim_pool_cached_hashes(e->pool, out, cap);
}

bool sim_engine_is_cached(const struct sim_engine *e, uint64_t seq)
{
	return sim_pool_lookup(e->pool, seq) != SIM_NO_BLOCK;
}

void sim_engine_get_stats(const struct sim_engine *e, struct sim_engine_stats *out)
{
	*out = e->st;
	out->running = (uint32_t)e->n_running;
	out->waiting = (uint32_t)e->w_len;
	out->free_blocks = sim_pool_num_free(e->pool);
	out->cached_hashes = (uint32_t)sim_pool_num_cached(e->pool);
}

const struct sim_pool *sim_engine_pool(const struct sim_engine *e)
{
	return e->pool;
}
