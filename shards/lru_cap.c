/*
 * shards/lru_cap.c - the engine's real capacity, estimated from cached-tokens answers (issue 15).
 *
 * The prediction evicts at a capacity, registered by the operator; when that number is wrong
 * (the engine reserves memory, a different GPU, a different block size), an LRU that mirrors
 * the engine's order is wrong on every rank all the time.  A per-request answer (how many prompt
 * blocks the engine found cached) says where the engine's eviction boundary lies, because
 * eviction is ORDERED: the engine holds exactly the C most recently released blocks (C its
 * capacity, counting what live requests hold).  So one block of known recency rank p that the
 * engine holds proves C >= p, and one it no longer holds proves C < p.
 *
 * The recency rank of a block:
 *  - a block the prediction still holds: the blocks ordered after it, plus one;
 *  - a block the prediction evicted: everything the prediction holds, plus what it evicted
 *    after that block (and has not stored again), plus one.  For this the LRU keeps GHOSTS: the
 *    hashes of its most recent evictions, in order (a ring of hashes, a live bit per slot, and a
 *    map hash -> slot), so the count is a popcount over the ring.  Ghosts start with the first
 *    answer (a router without feedback pays nothing) and cover half the capacity (or the
 *    registration, if larger): an under-registration is found up to 1.5x at once, and further
 *    as the estimate grows (the ring grows with it).
 * Blocks of routed requests the engine has not allocated yet (queued or part way through a
 * chunked prefill; the caller passes them) and the answering request's own new blocks are in
 * the prediction but not in the engine, so they are not counted.
 *
 * The rules (kvr_lru_heal_cached applies them to each answer):
 *  - cached above the prediction, on blocks the prediction had evicted: the deepest of them (the
 *    oldest: a chain is evicted deepest first) was held, so C >= its rank (a LOWER bound);
 *  - the first block the engine missed is a ghost: C < its rank (an UPPER bound);
 *  - cached below the prediction: the first block missed was predicted; after evicting through
 *    it (lru_heal.c), what is left and the engine has is an UPPER bound.
 * A bound moves the estimate half way to it (so one wrong fact - a block refreshed by traffic
 * this router does not see, an answer about a preempted request - moves it only half way, and
 * older facts fade as newer ones come), never below what live requests hold, and a lower
 * estimate evicts the oldest copies down to it.  The estimate starts at the registration and
 * goes above it only when an answer proves more; kvr_lru_set_capacity (a new registration)
 * resets it.  An answer that proves nothing moves the estimate a step (1/64 of the
 * registration) back toward the registration, so upper bounds caused by traffic this router
 * does not see fade when that traffic stops (measured: without it, 30 % foreign traffic left
 * the estimate low for good and cost hit rate).
 *
 * Why the estimate EXPLORES above the registration once one answer proved it too small: the
 * evidence is lopsided.  Routing is drawn to predicted blocks, so an estimate that is too large
 * is tested at once (requests go to blocks that are gone, and their answers bring upper
 * bounds); one that is too small is hardly ever tested, because routing avoids exactly the
 * blocks it forgot (kvr-replay, Mooncake sample, 0.8x, seed 1: 6 of 1200 answers proved a lower
 * bound, on 5 of 8 ranks).  So after such a proof each answer that proves nothing raises the
 * estimate a step, until an upper bound below it says the ceiling is found.  With a correct
 * registration no lower bound ever exceeds it (bounds are conservative: a lower bound counts
 * neither unallocated blocks nor the answering request's own, an upper bound counts them all),
 * so this never starts and the no-error case is unchanged (exact 100 %, same hit rate).
 *
 * Why not just the cached-below rule (evict through the missed block, as before): it heals the
 * prediction once but the capacity stays wrong, so it drifts off again at once; and an
 * under-registered LRU learns nothing from it (its mistake is forgetting blocks the engine still
 * holds, which no eviction rule can repair).  Measured in kvr-replay (README, "Healing").
 *
 * Context: the shard thread that owns the instance.
 */
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/lru_internal.h"

#define GHOSTS_MIN 256u
#define DRIFT_STEP 64u

static size_t words(uint32_t cap)
{
	return ((size_t)cap + 63) / 64;
}

static bool live(const struct ghosts *g, uint32_t s)
{
	return (g->live[s / 64] >> (s % 64)) & 1;
}

static void set_live(struct ghosts *g, uint32_t s, bool on)
{
	if (on)
		g->live[s / 64] |= 1ull << (s % 64);
	else
		g->live[s / 64] &= ~(1ull << (s % 64));
}

void kvr_lru_ghost_push(struct kvr_lru *lru, uint64_t h)
{
	struct ghosts *g = &lru->gh;
	if (g->cap == 0)
		return;
	uint32_t s = g->at;
	if (live(g, s))
		kvr_u64map_remove(&g->map, g->ring[s]); /* the oldest ghost ages out */
	uint32_t *v = kvr_u64map_find(&g->map, h);
	if (v) {
		set_live(g, *v, false); /* evicted again: the newer eviction counts */
		*v = s;
	} else {
		kvr_u64map_insert(&g->map, h, s); /* map entries <= slots: room reserved */
	}
	g->ring[s] = h;
	set_live(g, s, true);
	g->at = s + 1 == g->cap ? 0 : s + 1;
	g->n++;
}

/* The ghosts' size for the current estimate, but never above what the prediction holds (or
 * GHOSTS_MIN): ghosts come from evictions, which start only once the prediction holds the
 * capacity, so a full prediction gets half its capacity as before, and an estimate far above
 * what it holds (a resident count of 2^64 - 1 from a scrape gone wrong, kvr_rank_observe; a
 * registration of 10^9 blocks) costs no more than the blocks themselves.  Sized by the
 * estimate alone, one such count made the next cached-tokens answer reserve 2^31 hashes and
 * a map as large (test_heal absurd_resident_counts_cost_no_memory_and_evict_nothing). */
static uint32_t ghosts_want(const struct kvr_lru *lru)
{
	uint64_t c = lru->capacity > lru->registered ? lru->capacity : lru->registered;
	uint64_t held = lru->copies + lru->n_phantom;
	c /= 2;
	if (c > held)
		c = held;
	if (c < GHOSTS_MIN)
		c = GHOSTS_MIN;
	if (c > UINT32_MAX / 2)
		c = UINT32_MAX / 2;
	return (uint32_t)c;
}

int kvr_lru_ghosts_fit(struct kvr_lru *lru)
{
	struct ghosts *g = &lru->gh, ng;
	uint32_t want = ghosts_want(lru);
	if (g->cap && want <= g->cap + g->cap / 2)
		return 0; /* big enough (regrown only by half again, not on every move) */
	memset(&ng, 0, sizeof(ng));
	ng.cap = want;
	ng.ring = kvr_alloc((size_t)want * sizeof(uint64_t));
	ng.live = kvr_calloc(words(want), sizeof(uint64_t));
	kvr_u64map_init(&ng.map);
	if (!ng.ring || !ng.live || kvr_u64map_reserve(&ng.map, want)) {
		kvr_free(ng.ring, (size_t)want * sizeof(uint64_t));
		kvr_free(ng.live, words(want) * sizeof(uint64_t));
		kvr_u64map_fini(&ng.map);
		return g->cap ? 0 : KVR_ENOMEM; /* regrowing can wait for the next answer */
	}
	/* Oldest first, so the order is kept. */
	uint64_t n = g->n < g->cap ? g->n : g->cap;
	for (uint64_t k = 0; k < n; k++) {
		uint32_t s = (uint32_t)((g->at + g->cap - n + k) % g->cap);
		if (!live(g, s))
			continue;
		ng.ring[ng.at] = g->ring[s];
		set_live(&ng, ng.at, true);
		kvr_u64map_insert(&ng.map, g->ring[s], ng.at);
		ng.at++;
		ng.n++;
	}
	kvr_lru_ghosts_fini(lru);
	*g = ng;
	return 0;
}

void kvr_lru_ghosts_fini(struct kvr_lru *lru)
{
	struct ghosts *g = &lru->gh;
	kvr_free(g->ring, (size_t)g->cap * sizeof(uint64_t));
	kvr_free(g->live, words(g->cap) * sizeof(uint64_t));
	kvr_u64map_fini(&g->map);
	memset(g, 0, sizeof(*g));
}

uint32_t kvr_lru_ghost_slot(const struct kvr_lru *lru, uint64_t h)
{
	const uint32_t *v = lru->gh.cap ? kvr_u64map_find(&lru->gh.map, h) : NULL;
	return v ? *v : NIL;
}

/* Slots from s to the newest (0 for the newest). */
static uint32_t age(const struct ghosts *g, uint32_t s)
{
	return (g->at + g->cap - 1 - s) % g->cap;
}

bool kvr_lru_ghost_older(const struct kvr_lru *lru, uint32_t a, uint32_t b)
{
	return age(&lru->gh, a) > age(&lru->gh, b);
}

/* Live slots in [lo, hi) (no wrap). */
static uint64_t count(const struct ghosts *g, uint32_t lo, uint32_t hi)
{
	uint64_t n = 0;
	while (lo < hi && lo % 64) {
		n += live(g, lo);
		lo++;
	}
	for (; lo + 64 <= hi; lo += 64)
		n += (uint64_t)__builtin_popcountll(g->live[lo / 64]);
	for (; lo < hi; lo++)
		n += live(g, lo);
	return n;
}

uint64_t kvr_lru_ghosts_newer(const struct kvr_lru *lru, uint32_t s, bool inclusive)
{
	const struct ghosts *g = &lru->gh;
	uint32_t from = inclusive ? s : (s + 1 == g->cap ? 0 : s + 1);
	if (!inclusive && s == (g->at + g->cap - 1) % g->cap)
		return 0; /* s is the newest */
	if (from < g->at)
		return count(g, from, g->at);
	return count(g, from, g->cap) + count(g, 0, g->at);
}

void kvr_lru_ghost_kill(struct kvr_lru *lru, uint64_t h)
{
	struct ghosts *g = &lru->gh;
	uint32_t *v = g->cap ? kvr_u64map_find(&g->map, h) : NULL;
	if (!v)
		return;
	set_live(g, *v, false);
	kvr_u64map_remove(&g->map, h);
}

void kvr_lru_cap_bound(struct kvr_lru *lru, uint64_t lo, uint64_t hi, struct kvr_lru_out *out)
{
	uint64_t was = lru->capacity, c = was;
	if (lo > lru->registered && lo > c)
		lru->explore = true; /* below the engine, and the registration is too small */
	if (hi && hi < c)
		lru->explore = false; /* above it: the ceiling is found */
	if (lo == 0 && hi == 0 && (lru->explore || c < lru->registered)) {
		/* An answer that proves nothing: old bounds fade (see the essay). */
		uint64_t step = lru->registered / DRIFT_STEP + 1;
		c = c + step < c ? UINT64_MAX : c + step; /* an estimate raised to ~2^64 */
		if (!lru->explore && c > lru->registered)
			c = lru->registered;
	}
	if (lo > c)
		c += (lo - c + 1) / 2;
	if (hi && hi < c)
		c -= (c - hi + 1) / 2;
	if (c < was) {
		/* Never below what live requests hold: those blocks are in the engine now. */
		uint64_t pinned = lru->copies + lru->n_phantom + lru->priv - lru->n_inactive;
		if (c < pinned)
			c = pinned < was ? pinned : was;
		if (c == 0)
			c = 1;
	}
	lru->capacity = c;
	kvr_lru_evict_to(lru, c, out);
}
