/*
 * A call naming a rank that is removed while the call runs, its slot then given to a rank added
 * after it, must not act on that other rank.  The calls look the rank's slot up, then hand the
 * slot and its generation to the rank's shard, which refuses a generation that is not the slot's
 * current one.  When the generation was read after the lookup's read section had ended, a remove
 * and a grace period later an add in between gave the call the new rank's generation: a reset,
 * a capacity, an observation or an event of the removed rank landed on the new one.
 *
 * The window is forced: kvr_index_rank_find is wrapped (ld --wrap, tests/meson.build) to do what
 * the control plane would do right after the real lookup returned: remove X, wait long enough
 * for a grace period, and add Y, which then takes X's slot if the index has released it.
 */
#include <criterion/criterion.h>
#include <string.h>
#include <unistd.h>

#include "kvrouter.h"
#include "tests/common/metric.h"

struct kvr_index;
int __real_kvr_index_rank_find(const struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank,
                               uint32_t *slot);

static struct kvr_router *R;
static bool armed;
static const struct kvr_rank_id X = {.worker_id = 7, .dp_rank = 0};
static const struct kvr_rank_id Y = {.worker_id = 9, .dp_rank = 0};

int __wrap_kvr_index_rank_find(const struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank,
                               uint32_t *slot);
int __wrap_kvr_index_rank_find(const struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank,
                               uint32_t *slot)
{
	int rc = __real_kvr_index_rank_find(idx, worker_id, dp_rank, slot);
	if (armed && worker_id == X.worker_id && rc == 0) {
		armed = false;
		cr_assert_eq(kvr_rank_remove(R, X), 0);
		usleep(100000); /* the index hands a removed slot back after a grace period */
		cr_assert_eq(kvr_rank_add(R, Y, 1, 100, 4096), 0);
	}
	return rc;
}

static void setup(int mode)
{
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.n_shards = 2;
	cfg.max_ranks = 8;
	cfg.mode = mode;
	cr_assert_eq(kvr_router_create(&cfg, &R), 0);
	cr_assert_eq(kvr_rank_add(R, X, 1, 100, 4096), 0);
	armed = true;
}

/* Y as kvr_rank_add made it: incarnation 1, capacity 100, nothing held. */
static void y_untouched(void)
{
	cr_assert(!armed, "the window was not forced");
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(R, Y, &s), 0);
	cr_assert_eq(s.incarnation, 1);
	cr_assert_eq(s.capacity_blocks, 100);
	cr_assert_eq(s.indexed_blocks, 0);
	cr_assert_eq(s.event_id, 0);
	kvr_router_destroy(R);
}

Test(rank_slot_reuse, a_reset_of_a_removed_rank_is_not_the_new_ones)
{
	setup(KVR_MODE_APPROX_LRU);
	cr_assert_eq(kvr_rank_reset(R, X, 5), KVR_ENOENT);
	y_untouched();
}

Test(rank_slot_reuse, a_capacity_of_a_removed_rank_is_not_the_new_ones)
{
	setup(KVR_MODE_APPROX_LRU);
	cr_assert_eq(kvr_rank_set_capacity(R, X, 1, 2), KVR_ENOENT);
	y_untouched();
}

Test(rank_slot_reuse, stats_of_a_removed_rank_are_not_the_new_ones)
{
	setup(KVR_MODE_APPROX_LRU);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(R, X, &s), KVR_ENOENT);
	y_untouched();
}

Test(rank_slot_reuse, an_observation_of_a_removed_rank_is_not_the_new_ones)
{
	setup(KVR_MODE_APPROX_LRU);
	/* Above the capacity: it would raise the capacity of the rank it landed on. */
	struct kvr_rank_observation obs = {
	    .incarnation = 1, .flags = KVR_OBSERVE_RESIDENT, .resident_blocks = 1000};
	cr_assert_eq(kvr_rank_observe(R, X, &obs), KVR_ENOENT);
	y_untouched();
}

Test(rank_slot_reuse, an_event_of_a_removed_rank_is_not_the_new_ones)
{
	setup(KVR_MODE_EVENTS);
	struct kvr_event_block blk[3] = {{.ext_hash = 0xa1, .local_hash = 11},
	                                 {.ext_hash = 0xa2, .local_hash = 12},
	                                 {.ext_hash = 0xa3, .local_hash = 13}};
	struct kvr_event ev = {
	    .type = KVR_EVENT_STORED, .event_id = 1000, .blocks = blk, .n_blocks = 3};
	cr_assert_eq(kvr_events_apply(R, X, &ev), KVR_ENOENT);
	/* Y's own first event is its first, not one below a removed rank's id 1000. */
	struct kvr_event_block yb = {.ext_hash = 0xb1, .local_hash = 21};
	struct kvr_event yev = {
	    .type = KVR_EVENT_STORED, .event_id = 1, .blocks = &yb, .n_blocks = 1};
	cr_assert_eq(kvr_events_apply(R, Y, &yev), 0);
	kvr_router_sync(R, 1000);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(R, Y, &s), 0);
	cr_assert_eq(s.indexed_blocks, 1);
	cr_assert_eq(s.event_id, 1);
	kvr_router_destroy(R);
}

/* The router's lookup wrapped too: with gone_armed, the rank it found (X) is removed right after
 * it returns, before the call reaches the rank's shard (no slot reuse: the shard's own check
 * sees the rank gone). */
struct kvr_router;
int __real_kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                    uint64_t *gen);
int __wrap_kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                    uint64_t *gen);
static bool gone_armed;

int __wrap_kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                    uint64_t *gen)
{
	int rc = __real_kvr_router_find_rank_gen(r, id, slot, gen);
	if (gone_armed && id.worker_id == X.worker_id && rc == 0) {
		gone_armed = false;
		cr_assert_eq(kvr_rank_remove(R, X), 0);
	}
	return rc;
}

/* A stored event refused with KVR_ENOENT by the rank's shard says why: the rank was removed
 * after the call found it, or the rank does not hold the event's parent.  Both are KVR_ENOENT
 * (kvrouter.h); kvr_last_error and the counters now tell them apart (the removal's own,
 * kvr_events_total{type="any",status="rank_gone"}, and kvr_event_parent_not_found_total only
 * for a parent).  Before, the detail named both ("does not hold parent ... (or was removed
 * meanwhile)") and a removed rank's event counted nothing. */
Test(rank_slot_reuse, a_stored_event_of_a_removed_rank_says_the_rank_went_not_the_parent)
{
	setup(KVR_MODE_EVENTS);
	armed = false; /* the index lookup's window is not this test's */
	gone_armed = true;
	struct kvr_event_block blk = {.ext_hash = 0xa1, .local_hash = 11};
	struct kvr_event ev = {.type = KVR_EVENT_STORED,
	                       .event_id = 1,
	                       .has_parent = true,
	                       .parent_ext_hash = 0x99,
	                       .blocks = &blk,
	                       .n_blocks = 1};
	cr_assert_eq(kvr_events_apply(R, X, &ev), KVR_ENOENT);
	cr_assert(!gone_armed, "the window was not forced");
	const char *why = kvr_last_error();
	cr_assert(strstr(why, "removed") && !strstr(why, "parent"), "%s", why);
	cr_assert_eq(kvr_test_metric(R, "kvr_events_total{type=\"any\",status=\"rank_gone\"}"), 1);
	cr_assert_eq(kvr_test_metric(R, "kvr_event_parent_not_found_total"), 0);
	/* A parent a live rank does not hold: that, and nothing about a removal. */
	cr_assert_eq(kvr_rank_add(R, Y, 1, 100, 4096), 0);
	cr_assert_eq(kvr_events_apply(R, Y, &ev), KVR_ENOENT);
	why = kvr_last_error();
	cr_assert(strstr(why, "does not hold parent") && !strstr(why, "removed"), "%s", why);
	cr_assert_eq(kvr_test_metric(R, "kvr_event_parent_not_found_total"), 1);
	cr_assert_eq(kvr_test_metric(R, "kvr_events_total{type=\"any\",status=\"rank_gone\"}"), 1);
	kvr_router_destroy(R);
}
