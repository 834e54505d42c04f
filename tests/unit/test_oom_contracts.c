/*
 * KVR_ENOMEM's promise through the public API ("an allocation failed; nothing was changed"), as
 * SQLite-style out-of-memory loops: fail the Nth allocation of one call for N = 1, 2, ... until
 * the call succeeds without a failure, and check after each failure that nothing changed.
 * tests/fuzz/oom_api.c found each of these with random call sequences.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "tests/common/oom_loop.h"

static const struct kvr_rank_id R0 = {0, 0};
static uint32_t prompt[64];

static struct kvr_router *make_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true; /* every call applied before it returns */
	c.shard_idle_spin_ns = 0;
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	return r;
}

static uint64_t route_one(struct kvr_router *r, int *rc_out)
{
	for (size_t i = 0; i < 64; i++)
		prompt[i] = 7 + (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = prompt;
	q.n_tokens = 64;
	struct kvr_decision d;
	*rc_out = kvr_route(r, &q, &d);
	return *rc_out == 0 ? d.attempt : 0;
}

static struct kvr_rank_stats stats(struct kvr_router *r)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, R0, &s), 0);
	return s;
}

/* Whatever a failed or successful command did, the rank still predicts: a new admission is
 * cached.  Then the router goes. */
static void still_predicts_and_destroy(struct kvr_router *r, uint64_t nth)
{
	int rc;
	(void)route_one(r, &rc);
	cr_assert_eq(rc, 0);
	cr_assert_gt(stats(r).resident_blocks, 0, "nth %lu: no prediction any more",
	             (unsigned long)nth);
	kvr_router_destroy(r);
}

/* A rank command that starts a new life (set_capacity with a new incarnation, reset) and runs
 * out of memory changes nothing: the rank's attempts stay live, its predicted cache and
 * incarnation stay.  It used to end every attempt and drop the predicted cache first, then fail
 * to make the new one: the attempts were stale, the rank ABSENT (no prediction until the next
 * capacity call) under the old incarnation, and kvr_rank_reset returned an undocumented
 * KVR_ENOMEM. */
static void new_life_under_oom(bool reset, uint64_t capacity)
{
	bool completed = false;
	uint64_t nth;
	for (nth = 1; nth < 200 && !completed; nth++) {
		struct kvr_router *r = make_router();
		cr_assert_eq(kvr_rank_add(r, R0, 1, capacity, 0), 0);
		int rc;
		uint64_t a = route_one(r, &rc);
		cr_assert_eq(rc, 0);
		uint64_t resident = stats(r).resident_blocks;
		cr_assert_gt(resident, 0);
		kvr_alloc_fail_after(nth);
		rc = reset ? kvr_rank_reset(r, R0, 2) : kvr_rank_set_capacity(r, R0, 2, capacity);
		bool fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		struct kvr_rank_stats s = stats(r);
		if (rc == KVR_ENOMEM) {
			cr_assert_eq(s.incarnation, 1, "nth %lu", (unsigned long)nth);
			cr_assert_eq(s.active_requests, 1, "nth %lu: the attempt was ended",
			             (unsigned long)nth);
			cr_assert_eq(s.resident_blocks, resident, "nth %lu: the cache changed",
			             (unsigned long)nth);
			cr_assert_eq(kvr_request_finish(r, a), 0, "nth %lu: the attempt is stale",
			             (unsigned long)nth);
		} else {
			cr_assert_eq(rc, 0, "nth %lu: %d", (unsigned long)nth, rc);
			cr_assert_eq(s.incarnation, 2);
			cr_assert_eq(s.active_requests, 0);
			cr_assert_eq(kvr_request_finish(r, a), KVR_ESTALE);
			completed = !fired;
		}
		still_predicts_and_destroy(r, nth);
	}
	cr_assert(completed, "reached a run without a failure");
	cr_assert_gt(nth, 2, "failures were injected (%lu)", (unsigned long)nth);
}

Test(oom_contracts, set_capacity_new_incarnation_lru)
{
	new_life_under_oom(false, 64);
}

Test(oom_contracts, set_capacity_new_incarnation_ttl)
{
	new_life_under_oom(false, KVR_CAPACITY_NONE);
}

Test(oom_contracts, reset_lru)
{
	new_life_under_oom(true, 64);
}

Test(oom_contracts, reset_ttl)
{
	new_life_under_oom(true, KVR_CAPACITY_NONE);
}

/* TTL retention -> a finite capacity in the same life rebuilds the predicted cache as an LRU;
 * out of memory, it keeps the TTL one (it used to leave the rank ABSENT). */
Test(oom_contracts, ttl_to_lru_same_life)
{
	bool completed = false;
	uint64_t nth;
	for (nth = 1; nth < 200 && !completed; nth++) {
		struct kvr_router *r = make_router();
		cr_assert_eq(kvr_rank_add(r, R0, 1, KVR_CAPACITY_NONE, 0), 0);
		int rc;
		uint64_t a = route_one(r, &rc);
		cr_assert_eq(rc, 0);
		cr_assert_eq(kvr_request_finish(r, a), 0);
		kvr_alloc_fail_after(nth);
		rc = kvr_rank_set_capacity(r, R0, 1, 64);
		bool fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		struct kvr_rank_stats s = stats(r);
		if (rc == KVR_ENOMEM) {
			cr_assert_eq(s.capacity_blocks, KVR_CAPACITY_NONE);
			cr_assert_gt(s.resident_blocks, 0, "nth %lu: the TTL cache was dropped",
			             (unsigned long)nth);
		} else {
			cr_assert_eq(rc, 0);
			cr_assert_eq(s.capacity_blocks, 64);
			completed = !fired;
		}
		still_predicts_and_destroy(r, nth);
	}
	cr_assert(completed, "reached a run without a failure");
}

/* A synchronous booking whose load could not be added fails whole: kvr_route returns
 * KVR_ENOMEM and the rank carries no request.  It used to return 0 for an attempt whose load
 * was never added (the rank looked idle to every later decision while the request ran). */
Test(oom_contracts, sync_booking_load_or_nothing)
{
	bool completed = false;
	uint64_t nth;
	for (nth = 1; nth < 400 && !completed; nth++) {
		struct kvr_router *r = make_router();
		cr_assert_eq(kvr_rank_add(r, R0, 1, 64, 0), 0);
		kvr_alloc_fail_after(nth);
		int rc;
		uint64_t a = route_one(r, &rc);
		bool fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		struct kvr_rank_stats s = stats(r);
		if (rc == KVR_ENOMEM) {
			cr_assert_eq(s.active_requests, 0, "nth %lu", (unsigned long)nth);
			cr_assert_eq(s.active_prefill_tokens, 0, "nth %lu", (unsigned long)nth);
		} else {
			cr_assert_eq(rc, 0);
			cr_assert_eq(s.active_requests, 1, "nth %lu: admitted without its load",
			             (unsigned long)nth);
			cr_assert_eq(s.active_blocks, 4, "nth %lu", (unsigned long)nth);
			cr_assert_eq(kvr_request_finish(r, a), 0);
			completed = !fired;
		}
		kvr_router_destroy(r);
	}
	cr_assert(completed, "reached a run without a failure");
	cr_assert_gt(nth, 3, "failures were injected (%lu)", (unsigned long)nth);
}

/* The other side of it: a sync_booking booking is posted without a wait when its shard has
 * room to track it, so kvr_route has returned 0 before the shard records its load.  Where that
 * runs out of memory the attempt lives with its load left provisional (every decision counts
 * it), and the rank's stats must count it too: they read active_requests 0 for a request that
 * ran (sync_booking_load_or_nothing failed 1 run in ~60 when its armed failure reached the
 * shard before the disarm).  Here the failure is armed after kvr_route returns, so it lands in
 * the shard's booking, which the stats call settles. */
Test(oom_contracts, deferred_booking_out_of_memory_still_counted)
{
	for (uint64_t nth = 1; nth < 40; nth++) {
		struct kvr_router *r = make_router();
		cr_assert_eq(kvr_rank_add(r, R0, 1, 64, 0), 0);
		int rc;
		uint64_t a = route_one(r, &rc);
		cr_assert_eq(rc, 0);
		kvr_alloc_fail_after(nth);
		struct kvr_rank_stats s = stats(r);
		kvr_alloc_fail_after(0);
		cr_assert_eq(s.active_requests, 1, "nth %lu: admitted, and counted as idle",
		             (unsigned long)nth);
		cr_assert_eq(s.active_blocks, 4, "nth %lu", (unsigned long)nth);
		cr_assert_eq(s.active_prefill_tokens, 64, "nth %lu", (unsigned long)nth);
		cr_assert_eq(kvr_request_finish(r, a), 0);
		s = stats(r);
		cr_assert_eq(s.active_requests, 0, "nth %lu", (unsigned long)nth);
		cr_assert_eq(s.active_blocks, 0, "nth %lu", (unsigned long)nth);
		cr_assert_eq(s.active_prefill_tokens, 0, "nth %lu", (unsigned long)nth);
		kvr_router_destroy(r);
	}
}

/* The end of an attempt whose predicted-cache release runs out of memory still frees its blocks:
 * the release is retried on the shard's next call.  It used to be dropped: the lease pinned its
 * blocks in the LRU for the rank's life, never evictable, and the idle rank's prediction stayed
 * above its capacity (tests/fuzz/oom_api.c: resident 6 of capacity 1). */
Test(oom_contracts, release_out_of_memory_is_retried)
{
	bool completed = false;
	uint64_t nth;
	for (nth = 1; nth < 200 && !completed; nth++) {
		struct kvr_router *r = make_router();
		cr_assert_eq(kvr_rank_add(r, R0, 1, 2, 0), 0);
		int rc;
		uint64_t a = route_one(r, &rc); /* 4 blocks, all pinned: over the capacity of 2 */
		cr_assert_eq(rc, 0);
		cr_assert_eq(stats(r).resident_blocks, 4);
		kvr_alloc_fail_after(nth);
		cr_assert_eq(kvr_request_finish(r, a), 0, "finish never needs memory");
		/* sync_booking posts the finish's work and settles before the next read: run it
		 * before asking whether the armed failure fired in it. */
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		completed = kvr_alloc_fail_pending() != 0;
		kvr_alloc_fail_after(0);
		struct kvr_rank_stats s = stats(r);
		cr_assert_eq(s.active_requests, 0, "nth %lu", (unsigned long)nth);
		cr_assert_eq(s.resident_blocks, 2, "nth %lu: resident %lu of capacity 2 once idle",
		             (unsigned long)nth, (unsigned long)s.resident_blocks);
		kvr_router_destroy(r);
	}
	cr_assert(completed, "reached a run without a failure");
	cr_assert_gt(nth, 2, "failures were injected (%lu)", (unsigned long)nth);
}

static uint64_t vclock(void *ctx)
{
	return __atomic_load_n((uint64_t *)ctx, __ATOMIC_RELAXED);
}

/* A TTL expiry that runs out of memory, memory staying short (kvr_alloc_fail_from): nothing
 * expires, kvr_router_sync still returns, and the expiry is tried again later and happens once
 * memory is back.  The expiry's timer was re-armed at its own deadline, due at once: the shard
 * fired it again and again while memory stayed short, and kvr_router_sync, which waits for
 * every due timer, timed out (tests/fuzz/oom_api.c seed 9 with persistent failures). */
Test(oom_contracts, ttl_expiry_out_of_memory_retried_later)
{
	static uint64_t now = 1000;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.shard_idle_spin_ns = 0;
	c.ttl_ns = 1000000000ull;
	c.now_ns = vclock;
	c.clock_ctx = &now;
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, R0, 1, KVR_CAPACITY_NONE, 0), 0);
	int rc;
	uint64_t a = route_one(r, &rc);
	cr_assert_eq(rc, 0);
	cr_assert_eq(kvr_request_finish(r, a), 0);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	uint64_t held = stats(r).resident_blocks;
	cr_assert_gt(held, 0);
	__atomic_store_n(&now, now + 2 * c.ttl_ns, __ATOMIC_RELAXED); /* all of it expired */
	kvr_alloc_fail_from(1);
	rc = kvr_router_sync(r, 2000);
	bool fired = kvr_alloc_fail_pending() != 0;
	kvr_alloc_fail_after(0);
	cr_assert(fired, "the expiry allocated nothing");
	cr_assert_eq(rc, 0, "sync under a persistent failure: %d", rc);
	cr_assert_eq(stats(r).resident_blocks, held, "expired without memory");
	__atomic_store_n(&now, now + 100000000ull, __ATOMIC_RELAXED); /* past the retry */
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	cr_assert_eq(stats(r).resident_blocks, 0, "the expiry was not tried again");
	kvr_router_destroy(r);
}

/* Healing out of memory (its eviction list could not grow) changes nothing; the same observation
 * once memory is back evicts as it would have.  (No loop covered these failure branches:
 * shards/lru_heal.c, resident count and watermark.) */
Test(oom_contracts, observe_out_of_memory_changes_nothing)
{
	for (int watermark = 0; watermark < 2; watermark++) {
		bool completed = false;
		uint64_t nth;
		for (nth = 1; nth < 200 && !completed; nth++) {
			struct kvr_router *r = make_router();
			cr_assert_eq(kvr_rank_add(r, R0, 1, 1000, 0), 0);
			uint64_t first_seq = 0;
			for (uint32_t k = 0; k < 40; k++) { /* 40 released prompts of 4 blocks */
				for (size_t i = 0; i < 64; i++)
					prompt[i] = k * 1000 + (uint32_t)i;
				struct kvr_request q;
				kvr_request_init(&q);
				q.tokens = prompt;
				q.n_tokens = 64;
				struct kvr_decision d;
				cr_assert_eq(kvr_route(r, &q, &d), 0);
				cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
				if (k == 30) {
					uint64_t seq[4];
					kvr_hash_blocks(prompt, 64, 16, NULL, NULL, seq);
					first_seq = seq[3]; /* released first of its prompt */
				}
			}
			uint64_t resident = stats(r).resident_blocks;
			cr_assert_eq(resident, 160);
			struct kvr_rank_observation o = {.incarnation = 1};
			if (watermark) {
				o.flags = KVR_OBSERVE_WATERMARK;
				o.watermark_hash = first_seq; /* the 31st prompt's: 120 blocks go */
			} else {
				o.flags = KVR_OBSERVE_RESIDENT;
				o.resident_blocks = 10;
			}
			kvr_alloc_fail_after(nth);
			int rc = kvr_rank_observe(r, R0, &o);
			bool fired = kvr_alloc_fail_pending() == 0;
			kvr_alloc_fail_after(0);
			if (rc == KVR_ENOMEM) {
				cr_assert_eq(stats(r).resident_blocks, resident, "nth %lu",
				             (unsigned long)nth);
				rc = kvr_rank_observe(r, R0, &o);
			} else {
				completed = !fired;
			}
			cr_assert_eq(rc, 0, "nth %lu: %d", (unsigned long)nth, rc);
			cr_assert_eq(stats(r).resident_blocks, watermark ? 40 : 10,
			             "nth %lu watermark %d: resident %lu", (unsigned long)nth,
			             watermark, (unsigned long)stats(r).resident_blocks);
			still_predicts_and_destroy(r, nth);
		}
		cr_assert(completed, "reached a run without a failure");
		cr_assert_gt(nth, 2, "failures were injected (%lu)", (unsigned long)nth);
	}
}

/* One run held by 65 ranks, the 65th admission under failure: it is admitted (an index write
 * that failed is counted, and heals on a later store) or refused whole, the next admission goes
 * through, and every load returns to zero. */
static void pin_route(struct kvr_router *r, uint32_t rank, bool may_fail)
{
	struct kvr_rank_id pin = {rank, 0};
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = prompt;
	q.n_tokens = 64;
	q.pinned = &pin; /* the same prompt on every rank */
	struct kvr_decision d;
	int rc = kvr_route(r, &q, &d);
	cr_assert(rc == 0 || (may_fail && rc == KVR_ENOMEM), "rank %u: %d", rank, rc);
	if (rc == 0)
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
}

Test(oom_contracts, many_holders_out_of_memory)
{
	for (size_t i = 0; i < 64; i++)
		prompt[i] = 5 + (uint32_t)i;
	bool completed = false;
	uint64_t nth;
	for (nth = 1; nth < 100 && !completed; nth++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.sync_booking = true;
		c.shard_idle_spin_ns = 0;
		c.max_ranks = 80;
		struct kvr_router *r = NULL;
		cr_assert_eq(kvr_router_create(&c, &r), 0);
		for (uint32_t i = 0; i < 66; i++)
			cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){i, 0}, 1, 1000, 0), 0);
		for (uint32_t i = 0; i < 64; i++)
			pin_route(r, i, false);
		kvr_alloc_fail_after(nth); /* the 65th holder */
		pin_route(r, 64, true);
		completed = kvr_alloc_fail_pending() != 0;
		kvr_alloc_fail_after(0);
		pin_route(r, 65, false);
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		for (uint32_t i = 0; i < 66; i++) {
			struct kvr_rank_stats s;
			cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){i, 0}, &s), 0);
			cr_assert_eq(s.active_requests + s.active_blocks + s.active_prefill_tokens,
			             0);
		}
		kvr_router_destroy(r);
	}
	cr_assert(completed, "reached a run without a failure");
	cr_assert_gt(nth, 2, "failures were injected (%lu)", (unsigned long)nth);
}

/* kvr_events_apply of a numbered event with its Nth allocation failed (the shard's scratch, the
 * index write), N = 1, 2, ...: KVR_ENOMEM changes nothing, the event id cursor included, so the
 * same event applies when memory is back.  Before, the cursor had advanced before the write
 * failed: the retry was refused as stale (KVR_ESTALE) and the event was lost for good. */
struct event_ctx {
	struct kvr_router *r;
	struct kvr_event ev;
};

static int event_call(void *p)
{
	struct event_ctx *x = p;
	return kvr_events_apply(x->r, R0, &x->ev);
}

static void event_check(void *p, uint64_t nth)
{
	struct event_ctx *x = p;
	size_t n = 0;
	uint64_t got[16];
	cr_assert_eq(kvr_rank_blocks(x->r, R0, got, 16, &n), 0);
	cr_assert_eq(n, 2, "nth %lu: a failed event changed the rank (%zu blocks)",
	             (unsigned long)nth, n);
}

Test(oom_contracts, numbered_event_out_of_memory_changes_nothing)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.block_size = 4;
	struct event_ctx x = {0};
	cr_assert_eq(kvr_router_create(&c, &x.r), 0);
	cr_assert_eq(kvr_rank_add(x.r, R0, 1, KVR_CAPACITY_NONE, 0), 0);
	struct kvr_event_block a[2] = {{.ext_hash = 0xa1, .local_hash = 11},
	                               {.ext_hash = 0xa2, .local_hash = 12}};
	struct kvr_event_block b[3] = {{.ext_hash = 0xb1, .local_hash = 21},
	                               {.ext_hash = 0xb2, .local_hash = 22},
	                               {.ext_hash = 0xb3, .local_hash = 23}};
	x.ev =
	    (struct kvr_event){.type = KVR_EVENT_STORED, .event_id = 1, .blocks = a, .n_blocks = 2};
	cr_assert_eq(kvr_events_apply(x.r, R0, &x.ev), 0);
	static const uint64_t parent = 0xa2;
	x.ev = (struct kvr_event){.type = KVR_EVENT_STORED,
	                          .event_id = 2,
	                          .has_parent = true,
	                          .parent_ext_hash = parent,
	                          .blocks = b,
	                          .n_blocks = 3};
	uint64_t failed;
	int rc = kvr_oom_loop(event_call, event_check, &x, &failed);
	cr_assert_eq(rc, 0, "the event, applied again once memory was back: %d", rc);
	cr_assert_geq(failed, 1);
	size_t n = 0;
	uint64_t got[16];
	cr_assert_eq(kvr_rank_blocks(x.r, R0, got, 16, &n), 0);
	cr_assert_eq(n, 5);
	x.ev.event_id = 2;
	cr_assert_eq(kvr_events_apply(x.r, R0, &x.ev), KVR_ESTALE, "applied once");
	kvr_router_destroy(x.r);
}
