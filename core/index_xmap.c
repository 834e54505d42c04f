/*
 * core/index_xmap.c - the run index's per-rank ext <-> seq maps (events mode).
 *
 * An engine names a block by its own hash (ext); the index keys blocks by the router's sequence
 * hash (seq).  When the two differ (events mode), the rank keeps ext -> seq (xmap: resolving a
 * removed or parent hash) and seq -> ext (rmap: answering kvr_index_rank_blocks and refusing a
 * block held under two names).  Approximate modes store ext == seq and never touch them.
 *
 * Open addressing with linear probing and backward-shift deletion (no tombstones, probes stay
 * short under churn); an entry is empty iff key == val, since the maps only hold ext != seq, so
 * no separate occupancy word is needed (16 bytes an entry).  Grown at load 0.8, shrunk to load
 * <= 0.4 below 1/8.  Writer-only: every call runs under the index's writer mutex; the lookup is
 * inline in core/index_internal.h.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "kvrouter.h"

#define XMAP_MIN 16

static size_t xbytes(uint64_t mask)
{
	return (size_t)(mask + 1) * sizeof(struct idx_xent);
}

void kvr_index_xmap_put(struct idx_xmap *m, uint64_t key, uint64_t val)
{
	uint64_t i = idx_xhome(m, key);
	while (idx_xused(&m->e[i]))
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
			if (idx_xused(&m->e[i]))
				kvr_index_xmap_put(&nm, m->e[i].key, m->e[i].val);
		kvr_free(m->e, xbytes(m->mask));
		idx_count(&idx->bytes_rank, -idx_real(xbytes(m->mask)));
	}
	idx_count(&idx->bytes_rank, idx_real(xbytes(nm.mask)));
	*m = nm;
	return 0;
}

/* Makes room for one more entry at load <= 0.8.  Returns 0 or KVR_ENOMEM. */
int kvr_index_xmap_reserve(struct kvr_index *idx, struct idx_xmap *m)
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
void kvr_index_xmap_del(struct idx_xmap *m, uint64_t key)
{
	if (!m->e)
		return;
	uint64_t i = idx_xhome(m, key);
	for (;; i = (i + 1) & m->mask) {
		if (!idx_xused(&m->e[i]))
			return;
		if (m->e[i].key == key)
			break;
	}
	m->e[i] = (struct idx_xent){0, 0};
	m->count--;
	for (uint64_t j = (i + 1) & m->mask; idx_xused(&m->e[j]); j = (j + 1) & m->mask) {
		uint64_t k = idx_xhome(m, m->e[j].key);
		/* Move e[j] into the hole at i unless its home lies cyclically in (i, j]. */
		if (((j - k) & m->mask) >= ((j - i) & m->mask)) {
			m->e[i] = m->e[j];
			m->e[j] = (struct idx_xent){0, 0};
			i = j;
		}
	}
}

void kvr_index_xmap_shrink(struct kvr_index *idx, struct idx_xmap *m)
{
	if (!m->e)
		return;
	if (m->count == 0) {
		kvr_free(m->e, xbytes(m->mask));
		idx_count(&idx->bytes_rank, -idx_real(xbytes(m->mask)));
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
