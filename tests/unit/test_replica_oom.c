/*
 * Replica sync under allocation failure, over the in-process bus (tests/unit/replica_bus.h):
 * what a peer's output costs in memory on its way (the origin's note, the delivery, the
 * mirror's record and router call) may fail at any of its allocations; whatever is dropped is
 * counted, the mirror heals (its origin re-announces the attempt), and once the attempt ends its
 * load is zero on every router.
 */
#include <criterion/criterion.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h"
#include "sync/replica_msg.h"
#include "tests/common/mono_clock.h"
#include "tests/unit/replica_bus.h"

static struct kvr_rank_stats rank_stats(struct kvr_router *r, struct kvr_rank_id rk)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, rk, &s), 0);
	return s;
}

/* Waits (up to 5 s, quieting the bus between looks) until rank rk's load on r[1] is r[0]'s;
 * returns whether it came. */
static bool loads_agree(struct kvr_router **r, struct kvr_rank_id rk)
{
	for (int k = 0; k < 500; k++) {
		bus_quiet(r, 2);
		struct kvr_rank_stats a = rank_stats(r[0], rk), b = rank_stats(r[1], rk);
		if (a.active_blocks == b.active_blocks && a.active_requests == b.active_requests &&
		    a.active_prefill_tokens == b.active_prefill_tokens)
			return true;
		usleep(10000);
	}
	return false;
}

/* Shard work r counted as failed (kvr_shard_errors_total: an index write, a release), e.g. a
 * booking whose load could not be recorded for memory (booked without it, its load left
 * provisional): the router's own loss, which no replica message could have told. */
static uint64_t shard_errors(struct kvr_router *r)
{
	return metric(r, "kvr_shard_errors_total{what=\"index_write\"} ") +
	       metric(r, "kvr_shard_errors_total{what=\"release\"} ");
}

/* Asks replica `rep`'s peer `id` to re-announce, as ask_heal does (asked again at its
 * heartbeats until its RESET comes).  With no failure armed, its RESET and attempts book the
 * peer's attempts on rep's router anew. */
static void ask_heal_of(struct kvr_replica *rep, uint64_t id)
{
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_peer *p = kvr_rep_peer_find(rep, id);
	cr_assert_not_null(p);
	p->heal_pending = true;
	kvr_rep_ask_reannounce(rep, id, GAP_WINDOW_MS);
	pthread_mutex_unlock(&rep->mu);
}

static void *alloc_once(void *arg)
{
	void *p = kvr_alloc(64);
	*(bool *)arg = p != NULL;
	kvr_free(p, 64);
	return NULL;
}

/* The scoped failure hook the tests below aim with: while armed for this thread's role, another
 * (untagged) thread's allocations pass and are not counted; this thread's next one fails. */
Test(replica_oom, failure_scope_spares_other_threads)
{
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_after(1);
	bool ok = false;
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, alloc_once, &ok), 0);
	pthread_join(t, NULL);
	cr_assert(ok, "an untagged thread's allocation failed");
	cr_assert_eq(kvr_alloc_fail_pending(), 1, "an untagged thread's allocation was counted");
	cr_assert_null(kvr_alloc(64));
	cr_assert_eq(kvr_alloc_fail_pending(), 0);
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
}

/* Two routers on the bus, r[0] with one attempt (prompt seed) mirrored on r[1]; its decision. */
static struct kvr_decision two_with_one(struct kvr_router **r, uint32_t seed)
{
	bus_start(r, 2);
	struct kvr_decision d = bus_route(r[0], seed, 40);
	bus_quiet(r, 2);
	return d;
}

/* Two routers on the bus, r[0] with two attempts (prompt seeds seed, seed + 1) mirrored on
 * r[1]; their decisions. */
static void two_with_two(struct kvr_router **r, uint32_t seed, struct kvr_decision *a,
                         struct kvr_decision *b)
{
	*a = two_with_one(r, seed);
	*b = bus_route(r[0], seed + 1, 40);
	bus_quiet(r, 2);
}

/* Fills replica 0's outbound queue (its sender stalled) with one-token outputs of attempt on
 * r0: until it is full, not "until a call took 50 ms", which a preempted call on a loaded
 * machine also does. */
static void fill_outbound(struct kvr_router *r0, uint64_t attempt)
{
	uint32_t tok = 5;
	struct kvr_ring *q = &bus.rep[0]->outq;
	while (kvr_ring_depth(q) < kvr_ring_capacity(q))
		cr_assert_eq(kvr_request_output(r0, attempt, &tok, 1), 0);
}

static void no_load(struct kvr_router **r, int n, uint64_t nth)
{
	for (int i = 0; i < n; i++)
		for (uint64_t w = 0; w < 2; w++) {
			struct kvr_rank_stats s = rank_stats(r[i], (struct kvr_rank_id){w, 0});
			cr_assert(s.active_blocks == 0 && s.active_requests == 0 &&
			              s.active_prefill_tokens == 0,
			          "nth %lu: router %d rank %lu keeps requests %lu blocks %lu",
			          (unsigned long)nth, i, (unsigned long)w,
			          (unsigned long)s.active_requests, (unsigned long)s.active_blocks);
		}
}

/* One attempt per N: routed and mirrored, then 300 output tokens (two of the mirror's chunks)
 * with the Nth allocation from there failed, N = 1, 2, ... until one passes untouched.  Each
 * time, once the failures stop: the mirror's load equals the origin's again, and the origin
 * lost no note (it did, counted unpublished, 1 N in 7, until the routing thread's copy and the
 * sender's record stopped dropping output for memory: sync/replica_out.c); after the finish no
 * load is left anywhere.  Some N must land in the mirror's record or router
 * call (counted in output_dropped) and some in the delivery (counted dropped): with the former
 * code the tokens went uncounted, and a lost delivery of the last message (the finish) left
 * the mirror live until the origin sent again.
 * The failures are scoped (kvr_alloc_fail_scope) to this thread and the replicas' threads: the
 * routers' shard threads allocate meanwhile (the booking's load, index writes), and a failure
 * landing there is the router's own loss (kvr_shard_errors_total), which no replica message
 * reports (test_oom_contracts covers it); unscoped, it failed 1-3 runs in 60 pinned to one core
 * beside two busy loops ("nth 7: the mirror's load never healed"). */
Test(replica_oom, output_dropped_counted_and_healed, .timeout = 120)
{
	struct kvr_router *r[BUS_N];
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER | KVR_ALLOC_ROLE_REPLICA);
	bus_start(r, 2);
	uint32_t out[300];
	for (uint32_t j = 0; j < 300; j++)
		out[j] = 555000u + j;
	bool fired = true;
	uint64_t lost_at_origin = 0, nth;
	for (nth = 1; nth < 200 && fired; nth++) {
		struct kvr_decision d = bus_route(r[0], (uint32_t)nth, 40);
		bus_quiet(r, 2);
		struct kvr_sync_stats s0a, s0b;
		kvr_replica_get_stats(bus.rep[0], &s0a);
		kvr_alloc_fail_after(nth);
		int rc = kvr_request_output_ex(r[0], d.attempt, out, 300, 0);
		for (int i = 0; i < 2; i++)
			cr_assert_eq(kvr_replica_drain(bus.rep[i], 10000), 0);
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		cr_assert(rc == 0 || rc == KVR_ENOMEM, "output: %d", rc);
		kvr_replica_get_stats(bus.rep[0], &s0b);
		lost_at_origin += s0b.unpublished != s0a.unpublished;
		cr_assert_eq(s0b.unpublished, s0a.unpublished, "nth %lu: the origin lost the note",
		             (unsigned long)nth);
		cr_assert(loads_agree(r, d.rank), "nth %lu: the mirror's load never healed",
		          (unsigned long)nth);
		cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
		/* The finish's delivery is not failed; the heartbeat would heal it too. */
		cr_assert(loads_agree(r, d.rank));
		bus_quiet(r, 2);
		no_load(r, 2, nth);
	}
	cr_assert(!fired, "the allocations ran past 200");
	struct kvr_sync_stats s1;
	kvr_replica_get_stats(bus.rep[1], &s1);
	cr_assert_gt(s1.output_dropped, 0, "no failure landed in the mirror's output");
	cr_assert_gt(s1.dropped, 0, "no failure landed in a delivery");
	cr_assert_eq(s1.mirrored, 0);
	cr_assert_eq(metric(r[1], "\nkvr_sync_output_dropped_tokens_total "), s1.output_dropped);
	cr_log_info("%lu failures: %lu lost at the origin, %lu tokens dropped by the mirror, %lu "
	            "deliveries lost",
	            (unsigned long)nth - 2, (unsigned long)lost_at_origin,
	            (unsigned long)s1.output_dropped, (unsigned long)s1.dropped);
	kvr_alloc_fail_scope(0);
	bus_teardown(r, 2);
}

/* A re-announce asked by the mirror (as a dropped output asks it), with the Nth allocation from
 * there failed, N = 1, 2, ... until one passes untouched: whichever allocation fails (the ask's
 * delivery, the origin's re-announce, its delivery, the mirror's record or booking of the
 * attempt), the mirror's load comes back to the origin's.  Before, an attempt the mirror could
 * not book for memory (its record, the router's admission) was counted refused and nothing
 * asked again: the re-announce's RESET had released the old copy and cleared the heal, so the
 * mirror's load stayed short of the origin's for good.  output_dropped_counted_and_healed
 * met it at nth 8 on a loaded machine: a second re-announce (asked again at a heartbeat while
 * the first was on its way) arrived while the next N was armed, and took the failure. */
Test(replica_oom, reannounced_attempt_refused_for_memory_healed, .timeout = 120)
{
	struct kvr_router *r[BUS_N];
	struct kvr_decision d = two_with_one(r, 31);
	struct kvr_replica *rep = bus.rep[1];
	bool fired = true;
	uint64_t nth, router_lost = 0;
	for (nth = 1; nth < 200 && fired; nth++) {
		uint64_t e0 = shard_errors(r[1]);
		kvr_alloc_fail_after(nth);
		ask_heal_of(rep, 1);
		for (int i = 0; i < 2; i++)
			cr_assert_eq(kvr_replica_drain(bus.rep[i], 10000), 0);
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		bus_quiet(r, 2);
		if (shard_errors(r[1]) != e0) { /* the mirror router's own loss: books anew */
			router_lost++;
			ask_heal_of(rep, 1);
		}
		cr_assert(loads_agree(r, d.rank), "nth %lu: the mirror's load never healed",
		          (unsigned long)nth);
	}
	cr_assert(!fired, "the allocations ran past 200");
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	cr_assert(loads_agree(r, d.rank));
	bus_quiet(r, 2);
	no_load(r, 2, nth);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_log_info("%lu failures, %lu refused by the mirror, %lu lost by its router",
	            (unsigned long)nth - 2, (unsigned long)st.refused, (unsigned long)router_lost);
	bus_teardown(r, 2);
}

/* Waits until rep has no heal of peer `id` asked or pending within two heartbeat periods (the
 * rate limit of ask_heal): a heal asked while the routers came up on a loaded machine (the
 * first heartbeat seen before the admission) would otherwise be rate-limited when the lost
 * finish's heartbeat asks, and its re-announce, arriving after the loss, heals it with no gap
 * counted (1 full-suite run at load 10-13). */
static void settle_heals(struct kvr_replica *rep, uint64_t id)
{
	const uint64_t period = 2ull * rep->c.heartbeat_ms * 1000000ull, t0 = now_ms();
	for (;;) {
		pthread_mutex_lock(&rep->mu);
		struct kvr_rep_peer *p = kvr_rep_peer_find(rep, id);
		bool quiet = p && !p->heal_pending &&
		             (!p->heal_ns || kvr_rep_mono_ns() - p->heal_ns > period);
		pthread_mutex_unlock(&rep->mu);
		if (quiet)
			return;
		cr_assert(now_ms() - t0 < 10000, "a heal of peer %lu stayed pending",
		          (unsigned long)id);
		usleep(5000);
	}
}

/* The last message of a quiet stream lost on arrival (a finish): the sender's next heartbeat
 * shows its stream position ahead of what was applied, and the mirror asks for a re-announce
 * at once instead of keeping the attempt (and its load) until the sender sends again. */
Test(replica_oom, lost_finish_healed_by_heartbeat, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	struct kvr_decision d = bus_route(r[0], 7, 40);
	bus_quiet(r, 2);
	cr_assert_eq(rank_stats(r[1], d.rank).active_requests, 1);
	settle_heals(bus.rep[1], 1);
	struct kvr_sync_stats before, after;
	kvr_replica_get_stats(bus.rep[1], &before);
	/* The finish's allocations on the origin: none (a finish note is inline; the router's
	 * finish allocates nothing), so the first one is the delivery to r[1].  Scoped to the
	 * replica threads: unscoped, a shard thread's allocation took the failure 1 run in 40. */
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_REPLICA);
	kvr_alloc_fail_after(1);
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	bool fired = kvr_alloc_fail_pending() == 0;
	kvr_alloc_fail_after(0);
	kvr_replica_get_stats(bus.rep[1], &after);
	cr_assert(fired && after.dropped == before.dropped + 1,
	          "the delivery was not the allocation that failed (dropped %lu -> %lu)",
	          (unsigned long)before.dropped, (unsigned long)after.dropped);
	uint64_t t0 = now_ms();
	while (rank_stats(r[1], d.rank).active_requests && now_ms() - t0 < 5000)
		usleep(5000);
	cr_assert_eq(rank_stats(r[1], d.rank).active_requests, 0,
	             "the lost finish was never healed");
	kvr_replica_get_stats(bus.rep[1], &after);
	cr_assert_gt(after.gaps, before.gaps);
	cr_log_info("healed after %lu ms", (unsigned long)(now_ms() - t0));
	bus_quiet(r, 2);
	no_load(r, 2, 0);
	bus_teardown(r, 2);
}

/* Output for a mirror already waiting for its re-announce (out_gap, set here as a drop would) is
 * counted once, token for token (it was counted twice), and the re-announce asked for books the
 * attempt again with all its output: the mirror's load equals the origin's. */
Test(replica_oom, output_behind_a_gap_counted_once, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	struct kvr_decision d = two_with_one(r, 11);
	struct kvr_replica *rep = bus.rep[1];
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_rec *x = kvr_rep_map_find(rep, 1, d.attempt);
	cr_assert_not_null(x);
	x->out_gap = true;
	pthread_mutex_unlock(&rep->mu);
	uint32_t out[5] = {1, 2, 3, 4, 5};
	cr_assert_eq(kvr_request_output_ex(r[0], d.attempt, out, 5, 0), 0);
	cr_assert(loads_agree(r, d.rank), "the re-announce did not heal the mirror");
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.output_dropped, 5);
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	cr_assert(loads_agree(r, d.rank));
	no_load(r, 2, 0);
	bus_teardown(r, 2);
}

/* A bus of one router, r[0], with three long prompts routed and live (2,048 tokens each: records
 * that make a snapshot's buffers grow), then quiet. */
static void start_with_long_prompts(struct kvr_router **r)
{
	bus_start(r, 1);
	static uint32_t t[2048];
	for (int k = 0; k < 3; k++) {
		for (uint32_t j = 0; j < 2048; j++)
			t[j] = (uint32_t)k * 100000u + j;
		route(r[0], t, 2048);
	}
	bus_quiet(r, 1);
}

/* A snapshot served with its Nth allocation failed, N = 1, 2, ...: every chunk that goes out
 * decodes (its records included), and a snapshot that could not be built whole is not finished
 * (no last chunk) but given up (its last chunk says so: the asker asks again) instead of
 * carrying a record cut short.  Before, a record whose encoding ran out of memory was sent
 * truncated, and the asker dropped the whole snapshot as malformed. */
Test(replica_oom, snapshot_served_out_of_memory, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	start_with_long_prompts(r);
	bool fired = true;
	uint64_t nth, whole = 0;
	for (nth = 1; nth < 100 && fired; nth++) {
		kvr_alloc_fail_after(nth);
		kvr_rep_serve_snapshot(bus.rep[0], "1");
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		bool last = false, given_up = false;
		for (struct bus_chunk *c; (c = bus_take(1));) {
			struct kvr_wmsg m;
			cr_assert_eq(kvr_msg_decode(c->data, c->len, &m), 0,
			             "nth %lu: a chunk that does not decode went out",
			             (unsigned long)nth);
			cr_assert(!last && !given_up, "nth %lu: a chunk after the end",
			          (unsigned long)nth);
			last = m.chunk_flags & KVR_MSG_CHUNK_LAST;
			given_up = m.chunk_flags & KVR_MSG_CHUNK_GIVEN_UP;
			free(c);
		}
		whole += last;
		cr_assert(last || fired, "nth %lu: no failure, yet no last chunk",
		          (unsigned long)nth);
		cr_assert(last || given_up, "nth %lu: neither finished nor given up",
		          (unsigned long)nth);
	}
	cr_assert(!fired);
	cr_log_info("%lu failures, %lu snapshots whole anyway", (unsigned long)nth - 2,
	            (unsigned long)whole - 1);
	bus_teardown(r, 1);
}

/* An end whose note finds the outbound queue full for longer than the note waits (the sender
 * stalled behind 32767 notes) is still published once the sender runs again: the peer releases
 * the attempt.  Before, the end was dropped (counted unpublished) and the attempt stayed live
 * in the origin's tables and mirrored, with its load, on every peer for good. */
Test(replica_oom, end_not_dropped_by_a_full_queue, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	struct kvr_decision a, b;
	two_with_two(r, 21, &a, &b);
	cr_assert_eq(rank_stats(r[1], b.rank).active_requests +
	                 (a.rank.worker_id != b.rank.worker_id
	                      ? rank_stats(r[1], a.rank).active_requests
	                      : 0),
	             2);
	kvr_replica_stall(bus.rep[0], 5000, true);
	uint64_t t0 = now_ms();
	fill_outbound(r[0], a.attempt);
	uint64_t t1 = now_ms();
	cr_assert_eq(kvr_request_finish(r[0], b.attempt), 0);
	cr_assert_geq(now_ms() - t1, 90, "the finish did not find the queue full");
	cr_assert_lt(now_ms() - t0, 4000, "the stall ended before the finish");
	cr_assert_eq(kvr_request_finish(r[0], a.attempt), 0);
	while (now_ms() - t0 < 5100)
		usleep(10000);
	bus_quiet(r, 2);
	struct kvr_sync_stats st, s0;
	kvr_replica_get_stats(bus.rep[1], &st);
	kvr_replica_get_stats(bus.rep[0], &s0);
	cr_log_info("origin: published %lu unpublished %lu", (unsigned long)s0.published,
	            (unsigned long)s0.unpublished);
	cr_assert_eq(st.mirrored, 0, "%u attempts still mirrored", st.mirrored);
	no_load(r, 2, 0);
	bus_teardown(r, 2);
}

/* Every kind of note made while the outbound queue is full (the sender stalled behind 32767
 * notes) is published once the sender runs again, in order: an admission, a prefill done,
 * output, a rank's new capacity.  Before, all but ends were dropped (counted unpublished) after
 * waiting 100 ms each, and nothing healed them: the peer never mirrored the admission, its
 * load kept the dropped output and prefill out for the attempts' lives, and the rank kept its
 * old capacity for good (the origin's own tables missed them too, so a re-announce or a
 * snapshot would not have carried them either). */
Test(replica_oom, notes_not_dropped_by_a_full_queue, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	struct kvr_decision a, b;
	two_with_two(r, 41, &a, &b);
	struct kvr_replica *rep = bus.rep[0];
	struct kvr_sync_stats f0, f;
	kvr_replica_get_stats(rep, &f0);
	kvr_replica_stall(rep, 4000, true);
	uint64_t t0 = now_ms();
	fill_outbound(r[0], a.attempt);
	/* Full: each of these would wait, then drop. */
	static uint32_t out[200];
	for (uint32_t j = 0; j < 200; j++)
		out[j] = 777000u + j;
	cr_assert_eq(kvr_request_output(r[0], a.attempt, out, 200), 0);
	cr_assert_eq(kvr_request_prefill_done(r[0], b.attempt), 0);
	struct kvr_rank_id rk = {1, 0};
	cr_assert_eq(kvr_rank_set_capacity(r[0], rk, 7, 2000), 0);
	struct kvr_decision c = bus_route(r[0], 43, 40);
	cr_assert_lt(now_ms() - t0, 3500, "the stall ended before the notes were made");
	while (now_ms() - t0 < 4100)
		usleep(10000);
	bus_quiet(r, 2);
	kvr_replica_get_stats(rep, &f);
	cr_log_info("origin: published %lu unpublished %lu", (unsigned long)f.published,
	            (unsigned long)f.unpublished);
	cr_assert_eq(f.unpublished, f0.unpublished, "%lu notes dropped",
	             (unsigned long)(f.unpublished - f0.unpublished));
	cr_assert_eq(rank_stats(r[1], rk).capacity_blocks, 2000, "the capacity was not published");
	for (uint64_t w = 0; w < 2; w++)
		cr_assert(loads_agree(r, (struct kvr_rank_id){w, 0}), "rank %lu: loads differ",
		          (unsigned long)w);
	cr_assert_eq(kvr_request_finish(r[0], a.attempt), 0);
	cr_assert_eq(kvr_request_finish(r[0], b.attempt), 0);
	cr_assert_eq(kvr_request_finish(r[0], c.attempt), 0);
	bus_quiet(r, 2);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 0, "%u attempts still mirrored", st.mirrored);
	no_load(r, 2, 0);
	bus_teardown(r, 2);
}

/* A replica joining while its snapshot's Nth allocation fails (the failures scoped to replica
 * sync's threads: the provider's serving, the asker's collecting and applying), N = 1, 2, ...
 * until one passes untouched: it is ready well within snapshot_timeout_ms (5 s) and holds the
 * provider's live attempts.  Before, a snapshot the provider could not build whole was only not
 * finished (and a request lost on delivery for memory was not answered at all): the asker
 * waited out the whole timeout, then went on without it ("nth 4: ready after 5042 ms"); now
 * the provider says it gave up and the asker asks again at once. */
Test(replica_oom, snapshot_given_up_asked_again, .timeout = 240)
{
	struct kvr_router *r[BUS_N];
	start_with_long_prompts(r);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_REPLICA);
	bool fired = true;
	uint64_t nth, asked_again = 0;
	for (nth = 1; nth < 200 && fired; nth++) {
		kvr_alloc_fail_after(nth);
		uint64_t t0 = now_ms();
		r[1] = bus_router(1);
		uint64_t ms = now_ms() - t0;
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		struct kvr_sync_stats st;
		kvr_replica_get_stats(bus.rep[1], &st);
		cr_assert_lt(ms, 2500, "nth %lu: ready after %lu ms", (unsigned long)nth,
		             (unsigned long)ms);
		cr_assert_geq(st.snapshots_applied, 1, "nth %lu: no snapshot applied",
		              (unsigned long)nth);
		asked_again += st.resyncs > 1;
		for (uint64_t w = 0; w < 2; w++)
			cr_assert(loads_agree(r, (struct kvr_rank_id){w, 0}),
			          "nth %lu: rank %lu: loads differ", (unsigned long)nth,
			          (unsigned long)w);
		kvr_replica_stop(bus.rep[1]);
		kvr_replica_destroy(bus.rep[1]);
		bus.rep[1] = NULL;
		bus.ready[1] = false;
		kvr_router_destroy(r[1]);
		for (struct bus_chunk *c; (c = bus_take(1));)
			free(c);
	}
	kvr_alloc_fail_scope(0);
	cr_assert(!fired, "the allocations ran past 200");
	cr_assert_gt(asked_again, 0, "no snapshot was asked for again");
	cr_log_info("%lu failures, %lu snapshots asked for again", (unsigned long)nth - 2,
	            (unsigned long)asked_again);
	bus_teardown(r, 1);
}

/* An end that finds the outbound queue full while memory is short (the allocation of the node
 * that keeps it aside fails) is kept in one of the spare nodes set aside when the replica was
 * made, and published once the sender runs again: the peer releases the attempt.  Before, it
 * was dropped (counted unpublished) and the attempt stayed mirrored, with its load, on every
 * peer for good. */
Test(replica_oom, end_kept_when_memory_is_short, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	struct kvr_decision a, b;
	two_with_two(r, 51, &a, &b);
	struct kvr_sync_stats f0, f;
	kvr_replica_get_stats(bus.rep[0], &f0);
	kvr_replica_stall(bus.rep[0], 4000, true);
	uint64_t t0 = now_ms();
	fill_outbound(r[0], a.attempt);
	/* The finish allocates nothing on this thread but the node that keeps its note. */
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_after(1);
	cr_assert_eq(kvr_request_finish(r[0], b.attempt), 0);
	bool fired = kvr_alloc_fail_pending() == 0;
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
	cr_assert(fired, "the finish's note allocated nothing");
	cr_assert_eq(kvr_request_finish(r[0], a.attempt), 0);
	cr_assert_lt(now_ms() - t0, 3500, "the stall ended before the finishes");
	while (now_ms() - t0 < 4100)
		usleep(10000);
	bus_quiet(r, 2);
	kvr_replica_get_stats(bus.rep[0], &f);
	cr_assert_eq(f.unpublished, f0.unpublished, "%lu notes dropped",
	             (unsigned long)(f.unpublished - f0.unpublished));
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 0, "%u attempts still mirrored", st.mirrored);
	no_load(r, 2, 0);
	bus_teardown(r, 2);
}
