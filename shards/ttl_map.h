/*
 * shards/ttl_map.h - the TTL store's hash -> run map (shards/ttl.c, "Finding a block"): a
 * shards/u64map.h table that grows (or purges its stale entries) INCREMENTALLY, a bounded slice
 * per call, so that no TTL call rehashes the whole table (issue 11 item 3).  ttl_map.c's essay
 * says how; the entries' meaning (run id, run generation in the spare word) is ttl.c's.
 * Context (all functions): the shard thread that owns the TTL store; no locks, no atomics.
 */
#ifndef KVR_SHARDS_TTL_MAP_H
#define KVR_SHARDS_TTL_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shards/u64map.h"

/* The value of an old-table slot whose entry was removed while migrating (ttl_map.c); run ids
 * stay below it (shards/ttl.c RUN_MAX). */
#define KVR_TTL_MAP_TOMB (KVR_U64MAP_EMPTY - 1)

/* Whether an entry still names a live block (entries that do not are dropped, not moved). */
typedef bool (*kvr_ttl_map_live_fn)(const void *ctx, const struct kvr_u64map_slot *s);

struct kvr_ttl_map {
	struct kvr_u64map cur; /* the table; while migrating, the new one */
	struct kvr_u64map old; /* while migrating: the table being emptied (slots NULL otherwise) */
	size_t zeroed;         /* slots of cur made empty; cur is in use once zeroed == cur.cap */
	size_t mig;            /* old's entries below slot mig are copied (the copies count) */
	size_t released;       /* old's slots below it are given back to the system (unreadable) */
	size_t step;           /* units of migration per key inserted */
	int64_t credit;        /* units paid and not done yet (negative: done ahead) */
	uint64_t migrations;   /* started since init (stats) */
	size_t max_units;      /* most units one kvr_ttl_map_step() did (stats) */
	kvr_ttl_map_live_fn live;
	const void *ctx;
	const size_t *held; /* the store's held blocks (bounds the entries a migration copies) */
};

/* An empty map; live(ctx, slot) decides which entries a migration keeps; *held (borrowed for
 * the map's life, NULL: unknown) counts the held blocks, which the pace uses. */
void kvr_ttl_map_init(struct kvr_ttl_map *m, kvr_ttl_map_live_fn live, const void *ctx,
                      const size_t *held);
void kvr_ttl_map_fini(struct kvr_ttl_map *m);

static inline bool kvr_ttl_map_migrating(const struct kvr_ttl_map *m)
{
	return m->old.slots != NULL;
}

/* Entries in both tables (live and stale). */
static inline size_t kvr_ttl_map_count(const struct kvr_ttl_map *m)
{
	return m->cur.count + m->old.count;
}

struct kvr_u64map_slot *kvr_ttl_map_find_migrating(const struct kvr_ttl_map *m, uint64_t key);

/* The slot of key in whichever table holds it (a key is in one at most), or NULL.  Valid until
 * the next insert, remove, step or reserve. */
static inline struct kvr_u64map_slot *kvr_ttl_map_find(const struct kvr_ttl_map *m, uint64_t key)
{
	if (__builtin_expect(m->old.slots == NULL, 1))
		return kvr_u64map_find_slot(&m->cur, key);
	return kvr_ttl_map_find_migrating(m, key);
}

/* Inserts key (absent from both tables) with value val and tag; room must have been reserved
 * (kvr_ttl_map_room). */
static inline void kvr_ttl_map_insert(struct kvr_ttl_map *m, uint64_t key, uint32_t val,
                                      uint32_t tag)
{
	/* While the new table is being zeroed, the old one takes inserts. */
	struct kvr_u64map *t = m->old.slots && m->zeroed < m->cur.cap ? &m->old : &m->cur;
	kvr_u64map_insert_tag(t, key, val, tag);
}

/* kvr_ttl_map_insert unless key is in either table (live or stale): returns whether it
 * inserted.  One probe sequence when not migrating, as kvr_ttl_map_insert's. */
static inline bool kvr_ttl_map_insert_absent(struct kvr_ttl_map *m, uint64_t key, uint32_t val,
                                             uint32_t tag)
{
	if (__builtin_expect(m->old.slots == NULL, 1)) {
		struct kvr_u64map_slot *s = kvr_u64map_insert_absent(&m->cur, key, val);
		if (s)
			s->spare = tag;
		return s != NULL;
	}
	if (kvr_ttl_map_find_migrating(m, key))
		return false;
	kvr_ttl_map_insert(m, key, val, tag);
	return true;
}

void kvr_ttl_map_remove_migrating(struct kvr_ttl_map *m, struct kvr_u64map_slot *s);

/* Removes the entry in slot s (as kvr_ttl_map_find returned it). */
static inline void kvr_ttl_map_remove_slot(struct kvr_ttl_map *m, struct kvr_u64map_slot *s)
{
	if (__builtin_expect(m->old.slots == NULL, 1))
		kvr_u64map_remove_at(&m->cur, (size_t)(s - m->cur.slots));
	else
		kvr_ttl_map_remove_migrating(m, s);
}

/* Whether `extra` more keys fit without starting a migration (or, while migrating, without
 * passing the hard limit the migration's pace is sized for). */
bool kvr_ttl_map_room(const struct kvr_ttl_map *m, size_t extra);

/* Pays `units` of migration work (one per old slot scanned, one per entry moved, one per
 * KVR_TTL_MAP_ZERO slots zeroed); SIZE_MAX finishes it.  A no-op when not migrating. */
void kvr_ttl_map_step(struct kvr_ttl_map *m, size_t units);

/* Units a call that inserts `keys` keys pays while migrating. */
static inline size_t kvr_ttl_map_due(const struct kvr_ttl_map *m, size_t keys)
{
	return m->step * keys;
}

/*
 * Starts moving the map into a table of cap slots (a power of two, not migrating now), for
 * `extra` keys about to be inserted and `live` live entries: the new table is allocated here
 * and zeroed, then filled, by later steps; entries live() rejects are dropped on the way.
 * Returns 0 or KVR_ENOMEM (nothing changed).
 */
int kvr_ttl_map_start(struct kvr_ttl_map *m, size_t cap, size_t extra);

/* Slots held (both tables), for memory counts. */
static inline size_t kvr_ttl_map_slots(const struct kvr_ttl_map *m)
{
	return m->cur.cap + m->old.cap;
}

#endif /* KVR_SHARDS_TTL_MAP_H */
