/* The events-mode stored-block bound (shards/owner_events.c, "The stored-block bound"): a
 * publisher that stores far past its rank's capacity (its removals lost, or a hostile one) keeps
 * the index bounded, its excess stores are refused (KVR_ERANGE) and counted, and the rank is
 * reported out of sync through on_event_gap once per episode; an honest publisher at its
 * capacity (evictions reported before the stores that reuse the blocks, as vLLM does, copies
 * included) is untouched; a rank without a capacity is bounded by
 * kvr_config.events_max_blocks. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/metric.h"
#include "core/events.h"
#include "kvrouter.h"

static struct kvr_router *router;
static int gap_calls;
static uint64_t gap_expected, gap_got;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx, (void)worker, (void)dp;
	gap_calls++;
	gap_expected = expected;
	gap_got = got;
}

static const struct kvr_rank_id R0 = {7, 0};

/* An events-mode router (one shard) with rank R0 of the given capacity. */
static void make(uint64_t capacity, uint64_t events_max_blocks)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	if (events_max_blocks)
		c.events_max_blocks = events_max_blocks;
	gap_calls = 0;
	gap_expected = gap_got = 0;
	cr_assert_eq(kvr_router_create(&c, &router), 0);
	cr_assert_eq(kvr_rank_add(router, R0, 1, capacity, 0), 0);
}

/* Stores a chain of n blocks from the root: engine and local hashes first, first + 1, ... */
static int store_chain(uint64_t id, uint64_t first, size_t n)
{
	struct kvr_event_block b[64];
	cr_assert_leq(n, 64);
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_event_block){.ext_hash = first + i, .local_hash = first + i};
	struct kvr_event ev = {
	    .type = KVR_EVENT_STORED, .event_id = id, .blocks = b, .n_blocks = n};
	return kvr_events_apply(router, R0, &ev);
}

static int remove_blocks(uint64_t id, const uint64_t *h, size_t n)
{
	struct kvr_event ev = {
	    .type = KVR_EVENT_REMOVED, .event_id = id, .removed = h, .n_removed = n};
	return kvr_events_apply(router, R0, &ev);
}

static int clear(uint64_t id)
{
	struct kvr_event ev = {.type = KVR_EVENT_CLEARED, .event_id = id};
	return kvr_events_apply(router, R0, &ev);
}

static struct kvr_rank_stats stats(void)
{
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R0, &st), 0);
	return st;
}

static uint64_t index_bytes(void)
{
	struct kvr_memory m;
	cr_assert_eq(kvr_router_sync(router, 1000), 0);
	cr_assert_eq(kvr_router_get_memory(router, &m), 0);
	return m.index;
}

/* kvr_events_total{type="stored",status="over_bound"}. */
static uint64_t refused_events(void)
{
	static char buf[1 << 16];
	size_t len = 0;
	cr_assert_eq(kvr_metrics_render(router, buf, sizeof(buf), &len), 0);
	const char *key = "\nkvr_events_total{type=\"stored\",status=\"over_bound\"} ";
	const char *p = strstr(buf, key);
	cr_assert(p, "over_bound status rendered");
	return strtoull(p + strlen(key), NULL, 10);
}

Test(events_bound, publisher_far_past_capacity_stays_bounded)
{
	const uint64_t cap = 1000, bound = 2 * cap + 1024;
	make(cap, 0);
	/* 100,000 blocks in chains of 16, never a removal: 33x the bound. */
	uint64_t id = 0, accepted = 0, refused = 0, first_refused_id = 0, bytes_at_bound = 0;
	for (uint64_t k = 0; k < 100000 / 16; k++) {
		int rc = store_chain(++id, 1 + k * 16, 16);
		if (rc == 0) {
			accepted++;
			continue;
		}
		cr_assert_eq(rc, KVR_ERANGE, "event %lu: %d", (unsigned long)id, rc);
		if (!refused++) {
			first_refused_id = id;
			bytes_at_bound = index_bytes();
		}
	}
	cr_assert_eq(accepted, bound / 16, "every store that fits is applied");
	cr_assert_eq(stats().indexed_blocks, accepted * 16);
	cr_assert_leq(stats().indexed_blocks, bound);
	uint64_t bytes = index_bytes();
	cr_assert_leq(bytes, bytes_at_bound, "refused stores take no memory (%lu > %lu)",
	              (unsigned long)bytes, (unsigned long)bytes_at_bound);
	fprintf(stderr, "events_bound: %lu blocks held, index %lu bytes (%.1f per block)\n",
	        (unsigned long)stats().indexed_blocks, (unsigned long)bytes,
	        (double)bytes / (double)stats().indexed_blocks);
	/* Counted, and reported once: the first refused event as lost. */
	cr_assert_eq(refused_events(), refused);
	cr_assert_eq(kvr_test_metric(router, "kvr_event_over_bound_blocks_total"), refused * 16);
	cr_assert_eq(kvr_test_metric(router, "kvr_event_over_bound_episodes_total"), 1);
	cr_assert_eq(kvr_test_metric(router, "kvr_event_gaps_total"), 0, "no id gap");
	cr_assert_eq(gap_calls, 1, "once per episode, not per refused store (%d)", gap_calls);
	cr_assert_eq(gap_expected, first_refused_id);
	cr_assert_eq(gap_got, first_refused_id + 1);
	cr_assert_eq(stats().event_gaps, 1);
	cr_assert_eq(stats().event_id, id, "the cursor moved past the refused events");
	/* Removals still apply (the rank shrinks), and the episode stays open above half. */
	uint64_t h[16];
	for (int i = 0; i < 16; i++)
		h[i] = 1 + (uint64_t)i;
	cr_assert_eq(remove_blocks(++id, h, 16), 0);
	cr_assert_eq(store_chain(++id, 1, 16), 0, "room for one chain again");
	cr_assert_eq(store_chain(++id, 1u << 30, 16), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1, "still the same episode");
	/* The embedder resyncs (a cleared event): the next excess is a new episode. */
	cr_assert_eq(clear(++id), 0);
	cr_assert_eq(stats().indexed_blocks, 0);
	for (uint64_t k = 0; k < bound / 16; k++)
		cr_assert_eq(store_chain(++id, (2u << 30) + k * 16, 16), 0);
	cr_assert_eq(store_chain(++id, 3u << 30, 16), KVR_ERANGE);
	cr_assert_eq(gap_calls, 2);
	cr_assert_eq(gap_expected, id);
	cr_assert_eq(kvr_test_metric(router, "kvr_event_over_bound_episodes_total"), 2);
	kvr_router_destroy(router);
}

/* One event larger than the whole bound is refused on an empty rank, without allocating for
 * it; a store that lands exactly on the bound is applied. */
Test(events_bound, exact_bound_and_oversized_event)
{
	make(KVR_CAPACITY_NONE, 40);
	cr_assert_eq(store_chain(0, 1000, 41), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_expected, 0, "unnumbered: reported as (0, 1)");
	cr_assert_eq(gap_got, 1);
	cr_assert_eq(stats().indexed_blocks, 0);
	cr_assert_eq(store_chain(0, 1, 40), 0, "exactly the bound (the episode ended: empty)");
	cr_assert_eq(stats().indexed_blocks, 40);
	cr_assert_eq(store_chain(0, 100, 1), KVR_ERANGE);
	cr_assert_eq(gap_calls, 2, "a new episode: the rank had come back below half");
	/* Re-storing a held block would add only a copy, but near the bound it is counted as new
	 * (an honest engine never gets here: see the honest test). */
	cr_assert_eq(store_chain(0, 1, 1), KVR_ERANGE);
	cr_assert_eq(gap_calls, 2);
	kvr_router_destroy(router);
}

/* A numbered event that jumps ids and is refused: one report, its id gap through it. */
Test(events_bound, id_gap_and_refusal_merge)
{
	make(KVR_CAPACITY_NONE, 16);
	cr_assert_eq(store_chain(5, 1, 16), 0);
	cr_assert_eq(store_chain(9, 100, 1), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_expected, 6);
	cr_assert_eq(gap_got, 10, "6..9 lost: 6-8 never came, 9 refused");
	cr_assert_eq(stats().event_gaps, 2, "an id gap and an episode");
	cr_assert_eq(kvr_test_metric(router, "kvr_event_gaps_total"), 1);
	cr_assert_eq(store_chain(9, 100, 1), KVR_ESTALE, "a refused id is not applied later");
	kvr_router_destroy(router);
}

/* At the top of the id space the report is exact.  A refusal at UINT64_MAX - 1 reads
 * (UINT64_MAX - 1, UINT64_MAX), merged with an id gap before it.  UINT64_MAX itself is no event
 * id (KVR_EINVAL, nothing applied, nothing reported): its report would need got = 2^64.
 * Before, a refusal at UINT64_MAX was reported as (UINT64_MAX - 1, UINT64_MAX), an event that
 * was not lost, and an id gap through it lost the refused event itself. */
Test(events_bound, refusal_at_the_last_ids)
{
	make(KVR_CAPACITY_NONE, 16);
	cr_assert_eq(store_chain(UINT64_MAX - 3, 1, 16), 0);
	cr_assert_eq(store_chain(UINT64_MAX, 100, 1), KVR_EINVAL, "UINT64_MAX is no event id");
	cr_assert_eq(gap_calls, 0, "nothing reported (%" PRIu64 "..%" PRIu64 ")", gap_expected,
	             gap_got);
	cr_assert_eq(stats().event_gaps, 0);
	cr_assert_eq(clear(UINT64_MAX), KVR_EINVAL, "nor for a clear");
	cr_assert_eq(stats().indexed_blocks, 16, "nothing applied");
	/* An id gap (UINT64_MAX - 2) and the refused UINT64_MAX - 1: one report, exact. */
	cr_assert_eq(store_chain(UINT64_MAX - 1, 100, 1), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_expected, UINT64_MAX - 2);
	cr_assert_eq(gap_got, UINT64_MAX, "UINT64_MAX - 2 never came, UINT64_MAX - 1 refused");
	kvr_router_destroy(router);

	make(KVR_CAPACITY_NONE, 16);
	cr_assert_eq(store_chain(UINT64_MAX - 2, 1, 16), 0);
	cr_assert_eq(store_chain(UINT64_MAX - 1, 100, 1), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_expected, UINT64_MAX - 1, "the refused event alone");
	cr_assert_eq(gap_got, UINT64_MAX);
	kvr_router_destroy(router);
}

/* Ranks without a capacity (KVR_CAPACITY_NONE, or 0) use events_max_blocks; a publisher
 * hovering at the bound (a removal, a store) is reported once; the episode ends at half. */
Test(events_bound, no_capacity_uses_config_bound)
{
	for (int zero = 0; zero < 2; zero++) {
		make(zero ? 0 : KVR_CAPACITY_NONE, 100);
		uint64_t id = 0;
		for (uint64_t k = 0; k < 200; k++) {
			int rc = store_chain(++id, 1 + k, 1);
			cr_assert_eq(rc, k < 100 ? 0 : KVR_ERANGE, "block %lu", (unsigned long)k);
		}
		cr_assert_eq(stats().indexed_blocks, 100);
		cr_assert_eq(gap_calls, 1);
		for (uint64_t k = 0; k < 40; k++) { /* hovering: each removal lets one through */
			uint64_t h = 1 + k;
			cr_assert_eq(remove_blocks(++id, &h, 1), 0);
			cr_assert_eq(store_chain(++id, 1000 + k, 1), 0);
			cr_assert_eq(store_chain(++id, 2000 + k, 1), KVR_ERANGE);
		}
		cr_assert_eq(gap_calls, 1, "hovering at the bound is one episode");
		uint64_t h[60];
		for (int i = 0; i < 60; i++)
			h[i] = 41 + (uint64_t)i;
		cr_assert_eq(remove_blocks(++id, h, 60), 0);
		cr_assert_eq(stats().indexed_blocks, 40);
		cr_assert_eq(store_chain(++id, 3000, 1), 0, "below half: the episode is over");
		for (uint64_t k = 1; k < 60; k++)
			cr_assert_eq(store_chain(++id, 3000 + k, 1), 0);
		cr_assert_eq(store_chain(++id, 4000, 1), KVR_ERANGE);
		cr_assert_eq(gap_calls, 2, "a second episode");
		/* The feed's path (kvr_events_apply_many): the same refusal, rc per event, and the
		 * same report (none here: the episode is open). */
		struct kvr_event_block b = {.ext_hash = 5000, .local_hash = 5000};
		struct kvr_event evs[2] = {
		    {.type = KVR_EVENT_STORED, .blocks = &b, .n_blocks = 1},
		    {.type = KVR_EVENT_REMOVED, .removed = &h[0], .n_removed = 1}};
		int rcs[2] = {1, 1};
		cr_assert_eq(kvr_events_apply_many(router, R0, evs, 2, rcs), 0);
		cr_assert_eq(rcs[0], KVR_ERANGE);
		cr_assert_eq(rcs[1], 0);
		kvr_router_destroy(router);
	}
}

/* A vLLM-like engine with exactly `capacity` physical blocks: evictions (FIFO over physical
 * blocks, copies included) are reported before the stores that reuse them, as BlockPool does.
 * Held at its capacity for thousands of stores, nothing is refused or reported, and the index
 * holds exactly the engine's distinct hashes. */
Test(events_bound, honest_publisher_at_capacity_untouched)
{
	enum { CAP = 512, CHAINS = 4000 };
	make(CAP, 0);
	static uint64_t fifo[CAP]; /* physical blocks, oldest first (ring) */
	size_t head = 0, used = 0;
	uint64_t id = 0, seed = 12345;
	for (uint64_t k = 0; k < CHAINS; k++) {
		seed = seed * 6364136223846793005ull + 1442695040888963407ull;
		size_t n = 1 + (seed >> 33) % 48;
		/* One chain in four is a copy of a recent chain's prefix (two physical copies of
		 * one hash, as vLLM may hold). */
		uint64_t first = (k >= 8 && (seed >> 20) % 4 == 0)
		                     ? 1 + (k - 1 - (seed >> 40) % 8) * 64
		                     : 1 + k * 64;
		if (used + n > CAP) { /* evict the oldest, report, then store */
			size_t ne = used + n - CAP;
			uint64_t ev[64];
			for (size_t i = 0; i < ne; i++) {
				ev[i] = fifo[head];
				head = (head + 1) % CAP;
			}
			used -= ne;
			cr_assert_eq(remove_blocks(++id, ev, ne), 0);
		}
		int rc = store_chain(++id, first, n);
		cr_assert_eq(rc, 0, "store %lu: %d", (unsigned long)k, rc);
		for (size_t i = 0; i < n; i++)
			fifo[(head + used + i) % CAP] = first + i;
		used += n;
	}
	cr_assert_eq(used, CAP, "the engine is full");
	/* The index holds the engine's distinct hashes, exactly. */
	static uint64_t want[CAP], got[CAP];
	size_t nw = 0;
	for (size_t i = 0; i < used; i++) {
		uint64_t h = fifo[(head + i) % CAP];
		bool dup = false;
		for (size_t j = 0; j < nw && !dup; j++)
			dup = want[j] == h;
		if (!dup)
			want[nw++] = h;
	}
	size_t ng = 0;
	cr_assert_eq(kvr_rank_blocks(router, R0, got, CAP, &ng), 0);
	cr_assert_eq(ng, nw);
	for (size_t i = 0; i < nw; i++) {
		bool f = false;
		for (size_t j = 0; j < ng && !f; j++)
			f = got[j] == want[i];
		cr_assert(f, "block %lu missing", (unsigned long)want[i]);
	}
	cr_assert_lt(nw, CAP, "copies were held");
	cr_assert_eq(refused_events(), 0);
	cr_assert_eq(kvr_test_metric(router, "kvr_event_over_bound_episodes_total"), 0);
	cr_assert_eq(gap_calls, 0);
	cr_assert_eq(stats().event_gaps, 0);
	kvr_router_destroy(router);
}
