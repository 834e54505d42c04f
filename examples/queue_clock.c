/*
 * examples/queue_clock.c - README.md "Using the library", the queue and virtual time: a router on
 * the caller's clock with exact back-to-back decisions (sync_booking), a request that waits in
 * the queue while the rank is saturated and is admitted when the prefill ahead of it is done,
 * a full queue, and leases reclaimed by the reaper as virtual time passes.
 *
 * Built against kvrouter.h and the shared library alone.  The marked regions, read in order
 * (each without its indentation), are README.md's queue and virtual time C block word for word
 * (examples/check_excerpts.py).  Exit 0 when every check holds, 1 otherwise.
 */
#include <stdio.h>
#include <string.h>

#include <kvrouter.h>

#include "check.h"

/* The simulation's clock: nanoseconds that move only when the simulation says so. */
struct sim {
	uint64_t now;
};

static uint64_t sim_clock(void *ctx)
{
	return ((struct sim *)ctx)->now;
}

static struct kvr_request request(const uint32_t *tokens, size_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tokens;
	q.n_tokens = n;
	return q;
}

int main(void)
{
	struct sim sim = {.now = 1000000000};
	static uint32_t a_tokens[200], b_tokens[64], c_tokens[64];
	for (uint32_t i = 0; i < 200; i++)
		a_tokens[i] = 10 + i;
	for (uint32_t i = 0; i < 64; i++) {
		b_tokens[i] = 5000 + i;
		c_tokens[i] = 9000 + i;
	}
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.queue_capacity = 1;
	int rc;

	// clang-format off
	/* README.md excerpt */
	cfg.now_ns = sim_clock;                /* virtual time: the router reads sim_clock(&sim) */
	cfg.clock_ctx = &sim;
	cfg.sync_booking = true;               /* each decision sees every earlier call's effects */
	cfg.queue_threshold = 1.0;             /* queue while every rank's prefill > 1 x its budget */
	cfg.lease_scan_interval_ns = 1000000000; /* idle attempts expire after 1 to 2 s */
	/* README.md excerpt end */
	// clang-format on
	struct kvr_router *r;
	if (kvr_router_create(&cfg, &r) != 0) {
		fprintf(stderr, "kvr_router_create: %s\n", kvr_last_error());
		return 1;
	}
	const struct kvr_rank_id rank = {.worker_id = 1, .dp_rank = 0};
	CHECK(kvr_rank_add(r, rank, 1, 4096, 100) == 0, "kvr_rank_add");
	CHECK(kvr_router_now(r) == sim.now, "kvr_router_now %llu, the clock says %llu",
	      (unsigned long long)kvr_router_now(r), (unsigned long long)sim.now);

	/* A's 200 prompt tokens fill the rank's 100-token budget twice over. */
	struct kvr_request qa = request(a_tokens, 200);
	struct kvr_decision da;
	CHECK(kvr_route(r, &qa, &da) == 0 && da.status == KVR_DECIDED, "A not admitted");
	/* sync_booking: the very next decision sees A's blocks (no kvr_router_sync needed). */
	struct kvr_request probe = request(a_tokens, 200);
	probe.flags = KVR_ROUTE_QUERY_ONLY;
	struct kvr_decision dp;
	CHECK(kvr_route(r, &probe, &dp) == 0 && dp.overlap_blocks == 12,
	      "back-to-back decision saw %u of A's 12 blocks", dp.overlap_blocks);

	/* B waits: the rank is saturated by A's prefill. */
	struct kvr_request q = request(b_tokens, 64);
	struct kvr_decision d;
	// clang-format off
	/* README.md excerpt */

	rc = kvr_route(r, &q, &d);             /* KVR_EAGAIN: the queue (queue_capacity) is full */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0 && d.status == KVR_QUEUED && d.ticket != 0,
	      "B: %d, status %d, ticket %llu (want 0, KVR_QUEUED, a ticket)", rc, d.status,
	      (unsigned long long)d.ticket);
	struct kvr_request qc = request(c_tokens, 64);
	struct kvr_decision dc;
	int rc_c = kvr_route(r, &qc, &dc);
	CHECK(rc_c == KVR_EAGAIN, "C with the queue full: %d, want KVR_EAGAIN", rc_c);

	/* A's prefill is done: its prompt leaves the rank's load, and the queue admits B before
	 * kvr_request_prefill_done returns. */
	CHECK(kvr_request_prefill_done(r, da.attempt) == 0, "prefill_done A");
	// clang-format off
	/* README.md excerpt */
	if (rc == 0 && d.status == KVR_QUEUED) /* or KVR_ROUTE_WAIT in q.flags, or cfg.on_admit */
	    rc = kvr_route_wait(r, d.ticket, kvr_router_now(r) + 1000000, &d); /* 0: d.attempt */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0 && d.status == KVR_DECIDED && d.attempt != 0,
	      "B after A's prefill: %d, status %d", rc, d.status);
	CHECK(kvr_route_wait(r, d.ticket, 0, &d) == KVR_ENOENT, "a ticket is collected once");

	/* Leases: A and B make no progress; the reaper scans every lease_scan_interval_ns and
	 * reclaims an attempt idle for one to two intervals. */
	// clang-format off
	/* README.md excerpt */

	sim.now += 1000000000;                 /* time passes when you say so; */
	rc = kvr_router_sync(r, 1000);         /* the shards fire the timers due by now */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "kvr_router_sync: %d", rc);
	for (int i = 0; i < 2; i++) {
		sim.now += 1000000000;
		CHECK(kvr_router_sync(r, 1000) == 0, "kvr_router_sync");
	}
	CHECK(kvr_request_finish(r, da.attempt) == KVR_ESTALE, "A outlived its lease");
	CHECK(kvr_request_finish(r, d.attempt) == KVR_ESTALE, "B outlived its lease");
	struct kvr_rank_stats st;
	CHECK(kvr_rank_get_stats(r, rank, &st) == 0 && st.active_requests == 0 &&
	          st.active_prefill_tokens == 0,
	      "load left after expiry: %llu requests", (unsigned long long)st.active_requests);
	char text[1 << 16];
	size_t len = 0;
	CHECK(kvr_metrics_render(r, text, sizeof(text), &len) == 0 &&
	          strstr(text, "kvr_lease_expiries_total 2") != NULL,
	      "kvr_lease_expiries_total is not 2");

	/* An attempt that reports progress keeps its lease. */
	struct kvr_request qe = request(c_tokens, 64);
	struct kvr_decision de;
	CHECK(kvr_route(r, &qe, &de) == 0 && de.status == KVR_DECIDED, "E not admitted");
	for (int i = 0; i < 4; i++) {
		sim.now += 1000000000;
		CHECK(kvr_request_output(r, de.attempt, c_tokens, 1) == 0, "output E, step %d", i);
		CHECK(kvr_router_sync(r, 1000) == 0, "kvr_router_sync");
	}
	CHECK(kvr_request_finish(r, de.attempt) == 0, "E lost its lease while making progress");
	kvr_router_destroy(r);

	if (fails)
		fprintf(stderr, "examples/queue_clock: %d checks failed\n", fails);
	else
		printf("examples/queue_clock: ok\n");
	return fails ? 1 : 0;
}
