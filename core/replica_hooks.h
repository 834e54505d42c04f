/*
 * core/replica_hooks.h - the router's side of replica sync (issue 14): where a replica layer
 * (sync/replica.c) hears about what this router did, and how it applies what peers did.
 *
 * Two directions, both narrow on purpose so that core/ does not depend on sync/:
 *  - out: after a successful admission, lifecycle call or rank change, the router calls the
 *    attached hooks (struct kvr_repl_hooks) with what happened.  Unattached, a note costs one
 *    acquire load of r->repl.  The hooks run on the caller's thread, inside an RCU read section,
 *    after the router's own work: a detach unpublishes r->repl, waits one grace period, and only
 *    then frees what the hooks use.
 *  - in: kvr_repl_admit books a peer's admission on a given rank with given block hashes,
 *    through the same shard path as kvr_route's admission (kvr_admit), without selection.
 *    Peers' lifecycle calls and rank changes go through the public calls while
 *    kvr_repl_applying is set on the thread, so they are applied exactly as local ones are but
 *    are not republished.
 */
#ifndef KVR_CORE_REPLICA_HOOKS_H
#define KVR_CORE_REPLICA_HOOKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/router_internal.h"
#include "kvrouter.h"

/* One admission, as kvr_route booked it or as a peer reports it.  Arrays are borrowed. */
struct kvr_repl_admission {
	struct kvr_rank_id rank;
	uint64_t incarnation;  /* the rank's incarnation the decision saw */
	uint64_t attempt;      /* out: the local attempt id (in: for notes, the admitted id) */
	const uint64_t *local; /* the prompt's complete blocks' local hashes */
	uint32_t n;
	uint64_t prompt_tokens;
	uint32_t overlap;         /* predicted cached prefix at the decision, blocks */
	uint32_t expected_output; /* tokens */
	uint64_t lora_seed;
	const uint32_t *tail; /* the prompt's partial block (tokens) when chain_known */
	uint32_t tail_n;
	bool chain_known;
};

enum kvr_repl_rank_op {
	KVR_REPL_RANK_ADD = 1,
	KVR_REPL_RANK_REMOVE = 2,
	KVR_REPL_RANK_CAPACITY = 3,
	KVR_REPL_RANK_RESET = 4,
};

/* Progress ops are enum kvr_progress_op (shards/owner.h); progressed also hears
 * KVR_OP_EXPIRED and KVR_OP_RANK_ENDED (the shard's ends of own attempts, possibly before their
 * admission), and KVR_OP_WITHDRAWN (an own attempt never admitted, whose end the shard tells:
 * kvr_admit).  progressed's not_final: an
 * output call's last token is known not to be the final one (kvr_request_output_ex without
 * KVR_OUTPUT_FINAL), so the router counted its KV slot at once; false for every other call. */
/* One life of a rank in a router: its slot and the slot's generation (bumped on every add and
 * remove).  gen 0: none known. */
struct kvr_rank_life {
	uint32_t slot;
	uint64_t gen;
};

struct kvr_repl_hooks {
	void *ctx;
	void (*admitted)(void *ctx, const struct kvr_repl_admission *a);
	void (*progressed)(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n,
	                   bool not_final);
	/* life: for an add, the life the router made (its slot and the slot's generation, as
	 * kvr_repl_rank_life reads them), read under the router's rank lock, so that the table's
	 * entry names the life its note describes even when later changes overtook the note;
	 * {0, 0} for the other ops. */
	void (*rank_changed)(void *ctx, int op, struct kvr_rank_id rank, uint64_t incarnation,
	                     uint64_t capacity, uint32_t max_batched_tokens,
	                     struct kvr_rank_life life);
	/* Appends Prometheus text at buf (room bytes, snprintf semantics); returns the length it
	 * needs.  May be NULL. */
	size_t (*render)(void *ctx, char *buf, size_t room);
	/* The bytes the layer's rank table holds (kvr_memory.replica_ranks).  May be NULL. */
	uint64_t (*memory)(void *ctx);
	/* The router is being destroyed: the layer must stop using it.  May be NULL. */
	void (*router_destroyed)(void *ctx);
};

/* Set while the replica layer applies a peer's message on this thread: notes are skipped. */
extern _Thread_local bool kvr_repl_applying;

/*
 * Installs (hooks non-NULL) or removes (NULL) the hooks.  Removing waits one RCU grace period,
 * so when it returns no thread is inside a hook any more.  hooks is borrowed until removed.
 * Returns 0, KVR_EBUSY (installing over other hooks), KVR_EINVAL.
 * Context: any thread outside an RCU read section; not inside a hook.
 */
int kvr_repl_set_hooks(struct kvr_router *r, struct kvr_repl_hooks *hooks);

/*
 * Books a peer's admission on a->rank with a->local hashes, exactly as kvr_route's admission
 * books a chosen rank (lease, predicted cache, load, index), with no selection and no note.
 * Sets a->attempt to the new local attempt id.  Like kvr_route, the booking is posted to the
 * rank's shard (the load counts at once, the blocks once the shard ran it; kvr_router_sync
 * waits for it) unless the router has sync_booking.
 * Returns 0, KVR_ENOENT (rank unknown or going), KVR_ESTALE (the rank's incarnation differs),
 * KVR_EINVAL, KVR_ERANGE, KVR_ENOMEM, KVR_ESHUTDOWN, KVR_EAGAIN (the lane stayed full).
 * Context: any thread, outside an RCU read section.
 */
int kvr_repl_admit(struct kvr_router *r, struct kvr_repl_admission *a);

/* The life of rank id in r now, for kvr_repl_rank_remove_life: its slot and the slot's
 * generation (kvr_router_find_rank_gen; a removal bumps it).  Returns 0, KVR_ENOENT (no such
 * rank), KVR_ENOMEM (this thread could not become an RCU reader), KVR_ESHUTDOWN.  Context: any
 * thread outside an RCU read section; no lock taken. */
int kvr_repl_rank_life(struct kvr_router *r, struct kvr_rank_id rank, uint32_t *slot,
                       uint64_t *gen);
/* kvr_rank_remove of the life (slot, gen) kvr_repl_rank_life read, and of no other: a rank
 * removed and added again since (another life under the same id) is left alone, KVR_ESTALE.
 * For a removal decided on what the caller read earlier (a snapshot's judgement, told with its
 * lock released: sync/replica_ranks.c).  Returns as kvr_rank_remove, and KVR_ESTALE.  Context:
 * as kvr_rank_remove. */
int kvr_repl_rank_remove_life(struct kvr_router *r, struct kvr_rank_id rank, uint32_t slot,
                              uint64_t gen);

/* The notes: called by route.c, lifecycle.c and ranks.c after a successful call. */
void kvr_repl_note_admit_slow(struct kvr_router *r, const struct kvr_repl_admission *a);
void kvr_repl_note_progress_slow(struct kvr_router *r, uint64_t attempt, int op,
                                 const uint32_t *tokens, size_t n, bool not_final);
/* The lease reaper expired one of this router's attempts, or its posted booking was dropped for
 * memory (shard thread; ctx is the router; kvr_owner_ctx.on_expire): told as progress op
 * KVR_OP_EXPIRED, which the layer publishes as an abort, so peers release their mirror at once
 * instead of on their own reaper, and the layer drops its record of the attempt. */
void kvr_repl_note_expire(void *ctx, uint64_t attempt);
/* The shard ended one of this router's own attempts with its rank's life, or dropped its posted
 * booking for the rank gone (shard thread; ctx is the router; kvr_owner_ctx.on_rank_end): told
 * as progress op KVR_OP_RANK_ENDED, which the layer publishes as an abort, so that its record
 * and its peers' mirrors end (no call and no expiry ever will). */
void kvr_repl_note_rank_end(void *ctx, uint64_t attempt);
void kvr_repl_note_rank_slow(struct kvr_router *r, int op, struct kvr_rank_id rank,
                             uint64_t incarnation, uint64_t capacity, uint32_t mbt,
                             struct kvr_rank_life life);
/* Whether a note would reach anyone.  Ordering: acquire; pairs with kvr_repl_set_hooks. */
static inline bool kvr_repl_attached(const struct kvr_router *r)
{
	return __atomic_load_n(&r->repl, __ATOMIC_ACQUIRE) != NULL && !kvr_repl_applying;
}

/* kvr_route's admission note, made only when kvr_repl_attached(r) was true before the booking
 * was posted (kvr_admit_args.noted: core/route.c says why it is not read again here).  Context:
 * the routing thread, outside an RCU read section or inside one (nested). */
void kvr_repl_note_route_slow(struct kvr_router *r, const struct kvr_admit_args *a,
                              const struct kvr_decision *d, uint32_t expected_output);
/* Inline wrappers for the other call sites: one acquire load when nothing is attached. */
static inline void kvr_repl_note_progress(struct kvr_router *r, uint64_t attempt, int op,
                                          const uint32_t *tokens, size_t n, bool not_final)
{
	if (kvr_repl_attached(r))
		kvr_repl_note_progress_slow(r, attempt, op, tokens, n, not_final);
}
static inline void kvr_repl_note_rank(struct kvr_router *r, int op, struct kvr_rank_id rank,
                                      uint64_t incarnation, uint64_t capacity, uint32_t mbt,
                                      struct kvr_rank_life life)
{
	if (kvr_repl_attached(r))
		kvr_repl_note_rank_slow(r, op, rank, incarnation, capacity, mbt, life);
}

/* Whether own attempt `attempt` has ended on r (finished, aborted, expired: its lease is
 * claimed or gone), for a replica layer that lost the note of its end.  Context: any thread;
 * one acquire load (shards/lease.h kvr_lease_state). */
bool kvr_repl_attempt_ended(struct kvr_router *r, uint64_t attempt);

/* Lists up to cap routable ranks (ids and max batched tokens); returns how many there are.
 * Context: any thread. */
size_t kvr_repl_list_ranks(struct kvr_router *r, struct kvr_rank_id *ids, uint32_t *mbt,
                           size_t cap);

/* Prometheus text of the attached layer (0 bytes when none); snprintf semantics. */
size_t kvr_repl_render(struct kvr_router *r, char *buf, size_t room);
/* The attached layer's memory hook's answer, 0 if none is attached.  Context: any thread outside
 * an RCU read section (kvr_router_get_memory). */
uint64_t kvr_repl_memory(struct kvr_router *r);
/* Called first thing by kvr_router_destroy. */
void kvr_repl_router_destroy(struct kvr_router *r);

#endif
