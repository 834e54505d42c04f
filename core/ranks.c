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
#include <time.h>

#include "core/limits.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "sync/rcu.h"
#include "sync/nocancel.h"

/* Attempt ids carry the slot in KVR_SLOT_BITS bits: every slot max_ranks allows must fit. */
_Static_assert(KVR_LIMIT_MAX_RANKS_MAX <= (1u << KVR_SLOT_BITS),
               "max_ranks limit does not fit the attempt id's slot bits");

/* The admin calls' serialization.  On a shard's thread (a router callback there: its clock, or
 * an on_admit the clock's finish pumped) the holder may be waiting for this very shard in a
 * call it makes under the lock (kvr_rank_add's create, a removal's teardown): waiting for the
 * lock would wait for good.  There the lock is tried, and while it is taken the shard its
 * holder waits for (admin_waits) is checked: KVR_EBUSY when that shard waits for this one,
 * directly or through others; else tried again (the holder lets it go, or starts waiting for
 * this shard, which the next look sees: it is stored before the call is posted). */
static int admin_lock(struct kvr_router *r, const char *fn)
{
	if (!kvr_shard_current()) {
		pthread_mutex_lock(&r->admin_lock);
		return 0;
	}
	while (pthread_mutex_trylock(&r->admin_lock) != 0) {
		struct kvr_shard *t = __atomic_load_n(&r->admin_waits, __ATOMIC_SEQ_CST);
		if (t && kvr_shard_waits_for_current(t))
			return kvr_fail(KVR_EBUSY,
			                "%s: called on a shard's thread (a router callback there) "
			                "while another rank add or remove waits for this shard",
			                fn);
		/* A grace period the holder waits for waits for this thread's read section. */
		if (__atomic_load_n(&r->admin_barrier, __ATOMIC_SEQ_CST) && kvr_rcu_read_ongoing())
			return kvr_fail(KVR_EBUSY,
			                "%s: called inside an RCU read section on a shard's thread "
			                "while another rank add waits for a grace period",
			                fn);
		nanosleep(&(struct timespec){0, 20000}, NULL);
	}
	return 0;
}

/* A call on sh under admin_lock, published as the holder's wait (admin_lock above). */
static int admin_call(struct kvr_router *r, struct kvr_shard *sh, kvr_call_fn fn,
                      struct kvr_rank_args *a, bool always)
{
	__atomic_store_n(&r->admin_waits, sh, __ATOMIC_SEQ_CST);
	int rc = always ? kvr_shard_call_always(sh, KVR_LANE_ROUTING, fn, a)
	                : kvr_shard_call(sh, KVR_LANE_ROUTING, fn, a);
	__atomic_store_n(&r->admin_waits, NULL, __ATOMIC_SEQ_CST);
	return rc;
}

static int check(struct kvr_router *r, const char *fn)
{
	if (!r)
		return kvr_fail(KVR_EINVAL, "%s: router is NULL", fn);
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "%s: %s", fn, kvr_router_gone(r));
	return 0;
}

/* The detail of a code that came from the rank's lookup or its shard (core/error.h). */
static __attribute__((cold, noinline)) int
rank_fail(const struct kvr_router *r, int rc, const char *fn, struct kvr_rank_id rank, uint64_t inc)
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
		return kvr_fail(rc, "%s: %s", fn, kvr_router_gone(r));
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
	KVR_NOCANCEL(); /* sync/nocancel.h */
	static const char fn[] = "kvr_rank_add";
	int rc = check(r, fn);
	if (rc)
		return rc;
	uint32_t slot, shard;
	struct kvr_rank_life life = {0, 0}; /* the life made, for the replica's note */
	if ((rc = admin_lock(r, fn)))
		return rc;
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
		                      : rank_fail(r, rc, fn, rank, incarnation);
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
		rc = rank_fail(r, rc, fn, rank, incarnation);
		goto out;
	}
	/* The live list's room first, so that the rank, once live, never has to be rolled back
	 * (before, a list copy that ran out of memory after the create left the rank routable
	 * for an instant: a pinned request could book on it, a stats call read it). */
	if ((rc = kvr_router_live_reserve(r))) {
		kvr_shard_wait_intent_end();
		kvr_shards_unplace(r->shards, rank.worker_id);
		rc = kvr_fail(rc, "%s: out of memory growing the live rank list", fn);
		goto out;
	}
	rc = admin_call(r, sh, kvr_owner_rank_create, &a, false);
	if (rc == KVR_ERANGE) {
		/* Fewer than max_ranks ranks are present (checked above), so every free slot is
		 * one a remove released and the index hands back only after a grace period.  Wait
		 * for the deferred releases queued so far, then try once more. */
		__atomic_store_n(&r->admin_barrier, 1, __ATOMIC_SEQ_CST);
		kvr_rcu_barrier();
		__atomic_store_n(&r->admin_barrier, 0, __ATOMIC_SEQ_CST);
		rc = admin_call(r, sh, kvr_owner_rank_create, &a, false);
	}
	if (rc) {
		kvr_shard_wait_intent_end();
		kvr_shards_unplace(r->shards, rank.worker_id);
		rc = rc == KVR_ERANGE ? kvr_fail(rc, "%s: no free rank slot (max_ranks %u)", fn,
		                                 r->cfg.max_ranks)
		                      : rank_fail(r, rc, fn, rank, incarnation);
		goto out;
	}
	struct kvr_rank_pub *pub = &r->ranks[a.slot];
	life.slot = a.slot;
	life.gen = __atomic_add_fetch(&pub->gen, 1, __ATOMIC_RELEASE);
	__atomic_store_n(&pub->live, 1, __ATOMIC_RELEASE);
	(void)kvr_router_live_update(r, a.slot, true); /* room reserved above: cannot fail */
	kvr_shard_wait_intent_end();
out:
	pthread_mutex_unlock(&r->admin_lock);
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_ADD, rank, incarnation, capacity_blocks,
		                   max_batched_tokens, life);
	if (rc == 0)
		kvr_feeds_rank_added(r); /* a rank they fed may be back: they rebuild it */
	if (rc == 0 && r->queue)
		kvr_queue_pump(r); /* a new rank may take queued requests */
	return rc;
}

/* kvr_rank_remove, of the rank's life (life_slot, life_gen) only when life is set: KVR_ESTALE,
 * nothing changed, when the id names another life now (removed and added again since). */
static int rank_remove(struct kvr_router *r, struct kvr_rank_id rank, const char *fn, bool life,
                       uint32_t life_slot, uint64_t life_gen)
{
	int rc = check(r, fn);
	if (rc)
		return rc;
	uint32_t slot;
	uint64_t gen;
	if ((rc = admin_lock(r, fn)))
		return rc;
	/* Under admin_lock the generation is the rank's for the whole call (every add and
	 * remove takes it). */
	if ((rc = kvr_router_find_rank_gen(r, rank, &slot, &gen))) {
		rc = rank_fail(r, rc, fn, rank, 0);
		goto out;
	}
	if (life && (slot != life_slot || gen != life_gen)) {
		rc = kvr_fail(KVR_ESTALE,
		              "%s: rank (worker %" PRIu64 ", dp %" PRIu32
		              ") was removed and added again since it was named",
		              fn, rank.worker_id, rank.dp_rank);
		goto out;
	}
	struct kvr_rank_pub *pub = &r->ranks[slot];
	/* From the rank's own shard (its clock, inside a task that may hold the rank's state):
	 * the teardown would free it under that task. */
	if (kvr_shard_is_current(kvr_router_shard_of(r, slot))) {
		rc = rank_fail(r, KVR_EBUSY, fn, rank, 0);
		goto out;
	}
	/* From a shard's thread (its clock): the teardown below waits for the rank's shard and
	 * cannot be refused once the rank is unroutable, so a cycle of shards waiting for each
	 * other is refused here, before anything changes, and the wait is recorded from now on. */
	struct kvr_shard *sh = kvr_router_shard_of(r, slot);
	if ((rc = kvr_shard_wait_intent(sh))) {
		rc = rank_fail(r, rc, fn, rank, 0);
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
	admin_call(r, sh, kvr_owner_rank_destroy, &a, true);
	kvr_shard_wait_intent_end();
	kvr_shards_unplace(r->shards, rank.worker_id);
out:
	pthread_mutex_unlock(&r->admin_lock);
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_REMOVE, rank, 0, 0, 0,
		                   (struct kvr_rank_life){0, 0});
	/* Queued requests pinned or allowed only to it fail now, not once the cluster's load lets
	 * the queue's passes reach them. */
	if (rc == 0 && r->queue)
		kvr_queue_rank_gone(r);
	return rc;
}

int kvr_rank_remove(struct kvr_router *r, struct kvr_rank_id rank)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	return rank_remove(r, rank, "kvr_rank_remove", false, 0, 0);
}

int kvr_repl_rank_life(struct kvr_router *r, struct kvr_rank_id rank, uint32_t *slot, uint64_t *gen)
{
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	return kvr_router_find_rank_gen(r, rank, slot, gen);
}

int kvr_repl_rank_remove_life(struct kvr_router *r, struct kvr_rank_id rank, uint32_t slot,
                              uint64_t gen)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	return rank_remove(r, rank, "kvr_rank_remove", true, slot, gen);
}

/* Runs fn on the rank's shard with the rank's current generation. */
/* read: call only reads the rank's state (it may run inline inside a task of the rank's
 * shard, kvr_shard_call_read). */
static int rank_call(struct kvr_router *r, struct kvr_rank_id rank, kvr_call_fn call,
                     struct kvr_rank_args *a, const char *fn, bool read)
{
	int rc = check(r, fn);
	if (rc)
		return rc;
	uint32_t slot;
	if ((rc = kvr_router_find_rank_gen(r, rank, &slot, &a->gen)))
		return rank_fail(r, rc, fn, rank, a->incarnation);
	a->slot = slot;
	struct kvr_shard *sh = kvr_router_shard_of(r, slot);
	rc = read ? kvr_shard_call_read(sh, KVR_LANE_ROUTING, call, a)
	          : kvr_shard_call(sh, KVR_LANE_ROUTING, call, a);
	return rc ? rank_fail(r, rc, fn, rank, a->incarnation) : 0;
}

/* After a capacity or reset call on a router with a queue: a pass (the rank may take queued
 * requests now), then the reclaim of the admissions nobody collected whose attempts the call
 * ended (a reset, or a capacity call naming a new incarnation, ends every attempt of the rank).
 * No lease is left to expire and wake the admission thread for them, and the pass returns at
 * once with nothing queued: on an idle router they stayed for good (test_regress
 * an_uncollected_admission_goes_when_a_reset_ends_its_attempt), as kvr_rank_remove's reclaim
 * (kvr_queue_rank_gone) already covers for a removed rank. */
static void queue_new_life(struct kvr_router *r)
{
	kvr_queue_pump(r);
	(void)kvr_queue_reap(r, NULL);
}

int kvr_rank_set_capacity(struct kvr_router *r, struct kvr_rank_id rank, uint64_t incarnation,
                          uint64_t capacity_blocks)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	struct kvr_rank_args a = {.incarnation = incarnation, .capacity = capacity_blocks};
	int rc = rank_call(r, rank, kvr_owner_rank_capacity, &a, "kvr_rank_set_capacity", false);
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_CAPACITY, rank, incarnation, capacity_blocks, 0,
		                   (struct kvr_rank_life){0, 0});
	if (rc == 0 && r->queue)
		queue_new_life(r);
	return rc;
}

int kvr_rank_reset(struct kvr_router *r, struct kvr_rank_id rank, uint64_t new_incarnation)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	struct kvr_rank_args a = {.incarnation = new_incarnation};
	int rc = rank_call(r, rank, kvr_owner_rank_reset, &a, "kvr_rank_reset", false);
	if (rc == 0)
		kvr_repl_note_rank(r, KVR_REPL_RANK_RESET, rank, new_incarnation, 0, 0,
		                   (struct kvr_rank_life){0, 0});
	if (rc == 0 && r->queue)
		queue_new_life(r);
	return rc;
}

int kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank, struct kvr_rank_stats *out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!out)
		return kvr_fail(KVR_EINVAL, "kvr_rank_get_stats: out is NULL");
	struct kvr_rank_args a = {.stats = out};
	return rank_call(r, rank, kvr_owner_rank_stats, &a, "kvr_rank_get_stats", true);
}

int kvr_rank_blocks(struct kvr_router *r, struct kvr_rank_id rank, uint64_t *out, size_t cap,
                    size_t *n_out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!n_out || (!out && cap))
		return kvr_fail(KVR_EINVAL, "kvr_rank_blocks: %s",
		                !n_out ? "n_out is NULL" : "out is NULL with cap > 0");
	*n_out = 0;
	struct kvr_rank_args a = {.blocks = out, .cap = cap};
	int rc = rank_call(r, rank, kvr_owner_rank_blocks, &a, "kvr_rank_blocks", true);
	if (rc == 0 || rc == KVR_ERANGE)
		*n_out = a.n;
	if (rc == KVR_ERANGE)
		return kvr_fail(rc, "kvr_rank_blocks: cap %zu is below the rank's %zu blocks", cap,
		                a.n);
	return rc;
}
