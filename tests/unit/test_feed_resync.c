/*
 * A rank added after its publisher started: the feed replays what it missed (kvr_feed_resync),
 * and the rank must end up holding a subset of its engine's cache, never more, whatever the
 * replay brings.  The engine here stores A (seq 0), removes A (seq 1) and stores B (seq 2): it
 * holds B.  Before, a replay that stalled or ended after seq 0, or skipped seq 1, left A indexed
 * (removed by the engine), the second with no gap reported.  Now a batch missing from the answer
 * is a hole: reported through on_event_gap, the rank cleared if it took batches before it, and
 * rebuilt from the batches after it - once the feed has asked again from the hole and the
 * publisher still lacks it (an answer that brought something and has a hole inside it, or ends
 * short, is asked for again: test_feed_replay_reask).
 *
 * The test answers the feed's replay requests itself (the feed's thread waits for the answer).
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"

static atomic_int gap_calls;
static uint64_t gap_from, gap_to; /* the last gap reported */
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp;
	gap_from = from;
	gap_to = to;
	atomic_fetch_add(&gap_calls, 1);
}

static const uint64_t A[2] = {0xa1, 0xa2}, B[3] = {0xb1, 0xb2, 0xb3};

struct world {
	struct test_pub pub;
	void *router;           /* the replay endpoint: the test answers it */
	struct kvr_fenc enc[3]; /* the batches of seq 0, 1, 2 */
	struct kvr_router *r;
	struct kvr_feed *f;
	uint32_t id;
	zmq_msg_t asker; /* the feed's DEALER identity, from its request */
};

/* The feed's next replay request (within 5 s), from seq from. */
static void asked(struct world *w, uint64_t from)
{
	int to = 5000;
	zmq_setsockopt(w->router, ZMQ_RCVTIMEO, &to, sizeof(to));
	zmq_msg_close(&w->asker);
	zmq_msg_init(&w->asker);
	cr_assert_geq(zmq_msg_recv(&w->asker, w->router, 0), 0,
	              "the feed asks for a replay from seq %" PRIu64, from);
	uint8_t empty[8], start[8];
	cr_assert_eq(zmq_recv(w->router, empty, sizeof(empty), 0), 0);
	cr_assert_eq(zmq_recv(w->router, start, sizeof(start), 0), 8);
	uint64_t got = 0;
	for (int i = 0; i < 8; i++)
		got = got << 8 | start[i];
	cr_assert_eq(got, from, "the replay is asked from seq %" PRIu64 ", not %" PRIu64, got,
	             from);
}

/* The three batches sent before rank (0, 0) exists, then the rank added; returns once the feed
 * asked for the replay from seq 0. */
static void setup(struct world *w, uint32_t replay_timeout_ms)
{
	atomic_store(&gap_calls, 0);
	test_pub_open(&w->pub);
	w->router = zmq_socket(w->pub.zctx, ZMQ_ROUTER);
	cr_assert_eq(zmq_bind(w->router, "tcp://127.0.0.1:*"), 0);
	char rep[256];
	size_t cap = sizeof(rep);
	cr_assert_eq(zmq_getsockopt(w->router, ZMQ_LAST_ENDPOINT, rep, &cap), 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	cr_assert_eq(kvr_router_create(&c, &w->r), 0);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = replay_timeout_ms;
	cr_assert_eq(kvr_feed_create(w->r, &fc, &w->f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = w->pub.ep, .replay_endpoint = rep};
	cr_assert_eq(kvr_feed_add(w->f, &fe, &w->id), 0);
	test_pub_subscribed(&w->pub);
	for (int i = 0; i < 3; i++) {
		kvr_fenc_init(&w->enc[i]);
		kvr_fenc_begin(&w->enc[i], 1.0, 1);
		if (i == 0)
			kvr_fenc_stored(&w->enc[i], A, 2, NULL, 16, test_block_tokens, (void *)A);
		else if (i == 1)
			kvr_fenc_removed(&w->enc[i], A, 2);
		else
			kvr_fenc_stored(&w->enc[i], B, 3, NULL, 16, test_block_tokens, (void *)B);
		kvr_fenc_end(&w->enc[i], 0);
		test_pub_send(&w->pub, (uint64_t)i, (const uint8_t *)w->enc[i].sb.data,
		              w->enc[i].sb.size);
	}
	struct kvr_feed_stats st;
	for (int k = 0; k < 500; k++) { /* the three batches seen, for an unknown rank */
		cr_assert_eq(kvr_feed_get_stats(w->f, w->id, &st), 0);
		if (st.next_seq == 3)
			break;
		sleep_ms(10);
	}
	cr_assert_eq(st.next_seq, 3);
	cr_assert_eq(kvr_rank_add(w->r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	zmq_msg_init(&w->asker);
	asked(w, 0);
}

/* One message of the replay answer: batch seq, or the end marker (seq UINT64_MAX). */
static void answer(struct world *w, uint64_t seq)
{
	zmq_msg_t id;
	zmq_msg_init(&id);
	zmq_msg_copy(&id, &w->asker);
	cr_assert_geq(zmq_msg_send(&id, w->router, ZMQ_SNDMORE), 0);
	uint8_t s[8];
	for (int i = 0; i < 8; i++)
		s[i] = (uint8_t)(seq >> (56 - 8 * i));
	zmq_send(w->router, "", 0, ZMQ_SNDMORE);
	zmq_send(w->router, s, 8, ZMQ_SNDMORE);
	if (seq == UINT64_MAX)
		zmq_send(w->router, "", 0, 0);
	else
		zmq_send(w->router, w->enc[seq].sb.data, w->enc[seq].sb.size, 0);
}

/* What the index holds for the rank once the resync is over (a stats call waits for the feed's
 * thread, which is in the replay until it ends). */
static uint64_t settled(struct world *w)
{
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w->f, w->id, &st), 0);
	return test_indexed_blocks(w->r);
}

static void teardown(struct world *w)
{
	kvr_feed_destroy(w->f);
	kvr_router_destroy(w->r);
	zmq_msg_close(&w->asker);
	zmq_close(w->router);
	for (int i = 0; i < 3; i++)
		kvr_fenc_fini(&w->enc[i]);
	test_pub_close(&w->pub);
}

Test(feed_resync, a_whole_replay_rebuilds_the_rank, .timeout = 60)
{
	struct world w;
	setup(&w, 5000);
	answer(&w, 0);
	answer(&w, 1);
	answer(&w, 2);
	answer(&w, UINT64_MAX);
	cr_assert_eq(settled(&w), 3, "B only");
	cr_assert_eq(atomic_load(&gap_calls), 0);
	teardown(&w);
}

Test(feed_resync, a_replay_that_stalls_leaves_nothing_removed, .timeout = 60)
{
	struct world w;
	setup(&w, 300);
	answer(&w, 0); /* then nothing: the wait times out */
	cr_assert_eq(settled(&w), 0, "A was removed by the engine");
	cr_assert_eq(atomic_load(&gap_calls), 1);
	cr_assert_eq(gap_from, 1);
	cr_assert_eq(gap_to, 3);
	teardown(&w);
}

Test(feed_resync, a_replay_that_ends_early_is_a_gap, .timeout = 60)
{
	struct world w;
	setup(&w, 5000);
	answer(&w, 0);
	answer(&w, UINT64_MAX);
	/* Short of what the publisher had sent: asked again (test_feed_replay_reask), and it has
	 * nothing more. */
	asked(&w, 1);
	answer(&w, UINT64_MAX);
	cr_assert_eq(settled(&w), 0, "A was removed by the engine");
	cr_assert_eq(atomic_load(&gap_calls), 1, "the batches not brought are reported");
	cr_assert_eq(gap_from, 1);
	cr_assert_eq(gap_to, 3);
	teardown(&w);
}

Test(feed_resync, a_replay_that_skips_a_batch_keeps_what_follows, .timeout = 60)
{
	struct world w;
	setup(&w, 5000);
	answer(&w, 0);
	answer(&w, 2); /* seq 1 (A removed) missing */
	answer(&w, UINT64_MAX);
	/* Asked again from the hole (a ROUTER may have dropped it): the publisher lacks it. */
	asked(&w, 1);
	answer(&w, 2);
	answer(&w, UINT64_MAX);
	cr_assert_eq(settled(&w), 3, "cleared at the hole, B after it");
	cr_assert_eq(atomic_load(&gap_calls), 1, "the hole is reported");
	cr_assert_eq(gap_from, 1);
	cr_assert_eq(gap_to, 2);
	teardown(&w);
}

Test(feed_resync, a_replay_from_later_on_keeps_what_it_brings, .timeout = 60)
{
	struct world w;
	setup(&w, 5000);
	answer(&w, 2); /* the publisher's buffer starts at seq 2 */
	answer(&w, UINT64_MAX);
	cr_assert_eq(settled(&w), 3);
	cr_assert_eq(atomic_load(&gap_calls), 1);
	cr_assert_eq(gap_from, 0);
	cr_assert_eq(gap_to, 2);
	teardown(&w);
}
