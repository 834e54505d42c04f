/*
 * core/route.c - kvr_route: one routing decision, on the caller's thread.
 *
 *   1. hash the prompt's complete blocks (XXH3 chain, into thread-local scratch: no allocation
 *      once the scratch has grown to the largest prompt the thread has seen);
 *   2. find_matches in the RCU index (lock-free read side) -> per-rank cached prefix depth;
 *   3. read every candidate rank's load snapshot, published by its shard (relaxed atomics);
 *   4. score and select (core/select.c);
 *   5. admit without a round trip (kvr_admit): the attempt id and its lease word are minted
 *      lock-free (shards/lease.h), the request is added to the rank's provisional load (atomic
 *      adds, so the very next decision on any thread sees it), and the booking (predicted cache,
 *      load, index writes) is POSTED to the rank's shard on the routing lane.  The caller never
 *      waits for a shard, except on a full lane (a bounded wait, KVR_LANE_FULL_WAIT_NS, counted
 *      in kvr_lane_full_waits_total) and with sync_booking, where it waits for the booking so
 *      back-to-back decisions are exact.
 *
 * Why snapshots for load (step 3) and not a routing-lane call per candidate: a call is one round
 * trip to a shard thread (microseconds: see perf/bench_lanes), and with 64 or 1024 candidates
 * that would be the whole latency budget many times over, while the snapshot is one cache line
 * per rank.  The snapshot alone cannot tell which of this request's blocks are already pinned
 * by in-flight requests on each rank, and that is not a constant: on a rank where a sibling is
 * decoding the same long prefix, Dynamo's decode cost (active blocks + the request's blocks NOT
 * already pinned there) is much smaller, and counting every block as new sent follow-ups to an
 * idle rank to recompute the whole prefix.  So each rank's shard also publishes the runs of
 * blocks its live attempts pin (shards/load.c keeps them, shards/pinmap.c shares them: O(1)
 * shard work per run, none per block).  Pinned blocks are prefix-closed along each request's
 * chain, so the request's blocks pinned on a rank are a PREFIX of its chain there, and one walk
 * of the prompt along the published runs gives every rank's length of it, the pinned depth,
 * with no round trip: decode blocks = active + (request blocks - pinned depth).
 *
 *
 * A rank removed between selection and booking makes the booking stale (generation check on the
 * shard): nothing is booked and the attempt's later calls return KVR_ESTALE.  With sync_booking
 * the caller learns it at once and decides again from step 2, at most a few times.
 */
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
	uint32_t *score; /* by slot */
	size_t score_cap;
	struct kvr_index_match *match;
	size_t match_cap;
	struct kvr_candidate *cand;
	size_t cand_cap;
	uint32_t *pin; /* by slot: pinned depth (blocks of the prompt already pinned there) */
	size_t pin_cap;
	uint32_t *pslots; /* the slots kvr_pinmap_depths set in pin[] */
	size_t pslots_cap;
	uint32_t *cand_pin; /* pinned depth of each candidate */
	size_t cand_pin_cap;
};

static _Thread_local struct scratch tls;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
	struct scratch *s = p;
	kvr_free(s->local, 2 * s->hash_cap * sizeof(uint64_t));
	kvr_free(s->score, s->score_cap * sizeof(uint32_t));
	kvr_free(s->match, s->match_cap * sizeof(*s->match));
	kvr_free(s->cand, s->cand_cap * sizeof(*s->cand));
	kvr_free(s->pin, s->pin_cap * sizeof(uint32_t));
	kvr_free(s->pslots, s->pslots_cap * sizeof(uint32_t));
	kvr_free(s->cand_pin, s->cand_pin_cap * sizeof(uint32_t));
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

static int validate(const struct kvr_router *r, const struct kvr_request *q)
{
	if (!q)
		return KVR_EINVAL;
	if ((q->tokens != NULL) == (q->local_hashes != NULL))
		return KVR_EINVAL; /* exactly one of them */
	if (q->n_tokens == 0 || q->n_tokens > KVR_MAX_PROMPT_TOKENS)
		return KVR_EINVAL; /* an empty prompt, or a length no engine serves (and whose sum
		                    * over a rank's requests could wrap its prefill load) */
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
		bool found = false;
		for (size_t i = 0; i < q->n_allow; i++)
			if (q->allow[i].worker_id == q->pinned->worker_id &&
			    q->allow[i].dp_rank == q->pinned->dp_rank)
				found = true;
		if (!found)
			return KVR_EINVAL; /* pinned outside the allow-list */
	}
	return 0;
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

/* Adds slot as a candidate if it is routable: its overlap (score[]), pinned depth (pin[]) and
 * load go to cand[*n] and cand_pin[*n].  The scratch arrays are passed in so the loop over every
 * live rank reads the thread-local scratch once, not per rank.  Context: inside the read
 * section. */
static inline void add_candidate(const struct kvr_rank_pub *ranks, const uint32_t *score,
                                 const uint32_t *pin, struct kvr_candidate *cand,
                                 uint32_t *cand_pin, uint32_t slot, size_t n_blocks, size_t *n)
{
	const struct kvr_rank_pub *pub = &ranks[slot];
	if (!__atomic_load_n(&pub->live, __ATOMIC_ACQUIRE))
		return;
	uint32_t pinned = pin[slot];
	cand_pin[*n] = pinned;
	struct kvr_candidate *c = &cand[(*n)++];
	c->gen = __atomic_load_n(&pub->gen, __ATOMIC_ACQUIRE);
	c->slot = slot;
	c->overlap_blocks = score[slot];
	c->active_prefill_tokens = kvr_rank_pub_prefill(pub);
	/* Dynamo's decode blocks: the rank's active blocks plus the request's blocks NOT already
	 * pinned there (its pinned depth: pinned blocks are prefix-closed along the chain). */
	c->potential_decode_blocks = kvr_rank_pub_blocks(pub) + n_blocks - pinned;
	c->cost = 0;
}

/* Fills tls.cand with the eligible ranks and their overlap and load.  Returns the count, or a
 * negative error.  Context: inside the read section. */
static long candidates(struct kvr_router *r, const struct kvr_request *q, size_t n_blocks,
                       const struct kvr_live *live)
{
	/* The request's decode footprint: its prompt blocks plus the output it expects. */
	n_blocks += q->expected_output_tokens / r->cfg.block_size;
	size_t n = 0;
	const struct kvr_rank_pub *ranks = r->ranks;
	const uint32_t *score = tls.score, *pin = tls.pin;
	struct kvr_candidate *cand = tls.cand;
	uint32_t *cand_pin = tls.cand_pin;
	if (q->pinned) {
		uint32_t s;
		if (kvr_router_find_rank(r, *q->pinned, &s))
			return KVR_ENOENT;
		add_candidate(ranks, score, pin, cand, cand_pin, s, n_blocks, &n);
	} else if (q->n_allow) {
		for (size_t i = 0; i < q->n_allow; i++) {
			uint32_t s;
			if (kvr_router_find_rank(r, q->allow[i], &s) == 0) {
				bool dup = false;
				for (size_t k = 0; k < n; k++)
					dup |= cand[k].slot == s;
				if (!dup)
					add_candidate(ranks, score, pin, cand, cand_pin, s,
					              n_blocks, &n);
			}
		}
	} else {
		for (uint32_t i = 0; i < live->n; i++)
			add_candidate(ranks, score, pin, cand, cand_pin, live->slot[i], n_blocks,
			              &n);
	}
	return n ? (long)n : KVR_ENOENT;
}

int kvr_route_internal(struct kvr_router *r, const struct kvr_request *q, struct kvr_decision *d,
                       int queue_mode)
{
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	const struct kvr_config *cfg = &r->cfg;
	uint32_t bs = cfg->block_size;
	uint64_t t0 = mono_ns();
	size_t nb = q->tokens ? q->n_tokens / bs : q->n_hashes;
	uint64_t seed = kvr_hash_lora_seed(q->lora_name);
	int rc;
	if ((rc = scratch_hashes(nb ? nb : 1)))
		return rc;
	if ((rc = grow_arr((void **)&tls.score, &tls.score_cap, cfg->max_ranks, sizeof(uint32_t),
	                   true)) ||
	    (rc = grow_arr((void **)&tls.match, &tls.match_cap, cfg->max_ranks, sizeof(*tls.match),
	                   false)) ||
	    (rc = grow_arr((void **)&tls.cand, &tls.cand_cap, cfg->max_ranks, sizeof(*tls.cand),
	                   false)) ||
	    (rc = grow_arr((void **)&tls.pin, &tls.pin_cap, cfg->max_ranks, sizeof(uint32_t),
	                   true)) ||
	    (rc = grow_arr((void **)&tls.pslots, &tls.pslots_cap, cfg->max_ranks, sizeof(uint32_t),
	                   false)) ||
	    (rc = grow_arr((void **)&tls.cand_pin, &tls.cand_pin_cap, cfg->max_ranks,
	                   sizeof(uint32_t), false)))
		return rc;
	if (q->tokens)
		kvr_hash_chain_tokens(NULL, q->tokens, nb, bs, seed, tls.local, tls.seq);
	else {
		memcpy(tls.local, q->local_hashes, nb * sizeof(uint64_t));
		kvr_hash_chain_locals(NULL, tls.local, nb, tls.seq);
	}
	uint64_t t1 = mono_ns();
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
		uint64_t t2s = mono_ns();
		size_t nm = 0;
		kvr_rcu_read_lock();
		const struct kvr_live *live = kvr_rcu_deref(&r->live);
		if (nb)
			kvr_index_find_matches(r->index, tls.seq, nb, NULL, tls.match,
			                       tls.match_cap, &nm);
		uint32_t best = 0;
		for (size_t i = 0; i < nm; i++) {
			tls.score[tls.match[i].slot] = tls.match[i].score;
			if (tls.match[i].score > best)
				best = tls.match[i].score;
		}
		/* Pinned depth per rank: one walk along the published pinned runs. */
		size_t np = nb ? kvr_pinmap_depths(r->pinmap, tls.seq, nb, tls.pin, tls.pslots) : 0;
		long nc = candidates(r, q, nb, live);
		kvr_rcu_read_unlock();
		for (size_t i = 0; i < nm; i++)
			tls.score[tls.match[i].slot] = 0;
		for (size_t i = 0; i < np; i++)
			tls.pin[tls.pslots[i]] = 0;
		KVR_PROBE3(match, nb, nm, best);
		uint64_t t2 = mono_ns();
		if (nc < 0) {
			kvr_metrics_add(mb, KVR_C_ROUTE_ERRORS, 1);
			return (int)nc;
		}
		/* One random stream per decision; query-only decisions read the counter without
		 * advancing it, so asking "where would it go?" never changes later decisions. */
		uint64_t k = (q->flags & KVR_ROUTE_QUERY_ONLY)
		                 ? __atomic_load_n(&r->rng_counter, __ATOMIC_RELAXED) ^ (1ull << 63)
		                 : __atomic_fetch_add(&r->rng_counter, 1, __ATOMIC_RELAXED);
		uint64_t rng = cfg->seed ^ (k * 0x9e3779b97f4a7c15ull);
		long pick = kvr_select(&sp, tls.cand, (size_t)nc, &rng);
		struct kvr_candidate chosen = tls.cand[pick];
		uint32_t chosen_pinned = tls.cand_pin[pick];
		struct kvr_rank_pub *pub = &r->ranks[chosen.slot];
		uint64_t gen = chosen.gen;
		uint64_t t3 = mono_ns();

		if (r->queue && !(q->flags & KVR_ROUTE_QUERY_ONLY)) {
			bool sat = true;
			for (long i = 0; i < nc && sat; i++)
				sat = kvr_queue_saturated(r, &tls.cand[i].slot, 1);
			if (sat && queue_mode == KVR_QUEUE_FROM_PUMP)
				return KVR_EAGAIN;
			if (sat) {
				uint64_t cached = (uint64_t)best * bs;
				return kvr_queue_push(
				    r, q, q->n_tokens > cached ? q->n_tokens - cached : 0, d);
			}
		}

		memset(d, 0, sizeof(*d));
		d->status = KVR_DECIDED;
		d->rank.worker_id = pub->worker_id;
		d->rank.dp_rank = pub->dp_rank;
		d->overlap_blocks = chosen.overlap_blocks;
		d->required_blocks = (uint32_t)nb;
		d->cached_tokens = (uint64_t)chosen.overlap_blocks * bs;
		d->cost = chosen.cost;
		kvr_metrics_observe(mb, KVR_H_HASH_NS, t1 - t0);
		kvr_metrics_observe(mb, KVR_H_MATCH_NS, t2 - t2s);
		kvr_metrics_observe(mb, KVR_H_SELECT_NS, t3 - t2);
		if (q->flags & KVR_ROUTE_QUERY_ONLY) {
			kvr_metrics_add(mb, KVR_C_ROUTES_QUERY_ONLY, 1);
			kvr_metrics_observe(mb, KVR_H_ROUTE_NS, mono_ns() - t0);
			KVR_PROBE4(route_end, q->request_id, chosen.slot, chosen.overlap_blocks, 0);
			return 0;
		}
		size_t tail_n = q->tokens ? q->n_tokens % bs : 0;
		struct kvr_admit_args a = {
		    .slot = chosen.slot,
		    .gen = gen,
		    .local = tls.local,
		    .seq = tls.seq,
		    .n = nb,
		    .prompt_tokens = q->n_tokens,
		    .tail = q->tokens ? q->tokens + nb * bs : NULL,
		    .tail_n = (uint32_t)tail_n,
		    .chain_known = q->tokens != NULL || q->n_tokens == nb * bs,
		    .lora_seed = seed,
		    .overlap = chosen.overlap_blocks,
		    .pend_blocks = nb - chosen_pinned, /* the request's new decode blocks there */
		};
		rc = kvr_admit(r, &a, cfg->sync_booking);
		uint64_t t4 = mono_ns();
		if (rc == KVR_ENOENT)
			continue; /* sync: the rank went away after selection: decide again */
		if (rc) {
			kvr_metrics_add(mb, KVR_C_ROUTE_ERRORS, 1);
			return rc;
		}
		d->attempt = a.attempt;
		kvr_repl_note_route(r, &a, d, q->expected_output_tokens); /* replica sync */
		kvr_metrics_add(mb, KVR_C_ROUTES, 1);
		kvr_metrics_add(mb, KVR_C_ROUTED_BLOCKS, nb);
		kvr_metrics_add(mb, KVR_C_PREDICTED_OVERLAP_BLOCKS, chosen.overlap_blocks);
		kvr_metrics_observe(mb, KVR_H_ADMIT_NS, t4 - t3);
		kvr_metrics_observe(mb, KVR_H_ROUTE_NS, t4 - t0);
		kvr_metrics_observe(mb, KVR_H_OVERLAP_BLOCKS, chosen.overlap_blocks);
		KVR_PROBE4(route_end, q->request_id, chosen.slot, chosen.overlap_blocks, 0);
		return 0;
	}
	kvr_metrics_add(mb, KVR_C_ROUTE_ERRORS, 1);
	return KVR_ENOENT;
}

int kvr_admit(struct kvr_router *r, struct kvr_admit_args *a, bool sync)
{
	struct kvr_rank_pub *pub = &r->ranks[a->slot];
	int rc = kvr_lease_mint(r->leases, a->slot, &a->attempt);
	if (rc)
		return rc;
	uint64_t cached = (uint64_t)a->overlap * r->cfg.block_size;
	a->pend_prefill_tokens = a->prompt_tokens > cached ? a->prompt_tokens - cached : 0;
	struct kvr_attempt *rec = kvr_owner_attempt_new(&r->owner, a);
	if (!rec) {
		kvr_lease_unmint(r->leases, a->attempt);
		return KVR_ENOMEM;
	}
	/* Provisional load: the very next decision, on any thread, sees this request. */
	__atomic_fetch_add(&pub->pend_prefill_tokens, a->pend_prefill_tokens, __ATOMIC_RELAXED);
	__atomic_fetch_add(&pub->pend_requests, 1, __ATOMIC_RELAXED);
	__atomic_fetch_add(&pub->pend_blocks, a->pend_blocks, __ATOMIC_RELAXED);
	struct kvr_shard *sh =
	    kvr_shards_get(r->shards, __atomic_load_n(&pub->shard, __ATOMIC_RELAXED));
	if (sync) {
		/* The booking consumes the record whatever it returns, once it runs. */
		rc = kvr_shard_call(sh, KVR_LANE_ROUTING, kvr_owner_book_call, rec);
		if (rc != KVR_ESHUTDOWN && rc != KVR_EINVAL)
			return rc;
	} else {
		rc = kvr_shard_post(sh, KVR_LANE_ROUTING, kvr_owner_book_task, &rec, sizeof(rec));
		if (rc == KVR_EAGAIN) {
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
	__atomic_fetch_sub(&pub->pend_prefill_tokens, a->pend_prefill_tokens, __ATOMIC_RELAXED);
	__atomic_fetch_sub(&pub->pend_requests, 1, __ATOMIC_RELAXED);
	__atomic_fetch_sub(&pub->pend_blocks, a->pend_blocks, __ATOMIC_RELAXED);
	kvr_lease_unmint(r->leases, a->attempt);
	kvr_owner_attempt_free(&r->owner, rec);
	return rc == KVR_ETIMEDOUT ? KVR_EAGAIN : rc;
}

int kvr_route(struct kvr_router *r, const struct kvr_request *req, struct kvr_decision *d)
{
	if (!r || !d)
		return KVR_EINVAL;
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	int rc = validate(r, req);
	if (rc)
		return rc;
	if ((rc = kvr_rcu_thread_online()))
		return rc;
	if (r->queue && kvr_queue_depth(r))
		kvr_queue_pump(r); /* those waiting go first */
	rc = kvr_route_internal(r, req, d, KVR_QUEUE_IF_SATURATED);
	if (rc == 0 && d->status == KVR_QUEUED && (req->flags & KVR_ROUTE_WAIT))
		return kvr_route_wait(r, d->ticket, req->deadline_ns, d);
	return rc;
}
