/*
 * stress_feed_selfdestroy - kvr_feed_destroy from the feed's own callbacks (the router's
 * on_event_gap for a gap the feed reports, or the feed's log), followed at once by
 * kvr_router_destroy on the main thread: the feed's thread tears itself down, detached, while
 * the router's destroy waits for it (sync/feed.c feed_main, core/router.c feeds_closing).  Under
 * TSan this checks that the teardown's last use of the router is ordered before the router is
 * freed; under ASan, that nothing is used after it is freed.  Rounds alternate between the two
 * callbacks until the duration is spent.
 * Plain program: exit 0 pass, 1 fail, 77 skip (built without zmq).  argv[1]: duration, ms.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "kvrouter.h"
#include "tests/common/mono_clock.h"
#include "tests/common/vllm_batch.h"

static struct kvr_feed *F;
static atomic_int destroyed;
static int from_log;

static void destroy_feed(void)
{
	if (!atomic_load(&destroyed)) {
		kvr_feed_destroy(F);
		atomic_store(&destroyed, 1);
	}
}

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)w, (void)dp, (void)from, (void)to;
	if (!from_log)
		destroy_feed();
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx, (void)level, (void)msg;
	if (from_log)
		destroy_feed();
}

static int round_once(int log)
{
	from_log = log;
	atomic_store(&destroyed, 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r) ||
	    kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0)) {
		fprintf(stderr, "router\n");
		return 1;
	}
	void *zctx = zmq_ctx_new();
	void *pub;
	char ep[256];
	if (test_xpub_open(zctx, &pub, ep, sizeof(ep))) {
		fprintf(stderr, "bind\n");
		return 1;
	}
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log;
	if (test_feed_subscribed(r, &fc, pub, ep, 0, &F, NULL) || test_batch_send_empty(pub, 0) ||
	    test_batch_send_empty(pub, 5)) {
		fprintf(stderr, "feed\n");
		return 1;
	}
	uint64_t t0 = now_ms();
	while (!atomic_load(&destroyed) && now_ms() - t0 < 10000) {
		struct timespec ts = {0, 100000};
		nanosleep(&ts, NULL);
	}
	if (!atomic_load(&destroyed)) {
		fprintf(stderr, "the %s callback never came\n", log ? "log" : "gap");
		return 1;
	}
	kvr_router_destroy(r); /* at once: waits for the feed's own teardown */
	zmq_close(pub);
	zmq_ctx_term(zctx);
	return 0;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000;
	uint64_t t0 = now_ms();
	int rounds = 0;
	do {
		if (round_once(rounds & 1))
			return 1;
		rounds++;
	} while (now_ms() - t0 < ms);
	printf("stress_feed_selfdestroy: %d rounds, ok\n", rounds);
	return 0;
}
