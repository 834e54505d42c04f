/* kvr_events_apply and its batch paths (core/events.c, shards/owner_events.c): what an event
 * the library refuses, or one that fails, leaves behind. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "core/events.h"
#include "core/hash.h"
#include "core/index_internal.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "tests/common/metric.h"

static struct kvr_router *router;
static const struct kvr_rank_id R0 = {7, 0};

/* on_event_gap's calls and its last report. */
static int gap_calls;
static uint64_t gap_expected, gap_got, gap_worker;
static uint32_t gap_dp;

static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx;
	gap_calls++;
	gap_expected = expected;
	gap_got = got;
	gap_worker = worker;
	gap_dp = dp;
}

static void make(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	c.on_event_gap = on_gap;
	cr_assert_eq(kvr_router_create(&c, &router), 0);
	cr_assert_eq(kvr_rank_add(router, R0, 1, KVR_CAPACITY_NONE, 0), 0);
}

static uint64_t held(void)
{
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R0, &st), 0);
	return st.indexed_blocks;
}

/* A malformed stored event in a batch (blocks NULL) is refused alone, whatever its n_blocks
 * says: the batch's hash buffer was sized from every stored event's n_blocks before any was
 * validated, so a huge one failed the whole batch (KVR_ENOMEM, the valid events lost) or, its
 * size in bytes wrapping, got a buffer too small for the valid events' hashes (heap overflow;
 * SIZE_MAX looped for ever doubling the capacity). */
static void batch_with_malformed(size_t bad_n)
{
	make();
	struct kvr_event_block b[3] = {{.ext_hash = 1, .local_hash = 1},
	                               {.ext_hash = 2, .local_hash = 2},
	                               {.ext_hash = 3, .local_hash = 3}};
	struct kvr_event evs[2] = {
	    {.type = KVR_EVENT_STORED, .event_id = 1, .blocks = NULL, .n_blocks = bad_n},
	    {.type = KVR_EVENT_STORED, .event_id = 2, .blocks = b, .n_blocks = 3}};
	int rcs[2] = {-1, -1};
	cr_assert_eq(kvr_events_apply_many(router, R0, evs, 2, rcs), 0);
	cr_assert_eq(rcs[0], KVR_EINVAL);
	cr_assert_eq(rcs[1], 0);
	cr_assert_eq(held(), 3);
	/* The thread's buffer is as large as it says: a later, larger event fits. */
	struct kvr_event_block big[200];
	for (int i = 0; i < 200; i++)
		big[i] = (struct kvr_event_block){.ext_hash = 100 + (uint64_t)i,
		                                  .local_hash = 100 + (uint64_t)i};
	struct kvr_event ev = {
	    .type = KVR_EVENT_STORED, .event_id = 3, .blocks = big, .n_blocks = 200};
	cr_assert_eq(kvr_events_apply_many(router, R0, &ev, 1, NULL), 0);
	cr_assert_eq(kvr_events_apply(router, R0,
	                              &(struct kvr_event){.type = KVR_EVENT_STORED,
	                                                  .event_id = 4,
	                                                  .has_parent = true,
	                                                  .parent_ext_hash = 299,
	                                                  .blocks = big,
	                                                  .n_blocks = 200}),
	             KVR_EINVAL); /* 100 is held for another block: refused at once */
	kvr_router_destroy(router);
}

Test(events_apply, malformed_event_in_a_batch_is_refused_alone)
{
	batch_with_malformed((size_t)1 << 60);
}

Test(events_apply, malformed_event_size_does_not_wrap_the_batch_buffer)
{
	batch_with_malformed(SIZE_MAX / 8 + 2);
}

Test(events_apply, malformed_event_size_does_not_hang_the_batch, .timeout = 20)
{
	batch_with_malformed(SIZE_MAX - 8);
}

/* A stored event the index cannot name a run for (its run ids all in use; lowered to 3 here,
 * 2^25 - 1 in use) is KVR_ERANGE with a detail that says so, not the rank's bound, and nothing
 * of it is held.  Runs get ids when blocks are named by their sequence hash, as here. */
Test(events_apply, full_run_id_space_is_erange_not_the_bound)
{
	make();
	router->index->blk.id_limit = 3; /* before any store: the shard's next write reads it */
	for (uint64_t k = 1; k <= 4; k++) {
		uint64_t local[2] = {100 * k, 100 * k + 1}, seq[2];
		kvr_hash_chain_locals(NULL, local, 2, seq);
		struct kvr_event_block b[2] = {{.ext_hash = seq[0], .local_hash = local[0]},
		                               {.ext_hash = seq[1], .local_hash = local[1]}};
		struct kvr_event ev = {
		    .type = KVR_EVENT_STORED, .event_id = k, .blocks = b, .n_blocks = 2};
		int rc = kvr_events_apply(router, R0, &ev);
		if (k <= 3) {
			cr_assert_eq(rc, 0, "event %llu", (unsigned long long)k);
			continue;
		}
		cr_assert_eq(rc, KVR_ERANGE);
		cr_assert_not_null(strstr(kvr_last_error(), "the most runs it can name"), "%s",
		                   kvr_last_error());
	}
	cr_assert_eq(held(), 6);
	kvr_router_destroy(router);
}

/* Stores event id of rank: a root chain of 2 blocks named by their sequence hashes (they take a
 * run id) from local hashes key, key + 1. */
static int store_on(struct kvr_rank_id rank, uint64_t id, uint64_t key)
{
	uint64_t local[2] = {key, key + 1}, seq[2];
	kvr_hash_chain_locals(NULL, local, 2, seq);
	struct kvr_event_block b[2] = {{.ext_hash = seq[0], .local_hash = local[0]},
	                               {.ext_hash = seq[1], .local_hash = local[1]}};
	struct kvr_event ev = {
	    .type = KVR_EVENT_STORED, .event_id = id, .blocks = b, .n_blocks = 2};
	return kvr_events_apply(router, rank, &ev);
}

static int store_plain(uint64_t id, uint64_t key)
{
	return store_on(R0, id, key);
}

static struct kvr_rank_stats stats(void)
{
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R0, &st), 0);
	return st;
}

/* kvr_events_total{type="stored",status=...}. */
static uint64_t stored_events(const char *status)
{
	static char buf[1 << 16];
	size_t len = 0;
	cr_assert_eq(kvr_metrics_render(router, buf, sizeof(buf), &len), 0);
	char key[128];
	snprintf(key, sizeof(key), "\nkvr_events_total{type=\"stored\",status=\"%s\"} ", status);
	const char *p = strstr(buf, key);
	cr_assert(p, "%s rendered", key + 1);
	return strtoull(p + strlen(key), NULL, 10);
}

/* A stored event refused for a full run-id space is an event lost, as one refused at the bound:
 * reported through on_event_gap (its id, its id + 1) once per episode, counted in the rank's
 * event_gaps and under its own status (kvr_events_total{status="index_full"}, not "error").
 * Refusals in a row are one episode; the rank's next applied store ends it (the index had room
 * again), as does a cleared event.  Before, nothing but the return code said the event was
 * lost, which a feed's embedder never sees. */
Test(events_apply, full_run_id_space_is_reported_lost_once_per_episode)
{
	make();
	router->index->blk.id_limit = 3; /* before any store: the shard's next write reads it */
	uint64_t id = 0;
	for (uint64_t k = 1; k <= 3; k++)
		cr_assert_eq(store_plain(++id, 100 * k), 0);
	cr_assert_eq(store_plain(++id, 400), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1, "the refused event reported lost");
	cr_assert_eq(gap_expected, id);
	cr_assert_eq(gap_got, id + 1);
	cr_assert_eq(store_plain(++id, 500), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1, "the same episode");
	cr_assert_eq(stats().event_gaps, 1);
	cr_assert_eq(stats().event_id, id, "the cursor moved past the refused events");
	cr_assert_eq(stored_events("index_full"), 2);
	cr_assert_eq(stored_events("error"), 0, "not counted as another error");
	cr_assert_eq(stored_events("over_bound"), 0);
	/* A store that needs no new id is applied (a block below a held one): the episode ends,
	 * and the next refusal is reported again. */
	uint64_t local = 100, seq;
	kvr_hash_chain_locals(NULL, &local, 1, &seq);
	struct kvr_event_block one = {.ext_hash = seq, .local_hash = 100};
	cr_assert_eq(kvr_events_apply(router, R0,
	                              &(struct kvr_event){.type = KVR_EVENT_STORED,
	                                                  .event_id = ++id,
	                                                  .blocks = &one,
	                                                  .n_blocks = 1}),
	             0);
	cr_assert_eq(store_plain(++id, 600), KVR_ERANGE);
	cr_assert_eq(gap_calls, 2, "a new episode");
	cr_assert_eq(gap_expected, id);
	/* After a cleared event too (its runs die: their ids are free again). */
	cr_assert_eq(
	    kvr_events_apply(router, R0,
	                     &(struct kvr_event){.type = KVR_EVENT_CLEARED, .event_id = ++id}),
	    0);
	for (uint64_t k = 7; k <= 9; k++)
		cr_assert_eq(store_plain(++id, 100 * k), 0);
	cr_assert_eq(store_plain(++id, 1000), KVR_ERANGE);
	cr_assert_eq(gap_calls, 3);
	cr_assert_eq(stats().event_gaps, 3);
	/* And after kvr_rank_reset: another rank holding every id, R0's next store is refused
	 * straight after the reset, a new episode. */
	const struct kvr_rank_id R1 = {8, 0};
	cr_assert_eq(kvr_rank_add(router, R1, 1, KVR_CAPACITY_NONE, 0), 0);
	cr_assert_eq(
	    kvr_events_apply(router, R0,
	                     &(struct kvr_event){.type = KVR_EVENT_CLEARED, .event_id = ++id}),
	    0);
	for (uint64_t k = 11; k <= 13; k++) {
		uint64_t l[2] = {100 * k, 100 * k + 1}, s2[2];
		kvr_hash_chain_locals(NULL, l, 2, s2);
		struct kvr_event_block b[2] = {{.ext_hash = s2[0], .local_hash = l[0]},
		                               {.ext_hash = s2[1], .local_hash = l[1]}};
		cr_assert_eq(
		    kvr_events_apply(
		        router, R1,
		        &(struct kvr_event){.type = KVR_EVENT_STORED, .blocks = b, .n_blocks = 2}),
		    0);
	}
	cr_assert_eq(store_plain(++id, 1400), KVR_ERANGE);
	cr_assert_eq(gap_calls, 4);
	cr_assert_eq(kvr_rank_reset(router, R0, 2), 0);
	cr_assert_eq(store_plain(1, 1500), KVR_ERANGE);
	cr_assert_eq(gap_calls, 5, "a reset resyncs: the next refusal is reported");
	cr_assert_eq(gap_expected, 1);
	kvr_router_destroy(router);
}

/* kvr_events_apply's cleared event clears every dp rank of the worker (kvr_index_clear_worker),
 * so it resyncs each of them: each one's run-id episode ends, and its next refusal is reported
 * again.  Before, only the named rank's episode ended: another dp rank it had cleared stayed in
 * its old episode, and its refusals after the clear (the index still full of another worker's
 * runs) were lost without a word. */
Test(events_apply, worker_wide_clear_ends_the_run_id_episode_of_every_rank_it_clears)
{
	make();
	const struct kvr_rank_id R1 = {7, 1}, other = {8, 0};
	cr_assert_eq(kvr_rank_add(router, R1, 1, KVR_CAPACITY_NONE, 0), 0);
	cr_assert_eq(kvr_rank_add(router, other, 1, KVR_CAPACITY_NONE, 0), 0);
	router->index->blk.id_limit = 3;  /* before any store: the shard's next write reads it */
	for (uint64_t k = 1; k <= 3; k++) /* another worker holds every run id */
		cr_assert_eq(store_on(other, 0, 100 * k), 0);
	cr_assert_eq(store_on(R1, 0, 400), KVR_ERANGE);
	cr_assert_eq(gap_calls, 1);
	cr_assert_eq(gap_dp, 1, "dp rank 1's episode");
	cr_assert_eq(store_plain(1, 500), KVR_ERANGE);
	cr_assert_eq(gap_calls, 2);
	cr_assert_eq(gap_dp, 0, "dp rank 0's episode");
	/* Named by dp rank 0, the clear clears dp rank 1 too. */
	cr_assert_eq(kvr_events_apply(
	                 router, R0, &(struct kvr_event){.type = KVR_EVENT_CLEARED, .event_id = 2}),
	             0);
	cr_assert_eq(store_plain(3, 600), KVR_ERANGE);
	cr_assert_eq(gap_calls, 3, "dp rank 0 resynced: its next refusal is news");
	cr_assert_eq(store_on(R1, 0, 700), KVR_ERANGE);
	cr_assert_eq(gap_calls, 4, "dp rank 1 was cleared too: its next refusal is news as well");
	cr_assert_eq(gap_worker, 7);
	cr_assert_eq(gap_dp, 1);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R1, &st), 0);
	cr_assert_eq(st.event_gaps, 2);
	/* The other worker was not cleared: its episode, had it one, is not ours to end. */
	cr_assert_eq(kvr_rank_get_stats(router, other, &st), 0);
	cr_assert_eq(st.indexed_blocks, 6);
	kvr_router_destroy(router);
}

/* A worker-wide clear empties every dp rank of the worker, and the resident-blocks gauge of each
 * says so at once: the named rank's was published after the clear, the other dp ranks' kept
 * what they held before it until their next event. */
Test(events_apply, worker_wide_clear_publishes_every_cleared_ranks_resident_blocks)
{
	make();
	const struct kvr_rank_id R1 = {7, 1};
	cr_assert_eq(kvr_rank_add(router, R1, 1, KVR_CAPACITY_NONE, 0), 0);
	cr_assert_eq(store_on(R1, 1, 100), 0);
	cr_assert_eq(store_plain(1, 200), 0);
	const char *g1 = "kvr_rank_resident_blocks{worker=\"7\",dp_rank=\"1\"}";
	cr_assert_eq(kvr_test_metric(router, g1), 2);
	cr_assert_eq(kvr_events_apply(
	                 router, R0, &(struct kvr_event){.type = KVR_EVENT_CLEARED, .event_id = 2}),
	             0);
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(router, R1, &st), 0);
	cr_assert_eq(st.indexed_blocks, 0, "dp rank 1 cleared too");
	cr_assert_eq(
	    kvr_test_metric(router, "kvr_rank_resident_blocks{worker=\"7\",dp_rank=\"0\"}"), 0);
	cr_assert_eq(kvr_test_metric(router, g1), 0, "dp rank 1's gauge after the clear");
	kvr_router_destroy(router);
}
