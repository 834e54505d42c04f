/*
 * core/index_internal.h - the run-compressed index's data structures, for core/index*.c only.
 * The design essay is at the top of core/index.c.
 */
#ifndef KVR_CORE_INDEX_INTERNAL_H
#define KVR_CORE_INDEX_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/alloc.h"
#include "core/index.h"
#include "core/place.h"
#include "kvrouter.h" /* the KVR_E* codes idx_write_begin returns */
#include "sync/rcu.h"

#define IDX_CACHELINE 64
#define IDX_SEGS_BITS 8
#define IDX_SEGS      (1u << IDX_SEGS_BITS)
#define IDX_RUN_MAX                                                                                \
	2048u /* blocks in one run; longer chains chain runs (a writer looking a block up by hash  \
	       * scans its run: core/index_blocks.c) */

/*
 * A run's sequence hashes: one array uint64_t s[cap], exactly cap words (cap
 * one of the allocator's size classes / 8: idx_seqs_cap), or, for a one-block run, the run
 * header's `first` (cap 1, no allocation).  Positions 1 .. cap-1 hold hashes and are
 * WRITE-ONCE: s[p] never changes after it was written (a trim lowers the run's len but keeps
 * s[], and a different block at a trimmed position forks a child run instead of overwriting),
 * so a reader holding a stale len still compares permanent content.  Position 0's hash is
 * r->first, which is how readers found the run, so they never read s[0] (find_matches credits
 * an overlap of one block without a comparison), and s[0] is the array's HEADER WORD, writers'
 * only: cap << IDX_HI_SHIFT | the run's block-locator id (0: none) while the run uses the
 * array, cap << IDX_HI_SHIFT | the next retired array once retired (the batched call_rcu
 * reclamation's list; readers may still be reading s[1..]).  It was a 16-byte header in front
 * of the hashes: a 512-block array asked 4,112 bytes and jemalloc gave 5,120.  Growing copies
 * s[1..hw) into a new array and publishes it.  Writers read a position through idx_run_hash().
 */

/*
 * A run's holders, sorted by slot: e[i] = (slot << 32 | cut), one atomic word each, where the
 * rank holds positions [0, cut) of the run without a gap (what readers use).  Copy-on-write when
 * a rank joins or leaves; cut changes are in-place atomic stores.  Without memory for a smaller
 * copy, a leaving rank's word is overwritten with a neighbour's (readers skip adjacent
 * duplicates; writers keep duplicates equal).  hold[] (writer-only, after e[cap]) is parallel.
 */
struct idx_hset {
	uint32_t n;
	uint32_t cap;
	struct idx_hset *next_free;
	uint64_t e[];
	/* struct idx_hold *hold[cap] follows e[cap] */
};

static inline struct idx_hold **idx_hset_holds(const struct idx_hset *h)
{
	return (struct idx_hold **)(uintptr_t)&h->e[h->cap];
}

/* A run's holders as writers see them: the set, or the embedded single holder as a set of one
 * (e = &run->hs, holds NULL, one = &run->eh), or none.  idx_hv_hold() gives record i. */
struct idx_hview {
	uint32_t n;
	uint64_t *e;
	struct idx_hold **holds;
	struct idx_hold *one;
};

static inline struct idx_hold *idx_hv_hold(const struct idx_hview *v, uint32_t i)
{
	return v->holds ? v->holds[i] : v->one;
}

static inline uint64_t idx_bytes_hset(uint32_t cap)
{
	return sizeof(struct idx_hset) + (uint64_t)cap * (sizeof(uint64_t) + sizeof(void *));
}

/*
 * Writer-only record of one (rank, run): a bitmap of the held positions (bm[p/64] bit p%64),
 * so a removal never needs memory (an interior hole just clears a bit), the gap-free prefix
 * cut (mirrored into the run's hset) and top (highest held position + 1; 0: the record holds
 * nothing).  Copies beyond the first (count_copies) are counted in the rank's cmap, not here:
 * few records ever have one, so a pointer per record would cost every record 8 bytes.
 * 32 bytes (jemalloc's 32-byte class; it was 40, in the 48-byte class): slot (20 bits), top,
 * cut (12 bits each, <= IDX_RUN_MAX) and log2 of the bitmap's words (3 bits; the bitmap is a
 * power of two of words) ride in the high 16 bits of the three pointer words (below 2^48, as
 * the run table assumes); the count of held positions is a popcount when needed (rank clear).
 * Every run carries one record in its header (struct idx_run.eh, "embedded"): the first rank to
 * hold a run uses it, so a run with one holder costs no record allocation (80 bytes for header
 * and record together instead of 64 + 32); further holders get records of their own.  An embedded
 * record in use has IDX_HOLD_EMB_HI in nw's high bits (the run is then the header it sits in),
 * a free one has nw == 0.  Use the accessors.
 */
struct idx_hold {
	uint64_t rw; /* run | slot bits 0..15 << 48 (embedded record: the run's sibling link |
	              * slot bits 0..15 << 48; its run is the one it is in) */
	uint64_t pw; /* prev in the rank's list | (slot bits 16..19 | top << 4) << 48 */
	uint64_t nw; /* next in the rank's list | (cut | log2(bitmap words) << 12 |
	              * IDX_HOLD_EMB_HI) << 48 */
	union {
		uint64_t *bm; /* more than one word */
		uint64_t bm0; /* one word: inline */
	};
};

_Static_assert(sizeof(struct idx_hold) == 32, "a holder record is one 32-byte jemalloc class");

#define IDX_HOLD_EMB_HI (1ull << 15) /* nw's high bits: the record is a run's embedded one */

/*
 * A run: consecutive blocks of one chain.  Its first block hangs below block off-1 of parent
 * (parent NULL: below the root, off 0).  Reader fields: first, parent and off (immutable), len
 * and seqs (one word, RCU-published), hs.  The rest is the writers' (under kvr_index.wlock).
 * The 16-bit fields ride in the high bits of the pointer words (user-space pointers are below
 * 2^48, as the run table's entries already assume); readers compare parent and off with one
 * word, and load len and seqs with one acquire.  80 bytes (jemalloc's 80-byte class) with the
 * embedded holder record eh (struct idx_hold): a one-holder run was a 64-byte header plus a
 * 32-byte record (96); the single holder's reader word, which had a word of its own beside a
 * tagged record pointer, is now hs itself, and the sibling list's back link rides in the
 * embedded record's run word (the run is implied there).  Use the accessors.
 */
struct idx_run {
	uint64_t first; /* position 0's hash: the table key readers check */
	uint64_t po;    /* parent | off << 48 (off <= IDX_RUN_MAX); immutable */
	uint64_t sl;    /* seqs | len << 48: seqs is &first (a one-block run, no allocation) or
	                 * the run's array (s[0]: its header word, readers skip it); positions
	                 * [0, len) are in the tree.  Readers: acquire load; writers: release
	                 * stores (idx_run_set_len / idx_run_set_seqs) */
	uint64_t hs;    /* readers' holder words: IDX_HS_SET | the holder set, or the word
	                 * (slot << 32 | cut) of the single holder when that is the embedded
	                 * record eh; 0 when nobody holds the run (slot 0 with cut 0 credits
	                 * nothing, exactly like no holder).  Release stores, acquire loads */
	uint64_t ch;    /* children list | max_child_off << 48 (>= the largest off of a child, exact
	                 * after run_check); the retire-list link once dead.  Writers' (stored with
	                 * relaxed atomics once the run is published); readers take its high bits
	                 * as a HINT of where the query leaves the run (idx_run_mco_hint) */
	/* writer only */
	uint64_t sb; /* next sibling | hw << 48 (positions ever written into seqs: write-once, all
	              * in the block locator until the run dies) */
	struct idx_hold eh; /* the embedded holder record; eh.rw's pointer bits are the previous
	                     * sibling (idx_run_sib_prev) */
};

/* hs's tag: the rest of the word is a holder set's address (a holder word never has bit 63:
 * slots are 20 bits). */
#define IDX_HS_SET (1ull << 63)

#define IDX_HI_SHIFT 48

_Static_assert(sizeof(struct idx_run) == 80, "a run header is one 80-byte jemalloc class");

static inline uint64_t idx_lo_ptr(uint64_t w)
{
	return w & ((1ull << IDX_HI_SHIFT) - 1);
}

/* A 16-bit field in the high bits of a pointer word, and the pointer, replaced. */
static inline uint64_t idx_hi(uint64_t w)
{
	return w >> IDX_HI_SHIFT;
}

static inline uint64_t idx_set_hi(uint64_t w, uint64_t hi)
{
	return idx_lo_ptr(w) | hi << IDX_HI_SHIFT;
}

static inline uint64_t idx_set_lo(uint64_t w, const void *p)
{
	return (uint64_t)(uintptr_t)p | (w & ~idx_lo_ptr(~0ull));
}

static inline uint64_t idx_po(const struct idx_run *parent, uint32_t off)
{
	return (uint64_t)(uintptr_t)parent | (uint64_t)off << IDX_HI_SHIFT;
}

static inline struct idx_run *idx_run_parent(const struct idx_run *r)
{
	return (struct idx_run *)(uintptr_t)idx_lo_ptr(r->po);
}

static inline uint32_t idx_run_off(const struct idx_run *r)
{
	return (uint32_t)idx_hi(r->po);
}

/* Writer reads of len and seqs (only writers store them: no atomic needed to read). */
static inline uint32_t idx_run_len(const struct idx_run *r)
{
	return (uint32_t)idx_hi(r->sl);
}

static inline uint64_t *idx_run_seqs(const struct idx_run *r)
{
	return (uint64_t *)(uintptr_t)idx_lo_ptr(r->sl);
}

/* Ordering: release; pairs with the acquire load of sl in find_matches: a len covering a
 * position is stored after the position's hash was written into the array it points at. */
static inline void idx_run_set_len(struct idx_run *r, uint32_t len)
{
	__atomic_store_n(&r->sl, idx_set_hi(r->sl, len), __ATOMIC_RELEASE);
}

/* Ordering: release; publishes a new array (filled before this store) under the same len. */
static inline void idx_run_set_seqs(struct idx_run *r, uint64_t *s)
{
	__atomic_store_n(&r->sl, idx_set_lo(r->sl, s), __ATOMIC_RELEASE);
}

static inline struct idx_run *idx_run_child(const struct idx_run *r)
{
	return (struct idx_run *)(uintptr_t)idx_lo_ptr(r->ch);
}

static inline uint32_t idx_run_mco(const struct idx_run *r)
{
	return (uint32_t)idx_hi(r->ch);
}

/* Atomic stores: readers load the word for its hint (idx_run_mco_hint) and its first child
 * (idx_find_child), both values they verify.
 * Ordering: release; pairs with the acquire in idx_find_child(): a reader that reaches c
 * through its parent sees c's first, po, len and seqs (set before c is linked). */
static inline void idx_run_set_child(struct idx_run *r, const struct idx_run *c)
{
	__atomic_store_n(&r->ch, idx_set_lo(r->ch, c), __ATOMIC_RELEASE);
}

/* Release as well, though only the high bits change: a reader that loads this value follows its
 * low bits (idx_find_child), and under C11 a relaxed store, by another writer thread than the
 * one that linked the child, ends the release sequence of idx_run_set_child's store: the
 * reader would then read the child with no happens-before from its initialisation.  Free on
 * x86 (a release store is a plain mov). */
static inline void idx_run_set_mco(struct idx_run *r, uint32_t off)
{
	__atomic_store_n(&r->ch, idx_set_hi(r->ch, off), __ATOMIC_RELEASE);
}

/* The run's max child offset as a reader sees it: any value a writer stored (a stale bound, 0
 * once the run died and the word became a retire link).  Only a guess of the matched length,
 * which the reader checks with two comparisons (core/index_match.c: run_step).
 * Context: a reader inside a read section.  Ordering: relaxed; nothing is read through it. */
static inline uint32_t idx_run_mco_hint(const struct idx_run *r)
{
	return (uint32_t)idx_hi(__atomic_load_n(&r->ch, __ATOMIC_RELAXED));
}

static inline struct idx_run *idx_run_sib(const struct idx_run *r)
{
	return (struct idx_run *)(uintptr_t)idx_lo_ptr(r->sb);
}

/* sb's high bits: hw (<= IDX_RUN_MAX, 12 bits) and IDX_SB_LOC. */
#define IDX_SB_HW 0x7fffull
#define IDX_SB_LOC                                                                                 \
	0x8000ull /* the run is LOCATED: a rank held a position of it under its                    \
	           * sequence hash once (core/index_blocks.c) */

static inline uint32_t idx_run_hw(const struct idx_run *r)
{
	return (uint32_t)(idx_hi(r->sb) & IDX_SB_HW);
}

static inline void idx_run_set_sib(struct idx_run *r, const struct idx_run *c)
{
	r->sb = idx_set_lo(r->sb, c);
}

static inline void idx_run_set_hw(struct idx_run *r, uint32_t hw)
{
	r->sb = idx_set_hi(r->sb, (idx_hi(r->sb) & IDX_SB_LOC) | hw);
}

/* Whether the block locator holds r's positions [1, hw) (with the locator on): a run is located
 * from the first time a rank holds a position of it under its sequence hash (ext == seq) on, and
 * for good; a run only ever held under engine hashes (aliases) is not: its holders find its
 * blocks through their ext maps' places, never by sequence hash (core/index_blocks.c says why
 * and what that leaves). */
static inline bool idx_run_located(const struct idx_run *r)
{
	return (idx_hi(r->sb) & IDX_SB_LOC) != 0;
}

static inline void idx_run_set_located(struct idx_run *r)
{
	r->sb |= IDX_SB_LOC << IDX_HI_SHIFT;
}

/* The previous sibling: the pointer bits of the embedded record's run word. */
static inline struct idx_run *idx_run_sib_prev(const struct idx_run *r)
{
	return (struct idx_run *)(uintptr_t)idx_lo_ptr(r->eh.rw);
}

static inline void idx_run_set_sib_prev(struct idx_run *r, const struct idx_run *p)
{
	r->eh.rw = idx_set_lo(r->eh.rw, p);
}

/* Whether the embedded record is in use. */
static inline bool idx_run_eh_used(const struct idx_run *r)
{
	return (idx_hi(r->eh.nw) & IDX_HOLD_EMB_HI) != 0;
}

/* r's holder set, or NULL (its single holder is the embedded record, or none). */
static inline struct idx_hset *idx_run_set(const struct idx_run *r)
{
	return (r->hs & IDX_HS_SET) ? (struct idx_hset *)(uintptr_t)idx_lo_ptr(r->hs) : NULL;
}

static inline struct idx_hview idx_holders(const struct idx_run *cr)
{
	struct idx_run *r = (struct idx_run *)(uintptr_t)cr;
	struct idx_hset *hs = idx_run_set(r);
	if (hs)
		return (struct idx_hview){hs->n, hs->e, idx_hset_holds(hs), NULL};
	if (idx_run_eh_used(r))
		return (struct idx_hview){1, &r->hs, NULL, &r->eh};
	return (struct idx_hview){0, NULL, NULL, NULL};
}

static inline bool idx_seqs_inline(const struct idx_run *r)
{
	return idx_run_seqs(r) == &r->first;
}

/* The capacity of an array whose header word is w. */
static inline uint32_t idx_seqs_wcap(uint64_t w)
{
	return (uint32_t)idx_hi(w);
}

static inline uint32_t idx_run_cap(const struct idx_run *r)
{
	return idx_seqs_inline(r) ? 1 : idx_seqs_wcap(idx_run_seqs(r)[0]);
}

/* The run's number in the block locator (core/index_blocks.c), 0 while it has none: a run gets
 * one when it grows past one position, by then its hashes have their own array, whose header
 * word keeps the id (the run header does not pay 8 bytes for it). */
static inline uint32_t idx_run_id(const struct idx_run *r)
{
	return idx_seqs_inline(r) ? 0 : (uint32_t)idx_lo_ptr(idx_run_seqs(r)[0]);
}

/* Sets it (r has its own array; id < 2^IDX_ID_BITS, 0: none).  A one-block run's "array" is
 * its header's first, which must never be overwritten: it has no id to set. */
static inline void idx_run_set_id(struct idx_run *r, uint32_t id)
{
	if (idx_seqs_inline(r))
		return; /* NEVER: ids are given to runs with their own array only */
	uint64_t *s = idx_run_seqs(r);
	s[0] = idx_hi(s[0]) << IDX_HI_SHIFT | id;
}

/* Writers: the sequence hash at position p < hw.  Position 0's is r->first: s[0] of a run's
 * own array is its header word, never a hash. */
static inline uint64_t idx_run_hash(const struct idx_run *r, uint32_t p)
{
	return p ? idx_run_seqs(r)[p] : r->first;
}

static inline struct idx_run *idx_hold_run(const struct idx_hold *h)
{
	if (idx_hi(h->nw) & IDX_HOLD_EMB_HI)
		return (struct idx_run *)(uintptr_t)((uintptr_t)h - offsetof(struct idx_run, eh));
	return (struct idx_run *)(uintptr_t)idx_lo_ptr(h->rw);
}

static inline uint32_t idx_hold_slot(const struct idx_hold *h)
{
	return (uint32_t)(idx_hi(h->rw) | (idx_hi(h->pw) & 15) << 16);
}

static inline struct idx_hold *idx_hold_prev(const struct idx_hold *h)
{
	return (struct idx_hold *)(uintptr_t)idx_lo_ptr(h->pw);
}

static inline struct idx_hold *idx_hold_next(const struct idx_hold *h)
{
	return (struct idx_hold *)(uintptr_t)idx_lo_ptr(h->nw);
}

static inline void idx_hold_set_prev(struct idx_hold *h, const struct idx_hold *p)
{
	h->pw = idx_set_lo(h->pw, p);
}

static inline void idx_hold_set_next(struct idx_hold *h, const struct idx_hold *n)
{
	h->nw = idx_set_lo(h->nw, n);
}

static inline uint32_t idx_hold_top(const struct idx_hold *h)
{
	return (uint32_t)(idx_hi(h->pw) >> 4);
}

static inline void idx_hold_set_top(struct idx_hold *h, uint32_t top)
{
	h->pw = idx_set_hi(h->pw, (idx_hi(h->pw) & 15) | (uint64_t)top << 4);
}

static inline uint32_t idx_hold_cut(const struct idx_hold *h)
{
	return (uint32_t)(idx_hi(h->nw) & 0xfff);
}

static inline void idx_hold_set_cut(struct idx_hold *h, uint32_t cut)
{
	h->nw = idx_set_hi(h->nw, (idx_hi(h->nw) & ~0xfffull) | cut);
}

static inline uint32_t idx_hold_nwords(const struct idx_hold *h)
{
	return 1u << ((idx_hi(h->nw) >> 12) & 7);
}

/* Sets the bitmap's size, a power of two of words. */
static inline void idx_hold_set_nwords(struct idx_hold *h, uint32_t nwords)
{
	h->nw = idx_set_hi(h->nw, (idx_hi(h->nw) & ~(7ull << 12)) | (uint64_t)__builtin_ctz(nwords)
	                                                                << 12);
}

static inline uint64_t *idx_hold_bm(struct idx_hold *h)
{
	return idx_hold_nwords(h) == 1 ? &h->bm0 : h->bm;
}

/* Per-rank map key -> val (core/index_xmap.c: ext -> place for the blocks stored with ext != seq,
 * alias bits, copy counts): Robin Hood linear probing, backward-shift deletion; an entry is
 * empty iff key == val.  Writers only (under wlock). */
struct idx_xent {
	uint64_t key;
	uint64_t val;
};

struct idx_xmap {
	struct idx_xent *e;
	uint64_t cap; /* entries (any number: fastrange home), or 0 with e NULL */
	uint64_t count;
};

/* Objects retired by writers; freed together after one grace period. */
struct idx_retire {
	struct idx_run *runs;
	uint64_t *seqs; /* hash arrays, linked through their header words */
	struct idx_hset *sets;
	struct idx_tret *tabs;
	uint32_t n; /* objects on the lists */
};

/*
 * Run table (readers): every live run, keyed by the sequence hash of its FIRST block, which is
 * how readers find a child.  An entry is one word: 16 tag bits of the seq << 48 | run pointer
 * (8-byte aligned, below 2^48).  0 = empty, IDX_TOMB = deleted.  The key is run->first.
 */
#define IDX_TOMB     1ull
#define IDX_PTR_MASK ((1ull << 48) - 1)

static inline uint64_t idx_tag(uint64_t seq)
{
	return (seq >> 16) & 0xffff;
}

static inline struct idx_run *idx_ent_run(uint64_t e)
{
	return (struct idx_run *)(uintptr_t)(e & IDX_PTR_MASK);
}

/*
 * Block locator (writers only, under wlock; core/index_blocks.c): every position [1, hw) of
 * every live LOCATED run (idx_run_located), keyed by its sequence hash (position 0: the run table).
 * An entry is 32 bits: run id << 7 | 7 tag bits; 0 = empty.  Entries sit in chunks of IDX_BLK_CH
 * (one 64-byte line), and one overflow byte per chunk follows the entries.  The position is not
 * stored: the writer finds it in the run's hashes (hints first, then a scan of at most IDX_RUN_MAX
 * words).  dir[id] is the run.
 */
#define IDX_ID_BITS 25
#define IDX_BLK_CH  16u

/* The home slot of seq in a locator of cap slots (fastrange of the keyed hash's high half,
 * core/place.h); also the
 * home chunk with cap = the number of chunks (the same chunk as the home slot's). */
static inline uint64_t idx_blk_home_k(uint64_t seq, uint64_t cap, uint64_t key)
{
	return ((kvr_place_k(seq, key) >> 32) * cap) >> 32;
}

static inline uint64_t idx_blk_home(uint64_t seq, uint64_t cap)
{
	return idx_blk_home_k(seq, cap, kvr_place_key());
}

/* Bytes of a locator array of cap slots: the entries, then one overflow byte per chunk. */
static inline uint64_t idx_blk_bytes(uint64_t cap)
{
	return cap * sizeof(uint32_t) + cap / IDX_BLK_CH;
}

struct idx_blocks {
	uint32_t *e; /* the entries (while migrating: the new array) */
	uint64_t cap, count;
	/* While a resize migrates (old_e != NULL): the runs with ids [mig, mig_end) still have
	 * their entries in old_e (old_count of them, exact); every other id's are in e.  old_used:
	 * old_e's occupied slots (old_count and the stale entries of the runs moved out). */
	uint32_t *old_e;
	uint64_t old_cap, old_count, old_used;
	uint64_t zeroed;    /* slots of e zeroed: while fewer than cap, e is not in use yet */
	uint64_t mig_step;  /* work units (ids + positions) moved per locator call */
	int64_t mig_credit; /* units paid for and not spent yet (< 0: spent ahead) */
	uint32_t mig, mig_end;
	uint64_t rebuilds;           /* migrations started (growth and shrink; never a purge) */
	uint64_t finds, false_cands; /* lookups, and wrong runs they scanned (tag matches) */
	struct idx_run **dir;        /* id -> run; a free id holds (next free id << 1 | 1) */
	uint32_t dir_cap;            /* ids 1..dir_cap-1 exist (0 is never used) */
	uint32_t dir_free;           /* first free id, 0 = none */
	uint32_t live;               /* ids in use */
	/* The most ids the directory hands out (0: 2^IDX_ID_BITS - 1, the entry's field).  Only
	 * tests lower it, to reach the full id space without 2^25 runs (~4 GB). */
	uint32_t id_limit;
};

/*
 * A run-table segment's array: uint64_t e[cap], the entries and nothing else, so that it is
 * exactly an allocator size class (128, 192, 256, 384, 512, 768, ... bytes; with a 16-byte
 * header {cap, retire link} in front, 16 entries took 192 bytes, 64 took 640 and 512 took
 * 5,120).  Capacities step by 1.5x and 2x alternately (16, 24, 32, 48, ...; grown at load 0.8
 * to the next size with load <= 0.6), so the load stays in 0.53-0.8 (it was 0.4-0.8 with
 * powers of two).  The home slot is fastrange of the high half of seq times an odd constant
 * (every bit of seq counts: a root run's first hash is the caller's local hash, small integers
 * in tests, and fastrange of raw bits would pile those on one slot).  Readers find the
 * capacity in the low 6 bits of the segment's view word: code = h << 5 | s for cap = (2 | h)
 * << s; writers keep it in the segment.  A replaced array is retired through a record of its
 * own (struct idx_tret, 16 bytes, allocated with the array so that giving an array back never
 * needs memory): readers may still probe every entry of it.
 */

static inline uint64_t idx_tab_cap(uintptr_t code)
{
	return (uint64_t)(2 | (code >> 5)) << (code & 31);
}

static inline uintptr_t idx_tab_code(uint64_t cap)
{
	const unsigned z = (unsigned)__builtin_ctzll(cap);
	return (cap >> z) == 1 ? (uintptr_t)(z - 1) : (uintptr_t)1 << 5 | z;
}

static inline uint64_t idx_tab_home(uint64_t seq, uint64_t cap)
{
	return (kvr_place(seq) >> 32) * cap >> 32;
}

/* One of IDX_SEGS open-addressing tables; the segment is seq's top bits.  Writers use tab (under
 * wlock); readers use kvr_index.view[], kept apart from the writers' counters. */
struct idx_seg {
	uint64_t *tab;       /* the entries (NULL: none) */
	uint64_t cap;        /* their number */
	struct idx_tret *tr; /* tab's retire record (with tab) */
	uint32_t count;      /* runs */
	uint32_t tombs;
};

/* A segment array's retire record: the array | idx_tab_code(its capacity) (64-aligned, as in
 * the view word), and the retire-list link once retired. */
struct idx_tret {
	struct idx_tret *next;
	uintptr_t ec;
};

enum { SLOT_FREE = 0, SLOT_ACTIVE = 1, SLOT_RETIRING = 2 };

/*
 * A rank's end map (writers only; core/index_tops.c), kept when the index has no block locator
 * (kvr_index_set_locator): the rank's (run) records by the sequence hash of their deepest held
 * position (top - 1, when top >= 2: a record whose top is 1 is found through the run table) and,
 * for a record that holds nothing at position 0 (cut 0), of its lowest held position when that
 * is below top - 1.  Open addressing, linear probing, backward-shift deletion (an entry's key is
 * recomputed from its record); an entry is one word: 16 tag bits << 48 | the record | 1 for a
 * lowest-position entry.  An accelerator only: a lookup it misses falls back to a scan of the
 * rank's records (exact), so an insert that finds no room (a removal never allocates) is
 * skipped, never wrong; an entry never outlives its record's key.
 */
struct idx_tmap {
	uint64_t *e; /* NULL: none */
	uint32_t cap;
	uint32_t count;
};

struct idx_rank {
	uint64_t worker_id; /* atomic relaxed: read by lock-free rank_find */
	uint32_t dp_rank;
	uint32_t state;
	struct idx_hold *holds; /* the rank's (run) records */
	struct idx_xmap xmap;   /* ext -> place (idx_ext_place) for blocks stored with ext != seq */
	struct idx_xmap amap;   /* alias bits: (record << 5 | bitmap word) -> key ^ the word's
	                         * positions held under an ext hash != seq (xmap's blocks); only
	                         * while the rank mixes aliased and plain blocks (e NULL: pure) */
	struct idx_xmap cmap;   /* count_copies: (record << 16 | position) -> copies beyond the
	                         * first, for the positions that have some */
	struct idx_tmap tops;   /* no locator: records by their end positions' hashes */
	uint64_t size;          /* distinct blocks held, exact (writers; relaxed atomic:
	                         * kvr_index_tree_size); readers get kvr_index.tsize */
	uint32_t next_free;     /* free-slot list link */
} __attribute__((aligned(IDX_CACHELINE)));

/* Lookup (worker, dp) -> slot: open addressing of slot+1 (0 empty, UINT32_MAX deleted). */
struct idx_rtab {
	uint32_t mask;
	uint32_t tombs;
	uint32_t used;
	uint32_t pad;
	uint32_t e[];
};

struct kvr_index {
	/* Readers' view of the segments: (table | log2(capacity)), 0 = empty; RCU-published. */
	uintptr_t view[IDX_SEGS] __attribute__((aligned(IDX_CACHELINE)));
	struct idx_seg seg[IDX_SEGS];
	/* What readers read besides the view, on a line of its own: the writer's mutex and
	 * counters below change on every write, and sharing a line with them made every query
	 * after a write miss on it (bench_index_runs --rw-only). */
	uint32_t max_ranks __attribute__((aligned(IDX_CACHELINE)));
	uint64_t *tsize; /* per slot: distinct blocks held as last published (atomic relaxed;
	                  * idx_size_add says when), dense so that find_matches reads 8 ranks'
	                  * sizes per cache line */
	/* every writer call (stored, removed, cleared, ranks) */
	pthread_mutex_t wlock __attribute__((aligned(IDX_CACHELINE)));
	bool count_copies;
	bool no_locator; /* kvr_index_set_locator(false): writers find blocks through the ranks'
	                  * end maps, the run table and walks, not the block locator */
	struct idx_rank *rank;
	struct idx_rtab *rtab; /* RCU-published */
	uint32_t rank_lock;    /* spinlock: free-slot list and rtab */
	uint32_t free_head;    /* released slots, UINT32_MAX = none */
	/* Slots at or above this were never used: free, and their records never touched, so the
	 * rank array sized for max_ranks costs no resident memory beyond the ranks added (atomic
	 * relaxed: kvr_index_clear_worker reads it without rank_lock). */
	uint32_t fresh;
	uint64_t active_ranks;
	struct idx_retire rt;  /* retired under wlock, not yet handed to call_rcu: at a full
	                        * batch (idx_flush_if_due), or when the writers go idle
	                        * (kvr_index_flush_retired) */
	struct idx_blocks blk; /* the writers' block locator */
	/* Where the last successful store or removal ended (NULL: unknown; cleared when that run
	 * dies): the next store's parent is most often that block (a chain stored event by event,
	 * a turn's reply below its prompt) and the next removal's first block next to it (a tail
	 * evicted back to front), found there without a locator probe. */
	struct idx_run *last_run;
	uint32_t last_pos;
	uint64_t *scratch;  /* store's sequence hashes and rollback list (wlock; IDX_SCRATCH_MIN
	                     * words from create on, so short stores leave memory_bytes as it was) */
	size_t scratch_cap; /* its words (atomic relaxed: kvr_index_memory_bytes reads it) */
	/* counters (atomic relaxed) */
	uint64_t c_parent_nf, c_block_nf, c_invalid, c_stored, c_removed, c_nodes, c_copies;
	uint64_t c_rank_scans; /* no locator: lookups that scanned a rank's records */
	uint64_t bytes_shared, bytes_rank;
	uint64_t pending; /* queued call_rcu callbacks (atomic) */
};

/* What the memory counters count for an allocation of size bytes: the allocator's real size
 * (its size class; core/alloc.h), so bytes per held block are what the process pays. */
static inline int64_t idx_real(uint64_t size)
{
	return (int64_t)kvr_alloc_real_size((size_t)size);
}

static inline uint64_t idx_bytes_tab(uint64_t cap)
{
	return cap * sizeof(uint64_t);
}

static inline uint64_t idx_bytes_seqs(uint32_t cap)
{
	return (uint64_t)cap * sizeof(uint64_t);
}

/* The capacity to allocate for at least want (> 1) positions: the allocator's size class of
 * want words, so the array fills its allocation exactly (growth steps land on classes: 2, 4,
 * 6, 8, 10, 12, 14, 16, 20, 24, ... words with jemalloc; want itself without it). */
static inline uint32_t idx_seqs_cap(uint64_t want)
{
	if (want >= IDX_RUN_MAX)
		return IDX_RUN_MAX;
	const uint64_t c = (uint64_t)idx_real(idx_bytes_seqs((uint32_t)want)) / sizeof(uint64_t);
	return c < want ? (uint32_t)want : c > IDX_RUN_MAX ? IDX_RUN_MAX : (uint32_t)c;
}

/*
 * Finds the run whose FIRST block has sequence hash seq and that hangs at (parent, off).
 * Context: inside a read section (readers), or a writer under wlock.
 * Ordering: acquire load of the view and of each entry; pairs with the release stores in
 * seg_rebuild() and kvr_index_tab_insert(): a reader that sees an entry sees the run's fields.
 */
static inline const struct idx_run *idx_find_run(const struct kvr_index *idx, uint64_t seq,
                                                 const struct idx_run *parent, uint32_t off)
{
	uintptr_t v = __atomic_load_n(&idx->view[seq >> (64 - IDX_SEGS_BITS)], __ATOMIC_ACQUIRE);
	if (!v)
		return NULL;
	const uint64_t *t = (const uint64_t *)(v & ~(uintptr_t)63);
	const uint64_t cap = idx_tab_cap(v & 63);
	uint64_t want = idx_tag(seq);
	for (uint64_t i = idx_tab_home(seq, cap);; i = i + 1 == cap ? 0 : i + 1) {
		uint64_t e = __atomic_load_n(&t[i], __ATOMIC_ACQUIRE);
		if (!e)
			return NULL;
		if ((e >> 48) != want || e == IDX_TOMB)
			continue;
		const struct idx_run *r = idx_ent_run(e);
		if (r->first == seq && r->po == idx_po(parent, off))
			return r;
	}
}

/*
 * The child of parent at off whose first block is seq: the parent's most recently linked child
 * when it is that one (a session's path: each turn hangs one child on the previous turn's run,
 * so the walk reaches it through the parent's header, already loaded, instead of a table
 * entry), else the table's answer (idx_find_run).  A reader may load a child that was unlinked
 * meanwhile (freed only after a grace period, like a table entry it raced with), or a dead
 * parent's retire link (another run retired in the same batch): first and po are compared.
 * Context: inside a read section.  Ordering: acquire load of the child list; pairs with the
 * release in idx_run_set_child().
 */
static inline const struct idx_run *idx_find_child(const struct kvr_index *idx, uint64_t seq,
                                                   const struct idx_run *parent, uint32_t off)
{
	const struct idx_run *c = (const struct idx_run *)(uintptr_t)idx_lo_ptr(
	    __atomic_load_n(&parent->ch, __ATOMIC_ACQUIRE));
	if (c && c->first == seq && c->po == idx_po(parent, off))
		return c;
	return idx_find_run(idx, seq, parent, off);
}

/* Run table, writer side (under wlock). */
/* Makes room for one more run in seq's segment.  Returns 0 or KVR_ENOMEM (nothing changed). */
int kvr_index_tab_reserve(struct kvr_index *idx, uint64_t seq);
/* Gives back seq's segment array if it holds nothing (after a reserve whose insert failed). */
void kvr_index_tab_unreserve(struct kvr_index *idx, uint64_t seq);
/* The live run whose first block is seq, or NULL. */
struct idx_run *kvr_index_tab_first(const struct kvr_index *idx, uint64_t seq);
/* Inserts r (keyed by r->first); room must have been reserved. */
void kvr_index_tab_insert(struct kvr_index *idx, struct idx_run *r);
/* Deletes r's entry (never fails; may shrink the segment when memory allows). */
void kvr_index_tab_delete(struct kvr_index *idx, const struct idx_run *r);

/* ---- block locator (core/index_blocks.c).  Context: writer (wlock). */
/* Where block seq sits (a position in [1, hw) of a live run, or a run's first block, through the
 * run table): *r, *pos, or false.  (hr, hp): a position near which seq probably sits (hr NULL:
 * no hint). */
bool kvr_index_blk_find(const struct kvr_index *idx, uint64_t seq, const struct idx_run *hr,
                        uint32_t hp, struct idx_run **r, uint32_t *pos);
/* (r, pos): where a lookup found seq, a place the slot does not hold.  Whether the slot holds
 * seq at the other place it may sit (a crafted root block's first hash equal to an interior
 * block's): then *r, *pos and its record *h. */
bool kvr_index_blk_other_held(const struct kvr_index *idx, uint64_t seq, uint32_t slot,
                              struct idx_run **r, uint32_t *pos, struct idx_hold **h);
/* Before r (not located) becomes located: whether one of its positions [1, hw) is an interior
 * position of a located run too (only crafted input puts a hash at two such places: a root on
 * a hash r has inside, and a chain copied below it; core/index_blocks.c). */
bool kvr_index_blk_clash(const struct kvr_index *idx, const struct idx_run *r);
/* Makes room for k more entries.  Returns 0 or KVR_ENOMEM (nothing changed). */
int kvr_index_blk_reserve(struct kvr_index *idx, uint64_t k);
/* Frees the entry array if it holds nothing (after a reserve whose insert failed). */
void kvr_index_blk_unreserve(struct kvr_index *idx);
/* Inserts seq -> r (room reserved). */
void kvr_index_blk_insert(struct kvr_index *idx, uint64_t seq, const struct idx_run *r);
/* Inserts seq[0..k) -> r (room reserved, r has an id): kvr_index_blk_insert k times, the home
 * chunks prefetched ahead. */
void kvr_index_blk_insert_many(struct kvr_index *idx, const uint64_t *seq, size_t k,
                               const struct idx_run *r);
/* Room for up to k inserts without a growth (no allocation, never fails): pays k reserves'
 * share of a migration in progress and returns how many of the k its limits (those of
 * kvr_index_blk_reserve) admit; 0 when the locator is empty or full up to its growth threshold
 * (kvr_index_blk_reserve then grows it). */
uint64_t kvr_index_blk_reserve_upto(struct kvr_index *idx, uint64_t k);
/* Deletes the entries of r's positions [1, hw) and frees its id (never fails; may shrink the
 * locator when memory allows). */
void kvr_index_blk_drop_run(struct kvr_index *idx, struct idx_run *r);
/* Gives r (whose hashes have their own array) an id.  Returns 0, KVR_ENOMEM, or KVR_ERANGE when
 * every id is in use (blk.id_limit). */
int kvr_index_blk_id_new(struct kvr_index *idx, struct idx_run *r);
/* Frees r's id (its entries deleted first). */
void kvr_index_blk_id_free(struct kvr_index *idx, struct idx_run *r);
/* Frees the locator.  Context: destroy. */
void kvr_index_blk_fini(struct kvr_index *idx);
/* Work units (ids visited + entries moved) each locator call spends on a migration on top of
 * the least that keeps up (default 16; tests set 0 to make locators migrate over more calls).
 * Context: set before any index exists. */
extern uint64_t kvr_index_blk_step_min;
/* The load (per mille, default 900) past which the locator grows, starting a
 * migration: lower costs memory and leaves a migration more inserts to finish in before the
 * old array's hard limit (grow_at + 0.05, at most 0.97), so smaller slices per call.  Context: set
 * before any index exists (bench_index_runs --churn compares). */
extern uint64_t kvr_index_blk_grow_at;
/* The load (per mille, default 780; below grow_at) a growth sizes the new array for. */
extern uint64_t kvr_index_blk_grow_to;

/* ---- per-rank maps (core/index_xmap.c).  Context: writer (wlock). */
/* The load (per cent, default 65) a map's growth (past 0.9) sizes the new array for.  Context:
 * set before any index exists (bench_index_runs --xgrow compares). */
extern uint64_t kvr_index_xmap_grow_to;
static inline uint64_t idx_xhome(const struct idx_xmap *m, uint64_t key)
{
	return (kvr_place(key) >> 32) * m->cap >> 32;
}

/* How far slot i is from key's home (probing wraps around). */
static inline uint64_t idx_xdist(const struct idx_xmap *m, uint64_t key, uint64_t i)
{
	const uint64_t h = idx_xhome(m, key);
	return i >= h ? i - h : i + m->cap - h;
}

/* An entry is in use iff key != val (xmap stores key ^ place, a place never 0; amap stores
 * key ^ bits with bits != 0; cmap's counts are small, its keys addresses). */
static inline bool idx_xused(const struct idx_xent *e)
{
	return e->key != e->val;
}

/* The entry of key, or NULL.  Robin Hood: the probe stops at an entry nearer its home than key
 * would be there. */
static inline struct idx_xent *idx_xmap_ref(const struct idx_xmap *m, uint64_t key)
{
	if (!m->count)
		return NULL;
	uint64_t i = idx_xhome(m, key);
	for (uint64_t d = 0;; d++) {
		struct idx_xent *e = &m->e[i];
		if (!idx_xused(e))
			return NULL;
		if (e->key == key)
			return e;
		if (idx_xdist(m, e->key, i) < d)
			return NULL;
		i = i + 1 == m->cap ? 0 : i + 1;
	}
}

/* The value of key, or false.  Context: writer (wlock). */
static inline bool idx_xmap_get(const struct idx_xmap *m, uint64_t key, uint64_t *val)
{
	const struct idx_xent *e = idx_xmap_ref(m, key);
	if (e && val)
		*val = e->val;
	return e != NULL;
}

/* Inserts key -> val (key absent); room must have been reserved. */
void kvr_index_xmap_put(struct idx_xmap *m, uint64_t key, uint64_t val);
/* Makes room for one more entry at load <= 0.9.  Returns 0 or KVR_ENOMEM (unchanged). */
int kvr_index_xmap_reserve(struct kvr_index *idx, struct idx_xmap *m);
/* Removes key if present (never fails). */
void kvr_index_xmap_del(struct idx_xmap *m, uint64_t key);
/* Frees an empty map, or shrinks a sparse one when memory allows. */
void kvr_index_xmap_shrink(struct kvr_index *idx, struct idx_xmap *m);
/* Frees the map's array without counting it (destroy). */
void kvr_index_xmap_free(struct idx_xmap *m);

/* Alias bits: the rank holds position pos of h's run under an ext hash that is not its sequence
 * hash (the block is in xmap).  Set only on held positions, cleared when the position leaves the
 * rank, so an entry never outlives its record (kvr_index_alias_move when it moves). */
static inline uint64_t idx_alias_key(const struct idx_hold *h, uint32_t pos)
{
	return (uint64_t)(uintptr_t)h << 5 | pos / 64; /* < 2^53: addresses are below 2^48 */
}

/* Of the positions h's bitmap word wi holds, those held under an alias (the caller masks with
 * the bitmap).  A rank without alias bits (amap.e NULL) is pure: every block it holds is
 * aliased when xmap has entries, none when it has none (kvr_index_alias_reserve keeps that). */
static inline uint64_t idx_alias_word(const struct idx_rank *rk, const struct idx_hold *h,
                                      uint32_t wi)
{
	if (!rk->amap.e)
		return rk->xmap.count ? ~0ull : 0;
	const struct idx_xent *e = idx_xmap_ref(&rk->amap, idx_alias_key(h, wi * 64));
	return e ? e->key ^ e->val : 0;
}

/* Whether the rank holds position pos of h's run (held) under an alias. */
static inline bool idx_alias_bit(const struct idx_rank *rk, const struct idx_hold *h, uint32_t pos)
{
	return (idx_alias_word(rk, h, pos / 64) >> (pos % 64)) & 1;
}

/* Before a block is committed to a rank that holds size blocks (alias: under an ext hash !=
 * its sequence hash): the alias bits it needs.  A pure rank that stays pure needs none; one
 * that becomes mixed gets them (all aliased until now: a bit for every held position).
 * Returns 0 or KVR_ENOMEM (the answers of idx_alias_bit unchanged either way). */
int kvr_index_alias_reserve(struct kvr_index *idx, struct idx_rank *rk, bool alias, uint64_t size);
/* After a failed write was taken back: a rank that is pure again drops its alias bits (the
 * memory it had before the call). */
void kvr_index_alias_settle(struct kvr_index *idx, struct idx_rank *rk);
/* Sets pos's alias bit (clear; kvr_index_alias_reserve done). */
void kvr_index_alias_set(struct idx_rank *rk, const struct idx_hold *h, uint32_t pos);
/* Clears pos's alias bit if set (never fails). */
void kvr_index_alias_clear(struct idx_rank *rk, const struct idx_hold *h, uint32_t pos);
/* Moves the alias bits of from's nwords bitmap words to to (never fails). */
void kvr_index_alias_move(struct idx_rank *rk, const struct idx_hold *from,
                          const struct idx_hold *to, uint32_t nwords);

/* ---- holder records and sets (core/index_hold.c).  Context: writer (wlock). */
static inline bool idx_hold_bit(const struct idx_hold *h, uint32_t pos)
{
	const uint32_t nw = idx_hold_nwords(h);
	if (pos / 64 >= nw)
		return false;
	return ((nw == 1 ? h->bm0 : h->bm[pos / 64]) >> (pos % 64)) & 1;
}

static inline uint32_t idx_hslot(uint64_t w)
{
	return (uint32_t)(w >> 32);
}

/* A new empty record of (run, slot) whose bitmap covers pos, or NULL (no memory). */
struct idx_hold *kvr_index_hold_new(struct kvr_index *idx, struct idx_run *run, uint32_t slot,
                                    uint32_t pos);
/* Frees a record (unlinked from its run and rank, or never linked). */
void kvr_index_hold_free(struct kvr_index *idx, struct idx_hold *h);
/* Makes the bitmap cover pos.  Returns 0 or KVR_ENOMEM (unchanged).  The check is inline, the
 * reallocation (rare: bitmaps double) out of line, so the common call saves no registers. */
int kvr_index_hold_reserve_slow(struct kvr_index *idx, struct idx_hold *h, uint32_t pos);
static inline int kvr_index_hold_reserve(struct kvr_index *idx, struct idx_hold *h, uint32_t pos)
{
	if (pos / 64 < idx_hold_nwords(h))
		return 0;
	return kvr_index_hold_reserve_slow(idx, h, pos);
}
/* Sets pos (covered by the bitmap); advances the gap-free cut over what follows. */
void kvr_index_hold_set(struct idx_hold *h, uint32_t pos);
/* Sets positions [pos, pos + k), all clear and covered by the bitmap: the state k
 * kvr_index_hold_set calls in order leave, one cut scan. */
void kvr_index_hold_set_range(struct idx_hold *h, uint32_t pos, uint32_t k);
/* Clears pos; lowers the cut and the top as needed. */
void kvr_index_hold_clear(struct idx_hold *h, uint32_t pos);
/* Clears positions [pos, pos + k), all set: the state k kvr_index_hold_clear calls in order
 * leave. */
void kvr_index_hold_clear_range(struct idx_hold *h, uint32_t pos, uint32_t k);
/* count_copies: room for one more extra copy of pos (0 or KVR_ENOMEM), one more, one fewer
 * (false when pos has no extra copy). */
int kvr_index_copy_reserve(struct kvr_index *idx, struct idx_hold *h, uint32_t pos);
void kvr_index_copy_inc(struct kvr_index *idx, struct idx_hold *h, uint32_t pos);
bool kvr_index_copy_dec(struct kvr_index *idx, struct idx_hold *h, uint32_t pos);
/* The slot's record of r, or NULL. */
struct idx_hold *kvr_index_hold_of(const struct idx_run *r, uint32_t slot);
/* Mirrors h->cut into its run's holder words (relaxed stores). */
void kvr_index_publish_cut(struct idx_hold *h);
/* Publishes r's holder set plus h (cut 0).  Returns 0 or KVR_ENOMEM (unchanged). */
int kvr_index_hs_add(struct kvr_index *idx, struct idx_run *r, struct idx_hold *h);
/* Removes slot from r's holder set; never fails.  Returns the one holder left when its record
 * is not the embedded one (nothing changed then: see kvr_index_hold_embed), else NULL. */
struct idx_hold *kvr_index_hs_del(struct kvr_index *idx, struct idx_run *r, uint32_t slot);
/* Moves y (what kvr_index_hs_del returned) into r's embedded record, freed by then. */
void kvr_index_hold_embed(struct kvr_index *idx, struct idx_run *r, struct idx_hold *y);

/* ---- runs (core/index_run.c).  Context: writer (wlock). */
/* A new unpublished run below (parent, off) with room for cap blocks, or NULL. */
struct idx_run *kvr_index_run_new(struct kvr_index *idx, struct idx_run *parent, uint32_t off,
                                  uint32_t cap, uint64_t first);
/* Frees a run never published, or one nobody can read any more. */
void kvr_index_run_free(struct kvr_index *idx, struct idx_run *r);
/* Room for one more position, sized for `more` coming.  Returns 0 or KVR_ENOMEM.  Inline check,
 * out-of-line reallocation (geometric: rare). */
int kvr_index_run_grow_slow(struct kvr_index *idx, struct idx_run *r, size_t more);
static inline int kvr_index_run_grow(struct kvr_index *idx, struct idx_run *r, size_t more)
{
	if (idx_run_hw(r) < idx_run_cap(r))
		return 0;
	return kvr_index_run_grow_slow(idx, r, more);
}
/* Links c into p's child list (p NULL: the root, nothing to link). */
void kvr_index_link_child(struct idx_run *p, struct idx_run *c);
/* Links a new record into its rank's list. */
void kvr_index_rank_link_hold(struct kvr_index *idx, struct idx_hold *h);
/* Takes a record out of its rank's list. */
void kvr_index_rank_unlink_hold(struct kvr_index *idx, struct idx_hold *h);
/* Removes an empty record from its run and its rank and frees it. */
void kvr_index_drop_hold(struct kvr_index *idx, struct idx_hold *h);
/* Trims r to what its holders and children need; kills it (and re-checks its parent) when
 * that is nothing.  Never fails. */
void kvr_index_run_check(struct kvr_index *idx, struct idx_run *r);

#define IDX_RETIRE_BATCH                                                                           \
	256 /* objects gathered per call_rcu (fewer grace periods, so fewer membarrier IPIs on     \
	     * the readers' CPUs) */
/* Hands the batch to call_rcu.  Context: writer, outside any read section. */
void kvr_index_retire_flush(struct kvr_index *idx, struct idx_retire *rt);
/* Slot of an active rank, or NULL.  Context: writer (wlock). */
struct idx_rank *kvr_index_rank_get_active(struct kvr_index *idx, uint32_t slot);

/* How a write of n blocks to slot begins (kvr_index_store and its variants, the removes): the
 * rank active, something to do, then the caller registered with RCU (retired memory goes
 * through call_rcu, which needs a registered caller: without one, pthread keys exhausted,
 * nothing is written) and the writers' lock taken.  Returns 1 with idx->wlock held and *rk the
 * rank; else nothing done and no lock: 0 for n == 0, KVR_ENOENT (no such active rank),
 * KVR_ENOMEM (not registered).
 * Context: a writer (shard thread or owner); not inside idx->wlock. */
static inline int idx_write_begin(struct kvr_index *idx, uint32_t slot, size_t n,
                                  struct idx_rank **rk)
{
	*rk = kvr_index_rank_get_active(idx, slot);
	if (!*rk)
		return KVR_ENOENT;
	if (n == 0)
		return 0;
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	pthread_mutex_lock(&idx->wlock);
	return 1;
}
/* Drops every block of the slot.  Context: writer holding wlock.  Returns blocks dropped. */
uint64_t kvr_index_clear_locked(struct kvr_index *idx, uint32_t slot);
/* Frees a run's writer-only records (holds, bitmaps) and the run itself, with no deferral.
 * Context: destroy. */
void kvr_index_free_run_now(struct kvr_index *idx, struct idx_run *r);

/* ---- shared by the writers (core/index_write.c, core/index_remove.c).  Context: wlock. */
static inline void idx_flush_if_due(struct kvr_index *idx)
{
	if (idx->rt.n >= IDX_RETIRE_BATCH || idx->rt.tabs)
		kvr_index_retire_flush(idx, &idx->rt);
}

/* An ext map's value: the PLACE (run, position) of the block the key names, stored as key ^
 * place (a place is never 0, so an entry stays empty iff key == val).  The place, not the
 * sequence hash: a rank's alias is resolved without the block locator, so a run only ever held
 * under aliases needs no locator entries (idx_run_located).  A place stays valid while the rank
 * holds the block (a run lives while a rank holds a position of it; run headers never move). */
static inline uint64_t idx_place(const struct idx_run *r, uint32_t pos)
{
	return (uint64_t)(uintptr_t)r | (uint64_t)pos << IDX_HI_SHIFT;
}

/* Where the rank holds the block it names by the alias ext: *r, *pos and true, else false (the
 * caller then looks ext up as a sequence hash, and refuses a block the rank holds under an
 * alias, idx_alias_bit: a block held under another name is not named by its sequence hash). */
static inline bool idx_ext_place(const struct idx_rank *rk, uint64_t ext, struct idx_run **r,
                                 uint32_t *pos)
{
	if (!rk->xmap.count)
		return false;
	const struct idx_xent *e = idx_xmap_ref(&rk->xmap, ext);
	if (!e)
		return false;
	const uint64_t pl = e->key ^ e->val;
	*r = (struct idx_run *)(uintptr_t)idx_lo_ptr(pl);
	*pos = (uint32_t)idx_hi(pl);
	return true;
}

/* Records the alias ext -> (r, pos) (room reserved, ext absent). */
static inline void idx_ext_put(struct idx_rank *rk, uint64_t ext, const struct idx_run *r,
                               uint32_t pos)
{
	kvr_index_xmap_put(&rk->xmap, ext, ext ^ idx_place(r, pos));
}

/* Whether a lookup by sequence hash may answer with r: with the locator, only located runs
 * hold blocks a rank holds under their sequence hash (a hint at an unlocated run is skipped,
 * as the locator skips the run). */
static inline bool idx_seq_visible(const struct kvr_index *idx, const struct idx_run *r)
{
	return idx->no_locator || idx_run_located(r);
}

/* With the locator: where block seq sits in the tree (a position below hw): *r, *pos, or false.
 * (hr, hp): the block touched last, near which seq probably is (hr NULL: none). */
static inline bool idx_locate(const struct kvr_index *idx, uint64_t seq, const struct idx_run *hr,
                              uint32_t hp, struct idx_run **r, uint32_t *pos)
{
	return kvr_index_blk_find(idx, seq, hr, hp, r, pos); /* the run table's first blocks too */
}

/* With the locator: where block seq sits, for a removal's first block: next to where the last
 * write ended (a tail evicted a block or a few at a time, back to front, has it just below), else
 * idx_locate's answer. */
static inline bool idx_near_last(const struct kvr_index *idx, uint64_t seq, struct idx_run **r,
                                 uint32_t *pos)
{
	const struct idx_run *lr = idx->last_run; /* alive: cleared when it dies */
	if (lr && idx_run_located(lr)) {
		const uint32_t lp = idx->last_pos, hw = idx_run_hw(lr);
		for (uint32_t d = 0; d < 3; d++) { /* lp - 1, lp + 1, lp */
			const uint32_t q = d == 0 ? lp - 1 : d == 1 ? lp + 1 : lp;
			if ((d != 0 || lp > 0) && q < hw && idx_run_hash(lr, q) == seq) {
				*r = (struct idx_run *)(uintptr_t)lr;
				*pos = q;
				return true;
			}
		}
	}
	return idx_locate(idx, seq, NULL, 0, r, pos);
}

/* Removes ext[0..n) from the slot (one copy each with count_copies), ext[] split into runs of
 * run_len[0..n_runs) blocks (NULL: one run; a hint of where each chain ends, used without the
 * locator).  Adds to *removed the copies removed and to *dropped the blocks that left the rank;
 * returns the hashes not found.  Never fails, never allocates. */
size_t kvr_index_remove_locked(struct kvr_index *idx, struct idx_rank *rk, uint32_t slot,
                               const uint64_t *ext, size_t n, const uint32_t *run_len,
                               size_t n_runs, size_t *removed, size_t *dropped);

/*
 * The readers' tree sizes are published in steps, not at every call: find_matches reads the
 * size of every rank it places (a tie-break), 8 to a line, so each publish makes the next query
 * of any path those ranks hold miss on that line (~120 ns from the writer's core on the 2-core
 * VM, about a query's p99): with one writer removing and re-storing 16-block tails flat out,
 * that was half a missed line per query (valgrind lackey, bench_index_runs' --rw-only writer).
 * So the published size moves only when it is more than 1/IDX_TSIZE_SLACK of the exact one
 * (idx_rank.size, writers') away from it: exact below IDX_TSIZE_SLACK blocks and at 0, within
 * 1/64 (1.6 %) above, and exact again after kvr_index_quiesce.
 */
#define IDX_TSIZE_SLACK 64u

/* Words of the writers' store scratch made at create (a store of n blocks needs 2n). */
#define IDX_SCRATCH_MIN 256u

/* The slot's exact size becomes size; published when it is off by more than the slack.
 * Context: writer (wlock).  Ordering: relaxed (counts, no content behind them). */
static inline void idx_size_set(struct kvr_index *idx, struct idx_rank *rk, uint32_t slot,
                                uint64_t size)
{
	__atomic_store_n(&rk->size, size, __ATOMIC_RELAXED);
	const uint64_t pub = idx->tsize[slot], off = size > pub ? size - pub : pub - size;
	if (off > size / IDX_TSIZE_SLACK)
		__atomic_store_n(&idx->tsize[slot], size, __ATOMIC_RELAXED);
}

static inline void idx_count(uint64_t *c, int64_t d)
{
	__atomic_add_fetch(c, (uint64_t)d, __ATOMIC_RELAXED);
}

#endif /* KVR_CORE_INDEX_INTERNAL_H */
