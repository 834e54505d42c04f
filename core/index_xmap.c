/*
 * core/index_xmap.c - the run index's per-rank maps: ext -> place, alias bits, copy counts.
 *
 * An engine names a block by its own hash (ext); the index keys blocks by the router's sequence
 * hash (seq).  When the two differ (events mode: vLLM hashes with a per-process random seed, so
 * ext differs from seq and between ranks), the rank keeps ext -> the block's place, its (run,
 * position) (xmap: resolving a stored, removed or parent hash with no lookup by sequence hash,
 * so a run only ever held under aliases needs no block-locator entries: core/index_blocks.c,
 * "Located runs"; it was ext -> seq, then found through the locator) and, per (record, bitmap
 * word), which held positions it holds under such an alias (amap: refusing a block held under two
 * names, a removal or parent naming an aliased block by its sequence hash, and
 * kvr_index_rank_blocks, which lists the plain positions' sequence hashes and then xmap's keys).  A
 * pure rank (all its blocks aliased, as vLLM's, or none) keeps no alias bits at all: xmap's count
 * answers for every position; the bits are made when a rank starts to mix (kvr_index_alias_reserve)
 * and go when it holds no aliased block.  The same structure counts count_copies' extra copies
 * (cmap).  Approximate modes store ext == seq and never touch xmap or amap.
 *
 * Why no seq -> ext map any more.  It was a second 16-byte map per aliased block (rmap), kept
 * only to answer "does the rank hold seq under an alias, and which one": the alias bits answer
 * the first at the place the writer has found anyway (one probe of a word's entry, one entry
 * per 64 positions of a record), and the second is only ever asked by rank_blocks, an O(rank)
 * call that can walk xmap instead.  bench_index_runs --ext-hashes --mem-only (vLLM-like ranks,
 * all aliased): 64 bytes of ext maps per held (block, rank) -> 20 (docs/measurements.md).
 *
 * Open addressing, Robin Hood linear probing (an insert takes the slot of an entry closer to its
 * home, so a lookup stops as soon as it meets an entry closer to home than the key would be:
 * misses stay short at high load), backward-shift deletion (no tombstones).  An entry is empty
 * iff key == val (xmap stores key ^ place, a place is never 0; amap stores key ^ bits, bits never
 * 0; cmap's counts are small and its keys record addresses), so no occupancy word is needed: 16
 * bytes an entry.
 * The capacity is any number (fastrange home), sized to fill the allocator's size class; grown
 * past load 0.9 to ~0.65 (the mean over a growth cycle ~0.77: 21 bytes an entry; powers of two
 * grown at 0.8 sat at 0.4-0.8 and exactly 0.5 in the benchmark), shrunk below 0.25 to ~0.6, freed
 * when empty.  Growing to the next size class instead (load ~0.8, bench_index_runs --xgrow 80)
 * was measured and not taken: --ext-hashes --mem-sweep's mean 41.27 -> 39.52 bytes per held
 * block (the --mem-only point, 39.5, is the same class either way), but callgrind of
 * --ext-hashes --apply-only 765 -> 1,061 instructions per block op in 16-block calls and
 * 1,362 -> 1,629 single-block (rehashes 84 -> 241 of them, the rest longer probes).  Writer-only:
 * every call runs under the index's writer mutex; lookups are inline in core/index_internal.h.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "kvrouter.h"

#define XMAP_MIN     16
#define XMAP_GROW_AT 90 /* per cent: load past which an insert grows the map */
#define XMAP_SHRINK  25 /* per cent: load below which a removal shrinks it (to 60) */

uint64_t kvr_index_xmap_grow_to = 65;

static size_t xbytes(uint64_t cap)
{
	return (size_t)cap * sizeof(struct idx_xent);
}

/* The capacity for want entries at load pct: its bytes rounded up to the allocator's class,
 * which the map then fills. */
static uint64_t xcap_for(uint64_t want, uint64_t pct)
{
	uint64_t cap = want * 100 / pct + 1;
	if (cap < XMAP_MIN)
		cap = XMAP_MIN;
	const uint64_t real = (uint64_t)kvr_alloc_real_size(xbytes(cap)) / sizeof(struct idx_xent);
	return real > cap ? real : cap;
}

void kvr_index_xmap_put(struct idx_xmap *m, uint64_t key, uint64_t val)
{
	struct idx_xent cur = {.key = key, .val = val};
	uint64_t i = idx_xhome(m, key), d = 0;
	for (;;) {
		struct idx_xent *e = &m->e[i];
		if (!idx_xused(e)) {
			*e = cur;
			m->count++;
			return;
		}
		const uint64_t de = idx_xdist(m, e->key, i);
		if (de < d) { /* Robin Hood: the richer entry moves on */
			const struct idx_xent t = *e;
			*e = cur;
			cur = t;
			d = de;
		}
		i = i + 1 == m->cap ? 0 : i + 1;
		d++;
	}
}

static int xmap_resize(struct kvr_index *idx, struct idx_xmap *m, uint64_t cap)
{
	struct idx_xmap nm = {.cap = cap};
	nm.e = kvr_calloc(cap, sizeof(struct idx_xent));
	if (!nm.e)
		return KVR_ENOMEM;
	if (m->e) {
		for (uint64_t i = 0; i < m->cap; i++)
			if (idx_xused(&m->e[i]))
				kvr_index_xmap_put(&nm, m->e[i].key, m->e[i].val);
		kvr_free(m->e, xbytes(m->cap));
		idx_count(&idx->bytes_rank, -idx_real(xbytes(m->cap)));
	}
	idx_count(&idx->bytes_rank, idx_real(xbytes(nm.cap)));
	*m = nm;
	return 0;
}

/* Makes room for one more entry at load <= 0.9.  Returns 0 or KVR_ENOMEM. */
int kvr_index_xmap_reserve(struct kvr_index *idx, struct idx_xmap *m)
{
	const uint64_t need = m->count + 1;
	if (m->e && need * 100 <= m->cap * XMAP_GROW_AT)
		return 0;
	return xmap_resize(idx, m, xcap_for(need, kvr_index_xmap_grow_to));
}

/* Removes key (backward-shift deletion: the entries after it that are not at home move back
 * one slot, so no tombstone is left and Robin Hood's order holds). */
void kvr_index_xmap_del(struct idx_xmap *m, uint64_t key)
{
	struct idx_xent *e = idx_xmap_ref(m, key);
	if (!e)
		return;
	uint64_t i = (uint64_t)(e - m->e);
	for (;;) {
		const uint64_t j = i + 1 == m->cap ? 0 : i + 1;
		if (!idx_xused(&m->e[j]) || idx_xdist(m, m->e[j].key, j) == 0)
			break;
		m->e[i] = m->e[j];
		i = j;
	}
	m->e[i] = (struct idx_xent){0, 0};
	m->count--;
}

void kvr_index_xmap_shrink(struct kvr_index *idx, struct idx_xmap *m)
{
	if (!m->e)
		return;
	if (m->count == 0) {
		kvr_free(m->e, xbytes(m->cap));
		idx_count(&idx->bytes_rank, -idx_real(xbytes(m->cap)));
		memset(m, 0, sizeof(*m));
		return;
	}
	if (m->cap <= XMAP_MIN || m->count * 100 >= m->cap * XMAP_SHRINK)
		return;
	const uint64_t cap = xcap_for(m->count, 60);
	if (cap < m->cap)
		(void)xmap_resize(idx, m, cap); /* on failure keep the big one */
}

void kvr_index_xmap_free(struct idx_xmap *m)
{
	if (m->e)
		kvr_free(m->e, xbytes(m->cap));
	memset(m, 0, sizeof(*m));
}

/* ---------------------------------------------------------------- alias bits (amap) */

/* Makes room for k more entries at load <= 0.9.  Returns 0 or KVR_ENOMEM. */
static int xmap_reserve_n(struct kvr_index *idx, struct idx_xmap *m, uint64_t k)
{
	const uint64_t need = m->count + k;
	if (m->e && need * 100 <= m->cap * XMAP_GROW_AT)
		return 0;
	return xmap_resize(idx, m, xcap_for(need, kvr_index_xmap_grow_to));
}

int kvr_index_alias_reserve(struct kvr_index *idx, struct idx_rank *rk, bool alias, uint64_t size)
{
	if (rk->amap.e)
		return alias ? kvr_index_xmap_reserve(idx, &rk->amap) : 0;
	if (alias) /* all aliased (or empty) stays pure; all plain becomes mixed, no bit yet */
		return rk->xmap.count || size == 0 ? 0 : kvr_index_xmap_reserve(idx, &rk->amap);
	if (!rk->xmap.count)
		return 0; /* all plain stays pure */
	/* All aliased, a plain block coming: every held position gets its bit now (idx_alias_bit
	 * answers as before), one entry per nonzero bitmap word; O(rank), once per such change
	 * (the bits stay until the rank holds no aliased block or is cleared). */
	uint64_t k = 0;
	for (struct idx_hold *h = rk->holds; h; h = idx_hold_next(h))
		for (uint32_t w = 0; w < idx_hold_nwords(h); w++)
			k += idx_hold_bm(h)[w] != 0;
	if (xmap_reserve_n(idx, &rk->amap, k) != 0)
		return KVR_ENOMEM;
	for (struct idx_hold *h = rk->holds; h; h = idx_hold_next(h))
		for (uint32_t w = 0; w < idx_hold_nwords(h); w++) {
			const uint64_t bits = idx_hold_bm(h)[w], key = idx_alias_key(h, w * 64);
			if (bits)
				kvr_index_xmap_put(&rk->amap, key, key ^ bits);
		}
	return 0;
}

void kvr_index_alias_settle(struct kvr_index *idx, struct idx_rank *rk)
{
	if (rk->amap.e && rk->xmap.count == __atomic_load_n(&rk->size, __ATOMIC_RELAXED))
		rk->amap.count = 0; /* all aliased again (or empty): pure, the map goes */
	kvr_index_xmap_shrink(idx, &rk->amap);
}

void kvr_index_alias_set(struct idx_rank *rk, const struct idx_hold *h, uint32_t pos)
{
	if (!rk->amap.e)
		return; /* pure */
	const uint64_t key = idx_alias_key(h, pos), bit = 1ull << (pos % 64);
	struct idx_xent *e = idx_xmap_ref(&rk->amap, key);
	if (e)
		e->val ^= bit; /* val = key ^ bits, the bit clear in bits (not aliased yet) */
	else
		kvr_index_xmap_put(&rk->amap, key, key ^ bit);
}

void kvr_index_alias_clear(struct idx_rank *rk, const struct idx_hold *h, uint32_t pos)
{
	if (!rk->amap.e)
		return; /* pure */
	const uint64_t key = idx_alias_key(h, pos), bit = 1ull << (pos % 64);
	struct idx_xent *e = idx_xmap_ref(&rk->amap, key);
	if (!e || !((e->key ^ e->val) & bit))
		return;
	if ((e->key ^ e->val) == bit)
		kvr_index_xmap_del(&rk->amap, key); /* its last bit: the entry goes (before it
		                                     * would read as empty in the probe chain) */
	else
		e->val ^= bit;
}

void kvr_index_alias_move(struct idx_rank *rk, const struct idx_hold *from,
                          const struct idx_hold *to, uint32_t nwords)
{
	if (!rk->amap.e)
		return; /* pure: nothing keyed by the record */
	for (uint32_t wi = 0; wi < nwords && rk->amap.count; wi++) {
		const uint64_t bits = idx_alias_word(rk, from, wi);
		if (!bits)
			continue;
		const uint64_t k0 = idx_alias_key(from, wi * 64), k1 = idx_alias_key(to, wi * 64);
		kvr_index_xmap_del(&rk->amap, k0);
		kvr_index_xmap_put(&rk->amap, k1, k1 ^ bits); /* room: k0's entry just went */
	}
}
