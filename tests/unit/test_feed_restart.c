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
