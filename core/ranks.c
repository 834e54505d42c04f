/*
 * core/ranks.c - rank administration: add, set capacity, reset, remove, stats.
 *
 * Admin calls are rare, so they serialize on admin_lock (never taken on the routing path).  The
 * rank's state itself is created and changed on its shard (placement by worker id, so all dp
 * ranks of a worker share one shard and a Cleared event can clear them together); this thread
 * waits for that synchronously.  A slot becomes routable only after its shard has built its
 * state (gen bumped, live set, then published in the live list), and stops being routable
 * before its state is torn down, so a decision on a vanishing rank is refused at admission
 * (generation mismatch) instead of touching freed state.
 */
#include <inttypes.h>

#include "core/limits.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "sync/rcu.h"

/* Attempt ids carry the slot in KVR_SLOT_BITS bits: every slot max_ranks allows must fit. */
_Static_assert(KVR_LIMIT_MAX_RANKS_MAX <= (1u << KVR_SLOT_BITS),
               "max_ranks limit does not fit the attempt id's slot bits");

static int check(struct kvr_router *r, const char *fn)
{
	if (!r)
		return kvr_fail(KVR_EINVAL, "%s: router is NULL", fn);
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "%s: the router is being destroyed", fn);
	return 0;
}

/* The detail of a code that came from the rank's lookup or its shard (core/error.h). */
static __attribute__((cold, noinline)) int rank_fail(int rc, const char *fn,
                                                     struct kvr_rank_id rank, uint64_t inc)
{
	switch (rc) {
	case KVR_ENOENT:
		return kvr_fail(rc, "%s: no rank (worker %" PRIu64 ", dp %" PRIu32 ")", fn,
		                rank.worker_id, rank.dp_rank);
	case KVR_ESTALE:
		return kvr_fail(rc,
		                "%s: incarnation %" PRIu64 " is older than rank (worker %" PRIu64
		                ", dp %" PRIu32 ")'s current one",
		                fn, inc, rank.worker_id, rank.dp_rank);
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "%s: the router is being destroyed", fn);
	case KVR_EBUSY:
		return kvr_fail(rc, "%s: %s", fn, KVR_SHARD_CYCLE_DETAIL);
	default:
		return kvr_fail(rc, "%s: %s (rank worker %" PRIu64 ", dp %" PRIu32 ")", fn,
		                kvr_strerror(rc), rank.worker_id, rank.dp_rank);
	}
}

int kvr_rank_add(struct kvr_router *r, struct kvr_rank_id rank, uint64_t incarnation,
                 uint64_t capacity_blocks, uint32_t max_batched_tokens)
{
	static const char fn[] = "kvr_rank_add";
	int rc = check(r, fn);
	if (rc)
		return rc;
	uint32_t slot, shard;
	pthread_mutex_lock(&r->admin_lock);
	if (kvr_router_find_rank(r, rank, &slot) == 0) {
		rc = kvr_fail(KVR_EEXIST,
		              "%s: rank (worker %" PRIu64 ", dp %" PRIu32 ") already exists", fn,
		              rank.worker_id, rank.dp_rank);
		goto out;
	}
	if (r->live->n >= r->cfg.max_ranks) {
		rc = kvr_fail(KVR_ERANGE, "%s: the router holds max_ranks (%u) ranks already", fn,
		              r->cfg.max_ranks);
		goto out;
	}
	if ((rc = kvr_shards_place(r->shards, rank.worker_id, &shard))) {
		rc = rc == KVR_ERANGE ? kvr_fail(rc,
		                                 "%s: the shards place max_ranks (%u) distinct "
		                                 "workers already",
		                                 fn, r->cfg.max_ranks)
		                      : rank_fail(rc, fn, rank, incarnation);
		goto out;
	}
	struct kvr_rank_args a = {.worker_id = rank.worker_id,
	                          .dp_rank = rank.dp_rank,
	                          .max_batched_tokens = max_batched_tokens,
	                          .incarnation = incarnation,
	                          .capacity = capacity_blocks};
	struct kvr_shard *sh = kvr_shards_get(r->shards, shard);
	/* From a shard's thread (its clock): the rollback below waits for the rank's shard and
	 * cannot be refused once the rank was created, so a cycle of shards waiting for each
	 * other is refused here, before anything is created, and the wait is recorded until the
	 * end (through the create calls). */
	if ((rc = kvr_shard_wait_intent(sh))) {
		kvr_shards_unplace(r->shards, rank.worker_id);
		rc = rank_fail(rc, fn, rank, incarnation);
		goto out;
	}
	rc = kvr_shard_call(sh, KVR_LANE_ROUTING, kvr_owner_rank_create, &a);
	if (rc == KVR_ERANGE) {
		/* Fewer than max_ranks ranks are present (checked above), so every free slot is
		 * one a remove released and the index hands back only after a grace period.  Wait
		 * for the deferred releases queued so far, then try once more. */
		kvr_rcu_barrier();
		rc = kvr_shard_call(sh, KVR_LANE_ROUTING, kvr_owner_rank_create, &a);
	}
	if (rc) {
		kvr_shard_wait_intent_end();
		kvr_shards_unplace(r->shards, rank.worker_id);
		rc = rc == KVR_ERANGE ? kvr_fail(rc, "%s: no free rank slot (max_ranks %u)", fn,
		                                 r->cfg.max_ranks)
		                      : rank_fail(rc, fn, rank, incarnation);
		goto out;
	}
	struct kvr_rank_pub *pub = &r->ranks[a.slot];
	__atomic_add_fetch(&pub->gen, 1, __ATOMIC_RELEASE);
	__atomic_store_n(&pub->live, 1, __ATOMIC_RELEASE);
	if ((rc = kvr_router_live_update(r, a.slot, true))) {
		__atomic_store_n(&pub->live, 0, __ATOMIC_RELEASE);
		__atomic_add_fetch(&pub->gen, 1, __ATOMIC_RELEASE);
		kvr_shard_call_always(sh, KVR_LANE_ROUTING, kvr_owner_rank_destroy, &a);
		kvr_shards_unplace(r->shards, rank.worker_id);
		rc = rank_fail(rc, fn, rank, incarnation);
	}
	kvr_shard_wait_intent_end();
out:
	pthread_mutex_unlock(&r->admin_lock);
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_ADD, rank, incarnation, capacity_blocks,
		                   max_batched_tokens);
	if (rc == 0 && r->queue)
		kvr_queue_pump(r); /* a new rank may take queued requests */
	return rc;
}

int kvr_rank_remove(struct kvr_router *r, struct kvr_rank_id rank)
{
	static const char fn[] = "kvr_rank_remove";
	int rc = check(r, fn);
	if (rc)
		return rc;
	uint32_t slot;
	pthread_mutex_lock(&r->admin_lock);
	if ((rc = kvr_router_find_rank(r, rank, &slot))) {
		rc = rank_fail(rc, fn, rank, 0);
		goto out;
	}
	struct kvr_rank_pub *pub = &r->ranks[slot];
	/* From a shard's thread (its clock): the teardown below waits for the rank's shard and
	 * cannot be refused once the rank is unroutable, so a cycle of shards waiting for each
	 * other is refused here, before anything changes, and the wait is recorded from now on. */
	struct kvr_shard *sh = kvr_router_shard_of(r, slot);
	if ((rc = kvr_shard_wait_intent(sh))) {
		rc = rank_fail(rc, fn, rank, 0);
		goto out;
	}
	/* Unroutable first, so no new admission lands while the state goes. */
	rc = kvr_router_live_update(r, slot, false);
	if (rc) {
		kvr_shard_wait_intent_end();
		rc = kvr_fail(rc, "%s: out of memory copying the live rank list", fn);
		goto out;
	}
	__atomic_store_n(&pub->live, 0, __ATOMIC_RELEASE);
	__atomic_add_fetch(&pub->gen, 1, __ATOMIC_RELEASE);
	struct kvr_rank_args a = {.slot = slot};
	/* Unroutable already: the teardown cannot be refused (kvr_shard_call_always). */
	kvr_shard_call_always(sh, KVR_LANE_ROUTING, kvr_owner_rank_destroy, &a);
	kvr_shard_wait_intent_end();
	kvr_shards_unplace(r->shards, rank.worker_id);
out:
	pthread_mutex_unlock(&r->admin_lock);
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_REMOVE, rank, 0, 0, 0);
	return rc;
}

/* Runs fn on the rank's shard with the rank's current generation. */
static int rank_call(struct kvr_router *r, struct kvr_rank_id rank, kvr_call_fn call,
                     struct kvr_rank_args *a, const char *fn)
{
	int rc = check(r, fn);
	if (rc)
		return rc;
	uint32_t slot;
	if ((rc = kvr_router_find_rank(r, rank, &slot)))
		return rank_fail(rc, fn, rank, a->incarnation);
	a->slot = slot;
	a->gen = kvr_router_gen_of(r, slot);
	rc = kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING, call, a);
	return rc ? rank_fail(rc, fn, rank, a->incarnation) : 0;
}

int kvr_rank_set_capacity(struct kvr_router *r, struct kvr_rank_id rank, uint64_t incarnation,
                          uint64_t capacity_blocks)
{
	struct kvr_rank_args a = {.incarnation = incarnation, .capacity = capacity_blocks};
	int rc = rank_call(r, rank, kvr_owner_rank_capacity, &a, "kvr_rank_set_capacity");
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_CAPACITY, rank, incarnation, capacity_blocks,
		                   0);
	if (rc == 0 && r->queue)
		kvr_queue_pump(r);
	return rc;
}

int kvr_rank_reset(struct kvr_router *r, struct kvr_rank_id rank, uint64_t new_incarnation)
{
	struct kvr_rank_args a = {.incarnation = new_incarnation};
	int rc = rank_call(r, rank, kvr_owner_rank_reset, &a, "kvr_rank_reset");
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_RESET, rank, new_incarnation, 0, 0);
	if (rc == 0 && r->queue)
		kvr_queue_pump(r);
	return rc;
}

int kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank, struct kvr_rank_stats *out)
{
	if (!out)
		return kvr_fail(KVR_EINVAL, "kvr_rank_get_stats: out is NULL");
	struct kvr_rank_args a = {.stats = out};
	return rank_call(r, rank, kvr_owner_rank_stats, &a, "kvr_rank_get_stats");
}

int kvr_rank_blocks(struct kvr_router *r, struct kvr_rank_id rank, uint64_t *out, size_t cap,
                    size_t *n_out)
{
	if (!n_out || (!out && cap))
		return kvr_fail(KVR_EINVAL, "kvr_rank_blocks: %s",
		                !n_out ? "n_out is NULL" : "out is NULL with cap > 0");
	*n_out = 0;
	struct kvr_rank_args a = {.blocks = out, .cap = cap};
	int rc = rank_call(r, rank, kvr_owner_rank_blocks, &a, "kvr_rank_blocks");
	if (rc == 0 || rc == KVR_ERANGE)
		*n_out = a.n;
	if (rc == KVR_ERANGE)
		return kvr_fail(rc, "kvr_rank_blocks: cap %zu is below the rank's %zu blocks", cap,
		                a.n);
	return rc;
}
