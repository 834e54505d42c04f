/*
 * A snapshot request sent again while nobody answered (the transport's hedge, sync/replica.h):
 * several providers may then answer the same reply inbox, their replies interleaved.  The
 * asker takes the first provider that answered, whole, and ignores the others' replies, a
 * decline included.
 *
 * The replies are scripted here, in the order a transport could hand them over (each provider's
 * own in order, the providers' mixed), through a transport that plays them to on_chunk.
 */
#include "tests/common/replica_wire.h"
#include "tests/unit/replica_bus.h"

enum { SELF = 1, P = 5, Q = 9, MAX_SCRIPT = 8 };

/* The replies the next request gets, in order; none: no peer. */
static struct kvr_msg_buf script[MAX_SCRIPT];
static size_t n_script;
static unsigned played; /* requests that played the script to the end or were ended by it */

static int h_publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx, (void)buf, (void)len;
	return 0;
}

static int h_reply(void *ctx, const char *to, const void *buf, size_t len)
{
	(void)ctx, (void)to, (void)buf, (void)len;
	return 0;
}

static int h_request(void *ctx, const void *req, size_t len, uint64_t timeout_ns, uint64_t hedge_ns,
                     int (*on_chunk)(void *cb, const void *buf, size_t len), bool (*poll)(void *cb),
                     void *cb)
{
	(void)ctx, (void)req, (void)len, (void)timeout_ns, (void)hedge_ns, (void)poll;
	size_t n = __atomic_load_n(&n_script, __ATOMIC_ACQUIRE);
	if (!n)
		return KVR_ENOENT;
	/* A decline with more of the script to come: a copy was declined, others are out. */
	int rc = KVR_ETIMEDOUT;
	for (size_t i = 0; i < n; i++) {
		int r = on_chunk(cb, script[i].p, script[i].len);
		if (r == KVR_REP_CHUNK_MORE || r == KVR_REP_CHUNK_IGNORED ||
		    (r == KVR_REP_CHUNK_DECLINED && i + 1 < n))
			continue;
		rc = r == KVR_REP_CHUNK_LAST ? 0 : r == KVR_REP_CHUNK_DECLINED ? KVR_EAGAIN : r;
		break;
	}
	__atomic_add_fetch(&played, 1, __ATOMIC_RELEASE);
	return rc;
}

static void put_chunk(struct kvr_msg_buf *b, uint64_t from, uint64_t epoch, uint32_t chunk,
                      uint32_t flags, const struct kvr_msg_buf *recs, uint32_t n)
{
	kvr_test_put_chunk(b, from, epoch, chunk, flags, recs, n);
	cr_assert(!b->oom);
}

/* Provider `from`'s snapshot in two chunks: its fence, then a RANK add of worker w (the last). */
static void put_snapshot(struct kvr_msg_buf *c0, struct kvr_msg_buf *c1, uint64_t from, uint64_t w)
{
	struct kvr_msg_buf recs = {0}, rec = {0};
	kvr_test_put_fence(&rec, from, 300, from, 300, 0);
	kvr_test_put_record(&recs, &rec);
	put_chunk(c0, from, 300, 0, 0, &recs, 1);
	recs.len = rec.len = 0;
	kvr_test_put_rank(&rec, from, 300, 0, w);
	kvr_test_put_record(&recs, &rec);
	put_chunk(c1, from, 300, 1, KVR_MSG_CHUNK_LAST, &recs, 1);
	cr_assert(!recs.oom && !rec.oom);
	kvr_msg_buf_fini(&recs);
	kvr_msg_buf_fini(&rec);
}

static struct kvr_sync_stats h_stats(struct kvr_replica *rep)
{
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	return st;
}

static bool has_worker(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	return kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s) == 0;
}

/* A replica alone (no peer at its start), then cut off and back: its resync gets the script.
 * Returns once that resync ended (the script played, and the resync either applied a
 * snapshot or gave up). */
static void resync_with_script(struct kvr_router **r, struct kvr_replica **rep)
{
	*r = bus_ranks_router();
	struct kvr_replica_config c = {.replica_id = SELF,
	                               .heartbeat_ms = 50,
	                               .dead_after = 1000,
	                               .snapshot_timeout_ms = 1000};
	struct kvr_replica_transport t = {
	    .publish = h_publish, .reply = h_reply, .request = h_request};
	size_t n = n_script;
	__atomic_store_n(&n_script, 0, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_replica_create(*r, &c, &t, rep), 0);
	cr_assert_eq(kvr_replica_start(*rep), 0);
	cr_assert_eq(kvr_replica_wait_ready(*rep, 10000), 0);
	__atomic_store_n(&n_script, n, __ATOMIC_RELEASE);
	const uint64_t before = h_stats(*rep).resyncs;
	kvr_replica_disconnected(*rep);
	kvr_replica_reconnected(*rep);
	/* Played once; a resync given up on a bad chunk is not asked again. */
	for (int i = 0; i < 300 && !__atomic_load_n(&played, __ATOMIC_ACQUIRE); i++)
		nanosleep(&(struct timespec){0, 10000000}, NULL);
	cr_assert_gt(__atomic_load_n(&played, __ATOMIC_ACQUIRE), 0, "the resync never asked");
	for (int i = 0; i < 300 && h_stats(*rep).snapshots_applied == 0; i++)
		nanosleep(&(struct timespec){0, 10000000}, NULL);
	cr_assert_gt(h_stats(*rep).resyncs, before);
}

static void done(struct kvr_router *r, struct kvr_replica *rep)
{
	kvr_replica_stop(rep);
	kvr_replica_destroy(rep);
	kvr_router_destroy(r);
	for (size_t i = 0; i < MAX_SCRIPT; i++)
		kvr_msg_buf_fini(&script[i]);
	n_script = 0;
	played = 0;
}

/* P answers the request; the copy sent again reached a twin under our own id, which declines
 * it (sync/replica_apply.c), its decline between P's chunks.  The decline was taken for a
 * chunk out of place: the resync ended with KVR_EINVAL, P's snapshot not applied, and the
 * resync not asked again (a bad chunk ends it). */
Test(replica_hedge, a_twins_decline_between_the_providers_chunks_is_ignored, .timeout = 60)
{
	put_snapshot(&script[0], &script[2], P, 77);
	put_chunk(&script[1], SELF, 400, 0, KVR_MSG_CHUNK_GIVEN_UP, NULL, 0);
	n_script = 3;
	struct kvr_router *r;
	struct kvr_replica *rep;
	resync_with_script(&r, &rep);
	struct kvr_sync_stats st = h_stats(rep);
	cr_assert_eq(st.snapshots_applied, 1,
	             "P's snapshot not applied: the twin's decline of the hedged copy ended it");
	cr_assert_eq(st.dropped, 0, "the twin's decline counted as dropped");
	cr_assert(has_worker(r, 77), "P's rank missing");
	done(r, rep);
}

/* P answers; Q, reached by the copy sent again, declines as resyncing itself between P's
 * chunks: ignored, P's snapshot applied. */
Test(replica_hedge, another_providers_decline_between_the_chunks_is_ignored, .timeout = 60)
{
	put_snapshot(&script[0], &script[2], P, 77);
	put_chunk(&script[1], Q, 300, 0, KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING, NULL, 0);
	n_script = 3;
	struct kvr_router *r;
	struct kvr_replica *rep;
	resync_with_script(&r, &rep);
	struct kvr_sync_stats st = h_stats(rep);
	cr_assert_eq(st.snapshots_applied, 1);
	cr_assert_eq(st.dropped, 0);
	cr_assert(has_worker(r, 77));
	done(r, rep);
}

/* P and Q both answer, their chunks interleaved: P's snapshot, whole, is applied, none of Q's
 * (Q's last chunk, ahead of P's, does not end the collection; Q's rank is not taken). */
Test(replica_hedge, two_providers_chunks_are_not_mixed, .timeout = 60)
{
	put_snapshot(&script[0], &script[3], P, 77);
	put_snapshot(&script[1], &script[2], Q, 99);
	n_script = 4;
	struct kvr_router *r;
	struct kvr_replica *rep;
	resync_with_script(&r, &rep);
	struct kvr_sync_stats st = h_stats(rep);
	cr_assert_eq(st.snapshots_applied, 1);
	cr_assert(has_worker(r, 77), "P's rank missing");
	cr_assert(!has_worker(r, 99), "Q's rank taken from a snapshot that was not applied");
	done(r, rep);
}

/* Q, reached by one copy, declines as resyncing itself before P, reached by another, answers:
 * the transport waits on (a copy is still out), and P's snapshot is applied.  Before, the
 * decline ended the request and P's answer was lost, request after request (test_replica_serve
 * a_quick_decline_does_not_lose_a_slower_settled_providers_answer over the bus). */
Test(replica_hedge, a_decline_while_another_copy_is_out_does_not_end_the_request, .timeout = 60)
{
	put_chunk(&script[0], Q, 300, 0, KVR_MSG_CHUNK_GIVEN_UP | KVR_MSG_CHUNK_RESYNCING, NULL, 0);
	put_snapshot(&script[1], &script[2], P, 77);
	n_script = 3;
	struct kvr_router *r;
	struct kvr_replica *rep;
	resync_with_script(&r, &rep);
	struct kvr_sync_stats st = h_stats(rep);
	cr_assert_eq(st.snapshots_applied, 1, "P's snapshot not applied after Q's decline");
	cr_assert_eq(st.dropped, 0);
	cr_assert(has_worker(r, 77));
	done(r, rep);
}

/* P, taken, gives its snapshot up after its first chunk (it could not build the rest: a
 * given-up chunk numbered 1, kvr_rep_serve_snapshot).  The request ends and the snapshot is
 * asked for again.  Before, the given-up chunk was taken for the snapshot's next chunk and the
 * request waited on for one that never came (over NATS or the bus: its whole timeout), nothing
 * applied and not asked again. */
Test(replica_hedge, a_providers_give_up_after_its_first_chunk_ends_the_request, .timeout = 60)
{
	struct kvr_msg_buf last = {0};
	put_snapshot(&script[0], &last, P, 77);
	kvr_msg_buf_fini(&last);
	put_chunk(&script[1], P, 300, 1, KVR_MSG_CHUNK_GIVEN_UP, NULL, 0);
	n_script = 2;
	struct kvr_router *r;
	struct kvr_replica *rep;
	resync_with_script(&r, &rep);
	struct kvr_sync_stats st = h_stats(rep);
	cr_assert_eq(st.snapshots_applied, 0);
	cr_assert_gt(__atomic_load_n(&played, __ATOMIC_ACQUIRE), 1,
	             "the snapshot given up after its first chunk was not asked for again");
	cr_assert(!has_worker(r, 77));
	done(r, rep);
}
