/*
 * A feed that takes over a rank an earlier feed filled: kvr_feed_remove (and kvr_feed_destroy)
 * leave what the feed applied in the index, so a new endpoint on the same publisher finds the
 * rank holding the earlier feed's blocks.  Its first batch is a gap from 0, which the replay
 * brings from the publisher's start: those stores again.  Events mode counts copies (vLLM sends
 * one BlockRemoved per copy), so before, every block of the earlier feed was counted twice and
 * a block the engine then removed stayed credited to the rank for good.  Now a rank an endpoint
 * feeds for the first time is cleared before its first batch applies: the stream rebuilds it.
 *
 * The engine: seq 0 stores A, seq 1 stores B, seq 2 removes A; it then holds B.
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
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	atomic_fetch_add(&gap_calls, 1);
}

static const uint64_t A[2] = {0xa1, 0xa2}, B[3] = {0xb1, 0xb2, 0xb3};

struct world {
	struct test_replayer t; /* the publisher, the replay endpoint the test answers, r, f */
	struct kvr_fenc enc[3]; /* the batches of seq 0, 1, 2 */
	char rep[256];          /* the replay endpoint's address */
};

static void send_batch(struct world *w, uint64_t seq)
{
	test_pub_send(&w->t.pub, seq, (const uint8_t *)w->enc[seq].sb.data, w->enc[seq].sb.size);
}

/* Rank (0, 0) added, the first feed fed seq 0 and 1 (A and B: 5 blocks), then destroyed. */
static void setup(struct world *w)
{
	atomic_store(&gap_calls, 0);
	test_replayer_open(&w->t, on_gap, 5000, NULL);
	size_t cap = sizeof(w->rep);
	cr_assert_eq(zmq_getsockopt(w->t.router, ZMQ_LAST_ENDPOINT, w->rep, &cap), 0);
	for (int i = 0; i < 3; i++) {
		kvr_fenc_init(&w->enc[i]);
		kvr_fenc_begin(&w->enc[i], 1.0, 1);
		if (i == 0)
			kvr_fenc_stored(&w->enc[i], A, 2, NULL, 16, test_block_tokens, (void *)A);
		else if (i == 1)
			kvr_fenc_stored(&w->enc[i], B, 3, NULL, 16, test_block_tokens, (void *)B);
		else
			kvr_fenc_removed(&w->enc[i], A, 2);
		kvr_fenc_end(&w->enc[i], 0);
	}
	cr_assert_eq(kvr_rank_add(w->t.r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	send_batch(w, 0);
	send_batch(w, 1);
	test_replayer_feed_at(&w->t, 2);
	cr_assert_eq(test_indexed_blocks(w->t.r), 5, "A and B");
	kvr_feed_destroy(w->t.f);
	w->t.f = NULL;
}

/* The successor: a new feed on the same publisher, with the replay endpoint or without. */
static void successor(struct world *w, bool with_replay)
{
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = 5000;
	cr_assert_eq(kvr_feed_create(w->t.r, &fc, &w->t.f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = w->t.pub.ep,
	                               .replay_endpoint = with_replay ? w->rep : NULL};
	test_pub_verbose(&w->t.pub);
	cr_assert_eq(kvr_feed_add(w->t.f, &fe, &w->t.id), 0);
	test_pub_resubscribed(&w->t.pub);
}

static uint64_t settled(struct world *w)
{
	test_replayer_feed_at(&w->t, 3);
	return test_indexed_blocks(w->t.r);
}

static void teardown(struct world *w)
{
	test_replayer_close(&w->t);
	for (int i = 0; i < 3; i++)
		kvr_fenc_fini(&w->enc[i]);
}

Test(feed_successor, a_successor_that_replays_from_the_start_counts_no_block_twice, .timeout = 60)
{
	struct world w;
	setup(&w);
	successor(&w, true);
	send_batch(&w, 2);
	uint64_t from = UINT64_MAX;
	cr_assert(test_replayer_next_ask(&w.t, 5000, &from), "the successor asks for seq 0 on");
	cr_assert_eq(from, 0);
	for (uint64_t q = 0; q < 2; q++)
		test_replayer_answer(&w.t, q, w.enc[q].sb.data, w.enc[q].sb.size);
	test_replayer_answer(&w.t, UINT64_MAX, NULL, 0);
	cr_assert_eq(settled(&w), 3, "B only: the engine removed A");
	cr_assert_eq(atomic_load(&gap_calls), 0, "the replay brought everything");
	uint64_t got[8];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(w.t.r, (struct kvr_rank_id){0, 0}, got, 8, &n), 0);
	for (size_t i = 0; i < n; i++)
		cr_assert(got[i] != A[0] && got[i] != A[1], "A (removed) is still credited");
	teardown(&w);
}

/* Without a replay endpoint the successor's first batch is a gap from 0, reported, and the
 * rank cleared before the batch applies (as it was before: a regression guard). */
Test(feed_successor, a_successor_without_a_replay_reports_the_gap_and_clears, .timeout = 60)
{
	struct world w;
	setup(&w);
	successor(&w, false);
	send_batch(&w, 2);
	cr_assert_eq(settled(&w), 0, "cleared: the gap 0..2 lost B's store");
	cr_assert_eq(atomic_load(&gap_calls), 1);
	teardown(&w);
}
