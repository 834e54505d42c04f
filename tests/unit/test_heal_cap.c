/* The capacity estimate of the approximate LRU (shards/lru_cap.c, issue 15) on hand-worked
 * states: a cached-tokens answer that finds blocks the prediction had evicted (ghosts) proves a
 * lower bound on the engine's capacity and raises the estimate past a too small registration;
 * the first block missed being a ghost bounds it from above; an answer below the prediction
 * bounds it from above after evicting through the missed block, and the estimate falls; answers
 * that prove nothing drift back toward the registration (or, once an answer proved the
 * registration too small, explore above it); a registration resets it all. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "lru_out_util.h"
#include "shards/lru.h"

static struct kvr_lru *lru;
static struct kvr_lru_out out;
static struct kvr_lru_heal h;

static void teardown(void)
{
	kvr_lru_destroy(lru);
	lru = NULL;
	kvr_lru_out_fini(&out);
}

static void make(uint64_t cap)
{
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(cap, &lru), 0);
}

TestSuite(heal_cap, .fini = teardown);

static void acq(uint64_t attempt, const uint64_t *v, size_t n)
{
	struct kvr_lru_block b[16];
	for (size_t i = 0; i < n; i++)
		b[i] = (struct kvr_lru_block){.local = v[i] + 1000, .seq = v[i]};
	cr_assert_eq(kvr_lru_acquire(lru, attempt, b, n, 0, &out), 0);
}

static void rel(uint64_t attempt)
{
	cr_assert_eq(kvr_lru_release(lru, attempt, &out), 0);
}

static void cached(uint64_t attempt, uint32_t depth)
{
	cr_assert_eq(kvr_lru_heal_cached(lru, attempt, depth, 0, &h, &out), 0);
}

static uint64_t capacity(void)
{
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
	return st.capacity;
}

Test(heal_cap, ghosts_prove_a_larger_capacity)
{
	make(4); /* the engine really holds 7 (or more) */
	acq(1, (uint64_t[]){1, 2, 3}, 3);
	cached(1, 0); /* the first answer turns the ghosts on; it proves nothing */
	cr_assert(h.lower == 0 && h.upper == 0 && h.capacity == 4);
	rel(1);                          /* inactive [1 2 3] */
	acq(2, (uint64_t[]){10, 11}, 2); /* 5 > 4: 3 goes (ghost 3) */
	rel(2);
	acq(3, (uint64_t[]){20, 21}, 2); /* 2, 1 go (ghosts 3 2 1) */
	rel(3);
	acq(4, (uint64_t[]){1, 2, 3, 4},
	    4); /* predicted 0; 11 10 21 20 go: ghosts 3 2 1 11 10 21 20 */
	cr_assert_eq(h.predicted, 0);
	/* The engine found 1 2 3: it held 3, evicted before everything else the router evicted,
	 * so it held all seven: the capacity is at least 7.  The estimate goes half way. */
	cached(4, 3);
	cr_assert_eq(h.lower, 7);
	cr_assert_eq(h.upper, 0);
	cr_assert_eq(h.capacity, 6);
	cr_assert_eq(capacity(), 6);
	/* The first missed block is a ghost (10): the engine holds at most what the router holds
	 * now (4 + the 3 new blocks) and the ghosts evicted after it (21 20): 9.  The estimate is
	 * below: nothing moves. */
	acq(5, (uint64_t[]){10, 11, 12}, 3);
	cached(5, 0);
	cr_assert_eq(h.upper, 9);
	cr_assert_eq(capacity(), 6);
	/* An answer that proves nothing: the registration is known too small, so explore. */
	acq(6, (uint64_t[]){30}, 1);
	cached(6, 0);
	cr_assert(h.lower == 0 && h.upper == 0);
	cr_assert_eq(capacity(), 7);
	/* A resident count (kvr_rank_observe) is direct evidence: it stops the exploring. */
	uint64_t ev = 0;
	cr_assert_eq(kvr_lru_heal_resident(lru, 7, 0, &ev, NULL, &out), 0);
	acq(8, (uint64_t[]){41}, 1);
	cached(8, 0);
	cr_assert_eq(capacity(), 7);
	/* A registration replaces the estimate. */
	cr_assert_eq(kvr_lru_set_capacity(lru, 4, &out), 0);
	cr_assert_eq(capacity(), 4);
	acq(7, (uint64_t[]){40}, 1);
	cached(7, 0);
	cr_assert_eq(capacity(), 4);
}

Test(heal_cap, fewer_cached_lowers_the_estimate_then_it_drifts_back)
{
	make(10); /* the engine really holds 3 */
	acq(1, (uint64_t[]){1, 2, 3}, 3);
	cached(1, 0);
	rel(1);
	acq(2, (uint64_t[]){10, 11}, 2);
	rel(2);
	acq(3, (uint64_t[]){20, 21}, 2);
	rel(3); /* inactive [1 2 3] [10 11] [20 21]; the engine kept 10 20 21 */
	acq(4, (uint64_t[]){10, 11, 12}, 3);
	/* Predicted 2, the engine found 1: 11 was gone, and so was [1 2 3], released before it.
	 * What is left - 20 21 inactive, 10 11 12 held - less the copy of 11 (gone from the
	 * engine): the engine held at most 5 - (2 - 1) = 4 blocks when it evicted 11. */
	cached(4, 1);
	cr_assert_eq(h.predicted, 2);
	cr_assert_eq(h.evicted, 3);
	cr_assert_eq(h.upper, 4);
	cr_assert_eq(h.lower, 0);
	cr_assert_eq(h.capacity, 7, "half way from 10 to 4");
	cr_assert_eq(out.n_evicted, 3);
	/* The same again (release 4, its blocks are the newest): each answer halves the gap. */
	rel(4);
	acq(5, (uint64_t[]){10, 11, 12, 13}, 4); /* predicted 3 */
	cached(5, 1);
	cr_assert_lt(h.capacity, 7);
	uint64_t low = h.capacity;
	/* Answers that prove nothing drift back toward the registration, a step at a time (the
	 * engine may have been full of traffic this router did not see), never above it. */
	acq(6, (uint64_t[]){50}, 1);
	cached(6, 0);
	cr_assert_eq(capacity(), low + 1);
	for (int i = 0; i < 20; i++) {
		acq(100 + (uint64_t)i, (uint64_t[]){60 + (uint64_t)i}, 1);
		cached(100 + (uint64_t)i, 0);
		rel(100 + (uint64_t)i);
	}
	cr_assert_eq(capacity(), 10);
}

Test(heal_cap, never_below_what_live_requests_hold)
{
	make(10);
	acq(1, (uint64_t[]){1, 2, 3, 4, 5, 6}, 6);
	cached(1, 0);
	rel(1);
	acq(2, (uint64_t[]){1, 2, 3, 4, 5, 6, 7}, 7); /* predicted 6 */
	acq(3, (uint64_t[]){20, 21}, 2);
	/* The engine found nothing: an upper bound of 7 + 2 - 6 = 3, below the 9 blocks the two
	 * live requests hold: the estimate stops at 9. */
	cached(2, 0);
	cr_assert_eq(h.upper, 3);
	cr_assert_eq(h.capacity, 9);
	cr_assert_eq(capacity(), 9);
}

/* An answer that runs out of memory changes nothing, its ghosts included: the output's room
 * was reserved after the ghosts were turned on, so an answer failing there left them on, they
 * recorded the evictions that followed, and the next answer proved a lower bound that answer
 * alone cannot (the estimate rose from 4 to 6). */
Test(heal_cap, an_answer_out_of_memory_turns_no_ghosts_on)
{
	uint64_t want = 0;
	for (uint64_t nth = 0; nth < 12; nth++) {
		make(4);
		acq(9, (uint64_t[]){500, 501}, 2); /* live: answered below */
		acq(1, (uint64_t[]){100, 101}, 2);
		rel(1);
		size_t bytes = kvr_lru_bytes(lru);
		struct kvr_lru_out o;
		kvr_lru_out_init(&o);
		int rc = 0;
		if (nth) {
			kvr_alloc_fail_after(nth);
			rc = kvr_lru_heal_cached(lru, 9, 0, 0, &h, &o);
			kvr_alloc_fail_after(0);
			cr_assert(rc == 0 || rc == KVR_ENOMEM, "nth %lu: %d", (unsigned long)nth,
			          rc);
			if (rc)
				cr_assert_eq(kvr_lru_bytes(lru), bytes, "nth %lu",
				             (unsigned long)nth);
		}
		kvr_lru_out_fini(&o);
		/* 100 101 evicted by 200..203; the engine (larger) still holds them. */
		acq(2, (uint64_t[]){200, 201, 202, 203}, 4);
		rel(2);
		acq(3, (uint64_t[]){100, 101}, 2);
		cached(3, 2);
		if (nth == 0)
			want = capacity(); /* no earlier answer: no ghosts, nothing proven */
		else if (rc)
			cr_assert_eq(capacity(), want,
			             "nth %lu: the failed answer changed the estimate",
			             (unsigned long)nth);
		teardown();
	}
	cr_assert_eq(want, 4);
}

/* A block brought back by a request that never gets an answer is no ghost once that request
 * ends: before, its ghost stayed live while the prediction held it again, and every later answer
 * counted it twice in the recency of the blocks evicted before it (the upper bound below was 7
 * where the engine can hold at most 6). */
Test(heal_cap, a_block_brought_back_unanswered_is_no_ghost)
{
	make(4);
	acq(1, (uint64_t[]){1}, 1);
	cached(1, 0);                            /* ghosts on */
	rel(1);                                  /* inactive [1] */
	acq(2, (uint64_t[]){10, 11, 12, 13}, 4); /* 1 goes (ghost 1) */
	rel(2);                                  /* inactive, oldest first: 13 12 11 10 */
	acq(3, (uint64_t[]){20}, 1);             /* 13 goes (ghosts 1 13) */
	rel(3);
	acq(4, (uint64_t[]){13}, 1); /* 13 back, never answered; 12 goes (ghosts 1 13 12) */
	rel(4);
	acq(5, (uint64_t[]){1}, 1); /* 11 goes (ghosts 1 13 12 11) */
	cached(5, 0);
	/* The engine missed 1: it holds at most what the router holds (4: 10 20 13 1) and what
	 * was evicted after 1 and not stored again (12 11): 6. */
	cr_assert_eq(h.upper, 6, "upper bound %" PRIu64, h.upper);
}
