/*
 * Replays take turns (sync/feed_seq.c, "Replays take turns"): a feed with several endpoints
 * whose replays are slow asks for one replay a round of its loop, and serves every endpoint's
 * live batches and the calls waiting between two of them.  Before, one round asked every replay
 * it found, one after the other: with N slow replayers the feed's thread was held N replays'
 * ends, and a live batch on another endpoint, or a stats call, waited behind all of them.  A gap
 * that waits for its turn is replayed (or reported, the rank cleared) as before: never lost.
 *
 * The scene: endpoint L (worker 9, no replay endpoint) first in the feed, then S1..S3 (workers
 * 1..3), each with a replay endpoint the test holds and never answers: each replay ends after
 * one ask, at replay_timeout_ms (REPLAY_MS), with a gap reported.  Nothing here measures time:
 * the tests compare the order of what the feed does (the asks the replayers receive, a live
 * batch visible in the index).  The only timing is the window that makes the "before" fail:
 * REPLAY_MS, during which the test's few calls run (ms).
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/mono_clock.h"

enum { NS = 3, REPLAY_MS = 2000 };

static atomic_int gap_calls;
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp, (void)from, (void)to;
	atomic_fetch_add(&gap_calls, 1);
}

struct side {
	struct test_pub pub;
	void *router; /* the replay endpoint (S only): never answered */
	char rep[256];
	uint32_t id;
};

struct scene {
	struct kvr_router *r;
	struct kvr_feed *f;
	struct side l, s[NS];
	int asks[NS]; /* replay requests each S's replayer received */
};

static uint64_t block_of(uint64_t worker, uint64_t seq)
{
	return 0x70000 + worker * 0x1000 + seq;
}

/* Batch seq of worker's publisher: stores block_of(worker, seq) on dp rank 0. */
static void send_store(struct side *d, uint64_t worker, uint64_t seq)
{
	struct kvr_fenc e;
	uint64_t h = block_of(worker, seq);
	kvr_fenc_init(&e);
	kvr_fenc_begin(&e, 1.0, 1);
	kvr_fenc_stored(&e, &h, 1, NULL, TEST_BLOCK_TOKENS, test_block_tokens, &h);
	kvr_fenc_end(&e, 0);
	test_pub_send(&d->pub, seq, (const uint8_t *)e.sb.data, e.sb.size);
	kvr_fenc_fini(&e);
}

static void add_rank(struct scene *c, uint64_t worker)
{
	cr_assert_eq(kvr_rank_add(c->r, (struct kvr_rank_id){worker, 0}, 1, KVR_CAPACITY_NONE, 0),
	             0);
}

/* Rank (9, 0) added, and (1..3, 0) too when s_ranks; L first in the feed, then S1..S3. */
static void open_scene(struct scene *c, bool s_ranks)
{
	memset(c, 0, sizeof(*c));
	atomic_store(&gap_calls, 0);
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.mode = KVR_MODE_EVENTS;
	cfg.block_size = TEST_BLOCK_TOKENS;
	cfg.n_shards = 1;
	cfg.on_event_gap = on_gap;
	cr_assert_eq(kvr_router_create(&cfg, &c->r), 0);
	add_rank(c, 9);
	for (uint64_t k = 1; s_ranks && k <= NS; k++)
		add_rank(c, k);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.replay_timeout_ms = REPLAY_MS;
	cr_assert_eq(kvr_feed_create(c->r, &fc, &c->f), 0);
	test_pub_open(&c->l.pub);
	struct kvr_feed_endpoint fe = {.endpoint = c->l.pub.ep, .worker_id = 9};
	cr_assert_eq(kvr_feed_add(c->f, &fe, &c->l.id), 0);
	test_pub_subscribed(&c->l.pub);
	for (int k = 0; k < NS; k++) {
		struct side *d = &c->s[k];
		test_pub_open(&d->pub);
		d->router = zmq_socket(d->pub.zctx, ZMQ_ROUTER);
		cr_assert_not_null(d->router);
		cr_assert_eq(zmq_bind(d->router, "tcp://127.0.0.1:*"), 0);
		size_t cap = sizeof(d->rep);
		cr_assert_eq(zmq_getsockopt(d->router, ZMQ_LAST_ENDPOINT, d->rep, &cap), 0);
		struct kvr_feed_endpoint se = {
		    .endpoint = d->pub.ep, .replay_endpoint = d->rep, .worker_id = (uint64_t)k + 1};
		cr_assert_eq(kvr_feed_add(c->f, &se, &d->id), 0);
		test_pub_subscribed(&d->pub);
	}
}

static void close_scene(struct scene *c)
{
	kvr_feed_destroy(c->f);
	kvr_router_destroy(c->r);
	test_pub_close(&c->l.pub);
	for (int k = 0; k < NS; k++) {
		zmq_close(c->s[k].router);
		test_pub_close(&c->s[k].pub);
	}
}

/* Waits (within ms) for the next replay request to any S; returns its index, -1 if none came.
 * The request is read and left unanswered. */
static int next_ask(struct scene *c, long ms)
{
	zmq_pollitem_t it[NS];
	for (int k = 0; k < NS; k++)
		it[k] = (zmq_pollitem_t){.socket = c->s[k].router, .events = ZMQ_POLLIN};
	if (zmq_poll(it, NS, ms) <= 0)
		return -1;
	for (int k = 0; k < NS; k++) {
		if (!(it[k].revents & ZMQ_POLLIN))
			continue;
		uint8_t buf[64];
		int more = 1;
		size_t sz = sizeof(more);
		while (more) { /* [identity, "", start] */
			cr_assert_geq(zmq_recv(c->s[k].router, buf, sizeof(buf), 0), 0);
			zmq_getsockopt(c->s[k].router, ZMQ_RCVMORE, &more, &sz);
		}
		c->asks[k]++;
		return k;
	}
	return -1;
}

/* Waits (5 s at most) until the feed took every batch before seq next from endpoint id. */
static void feed_at(struct scene *c, uint32_t id, uint64_t next)
{
	struct kvr_feed_stats st;
	for (int k = 0; k < 500; k++) {
		cr_assert_eq(kvr_feed_get_stats(c->f, id, &st), 0);
		if (st.next_seq == next)
			return;
		sleep_ms(10);
	}
	cr_assert_fail("endpoint %u took %" PRIu64 " batches, not %" PRIu64, id, st.next_seq, next);
}

/* Whether rank (9, 0) holds L's batch 1 once the shards ran everything posted so far. */
/* The scene with its first n slow endpoints fed from batch 1 (each publisher's batch 0 stored
 * before), then S1's jump at 5: its replay, unanswered, holds the feed's turn. */
static void s1_replaying(struct scene *c, int n)
{
	open_scene(c, true);
	for (int k = 0; k < n; k++)
		send_store(&c->s[k], (uint64_t)k + 1, 0);
	for (int k = 0; k < n; k++)
		feed_at(c, c->s[k].id, 1);
	send_store(&c->s[0], 1, 5);
	cr_assert_eq(next_ask(c, 10000), 0, "S1's replay is asked for");
}

static bool live_batch_indexed(struct scene *c)
{
	cr_assert_eq(kvr_router_sync(c->r, 5000), 0);
	uint64_t got[8];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(c->r, (struct kvr_rank_id){9, 0}, got, 8, &n), 0);
	for (size_t i = 0; i < n && i < 8; i++)
		if (got[i] == block_of(9, 1))
			return true;
	return false;
}

/* Every S's replay asked for once and given up as unanswered (a gap each, reported): within a
 * generous bound (NS replays of REPLAY_MS, plus slack for a loaded machine). */
static void all_gaps_reported(struct scene *c, int asked)
{
	for (int t = 0; t < 4000 && atomic_load(&gap_calls) < NS; t++) {
		if (asked < NS && next_ask(c, 0) >= 0)
			asked++;
		sleep_ms(10);
	}
	while (asked < NS && next_ask(c, 1000) >= 0)
		asked++;
	cr_assert_eq(atomic_load(&gap_calls), NS, "%d gaps reported, not %d",
	             atomic_load(&gap_calls), NS);
	for (int k = 0; k < NS; k++)
		cr_assert_eq(c->asks[k], 1, "S%d's replayer asked %d times", k + 1, c->asks[k]);
}

/* A replay asked for (a second one due in the same round), L's batch 1 sent: the next replay is
 * asked for only after L's batch is applied.  Before, the next ask came as soon as the replay
 * ended, L's batch still in its socket: the feed's thread went from one replay to the next
 * within the round, L's batch waiting for them all. */
static void live_between_replays(struct scene *c, int asked)
{
	uint64_t t0 = now_ms();
	send_store(&c->l, 9, 1);
	int next = next_ask(c, 10000);
	cr_assert_geq(next, 0, "another replay is asked for");
	bool indexed = live_batch_indexed(c);
	cr_log_info("next replay asked %" PRIu64 " ms after L's batch was sent; L's batch %s then",
	            now_ms() - t0, indexed ? "applied" : "not applied");
	cr_assert(indexed, "L's live batch was not applied before the next replay was asked for: "
	                   "the feed's thread went from one slow replay to the next");
	all_gaps_reported(c, asked + 1);
}

/* Ranks added late (resyncs): S1..S3 each send batches 0..2 for a rank the router lacks, then the
 * three ranks are added: before, one round resynced all three (kvr_feed_resync_added), one
 * replay after the other. */
static void resync_scene(struct scene *c)
{
	open_scene(c, false);
	send_store(&c->l, 9, 0);
	for (int k = 0; k < NS; k++)
		for (uint64_t q = 0; q < 3; q++)
			send_store(&c->s[k], (uint64_t)k + 1, q);
	feed_at(c, c->l.id, 1);
	for (int k = 0; k < NS; k++)
		feed_at(c, c->s[k].id, 3);
	for (uint64_t k = 1; k <= NS; k++)
		add_rank(c, k);
}

Test(feed_replay_turns, resyncs_of_several_ranks_let_live_batches_through_between_them,
     .timeout = 120)
{
	struct scene c;
	resync_scene(&c);
	cr_assert_geq(next_ask(&c, 10000), 0, "a first replay is asked for");
	cr_assert_geq(next_ask(&c, 10000), 0, "a second replay is asked for");
	live_between_replays(&c, 2);
	close_scene(&c);
}

/* Live gaps: S1..S3 each fed batch 0; S1 jumps to batch 5, and while its replay holds the feed's
 * thread S2 and S3 jump too, so that one poll finds both (before, that round replayed both, one
 * after the other). */
Test(feed_replay_turns, gaps_on_several_endpoints_let_live_batches_through_between_them,
     .timeout = 120)
{
	struct scene c;
	open_scene(&c, true);
	send_store(&c.l, 9, 0);
	for (int k = 0; k < NS; k++)
		send_store(&c.s[k], (uint64_t)k + 1, 0);
	feed_at(&c, c.l.id, 1);
	for (int k = 0; k < NS; k++)
		feed_at(&c, c.s[k].id, 1);
	send_store(&c.s[0], 1, 5);
	cr_assert_eq(next_ask(&c, 10000), 0, "S1's replay is asked for");
	for (int k = 1; k < NS; k++)
		send_store(&c.s[k], (uint64_t)k + 1, 5);
	cr_assert_geq(next_ask(&c, 10000), 1, "a second replay is asked for");
	live_between_replays(&c, 2);
	/* Each gap's batch applied after its gap was reported (the rank cleared, then 5 stored):
	 * a batch held for its turn, not dropped. */
	for (int k = 0; k < NS; k++) {
		feed_at(&c, c.s[k].id, 6);
		uint64_t got[8];
		size_t n = 0;
		cr_assert_eq(kvr_router_sync(c.r, 5000), 0);
		cr_assert_eq(
		    kvr_rank_blocks(c.r, (struct kvr_rank_id){(uint64_t)k + 1, 0}, got, 8, &n), 0);
		cr_assert(n == 1 && got[0] == block_of((uint64_t)k + 1, 5),
		          "rank (%d, 0) holds %zu blocks, not only batch 5's", k + 1, n);
	}
	close_scene(&c);
}

/* A stats call made during the first of NS slow replays returns before the last is asked for.
 * Before, it waited for every replay (it is served after the round's replays). */
Test(feed_replay_turns, a_stats_call_waits_for_one_replay_not_all, .timeout = 120)
{
	struct scene c;
	resync_scene(&c);
	int asked = next_ask(&c, 10000) >= 0;
	cr_assert(asked, "a replay is asked for");
	struct kvr_feed_stats st;
	uint64_t t0 = now_ms();
	cr_assert_eq(kvr_feed_get_stats(c.f, KVR_FEED_ALL, &st), 0);
	cr_log_info("the stats call waited %" PRIu64 " ms (one replay: %d ms)", now_ms() - t0,
	            REPLAY_MS);
	/* Asks already sent are in the replayers' sockets within a moment (local TCP); the one
	 * the turns would not allow yet would have been sent REPLAY_MS before the call returned. */
	while (next_ask(&c, 200) >= 0)
		asked++;
	cr_assert_lt(asked, NS,
	             "all %d replays were asked for before a stats call made during the first "
	             "returned",
	             asked);
	all_gaps_reported(&c, asked);
	close_scene(&c);
}

/* Rank (worker, 0) holds exactly block_of(worker, seq). */
static void holds_only(struct scene *c, uint64_t worker, uint64_t seq)
{
	uint64_t got[8];
	size_t n = 0;
	cr_assert_eq(kvr_router_sync(c->r, 5000), 0);
	cr_assert_eq(kvr_rank_blocks(c->r, (struct kvr_rank_id){worker, 0}, got, 8, &n), 0);
	cr_assert(n == 1 && got[0] == block_of(worker, seq),
	          "rank (%" PRIu64 ", 0) holds %zu blocks, not only batch %" PRIu64 "'s", worker, n,
	          seq);
}

/* The feed destroyed while S2's replay runs and S3's gap waits for its turn: neither is
 * reported (the feed going away missed nothing of the publisher's), and both ranks are cleared
 * (what the index held of them from before the gap may have been removed in it; no later event
 * of this feed would say so), as a replay a destroy ends leaves its rank (test_feed_replay_stop):
 * the held batch is taken as the thread ends, not dropped with its endpoint. */
Test(feed_replay_turns, a_gap_waiting_for_its_turn_at_a_destroy_is_cleared_unreported,
     .timeout = 120)
{
	struct scene c;
	s1_replaying(&c, NS);
	for (int k = 1; k < NS; k++)
		send_store(&c.s[k], (uint64_t)k + 1, 5);
	cr_assert_eq(next_ask(&c, 10000), 1, "S2's replay is asked for, S3's gap waits");
	cr_assert_eq(atomic_load(&gap_calls), 1, "S1's gap is reported");
	kvr_feed_destroy(c.f);
	c.f = NULL;
	cr_assert_eq(atomic_load(&gap_calls), 1, "a gap the destroy ended is reported");
	for (uint64_t w = 1; w <= NS; w++)
		holds_only(&c, w, 5);
	close_scene(&c);
}

/* An endpoint that gaps again during each of its own replays cannot keep another's gap waiting:
 * the turn goes to the oldest waiting (tickets), not to the first endpoint in the feed.  S1
 * (before S2 in the feed) jumps at 5, then at 10 and 15 during its replays; S2 jumps at 5 during
 * S1's first.  The second round holds S1's 10 and S2's 5 (S1's first: it is drained first) and
 * serves S1; the third holds S1's 15, newer than S2's, and serves S2.  Taken in the feed's order,
 * S1 would be served every round for as long as it gapped. */
Test(feed_replay_turns, an_endpoint_that_gaps_every_round_does_not_starve_another, .timeout = 120)
{
	struct scene c;
	s1_replaying(&c, 2);
	send_store(&c.s[1], 2, 5);
	send_store(&c.s[0], 1, 10);
	cr_assert_eq(next_ask(&c, 10000), 0, "S1's second replay (its gap held first)");
	send_store(&c.s[0], 1, 15);
	cr_assert_eq(next_ask(&c, 10000), 1, "S2's replay, before S1's third");
	cr_assert_eq(next_ask(&c, 10000), 0, "then S1's third");
	for (int t = 0; t < 1000 && atomic_load(&gap_calls) < 4; t++)
		sleep_ms(10);
	cr_assert_eq(atomic_load(&gap_calls), 4, "S1's three gaps and S2's reported");
	holds_only(&c, 1, 15);
	holds_only(&c, 2, 5);
	close_scene(&c);
}

/* An endpoint removed while a live batch of it is held for its rank's resync (the rank removed
 * and added back) and another endpoint's slow replay has the turn (the review's probe).  Before,
 * the remove took the held batch outside any turn, its resync waited for one, and the batch was
 * dropped as unknown_rank with the endpoint: no replay asked, no gap reported, the rank left
 * without the batch's block.  Now the remove replays it, as it did before turns. */
Test(feed_replay_turns, an_endpoint_removed_with_a_batch_held_for_its_ranks_resync_replays_it,
     .timeout = 120)
{
	struct scene c;
	s1_replaying(&c, 2);
	cr_assert_eq(kvr_rank_remove(c.r, (struct kvr_rank_id){2, 0}), 0);
	add_rank(&c, 2);
	send_store(&c.s[1], 2, 1); /* held: its rank resyncs */
	int gaps0 = atomic_load(&gap_calls);
	cr_assert_eq(kvr_feed_remove(c.f, c.s[1].id), 0); /* after S1's replay, before the turn */
	int asked = 0;
	while (next_ask(&c, 300) >= 0)
		asked++;
	cr_assert_eq(kvr_router_sync(c.r, 5000), 0);
	uint64_t got[8];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(c.r, (struct kvr_rank_id){2, 0}, got, 8, &n), 0);
	int gaps = atomic_load(&gap_calls) - gaps0;
	close_scene(&c);
	cr_assert_eq(asked, 1, "S2's resync asked %d replays", asked);
	cr_assert_geq(gaps, 1, "S2's unanswered resync was not reported");
	cr_assert(n == 1 && got[0] == block_of(2, 1), "rank (2,0) holds %zu blocks, not batch 1's",
	          n);
}
