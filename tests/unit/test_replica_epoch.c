/*
 * A replica that comes back (same replica id) with a wall clock behind its previous life's.
 *
 * A replica's epoch, which tells its lives apart, is CLOCK_REALTIME at its creation, and peers
 * took any message with a smaller epoch than the one they knew for a message of an older life:
 * dropped.  A replica restarted on a host whose clock is behind the previous life's start (the
 * same replica id rescheduled on another node with a skewed clock, a wall clock stepped back
 * between two short lives of a crash-looping process) was never heard again: every message of
 * it counted as a duplicate, its admissions never mirrored.  Now a smaller epoch is a new life
 * when the life the peer knew is gone (it said goodbye or was given up); while that life is
 * heard, a smaller epoch is still an older one.
 *
 * CLOCK_REALTIME is moved by tests/common/realtime_shift.h.  Over the in-process bus
 * (tests/unit/replica_bus.h).
 */
#include "tests/common/realtime_shift.h"
#include "tests/common/replica_wire.h"
#include "tests/unit/replica_bus.h"

Test(replica_epoch, a_new_life_with_a_clock_behind_is_heard, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	for (uint32_t k = 0; k < 4; k++)
		bus_route(r[0], 10 + k, 64);
	bus_quiet(r, 2);
	all_agree(r, 2, "first life");
	/* Replica 1 goes (goodbye) and comes back, its clock an hour behind. */
	kvr_replica_stop(bus.rep[0]);
	kvr_replica_destroy(bus.rep[0]);
	bus.rep[0] = NULL;
	kvr_router_destroy(r[0]);
	bus.ready[0] = false;
	atomic_store(&kvr_test_realtime_shift_ns, -3600ll * 1000000000ll);
	r[0] = bus_ranks_router();
	bus_create_as(0, r[0], 1); /* the epoch is read here */
	atomic_store(&kvr_test_realtime_shift_ns, 0);
	bus_start_one(0);
	/* Its admissions reach replica 2. */
	for (uint32_t k = 0; k < 4; k++)
		bus_route(r[0], 20 + k, 64);
	bus_quiet(r, 2);
	all_agree(r, 2, "the life with the clock behind");
	bus_teardown(r, 2);
}

/* A replica back under its id (a new life) takes the finished attempts of its earlier lives
 * from a peer's snapshot as history, and must not announce them as its own when it
 * re-announces (after a reconnect, or when a peer asks): it did, so every restart under one id
 * sent the peers the whole journal, which they booked, finished and journaled again as new
 * (a probe over NATS: ~460 attempts a restart, 46,052 in 100 restarts; their old blocks came
 * back as the most recent in the peers' LRUs). */
Test(replica_epoch, a_new_life_does_not_announce_its_earlier_lives_history, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	for (uint32_t k = 0; k < 20; k++) {
		struct kvr_decision d = bus_route(r[1], 100 + k, 64);
		cr_assert_eq(kvr_request_finish(r[1], d.attempt), 0);
	}
	bus_quiet(r, 2);
	const char *ended = "kvr_requests_ended_total{how=\"finish\"} ";
	cr_assert_eq(metric(r[0], ended), 20);
	/* Replica 2 goes (goodbye) and a new life of it joins: a fresh replica, it applies
	 * replica 1's snapshot, history included. */
	kvr_replica_stop(bus.rep[1]);
	kvr_replica_destroy(bus.rep[1]);
	bus.rep[1] = NULL;
	kvr_router_destroy(r[1]);
	bus.ready[1] = false;
	r[1] = bus_router(1);
	bus_quiet(r, 2);
	all_agree(r, 2, "the new life took the history");
	uint64_t before = metric(r[0], ended);
	/* It reconnects: it re-announces what it did in this life, which is nothing. */
	kvr_replica_disconnected(bus.rep[1]);
	kvr_replica_reconnected(bus.rep[1]);
	bus_quiet(r, 2);
	struct kvr_decision d = bus_route(r[1], 999, 64); /* a marker behind the re-announce */
	cr_assert_eq(kvr_request_finish(r[1], d.attempt), 0);
	bus_quiet(r, 2);
	cr_assert_eq(metric(r[0], ended), before + 1,
	             "replica 1 was told %llu attempts, only the marker is new",
	             (unsigned long long)(metric(r[0], ended) - before));
	all_agree(r, 2, "after the re-announce");
	bus_teardown(r, 2);
}

/* Appends one message from replica `id` (epoch 1) to b: a HEARTBEAT, a GOODBYE, or a RANK add of
 * worker w at stream position 1. */
static void put_msg(struct kvr_msg_buf *b, unsigned type, uint64_t id, uint64_t w)
{
	if (type == KVR_MSG_RANK) {
		kvr_test_put_rank(b, id, 1, 1, w);
		return;
	}
	size_t off = kvr_msg_begin(b, type, id, 1, 0);
	if (type == KVR_MSG_HEARTBEAT)
		kvr_msg_put_u64(b, 0);
	kvr_msg_end(b, off);
}

static void deliver(struct kvr_replica *rep, unsigned type, uint64_t id, uint64_t w)
{
	struct kvr_msg_buf b = {0};
	put_msg(&b, type, id, w);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
}

/* A replica keeps an entry per peer id it has heard (256 at most).  They were kept for good:
 * once it had heard 256 ids in its life (replicas restarted under new ids, each saying goodbye),
 * every message of a new id was dropped, for ever.  Now the entry of a peer gone longest ago is
 * taken over. */
Test(replica_epoch, peers_gone_make_room_for_new_ones, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	for (uint64_t id = 100; id < 100 + 300; id++) { /* 300 lives of new ids, each gone */
		deliver(rep, KVR_MSG_HEARTBEAT, id, 0);
		deliver(rep, KVR_MSG_GOODBYE, id, 0);
	}
	deliver(rep, KVR_MSG_RANK, 1000, 77); /* a new replica's first message: rank 77 added */
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r[0], (struct kvr_rank_id){77, 0}, &s), 0,
	             "the 301st replica's rank add was dropped");
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.peers_lost, 300);
	bus_teardown(r, 1);
}
