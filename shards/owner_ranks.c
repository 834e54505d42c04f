/*
 * shards/owner_ranks.c - a rank's life on its shard: create, capacity, reset, destroy, stats; the
 * shard's own start and stop; the helpers that keep the index and the load snapshot in step with
 * the rank's state (publish, apply_removals, store_run) and its timers (TTL expiry, the lease
 * reaper).
 *
 * Per rank (struct kvr_rank_owned): the predicted cache (shards/rank_state: the capacity-bounded
 * LRU, or TTL retention), the active load (shards/load), the KV event cursor and the rank's live
 * attempts.  Per shard (struct kvr_shard_state): the attempts booked here, scratch buffers.
 *
 * Index writes: the rank's shard is the only writer of the rank's index entries.  The LRU and
 * TTL report what became present (stored runs: ranges of the command's input blocks) and what
 * went (evicted runs); the index gets the evictions first, then each stored range as one chain
 * run below the block before it (held, so the index accepts the run; re-storing held blocks is a
 * no-op).  If the parent was evicted by an unusual copy order, the whole prompt chain is stored
 * from the root instead, which is always valid because every block of the prompt is resident.
 *
 * After every change the rank's load snapshot (struct kvr_rank_pub) is republished with relaxed
 * stores, and its change added to the rank's booked load word (struct kvr_rank_load, this
 * shard its single writer), which routing threads read with the provisional word.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/probes.h"
#include "shards/load.h"
#include "shards/owner_internal.h"
#include "shards/rank_state.h"
#include "shards/ttl.h"

void kvr_owner_publish_load(const struct kvr_owner_ctx *c, uint32_t slot, uint64_t blocks,
                            uint64_t prefill_tokens)
{
	struct kvr_rank_pub *pub = &c->ranks[slot];
	/* The snapshot is this thread's own: plain reads of it are exact. */
	uint64_t db = blocks - pub->active_blocks, dp = prefill_tokens - pub->prefill_tokens;
	__atomic_store_n(&pub->active_blocks, blocks, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->prefill_tokens, prefill_tokens, __ATOMIC_RELAXED);
	/* Modular: a snapshot that shrank adds the two's complement of the drop. */
	kvr_owner_take_back(c, slot, -dp, -db);
}

void kvr_owner_take_back(const struct kvr_owner_ctx *c, uint32_t slot, uint64_t prefill_tokens,
                         uint64_t blocks)
{
	struct kvr_rank_load *l = &c->load[slot];
	/* Single writer (this shard): a load and a store, no RMW.  Ordering: release; pairs with
	 * the acquire in kvr_rank_load_prefill/_blocks (shards/owner.h). */
	if (blocks)
		__atomic_store_n(&l->blocks, l->blocks - blocks, __ATOMIC_RELEASE);
	if (prefill_tokens)
		__atomic_store_n(&l->prefill_tokens, l->prefill_tokens - prefill_tokens,
		                 __ATOMIC_RELEASE);
}

/* The decay's published steps: a decision reads the oldest prefill's tokens at most this share
 * of them (plus one) above what they are now. */
#define DECAY_STEPS 16u

static void arm_decay(struct kvr_shard *sh, struct kvr_rank_owned *own, uint64_t now);

static void decay_fire(struct kvr_shard *sh, void *arg)
{
	(void)arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	ss->decay_armed = false;
	bool lowered = false;
	for (struct kvr_rank_owned *own = ss->ranks; own; own = own->next) {
		if (kvr_load_decay_end(own->load)) {
			kvr_owner_publish(ss, own); /* arms the next step while one decays */
			lowered = true;
		}
	}
	if (lowered && ss->c->on_unloaded) /* a step of a decay lowered the load */
		ss->c->on_unloaded(ss->c->expire_ctx, false);
}

/*
 * expected_prefill_ns: the oldest prefill counts linearly less as it progresses, but a decision
 * reads the load the shard last published, so between the rank's events it read the decay frozen
 * (a 1,024-token prefill at 0 of 1,000 ns still counted whole at 5,000 ns, where
 * kvr_rank_get_stats, computing at its own time, said 0).  While some rank's oldest prefill
 * decays, one timer per shard publishes those ranks again every 1/DECAY_STEPS of
 * expected_prefill_ns: one wake-up a step whatever the shard's rank count (a timer per rank would
 * wake a parked shard as often as ranks times steps).  A failed arm is retried on the shard's next
 * call, as the TTL timer's.  Context: own's shard (sh NULL: not on it, nothing armed).
 */
static void arm_decay(struct kvr_shard *sh, struct kvr_rank_owned *own, uint64_t now)
{
	if (!sh || kvr_load_decay_end(own->load) <= now)
		return;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (ss->decay_armed)
		return;
	uint64_t step = ss->c->expected_prefill_ns / DECAY_STEPS + 1;
	uint64_t d = now + step < now ? UINT64_MAX - 1 : now + step;
	if (kvr_shard_timer_add(sh, d, decay_fire, NULL, NULL) == 0) {
		ss->decay_armed = true;
	} else {
		ss->timers_broken = true;
		kvr_metrics_add(kvr_owner_mb(ss->c), KVR_C_SHARD_TIMER_ERRORS, 1);
	}
}

/* Republishes the rank's load snapshot.  Ordering: relaxed stores; single writer. */
void kvr_owner_publish(struct kvr_shard_state *ss, struct kvr_rank_owned *own)
{
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_pub *pub = &c->ranks[own->slot];
	struct kvr_load_stats st;
	kvr_load_stats(own->load, &st);
	uint64_t resident = 0;
	const struct kvr_lru *lru = own->rs ? kvr_rank_state_lru(own->rs) : NULL;
	if (lru) {
		struct kvr_lru_stats ls;
		kvr_lru_stats(lru, &ls);
		resident = ls.hashes;
	} else {
		resident = kvr_index_tree_size(c->index, own->slot);
	}
	uint64_t now = kvr_owner_now(c);
	kvr_owner_publish_load(c, own->slot, st.active_blocks,
	                       kvr_load_prefill_tokens(own->load, now));
	arm_decay(kvr_shard_current(), own, now);
	__atomic_store_n(&pub->active_requests, st.active_requests, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->resident_blocks, resident, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->incarnation, own->incarnation, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->capacity, own->capacity, __ATOMIC_RELAXED);
}

/* Applies what the predicted cache reported, except stored blocks (the caller knows the chain). */
void kvr_owner_apply_removals(struct kvr_shard_state *ss, struct kvr_rank_owned *own,
                              const struct kvr_lru_out *out)
{
	const struct kvr_owner_ctx *c = ss->c;
	/* A timer's removals (TTL expiry, the reaper's releases) retire index objects long after
	 * the shard's idle hook ran: it must run again, or they wait for the next write. */
	if (out->cleared || out->n_evicted)
		kvr_shard_note_work(kvr_shard_current());
	if (out->cleared)
		kvr_index_clear_rank(c->index, own->slot);
	if (out->n_evicted) {
		kvr_index_remove_runs(c->index, own->slot, out->evicted_seq, out->n_evicted,
		                      out->evicted_run_len, out->n_evicted_runs, NULL);
		own->evictions += out->n_evicted;
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_EVICTIONS, out->n_evicted);
		KVR_PROBE2(evict, own->slot, out->n_evicted);
	}
}

/* blk[from..to) = b[from..to) as index blocks. */
static void fill_blocks(struct kvr_index_block *blk, const struct kvr_lru_block *b, size_t from,
                        size_t to)
{
	for (size_t i = from; i < to; i++)
		blk[i] = (struct kvr_index_block){.ext_hash = b[i].seq, .local_hash = b[i].local};
}

/* Stores blocks b[p0..n) as one chain below b[p0-1] (root when p0 == 0 and no parent).
 * A write that fails (out of memory) leaves the index without blocks the predicted cache holds:
 * routing then under-estimates that rank's overlap, which is safe, and it is counted
 * (kvr_shard_errors_total{what="index_write"}), never silent.  The next admission that extends
 * such a chain finds b[p0-1] missing and stores the whole prompt from the root, which puts the
 * index back in step; that retry writes blk[0..p0) first (it once re-read what the previous
 * store had left in the scratch: the index got that prompt's chain with the new blocks under it,
 * and the prefix stayed missing). */
static int store_run(struct kvr_shard_state *ss, struct kvr_rank_owned *own, const uint64_t *parent,
                     const struct kvr_lru_block *b, size_t p0, size_t n)
{
	if (p0 >= n)
		return 0;
	const struct kvr_owner_ctx *c = ss->c;
	int rc = kvr_grow((void **)&ss->blk, &ss->blk_cap, n, sizeof(*ss->blk));
	if (rc == 0) {
		fill_blocks(ss->blk, b, p0, n);
		/* Below the command's own blocks, the parent is named by its path from the root
		 * (b[0..p0) when the command has no parent: an admission's prompt), which an index
		 * without the block locator finds by a walk. */
		if (p0 > 0 && !parent)
			rc = kvr_index_store_path(c->index, own->slot, &b[0].seq,
			                          KVR_LRU_BLOCK_STRIDE, p0, ss->blk + p0, n - p0);
		else
			rc = kvr_index_store(c->index, own->slot, p0 > 0 ? &b[p0 - 1].seq : parent,
			                     ss->blk + p0, n - p0);
		if (rc == KVR_ENOENT && p0 > 0 && !parent) {
			fill_blocks(ss->blk, b, 0, p0);
			rc = kvr_index_store(c->index, own->slot, NULL, ss->blk, n);
		}
	}
	if (rc)
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_SHARD_INDEX_WRITE_ERRORS, 1);
	return rc;
}

/* Stores what the predicted cache reported as stored: ranges of the command's input blocks b[],
 * each one run below the block before it (or *parent / the root at 0). */
void kvr_owner_store_runs(struct kvr_shard_state *ss, struct kvr_rank_owned *own,
                          const uint64_t *parent, const struct kvr_lru_block *b,
                          const struct kvr_lru_out *out)
{
	for (size_t k = 0; k < out->n_stored_runs; k++) {
		const struct kvr_lru_range *g = &out->stored[k];
		store_run(ss, own, parent, b, g->first, (size_t)g->first + g->n);
	}
}

static void ttl_fire(struct kvr_shard *sh, void *arg);

/* An expiry that ran out of memory is tried again this much later, not at once: a timer due
 * again at once fired again and again for as long as memory stayed short (the shard spun on
 * it, and kvr_router_sync, which waits for every due timer, timed out: oom_api seed 9 with
 * persistent failures). */
#define TTL_RETRY_NS 10000000ull

/* Arms rank own's TTL timer at d unless it is armed at d or earlier.  A failed arm (out of
 * memory) is counted and retried on the shard's next call (kvr_owner_retry_timers). */
static void arm_ttl_at(struct kvr_shard *sh, struct kvr_rank_owned *own, uint64_t d)
{
	if (d == UINT64_MAX || d >= own->ttl_deadline)
		return;
	if (own->ttl_deadline != UINT64_MAX)
		kvr_shard_timer_cancel(sh, own->ttl_timer);
	if (kvr_shard_timer_add(sh, d, ttl_fire, own, &own->ttl_timer) == 0) {
		own->ttl_deadline = d;
	} else {
		struct kvr_shard_state *ss = kvr_owner_state(sh);
		own->ttl_deadline = UINT64_MAX;
		ss->timers_broken = true;
		kvr_metrics_add(kvr_owner_mb(ss->c), KVR_C_SHARD_TIMER_ERRORS, 1);
	}
}

/* TTL retention: keeps one timer armed at the earliest expiry. */
void kvr_owner_arm_ttl(struct kvr_shard *sh, struct kvr_rank_owned *own)
{
	if (!own->rs || kvr_rank_state_mode(own->rs) != KVR_RANK_TTL)
		return;
	arm_ttl_at(sh, own, kvr_rank_state_next_deadline(own->rs));
}

static void ttl_fire(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_owned *own = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	own->ttl_deadline = UINT64_MAX;
	uint64_t now = kvr_owner_now(c);
	int rc = kvr_rank_state_tick(own->rs, now, &ss->out);
	if (rc == 0) {
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_TTL_EXPIRIES, ss->out.n_evicted);
		kvr_owner_apply_removals(ss, own, &ss->out);
	}
	kvr_owner_publish(ss, own);
	if (rc == KVR_ENOMEM) { /* nothing expired: a release of the predicted cache, retried */
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_SHARD_RELEASE_ERRORS, 1);
		arm_ttl_at(sh, own, now + TTL_RETRY_NS > now ? now + TTL_RETRY_NS : UINT64_MAX - 1);
		return;
	}
	kvr_owner_arm_ttl(sh, own);
}

/* Arms the lease reaper at `when`.  A failure (out of memory in the timer heap) is counted and
 * retried on the shard's next call, so one failed allocation never stops lease expiry. */
static void arm_reaper(struct kvr_shard *sh, uint64_t when)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (kvr_shard_timer_add(sh, when, kvr_owner_reaper_fire, NULL, NULL) == 0) {
		ss->reaper_armed = true;
		return;
	}
	ss->reaper_armed = false;
	ss->timers_broken = true;
	kvr_metrics_add(kvr_owner_mb(ss->c), KVR_C_SHARD_TIMER_ERRORS, 1);
}

/* The next scan, one interval after now, saturating: an interval near 2^64 (the reaper turned
 * off) wrapped to a deadline in the past, which fired on every turn of the shard's loop and
 * reaped every idle attempt (test_regress lease_scan_interval_near_2_to_64_never_expires). */
static uint64_t reaper_next(const struct kvr_owner_ctx *c)
{
	uint64_t now = kvr_owner_now(c), t = now + c->lease_scan_interval_ns;
	return t < now ? UINT64_MAX : t;
}

/* Called by the reaper when it has run: the next scan one interval later, while the shard has
 * attempts to scan (or releases to retry).  A reaper that re-armed itself for ever kept an idle
 * shard waking every interval, and at a short one (lease_scan_interval_ns 1: a timer always
 * due) never let it park: kvr_router_sync timed out with no work left and the shard's thread
 * spun (a probe: 20,000 routes finished, then 5 s of KVR_ETIMEDOUT).  The next booking arms it
 * again (kvr_owner_wake_reaper): its first scan comes one interval after it, so an idle attempt
 * still expires one to two intervals after its last call. */
void kvr_owner_rearm_reaper(struct kvr_shard *sh)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	ss->reaper_armed = false;
	if (ss->n_recs || ss->releases_owed)
		arm_reaper(sh, reaper_next(ss->c));
}

void kvr_owner_wake_reaper(struct kvr_shard *sh)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss->reaper_armed && !ss->timers_broken)
		arm_reaper(sh, reaper_next(ss->c));
}

/* Re-arms what a failed timer allocation left unarmed.  Called at the top of every shard-side
 * entry point; costs one branch when nothing failed. */
void kvr_owner_retry_timers(struct kvr_shard *sh)
{
	kvr_owner_retry_releases(sh);
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss || !ss->timers_broken)
		return;
	ss->timers_broken = false;
	/* One interval on, as a booking arms it: sync_booking's lifecycle calls count on no scan
	 * coming sooner after the time of the work that arms the reaper (core/lifecycle.c). */
	if (!ss->reaper_armed)
		arm_reaper(sh, reaper_next(ss->c));
	for (struct kvr_rank_owned *own = ss->ranks; own; own = own->next) {
		kvr_owner_arm_ttl(sh, own);
		arm_decay(sh, own, kvr_owner_now(ss->c));
	}
}

/* ---------------------------------------------------------------- shard life */

void kvr_owner_shard_start(struct kvr_shard *sh, void *ctx)
{
	const struct kvr_owner_ctx *c = ctx;
	struct kvr_shard_state *ss = kvr_calloc(1, sizeof(*ss));
	if (!ss)
		return; /* every call on this shard then fails with KVR_ENOMEM */
	ss->c = c;
	kvr_lru_out_init(&ss->out);
	kvr_u64map_init(&ss->by_id);
	kvr_shard_set_userdata(sh, ss);
	kvr_owner_room_prepare(ss);
}

void kvr_owner_shard_idle(struct kvr_shard *sh, void *ctx)
{
	const struct kvr_owner_ctx *c = ctx;
	kvr_attempt_pool_trim(c->pool);
	/* Under the index's writer mutex, as every write: the batch may hold what other shards'
	 * ranks retired too, and they may be writing now.  Tried, not waited for: a shard behind
	 * another's long write was late for its next message; that writer is a shard task too,
	 * and flushes when its shard goes idle (kvr_index_flush_retired_try).  A holder that is
	 * no shard (a test reading the batch, a quiesce) flushes nothing later, so a missed try
	 * comes back at the next idle period instead of leaving the batch for the next write (CI:
	 * memory/idle_router_hands_retired_index_objects_to_rcu under ASan, the test's own reads of
	 * the batch holding the mutex when the hook tried it). */
	if (!kvr_index_flush_retired_try(c->index))
		kvr_shard_note_work(sh);
}

void kvr_owner_shard_stop(struct kvr_shard *sh, void *ctx)
{
	(void)ctx;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss)
		return;
	/* The ranks still here at shutdown go with their attempts and index entries. */
	while (ss->ranks) {
		struct kvr_rank_args a = {.slot = ss->ranks->slot};
		kvr_owner_rank_destroy(sh, &a);
	}
	kvr_owner_attempts_fini(ss);
	kvr_lru_out_fini(&ss->out);
	kvr_free(ss->blk, ss->blk_cap * sizeof(*ss->blk));
	kvr_free(ss->lb, ss->lb_cap * sizeof(*ss->lb));
	kvr_free(ss, sizeof(*ss));
	kvr_shard_set_userdata(sh, NULL);
}

/* ---------------------------------------------------------------- ranks */

static uint64_t initial_capacity(const struct kvr_owner_ctx *c, uint64_t capacity)
{
	if (c->mode == KVR_MODE_APPROX_TTL || capacity == KVR_CAPACITY_NONE)
		return 0;
	return capacity;
}

int kvr_owner_rank_create(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss)
		return KVR_ENOMEM;
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own = kvr_calloc(1, sizeof(*own));
	if (!own)
		return KVR_ENOMEM;
	int rc = kvr_load_create(c->expected_prefill_ns, &own->load);
	if (rc)
		goto fail;
	if (c->mode != KVR_MODE_EVENTS) {
		rc = kvr_rank_state_create(c->ttl_ns, KVR_TTL_BUCKET_NS, &own->rs);
		if (rc)
			goto fail;
		/* A 2025 vLLM queues a released partial block behind older cached ones; a current
		 * one reuses it first, as a free slot (kvrouter.h, kvr_free_order). */
		kvr_rank_state_set_keep_private(own->rs, c->free_order == KVR_FREE_TAIL_FIRST);
		rc = kvr_rank_state_set_capacity(own->rs, a->incarnation,
		                                 initial_capacity(c, a->capacity), &ss->out);
		if (rc)
			goto fail;
	}
	uint32_t slot;
	rc = kvr_index_rank_add(c->index, a->worker_id, a->dp_rank, &slot);
	if (rc)
		goto fail;
	if (slot >= c->max_ranks) {
		kvr_index_rank_remove(c->index, slot);
		rc = KVR_ERANGE;
		goto fail;
	}
	if (c->pinmap)
		(void)kvr_load_publish(own->load, c->pinmap, slot); /* empty load: cannot fail */
	own->incarnation = a->incarnation;
	own->capacity = a->capacity;
	own->ttl_deadline = UINT64_MAX;
	own->slot = slot;
	struct kvr_rank_pub *pub = &c->ranks[slot];
	/* Identity: atomic stores, since a stale attempt id may still lead a caller to read this
	 * slot's shard while the slot is being reused (it then gets KVR_ESTALE from that shard). */
	__atomic_store_n(&pub->worker_id, a->worker_id, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->dp_rank, a->dp_rank, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->shard, kvr_shard_index(sh), __ATOMIC_RELAXED);
	__atomic_store_n(&pub->max_batched_tokens, a->max_batched_tokens, __ATOMIC_RELAXED);
	pub->own = own;
	own->next = ss->ranks;
	if (ss->ranks)
		ss->ranks->prev = own;
	ss->ranks = own;
	kvr_owner_publish(ss, own);
	kvr_owner_room_prepare(ss); /* its first bookings need not wait (sync_booking) */
	a->slot = slot;
	return 0;
fail:
	kvr_rank_state_destroy(own->rs);
	kvr_load_destroy(own->load);
	kvr_free(own, sizeof(*own));
	return rc;
}

struct kvr_rank_owned *kvr_owner_rank(const struct kvr_owner_ctx *c, uint32_t slot, uint64_t gen)
{
	if (slot >= c->max_ranks)
		return NULL;
	struct kvr_rank_pub *pub = &c->ranks[slot];
	if (!__atomic_load_n(&pub->live, __ATOMIC_ACQUIRE) ||
	    __atomic_load_n(&pub->gen, __ATOMIC_ACQUIRE) != gen)
		return NULL;
	return pub->own;
}

int kvr_owner_rank_destroy(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_pub *pub = &c->ranks[a->slot];
	struct kvr_rank_owned *own = pub->own;
	if (!own)
		return KVR_ENOENT;
	kvr_owner_end_all_attempts(sh, own);
	kvr_owner_drop_owed(sh, own);
	if (own->ttl_deadline != UINT64_MAX)
		kvr_shard_timer_cancel(sh, own->ttl_timer);
	kvr_rank_state_destroy(own->rs);
	kvr_load_destroy(own->load);
	kvr_index_rank_remove(c->index, a->slot);
	if (own->prev)
		own->prev->next = own->next;
	else
		ss->ranks = own->next;
	if (own->next)
		own->next->prev = own->prev;
	pub->own = NULL;
	kvr_owner_publish_load(c, a->slot, 0, 0);
	__atomic_store_n(&pub->active_requests, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&pub->resident_blocks, 0, __ATOMIC_RELAXED);
	kvr_free(own, sizeof(*own));
	return 0;
}

/* A new life of the rank: its attempts end, its predicted cache and index entries go. */
static int new_life(struct kvr_shard *sh, struct kvr_rank_owned *own, uint64_t incarnation,
                    uint64_t capacity)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	/* The new store first: out of memory then changes nothing (KVR_ENOMEM's promise).  Ending
	 * the attempts first once left a failed set_capacity or reset with every attempt stale, the
	 * predicted cache dropped and the rank ABSENT (no prediction until the next capacity call)
	 * under the old incarnation (tests/fuzz/oom_api.c). */
	if (own->rs) {
		int rc = kvr_rank_state_renew(own->rs, incarnation, initial_capacity(c, capacity),
		                              &ss->out);
		if (rc)
			return rc;
	}
	kvr_owner_end_all_attempts(sh, own); /* releases no blocks: ss->out is left as it is */
	if (own->rs)
		kvr_owner_apply_removals(ss, own, &ss->out);
	else
		kvr_index_clear_rank(c->index, own->slot);
	own->incarnation = incarnation;
	own->capacity = capacity;
	own->have_event = false;
	own->index_full = false; /* resynced: the next refusal is news */
	return 0;
}

/* The predicted cache was rebuilt in another mode: it holds no lease of the live attempts any
 * more, so their later output is tracked for load only (see output()). */
static void forget_bookings(struct kvr_rank_owned *own)
{
	for (struct kvr_attempt *rec = own->attempts; rec; rec = rec->next)
		rec->booked = false;
}

/* The rank a capacity or reset message names, if the message is of its life or a later one.
 * Returns 0 and *own, KVR_ENOENT (gone, or its slot reused) or KVR_ESTALE (an older life). */
static int rank_of_life(const struct kvr_owner_ctx *c, const struct kvr_rank_args *a,
                        struct kvr_rank_owned **own)
{
	*own = kvr_owner_rank(c, a->slot, a->gen);
	if (!*own)
		return KVR_ENOENT;
	return a->incarnation < (*own)->incarnation ? KVR_ESTALE : 0;
}

int kvr_owner_rank_capacity(struct kvr_shard *sh, void *arg)
{
	kvr_owner_retry_timers(sh);
	struct kvr_rank_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own;
	int rc = rank_of_life(c, a, &own);
	if (rc)
		return rc;
	if (a->incarnation != own->incarnation) {
		rc = new_life(sh, own, a->incarnation, a->capacity);
	} else if (own->rs) {
		enum kvr_rank_mode before = kvr_rank_state_mode(own->rs);
		uint64_t cap = initial_capacity(c, a->capacity);
		rc = kvr_rank_state_set_capacity(own->rs, own->incarnation, cap, &ss->out);
		if (rc == KVR_EBUSY && before == KVR_RANK_TTL && cap > 0) {
			/* TTL retention -> a finite capacity, same life: the predicted cache starts
			 * over as an LRU (the TTL state cannot be turned into one), made before the
			 * TTL store goes (a reset first left the rank ABSENT on KVR_ENOMEM). */
			rc = kvr_rank_state_renew(own->rs, own->incarnation, cap, &ss->out);
		}
		if (rc == 0) {
			kvr_owner_apply_removals(ss, own, &ss->out);
			own->capacity = a->capacity;
			if (kvr_rank_state_mode(own->rs) != before)
				forget_bookings(own);
		}
	} else {
		own->capacity = a->capacity;
	}
	kvr_owner_publish(ss, own);
	return rc;
}

int kvr_owner_rank_reset(struct kvr_shard *sh, void *arg)
{
	kvr_owner_retry_timers(sh);
	struct kvr_rank_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	struct kvr_rank_owned *own;
	int rc = rank_of_life(ss->c, a, &own);
	if (rc)
		return rc;
	rc = new_life(sh, own, a->incarnation, own->capacity);
	kvr_owner_publish(ss, own);
	return rc;
}

int kvr_owner_rank_stats(struct kvr_shard *sh, void *arg)
{
	/* resident_blocks counts what an owed release frees; not inside another task (a clock
	 * reading the stats of its own shard's rank), which may hold what the retry frees. */
	if (!kvr_shard_in_inline_call())
		kvr_owner_retry_releases(sh);
	struct kvr_rank_args *a = arg;
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own = kvr_owner_rank(c, a->slot, a->gen);
	if (!own)
		return KVR_ENOENT;
	struct kvr_rank_stats *st = a->stats;
	struct kvr_load_stats ls;
	kvr_load_stats(own->load, &ls);
	memset(st, 0, sizeof(*st));
	st->incarnation = own->incarnation;
	/* 0 is registered as "no capacity", as KVR_CAPACITY_NONE is (kvr_rank_add): the stats
	 * say so the one way the header gives. */
	st->capacity_blocks = own->capacity ? own->capacity : KVR_CAPACITY_NONE;
	st->indexed_blocks = kvr_index_tree_size(c->index, a->slot);
	st->resident_blocks = st->indexed_blocks;
	if (own->rs && kvr_rank_state_lru(own->rs)) {
		struct kvr_lru_stats lst;
		kvr_lru_stats(kvr_rank_state_lru(own->rs), &lst);
		st->resident_blocks = lst.hashes;
	}
	st->active_blocks = ls.active_blocks;
	st->active_prefill_tokens = kvr_load_prefill_tokens(own->load, kvr_owner_now(c));
	st->active_requests = ls.active_requests;
	/* A sync_booking booking whose load could not be recorded for memory lives with its load
	 * left provisional (owner_attempts.c: load_missing), which every decision still counts:
	 * so do the stats, or the rank read as idle while the request ran. */
	for (const struct kvr_attempt *rec = own->attempts; rec; rec = rec->next)
		if (rec->load_missing) {
			st->active_requests++;
			st->active_blocks += rec->pend_blocks;
			st->active_prefill_tokens += rec->pend_prefill_tokens;
		}
	st->evictions = own->evictions;
	st->event_id = own->last_event_id;
	st->event_gaps = own->gaps;
	return 0;
}

int kvr_owner_rank_memory(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	const struct kvr_owner_ctx *c = kvr_owner_state(sh)->c;
	struct kvr_rank_owned *own = kvr_owner_rank(c, a->slot, a->gen);
	if (!own)
		return KVR_ENOENT;
	const struct kvr_lru *lru = own->rs ? kvr_rank_state_lru(own->rs) : NULL;
	a->cache_bytes = lru ? kvr_lru_bytes(lru) : 0;
	a->load_bytes = kvr_load_bytes(own->load);
	return 0;
}

int kvr_owner_rank_blocks(struct kvr_shard *sh, void *arg)
{
	struct kvr_rank_args *a = arg;
	const struct kvr_owner_ctx *c = kvr_owner_state(sh)->c;
	if (!kvr_owner_rank(c, a->slot, a->gen))
		return KVR_ENOENT;
	a->n = kvr_index_rank_blocks(c->index, a->slot, a->blocks, a->cap);
	return a->n > a->cap ? KVR_ERANGE : 0;
}
