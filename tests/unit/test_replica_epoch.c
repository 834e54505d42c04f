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
	/* A peer gone is no position: *seq untouched, as for an unknown peer (it was written). */
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	uint64_t seq = 7;
	cr_assert_eq(kvr_replica_peer_seq(rep, 399, &seq), KVR_ENOENT);
	cr_assert_eq(seq, 7, "a gone peer's seq written: %llu", (unsigned long long)seq);
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

/* A snapshot served to this replica, crafted: one chunk, the last, holding recs (n records). */
static struct kvr_msg_buf snap_chunk;

static int snap_publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx, (void)buf, (void)len;
	return 0;
}

static int snap_reply(void *ctx, const char *to, const void *buf, size_t len)
{
	(void)ctx, (void)to, (void)buf, (void)len;
	return 0;
}

static int snap_request(void *ctx, const void *req, size_t len, uint64_t timeout_ns,
                        uint64_t hedge_ns, int (*on_chunk)(void *cb, const void *buf, size_t len),
                        bool (*poll)(void *cb), void *cb)
{
	(void)ctx, (void)req, (void)len, (void)timeout_ns, (void)hedge_ns, (void)poll;
	if (!snap_chunk.len)
		return KVR_ENOENT; /* no peer yet */
	int rc = on_chunk(cb, snap_chunk.p, snap_chunk.len);
	return rc == 1 ? 0 : rc;
}

static void snap_add(struct kvr_msg_buf *recs, uint32_t *n, struct kvr_msg_buf *rec)
{
	cr_assert(!rec->oom);
	kvr_msg_put_u32(recs, (uint32_t)rec->len);
	kvr_msg_put_bytes(recs, rec->p, rec->len);
	rec->len = 0;
	(*n)++;
}

static struct kvr_rank_stats rank_stats(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0);
	return s;
}

/* A peer restarted while this replica was cut off (an outage shorter than the liveness bound),
 * and its new life reuses an attempt id of its old one (a new process mints the same ids) on
 * another rank.  The snapshot taken after the reconnect names the new life (its FENCE's epoch)
 * and that attempt on its new rank.  It was applied without releasing what this replica
 * mirrored of the old life, and the map's key (origin, attempt) has no epoch: the new attempt
 * was taken for the old one, only caught up on, and never booked on its rank; the old one's
 * load stayed on the old rank until the new life ended the attempt. */
Test(replica_epoch, a_snapshot_with_a_peers_new_life_releases_its_old_one, .timeout = 60)
{
	enum { P = 5, Q = 9 };
	const uint64_t A = 0x10000;
	struct kvr_router *r = bus_ranks_router();
	struct kvr_config g;
	kvr_router_get_config(r, &g);
	struct kvr_replica_config c = {
	    .replica_id = 1, .heartbeat_ms = 50, .dead_after = 1000, .snapshot_timeout_ms = 5000};
	struct kvr_replica_transport t = {
	    .publish = snap_publish, .reply = snap_reply, .request = snap_request};
	struct kvr_replica *rep;
	snap_chunk.len = 0;
	cr_assert_eq(kvr_replica_create(r, &c, &t, &rep), 0);
	cr_assert_eq(kvr_replica_start(rep), 0);
	cr_assert_eq(kvr_replica_wait_ready(rep, 10000), 0);
	/* P's old life (epoch 100) admits A on rank 0. */
	struct kvr_msg_buf b = {0};
	kvr_test_put_attempt(&b, KVR_MSG_ADMIT, P, 100, 1, A, 0, 7, 1, g.block_size);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(rank_stats(r, 0).active_requests, 1);
	/* Cut off, then back: Q's snapshot has P's new life (epoch 200) with A live on rank 1. */
	struct kvr_msg_buf recs = {0}, rec = {0};
	uint32_t n = 0;
	kvr_test_put_fence(&rec, Q, 300, Q, 300, 0);
	snap_add(&recs, &n, &rec);
	kvr_test_put_fence(&rec, Q, 300, P, 200, 1);
	snap_add(&recs, &n, &rec);
	kvr_test_put_attempt(&rec, KVR_MSG_ATTEMPT, P, 200, 0, A, 1, 7, 2, g.block_size);
	snap_add(&recs, &n, &rec);
	size_t off = kvr_msg_begin(&snap_chunk, KVR_MSG_SNAP_CHUNK, Q, 300, 0);
	kvr_msg_put_u32(&snap_chunk, 0);
	kvr_msg_put_u32(&snap_chunk, KVR_MSG_CHUNK_LAST);
	kvr_msg_put_u32(&snap_chunk, n);
	kvr_msg_put_u32(&snap_chunk, 0);
	kvr_msg_put_bytes(&snap_chunk, recs.p, recs.len);
	kvr_msg_end(&snap_chunk, off);
	cr_assert(!snap_chunk.oom && !recs.oom);
	kvr_replica_disconnected(rep);
	kvr_replica_reconnected(rep);
	struct kvr_sync_stats st;
	for (int i = 0; i < 1000; i++) { /* the resync runs on the apply thread */
		kvr_replica_get_stats(rep, &st);
		if (st.snapshots_applied)
			break;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(st.snapshots_applied, 1);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.mirrored, 1);
	cr_assert_eq(st.released, 1, "the old life's A is released");
	cr_assert_eq(rank_stats(r, 0).active_requests, 0, "the old life's A still loads rank 0");
	cr_assert_eq(rank_stats(r, 1).active_requests, 1,
	             "the new life's A is not booked on rank 1");
	/* The new life finishes A: rank 1 keeps its blocks, nothing stays live. */
	b.len = 0;
	off = kvr_msg_begin(&b, KVR_MSG_FINISH, P, 200, 2);
	kvr_msg_put_u64(&b, A);
	kvr_msg_end(&b, off);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(rank_stats(r, 0).active_requests, 0);
	cr_assert_eq(rank_stats(r, 1).active_requests, 0);
	cr_assert_eq(rank_stats(r, 1).resident_blocks, 4);
	kvr_replica_stop(rep);
	kvr_replica_destroy(rep);
	kvr_router_destroy(r);
	kvr_msg_buf_fini(&b);
	kvr_msg_buf_fini(&recs);
	kvr_msg_buf_fini(&rec);
	kvr_msg_buf_fini(&snap_chunk);
}

/* What a replica publishes after its goodbye (counted by gb_publish). */
static int gb_said, gb_after;

static int gb_publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx;
	const uint8_t *b = buf;
	if (len < KVR_MSG_HEADER)
		return 0;
	if (b[3] != KVR_MSG_GOODBYE) {
		if (__atomic_load_n(&gb_said, __ATOMIC_ACQUIRE))
			__atomic_add_fetch(&gb_after, 1, __ATOMIC_RELAXED);
		return 0;
	}
	__atomic_store_n(&gb_said, 1, __ATOMIC_RELEASE);
	struct timespec ts = {0, 3000000}; /* a slow write: the heartbeat comes due meanwhile */
	nanosleep(&ts, NULL);
	return 0;
}

/* A replica's goodbye went out before its apply thread was stopped: a heartbeat (or a
 * re-announce) made meanwhile waited for the lock the goodbye was sent under and followed it,
 * and the peers took the replica up again (and its live attempts, with the re-announce they
 * then ask for) until the liveness bound.  Heartbeats every 1 ms and a goodbye that takes 3 ms
 * to write: before, nearly every stop sent a heartbeat after it. */
Test(replica_epoch, nothing_follows_the_goodbye, .timeout = 60)
{
	struct kvr_router *r = make();
	for (int i = 0; i < 20; i++) {
		struct kvr_replica_config c = {.replica_id = 1,
		                               .heartbeat_ms = 1,
		                               .dead_after = 1000,
		                               .snapshot_timeout_ms = 100};
		struct kvr_replica_transport t = {.publish = gb_publish};
		struct kvr_replica *rep;
		gb_said = gb_after = 0;
		cr_assert_eq(kvr_replica_create(r, &c, &t, &rep), 0);
		cr_assert_eq(kvr_replica_start(rep), 0);
		cr_assert_eq(kvr_replica_wait_ready(rep, 10000), 0);
		struct timespec ts = {0, 2000000};
		nanosleep(&ts, NULL);
		kvr_replica_stop(rep);
		cr_assert_eq(gb_said, 1);
		cr_assert_eq(gb_after, 0, "stop %d: %d messages after the goodbye", i, gb_after);
		kvr_replica_destroy(rep);
	}
	kvr_router_destroy(r);
}
