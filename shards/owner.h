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
 *  - struct kvr_rank_load, one per index slot, in its own array: snapshot + provisional load,
 *    added to by routing threads (admissions) and by the rank's shard (its snapshot's change,
 *    the provisional load taken back at booking), atomic RMW.  Any thread reads it.
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
	/* First cache line: what admissions and the booking read of the chosen rank. */
	uint32_t live; /* 1 while added (atomic) */
	uint32_t max_batched_tokens;
	/* Bumped (release) when the slot is added and when it is removed: a booking taken on an
	 * older generation is stale.  Ordering: acquire in the booking; routers take it from the
	 * live list (core/router_internal.h), which carries each slot's generation. */
	uint64_t gen;
	/* Load snapshot for stats and metrics: written by the owner shard, read anywhere (relaxed).
	 * Routing reads struct kvr_rank_load instead. */
	uint64_t active_blocks;
	uint64_t prefill_tokens;
	uint64_t active_requests;
	/* Identity: written by the admin path while the slot is not live. */
	uint64_t worker_id;
	uint32_t dp_rank;
	uint32_t shard;
	/* Snapshot read by stats and the replica layer (relaxed). */
	uint64_t incarnation;
	uint64_t resident_blocks;
	uint64_t capacity;
	/* Shard-thread only. */
	struct kvr_rank_owned *own;
} __attribute__((aligned(64)));

/*
 * The load a routing decision reads of every candidate, in an array of its own indexed by slot
 * (struct of arrays: 16 bytes a rank, four ranks per cache line, nothing else on those lines),
 * so scoring 64 candidates reads 16 lines instead of one struct kvr_rank_pub line per rank.
 * Each word is the rank's booked snapshot PLUS the provisional load of admissions posted but
 * not booked yet: a routing thread adds its request (atomic add) before it posts the booking;
 * the shard adds the change of its snapshot when it republishes, then subtracts the request's
 * provisional amounts after its booking is out, so a reader may count a request twice for an
 * instant, never miss it.  Ordering: relaxed RMW only (one location each; coherence gives "the
 * very next decision sees it").  At rest each word equals the shard's snapshot in struct
 * kvr_rank_pub.
 */
struct kvr_rank_load {
	uint64_t prefill_tokens; /* prefill tokens, booked (with decay) + provisional */
	uint64_t blocks;         /* active decode blocks, booked + the provisional new blocks */
};
_Static_assert(sizeof(struct kvr_rank_load) == 16, "four ranks per cache line");

/* Prefill tokens and decode blocks of a rank: snapshot + provisional.  Context: any thread. */
static inline uint64_t kvr_rank_load_prefill(const struct kvr_rank_load *l)
{
	return __atomic_load_n(&l->prefill_tokens, __ATOMIC_RELAXED);
}
static inline uint64_t kvr_rank_load_blocks(const struct kvr_rank_load *l)
{
	return __atomic_load_n(&l->blocks, __ATOMIC_RELAXED);
}

/* What shard code may use.  Filled once at router creation; read-only afterwards. */
struct kvr_owner_ctx {
	/* configuration values */
	uint32_t block_size;
	uint32_t max_ranks;
	enum kvr_mode mode;
	uint64_t ttl_ns;
	uint64_t lease_scan_interval_ns;
	uint64_t expected_prefill_ns;
	void (*on_event_gap)(void *ctx, uint64_t worker_id, uint32_t dp_rank, uint64_t expected,
	                     uint64_t got);
	void *callback_ctx;
	/* The lease reaper expired `attempt` (called on the shard thread, after the attempt ended;
	 * replica sync tells the peers, as for an abort).  NULL: nothing to tell. */
	void (*on_expire)(void *ctx, uint64_t attempt);
	void *expire_ctx;
	/* shared objects */
	struct kvr_clock clock;
	struct kvr_index *index;     /* cached blocks per rank */
	struct kvr_pinmap *pinmap;   /* every rank's pinned runs, for routers (shards/pinmap.h) */
	struct kvr_metrics *metrics; /* per-thread blocks */
	struct kvr_rank_pub *ranks;  /* [max_ranks] */
	struct kvr_rank_load *load;  /* [max_ranks]: what routing reads (snapshot + provisional) */
	struct kvr_leases *leases;   /* the router's attempt leases */
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
};

struct kvr_attempt; /* the shard's record of an attempt (shards/owner_attempts.c) */

/*
 * Builds the record of an admission (copies the prompt's hashes and tail).  Returns NULL when
 * out of memory.  Context: any thread (touches no shard state).  The record goes to the rank's
 * shard with kvr_owner_book_task / kvr_owner_book_call, or back with kvr_owner_attempt_free.
 */
struct kvr_attempt *kvr_owner_attempt_new(const struct kvr_owner_ctx *c,
                                          const struct kvr_admit_args *a);
void kvr_owner_attempt_free(const struct kvr_owner_ctx *c, struct kvr_attempt *rec);

/*
 * Records of long prompts are recycled: an admission of a 32k-token prompt needs a 32 KiB record,
 * and a fresh large allocation per admission (page faults, the allocator's large-size path) cost
 * more than the rest of the admission (perf/bench_route).  Freed records of 64..16384 blocks wait
 * in a per-size-class stack (16 deep) for the next admission of that class.  Each stack has a
 * mutex taken only with trylock: a busy stack means "allocate / free normally", so nobody waits.
 * Create returns 0, KVR_ENOMEM; destroy frees what is pooled (NULL is a no-op).
 * Context: create/destroy at router setup/teardown; new/free any thread.
 */
struct kvr_attempt_pool;
int kvr_attempt_pool_create(struct kvr_attempt_pool **out);
void kvr_attempt_pool_destroy(struct kvr_attempt_pool *pool);

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

enum kvr_progress_op {
	KVR_OP_PREFILL_DONE,
	KVR_OP_OUTPUT,
	KVR_OP_FINISH, /* the caller claimed the lease */
	KVR_OP_ABORT,  /* the caller claimed the lease */
};

/* Inline output tokens in a posted message; more go through a heap copy. */
#define KVR_PROGRESS_INLINE 8

/* kvr_progress_msg.flags: the last output token is known not to be the request's final one
 * (kvr_request_output_ex without KVR_OUTPUT_FINAL): its KV is computed in the engine's next
 * step, so it is not held back. */
#define KVR_PROGRESS_NOT_FINAL 1u

/* A lifecycle message (exactly one lane payload). */
struct kvr_progress_msg {
	uint64_t attempt;
	int16_t op;     /* enum kvr_progress_op */
	uint16_t flags; /* KVR_PROGRESS_* */
	uint32_t n_tokens;
	union {
		uint32_t inl[KVR_PROGRESS_INLINE];
		uint32_t *heap; /* kvr_alloc'd copy, freed by the shard (task form only) */
		const uint32_t *borrowed; /* call form */
	} tok;
};
_Static_assert(sizeof(struct kvr_progress_msg) <= KVR_SHARD_PAYLOAD, "one lane payload");

/* Applies a lifecycle message on the attempt's shard.  An attempt the shard does not hold (it
 * ended, or its booking was stale) is a no-op.  The task form frees a heap token copy; the call
 * form (msg borrowed, tokens in tok.borrowed) returns 0, KVR_ESTALE (not held here) or
 * KVR_ENOMEM (output).  Context: the attempt's shard thread (routing lane). */
void kvr_owner_progress_task(struct kvr_shard *sh, void *payload);
int kvr_owner_progress_call(struct kvr_shard *sh, void *msg);

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
};

struct kvr_event_args {
	uint32_t slot;
	uint64_t gen;
	const struct kvr_event *ev;
	const uint64_t *local; /* stored: local hash per block (computed by the caller) */
	bool rank_only;        /* cleared: this rank only, not every dp rank of its worker */
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
int kvr_owner_event(struct kvr_shard *sh, void *event_args);
/* Shard thread start/stop hooks (ctx: struct kvr_owner_ctx *). */
void kvr_owner_shard_start(struct kvr_shard *sh, void *ctx);
void kvr_owner_shard_stop(struct kvr_shard *sh, void *ctx);

#endif /* KVR_SHARDS_OWNER_H */
