/*
 * core/router_internal.h - the router's shape, shared by core/ (the caller side: route,
 * lifecycle, events, ranks, queue, metrics) and shards/rank_owner.c (the shard side).
 *
 * Who owns what (ARCHITECTURE.md):
 *  - struct kvr_rank_pub, one per index slot: identity fields are written by the admin path
 *    under admin_lock before the slot is published in `live`; the load snapshot is written only
 *    by the rank's shard thread (relaxed atomics: single writer, readers want a recent value,
 *    not a consistent set).  Any thread reads them.
 *  - struct kvr_rank_owned (pub->own): the rank's predicted cache (rank_state: LRU or TTL), its
 *    load, its event cursor and its live attempts.  Only the rank's shard thread touches it.
 *  - struct kvr_shard_state (shard userdata): the shard's lease table and attempt records,
 *    scratch buffers, timers.  Only that shard thread touches it.
 *  - `live`: the array of routable slots, RCU-published copy-on-write by the admin path;
 *    routers read it inside a read section.
 * Attempt ids: (sequence << 16) | slot, so any thread finds an attempt's rank (and shard) with
 * no lookup; the sequence part is never reused, so an id is never reused either.
 */
#ifndef KVR_CORE_ROUTER_INTERNAL_H
#define KVR_CORE_ROUTER_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/clock.h"
#include "core/index.h"
#include "core/metrics.h"
#include "kvrouter.h"
#include "shards/lease.h"
#include "shards/runtime.h"

#define KVR_SLOT_BITS       16u
#define KVR_SLOT_MASK       ((1u << KVR_SLOT_BITS) - 1u)
#define KVR_ATTEMPT_SEQ_MAX (UINT64_C(1) << (62 - KVR_SLOT_BITS))

static inline uint32_t kvr_attempt_slot(uint64_t attempt)
{
	return (uint32_t)(attempt & KVR_SLOT_MASK);
}

struct kvr_rank_owned;

struct kvr_rank_pub {
	/* Identity: written under admin_lock while the slot is not live. */
	uint64_t worker_id;
	uint32_t dp_rank;
	uint32_t shard;
	uint32_t max_batched_tokens;
	/* Bumped (release) when the slot is added and when it is removed: a decision taken on an
	 * older generation is refused at admission.  Ordering: acquire in route. */
	uint64_t gen;
	uint32_t live; /* 1 while added (atomic) */
	/* Load snapshot: written by the owner shard, read anywhere (relaxed). */
	uint64_t incarnation;
	uint64_t active_blocks;
	uint64_t prefill_tokens;
	uint64_t active_requests;
	uint64_t resident_blocks;
	uint64_t capacity;
	/* Shard-thread only. */
	struct kvr_rank_owned *own;
} __attribute__((aligned(64)));

struct kvr_live {
	struct rcu_head rcu;
	uint32_t n;
	uint32_t slot[];
};

struct kvr_queue;      /* core/queue.c */
struct kvr_repl_hooks; /* core/replica_hooks.h */

struct kvr_router {
	struct kvr_config cfg;
	struct kvr_clock clock;
	struct kvr_index *index;
	struct kvr_shards *shards;
	struct kvr_metrics *metrics;
	struct kvr_attempt_ids ids;
	struct kvr_rank_pub *ranks;  /* [cfg.max_ranks], indexed by index slot */
	struct kvr_live *live;       /* RCU */
	pthread_mutex_t admin_lock;  /* rank add / remove / reset, live list writers */
	uint64_t rng_counter;        /* per-decision random stream (atomic) */
	struct kvr_queue *queue;     /* NULL unless queue_threshold > 0 */
	uint32_t shutting_down;      /* atomic */
	struct kvr_repl_hooks *repl; /* replica sync hooks, NULL = none (RCU, acquire) */
};

/* Arguments of the shard-side operations (borrowed for a synchronous call). */
struct kvr_admit_args {
	struct kvr_router *r;
	uint32_t slot;
	uint64_t gen;
	uint64_t attempt;
	const uint64_t *local, *seq; /* the prompt's complete blocks */
	size_t n;
	uint64_t prompt_tokens;
	const uint32_t *tail; /* the prompt's partial last block (tokens), may be NULL */
	uint32_t tail_n;
	bool chain_known; /* the tail tokens are known, so output blocks can be hashed */
	uint64_t lora_seed;
	uint32_t overlap;
};

struct kvr_progress_args {
	struct kvr_router *r;
	uint64_t attempt;
	int op; /* enum kvr_progress_op */
	const uint32_t *tokens;
	size_t n_tokens;
};

enum kvr_progress_op {
	KVR_OP_PREFILL_DONE,
	KVR_OP_OUTPUT,
	KVR_OP_FINISH,
	KVR_OP_ABORT,
};

struct kvr_event_args {
	struct kvr_router *r;
	uint32_t slot;
	uint64_t gen;
	const struct kvr_event *ev;
	const uint64_t *local; /* stored: local hash per block (computed by the caller) */
	bool rank_only;        /* cleared: this rank only, not every dp rank of its worker */
};

struct kvr_rank_args {
	struct kvr_router *r;
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

/* shards/rank_owner.c: shard-thread side.  All run on the slot's shard thread via
 * kvr_shard_call (Context: that shard thread, outside any RCU read section). */
int kvr_owner_rank_create(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_destroy(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_capacity(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_reset(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_stats(struct kvr_shard *sh, void *rank_args);
int kvr_owner_rank_blocks(struct kvr_shard *sh, void *rank_args);
int kvr_owner_admit(struct kvr_shard *sh, void *admit_args);
int kvr_owner_progress(struct kvr_shard *sh, void *progress_args);
int kvr_owner_event(struct kvr_shard *sh, void *event_args);
void kvr_owner_shard_start(struct kvr_shard *sh, void *router);
void kvr_owner_shard_stop(struct kvr_shard *sh, void *router);

/* core/queue.c */
int kvr_queue_create(struct kvr_router *r, struct kvr_queue **out);
void kvr_queue_destroy(struct kvr_queue *q);
/* Whether every eligible rank is saturated (see kvr_config.queue_threshold). */
bool kvr_queue_saturated(struct kvr_router *r, const uint32_t *slots, size_t n);
/* Queues a copy of req (key: WSPT weight, predicted uncached tokens).  Returns 0 with
 * d->status KVR_QUEUED, KVR_EAGAIN (full), KVR_ENOMEM, KVR_ESHUTDOWN. */
int kvr_queue_push(struct kvr_router *r, const struct kvr_request *req, uint64_t key,
                   struct kvr_decision *d);
/* Tries to admit waiting requests (after load dropped).  Context: any thread, no shard's. */
void kvr_queue_pump(struct kvr_router *r);
size_t kvr_queue_depth(struct kvr_router *r);

/* How kvr_route_internal treats saturation. */
enum kvr_queue_mode {
	KVR_QUEUE_IF_SATURATED = 0, /* kvr_route: queue the request */
	KVR_QUEUE_FROM_PUMP = 1,    /* the pump: KVR_EAGAIN, the request stays queued */
};

/* core/route.c: the decision and admission for an already validated request (also used by the
 * queue pump). */
int kvr_route_internal(struct kvr_router *r, const struct kvr_request *req, struct kvr_decision *d,
                       int queue_mode);

/* core/router.c: replaces the live list (slot added or removed).  Context: under admin_lock. */
int kvr_router_live_update(struct kvr_router *r, uint32_t slot, bool add);

/* The rank behind a (worker, dp); 0 and *slot or KVR_ENOENT.  Context: any thread. */
int kvr_router_find_rank(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot);

static inline bool kvr_router_stopping(const struct kvr_router *r)
{
	return __atomic_load_n(&r->shutting_down, __ATOMIC_ACQUIRE) != 0;
}

#endif
