/*
 * core/index_remove.c - the run index's removals: removed events (kvr_index_remove, _remove_runs),
 * cleared ranks and workers, and the rank's block list.
 *
 * Removals never need memory: they clear bits, lower cuts and let kvr_index_run_check trim or
 * free what nobody needs.  A removal names blocks by hash; where each one sits is found next to
 * the block removed before (an evicted run is named in chain order, so the next block is the
 * position after or, walked backwards, before the last one: shorten_run / lower_run apply a
 * stretch of them in one step), else through the block locator (core/index_blocks.c) or,
 * in an index without one, kvr_index_find_held (core/index_tops.c: the run table, the rank's end
 * map, a scan of the rank's records).  Without the locator each run of the list is walked from
 * the end that is cheap to find: its last block when that is a record's deepest position (an
 * evicted tail), else its first (a run's first block or a record's lowest position: an expired
 * head), else backwards from its last through the exact lookup.  The order blocks are removed in
 * does not change the outcome: each named block the rank holds leaves it (one copy of it with
 * count_copies), each one it does not hold counts as not found.
 * Context: every writer call takes the index's writer mutex.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "core/index_tops.h"
#include "kvrouter.h"

/* A removal in progress: the record it is removing from and the position it removed last. */
struct rm {
	struct kvr_index *idx;
	struct idx_rank *rk;
	uint32_t slot;
	struct idx_run *R; /* NULL: none yet */
	struct idx_hold *h;
	uint32_t p;
	struct idx_tkey k0; /* h's end-map keys when the removal started on it */
	size_t nf, left, removed, dropped;
};

/* Done with the current record: its end-map keys updated, the record dropped when empty, its run
 * trimmed or killed. */
static void rm_leave(struct rm *c)
{
	if (!c->R)
		return;
	idx_tops_after(c->idx, c->h, &c->k0);
	if (idx_hold_top(c->h) == 0) /* holds nothing */
		kvr_index_drop_hold(c->idx, c->h);
	kvr_index_run_check(c->idx, c->R);
	c->R = NULL;
	c->h = NULL;
}

/* Removal goes on in run C with the slot's record ch (found before the current one is left: ch
 * holds a position of C, so leaving the current run, which may kill it, keeps C alive). */
static void rm_enter(struct rm *c, struct idx_run *C, struct idx_hold *ch)
{
	if (C == c->R)
		return;
	rm_leave(c);
	c->R = C;
	c->h = ch;
	idx_tops_before(c->idx, ch, &c->k0);
}

/*
 * The fast path of removals going on along R after its position p (an evicted tail, named in
 * chain order): how many of ext[i..] are R's positions p+1.. held by the record h, removed in
 * one step (bits cleared, the cut lowered and published once, the top found once), exactly as
 * block by block.  Only for a rank with no ext hash aliases and without copy counts.  Returns 0
 * when ext[i] does not qualify.
 */
static size_t shorten_run(struct rm *c, const uint64_t *ext, size_t i, size_t n)
{
	if (!c->R || n - i < 2 || c->rk->xmap.count || c->idx->count_copies)
		return 0; /* a last block: the block-by-block path costs no more */
	const uint32_t len = idx_run_len(c->R), q = c->p + 1;
	const uint64_t *rs = idx_run_seqs(c->R);
	size_t k = 0;
	while (i + k < n && q + k < len && rs[q + k] == ext[i + k] &&
	       idx_hold_bit(c->h, q + (uint32_t)k))
		k++;
	if (k == 0)
		return 0;
	const uint32_t cut0 = idx_hold_cut(c->h);
	kvr_index_hold_clear_range(c->h, q, (uint32_t)k);
	if (idx_hold_cut(c->h) != cut0)
		kvr_index_publish_cut(c->h);
	c->p += (uint32_t)k;
	return k;
}

/* The same walking backwards (an evicted run read from its last block): how many of ext[j],
 * ext[j-1], .. ext[lo] are R's positions p-1, p-2, .. held by h, removed in one step. */
static size_t lower_run(struct rm *c, const uint64_t *ext, size_t j, size_t lo)
{
	if (!c->R || j == lo || c->p == 0 || c->rk->xmap.count || c->idx->count_copies)
		return 0;
	size_t k = 0;
	while (k <= j - lo && k < c->p &&
	       idx_run_hash(c->R, c->p - 1 - (uint32_t)k) == ext[j - k] &&
	       idx_hold_bit(c->h, c->p - 1 - (uint32_t)k))
		k++;
	if (k < 2)
		return 0; /* one block: the block-by-block path */
	const uint32_t cut0 = idx_hold_cut(c->h), q = c->p - (uint32_t)k;
	kvr_index_hold_clear_range(c->h, q, (uint32_t)k);
	if (idx_hold_cut(c->h) != cut0)
		kvr_index_publish_cut(c->h);
	c->p = q;
	return k;
}

/* Where the slot holds block s (ext hash e), for the block-by-block path: *C, *q, *ch. */
static bool rm_find(struct rm *c, uint64_t s, struct idx_run **C, uint32_t *q, struct idx_hold **ch)
{
	struct kvr_index *idx = c->idx;
	if (idx->no_locator)
		return kvr_index_find_held(idx, c->slot, s, c->R, c->p, C, q, ch);
	const struct idx_run *R = c->R;
	if (R && c->p + 1 < idx_run_len(R) && idx_run_seqs(R)[c->p + 1] == s) { /* no probe */
		*C = c->R;
		*q = c->p + 1;
	} else if (!(R ? idx_locate(idx, s, R, c->p, C, q) : idx_near_last(idx, s, C, q))) {
		return false;
	}
	*ch = *C == R ? c->h : kvr_index_hold_of(*C, c->slot);
	if (*ch && idx_hold_bit(*ch, *q))
		return true;
	/* Not the slot's there: a crafted root may have put the hash at a second place. */
	return kvr_index_blk_other_held(idx, s, c->slot, C, q, ch);
}

/* Removes ext[j] (one copy of it with count_copies), or counts it not found. */
static void rm_one(struct rm *c, uint64_t e)
{
	struct idx_run *C;
	struct idx_hold *ch;
	uint32_t q;
	const bool via = idx_ext_place(c->rk, e, &C, &q); /* an alias: its place */
	if (via) {
		ch = C == c->R ? c->h : kvr_index_hold_of(C, c->slot);
		if (!ch || !idx_hold_bit(ch, q)) { /* NEVER: the map holds held blocks */
			c->nf++;
			return;
		}
	} else if (!rm_find(c, e, &C, &q, &ch) || idx_alias_bit(c->rk, ch, q)) {
		c->nf++; /* not held, or held under an alias and named by its sequence hash */
		return;
	}
	rm_enter(c, C, ch);
	c->p = q;
	c->removed++;
	if (c->idx->count_copies && kvr_index_copy_dec(c->idx, c->h, q))
		return; /* one copy of several goes: the block stays */
	const uint32_t cut0 = idx_hold_cut(c->h);
	kvr_index_hold_clear(c->h, q);
	if (idx_hold_cut(c->h) != cut0)
		kvr_index_publish_cut(c->h);
	c->dropped++;
	c->left++;
	if (via) {
		kvr_index_xmap_del(&c->rk->xmap, e);
		kvr_index_alias_clear(c->rk, c->h, q);
	}
}

/* ext[i..e) in chain order, forwards (shorten_run's steps where they apply). */
static void rm_forward(struct rm *c, const uint64_t *ext, size_t i, size_t e)
{
	for (; i < e; i++) {
		const size_t k = shorten_run(c, ext, i, e);
		if (k) {
			c->removed += k;
			c->dropped += k;
			c->left += k;
			i += k - 1;
			continue;
		}
		rm_one(c, ext[i]);
	}
}

/* ext[i..e) from the last, backwards (lower_run's steps where they apply). */
static void rm_backward(struct rm *c, const uint64_t *ext, size_t i, size_t e)
{
	for (size_t j = e; j-- > i;) {
		const size_t k = lower_run(c, ext, j, i);
		if (k) {
			c->removed += k;
			c->dropped += k;
			c->left += k;
			j -= k - 1;
			continue;
		}
		rm_one(c, ext[j]);
	}
}

/* Without the locator: one run ext[i..e) (a chain, parent first, expected), from the end that
 * is cheap to find. */
static void rm_run(struct rm *c, const uint64_t *ext, size_t i, size_t e)
{
	struct kvr_index *idx = c->idx;
	struct idx_run *C;
	struct idx_hold *ch;
	uint32_t q;
	uint64_t s = ext[e - 1];
	if (e - i < 2 || c->rk->xmap.count ||
	    kvr_index_find_held_fast(idx, c->slot, s, c->R, c->p, &C, &q, &ch)) {
		rm_backward(c, ext, i, e);
		return;
	}
	s = ext[i];
	if (kvr_index_find_held_fast(idx, c->slot, s, c->R, c->p, &C, &q, &ch))
		rm_forward(c, ext, i, e);
	else
		rm_backward(c, ext, i, e);
}

size_t kvr_index_remove_locked(struct kvr_index *idx, struct idx_rank *rk, uint32_t slot,
                               const uint64_t *ext, size_t n, const uint32_t *run_len,
                               size_t n_runs, size_t *removed, size_t *dropped)
{
	struct rm c = {.idx = idx, .rk = rk, .slot = slot};
	if (!idx->no_locator) {
		rm_forward(&c, ext, 0, n);
	} else if (!run_len) {
		if (n)
			rm_run(&c, ext, 0, n);
	} else {
		size_t i = 0;
		for (size_t k = 0; k < n_runs && i < n; k++) {
			const size_t e = run_len[k] < n - i ? i + run_len[k] : n;
			if (e > i)
				rm_run(&c, ext, i, e);
			i = e;
		}
		if (i < n) /* what the lengths do not cover: one run */
			rm_run(&c, ext, i, n);
	}
	if (c.R) {
		idx->last_run = c.R; /* cleared by run_check if it dies */
		idx->last_pos = c.p;
		rm_leave(&c);
	}
	if (c.left) /* once per call, published in steps (kvr_index_store says why) */
		idx_size_set(idx, rk, slot, rk->size - c.left);
	*removed += c.removed;
	*dropped += c.dropped;
	return c.nf;
}

static int remove_common(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                         const uint32_t *run_len, size_t n_runs, size_t *n_not_found)
{
	if (n_not_found)
		*n_not_found = 0;
	if (!idx || (!ext && n > 0) || (!run_len && n_runs > 0))
		return KVR_EINVAL;
	struct idx_rank *rk;
	int go = idx_write_begin(idx, slot, n, &rk);
	if (go <= 0)
		return go;
	size_t removed = 0, dropped = 0;
	size_t nf =
	    kvr_index_remove_locked(idx, rk, slot, ext, n, run_len, n_runs, &removed, &dropped);
	if (removed) {
		kvr_index_xmap_shrink(idx, &rk->xmap);
		kvr_index_xmap_shrink(idx, &rk->amap);
		kvr_index_xmap_shrink(idx, &rk->cmap);
		if (idx->no_locator)
			kvr_index_tops_shrink(idx, slot);
	}
	if (nf)
		idx_count(&idx->c_block_nf, (int64_t)nf);
	if (removed) {
		idx_count(&idx->c_removed, (int64_t)removed);
		idx_count(&idx->c_copies, -(int64_t)removed);
	}
	idx_flush_if_due(idx);
	pthread_mutex_unlock(&idx->wlock);
	if (n_not_found)
		*n_not_found = nf;
	return 0;
}

int kvr_index_remove(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                     size_t *n_not_found)
{
	return remove_common(idx, slot, ext, n, NULL, 0, n_not_found);
}

int kvr_index_remove_runs(struct kvr_index *idx, uint32_t slot, const uint64_t *ext, size_t n,
                          const uint32_t *run_len, size_t n_runs, size_t *n_not_found)
{
	return remove_common(idx, slot, ext, n, run_len, n_runs, n_not_found);
}

uint64_t kvr_index_clear_locked(struct kvr_index *idx, uint32_t slot)
{
	struct idx_rank *rk = &idx->rank[slot];
	uint64_t removed = 0;
	while (rk->holds) {
		struct idx_hold *h = rk->holds;
		struct idx_run *r = idx_hold_run(h);
		if (idx->no_locator) { /* its end-map entries go before its keys change */
			struct idx_tkey k;
			kvr_index_tops_key(h, &k);
			kvr_index_tops_del(idx, h, &k);
		}
		uint64_t *bm = idx_hold_bm(h);
		for (uint32_t w = 0; w < idx_hold_nwords(h); w++) {
			removed += (uint64_t)__builtin_popcountll(bm[w]);
			bm[w] = 0;
		}
		idx_hold_set_cut(h, 0);
		idx_hold_set_top(h, 0);
		kvr_index_publish_cut(h);
		kvr_index_drop_hold(idx, h);
		kvr_index_run_check(idx, r);
		if (idx->rt.n >= IDX_RETIRE_BATCH * 16)
			kvr_index_retire_flush(idx, &idx->rt);
	}
	for (uint64_t i = 0; rk->cmap.e && i < rk->cmap.cap; i++)
		if (idx_xused(&rk->cmap.e[i]))
			removed += rk->cmap.e[i].val; /* extra copies */
	kvr_index_tops_free(idx, slot);
	rk->xmap.count = rk->amap.count = rk->cmap.count = 0;
	kvr_index_xmap_shrink(idx, &rk->xmap);
	kvr_index_xmap_shrink(idx, &rk->amap);
	kvr_index_xmap_shrink(idx, &rk->cmap);
	idx_size_set(idx, rk, slot, 0); /* 0 is always published */
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
	if (kvr_rcu_thread_online() != 0) /* as remove_common: nothing cleared */
		return KVR_ENOMEM;
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
	/* First, so that KVR_ENOMEM clears no rank rather than some. */
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	int found = 0;
	uint32_t used = __atomic_load_n(&idx->fresh, __ATOMIC_RELAXED); /* above: never used */
	for (uint32_t s = 0; s < used; s++) {
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
	if (!idx)
		return;
	pthread_mutex_lock(&idx->wlock);
	if (idx->count_copies && !on) {
		/* Counting off, a held block is one copy: the extras go now (counted removed, as
		 * a removal of them would be).  Left in the copy maps they kept the copies gauge
		 * above what is held, and outlived their records once the block went (one removal
		 * drops it, copy_dec unasked), so a record later allocated at the same address
		 * would have inherited them. */
		uint64_t extra = 0;
		const uint32_t used = __atomic_load_n(&idx->fresh, __ATOMIC_RELAXED);
		for (uint32_t s = 0; s < used; s++) {
			struct idx_rank *rk = &idx->rank[s];
			if (__atomic_load_n(&rk->state, __ATOMIC_RELAXED) != SLOT_ACTIVE)
				continue; /* cleared when it was removed */
			for (uint64_t i = 0; rk->cmap.e && i < rk->cmap.cap; i++)
				if (idx_xused(&rk->cmap.e[i]))
					extra += rk->cmap.e[i].val;
			rk->cmap.count = 0;
			kvr_index_xmap_shrink(idx, &rk->cmap); /* frees it */
		}
		idx_count(&idx->c_removed, (int64_t)extra);
		idx_count(&idx->c_copies, -(int64_t)extra);
	}
	idx->count_copies = on;
	pthread_mutex_unlock(&idx->wlock);
}

size_t kvr_index_rank_blocks(struct kvr_index *idx, uint32_t slot, uint64_t *out, size_t cap)
{
	struct idx_rank *rk = idx ? kvr_index_rank_get_active(idx, slot) : NULL;
	if (!rk)
		return 0;
	pthread_mutex_lock(&idx->wlock);
	size_t n = 0;
	/* The blocks held under their sequence hash, then those held under an alias: xmap's keys
	 * (their positions carry alias bits). */
	for (struct idx_hold *h = rk->holds; h; h = idx_hold_next(h)) {
		for (uint32_t w = 0; w < idx_hold_nwords(h); w++) {
			uint64_t b = idx_hold_bm(h)[w] & ~idx_alias_word(rk, h, w);
			for (; b; b &= b - 1) {
				uint32_t pos = w * 64 + (uint32_t)__builtin_ctzll(b);
				if (out && n < cap)
					out[n] = idx_run_hash(idx_hold_run(h), pos);
				n++;
			}
		}
	}
	for (uint64_t i = 0; i < rk->xmap.cap; i++) {
		if (!idx_xused(&rk->xmap.e[i]))
			continue;
		if (out && n < cap)
			out[n] = rk->xmap.e[i].key;
		n++;
	}
	pthread_mutex_unlock(&idx->wlock);
	return n;
}
