/*
 * shards/lru_internal.h - what the files of the segment LRU share (lru.c: walks and commands;
 * lru_segs.c: the segment store and eviction; lru_heal.c: healing from engine ground truth;
 * lru_out.c: output buffers).  See lru.c for the algorithm and the invariants. Context (everything
 * here): the shard thread that owns the instance.
 */
#ifndef KVR_SHARDS_LRU_INTERNAL_H
#define KVR_SHARDS_LRU_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "shards/chain.h"
#include "shards/lru.h"
#include "shards/u64map.h"

#define NIL UINT32_MAX

/* A segment: 40 bytes.  What only some segments need lives elsewhere or shares room: the list
 * links and release order only matter while the segment is inactive (refs == 0) and the
 * refcount only while it is held, so they share a union (`inactive` says which); the next
 * segment with the same head hash (only duplicate copies have one) is in lru->hnext.  The split
 * chain has no back link: it is followed only inside a lease's piece, whose segments the lease
 * holds, so a dropped (inactive) segment is never reached through it and needs no unlinking,
 * and kvr_lru_settle redirects the links inside the leases' pieces when it moves segments.  The
 * hashes are lru->heap[off, off + len) (lru_heap.c): no pointer, no capacity of their own. */
struct seg {
	uint64_t stamp : 56;    /* the command that created these copies: smaller = older (2^56
	                         * segment creations per rank: 2,000 years at a million a second) */
	uint64_t inactive : 1;  /* on the inactive list (then the union holds order/prev/next) */
	uint64_t has_hnext : 1; /* in lru->hnext: not the last with its head hash */
	uint64_t unused : 1;    /* a free slot (on the free list) */
	union {
		struct {                     /* inactive */
			uint64_t order;      /* the list is sorted by (order asc, depth desc) */
			uint32_t prev, next; /* inactive list; next doubles as the free list */
		};
		uint32_t refs; /* held: leases holding every copy of the segment */
	};
	uint32_t off;   /* its hashes start at lru->heap[off] (moved by kvr_lru_reserve_hashes) */
	uint32_t len;   /* copies */
	uint32_t snext; /* split chain: the next of the segments that were one, in chain
	                 * order (meaningful inside a lease's piece only) */
	uint32_t depth; /* chain position of the first copy */
};
_Static_assert(sizeof(struct seg) == 40, "struct seg grew");

/* Released private blocks (keep_private): one entry per release that had any, in a FIFO (a ring)
 * beside the inactive list.  An entry takes its release's first order, unshared by any segment,
 * so merging the two by order gives the inactive order exactly (see lru_segs.c). */
struct phantom {
	uint64_t order; /* its place in the inactive order */
	uint32_t len;   /* blocks */
	uint32_t unused;
};

/* The head map (lru_heads.c): head hash -> first segment of its multimap chain, 8 bytes a slot
 * (the segment and the hash's high half; the hash itself is the segment's first in the heap). */
struct head_slot {
	uint32_t seg; /* NIL: empty */
	uint32_t tag; /* the head hash's high 32 bits */
};
struct kvr_lru_heads {
	struct head_slot *slots;
	uint32_t cap, count; /* cap: a power of two, or 0 */
	unsigned shift;      /* 64 - log2(cap) */
};

struct piece {
	uint32_t seg; /* first segment (its split chain continues the piece) */
	uint32_t len; /* blocks */
	uint64_t ord; /* a hit on inactive copies: their order then (0: they were held) */
};

struct lease {
	uint64_t attempt;
	uint64_t last_seq; /* hash of the last block (valid when nblocks > 0) */
	struct piece *p;
	uint32_t n, cap;
	uint32_t priv;
	uint32_t nblocks;
	uint32_t nprompt;   /* blocks the acquire took (the prompt's; output follows them) */
	uint32_t hit;       /* blocks the acquire found present (the predicted depth) */
	uint32_t unghosted; /* its blocks below this depth are no ghosts any more (lru_heal.c) */
};

struct cursor {
	uint32_t seg, off;
};

/* Ghosts (lru_cap.c): the hashes evicted most recently, in eviction order, for the capacity
 * estimator.  Off (cap 0) until the first cached-tokens report. */
struct ghosts {
	uint64_t *ring;        /* evicted hashes; slot `at` is overwritten next */
	uint64_t *live;        /* bit per slot: the hash is still a ghost (absent, not evicted
	                        * again later) */
	uint32_t cap, at;      /* slots; next slot written */
	uint64_t n;            /* pushed since enabled */
	struct kvr_u64map map; /* live ghost hash -> its slot */
};

struct kvr_lru {
	uint64_t capacity;   /* what eviction keeps to: the estimate (lru_cap.c) */
	uint64_t registered; /* the capacity set (kvr_lru_create / kvr_lru_set_capacity) */
	bool explore;        /* an answer proved the registration too small (lru_cap.c) */
	struct ghosts gh;
	struct seg *s;
	uint32_t s_cap, s_live, free_head;
	uint64_t *heap;       /* every segment's hashes, in chunks (lru_heap.c) */
	uint32_t *chunk_live; /* per chunk: live hashes in it (live_cap entries) */
	uint32_t heap_chunks, live_cap, chunk_shift; /* chunks of 1 << chunk_shift hashes */
	uint32_t chunk_cur, chunk_pos,
	    n_free; /* the chunk taken from, its next slot; free chunks */
	uint32_t inact_head, inact_tail;
	struct phantom *ph; /* phantom ring: ph_n entries from ph_head */
	uint32_t ph_cap, ph_head, ph_n;
	uint64_t copies, n_inactive, priv, n_phantom, evictions, epoch, stamp, dup_extra;
	uint64_t order_seq; /* last order given to a segment entering the inactive list */
	bool keep_private;
	struct kvr_lru_heads heads; /* head hash -> first segment of its multimap chain */
	struct kvr_u64map
	    hnext;              /* segment -> the next one with its head hash (when there is one) */
	struct kvr_u64map dups; /* hash -> extra copies, for hashes with several copies */
	struct lease *leases;
	uint32_t n_leases, leases_cap;
	struct kvr_u64map by_attempt;
	struct cursor *cur, *nxt; /* walk sets, cur_cap each */
	size_t cur_cap;
	struct kvr_run_hit *hits;
	size_t hits_cap;
	uint32_t *rel; /* release: segments of one piece */
	size_t rel_cap;
};

static inline uint64_t *seq_of(const struct kvr_lru *lru, const struct seg *g)
{
	return lru->heap + g->off;
}

/* lru_heads.c: the head map */
static inline size_t kvr_lru_heads_home(const struct kvr_lru_heads *m, uint64_t h)
{
	h ^= h >> 29;
	return (size_t)(kvr_place(h) >> m->shift);
}
/* The head hash of segment i. */
static inline uint64_t kvr_lru_head_hash(const struct kvr_lru *lru, uint32_t i)
{
	return lru->heap[lru->s[i].off];
}
/* The first segment with head hash h (its slot's value, which may be rewritten), or NULL.
 * Valid until the next insert, remove or resize. */
static inline uint32_t *kvr_lru_heads_find(const struct kvr_lru *lru, uint64_t h)
{
	const struct kvr_lru_heads *m = &lru->heads;
	if (m->count == 0)
		return NULL;
	size_t mask = m->cap - 1, i = kvr_lru_heads_home(m, h);
	uint32_t tag = (uint32_t)(h >> 32);
	for (;;) {
		struct head_slot *s = &m->slots[i];
		if (s->seg == NIL)
			return NULL;
		if (s->tag == tag && kvr_lru_head_hash(lru, s->seg) == h)
			return &s->seg;
		i = (i + 1) & mask;
	}
}
/* Room for n more heads.  0 or KVR_ENOMEM (unchanged). */
int kvr_lru_heads_reserve(struct kvr_lru *lru, size_t n);
/* Adds head hash h -> segment i (h absent; room reserved; h is i's first hash in the heap). */
void kvr_lru_heads_insert(struct kvr_lru *lru, uint64_t h, uint32_t i);
/* Removes head hash h (present). */
void kvr_lru_heads_remove(struct kvr_lru *lru, uint64_t h);
/* Halves the map when under 30 % full (best effort). */
void kvr_lru_heads_settle(struct kvr_lru *lru);
/* Frees the map. */
void kvr_lru_heads_fini(struct kvr_lru *lru);

/* lru.c */
struct lease *kvr_lru_find_lease(const struct kvr_lru *lru, uint64_t attempt);
/* lru_heal.c: the lease's blocks stored since its acquire (or its last answer) are no ghosts:
 * called as it is released, so that a request never answered leaves no ghost of a block it
 * brought back. */
void kvr_lru_heal_unghost(struct kvr_lru *lru, struct lease *l);

/* lru_segs.c: the segment store */
/* Makes room for n new segments.  0, KVR_ERANGE or KVR_ENOMEM. */
int kvr_lru_reserve_segs(struct kvr_lru *lru, size_t n);
/* Upper bound on evictions a command can cause when it adds `added` resident blocks. */
size_t kvr_lru_eviction_bound(const struct kvr_lru *lru, uint64_t added);
/* A fresh segment slot (room reserved), zeroed, on no list. */
uint32_t kvr_lru_seg_new(struct kvr_lru *lru);
/* Room for n head_adds: in lru->heads and lru->hnext.  0 or KVR_ENOMEM. */
int kvr_lru_reserve_head(struct kvr_lru *lru, size_t n);
/* The next segment with segment i's head hash, or NIL. */
static inline uint32_t kvr_lru_hnext(const struct kvr_lru *lru, uint32_t i)
{
	return lru->s[i].has_hnext ? *kvr_u64map_find(&lru->hnext, i) : NIL;
}
/* Adds segment i to the head multimap under its first hash (room reserved: reserve_head). */
void kvr_lru_head_add(struct kvr_lru *lru, uint32_t i);
/* Takes inactive segment i off the inactive list. */
void kvr_lru_inact_unlink(struct kvr_lru *lru, uint32_t i);
/* Appends segment i (refs 0) to the inactive list with the next release order. */
void kvr_lru_inact_append(struct kvr_lru *lru, uint32_t i);
/* Splits segment i before off (0 < off < len); see lru_segs.c.  0, KVR_ERANGE or KVR_ENOMEM
 * (nothing changed). */
int kvr_lru_split(struct kvr_lru *lru, uint32_t i, uint32_t off);
/* Ends a command: shrinks the segment array to 1.25x its use when under two thirds of its slots
 * are in use, and halves the head map when under 30 % full (see lru_segs.c).  Never fails (on
 * no memory they stay). */
void kvr_lru_settle(struct kvr_lru *lru);
/* Evicts down to the capacity. */
void kvr_lru_reconcile(struct kvr_lru *lru, struct kvr_lru_out *out);
/* Evicts the m deepest copies of inactive segment i; room in the output must be reserved. */
void kvr_lru_trim(struct kvr_lru *lru, uint32_t i, uint32_t m, struct kvr_lru_out *out);
/* Drops an emptied inactive segment from every structure. */
void kvr_lru_seg_drop(struct kvr_lru *lru, uint32_t i);
/* Room for one more phantom entry.  0 or KVR_ENOMEM. */
int kvr_lru_reserve_phantom(struct kvr_lru *lru);
/* Appends a phantom of len blocks (room reserved) with the next release order. */
void kvr_lru_phantom_push(struct kvr_lru *lru, uint32_t len);
/* The oldest phantom if it comes before the inactive list's head in eviction order, else NULL. */
static inline struct phantom *kvr_lru_phantom_next(const struct kvr_lru *lru)
{
	if (lru->ph_n == 0)
		return NULL;
	struct phantom *p = &lru->ph[lru->ph_head];
	return lru->inact_head == NIL || p->order < lru->s[lru->inact_head].order ? p : NULL;
}
/* Reuses the m oldest phantom blocks (m <= the oldest entry's len): nothing to tell the index. */
void kvr_lru_phantom_evict(struct kvr_lru *lru, uint32_t m);
/* Evicts from the head of the inactive list until resident <= limit or nothing is inactive. */
void kvr_lru_evict_to(struct kvr_lru *lru, uint64_t limit, struct kvr_lru_out *out);

/* lru_heap.c: the hash heap */
/* Sets the chunk size for a rank of this capacity (before the first hashes). */
void kvr_lru_heap_init(struct kvr_lru *lru, uint64_t capacity);
/* The segments a new range of n hashes is stored as (none for 0). */
uint32_t kvr_lru_hash_pieces(const struct kvr_lru *lru, size_t n);
/* Room for a new range of n hashes: may compact the heap, which moves every segment's hashes
 * (no seq_of pointer may be held across it; segment indices stay).  0, KVR_ERANGE or
 * KVR_ENOMEM (nothing observable changed). */
int kvr_lru_reserve_hashes(struct kvr_lru *lru, size_t n);
/* Takes room for the next piece (len hashes, at most a chunk) of a reserved range; returns
 * its offset.  The pieces of one range are taken in order, kvr_lru_hash_pieces of them. */
uint32_t kvr_lru_hashes_take(struct kvr_lru *lru, uint32_t len);
/* The first piece's length of a new range of n hashes (the others are whole chunks, the last
 * what is left). */
uint32_t kvr_lru_hash_piece_len(const struct kvr_lru *lru, size_t n);
/* Whether segment g's hashes end where the current chunk is taken from next, with room for n
 * more there (then kvr_lru_hashes_extend can lengthen it in place). */
static inline bool kvr_lru_hashes_can_extend(const struct kvr_lru *lru, const struct seg *g,
                                             size_t n)
{
	return lru->chunk_cur != NIL && lru->chunk_live[lru->chunk_cur] != 0 &&
	       g->off + g->len == (lru->chunk_cur << lru->chunk_shift) + lru->chunk_pos &&
	       lru->chunk_pos + n <= (1u << lru->chunk_shift);
}
/* Takes the n slots after segment g (kvr_lru_hashes_can_extend); returns where they start. The
 * caller lengthens g. */
static inline uint64_t *kvr_lru_hashes_extend(struct kvr_lru *lru, const struct seg *g, uint32_t n)
{
	lru->chunk_pos += n;
	lru->chunk_live[lru->chunk_cur] += n;
	return lru->heap + g->off + g->len;
}
/* Tells the heap that m hashes at the end of segment g are gone (a trim). */
static inline void kvr_lru_hashes_gone(struct kvr_lru *lru, const struct seg *g, uint32_t m)
{
	uint32_t c = g->off >> lru->chunk_shift;
	if ((lru->chunk_live[c] -= m) == 0 && c != lru->chunk_cur)
		lru->n_free++;
}
/* Gives the heap back down to its use plus a margin when it is less than half used (end of a
 * command; best effort). */
void kvr_lru_heap_settle(struct kvr_lru *lru);
/* Frees the heap. */
void kvr_lru_heap_fini(struct kvr_lru *lru);

/* lru_cap.c: ghosts and the capacity estimate */
/* Records hash h, whose last copy was just evicted (no-op while ghosts are off). */
void kvr_lru_ghost_push(struct kvr_lru *lru, uint64_t h);
/* Turns ghosts on (first call) or regrows them to follow the estimate (best effort).  0 or
 * KVR_ENOMEM (turning on failed; nothing changed). */
int kvr_lru_ghosts_fit(struct kvr_lru *lru);
/* Frees the ghosts. */
void kvr_lru_ghosts_fini(struct kvr_lru *lru);
/* The slot of hash h's live ghost, or NIL. */
uint32_t kvr_lru_ghost_slot(const struct kvr_lru *lru, uint64_t h);
/* Of two ghost slots, whether a was evicted before b. */
bool kvr_lru_ghost_older(const struct kvr_lru *lru, uint32_t a, uint32_t b);
/* Live ghosts evicted after slot s (and s itself when inclusive). */
uint64_t kvr_lru_ghosts_newer(const struct kvr_lru *lru, uint32_t s, bool inclusive);
/* Forgets h's ghost (its hash is present again). */
void kvr_lru_ghost_kill(struct kvr_lru *lru, uint64_t h);
/* Moves the estimate toward a lower (lo) or upper (hi) bound on the engine's capacity (0:
 * none) and evicts down to it; room for n_inactive evictions must be reserved in out. */
void kvr_lru_cap_bound(struct kvr_lru *lru, uint64_t lo, uint64_t hi, struct kvr_lru_out *out);

#endif /* KVR_SHARDS_LRU_INTERNAL_H */
