/*
 * shards/owner_internal.h - what the three owner files (ranks, attempts, events) share: the
 * per-rank and per-shard state and the helpers that keep the index and the load snapshot in step
 * with them.  Context (everything here): the shard thread that owns the state.
 */
#ifndef KVR_SHARDS_OWNER_INTERNAL_H
#define KVR_SHARDS_OWNER_INTERNAL_H

#include "core/limits.h"
#include "shards/lru.h"
#include "shards/owner.h"
#include "shards/u64map.h"

struct kvr_attempt {
	uint64_t attempt;
	uint64_t gen;         /* the rank generation the decision saw */
	uint64_t incarnation; /* the rank's incarnation at the booking */
	uint64_t last_seq;    /* sequence hash of the last complete block (prompt, then output) */
	uint64_t lora_seed;
	uint64_t pend_prefill_tokens, pend_blocks; /* provisional load to take back at booking */
	uint32_t slot;
	uint32_t idx;      /* position in the shard's attempt array */
	uint32_t n_blocks; /* complete blocks so far */
	uint32_t n_prompt; /* complete blocks of the prompt (after tail[]) */
	uint32_t tail_n;   /* tokens of the partial block (KV computed) */
	uint32_t pending;  /* the last output token reported: no KV until a later one comes */
	uint32_t overlap;  /* predicted cached prefix at the decision */
	/* kvr_admit_args.noted.  Here, in the padding before prompt_tokens: after the bools it
	 * (as `peer`, which it replaced) grew the record from 128 bytes (two lines, tail[] on a
	 * line's start) to 136, and kvr_route's p50 by 8-10 % (bench_route --lengths 2048
	 * --shards 1 --threads-max 1 --cpus 1: 1412-1492 ns against 1272-1312). */
	bool noted;
	uint64_t prompt_tokens;
	size_t size; /* bytes allocated for this record */
	bool has_last;
	bool has_pending;
	bool booked; /* the predicted cache holds a lease for it (booking did not fail) */
	/* A deferred sync_booking booking whose load could not be recorded (memory): its load
	 * stays provisional (the routers' prov words) until its prefill ends / it ends. */
	bool load_missing;
	bool chain_known;
	bool in_prefill;
	/* Output no longer predicted: its blocks reached the attempt bound, or some of its output
	 * could not be taken (memory), after which its chain is not known (owner_attempts.c). */
	bool output_off;
	int8_t pool_class; /* capacity 2^pool_class blocks, recycled; -1: exact size, freed */
	struct kvr_attempt *prev, *next; /* the rank's live attempts */
	uint32_t tail[]; /* block_size tokens, then the prompt's blocks (kvr_attempt_blocks) */
};

struct kvr_rank_owned {
	struct kvr_rank_state *rs; /* NULL in events mode */
	struct kvr_load *load;
	uint64_t incarnation;
	uint64_t capacity;
	uint64_t last_event_id;
	bool have_event;
	bool over_bound; /* events mode: an episode at the stored-block bound (owner_events.c) */
	bool index_full; /* events mode: an episode of stores refused for run ids (same file) */
	uint64_t gaps;
	uint64_t evictions;
	struct kvr_attempt *attempts;
	/* Ended attempts whose predicted-cache release ran out of memory: their lease still pins
	 * their blocks in the LRU (never evictable), so the release is retried on the shard's
	 * next call (kvr_owner_retry_releases).  Linked by prev/next like attempts. */
	struct kvr_attempt *owed;
	uint64_t ttl_timer;
	uint64_t ttl_deadline; /* UINT64_MAX: no timer armed */
	uint32_t slot;
	struct kvr_rank_owned *prev, *next; /* the shard's ranks */
};

struct kvr_shard_state {
	const struct kvr_owner_ctx *c;
	/* live attempts booked here: attempt id -> index in recs[] (dense, swap-removed) */
	struct kvr_u64map by_id;
	struct kvr_attempt **recs;
	size_t n_recs, recs_cap;
	/* Deferred bookings that may still be posted without this shard allocating to track them
	 * (atomic: posters take from it, kvr_owner_book_room_take; the shard adds what it frees
	 * or grows, room_sync in owner_attempts.c), and the shard's own view: the track slots
	 * free at its last update and the deferred bookings run since (taken by their posters). */
	int64_t book_room;
	size_t room_free;
	uint64_t room_taken;
	struct kvr_lru_out out;
	struct kvr_index_block *blk;
	size_t blk_cap;
	struct kvr_lru_block *lb; /* output blocks being hashed */
	size_t lb_cap;
	struct kvr_rank_owned *ranks; /* every rank this shard owns */
	bool reaper_armed;            /* the lease reaper's timer is pending */
	bool decay_armed;             /* the prefill decay's timer is pending (owner_ranks.c) */
	bool timers_broken;           /* a timer could not be armed: retry on the next call */
	bool releases_owed;           /* some rank's owed list is not empty */
};

static inline struct kvr_shard_state *kvr_owner_state(struct kvr_shard *sh)
{
	return kvr_shard_userdata(sh);
}

/* The router's time: a timed task's own (sync_booking's deferred work runs at the time it was
 * posted at, see kvr_shard_post_at), else the clock's. */
static inline uint64_t kvr_owner_now(const struct kvr_owner_ctx *c)
{
	uint64_t t;
	return kvr_shard_task_time(&t) ? t : kvr_clock_now(&c->clock);
}

static inline struct kvr_metrics_block *kvr_owner_mb(const struct kvr_owner_ctx *c)
{
	return kvr_metrics_local(c->metrics);
}

/* The prompt's blocks are stored after the tail tokens, 16-byte aligned. */
static inline size_t kvr_attempt_blocks_off(uint32_t bs)
{
	return sizeof(struct kvr_attempt) + (((size_t)bs * sizeof(uint32_t) + 15) & ~(size_t)15);
}

/* The prompt's n_prompt blocks in the record, (local, seq) pairs as the predicted cache takes
 * them: the booking hands them over in place (no copy), the load reads the .seq fields with a
 * stride of 2, the index store copies the new blocks.  The routing thread hashes into them with
 * streaming stores (core/hash.h) and keeps its own copy of seq for its lookups, so nothing it
 * reads gets slower from the interleaving. */
static inline struct kvr_lru_block *kvr_attempt_blocks(struct kvr_attempt *rec, uint32_t bs)
{
	return (struct kvr_lru_block *)(void *)((char *)rec + kvr_attempt_blocks_off(bs));
}

/* shards/owner_ranks.c */
void kvr_owner_publish(struct kvr_shard_state *ss, struct kvr_rank_owned *own);
/* Publishes a rank's new decode blocks and prefill tokens: the snapshot in struct kvr_rank_pub
 * (relaxed stores) and its change added to the booked load word (struct kvr_rank_load).
 * Context: the rank's shard thread (the single writer of both). */
void kvr_owner_publish_load(const struct kvr_owner_ctx *c, uint32_t slot, uint64_t blocks,
                            uint64_t prefill_tokens);
/* Subtracts a booked admission's provisional amounts from the rank's booked load word (they
 * stay in the routers' prov word: the sum counts the request once, as booked).  Modular.
 * Context: the rank's shard thread, the rank live here (the word's single writer). */
void kvr_owner_take_back(const struct kvr_owner_ctx *c, uint32_t slot, uint64_t prefill_tokens,
                         uint64_t blocks);
void kvr_owner_apply_removals(struct kvr_shard_state *ss, struct kvr_rank_owned *own,
                              const struct kvr_lru_out *out);
void kvr_owner_store_runs(struct kvr_shard_state *ss, struct kvr_rank_owned *own,
                          const uint64_t *parent, const struct kvr_lru_block *b,
                          const struct kvr_lru_out *out);
void kvr_owner_arm_ttl(struct kvr_shard *sh, struct kvr_rank_owned *own);
/* What failed for lack of memory and is retried at the start of the shard's next call: owed
 * releases (kvr_owner_retry_releases), timers.  Context: the shard's thread. */
void kvr_owner_retry_timers(struct kvr_shard *sh);
/* The lease reaper has run: its next scan one interval from now, if the shard has attempts. */
void kvr_owner_rearm_reaper(struct kvr_shard *sh);
/* Twice a capacity plus KVR_EVENTS_BOUND_FLOOR_BLOCKS, saturating: what a rank may hold in events
 * mode (owner_events.c, "The stored-block bound") and one attempt in approx_lru
 * (owner_attempts.c, attempt_bound), beyond anything an honest engine of that capacity holds. */
static inline uint64_t kvr_owner_capacity_bound(uint64_t cap)
{
	if (cap > (UINT64_MAX - KVR_EVENTS_BOUND_FLOOR_BLOCKS) / 2)
		return UINT64_MAX;
	return 2 * cap + KVR_EVENTS_BOUND_FLOOR_BLOCKS;
}
/* Arms the lease reaper one interval from now unless it is pending (a booking: the reaper
 * sleeps while the shard has no attempts). */
void kvr_owner_wake_reaper(struct kvr_shard *sh);
/* The rank's owned state if the slot still holds generation gen, else NULL. */
struct kvr_rank_owned *kvr_owner_rank(const struct kvr_owner_ctx *c, uint32_t slot, uint64_t gen);

/* shards/owner_attempts.c */
/* Claims (if nobody has) and ends every live attempt of the rank, blocks not released. */
void kvr_owner_end_all_attempts(struct kvr_shard *sh, struct kvr_rank_owned *own);
/* Retries the predicted-cache releases that ran out of memory (struct kvr_rank_owned's owed),
 * keeping those that fail again; frees the records of the others (and of those whose store was
 * renewed or dropped since: their lease went with it).  Cheap when none is owed.
 * Context: the shard's thread. */
void kvr_owner_retry_releases(struct kvr_shard *sh);
/* Frees the rank's owed records without releasing (its store is going).  Context: the shard. */
void kvr_owner_drop_owed(struct kvr_shard *sh, struct kvr_rank_owned *own);
/* The reaper's timer callback: one CLOCK step over the shard's attempts. */
void kvr_owner_reaper_fire(struct kvr_shard *sh, void *arg);
/* Makes the room deferred bookings take (kvr_owner_book_room_take) if little is left: at shard
 * start and rank creation, so no booking waits for the shard to allocate until the room made
 * ahead of time is really used up.  An allocation failure leaves less room, nothing else.
 * Context: the shard's thread. */
void kvr_owner_room_prepare(struct kvr_shard_state *ss);
/* Frees the shard's attempt map (shard stop; the ranks are gone). */
void kvr_owner_attempts_fini(struct kvr_shard_state *ss);

#endif /* KVR_SHARDS_OWNER_INTERNAL_H */
