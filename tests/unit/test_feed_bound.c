/* The events-mode stored-block bound behind the real KV event feed (a ZeroMQ publisher in this
 * process sending vLLM's BlockStored batches): a publisher that never removes keeps its rank at
 * kvr_config.events_max_blocks, the feed counts the refused events (kvr_feed_stats.refused), and
 * on_event_gap is called once per episode on the feed's thread (an unnumbered event: (0, 1)),
 * again after the publisher's AllBlocksCleared and a new excess.  The feed's own set of blocks on
 * another medium (CPU offload) has the same bound.  A store the index refuses because its run-id
 * space is full is told apart from the bound: its own log line, metric and report. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "core/index_internal.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/metric.h"

static atomic_int gap_calls;
static atomic_uint_fast64_t gap_from, gap_to;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp;
	atomic_store(&gap_from, from);
	atomic_store(&gap_to, to);
	atomic_fetch_add(&gap_calls, 1);
}

/* How many log lines named the bound, and the index's full run-id space; the lines
 * themselves (the first LOGS). */
static atomic_int bound_logs, full_logs;
enum { LOGS = 32 };
static char logs[LOGS][512];
static atomic_int n_logs;

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level;
	if (strstr(msg, "bound"))
		atomic_fetch_add(&bound_logs, 1);
	if (strstr(msg, "the most runs it can name"))
		atomic_fetch_add(&full_logs, 1);
	int k = atomic_load(&n_logs);
	if (k < LOGS) {
		snprintf(logs[k], sizeof(logs[k]), "%s", msg);
		atomic_store(&n_logs, k + 1); /* the feed thread is the only writer */
	}
}

/* Whether a log line holds both a and b. */
static bool logged(const char *a, const char *b)
{
	for (int k = 0; k < atomic_load(&n_logs); k++)
		if (strstr(logs[k], a) && strstr(logs[k], b))
			return true;
	return false;
}

enum { BS = TEST_BLOCK_TOKENS, PER = 8, BOUND = 64 };

/* Sends one batch: a root chain of PER blocks from hash first on medium, or a clear (medium
 * NULL). */
static void send_on(struct test_pub *p, struct kvr_fenc *e, uint64_t seq, uint64_t first,
                    const char *medium)
{
	uint64_t h[PER];
	for (int i = 0; i < PER; i++)
		h[i] = first + (uint64_t)i;
	kvr_fenc_begin(e, 1.0, 1);
	if (!medium)
		kvr_fenc_cleared(e);
	else
		kvr_fenc_stored_on(e, medium, h, PER, NULL, BS, test_block_tokens, h);
	kvr_fenc_end(e, 0);
	cr_assert_eq(kvr_fenc_send(p->pub, seq, e->sb.data, e->sb.size), 0);
}

static void send_batch(struct test_pub *p, struct kvr_fenc *e, uint64_t seq, uint64_t first,
                       bool clear)
{
	send_on(p, e, seq, first, clear ? NULL : "GPU");
}

/* Waits until the feed has applied `batches` batches. */
static struct kvr_feed_stats settled(struct kvr_feed *f, uint32_t id, uint64_t batches)
{
	struct kvr_feed_stats st;
	for (int t = 0; t < 3000; t++) {
		cr_assert_eq(kvr_feed_get_stats(f, id, &st), 0);
		if (st.batches >= batches)
			break;
		struct timespec ts = {0, 10000000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(st.batches, batches);
	return st;
}

/* One events-mode router (bound BOUND, rank {0,0} without a capacity) and a feed on one
 * publisher, with the test's gap callback and log. */
struct rig {
	struct kvr_router *r;
	struct test_pub pub;
	struct kvr_feed *f;
	uint32_t id;
	struct kvr_fenc e;
};

static void rig_open(struct rig *g)
{
	g->r = test_events_router_max(on_gap, BOUND);
	test_pub_open(&g->pub);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log;
	cr_assert_eq(kvr_feed_create(g->r, &fc, &g->f), 0);
	struct kvr_feed_endpoint fe = {.endpoint = g->pub.ep, .worker_id = 0, .dp_rank = 0};
	cr_assert_eq(kvr_feed_add(g->f, &fe, &g->id), 0);
	test_pub_subscribed(&g->pub);
	kvr_fenc_init(&g->e);
}

static void rig_close(struct rig *g)
{
	kvr_fenc_fini(&g->e);
	kvr_feed_destroy(g->f);
	test_pub_close(&g->pub);
	kvr_router_destroy(g->r);
}

Test(feed_bound, publisher_past_the_bound, .timeout = 120)
{
	struct rig g;
	rig_open(&g);
	struct kvr_router *r = g.r;
	struct kvr_feed *f = g.f;
	uint32_t id = g.id;
	/* 40 batches of 8 new blocks, never a removal: 5x the bound. */
	uint64_t seq = 0;
	for (int k = 0; k < 40; k++)
		send_batch(&g.pub, &g.e, seq++, 1 + (uint64_t)k * 100, false);
	struct kvr_feed_stats st = settled(f, id, seq);
	cr_assert_eq(test_indexed_blocks(r), BOUND, "the rank stays at its bound");
	cr_assert_eq(st.refused, 40 - BOUND / PER, "the feed counts the refused events");
	cr_assert_eq(st.gaps, 0, "no seq gap");
	cr_assert_eq(atomic_load(&gap_calls), 1, "one report for the episode");
	cr_assert_eq(atomic_load(&gap_from), 0);
	cr_assert_eq(atomic_load(&gap_to), 1);
	cr_assert_gt(atomic_load(&bound_logs), 0, "the log names the bound");
	/* The publisher clears (as vLLM's reset_prefix_cache): room again, a new episode later. */
	send_batch(&g.pub, &g.e, seq++, 0, true);
	for (int k = 0; k < BOUND / PER + 1; k++)
		send_batch(&g.pub, &g.e, seq++, 100000 + (uint64_t)k * 100, false);
	st = settled(f, id, seq);
	cr_assert_eq(test_indexed_blocks(r), BOUND);
	cr_assert_eq(st.refused, 40 - BOUND / PER + 1);
	cr_assert_eq(atomic_load(&gap_calls), 2);
	rig_close(&g);
}

/* Blocks on another medium are kept by the feed, not the index, under the same bound: a CPU
 * offload tier that never reports a removal stays at events_max_blocks, the excess refused and
 * logged, the GPU index untouched and no gap reported (the GPU view is not out of sync). */
Test(feed_bound, other_medium_past_the_bound, .timeout = 120)
{
	struct rig g;
	rig_open(&g);
	uint64_t seq = 0;
	for (int k = 0; k < 40; k++)
		send_on(&g.pub, &g.e, seq++, 1 + (uint64_t)k * 100, "CPU");
	struct kvr_feed_stats st = settled(g.f, g.id, seq);
	cr_assert_eq(st.other_medium_blocks, BOUND, "the set stays at the bound");
	cr_assert_eq(st.refused, 40 - BOUND / PER, "the excess is refused");
	cr_assert_gt(atomic_load(&bound_logs), 0, "and logged, naming the bound");
	cr_assert_eq(test_indexed_blocks(g.r), 0, "the GPU index holds none of it");
	cr_assert_eq(atomic_load(&gap_calls), 0);
	/* A clear empties it: room again. */
	send_on(&g.pub, &g.e, seq++, 0, NULL);
	send_on(&g.pub, &g.e, seq++, 5000, "CPU");
	st = settled(g.f, g.id, seq);
	cr_assert_eq(st.other_medium_blocks, PER);
	rig_close(&g);
}

/* Token ids of block i of a chain: ctx is the chain's first key (any value), so that the test
 * can name each block by the router's own sequence hash of them. */
static const uint32_t *key_tokens(void *ctx, size_t i)
{
	static _Thread_local uint32_t t[BS];
	const uint64_t *key = ctx;
	for (uint32_t j = 0; j < BS; j++)
		t[j] = (uint32_t)(*key * 2654435761u + i * 7919u) + j;
	return t;
}

/* Sends a batch of one root chain of 2 blocks whose hashes are the router's sequence hashes of
 * their tokens, as kvr_route would name them: such runs take a run id in the index (the block
 * locator's; core/index_blocks.c), aliased ones (vLLM's own hashes) do not. */
static void send_plain(struct rig *g, uint64_t seq, uint64_t key)
{
	uint32_t tok[2 * BS];
	for (size_t i = 0; i < 2; i++)
		memcpy(tok + i * BS, key_tokens(&key, i), sizeof(uint32_t) * BS);
	uint64_t seqh[2];
	cr_assert_eq(kvr_hash_blocks(tok, 2 * BS, BS, NULL, NULL, seqh), 2);
	kvr_fenc_begin(&g->e, 1.0, 1);
	kvr_fenc_stored(&g->e, seqh, 2, NULL, BS, key_tokens, &key);
	kvr_fenc_end(&g->e, 0);
	cr_assert_eq(kvr_fenc_send(g->pub.pub, seq, g->e.sb.data, g->e.sb.size), 0);
}

/* kvr_events_total{type="stored",status="index_full"}. */
static uint64_t index_full_events(struct kvr_router *r)
{
	static char buf[1 << 16];
	size_t len = 0;
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf), &len), 0);
	const char *key = "\nkvr_events_total{type=\"stored\",status=\"index_full\"} ";
	const char *p = strstr(buf, key);
	cr_assert(p, "index_full status rendered");
	return strtoull(p + strlen(key), NULL, 10);
}

/* A stored event the index refuses because every run id is in use (2^25 - 1 runs; lowered to 3
 * here through the directory's id_limit, which only tests set) is not the rank's bound: the
 * feed logged it as "at its stored-block bound" and nothing reported it lost.  Now the log says
 * why, it is counted as refused and under its own status, and on_event_gap reports it lost
 * once (an unnumbered event: (0, 1)), as at the bound; further refusals in a row are the same
 * episode. */
Test(feed_bound, full_run_id_space_is_not_the_bound, .timeout = 120)
{
	struct rig g;
	rig_open(&g);
	g.r->index->blk.id_limit = 3; /* before any store: the shard's next write reads it */
	uint64_t seq = 0;
	for (uint64_t k = 1; k <= 5; k++)
		send_plain(&g, seq++, k);
	struct kvr_feed_stats st = settled(g.f, g.id, seq);
	cr_assert_eq(test_indexed_blocks(g.r), 6, "three runs of two blocks");
	cr_assert_eq(st.refused, 2, "the fourth and fifth stores are refused");
	cr_assert_eq(atomic_load(&bound_logs), 0, "not the stored-block bound");
	cr_assert_gt(atomic_load(&full_logs), 0, "the log says the index is full");
	cr_assert_eq(index_full_events(g.r), 2);
	cr_assert_eq(atomic_load(&gap_calls), 1, "reported lost, once for the episode");
	cr_assert_eq(atomic_load(&gap_from), 0);
	cr_assert_eq(atomic_load(&gap_to), 1);
	rig_close(&g);
}

/* Each store the index refuses is logged with its own reason, as kvr_events_apply's detail gives
 * it, not kvr_strerror's generic words: a parent the rank does not hold read "no such rank,
 * attempt, block or object" (the rank was there), a block named as its own parent and one that
 * contradicts the rank's blocks both read "invalid argument". */
Test(feed_bound, refused_stores_name_their_reason, .timeout = 120)
{
	struct rig g;
	rig_open(&g);
	uint64_t seq = 0, h[2] = {10, 11}, key = 1;
	/* Applied: 10 <- 11. */
	kvr_fenc_begin(&g.e, 1.0, 1);
	kvr_fenc_stored(&g.e, h, 2, NULL, BS, key_tokens, &key);
	kvr_fenc_end(&g.e, 0);
	cr_assert_eq(kvr_fenc_send(g.pub.pub, seq++, g.e.sb.data, g.e.sb.size), 0);
	/* 11 again as a root block of other tokens: a hash the rank holds for another block. */
	key = 2;
	kvr_fenc_begin(&g.e, 1.0, 1);
	kvr_fenc_stored(&g.e, &h[1], 1, NULL, BS, key_tokens, &key);
	kvr_fenc_end(&g.e, 0);
	cr_assert_eq(kvr_fenc_send(g.pub.pub, seq++, g.e.sb.data, g.e.sb.size), 0);
	/* 20 <- 20: a block its own parent's. */
	uint64_t self[2] = {20, 20};
	kvr_fenc_begin(&g.e, 1.0, 1);
	kvr_fenc_stored(&g.e, self, 2, NULL, BS, key_tokens, &key);
	kvr_fenc_end(&g.e, 0);
	cr_assert_eq(kvr_fenc_send(g.pub.pub, seq++, g.e.sb.data, g.e.sb.size), 0);
	/* 31 below 30, which the rank does not hold. */
	uint64_t parent = 30, child = 31;
	kvr_fenc_begin(&g.e, 1.0, 1);
	kvr_fenc_stored(&g.e, &child, 1, &parent, BS, key_tokens, &key);
	kvr_fenc_end(&g.e, 0);
	cr_assert_eq(kvr_fenc_send(g.pub.pub, seq++, g.e.sb.data, g.e.sb.size), 0);
	struct kvr_feed_stats st = settled(g.f, g.id, seq);
	cr_assert_eq(st.refused, 3);
	cr_assert_eq(test_indexed_blocks(g.r), 2);
	for (int k = 0; k < atomic_load(&n_logs); k++)
		cr_log_info("log: %s", logs[k]);
	cr_assert(logged("BlockStored", "contradicts the rank's blocks"), "held for another block");
	cr_assert(logged("BlockStored", "its own parent"), "self-parent");
	cr_assert(logged("BlockStored", "does not hold its parent 0x1e"), "parent not held");
	cr_assert(!logged("not applied", "no such rank"));
	cr_assert(!logged("not applied", "invalid argument"));
	rig_close(&g);
}
