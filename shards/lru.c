/*
 * shards/lru.c - capacity-bounded approximate LRU of one rank, kept in RUNS of blocks (issue 5
 * part A; rebuilt for issue 11 item 3).
 *
 * The policy (unchanged).  vLLM's block pool reference-counts physical blocks.  A finished
 * request frees its blocks tail first into a free queue; a prefix-cache hit pulls a block back
 * out; allocation evicts from the queue's head.  So the eviction order is: least recently
 * released first, and within one release the deepest block first (then the lowest copy id).
 * One hash can live in several physical copies (two requests computed the same output block at
 * once).  A hit reuses the OLDEST copy of each hash.  We mirror that per rank, from routing
 * decisions alone.  tests/ref/lru_ref.c is the per-block implementation of exactly this policy,
 * the oracle of tests/unit/test_lru_diff.c (both keep_private settings).
 *
 * Why runs.  The per-block version paid a hash-map probe, a 48-byte copy record and a list
 * link per block, ~100+ ns per block on every admission, release and eviction, and a lease
 * array entry per block: a 2,000-block booking held the shard for hundreds of microseconds.
 * But the copies a request takes are consecutive blocks of one chain, and they are taken,
 * released and (deepest first) evicted together.  So the unit here is a SEGMENT: consecutive
 * copies of one chain with ONE refcount, ONE place in the inactive order, one creation stamp,
 * and an array of their sequence hashes (8 bytes a block, the only per-block memory).
 *  - A hit on part of a segment SPLITS it (the hit part changes refcount, the rest does not).
 *  - A release appends the lease's segments that reach refcount 0 to the inactive list, deepest
 *    first; eviction TRIMS the list head's segment from its tail, m blocks at a time, and
 *    reports them as one run.  Within one release all positions are distinct (a lease holds one
 *    copy per position), so the copy-id tie-break never decides, and "release epoch ascending,
 *    deepest first" is exactly "list order, each segment tail first".  A split of an inactive
 *    segment puts the deeper part just before the shallower one, at the same place.
 *  - A materialize of new blocks no copy has, right after a segment only its lease holds whose
 *    hashes end at the heap's next slot (lru_heap.c), lengthens that segment: outputs told a
 *    block at a time make one segment.  Its stamp and release place order them as a new
 *    segment's would (no other copy of those hashes, later ones newer; released deepest first).
 *  - A lease keeps (first segment, length) per piece.  A later split of a held segment keeps
 *    the first part in the same slot and links the rest behind it (the split chain, in chain
 *    order), so a lease still finds all its segments without being told of the split.
 *  - Lookups walk the prompt from the root.  A segment head is found by its hash (the head map,
 *    a multimap: copies of one hash are separate segments); inside a segment the next copy is
 *    found by comparing the next hash.  The copies of hash b[k] are exactly: the in-segment
 *    successors of the copies of b[k-1], plus heads with hash b[k], and the walk follows all
 *    of them.  The head map is probed only below segment TAILS, because of this invariant:
 *    while a head with hash h is present, some copy of h's parent that is a segment tail is
 *    present too.  A head is created below a tail (a new segment continues a lease's last piece;
 *    a split makes its left part end there), nothing ever merges (a tail stays a tail until it
 *    is evicted), and whoever holds the head holds a copy of the parent whose piece ends there
 *    (a tail), released in the same release and shallower, so evicted after the head.  The diff
 *    test checks it on workloads full of duplicate copies.  With one copy per hash (the usual
 *    case) the walk is a sequential compare of the prompt against segment arrays, plus one
 *    probe per segment boundary; the writes (refcounts, list links, lease pieces) are O(runs).
 *  - Several copies of a hash: `dups` counts the extra copies of such hashes, so that an
 *    eviction reports a hash only when its last copy goes; the walk follows every copy and
 *    takes the one with the smallest creation stamp (the oldest, as vLLM's cache does).
 *
 * Requirement: sequence hashes are CHAINED (a hash names its whole prefix: core/hash), so the
 * hashes present form a prefix-closed set along every chain.  Then an acquire's blocks after its
 * first miss are all absent (they get new copies and are stored as one range), and a block's
 * last copy is never evicted before its children's last copies (the eviction order guarantees
 * it), so every evicted run is a tail.  The router always chains; tests use chains too.
 *
 * Memory: per held block the 8-byte hash, in the rank's chunked hash heap (lru_heap.c: no
 * allocation per segment, so no allocator slabs left partly used as segments die; a margin of
 * ~1/16 and the garbage of partly evicted chunks); per segment a 40-byte record and a head-map
 * slot; per lease piece 16 bytes.  Long runs therefore cost ~9-11 bytes a block (perf/bench_lru
 * prints it).
 *
 * Released private blocks (kvr_lru_set_keep_private).  A request's partial, unhashed tail block
 * occupies a pool slot too.  In the reference model it simply disappears at release, so
 * its slot is free at once.  vLLM does not free it that way: the block goes to the free queue
 * with the request's other blocks (tail first, so ahead of them), and a new allocation pops the
 * queue head, which evicts older cached blocks before it ever reaches that unhashed one.  With
 * keep_private on, a release turns its private blocks into a PHANTOM: unhashed, inactive,
 * deepest of its release; evicting it emits nothing.  Phantoms are (order, count) entries of a
 * FIFO beside the inactive list, merged with it by order (lru_segs.c), not segments.  The router
 * runs in this mode for kvr_config.free_order KVR_FREE_TAIL_FIRST, vLLM's 2025 block pool
 * (measured: it makes the serial replay exact under eviction with partial blocks), and with it
 * off for KVR_FREE_FRESH_FIRST (the default, vLLM's 2026 pool puts a freed block without a hash at
 * the queue's head: reused first, as a free slot is).
 *
 * Invariants: a segment is on the inactive list iff no lease holds it (its refcount would be 0:
 * the record then keeps its release order and list links in the refcount's place); copies == sum of
 * segment lengths; dup_extra == sum of dups; resident = copies + phantoms + private; after every
 * command, resident > capacity implies the inactive list and the phantom ring are empty.
 *
 * Failure model: a command first does its splits (each either happens or fails cleanly, and a
 * split changes no observable state), then reserves everything it may need (segment slots, map
 * room, lease arrays, hash arrays, output room, a release's phantom entry), then mutates without
 * failing.
 */
#include "shards/lru.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/chain.h"
#include "shards/lru_internal.h"

/* ------------------------------------------------------------------ create / destroy */

int kvr_lru_create(uint64_t capacity_blocks, struct kvr_lru **out)
{
	if (!out)
		return KVR_EINVAL;
	struct kvr_lru *lru = kvr_calloc(1, sizeof(*lru));
	if (!lru)
		return KVR_ENOMEM;
	lru->capacity = lru->registered = capacity_blocks;
	lru->free_head = NIL;
	lru->inact_head = lru->inact_tail = NIL;
	kvr_lru_heap_init(lru, capacity_blocks);
	lru->heads.shift = 64;
	kvr_u64map_init(&lru->hnext);
	kvr_u64map_init(&lru->dups);
	kvr_u64map_init(&lru->by_attempt);
	*out = lru;
	return 0;
}

void kvr_lru_destroy(struct kvr_lru *lru)
{
	if (!lru)
		return;
	kvr_lru_heap_fini(lru);
	for (uint32_t i = 0; i < lru->n_leases; i++)
		kvr_free(lru->leases[i].p, lru->leases[i].cap * sizeof(struct piece));
	kvr_free(lru->leases, lru->leases_cap * sizeof(struct lease));
	kvr_free(lru->s, (size_t)lru->s_cap * sizeof(struct seg));
	kvr_free(lru->ph, (size_t)lru->ph_cap * sizeof(struct phantom));
	kvr_free(lru->cur, lru->cur_cap * sizeof(struct cursor));
	kvr_free(lru->nxt, lru->cur_cap * sizeof(struct cursor));
	kvr_free(lru->hits, lru->hits_cap * sizeof(struct kvr_run_hit));
	kvr_free(lru->rel, lru->rel_cap * sizeof(uint32_t));
	kvr_lru_heads_fini(lru);
	kvr_u64map_fini(&lru->hnext);
	kvr_u64map_fini(&lru->dups);
	kvr_u64map_fini(&lru->by_attempt);
	kvr_lru_ghosts_fini(lru);
	kvr_free(lru, sizeof(*lru));
}

/* ------------------------------------------------------------------ scratch */

/* Walk sets: the copies of one hash, at most 1 + dup_extra (+ room for the dups a
 * materialize is about to add). */
static int reserve_cursors(struct kvr_lru *lru, size_t extra)
{
	size_t need = (size_t)lru->dup_extra + extra + 2;
	if (need <= lru->cur_cap)
		return 0;
	size_t nc = need * 2;
	/* Both arrays at one capacity, and nothing to undo that can fail: nxt's new array is
	 * taken first, and freeing it undoes a failed resize of cur.  cur used to be resized
	 * first and shrunk back when nxt's failed; the shrink can fail too (a second failure in a
	 * row: oom_api --threads arms one from another thread), and cur was then lost (32 bytes
	 * on a fresh LRU) or kept at a size nobody recorded. */
	struct cursor *x = kvr_alloc(nc * sizeof(*x));
	if (!x)
		return KVR_ENOMEM;
	struct cursor *c = kvr_realloc(lru->cur, lru->cur_cap * sizeof(*c), nc * sizeof(*c));
	if (!c) {
		kvr_free(x, nc * sizeof(*x));
		return KVR_ENOMEM;
	}
	if (lru->cur_cap)
		memcpy(x, lru->nxt, lru->cur_cap * sizeof(*x));
	kvr_free(lru->nxt, lru->cur_cap * sizeof(*x));
	lru->cur = c;
	lru->nxt = x;
	lru->cur_cap = nc;
	return 0;
}

static int reserve_pieces(struct lease *l, size_t n)
{
	if ((size_t)l->n + n <= l->cap)
		return 0;
	size_t nc = (size_t)l->cap * 2;
	if (nc < (size_t)l->n + n)
		nc = (size_t)l->n + n;
	if (nc < 4)
		nc = 4;
	if (nc >= NIL)
		return KVR_ERANGE;
	struct piece *p = kvr_realloc(l->p, l->cap * sizeof(*p), nc * sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	l->p = p;
	l->cap = (uint32_t)nc;
	return 0;
}

/* ------------------------------------------------------------------ walks */

/* The copies of hash h, given cur[0..nc), all the copies of the hash before it, or the root
 * (nc == 0, root).  Writes them to nxt (at most lru->cur_cap); returns how many.
 *
 * The cap: the walk sets hold the copies of one hash, 1 + dups[h], and an acquire makes copies
 * of absent hashes only - for chained hashes.  A crafted prompt (kvr_request does not check
 * that a caller's hashes chain) gets copies of present hashes made after its first miss, which
 * no one counts (finding them would take a map of every copy), so more copies can come than the
 * sets hold: ASan saw the write past nxt (test_lru crafted_sequences_on_lru_and_load, seed 3). Past
 * the cap, copies are left out of the walk: the answer stays a prediction. */
static size_t step(const struct kvr_lru *lru, const struct cursor *cur, size_t nc, bool root,
                   uint64_t h, struct cursor *nxt)
{
	size_t nn = 0, cap = lru->cur_cap;
	bool probe = root;
	for (size_t k = 0; k < nc; k++) {
		const struct seg *g = &lru->s[cur[k].seg];
		uint32_t o = cur[k].off + 1;
		if (o < g->len) {
			if (seq_of(lru, g)[o] == h && nn < cap)
				nxt[nn++] = (struct cursor){cur[k].seg, o};
		} else {
			probe = true;
		}
	}
	if (probe) {
		uint32_t *v = kvr_lru_heads_find(lru, h);
		for (uint32_t j = v ? *v : NIL; j != NIL && nn < cap; j = kvr_lru_hnext(lru, j))
			nxt[nn++] = (struct cursor){j, 0};
	}
	return nn;
}

/* Records a hit of run copies of segment seg from off: extends the last piece when it continues
 * it, else appends one.  False when that needs a piece beyond hcap (nothing recorded). */
static bool add_hit(struct kvr_run_hit *hits, size_t hcap, size_t *nh, uint32_t seg, uint32_t off,
                    uint32_t run)
{
	struct kvr_run_hit *last = *nh ? &hits[*nh - 1] : NULL;
	if (last && last->run == seg && last->off + last->len == off) {
		last->len += run;
		return true;
	}
	if (*nh == hcap)
		return false;
	hits[(*nh)++] = (struct kvr_run_hit){seg, off, run};
	return true;
}

/*
 * Walks seq[0], seq[stride], ... (n hashes) from the copies in lru->cur[0..nc) of the hash
 * before them, or from the root (root: nc must be 0).  Returns how many leading hashes
 * are present.  With hits: records, per depth, the oldest copy, as pieces of consecutive copies
 * of one segment (*nh of them); when that takes more than hcap pieces, stops early with
 * *nh = SIZE_MAX.  lru->cur_cap must cover every copy of one hash.
 */
static size_t walk(const struct kvr_lru *lru, const uint64_t *seq, size_t stride, size_t n,
                   bool root, size_t nc, struct kvr_run_hit *hits, size_t hcap, size_t *nh)
{
	struct cursor *cur = lru->cur, *nxt = lru->nxt;
	size_t k = 0;
	while (k < n) {
		uint64_t h = seq[k * stride];
		size_t nn = step(lru, cur, nc, root && k == 0, h, nxt);
		if (nn == 0)
			break;
		struct cursor *t = cur;
		cur = nxt;
		nxt = t;
		nc = nn;
		k++;
		size_t best = 0;
		for (size_t j = 1; j < nc; j++)
			if (lru->s[cur[j].seg].stamp < lru->s[cur[best].seg].stamp)
				best = j;
		uint32_t run = 1;
		if (nc == 1) {
			/* One copy: follow its segment while it matches (chained hashes: one
			 * compare at the far end, a binary search where it differs). */
			const struct seg *g = &lru->s[cur[0].seg];
			uint32_t o = cur[0].off;
			uint32_t more = kvr_chain_agree(seq_of(lru, g) + o, g->len - 1 - o,
			                                seq + (k - 1) * stride, stride, n - k);
			o += more;
			k += more;
			run += more;
			if (hits && !add_hit(hits, hcap, nh, cur[0].seg, cur[0].off, run)) {
				*nh = SIZE_MAX;
				return k;
			}
			cur[0].off = o;
			continue;
		}
		if (hits && !add_hit(hits, hcap, nh, cur[best].seg, cur[best].off, 1)) {
			*nh = SIZE_MAX;
			return k;
		}
	}
	return k;
}

struct lease *kvr_lru_find_lease(const struct kvr_lru *lru, uint64_t attempt)
{
	uint32_t *ix = kvr_u64map_find(&lru->by_attempt, attempt);
	return ix ? &lru->leases[*ix] : NULL;
}

/* The last segment of a lease's piece (its split chain walked for the piece's length). */
static uint32_t piece_last(const struct kvr_lru *lru, const struct piece *p)
{
	uint32_t i = p->seg, left = p->len;
	while (left > lru->s[i].len) {
		left -= lru->s[i].len;
		i = lru->s[i].snext;
	}
	return i;
}

/* A new active range (refs 1) holding hashes seq[0], seq[stride], ... (n > 0): one segment,
 * or several linked by the split chain when it takes more than the heap's current chunk
 * (lru_heap.c).  Returns the first.  Heap room for n hashes, then slots and head-map room for
 * kvr_lru_hash_pieces(n) segments must be reserved. */
static uint32_t seg_make(struct kvr_lru *lru, const uint64_t *seq, size_t stride, uint32_t n,
                         uint32_t depth)
{
	uint32_t first = NIL, prev = NIL, len = kvr_lru_hash_piece_len(lru, n);
	uint64_t stamp = ++lru->stamp;
	for (uint32_t done = 0; done < n; done += len) {
		if (done)
			len = 1u << lru->chunk_shift; /* the next pieces: whole chunks */
		if (n - done < len)
			len = n - done;
		uint32_t off = kvr_lru_hashes_take(lru, len);
		uint64_t *m = lru->heap + off;
		for (uint32_t k = 0; k < len; k++)
			m[k] = seq[(size_t)(done + k) * stride];
		uint32_t i = kvr_lru_seg_new(lru);
		struct seg *g = &lru->s[i];
		g->off = off;
		g->len = len;
		g->refs = 1;
		g->depth = depth + done;
		g->stamp = stamp;
		kvr_lru_head_add(lru, i);
		if (prev == NIL)
			first = i;
		else
			lru->s[prev].snext = i;
		prev = i;
	}
	lru->copies += n;
	return first;
}

static int lease_slot(struct kvr_lru *lru)
{
	if (lru->n_leases < lru->leases_cap)
		return 0;
	size_t nc = lru->leases_cap ? (size_t)lru->leases_cap * 2 : 16;
	struct lease *l = kvr_realloc(lru->leases, lru->leases_cap * sizeof(*l), nc * sizeof(*l));
	if (!l)
		return KVR_ENOMEM;
	lru->leases = l;
	lru->leases_cap = (uint32_t)nc;
	return 0;
}

/* Segments as a run store, for kvr_hits_whole. */
static uint32_t seg_len(const void *lru, uint32_t i)
{
	return ((const struct kvr_lru *)lru)->s[i].len;
}
static uint32_t seg_next(const void *lru, uint32_t i)
{
	return ((const struct kvr_lru *)lru)->s[i].snext;
}
static int seg_split(void *lru, uint32_t i, uint32_t off)
{
	return kvr_lru_split(lru, i, off);
}
static const struct kvr_run_ops seg_ops = {seg_len, seg_next, seg_split};

/* ------------------------------------------------------------------ commands */

int kvr_lru_acquire(struct kvr_lru *lru, uint64_t attempt, const struct kvr_lru_block *b, size_t n,
                    uint32_t private_blocks, struct kvr_lru_out *out)
{
	if (!lru || !out || (n > 0 && !b))
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	if (kvr_u64map_find(&lru->by_attempt, attempt))
		return KVR_EEXIST;
	if (n >= NIL)
		return KVR_ERANGE;
	int rc;
	if ((rc = reserve_cursors(lru, 0)))
		return rc;
	/* The hit pieces: a few, not one per block (an array of n would keep 24 KB a rank at 2,048
	 * blocks: 1 B per (block, rank) in bench_footprint at 32k prompts); grown when a walk
	 * needs more and walked again. */
	size_t nh = 0, hit = 0, need = 1;
	for (;;) {
		if ((rc = kvr_grow((void **)&lru->hits, &lru->hits_cap, need,
		                   sizeof(struct kvr_run_hit))))
			return rc;
		nh = 0;
		hit = n ? walk(lru, &b[0].seq, 2, n, true, 0, lru->hits, lru->hits_cap, &nh) : 0;
		if (nh != SIZE_MAX)
			break;
		need = lru->hits_cap + 1;
	}
	/* Make every hit piece a whole segment (splits change nothing observable). */
	if ((rc = kvr_hits_whole(lru, &seg_ops, lru->hits, nh)))
		return rc;
	uint32_t nnew = (uint32_t)(n - hit);
	if ((rc = kvr_lru_reserve_hashes(lru, nnew)) ||
	    (rc = kvr_lru_reserve_segs(lru, 1 + kvr_lru_hash_pieces(lru, nnew))) ||
	    (rc = kvr_lru_reserve_head(lru, kvr_lru_hash_pieces(lru, nnew))) ||
	    (rc = kvr_u64map_reserve(&lru->by_attempt, 1)) || (rc = lease_slot(lru)) ||
	    (rc = kvr_lru_out_reserve(
	         out, 1, kvr_lru_eviction_bound(lru, nnew + (uint64_t)private_blocks))))
		return rc;
	struct lease *l = &lru->leases[lru->n_leases];
	memset(l, 0, sizeof(*l));
	if ((rc = reserve_pieces(l, nh + 1)))
		return rc;
	/* From here on nothing fails. */
	l->attempt = attempt;
	l->priv = private_blocks;
	l->nblocks = l->nprompt = (uint32_t)n;
	l->last_seq = n ? b[n - 1].seq : 0;
	kvr_u64map_insert(&lru->by_attempt, attempt, lru->n_leases++);
	l->hit = (uint32_t)hit;
	for (size_t k = 0; k < nh; k++) {
		uint32_t i = lru->hits[k].run, left = lru->hits[k].len;
		uint64_t ord = lru->s[i].inactive ? lru->s[i].order : 0;
		/* Every segment of the piece, as the release drops them: one, unless a later hit
		 * of this walk split it.  Only a crafted prompt repeating a hash (kvr_request does
		 * not check its hashes chain) walks back into a segment it took: counting the
		 * first segment alone, the release then dropped a reference it never took from
		 * the others (another lease's copies went inactive under it, then a SEGV in
		 * head_del: test_lru crafted_prompt_repeating_a_hash). */
		for (; left; i = lru->s[i].snext) {
			struct seg *g = &lru->s[i];
			left -= g->len;
			if (g->inactive) {
				kvr_lru_inact_unlink(lru, i);
				g->refs = 1;
			} else {
				g->refs++;
			}
		}
		l->p[l->n++] = (struct piece){lru->hits[k].run, lru->hits[k].len, ord};
	}
	if (nnew) {
		uint32_t i = seg_make(lru, &b[hit].seq, 2, nnew, (uint32_t)hit);
		l->p[l->n++] = (struct piece){i, nnew, 0};
		kvr_lru_out_stored(out, (uint32_t)hit, nnew);
	}
	lru->priv += private_blocks;
	kvr_lru_reconcile(lru, out);
	return 0;
}

/* Materialize's slow path (the parent hash has several copies): the lease's chain, then the
 * new hashes, in a temporary array (rare: kept, it would hold a prompt's hashes per rank for
 * good); walked from the root.  Returns how many new hashes are present. */
static int present_slow(struct kvr_lru *lru, const struct lease *l, const struct kvr_lru_block *b,
                        size_t n, size_t *present)
{
	size_t total = (size_t)l->nblocks + n;
	uint64_t *chain = kvr_alloc(total * sizeof(uint64_t));
	if (!chain)
		return KVR_ENOMEM;
	size_t k = 0;
	for (uint32_t p = 0; p < l->n; p++) {
		uint32_t i = l->p[p].seg, left = l->p[p].len;
		while (left) {
			const struct seg *g = &lru->s[i];
			uint32_t take = left < g->len ? left : g->len;
			memcpy(chain + k, seq_of(lru, g), take * sizeof(uint64_t));
			k += take;
			left -= take;
			i = g->snext;
		}
	}
	for (size_t j = 0; j < n; j++)
		chain[k++] = b[j].seq;
	size_t w = walk(lru, chain, 1, total, true, 0, NULL, 0, NULL);
	*present = w > l->nblocks ? w - l->nblocks : 0;
	kvr_free(chain, total * sizeof(uint64_t));
	return 0;
}

int kvr_lru_materialize(struct kvr_lru *lru, uint64_t attempt, uint64_t parent_seq,
                        const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                        uint32_t private_blocks, struct kvr_lru_out *out)
{
	(void)start_pos; /* positions are implied by the chain */
	if (!lru || !out || (n > 0 && !b))
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	struct lease *l = kvr_lru_find_lease(lru, attempt);
	if (!l)
		return KVR_ENOENT;
	if (l->nblocks > 0 && l->last_seq != parent_seq)
		return KVR_ENOENT;
	if (n >= NIL || (size_t)l->nblocks + n >= NIL)
		return KVR_ERANGE;
	uint64_t added = n + (private_blocks > l->priv ? private_blocks - l->priv : 0);
	int rc;
	size_t present = 0;
	uint32_t t = NIL; /* the lease's last segment, when its tail is the only parent copy */
	if ((rc = reserve_cursors(lru, 0)))
		return rc;
	if (n > 0) {
		if (l->nblocks == 0) {
			present = walk(lru, &b[0].seq, 2, n, true, 0, NULL, 0, NULL);
		} else if (kvr_u64map_find(&lru->dups, l->last_seq)) {
			if ((rc = present_slow(lru, l, b, n, &present)))
				return rc;
		} else {
			/* The lease's last copy is the only copy of the parent hash, a segment
			 * tail. */
			t = piece_last(lru, &l->p[l->n - 1]);
			lru->cur[0] = (struct cursor){t, lru->s[t].len - 1};
			present = walk(lru, &b[0].seq, 2, n, false, 1, NULL, 0, NULL);
		}
	}
	/* New blocks that no copy has, right after a segment only this lease holds, whose hashes
	 * end where the heap takes from next: that segment grows in place (a request's outputs,
	 * told a block at a time, make one segment, not one each).  Its copies keep the segment's
	 * stamp and release order, as the new segment's would order them: no other copy of these
	 * hashes exists, later ones will be newer, and the lease releases them deepest first. */
	bool grow = t != NIL && present == 0 && !lru->s[t].inactive && lru->s[t].refs == 1 &&
	            kvr_lru_hashes_can_extend(lru, &lru->s[t], n);
	size_t pieces = grow ? 0 : kvr_lru_hash_pieces(lru, n);
	if ((rc = reserve_cursors(lru, present)) ||
	    (!grow && (rc = kvr_lru_reserve_hashes(lru, n))) ||
	    (rc = kvr_lru_reserve_segs(lru, pieces)) || (rc = kvr_lru_reserve_head(lru, pieces)) ||
	    (rc = kvr_u64map_reserve(&lru->dups, present)) || (rc = reserve_pieces(l, 1)) ||
	    (rc = kvr_lru_out_reserve(out, 1, kvr_lru_eviction_bound(lru, added))))
		return rc;
	/* From here on nothing fails. */
	for (size_t j = 0; j < present; j++) {
		uint32_t *d = kvr_u64map_find(&lru->dups, b[j].seq);
		if (d)
			(*d)++;
		else
			kvr_u64map_insert(&lru->dups, b[j].seq, 1);
	}
	lru->dup_extra += present;
	if (grow) {
		struct seg *g = &lru->s[t];
		uint64_t *m = kvr_lru_hashes_extend(lru, g, (uint32_t)n);
		for (size_t k = 0; k < n; k++)
			m[k] = b[k].seq;
		g->len += (uint32_t)n;
		lru->copies += n;
		l->p[l->n - 1].len += (uint32_t)n;
	} else if (n) {
		uint32_t i = seg_make(lru, &b[0].seq, 2, (uint32_t)n, l->nblocks);
		l->p[l->n++] = (struct piece){i, (uint32_t)n, 0};
	}
	if (n) {
		l->nblocks += (uint32_t)n;
		l->last_seq = b[n - 1].seq;
		kvr_lru_out_stored(out, (uint32_t)present, (uint32_t)(n - present));
	}
	lru->priv = lru->priv - l->priv + private_blocks;
	l->priv = private_blocks;
	kvr_lru_reconcile(lru, out);
	return 0;
}

int kvr_lru_release(struct kvr_lru *lru, uint64_t attempt, struct kvr_lru_out *out)
{
	if (!lru || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	uint32_t *ix = kvr_u64map_find(&lru->by_attempt, attempt);
	if (!ix)
		return KVR_ENOENT;
	uint32_t li = *ix;
	struct lease *l = &lru->leases[li];
	/* Releasing adds no block; evictions happen only if we were over capacity. */
	uint64_t resident = lru->copies + lru->n_phantom + lru->priv - l->priv;
	size_t bound = 0;
	if (resident > lru->capacity) {
		uint64_t over = resident - lru->capacity, inact = lru->n_inactive + l->nblocks;
		bound = (size_t)(over < inact ? over : inact);
	}
	size_t most = 1; /* segments in the longest piece */
	for (uint32_t p = 0; p < l->n; p++) {
		size_t c = 0;
		for (uint32_t i = l->p[p].seg, left = l->p[p].len; left; i = lru->s[i].snext) {
			left -= lru->s[i].len;
			c++;
		}
		if (c > most)
			most = c;
	}
	int rc;
	bool phantom = lru->keep_private && l->priv;
	if ((rc = kvr_lru_out_reserve(out, 0, bound)) ||
	    (rc = kvr_grow((void **)&lru->rel, &lru->rel_cap, most, sizeof(uint32_t))) ||
	    (phantom && (rc = kvr_lru_reserve_phantom(lru))))
		return rc;
	lru->epoch++;
	lru->priv -= l->priv;
	kvr_lru_heal_unghost(lru, l);
	/* keep_private: the private blocks stay as a phantom, deepest of this release. */
	if (phantom)
		kvr_lru_phantom_push(lru, l->priv);
	/* Deepest first: pieces backwards, each piece's segments backwards. */
	for (uint32_t p = l->n; p-- > 0;) {
		size_t c = 0;
		for (uint32_t i = l->p[p].seg, left = l->p[p].len; left; i = lru->s[i].snext) {
			left -= lru->s[i].len;
			lru->rel[c++] = i;
		}
		while (c--) {
			uint32_t i = lru->rel[c];
			if (--lru->s[i].refs == 0)
				kvr_lru_inact_append(lru, i);
		}
	}
	/* Remove the lease: swap the last one into its slot. */
	kvr_free(l->p, l->cap * sizeof(struct piece));
	kvr_u64map_remove(&lru->by_attempt, attempt);
	uint32_t last = --lru->n_leases;
	if (li != last) {
		lru->leases[li] = lru->leases[last];
		*kvr_u64map_find(&lru->by_attempt, lru->leases[li].attempt) = li;
	}
	kvr_lru_reconcile(lru, out);
	return 0;
}

int kvr_lru_set_capacity(struct kvr_lru *lru, uint64_t capacity, struct kvr_lru_out *out)
{
	if (!lru || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	uint64_t old = lru->capacity;
	lru->capacity = capacity;
	int rc;
	if ((rc = kvr_lru_out_reserve(out, 0, kvr_lru_eviction_bound(lru, 0)))) {
		lru->capacity = old;
		return rc;
	}
	lru->registered = capacity; /* a new registration replaces the estimate (lru_cap.c) */
	lru->explore = false;
	kvr_lru_reconcile(lru, out);
	return 0;
}

size_t kvr_lru_overlap(const struct kvr_lru *lru, const uint64_t *seq, size_t n)
{
	if (!lru || !seq || n == 0 || lru->heads.count == 0)
		return 0;
	return walk(lru, seq, 1, n, true, 0, NULL, 0, NULL);
}

void kvr_lru_set_keep_private(struct kvr_lru *lru, bool on)
{
	if (lru && lru->copies == 0 && lru->n_phantom == 0 && lru->priv == 0)
		lru->keep_private = on;
}

bool kvr_lru_has_lease(const struct kvr_lru *lru, uint64_t attempt)
{
	return lru && kvr_u64map_find(&lru->by_attempt, attempt) != NULL;
}

uint64_t kvr_lru_capacity(const struct kvr_lru *lru)
{
	return lru ? lru->capacity : 0;
}

void kvr_lru_stats(const struct kvr_lru *lru, struct kvr_lru_stats *st)
{
	memset(st, 0, sizeof(*st));
	if (!lru)
		return;
	st->capacity = lru->capacity;
	st->copies = lru->copies;
	st->phantoms = lru->n_phantom;
	st->private_blocks = lru->priv;
	st->resident = lru->copies + lru->n_phantom + lru->priv;
	st->hashes = lru->copies - lru->dup_extra;
	st->inactive = lru->n_inactive;
	st->leases = lru->n_leases;
	st->evictions = lru->evictions;
	st->epoch = lru->epoch;
}

/* What an allocation of n elements of elem bytes occupies (its size class; 0 for none). */
static size_t real(size_t n, size_t elem)
{
	return n ? kvr_alloc_real_size(n * elem) : 0;
}

size_t kvr_lru_bytes(const struct kvr_lru *lru)
{
	if (!lru)
		return 0;
	const size_t slot = sizeof(struct kvr_u64map_slot);
	size_t bytes = real(1, sizeof(*lru)) + real(lru->s_cap, sizeof(struct seg)) +
	               real(lru->heads.cap, sizeof(struct head_slot)) + real(lru->hnext.cap, slot) +
	               real(lru->dups.cap, slot) + real(lru->by_attempt.cap, slot) +
	               real(lru->leases_cap, sizeof(struct lease)) +
	               real(lru->ph_cap, sizeof(struct phantom));
	bytes += real(lru->gh.cap, sizeof(uint64_t)) + real(((size_t)lru->gh.cap + 63) / 64, 8) +
	         real(lru->gh.map.cap, slot);
	bytes += real(lru->cur_cap, sizeof(struct cursor)) * 2 +
	         real(lru->hits_cap, sizeof(struct kvr_run_hit)) +
	         real(lru->rel_cap, sizeof(uint32_t));
	bytes += real((size_t)lru->heap_chunks << lru->chunk_shift, sizeof(uint64_t)) +
	         real(lru->live_cap, sizeof(uint32_t));
	for (uint32_t i = 0; i < lru->n_leases; i++)
		bytes += real(lru->leases[i].cap, sizeof(struct piece));
	return bytes;
}

double kvr_lru_bytes_per_copy(const struct kvr_lru *lru)
{
	if (!lru || lru->copies == 0)
		return 0;
	return (double)kvr_lru_bytes(lru) / (double)lru->copies;
}
