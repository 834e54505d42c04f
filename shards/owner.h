/*
 * shards/owner.h - the shard side of the router, as core/ sees it: the narrow context shard code
 * runs with, the per-rank table both sides share, and the operations a rank's shard runs.
 *
 * Shard code is handed struct kvr_owner_ctx (index, pinned-run map, metrics, clock, rank
 * table, lease table and the config values it uses), never the router: shards/ depends on core/'s
 * lower layer (clock, index, metrics) and on nothing above it.  The files:
 *   shards/owner_ranks.c     rank lifecycle: create, capacity, reset, destroy, stats; the shard's
 *                            own start/stop and timers; the load snapshot (publish)
 *   shards/owner_attempts.c  attempts: booking an admission, prefill/output/finish/abort, the
 *                            lease reaper
 *   shards/owner_events.c    KV events (events mode)
 *
 * Who owns what (ARCHITECTURE.md):
 *  - struct kvr_rank_pub, one per index slot: identity fields are written by the admin path
 *    (under the router's admin lock) before the slot is published live; the load snapshot is
 *    written only by the rank's shard (relaxed atomics: single writer).  Any thread reads them.
 *  - struct kvr_rank_load and struct kvr_rank_prov, one each per index slot, in arrays of their
 *    own: the booked load (the rank's shard, single writer) and the provisional load (routing
 *    threads, atomic adds).  Any thread reads them.
 *  - struct kvr_rank_owned (pub->own) and the shard's attempt records: only the rank's shard.
 * Attempt ids: (lease sequence << 16) | slot (shards/lease.h), so any thread finds an attempt's
 * rank, shard and lease word with no lookup; ids are never reused.
 */
#ifndef KVR_SHARDS_OWNER_H
#define KVR_SHARDS_OWNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/clock.h"
#include "core/index.h"
#include "core/metrics.h"
#include "kvrouter.h"
#include "shards/lease.h"
#include "shards/runtime.h"

#define KVR_SLOT_BITS KVR_LEASE_TAG_BITS
#define KVR_SLOT_MASK KVR_LEASE_TAG_MASK

static inline uint32_t kvr_attempt_slot(uint64_t attempt)
{
	return (uint32_t)(attempt & KVR_SLOT_MASK);
}

struct kvr_rank_owned;

struct kvr_rank_pub {
	/* First cache line, read-mostly: what a decision reads of the chosen rank (identity, shard)
	 * and the booking of its slot.  Nothing written per request lives here, so the line stays
	 * shared in every routing thread's cache. */
	uint32_t live; /* 1 while added (atomic) */
	uint32_t max_batched_tokens;
	/* Bumped (release) when the slot is added and when it is removed: a booking taken on an
	 * older generation is stale.  Ordering: acquire in the booking; routers take it from the
	 * live list (core/router_internal.h), which carries each slot's generation. */
	uint64_t gen;
	/* Identity: written by the admin path while the slot is not live. */
	uint64_t worker_id;
	uint32_t dp_rank;
	uint32_t shard;
	/* Shard-thread only (set at create and destroy). */
	struct kvr_rank_owned *own;
	/* Second cache line, written by the owner shard after every change, read anywhere
	 * (relaxed) by stats, metrics and the replica layer.  Routing reads struct kvr_rank_load
	 * and struct kvr_rank_prov instead. */
	uint64_t active_blocks __attribute__((aligned(64)));
	uint64_t prefill_tokens;
	uint64_t active_requests;
	uint64_t incarnation;
	uint64_t resident_blocks;
	uint64_t capacity;
} __attribute__((aligned(64)));
_Static_assert(offsetof(struct kvr_rank_pub, active_blocks) == 64, "shard writes: own line");

/*
 * The load a routing decision reads of every candidate, in two arrays of their own indexed by
 * slot (struct of arrays: 16 bytes a rank, four ranks per cache line), split by WRITER so that
 * nobody's write makes another writer's line bounce:
 *  - struct kvr_rank_load, written only by the rank's shard (single writer, plain release
 *    stores): the booked snapshot LESS the provisional amounts the shard has taken back;
 *  - struct kvr_rank_prov, written only by routing threads (atomic adds): the provisional
 *    amounts of every admission posted (less the posts that failed).  An admission's add hits a
 *    line no shard writes, so with one frontend thread it stays in that thread's cache.
 * A rank's load is their sum (modular): booked snapshot + provisional not yet booked.  A routing
 * thread adds its request to prov before it posts the booking; the shard, once the booking is
 * out, stores its new snapshot less the request's amounts.  Ordering: the shard's store is a
 * release, and readers load the shard word (acquire) BEFORE the prov word, so a reader that
 * sees a take-back also sees the add it takes back: the sum never misses a request (it may
 * count it twice between the shard's snapshot store and its take-back store, for an instant).
 * A booking that turns out stale takes its amounts back from prov instead (an atomic subtract:
 * by then the slot may belong to another shard, which is the single writer of its load word).
 */
struct kvr_rank_load {
	uint64_t prefill_tokens; /* booked prefill tokens (with decay) less those taken back */
	uint64_t blocks;         /* booked active decode blocks less those taken back */
};
struct kvr_rank_prov {
	uint64_t prefill_tokens; /* provisional prefill tokens ever added */
	uint64_t blocks;         /* provisional new decode blocks ever added */
};
_Static_assert(sizeof(struct kvr_rank_load) == 16, "four ranks per cache line");
_Static_assert(sizeof(struct kvr_rank_prov) == 16, "four ranks per cache line");

/* Prefill tokens and decode blocks of a rank: booked + provisional.  Context: any thread. */
static inline uint64_t kvr_rank_load_prefill(const struct kvr_rank_load *l,
                                             const struct kvr_rank_prov *p)
{
	/* Ordering: acquire; pairs with the release stores in kvr_owner_publish_load and the
	 * take-back (shards/owner_*.c). */
	uint64_t booked = __atomic_load_n(&l->prefill_tokens, __ATOMIC_ACQUIRE);
	return booked + __atomic_load_n(&p->prefill_tokens, __ATOMIC_RELAXED);
}
static inline uint64_t kvr_rank_load_blocks(const struct kvr_rank_load *l,
                                            const struct kvr_rank_prov *p)
{
	uint64_t booked = __atomic_load_n(&l->blocks, __ATOMIC_ACQUIRE); /* as above */
	return booked + __atomic_load_n(&p->blocks, __ATOMIC_RELAXED);
}

/* What shard code may use.  Filled once at router creation; read-only afterwards. */
struct kvr_owner_ctx {
	/* configuration values */
	uint32_t block_size;
	uint32_t max_ranks;
	enum kvr_mode mode;
	enum kvr_free_order free_order; /* approx_lru: keep_private (shards/lru.c) if TAIL_FIRST */
	uint64_t ttl_ns;
	uint64_t lease_scan_interval_ns;
	uint64_t expected_prefill_ns;
	uint64_t events_max_blocks; /* events mode: bound of a rank without a capacity */
	void (*on_event_gap)(void *ctx, uint64_t worker_id, uint32_t dp_rank, uint64_t expected,
	                     uint64_t got);
	void *callback_ctx;
	/* The lease reaper expired `attempt`, or its posted booking was dropped for memory and the
	 * drop won its lease's claim (called on the shard thread, after the attempt ended; replica
	 * sync tells the peers, as for an abort).  Only for an attempt whose admission its router
	 * noted to replica sync (kvr_admit_args.noted): not one booked for a peer replica, whose
	 * origin tells its end, nor one routed while no replica was attached.  NULL: nothing to
	 * tell. */
	void (*on_expire)(void *ctx, uint64_t attempt);
	void *expire_ctx;
	/* The shard ended `attempt` because its rank's life ended (a removal, a reset, a new
	 * incarnation: kvr_owner_end_all_attempts) or dropped its posted booking for the rank
	 * gone, and won its lease's claim: no lifecycle call and no expiry will ever tell it.
	 * Called on the shard thread, after the attempt ended, only for an attempt whose admission
	 * its router noted to replica sync (kvr_admit_args.noted).  ctx: expire_ctx.  NULL:
	 * nothing to tell. */
	void (*on_rank_end)(void *ctx, uint64_t attempt);
	/* The shard lowered load by itself, in no call of the router's: a lease expiry, the end of
	 * an attempt whose ending call's work never came, a booking dropped for memory, a decay
	 * step (expected_prefill_ns); or applied a posted lifecycle message (its call returned
	 * without waiting for it, and pumped nothing after it).  Called on the shard thread after
	 * the lowered load is published, once per timer fire or task; it must not block, allocate
	 * or take a lock (the router wakes its admission thread: core/queue_thread.c).  ctx:
	 * expire_ctx; ended: attempts ended with no call of the router's (an expiry, a claimed
	 * attempt whose end never came, a booking dropped), so an outcome of the router's queue
	 * that nobody collected may have ended with them.  NULL: nothing to tell (a router
	 * without a queue). */
	void (*on_unloaded)(void *ctx, bool ended);
	/* shared objects */
	struct kvr_clock clock;
	struct kvr_index *index;       /* cached blocks per rank */
	struct kvr_pinmap *pinmap;     /* every rank's pinned runs, for routers (shards/pinmap.h) */
	struct kvr_metrics *metrics;   /* per-thread blocks */
	struct kvr_rank_pub *ranks;    /* [max_ranks] */
	struct kvr_rank_load *load;    /* [max_ranks]: booked load, the shards' side */
	struct kvr_rank_prov *prov;    /* [max_ranks]: provisional load, the routers' side */
	struct kvr_leases *leases;     /* the router's attempt leases */
	struct kvr_attempt_pool *pool; /* recycled attempt records */
};

/* An admission, as the caller describes it (borrowed for kvr_owner_attempt_new). */
struct kvr_admit_args {
	uint32_t slot;
	uint64_t gen;
	uint64_t attempt;            /* minted by the caller (kvr_lease_mint) */
	const uint64_t *local, *seq; /* the prompt's complete blocks */
	size_t n;
	uint64_t prompt_tokens;
	const uint32_t *tail; /* the prompt's partial last block (tokens), may be NULL */
	uint32_t tail_n;
	bool chain_known; /* the tail tokens are known, so output blocks can be hashed */
	uint64_t lora_seed;
	uint32_t overlap;
	/* provisional load the caller added to the rank (taken back at the booking) */
	uint64_t pend_prefill_tokens;
	uint64_t pend_blocks;
	/* kvr_admit: a record from kvr_owner_attempt_reserve, consumed whatever kvr_admit
	 * returns; NULL: one is made (a copy) */
	struct kvr_attempt *reserved;
	/* the reserved record holds the hashes already (written by the caller); local and seq
	 * may then be copies elsewhere, read for nothing but the last sequence hash */
	bool in_record;
	/* Its admission is noted to replica sync, so the shard tells its end when it ends it
	 * (kvr_owner_ctx.on_expire, on_rank_end).  Decided by the router before the booking is
	 * posted, with the note (core/route.c says why): false for an attempt routed while no
	 * replica was attached, whose end would find no record on the sender and wait in its
	 * early set for nothing (sync/replica_early.c), and for a peer replica's attempt
	 * (kvr_repl_admit), whose origin tells its end. */
	bool noted;
};

struct kvr_attempt; /* the shard's record of an attempt (shards/owner_attempts.c) */

/*
 * Builds the record of an admission (copies the prompt's hashes and tail).  Returns NULL when
 * out of memory.  Context: any thread (touches no shard state).  The record goes to the rank's
 * shard with kvr_owner_book_task / kvr_owner_book_call, or back with kvr_owner_attempt_free.
 */
struct kvr_attempt *kvr_owner_attempt_new(const struct kvr_owner_ctx *c,
                                          const struct kvr_admit_args *a);
/*
 * The same in two steps, so a router can hash a prompt straight into its record: reserve one
 * with room for n blocks (*hashes: its blocks, (local, seq) pairs: local i at [2i], seq i at
 * [2i + 1]), then fill it from a (a->n == n; unless a->in_record, a->local and a->seq are
 * copied in).  A reserved record not filled goes back with
 * kvr_owner_attempt_free.  Reserve returns NULL when out of memory.  Context: any thread.
 */
struct kvr_attempt *kvr_owner_attempt_reserve(const struct kvr_owner_ctx *c, size_t n,
                                              uint64_t **hashes);
/* Asks for the line of the pool stack kvr_owner_attempt_reserve(c, n) will take from (its lock,
 * count and top: the shard that gave the last record back wrote it), so that a reserve some
 * hundreds of cycles later finds it.  A hint only.  Context: any thread. */
void kvr_owner_attempt_prefetch(const struct kvr_owner_ctx *c, size_t n);
void kvr_owner_attempt_fill(const struct kvr_owner_ctx *c, struct kvr_attempt *rec,
                            const struct kvr_admit_args *a);
/* How many records the calling thread has allocated (kvr_owner_attempt_reserve finding the
 * pool's class empty or busy): an allocation of the prompt's size on the routing thread, one
 * of the steps that make a route slow (counted, for attributing tails).  Context: any thread. */
uint64_t kvr_owner_thread_record_allocs(void);
void kvr_owner_attempt_free(const struct kvr_owner_ctx *c, struct kvr_attempt *rec);

/*
 * Records of long prompts are recycled: an admission of a 32k-token prompt needs a 32 KiB record,
 * and a fresh large allocation per admission (page faults, the allocator's large-size path) cost
 * more than the rest of the admission (perf/bench_route).  Freed records of 64..16384 blocks wait
 * in a per-size-class stack for the next admission of that class (256 deep up to 128 blocks,
 * then 512 KB of hashes a class, at least 2: 4.25 MB of hashes in all, owner_attempts.c).  Each
 * stack has a lock taken only with a try (one exchange): a busy stack means "allocate / free
 * normally", so nobody waits.
 * Create returns 0, KVR_ENOMEM; destroy frees what is pooled (NULL is a no-op).
 * Context: create/destroy at router setup/teardown; new/free any thread.
 */
struct kvr_attempt_pool;
int kvr_attempt_pool_create(struct kvr_attempt_pool **out);
void kvr_attempt_pool_destroy(struct kvr_attempt_pool *pool);
/* The pool's bytes: its records kept and itself, at allocator sizes (0 for NULL).
 * Context: any thread; a relaxed read, exact when no record moves meanwhile. */
uint64_t kvr_attempt_pool_bytes(const struct kvr_attempt_pool *pool);
/* Frees every record the pool keeps (NULL is a no-op): a router with no traffic has no use for
 * them (kvr_owner_shard_idle).  Context: any thread; takes each class's lock in turn (yielding
 * while a take or a give holds it). */
void kvr_attempt_pool_trim(struct kvr_attempt_pool *pool);

/*
 * Books an admission on its rank's shard: the attempt's record, the predicted cache (acquire),
 * the index writes, the load; then publishes the snapshot and takes back the provisional load.
 * A rank removed (generation changed) since the decision makes the attempt stale: its lease is
 * claimed and released, nothing is booked.  The task takes a struct kvr_attempt * payload and
 * owns the record from then on; the call takes the record as arg and returns 0, KVR_ENOENT
 * (stale), KVR_ENOMEM.  Context: the rank's shard thread (routing lane).
 */
void kvr_owner_book_task(struct kvr_shard *sh, void *payload);
int kvr_owner_book_call(struct kvr_shard *sh, void *rec);

/*
 * sync_booking's deferred booking (kvr_shard_post_at): kvr_owner_book_task for a poster that took
 * room with kvr_owner_book_room_take first, so the booking cannot fail for memory (a stale one
 * is dropped as by the task).
 * Room: every shard keeps its attempt map and array grown ahead of its bookings and publishes
 * how many more it can track without allocating; a poster takes one (true) before it posts a
 * deferred booking, or (false: none left, e.g. after an allocation failed) books with
 * kvr_owner_book_call, whose KVR_ENOMEM it then returns as sync_booking always did.
 * Context: book: the shard thread; room_take: any thread (one atomic add).
 */
void kvr_owner_book_deferred_task(struct kvr_shard *sh, void *payload);
bool kvr_owner_book_room_take(struct kvr_shard *sh);
/* Gives back the room a poster took for a deferred booking it could not post (the shard never
 * sees it, so only the poster can: the room was lost for good).  Context: any thread. */
void kvr_owner_book_room_give(struct kvr_shard *sh);

enum kvr_progress_op {
	KVR_OP_PREFILL_DONE,
	KVR_OP_OUTPUT,
	KVR_OP_FINISH, /* the caller claimed the lease */
	KVR_OP_ABORT,  /* the caller claimed the lease */
	/* Only in a replica note (kvr_owner_ctx.on_rank_end), never posted to a shard: the shard
	 * ended the attempt when its rank's life ended (removed, reset, a new incarnation) or
	 * dropped its booking for the rank gone, winning the claim. */
	KVR_OP_RANK_ENDED,
	/* Only in a replica note (kvr_owner_ctx.on_expire), never posted to a shard: the lease
	 * reaper expired the attempt, or its posted booking was dropped for memory.  Told apart
	 * from a caller's abort because, like a rank's end, it is told on the shard thread and can
	 * reach replica sync before the attempt's admission note (sync/replica_early.c); a
	 * caller's end never can. */
	KVR_OP_EXPIRED,
	/* Only in a replica note, never posted to a shard: kvr_route gave up a noted attempt
	 * after posting its booking (sync_booking: the rank's generation moved after the post,
	 * kvr_admit's KVR_ENOENT; the route decides again), so its admission is never noted,
	 * while the shard, which alone can claim its lease (nobody else has the id), tells its
	 * end (KVR_OP_RANK_ENDED, or KVR_OP_EXPIRED) in either order with this note.  The sender
	 * pairs the two in its early set (sync/replica_early.c). */
	KVR_OP_WITHDRAWN,
};

/* Inline output tokens in a posted message; more go through a heap copy.  Six, so that the
 * message fits a timed post (KVR_SHARD_TIMED_PAYLOAD: sync_booking's deferred lifecycle work). */
#define KVR_PROGRESS_INLINE 6

/* kvr_progress_msg.flags: the last output token is known not to be the request's final one
 * (kvr_request_output_ex without KVR_OUTPUT_FINAL): its KV is computed in the engine's next
 * step, so it is not held back. */
#define KVR_PROGRESS_NOT_FINAL 1u
/* The posted message, once applied, calls on_unloaded: a route may have read the load before it
 * and queued (core/queue.c).  Not with sync_booking, where every call settles posted work before
 * it reads: its admissions stay on the simulation's own calls, in order. */
#define KVR_PROGRESS_WAKE 2u

/* A lifecycle message (exactly one lane payload). */
struct kvr_progress_msg {
	uint64_t attempt;
	int16_t op;     /* enum kvr_progress_op */
	uint16_t flags; /* KVR_PROGRESS_* */
	uint32_t n_tokens;
	union {
		uint32_t inl[KVR_PROGRESS_INLINE];
		uint32_t *heap; /* kvr_alloc'd copy, freed by the shard */
	} tok;
};
_Static_assert(sizeof(struct kvr_progress_msg) <= KVR_SHARD_TIMED_PAYLOAD, "one timed payload");

/* Applies a lifecycle message on the attempt's shard, and frees its heap token copy.  An attempt
 * the shard does not hold (it ended, or its booking was stale) is a no-op.  Context: the
 * attempt's shard thread (routing lane). */
void kvr_owner_progress_task(struct kvr_shard *sh, void *payload);

/* Arguments of the synchronous rank operations. */
struct kvr_rank_args {
	uint64_t worker_id; /* create */
	uint32_t dp_rank;
	uint32_t max_batched_tokens;
	uint32_t slot; /* create: out; others: in */
	uint64_t gen;
	uint64_t incarnation;
	uint64_t capacity;
	struct kvr_rank_stats *stats;
	uint64_t *blocks; /* kvr_owner_rank_blocks: out, cap in / count out */
	size_t cap, n;
	uint64_t cache_bytes, load_bytes; /* kvr_owner_rank_memory: out */
};

struct kvr_event_args {
	uint32_t slot;
	uint64_t gen;
	const struct kvr_event *ev;
	const uint64_t *local; /* stored: local hash per block (computed by the caller) */
	bool rank_only;        /* cleared: this rank only, not every dp rank of its worker */
	/* Out: the event ids skipped (gap_from..gap_to-1; gap_to 0: none), for the caller to
	 * report through on_event_gap on its own thread once the call returns. */
	uint64_t gap_from, gap_to;
	/* Out: the index refused the stored event for want of a run id (KVR_ERANGE from
	 * kvr_index_store, not the rank's bound), for the caller's detail. */
	bool index_full;
	/* Out: KVR_ENOENT because the rank was removed (or its slot's generation moved on) after
	 * the caller found it, not a stored event's parent the rank does not hold: both are
	 * KVR_ENOENT to the API, the caller's detail and log say which. */
	bool rank_gone;
};

/* Engine ground truth (issue 15; shards/owner_heal.c).  Context: the rank's shard thread. */
struct kvr_heal_args {
	uint64_t attempt;       /* kvr_owner_cached_call */
	uint64_t cached_tokens; /* kvr_owner_cached_call */
	uint32_t slot;          /* kvr_owner_observe_call */
	uint64_t gen;           /* kvr_owner_observe_call */
	const struct kvr_rank_observation *obs;
};
/* The attempt's cached-token report: KVR_ESTALE if the shard has no live record of it. */
int kvr_owner_cached_call(struct kvr_shard *sh, void *arg);
/* A rank observation: KVR_ENOENT if the slot's generation changed. */
int kvr_owner_observe_call(struct kvr_shard *sh, void *arg);

/* Synchronous calls on the slot's shard (Context: that shard thread, outside any RCU read
 * section), reached with kvr_shard_call. */
int kvr_owner_rank_create(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_destroy(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_capacity(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_reset(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_stats(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_blocks(struct kvr_shard *sh, void *rank_args);
/* The bytes of the rank's predicted cache (kvr_lru_bytes; 0 without one) and load tracker
 * (kvr_load_bytes). */
int kvr_owner_rank_memory(struct kvr_shard *sh, void *rank_args);
int kvr_owner_event(struct kvr_shard *sh, void *event_args);
/* Shard thread start/stop hooks (ctx: struct kvr_owner_ctx *). */
void kvr_owner_shard_start(struct kvr_shard *sh, void *ctx);
void kvr_owner_shard_stop(struct kvr_shard *sh, void *ctx);
/* Shard idle hook (kvr_shards_config.on_idle; ctx: struct kvr_owner_ctx *): the shard has had no
 * work for 100 ms, so the recycled attempt records go back to the allocator before its purge.
 * The pool serves bursts of admissions (bench_route's tails); idle, it held up to ~1.8 MB and
 * pinned slabs of the transient arena (bench_footprint, 8 ranks: 0.7 / 5.7 B per tracked
 * (block, rank) kept at 2k / 32k prompts, and ~2 B of half-empty slabs).  The next burst
 * allocates its first records again (one per class and frontend in flight).  And the index's
 * retired objects still waiting for a full batch go to RCU (kvr_index_flush_retired_try): up to
 * 255 of them (~4 MB of hash arrays at worst) waited for the next write, for good on an idle
 * router; with the writers' mutex held by another shard's write, that shard's own idle hook
 * flushes them instead of this one waiting. */
void kvr_owner_shard_idle(struct kvr_shard *sh, void *ctx);

#endif /* KVR_SHARDS_OWNER_H */
