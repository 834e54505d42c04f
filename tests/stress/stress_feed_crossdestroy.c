/*
 * stress_feed_crossdestroy - two feeds of one router whose callbacks destroy each other (feed
 * 0's callback destroys feed 1 while feed 1's destroys feed 0), then kvr_router_destroy at once
 * on the main thread.  Before, each destroy joined the other feed's thread, which was waiting in
 * its own destroy: both waited for good.  Now each marks the other feed and returns; each feed's
 * thread tears itself down, detached, while the router's destroy waits for both (sync/feed.c
 * mark_dying, core/router.c feeds_closing).  Rounds alternate between the callbacks: the feeds'
 * logs, and the router's on_event_gap (one callback for both feeds, told apart by worker).  Under
 * TSan this checks the marking and the teardowns against each other and against the router's
 * free; under ASan, no use after free and no leak.  A hang fails by SIGALRM instead of stalling
 * the suite.
 * Plain program: exit 0 pass, 1 fail, 77 skip.  argv[1]: duration, ms.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "tests/common/mono_clock.h"
#include "tests/common/vllm_batch.h"

static struct kvr_feed *F[2];
static atomic_int entered[2], returned[2];
static int from_log;

/* Feed i's callback: the first time, once both feeds are inside a callback, destroys the other. */
static void destroy_other(int i)
{
	if (atomic_exchange(&entered[i], 1))
		return;
	for (int t = 0; t < 5000 && !atomic_load(&entered[1 - i]); t++)
		sleep_us(1000);
	kvr_feed_destroy(F[1 - i]);
	atomic_store(&returned[i], 1);
}

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)dp, (void)from, (void)to;
	if (!from_log && w < 2)
		destroy_other((int)w);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)level, (void)msg;
	if (from_log)
		destroy_other((int)(intptr_t)ctx);
}

static int round_once(int log)
{
	from_log = log;
	for (int i = 0; i < 2; i++) {
		atomic_store(&entered[i], 0);
		atomic_store(&returned[i], 0);
	}
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r) ||
	    kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0) ||
	    kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, KVR_CAPACITY_NONE, 0)) {
		fprintf(stderr, "router\n");
		return 1;
	}
	void *zctx = zmq_ctx_new();
	void *pub[2];
	for (int i = 0; i < 2; i++) {
		char ep[256];
		if (test_xpub_open(zctx, &pub[i], ep, sizeof(ep))) {
			fprintf(stderr, "bind\n");
			return 1;
		}
		struct kvr_feed_config fc;
		kvr_feed_config_init(&fc);
		fc.log = on_log;
		fc.log_ctx = (void *)(intptr_t)i;
		if (test_feed_subscribed(r, &fc, pub[i], ep, (uint64_t)i, &F[i], NULL)) {
			fprintf(stderr, "feed\n");
			return 1;
		}
	}
	for (int i = 0; i < 2; i++)
		if (test_batch_send_empty(pub[i], 0) ||
		    test_batch_send_empty(pub[i], 5)) { /* a gap: both callbacks */
			fprintf(stderr, "send\n");
			return 1;
		}
	uint64_t t0 = now_ms();
	while (!(atomic_load(&returned[0]) && atomic_load(&returned[1])) && now_ms() - t0 < 20000)
		sleep_us(100);
	if (!(atomic_load(&returned[0]) && atomic_load(&returned[1]))) {
		fprintf(stderr, "the %s callbacks' destroys never returned\n", log ? "log" : "gap");
		return 1;
	}
	kvr_router_destroy(r); /* at once: waits for both feeds' teardowns */
	for (int i = 0; i < 2; i++)
		zmq_close(pub[i]);
	zmq_ctx_term(zctx);
	return 0;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000;
	/* A deadlock fails the test (SIGALRM) instead of waiting for meson's timeout. */
	alarm((unsigned)(ms / 1000) + 60);
	uint64_t t0 = now_ms();
	int rounds = 0;
	do {
		if (round_once(rounds & 1))
			return 1;
		rounds++;
	} while (now_ms() - t0 < ms);
	printf("stress_feed_crossdestroy: %d rounds, ok\n", rounds);
	return 0;
}
