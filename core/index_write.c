/*
 * core/index_write.c - the index's writer side: stored, removed, cleared events.
 *
 * Every call runs inside the RCU read lock it takes itself (so nodes other writers unlink stay
 * valid while this one looks at them) and ends with one deferred free for what it unlinked.
 * Per node, the spinlock in the node's lock word serialises rank-set changes and death; rank
 * sets are copy-on-write so readers see either the old or the new set, never a half-edited one.
 * The per-rank ext map is touched only by the slot's writer thread, so it has no lock at all.
 * Design essay and invariants: core/index.c.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/index_internal.h"
#include "kvrouter.h"

/* ---------------------------------------------------------------- per-rank ext map */

#define XMAP_MIN 16

static inline uint64_t xhome(const struct idx_xmap *m, uint64_t ext)
{
	uint64_t h = ext * 0x9e3779b97f4a7c15ull;
	return (h ^ (h >> 32)) & m->mask;
}

static size_t xbytes(uint64_t mask)
{
	return (size_t)(mask + 1) * sizeof(struct idx_xent);
}

/* Returns ext's node, or NULL with *hole = the empty entry that ended the probe (where
 * xmap_put() would put ext; UINT64_MAX without an array). */
static struct idx_node *xmap_find_hole(const struct idx_xmap *m, uint64_t ext, uint64_t *hole)
{
	*hole = UINT64_MAX;
	if (!m->e)
		return NULL;
	for (uint64_t i = xhome(m, ext);; i = (i + 1) & m->mask) {
		if (!m->e[i].node) {
			*hole = i;
			return NULL;
		}
		if (m->e[i].ext == ext)
			return m->e[i].node;
	}
}

static struct idx_xent *xmap_entry(const struct idx_xmap *m, uint64_t ext)
{
	if (!m->e)
		return NULL;
	for (uint64_t i = xhome(m, ext);; i = (i + 1) & m->mask) {
		if (!m->e[i].node)
			return NULL;
		if (m->e[i].ext == ext)
			return &m->e[i];
	}
}

static struct idx_node *xmap_find(const struct idx_xmap *m, uint64_t ext)
{
	uint64_t hole;
	return xmap_find_hole(m, ext, &hole);
}

static void xmap_put(struct idx_xmap *m, uint64_t ext, struct idx_node *n)
{
	uint64_t i = xhome(m, ext);
	while (m->e[i].node)
		i = (i + 1) & m->mask;
	m->e[i].ext = ext;
	m->e[i].node = n;
	m->e[i].extra = 0;
	m->count++;
}

static int xmap_resize(struct kvr_index *idx, struct idx_xmap *m, uint64_t cap)
{
	struct idx_xmap nm = {.mask = cap - 1};
	nm.e = kvr_calloc(cap, sizeof(struct idx_xent));
	if (!nm.e)
		return KVR_ENOMEM;
	if (m->e) {
		for (uint64_t i = 0; i <= m->mask; i++)
			if (m->e[i].node) {
				xmap_put(&nm, m->e[i].ext, m->e[i].node);
				xmap_entry(&nm, m->e[i].ext)->extra = m->e[i].extra;
			}
		kvr_free(m->e, xbytes(m->mask));
		idx_count(&idx->bytes_rank, -(int64_t)xbytes(m->mask));
	}
	idx_count(&idx->bytes_rank, (int64_t)xbytes(nm.mask));
	*m = nm;
	return 0;
}

/* Makes room for `extra` more entries at load <= 0.8.  Returns 0 or KVR_ENOMEM. */
static int xmap_reserve(struct kvr_index *idx, struct idx_xmap *m, uint64_t extra)
{
	uint64_t need = m->count + extra;
	uint64_t cap = m->e ? m->mask + 1 : 0;
	if (need * 5 <= cap * 4)
		return 0;
	uint64_t ncap = cap ? cap : XMAP_MIN;
	while (need * 5 > ncap * 4)
		ncap <<= 1;
	return xmap_resize(idx, m, ncap);
}

/* Removes ext; returns its node or NULL.  Backward-shift deletion keeps probes short. */
static struct idx_node *xmap_del(struct idx_xmap *m, uint64_t ext)
{
	if (!m->e)
		return NULL;
	uint64_t i = xhome(m, ext);
	for (;; i = (i + 1) & m->mask) {
		if (!m->e[i].node)
			return NULL;
		if (m->e[i].ext == ext)
			break;
	}
	struct idx_node *n = m->e[i].node;
	m->e[i].node = NULL;
	m->count--;
	for (uint64_t j = (i + 1) & m->mask; m->e[j].node; j = (j + 1) & m->mask) {
		uint64_t k = xhome(m, m->e[j].ext);
		/* Move e[j] into the hole at i unless its home lies cyclically in (i, j], i.e.
		 * when it sits at least as far from its home as from the hole. */
		if (((j - k) & m->mask) >= ((j - i) & m->mask)) {
			m->e[i] = m->e[j];
			m->e[j].node = NULL;
			i = j;
		}
	}
	return n;
}

static void xmap_shrink(struct kvr_index *idx, struct idx_xmap *m)
{
	if (!m->e)
		return;
	if (m->count == 0) {
		kvr_free(m->e, xbytes(m->mask));
		idx_count(&idx->bytes_rank, -(int64_t)xbytes(m->mask));
		memset(m, 0, sizeof(*m));
		return;
	}
	uint64_t cap = m->mask + 1;
	if (cap <= XMAP_MIN || m->count * 8 >= cap)
		return;
	uint64_t ncap = XMAP_MIN;
	while (m->count * 5 > ncap * 2) /* land at load <= 0.4 */
		ncap <<= 1;
	(void)xmap_resize(idx, m, ncap); /* on failure keep the big one */
}

/* ---------------------------------------------------------------- rank sets */

static inline struct idx_rset *rset_of(uintptr_t v)
{
	return (struct idx_rset *)v;
}

static struct idx_rset *rset_new(struct kvr_index *idx, uint32_t cap)
{
	struct idx_rset *r = kvr_alloc(idx_bytes_rset(cap));
	if (r) {
		r->cap = cap;
		r->n = 0;
		r->next_free = NULL;
		idx_count(&idx->bytes_rank, (int64_t)idx_bytes_rset(cap));
	}
	return r;
}

static void retire_ranks(uintptr_t v, struct idx_retire *rt)
{
	if (v && !(v & 1)) {
		struct idx_rset *r = rset_of(v);
		r->next_free = rt->sets;
		rt->sets = r;
		rt->n++;
	}
}

/* Adds slot s to node x.  Returns 0, 1 (already there) or KVR_ENOMEM.
 * Context: writer in a read section, holding x's lock.
 * Ordering: release publish of x->ranks; pairs with the acquire load in find_matches. */
static int rank_add(struct kvr_index *idx, struct idx_node *x, uint32_t s, struct idx_retire *rt)
{
	uintptr_t v = x->ranks, nv;
	if (v == 0) {
		nv = ((uintptr_t)s << 1) | 1;
	} else if (v & 1) {
		uint32_t t = (uint32_t)(v >> 1);
		if (t == s)
			return 1;
		struct idx_rset *r = rset_new(idx, 2);
		if (!r)
			return KVR_ENOMEM;
		r->slot[0] = t < s ? t : s;
		r->slot[1] = t < s ? s : t;
		r->n = 2;
		nv = (uintptr_t)r;
	} else {
		const struct idx_rset *o = rset_of(v);
		for (uint32_t i = 0; i < o->n; i++)
			if (o->slot[i] == s)
				return 1;
		struct idx_rset *r = rset_new(idx, o->n + 1);
		if (!r)
			return KVR_ENOMEM;
		uint32_t k = 0;
		bool put = false;
		for (uint32_t i = 0; i < o->n; i++) {
			uint32_t t = __atomic_load_n(&o->slot[i], __ATOMIC_RELAXED);
			if (!put && s < t) {
				r->slot[k++] = s;
				put = true;
			}
			if (k == 0 || r->slot[k - 1] != t) /* drop duplicates left by rank_del */
				r->slot[k++] = t;
		}
		if (!put)
			r->slot[k++] = s;
		r->n = k;
		nv = (uintptr_t)r;
	}
	__atomic_store_n(&x->ranks, nv, __ATOMIC_RELEASE);
	retire_ranks(v, rt);
	return 0;
}

/* Removes slot s from node x (no-op if absent).  Never fails: without memory for the smaller
 * copy it overwrites s in place with a neighbour's value (readers tolerate duplicates).
 * Context: writer in a read section, holding x's lock.  Ordering: as rank_add. */
static void rank_del(struct kvr_index *idx, struct idx_node *x, uint32_t s, struct idx_retire *rt)
{
	uintptr_t v = x->ranks, nv;
	if (v == 0)
		return;
	if (v & 1) {
		if ((uint32_t)(v >> 1) != s)
			return;
		nv = 0;
	} else {
		struct idx_rset *o = rset_of(v);
		uint32_t distinct = 0, other = 0, pos = UINT32_MAX;
		for (uint32_t i = 0; i < o->n; i++) {
			uint32_t t = o->slot[i];
			if (t == s) {
				if (pos == UINT32_MAX)
					pos = i;
				continue;
			}
			if (distinct == 0 || other != t)
				distinct++;
			other = t;
		}
		if (pos == UINT32_MAX)
			return;
		if (distinct == 0) {
			nv = 0;
		} else if (distinct == 1) {
			nv = ((uintptr_t)other << 1) | 1;
		} else {
			struct idx_rset *r = rset_new(idx, distinct);
			if (!r) {
				uint32_t fill = pos > 0 ? o->slot[pos - 1] : other;
				if (pos ==
				    0) /* first entries equal s: copy the first other value */
					for (uint32_t i = 0; i < o->n; i++)
						if (o->slot[i] != s) {
							fill = o->slot[i];
							break;
						}
				for (uint32_t i = 0; i < o->n; i++)
					if (o->slot[i] == s)
						__atomic_store_n(&o->slot[i], fill,
						                 __ATOMIC_RELAXED);
				return;
			}
			uint32_t k = 0;
			for (uint32_t i = 0; i < o->n; i++) {
				uint32_t t = o->slot[i];
				if (t != s && (k == 0 || r->slot[k - 1] != t))
					r->slot[k++] = t;
			}
			r->n = k;
			nv = (uintptr_t)r;
		}
	}
	__atomic_store_n(&x->ranks, nv, __ATOMIC_RELEASE);
	retire_ranks(v, rt);
}

/* ---------------------------------------------------------------- node life */

/* Marks x dead and unlinks it if it has no rank and no child.  Context: holding x's lock. */
static bool try_kill(struct kvr_index *idx, struct idx_node *x, struct idx_retire *rt)
{
	if (x->ranks != 0 || __atomic_load_n(&x->nchildren, __ATOMIC_ACQUIRE) != 0 ||
	    (__atomic_load_n(&x->lock, __ATOMIC_RELAXED) & IDX_DEAD))
		return false;
	__atomic_fetch_or(&x->lock, IDX_DEAD, __ATOMIC_RELAXED);
	kvr_index_table_delete(idx, x, rt);
	idx_count(&idx->c_nodes, -1);
	return true;
}

/* x just died (unlocked): retire it and walk up while parents become empty.
 * Ordering: the child count decrement is acq_rel; whoever takes it to zero re-checks the parent
 * under the parent's lock, which pairs with try_kill()'s check by a concurrent remover. */
static void cascade(struct kvr_index *idx, struct idx_node *x, struct idx_retire *rt)
{
	for (;;) {
		struct idx_node *p = x->parent;
		__atomic_store_n(&x->parent, rt->nodes, __ATOMIC_RELAXED);
		rt->nodes = x;
		rt->n++;
		if (p == &idx->root)
			return;
		if (__atomic_sub_fetch(&p->nchildren, 1, __ATOMIC_ACQ_REL) != 0)
			return;
		idx_lock(&p->lock);
		bool died = try_kill(idx, p, rt);
		idx_unlock(&p->lock);
		if (!died)
			return;
		x = p;
	}
}

/* Drops slot s from x, reclaiming what becomes empty.  Context: writer in a read section. */
static void drop_rank(struct kvr_index *idx, struct idx_node *x, uint32_t s, struct idx_retire *rt)
{
	idx_lock(&x->lock);
	rank_del(idx, x, s, rt);
	bool died = try_kill(idx, x, rt);
	idx_unlock(&x->lock);
	if (died)
		cascade(idx, x, rt);
}

/* Adds slot s to the child (p, seq), creating it.  *out = the child.  Returns 0, 1 (s already
 * held it) or KVR_ENOMEM.  Context: writer in a read section; p is live (held by s, or root). */
static int child_add(struct kvr_index *idx, struct idx_node *p, uint64_t seq, uint32_t s,
                     struct idx_retire *rt, struct idx_node **out)
{
	for (;;) {
		struct idx_node *x = idx_lookup(idx, p, seq);
		if (!x) {
			struct idx_node *n = kvr_alloc(sizeof(*n));
			if (!n)
				return KVR_ENOMEM;
			n->seq = seq;
			n->parent = p;
			n->ranks = ((uintptr_t)s << 1) | 1;
			n->lock = 0;
			n->nchildren = 0;
			__atomic_add_fetch(&p->nchildren, 1, __ATOMIC_RELAXED);
			x = kvr_index_table_insert(idx, n, rt);
			if (x == n) {
				idx_count(&idx->c_nodes, 1);
				idx_count(&idx->bytes_shared, (int64_t)sizeof(*n));
				*out = n;
				return 0;
			}
			/* p holds s (or is root): the count cannot have gone to zero meanwhile. */
			__atomic_sub_fetch(&p->nchildren, 1, __ATOMIC_RELAXED);
			kvr_free(n, sizeof(*n));
			if (!x)
				return KVR_ENOMEM;
		}
		idx_lock(&x->lock);
		if (__atomic_load_n(&x->lock, __ATOMIC_RELAXED) & IDX_DEAD) {
			idx_unlock(&x->lock); /* being unlinked: look again */
			continue;
		}
		int rc = rank_add(idx, x, s, rt);
		idx_unlock(&x->lock);
		*out = x;
		return rc;
	}
}

/* ---------------------------------------------------------------- events */

/* Hands the slot's retired objects to call_rcu once there are enough of them, or at once when
 * a whole table is among them.  Context: the slot's writer, outside the read section. */
static void maybe_flush(struct kvr_index *idx, struct idx_retire *rt)
{
	if (rt->n >= IDX_RETIRE_BATCH || rt->tabs)
		kvr_index_retire_flush(idx, rt);
}

int kvr_index_store(struct kvr_index *idx, uint32_t slot, const uint64_t *parent_ext,
                    const struct kvr_index_block *blocks, size_t n)
{
	if (!idx || (!blocks && n > 0))
		return KVR_EINVAL;
	struct idx_rank *r = kvr_index_rank_get_active(idx, slot);
	if (!r)
		return KVR_ENOENT;
	if (n == 0)
		return 0;
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	struct idx_retire *rt = &r->pend;
	int rc = 0;
	uint64_t added = 0, copies = 0;
	kvr_rcu_read_lock();
	struct idx_node *p = &idx->root;
	bool has_prev = parent_ext != NULL;
	uint64_t prev = has_prev ? *parent_ext : 0;
	if (has_prev) {
		p = xmap_find(&r->map, prev);
		if (!p) {
			idx_count(&idx->c_parent_nf, 1);
			rc = KVR_ENOENT;
		}
	}
	/* The table keys of all blocks follow from the parent's key: prefetch PF blocks ahead
	 * (the table entry and the rank's ext-map entry), as find_matches does. */
	enum { PF = 8, RING = 16 };
	uint64_t ring[RING];
	size_t ahead = 0;
	uint64_t last = rc == 0 ? p->seq : 0;
	bool at_root = p == &idx->root;
	for (size_t i = 0; rc == 0 && i < n; i++) {
		while (ahead < n && ahead <= i + PF) {
			/* The router's sequence hash (core/hash.c): the query passes the same. */
			kvr_hash_chain_locals(at_root && ahead == 0 ? NULL : &last,
			                      &blocks[ahead].local_hash, 1, &last);
			ring[ahead % RING] = last;
			__builtin_prefetch(idx_home_entry(idx, last));
			if (r->map.e)
				__builtin_prefetch(
				    &r->map.e[xhome(&r->map, blocks[ahead].ext_hash)]);
			ahead++;
		}
		const struct kvr_index_block b = blocks[i];
		if (has_prev && b.ext_hash == prev) {
			rc = KVR_EINVAL;
			break;
		}
		uint64_t seq = ring[i % RING];
		uint64_t hole;
		struct idx_node *e = xmap_find_hole(&r->map, b.ext_hash, &hole);
		if (e) {
			if (e->seq != seq || e->parent != p) {
				rc = KVR_EINVAL; /* this ext hash names another block of the rank */
				break;
			}
			if (idx->count_copies) {
				xmap_entry(&r->map, b.ext_hash)->extra++;
				copies++;
			}
			p = e; /* already held: idempotent, or one more copy */
		} else {
			struct idx_node *x;
			const struct idx_xent *before = r->map.e;
			if (xmap_reserve(idx, &r->map, 1) != 0) {
				rc = KVR_ENOMEM;
				break;
			}
			int a = child_add(idx, p, seq, slot, rt, &x);
			if (a == 1) {
				rc = KVR_EINVAL; /* the rank holds it under another ext hash */
				break;
			}
			if (a < 0) {
				rc = a;
				break;
			}
			if (r->map.e == before && hole != UINT64_MAX) {
				/* Not resized: the miss above ended at ext's place (saves a probe).
				 */
				r->map.e[hole].ext = b.ext_hash;
				r->map.e[hole].node = x;
				r->map.e[hole].extra = 0;
				r->map.count++;
			} else {
				xmap_put(&r->map, b.ext_hash, x);
			}
			added++;
			p = x;
		}
		prev = b.ext_hash;
		has_prev = true;
	}
	kvr_rcu_read_unlock();
	maybe_flush(idx, rt);
	if (rc == KVR_EINVAL)
		idx_count(&idx->c_invalid, 1);
	if (added)
		__atomic_store_n(&r->tree_size, r->map.count, __ATOMIC_RELAXED);
	if (added + copies) {
		idx_count(&idx->c_stored, (int64_t)(added + copies));
		idx_count(&idx->c_copies, (int64_t)(added + copies));
	}
	return rc;
}

int kvr_index_remove(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                     size_t *n_not_found)
{
	if (n_not_found)
		*n_not_found = 0;
	if (!idx || (!ext && n > 0))
		return KVR_EINVAL;
	struct idx_rank *r = kvr_index_rank_get_active(idx, slot);
	if (!r)
		return KVR_ENOENT;
	if (n == 0)
		return 0;
	kvr_rcu_thread_online();
	struct idx_retire *rt = &r->pend;
	size_t nf = 0, removed = 0;
	kvr_rcu_read_lock();
	/* Three-stage prefetch, as find_matches does: the ext-map entry PF_X blocks ahead, then
	 * the node it names PF_N ahead (for writing: its lock is taken), then the node's table
	 * entry PF_T ahead (for the delete when it dies).  The map entries and nodes are this
	 * rank's (only this thread removes them), so peeking them ahead is safe; a peek that
	 * misses (a duplicate hash) only wastes a prefetch. */
	enum { PF_X = 16, PF_N = 8, PF_T = 4, RING = 8 };
	struct idx_node *ring[RING];
	for (size_t j = 0; j < n && j < PF_X; j++)
		if (r->map.e)
			__builtin_prefetch(&r->map.e[xhome(&r->map, ext[j])]);
	for (size_t j = 0; j < n && j < PF_N; j++) {
		ring[j % RING] = xmap_find(&r->map, ext[j]);
		if (ring[j % RING])
			__builtin_prefetch(ring[j % RING], 1);
	}
	for (size_t j = 0; j < n && j < PF_T; j++)
		if (ring[j % RING])
			__builtin_prefetch(idx_home_entry(idx, ring[j % RING]->seq));
	for (size_t i = 0; i < n; i++) {
		if (i + PF_X < n && r->map.e)
			__builtin_prefetch(&r->map.e[xhome(&r->map, ext[i + PF_X])]);
		if (i + PF_N < n) {
			struct idx_node *pn = xmap_find(&r->map, ext[i + PF_N]);
			ring[(i + PF_N) % RING] = pn;
			if (pn)
				__builtin_prefetch(pn, 1);
		}
		if (i + PF_T < n && ring[(i + PF_T) % RING])
			__builtin_prefetch(idx_home_entry(idx, ring[(i + PF_T) % RING]->seq));
		if (idx->count_copies) {
			struct idx_xent *xe = xmap_entry(&r->map, ext[i]);
			if (xe && xe->extra) {
				xe->extra--; /* one copy of several goes: the block stays */
				removed++;
				continue;
			}
		}
		struct idx_node *x = xmap_del(&r->map, ext[i]);
		if (!x) {
			nf++;
			continue;
		}
		drop_rank(idx, x, slot, rt);
		removed++;
	}
	kvr_rcu_read_unlock();
	maybe_flush(idx, rt);
	xmap_shrink(idx, &r->map);
	__atomic_store_n(&r->tree_size, r->map.count, __ATOMIC_RELAXED);
	if (nf)
		idx_count(&idx->c_block_nf, (int64_t)nf);
	if (removed) {
		idx_count(&idx->c_removed, (int64_t)removed);
		idx_count(&idx->c_copies, -(int64_t)removed);
	}
	if (n_not_found)
		*n_not_found = nf;
	return 0;
}

int kvr_index_clear_rank(struct kvr_index *idx, uint32_t slot)
{
	if (!idx)
		return KVR_EINVAL;
	struct idx_rank *r = kvr_index_rank_get_active(idx, slot);
	if (!r)
		return KVR_ENOENT;
	kvr_rcu_thread_online();
	kvr_index_retire_flush(idx, &r->pend);
	if (!r->map.e)
		return 0;
	struct idx_retire rt = {0};
	uint64_t removed = 0;
	/* Batches of 4096 keep each read section (and so each grace period) short. */
	kvr_rcu_read_lock();
	for (uint64_t i = 0; i <= r->map.mask; i++) {
		struct idx_node *x = r->map.e[i].node;
		if (!x)
			continue;
		drop_rank(idx, x, slot, &rt);
		r->map.e[i].node = NULL;
		removed += r->map.e[i].extra;
		if (++removed % 4096 == 0) {
			kvr_rcu_read_unlock();
			kvr_index_retire_flush(idx, &rt);
			kvr_rcu_read_lock();
		}
	}
	kvr_rcu_read_unlock();
	kvr_index_retire_flush(idx, &rt);
	r->map.count = 0;
	xmap_shrink(idx, &r->map);
	__atomic_store_n(&r->tree_size, 0, __ATOMIC_RELAXED);
	idx_count(&idx->c_removed, (int64_t)removed);
	idx_count(&idx->c_copies, -(int64_t)removed);
	return 0;
}

void kvr_index_set_count_copies(struct kvr_index *idx, bool on)
{
	if (idx)
		idx->count_copies = on;
}

int kvr_index_clear_worker(struct kvr_index *idx, uint64_t worker_id)
{
	if (!idx)
		return KVR_EINVAL;
	int found = 0;
	for (uint32_t s = 0; s < idx->max_ranks; s++) {
		const struct idx_rank *r = &idx->rank[s];
		if (__atomic_load_n(&r->state, __ATOMIC_RELAXED) == SLOT_ACTIVE &&
		    __atomic_load_n(&r->worker_id, __ATOMIC_RELAXED) == worker_id) {
			found = 1;
			kvr_index_clear_rank(idx, s);
		}
	}
	return found ? 0 : KVR_ENOENT;
}
