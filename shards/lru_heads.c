/*
 * shards/lru_heads.c - the approximate LRU's head map: a segment's first hash -> the first
 * segment of its multimap chain (lru->hnext links the rest; see lru.c for why the walk probes
 * it only below segment tails).
 *
 * Why not the shards' u64map (16-byte slots: the key, the value, a spare word).  The key is
 * already in the heap (a segment's first hash, lru_heap.c), so a slot keeps the segment and the
 * hash's high 32 bits as a tag: 8 bytes.  A probe compares the tag and, on a match, the hash in
 * the heap (the walk reads that segment's hashes next anyway).  bench_footprint at 2k prompts
 * ended with 1,300-1,900 heads a rank in 2,048-4,096 slots: 32-64 KB a rank in 16-byte slots,
 * 1.3-2.6 B per (block, rank).  Linear probing, load <= 0.7 (doubles above, halves under 0.3 at
 * a command's end), deletion by backward shift (no tombstones), the home a Fibonacci hash of
 * the whole key; a move (resize, backward shift) reads the moved slot's hash from the heap.
 *
 * Failure model: only kvr_lru_heads_reserve and the settle's halving allocate; a command
 * reserves before it mutates.  Context: the shard thread that owns the instance.
 */
#include "kvrouter.h"
#include "shards/lru_internal.h"

/* Moves the map into cap slots (a power of two, room for every entry at load <= 0.7).  0 or
 * KVR_ENOMEM (unchanged). */
static int heads_rebuild(struct kvr_lru *lru, uint32_t cap)
{
	struct head_slot *s = kvr_alloc((size_t)cap * sizeof(*s));
	if (!s)
		return KVR_ENOMEM;
	for (uint32_t i = 0; i < cap; i++)
		s[i].seg = NIL;
	struct kvr_lru_heads old = lru->heads, *m = &lru->heads;
	m->slots = s;
	m->cap = cap;
	m->count = 0;
	m->shift = 64u - (unsigned)__builtin_ctz(cap);
	for (uint32_t i = 0; i < old.cap; i++)
		if (old.slots[i].seg != NIL)
			kvr_lru_heads_insert(lru, kvr_lru_head_hash(lru, old.slots[i].seg),
			                     old.slots[i].seg);
	kvr_free(old.slots, (size_t)old.cap * sizeof(*old.slots));
	return 0;
}

int kvr_lru_heads_reserve(struct kvr_lru *lru, size_t n)
{
	size_t need = (size_t)lru->heads.count + n, cap = lru->heads.cap ? lru->heads.cap : 16;
	if (need * 10 <= (size_t)lru->heads.cap * 7)
		return 0;
	while (need * 10 > cap * 7)
		cap *= 2;
	if (cap > (size_t)1 << 31)
		return KVR_ERANGE;
	return heads_rebuild(lru, (uint32_t)cap);
}

void kvr_lru_heads_insert(struct kvr_lru *lru, uint64_t h, uint32_t i)
{
	struct kvr_lru_heads *m = &lru->heads;
	size_t mask = m->cap - 1, at = kvr_lru_heads_home(m, h);
	while (m->slots[at].seg != NIL)
		at = (at + 1) & mask;
	m->slots[at] = (struct head_slot){i, (uint32_t)(h >> 32)};
	m->count++;
}

void kvr_lru_heads_remove(struct kvr_lru *lru, uint64_t h)
{
	struct kvr_lru_heads *m = &lru->heads;
	/* seg is the slot's first member: the pointer find returns is the slot's. */
	struct head_slot *at = (struct head_slot *)kvr_lru_heads_find(lru, h);
	size_t mask = m->cap - 1, i = (size_t)(at - m->slots);
	for (size_t j = i;;) {
		j = (j + 1) & mask;
		if (m->slots[j].seg == NIL)
			break;
		size_t home = kvr_lru_heads_home(m, kvr_lru_head_hash(lru, m->slots[j].seg));
		/* Move slot j back into the hole i unless its home lies cyclically in (i, j]. */
		bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
		if (!stays) {
			m->slots[i] = m->slots[j];
			i = j;
		}
	}
	m->slots[i].seg = NIL;
	m->count--;
}

void kvr_lru_heads_settle(struct kvr_lru *lru)
{
	struct kvr_lru_heads *m = &lru->heads;
	if (m->cap > 64 && (size_t)m->count * 10 < (size_t)m->cap * 3)
		(void)heads_rebuild(lru, m->cap / 2);
}

void kvr_lru_heads_fini(struct kvr_lru *lru)
{
	kvr_free(lru->heads.slots, (size_t)lru->heads.cap * sizeof(struct head_slot));
	lru->heads = (struct kvr_lru_heads){NULL, 0, 0, 64};
}
