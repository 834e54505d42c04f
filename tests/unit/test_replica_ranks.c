/*
 * Rank changes over replica sync: what a replica's rank table holds (what its snapshots serve
 * and its re-announces send) follows what its router holds.  Over the in-process bus
 * (tests/unit/replica_bus.h); a peer's words written by hand (tests/common/replica_wire.h).
 */
#include "core/replica_hooks.h"
#include "tests/common/replica_wire.h"
#include "tests/unit/replica_bus.h"

static struct kvr_rank_stats stats_of(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0, "rank %lu absent",
	             (unsigned long)w);
	return s;
}

/* Peer 5 (life 100) says at stream position seq: op on worker w, incarnation inc, capacity cap. */
static void peer_rank(struct kvr_replica *rep, uint64_t seq, uint32_t op, uint64_t w, uint64_t inc,
                      uint64_t cap)
{
	struct kvr_msg_buf b = {0};
	kvr_test_put_rank_op(&b, 5, 100, seq, op, w, inc, cap);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
}

/* A peer's rank change with an older incarnation is refused by the router (KVR_ESTALE: a
 * capacity change, or an add of a present rank, which becomes one), but it was written into
 * the replica's rank table: the snapshot it served then carried the older incarnation, and a
 * fresh joiner added the rank at it and refused every admission at the rank's real one. */
Test(replica_ranks, a_refused_rank_change_is_not_served, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 1); /* ranks 0 and 1 at incarnation 7, capacity 1,000 */
	bus_quiet(r, 1); /* its own rank adds are in its table: the peer's words come after */
	peer_rank(bus.rep[0], 1, KVR_REPL_RANK_CAPACITY, 0, 6, 500);
	peer_rank(bus.rep[0], 2, KVR_REPL_RANK_ADD, 1, 6, 500);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	for (uint64_t w = 0; w < 2; w++) {
		cr_assert_eq(stats_of(r[0], w).incarnation, 7, "the router took the stale change");
		cr_assert_eq(stats_of(r[0], w).capacity_blocks, 1000);
	}
	/* A fresh joiner takes replica 1's snapshot. */
	r[1] = make();
	bus_attach(1, r[1]);
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats s = stats_of(r[1], w);
		cr_assert_eq(s.incarnation, 7, "rank %lu served at incarnation %lu",
		             (unsigned long)w, (unsigned long)s.incarnation);
		cr_assert_eq(s.capacity_blocks, 1000);
	}
	/* Replica 1's admissions on either rank are mirrored by the joiner. */
	for (uint32_t k = 0; k < 8; k++)
		bus_route(r[0], 10 + k, 64);
	bus_quiet(r, 2);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.refused, 0, "the joiner refused %lu admissions", (unsigned long)st.refused);
	cr_assert_eq(st.mirrored, 8);
	all_agree(r, 2, "joiner");
	bus_teardown(r, 2);
}

/* A peer's reset that keeps the incarnation clears the rank's predicted cache on the router, but
 * the replica kept the rank's journal (it was cleared only at a new incarnation): a joiner that
 * took this replica's snapshot replayed the finished attempts from before the reset, and
 * predicted blocks the others had forgotten. */
Test(replica_ranks, a_reset_keeping_the_incarnation_clears_the_journal, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 2);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[0], 20 + k, 64);
		cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	}
	bus_quiet(r, 2);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_reset(r[0], (struct kvr_rank_id){w, 0}, 7), 0);
	bus_quiet(r, 2);
	for (uint64_t w = 0; w < 2; w++) {
		cr_assert_eq(n_blocks(r[0], (struct kvr_rank_id){w, 0}), 0);
		cr_assert_eq(n_blocks(r[1], (struct kvr_rank_id){w, 0}), 0);
	}
	/* A joiner takes its snapshot from replica 2 (the bus asks the last ready one). */
	r[2] = make();
	bus_attach(2, r[2]);
	bus_quiet(r, 3);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(n_blocks(r[2], (struct kvr_rank_id){w, 0}), 0,
		             "rank %lu: the joiner replayed history from before the reset",
		             (unsigned long)w);
	bus_teardown(r, 3);
}

/* Waits (10 s at most) until replica i has applied `n` snapshots. */
static void wait_snapshots(int i, uint64_t n)
{
	struct kvr_sync_stats st;
	for (int k = 0; k < 1000; k++) {
		kvr_replica_get_stats(bus.rep[i], &st);
		if (st.snapshots_applied >= n)
			return;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_fail("replica %d applied %lu snapshots, not %lu", i + 1,
	               (unsigned long)st.snapshots_applied, (unsigned long)n);
}

/* Replica 1 removes rank 2 and resets ranks 0 and 1 keeping their incarnation, while its
 * publishes do not go out: cut off (down: kvr_replica_disconnected) or refused by the transport
 * (the bus fails them).  Returns once they are done on its router. */
static void change_ranks_unheard(struct kvr_router **r, bool cut_off)
{
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){2, 0}, 7, 1000, 4096), 0);
	for (uint32_t k = 0; k < 12; k++) {
		struct kvr_decision d = bus_route(r[0], 30 + k, 64);
		cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	}
	bus_quiet(r, 2);
	all_agree(r, 2, "before");
	cr_assert_eq(
	    kvr_rank_get_stats(r[1], (struct kvr_rank_id){2, 0}, &(struct kvr_rank_stats){0}), 0);
	cr_assert_gt(n_blocks(r[1], (struct kvr_rank_id){0, 0}) +
	                 n_blocks(r[1], (struct kvr_rank_id){1, 0}),
	             0);
	if (cut_off)
		kvr_replica_disconnected(bus.rep[0]);
	else
		__atomic_store_n(&bus_down[0], true, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_reset(r[0], (struct kvr_rank_id){w, 0}, 7), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0); /* the notes handled, not sent */
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[0], &st);
	cr_assert_geq(st.unpublished, 3);
}

/* Replica 2 holds what replica 1 holds: no rank 2, ranks 0 and 1 empty.  Polled for 10 s at most
 * (a refused publish is re-announced at the next delivery). */
static bool peers_heard(struct kvr_router **r)
{
	struct kvr_rank_stats s;
	return kvr_rank_get_stats(r[1], (struct kvr_rank_id){2, 0}, &s) == KVR_ENOENT &&
	       n_blocks(r[1], (struct kvr_rank_id){0, 0}) == 0 &&
	       n_blocks(r[1], (struct kvr_rank_id){1, 0}) == 0;
}

static void check_heard(struct kvr_router **r, const char *how)
{
	bool ok = false;
	for (int k = 0; k < 100 && !ok; k++) {
		bus_quiet(r, 2);
		ok = peers_heard(r);
		if (!ok) {
			struct timespec ts = {0, 100000000};
			nanosleep(&ts, NULL);
		}
	}
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r[1], (struct kvr_rank_id){2, 0}, &s), KVR_ENOENT,
	             "%s: the peer still routes to the removed rank", how);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(n_blocks(r[1], (struct kvr_rank_id){w, 0}), 0,
		             "%s: rank %lu's reset never reached the peer", how, (unsigned long)w);
	all_agree(r, 2, how);
	/* Told once, not at every re-announce: a later rank 2 (a new worker) stays. */
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){2, 0}, 8, 1000, 4096), 0);
	bus_quiet(r, 2);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[0], &st);
	kvr_replica_disconnected(bus.rep[0]);
	kvr_replica_reconnected(bus.rep[0]);
	wait_snapshots(0, st.snapshots_applied + 1);
	bus_quiet(r, 2);
	cr_assert_eq(kvr_rank_get_stats(r[0], (struct kvr_rank_id){2, 0}, &s), 0);
	cr_assert_eq(kvr_rank_get_stats(r[1], (struct kvr_rank_id){2, 0}, &s), 0,
	             "%s: the removal was told again", how);
}

/* A rank removed, and ranks reset keeping their incarnation, while a replica is cut off: its
 * re-announce after the reconnect sent RESET, an add for each rank in its table and its
 * attempts; the removed rank was gone from the table and a reset reads as nothing new in an
 * add, so the peers routed to the removed worker for good and kept the reset ranks' predicted
 * caches. */
Test(replica_ranks, rank_changes_made_while_cut_off_reach_the_peers, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	change_ranks_unheard(r, true);
	kvr_replica_reconnected(bus.rep[0]);
	wait_snapshots(0, 1);
	check_heard(r, "after the outage");
	bus_teardown(r, 2);
}

/* The same with publishes the transport refused while connected: the re-announce that follows
 * (asked by the failed send) did not tell them either. */
Test(replica_ranks, rank_changes_whose_publish_failed_reach_the_peers, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	change_ranks_unheard(r, false);
	__atomic_store_n(&bus_down[0], false, __ATOMIC_RELEASE);
	check_heard(r, "after the failed publishes");
	bus_teardown(r, 2);
}

/* A removal re-announced after its origin's outage may come after the rank was added again with
 * a newer incarnation (a new worker under the id): it does not remove that one. */
Test(replica_ranks, a_removal_of_an_older_incarnation_is_refused, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1); /* ranks 0 and 1 at incarnation 7 */
	bus_quiet(r, 1);
	peer_rank(bus.rep[0], 1, KVR_REPL_RANK_REMOVE, 0, 6, 1000);
	peer_rank(bus.rep[0], 2, KVR_REPL_RANK_REMOVE, 1, 7, 1000);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r[0], (struct kvr_rank_id){0, 0}, &s), 0,
	             "an older life's removal removed the rank");
	cr_assert_eq(kvr_rank_get_stats(r[0], (struct kvr_rank_id){1, 0}, &s), KVR_ENOENT);
	bus_teardown(r, 1);
}
