/* The public API called from inside the router's own callbacks, as a careless embedder would:
 * kvrouter.h does not forbid it.  on_event_gap ran on the rank's shard thread, where a call on
 * the same rank ran inline (the first two tests) and one on another shard's rank waited for it
 * (the last); it runs on the caller's thread now.
 *
 * gap_callback_removes_the_rank: on_event_gap removing the rank it reports freed the rank's
 * state under kvr_owner_event, which then set the event cursor in freed memory (ASan:
 * heap-use-after-free in shards/owner_events.c).
 * gap_callback_resets_the_rank: on_event_gap resetting the rank (a natural answer to a gap: start
 * over) had the gapped event of the old life set the new life's event cursor, so the new
 * engine's first events (ids from 1) were dropped as stale. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kvrouter.h"

static struct kvr_router *router;
static int gap_action; /* 0: nothing, 1: remove the rank, 2: reset it */
static int gap_calls, gap_rc;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx, (void)expected, (void)got;
	struct kvr_rank_id id = {worker, dp};
	gap_calls++;
	if (gap_action == 1)
		gap_rc = kvr_rank_remove(router, id);
	else if (gap_action == 2)
		gap_rc = kvr_rank_reset(router, id, 2);
}

static const struct kvr_rank_id R0 = {7, 0};

static void events_router(int action)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	gap_action = action;
	gap_calls = 0;
	gap_rc = 1;
	cr_assert_eq(kvr_router_create(&c, &router), 0);
	cr_assert_eq(kvr_rank_add(router, R0, 1, KVR_CAPACITY_NONE, 0), 0);
}

/* A stored event of one block (local hash h, engine hash h) with event id id. */
static int store(uint64_t id, uint64_t h)
{
	struct kvr_event_block b = {.ext_hash = h, .local_hash = h};
	struct kvr_event ev = {
	    .type = KVR_EVENT_STORED, .event_id = id, .blocks = &b, .n_blocks = 1};
	return kvr_events_apply(router, R0, &ev);
}

Test(callbacks, gap_callback_removes_the_rank)
{
	events_router(1);
	cr_assert_eq(store(1, 11), 0);
	int rc = store(5, 12); /* 2..4 lost: the callback removes the rank */
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_rc, 0, "the removal from the callback: %d", gap_rc);
	cr_assert(rc == 0 || rc == KVR_ENOENT, "the gapped event: %d", rc);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R0, &st), KVR_ENOENT);
	cr_assert_eq(kvr_rank_add(router, R0, 3, KVR_CAPACITY_NONE, 0), 0, "added again");
	cr_assert_eq(store(1, 13), 0, "the new rank's first event");
	cr_assert_eq(kvr_router_sync(router, 10000), 0);
	kvr_router_destroy(router);
}

Test(callbacks, gap_callback_resets_the_rank)
{
	events_router(2);
	cr_assert_eq(store(1, 11), 0);
	cr_assert_eq(store(5, 12), 0); /* 2..4 lost: the callback resets the rank */
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_rc, 0, "the reset from the callback: %d", gap_rc);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R0, &st), 0);
	cr_assert_eq(st.incarnation, 2);
	/* The new life's engine numbers its events from 1 again. */
	cr_assert_eq(store(1, 13), 0, "the new life's first event was taken for the old life's");
	cr_assert_eq(kvr_rank_get_stats(router, R0, &st), 0);
	cr_assert_eq(st.event_id, 1);
	cr_assert_eq(st.indexed_blocks, 1, "the new life holds its one block");
	kvr_router_destroy(router);
}

/* ---------------------------------------------------------------- on_event_gap across shards */

/* on_event_gap ran on the rank's shard thread.  A callback that asked about a rank of another
 * shard waited for that shard, and when that shard's own callback was asking about a rank of
 * the first at the same moment (two publishers gapping together, each callback logging the
 * other's stats) both waited for ever: the router's shards were dead.  It runs on the caller's
 * thread now. */
static struct kvr_router *xr;
static atomic_long x_calls;

static void x_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx, (void)dp, (void)expected, (void)got;
	struct kvr_rank_stats st;
	struct kvr_rank_id other = {worker == 1 ? 2 : 1, 0};
	cr_assert_eq(kvr_rank_get_stats(xr, other, &st), 0);
	atomic_fetch_add(&x_calls, 1);
}

static void *x_apply(void *arg)
{
	struct kvr_rank_id id = {(uint64_t)(uintptr_t)arg, 0};
	for (uint64_t k = 1; k < 4000; k += 2) { /* every other id: a gap each time */
		struct kvr_event ev = {.type = KVR_EVENT_CLEARED, .event_id = k};
		cr_assert_eq(kvr_events_apply(xr, id, &ev), 0);
	}
	return NULL;
}

Test(callbacks, gap_callbacks_across_shards, .timeout = 60)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 2;
	c.on_event_gap = x_gap;
	cr_assert_eq(kvr_router_create(&c, &xr), 0);
	cr_assert_eq(kvr_rank_add(xr, (struct kvr_rank_id){1, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	cr_assert_eq(kvr_rank_add(xr, (struct kvr_rank_id){2, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
	pthread_t a, b;
	cr_assert_eq(pthread_create(&a, NULL, x_apply, (void *)(uintptr_t)1), 0);
	cr_assert_eq(pthread_create(&b, NULL, x_apply, (void *)(uintptr_t)2), 0);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	cr_assert_eq(atomic_load(&x_calls), 2 * 1999, "every gap reported once");
	kvr_router_destroy(xr);
}
