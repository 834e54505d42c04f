/* Regression tests for the defects of issue 12 (found by API fuzzing and the TSan torture), one
 * per defect, each failing on the code before its fix:
 *   1. kvr_route_cancel racing the queue's admission pass (use-after-free, depth underflow);
 *   2. kvr_router_sync from a thread that never called the library, with a queued pinned request;
 *   3. a queued request whose admission fails is reported (on_admit / kvr_route_wait);
 *   6. kvr_rank_add at max_ranks right after a remove (slot awaiting its grace period);
 *   8. a queued hash-given prompt with n_hashes = 0 (memcpy from NULL under UBSan).
 * Defect 7 (a data race) has its regression test under TSan: tests/stress/stress_queue.c. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "tests/common/router_prompts.h"

/* What on_admit saw, for the test's router (callbacks run on whichever thread pumped). */
struct seen {
	pthread_mutex_t mu;
	uint64_t ticket[64];
	struct kvr_decision d[64];
	int n;
};

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	struct seen *s = ctx;
	pthread_mutex_lock(&s->mu);
	if (s->n < 64) {
		s->ticket[s->n] = ticket;
		s->d[s->n] = *d;
		s->n++;
	}
	pthread_mutex_unlock(&s->mu);
}

static int seen_find(struct seen *s, uint64_t ticket, struct kvr_decision *out)
{
	int found = 0;
	pthread_mutex_lock(&s->mu);
	for (int i = 0; i < s->n; i++)
		if (s->ticket[i] == ticket) {
			found++;
			if (out)
				*out = s->d[i];
		}
	pthread_mutex_unlock(&s->mu);
	return found;
}

static struct kvr_router *make_queue_router(struct seen *s, uint32_t max_ranks)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = vclock;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	c.max_ranks = max_ranks;
	if (s) {
		memset(s, 0, sizeof(*s));
		pthread_mutex_init(&s->mu, NULL);
		c.on_admit = on_admit;
		c.callback_ctx = s;
	}
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	return r;
}

static int route_tokens(struct kvr_router *r, const uint32_t *t, size_t n,
                        const struct kvr_rank_id *pinned, struct kvr_decision *d)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.pinned = pinned;
	return kvr_route(r, &q, d);
}

/* ---------------------------------------------------------------- defect 1 */

struct pump_arg {
	struct kvr_router *r;
	uint64_t attempt;
	int go;
	int rc;
};

static void *prefill_done_thread(void *p)
{
	struct pump_arg *a = p;
	while (!__atomic_load_n(&a->go, __ATOMIC_ACQUIRE))
		;
	a->rc = kvr_request_prefill_done(a->r, a->attempt); /* pumps the queue */
	return NULL;
}

static void spin_ns(uint64_t ns)
{
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do
		clock_gettime(CLOCK_MONOTONIC, &t);
	while ((uint64_t)(t.tv_sec - t0.tv_sec) * 1000000000ull +
	           (uint64_t)(t.tv_nsec - t0.tv_nsec) <
	       ns);
}

/* A long queued prompt keeps the pump inside its (unlocked) routing call for a millisecond or
 * so while another thread cancels the ticket at a varying moment.  A cancel that returns 0 must
 * mean the request is never admitted; one that returns KVR_ENOENT must mean it was.  Before the
 * fix the cancel freed the entry under the pump (ASan: heap-use-after-free), on_admit then
 * reported a cancelled ticket and the depth underflowed, so the queue answered KVR_EAGAIN for
 * good. */
Test(regress, cancel_racing_the_pump)
{
	struct seen s;
	struct kvr_router *r = make_queue_router(&s, 16);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, KVR_CAPACITY_NONE, 100), 0);
	enum { LONG = 1 << 18 };
	static uint32_t hog[200], big[LONG];
	prompt(big, LONG, 100);
	int cancelled = 0, admitted = 0;
	for (int it = 0; it < 60; it++) {
		prompt(hog, 200, 1000 + (uint32_t)it); /* uncached: its prefill saturates */
		struct kvr_decision h, q;
		cr_assert_eq(route_tokens(r, hog, 200, NULL, &h), 0);
		cr_assert_eq(h.status, KVR_DECIDED, "it %d", it);
		cr_assert_eq(route_tokens(r, big, LONG, NULL, &q), 0);
		cr_assert_eq(q.status, KVR_QUEUED, "it %d: saturated by the hog", it);
		struct pump_arg a = {.r = r, .attempt = h.attempt};
		pthread_t th;
		cr_assert_eq(pthread_create(&th, NULL, prefill_done_thread, &a), 0);
		__atomic_store_n(&a.go, 1, __ATOMIC_RELEASE);
		spin_ns((uint64_t)(it % 20) * 100000); /* 0 .. 1.9 ms */
		int rc = kvr_route_cancel(r, q.ticket);
		pthread_join(th, NULL);
		cr_assert_eq(a.rc, 0);
		cr_assert(rc == 0 || rc == KVR_ENOENT, "cancel: %d", rc);
		struct kvr_decision got;
		int n = seen_find(&s, q.ticket, &got);
		struct kvr_rank_stats st;
		cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
		if (rc == 0) {
			cancelled++;
			cr_assert_eq(n, 0, "it %d: a cancelled ticket was admitted", it);
			cr_assert_eq(st.active_requests, 1, "it %d: only the hog is active", it);
		} else {
			admitted++;
			cr_assert_eq(n, 1, "it %d: cancel said not queued, so it was admitted", it);
			cr_assert_eq(got.status, KVR_DECIDED);
			cr_assert_eq(st.active_requests, 2);
			cr_assert_eq(kvr_request_finish(r, got.attempt), 0);
		}
		cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
		cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &got), KVR_ENOENT);
	}
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
	cr_assert_eq(st.active_requests, 0);
	cr_assert_eq(st.active_prefill_tokens, 0);
	/* The depth is exact: saturated again, a request queues (not KVR_EAGAIN). */
	prompt(hog, 200, 999);
	struct kvr_decision h, q;
	cr_assert_eq(route_tokens(r, hog, 200, NULL, &h), 0);
	cr_assert_eq(route_tokens(r, hog, 200, NULL, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(kvr_route_cancel(r, q.ticket), 0);
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
	cr_log_info("cancel vs pump: %d cancelled, %d admitted", cancelled, admitted);
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- defects 2 and 3 */

/* A rank saturated by a hog, a request pinned to it queued, then the rank removed: the next pump
 * must resolve the request as failed (its pinned rank is gone). */
static uint64_t queue_pinned_then_remove(struct kvr_router *r, struct kvr_rank_id id)
{
	static uint32_t hog[200], t[64];
	prompt(hog, 200, 7);
	prompt(t, 64, 8);
	struct kvr_decision h, q;
	cr_assert_eq(route_tokens(r, hog, 200, &id, &h), 0);
	cr_assert_eq(h.status, KVR_DECIDED);
	cr_assert_eq(route_tokens(r, t, 64, &id, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(kvr_rank_remove(r, id), 0);
	return q.ticket;
}

struct sync_arg {
	struct kvr_router *r;
	int rc;
};

static void *sync_thread(void *p)
{
	struct sync_arg *a = p;
	a->rc = kvr_router_sync(a->r, 10000); /* this thread's first library call */
	return NULL;
}

/* Before the fix the pump ran the pinned request's decision on a thread liburcu had never seen,
 * and liburcu aborted the process. */
Test(regress, sync_from_a_fresh_thread_with_a_queued_pinned_request)
{
	struct seen s;
	struct kvr_router *r = make_queue_router(&s, 16);
	struct kvr_rank_id id = {5, 1};
	cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 100), 0);
	uint64_t ticket = queue_pinned_then_remove(r, id);
	struct sync_arg a = {.r = r};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, sync_thread, &a), 0);
	pthread_join(th, NULL);
	cr_assert_eq(a.rc, 0);
	struct kvr_decision d;
	cr_assert_eq(seen_find(&s, ticket, &d), 1, "the sync's pump resolved the request");
	kvr_router_destroy(r);
}

/* Before the fix a failed admission with on_admit set freed the entry silently: no callback, and
 * kvr_route_wait / kvr_route_cancel both said KVR_ENOENT. */
Test(regress, failed_admission_reaches_on_admit)
{
	struct seen s;
	struct kvr_router *r = make_queue_router(&s, 16);
	struct kvr_rank_id id = {3, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 100), 0);
	uint64_t ticket = queue_pinned_then_remove(r, id);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct kvr_decision d;
	cr_assert_eq(seen_find(&s, ticket, &d), 1, "on_admit told the outcome");
	cr_assert_eq(d.status, KVR_FAILED);
	cr_assert_eq(d.error, KVR_ENOENT, "its pinned rank is gone");
	cr_assert_eq(d.ticket, ticket);
	cr_assert_eq(d.attempt, 0);
	cr_assert_eq(kvr_route_cancel(r, ticket), KVR_ENOENT, "not queued any more");
	kvr_router_destroy(r);
}

Test(regress, failed_admission_reaches_route_wait)
{
	struct kvr_router *r = make_queue_router(NULL, 16);
	struct kvr_rank_id id = {3, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 100), 0);
	uint64_t ticket = queue_pinned_then_remove(r, id);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct kvr_decision d;
	memset(&d, 0x5a, sizeof(d));
	cr_assert_eq(kvr_route_wait(r, ticket, 0, &d), KVR_ENOENT, "the admission's error");
	cr_assert_eq(d.status, KVR_FAILED);
	cr_assert_eq(d.error, KVR_ENOENT);
	cr_assert_eq(d.ticket, ticket);
	cr_assert_eq(kvr_route_wait(r, ticket, 0, &d), KVR_ENOENT, "collected once");
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- defect 6 */

/* Before the fix the re-add was refused with KVR_ERANGE for the removed slot's grace period
 * (~200 ms), although only one of two ranks was present. */
Test(regress, add_at_max_ranks_right_after_a_remove)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.max_ranks = 2;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (int round = 0; round < 20; round++) {
		struct kvr_rank_id a = {100 + (uint64_t)round, 0}, b = {200 + (uint64_t)round, 0};
		cr_assert_eq(kvr_rank_add(r, a, 1, 100, 0), 0, "round %d", round);
		cr_assert_eq(kvr_rank_add(r, b, 1, 100, 0), 0, "round %d", round);
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){999, 0}, 1, 100, 0), KVR_ERANGE,
		             "three present ranks exceed max_ranks 2");
		cr_assert_eq(kvr_rank_remove(r, a), 0);
		cr_assert_eq(kvr_rank_add(r, a, 2, 100, 0), 0, "round %d: re-add the same id",
		             round);
		cr_assert_eq(kvr_rank_remove(r, a), 0);
		cr_assert_eq(kvr_rank_remove(r, b), 0);
	}
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- defect 8 */

/* A hash-given prompt shorter than one block (n_hashes = 0) that waits in the queue.  Before the
 * fix the queue's copy had neither tokens nor hashes and admission memcpy'd from NULL (UBSan:
 * "null pointer passed as argument 2"). */
Test(regress, queued_prompt_without_complete_blocks)
{
	struct kvr_router *r = make_queue_router(NULL, 16);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 100), 0);
	static uint32_t hog[200];
	prompt(hog, 200, 9);
	struct kvr_decision h, d;
	cr_assert_eq(route_tokens(r, hog, 200, NULL, &h), 0);
	struct kvr_request q;
	kvr_request_init(&q);
	uint64_t none = 0;
	q.local_hashes = &none;
	q.n_hashes = 0;
	q.n_tokens = 5;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	uint64_t ticket = d.ticket;
	cr_assert_eq(kvr_request_prefill_done(r, h.attempt), 0); /* admits it */
	cr_assert_eq(kvr_route_wait(r, ticket, 0, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(d.required_blocks, 0);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- found by fuzz_api */

/* kvr_router_live_update allocated a removal's new live list one slot too big and freed it by its
 * count: every rank remove left 4 bytes in the allocation counter, and a sized free (jemalloc's
 * sdallocx) was given a size it was not allocated with.  fuzz_api's leak check found it. */
Test(regress, rank_churn_frees_exactly_what_it_allocates)
{
	int64_t before = kvr_alloc_live_bytes();
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (int round = 0; round < 3; round++) {
		for (uint64_t w = 0; w < 4; w++)
			cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 100, 0), 0);
		for (uint64_t w = 0; w < 4; w++)
			cr_assert_eq(kvr_rank_remove(r, (struct kvr_rank_id){3 - w, 0}), 0);
	}
	kvr_router_destroy(r);
	cr_assert_eq(kvr_alloc_live_bytes(), before, "%lld bytes unaccounted",
	             (long long)(kvr_alloc_live_bytes() - before));
}

/* With sync_booking off, admission books the attempt on the maintenance lane after kvr_route
 * returns, and a stats call (routing lane, served first) read the load without it: a rank said
 * active_requests 0 right after a decision on it.  Snapshots now book pending attempts first.
 * Found by fuzz_api. */
Test(regress, stats_count_an_attempt_right_after_its_decision)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = false;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 0), 0);
	static uint32_t t[4096];
	for (int it = 0; it < 200; it++) {
		prompt(t, 4096, 5000 + (uint32_t)it);
		struct kvr_decision d;
		cr_assert_eq(route_tokens(r, t, 4096, NULL, &d), 0);
		struct kvr_rank_stats st;
		cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
		cr_assert_eq(st.active_requests, 1, "it %d", it);
		cr_assert_gt(st.active_prefill_tokens, 0, "it %d", it);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	}
	kvr_router_destroy(r);
}

/* kvr_request does not check that a caller's hashes chain, and a prompt given as local hashes has
 * its first local hash as its root's sequence hash: a root on another prompt's interior hash is
 * two calls away for any frontend.  The shard's load tracker (shards/load.c) then made a second
 * head entry for that hash when a third prompt split the first one's run there, dropped the wrong
 * entry when the split's run was freed, and the next booking walked a freed run: the shard thread
 * died (SEGV in walk, kvr_load_add, at the fifth route).  Found by fuzz_api_seeds --craft (seed
 * 176); test_load crafted_root_on_an_interior_hash holds the tracker's own case. */
static uint64_t route_local(struct kvr_router *r, const uint64_t *local, size_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.local_hashes = local;
	q.n_hashes = n;
	q.n_tokens = n * 16;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 10000), 0); /* booked before the next call */
	return d.attempt;
}

Test(regress, crafted_root_on_an_interior_hash)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.block_size = 16;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 0, 1000), 0);
	uint32_t tok[64];
	prompt(tok, 64, 3);
	uint64_t loc[4], seq[4];
	cr_assert_eq(kvr_hash_blocks(tok, 64, 16, NULL, loc, seq), 4);
	uint64_t a1 = route_local(r, loc, 4);
	uint64_t a2 = route_local(r, (uint64_t[]){seq[2], 77}, 2); /* crafted: its root is S2 */
	uint64_t a3 = route_local(r, (uint64_t[]){loc[0], loc[1], 55}, 3); /* leaves at S2 */
	cr_assert_eq(kvr_request_finish(r, a1), 0);
	cr_assert_eq(kvr_request_finish(r, a3), 0);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	uint64_t a4 = route_local(r, (uint64_t[]){seq[2], 77, 78}, 3);
	uint64_t a5 = route_local(r, loc, 4);
	cr_assert_eq(kvr_request_finish(r, a2), 0);
	cr_assert_eq(kvr_request_finish(r, a4), 0);
	cr_assert_eq(kvr_request_finish(r, a5), 0);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
	cr_assert_eq(st.active_requests, 0);
	cr_assert_eq(st.active_blocks, 0);
	kvr_router_destroy(r);
}

/* A lease scan interval of 2^64 - 1 ns (kvr_config accepts any non-zero one; a caller turning
 * the reaper off writes that) wrapped the reaper's next deadline to one before now: the shard
 * fired the reaper on every turn of its loop, a core busy for the router's life, and the CLOCK
 * reaper expired every idle attempt within its first two passes (found reading the timers after
 * fuzz_api's absurd resident counts).  The interval must mean "never", as a long one does. */
Test(regress, lease_scan_interval_near_2_to_64_never_expires)
{
	static const uint64_t intervals[] = {UINT64_MAX, UINT64_MAX - 500};
	for (size_t k = 0; k < 2; k++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.now_ns = vclock;
		c.lease_scan_interval_ns = intervals[k];
		struct kvr_router *r;
		cr_assert_eq(kvr_router_create(&c, &r), 0);
		struct kvr_rank_id id = {0, 0};
		cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 0), 0);
		uint32_t t[64];
		prompt(t, 64, 5);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 64;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		__atomic_add_fetch(&vnow, 10000000000ull, __ATOMIC_RELAXED); /* 10 s idle */
		cr_assert_eq(kvr_router_sync(r, 5000), 0);
		struct kvr_rank_stats s;
		cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
		cr_assert_eq(s.active_requests, 1, "interval %llu: the idle attempt was reaped",
		             (unsigned long long)intervals[k]);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		kvr_router_destroy(r);
	}
}

/* Waits up to 5 s for rank id to have no live attempt. */
static bool no_attempt_within_5s(struct kvr_router *r, struct kvr_rank_id id)
{
	struct kvr_rank_stats s;
	for (int i = 0; i < 5000; i++) {
		cr_assert_eq(kvr_rank_get_stats(r, id, &s), 0);
		if (s.active_requests == 0)
			return true;
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	return false;
}

/* The lease reaper re-armed itself whatever its shard held, so at lease_scan_interval_ns 1 its
 * timer was always due: the shard never parked, kvr_router_sync timed out with no work left
 * (KVR_ETIMEDOUT after 5 s, 20,000 routes all finished) and the shard's thread spun.  It now
 * sleeps while its shard has no attempt, and a booking wakes it: attempts left alone still
 * expire, before and after such an idle spell. */
Test(regress, the_lease_reaper_sleeps_on_an_idle_shard)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.lease_scan_interval_ns = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 0), 0);
	uint32_t t[64];
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	struct kvr_decision d;
	for (uint32_t k = 0; k < 100; k++) {
		prompt(t, 64, k);
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		int rc = kvr_request_finish(r, d.attempt);
		cr_assert(rc == 0 || rc == KVR_ESTALE); /* it may have expired already */
	}
	cr_assert_eq(kvr_router_sync(r, 5000), 0, "the shard never went idle: %s",
	             kvr_last_error());
	for (int round = 0; round < 2; round++) {
		prompt(t, 64, 1000 + (uint32_t)round);
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert(no_attempt_within_5s(r, id), "round %d: the attempt never expired",
		          round);
		cr_assert_eq(kvr_request_finish(r, d.attempt), KVR_ESTALE);
		cr_assert_eq(kvr_router_sync(r, 5000), 0, "round %d: %s", round, kvr_last_error());
	}
	kvr_router_destroy(r);
}

/* One shard, the queue on (threshold 1.0), rank {1, 0} with a 16-token budget: a 64-token prompt
 * saturates it.  clock and lease_ns 0 keep the defaults. */
static struct kvr_router *
saturable_router(void (*admit)(void *, uint64_t, const struct kvr_decision *),
                 uint64_t (*clock)(void *), bool sync_booking, uint64_t lease_ns)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.on_admit = admit;
	c.sync_booking = sync_booking;
	if (clock)
		c.now_ns = clock;
	if (lease_ns)
		c.lease_scan_interval_ns = lease_ns;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 100000, 16), 0);
	return r;
}

/* A request queued right after a finish (whose release the shard applies after the call
 * returned) is admitted by its waiter once the rank is idle: the shards lower load on their own
 * threads, which pump nothing, and kvr_route_wait did not pump either, so the ticket stayed
 * queued on an idle rank until some later call pumped (the 200 ms wait timed out in 20 of 20
 * rounds).  The wait pumps while it waits now. */
Test(regress, a_waiter_is_admitted_once_the_shard_lowered_the_load, .timeout = 60)
{
	struct kvr_router *r = saturable_router(NULL, NULL, false, 0);
	static uint32_t tok[64];
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	int queued = 0;
	for (int it = 0; it < 10; it++) {
		for (int i = 0; i < 64; i++)
			tok[i] = (uint32_t)(it * 1000 + i);
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0); /* 64 prefill tokens > 16: saturated */
		cr_assert_eq(d.status, KVR_DECIDED);
		cr_assert_eq(kvr_router_sync(r, 1000), 0);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		tok[0] ^= 0x55555;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		if (d.status == KVR_QUEUED) {
			queued++;
			int rc = kvr_route_wait(r, d.ticket, kvr_router_now(r) + 2000000000ull, &d);
			cr_assert_eq(rc, 0, "round %d: %s", it, kvr_last_error());
		}
		cr_assert_eq(d.status, KVR_DECIDED);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		cr_assert_eq(kvr_router_sync(r, 1000), 0);
	}
	cr_log_info("queued in %d of 10 rounds", queued);
	kvr_router_destroy(r);
}

/* A request still queued when the router is destroyed, with no waiter to collect it, is answered
 * through on_admit (KVR_FAILED, KVR_ESHUTDOWN): it was freed silently, its ticket never
 * resolved for a frontend that counts what it is owed. */
static uint64_t shut_ticket;
static int shut_calls, shut_error;
static void on_admit_at_shutdown(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	shut_ticket = ticket;
	shut_error = d->status == KVR_FAILED ? d->error : 0;
	shut_calls++;
}

Test(regress, a_request_queued_at_destroy_is_answered)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit_at_shutdown;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 100000, 16), 0);
	static uint32_t tok[64];
	for (int i = 0; i < 64; i++)
		tok[i] = (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 1000), 0);
	tok[0] = 99999;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	kvr_router_destroy(r);
	cr_assert_eq(shut_calls, 1);
	cr_assert_eq(shut_ticket, d.ticket);
	cr_assert_eq(shut_error, KVR_ESHUTDOWN);
}

/* A request routed right after a finish that freed its only rank, with on_admit and no waiter:
 * the finish (queue empty) was posted, the route read the rank's load before the shard applied
 * it and queued the request, and no call pumped after that: it stayed queued on the idle rank
 * until some later call (20 rounds of 20 in a probe; the last request of a burst, for good).
 * kvr_route pumps after it queues, and the shard's hook wakes the admission thread once the
 * finish is applied (the finish itself waits for nothing): the request is admitted by kvr_route
 * or, queued, through on_admit a moment later. */
static int lone_admits;
static uint64_t lone_attempt; /* the last admission's, 0 for a failed one */
static void on_admit_count(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	__atomic_store_n(&lone_attempt, d->status == KVR_DECIDED ? d->attempt : 0,
	                 __ATOMIC_RELAXED);
	__atomic_add_fetch(&lone_admits, 1, __ATOMIC_RELAXED); /* after: read once it counts */
}

/* Whether *count reached n within ms milliseconds. */
static bool admits_within(int *count, int n, int ms)
{
	for (int i = 0; i < ms * 10; i++) {
		if (__atomic_load_n(count, __ATOMIC_RELAXED) >= n)
			return true;
		nanosleep(&(struct timespec){0, 100000}, NULL);
	}
	return __atomic_load_n(count, __ATOMIC_RELAXED) >= n;
}

Test(regress, a_request_routed_right_after_a_finish_is_not_left_queued, .timeout = 60)
{
	struct kvr_router *r = saturable_router(on_admit_count, NULL, false, 0);
	int queued = 0;
	static uint32_t tok[64];
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	for (int it = 0; it < 20; it++) {
		prompt(tok, 64, 2000 + (uint32_t)it);
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0); /* 64 prefill tokens > 16: saturated */
		cr_assert_eq(d.status, KVR_DECIDED);
		cr_assert_eq(kvr_router_sync(r, 1000), 0);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0); /* nothing queued: posted */
		tok[0] ^= 0x55555;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		if (d.status == KVR_QUEUED) {
			cr_assert(admits_within(&lone_admits, 1, 5000),
			          "round %d: queued (ticket %" PRIu64
			          ") on a rank the finish freed, "
			          "never admitted",
			          it, d.ticket);
			lone_admits = 0;
			queued++;
			d.attempt = __atomic_load_n(&lone_attempt, __ATOMIC_RELAXED);
			cr_assert_neq(d.attempt, 0, "round %d: admitted as failed", it);
		} else {
			cr_assert_eq(d.status, KVR_DECIDED);
		}
		cr_assert_eq(lone_admits, 0, "its decision came from kvr_route, not on_admit");
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
		cr_assert_eq(kvr_router_sync(r, 1000), 0);
	}
	cr_log_info("queued then admitted: %d", queued);
	kvr_router_destroy(r);
}

/* A route that queues while a finish on another thread is between its look at the queue (empty:
 * no pass) and its post: the route read the load before the finish's work, and the finish saw
 * nothing queued, so nobody pumped after the release and the request stayed queued on the freed
 * rank.  The finish looks at the queue again after its post now.  The interleaving is made
 * with sync_booking's clock, read by the finish's timed post between the two: there the clock
 * routes the request. */
static struct kvr_router *race_r;
static uint32_t race_tok[64];
static int race_armed, race_rc = -1;
static struct kvr_decision race_d;
static uint64_t race_clock(void *ctx)
{
	(void)ctx;
	if (__atomic_exchange_n(&race_armed, 0, __ATOMIC_RELAXED)) {
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = race_tok;
		q.n_tokens = 64;
		race_rc = kvr_route(race_r, &q, &race_d);
	}
	return vclock(NULL);
}

Test(regress, a_request_queued_while_a_finish_posts_is_admitted_by_it)
{
	lone_admits = 0;
	race_r = saturable_router(on_admit_count, race_clock, true, 0);
	struct kvr_router *r = race_r;
	static uint32_t hog[64];
	prompt(hog, 64, 3000);
	prompt(race_tok, 64, 3001);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = hog;
	q.n_tokens = 64;
	struct kvr_decision h;
	cr_assert_eq(kvr_route(r, &q, &h), 0); /* 64 prefill tokens > 16: saturated */
	cr_assert_eq(h.status, KVR_DECIDED);
	__atomic_store_n(&race_armed, 1, __ATOMIC_RELAXED);
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
	cr_assert_eq(race_armed, 0, "the finish read the clock");
	cr_assert_eq(race_rc, 0, "%s", kvr_strerror(race_rc));
	cr_assert_eq(race_d.status, KVR_QUEUED, "routed inside the finish, before its post");
	cr_assert_eq(lone_admits, 1, "the finish's release admits the queued request");
	kvr_router_destroy(r);
}

/* A request queued behind an attempt that vanishes (never finished: its lease expires) is
 * admitted once the reaper lowers the load, with no further call on the router: the shards pump
 * nothing, and before, the request stayed queued on the idle rank until the embedder's next call
 * that pumped (kvrouter.h told it to call kvr_router_sync now and then; the wait below ran out).
 * The expiry wakes the router's admission thread now, which runs on_admit.  The wait is a bound
 * on an event, not a timing: the lease expires within 40 ms, so 10 s is a hang. */
static int expiry_admits;
static struct kvr_router *expiry_r;
static void on_admit_expiry(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	/* On the admission thread: a destroy from on_admit returns at once, as on any thread (it
	 * would join the thread that runs it). */
	kvr_router_destroy(__atomic_load_n(&expiry_r, __ATOMIC_SEQ_CST));
	if (d->status == KVR_DECIDED)
		__atomic_add_fetch(&expiry_admits, 1, __ATOMIC_SEQ_CST);
}

Test(regress, a_request_queued_behind_an_expired_lease_is_admitted_with_no_further_call,
     .timeout = 60)
{
	/* idle attempts expire after 20 to 40 ms */
	struct kvr_router *r = saturable_router(on_admit_expiry, NULL, false, 20000000);
	__atomic_store_n(&expiry_r, r, __ATOMIC_SEQ_CST);
	static uint32_t tok[64];
	prompt(tok, 64, 7000);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0); /* 64 prefill tokens > 16: saturated */
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 1000000000), 0);
	tok[0] ^= 0x55555;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	/* The first attempt vanishes; nothing calls the router until the admission came. */
	for (int i = 0; i < 10000 && !__atomic_load_n(&expiry_admits, __ATOMIC_SEQ_CST); i++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(__atomic_load_n(&expiry_admits, __ATOMIC_SEQ_CST), 1,
	             "the expiry of the vanished attempt admitted nobody");
	/* The router outlived its on_admit's destroy: it still routes. */
	tok[0] ^= 0x3333;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	kvr_router_destroy(r);
}

/* The same for load a shard lowers on a timer of its own: with expected_prefill_ns the oldest
 * prefill counts less as it goes, and the shard publishes each step.  Once the decay took the
 * rank below the threshold, the request queued behind the prefill waited for the embedder's next
 * call (probe: 0 admitted 500 ms later with a prefill of 100 ms; the sync admitted it).  The step
 * wakes the admission thread now.  No lease expires here (a minute's interval). */
static int decay_admits;
static void on_admit_decay(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	if (d->status == KVR_DECIDED)
		__atomic_add_fetch(&decay_admits, 1, __ATOMIC_SEQ_CST);
}

Test(regress, a_request_queued_behind_a_decaying_prefill_is_admitted_with_no_further_call,
     .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit_decay;
	c.expected_prefill_ns = 50000000;          /* 50 ms */
	c.lease_scan_interval_ns = 60000000000ull; /* no expiry */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 100000, 16), 0);
	static uint32_t tok[64];
	prompt(tok, 64, 7100);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0); /* 64 prefill tokens > 16: saturated */
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 1000000000), 0);
	tok[0] ^= 0x55555;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	/* The first attempt never reports: nothing calls the router until the admission came. */
	for (int i = 0; i < 10000 && !__atomic_load_n(&decay_admits, __ATOMIC_SEQ_CST); i++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(__atomic_load_n(&decay_admits, __ATOMIC_SEQ_CST), 1,
	             "the decay of the first prefill admitted nobody");
	kvr_router_destroy(r);
}

/* An output ends its attempt's prefill (the output implies it), and on a saturated rank with
 * nothing queued it is posted, not waited for (outputs are frequent).  A route right after it
 * reads the load before the shard applied the output, and queues; the shard then lowers the
 * load and, before, pumped nothing: the request waited for the embedder's next call.  Now a
 * posted release wakes the admission thread once applied.  Rounds where the shard was quicker
 * than the route do not queue; every round that queued must be admitted with no call. */
static int output_admits;
static uint64_t output_admitted; /* the attempt on_admit was given */
static void on_admit_output(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	if (d->status == KVR_DECIDED) {
		__atomic_store_n(&output_admitted, d->attempt, __ATOMIC_SEQ_CST);
		__atomic_add_fetch(&output_admits, 1, __ATOMIC_SEQ_CST);
	}
}

Test(regress, a_request_queued_behind_a_posted_output_is_admitted_with_no_further_call,
     .timeout = 120)
{
	struct kvr_router *r = saturable_router(on_admit_output, NULL, false, 0);
	static uint32_t tok[64];
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	int queued = 0;
	for (int it = 0; it < 50; it++) {
		prompt(tok, 64, 9000 + (uint32_t)it);
		struct kvr_decision a, b;
		cr_assert_eq(kvr_route(r, &q, &a), 0); /* 64 prefill tokens > 16: saturated */
		cr_assert_eq(a.status, KVR_DECIDED);
		cr_assert_eq(kvr_router_sync(r, 1000000000), 0);
		const uint32_t out[1] = {7};
		cr_assert_eq(kvr_request_output(r, a.attempt, out, 1), 0); /* posted */
		tok[0] ^= 0x55555;
		cr_assert_eq(kvr_route(r, &q, &b), 0);
		if (b.status == KVR_QUEUED) {
			queued++;
			int want = queued;
			for (int i = 0;
			     i < 10000 && __atomic_load_n(&output_admits, __ATOMIC_SEQ_CST) < want;
			     i++) {
				struct timespec ts = {0, 1000000};
				nanosleep(&ts, NULL);
			}
			cr_assert_eq(__atomic_load_n(&output_admits, __ATOMIC_SEQ_CST), want,
			             "round %d: queued behind the output, admitted nobody in 10 s",
			             it);
			cr_assert_eq(kvr_request_finish(
			                 r, __atomic_load_n(&output_admitted, __ATOMIC_SEQ_CST)),
			             0);
		} else {
			cr_assert_eq(kvr_request_finish(r, b.attempt), 0);
		}
		cr_assert_eq(kvr_request_finish(r, a.attempt), 0);
		cr_assert_eq(kvr_router_sync(r, 1000000000), 0);
	}
	cr_log_info("queued behind the output in %d of 50 rounds", queued);
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- uncollected admissions */

/* The kvr_queue_uncollected gauge: admissions (or failures) waiting in the queue's list for a
 * kvr_route_wait to collect them; -1 when the metrics do not have it. */
static long uncollected(struct kvr_router *r)
{
	static char text[1 << 17];
	cr_assert_eq(kvr_metrics_render(r, text, sizeof(text), NULL), 0);
	const char *p = strstr(text, "\nkvr_queue_uncollected ");
	return p ? strtol(p + strlen("\nkvr_queue_uncollected "), NULL, 10) : -1;
}

/* Waits (10 s at most) until nothing is queued: a finish does not run the pass any more, the
 * admission thread does once the shard applied it (core/lifecycle.c), so a request the finish
 * admits is admitted a moment after the call returned (kvr_router_sync waits for the shard, not
 * for that thread's pass). */
static void await_admission(struct kvr_router *r)
{
	static char text[1 << 17];
	long depth = -1;
	for (int ms = 0; ms < 10000 && depth != 0; ms++) {
		if (ms) {
			struct timespec ts = {0, 1000000};
			nanosleep(&ts, NULL);
		}
		cr_assert_eq(kvr_metrics_render(r, text, sizeof(text), NULL), 0);
		const char *p = strstr(text, "\nkvr_queue_depth ");
		cr_assert(p, "no kvr_queue_depth gauge");
		depth = strtol(p + strlen("\nkvr_queue_depth "), NULL, 10);
	}
	cr_assert_eq(depth, 0, "still queued after 10 s");
}

/* The documented way to give up on a queued request: wait with a deadline, cancel, move on.
 * When the admission lands between the wait's timeout and the cancel, the cancel said KVR_ENOENT
 * and the admission stayed in the queue's list for a collection that never came, its attempt
 * holding the rank's load until its lease expired (probe: 500 rounds, 500 records left, 174
 * attempts still active at the end; here the second round's request queued behind the first
 * round's leaked load).  The cancel takes the outcome and ends the attempt now: 0, nothing held,
 * the ticket gone. */
Test(regress, a_cancel_that_loses_the_race_to_admission_ends_the_attempt)
{
	struct kvr_router *r = make_queue_router(NULL, 16);
	struct kvr_rank_id id = {0, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, KVR_CAPACITY_NONE, 100), 0);
	static uint32_t hog[200], t[200];
	for (int it = 0; it < 50; it++) {
		prompt(hog, 200, 5000 + 2 * (uint32_t)it);
		prompt(t, 200, 5001 + 2 * (uint32_t)it);
		struct kvr_decision h, q, d;
		cr_assert_eq(route_tokens(r, hog, 200, NULL, &h), 0);
		cr_assert_eq(h.status, KVR_DECIDED, "it %d: nothing else holds the rank", it);
		cr_assert_eq(route_tokens(r, t, 200, NULL, &q), 0);
		cr_assert_eq(q.status, KVR_QUEUED, "it %d: saturated by the hog", it);
		/* The caller gives up (vnow is past deadline 1)... */
		cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ETIMEDOUT);
		/* ...the hog's finish admits the request meanwhile... */
		cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
		/* ...and its cancel loses the race. */
		cr_assert_eq(kvr_route_cancel(r, q.ticket), 0, "it %d", it);
		memset(&d, 0x5a, sizeof(d));
		cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ENOENT, "it %d: gone", it);
		cr_assert_eq(d.status, 0x5a5a5a5a, "d not written");
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		struct kvr_rank_stats st;
		cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
		cr_assert_eq(st.active_requests, 0, "it %d: the admission was ended", it);
		cr_assert_eq(st.active_prefill_tokens, 0, "it %d", it);
		cr_assert_eq(uncollected(r), 0, "it %d", it);
	}
	kvr_router_destroy(r);
}

/* A caller that gives up without cancelling (the header's "or its admission is reported to
 * nobody") left each admission in the queue's list for good, with no bound: once its attempt's
 * lease expired, collecting it gave a stale attempt (probe: 500 records, all stale, 400 ms past
 * the last lease).  An admission nobody collected is reclaimed once its attempt ended, by the
 * admission thread the expiry wakes, with no further call: the list is bounded by the live
 * leases, and the load and the list both return to zero. */
Test(regress, admissions_nobody_collects_go_when_their_leases_expire, .timeout = 60)
{
	enum { N = 32 };
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.lease_scan_interval_ns = 200000000; /* idle attempts expire after 200 to 400 ms */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (uint64_t i = 0; i < N; i++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){i + 1, 0}, 1, 100000, 16), 0);
	uint64_t tickets[N];
	static uint32_t tok[64];
	for (int i = 0; i < N; i++) {
		struct kvr_rank_id id = {(uint64_t)i + 1, 0};
		struct kvr_decision h, q, d;
		prompt(tok, 64, 9000 + 2 * (uint32_t)i);
		cr_assert_eq(route_tokens(r, tok, 64, &id, &h), 0); /* 64 tokens > 16: saturated */
		cr_assert_eq(h.status, KVR_DECIDED);
		cr_assert_eq(kvr_router_sync(r, 10000), 0);
		prompt(tok, 64, 9001 + 2 * (uint32_t)i);
		cr_assert_eq(route_tokens(r, tok, 64, &id, &q), 0);
		cr_assert_eq(q.status, KVR_QUEUED, "round %d", i);
		tickets[i] = q.ticket;
		cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ETIMEDOUT); /* gives up */
		cr_assert_eq(kvr_request_finish(r, h.attempt), 0);               /* admits it */
		/* Before the next round's hog: routed while this request still waits for the
		 * admission thread's pass, it queued behind it (h.status KVR_QUEUED, 4 runs in
		 * 12 under ASan on a loaded machine). */
		await_admission(r);
		if (i == 0) {
			/* While its attempt lives, an admission waits for its collector. */
			cr_assert_eq(
			    kvr_route_wait(r, q.ticket, kvr_router_now(r) + 5000000000ull, &d), 0);
			cr_assert_eq(d.status, KVR_DECIDED);
			cr_assert_eq(kvr_request_finish(r, d.attempt), 0, "a live attempt");
		}
	}
	/* No call on the router from here but reads: the expiries alone must do it. */
	bool done = false;
	for (int ms = 0; ms < 20000 && !done; ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
		uint64_t active = 0;
		for (uint64_t i = 0; i < N; i++) {
			struct kvr_rank_stats st;
			cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){i + 1, 0}, &st), 0);
			active += st.active_requests + st.active_prefill_tokens;
		}
		done = active == 0 && uncollected(r) == 0;
	}
	for (int i = 0; i < N; i++) {
		struct kvr_decision d;
		cr_assert_eq(kvr_route_wait(r, tickets[i], 1, &d), KVR_ENOENT,
		             "round %d: its record outlived its attempt", i);
	}
	cr_assert_eq(uncollected(r), 0, "the expired admissions' records were reclaimed");
	kvr_router_destroy(r);
}

/* A failed admission (its pinned rank removed) that nobody collects (no on_admit, no wait) has
 * no attempt to expire: it is reclaimed two lease scan intervals after it failed, as long as an
 * idle attempt lives (before, it stayed for good, and a wait a day later still collected it). */
Test(regress, a_failed_admission_nobody_collects_goes_after_two_lease_intervals)
{
	struct kvr_router *r = make_queue_router(NULL, 16);
	struct kvr_rank_id gone = {3, 0}, other = {4, 0};
	cr_assert_eq(kvr_rank_add(r, gone, 1, 1000, 100), 0);
	cr_assert_eq(kvr_rank_add(r, other, 1, 1000, 100), 0);
	uint64_t ticket = queue_pinned_then_remove(r, gone);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	cr_assert_eq(uncollected(r), 1, "failed, kept for its collector");
	struct kvr_config c;
	cr_assert_eq(kvr_router_get_config(r, &c), 0);
	__atomic_add_fetch(&vnow, 2 * c.lease_scan_interval_ns - 1, __ATOMIC_RELAXED);
	/* A request queued: the list grows, and reclaims what is of no use first. */
	static uint32_t hog[200], t[64];
	prompt(hog, 200, 17);
	prompt(t, 64, 18);
	struct kvr_decision h, q, d;
	cr_assert_eq(route_tokens(r, hog, 200, &other, &h), 0);
	cr_assert_eq(route_tokens(r, t, 64, &other, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(uncollected(r), 1, "not yet two intervals old");
	cr_assert_eq(kvr_route_cancel(r, q.ticket), 0);
	__atomic_add_fetch(&vnow, 1, __ATOMIC_RELAXED);
	cr_assert_eq(route_tokens(r, t, 64, &other, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(uncollected(r), 0, "two intervals old: reclaimed");
	memset(&d, 0x5a, sizeof(d));
	cr_assert_eq(kvr_route_wait(r, ticket, 1, &d), KVR_ENOENT);
	cr_assert_eq(d.status, 0x5a5a5a5a, "nothing collected");
	cr_assert_eq(kvr_route_cancel(r, q.ticket), 0);
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0);
	kvr_router_destroy(r);
}

/* The lease scan interval of failed_uncollected's routers: 1 ms of the virtual clock. */
#define FAILED_SCAN_NS 1000000ull

/* A router (one shard, a queue, sync_booking, the clock now_ns) holding one failed admission
 * nobody collects: a request queued behind a hog pinned to a rank, waited on until its deadline
 * passed (so on_admit, when s is given, does not report it), then the rank removed.  *ticket:
 * the request's; seed: the prompts'. */
static struct kvr_router *failed_uncollected(kvr_clock_fn now_ns, struct seen *s, uint32_t seed,
                                             uint64_t *ticket)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = now_ns;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	c.max_ranks = 16;
	c.lease_scan_interval_ns = FAILED_SCAN_NS;
	if (s) {
		c.on_admit = on_admit;
		c.callback_ctx = s;
	}
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id gone = {3, 0};
	cr_assert_eq(kvr_rank_add(r, gone, 1, 1000, 100), 0);
	static uint32_t hog[200], t[64];
	prompt(hog, 200, seed);
	prompt(t, 64, seed + 1);
	struct kvr_decision h, q, d;
	cr_assert_eq(route_tokens(r, hog, 200, &gone, &h), 0);
	cr_assert_eq(h.status, KVR_DECIDED);
	cr_assert_eq(route_tokens(r, t, 64, &gone, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ETIMEDOUT); /* vnow is past 1 */
	cr_assert_eq(kvr_rank_remove(r, gone), 0);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	cr_assert_eq(uncollected(r), 1, "failed, kept for the wait's caller");
	*ticket = q.ticket;
	return r;
}

/* The same failed admission on an idle router: after a wait that timed out (so on_admit does not
 * report it) its pinned rank goes, and nothing is called after.  Before, only a push or a rank
 * removal reclaimed it, and it stayed for good (kvr_queue_uncollected 1 after 20 s); the
 * admission thread reclaims it now once its two intervals are over.  The clock is virtual: the
 * reclaim can only come from the admission thread reading it again by itself. */
Test(regress, a_failed_admission_nobody_collects_goes_on_an_idle_router)
{
	struct seen s;
	memset(&s, 0, sizeof(s));
	pthread_mutex_init(&s.mu, NULL);
	uint64_t ticket;
	struct kvr_router *r = failed_uncollected(vclock, &s, 27, &ticket);
	struct kvr_decision d;
	cr_assert_eq(seen_find(&s, ticket, NULL), 0, "waited on: not reported");
	__atomic_add_fetch(&vnow, 2 * FAILED_SCAN_NS, __ATOMIC_RELAXED);
	/* Reads only from here. */
	long left = 1;
	for (int ms = 0; ms < 20000 && left != 0; ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
		left = uncollected(r);
	}
	cr_assert_eq(left, 0, "the failed admission outlived its two intervals on an idle router");
	cr_assert_eq(kvr_route_wait(r, ticket, 1, &d), KVR_ENOENT);
	kvr_router_destroy(r);
	pthread_mutex_destroy(&s.mu);
}

/* Clock reads off the test's thread, for the next test. */
static pthread_t clock_owner;
static uint64_t clock_reads_off_owner;
static uint64_t counting_clock(void *ctx)
{
	if (!pthread_equal(pthread_self(), clock_owner))
		__atomic_add_fetch(&clock_reads_off_owner, 1, __ATOMIC_RELAXED);
	return vclock(ctx);
}

/* The clock stopped: after 50 ms to settle, the router's threads read it fewer than 400 times
 * in the next 0.5 s (a spinning thread reads it thousands of times; a slow machine, less). */
static void assert_no_spin_on_stopped_clock(void)
{
	struct timespec settle = {0, 50000000}, span = {0, 500000000};
	nanosleep(&settle, NULL);
	uint64_t r0 = __atomic_load_n(&clock_reads_off_owner, __ATOMIC_RELAXED);
	nanosleep(&span, NULL);
	uint64_t reads = __atomic_load_n(&clock_reads_off_owner, __ATOMIC_RELAXED) - r0;
	cr_assert_lt(reads, 400,
	             "the router's threads read the stopped clock %" PRIu64
	             " times in 0.5 s: a spin",
	             reads);
}

/* The same failed admission, the virtual clock stopped 1 us short of its due time (a paused
 * simulation).  The admission thread parked for the gap left, in ns, again and again: ~12,000
 * wakes (clock reads) and ~20% of a core per second.  Now it parks 1 ms at least and backs off
 * while the clock stands still.  Only a spinning thread reads more: a slow machine reads less. */
Test(regress, a_stopped_virtual_clock_short_of_a_reclaim_does_not_spin_the_admission_thread)
{
	clock_owner = pthread_self();
	uint64_t ticket;
	struct kvr_router *r = failed_uncollected(counting_clock, NULL, 29, &ticket);
	(void)ticket;
	/* Due two intervals after it failed, at the vnow read then: stop 1 us short. */
	__atomic_add_fetch(&vnow, 2 * FAILED_SCAN_NS - 1000, __ATOMIC_RELAXED);
	assert_no_spin_on_stopped_clock();
	cr_assert_eq(uncollected(r), 1, "not due: the clock stopped short");
	__atomic_add_fetch(&vnow, 1000, __ATOMIC_RELAXED); /* due now: still reclaimed */
	long left = 1;
	for (int ms = 0; ms < 20000 && left != 0; ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
		left = uncollected(r);
	}
	cr_assert_eq(left, 0, "the failed admission outlived its due time once the clock moved");
	kvr_router_destroy(r);
}

/* A shard's timer (the lease reaper's next scan, an attempt live), the virtual clock stopped 1
 * us short of it (a paused simulation).  The shard parked for the gap left, again and again:
 * 6,479 clock reads and 0.11 s of CPU in 0.5 s (tests' probe, 1 shard).  Now, while the clock
 * stands still, the park is 1 ms at least and doubles to 16 ms.  Only a spinning thread reads
 * more: a slow machine reads less. */
Test(regress, a_stopped_virtual_clock_short_of_a_timer_does_not_spin_the_shard)
{
	clock_owner = pthread_self();
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = counting_clock;
	c.max_ranks = 16;
	c.lease_scan_interval_ns = 1000000; /* 1 ms of the virtual clock */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id one = {1, 0};
	cr_assert_eq(kvr_rank_add(r, one, 1, 1000, 100), 0);
	static uint32_t t[64];
	prompt(t, 64, 31);
	struct kvr_decision d;
	cr_assert_eq(route_tokens(r, t, 64, NULL, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct timespec settle = {0, 50000000};
	nanosleep(&settle, NULL);
	/* The reaper's next scan is an interval after the route's reading: stop 1 us short. */
	__atomic_add_fetch(&vnow, c.lease_scan_interval_ns - 1000, __ATOMIC_RELAXED);
	assert_no_spin_on_stopped_clock();
	/* The clock moves on, a step at a time: the idle attempt's lease still expires (the
	 * reaper still runs, a stalled park at most 16 ms late). */
	struct kvr_rank_stats st = {0};
	for (int ms = 0; ms < 20000; ms++) {
		__atomic_add_fetch(&vnow, c.lease_scan_interval_ns, __ATOMIC_RELAXED);
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
		cr_assert_eq(kvr_rank_get_stats(r, one, &st), 0);
		if (st.active_requests == 0)
			break;
	}
	cr_assert_eq(st.active_requests, 0, "the lease never expired once the clock moved");
	cr_assert_eq(kvr_request_finish(r, d.attempt), KVR_ESTALE);
	kvr_router_destroy(r);
}

/* An admission nobody collects whose attempt a rank reset (or a capacity call naming a new
 * incarnation) ended: every call on the attempt is KVR_ESTALE from then on, so its outcome is of
 * no use, but no lease is left to expire and wake the admission thread for it, and the reset's
 * own pump returns at once with nothing queued.  On an idle router it stayed for good
 * (kvr_queue_uncollected 1). */
static void admitted_uncollected_then_new_life(bool reset)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.lease_scan_interval_ns = 60ull * 1000000000ull; /* no expiry within the test */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {1, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 16), 0);
	static uint32_t tok[64];
	struct kvr_decision h, q, d;
	prompt(tok, 64, 31000);
	cr_assert_eq(route_tokens(r, tok, 64, &id, &h), 0); /* 64 tokens > 16: saturated */
	cr_assert_eq(h.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	prompt(tok, 64, 31001);
	cr_assert_eq(route_tokens(r, tok, 64, &id, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ETIMEDOUT); /* gives up */
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0);               /* admits it */
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	await_admission(r); /* the sync waits for the shard, not for the admission thread */
	cr_assert_eq(uncollected(r), 1, "admitted, kept for its collector");
	if (reset)
		cr_assert_eq(kvr_rank_reset(r, id, 2), 0);
	else
		cr_assert_eq(kvr_rank_set_capacity(r, id, 2, 100000), 0);
	/* Reads only from here. */
	long left = 1;
	for (int ms = 0; ms < 2000 && left != 0; ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
		left = uncollected(r);
	}
	cr_assert_eq(left, 0, "the admission outlived its attempt, which the %s ended",
	             reset ? "reset" : "new incarnation");
	cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ENOENT);
	kvr_router_destroy(r);
}

Test(regress, an_uncollected_admission_goes_when_a_reset_ends_its_attempt)
{
	admitted_uncollected_then_new_life(true);
}

Test(regress, an_uncollected_admission_goes_when_a_new_incarnation_ends_its_attempt)
{
	admitted_uncollected_then_new_life(false);
}

/* A clock that, armed, lets the lease of the attempt the test thread's admission pass just made
 * expire inside the pass's clock read that follows the admission (queue.c reads it after
 * kvr_route_internal, off its lock, before it counts the outcome as uncollected): it steps the
 * virtual time one lease interval at a time and lets the shard's reaper run. */
static struct kvr_router *pass_router;
static pthread_t pass_thread;
static int pass_armed, pass_danced;
#define PASS_SCAN_NS 1000000ull
static uint64_t pass_clock(void *ctx)
{
	if (__atomic_load_n(&pass_armed, __ATOMIC_ACQUIRE) &&
	    pthread_equal(pthread_self(), pass_thread) && kvr_queue_pumped_here(pass_router)) {
		pass_danced++;
		for (int k = 0; k < 8; k++) {
			__atomic_add_fetch(&vnow, PASS_SCAN_NS, __ATOMIC_RELAXED);
			struct timespec ts = {0, 20000000};
			nanosleep(&ts, NULL);
		}
	}
	return vclock(ctx);
}

/* An admission nobody collects (its wait timed out) whose lease expires between the pass's
 * admission and the pass's count of it as uncollected (the pass reads the clock in between, off
 * the queue's lock; a slow clock, a preempted thread, a virtual clock a simulation steps).  The
 * expiry's hook (kvr_admitter_note_unloaded) reads the queue's depth, still 1, and wakes the
 * admission thread, whose pass finds the test thread's running (again) and whose reap finds
 * nothing uncollected yet; then the count rises, and no expiry is left to wake anyone: the record
 * stays in the list for good on an idle router (kvr_queue_uncollected 1), its attempt long
 * ended.  The pass now judges an outcome it keeps for nobody at once (after a fence that pairs
 * with the hook's). */
Test(regress, an_admission_whose_lease_expires_inside_its_pass_is_still_reclaimed)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = pass_clock;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	c.lease_scan_interval_ns = PASS_SCAN_NS;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	pass_router = r;
	pass_thread = pthread_self();
	struct kvr_rank_id id = {1, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 100000, 16), 0);
	static uint32_t tok[64];
	struct kvr_decision h, q, d;
	prompt(tok, 64, 33000);
	cr_assert_eq(route_tokens(r, tok, 64, &id, &h), 0); /* 64 tokens > 16: saturated */
	cr_assert_eq(h.status, KVR_DECIDED);
	prompt(tok, 64, 33001);
	cr_assert_eq(route_tokens(r, tok, 64, &id, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED);
	cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ETIMEDOUT); /* gives up */
	__atomic_store_n(&pass_armed, 1, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_request_finish(r, h.attempt), 0); /* admits it, in this thread's pass */
	__atomic_store_n(&pass_armed, 0, __ATOMIC_RELEASE);
	cr_assert_gt(pass_danced, 0, "the pass read the clock");
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
	cr_assert_eq(st.active_requests, 0, "the admission's lease expired in its pass");
	/* Reads only from here. */
	long left = 1;
	for (int ms = 0; ms < 2000 && left != 0; ms++) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
		left = uncollected(r);
	}
	cr_assert_eq(left, 0, "the admission outlived its expired attempt on an idle router");
	cr_assert_eq(kvr_route_wait(r, q.ticket, 1, &d), KVR_ENOENT);
	kvr_router_destroy(r);
}

/* A request restricted to a rank (pinned, or allow-listed to it and to ranks that do not exist)
 * whose rank goes between kvr_route's look at it (live and saturated: it queues) and its push:
 * the removal's pass (kvr_queue_rank_gone's, full) runs before the entry is on the list, and
 * every later pass ends at the first saturated unrestricted entry, which waits ahead of it.  It
 * stayed queued (on_admit told nothing, kvr_route_wait ran out) until that entry was admitted or
 * another rank went.  Now it fails at once (KVR_ENOENT, as if the rank had gone before the
 * call), or, queued, is failed within the wait and reported once.  The removal runs on another
 * thread inside the routing thread's first clock read after the look (the push's). */
static struct kvr_router *gone_r;
static struct kvr_rank_id gone_rank;
static pthread_t gone_thread;
static int gone_armed, gone_fired, gone_rc = -1, gone_ticking;

static void *gone_remove(void *p)
{
	(void)p;
	gone_rc = kvr_rank_remove(gone_r, gone_rank);
	return NULL;
}

static uint64_t gone_clock(void *ctx)
{
	if (pthread_equal(pthread_self(), gone_thread) &&
	    __atomic_exchange_n(&gone_armed, 0, __ATOMIC_ACQ_REL)) {
		pthread_t t;
		cr_assert_eq(pthread_create(&t, NULL, gone_remove, NULL), 0);
		pthread_join(t, NULL);
		gone_fired = 1;
	}
	return vclock(ctx);
}

/* Moves the virtual clock 1 ms a real ms while gone_ticking, so that a wait's deadline passes. */
static void *gone_ticker(void *p)
{
	(void)p;
	while (__atomic_load_n(&gone_ticking, __ATOMIC_ACQUIRE)) {
		__atomic_add_fetch(&vnow, 1000000, __ATOMIC_RELAXED);
		nanosleep(&(struct timespec){0, 1000000}, NULL);
	}
	return NULL;
}

static void restricted_to_a_rank_removed_before_its_push(bool allow, bool wait,
                                                         enum kvr_queue_policy policy, bool full)
{
	struct seen s;
	memset(&s, 0, sizeof(s));
	pthread_mutex_init(&s.mu, NULL);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = gone_clock;
	c.queue_threshold = 1.0;
	c.queue_policy = policy;
	c.lease_scan_interval_ns = 1000000000000000ull; /* no lease expires: the hogs stay */
	if (full)
		c.queue_capacity = 1; /* the unrestricted request below fills it */
	if (!wait) {
		c.on_admit = on_admit;
		c.callback_ctx = &s;
	}
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id a = {1, 0}, b = {2, 0}, never = {3, 0};
	cr_assert_eq(kvr_rank_add(r, a, 1, 100000, 16), 0);
	cr_assert_eq(kvr_rank_add(r, b, 1, 100000, 16), 0);
	struct kvr_decision ha, hb, u, d;
	/* 64 prefill tokens > 16: each rank saturated, for good (no lease expires). */
	cr_assert_eq(route_salt_pinned(r, &a, 34000, 64, &ha), 0);
	cr_assert_eq(route_salt_pinned(r, &b, 34001, 64, &hb), 0);
	cr_assert_eq(ha.status, KVR_DECIDED);
	cr_assert_eq(hb.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	/* An unrestricted request waits: every live rank is saturated. */
	static uint32_t tu[64], tp[128];
	prompt(tu, 64, 34002);
	cr_assert_eq(route_tokens(r, tu, 64, NULL, &u), 0);
	cr_assert_eq(u.status, KVR_QUEUED);
	/* Then one for rank a only (under WSPT after u too: more uncached tokens), a removed
	 * inside its push. */
	prompt(tp, 128, 34003);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tp;
	q.n_tokens = 128;
	const struct kvr_rank_id list[2] = {a, never};
	if (allow) {
		q.allow = list;
		q.n_allow = 2;
	} else {
		q.pinned = &a;
	}
	pthread_t ticker;
	if (wait) {
		q.flags |= KVR_ROUTE_WAIT;
		q.deadline_ns = vclock(NULL) + 5000000000ull; /* 5 s of the ticking clock */
		__atomic_store_n(&gone_ticking, 1, __ATOMIC_RELEASE);
		cr_assert_eq(pthread_create(&ticker, NULL, gone_ticker, NULL), 0);
	}
	gone_r = r;
	gone_rank = a;
	gone_thread = pthread_self();
	gone_fired = 0;
	gone_rc = -1;
	__atomic_store_n(&gone_armed, 1, __ATOMIC_RELEASE);
	int rc = kvr_route(r, &q, &d);
	__atomic_store_n(&gone_armed, 0, __ATOMIC_RELEASE);
	if (wait) {
		__atomic_store_n(&gone_ticking, 0, __ATOMIC_RELEASE);
		pthread_join(ticker, NULL);
	}
	cr_assert_eq(gone_fired, 1, "the route read the clock");
	cr_assert_eq(gone_rc, 0, "the removal: %s", kvr_strerror(gone_rc));
	if (rc == 0 && !wait && !full) {
		/* Queued: its failure is reported through on_admit, once, within 5 s. */
		cr_assert_eq(d.status, KVR_QUEUED);
		int found = 0;
		for (int ms = 0; ms < 5000 && !found; ms++) {
			nanosleep(&(struct timespec){0, 1000000}, NULL);
			found = seen_find(&s, d.ticket, NULL);
		}
		cr_assert_eq(found, 1,
		             "the request for the removed rank stayed queued (ticket %" PRIu64
		             ") behind a saturated unrestricted one",
		             d.ticket);
		nanosleep(&(struct timespec){0, 20000000}, NULL);
		struct kvr_decision o;
		cr_assert_eq(seen_find(&s, d.ticket, &o), 1, "reported once");
		cr_assert_eq(o.status, KVR_FAILED);
		cr_assert_eq(o.error, KVR_ENOENT);
	} else {
		cr_assert_eq(rc, KVR_ENOENT, "%s: %s", kvr_strerror(rc), kvr_last_error());
	}
	/* Only the unrestricted request waits, still saturated; nobody was told anything. */
	cr_assert_eq(kvr_queue_depth(r), 1);
	cr_assert_eq(seen_find(&s, u.ticket, NULL), 0);
	pthread_mutex_lock(&s.mu);
	int told = s.n;
	pthread_mutex_unlock(&s.mu);
	cr_assert_eq(told, rc == 0 && !wait ? 1 : 0);
	kvr_router_destroy(r);
}

Test(regress, a_request_pinned_to_a_rank_removed_before_its_push_fails_at_once, .timeout = 60)
{
	restricted_to_a_rank_removed_before_its_push(false, false, KVR_QUEUE_FCFS, false);
}

Test(regress, a_waiter_allowed_only_a_rank_removed_before_its_push_fails_at_once, .timeout = 60)
{
	restricted_to_a_rank_removed_before_its_push(true, true, KVR_QUEUE_FCFS, false);
}

Test(regress, a_request_allowed_only_a_rank_removed_before_its_push_fails_at_once_wspt,
     .timeout = 60)
{
	restricted_to_a_rank_removed_before_its_push(true, false, KVR_QUEUE_WSPT, false);
}

Test(regress, a_waiter_pinned_to_a_rank_removed_before_its_push_fails_at_once_wspt, .timeout = 60)
{
	restricted_to_a_rank_removed_before_its_push(false, true, KVR_QUEUE_WSPT, false);
}

/* The same with the queue full: the push refused it with KVR_EAGAIN ("try again"), and the
 * retry got KVR_ENOENT.  Nothing it could wait for: its ranks are gone, so KVR_ENOENT at once,
 * whatever room the queue has. */
Test(regress, a_request_pinned_to_a_rank_removed_before_its_push_into_a_full_queue_fails_enoent,
     .timeout = 60)
{
	restricted_to_a_rank_removed_before_its_push(false, false, KVR_QUEUE_FCFS, true);
}

Test(regress, a_waiter_allowed_only_a_rank_removed_before_its_push_into_a_full_queue_fails_enoent,
     .timeout = 60)
{
	restricted_to_a_rank_removed_before_its_push(true, true, KVR_QUEUE_WSPT, true);
}

/* An unrestricted request whose every rank goes between kvr_route's look (live and saturated:
 * it queues) and its push, while the queue is full: a full queue with no rank left lasts only
 * while the removal runs (its pass, kvr_queue_rank_gone's, then fails every waiting request,
 * none of which has a rank left), and a push inside that window was refused KVR_EAGAIN ("try
 * again"), for a retry that could only get KVR_ENOENT.  As for a restricted request (above):
 * KVR_ENOENT at once, whatever room the queue has.  The window is held open: the routing
 * thread's push reads the clock, where the rank's shard is stalled by a task of the test and
 * the removal started on another thread; that removal takes the rank off the live list and then
 * waits for the stalled shard (its teardown), before its pass.  The push goes on once the rank's
 * live word is clear. */
static struct kvr_router *all_r;
static struct kvr_rank_id all_rank;
static uint32_t all_slot;
static pthread_t all_thread, all_remover;
static int all_armed, all_fired, all_stalled, all_go, all_rc = -1;

static void all_stall(struct kvr_shard *sh, void *p)
{
	(void)sh;
	(void)p;
	__atomic_store_n(&all_stalled, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&all_go, __ATOMIC_ACQUIRE))
		nanosleep(&(struct timespec){0, 100000}, NULL);
}

static void *all_remove(void *p)
{
	(void)p;
	all_rc = kvr_rank_remove(all_r, all_rank);
	return NULL;
}

static uint64_t all_clock(void *ctx)
{
	if (pthread_equal(pthread_self(), all_thread) &&
	    __atomic_exchange_n(&all_armed, 0, __ATOMIC_ACQ_REL)) {
		struct kvr_shard *sh = kvr_router_shard_of(all_r, all_slot);
		cr_assert_eq(kvr_shard_post(sh, KVR_LANE_ROUTING, all_stall, NULL, 0), 0);
		for (int ms = 0; ms < 10000 && !__atomic_load_n(&all_stalled, __ATOMIC_ACQUIRE);
		     ms++)
			nanosleep(&(struct timespec){0, 1000000}, NULL);
		cr_assert(__atomic_load_n(&all_stalled, __ATOMIC_ACQUIRE), "the shard stalled");
		cr_assert_eq(pthread_create(&all_remover, NULL, all_remove, NULL), 0);
		for (int ms = 0;
		     ms < 10000 && __atomic_load_n(&all_r->ranks[all_slot].live, __ATOMIC_ACQUIRE);
		     ms++)
			nanosleep(&(struct timespec){0, 1000000}, NULL);
		cr_assert_eq(__atomic_load_n(&all_r->ranks[all_slot].live, __ATOMIC_ACQUIRE), 0,
		             "the removal took the rank off");
		cr_assert_eq(kvr_queue_depth(all_r), 1, "the waiting request is not failed yet");
		all_fired = 1;
	}
	return vclock(ctx);
}

static void
unrestricted_whose_ranks_all_went_before_its_push_into_a_full_queue(enum kvr_queue_policy policy,
                                                                    bool wait)
{
	struct seen s;
	memset(&s, 0, sizeof(s));
	pthread_mutex_init(&s.mu, NULL);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = all_clock;
	c.queue_threshold = 1.0;
	c.queue_policy = policy;
	c.queue_capacity = 1; /* the first unrestricted request fills it */
	c.lease_scan_interval_ns = 1000000000000000ull; /* no lease expires: the hog stays */
	c.on_admit = on_admit;
	c.callback_ctx = &s;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id a = {1, 0};
	cr_assert_eq(kvr_rank_add(r, a, 1, 100000, 16), 0);
	struct kvr_decision h, u, d;
	cr_assert_eq(route_salt_pinned(r, &a, 35000, 64, &h), 0); /* 64 > 16: saturated */
	cr_assert_eq(h.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	static uint32_t tu[64], tq[128];
	prompt(tu, 64, 35001);
	cr_assert_eq(route_tokens(r, tu, 64, NULL, &u), 0);
	cr_assert_eq(u.status, KVR_QUEUED);
	cr_assert_eq(kvr_queue_depth(r), 1);
	/* Another unrestricted request: the only rank is saturated, so it queues; the rank goes
	 * inside its push. */
	prompt(tq, 128, 35002);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tq;
	q.n_tokens = 128;
	if (wait)
		q.flags |= KVR_ROUTE_WAIT; /* no deadline: queued, it would wait for good */
	all_r = r;
	all_rank = a;
	cr_assert_eq(kvr_router_find_rank(r, a, &all_slot), 0);
	all_thread = pthread_self();
	all_fired = 0;
	all_stalled = 0;
	all_go = 0;
	all_rc = -1;
	__atomic_store_n(&all_armed, 1, __ATOMIC_RELEASE);
	int rc = kvr_route(r, &q, &d);
	char detail[256];
	snprintf(detail, sizeof(detail), "%s", kvr_last_error());
	__atomic_store_n(&all_armed, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&all_go, 1, __ATOMIC_RELEASE);
	if (all_fired)
		pthread_join(all_remover, NULL);
	cr_assert_eq(all_fired, 1, "the push read the clock");
	cr_assert_eq(all_rc, 0, "the removal: %s", kvr_strerror(all_rc));
	cr_assert_eq(rc, KVR_ENOENT, "%s: %s", kvr_strerror(rc), detail);
	/* The removal's pass failed the waiting one (no rank left), told once. */
	int found = 0;
	for (int ms = 0; ms < 5000 && !found; ms++) {
		nanosleep(&(struct timespec){0, 1000000}, NULL);
		found = seen_find(&s, u.ticket, NULL);
	}
	cr_assert_eq(found, 1, "the waiting request was never failed");
	struct kvr_decision o;
	cr_assert_eq(seen_find(&s, u.ticket, &o), 1);
	cr_assert_eq(o.status, KVR_FAILED);
	cr_assert_eq(o.error, KVR_ENOENT);
	cr_assert_eq(kvr_queue_depth(r), 0);
	pthread_mutex_lock(&s.mu);
	int told = s.n;
	pthread_mutex_unlock(&s.mu);
	cr_assert_eq(told, 1, "only the waiting request was told anything");
	kvr_router_destroy(r);
}

Test(regress,
     an_unrestricted_request_whose_ranks_all_went_before_its_push_into_a_full_queue_fails_enoent,
     .timeout = 60)
{
	unrestricted_whose_ranks_all_went_before_its_push_into_a_full_queue(KVR_QUEUE_FCFS, false);
}

Test(
    regress,
    an_unrestricted_waiter_whose_ranks_all_went_before_its_push_into_a_full_queue_fails_enoent_wspt,
    .timeout = 60)
{
	unrestricted_whose_ranks_all_went_before_its_push_into_a_full_queue(KVR_QUEUE_WSPT, true);
}
