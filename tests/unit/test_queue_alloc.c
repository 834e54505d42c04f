/*
 * tests/unit/test_queue_alloc.c - what a queued route allocates (core/queue.c, kvr_queue_push).
 *
 * A push copies the request (its entry with the WSPT levels, the tokens, the allow-list, the
 * LoRA name) and, for the first request of a restriction, makes that restriction's group.
 * The allocations are counted through the allocator seam's fault countdown (core/alloc.h): armed
 * far away and scoped to this thread, it counts down once per allocation the routing thread
 * makes and fails none; the shard and admission threads are out of its scope.
 *
 * Checked: a restricted request queued into a group that exists allocates what an unrestricted
 * one does (the push made a group before its lock and freed it when its group existed: one
 * allocation and one free a restricted queued route), the first of a restriction one more (its
 * group); and, SQLite style, a restricted push with its Nth allocation failed, N = 1, 2, ...,
 * whether its group exists or not, says KVR_ENOMEM and leaves nothing: no entry, no group, no
 * byte, and the next push of that restriction still makes (or finds) its group.
 */
#include <criterion/criterion.h>
#include <stdint.h>

#include "core/alloc.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "sync/rcu.h"
#include "tests/common/router_prompts.h"

#define RANKS 3
#define FAR   (1ull << 40)

/* A router of one shard queueing at threshold 1 (sync_booking: the hogs' load is seen at
 * once), ranks {i, 0} of 1,000 batched tokens each saturated for good by a 2,000-token request
 * pinned there (no lease expires). */
static struct kvr_router *saturated(enum kvr_queue_policy pol)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = vclock;
	c.queue_threshold = 1.0;
	c.queue_policy = pol;
	c.sync_booking = true;
	c.lease_scan_interval_ns = 1000000000000000ull;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	static uint32_t t[2000];
	for (uint64_t i = 0; i < RANKS; i++) {
		struct kvr_rank_id id = {i, 0};
		cr_assert_eq(kvr_rank_add(r, id, 1, 100000000, 1000), 0);
		prompt(t, 2000, 70000 + (uint32_t)i);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 2000;
		q.pinned = &id;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(d.status, KVR_DECIDED);
	}
	return r;
}

struct push {
	struct kvr_router *r;
	const struct kvr_rank_id *pin; /* NULL: unrestricted */
	const struct kvr_rank_id *allow;
	size_t n_allow;
	uint32_t salt;
	uint64_t ticket; /* queued by the call */
};

/* Routes a 64-token prompt (salt p->salt++), which queues: every rank it may use is
 * saturated.  kvr_route's code. */
static int push(void *ctx)
{
	struct push *p = ctx;
	static uint32_t t[64];
	prompt(t, 64, p->salt++);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	q.pinned = p->pin;
	q.allow = p->allow;
	q.n_allow = p->n_allow;
	struct kvr_decision d;
	int rc = kvr_route(p->r, &q, &d);
	if (rc == 0)
		cr_assert_eq(d.status, KVR_QUEUED);
	p->ticket = rc == 0 ? d.ticket : 0;
	return rc;
}

/* The allocations this thread makes in push(p), which must queue. */
static uint64_t allocations(struct push *p)
{
	kvr_alloc_fail_after(FAR);
	int rc = push(p);
	uint64_t n = FAR - kvr_alloc_fail_pending();
	kvr_alloc_fail_after(0);
	cr_assert_eq(rc, 0, "%s", kvr_last_error());
	return n;
}

static void counted(enum kvr_queue_policy pol)
{
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
	struct kvr_router *r = saturated(pol);
	const struct kvr_rank_id a = {0, 0}, b = {1, 0};
	const struct kvr_rank_id list[2] = {b, a};
	struct push u = {.r = r, .salt = 1000};
	struct push p = {.r = r, .pin = &a, .salt = 2000};
	struct push l = {.r = r, .allow = list, .n_allow = 2, .salt = 3000};
	/* The first of each: the thread's routing scratch, and the groups of a and of the list. */
	(void)allocations(&u);
	uint64_t first_pin = allocations(&p), first_list = allocations(&l);
	for (int k = 0; k < 8; k++) {
		uint64_t nu = allocations(&u), np = allocations(&p), nl = allocations(&l);
		/* The allow-list's copy is the entry's own: one more than the others. */
		cr_assert_eq(np, nu,
		             "a request pinned to a rank others wait for allocated %lu, an "
		             "unrestricted one %lu",
		             (unsigned long)np, (unsigned long)nu);
		cr_assert_eq(nl, nu + 1,
		             "a request allowed a list others wait with allocated %lu, an "
		             "unrestricted one %lu (+1: its list's copy)",
		             (unsigned long)nl, (unsigned long)nu);
		if (k == 0) {
			cr_assert_eq(first_pin, np + 1,
			             "the first pinned: its group too (%lu, %lu)",
			             (unsigned long)first_pin, (unsigned long)np);
			cr_assert_eq(first_list, nl + 1,
			             "the first listed: its group too (%lu, %lu)",
			             (unsigned long)first_list, (unsigned long)nl);
			cr_log_info("allocations a queued route: unrestricted %lu, pinned %lu, "
			            "allow-listed %lu; the first of a restriction +1",
			            (unsigned long)nu, (unsigned long)np, (unsigned long)nl);
		}
	}
	kvr_alloc_fail_scope(0);
	kvr_router_destroy(r);
}

Test(queue_alloc, fcfs_a_restricted_push_into_its_group_allocates_no_group)
{
	counted(KVR_QUEUE_FCFS);
}

Test(queue_alloc, wspt_a_restricted_push_into_its_group_allocates_no_group)
{
	counted(KVR_QUEUE_WSPT);
}

/* A push with its nth allocation failed, nth = 1, 2, ... until one fails none: each says
 * KVR_ENOMEM and leaves no entry and no byte, or (a failure the route absorbs: its attempt
 * record's, hashed into the thread's scratch instead) queues, and is cancelled for the next. */
static void oom(enum kvr_queue_policy pol, bool allow, bool group_exists)
{
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
	struct kvr_router *r = saturated(pol);
	const struct kvr_rank_id a = {2, 0}, list[2] = {{2, 0}, {0, 0}};
	struct push p = {.r = r, .salt = 4000};
	if (allow) {
		p.allow = list;
		p.n_allow = 2;
	} else {
		p.pin = &a;
	}
	/* The thread's routing scratch first, so the loop's failures land in the push. */
	struct push u = {.r = r, .salt = 5000};
	cr_assert_eq(push(&u), 0);
	if (group_exists)
		cr_assert_eq(push(&p), 0);
	const size_t depth0 = kvr_queue_depth(r);
	unsigned enomem = 0;
	bool fired = true;
	for (uint64_t nth = 1; fired; nth++) {
		cr_assert_lt(nth, 100);
		kvr_rcu_barrier(); /* frees deferred earlier land before the count */
		int64_t live0 = kvr_alloc_live_bytes();
		kvr_alloc_fail_after(nth);
		int rc = push(&p);
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		if (rc == KVR_ENOMEM) {
			cr_assert(fired);
			enomem++;
			cr_assert_eq(kvr_queue_depth(r), depth0, "nth %lu queued",
			             (unsigned long)nth);
			cr_assert_eq(kvr_alloc_live_bytes(), live0, "nth %lu kept bytes",
			             (unsigned long)nth);
			continue;
		}
		cr_assert_eq(rc, 0, "nth %lu: %s", (unsigned long)nth, kvr_last_error());
		cr_assert_eq(kvr_queue_depth(r), depth0 + 1);
		if (fired) {
			cr_assert_eq(kvr_route_cancel(r, p.ticket), 0);
			cr_assert_eq(kvr_queue_depth(r), depth0);
		}
	}
	/* The entry, the tokens' copy, the allow-list's, and a new group: one KVR_ENOMEM each. */
	cr_assert_eq(enomem, 2u + allow + !group_exists, "KVR_ENOMEM %u times", enomem);
	/* Its group works: another of the restriction queues into it, allocating no group. */
	uint64_t n0 = allocations(&u), n1 = allocations(&p);
	cr_assert_eq(n1, n0 + allow, "after the loop: %lu allocations, unrestricted %lu",
	             (unsigned long)n1, (unsigned long)n0);
	kvr_alloc_fail_scope(0);
	kvr_router_destroy(r);
}

Test(queue_alloc, a_pinned_push_that_makes_its_group_fails_for_memory_cleanly)
{
	oom(KVR_QUEUE_FCFS, false, false);
}

Test(queue_alloc, a_pinned_push_into_its_group_fails_for_memory_cleanly)
{
	oom(KVR_QUEUE_FCFS, false, true);
}

Test(queue_alloc, an_allow_listed_push_that_makes_its_group_fails_for_memory_cleanly_wspt)
{
	oom(KVR_QUEUE_WSPT, true, false);
}

Test(queue_alloc, an_allow_listed_push_into_its_group_fails_for_memory_cleanly_wspt)
{
	oom(KVR_QUEUE_WSPT, true, true);
}
