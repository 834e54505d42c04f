/*
 * core/index.c - the run-compressed RCU index: run table, deferred reclamation, rank slots.
 *
 * The idea.  A prompt is a chain of blocks; a block is named by its sequence hash (core/hash.c),
 * which names its whole prefix (a 64-bit chain, trusted the way Dynamo and smg trust it).  The
 * index stores the union of the chains ranks hold as a tree of RUNS: a run is a stretch of
 * consecutive blocks of one chain (their sequence hashes in an array); a child run hangs off any
 * position of its parent and is found by the sequence hash of its first block.  A query of L
 * blocks, given its sequence hashes, is matched run by run: ONE comparison at the far end of the
 * overlap (the hash there equal => the whole stretch equal), and a binary search inside the run
 * where it differs; then one table probe for the child at the divergence point.  So a lookup
 * costs O(runs on the path + log L) probes, not one per block (core/index_match.c), which is the
 * Waldvogel et al. idea (binary search on prefix lengths, SIGCOMM 1997) applied per run.
 *
 * Holders.  Every run carries the ranks that hold some of it, each with a CUT: the rank holds
 * positions [0, cut) of the run without a gap.  That is all a reader needs: a rank's score along
 * the path is decided by the first run where its cut falls short of the match.  Holes (events
 * mode removes an interior block; copies evicted out of order) therefore just lower one cut: the
 * run is not split, and a pattern with 2 % holes matches as fast as one without.  What a rank
 * holds beyond its cut lives in a writer-only bitmap per (rank, run), so a hole that is filled
 * again raises the cut back over the blocks held after it, and a removal never needs memory.
 * Storing along a held chain appends to the run (amortised O(1) per run plus the hashes),
 * evicting a chain's tail lowers a cut and trims the run's length when nobody holds its end.
 *
 * Memory.  Per distinct block: its sequence hash in the run (8 bytes) and one 4-byte entry in
 * the writers' block locator (core/index_blocks.c: run id and tag, load 0.62-0.9), which lets
 * writers find any block by hash (parents, removals); readers only ever look up a run's FIRST
 * block, so the RCU-published run table holds one 8-byte entry per run, not per block, and
 * the locator skips first blocks.  Per run: an 80-byte header (16-bit lengths and offsets in
 * the high bits of its pointer words; a one-block run keeps its hash in it; longer ones have a
 * hash array of exactly an allocator size class, whose word 0 keeps its capacity and the
 * locator id, position 0's hash being the header's) that embeds its first holder's record.
 * Per (rank, run): an 8-byte holder word (the run's own word for a single holder whose record
 * is the embedded one, else in a holder set with a pointer beside it), a 32-byte record (none
 * for the embedded holder) and a bitmap (1 bit per position), so the per-holder cost of a
 * run of 16+ blocks is a few bytes.  Events mode, where the engine's ext hash differs from the
 * sequence hash, adds per rank an ext -> place map (16 bytes an aliased block at load 0.65-0.9; a
 * run only ever held under such aliases has no block-locator entry) and, only in a rank that mixes
 * aliased and plain blocks, alias bits per (record, bitmap word) (core/index_xmap.c).  Header and
 * record sizes are jemalloc classes (64, 32): the 16-bit fields ride in the high bits of pointer
 * words.
 *
 * What that leaves for short runs (bench_index_runs prints the split, '# where:').  A run of
 * one block with one holder: 80 (header with its record) + 8 / load of the run table (10-15) =
 * 90-95 bytes (106-111 with a 64-byte header and a separate 32-byte record), below the 128 of
 * the per-block index this replaced.  A run of 16 blocks with one holder: 16 x 8 (hashes) + 15
 * x 4 / load of the locator (68-98) + 80 + 10-15 + the locator id's directory entry (8-12) =
 * 294-333 bytes, 18.4-20.8 per block, and more while the locator migrates after a growth (it
 * holds both arrays; --mem-sweep gives the mean over 97 index sizes).  The memory counters count
 * what jemalloc really takes (its size class); hash arrays are classes exactly (growth steps land
 * on them: 2, 4, 6, 8, 10, 12, 14, 16, 20, ... words).  With a 16-byte header in front of the
 * hashes (it kept the capacity, the id and the retire link) the 16-block array's 144 bytes took 160
 * and a 512-block one's 4,112 took 5,120: 29.6 and 17.6 per block in that benchmark, now 27.6
 * and 15.6 (the header word is s[0]: readers never read it, since position 0 matched when the run
 * was found). Issue 10's 16 bytes per block would leave 256 - 128 (hashes) - 68 (locator, at its
 * highest load) = 60 bytes per run for the header, record, table and directory entries, less than
 * the header alone: the floor is set by the writers' need to find any block by its hash (a 4-byte
 * locator entry per block; a removal names any block), not by per-run overhead.  Options weighed
 * and not taken: hashes inline in the run allocation (64 + 128 is a class too, but a growing run
 * must then move, and readers and children hold its address), the single holder without a record
 * (the rank's list and the bitmap still need 24+ bytes somewhere; a removal that punches a hole
 * must not need memory).  Taken: that record embedded in the run header (64 + 32 -> 80: the single
 * holder's reader word became the header's holder-set word, and the sibling back link rides in the
 * record's run word, the run being implied).  Taken: the locator grows at load 0.9 to 0.78 (it
 * grew at 0.85 to 0.57), 1 byte per block less where an index settles.
 *
 * Why events mode stays above 16 bytes per block with one holder (measured 2026-12-02, evmem):
 * a 16-block run costs 128 (hashes) + 80 (header) + 80 (locator: 15 entries of 4 bytes at load
 * 0.76 and the overflow bytes) + 14 (run table) + 10 (directory) = 312 bytes, 19.5 a block.  The
 * hashes and a locator entry per block cost at least 8 + 4.4 (load 0.9), which leaves 57 bytes a
 * run for everything else at 16 bytes a block, less than the header, which cannot lose 16 bytes
 * without dropping a pointer (its fields need ~70 bytes even with every pointer packed into 43
 * bits; the sibling back link or the rank list's prev would make an unlink O(siblings) or
 * O(rank)).  So the target needs no per-block locator, or one of ~2 bytes a block with its
 * directory.  Without it events mode would hold less (kvr-replay --policies events
 * --blocks-per-rank 12000 on the 24 session traces: 23.8 -> 16.9 bytes per copy at the end, the
 * same decisions, 989 scans in 1.3M block ops), but a write naming a block away from a record's
 * ends scans the rank (bench_index_runs --scan-cost, p50: a removal of a hash the rank does not
 * hold, as stale or duplicate events after a gap send, 1.4-1.6 us with the locator, 15-16 /
 * 58-65 / 282-597 us without at ranks of 25,600 / 102,400 / 409,600 blocks).
 *
 * Without the locator (kvr_index_set_locator(idx, false); the router's approximate modes, where
 * it writes the index itself; events mode keeps it: engine hashes name arbitrary blocks).  The
 * locator's 4-6 bytes per distinct block buy writers a lookup of ANY block; the approximate modes
 * name blocks at a few places only: an admission's parent by its path from the root (a walk like
 * the readers', kvr_index_store_path), an output's parent where the rank's last write ended or at
 * a record's end, an evicted run by its last block (a chain tail: the rank's deepest position in
 * that run) or an expired one by its first (a head).  core/index_tops.c finds those through the
 * positions next to the last write, the run table, and a per-rank END MAP (one 8-byte word per
 * (rank, run) record, keyed by the hash of its deepest held position and, with nothing held at
 * position 0, of its lowest), and anything else by a scan of the rank's records, so every call
 * keeps its exact semantics (the differential test runs the same random streams, holes and
 * parents anywhere included, in both modes) and only its cost depends on the shape.  Measured
 * (bench_index_runs --mem-only; the same binary, both modes): 16-block runs with 1 / 2 / 4
 * holders 19.5 / 12.3 / 7.6 -> 14.6 / 10.2 / 7.0 bytes per held block (the locator's 5.00 and its
 * directory's 0.62 gone, the end maps' 0.75 added), 512-block runs 13.5 -> 8.5, one-block runs
 * 92.2 -> 92.1.  Writes got cheaper too (no locator insert per block, no locator walk per
 * removal): --apply-only --per 16, alternated, 23.5M / 15.8M -> 33.8M / 17.8M block ops/s,
 * --per 1 3.7M -> 7.7M; --churn 2000 --churn-mode incr 70M -> 123M block ops/s, p50 per call
 * 6.8 -> 4.1 us, cpu p99 19.2 -> 15.6 us.  The whole router (bench_footprint, 8 ranks of
 * 25,600 blocks, RSS per tracked (block, rank), two runs each, alternated with the same tree
 * built without the router's switch): 2k-token sessions 34.3 / 36.0 -> 32.6 / 32.5, 32k 32.3 /
 * 31.1 -> 31.3 / 28.1 (allocated 31.5 / 33.4 -> 29.7 / 29.9 and 31.4 / 30.5 -> 29.8 / 27.4).
 * The price: an end map grows by rehashing the rank's entries at once (a record read per
 * entry), and a write naming a block nowhere near the places above scans the rank's records
 * (O(its blocks); counted in rank_scans).  On the session traces (kvr-replay, 8 ranks of
 * 25,600 blocks) approx_lru never scanned (91,174 blocks removed); approx_ttl scanned 1,275
 * times for 236,194 removed, every one a removal: TTL expires runs in the middle of what a rank
 * holds (a block refreshed by a later turn outlives its parent), neither a record's deepest nor
 * its lowest position, and the scan finds the run's last block (the walk takes the rest).
 *
 * Concurrency.  Readers take no lock, allocate nothing, never retry: they load a run's len and
 * seqs (acquire), compare, and read holder words.  Positions are write-once (index_internal.h),
 * cuts are published after the blocks they cover, so a reader never credits a rank with a block
 * it did not store, and a reader that raced with a trim compares permanent content.  Writers
 * (shard threads, several at once) serialise on one mutex per index: every structure they change
 * (table, runs, holder sets, per-rank records) is then theirs alone; a single writer core applies
 * >10M block ops/s, more than the event feeds deliver.  Everything unlinked (runs, sequence
 * arrays, holder sets, table arrays) is retired into one batch and freed by one call_rcu callback
 * (kvr_index_retire_flush) - writer-only records are freed at once.
 *
 * Why not liburcu's rculfhash or ck_hs.  rculfhash's split-ordered lists make a lookup a chain
 * walk and add 16 bytes per entry; ck_hs stores bare pointers.  The run table is IDX_SEGS
 * open-addressing segments of one-word entries (pointer and 16 tag bits of the first block's
 * hash packed), RCU-published arrays for readers (insert releases the entry; delete leaves a
 * tombstone; growth and purges copy to a new array and retire the old one).  Capacities step
 * by 1.5x and 2x alternately (fastrange home slot, the capacity coded in the view word), so a
 * segment's load stays in 0.53-0.8: 10-15 bytes per run (powers of two gave 0.4-0.8; with
 * 65,536 one-block runs every segment sat at 0.5, 16 bytes per run, 4 per held block).  An
 * array is its entries only, exactly a size class, and its retire link is a 16-byte record
 * allocated with it (readers may probe any entry of a retired array): a 16-byte header in the
 * array put 16 entries in 192 bytes, 64 in 640, 512 in 5,120 (bench_index_runs' run table:
 * 14.0 -> 12.1 bytes per one-block run, 1.01 -> 0.89 per block of 16-block runs).
 *
 * Invariants.
 *  - Every live run has one run-table entry (keyed by its first block); with the locator, every
 *    position [1, hw) of every LOCATED live run (one a rank held a position of under its
 *    sequence hash once: core/index_blocks.c) has one block-locator entry (trimmed positions
 *    stay until it dies); without it, a rank's end-map entries are keyed by its records' current
 *    ends (an entry may be missing, never stale).
 *  - A run lives while a rank holds a position of it or it has a child; len >= max(top of every
 *    holder, largest child offset); a run whose need drops to 0 dies and its parent is re-checked.
 *  - For every (rank, run) record, cut = the gap-free prefix of its bitmap, mirrored in the hset.
 *  - Rank slots are reused only after a grace period (rank_remove queues the slot's release).
 * Reference: Dynamo lib/kv-router (semantics, ConcurrentRadixTreeCompressed); smg ChainIndex
 * (run-length chains, compare at the window's end, bisect); Waldvogel, Varghese, Turner,
 * Plattner, SIGCOMM 1997; McKenney, "Is Parallel Programming Hard" ch. 9 (RCU).
 */
#include "core/index_internal.h"

#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "kvrouter.h"

#define TAB_MIN 16

static inline void idx_lock(uint32_t *w)
{
	for (;;) {
		uint32_t v = 0;
		/* Ordering: acquire; pairs with the release in idx_unlock(). */
		if (__atomic_compare_exchange_n(w, &v, 1, true, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
			return;
		__builtin_ia32_pause();
	}
}

static inline void idx_unlock(uint32_t *w)
{
	__atomic_store_n(w, 0, __ATOMIC_RELEASE);
}

/* ---------------------------------------------------------------- run table */

static inline struct idx_seg *seg_of(struct kvr_index *idx, uint64_t seq)
{
	return &idx->seg[seq >> (64 - IDX_SEGS_BITS)];
}

static inline uint64_t ent_seq(uint64_t e)
{
	return idx_ent_run(e)->first;
}

static inline uint64_t ent_of(const struct idx_run *r)
{
	return idx_tag(r->first) << 48 | (uintptr_t)r;
}

/* Bytes of a segment array of cap entries and its retire record, as the allocator takes them. */
static int64_t tab_real(uint64_t cap)
{
	return (int64_t)kvr_alloc_real_size_aligned(idx_bytes_tab(cap)) +
	       idx_real(sizeof(struct idx_tret));
}

/* Puts a segment array that readers no longer reach from the view on the retire list, through
 * its record (readers may still probe every entry of it, so the link cannot live in it). */
static void tab_retire(struct kvr_index *idx, struct idx_seg *s)
{
	struct idx_tret *tr = s->tr;
	tr->ec = (uintptr_t)s->tab | idx_tab_code(s->cap);
	tr->next = idx->rt.tabs;
	idx->rt.tabs = tr;
	idx->rt.n++;
}

/* Copies the live entries of s->tab into a new array of cap entries and publishes it.
 * Context: writer (wlock).  Returns 0 or KVR_ENOMEM (nothing changed). */
static int seg_rebuild(struct kvr_index *idx, struct idx_seg *s, uint64_t cap)
{
	struct idx_tret *tr = kvr_alloc(sizeof(*tr));
	uint64_t *nt = tr ? kvr_alloc_aligned(idx_bytes_tab(cap)) : NULL;
	if (!nt) {
		kvr_free(tr, sizeof(*tr));
		return KVR_ENOMEM;
	}
	memset(nt, 0, idx_bytes_tab(cap));
	uint64_t *const ot = s->tab;
	const uint64_t ocap = s->cap;
	for (uint64_t i = 0; ot && i < ocap; i++) {
		uint64_t e = ot[i];
		if (e <= IDX_TOMB)
			continue;
		uint64_t j = idx_tab_home(ent_seq(e), cap);
		while (nt[j])
			j = j + 1 == cap ? 0 : j + 1;
		nt[j] = e;
	}
	idx_count(&idx->bytes_shared, tab_real(cap));
	/* Ordering: release; pairs with the acquire load of view[] in idx_find_run(). */
	kvr_rcu_publish(&idx->view[s - idx->seg], (uintptr_t)nt | idx_tab_code(cap));
	if (ot)
		tab_retire(idx, s);
	s->tombs = 0;
	s->tab = nt;
	s->cap = cap;
	s->tr = tr;
	return 0;
}

/* Gives back the array of a segment that holds no run (never fails). */
static void seg_drop(struct kvr_index *idx, struct idx_seg *s)
{
	kvr_rcu_publish(&idx->view[s - idx->seg], (uintptr_t)0);
	tab_retire(idx, s);
	s->tab = NULL;
	s->cap = 0;
	s->tr = NULL;
	s->tombs = 0;
}

/* Smallest capacity of the sequence 16, 24, 32, 48, ... (idx_seg) with load <= 0.6. */
static uint64_t cap_for(uint64_t count)
{
	uint64_t cap = TAB_MIN;
	while (count * 5 > cap * 3)
		cap = (cap & (cap - 1)) ? (cap & (cap - 1)) << 1 : cap + cap / 2;
	return cap;
}

struct idx_run *kvr_index_tab_first(const struct kvr_index *idx, uint64_t seq)
{
	const struct idx_seg *s = &idx->seg[seq >> (64 - IDX_SEGS_BITS)];
	const uint64_t *t = s->tab;
	if (!t)
		return NULL;
	const uint64_t want = idx_tag(seq), cap = s->cap;
	for (uint64_t i = idx_tab_home(seq, cap);; i = i + 1 == cap ? 0 : i + 1) {
		uint64_t e = t[i];
		if (!e)
			return NULL;
		if ((e >> 48) == want && e != IDX_TOMB && idx_ent_run(e)->first == seq)
			return idx_ent_run(e);
	}
}

int kvr_index_tab_reserve(struct kvr_index *idx, uint64_t seq)
{
	struct idx_seg *s = seg_of(idx, seq);
	/* Grow at load 0.8 (tombstones count: they lengthen probes). */
	if (s->tab && ((uint64_t)s->count + s->tombs + 1) * 5 <= s->cap * 4)
		return 0;
	return seg_rebuild(idx, s, cap_for((uint64_t)s->count + 1));
}

void kvr_index_tab_insert(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_seg *s = seg_of(idx, r->first);
	uint64_t *t = s->tab;
	const uint64_t cap = s->cap;
	uint64_t i = idx_tab_home(r->first, cap);
	while (t[i] > IDX_TOMB)
		i = i + 1 == cap ? 0 : i + 1;
	if (t[i] == IDX_TOMB)
		s->tombs--;
	/* Ordering: release; pairs with the acquire in idx_find_run(): a reader that sees the
	 * entry sees the run's first, parent, off, len and seqs. */
	__atomic_store_n(&t[i], ent_of(r), __ATOMIC_RELEASE);
	s->count++;
}

void kvr_index_tab_unreserve(struct kvr_index *idx, uint64_t seq)
{
	struct idx_seg *s = seg_of(idx, seq);
	if (s->tab && s->count == 0)
		seg_drop(idx, s);
}

void kvr_index_tab_delete(struct kvr_index *idx, const struct idx_run *r)
{
	const uint64_t seq = r->first;
	struct idx_seg *s = seg_of(idx, seq);
	uint64_t *t = s->tab;
	if (!t)
		return; /* NEVER */
	const uint64_t cap = s->cap;
	/* The entry is known exactly: compare words, no key dereference. */
	const uint64_t want = ent_of(r);
	for (uint64_t i = idx_tab_home(seq, cap);; i = i + 1 == cap ? 0 : i + 1) {
		uint64_t e = t[i];
		if (!e)
			return; /* NEVER: a block in the tree is in its segment */
		if (e == want) {
			__atomic_store_n(&t[i], IDX_TOMB, __ATOMIC_RELAXED);
			s->count--;
			s->tombs++;
			break;
		}
	}
	/* Give memory back after mass removal; keep the old array if the new one fails. */
	if (s->count == 0)
		seg_drop(idx, s);
	else if (cap > TAB_MIN && (uint64_t)s->count * 8 < cap)
		(void)seg_rebuild(idx, s, cap_for(s->count));
	else if ((uint64_t)s->tombs * 4 > cap)
		(void)seg_rebuild(idx, s, cap); /* purge tombstones */
}

/* ---------------------------------------------------------------- deferred free */

/*
 * Every call_rcu the index makes goes through one record type and one counter, `pending`, so
 * that kvr_index_quiesce() and destroy can wait for exactly this index's callbacks without
 * rcu_barrier(): liburcu is uninstrumented, and counting with C11 atomics lets
 * ThreadSanitizer see the order (submit: TSan release on the RCU token after the record is
 * filled; callback: acquire on entry, release-decrement of pending as its last access).
 */
enum cb_kind { CB_BATCH, CB_SLOT, CB_RTAB };

struct idx_cb {
	struct rcu_head head;
	struct kvr_index *idx;
	enum cb_kind kind;
	uint32_t slot;
	struct idx_rtab *rtab;
	struct idx_retire rt;
};

static void free_batch(struct kvr_index *idx, struct idx_retire *rt)
{
	int64_t shared = 0, ranks = 0;
	for (struct idx_run *r = rt->runs, *next; r; r = next) {
		next = (struct idx_run *)(uintptr_t)r->ch;
		kvr_free(r, sizeof(*r));
		shared += idx_real(sizeof(*r));
	}
	for (uint64_t *q = rt->seqs, *next; q; q = next) {
		next = (uint64_t *)(uintptr_t)idx_lo_ptr(q[0]); /* the header word: link | cap */
		const uint32_t cap = idx_seqs_wcap(q[0]);
		shared += idx_real(idx_bytes_seqs(cap));
		kvr_free(q, idx_bytes_seqs(cap));
	}
	for (struct idx_hset *h = rt->sets, *next; h; h = next) {
		next = h->next_free;
		ranks += idx_real(idx_bytes_hset(h->cap));
		kvr_free(h, idx_bytes_hset(h->cap));
	}
	for (struct idx_tret *t = rt->tabs, *next; t; t = next) {
		next = t->next;
		const uint64_t cap = idx_tab_cap(t->ec & 63);
		shared += tab_real(cap);
		kvr_free_aligned((void *)(t->ec & ~(uintptr_t)63), idx_bytes_tab(cap));
		kvr_free(t, sizeof(*t));
	}
	idx_count(&idx->bytes_shared, -shared);
	idx_count(&idx->bytes_rank, -ranks);
}

static void release_slot(struct kvr_index *idx, uint32_t slot);
static size_t rtab_bytes(uint32_t mask);

static void run_cb(struct idx_cb *cb)
{
	struct kvr_index *idx = cb->idx;
	switch (cb->kind) {
	case CB_BATCH:
		free_batch(idx, &cb->rt);
		break;
	case CB_SLOT:
		release_slot(idx, cb->slot);
		break;
	case CB_RTAB:
		kvr_free(cb->rtab, rtab_bytes(cb->rtab->mask));
		break;
	}
}

static void idx_cb_fn(struct rcu_head *head)
{
	KVR_RCU_CALLBACK_ENTER();
	struct idx_cb *cb = caa_container_of(head, struct idx_cb, head);
	struct kvr_index *idx = cb->idx;
	run_cb(cb);
	kvr_free(cb, sizeof(*cb));
	/* Ordering: release, the callback's last access to idx; pairs with the acquire in
	 * kvr_index_quiesce(). */
	__atomic_sub_fetch(&idx->pending, 1, __ATOMIC_RELEASE);
}

/* Runs cb's work after a grace period.  cb is a filled stack template; a heap copy is queued,
 * or, without memory or on a thread that cannot be registered (call_rcu needs a registered
 * caller), the grace period is waited for here: never leaked, never freed early.  It cannot fail,
 * so it cannot report KVR_ENOMEM; the writers that reach it returned that before changing
 * anything when the caller cannot be registered, so the wait is a fallback only.  Context: a
 * writer, outside a read section (it may hold wlock: readers never take it; synchronize_rcu
 * needs no registration). */
static void idx_defer(struct idx_cb *tmpl)
{
	struct idx_cb *cb = kvr_rcu_thread_online() == 0 ? kvr_alloc(sizeof(*cb)) : NULL;
	if (!cb) {
		kvr_rcu_synchronize();
		KVR_RCU_CALLBACK_ENTER();
		run_cb(tmpl);
		return;
	}
	*cb = *tmpl;
	__atomic_add_fetch(&cb->idx->pending, 1, __ATOMIC_RELAXED);
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	kvr_rcu_call(&cb->head, idx_cb_fn);
}

void kvr_index_retire_flush(struct kvr_index *idx, struct idx_retire *rt)
{
	if (!rt->runs && !rt->seqs && !rt->sets && !rt->tabs)
		return;
	struct idx_cb t = {.idx = idx, .kind = CB_BATCH, .rt = *rt};
	idx_defer(&t);
	memset(rt, 0, sizeof(*rt));
}

void kvr_index_flush_retired(struct kvr_index *idx)
{
	if (!idx)
		return;
	pthread_mutex_lock(&idx->wlock); /* the batch is the writers' */
	kvr_index_retire_flush(idx, &idx->rt);
	pthread_mutex_unlock(&idx->wlock);
}

bool kvr_index_flush_retired_try(struct kvr_index *idx)
{
	if (!idx)
		return true;
	if (pthread_mutex_trylock(&idx->wlock) != 0)
		return false; /* its holder flushes when it goes idle (index.h says why) */
	kvr_index_retire_flush(idx, &idx->rt);
	pthread_mutex_unlock(&idx->wlock);
	return true;
}

void kvr_index_quiesce(struct kvr_index *idx)
{
	if (!idx)
		return;
	/* What the writers retired since their last full batch, or the wait below would not
	 * cover it and the counters would stay above what is live. */
	kvr_index_flush_retired(idx);
	/* Ordering: acquire; pairs with the release decrement in idx_cb_fn(). */
	while (__atomic_load_n(&idx->pending, __ATOMIC_ACQUIRE) != 0) {
		struct timespec ts = {0, 100000};
		nanosleep(&ts, NULL);
	}
	/* No writer runs: the readers' tree sizes become exact (idx_size_set publishes them in
	 * steps). */
	const uint32_t used = __atomic_load_n(&idx->fresh, __ATOMIC_RELAXED);
	for (uint32_t s = 0; s < used; s++)
		__atomic_store_n(&idx->tsize[s],
		                 __atomic_load_n(&idx->rank[s].size, __ATOMIC_RELAXED),
		                 __ATOMIC_RELAXED);
}

/* ---------------------------------------------------------------- create / destroy */

static uint32_t rtab_cap(uint32_t max_ranks)
{
	uint32_t cap = 16;
	while (cap < max_ranks * 2u)
		cap <<= 1;
	return cap;
}

static size_t rtab_bytes(uint32_t mask)
{
	return sizeof(struct idx_rtab) + ((size_t)mask + 1) * sizeof(uint32_t);
}

int kvr_index_create(uint32_t max_ranks, struct kvr_index **out)
{
	if (!out)
		return KVR_EINVAL;
	*out = NULL;
	if (max_ranks == 0 || max_ranks > KVR_INDEX_MAX_RANKS)
		return KVR_ERANGE;
	struct kvr_index *idx = kvr_alloc_aligned(sizeof(*idx));
	if (!idx)
		return KVR_ENOMEM;
	memset(idx, 0, sizeof(*idx));
	idx->max_ranks = max_ranks;
	idx->rank = kvr_alloc_aligned(sizeof(struct idx_rank) * max_ranks);
	idx->tsize = kvr_calloc(max_ranks, sizeof(uint64_t));
	uint32_t cap = rtab_cap(max_ranks);
	idx->rtab = kvr_calloc(1, rtab_bytes(cap - 1));
	idx->scratch = kvr_alloc(IDX_SCRATCH_MIN * sizeof(uint64_t));
	idx->scratch_cap = idx->scratch ? IDX_SCRATCH_MIN : 0;
	if (!idx->rank || !idx->tsize || !idx->rtab || !idx->scratch ||
	    pthread_mutex_init(&idx->wlock, NULL) != 0) {
		kvr_free_aligned(idx->rank, sizeof(struct idx_rank) * max_ranks);
		kvr_free(idx->tsize, idx->tsize ? max_ranks * sizeof(uint64_t) : 0);
		kvr_free(idx->rtab, idx->rtab ? rtab_bytes(cap - 1) : 0);
		kvr_free(idx->scratch, idx->scratch_cap * sizeof(uint64_t));
		kvr_free_aligned(idx, sizeof(*idx));
		return KVR_ENOMEM;
	}
	idx->rtab->mask = cap - 1;
	/* idx->rank is zeroed (SLOT_FREE) by the allocator and left untouched: fresh pages cost no
	 * RSS until a rank is added there (512 KiB at the default max_ranks). */
	idx->free_head = UINT32_MAX;
	idx->fresh = 0;
	*out = idx;
	return 0;
}

void kvr_index_destroy(struct kvr_index *idx)
{
	if (!idx)
		return;
	/* Pending callbacks (retired batches, slot releases) point at idx. */
	kvr_index_quiesce(idx);
	free_batch(idx, &idx->rt);                /* nobody reads them any more */
	for (uint32_t i = 0; i < IDX_SEGS; i++) { /* every live run has one entry */
		const uint64_t *t = idx->seg[i].tab;
		for (uint64_t j = 0; t && j < idx->seg[i].cap; j++)
			if (t[j] > IDX_TOMB)
				kvr_index_free_run_now(idx, idx_ent_run(t[j]));
	}
	kvr_index_blk_fini(idx);
	for (uint32_t i = 0; i < IDX_SEGS; i++)
		if (idx->seg[i].tab) {
			kvr_free_aligned(idx->seg[i].tab, idx_bytes_tab(idx->seg[i].cap));
			kvr_free(idx->seg[i].tr, sizeof(struct idx_tret));
		}
	for (uint32_t i = 0; i < idx->fresh; i++) {
		struct idx_rank *r = &idx->rank[i];
		kvr_index_xmap_free(&r->xmap);
		kvr_index_xmap_free(&r->amap);
		kvr_index_xmap_free(&r->cmap);
		if (r->tops.e)
			kvr_free(r->tops.e, (size_t)r->tops.cap * sizeof(uint64_t));
	}
	kvr_free(idx->scratch, idx->scratch_cap * sizeof(uint64_t));
	pthread_mutex_destroy(&idx->wlock);
	kvr_free(idx->rtab, rtab_bytes(idx->rtab->mask));
	kvr_free_aligned(idx->rank, sizeof(struct idx_rank) * idx->max_ranks);
	kvr_free(idx->tsize, idx->max_ranks * sizeof(uint64_t));
	kvr_free_aligned(idx, sizeof(*idx));
}

/* ---------------------------------------------------------------- rank slots */

static uint64_t rank_hash(uint64_t worker_id, uint32_t dp_rank)
{
	uint64_t x = worker_id ^ ((uint64_t)dp_rank * 0x9e3779b97f4a7c15ull);
	x ^= x >> 31;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 29;
	return x;
}

static bool rank_is(const struct idx_rank *r, uint64_t worker_id, uint32_t dp_rank)
{
	return __atomic_load_n(&r->worker_id, __ATOMIC_RELAXED) == worker_id &&
	       __atomic_load_n(&r->dp_rank, __ATOMIC_RELAXED) == dp_rank &&
	       __atomic_load_n(&r->state, __ATOMIC_RELAXED) == SLOT_ACTIVE;
}

/* Probe for (worker, dp); returns the entry index or UINT32_MAX.  Context: any, with the table
 * pinned (read section or rank_lock). */
static uint32_t rtab_find(const struct kvr_index *idx, const struct idx_rtab *t, uint64_t worker_id,
                          uint32_t dp_rank)
{
	for (uint32_t i = (uint32_t)rank_hash(worker_id, dp_rank) & t->mask;;
	     i = (i + 1) & t->mask) {
		/* Ordering: acquire; pairs with the release store in rank_add. */
		uint32_t v = __atomic_load_n(&t->e[i], __ATOMIC_ACQUIRE);
		if (v == 0)
			return UINT32_MAX;
		if (v != UINT32_MAX && rank_is(&idx->rank[v - 1], worker_id, dp_rank))
			return i;
	}
}

/* Rebuilds the slot lookup table without tombstones.  Context: rank_lock held. */
static void rtab_purge(struct kvr_index *idx)
{
	struct idx_rtab *ot = idx->rtab;
	struct idx_rtab *nt = kvr_calloc(1, rtab_bytes(ot->mask));
	if (!nt)
		return; /* keep the tombstones; lookups stay correct, only slower */
	nt->mask = ot->mask;
	for (uint32_t i = 0; i <= ot->mask; i++) {
		uint32_t v = ot->e[i];
		if (v == 0 || v == UINT32_MAX)
			continue;
		const struct idx_rank *r = &idx->rank[v - 1];
		uint32_t j = (uint32_t)rank_hash(r->worker_id, r->dp_rank) & nt->mask;
		while (nt->e[j])
			j = (j + 1) & nt->mask;
		nt->e[j] = v;
		nt->used++;
	}
	kvr_rcu_publish(&idx->rtab, nt);
	struct idx_cb cb = {.idx = idx, .kind = CB_RTAB, .rtab = ot};
	idx_defer(&cb);
}

/* Where an insert of (worker, dp) goes: the first tombstone or empty entry on its probe path.
 * Context: rank_lock held. */
static uint32_t rtab_slot_for(const struct idx_rtab *t, uint64_t worker_id, uint32_t dp_rank)
{
	uint32_t i = (uint32_t)rank_hash(worker_id, dp_rank) & t->mask;
	while (t->e[i] != 0 && t->e[i] != UINT32_MAX)
		i = (i + 1) & t->mask;
	return i;
}

/* Whether (worker, dp) may be inserted into *t: past 3/4 of the table in use (entries and
 * tombstones), the tombstones are purged first (*t then the new table); with no memory for
 * that, only an insert that reuses a tombstone may go, so that a quarter of the table stays
 * empty.  Before, an insert took an empty entry all the same: a churn of adds and removes under
 * a lasting allocation failure used every empty entry up, and a lookup of an absent rank (which
 * stops only at one) spun for good, under the rank lock in rank_add and in the lock-free
 * rank_find.  Context: rank_lock held. */
static bool rtab_room(struct kvr_index *idx, struct idx_rtab **t, uint64_t worker_id,
                      uint32_t dp_rank)
{
	const uint32_t most = ((*t)->mask + 1) / 4 * 3;
	if ((*t)->used + 1 <= most)
		return true;
	rtab_purge(idx);
	*t = idx->rtab;
	return (*t)->used + 1 <= most || (*t)->e[rtab_slot_for(*t, worker_id, dp_rank)] != 0;
}

int kvr_index_rank_add(struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank, uint32_t *slot)
{
	if (!idx || !slot)
		return KVR_EINVAL;
	/* A table purge below retires the old one through call_rcu (registered callers only). */
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	int rc = 0;
	idx_lock(&idx->rank_lock);
	struct idx_rtab *t = idx->rtab;
	uint32_t at = rtab_find(idx, t, worker_id, dp_rank);
	if (at != UINT32_MAX) {
		*slot = t->e[at] - 1;
		rc = KVR_EEXIST;
	} else if (idx->free_head == UINT32_MAX && idx->fresh == idx->max_ranks) {
		rc = KVR_ERANGE;
	} else if (!rtab_room(idx, &t, worker_id, dp_rank)) {
		rc = KVR_ENOMEM;
	} else {
		/* A released slot first (the most recent), else the next never used one. */
		uint32_t s = idx->free_head;
		if (s != UINT32_MAX)
			idx->free_head = idx->rank[s].next_free;
		else
			__atomic_store_n(&idx->fresh, (s = idx->fresh) + 1, __ATOMIC_RELAXED);
		struct idx_rank *r = &idx->rank[s];
		__atomic_store_n(&r->worker_id, worker_id, __ATOMIC_RELAXED);
		__atomic_store_n(&r->dp_rank, dp_rank, __ATOMIC_RELAXED);
		__atomic_store_n(&idx->tsize[s], 0, __ATOMIC_RELAXED);
		__atomic_store_n(&r->size, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&r->state, SLOT_ACTIVE, __ATOMIC_RELAXED);
		r->holds = NULL;
		memset(&r->xmap, 0, sizeof(r->xmap));
		memset(&r->amap, 0, sizeof(r->amap));
		memset(&r->cmap, 0, sizeof(r->cmap));
		memset(&r->tops, 0, sizeof(r->tops));
		uint32_t i = rtab_slot_for(t, worker_id, dp_rank);
		if (t->e[i] == 0)
			t->used++;
		/* Ordering: release; pairs with the acquire in rtab_find(). */
		__atomic_store_n(&t->e[i], s + 1, __ATOMIC_RELEASE);
		idx_count(&idx->active_ranks, 1);
		*slot = s;
	}
	idx_unlock(&idx->rank_lock);
	return rc;
}

int kvr_index_rank_find(const struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank,
                        uint32_t *slot)
{
	if (!idx || !slot)
		return KVR_EINVAL;
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	kvr_rcu_read_lock();
	const struct idx_rtab *t = kvr_rcu_deref((struct idx_rtab **)&idx->rtab);
	uint32_t at = rtab_find(idx, t, worker_id, dp_rank);
	int rc = KVR_ENOENT;
	if (at != UINT32_MAX) {
		*slot = __atomic_load_n(&t->e[at], __ATOMIC_RELAXED) - 1;
		rc = 0;
	}
	kvr_rcu_read_unlock();
	return rc;
}

int kvr_index_rank_get(const struct kvr_index *idx, uint32_t slot, uint64_t *worker_id,
                       uint32_t *dp_rank)
{
	if (!idx || slot >= idx->max_ranks)
		return KVR_EINVAL;
	const struct idx_rank *r = &idx->rank[slot];
	if (__atomic_load_n(&r->state, __ATOMIC_RELAXED) != SLOT_ACTIVE)
		return KVR_ENOENT;
	if (worker_id)
		*worker_id = __atomic_load_n(&r->worker_id, __ATOMIC_RELAXED);
	if (dp_rank)
		*dp_rank = __atomic_load_n(&r->dp_rank, __ATOMIC_RELAXED);
	return 0;
}

struct idx_rank *kvr_index_rank_get_active(struct kvr_index *idx, uint32_t slot)
{
	if (!idx || slot >= idx->max_ranks)
		return NULL;
	struct idx_rank *r = &idx->rank[slot];
	return __atomic_load_n(&r->state, __ATOMIC_RELAXED) == SLOT_ACTIVE ? r : NULL;
}

static void release_slot(struct kvr_index *idx, uint32_t slot)
{
	idx_lock(&idx->rank_lock);
	struct idx_rank *r = &idx->rank[slot];
	__atomic_store_n(&r->state, SLOT_FREE, __ATOMIC_RELAXED);
	r->next_free = idx->free_head;
	idx->free_head = slot;
	idx_unlock(&idx->rank_lock);
}

int kvr_index_rank_remove(struct kvr_index *idx, uint32_t slot)
{
	if (!idx)
		return KVR_EINVAL;
	int rc = kvr_index_clear_rank(idx, slot);
	if (rc != 0)
		return rc;
	struct idx_rank *r = &idx->rank[slot];
	idx_lock(&idx->rank_lock);
	struct idx_rtab *t = idx->rtab;
	uint32_t at = rtab_find(idx, t, r->worker_id, r->dp_rank);
	if (at != UINT32_MAX) {
		__atomic_store_n(&t->e[at], UINT32_MAX, __ATOMIC_RELAXED);
		t->tombs++;
	}
	__atomic_store_n(&r->state, SLOT_RETIRING, __ATOMIC_RELAXED);
	idx_count(&idx->active_ranks, -1);
	idx_unlock(&idx->rank_lock);
	struct idx_cb cb = {.idx = idx, .kind = CB_SLOT, .slot = slot};
	idx_defer(&cb);
	return 0;
}

/* ---------------------------------------------------------------- stats */

uint64_t kvr_index_tree_size(const struct kvr_index *idx, uint32_t slot)
{
	if (!idx || slot >= idx->max_ranks ||
	    slot >= __atomic_load_n(&idx->fresh, __ATOMIC_RELAXED)) /* never used: no record */
		return 0;
	/* The exact size (the readers' copy lags by up to 1/64: idx_size_set). */
	return __atomic_load_n(&idx->rank[slot].size, __ATOMIC_RELAXED);
}

static uint64_t ld(const uint64_t *p)
{
	return __atomic_load_n(p, __ATOMIC_RELAXED);
}

void kvr_index_stats_get(const struct kvr_index *idx, struct kvr_index_stats *st)
{
	if (!st)
		return;
	memset(st, 0, sizeof(*st));
	if (!idx)
		return;
	st->parent_not_found = ld(&idx->c_parent_nf);
	st->block_not_found = ld(&idx->c_block_nf);
	st->invalid = ld(&idx->c_invalid);
	st->rank_scans = ld(&idx->c_rank_scans);
	st->stored_blocks = ld(&idx->c_stored);
	st->removed_blocks = ld(&idx->c_removed);
	st->nodes = ld(&idx->c_nodes);
	st->copies = ld(&idx->c_copies);
	st->ranks = ld(&idx->active_ranks);
	st->bytes_shared = ld(&idx->bytes_shared);
	st->bytes_per_rank = ld(&idx->bytes_rank);
}

uint64_t kvr_index_memory_bytes(const struct kvr_index *idx)
{
	if (!idx)
		return 0;
	/* Allocator-real sizes, as the counters (index_internal.h: idx_real); the writers'
	 * store scratch too (core/index_write.c). */
	const size_t scratch = __atomic_load_n(&idx->scratch_cap, __ATOMIC_RELAXED);
	return ld(&idx->bytes_shared) + ld(&idx->bytes_rank) +
	       kvr_alloc_real_size(scratch * sizeof(uint64_t)) +
	       kvr_alloc_real_size_aligned(sizeof(*idx)) +
	       kvr_alloc_real_size_aligned(sizeof(struct idx_rank) * idx->max_ranks) +
	       kvr_alloc_real_size(sizeof(uint64_t) * idx->max_ranks) +
	       kvr_alloc_real_size(rtab_bytes(rtab_cap(idx->max_ranks) - 1)); /* purges keep
	                                                                       * the size */
}
