/*
 * stress_feed_replaydestroy - a feed destroyed while it heals a gap by replay (the replay
 * endpoint takes the request and never answers in full): from the main thread
 * (kvr_feed_destroy, which stops and joins the feed's thread), from the feed's own log (the
 * feed's thread tears itself down, detached), or by kvr_router_destroy with the feed still
 * alive; another thread reads the rank meanwhile.  The batch the gap lost removed the block
 * the feed had applied, so the feed clears the rank as the destroy ends the replay
 * (sync/feed_seq.c abandoned_gap): the first two ways must leave the rank without it, and
 * nothing may be reported through on_event_gap.  Under TSan this checks the clear the feed's
 * thread posts to the shard while a destroy waits for it (or does not), and the teardown's
 * order against the router's.
 * Plain program: exit 0 pass, 1 fail, 77 skip (built without zmq).  argv[1]: duration, ms.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/mono_clock.h"
#include "tests/common/vllm_batch.h"

static const uint64_t A[2] = {0xa1, 0xa2};

static struct kvr_feed *_Atomic victim; /* destroyed by its log at the bad reply */
static atomic_int gaps;

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)w, (void)dp, (void)from, (void)to;
	atomic_fetch_add(&gaps, 1);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level;
	if (strstr(msg, "bad replay reply")) {
		struct kvr_feed *f = atomic_exchange(&victim, NULL);
		if (f)
			kvr_feed_destroy(f);
	}
}

struct reader {
	struct kvr_router *r;
	atomic_int stop;
	uint64_t calls;
};

static void *read_rank(void *arg)
{
	struct reader *rd = arg;
	while (!atomic_load(&rd->stop)) {
		struct kvr_rank_stats st;
		(void)kvr_rank_get_stats(rd->r, (struct kvr_rank_id){0, 0}, &st);
		rd->calls++;
	}
	return NULL;
}

/* Whether rank (0, 0) holds A's first block; -1 when it cannot be read. */
static int holds_a(struct kvr_router *r)
{
	uint64_t out[16];
	size_t n = 0;
	if (kvr_router_sync(r, 1000) || kvr_rank_blocks(r, (struct kvr_rank_id){0, 0}, out, 16, &n))
		return -1;
	for (size_t i = 0; i < n; i++)
		if (out[i] == A[0])
			return 1;
	return 0;
}

static int fail(const char *why, int how)
{
	fprintf(stderr, "stress_feed_replaydestroy: %s (way %d)\n", why, how);
	return 1;
}

/* how 0: kvr_feed_destroy from here; 1: from the feed's log; 2: kvr_router_destroy first. */
static int round_once(int how)
{
	atomic_store(&gaps, 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.block_size = TEST_BLOCK_TOKENS;
	c.on_event_gap = on_gap;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r) ||
	    kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0))
		return fail("router", how);
	void *zctx = zmq_ctx_new(), *pub, *rep = zmq_socket(zctx, ZMQ_ROUTER);
	char ep[256], rep_ep[256];
	size_t cap = sizeof(rep_ep);
	if (test_xpub_open(zctx, &pub, ep, sizeof(ep)) || !rep ||
	    zmq_bind(rep, "tcp://127.0.0.1:*") ||
	    zmq_getsockopt(rep, ZMQ_LAST_ENDPOINT, rep_ep, &cap))
		return fail("bind", how);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log;
	fc.replay_timeout_ms = 20000;
	struct kvr_feed *f;
	struct kvr_feed_endpoint fe = {.endpoint = ep, .replay_endpoint = rep_ep};
	uint32_t id;
	uint8_t sub[64];
	if (kvr_feed_create(r, &fc, &f) || kvr_feed_add(f, &fe, &id) ||
	    zmq_recv(pub, sub, sizeof(sub), 0) < 1)
		return fail("feed", how);
	struct kvr_fenc enc;
	kvr_fenc_init(&enc);
	kvr_fenc_begin(&enc, 1.0, 1);
	kvr_fenc_stored(&enc, A, 2, NULL, TEST_BLOCK_TOKENS, test_block_tokens, (void *)A);
	kvr_fenc_end(&enc, 0);
	if (test_batch_send(pub, 0, (const uint8_t *)enc.sb.data, enc.sb.size))
		return fail("send", how);
	kvr_fenc_fini(&enc);
	struct kvr_feed_stats st = {0};
	uint64_t t0 = now_ms();
	while ((kvr_feed_get_stats(f, id, &st) || st.next_seq != 1) && now_ms() - t0 < 10000)
		sleep_us(1000);
	if (st.next_seq != 1 || holds_a(r) != 1)
		return fail("A not applied", how);
	/* seq 1, which removed A, lost: the feed asks from 1 and waits. */
	if (test_batch_send_empty(pub, 2))
		return fail("send", how);
	zmq_msg_t asker;
	zmq_msg_init(&asker);
	uint8_t fr[8];
	if (zmq_msg_recv(&asker, rep, 0) < 0 || zmq_recv(rep, fr, sizeof(fr), 0) != 0 ||
	    zmq_recv(rep, fr, sizeof(fr), 0) != 8)
		return fail("no replay request", how);
	struct reader rd = {.r = r};
	pthread_t th;
	if (pthread_create(&th, NULL, read_rank, &rd))
		return fail("thread", how);
	int bad = 0;
	if (how == 0) {
		kvr_feed_destroy(f);
	} else if (how == 1) {
		atomic_store(&victim, f);
		zmq_send(rep, zmq_msg_data(&asker), zmq_msg_size(&asker), ZMQ_SNDMORE);
		zmq_send(rep, "", 0, ZMQ_SNDMORE);
		zmq_send(rep, "x", 1, 0); /* malformed: logged, and the log destroys f */
		t0 = now_ms();
		while (holds_a(r) == 1 && now_ms() - t0 < 10000)
			sleep_us(1000);
	}
	atomic_store(&rd.stop, 1);
	pthread_join(th, NULL);
	if (how != 2 && holds_a(r) != 0)
		bad = fail("the rank keeps A, removed in the batch the replay never brought", how);
	if (atomic_load(&gaps))
		bad = fail("a gap reported for a replay a destroy ended", how);
	kvr_router_destroy(r); /* how 1: waits for the feed's own teardown */
	if (how == 2)
		kvr_feed_destroy(f);
	zmq_msg_close(&asker);
	zmq_close(rep);
	zmq_close(pub);
	zmq_ctx_term(zctx);
	return bad;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000;
	uint64_t t0 = now_ms();
	int rounds = 0;
	do {
		if (round_once(rounds % 3))
			return 1;
		rounds++;
	} while (now_ms() - t0 < ms);
	printf("stress_feed_replaydestroy: %d rounds, ok\n", rounds);
	return 0;
}
