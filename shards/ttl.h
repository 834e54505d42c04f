/*
 * shards/ttl.h - TTL retention of one rank (issue 5, part B): the baseline predictor, and the
 * fallback for a rank whose capacity is unknown.  A routed block is remembered for ttl_ns;
 * routing it again refreshes it; expiry removes it from the index.  Kept in runs of consecutive
 * blocks of one chain (ttl.c): a record costs O(runs it touches * log) plus its new blocks, an
 * expiry O(runs expired) plus copying their hashes out (their map entries go stale, dropped
 * later: ttl.c, "Lazy deletion").
 * Inputs must be chained sequence hashes (core/hash: a hash names its whole prefix, so one
 * hash is never at two positions of one input), as shards/lru.h requires.
 *
 * Outputs use struct kvr_lru_out (shards/lru.h): each command resets it, then the stored runs
 * are the ranges of the input b[] whose hashes became present (a range with first == 0 hangs
 * below the block before start_pos, or the root at position 0), the evicted runs the hashes
 * that expired, each run a chain (parent first).  Unlike the LRU's, TTL evicted runs need not
 * be tails: a block refreshed by output can outlive its parent, as it always could under TTL.
 * Context (all functions): the shard thread that owns the instance; no locks, no atomics.
 */
#ifndef KVR_SHARDS_TTL_H
#define KVR_SHARDS_TTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shards/lru.h"

/* Default expiry bucket: expiries are rounded up to a multiple of it. */
#define KVR_TTL_BUCKET_NS (100ull * 1000 * 1000)

struct kvr_ttl;

/* Creates an empty store.  ttl_ns > 0; bucket_ns 0 = exact expiries (no rounding).
 * Returns 0, KVR_EINVAL or KVR_ENOMEM. */
int kvr_ttl_create(uint64_t ttl_ns, uint64_t bucket_ns, struct kvr_ttl **out);
/* NULL is a no-op. */
void kvr_ttl_destroy(struct kvr_ttl *ttl);

/*
 * Records blocks b[0..n) (borrowed) routed at time now, at positions start_pos + i: each expires
 * at round_up(now + ttl, bucket) (never earlier than an expiry already recorded, so a clock that
 * steps back cannot reorder the queue); a block already present is refreshed.
 * Returns 0, KVR_EINVAL, KVR_ERANGE (2^32-2 entries), KVR_ENOMEM (nothing changed).
 */
int kvr_ttl_record(struct kvr_ttl *ttl, const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                   uint64_t now, struct kvr_lru_out *out);

/* Removes every entry whose expiry is <= now, reporting them as evicted runs (oldest first).
 * Returns 0, KVR_EINVAL, KVR_ENOMEM (nothing changed). */
int kvr_ttl_expire(struct kvr_ttl *ttl, uint64_t now, struct kvr_lru_out *out);

/* The earliest expiry in the store (when to run kvr_ttl_expire next), UINT64_MAX if empty. */
uint64_t kvr_ttl_next_expiry(const struct kvr_ttl *ttl);

/* How many leading hashes of seq[0..n) are present. */
size_t kvr_ttl_overlap(const struct kvr_ttl *ttl, const uint64_t *seq, size_t n);

/* Whether the block seq is present at position pos of its chain (O(1) with the position). */
bool kvr_ttl_holds_at(const struct kvr_ttl *ttl, uint64_t seq, uint32_t pos);

/* Entries present. */
size_t kvr_ttl_count(const struct kvr_ttl *ttl);

/* The expiry and position of a present hash: 0, or KVR_ENOENT.  O(length of its run): for
 * tests and tools. */
int kvr_ttl_lookup(const struct kvr_ttl *ttl, uint64_t seq, uint64_t *expiry, uint32_t *pos);

/* The map's state, for tests and benchmarks. */
struct kvr_ttl_stats {
	size_t map_entries;    /* entries in the map: one per held block, plus stale ones */
	size_t map_slots;      /* slots allocated (both tables while growing) */
	size_t pending;        /* hashes of expired runs whose map entries may remain */
	uint64_t growths;      /* migrations of the map started since create */
	size_t max_step_units; /* most units of migration work one call did (shards/ttl_map.c) */
	bool growing;          /* a migration is under way */
};
void kvr_ttl_stats(const struct kvr_ttl *ttl, struct kvr_ttl_stats *out);

/* Units of map migration every record and expiry pays besides its new blocks' share (64);
 * tests set it low so that tables stay mid-migration longer. */
extern size_t kvr_ttl_mig_per_call;
/* Whether records bury expired runs' map entries (true); tests turn it off so that stale
 * entries fill a table, which then purges them by migrating at the same size. */
extern bool kvr_ttl_bury_on;

/* Checks every invariant of the store, O(table): for tests.  Returns 0, or the source line
 * (> 0) of the first invariant found broken. */
int kvr_ttl_check(const struct kvr_ttl *ttl);

#endif /* KVR_SHARDS_TTL_H */
