/*
 * shards/lru_segs.c - the segment store of the approximate LRU: segment slots and their
 * reservations, the head multimap, the inactive list in eviction order, splits, and eviction
 * (trimming the inactive list's head segment from its tail).  The commands that use it
 * (acquire, materialize, release: shards/lru.c) and the healing rules (shards/lru_heal.c) never
 * touch these structures but through the functions here.  See lru.c for the algorithm and its
 * invariants.
 * Context: the shard thread that owns the instance.
 */
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/lru_internal.h"

/* ------------------------------------------------------------------ reservations */

/* The slots an array of at least n segments can have for the memory it takes: its allocator
 * size class holds (the classes above 16 KiB are a quarter apart, so asking for n alone wastes up
 * to a fifth of the array), at most NIL - 1. */
static size_t seg_slots_fit(size_t n)
{
	size_t fit = kvr_alloc_real_size(n * sizeof(struct seg)) / sizeof(struct seg);
	fit = fit > n ? fit : n;
	return fit < NIL ? fit : NIL - 1;
}

/* Makes room for n new segments.  The array grows by a quarter (40 B a slot: bench_footprint's
 * predicted caches at 2k prompts carried 1.6 slots per live segment growing by half), to what
 * its size class holds. */
int kvr_lru_reserve_segs(struct kvr_lru *lru, size_t n)
{
	size_t need = (size_t)lru->s_live + n;
	if (need >= NIL)
		return KVR_ERANGE;
	if (need <= lru->s_cap)
		return 0;
	size_t nc = (size_t)lru->s_cap + lru->s_cap / 4;
	if (nc < need)
		nc = need;
	if (nc < 16)
		nc = 16;
	nc = seg_slots_fit(nc);
	struct seg *s = kvr_realloc(lru->s, (size_t)lru->s_cap * sizeof(*s), nc * sizeof(*s));
	if (!s)
		return KVR_ENOMEM;
	for (size_t i = nc; i-- > lru->s_cap;) {
		s[i].len = 0;
		s[i].unused = 1;
		s[i].next = lru->free_head;
		lru->free_head = (uint32_t)i;
	}
	lru->s = s;
	lru->s_cap = (uint32_t)nc;
	return 0;
}

/* Upper bound on evictions a command can cause when it adds `added` resident blocks. */
size_t kvr_lru_eviction_bound(const struct kvr_lru *lru, uint64_t added)
{
	uint64_t resident = lru->copies + lru->n_phantom + lru->priv + added;
	if (resident <= lru->capacity)
		return 0;
	uint64_t over = resident - lru->capacity;
	uint64_t inact = lru->n_inactive + added;
	return (size_t)(over < inact ? over : inact);
}

/* ------------------------------------------------------------------ segments */

uint32_t kvr_lru_seg_new(struct kvr_lru *lru)
{
	uint32_t i = lru->free_head;
	struct seg *g = &lru->s[i];
	lru->free_head = g->next;
	lru->s_live++;
	memset(g, 0, sizeof(*g));
	g->prev = g->next = g->snext = NIL;
	return i;
}

static void seg_free(struct kvr_lru *lru, uint32_t i)
{
	struct seg *g = &lru->s[i];
	g->len = 0; /* its hashes are garbage in the heap until it is compacted */
	g->unused = 1;
	g->next = lru->free_head;
	lru->free_head = i;
	lru->s_live--;
}

/* Head multimap: lru->heads maps a head hash to its first segment, lru->hnext each segment of a
 * multimap chain to the next (only duplicate copies make chains longer than one). */
int kvr_lru_reserve_head(struct kvr_lru *lru, size_t n)
{
	int rc = kvr_lru_heads_reserve(lru, n);
	return rc ? rc : kvr_u64map_reserve(&lru->hnext, n);
}

static void set_hnext(struct kvr_lru *lru, uint32_t i, uint32_t next)
{
	struct seg *g = &lru->s[i];
	if (next == NIL) {
		if (g->has_hnext)
			kvr_u64map_remove(&lru->hnext, i);
		g->has_hnext = 0;
	} else if (g->has_hnext) {
		*kvr_u64map_find(&lru->hnext, i) = next;
	} else {
		kvr_u64map_insert(&lru->hnext, i, next);
		g->has_hnext = 1;
	}
}

void kvr_lru_head_add(struct kvr_lru *lru, uint32_t i)
{
	uint64_t h = seq_of(lru, &lru->s[i])[0];
	uint32_t *v = kvr_lru_heads_find(lru, h);
	if (v) {
		uint32_t first = *v;
		*v = i;
		set_hnext(lru, i, first);
	} else {
		set_hnext(lru, i, NIL);
		kvr_lru_heads_insert(lru, h, i);
	}
}

static void head_del(struct kvr_lru *lru, uint32_t i)
{
	uint64_t h = seq_of(lru, &lru->s[i])[0];
	uint32_t *v = kvr_lru_heads_find(lru, h);
	uint32_t after = kvr_lru_hnext(lru, i);
	set_hnext(lru, i, NIL);
	if (*v == i) {
		if (after == NIL)
			kvr_lru_heads_remove(lru, h);
		else
			*v = after;
		return;
	}
	uint32_t t = *v;
	while (kvr_lru_hnext(lru, t) != i)
		t = kvr_lru_hnext(lru, t);
	set_hnext(lru, t, after);
}

void kvr_lru_inact_unlink(struct kvr_lru *lru, uint32_t i)
{
	struct seg *g = &lru->s[i];
	if (g->prev != NIL)
		lru->s[g->prev].next = g->next;
	else
		lru->inact_head = g->next;
	if (g->next != NIL)
		lru->s[g->next].prev = g->prev;
	else
		lru->inact_tail = g->prev;
	g->inactive = 0;
	lru->n_inactive -= g->len;
}

void kvr_lru_inact_append(struct kvr_lru *lru, uint32_t i)
{
	struct seg *g = &lru->s[i];
	g->next = NIL;
	g->prev = lru->inact_tail;
	if (lru->inact_tail != NIL)
		lru->s[lru->inact_tail].next = i;
	else
		lru->inact_head = i;
	lru->inact_tail = i;
	g->inactive = 1;
	g->order = ++lru->order_seq;
	lru->n_inactive += g->len;
}

/*
 * Splits segment i before offset off (0 < off < len): i keeps [0, off); a new segment gets
 * [off, len) with the same refcount and stamp, joins the split chain right after i and, if i is
 * inactive, takes the place just before i in the inactive list (it is deeper: it goes first).
 * The hashes stay where they are in the heap: the new segment's start at i's old offset + off.
 * No observable change.  0, KVR_ERANGE or KVR_ENOMEM (nothing changed).
 */
int kvr_lru_split(struct kvr_lru *lru, uint32_t i, uint32_t off)
{
	int rc;
	if ((rc = kvr_lru_reserve_segs(lru, 1)) || (rc = kvr_lru_reserve_head(lru, 1)))
		return rc;
	uint32_t j = kvr_lru_seg_new(lru);
	struct seg *a = &lru->s[i], *b = &lru->s[j];
	uint32_t rest = a->len - off;
	b->off = a->off + off;
	a->len = off;
	b->len = rest;
	b->stamp = a->stamp;
	b->depth = a->depth + off;
	if (a->inactive)
		b->order = a->order;
	else
		b->refs = a->refs;
	b->snext = a->snext;
	a->snext = j;
	if (a->inactive) {
		b->inactive = 1;
		b->next = i;
		b->prev = a->prev;
		if (a->prev != NIL)
			lru->s[a->prev].next = j;
		else
			lru->inact_head = j;
		a->prev = j;
	}
	kvr_lru_head_add(lru, j);
	return 0;
}

/* Drops an emptied inactive segment from every structure (a split-chain link that names it
 * lies outside every piece: it is never followed, see struct seg). */
void kvr_lru_seg_drop(struct kvr_lru *lru, uint32_t i)
{
	kvr_lru_inact_unlink(lru, i);
	head_del(lru, i);
	seg_free(lru, i);
}

/* ------------------------------------------------------------------ phantoms */

/*
 * Released private blocks (keep_private, see lru.c) hold pool slots in the inactive order but
 * are never hit, split or reported: all they have is a place in the order and a count.  They
 * were one-block segments on the inactive list, a 56-byte record each (bench_footprint at 2k
 * prompts: 576 of a rank's 1,822 live segments, 1.2 B per (block, rank) pair).  Now a release
 * appends (order, len) to a FIFO ring, 16 B an entry.  The entry's order is the release's first
 * (order_seq is shared with the list, and no segment gets it), the list is sorted by order, and
 * phantoms leave only from the front, so the oldest of the ring head and the list head (by
 * order) is exactly what the single list would have at its head.  n_inactive counts phantom
 * blocks too, as it did.  The ring doubles when full and halves under a quarter used.
 */
static int phantoms_resize(struct kvr_lru *lru, uint32_t nc)
{
	struct phantom *q = kvr_alloc((size_t)nc * sizeof(*q));
	if (!q)
		return KVR_ENOMEM;
	for (uint32_t k = 0; k < lru->ph_n; k++)
		q[k] = lru->ph[(lru->ph_head + k) % lru->ph_cap];
	kvr_free(lru->ph, (size_t)lru->ph_cap * sizeof(*q));
	lru->ph = q;
	lru->ph_cap = nc;
	lru->ph_head = 0;
	return 0;
}

int kvr_lru_reserve_phantom(struct kvr_lru *lru)
{
	if (lru->ph_n < lru->ph_cap)
		return 0;
	if (lru->ph_cap >= NIL / 2)
		return KVR_ERANGE;
	return phantoms_resize(lru, lru->ph_cap ? lru->ph_cap * 2 : 16);
}

void kvr_lru_phantom_push(struct kvr_lru *lru, uint32_t len)
{
	struct phantom *p = &lru->ph[(lru->ph_head + lru->ph_n++) % lru->ph_cap];
	p->order = ++lru->order_seq;
	p->len = len;
	p->unused = 0;
	lru->n_phantom += len;
	lru->n_inactive += len;
}

void kvr_lru_phantom_evict(struct kvr_lru *lru, uint32_t m)
{
	struct phantom *p = &lru->ph[lru->ph_head];
	lru->n_phantom -= m;
	lru->n_inactive -= m;
	p->len -= m;
	if (p->len == 0) {
		lru->ph_head = (lru->ph_head + 1) % lru->ph_cap;
		lru->ph_n--;
	}
}

/* ------------------------------------------------------------------ giving slots back */

/* Moves live segment j to free slot i: every index that names it (list neighbours, the head
 * multimap) is redirected.  The leases' pieces and the split-chain links inside them are
 * redirected by the caller (s[j].next = i). */
static void seg_move(struct kvr_lru *lru, uint32_t j, uint32_t i)
{
	struct seg *s = lru->s, *g = &s[j];
	if (g->inactive) {
		if (g->prev != NIL)
			s[g->prev].next = i;
		else
			lru->inact_head = i;
		if (g->next != NIL)
			s[g->next].prev = i;
		else
			lru->inact_tail = i;
	}
	uint32_t *v = kvr_lru_heads_find(lru, seq_of(lru, g)[0]);
	if (*v == j) {
		*v = i;
	} else {
		uint32_t t = *v;
		while (kvr_lru_hnext(lru, t) != j)
			t = kvr_lru_hnext(lru, t);
		*kvr_u64map_find(&lru->hnext, t) = i;
	}
	if (g->has_hnext) {
		uint32_t after = *kvr_u64map_find(&lru->hnext, j);
		kvr_u64map_remove(&lru->hnext, j);
		kvr_u64map_insert(&lru->hnext, i, after); /* a slot was just freed */
	}
	s[i] = *g;
	g->next = i; /* forwarding address, for the leases */
}

/*
 * When fewer than two thirds of the slots are in use, the array shrinks to a quarter more than that
 * use (what its size class holds, 64 slots at least): the live segments above the new end move down
 * to free slots, the leases' pieces that name them are redirected, and the free list is rebuilt
 * from what stays.  O(slots + lease pieces) in that call; amortized O(1) per segment freed or
 * added, since the use changed by at least a sixth of it since the array last changed size (it
 * grows by a quarter when full, to 0.8x use; shrinks to 1.25x the use when that is under two
 * thirds).  bench_footprint at 2k prompts ended with 1,822 live segments in 2,925 slots with a
 * threshold of one half. The head map, which only grows on inserts, halves when under 30 % full (it
 * doubles at 70 %): at the same point it held 1,246 heads in 4,096 slots (2.6 B per copy). No
 * observable change: indices order nothing (ties between copies are broken by stamps, and eviction
 * follows the list).  The new array is allocated first, so no memory means no change.
 */
void kvr_lru_settle(struct kvr_lru *lru)
{
	kvr_lru_heap_settle(lru);
	kvr_lru_heads_settle(lru);
	if (lru->ph_cap > 16 && (size_t)lru->ph_n * 4 < lru->ph_cap)
		(void)phantoms_resize(lru, lru->ph_cap / 2);
	size_t used = (size_t)lru->s_live + 1;
	if (lru->s_cap < 64 || used * 3 >= (size_t)lru->s_cap * 2)
		return;
	size_t want = used + used / 4 > 64 ? used + used / 4 : 64;
	uint32_t nc = (uint32_t)seg_slots_fit(want);
	if (nc >= lru->s_cap)
		return;
	struct seg *ns = kvr_alloc((size_t)nc * sizeof(*ns));
	if (!ns)
		return;
	/* The free slots below the new end, in free-list order. */
	uint32_t low = NIL, *tail = &low;
	for (uint32_t i = lru->free_head; i != NIL; i = lru->s[i].next)
		if (i < nc) {
			*tail = i;
			tail = &lru->s[i].next;
		}
	*tail = NIL;
	for (uint32_t j = nc; j < lru->s_cap; j++) {
		if (lru->s[j].unused)
			continue;
		uint32_t i = low;
		low = lru->s[i].next;
		seg_move(lru, j, i);
	}
	/* The pieces, and the split chain inside each (a link outside a piece is never followed:
	 * see struct seg). */
	for (uint32_t l = 0; l < lru->n_leases; l++) {
		struct lease *le = &lru->leases[l];
		for (uint32_t p = 0; p < le->n; p++) {
			struct piece *pc = &le->p[p];
			if (pc->seg >= nc)
				pc->seg = lru->s[pc->seg].next;
			uint32_t i = pc->seg, left = pc->len;
			while (left > lru->s[i].len) {
				left -= lru->s[i].len;
				if (lru->s[i].snext >= nc)
					lru->s[i].snext = lru->s[lru->s[i].snext].next;
				i = lru->s[i].snext;
			}
		}
	}
	memcpy(ns, lru->s, (size_t)nc * sizeof(*ns));
	kvr_free(lru->s, (size_t)lru->s_cap * sizeof(*ns));
	lru->s = ns;
	lru->s_cap = nc;
	lru->free_head = low;
}

/* ------------------------------------------------------------------ eviction */

/* Evicts the m deepest copies of inactive segment i (its tail).  Hashes whose last copy goes
 * are emitted as runs, deeper runs first, each in chain order.  Room in out (m hashes and
 * runs) must be reserved. */
void kvr_lru_trim(struct kvr_lru *lru, uint32_t i, uint32_t m, struct kvr_lru_out *out)
{
	struct seg *g = &lru->s[i];
	uint64_t *q = seq_of(lru, g);
	uint32_t len = g->len, lo = len - m;
	kvr_lru_hashes_gone(lru, g, m);
	if (lru->dups.count == 0) {
		kvr_lru_out_evicted_run(out, q + lo, m);
		for (uint32_t j = len; lru->gh.cap && j-- > lo;)
			kvr_lru_ghost_push(lru, q[j]); /* deepest first: the eviction order */
	} else {
		uint32_t end = len;
		for (uint32_t j = len; j-- > lo;) {
			uint32_t *d = kvr_u64map_find(&lru->dups, q[j]);
			if (!d) {
				kvr_lru_ghost_push(lru, q[j]);
				continue;
			}
			/* Not the last copy: the deeper group goes out first. */
			kvr_lru_out_evicted_run(out, q + j + 1, end - j - 1);
			end = j;
			if (--*d == 0)
				kvr_u64map_remove(&lru->dups, q[j]);
			lru->dup_extra--;
		}
		kvr_lru_out_evicted_run(out, q + lo, end - lo);
	}
	lru->copies -= m;
	lru->evictions += m;
	if (m == len) {
		kvr_lru_seg_drop(lru, i);
		return;
	}
	g->len -= m;
	lru->n_inactive -= m;
}

/* Evicts from the head of the inactive list until resident <= limit or nothing is inactive. */
void kvr_lru_evict_to(struct kvr_lru *lru, uint64_t limit, struct kvr_lru_out *out)
{
	for (;;) {
		uint64_t resident = lru->copies + lru->n_phantom + lru->priv;
		if (resident <= limit)
			return;
		uint64_t over = resident - limit;
		struct phantom *p = kvr_lru_phantom_next(lru);
		if (p) {
			kvr_lru_phantom_evict(lru, over < p->len ? (uint32_t)over : p->len);
			continue;
		}
		uint32_t i = lru->inact_head;
		if (i == NIL)
			return;
		struct seg *g = &lru->s[i];
		kvr_lru_trim(lru, i, over < g->len ? (uint32_t)over : g->len, out);
	}
}

void kvr_lru_reconcile(struct kvr_lru *lru, struct kvr_lru_out *out)
{
	kvr_lru_evict_to(lru, lru->capacity, out);
	kvr_lru_settle(lru);
}
