/* TTL retention (shards/ttl): record, refresh, bucketed expiry, clock steps back, out of
 * memory; and the per-block oracle (tests/ref/ttl_ref.c) against an array model on arbitrary
 * hashes (seed printed on failure; TTL_DIFF_SEED=<seed>).  shards/ttl against the oracle on
 * chained hashes: tests/unit/test_ttl_diff.c. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "core/alloc.h"
#include "shards/ttl.h"
#include "../ref/ttl_ref.h"
#include "lru_out_util.h"
#include "tests/common/splitmix.h"

#define MS 1000000ull

static void blk(struct kvr_lru_block *b, const uint64_t *v, size_t n)
{
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_lru_block){.local = v[i] + 1, .seq = v[i]};
}

Test(ttl, record_refresh_expire)
{
	struct kvr_ttl *t;
	struct kvr_lru_out out;
	struct kvr_lru_block b[3];
	uint64_t x;
	uint32_t pos;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_ttl_create(0, 0, &t), KVR_EINVAL);
	cr_assert_eq(kvr_ttl_create(1000 * MS, 100 * MS, &t), 0);
	cr_assert_eq(kvr_ttl_next_expiry(t), UINT64_MAX);
	blk(b, (uint64_t[]){1, 2, 3}, 3);
	cr_assert_eq(kvr_ttl_record(t, b, 3, 0, 50 * MS, &out), 0);
	cr_assert_eq(out.n_stored, 3);
	cr_assert_eq(out_stored(&out, b, 1)->local, 3);
	cr_assert_eq(kvr_ttl_next_expiry(t), 1100 * MS, "1050 ms rounded up to the bucket");
	/* Same bucket: refresh is free and stores nothing. */
	cr_assert_eq(kvr_ttl_record(t, b, 2, 0, 90 * MS, &out), 0);
	cr_assert_eq(out.n_stored, 0);
	/* Next bucket: 1 and 2 move to 1200 ms; 3 stays at 1100 ms. */
	cr_assert_eq(kvr_ttl_record(t, b, 2, 5, 150 * MS, &out), 0);
	cr_assert_eq(kvr_ttl_lookup(t, 1, &x, &pos), 0);
	cr_assert_eq(x, 1200 * MS);
	cr_assert_eq(pos, 5, "routing again updates the position");
	cr_assert_eq(kvr_ttl_lookup(t, 9, &x, &pos), KVR_ENOENT);
	cr_assert_eq(kvr_ttl_expire(t, 1099 * MS, &out), 0);
	cr_assert_eq(out.n_evicted, 0);
	cr_assert_eq(kvr_ttl_expire(t, 1100 * MS, &out), 0);
	cr_assert_eq(out.n_evicted, 1);
	cr_assert_eq(out_evicted(&out, 0), 3);
	uint64_t q[3] = {1, 2, 3};
	cr_assert_eq(kvr_ttl_overlap(t, q, 3), 2);
	cr_assert_eq(kvr_ttl_expire(t, 5000 * MS, &out), 0);
	cr_assert_eq(out.n_evicted, 2);
	cr_assert_eq(out.n_evicted_runs, 1, "one run, parent first");
	cr_assert_eq(out.evicted_seq[0], 1);
	cr_assert_eq(out.evicted_seq[1], 2);
	cr_assert_eq(kvr_ttl_count(t), 0);
	cr_assert_eq(kvr_ttl_record(t, NULL, 1, 0, 0, &out), KVR_EINVAL);
	kvr_ttl_destroy(t);
	kvr_ttl_destroy(NULL);
	kvr_lru_out_fini(&out);
}

/* Crafted hashes (kvr_request does not check that a caller's hashes chain; approx_ttl records
 * the prompt as given).  A record repeating a new hash entered it twice: two map entries for one
 * key, kvr_ttl_check broken, and the store's block counts drifted until an expiry reserved
 * ~2^35 bytes for its output (ASan out-of-memory in kvr_ttl_expire; fuzz_api_seeds --craft in
 * approx_ttl mode hit it on a shard's TTL timer).  A record coming back to a run it refreshed
 * split that run at an offset the first step's split had made stale.  Now such a record ends at
 * the repeat: its later blocks are not recorded. */
Test(ttl, crafted_record_repeating_a_hash)
{
	struct kvr_ttl *t;
	struct kvr_lru_out out;
	struct kvr_lru_block b[8];
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_ttl_create(1000, 0, &t), 0);
	blk(b, (uint64_t[]){15, 15, 14, 1, 2}, 5);
	cr_assert_eq(kvr_ttl_record(t, b, 5, 0, 1, &out), 0);
	cr_assert_eq(kvr_ttl_check(t), 0);
	cr_assert_eq(kvr_ttl_count(t), 1, "the record ends at the repeated 15");
	blk(b, (uint64_t[]){1, 2, 3}, 3);
	cr_assert_eq(kvr_ttl_record(t, b, 3, 0, 2, &out), 0);
	blk(b, (uint64_t[]){1, 2, 3, 1, 2, 9}, 6); /* comes back to the run 1, 2, 3 */
	cr_assert_eq(kvr_ttl_record(t, b, 6, 0, 3, &out), 0);
	cr_assert_eq(kvr_ttl_check(t), 0);
	blk(b, (uint64_t[]){7, 8, 7, 9, 8}, 5); /* new, with repeats after a new stretch */
	cr_assert_eq(kvr_ttl_record(t, b, 5, 4, 4, &out), 0);
	cr_assert_eq(kvr_ttl_check(t), 0);
	cr_assert_eq(kvr_ttl_expire(t, 100000, &out), 0);
	cr_assert_eq(kvr_ttl_count(t), 0);
	cr_assert_eq(kvr_ttl_check(t), 0);
	kvr_ttl_destroy(t);
	kvr_lru_out_fini(&out);
}

Test(ttl, clock_step_back_keeps_order)
{
	struct kvr_ttl *t;
	struct kvr_lru_out out;
	struct kvr_lru_block b[1];
	kvr_lru_out_init(&out);
	kvr_ttl_create(100, 0, &t);
	blk(b, (uint64_t[]){1}, 1);
	kvr_ttl_record(t, b, 1, 0, 1000, &out); /* expires 1100 */
	blk(b, (uint64_t[]){2}, 1);
	kvr_ttl_record(t, b, 1, 0, 500, &out); /* would be 600: clamped to 1100 */
	kvr_ttl_expire(t, 700, &out);
	cr_assert_eq(out.n_evicted, 0);
	kvr_ttl_expire(t, 1100, &out);
	cr_assert_eq(out.n_evicted, 2);
	kvr_ttl_destroy(t);
	kvr_lru_out_fini(&out);
}

/* A re-record that starts inside a run splits it; the refreshed middle outlives both ends,
 * is unreachable for overlap while its parent is gone, and is found again (not stored) when
 * the whole chain is recorded from the root. */
Test(ttl, refresh_inside_a_run)
{
	struct kvr_ttl *t;
	struct kvr_lru_out out;
	struct kvr_lru_block b[6];
	uint64_t x, q[6] = {11, 12, 13, 14, 15, 16};
	uint32_t pos;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_ttl_create(100, 0, &t), 0);
	blk(b, q, 6);
	cr_assert_eq(kvr_ttl_record(t, b, 6, 0, 0, &out), 0); /* one run, expires 100 */
	cr_assert_eq(out.n_stored, 6);
	blk(b, q + 2, 2);
	cr_assert_eq(kvr_ttl_record(t, b, 2, 2, 50, &out), 0); /* 13, 14 at their positions */
	cr_assert_eq(out.n_stored, 0, "present blocks are refreshed, not stored");
	cr_assert_eq(kvr_ttl_lookup(t, 13, &x, &pos), 0);
	cr_assert(x == 150 && pos == 2);
	cr_assert_eq(kvr_ttl_lookup(t, 16, &x, &pos), 0);
	cr_assert(x == 100 && pos == 5);
	cr_assert_eq(kvr_ttl_expire(t, 100, &out), 0);
	cr_assert_eq(out.n_evicted, 4);
	cr_assert_eq(out.n_evicted_runs, 2, "the two ends, each a chain (same expiry: any order)");
	for (size_t k = 0; k < 2; k++) {
		const uint64_t *e = out.evicted_seq + 2 * k;
		cr_assert((e[0] == 11 && e[1] == 12) || (e[0] == 15 && e[1] == 16));
	}
	cr_assert_neq(out.evicted_seq[0], out.evicted_seq[2]);
	cr_assert_eq(kvr_ttl_count(t), 2);
	cr_assert_eq(kvr_ttl_overlap(t, q, 6), 0, "13 outlived its parent: not a prefix");
	cr_assert_eq(kvr_ttl_overlap(t, q + 2, 2), 2);
	blk(b, q, 6);
	cr_assert_eq(kvr_ttl_record(t, b, 6, 0, 120, &out), 0);
	cr_assert_eq(out.n_stored, 4);
	cr_assert_eq(out.n_stored_runs, 2);
	cr_assert(out.stored[0].first == 0 && out.stored[0].n == 2);
	cr_assert(out.stored[1].first == 4 && out.stored[1].n == 2);
	cr_assert_eq(kvr_ttl_overlap(t, q, 6), 6);
	cr_assert_eq(kvr_ttl_next_expiry(t), 220);
	cr_assert_eq(kvr_ttl_expire(t, 220, &out), 0);
	cr_assert_eq(out.n_evicted, 6);
	cr_assert_eq(kvr_ttl_count(t), 0);
	kvr_ttl_destroy(t);
	kvr_lru_out_fini(&out);
}

/* ---------------------------------------------------------------- growth */

#define G_SES 64
#define G_MAX 520

struct gstate {
	struct kvr_ttl *t;
	struct ref_ttl *ref;
	uint64_t ses[G_SES][G_MAX];
	size_t len[G_SES];
	uint64_t sys[8][64];
	uint64_t rng, turns_growing, checks;
	size_t max_fresh;
};

/* Every invariant of the store (kvr_ttl_check). */
static void g_check_all(struct gstate *g, uint64_t turn)
{
	int bad = kvr_ttl_check(g->t);
	cr_assert_eq(bad, 0, "turn %llu: invariant at shards/ttl.c:%d", (unsigned long long)turn,
	             bad);
	g->checks++;
}

static void g_lookup(struct gstate *g, uint64_t seq, uint64_t turn)
{
	uint64_t x1 = 0, x2 = 0;
	uint32_t p1 = 0, p2 = 0;
	int r1 = kvr_ttl_lookup(g->t, seq, &x1, &p1), r2 = ref_ttl_lookup(g->ref, seq, &x2, &p2);
	cr_assert(r1 == r2 && x1 == x2 && p1 == p2,
	          "turn %llu: lookup %d %llu %u vs ref %d %llu %u", (unsigned long long)turn, r1,
	          (unsigned long long)x1, p1, r2, (unsigned long long)x2, p2);
}

/* One turn: session s records its whole prompt from the root (16 new blocks at its end; back
 * to a shared system prompt when full), then 2 output blocks at their position, then expiry. */
static void g_turn(struct gstate *g, uint64_t turn, uint64_t now, struct kvr_lru_block *b,
                   struct kvr_lru_out *o1, struct kvr_lru_out *o2)
{
	size_t s = splitmix64(&g->rng) % G_SES;
	uint64_t *q = g->ses[s];
	if (g->len[s] == 0 || g->len[s] + 18 > G_MAX) {
		memcpy(q, g->sys[splitmix64(&g->rng) % 8], sizeof(g->sys[0]));
		g->len[s] = 64;
	}
	for (size_t i = 0; i < 16; i++, g->len[s]++)
		q[g->len[s]] = splitmix64(&g->rng) | 1;
	for (size_t i = 0; i < g->len[s]; i++)
		b[i] = (struct kvr_lru_block){.local = i, .seq = q[i]};
	cr_assert_eq(kvr_ttl_record(g->t, b, g->len[s], 0, now, o1), 0);
	cr_assert_eq(ref_ttl_record(g->ref, b, g->len[s], 0, now, o2), 0);
	cr_assert_eq(o1->n_stored, o2->n_stored, "turn %llu", (unsigned long long)turn);
	if (o1->n_stored > g->max_fresh)
		g->max_fresh = o1->n_stored;
	for (size_t i = 0; i < 2; i++, g->len[s]++) {
		q[g->len[s]] = splitmix64(&g->rng) | 1;
		b[i] = (struct kvr_lru_block){.local = i, .seq = q[g->len[s]]};
	}
	cr_assert_eq(kvr_ttl_record(g->t, b, 2, (uint32_t)(g->len[s] - 2), now, o1), 0);
	cr_assert_eq(ref_ttl_record(g->ref, b, 2, (uint32_t)(g->len[s] - 2), now, o2), 0);
	cr_assert_eq(kvr_ttl_expire(g->t, now, o1), 0);
	cr_assert_eq(ref_ttl_expire(g->ref, now, o2), 0);
	cr_assert_eq(o1->n_evicted, o2->n_evicted, "turn %llu", (unsigned long long)turn);
	cr_assert_eq(kvr_ttl_count(g->t), ref_ttl_count(g->ref), "turn %llu",
	             (unsigned long long)turn);
	cr_assert_eq(kvr_ttl_overlap(g->t, q, g->len[s]), ref_ttl_overlap(g->ref, q, g->len[s]));
	for (size_t k = 0; k < 4; k++) /* the new blocks, a few old ones */
		g_lookup(g, q[g->len[s] - 1 - k * 6], turn);
	g_lookup(g, q[splitmix64(&g->rng) % g->len[s]], turn);
	struct kvr_ttl_stats st;
	kvr_ttl_stats(g->t, &st);
	g->turns_growing += st.growing;
	if (st.growing || turn % 101 == 0)
		g_check_all(g, turn);
	if (turn % 997 == 0)
		for (size_t k = 0; k < G_SES; k++)
			for (size_t i = 0; i < g->len[k]; i++)
				g_lookup(g, g->ses[k][i], turn);
}

/* The map grows (and purges) a slice per call while records and expiries go on: after every
 * call of a growth, every held block is found, with its expiry and position as the per-block
 * oracle has them, counts are exact, and every invariant holds; no call does more than a
 * bounded slice of migration work although the table reaches 128k slots.  Then everything
 * expires at once and the table fills again with the expired blocks' graves pending. */
Test(ttl, grows_a_slice_per_call)
{
	struct gstate *g = calloc(1, sizeof(*g));
	struct kvr_lru_block *b = malloc(G_MAX * sizeof(*b));
	struct kvr_lru_out o1, o2;
	kvr_lru_out_init(&o1);
	kvr_lru_out_init(&o2);
	g->rng = 42;
	for (size_t k = 0; k < 8; k++)
		for (size_t i = 0; i < 64; i++)
			g->sys[k][i] = splitmix64(&g->rng) | 1;
	cr_assert_eq(kvr_ttl_create(3000, 0, &g->t), 0);
	cr_assert_eq(ref_ttl_create(3000, 0, &g->ref), 0);
	uint64_t turn = 0, now = 1;
	for (; turn < 8000; turn++, now++)
		g_turn(g, turn, now, b, &o1, &o2);
	struct kvr_ttl_stats st;
	kvr_ttl_stats(g->t, &st);
	size_t held = kvr_ttl_count(g->t), slots = st.map_slots;
	cr_assert_geq(held, 40000, "held %zu", held);
	cr_assert_geq(slots, 65536);
	/* everything expires: its entries go stale, graves pending */
	now += 4000;
	cr_assert_eq(kvr_ttl_expire(g->t, now, &o1), 0);
	cr_assert_eq(ref_ttl_expire(g->ref, now, &o2), 0);
	cr_assert_eq(o1.n_evicted, held);
	kvr_ttl_stats(g->t, &st);
	cr_assert_eq(st.pending, held);
	g_check_all(g, turn);
	for (uint64_t end = turn + 6000; turn < end; turn++, now++)
		g_turn(g, turn, now, b, &o1, &o2);
	kvr_ttl_stats(g->t, &st);
	cr_assert_geq(st.growths, 8, "growths %llu", (unsigned long long)st.growths);
	cr_assert_geq(g->turns_growing, 100);
	/* a bounded slice per call: ~10 units per new block (ttl_map.c), + 64 per call, + a
	 * zeroing chunk; nothing near the table's size */
	cr_assert_leq(st.max_step_units, 32 * g->max_fresh + 64 + 1024 / 8 + 8,
	              "max units %zu, max new blocks %zu", st.max_step_units, g->max_fresh);
	cr_assert_lt(st.max_step_units * 16, st.map_slots);
	if (getenv("TTL_GROW_VERBOSE"))
		printf("growths %llu turns growing %llu checks %llu max units %zu max new %zu "
		       "slots %zu held %zu\n",
		       (unsigned long long)st.growths, (unsigned long long)g->turns_growing,
		       (unsigned long long)g->checks, st.max_step_units, g->max_fresh, st.map_slots,
		       kvr_ttl_count(g->t));
	kvr_ttl_destroy(g->t);
	ref_ttl_destroy(g->ref);
	kvr_lru_out_fini(&o1);
	kvr_lru_out_fini(&o2);
	free(b);
	free(g);
}

/* ---------------------------------------------------------------- differential */

#define U 64
struct mentry {
	bool live;
	uint64_t expiry;
	uint32_t pos;
};

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void run_seed(uint64_t seed, int steps)
{
	uint64_t r = seed, ttl = 1 + splitmix64(&r) % 500,
	         bucket = splitmix64(&r) % 3 ? splitmix64(&r) % 100 : 0;
	struct mentry m[U];
	memset(m, 0, sizeof(m));
	struct ref_ttl *t;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	cr_assert_eq(ref_ttl_create(ttl, bucket, &t), 0);
	uint64_t now = 1000;
	struct kvr_lru_block b[16];
	for (int step = 0; step < steps; step++) {
		uint64_t op = splitmix64(&r) % 10;
		if (op < 5) {
			size_t n = splitmix64(&r) % 16;
			uint32_t start = (uint32_t)(splitmix64(&r) % 8);
			for (size_t i = 0; i < n; i++)
				b[i] =
				    (struct kvr_lru_block){.seq = splitmix64(&r) % U, .local = 0};
			cr_assert_eq(ref_ttl_record(t, b, n, start, now, &out), 0);
			/* Model: expiry = max(roundup(now + ttl), every live expiry). */
			uint64_t x = now + ttl;
			if (bucket > 1 && x % bucket)
				x += bucket - x % bucket;
			for (int s = 0; s < U; s++)
				if (m[s].live && m[s].expiry > x)
					x = m[s].expiry;
			uint64_t stored[16];
			size_t ns = 0;
			for (size_t i = 0; i < n; i++) {
				struct mentry *e = &m[b[i].seq];
				if (!e->live)
					stored[ns++] = b[i].seq;
				e->live = true;
				e->expiry = x;
				e->pos = start + (uint32_t)i;
			}
			cr_assert_eq(out.n_stored, ns, "seed %llu step %d",
			             (unsigned long long)seed, step);
			for (size_t i = 0; i < ns; i++)
				cr_assert_eq(out_stored(&out, b, i)->seq, stored[i],
				             "seed %llu step %d", (unsigned long long)seed, step);
		} else if (op < 8) {
			cr_assert_eq(ref_ttl_expire(t, now, &out), 0);
			uint64_t ev[U];
			size_t ne = 0;
			for (int s = 0; s < U; s++)
				if (m[s].live && m[s].expiry <= now) {
					m[s].live = false;
					ev[ne++] = (uint64_t)s;
				}
			cr_assert_eq(out.n_evicted, ne, "seed %llu step %d",
			             (unsigned long long)seed, step);
			for (size_t i = 1; i < ne; i++) /* oldest first */
				cr_assert_leq(m[out_evicted(&out, i - 1)].expiry,
				              m[out_evicted(&out, i)].expiry);
			if (ne)
				qsort(out.evicted_seq, ne, sizeof(uint64_t), cmp_u64);
			for (size_t i = 0; i < ne; i++)
				cr_assert_eq(out_evicted(&out, i), ev[i], "seed %llu step %d",
				             (unsigned long long)seed, step);
		} else {
			/* clock advance, rarely backwards */
			if (splitmix64(&r) % 20 == 0 && now > 200)
				now -= splitmix64(&r) % 200;
			else
				now += splitmix64(&r) % 300;
		}
		size_t live = 0;
		uint64_t next = UINT64_MAX;
		for (int s = 0; s < U; s++)
			if (m[s].live) {
				live++;
				uint64_t x;
				uint32_t pos;
				cr_assert_eq(ref_ttl_lookup(t, (uint64_t)s, &x, &pos), 0);
				cr_assert(x == m[s].expiry && pos == m[s].pos, "seed %llu step %d",
				          (unsigned long long)seed, step);
				if (x < next)
					next = x;
			}
		cr_assert_eq(ref_ttl_count(t), live, "seed %llu step %d", (unsigned long long)seed,
		             step);
		cr_assert_eq(ref_ttl_next_expiry(t), next);
	}
	ref_ttl_destroy(t);
	kvr_lru_out_fini(&out);
}

Test(ttl, ref_against_model)
{
	const char *env = getenv("TTL_DIFF_SEED");
	if (env) {
		run_seed(strtoull(env, NULL, 0), 5000);
		return;
	}
	for (uint64_t seed = 1; seed <= 300; seed++)
		run_seed(seed, 300);
}

/* Fail the Nth allocation for N = 1, 2, ...: a failed command changes nothing. */
Test(ttl, out_of_memory_changes_nothing)
{
	struct kvr_lru_block b[100];
	for (uint64_t nth = 1; nth < 60; nth++) {
		struct kvr_ttl *t;
		struct kvr_lru_out out;
		kvr_lru_out_init(&out);
		cr_assert_eq(kvr_ttl_create(100, 10, &t), 0);
		kvr_alloc_fail_after(nth);
		for (uint64_t round = 0; round < 5; round++) {
			for (size_t i = 0; i < 100; i++)
				b[i] = (struct kvr_lru_block){.seq = round * 50 + i, .local = 0};
			size_t before = kvr_ttl_count(t);
			uint64_t next = kvr_ttl_next_expiry(t);
			int rc = kvr_ttl_record(t, b, 100, 0, round * 60, &out);
			if (rc) {
				cr_assert_eq(rc, KVR_ENOMEM);
				cr_assert_eq(kvr_ttl_count(t), before);
				cr_assert_eq(kvr_ttl_next_expiry(t), next);
			}
			cr_assert_eq(kvr_ttl_check(t), 0, "nth %llu round %llu",
			             (unsigned long long)nth, (unsigned long long)round);
			before = kvr_ttl_count(t);
			rc = kvr_ttl_expire(t, round * 60, &out);
			if (rc)
				cr_assert_eq(kvr_ttl_count(t), before);
		}
		kvr_alloc_fail_after(0);
		kvr_ttl_destroy(t);
		kvr_lru_out_fini(&out);
	}
}
