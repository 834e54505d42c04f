/*
 * tools/replay/policy_router.c - the kvrouter router as a replay policy, in its three modes:
 *
 *  - events: KVR_MODE_EVENTS, fed every KV event of the simulated cluster (kvr_events_apply;
 *    the simulator runs with dedup_events = true so the router's set semantics stay exact:
 *    one stored event per hash's first copy, one removed when its last copy goes).  External
 *    hash = the simulator's sequence hash; local hashes are passed, tokens are not.  The oracle.
 *  - approx_lru: KVR_MODE_APPROX_LRU, no events; each rank's capacity = its GPU blocks, so the
 *    router's LRU mirrors the engine's pool from the request lifecycle alone (capacity_factor
 *    != 1 registers a wrong capacity on purpose, to measure what mis-registration costs).
 *  - approx_ttl: KVR_MODE_APPROX_TTL, no events, no capacity; a routed block is forgotten
 *    ttl_ns (router default, 120 s) after its last use.
 *  - approx_lru+feedback: approx_lru, and each request's cached prefix at its first admission
 *    is reported back (kvr_request_cached), so engine ground truth heals the prediction.
 *  - approx_lru+watermark: approx_lru+feedback, and at each admission the rank's oldest cached
 *    evictable block and resident block count (kvr_rank_observe, KVR_OBSERVE_WATERMARK |
 *    KVR_OBSERVE_RESIDENT).
 *
 * Rank i of the simulator is worker i, dp rank 0, incarnation 1.  One shard (n_shards = 1) for
 * determinism.  The router's clock is the simulator's virtual clock; sync() runs
 * kvr_router_sync() so TTL expiry and the lease reaper fire as virtual time advances.
 * Happenings map to the request lifecycle: first token -> kvr_request_prefill_done, output
 * tokens -> kvr_request_output, finished -> kvr_request_finish, refused -> kvr_request_abort.
 * Router settings from the environment (overlap_credit, prefill_load_scale, temperature, ttl,
 * queue_threshold)
 * override the router's defaults.  With queue_threshold > 0 a decision may be KVR_QUEUED: the
 * request is parked with its ticket, on_admit (run by the router on the thread that pumps the
 * queue, here always the replay's) moves it to a ready list, and dequeue() hands it to the
 * replay, which submits it to the engine at that instant.
 *
 * Context: single-threaded (the replay's thread); the router's shard thread runs beside it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/metrics.h"         /* kvr_route's stage histograms */
#include "core/router_internal.h" /* the shard threads, for their CPU time */
#include "kvrouter.h"
#include "tools/replay/policy.h"

/* approx_lru+chain: what the frontend keeps of a session's latest prompt, its complete blocks'
 * tokens and hashes. */
struct rp_chain {
	uint32_t *tok;
	uint64_t *local, *seq;
	size_t n_blocks, cap_blocks;
};

/* A queued request: its ticket and trace id; once admitted, the decision too. */
struct rp_queued {
	uint64_t ticket, id;
	struct kvr_decision d;
};

struct rp {
	struct replay_env env;
	struct kvr_router *r;
	struct kvr_event_block *blk; /* events: scratch for one stored event */
	size_t blk_cap;
	/* events with KVR_REPLAY_EXT_HASHES set: each rank names a block by an engine hash of its
	 * own (seq ^ a per-rank constant, as vLLM's per-process seed makes them differ), not by
	 * the sequence hash; rm is the scratch of a removed event's names */
	bool ext_hashes;
	uint64_t *rm;
	size_t rm_cap;
	/* Queue (queue_threshold > 0): waiting[] in ticket order, ready[] admitted, FIFO. */
	struct rp_queued *waiting, *ready;
	size_t n_waiting, cap_waiting, n_ready, head_ready, cap_ready;
	int queue_err;
	/* The router's clock: the simulator's virtual time as of the replay's latest call into
	 * the policy.  The replay thread stores it (tick) before each router call; shard threads
	 * read it whenever they look at the clock, so they never read the simulator itself while
	 * the replay thread advances it.  Ordering: release store in tick, acquire load in
	 * rp_clock. */
	uint64_t vnow;
	/* CPU (rp_cpu): the happenings' on this thread; the shards' during the agreement check's
	 * introspection calls (left out of the shards' figure). */
	uint64_t happen_ns, happen_n, intro_busy_ns, intro_spin_ns;
	/* approx_lru+chain: the frontend keeps each session's chain (by session id). */
	bool chain;
	struct rp_chain *chains;
	size_t n_chains;
	uint64_t verify_ns, suffix_ns, kept_blocks, all_blocks; /* summed, for rp_cpu */
};

static uint64_t thread_cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* CPU time of every shard thread so far: busy (less idle polling) and idle polling. */
static void shards_cpu(struct kvr_router *r, uint64_t *busy, uint64_t *spin)
{
	*busy = *spin = 0;
	for (uint32_t i = 0; i < kvr_shards_count(r->shards); i++) {
		struct kvr_shard_stats st;
		kvr_shard_get_stats(kvr_shards_get(r->shards, i), &st);
		*busy += st.cpu_ns > st.spin_ns ? st.cpu_ns - st.spin_ns : 0;
		*spin += st.spin_ns;
	}
}

/* A happening: a router call (expr, an int return code, which this evaluates to) whose CPU time
 * on this thread is the router's work for the decision it belongs to.  TICKED first brings the
 * router's clock to the current event (tick), as a frontend's call at that moment would see it;
 * the tick counts in the happening. */
#define HAPPEN(p, expr)                                                                            \
	({                                                                                         \
		uint64_t happen_c0_ = thread_cpu_ns();                                             \
		int happen_rc_ = (expr);                                                           \
		(p)->happen_ns += thread_cpu_ns() - happen_c0_;                                    \
		(p)->happen_n++;                                                                   \
		happen_rc_;                                                                        \
	})
#define TICKED(p, expr) HAPPEN(p, (tick(p), (expr)))

/* Brackets an introspection call of the agreement check: the shards' CPU meanwhile is the
 * check's, not routing's. */
#define INTRO_BEGIN(p)                                                                             \
	uint64_t intro_b0_, intro_s0_;                                                             \
	shards_cpu((p)->r, &intro_b0_, &intro_s0_)
#define INTRO_END(p)                                                                               \
	do {                                                                                       \
		uint64_t b1_, s1_;                                                                 \
		shards_cpu((p)->r, &b1_, &s1_);                                                    \
		(p)->intro_busy_ns += b1_ - intro_b0_;                                             \
		(p)->intro_spin_ns += s1_ - intro_s0_;                                             \
	} while (0)

static void rp_cpu(void *state, struct replay_cpu *out)
{
	struct rp *p = state;
	uint64_t busy, spin;
	shards_cpu(p->r, &busy, &spin);
	out->happenings_ns = p->happen_ns;
	out->happenings = p->happen_n;
	out->threads_busy_ns = busy > p->intro_busy_ns ? busy - p->intro_busy_ns : 0;
	out->threads_spin_ns = spin > p->intro_spin_ns ? spin - p->intro_spin_ns : 0;
	out->verify_ns = p->verify_ns;
	out->suffix_ns = p->suffix_ns;
	out->kept_blocks = p->kept_blocks;
	out->all_blocks = p->all_blocks;
	static const enum kvr_hist stage[4] = {KVR_H_HASH_NS, KVR_H_MATCH_NS, KVR_H_SELECT_NS,
	                                       KVR_H_ADMIT_NS};
	for (int k = 0; k < 4; k++) {
		uint64_t h[KVR_HIST_BUCKETS], n = 0;
		kvr_metrics_hist(p->r->metrics, stage[k], h, &out->stage_ns[k]);
		for (int b = 0; b < KVR_HIST_BUCKETS; b++)
			n += h[b];
		out->stage_n[k] = n;
	}
}

/* --path-runs: the runs the chain's walk crosses in the router's index (the router hashes the
 * prompt as kvr_hash_blocks does, without a LoRA seed). */
static size_t rp_path_runs(void *state, const uint64_t *seq, size_t n)
{
	struct rp *p = state;
	kvr_rcu_read_lock();
	size_t runs = kvr_index_path_runs(p->r->index, seq, n);
	kvr_rcu_read_unlock();
	return runs;
}

static uint64_t rp_clock(void *ctx)
{
	struct rp *p = ctx;
	return __atomic_load_n(&p->vnow, __ATOMIC_ACQUIRE);
}

static void tick(struct rp *p)
{
	__atomic_store_n(&p->vnow, p->env.now_ns(p->env.clock_ctx), __ATOMIC_RELEASE);
}

static int push(struct rp_queued **a, size_t *n, size_t *cap, const struct rp_queued *e)
{
	if (*n == *cap) {
		size_t nc = *cap ? *cap * 2 : 64;
		struct rp_queued *na = realloc(*a, nc * sizeof(*na));
		if (!na)
			return KVR_ENOMEM;
		*a = na;
		*cap = nc;
	}
	(*a)[(*n)++] = *e;
	return 0;
}

/* on_admit: the router runs it on the thread that pumps the queue, which in the replay is the
 * replay's own thread (inside route, finish, prefill_done or sync). */
static void rp_on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	struct rp *p = ctx;
	for (size_t i = 0; i < p->n_waiting; i++) {
		if (p->waiting[i].ticket != ticket)
			continue;
		struct rp_queued e = p->waiting[i];
		e.d = *d;
		memmove(p->waiting + i, p->waiting + i + 1,
		        (p->n_waiting - i - 1) * sizeof(*p->waiting));
		p->n_waiting--;
		if (p->head_ready == p->n_ready)
			p->head_ready = p->n_ready = 0;
		int rc = push(&p->ready, &p->n_ready, &p->cap_ready, &e);
		if (rc && !p->queue_err)
			p->queue_err = rc;
		return;
	}
	if (!p->queue_err)
		p->queue_err = KVR_ENOENT;
}

static int rp_create(const struct replay_env *env, enum kvr_mode mode, void **state)
{
	if (!env || !state || env->n_ranks == 0)
		return KVR_EINVAL;
	struct rp *p = calloc(1, sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	p->env = *env;
	p->ext_hashes = getenv("KVR_REPLAY_EXT_HASHES") != NULL;
	struct kvr_config c;
	kvr_config_init(&c);
	c.block_size = env->block_size;
	c.n_shards = 1;
	c.mode = mode;
	c.free_order = env->free_tail_first ? KVR_FREE_TAIL_FIRST : KVR_FREE_FRESH_FIRST;
	c.seed = env->seed;
	p->vnow = env->now_ns(env->clock_ctx);
	c.now_ns = rp_clock;
	c.clock_ctx = p;
	/* Every call observes what the calls before it did, applied at their own virtual
	 * instants, as if each had waited for its shard: the replay is deterministic (lifecycle
	 * calls and bookings are otherwise applied whenever the shard gets to them). */
	c.sync_booking = true;
	if (env->n_ranks > c.max_ranks)
		c.max_ranks = env->n_ranks;
	if (!isnan(env->overlap_credit))
		c.overlap_credit = env->overlap_credit;
	if (!isnan(env->temperature))
		c.temperature = env->temperature;
	if (!isnan(env->prefill_load_scale))
		c.prefill_load_scale = env->prefill_load_scale;
	if (!isnan(env->ttl_s))
		c.ttl_ns = (uint64_t)llround(env->ttl_s * 1e9);
	if (!isnan(env->queue_threshold))
		c.queue_threshold = env->queue_threshold;
	c.on_admit = rp_on_admit;
	c.callback_ctx = p;
	int rc = kvr_router_create(&c, &p->r);
	if (rc) {
		free(p);
		return rc;
	}
	double f = isnan(env->capacity_factor) ? 1.0 : env->capacity_factor;
	uint64_t cap = mode == KVR_MODE_APPROX_TTL
	                   ? KVR_CAPACITY_NONE
	                   : (uint64_t)llround((double)env->blocks_per_rank * f);
	if (cap == 0)
		cap = 1;
	for (uint32_t i = 0; i < env->n_ranks; i++) {
		struct kvr_rank_id id = {.worker_id = i, .dp_rank = 0};
		rc = kvr_rank_add(p->r, id, 1, cap, env->max_batched_tokens);
		if (rc) {
			kvr_router_destroy(p->r);
			free(p);
			return rc;
		}
	}
	*state = p;
	return 0;
}

static int events_create(const struct replay_env *env, void **state)
{
	return rp_create(env, KVR_MODE_EVENTS, state);
}

static int lru_create(const struct replay_env *env, void **state)
{
	return rp_create(env, KVR_MODE_APPROX_LRU, state);
}

static int ttl_create(const struct replay_env *env, void **state)
{
	return rp_create(env, KVR_MODE_APPROX_TTL, state);
}

static int chain_create(const struct replay_env *env, void **state)
{
	int rc = rp_create(env, KVR_MODE_APPROX_LRU, state);
	if (rc == 0)
		((struct rp *)*state)->chain = true;
	return rc;
}

static void rp_destroy(void *state)
{
	struct rp *p = state;
	if (!p)
		return;
	for (size_t i = 0; i < p->n_chains; i++) {
		free(p->chains[i].tok);
		free(p->chains[i].local);
		free(p->chains[i].seq);
	}
	free(p->chains);
	if (p->r && getenv("KVR_REPLAY_INDEX_BYTES")) { /* the index at the end */
		struct kvr_index_stats st;
		kvr_index_stats_get(p->r->index, &st);
		const uint64_t b = kvr_index_memory_bytes(p->r->index);
		fprintf(stderr, "index: %lu bytes, %lu copies, %.1f bytes per copy\n",
		        (unsigned long)b, (unsigned long)st.copies,
		        st.copies ? (double)b / (double)st.copies : 0.0);
	}
	kvr_router_destroy(p->r);
	free(p->blk);
	free(p->rm);
	free(p->waiting);
	free(p->ready);
	free(p);
}

/* Complete blocks at the start of a and b (n blocks each) with equal tokens: memcmp over
 * 64-block strides, then block by block inside the stride that differs. */
static size_t same_blocks(const uint32_t *a, const uint32_t *b, size_t n, uint32_t bs)
{
	const size_t stride = 64;
	size_t i = 0;
	while (i + stride <= n && !memcmp(a + i * bs, b + i * bs, stride * bs * sizeof(*a)))
		i += stride;
	while (i < n && !memcmp(a + i * bs, b + i * bs, bs * sizeof(*a)))
		i++;
	return i;
}

/* approx_lru+chain: the frontend's side.  An agentic frontend sends each turn as the session's
 * previous prompt plus new tokens; keeping the session's chain (the previous prompt's complete
 * blocks: tokens, local and sequence hashes), it checks how many of those blocks the new
 * prompt repeats (comparing tokens: that check is the price of not trusting the conversation
 * structure, and it is timed with the decision), hashes only the rest (kvr_hash_extend from the
 * last kept block) and passes tokens and both hash arrays to kvr_route, which then hashes
 * nothing.  A prompt that does not extend the previous one keeps only the blocks they share. */
static int chain_hashes(struct rp *p, const struct replay_route_req *q, struct kvr_request *req)
{
	uint32_t bs = p->env.block_size;
	if (q->session >= p->n_chains) {
		size_t n = q->session + 1;
		struct rp_chain *c = realloc(p->chains, n * sizeof(*c));
		if (!c)
			return KVR_ENOMEM;
		memset(c + p->n_chains, 0, (n - p->n_chains) * sizeof(*c));
		p->chains = c;
		p->n_chains = n;
	}
	struct rp_chain *c = &p->chains[q->session];
	size_t nb = q->n_tokens / bs;
	if (nb > c->cap_blocks) {
		size_t cap = nb + nb / 2;
		uint32_t *t = realloc(c->tok, cap * bs * sizeof(*t));
		if (t)
			c->tok = t;
		uint64_t *l = realloc(c->local, cap * sizeof(*l));
		if (l)
			c->local = l;
		uint64_t *s = realloc(c->seq, cap * sizeof(*s));
		if (s)
			c->seq = s;
		if (!t || !l || !s)
			return KVR_ENOMEM;
		c->cap_blocks = cap;
	}
	uint64_t c0 = thread_cpu_ns();
	size_t keep = same_blocks(c->tok, q->tokens, c->n_blocks < nb ? c->n_blocks : nb, bs);
	uint64_t c1 = thread_cpu_ns();
	size_t got = 0;
	int rc = kvr_hash_extend(keep ? &c->seq[keep - 1] : NULL, q->tokens + keep * bs,
	                         (nb - keep) * bs, bs, NULL, c->local + keep, c->seq + keep, &got);
	if (rc)
		return rc;
	memcpy(c->tok + keep * bs, q->tokens + keep * bs, (nb - keep) * bs * sizeof(*c->tok));
	c->n_blocks = nb;
	p->verify_ns += c1 - c0;
	p->suffix_ns += thread_cpu_ns() - c1;
	p->kept_blocks += keep;
	p->all_blocks += nb;
	req->local_hashes = c->local;
	req->seq_hashes = c->seq;
	req->n_hashes = nb;
	return 0;
}

static int rp_route(void *state, const struct replay_route_req *q, struct replay_route_out *out)
{
	struct rp *p = state;
	tick(p);
	struct kvr_request req;
	kvr_request_init(&req);
	req.tokens = q->tokens;
	req.n_tokens = q->n_tokens;
	int rc;
	if (p->chain && (rc = chain_hashes(p, q, &req)))
		return rc;
	req.request_id = q->id;
	req.expected_output_tokens = q->output_len;
	struct kvr_decision d;
	rc = kvr_route(p->r, &req, &d);
	if (rc)
		return rc;
	if (d.status == KVR_QUEUED) {
		struct rp_queued e = {.ticket = d.ticket, .id = q->id};
		out->queued = true;
		return push(&p->waiting, &p->n_waiting, &p->cap_waiting, &e);
	}
	if (d.status != KVR_DECIDED)
		return KVR_EAGAIN;
	out->rank = (uint32_t)d.rank.worker_id;
	out->predicted_blocks = d.overlap_blocks;
	out->handle = d.attempt;
	return 0;
}

static int rp_dequeue(void *state, uint64_t *id, struct replay_route_out *out)
{
	struct rp *p = state;
	if (p->queue_err) {
		int rc = p->queue_err;
		p->queue_err = 0;
		return rc;
	}
	if (p->head_ready == p->n_ready)
		return 0;
	const struct rp_queued *e = &p->ready[p->head_ready++];
	*id = e->id;
	*out = (struct replay_route_out){.rank = (uint32_t)e->d.rank.worker_id,
	                                 .predicted_blocks = e->d.overlap_blocks,
	                                 .handle = e->d.attempt};
	return 1;
}

static int kv_event(void *state, const struct sim_kv_event *ev)
{
	struct rp *p = state;
	tick(p);
	struct kvr_event e = {.event_id = ev->event_id + 1}; /* the router's ids start at 1 */
	const uint64_t salt = p->ext_hashes ? (ev->rank + 1) * 0x9e3779b97f4a7c15ull : 0;
	switch (ev->kind) {
	case SIM_EV_STORED:
		if (ev->n > p->blk_cap) {
			size_t nc = ev->n < 64 ? 64 : ev->n;
			struct kvr_event_block *nb = realloc(p->blk, nc * sizeof(*nb));
			if (!nb)
				return KVR_ENOMEM;
			p->blk = nb;
			p->blk_cap = nc;
		}
		for (size_t i = 0; i < ev->n; i++)
			p->blk[i] = (struct kvr_event_block){.ext_hash = ev->seq[i] ^ salt,
			                                     .local_hash = ev->local[i],
			                                     .n_tokens = ev->block_size};
		e.type = KVR_EVENT_STORED;
		e.has_parent = ev->has_parent;
		e.parent_ext_hash = ev->parent_seq ^ salt;
		e.blocks = p->blk;
		e.n_blocks = ev->n;
		break;
	case SIM_EV_REMOVED:
		e.type = KVR_EVENT_REMOVED;
		e.removed = ev->seq;
		e.n_removed = ev->n;
		if (salt) {
			if (ev->n > p->rm_cap) {
				uint64_t *nr = realloc(p->rm, ev->n * sizeof(*nr));
				if (!nr)
					return KVR_ENOMEM;
				p->rm = nr;
				p->rm_cap = ev->n;
			}
			for (size_t i = 0; i < ev->n; i++)
				p->rm[i] = ev->seq[i] ^ salt;
			e.removed = p->rm;
		}
		break;
	case SIM_EV_CLEARED:
		e.type = KVR_EVENT_CLEARED;
		break;
	}
	struct kvr_rank_id id = {.worker_id = ev->rank, .dp_rank = 0};
	return kvr_events_apply(p->r, id, &e);
}

static int rp_kv_event(void *state, const struct sim_kv_event *ev)
{
	struct rp *p = state;
	return HAPPEN(p, kv_event(state, ev));
}

static int rp_first_token(void *state, uint64_t handle, uint32_t rank, uint64_t time_ns)
{
	(void)rank;
	(void)time_ns;
	struct rp *p = state;
	return TICKED(p, kvr_request_prefill_done(p->r, handle));
}

/* approx_lru+feedback: the engine's cached prefix at the request's first admission goes back
 * to the router (kvr_request_cached), as a frontend would report vLLM's
 * usage.prompt_tokens_details.cached_tokens (issue 15). */
static int rp_admitted(void *state, uint64_t handle, const struct sim_admit_info *info)
{
	struct rp *p = state;
	if (info->preemptions > 0)
		return 0; /* a re-admission: the report is about the first one */
	int rc = TICKED(
	    p, kvr_request_cached(p->r, handle, (uint64_t)info->cached_blocks * p->env.block_size));
	return rc == KVR_ESTALE ? 0 : rc; /* ended already (the lease reaper): nothing to heal */
}

/* approx_lru+watermark: also each rank's oldest cached evictable block and its resident block
 * count, as a frontend scraping the engine would report them (kvr_rank_observe with
 * KVR_OBSERVE_WATERMARK | KVR_OBSERVE_RESIDENT). */
static int rp_observe(void *state, uint32_t rank, bool has_watermark, uint64_t watermark,
                      uint64_t resident)
{
	struct rp *p = state;
	struct kvr_rank_observation ob = {.flags = KVR_OBSERVE_RESIDENT,
	                                  .incarnation = 1,
	                                  .resident_blocks = resident,
	                                  .watermark_hash = watermark};
	if (has_watermark)
		ob.flags |= KVR_OBSERVE_WATERMARK;
	struct kvr_rank_id id = {.worker_id = rank, .dp_rank = 0};
	return TICKED(p, kvr_rank_observe(p->r, id, &ob));
}

/* The replay knows which token is final, as a streaming frontend does (finish_reason comes with
 * it): the router counts each other token's KV slot at once (kvr_request_output_ex). */
static int rp_output(void *state, uint64_t handle, const uint32_t *tokens, size_t n, bool final)
{
	struct rp *p = state;
	return TICKED(p,
	              kvr_request_output_ex(p->r, handle, tokens, n, final ? KVR_OUTPUT_FINAL : 0));
}

static int rp_finished(void *state, uint64_t handle, const struct sim_finish_info *info)
{
	(void)info;
	struct rp *p = state;
	return TICKED(p, kvr_request_finish(p->r, handle));
}

static int rp_aborted(void *state, uint64_t handle)
{
	struct rp *p = state;
	return TICKED(p, kvr_request_abort(p->r, handle));
}

static int rp_sync(void *state, uint64_t now_ns)
{
	(void)now_ns; /* the router reads the virtual clock itself */
	struct rp *p = state;
	return TICKED(p, kvr_router_sync(p->r, 60000));
}

static int rp_resident(void *state, uint32_t rank, uint64_t *blocks)
{
	struct rp *p = state;
	tick(p);
	struct kvr_rank_stats st;
	struct kvr_rank_id id = {.worker_id = rank, .dp_rank = 0};
	INTRO_BEGIN(p);
	int rc = kvr_rank_get_stats(p->r, id, &st);
	INTRO_END(p);
	if (rc)
		return rc;
	*blocks = st.resident_blocks;
	return 0;
}

static int rp_predict(void *state, uint32_t rank, const uint64_t *local, size_t n,
                      uint32_t *overlap)
{
	struct rp *p = state;
	tick(p);
	struct kvr_rank_id id = {.worker_id = rank, .dp_rank = 0};
	struct kvr_request req;
	kvr_request_init(&req);
	req.local_hashes = local;
	req.n_hashes = n;
	req.n_tokens = n * p->env.block_size;
	req.flags = KVR_ROUTE_QUERY_ONLY;
	req.pinned = &id;
	struct kvr_decision d;
	INTRO_BEGIN(p);
	int rc = kvr_route(p->r, &req, &d);
	INTRO_END(p);
	if (rc)
		return rc;
	*overlap = d.overlap_blocks;
	return 0;
}

static int rp_blocks(void *state, uint32_t rank, uint64_t **out, size_t *n)
{
	struct rp *p = state;
	tick(p);
	struct kvr_rank_id id = {.worker_id = rank, .dp_rank = 0};
	size_t cap = 0;
	uint64_t *buf = NULL;
	int rc;
	*out = NULL;
	*n = 0;
	INTRO_BEGIN(p);
	while ((rc = kvr_rank_blocks(p->r, id, buf, cap, n)) == KVR_ERANGE) {
		free(buf);
		cap = *n + 64;
		buf = malloc(cap * sizeof(*buf));
		if (!buf) {
			INTRO_END(p);
			return KVR_ENOMEM;
		}
	}
	INTRO_END(p);
	if (rc) {
		free(buf);
		return rc;
	}
	*out = buf;
	return 0;
}

struct kvr_router *replay_policy_router(void *state)
{
	return ((struct rp *)state)->r;
}

/* ADMITTED / OBSERVE: the healing variants' extra hooks (NULL for the plain policies).  SAMPLED:
 * approx_lru and its variants, whose prediction is the question the tool answers. */
#define ROUTER_POLICY(NAME, CREATE, EVENTS, SAMPLED, ADMITTED, OBSERVE)                            \
	{                                                                                          \
		.name = NAME, .predicts = true, .wants_events = EVENTS, .sampled = SAMPLED,        \
		.create = CREATE, .destroy = rp_destroy, .route = rp_route,                        \
		.kv_event = rp_kv_event, .admitted = ADMITTED, .observe = OBSERVE,                 \
		.first_token = rp_first_token, .output = rp_output, .finished = rp_finished,       \
		.aborted = rp_aborted, .sync = rp_sync, .dequeue = rp_dequeue,                     \
		.resident = rp_resident, .predict = rp_predict, .blocks = rp_blocks,               \
		.cpu = rp_cpu, .path_runs = rp_path_runs,                                          \
	}

const struct replay_policy_ops replay_policy_events =
    ROUTER_POLICY("events", events_create, true, false, NULL, NULL);
const struct replay_policy_ops replay_policy_approx_lru =
    ROUTER_POLICY("approx_lru", lru_create, false, true, NULL, NULL);
const struct replay_policy_ops replay_policy_approx_ttl =
    ROUTER_POLICY("approx_ttl", ttl_create, false, false, NULL, NULL);
const struct replay_policy_ops replay_policy_approx_lru_feedback =
    ROUTER_POLICY("approx_lru+feedback", lru_create, false, true, rp_admitted, NULL);
const struct replay_policy_ops replay_policy_approx_lru_chain =
    ROUTER_POLICY("approx_lru+chain", chain_create, false, true, NULL, NULL);
const struct replay_policy_ops replay_policy_approx_lru_watermark =
    ROUTER_POLICY("approx_lru+watermark", lru_create, false, true, rp_admitted, rp_observe);
