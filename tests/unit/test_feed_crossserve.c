/* Calls between feeds' callbacks made while a feed's LOOP runs another feed's call: the loop
 * settles what it posted before any command (sync/feed.c run_cmd), and that settle can report a
 * refusal through the feed's log (or a loss through on_event_gap), i.e. run the feed's callback
 * inside the command.  The command's caller waits for this loop as surely as a deferred caller
 * does, so the wait-for graph must show it: before, it did not, and feed A's callback (inside B's
 * call on A) adding an endpoint to B was deferred by B, which waited for A: both waited for good.
 * Now the callers of the commands a loop has taken wait on it in the graph, and such a call is
 * answered KVR_EBUSY (a cycle), as between two callbacks. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"

enum { BS = TEST_BLOCK_TOKENS, PER = 8 };

static struct kvr_feed *feeds[2];
static atomic_int b_calling; /* feed B's callback is in its call on feed A */
static atomic_int a_called;  /* feed A's callback made its call (inside B's) */
static atomic_int a_outside; /* feed A's bound log came outside B's call */
static atomic_int b_back;
static int a_rc = 1, b_rc = 1;
static uint32_t a_id = UINT32_MAX;

static void on_log(void *ctx, int level, const char *msg)
{
	(void)level;
	int i = (int)(intptr_t)ctx;
	if (i == 0 && strstr(msg, "bound")) {
		if (!atomic_load(&b_calling)) {
			atomic_store(&a_outside, 1);
			return;
		}
		if (atomic_exchange(&a_called, 1))
			return;
		struct kvr_feed_endpoint fe = {.endpoint = "tcp://127.0.0.1:9", .worker_id = 7};
		a_rc = kvr_feed_add(feeds[1], &fe, &a_id);
		return;
	}
	if (i == 1 && strstr(msg, "gap") && !atomic_exchange(&b_calling, 1)) {
		struct kvr_feed_stats st;
		b_rc = kvr_feed_get_stats(feeds[0], KVR_FEED_ALL, &st);
		atomic_store(&b_back, 1);
	}
}

Test(feed_crossserve, callback_in_a_served_call_calls_its_caller, .timeout = 60)
{
	/* Rank (0, 0) at most PER blocks: the batch's second chain is refused by the shard, which
	 * the feed learns (and logs, "bound") when it next settles. */
	struct kvr_router *r = test_events_router_max(NULL, PER);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	struct test_pub pub[2];
	for (int i = 0; i < 2; i++) {
		test_pub_open(&pub[i]);
		feeds[i] = test_feed_on(r, &pub[i], (uint64_t)i, on_log, (void *)(intptr_t)i);
	}
	/* One batch, two chains of PER blocks, to feed A: posted by A's drain (the first chain in
	 * the index shows it), its refusal not yet collected. */
	struct kvr_fenc e;
	kvr_fenc_init(&e);
	uint64_t h0[PER], h1[PER];
	for (int k = 0; k < PER; k++) {
		h0[k] = 1 + (uint64_t)k;
		h1[k] = 1001 + (uint64_t)k;
	}
	kvr_fenc_begin(&e, 1.0, 2);
	kvr_fenc_stored_on(&e, "GPU", h0, PER, NULL, BS, test_block_tokens, h0);
	kvr_fenc_stored_on(&e, "GPU", h1, PER, NULL, BS, test_block_tokens, h1);
	kvr_fenc_end(&e, 0);
	cr_assert_eq(kvr_fenc_send(pub[0].pub, 0, e.sb.data, e.sb.size), 0);
	kvr_fenc_fini(&e);
	for (int t = 0; t < 1000 && test_indexed_blocks(r) < PER; t++)
		sleep_ms(10);
	cr_assert_eq(test_indexed_blocks(r), PER, "feed A posted its batch");
	/* Feed B's callback (a gap) reads A's stats; A's loop settles for it, logs the refusal,
	 * and A's callback adds an endpoint to B, which waits for A's answer. */
	test_pub_send_empty(&pub[1], 0, 0);
	test_pub_send_empty(&pub[1], 5, 0);
	cr_assert(came_back(&b_back),
	          "feed B's call on feed A never returned (A's callback called B: %d)",
	          atomic_load(&a_called));
	cr_assert_not(atomic_load(&a_outside), "feed A logged the refusal before B's call");
	cr_assert(atomic_load(&a_called), "feed A's callback did not run inside B's call");
	cr_assert_eq(b_rc, 0);
	cr_assert_eq(a_rc, KVR_EBUSY, "A's add on B, which waits for A: %d", a_rc);
	/* Both feeds go on. */
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(feeds[0], pub[0].id, &st), 0);
	cr_assert_eq(st.refused, 1);
	cr_assert_eq(kvr_feed_get_stats(feeds[1], KVR_FEED_ALL, &st), 0);
	cr_assert_eq(st.gaps, 1);
	for (int i = 0; i < 2; i++) {
		kvr_feed_destroy(feeds[i]);
		test_pub_close(&pub[i]);
	}
	kvr_router_destroy(r);
}
