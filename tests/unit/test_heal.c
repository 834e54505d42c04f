/* Self-healing predictions through the public API (kvr_request_cached, kvr_rank_observe; issue
 * 15).  A hidden engine - the per-block reference LRU (tests/ref/lru_ref.c), the policy the
 * router mirrors - diverges from the router's prediction: its real capacity is smaller than the
 * one registered, or it serves traffic the router never sees.  Fed the engine's cached tokens
 * and resident count, the prediction becomes exact again (Jaccard of the two block sets = 1);
 * without feedback it stays wrong.  Also: every documented error, and an out-of-memory loop. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../ref/lru_ref.h"
#include "core/alloc.h"
#include "kvrouter.h"
#include "tests/common/metric.h"
#include "tests/common/splitmix.h"

#define BS   16
#define MAXB 64

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Jaccard of the router's predicted blocks of rank 0 and the engine's. */
static double jaccard(struct kvr_router *r, struct ref_lru *eng)
{
	static uint64_t a[4096], b[4096];
	size_t na = 0, nb = ref_lru_hashes(eng, b, 4096);
	cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, a, 4096, &na), 0);
	qsort(a, na, sizeof(uint64_t), cmp_u64);
	qsort(b, nb, sizeof(uint64_t), cmp_u64);
	size_t i = 0, j = 0, both = 0;
	while (i < na && j < nb) {
		if (a[i] == b[j]) {
			both++;
			i++;
			j++;
		} else if (a[i] < b[j]) {
			i++;
		} else {
			j++;
		}
	}
	size_t uni = na + nb - both;
	return uni ? (double)both / (double)uni : 1.0;
}

static struct kvr_router *make(uint64_t capacity)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, capacity, 0), 0);
	return r;
}

/* A prompt of whole blocks: a prefix of one of 12 documents, sometimes diverging. */
static size_t gen(uint64_t *s, uint32_t *t, uint32_t salt)
{
	size_t nb = 1 + splitmix64(s) % 12;
	uint32_t doc = (uint32_t)(splitmix64(s) % 12);
	size_t div = splitmix64(s) % 3 == 0 ? splitmix64(s) % nb : nb;
	for (size_t i = 0; i < nb * BS; i++)
		t[i] = i / BS < div ? doc * 100000u + (uint32_t)i : salt * 7919u + (uint32_t)i;
	return nb * BS;
}

struct engine_req {
	uint64_t attempt, eng_id;
};

/*
 * Runs `steps` requests, two in flight, through the router and the hidden engine (capacity
 * eng_cap; `foreign` percent of extra requests only the engine sees, during the first
 * foreign_steps).  feedback: report each request's cached tokens and, after it, the engine's
 * resident count.  Returns the Jaccard after the last step; *min_after (if given) gets the
 * lowest Jaccard measured after `from` steps.
 */
/* feedback: FB_CACHED (cached tokens only) | FB_RESIDENT (and the resident count). */
#define FB_CACHED   1
#define FB_RESIDENT 2
#define FB_ALL      (FB_CACHED | FB_RESIDENT)

static double run(uint64_t seed, uint64_t reg_cap, uint64_t eng_cap, int foreign, int foreign_steps,
                  int steps, int feedback, int from, double *min_after)
{
	struct kvr_router *r = make(reg_cap);
	struct ref_lru *eng;
	struct kvr_lru_out eo;
	kvr_lru_out_init(&eo);
	cr_assert_eq(ref_lru_create(eng_cap, &eng), 0);
	ref_lru_set_keep_private(eng, true);
	uint64_t s = seed, eng_id = 1;
	uint32_t t[MAXB * BS];
	uint64_t local[MAXB], seq[MAXB];
	struct kvr_lru_block b[MAXB];
	struct engine_req fly[2] = {{0, 0}, {0, 0}};
	double j = 1.0, lo = 1.0;
	for (int step = 0; step < steps; step++) {
		if (step < foreign_steps && (int)(splitmix64(&s) % 100) < foreign) {
			size_t n = gen(&s, t, 900000 + (uint32_t)step) / BS;
			kvr_hash_blocks(t, n * BS, BS, NULL, local, seq);
			for (size_t i = 0; i < n; i++)
				b[i] = (struct kvr_lru_block){.local = local[i], .seq = seq[i]};
			cr_assert_eq(ref_lru_acquire(eng, eng_id, b, n, 0, &eo), 0);
			cr_assert_eq(ref_lru_release(eng, eng_id++, &eo), 0);
		}
		size_t nt = gen(&s, t, (uint32_t)step);
		size_t n = nt / BS;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = nt;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		kvr_hash_blocks(t, nt, BS, NULL, local, seq);
		for (size_t i = 0; i < n; i++)
			b[i] = (struct kvr_lru_block){.local = local[i], .seq = seq[i]};
		size_t cached = ref_lru_overlap(eng, seq, n);
		cr_assert_eq(ref_lru_acquire(eng, eng_id, b, n, 0, &eo), 0);
		/* This engine prefills at admission: the first token is out before the next step.
		 */
		cr_assert_eq(kvr_request_prefill_done(r, d.attempt), 0);
		if (feedback & FB_CACHED) {
			cr_assert_eq(kvr_request_cached(r, d.attempt, cached * BS), 0);
		}
		struct engine_req *old = &fly[step % 2];
		if (old->attempt) {
			cr_assert_eq(kvr_request_finish(r, old->attempt), 0);
			cr_assert_eq(ref_lru_release(eng, old->eng_id, &eo), 0);
		}
		*old = (struct engine_req){d.attempt, eng_id++};
		if (feedback & FB_RESIDENT) {
			struct kvr_lru_stats es;
			ref_lru_stats(eng, &es);
			struct kvr_rank_observation ob = {.flags = KVR_OBSERVE_RESIDENT,
			                                  .incarnation = 1,
			                                  .resident_blocks = es.resident};
			cr_assert_eq(kvr_rank_observe(r, (struct kvr_rank_id){0, 0}, &ob), 0);
		}
		j = jaccard(r, eng);
		if (step >= from && j < lo)
			lo = j;
	}
	if (min_after)
		*min_after = lo;
	ref_lru_destroy(eng);
	kvr_lru_out_fini(&eo);
	kvr_router_destroy(r);
	return j;
}

Test(heal, capacity_error_exact_with_feedback)
{
	/* Registered 64 blocks, the engine really has 48. */
	double lo = 0;
	double with = run(1, 64, 48, 0, 0, 400, FB_ALL, 0, &lo);
	cr_assert_eq(with, 1.0);
	cr_assert_eq(lo, 1.0, "exact after every request (lowest %.3f)", lo);
	double without = run(1, 64, 48, 0, 0, 400, 0, 0, NULL);
	cr_log_info("capacity error: Jaccard with feedback %.3f (lowest %.3f), without %.3f", with,
	            lo, without);
	cr_assert_lt(without, 0.9, "without feedback the prediction stays wrong (%.3f)", without);
}

Test(heal, foreign_traffic_heals_back_to_exact)
{
	/* 50 % extra requests the router never sees, for 150 steps; then only the router's. */
	double lo = 0;
	double with = run(2, 64, 64, 50, 150, 400, FB_ALL, 300, &lo);
	cr_assert_eq(with, 1.0, "feedback brings the Jaccard back to 1");
	cr_assert_eq(lo, 1.0, "and it stays there (lowest %.3f)", lo);
	double lo_without = 0;
	double without = run(2, 64, 64, 50, 150, 400, 0, 150, &lo_without);
	cr_log_info("foreign traffic: Jaccard at the end with feedback %.3f (lowest after step 300 "
	            "%.3f), without %.3f (lowest after step 150 %.3f)",
	            with, lo, without, lo_without);
	cr_assert_lt(lo_without, 1.0,
	             "without feedback the divergence outlives the foreign traffic");
}

/* Cached tokens alone (no rank observation) heal an under-registered capacity: an answer that
 * finds blocks the prediction had evicted proves a larger capacity (shards/lru_cap.c), and the
 * prediction's capacity follows it until the prediction is exact.  An over-registered one is
 * not healed here: its upper bounds are loose (an answer shows a block gone, not when it went),
 * and answers that prove nothing drift the estimate back up; it must at least do no harm. */
Test(heal, cached_tokens_alone_estimate_the_capacity)
{
	double over_lo = 0, under_lo = 0;
	double over = run(4, 64, 48, 0, 0, 400, FB_CACHED, 300, &over_lo);
	double over_without = run(4, 64, 48, 0, 0, 400, 0, 0, NULL);
	double under = run(5, 48, 64, 0, 0, 400, FB_CACHED, 300, &under_lo);
	double under_without = run(5, 48, 64, 0, 0, 400, 0, 0, NULL);
	cr_log_info("cached tokens only: registered 64 for 48: Jaccard %.3f (lowest after step 300 "
	            "%.3f), without %.3f; registered 48 for 64: %.3f (%.3f), without %.3f",
	            over, over_lo, over_without, under, under_lo, under_without);
	cr_assert_eq(under, 1.0, "under-registered: exact at the end");
	cr_assert_eq(under_lo, 1.0, "and from step 300 on (lowest %.3f)", under_lo);
	cr_assert_lt(under_without, 0.9, "without feedback it stays short (%.3f)", under_without);
	cr_assert_geq(over_lo, over_without, "over-registered: no worse (%.3f vs %.3f)", over_lo,
	              over_without);
}

Test(heal, errors_change_nothing)
{
	struct kvr_router *r = make(64);
	uint32_t t[4 * BS];
	for (size_t i = 0; i < 4 * BS; i++)
		t[i] = (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 4 * BS;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_request_cached(NULL, d.attempt, 0), KVR_EINVAL);
	cr_assert_eq(kvr_request_cached(r, 0, 0), KVR_EINVAL);
	cr_assert_eq(kvr_request_cached(r, d.attempt, 4 * BS + 1), KVR_EINVAL, "above the prompt");
	cr_assert_eq(kvr_request_cached(r, (d.attempt & ~0xffffull) | 0xfff0, 0), KVR_ENOENT);
	cr_assert_eq(kvr_request_cached(r, d.attempt, 4 * BS), 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_request_cached(r, d.attempt, 0), KVR_ESTALE, "stale stays stale");
	struct kvr_rank_observation ob = {
	    .flags = KVR_OBSERVE_RESIDENT, .incarnation = 1, .resident_blocks = 0};
	cr_assert_eq(kvr_rank_observe(NULL, id, &ob), KVR_EINVAL);
	cr_assert_eq(kvr_rank_observe(r, id, NULL), KVR_EINVAL);
	ob.flags = 0;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), KVR_EINVAL, "nothing observed");
	ob.flags = 8;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), KVR_EINVAL, "unknown flag");
	ob.flags = KVR_OBSERVE_RESIDENT;
	cr_assert_eq(kvr_rank_observe(r, (struct kvr_rank_id){7, 0}, &ob), KVR_ENOENT);
	ob.incarnation = 2;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), KVR_ESTALE, "another life of the rank");
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(r, id, NULL, 0, &n), KVR_ERANGE);
	cr_assert_eq(n, 4, "errors changed nothing");
	ob.incarnation = 1;
	ob.flags = KVR_OBSERVE_WATERMARK;
	ob.watermark_hash = 12345;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0, "an unknown watermark proves nothing");
	uint64_t seq[4];
	kvr_hash_blocks(t, 4 * BS, BS, NULL, NULL, seq);
	ob.watermark_hash = seq[1]; /* eviction order 4 3 2 1: blocks 3 and 4 are older */
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_rank_blocks(r, id, NULL, 0, &n), KVR_ERANGE);
	cr_assert_eq(n, 2);
	ob.flags = KVR_OBSERVE_RESIDENT;
	ob.resident_blocks = 0;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_rank_blocks(r, id, NULL, 0, &n), 0);
	cr_assert_eq(n, 0);
	kvr_router_destroy(r);
}

/* Fail the Nth allocation for N = 1, 2, ...: the new calls return 0 or KVR_ENOMEM, never
 * anything else, and the load still returns to zero. */
Test(heal, out_of_memory_loop)
{
	uint32_t t[6 * BS];
	for (size_t i = 0; i < 6 * BS; i++)
		t[i] = (uint32_t)(i * 3);
	int completed = 0;
	uint64_t nth;
	for (nth = 1; nth < 400 && !completed; nth++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.sync_booking = true;
		struct kvr_router *r = NULL;
		kvr_alloc_fail_after(nth);
		int rc = kvr_router_create(&c, &r);
		if (rc) {
			cr_assert_eq(rc, KVR_ENOMEM);
			continue;
		}
		struct kvr_rank_id id = {0, 0};
		int ok = kvr_rank_add(r, id, 1, 8, 0) == 0;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 6 * BS;
		struct kvr_decision d, d2;
		if (ok && kvr_route(r, &q, &d) == 0) {
			rc = kvr_request_finish(r, d.attempt);
			cr_assert_eq(rc, 0);
			if (kvr_route(r, &q, &d2) == 0) {
				rc = kvr_request_cached(r, d2.attempt, BS);
				cr_assert(rc == 0 || rc == KVR_ENOMEM, "cached: %d", rc);
				struct kvr_rank_observation ob = {.flags = KVR_OBSERVE_RESIDENT |
				                                           KVR_OBSERVE_WATERMARK,
				                                  .incarnation = 1,
				                                  .resident_blocks = 3,
				                                  .watermark_hash = 1};
				rc = kvr_rank_observe(r, id, &ob);
				cr_assert(rc == 0 || rc == KVR_ENOMEM, "observe: %d", rc);
				cr_assert_eq(kvr_request_finish(r, d2.attempt), 0);
			} else {
				ok = 0;
			}
		} else {
			ok = 0;
		}
		int fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		if (ok) {
			struct kvr_rank_stats st;
			cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
			cr_assert(st.active_requests == 0 && st.active_blocks == 0);
			completed = !fired;
		}
		kvr_router_destroy(r);
	}
	kvr_alloc_fail_after(0);
	cr_assert(completed, "the loop reached a run with enough memory");
	cr_assert_gt(nth, 10);
}

Test(heal, under_registered_capacity_is_raised)
{
	/* Registered 48 blocks, the engine really has 64: the resident count above 48 raises the
	 * prediction's capacity, and the prediction converges to the engine's. */
	double lo = 0;
	double with = run(3, 48, 64, 0, 0, 400, FB_ALL, 300, &lo);
	double without = run(3, 48, 64, 0, 0, 400, 0, 0, NULL);
	cr_log_info("under-registered: Jaccard with feedback %.3f (lowest after step 300 %.3f), "
	            "without %.3f",
	            with, lo, without);
	cr_assert_eq(with, 1.0);
	cr_assert_eq(lo, 1.0, "exact after every request from step 300 (lowest %.3f)", lo);
	cr_assert_lt(without, 0.9, "without feedback the prediction stays short (%.3f)", without);

	struct kvr_router *r = make(8);
	struct kvr_rank_id id = {0, 0};
	struct kvr_rank_observation ob = {
	    .flags = KVR_OBSERVE_RESIDENT, .incarnation = 1, .resident_blocks = 8};
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_test_metric(r, "kvr_heal_capacity_raised_total"), 0,
	             "at the capacity: no raise");
	ob.resident_blocks = 12;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_test_metric(r, "kvr_heal_capacity_raised_total"), 1);
	ob.resident_blocks = 10;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_test_metric(r, "kvr_heal_capacity_raised_total"), 1,
	             "12 is the capacity now");
	kvr_router_destroy(r);
}

/* Routes a 4-block prompt of t (8 blocks' room) and ends it: 4 blocks cached, inactive.  q is
 * left pointing at t for the caller's next prompt. */
static void four_cached(struct kvr_router *r, uint32_t *t, struct kvr_request *q)
{
	for (size_t i = 0; i < 8 * BS; i++)
		t[i] = 1000u + (uint32_t)i;
	kvr_request_init(q);
	q->tokens = t;
	q->n_tokens = 4 * BS;
	struct kvr_decision a;
	cr_assert_eq(kvr_route(r, q, &a), 0);
	cr_assert_eq(kvr_request_prefill_done(r, a.attempt), 0);
	cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
}

/* After four_cached: routes another prompt in t through q, 6 new blocks, as b (not prefilled). */
static void six_new(struct kvr_router *r, uint32_t *t, struct kvr_request *q,
                    struct kvr_decision *b)
{
	for (size_t i = 0; i < 8 * BS; i++)
		t[i] = 5000u + (uint32_t)i;
	q->n_tokens = 6 * BS;
	cr_assert_eq(kvr_route(r, q, b), 0);
}

/* A routed request the engine has not admitted yet (no first token): its new blocks are in the
 * prediction, not in the engine's count, so a resident count taken then proves nothing about
 * them; it must not evict cached blocks the engine still holds.  Once its prefill is done the
 * same count does prove the older blocks gone. */
Test(heal, resident_count_waits_for_unadmitted_requests)
{
	struct kvr_router *r = make(1000);
	struct kvr_rank_id id = {0, 0};
	uint32_t t[8 * BS];
	struct kvr_request q;
	struct kvr_decision b;
	four_cached(r, t, &q);
	six_new(r, t, &q, &b); /* waiting in the engine: 6 new blocks */
	static uint64_t blk[64];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(r, id, blk, 64, &n), 0);
	cr_assert_eq(n, 10);
	/* The engine holds the first request's 4 blocks and nothing of the second yet. */
	struct kvr_rank_observation ob = {
	    .flags = KVR_OBSERVE_RESIDENT, .incarnation = 1, .resident_blocks = 4};
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_rank_blocks(r, id, blk, 64, &n), 0);
	cr_assert_eq(n, 10, "nothing evicted: the 6 are not allocated yet (%zu left)", n);
	cr_assert_eq(kvr_test_metric(r, "kvr_heal_evicted_blocks_total"), 0);
	/* Prefilled: the engine holds 6 + 4, but reports 6: the 4 older ones went. */
	cr_assert_eq(kvr_request_prefill_done(r, b.attempt), 0);
	ob.resident_blocks = 6;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	cr_assert_eq(kvr_rank_blocks(r, id, blk, 64, &n), 0);
	cr_assert_eq(n, 6);
	cr_assert_eq(kvr_test_metric(r, "kvr_heal_evicted_blocks_total"), 4);
	cr_assert_eq(kvr_request_finish(r, b.attempt), 0);
	kvr_router_destroy(r);
}

/* A resident count no engine can have (a scrape gone wrong: 2^64 - 1) raises the capacity
 * estimate, as any count above it does.  Two things must not follow from it: the capacity
 * estimator's ghosts (lru_cap.c) sized by that estimate at the next cached-tokens answer (half
 * of it, capped at 2^31 hashes: 16 GB of ring, a map as large, and the answer's KVR_ENOMEM;
 * found by fuzz_api's op_heal, a shard at 9 GB), and a count just below it, with a request
 * still prefilling, wrapping the eviction target (resident + unallocated) to a few blocks,
 * which evicted every cached block the engine had just said it holds. */
Test(heal, absurd_resident_counts_cost_no_memory_and_evict_nothing)
{
	struct kvr_router *r = make(1000);
	struct kvr_rank_id id = {0, 0};
	uint32_t t[8 * BS];
	struct kvr_request q;
	struct kvr_decision b;
	four_cached(r, t, &q);
	struct kvr_rank_observation ob = {
	    .flags = KVR_OBSERVE_RESIDENT, .incarnation = 1, .resident_blocks = UINT64_MAX};
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	six_new(r, t, &q, &b); /* 6 new blocks, not allocated by the engine yet */
	int64_t before = kvr_alloc_live_bytes();
	cr_assert_eq(kvr_request_cached(r, b.attempt, 0), 0, "the first answer turns ghosts on");
	int64_t grown = kvr_alloc_live_bytes() - before;
	cr_assert_lt(grown, 1 << 20, "ghosts for a prediction of 10 blocks took %lld bytes",
	             (long long)grown);
	ob.resident_blocks = UINT64_MAX - 1;
	cr_assert_eq(kvr_rank_observe(r, id, &ob), 0);
	static uint64_t blk[64];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(r, id, blk, 64, &n), 0);
	cr_assert_eq(n, 10, "a count above everything evicted %zu blocks", 10 - n);
	cr_assert_eq(kvr_test_metric(r, "kvr_heal_evicted_blocks_total"), 0);
	cr_assert_eq(kvr_request_finish(r, b.attempt), 0);
	kvr_router_destroy(r);

	/* The same for a registration in bytes instead of blocks (2^40). */
	r = make(1ull << 40);
	cr_assert_eq(kvr_route(r, &q, &b), 0);
	before = kvr_alloc_live_bytes();
	cr_assert_eq(kvr_request_cached(r, b.attempt, 0), 0);
	grown = kvr_alloc_live_bytes() - before;
	cr_assert_lt(grown, 1 << 20, "ghosts for a registration of 2^40 took %lld bytes",
	             (long long)grown);
	cr_assert_eq(kvr_request_finish(r, b.attempt), 0);
	kvr_router_destroy(r);
}
