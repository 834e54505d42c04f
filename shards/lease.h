/*
 * shards/lease.h - request leases: attempt ids minted on any thread, the exactly-once claim, and
 * the CLOCK states the reaper walks.  See lease.c for the algorithm.
 *
 * One table per router.  An attempt id names its lease word (the word's index is the id's
 * sequence number modulo the table size), so every call (mint, touch, claim, state, release)
 * works on ANY thread with no lookup and no lock: finish, abort and expiry race through claim,
 * and exactly one of them wins.
 */
#ifndef KVR_SHARDS_LEASE_H
#define KVR_SHARDS_LEASE_H

#include <stddef.h>
#include <stdint.h>

/* Clock states of a live lease (0 is a free word). */
enum kvr_lease_state {
	KVR_LEASE_QUIET = 1,   /* no progress since the last scan */
	KVR_LEASE_TOUCHED = 2, /* progress since the last scan (new leases start here) */
	KVR_LEASE_CLAIMED = 3, /* finished, aborted or expired: one claimer cleans up */
};

/* Attempt ids: (sequence << KVR_LEASE_TAG_BITS) | tag, below 2^62 (two bits of the word hold
 * the state).  The router's tag is the rank slot. */
#define KVR_LEASE_TAG_BITS 16u
#define KVR_LEASE_TAG_MASK ((1u << KVR_LEASE_TAG_BITS) - 1u)
#define KVR_ATTEMPT_MAX    (UINT64_C(1) << 62)
#define KVR_LEASE_SEQ_MAX  (KVR_ATTEMPT_MAX >> KVR_LEASE_TAG_BITS)
/* Lease words per table: the most attempts live at once (a little less: see mint). */
#define KVR_LEASE_WORDS (1u << 20)

struct kvr_leases;

/* Creates an empty table (words are allocated in 4096-word chunks as sequence numbers reach
 * them: 32 KiB each, 8 MiB at most, of which pages of free words are given back as the
 * sequence moves on).  Returns 0, KVR_EINVAL or KVR_ENOMEM.  Context: setup. */
int kvr_leases_create(struct kvr_leases **out);
/* Frees the table; no thread may use it after.  NULL is a no-op. */
void kvr_leases_destroy(struct kvr_leases *t);
/* Bytes of the table's word pages resident in memory (mincore), for tests and benchmarks: the
 * minters give back the pages of free words behind them (lease.c).  Context: any thread. */
size_t kvr_leases_resident_bytes(const struct kvr_leases *t);

/*
 * Mints a fresh attempt id with the given tag (< 2^KVR_LEASE_TAG_BITS) and starts its lease in
 * state TOUCHED.  Ids are never reused.  Returns 0 and *attempt, KVR_ERANGE (the 2^46 sequence
 * numbers are used up), KVR_EAGAIN (64 consecutive words still held by live attempts: about
 * KVR_LEASE_WORDS attempts are live), KVR_ENOMEM (a chunk could not be allocated), KVR_EINVAL.
 * Context: any thread.  Ordering: relaxed fetch-add of the sequence; acq_rel CAS of the word
 * from free (0), pairing with the release store in kvr_lease_release()/kvr_lease_unmint().
 */
int kvr_lease_mint(struct kvr_leases *t, uint32_t tag, uint64_t *attempt);

/* Asks for the cache line of the word the next mint will try, for writing (a hint: nothing
 * changes; with several minters another may take that number first).  The words are used in
 * sequence, eight to a line, and the shard that released the previous attempt of a line last
 * wrote it, so a mint otherwise waits for that line.  Context: any thread.  Ordering: a relaxed
 * load of the sequence and the directory entry (a chunk not yet allocated: no hint). */
void kvr_lease_prefetch_next(struct kvr_leases *t);

/* Takes back a lease nobody was told about (the minter's admission failed): its word becomes
 * free and the id stale.  Returns 0 or KVR_ESTALE (claimed meanwhile: the claimer owns it).
 * Context: any thread.  Ordering: acq_rel CAS. */
int kvr_lease_unmint(struct kvr_leases *t, uint64_t attempt);

/*
 * Progress on the attempt (prefill done, output): QUIET -> TOUCHED; TOUCHED stays.
 * Returns 0, KVR_ESTALE (claimed, ended, never issued), KVR_EINVAL.
 * Context: any thread.  Ordering: relaxed (a touch publishes no data); does not write when
 * already TOUCHED, so frequent touches cost one shared load.
 */
int kvr_lease_touch(struct kvr_leases *t, uint64_t attempt);

/*
 * Claims the attempt for cleanup: finish, abort, expiry and a rank's end all call this; exactly
 * one caller gets 0, every other (and every later call) gets KVR_ESTALE and must change
 * nothing.  KVR_EINVAL for a bad id.
 * Context: any thread.  Ordering: acq_rel CAS on the word; pairs with mint and other claimers.
 */
int kvr_lease_claim(struct kvr_leases *t, uint64_t attempt);

/* The CLOCK state of the attempt (enum kvr_lease_state), or KVR_ESTALE / KVR_EINVAL.
 * Context: any thread.  Ordering: acquire load. */
int kvr_lease_state(struct kvr_leases *t, uint64_t attempt);

/*
 * One reaper step for a live attempt (the CLOCK hand): TOUCHED -> QUIET (returns
 * KVR_LEASE_QUIET), QUIET -> CLAIMED (returns KVR_LEASE_CLAIMED: expired, this caller won the
 * claim and cleans up), already CLAIMED by someone else (returns 0: a claimer's cleanup is on
 * its way, or lost: the caller may clean up), KVR_ESTALE if the word holds another attempt.
 * Context: the thread that owns the attempt's cleanup.  Ordering: acq_rel CAS.
 */
int kvr_lease_age(struct kvr_leases *t, uint64_t attempt);

/* Frees the word of a CLAIMED attempt once its cleanup is done; the id is stale forever.
 * Returns 0, KVR_EBUSY (not claimed), KVR_ESTALE (not this attempt's word any more).
 * Context: the thread that owns the cleanup.  Ordering: release store. */
int kvr_lease_release(struct kvr_leases *t, uint64_t attempt);

#endif /* KVR_SHARDS_LEASE_H */
