/* kvr_feed_add / remove / get_stats / other_medium_blocks called on one feed from the callbacks of
 * another (its log, the router's on_event_gap), while the target feed's callbacks call back.
 * Before, such a call took the target's ctl_lock and waited for the target's thread, which was
 * waiting in its own callback for the caller's: feed 0's callback asking feed 1's stats while
 * feed 1's asked feed 0's (or 0 -> 1 -> 2 -> 0, or an ordinary thread holding feed 0's ctl_lock)
 * waited for good.  Now a feed thread waiting for another feed serves the calls that come for
 * its own feed meanwhile: reads at once, add / remove when it is back in its loop, unless that
 * wait would close a cycle (KVR_EBUSY).  Every test here waited for good before (a 10 s wait
 * for the callbacks to come back fails it).  (Many feeds at random, under ThreadSanitizer:
 * stress_feed_crosscall.) */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/rcu.h"
#include "tests/common/feed_pub.h"

#define N_MAX 3

/* What feed i's callback does the first time it runs. */
enum act { NONE, STATS, OTHER, ADD, REMOVE, STATS_THEN_DESTROY_SELF, DESTROY };

static struct kvr_feed *feeds[N_MAX];
static int n_feeds;
static enum act act[N_MAX];
static int target[N_MAX];
static uint32_t rm_id[N_MAX]; /* REMOVE: the endpoint of target[i] it removes */
static int rc[N_MAX];
static uint32_t add_id[N_MAX];
static uint32_t pub_id[N_MAX]; /* feed i's publisher endpoint */
#define NOT_ISSUED 0x7fffff00u /* an endpoint id no feed of the test gives */
static struct kvr_feed_stats st[N_MAX];
static atomic_int entered[N_MAX], returned[N_MAX];
static atomic_int go; /* the callbacks wait for this (all entered, or later) */
static bool use_gap;  /* act from on_event_gap (else from the log) */
static const char *dead_end[N_MAX] = {"tcp://127.0.0.1:9", "tcp://127.0.0.1:7",
                                      "tcp://127.0.0.1:13"}; /* never answers */

static void act_once(int i)
{
	if (i < 0 || i >= n_feeds || atomic_exchange(&entered[i], 1))
		return;
	for (int t = 0; t < 1000 && !atomic_load(&go); t++)
		sleep_ms(10);
	struct kvr_feed *to = feeds[target[i]];
	struct kvr_feed_endpoint fe = {.endpoint = dead_end[i], .worker_id = 7, .dp_rank = 0};
	size_t n = 0;
	switch (act[i]) {
	case NONE:
		break;
	case STATS:
		rc[i] = kvr_feed_get_stats(to, KVR_FEED_ALL, &st[i]);
		break;
	case OTHER:
		rc[i] = kvr_feed_other_medium_blocks(to, pub_id[target[i]], 0, NULL, 0, &n);
		break;
	case ADD:
		rc[i] = kvr_feed_add(to, &fe, &add_id[i]);
		break;
	case REMOVE:
		rc[i] = kvr_feed_remove(to, rm_id[i]);
		break;
	case DESTROY:
		kvr_feed_destroy(to);
		rc[i] = 0;
		break;
	case STATS_THEN_DESTROY_SELF:
		rc[i] = kvr_feed_get_stats(to, KVR_FEED_ALL, &st[i]);
		kvr_feed_destroy(feeds[i]);
		break;
	}
	atomic_store(&returned[i], 1);
}

static void on_log(void *ctx, int level, const char *msg)
{
	(void)level, (void)msg;
	if (!use_gap)
		act_once((int)(intptr_t)ctx);
}

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)dp, (void)from, (void)to;
	if (use_gap)
		act_once((int)w);
}

/* A router with ranks (i, 0), and n feeds, feed i fed by pub[i] for worker i. */
static struct kvr_router *rig(int n, struct test_pub *pub)
{
	n_feeds = n;
	for (int i = 0; i < N_MAX; i++) {
		feeds[i] = NULL;
		rc[i] = 1;
		add_id[i] = NOT_ISSUED;
		memset(&st[i], 0, sizeof(st[i]));
		atomic_store(&entered[i], 0);
		atomic_store(&returned[i], 0);
	}
	atomic_store(&go, 0);
	struct kvr_router *r = test_events_router(on_gap);
	for (int i = 1; i < n; i++)
		cr_assert_eq(
		    kvr_rank_add(r, (struct kvr_rank_id){(uint64_t)i, 0}, 1, KVR_CAPACITY_NONE, 0),
		    0);
	for (int i = 0; i < n; i++) {
		test_pub_open(&pub[i]);
		feeds[i] = test_feed_on(r, &pub[i], (uint64_t)i, on_log, (void *)(intptr_t)i);
		pub_id[i] = pub[i].id;
	}
	return r;
}

/* Every feed's thread into its callback (a gap: logged, and on_event_gap), and, once all are
 * in, go. */
static void fire(struct test_pub *pub, int n)
{
	for (int i = 0; i < n; i++) {
		test_pub_send_empty(&pub[i], 0, 0);
		test_pub_send_empty(&pub[i], 5, 0);
	}
	for (int i = 0; i < n; i++)
		cr_assert(came_back(&entered[i]), "feed %d's callback never ran", i);
	atomic_store(&go, 1);
}

static void all_back(int n)
{
	for (int i = 0; i < n; i++)
		cr_assert(came_back(&returned[i]), "feed %d's call on feed %d never returned", i,
		          target[i]);
}

static void teardown(struct kvr_router *r, struct test_pub *pub, int n)
{
	for (int i = 0; i < n; i++)
		kvr_feed_destroy(feeds[i]);
	kvr_router_destroy(r);
	for (int i = 0; i < n; i++)
		test_pub_close(&pub[i]);
}

/* Waits (thread-exit destructors) for the library's live bytes to be back to live0. */
static void live_back_to(int64_t live0)
{
	kvr_rcu_barrier();
	int64_t live = kvr_alloc_live_bytes();
	for (int t = 0; t < 500 && live != live0; t++) {
		sleep_ms(10);
		live = kvr_alloc_live_bytes();
	}
	cr_assert_eq(live, live0, "live bytes %ld, %ld before", (long)live, (long)live0);
}

/* A cycle of reads: feed i reads feed (i + 1) % n, each from its callback, all at once. */
static void read_cycle(int n, enum act a, bool gap)
{
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	use_gap = gap;
	for (int i = 0; i < n; i++) {
		act[i] = a;
		target[i] = (i + 1) % n;
	}
	struct test_pub pub[N_MAX];
	struct kvr_router *r = rig(n, pub);
	fire(pub, n);
	all_back(n);
	for (int i = 0; i < n; i++) {
		cr_assert_eq(rc[i], 0, "feed %d's read of feed %d: %d", i, target[i], rc[i]);
		if (a == STATS) {
			/* Counted before the target's callbacks for the gap ran. */
			cr_assert_geq(st[i].messages, 2);
			cr_assert_eq(st[i].gaps, 1);
		}
	}
	/* The feeds go on as before. */
	struct kvr_feed_stats s;
	for (int i = 0; i < n; i++) {
		cr_assert_eq(kvr_feed_get_stats(feeds[i], pub[i].id, &s), 0);
		cr_assert_eq(s.batches, 2);
	}
	teardown(r, pub, n);
	live_back_to(live0);
}

Test(feed_crosscall, two_feeds_logs_read_each_others_stats, .timeout = 60)
{
	read_cycle(2, STATS, false);
}

Test(feed_crosscall, two_feeds_gaps_read_each_others_stats, .timeout = 60)
{
	read_cycle(2, STATS, true);
}

Test(feed_crosscall, two_feeds_read_each_others_other_medium, .timeout = 60)
{
	read_cycle(2, OTHER, false);
}

Test(feed_crosscall, three_feeds_read_in_a_cycle, .timeout = 60)
{
	read_cycle(3, STATS, false);
}

/* Feed 0's add on feed 1 waits for feed 1's loop while feed 1 reads feed 0: feed 0 serves the
 * read while it waits, so both return 0 (the add is not refused: no cycle). */
Test(feed_crosscall, add_waits_for_the_targets_loop, .timeout = 60)
{
	use_gap = false;
	act[0] = ADD, target[0] = 1;
	act[1] = STATS, target[1] = 0;
	struct test_pub pub[N_MAX];
	struct kvr_router *r = rig(2, pub);
	fire(pub, 2);
	all_back(2);
	cr_assert_eq(rc[0], 0, "add from feed 0's log on feed 1: %d", rc[0]);
	cr_assert_eq(rc[1], 0);
	cr_assert_neq(add_id[0], NOT_ISSUED);
	struct kvr_feed_stats s;
	cr_assert_eq(kvr_feed_get_stats(feeds[1], add_id[0], &s), 0, "the endpoint is there");
	cr_assert_eq(kvr_feed_remove(feeds[1], add_id[0]), 0);
	teardown(r, pub, 2);
}

/* n feeds each add to (or remove from) the next, all from their callbacks: the one whose wait
 * would close the cycle gets KVR_EBUSY, the others' calls run once their target is back in its
 * loop. */
static void write_cycle(int n, enum act a)
{
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	use_gap = false;
	for (int i = 0; i < n; i++) {
		act[i] = a;
		target[i] = (i + 1) % n;
		rm_id[i] = NOT_ISSUED;
	}
	struct test_pub pub[N_MAX];
	struct kvr_router *r = rig(n, pub);
	if (a == REMOVE)
		for (int i = 0; i < n; i++) {
			struct kvr_feed_endpoint fe = {.endpoint = dead_end[i], .worker_id = 7};
			uint32_t id;
			cr_assert_eq(kvr_feed_add(feeds[i], &fe, &id), 0);
			rm_id[(i + n - 1) % n] = id; /* feed i - 1 removes it */
		}
	fire(pub, n);
	all_back(n);
	int busy = 0;
	for (int i = 0; i < n; i++) {
		cr_assert(rc[i] == 0 || rc[i] == KVR_EBUSY, "feed %d on feed %d: %d", i, target[i],
		          rc[i]);
		busy += rc[i] == KVR_EBUSY;
	}
	cr_assert_eq(busy, 1, "%d of %d calls refused", busy, n);
	/* Each call that returned 0 was done, the refused one was not. */
	struct kvr_feed_stats s;
	for (int i = 0; i < n; i++) {
		int there =
		    kvr_feed_get_stats(feeds[target[i]], a == ADD ? add_id[i] : rm_id[i], &s);
		if (a == ADD)
			cr_assert_eq(there, rc[i] == 0 ? 0 : KVR_ENOENT, "feed %d's add", i);
		else
			cr_assert_eq(there, rc[i] == 0 ? KVR_ENOENT : 0, "feed %d's remove", i);
	}
	teardown(r, pub, n);
	live_back_to(live0);
}

Test(feed_crosscall, two_feeds_add_to_each_other, .timeout = 60)
{
	write_cycle(2, ADD);
}

Test(feed_crosscall, two_feeds_remove_from_each_other, .timeout = 60)
{
	write_cycle(2, REMOVE);
}

Test(feed_crosscall, three_feeds_add_in_a_cycle, .timeout = 60)
{
	write_cycle(3, ADD);
}

/* An ordinary thread's call on feed 0 holds feed 0's ctl_lock (waiting for feed 0's thread,
 * which is in its callback waiting for feed 1), when feed 1's callback reads feed 0.  Before,
 * feed 1 waited for that lock, the thread for feed 0, feed 0 for feed 1.  Now feed 1 needs no
 * lock of feed 0's; the ordinary call is answered once feed 0 is back in its loop. */
static struct kvr_feed *ord_target;
static uint32_t ord_id; /* ord_target's publisher endpoint */
static int ord_op;      /* 0 stats, 1 add */
static int ord_rc = 1;
static atomic_int ord_in, ord_out;

static void *ordinary(void *arg)
{
	(void)arg;
	atomic_store(&ord_in, 1);
	struct kvr_feed_stats s;
	struct kvr_feed_endpoint fe = {.endpoint = "tcp://127.0.0.1:11", .worker_id = 7};
	ord_rc = ord_op ? kvr_feed_add(ord_target, &fe, NULL)
	                : kvr_feed_get_stats(ord_target, ord_id, &s);
	atomic_store(&ord_out, 1);
	return NULL;
}

static void ordinary_holds_the_lock(int op)
{
	use_gap = false;
	act[0] = STATS, target[0] = 1;
	act[1] = STATS, target[1] = 0;
	struct test_pub pub[N_MAX];
	struct kvr_router *r = rig(2, pub);
	/* Feed 1's callback starts only once the ordinary thread waits on feed 0. */
	test_pub_send_empty(&pub[0], 0, 0);
	test_pub_send_empty(&pub[0], 5, 0);
	cr_assert(came_back(&entered[0]));
	ord_target = feeds[0];
	ord_id = pub[0].id;
	ord_op = op;
	atomic_store(&ord_in, 0);
	atomic_store(&ord_out, 0);
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, ordinary, NULL), 0);
	cr_assert(came_back(&ord_in));
	sleep_ms(100); /* in call(), holding feed 0's ctl_lock */
	test_pub_send_empty(&pub[1], 0, 0);
	test_pub_send_empty(&pub[1], 5, 0);
	cr_assert(came_back(&entered[1]));
	atomic_store(&go, 1);
	all_back(2);
	cr_assert(came_back(&ord_out), "the ordinary thread's call on feed 0 never returned");
	pthread_join(t, NULL);
	cr_assert_eq(rc[0], 0);
	cr_assert_eq(rc[1], 0);
	cr_assert_eq(ord_rc, 0);
	teardown(r, pub, 2);
}

Test(feed_crosscall, ordinary_thread_reads_while_the_feeds_read_each_other, .timeout = 60)
{
	ordinary_holds_the_lock(0);
}

Test(feed_crosscall, ordinary_thread_adds_while_the_feeds_read_each_other, .timeout = 60)
{
	ordinary_holds_the_lock(1);
}

/* Feed 1's callback reads feed 0, then destroys feed 1, while feed 0's callback calls feed 1: a
 * read is answered (by feed 1 while it waits) or gets KVR_ESHUTDOWN (feed 1's teardown); an add,
 * deferred to feed 1's loop, gets KVR_ESHUTDOWN.  Never a wait for good; the router's destroy
 * still waits for feed 1's teardown, and nothing leaks. */
static void cross_call_racing_destroy(enum act a0)
{
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	use_gap = false;
	act[0] = a0, target[0] = 1;
	act[1] = STATS_THEN_DESTROY_SELF, target[1] = 0;
	struct test_pub pub[N_MAX];
	struct kvr_router *r = rig(2, pub);
	fire(pub, 2);
	all_back(2);
	cr_assert_eq(rc[1], 0);
	if (a0 == STATS)
		cr_assert(rc[0] == 0 || rc[0] == KVR_ESHUTDOWN,
		          "read of a feed destroyed meanwhile: %d", rc[0]);
	else
		cr_assert_eq(rc[0], KVR_ESHUTDOWN, "add on a feed destroyed meanwhile: %d", rc[0]);
	kvr_feed_destroy(feeds[0]);
	kvr_router_destroy(r);
	for (int i = 0; i < 2; i++)
		test_pub_close(&pub[i]);
	live_back_to(live0);
}

Test(feed_crosscall, read_racing_the_targets_destroy, .timeout = 60)
{
	for (int k = 0; k < 5; k++)
		cross_call_racing_destroy(STATS);
}

Test(feed_crosscall, add_racing_the_targets_destroy, .timeout = 60)
{
	cross_call_racing_destroy(ADD);
}

/* Feeds 0 and 1 read each other from their callbacks while feed 2's callback destroys feed 1
 * (marked, woken through its box: not through its ctl_lock).  Feed 1 is freed only once its
 * callback returned, which needs feed 0 waiting on it, so feed 0's call is in feed 1's box by
 * then: answered, or KVR_ESHUTDOWN by the teardown. */
Test(feed_crosscall, read_cycle_while_a_third_feed_destroys_one, .timeout = 60)
{
	kvr_rcu_barrier();
	int64_t live0 = kvr_alloc_live_bytes();
	use_gap = false;
	act[0] = STATS, target[0] = 1;
	act[1] = STATS, target[1] = 0;
	act[2] = DESTROY, target[2] = 1;
	struct test_pub pub[N_MAX];
	struct kvr_router *r = rig(3, pub);
	fire(pub, 3);
	all_back(3);
	cr_assert(rc[0] == 0 || rc[0] == KVR_ESHUTDOWN, "read of feed 1: %d", rc[0]);
	cr_assert_eq(rc[1], 0);
	kvr_feed_destroy(feeds[0]);
	kvr_feed_destroy(feeds[2]);
	kvr_router_destroy(r);
	for (int i = 0; i < 3; i++)
		test_pub_close(&pub[i]);
	live_back_to(live0);
}
