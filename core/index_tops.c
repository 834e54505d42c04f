/*
 * core/index_tops.c - finding a rank's blocks without the block locator: the ranks' end maps,
 * the exact lookup built on them, and the walk from the root.
 *
 * Why.  The block locator (core/index_blocks.c) lets a writer find ANY block by its hash: 4-6
 * bytes per distinct block, most of the index's memory past the hashes themselves (issue 10:
 * 19.5 bytes per held block for 16-block runs with one holder, the locator and its directory
 * 5.6 of them).  In the approximate modes the router writes the index itself, and what it
 * writes has a shape: an admission stores a prompt chain from the root (the path is known: the
 * prompt's own hashes), an output continues the attempt's chain, and the predicted cache evicts
 * chain TAILS (shards/lru.h: each evicted run's last block has no child left), or under TTL
 * retention mostly chain HEADS (the oldest blocks of a chain expire first).  A rank's blocks in
 * one run are then [0, top) (or [lo, top) after heads expired), and the blocks a write names are
 * a record's ends or next to the block the write touched before.  So, with
 * kvr_index_set_locator(idx, false):
 *  - each rank keeps an END MAP: its (run) records by the hash of their deepest held position
 *    (top - 1; a record whose top is 1 needs none, the run table finds a run's first block) and,
 *    for a record with nothing held at position 0, of its lowest held position.  One 8-byte
 *    word per (rank, run) record instead of ~5 bytes per block: for runs of 16 blocks with one
 *    holder 0.6-0.9 bytes per block (load 0.53-0.8);
 *  - a lookup of a block a rank holds (kvr_index_find_held) tries the positions next to the
 *    block the writer touched last (a chain is stored and evicted in order), the run table (a
 *    run's first block), the end map, and only then scans the rank's records: EXACT for any
 *    input (holes, interior removals, parents anywhere), so kvr_index_store / _remove keep their
 *    documented semantics in this mode, only their cost depends on the input's shape.  The scan
 *    is counted (kvr_index_stats.rank_scans);
 *  - an admission names its parent by the path from the root (kvr_index_store_path): a walk like
 *    the readers' (a run's far end compared, a binary search where it differs, one table probe
 *    per run);
 *  - a removal of evicted runs (kvr_index_remove_runs) looks each run's last block up first (a
 *    tail's: a record's top), else its first (a head's: a run's first block or a record's lowest
 *    position), then walks the run from there block by block through the positions next to the
 *    last one.
 * The end map's entries are keyed by hashes the records' positions hold, recomputed from the
 * record (so an entry is one word and a deletion shifts the entries after it back, no tombstone),
 * and they change with a record's top or lowest position: writers take a record's keys before
 * changing it and update the map after (idx_tops_before / idx_tops_after).  A removal never
 * allocates: an entry that finds no room (past load 0.9) is skipped, which only sends later
 * lookups of that record to the scan.  A growth rehashes the rank's entries at once (one record
 * read per entry: 1,600 records for a rank of 25,600 blocks in runs of 16), in stores only.
 * Context: every function here runs under the index's writer mutex, in an index without the
 * locator.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "core/index_tops.h"
#include "kvrouter.h"

#define TOPS_MIN 8u

static inline uint64_t t_mix(uint64_t seq)
{
	return kvr_place(seq);
}

static inline uint32_t t_home(uint64_t seq, uint32_t cap)
{
	return (uint32_t)(((t_mix(seq) >> 32) * cap) >> 32);
}

static inline uint64_t t_tag(uint64_t seq)
{
	return (t_mix(seq) >> 16) & 0xffff;
}

static inline uint64_t t_ent(const struct idx_hold *h, uint64_t seq, bool lo)
{
	return t_tag(seq) << 48 | (uint64_t)(uintptr_t)h | (lo ? 1u : 0u);
}

static inline struct idx_hold *t_hold(uint64_t e)
{
	return (struct idx_hold *)(uintptr_t)(e & IDX_PTR_MASK & ~1ull);
}

/* The lowest held position of h (its top when it holds nothing). */
static uint32_t lo_of(const struct idx_hold *h)
{
	const uint64_t *bm = idx_hold_bm((struct idx_hold *)(uintptr_t)h);
	for (uint32_t w = 0; w < idx_hold_nwords(h); w++)
		if (bm[w])
			return w * 64 + (uint32_t)__builtin_ctzll(bm[w]);
	return idx_hold_top(h);
}

void kvr_index_tops_key(const struct idx_hold *h, struct idx_tkey *k)
{
	const struct idx_run *r = idx_hold_run(h);
	const uint32_t top = idx_hold_top(h);
	k->has_top = top >= 2;
	k->top = k->has_top ? idx_run_hash(r, top - 1) : 0;
	k->has_lo = false;
	k->lo = 0;
	if (top >= 3 && idx_hold_cut(h) == 0) {
		const uint32_t lo = lo_of(h);
		if (lo + 1 < top) {
			k->has_lo = true;
			k->lo = idx_run_hash(r, lo);
		}
	}
}

/* The key of entry e: its record's current one, or ovk's for the record ov (whose entries
 * were made for ovk and which has changed since). */
static uint64_t ent_key(uint64_t e, const struct idx_hold *ov, const struct idx_tkey *ovk)
{
	const struct idx_hold *h = t_hold(e);
	if (h == ov)
		return (e & 1) ? ovk->lo : ovk->top;
	struct idx_tkey k;
	kvr_index_tops_key(h, &k);
	return (e & 1) ? k.lo : k.top;
}

static bool t_put(struct idx_tmap *m, uint64_t seq, uint64_t v)
{
	/* Past load 0.9 skip it: lookups of that record fall back to the scan. */
	if (!m->e || ((uint64_t)m->count + 1) * 10 > (uint64_t)m->cap * 9)
		return false;
	uint32_t i = t_home(seq, m->cap);
	while (m->e[i])
		i = i + 1 == m->cap ? 0 : i + 1;
	m->e[i] = v;
	m->count++;
	return true;
}

/* Deletes entry v (key seq) if present, shifting the entries after it back. */
static void t_del(struct idx_tmap *m, uint64_t seq, uint64_t v, const struct idx_hold *ov,
                  const struct idx_tkey *ovk)
{
	if (!m->e)
		return;
	const uint32_t cap = m->cap;
	uint32_t i = t_home(seq, cap);
	while (m->e[i] != v) {
		if (!m->e[i])
			return; /* skipped when it was put */
		i = i + 1 == cap ? 0 : i + 1;
	}
	for (uint32_t j = i;;) {
		j = j + 1 == cap ? 0 : j + 1;
		const uint64_t e = m->e[j];
		if (!e)
			break;
		const uint32_t k = t_home(ent_key(e, ov, ovk), cap);
		/* e may fill the hole at i unless its home lies cyclically in (i, j]. */
		const bool stays = i <= j ? (k > i && k <= j) : (k > i || k <= j);
		if (!stays) {
			m->e[i] = e;
			i = j;
		}
	}
	m->e[i] = 0;
	m->count--;
}

void kvr_index_tops_del(struct kvr_index *idx, const struct idx_hold *h, const struct idx_tkey *k)
{
	struct idx_tmap *m = &idx->rank[idx_hold_slot(h)].tops;
	if (k->has_top)
		t_del(m, k->top, t_ent(h, k->top, false), h, k);
	if (k->has_lo)
		t_del(m, k->lo, t_ent(h, k->lo, true), h, k);
}

void kvr_index_tops_put(struct kvr_index *idx, struct idx_hold *h, const struct idx_tkey *k)
{
	struct idx_tmap *m = &idx->rank[idx_hold_slot(h)].tops;
	if (k->has_top)
		t_put(m, k->top, t_ent(h, k->top, false));
	if (k->has_lo)
		t_put(m, k->lo, t_ent(h, k->lo, true));
}

void kvr_index_tops_update(struct kvr_index *idx, struct idx_hold *h, const struct idx_tkey *old)
{
	struct idx_tkey k;
	kvr_index_tops_key(h, &k);
	const bool top_same = k.has_top == old->has_top && k.top == old->top;
	const bool lo_same = k.has_lo == old->has_lo && k.lo == old->lo;
	if (top_same && lo_same)
		return;
	struct idx_tmap *m = &idx->rank[idx_hold_slot(h)].tops;
	/* Both deletions first, while h's other entry still has its old key (ent_key). */
	if (!top_same && old->has_top)
		t_del(m, old->top, t_ent(h, old->top, false), h, old);
	if (!lo_same && old->has_lo)
		t_del(m, old->lo, t_ent(h, old->lo, true), h, old);
	if (!top_same && k.has_top)
		t_put(m, k.top, t_ent(h, k.top, false));
	if (!lo_same && k.has_lo)
		t_put(m, k.lo, t_ent(h, k.lo, true));
}

/* Smallest capacity of 8, 12, 16, 24, 32, ... (1.5x and 2x steps: allocator classes of 8-byte
 * words) with load <= 0.6. */
static uint32_t cap_for(uint64_t count)
{
	uint64_t cap = TOPS_MIN;
	while (count * 5 > cap * 3)
		cap = (cap & (cap - 1)) ? (cap & (cap - 1)) << 1 : cap + cap / 2;
	return (uint32_t)cap;
}

/* Rehashes the map into cap slots.  Returns 0 or KVR_ENOMEM (unchanged). */
static int t_rebuild(struct kvr_index *idx, struct idx_tmap *m, uint32_t cap)
{
	uint64_t *ne = kvr_calloc(cap, sizeof(uint64_t));
	if (!ne)
		return KVR_ENOMEM;
	for (uint32_t i = 0; m->e && i < m->cap; i++) {
		const uint64_t e = m->e[i];
		if (!e)
			continue;
		uint32_t j = t_home(ent_key(e, NULL, NULL), cap);
		while (ne[j])
			j = j + 1 == cap ? 0 : j + 1;
		ne[j] = e;
	}
	if (m->e) {
		kvr_free(m->e, (size_t)m->cap * sizeof(uint64_t));
		idx_count(&idx->bytes_rank, -idx_real((uint64_t)m->cap * sizeof(uint64_t)));
	}
	idx_count(&idx->bytes_rank, idx_real((uint64_t)cap * sizeof(uint64_t)));
	m->e = ne;
	m->cap = cap;
	return 0;
}

bool kvr_index_tops_room(const struct kvr_index *idx, uint32_t slot, uint32_t k)
{
	const struct idx_tmap *m = &idx->rank[slot].tops;
	return m->e && ((uint64_t)m->count + k) * 5 <= (uint64_t)m->cap * 4;
}

int kvr_index_tops_reserve(struct kvr_index *idx, uint32_t slot, uint32_t k)
{
	if (kvr_index_tops_room(idx, slot, k))
		return 0;
	struct idx_tmap *m = &idx->rank[slot].tops;
	return t_rebuild(idx, m, cap_for((uint64_t)m->count + k));
}

void kvr_index_tops_free(struct kvr_index *idx, uint32_t slot)
{
	struct idx_tmap *m = &idx->rank[slot].tops;
	if (m->e) {
		kvr_free(m->e, (size_t)m->cap * sizeof(uint64_t));
		idx_count(&idx->bytes_rank, -idx_real((uint64_t)m->cap * sizeof(uint64_t)));
	}
	memset(m, 0, sizeof(*m));
}

void kvr_index_tops_shrink(struct kvr_index *idx, uint32_t slot)
{
	struct idx_tmap *m = &idx->rank[slot].tops;
	if (!m->e)
		return;
	if (m->count == 0 && !idx->rank[slot].holds)
		kvr_index_tops_free(idx, slot);
	else if (m->cap > TOPS_MIN && (uint64_t)m->count * 8 < m->cap)
		(void)t_rebuild(idx, m, cap_for(m->count)); /* keeps the old one without memory */
}

/* ---------------------------------------------------------------- lookups */

enum held { H_YES, H_UNKNOWN };

/* The slot's answer for block seq at (r, q), where the tree has it: H_YES when the slot holds
 * it there, else H_UNKNOWN, never "not held".  Without the locator a hash may sit at TWO
 * places: a root store whose local hash (its sequence hash) is an interior block's elsewhere
 * is not detected (only the locator finds interior blocks; caller-supplied hashes, or a 64-bit
 * collision), so a place the slot does not hold does not say it holds the block nowhere: the
 * lookup goes on to the end map and the scan.  Only a block the slot does not hold pays them (a
 * not-found removal or parent); a held one is answered where it was before. */
static enum held held_at(struct idx_run *r, uint32_t q, uint32_t slot, struct idx_run **ro,
                         uint32_t *pos, struct idx_hold **ho)
{
	struct idx_hold *h = kvr_index_hold_of(r, slot);
	if (!h || !idx_hold_bit(h, q))
		return H_UNKNOWN;
	*ro = r;
	*pos = q;
	*ho = h;
	return H_YES;
}

/* Positions hp, hp + 1, hp - 1 of hr, and the parent's block above position 0. */
static enum held near(const struct idx_run *chr, uint32_t hp, uint64_t seq, uint32_t slot,
                      struct idx_run **r, uint32_t *pos, struct idx_hold **h)
{
	struct idx_run *hr = (struct idx_run *)(uintptr_t)chr;
	const uint32_t hw = idx_run_hw(hr);
	if (hp < hw && idx_run_hash(hr, hp) == seq)
		return held_at(hr, hp, slot, r, pos, h);
	if (hp + 1 < hw && idx_run_hash(hr, hp + 1) == seq)
		return held_at(hr, hp + 1, slot, r, pos, h);
	if (hp > 0 && hp - 1 < hw && idx_run_hash(hr, hp - 1) == seq)
		return held_at(hr, hp - 1, slot, r, pos, h);
	struct idx_run *p = idx_run_parent(hr);
	if (hp == 0 && p && idx_run_hash(p, idx_run_off(hr) - 1) == seq)
		return held_at(p, idx_run_off(hr) - 1, slot, r, pos, h);
	return H_UNKNOWN;
}

static enum held find_cheap(struct kvr_index *idx, uint32_t slot, uint64_t seq,
                            const struct idx_run *hr, uint32_t hp, struct idx_run **r,
                            uint32_t *pos, struct idx_hold **h)
{
	enum held a;
	if (hr && (a = near(hr, hp, seq, slot, r, pos, h)) != H_UNKNOWN)
		return a;
	if (idx->last_run && idx->last_run != hr &&
	    (a = near(idx->last_run, idx->last_pos, seq, slot, r, pos, h)) != H_UNKNOWN)
		return a;
	struct idx_run *f = kvr_index_tab_first(idx, seq);
	if (f && (a = held_at(f, 0, slot, r, pos, h)) != H_UNKNOWN)
		return a;
	/* The end map: a record whose deepest or lowest held position is seq. */
	const struct idx_tmap *m = &idx->rank[slot].tops;
	if (!m->e)
		return H_UNKNOWN;
	const uint64_t tag = t_tag(seq);
	for (uint32_t i = t_home(seq, m->cap);; i = i + 1 == m->cap ? 0 : i + 1) {
		const uint64_t e = m->e[i];
		if (!e)
			return H_UNKNOWN;
		if (e >> 48 != tag)
			continue;
		struct idx_hold *c = t_hold(e);
		struct idx_run *cr = idx_hold_run(c);
		const uint32_t top = idx_hold_top(c);
		/* Checked against the record as it is now (a removal in progress may have
		 * changed it since its entry was made): the position must be held. */
		const uint32_t q = (e & 1) ? lo_of(c) : top - 1;
		if (top > 0 && q < top && idx_run_hash(cr, q) == seq && idx_hold_bit(c, q)) {
			*r = cr;
			*pos = q;
			*h = c;
			return H_YES;
		}
	}
}

bool kvr_index_find_held_fast(struct kvr_index *idx, uint32_t slot, uint64_t seq,
                              const struct idx_run *hr, uint32_t hp, struct idx_run **r,
                              uint32_t *pos, struct idx_hold **h)
{
	return find_cheap(idx, slot, seq, hr, hp, r, pos, h) == H_YES;
}

bool kvr_index_find_held(struct kvr_index *idx, uint32_t slot, uint64_t seq,
                         const struct idx_run *hr, uint32_t hp, struct idx_run **r, uint32_t *pos,
                         struct idx_hold **h)
{
	const enum held a = find_cheap(idx, slot, seq, hr, hp, r, pos, h);
	if (a != H_UNKNOWN)
		return a == H_YES;
	/* The scan: every held position of every record of the slot. */
	idx_count(&idx->c_rank_scans, 1);
	for (struct idx_hold *c = idx->rank[slot].holds; c; c = idx_hold_next(c)) {
		struct idx_run *cr = idx_hold_run(c);
		const uint64_t *bm = idx_hold_bm(c);
		for (uint32_t w = 0; w < idx_hold_nwords(c); w++)
			for (uint64_t b = bm[w]; b; b &= b - 1) {
				const uint32_t q = w * 64 + (uint32_t)__builtin_ctzll(b);
				if (idx_run_hash(cr, q) == seq) {
					*r = cr;
					*pos = q;
					*h = c;
					return true;
				}
			}
	}
	return false;
}

bool kvr_index_next_at(const struct kvr_index *idx, const struct idx_run *R, uint32_t p, uint64_t s,
                       struct idx_run **c, uint32_t *q)
{
	if (R && p + 1 < idx_run_hw(R) && idx_run_hash(R, p + 1) == s) {
		*c = (struct idx_run *)(uintptr_t)R;
		*q = p + 1;
		return true;
	}
	struct idx_run *f = kvr_index_tab_first(idx, s);
	if (!f)
		return false;
	*c = f;
	*q = 0;
	return true;
}

bool kvr_index_walk(const struct kvr_index *idx, const uint64_t *path, size_t stride, size_t np,
                    struct idx_run **r, uint32_t *pos)
{
	struct idx_run *R = kvr_index_tab_first(idx, path[0]);
	if (!R || R->po != idx_po(NULL, 0))
		return false;
	uint32_t p = 0;
	for (size_t i = 1; i < np;) {
		/* path[i] would sit at R's position p + 1; the stretch R has of the rest. */
		const uint32_t len = idx_run_len(R);
		const size_t m0 = len - 1 - p, m = m0 < np - i ? m0 : np - i;
		if (m > 0) {
			/* A hash names its prefix: the far end equal, the whole stretch is. */
			if (idx_run_hash(R, p + (uint32_t)m) == path[(i + m - 1) * stride]) {
				p += (uint32_t)m;
				i += m;
				continue;
			}
			size_t lo = 0, hi = m; /* lo blocks match, the hi-th does not */
			while (hi - lo > 1) {
				const size_t mid = (lo + hi) / 2;
				if (idx_run_hash(R, p + (uint32_t)mid) ==
				    path[(i + mid - 1) * stride])
					lo = mid;
				else
					hi = mid;
			}
			p += (uint32_t)lo;
			i += lo;
		}
		/* path[i] leaves R below position p: a child run starting there. */
		struct idx_run *c = kvr_index_tab_first(idx, path[i * stride]);
		if (!c || c->po != idx_po(R, p + 1))
			return false;
		R = c;
		p = 0;
		i++;
	}
	*r = R;
	*pos = p;
	return true;
}
