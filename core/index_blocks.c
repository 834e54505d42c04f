/*
 * core/index_blocks.c - the run index's block locator: any block's (run, position) by its hash.
 *
 * Why it exists.  Readers never need it: they walk from the root and find each child by the
 * sequence hash of its first block (the run table, core/index.c).  Writers do: a stored event
 * names its parent by hash and a removed event names arbitrary blocks, so every block of every
 * live run must be findable by its sequence hash.  A run's first block already is (the run
 * table), so the locator holds positions 1 .. hw-1, and a run gets an id only once it grows
 * past one block: a one-block run costs nothing here.  This is most of the index's memory per
 * block besides the hash itself, so it is kept small.
 *
 * The idea.  An entry is 32 bits: the run's id (IDX_ID_BITS = 25, an index into dir[]: 33M
 * runs of two blocks or more) and 7 tag bits of the hash (6 and 26 before the load rose to
 * 0.62-0.9: with 6, a removal's lookup scanned 0.21 wrong runs in bench_index_runs
 * --apply-only --per 16, with 7 0.11, callgrind 489 -> 455 instructions per block op, 368 at
 * the old load).  The position is NOT stored: the writer finds the hash in the run's sequence
 * array, trying the caller's hint (the neighbours of the last block it touched: chains are
 * stored and removed in order) and the run's last position first, then scanning at most
 * IDX_RUN_MAX words.  Two blocks of one run with equal tags have equal entries, which is
 * harmless: an entry only says "look in this run".
 *
 * The table: F14-style chunks (folly's F14 hash tables, "F14: a fast, memory-efficient hash
 * table", Bronson and Shi, 2019).  Slots come in chunks of IDX_BLK_CH = 16 entries, one 64-byte
 * line; the home CHUNK is fastrange of the keyed hash's high half (core/place.h), an entry goes to
 * the first chunk with an empty slot on its WALK (home, home + d, home + 2d, ... modulo the number
 * of chunks, which is prime; the step d comes from the entry's tag, F14's double hashing), and each
 * chunk has an overflow byte: how many entries' walks went on past it.  A lookup compares the 16
 * tags of a chunk at once (SSE2), tries the runs whose tag matches, and stops at the first chunk on
 * its walk whose overflow is 0.  (The walk was linear, d = 1: its clusters made a put visit 2.07
 * chunks at load 0.81-0.86, 1.57 now; a simulation of both at load 0.85 plus a 0.05 burst, 2.83
 * and 1.90;
 * callgrind bench_index_runs --apply-only 457 -> 424 instructions per block op in 16-block calls,
 * 1024 -> 977 single-block, the memory lines unchanged.)
 * Deletion needs no tombstone: the locator only deletes when a run dies (drop_run), which
 * iterates the run's hashes, so it knows each entry's key, hence its walk: it walks from the
 * home to the entry, empties the slot and takes one off the overflow bytes it passed.  (Why
 * not linear probing, as before: its deletions left tombstones, since a backward shift needs
 * the moved entries' keys, and the O(table) purges that cleared them, every 0.25 x cap
 * deletions, were the 10-30 ms stalls of replica propagation (issue 14).  Why not Robin Hood
 * with backward-shift deletion: it needs each entry's displacement, 4+ bits per slot, either
 * a parallel array (+0.5-1 byte per slot, +12-25 %) or bits taken from the tag (1-2 tag bits:
 * a wrong run scanned on most probes; a wrong run costs a scan of up to 2048 words) or from the
 * id.  The overflow bytes cost 1 byte per 16 slots.)  An overflow byte saturates at 255 and then
 * stays (never decremented: lookups walk further, nothing is lost; NEVER at load <= 0.9).
 * A delete walk stops at the first entry equal to the one it deletes, which may be the other
 * block's of an equal pair (same run, same tag) nearer the home; the run's other deletions take
 * the rest, and the counts come out exact (they only depend on which chunks the homes and the
 * placed entries are in) unless the walks wrap around the whole array, where they come out too
 * high, never too low (a walk never passes the first equal entry).  That needs the two entries
 * of a pair to walk the same cycle, as linear probing's do: the step is the tag's, which they
 * share, so their walks are one cycle entered at two homes.
 *
 * Capacity: a multiple of 16 slots, as many chunks as the allocator's size class holds (the
 * array is one allocation: entries, then the overflow bytes), grown at load 0.9 to load 0.78
 * (1.15x, or the size class above: 0.62-0.78 just after), so the load stays in 0.62-0.9:
 * 4.5-6.6 bytes per block with the overflow bytes (it grew 1.5x at 0.85, load 0.57-0.85,
 * 4.8-7.1 bytes: bench_index_runs memory lines 21.5 -> 20.5 bytes per held block for 16-block
 * runs with one holder, 14.5 -> 13.5 for 512-block ones; --mem-sweep, 16-block runs with one
 * holder at 97 index sizes, mean 21.84 -> 21.39: the sizes caught migrating, which hold both
 * arrays, take most of the difference back).  The cost is the writers' chunk walks, which grow
 * near the top (a put at load 0.81-0.86 visits 1.57 chunks, 2.07 with linear walks, at 0.51
 * 1.01; bench_index_runs --apply-only sits at 0.81-0.86 with this policy, 0.51-0.54 with the
 * old one: callgrind 368 -> 424 instructions per block op in 16-block calls and 873 -> 977
 * single-block (455 and 1010 with linear walks, whose wall clock was 50-55M -> 30-37M and
 * 19.5M -> 15M block ops/s)).  Shrunk to
 * load 0.6 when below 0.125.  With no tombstones a steady live count never rebuilds, however many
 * entries come and go (bench_index_runs --churn 4000: 0 rebuilds while 2.6 x the table's
 * slots are deleted and inserted, the tombstone table purged 4 times; per-call CPU p99 112-162
 * -> 19-27 us, max 204-274 -> 62-98 us; locator 7.00 -> 6.00 bytes per block).  A lookup tries
 * every candidate's likely words (hint, run ends) before scanning any candidate's hashes; one
 * that misses (a store's first block) scans 0.25 wrong runs there (the tombstone table 0.10).
 *
 * No writer call pays for a whole rebuild (issues 10, 14: done at once, a rebuild of 8 x 65,536
 * blocks was one 5-10 ms call on a shard thread).  A rebuild MIGRATES: the new array is
 * allocated, zeroed in slices, then the runs move over in id order (a cursor `mig` over dir[]):
 * the positions [1, hw) of the runs with ids in [mig, mig_end) are in the old array, every other
 * run's in the new one, so each run's entries are in exactly one array and inserts and drops go
 * to that one, with exact counts.  A moved run's old entries stay behind, stale (its id may be
 * freed and reused; old_used counts them with the live ones): probes of the old array skip the
 * entries of ids outside [mig, mig_end), and the old array is freed when the cursor passes
 * mig_end or no unmoved run has an entry left (ids handed out after the start, >= mig_end, are
 * new-array ids from the first; but while the new array is still being zeroed every insert goes
 * to the old one, so a directory growth then moves mig_end past the new ids).  Lookups probe the
 * new array, then the old.  Each reserve (one per insert) pays a credit of units (16 slots zeroed,
 * one id visited, one entry moved) sized so that the migration ends before the inserts still going
 * to the old array take it past load 0.95 (grow_at + 0.05): (units to do) / (inserts allowed) +
 * 1 + 16 (the 16 was 2: a migration then spanned most of the inserts its hard limit allows, and
 * a growing index held two arrays for a third of its growth cycle; bench_index_runs --churn's
 * fill, 1,024 stores of 512 blocks from empty, averages 6.14 locator bytes per entry with 2,
 * 5.94 with 8, 5.77 with 16, 5.23 with every rebuild at once, 6.65 with the old growth
 * policy; its calls' CPU max 325-676 us with 2, 455-464 with 16, p99 similar (250-330);
 * --mem-sweep's mean 21.39 -> 21.06); a drop_run
 * pays as much per entry it deletes and an unreserve one share, so deletions alone (a shrink, an
 * index being emptied) finish a migration too.  A run moves whole (the credit goes negative and
 * later calls pay it back), so one call does at most its credit + IDX_RUN_MAX units.  Past the hard
 * limit (NEVER with one insert per reserve) the rest moves at once.  A failed allocation changes
 * nothing (the old array stays).  Amortised cost: every rebuild moves each entry once, O(1) per
 * insert per growth (7.7 moves per insert while an index fills at 1.15x; a steady index never
 * grows); while migrating, misses probe two arrays and the memory is old + new.
 * Located runs (extplace, 2026-12-02).  Who looks a block up by its sequence hash?  A write
 * naming a block by the hash the rank stored it under, when that hash is the sequence hash
 * (ext == seq, a "plain" block: the approximate modes, events mode with engines that publish
 * the router's hashes).  A block stored under an engine hash (an alias: vLLM's, every rank's
 * hashes its own) is found through the rank's ext map, whose value is the block's place (run,
 * position: core/index_internal.h, idx_ext_place), never through the locator.  So only runs a
 * rank ever held a position of under its sequence hash are LOCATED (IDX_SB_LOC, for good): the
 * store that commits the first plain block to a run reserves hw - 1 entries and an id in its
 * reserve phase and inserts the run's positions at its commit (once per run; a failed write
 * leaves nothing visible changed, the run may stay located).  A router fed by vLLM alone has no
 * located run past the one-block ones: no locator entry and no directory, 5.6 bytes per block
 * (bench_index_runs --mem-only, ext=rank, 16-block runs with one holder: 39.5 -> 33.9 bytes per
 * held block).  What the locator no longer sees: a crafted root (kvr_index_blk_other_held) on a
 * hash that only an unlocated run has inside is accepted, as in an index without the locator,
 * and so is a chain the crafter appends below it, whose hashes then equal the run's next ones.
 * Lookups by sequence hash never answer with an unlocated run (idx_seq_visible), so the two
 * places stay apart until the run gets a plain holder; that store checks the run's positions
 * against the located runs' first (kvr_index_blk_clash, O(hw) probes once per run) and refuses
 * a clash as a collision, so no two located runs share an interior hash that the locator would
 * have refused before (a crafted root's own hash at an interior position stays allowed, as
 * before: the run table tells the two places apart).
 * Invariant: the locator holds exactly positions [1, hw) of every live LOCATED run (trimmed
 * positions stay until the run dies, so a re-store finds them), and a run has an id iff it is
 * located and has had two positions.
 * Context: every function here runs under the index's writer mutex (or in create / destroy).
 */
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "core/alloc.h"
#include "core/index_internal.h"
#include "kvrouter.h"

#define BLK_MIN      64u /* slots */
#define BLK_EMPTY    0u  /* no live entry is 0: ids start at 1 */
#define BLK_ID_MAX   ((1u << IDX_ID_BITS) - 1)
#define BLK_TAG_BITS (32 - IDX_ID_BITS)
#define BLK_TAG_MASK ((1u << BLK_TAG_BITS) - 1)
#define BLK_OVF_MAX  255u /* an overflow count this high stays (never decremented) */

uint64_t kvr_index_blk_step_min = 16;
uint64_t kvr_index_blk_grow_at = 900;
uint64_t kvr_index_blk_grow_to = 780;

/* The old array's hard limit while migrating (per mille): the growth threshold + 0.05. */
static inline uint64_t blk_hard(void)
{
	const uint64_t h = kvr_index_blk_grow_at + 50;
	return h > 970 ? 970 : h;
}

/* A new array is zeroed in slices of BLK_ZERO slots (so that neither the zeroing nor the page
 * faults of fresh memory land on one call), BLK_ZERO_UNIT slots for one unit of work. */
#define BLK_ZERO      1024u
#define BLK_ZERO_UNIT 16u

static inline uint32_t blk_tag(uint64_t seq)
{
	return (uint32_t)(seq >> 8) & BLK_TAG_MASK;
}

static inline uint32_t blk_ent(uint64_t seq, uint32_t id)
{
	return id << BLK_TAG_BITS | blk_tag(seq);
}

static inline bool dir_live(const struct idx_run *r)
{
	return !((uintptr_t)r & 1);
}

/* The overflow bytes of an array of cap slots (after the entries). */
static inline uint8_t *blk_ovf(uint32_t *e, uint64_t cap)
{
	return (uint8_t *)(e + cap);
}

/* Bit j set: slot j of chunk c has (entry & mask) == v.  The four compares are packed into one
 * byte mask (two saturating packs keep 0 and -1) for a single movemask, with no loop (it was a
 * loop of four movemasks, which -O2 did not unroll: callgrind bench_index_runs --apply-only
 * counted 200 of the 440 instructions per block op in it). */
static inline uint32_t chunk_eq(const uint32_t *c, uint32_t mask, uint32_t v)
{
#ifdef __SSE2__
	const __m128i m = _mm_set1_epi32((int)mask), t = _mm_set1_epi32((int)v);
	__m128i x0 = _mm_loadu_si128((const __m128i *)(const void *)c);
	__m128i x1 = _mm_loadu_si128((const __m128i *)(const void *)(c + 4));
	__m128i x2 = _mm_loadu_si128((const __m128i *)(const void *)(c + 8));
	__m128i x3 = _mm_loadu_si128((const __m128i *)(const void *)(c + 12));
	if (mask != ~0u) {
		x0 = _mm_and_si128(x0, m);
		x1 = _mm_and_si128(x1, m);
		x2 = _mm_and_si128(x2, m);
		x3 = _mm_and_si128(x3, m);
	}
	const __m128i lo = _mm_packs_epi32(_mm_cmpeq_epi32(x0, t), _mm_cmpeq_epi32(x1, t));
	const __m128i hi = _mm_packs_epi32(_mm_cmpeq_epi32(x2, t), _mm_cmpeq_epi32(x3, t));
	return (uint32_t)_mm_movemask_epi8(_mm_packs_epi16(lo, hi));
#else
	uint32_t bits = 0;
	for (uint32_t j = 0; j < IDX_BLK_CH; j++)
		bits |= (uint32_t)((c[j] & mask) == v) << j;
	return bits;
#endif
}

/* The slots of chunk c whose entry has tag (a candidate run each). */
static inline uint32_t chunk_tag(const uint32_t *c, uint32_t tag)
{
	const uint32_t m = chunk_eq(c, BLK_TAG_MASK, tag);
	return tag ? m : m & ~chunk_eq(c, ~0u, BLK_EMPTY);
}

/* The position of seq in r, in [1, hw) (position 0 is only in the run table, and s[0] of a
 * run's own array is reserved for its header word, not a hash: core/index_internal.h), at
 * hp+1, hp-1, hp (the caller's hint), len-1 or hw-1: a few words, where most lookups end. */
static bool pos_quick(const struct idx_run *r, uint64_t seq, const struct idx_run *hr, uint32_t hp,
                      uint32_t *pos)
{
	const uint64_t *s = idx_run_seqs(r);
	const uint32_t hw = idx_run_hw(r);
	if (hr == r) {
		if (hp + 1 < hw && s[hp + 1] == seq) {
			*pos = hp + 1;
			return true;
		}
		if (hp > 1 && hp - 1 < hw && s[hp - 1] == seq) {
			*pos = hp - 1;
			return true;
		}
		if (hp > 0 && hp < hw && s[hp] == seq) {
			*pos = hp;
			return true;
		}
	}
	/* A chain's end: where stores append and tail evictions remove. */
	const uint32_t len = idx_run_len(r);
	if (len > 1 && s[len - 1] == seq) {
		*pos = len - 1;
		return true;
	}
	if (hw > 1 && s[hw - 1] == seq) {
		*pos = hw - 1;
		return true;
	}
	return false;
}

/* Positions a window scan looks at, just below a run's len (pos_scan). */
#define BLK_WINDOW 64u

/* The position of seq in r, in [1, hw), by a scan of r's hashes: with window, of the
 * BLK_WINDOW positions below len only, else of all (up to IDX_RUN_MAX words: what a wrong
 * candidate costs). */
static bool pos_scan(const struct idx_run *r, uint64_t seq, bool window, uint32_t *pos)
{
	const uint64_t *s = idx_run_seqs(r);
	const uint32_t hw = idx_run_hw(r), len = idx_run_len(r);
	const uint32_t stop = window && len > BLK_WINDOW + 1 ? len - BLK_WINDOW : 1;
	/* Backward from the end of the tree's part (positions [1, len)), four words per step
	 * (branch-light): evictions take a chain's tail and stores extend it, so the block is
	 * most often near len; then the trimmed positions [len, hw) a re-store looks for. */
	uint32_t i = len;
	for (; i >= stop + 4; i -= 4) {
		if ((s[i - 1] == seq) | (s[i - 2] == seq) | (s[i - 3] == seq) | (s[i - 4] == seq))
			break;
	}
	for (uint32_t lo = i >= stop + 4 ? i - 4 : stop; i > lo; i--)
		if (s[i - 1] == seq) {
			*pos = i - 1;
			return true;
		}
	if (window)
		return false;
	for (i = len > 1 ? len : 1; i < hw; i++)
		if (s[i] == seq) {
			*pos = i;
			return true;
		}
	return false;
}

/* Whether run id's entries are still in the array being emptied. */
static inline bool in_old(const struct idx_blocks *b, uint32_t id)
{
	return b->old_e && (b->zeroed < b->cap || (id >= b->mig && id < b->mig_end));
}

/* The step between the chunks of seq's walk: from its tag only, so that the two entries of an
 * equal pair (one run, one tag) walk the same cycle; the number of chunks is prime (mig_start),
 * so every step visits them all. */
static inline uint64_t blk_step(uint64_t seq, uint64_t nch)
{
	/* fastrange of a 32-bit mix of the tag onto [1, nch - 1]: a multiply where a division
	 * (% (nch - 1)) was, on every put, lookup and delete. */
	return 1 + (((uint64_t)(blk_tag(seq) * 0x9e3779b1u) * (nch - 1)) >> 32);
}

static inline uint64_t blk_next(uint64_t c, uint64_t d, uint64_t nch)
{
	c += d;
	return c >= nch ? c - nch : c;
}

/* Looks seq up in e (cap slots; old: the array being emptied), trying each candidate run with
 * pos_quick (stage 0), pos_scan of the window below len (stage 1) or of the whole run (2). */
static bool find_in(struct idx_blocks *b, uint32_t *e, uint64_t cap, bool old, int stage,
                    uint64_t seq, const struct idx_run *hr, uint32_t hp, struct idx_run **r,
                    uint32_t *pos)
{
	const uint32_t tag = blk_tag(seq);
	const uint64_t nch = cap / IDX_BLK_CH;
	const uint8_t *ovf = blk_ovf(e, cap);
	const uint64_t d = blk_step(seq, nch);
	uint64_t c = idx_blk_home(seq, nch);
	for (uint64_t n = 0; n < nch; n++) {
		const uint32_t *ch = e + c * IDX_BLK_CH;
		for (uint32_t m = chunk_tag(ch, tag); m; m &= m - 1) {
			const uint32_t v = ch[__builtin_ctz(m)];
			if (old && !in_old(b, v >> BLK_TAG_BITS))
				continue; /* a migrated run's stale entry (its id may be free or
				             reused) */
			struct idx_run *cr = b->dir[v >> BLK_TAG_BITS];
			if (stage ? pos_scan(cr, seq, stage == 1, pos)
			          : pos_quick(cr, seq, hr, hp, pos)) {
				*r = cr;
				return true;
			}
			b->false_cands += stage == 2;
		}
		if (ovf[c] == 0)
			return false; /* no entry's walk went on past c */
		c = blk_next(c, d, nch);
	}
	return false;
}

/* kvr_index_blk_find; tab false: the locator's entries only (interior positions). */
static bool blk_find(const struct kvr_index *idx, uint64_t seq, const struct idx_run *hr,
                     uint32_t hp, bool tab, struct idx_run **r, uint32_t *pos)
{
	/* Const to its callers; its counters are writers' (under wlock) like the rest. */
	struct idx_blocks *b = (struct idx_blocks *)(uintptr_t)&idx->blk;
	b->finds++;
	/* Every candidate's few likely words first (the hint, the run's ends: most lookups end
	 * there), then the run table (a run's first block is only there: one probe), then the
	 * scans, so that a wrong candidate before the right one costs a few words rather than a
	 * scan of its run, and a first block (a removal's usual start) no scan at all: at the
	 * locator's load 0.8 a miss passed 0.91 wrong candidates, 0.44 with the run table tried
	 * first (bench_index_runs --churn; at load 0.68: 0.23 and 0.12).  The scans look at the
	 * BLK_WINDOW positions below each candidate's len first (an evicted tail's first block is
	 * there), so a wrong candidate before the right one costs 64 words, not its whole run
	 * (callgrind bench_index_runs --apply-only --per 16: a removal's first lookup 1,340 ->
	 * 568 instructions). */
	const bool nu = b->e && (!b->old_e || b->zeroed == b->cap);
	for (int stage = 0; stage < 3; stage++) {
		if (nu && find_in(b, b->e, b->cap, false, stage, seq, hr, hp, r, pos))
			return true;
		if (b->old_e && find_in(b, b->old_e, b->old_cap, true, stage, seq, hr, hp, r, pos))
			return true;
		struct idx_run *f = stage || !tab ? NULL : kvr_index_tab_first(idx, seq);
		if (f) {
			*r = f;
			*pos = 0;
			return true;
		}
	}
	return false;
}

bool kvr_index_blk_find(const struct kvr_index *idx, uint64_t seq, const struct idx_run *hr,
                        uint32_t hp, struct idx_run **r, uint32_t *pos)
{
	return blk_find(idx, seq, hr, hp, true, r, pos);
}

/*
 * A hash can sit at two places of the tree: a root run's first block, whose sequence hash is
 * the caller's local hash (kvr_request takes local and sequence hashes: a crafted one, or a
 * 64-bit collision), and an interior position of a chain appended WITHOUT a probe (a block at
 * a run's end with no child there: its hash names its prefix, so honest input cannot have it
 * anywhere else).  A root store onto a hash the tree has is rejected, but a chain appended after
 * the crafted root is not (a probe per appended block would cost every store).  So where a
 * lookup's first answer is a place the slot does not hold, the slot may hold the other one: a
 * rank's removal of its own block answered "not found" there and left it credited with the
 * block.  Only such a lookup pays this (an interior answer: one run-table probe; a root run's
 * first: the locator's search), never one the slot holds where it was found first.
 */
bool kvr_index_blk_other_held(const struct kvr_index *idx, uint64_t seq, uint32_t slot,
                              struct idx_run **r, uint32_t *pos, struct idx_hold **h)
{
	struct idx_run *o;
	uint32_t p = 0;
	if (*pos > 0) { /* an interior position: the root run of that first hash */
		o = kvr_index_tab_first(idx, seq);
		if (!o || idx_run_parent(o))
			return false;
	} else if (idx_run_parent(*r) || !blk_find(idx, seq, NULL, 0, false, &o, &p)) {
		return false; /* a fork's first block is probed when it is made: one place */
	}
	if (o == *r && p == *pos)
		return false; /* NEVER: the run table holds first blocks, the locator the rest */
	struct idx_hold *oh = kvr_index_hold_of(o, slot);
	if (!oh || !idx_hold_bit(oh, p))
		return false;
	*r = o;
	*pos = p;
	*h = oh;
	return true;
}

bool kvr_index_blk_clash(const struct kvr_index *idx, const struct idx_run *r)
{
	struct idx_run *o;
	uint32_t q;
	for (uint32_t p = 1; p < idx_run_hw(r); p++)
		if (blk_find(idx, idx_run_hash(r, p), NULL, 0, false, &o, &q))
			return true;
	return false;
}

/* Puts entry v for seq into e (cap slots, one free at least): the first empty slot of the first
 * chunk from seq's home chunk (home) that has one, counting the chunks passed as overflowed. */
static void put_at(uint32_t *e, uint64_t cap, uint64_t home, uint64_t seq, uint32_t v)
{
	const uint64_t nch = cap / IDX_BLK_CH;
	uint8_t *ovf = blk_ovf(e, cap);
	const uint64_t d = blk_step(seq, nch);
	for (uint64_t c = home;; c = blk_next(c, d, nch)) {
		uint32_t *ch = e + c * IDX_BLK_CH;
		const uint32_t m = chunk_eq(ch, ~0u, BLK_EMPTY);
		if (m) {
			ch[__builtin_ctz(m)] = v;
			return;
		}
		if (ovf[c] < BLK_OVF_MAX)
			ovf[c]++;
	}
}

static void put(uint32_t *e, uint64_t cap, uint64_t seq, uint32_t v)
{
	put_at(e, cap, idx_blk_home(seq, cap / IDX_BLK_CH), seq, v);
}

/* put() of seq[0..k) for run id, the home chunks prefetched a few blocks ahead: they are random
 * lines of a table much larger than the caches (a store's new blocks, a run moved by a
 * migration).  Each home is computed once, with the key read once (core/place.h). */
static void put_many(uint32_t *e, uint64_t cap, const uint64_t *seq, size_t k, uint32_t id)
{
	enum { AHEAD = 6, RING = 8 };
	const uint64_t nch = cap / IDX_BLK_CH, key = kvr_place_key();
	uint64_t home[RING];
	for (size_t j = 0; j < k && j < AHEAD; j++) {
		home[j] = idx_blk_home_k(seq[j], nch, key);
		__builtin_prefetch(e + home[j] * IDX_BLK_CH, 1);
	}
	for (size_t j = 0; j < k; j++) {
		if (j + AHEAD < k) {
			const uint64_t h = idx_blk_home_k(seq[j + AHEAD], nch, key);
			home[(j + AHEAD) % RING] = h;
			__builtin_prefetch(e + h * IDX_BLK_CH, 1);
		}
		put_at(e, cap, home[j % RING], seq[j], blk_ent(seq[j], id));
	}
}

/* Empties the first slot holding v on seq's walk in e and uncounts the chunks the walk passed.
 * Returns false if there is none (NEVER: the locator holds every position below hw).
 * Two blocks of one run with equal tags have equal entries, so this may empty the other one's
 * slot (nearer the home than its own); dropping the run deletes both, and the overflow counts
 * come out exact when the walks do not wrap around the whole array, too high (lookups walk a
 * little further, harmless) when they do: a walk never passes the first equal entry, so no
 * count ends below what the entries left need. */
static bool del(uint32_t *e, uint64_t cap, uint64_t home, uint64_t seq, uint32_t v)
{
	const uint64_t nch = cap / IDX_BLK_CH, d = blk_step(seq, nch);
	uint8_t *ovf = blk_ovf(e, cap);
	uint64_t c = home;
	for (uint64_t n = 0;; n++, c = blk_next(c, d, nch)) {
		if (n == nch)
			return false;
		uint32_t *ch = e + c * IDX_BLK_CH;
		const uint32_t m = chunk_eq(ch, ~0u, v);
		if (m) {
			ch[__builtin_ctz(m)] = BLK_EMPTY;
			break;
		}
	}
	for (uint64_t k = home; k != c; k = blk_next(k, d, nch))
		if (ovf[k] < BLK_OVF_MAX)
			ovf[k]--;
	return true;
}

/* Ends a migration: the old array holds no live entry any more. */
static void mig_done(struct kvr_index *idx)
{
	struct idx_blocks *b = &idx->blk;
	kvr_free(b->old_e, idx_blk_bytes(b->old_cap));
	idx_count(&idx->bytes_shared, -idx_real(idx_blk_bytes(b->old_cap)));
	b->old_e = NULL;
	b->old_cap = b->old_count = b->old_used = b->mig_step = 0;
	b->mig_credit = 0;
	b->mig = b->mig_end = 0;
}

/* Adds `budget` units of work (one per id visited, one per position moved) to the migration's
 * credit and moves the entries of the next runs (in id order) into the new array while the
 * credit is positive (a run moves whole, so the credit may go negative: the calls after pay
 * it back) or until the migration ends.  One call moves at most budget + IDX_RUN_MAX units. */
static void mig_run(struct kvr_index *idx, uint64_t budget)
{
	struct idx_blocks *b = &idx->blk;
	if (!b->old_e)
		return;
	b->mig_credit = budget > INT64_MAX / 2 ? INT64_MAX / 2 : b->mig_credit + (int64_t)budget;
	while (b->old_e) {
		if (b->zeroed < b->cap) { /* first make the new array usable */
			if (b->mig_credit <= 0)
				return;
			uint64_t n = (uint64_t)b->mig_credit * BLK_ZERO_UNIT;
			if (n > BLK_ZERO)
				n = BLK_ZERO;
			if (n > b->cap - b->zeroed)
				n = b->cap - b->zeroed; /* all multiples of IDX_BLK_CH */
			memset(b->e + b->zeroed, 0, n * sizeof(uint32_t));
			memset(blk_ovf(b->e, b->cap) + b->zeroed / IDX_BLK_CH, 0, n / IDX_BLK_CH);
			b->zeroed += n;
			b->mig_credit -= (int64_t)(n / BLK_ZERO_UNIT) + 1;
			continue;
		}
		if (b->old_count == 0 || b->mig >= b->mig_end || b->mig >= b->dir_cap) {
			/* No run left with entries there (ids past dir_cap have no run). */
			mig_done(idx);
			return;
		}
		if (b->mig_credit <= 0)
			return;
		const uint32_t id = b->mig;
		const struct idx_run *r = b->dir[id];
		int64_t w = 1;
		const uint32_t hw = dir_live(r) ? idx_run_hw(r) : 0;
		if (hw > 1) {
			put_many(b->e, b->cap, idx_run_seqs(r) + 1, hw - 1u, id);
			b->count += hw - 1u;
			b->old_count -= hw - 1u; /* their slots there stay used, stale */
			w += hw - 1;
		}
		b->mig = id + 1; /* its old entries are stale from here */
		b->mig_credit -= w;
	}
}

static bool prime(uint64_t n)
{
	if (n < 2)
		return false;
	for (uint64_t k = 2; k * k <= n; k++)
		if (n % k == 0)
			return false;
	return true;
}

/* Replaces the entry array by an empty one of cap slots at least (as many chunks as the
 * allocator's size class holds) and starts zeroing it, then moving the entries into it, a
 * bounded slice per locator call, so that no call does O(table) work.  Returns 0 or KVR_ENOMEM
 * (unchanged).  Context: not migrating. */
static int mig_start(struct kvr_index *idx, uint64_t cap)
{
	struct idx_blocks *b = &idx->blk;
	const uint64_t want = (cap + IDX_BLK_CH - 1) / IDX_BLK_CH;
	uint64_t nch =
	    kvr_alloc_real_size(idx_blk_bytes(want * IDX_BLK_CH)) / idx_blk_bytes(IDX_BLK_CH);
	/* A prime number of chunks (a walk's step must be coprime with it: blk_step), the
	 * largest the size class holds, or the next one up if that is fewer than asked. */
	while (!prime(nch))
		nch--;
	if (nch < want)
		for (nch = want; !prime(nch); nch++)
			;
	cap = nch * IDX_BLK_CH;
	uint32_t *e = kvr_alloc(idx_blk_bytes(cap));
	if (!e)
		return KVR_ENOMEM;
	idx_count(&idx->bytes_shared, idx_real(idx_blk_bytes(cap)));
	if (!b->e) {
		memset(e, 0, idx_blk_bytes(cap));
	} else {
		b->rebuilds++;
		b->old_e = b->e;
		b->old_cap = b->cap;
		b->old_count = b->old_used = b->count;
		b->mig = 1;
		b->mig_end = b->dir_cap;
		/* Size the slice so that the migration ends before the inserts that still go to
		 * the old array could take it past its hard limit (blk_hard): each insert
		 * may go there and add a unit to move, so (ids + entries) / (inserts allowed) + 1
		 * per insert, the least slice on top. */
		uint64_t lim = b->old_cap * blk_hard() / 1000;
		uint64_t slack = lim > b->old_used ? lim - b->old_used : 1;
		b->mig_step = (cap / BLK_ZERO_UNIT + b->mig_end + b->old_count) / slack + 1 +
		              kvr_index_blk_step_min;
	}
	b->e = e;
	b->cap = cap;
	b->zeroed = b->old_e ? 0 : cap;
	b->count = 0;
	mig_run(idx, b->mig_step); /* a small table moves at once */
	return 0;
}

void kvr_index_blk_unreserve(struct kvr_index *idx)
{
	struct idx_blocks *b = &idx->blk;
	if (b->e && b->count == 0 && b->old_count == 0) {
		if (b->old_e)
			mig_done(idx);
		kvr_free(b->e, idx_blk_bytes(b->cap));
		idx_count(&idx->bytes_shared, -idx_real(idx_blk_bytes(b->cap)));
		b->e = NULL;
		b->cap = 0;
	} else {
		mig_run(idx, b->mig_step); /* a write that failed still moves its share */
	}
}

int kvr_index_blk_reserve(struct kvr_index *idx, uint64_t k)
{
	struct idx_blocks *b = &idx->blk;
	if (b->old_e) {
		mig_run(idx, b->mig_step * k);
		if (b->old_e && (b->old_used + k) * 1000 <= b->old_cap * blk_hard() &&
		    (b->count + b->old_count + k) * 1000 <= b->cap * kvr_index_blk_grow_at)
			return 0;
		/* Past the hard limit (NEVER with k = 1: the slice is sized for it): the rest at
		 * once.  Not migrating any more: check the array as a whole. */
		mig_run(idx, UINT64_MAX);
	}
	const uint64_t need = b->count + k;
	if (b->e && need * 1000 <= b->cap * kvr_index_blk_grow_at)
		return 0;
	/* Grow to load grow_to (1.2x at the defaults).  Deletions leave no tombstone, so this
	 * is the only rebuild inserts cause: steady churn at a steady live count never
	 * rebuilds. */
	uint64_t cap = need * 1000 / kvr_index_blk_grow_to + 1;
	if (cap < BLK_MIN)
		cap = BLK_MIN;
	const int rc = mig_start(idx, cap);
	/* The k inserts may go to the old array (while the new one is zeroed, or for an id the
	 * cursor has not passed): for k > 1 (a run's positions entering the locator together,
	 * kvr_index_store) it may not hold them; then the rest at once (k = 1 always fits). */
	if (rc == 0 && b->old_e && (b->old_used + k) * 1000 > b->old_cap * blk_hard())
		mig_run(idx, UINT64_MAX);
	return rc;
}

void kvr_index_blk_insert(struct kvr_index *idx, uint64_t seq, const struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	const uint32_t id = idx_run_id(r);
	if (in_old(b, id)) {
		put(b->old_e, b->old_cap, seq, blk_ent(seq, id));
		b->old_count++;
		b->old_used++;
	} else {
		put(b->e, b->cap, seq, blk_ent(seq, id));
		b->count++;
	}
}

void kvr_index_blk_insert_many(struct kvr_index *idx, const uint64_t *seq, size_t k,
                               const struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	const uint32_t id = idx_run_id(r);
	const bool old = in_old(b, id); /* one run: one array for all k */
	uint32_t *e = old ? b->old_e : b->e;
	const uint64_t cap = old ? b->old_cap : b->cap;
	put_many(e, cap, seq, k, id);
	if (old) {
		b->old_count += k;
		b->old_used += k;
	} else {
		b->count += k;
	}
}

uint64_t kvr_index_blk_reserve_upto(struct kvr_index *idx, uint64_t k)
{
	struct idx_blocks *b = &idx->blk;
	if (!b->e || k == 0)
		return 0;
	uint64_t room = UINT64_MAX;
	if (b->old_e) {
		/* k reserves' share of the migration, paid at once (ahead of the inserts: a run's
		 * entries then go where the migration has put the run by now). */
		mig_run(idx, b->mig_step * k);
		if (b->old_e) {
			/* kvr_index_blk_reserve's two limits while migrating */
			const uint64_t hard = b->old_cap * blk_hard() / 1000;
			const uint64_t all = b->count + b->old_count;
			room = hard > b->old_used ? hard - b->old_used : 0;
			const uint64_t lim = b->cap * kvr_index_blk_grow_at / 1000;
			if (room > (lim > all ? lim - all : 0))
				room = lim > all ? lim - all : 0;
			return room < k ? room : k;
		}
	}
	const uint64_t lim = b->cap * kvr_index_blk_grow_at / 1000;
	room = lim > b->count ? lim - b->count : 0;
	return room < k ? room : k;
}

void kvr_index_blk_drop_run(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	const uint32_t id = idx_run_id(r);
	if (id == 0)
		return; /* one position ever: nothing here */
	const uint32_t hw = idx_run_hw(r);
	/* A migration moves its share per entry deleted too, so that deletions alone (a shrink,
	 * an index being emptied) finish it: the call's work stays O(its run). */
	if (b->old_e)
		mig_run(idx, b->mig_step * hw);
	/* All of r's entries are in one array: the old one iff r is not migrated yet. */
	const bool old = in_old(b, id);
	uint32_t *e = old ? b->old_e : b->e;
	const uint64_t cap = old ? b->old_cap : b->cap;
	const uint64_t *s = idx_run_seqs(r);
	uint64_t n = 0;
	enum { AHEAD = 6, RING = 8 };
	const uint64_t nch = cap / IDX_BLK_CH, key = kvr_place_key();
	uint64_t home[RING];
	for (uint32_t p = 1; p < hw && p <= AHEAD; p++) {
		home[p % RING] = idx_blk_home_k(s[p], nch, key);
		__builtin_prefetch(e + home[p % RING] * IDX_BLK_CH, 1);
	}
	for (uint32_t p = 1; p < hw; p++) {
		if (p + AHEAD < hw) { /* random lines, as in put_many */
			const uint64_t h = idx_blk_home_k(s[p + AHEAD], nch, key);
			home[(p + AHEAD) % RING] = h;
			__builtin_prefetch(e + h * IDX_BLK_CH, 1);
		}
		n += del(e, cap, home[p % RING], s[p], blk_ent(s[p], id));
	}
	if (old) {
		b->old_count -= n;
		b->old_used -= n;
	} else {
		b->count -= n;
	}
	kvr_index_blk_id_free(idx, r);
	/* Give memory back after mass removal; keep the old array if the new one fails.  While
	 * migrating, the next check after the migration decides. */
	if (b->count == 0 && b->old_count == 0)
		kvr_index_blk_unreserve(idx);
	else if (!b->old_e && b->cap > BLK_MIN && b->count * 8 < b->cap)
		(void)mig_start(idx, b->count * 5 / 3 + BLK_MIN);
}

int kvr_index_blk_id_new(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	if (idx_seqs_inline(r))
		return KVR_ENOMEM; /* NEVER: a run past one position has its own hash array */
	if (!b->dir_free) {
		const uint32_t max = b->id_limit ? b->id_limit : BLK_ID_MAX;
		uint32_t ocap = b->dir_cap, ncap = ocap ? ocap + ocap / 2 : 64;
		/* Every id in use (2^25 - 1 located runs, ~4 GB of index): no memory would help,
		 * and KVR_ENOMEM would say it could, so the store is refused as out of range
		 * (and taken back whole: index_write.c).  Ids of dead runs are reused. */
		if (ocap > max)
			return KVR_ERANGE;
		if (ncap > max + 1)
			ncap = max + 1;
		struct idx_run **d = kvr_alloc((size_t)ncap * sizeof(*d));
		if (!d)
			return KVR_ENOMEM;
		if (ocap)
			memcpy(d, b->dir, (size_t)ocap * sizeof(*d));
		/* New ids 1 (or ocap) .. ncap-1 onto the free list, lowest first. */
		uint32_t lo = ocap ? ocap : 1;
		for (uint32_t id = lo; id < ncap; id++)
			d[id] =
			    (struct idx_run *)(uintptr_t)((id + 1 < ncap ? (uintptr_t)(id + 1) : 0)
			                                      << 1 |
			                                  1);
		if (!ocap)
			d[0] = (struct idx_run *)(uintptr_t)1; /* never used */
		kvr_free(b->dir, (size_t)ocap * sizeof(*d));
		idx_count(&idx->bytes_shared, idx_real((uint64_t)ncap * sizeof(*d)) -
		                                  idx_real((uint64_t)ocap * sizeof(*d)));
		/* While the new array is being zeroed every insert goes to the old one, these ids'
		 * too: the migration must move them (it moves ids below mig_end; once zeroing ends
		 * the old array answers for no other id, so their entries were lost: held blocks
		 * a store could not find as its parent). */
		if (b->old_e && b->zeroed < b->cap && ncap > b->mig_end)
			b->mig_end = ncap;
		b->dir = d;
		b->dir_cap = ncap;
		b->dir_free = lo;
	}
	uint32_t id = b->dir_free;
	b->dir_free = (uint32_t)((uintptr_t)b->dir[id] >> 1);
	b->dir[id] = r;
	b->live++;
	idx_run_set_id(r, id);
	return 0;
}

void kvr_index_blk_id_free(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	const uint32_t id = idx_run_id(r);
	if (id == 0)
		return; /* never had one */
	if (id >= b->dir_cap || b->dir[id] != r)
		return; /* NEVER */
	b->dir[id] = (struct idx_run *)(uintptr_t)((uintptr_t)b->dir_free << 1 | 1);
	b->dir_free = id;
	idx_run_set_id(r, 0);
	if (--b->live == 0) { /* no run left: give the directory back */
		kvr_free(b->dir, (size_t)b->dir_cap * sizeof(*b->dir));
		idx_count(&idx->bytes_shared, -idx_real((uint64_t)b->dir_cap * sizeof(*b->dir)));
		b->dir = NULL;
		b->dir_cap = b->dir_free = 0;
	}
}

void kvr_index_blk_fini(struct kvr_index *idx)
{
	struct idx_blocks *b = &idx->blk;
	kvr_free(b->e, idx_blk_bytes(b->cap));
	kvr_free(b->old_e, idx_blk_bytes(b->old_cap));
	kvr_free(b->dir, (size_t)b->dir_cap * sizeof(*b->dir));
	memset(b, 0, sizeof(*b));
}
