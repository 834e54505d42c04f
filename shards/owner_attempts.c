/*
 * shards/owner_attempts.c - request attempts on their rank's shard: the booking of an admission,
 * prefill done, output, finish and abort, and the lease reaper.
 *
 * Nobody waits for this file.  kvr_route mints the attempt's lease on the caller's thread
 * (shards/lease.h), adds the request to the rank's provisional load (struct kvr_rank_prov), builds
 * the record (kvr_owner_attempt_new) and POSTS it to the rank's shard on the routing lane; the
 * lifecycle calls claim or touch the lease on the caller's thread and post the rest.  Here, in
 * lane order, the shard:
 *  - books: record -> the shard's map, the predicted cache acquire (hits, new copies,
 *    evictions) with its index writes, the exact load; then publishes the snapshot and takes the
 *    provisional load back (in that order, so a reader may count the request twice for an
 *    instant, never zero times);
 *  - applies prefill done / output / finish / abort to a booked attempt; a message for an
 *    attempt this shard does not hold (ended, stale, or sent to a slot's new shard) is a no-op;
 *  - ends every attempt of a rank that is reset or removed (claiming each lease if nobody has),
 *  - runs the CLOCK reaper over its booked attempts every lease_scan_interval_ns: TOUCHED ->
 *    QUIET, QUIET -> expired; a lease some caller claimed but whose message never came (a full
 *    lane) is cleaned up by the same pass, so no claim is ever lost.
 * Ordering: a lane is FIFO across producers (sync/ring.h: a post that completed before another
 * began is consumed first), so a finish posted by any thread after kvr_route returned is applied
 * after that attempt's booking.
 * A rank removed between the decision and the booking makes the booking stale (generation
 * check): the lease is claimed (if nobody has) and released, nothing is booked, and the
 * attempt's later calls return KVR_ESTALE.
 */
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/probes.h"
#include "shards/load.h"
#include "shards/owner_internal.h"
#include "shards/rank_state.h"

/* ---------------------------------------------------------------- records */

/* The pool keeps records of 2^k blocks (k in [POOL_MIN_CLASS, POOL_MAX_CLASS]) per class: at
 * most POOL_DEPTH of them and at most POOL_CLASS_BYTES of hashes (16 B a block), but always
 * POOL_MIN_DEPTH: classes of up to 128 blocks (2k-token prompts at 16 tokens a block) keep 256,
 * 256 blocks 128, 512 blocks 64, ..., 2048 blocks (32k tokens) 16, 8192 blocks 4, 16384 blocks
 * 2.  So the pool holds at most 4.25 MB of hashes whatever the prompts (and 766 records'
 * headers and tails: ~0.2 MB at 16 tokens a block), only under load: an idle shard empties it
 * (kvr_owner_shard_idle).  Its bytes (at their allocator sizes) are counted for
 * kvr_router_get_memory.
 *
 * Why this deep.  A record comes back when its shard has run the attempt's finish, so the
 * records out of the pool are the attempts booked or queued and not yet ended: under an unpaced
 * frontend that finishes each request at once (bench_route) that is about half the routing
 * lanes' depth, 20-350 at 2k tokens with 2 shards (lane depth mean 45, max 380-700), and it
 * swings by hundreds as the shards drain their lanes in batches.  A class 16 deep ran dry on
 * every swing: 40-73 % of the routes allocated their record (bench_route --ms 800 --lengths
 * 2048 and callgrind's run; jemalloc's arena path without a thread cache, ~500 instructions),
 * 64 deep 7-10 %, 256 deep 1-1.5 %.  The byte budget keeps long prompts' classes at the depth
 * they had (32k tokens: 16), which kept the routing cost at 32k: bench_route --lengths 32768 (1
 * / 2 threads) hits the pool 99 / 83% with 16 of each, 95 / 71% with 256 KB a class (route
 * cost unchanged), 86 / 64% with 128 KB (own_ratio +2-3%). */
#define POOL_MIN_CLASS   6  /* 64 blocks */
#define POOL_MAX_CLASS   14 /* 16384 blocks */
#define POOL_CLASSES     (POOL_MAX_CLASS - POOL_MIN_CLASS + 1)
#define POOL_DEPTH       256
#define POOL_MIN_DEPTH   2
#define POOL_CLASS_BYTES (512u * 1024u)

/*
 * Each class is a stack behind a try-lock of its own, on cache lines of its own: the lock word,
 * the count and the first records share one line, so a take (a routing thread) or a give (the
 * shard that booked the record, on another core) moves that one line, which a router asks for
 * early (kvr_owner_attempt_prefetch) and finds when it takes the record.  It was a pthread mutex
 * beside the count, classes sharing lines, and a pool-wide byte counter updated with an atomic
 * add at every take and give: three locked instructions on up to three lines another core had
 * just written (bench_route at 2k and 8k tokens, the take timed with rdtsc: ~300 cycles a route,
 * about what the line alone costs when nobody asked for it first).  The lock is taken with one
 * exchange and released with a release store (x86: no locked instruction), and the bytes are
 * counted from the classes' counts (a class's records all have one size).
 */
struct pool_class {
	uint32_t lock; /* 0 free, 1 held: try_lock / unlock */
	uint32_t n;    /* records kept (written under the lock; read relaxed by pool_bytes) */
	uint32_t cap;  /* how many it keeps at most (pool_depth) */
	uint64_t real; /* allocator size of this class's records (0: none kept yet) */
	struct kvr_attempt **rec; /* cap slots in the pool's recs[]: a stack, the top at n - 1 */
} __attribute__((aligned(64)));

/* One allocation: the classes' lines, a line written only by create, then their stacks (766
 * slots, 6 KB; the pages of a stack are touched only as deep as it has been). */
struct kvr_attempt_pool {
	struct pool_class cls[POOL_CLASSES]; /* class k at [k - POOL_MIN_CLASS] */
	/* cls[i].rec again, where kvr_owner_attempt_prefetch reads it: read from the class's
	 * line, which the shards write at every give, it stalled the routing thread's hashing
	 * until that line came in (the prefetch's address depended on the load; bench_hashstage
	 * route_line; in kvr_route the 10-20 % of routes that found the line freshly written,
	 * 2k-token head stage p90 357-609 -> 336-357 TSC ticks: docs/measurements.md). */
	struct kvr_attempt **stack[POOL_CLASSES] __attribute__((aligned(64)));
	size_t bytes; /* of this allocation */
	struct kvr_attempt *recs[] __attribute__((aligned(64)));
};

/* Ordering: acquire, pairing with unlock's release: the stack as the last holder left it. */
static inline bool try_lock(struct pool_class *pc)
{
	return __atomic_exchange_n(&pc->lock, 1, __ATOMIC_ACQUIRE) == 0;
}

static inline void unlock(struct pool_class *pc)
{
	__atomic_store_n(&pc->lock, 0, __ATOMIC_RELEASE);
}

/* How many records class k keeps. */
static uint32_t pool_depth(int k)
{
	size_t d = POOL_CLASS_BYTES / (((size_t)1 << k) * 2 * sizeof(uint64_t));
	return d < POOL_MIN_DEPTH ? POOL_MIN_DEPTH : d > POOL_DEPTH ? POOL_DEPTH : (uint32_t)d;
}

int kvr_attempt_pool_create(struct kvr_attempt_pool **out)
{
	size_t slots = 0;
	for (int k = POOL_MIN_CLASS; k <= POOL_MAX_CLASS; k++)
		slots += pool_depth(k);
	size_t bytes = sizeof(struct kvr_attempt_pool) + slots * sizeof(struct kvr_attempt *);
	struct kvr_attempt_pool *p = kvr_calloc(1, bytes);
	if (!p)
		return KVR_ENOMEM;
	p->bytes = bytes;
	slots = 0;
	for (int k = POOL_MIN_CLASS; k <= POOL_MAX_CLASS; k++) {
		struct pool_class *pc = &p->cls[k - POOL_MIN_CLASS];
		pc->cap = pool_depth(k);
		pc->rec = &p->recs[slots];
		p->stack[k - POOL_MIN_CLASS] = pc->rec;
		slots += pc->cap;
	}
	*out = p;
	return 0;
}

void kvr_attempt_pool_destroy(struct kvr_attempt_pool *p)
{
	if (!p)
		return;
	for (int i = 0; i < POOL_CLASSES; i++)
		for (uint32_t j = 0; j < p->cls[i].n; j++)
			kvr_free_transient(p->cls[i].rec[j], p->cls[i].rec[j]->size);
	kvr_free(p, p->bytes);
}

uint64_t kvr_attempt_pool_bytes(const struct kvr_attempt_pool *p)
{
	if (!p)
		return 0;
	uint64_t b = kvr_alloc_real_size(p->bytes);
	for (int i = 0; i < POOL_CLASSES; i++)
		b += (uint64_t)__atomic_load_n(&p->cls[i].n, __ATOMIC_RELAXED) *
		     __atomic_load_n(&p->cls[i].real, __ATOMIC_RELAXED);
	return b;
}

void kvr_attempt_pool_trim(struct kvr_attempt_pool *p)
{
	if (!p)
		return;
	for (int i = 0; i < POOL_CLASSES; i++) {
		struct pool_class *pc = &p->cls[i];
		struct kvr_attempt *rec[POOL_DEPTH];
		if (!__atomic_load_n(&pc->n, __ATOMIC_RELAXED))
			continue;
		while (!try_lock(pc)) /* held for a few instructions by a take or a give */
			sched_yield();
		uint32_t n = pc->n;
		memcpy(rec, pc->rec, n * sizeof(rec[0]));
		__atomic_store_n(&pc->n, 0, __ATOMIC_RELAXED);
		unlock(pc);
		for (uint32_t j = 0; j < n; j++) /* outside the lock: frees can take the arena's */
			kvr_free_transient(rec[j], rec[j]->size);
	}
}

/* The pool class of n blocks (capacity 2^class >= n), or -1 when not pooled.  A bit scan, not a
 * loop over the classes (~20 instructions at 2k tokens, twice a route). */
static inline int pool_class(size_t n)
{
	if (n < ((size_t)1 << POOL_MIN_CLASS) || n > ((size_t)1 << POOL_MAX_CLASS))
		return -1;
	return n == ((size_t)1 << POOL_MIN_CLASS) ? POOL_MIN_CLASS
	                                          : 64 - __builtin_clzll((unsigned long long)n - 1);
}

/* Records this thread allocated because the pool had none (kvr_owner_thread_record_allocs). */
static _Thread_local uint64_t tls_record_allocs;
/* Where the top of the stack was after this thread's last take (kvr_owner_attempt_prefetch). */
static _Thread_local uint32_t tls_top_hint;

uint64_t kvr_owner_thread_record_allocs(void)
{
	return tls_record_allocs;
}

/* The slow path of a reserve: the pool's class is empty or busy, or n is not pooled (jemalloc's
 * arena path without a thread cache, ~500 instructions).  Out of line, so the take from the pool
 * saves no registers for it. */
static __attribute__((noinline, cold)) struct kvr_attempt *reserve_alloc(size_t size, int k)
{
	tls_record_allocs++;
	struct kvr_attempt *rec = kvr_alloc_transient(size);
	if (rec) {
		rec->size = size;
		rec->pool_class = (int8_t)k;
	}
	return rec;
}

struct kvr_attempt *kvr_owner_attempt_reserve(const struct kvr_owner_ctx *c, size_t n,
                                              uint64_t **hashes)
{
	uint32_t bs = c->block_size;
	int k = c->pool ? pool_class(n) : -1;
	struct kvr_attempt *rec = NULL;
	*hashes = NULL;
	if (k >= 0) {
		struct pool_class *pc = &c->pool->cls[k - POOL_MIN_CLASS];
		if (try_lock(pc)) {
			uint32_t top = pc->n;
			if (top) {
				rec = pc->rec[--top];
				__atomic_store_n(&pc->n, top, __ATOMIC_RELAXED);
			}
			unlock(pc);
			tls_top_hint = top ? top - 1 : 0;
		}
	}
	/* A pooled record keeps its size and class (kvr_owner_attempt_fill keeps them too). */
	if (!rec && !(rec = reserve_alloc(kvr_attempt_blocks_off(bs) +
	                                      (k < 0 ? n : (size_t)1 << k) * 2 * sizeof(uint64_t),
	                                  k)))
		return NULL;
	*hashes = (uint64_t *)(void *)kvr_attempt_blocks(rec, bs);
	return rec;
}

void kvr_owner_attempt_prefetch(const struct kvr_owner_ctx *c, size_t n)
{
	int k = c->pool ? pool_class(n) : -1;
	if (k >= 0) {
		struct pool_class *pc = &c->pool->cls[k - POOL_MIN_CLASS];
		__builtin_prefetch(pc, 1, 3); /* for writing: the lock is exchanged */
		/* The top's line, where this thread's last take left it (a guess: reading the
		 * count, or anything else on the class's line, here would wait for the line the
		 * first hint asks for; the stack's address comes from a line nobody writes). */
		__builtin_prefetch(&c->pool->stack[k - POOL_MIN_CLASS][tls_top_hint], 0, 3);
	}
}

void kvr_owner_attempt_fill(const struct kvr_owner_ctx *c, struct kvr_attempt *rec,
                            const struct kvr_admit_args *a)
{
	const size_t size = rec->size;
	const int8_t k = rec->pool_class;
	memset(rec, 0, sizeof(*rec));
	rec->size = size;
	rec->pool_class = k;
	rec->attempt = a->attempt;
	rec->gen = a->gen;
	rec->slot = a->slot;
	rec->n_blocks = (uint32_t)a->n;
	rec->n_prompt = (uint32_t)a->n;
	rec->prompt_tokens = a->prompt_tokens;
	rec->overlap = a->overlap;
	rec->has_last = a->n > 0;
	rec->last_seq = a->n > 0 ? a->seq[a->n - 1] : 0;
	rec->lora_seed = a->lora_seed;
	rec->chain_known = a->chain_known;
	rec->noted = a->noted;
	rec->in_prefill = true;
	rec->pend_prefill_tokens = a->pend_prefill_tokens;
	rec->pend_blocks = a->pend_blocks;
	rec->tail_n = a->chain_known ? a->tail_n : 0;
	if (rec->tail_n)
		memcpy(rec->tail, a->tail, rec->tail_n * sizeof(uint32_t));
	if (a->in_record)
		return; /* hashed in place (kvr_owner_attempt_reserve) */
	/* The frontend's chain (kvr_request.seq_hashes) or a retry's scratch: streamed, as the
	 * routing thread's own hashing is (core/hash.h says why). */
	_Static_assert(sizeof(struct kvr_lru_block) == 2 * sizeof(uint64_t) &&
	                   offsetof(struct kvr_lru_block, seq) == sizeof(uint64_t),
	               "a block is a (local, seq) pair");
	kvr_hash_pairs_stream(a->local, a->seq, a->n,
	                      (uint64_t *)(void *)kvr_attempt_blocks(rec, c->block_size));
}

struct kvr_attempt *kvr_owner_attempt_new(const struct kvr_owner_ctx *c,
                                          const struct kvr_admit_args *a)
{
	uint64_t *h;
	struct kvr_attempt *rec = kvr_owner_attempt_reserve(c, a->n, &h);
	if (rec)
		kvr_owner_attempt_fill(c, rec, a);
	return rec;
}

void kvr_owner_attempt_free(const struct kvr_owner_ctx *c, struct kvr_attempt *rec)
{
	if (!rec)
		return;
	int k = rec->pool_class;
	if (k >= 0 && c->pool && try_lock(&c->pool->cls[k - POOL_MIN_CLASS])) {
		struct pool_class *pc = &c->pool->cls[k - POOL_MIN_CLASS];
		bool kept = pc->n < pc->cap;
		if (kept) {
			pc->rec[pc->n] = rec;
			if (!pc->real) /* every record of the class has this size */
				__atomic_store_n(&pc->real, kvr_alloc_real_size(rec->size),
				                 __ATOMIC_RELAXED);
			__atomic_store_n(&pc->n, pc->n + 1, __ATOMIC_RELAXED);
		}
		unlock(pc);
		if (kept)
			return;
	}
	kvr_free_transient(rec, rec->size);
}

/* Takes the attempt's provisional load back from its rank, after the booked snapshot is out:
 * subtracted from the rank's booked load word, of which this shard is the single writer
 * (booked: the rank is live here with the decision's generation), or from the routers' prov
 * word with an atomic subtract (stale: the slot may be another shard's by now). */
static void unprovision(const struct kvr_owner_ctx *c, struct kvr_attempt *rec, bool booked)
{
	if (booked) {
		kvr_owner_take_back(c, rec->slot, rec->pend_prefill_tokens, rec->pend_blocks);
	} else {
		struct kvr_rank_prov *p = &c->prov[rec->slot];
		if (rec->pend_prefill_tokens)
			__atomic_fetch_sub(&p->prefill_tokens, rec->pend_prefill_tokens,
			                   __ATOMIC_RELAXED);
		if (rec->pend_blocks)
			__atomic_fetch_sub(&p->blocks, rec->pend_blocks, __ATOMIC_RELAXED);
	}
	rec->pend_prefill_tokens = rec->pend_blocks = 0;
}

/* ---------------------------------------------------------------- tracking, and its room */

/* Attempts the map and the array can still take without allocating. */
static size_t track_free(const struct kvr_shard_state *ss)
{
	size_t map = ss->by_id.cap * 7 / 10; /* kvr_u64map_reserve's load bound */
	map = map > ss->by_id.count ? map - ss->by_id.count : 0;
	size_t arr = ss->recs_cap - ss->n_recs;
	return map < arr ? map : arr;
}

/* Brings book_room up to date: what was freed or grown since the last update, less what was
 * tracked without a poster's taking (synchronous bookings).  Ordering: relaxed; a poster that
 * must see this update settles first (sync_booking), which orders it. */
static void room_sync(struct kvr_shard_state *ss)
{
	size_t f = track_free(ss);
	int64_t d = (int64_t)f - (int64_t)ss->room_free + (int64_t)ss->room_taken;
	ss->room_free = f;
	ss->room_taken = 0;
	if (d)
		__atomic_add_fetch(&ss->book_room, d, __ATOMIC_RELAXED);
}

/* Room for ROOM_AHEAD more attempts (or half the live ones, if more) is made whenever fewer
 * than ROOM_LOW are left, and when the shard starts and a rank is created on it
 * (kvr_owner_room_prepare): deferred bookings find it made, the first ones included (the room
 * started at zero, so each shard's first sync_booking booking waited for its answer:
 * kvr_booking_waits_total), and an allocation failure here costs nothing but room (the next
 * bookings wait for their answer and get the failure then). */
#define ROOM_LOW   4
#define ROOM_AHEAD 64

static void room_grow(struct kvr_shard_state *ss)
{
	if (track_free(ss) >= ROOM_LOW)
		return;
	size_t extra = ss->n_recs / 2 > ROOM_AHEAD ? ss->n_recs / 2 : ROOM_AHEAD;
	if (kvr_u64map_reserve(&ss->by_id, extra) == 0)
		(void)kvr_grow((void **)&ss->recs, &ss->recs_cap, ss->n_recs + extra,
		               sizeof(*ss->recs));
}

void kvr_owner_room_prepare(struct kvr_shard_state *ss)
{
	room_grow(ss);
	room_sync(ss);
}

static int track(struct kvr_shard_state *ss, struct kvr_attempt *rec)
{
	if (kvr_u64map_reserve(&ss->by_id, 1) ||
	    kvr_grow((void **)&ss->recs, &ss->recs_cap, ss->n_recs + 1, sizeof(*ss->recs)))
		return KVR_ENOMEM;
	rec->idx = (uint32_t)ss->n_recs;
	ss->recs[ss->n_recs++] = rec;
	kvr_u64map_insert(&ss->by_id, rec->attempt, rec->idx);
	room_grow(ss);
	room_sync(ss);
	return 0;
}

static void untrack(struct kvr_shard_state *ss, struct kvr_attempt *rec)
{
	kvr_u64map_remove(&ss->by_id, rec->attempt);
	struct kvr_attempt *last = ss->recs[--ss->n_recs];
	if (last != rec) {
		last->idx = rec->idx;
		ss->recs[rec->idx] = last;
		*kvr_u64map_find(&ss->by_id, last->attempt) = last->idx;
	}
	room_sync(ss);
}

bool kvr_owner_book_room_take(struct kvr_shard *sh)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (__atomic_sub_fetch(&ss->book_room, 1, __ATOMIC_RELAXED) >= 0)
		return true;
	__atomic_add_fetch(&ss->book_room, 1, __ATOMIC_RELAXED);
	return false;
}

void kvr_owner_book_room_give(struct kvr_shard *sh)
{
	__atomic_add_fetch(&kvr_owner_state(sh)->book_room, 1, __ATOMIC_RELAXED);
}

static struct kvr_attempt *find(struct kvr_shard_state *ss, uint64_t attempt)
{
	uint32_t *i = kvr_u64map_find(&ss->by_id, attempt);
	return i ? ss->recs[*i] : NULL;
}

void kvr_owner_attempts_fini(struct kvr_shard_state *ss)
{
	kvr_u64map_fini(&ss->by_id);
	kvr_free(ss->recs, ss->recs_cap * sizeof(*ss->recs));
	ss->recs = NULL;
	ss->n_recs = ss->recs_cap = 0;
}

static void unlink_rec(struct kvr_rank_owned *own, struct kvr_attempt *rec)
{
	if (rec->prev)
		rec->prev->next = rec->next;
	else
		own->attempts = rec->next;
	if (rec->next)
		rec->next->prev = rec->prev;
}

/* Releases the attempt's lease in the predicted cache.  Returns false when that ran out of
 * memory (the lease still pins its blocks). */
static bool release(struct kvr_shard_state *ss, struct kvr_rank_owned *own, struct kvr_attempt *rec)
{
	if (!own->rs || !rec->booked || rec->incarnation != own->incarnation)
		return true; /* nothing held, or held by a store that went */
	int rc = kvr_rank_state_release(own->rs, own->incarnation, rec->attempt, &ss->out);
	if (rc == KVR_ENOMEM) {
		kvr_metrics_add(kvr_owner_mb(ss->c), KVR_C_SHARD_RELEASE_ERRORS, 1);
		return false;
	}
	if (rc == 0)
		kvr_owner_apply_removals(ss, own, &ss->out);
	return true;
}

static void owe(struct kvr_shard_state *ss, struct kvr_rank_owned *own, struct kvr_attempt *rec)
{
	rec->prev = NULL;
	rec->next = own->owed;
	if (own->owed)
		own->owed->prev = rec;
	own->owed = rec;
	ss->releases_owed = true;
}

/* Ends a claimed attempt: releases its blocks (unless the rank's state is being dropped), its
 * load, its record and, last, its lease word (so the id is stale from then on).  A release out
 * of memory used to be ignored: the lease pinned its blocks in the LRU for the rank's life, so
 * they were never evicted and the rank's prediction held more than its capacity once idle
 * (tests/fuzz/oom_api.c); the record now waits on the rank's owed list for a retry. */
static void end_attempt(struct kvr_shard *sh, struct kvr_attempt *rec, bool release_blocks)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_rank_owned *own = c->ranks[rec->slot].own;
	bool released = !release_blocks || release(ss, own, rec);
	kvr_load_finish(own->load, rec->attempt);
	if (rec->load_missing)
		unprovision(c, rec, false);
	unlink_rec(own, rec);
	kvr_owner_publish(ss, own);
	untrack(ss, rec);
	kvr_lease_release(c->leases, rec->attempt);
	if (released)
		kvr_owner_attempt_free(c, rec);
	else
		owe(ss, own, rec);
}

void kvr_owner_retry_releases(struct kvr_shard *sh)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	if (!ss || !ss->releases_owed)
		return;
	ss->releases_owed = false;
	for (struct kvr_rank_owned *own = ss->ranks; own; own = own->next) {
		struct kvr_attempt *rec = own->owed, *keep = NULL;
		own->owed = NULL;
		bool changed = false;
		while (rec) {
			struct kvr_attempt *next = rec->next;
			if (release(ss, own, rec)) {
				kvr_owner_attempt_free(ss->c, rec);
				changed = true;
			} else {
				rec->next = keep;
				keep = rec;
			}
			rec = next;
		}
		for (rec = keep; rec;) { /* back on the list (prev links rebuilt) */
			struct kvr_attempt *next = rec->next;
			owe(ss, own, rec);
			rec = next;
		}
		if (changed)
			kvr_owner_publish(ss, own);
	}
}

void kvr_owner_drop_owed(struct kvr_shard *sh, struct kvr_rank_owned *own)
{
	const struct kvr_owner_ctx *c = kvr_owner_state(sh)->c;
	while (own->owed) {
		struct kvr_attempt *rec = own->owed;
		own->owed = rec->next;
		kvr_owner_attempt_free(c, rec);
	}
}

/* An own attempt whose end this shard claimed when its rank's life ended: replica sync tells
 * it (an abort), or no one would: the frontend's finish then returns KVR_ESTALE and no lease
 * expiry comes, so its record stayed on this replica and its mirror (with its load) on every
 * peer until the replica went (test_replica_ranks
 * attempts_ended_by_a_rank_removal_or_reset_leave_no_record).  A claim a caller won is told by
 * that caller's note; a peer's attempt by its origin; an attempt whose admission was never
 * noted (routed while no replica was attached: kvr_admit_args.noted) by nobody, since no peer
 * ever saw it (told, it waited in the sender's early set for its 60 s prune: test_replica_early
 * rank_ends_of_attempts_routed_before_attach_are_not_kept). */
static void tell_rank_end(const struct kvr_owner_ctx *c, uint64_t attempt, bool won, bool noted)
{
	if (won && noted && c->on_rank_end)
		c->on_rank_end(c->expire_ctx, attempt);
}

/* A posted booking dropped for memory: kvr_route returned the attempt and noted it to replica
 * sync, and it is stale here (its finish returns KVR_ESTALE and notes nothing), so it is told as
 * an expiry (an abort), or every peer kept its mirror live for good (test_sync_nats test_oom).
 * Only when this drop won the claim: a caller's finish or abort that won it was noted by that
 * caller, and a second end note reached the sender with no record left, to sit in its early set
 * (sync/replica_early.c) for 60 s; and not for a peer's attempt, whose end its origin tells
 * (test_owner_attempts a_booking_dropped_for_memory_tells_one_end_and_none_for_a_mirror); nor
 * for one whose admission was never noted (kvr_admit_args.noted). */
static void tell_dropped(const struct kvr_owner_ctx *c, uint64_t attempt, bool won, bool noted)
{
	if (won && noted && c->on_expire)
		c->on_expire(c->expire_ctx, attempt);
}

void kvr_owner_end_all_attempts(struct kvr_shard *sh, struct kvr_rank_owned *own)
{
	const struct kvr_owner_ctx *c = kvr_owner_state(sh)->c;
	while (own->attempts) {
		struct kvr_attempt *rec = own->attempts;
		uint64_t attempt = rec->attempt; /* rec is recycled by end_attempt */
		bool noted = rec->noted;
		/* lost if a caller claimed first: fine, its call ends the attempt */
		bool won = kvr_lease_claim(c->leases, attempt) == 0;
		end_attempt(sh, rec, false);
		tell_rank_end(c, attempt, won, noted);
	}
}

/* ---------------------------------------------------------------- booking */

/* A booking that cannot be made: the attempt is stale (its lease claimed if nobody has, then
 * released) and its provisional load goes back.  Returns whether this claimed it. */
static bool drop_booking(struct kvr_shard_state *ss, struct kvr_attempt *rec)
{
	const struct kvr_owner_ctx *c = ss->c;
	bool won = kvr_lease_claim(c->leases, rec->attempt) == 0;
	kvr_lease_release(c->leases, rec->attempt);
	unprovision(c, rec, false);
	kvr_owner_attempt_free(c, rec);
	return won;
}

/* The routing thread wrote the record's blocks with streaming stores (core/hash.h): they are in
 * memory, in no core's cache, and the booking reads them one dependent step after another (the
 * LRU's walk compares at run boundaries and follows duplicate copies block by block, the load's
 * walk, then the copies of the new blocks).  Asking for the first PREFETCH_BLOCKS of them at
 * once lets the misses overlap; the hardware prefetcher follows the sequential copies beyond.
 * A booking's p50 timed on the shard (temporary), bench_route --shards 1 --threads-max 1 --cpus 1
 * paced (--rate 8000 --spin-us 100000), four pairs alternated: 8k tokens 7.5 / 7.9 / 8.4 / 7.8
 * us without, 4.9 / 2.3 / 3.2 / 7.6 with; 32k 4.8 / 6.1 / 16.1 / 19.6 without, 13.6 / 4.3 /
 * - / 15.1 with (the shard's timings are bimodal from run to run on this VM). */
#define PREFETCH_BLOCKS 1024 /* 16 KiB */
static void prefetch_blocks(const struct kvr_lru_block *b, size_t n)
{
	const char *p = (const char *)b;
	const char *end = (const char *)(b + (n < PREFETCH_BLOCKS ? n : PREFETCH_BLOCKS));
	for (; p < end; p += 64)
		__builtin_prefetch(p, 0, 3);
}

/* deferred: sync_booking's posted booking (kvr_owner_book_deferred_task), whose kvr_route has
 * returned 0 already: it cannot fail for the record's tracking (its poster took room), and if
 * the load cannot be recorded for memory it is booked without it, its load left provisional
 * (load_missing), rather than dropped as the posted booking is: the waited-for booking would
 * have failed kvr_route instead, and an attempt kvr_route returned must live until its end.
 * posted: a posted booking (deferred or not), whose attempt its router returned and noted: a
 * drop tells its end (tell_rank_end, tell_dropped); a waited one (kvr_owner_book_call) fails
 * its admission instead. */
static int book(struct kvr_shard *sh, struct kvr_attempt *rec, bool deferred, bool posted)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	prefetch_blocks(kvr_attempt_blocks(rec, c->block_size), rec->n_prompt);
	kvr_owner_retry_timers(sh);
	struct kvr_rank_owned *own = kvr_owner_rank(c, rec->slot, rec->gen);
	if (!own) {
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_STALE_BOOKINGS, 1);
		uint64_t attempt = rec->attempt;
		bool noted = rec->noted;
		bool won = drop_booking(ss, rec);
		/* A posted booking: kvr_route returned the attempt and noted it, or (sync_booking,
		 * the rank's generation moved after the post) noted it withdrawn, which pairs with
		 * this end (core/route.c, kvr_admit); a waited one (kvr_owner_book_call) fails its
		 * kvr_admit instead, noted nowhere. */
		if (posted)
			tell_rank_end(c, attempt, won, noted);
		return KVR_ENOENT;
	}
	uint32_t bs = c->block_size;
	size_t n = rec->n_prompt;
	/* Read in place: the LRU walks the .seq fields at run boundaries and copies the new
	 * blocks, the load copies the blocks nobody pins yet, the index store the new ones. */
	const struct kvr_lru_block *b = kvr_attempt_blocks(rec, bs);
	if (track(ss, rec)) {
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_SHARD_INDEX_WRITE_ERRORS, 1);
		uint64_t attempt = rec->attempt;
		bool noted = rec->noted;
		bool won = drop_booking(ss, rec);
		if (posted)
			tell_dropped(c, attempt, won, noted);
		return KVR_ENOMEM;
	}
	kvr_owner_wake_reaper(sh);
	/* The load before the predicted cache: the one step after track() that can fail and must
	 * not (an attempt without its load was routed as if it were not there, and with
	 * sync_booking kvr_route returned 0 for it), so it fails the booking whole, as track()
	 * does, before anything else has changed. */
	uint64_t now = kvr_owner_now(c);
	uint64_t cached = (uint64_t)rec->overlap * bs;
	if (kvr_load_add(own->load, rec->attempt, n ? &b[0].seq : NULL, KVR_LRU_BLOCK_STRIDE, n,
	                 rec->prompt_tokens > cached ? rec->prompt_tokens - cached : 0, now)) {
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_SHARD_INDEX_WRITE_ERRORS, 1);
		if (!deferred) {
			untrack(ss, rec);
			uint64_t attempt = rec->attempt;
			bool noted = rec->noted;
			bool won = drop_booking(ss, rec);
			if (posted)
				tell_dropped(c, attempt, won, noted);
			return KVR_ENOMEM;
		}
		rec->load_missing = true;
	}
	rec->incarnation = own->incarnation;
	rec->next = own->attempts;
	if (own->attempts)
		own->attempts->prev = rec;
	own->attempts = rec;
	if (own->rs) {
		uint32_t priv = rec->tail_n > 0 || !rec->chain_known ? 1 : 0;
		int rc = kvr_rank_state_acquire(own->rs, own->incarnation, rec->attempt, b, n, priv,
		                                now, &ss->out);
		if (rc == 0) {
			rec->booked = true;
			kvr_owner_apply_removals(ss, own, &ss->out);
			kvr_owner_store_runs(ss, own, NULL, b, &ss->out);
			kvr_owner_arm_ttl(sh, own);
		} else if (rc == KVR_ENOMEM) {
			/* tracked for load only (output() skips it): counted, not silent */
			kvr_metrics_add(kvr_owner_mb(c), KVR_C_SHARD_INDEX_WRITE_ERRORS, 1);
		}
	}
	kvr_owner_publish(ss, own);
	if (!rec->load_missing)
		unprovision(c, rec, true);
	KVR_PROBE4(admit, rec->slot, rec->attempt, n, ss->out.n_evicted);
	return 0;
}

void kvr_owner_book_task(struct kvr_shard *sh, void *payload)
{
	struct kvr_attempt *rec;
	memcpy(&rec, payload, sizeof(rec));
	/* Dropped for memory, it is told as an expiry by book() (tell_dropped). */
	const struct kvr_owner_ctx *c = kvr_owner_state(sh)->c;
	int rc = book(sh, rec, false, true);
	/* Its provisional load is gone.  Also for a rank removed meanwhile (KVR_ENOENT): the
	 * load words are the slot's, and a rank added since in the same slot read this booking's
	 * load until now, so a request may have queued behind it. */
	if (rc && c->on_unloaded)
		c->on_unloaded(c->expire_ctx, true);
}

void kvr_owner_book_deferred_task(struct kvr_shard *sh, void *payload)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	struct kvr_attempt *rec;
	memcpy(&rec, payload, sizeof(rec));
	ss->room_taken++; /* its poster took one: a track uses it, a stale drop gives it back */
	book(sh, rec, true, true);
	room_sync(ss);
}

int kvr_owner_book_call(struct kvr_shard *sh, void *rec)
{
	/* A sync_booking booking waited for: its poster found no room (kvr_owner_book_room_take).
	 */
	kvr_metrics_add(kvr_owner_mb(kvr_owner_state(sh)->c), KVR_C_BOOKING_WAITS, 1);
	return book(sh, rec, false, false);
}

/* ---------------------------------------------------------------- lifecycle */

/* Output tokens: complete blocks are hashed (chained after the last one), materialized in the
 * predicted cache and stored in the index.  vLLM computes a token's KV only when it feeds the
 * token back to sample the next one, so the last token reported so far has no KV yet: unless
 * the frontend said it is not the final one (not_final: vLLM allocates its slot as it schedules
 * the next step, and so does the router, now), it is held back (rec->pending) and joins the
 * tail when a later token arrives.  A block therefore counts
 * as cached once a token after it has been reported; at finish or abort the held token is
 * dropped, so a block only the final token would complete is never predicted, and the tail
 * (computed tokens only) keeps the private block vLLM holds for it: after P prompt and O output
 * tokens the rank holds ceil((P+O-1)/B) blocks and caches floor((P+O-1)/B), as vLLM does. */
/* The attempt bound: the most blocks one attempt's prediction may reach through its output on
 * a rank of the LRU kind, twice the rank's capacity (the larger of the registered one and the
 * estimate, shards/lru_cap.c) plus KVR_EVENTS_BOUND_FLOOR_BLOCKS.  An engine cannot hold one
 * request larger than its KV cache (vLLM refuses to start with a max_model_len that does not
 * fit), so no honest stream reaches it; the slack is for a capacity registered low, as in
 * events mode's stored-block bound (owner_events.c).  Without it an attempt's pinned blocks
 * were never evicted and a prediction above the capacity reads as an under-registered capacity:
 * a frontend that kept reporting output (a runaway generation, a bug, a hostile client) grew the
 * rank's prediction, load and index without limit while the attempt lived (160,000 output
 * tokens on a 100-block rank held 10,009 blocks, ~35 B each in caches and load plus the
 * index's).  A rank of the TTL kind needs none: its blocks expire whether or not an attempt
 * lives.  A prompt past the bound is booked whole (its size is the caller's own input), and
 * its output is not predicted. */
static uint64_t attempt_bound(const struct kvr_rank_owned *own)
{
	if (kvr_rank_state_mode(own->rs) != KVR_RANK_LRU)
		return UINT64_MAX;
	uint64_t est = kvr_lru_capacity(kvr_rank_state_lru(own->rs));
	return kvr_owner_capacity_bound(own->capacity > est ? own->capacity : est);
}

/* Output that could not be taken for memory: its tokens are gone (the tail already took them),
 * so every later block would be hashed on a chain that skips them, and predicted where no prompt
 * will match it, evicting real blocks: the attempt's output is no longer predicted (its liveness
 * still renews; what it predicted stays).  Counted by the caller (kvr_shard_errors_total). */
static int output_lost(struct kvr_attempt *rec)
{
	rec->output_off = true;
	return KVR_ENOMEM;
}

static int output(struct kvr_shard *sh, struct kvr_rank_owned *own, struct kvr_attempt *rec,
                  const uint32_t *tok, size_t n, bool not_final)
{
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	uint32_t bs = c->block_size;
	if (!rec->chain_known || !own->rs || !rec->booked || rec->incarnation != own->incarnation ||
	    rec->output_off)
		return 0; /* tracked for liveness only */
	/* Computed now: the held-back token, then all new tokens but the last, which is held unless
	 * it is known not to be the final one. */
	bool held = n > 0 && rec->has_pending, joined = held;
	bool hold = n > 0 && !not_final;
	uint32_t next_pending = hold ? tok[n - 1] : 0;
	n -= hold ? 1 : 0;
	size_t max_blocks = (rec->tail_n + n + (held ? 1 : 0)) / bs;
	if (kvr_grow((void **)&ss->lb, &ss->lb_cap, max_blocks ? max_blocks : 1, sizeof(*ss->lb)))
		return output_lost(rec);
	struct kvr_lru_block *b = ss->lb;
	size_t nb = 0;
	uint64_t parent = rec->last_seq;
	bool has_parent = rec->has_last;
	while (held || n > 0) {
		if (held) {
			rec->tail[rec->tail_n++] = rec->pending;
			held = false;
		} else {
			uint32_t take = bs - rec->tail_n;
			if (take > n)
				take = (uint32_t)n;
			memcpy(rec->tail + rec->tail_n, tok, take * sizeof(uint32_t));
			rec->tail_n += take;
			tok += take;
			n -= take;
		}
		if (rec->tail_n == bs) {
			const uint64_t *par = nb ? &b[nb - 1].seq : (has_parent ? &parent : NULL);
			kvr_hash_chain_tokens(par, rec->tail, 1, bs, rec->lora_seed, &b[nb].local,
			                      &b[nb].seq);
			nb++;
			rec->tail_n = 0;
		}
	}
	if (hold) {
		rec->pending = next_pending;
		rec->has_pending = true;
	} else if (joined) {
		rec->has_pending = false; /* it joined the tail */
	}
	uint64_t bound = attempt_bound(own);
	if (rec->n_blocks + (uint64_t)nb > bound) {
		/* Cut at the bound; the rest of its output is not predicted (see attempt_bound). */
		nb = bound > rec->n_blocks ? (size_t)(bound - rec->n_blocks) : 0;
		rec->output_off = true;
		kvr_metrics_add(kvr_owner_mb(c), KVR_C_OUTPUT_OVER_BOUND, 1);
	}
	uint32_t priv = rec->tail_n > 0 ? 1 : 0;
	int rc = kvr_rank_state_materialize(own->rs, own->incarnation, rec->attempt, parent, b, nb,
	                                    rec->n_blocks, priv, kvr_owner_now(c), &ss->out);
	if (rc == KVR_ENOENT) {
		rec->booked = false; /* the predicted cache no longer knows it: load only */
		return 0;
	}
	if (rc)
		return output_lost(rec);
	kvr_owner_apply_removals(ss, own, &ss->out);
	if (nb) {
		kvr_owner_store_runs(ss, own, has_parent ? &parent : NULL, b, &ss->out);
		kvr_load_add_output(own->load, rec->attempt, &b[0].seq, KVR_LRU_BLOCK_STRIDE, nb);
		rec->last_seq = b[nb - 1].seq;
		rec->has_last = true;
		rec->n_blocks += (uint32_t)nb;
	}
	kvr_owner_arm_ttl(sh, own);
	return 0;
}

/* The attempt's prefill tokens leave the rank's load (its provisional load, if load_missing). */
static void prefill_done(const struct kvr_owner_ctx *c, struct kvr_rank_owned *own,
                         struct kvr_attempt *rec)
{
	rec->in_prefill = false;
	if (!rec->load_missing) {
		kvr_load_prefill_done(own->load, rec->attempt);
	} else if (rec->pend_prefill_tokens) {
		__atomic_fetch_sub(&c->prov[rec->slot].prefill_tokens, rec->pend_prefill_tokens,
		                   __ATOMIC_RELAXED);
		rec->pend_prefill_tokens = 0;
	}
}

static int progress(struct kvr_shard *sh, const struct kvr_progress_msg *m, const uint32_t *tok)
{
	kvr_owner_retry_timers(sh);
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	struct kvr_attempt *rec = find(ss, m->attempt);
	if (!rec)
		return KVR_ESTALE; /* ended, expired, stale booking, or not this shard's */
	struct kvr_rank_owned *own = c->ranks[rec->slot].own;
	int rc = 0;
	switch (m->op) {
	case KVR_OP_PREFILL_DONE:
		if (rec->in_prefill) {
			prefill_done(c, own, rec);
			kvr_owner_publish(ss, own);
		}
		return 0;
	case KVR_OP_OUTPUT:
		if (rec->in_prefill) /* output implies the prefill is done */
			prefill_done(c, own, rec);
		rc = output(sh, own, rec, tok, m->n_tokens, m->flags & KVR_PROGRESS_NOT_FINAL);
		kvr_owner_publish(ss, own);
		if (rc)
			kvr_metrics_add(kvr_owner_mb(c), KVR_C_SHARD_INDEX_WRITE_ERRORS, 1);
		return rc;
	case KVR_OP_FINISH:
	case KVR_OP_ABORT:
		end_attempt(sh, rec, true); /* the caller claimed the lease */
		return 0;
	default:
		return KVR_EINVAL;
	}
}

void kvr_owner_progress_task(struct kvr_shard *sh, void *payload)
{
	struct kvr_progress_msg m;
	memcpy(&m, payload, sizeof(m));
	bool heap = m.op == KVR_OP_OUTPUT && m.n_tokens > KVR_PROGRESS_INLINE;
	int rc = progress(sh, &m, heap ? m.tok.heap : m.tok.inl);
	if (heap)
		kvr_free_transient(m.tok.heap, m.n_tokens * sizeof(uint32_t));
	/* No lifecycle call runs the queue's admission pass (none waits for this work): the hook
	 * wakes the router's admission thread if requests are queued (a router with a queue). */
	const struct kvr_owner_ctx *c = kvr_owner_state(sh)->c;
	if (rc == 0 && (m.flags & KVR_PROGRESS_WAKE) && c->on_unloaded)
		c->on_unloaded(c->expire_ctx, false);
}

/* ---------------------------------------------------------------- reaper */

/* One CLOCK step over the shard's booked attempts (walked from the end: ending one moves the
 * last into its place). */
void kvr_owner_reaper_fire(struct kvr_shard *sh, void *arg)
{
	(void)arg;
	kvr_owner_retry_releases(sh);
	struct kvr_shard_state *ss = kvr_owner_state(sh);
	const struct kvr_owner_ctx *c = ss->c;
	bool ended = false;
	for (size_t i = ss->n_recs; i-- > 0;) {
		if (i >= ss->n_recs)
			continue;
		struct kvr_attempt *rec = ss->recs[i];
		int st = kvr_lease_age(c->leases, rec->attempt);
		if (st == KVR_LEASE_CLAIMED) {
			uint64_t attempt = rec->attempt; /* rec is recycled by end_attempt */
			bool noted = rec->noted;
			KVR_PROBE2(lease_expire, rec->slot, attempt);
			kvr_metrics_add(kvr_owner_mb(c), KVR_C_LEASE_EXPIRIES, 1);
			end_attempt(sh, rec, true);
			ended = true;
			/* A mirror's end is its origin's to tell, and an attempt whose admission
			 * was never noted has none to tell: told, its id was no record of the
			 * replica layer's and sat in its early set (sync/replica_early.c;
			 * test_replica_early expiries_of_attempts_routed_before_attach_*). */
			if (c->on_expire && noted)
				c->on_expire(c->expire_ctx, attempt);
		} else if (st == 0) {
			/* A caller claimed it and its finish/abort message has not come (still
			 * queued, or given up on a full lane): end it now; the message, if it
			 * comes, finds nothing. */
			end_attempt(sh, rec, true);
			ended = true;
		}
	}
	if (ended && c->on_unloaded)
		c->on_unloaded(c->expire_ctx, true);
	kvr_owner_rearm_reaper(sh);
}
