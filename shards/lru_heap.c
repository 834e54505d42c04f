/*
 * shards/lru_heap.c - where the approximate LRU keeps its segments' hashes: one array per rank
 * (the heap) cut into chunks of K hashes (1,024 = 8 KiB for a rank of 16 Ki blocks or more;
 * the power of two in (capacity / 32, capacity / 16] below that, 4 at least, so the small ranks
 * of the tests cross chunks all the time), a segment's hashes at heap[off, off + len) inside one
 * chunk, and a count of live hashes per chunk.
 *
 * Why not an allocation per segment (as before).  A segment's array had the prompt's length
 * (8 B a hash: 32 B to 16 KiB) and arrays die in eviction order, so jemalloc's slabs of every
 * size class were left partly used: bench_footprint (8 ranks x 25,600 blocks, 2k prompts) had
 * 3.2-3.3 B per (block, rank) of slab waste in those arrays alone (measured with the arrays in
 * an arena of their own), plus size-class rounding and the arrays a trim had left up to half
 * used.  And why chunks, not one array compacted when full (tried first): eviction frees the
 * OLDEST hashes, which a sliding compaction keeps at the bottom, so every compaction moved
 * nearly every live hash (bench_lru, FIFO churn at 64 Ki blocks: seg_ops_s 20-30 % lower and
 * 13-32 us p999 with a 1/16-1/8 margin).  In chunks, hashes stored together are mostly evicted
 * together: a chunk whose live count reaches zero is free again, nothing moved.
 *
 * Allocation.  A new range of n hashes (an acquire's or a materialize's new blocks) goes into
 * the current chunk if it fits there; otherwise it takes the current chunk's rest (when that is
 * at least K/8) and then fresh chunks, K hashes a piece: ceil(n / K) or so segments linked by
 * the split chain (exactly what splits of one segment give: one stamp, one lease piece,
 * released deepest first, the head map probed at each piece's head, below the previous piece's
 * tail), the last one's chunk becoming the current one.  A smaller rest is garbage until its
 * chunk's live count reaches zero.  A current chunk whose hashes were all evicted starts again
 * from its first slot.  A split copies nothing (the right part starts at the left part's offset
 * + its length, in the same chunk); a trim only lowers its chunk's count.
 *
 * When no chunk is free and the heap holds 17/16 of the live hashes (plus the range) and one
 * chunk more, the sparsest chunks are EVACUATED: the k sparsest (the current one aside), k the
 * fewest whose live hashes, packed, leave the chunks asked for free, laid end to end in index
 * order and packed like a compaction (each segment slid down to the first slot that keeps it
 * inside one chunk: nothing moves up, so memmove in place is safe).  It asks for an eighth of
 * the heap first, then half that, ..., then what the range needs: chunks that hits keep partly
 * live (shared prefixes) get consolidated once instead of the eviction frontier's chunk being
 * merged on every allocation (bench_lru with shared prefixes: an evacuation at 1 of 32 acquires,
 * p99 3 us, before the batches; 114 in 0.6 s after, p99 as main's).  Otherwise the heap grows
 * to that size (what its size class holds; at least twice its size while below what a full
 * rank needs) by a reallocation: offsets stay, nothing is packed (growing by packing into a new
 * array at every size class cost 33k instructions a growth, 72 growths in a short run).
 * kvr_lru_heap_settle shrinks it, packed into a new array, when it holds more than twice that.  So
 * a command allocates at most once (the heap or its counts, plus a temporary sort array), in
 * kvr_lru_reserve_hashes, before it mutates (lru.c's failure model).  Segment indices never
 * change, so leases, lists and the head map are untouched by a move; only pointers into the
 * heap (seq_of) are invalid after it, and no caller holds one across a reservation or a settle.
 *
 * Context (everything here): the shard thread that owns the instance.
 */
#include <assert.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/lru_internal.h"

#define CHUNK_SHIFT_MAX 10 /* 1,024 hashes, 8 KiB */
#define CHUNK_SHIFT_MIN 2

void kvr_lru_heap_init(struct kvr_lru *lru, uint64_t capacity)
{
	uint32_t shift = CHUNK_SHIFT_MIN;
	while (shift < CHUNK_SHIFT_MAX && (capacity >> (shift + 5)) != 0)
		shift++;
	lru->chunk_shift = shift;
	lru->chunk_cur = NIL;
}

static inline uint32_t chunk_len(const struct kvr_lru *lru)
{
	return 1u << lru->chunk_shift;
}

/* The room left in the current chunk (0 if none). */
static uint32_t cur_room(const struct kvr_lru *lru)
{
	if (lru->chunk_cur == NIL)
		return 0;
	return chunk_len(lru) - (lru->chunk_live[lru->chunk_cur] ? lru->chunk_pos : 0);
}

/* What a range of n (> 0) takes from the current chunk: all of it when it fits, else the
 * chunk's rest if that is at least an eighth of a chunk (smaller rests are left as garbage
 * rather than cut the range there), else nothing. */
static uint32_t from_cur(const struct kvr_lru *lru, size_t n)
{
	uint32_t room = cur_room(lru);
	if (n <= room)
		return (uint32_t)n;
	return room >= chunk_len(lru) / 8 ? room : 0;
}

/* Fresh chunks a range of n takes. */
static size_t fresh_chunks(const struct kvr_lru *lru, size_t n)
{
	size_t rest = n - from_cur(lru, n);
	return (rest + chunk_len(lru) - 1) >> lru->chunk_shift;
}

uint32_t kvr_lru_hash_pieces(const struct kvr_lru *lru, size_t n)
{
	if (n == 0)
		return 0;
	return (uint32_t)fresh_chunks(lru, n) + (from_cur(lru, n) ? 1 : 0);
}

uint32_t kvr_lru_hash_piece_len(const struct kvr_lru *lru, size_t n)
{
	uint32_t c = from_cur(lru, n);
	if (c)
		return c;
	return n <= chunk_len(lru) ? (uint32_t)n : chunk_len(lru);
}

uint32_t kvr_lru_hashes_take(struct kvr_lru *lru, uint32_t len)
{
	if (lru->chunk_cur != NIL && lru->chunk_live[lru->chunk_cur] == 0)
		lru->chunk_pos = 0;
	if (lru->chunk_cur == NIL || lru->chunk_pos + len > chunk_len(lru)) {
		/* A free chunk (the reservation made sure of one). */
		uint32_t c = 0;
		while (lru->chunk_live[c] != 0 || c == lru->chunk_cur)
			c++;
		assert(c < lru->heap_chunks);
		lru->n_free--;
		if (lru->chunk_cur != NIL && lru->chunk_live[lru->chunk_cur] == 0)
			lru->n_free++;
		lru->chunk_cur = c;
		lru->chunk_pos = 0;
	}
	uint32_t off = (lru->chunk_cur << lru->chunk_shift) + lru->chunk_pos;
	lru->chunk_pos += len;
	lru->chunk_live[lru->chunk_cur] += len;
	return off;
}

/* Sorts the n segment indices in a by offset (offsets below top; radix, 8 bits a pass, b the
 * scratch of n); returns the array that holds the result (a or b). */
static uint32_t *sort_segs(const struct kvr_lru *lru, uint32_t *a, uint32_t *b, size_t n,
                           uint64_t top)
{
	for (unsigned shift = 0; shift < 32 && ((top - 1) >> shift) != 0; shift += 8) {
		uint32_t cnt[257] = {0};
		for (size_t j = 0; j < n; j++)
			cnt[((lru->s[a[j]].off >> shift) & 255) + 1]++;
		for (int d = 0; d < 256; d++)
			cnt[d + 1] += cnt[d];
		for (size_t j = 0; j < n; j++)
			b[cnt[(lru->s[a[j]].off >> shift) & 255]++] = a[j];
		uint32_t *t = a;
		a = b;
		b = t;
	}
	return a;
}

/* The live segments' indices sorted by offset, in a temporary array of 2 x s_live entries from
 * *base (free it with kvr_free_transient), or NULL on no memory. */
static const uint32_t *by_offset(const struct kvr_lru *lru, uint32_t **base)
{
	size_t n = lru->s_live;
	uint32_t *a = kvr_alloc_transient(2 * n * sizeof(uint32_t) + 1), k = 0;
	if (!(*base = a))
		return NULL;
	for (uint32_t i = 0; i < lru->s_cap; i++)
		if (!lru->s[i].unused)
			a[k++] = i;
	return sort_segs(lru, a, a + n, n, (uint64_t)lru->heap_chunks << lru->chunk_shift);
}

/* Where a compaction puts segment g, given the end w of what was packed before it: the first
 * slot from which it stays inside one chunk. */
static inline uint32_t pack_at(const struct kvr_lru *lru, uint32_t w, uint32_t len)
{
	uint32_t k = chunk_len(lru);
	return (w & (k - 1)) + len > k ? (w + k - 1) & ~(k - 1) : w;
}

/* A compaction's plan: the live segments in offset order (*order, from the temporary array
 * *base) and the chunks they fill packed (*used).  0 or KVR_ENOMEM. */
static int pack_plan(const struct kvr_lru *lru, uint32_t **base, const uint32_t **order,
                     uint32_t *used)
{
	if (!(*order = by_offset(lru, base)))
		return KVR_ENOMEM;
	uint32_t w = 0;
	for (size_t j = 0; j < lru->s_live; j++) {
		const struct seg *g = &lru->s[(*order)[j]];
		w = pack_at(lru, w, g->len) + g->len;
	}
	*used = (w + chunk_len(lru) - 1) >> lru->chunk_shift;
	return 0;
}

/* Carries out a plan: moves every live segment's hashes from the heap to dst (the heap itself:
 * nothing moves up, or a new array of dst_chunks >= the plan's chunks), recounts the chunks
 * (live_cap >= dst_chunks) and frees the plan. */
static void pack_move(struct kvr_lru *lru, uint32_t *base, const uint32_t *order, uint64_t *dst,
                      uint32_t dst_chunks)
{
	size_t n = lru->s_live;
	uint32_t w = 0;
	memset(lru->chunk_live, 0, (size_t)lru->live_cap * sizeof(uint32_t));
	for (size_t j = 0; j < n; j++) {
		struct seg *g = &lru->s[order[j]];
		w = pack_at(lru, w, g->len);
		if (dst != lru->heap || g->off != w)
			memmove(dst + w, lru->heap + g->off, (size_t)g->len * sizeof(uint64_t));
		g->off = w;
		lru->chunk_live[w >> lru->chunk_shift] += g->len;
		w += g->len;
	}
	kvr_free_transient(base, 2 * n * sizeof(uint32_t) + 1);
	uint32_t used = (w + chunk_len(lru) - 1) >> lru->chunk_shift;
	lru->chunk_cur = used ? used - 1 : NIL;
	lru->chunk_pos = used ? w - ((used - 1) << lru->chunk_shift) : 0;
	lru->n_free = dst_chunks - used;
	if (lru->chunk_cur != NIL && lru->chunk_live[lru->chunk_cur] == 0)
		lru->n_free++; /* its segments are all empty (none is: a live segment has len > 0)
		                */
}

/* Room for nc chunk counts.  0 or KVR_ENOMEM. */
static int live_room(struct kvr_lru *lru, uint32_t nc)
{
	if (nc <= lru->live_cap)
		return 0;
	uint32_t *v = kvr_realloc(lru->chunk_live, (size_t)lru->live_cap * sizeof(uint32_t),
	                          (size_t)nc * sizeof(uint32_t));
	if (!v)
		return KVR_ENOMEM;
	memset(v + lru->live_cap, 0, (size_t)(nc - lru->live_cap) * sizeof(uint32_t));
	lru->chunk_live = v;
	lru->live_cap = nc;
	return 0;
}

/* At least nc chunks: as many as a heap of nc chunks' size class holds (classes above 16 KiB
 * are a quarter apart: the rest of the class would be allocated and unused). */
static uint32_t chunks_fit(const struct kvr_lru *lru, uint32_t nc)
{
	size_t chunk_bytes = (size_t)chunk_len(lru) * sizeof(uint64_t);
	size_t fit = kvr_alloc_real_size((size_t)nc * chunk_bytes) / chunk_bytes;
	return fit > nc && fit < (NIL >> lru->chunk_shift) ? (uint32_t)fit : nc;
}

/* Grows the heap to at least nc chunks in place or by a copy (offsets stay: nothing is
 * packed), the new chunks free.  0 or KVR_ENOMEM (nothing changed). */
static int heap_grow(struct kvr_lru *lru, uint32_t nc)
{
	nc = chunks_fit(lru, nc);
	int rc = live_room(lru, nc);
	if (rc)
		return rc;
	size_t old = ((size_t)lru->heap_chunks << lru->chunk_shift) * sizeof(uint64_t);
	uint64_t *h =
	    kvr_realloc(lru->heap, old, ((size_t)nc << lru->chunk_shift) * sizeof(uint64_t));
	if (!h)
		return KVR_ENOMEM;
	lru->heap = h;
	lru->n_free += nc - lru->heap_chunks;
	lru->heap_chunks = nc;
	return 0;
}

/* Compacts the hashes into a new heap of at least nc chunks (more if packing them needs more)
 * plus `extra` free ones.  0 or KVR_ENOMEM (nothing moved). */
static int heap_resize(struct kvr_lru *lru, uint32_t nc, uint32_t extra)
{
	uint32_t *base, used;
	const uint32_t *order;
	int rc = pack_plan(lru, &base, &order, &used);
	if (rc)
		return rc;
	nc = chunks_fit(lru, used + extra > nc ? used + extra : nc);
	size_t bytes = ((size_t)nc << lru->chunk_shift) * sizeof(uint64_t);
	uint64_t *h = NULL;
	if ((rc = live_room(lru, nc)) || !(h = kvr_alloc(bytes))) {
		kvr_free_transient(base, 2 * (size_t)lru->s_live * sizeof(uint32_t) + 1);
		return KVR_ENOMEM;
	}
	pack_move(lru, base, order, h, nc);
	kvr_free(lru->heap, ((size_t)lru->heap_chunks << lru->chunk_shift) * sizeof(uint64_t));
	lru->heap = h;
	lru->heap_chunks = nc;
	return 0;
}

/* The chunks a heap for live hashes should have: 9/8 of them, two more. */
static size_t want_chunks(const struct kvr_lru *lru, size_t live)
{
	return ((live + live / 16 + chunk_len(lru) - 1) >> lru->chunk_shift) + 1;
}

/*
 * Frees `more` chunks by packing the live hashes of the sparsest chunks (the current one aside)
 * into as few of them as they need: the k sparsest, k the smallest for which the packed hashes
 * leave `more` of them free.  Chunks filled together are mostly evicted together, so the
 * sparse ones hold a little of what hits kept (shared prefixes), and this moves that little
 * instead of the whole heap.  The chosen chunks in index order, laid end to end, are packed like
 * a compaction (nothing moves up).  Returns 0 (done), 1 (no set of chunks would free enough:
 * nothing done) or KVR_ENOMEM.
 *
 * The live segments outside the current chunk are gathered and sorted by offset once: the
 * segments of any chosen set, in the order the packing takes them (chunks in index order, then
 * offset), are that order filtered to the set.  Trying k, k + 1, ... (when the packing would
 * waste a chunk at the boundaries) then costs a pass over them each, not a scan of every slot
 * and a sort: with segments nearly a chunk long (small ranks, whose chunks are capacity / 16 -
 * capacity / 32 hashes) several sizes were tried per call, 5.5 sorts per evacuation in
 * bench_route --lengths 2048's deep-lane regime, where evacuations were a fifth of the shard's
 * instructions.
 */
static int evacuate(struct kvr_lru *lru, size_t more)
{
	uint32_t nc = lru->heap_chunks, k = chunk_len(lru);
	size_t n = lru->s_live, bytes = ((size_t)3 * nc + 2 * n + 1) * sizeof(uint32_t);
	uint32_t *mem = kvr_alloc_transient(bytes);
	if (!mem)
		return KVR_ENOMEM;
	uint32_t *by_live = mem, *vpos = mem + nc, *set = mem + 2 * nc, *a = mem + 3 * nc,
	         *b = a + n;
	/* The candidates, sparsest first (insertion sort: tens of chunks). */
	uint32_t nv = 0;
	for (uint32_t c = 0; c < nc; c++) {
		vpos[c] = NIL;
		if (lru->chunk_live[c] == 0 || c == lru->chunk_cur)
			continue;
		uint32_t j = nv++;
		for (; j > 0 && lru->chunk_live[by_live[j - 1]] > lru->chunk_live[c]; j--)
			by_live[j] = by_live[j - 1];
		by_live[j] = c;
	}
	int rc = 1;
	uint64_t sum = 0;
	const uint32_t *order = NULL; /* the candidates' segments by offset, once needed */
	uint32_t m = 0;
	for (uint32_t take = 1; take <= nv; take++) {
		sum += lru->chunk_live[by_live[take - 1]];
		if (take < more + ((sum + k - 1) >> lru->chunk_shift))
			continue;
		if (!order) {
			for (uint32_t i = 0; i < lru->s_cap; i++)
				if (!lru->s[i].unused &&
				    (lru->s[i].off >> lru->chunk_shift) != lru->chunk_cur)
					a[m++] = i;
			order = sort_segs(lru, a, b, m, (uint64_t)nc << lru->chunk_shift);
		}
		/* The chosen chunks in index order: their places laid end to end. */
		for (uint32_t j = 0; j < take; j++) {
			uint32_t x = j, c = by_live[j];
			for (; x > 0 && set[x - 1] > c; x--)
				set[x] = set[x - 1];
			set[x] = c;
		}
		for (uint32_t j = 0; j < take; j++)
			vpos[set[j]] = j;
		uint32_t w = 0;
		for (uint32_t j = 0; j < m; j++) {
			const struct seg *g = &lru->s[order[j]];
			if (vpos[g->off >> lru->chunk_shift] != NIL)
				w = pack_at(lru, w, g->len) + g->len;
		}
		uint32_t used = (w + k - 1) >> lru->chunk_shift;
		if (used + more > take) { /* chunk-boundary waste: one more chunk */
			for (uint32_t j = 0; j < take; j++)
				vpos[set[j]] = NIL;
			continue;
		}
		for (uint32_t j = 0; j < take; j++)
			lru->chunk_live[set[j]] = 0;
		w = 0;
		for (uint32_t j = 0; j < m; j++) {
			struct seg *g = &lru->s[order[j]];
			if (vpos[g->off >> lru->chunk_shift] == NIL)
				continue; /* not in a chosen chunk (checked before it moves) */
			w = pack_at(lru, w, g->len);
			uint32_t dst =
			    (set[w >> lru->chunk_shift] << lru->chunk_shift) | (w & (k - 1));
			if (dst != g->off)
				memmove(lru->heap + dst, lru->heap + g->off,
				        (size_t)g->len * sizeof(uint64_t));
			g->off = dst;
			lru->chunk_live[dst >> lru->chunk_shift] += g->len;
			w += g->len;
		}
		lru->n_free += take - used;
		rc = 0;
		break;
	}
	kvr_free_transient(mem, bytes);
	return rc;
}

int kvr_lru_reserve_hashes(struct kvr_lru *lru, size_t n)
{
	if (n == 0)
		return 0;
	size_t fresh = fresh_chunks(lru, n);
	if (lru->n_free >= fresh)
		return 0;
	/* A compaction moves the current chunk: ask for what the range takes without it. */
	size_t need = (n + chunk_len(lru) - 1) >> lru->chunk_shift;
	size_t want = want_chunks(lru, (size_t)lru->copies + n);
	if (want + need + lru->heap_chunks >= (NIL >> lru->chunk_shift))
		return KVR_ERANGE;
	if (lru->heap_chunks >= want) {
		/* Evacuating the sparse chunks (the current one stays: `fresh` holds): as many as
		 * an eighth of the heap when that many are sparse enough, else half that, ..., at
		 * least what this range needs.  Freeing more than needed pays the scan of every
		 * segment once for several chunks, and consolidates chunks that hits keep partly
		 * live (bench_lru with shared prefixes: 13 chunks 60 % live, so that freeing one
		 * chunk at a time merged the eviction frontier's chunk every time instead). */
		size_t more = fresh - lru->n_free, batch = (lru->heap_chunks + 7) / 8;
		int rc = 1;
		for (; rc == 1 && batch > more; batch /= 2)
			rc = evacuate(lru, batch);
		if (rc == 1)
			rc = evacuate(lru, more);
		if (rc <= 0)
			return rc;
	}
	/* Below what a full rank needs, at least double (a rank filling up would otherwise copy
	 * its heap at every size class). */
	size_t nc = lru->heap_chunks + need - lru->n_free, full = want_chunks(lru, lru->capacity);
	nc = nc > want ? nc : want;
	if (nc < full) {
		size_t twice = 2 * (size_t)lru->heap_chunks;
		nc = twice < nc ? nc : twice < full ? twice : full;
	}
	if (nc + lru->heap_chunks >= (NIL >> lru->chunk_shift))
		return KVR_ERANGE;
	return heap_grow(lru, (uint32_t)nc);
}

void kvr_lru_heap_settle(struct kvr_lru *lru)
{
	size_t want = want_chunks(lru, (size_t)lru->copies);
	if (lru->heap_chunks > 2 * want)
		(void)heap_resize(lru, (uint32_t)want, 0);
}

void kvr_lru_heap_fini(struct kvr_lru *lru)
{
	kvr_free(lru->heap, ((size_t)lru->heap_chunks << lru->chunk_shift) * sizeof(uint64_t));
	kvr_free(lru->chunk_live, (size_t)lru->live_cap * sizeof(uint32_t));
	lru->heap = NULL;
	lru->chunk_live = NULL;
	lru->heap_chunks = lru->live_cap = lru->n_free = 0;
	lru->chunk_cur = NIL;
}
