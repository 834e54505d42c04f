/* Lifecycle calls (core/lifecycle.c) and the admission queue. */
#include <criterion/criterion.h>

#include "kvrouter.h"

static int admitted;
static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	if (d->status == KVR_DECIDED)
		__atomic_add_fetch(&admitted, 1, __ATOMIC_RELAXED);
}

/* One rank with a 16-token budget at queue_threshold 1: A (64 prompt tokens) saturates it and B
 * queues behind it.  Returns A's attempt; *r the router. */
static uint64_t saturate(bool sync, struct kvr_router **r)
{
	admitted = 0;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = sync;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit;
	cr_assert_eq(kvr_router_create(&c, r), 0);
	cr_assert_eq(kvr_rank_add(*r, (struct kvr_rank_id){0, 0}, 1, 1000, 16), 0);
	static uint32_t t[64], u[64];
	for (uint32_t i = 0; i < 64; i++)
		t[i] = 5 + i, u[i] = 900 + i;
	struct kvr_request q;
	struct kvr_decision a, b;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	cr_assert_eq(kvr_route(*r, &q, &a), 0);
	cr_assert_eq(a.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(*r, 5000), 0);
	q.tokens = u;
	cr_assert_eq(kvr_route(*r, &q, &b), 0);
	cr_assert_eq(b.status, KVR_QUEUED);
	cr_assert_eq(admitted, 0);
	return a.attempt;
}

/* Output implies the prefill is done: the attempt's prefill tokens leave its rank's load, as at
 * kvr_request_prefill_done.  The request queued behind that load is admitted before the call
 * returns, as after prefill_done.  Before, output ran no admission pass: B stayed queued on an
 * idle rank (0 prefill tokens) until another call ran one (a finish, a new route). */
static void output_admits(bool sync, bool ex)
{
	struct kvr_router *r;
	uint64_t a = saturate(sync, &r);
	uint32_t tok[2] = {1, 2};
	if (ex)
		cr_assert_eq(kvr_request_output_ex(r, a, tok, 2, 0), 0);
	else
		cr_assert_eq(kvr_request_output(r, a, tok, 1), 0);
	cr_assert_eq(admitted, 1, "the queued request is admitted by the output call (sync %d)",
	             sync);
	kvr_router_destroy(r);
}

Test(lifecycle, first_output_admits_queued)
{
	output_admits(false, false);
}

Test(lifecycle, first_output_admits_queued_sync_booking)
{
	output_admits(true, false);
}

Test(lifecycle, first_output_ex_admits_queued)
{
	output_admits(false, true);
}

/* The reference: prefill_done admits it. */
Test(lifecycle, prefill_done_admits_queued)
{
	struct kvr_router *r;
	uint64_t a = saturate(false, &r);
	cr_assert_eq(kvr_request_prefill_done(r, a), 0);
	cr_assert_eq(admitted, 1);
	kvr_router_destroy(r);
}
