/*
 * core/place.h - the key of every hash table whose keys a prompt chooses.
 *
 * Why.  Block hashes are public functions of the prompt (XXH3, seed 1337, as Dynamo's), so a
 * table that placed an entry by a fixed function of its hash could be flooded: prompts found
 * offline whose hashes share a table's home bits pile into one probe cluster that every insert
 * and every lookup near it walks (perf/bench_flood: 20,000 crafted prompts made the shard's
 * bookings 13.9x and their lookups 35x slower, and the cost grows with their number).  Each
 * such table multiplies the hash by this key, odd and drawn at random once per process
 * (multiply-shift: for two different hashes, the chance that they share the top b bits of
 * the product is at most 2^(1-b) over the key), and takes its home from the product's top bits.
 * The placement is the only thing the key changes: what a lookup finds, the decisions, the
 * wire and every output are the same in every process.  Tables keyed by what the embedder or
 * the peers give (worker ids, attempt ids) keep their fixed mixes.
 *
 * The key is fixed at its first use (by whichever table is made first, on any thread) and
 * never changes after: a table built with it stays valid for the life of the process,
 * children of fork() included.  Context: any thread.
 */
#ifndef KVR_CORE_PLACE_H
#define KVR_CORE_PLACE_H

#include <stdint.h>

extern uint64_t kvr_place_key_; /* 0 until the first use; then the key for good */

/* Draws the key and publishes it (the first caller's wins); returns it. */
uint64_t kvr_place_key_draw(void);

static inline uint64_t kvr_place_key(void)
{
	uint64_t k = __atomic_load_n(&kvr_place_key_, __ATOMIC_RELAXED);
	return __builtin_expect(k != 0, 1) ? k : kvr_place_key_draw();
}

/* h mixed by the key: take a table's home from the TOP bits of the result. */
static inline uint64_t kvr_place(uint64_t h)
{
	return h * kvr_place_key();
}

/* kvr_place with the key read once by the caller: loops over many hashes hoist it themselves
 * (a compiler keeps an atomic load inside the loop). */
static inline uint64_t kvr_place_k(uint64_t h, uint64_t key)
{
	return h * key;
}

#endif
