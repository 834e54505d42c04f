/* Active load (shards/load): dedup of pinned blocks, prefill tokens with linear decay of the
 * oldest in-prefill request, potential load, every unknown/duplicate case, and a differential
 * test against a brute-force model AND the per-block tracker it replaced (tests/ref/load_ref.c),
 * on chained hashes (seed printed on failure; LOAD_DIFF_SEED=<seed>), in which two ranks'
 * loads publish their runs in one shards/pinmap.h table and the routers' reading of it must give
 * every rank's pinned depth exactly. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "core/alloc.h"
#include "../ref/load_ref.h"
#include "shards/load.h"
#include "shards/pinmap.h"
#include "sync/rcu.h"
#include "tests/common/splitmix.h"

/* The blocks pinned by live requests, each counted once however many pin it. */
static uint64_t active_blocks(struct kvr_load *l)
{
	struct kvr_load_stats st;
	kvr_load_stats(l, &st);
	return st.active_blocks;
}

Test(load, dedup_and_potential)
{
	struct kvr_load *l;
	struct kvr_load_potential p;
	struct kvr_load_stats st;
	cr_assert_eq(kvr_load_create(0, &l), 0);
	cr_assert_eq(kvr_load_add(l, 1, (uint64_t[]){10, 11, 12}, 1, 3, 100, 0), 0);
	cr_assert_eq(kvr_load_add(l, 2, (uint64_t[]){10, 11, 20}, 1, 3, 40, 0), 0);
	cr_assert_eq(kvr_load_add(l, 2, (uint64_t[]){1}, 1, 1, 1, 0), KVR_EEXIST);
	kvr_load_stats(l, &st);
	cr_assert_eq(st.active_blocks, 4, "10 and 11 pinned twice count once");
	cr_assert_eq(st.active_requests, 2);
	cr_assert_eq(kvr_load_prefill_tokens(l, 5), 140);
	cr_assert_eq(kvr_load_potential(l, (uint64_t[]){10, 11, 30, 31}, 4, 64, 5, &p), 0);
	cr_assert_eq(p.decode_blocks, 6, "4 active + 30, 31");
	cr_assert_eq(p.prefill_tokens, 204);
	cr_assert_eq(kvr_load_prefill_done(l, 1), 0);
	cr_assert_eq(kvr_load_prefill_done(l, 1), 0, "idempotent");
	cr_assert_eq(kvr_load_prefill_tokens(l, 5), 40);
	cr_assert_eq(kvr_load_add_output(l, 1, (uint64_t[]){13}, 1, 1), 0);
	cr_assert_eq(active_blocks(l), 5);
	cr_assert_eq(kvr_load_finish(l, 1), 0);
	cr_assert_eq(kvr_load_finish(l, 1), KVR_ENOENT, "already finished");
	cr_assert_eq(kvr_load_prefill_done(l, 1), KVR_ENOENT);
	cr_assert_eq(kvr_load_add_output(l, 1, (uint64_t[]){14}, 1, 1), KVR_ENOENT);
	cr_assert_eq(active_blocks(l), 3, "10, 11 still pinned by 2");
	cr_assert_eq(kvr_load_finish(l, 2), 0);
	kvr_load_stats(l, &st);
	cr_assert_eq(st.active_blocks, 0);
	cr_assert_eq(st.prefill_tokens, 0);
	cr_assert_eq(kvr_load_potential(l, NULL, 0, 7, 0, &p), 0);
	cr_assert_eq(p.decode_blocks, 0);
	cr_assert_eq(p.prefill_tokens, 7);
	cr_assert_eq(kvr_load_potential(l, NULL, 1, 7, 0, &p), KVR_EINVAL);
	cr_assert_eq(kvr_load_add(l, 3, NULL, 1, 2, 0, 0), KVR_EINVAL);
	kvr_load_destroy(l);
	kvr_load_destroy(NULL);
}

/* A prompt whose pinned blocks lie in more runs than the walk's first room (16 hit pieces) is
 * walked again with more (pin): here 64 blocks in 32 runs (31 requests split the first one's run
 * every 2 blocks), pinned once more, counted once, and released. */
Test(load, pin_across_many_runs)
{
	struct kvr_load *l;
	cr_assert_eq(kvr_load_create(0, &l), 0);
	uint64_t seq[64];
	for (int i = 0; i < 64; i++)
		seq[i] = 1000 + (uint64_t)i;
	cr_assert_eq(kvr_load_add(l, 1, seq, 1, 64, 0, 0), 0);
	for (uint64_t k = 1; k < 32; k++) {
		uint64_t p[65];
		memcpy(p, seq, 2 * k * sizeof(uint64_t));
		p[2 * k] = 5000 + k; /* a branch: the run splits after block 2k */
		cr_assert_eq(kvr_load_add(l, 1 + k, p, 1, 2 * k + 1, 0, 0), 0);
	}
	cr_assert_eq(active_blocks(l), 64 + 31);
	cr_assert_eq(kvr_load_add(l, 100, seq, 1, 64, 0, 0), 0);
	cr_assert_eq(active_blocks(l), 64 + 31, "the prompt's blocks were all pinned already");
	cr_assert_eq(kvr_load_pinned_depth(l, seq, 64), 64);
	for (uint64_t a = 1; a <= 32; a++)
		cr_assert_eq(kvr_load_finish(l, a), 0);
	cr_assert_eq(active_blocks(l), 64, "the last request holds them");
	cr_assert_eq(kvr_load_finish(l, 100), 0);
	cr_assert_eq(active_blocks(l), 0);
	kvr_load_destroy(l);
}

/* Crafted hashes (kvr_request does not check that a caller's hashes chain): a root whose hash is
 * another chain's interior hash.  The split made by a third request gave that hash a second head
 * entry; when the split's run was freed, the crafted run's entry went instead and the map named a
 * freed run, which the next walk read (ASan: SEGV in walk; a router's shard thread died the same
 * way, test_regress crafted_root_on_an_interior_hash).  Found by fuzz_api_seeds --craft. */
Test(load, crafted_root_on_an_interior_hash)
{
	struct kvr_load *l;
	struct kvr_load_stats st;
	cr_assert_eq(kvr_load_create(0, &l), 0);
	cr_assert_eq(kvr_load_add(l, 1, (uint64_t[]){10, 11, 12, 13}, 1, 4, 0, 0), 0);
	cr_assert_eq(kvr_load_add(l, 2, (uint64_t[]){12, 99}, 1, 2, 0, 0), 0); /* crafted root */
	cr_assert_eq(kvr_load_add(l, 3, (uint64_t[]){10, 11, 50}, 1, 3, 0, 0), 0); /* split at 12 */
	cr_assert_eq(kvr_load_finish(l, 1), 0);
	cr_assert_eq(kvr_load_finish(l, 3), 0); /* frees the run the split made, headed by 12 */
	cr_assert_eq(active_blocks(l), 2, "request 2's blocks");
	cr_assert_eq(kvr_load_pinned_depth(l, (uint64_t[]){12, 99, 7}, 3), 2);
	cr_assert_eq(kvr_load_add(l, 4, (uint64_t[]){12, 99, 7}, 1, 3, 0, 0), 0);
	cr_assert_eq(kvr_load_add(l, 5, (uint64_t[]){10, 11, 12, 13}, 1, 4, 0, 0), 0);
	cr_assert_eq(active_blocks(l), 3 + 4);
	for (uint64_t a = 2; a <= 5; a++)
		if (a != 3)
			cr_assert_eq(kvr_load_finish(l, a), 0);
	kvr_load_stats(l, &st);
	cr_assert_eq(st.active_blocks, 0);
	cr_assert_eq(st.active_requests, 0);
	kvr_load_destroy(l);
}

/* A crafted prompt that repeats a hash comes back to a run its walk already took: the second hit
 * split the first one's run after the first was counted, so the finish unpinned a run the request
 * never pinned (request 1's blocks 12, 13 freed under it: 2 active blocks left instead of 4, then
 * a double free).  Now the walk stops there and the rest is a run of its own. */
Test(load, crafted_prompt_repeating_a_hash)
{
	struct kvr_load *l;
	cr_assert_eq(kvr_load_create(0, &l), 0);
	cr_assert_eq(kvr_load_add(l, 1, (uint64_t[]){10, 11, 12, 13}, 1, 4, 0, 0), 0);
	cr_assert_eq(kvr_load_add(l, 2, (uint64_t[]){10, 11, 12, 13, 10, 11}, 1, 6, 0, 0), 0);
	cr_assert_geq(active_blocks(l), 4);
	cr_assert_eq(kvr_load_add_output(l, 2, (uint64_t[]){10, 11, 12}, 1, 3), 0);
	cr_assert_eq(kvr_load_finish(l, 2), 0);
	cr_assert_eq(active_blocks(l), 4, "request 1 still holds its 4 blocks");
	cr_assert_eq(kvr_load_pinned_depth(l, (uint64_t[]){10, 11, 12, 13}, 4), 4);
	cr_assert_eq(kvr_load_finish(l, 1), 0);
	cr_assert_eq(active_blocks(l), 0);
	kvr_load_destroy(l);
}

Test(load, oldest_prefill_decays_linearly)
{
	struct kvr_load *l;
	cr_assert_eq(kvr_load_create(1000, &l), 0);
	kvr_load_add(l, 1, NULL, 1, 0, 100, 0);
	kvr_load_add(l, 2, NULL, 1, 0, 50, 200);
	cr_assert_eq(kvr_load_prefill_tokens(l, 0), 150);
	cr_assert_eq(kvr_load_prefill_tokens(l, 250), 75 + 50, "only the oldest decays");
	cr_assert_eq(kvr_load_prefill_tokens(l, 1000), 50);
	cr_assert_eq(kvr_load_prefill_tokens(l, 5000), 50, "never negative");
	kvr_load_prefill_done(l, 1); /* 2 becomes the oldest: decays from its own start */
	cr_assert_eq(kvr_load_prefill_tokens(l, 700), 25);
	cr_assert_eq(kvr_load_prefill_tokens(l, 100), 50, "clock before start: no decay");
	kvr_load_finish(l, 2);
	cr_assert_eq(kvr_load_prefill_tokens(l, 700), 0);
	kvr_load_add(l, 3, NULL, 1, 0, 10, 800);
	cr_assert_eq(kvr_load_prefill_tokens(l, 900), 9);
	kvr_load_destroy(l);
}

/* ---------------------------------------------------------------- differential */

#define MAXR 64
#define HMAX 64 /* hashes 1..63: h's parent is h / 2, 1 hangs below the root */
struct mreq {
	bool live, in_prefill;
	uint64_t attempt, tokens, start, order;
	uint64_t seq[64];
	int n;
};

static bool m_pinned(struct mreq *m, uint64_t s)
{
	for (int i = 0; i < MAXR; i++)
		if (m[i].live)
			for (int k = 0; k < m[i].n; k++)
				if (m[i].seq[k] == s)
					return true;
	return false;
}

static uint64_t m_blocks(struct mreq *m)
{
	uint64_t n = 0;
	for (uint64_t s = 1; s < HMAX; s++)
		n += m_pinned(m, s);
	return n;
}

static uint64_t m_prefill(struct mreq *m, uint64_t d, uint64_t now)
{
	uint64_t sum = 0;
	struct mreq *old = NULL;
	for (int i = 0; i < MAXR; i++)
		if (m[i].live && m[i].in_prefill) {
			sum += m[i].tokens;
			if (!old || m[i].order < old->order)
				old = &m[i];
		}
	if (d && old) {
		uint64_t el = now > old->start ? now - old->start : 0;
		uint64_t kept = el >= d ? 0 : old->tokens * (d - el) / d;
		sum = sum - old->tokens + kept;
	}
	return sum;
}

/* p[2i + 1] = seq[i], p[2i] a hash no chain holds (as struct kvr_lru_block's local field). */
static void interleave(uint64_t *p, const uint64_t *seq, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		p[2 * i] = ~seq[i];
		p[2 * i + 1] = seq[i];
	}
}

static void run_seed(uint64_t seed, int steps)
{
	uint64_t r = seed, d = splitmix64(&r) % 2 ? 1 + splitmix64(&r) % 1000 : 0, now = 0,
	         order = 0;
	static struct mreq m[MAXR];
	memset(m, 0, sizeof(m));
	struct kvr_load *l, *l2;
	struct ref_load *x;
	struct kvr_pinmap *pm;
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	cr_assert_eq(kvr_pinmap_create(&pm), 0);
	cr_assert_eq(kvr_load_create(d, &l), 0);
	cr_assert_eq(kvr_load_create(d, &l2), 0);
	cr_assert_eq(kvr_load_publish(l, pm, 5), 0);
	cr_assert_eq(kvr_load_publish(l2, pm, 9), 0); /* a second rank: the odd attempts */
	cr_assert_eq(ref_load_create(d, &x), 0);
	uint64_t seq[16];
	uint64_t pairs[32]; /* seq interleaved with noise: the second rank reads it strided */
	for (int step = 0; step < steps; step++) {
		uint64_t op = splitmix64(&r) % 10, a = 1 + splitmix64(&r) % MAXR;
		struct mreq *q = &m[a - 1];
		int rc, want, xrc;
		if (op < 3) {
			size_t n = splitmix64(&r) % 7;
			for (size_t i = 0; i < n; i++) {
				seq[i] = i ? 2 * seq[i - 1] + splitmix64(&r) % 2 : 1;
				if (seq[i] >= HMAX) {
					n = i;
					break;
				}
			}
			uint64_t tok = splitmix64(&r) % 1000;
			rc = kvr_load_add(l, a, seq, 1, n, tok, now);
			interleave(pairs, seq, n);
			if (a % 2)
				kvr_load_add(l2, a, pairs + 1, 2, n, tok, now);
			xrc = ref_load_add(x, a, seq, n, tok, now);
			want = q->live ? KVR_EEXIST : 0;
			if (!q->live) {
				*q = (struct mreq){.live = 1,
				                   .in_prefill = 1,
				                   .attempt = a,
				                   .tokens = tok,
				                   .start = now,
				                   .order = order++,
				                   .n = (int)n};
				memcpy(q->seq, seq, n * sizeof(uint64_t));
			}
		} else if (op < 5) {
			rc = kvr_load_prefill_done(l, a);
			xrc = ref_load_prefill_done(x, a);
			want = q->live ? 0 : KVR_ENOENT;
			q->in_prefill = false;
		} else if (op < 6) {
			size_t n = splitmix64(&r) % 3;
			uint64_t par = q->live && q->n ? q->seq[q->n - 1] : 0;
			for (size_t i = 0; i < n; i++) {
				uint64_t p = i ? seq[i - 1] : par;
				seq[i] = p ? 2 * p + splitmix64(&r) % 2 : 1;
				if (seq[i] >= HMAX) {
					n = i;
					break;
				}
			}
			if (q->live && q->n + (int)n > 64)
				n = 0;
			rc = kvr_load_add_output(l, a, seq, 1, n);
			interleave(pairs, seq, n);
			if (a % 2)
				kvr_load_add_output(l2, a, pairs + 1, 2, n);
			xrc = ref_load_add_output(x, a, seq, n);
			want = q->live ? 0 : KVR_ENOENT;
			if (q->live)
				for (size_t i = 0; i < n; i++)
					q->seq[q->n++] = seq[i];
		} else if (op < 8) {
			rc = kvr_load_finish(l, a);
			if (a % 2)
				kvr_load_finish(l2, a);
			xrc = ref_load_finish(x, a);
			want = q->live ? 0 : KVR_ENOENT;
			q->live = false;
		} else {
			now += splitmix64(&r) % 300;
			rc = want = xrc = 0;
		}
		cr_assert_eq(rc, want, "seed %llu step %d", (unsigned long long)seed, step);
		cr_assert_eq(rc, xrc, "seed %llu step %d", (unsigned long long)seed, step);
		struct kvr_load_stats xs;
		ref_load_stats(x, &xs);
		struct kvr_load_stats st;
		kvr_load_stats(l, &st);
		cr_assert_eq(st.active_blocks, m_blocks(m), "seed %llu step %d",
		             (unsigned long long)seed, step);
		cr_assert_eq(st.active_blocks, xs.active_blocks, "seed %llu step %d",
		             (unsigned long long)seed, step);
		cr_assert_eq(st.publish_errors, 0);
		cr_assert_eq(kvr_load_prefill_tokens(l, now), m_prefill(m, d, now),
		             "seed %llu step %d", (unsigned long long)seed, step);
		size_t n = splitmix64(&r) % 7;
		uint64_t fresh = 0;
		for (size_t i = 0; i < n; i++) {
			seq[i] = i ? 2 * seq[i - 1] + splitmix64(&r) % 2 : 1;
			if (seq[i] >= HMAX) {
				n = i;
				break;
			}
			fresh += !m_pinned(m, seq[i]);
		}
		struct kvr_load_potential p;
		kvr_load_potential(l, seq, n, 5, now, &p);
		size_t want_depth = kvr_load_pinned_depth(l, seq, n);
		cr_assert_eq(want_depth + fresh, n, "seed %llu step %d", (unsigned long long)seed,
		             step);
		/* The routers' reading: both ranks' depths in one walk of the table. */
		static uint32_t depth[16], slots[16];
		kvr_rcu_read_lock();
		size_t ns = kvr_pinmap_depths(pm, seq, n, depth, slots);
		kvr_rcu_read_unlock();
		cr_assert_eq(depth[5], want_depth, "seed %llu step %d: published depth",
		             (unsigned long long)seed, step);
		cr_assert_eq(depth[9], kvr_load_pinned_depth(l2, seq, n),
		             "seed %llu step %d: rank 2's published depth",
		             (unsigned long long)seed, step);
		cr_assert_eq(ns, (size_t)(depth[5] > 0) + (depth[9] > 0));
		for (size_t i = 0; i < ns; i++)
			depth[slots[i]] = 0;
		cr_assert(p.decode_blocks == m_blocks(m) + fresh &&
		              p.prefill_tokens == m_prefill(m, d, now) + 5,
		          "seed %llu step %d: potential", (unsigned long long)seed, step);
	}
	kvr_load_destroy(l);
	kvr_load_destroy(l2);
	ref_load_destroy(x);
	kvr_rcu_barrier(); /* the runs go after a grace period, then the table */
	kvr_pinmap_destroy(pm);
}

Test(load, differential_against_model)
{
	const char *env = getenv("LOAD_DIFF_SEED");
	if (env) {
		run_seed(strtoull(env, NULL, 0), 5000);
		return;
	}
	for (uint64_t seed = 1; seed <= 200; seed++)
		run_seed(seed, 300);
}

/* Fail the Nth allocation for N = 1, 2, ...: a failed command changes nothing; with the runs
 * published, the routers' reading equals the load's own walk after every command (or, where the
 * table could not grow, under-counts: counted in publish_errors). */
Test(load, out_of_memory_changes_nothing)
{
	uint64_t seq[40];
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	for (int publish = 0; publish < 2; publish++) {
		for (uint64_t nth = 1; nth < 80; nth++) {
			struct kvr_load *l;
			struct kvr_pinmap *pm = NULL;
			cr_assert_eq(kvr_load_create(100, &l), 0);
			if (publish) {
				cr_assert_eq(kvr_pinmap_create(&pm), 0);
				cr_assert_eq(kvr_load_publish(l, pm, 3), 0);
			}
			kvr_alloc_fail_after(nth);
			for (uint64_t a = 1; a <= 30; a++) {
				for (size_t i = 0; i < 40; i++) /* a shared prefix, then a's own */
					seq[i] = i < 10 ? i + 1 : a * 1000 + i;
				struct kvr_load_stats before, after;
				kvr_load_stats(l, &before);
				int rc = kvr_load_add(l, a, seq, 1, 40, 10, a);
				kvr_load_stats(l, &after);
				if (rc) {
					cr_assert_eq(rc, KVR_ENOMEM);
					cr_assert_eq(memcmp(&before, &after, sizeof(before)), 0);
					cr_assert_eq(kvr_load_finish(l, a), KVR_ENOENT);
					continue;
				}
				if (pm) {
					uint32_t depth[4] = {0}, slots[4];
					kvr_rcu_read_lock();
					kvr_pinmap_depths(pm, seq, 40, depth, slots);
					kvr_rcu_read_unlock();
					size_t want = kvr_load_pinned_depth(l, seq, 40);
					if (after.publish_errors)
						cr_assert_leq(depth[3], want);
					else
						cr_assert_eq(
						    depth[3], want, "nth %llu attempt %llu",
						    (unsigned long long)nth, (unsigned long long)a);
				}
				for (size_t i = 0; i < 40; i++)
					seq[i] = 100000 + a * 40 + i;
				kvr_load_stats(l, &before);
				rc = kvr_load_add_output(l, a, seq, 1, 40);
				kvr_load_stats(l, &after);
				if (rc) {
					cr_assert_eq(rc, KVR_ENOMEM);
					cr_assert_eq(memcmp(&before, &after, sizeof(before)), 0);
				}
				if (a % 3 == 0)
					cr_assert_eq(kvr_load_finish(l, a), 0);
			}
			kvr_alloc_fail_after(0);
			kvr_load_destroy(l);
			kvr_rcu_barrier();
			cr_assert_eq(kvr_pinmap_runs(pm), 0);
			kvr_pinmap_destroy(pm);
		}
	}
}

/* Two ranks publish into one table: a prompt's pinned depth on each, a run split on one rank
 * by a request that leaves it (the reader continues through both halves), a finish that frees
 * runs (the depth drops at once), an output that extends a chain. */
Test(load, published_pinned_depth)
{
	struct kvr_pinmap *pm;
	struct kvr_load *a, *b;
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	cr_assert_eq(kvr_pinmap_create(&pm), 0);
	cr_assert_eq(kvr_load_create(0, &a), 0);
	cr_assert_eq(kvr_load_create(0, &b), 0);
	cr_assert_eq(kvr_load_publish(a, pm, 1), 0);
	cr_assert_eq(kvr_load_publish(b, pm, 2), 0);
	uint32_t depth[4] = {0}, slots[4];
	uint64_t p[6] = {1, 2, 3, 4, 5, 6}, q[4] = {1, 2, 30, 40};
	cr_assert_eq(kvr_load_add(a, 10, p, 1, 4, 0, 0), 0);      /* rank 1 pins 1 2 3 4 */
	cr_assert_eq(kvr_load_add(b, 11, p, 1, 2, 0, 0), 0);      /* rank 2 pins 1 2 */
	cr_assert_eq(kvr_load_add(a, 12, q, 1, 4, 0, 0), 0);      /* splits rank 1's run after 2 */
	cr_assert_eq(kvr_load_add_output(a, 10, p + 4, 1, 2), 0); /* rank 1: ... 4 5 6 */
	kvr_rcu_read_lock();
	size_t ns = kvr_pinmap_depths(pm, p, 6, depth, slots);
	kvr_rcu_read_unlock();
	cr_assert_eq(ns, 2);
	cr_assert(depth[1] == 6 && depth[2] == 2, "through the split: %u %u", depth[1], depth[2]);
	depth[1] = depth[2] = 0;
	kvr_rcu_read_lock();
	ns = kvr_pinmap_depths(pm, q, 4, depth, slots);
	kvr_rcu_read_unlock();
	cr_assert(ns == 2 && depth[1] == 4 && depth[2] == 2);
	depth[1] = depth[2] = 0;
	cr_assert_eq(kvr_load_finish(a, 10), 0); /* 3 4 5 6 go from rank 1 */
	uint64_t r[8] = {1, 2, 3, 4, 5, 6, 7, 8};
	kvr_rcu_read_lock();
	ns = kvr_pinmap_depths(pm, r, 8, depth, slots);
	kvr_rcu_read_unlock();
	cr_assert(ns == 2 && depth[1] == 2 && depth[2] == 2, "%u %u", depth[1], depth[2]);
	depth[1] = depth[2] = 0;
	uint64_t none[2] = {99, 100};
	kvr_rcu_read_lock();
	cr_assert_eq(kvr_pinmap_depths(pm, none, 2, depth, slots), 0);
	kvr_rcu_read_unlock();
	kvr_load_destroy(a);
	kvr_load_destroy(b);
	kvr_rcu_barrier();
	kvr_pinmap_destroy(pm);
}
