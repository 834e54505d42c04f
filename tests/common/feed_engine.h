/*
 * tests/common/feed_engine.h - the engine the feed's replay tests script (test_feed_replay_bound,
 * test_feed_takeover): N batches where batch i stores block S(i) and removes S(i - 2), so that
 * after n batches the engine holds S(n - 2) and S(n - 1), and a batch applied out of order or
 * skipped leaves a block the engine removed; a world of a publisher, a replay endpoint the test
 * answers (tests/common/feed_replayer.h) and the N batches encoded; the gaps the router reports.
 * One test file includes it: its state is that file's.
 */
#ifndef KVR_TESTS_COMMON_FEED_ENGINE_H
#define KVR_TESTS_COMMON_FEED_ENGINE_H

#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/feed_replayer.h"

enum { N = 640 };

static atomic_int gap_calls;
static _Atomic uint64_t gap_from, gap_to;
static inline void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp;
	atomic_store(&gap_from, from);
	atomic_store(&gap_to, to);
	atomic_fetch_add(&gap_calls, 1);
}

static inline uint64_t block_of(uint64_t i)
{
	return 0x5000 + i;
}

struct world {
	struct test_replayer t;
	struct kvr_fenc enc[N];
};

/* dp_of(i): the batch's data_parallel_rank, or -1 for none. */
static inline void encode(struct world *w, int (*dp_of)(uint64_t))
{
	for (uint64_t i = 0; i < N; i++) {
		uint64_t s = block_of(i), old = block_of(i - 2);
		kvr_fenc_init(&w->enc[i]);
		kvr_fenc_begin(&w->enc[i], 1.0, i >= 2 ? 2 : 1);
		kvr_fenc_stored(&w->enc[i], &s, 1, NULL, TEST_BLOCK_TOKENS, test_block_tokens, &s);
		if (i >= 2)
			kvr_fenc_removed(&w->enc[i], &old, 1);
		kvr_fenc_end(&w->enc[i], dp_of ? dp_of(i) : 0);
	}
}

static inline void open_world(struct world *w, uint32_t replay_timeout_ms)
{
	atomic_store(&gap_calls, 0);
	memset(w, 0, sizeof(*w));
	test_replayer_open(&w->t, on_gap, replay_timeout_ms, NULL);
	encode(w, NULL);
}

static inline void close_world(struct world *w)
{
	test_replayer_close(&w->t);
	for (int i = 0; i < N; i++)
		kvr_fenc_fini(&w->enc[i]);
}

static inline void live_as(struct world *w, uint64_t seq, uint64_t payload_of)
{
	test_pub_send(&w->t.pub, seq, (const uint8_t *)w->enc[payload_of].sb.data,
	              w->enc[payload_of].sb.size);
}

static inline void answer_as(struct world *w, uint64_t seq, uint64_t payload_of)
{
	if (seq == UINT64_MAX)
		test_replayer_answer(&w->t, seq, NULL, 0);
	else
		test_replayer_answer(&w->t, seq, w->enc[payload_of].sb.data,
		                     w->enc[payload_of].sb.size);
}

static inline void add_rank(struct world *w)
{
	cr_assert_eq(kvr_rank_add(w->t.r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
}

#endif
