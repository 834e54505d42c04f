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
#include "tests/common/feed_replayer.h"

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
	struct test_replayer t; /* the publisher, the replay endpoint the test answers, r, f */
	struct kvr_fenc enc[3]; /* the batches of seq 0, 1, 2 */
};

/* The feed's next replay request (within 5 s), from seq from. */
static void asked(struct world *w, uint64_t from)
{
	uint64_t got = UINT64_MAX;
	cr_assert(test_replayer_next_ask(&w->t, 5000, &got),
	          "the feed asks for a replay from seq %" PRIu64, from);
	cr_assert_eq(got, from, "the replay is asked from seq %" PRIu64 ", not %" PRIu64, got,
	             from);
}

/* The three batches sent before rank (0, 0) exists, then the rank added; returns once the feed
 * asked for the replay from seq 0. */
static void setup(struct world *w, uint32_t replay_timeout_ms)
{
	atomic_store(&gap_calls, 0);
	test_replayer_open(&w->t, on_gap, replay_timeout_ms, NULL);
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
		test_pub_send(&w->t.pub, (uint64_t)i, (const uint8_t *)w->enc[i].sb.data,
		              w->enc[i].sb.size);
	}
	test_replayer_feed_at(&w->t, 3); /* the three batches seen, for an unknown rank */
	cr_assert_eq(kvr_rank_add(w->t.r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	asked(w, 0);
}

/* One message of the replay answer: batch seq, or the end marker (seq UINT64_MAX). */
static void answer(struct world *w, uint64_t seq)
{
	if (seq == UINT64_MAX)
		test_replayer_answer(&w->t, seq, NULL, 0);
	else
		test_replayer_answer(&w->t, seq, w->enc[seq].sb.data, w->enc[seq].sb.size);
}
/* What the index holds for the rank once the resync is over (a stats call waits for the feed's
 * thread, which is in the replay until it ends). */
static uint64_t settled(struct world *w)
{
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w->t.f, w->t.id, &st), 0);
	return test_indexed_blocks(w->t.r);
}

static void teardown(struct world *w)
{
	test_replayer_close(&w->t);
	for (int i = 0; i < 3; i++)
		kvr_fenc_fini(&w->enc[i]);
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
