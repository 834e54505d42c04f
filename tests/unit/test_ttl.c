/* TTL retention (shards/ttl): record, refresh, bucketed expiry, clock steps back, out of
 * memory; and the per-block oracle (tests/ref/ttl_ref.c) against an array model on arbitrary
 * hashes (seed printed on failure; TTL_DIFF_SEED=<seed>).  shards/ttl against the oracle on
 * chained hashes: tests/unit/test_ttl_diff.c. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "core/alloc.h"
#include "shards/ttl.h"
#include "../ref/ttl_ref.h"
#include "lru_out_util.h"

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

/* ---------------------------------------------------------------- differential */

#define U 64
struct mentry {
	bool live;
	uint64_t expiry;
	uint32_t pos;
};

static uint64_t rng(uint64_t *s)
{
	uint64_t x = *s += 0x9E3779B97F4A7C15ull;
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
	x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
	return x ^ (x >> 31);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void run_seed(uint64_t seed, int steps)
{
	uint64_t r = seed, ttl = 1 + rng(&r) % 500, bucket = rng(&r) % 3 ? rng(&r) % 100 : 0;
	struct mentry m[U];
	memset(m, 0, sizeof(m));
	struct ref_ttl *t;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	cr_assert_eq(ref_ttl_create(ttl, bucket, &t), 0);
	uint64_t now = 1000;
	struct kvr_lru_block b[16];
	for (int step = 0; step < steps; step++) {
		uint64_t op = rng(&r) % 10;
		if (op < 5) {
			size_t n = rng(&r) % 16;
			uint32_t start = (uint32_t)(rng(&r) % 8);
			for (size_t i = 0; i < n; i++)
				b[i] = (struct kvr_lru_block){.seq = rng(&r) % U, .local = 0};
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
			if (rng(&r) % 20 == 0 && now > 200)
				now -= rng(&r) % 200;
			else
				now += rng(&r) % 300;
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
