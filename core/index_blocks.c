/*
 * core/index_blocks.c - the run index's block locator: any block's (run, position) by its hash.
 *
 * Why it exists.  Readers never need it: they walk from the root and find each child by the
 * sequence hash of its first block (the run table, core/index.c).  Writers do: a stored event
 * names its parent by hash and a removed event names arbitrary blocks, so every block of every
 * live run must be findable by its sequence hash.  A run's first block already is (the run
 * table), so the locator holds positions 1 .. hw-1, and a run gets an id only once it grows
 * past one block: a one-block run costs nothing here.  This is most of the index's memory per block
 * besides the hash itself, so it is kept small.
 *
 * The idea.  An entry is 32 bits: the run's id (IDX_ID_BITS, an index into dir[]) and 6 tag
 * bits of the hash.  The position is NOT stored: the writer finds the hash in the run's sequence
 * array, trying the caller's hint (the neighbours of the last block it touched: chains are
 * stored and removed in order) and the run's last position first, then scanning at most
 * IDX_RUN_MAX words.  Two blocks of one run with equal tags have equal entries, which is
 * harmless: an entry only says "look in this run".  Open addressing, linear probing, deletes
 * leave tombstones (a backward shift would need the moved entries' keys), capacity any integer
 * (the home slot is fastrange of the hash's high half), grown by 1.5x at load 0.85, so the
 * load stays in 0.57-0.85: 4.7-7 bytes per block, versus 8-byte pointer entries at 0.4-0.8
 * (10-20 bytes) in the table this replaced.
 *
 * Under insert / remove churn tombstones fill the table; the purge that clears them is
 * O(table), so it rebuilds at a size where the live entries sit at load 0.6, which leaves
 * room for 0.25 x cap deletions before the next one (a purge at the same size came every few
 * hundred deletions).
 *
 * Growth re-inserts every position [0, hw) of every live run, reading the keys from the runs
 * (entries do not hold them): O(blocks) once per 1.5x, amortised O(1) per insert, under the
 * writer mutex (readers are not involved).  Invariant: the locator holds exactly positions
 * [1, hw) of every live run (trimmed positions stay until the run dies, so a re-store finds
 * them), and a run has an id iff it ever had two positions.
 * Context: every function here runs under the index's writer mutex (or in create / destroy).
 */
#include <string.h>

#include "core/alloc.h"
#include "core/index_internal.h"
#include "kvrouter.h"

#define BLK_MIN    64
#define BLK_EMPTY  0u
#define BLK_TOMB   1u
#define BLK_ID_MAX ((1u << IDX_ID_BITS) - 1)

static inline uint32_t blk_tag(uint64_t seq)
{
	return (uint32_t)(seq >> 8) & 63;
}

static inline uint32_t blk_ent(uint64_t seq, uint32_t id)
{
	return id << 6 | blk_tag(seq);
}

static inline bool dir_live(const struct idx_run *r)
{
	return !((uintptr_t)r & 1);
}

/* The position of seq in r (below hw), trying hp+1, hp-1, hp, len-1 and hw-1 before a scan. */
static bool pos_in(const struct idx_run *r, uint64_t seq, const struct idx_run *hr, uint32_t hp,
                   uint32_t *pos)
{
	const uint64_t *s = r->seqs;
	const uint32_t hw = r->hw;
	if (hr == r) {
		if (hp + 1 < hw && s[hp + 1] == seq) {
			*pos = hp + 1;
			return true;
		}
		if (hp > 0 && hp - 1 < hw && s[hp - 1] == seq) {
			*pos = hp - 1;
			return true;
		}
		if (hp < hw && s[hp] == seq) {
			*pos = hp;
			return true;
		}
	}
	/* A chain's end: where stores append and tail evictions remove. */
	const uint32_t len = r->len;
	if (len > 0 && s[len - 1] == seq) {
		*pos = len - 1;
		return true;
	}
	if (s[hw - 1] == seq) {
		*pos = hw - 1;
		return true;
	}
	/* Backward from the end of the tree's part (positions [0, len)), four words per step
	 * (branch-light): evictions take a chain's tail and stores extend it, so the block is
	 * most often near len; then the trimmed positions [len, hw) a re-store looks for. */
	uint32_t i = len;
	for (; i >= 4; i -= 4) {
		if ((s[i - 1] == seq) | (s[i - 2] == seq) | (s[i - 3] == seq) | (s[i - 4] == seq))
			break;
	}
	for (uint32_t lo = i >= 4 ? i - 4 : 0; i > lo; i--)
		if (s[i - 1] == seq) {
			*pos = i - 1;
			return true;
		}
	for (i = len; i < hw; i++)
		if (s[i] == seq) {
			*pos = i;
			return true;
		}
	return false;
}

bool kvr_index_blk_find(const struct kvr_index *idx, uint64_t seq, const struct idx_run *hr,
                        uint32_t hp, struct idx_run **r, uint32_t *pos)
{
	const struct idx_blocks *b = &idx->blk;
	if (!b->e)
		return false;
	const uint32_t tag = blk_tag(seq);
	for (uint64_t i = idx_blk_home(seq, b->cap);; i = i + 1 == b->cap ? 0 : i + 1) {
		uint32_t e = b->e[i];
		if (e == BLK_EMPTY)
			return false;
		if ((e & 63) != tag || e == BLK_TOMB)
			continue;
		struct idx_run *c = b->dir[e >> 6];
		if (pos_in(c, seq, hr, hp, pos)) {
			*r = c;
			return true;
		}
	}
}

static void put(uint32_t *e, uint64_t cap, uint64_t seq, uint32_t v)
{
	uint64_t i = idx_blk_home(seq, cap);
	while (e[i] > BLK_TOMB)
		i = i + 1 == cap ? 0 : i + 1;
	e[i] = v;
}

/* Rebuilds the entries into a new array of cap slots.  Returns 0 or KVR_ENOMEM (unchanged). */
static int rebuild(struct kvr_index *idx, uint64_t cap)
{
	struct idx_blocks *b = &idx->blk;
	uint32_t *e = kvr_calloc(cap, sizeof(uint32_t));
	if (!e)
		return KVR_ENOMEM;
	uint64_t count = 0;
	for (uint32_t id = 1; id < b->dir_cap; id++) {
		const struct idx_run *r = b->dir[id];
		if (!dir_live(r))
			continue;
		for (uint32_t p = 1; p < r->hw; p++)
			put(e, cap, r->seqs[p], blk_ent(r->seqs[p], id));
		count += r->hw - 1u;
	}
	if (b->e) {
		kvr_free(b->e, b->cap * sizeof(uint32_t));
		idx_count(&idx->bytes_shared, -(int64_t)(b->cap * sizeof(uint32_t)));
	}
	idx_count(&idx->bytes_shared, (int64_t)(cap * sizeof(uint32_t)));
	b->e = e;
	b->cap = cap;
	b->count = count;
	b->tombs = 0;
	return 0;
}

void kvr_index_blk_unreserve(struct kvr_index *idx)
{
	struct idx_blocks *b = &idx->blk;
	if (b->e && b->count == 0) {
		kvr_free(b->e, b->cap * sizeof(uint32_t));
		idx_count(&idx->bytes_shared, -(int64_t)(b->cap * sizeof(uint32_t)));
		b->e = NULL;
		b->cap = b->tombs = 0;
	}
}

int kvr_index_blk_reserve(struct kvr_index *idx, uint64_t k)
{
	struct idx_blocks *b = &idx->blk;
	uint64_t used = b->count + b->tombs + k;
	if (b->e && used * 20 <= b->cap * 17)
		return 0;
	uint64_t need = b->count + k, cap = b->cap;
	if (need * 20 > cap * 17 || !b->e) { /* grow 1.5x, or to load 0.6 for a big k */
		cap = cap * 3 / 2;
		if (cap * 3 < need * 5)
			cap = need * 5 / 3 + 1;
		if (cap < BLK_MIN)
			cap = BLK_MIN;
	} else if (cap * 3 < need * 5) {
		/* Tombstones filled the table: purge them, at a size where the live entries are
		 * at load 0.6, so steady insert / remove churn purges after 0.25 x cap deletions
		 * (a purge at the same size came every few: O(table) each, 7.5 % of a churn
		 * run's instructions). */
		cap = need * 5 / 3 + 1;
	} /* else: purge tombstones at the same size */
	return rebuild(idx, cap);
}

void kvr_index_blk_insert(struct kvr_index *idx, uint64_t seq, const struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	uint64_t i = idx_blk_home(seq, b->cap);
	while (b->e[i] > BLK_TOMB)
		i = i + 1 == b->cap ? 0 : i + 1;
	if (b->e[i] == BLK_TOMB)
		b->tombs--;
	b->e[i] = blk_ent(seq, idx_run_id(r));
	b->count++;
}

/* Empties slot i: a tombstone, unless the next slot is empty, in which case no probe can
 * need to pass i (nor the tombstones just before it, which are emptied too). */
static void kill(struct idx_blocks *b, uint64_t i)
{
	uint64_t next = i + 1 == b->cap ? 0 : i + 1;
	if (b->e[next] != BLK_EMPTY) {
		b->e[i] = BLK_TOMB;
		b->tombs++;
		return;
	}
	b->e[i] = BLK_EMPTY;
	for (uint64_t j = i ? i - 1 : b->cap - 1; b->e[j] == BLK_TOMB; j = j ? j - 1 : b->cap - 1) {
		b->e[j] = BLK_EMPTY;
		b->tombs--;
	}
}

void kvr_index_blk_drop_run(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	const uint32_t id = idx_run_id(r);
	if (id == 0)
		return; /* one position ever: nothing here */
	for (uint32_t p = 1; p < r->hw; p++) {
		const uint64_t seq = r->seqs[p];
		const uint32_t want = blk_ent(seq, id);
		for (uint64_t i = idx_blk_home(seq, b->cap);; i = i + 1 == b->cap ? 0 : i + 1) {
			uint32_t e = b->e[i];
			if (e == BLK_EMPTY)
				break; /* NEVER: the locator holds every position below hw */
			if (e == want) {
				b->count--;
				kill(b, i);
				break;
			}
		}
	}
	kvr_index_blk_id_free(idx, r);
	/* Give memory back after mass removal; keep the old array if the new one fails. */
	if (b->count == 0) {
		kvr_index_blk_unreserve(idx);
	} else if (b->cap > BLK_MIN && b->count * 8 < b->cap) {
		(void)rebuild(idx, b->count * 5 / 3 + BLK_MIN);
	} else if (b->tombs * 4 > b->cap) {
		uint64_t cap = b->count * 5 / 3 + 1; /* as in kvr_index_blk_reserve */
		(void)rebuild(idx, cap > b->cap ? cap : b->cap);
	}
}

int kvr_index_blk_id_new(struct kvr_index *idx, struct idx_run *r)
{
	struct idx_blocks *b = &idx->blk;
	if (idx_seqs_inline(r))
		return KVR_ENOMEM; /* NEVER: a run past one position has its own hash array */
	if (!b->dir_free) {
		uint32_t ocap = b->dir_cap, ncap = ocap ? ocap + ocap / 2 : 64;
		if (ocap > BLK_ID_MAX)
			return KVR_ENOMEM; /* 2^26 runs: the id space is full */
		if (ncap > BLK_ID_MAX + 1)
			ncap = BLK_ID_MAX + 1;
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
		idx_count(&idx->bytes_shared, (int64_t)(ncap - ocap) * (int64_t)sizeof(*d));
		b->dir = d;
		b->dir_cap = ncap;
		b->dir_free = lo;
	}
	uint32_t id = b->dir_free;
	b->dir_free = (uint32_t)((uintptr_t)b->dir[id] >> 1);
	b->dir[id] = r;
	b->live++;
	idx_seqs_hdr(r->seqs)->id = id;
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
	idx_seqs_hdr(r->seqs)->id = 0;
	if (--b->live == 0) { /* no run left: give the directory back */
		kvr_free(b->dir, (size_t)b->dir_cap * sizeof(*b->dir));
		idx_count(&idx->bytes_shared, -(int64_t)b->dir_cap * (int64_t)sizeof(*b->dir));
		b->dir = NULL;
		b->dir_cap = b->dir_free = 0;
	}
}

void kvr_index_blk_fini(struct kvr_index *idx)
{
	struct idx_blocks *b = &idx->blk;
	kvr_free(b->e, b->cap * sizeof(uint32_t));
	kvr_free(b->dir, (size_t)b->dir_cap * sizeof(*b->dir));
	memset(b, 0, sizeof(*b));
}
