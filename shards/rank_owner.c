/*
 * shards/rank_owner.c - the shard-thread side of the router: everything that changes a rank's
 * state runs here, on the one thread that owns the rank, reached by kvr_shard_call from the
 * caller side in core/.
 *
 * Per rank (struct kvr_rank_owned): the predicted cache (shards/rank_state: the capacity-bounded
 * LRU, or TTL retention), the active load (shards/load), the KV event cursor, and the list of
 * the rank's live attempts.  Per shard (struct kvr_shard_state): one lease table for all its
 * ranks (shards/lease: the CLOCK reaper scans it on a timer), the attempt records indexed by
 * lease slot, and scratch buffers, so a steady-state admission allocates only its attempt
 * record.
 *
 * Index writes: the rank's shard is the only writer of the rank's index entries.  The LRU and
 * TTL report what became present (stored runs: ranges of the command's input blocks) and what
 * went (evicted runs); the index gets the evictions first, then each stored range as one chain
 * run below the block before it (held, so the index accepts the run; re-storing held blocks is a
 * no-op).  If the parent was evicted by an unusual copy order, the whole prompt chain is stored
 * from the root instead, which is always valid because every block of the prompt is resident.
 *
 * After every change the rank's load snapshot (struct kvr_rank_pub) is republished with relaxed
 * stores, which is what routing threads read.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/probes.h"
#include "core/router_internal.h"
#include "shards/load.h"
#include "shards/rank_state.h"
#include "shards/ttl.h"
#include "sync/rcu.h"

struct attempt_rec {
	uint64_t attempt;
	uint64_t incarnation;
	uint64_t last_seq; /* sequence hash of the last complete block (prompt, then output) */
	uint64_t lora_seed;
	uint32_t slot;
	uint32_t lease_slot;
	uint32_t n_blocks; /* complete blocks so far */
	uint32_t n_prompt; /* complete blocks of the prompt (copied after tail[]) */
	uint32_t tail_n;   /* tokens of the partial block (KV computed) */
	uint32_t pending;  /* the last output token reported: no KV until a later one comes */
	uint32_t overlap;  /* predicted cached prefix at the decision */
	uint64_t prompt_tokens;
	size_t size; /* bytes allocated for this record */
	bool has_last;
	bool has_pending;
	bool booked;       /* the predicted cache holds a lease for it (booking did not fail) */
	bool book_pending; /* admitted, booking not done yet (see kvr_owner_admit) */
	bool chain_known;
	bool in_prefill;
	struct attempt_rec *prev, *next; /* the rank's live attempts */
	uint32_t tail[];                 /* block_size tokens */
};

struct kvr_rank_owned {
	struct kvr_rank_state *rs; /* NULL in events mode */
	struct kvr_load *load;
	uint64_t incarnation;
	uint64_t capacity;
	uint64_t last_event_id;
	bool have_event;
	uint64_t gaps;
	uint64_t evictions;
	struct attempt_rec *attempts;
	uint64_t ttl_timer;
	uint64_t ttl_deadline; /* UINT64_MAX: no timer armed */
	uint32_t slot;
	struct kvr_rank_owned *prev, *next; /* the shard's ranks */
};

struct kvr_shard_state {
	struct kvr_router *r;
	struct kvr_lease_table *leases;
	struct attempt_rec **by_lease;
	uint32_t by_lease_cap;
	struct kvr_lru_out out;
	struct kvr_lease_expired exp[1024];
	struct kvr_index_block *blk;
	size_t blk_cap;
	struct kvr_lru_block *lb;
	size_t lb_cap;
	uint64_t *seq;
	size_t seq_cap;
	struct kvr_rank_owned *ranks; /* every rank this shard owns */
	bool reaper_armed;            /* the lease reaper's timer is pending */
	bool timers_broken;           /* a timer could not be armed: retry on the next call */
};

static inline uint64_t now_ns(struct kvr_router *r)
{
	return kvr_clock_now(&r->clock);
}

static inline struct kvr_shard_state *state_of(struct kvr_shard *sh)
{
	return kvr_shard_userdata(sh);
}

static int grow(void **buf, size_t *cap, size_t need, size_t elem)
{
	if (need <= *cap)
		return 0;
	size_t nc = *cap ? *cap : 64;
	while (nc < need)
		nc *= 2;
	void *p = kvr_realloc(*buf, *cap * elem, nc * elem);
	if (!p)
		return KVR_ENOMEM;
	*buf = p;
	*cap = nc;
	return 0;
}

/* Republishes the rank's load snapshot.  Ordering: relaxed stores; single writer. */
static void publish(struct kvr_router *r, struct kvr_rank_pub *pub, struct kvr_rank_owned *own)
{
	struct kvr_load_stats st;
	kvr_load_stats(own->load, &st);
	uint64_t resident = 0;
	if (own->rs) {
		const struct kvr_lru *lru = kvr_rank_state_lru(own->rs);
		if (lru) {
			struct kvr_lru_stats ls;
			kvr_lru_stats(lru, &ls);
			resident = ls.hashes;
		} else {
			resident = kvr_index_tree_size(r->index, own->slot);
		}
	} else {
		resident = kvr_index_tree_size(r->index, own->slot);
	}
	__atomic_store_n(&pub->active_blocks, st.active_blocks, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->prefill_tokens, kvr_load_prefill_tokens(own->load, now_ns(r)),
	                 __ATOMIC_RELAXED);
	__atomic_store_n(&pub->active_requests, st.active_requests, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->resident_blocks, resident, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->incarnation, own->incarnation, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->capacity, own->capacity, __ATOMIC_RELAXED);
}

/* Applies what the predicted cache reported, except stored blocks (the caller knows the chain). */
static void apply_removals(struct kvr_router *r, struct kvr_rank_owned *own,
                           const struct kvr_lru_out *out)
{
	if (out->cleared)
		kvr_index_clear_rank(r->index, own->slot);
	if (out->n_evicted) {
		kvr_index_remove(r->index, own->slot, out->evicted_seq, out->n_evicted, NULL);
		own->evictions += out->n_evicted;
		kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_EVICTIONS, out->n_evicted);
		KVR_PROBE2(evict, own->slot, out->n_evicted);
	}
}

/* Stores seq/local[p0..n) as one chain below seq[p0-1] (root when p0 == 0 and no parent).
 * A write that fails (out of memory) leaves the index without blocks the predicted cache holds:
 * routing then under-estimates that rank's overlap, which is safe, and it is counted
 * (kvr_shard_errors_total{what="index_write"}), never silent. */
static int store_run(struct kvr_shard_state *ss, struct kvr_rank_owned *own, const uint64_t *parent,
                     const uint64_t *local, const uint64_t *seq, size_t p0, size_t n)
{
	if (p0 >= n)
		return 0;
	int rc = grow((void **)&ss->blk, &ss->blk_cap, n, sizeof(*ss->blk));
	if (rc == 0) {
		for (size_t i = p0; i < n; i++)
			ss->blk[i] =
			    (struct kvr_index_block){.ext_hash = seq[i], .local_hash = local[i]};
		const uint64_t *par = p0 > 0 ? &seq[p0 - 1] : parent;
		rc = kvr_index_store(ss->r->index, own->slot, par, ss->blk + p0, n - p0);
		if (rc == KVR_ENOENT && p0 > 0 && !parent)
			rc = kvr_index_store(ss->r->index, own->slot, NULL, ss->blk, n);
	}
	if (rc)
		kvr_metrics_add(kvr_metrics_local(ss->r->metrics), KVR_C_SHARD_INDEX_WRITE_ERRORS,
		                1);
	return rc;
}

/* Stores what the predicted cache reported as stored: ranges of the command's input blocks
 * (local/seq), each one run below the block before it (or *parent / the root at 0). */
static void store_runs(struct kvr_shard_state *ss, struct kvr_rank_owned *own,
                       const uint64_t *parent, const uint64_t *local, const uint64_t *seq,
                       const struct kvr_lru_out *out)
{
	for (size_t k = 0; k < out->n_stored_runs; k++) {
		const struct kvr_lru_range *g = &out->stored[k];
		store_run(ss, own, parent, local, seq, g->first, (size_t)g->first + g->n);
	}
}

static void ttl_fire(struct kvr_shard *sh, void *arg);

/* TTL retention: keeps one timer armed at the earliest expiry. */
static void arm_ttl(struct kvr_shard *sh, struct kvr_rank_owned *own)
{
	if (!own->rs || kvr_rank_state_mode(own->rs) != KVR_RANK_TTL)
		return;
	uint64_t d = kvr_rank_state_next_deadline(own->rs);
	if (d == UINT64_MAX || d >= own->ttl_deadline)
		return;
	if (own->ttl_deadline != UINT64_MAX)
		kvr_shard_timer_cancel(sh, own->ttl_timer);
	if (kvr_shard_timer_add(sh, d, ttl_fire, own, &own->ttl_timer) == 0) {
		own->ttl_deadline = d;
	} else {
		/* Out of memory: counted, and retried on the shard's next call (retry_timers). */
		own->ttl_deadline = UINT64_MAX;
		state_of(sh)->timers_broken = true;
		kvr_metrics_add(kvr_metrics_local(state_of(sh)->r->metrics),
		                KVR_C_SHARD_TIMER_ERRORS, 1);
	}
}

static void ttl_fire(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_owned *own = arg;
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_router *r = ss->r;
	own->ttl_deadline = UINT64_MAX;
	if (kvr_rank_state_tick(own->rs, now_ns(r), &ss->out) == 0) {
		kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_TTL_EXPIRIES,
		                ss->out.n_evicted);
		apply_removals(r, own, &ss->out);
	}
	publish(r, &r->ranks[own->slot], own);
	arm_ttl(sh, own);
}

/* ---------------------------------------------------------------- attempts */

static void unlink_rec(struct kvr_rank_owned *own, struct attempt_rec *rec)
{
	if (rec->prev)
		rec->prev->next = rec->next;
	else
		own->attempts = rec->next;
	if (rec->next)
		rec->next->prev = rec->prev;
}

/* Ends a claimed attempt: releases its blocks (unless the rank's state is being dropped), its
 * load, its lease and its record. */
static void end_attempt(struct kvr_shard *sh, struct attempt_rec *rec, bool release_blocks)
{
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_router *r = ss->r;
	struct kvr_rank_pub *pub = &r->ranks[rec->slot];
	struct kvr_rank_owned *own = pub->own;
	if (own) {
		if (release_blocks && own->rs && rec->incarnation == own->incarnation &&
		    kvr_rank_state_release(own->rs, own->incarnation, rec->attempt, &ss->out) == 0)
			apply_removals(r, own, &ss->out);
		kvr_load_finish(own->load, rec->attempt);
		unlink_rec(own, rec);
		publish(r, pub, own);
	}
	ss->by_lease[rec->lease_slot] = NULL;
	kvr_lease_end(ss->leases, rec->attempt);
	kvr_free(rec, rec->size);
}

/* Claims and ends every live attempt of the rank (reset, new incarnation, removal). */
static void end_all_attempts(struct kvr_shard *sh, struct kvr_rank_owned *own)
{
	struct kvr_shard_state *ss = state_of(sh);
	while (own->attempts) {
		struct attempt_rec *rec = own->attempts;
		kvr_lease_claim(ss->leases, rec->lease_slot, rec->attempt);
		end_attempt(sh, rec, false);
	}
}

static void book(struct kvr_shard *sh, struct attempt_rec *rec);
static void arm_reaper(struct kvr_shard *sh, uint64_t when);

static void reaper_fire(struct kvr_shard *sh, void *arg)
{
	(void)arg;
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_router *r = ss->r;
	uint64_t now = now_ns(r);
	size_t n;
	do {
		n = 0;
		kvr_lease_tick(ss->leases, now, ss->exp, sizeof(ss->exp) / sizeof(ss->exp[0]), &n);
		for (size_t i = 0; i < n; i++) {
			struct attempt_rec *rec = ss->by_lease[ss->exp[i].slot];
			if (!rec)
				continue;
			KVR_PROBE2(lease_expire, rec->slot, rec->attempt);
			kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_LEASE_EXPIRIES, 1);
			book(sh, rec);
			end_attempt(sh, rec, true);
		}
		/* More than a batch stays QUIET and expires on the next scan (lease.h). */
	} while (0);
	ss->reaper_armed = false;
	arm_reaper(sh, now + r->cfg.lease_scan_interval_ns);
}

/* Arms the lease reaper at `when`.  A failure (out of memory in the timer heap) is counted and
 * retried on the shard's next call, so one failed allocation never stops lease expiry. */
static void arm_reaper(struct kvr_shard *sh, uint64_t when)
{
	struct kvr_shard_state *ss = state_of(sh);
	if (kvr_shard_timer_add(sh, when, reaper_fire, NULL, NULL) == 0) {
		ss->reaper_armed = true;
		return;
	}
	ss->timers_broken = true;
	kvr_metrics_add(kvr_metrics_local(ss->r->metrics), KVR_C_SHARD_TIMER_ERRORS, 1);
}

/* Re-arms what a failed timer allocation left unarmed.  Called at the top of every shard-side
 * entry point; costs one branch when nothing failed. */
static void retry_timers(struct kvr_shard *sh)
{
	struct kvr_shard_state *ss = state_of(sh);
	if (!ss || !ss->timers_broken)
		return;
	ss->timers_broken = false;
	if (!ss->reaper_armed)
		arm_reaper(sh, now_ns(ss->r));
	for (struct kvr_rank_owned *own = ss->ranks; own; own = own->next)
		arm_ttl(sh, own);
}

/* ---------------------------------------------------------------- shard life */

void kvr_owner_shard_start(struct kvr_shard *sh, void *router)
{
	struct kvr_router *r = router;
	struct kvr_shard_state *ss = kvr_calloc(1, sizeof(*ss));
	if (!ss)
		return; /* every call on this shard then fails with KVR_ENOMEM (see need_state) */
	ss->r = r;
	kvr_lru_out_init(&ss->out);
	uint64_t now = now_ns(r);
	if (kvr_lease_table_create(r->cfg.lease_scan_interval_ns, now, &ss->leases)) {
		kvr_free(ss, sizeof(*ss));
		return;
	}
	kvr_shard_set_userdata(sh, ss);
	arm_reaper(sh, now + r->cfg.lease_scan_interval_ns);
}

void kvr_owner_shard_stop(struct kvr_shard *sh, void *router)
{
	struct kvr_router *r = router;
	struct kvr_shard_state *ss = state_of(sh);
	if (!ss)
		return;
	/* The ranks still here at shutdown go with their attempts and index entries. */
	while (ss->ranks) {
		struct kvr_rank_args a = {.r = r, .slot = ss->ranks->slot};
		kvr_owner_rank_destroy(sh, &a);
	}
	kvr_lease_table_destroy(ss->leases);
	kvr_lru_out_fini(&ss->out);
	kvr_free(ss->by_lease, ss->by_lease_cap * sizeof(*ss->by_lease));
	kvr_free(ss->blk, ss->blk_cap * sizeof(*ss->blk));
	kvr_free(ss->lb, ss->lb_cap * sizeof(*ss->lb));
	kvr_free(ss->seq, ss->seq_cap * sizeof(*ss->seq));
	kvr_free(ss, sizeof(*ss));
	kvr_shard_set_userdata(sh, NULL);
}

/* ---------------------------------------------------------------- ranks */

static uint64_t initial_capacity(struct kvr_router *r, uint64_t capacity)
{
	if (r->cfg.mode == KVR_MODE_APPROX_TTL || capacity == KVR_CAPACITY_NONE)
		return 0;
	return capacity;
}

int kvr_owner_rank_create(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	struct kvr_router *r = a->r;
	if (!state_of(sh))
		return KVR_ENOMEM;
	struct kvr_rank_owned *own = kvr_calloc(1, sizeof(*own));
	if (!own)
		return KVR_ENOMEM;
	int rc = kvr_load_create(r->cfg.expected_prefill_ns, &own->load);
	if (rc)
		goto fail;
	if (r->cfg.mode != KVR_MODE_EVENTS) {
		rc = kvr_rank_state_create(r->cfg.ttl_ns, KVR_TTL_BUCKET_NS, &own->rs);
		if (rc)
			goto fail;
		kvr_rank_state_set_keep_private(own->rs, true); /* as vLLM's free queue */
		rc = kvr_rank_state_set_capacity(
		    own->rs, a->incarnation, initial_capacity(r, a->capacity), &state_of(sh)->out);
		if (rc)
			goto fail;
	}
	uint32_t slot;
	rc = kvr_index_rank_add(r->index, a->worker_id, a->dp_rank, &slot);
	if (rc)
		goto fail;
	if (slot >= r->cfg.max_ranks) {
		kvr_index_rank_remove(r->index, slot);
		rc = KVR_ERANGE;
		goto fail;
	}
	own->incarnation = a->incarnation;
	own->capacity = a->capacity;
	own->ttl_deadline = UINT64_MAX;
	own->slot = slot;
	struct kvr_rank_pub *pub = &r->ranks[slot];
	/* Identity: atomic stores, since a stale attempt id may still lead a caller to read this
	 * slot's shard while the slot is being reused (it then gets KVR_ESTALE from that shard). */
	__atomic_store_n(&pub->worker_id, a->worker_id, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->dp_rank, a->dp_rank, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->shard, kvr_shard_index(sh), __ATOMIC_RELAXED);
	__atomic_store_n(&pub->max_batched_tokens, a->max_batched_tokens, __ATOMIC_RELAXED);
	pub->own = own;
	struct kvr_shard_state *ss = state_of(sh);
	own->next = ss->ranks;
	if (ss->ranks)
		ss->ranks->prev = own;
	ss->ranks = own;
	publish(r, pub, own);
	a->slot = slot;
	return 0;
fail:
	kvr_rank_state_destroy(own->rs);
	kvr_load_destroy(own->load);
	kvr_free(own, sizeof(*own));
	return rc;
}

/* The rank's owned state if the slot still holds the generation the caller saw. */
static struct kvr_rank_owned *owned(struct kvr_router *r, uint32_t slot, uint64_t gen)
{
	if (slot >= r->cfg.max_ranks)
		return NULL;
	struct kvr_rank_pub *pub = &r->ranks[slot];
	if (!__atomic_load_n(&pub->live, __ATOMIC_ACQUIRE) ||
	    __atomic_load_n(&pub->gen, __ATOMIC_ACQUIRE) != gen)
		return NULL;
	return pub->own;
}

int kvr_owner_rank_destroy(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_rank_pub *pub = &r->ranks[a->slot];
	struct kvr_rank_owned *own = pub->own;
	if (!own)
		return KVR_ENOENT;
	end_all_attempts(sh, own);
	if (own->ttl_deadline != UINT64_MAX)
		kvr_shard_timer_cancel(sh, own->ttl_timer);
	kvr_rank_state_destroy(own->rs);
	kvr_load_destroy(own->load);
	kvr_index_rank_remove(r->index, a->slot);
	struct kvr_shard_state *ss = state_of(sh);
	if (own->prev)
		own->prev->next = own->next;
	else
		ss->ranks = own->next;
	if (own->next)
		own->next->prev = own->prev;
	pub->own = NULL;
	__atomic_store_n(&pub->active_blocks, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->prefill_tokens, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->active_requests, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->resident_blocks, 0, __ATOMIC_RELAXED);
	kvr_free(own, sizeof(*own));
	return 0;
}

/* A new life of the rank: its attempts end, its predicted cache and index entries go. */
static int new_life(struct kvr_shard *sh, struct kvr_rank_owned *own, uint64_t incarnation,
                    uint64_t capacity)
{
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_router *r = ss->r;
	end_all_attempts(sh, own);
	if (own->rs) {
		if (kvr_rank_state_mode(own->rs) != KVR_RANK_ABSENT &&
		    kvr_rank_state_reset(own->rs, &ss->out) == 0)
			apply_removals(r, own, &ss->out);
		int rc = kvr_rank_state_set_capacity(own->rs, incarnation,
		                                     initial_capacity(r, capacity), &ss->out);
		if (rc)
			return rc;
		apply_removals(r, own, &ss->out);
	} else {
		kvr_index_clear_rank(r->index, own->slot);
	}
	own->incarnation = incarnation;
	own->capacity = capacity;
	own->have_event = false;
	return 0;
}

/* The predicted cache was rebuilt in another mode: it holds no lease of the live attempts any
 * more, so their later output is tracked for load only (see output()). */
static void forget_bookings(struct kvr_rank_owned *own)
{
	for (struct attempt_rec *rec = own->attempts; rec; rec = rec->next)
		rec->booked = false;
}

int kvr_owner_rank_capacity(struct kvr_shard *sh, void *arg)
{
	retry_timers(sh);
	struct kvr_rank_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_rank_owned *own = owned(r, a->slot, a->gen);
	struct kvr_shard_state *ss = state_of(sh);
	if (!own)
		return KVR_ENOENT;
	if (a->incarnation < own->incarnation)
		return KVR_ESTALE;
	int rc = 0;
	if (a->incarnation != own->incarnation) {
		rc = new_life(sh, own, a->incarnation, a->capacity);
	} else if (own->rs) {
		enum kvr_rank_mode before = kvr_rank_state_mode(own->rs);
		uint64_t cap = initial_capacity(r, a->capacity);
		rc = kvr_rank_state_set_capacity(own->rs, own->incarnation, cap, &ss->out);
		if (rc == KVR_EBUSY && before == KVR_RANK_TTL && cap > 0) {
			/* TTL retention -> a finite capacity, same life: the predicted cache starts
			 * over as an LRU (the TTL state cannot be turned into one). */
			if ((rc = kvr_rank_state_reset(own->rs, &ss->out)) == 0) {
				apply_removals(r, own, &ss->out);
				rc = kvr_rank_state_set_capacity(own->rs, own->incarnation, cap,
				                                 &ss->out);
			}
		}
		if (rc == 0) {
			apply_removals(r, own, &ss->out);
			own->capacity = a->capacity;
			if (kvr_rank_state_mode(own->rs) != before)
				forget_bookings(own);
		}
	} else {
		own->capacity = a->capacity;
	}
	publish(r, &r->ranks[a->slot], own);
	return rc;
}

int kvr_owner_rank_reset(struct kvr_shard *sh, void *arg)
{
	retry_timers(sh);
	struct kvr_rank_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_rank_owned *own = owned(r, a->slot, a->gen);
	if (!own)
		return KVR_ENOENT;
	if (a->incarnation < own->incarnation)
		return KVR_ESTALE;
	int rc = new_life(sh, own, a->incarnation, own->capacity);
	publish(r, &r->ranks[a->slot], own);
	return rc;
}

static void book(struct kvr_shard *sh, struct attempt_rec *rec);

/* Books the rank's admitted-but-unbooked attempts, so a snapshot counts every attempt kvr_route
 * has returned (found by fuzz_api: active_requests 0 right after a decision). */
static void book_pending(struct kvr_shard *sh, struct kvr_rank_owned *own)
{
	for (struct attempt_rec *rec = own->attempts; rec; rec = rec->next)
		book(sh, rec);
}

int kvr_owner_rank_stats(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_rank_owned *own = owned(r, a->slot, a->gen);
	if (!own)
		return KVR_ENOENT;
	book_pending(sh, own);
	struct kvr_rank_stats *st = a->stats;
	struct kvr_load_stats ls;
	kvr_load_stats(own->load, &ls);
	memset(st, 0, sizeof(*st));
	st->incarnation = own->incarnation;
	st->capacity_blocks = own->capacity;
	st->indexed_blocks = kvr_index_tree_size(r->index, a->slot);
	st->resident_blocks = st->indexed_blocks;
	if (own->rs && kvr_rank_state_lru(own->rs)) {
		struct kvr_lru_stats lst;
		kvr_lru_stats(kvr_rank_state_lru(own->rs), &lst);
		st->resident_blocks = lst.hashes;
	}
	st->active_blocks = ls.active_blocks;
	st->active_prefill_tokens = kvr_load_prefill_tokens(own->load, now_ns(r));
	st->active_requests = ls.active_requests;
	st->evictions = own->evictions;
	st->event_id = own->last_event_id;
	st->event_gaps = own->gaps;
	return 0;
}

int kvr_owner_rank_blocks(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	struct kvr_rank_owned *own = owned(a->r, a->slot, a->gen);
	if (!own)
		return KVR_ENOENT;
	book_pending(sh, own);
	a->n = kvr_index_rank_blocks(a->r->index, a->slot, a->blocks, a->cap);
	return a->n > a->cap ? KVR_ERANGE : 0;
}

/* ---------------------------------------------------------------- requests */

static int lru_blocks(struct kvr_shard_state *ss, const uint64_t *local, const uint64_t *seq,
                      size_t n)
{
	if (grow((void **)&ss->lb, &ss->lb_cap, n ? n : 1, sizeof(*ss->lb)))
		return KVR_ENOMEM;
	for (size_t i = 0; i < n; i++)
		ss->lb[i] = (struct kvr_lru_block){.local = local[i], .seq = seq[i]};
	return 0;
}

/*
 * Admission in two steps.  The synchronous call (kvr_owner_admit) only books what the decision
 * needs to be final: the lease, the attempt record with a copy of the prompt's block hashes, and
 * a provisional bump of the published load, then replies.  The expensive part, the LRU acquire
 * (hits, new copies, evictions) with its index writes and the exact load booking (book()), is
 * a maintenance-lane task: routing work (other admissions) runs ahead of it, as the biased
 * scheduler intends, and it still runs within the scheduler's bound.  Anything that later
 * happens to the attempt on this shard (prefill done, output, finish, abort, expiry) books it
 * first if the task has not run yet, so no command ever sees an unbooked attempt; a reset or
 * removal ends it unbooked, and the task then finds the lease gone.  With sync_booking, or
 * if the lane is full, the booking runs inline before the reply.  Effect: the frontend waits
 * for microseconds of bookkeeping, not for hundreds of block copies and index writes queued
 * behind earlier bookings (see perf/bench_route).
 */
struct admit_book_msg {
	uint64_t attempt;
};

/* The prompt's blocks are stored after the tail tokens, 16-byte aligned. */
static inline size_t rec_blocks_off(uint32_t bs)
{
	return sizeof(struct attempt_rec) + (((size_t)bs * sizeof(uint32_t) + 15) & ~(size_t)15);
}

static inline struct kvr_lru_block *rec_blocks(struct attempt_rec *rec, uint32_t bs)
{
	return (struct kvr_lru_block *)(void *)((char *)rec + rec_blocks_off(bs));
}

/* Books an admitted attempt's prompt in the predicted cache, the index and the load, once. */
static void book(struct kvr_shard *sh, struct attempt_rec *rec)
{
	if (!rec->book_pending)
		return;
	rec->book_pending = false;
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_router *r = ss->r;
	struct kvr_rank_pub *pub = &r->ranks[rec->slot];
	struct kvr_rank_owned *own = pub->own;
	if (!own || rec->incarnation != own->incarnation)
		return;
	uint32_t bs = r->cfg.block_size;
	struct kvr_lru_block *b = rec_blocks(rec, bs);
	size_t n = rec->n_prompt;
	uint64_t now = now_ns(r);
	if (grow((void **)&ss->seq, &ss->seq_cap, 2 * (n ? n : 1), sizeof(*ss->seq)) == 0) {
		uint64_t *local = ss->seq, *seq = ss->seq + n;
		for (size_t i = 0; i < n; i++) {
			local[i] = b[i].local;
			seq[i] = b[i].seq;
		}
		if (own->rs) {
			uint32_t priv = rec->tail_n > 0 || !rec->chain_known ? 1 : 0;
			if (kvr_rank_state_acquire(own->rs, own->incarnation, rec->attempt, b, n,
			                           priv, now, &ss->out) == 0) {
				rec->booked = true;
				apply_removals(r, own, &ss->out);
				store_runs(ss, own, NULL, local, seq, &ss->out);
				arm_ttl(sh, own);
			}
		}
		uint64_t cached = (uint64_t)rec->overlap * bs;
		kvr_load_add(own->load, rec->attempt, seq, n,
		             rec->prompt_tokens > cached ? rec->prompt_tokens - cached : 0, now);
	}
	publish(r, pub, own);
	KVR_PROBE4(admit, rec->slot, rec->attempt, n, ss->out.n_evicted);
}

/* The maintenance-lane task that books an attempt, unless something booked or ended it first. */
static void admit_book(struct kvr_shard *sh, void *payload)
{
	struct admit_book_msg m;
	memcpy(&m, payload, sizeof(m));
	struct kvr_shard_state *ss = state_of(sh);
	uint32_t lslot;
	if (kvr_lease_find(ss->leases, m.attempt, &lslot) != 0)
		return; /* ended (rank reset or removed) before it was booked */
	book(sh, ss->by_lease[lslot]);
}

int kvr_owner_admit(struct kvr_shard *sh, void *arg)
{
	retry_timers(sh);
	struct kvr_admit_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_rank_owned *own = owned(r, a->slot, a->gen);
	if (!ss)
		return KVR_ENOMEM;
	if (!own)
		return KVR_ENOENT;
	uint32_t bs = r->cfg.block_size;
	size_t size = rec_blocks_off(bs) + a->n * sizeof(struct kvr_lru_block);
	struct attempt_rec *rec = kvr_alloc(size);
	if (!rec)
		return KVR_ENOMEM;
	uint32_t lslot;
	int rc = kvr_lease_begin(ss->leases, a->attempt, &lslot);
	if (rc == 0 && lslot >= ss->by_lease_cap) {
		size_t cap = ss->by_lease_cap;
		rc = grow((void **)&ss->by_lease, &cap, (size_t)lslot + 1, sizeof(*ss->by_lease));
		if (rc == 0) {
			memset(ss->by_lease + ss->by_lease_cap, 0,
			       (cap - ss->by_lease_cap) * sizeof(*ss->by_lease));
			ss->by_lease_cap = (uint32_t)cap;
		} else {
			kvr_lease_claim(ss->leases, lslot, a->attempt);
			kvr_lease_end(ss->leases, a->attempt);
		}
	}
	if (rc) {
		kvr_free(rec, size);
		return rc;
	}
	memset(rec, 0, sizeof(*rec));
	rec->size = size;
	rec->attempt = a->attempt;
	rec->incarnation = own->incarnation;
	rec->slot = a->slot;
	rec->lease_slot = lslot;
	rec->n_blocks = (uint32_t)a->n;
	rec->n_prompt = (uint32_t)a->n;
	rec->prompt_tokens = a->prompt_tokens;
	rec->overlap = a->overlap;
	rec->has_last = a->n > 0;
	rec->last_seq = a->n > 0 ? a->seq[a->n - 1] : 0;
	rec->lora_seed = a->lora_seed;
	rec->chain_known = a->chain_known;
	rec->in_prefill = true;
	rec->book_pending = true;
	rec->tail_n = a->chain_known ? a->tail_n : 0;
	if (rec->tail_n)
		memcpy(rec->tail, a->tail, rec->tail_n * sizeof(uint32_t));
	struct kvr_lru_block *b = rec_blocks(rec, bs);
	for (size_t i = 0; i < a->n; i++)
		b[i] = (struct kvr_lru_block){.local = a->local[i], .seq = a->seq[i]};
	rec->next = own->attempts;
	if (own->attempts)
		own->attempts->prev = rec;
	own->attempts = rec;
	ss->by_lease[lslot] = rec;
	/* Provisional load, so decisions taken before the booking see this request. */
	struct kvr_rank_pub *pub = &r->ranks[a->slot];
	uint64_t cached = (uint64_t)a->overlap * bs;
	uint64_t uncached = a->prompt_tokens > cached ? a->prompt_tokens - cached : 0;
	__atomic_store_n(&pub->prefill_tokens,
	                 __atomic_load_n(&pub->prefill_tokens, __ATOMIC_RELAXED) + uncached,
	                 __ATOMIC_RELAXED);
	__atomic_store_n(&pub->active_requests,
	                 __atomic_load_n(&pub->active_requests, __ATOMIC_RELAXED) + 1,
	                 __ATOMIC_RELAXED);
	struct admit_book_msg m = {.attempt = a->attempt};
	if (r->cfg.sync_booking || kvr_shard_post(sh, KVR_LANE_MAINT, admit_book, &m, sizeof(m)))
		book(sh, rec); /* asked for, or the lane is full or shutting down: book now */
	return 0;
}

/* Output tokens: complete blocks are hashed (chained after the last one), materialized in the
 * predicted cache and stored in the index.  vLLM computes a token's KV only when it feeds the
 * token back to sample the next one, so the last token reported so far has no KV yet: it is held
 * back (rec->pending) and joins the tail when a later token arrives.  A block therefore counts
 * as cached once a token after it has been reported; at finish or abort the held token is
 * dropped, so a block only the final token would complete is never predicted, and the tail
 * (computed tokens only) keeps the private block vLLM holds for it: after P prompt and O output
 * tokens the rank holds ceil((P+O-1)/B) blocks and caches floor((P+O-1)/B), as vLLM does. */
static int output(struct kvr_shard *sh, struct kvr_rank_owned *own, struct attempt_rec *rec,
                  const uint32_t *tok, size_t n)
{
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_router *r = ss->r;
	uint32_t bs = r->cfg.block_size;
	if (!rec->chain_known || !own->rs || !rec->booked || rec->incarnation != own->incarnation)
		return 0; /* tracked for liveness only */
	/* Computed now: the held-back token, then all new tokens but the last, which is held. */
	bool held = n > 0 && rec->has_pending;
	bool hold = n > 0;
	uint32_t next_pending = hold ? tok[n - 1] : 0;
	n -= hold ? 1 : 0;
	size_t max_blocks = (rec->tail_n + n + (held ? 1 : 0)) / bs;
	if (grow((void **)&ss->seq, &ss->seq_cap, 2 * (max_blocks ? max_blocks : 1),
	         sizeof(*ss->seq)))
		return KVR_ENOMEM;
	uint64_t *local = ss->seq, *seq = ss->seq + max_blocks;
	size_t nb = 0;
	uint64_t parent = rec->last_seq;
	bool has_parent = rec->has_last;
	while (held || n > 0) {
		if (held) {
			rec->tail[rec->tail_n++] = rec->pending;
			held = false;
		} else {
			uint32_t take = bs - rec->tail_n;
			if (take > n)
				take = (uint32_t)n;
			memcpy(rec->tail + rec->tail_n, tok, take * sizeof(uint32_t));
			rec->tail_n += take;
			tok += take;
			n -= take;
		}
		if (rec->tail_n == bs) {
			const uint64_t *par = nb ? &seq[nb - 1] : (has_parent ? &parent : NULL);
			kvr_hash_chain_tokens(par, rec->tail, 1, bs, rec->lora_seed, &local[nb],
			                      &seq[nb]);
			nb++;
			rec->tail_n = 0;
		}
	}
	if (hold) {
		rec->pending = next_pending;
		rec->has_pending = true;
	}
	uint32_t priv = rec->tail_n > 0 ? 1 : 0;
	int rc = lru_blocks(ss, local, seq, nb);
	if (rc == 0)
		rc = kvr_rank_state_materialize(own->rs, own->incarnation, rec->attempt, parent,
		                                ss->lb, nb, rec->n_blocks, priv,
		                                kvr_clock_now(&r->clock), &ss->out);
	if (rc == KVR_ENOENT) {
		rec->booked = false; /* the predicted cache no longer knows it: load only */
		return 0;
	}
	if (rc)
		return rc;
	apply_removals(r, own, &ss->out);
	if (nb) {
		store_runs(ss, own, has_parent ? &parent : NULL, local, seq, &ss->out);
		kvr_load_add_output(own->load, rec->attempt, seq, nb);
		rec->last_seq = seq[nb - 1];
		rec->has_last = true;
		rec->n_blocks += (uint32_t)nb;
	}
	arm_ttl(sh, own);
	return 0;
}

int kvr_owner_progress(struct kvr_shard *sh, void *arg)
{
	retry_timers(sh);
	struct kvr_progress_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_shard_state *ss = state_of(sh);
	if (!ss)
		return KVR_ENOMEM;
	uint32_t lslot;
	if (kvr_lease_find(ss->leases, a->attempt, &lslot) != 0)
		return KVR_ESTALE; /* ended, expired, or its rank reset or removed */
	struct attempt_rec *rec = ss->by_lease[lslot];
	book(sh, rec); /* anything the attempt does comes after its booking */
	struct kvr_rank_pub *pub = &r->ranks[rec->slot];
	struct kvr_rank_owned *own = pub->own;
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	int rc = 0;
	switch (a->op) {
	case KVR_OP_PREFILL_DONE:
		kvr_lease_touch(ss->leases, lslot, a->attempt);
		if (rec->in_prefill) {
			rec->in_prefill = false;
			kvr_load_prefill_done(own->load, a->attempt);
			publish(r, pub, own);
		}
		return 0;
	case KVR_OP_OUTPUT:
		kvr_lease_touch(ss->leases, lslot, a->attempt);
		if (rec->in_prefill) { /* output implies the prefill is done */
			rec->in_prefill = false;
			kvr_load_prefill_done(own->load, a->attempt);
		}
		rc = output(sh, own, rec, a->tokens, a->n_tokens);
		publish(r, pub, own);
		return rc;
	case KVR_OP_FINISH:
	case KVR_OP_ABORT:
		if (kvr_lease_claim(ss->leases, lslot, a->attempt) != 0)
			return KVR_ESTALE;
		kvr_metrics_add(mb, a->op == KVR_OP_FINISH ? KVR_C_FINISHED : KVR_C_ABORTED, 1);
		end_attempt(sh, rec, true);
		return 0;
	default:
		return KVR_EINVAL;
	}
}

/* ---------------------------------------------------------------- KV events */

int kvr_owner_event(struct kvr_shard *sh, void *arg)
{
	retry_timers(sh);
	struct kvr_event_args *a = arg;
	struct kvr_router *r = a->r;
	struct kvr_shard_state *ss = state_of(sh);
	struct kvr_rank_owned *own = owned(r, a->slot, a->gen);
	const struct kvr_event *ev = a->ev;
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	if (!ss)
		return KVR_ENOMEM;
	if (!own)
		return KVR_ENOENT;
	if (ev->event_id) {
		if (own->have_event && ev->event_id <= own->last_event_id) {
			kvr_metrics_add(mb, KVR_C_EV_STALE, 1);
			return KVR_ESTALE;
		}
		if (own->have_event && ev->event_id > own->last_event_id + 1) {
			own->gaps++;
			kvr_metrics_add(mb, KVR_C_EV_GAPS, 1);
			if (r->cfg.on_event_gap)
				r->cfg.on_event_gap(r->cfg.callback_ctx,
				                    r->ranks[a->slot].worker_id,
				                    r->ranks[a->slot].dp_rank,
				                    own->last_event_id + 1, ev->event_id);
		}
		own->have_event = true;
		own->last_event_id = ev->event_id;
	}
	int rc = 0;
	switch (ev->type) {
	case KVR_EVENT_STORED:
		if (grow((void **)&ss->blk, &ss->blk_cap, ev->n_blocks ? ev->n_blocks : 1,
		         sizeof(*ss->blk)))
			return KVR_ENOMEM;
		for (size_t i = 0; i < ev->n_blocks; i++)
			ss->blk[i] = (struct kvr_index_block){.ext_hash = ev->blocks[i].ext_hash,
			                                      .local_hash = a->local[i]};
		rc =
		    kvr_index_store(r->index, a->slot, ev->has_parent ? &ev->parent_ext_hash : NULL,
		                    ss->blk, ev->n_blocks);
		if (rc == KVR_ENOENT)
			kvr_metrics_add(mb, KVR_C_EV_PARENT_NOT_FOUND, 1);
		kvr_metrics_add(mb, rc ? KVR_C_EV_STORED_ERR : KVR_C_EV_STORED_OK, 1);
		break;
	case KVR_EVENT_REMOVED: {
		size_t nf = 0;
		rc = kvr_index_remove(r->index, a->slot, ev->removed, ev->n_removed, &nf);
		kvr_metrics_add(mb, KVR_C_EV_BLOCK_NOT_FOUND, nf);
		kvr_metrics_add(mb, rc ? KVR_C_EV_REMOVED_ERR : KVR_C_EV_REMOVED_OK, 1);
		break;
	}
	case KVR_EVENT_CLEARED:
		rc = a->rank_only ? kvr_index_clear_rank(r->index, a->slot)
		                  : kvr_index_clear_worker(r->index, r->ranks[a->slot].worker_id);
		kvr_metrics_add(mb, rc ? KVR_C_EV_CLEARED_ERR : KVR_C_EV_CLEARED_OK, 1);
		break;
	default:
		return KVR_EINVAL;
	}
	publish(r, &r->ranks[a->slot], own);
	return rc;
}
