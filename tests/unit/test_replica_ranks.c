/*
 * Rank changes over replica sync: what a replica's rank table holds (what its snapshots serve
 * and its re-announces send) follows what its router holds.  Over the in-process bus
 * (tests/unit/replica_bus.h); a peer's words written by hand (tests/common/replica_wire.h).
 */
#include "core/alloc.h"
#include "core/replica_hooks.h"
#include "sync/replica_internal.h"
#include "tests/common/replica_wire.h"
#include "tests/common/xorshift.h"
#include "tests/unit/replica_bus.h"

static bool has_rank(struct kvr_router *r, uint64_t w);

/* Whether rep's table holds rank id at all: an entry or a tombstone.  mu held. */
static bool has_entry(struct kvr_replica *rep, struct kvr_rank_id id)
{
	return kvr_rep_rank_find(rep, id) || kvr_rep_tomb_find(rep, id);
}

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

/* The same, versioned (clock, writer 5). */
static void peer_rank_v(struct kvr_replica *rep, uint64_t seq, uint32_t op, uint64_t w,
                        uint64_t inc, uint64_t clock)
{
	struct kvr_msg_buf b = {0};
	kvr_test_put_rank_ver(&b, 5, 100, seq, op, w, inc, 1000, clock, 5);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
}

/* A RANK message's version (sync/replica_msg.h): read when flagged, absent (0) in the older
 * layout, and the two layouts never mixed. */
Test(replica_ranks, rank_versions_on_the_wire, .timeout = 60)
{
	struct kvr_msg_buf b = {0};
	struct kvr_wmsg m;
	kvr_test_put_rank_ver(&b, 5, 100, 1, KVR_REPL_RANK_REMOVE, 3, 7, 1000, 12345, 9);
	cr_assert_eq(b.len, KVR_MSG_HEADER + 56);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), 0);
	cr_assert_eq(m.op, KVR_REPL_RANK_REMOVE);
	cr_assert_eq(m.worker_id, 3);
	cr_assert_eq(m.rank_clock, 12345);
	cr_assert_eq(m.rank_writer, 9);
	b.p[KVR_MSG_HEADER + 20] = 0; /* flag cleared, 16 bytes too many */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	b.p[KVR_MSG_HEADER + 20] = 3; /* an unknown flag */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	b.p[KVR_MSG_HEADER + 20] = 1;
	memset(b.p + KVR_MSG_HEADER + 40, 0, 8); /* clock 0 */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	/* clock 2^64 - 1: the receiver's next own version (one past it) wrapped to 0 */
	memset(b.p + KVR_MSG_HEADER + 40, 0xff, 8);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	b.len = 0;
	kvr_test_put_rank_op(&b, 5, 100, 1, KVR_REPL_RANK_ADD, 3, 7, 1000);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), 0);
	cr_assert_eq(m.rank_clock, 0);
	cr_assert_eq(m.rank_writer, 0);
	b.p[KVR_MSG_HEADER + 20] = 1; /* flagged, the version missing */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	kvr_msg_buf_fini(&b);
}

/* A snapshot chunk may carry its provider's floor (sync/replica_msg.h, SNAP_CHUNK flags bit2):
 * 16 bytes before the records, read when flagged, a version as a RANK's, never with given up. */
Test(replica_ranks, a_snapshot_chunk_carries_the_floor, .timeout = 60)
{
	struct kvr_msg_buf b = {0}, rec = {0};
	struct kvr_wmsg m;
	kvr_test_put_rank_ver(&rec, 5, 100, 0, KVR_REPL_RANK_ADD, 3, 7, 1000, 12345, 9);
	size_t off = kvr_msg_begin(&b, KVR_MSG_SNAP_CHUNK, 5, 100, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, KVR_MSG_CHUNK_LAST | KVR_MSG_CHUNK_FLOOR);
	kvr_msg_put_u32(&b, 1);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u64(&b, 777);
	kvr_msg_put_u64(&b, 4);
	kvr_msg_put_u32(&b, (uint32_t)rec.len);
	kvr_msg_put_bytes(&b, rec.p, rec.len);
	kvr_msg_end(&b, off);
	cr_assert(!b.oom && !rec.oom);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), 0);
	cr_assert_eq(m.floor_clock, 777);
	cr_assert_eq(m.floor_writer, 4);
	size_t pos = 0, rl;
	const uint8_t *rp;
	cr_assert_eq(kvr_msg_next_record(&m, &pos, &rp, &rl), 1);
	cr_assert_eq(rl, rec.len);
	cr_assert_eq(memcmp(rp, rec.p, rl), 0);
	const size_t flags_at = KVR_MSG_HEADER + 4, floor_at = KVR_MSG_HEADER + 16;
	b.p[flags_at] = KVR_MSG_CHUNK_LAST; /* the floor read as a record's length */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	b.p[flags_at] = KVR_MSG_CHUNK_LAST | KVR_MSG_CHUNK_FLOOR;
	memset(b.p + floor_at, 0, 8); /* clock 0 */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	memset(b.p + floor_at, 0xff, 8); /* past 2^63 */
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL);
	b.len = 0;
	off = kvr_msg_begin(&b, KVR_MSG_SNAP_CHUNK, 5, 100, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_FLOOR);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u64(&b, 777);
	kvr_msg_put_u64(&b, 4);
	kvr_msg_end(&b, off);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL, "given up with a floor");
	b.len = 0;
	off = kvr_msg_begin(&b, KVR_MSG_SNAP_CHUNK, 5, 100, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, KVR_MSG_CHUNK_FLOOR);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u64(&b, 777);
	kvr_msg_put_u64(&b, 4);
	kvr_msg_end(&b, off);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL, "a floor on a chunk not last");
	b.len = 0;
	off = kvr_msg_begin(&b, KVR_MSG_SNAP_CHUNK, 5, 100, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, KVR_MSG_CHUNK_LAST | KVR_MSG_CHUNK_FLOOR);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_end(&b, off);
	cr_assert_eq(kvr_msg_decode(b.p, b.len, &m), KVR_EINVAL, "the flag without the floor");
	kvr_msg_buf_fini(&b);
	kvr_msg_buf_fini(&rec);
}

/* A peer's versioned rank changes: the newer wins whatever the order they come in; a removal
 * leaves a tombstone, for a rank this router never had too; a reset told again resets once. */
Test(replica_ranks, the_newer_rank_change_wins, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1); /* ranks 0 and 1 at incarnation 7 */
	bus_quiet(r, 1);
	uint64_t t0 = 0; /* newer than replica 1's own adds (their clock) */
	pthread_mutex_lock(&bus.rep[0]->mu);
	for (size_t i = 0; i < bus.rep[0]->n_ranks; i++)
		if (bus.rep[0]->ranks[i].ver.clock > t0)
			t0 = bus.rep[0]->ranks[i].ver.clock;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	peer_rank_v(bus.rep[0], 1, KVR_REPL_RANK_REMOVE, 0, 7, t0 + 100);
	peer_rank_v(bus.rep[0], 2, KVR_REPL_RANK_ADD, 0, 7, t0 + 50);     /* stale: told again */
	peer_rank_v(bus.rep[0], 3, KVR_REPL_RANK_REMOVE, 3, 7, t0 + 100); /* never had it */
	peer_rank_v(bus.rep[0], 4, KVR_REPL_RANK_ADD, 3, 7, t0 + 50);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert(!has_rank(r[0], 0), "an older add brought the removed rank back");
	cr_assert(!has_rank(r[0], 3), "an add older than the removal that came first was taken");
	pthread_mutex_lock(&bus.rep[0]->mu);
	cr_assert_eq(bus.rep[0]->st.rank_stale, 2, "the two older adds counted");
	pthread_mutex_unlock(&bus.rep[0]->mu);
	peer_rank_v(bus.rep[0], 5, KVR_REPL_RANK_ADD, 0, 8, t0 + 200); /* a real re-add */
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(stats_of(r[0], 0).incarnation, 8);
	/* A reset: applied once, however often told. */
	struct kvr_decision d = bus_route(r[0], 7, 64);
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	struct kvr_rank_id one = d.rank;
	cr_assert_gt(n_blocks(r[0], one), 0);
	peer_rank_v(bus.rep[0], 6, KVR_REPL_RANK_RESET, one.worker_id,
	            stats_of(r[0], one.worker_id).incarnation, t0 + 300);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	cr_assert_eq(n_blocks(r[0], one), 0);
	d = bus_route(r[0], 7, 64);
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	cr_assert_eq(d.rank.worker_id, one.worker_id); /* its cached prefix was reset: same cost */
	size_t kept = n_blocks(r[0], one);
	cr_assert_gt(kept, 0);
	peer_rank_v(bus.rep[0], 7, KVR_REPL_RANK_RESET, one.worker_id,
	            stats_of(r[0], one.worker_id).incarnation, t0 + 300);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(kvr_router_sync(r[0], 5000), 0);
	cr_assert_eq(n_blocks(r[0], one), kept, "a reset told again reset the rank again");
	bus_teardown(r, 1);
}

/* A tombstone is forgotten tombstone_ms after the removal (the table does not grow for good
 * with removed ranks); until then it is kept. */
Test(replica_ranks, tombstones_are_forgotten_after_their_keep, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_tombstone_ms = 300;
	bus_start(r, 1);
	bus_tombstone_ms = 0;
	bus_quiet(r, 1);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){1, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	struct kvr_replica *rep = bus.rep[0];
	pthread_mutex_lock(&rep->mu);
	cr_assert(kvr_rep_tomb_find(rep, (struct kvr_rank_id){1, 0}) &&
	              !kvr_rep_rank_find(rep, (struct kvr_rank_id){1, 0}),
	          "no tombstone");
	pthread_mutex_unlock(&rep->mu);
	bool gone = false;
	for (int k = 0; k < 200 && !gone; k++) { /* heartbeats every 50 ms expire it */
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&rep->mu);
		gone = !has_entry(rep, (struct kvr_rank_id){1, 0});
		pthread_mutex_unlock(&rep->mu);
	}
	cr_assert(gone, "the tombstone outlived its keep");
	bus_teardown(r, 1);
}

/* The rank table's bytes (kvr_memory.replica_ranks), read as a user reads them. */
static uint64_t table_bytes(struct kvr_router *r)
{
	struct kvr_memory m;
	cr_assert_eq(kvr_router_get_memory(r, &m), 0);
	return m.replica_ranks;
}

/* The rank table's tombstones are memory the router holds for an hour (the default keep): they
 * are counted in kvr_memory.replica_ranks, which grows with them and falls back once they are
 * forgotten.  No part counted them: a soak adding 3 new worker ids a cycle (perf/soak_router
 * --phases ranks,replica) showed ~0.9 KB a report of growth no part accounted for, stepping as
 * the table's array doubled; and the array kept its largest size after the prunes.  A
 * tombstone holds only what a removal's version check needs (a table of its own), not a whole
 * entry. */
Test(replica_ranks, tombstones_are_counted_in_the_memory_and_given_back, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1); /* tombstones kept an hour: forgotten below by hand */
	bus_quiet(r, 1);
	const uint64_t m0 = table_bytes(r[0]);
	cr_assert_gt(m0, 0, "the two ranks' entries are not counted");
	enum { N = 300 };
	for (uint64_t w = 100; w < 100 + N; w++) {
		cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){w, 0}, 1, 1000, 4096), 0);
		cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){w, 0}), 0);
	}
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	struct kvr_replica *rep = bus.rep[0];
	size_t tombs = 0;
	for (int k = 0; k < 1000 && tombs < N; k++) { /* the sender notes them */
		tombs = 0;
		pthread_mutex_lock(&rep->mu);
		for (uint64_t w = 100; w < 100 + N; w++) {
			tombs += kvr_rep_tomb_find(rep, (struct kvr_rank_id){w, 0}) != NULL;
		}
		pthread_mutex_unlock(&rep->mu);
		if (tombs < N)
			nanosleep(&(struct timespec){0, 10000000}, NULL);
	}
	cr_assert_eq(tombs, N, "%zu tombstones of %d", tombs, N);
	/* At least what a removal's version check needs: id, incarnation, version, time. */
	const uint64_t need = sizeof(struct kvr_rank_id) + 8 + sizeof(struct kvr_rep_ver) + 8;
	const uint64_t m1 = table_bytes(r[0]);
	cr_assert_geq(m1, m0 + N * need, "%d tombstones counted %lu bytes (%lu before)", N,
	              (unsigned long)m1, (unsigned long)m0);
	/* Less than whole entries, doubling included (they were: 83,328 bytes for these). */
	cr_assert_lt(m1 - m0, N * sizeof(struct kvr_rep_rank), "%d tombstones hold %lu bytes", N,
	             (unsigned long)(m1 - m0));
	pthread_mutex_lock(&rep->mu);
	kvr_rep_ranks_expire(rep, kvr_rep_mono_ns() + 2 * 3600 * 1000000000ull); /* past the keep */
	for (uint64_t w = 100; w < 100 + N; w++)
		cr_assert(!has_entry(rep, (struct kvr_rank_id){w, 0}));
	pthread_mutex_unlock(&rep->mu);
	const uint64_t m2 = table_bytes(r[0]);
	cr_assert_leq(m2, m0,
	              "the table kept %lu bytes after its tombstones went (%lu before them)",
	              (unsigned long)m2, (unsigned long)m0);
	cr_assert(has_rank(r[0], 0) && has_rank(r[0], 1));
	bus_teardown(r, 1);
}

static uint64_t route_on(struct kvr_router *r, struct kvr_rank_id rk, uint32_t s);

/* What journal record x holds at the sizes asked for: the record with its blocks and tail,
 * and its output array. */
static uint64_t rec_held(const struct kvr_rep_rec *x)
{
	return x->size + (uint64_t)x->out_cap * sizeof(*x->out);
}

/* Replica i's journal of rank rk: how many records, and the bytes they hold. */
static size_t journal_of(int i, struct kvr_rank_id rk, uint64_t *bytes)
{
	struct kvr_replica *rep = bus.rep[i];
	size_t n = 0;
	*bytes = 0;
	pthread_mutex_lock(&rep->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, rk);
	for (const struct kvr_rep_rec *x = e ? e->jhead : NULL; x; x = x->next) {
		n++;
		*bytes += rec_held(x);
	}
	pthread_mutex_unlock(&rep->mu);
	return n;
}

/* Waits (5 s at most) until replica i's journal of rk holds want records (the origin's sender,
 * then the peer, journal them); *bytes: what they hold. */
static void journal_settles(struct kvr_router **r, int i, struct kvr_rank_id rk, size_t want,
                            uint64_t *bytes)
{
	size_t n = SIZE_MAX;
	for (int k = 0; k < 500 && n != want; k++) {
		bus_quiet(r, 2);
		n = journal_of(i, rk, bytes);
		if (n != want)
			nanosleep(&(struct timespec){0, 10000000}, NULL);
	}
	cr_assert_eq(n, want, "replica %d's journal holds %zu records, not %zu", i, n, want);
}

/* The journals of finished attempts are memory the replica holds (up to journal_blocks, twice
 * the rank's capacity, per rank: megabytes for a large rank): counted in
 * kvr_memory.replica_ranks, as they grow and as they are given back (a reset, a removal).  They
 * were not counted: perf/soak_router showed them as growth no part accounted for.  On the
 * origin (its own attempts) and on the peer (their mirrors). */
Test(replica_ranks, journals_are_counted_in_the_memory_and_given_back, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	bus_quiet(r, 2);
	const struct kvr_rank_id rk = {1, 0};
	const uint64_t m0[2] = {table_bytes(r[0]), table_bytes(r[1])};
	enum { N = 20 };
	for (uint32_t k = 0; k < N; k++) {
		uint64_t a = route_on(r[0], rk, 500 + k);
		uint32_t out[100];
		for (uint32_t j = 0; j < 100; j++)
			out[j] = k * 7919u + j;
		cr_assert_eq(kvr_request_output(r[0], a, out, 1 + k * 5), 0);
		cr_assert_eq(kvr_request_finish(r[0], a), 0);
	}
	uint64_t jb[2] = {0, 0};
	for (int i = 0; i < 2; i++) {
		journal_settles(r, i, rk, N, &jb[i]);
		cr_assert_gt(jb[i], N * sizeof(struct kvr_rep_rec));
		const uint64_t m1 = table_bytes(r[i]);
		cr_assert_eq(m1, m0[i] + jb[i],
		             "replica %d: replica_ranks %lu, %lu before %d finished attempts whose "
		             "journal holds %lu bytes",
		             i, (unsigned long)m1, (unsigned long)m0[i], N, (unsigned long)jb[i]);
	}
	/* A reset ends the rank's life and its journal (on the peer too, once it hears it). */
	cr_assert_eq(kvr_rank_reset(r[0], rk, 8), 0);
	for (int i = 0; i < 2; i++) {
		journal_settles(r, i, rk, 0, &jb[i]);
		cr_assert_eq(
		    table_bytes(r[i]), m0[i],
		    "replica %d: replica_ranks %lu after the reset, %lu before the journal", i,
		    (unsigned long)table_bytes(r[i]), (unsigned long)m0[i]);
	}
	/* Again, then the rank's removal takes the journal with the entry. */
	for (uint32_t k = 0; k < N; k++)
		cr_assert_eq(kvr_request_finish(r[0], route_on(r[0], rk, 900 + k)), 0);
	for (int i = 0; i < 2; i++) {
		journal_settles(r, i, rk, N, &jb[i]);
		cr_assert_eq(table_bytes(r[i]), m0[i] + jb[i]);
	}
	cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
	for (int i = 0; i < 2; i++) {
		struct kvr_replica *rep = bus.rep[i];
		bool buried = false;
		for (int k = 0; k < 500 && !buried; k++) {
			bus_quiet(r, 2);
			pthread_mutex_lock(&rep->mu);
			buried = kvr_rep_tomb_find(rep, rk) && !kvr_rep_rank_find(rep, rk);
			pthread_mutex_unlock(&rep->mu);
			if (!buried)
				nanosleep(&(struct timespec){0, 10000000}, NULL);
		}
		cr_assert(buried, "replica %d: the rank was not removed", i);
		/* the entry's room held its tombstone: the table's arrays are as they were */
		cr_assert_leq(table_bytes(r[i]), m0[i],
		              "replica %d: replica_ranks %lu after the removal, %lu before", i,
		              (unsigned long)table_bytes(r[i]), (unsigned long)m0[i]);
	}
	bus_teardown(r, 2);
}

/* What rep's journals hold, walked (kvr_rep_ranks_bytes keeps it as a count). */
static uint64_t journals_walked(const struct kvr_replica *rep)
{
	uint64_t n = 0;
	for (size_t i = 0; i < rep->n_ranks; i++)
		for (const struct kvr_rep_rec *x = rep->ranks[i].jhead; x; x = x->next)
			n += rec_held(x);
	return n;
}

/* The rank table's arrays, at the sizes asked for. */
static uint64_t arrays_of(const struct kvr_replica *rep)
{
	return rep->ranks_cap * sizeof(*rep->ranks) + rep->rix.cap * sizeof(*rep->rix.slot) +
	       rep->tombs_cap * sizeof(*rep->tombs) + rep->tix.cap * sizeof(*rep->tix.slot);
}

/* The rank table's index (sync/replica_table.c: open addressing over the entries' positions,
 * shifted back on removal, rebuilt as the array grows and shrinks) against a model: random
 * gets, drops, burials, forgotten tombstones and finished attempts joining journals (a small
 * budget: the oldest go) over 300 ids, every id looked up after each, and the bytes counted
 * (kvr_rep_ranks_bytes) against the arrays and a walk of the journals; with `failures`, three
 * calls in four have their first or second allocation fail (a get that fails changes nothing;
 * a burial of a rank with an entry never fails: its room is held). */
static void index_model(uint64_t seed, bool failures)
{
	enum { IDS = 300, OPS = 20000 };
	struct kvr_replica *rep = kvr_calloc(1, sizeof(*rep));
	cr_assert(rep);
	rep->bs = 16;
	rep->c.journal_blocks = 40;
	unsigned char st[IDS] = {0}; /* 0 none, 1 rank, 2 tombstone */
	uint64_t x = seed;
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	kvr_alloc_fail_scope(failures ? KVR_ALLOC_ROLE_CALLER : 0);
	for (int op = 0; op < OPS; op++) {
		/* phases that favour growth, then shrinking, so the arrays double and halve */
		const bool grow = (op / 2500) % 2 == 0;
		uint32_t k = (uint32_t)(xorshift64(&x) % IDS),
		         what = (uint32_t)(xorshift64(&x) % 10);
		struct kvr_rank_id id = {(uint64_t)k * 3 + 1, k % 2};
		if (failures && xorshift64(&x) % 4 != 0)
			kvr_alloc_fail_from((xorshift64(&x) % 4) + 1);
		if (what < (grow ? 5u : 2u)) {
			bool got = kvr_rep_rank_get(rep, id) != NULL;
			cr_assert(got || failures, "seed %#lx op %d: get", (unsigned long)seed, op);
			st[k] = got ? 1 : st[k];
		} else if (what < 6) {
			kvr_rep_rank_drop(rep, id);
			st[k] = st[k] == 1 ? 0 : st[k];
		} else if (what < 7) {
			bool held = st[k] != 0;
			bool kept = kvr_rep_rank_bury(
			    rep, id, (struct kvr_rep_ver){(uint64_t)op + 1, 1}, 7, NULL);
			cr_assert(kept || (failures && !held), "seed %#lx op %d: bury (held %d)",
			          (unsigned long)seed, op, held);
			st[k] = kept ? 2 : 0;
		} else if (what < 8) {
			kvr_rep_tomb_drop(rep, id);
			st[k] = st[k] == 2 ? 0 : st[k];
		} else { /* a finished attempt: joins the rank's journal, or freed (no rank) */
			struct kvr_rep_rec *y = kvr_rep_rec_new((uint32_t)(xorshift64(&x) % 20),
			                                        (uint32_t)(xorshift64(&x) % 20));
			if (y) {
				y->rank = id;
				(void)kvr_rep_rec_reserve_out(y, xorshift64(&x) % 100);
				kvr_rep_journal_add(rep, y);
			}
			cr_assert(y || failures, "seed %#lx op %d: record", (unsigned long)seed,
			          op);
		}
		kvr_alloc_fail_after(0);
		cr_assert_eq(kvr_rep_ranks_bytes(rep), arrays_of(rep) + journals_walked(rep),
		             "seed %#lx op %d: %lu bytes counted, %lu in the arrays, %lu in the "
		             "journals",
		             (unsigned long)seed, op, (unsigned long)kvr_rep_ranks_bytes(rep),
		             (unsigned long)arrays_of(rep), (unsigned long)journals_walked(rep));
		size_t n = 0;
		for (uint32_t j = 0; j < IDS; j++) {
			struct kvr_rank_id q = {(uint64_t)j * 3 + 1, j % 2};
			const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, q);
			cr_assert_eq(e != NULL, st[j] == 1, "seed %#lx op %d: id %u %s",
			             (unsigned long)seed, op, j,
			             e ? "found, not a rank" : "a rank not found");
			cr_assert(!e ||
			          (e->id.worker_id == q.worker_id && e->id.dp_rank == q.dp_rank));
			cr_assert_eq(kvr_rep_tomb_find(rep, q) != NULL, st[j] == 2,
			             "seed %#lx op %d: id %u's tombstone", (unsigned long)seed, op,
			             j);
			n += st[j] == 1;
		}
		cr_assert_eq(rep->n_ranks, n);
		cr_assert(rep->rix.cap == 0 || rep->n_ranks * 2 <= rep->rix.cap);
		cr_assert_leq(2 * (rep->n_tombs + rep->n_ranks), rep->tix.cap,
		              "seed %#lx op %d: %zu tombstones and %zu entries, %zu index slots",
		              (unsigned long)seed, op, rep->n_tombs, rep->n_ranks, rep->tix.cap);
		cr_assert_leq(rep->n_tombs + rep->n_ranks, rep->tombs_cap,
		              "seed %#lx op %d: an entry's tombstone has no room",
		              (unsigned long)seed, op);
	}
	kvr_alloc_fail_scope(0);
	kvr_alloc_thread_role(0);
	for (uint32_t j = 0; j < IDS; j++) {
		kvr_rep_rank_drop(rep, (struct kvr_rank_id){(uint64_t)j * 3 + 1, j % 2});
		kvr_rep_tomb_drop(rep, (struct kvr_rank_id){(uint64_t)j * 3 + 1, j % 2});
	}
	cr_assert_eq(kvr_rep_ranks_bytes(rep), 0, "emptied, the table holds %lu bytes",
	             (unsigned long)kvr_rep_ranks_bytes(rep));
	kvr_free(rep, sizeof(*rep));
}

Test(replica_ranks, the_rank_index_follows_random_changes, .timeout = 60)
{
	index_model(0x5eed1234ull, false);
}

/* The review's probe: the same under allocation failures (gets, shrinks and index rebuilds). */
Test(replica_ranks, the_rank_index_follows_random_changes_under_allocation_failures, .timeout = 120)
{
	for (uint64_t seed = 1; seed <= 8; seed++)
		index_model(0xfeedbeefull * seed, true);
}

/* A removal buried after a newer one of the same rank (a peer's, buried after its router call
 * without mu, while an own removal buried the rank meanwhile) keeps the newer version: lowered,
 * an add between the two versions told later was taken and brought the rank back. */
Test(replica_ranks, a_tombstone_never_goes_back_to_an_older_removal)
{
	struct kvr_replica *rep = kvr_calloc(1, sizeof(*rep));
	cr_assert(rep);
	const struct kvr_rank_id id = {5, 0};
	cr_assert(kvr_rep_rank_get(rep, id));
	cr_assert(kvr_rep_rank_bury(rep, id, (struct kvr_rep_ver){200, 1}, 7, NULL));
	cr_assert(kvr_rep_rank_bury(rep, id, (struct kvr_rep_ver){100, 2}, 7, NULL));
	const struct kvr_rep_tomb *t = kvr_rep_tomb_find(rep, id);
	cr_assert(t);
	cr_assert_eq(t->ver.clock, 200, "the tombstone went back to version %lu",
	             (unsigned long)t->ver.clock);
	cr_assert(kvr_rep_rank_bury(rep, id, (struct kvr_rep_ver){300, 2}, 7, NULL));
	cr_assert_eq(kvr_rep_tomb_find(rep, id)->ver.clock, 300, "a newer removal renews it");
	kvr_rep_tomb_drop(rep, id);
	cr_assert_eq(kvr_rep_ranks_bytes(rep), 0);
	kvr_free(rep, sizeof(*rep));
}

/* A tombstone for a rank never held here carries the removal's incarnation.  Before, it was at
 * 0, and told again (a re-announce, a snapshot) its removal was refused by every replica holding
 * the rank at a later incarnation (kvr_rep_apply_rank). */
Test(replica_ranks, a_tombstone_of_a_rank_never_held_has_the_removals_incarnation, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	bus_quiet(r, 1);
	pthread_mutex_lock(&bus.rep[0]->mu);
	uint64_t t0 = bus.rep[0]->rank_clock;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	peer_rank_v(bus.rep[0], 1, KVR_REPL_RANK_REMOVE, 9, 7, t0 + 100);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	pthread_mutex_lock(&bus.rep[0]->mu);
	const struct kvr_rep_tomb *t = kvr_rep_tomb_find(bus.rep[0], (struct kvr_rank_id){9, 0});
	uint64_t inc = t ? t->incarnation : 999;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	bus_teardown(r, 1);
	cr_assert_eq(inc, 7, "the tombstone's incarnation is %lu, the removal's 7",
	             (unsigned long)inc);
}

/* An own removal whose sender finds no memory (the review's probe).  Before, the tombstone could
 * not be kept, was forgotten at once and raised the floor to the removal's version: a peer's add
 * of an unrelated rank made a moment before and still on its way was refused for good.  Now an
 * entry's tombstone has its room (kvr_rep_rank_get). */
Test(replica_ranks, a_removal_without_memory_keeps_its_tombstone_and_the_floor, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	bus_quiet(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	pthread_mutex_lock(&rep->mu);
	uint64_t t0 = rep->rank_clock;
	pthread_mutex_unlock(&rep->mu);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_SENDER);
	kvr_alloc_fail_after(1);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){1, 0}), 0);
	bus_quiet(r, 1);
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
	pthread_mutex_lock(&rep->mu);
	bool tomb = kvr_rep_tomb_find(rep, (struct kvr_rank_id){1, 0}) != NULL;
	struct kvr_rep_ver f = rep->rank_floor;
	uint64_t t1 = rep->rank_clock;
	pthread_mutex_unlock(&rep->mu);
	/* a peer's add of rank 42, made between the quiet and the removal, arrives now */
	peer_rank_v(rep, 1, KVR_REPL_RANK_ADD, 42, 3, t0 + (t1 - t0) / 2);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	bool has = has_rank(r[0], 42);
	bus_teardown(r, 1);
	cr_assert(tomb, "the removal's tombstone was not kept");
	cr_assert_eq(f.clock, 0, "the floor rose to %lu", (unsigned long)f.clock);
	cr_assert(has, "a peer's add of an unrelated rank made before the removal was refused");
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

/* How replica 1's rank changes fail to reach its peer. */
enum unheard {
	CUT_OFF, /* down, and it knows (kvr_replica_disconnected): nothing is published */
	REFUSED, /* the transport refuses the publishes (the bus fails them) */
	LOST,    /* the transport takes them and loses them (a connection that died unnoticed) */
};

/* Replica 1 removes rank 2 and resets ranks 0 and 1 keeping their incarnation, while its
 * publishes do not reach replica 2 (how).  Returns once they are done on its router. */
static void change_ranks_unheard(struct kvr_router **r, enum unheard how)
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
	if (how == CUT_OFF)
		kvr_replica_disconnected(bus.rep[0]);
	else
		__atomic_store_n(how == REFUSED ? &bus_down[0] : &bus_lose[0], true,
		                 __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_reset(r[0], (struct kvr_rank_id){w, 0}, 7), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0); /* the notes handled, not sent */
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[0], &st);
	if (how != LOST)
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
	change_ranks_unheard(r, CUT_OFF);
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
	change_ranks_unheard(r, REFUSED);
	__atomic_store_n(&bus_down[0], false, __ATOMIC_RELEASE);
	check_heard(r, "after the failed publishes");
	bus_teardown(r, 2);
}

/* The same with publishes the transport took and lost: the connection died just after them and
 * the replica noticed only later.  They had gone out as far as it knew, so they were not kept
 * (the removal's entry dropped, the reset marked told), and the re-announce after the reconnect
 * did not tell them again: the peer routed to the removed rank for good and kept the reset
 * ranks' predicted caches. */
Test(replica_ranks, rank_changes_lost_after_their_publish_reach_the_peers, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	change_ranks_unheard(r, LOST);
	__atomic_store_n(&bus_lose[0], false, __ATOMIC_RELEASE);
	kvr_replica_disconnected(bus.rep[0]); /* noticed now */
	kvr_replica_reconnected(bus.rep[0]);
	wait_snapshots(0, 1);
	check_heard(r, "after the unnoticed loss");
	bus_teardown(r, 2);
}

static bool has_rank(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	return kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s) == 0;
}

/* Polls (10 s at most) until no router of r[0..n-1] has rank w; says which still has it (r[0]
 * is replica first + 1). */
static void rank_gone_from(struct kvr_router **r, int first, int n, uint64_t w, const char *how)
{
	int left = -1;
	for (int k = 0; k < 100; k++) {
		bus_quiet(r, n);
		left = -1;
		for (int i = 0; i < n && left < 0; i++)
			if (has_rank(r[i], w))
				left = i;
		if (left < 0)
			return;
		struct timespec ts = {0, 100000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_fail("%s: replica %d still has the removed rank %lu", how, first + left + 1,
	               (unsigned long)w);
}

static void rank_gone_everywhere(struct kvr_router **r, int n, uint64_t w, const char *how)
{
	rank_gone_from(r, 0, n, w, how);
}

/* Rank 2 added on replica 1 and known to every replica of r[0..n-1]. */
static void add_rank_2(struct kvr_router **r, int n)
{
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){2, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, n);
	for (int i = 0; i < n; i++)
		cr_assert(has_rank(r[i], 2), "replica %d never heard rank 2", i + 1);
}

/* Replica 2 is cut off (it knows: kvr_replica_disconnected; and it hears nothing) while replica 1
 * removes rank 2.  Back, it re-announced its rank table, rank 2 included, and replica 1 took the
 * add for a real one: the rank came back on both.  A stale re-announce and a re-add read alike
 * without versions; now replica 1's removal is newer than the add replica 2 repeats. */
Test(replica_ranks, a_rank_removed_while_a_peer_was_cut_off_stays_removed, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	add_rank_2(r, 2);
	kvr_replica_disconnected(bus.rep[1]);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert(has_rank(r[1], 2));
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	kvr_replica_reconnected(bus.rep[1]);
	wait_snapshots(1, 2); /* its first at its start */
	rank_gone_everywhere(r, 2, 2, "after the cut-off peer's reconnect");
	/* Both still route, and a real re-add (newer) goes through. */
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){2, 0}, 8, 1000, 4096), 0);
	bus_quiet(r, 2);
	cr_assert(has_rank(r[0], 2), "a re-add after the removal did not reach the peer");
	bus_teardown(r, 2);
}

/* Replica 3 heard replica 1 remove rank 2 but replica 2 had not yet (its stream far behind) when
 * replica 3 resynced (an outage of its own) and took replica 2's snapshot, which still listed
 * the rank: its records were applied whatever the fences said, and the rank came back on
 * replica 3 for good.  The removal's version now beats the snapshot's older add, whichever
 * comes first: the removal applied first leaves a tombstone. */
Test(replica_ranks, a_snapshot_older_than_a_removal_does_not_bring_the_rank_back, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 3);
	add_rank_2(r, 3);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[2], 10000), 0);
	cr_assert(!has_rank(r[2], 2));
	cr_assert(has_rank(r[1], 2));
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[2], &st);
	kvr_replica_disconnected(bus.rep[2]);
	kvr_replica_reconnected(bus.rep[2]); /* the bus asks replica 2 for the snapshot */
	wait_snapshots(2, st.snapshots_applied + 1);
	cr_assert_eq(kvr_replica_drain(bus.rep[2], 10000), 0);
	cr_assert(!has_rank(r[2], 2), "the older snapshot brought the removed rank back");
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	rank_gone_everywhere(r, 3, 2, "once replica 2 caught up");
	bus_teardown(r, 3);
}

/* A replica joins after replica 1 removed rank 2 (it never hears the removal) and takes its
 * snapshot from replica 2, whose stream is behind: the snapshot lists rank 2 and fences
 * replica 1 before the removal.  The joiner sees the gap at replica 1's next heartbeat and asks
 * it to re-announce, but replica 1 had dropped the removed rank from its table once the removal
 * went out, so nothing told the joiner: it kept the rank for good.  Replica 1 keeps the removal
 * (a tombstone, versioned) and re-announces it. */
Test(replica_ranks, a_joiner_served_before_a_removal_loses_the_rank, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 2);
	add_rank_2(r, 2);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	r[2] = make();
	bus_attach(2, r[2]); /* the bus asks replica 2, the last ready one */
	cr_assert_eq(kvr_replica_drain(bus.rep[2], 10000), 0);
	cr_assert(has_rank(r[2], 2), "the snapshot was not the stale one this test needs");
	rank_gone_from(r + 2, 2, 1, 2, "the joiner");
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	rank_gone_everywhere(r, 3, 2, "once replica 2 caught up");
	bus_teardown(r, 3);
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

/* Sets whether replica i answers snapshot requests on the bus (a replica cut off from the server
 * gets none). */
static void bus_set_ready(int i, bool ready)
{
	pthread_mutex_lock(&bus.mu);
	bus.ready[i] = ready;
	pthread_mutex_unlock(&bus.mu);
}

/* Waits (10 s at most) until replica i has forgotten rank w's tombstone. */
static void wait_forgotten(int i, uint64_t w)
{
	struct kvr_replica *rep = bus.rep[i];
	for (int k = 0; k < 1000; k++) {
		pthread_mutex_lock(&rep->mu);
		bool gone = !has_entry(rep, (struct kvr_rank_id){w, 0});
		pthread_mutex_unlock(&rep->mu);
		if (gone)
			return;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_fail("replica %d kept rank %lu's tombstone", i + 1, (unsigned long)w);
}

/* Replica 2 is cut off longer than the tombstones' keep (300 ms here, an hour by default) while
 * replica 1 removes rank 2; replica 3 joins meanwhile from replica 1's snapshot.  Back, replica
 * 2 re-announced rank 2's add and resynced from replica 3: nobody remembered the removal, so the
 * add was taken for a rank unknown yet (rank 2 back on replicas 1 and 3), and replica 2 kept the
 * rank the snapshot did not list.  Now a replica remembers the highest removal it forgot (the
 * floor, inherited with a snapshot): an add older than it for a rank unknown here is refused, and
 * a rank older than the snapshot's floor that the snapshot does not list is gone.  Rank 3, added
 * on replica 2 during the outage (before the removal: older than the floor too), is its own
 * change the cluster never heard, not a forgotten one: it is kept and told again. */
Test(replica_ranks, a_rank_removed_during_an_outage_longer_than_its_tombstone_stays_removed,
     .timeout = 60)
{
	struct kvr_router *r[3];
	bus_tombstone_ms = 300;
	bus_start(r, 2);
	add_rank_2(r, 2);
	kvr_replica_disconnected(bus.rep[1]);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	bus_set_ready(1, false);
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){3, 0}, 7, 1000, 4096), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[1], 10000), 0);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	wait_forgotten(0, 2);
	r[2] = make();
	bus_attach(2, r[2]); /* from replica 1, the only one ready */
	cr_assert(!has_rank(r[2], 2));
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	bus_set_ready(1, true);
	kvr_replica_reconnected(bus.rep[1]);
	wait_snapshots(1, 2); /* from replica 3, the last ready */
	rank_gone_everywhere(r, 3, 2, "after an outage longer than the tombstone's keep");
	for (int i = 0; i < 3; i++)
		cr_assert(has_rank(r[i], 3), "replica %d lacks rank 3, added during the outage",
		          i + 1);
	/* A real re-add (newer than every removal) goes through. */
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){2, 0}, 8, 1000, 4096), 0);
	bus_quiet(r, 3);
	for (int i = 0; i < 3; i++)
		cr_assert(has_rank(r[i], 2), "replica %d refused the re-add", i + 1);
	bus_tombstone_ms = 0;
	bus_teardown(r, 3);
}

/* Replica 2's connection dies unnoticed (its publishes are lost, it hears nothing) just before
 * it adds rank 3, and it notices the disconnect a moment later; replica 1 then removes rank 2
 * and, the outage outlasting the tombstone's keep, forgets the removal.  Back, replica 2's
 * re-announced add of rank 3 is older than replica 1's floor (refused), and the snapshot does
 * not list it: rank 3 was judged forgotten and removed from replica 2's own router, though
 * nobody but replica 2 ever heard of it. */
Test(replica_ranks, a_rank_added_just_before_an_unnoticed_disconnect_is_kept, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_tombstone_ms = 300;
	bus_start(r, 2);
	add_rank_2(r, 2);
	__atomic_store_n(&bus_lose[1], true, __ATOMIC_RELEASE);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	bus_set_ready(1, false);
	cr_assert_eq(kvr_rank_add(r[1], (struct kvr_rank_id){3, 0}, 7, 1000, 4096), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[1], 10000), 0); /* published, and lost */
	kvr_replica_disconnected(bus.rep[1]);                  /* noticed now */
	__atomic_store_n(&bus_lose[1], false, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	wait_forgotten(0, 2);
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	bus_set_ready(1, true);
	kvr_replica_reconnected(bus.rep[1]);
	wait_snapshots(1, 2);
	rank_gone_everywhere(r, 2, 2, "after an outage longer than the tombstone's keep");
	bus_quiet(r, 2);
	for (int i = 2; i-- > 0;)
		cr_assert(has_rank(r[i], 3),
		          "replica %d lacks rank 3, added just before the unnoticed disconnect",
		          i + 1);
	bus_tombstone_ms = 0;
	bus_teardown(r, 2);
}

/* The end of a snapshot with floor f that names every rank entry of rep but worker `unnamed`'s
 * (UINT64_MAX: none), as the apply thread runs it; the caller holds the handling lock (hmu).
 * With nth, this thread's nth allocation from the end's start fails. */
static void snapshot_end_without(struct kvr_replica *rep, struct kvr_rep_ver f, uint64_t unnamed,
                                 uint64_t nth)
{
	pthread_mutex_lock(&rep->mu);
	kvr_rep_ranks_snapshot_begin(rep);
	for (size_t i = 0; i < rep->n_ranks; i++)
		if (rep->ranks[i].id.worker_id != unnamed)
			kvr_rep_ranks_listed(rep, rep->ranks[i].id);
	pthread_mutex_unlock(&rep->mu);
	if (nth) {
		kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
		kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
		kvr_alloc_fail_after(nth);
	}
	kvr_rep_ranks_snapshot_end(rep, f);
	if (nth) {
		kvr_alloc_fail_after(0);
		kvr_alloc_fail_scope(0);
		kvr_alloc_thread_role(0);
	}
}

static void snapshot_end_with_floor(struct kvr_replica *rep, struct kvr_rep_ver f)
{
	pthread_mutex_lock(&rep->hmu);
	snapshot_end_without(rep, f, UINT64_MAX, 0);
	pthread_mutex_unlock(&rep->hmu);
}

/* A faulty peer tells a rank change versioned 2^63 - 1, the largest clock the wire takes (or a
 * snapshot's floor that high): replica 1's clock took it, its next own version was 2^63, which
 * every peer refuses as malformed (with the batch it came in), so none of its rank changes
 * reached them any more.  A version that far ahead of the wall clock is refused and counted. */
Test(replica_ranks, a_version_at_the_clock_limit_does_not_stop_the_rank_changes, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	bus_quiet(r, 2);
	struct kvr_sync_stats st0, st;
	kvr_replica_get_stats(bus.rep[0], &st0);
	peer_rank_v(bus.rep[0], 1, KVR_REPL_RANK_ADD, 3, 7, (uint64_t)INT64_MAX);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){4, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, 2);
	cr_assert(has_rank(r[1], 4), "replica 1's add after the faulty version never arrived");
	cr_assert(!has_rank(r[0], 3), "the faulty peer's add was taken");
	kvr_replica_get_stats(bus.rep[0], &st);
	cr_assert_eq(st.dropped, st0.dropped + 1, "the faulty version not counted");
	snapshot_end_with_floor(bus.rep[0], (struct kvr_rep_ver){(uint64_t)INT64_MAX, 5});
	cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){5, 0}, 7, 1000, 4096), 0);
	bus_quiet(r, 2);
	cr_assert(has_rank(r[1], 5), "replica 1's add after the faulty floor never arrived");
	kvr_replica_get_stats(bus.rep[0], &st);
	cr_assert_eq(st.dropped, st0.dropped + 2, "the faulty floor not counted");
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.dropped, 0, "replica 2 dropped %lu messages", (unsigned long)st.dropped);
	bus_teardown(r, 2);
}

/* The newest version clock in rep's table (its own adds'), for peers' changes made after them. */
static uint64_t newest_clock(struct kvr_replica *rep)
{
	uint64_t t = 0;
	pthread_mutex_lock(&rep->mu);
	for (size_t i = 0; i < rep->n_ranks; i++)
		if (rep->ranks[i].ver.clock > t)
			t = rep->ranks[i].ver.clock;
	pthread_mutex_unlock(&rep->mu);
	return t;
}

/* A snapshot that no longer names a peer's rank older than its floor removes it from the router
 * (counted in rank_stale); the removal may fail for memory (kvr_rank_remove: KVR_ENOMEM), and was
 * counted all the same: rank_stale said removed of a rank the router still routed to.  Failing
 * each allocation of the judgement in turn (SQLite-style), until one fails the removal: a rank is
 * counted once it is gone, and one that stayed is removed (and counted) by a later heartbeat. */
Test(replica_ranks, a_stale_rank_whose_removal_failed_is_not_counted, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	bus_quiet(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const uint64_t t0 = newest_clock(rep); /* peers' versions newer than its own adds */
	const struct kvr_rank_id three = {3, 0};
	bool failed = false;
	struct kvr_sync_stats after; /* the last round's */
	for (uint64_t nth = 1; nth < 200 && !failed; nth++) {
		if (!has_rank(r[0], 3)) { /* removed by the last round: added again */
			peer_rank_v(rep, nth, KVR_REPL_RANK_ADD, 3, 7, t0 + 10 * nth);
			cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
			cr_assert(has_rank(r[0], 3));
		}
		struct kvr_sync_stats a, b;
		pthread_mutex_lock(&rep->hmu); /* no heartbeat meanwhile */
		kvr_replica_get_stats(rep, &a);
		snapshot_end_without(rep, (struct kvr_rep_ver){t0 + 10 * nth + 5, 5}, 3, nth);
		kvr_replica_get_stats(rep, &b);
		bool gone = !has_rank(r[0], 3);
		pthread_mutex_lock(&rep->mu);
		bool entry = has_entry(rep, three);
		pthread_mutex_unlock(&rep->mu);
		pthread_mutex_unlock(&rep->hmu);
		after = b;
		cr_assert_eq(b.rank_stale - a.rank_stale, gone ? 1 : 0,
		             "allocation %lu failed: rank 3 %s, rank_stale counted %lu",
		             (unsigned long)nth, gone ? "removed" : "still routed",
		             (unsigned long)(b.rank_stale - a.rank_stale));
		cr_assert_eq(entry, !gone, "rank 3's entry %s", gone ? "kept" : "dropped");
		failed = !gone;
	}
	cr_assert(failed, "no removal failed: the test missed its path");
	struct kvr_sync_stats b;
	for (int k = 0; k < 1000 && has_rank(r[0], 3); k++) {
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert(!has_rank(r[0], 3), "the rank whose removal failed was never removed");
	/* The rank leaves the router inside the heartbeat's retry, which counts it and drops its
	 * entry only after the router call (mu released meanwhile): read before that, under load
	 * rank_stale was 0 of 1.  The retry runs with hmu held from start to end: taking it waits
	 * for the retry's bookkeeping. */
	pthread_mutex_lock(&rep->hmu);
	kvr_replica_get_stats(rep, &b);
	pthread_mutex_lock(&rep->mu);
	bool entry = has_entry(rep, three);
	pthread_mutex_unlock(&rep->mu);
	pthread_mutex_unlock(&rep->hmu);
	cr_assert_eq(b.rank_stale, after.rank_stale + 1, "rank_stale %lu, %lu before the retry",
	             (unsigned long)b.rank_stale, (unsigned long)after.rank_stale);
	cr_assert(!entry, "its entry kept");
	bus_teardown(r, 1);
}

/* A snapshot judged rank 3 gone and its removal failed for memory (doomed: the heartbeats try
 * again); meanwhile this replica's router removed rank 3 and added it again, a new life, whose
 * notes have not reached the table yet (they come after the router's change, with the table's
 * lock released: emulated by skipping them, kvr_repl_applying).  The retry removed by id, so
 * the new life went: rank 3 gone from the router, though no snapshot ever judged that life.
 * Now the removal names the life the snapshot judged, and another is left alone. */
Test(replica_ranks, a_stale_rank_removed_and_added_again_meanwhile_keeps_its_new_life,
     .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	bus_quiet(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const uint64_t t0 = newest_clock(rep); /* peers' versions newer than its own adds */
	const struct kvr_rank_id three = {3, 0};
	bool failed = false;
	for (uint64_t nth = 1; nth < 200 && !failed; nth++) {
		if (!has_rank(r[0], 3)) {
			peer_rank_v(rep, nth, KVR_REPL_RANK_ADD, 3, 7, t0 + 10 * nth);
			cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
			cr_assert(has_rank(r[0], 3));
		}
		pthread_mutex_lock(&rep->hmu); /* no heartbeat (no retry) but the test's */
		snapshot_end_without(rep, (struct kvr_rep_ver){t0 + 10 * nth + 5, 5}, 3, nth);
		failed = has_rank(r[0], 3);
		if (!failed)
			pthread_mutex_unlock(&rep->hmu);
	}
	cr_assert(failed, "no removal failed: the test missed its path"); /* hmu held */
	cr_assert_eq(stats_of(r[0], 3).incarnation, 7);
	kvr_repl_applying = true; /* the router's change, its notes not arrived yet */
	cr_assert_eq(kvr_rank_remove(r[0], three), 0);
	cr_assert_eq(kvr_rank_add(r[0], three, 8, 1000, 4096), 0);
	kvr_repl_applying = false;
	kvr_rep_ranks_retry(rep); /* a heartbeat's */
	pthread_mutex_unlock(&rep->hmu);
	cr_assert(has_rank(r[0], 3), "the retry of the judged removal removed rank 3's new life");
	cr_assert_eq(stats_of(r[0], 3).incarnation, 8);
	bus_teardown(r, 1);
}

/* As above, the router's remove and re-add of rank 3 landing before the snapshot's judgement
 * (their notes still on their way to the table: queued for the replica's sender, emulated by
 * skipping them): the life the judgement read from the router was already the new one, which
 * no snapshot judged, and it was removed ("the judgement removed rank 3's new life").  The
 * judgement now removes the life the table's entry describes (here the one the peer's add
 * made), gone already. */
Test(replica_ranks, a_rank_added_again_before_the_judgement_keeps_its_new_life, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	bus_quiet(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const uint64_t t0 = newest_clock(rep); /* peers' versions newer than its own adds */
	const struct kvr_rank_id three = {3, 0};
	peer_rank_v(rep, 1, KVR_REPL_RANK_ADD, 3, 7, t0 + 10);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert(has_rank(r[0], 3));
	pthread_mutex_lock(&rep->hmu);
	kvr_repl_applying = true; /* the router's change, its notes not arrived yet */
	cr_assert_eq(kvr_rank_remove(r[0], three), 0);
	cr_assert_eq(kvr_rank_add(r[0], three, 8, 1000, 4096), 0);
	kvr_repl_applying = false;
	snapshot_end_without(rep, (struct kvr_rep_ver){t0 + 15, 5}, 3, 0);
	pthread_mutex_unlock(&rep->hmu);
	cr_assert(has_rank(r[0], 3), "the judgement removed rank 3's new life");
	cr_assert_eq(stats_of(r[0], 3).incarnation, 8);
	bus_teardown(r, 1);
}

/* A snapshot judges rank 3 gone while this replica's router has removed it already (by another
 * hand: an admin call whose note has not reached the table yet, emulated by skipping it).  The
 * judgement's removal finds the rank gone (KVR_ENOENT): nothing was removed here because of the
 * snapshot, so rank_stale ("ranks removed here because a snapshot, newer than them, no longer
 * named them") must not count it; it counted it as removed.  The entry goes all the same (the
 * router holds no such rank). */
Test(replica_ranks, a_judged_rank_already_gone_is_not_counted, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	bus_quiet(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const uint64_t t0 = newest_clock(rep); /* peers' versions newer than its own adds */
	const struct kvr_rank_id three = {3, 0};
	peer_rank_v(rep, 1, KVR_REPL_RANK_ADD, 3, 7, t0 + 10);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert(has_rank(r[0], 3));
	struct kvr_sync_stats a, b;
	pthread_mutex_lock(&rep->hmu); /* no heartbeat meanwhile */
	kvr_replica_get_stats(rep, &a);
	kvr_repl_applying = true; /* the router's change, its note not arrived yet */
	cr_assert_eq(kvr_rank_remove(r[0], three), 0);
	kvr_repl_applying = false;
	snapshot_end_without(rep, (struct kvr_rep_ver){t0 + 15, 5}, 3, 0);
	kvr_replica_get_stats(rep, &b);
	pthread_mutex_lock(&rep->mu);
	bool entry = has_entry(rep, three);
	pthread_mutex_unlock(&rep->mu);
	pthread_mutex_unlock(&rep->hmu);
	cr_assert(!has_rank(r[0], 3));
	cr_assert_eq(b.rank_stale, a.rank_stale,
	             "a rank removed by another hand counted as removed by the snapshot (%lu)",
	             (unsigned long)(b.rank_stale - a.rank_stale));
	cr_assert(!entry, "the entry of a rank the router no longer holds was kept");
	/* A judged rank this replica does remove is still counted. */
	peer_rank_v(rep, 2, KVR_REPL_RANK_ADD, 4, 7, t0 + 20);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	cr_assert(has_rank(r[0], 4));
	pthread_mutex_lock(&rep->hmu);
	snapshot_end_without(rep, (struct kvr_rep_ver){t0 + 25, 5}, 4, 0);
	kvr_replica_get_stats(rep, &a);
	pthread_mutex_unlock(&rep->hmu);
	cr_assert(!has_rank(r[0], 4));
	cr_assert_eq(a.rank_stale, b.rank_stale + 1, "the judged removal not counted");
	bus_teardown(r, 1);
}

/* Own live records of replica i (attempts it routed and has not seen end), and the records of
 * every kind in its attempt map (own and mirrored). */
static size_t own_live(int i, size_t *in_map)
{
	struct kvr_replica *rep = bus.rep[i];
	size_t n = 0;
	pthread_mutex_lock(&rep->mu);
	for (const struct kvr_rep_rec *x = rep->live_head; x; x = x->next)
		n += x->origin == rep->c.replica_id;
	*in_map = rep->map_n;
	pthread_mutex_unlock(&rep->mu);
	return n;
}

/* Whether replica i's journal of rank rk holds the record of the attempt origin told as oa. */
static bool journaled(int i, struct kvr_rank_id rk, uint64_t origin, uint64_t oa)
{
	struct kvr_replica *rep = bus.rep[i];
	bool found = false;
	pthread_mutex_lock(&rep->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, rk);
	for (const struct kvr_rep_rec *x = e ? e->jhead : NULL; x && !found; x = x->next)
		found = x->origin == origin && x->oattempt == oa;
	pthread_mutex_unlock(&rep->mu);
	return found;
}

/* Routes a 64-token prompt (seed s) pinned to rank rk on r; returns the attempt. */
static uint64_t route_on(struct kvr_router *r, struct kvr_rank_id rk, uint32_t s)
{
	uint32_t t[64];
	for (int j = 0; j < 64; j++)
		t[j] = s * 1000003u + (uint32_t)j;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	q.pinned = &rk;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	return d.attempt;
}

/* Waits (2 s at most) until replica 0 holds want own live records and replica 1 mirrors want
 * attempts, with nothing else in either map; false if that never came. */
static bool records_settle(size_t want)
{
	for (int k = 0; k < 200; k++) {
		size_t map0, map1;
		size_t own = own_live(0, &map0);
		(void)own_live(1, &map1);
		struct kvr_sync_stats st;
		kvr_replica_get_stats(bus.rep[1], &st);
		if (own == want && map0 == want && map1 == want && st.mirrored == want)
			return true;
		nanosleep(&(struct timespec){0, 10000000}, NULL);
	}
	return false;
}

static void expect_records(size_t want, const char *what)
{
	bool ok = records_settle(want);
	size_t map0, map1;
	size_t own = own_live(0, &map0);
	(void)own_live(1, &map1);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_expect(ok,
	          "%s: origin %zu own live, %zu in its map; the peer mirrors %u, %zu in its map "
	          "(want %zu each)",
	          what, own, map0, (unsigned)st.mirrored, map1, want);
}

/* A rank removed (or reset) with attempts live on it ends them (KVR_ESTALE from then on), with
 * no lifecycle call and no lease expiry to tell the replica: their records stayed in its
 * attempt map and live list (blocks, tail and output arrays) until the replica went, told to
 * every joiner in its snapshots, and every peer kept its mirror.  A frontend whose workers come
 * and go for weeks, each leaving with requests in flight, grew every replica by each such
 * attempt (perf/soak_router --phases ranks,replica).  Each lap here routes attempts onto a
 * rank, removes the rank (or resets it) and adds it back: no record may stay, and the attempts
 * of the rank's new life stay until they finish. */
Test(replica_ranks, attempts_ended_by_a_rank_removal_or_reset_leave_no_record, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	const struct kvr_rank_id rk = {1, 0};
	uint64_t inc = 7;
	for (uint32_t lap = 0; lap < 40; lap++) {
		for (uint32_t k = 0; k < 4; k++)
			(void)route_on(r[0], rk, lap * 4 + k);
		if (lap % 2) {
			cr_assert_eq(kvr_rank_reset(r[0], rk, ++inc), 0);
		} else {
			cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
			cr_assert_eq(kvr_rank_add(r[0], rk, ++inc, 1000, 4096), 0);
		}
	}
	bus_quiet(r, 2);
	expect_records(0, "after 40 removals and resets");
	/* Only the attempts that ended go: two routed on the rank's new life, right after its
	 * removal and re-add, stay mirrored until they finish. */
	uint64_t a[2];
	cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
	cr_assert_eq(kvr_rank_add(r[0], rk, ++inc, 1000, 4096), 0);
	for (uint32_t k = 0; k < 2; k++)
		a[k] = route_on(r[0], rk, 9000 + k);
	bus_quiet(r, 2);
	nanosleep(&(struct timespec){0, 200000000}, NULL); /* 4 heartbeats */
	expect_records(2, "the new life's attempts");
	for (int k = 0; k < 2; k++)
		cr_assert_eq(kvr_request_finish(r[0], a[k]), 0);
	bus_quiet(r, 2);
	expect_records(0, "the new life's attempts finished");
	bus_teardown(r, 2);
}

/* Holds replica 0's threads (sender and apply thread) for 60 ms, then lets them race: the apply
 * thread's heartbeat is due at once, the sender has notes waiting.  A heartbeat that dropped
 * records of ended attempts (b1a33d1's sweep) then ran before the sender's ends about half the
 * time. */
static void stall_then_race(void)
{
	kvr_replica_stall(bus.rep[0], 60, true);
}

/* An attempt a caller finished just before its rank's removal (the rank's end found its lease
 * claimed), and one finished on the rank's new life, are told by their own FINISH: the rank's
 * end tells only the attempts it ended.  The review's probe of b1a33d1: its heartbeat sweep
 * dropped own records of ended attempts on a rank changed since the last heartbeat, those that
 * ended normally too, before their FINISH was published, so the peers kept those mirrors and
 * their load for good ("peer mirrored=1 map=1").  Here the finishes wait behind a stall of the
 * origin, after which its heartbeat races its sender.  Finished ones join their rank's journal
 * on the origin (an attempt the rank's end ended does not: its blocks went with the rank's
 * life). */
Test(replica_ranks, an_attempt_finished_before_its_ranks_removal_still_tells_its_finish,
     .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	const struct kvr_rank_id rk = {1, 0};
	uint64_t inc = 7;
	for (uint32_t lap = 0; lap < 20; lap++) {
		uint64_t a = route_on(r[0], rk, 100 + lap);
		uint64_t gone = route_on(r[0], rk, 200 + lap);
		bus_quiet(r, 2); /* the peer mirrors them */
		cr_assert_eq(kvr_request_finish(r[0], a), 0);
		if (lap % 2) {
			cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
			cr_assert_eq(kvr_rank_add(r[0], rk, ++inc, 1000, 4096), 0);
		} else {
			cr_assert_eq(kvr_rank_reset(r[0], rk, ++inc), 0);
		}
		cr_assert_eq(kvr_request_finish(r[0], gone), KVR_ESTALE);
		/* one on the new life, mirrored, then finished while the origin is held */
		uint64_t b = route_on(r[0], rk, 300 + lap);
		bus_quiet(r, 2);
		stall_then_race();
		cr_assert_eq(kvr_request_finish(r[0], b), 0);
		nanosleep(&(struct timespec){0, 80000000}, NULL);
		bus_quiet(r, 2);
		expect_records(0, "a lap");
		cr_assert(journaled(0, rk, 1, b),
		          "lap %u: the new life's finished attempt was not journaled (not ended by "
		          "its FINISH)",
		          lap);
		cr_assert(!journaled(0, rk, 1, gone), "lap %u: the ended attempt was journaled",
		          lap);
		/* The peer journals its mirror at the ABORT the rank's end told (it cannot tell
		 * it from a caller's), but that ABORT precedes the rank change on the origin's
		 * stream (told on the shard inside the change's call, the change noted after it
		 * returned), and the change clears the journal of the life it ended. */
		cr_assert(!journaled(1, rk, 1, gone),
		          "lap %u: the ended attempt was journaled on the peer", lap);
		cr_assert(journaled(1, rk, 1, b), "lap %u: the peer did not journal the finished",
		          lap);
	}
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_expect_eq(st.orphans, 0, "%lu ends reached the peer for attempts it did not mirror",
	             (unsigned long)st.orphans);
	bus_teardown(r, 2);
}

/* Many ranks changed at once (more than the 32 b1a33d1's sweep could name before it fell back
 * to every rank) end only their own attempts: the attempts of a rank left alone stay live and
 * mirrored, and those of it finished meanwhile are told by their FINISH (the review's probe:
 * the "every rank" fallback dropped them unpublished when the heartbeat came first, and the
 * peers kept their mirrors).  Each lap: 40 ranks added, routed to and removed or reset, then
 * two of the live rank's attempts finished while the origin is held. */
Test(replica_ranks, many_rank_changes_at_once_leave_the_other_ranks_records, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	const struct kvr_rank_id live = {1, 0};
	uint64_t keep[4];
	for (uint32_t k = 0; k < 4; k++)
		keep[k] = route_on(r[0], live, 400 + k);
	for (uint32_t lap = 0; lap < 8; lap++) {
		uint64_t done[2];
		for (uint32_t k = 0; k < 2; k++)
			done[k] = route_on(r[0], live, 500 + lap * 2 + k);
		for (uint64_t w = 100; w < 140; w++)
			cr_assert_eq(
			    kvr_rank_add(r[0], (struct kvr_rank_id){w, 0}, 1 + lap, 1000, 4096), 0);
		for (uint64_t w = 100; w < 140; w++)
			(void)route_on(r[0], (struct kvr_rank_id){w, 0}, 600 + (uint32_t)w);
		bus_quiet(r, 2);
		expect_records(46, "before the changes");
		for (uint64_t w = 100; w < 140; w++) {
			struct kvr_rank_id id = {w, 0};
			cr_assert_eq(w % 2 ? kvr_rank_reset(r[0], id, 100 + lap) : 0, 0);
			cr_assert_eq(kvr_rank_remove(r[0], id), 0);
		}
		bus_quiet(r, 2);
		stall_then_race();
		for (uint32_t k = 0; k < 2; k++)
			cr_assert_eq(kvr_request_finish(r[0], done[k]), 0);
		nanosleep(&(struct timespec){0, 80000000}, NULL);
		bus_quiet(r, 2);
		expect_records(4, "after 40 rank changes");
		for (uint32_t k = 0; k < 2; k++)
			cr_assert(journaled(0, live, 1, done[k]),
			          "lap %u: finished attempt %u not journaled", lap, k);
	}
	for (uint32_t k = 0; k < 4; k++)
		cr_assert_eq(kvr_request_finish(r[0], keep[k]), 0);
	bus_quiet(r, 2);
	expect_records(0, "all finished");
	bus_teardown(r, 2);
}

/* Own records the sender holds across sender_pause (their output's copy failing for memory:
 * the sender sleeps with mu released, the apply thread goes on) while a peer's removal of their
 * rank is applied and heartbeats pass: they are ended by the sender itself, after the pause,
 * never freed under it (the review's probe of b1a33d1: its heartbeat sweep freed the held one,
 * ASan's heap-use-after-free in out_progress).  Run under ASan (-Db_sanitize=address). */
Test(replica_ranks, a_record_the_sender_holds_across_a_pause_outlives_its_ranks_end, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	const struct kvr_rank_id rk = {1, 0};
	uint64_t inc = 7, seq = 0;
	uint32_t out[200];
	for (uint32_t lap = 0; lap < 8; lap++) {
		uint64_t a[5];
		for (uint32_t k = 0; k < 5; k++)
			a[k] = route_on(r[0], rk, 700 + lap * 5 + k);
		bus_quiet(r, 2);
		pthread_mutex_lock(&bus.rep[0]->mu);
		uint64_t clock = bus.rep[0]->rank_clock + 1000;
		pthread_mutex_unlock(&bus.rep[0]->mu);
		kvr_alloc_fail_scope(KVR_ALLOC_ROLE_SENDER);
		kvr_alloc_fail_from(1);
		for (uint32_t k = 0; k < 5; k++) { /* 5 pauses of 10 ms each */
			for (uint32_t j = 0; j < 200; j++)
				out[j] = (lap * 5 + k) * 7919u + 888000u + j;
			cr_assert_eq(kvr_request_output(r[0], a[k], out, 200), 0);
		}
		/* a peer (5) removes the rank: applied by the origin's apply thread */
		peer_rank_v(bus.rep[0], ++seq, KVR_REPL_RANK_REMOVE, rk.worker_id, inc, clock);
		nanosleep(&(struct timespec){0, 80000000}, NULL); /* a heartbeat meanwhile */
		kvr_alloc_fail_after(0);
		kvr_alloc_fail_scope(0);
		cr_assert(!has_rank(r[0], rk.worker_id), "lap %u: the peer's removal not applied",
		          lap);
		cr_assert_eq(kvr_rank_add(r[0], rk, ++inc, 1000, 4096), 0);
		bus_quiet(r, 2);
		expect_records(0, "after the pause");
	}
	bus_teardown(r, 2);
}

/* End to end (the review's probe): replica 1 removes rank 2 (incarnation 7) while replica 2 is
 * cut off; replica 3 joins from replica 1's snapshot (it never had the rank).  Replica 1 goes
 * silent; replica 2, back, resyncs from replica 3, whose snapshot tells the removal.  Before, it
 * told it at incarnation 0, refused: replica 2 kept rank 2 for good. */
Test(replica_ranks, a_removal_told_by_a_replica_that_never_held_the_rank_is_taken, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 2);
	add_rank_2(r, 2);
	kvr_replica_disconnected(bus.rep[1]);
	__atomic_store_n(&bus_deaf[1], true, __ATOMIC_RELEASE);
	bus_set_ready(1, false);
	cr_assert_eq(kvr_rank_remove(r[0], (struct kvr_rank_id){2, 0}), 0);
	cr_assert_eq(kvr_replica_drain(bus.rep[0], 10000), 0);
	r[2] = make();
	bus_attach(2, r[2]); /* served by replica 1 */
	cr_assert_eq(kvr_replica_drain(bus.rep[2], 10000), 0);
	cr_assert(!has_rank(r[2], 2));
	/* replica 1 goes silent (its publishes lost, no snapshots served) */
	__atomic_store_n(&bus_lose[0], true, __ATOMIC_RELEASE);
	bus_set_ready(0, false);
	__atomic_store_n(&bus_deaf[1], false, __ATOMIC_RELEASE);
	bus_set_ready(1, true);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	kvr_replica_reconnected(bus.rep[1]); /* asks replica 3 */
	wait_snapshots(1, st.snapshots_applied + 1);
	cr_assert_eq(kvr_replica_drain(bus.rep[1], 10000), 0);
	bool kept = has_rank(r[1], 2);
	bus_teardown(r, 3);
	cr_assert(!kept, "replica 2 kept rank 2 after resyncing from replica 3");
}

/* Peer 5 says at stream position seq that its attempt oa ended (type: FINISH or ABORT). */
static void peer_end(struct kvr_replica *rep, uint64_t seq, unsigned type, uint64_t oa)
{
	struct kvr_msg_buf b = {0};
	size_t off = kvr_msg_begin(&b, type, 5, 100, seq);
	kvr_msg_put_u64(&b, oa);
	kvr_msg_end(&b, off);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
}

/* A peer's attempt whose end comes after its rank's removal and re-add (the origin's posted
 * booking dropped as stale: the shard tells that ABORT with no order against the rank's notes,
 * so the REMOVE and the ADD can precede it) ended with the life it was booked on: its blocks
 * went with that life, and the new life's journal (what snapshots serve joiners as the rank's
 * predicted cache) must not take them.  Before, the mirror joined the journal of whatever life
 * the rank had when the end came.  An attempt finished on the life it was booked on is still
 * journaled; so is one booked on the new life. */
Test(replica_ranks, a_mirror_ended_after_its_ranks_new_life_is_not_journaled_in_it, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	struct kvr_config g;
	kvr_router_get_config(r[0], &g);
	const struct kvr_rank_id rk = {1, 0};
	/* Ahead of every own version (the wall clock's ns, or past the last), also of those the
	 * replica makes after this read: its entries' first versions may come after it. */
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	pthread_mutex_lock(&rep->mu);
	uint64_t clock = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
	if (rep->rank_clock > clock)
		clock = rep->rank_clock;
	clock += 60000000000ull;
	pthread_mutex_unlock(&rep->mu);
	uint64_t seq = 0;
	struct kvr_msg_buf b = {0};
	/* 11 finishes on its own life; 12 is live across the removal and re-add */
	for (uint64_t oa = 11; oa <= 12; oa++) {
		b.len = 0;
		kvr_test_put_attempt(&b, KVR_MSG_ADMIT, 5, 100, ++seq, oa, rk.worker_id, 7, oa,
		                     g.block_size);
		cr_assert(!b.oom);
		kvr_replica_deliver(rep, b.p, b.len, NULL);
	}
	kvr_msg_buf_fini(&b);
	peer_end(rep, ++seq, KVR_MSG_FINISH, 11);
	for (int same_inc = 0; same_inc < 2; same_inc++) {
		peer_rank_v(rep, ++seq, KVR_REPL_RANK_REMOVE, rk.worker_id, 7 + same_inc, ++clock);
		peer_rank_v(rep, ++seq, KVR_REPL_RANK_ADD, rk.worker_id, 8, ++clock);
		cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
		cr_assert(has_rank(r[0], rk.worker_id), "the rank's new life not applied");
	}
	peer_end(rep, ++seq, KVR_MSG_ABORT, 12);
	b = (struct kvr_msg_buf){0};
	kvr_test_put_attempt(&b, KVR_MSG_ADMIT, 5, 100, ++seq, 13, rk.worker_id, 8, 13,
	                     g.block_size);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
	peer_end(rep, ++seq, KVR_MSG_FINISH, 13);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.mirrored, 0, "%u mirrors left", (unsigned)st.mirrored);
	cr_assert_eq(st.orphans, 0, "%lu ends found no mirror (%lu admissions refused)",
	             (unsigned long)st.orphans, (unsigned long)st.refused);
	cr_expect(!journaled(0, rk, 5, 11), "the old life's finished attempt survived the removal");
	cr_expect(!journaled(0, rk, 5, 12), "the old life's attempt joined the new life's journal");
	cr_expect(journaled(0, rk, 5, 13), "the new life's finished attempt was not journaled");
	bus_teardown(r, 1);
}

/* (The review's probe of the first version of this fix, which compared lives: a reset or a
 * new incarnation keeps the slot's generation.)  Replica 1 routes an attempt on rk, replica 2
 * mirrors it; then replica 2 itself ends rk's life as its predicted cache knows it (how: 0 a
 * reset keeping the incarnation, 1 a capacity change to a new incarnation, 2 a removal and
 * re-add).  Replica 1 hears the change, its shard ends the attempt and tells it as an ABORT
 * (KVR_OP_RANK_ENDED), which reaches replica 2 only after its own change: its journal (what its
 * snapshots serve joiners) must not take the ended attempt's blocks, which its router no longer
 * predicts.  A joiner served by replica 2 then predicts what replica 2's router does. */
static void change_on_the_mirror(int how)
{
	struct kvr_router *r[3];
	bus_start(r, 2);
	const struct kvr_rank_id rk = {1, 0};
	uint64_t gone = route_on(r[0], rk, 700 + (uint32_t)how);
	bus_quiet(r, 2);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 1, "replica 2 mirrors %u", (unsigned)st.mirrored);
	if (how == 0) {
		cr_assert_eq(kvr_rank_reset(r[1], rk, 7), 0);
	} else if (how == 1) {
		cr_assert_eq(kvr_rank_set_capacity(r[1], rk, 8, 1000), 0);
	} else {
		cr_assert_eq(kvr_rank_remove(r[1], rk), 0);
		cr_assert_eq(kvr_rank_add(r[1], rk, 7, 1000, 4096), 0);
	}
	bus_quiet(r, 2);
	nanosleep(&(struct timespec){0, 100000000}, NULL);
	bus_quiet(r, 2);
	cr_assert_eq(kvr_request_finish(r[0], gone), KVR_ESTALE, "the change did not end it");
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 0, "replica 2 still mirrors %u", (unsigned)st.mirrored);
	size_t here = n_blocks(r[1], rk), origin = n_blocks(r[0], rk);
	bool in_journal = journaled(1, rk, 1, gone);
	r[2] = make();
	bus_attach(2, r[2]);
	bus_quiet(r, 3);
	size_t joiner = n_blocks(r[2], rk);
	cr_log_info("how %d: blocks replica1 %zu replica2 %zu joiner %zu; journaled on 2: %d", how,
	            origin, here, joiner, in_journal);
	cr_expect(!in_journal, "how %d: replica 2 journaled the attempt its own change ended", how);
	cr_expect_eq(joiner, here,
	             "how %d: the joiner predicts %zu blocks on the rank, replica 2's router %zu",
	             how, joiner, here);
	bus_teardown(r, 3);
}

Test(replica_ranks, a_mirror_ended_by_a_reset_made_here_is_not_journaled, .timeout = 60)
{
	change_on_the_mirror(0);
}

Test(replica_ranks, a_mirror_ended_by_a_new_incarnation_made_here_is_not_journaled, .timeout = 60)
{
	change_on_the_mirror(1);
}

Test(replica_ranks, a_mirror_ended_by_a_removal_and_readd_made_here_is_not_journaled, .timeout = 60)
{
	change_on_the_mirror(2);
}

/* (The review's probe of the first version of this fix, which compared the record's life with
 * the table entry's, and dropped these.)  Own rank notes reach the table in the order they
 * are pushed, after the router's admin lock is released, so one thread's add note can come
 * after another thread's remove and re-add of the same rank (the first thread preempted between
 * its add and its note).  The gate holds the next ADD note in the hook, as such a preemption
 * would. */
static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool hold_add, held, release;
	struct kvr_repl_hooks *orig;
	struct kvr_repl_hooks wrap;
} gate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void gated_rank_changed(void *ctx, int op, struct kvr_rank_id rank, uint64_t inc,
                               uint64_t cap, uint32_t mbt, struct kvr_rank_life life)
{
	pthread_mutex_lock(&gate.mu);
	if (op == KVR_REPL_RANK_ADD && gate.hold_add) {
		gate.hold_add = false;
		gate.held = true;
		pthread_cond_broadcast(&gate.cv);
		while (!gate.release)
			pthread_cond_wait(&gate.cv, &gate.mu);
	}
	pthread_mutex_unlock(&gate.mu);
	gate.orig->rank_changed(ctx, op, rank, inc, cap, mbt, life);
}

static uint64_t gated_worker = 1; /* the worker gated_add adds */

static void *gated_add(void *arg)
{
	return (void *)(intptr_t)kvr_rank_add(arg, (struct kvr_rank_id){gated_worker, 0}, 7, 1000,
	                                      4096);
}

/* Adds worker w on r from another thread, its ADD note held in the hook until gate_release. */
static pthread_t gate_add(struct kvr_router *r, uint64_t w)
{
	gated_worker = w;
	gate.orig = __atomic_load_n(&r->repl, __ATOMIC_ACQUIRE);
	cr_assert(gate.orig);
	gate.wrap = *gate.orig;
	gate.wrap.rank_changed = gated_rank_changed;
	gate.held = gate.release = false;
	__atomic_store_n(&r->repl, &gate.wrap, __ATOMIC_RELEASE);
	gate.hold_add = true;
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, gated_add, r), 0);
	pthread_mutex_lock(&gate.mu);
	while (!gate.held)
		pthread_cond_wait(&gate.cv, &gate.mu);
	pthread_mutex_unlock(&gate.mu);
	return t;
}

/* Lets the held ADD note go; the add returned 0. */
static void gate_release(struct kvr_router *r, pthread_t t)
{
	pthread_mutex_lock(&gate.mu);
	gate.release = true;
	pthread_cond_broadcast(&gate.cv);
	pthread_mutex_unlock(&gate.mu);
	void *rc;
	cr_assert_eq(pthread_join(t, &rc), 0);
	cr_assert_eq((intptr_t)rc, 0);
	__atomic_store_n(&r->repl, gate.orig, __ATOMIC_RELEASE);
}

/* One thread adds rank 1 (its note held), another removes it and adds it back (same
 * incarnation) meanwhile; then the held note goes.  The router holds the rank's latest life:
 * attempts finished on it, own and mirrored, must join the rank's journal. */
Test(replica_ranks, a_late_own_add_note_does_not_keep_finished_attempts_out_of_the_journal,
     .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const struct kvr_rank_id rk = {1, 0};
	cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
	pthread_t t = gate_add(r[0], rk.worker_id);
	cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
	cr_assert_eq(kvr_rank_add(r[0], rk, 7, 1000, 4096), 0);
	gate_release(r[0], t);
	bus_quiet(r, 1);
	/* an own attempt on the rank's life now, finished */
	uint64_t own = route_on(r[0], rk, 900);
	cr_assert_eq(kvr_request_finish(r[0], own), 0);
	/* a peer's, mirrored, finished */
	struct kvr_config g;
	kvr_router_get_config(r[0], &g);
	struct kvr_msg_buf b = {0};
	kvr_test_put_attempt(&b, KVR_MSG_ADMIT, 5, 100, 1, 31, rk.worker_id, 7, 31, g.block_size);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
	peer_end(rep, 2, KVR_MSG_FINISH, 31);
	bus_quiet(r, 1);
	uint32_t slot;
	uint64_t gen;
	cr_assert_eq(kvr_repl_rank_life(r[0], rk, &slot, &gen), 0);
	pthread_mutex_lock(&rep->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, rk);
	cr_assert(e, "no entry for the rank");
	struct kvr_rank_life el = e->life;
	uint64_t inc = e->incarnation;
	pthread_mutex_unlock(&rep->mu);
	cr_log_info("router life (%u, %lu); entry life (%u, %lu), incarnation %lu", slot,
	            (unsigned long)gen, el.slot, (unsigned long)el.gen, (unsigned long)inc);
	cr_expect(journaled(0, rk, 1, own),
	          "the own attempt finished on the rank was not journaled");
	cr_expect(journaled(0, rk, 5, 31),
	          "the peer's attempt finished on the rank was not journaled");
	bus_teardown(r, 1);
}

/* (The review's probe of the second version of this fix, which read the mark of the rank's
 * entry: one not made yet read 0, and every entry's making took a new mark.)  A new worker:
 * this router adds rank 9 (its ADD note held in the hook, as a preempted adder's is, or just
 * not yet taken by the sender), and a peer's admission on the rank arrives meanwhile; it is
 * booked on the rank's only life, which the note then names.  Finished after, it must join the
 * journal: no clear of the journal came between its booking and its end.  (A rank removed
 * here before and added back is another matter: its entry, made from the tombstone, is a new
 * life, and a mirror booked on it before the ADD's note came joins no journal: a prediction
 * missing, kvr_rep_journal_add.) */
Test(replica_ranks, a_mirror_booked_on_a_new_rank_before_its_add_note_is_journaled, .timeout = 60)
{
	struct kvr_router *r[1];
	bus_start(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const struct kvr_rank_id rk = {9, 0};
	pthread_t t = gate_add(r[0], rk.worker_id);
	cr_assert(has_rank(r[0], rk.worker_id));
	struct kvr_config g;
	kvr_router_get_config(r[0], &g);
	struct kvr_msg_buf b = {0};
	kvr_test_put_attempt(&b, KVR_MSG_ADMIT, 5, 100, 1, 41, rk.worker_id, 7, 41, g.block_size);
	cr_assert(!b.oom);
	kvr_replica_deliver(rep, b.p, b.len, NULL);
	kvr_msg_buf_fini(&b);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.mirrored, 1, "the admission was not booked (%u)", (unsigned)st.mirrored);
	gate_release(r[0], t);
	bus_quiet(r, 1);
	peer_end(rep, 2, KVR_MSG_FINISH, 41);
	cr_assert_eq(kvr_replica_drain(rep, 10000), 0);
	bus_quiet(r, 1);
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.mirrored, 0);
	cr_expect(journaled(0, rk, 5, 41),
	          "a mirror booked on the rank's only life and finished there was not journaled");
	bus_teardown(r, 1);
}

/* (The review's probe.)  A joiner: the snapshot's ranks, then their journals (ghosts)
 * and the live attempts; the live one finishing after must join the joiner's journal, as the
 * ghost did. */
Test(replica_ranks, a_joiners_mirrors_finished_after_the_snapshot_are_journaled, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 1);
	const struct kvr_rank_id rk = {1, 0};
	uint64_t done = route_on(r[0], rk, 811);
	cr_assert_eq(kvr_request_finish(r[0], done), 0);
	uint64_t live = route_on(r[0], rk, 812);
	bus_quiet(r, 1);
	r[1] = make();
	bus_attach(1, r[1]);
	bus_quiet(r, 2);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 1, "the joiner mirrors %u", (unsigned)st.mirrored);
	cr_assert_eq(kvr_request_finish(r[0], live), 0);
	bus_quiet(r, 2);
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 0);
	cr_expect(journaled(1, rk, 1, done), "the ghost was not journaled on the joiner");
	cr_expect(journaled(1, rk, 1, live),
	          "the live attempt finished after the snapshot was not journaled on the joiner");
	bus_teardown(r, 2);
}

/* (The review's probe of the second version of this fix, which exempted own attempts, saying
 * an own attempt's end is noted before the change that would end it; main had it too.)  A
 * caller's finish is noted after its lease claim and
 * post (core/lifecycle.c), with nothing ordering that note against another thread's reset
 * note: the finishing thread preempted between its post and its note (the gate holds the
 * FINISH note in the hook), the reset (rank's blocks dropped) is noted first and clears the
 * journal; the finish then joins the journal of the rank's new life with blocks nobody holds,
 * and a joiner served by this replica predicts them. */
static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	uint64_t hold;
	bool held, release;
	struct kvr_repl_hooks *orig;
	struct kvr_repl_hooks wrap;
} pgate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void gated_progressed(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n,
                             bool not_final)
{
	pthread_mutex_lock(&pgate.mu);
	if (op == KVR_OP_FINISH && attempt == pgate.hold) {
		pgate.hold = 0;
		pgate.held = true;
		pthread_cond_broadcast(&pgate.cv);
		while (!pgate.release)
			pthread_cond_wait(&pgate.cv, &pgate.mu);
	}
	pthread_mutex_unlock(&pgate.mu);
	pgate.orig->progressed(ctx, attempt, op, tokens, n, not_final);
}

struct finish_arg {
	struct kvr_router *r;
	uint64_t attempt;
};

static void *gated_finish(void *arg)
{
	struct finish_arg *f = arg;
	return (void *)(intptr_t)kvr_request_finish(f->r, f->attempt);
}

/* how: 0 a reset keeping the incarnation, 1 the rank removed and added back. */
static void own_finish_noted_after(int how)
{
	struct kvr_router *r[2];
	bus_start(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	const struct kvr_rank_id rk = {1, 0};
	uint64_t own = route_on(r[0], rk, 950);
	bus_quiet(r, 1);
	pgate.orig = __atomic_load_n(&r[0]->repl, __ATOMIC_ACQUIRE);
	cr_assert(pgate.orig);
	pgate.wrap = *pgate.orig;
	pgate.wrap.progressed = gated_progressed;
	pgate.hold = own;
	__atomic_store_n(&r[0]->repl, &pgate.wrap, __ATOMIC_RELEASE);
	struct finish_arg fa = {r[0], own};
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, gated_finish, &fa), 0);
	pthread_mutex_lock(&pgate.mu);
	while (!pgate.held)
		pthread_cond_wait(&pgate.cv, &pgate.mu);
	pthread_mutex_unlock(&pgate.mu);
	pthread_mutex_lock(&rep->mu);
	const uint64_t ver0 = kvr_rep_rank_find(rep, rk)->ver.clock;
	pthread_mutex_unlock(&rep->mu);
	if (how == 0) {
		cr_assert_eq(kvr_rank_reset(r[0], rk, 7), 0);
	} else {
		cr_assert_eq(kvr_rank_remove(r[0], rk), 0);
		cr_assert_eq(kvr_rank_add(r[0], rk, 7, 1000, 4096), 0);
	}
	/* the change's notes taken by the sender (the entry's journal cleared or made anew) */
	bool reset_seen = false;
	for (int i = 0; i < 500 && !reset_seen; i++) {
		pthread_mutex_lock(&rep->mu);
		const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, rk);
		reset_seen = e && e->ver.clock != ver0;
		pthread_mutex_unlock(&rep->mu);
		if (!reset_seen)
			nanosleep(&(struct timespec){0, 10000000}, NULL);
	}
	cr_assert(reset_seen, "the change's notes never reached the table");
	pthread_mutex_lock(&pgate.mu);
	pgate.release = true;
	pthread_cond_broadcast(&pgate.cv);
	pthread_mutex_unlock(&pgate.mu);
	void *rc;
	cr_assert_eq(pthread_join(t, &rc), 0);
	cr_assert_eq((intptr_t)rc, 0, "the finish lost to the reset (%d)", (int)(intptr_t)rc);
	__atomic_store_n(&r[0]->repl, pgate.orig, __ATOMIC_RELEASE);
	bus_quiet(r, 1);
	size_t here = n_blocks(r[0], rk);
	bool in_journal = journaled(0, rk, 1, own);
	r[1] = make();
	bus_attach(1, r[1]);
	bus_quiet(r, 2);
	size_t joiner = n_blocks(r[1], rk);
	cr_log_info("how %d: blocks: router %zu, joiner %zu; journaled: %d", how, here, joiner,
	            in_journal);
	cr_expect(!in_journal,
	          "how %d: the own attempt finished on the rank's old life joined the "
	          "journal of its life after the change",
	          how);
	cr_expect_eq(joiner, here,
	             "how %d: the joiner predicts %zu blocks on the rank, the router %zu", how,
	             joiner, here);
	bus_teardown(r, 2);
}

Test(replica_ranks, an_own_finish_noted_after_a_reset_is_not_journaled, .timeout = 60)
{
	own_finish_noted_after(0);
}

Test(replica_ranks, an_own_finish_noted_after_a_removal_and_readd_is_not_journaled, .timeout = 60)
{
	own_finish_noted_after(1);
}

/* (The review's probe.)  A resync (reconnect: a snapshot from a peer that lists the
 * rank as its add and its last reset, heard here already) and the origin's re-announce after
 * its own outage must not clear the journal under the mirrors: a live mirror finished after
 * them is journaled. */
Test(replica_ranks, mirrors_finished_after_a_resync_and_a_reannounce_are_journaled, .timeout = 60)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	const struct kvr_rank_id rk = {1, 0};
	cr_assert_eq(kvr_rank_reset(r[0], rk, 7), 0);
	cr_assert_eq(kvr_rank_set_capacity(r[0], rk, 7, 900), 0);
	bus_quiet(r, 2);
	uint64_t a = route_on(r[0], rk, 971), b2 = route_on(r[0], rk, 972);
	bus_quiet(r, 2);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 2);
	kvr_replica_reconnected(bus.rep[1]);
	wait_snapshots(1, st.snapshots_applied + 1);
	bus_quiet(r, 2);
	cr_assert_eq(kvr_request_finish(r[0], a), 0);
	bus_quiet(r, 2);
	kvr_replica_disconnected(bus.rep[0]);
	kvr_replica_reconnected(bus.rep[0]);
	bus_quiet(r, 2);
	nanosleep(&(struct timespec){0, 100000000}, NULL);
	bus_quiet(r, 2);
	cr_assert_eq(kvr_request_finish(r[0], b2), 0);
	bus_quiet(r, 2);
	kvr_replica_get_stats(bus.rep[1], &st);
	cr_assert_eq(st.mirrored, 0, "%u mirrors left", (unsigned)st.mirrored);
	cr_expect(journaled(1, rk, 1, a), "the mirror finished after the resync was not journaled");
	cr_expect(journaled(1, rk, 1, b2),
	          "the mirror finished after the origin's re-announce was not journaled");
	bus_teardown(r, 2);
}

/* The review's probe: the rank table against a model with more ids than the
 * index model (the index wraps, doubles and halves several times), single and persistent
 * allocation failures, and stricter checks at every step: what kvr_rep_ranks_bytes counts is
 * exactly what the table holds through the allocator (kvr_alloc_live_bytes, this process's only
 * allocating thread); a failed get changes no entry or tombstone; a removal (a drop, a
 * tombstone forgotten, the burial of a held rank) succeeds with every allocation failing; the
 * entries' and tombstones' contents (an incarnation, a version) follow them through the moves;
 * a journal's records stay with their rank. */
static void table_probe(uint64_t seed, int ids, int ops)
{
	struct kvr_replica *rep = kvr_calloc(1, sizeof(*rep));
	cr_assert(rep);
	rep->bs = 16;
	rep->c.journal_blocks = 30;
	const int64_t base = kvr_alloc_live_bytes();
	unsigned char *st = calloc((size_t)ids, 1);        /* 0 none, 1 rank, 2 tombstone */
	uint64_t *inc = calloc((size_t)ids, sizeof(*inc)); /* the entry's incarnation */
	uint64_t *ver = calloc((size_t)ids, sizeof(*ver)); /* the tombstone's version clock */
	cr_assert(st && inc && ver);
	uint64_t x = seed;
	for (int op = 0; op < ops; op++) {
		const bool grow = (op / (ops / 8)) % 2 == 0;
		uint32_t k = (uint32_t)(xorshift64(&x) % (uint64_t)ids),
		         what = (uint32_t)(xorshift64(&x) % 10);
		/* ids that differ in high bits only, as worker ids k << 40 */
		struct kvr_rank_id id = {((uint64_t)(k / 2) << 40) | 1, k % 2};
		const uint32_t fail = (uint32_t)(xorshift64(&x) % 6);
		const size_t n_ranks0 = rep->n_ranks, n_tombs0 = rep->n_tombs;
		if (what < (grow ? 5u : 2u)) {
			if (fail == 1)
				kvr_alloc_fail_after(1 + xorshift64(&x) % 3);
			else if (fail == 2)
				kvr_alloc_fail_from(1 + xorshift64(&x) % 3);
			struct kvr_rep_rank *e = kvr_rep_rank_get(rep, id);
			kvr_alloc_fail_after(0);
			cr_assert(e || fail == 1 || fail == 2, "seed %#lx op %d: get",
			          (unsigned long)seed, op);
			if (e) {
				if (st[k] == 2) /* back from its tombstone: the version it had */
					cr_assert_eq(
					    e->ver.clock, ver[k],
					    "seed %#lx op %d: id %u back at %lu, buried at %lu",
					    (unsigned long)seed, op, k, (unsigned long)e->ver.clock,
					    (unsigned long)ver[k]);
				if (st[k] != 1) {
					e->incarnation = xorshift64(&x) | 1;
					inc[k] = e->incarnation;
				}
				st[k] = 1;
			} else {
				cr_assert_eq(rep->n_ranks, n_ranks0,
				             "seed %#lx op %d: a failed get", (unsigned long)seed,
				             op);
				cr_assert_eq(rep->n_tombs, n_tombs0,
				             "seed %#lx op %d: a failed get", (unsigned long)seed,
				             op);
			}
		} else if (what < 6) {
			kvr_alloc_fail_from(1); /* a removal needs no memory */
			kvr_rep_rank_drop(rep, id);
			kvr_alloc_fail_after(0);
			st[k] = st[k] == 1 ? 0 : st[k];
		} else if (what < 7) {
			const bool held = st[k] != 0;
			if (held || fail == 1)
				kvr_alloc_fail_from(1);
			const uint64_t clock = (uint64_t)op + 1;
			const bool kept =
			    kvr_rep_rank_bury(rep, id, (struct kvr_rep_ver){clock, 1}, 7, NULL);
			kvr_alloc_fail_after(0);
			cr_assert(kept || (!held && fail == 1), "seed %#lx op %d: bury (held %d)",
			          (unsigned long)seed, op, held);
			if (kept) {
				/* a tombstone already there keeps the newer version: this one */
				ver[k] = clock;
				st[k] = 2;
			} else {
				st[k] = 0;
			}
		} else if (what < 8) {
			kvr_alloc_fail_from(1); /* forgetting needs no memory */
			kvr_rep_tomb_drop(rep, id);
			kvr_alloc_fail_after(0);
			st[k] = st[k] == 2 ? 0 : st[k];
		} else {
			if (fail == 1)
				kvr_alloc_fail_after(1 + xorshift64(&x) % 2);
			struct kvr_rep_rec *y = kvr_rep_rec_new((uint32_t)(xorshift64(&x) % 12),
			                                        (uint32_t)(xorshift64(&x) % 12));
			if (y) {
				y->rank = id;
				y->incarnation = inc[k];
				(void)kvr_rep_rec_reserve_out(y, xorshift64(&x) % 300);
				kvr_rep_journal_add(rep, y);
			}
			kvr_alloc_fail_after(0);
		}
		const int64_t live = kvr_alloc_live_bytes() - base;
		cr_assert_eq((int64_t)kvr_rep_ranks_bytes(rep), live,
		             "seed %#lx op %d: %lu bytes counted, %ld held through the allocator",
		             (unsigned long)seed, op, (unsigned long)kvr_rep_ranks_bytes(rep),
		             (long)live);
		size_t n = 0, nt = 0;
		for (int j = 0; j < ids; j++) {
			struct kvr_rank_id q = {((uint64_t)(j / 2) << 40) | 1, (uint32_t)j % 2};
			const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, q);
			const struct kvr_rep_tomb *t = kvr_rep_tomb_find(rep, q);
			cr_assert_eq(e != NULL, st[j] == 1, "seed %#lx op %d: id %d entry",
			             (unsigned long)seed, op, j);
			cr_assert_eq(t != NULL, st[j] == 2, "seed %#lx op %d: id %d tombstone",
			             (unsigned long)seed, op, j);
			if (e) {
				cr_assert_eq(e->incarnation, inc[j],
				             "seed %#lx op %d: id %d's entry", (unsigned long)seed,
				             op, j);
				for (const struct kvr_rep_rec *r = e->jhead; r; r = r->next)
					cr_assert(r->rank.worker_id == q.worker_id &&
					              r->rank.dp_rank == q.dp_rank &&
					              r->incarnation == inc[j],
					          "seed %#lx op %d: id %d's journal holds "
					          "another's record",
					          (unsigned long)seed, op, j);
			}
			if (t)
				cr_assert_eq(t->ver.clock, ver[j],
				             "seed %#lx op %d: id %d's tombstone",
				             (unsigned long)seed, op, j);
			n += st[j] == 1;
			nt += st[j] == 2;
		}
		cr_assert_eq(rep->n_ranks, n);
		cr_assert_eq(rep->n_tombs, nt);
		cr_assert_leq(2 * (rep->n_tombs + rep->n_ranks), rep->tix.cap,
		              "seed %#lx op %d: %zu tombstones and %zu entries, %zu index slots",
		              (unsigned long)seed, op, rep->n_tombs, rep->n_ranks, rep->tix.cap);
		cr_assert_leq(rep->n_tombs + rep->n_ranks, rep->tombs_cap);
	}
	for (int j = 0; j < ids; j++) {
		struct kvr_rank_id q = {((uint64_t)(j / 2) << 40) | 1, (uint32_t)j % 2};
		kvr_rep_rank_drop(rep, q);
		kvr_rep_tomb_drop(rep, q);
	}
	cr_assert_eq(kvr_rep_ranks_bytes(rep), 0);
	cr_assert_eq(kvr_alloc_live_bytes(), base, "emptied, %ld bytes held still",
	             (long)(kvr_alloc_live_bytes() - base));
	kvr_free(rep, sizeof(*rep));
	free(st);
	free(inc);
	free(ver);
}

Test(replica_ranks, table_against_model_small, .timeout = 120)
{
	for (uint64_t seed = 1; seed <= 6; seed++)
		table_probe(0x9e3779b97f4a7c15ull * seed, 40, 16000);
}

Test(replica_ranks, table_against_model_large, .timeout = 300)
{
	for (uint64_t seed = 1; seed <= 2; seed++)
		table_probe(0xc2b2ae3d27d4eb4full * seed, 2000, 24000);
}

/* Replica i's count of its journals (kvr_rep_ranks_bytes less the arrays) against a walk of
 * them, read at once under mu. */
static uint64_t probe_max_walked[2];

static void journals_count_matches(int i, int op)
{
	struct kvr_replica *rep = bus.rep[i];
	pthread_mutex_lock(&rep->mu);
	const uint64_t counted = kvr_rep_ranks_bytes(rep) - arrays_of(rep),
	               walked = journals_walked(rep);
	pthread_mutex_unlock(&rep->mu);
	if (walked > probe_max_walked[i])
		probe_max_walked[i] = walked;
	cr_assert_eq(counted, walked, "op %d: replica %d counts %lu bytes of journals, holds %lu",
	             op, i, (unsigned long)counted, (unsigned long)walked);
}

/* The review's probe: the journals' count against a walk on two live replicas
 * under random own attempts on both routers (output in several calls, finishes and aborts:
 * journaled on the origin and mirrored on the peer), with small journal budgets (trims), resets,
 * new incarnations, removals and re-adds: every path where a record joins or leaves a journal,
 * the apply thread's included, checked after every call and once the bus is quiet. */
Test(replica_ranks, journals_count_under_random_traffic, .timeout = 240)
{
	struct kvr_router *r[2];
	bus_start(r, 2);
	bus_quiet(r, 2);
	uint64_t inc[2] = {7, 7};
	bool present[2] = {true, true};
	for (int w = 0; w < 2; w++)
		cr_assert_eq(
		    kvr_rank_set_capacity(r[0], (struct kvr_rank_id){(uint64_t)w, 0}, 7, 12), 0);
	bus_quiet(r, 2);
	enum { LIVE = 16, OPS = 3000 };
	uint64_t live[2][LIVE];
	size_t n_live[2] = {0, 0};
	uint64_t x = 0x1234567ull;
	for (int op = 0; op < OPS; op++) {
		const int i = (int)(xorshift64(&x) % 2);
		const uint32_t what = (uint32_t)(xorshift64(&x) % 100);
		const int w = (int)(xorshift64(&x) % 2);
		const struct kvr_rank_id rk = {(uint64_t)w, 0};
		if (what < 30) {
			if (n_live[i] == LIVE || !present[w])
				continue;
			uint32_t t[64];
			for (int j = 0; j < 64; j++)
				t[j] = (uint32_t)(xorshift64(&x) % 50) + (uint32_t)j * 1000u;
			struct kvr_request q;
			kvr_request_init(&q);
			q.tokens = t;
			q.n_tokens = 16 * (1 + xorshift64(&x) % 4);
			q.pinned = &rk;
			struct kvr_decision d;
			if (kvr_route(r[i], &q, &d) == 0 && d.status == KVR_DECIDED)
				live[i][n_live[i]++] = d.attempt;
		} else if (what < 60) {
			if (!n_live[i])
				continue;
			uint32_t out[300];
			size_t n = 1 + xorshift64(&x) % 300;
			for (size_t j = 0; j < n; j++)
				out[j] = (uint32_t)(xorshift64(&x));
			(void)kvr_request_output(r[i], live[i][xorshift64(&x) % n_live[i]], out, n);
		} else if (what < 88) {
			if (!n_live[i])
				continue;
			size_t k = xorshift64(&x) % n_live[i];
			uint64_t a = live[i][k];
			live[i][k] = live[i][--n_live[i]];
			(void)(what % 3 ? kvr_request_finish(r[i], a) : kvr_request_abort(r[i], a));
		} else if (what < 92) {
			if (present[w])
				(void)kvr_rank_reset(r[0], rk, ++inc[w]);
		} else if (what < 95) {
			if (present[w])
				(void)kvr_rank_set_capacity(r[0], rk, ++inc[w],
				                            4 + xorshift64(&x) % 30);
		} else if (what < 98) {
			if (present[w] && kvr_rank_remove(r[0], rk) == 0)
				present[w] = false;
		} else if (!present[w]) {
			if (kvr_rank_add(r[0], rk, ++inc[w], 4 + xorshift64(&x) % 30, 4096) == 0)
				present[w] = true;
		}
		if (what >= 88)
			bus_quiet(r, 2); /* both routers agree on the ranks before the next route */
		for (int j = 0; j < 2; j++)
			journals_count_matches(j, op);
	}
	for (int i = 0; i < 2; i++)
		while (n_live[i])
			(void)kvr_request_finish(r[i], live[i][--n_live[i]]);
	bus_quiet(r, 2);
	for (int j = 0; j < 2; j++)
		journals_count_matches(j, OPS);
	cr_log_info("journals held at most %lu and %lu bytes", (unsigned long)probe_max_walked[0],
	            (unsigned long)probe_max_walked[1]);
	cr_assert_gt(probe_max_walked[0], 0);
	cr_assert_gt(probe_max_walked[1], 0);
	bus_teardown(r, 2);
}
