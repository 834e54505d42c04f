/*
 * core/index_hold.c - the run index's holders: per-(rank, run) records and per-run holder sets.
 *
 * A record (struct idx_hold, writer-only) keeps a bitmap of the positions of one run one rank
 * holds, so an interior removal (a hole) only clears a bit and never needs memory; from it follow
 * the gap-free prefix CUT, the top (highest held position + 1) and the count.  With
 * count_copies, positions held more than once carry an extra-copy count in a small side array.
 *
 * A holder set (struct idx_hset) is what readers see of a run's holders: one word per rank,
 * slot << 32 | cut, sorted by slot, copy-on-write when a rank joins or leaves (the old set goes
 * to the retire batch), cut changes stored in place.  A run whose ONE holder is its embedded
 * record (the first holder's: core/index_internal.h) has no set: run->hs is that holder's word
 * (most runs have one holder: this saves the set's 32 bytes and the reader's miss on it); a
 * single holder with a record of its own (the embedded one left first) keeps a set of one.
 * Writers see both shapes through idx_holders().  A leave without memory for
 * the smaller copy overwrites the rank's word with a neighbour's: readers skip adjacent duplicates
 * and take the largest cut, writers keep duplicates equal, the next join or leave compacts them.
 *
 * Ordering: cuts are relaxed stores; a cut only covers positions whose content is permanent and
 * whose run len was released before (core/index_match.c credits min(cut, matched)).  Sets are
 * published with a release (kvr_rcu_publish), paired with the acquire load in find_matches.
 * Context: every function here runs under the index's writer mutex.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "core/index_tops.h"
#include "kvrouter.h"

/* ---------------------------------------------------------------- holder records */

static inline bool hold_emb(const struct idx_hold *h)
{
	return (idx_hi(h->nw) & IDX_HOLD_EMB_HI) != 0;
}

/* What the record takes besides its run: an embedded one, its bitmap only. */
static uint64_t hold_bytes(const struct idx_hold *h)
{
	const uint32_t nw = idx_hold_nwords(h);
	return (hold_emb(h) ? 0 : (uint64_t)idx_real(sizeof(*h))) +
	       (nw > 1 ? (uint64_t)idx_real((uint64_t)nw * 8) : 0);
}

/* Bitmap words to cover pos: a power of two (the record keeps its log2). */
static uint32_t words_for(uint32_t pos)
{
	uint32_t nw = 1;
	while (nw * 64 <= pos)
		nw *= 2;
	return nw;
}

struct idx_hold *kvr_index_hold_new(struct kvr_index *idx, struct idx_run *run, uint32_t slot,
                                    uint32_t pos)
{
	const uint32_t nw = words_for(pos);
	uint64_t *bm = NULL;
	if (nw > 1 && !(bm = kvr_calloc(nw, 8)))
		return NULL;
	struct idx_hold *h;
	if (!idx_run_eh_used(run)) { /* the run's own record: its first holder's */
		h = &run->eh;
		h->rw = idx_set_hi(h->rw, slot & 0xffff); /* keeps the sibling link */
		h->nw = IDX_HOLD_EMB_HI << IDX_HI_SHIFT;
	} else {
		if (!(h = kvr_alloc(sizeof(*h)))) {
			kvr_free(bm, bm ? (size_t)nw * 8 : 0);
			return NULL;
		}
		h->rw = (uint64_t)(uintptr_t)run | (uint64_t)(slot & 0xffff) << IDX_HI_SHIFT;
		h->nw = 0;
	}
	h->pw = (uint64_t)(slot >> 16) << IDX_HI_SHIFT;
	h->bm0 = 0;
	idx_hold_set_nwords(h, nw);
	if (bm)
		h->bm = bm;
	idx_count(&idx->bytes_rank, (int64_t)hold_bytes(h));
	return h;
}

void kvr_index_hold_free(struct kvr_index *idx, struct idx_hold *h)
{
	idx_count(&idx->bytes_rank, -(int64_t)hold_bytes(h));
	if (idx_hold_nwords(h) > 1)
		kvr_free(h->bm, (size_t)idx_hold_nwords(h) * 8);
	if (hold_emb(h)) { /* back to free; the run word keeps the sibling link */
		h->rw = idx_lo_ptr(h->rw);
		h->pw = h->nw = h->bm0 = 0;
		return;
	}
	kvr_free(h, sizeof(*h));
}

/* kvr_index_hold_reserve's reallocation: the bitmap doubles (or more) to cover pos. */
__attribute__((noinline, cold)) int kvr_index_hold_reserve_slow(struct kvr_index *idx,
                                                                struct idx_hold *h, uint32_t pos)
{
	const uint32_t ow = idx_hold_nwords(h);
	if (pos / 64 < ow)
		return 0;                   /* NEVER: kvr_index_hold_reserve checked */
	const uint32_t nw = words_for(pos); /* at least twice ow: amortised O(1) */
	uint64_t *bm = kvr_calloc(nw, 8);
	if (!bm)
		return KVR_ENOMEM;
	memcpy(bm, idx_hold_bm(h), (size_t)ow * 8);
	idx_count(&idx->bytes_rank,
	          idx_real((uint64_t)nw * 8) - (ow > 1 ? idx_real((uint64_t)ow * 8) : 0));
	if (ow > 1)
		kvr_free(h->bm, (size_t)ow * 8);
	h->bm = bm;
	idx_hold_set_nwords(h, nw);
	return 0;
}

/* The gap-free cut from c (a held position, or the top): the first clear position at or after
 * c, at most top. */
static uint32_t cut_from(const uint64_t *bm, uint32_t nw, uint32_t c, uint32_t top)
{
	while (c / 64 < nw) {
		/* The shift brings in zeros above bit 63 - c % 64, which ~ makes look like a
		 * gap: only a gap below them ends the cut here, else go on to the next word
		 * (stopping at the word's end under-credited a refilled hole by up to 63 blocks
		 * per word boundary). */
		const uint32_t rest = 64 - c % 64;
		uint64_t w = ~(bm[c / 64] >> (c % 64));
		uint32_t z = w ? (uint32_t)__builtin_ctzll(w) : 64;
		if (z < rest) {
			c += z;
			break;
		}
		c += rest;
	}
	return c < top ? c : top;
}

/* Sets pos (the bitmap covers it); advances the gap-free cut over what follows. */
void kvr_index_hold_set(struct idx_hold *h, uint32_t pos)
{
	uint64_t *bm = idx_hold_bm(h);
	bm[pos / 64] |= 1ull << (pos % 64);
	uint32_t top = idx_hold_top(h);
	if (pos + 1 > top)
		idx_hold_set_top(h, top = pos + 1);
	if (pos != idx_hold_cut(h))
		return;
	idx_hold_set_cut(h, cut_from(bm, idx_hold_nwords(h), pos, top));
}

/* Sets [pos, pos + k), all clear (the bitmap covers them): what k calls of kvr_index_hold_set in
 * order leave, with one cut scan instead of k (a store of k consecutive blocks). */
void kvr_index_hold_set_range(struct idx_hold *h, uint32_t pos, uint32_t k)
{
	uint64_t *bm = idx_hold_bm(h);
	for (uint32_t p = pos, end = pos + k; p < end;) {
		const uint32_t b = p % 64, m = end - p < 64 - b ? end - p : 64 - b;
		bm[p / 64] |= (m == 64 ? ~0ull : ((1ull << m) - 1)) << b;
		p += m;
	}
	uint32_t top = idx_hold_top(h);
	if (pos + k > top)
		idx_hold_set_top(h, top = pos + k);
	/* The cut is at most pos (clear before): it moves iff it was pos (no gap below). */
	if (pos == idx_hold_cut(h))
		idx_hold_set_cut(h, cut_from(bm, idx_hold_nwords(h), pos, top));
}

/* The top (highest set position + 1, or 0) of a bitmap with no bit set past word w. */
static uint32_t top_below(const uint64_t *bm, uint32_t w)
{
	for (w++; w-- > 0;)
		if (bm[w])
			return w * 64 + 64 - (uint32_t)__builtin_clzll(bm[w]);
	return 0;
}

void kvr_index_hold_clear(struct idx_hold *h, uint32_t pos)
{
	uint64_t *bm = idx_hold_bm(h);
	bm[pos / 64] &= ~(1ull << (pos % 64));
	if (pos < idx_hold_cut(h))
		idx_hold_set_cut(h, pos);
	if (pos + 1 != idx_hold_top(h))
		return;
	idx_hold_set_top(h, top_below(bm, pos / 64));
}

/* Clears [pos, pos + k), all set: what k calls of kvr_index_hold_clear in order leave (only the
 * last can be the top's position: the others are set below it), one top scan at most. */
void kvr_index_hold_clear_range(struct idx_hold *h, uint32_t pos, uint32_t k)
{
	uint64_t *bm = idx_hold_bm(h);
	for (uint32_t p = pos, end = pos + k; p < end;) {
		const uint32_t b = p % 64, m = end - p < 64 - b ? end - p : 64 - b;
		bm[p / 64] &= ~((m == 64 ? ~0ull : ((1ull << m) - 1)) << b);
		p += m;
	}
	if (pos < idx_hold_cut(h))
		idx_hold_set_cut(h, pos);
	if (pos + k == idx_hold_top(h))
		idx_hold_set_top(h, top_below(bm, (pos + k - 1) / 64));
}

/* Copy counts (count_copies): extra copies of a held position, in the rank's cmap keyed by
 * the record and the position (a record lives while it holds a position, and a position's
 * extra copies go before it does, so a key never outlives its record). */
static inline uint64_t copy_key(const struct idx_hold *h, uint32_t pos)
{
	return (uint64_t)(uintptr_t)h << 16 | pos;
}

int kvr_index_copy_reserve(struct kvr_index *idx, struct idx_hold *h, uint32_t pos)
{
	struct idx_xmap *m = &idx->rank[idx_hold_slot(h)].cmap;
	if (idx_xmap_ref(m, copy_key(h, pos)))
		return 0;
	return kvr_index_xmap_reserve(idx, m);
}

void kvr_index_copy_inc(struct kvr_index *idx, struct idx_hold *h, uint32_t pos)
{
	struct idx_xmap *m = &idx->rank[idx_hold_slot(h)].cmap;
	struct idx_xent *e = idx_xmap_ref(m, copy_key(h, pos));
	if (e)
		e->val++;
	else
		kvr_index_xmap_put(m, copy_key(h, pos), 1);
}

/* Drops one extra copy of pos; false when pos has none. */
bool kvr_index_copy_dec(struct kvr_index *idx, struct idx_hold *h, uint32_t pos)
{
	struct idx_xmap *m = &idx->rank[idx_hold_slot(h)].cmap;
	struct idx_xent *e = m->count ? idx_xmap_ref(m, copy_key(h, pos)) : NULL;
	if (!e)
		return false;
	if (--e->val == 0)
		kvr_index_xmap_del(m, copy_key(h, pos));
	return true;
}

/* ---------------------------------------------------------------- holder sets */

/* Index of the first entry of slot in v, or -1. */
static int64_t hs_find(struct idx_hview v, uint32_t slot)
{
	uint32_t lo = 0, hi = v.n;
	while (lo < hi) {
		uint32_t mid = (lo + hi) / 2;
		if (idx_hslot(v.e[mid]) < slot)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < v.n && idx_hslot(v.e[lo]) == slot ? (int64_t)lo : -1;
}

struct idx_hold *kvr_index_hold_of(const struct idx_run *r, uint32_t slot)
{
	struct idx_hview v = idx_holders(r);
	int64_t i = hs_find(v, slot);
	return i < 0 ? NULL : idx_hv_hold(&v, (uint32_t)i);
}

/* Mirrors h->cut into the run's holder words (every duplicate).  A word that already says so is
 * not stored again: a store of the same value still takes the line from every reader's cache
 * (a store that extends a rank's blocks above a hole leaves its cut where it was).
 * Ordering: relaxed; a cut covers positions whose content is permanent and whose len was
 * released before (index_match.c credits min(cut, matched)). */
void kvr_index_publish_cut(struct idx_hold *h)
{
	const uint32_t slot = idx_hold_slot(h);
	struct idx_hview v = idx_holders(idx_hold_run(h));
	int64_t i = hs_find(v, slot);
	if (i < 0)
		return; /* NEVER */
	uint64_t w = ((uint64_t)slot << 32) | idx_hold_cut(h);
	for (uint32_t k = (uint32_t)i; k < v.n && idx_hslot(v.e[k]) == slot; k++)
		if (v.e[k] != w) /* only writers store the words: a plain read is exact */
			__atomic_store_n(&v.e[k], w, __ATOMIC_RELAXED);
}

static struct idx_hset *hs_alloc(struct kvr_index *idx, uint32_t cap)
{
	struct idx_hset *hs = kvr_alloc(idx_bytes_hset(cap));
	if (hs) {
		hs->cap = cap;
		hs->n = 0;
		hs->next_free = NULL;
		idx_count(&idx->bytes_rank, idx_real(idx_bytes_hset(cap)));
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

/* Adds h (cut 0) to r's holders: the inline single holder when r has none (no memory), else
 * a new published set.  Returns 0 or KVR_ENOMEM (unchanged). */
int kvr_index_hs_add(struct kvr_index *idx, struct idx_run *r, struct idx_hold *h)
{
	const uint32_t slot = idx_hold_slot(h);
	struct idx_hset *old = idx_run_set(r);
	if (!old && h == &r->eh) { /* nobody else holds r: h is in use since kvr_index_hold_new */
		/* Ordering: release (pairs with the acquire load of hs in find_matches); the cut
		 * (0 here) is raised by publish_cut after the blocks. */
		__atomic_store_n(&r->hs, (uint64_t)slot << 32, __ATOMIC_RELEASE);
		return 0;
	}
	const struct idx_hview o = idx_holders(r); /* without h (not in a set yet) */
	struct idx_hset *hs = hs_alloc(idx, o.n + 1);
	if (!hs)
		return KVR_ENOMEM;
	struct idx_hold **nh = idx_hset_holds(hs);
	uint32_t k = 0;
	bool put = false;
	for (uint32_t i = 0; i < o.n; i++) {
		uint64_t w = __atomic_load_n(&o.e[i], __ATOMIC_RELAXED);
		if (!put && slot < idx_hslot(w)) {
			hs->e[k] = (uint64_t)slot << 32;
			nh[k++] = h;
			put = true;
		}
		if (k > 0 && idx_hslot(hs->e[k - 1]) == idx_hslot(w))
			continue; /* a duplicate left by hs_del without memory */
		hs->e[k] = w;
		nh[k++] = idx_hv_hold(&o, i);
	}
	if (!put) {
		hs->e[k] = (uint64_t)slot << 32;
		nh[k++] = h;
	}
	hs->n = k;
	/* Ordering: release; pairs with the acquire load of r->hs in find_matches (a reader that
	 * loaded the single holder's word before this keeps that word). */
	__atomic_store_n(&r->hs, IDX_HS_SET | (uint64_t)(uintptr_t)hs, __ATOMIC_RELEASE);
	hs_retire(idx, old);
	return 0;
}

/* Removes slot from r's holders.  Never fails: down to the embedded record alone, or to none,
 * it goes inline (no memory); without memory for a smaller set, the slot's words are
 * overwritten in place with a neighbour's (one atomic word each).  Down to one holder whose
 * record is its own, it changes nothing and returns that record, for kvr_index_hold_embed once
 * the leaving record is freed (which frees the embedded one if that was it). */
struct idx_hold *kvr_index_hs_del(struct kvr_index *idx, struct idx_run *r, uint32_t slot)
{
	const struct idx_hview v = idx_holders(r);
	int64_t at = hs_find(v, slot);
	if (at < 0)
		return NULL;
	uint32_t distinct = 0;
	for (uint32_t i = 0; i < v.n; i++)
		if (idx_hslot(v.e[i]) != slot &&
		    (i == 0 || idx_hslot(v.e[i - 1]) != idx_hslot(v.e[i])))
			distinct++;
	struct idx_hset *o = idx_run_set(r);
	uint64_t w = 0;
	struct idx_hold *hh = NULL;
	for (uint32_t i = 0; distinct <= 1 && i < v.n; i++)
		if (idx_hslot(v.e[i]) != slot) {
			w = v.e[i];
			hh = idx_hv_hold(&v, i);
			break;
		}
	if (distinct == 0 || hh == &r->eh) {
		/* Ordering: release; pairs with the acquire load of hs in find_matches. */
		__atomic_store_n(&r->hs, w, __ATOMIC_RELEASE);
		hs_retire(idx, o);
		return NULL;
	}
	if (distinct == 1)
		return hh; /* o != NULL: without a set a run has one holder, the embedded one */
	struct idx_hset *hs = hs_alloc(idx, distinct);
	if (!hs) {
		uint32_t nb = at > 0 ? (uint32_t)at - 1 : UINT32_MAX;
		if (nb == UINT32_MAX)
			for (uint32_t i = 0; i < o->n; i++)
				if (idx_hslot(o->e[i]) != slot) {
					nb = i;
					break;
				}
		struct idx_hold **oh = idx_hset_holds(o);
		for (uint32_t i = (uint32_t)at; i < o->n && idx_hslot(o->e[i]) == slot; i++) {
			oh[i] = oh[nb];
			__atomic_store_n(&o->e[i], o->e[nb], __ATOMIC_RELAXED);
		}
		return NULL;
	}
	struct idx_hold **oh = idx_hset_holds(o), **nh = idx_hset_holds(hs);
	uint32_t k = 0;
	for (uint32_t i = 0; i < o->n; i++) {
		if (idx_hslot(o->e[i]) == slot ||
		    (k > 0 && idx_hslot(hs->e[k - 1]) == idx_hslot(o->e[i])))
			continue;
		hs->e[k] = o->e[i];
		nh[k++] = oh[i];
	}
	hs->n = k;
	__atomic_store_n(&r->hs, IDX_HS_SET | (uint64_t)(uintptr_t)hs, __ATOMIC_RELEASE);
	hs_retire(idx, o);
	return NULL;
}

/* Moves y, r's only holder, into r's free embedded record: its rank-list links, its bitmap,
 * its copy counts (count_copies: keyed by the record's address), then r's holder word inline
 * and the set retired.  What kvr_index_hs_del returned, after the leaving record was freed: a
 * run whose first holder left keeps no set of one and no second record (80 bytes, not 80 + 32
 * + 32).  Never fails (a copy count's entry is deleted before its new key goes in). */
void kvr_index_hold_embed(struct kvr_index *idx, struct idx_run *r, struct idx_hold *y)
{
	struct idx_hold *e = &r->eh;
	struct idx_hset *o = idx_run_set(r);
	if (idx_run_eh_used(r) || !o)
		return; /* NEVER: kvr_index_hs_del returns y only with a set, the embedded free */
	const uint32_t slot = idx_hold_slot(y);
	struct idx_tkey k; /* without the locator: y's end-map entries move to e */
	if (idx->no_locator) {
		kvr_index_tops_key(y, &k);
		kvr_index_tops_del(idx, y, &k);
	}
	e->rw = idx_set_hi(e->rw, slot & 0xffff);
	e->pw = y->pw;
	e->nw = y->nw | IDX_HOLD_EMB_HI << IDX_HI_SHIFT;
	e->bm0 = y->bm0; /* the bitmap word, or its pointer */
	kvr_index_rank_unlink_hold(idx, y);
	kvr_index_rank_link_hold(idx, e);
	if (idx->no_locator)
		kvr_index_tops_put(idx, e, &k); /* room: y's were just deleted */
	struct idx_rank *rk = &idx->rank[slot];
	kvr_index_alias_move(rk, y, e, idx_hold_nwords(e)); /* keyed by the address too */
	if (rk->cmap.count) {
		const uint64_t *bm = idx_hold_bm(e);
		for (uint32_t wi = 0; wi < idx_hold_nwords(e); wi++)
			for (uint64_t b = bm[wi]; b; b &= b - 1) {
				const uint32_t pos = wi * 64 + (uint32_t)__builtin_ctzll(b);
				uint64_t c;
				if (!idx_xmap_get(&rk->cmap, copy_key(y, pos), &c))
					continue;
				kvr_index_xmap_del(&rk->cmap, copy_key(y, pos));
				kvr_index_xmap_put(&rk->cmap, copy_key(e, pos), c);
			}
	}
	/* Ordering: release; pairs with the acquire load of hs in find_matches. */
	__atomic_store_n(&r->hs, (uint64_t)slot << 32 | idx_hold_cut(e), __ATOMIC_RELEASE);
	hs_retire(idx, o);
	idx_count(&idx->bytes_rank, -idx_real(sizeof(*y)));
	kvr_free(y, sizeof(*y));
}
