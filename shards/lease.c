/*
 * shards/lease.c - request leases.
 *
 * The idea.  An attempt that goes silent (a client vanished, a finish message lost) must not pin
 * blocks and load forever.  A CLOCK-style reaper, as in page replacement: each live lease has a
 * state QUIET, TOUCHED or CLAIMED.  Progress sets TOUCHED; the reaper, every interval, turns
 * TOUCHED into QUIET and QUIET into CLAIMED (= expired).  So an idle attempt is reclaimed after
 * one to two intervals, with no per-request timer and no timestamp writes on the hot path.
 *
 * Exactly once, on the caller's thread.  finish and abort arrive on frontend threads, expiry and
 * a rank's end on its shard; they race.  Each lease is one 64-bit word: (attempt << 2) | state.
 * A claimer CASes it from (attempt, QUIET|TOUCHED) to (attempt, CLAIMED): one CAS succeeds,
 * every other sees CLAIMED (or another attempt) and gets KVR_ESTALE.  The return code of a
 * lifecycle call is therefore known at once, on the calling thread; the cleanup is posted to
 * the shard.  Attempt ids are never reused, so a stale id can never match a recycled word (no
 * ABA).
 *
 * No lookup.  The word of attempt (seq << 16 | tag) is words[seq mod 2^20]: minting takes the
 * next sequence number and CASes that word from free (0) to (attempt, TOUCHED); if a long-lived
 * attempt still holds it, the minter takes the next number (so up to 2^20 attempts can be live;
 * at 50 % occupancy a mint probes twice on average).  Anyone holding an id finds its word in
 * O(1) with no table of attempts, which is what lets kvr_route mint on the caller's thread and
 * post the booking without waiting for the shard.
 *
 * Ids differ between routers.  Every table counts its own sequence from 1, so two routers of
 * one process (one per model, or a router and the one created to replace it) minted the same
 * ids, and a finish given the wrong router's handle ended that router's own attempt with the
 * same id (tests/unit/test_router.c: attempts_of_another_router_are_refused).  So the n-th
 * table created in the process (n from 0) XORs its SALT, n's 46 bits reversed, into the
 * sequence number of every id it mints (the word stays the sequence number's: the salt only
 * renames the ids).  Two tables whose creation numbers first differ in bit k have salts whose
 * XOR has bit 45 - k as its highest, so their ids cannot meet before one of them has minted
 * 2^(45-k) ids: 2^45 (a year at a million routes a second) for a router and the next one
 * created, 2^42 among the first 16 routers.  Beyond that a foreign id is still refused unless
 * it happens to name a live attempt.  The first table's salt is 0: a process with one router
 * mints the ids it always did.
 *
 * Memory safety for other threads: words live in fixed 4096-word chunks that are never moved or
 * freed before the table is destroyed; a chunk is allocated by the first minter that reaches it
 * and published with a CAS (a loser frees its copy); readers load the directory entry with
 * acquire.  An id whose chunk does not exist was never issued: KVR_ESTALE.
 *
 * Giving pages back.  The sequence walks through all 2^20 words whatever few attempts are live,
 * so without more every page of the 8 MiB would end up resident (32 KiB per 4,096 routes).  The
 * minter that enters a chunk sweeps the chunk SWEEP_LAG chunks behind it: each run of pages
 * whose words are all free (0) is discarded (kvr_alloc_discard: the mapping stays, so readers
 * and claimers of old ids read zeros, which no id matches: KVR_ESTALE, as before).  Only a mint
 * turns a free word live, so a page found all free stays so but for a minter whose word is in
 * it, which is SWEEP_LAG x 4,096 numbers behind the sequence (a minter preempted between its
 * fetch-add and its CAS, or the sequence wrapped).  Such a CAS could land between the sweep's
 * check and the discard, which would zero it: so a sweep makes the table's sweep generation odd
 * while it runs, and a minter that saw the generation odd or moved across its CAS waits for the
 * sweep to end and reads its word again (zeroed: the id was never returned, it mints another).
 * A sweep is one scan of 32 KiB and a few madvise calls per 4,096 mints, on the minter's thread.
 * (A hand-written reclamation, not a library's: the words must be found from the id alone, with
 * no table and no read-side section on the lifecycle calls.)
 */
#include "shards/lease.h"

#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/park.h"

#define CHUNK_SHIFT 12u
#define CHUNK_WORDS (1u << CHUNK_SHIFT)
#define N_CHUNKS    (KVR_LEASE_WORDS / CHUNK_WORDS)
#define STATE_MASK  UINT64_C(3)
#define MINT_PROBES 64
#define SWEEP_LAG   8u /* chunks between the minter and the chunk it sweeps */

struct kvr_leases {
	_Alignas(64) uint64_t next_seq;  /* atomic; its own cache line (every mint adds) */
	_Alignas(64) uint64_t sweep_gen; /* atomic; odd while a sweep runs (minters read it) */
	uint32_t sweeping;               /* atomic; 1 while a thread sweeps (one at a time) */
	_Alignas(64) uint64_t salt;      /* XORed into the ids' sequence numbers; constant */
	uint64_t *dir[N_CHUNKS];         /* published once each (CAS), read with acquire */
};

/* Tables created in this process so far: the next one's creation number. */
static uint64_t tables_created;

/* The salt of the n-th table: n's low 46 bits in reverse order. */
static uint64_t salt_of(uint64_t n)
{
	uint64_t r = 0;
	for (unsigned b = 0; b < 46; b++)
		r |= ((n >> b) & 1) << (45 - b);
	return r;
}

int kvr_leases_create(struct kvr_leases **out)
{
	if (!out)
		return KVR_EINVAL;
	struct kvr_leases *t = kvr_alloc_aligned(sizeof(*t));
	if (!t)
		return KVR_ENOMEM;
	memset(t, 0, sizeof(*t));
	t->next_seq = 1;
	t->salt = salt_of(__atomic_fetch_add(&tables_created, 1, __ATOMIC_RELAXED));
	*out = t;
	return 0;
}

void kvr_leases_destroy(struct kvr_leases *t)
{
	if (!t)
		return;
	for (uint32_t i = 0; i < N_CHUNKS; i++)
		kvr_free(t->dir[i], CHUNK_WORDS * sizeof(uint64_t));
	kvr_free_aligned(t, sizeof(*t));
}

static inline bool valid(uint64_t attempt)
{
	return attempt >= (UINT64_C(1) << KVR_LEASE_TAG_BITS) && attempt < KVR_ATTEMPT_MAX;
}

/* The word of an attempt id, or NULL if its chunk does not exist (never issued).
 * Ordering: acquire load of the directory entry; pairs with the CAS in chunk_of(). */
static uint64_t *word_of(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t i = ((attempt >> KVR_LEASE_TAG_BITS) ^ t->salt) & (KVR_LEASE_WORDS - 1);
	uint64_t *chunk = __atomic_load_n(&t->dir[i >> CHUNK_SHIFT], __ATOMIC_ACQUIRE);
	return chunk ? &chunk[i & (CHUNK_WORDS - 1)] : NULL;
}

/* How every call on an issued id begins: 0 and *w, KVR_EINVAL (no table, malformed id) or
 * KVR_ESTALE (never issued). */
static inline int find_word(struct kvr_leases *t, uint64_t attempt, uint64_t **w)
{
	if (!t || !valid(attempt))
		return KVR_EINVAL;
	*w = word_of(t, attempt);
	return *w ? 0 : KVR_ESTALE;
}

/* True if word value cur is attempt's lease in any state (not free, not another attempt's). */
static inline bool holds(uint64_t cur, uint64_t attempt)
{
	return (cur >> 2) == attempt && (cur & STATE_MASK) != 0;
}

/* The state of attempt's lease in *w (QUIET, TOUCHED or CLAIMED), or KVR_ESTALE.
 * Ordering: acquire; pairs with the claimer's acq_rel CAS. */
static inline int state_in(const uint64_t *w, uint64_t attempt)
{
	uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
	return holds(cur, attempt) ? (int)(cur & STATE_MASK) : KVR_ESTALE;
}

/* The chunk of word i, allocated and published if it is the first use. */
static uint64_t *chunk_of(struct kvr_leases *t, uint64_t i)
{
	uint64_t **slot = &t->dir[i >> CHUNK_SHIFT];
	uint64_t *chunk = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
	if (chunk)
		return chunk;
	uint64_t *fresh = kvr_calloc(CHUNK_WORDS, sizeof(uint64_t));
	if (!fresh)
		return NULL;
	if (__atomic_compare_exchange_n(slot, &chunk, fresh, false, __ATOMIC_ACQ_REL,
	                                __ATOMIC_ACQUIRE))
		return fresh;
	kvr_free(fresh, CHUNK_WORDS * sizeof(uint64_t)); /* another minter published first */
	return chunk;
}

/* Discards every run of pages of chunk c whose words are all free.  Context: one sweeper at a
 * time (t->sweeping).  Ordering: the generation's seq_cst increments bracket the scan and the
 * discards; a minter reads it seq_cst around its CAS (kvr_lease_mint). */
static void sweep(struct kvr_leases *t, uint32_t c)
{
	uint64_t *chunk = __atomic_load_n(&t->dir[c], __ATOMIC_ACQUIRE);
	if (!chunk)
		return;
	const size_t page_words = 4096 / sizeof(uint64_t);
	__atomic_add_fetch(&t->sweep_gen, 1, __ATOMIC_SEQ_CST); /* odd: sweeping */
	size_t run = 0; /* free words before w, page-aligned */
	for (size_t w = 0; w < CHUNK_WORDS; w += page_words) {
		bool free_page = true;
		for (size_t j = 0; j < page_words && free_page; j++)
			free_page = __atomic_load_n(&chunk[w + j], __ATOMIC_SEQ_CST) == 0;
		if (free_page) {
			run += page_words;
			continue;
		}
		if (run)
			(void)kvr_alloc_discard(&chunk[w - run], run * sizeof(uint64_t));
		run = 0;
	}
	if (run)
		(void)kvr_alloc_discard(&chunk[CHUNK_WORDS - run], run * sizeof(uint64_t));
	__atomic_add_fetch(&t->sweep_gen, 1, __ATOMIC_SEQ_CST); /* even: done */
}

/* After a CAS that made w live: true if it still holds `live`.  A sweep that overlapped the CAS
 * may have discarded the page under it; wait for it to end, then look. */
static bool survived_sweeps(struct kvr_leases *t, uint64_t g0, uint64_t *w, uint64_t live)
{
	uint64_t g1 = __atomic_load_n(&t->sweep_gen, __ATOMIC_SEQ_CST);
	if (g0 == g1 && !(g0 & 1))
		return true; /* no sweep ran at any time between the two loads */
	while (__atomic_load_n(&t->sweep_gen, __ATOMIC_SEQ_CST) & 1)
		kvr_cpu_relax();
	return __atomic_load_n(w, __ATOMIC_SEQ_CST) == live;
}

int kvr_lease_mint(struct kvr_leases *t, uint32_t tag, uint64_t *attempt)
{
	if (!t || !attempt || tag > KVR_LEASE_TAG_MASK)
		return KVR_EINVAL;
	for (int probe = 0; probe < MINT_PROBES; probe++) {
		uint64_t seq = __atomic_fetch_add(&t->next_seq, 1, __ATOMIC_RELAXED);
		if (seq >= KVR_LEASE_SEQ_MAX) {
			__atomic_store_n(&t->next_seq, KVR_LEASE_SEQ_MAX, __ATOMIC_RELAXED);
			return KVR_ERANGE;
		}
		uint64_t i = seq & (KVR_LEASE_WORDS - 1);
		uint64_t *chunk = chunk_of(t, i);
		if (!chunk)
			return KVR_ENOMEM;
		if ((i & (CHUNK_WORDS - 1)) == 0 &&
		    !__atomic_exchange_n(&t->sweeping, 1, __ATOMIC_ACQUIRE)) {
			sweep(t, (uint32_t)((i >> CHUNK_SHIFT) + N_CHUNKS - SWEEP_LAG) % N_CHUNKS);
			__atomic_store_n(&t->sweeping, 0, __ATOMIC_RELEASE);
		}
		const uint64_t named = seq ^ t->salt; /* the id's sequence part */
		if (named == 0)
			continue; /* it would make an id below 2^16, which is not one */
		uint64_t id = (named << KVR_LEASE_TAG_BITS) | tag, free_word = 0;
		uint64_t *w = &chunk[i & (CHUNK_WORDS - 1)], live = (id << 2) | KVR_LEASE_TOUCHED;
		uint64_t g0 = __atomic_load_n(&t->sweep_gen, __ATOMIC_SEQ_CST);
		if (__atomic_compare_exchange_n(w, &free_word, live, false, __ATOMIC_SEQ_CST,
		                                __ATOMIC_RELAXED) &&
		    survived_sweeps(t, g0, w, live)) {
			*attempt = id;
			return 0;
		}
	}
	return KVR_EAGAIN;
}

int kvr_lease_touch(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t *w;
	int rc = find_word(t, attempt, &w);
	if (rc)
		return rc;
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

/* CAS (attempt, QUIET|TOUCHED) -> (attempt, to).  Only from state `only` if nonzero. */
static int cas_live(uint64_t *w, uint64_t attempt, uint64_t only, uint64_t to)
{
	uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
	for (;;) {
		if (!holds(cur, attempt))
			return KVR_ESTALE;
		if ((cur & STATE_MASK) == KVR_LEASE_CLAIMED)
			return KVR_EBUSY;
		if (only && (cur & STATE_MASK) != only)
			return KVR_EAGAIN;
		if (__atomic_compare_exchange_n(w, &cur, to, false, __ATOMIC_ACQ_REL,
		                                __ATOMIC_ACQUIRE))
			return 0;
	}
}

int kvr_lease_claim(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t *w;
	int rc = find_word(t, attempt, &w);
	if (rc)
		return rc;
	rc = cas_live(w, attempt, 0, (attempt << 2) | KVR_LEASE_CLAIMED);
	return rc == 0 ? 0 : KVR_ESTALE;
}

void kvr_lease_prefetch_next(struct kvr_leases *t)
{
	uint64_t seq = __atomic_load_n(&t->next_seq, __ATOMIC_RELAXED);
	uint64_t i = seq & (KVR_LEASE_WORDS - 1);
	uint64_t *chunk = __atomic_load_n(&t->dir[i >> CHUNK_SHIFT], __ATOMIC_RELAXED);
	if (chunk)
		__builtin_prefetch(&chunk[i & (CHUNK_WORDS - 1)], 1, 3);
}

int kvr_lease_unmint(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t *w;
	int rc = find_word(t, attempt, &w);
	if (rc)
		return rc;
	return cas_live(w, attempt, 0, 0) == 0 ? 0 : KVR_ESTALE;
}

int kvr_lease_state(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t *w;
	int rc = find_word(t, attempt, &w);
	return rc ? rc : state_in(w, attempt);
}

/* One CLOCK step of the reaper, from -> to: `to` if it won, 0 if someone else claimed first,
 * KVR_ESTALE, or KVR_EAGAIN if the state was not `from`. */
static int age_step(uint64_t *w, uint64_t attempt, uint64_t from, uint64_t to)
{
	int rc = cas_live(w, attempt, from, (attempt << 2) | to);
	if (rc == 0)
		return (int)to;
	return rc == KVR_EBUSY ? 0 : rc;
}

int kvr_lease_age(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t *w;
	int rc = find_word(t, attempt, &w);
	if (rc)
		return rc;
	do {
		rc = age_step(w, attempt, KVR_LEASE_TOUCHED, KVR_LEASE_QUIET);
		if (rc == KVR_EAGAIN) /* QUIET since the last step: expired, unless a claimer or
		                       * toucher wins first */
			rc = age_step(w, attempt, KVR_LEASE_QUIET, KVR_LEASE_CLAIMED);
	} while (rc == KVR_EAGAIN); /* touched meanwhile: go round (it becomes QUIET) */
	return rc;
}

int kvr_lease_release(struct kvr_leases *t, uint64_t attempt)
{
	uint64_t *w;
	int rc = find_word(t, attempt, &w);
	if (rc)
		return rc;
	rc = state_in(w, attempt); /* acquire: we see the claimer's writes */
	if (rc < 0)
		return rc;
	if (rc != KVR_LEASE_CLAIMED)
		return KVR_EBUSY;
	/* Once CLAIMED nobody else writes the word, so a plain release store frees it. */
	__atomic_store_n(w, 0, __ATOMIC_RELEASE);
	return 0;
}

size_t kvr_leases_resident_bytes(const struct kvr_leases *t)
{
	if (!t)
		return 0;
	const size_t page = 4096;
	size_t bytes = 0;
	unsigned char vec[CHUNK_WORDS * sizeof(uint64_t) / 4096 + 1];
	for (uint32_t c = 0; c < N_CHUNKS; c++) {
		uintptr_t a = (uintptr_t)__atomic_load_n(&t->dir[c], __ATOMIC_ACQUIRE);
		if (!a)
			continue;
		uintptr_t start = (a + page - 1) & ~(uintptr_t)(page - 1);
		uintptr_t end = (a + CHUNK_WORDS * sizeof(uint64_t)) & ~(uintptr_t)(page - 1);
		if (end <= start || mincore((void *)start, end - start, vec) != 0)
			continue;
		for (size_t p = 0; p < (end - start) / page; p++)
			bytes += (vec[p] & 1) ? page : 0;
	}
	return bytes;
}
