/*
 * Snapshots served by a replica that is resyncing itself (after a reconnect): a joiner must not
 * get the table from before that resync, nor a replica resyncing too while a settled peer can
 * serve it; and replicas that all resync at once must not wait for each other for ever.  Over
 * the in-process bus (tests/unit/replica_bus.h).
 */
#include "sync/replica_internal.h"
#include "tests/unit/replica_bus.h"

static bool has_rank(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	return kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s) == 0;
}

static struct kvr_sync_stats stats(int i)
{
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[i], &st);
	return st;
}

/* Waits (10 s at most) until replica i has asked for `n` snapshots and applied `applied`. */
static void wait_resyncs(int i, uint64_t n, uint64_t applied)
{
	struct kvr_sync_stats st = {0};
	for (int k = 0; k < 1000; k++) {
		st = stats(i);
		if (st.resyncs >= n && st.snapshots_applied >= applied)
			return;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_fail("replica %d asked %lu snapshots and applied %lu, not %lu and %lu", i + 1,
	               (unsigned long)st.resyncs, (unsigned long)st.snapshots_applied,
	               (unsigned long)n, (unsigned long)applied);
}

/* Replica 2 is cut off while replica 1 removes rank 2; back, it resyncs from replica 1, which
 * does not answer yet (this thread holds its handling lock, as a busy apply thread would).  A
 * joiner asking meanwhile is served by replica 2 (the bus asks the last ready one): it got
 * replica 2's table from before its resync, rank 2 included. */
Test(replica_serve, a_joiner_is_not_served_a_table_from_before_the_providers_resync, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 2);
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){2, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, 2);
	cr_assert(has_rank(r[1], 2));
	kvr_replica_disconnected(bus.rep[1]);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert(has_rank(r[1], 2));
	pthread_mutex_lock(&bus.rep[0]->hmu); /* replica 1 handles nothing until released */
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	uint64_t asked = stats(1).resyncs, applied = stats(1).snapshots_applied;
	kvr_replica_reconnected(bus.rep[1]);
	wait_resyncs(1, asked + 1, 0);
	/* While its resync waits, replica 2 handles snapshot requests only: the next one it
	 * takes in (counted received) is the joiner's. */
	uint64_t received = stats(1).received;
	r[2] = make();
	bus_create_as(2, r[2], 3);
	cr_assert_eq(kvr_replica_start(bus.rep[2]), 0);
	for (int k = 0; k < 1000 && stats(1).received == received; k++) {
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_gt(stats(1).received, received, "replica 2 never took the joiner's request");
	cr_assert_eq(stats(1).snapshots_applied, applied, "replica 2's resync did not wait");
	pthread_mutex_unlock(&bus.rep[0]->hmu);
	cr_assert_eq(kvr_replica_wait_ready(bus.rep[2], 10000), 0);
	cr_assert(!has_rank(r[2], 2), "the joiner got its provider's table from before its resync");
	bus_quiet(r, 3);
	for (int i = 0; i < 3; i++)
		cr_assert(!has_rank(r[i], 2), "replica %d has the removed rank", i + 1);
	all_agree(r, 3, "after the join");
	bus_teardown(r, 3);
}

/* Replica 3 is cut off while replica 1 removes rank 2; back, it resyncs, and its first request
 * goes to replica 2, alive but stuck (this thread holds its handling lock, as an apply thread
 * busy for longer than the snapshot budget would).  The request is sent again once an eighth
 * of the budget went by without an answer, the bus spreads it to replica 1, which answers:
 * the resync applies replica 1's table long before the budget is out.  Before, the asker
 * waited the whole snapshot_timeout_ms for replica 2 and applied nothing, the removed rank
 * still routable on it. */
Test(replica_serve, a_peer_that_does_not_answer_does_not_cost_the_whole_resync, .timeout = 60)
{
	bus_snapshot_ms = 4000;
	struct kvr_router *r[3];
	bus_start(r, 3);
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){2, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, 3);
	cr_assert(has_rank(r[2], 2));
	kvr_replica_disconnected(bus.rep[2]);
	__atomic_store_n(&bus_deaf[2], true, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[1], 10000), 0);
	cr_assert(has_rank(r[2], 2));
	bus_spread = true; /* replica 3's requests: replica 2 first, then replica 1 */
	pthread_mutex_lock(&bus.rep[1]->hmu);
	__atomic_store_n(&bus_deaf[2], false, __ATOMIC_RELEASE);
	uint64_t applied = stats(2).snapshots_applied;
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	kvr_replica_reconnected(bus.rep[2]);
	for (int k = 0; k < 300 && stats(2).snapshots_applied == applied; k++)
		nanosleep(&(struct timespec){0, 10000000}, NULL);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	const double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
	const bool got = stats(2).snapshots_applied > applied, gone = !has_rank(r[2], 2);
	pthread_mutex_unlock(&bus.rep[1]->hmu);
	cr_assert(got,
	          "no snapshot applied in %.0f ms of a 4,000 ms budget while replica 2 is "
	          "stuck",
	          ms);
	cr_assert(gone, "replica 3 still has the removed rank after its resync");
	bus_quiet(r, 3);
	all_agree(r, 3, "after the resync");
	bus_teardown(r, 3);
	bus_snapshot_ms = 0;
}

/* Replicas 1 and 3 are cut off while replica 2 removes rank 2; replica 1 comes back first and
 * resyncs, its requests reaching nobody, so it declines every settled-only request meanwhile.
 * Replica 3 then resyncs: its request goes to replica 2, settled but slow (each request reaches
 * it 700 ms late), the copy sent again after 500 ms (an eighth of the budget) to replica 1,
 * which declines it at once.  That decline does not end the try: replica 2's answer comes and
 * is applied.  Before, the decline ended every try before replica 2 answered, and once half the
 * budget had gone on declines replica 3 settled for replica 1's table from before the outage:
 * the removed rank stayed routable on it. */
Test(replica_serve, a_quick_decline_does_not_lose_a_slower_settled_providers_answer, .timeout = 60)
{
	bus_snapshot_ms = 4000;
	struct kvr_router *r[3];
	bus_start(r, 3);
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){2, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, 3);
	cr_assert(has_rank(r[0], 2) && has_rank(r[2], 2));
	for (int i = 0; i < 3; i += 2) {
		kvr_replica_disconnected(bus.rep[i]);
		__atomic_store_n(&bus_deaf[i], true, __ATOMIC_RELEASE);
	}
	cr_assert_eq(kvr_rank_remove(r[1], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[1], 10000), 0);
	cr_assert(has_rank(r[0], 2) && has_rank(r[2], 2));
	__atomic_store_n(&bus_unheard[0], true, __ATOMIC_RELEASE);
	bus_slow_ms[1] = 700;
	bus_spread = true; /* replica 3's requests: replica 2 first, then replica 1 */
	const uint64_t asked = stats(0).resyncs, applied0 = stats(0).snapshots_applied;
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, asked + 1, 0);
	/* Replica 3 stays deaf to the stream: what it holds of rank 2 is the snapshot's word. */
	uint64_t applied = stats(2).snapshots_applied;
	kvr_replica_reconnected(bus.rep[2]);
	for (int k = 0; k < 500 && stats(2).snapshots_applied == applied; k++)
		nanosleep(&(struct timespec){0, 10000000}, NULL);
	const bool stale = has_rank(r[2], 2);
	cr_assert_gt(stats(2).snapshots_applied, applied, "no snapshot applied");
	cr_assert(!stale, "replica 3 took replica 1's table from before the outage");
	cr_assert_eq(stats(0).snapshots_applied, applied0, "replica 1's resync was answered");
	for (int i = 0; i < 3; i++) {
		__atomic_store_n(&bus_unheard[i], false, __ATOMIC_RELEASE);
		__atomic_store_n(&bus_deaf[i], false, __ATOMIC_RELEASE);
	}
	bus_spread = false;
	bus_teardown(r, 3);
	bus_snapshot_ms = 0;
}

/* Replica 1 serves a snapshot of several chunks (a small transport limit) and a reply fails
 * after the first one: it gives the snapshot up with a given-up chunk numbered 1, not 0
 * (kvr_rep_serve_snapshot).  Replica 2 asks again after a pause and applies the snapshot
 * served then.  Taken for a chunk of the snapshot, that give-up left replica 2 waiting out its
 * whole snapshot_timeout_ms for a chunk that never came, then ready with nothing applied. */
Test(replica_serve, a_snapshot_given_up_midway_is_asked_again, .timeout = 60)
{
	struct kvr_router *r[2];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[0] = bus_router(0);
	/* Room for one record a chunk: the fence, then each rank's records, a chunk each. */
	kvr_replica_set_max_msg(bus.rep[0], KVR_MSG_HEADER + 32 + 100);
	__atomic_store_n(&bus_reply_fail[0], 2, __ATOMIC_RELEASE);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	r[1] = bus_router(1);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	const long ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
	cr_assert_eq(__atomic_load_n(&bus_reply_fail[0], __ATOMIC_ACQUIRE), 0,
	             "no reply of replica 1 failed");
	cr_assert_geq(stats(1).snapshots_applied, 1, "no snapshot applied (ready after %ld ms)",
	              ms);
	cr_assert_geq(stats(1).resyncs, 2, "the given-up snapshot was not asked for again");
	cr_assert_lt(ms, 2500, "ready after %ld ms", ms);
	bus_teardown(r, 2);
}

/* Replicas 1 and 3 are cut off and come back; replica 1 resyncs first, its requests reaching
 * nobody (for longer than replica 3's whole budget), so it declines every settled-only request
 * meanwhile.  Replica 3 then resyncs: its requests go to replica 2, alive but stuck (this
 * thread holds its handling lock), and to replica 1, in turn.  Replica 2 answers no copy, so
 * not every copy sent is ever declined; once half the budget went on declines, replica 3
 * settles for what replica 1 has (kvr_rep_resync), as it did before copies were waited for.
 * Before, a decline no longer ended the request while replica 2 held a copy: it ran out the
 * whole budget and applied nothing. */
Test(replica_serve, a_stuck_peer_does_not_keep_a_resync_from_settling, .timeout = 60)
{
	struct kvr_router *r[3];
	memset(&bus.rep, 0, sizeof(bus.rep));
	bus_snapshot_ms = 20000; /* replica 1's resync outlasts replica 3's */
	r[0] = bus_router(0);
	bus_snapshot_ms = 8000; /* sent again every second, settling from 4 s on */
	r[1] = bus_router(1);
	r[2] = bus_router(2);
	bus_quiet(r, 3);
	for (int i = 0; i < 3; i += 2)
		kvr_replica_disconnected(bus.rep[i]);
	__atomic_store_n(&bus_unheard[0], true, __ATOMIC_RELEASE);
	const uint64_t asked = stats(0).resyncs;
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, asked + 1, 0);
	bus_spread = true; /* replica 3's requests: replica 2 first, then replica 1 */
	pthread_mutex_lock(&bus.rep[1]->hmu);
	const uint64_t applied = stats(2).snapshots_applied, resyncs = stats(2).resyncs;
	kvr_replica_reconnected(bus.rep[2]);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int k = 0; k < 1000 && stats(2).snapshots_applied == applied; k++)
		nanosleep(&(struct timespec){0, 10000000}, NULL);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	const long ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
	const struct kvr_sync_stats st = stats(2);
	pthread_mutex_unlock(&bus.rep[1]->hmu);
	cr_assert_gt(st.snapshots_applied, applied,
	             "no snapshot applied in %ld ms of an 8,000 ms budget (%lu requests)", ms,
	             (unsigned long)(st.resyncs - resyncs));
	cr_log_info("applied after %ld ms of an 8,000 ms budget", ms);
	__atomic_store_n(&bus_unheard[0], false, __ATOMIC_RELEASE);
	bus_spread = false;
	bus_teardown(r, 3);
	bus_snapshot_ms = 0;
}

/* Every replica reconnects at once (the server came back): each resyncs, asking a peer that is
 * resyncing too.  None may hold another's request until its own resync ends: replicas 2 and 3
 * ask each other (the bus asks the last ready one), and both would wait out their
 * snapshot_timeout_ms and apply nothing. */
Test(replica_serve, replicas_resyncing_from_each_other_all_get_a_snapshot, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[k % 3], 40 + k, 64);
		if (k % 2)
			cr_assert_eq(kvr_request_finish(r[k % 3], d.attempt), 0);
	}
	bus_quiet(r, 3);
	uint64_t applied[3];
	for (int i = 0; i < 3; i++) {
		applied[i] = stats(i).snapshots_applied;
		kvr_replica_disconnected(bus.rep[i]);
	}
	/* Held while all are told of the reconnect (this thread holds their handling locks):
	 * each then resyncs before it handles anything else, so every request finds its
	 * provider resyncing. */
	for (int i = 0; i < 3; i++)
		pthread_mutex_lock(&bus.rep[i]->hmu);
	for (int i = 0; i < 3; i++)
		kvr_replica_reconnected(bus.rep[i]);
	for (int i = 0; i < 3; i++)
		pthread_mutex_unlock(&bus.rep[i]->hmu);
	for (int i = 0; i < 3; i++)
		wait_resyncs(i, 0, applied[i] + 1);
	bus_quiet(r, 3);
	all_agree(r, 3, "after every replica resynced at once");
	bus_teardown(r, 3);
}

/* Replicas 2 and 3 are cut off together (and stay deaf to the stream: only a snapshot can tell
 * them what they missed) while replica 1 removes rank 2.  Back at once, each resyncs, asking
 * the other first (the bus asks the last ready one), then the ready peers in turn (bus_spread,
 * as a NATS queue group spreads requests).  Each was served the other's table from before
 * its resync, rank 2 included, and took it for what the cluster holds: the removed rank stayed
 * routable on both until their stream told them (a re-announce's tombstone, ~100 ms later). */
Test(replica_serve, resyncing_replicas_do_not_serve_each_other_a_stale_table, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){2, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, 3);
	for (int i = 0; i < 3; i++)
		cr_assert(has_rank(r[i], 2));
	for (int i = 1; i < 3; i++) {
		kvr_replica_disconnected(bus.rep[i]);
		__atomic_store_n(&bus_deaf[i], true, __ATOMIC_RELEASE);
	}
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert(has_rank(r[1], 2) && has_rank(r[2], 2));
	bus_spread = true;
	uint64_t applied[3];
	/* Both told of the reconnect before either handles anything: each resyncs while the
	 * other does, so each one's first request finds its provider resyncing. */
	for (int i = 1; i < 3; i++) {
		applied[i] = stats(i).snapshots_applied;
		pthread_mutex_lock(&bus.rep[i]->hmu);
	}
	for (int i = 1; i < 3; i++)
		kvr_replica_reconnected(bus.rep[i]);
	for (int i = 1; i < 3; i++)
		pthread_mutex_unlock(&bus.rep[i]->hmu);
	for (int i = 1; i < 3; i++)
		wait_resyncs(i, 0, applied[i] + 1);
	for (int i = 1; i < 3; i++)
		cr_assert(!has_rank(r[i], 2),
		          "replica %d took a resyncing peer's table: the removed rank is routable",
		          i + 1);
	for (int i = 1; i < 3; i++)
		__atomic_store_n(&bus_deaf[i], false, __ATOMIC_RELEASE);
	bus_quiet(r, 3);
	for (int i = 0; i < 3; i++)
		cr_assert(!has_rank(r[i], 2), "replica %d has the removed rank", i + 1);
	all_agree(r, 3, "after both resynced");
	bus_teardown(r, 3);
}

/* The first chunk that comes to port i's inbox within 10 s, decoded into *m (its copy in *keep,
 * which the caller frees). */
static void take_chunk(int i, struct kvr_wmsg *m, struct bus_chunk **keep)
{
	struct bus_chunk *c = NULL;
	for (int k = 0; k < 1000 && !c; k++)
		c = bus_take(i);
	cr_assert_not_null(c, "no answer came to port %d", i);
	cr_assert_eq(kvr_msg_decode(c->data, c->len, m), 0);
	cr_assert_eq(m->h.type, KVR_MSG_SNAP_CHUNK);
	*keep = c;
}

/* What a resyncing replica answers a snapshot request: an asker after its own reconnect that
 * wants a settled table (KVR_MSG_SNAP_SETTLED_ONLY) is declined, and told why
 * (KVR_MSG_CHUNK_RESYNCING); one that does not ask so (an older replica, which sends bit0
 * alone, or an asker every peer declined) is served at once, as before; a joiner is declined
 * without the flag (an older joiner could not read it). */
Test(replica_serve, a_resyncing_provider_declines_an_asker_that_wants_a_settled_table,
     .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	pthread_mutex_lock(&bus.rep[0]->hmu); /* replica 1 handles nothing: 2's resync waits */
	uint64_t asked = stats(1).resyncs;
	kvr_replica_disconnected(bus.rep[1]);
	kvr_replica_reconnected(bus.rep[1]);
	wait_resyncs(1, asked + 1, 0);
	const uint64_t flags[3] = {KVR_MSG_SNAP_ASKER_SERVES | KVR_MSG_SNAP_SETTLED_ONLY,
	                           KVR_MSG_SNAP_ASKER_SERVES, 0};
	const uint32_t want[3] = {KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING, 0,
	                          KVR_MSG_CHUNK_GIVEN_UP};
	for (int k = 0; k < 3; k++) {
		struct kvr_msg_buf b = {0};
		size_t off = kvr_msg_begin(&b, KVR_MSG_SNAP_REQ, 9, 1, 0); /* replica 9 asks */
		kvr_msg_put_u64(&b, flags[k]);
		kvr_msg_end(&b, off);
		cr_assert(!b.oom);
		kvr_replica_deliver(bus.rep[1], b.p, b.len, "2"); /* answered to port 2 */
		kvr_msg_buf_fini(&b);
		struct kvr_wmsg m;
		struct bus_chunk *c;
		take_chunk(2, &m, &c);
		cr_assert_eq(m.h.replica, 2);
		cr_assert_eq(m.chunk_flags & ~(uint32_t)KVR_MSG_CHUNK_LAST, want[k],
		             "request flags %lu: chunk flags %u, not %u", (unsigned long)flags[k],
		             m.chunk_flags, want[k]);
		while (!(m.chunk_flags & (KVR_MSG_CHUNK_LAST | KVR_MSG_CHUNK_GIVEN_UP))) {
			free(c);
			take_chunk(2, &m, &c);
		}
		free(c);
	}
	pthread_mutex_unlock(&bus.rep[0]->hmu);
	bus_quiet(r, 2);
	bus_teardown(r, 2);
}

/* Every replica reconnects at once, its requests spread over its peers (bus_spread): once both
 * peers declined as resyncing, an asker takes a resyncing peer's table (nobody has better), 3
 * requests at most; it does not wait out its rounds of declines (BUSY_ROUNDS, 24, in
 * sync/replica_snap.c) as when a peer it knows never answered. */
Test(replica_serve, replicas_all_resyncing_settle_once_every_peer_declined, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[k % 3], 60 + k, 64);
		if (k % 2)
			cr_assert_eq(kvr_request_finish(r[k % 3], d.attempt), 0);
	}
	bus_quiet(r, 3);
	bus_spread = true;
	uint64_t applied[3], asked[3];
	for (int i = 0; i < 3; i++) {
		applied[i] = stats(i).snapshots_applied;
		asked[i] = stats(i).resyncs;
		kvr_replica_disconnected(bus.rep[i]);
	}
	for (int i = 0; i < 3; i++)
		pthread_mutex_lock(&bus.rep[i]->hmu);
	for (int i = 0; i < 3; i++)
		kvr_replica_reconnected(bus.rep[i]);
	for (int i = 0; i < 3; i++)
		pthread_mutex_unlock(&bus.rep[i]->hmu);
	for (int i = 0; i < 3; i++)
		wait_resyncs(i, 0, applied[i] + 1);
	for (int i = 0; i < 3; i++)
		cr_assert_leq(stats(i).resyncs - asked[i], 3, "replica %d asked %lu times", i + 1,
		              (unsigned long)(stats(i).resyncs - asked[i]));
	bus_quiet(r, 3);
	all_agree(r, 3, "after every replica resynced at once");
	bus_teardown(r, 3);
}

/* A given-up chunk may say why (sync/replica_msg.h, SNAP_CHUNK flags bit3: the provider resyncs
 * itself): read with given up, and only with it; nothing else comes with either. */
Test(replica_serve, a_resyncing_decline_on_the_wire, .timeout = 60)
{
	struct kvr_msg_buf b = {0};
	struct kvr_wmsg m;
	size_t off = kvr_msg_begin(&b, KVR_MSG_SNAP_CHUNK, 5, 100, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_end(&b, off);
	cr_assert(!b.oom);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), 0);
	cr_assert_eq(m.chunk_flags, KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING);
	const size_t flags_at = KVR_MSG_HEADER + 4;
	const uint8_t bad[] = {
	    KVR_MSG_CHUNK_RESYNCING,                      /* alone */
	    KVR_MSG_CHUNK_LAST | KVR_MSG_CHUNK_RESYNCING, /* on a snapshot */
	    KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING | KVR_MSG_CHUNK_LAST, /* and last */
	    KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING | 16, /* an unknown flag */
	};
	for (size_t k = 0; k < sizeof(bad); k++) {
		b.p[flags_at] = bad[k];
		cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL, "flags %u", bad[k]);
	}
	b.p[flags_at] = KVR_MSG_CHUNK_GIVEN_UP; /* given up, no reason: as before */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), 0);
	kvr_msg_buf_fini(&b);
}

/* Replicas 1 and 2 reconnect at once, each resyncing and asking the other; waits until both
 * applied a snapshot.  Returns the most requests either made. */
static uint64_t both_reconnect(void)
{
	uint64_t applied[2], asked[2], most = 0;
	for (int i = 0; i < 2; i++) {
		applied[i] = stats(i).snapshots_applied;
		asked[i] = stats(i).resyncs;
		kvr_replica_disconnected(bus.rep[i]);
	}
	for (int i = 0; i < 2; i++)
		pthread_mutex_lock(&bus.rep[i]->hmu);
	for (int i = 0; i < 2; i++)
		kvr_replica_reconnected(bus.rep[i]);
	for (int i = 0; i < 2; i++)
		pthread_mutex_unlock(&bus.rep[i]->hmu);
	for (int i = 0; i < 2; i++) {
		wait_resyncs(i, 0, applied[i] + 1);
		uint64_t n = stats(i).resyncs - asked[i];
		most = n > most ? n : most;
	}
	return most;
}

/* Replica 3 leaves (its goodbye heard), then replicas 1 and 2 reconnect at once: each asks the
 * other, the only peer left, which declines (it resyncs too).  Replica 3 will never answer,
 * yet it was counted among the peers that must decline before an asker settles, so each waited
 * out BUSY_ROUNDS (8 then) declines, 9 requests, instead of settling after the other's decline (3
 * at most).  Replica 3 then comes back (its id, a new life) and is cut off (neither heard nor
 * taking requests) long enough for both to give it up: given up, not gone, it may hold a
 * settled table once heard again, so it counts as before it left, and the askers must not
 * settle as soon as the other declined. */
Test(replica_serve, a_peer_that_left_is_not_waited_for_one_back_is, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[k % 3], 80 + k, 64);
		if (k % 2)
			cr_assert_eq(kvr_request_finish(r[k % 3], d.attempt), 0);
	}
	bus_quiet(r, 3);
	kvr_replica_stop(bus.rep[2]);
	kvr_replica_destroy(bus.rep[2]);
	pthread_mutex_lock(&bus.mu);
	bus.rep[2] = NULL;
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	kvr_router_destroy(r[2]);
	bus_quiet(r, 2);
	for (int i = 0; i < 2; i++)
		cr_assert_eq(stats(i).peers_alive, 1, "replica %d did not hear replica 3 leave",
		             i + 1);
	bus_spread = true;
	uint64_t most = both_reconnect();
	cr_assert_leq(most, 3, "a replica asked %lu times: it waited for the peer that left",
	              (unsigned long)most);
	bus_quiet(r, 2);
	all_agree(r, 2, "after both resynced");

	r[2] = bus_router(2); /* id 3 again, a new epoch */
	bus_quiet(r, 3);
	for (int i = 0; i < 2; i++)
		cr_assert_eq(stats(i).peers_alive, 2, "replica %d did not hear replica 3 back",
		             i + 1);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	__atomic_store_n(&bus_lose[2], true, __ATOMIC_RELEASE);
	/* Each judges its peers past the liveness bound (as its apply thread would, holding its
	 * handling lock): every one of them is given up. */
	for (int i = 0; i < 2; i++) {
		uint64_t lost = stats(i).peers_lost;
		pthread_mutex_lock(&bus.rep[i]->hmu);
		kvr_rep_heartbeat(bus.rep[i],
		                  kvr_rep_mono_ns() + 3 * kvr_rep_silence_bound(bus.rep[i]), 0);
		pthread_mutex_unlock(&bus.rep[i]->hmu);
		cr_assert_eq(stats(i).peers_lost, lost + 2);
	}
	most = both_reconnect();
	cr_assert_gt(most, 3, "the replicas settled for each other's table, replica 3 not heard");
	__atomic_store_n(&bus_lose[2], false, __ATOMIC_RELEASE);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = true;
	pthread_mutex_unlock(&bus.mu);
	bus_teardown(r, 3);
}

static void sleep_ms(long ms)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
}

/* Whether replica i has given up its peer `id` (for silence, or at its goodbye). */
static bool peer_lost(int i, uint64_t id)
{
	pthread_mutex_lock(&bus.rep[i]->mu);
	struct kvr_rep_peer *p = kvr_rep_peer_find(bus.rep[i], id);
	bool lost = p && p->lost && !p->alive;
	pthread_mutex_unlock(&bus.rep[i]->mu);
	return lost;
}

/* Waits (10 s at most) until replica i has given up its peer `id`. */
static void wait_lost(int i, uint64_t id)
{
	for (int k = 0; k < 1000 && !peer_lost(i, id); k++)
		sleep_ms(10);
	cr_assert(peer_lost(i, id), "replica %d never gave up replica %lu", i + 1,
	          (unsigned long)id);
}

/* The liveness bound of the replicas of the tests below: 6 heartbeats of 50 ms. */
#define BOUND_MS 300

/* Replica 3 crashes (no goodbye: what it publishes is lost, it takes no request) and replicas 1
 * and 2 give it up for silence; they go on hearing each other for three liveness bounds, then
 * reconnect at once (the server came back), each resyncing and asking the other, which
 * declines.  Given up, replica 3 counted among the peers that must decline before an asker
 * settles, as a peer given up in the asker's own outage must: it will never answer, and each
 * waited out BUSY_ROUNDS declines (9 requests at 8) instead of settling after the other's
 * decline (3 at most). */
Test(replica_serve, a_peer_crashed_before_the_outage_is_not_waited_for, .timeout = 60)
{
	bus_dead_after = BOUND_MS / 50;
	struct kvr_router *r[3];
	bus_start(r, 3);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[k % 3], 100 + k, 64);
		if (k % 2)
			cr_assert_eq(kvr_request_finish(r[k % 3], d.attempt), 0);
	}
	bus_quiet(r, 3);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	__atomic_store_n(&bus_lose[2], true, __ATOMIC_RELEASE);
	for (int i = 0; i < 2; i++)
		wait_lost(i, 3);
	sleep_ms(3 * BOUND_MS);
	for (int i = 0; i < 2; i++)
		cr_assert(peer_lost(i, 3), "replica %d heard replica 3 again", i + 1);
	bus_spread = true;
	uint64_t most = both_reconnect();
	cr_assert_leq(most, 3, "a replica asked %lu times: it waited for the peer that crashed",
	              (unsigned long)most);
	bus_quiet(r, 2);
	all_agree(r, 2, "after both resynced");
	__atomic_store_n(&bus_lose[2], false, __ATOMIC_RELEASE);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = true;
	pthread_mutex_unlock(&bus.mu);
	bus_teardown(r, 3);
}

/* Three replicas, attempts routed and some finished (salt names the prompts).  Replica 1 then
 * goes deaf and unheard until it gave up both peers, notices its disconnect three bounds later,
 * and hears replica 2 again (not replica 3, now out of the queue group and unheard) before any
 * reconnect. */
static void cut_off_hearing_replica_2_again(struct kvr_router **r, uint32_t salt)
{
	bus_dead_after = BOUND_MS / 50;
	bus_start(r, 3);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[k % 3], salt + k, 64);
		if (k % 2)
			cr_assert_eq(kvr_request_finish(r[k % 3], d.attempt), 0);
	}
	bus_quiet(r, 3);
	__atomic_store_n(&bus_deaf[0], true, __ATOMIC_RELEASE);
	__atomic_store_n(&bus_lose[0], true, __ATOMIC_RELEASE);
	for (uint64_t id = 2; id <= 3; id++)
		wait_lost(0, id);
	sleep_ms(3 * BOUND_MS);
	kvr_replica_disconnected(bus.rep[0]);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	__atomic_store_n(&bus_lose[2], true, __ATOMIC_RELEASE);
	__atomic_store_n(&bus_deaf[0], false, __ATOMIC_RELEASE);
	for (int k = 0; k < 1000 && peer_lost(0, 2); k++)
		sleep_ms(10);
	cr_assert(!peer_lost(0, 2), "replica 1 never heard replica 2 again");
	cr_assert(peer_lost(0, 3));
}

/* Replica 1 is cut off without noticing (nothing reaches it, what it publishes is lost: a
 * connection that died unnoticed) until it has given up both peers, the settled ones too; the
 * disconnect is noticed three liveness bounds later (as NATS's pings find it).  Back, replica 1
 * hears replica 2 before it is told of the reconnect (nats.c delivers on the subscription's
 * thread, and calls back on another), not replica 3 yet; then it and replica 2 resync at once.
 * Replica 3 is settled, but the queue group does not pick it (not ready).  Replica 1 must not
 * settle for replica 2's table once replica 2 alone has declined: replica 3, given up in replica
 * 1's own outage, may hold a settled table.  Had the give-ups been weighed against when the
 * disconnect was noticed, or when a peer was last heard at the resync, replica 3's would have
 * been too old to count, and replica 1 settled (3 requests at most). */
Test(replica_serve, a_replica_cut_off_waits_for_the_peers_it_gave_up_in_its_outage, .timeout = 60)
{
	struct kvr_router *r[3];
	cut_off_hearing_replica_2_again(r, 110);
	bus_spread = true;
	uint64_t asked = stats(0).resyncs, applied[2];
	kvr_replica_disconnected(bus.rep[1]);
	for (int i = 0; i < 2; i++) {
		applied[i] = stats(i).snapshots_applied;
		pthread_mutex_lock(&bus.rep[i]->hmu);
	}
	for (int i = 0; i < 2; i++)
		kvr_replica_reconnected(bus.rep[i]);
	for (int i = 0; i < 2; i++)
		pthread_mutex_unlock(&bus.rep[i]->hmu);
	for (int i = 0; i < 2; i++)
		wait_resyncs(i, 0, applied[i] + 1);
	cr_assert_gt(stats(0).resyncs - asked, 3,
	             "replica 1 settled for replica 2's table, replica 3 not heard");
	__atomic_store_n(&bus_lose[0], false, __ATOMIC_RELEASE);
	__atomic_store_n(&bus_lose[2], false, __ATOMIC_RELEASE);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = true;
	pthread_mutex_unlock(&bus.mu);
	bus_quiet(r, 3);
	bus_teardown(r, 3);
}

/* As above, but the connection comes back only for a moment: replica 1 is told of the reconnect,
 * its resync finds no provider (the link dropped again: nobody answers), and the second
 * disconnect is noticed after it heard replica 2 again.  The outage it must resync for began
 * before the first disconnect: replica 3, given up in it, still counts among the peers that
 * must decline.  Weighed against when replica 1 last heard a peer before the second disconnect
 * (replica 2, just now), replica 3's give-up was too old to count, and replica 1 settled for
 * replica 2's table (3 requests at most). */
Test(replica_serve, a_flapping_reconnect_still_waits_for_the_peers_given_up_in_the_outage,
     .timeout = 60)
{
	struct kvr_router *r[3];
	cut_off_hearing_replica_2_again(r, 130);
	/* Back for a moment: the resync finds nobody to ask, then the link drops again. */
	pthread_mutex_lock(&bus.mu);
	bus.ready[1] = false;
	pthread_mutex_unlock(&bus.mu);
	uint64_t asked = stats(0).resyncs, applied[2] = {stats(0).snapshots_applied};
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, asked + 1, 0);
	pthread_mutex_lock(&bus.rep[0]->hmu); /* held by the resync until it ends */
	pthread_mutex_unlock(&bus.rep[0]->hmu);
	cr_assert_eq(stats(0).snapshots_applied, applied[0], "the first resync applied nothing");
	sleep_ms(BOUND_MS); /* replica 2 heard meanwhile */
	kvr_replica_disconnected(bus.rep[0]);
	pthread_mutex_lock(&bus.mu);
	bus.ready[1] = true;
	pthread_mutex_unlock(&bus.mu);
	cr_assert(!peer_lost(0, 2));
	cr_assert(peer_lost(0, 3));
	bus_spread = true;
	asked = stats(0).resyncs;
	kvr_replica_disconnected(bus.rep[1]);
	for (int i = 0; i < 2; i++) {
		applied[i] = stats(i).snapshots_applied;
		pthread_mutex_lock(&bus.rep[i]->hmu);
	}
	for (int i = 0; i < 2; i++)
		kvr_replica_reconnected(bus.rep[i]);
	for (int i = 0; i < 2; i++)
		pthread_mutex_unlock(&bus.rep[i]->hmu);
	for (int i = 0; i < 2; i++)
		wait_resyncs(i, 0, applied[i] + 1);
	cr_assert_gt(stats(0).resyncs - asked, 3,
	             "replica 1 settled for replica 2's table, replica 3 not heard");
	__atomic_store_n(&bus_lose[0], false, __ATOMIC_RELEASE);
	__atomic_store_n(&bus_lose[2], false, __ATOMIC_RELEASE);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = true;
	pthread_mutex_unlock(&bus.mu);
	bus_quiet(r, 3);
	bus_teardown(r, 3);
}

static uint64_t active(struct kvr_router *r)
{
	uint64_t n = 0;
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats s;
		cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0);
		n += s.active_blocks;
	}
	return n;
}

/* Replica 3 leaves with an attempt in flight; replica 1 hears its goodbye and releases the
 * attempt's load, replica 2 does not (cut off then: it gives replica 3 up only after the
 * liveness bound).  Replica 1 then resyncs from replica 2, whose snapshot still names replica 3
 * alive at the life whose goodbye replica 1 heard.  Taken, it made replica 3 a live peer again
 * and booked its attempt again on replica 1, for one more liveness bound. */
Test(replica_serve, a_snapshot_does_not_bring_back_a_peer_that_left, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	bus_route(r[2], 90, 64); /* not finished: in flight when replica 3 leaves */
	bus_quiet(r, 3);
	cr_assert_gt(active(r[0]), 0);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	kvr_replica_stop(bus.rep[2]);
	kvr_replica_destroy(bus.rep[2]);
	pthread_mutex_lock(&bus.mu);
	bus.rep[2] = NULL;
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	kvr_router_destroy(r[2]);
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	bus_quiet(r, 2);
	cr_assert_eq(stats(0).peers_alive, 1);
	cr_assert_eq(active(r[0]), 0, "replica 3's attempt still booked after its goodbye");
	cr_assert_eq(stats(1).peers_alive, 2, "replica 2 heard the goodbye");
	uint64_t applied = stats(0).snapshots_applied;
	kvr_replica_disconnected(bus.rep[0]);
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, 0, applied + 1);
	bus_quiet(r, 2);
	cr_assert_eq(stats(0).peers_alive, 1, "replica 3 is alive again after the snapshot");
	cr_assert_eq(active(r[0]), 0, "replica 3's attempt booked again by the snapshot");
	bus_teardown(r, 2);
}

/* Stops replica 3 (its goodbye goes out) and destroys it and its router. */
static void replica3_leaves(struct kvr_router **r)
{
	kvr_replica_stop(bus.rep[2]);
	kvr_replica_destroy(bus.rep[2]);
	pthread_mutex_lock(&bus.mu);
	bus.rep[2] = NULL;
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	kvr_router_destroy(r[2]);
	r[2] = NULL;
}

/* The same for a life before the one whose goodbye was heard: replica 3 leaves with an attempt
 * in flight, comes back under its id (a new life, a later epoch) and leaves again; replica 1
 * hears all of it, replica 2 none (cut off meanwhile: it still names the first life alive).
 * Replica 1 then resyncs from replica 2.  The first life ended before the second began (one id,
 * one life at a time): taken, it made replica 3 a live peer again on replica 1 and booked its
 * attempt again, for one more liveness bound, as the very life whose goodbye was heard did. */
Test(replica_serve, a_snapshot_does_not_bring_back_an_earlier_life_of_a_peer_that_left,
     .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	bus_route(r[2], 91, 64); /* not finished: in flight when replica 3 leaves */
	bus_quiet(r, 3);
	cr_assert_gt(active(r[0]), 0);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	replica3_leaves(r);
	r[2] = bus_router(2); /* id 3 again, a new epoch */
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(stats(0).peers_alive, 2, "replica 1 did not hear replica 3 back");
	replica3_leaves(r);
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	bus_quiet(r, 2);
	cr_assert_eq(stats(0).peers_alive, 1);
	cr_assert_eq(active(r[0]), 0, "replica 3's attempt still booked after its goodbye");
	cr_assert_eq(stats(1).peers_alive, 2, "replica 2 heard a goodbye");
	uint64_t applied = stats(0).snapshots_applied;
	kvr_replica_disconnected(bus.rep[0]);
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, 0, applied + 1);
	bus_quiet(r, 2);
	cr_assert_eq(stats(0).peers_alive, 1, "replica 3's first life is alive again");
	cr_assert_eq(active(r[0]), 0, "replica 3's first life's attempt booked again");
	bus_teardown(r, 2);
}

/* Replicas 1 and 2 reconnect at once, each resyncing, with replica 3 given up in their outage
 * (it may hold a settled table) and out of the queue group: each waits for its answer until its
 * rounds of declines run out (BUSY_ROUNDS, ~0.5 s on the bus).  With a snapshot_timeout_ms
 * shorter than that (400 ms), the rounds ran past it, and a replica gave its resync up with
 * nothing applied; the rounds now end once half the deadline went on declines. */
Test(replica_serve, rounds_of_declines_end_within_a_short_snapshot_timeout, .timeout = 60)
{
	bus_snapshot_ms = 400;
	struct kvr_router *r[3];
	bus_start(r, 3);
	for (uint32_t k = 0; k < 6; k++) {
		struct kvr_decision d = bus_route(r[k % 3], 150 + k, 64);
		if (k % 2)
			cr_assert_eq(kvr_request_finish(r[k % 3], d.attempt), 0);
	}
	bus_quiet(r, 3);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = false;
	pthread_mutex_unlock(&bus.mu);
	__atomic_store_n(&bus_lose[2], true, __ATOMIC_RELEASE);
	/* Each judges its peers past the liveness bound (as its apply thread would, holding its
	 * handling lock): both are given up, replica 2 heard again soon. */
	for (int i = 0; i < 2; i++) {
		uint64_t lost = stats(i).peers_lost;
		pthread_mutex_lock(&bus.rep[i]->hmu);
		kvr_rep_heartbeat(bus.rep[i],
		                  kvr_rep_mono_ns() + 3 * kvr_rep_silence_bound(bus.rep[i]), 0);
		pthread_mutex_unlock(&bus.rep[i]->hmu);
		cr_assert_eq(stats(i).peers_lost, lost + 2);
	}
	bus_spread = true;
	uint64_t most = both_reconnect();
	cr_assert_gt(most, 3, "a replica settled for the other's table, replica 3 not heard");
	__atomic_store_n(&bus_lose[2], false, __ATOMIC_RELEASE);
	pthread_mutex_lock(&bus.mu);
	bus.ready[2] = true;
	pthread_mutex_unlock(&bus.mu);
	bus_snapshot_ms = 0;
	bus_teardown(r, 3);
}

/* Replica 1 is cut off (what it publishes is lost: a connection that died unnoticed) and finishes
 * an attempt its peer mirrors and one its peer never heard of.  The connection comes back for a
 * moment: its re-announce is lost too and its resync finds nobody; then the second disconnect,
 * more than the re-announce's margin after those finishes, and the real reconnect.  Its
 * re-announce is what tells replica 2 of them (notes made while disconnected are not sent); taken
 * from the second disconnect, it left them out: replica 2 released the first as aborted and never
 * predicted the second's blocks. */
Test(replica_serve, a_flapping_reconnect_still_reannounces_what_was_finished_in_the_outage,
     .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	struct kvr_decision d[2];
	d[0] = bus_route(r[0], 170, 64);
	bus_quiet(r, 2);
	cr_assert_gt(active(r[1]), 0);
	__atomic_store_n(&bus_lose[0], true, __ATOMIC_RELEASE);
	kvr_replica_disconnected(bus.rep[0]);
	cr_assert_eq(kvr_request_finish(r[0], d[0].attempt), 0);
	d[1] = bus_route(r[0], 171, 64);
	cr_assert_eq(kvr_request_finish(r[0], d[1].attempt), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	sleep_ms((long)(OUTAGE_MARGIN_NS / 1000000) + 100);
	/* Back for a moment: the re-announce is lost, the resync finds nobody to ask. */
	pthread_mutex_lock(&bus.mu);
	bus.ready[1] = false;
	pthread_mutex_unlock(&bus.mu);
	uint64_t asked = stats(0).resyncs, applied = stats(0).snapshots_applied;
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, asked + 1, 0);
	pthread_mutex_lock(&bus.rep[0]->hmu); /* held by the resync until it ends */
	pthread_mutex_unlock(&bus.rep[0]->hmu);
	cr_assert_eq(stats(0).snapshots_applied, applied, "the first resync applied nothing");
	kvr_replica_disconnected(bus.rep[0]);
	pthread_mutex_lock(&bus.mu);
	bus.ready[1] = true;
	pthread_mutex_unlock(&bus.mu);
	__atomic_store_n(&bus_lose[0], false, __ATOMIC_RELEASE);
	kvr_replica_reconnected(bus.rep[0]);
	wait_resyncs(0, 0, applied + 1);
	bus_quiet(r, 2);
	cr_assert_eq(active(r[1]), 0);
	all_agree(r, 2, "after the flapping reconnect");
	bus_teardown(r, 2);
}

/* A reconnect whose resync applied a snapshot ends the outage: the next one re-announces only
 * what was finished since its own disconnect, not the earlier outage's attempts again (each
 * re-announced finish is booked again by the peers, as their most recent). */
Test(replica_serve, a_reconnect_after_a_resync_starts_a_new_outage_window, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	kvr_replica_disconnected(bus.rep[0]);
	struct kvr_decision d = bus_route(r[0], 172, 64);
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	bus_quiet(r, 2);
	uint64_t sent[2], applied = stats(0).snapshots_applied;
	for (int k = 0; k < 2; k++) {
		uint64_t before = stats(0).published;
		kvr_replica_reconnected(bus.rep[0]);
		wait_resyncs(0, 0, ++applied);
		bus_quiet(r, 2);
		sent[k] = stats(0).published - before;
		if (!k) {
			sleep_ms((long)(OUTAGE_MARGIN_NS / 1000000) + 100);
			kvr_replica_disconnected(bus.rep[0]);
		}
	}
	cr_assert_eq(sent[1] + 1, sent[0], "re-announced %lu, then %lu", (unsigned long)sent[0],
	             (unsigned long)sent[1]);
	all_agree(r, 2, "after the second reconnect");
	bus_teardown(r, 2);
}
