/*
 * shards/lease.h - request leases: attempt ids, the CLOCK reaper, exactly-once claim (issue 5,
 * part C).  See lease.c for the algorithm.
 *
 * A lease table belongs to one shard thread (the owner): begin, end, find and scan run there.
 * touch, claim and state may run on ANY thread, given the handle (slot, attempt) that begin
 * returned: finish, abort and expiry race through claim, and exactly one of them wins.
 */
#ifndef KVR_SHARDS_LEASE_H
#define KVR_SHARDS_LEASE_H

#include <stddef.h>
#include <stdint.h>

/* Clock states of a live lease (0 is a free slot). */
enum kvr_lease_state {
	KVR_LEASE_QUIET = 1,   /* no progress since the last scan */
	KVR_LEASE_TOUCHED = 2, /* progress since the last scan (new leases start here) */
	KVR_LEASE_CLAIMED = 3, /* finished, aborted or expired: one claimer cleans up */
};

/* Attempt ids are below this bound (two bits of the slot word hold the state). */
#define KVR_ATTEMPT_MAX (UINT64_C(1) << 62)
/* Most live leases per table (1024 chunks of 4096 slots). */
#define KVR_LEASE_MAX_SLOTS (1024u * 4096u)

/* The router-wide attempt id source: ids 1, 2, 3, ... never reused for the router's life. */
struct kvr_attempt_ids {
	uint64_t next;
};

/* Context: single-threaded setup. */
void kvr_attempt_ids_init(struct kvr_attempt_ids *ids);
/* A fresh attempt id, or 0 once 2^62 - 1 ids have been issued.
 * Context: any thread.  Ordering: relaxed fetch-add (ids need uniqueness, not order). */
uint64_t kvr_attempt_id_next(struct kvr_attempt_ids *ids);

struct kvr_lease_table;

/* One expired attempt reported by a scan (the scan claimed it: the owner must clean up). */
struct kvr_lease_expired {
	uint64_t attempt;
	uint32_t slot;
};

/* Creates a table whose reaper scans every scan_interval_ns (> 0; the first scan is due at
 * now + interval).  Returns 0, KVR_EINVAL or KVR_ENOMEM.  Context: any thread (setup). */
int kvr_lease_table_create(uint64_t scan_interval_ns, uint64_t now, struct kvr_lease_table **out);
/* Frees the table.  No other thread may use a handle after this.  NULL is a no-op. */
void kvr_lease_table_destroy(struct kvr_lease_table *t);

/*
 * Starts a lease for attempt (1 <= attempt < KVR_ATTEMPT_MAX) in state TOUCHED; *slot receives
 * the handle's slot, which other threads pass to touch/claim with the attempt.
 * Returns 0, KVR_EINVAL, KVR_EEXIST (attempt live here), KVR_ERANGE (table full), KVR_ENOMEM.
 * Context: owner thread.  Ordering: release store of the slot word; pairs with the acquire
 * loads in kvr_lease_claim() / kvr_lease_touch().
 */
int kvr_lease_begin(struct kvr_lease_table *t, uint64_t attempt, uint32_t *slot);

/*
 * Progress on the attempt (prefill done, output): QUIET -> TOUCHED; TOUCHED stays.
 * Returns 0, KVR_ESTALE (claimed, ended, or the slot now holds another attempt), KVR_ENOENT
 * (slot never allocated), KVR_EINVAL.
 * Context: any thread.  Ordering: relaxed (a touch publishes no data); does not write when
 * already TOUCHED, so frequent touches cost one shared load.
 */
int kvr_lease_touch(struct kvr_lease_table *t, uint32_t slot, uint64_t attempt);

/*
 * Claims the attempt for cleanup: finish, abort and expiry all call this (expiry through
 * scan); exactly one caller gets 0, every other (and every later call) gets KVR_ESTALE and must
 * change nothing.  KVR_ENOENT for a slot never allocated, KVR_EINVAL for bad arguments.
 * Context: any thread.  Ordering: acq_rel CAS on the slot word; pairs with the release store
 * in kvr_lease_begin() and with the other claimers' CAS.
 */
int kvr_lease_claim(struct kvr_lease_table *t, uint32_t slot, uint64_t attempt);

/* The clock state of (slot, attempt) (enum kvr_lease_state), or KVR_ESTALE / KVR_ENOENT /
 * KVR_EINVAL.  Context: any thread.  Ordering: acquire load. */
int kvr_lease_state(struct kvr_lease_table *t, uint32_t slot, uint64_t attempt);

/*
 * Frees the slot of a CLAIMED attempt once its cleanup is done; the attempt's handle becomes
 * stale forever.  Returns 0, KVR_ENOENT (not live here), KVR_EBUSY (not claimed yet).
 * Context: owner thread.
 */
int kvr_lease_end(struct kvr_lease_table *t, uint64_t attempt);

/* The slot of a live attempt.  Returns 0, KVR_ESTALE (an attempt this table began and has
 * ended), KVR_ENOENT (never begun here).  Context: owner thread. */
int kvr_lease_find(const struct kvr_lease_table *t, uint64_t attempt, uint32_t *slot);

/*
 * One reaper pass (the CLOCK hand): TOUCHED -> QUIET, QUIET -> CLAIMED.  Every lease it claims
 * (expired: idle for a whole interval) is written to exp[] and counted in *n_out; the owner then
 * cleans up and calls kvr_lease_end.  At most max are claimed per pass; the rest stay QUIET and
 * expire on a later pass.  Returns 0 or KVR_EINVAL.
 * Context: owner thread.  Ordering: acq_rel CAS, like kvr_lease_claim().
 */
int kvr_lease_scan(struct kvr_lease_table *t, struct kvr_lease_expired *exp, size_t max,
                   size_t *n_out);

/* Runs kvr_lease_scan if a scan is due at now (and schedules the next one at now + interval);
 * else *n_out = 0.  Context: owner thread. */
int kvr_lease_tick(struct kvr_lease_table *t, uint64_t now, struct kvr_lease_expired *exp,
                   size_t max, size_t *n_out);

/* Live leases (begun, not ended).  Context: owner thread. */
size_t kvr_lease_count(const struct kvr_lease_table *t);

#endif /* KVR_SHARDS_LEASE_H */
