/*
 * core/replica_hooks.c - the router's side of replica sync: notes out, peer admissions in.
 * See core/replica_hooks.h for the contract and sync/replica.c for the layer that uses it.
 *
 * Why peer admissions get their own entry instead of going through kvr_route: a peer already
 * chose the rank, and every replica must book the SAME rank with the SAME hashes, or the
 * predicted caches diverge.  So this skips hashing of tokens (the peer sends local hashes),
 * the index lookup and selection, and does exactly what kvr_route's step 5 does: mint an
 * attempt id and book it on the rank's shard (kvr_admit: posted, or waited for with
 * sync_booking, as kvr_route does).  The queue is bypassed: the peer's router already admitted
 * the request.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/replica_hooks.h"
#include "sync/rcu.h"

_Thread_local bool kvr_repl_applying;

int kvr_repl_set_hooks(struct kvr_router *r, struct kvr_repl_hooks *hooks)
{
	if (!r)
		return KVR_EINVAL;
	if (hooks) {
		struct kvr_repl_hooks *none = NULL;
		if (!__atomic_compare_exchange_n(&r->repl, &none, hooks, false, __ATOMIC_RELEASE,
		                                 __ATOMIC_RELAXED))
			return KVR_EBUSY;
		return 0;
	}
	__atomic_store_n(&r->repl, NULL, __ATOMIC_RELEASE);
	kvr_rcu_synchronize(); /* every note that saw the hooks has returned */
	return 0;
}

int kvr_repl_admit(struct kvr_router *r, struct kvr_repl_admission *m)
{
	if (!r || !m || (m->n && !m->local) || (m->tail_n && !m->tail) ||
	    m->tail_n >= r->cfg.block_size)
		return KVR_EINVAL;
	uint32_t slot;
	uint64_t gen;
	int rc = kvr_router_enter_rank(r, m->rank, &slot, &gen);
	if (rc)
		return rc;
	struct kvr_rank_pub *pub = &r->ranks[slot];
	if (__atomic_load_n(&pub->incarnation, __ATOMIC_RELAXED) != m->incarnation)
		return KVR_ESTALE;
	size_t n = m->n;
	uint64_t *seq = kvr_alloc((n ? n : 1) * sizeof(uint64_t));
	if (!seq)
		return KVR_ENOMEM;
	kvr_hash_chain_locals(NULL, m->local, n, seq);
	struct kvr_admit_args a = {
	    .slot = slot,
	    .gen = gen,
	    .local = m->local,
	    .seq = seq,
	    .n = n,
	    .prompt_tokens = m->prompt_tokens,
	    .tail = m->tail,
	    .tail_n = m->tail_n,
	    .chain_known = m->chain_known,
	    .lora_seed = m->lora_seed,
	    .overlap = m->overlap,
	    .pend_blocks = n,
	    .noted = false, /* a mirror: its end is the origin's to tell (on_rank_end) */
	};
	/* Posted like kvr_route's own admissions (waited for only with sync_booking): the lane is
	 * FIFO, so the peer's later lifecycle calls for this attempt are applied after the
	 * booking, and the apply thread goes on with the next message while the shard books. */
	rc = kvr_admit(r, &a, r->cfg.sync_booking, true);
	kvr_free(seq, (n ? n : 1) * sizeof(uint64_t));
	if (rc == 0)
		m->attempt = a.attempt;
	return rc;
}

void kvr_repl_note_admit_slow(struct kvr_router *r, const struct kvr_repl_admission *a)
{
	kvr_rcu_read_lock();
	struct kvr_repl_hooks *h = kvr_rcu_deref(&r->repl);
	if (h && h->admitted)
		h->admitted(h->ctx, a);
	kvr_rcu_read_unlock();
}

void kvr_repl_note_route_slow(struct kvr_router *r, const struct kvr_admit_args *a,
                              const struct kvr_decision *d, uint32_t expected_output)
{
	struct kvr_repl_admission m = {
	    .rank = d->rank,
	    .incarnation = __atomic_load_n(&r->ranks[a->slot].incarnation, __ATOMIC_RELAXED),
	    .attempt = a->attempt,
	    .local = a->local,
	    .n = (uint32_t)a->n,
	    .prompt_tokens = a->prompt_tokens,
	    .overlap = a->overlap,
	    .expected_output = expected_output,
	    .lora_seed = a->lora_seed,
	    .tail = a->chain_known ? a->tail : NULL,
	    .tail_n = a->chain_known ? a->tail_n : 0,
	    .chain_known = a->chain_known,
	};
	kvr_repl_note_admit_slow(r, &m);
}

void kvr_repl_note_progress_slow(struct kvr_router *r, uint64_t attempt, int op,
                                 const uint32_t *tokens, size_t n, bool not_final)
{
	kvr_rcu_read_lock();
	struct kvr_repl_hooks *h = kvr_rcu_deref(&r->repl);
	if (h && h->progressed)
		h->progressed(h->ctx, attempt, op, tokens, n, not_final);
	kvr_rcu_read_unlock();
}

void kvr_repl_note_expire(void *ctx, uint64_t attempt)
{
	kvr_repl_note_progress(ctx, attempt, KVR_OP_EXPIRED, NULL, 0, false);
}

void kvr_repl_note_rank_end(void *ctx, uint64_t attempt)
{
	kvr_repl_note_progress(ctx, attempt, KVR_OP_RANK_ENDED, NULL, 0, false);
}

void kvr_repl_note_rank_slow(struct kvr_router *r, int op, struct kvr_rank_id rank,
                             uint64_t incarnation, uint64_t capacity, uint32_t mbt,
                             struct kvr_rank_life life)
{
	kvr_rcu_read_lock();
	struct kvr_repl_hooks *h = kvr_rcu_deref(&r->repl);
	if (h && h->rank_changed)
		h->rank_changed(h->ctx, op, rank, incarnation, capacity, mbt, life);
	kvr_rcu_read_unlock();
}

size_t kvr_repl_render(struct kvr_router *r, char *buf, size_t room)
{
	size_t n = 0;
	if (kvr_rcu_thread_online())
		return 0;
	kvr_rcu_read_lock();
	struct kvr_repl_hooks *h = kvr_rcu_deref(&r->repl);
	if (h && h->render)
		n = h->render(h->ctx, buf, room);
	kvr_rcu_read_unlock();
	return n;
}

uint64_t kvr_repl_memory(struct kvr_router *r)
{
	uint64_t n = 0;
	if (kvr_rcu_thread_online())
		return 0;
	kvr_rcu_read_lock();
	struct kvr_repl_hooks *h = kvr_rcu_deref(&r->repl);
	if (h && h->memory)
		n = h->memory(h->ctx);
	kvr_rcu_read_unlock();
	return n;
}

void kvr_repl_router_destroy(struct kvr_router *r)
{
	struct kvr_repl_hooks *h = __atomic_load_n(&r->repl, __ATOMIC_ACQUIRE);
	if (h && h->router_destroyed)
		h->router_destroyed(h->ctx); /* the layer detaches itself */
	__atomic_store_n(&r->repl, NULL, __ATOMIC_RELEASE);
}

bool kvr_repl_attempt_ended(struct kvr_router *r, uint64_t attempt)
{
	int st = kvr_lease_state(r->leases, attempt);
	return st < 0 || st == KVR_LEASE_CLAIMED;
}

size_t kvr_repl_list_ranks(struct kvr_router *r, struct kvr_rank_id *ids, uint32_t *mbt, size_t cap)
{
	if (kvr_rcu_thread_online())
		return 0;
	kvr_rcu_read_lock();
	const struct kvr_live *live = kvr_rcu_deref(&r->live);
	size_t n = kvr_live_n(live);
	for (size_t i = 0; i < n && i < cap; i++) {
		const struct kvr_rank_pub *p = &r->ranks[live->slot[i]];
		ids[i].worker_id = __atomic_load_n(&p->worker_id, __ATOMIC_RELAXED);
		ids[i].dp_rank = __atomic_load_n(&p->dp_rank, __ATOMIC_RELAXED);
		mbt[i] = __atomic_load_n(&p->max_batched_tokens, __ATOMIC_RELAXED);
	}
	kvr_rcu_read_unlock();
	return n;
}
