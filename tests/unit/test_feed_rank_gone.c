/* A rank removed while the feed's events for it are on their way to its shard: the feed says so,
 * not that the rank lacks the event's parent.  The window is forced: kvr_router_find_rank_gen is
 * wrapped (ld --wrap, tests/meson.build) to remove the rank right after the lookup that sends a
 * batch's events to its shard found it; the shard then finds it gone. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "tests/common/feed_pub.h"
#include "tests/common/metric.h"

int __real_kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                    uint64_t *gen);
int __wrap_kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                    uint64_t *gen);
static atomic_bool armed;

/* Only the event path's lookups are wrapped (core/events.c): the feed's own, in
 * kvr_feed_apply_batch, is kvr_router_find_rank, inside the router's file. */
int __wrap_kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                                    uint64_t *gen)
{
	int rc = __real_kvr_router_find_rank_gen(r, id, slot, gen);
	if (rc == 0 && id.worker_id == 0 && atomic_exchange(&armed, false))
		cr_assert_eq(kvr_rank_remove(r, id), 0);
	return rc;
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
	atomic_store(&armed, true);
	cr_assert_eq(kvr_fenc_send(pub.pub, 0, e.sb.data, e.sb.size), 0);
	struct kvr_feed_stats st;
	for (int t = 0; t < 3000; t++) { /* stats settle the feed: its refusals are logged */
		cr_assert_eq(kvr_feed_get_stats(f, pub.id, &st), 0);
		if (st.batches >= 1 && st.refused >= 1)
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
