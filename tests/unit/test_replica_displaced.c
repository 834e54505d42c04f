/*
 * Two replicas under one id (kvr_sync_stats.displaced), over the in-process bus
 * (tests/unit/replica_bus.h): the id given again while its holder reconnected, which
 * kvr_sync_attach cannot see (tests/sync/test_sync_displaced.c makes that case over a real
 * server).  Peers follow the newer life, so the older replica's decisions reach nobody: it
 * reports displaced, the newer one does not, and a snapshot request under the id is declined
 * at once (a given-up chunk) instead of being dropped, which left its asker waiting out
 * snapshot_timeout_ms.  The newer one's goodbye ends it.
 */
#include "sync/replica_msg.h"
#include "tests/unit/replica_bus.h"

static struct kvr_sync_stats stats(int i)
{
	struct kvr_sync_stats s;
	kvr_replica_get_stats(bus.rep[i], &s);
	return s;
}

static bool wait_displaced(int i, bool want)
{
	for (int k = 0; k < 300 && stats(i).displaced != want; k++) {
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	return stats(i).displaced == want;
}

Test(replica_displaced, the_older_life_of_an_id_says_so, .timeout = 60)
{
	struct kvr_router *r[3];
	bus_start(r, 2); /* A: replica 1 on port 0; C: replica 2 on port 1 */
	struct timespec ts = {0, 2 * 1000 * 1000};
	nanosleep(&ts, NULL); /* B's epoch (the wall clock at its creation) is A's + 2 ms */
	r[2] = bus_ranks_router();
	bus_create_as(2, r[2], 1); /* B: replica 1 again, on port 2 */
	bus_start_one(2);

	cr_assert(wait_displaced(0, true), "A never said it was displaced");
	struct kvr_sync_stats a = stats(0), b = stats(2);
	cr_assert_eq(a.displacements, 1);
	cr_assert(!b.displaced && b.displacements == 0, "B displaced %d", b.displaced);
	cr_assert(!stats(1).displaced, "C has an id of its own");
	for (int k = 0; k < 300 && stats(2).forged == 0; k++)
		nanosleep(&ts, NULL);
	cr_assert_gt(stats(2).forged, 0, "B heard A under its id");
	uint64_t metric_b = metric(r[0], "kvr_sync_displaced ");
	cr_assert_eq(metric_b, 1, "the gauge");

	/* A snapshot request under B's id, delivered to B with a reply inbox: declined at once. */
	struct kvr_msg_buf req = {0};
	size_t off = kvr_msg_begin(&req, KVR_MSG_SNAP_REQ, 1, 5, 0);
	kvr_msg_put_u64(&req, 0);
	kvr_msg_end(&req, off);
	cr_assert(!req.oom);
	kvr_replica_deliver(bus.rep[2], req.p, req.len, "0");
	struct bus_chunk *ch = NULL;
	for (int k = 0; k < 300 && !ch; k++)
		ch = bus_take(0);
	cr_assert_not_null(ch, "no answer to the request under B's own id");
	struct kvr_wmsg m;
	cr_assert_eq(kvr_msg_decode(ch->data, ch->len, &m), 0);
	cr_assert(m.h.type == KVR_MSG_SNAP_CHUNK && m.h.replica == 1 && m.chunk == 0 &&
	              (m.chunk_flags & KVR_MSG_CHUNK_GIVEN_UP),
	          "type %u replica %lu chunk %u flags %x", m.h.type, (unsigned long)m.h.replica,
	          m.chunk, m.chunk_flags);
	free(ch);
	kvr_msg_buf_fini(&req);

	/* B leaves (its goodbye): A is no longer displaced. */
	kvr_replica_stop(bus.rep[2]);
	cr_assert(wait_displaced(0, false), "A still displaced after B's goodbye");
	cr_assert_eq(stats(0).displacements, 1);
	kvr_replica_destroy(bus.rep[2]);
	bus.rep[2] = NULL;
	kvr_router_destroy(r[2]);
	bus_teardown(r, 2);
}
