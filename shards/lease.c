/*
 * shards/lease.c - request leases (issue 5, part C).
 *
 * The idea.  An attempt that goes silent (a client vanished, a finish message lost) must not pin
 * blocks and load forever.  A CLOCK-style reaper, as in page replacement: each live lease has a
 * state QUIET, TOUCHED or CLAIMED.  Progress sets TOUCHED; the reaper scan, every interval,
 * turns TOUCHED into QUIET and QUIET into CLAIMED (= expired).  So an idle attempt is reclaimed
 * after one to two intervals, with no per-request timer and no timestamp writes on the hot path.
 *
 * Exactly once.  finish and abort arrive from frontend threads, expiry from the owner's scan;
 * they can race.  Each lease's state lives in one 64-bit word: (attempt << 2) | state.  A
 * claimer CASes it from (attempt, QUIET|TOUCHED) to (attempt, CLAIMED): one CAS succeeds, every
 * other sees CLAIMED (or a different attempt) and gets KVR_ESTALE.  Putting the attempt id into
 * the word makes slot reuse safe against ABA: attempt ids are never reused, so a stale handle
 * (slot, old attempt) can never match a recycled slot.
 *
 * Memory safety for other threads: slot words live in fixed 4096-slot chunks that are never
 * moved or freed before the table is destroyed; the chunk directory is a fixed array whose
 * entries are published once (release) and read with acquire.  So touch/claim/state from any
 * thread only ever read valid memory, without RCU or reference counts.
 *
 * Owner-only parts: the attempt -> slot map (shards/u64map.h), the free-slot stack, the scan.
 */
#include "shards/lease.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/u64map.h"

#define CHUNK_SHIFT 12u
#define CHUNK_SLOTS (1u << CHUNK_SHIFT)
#define MAX_CHUNKS  (KVR_LEASE_MAX_SLOTS / CHUNK_SLOTS)
#define STATE_MASK  UINT64_C(3)

struct kvr_lease_table {
	uint64_t *dir[MAX_CHUNKS]; /* published once each; words accessed atomically */
	uint32_t n_chunks;
	uint32_t high; /* slots ever handed out: [0, high) */
	uint32_t *free_slots;
	uint32_t n_free, free_cap;
	struct kvr_u64map live; /* attempt -> slot */
	uint64_t max_attempt;   /* largest attempt ever begun here */
	uint64_t interval, next_scan;
};

void kvr_attempt_ids_init(struct kvr_attempt_ids *ids)
{
	ids->next = 1;
}

uint64_t kvr_attempt_id_next(struct kvr_attempt_ids *ids)
{
	uint64_t id = __atomic_fetch_add(&ids->next, 1, __ATOMIC_RELAXED);
	return id < KVR_ATTEMPT_MAX ? id : 0;
}

int kvr_lease_table_create(uint64_t scan_interval_ns, uint64_t now, struct kvr_lease_table **out)
{
	if (!out || scan_interval_ns == 0)
		return KVR_EINVAL;
	struct kvr_lease_table *t = kvr_calloc(1, sizeof(*t));
	if (!t)
		return KVR_ENOMEM;
	kvr_u64map_init(&t->live);
	t->interval = scan_interval_ns;
	t->next_scan = now + scan_interval_ns;
	*out = t;
	return 0;
}

void kvr_lease_table_destroy(struct kvr_lease_table *t)
{
	if (!t)
		return;
	for (uint32_t i = 0; i < t->n_chunks; i++)
		kvr_free(t->dir[i], CHUNK_SLOTS * sizeof(uint64_t));
	kvr_free(t->free_slots, t->free_cap * sizeof(uint32_t));
	kvr_u64map_fini(&t->live);
	kvr_free(t, sizeof(*t));
}

/* The word of a slot, or NULL if its chunk does not exist.  Context: any thread.
 * Ordering: acquire load of the directory entry; pairs with the release store in new_slot(). */
static uint64_t *word_of(struct kvr_lease_table *t, uint32_t slot)
{
	if (slot >= KVR_LEASE_MAX_SLOTS)
		return NULL;
	uint64_t *chunk = __atomic_load_n(&t->dir[slot >> CHUNK_SHIFT], __ATOMIC_ACQUIRE);
	return chunk ? &chunk[slot & (CHUNK_SLOTS - 1)] : NULL;
}

static int new_slot(struct kvr_lease_table *t, uint32_t *slot)
{
	if (t->n_free > 0) {
		*slot = t->free_slots[--t->n_free];
		return 0;
	}
	if (t->high == KVR_LEASE_MAX_SLOTS)
		return KVR_ERANGE;
	if ((t->high >> CHUNK_SHIFT) == t->n_chunks) {
		uint64_t *chunk = kvr_calloc(CHUNK_SLOTS, sizeof(uint64_t));
		if (!chunk)
			return KVR_ENOMEM;
		__atomic_store_n(&t->dir[t->n_chunks++], chunk, __ATOMIC_RELEASE);
	}
	*slot = t->high++;
	return 0;
}

int kvr_lease_begin(struct kvr_lease_table *t, uint64_t attempt, uint32_t *slot)
{
	if (!t || !slot || attempt == 0 || attempt >= KVR_ATTEMPT_MAX)
		return KVR_EINVAL;
	if (kvr_u64map_find(&t->live, attempt))
		return KVR_EEXIST;
	/* The free stack must be able to take this slot back at end() without allocating. */
	if (t->free_cap < t->high + 1) {
		size_t nc = t->free_cap ? (size_t)t->free_cap * 2 : 256;
		uint32_t *p = kvr_realloc(t->free_slots, t->free_cap * sizeof(uint32_t),
		                          nc * sizeof(uint32_t));
		if (!p)
			return KVR_ENOMEM;
		t->free_slots = p;
		t->free_cap = (uint32_t)nc;
	}
	int rc = kvr_u64map_reserve(&t->live, 1);
	if (rc)
		return rc;
	uint32_t s;
	if ((rc = new_slot(t, &s)))
		return rc;
	kvr_u64map_insert(&t->live, attempt, s);
	if (attempt > t->max_attempt)
		t->max_attempt = attempt;
	__atomic_store_n(word_of(t, s), (attempt << 2) | KVR_LEASE_TOUCHED, __ATOMIC_RELEASE);
	*slot = s;
	return 0;
}

int kvr_lease_touch(struct kvr_lease_table *t, uint32_t slot, uint64_t attempt)
{
	if (!t || attempt == 0 || attempt >= KVR_ATTEMPT_MAX)
		return KVR_EINVAL;
	uint64_t *w = word_of(t, slot);
	if (!w)
		return KVR_ENOENT;
	uint64_t cur = __atomic_load_n(w, __ATOMIC_RELAXED);
	for (;;) {
		if ((cur >> 2) != attempt || (cur & STATE_MASK) == KVR_LEASE_CLAIMED)
			return KVR_ESTALE;
		if ((cur & STATE_MASK) == KVR_LEASE_TOUCHED)
			return 0;
		if (__atomic_compare_exchange_n(w, &cur, (attempt << 2) | KVR_LEASE_TOUCHED, false,
		                                __ATOMIC_RELAXED, __ATOMIC_RELAXED))
			return 0;
	}
}

/* CAS (attempt, QUIET|TOUCHED) -> (attempt, CLAIMED).  Only from `only` if nonzero. */
static int claim_word(uint64_t *w, uint64_t attempt, uint64_t only)
{
	uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
	for (;;) {
		if ((cur >> 2) != attempt || (cur & STATE_MASK) == KVR_LEASE_CLAIMED ||
		    (cur & STATE_MASK) == 0)
			return KVR_ESTALE;
		if (only && (cur & STATE_MASK) != only)
			return KVR_EAGAIN;
		if (__atomic_compare_exchange_n(w, &cur, (attempt << 2) | KVR_LEASE_CLAIMED, false,
		                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			return 0;
	}
}

int kvr_lease_claim(struct kvr_lease_table *t, uint32_t slot, uint64_t attempt)
{
	if (!t || attempt == 0 || attempt >= KVR_ATTEMPT_MAX)
		return KVR_EINVAL;
	uint64_t *w = word_of(t, slot);
	if (!w)
		return KVR_ENOENT;
	return claim_word(w, attempt, 0);
}

int kvr_lease_state(struct kvr_lease_table *t, uint32_t slot, uint64_t attempt)
{
	if (!t || attempt == 0 || attempt >= KVR_ATTEMPT_MAX)
		return KVR_EINVAL;
	uint64_t *w = word_of(t, slot);
	if (!w)
		return KVR_ENOENT;
	uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
	if ((cur >> 2) != attempt || (cur & STATE_MASK) == 0)
		return KVR_ESTALE;
	return (int)(cur & STATE_MASK);
}

int kvr_lease_end(struct kvr_lease_table *t, uint64_t attempt)
{
	if (!t)
		return KVR_EINVAL;
	uint32_t *s = kvr_u64map_find(&t->live, attempt);
	if (!s)
		return KVR_ENOENT;
	uint32_t slot = *s;
	uint64_t *w = word_of(t, slot);
	/* Ordering: acquire; pairs with the claimer's acq_rel CAS. */
	if ((__atomic_load_n(w, __ATOMIC_ACQUIRE) & STATE_MASK) != KVR_LEASE_CLAIMED)
		return KVR_EBUSY;
	/* Once CLAIMED nobody else writes the word, so a plain release store frees it. */
	__atomic_store_n(w, 0, __ATOMIC_RELEASE);
	kvr_u64map_remove(&t->live, attempt);
	t->free_slots[t->n_free++] = slot;
	return 0;
}

int kvr_lease_find(const struct kvr_lease_table *t, uint64_t attempt, uint32_t *slot)
{
	if (!t || !slot)
		return KVR_EINVAL;
	uint32_t *s = kvr_u64map_find(&t->live, attempt);
	if (s) {
		*slot = *s;
		return 0;
	}
	return (attempt != 0 && attempt <= t->max_attempt) ? KVR_ESTALE : KVR_ENOENT;
}

int kvr_lease_scan(struct kvr_lease_table *t, struct kvr_lease_expired *exp, size_t max,
                   size_t *n_out)
{
	if (!t || !n_out || (max > 0 && !exp))
		return KVR_EINVAL;
	size_t n = 0;
	for (uint32_t s = 0; s < t->high; s++) {
		uint64_t *w = word_of(t, s);
		uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
		uint64_t st = cur & STATE_MASK, attempt = cur >> 2;
		if (st == KVR_LEASE_TOUCHED) {
			/* A failed CAS means a claimer won meanwhile: nothing to do. */
			__atomic_compare_exchange_n(w, &cur, (attempt << 2) | KVR_LEASE_QUIET,
			                            false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
		} else if (st == KVR_LEASE_QUIET && n < max) {
			if (claim_word(w, attempt, KVR_LEASE_QUIET) == 0) {
				exp[n].attempt = attempt;
				exp[n].slot = s;
				n++;
			}
		}
	}
	*n_out = n;
	return 0;
}

int kvr_lease_tick(struct kvr_lease_table *t, uint64_t now, struct kvr_lease_expired *exp,
                   size_t max, size_t *n_out)
{
	if (!t || !n_out)
		return KVR_EINVAL;
	*n_out = 0;
	if (now < t->next_scan)
		return 0;
	t->next_scan = now + t->interval;
	return kvr_lease_scan(t, exp, max, n_out);
}

size_t kvr_lease_count(const struct kvr_lease_table *t)
{
	return t ? t->live.count : 0;
}
