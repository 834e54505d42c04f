/*
 * shards/ttl_map.c - the TTL store's hash -> run map, grown incrementally (issue 11 item 3).
 *
 * Why.  The TTL store (shards/ttl.c) maps every held block's hash to its run.  Grown the usual
 * way, the call that fills the table allocates one twice the size and rehashes every entry into
 * it: at 600k held blocks a 10 ms call on the shard thread (bench_lru --blocks 512, record max),
 * and every routing task queued behind it waits that long.  Before growing, the store also
 * buried every pending grave (entries of expired runs, ttl.c "Lazy deletion") at once: O(expired
 * blocks), as bad after a mass expiry.
 *
 * The idea is the index block locator's (core/index_blocks.c): a new table is allocated, made
 * empty a slice at a time, then the entries migrate a slice at a time, each call paying for a
 * bounded number of units; lookups probe the new table, then the old; every key is in exactly
 * one of the two, so counts stay exact.  What differs is how the old table is walked: it is
 * linear probing with deletion by backward shift (shards/u64map.h), where a removal moves other
 * entries, which a cursor over slots cannot follow.  So once the old table stops taking inserts
 * it stops moving entries too: the migration cursor `mig` walks its slots upwards and copies
 * each entry (if live: stale entries, of expired runs, are dropped) into the new table, leaving
 * the old slot as it is; a removal from the old table leaves a tombstone (KVR_TTL_MAP_TOMB).  Slots
 * never empty, so every probe path of the old table stays intact.  Invariant: a key's entry in
 * the old table counts only at a slot >= mig (below, its copy in the new table is the one:
 * found there first, or removed since), old.count counts those entries, and each key is in at
 * most one place.  The old table is freed when old.count reaches 0 (often before the cursor
 * reaches its end) or the cursor passes its end.
 *
 * Phases.  (1) zeroing: the new table's slots are marked empty, KVR_TTL_MAP_ZERO slots a unit,
 * so that neither the writes nor the page faults of fresh memory land on one call; the old
 * table alone is in use and takes inserts.  (2) moving: lookups probe the new table, then the
 * old; inserts go to the new one.
 *
 * Pace.  Work is counted in units: KVR_TTL_MAP_ZERO slots zeroed, one old slot scanned, one
 * entry copied.  Each call that inserts k keys first pays step * k units (and a few per call,
 * ttl.c), the step set per phase so that the phase ends before the inserts could take the table
 * they go to past MAP_HARD (0.85): phase 1 zeroes C'/ZERO units while the old table (C slots,
 * n entries) takes inserts, so C'/ZERO / (0.85 C - n) + 1, a little more; phase 2 scans C slots
 * and copies at most n entries while the new table takes the inserts, and it will hold at most
 * the held blocks' entries plus those inserts, so (C + n) / (0.85 C' - held) + 1, a little more.
 * At the usual start (load 0.7, doubling) that is about 5 units per inserted key in either
 * phase: a record of 128 new blocks does ~700 units where it rehashed the whole table.  (One
 * pace for both, sized by the tighter phase-1 slack, was 16 units per key: bench_lru
 * --blocks 512 record p99.9 109-116 us against 78-90 before the change; with two, 58-72 against
 * 61-63.)  A call that inserts more keys than the slack (one record bigger than 15 % of the
 * table) finishes the migration at once: O(table), but its own size is a good part of that.
 * A failed allocation (only kvr_ttl_map_start allocates) changes nothing.  Every entry still
 * moves once per growth, but while migrating misses probe two tables (the graves' lookups of
 * entries a migration already dropped are such misses), every slot costs a unit of
 * bookkeeping, and the memory is old + new table (as it was for an instant before).  Measured
 * (callgrind, bench_lru --only ttl-runs, instructions per record): 16.5k -> 19.1k at 512
 * blocks (+15.5 %; 18.3k with one faster pace, the migrations shorter), 4.32k -> 4.59k at 64
 * (+6.2 %), where a growth of the 1M-slot table rehashed 600k entries in one call.  Probing the
 * fuller table first was worse (most lookups are of blocks just recorded, in the new one).
 * Context: the shard thread that owns the TTL store; no locks, no atomics.
 */
#include "shards/ttl_map.h"

#include "core/alloc.h"
#include "kvrouter.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#include <sanitizer/asan_interface.h>
#endif
#endif
#ifndef ASAN_POISON_MEMORY_REGION
#define ASAN_POISON_MEMORY_REGION(addr, size)   ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif

/* Slots made empty per unit of work (128 bytes), and per loop iteration at most. */
#define KVR_TTL_MAP_ZERO 8u
#define ZERO_CHUNK       1024u
/* Load (percent) the table taking inserts may reach while migrating: the pace is sized so that
 * it does not (a table starts migrating when inserts would take it past 0.7). */
#define MAP_HARD 85u
#define STEP_MIN 2u

void kvr_ttl_map_init(struct kvr_ttl_map *m, kvr_ttl_map_live_fn live, const void *ctx,
                      const size_t *held)
{
	m->held = held;
	kvr_u64map_init(&m->cur);
	kvr_u64map_init(&m->old);
	m->zeroed = m->mig = m->released = m->step = 0;
	m->credit = 0;
	m->migrations = 0;
	m->max_units = 0;
	m->live = live;
	m->ctx = ctx;
}

void kvr_ttl_map_fini(struct kvr_ttl_map *m)
{
	ASAN_UNPOISON_MEMORY_REGION(m->old.slots, m->old.cap * sizeof(*m->old.slots));
	kvr_u64map_fini(&m->cur);
	kvr_u64map_fini(&m->old);
}

static inline bool zeroing(const struct kvr_ttl_map *m)
{
	return m->old.slots && m->zeroed < m->cur.cap;
}

/* key's entry in the old table (moving phase): one at a slot >= mig, or NULL.  The slots below
 * mig are never read (they may have been given back to the system): a probe that reaches them
 * jumps to mig.  That is exact, since every slot of a probe path was occupied and slots never
 * empty while moving: the path from the home slot to an entry at p >= mig, cut to its slots
 * >= mig, is still unbroken, and it has at most cap - mig slots. */
static struct kvr_u64map_slot *old_find(const struct kvr_ttl_map *m, uint64_t key)
{
	const struct kvr_u64map *o = &m->old;
	if (o->count == 0)
		return NULL;
	size_t mask = o->cap - 1, i = kvr_u64map_home(o, key);
	for (size_t left = o->cap - m->mig; left > 0; left--, i = (i + 1) & mask) {
		if (i < m->mig)
			i = m->mig;
		struct kvr_u64map_slot *s = &o->slots[i];
		if (s->val == KVR_U64MAP_EMPTY)
			return NULL;
		if (s->key == key && s->val != KVR_TTL_MAP_TOMB)
			return s;
	}
	return NULL;
}

struct kvr_u64map_slot *kvr_ttl_map_find_migrating(const struct kvr_ttl_map *m, uint64_t key)
{
	if (zeroing(m)) /* the old table alone, a plain one */
		return kvr_u64map_find_slot(&m->old, key);
	struct kvr_u64map_slot *s = kvr_u64map_find_slot(&m->cur, key);
	return s ? s : old_find(m, key);
}

void kvr_ttl_map_remove_migrating(struct kvr_ttl_map *m, struct kvr_u64map_slot *s)
{
	struct kvr_u64map *o = &m->old;
	if (s < o->slots || s >= o->slots + o->cap) {
		kvr_u64map_remove_at(&m->cur, (size_t)(s - m->cur.slots));
	} else if (zeroing(m)) {
		kvr_u64map_remove_at(o, (size_t)(s - o->slots));
	} else { /* no entry may move while the cursor runs */
		s->val = KVR_TTL_MAP_TOMB;
		o->count--;
	}
}

bool kvr_ttl_map_room(const struct kvr_ttl_map *m, size_t extra)
{
	if (!m->old.slots)
		return m->cur.cap && (m->cur.count + extra) * 10 <= m->cur.cap * 7;
	const struct kvr_u64map *t = zeroing(m) ? &m->old : &m->cur;
	return (t->count + extra) * 100 <= t->cap * MAP_HARD;
}

/* Pages of the old table below the cursor go back to the system a slice at a time, so that
 * neither they nor the free at the end land on one call (a 1M-slot table is 16 MB). */
#define RELEASE_SLOTS 4096u

static void release_copied(struct kvr_ttl_map *m)
{
	if (m->mig - m->released < RELEASE_SLOTS)
		return;
	struct kvr_u64map_slot *from = m->old.slots + m->released;
	size_t n = (m->mig - m->released) * sizeof(*from);
	m->released += kvr_alloc_discard(from, n) / sizeof(*from);
	/* AddressSanitizer builds: a read below the cursor is reported (it must never happen) */
	ASAN_POISON_MEMORY_REGION(from, n);
}

/* Ends a migration: the old table holds no entry. */
static void mig_done(struct kvr_ttl_map *m)
{
	ASAN_UNPOISON_MEMORY_REGION(m->old.slots, m->old.cap * sizeof(*m->old.slots));
	kvr_u64map_fini(&m->old);
	m->mig = m->step = 0;
	m->credit = 0;
}

/* Phase 2's pace, set when the new table becomes usable: the old table's slots to scan and
 * entries to copy over the inserts the new one takes before MAP_HARD.  What it will hold is at
 * most what it holds now, plus the held blocks' entries still in the old table (at most every
 * held block: stale entries are dropped, not copied), plus the inserts. */
static void pace_moving(struct kvr_ttl_map *m)
{
	size_t units = m->old.cap - m->mig + m->old.count;
	size_t copy = m->held && *m->held < m->old.count ? *m->held : m->old.count;
	size_t lim = m->cur.cap * MAP_HARD / 100, used = m->cur.count + copy;
	if (lim <= used) /* no slack (NEVER for a growth): the rest now */
		m->credit = INT64_MAX / 4;
	else
		m->step = units / (lim - used) + 1 + STEP_MIN;
}

void kvr_ttl_map_step(struct kvr_ttl_map *m, size_t units)
{
	if (!m->old.slots)
		return;
	const int64_t cap = INT64_MAX / 4;
	m->credit = units >= (size_t)cap || m->credit + (int64_t)units >= cap
	                ? cap
	                : m->credit + (int64_t)units;
	const int64_t start = m->credit;
	struct kvr_u64map *o = &m->old, *c = &m->cur;
	while (m->credit > 0) {
		if (m->zeroed < c->cap) { /* phase 1: make the new table usable */
			size_t n = (size_t)m->credit * KVR_TTL_MAP_ZERO;
			if (n > ZERO_CHUNK)
				n = ZERO_CHUNK;
			if (n > c->cap - m->zeroed)
				n = c->cap - m->zeroed;
			for (size_t i = 0; i < n; i++)
				c->slots[m->zeroed + i].val = KVR_U64MAP_EMPTY;
			m->zeroed += n;
			m->credit -= (int64_t)(n / KVR_TTL_MAP_ZERO) + 1;
			if (m->zeroed == c->cap)
				pace_moving(m);
			continue;
		}
		if (o->count == 0 || m->mig >= o->cap)
			break;
		/* phase 2: a run of slots, a unit each and one more per entry copied */
		size_t i = m->mig,
		       end = o->cap - i < (size_t)m->credit ? o->cap : i + (size_t)m->credit;
		int64_t copied = 0;
		for (; i < end && o->count; i++) {
			const struct kvr_u64map_slot *s = &o->slots[i];
			if (s->val >= KVR_TTL_MAP_TOMB) /* empty, or removed */
				continue;
			o->count--;
			if (!m->live || m->live(m->ctx, s)) {
				kvr_u64map_insert_tag(c, s->key, s->val, s->spare);
				copied++;
				if (end > i + 1)
					end--;
			}
		}
		m->credit -= (int64_t)(i - m->mig) + copied;
		m->mig = i;
		release_copied(m);
	}
	size_t did = (size_t)(start - m->credit);
	if (did > m->max_units)
		m->max_units = did;
	if (m->zeroed == c->cap && (o->count == 0 || m->mig >= o->cap))
		mig_done(m);
}

int kvr_ttl_map_start(struct kvr_ttl_map *m, size_t cap, size_t extra)
{
	struct kvr_u64map_slot *s = kvr_alloc(cap * sizeof(*s));
	if (!s)
		return KVR_ENOMEM;
	m->migrations++;
	struct kvr_u64map n = {
	    .slots = s, .cap = cap, .count = 0, .shift = 64u - (unsigned)__builtin_ctzll(cap)};
	if (m->cur.count == 0) { /* nothing to move: an empty (or no) table, at once */
		kvr_u64map_fini(&m->cur);
		m->cur = n;
		kvr_u64map_clear(&m->cur);
		m->zeroed = cap;
		return 0;
	}
	m->old = m->cur;
	m->cur = n;
	m->zeroed = m->mig = m->released = 0;
	m->credit = 0;
	/* Phase 1's pace (essay): slices to zero over the inserts the old table takes before
	 * MAP_HARD, counting this call's `extra`; phase 2's is set when it starts. */
	size_t units = cap / KVR_TTL_MAP_ZERO + 1;
	size_t lim = m->old.cap * MAP_HARD / 100, used = m->old.count + extra;
	if (lim <= used) { /* more inserts than the slack: all at once (NEVER by the pace) */
		kvr_ttl_map_step(m, SIZE_MAX);
		return 0;
	}
	m->step = units / (lim - used) + 1 + STEP_MIN;
	return 0;
}
