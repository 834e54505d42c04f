/*
 * tests/ref/lru_ref.c - the per-block approximate LRU: the ORACLE of test_lru_diff and the
 * baseline of perf/bench_lru.  This was shards/lru.c until the LRU was rebuilt around segments
 * of consecutive copies (issue 11 item 3); kept here unchanged in behaviour (one struct copy
 * per block, one hash-map entry per hash, per-block eviction), with its functions renamed
 * ref_lru_*.  It shares struct kvr_lru_out and its helpers with shards/lru.c.
 *
 * Original essay follows.
 *
 * The idea.  vLLM's block pool reference-counts physical blocks.  A finished request frees its
 * blocks tail first into a free queue; a prefix-cache hit pulls a block back out; allocation
 * evicts from the queue's head.  So the eviction order is: least recently released first, and
 * within one release the deepest block first.  One hash can live in several physical copies
 * (two requests computed the same block at once, or a request diverged and re-computed).  We
 * mirror that per rank, from routing decisions alone.
 *
 * Data structures (all owned by one shard thread):
 *  - copies: a slab (array of struct copy, indices stable, free slots on a free list); a copy
 *    is 48 bytes.  Copy ids come from a 64-bit counter and break ties in the eviction order.
 *  - copies by hash: shards/u64map.h, seq -> first copy; the copies of one hash form a singly
 *    linked chain in creation order (chains are almost always length 1, so walking is cheap).
 *  - the inactive set ordered by (release epoch asc, position desc, copy id asc).  We do NOT need
 *    a general ordered tree: a copy enters the set only at a release, stamped with that release's
 *    epoch, which is larger than every epoch already in the set.  So the set is a doubly linked
 *    list in exact order: a release sorts just the copies it frees by (position desc, id asc)
 *    and appends them at the tail; a cache hit unlinks in O(1); eviction pops the head.
 *    Cost: O(k log k) per release of k copies (O(k) in the usual, already ordered case), O(1)
 *    per hit and per eviction.  The epoch itself therefore need not be stored in a copy: its
 *    place in the list is its epoch (the rank keeps only the epoch counter, for stats).
 *  - leases: a dense array (swap-remove) indexed through a u64map attempt -> index; each lease
 *    holds the slab indices of its copies (a hit on the same copy twice appears twice).
 *
 * Invariants: a copy is in the inactive list iff refs == 0; sum of refs == total lease entries;
 * resident = copies + private; after every command, resident > capacity implies the inactive
 * list is empty (over-capacity made of active blocks is tolerated until releases).
 *
 * Released private blocks (ref_lru_set_keep_private).  A request's partial, unhashed tail
 * block occupies a pool slot too.  In the reference model it simply disappears at
 * release, so its slot is free at once.  vLLM does not free it that way: the block goes to the
 * free queue with the request's other blocks (tail first, so ahead of them), and a new
 * allocation pops the queue head, which evicts older cached blocks before it ever reaches that
 * unhashed one.  With keep_private on, a release turns each private block into a "phantom"
 * copy: unhashed, inactive, deepest of its release; evicting it emits nothing.  The router runs
 * in this mode (measured: it makes the serial replay exact under eviction with partial blocks);
 * the reference lifecycle test runs in the default mode, as the issue writes it.
 *
 * Failure model: each command first reserves everything it may need (slab slots, map room,
 * lease arrays, output room, sort scratch), then mutates without failing.  In keep_private mode
 * the slab always has room for every live private block to become a phantom, so a release never
 * allocates.
 */
#include "lru_ref.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/u64map.h"

#define NIL UINT32_MAX

struct copy {
	uint64_t seq;
	uint64_t local;
	uint64_t id; /* creation order, unique per rank */
	uint32_t refs;
	uint32_t pos;        /* position in the sequence of its latest holder */
	uint32_t phantom;    /* 1: a released private block (unhashed, never hit) */
	uint32_t hnext;      /* next copy of the same hash, or the free list */
	uint32_t prev, next; /* inactive list */
};

struct lease {
	uint64_t attempt;
	uint32_t *copies;
	uint32_t n, cap;
	uint32_t priv;
};

struct ref_lru {
	uint64_t capacity;
	struct copy *c;
	uint32_t c_cap, c_live, free_head;
	uint32_t inact_head, inact_tail;
	uint64_t n_inactive, priv, evictions, epoch, next_id;
	uint64_t n_phantom;
	bool keep_private;
	struct kvr_u64map by_hash;
	struct lease *leases;
	uint32_t n_leases, leases_cap;
	struct kvr_u64map by_attempt;
	uint32_t *scratch; /* release sort buffer, >= the longest lease */
	size_t scratch_cap;
};

/* ------------------------------------------------------------------ create / destroy */

int ref_lru_create(uint64_t capacity_blocks, struct ref_lru **out)
{
	if (!out)
		return KVR_EINVAL;
	struct ref_lru *lru = kvr_calloc(1, sizeof(*lru));
	if (!lru)
		return KVR_ENOMEM;
	lru->capacity = capacity_blocks;
	lru->free_head = NIL;
	lru->inact_head = lru->inact_tail = NIL;
	lru->next_id = 1;
	kvr_u64map_init(&lru->by_hash);
	kvr_u64map_init(&lru->by_attempt);
	*out = lru;
	return 0;
}

void ref_lru_destroy(struct ref_lru *lru)
{
	if (!lru)
		return;
	for (uint32_t i = 0; i < lru->n_leases; i++)
		kvr_free(lru->leases[i].copies, lru->leases[i].cap * sizeof(uint32_t));
	kvr_free(lru->leases, lru->leases_cap * sizeof(struct lease));
	kvr_free(lru->c, (size_t)lru->c_cap * sizeof(struct copy));
	kvr_free(lru->scratch, lru->scratch_cap * sizeof(uint32_t));
	kvr_u64map_fini(&lru->by_hash);
	kvr_u64map_fini(&lru->by_attempt);
	kvr_free(lru, sizeof(*lru));
}

/* ------------------------------------------------------------------ reservations */

static int reserve_copies(struct ref_lru *lru, size_t n)
{
	if ((size_t)lru->c_live + n >= NIL)
		return KVR_ERANGE;
	if ((size_t)lru->c_live + n <= lru->c_cap)
		return 0;
	/* 1.5x: the slab dominates memory per copy, and a full LRU needs capacity + one
	 * request, so doubling would leave half of it idle. */
	size_t nc = (size_t)lru->c_cap + lru->c_cap / 2;
	if (nc < (size_t)lru->c_live + n)
		nc = (size_t)lru->c_live + n;
	if (nc < 64)
		nc = 64;
	if (nc >= NIL)
		nc = NIL - 1;
	struct copy *c = kvr_realloc(lru->c, (size_t)lru->c_cap * sizeof(*c), nc * sizeof(*c));
	if (!c)
		return KVR_ENOMEM;
	/* New slots go on the free list, lowest index first. */
	for (size_t i = nc; i-- > lru->c_cap;) {
		c[i].hnext = lru->free_head;
		lru->free_head = (uint32_t)i;
	}
	lru->c = c;
	lru->c_cap = (uint32_t)nc;
	return 0;
}

static int reserve_scratch(struct ref_lru *lru, size_t n)
{
	if (n <= lru->scratch_cap)
		return 0;
	size_t nc = lru->scratch_cap * 2 > n ? lru->scratch_cap * 2 : n;
	uint32_t *s =
	    kvr_realloc(lru->scratch, lru->scratch_cap * sizeof(uint32_t), nc * sizeof(uint32_t));
	if (!s)
		return KVR_ENOMEM;
	lru->scratch = s;
	lru->scratch_cap = nc;
	return 0;
}

static int reserve_lease_copies(struct lease *l, size_t n)
{
	if ((size_t)l->n + n <= l->cap)
		return 0;
	if ((size_t)l->n + n >= NIL)
		return KVR_ERANGE;
	size_t nc = (size_t)l->cap * 2;
	if (nc < (size_t)l->n + n)
		nc = (size_t)l->n + n;
	if (nc < 8)
		nc = 8;
	uint32_t *p = kvr_realloc(l->copies, l->cap * sizeof(uint32_t), nc * sizeof(uint32_t));
	if (!p)
		return KVR_ENOMEM;
	l->copies = p;
	l->cap = (uint32_t)nc;
	return 0;
}

/* Upper bound on evictions a command can cause when it adds `added` resident blocks. */
static size_t eviction_bound(const struct ref_lru *lru, uint64_t added)
{
	uint64_t resident = lru->c_live + lru->priv + added;
	if (resident <= lru->capacity)
		return 0;
	uint64_t over = resident - lru->capacity;
	uint64_t inact = lru->n_inactive + added;
	return (size_t)(over < inact ? over : inact);
}

/* ------------------------------------------------------------------ core moves */

static void inactive_unlink(struct ref_lru *lru, uint32_t i)
{
	struct copy *c = &lru->c[i];
	if (c->prev != NIL)
		lru->c[c->prev].next = c->next;
	else
		lru->inact_head = c->next;
	if (c->next != NIL)
		lru->c[c->next].prev = c->prev;
	else
		lru->inact_tail = c->prev;
	lru->n_inactive--;
}

static void inactive_append(struct ref_lru *lru, uint32_t i)
{
	struct copy *c = &lru->c[i];
	c->next = NIL;
	c->prev = lru->inact_tail;
	if (lru->inact_tail != NIL)
		lru->c[lru->inact_tail].next = i;
	else
		lru->inact_head = i;
	lru->inact_tail = i;
	lru->n_inactive++;
}

/* A new copy (refs 1) of b at pos; reports the hash as stored if it was absent.
 * Room in the slab, the map and out must be reserved. */
static uint32_t new_copy(struct ref_lru *lru, const struct kvr_lru_block *b, uint32_t pos,
                         uint32_t input, struct kvr_lru_out *out)
{
	uint32_t i = lru->free_head;
	struct copy *c = &lru->c[i];
	lru->free_head = c->hnext;
	lru->c_live++;
	c->seq = b->seq;
	c->local = b->local;
	c->id = lru->next_id++;
	c->refs = 1;
	c->pos = pos;
	c->phantom = 0;
	c->hnext = NIL;
	c->prev = c->next = NIL;
	uint32_t *head = kvr_u64map_find(&lru->by_hash, b->seq);
	if (!head) {
		kvr_u64map_insert(&lru->by_hash, b->seq, i);
		kvr_lru_out_stored(out, input, 1);
	} else {
		uint32_t t = *head;
		while (lru->c[t].hnext != NIL)
			t = lru->c[t].hnext;
		lru->c[t].hnext = i;
	}
	return i;
}

static void evict_one(struct ref_lru *lru, struct kvr_lru_out *out)
{
	uint32_t i = lru->inact_head;
	struct copy *c = &lru->c[i];
	inactive_unlink(lru, i);
	if (c->phantom) { /* an unhashed block reused: nothing to tell the index */
		c->hnext = lru->free_head;
		lru->free_head = i;
		lru->c_live--;
		lru->n_phantom--;
		return;
	}
	uint32_t *head = kvr_u64map_find(&lru->by_hash, c->seq);
	if (*head == i) {
		if (c->hnext == NIL) {
			kvr_u64map_remove(&lru->by_hash, c->seq);
			kvr_lru_out_evicted_run(out, &c->seq, 1);
		} else {
			*head = c->hnext;
		}
	} else {
		uint32_t t = *head;
		while (lru->c[t].hnext != i)
			t = lru->c[t].hnext;
		lru->c[t].hnext = c->hnext;
	}
	c->hnext = lru->free_head;
	lru->free_head = i;
	lru->c_live--;
	lru->evictions++;
}

static void reconcile(struct ref_lru *lru, struct kvr_lru_out *out)
{
	while (lru->c_live + lru->priv > lru->capacity && lru->inact_head != NIL)
		evict_one(lru, out);
}

static struct lease *find_lease(const struct ref_lru *lru, uint64_t attempt)
{
	uint32_t *ix = kvr_u64map_find(&lru->by_attempt, attempt);
	return ix ? &lru->leases[*ix] : NULL;
}

/* ------------------------------------------------------------------ commands */

int ref_lru_acquire(struct ref_lru *lru, uint64_t attempt, const struct kvr_lru_block *b, size_t n,
                    uint32_t private_blocks, struct kvr_lru_out *out)
{
	if (!lru || !out || (n > 0 && !b))
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	if (kvr_u64map_find(&lru->by_attempt, attempt))
		return KVR_EEXIST;
	if (n >= NIL)
		return KVR_ERANGE;
	int rc;
	size_t keep = lru->keep_private ? (size_t)lru->priv + private_blocks : 0;
	if ((rc = reserve_copies(lru, n + keep)) ||
	    (rc = reserve_scratch(lru, n + private_blocks)) ||
	    (rc = kvr_u64map_reserve(&lru->by_hash, n)) ||
	    (rc = kvr_u64map_reserve(&lru->by_attempt, 1)) ||
	    (rc = kvr_lru_out_reserve(out, n, eviction_bound(lru, n + private_blocks))))
		return rc;
	if (lru->n_leases == lru->leases_cap) {
		size_t nc = lru->leases_cap ? (size_t)lru->leases_cap * 2 : 16;
		struct lease *l =
		    kvr_realloc(lru->leases, lru->leases_cap * sizeof(*l), nc * sizeof(*l));
		if (!l)
			return KVR_ENOMEM;
		lru->leases = l;
		lru->leases_cap = (uint32_t)nc;
	}
	struct lease *l = &lru->leases[lru->n_leases];
	memset(l, 0, sizeof(*l));
	if ((rc = reserve_lease_copies(l, n)))
		return rc;
	/* From here on nothing fails. */
	l->attempt = attempt;
	l->priv = private_blocks;
	kvr_u64map_insert(&lru->by_attempt, attempt, lru->n_leases++);
	size_t i = 0;
	for (; i < n; i++) {
		uint32_t *head = kvr_u64map_find(&lru->by_hash, b[i].seq);
		if (!head)
			break;
		struct copy *c = &lru->c[*head];
		if (c->refs == 0)
			inactive_unlink(lru, *head);
		c->refs++;
		c->pos = (uint32_t)i;
		l->copies[l->n++] = *head;
	}
	for (; i < n; i++)
		l->copies[l->n++] = new_copy(lru, &b[i], (uint32_t)i, (uint32_t)i, out);
	lru->priv += private_blocks;
	reconcile(lru, out);
	return 0;
}

int ref_lru_materialize(struct ref_lru *lru, uint64_t attempt, uint64_t parent_seq,
                        const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                        uint32_t private_blocks, struct kvr_lru_out *out)
{
	if (!lru || !out || (n > 0 && !b))
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	struct lease *l = find_lease(lru, attempt);
	if (!l)
		return KVR_ENOENT;
	if (l->n > 0 && lru->c[l->copies[l->n - 1]].seq != parent_seq)
		return KVR_ENOENT;
	if (n >= NIL)
		return KVR_ERANGE;
	uint64_t added = n + (private_blocks > l->priv ? private_blocks - l->priv : 0);
	int rc;
	size_t keep = lru->keep_private ? (size_t)(lru->priv - l->priv) + private_blocks : 0;
	if ((rc = reserve_copies(lru, n + keep)) ||
	    (rc = reserve_scratch(lru, (size_t)l->n + n + private_blocks)) ||
	    (rc = kvr_u64map_reserve(&lru->by_hash, n)) || (rc = reserve_lease_copies(l, n)) ||
	    (rc = kvr_lru_out_reserve(out, n, eviction_bound(lru, added))))
		return rc;
	for (size_t i = 0; i < n; i++)
		l->copies[l->n++] = new_copy(lru, &b[i], start_pos + (uint32_t)i, (uint32_t)i, out);
	lru->priv = lru->priv - l->priv + private_blocks;
	l->priv = private_blocks;
	reconcile(lru, out);
	return 0;
}

/* Release order within one epoch: deepest position first, then lowest copy id. */
static bool release_before(const struct copy *x, const struct copy *y)
{
	return x->pos > y->pos || (x->pos == y->pos && x->id < y->id);
}

static int cmp_release(const void *a, const void *b, void *ctx)
{
	const struct copy *base = ctx;
	const struct copy *x = &base[*(const uint32_t *)a], *y = &base[*(const uint32_t *)b];
	return release_before(x, y) ? -1 : (release_before(y, x) ? 1 : 0);
}

int ref_lru_release(struct ref_lru *lru, uint64_t attempt, struct kvr_lru_out *out)
{
	if (!lru || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	uint32_t *ix = kvr_u64map_find(&lru->by_attempt, attempt);
	if (!ix)
		return KVR_ENOENT;
	uint32_t li = *ix;
	struct lease *l = &lru->leases[li];
	/* Releasing adds no block; evictions happen only if we were over capacity. */
	uint64_t resident = lru->c_live + lru->priv - l->priv;
	size_t bound = 0;
	if (resident > lru->capacity) {
		uint64_t over = resident - lru->capacity, inact = lru->n_inactive + l->n;
		bound = (size_t)(over < inact ? over : inact);
	}
	int rc = kvr_lru_out_reserve(out, 0, bound);
	if (rc)
		return rc;
	lru->epoch++;
	lru->priv -= l->priv;
	size_t k = 0;
	bool sorted = true;
	/* keep_private: the private blocks stay as phantoms, deepest of this release (room in the
	 * slab and the scratch was reserved when they were taken). */
	for (uint32_t p = 0; lru->keep_private && p < l->priv; p++) {
		uint32_t i = lru->free_head;
		struct copy *c = &lru->c[i];
		lru->free_head = c->hnext;
		lru->c_live++;
		lru->n_phantom++;
		memset(c, 0, sizeof(*c));
		c->phantom = 1;
		c->id = lru->next_id++;
		c->pos = UINT32_MAX - p;
		c->hnext = NIL;
		lru->scratch[k++] = i;
	}
	/* Walk the lease backwards: prompt and output blocks were appended in position order, so
	 * the freed copies usually come out already sorted deepest first. */
	for (uint32_t j = l->n; j-- > 0;) {
		struct copy *c = &lru->c[l->copies[j]];
		if (--c->refs == 0) {
			if (k > 0 && !release_before(&lru->c[lru->scratch[k - 1]], c))
				sorted = false;
			lru->scratch[k++] = l->copies[j];
		}
	}
	if (!sorted)
		qsort_r(lru->scratch, k, sizeof(uint32_t), cmp_release, lru->c);
	for (size_t a = 0; a < k; a++)
		inactive_append(lru, lru->scratch[a]);
	/* Remove the lease: swap the last one into its slot. */
	kvr_free(l->copies, l->cap * sizeof(uint32_t));
	kvr_u64map_remove(&lru->by_attempt, attempt);
	uint32_t last = --lru->n_leases;
	if (li != last) {
		lru->leases[li] = lru->leases[last];
		*kvr_u64map_find(&lru->by_attempt, lru->leases[li].attempt) = li;
	}
	reconcile(lru, out);
	return 0;
}

int ref_lru_set_capacity(struct ref_lru *lru, uint64_t capacity, struct kvr_lru_out *out)
{
	if (!lru || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	uint64_t old = lru->capacity;
	lru->capacity = capacity;
	int rc = kvr_lru_out_reserve(out, 0, eviction_bound(lru, 0));
	if (rc) {
		lru->capacity = old;
		return rc;
	}
	reconcile(lru, out);
	return 0;
}

size_t ref_lru_overlap(const struct ref_lru *lru, const uint64_t *seq, size_t n)
{
	if (!lru || !seq)
		return 0;
	size_t i = 0;
	while (i < n && kvr_u64map_find(&lru->by_hash, seq[i]))
		i++;
	return i;
}

void ref_lru_set_keep_private(struct ref_lru *lru, bool on)
{
	if (lru && lru->c_live == 0 && lru->priv == 0)
		lru->keep_private = on;
}

bool ref_lru_has_lease(const struct ref_lru *lru, uint64_t attempt)
{
	return lru && kvr_u64map_find(&lru->by_attempt, attempt) != NULL;
}

void ref_lru_stats(const struct ref_lru *lru, struct kvr_lru_stats *st)
{
	memset(st, 0, sizeof(*st));
	if (!lru)
		return;
	st->capacity = lru->capacity;
	st->copies = lru->c_live - lru->n_phantom;
	st->phantoms = lru->n_phantom;
	st->private_blocks = lru->priv;
	st->resident = lru->c_live + lru->priv;
	st->hashes = lru->by_hash.count;
	st->inactive = lru->n_inactive;
	st->leases = lru->n_leases;
	st->evictions = lru->evictions;
	st->epoch = lru->epoch;
}

double ref_lru_bytes_per_copy(const struct ref_lru *lru)
{
	if (!lru || lru->c_live == 0)
		return 0;
	/* Slab slot + this copy's share of the hash table + one lease entry if held. */
	double bytes = (double)lru->c_cap * sizeof(struct copy) +
	               (double)lru->by_hash.cap * sizeof(struct kvr_u64map_slot);
	for (uint32_t i = 0; i < lru->n_leases; i++)
		bytes += (double)lru->leases[i].cap * sizeof(uint32_t);
	return bytes / (double)lru->c_live;
}

size_t ref_lru_hashes(const struct ref_lru *lru, uint64_t *out, size_t cap)
{
	size_t n = 0;
	for (size_t i = 0; i < lru->by_hash.cap; i++)
		if (lru->by_hash.slots[i].val != KVR_U64MAP_EMPTY) {
			if (n < cap)
				out[n] = lru->by_hash.slots[i].key;
			n++;
		}
	return n;
}
