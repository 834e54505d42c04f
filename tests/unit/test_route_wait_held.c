/*
 * A kvr_route with KVR_ROUTE_WAIT that queues hands its ticket to its own kvr_route_wait.  Between
 * the two (kvr_queue_settle, then the wait's look-up) the request may be admitted by another
 * thread's pass, and its attempt ended by a rank's reset or removal; the admission's outcome
 * must still be the waiting call's to collect.  It was not: the settle stopped holding the entry,
 * the wait did not watch it yet, and the reclaim of outcomes nobody collects (kvr_queue_reap)
 * dropped it, so kvr_route returned KVR_ENOENT ("ticket ... is not queued"), with d still saying
 * KVR_QUEUED, for an unrestricted request on a router whose rank was live (stress_queue_churn,
 * under TSan: "kvr_route: rc -3 ..., status 1").
 *
 * The window is forced: kvr_queue_settle is wrapped (ld --wrap, tests/meson.build) to do, right
 * after the real settle left the request queued, what other threads would: finish the attempt
 * that saturates the rank (with sync_booking its pass admits the request at once), then reset
 * the rank (or remove it, the request allowed on a second rank too), which ends the admitted
 * attempt and reaps the outcomes nobody collects.
 */
#include <criterion/criterion.h>

#include "core/router_internal.h"
#include "kvrouter.h"
#include "tests/common/router_prompts.h"

int __real_kvr_queue_settle(struct kvr_router *r, uint64_t ticket, bool wait,
                            struct kvr_decision *d);

static struct kvr_router *R;
static const struct kvr_rank_id X = {7, 0}, Y = {8, 0};
static uint64_t hog;
static bool armed, fired, by_removal, by_cancel;

int __wrap_kvr_queue_settle(struct kvr_router *r, uint64_t ticket, bool wait,
                            struct kvr_decision *d);
int __wrap_kvr_queue_settle(struct kvr_router *r, uint64_t ticket, bool wait,
                            struct kvr_decision *d)
{
	int rc = __real_kvr_queue_settle(r, ticket, wait, d);
	if (armed && rc == 0 && d->status == KVR_QUEUED) {
		armed = false;
		fired = true;
		if (by_cancel) { /* another thread cancels the ticket before the wait looks */
			cr_assert_eq(kvr_route_cancel(R, ticket), 0);
			return rc;
		}
		/* Another thread's finish: its pass admits the request (not told to on_admit: it is
		 * waited on), and the outcome waits for this call's wait. */
		cr_assert_eq(kvr_request_finish(R, hog), 0);
		cr_assert_eq(kvr_queue_uncollected(R), 1, "the pass admitted it");
		/* Then a reset (or a removal) ends its attempt and reaps what nobody collects. */
		if (by_removal)
			cr_assert_eq(kvr_rank_remove(R, X), 0);
		else
			cr_assert_eq(kvr_rank_reset(R, X, 2), 0);
	}
	return rc;
}

/* Rank X (100-token budget) saturated by a 200-token request; with by_removal, a rank Y too. */
static void setup(bool removal)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	cr_assert_eq(kvr_router_create(&c, &R), 0);
	cr_assert_eq(kvr_rank_add(R, X, 1, 1000, 100), 0);
	struct kvr_decision d;
	cr_assert_eq(route_salt_pinned(R, &X, 1, 200, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	hog = d.attempt;
	by_removal = removal;
	if (removal) { /* saturated as well, so the request queues */
		cr_assert_eq(kvr_rank_add(R, Y, 1, 1000, 100), 0);
		cr_assert_eq(route_salt_pinned(R, &Y, 2, 200, &d), 0);
		cr_assert_eq(d.status, KVR_DECIDED);
	}
}

/* A 50-token request over t with KVR_ROUTE_WAIT and a 5 s deadline. */
static void waiting_request(struct kvr_request *q, uint32_t t[50])
{
	prompt(t, 50, 3);
	kvr_request_init(q);
	q->tokens = t;
	q->n_tokens = 50;
	q->flags = KVR_ROUTE_WAIT;
	q->deadline_ns = kvr_router_now(R) + 5000000000ull;
}

/* Routes a 50-token request with KVR_ROUTE_WAIT (allowed X and Y, or unrestricted), the window
 * forced in its settle: it is told its admission, whose attempt the reset or removal ended. */
static void route_waiting(const struct kvr_rank_id *allow, size_t n_allow)
{
	uint32_t t[50];
	struct kvr_request q;
	waiting_request(&q, t);
	q.allow = allow;
	q.n_allow = n_allow;
	struct kvr_decision d;
	armed = true;
	int rc = kvr_route(R, &q, &d);
	cr_assert(fired, "the request did not queue: the window was not forced");
	cr_assert_eq(rc, 0, "kvr_route: %d (%s), status %d", rc, kvr_last_error(), d.status);
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_neq(d.ticket, 0);
	cr_assert_eq(d.rank.worker_id, X.worker_id);
	/* Its attempt ended with the rank's life: every call on it is stale. */
	cr_assert_eq(kvr_request_finish(R, d.attempt), KVR_ESTALE);
	cr_assert_eq(kvr_queue_depth(R), 0);
	cr_assert_eq(kvr_queue_uncollected(R), 0);
	kvr_router_destroy(R);
}

Test(route_wait_held, an_admission_ended_by_a_reset_before_the_wait_looks_is_still_told)
{
	setup(false);
	route_waiting(NULL, 0);
}

Test(route_wait_held, an_admission_ended_by_a_removal_before_the_wait_looks_is_still_told)
{
	setup(true);
	const struct kvr_rank_id allow[2] = {X, Y};
	route_waiting(allow, 2);
}

/* The ticket cancelled (by another thread) between the settle and kvr_route's own wait: the wait
 * finds no ticket (KVR_ENOENT) and does not write d.  kvr_route's failures other than KVR_EINVAL,
 * KVR_ETIMEDOUT and a failed admission zero d with status KVR_FAILED and error the code
 * (kvrouter.h); before, d still read KVR_QUEUED with the cancelled ticket.  (A destroy that wakes
 * the wait, KVR_ESHUTDOWN, took the same path.) */
Test(route_wait_held, a_route_whose_wait_finds_its_ticket_gone_reads_failed)
{
	setup(false);
	uint32_t t[50];
	struct kvr_request q;
	waiting_request(&q, t);
	struct kvr_decision d;
	by_cancel = armed = true;
	int rc = kvr_route(R, &q, &d);
	cr_assert(fired, "the request did not queue: the window was not forced");
	cr_assert_eq(rc, KVR_ENOENT, "kvr_route: %d (%s)", rc, kvr_last_error());
	cr_assert(d.status == KVR_FAILED && d.error == KVR_ENOENT && d.ticket == 0,
	          "a failed route's d reads status %d error %d ticket %llu", d.status, d.error,
	          (unsigned long long)d.ticket);
	cr_assert_eq(kvr_queue_depth(R), 0);
	cr_assert_eq(kvr_request_finish(R, hog), 0);
	kvr_router_destroy(R);
}
