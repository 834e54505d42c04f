/*
 * shards/u64map.h - a small open-addressing map from a 64-bit key to a 32-bit value, for the
 * single-threaded per-rank state machines (LRU copies by hash, leases by attempt, load refcounts).
 *
 * Why not ck_hs / ck_ht: those are SPMC tables built for concurrent readers (tombstones, version
 * counters, a garbage-collection pass).  Everything here is owned by one shard thread, so a plain
 * linear-probing table is smaller and faster: 16-byte slots, load factor <= 0.7, deletion by
 * backward shift (no tombstones, so probe lengths never degrade).  Every key is valid (a chained
 * XXH3 hash may be 0); an empty slot is marked by the value KVR_U64MAP_EMPTY, which callers never
 * store.
 *
 * Failure model: only kvr_u64map_reserve() allocates.  Callers reserve room for everything a
 * command may insert before they change any state, so a command either fails with KVR_ENOMEM
 * having changed nothing, or succeeds.
 * Context: all functions: the owning thread only; no locks, no atomics.
 */
#ifndef KVR_SHARDS_U64MAP_H
#define KVR_SHARDS_U64MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/alloc.h"
#include "core/place.h"
#include "kvrouter.h"

#define KVR_U64MAP_EMPTY UINT32_MAX

struct kvr_u64map_slot {
	uint64_t key;
	uint32_t val; /* KVR_U64MAP_EMPTY = free slot */
	uint32_t spare;
};

struct kvr_u64map {
	struct kvr_u64map_slot *slots;
	size_t cap; /* power of two, or 0 */
	size_t count;
	unsigned shift; /* 64 - log2(cap) */
};

static inline void kvr_u64map_init(struct kvr_u64map *m)
{
	m->slots = NULL;
	m->cap = 0;
	m->count = 0;
	m->shift = 64;
}

static inline void kvr_u64map_fini(struct kvr_u64map *m)
{
	kvr_free(m->slots, m->cap * sizeof(*m->slots));
	kvr_u64map_init(m);
}

/* Multiply-shift by the process's placement key (core/place.h: the keys are often block hashes
 * a prompt chooses) after a fold (tests use 1, 2, 3). */
static inline size_t kvr_u64map_home(const struct kvr_u64map *m, uint64_t key)
{
	key ^= key >> 29;
	return (size_t)(kvr_place(key) >> m->shift);
}

/* The slot of key (its value and spare word), or NULL.  Valid until the next insert, remove or
 * reserve. */
static inline struct kvr_u64map_slot *kvr_u64map_find_slot(const struct kvr_u64map *m, uint64_t key)
{
	if (m->count == 0)
		return NULL;
	size_t mask = m->cap - 1, i = kvr_u64map_home(m, key);
	for (;;) {
		struct kvr_u64map_slot *s = &m->slots[i];
		if (s->val == KVR_U64MAP_EMPTY)
			return NULL;
		if (s->key == key)
			return s;
		i = (i + 1) & mask;
	}
}

/* The value slot of key, or NULL. */
static inline uint32_t *kvr_u64map_find(const struct kvr_u64map *m, uint64_t key)
{
	struct kvr_u64map_slot *s = kvr_u64map_find_slot(m, key);
	return s ? &s->val : NULL;
}

static inline struct kvr_u64map_slot *kvr_u64map_put_raw(struct kvr_u64map *m, uint64_t key,
                                                         uint32_t val)
{
	size_t mask = m->cap - 1, i = kvr_u64map_home(m, key);
	while (m->slots[i].val != KVR_U64MAP_EMPTY)
		i = (i + 1) & mask;
	m->slots[i].key = key;
	m->slots[i].val = val;
	m->count++;
	return &m->slots[i];
}

/* Inserts a key known to be absent; room must have been reserved.  val != KVR_U64MAP_EMPTY. */
static inline void kvr_u64map_insert(struct kvr_u64map *m, uint64_t key, uint32_t val)
{
	(void)kvr_u64map_put_raw(m, key, val);
}

/* Inserts key unless it is present (room must have been reserved; one probe sequence, as
 * kvr_u64map_insert's).  Returns its new slot (for a tag), or NULL if key was there.
 * val != KVR_U64MAP_EMPTY. */
static inline struct kvr_u64map_slot *kvr_u64map_insert_absent(struct kvr_u64map *m, uint64_t key,
                                                               uint32_t val)
{
	size_t mask = m->cap - 1, i = kvr_u64map_home(m, key);
	for (; m->slots[i].val != KVR_U64MAP_EMPTY; i = (i + 1) & mask)
		if (m->slots[i].key == key)
			return NULL;
	m->slots[i].key = key;
	m->slots[i].val = val;
	m->count++;
	return &m->slots[i];
}

/* kvr_u64map_insert, with a tag in the slot's spare word (shards/ttl.c: a run generation). */
static inline void kvr_u64map_insert_tag(struct kvr_u64map *m, uint64_t key, uint32_t val,
                                         uint32_t tag)
{
	kvr_u64map_put_raw(m, key, val)->spare = tag;
}

/* Moves the map into cap slots (a power of two with room for every kept entry at load <= 0.7),
 * keeping the entries for which keep(ctx, slot) is true (keep NULL: all).  Returns 0 or
 * KVR_ENOMEM (the map is unchanged). */
static inline int kvr_u64map_rebuild(struct kvr_u64map *m, size_t cap,
                                     bool (*keep)(const void *ctx,
                                                  const struct kvr_u64map_slot *slot),
                                     const void *ctx)
{
	struct kvr_u64map_slot *s = kvr_alloc(cap * sizeof(*s));
	if (!s)
		return KVR_ENOMEM;
	for (size_t i = 0; i < cap; i++)
		s[i].val = KVR_U64MAP_EMPTY;
	struct kvr_u64map old = *m;
	m->slots = s;
	m->cap = cap;
	m->count = 0;
	m->shift = 64u - (unsigned)__builtin_ctzll(cap);
	for (size_t i = 0; i < old.cap; i++)
		if (old.slots[i].val != KVR_U64MAP_EMPTY && (!keep || keep(ctx, &old.slots[i])))
			kvr_u64map_insert_tag(m, old.slots[i].key, old.slots[i].val,
			                      old.slots[i].spare);
	kvr_free(old.slots, old.cap * sizeof(*old.slots));
	return 0;
}

/* Makes room for `extra` more keys without further allocation.  Returns 0 or KVR_ENOMEM (the
 * map is unchanged). */
static inline int kvr_u64map_reserve(struct kvr_u64map *m, size_t extra)
{
	size_t need = m->count + extra;
	if (need * 10 <= m->cap * 7)
		return 0;
	size_t cap = m->cap ? m->cap : 16;
	while (need * 10 > cap * 7)
		cap *= 2;
	return kvr_u64map_rebuild(m, cap, NULL, NULL);
}

/* Removes the entry in slot i (occupied) by backward shift: later entries of its cluster may
 * move back, into i among others. */
static inline void kvr_u64map_remove_at(struct kvr_u64map *m, size_t i)
{
	size_t mask = m->cap - 1, j = i;
	for (;;) {
		j = (j + 1) & mask;
		if (m->slots[j].val == KVR_U64MAP_EMPTY)
			break;
		size_t h = kvr_u64map_home(m, m->slots[j].key);
		/* Move slot j back into the hole i unless its home lies cyclically in (i, j]. */
		bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
		if (!stays) {
			m->slots[i] = m->slots[j];
			i = j;
		}
	}
	m->slots[i].val = KVR_U64MAP_EMPTY;
	m->count--;
}

/* Removes key if present.  Returns whether it was present. */
static inline bool kvr_u64map_remove(struct kvr_u64map *m, uint64_t key)
{
	struct kvr_u64map_slot *s = kvr_u64map_find_slot(m, key);
	if (s)
		kvr_u64map_remove_at(m, (size_t)(s - m->slots));
	return s != NULL;
}

/* Removes key if it is present with value val.  Returns whether it removed it. */
static inline bool kvr_u64map_remove_val(struct kvr_u64map *m, uint64_t key, uint32_t val)
{
	struct kvr_u64map_slot *s = kvr_u64map_find_slot(m, key);
	if (!s || s->val != val)
		return false;
	kvr_u64map_remove_at(m, (size_t)(s - m->slots));
	return true;
}

/* Empties the map, keeping its memory. */
static inline void kvr_u64map_clear(struct kvr_u64map *m)
{
	for (size_t i = 0; i < m->cap; i++)
		m->slots[i].val = KVR_U64MAP_EMPTY;
	m->count = 0;
}

#endif /* KVR_SHARDS_U64MAP_H */
