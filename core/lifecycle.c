/*
 * core/lifecycle.c - a request attempt's life after admission: prefill done, output progress,
 * finish, abort.  Each is one synchronous routing-lane call to the shard that owns the
 * attempt's rank (the slot is in the attempt id), where the lease decides: finish, abort and the
 * reaper's expiry race through one claim, and every call on an attempt that has ended returns
 * KVR_ESTALE and changes nothing.  Calls that lower a rank's load let queued requests in.
 */
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "sync/rcu.h"

static int progress(struct kvr_router *r, uint64_t attempt, int op, const uint32_t *tokens,
                    size_t n)
{
	if (!r || attempt == 0)
		return KVR_EINVAL;
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	uint32_t slot = kvr_attempt_slot(attempt);
	if (slot >= r->cfg.max_ranks)
		return KVR_ENOENT; /* not an id this router issued */
	struct kvr_progress_args a = {
	    .r = r, .attempt = attempt, .op = op, .tokens = tokens, .n_tokens = n};
	uint32_t shard = __atomic_load_n(&r->ranks[slot].shard, __ATOMIC_RELAXED);
	int rc = kvr_shard_call(kvr_shards_get(r->shards, shard), KVR_LANE_ROUTING,
	                        kvr_owner_progress, &a);
	if (rc == 0)
		kvr_repl_note_progress(r, attempt, op, tokens, n); /* replica sync */
	if (rc == KVR_ESTALE)
		kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_STALE_CALLS, 1);
	if (rc == 0 && op != KVR_OP_OUTPUT && r->queue)
		kvr_queue_pump(r);
	return rc;
}

int kvr_request_prefill_done(struct kvr_router *r, uint64_t attempt)
{
	return progress(r, attempt, KVR_OP_PREFILL_DONE, NULL, 0);
}

int kvr_request_output(struct kvr_router *r, uint64_t attempt, const uint32_t *tokens,
                       size_t n_tokens)
{
	if (!tokens && n_tokens)
		return KVR_EINVAL;
	return progress(r, attempt, KVR_OP_OUTPUT, tokens, n_tokens);
}

int kvr_request_finish(struct kvr_router *r, uint64_t attempt)
{
	return progress(r, attempt, KVR_OP_FINISH, NULL, 0);
}

int kvr_request_abort(struct kvr_router *r, uint64_t attempt)
{
	return progress(r, attempt, KVR_OP_ABORT, NULL, 0);
}
