/*
 * core/route.c - kvr_route: one routing decision, on the caller's thread.
 *
 *   1. hash the prompt's complete blocks (XXH3 chain, into thread-local scratch: no allocation
 *      once the scratch has grown to the largest prompt the thread has seen);
 *   2. find_depths in the RCU index (lock-free read side) -> per-rank cached prefix depth, by
 *      slot (find_matches' scores, written straight where the scoring reads them);
 *   3. read every candidate rank's load words (shards/owner.h: the booked load its shard
 *      writes plus the provisional load routing threads add, four ranks per cache line each);
 *   4. score and select in the same pass (core/select.h: cost inline, a running argmin scan,
 *      then one pick), straight from the per-slot arrays, no candidate structs;
 *   5. admit without a round trip (kvr_admit): the attempt id and its lease word are minted
 *      lock-free (shards/lease.h), the request is added to the rank's provisional load (atomic
 *      adds, so the very next decision on any thread sees it), and the booking (predicted cache,
 *      load, index writes) is POSTED to the rank's shard on the routing lane, without waking a
 *      shard that booked lately and sleeps in a short park (kvr_config.booking_lazy_ns: it
 *      finds the booking within that bound, and the caller makes no FUTEX_WAKE; the first
 *      booking after a lull wakes it, kvr_shard_post_soon).  The caller never
 *      waits for a shard, except on a full lane (a bounded wait, KVR_LANE_FULL_WAIT_NS, counted
 *      in kvr_lane_full_waits_total; a queued request's booking in a frontend's admission pass
 *      does not wait, refused at once, kvr_lane_full_refusals_total) and, briefly, at the
 *      lane's soft depth while the shard is making progress (kvr_shard_post_paced,
 *      kvr_lane_soft_throttles_total).  With
 *      sync_booking the booking is a timed post (kvr_shard_post_at: applied at this
 *      decision's time) and the next decision settles first (kvr_router_settle), so
 *      back-to-back decisions are exact without a round trip per booking; only a booking the
 *      shard would need memory to track is waited for, so that its KVR_ENOMEM is returned
 *      (kvr_owner_book_room_take).
 *
 * Why snapshots for load (step 3) and not a routing-lane call per candidate: a call is one round
 * trip to a shard thread (microseconds: see perf/bench_lanes), and with 64 or 1024 candidates
 * that would be the whole latency budget many times over, while the load words are 16 bytes per
 * rank.  The candidates of a plain request are the live list itself (slots and the generation
 * each had when it became routable), so scoring touches no struct kvr_rank_pub line at all; only
 * the chosen rank's is read, for its identity and shard.
 *
 * The load alone cannot tell which of this request's blocks are already pinned by in-flight
 * requests on each rank, and that is not a constant: on a rank where a sibling is decoding the
 * same long prefix, Dynamo's decode cost (active blocks + the request's blocks NOT already
 * pinned there) is much smaller, and counting every block as new sent follow-ups to an idle
 * rank to recompute the whole prefix.  So each rank's shard also publishes the runs of
 * blocks its live attempts pin (shards/load.c keeps them, shards/pinmap.c shares them: O(1)
 * shard work per run, none per block).  Pinned blocks are prefix-closed along each request's
 * chain, so the request's blocks pinned on a rank are a PREFIX of its chain there, and one walk
 * of the prompt along the published runs gives every rank's length of it, the pinned depth,
 * with no round trip: decode blocks = active + (request blocks - pinned depth).
 *
 * A rank removed between selection and booking makes the booking stale (generation check on the
 * shard): nothing is booked and the attempt's later calls return KVR_ESTALE.  With sync_booking
 * the caller decides again from step 2 (at most a few times) when the rank's generation moved
 * by the time its booking is posted (kvr_admit says why that is the waited-for outcome).
 */
#include <assert.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/probes.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "core/select.h"
#include "sync/rcu.h"

#define ROUTE_RETRIES 4

struct scratch {
	uint64_t *local, *seq;
	size_t hash_cap;
	uint32_t *score; /* by slot: predicted cached depth (find_depths), zero between calls */
	size_t score_cap;
	uint32_t *mslots; /* the slots kvr_index_find_depths set in score[] */
	size_t mslots_cap;
	uint32_t *pin; /* by slot: pinned depth (blocks of the prompt already pinned there) */
	size_t pin_cap;
	uint32_t *pslots; /* the slots kvr_pinmap_depths set in pin[] */
	size_t pslots_cap;
	uint32_t *cslot; /* an allow-list's or pin's candidates: slots ... */
	size_t cslot_cap;
	uint64_t *cgen; /* ... and their generations */
	size_t cgen_cap;
	double *cost; /* by candidate */
	size_t cost_cap;
	uint32_t routes; /* decisions on this thread: every STAGE_SAMPLE-th is timed */
	const struct kvr_live *live_seen; /* the live list last scored (compared, never read; a
	                                   * reused address only mis-aims prefetch hints) */
	size_t live_n;                    /* its length then (a list grows in place) */
	uint32_t slot_hw;                 /* 1 + its highest slot: the load lines to prefetch */
	bool raced; /* kvr_route's KVR_ENOENT: every decision's rank went away before its booking
	             * (route_failed's detail; set and read only off the hot path) */
};
static _Thread_local struct scratch tls;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
	struct scratch *s = p;
	kvr_free(s->local, 2 * s->hash_cap * sizeof(uint64_t));
	kvr_free(s->score, s->score_cap * sizeof(uint32_t));
	kvr_free(s->mslots, s->mslots_cap * sizeof(uint32_t));
	kvr_free(s->pin, s->pin_cap * sizeof(uint32_t));
	kvr_free(s->pslots, s->pslots_cap * sizeof(uint32_t));
	kvr_free(s->cslot, s->cslot_cap * sizeof(uint32_t));
	kvr_free(s->cgen, s->cgen_cap * sizeof(uint64_t));
	kvr_free(s->cost, s->cost_cap * sizeof(double));
	memset(s, 0, sizeof(*s));
}

static void scratch_key_make(void)
{
	pthread_key_create(&scratch_key, scratch_free);
}

/* Grows an array to at least need elements (doubling).  Context: the owning thread. */
static int grow_arr(void **p, size_t *cap, size_t need, size_t elem, bool zero)
{
	if (need <= *cap)
		return 0;
	size_t nc = *cap ? *cap : 256;
	while (nc < need)
		nc *= 2;
	void *q = zero ? kvr_calloc(nc, elem) : kvr_alloc(nc * elem);
	if (!q)
		return KVR_ENOMEM;
	if (*p) {
		memcpy(q, *p, *cap * elem);
		kvr_free(*p, *cap * elem);
	}
	*p = q;
	*cap = nc;
	pthread_once(&scratch_once, scratch_key_make);
	pthread_setspecific(scratch_key, &tls);
	return 0;
}

/* The per-rank arrays for a router of max_ranks slots (every one sized max_ranks; score[] and
 * pin[] zeroed).  Context: the owning thread. */
static __attribute__((noinline, cold)) int scratch_ranks_grow(size_t max_ranks)
{
	int rc;
	if ((rc = grow_arr((void **)&tls.score, &tls.score_cap, max_ranks, sizeof(uint32_t),
	                   true)) ||
	    (rc = grow_arr((void **)&tls.mslots, &tls.mslots_cap, max_ranks, sizeof(uint32_t),
	                   false)) ||
	    (rc = grow_arr((void **)&tls.pin, &tls.pin_cap, max_ranks, sizeof(uint32_t), true)) ||
	    (rc = grow_arr((void **)&tls.pslots, &tls.pslots_cap, max_ranks, sizeof(uint32_t),
	                   false)) ||
	    (rc = grow_arr((void **)&tls.cslot, &tls.cslot_cap, max_ranks, sizeof(uint32_t),
	                   false)) ||
	    (rc =
	         grow_arr((void **)&tls.cgen, &tls.cgen_cap, max_ranks, sizeof(uint64_t), false)) ||
	    (rc = grow_arr((void **)&tls.cost, &tls.cost_cap, max_ranks, sizeof(double), false)))
		return rc;
	return 0;
}

static inline int scratch_ranks(size_t max_ranks)
{
	return max_ranks <= tls.cost_cap ? 0 : scratch_ranks_grow(max_ranks); /* cost[]: last */
}

/* local and seq live in one allocation of 2 x hash_cap, so they always grow together. */
static int scratch_hashes(size_t n)
{
	if (n <= tls.hash_cap)
		return 0;
	size_t cap = tls.hash_cap ? tls.hash_cap : 256;
	while (cap < n)
		cap *= 2;
	uint64_t *p = kvr_alloc(2 * cap * sizeof(uint64_t));
	if (!p)
		return KVR_ENOMEM;
	kvr_free(tls.local, 2 * tls.hash_cap * sizeof(uint64_t));
	tls.local = p;
	tls.seq = p + cap;
	tls.hash_cap = cap;
	pthread_once(&scratch_once, scratch_key_make);
	pthread_setspecific(scratch_key, &tls);
	return 0;
}

/* Real elapsed time for stage histograms (the router clock may be virtual). */
static inline uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Whether q->pinned is in q->allow (q->n_allow > 0). */
static bool pinned_allowed(const struct kvr_request *q)
{
	for (size_t i = 0; i < q->n_allow; i++)
		if (q->allow[i].worker_id == q->pinned->worker_id &&
		    q->allow[i].dp_rank == q->pinned->dp_rank)
			return true;
	return false;
}

static int validate(const struct kvr_router *r, const struct kvr_request *q)
{
	if (!q)
		return KVR_EINVAL;
	if (q->seq_hashes) {
		if (!q->local_hashes)
			return KVR_EINVAL; /* sequence hashes only with their local ones */
		if (q->tokens && q->n_hashes != q->n_tokens / r->cfg.block_size)
			return KVR_EINVAL; /* with tokens: every complete block's */
	} else if ((q->tokens != NULL) == (q->local_hashes != NULL)) {
		return KVR_EINVAL; /* exactly one of them */
	}
	if (q->n_tokens == 0 || q->n_tokens > KVR_MAX_PROMPT_TOKENS)
		return KVR_EINVAL; /* an empty prompt, or a length no engine serves (and whose sum
		                    * over a rank's requests could wrap its prefill load) */
	if ((uint64_t)q->n_tokens >> 32 >= r->cfg.block_size)
		return KVR_EINVAL; /* 2^32 blocks (block_size 1): the block counts are 32-bit */
	if (q->local_hashes && q->n_hashes > q->n_tokens / r->cfg.block_size)
		return KVR_EINVAL; /* more blocks than the prompt has */
	if (q->n_allow > 0 && !q->allow)
		return KVR_EINVAL;
	if (isnan(q->overlap_credit) || isnan(q->prefill_load_scale) || isnan(q->temperature) ||
	    isinf(q->overlap_credit) || isinf(q->prefill_load_scale) || isinf(q->temperature))
		return KVR_EINVAL;
	if (q->flags & ~(uint32_t)(KVR_ROUTE_QUERY_ONLY | KVR_ROUTE_WAIT))
		return KVR_EINVAL;
	if (q->pinned && q->n_allow > 0) {
		if (!pinned_allowed(q))
			return KVR_EINVAL; /* pinned outside the allow-list */
	}
	return 0;
}

/* Why validate() refused q, found again by the same checks one at a time for the detail
 * (core/error.h).  Apart, so that validate() stays the code it was: spelling the detail's
 * causes there split its merged tests (n_tokens 0 or above the maximum is one subtraction and
 * shift) and cost kvr_route 5 instructions (callgrind). */
static __attribute__((cold, noinline)) int invalid_request(const struct kvr_router *r,
                                                           const struct kvr_request *q)
{
	const uint32_t bs = r->cfg.block_size;
	if (!q)
		return kvr_fail(KVR_EINVAL, "kvr_route: req is NULL");
	if (q->seq_hashes) {
		if (!q->local_hashes) /* sequence hashes only with their local ones */
			return kvr_fail(
			    KVR_EINVAL,
			    "kvr_route: req.seq_hashes is set but req.local_hashes is NULL");
		if (q->tokens && q->n_hashes != q->n_tokens / bs) /* with tokens: every complete
		                                                   * block's */
			return kvr_fail(
			    KVR_EINVAL,
			    "kvr_route: req.n_hashes %zu with tokens and seq_hashes must "
			    "be n_tokens / block_size = %zu / %u = %zu",
			    q->n_hashes, q->n_tokens, bs, q->n_tokens / bs);
	} else if ((q->tokens != NULL) == (q->local_hashes != NULL)) { /* exactly one of them */
		return kvr_fail(KVR_EINVAL,
		                q->tokens
		                    ? "kvr_route: req.tokens and req.local_hashes are both set; "
		                      "give one (or both with seq_hashes)"
		                    : "kvr_route: req.tokens and req.local_hashes are both "
		                      "NULL; give one");
	}
	/* An empty prompt, or a length no engine serves (and whose sum over a rank's requests
	 * could wrap its prefill load). */
	if (q->n_tokens == 0)
		return kvr_fail(KVR_EINVAL,
		                "kvr_route: req.n_tokens is 0; a prompt needs at least one token");
	if (q->n_tokens > KVR_MAX_PROMPT_TOKENS)
		return kvr_fail(
		    KVR_EINVAL,
		    "kvr_route: req.n_tokens %zu exceeds KVR_MAX_PROMPT_TOKENS (%" PRIu64 ")",
		    q->n_tokens, (uint64_t)KVR_MAX_PROMPT_TOKENS);
	if ((uint64_t)q->n_tokens >> 32 >= bs) /* n_tokens / bs >= 2^32: block_size 1 */
		return kvr_fail(KVR_EINVAL,
		                "kvr_route: req.n_tokens %zu makes 2^32 blocks of block_size %u; "
		                "a prompt has fewer than 2^32 blocks",
		                q->n_tokens, bs);
	if (q->local_hashes && q->n_hashes > q->n_tokens / bs) /* more blocks than the prompt */
		return kvr_fail(KVR_EINVAL,
		                "kvr_route: req.n_hashes %zu exceeds the prompt's complete blocks, "
		                "n_tokens / block_size = %zu / %u = %zu",
		                q->n_hashes, q->n_tokens, bs, q->n_tokens / bs);
	if (q->n_allow > 0 && !q->allow)
		return kvr_fail(KVR_EINVAL, "kvr_route: req.allow is NULL with req.n_allow %zu",
		                q->n_allow);
	if (isnan(q->overlap_credit) || isnan(q->prefill_load_scale) || isnan(q->temperature) ||
	    isinf(q->overlap_credit) || isinf(q->prefill_load_scale) || isinf(q->temperature))
		return kvr_fail(KVR_EINVAL,
		                "kvr_route: req.%s is %g; an override must be finite (negative = "
		                "the router's)",
		                !isfinite(q->overlap_credit)       ? "overlap_credit"
		                : !isfinite(q->prefill_load_scale) ? "prefill_load_scale"
		                                                   : "temperature",
		                !isfinite(q->overlap_credit)       ? q->overlap_credit
		                : !isfinite(q->prefill_load_scale) ? q->prefill_load_scale
		                                                   : q->temperature);
	if (q->flags & ~(uint32_t)(KVR_ROUTE_QUERY_ONLY | KVR_ROUTE_WAIT))
		return kvr_fail(KVR_EINVAL,
		                "kvr_route: req.flags 0x%x has unknown bits 0x%x (known: "
		                "KVR_ROUTE_QUERY_ONLY, KVR_ROUTE_WAIT)",
		                q->flags,
		                q->flags & ~(uint32_t)(KVR_ROUTE_QUERY_ONLY | KVR_ROUTE_WAIT));
	if (q->pinned && q->n_allow > 0) {
		if (!pinned_allowed(q))
			return kvr_fail(KVR_EINVAL,
			                "kvr_route: req.pinned (worker %" PRIu64
			                ", dp %u) is not in req.allow (%zu ranks)",
			                q->pinned->worker_id, q->pinned->dp_rank, q->n_allow);
	}
	return kvr_fail_code(KVR_EINVAL, "kvr_route");
}

void kvr_request_init(struct kvr_request *req)
{
	if (!req)
		return;
	memset(req, 0, sizeof(*req));
	req->overlap_credit = -1.0;
	req->prefill_load_scale = -1.0;
	req->temperature = -1.0;
}

/* Appends slot to an allow-list's or pin's candidates if it is routable (and not there yet).
 * Context: inside the read section. */
static void listed(const struct kvr_router *r, uint32_t slot, size_t *n)
{
	const struct kvr_rank_pub *pub = &r->ranks[slot];
	for (size_t k = 0; k < *n; k++)
		if (tls.cslot[k] == slot)
			return;
	if (!__atomic_load_n(&pub->live, __ATOMIC_ACQUIRE))
		return;
	tls.cgen[*n] = __atomic_load_n(&pub->gen, __ATOMIC_ACQUIRE);
	tls.cslot[(*n)++] = slot;
}

/* a[idx[i]] = 0 for i < n: the depth arrays back to zero after a decision.  Four a step: at 2k
 * tokens ~58 of 64 ranks hold part of the prompt, and the one-at-a-time loop was ~290
 * instructions a decision (callgrind), two a slot of them its own counting. */
static inline void zero_at(uint32_t *a, const uint32_t *idx, size_t n)
{
	size_t i = 0;
	for (; i + 4 <= n; i += 4) {
		uint32_t i0 = idx[i], i1 = idx[i + 1], i2 = idx[i + 2], i3 = idx[i + 3];
		a[i0] = 0;
		a[i1] = 0;
		a[i2] = 0;
		a[i3] = 0;
	}
	for (; i < n; i++)
		a[idx[i]] = 0;
}

/* The chosen candidate. */
struct choice {
	uint32_t slot, overlap, pinned;
	uint64_t gen;
	double cost;
};

/*
 * Scores the candidates and picks one: the request's pinned rank, its allow-list, or every live
 * rank (the live list, with the generation each slot had when it became routable).  Per
 * candidate it reads the slot's cached depth (score[]), pinned depth (pin[]) and load words
 * (r->load + r->prov: booked + provisional, 4 ranks a cache line), computes the cost and feeds the
 * scan; no candidate structs, one pass.  *sat: every candidate is saturated (only asked when
 * the router queues).  Returns 0, or KVR_ENOENT (no routable candidate; nothing drawn from the
 * random stream).  Context: inside the read section (the live list is read here).
 */
static int choose(struct kvr_router *r, const struct kvr_request *q,
                  const struct kvr_select_params *sp, size_t n_blocks, bool *sat, struct choice *ch)
{
	const struct kvr_live *live = kvr_rcu_deref(&r->live);
	const uint32_t *cs = live->slot;
	const uint64_t *cg = live->gen;
	size_t n = kvr_live_n(live);
	if (live != tls.live_seen || n != tls.live_n) {
		/* Admin changes: where its load lines end.  A list grows in place
		 * (router_internal.h): only its new entries need a look. */
		size_t from = live == tls.live_seen && n > tls.live_n ? tls.live_n : 0;
		uint32_t hw = from ? tls.slot_hw : 0;
		for (size_t i = from; i < n; i++)
			hw = cs[i] >= hw ? cs[i] + 1 : hw;
		tls.live_seen = live;
		tls.live_n = n;
		tls.slot_hw = hw;
	}
	if (q->pinned || q->n_allow) {
		n = 0;
		uint32_t s;
		if (q->pinned) {
			if (kvr_router_find_rank(r, *q->pinned, &s))
				return KVR_ENOENT;
			listed(r, s, &n);
		}
		for (size_t i = 0; !q->pinned && i < q->n_allow; i++)
			if (kvr_router_find_rank(r, q->allow[i], &s) == 0)
				listed(r, s, &n);
		cs = tls.cslot;
		cg = tls.cgen;
	}
	if (n == 0)
		return KVR_ENOENT;
	/* The request's decode footprint: its prompt blocks plus the output it expects. */
	uint64_t foot = n_blocks + q->expected_output_tokens / r->cfg.block_size;
	/* Dynamo's decode blocks: the rank's active blocks plus the request's blocks NOT already
	 * pinned there (its pinned depth: pinned blocks are prefix-closed along the chain). */
	const struct kvr_select_inputs in = {.booked = (const uint64_t *)r->load,
	                                     .prov = (const uint64_t *)r->prov,
	                                     .overlap = tls.score,
	                                     .pinned = tls.pin,
	                                     .foot = foot};
	_Static_assert(offsetof(struct kvr_rank_load, blocks) == sizeof(uint64_t) &&
	                   offsetof(struct kvr_rank_prov, blocks) == sizeof(uint64_t),
	               "kvr_select_inputs reads two words per slot");
	double *cost = tls.cost;
	struct kvr_select_scan scan;
	kvr_select_score(KVR_SELECT_AUTO, sp, &in, cs, n, cost, &scan);
	*sat = false;
	if (r->queue && !(q->flags & KVR_ROUTE_QUERY_ONLY)) {
		*sat = true;
		for (size_t i = 0; i < n && *sat; i++)
			*sat = kvr_queue_saturated(r, &cs[i], 1);
	}
	/* One random stream per decision; query-only decisions read the counter without
	 * advancing it, so asking "where would it go?" never changes later decisions. */
	uint64_t k = (q->flags & KVR_ROUTE_QUERY_ONLY)
	                 ? __atomic_load_n(&r->rng_counter, __ATOMIC_RELAXED) ^ (1ull << 63)
	                 : __atomic_fetch_add(&r->rng_counter, 1, __ATOMIC_RELAXED);
	uint64_t rng = r->cfg.seed ^ (k * 0x9e3779b97f4a7c15ull);
	long pick = kvr_select_pick(sp, cost, n, &scan, &rng);
	uint32_t s = cs[pick];
	*ch = (struct choice){.slot = s,
	                      .overlap = tls.score[s],
	                      .pinned = tls.pin[s],
	                      .gen = cg[pick],
	                      .cost = cost[pick]};
	return 0;
}

/* Decisions are timed one in STAGE_SAMPLE per thread (a thread's first included), the whole
 * decision (KVR_H_ROUTE_NS) as its stages: a clock read costs 20-40 ns (37.6 ns on the shared
 * VM of docs/measurements.md's figures), four per decision for the stages were a quarter of the
 * non-hashing time of a 2k-token route, and the two for the whole decision were still ~7 % of
 * it (bench_route at 2k tokens: p50 ~1.1 us, floor ~0.5 us).  The histograms' sums and counts
 * stay unbiased samples; KVR_C_ROUTES counts every decision. */
#define STAGE_SAMPLE 16

/* A record is taken from the pool after this many of the prompt's blocks are hashed: the pool
 * line it takes the record from was last written by the shard that gave a record back, and the
 * take's exchange waited for it (~300 cycles a route at 2k and 8k tokens, rdtsc, bench_route
 * --shards 1 --cpus 1: a quarter of the 2k floor), while hashing 32 blocks takes about that
 * long once the line was asked for. */
#define HEAD_BLOCKS 32

/* Prompts of at least this many blocks prefetch the decision's shared lines before hashing. */
#define PREFETCH_MIN_BLOCKS 64
/* ... for at most this many slots (64 lines of load and prov words). */
#define PREFETCH_MAX_SLOTS 256

/*
 * Asks for the lines the decision will read after hashing that other threads write between
 * decisions, while the hashing (0.5 us at 2k tokens, 2 us at 8k) hides their latency: the load
 * words of the slots the live list last held (r->load: the shards store a rank's snapshot at
 * every booking and finish; r->prov: the routing threads' adds), four slots a line, and the
 * lease word the next mint will try (the shard's release of its line's previous attempt wrote
 * it).  Hints only: a line written again before it is read is missed as before.  The index's
 * lines depend on the hashes and are not asked for here.  Context: any routing thread.
 */
static void prefetch_decision(const struct kvr_router *r, bool admit)
{
	/* The list last seen may be another router's (a thread routing for several): bounded by
	 * this one's arrays, so no hint points past them. */
	uint32_t hw = tls.slot_hw < PREFETCH_MAX_SLOTS ? tls.slot_hw : PREFETCH_MAX_SLOTS;
	hw = hw < r->cfg.max_ranks ? hw : r->cfg.max_ranks;
	for (uint32_t s = 0; s < hw; s += 4) {
		__builtin_prefetch(&r->load[s], 0, 3);
		__builtin_prefetch(&r->prov[s], 0, 3);
	}
	if (admit)
		kvr_lease_prefetch_next(r->leases);
}

int kvr_route_internal(struct kvr_router *r, const struct kvr_request *q, struct kvr_decision *d,
                       int queue_mode)
{
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	const struct kvr_config *cfg = &r->cfg;
	uint32_t bs = cfg->block_size;
	const bool timed = tls.routes++ % STAGE_SAMPLE == 0;
	uint64_t t0 = timed ? mono_ns() : 0;
	size_t nb = q->tokens ? q->n_tokens / bs : q->n_hashes;
	uint64_t seed = kvr_hash_lora_seed(q->lora_name);
	int rc;
	if ((rc = scratch_hashes(nb ? nb : 1)) || (rc = scratch_ranks(cfg->max_ranks)))
		return rc;
	if (nb >= PREFETCH_MIN_BLOCKS)
		prefetch_decision(r, !(q->flags & KVR_ROUTE_QUERY_ONLY));
	/* The prompt's chain: the frontend's own (borrowed for the call, not copied: 146 KiB of a
	 * 146k-token prompt), else hashed straight into the attempt's record (no copy at
	 * admission: 2 KiB at 2k tokens, 128 KiB at 128k) with streaming stores, keeping the
	 * sequence hashes in the thread's warm scratch for this thread's own lookups
	 * (kvr_hash_chain_tokens_stream says why: the record's lines were last read by the shard
	 * that booked it), and the local ones too when a replica note will read them or the
	 * booking is synchronous (a booking that finds the rank gone consumes the record, and the
	 * retry builds a new one from the scratch); else into the thread's scratch only (a query;
	 * hashes without their tokens, which the replica note below would need again).  The
	 * synchronous booking hashed into the scratch and interleaved it into a fresh record after
	 * the decision: 8-24 us of kvr-replay's route CPU on the session prompts (~9,000 blocks),
	 * each store of the 146 KB taking its line back from the shard that last read it.  The
	 * streamed stores' fence waits until the lookup and the choice have read what they
	 * need (fence_due, below). */
	const uint64_t *local = tls.local, *seq = tls.seq;
	struct kvr_attempt *rec = NULL;
	bool note_copy = false; /* tls.local holds the local hashes for the replica note */
	bool fence_due = false; /* the record's streamed stores are not fenced yet */
	uint64_t *h;
	if (q->seq_hashes) {
		local = q->local_hashes;
		seq = q->seq_hashes;
	} else if (nb && q->tokens && !(q->flags & KVR_ROUTE_QUERY_ONLY)) {
		/* The record is taken after the prompt's first HEAD_BLOCKS blocks are hashed into
		 * the scratch, which hides the miss on the pool's line (asked for first: see
		 * HEAD_BLOCKS); those blocks are then streamed in from the scratch. */
		const size_t head = nb < HEAD_BLOCKS ? nb : HEAD_BLOCKS;
		kvr_owner_attempt_prefetch(&r->owner, nb);
		kvr_hash_chain_tokens(NULL, q->tokens, head, bs, seed, tls.local, tls.seq);
		const uint32_t *tok = q->tokens + head * bs;
		const uint64_t *par = &tls.seq[head - 1];
		if ((rec = kvr_owner_attempt_reserve(&r->owner, nb, &h))) {
			note_copy = cfg->sync_booking || kvr_repl_attached(r);
			kvr_hash_pairs_stream_part(tls.local, tls.seq, head, h);
			kvr_hash_chain_tokens_stream_part(
			    par, tok, nb - head, bs, seed, h + 2 * head,
			    note_copy ? tls.local + head : NULL, tls.seq + head);
			fence_due = true;
		} else {
			kvr_hash_chain_tokens(par, tok, nb - head, bs, seed, tls.local + head,
			                      tls.seq + head);
		}
	} else if (q->tokens) {
		kvr_hash_chain_tokens(NULL, q->tokens, nb, bs, seed, tls.local, tls.seq);
	} else {
		memcpy(tls.local, q->local_hashes, nb * sizeof(uint64_t));
		kvr_hash_chain_locals(NULL, tls.local, nb, tls.seq);
	}
	uint64_t t1 = timed ? mono_ns() : 0;
	KVR_PROBE2(route_begin, q->request_id, nb);

	struct kvr_select_params sp = {
	    .overlap_credit = q->overlap_credit >= 0 ? q->overlap_credit : cfg->overlap_credit,
	    .prefill_load_scale =
	        q->prefill_load_scale >= 0 ? q->prefill_load_scale : cfg->prefill_load_scale,
	    .temperature = q->temperature >= 0 ? q->temperature : cfg->temperature,
	    .block_size = bs,
	    .prompt_tokens = q->n_tokens,
	};
	for (int attempt_no = 0; attempt_no < ROUTE_RETRIES; attempt_no++) {
		uint64_t t2s = timed ? mono_ns() : 0;
		/* sync_booking: the work earlier calls posted is applied before this decision reads
		 * the index, the pinned runs, the load and (admitting) the lease words; after the
		 * hashing, which gives the shard that much longer to have done it (timed with the
		 * lookup). */
		assert(!kvr_rcu_read_ongoing()); /* settle may wait for a shard */
		kvr_router_settle(r);
		uint32_t best = 0, *score = tls.score;
		kvr_rcu_read_lock();
		/* The pinned runs' first probe: its line (often just written by a shard) is
		 * fetched while find_depths walks the index. */
		if (nb)
			kvr_pinmap_prefetch(r->pinmap, seq[0]);
		size_t nm =
		    nb ? kvr_index_find_depths(r->index, seq, nb, score, tls.mslots, &best) : 0;
		/* Pinned depth per rank: one walk along the published pinned runs. */
		size_t np = nb ? kvr_pinmap_depths(r->pinmap, seq, nb, tls.pin, tls.pslots) : 0;
		uint64_t t2 = timed ? mono_ns() : 0;
		struct choice chosen;
		bool sat;
		rc = choose(r, q, &sp, nb, &sat, &chosen);
		/* The record's streamed stores are fenced here, after this decision's reads and
		 * before anything can post the record or give it back to the pool: loads issued
		 * right after the fence waited for the streamed lines to drain (rdtsc, 2k tokens:
		 * the lookup took 728-780 cycles after it, 520-544 before it;
		 * docs/measurements.md). */
		if (fence_due) {
			kvr_hash_stream_fence();
			fence_due = false;
		}
		/* One read section for the lookup, the choice and an asynchronous admission: the
		 * post opens its own (kvr_shard_post_soon: it checks that the shard is not closed
		 * inside one), which is then nested, a thread-local increment instead of liburcu's
		 * out-of-line lock and unlock (~75 instructions a route, sync/rcu.h).  It adds
		 * the lease mint, the record's header and the provisional load to what a grace
		 * period may wait for (~100 ns; the post's own waits at a full lane were inside a
		 * section already).  Not a synchronous booking's: it may wait for the shard's
		 * answer, and a shard may wait for a grace period (kvr_rcu_defer_free without
		 * memory). */
		const bool post_inside = !cfg->sync_booking && !(q->flags & KVR_ROUTE_QUERY_ONLY);
		if (!post_inside)
			kvr_rcu_read_unlock();
		zero_at(score, tls.mslots, nm);
		zero_at(tls.pin, tls.pslots, np);
		KVR_PROBE3(match, nb, nm, best);
		if (rc) {
			if (post_inside)
				kvr_rcu_read_unlock();
			kvr_owner_attempt_free(&r->owner, rec);
			kvr_metrics_add(mb, KVR_C_ROUTE_ERRORS, 1);
			return rc;
		}
		struct kvr_rank_pub *pub = &r->ranks[chosen.slot];
		uint64_t t3 = timed ? mono_ns() : 0;

		if (sat || queue_mode == KVR_QUEUE_BEHIND) {
			if (post_inside)
				kvr_rcu_read_unlock();
			kvr_owner_attempt_free(&r->owner, rec); /* not admitted now */
			if (queue_mode == KVR_QUEUE_FROM_PUMP)
				return KVR_QUEUE_SATURATED;
			uint64_t cached = (uint64_t)best * bs;
			return kvr_queue_push(r, q, q->n_tokens > cached ? q->n_tokens - cached : 0,
			                      d);
		}

		memset(d, 0, sizeof(*d));
		d->status = KVR_DECIDED;
		/* Atomic: the slot may be reused by a rank add on its shard meanwhile (the booking
		 * is then stale); a plain read raced its atomic stores (TSan, stress_torture's
		 * slot reuse, 1 run in 10 under load). */
		d->rank.worker_id = __atomic_load_n(&pub->worker_id, __ATOMIC_RELAXED);
		d->rank.dp_rank = __atomic_load_n(&pub->dp_rank, __ATOMIC_RELAXED);
		d->overlap_blocks = chosen.overlap;
		d->required_blocks = (uint32_t)nb;
		d->cached_tokens = (uint64_t)chosen.overlap * bs;
		d->cost = chosen.cost;
		if (timed) {
			kvr_metrics_observe(mb, KVR_H_HASH_NS, t1 - t0);
			kvr_metrics_observe(mb, KVR_H_MATCH_NS, t2 - t2s);
			kvr_metrics_observe(mb, KVR_H_SELECT_NS, t3 - t2);
		}
		if (q->flags & KVR_ROUTE_QUERY_ONLY) {
			kvr_metrics_add(mb, KVR_C_ROUTES_QUERY_ONLY, 1);
			if (timed)
				kvr_metrics_observe(mb, KVR_H_ROUTE_NS, mono_ns() - t0);
			KVR_PROBE4(route_end, q->request_id, chosen.slot, chosen.overlap, 0);
			return 0;
		}
		size_t tail_n = q->tokens ? q->n_tokens % bs : 0;
		/* Whether this admission is noted to replica sync, decided once, before the booking
		 * is posted: the record carries it (kvr_admit_args.noted), the shard tells the
		 * attempt's end (an expiry, a rank's end) only if so, and the note below is made
		 * only if so.  So an attempt routed while nothing was attached tells no end (told,
		 * it found no record on the sender and waited in its early set for its 60 s prune:
		 * sync/replica_early.c; test_replica_early *_routed_before_attach_*), and one whose
		 * admission is published always tells its end.  Not read again at the note: a
		 * replica attached between the two would publish an admission whose end the
		 * shard, its record saying `not noted`, never tells (a mirror live on every peer
		 * for good).  A note made on this flag finds no hooks if the replica detached
		 * since (kvr_repl_note_route_slow reads them under RCU); its end then reaches no
		 * one, or a replica attached after that: an end with no admission, left to that
		 * replica's early-set prune (a detach and an attach within one route's window). */
		const bool noted = kvr_repl_attached(r);
		struct kvr_admit_args a = {
		    .slot = chosen.slot,
		    .gen = chosen.gen,
		    .local = local,
		    .seq = seq,
		    .n = nb,
		    .prompt_tokens = q->n_tokens,
		    .tail = q->tokens ? q->tokens + nb * bs : NULL,
		    .tail_n = (uint32_t)tail_n,
		    .chain_known = q->tokens != NULL || q->n_tokens == nb * bs,
		    .lora_seed = seed,
		    .overlap = chosen.overlap,
		    .pend_blocks = nb - chosen.pinned, /* the request's new decode blocks there */
		    .noted = noted,
		};
		const bool in_rec = rec != NULL; /* hashed into it (seq: the scratch copy) */
		a.reserved = rec;
		a.in_record = in_rec;
		/* A frontend's admission pass does not wait on a full lane: the booking is refused
		 * at once, the pass ends there and hands the retry, with its bounded wait, to the
		 * admission thread (kvr_queue_pump: hand_off).  Waited, it cost the route that
		 * happened to pump 10 ms (issue 11; test_queue_lane
		 * a_route_that_pumps_does_not_retry_a_full_lane_while_it_stays_full).  The pass
		 * ends at a refusal whatever the wait, so the order is the same: only the wait
		 * moved to the thread that retries. */
		const bool full_wait = queue_mode != KVR_QUEUE_FROM_PUMP || kvr_admitter_of == r;
		rc = kvr_admit(r, &a, cfg->sync_booking, full_wait); /* consumes rec */
		rec = NULL;
		if (post_inside)
			kvr_rcu_read_unlock();
		uint64_t t4 = timed ? mono_ns() : 0;
		if (rc == KVR_ENOENT && (!in_rec || cfg->sync_booking))
			continue; /* sync: the rank went away after selection: decide again (a new
			           * record from the scratch's local and seq) */
		if (rc) {
			/* Not a pass's refused booking: the request stays queued, and no call
			 * failed (the admission thread retried a full lane every 10 ms, each
			 * counted: ~90 errors a second with every route call returning 0;
			 * test_queue_lane a_route_that_pumps_*). */
			if (rc != KVR_EAGAIN || queue_mode != KVR_QUEUE_FROM_PUMP)
				kvr_metrics_add(mb, KVR_C_ROUTE_ERRORS, 1);
			return rc;
		}
		d->attempt = a.attempt;
		if (noted && in_rec) {
			/* The record is the shard's now (a stale booking frees it at once): the
			 * note reads the copy kept while hashing (hashing again cost the attached
			 * route 2.0-2.1 us at 8k tokens, bench_sync), or, attached meanwhile, the
			 * local hashes from the tokens again. */
			if (!note_copy)
				kvr_hash_chain_tokens(NULL, q->tokens, nb, bs, seed, tls.local,
				                      tls.seq);
			a.local = tls.local;
			a.seq = note_copy ? NULL : tls.seq; /* the note reads local only */
		}
		if (noted) /* replica sync */
			kvr_repl_note_route_slow(r, &a, d, q->expected_output_tokens);
		kvr_metrics_add(mb, KVR_C_ROUTES, 1);
		kvr_metrics_add(mb, KVR_C_ROUTED_BLOCKS, nb);
		kvr_metrics_add(mb, KVR_C_PREDICTED_OVERLAP_BLOCKS, chosen.overlap);
		if (timed) {
			kvr_metrics_observe(mb, KVR_H_ADMIT_NS, t4 - t3);
			kvr_metrics_observe(mb, KVR_H_ROUTE_NS, t4 - t0);
		}
		kvr_metrics_observe(mb, KVR_H_OVERLAP_BLOCKS, chosen.overlap);
		KVR_PROBE4(route_end, q->request_id, chosen.slot, chosen.overlap, 0);
		return 0;
	}
	kvr_metrics_add(mb, KVR_C_ROUTE_ERRORS, 1);
	tls.raced = queue_mode != KVR_QUEUE_FROM_PUMP; /* kvr_route's: it reads the detail */
	return KVR_ENOENT;
}

int kvr_admit(struct kvr_router *r, struct kvr_admit_args *a, bool sync, bool full_wait)
{
	struct kvr_rank_pub *pub = &r->ranks[a->slot];
	int rc = kvr_lease_mint(r->leases, a->slot, &a->attempt);
	if (rc) {
		kvr_owner_attempt_free(&r->owner, a->reserved);
		return rc;
	}
	uint64_t cached = (uint64_t)a->overlap * r->cfg.block_size;
	a->pend_prefill_tokens = a->prompt_tokens > cached ? a->prompt_tokens - cached : 0;
	struct kvr_attempt *rec = a->reserved;
	if (rec)
		kvr_owner_attempt_fill(&r->owner, rec, a);
	else if (!(rec = kvr_owner_attempt_new(&r->owner, a))) {
		kvr_lease_unmint(r->leases, a->attempt);
		return KVR_ENOMEM;
	}
	/* Provisional load: the very next decision, on any thread, sees this request. */
	struct kvr_rank_prov *l = &r->prov[a->slot];
	if (a->pend_prefill_tokens)
		__atomic_fetch_add(&l->prefill_tokens, a->pend_prefill_tokens, __ATOMIC_RELAXED);
	if (a->pend_blocks)
		__atomic_fetch_add(&l->blocks, a->pend_blocks, __ATOMIC_RELAXED);
	struct kvr_shard *sh =
	    kvr_shards_get(r->shards, __atomic_load_n(&pub->shard, __ATOMIC_RELAXED));
	if (sync && kvr_owner_book_room_take(sh)) {
		/* sync_booking, deferred: the booking cannot fail for memory (room taken), so its
		 * outcome is known here but for a rank going away, and the caller's next call
		 * settles before it reads anything the booking changes (kvr_router_settle). */
		rc = kvr_shard_post_at(sh, KVR_LANE_ROUTING, kvr_owner_book_deferred_task, &rec,
		                       sizeof(rec), kvr_clock_now(&r->clock));
		if (rc == 0) {
			/* The record is the shard's now.  A removal (or re-add) moves the slot's
			 * generation before it tells the shard: if the generation still holds
			 * after this post, the removal began after it, and the attempt ends with
			 * the rank (dropped as stale, or booked and torn down: its calls return
			 * KVR_ESTALE), as a waited-for booking followed by that removal does; if
			 * not, decide again, as the waited-for booking's KVR_ENOENT did (this one
			 * is dropped, or made and torn down, and never returned). */
			if (__atomic_fetch_add(&pub->gen, 0, __ATOMIC_SEQ_CST) != a->gen) {
				/* Its kvr_route decides again and never notes this attempt, but the
				 * shard, which alone can claim it, tells its end if it was to be
				 * noted (a->noted): told with no admission, it waited in the
				 * sender's early set for its 60 s prune.  The withdrawal pairs with
				 * it there, whichever comes first (test_replica_early
				 * a_sync_booking_route_that_decides_again_leaves_nothing_kept). */
				if (a->noted)
					kvr_repl_note_progress_slow(r, a->attempt, KVR_OP_WITHDRAWN,
					                            NULL, 0, false);
				return KVR_ENOENT; /* (an RMW: the latest generation, no fence) */
			}
			return 0;
		}
		kvr_owner_book_room_give(sh); /* not posted: the shard never takes it up */
	} else if (sync) {
		/* No room: the shard must allocate to track it (or an allocation failed there),
		 * so wait for its answer.  The booking consumes the record whatever it returns. */
		rc = kvr_shard_call(sh, KVR_LANE_ROUTING, kvr_owner_book_call, rec);
		/* KVR_ESHUTDOWN, KVR_EINVAL, KVR_EBUSY: not run. */
		if (rc != KVR_ESHUTDOWN && rc != KVR_EINVAL && rc != KVR_EBUSY) {
			/* Failed there (memory, a rank gone): the shard took its provisional load
			 * back, and a request may have queued behind it.  Woken as for a load
			 * taken back below: else it waited on an idle rank for the embedder's
			 * next call (test_owner_attempts
			 * sync_booking_waited_booking_failed_for_memory_wakes_the_queue). */
			if (rc && r->queue)
				kvr_admitter_note_unloaded(r, false);
			return rc;
		}
	} else {
		/* A soon post: a shard that has been booking lately parks for at most
		 * booking_lazy_ns and is left asleep (no FUTEX_WAKE on this thread); the first
		 * booking after a lull wakes it (kvr_config.booking_lazy_ns: the figures). */
		unsigned how;
		rc = kvr_shard_post_soon(sh, KVR_LANE_ROUTING, kvr_owner_book_task, &rec,
		                         sizeof(rec), &how, NULL);
		if (how) {
			struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
			kvr_metrics_add(mb, KVR_C_LANE_SOFT_THROTTLES,
			                !!(how & KVR_POST_THROTTLED));
			kvr_metrics_add(mb, KVR_C_LANE_SOFT_SPILLS, !!(how & KVR_POST_SPILLED));
		}
		/* !full_wait: refused at once, counted on its own (no wait, nothing dropped: the
		 * request stays queued); the admission thread's retry, which the refusal wakes
		 * below, waits and counts as any other post.  Before, counted nowhere: a lane that
		 * drained before the retry left no sign that it was ever full (test_queue_lane
		 * a_frontends_refused_booking_on_a_full_lane_is_counted). */
		if (rc == KVR_EAGAIN && !full_wait)
			kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_LANE_FULL_REFUSALS, 1);
		if (rc == KVR_EAGAIN && full_wait) {
			struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
			kvr_metrics_add(mb, KVR_C_LANE_FULL_WAITS, 1);
			rc = kvr_shard_post_wait(sh, KVR_LANE_ROUTING, kvr_owner_book_task, &rec,
			                         sizeof(rec), KVR_LANE_FULL_WAIT_NS);
			if (rc)
				kvr_metrics_add(mb, KVR_C_LANE_FULL_DROPS, 1);
		}
		if (rc == 0)
			return 0;
	}
	/* Not posted (full lane, shutdown): nobody has seen the id, take everything back. */
	if (a->pend_prefill_tokens)
		__atomic_fetch_sub(&l->prefill_tokens, a->pend_prefill_tokens, __ATOMIC_RELAXED);
	if (a->pend_blocks)
		__atomic_fetch_sub(&l->blocks, a->pend_blocks, __ATOMIC_RELAXED);
	kvr_lease_unmint(r->leases, a->attempt);
	kvr_owner_attempt_free(&r->owner, rec);
	/* A request may have queued behind that load, and no shard will lower it: wake the
	 * admission thread as the shards' hook does (before, it stayed queued on an idle rank). */
	if (r->queue)
		kvr_admitter_note_unloaded(r, false);
	return rc == KVR_ETIMEDOUT ? KVR_EAGAIN : rc;
}

/* What d says of a call that failed after the request was found valid.  d may hold the
 * decision whose booking failed (status KVR_DECIDED, its rank and cost): a caller that read d
 * before rc took a refused request for an admitted one (the header-contract audit). */
static __attribute__((cold, noinline)) void decision_failed(struct kvr_decision *d, int rc)
{
	memset(d, 0, sizeof(*d));
	d->status = KVR_FAILED;
	d->error = rc;
}

/* The detail of a decision that failed after the request was found valid (core/error.h). */
static __attribute__((cold, noinline)) int route_failed(const struct kvr_router *r,
                                                        const struct kvr_request *q,
                                                        struct kvr_decision *d, int rc)
{
	decision_failed(d, rc);
	switch (rc) {
	case KVR_ENOENT:
		if (tls.raced) {
			tls.raced = false;
			return kvr_fail(
			    rc,
			    "kvr_route: the chosen rank was removed (or replaced) before "
			    "its booking at each of %d decisions; nothing admitted",
			    ROUTE_RETRIES);
		}
		if (q->pinned)
			return kvr_fail(rc,
			                "kvr_route: the pinned rank (worker %" PRIu64
			                ", dp %u) is not a routable rank",
			                q->pinned->worker_id, q->pinned->dp_rank);
		if (q->n_allow)
			return kvr_fail(rc, "kvr_route: none of req.allow's %zu ranks is routable",
			                q->n_allow);
		return kvr_fail(rc, "kvr_route: no routable rank (none added, or all removed)");
	case KVR_EAGAIN:
		if (r->queue)
			return kvr_fail(
			    rc,
			    "kvr_route: the waiting queue (queue_capacity %u) or the chosen "
			    "rank's shard lane is full, or 2^20 attempts are live; try again",
			    r->cfg.queue_capacity);
		return kvr_fail(rc,
		                "kvr_route: the chosen rank's shard lane stayed full for 10 ms, "
		                "or 2^20 attempts are live; try again");
	case KVR_ENOMEM:
		return kvr_fail(rc, "kvr_route: out of memory hashing or booking the request");
	case KVR_ERANGE:
		return kvr_fail(rc, "kvr_route: the router's 2^46 attempt ids are used up");
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "kvr_route: %s", kvr_router_gone(r));
	case KVR_EBUSY: /* sync_booking's waited-for booking */
		return kvr_fail(rc, "kvr_route: %s", KVR_SHARD_CYCLE_DETAIL);
	default:
		return kvr_fail_code(rc, "kvr_route");
	}
}

/* kvr_route_errors_total counts every failed call on a live router: a refused request too, not
 * only the decisions that failed (kvr_route_internal counts those). */
static __attribute__((cold, noinline)) void count_refused(struct kvr_router *r)
{
	kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_ROUTE_ERRORS, 1);
}

int kvr_route(struct kvr_router *r, const struct kvr_request *req, struct kvr_decision *d)
{
	if (!r || !d) {
		if (r && !kvr_router_stopping(r))
			count_refused(r);
		return kvr_fail(KVR_EINVAL, "kvr_route: %s is NULL", !r ? "router" : "d");
	}
	if (kvr_router_stopping(r)) {
		decision_failed(d, KVR_ESHUTDOWN);
		return kvr_fail(KVR_ESHUTDOWN, "kvr_route: %s", kvr_router_gone(r));
	}
	int rc = validate(r, req);
	if (rc) {
		count_refused(r);
		return invalid_request(r, req);
	}
	if ((rc = kvr_rcu_thread_online())) {
		count_refused(r);
		decision_failed(d, rc);
		return kvr_fail(rc, "kvr_route: this thread could not register with RCU: %s",
		                kvr_strerror(rc));
	}
	/* Those waiting go first.  Another thread's pass may not have reached one that could be
	 * admitted now, or this thread's pass ended at one whose booking a full lane refused (the
	 * admission thread retries it): this request then queues behind it rather than take its
	 * rank (core/queue.c), marked waited so that no on_admit names its ticket before this call
	 * returns it, and pumps again (that pass may have ended before the push): admitted by then,
	 * it returns its decision as if it had not queued.  Not a KVR_ROUTE_WAIT from inside the
	 * pass itself (on_admit): nothing admits its ticket while it waits, the pass being its
	 * caller (before, it waited out its deadline, forever without one, for a rank that was
	 * free). */
	bool behind = r->queue && kvr_queue_depth(r) && !kvr_queue_pump(r) &&
	              !(req->flags & KVR_ROUTE_QUERY_ONLY) &&
	              !((req->flags & KVR_ROUTE_WAIT) && kvr_queue_pumped_here(r)) &&
	              kvr_queue_admissible(r);
	if (behind) {
		rc = kvr_route_internal(r, req, d, KVR_QUEUE_BEHIND);
		/* The queue filled meanwhile: no room behind, so it is routed as if nobody waited
		 * (it queues, and is refused, only if its ranks are saturated).  Before, a full
		 * queue refused it with KVR_EAGAIN though a rank was free for it. */
		if (rc == KVR_EAGAIN)
			behind = false;
		else if (rc)
			return route_failed(r, req, d, rc);
	}
	if (!behind && (rc = kvr_route_internal(r, req, d, KVR_QUEUE_IF_SATURATED)))
		return route_failed(r, req, d, rc);
	bool wait = (req->flags & KVR_ROUTE_WAIT) != 0;
	/* Inside the router (its clock, a callback, one of its threads or shards) but not the
	 * admission pass itself (on_admit: refused below), kvr_route_wait would refuse to sleep
	 * (it could wait for the call it runs in: core/queue.c): a request that queues there is
	 * returned KVR_QUEUED with its ticket, and is the caller's as without the flag (on_admit
	 * tells it, or kvr_route_wait collects it).  Settled as waited, on_admit never named it and
	 * its outcome was held for a wait that never came.  A deadline already passed is
	 * honoured there as outside (the wait does not sleep): KVR_ETIMEDOUT, the ticket kept for
	 * a wait (before, KVR_QUEUED as without the flag).  `late` is that one reading, given to
	 * the wait: read again, a clock gone back would have the wait refuse a ticket settled as
	 * waited, held for good. */
	int late = -1; /* not read */
	if (wait && d->status == KVR_QUEUED && !kvr_queue_pumped_here(r) &&
	    kvr_router_runs_thread(r)) {
		late = req->deadline_ns && kvr_clock_now(&r->clock) >= req->deadline_ns;
		wait = late;
	}
	if (d->status == KVR_QUEUED) {
		/* Queued (held for this call: no on_admit names it yet).  Pumped again: the pass of
		 * a call that lowered the load meanwhile may have ended before the push (with
		 * on_admit and no waiter, the request then stayed queued on the freed rank until
		 * some later call; core/queue.c).  Admitted by then, it returns its decision as if
		 * it had not queued. */
		uint64_t ticket = d->ticket;
		kvr_queue_catch_up();
		kvr_queue_pump(r);
		if ((rc = kvr_queue_settle(r, ticket, wait, d)))
			return kvr_fail(
			    rc, "kvr_route: queued (ticket %" PRIu64 "), its admission failed: %s",
			    ticket, kvr_strerror(rc));
	}
	if (d->status == KVR_QUEUED && wait) {
		/* Inside the admission pass (on_admit), a wait would block the only pass that could
		 * admit it (before, it waited out its deadline, for good without one). */
		if (kvr_queue_pumped_here(r)) {
			uint64_t ticket = d->ticket;
			(void)kvr_route_cancel(
			    r, ticket); /* no pass can take it meanwhile: ours waits */
			/* A failed call, counted as every other refusal is (it was not: test_router
			 * a_wait_refused_inside_the_admission_pass_counts_as_a_route_error). */
			count_refused(r);
			decision_failed(d, KVR_EBUSY); /* its ticket is gone */
			return kvr_fail(
			    KVR_EBUSY,
			    "kvr_route: KVR_ROUTE_WAIT inside the queue's admission pass "
			    "(on_admit), with every eligible rank saturated: waiting would "
			    "block the pass that admits it; not queued");
		}
		if (late < 0) /* read off the queue's lock, as kvr_route_wait reads it */
			late = req->deadline_ns && kvr_clock_now(&r->clock) >= req->deadline_ns;
		rc = kvr_queue_wait(r, d->ticket, req->deadline_ns, late, d); /* its own details */
		/* Woken by a destroy (KVR_ESHUTDOWN) or its ticket gone (KVR_ENOENT): d was not
		 * written and read KVR_QUEUED with a ticket nobody can use.  A timeout keeps the
		 * ticket; a failed admission's d is its outcome (KVR_FAILED already). */
		if (rc && rc != KVR_ETIMEDOUT && d->status == KVR_QUEUED)
			decision_failed(d, rc);
		return rc;
	}
	return 0;
}
