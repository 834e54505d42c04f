/*
 * core/index_run.c - the run index's runs: allocation, growth, tree links, trim and death.
 *
 * A run (struct idx_run, core/index_internal.h) is a stretch of consecutive blocks of one chain.
 * Its sequence hashes are write-once: growing copies them into a larger array that is
 * published whole (the old one is retired); a one-block run keeps its hash in the header.  A
 * child hangs below a position of its parent (off) and is linked into the parent's child list
 * (O(1) unlink; max_child_off stays an upper bound until a trim needs it exact, which a walk of at
 * most MCO_WALK children gives).
 *
 * A run lives while a rank holds a position of it or a child hangs below it.  kvr_index_run_check
 * is the one place runs shrink: after removals it lowers len to what the holders' tops and the
 * children need (O(MCO_WALK) at most: trimmed positions keep their table entries, so a re-store of
 * the same block re-extends in place), and when that is nothing, deletes the run's table entries,
 * unlinks it, retires it and re-checks its parent.  Nothing here fails: removals never need memory.
 * Context: every function here runs under the index's writer mutex.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "kvrouter.h"

/* Retires r's sequence array if it has its own allocation: its header word (which readers
 * never read) becomes the retire-list link, next to the capacity. */
static void seqs_retire(struct kvr_index *idx, struct idx_run *r)
{
	if (idx_seqs_inline(r))
		return;
	uint64_t *s = idx_run_seqs(r);
	s[0] = idx_set_lo(s[0], idx->rt.seqs);
	idx->rt.seqs = s;
	idx->rt.n++;
}

static uint64_t run_bytes(const struct idx_run *r)
{
	return (uint64_t)idx_real(sizeof(*r)) +
	       (idx_seqs_inline(r) ? 0 : (uint64_t)idx_real(idx_bytes_seqs(idx_run_cap(r))));
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
	uint64_t *q = NULL;
	if (cap > 1)
		cap = idx_seqs_cap(cap);
	if ((cap > 1 && !(q = kvr_alloc(idx_bytes_seqs(cap)))) ||
	    (((uintptr_t)r | (uintptr_t)q) & ~IDX_PTR_MASK) || /* NEVER: user space < 2^48 */
	    ((uintptr_t)r & 7) != 0) {                         /* NEVER: malloc aligns to 8 */
		kvr_free(q, q ? idx_bytes_seqs(cap) : 0);
		kvr_free(r, sizeof(*r));
		return NULL;
	}
	r->first = first;
	if (q) {
		q[0] = (uint64_t)cap << IDX_HI_SHIFT; /* header word: no locator id yet */
		r->sl = (uint64_t)(uintptr_t)q;
	} else {
		r->sl = (uint64_t)(uintptr_t)&r->first;
	}
	r->po = idx_po(parent, off);
	idx_run_set_hw(r, 1);
	idx_count(&idx->bytes_shared, (int64_t)run_bytes(r));
	return r;
}

/* Frees a run never published, or (destroy) one nobody can read any more. */
void kvr_index_run_free(struct kvr_index *idx, struct idx_run *r)
{
	idx_count(&idx->bytes_shared, -(int64_t)run_bytes(r));
	kvr_index_blk_id_free(idx, r);
	if (!idx_seqs_inline(r))
		kvr_free(idx_run_seqs(r), idx_bytes_seqs(idx_run_cap(r)));
	kvr_free(r, sizeof(*r));
}

/* kvr_index_run_grow's reallocation: a larger hash array, published whole. */
__attribute__((noinline)) int kvr_index_run_grow_slow(struct kvr_index *idx, struct idx_run *r,
                                                      size_t more)
{
	uint32_t ocap = idx_run_cap(r), hw = idx_run_hw(r);
	if (hw < ocap)
		return 0; /* NEVER: kvr_index_run_grow checked */
	uint64_t cap = (uint64_t)hw + (more > 1 ? more : 1);
	if (cap < (uint64_t)hw + hw / 4 + 1) /* geometric: amortised O(1) per block */
		cap = (uint64_t)hw + hw / 4 + 1;
	const uint32_t ncap = idx_seqs_cap(cap);
	uint64_t *q = kvr_alloc(idx_bytes_seqs(ncap));
	if (!q)
		return KVR_ENOMEM;
	if ((uintptr_t)q & ~IDX_PTR_MASK) { /* NEVER: user space is below 2^48 */
		kvr_free(q, idx_bytes_seqs(ncap));
		return KVR_ENOMEM;
	}
	q[0] = (uint64_t)ncap << IDX_HI_SHIFT | idx_run_id(r);
	memcpy(q + 1, idx_run_seqs(r) + 1, (size_t)(hw - 1) * sizeof(uint64_t));
	idx_count(&idx->bytes_shared, idx_real(idx_bytes_seqs(ncap)));
	seqs_retire(idx, r);
	/* Ordering: release (idx_run_set_seqs); pairs with the acquire load of sl in
	 * find_matches: a len covering new positions is stored after this publish. */
	idx_run_set_seqs(r, q);
	return 0;
}

void kvr_index_link_child(struct idx_run *p, struct idx_run *c)
{
	if (!p)
		return;
	struct idx_run *head = idx_run_child(p);
	idx_run_set_sib_prev(c, NULL);
	idx_run_set_sib(c, head);
	if (head)
		idx_run_set_sib_prev(head, c);
	idx_run_set_child(p, c);
	if (idx_run_off(c) > idx_run_mco(p))
		idx_run_set_mco(p, idx_run_off(c));
}

/* O(1); p->max_child_off stays an upper bound until kvr_index_run_check() needs it exact. */
static void unlink_child(struct idx_run *p, struct idx_run *c)
{
	if (!p)
		return;
	struct idx_run *next = idx_run_sib(c), *prev = idx_run_sib_prev(c);
	if (prev)
		idx_run_set_sib(prev, next);
	else
		idx_run_set_child(p, next);
	if (next)
		idx_run_set_sib_prev(next, prev);
}

void kvr_index_rank_unlink_hold(struct kvr_index *idx, struct idx_hold *h)
{
	struct idx_rank *rk = &idx->rank[idx_hold_slot(h)];
	struct idx_hold *prev = idx_hold_prev(h), *next = idx_hold_next(h);
	if (prev)
		idx_hold_set_next(prev, next);
	else
		rk->holds = next;
	if (next)
		idx_hold_set_prev(next, prev);
}

void kvr_index_rank_link_hold(struct kvr_index *idx, struct idx_hold *h)
{
	struct idx_rank *rk = &idx->rank[idx_hold_slot(h)];
	idx_hold_set_prev(h, NULL);
	idx_hold_set_next(h, rk->holds);
	if (rk->holds)
		idx_hold_set_prev(rk->holds, h);
	rk->holds = h;
}

/* Removes an empty holder record from its run and its rank. */
void kvr_index_drop_hold(struct kvr_index *idx, struct idx_hold *h)
{
	struct idx_run *r = idx_hold_run(h);
	kvr_index_rank_unlink_hold(idx, h);
	struct idx_hold *y = kvr_index_hs_del(idx, r, idx_hold_slot(h));
	kvr_index_hold_free(idx, h);
	if (y) /* one holder left, with a record of its own: into the free embedded one */
		kvr_index_hold_embed(idx, r, y);
}

#define MCO_WALK 64u

/* Trims r to what its holders and children need, killing it (and re-checking its parent)
 * when that is nothing.  Never fails. */
void kvr_index_run_check(struct kvr_index *idx, struct idx_run *r)
{
	while (r) {
		uint32_t need = 0;
		const struct idx_hview v = idx_holders(r);
		for (uint32_t i = 0; i < v.n; i++)
			if (idx_hold_top(idx_hv_hold(&v, i)) > need)
				need = idx_hold_top(idx_hv_hold(&v, i));
		const uint32_t len = idx_run_len(r);
		if (need >= len)
			return;
		if (idx_run_mco(r) > need) {
			/* The bound may be stale: made exact from a walk of the children, at most
			 * MCO_WALK of them.  A longer list keeps its bound (an upper bound is all
			 * the run needs: the run is then not trimmed below it, and its trimmed
			 * positions would only have waited for it), else each child's death
			 * walked all the others when the exact value stayed above need (K
			 * children below a block no rank holds: K^2 / 2 steps under the writers'
			 * lock, 3.5 s for 40,000). */
			uint32_t mco = 0, walked = 0;
			const struct idx_run *k = idx_run_child(r);
			for (; k && walked < MCO_WALK; k = idx_run_sib(k), walked++)
				if (idx_run_off(k) > mco)
					mco = idx_run_off(k);
			if (!k && mco != idx_run_mco(r)) /* the header is the readers' line: no
			                                  * store of the same value */
				idx_run_set_mco(r, mco);
		}
		if (idx_run_mco(r) > need)
			need = idx_run_mco(r);
		if (need >= len)
			return;
		/* Trim in O(1): the trimmed positions keep their locator entries (a re-store finds
		 * them, removals find no holder there) until the run dies.
		 * Ordering: release; readers that still see the old len compare permanent content.
		 */
		idx_count(&idx->c_nodes, -(int64_t)(len - need));
		idx_run_set_len(r, need);
		if (need > 0)
			return;
		if (idx->last_run == r) /* the store's hint must not outlive its run */
			idx->last_run = NULL;
		kvr_index_blk_drop_run(idx, r);
		kvr_index_tab_delete(idx, r);
		/* Dead: nobody holds a position and no child hangs below. */
		for (struct idx_hview w; (w = idx_holders(r)).n > 0;)
			kvr_index_drop_hold(idx, idx_hv_hold(&w, 0)); /* NEVER: no record is left */
		struct idx_run *p = idx_run_parent(r);
		unlink_child(p, r);
		seqs_retire(idx, r);
		/* Release: a reader still inside its read section may load this dead run's word in
		 * idx_find_child and read the run it links (another run of the batch) before
		 * comparing; without release nothing orders that run's initialisation, by whichever
		 * shard thread allocated it, before the reader's read (TSan in stress_router:
		 * idx_find_child's read of first against kvr_index_run_new's malloc). */
		__atomic_store_n(&r->ch, (uint64_t)(uintptr_t)idx->rt.runs, __ATOMIC_RELEASE);
		idx->rt.runs = r;
		idx->rt.n++;
		r = p;
	}
}

void kvr_index_free_run_now(struct kvr_index *idx, struct idx_run *r)
{
	if (idx->last_run == r)
		idx->last_run = NULL;
	const struct idx_hview v = idx_holders(r);
	for (uint32_t i = 0; i < v.n; i++)
		if (i == 0 || idx_hv_hold(&v, i) != idx_hv_hold(&v, i - 1))
			kvr_index_hold_free(idx, idx_hv_hold(&v, i));
	struct idx_hset *hs = idx_run_set(r);
	if (hs) {
		idx_count(&idx->bytes_rank, -idx_real(idx_bytes_hset(hs->cap)));
		kvr_free(hs, idx_bytes_hset(hs->cap));
	}
	kvr_index_run_free(idx, r);
}
