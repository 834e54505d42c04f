/*
 * core/lifecycle.c - a request attempt's life after admission: prefill done, output progress,
 * finish, abort.  None of them waits for a shard.
 *
 * The decision is made on the caller's thread, on the attempt's lease word (shards/lease.h):
 * finish and abort CLAIM it (one CAS; finish, abort, lease expiry and the rank's end race
 * through it and exactly one wins), prefill done and output TOUCH it.  So the return code, 0 or
 * KVR_ESTALE, is known at once; the work itself (release blocks, return load, materialize output
 * blocks) is posted to the shard that owns the attempt's rank (the slot is in the attempt id),
 * on the routing lane, behind the attempt's booking (lanes are FIFO across producers).
 *
 * The post is lazy (kvr_shard_post_lazy): a shard that went idle within the last 100 ms sleeps in
 * timed waits of at most 1 ms (KVR_DEFAULT_SHARD_LAZY_WAKE_NS) and is not woken for this work,
 * so the caller makes no FUTEX_WAKE; the load it releases shows in the next decisions at most
 * that much later (plus the shard's scheduling delay).  Counted in
 * kvr_shard_wakes_deferred_total.  A shard idle for longer is woken as before.
 *
 * A router that queues (kvr_config.queue_threshold): the shard applies the work and then its
 * hook (KVR_PROGRESS_WAKE) wakes the router's admission thread, which runs the queue's pass
 * (core/queue_thread.c); the caller waits for neither.  Where queued requests may wait for what
 * the call releases (finish, abort, prefill done while requests are queued or the rank is
 * saturated; output while the rank is saturated: an attempt's first output implies its prefill
 * is done) the post is eager, so the shard is woken at once instead of within the lazy bound.
 * A call that saw no one waiting posts lazily: should a route queue behind its rank meanwhile
 * (the rank saturated since, by a third call's booking), that request is admitted once the
 * shard applies the work, within the lazy bound (before, the call looked again after its post
 * and then waited for the shard).
 * A route that read the load before the work was applied and queued is admitted by that pass
 * or by its own after its push: the hook fences and reads the queue's depth, the route pushes,
 * fences and reads the load.  Before, these calls waited one round trip to the shard and ran
 * the pass themselves (the only pass then; the admission thread came later), so a caller's
 * finish p99 on a saturated rank was the shard's whole backlog.  What changed for the caller:
 * a route right after a finish on a saturated rank may queue and be admitted a moment later
 * (on_admit, kvr_route_wait) instead of at once; sync_booking keeps the exact order.  With
 * sync_booking the work is posted at the call's time and every later call that reads shard state
 * (this file's claims and touches included) first settles (kvr_router_settle): the caller
 * observes exactly what it would have had the call waited (simulation, tests), but the shard
 * applies it while the caller goes on.  A full lane (the
 * shards are overloaded) is waited on, counted: a finish or abort, already claimed, waits for
 * room (dropping it would leave its load behind until the lease reaper's next pass); prefill
 * done and output wait at most KVR_LANE_FULL_WAIT_NS, then return KVR_EAGAIN (counted in
 * kvr_lane_full_drops_total).  Should a claimed end still never reach its shard, the shard's
 * reaper ends the attempt on its next pass (it cleans up claimed leases it still holds).
 */
#include <inttypes.h>
#include <string.h>

#include "core/alloc.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "sync/rcu.h"

/* Posts a lifecycle message (tokens copied) to the attempt's shard.  sync_booking: a timed post
 * (kvr_shard_post_at) at this call's time, applied before anything later reads what it changes
 * (every call that reads shard state settles first), so the caller observes what it would have
 * had it waited; the return code is the claim's (touch's), known already.  Otherwise lazy, with
 * the full lane's bounded wait.  Returns 0, KVR_ENOMEM (the copy), KVR_EAGAIN (progress on a
 * full lane), KVR_ESHUTDOWN (not for a claimed end). */
static int post_progress(struct kvr_router *r, struct kvr_shard *sh, struct kvr_progress_msg *m,
                         const uint32_t *tokens, bool ends, bool eager,
                         struct kvr_metrics_block *mb)
{
	size_t n = m->n_tokens;
	bool heap = m->op == KVR_OP_OUTPUT && n > KVR_PROGRESS_INLINE;
	if (heap) {
		m->tok.heap = kvr_alloc_transient(n * sizeof(uint32_t));
		if (!m->tok.heap)
			return KVR_ENOMEM;
		memcpy(m->tok.heap, tokens, n * sizeof(uint32_t));
	} else if (n) {
		memcpy(m->tok.inl, tokens, n * sizeof(uint32_t));
	}
	int rc;
	/* A claimed end is never dropped: kvr_shard_post_later waits for room, or on a shard's
	 * thread (the router's clock), where the full lane may be its own or that of a shard
	 * waiting for this one, keeps the post for the shard's loop. */
	if (r->cfg.sync_booking) {
		rc = kvr_shard_post_at(sh, KVR_LANE_ROUTING, kvr_owner_progress_task, m, sizeof(*m),
		                       kvr_clock_now(&r->clock));
		/* (refused only on a shard's thread: its own lane full, or a cycle) */
		if (ends && (rc == KVR_EAGAIN || rc == KVR_EBUSY))
			rc = kvr_shard_post_later(sh, KVR_LANE_ROUTING, kvr_owner_progress_task, m,
			                          sizeof(*m));
	} else {
		/* Lazy: a shard that parked lately (a bounded park) is left asleep and applies the
		 * work within KVR_DEFAULT_SHARD_LAZY_WAKE_NS, sparing this caller the FUTEX_WAKE.
		 * Eager where queued requests wait for what it releases: the shard is woken at
		 * once, and its hook wakes the admission thread once the work is applied. */
		bool deferred = false;
		rc = eager ? kvr_shard_post(sh, KVR_LANE_ROUTING, kvr_owner_progress_task, m,
		                            sizeof(*m))
		           : kvr_shard_post_lazy(sh, KVR_LANE_ROUTING, kvr_owner_progress_task, m,
		                                 sizeof(*m), &deferred);
		if (deferred)
			kvr_metrics_add(mb, KVR_C_SHARD_WAKES_DEFERRED, 1);
		if (rc == KVR_EAGAIN) {
			kvr_metrics_add(mb, KVR_C_LANE_FULL_WAITS, 1);
			/* Progress waits a bounded time. */
			if (ends)
				rc = kvr_shard_post_later(sh, KVR_LANE_ROUTING,
				                          kvr_owner_progress_task, m, sizeof(*m));
			else
				rc = kvr_shard_post_wait(sh, KVR_LANE_ROUTING,
				                         kvr_owner_progress_task, m, sizeof(*m),
				                         KVR_LANE_FULL_WAIT_NS);
			if (rc)
				kvr_metrics_add(mb, KVR_C_LANE_FULL_DROPS, 1);
		}
	}
	if (rc && heap)
		kvr_free_transient(m->tok.heap, n * sizeof(uint32_t));
	if (rc == KVR_ETIMEDOUT)
		rc = KVR_EAGAIN;
	if (rc == KVR_ESHUTDOWN && ends)
		rc = 0; /* claimed; the router is going away with everything it holds */
	if (rc == KVR_ENOMEM && ends)
		rc = 0; /* not kept: claimed, the lease reaper ends it (kvr_owner_reaper_fire) */
	return rc;
}

/* In a progress message's flags beside KVR_PROGRESS_NOT_FINAL, which is all the shard reads
 * of them: the call was kvr_request_output_ex, for a failure's detail. */
#define PROGRESS_EX 0x8000u
_Static_assert((PROGRESS_EX & (KVR_PROGRESS_NOT_FINAL | KVR_PROGRESS_WAKE)) == 0,
               "PROGRESS_EX is a flag of its own");

/* The detail of a lifecycle call's failure (core/error.h): each code has one cause here but
 * KVR_EINVAL, whose causes are checked again.  Cold: no work on the calls that succeed. */
static __attribute__((cold, noinline)) int
progress_fail(int rc, int op, uint16_t flags, const struct kvr_router *r, uint64_t attempt)
{
	const char *fn = op == KVR_OP_FINISH         ? "kvr_request_finish"
	                 : op == KVR_OP_ABORT        ? "kvr_request_abort"
	                 : op == KVR_OP_PREFILL_DONE ? "kvr_request_prefill_done"
	                 : (flags & PROGRESS_EX)     ? "kvr_request_output_ex"
	                                             : "kvr_request_output";
	switch (rc) {
	case KVR_EINVAL:
		if (!r)
			return kvr_fail(rc, "%s: router is NULL", fn);
		if (attempt == 0)
			return kvr_fail(rc, "%s: attempt is 0, which no decision carries", fn);
		return kvr_fail(rc, "%s: n_tokens exceeds %" PRIu32, fn, UINT32_MAX);
	case KVR_ENOENT:
		return kvr_fail(rc,
		                "%s: attempt %" PRIu64 " was not issued by this router (its rank "
		                "slot %" PRIu32 " >= max_ranks %u)",
		                fn, attempt, kvr_attempt_slot(attempt), r->cfg.max_ranks);
	case KVR_ESTALE:
		return kvr_fail(rc,
		                "%s: attempt %" PRIu64 " has ended (finished, aborted, expired, or "
		                "its rank was reset or removed) or was never issued",
		                fn, attempt);
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "%s: %s", fn, kvr_router_gone(r));
	case KVR_EAGAIN:
		return kvr_fail(rc,
		                "%s: the rank's shard lane stayed full for 10 ms (or is full, on "
		                "that shard's own thread); nothing changed, try again",
		                fn);
	case KVR_EBUSY: /* progress from a shard's thread on a full lane */
		return kvr_fail(rc, "%s: %s", fn, KVR_SHARD_CYCLE_DETAIL);
	case KVR_ENOMEM:
		return kvr_fail(
		    rc, "%s: out of memory (copying the tokens, or registering the thread)", fn);
	default:
		return kvr_fail_code(rc, fn);
	}
}

/* Whether queued requests may wait for what this call releases (or a route right after it
 * may read the rank saturated and queue: finish, abort, prefill done on a saturated rank), so
 * that the shard must apply the work at once and an admission pass run after it (see the
 * top).  Context: the lifecycle call's thread. */
static bool queue_waits_on(struct kvr_router *r, int op, uint32_t slot)
{
	if (!r->queue)
		return false;
	if (kvr_queue_depth(r) == 0)
		return op != KVR_OP_OUTPUT && kvr_queue_saturated(r, &slot, 1);
	return op != KVR_OP_OUTPUT || kvr_queue_saturated(r, &slot, 1);
}

static int progress(struct kvr_router *r, uint64_t attempt, int op, const uint32_t *tokens,
                    size_t n, uint16_t flags)
{
	uint32_t slot;
	int rc = kvr_router_attempt_slot(r, attempt, &slot);
	if (rc)
		return progress_fail(rc, op, flags, r, attempt);
	if (n > UINT32_MAX)
		return progress_fail(KVR_EINVAL, op, flags, r, attempt);
	if ((rc = kvr_rcu_thread_online()))
		return progress_fail(rc, op, flags, r, attempt);
	struct kvr_shard *sh = kvr_router_shard_of(r, slot);
	/* sync_booking: the claim or touch below reads the lease word as the work posted before
	 * left it.  Of that work, only the shard's lease reaper (a timer, run before each posted
	 * task whose time it is due by) changes what the claim or touch returns: an end only
	 * releases a word its caller claimed (stale either way), and a booking is dropped only
	 * when its rank went away under another thread.  So this waits only when the reaper may
	 * run in the work still queued, armed already or by a queued booking (one scan interval
	 * after the booking's time: kvr_owner_wake_reaper). */
	if (r->cfg.sync_booking) /* 0, or stopping */
		(void)kvr_shard_settle_timers(sh, r->cfg.lease_scan_interval_ns);
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	bool ends = op == KVR_OP_FINISH || op == KVR_OP_ABORT;
	rc = ends ? kvr_lease_claim(r->leases, attempt) : kvr_lease_touch(r->leases, attempt);
	if (rc) { /* claimed, ended, never issued */
		kvr_metrics_add(mb, KVR_C_STALE_CALLS, 1);
		return progress_fail(KVR_ESTALE, op, flags, r, attempt);
	}
	if (ends)
		kvr_metrics_add(mb, op == KVR_OP_FINISH ? KVR_C_FINISHED : KVR_C_ABORTED, 1);
	/* A router with a queue and without sync_booking: the shard wakes the admission thread
	 * once the posted work is applied (KVR_PROGRESS_WAKE). */
	const uint16_t wake = r->queue && !r->cfg.sync_booking ? KVR_PROGRESS_WAKE : 0;
	struct kvr_progress_msg m = {.attempt = attempt,
	                             .op = (int16_t)op,
	                             .flags = (uint16_t)(flags | wake),
	                             .n_tokens = (uint32_t)n};
	/* Queued requests may wait for what this call releases: the shard is woken for the work
	 * (an eager post), applies it, and its hook (KVR_PROGRESS_WAKE) wakes the admission
	 * thread, which runs the pass; this caller waits for neither.  A route that reads the
	 * load before the work is applied and queues is admitted by that pass or by its own
	 * after its push (the hook's fence and the route's pair up: core/queue_thread.c).
	 * sync_booking: the pass below settles first, so the posted work is applied before it. */
	bool pump = queue_waits_on(r, op, slot);
	rc = post_progress(r, sh, &m, tokens, ends, pump, mb);
	if (rc == 0)
		kvr_repl_note_progress(r, attempt, op, tokens, n,
		                       (flags & KVR_PROGRESS_NOT_FINAL) != 0); /* replica sync */
	if (rc) /* what the failure names, read back from the message: nothing kept live for it */
		return progress_fail(rc, m.op, m.flags, r, m.attempt);
	if (r->cfg.sync_booking && r->queue) {
		/* No hook wakes anyone (the work is timed, applied on the next settle): the pass
		 * runs here.  A route may have queued since the look above: this fence pairs with
		 * its own after the push (kvr_queue_catch_up), so either this look sees it or its
		 * pass, which settles first, sees this work. */
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
		if ((pump || queue_waits_on(r, op, slot)) && kvr_queue_depth(r) > 0)
			kvr_queue_pump(r);
	}
	return 0;
}

int kvr_request_prefill_done(struct kvr_router *r, uint64_t attempt)
{
	return progress(r, attempt, KVR_OP_PREFILL_DONE, NULL, 0, 0);
}

int kvr_request_output(struct kvr_router *r, uint64_t attempt, const uint32_t *tokens,
                       size_t n_tokens)
{
	if (!tokens && n_tokens)
		return kvr_fail(KVR_EINVAL, "kvr_request_output: tokens is NULL with n_tokens %zu",
		                n_tokens);
	return progress(r, attempt, KVR_OP_OUTPUT, tokens, n_tokens, 0);
}

int kvr_request_output_ex(struct kvr_router *r, uint64_t attempt, const uint32_t *tokens,
                          size_t n_tokens, uint32_t flags)
{
	if (!tokens && n_tokens)
		return kvr_fail(KVR_EINVAL,
		                "kvr_request_output_ex: tokens is NULL with n_tokens %zu",
		                n_tokens);
	if (flags & ~KVR_OUTPUT_FINAL)
		return kvr_fail(KVR_EINVAL,
		                "kvr_request_output_ex: flags 0x%x has unknown bits 0x%x (known: "
		                "KVR_OUTPUT_FINAL)",
		                flags, flags & ~KVR_OUTPUT_FINAL);
	return progress(r, attempt, KVR_OP_OUTPUT, tokens, n_tokens,
	                PROGRESS_EX | ((flags & KVR_OUTPUT_FINAL) ? 0 : KVR_PROGRESS_NOT_FINAL));
}

int kvr_request_finish(struct kvr_router *r, uint64_t attempt)
{
	return progress(r, attempt, KVR_OP_FINISH, NULL, 0, 0);
}

int kvr_request_abort(struct kvr_router *r, uint64_t attempt)
{
	return progress(r, attempt, KVR_OP_ABORT, NULL, 0, 0);
}
