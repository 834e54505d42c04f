/*
 * core/events.c - KV events from the engines (events mode).
 *
 * The caller's thread validates the event and computes local block hashes from token ids when
 * the event carries tokens (so the shard does no hashing); the rank's shard then checks the
 * event id cursor and applies the event to the index (shards/owner_events.c).  Validation is
 * complete before anything is applied, so a malformed event changes nothing.
 */
#include <inttypes.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "core/events.h"

#include "core/alloc.h"
#include "core/hash.h"
#include "core/router_internal.h"
#include "sync/nocancel.h"

/* Thread-local scratch of kvr_events_apply and kvr_events_apply_many (shard call arguments,
 * local hashes), grown and kept for the thread's next call, freed when it exits.  One set
 * serves both: each call is done with it when it returns (its shard call is synchronous). */
static _Thread_local struct kvr_event_args *scratch_args;
static _Thread_local size_t scratch_args_cap;
static _Thread_local uint64_t *scratch_local;
static _Thread_local size_t scratch_local_cap;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
	(void)p;
	kvr_free(scratch_args, scratch_args_cap * sizeof(*scratch_args));
	kvr_free(scratch_local, scratch_local_cap * sizeof(uint64_t));
	scratch_args = NULL;
	scratch_local = NULL;
	scratch_args_cap = scratch_local_cap = 0;
}

static void scratch_key_make(void)
{
	pthread_key_create(&scratch_key, scratch_free);
}

/* The capacity a buffer of cap items of item bytes grows to for need (> cap): 64, doubled until
 * it fits; 0 when need items do not fit in a size_t of bytes. */
static size_t grown(size_t cap, size_t need, size_t item)
{
	if (need > SIZE_MAX / item)
		return 0;
	size_t nc = cap ? cap : 64;
	while (nc < need)
		nc = nc > SIZE_MAX / item / 2 ? need : nc * 2;
	return nc;
}

static int scratch_grow(void **p, size_t *cap, size_t need, size_t item)
{
	if (need <= *cap)
		return 0;
	size_t nc = grown(*cap, need, item);
	void *q = nc ? kvr_alloc(nc * item) : NULL;
	if (!q)
		return KVR_ENOMEM;
	kvr_free(*p, *cap * item);
	*p = q;
	*cap = nc;
	pthread_once(&scratch_once, scratch_key_make);
	pthread_setspecific(scratch_key, (void *)1);
	return 0;
}

/* on_event_gap for the gaps the shard found (struct kvr_event_args.gap_to), on the caller's
 * thread after the shard call: a callback is free to call the API (owner_events.c says why not
 * from the shard). */
static void report_gaps(const struct kvr_router *r, struct kvr_rank_id rank,
                        const struct kvr_event_args *a, size_t n)
{
	for (size_t i = 0; i < n && r->cfg.on_event_gap; i++)
		if (a[i].ev && a[i].gap_to) {
			const struct kvr_router *prev = kvr_router_callback_enter(r);
			r->cfg.on_event_gap(r->cfg.callback_ctx, rank.worker_id, rank.dp_rank,
			                    a[i].gap_from, a[i].gap_to);
			kvr_router_callback_leave(prev);
		}
}

/* The one event id refused whatever the event: a lost event is reported as (its id, its id + 1)
 * (on_event_gap), which for UINT64_MAX would be 2^64, so the report at the last id either
 * wrapped to 0 or, as it was, saturated and named the wrong event (events_bound
 * refusal_at_the_last_ids).  Taking it from the id space keeps every report exact. */
#define EVENT_ID_NONE UINT64_MAX

static int validate(const struct kvr_router *r, const struct kvr_event *ev)
{
	if (ev->event_id == EVENT_ID_NONE)
		return KVR_EINVAL;
	switch (ev->type) {
	case KVR_EVENT_STORED:
		if (ev->n_blocks == 0 || !ev->blocks)
			return KVR_EINVAL;
		for (size_t i = 0; i < ev->n_blocks; i++) {
			const struct kvr_event_block *b = &ev->blocks[i];
			if (b->tokens && b->n_tokens != r->cfg.block_size)
				return KVR_EINVAL; /* block size mismatch */
			uint64_t parent = i ? ev->blocks[i - 1].ext_hash : ev->parent_ext_hash;
			if ((i || ev->has_parent) && b->ext_hash == parent)
				return KVR_EINVAL; /* a block cannot be its own parent */
		}
		return 0;
	case KVR_EVENT_REMOVED:
		return ev->n_removed == 0 || !ev->removed ? KVR_EINVAL : 0;
	case KVR_EVENT_CLEARED:
		return 0;
	default:
		return KVR_EINVAL;
	}
}

/* Why validate() refused ev, said again for kvr_events_apply's detail (core/error.h); the
 * feed's batches (prepare_many) count refusals instead. */
static __attribute__((cold, noinline)) int invalid_event(const struct kvr_router *r,
                                                         const struct kvr_event *ev)
{
	static const char fn[] = "kvr_events_apply";
	if (ev->event_id == EVENT_ID_NONE)
		return kvr_fail(KVR_EINVAL, "%s: event_id UINT64_MAX is not an event id", fn);
	switch (ev->type) {
	case KVR_EVENT_STORED:
		if (ev->n_blocks == 0 || !ev->blocks)
			return kvr_fail(KVR_EINVAL, "%s: stored event with %s", fn,
			                ev->n_blocks ? "blocks NULL" : "n_blocks 0");
		for (size_t i = 0; i < ev->n_blocks; i++) {
			const struct kvr_event_block *b = &ev->blocks[i];
			if (b->tokens && b->n_tokens != r->cfg.block_size)
				return kvr_fail(
				    KVR_EINVAL,
				    "%s: stored blocks[%zu].n_tokens %u is not the router's "
				    "block_size %u",
				    fn, i, b->n_tokens, r->cfg.block_size);
			uint64_t parent = i ? ev->blocks[i - 1].ext_hash : ev->parent_ext_hash;
			if ((i || ev->has_parent) && b->ext_hash == parent)
				return kvr_fail(KVR_EINVAL,
				                "%s: stored blocks[%zu].ext_hash %#" PRIx64
				                " is its own parent's",
				                fn, i, b->ext_hash);
		}
		break;
	case KVR_EVENT_REMOVED:
		return kvr_fail(KVR_EINVAL, "%s: removed event with %s", fn,
		                ev->n_removed ? "removed NULL" : "n_removed 0");
	default:
		return kvr_fail(KVR_EINVAL,
		                "%s: event type %d is not KVR_EVENT_STORED, _REMOVED or _CLEARED",
		                fn, ev->type);
	}
	return kvr_fail_code(KVR_EINVAL, fn);
}

/* The detail of a code from the rank's lookup (a NULL) or its shard (a: what the shard said of
 * it; core/error.h). */
static __attribute__((cold, noinline)) int event_fail(const struct kvr_router *r, int rc,
                                                      struct kvr_rank_id rank,
                                                      const struct kvr_event *ev,
                                                      const struct kvr_event_args *a)
{
	static const char fn[] = "kvr_events_apply";
	switch (rc) {
	case KVR_ENOENT:
		if (a && a->rank_gone)
			return kvr_fail(rc,
			                "%s: rank (worker %" PRIu64 ", dp %" PRIu32
			                ") was removed while the event was on its way: nothing "
			                "applied",
			                fn, rank.worker_id, rank.dp_rank);
		if (!a || ev->type != KVR_EVENT_STORED)
			return kvr_fail(rc, "%s: no rank (worker %" PRIu64 ", dp %" PRIu32 ")", fn,
			                rank.worker_id, rank.dp_rank);
		return kvr_fail(rc,
		                "%s: stored event %" PRIu64 ": rank (worker %" PRIu64
		                ", dp %" PRIu32 ") does not hold parent %#" PRIx64,
		                fn, ev->event_id, rank.worker_id, rank.dp_rank,
		                ev->parent_ext_hash);
	case KVR_ESTALE:
		return kvr_fail(rc,
		                "%s: event_id %" PRIu64 " is at or below rank (worker %" PRIu64
		                ", dp %" PRIu32 ")'s last applied one: dropped",
		                fn, ev->event_id, rank.worker_id, rank.dp_rank);
	case KVR_ERANGE:
		if (a && a->index_full)
			return kvr_fail(rc,
			                "%s: stored event %" PRIu64
			                " refused: the index holds the most "
			                "runs it can name (2^25 - 1); nothing applied",
			                fn, ev->event_id);
		return kvr_fail(rc,
		                "%s: stored event %" PRIu64 " would take rank (worker %" PRIu64
		                ", dp %" PRIu32 ") past its stored-block bound: refused",
		                fn, ev->event_id, rank.worker_id, rank.dp_rank);
	case KVR_EINVAL: /* the index's: the event contradicts the blocks the rank holds */
		return kvr_fail(rc,
		                "%s: stored event %" PRIu64 " contradicts rank (worker %" PRIu64
		                ", dp %" PRIu32
		                ")'s blocks: an ext_hash held for another block, or "
		                "a sequence hash collision; the blocks before it stay applied",
		                fn, ev->event_id, rank.worker_id, rank.dp_rank);
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "%s: %s", fn, kvr_router_gone(r));
	case KVR_EBUSY:
		return kvr_fail(rc, "%s: %s", fn, KVR_SHARD_CYCLE_DETAIL);
	default:
		return kvr_fail_code(rc, fn);
	}
}

int kvr_events_apply(struct kvr_router *r, struct kvr_rank_id rank, const struct kvr_event *ev)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!r || !ev)
		return kvr_fail(KVR_EINVAL, "kvr_events_apply: %s is NULL", !r ? "router" : "ev");
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "kvr_events_apply: %s", kvr_router_gone(r));
	if (r->cfg.mode != KVR_MODE_EVENTS)
		return kvr_fail(KVR_EINVAL,
		                "kvr_events_apply: the router's mode is %d, not KVR_MODE_EVENTS",
		                (int)r->cfg.mode);
	int rc = validate(r, ev);
	if (rc)
		return invalid_event(r, ev);
	uint32_t slot;
	uint64_t gen;
	if ((rc = kvr_router_find_rank_gen(r, rank, &slot, &gen)))
		return event_fail(r, rc, rank, ev, NULL);
	if (ev->type == KVR_EVENT_STORED) {
		if (scratch_grow((void **)&scratch_local, &scratch_local_cap, ev->n_blocks,
		                 sizeof(uint64_t)))
			return kvr_fail(KVR_ENOMEM,
			                "kvr_events_apply: out of memory hashing %zu stored blocks",
			                ev->n_blocks);
		uint64_t seed = kvr_hash_lora_seed(ev->lora_name);
		for (size_t i = 0; i < ev->n_blocks; i++) {
			const struct kvr_event_block *b = &ev->blocks[i];
			if (b->tokens)
				kvr_hash_chain_tokens(NULL, b->tokens, 1, r->cfg.block_size, seed,
				                      &scratch_local[i], NULL);
			else
				scratch_local[i] = b->local_hash;
		}
	}
	struct kvr_event_args a = {.slot = slot, .gen = gen, .ev = ev, .local = scratch_local};
	rc = kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING, kvr_owner_event, &a);
	report_gaps(r, rank, &a, 1);
	return rc ? event_fail(r, rc, rank, ev, &a) : 0;
}

struct many {
	struct kvr_event_args *args;
	size_t n;
	int *rcs;
};

/* On the rank's shard: each event through the same owner function kvr_events_apply uses. */
static int apply_many(struct kvr_shard *sh, void *arg)
{
	struct many *m = arg;
	for (size_t i = 0; i < m->n; i++)
		if (m->args[i].ev) {
			int rc = kvr_owner_event(sh, &m->args[i]);
			if (m->rcs)
				m->rcs[i] = rc;
		}
	return 0;
}

/* Validates evs and computes their local hashes into args / local (grown with grow); the
 * rank's shard in *sh.  Returns 0 or what kvr_events_apply_many returns for the whole call. */
static int prepare_many(struct kvr_router *r, struct kvr_rank_id rank, const struct kvr_event *evs,
                        size_t n, int *rcs, struct kvr_event_args **args, size_t *cap_args,
                        uint64_t **local, size_t *cap_local,
                        int (*grow)(void **, size_t *, size_t, size_t), struct kvr_shard **sh)
{
	if (!r || (!evs && n))
		return KVR_EINVAL;
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	if (r->cfg.mode != KVR_MODE_EVENTS)
		return KVR_EINVAL;
	*sh = NULL;
	if (n == 0)
		return 0;
	uint32_t slot;
	uint64_t gen;
	int rc = kvr_router_find_rank_gen(r, rank, &slot, &gen);
	if (rc)
		return rc;
	/* The hashes' room from the valid events only: a malformed one's n_blocks (blocks NULL)
	 * may be anything. */
	size_t nblk = 0;
	for (size_t i = 0; i < n; i++) {
		const int v = validate(r, &evs[i]);
		if (rcs)
			rcs[i] = v;
		if (!v && evs[i].type == KVR_EVENT_STORED) {
			if (evs[i].n_blocks > SIZE_MAX - nblk)
				return KVR_ENOMEM;
			nblk += evs[i].n_blocks;
		}
	}
	if (grow((void **)args, cap_args, n ? n : 1, sizeof(**args)) ||
	    grow((void **)local, cap_local, nblk ? nblk : 1, sizeof(uint64_t)))
		return KVR_ENOMEM;
	size_t off = 0;
	for (size_t i = 0; i < n; i++) {
		const struct kvr_event *ev = &evs[i];
		const int v = rcs ? rcs[i] : validate(r, ev);
		(*args)[i] = (struct kvr_event_args){.slot = slot,
		                                     .gen = gen,
		                                     .ev = v ? NULL : ev,
		                                     .local = *local + off,
		                                     .rank_only = true};
		if (v || ev->type != KVR_EVENT_STORED)
			continue;
		uint64_t seed = kvr_hash_lora_seed(ev->lora_name);
		for (size_t k = 0; k < ev->n_blocks; k++) {
			const struct kvr_event_block *b = &ev->blocks[k];
			if (b->tokens)
				kvr_hash_chain_tokens(NULL, b->tokens, 1, r->cfg.block_size, seed,
				                      &(*local)[off + k], NULL);
			else
				(*local)[off + k] = b->local_hash;
		}
		off += ev->n_blocks;
	}
	*sh = kvr_router_shard_of(r, slot);
	return 0;
}

int kvr_events_apply_many(struct kvr_router *r, struct kvr_rank_id rank,
                          const struct kvr_event *evs, size_t n, int *rcs)
{
	struct kvr_shard *sh;
	int rc = prepare_many(r, rank, evs, n, rcs, &scratch_args, &scratch_args_cap,
	                      &scratch_local, &scratch_local_cap, scratch_grow, &sh);
	if (rc || !sh)
		return rc;
	struct many m = {.args = scratch_args, .n = n, .rcs = rcs};
	rc = kvr_shard_call(sh, KVR_LANE_ROUTING, apply_many, &m);
	/* The thread's scratch: a callback may call the public API (kvr_events_apply grows only
	 * scratch_local), not this internal function. */
	report_gaps(r, rank, scratch_args, n);
	return rc;
}

/* Grows a kvr_events_post buffer (owned by the struct, not the thread). */
static int post_grow(void **p, size_t *cap, size_t need, size_t item)
{
	if (need <= *cap)
		return 0;
	size_t nc = grown(*cap, need, item);
	void *q = nc ? kvr_realloc(*p, *cap * item, nc * item) : NULL;
	if (!q)
		return KVR_ENOMEM;
	*p = q;
	*cap = nc;
	return 0;
}

/* On the rank's shard: the events, then the reply the poster waits on. */
static void post_task(struct kvr_shard *sh, void *payload)
{
	struct kvr_events_post *a;
	memcpy(&a, payload, sizeof(a));
	struct many m = {.args = a->args, .n = a->n, .rcs = a->rcs};
	apply_many(sh, &m);
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	a->done_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
	kvr_reply_post(&a->reply, 0); /* release: done_ns and rcs before it */
}

int kvr_events_post_many(struct kvr_router *r, struct kvr_rank_id rank, const struct kvr_event *evs,
                         size_t n, int *rcs, struct kvr_events_post *a)
{
	if (!a || a->in_flight)
		return KVR_EINVAL;
	struct kvr_shard *sh;
	int rc = prepare_many(r, rank, evs, n, rcs, &a->args, &a->cap_args, &a->local,
	                      &a->cap_local, post_grow, &sh);
	if (rc || !sh)
		return rc;
	a->rcs = rcs;
	a->n = n;
	a->r = r;
	a->rank = rank;
	kvr_reply_init(&a->reply);
	struct kvr_events_post *pa = a;
	rc = kvr_shard_post_wait(sh, KVR_LANE_ROUTING, post_task, &pa, sizeof(pa), UINT64_MAX);
	if (rc)
		return rc;
	a->in_flight = true;
	return 0;
}

int kvr_events_post_wait(struct kvr_events_post *a)
{
	if (!a->in_flight)
		return 0;
	kvr_reply_wait(&a->reply, 0, NULL);
	a->in_flight = false;
	report_gaps(a->r, a->rank, a->args, a->n);
	return 0;
}

void kvr_events_post_fini(struct kvr_events_post *a)
{
	kvr_free(a->args, a->cap_args * sizeof(*a->args));
	kvr_free(a->local, a->cap_local * sizeof(uint64_t));
	a->args = NULL;
	a->local = NULL;
	a->cap_args = a->cap_local = 0;
}

int kvr_events_clear_rank(struct kvr_router *r, struct kvr_rank_id rank)
{
	if (!r)
		return KVR_EINVAL;
	if (kvr_router_stopping(r))
		return KVR_ESHUTDOWN;
	if (r->cfg.mode != KVR_MODE_EVENTS)
		return KVR_EINVAL;
	uint32_t slot;
	uint64_t gen;
	int rc = kvr_router_find_rank_gen(r, rank, &slot, &gen);
	if (rc)
		return rc;
	struct kvr_event ev = {.type = KVR_EVENT_CLEARED};
	struct kvr_event_args a = {.slot = slot, .gen = gen, .ev = &ev, .rank_only = true};
	return kvr_shard_call(kvr_router_shard_of(r, slot), KVR_LANE_ROUTING, kvr_owner_event, &a);
}
