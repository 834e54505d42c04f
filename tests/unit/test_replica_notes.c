/*
 * The router's notes to replica sync (sync/replica_note.c) when the routing thread is short of
 * memory, over the in-process bus (tests/unit/replica_bus.h): what a note copies on the
 * routing thread (an admission's record, output beyond the ring message's inline tokens) may
 * fail to allocate, and the peer must still end with the origin's load and predicted blocks.
 * The failures are scoped (kvr_alloc_fail_scope) to the test's thread, the routing thread:
 * the routers' shards and the replicas' threads allocate untouched.
 */
#include <criterion/criterion.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h"
#include "tests/common/mono_clock.h"
#include "tests/unit/replica_bus.h"

static struct kvr_rank_stats rank_stats(struct kvr_router *r, struct kvr_rank_id rk)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, rk, &s), 0);
	return s;
}

/* Rank w's load on r[1] is r[0]'s. */
static bool same_load(struct kvr_router **r, uint64_t w)
{
	struct kvr_rank_id rk = {w, 0};
	struct kvr_rank_stats a = rank_stats(r[0], rk), b = rank_stats(r[1], rk);
	return a.active_blocks == b.active_blocks && a.active_requests == b.active_requests &&
	       a.active_prefill_tokens == b.active_prefill_tokens;
}

/* Both ranks: r[1]'s load and predicted blocks are r[0]'s. */
static void peer_agrees(struct kvr_router **r, uint64_t nth)
{
	bus_quiet(r, 2);
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_id rk = {w, 0};
		struct kvr_rank_stats a = rank_stats(r[0], rk), b = rank_stats(r[1], rk);
		cr_assert(same_load(r, w),
		          "nth %lu rank %lu: origin requests %lu blocks %lu, peer %lu %lu",
		          (unsigned long)nth, (unsigned long)w, (unsigned long)a.active_requests,
		          (unsigned long)a.active_blocks, (unsigned long)b.active_requests,
		          (unsigned long)b.active_blocks);
		same_blocks(r[0], r[1], rk);
	}
}

/* The peer agrees with the origin with attempt live, and after its finish. */
static void agrees_through_finish(struct kvr_router **r, uint64_t attempt, uint64_t nth)
{
	peer_agrees(r, nth);
	cr_assert_eq(kvr_request_finish(r[0], attempt), 0);
	peer_agrees(r, nth);
}

/* The OOM loop ended (an N passed untouched) and the origin dropped no note. */
static void nothing_dropped(bool fired)
{
	cr_assert(!fired, "the allocations ran past 100");
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[0], &st);
	cr_assert_eq(st.unpublished, 0, "%lu notes dropped", (unsigned long)st.unpublished);
}

static void arm(uint64_t nth)
{
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_after(nth);
}

/* Whether the armed failure fired; disarms. */
static bool disarm(void)
{
	bool fired = kvr_alloc_fail_pending() == 0;
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
	return fired;
}

/* A long prompt (more blocks than a staging slab holds, so the routing thread copies it into a
 * record of its own) routed with the Nth allocation of the routing thread failed, N = 1, 2, ...
 * until one passes untouched: whenever the route succeeds, the peer mirrors it (same load, same
 * predicted blocks).  Before, an admission whose record could not be allocated there was
 * counted (unpublished) and never told to anyone: the peer's load and prediction stayed short
 * of the origin's ("nth 1 rank ...: origin requests 1, peer 0"). */
Test(replica_notes, long_admission_mirrored_when_its_record_fails, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	static uint32_t t[48000]; /* 3000 blocks: more than OUT_SLAB_BLOCKS (2048) */
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 48000;
	q.expected_output_tokens = 64;
	struct kvr_decision d;
	/* Twice untouched first: the routing thread's scratch and pools grow for long prompts. */
	for (uint32_t k = 0; k < 2; k++) {
		for (uint32_t j = 0; j < 48000; j++)
			t[j] = (k + 1000) * 1000003u + j;
		cr_assert_eq(kvr_route(r[0], &q, &d), 0);
		cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	}
	bool fired = true;
	uint64_t nth, routed = 0;
	for (nth = 1; nth < 100 && fired; nth++) {
		for (uint32_t j = 0; j < 48000; j++)
			t[j] = (uint32_t)nth * 1000003u + j;
		arm(nth);
		int rc = kvr_route(r[0], &q, &d);
		fired = disarm();
		cr_assert(rc == 0 || rc == KVR_ENOMEM, "nth %lu: route %d", (unsigned long)nth, rc);
		if (rc)
			continue;
		routed++;
		agrees_through_finish(r, d.attempt, nth);
	}
	nothing_dropped(fired);
	cr_log_info("%lu routes, %lu failed", (unsigned long)routed,
	            (unsigned long)(nth - 1 - routed));
	bus_teardown(r, 2);
}

/* 300 output tokens (more than a ring message carries inline, so the routing thread copies
 * them) with the Nth allocation of the routing thread failed, N = 1, 2, ... until one passes
 * untouched: whenever the call succeeds, the peer's load and predicted blocks are the
 * origin's.  Before, output whose copy could not be allocated was counted (unpublished) and
 * never told: the peer's decode blocks stayed short of the origin's for the attempt's life and
 * its prediction after it. */
Test(replica_notes, long_output_mirrored_when_its_copy_fails, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	uint32_t out[300];
	bool fired = true;
	uint64_t nth, ok = 0;
	for (nth = 1; nth < 100 && fired; nth++) {
		struct kvr_decision d = bus_route(r[0], (uint32_t)nth, 40);
		bus_quiet(r, 2);
		for (uint32_t j = 0; j < 300; j++)
			out[j] = (uint32_t)nth * 7919u + 555000u + j;
		arm(nth);
		int rc = kvr_request_output_ex(r[0], d.attempt, out, 300,
		                               nth & 1 ? 0 : KVR_OUTPUT_FINAL);
		fired = disarm();
		cr_assert(rc == 0 || rc == KVR_ENOMEM, "nth %lu: output %d", (unsigned long)nth,
		          rc);
		ok += rc == 0;
		agrees_through_finish(r, d.attempt, nth);
	}
	nothing_dropped(fired);
	cr_log_info("%lu outputs, %lu failed", (unsigned long)ok, (unsigned long)(nth - 1 - ok));
	bus_teardown(r, 2);
}

/* The nodes kept aside on rep (its sender stalled: nobody takes them meanwhile), bytes. */
static size_t kept_nodes_bytes(struct kvr_replica *rep)
{
	size_t b = 0;
	for (struct kvr_rep_kept *k = __atomic_load_n(&rep->kept, __ATOMIC_ACQUIRE); k; k = k->next)
		b += sizeof(*k);
	return b;
}

#define KEPT_CAP   4096u
#define N_ATTEMPTS 300

/* The sender stalled behind a full queue while 300 attempts end (and a prefill done each,
 * first): with kept_bytes_max at 4 KiB, what is kept aside stays under it, and once the sender
 * runs again the peer mirrors nothing, every load is zero on both routers and the predicted
 * blocks are the origin's (the ends dropped past the cap are told as aborts).  Before, every
 * note was kept, the stall's memory growing with the traffic (600 nodes, 57,600 bytes of nodes
 * alone here; a stalled connection for good grows it for good). */
Test(replica_notes, kept_notes_capped_and_healed, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_kept_max = KEPT_CAP;
	bus_start(r, 2);
	static struct kvr_decision d[N_ATTEMPTS];
	for (uint32_t i = 0; i < N_ATTEMPTS; i++)
		d[i] = bus_route(r[0], 100 + i, 40);
	peer_agrees(r, 0);
	struct kvr_replica *rep = bus.rep[0];
	kvr_replica_stall(rep, 3000, true);
	uint64_t t0 = now_ms();
	/* The queue filled with prefill dones, which make no blocks: with output, a's chain would
	 * pass the ranks' capacity (1000 blocks), and the predictions would depend on the order
	 * each router applied the releases in (a mirror's output refused when its lane stays full
	 * under a loaded machine is healed by a re-announce, which re-books a later). */
	struct kvr_ring *q = &rep->outq;
	while (kvr_ring_depth(q) < kvr_ring_capacity(q)) /* full: later notes are kept aside */
		cr_assert_eq(kvr_request_prefill_done(r[0], d[0].attempt), 0);
	size_t most = 0;
	for (uint32_t i = 1; i < N_ATTEMPTS; i++) {
		cr_assert_eq(kvr_request_prefill_done(r[0], d[i].attempt), 0);
		cr_assert_eq(kvr_request_finish(r[0], d[i].attempt), 0);
		size_t b = kept_nodes_bytes(rep);
		most = b > most ? b : most;
	}
	cr_assert_lt(now_ms() - t0, 2500, "the stall ended before the notes were made");
	cr_log_info("kept at most %zu bytes of nodes (cap %u)", most, KEPT_CAP);
	cr_assert_leq(most, KEPT_CAP, "kept %zu bytes past the cap", most);
	while (now_ms() - t0 < 3100)
		usleep(10000);
	peer_agrees(r, 0);
	/* No output was among the dropped notes: the live attempt's output is still told. */
	uint32_t out[100];
	for (uint32_t j = 0; j < 100; j++)
		out[j] = 424242u + j;
	cr_assert_eq(kvr_request_output(r[0], d[0].attempt, out, 100), 0);
	peer_agrees(r, 0);
	cr_assert_eq(kvr_request_finish(r[0], d[0].attempt), 0);
	peer_agrees(r, 0);
	struct kvr_sync_stats s0, s1;
	kvr_replica_get_stats(rep, &s0);
	kvr_replica_get_stats(bus.rep[1], &s1);
	cr_log_info("over the cap %lu, ends reconciled %lu", (unsigned long)s0.notes_over_cap,
	            (unsigned long)s0.ends_reconciled);
	cr_assert_gt(s0.notes_over_cap, 0);
	cr_assert_gt(s0.ends_reconciled, 0);
	cr_assert_eq(s1.mirrored, 0, "%u attempts still mirrored", s1.mirrored);
	for (int i = 0; i < 2; i++)
		for (uint64_t w = 0; w < 2; w++) {
			struct kvr_rank_stats s = rank_stats(r[i], (struct kvr_rank_id){w, 0});
			cr_assert(s.active_requests == 0 && s.active_blocks == 0,
			          "router %d rank %lu keeps %lu requests", i, (unsigned long)w,
			          (unsigned long)s.active_requests);
		}
	bus_kept_max = 0;
	bus_teardown(r, 2);
}

/* Peers agree with the origin, waiting (up to 5 s) for heals that come at a heartbeat (a
 * delivery lost: the gap shows at the origin's next one; a booking refused: asked again). */
static bool peer_agrees_soon(struct kvr_router **r)
{
	for (int k = 0; k < 100; k++) {
		bus_quiet(r, 2);
		if (same_load(r, 0) && same_load(r, 1))
			return true;
		usleep(50000);
	}
	return false;
}

/* An admission with the Nth allocation of replica sync's threads failed (the origin's sender
 * making its record from the staging slab, the peer's delivery, its record and booking), N = 1,
 * 2, ... until one passes untouched: the peer mirrors it each time, and the two agree again
 * after its output and finish.  Before, a record the sender could not allocate was dropped
 * (counted unpublished) and nothing healed it ("nth 1: the peer never mirrored it"); output
 * whose copy into the sender's record failed was dropped too. */
Test(replica_notes, admission_mirrored_when_the_senders_record_fails, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	uint32_t out[100];
	bool fired = true;
	uint64_t nth;
	for (nth = 1; nth < 100 && fired; nth++) {
		kvr_alloc_fail_scope(KVR_ALLOC_ROLE_REPLICA);
		kvr_alloc_fail_after(nth);
		struct kvr_decision d = bus_route(r[0], 5000 + (uint32_t)nth, 200);
		for (uint32_t j = 0; j < 100; j++)
			out[j] = (uint32_t)nth * 7919u + 888000u + j;
		cr_assert_eq(kvr_request_output(r[0], d.attempt, out, 100), 0);
		for (int i = 0; i < 2; i++)
			cr_assert_eq(kvr_replica_drain(bus.rep[i], 10000), 0);
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		kvr_alloc_fail_scope(0);
		cr_assert(peer_agrees_soon(r), "nth %lu: the peer never mirrored it",
		          (unsigned long)nth);
		peer_agrees(r, nth);
		cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
		cr_assert(peer_agrees_soon(r), "nth %lu: the peer kept it", (unsigned long)nth);
		peer_agrees(r, nth);
	}
	cr_assert(!fired, "the allocations ran past 100");
	/* Unpublished may be nonzero: a batch the sender could not encode (its buffer's growth
	 * failed) is counted and re-announced, which the agreement above saw through. */
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[0], &st);
	cr_log_info("%lu failures, %lu unpublished (re-announced)", (unsigned long)nth - 2,
	            (unsigned long)st.unpublished);
	bus_teardown(r, 2);
}

/* Gives the slabs back after 20 ms (arg: the replica), as a sender that was behind would. */
static void *slabs_back(void *arg)
{
	struct kvr_replica *rep = arg;
	usleep(20000);
	__atomic_fetch_or(&rep->slab_free, ~0ull, __ATOMIC_RELEASE);
	return NULL;
}

/* A short admission when every staging slab is queued (taken here, as a sender behind would
 * hold them, and given back 20 ms later), with the Nth allocation of the routing thread failed,
 * N = 1, 2, ... until one passes untouched: the note's ring slot is reserved before its record
 * is made, and when the record fails the admission waits for a slab instead of being lost.
 * Before, the slot was left empty and the admission counted unpublished (the peer never
 * mirrored it). */
Test(replica_notes, admission_waits_for_a_slab_when_its_record_fails, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	struct kvr_replica *rep = bus.rep[0];
	bool fired = true;
	uint64_t nth;
	for (nth = 1; nth < 100 && fired; nth++) {
		cr_assert_eq(kvr_replica_drain(rep, 10000), 0); /* every slab back */
		__atomic_store_n(&rep->slab_mine, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&rep->slab_free, 0, __ATOMIC_RELAXED);
		pthread_t t;
		cr_assert_eq(pthread_create(&t, NULL, slabs_back, rep), 0);
		uint32_t tok[200];
		for (uint32_t j = 0; j < 200; j++)
			tok[j] = (9000 + (uint32_t)nth) * 1000003u + j;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 200;
		struct kvr_decision d;
		arm(nth);
		int rc = kvr_route(r[0], &q, &d);
		fired = disarm();
		pthread_join(t, NULL);
		cr_assert(rc == 0 || rc == KVR_ENOMEM, "nth %lu: route %d", (unsigned long)nth, rc);
		if (rc == 0)
			agrees_through_finish(r, d.attempt, nth);
	}
	nothing_dropped(fired);
	cr_log_info("%lu failures", (unsigned long)nth - 2);
	bus_teardown(r, 2);
}

/* A caller's end kept aside (the ring full) and its attempt's admission note committed in the
 * ring behind an earlier producer's reserved, uncommitted slot (a routing thread descheduled
 * between its reserve and its commit): the sender handled the kept notes once its dequeue
 * returned nothing, i.e. before that admission, so the end found no record.  Dropped (a caller's
 * end with no record, sync/replica_out.c out_progress), the admission then made a record
 * nothing ended: the origin and every peer kept the attempt for good (the review's probe).  The
 * kept notes now wait until no slot is reserved. */
Test(replica_notes, a_kept_end_waits_for_its_admission_behind_an_uncommitted_slot, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	struct kvr_replica *rep = bus.rep[0];
	struct kvr_decision c = bus_route(r[0], 1, 40); /* filler notes' attempt */
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 1);
	kvr_replica_stall(rep, 600000, true); /* ended below */
	struct kvr_ring *q = &rep->outq;
	/* P: a producer descheduled between its reserve and its commit. */
	uint32_t tp;
	struct kvr_msg *ps = kvr_ring_reserve(q, &tp);
	cr_assert(ps);
	/* A: routed; its admission's note commits behind P's slot (tagged). */
	struct kvr_decision a = bus_route(r[0], 2, 40);
	while (kvr_ring_reserved(q) < kvr_ring_capacity(q))
		cr_assert_eq(kvr_request_prefill_done(r[0], c.attempt), 0);
	cr_assert_eq(kvr_request_prefill_done(r[0], c.attempt), 0); /* kept after 100 ms */
	cr_assert(__atomic_load_n(&rep->kept, __ATOMIC_ACQUIRE) != NULL);
	cr_assert_eq(kvr_request_finish(r[0], a.attempt), 0); /* A's end: kept */
	kvr_replica_stall(rep, 0, true);
	for (int k = 0; k < 200 && __atomic_load_n(&rep->kept, __ATOMIC_ACQUIRE); k++)
		usleep(10000);
	/* P commits (nothing to say). */
	kvr_ring_write(ps, NULL, NULL, 0, OUT_NONE);
	kvr_ring_commit_or_tag(q, tp);
	bus_quiet(r, 2);
	usleep(200000);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[0]), 1);
	cr_assert_eq(bus_active_requests(r[1]), 1,
	             "peer mirrors A (finished on the origin) for good: %lu",
	             (unsigned long)bus_active_requests(r[1]));
	cr_assert_eq(kvr_request_finish(r[0], c.attempt), 0);
	bus_quiet(r, 2);
	bus_teardown(r, 2);
}
