/*
 * A publisher restarted while a replay had run ahead of the live stream.  The feed healed a gap
 * by replaying seq 1..5 of the old stream, whose live copies of 3..5 never came (next_seq 6,
 * last live seq 2).  Then the publisher dies and a new one on the same address counts from 0;
 * the first of its batches the feed sees after reconnecting is seq 4, between the last live seq
 * and next_seq.  Before, that was taken for a duplicate of the replayed seq 4: no restart, the
 * old stream's blocks kept, and the new stream's later batches applied on top of them.  After a
 * reconnection, any first seq but next_seq is a new publisher: the rank is cleared.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"

/* A batch storing one root block named h (its tokens from h). */
static void one_block(struct kvr_fenc *e, uint64_t h)
{
	static uint64_t hh;
	hh = h;
	kvr_fenc_begin(e, 1.0, 1);
	kvr_fenc_stored(e, &hh, 1, NULL, 16, test_block_tokens, &hh);
	kvr_fenc_end(e, 0);
}

static void send_block(void *pub, struct kvr_fenc *e, uint64_t seq, uint64_t h)
{
	one_block(e, h);
	cr_assert_eq(kvr_fenc_send(pub, seq, e->sb.data, e->sb.size), 0);
}

/* The replay answer: the old stream's batches from..to, then the end marker. */
static void answer(void *router, zmq_msg_t *asker, struct kvr_fenc *e, uint64_t from, uint64_t to)
{
	for (uint64_t s = from; s <= to + 1; s++) {
		zmq_msg_t id;
		zmq_msg_init(&id);
		zmq_msg_copy(&id, asker);
		zmq_msg_send(&id, router, ZMQ_SNDMORE);
		uint64_t seq = s <= to ? s : UINT64_MAX;
		uint8_t b[8];
		for (int i = 0; i < 8; i++)
			b[i] = (uint8_t)(seq >> (56 - 8 * i));
		zmq_send(router, "", 0, ZMQ_SNDMORE);
		zmq_send(router, b, 8, ZMQ_SNDMORE);
		if (s <= to) {
			one_block(e, 1000 + s);
			zmq_send(router, e->sb.data, e->sb.size, 0);
		} else {
			zmq_send(router, "", 0, 0);
		}
	}
}

static struct kvr_feed_stats stats(struct kvr_feed *f, uint32_t id)
{
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(f, id, &st), 0);
	return st;
}

Test(feed_restart, a_restart_below_a_replay_that_ran_ahead_is_a_restart, .timeout = 60)
{
	struct test_pub pub;
	test_pub_open(&pub);
	int zero = 0;
	zmq_setsockopt(pub.pub, ZMQ_LINGER, &zero, sizeof(zero));
	void *router = zmq_socket(pub.zctx, ZMQ_ROUTER);
	cr_assert_eq(zmq_bind(router, "tcp://127.0.0.1:*"), 0);
	char rep[256];
	size_t cap = sizeof(rep);
	cr_assert_eq(zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, rep, &cap), 0);
	int rto = 5000;
	zmq_setsockopt(router, ZMQ_RCVTIMEO, &rto, sizeof(rto));
	struct kvr_router *r = test_events_router(NULL);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = 5000;
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, &fc, &f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = pub.ep, .replay_endpoint = rep};
	uint32_t id;
	cr_assert_eq(kvr_feed_add(f, &fe, &id), 0);
	test_pub_subscribed(&pub);
	struct kvr_fenc e;
	kvr_fenc_init(&e);

	/* The old stream: seq 0 live, 1 lost, 2 live (a gap: the feed asks from 1), and the
	 * replay brings 1..5, ahead of the live stream. */
	send_block(pub.pub, &e, 0, 1000);
	send_block(pub.pub, &e, 2, 1002);
	zmq_msg_t asker;
	zmq_msg_init(&asker);
	cr_assert_geq(zmq_msg_recv(&asker, router, 0), 0, "the gap asks for a replay");
	uint8_t buf[16];
	cr_assert_eq(zmq_recv(router, buf, sizeof(buf), 0), 0);
	cr_assert_eq(zmq_recv(router, buf, sizeof(buf), 0), 8);
	answer(router, &asker, &e, 1, 5);
	struct kvr_feed_stats st = stats(f, id);
	cr_assert_eq(st.next_seq, 6);
	cr_assert_eq(test_indexed_blocks(r), 6, "the old stream's blocks 1000..1005");

	/* The publisher dies; a new one binds the same address and counts from 0, of which the
	 * feed sees 4 first (0..3 went out before it reconnected). */
	zmq_close(pub.pub);
	pub.pub = zmq_socket(pub.zctx, ZMQ_XPUB);
	zmq_setsockopt(pub.pub, ZMQ_LINGER, &zero, sizeof(zero));
	int bound = -1;
	for (int t = 0; t < 200 && bound != 0; t++)
		if ((bound = zmq_bind(pub.pub, pub.ep)) != 0)
			sleep_ms(10);
	cr_assert_eq(bound, 0);
	test_pub_subscribed(&pub); /* the feed reconnected */
	send_block(pub.pub, &e, 4, 2004);
	/* The restart asks for the new stream from 0: its buffer holds what the new engine
	 * stored (2004 only, here). */
	zmq_msg_close(&asker);
	zmq_msg_init(&asker);
	cr_assert_geq(zmq_msg_recv(&asker, router, 0), 0, "the restart asks for a replay");
	cr_assert_eq(zmq_recv(router, buf, sizeof(buf), 0), 0);
	cr_assert_eq(zmq_recv(router, buf, sizeof(buf), 0), 8);
	for (int i = 0; i < 8; i++)
		cr_assert_eq(buf[i], 0, "from seq 0");
	answer(router, &asker, &e, 5, 4); /* nothing before 4 in its buffer: the end marker */
	st = stats(f, id);
	cr_assert_eq(st.restarts, 1);
	cr_assert_eq(test_indexed_blocks(r), 1, "only the new engine's block 2004");

	zmq_msg_close(&asker);
	kvr_fenc_fini(&e);
	kvr_feed_destroy(f);
	kvr_router_destroy(r);
	zmq_close(router);
	test_pub_close(&pub);
}

/*
 * A restart the feed learns of late.  ZeroMQ keeps one queue per connect()ed endpoint across
 * its reconnections, so the old connection's last batches and the new one's first wait in the
 * same SUB socket, in order, and the disconnection comes on another socket (the monitor) with
 * no position in that queue.  Here the feed's thread is held in on_event_gap (a gap of the old
 * stream) while the old publisher dies and a new one, counting from 0 again, is reached: the
 * old stream's tail and the new stream's first batches (1000, 1001: 0..999 went out before the
 * feed reconnected) are queued behind each other.  Before, the feed read the monitor only
 * between drains: the new batches were taken for the old stream's (a gap, applied on its
 * blocks), no restart was counted, and the disconnection read afterwards made the new stream's
 * next gap a "restart".
 */
/* on_event_gap holds the feed's thread in its n-th call until pass >= n. */
static atomic_int calls, pass;

static void holding_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	int n = atomic_fetch_add(&calls, 1) + 1;
	while (atomic_load(&pass) < n)
		sleep_ms(1);
}

static void wait_held(int n)
{
	for (int t = 0; t < 1000 && atomic_load(&calls) < n; t++)
		sleep_ms(10);
	cr_assert_geq(atomic_load(&calls), n, "the feed's thread is held in on_event_gap");
}

static struct kvr_feed_stats stats_at(struct kvr_feed *f, uint32_t id, uint64_t next_seq)
{
	struct kvr_feed_stats st;
	for (int t = 0; t < 1000; t++) {
		st = stats(f, id);
		if (st.next_seq == next_seq)
			break;
		sleep_ms(10);
	}
	cr_assert_eq(st.next_seq, next_seq);
	return st;
}

Test(feed_restart, a_restart_queued_behind_the_old_streams_tail_is_a_restart, .timeout = 60)
{
	struct test_pub pub;
	test_pub_open(&pub);
	struct kvr_router *r = test_events_router(holding_gap);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	struct kvr_feed *f;
	cr_assert_eq(kvr_feed_create(r, &fc, &f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = pub.ep};
	uint32_t id;
	cr_assert_eq(kvr_feed_add(f, &fe, &id), 0);
	test_pub_subscribed(&pub);
	struct kvr_fenc e;
	kvr_fenc_init(&e);

	/* The old stream: 0, then 2 (a gap, no replay endpoint: reported) holds the thread. */
	send_block(pub.pub, &e, 0, 10000);
	stats_at(f, id, 1);
	send_block(pub.pub, &e, 2, 10002);
	wait_held(1);
	/* Meanwhile its tail, 3..300 but 150, is queued, and the publisher dies (its queue sent
	 * first: the default linger).  The gap at 150 holds the thread again. */
	for (uint64_t s = 3; s <= 300; s++)
		if (s != 150)
			send_block(pub.pub, &e, s, 10000 + s);
	zmq_close(pub.pub);
	sleep_ms(300); /* the feed's ZeroMQ has read it all, and the disconnection */
	atomic_store(&pass, 1);
	wait_held(2);
	/* A new publisher on the same address, counting from 0; the feed reconnects, and its
	 * batches 1000, 1001 are queued behind the old stream's tail (0..999 went out before). */
	pub.pub = zmq_socket(pub.zctx, ZMQ_XPUB);
	int bound = -1;
	for (int t = 0; t < 200 && bound != 0; t++)
		if ((bound = zmq_bind(pub.pub, pub.ep)) != 0)
			sleep_ms(10);
	cr_assert_eq(bound, 0);
	test_pub_subscribed(&pub);
	send_block(pub.pub, &e, 1000, 20000);
	send_block(pub.pub, &e, 1001, 20001);
	sleep_ms(100);
	atomic_store(&pass, 1000);

	struct kvr_feed_stats st = stats_at(f, id, 1002);
	uint64_t blocks = test_indexed_blocks(r);
	cr_assert_eq(st.restarts, 1,
	             "the new publisher is a restart (restarts %" PRIu64 ", %" PRIu64
	             " blocks indexed)",
	             st.restarts, blocks);
	cr_assert_eq(blocks, 2, "only the new stream's blocks 20000, 20001 (%" PRIu64 ")", blocks);
	uint64_t gaps = st.gaps;
	/* A later gap of the new stream is a gap, not another restart. */
	send_block(pub.pub, &e, 1003, 20003);
	st = stats_at(f, id, 1004);
	cr_assert_eq(st.restarts, 1, "one restart (%" PRIu64 ")", st.restarts);
	cr_assert_eq(st.gaps, gaps + 1, "a gap (%" PRIu64 " after %" PRIu64 ")", st.gaps, gaps);

	kvr_fenc_fini(&e);
	kvr_feed_destroy(f);
	kvr_router_destroy(r);
	test_pub_close(&pub);
}
