/*
 * How long one replay may hold the feed's thread (sync/feed_seq.c replay()): asks that bring
 * FEED_REPLAY_ASK_GAIN batches or more in order do not count toward FEED_REPLAY_ASKS (a ROUTER
 * cut at its send bound brings that much each time: test_feed_replay_reask), so what bounds a
 * replay against a replayer that answers a little each time, jumps ahead, or answers slowly is
 * the count of asks that brought little in order and the replay's own end, FEED_REPLAY_ASKS x
 * replay_timeout_ms.  Each case failed on the first version of the free asks, which counted how
 * far an ask moved the cursor (a jump of 101 seqs was "much") and had no end of its own: 200
 * asks and 201 gaps for one live jump; a stats call held 3.2 s while a replayer went on; every
 * ask after seven small ones waited its whole replay_timeout_ms for a cut answer.  (From the
 * review of that version, s26-rev1.)
 *
 * Engine model (as test_feed_replay_reask): batch i stores S(i) and removes S(i - 2).
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "sync/feed_internal.h"
#include "tests/common/feed_engine.h"
#include "tests/common/feed_pub.h"
#include "tests/common/feed_replayer.h"
#include "tests/common/mono_clock.h"

/* A replayer whose every answer is one batch, 100 seqs past what was asked (its first batch, so
 * never a hole inside the answer), then its end marker: the cursor moves 101 seqs an ask, but no
 * ask brings a batch in order, so each counts, and the replay ends after FEED_REPLAY_ASKS asks.
 * Before (progress measured as the cursor's move): 200 asks and 201 gaps for one live jump,
 * until the test stopped answering. */
static void hostile_stepper(struct world *w, bool resync)
{
	const uint64_t far = 1ull << 40;
	int asks = 0;
	uint64_t from = 0;
	if (resync) {
		/* Batches 0..9 for a rank the router lacks, then a live jump to `far` (its replay,
		 * never answered, times out: a gap), then the rank is added: resync 0..far+1. */
		for (uint64_t i = 0; i < 10; i++)
			live_as(w, i, i);
		test_replayer_feed_at(&w->t, 10);
		live_as(w, far, 10);
		cr_assert(test_replayer_next_ask(&w->t, 5000, &from));
		test_replayer_feed_at(&w->t, far + 1); /* the timeout, 300 ms */
		atomic_store(&gap_calls, 0);
		add_rank(w);
	} else {
		add_rank(w);
		live_as(w, 0, 0);
		test_replayer_feed_at(&w->t, 1);
		live_as(w, far, 1);
	}
	uint64_t t0 = now_ms();
	while (asks < 200 && test_replayer_next_ask(&w->t, 2000, &from)) {
		asks++;
		answer_as(w, from + 100, 2 + (uint64_t)asks % 100);
		answer_as(w, UINT64_MAX, 0);
	}
	uint64_t ms = now_ms() - t0;
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w->t.f, w->t.id, &st), 0); /* out of the replay */
	cr_log_info("%s: %d asks in %" PRIu64 " ms, %d gaps reported, reasks %" PRIu64,
	            resync ? "resync" : "heal", asks, ms, atomic_load(&gap_calls), st.reasks);
	cr_assert_leq(asks, FEED_REPLAY_ASKS, "one replay asked %d times (one gap per ask: %d)",
	              asks, atomic_load(&gap_calls));
}

Test(feed_replay_bound, a_healing_replayer_that_jumps_ahead_is_asked_a_bounded_number_of_times,
     .timeout = 120)
{
	struct world w;
	open_world(&w, 300);
	hostile_stepper(&w, false);
	close_world(&w);
}

Test(feed_replay_bound, a_resync_replayer_that_jumps_ahead_is_asked_a_bounded_number_of_times,
     .timeout = 120)
{
	struct world w;
	open_world(&w, 300);
	hostile_stepper(&w, true);
	close_world(&w);
}

/* Seven asks that brought little, then answers cut at a bound of 100 batches (no end marker):
 * each of those is followed by another ask once it goes quiet (FEED_REPLAY_QUIET_MS), not after
 * the whole replay_timeout_ms (2 s here).  Before, an ask after seven small ones ended a cut
 * answer only at its timeout (the quiet rule was for asks that stop at a hole): each waited
 * 2,000 ms. */
Test(feed_replay_bound, cut_answers_after_seven_small_asks_end_at_their_quiet, .timeout = 120)
{
	struct world w;
	open_world(&w, 2000);
	add_rank(&w);
	live_as(&w, 0, 0);
	test_replayer_feed_at(&w.t, 1);
	live_as(&w, N - 1, N - 1);
	uint64_t from = 0;
	for (int k = 0; k < FEED_REPLAY_ASKS - 1; k++) { /* 7 asks of one batch each */
		cr_assert(test_replayer_next_ask(&w.t, 5000, &from));
		cr_assert_eq(from, 1 + (uint64_t)k);
		answer_as(&w, from, from);
		answer_as(&w, from + 2, from + 2); /* from + 1 dropped: a hole */
		answer_as(&w, UINT64_MAX, 0);
	}
	int big = 0;
	uint64_t waits[8];
	cr_assert(test_replayer_next_ask(&w.t, 5000, &from));
	for (;;) {
		/* Answer the ask in hand: 100 batches then nothing (a bound), or the rest whole. */
		uint64_t cut = from + 100 < N - 1 ? from + 100 : N - 1;
		for (uint64_t q = from; q < cut; q++)
			answer_as(&w, q, q);
		if (cut == N - 1) {
			answer_as(&w, N - 1, N - 1);
			answer_as(&w, UINT64_MAX, 0);
			break;
		}
		uint64_t t0 = now_ms(), nf = 0;
		bool more = test_replayer_next_ask(&w.t, 5000, &nf);
		uint64_t ms = now_ms() - t0;
		if (more && big < 8) /* a next ask: this one was not the last */
			waits[big++] = ms;
		if (!more)
			break;
		from = nf;
	}
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w.t.f, w.t.id, &st), 0);
	cr_assert_gt(big, 0);
	for (int i = 0; i < big && i < 8; i++)
		cr_assert_lt(waits[i], 1000,
		             "big ask %d: the feed's thread waited %" PRIu64
		             " ms (replay_timeout_ms 2000) for a cut answer that was not its last",
		             i + 1, waits[i]);
	close_world(&w);
}

/* A replayer on its own thread until stop: each answer is one batch 100 seqs past what was
 * asked and the end marker (jump), or FEED_REPLAY_ASK_GAIN batches in order from what was asked
 * and then nothing, as a ROUTER past its send bound (in_order). */
struct stepper {
	struct world *w;
	bool in_order;
	atomic_bool stop;
	atomic_int asks;
};

static void *stepper_main(void *arg)
{
	struct stepper *s = arg;
	uint64_t from;
	while (!atomic_load(&s->stop)) {
		if (!test_replayer_next_ask(&s->w->t, 200, &from))
			continue;
		atomic_fetch_add(&s->asks, 1);
		if (s->in_order) {
			for (uint64_t q = from; q < from + FEED_REPLAY_ASK_GAIN; q++)
				answer_as(s->w, q, 2 + q % (N - 2));
		} else {
			answer_as(s->w, from + 100, 2);
			answer_as(s->w, UINT64_MAX, 0);
		}
	}
	return NULL;
}

/* A live jump to 2^40 on a rank fed seq 0; the stepper answers until the stats call is back.
 * Returns how long a stats call (one round trip to the feed's thread) made 100 ms into the replay
 * waited for the replay to end. */
static uint64_t stats_wait_during(struct world *w, bool in_order)
{
	add_rank(w);
	live_as(w, 0, 0);
	test_replayer_feed_at(&w->t, 1);
	live_as(w, 1ull << 40, 1);
	struct stepper s = {.w = w, .in_order = in_order};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, stepper_main, &s), 0);
	sleep_ms(100);
	uint64_t t0 = now_ms();
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w->t.f, w->t.id, &st), 0);
	uint64_t ms = now_ms() - t0;
	cr_log_info("stats waited %" PRIu64 " ms, %d asks, %d gaps reported", ms,
	            atomic_load(&s.asks), atomic_load(&gap_calls));
	atomic_store(&s.stop, true);
	pthread_join(th, NULL);
	cr_assert_geq(atomic_load(&gap_calls), 1, "what the replay lacks is reported");
	return ms;
}

/* The jumping replayer on a thread: the replay ends after FEED_REPLAY_ASKS asks, at once.
 * Before, a stats call made during the replay waited for as long as the replayer went on
 * (3,207 ms of 3 s). */
Test(feed_replay_bound, a_replayer_that_jumps_ahead_holds_the_feed_briefly, .timeout = 60)
{
	struct world w;
	open_world(&w, 300);
	uint64_t ms = stats_wait_during(&w, false);
	cr_assert_lt(ms, 2000, "the stats call waited %" PRIu64 " ms for one replay", ms);
	close_world(&w);
}

/* A replayer that brings FEED_REPLAY_ASK_GAIN batches in order each time, toward a target it
 * will never reach: no ask counts, and the replay ends at its own end, FEED_REPLAY_ASKS x
 * FEED_REPLAY_END_MIN_MS here (replay_timeout_ms 300 is below it: 8 s), with what it lacks
 * reported.  Without that end the replay went on for as long as the replayer answered, which
 * here is until the stats call returns (the test's timeout). */
Test(feed_replay_bound, a_replay_that_brings_much_each_ask_still_ends, .timeout = 60)
{
	struct world w;
	open_world(&w, 300);
	uint64_t ms = stats_wait_during(&w, true);
	const uint64_t end_ms = FEED_REPLAY_ASKS * FEED_REPLAY_END_MIN_MS;
	cr_assert_lt(ms, end_ms + 4000,
	             "the stats call waited %" PRIu64 " ms; the replay's end is %" PRIu64
	             " ms away",
	             ms, end_ms);
	close_world(&w);
}

/* A short replay_timeout_ms (100 ms) and an honest long answer cut at a bound of
 * FEED_REPLAY_ASK_GAIN batches each time: each ask ends at its timeout (no shorter than the
 * quiet rule), brings a bound's worth in order, and so does not count; the replay's end is
 * FEED_REPLAY_ASKS x FEED_REPLAY_END_MIN_MS, not 8 x 100 ms.  Before (a timed-out ask always
 * counted, and the end was 800 ms), the ninth ask never came and the rest was a gap (the
 * review's honest replayer: 10,000 batches behind a bound of 1,000 cut at 8,000). */
Test(feed_replay_bound, a_short_timeout_still_lets_a_long_cut_answer_through, .timeout = 60)
{
	struct world w;
	open_world(&w, 100);
	add_rank(&w);
	live_as(&w, 0, 0);
	test_replayer_feed_at(&w.t, 1);
	live_as(&w, N - 1, N - 1);
	int asks = 0;
	for (uint64_t from = 1;; from += FEED_REPLAY_ASK_GAIN) {
		uint64_t got = 0;
		cr_assert(test_replayer_next_ask(&w.t, 5000, &got), "ask %d did not come",
		          asks + 1);
		cr_assert_eq(got, from);
		asks++;
		if (from + FEED_REPLAY_ASK_GAIN >= N - 1) {
			for (uint64_t q = from; q < N - 1; q++)
				answer_as(&w, q, q);
			answer_as(&w, UINT64_MAX, 0);
			break;
		}
		for (uint64_t q = from; q < from + FEED_REPLAY_ASK_GAIN; q++)
			answer_as(&w, q, q);
	}
	cr_assert_gt(asks, FEED_REPLAY_ASKS);
	test_replayer_feed_at(&w.t, N);
	cr_assert_eq(atomic_load(&gap_calls), 0, "a gap %" PRIu64 "..%" PRIu64,
	             atomic_load(&gap_from), atomic_load(&gap_to));
	close_world(&w);
}
