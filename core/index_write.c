/*
 * core/index_write.c - the run index's writer side: stored, removed, cleared events.
 *
 * Every call takes the index's writer mutex (readers never do), so the table, the runs, the
 * holder sets and the per-rank records below change under one owner at a time.  What a reader
 * may be looking at is changed only by release stores of whole words (a run's len, a holder's
 * cut, a table entry) or by publishing a new copy (holder sets, sequence arrays, table arrays);
 * the old copy goes to the retire batch.  Design essay and invariants: core/index.c.
 *
 * A store applies block by block, each block atomically: first everything that needs memory is
 * obtained (table room, a grown sequence array, a new run, a holder record and set, map room),
 * then it is committed with no failure possible, so KVR_ENOMEM leaves the failing block (and
 * the ones after it) unapplied and the index consistent.  Removals never need memory.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/index_internal.h"
#include "kvrouter.h"

/* ---------------------------------------------------------------- per-rank maps */

#define XMAP_MIN 16

static inline uint64_t xhome(const struct idx_xmap *m, uint64_t key)
{
	uint64_t h = key * 0x9e3779b97f4a7c15ull;
	return (h ^ (h >> 32)) & m->mask;
}

static size_t xbytes(uint64_t mask)
{
	return (size_t)(mask + 1) * sizeof(struct idx_xent);
}

/* An entry is in use iff key != val: both maps only hold pairs with ext != seq. */
static inline bool xused(const struct idx_xent *e)
{
	return e->key != e->val;
}

static bool xmap_get(const struct idx_xmap *m, uint64_t key, uint64_t *val)
{
	if (!m->e)
		return false;
	for (uint64_t i = xhome(m, key);; i = (i + 1) & m->mask) {
		if (!xused(&m->e[i]))
			return false;
		if (m->e[i].key == key) {
			if (val)
				*val = m->e[i].val;
			return true;
		}
	}
}

static void xmap_put(struct idx_xmap *m, uint64_t key, uint64_t val)
{
	uint64_t i = xhome(m, key);
	while (xused(&m->e[i]))
		i = (i + 1) & m->mask;
	m->e[i] = (struct idx_xent){.key = key, .val = val};
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
			if (xused(&m->e[i]))
				xmap_put(&nm, m->e[i].key, m->e[i].val);
		kvr_free(m->e, xbytes(m->mask));
		idx_count(&idx->bytes_rank, -(int64_t)xbytes(m->mask));
	}
	idx_count(&idx->bytes_rank, (int64_t)xbytes(nm.mask));
	*m = nm;
	return 0;
}

/* Makes room for one more entry at load <= 0.8.  Returns 0 or KVR_ENOMEM. */
static int xmap_reserve(struct kvr_index *idx, struct idx_xmap *m)
{
	uint64_t need = m->count + 1;
	uint64_t cap = m->e ? m->mask + 1 : 0;
	if (need * 5 <= cap * 4)
		return 0;
	uint64_t ncap = cap ? cap : XMAP_MIN;
	while (need * 5 > ncap * 4)
		ncap <<= 1;
	return xmap_resize(idx, m, ncap);
}

/* Removes key (backward-shift deletion keeps probes short). */
static void xmap_del(struct idx_xmap *m, uint64_t key)
{
	if (!m->e)
		return;
	uint64_t i = xhome(m, key);
	for (;; i = (i + 1) & m->mask) {
		if (!xused(&m->e[i]))
			return;
		if (m->e[i].key == key)
			break;
	}
	m->e[i] = (struct idx_xent){0, 0};
	m->count--;
	for (uint64_t j = (i + 1) & m->mask; xused(&m->e[j]); j = (j + 1) & m->mask) {
		uint64_t k = xhome(m, m->e[j].key);
		/* Move e[j] into the hole at i unless its home lies cyclically in (i, j]. */
		if (((j - k) & m->mask) >= ((j - i) & m->mask)) {
			m->e[i] = m->e[j];
			m->e[j] = (struct idx_xent){0, 0};
			i = j;
		}
	}
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

/* ---------------------------------------------------------------- holder records */

static inline bool bit(const struct idx_hold *h, uint32_t pos)
{
	if (pos / 64 >= h->nwords)
		return false;
	return ((h->nwords == 1 ? h->bm0 : h->bm[pos / 64]) >> (pos % 64)) & 1;
}

static uint64_t ex_bytes(uint32_t cap)
{
	return cap ? sizeof(struct idx_xcopies) + (uint64_t)cap * sizeof(struct idx_xcopy) : 0;
}

static uint64_t hold_bytes(const struct idx_hold *h)
{
	return sizeof(*h) + (h->nwords > 1 ? (uint64_t)h->nwords * 8 : 0) +
	       ex_bytes(h->ex ? h->ex->cap : 0);
}

static struct idx_hold *hold_new(struct kvr_index *idx, struct idx_run *run, uint32_t slot,
                                 uint32_t pos)
{
	struct idx_hold *h = kvr_alloc(sizeof(*h));
	if (!h)
		return NULL;
	memset(h, 0, sizeof(*h));
	h->nwords = pos / 64 + 1;
	if (h->nwords > 1 && !(h->bm = kvr_calloc(h->nwords, 8))) {
		kvr_free(h, sizeof(*h));
		return NULL;
	}
	h->run = run;
	h->slot = slot;
	idx_count(&idx->bytes_rank, (int64_t)hold_bytes(h));
	return h;
}

static void hold_free(struct kvr_index *idx, struct idx_hold *h)
{
	idx_count(&idx->bytes_rank, -(int64_t)hold_bytes(h));
	if (h->nwords > 1)
		kvr_free(h->bm, (size_t)h->nwords * 8);
	if (h->ex)
		kvr_free(h->ex, ex_bytes(h->ex->cap));
	kvr_free(h, sizeof(*h));
}

/* Makes the bitmap cover pos.  Returns 0 or KVR_ENOMEM (unchanged). */
static int hold_reserve(struct kvr_index *idx, struct idx_hold *h, uint32_t pos)
{
	if (pos / 64 < h->nwords)
		return 0;
	uint32_t nw = h->nwords * 2 > pos / 64 + 1 ? h->nwords * 2 : pos / 64 + 1;
	uint64_t *bm = kvr_calloc(nw, 8);
	if (!bm)
		return KVR_ENOMEM;
	memcpy(bm, idx_hold_bm(h), (size_t)h->nwords * 8);
	idx_count(&idx->bytes_rank, (int64_t)(nw - (h->nwords > 1 ? h->nwords : 0)) * 8);
	if (h->nwords > 1)
		kvr_free(h->bm, (size_t)h->nwords * 8);
	h->bm = bm;
	h->nwords = nw;
	return 0;
}

/* Sets pos (the bitmap covers it); advances the gap-free cut over what follows. */
static void hold_set(struct idx_hold *h, uint32_t pos)
{
	uint64_t *bm = idx_hold_bm(h);
	bm[pos / 64] |= 1ull << (pos % 64);
	h->held++;
	if (pos + 1 > h->top)
		h->top = pos + 1;
	if (pos != h->cut)
		return;
	uint32_t c = h->cut;
	while (c / 64 < h->nwords) {
		uint64_t w = ~(bm[c / 64] >> (c % 64));
		if (w) {
			c += (uint32_t)__builtin_ctzll(w);
			break;
		}
		c += 64 - c % 64;
	}
	h->cut = c < h->top ? c : h->top;
}

static void hold_clear(struct idx_hold *h, uint32_t pos)
{
	uint64_t *bm = idx_hold_bm(h);
	bm[pos / 64] &= ~(1ull << (pos % 64));
	h->held--;
	if (pos < h->cut)
		h->cut = pos;
	if (pos + 1 != h->top)
		return;
	uint32_t t = 0;
	for (uint32_t w = pos / 64 + 1; w-- > 0;)
		if (bm[w]) {
			t = w * 64 + 64 - (uint32_t)__builtin_clzll(bm[w]);
			break;
		}
	h->top = t;
}

/* Copy counts (count_copies): extra copies of a held position. */
static struct idx_xcopy *ex_find(const struct idx_hold *h, uint32_t pos)
{
	if (!h->ex)
		return NULL;
	for (uint32_t i = 0; i < h->ex->n; i++)
		if (h->ex->e[i].pos == pos)
			return &h->ex->e[i];
	return NULL;
}

static int ex_reserve(struct kvr_index *idx, struct idx_hold *h, uint32_t pos)
{
	uint32_t cap = h->ex ? h->ex->cap : 0, n = h->ex ? h->ex->n : 0;
	if (ex_find(h, pos) || n < cap)
		return 0;
	uint32_t nc = cap ? cap * 2 : 2;
	struct idx_xcopies *e = kvr_alloc(ex_bytes(nc));
	if (!e)
		return KVR_ENOMEM;
	e->n = n;
	e->cap = nc;
	if (h->ex) {
		memcpy(e->e, h->ex->e, (size_t)n * sizeof(struct idx_xcopy));
		kvr_free(h->ex, ex_bytes(cap));
	}
	idx_count(&idx->bytes_rank, (int64_t)(ex_bytes(nc) - ex_bytes(cap)));
	h->ex = e;
	return 0;
}

static void ex_inc(struct idx_hold *h, uint32_t pos)
{
	struct idx_xcopy *e = ex_find(h, pos);
	if (e)
		e->extra++;
	else
		h->ex->e[h->ex->n++] = (struct idx_xcopy){pos, 1};
}

/* Drops one extra copy of pos; false when pos has none. */
static bool ex_dec(struct idx_hold *h, uint32_t pos)
{
	struct idx_xcopy *e = ex_find(h, pos);
	if (!e)
		return false;
	if (--e->extra == 0)
		*e = h->ex->e[--h->ex->n];
	return true;
}

/* ---------------------------------------------------------------- holder sets */

static inline uint32_t hslot(uint64_t w)
{
	return (uint32_t)(w >> 32);
}

/* Index of the first entry of slot in hs, or -1. */
static int64_t hs_find(const struct idx_hset *hs, uint32_t slot)
{
	if (!hs)
		return -1;
	uint32_t lo = 0, hi = hs->n;
	while (lo < hi) {
		uint32_t mid = (lo + hi) / 2;
		if (hslot(hs->e[mid]) < slot)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < hs->n && hslot(hs->e[lo]) == slot ? (int64_t)lo : -1;
}

static struct idx_hold *hold_of(const struct idx_run *r, uint32_t slot)
{
	int64_t i = hs_find(r->hs, slot);
	return i < 0 ? NULL : idx_hset_holds(r->hs)[i];
}

/* Mirrors h->cut into the run's holder words (every duplicate).
 * Ordering: relaxed; a cut covers positions whose content is permanent and whose len was
 * released before (index_match.c credits min(cut, matched)). */
static void publish_cut(struct idx_hold *h)
{
	struct idx_hset *hs = h->run->hs;
	int64_t i = hs_find(hs, h->slot);
	if (i < 0)
		return; /* NEVER */
	uint64_t w = ((uint64_t)h->slot << 32) | h->cut;
	for (uint32_t k = (uint32_t)i; k < hs->n && hslot(hs->e[k]) == h->slot; k++)
		__atomic_store_n(&hs->e[k], w, __ATOMIC_RELAXED);
}

static struct idx_hset *hs_alloc(struct kvr_index *idx, uint32_t cap)
{
	struct idx_hset *hs = kvr_alloc(idx_bytes_hset(cap));
	if (hs) {
		hs->cap = cap;
		hs->n = 0;
		hs->next_free = NULL;
		idx_count(&idx->bytes_rank, (int64_t)idx_bytes_hset(cap));
	}
	return hs;
}

static void hs_retire(struct kvr_index *idx, struct idx_hset *hs)
{
	if (!hs)
		return;
	hs->next_free = idx->rt.sets;
	idx->rt.sets = hs;
	idx->rt.n++;
}

/* Publishes r's holder set plus h (cut 0).  Returns 0 or KVR_ENOMEM (unchanged). */
static int hs_add(struct kvr_index *idx, struct idx_run *r, struct idx_hold *h)
{
	const struct idx_hset *o = r->hs;
	uint32_t n = o ? o->n : 0;
	struct idx_hset *hs = hs_alloc(idx, n + 1);
	if (!hs)
		return KVR_ENOMEM;
	struct idx_hold **oh = o ? idx_hset_holds(o) : NULL, **nh = idx_hset_holds(hs);
	uint32_t k = 0;
	bool put = false;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t w = __atomic_load_n(&o->e[i], __ATOMIC_RELAXED);
		if (!put && h->slot < hslot(w)) {
			hs->e[k] = (uint64_t)h->slot << 32;
			nh[k++] = h;
			put = true;
		}
		if (k > 0 && hslot(hs->e[k - 1]) == hslot(w))
			continue; /* a duplicate left by hs_del without memory */
		hs->e[k] = w;
		nh[k++] = oh[i];
	}
	if (!put) {
		hs->e[k] = (uint64_t)h->slot << 32;
		nh[k++] = h;
	}
	hs->n = k;
	/* Ordering: release; pairs with the acquire load of r->hs in find_matches. */
	kvr_rcu_publish(&r->hs, hs);
	hs_retire(idx, (struct idx_hset *)o);
	return 0;
}

/* Removes slot from r's holder set.  Never fails: without memory for the smaller copy, the
 * slot's words are overwritten in place with a neighbour's (one atomic word each). */
static void hs_del(struct kvr_index *idx, struct idx_run *r, uint32_t slot)
{
	struct idx_hset *o = r->hs;
	int64_t at = hs_find(o, slot);
	if (at < 0)
		return;
	uint32_t distinct = 0;
	for (uint32_t i = 0; i < o->n; i++)
		if (hslot(o->e[i]) != slot && (i == 0 || hslot(o->e[i - 1]) != hslot(o->e[i])))
			distinct++;
	struct idx_hset *hs = NULL;
	if (distinct > 0) {
		hs = hs_alloc(idx, distinct);
		if (!hs) {
			uint32_t nb = at > 0 ? (uint32_t)at - 1 : UINT32_MAX;
			if (nb == UINT32_MAX)
				for (uint32_t i = 0; i < o->n; i++)
					if (hslot(o->e[i]) != slot) {
						nb = i;
						break;
					}
			struct idx_hold **oh = idx_hset_holds(o);
			for (uint32_t i = (uint32_t)at; i < o->n && hslot(o->e[i]) == slot; i++) {
				oh[i] = oh[nb];
				__atomic_store_n(&o->e[i], o->e[nb], __ATOMIC_RELAXED);
			}
			return;
		}
		struct idx_hold **oh = idx_hset_holds(o), **nh = idx_hset_holds(hs);
		uint32_t k = 0;
		for (uint32_t i = 0; i < o->n; i++) {
			if (hslot(o->e[i]) == slot ||
			    (k > 0 && hslot(hs->e[k - 1]) == hslot(o->e[i])))
				continue;
			hs->e[k] = o->e[i];
			nh[k++] = oh[i];
		}
		hs->n = k;
	}
	kvr_rcu_publish(&r->hs, hs);
	hs_retire(idx, o);
}

/* ---------------------------------------------------------------- runs */

/* Retires r's sequence array if it has its own allocation. */
static void seqs_retire(struct kvr_index *idx, struct idx_run *r)
{
	if (idx_seqs_inline(r))
		return;
	struct idx_seqs *q = idx_seqs_hdr(r->seqs);
	q->next_free = idx->rt.seqs;
	idx->rt.seqs = q;
	idx->rt.n++;
}

static uint64_t run_bytes(const struct idx_run *r)
{
	return sizeof(*r) + (idx_seqs_inline(r) ? 0 : idx_bytes_seqs(idx_run_cap(r)));
}

/* A new run below (parent, off) with room for cap blocks (one-block runs keep their hash in
 * the header: no second allocation). */
static struct idx_run *run_new(struct kvr_index *idx, struct idx_run *parent, uint32_t off,
                               uint32_t cap, uint64_t first)
{
	struct idx_run *r = kvr_alloc_aligned(sizeof(*r));
	if (!r)
		return NULL;
	struct idx_seqs *q = NULL;
	if (cap > 1 && !(q = kvr_alloc(idx_bytes_seqs(cap)))) {
		kvr_free_aligned(r, sizeof(*r));
		return NULL;
	}
	if ((uintptr_t)r & ~IDX_PTR_MASK) { /* NEVER: user space is below 2^49 */
		kvr_free(q, q ? idx_bytes_seqs(cap) : 0);
		kvr_free_aligned(r, sizeof(*r));
		return NULL;
	}
	memset(r, 0, sizeof(*r));
	r->first = first;
	if (q) {
		q->cap = cap;
		q->next_free = NULL;
		q->s[0] = first;
		r->seqs = q->s;
	} else {
		r->seqs = &r->first;
	}
	r->parent = parent;
	r->off = off;
	r->hw = 1;
	idx_count(&idx->bytes_shared, (int64_t)run_bytes(r));
	return r;
}

/* Frees a run never published, or (destroy) one nobody can read any more. */
static void run_free(struct kvr_index *idx, struct idx_run *r)
{
	idx_count(&idx->bytes_shared, -(int64_t)run_bytes(r));
	if (!idx_seqs_inline(r))
		kvr_free(idx_seqs_hdr(r->seqs), idx_bytes_seqs(idx_run_cap(r)));
	kvr_free_aligned(r, sizeof(*r));
}

/* Makes room for one more position, sized for `more` coming.  Returns 0 or KVR_ENOMEM. */
static int run_grow(struct kvr_index *idx, struct idx_run *r, size_t more)
{
	uint32_t ocap = idx_run_cap(r);
	if (r->hw < ocap)
		return 0;
	uint64_t cap = (uint64_t)r->hw + (more > 1 ? more : 1);
	if (cap < (uint64_t)r->hw + r->hw / 4 + 1) /* geometric: amortised O(1) per block */
		cap = (uint64_t)r->hw + r->hw / 4 + 1;
	if (cap > IDX_RUN_MAX)
		cap = IDX_RUN_MAX;
	struct idx_seqs *q = kvr_alloc(idx_bytes_seqs((uint32_t)cap));
	if (!q)
		return KVR_ENOMEM;
	q->cap = (uint32_t)cap;
	q->next_free = NULL;
	memcpy(q->s, r->seqs, (size_t)r->hw * sizeof(uint64_t));
	idx_count(&idx->bytes_shared, (int64_t)idx_bytes_seqs(q->cap));
	seqs_retire(idx, r);
	/* Ordering: release; pairs with the acquire load of seqs in find_matches (which loads
	 * len first: a len covering new positions was stored after this publish). */
	kvr_rcu_publish(&r->seqs, q->s);
	return 0;
}

static void link_child(struct idx_run *p, struct idx_run *c)
{
	if (!p)
		return;
	c->sib_prev = NULL;
	c->sib = p->child;
	if (p->child)
		p->child->sib_prev = c;
	p->child = c;
	if (c->off > p->max_child_off)
		p->max_child_off = c->off;
}

/* O(1); p->max_child_off stays an upper bound until run_check() needs it exact. */
static void unlink_child(struct idx_run *p, struct idx_run *c)
{
	if (!p)
		return;
	if (c->sib_prev)
		c->sib_prev->sib = c->sib;
	else
		p->child = c->sib;
	if (c->sib)
		c->sib->sib_prev = c->sib_prev;
}

static void rank_unlink_hold(struct kvr_index *idx, struct idx_hold *h)
{
	struct idx_rank *rk = &idx->rank[h->slot];
	if (h->prev)
		h->prev->next = h->next;
	else
		rk->holds = h->next;
	if (h->next)
		h->next->prev = h->prev;
}

static void rank_link_hold(struct kvr_index *idx, struct idx_hold *h)
{
	struct idx_rank *rk = &idx->rank[h->slot];
	h->prev = NULL;
	h->next = rk->holds;
	if (rk->holds)
		rk->holds->prev = h;
	rk->holds = h;
}

/* Removes an empty holder record from its run and its rank. */
static void drop_hold(struct kvr_index *idx, struct idx_hold *h)
{
	rank_unlink_hold(idx, h);
	hs_del(idx, h->run, h->slot);
	hold_free(idx, h);
}

/* Trims r to what its holders and children need, killing it (and re-checking its parent)
 * when that is nothing.  Never fails. */
static void run_check(struct kvr_index *idx, struct idx_run *r)
{
	while (r) {
		uint32_t need = 0;
		const struct idx_hset *hs = r->hs;
		if (hs) {
			struct idx_hold **hh = idx_hset_holds(hs);
			for (uint32_t i = 0; i < hs->n; i++)
				if (hh[i]->top > need)
					need = hh[i]->top;
		}
		if (need >= r->len)
			return;
		if (r->max_child_off > need) { /* the bound may be stale: make it exact */
			r->max_child_off = 0;
			for (const struct idx_run *k = r->child; k; k = k->sib)
				if (k->off > r->max_child_off)
					r->max_child_off = k->off;
		}
		if (r->max_child_off > need)
			need = r->max_child_off;
		if (need >= r->len)
			return;
		/* Trim in O(1): the trimmed positions keep their table entries (a re-store finds
		 * them, removals find no holder there) until the run dies.
		 * Ordering: release; readers that still see the old len compare permanent content.
		 */
		idx_count(&idx->c_nodes, -(int64_t)(r->len - need));
		__atomic_store_n(&r->len, (uint16_t)need, __ATOMIC_RELEASE);
		if (need > 0)
			return;
		for (uint32_t q = 0; q < r->hw; q++)
			kvr_index_tab_delete(idx, r->seqs[q], r, q);
		/* Dead: nobody holds a position and no child hangs below. */
		while (r->hs) {
			struct idx_hold *h = idx_hset_holds(r->hs)[0];
			drop_hold(idx, h); /* NEVER reached with a non-empty record */
		}
		struct idx_run *p = r->parent;
		unlink_child(p, r);
		seqs_retire(idx, r);
		r->child = idx->rt.runs;
		idx->rt.runs = r;
		idx->rt.n++;
		r = p;
	}
}

void kvr_index_free_run_now(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_hset *hs = r->hs;
	if (hs) {
		struct idx_hold **hh = idx_hset_holds(hs);
		for (uint32_t i = 0; i < hs->n; i++)
			if (i == 0 || hh[i] != hh[i - 1])
				hold_free(idx, hh[i]);
		idx_count(&idx->bytes_rank, -(int64_t)idx_bytes_hset(hs->cap));
		kvr_free(hs, idx_bytes_hset(hs->cap));
	}
	run_free(idx, r);
}

/* ---------------------------------------------------------------- events */

/* After removals from (r, h): drops the record when empty, trims / kills the run. */
static void settle(struct kvr_index *idx, struct idx_run *r, struct idx_hold *h)
{
	if (h->held == 0)
		drop_hold(idx, h);
	run_check(idx, r);
}

static void flush_if_due(struct kvr_index *idx)
{
	if (idx->rt.n >= IDX_RETIRE_BATCH || idx->rt.tabs)
		kvr_index_retire_flush(idx, &idx->rt);
}

/* The sequence hash an ext hash names for the rank, or false (the rank uses ext for nothing:
 * unknown, or ext is the sequence hash of a block the rank holds under another ext). */
static bool ext_to_seq(const struct idx_rank *rk, uint64_t ext, uint64_t *seq)
{
	if (xmap_get(&rk->xmap, ext, seq))
		return true;
	if (xmap_get(&rk->rmap, ext, NULL))
		return false;
	*seq = ext;
	return true;
}

/* Where block seq sits in the tree: *r, *pos, or false. */
static bool locate(const struct kvr_index *idx, uint64_t seq, struct idx_run **r, uint32_t *pos)
{
	uint64_t e = kvr_index_tab_find(idx, seq);
	if (!e)
		return false;
	*r = idx_ent_run(e);
	*pos = idx_ent_pos(e);
	return true;
}

static bool ensure_scratch(struct kvr_index *idx, size_t n)
{
	if (idx->scratch_cap >= n)
		return true;
	size_t cap = idx->scratch_cap ? idx->scratch_cap : 256;
	while (cap < n)
		cap *= 2;
	uint64_t *p = kvr_alloc(cap * sizeof(uint64_t));
	if (!p)
		return false;
	kvr_free(idx->scratch, idx->scratch_cap * sizeof(uint64_t));
	idx->scratch = p;
	idx->scratch_cap = cap;
	return true;
}

/* Whether the slot holds the block with sequence hash s under ext hash s. */
static bool holds_plain(const struct kvr_index *idx, const struct idx_rank *rk, uint32_t slot,
                        uint64_t s)
{
	struct idx_run *r;
	uint32_t pos;
	if (idx->tsize[slot] == rk->xmap.count) /* every held block is aliased: nothing plain */
		return false;
	if (xmap_get(&rk->rmap, s, NULL) || !locate(idx, s, &r, &pos))
		return false;
	const struct idx_hold *h = hold_of(r, slot);
	return h && bit(h, pos);
}

static size_t remove_locked(struct kvr_index *idx, struct idx_rank *rk, uint32_t slot,
                            const uint64_t *ext, size_t n, size_t *removed, size_t *dropped);

enum place { P_HELD, P_EXISTS, P_REEXTEND, P_APPEND, P_FORK };

int kvr_index_store(struct kvr_index *idx, uint32_t slot, const uint64_t *parent_ext,
                    const struct kvr_index_block *blocks, size_t n)
{
	if (!idx || (!blocks && n > 0))
		return KVR_EINVAL;
	struct idx_rank *rk = kvr_index_rank_get_active(idx, slot);
	if (!rk)
		return KVR_ENOENT;
	if (n == 0)
		return 0;
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	pthread_mutex_lock(&idx->wlock);
	int rc = 0;
	uint64_t added = 0, copies = 0;
	uint64_t *applied = NULL; /* ext hashes added or copied, for a rollback */
	size_t napplied = 0;
	struct idx_hold *pub = NULL; /* a record whose cut is not yet mirrored into its hset */
	struct idx_run *R = NULL;    /* where the previous block sits; NULL = the root */
	uint32_t p = 0;
	struct idx_hold *h = NULL; /* slot's record of R (cached) */
	uint64_t pseq = 0, prev = 0;
	bool has_prev = parent_ext != NULL;
	if (has_prev) {
		prev = *parent_ext;
		if (!ext_to_seq(rk, prev, &pseq) || !locate(idx, pseq, &R, &p) ||
		    !(h = hold_of(R, slot)) || !bit(h, p)) {
			idx_count(&idx->c_parent_nf, 1);
			rc = KVR_ENOENT;
			goto out;
		}
	}
	if (!ensure_scratch(idx, 2 * n)) {
		rc = KVR_ENOMEM;
		goto out;
	}
	uint64_t *seq = idx->scratch;
	applied = idx->scratch + n;
	for (size_t i = 0; i < n; i++) /* the router's chain (core/hash.c) */
		kvr_hash_chain_locals(i == 0 && !has_prev ? NULL : (i ? &seq[i - 1] : &pseq),
		                      &blocks[i].local_hash, 1, &seq[i]);
	for (size_t i = 0; i < n; i++) {
		const uint64_t e = blocks[i].ext_hash, s = seq[i];
		if (i + 8 < n) {
			uintptr_t v = idx->view[seq[i + 8] >> (64 - IDX_SEGS_BITS)];
			if (v)
				__builtin_prefetch(
				    &((const struct idx_tab *)(v & ~(uintptr_t)63))
				         ->e[seq[i + 8] & (((uint64_t)1 << (v & 63)) - 1)]);
		}
		if (has_prev && e == prev) {
			rc = KVR_EINVAL; /* self-parent */
			break;
		}
		const bool alias = e != s;
		uint64_t mapped;
		bool via_e = xmap_get(&rk->xmap, e, &mapped);
		if (via_e && (!alias || mapped != s)) {
			rc = KVR_EINVAL; /* e names another block of the rank */
			break;
		}
		if (alias && !via_e && holds_plain(idx, rk, slot, e)) {
			rc =
			    KVR_EINVAL; /* e is the sequence hash (and ext) of another held block */
			break;
		}
		/* Where does s go? */
		struct idx_run *C = NULL;
		uint32_t q = 0;
		enum place pl;
		if (R && p + 1 < R->len && R->seqs[p + 1] == s) {
			C = R;
			q = p + 1;
			pl = P_EXISTS;
		} else if (R && p + 1 == R->len && R->hw == R->len && R->max_child_off <= p &&
		           R->hw < IDX_RUN_MAX) {
			/* Extending a run at its end with no child there: s, which names its
			 * prefix, cannot be in the tree (no probe). */
			pl = P_APPEND;
		} else if (locate(idx, s, &C, &q)) {
			bool ok;
			if (q >= C->len) { /* trimmed off R's end, its entry kept: re-extend */
				ok = C == R && q == p + 1;
				pl = P_REEXTEND;
			} else {
				ok = q > 0 ? (C == R && q == p + 1)
				           : (C->parent == R && C->off == (R ? p + 1 : 0));
				pl = P_EXISTS;
			}
			if (!ok) {
				rc = KVR_EINVAL; /* a 64-bit sequence hash collision */
				break;
			}
		} else if (R && p + 1 == R->len && R->hw == R->len && R->hw < IDX_RUN_MAX) {
			pl = P_APPEND;
		} else {
			pl = P_FORK;
		}
		struct idx_hold *ch = NULL; /* slot's record of the block's run */
		if (pl == P_EXISTS) {
			ch = C == R ? h : hold_of(C, slot);
			if (ch && bit(ch, q))
				pl = P_HELD;
		}
		if (pl == P_HELD) {
			if (!via_e && (alias || xmap_get(&rk->rmap, s, NULL))) {
				rc = KVR_EINVAL; /* held under another ext hash */
				break;
			}
			if (idx->count_copies) {
				if (ex_reserve(idx, ch, q) != 0) {
					rc = KVR_ENOMEM;
					break;
				}
				ex_inc(ch, q);
				copies++;
				applied[napplied++] = e;
			}
			R = C;
			p = q;
			h = ch;
			prev = e;
			has_prev = true;
			continue;
		}
		if (via_e) { /* NEVER: e maps to s, so the rank holds s */
			rc = KVR_EINVAL;
			break;
		}
		/* Obtain everything that needs memory; nothing visible changes before commit. */
		if (alias && (xmap_reserve(idx, &rk->xmap) || xmap_reserve(idx, &rk->rmap))) {
			rc = KVR_ENOMEM;
			break;
		}
		if ((pl == P_APPEND || pl == P_FORK) && kvr_index_tab_reserve(idx, s) != 0) {
			rc = KVR_ENOMEM;
			break;
		}
		if (pl == P_APPEND && run_grow(idx, R, n - i) != 0) {
			kvr_index_tab_unreserve(idx, s);
			rc = KVR_ENOMEM;
			break;
		}
		struct idx_run *nr = NULL;
		if (pl == P_FORK) {
			size_t cap = n - i < IDX_RUN_MAX ? n - i : IDX_RUN_MAX;
			nr = run_new(idx, R, R ? p + 1 : 0, (uint32_t)cap, s);
			if (!nr) {
				kvr_index_tab_unreserve(idx, s);
				rc = KVR_ENOMEM;
				break;
			}
			C = nr;
			q = 0;
		} else if (pl != P_EXISTS) {
			C = R;
			q = p + 1;
			ch = h;
		}
		bool new_hold = false;
		if (ch) {
			if (hold_reserve(idx, ch, q) != 0) {
				rc = KVR_ENOMEM;
			}
		} else {
			ch = hold_new(idx, C, slot, q);
			if (!ch || hs_add(idx, C, ch) != 0) {
				if (ch)
					hold_free(idx, ch);
				rc = KVR_ENOMEM;
			}
			new_hold = true;
		}
		if (rc) {
			kvr_index_tab_unreserve(idx, s);
			if (nr) {
				/* hs_add may have published a set on the unpublished run */
				if (nr->hs) {
					idx_count(&idx->bytes_rank,
					          -(int64_t)idx_bytes_hset(nr->hs->cap));
					kvr_free(nr->hs, idx_bytes_hset(nr->hs->cap));
				}
				run_free(idx, nr);
			}
			break;
		}
		/* Commit: no failure from here. */
		switch (pl) {
		case P_FORK:
			nr->len = 1;
			link_child(R, nr);
			kvr_index_tab_insert(idx, s, nr, 0);
			break;
		case P_APPEND:
			R->seqs[R->hw++] = s;
			/* Ordering: release; pairs with the acquire load of len in find_matches. */
			__atomic_store_n(&R->len, (uint16_t)(R->len + 1), __ATOMIC_RELEASE);
			kvr_index_tab_insert(idx, s, R, q);
			break;
		case P_REEXTEND: /* the table entry was kept by the trim */
			__atomic_store_n(&R->len, (uint16_t)(R->len + 1), __ATOMIC_RELEASE);
			break;
		default:
			break;
		}
		if (pl != P_EXISTS)
			idx_count(&idx->c_nodes, 1);
		if (new_hold)
			rank_link_hold(idx, ch);
		hold_set(ch, q);
		if (pub != ch) { /* cuts are published once per run and call */
			if (pub)
				publish_cut(pub);
			pub = ch;
		}
		if (alias) {
			xmap_put(&rk->xmap, e, s);
			xmap_put(&rk->rmap, s, e);
		}
		added++;
		__atomic_store_n(&idx->tsize[slot], idx->tsize[slot] + 1, __ATOMIC_RELAXED);
		applied[napplied++] = e;
		R = C;
		p = q;
		h = ch;
		prev = e;
		has_prev = true;
	}
out:
	if (pub)
		publish_cut(pub);
	if (rc == KVR_ENOMEM && napplied) {
		/* A failed write changes nothing: take back what this call applied, newest
		 * first (a removal never needs memory). */
		size_t removed = 0, dropped = 0;
		for (size_t i = napplied; i-- > 0;)
			remove_locked(idx, rk, slot, &applied[i], 1, &removed, &dropped);
		xmap_shrink(idx, &rk->xmap);
		xmap_shrink(idx, &rk->rmap);
		added = copies = 0;
	}
	if (rc == KVR_EINVAL)
		idx_count(&idx->c_invalid, 1);
	if (added + copies) {
		idx_count(&idx->c_stored, (int64_t)(added + copies));
		idx_count(&idx->c_copies, (int64_t)(added + copies));
	}
	flush_if_due(idx);
	pthread_mutex_unlock(&idx->wlock);
	return rc;
}

/* Removes ext[0..n) from the slot (one copy each with count_copies).  Adds to *removed the
 * copies removed and to *dropped the blocks that left the rank; returns the hashes not found.
 * Never fails.  Context: wlock held. */
static size_t remove_locked(struct kvr_index *idx, struct idx_rank *rk, uint32_t slot,
                            const uint64_t *ext, size_t n, size_t *removed, size_t *dropped)
{
	size_t nf = 0;
	struct idx_run *R = NULL; /* the run being removed from, its record, the last position */
	struct idx_hold *h = NULL;
	uint32_t p = 0;
	for (size_t i = 0; i < n; i++) {
		uint64_t s = ext[i];
		if (rk->xmap.count && !ext_to_seq(rk, ext[i], &s)) {
			nf++;
			continue;
		}
		struct idx_run *C;
		uint32_t q;
		if (R && p + 1 < R->len && R->seqs[p + 1] == s) { /* a chain's tail: no probe */
			C = R;
			q = p + 1;
		} else if (!locate(idx, s, &C, &q)) {
			nf++;
			continue;
		}
		struct idx_hold *ch = C == R ? h : hold_of(C, slot);
		if (!ch || !bit(ch, q)) {
			nf++;
			continue;
		}
		if (C != R) {
			if (R)
				settle(idx, R, h);
			R = C;
			h = ch;
		}
		p = q;
		(*removed)++;
		if (idx->count_copies && ex_dec(h, q))
			continue; /* one copy of several goes: the block stays */
		uint32_t cut0 = h->cut;
		hold_clear(h, q);
		if (h->cut != cut0)
			publish_cut(h);
		(*dropped)++;
		__atomic_store_n(&idx->tsize[slot], idx->tsize[slot] - 1, __ATOMIC_RELAXED);
		if (s != ext[i]) {
			xmap_del(&rk->xmap, ext[i]);
			xmap_del(&rk->rmap, s);
		}
	}
	if (R)
		settle(idx, R, h);
	return nf;
}

int kvr_index_remove(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                     size_t *n_not_found)
{
	if (n_not_found)
		*n_not_found = 0;
	if (!idx || (!ext && n > 0))
		return KVR_EINVAL;
	struct idx_rank *rk = kvr_index_rank_get_active(idx, slot);
	if (!rk)
		return KVR_ENOENT;
	if (n == 0)
		return 0;
	kvr_rcu_thread_online();
	pthread_mutex_lock(&idx->wlock);
	size_t removed = 0, dropped = 0;
	size_t nf = remove_locked(idx, rk, slot, ext, n, &removed, &dropped);
	if (dropped) {
		xmap_shrink(idx, &rk->xmap);
		xmap_shrink(idx, &rk->rmap);
	}
	if (nf)
		idx_count(&idx->c_block_nf, (int64_t)nf);
	if (removed) {
		idx_count(&idx->c_removed, (int64_t)removed);
		idx_count(&idx->c_copies, -(int64_t)removed);
	}
	flush_if_due(idx);
	pthread_mutex_unlock(&idx->wlock);
	if (n_not_found)
		*n_not_found = nf;
	return 0;
}

uint64_t kvr_index_clear_locked(struct kvr_index *idx, uint32_t slot)
{
	struct idx_rank *rk = &idx->rank[slot];
	uint64_t removed = 0;
	while (rk->holds) {
		struct idx_hold *h = rk->holds;
		struct idx_run *r = h->run;
		removed += h->held;
		for (uint32_t i = 0; h->ex && i < h->ex->n; i++)
			removed += h->ex->e[i].extra;
		memset(idx_hold_bm(h), 0, (size_t)h->nwords * 8);
		h->held = h->cut = h->top = 0;
		publish_cut(h);
		drop_hold(idx, h);
		run_check(idx, r);
		if (idx->rt.n >= IDX_RETIRE_BATCH * 16)
			kvr_index_retire_flush(idx, &idx->rt);
	}
	rk->xmap.count = rk->rmap.count = 0;
	xmap_shrink(idx, &rk->xmap);
	xmap_shrink(idx, &rk->rmap);
	__atomic_store_n(&idx->tsize[slot], 0, __ATOMIC_RELAXED);
	idx_count(&idx->c_removed, (int64_t)removed);
	idx_count(&idx->c_copies, -(int64_t)removed);
	return removed;
}

int kvr_index_clear_rank(struct kvr_index *idx, uint32_t slot)
{
	if (!idx)
		return KVR_EINVAL;
	if (!kvr_index_rank_get_active(idx, slot))
		return KVR_ENOENT;
	kvr_rcu_thread_online();
	pthread_mutex_lock(&idx->wlock);
	kvr_index_clear_locked(idx, slot);
	kvr_index_retire_flush(idx, &idx->rt);
	pthread_mutex_unlock(&idx->wlock);
	return 0;
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

void kvr_index_set_count_copies(struct kvr_index *idx, bool on)
{
	if (idx)
		idx->count_copies = on;
}

size_t kvr_index_rank_blocks(struct kvr_index *idx, uint32_t slot, uint64_t *out, size_t cap)
{
	struct idx_rank *rk = idx ? kvr_index_rank_get_active(idx, slot) : NULL;
	if (!rk)
		return 0;
	pthread_mutex_lock(&idx->wlock);
	size_t n = 0;
	for (struct idx_hold *h = rk->holds; h; h = h->next) {
		for (uint32_t w = 0; w < h->nwords; w++) {
			for (uint64_t b = idx_hold_bm(h)[w]; b; b &= b - 1) {
				uint32_t pos = w * 64 + (uint32_t)__builtin_ctzll(b);
				uint64_t s = h->run->seqs[pos], e = s;
				xmap_get(&rk->rmap, s, &e);
				if (out && n < cap)
					out[n] = e;
				n++;
			}
		}
	}
	pthread_mutex_unlock(&idx->wlock);
	return n;
}
