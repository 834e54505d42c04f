/* A rank removed while the feed's events for it are on their way to its shard: the feed says so,
 * not that the rank lacks the event's parent.  The window is forced: kvr_shard_post_wait is
 * wrapped (ld --wrap, tests/meson.build) to remove the rank when the event path has looked it up
 * and is about to post a batch's events to its shard (core/events.c, kvr_events_post_many); the
 * shard then finds it gone.  (The wrap is on the post, not on the lookup: the feed looks the rank
 * up too when it takes a batch, and the window must follow the event path's lookup, whichever
 * comes first.)
 *
 * Then a rank removed and added back (same worker and dp rank) while its publisher went on: its
 * removal took the blocks the index held for it, which the engine still holds.  Added back, the
 * feed rebuilds it by replay, as it does a rank added after its publisher started, from where what
 * the index held began (the stream's start here), whether the feed learnt of the removal from a
 * batch for the missing rank, from events the shard refused because the rank went meanwhile, or
 * only from the rank being another life when its next batch came; without a replay that reaches
 * back that far, the batches missing are reported through on_event_gap.  Before, the rank added
 * back held only what came after the removal (a replay from the first batch it missed), so every
 * store below an older block was refused for its parent, and nothing was reported. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/metric.h"

int __real_kvr_shard_post_wait(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                               const void *payload, size_t size, uint64_t timeout_ns);
int __wrap_kvr_shard_post_wait(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                               const void *payload, size_t size, uint64_t timeout_ns);
static atomic_bool armed;
static struct kvr_router *armed_router; /* set before armed */

/* Only the feed posts here (the tests route nothing); the rank is worker 0's. */
int __wrap_kvr_shard_post_wait(struct kvr_shard *sh, enum kvr_lane lane, kvr_task_fn fn,
                               const void *payload, size_t size, uint64_t timeout_ns)
{
	if (atomic_exchange(&armed, false))
		cr_assert_eq(kvr_rank_remove(armed_router, (struct kvr_rank_id){0, 0}), 0);
	return __real_kvr_shard_post_wait(sh, lane, fn, payload, size, timeout_ns);
}

/* The earlier window: after the feed took a BlockStored for the rank it found (its local hashes
 * are computed then, sync/feed_apply.c apply_stored) and before the event path looks the rank
 * up to post it.  ARM_REMOVE: the rank is removed there (the post finds no rank); ARM_BACK:
 * removed and added back (the post finds another life of it, empty). */
enum { ARM_NONE, ARM_REMOVE, ARM_BACK };
static atomic_int armed_hash;

size_t __real_kvr_hash_blocks(const uint32_t *tokens, size_t n_tokens, uint32_t block_size,
                              const char *lora_name, uint64_t *local_out, uint64_t *seq_out);
size_t __wrap_kvr_hash_blocks(const uint32_t *tokens, size_t n_tokens, uint32_t block_size,
                              const char *lora_name, uint64_t *local_out, uint64_t *seq_out);
size_t __wrap_kvr_hash_blocks(const uint32_t *tokens, size_t n_tokens, uint32_t block_size,
                              const char *lora_name, uint64_t *local_out, uint64_t *seq_out)
{
	int how = atomic_exchange(&armed_hash, ARM_NONE);
	if (how != ARM_NONE)
		cr_assert_eq(kvr_rank_remove(armed_router, (struct kvr_rank_id){0, 0}), 0);
	if (how == ARM_BACK)
		cr_assert_eq(
		    kvr_rank_add(armed_router, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0),
		    0);
	return __real_kvr_hash_blocks(tokens, n_tokens, block_size, lora_name, local_out, seq_out);
}

/* The feed's log lines (the first LOGS), written by its thread only. */
enum { LOGS = 32 };
static char logs[LOGS][512];
static atomic_int n_logs;

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level;
	int k = atomic_load(&n_logs);
	if (k < LOGS) {
		snprintf(logs[k], sizeof(logs[k]), "%s", msg);
		atomic_store(&n_logs, k + 1);
	}
}

static bool logged(const char *a, const char *b)
{
	for (int k = 0; k < atomic_load(&n_logs); k++)
		if (strstr(logs[k], a) && strstr(logs[k], b))
			return true;
	return false;
}

/* The BlockStored is below a parent the rank never held, so a refusal for the parent would look
 * the same from the outside (KVR_ENOENT): the log line must come from what the shard said.
 * Before, one line named both ("does not hold its parent ... or the rank was removed
 * meanwhile"). */
Test(feed_rank_gone, a_stored_event_of_a_rank_removed_meanwhile_is_logged_as_such, .timeout = 120)
{
	struct kvr_router *r = test_events_router(NULL);
	struct test_pub pub;
	test_pub_open(&pub);
	struct kvr_feed *f = test_feed_on(r, &pub, 0, on_log, NULL);
	struct kvr_fenc e;
	kvr_fenc_init(&e);
	uint64_t parent = 30, child = 31;
	kvr_fenc_begin(&e, 1.0, 1);
	kvr_fenc_stored(&e, &child, 1, &parent, TEST_BLOCK_TOKENS, test_block_tokens, &child);
	kvr_fenc_end(&e, 0);
	/* First an empty batch: the feed's first batch for a rank clears it first (what it held
	 * came from elsewhere: test_feed_successor), and that clear must not be the post the
	 * window catches, which would then refuse it too. */
	test_pub_send_empty(&pub, 0, 0);
	struct kvr_feed_stats st;
	for (int t = 0; t < 3000; t++) { /* stats settle the feed: its posts are done */
		cr_assert_eq(kvr_feed_get_stats(f, pub.id, &st), 0);
		if (st.batches >= 1)
			break;
		sleep_ms(10);
	}
	armed_router = r;
	atomic_store(&armed, true);
	cr_assert_eq(kvr_fenc_send(pub.pub, 1, e.sb.data, e.sb.size), 0);
	for (int t = 0; t < 3000; t++) { /* stats settle the feed: its refusals are logged */
		cr_assert_eq(kvr_feed_get_stats(f, pub.id, &st), 0);
		if (st.batches >= 2 && st.refused >= 1)
			break;
		sleep_ms(10);
	}
	cr_assert(!atomic_load(&armed), "the window was not forced");
	cr_assert_eq(st.refused, 1);
	for (int k = 0; k < atomic_load(&n_logs); k++)
		cr_log_info("log: %s", logs[k]);
	cr_assert(logged("BlockStored", "the rank was removed meanwhile"), "the rank went");
	cr_assert(!logged("BlockStored", "parent"), "not its parent");
	cr_assert_eq(kvr_test_metric(r, "kvr_events_total{type=\"any\",status=\"rank_gone\"}"), 1);
	cr_assert_eq(kvr_test_metric(r, "kvr_event_parent_not_found_total"), 0);
	kvr_fenc_fini(&e);
	kvr_feed_destroy(f);
	test_pub_close(&pub);
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- a rank added back */

static atomic_int gap_calls;
static _Atomic uint64_t gap_from, gap_to; /* the last gap reported */

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp;
	atomic_store(&gap_from, from);
	atomic_store(&gap_to, to);
	atomic_fetch_add(&gap_calls, 1);
}

/* The engine's prefix: A (2 blocks, a root), B (3, below A), C (1, below B); D (1, a root). */
static const uint64_t A[2] = {0xa1, 0xa2}, B[3] = {0xb1, 0xb2, 0xb3}, C[1] = {0xc1}, D[1] = {0xd1};

enum { BATCHES = 8 };

/* A vLLM publisher: the XPUB, and the ROUTER that answers replay requests from the batches it
 * sent (all of them: its buffer reaches back to seq 0), on a thread of its own. */
struct back {
	struct test_pub pub;
	void *rep; /* ROUTER; NULL: the publisher has no replay endpoint */
	char rep_ep[256];
	struct kvr_fenc enc[BATCHES]; /* batch seq i, once sent */
	atomic_int n_sent;
	atomic_int asks;             /* replay requests answered */
	_Atomic uint64_t first_from; /* the first request's start seq */
	atomic_bool stop;
	atomic_bool no_end; /* answers without the end marker (a replayer that dropped it) */
	pthread_t th;
	struct kvr_router *r;
	struct kvr_feed *f;
};

static void be64(uint8_t *b, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		b[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* Answers ["", start] with every batch sent from start on, then the end marker. */
static void *serve_replays(void *arg)
{
	struct back *w = arg;
	while (!atomic_load(&w->stop)) {
		zmq_pollitem_t it = {.socket = w->rep, .events = ZMQ_POLLIN};
		if (zmq_poll(&it, 1, 10) <= 0)
			continue;
		zmq_msg_t id;
		zmq_msg_init(&id);
		uint8_t empty[8], start[8];
		if (zmq_msg_recv(&id, w->rep, 0) < 0 || zmq_recv(w->rep, empty, 8, 0) != 0 ||
		    zmq_recv(w->rep, start, 8, 0) != 8) {
			zmq_msg_close(&id);
			continue;
		}
		uint64_t from = 0;
		for (int i = 0; i < 8; i++)
			from = from << 8 | start[i];
		if (atomic_fetch_add(&w->asks, 1) == 0)
			atomic_store(&w->first_from, from);
		uint64_t n = (uint64_t)atomic_load(&w->n_sent);
		for (uint64_t q = from; q <= n - atomic_load(&w->no_end); q++) {
			zmq_msg_t to;
			zmq_msg_init(&to);
			zmq_msg_copy(&to, &id);
			zmq_msg_send(&to, w->rep, ZMQ_SNDMORE);
			uint8_t s[8];
			be64(s, q < n ? q : UINT64_MAX);
			zmq_send(w->rep, "", 0, ZMQ_SNDMORE);
			zmq_send(w->rep, s, 8, ZMQ_SNDMORE);
			if (q < n)
				zmq_send(w->rep, w->enc[q].sb.data, w->enc[q].sb.size, 0);
			else
				zmq_send(w->rep, "", 0, 0);
		}
		zmq_msg_close(&id);
	}
	return NULL;
}

static void back_open(struct back *w, bool replay)
{
	memset(w, 0, sizeof(*w));
	atomic_store(&gap_calls, 0);
	test_pub_open(&w->pub);
	if (replay) {
		w->rep = zmq_socket(w->pub.zctx, ZMQ_ROUTER);
		cr_assert_eq(zmq_bind(w->rep, "tcp://127.0.0.1:*"), 0);
		size_t cap = sizeof(w->rep_ep);
		cr_assert_eq(zmq_getsockopt(w->rep, ZMQ_LAST_ENDPOINT, w->rep_ep, &cap), 0);
		cr_assert_eq(pthread_create(&w->th, NULL, serve_replays, w), 0);
	}
	w->r = test_events_router(on_gap);
	armed_router = w->r;
	cr_assert_eq(kvr_feed_create(w->r, NULL, &w->f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = w->pub.ep,
	                               .replay_endpoint = replay ? w->rep_ep : NULL};
	cr_assert_eq(kvr_feed_add(w->f, &fe, &w->pub.id), 0);
	test_pub_subscribed(&w->pub);
}

/* Publishes batch seq (the next one) of one stored event: n blocks h below parent (NULL: a
 * root). */
static void back_store(struct back *w, uint64_t seq, const uint64_t *h, size_t n,
                       const uint64_t *parent)
{
	cr_assert_eq(seq, (uint64_t)atomic_load(&w->n_sent));
	struct kvr_fenc *e = &w->enc[seq];
	kvr_fenc_init(e);
	kvr_fenc_begin(e, 1.0, 1);
	kvr_fenc_stored(e, h, n, parent, TEST_BLOCK_TOKENS, test_block_tokens, (void *)h);
	kvr_fenc_end(e, 0);
	atomic_store(&w->n_sent, (int)seq + 1); /* in the replay buffer before it goes out */
	test_pub_send(&w->pub, seq, (const uint8_t *)e->sb.data, e->sb.size);
}

/* Stats once the feed has taken every batch sent (and settled: the index shows them). */
static struct kvr_feed_stats back_caught_up(struct back *w)
{
	struct kvr_feed_stats st;
	for (int t = 0; t < 500; t++) {
		cr_assert_eq(kvr_feed_get_stats(w->f, w->pub.id, &st), 0);
		if (st.next_seq == (uint64_t)atomic_load(&w->n_sent))
			break;
		sleep_ms(10);
	}
	cr_assert_eq(st.next_seq, (uint64_t)atomic_load(&w->n_sent), "the feed took every batch");
	return st;
}

/* The start of every rebuild test: a feed with a replay endpoint, and batch 0 (A, 2 blocks)
 * applied to the rank. */
static void back_open_holding_a(struct back *w)
{
	back_open(w, true);
	back_store(w, 0, A, 2, NULL);
	back_caught_up(w);
	cr_assert_eq(test_indexed_blocks(w->r), 2);
}

/* The blocks the index holds for rank (0, 0) once it reaches want (the feed resyncs a rank
 * added back from its own loop, at its next look), or after 5 s. */
static uint64_t back_indexed(struct back *w, uint64_t want)
{
	uint64_t n = 0;
	for (int t = 0; t < 500; t++) {
		struct kvr_feed_stats st;
		cr_assert_eq(kvr_feed_get_stats(w->f, w->pub.id, &st), 0);
		if ((n = test_indexed_blocks(w->r)) == want)
			break;
		sleep_ms(10);
	}
	return n;
}

static void back_add(struct back *w)
{
	cr_assert_eq(kvr_rank_add(w->r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
}

static void back_remove(struct back *w)
{
	cr_assert_eq(kvr_rank_remove(w->r, (struct kvr_rank_id){0, 0}), 0);
}

static void back_close(struct back *w)
{
	kvr_feed_destroy(w->f);
	kvr_router_destroy(w->r);
	if (w->rep) {
		atomic_store(&w->stop, true);
		pthread_join(w->th, NULL);
		zmq_close(w->rep);
	}
	for (int i = 0; i < atomic_load(&w->n_sent); i++)
		kvr_fenc_fini(&w->enc[i]);
	test_pub_close(&w->pub);
}

Test(feed_rank_gone, a_rank_added_back_after_missing_batches_holds_what_its_engine_holds,
     .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	back_remove(&w);
	back_store(&w, 1, B, 3, &A[1]); /* for a rank the router does not have */
	struct kvr_feed_stats st = back_caught_up(&w);
	cr_assert_eq(st.unknown_rank, 1);
	back_add(&w);
	back_store(&w, 2, C, 1, &B[2]);
	back_caught_up(&w);
	uint64_t n = back_indexed(&w, 6);
	cr_assert_eq(n, 6, "the engine holds A, B and C (6 blocks); the rank added back %" PRIu64,
	             n);
	cr_assert_eq(atomic_load(&w.first_from), 0, "replayed from the stream's start");
	cr_assert_eq(atomic_load(&gap_calls), 0, "the replay brought everything");
	back_close(&w);
}

Test(feed_rank_gone, a_rank_removed_and_added_back_between_two_batches_holds_what_its_engine_holds,
     .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	back_remove(&w);
	back_add(&w); /* no batch of the rank between the two */
	/* (The add wakes the feed, which may rebuild A before B comes or, if B comes first, when
	 * B's batch finds the rank another life: either way, once.) */
	back_store(&w, 1, B, 3, &A[1]);
	back_caught_up(&w);
	uint64_t n = back_indexed(&w, 5);
	cr_assert_eq(n, 5, "the engine holds A and B (5 blocks); the rank added back %" PRIu64, n);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	back_close(&w);
}

Test(feed_rank_gone, a_rank_removed_while_its_events_were_on_their_way_is_rebuilt_once_added_back,
     .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	atomic_store(&armed, true);
	back_store(&w, 1, B, 3, &A[1]); /* refused: the rank went as it was posted */
	struct kvr_feed_stats st = back_caught_up(&w);
	cr_assert(!atomic_load(&armed), "the window was not forced");
	cr_assert_eq(st.refused, 1);
	cr_assert_eq(kvr_test_metric(w.r, "kvr_events_total{type=\"any\",status=\"rank_gone\"}"),
	             1);
	back_add(&w);
	/* Rebuilt with no further batch (the publisher may be quiet for long): the feed knows the
	 * rank went from its refused events, and looks for it to come back. */
	uint64_t n = back_indexed(&w, 5);
	cr_assert_eq(n, 5, "the engine holds A and B (5 blocks); the rank added back %" PRIu64, n);
	/* The engine goes on below B: once added back, the rank must hold B for C to apply. */
	back_store(&w, 2, C, 1, &B[2]);
	back_caught_up(&w);
	n = back_indexed(&w, 6);
	cr_assert_eq(n, 6, "the engine holds A, B and C (6 blocks); the rank added back %" PRIu64,
	             n);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	back_close(&w);
}

/* The rank removed after the feed took B for it but before the event path looked it up: the
 * post finds no rank (B refused, not posted). */
Test(feed_rank_gone, a_rank_removed_before_its_events_were_posted_is_rebuilt_once_added_back,
     .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	atomic_store(&armed_hash, ARM_REMOVE);
	back_store(&w, 1, B, 3, &A[1]);
	struct kvr_feed_stats st = back_caught_up(&w);
	cr_assert_eq(atomic_load(&armed_hash), ARM_NONE, "the window was not forced");
	cr_assert_eq(st.refused, 1);
	back_add(&w);
	uint64_t n = back_indexed(&w, 5);
	cr_assert_eq(n, 5, "the engine holds A and B (5 blocks); the rank added back %" PRIu64, n);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	back_close(&w);
}

/* Removed and added back in that window: B goes to the rank's new life, which is empty (B is
 * refused there for its parent), and no batch follows to tell the feed. */
Test(feed_rank_gone, a_rank_removed_and_added_back_before_its_events_were_posted_is_rebuilt,
     .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	atomic_store(&armed_hash, ARM_BACK);
	back_store(&w, 1, B, 3, &A[1]);
	back_caught_up(&w);
	cr_assert_eq(atomic_load(&armed_hash), ARM_NONE, "the window was not forced");
	uint64_t n = back_indexed(&w, 5);
	cr_assert_eq(n, 5, "the engine holds A and B (5 blocks); the rank added back %" PRIu64, n);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	back_close(&w);
}

Test(feed_rank_gone, without_a_replay_what_a_rank_added_back_lacks_is_reported, .timeout = 120)
{
	struct back w;
	back_open(&w, false);
	back_store(&w, 0, A, 2, NULL);
	back_caught_up(&w);
	back_remove(&w);
	back_store(&w, 1, B, 3, &A[1]);
	back_caught_up(&w);
	back_add(&w);
	back_store(&w, 2, D, 1, NULL);
	back_caught_up(&w);
	cr_assert_eq(back_indexed(&w, 1), 1, "D only");
	cr_assert_eq(atomic_load(&gap_calls), 1, "the batches the rank lacks are reported");
	cr_assert_eq(atomic_load(&gap_from), 0, "from A's batch, which the removal took: %" PRIu64,
	             atomic_load(&gap_from));
	cr_assert_eq(atomic_load(&gap_to), 2);
	back_close(&w);
}

/* Removed and added back while its publisher is quiet and nothing of it is in flight: no batch,
 * no refusal tells the feed, so the add does (kvr_rank_add wakes the router's feeds, which look
 * for ranks that are another life than the one they fed).  Before, the rank stayed empty until
 * its publisher's next batch, however long the engine stayed idle. */
Test(feed_rank_gone, a_rank_removed_and_added_back_while_its_publisher_is_quiet_is_rebuilt,
     .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	back_store(&w, 1, B, 3, &A[1]);
	back_caught_up(&w);
	cr_assert_eq(back_indexed(&w, 5), 5);
	back_remove(&w);
	back_add(&w);
	uint64_t n = back_indexed(&w, 5);
	cr_assert_eq(n, 5, "the engine holds A and B (5 blocks); the rank added back %" PRIu64, n);
	cr_assert_eq(atomic_load(&w.first_from), 0, "replayed from the stream's start");
	cr_assert_eq(atomic_load(&gap_calls), 0);
	/* Removed and added back again: rebuilt again, from the stream's start. */
	back_remove(&w);
	back_add(&w);
	n = back_indexed(&w, 5);
	cr_assert_eq(n, 5, "rebuilt a second time: %" PRIu64, n);
	cr_assert_eq(atomic_load(&w.asks), 2, "one replay per add");
	/* The engine goes on below B: C applies. */
	back_store(&w, 2, C, 1, &B[2]);
	back_caught_up(&w);
	cr_assert_eq(back_indexed(&w, 6), 6);
	cr_assert_eq(atomic_load(&gap_calls), 0);
	back_close(&w);
}

/* The replay's answer brought every batch the rank missed but not its end marker (a replayer's
 * ROUTER past its send bound drops what follows, stress_feed_rank_churn SFC_ROUTER_HWM=1): the
 * rank holds all it missed, so nothing is reported and it stays as rebuilt.  Before, the replay's
 * timeout was taken for a hole even with nothing missing ("missed seq 2..2"): on_event_gap was
 * called and the rebuilt rank cleared, though its engine held A and B. */
Test(feed_rank_gone, a_rebuild_whose_answer_lacks_only_its_end_marker_is_whole, .timeout = 120)
{
	struct back w;
	back_open_holding_a(&w);
	back_store(&w, 1, B, 3, &A[1]);
	back_caught_up(&w);
	cr_assert_eq(back_indexed(&w, 5), 5);
	atomic_store(&w.no_end, true);
	back_remove(&w);
	back_add(&w);
	cr_assert_eq(back_indexed(&w, 5), 5);
	/* The replay waits for the end marker until the answer is quiet (FEED_REPLAY_QUIET_MS;
	 * replay_timeout_ms, 1 s, before); then no gap. */
	sleep_ms(1500);
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w.f, w.pub.id, &st), 0);
	cr_assert_eq(atomic_load(&w.asks), 1);
	cr_assert_eq(atomic_load(&gap_calls), 0, "a gap of %" PRIu64 "..%" PRIu64 " reported",
	             atomic_load(&gap_from), atomic_load(&gap_to));
	cr_assert_eq(st.gaps, 0);
	uint64_t n = test_indexed_blocks(w.r);
	cr_assert_eq(n, 5, "the engine holds A and B (5 blocks); the rank %" PRIu64, n);
	back_close(&w);
}
