/*
 * An endpoint that takes over ranks another feed (or endpoint) filled, beyond
 * test_feed_successor's one scene: a rank an endpoint feeds for the first time is cleared
 * before its first batch applies (sync/feed_apply.c kvr_feed_apply_batch), and only then.  The
 * same endpoint removed and added back, an endpoint that takes each batch's dp rank, a rank
 * removed and added back while its endpoint goes on (rebuilt, not wiped), blocks applied after
 * the first batch (kept), and the first batch's clear under every allocation failure.  From the
 * review of that change (s26-rev1): the remove-then-add, dp-from-batch and OOM cases kept the
 * earlier feed's blocks, or counted them twice, before it.
 *
 * Engine model (as test_feed_replay_reask): batch i stores S(i) and removes S(i - 2); after n
 * batches it holds S(n - 2) and S(n - 1).
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

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "sync/feed_internal.h"
#include "tests/common/feed_engine.h"
#include "tests/common/feed_pub.h"
#include "tests/common/feed_replayer.h"
#include "tests/common/mono_clock.h"

static void rank_holds_engine(struct world *w, uint32_t dp, uint64_t n_batches)
{
	cr_assert_eq(kvr_router_sync(w->t.r, 1000), 0);
	uint64_t got[16];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(w->t.r, (struct kvr_rank_id){0, dp}, got, 16, &n), 0);
	bool a = false, b = false;
	for (size_t i = 0; i < n; i++) {
		a |= got[i] == block_of(n_batches - 2);
		b |= got[i] == block_of(n_batches - 1);
	}
	cr_assert(n == 2 && a && b,
	          "rank (0, %u) holds %zu blocks, not S(%" PRIu64 ") S(%" PRIu64 ")", dp, n,
	          n_batches - 2, n_batches - 1);
}

/* the same endpoint removed and added back in the same feed (kvr_feed_remove, then
 * kvr_feed_add): the new endpoint has fresh rstates; its first batch is a gap from 0 healed by a
 * replay from 0: the rank is cleared once, rebuilt to the engine's state (no copy counted
 * twice, no removed block left). */
Test(feed_takeover, remove_then_add_the_same_endpoint_rebuilds_exactly, .timeout = 60)
{
	struct world w;
	open_world(&w, 5000);
	char rep[256];
	size_t cap = sizeof(rep);
	cr_assert_eq(zmq_getsockopt(w.t.router, ZMQ_LAST_ENDPOINT, rep, &cap), 0);
	add_rank(&w);
	for (uint64_t i = 0; i < 10; i++)
		live_as(&w, i, i);
	test_replayer_feed_at(&w.t, 10);
	rank_holds_engine(&w, 0, 10);
	cr_assert_eq(kvr_feed_remove(w.t.f, w.t.id), 0);
	struct kvr_feed_endpoint fe = {.endpoint = w.t.pub.ep, .replay_endpoint = rep};
	test_pub_verbose(&w.t.pub);
	cr_assert_eq(kvr_feed_add(w.t.f, &fe, &w.t.id), 0);
	test_pub_resubscribed(&w.t.pub);
	live_as(&w, 12, 12);
	uint64_t from;
	cr_assert(test_replayer_next_ask(&w.t, 5000, &from));
	cr_assert_eq(from, 0);
	for (uint64_t q = 0; q < 12; q++)
		answer_as(&w, q, q);
	answer_as(&w, UINT64_MAX, 0);
	test_replayer_feed_at(&w.t, 13);
	rank_holds_engine(&w, 0, 13);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	close_world(&w);
}

/* a rank removed and added back while the endpoint keeps feeding it (note_lives /
 * rank_gone -> missed -> resync): the rank's state is not SINCE_NONE, so no extra clear; the
 * resync rebuilds it from since = 0 to the engine's state. */
Test(feed_takeover, rank_removed_and_added_back_is_rebuilt_not_wiped, .timeout = 60)
{
	struct world w;
	open_world(&w, 5000);
	add_rank(&w);
	for (uint64_t i = 0; i < 10; i++)
		live_as(&w, i, i);
	test_replayer_feed_at(&w.t, 10);
	cr_assert_eq(kvr_rank_remove(w.t.r, (struct kvr_rank_id){0, 0}), 0);
	add_rank(&w);
	uint64_t from;
	cr_assert(test_replayer_next_ask(&w.t, 5000, &from), "the resync asks");
	cr_assert_eq(from, 0);
	for (uint64_t q = 0; q < 10; q++)
		answer_as(&w, q, q);
	answer_as(&w, UINT64_MAX, 0);
	live_as(&w, 10, 10);
	test_replayer_feed_at(&w.t, 11);
	rank_holds_engine(&w, 0, 11);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	close_world(&w);
}

/* kvr_events_apply's blocks on a rank before the feed's first batch (documented now:
 * cleared), and after it (kept: not a first batch). */
Test(feed_takeover, events_apply_after_the_first_batch_is_kept, .timeout = 60)
{
	struct world w;
	open_world(&w, 5000);
	add_rank(&w);
	live_as(&w, 0, 0);
	test_replayer_feed_at(&w.t, 1);
	uint64_t x = 0x9999;
	struct kvr_event_block blk = {.ext_hash = x, .local_hash = x};
	struct kvr_event ev = {.type = KVR_EVENT_STORED, .blocks = &blk, .n_blocks = 1};
	cr_assert_eq(kvr_events_apply(w.t.r, (struct kvr_rank_id){0, 0}, &ev), 0);
	live_as(&w, 1, 1);
	test_replayer_feed_at(&w.t, 2);
	cr_assert_eq(kvr_router_sync(w.t.r, 1000), 0);
	cr_assert_eq(test_indexed_blocks(w.t.r), 3, "S(0) S(1) and the applied block");
	close_world(&w);
}

/* ---------------------------------------------------------------- an endpoint of every dp rank */

static int dp_alternating(uint64_t i)
{
	return (int)(i % 2);
}

static void open_dp_world(struct world *w)
{
	atomic_store(&gap_calls, 0);
	memset(w, 0, sizeof(*w));
	test_replayer_open(&w->t, on_gap, 5000, NULL);
	encode(w, dp_alternating);
	for (uint32_t dp = 0; dp < 2; dp++)
		cr_assert_eq(
		    kvr_rank_add(w->t.r, (struct kvr_rank_id){0, dp}, 1, KVR_CAPACITY_NONE, 0), 0);
}

/* A feed on the publisher whose endpoint takes the rank from each batch. */
static void dp_feed(struct world *w, bool with_replay)
{
	char rep[256];
	size_t cap = sizeof(rep);
	cr_assert_eq(zmq_getsockopt(w->t.router, ZMQ_LAST_ENDPOINT, rep, &cap), 0);
	kvr_feed_destroy(w->t.f);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = 5000;
	cr_assert_eq(kvr_feed_create(w->t.r, &fc, &w->t.f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = w->t.pub.ep,
	                               .replay_endpoint = with_replay ? rep : NULL,
	                               .dp_rank = KVR_FEED_DP_FROM_BATCH};
	test_pub_verbose(&w->t.pub);
	cr_assert_eq(kvr_feed_add(w->t.f, &fe, &w->t.id), 0);
	test_pub_resubscribed(&w->t.pub);
}

/* Rank (0, dp) holds exactly the blocks S(want[0..n_want)). */
static void dp_holds(struct world *w, uint32_t dp, const uint64_t *want, size_t n_want)
{
	cr_assert_eq(kvr_router_sync(w->t.r, 1000), 0);
	uint64_t got[16];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(w->t.r, (struct kvr_rank_id){0, dp}, got, 16, &n), 0);
	char s[200] = "";
	for (size_t i = 0; i < n; i++)
		snprintf(s + strlen(s), sizeof(s) - strlen(s), " S(%" PRIu64 ")", got[i] - 0x5000);
	bool ok = n == n_want;
	for (size_t k = 0; ok && k < n_want; k++) {
		bool f = false;
		for (size_t i = 0; i < n; i++)
			f |= got[i] == block_of(want[k]);
		ok = f;
	}
	cr_assert(ok, "rank (0, %u) holds%s", dp, s);
}

/* an endpoint feeding several dp ranks (KVR_FEED_DP_FROM_BATCH) taking over from an
 * earlier feed: every rank is cleared at its own first batch, replayed from 0, exactly. */
Test(feed_takeover, dp_from_batch_successor_with_replay_rebuilds_every_rank, .timeout = 60)
{
	struct world w;
	open_dp_world(&w);
	dp_feed(&w, false);
	for (uint64_t i = 0; i < 10; i++)
		live_as(&w, i, i);
	test_replayer_feed_at(&w.t, 10);
	dp_holds(&w, 0, (const uint64_t[]){8}, 1);
	dp_holds(&w, 1, (const uint64_t[]){9}, 1);
	dp_feed(&w, true);
	live_as(&w, 12, 12);
	uint64_t from;
	cr_assert(test_replayer_next_ask(&w.t, 5000, &from));
	cr_assert_eq(from, 0);
	for (uint64_t q = 0; q < 12; q++)
		answer_as(&w, q, q);
	answer_as(&w, UINT64_MAX, 0);
	test_replayer_feed_at(&w.t, 13);
	dp_holds(&w, 0, (const uint64_t[]){12}, 1);
	dp_holds(&w, 1, (const uint64_t[]){11}, 1);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	close_world(&w);
}

/* Without a replay: the gap 0..12 clears dp 0 (its batch's rank); dp 1, which the successor has
 * no state of yet, keeps the earlier feed's S(9) (removed by the engine in batch 11, lost in the
 * gap) until its own first batch, 13, clears it.  Before, it kept S(9) for good. */
Test(feed_takeover, dp_from_batch_successor_without_replay_clears_each_rank_at_its_first_batch,
     .timeout = 60)
{
	struct world w;
	open_dp_world(&w);
	dp_feed(&w, false);
	for (uint64_t i = 0; i < 10; i++)
		live_as(&w, i, i);
	test_replayer_feed_at(&w.t, 10);
	dp_feed(&w, false);
	live_as(&w, 12, 12);
	test_replayer_feed_at(&w.t, 13);
	dp_holds(&w, 0, (const uint64_t[]){12}, 1);
	live_as(&w, 13, 13);
	test_replayer_feed_at(&w.t, 14);
	dp_holds(&w, 1, (const uint64_t[]){13}, 1);
	close_world(&w);
}

/* Two publishers of one worker, one per dp rank as vLLM runs them, each added as
 * KVR_FEED_DP_FROM_BATCH under worker 0: the first names dp 0 in its batches, the second dp 1.  A
 * gap on the first (no replay endpoint) clears and reports dp 0 only: dp 1, which the first
 * never fed, is the second's, and nothing was missed for it.  This is why a gap does not clear
 * the ranks an endpoint has no state of (sync/feed_seq.c report_gap): (0, 1) is, to the first
 * endpoint, exactly the rank an earlier feed could have left, and clearing it would wipe a
 * healthy rank at every sibling's gap. */
static int dp_one(uint64_t i)
{
	(void)i;
	return 1;
}

Test(feed_takeover, a_dp_from_batch_gap_leaves_a_sibling_endpoints_rank, .timeout = 60)
{
	struct world w;
	open_dp_world(&w);
	dp_feed(&w, false);
	for (uint64_t i = 0; i < N; i++)
		kvr_fenc_fini(&w.enc[i]);
	encode(&w, NULL); /* the first publisher: every batch names dp 0 */
	struct kvr_fenc one[N];
	struct test_pub sib;
	test_pub_open(&sib);
	struct kvr_feed_endpoint fe = {.endpoint = sib.ep, .dp_rank = KVR_FEED_DP_FROM_BATCH};
	uint32_t sib_id;
	cr_assert_eq(kvr_feed_add(w.t.f, &fe, &sib_id), 0);
	test_pub_subscribed(&sib);
	{
		struct world *tmp = malloc(sizeof(*tmp));
		cr_assert_not_null(tmp);
		encode(tmp, dp_one); /* the sibling: every batch names dp 1 */
		memcpy(one, tmp->enc, sizeof(one));
		free(tmp);
	}
	for (uint64_t i = 0; i < 10; i++) {
		live_as(&w, i, i);
		test_pub_send(&sib, i, (const uint8_t *)one[i].sb.data, one[i].sb.size);
	}
	test_replayer_feed_at(&w.t, 10);
	struct kvr_feed_stats st;
	for (int k = 0; k < 500; k++) {
		cr_assert_eq(kvr_feed_get_stats(w.t.f, sib_id, &st), 0);
		if (st.next_seq == 10)
			break;
		sleep_ms(10);
	}
	cr_assert_eq(st.next_seq, 10);
	dp_holds(&w, 0, (const uint64_t[]){8, 9}, 2);
	dp_holds(&w, 1, (const uint64_t[]){8, 9}, 2);
	live_as(&w, 12, 12); /* a gap on the first: 10 and 11 lost, nothing to replay them */
	test_replayer_feed_at(&w.t, 13);
	cr_assert_eq(atomic_load(&gap_calls), 1, "one gap, for dp 0 only");
	dp_holds(&w, 0, (const uint64_t[]){12}, 1);
	dp_holds(&w, 1, (const uint64_t[]){8, 9}, 2); /* the sibling's, untouched */
	test_pub_send(&sib, 10, (const uint8_t *)one[10].sb.data, one[10].sb.size);
	for (int k = 0; k < 500; k++) {
		cr_assert_eq(kvr_feed_get_stats(w.t.f, sib_id, &st), 0);
		if (st.next_seq == 11)
			break;
		sleep_ms(10);
	}
	dp_holds(&w, 1, (const uint64_t[]){9, 10}, 2);
	cr_assert_eq(atomic_load(&gap_calls), 1);
	for (uint64_t i = 0; i < N; i++)
		kvr_fenc_fini(&one[i]);
	close_world(&w);
	test_pub_close(&sib);
}

/* The first batch's clear under allocation failure (the clear's pend_event failing:
 * flush, then a direct clear; the rstate not made: the batch lost, the rank cleared).  The Nth
 * allocation fails for N = 1, 2, ... while the feed takes its first batch, which stores A on a
 * rank that holds X (kvr_events_apply, before the feed): afterwards X is never held, and A is
 * held unless the batch was lost (counted, a gap reported). */
Test(feed_takeover, first_batch_clear_under_oom_never_keeps_what_came_before, .timeout = 120)
{
	static const uint64_t A[2] = {0xa1, 0xa2};
	const uint64_t X = 0x77;
	bool fired = true;
	uint64_t nth, losses = 0;
	for (nth = 1; nth < 400 && fired; nth++) {
		atomic_store(&gap_calls, 0);
		struct kvr_router *r = test_events_router(on_gap);
		struct kvr_event_block xb = {.ext_hash = X, .local_hash = X};
		struct kvr_event xe = {.type = KVR_EVENT_STORED, .blocks = &xb, .n_blocks = 1};
		cr_assert_eq(kvr_events_apply(r, (struct kvr_rank_id){0, 0}, &xe), 0);
		struct test_pub pub;
		test_pub_open(&pub);
		struct kvr_feed *f = test_feed_on(r, &pub, 0, NULL, NULL);
		struct kvr_fenc e;
		kvr_fenc_init(&e);
		kvr_fenc_begin(&e, 1.0, 1);
		kvr_fenc_stored(&e, A, 2, NULL, TEST_BLOCK_TOKENS, test_block_tokens, (void *)A);
		kvr_fenc_end(&e, 0);
		kvr_alloc_fail_after(nth);
		test_pub_send(&pub, 0, (const uint8_t *)e.sb.data, e.sb.size);
		struct kvr_feed_stats st;
		for (int k = 0; k < 3000; k++) {
			cr_assert_eq(kvr_feed_get_stats(f, pub.id, &st), 0);
			if (st.next_seq == 1)
				break;
			sleep_ms(1);
		}
		fired = kvr_alloc_fail_pending() == 0;
		kvr_alloc_fail_after(0);
		cr_assert_eq(st.next_seq, 1, "nth %" PRIu64 ": the batch was taken", nth);
		cr_assert_eq(kvr_router_sync(r, 5000), 0);
		uint64_t got[8];
		size_t n = 0;
		cr_assert_eq(kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, got, 8, &n), 0);
		bool has_x = false, has_a = false;
		for (size_t i = 0; i < n; i++) {
			has_x |= got[i] == X;
			has_a |= got[i] == A[0];
		}
		cr_assert(!has_x, "nth %" PRIu64 ": X (from before the feed) is still held", nth);
		cr_assert(has_a || st.lost > 0, "nth %" PRIu64 ": A neither held nor counted lost",
		          nth);
		if (st.lost)
			cr_assert_geq(atomic_load(&gap_calls), 1,
			              "nth %" PRIu64 ": a loss unreported", nth);
		losses += st.lost > 0;
		kvr_feed_destroy(f);
		kvr_fenc_fini(&e);
		test_pub_close(&pub);
		kvr_router_destroy(r);
	}
	cr_log_info("%" PRIu64 " allocation failures, %" PRIu64 " of them losses", nth - 2, losses);
	cr_assert(!fired, "the allocations ran past 400");
}
