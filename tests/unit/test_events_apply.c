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

static struct kvr_router *router;
static const struct kvr_rank_id R0 = {7, 0};

static void make(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
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
