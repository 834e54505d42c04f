/*
 * core/index_run.c - the run index's runs: allocation, growth, tree links, trim and death.
 *
 * A run (struct idx_run, core/index_internal.h) is a stretch of consecutive blocks of one chain.
 * Its sequence hashes are write-once: growing copies them into a larger array that is
 * published whole (the old one is retired); a one-block run keeps its hash in the header.  A
 * child hangs below a position of its parent (off) and is linked into the parent's child list
 * (O(1) unlink; max_child_off stays an upper bound until a trim needs it exact).
 *
 * A run lives while a rank holds a position of it or a child hangs below it.  kvr_index_run_check
 * is the one place runs shrink: after removals it lowers len to what the holders' tops and the
 * children need (O(1): trimmed positions keep their table entries, so a re-store of the same
 * block re-extends in place), and when that is nothing, deletes the run's table entries, unlinks
 * it, retires it and re-checks its parent.  Nothing here fails: removals never need memory.
 * Context: every function here runs under the index's writer mutex.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "kvrouter.h"

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
struct idx_run *kvr_index_run_new(struct kvr_index *idx, struct idx_run *parent, uint32_t off,
                                  uint32_t cap, uint64_t first)
{
	struct idx_run *r = kvr_alloc(sizeof(*r));
	if (!r)
		return NULL;
	memset(r, 0, sizeof(*r));
	struct idx_seqs *q = NULL;
	if ((cap > 1 && !(q = kvr_alloc(idx_bytes_seqs(cap)))) ||
	    ((uintptr_t)r & ~IDX_PTR_MASK) || /* NEVER: user space is below 2^48 */
	    ((uintptr_t)r & 7) != 0) {        /* NEVER: malloc aligns to 8 */
		kvr_free(q, q ? idx_bytes_seqs(cap) : 0);
		kvr_free(r, sizeof(*r));
		return NULL;
	}
	r->first = first;
	if (q) {
		q->cap = cap;
		q->id = 0;
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
void kvr_index_run_free(struct kvr_index *idx, struct idx_run *r)
{
	idx_count(&idx->bytes_shared, -(int64_t)run_bytes(r));
	kvr_index_blk_id_free(idx, r);
	if (!idx_seqs_inline(r))
		kvr_free(idx_seqs_hdr(r->seqs), idx_bytes_seqs(idx_run_cap(r)));
	kvr_free(r, sizeof(*r));
}

/* Makes room for one more position, sized for `more` coming.  Returns 0 or KVR_ENOMEM. */
int kvr_index_run_grow(struct kvr_index *idx, struct idx_run *r, size_t more)
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
	q->id = idx_run_id(r);
	q->next_free = NULL;
	memcpy(q->s, r->seqs, (size_t)r->hw * sizeof(uint64_t));
	idx_count(&idx->bytes_shared, (int64_t)idx_bytes_seqs(q->cap));
	seqs_retire(idx, r);
	/* Ordering: release; pairs with the acquire load of seqs in find_matches (which loads
	 * len first: a len covering new positions was stored after this publish). */
	kvr_rcu_publish(&r->seqs, q->s);
	return 0;
}

void kvr_index_link_child(struct idx_run *p, struct idx_run *c)
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

/* O(1); p->max_child_off stays an upper bound until kvr_index_run_check() needs it exact. */
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

void kvr_index_rank_link_hold(struct kvr_index *idx, struct idx_hold *h)
{
	struct idx_rank *rk = &idx->rank[h->slot];
	h->prev = NULL;
	h->next = rk->holds;
	if (rk->holds)
		rk->holds->prev = h;
	rk->holds = h;
}

/* Removes an empty holder record from its run and its rank. */
void kvr_index_drop_hold(struct kvr_index *idx, struct idx_hold *h)
{
	rank_unlink_hold(idx, h);
	kvr_index_hs_del(idx, h->run, h->slot);
	kvr_index_hold_free(idx, h);
}

/* Trims r to what its holders and children need, killing it (and re-checking its parent)
 * when that is nothing.  Never fails. */
void kvr_index_run_check(struct kvr_index *idx, struct idx_run *r)
{
	while (r) {
		uint32_t need = 0;
		const struct idx_hview v = idx_holders(r);
		for (uint32_t i = 0; i < v.n; i++)
			if (idx_hv_hold(&v, i)->top > need)
				need = idx_hv_hold(&v, i)->top;
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
		/* Trim in O(1): the trimmed positions keep their locator entries (a re-store finds
		 * them, removals find no holder there) until the run dies.
		 * Ordering: release; readers that still see the old len compare permanent content.
		 */
		idx_count(&idx->c_nodes, -(int64_t)(r->len - need));
		__atomic_store_n(&r->len, (uint16_t)need, __ATOMIC_RELEASE);
		if (need > 0)
			return;
		kvr_index_blk_drop_run(idx, r);
		kvr_index_tab_delete(idx, r);
		/* Dead: nobody holds a position and no child hangs below. */
		for (struct idx_hview w; (w = idx_holders(r)).n > 0;)
			kvr_index_drop_hold(idx, idx_hv_hold(&w, 0)); /* NEVER: no record is left */
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
	const struct idx_hview v = idx_holders(r);
	for (uint32_t i = 0; i < v.n; i++)
		if (i == 0 || idx_hv_hold(&v, i) != idx_hv_hold(&v, i - 1))
			kvr_index_hold_free(idx, idx_hv_hold(&v, i));
	struct idx_hset *hs = idx_run_set(r);
	if (hs) {
		idx_count(&idx->bytes_rank, -(int64_t)idx_bytes_hset(hs->cap));
		kvr_free(hs, idx_bytes_hset(hs->cap));
	}
	kvr_index_run_free(idx, r);
}
