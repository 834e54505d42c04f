/*
 * shards/pinmap.h - every rank's pinned runs, readable by routing threads (issue 11 items 3-4).
 *
 * Each rank's load tracker (shards/load.c) keeps the blocks its live attempts pin as RUNS of
 * consecutive chain blocks, split wherever a request leaves a run, so along any chain a new run
 * starts only right after another run's last block.  The pinmap publishes those runs for
 * kvr_route: one RCU hash table from a run's first sequence hash to the runs (of any rank)
 * starting there.  A router then finds every rank's PINNED DEPTH of a prompt (how many leading
 * blocks of its chain are already pinned there: Dynamo's deduplicated decode load) by walking
 * the prompt run by run, one probe per run boundary, one compare at a run's far end and a binary
 * search inside the run where it differs: O(runs) per rank, no round trip, and no per-block work
 * for the shards (the per-block pinned index it replaces cost a table write per pinned block).
 * See pinmap.c for the ordering argument.
 *
 * Context: writers are shard threads (several at once: one lock per map, held for O(1) per
 * call); readers are any threads inside an RCU read-side section (sync/rcu.h).
 */
#ifndef KVR_SHARDS_PINMAP_H
#define KVR_SHARDS_PINMAP_H

#include <stddef.h>
#include <stdint.h>

#include "sync/rcu.h"

struct kvr_pinmap;

/*
 * One published run of one rank.  head and slot never change; seqs and len change under a
 * split (the left part shrinks, possibly into a copy): written with release stores, len first,
 * then seqs, so a reader that loads seqs then len never reads past the array it loaded.
 * The content of every seqs array is immutable while any run points to it.
 */
struct kvr_pinrun {
	uint64_t head;                 /* seqs[0] */
	uint32_t slot;                 /* the rank's main index slot */
	uint32_t len;                  /* atomic */
	const uint64_t *seqs;          /* atomic */
	struct kvr_pinrun *next;       /* atomic: the next run with this head (another rank) */
	uint64_t *mem;                 /* writer: the array this run owns (freed with it) */
	size_t mem_cap;                /* its capacity, hashes */
	int published;                 /* writer: in the table */
	struct rcu_head rcu;           /* retire: freed after a grace period */
	struct kvr_pinrun *retire_nxt; /* retire: the rest of the batch */
};

/* Creates an empty map.  0, KVR_EINVAL or KVR_ENOMEM. */
int kvr_pinmap_create(struct kvr_pinmap **out);
/* Frees the table.  Every run must have been removed.  Context: no reader left (after the
 * shards stopped and an RCU barrier).  NULL is a no-op. */
void kvr_pinmap_destroy(struct kvr_pinmap *pm);

/* Publishes run r (head, slot, seqs, len set; published == 0).  0 or KVR_ENOMEM (the table
 * could not grow: r stays unpublished, and readers under-count that rank's pinned depth until it
 * goes, which is what the decision did before deduplication existed).
 * Context: a shard thread. */
int kvr_pinmap_add(struct kvr_pinmap *pm, struct kvr_pinrun *r);
/* Unpublishes r (a no-op if it is not published).  Never fails.  Context: a shard thread. */
void kvr_pinmap_del(struct kvr_pinmap *pm, struct kvr_pinrun *r);

/* Published runs now (all ranks).  Context: any thread (a relaxed read). */
size_t kvr_pinmap_runs(const struct kvr_pinmap *pm);

/* A batch of unpublished runs to free (with the arrays they own) after one grace period. */
struct kvr_pinrun_retire {
	struct kvr_pinrun *head;
};
/* Adds r (unpublished) to the batch.  Context: the batch's owner. */
void kvr_pinrun_retire(struct kvr_pinrun_retire *b, struct kvr_pinrun *r);
/* Hands the batch to one call_rcu (no allocation).  Context: an RCU-registered thread (it is
 * made online if needed), outside a read-side section. */
void kvr_pinrun_retire_flush(struct kvr_pinrun_retire *b);

#define KVR_PIN_OPEN 0x80000000u

/*
 * Asks for the table line kvr_pinmap_depths will probe first for a chain starting with seq0: a
 * hint, so that its miss overlaps the caller's other reads (the shards write the table at every
 * pin and unpin, so the line is often another core's).  Context: inside an RCU read-side
 * section; any thread.
 */
void kvr_pinmap_prefetch(const struct kvr_pinmap *pm, uint64_t seq0);

/*
 * Every rank's pinned depth of the chain seq[0..n) (borrowed): depth[slot] (caller's array,
 * zero on entry for every slot) is set for each rank pinning seq[0], and that rank's slot is
 * appended to slots[] (room for every rank).  Returns how many slots were appended; the caller
 * zeroes those depth[] entries before the next call.  Ranks that pin nothing stay 0.
 * Racing a writer, a rank's answer is its depth just before or just after the writer's command
 * (a pin: splits are invisible, the new run appears last), or, racing a finish that unpins
 * several runs one at a time, anything between the two (tests/stress/stress_pinmap.c).
 * Context: inside an RCU read-side section; any thread.  O(runs on the path per rank +
 * log(run length) per rank where it diverges).
 */
size_t kvr_pinmap_depths(const struct kvr_pinmap *pm, const uint64_t *seq, size_t n,
                         uint32_t *depth, uint32_t *slots);

#endif /* KVR_SHARDS_PINMAP_H */
