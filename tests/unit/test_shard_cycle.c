/* Router callbacks on two shards calling the API on each other's ranks.  The router's clock
 * (kvr_config.now_ns) runs on the shards; a clock on shard 0 that applies an event to a rank of
 * shard 1 waits for shard 1, whose clock meanwhile waits for shard 0: before, both shards
 * waited for good (the header's rule, "the clock should only read a time", was the only
 * guard).  Now kvr_shard_call refuses the call that closes the cycle (shards/runtime.c,
 * wait_edge_add): KVR_EBUSY with its detail, nothing applied; the other call goes through. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/mono_clock.h"
#include "tests/common/router_prompts.h"

static struct kvr_router *xr;
static atomic_int armed, ready, arrived, done;
static uint64_t attempts[2]; /* the pinned routes' attempts, set before ready */
static atomic_int entered[2];
static int call_rc[2] = {1, 1};
static char call_detail[2][256];
static int (*cross_call)(unsigned shard);

static bool wait_for(atomic_int *v, int want, int ms)
{
	for (int t = 0; t < ms && atomic_load(v) < want; t++)
		sleep_us(1000);
	return atomic_load(v) >= want;
}

/* Shard s's call on the other shard's rank (worker 1 - s: one worker a shard, placed in order). */
static int apply_on_other(unsigned s)
{
	struct kvr_event_block b = {.ext_hash = 500 + s, .local_hash = 900 + s};
	struct kvr_event ev = {.type = KVR_EVENT_STORED, .blocks = &b, .n_blocks = 1};
	return kvr_events_apply(xr, (struct kvr_rank_id){1 - s, 0}, &ev);
}

static int stats_of_other(unsigned s)
{
	struct kvr_rank_stats st;
	return kvr_rank_get_stats(xr, (struct kvr_rank_id){1 - s, 0}, &st);
}

/* With requests waiting, a finish first asks the attempt's shard to apply it (so that the
 * admission pass sees the load gone): that call, refused, is posted instead; the finish counts. */
static int finish_other(unsigned s)
{
	return kvr_request_finish(xr, attempts[1 - s]);
}

/* The clock: once armed, its first call on each shard waits until both shards are in it, then
 * calls the API on the other shard's rank. */
static uint64_t clock_calls_other_shard(void *ctx)
{
	(void)ctx;
	struct kvr_shard *sh = kvr_shard_current();
	if (atomic_load(&armed) && sh) {
		unsigned s = kvr_shard_index(sh);
		if (s < 2 && !atomic_exchange(&entered[s], 1)) {
			atomic_fetch_add(&arrived, 1);
			wait_for(&arrived, 2, 5000);
			wait_for(&ready, 1, 5000);
			call_rc[s] = cross_call(s);
			snprintf(call_detail[s], sizeof(call_detail[s]), "%s", kvr_last_error());
			atomic_fetch_add(&done, 1);
		}
	}
	return mono_ns();
}

/* An events-mode router on two shards with ranks {0, 0} and {1, 0} (one a shard), each with a
 * step budget of budget tokens, reading the clock clk; armed once made. */
static void make_router(kvr_clock_fn clk, double queue_threshold, uint32_t budget)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 2;
	c.now_ns = clk;
	c.queue_threshold = queue_threshold;
	cr_assert_eq(kvr_router_create(&c, &xr), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(
		    kvr_rank_add(xr, (struct kvr_rank_id){w, 0}, 1, KVR_CAPACITY_NONE, budget), 0);
	atomic_store(&armed, 1);
}

/* Starts a round: an events-mode router on two shards with ranks {0, 0} and {1, 0} (one a
 * shard), one 64-token route pinned to each (a booking makes its rank's shard read the clock),
 * then waits until both clocks made their call.  queued: ranks with a 16-token step budget and
 * queue_threshold 1, so that the pinned prompts saturate both and a third request waits in
 * *waiting (the finish case).  salt varies the prompt between rounds. */
static void start(int (*call)(unsigned), bool queued, uint32_t salt, struct kvr_decision d[2],
                  struct kvr_decision *waiting)
{
	atomic_store(&armed, 0);
	atomic_store(&ready, 0);
	atomic_store(&arrived, 0);
	atomic_store(&done, 0);
	atomic_store(&entered[0], 0);
	atomic_store(&entered[1], 0);
	cross_call = call;
	make_router(clock_calls_other_shard, queued ? 1.0 : 0, queued ? 16 : 0);
	for (uint64_t w = 0; w < 2; w++) {
		const struct kvr_rank_id pin = {w, 0};
		cr_assert_eq(route_salt_pinned(xr, &pin, salt, 64, &d[w]), 0);
		attempts[w] = d[w].attempt;
	}
	if (queued) {
		cr_assert_eq(route_salt_pinned(xr, NULL, salt, 64, waiting), 0);
		cr_assert_eq(waiting->status, KVR_QUEUED);
	}
	atomic_store(&ready, 1);
	cr_assert(wait_for(&arrived, 2, 10000), "the shards never both read the clock");
	cr_assert(wait_for(&done, 2, 10000),
	          "the clocks' calls on each other's shard never returned (%d of 2)",
	          atomic_load(&done));
	atomic_store(&armed, 0);
}

/* Each clock's call returned 0, or KVR_EBUSY with the cycle's detail naming fn[s]: how many
 * were refused. */
static int refusals(const char *const fn[2])
{
	int refused = 0;
	for (int s = 0; s < 2; s++) {
		if (call_rc[s] == KVR_EBUSY) {
			refused++;
			cr_assert(strstr(call_detail[s], fn[s]) == call_detail[s] &&
			              strstr(call_detail[s], "cycle of shards"),
			          "detail \"%s\"", call_detail[s]);
		} else {
			cr_assert_eq(call_rc[s], 0, "shard %d's call returned %d (%s)", s,
			             call_rc[s], call_detail[s]);
		}
	}
	return refused;
}

static void run(int (*call)(unsigned), const char *fn, bool queued)
{
	struct kvr_decision d[2], waiting = {0};
	start(call, queued, 0, d, &waiting);
	int refused = refusals((const char *const[2]){fn, fn});
	if (queued) {
		/* Both finishes counted (a refused load call posts the work): the waiting request
		 * is admitted once the load is gone, and all load ends at zero. */
		cr_assert_eq(refused, 0, "a finish returned KVR_EBUSY");
		for (int w = 0; w < 2; w++)
			cr_assert_eq(kvr_request_finish(xr, d[w].attempt), KVR_ESTALE);
		struct kvr_decision late;
		cr_assert_eq(kvr_route_wait(xr, waiting.ticket, mono_ns() + 10000000000ull, &late),
		             0, "%s", kvr_last_error());
		cr_assert_eq(late.status, KVR_DECIDED);
		cr_assert_eq(kvr_request_finish(xr, late.attempt), 0);
	} else {
		cr_assert_geq(refused, 1);
		/* The router goes on: both attempts end, and the shards answer. */
		for (int w = 0; w < 2; w++)
			cr_assert_eq(kvr_request_finish(xr, d[w].attempt), 0);
	}
	cr_assert_eq(kvr_router_sync(xr, 5000), 0);
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats st;
		cr_assert_eq(kvr_rank_get_stats(xr, (struct kvr_rank_id){w, 0}, &st), 0);
		cr_assert_eq(st.active_requests, 0, "rank %u: %u live attempts", (unsigned)w,
		             (unsigned)st.active_requests);
		cr_assert_eq(st.active_prefill_tokens, 0);
	}
	kvr_router_destroy(xr);
}

Test(shard_cycle, clocks_apply_events_on_each_others_rank, .timeout = 60)
{
	run(apply_on_other, "kvr_events_apply: ", false);
}

Test(shard_cycle, clocks_read_each_others_rank_stats, .timeout = 60)
{
	run(stats_of_other, "kvr_rank_get_stats: ", false);
}

Test(shard_cycle, clocks_finish_each_others_attempts_with_requests_waiting, .timeout = 60)
{
	run(finish_other, "kvr_request_finish: ", true);
}

/* Shard 0's clock removes rank 1 (on shard 1) while shard 1's clock reads rank 0's stats.
 * kvr_rank_remove's teardown cannot be refused once the rank is unroutable, so the remove
 * records its wait first (kvr_shard_wait_intent) and is the one refused if the stats call
 * waits already; else the stats call is.  Before, the teardown recorded its wait only when it
 * began, and a stats call already waiting made both wait for good. */
static int remove_or_stats(unsigned s)
{
	return s == 0 ? kvr_rank_remove(xr, (struct kvr_rank_id){1, 0}) : stats_of_other(s);
}

Test(shard_cycle, a_clock_removes_a_rank_whose_shard_waits_for_it, .timeout = 120)
{
	for (uint32_t round = 0; round < 10; round++) {
		struct kvr_decision d[2];
		start(remove_or_stats, false, round, d, NULL);
		cr_assert_geq(
		    refusals((const char *const[2]){"kvr_rank_remove: ", "kvr_rank_get_stats: "}),
		    1);
		bool removed = call_rc[0] == 0;
		struct kvr_rank_stats st;
		cr_assert_eq(kvr_rank_get_stats(xr, (struct kvr_rank_id){1, 0}, &st),
		             removed ? KVR_ENOENT : 0);
		cr_assert_eq(kvr_request_finish(xr, d[0].attempt), 0);
		cr_assert_eq(kvr_request_finish(xr, d[1].attempt), removed ? KVR_ESTALE : 0);
		cr_assert_eq(kvr_router_sync(xr, 5000), 0);
		cr_assert_eq(kvr_rank_get_stats(xr, (struct kvr_rank_id){0, 0}, &st), 0);
		cr_assert_eq(st.active_requests, 0);
		kvr_router_destroy(xr);
	}
}

/* Shard 0's clock adds rank {1, 1} (worker 1's: shard 1) while shard 1's clock reads rank 0's
 * stats.  kvr_rank_add's rollback (out of memory after the create) cannot be refused, so the
 * add records its wait before creating anything, as the remove does; one of the two calls is
 * refused, and a refused add leaves nothing behind (the rank can be added afterwards). */
static int add_or_stats(unsigned s)
{
	return s == 0 ? kvr_rank_add(xr, (struct kvr_rank_id){1, 1}, 1, KVR_CAPACITY_NONE, 0)
	              : stats_of_other(s);
}

Test(shard_cycle, a_clock_adds_a_rank_on_a_shard_that_waits_for_it, .timeout = 120)
{
	for (uint32_t round = 0; round < 10; round++) {
		struct kvr_decision d[2];
		start(add_or_stats, false, round, d, NULL);
		cr_assert_geq(
		    refusals((const char *const[2]){"kvr_rank_add: ", "kvr_rank_get_stats: "}), 1);
		const struct kvr_rank_id added = {1, 1};
		struct kvr_rank_stats st;
		if (call_rc[0] == 0) {
			cr_assert_eq(kvr_rank_get_stats(xr, added, &st), 0);
		} else {
			cr_assert_eq(kvr_rank_get_stats(xr, added, &st), KVR_ENOENT);
			cr_assert_eq(kvr_rank_add(xr, added, 1, KVR_CAPACITY_NONE, 0), 0, "%s",
			             kvr_last_error());
		}
		for (int w = 0; w < 2; w++)
			cr_assert_eq(kvr_request_finish(xr, d[w].attempt), 0);
		cr_assert_eq(kvr_rank_remove(xr, added), 0);
		cr_assert_eq(kvr_router_sync(xr, 5000), 0);
		kvr_router_destroy(xr);
	}
}

/* A frontend thread's kvr_rank_add holds the router's admin lock while it waits for shard 1
 * (the rank's create); shard 1's clock meanwhile calls kvr_rank_remove, which needs that lock.
 * The lock is no edge between shards, so nothing saw the cycle: both waited for good.  Now an
 * admin call on a shard's thread tries the lock and, while it is taken, refuses when the
 * holder waits for this shard (core/ranks.c admin_lock): KVR_EBUSY, and the add completes. */
static atomic_int lock_in_clock, lock_go, lock_clock_done, lock_add_done;
static int lock_clock_rc = 1, lock_add_rc = 1;
static char lock_clock_detail[256];

static uint64_t clock_removes_under_lock(void *ctx)
{
	(void)ctx;
	struct kvr_shard *sh = kvr_shard_current();
	if (atomic_load(&armed) && sh && kvr_shard_index(sh) == 1 &&
	    !atomic_exchange(&entered[1], 1)) {
		atomic_store(&lock_in_clock, 1);
		wait_for(&lock_go, 1, 10000);
		lock_clock_rc = kvr_rank_remove(xr, (struct kvr_rank_id){0, 0});
		snprintf(lock_clock_detail, sizeof(lock_clock_detail), "%s", kvr_last_error());
		atomic_store(&lock_clock_done, 1);
	}
	return mono_ns();
}

static void *add_on_shard_1(void *arg)
{
	(void)arg;
	lock_add_rc = kvr_rank_add(xr, (struct kvr_rank_id){1, 1}, 1, KVR_CAPACITY_NONE, 0);
	atomic_store(&lock_add_done, 1);
	return NULL;
}

Test(shard_cycle, a_clock_admin_call_while_an_admin_call_waits_for_its_shard, .timeout = 120)
{
	int refused = 0;
	for (uint32_t round = 0; round < 5; round++) {
		atomic_store(&armed, 0);
		atomic_store(&entered[1], 0);
		atomic_store(&lock_in_clock, 0);
		atomic_store(&lock_go, 0);
		atomic_store(&lock_clock_done, 0);
		atomic_store(&lock_add_done, 0);
		make_router(clock_removes_under_lock, 0, 0);
		const struct kvr_rank_id pin = {1, 0};
		struct kvr_decision d;
		cr_assert_eq(route_salt_pinned(xr, &pin, 100 + round, 64, &d), 0);
		cr_assert(wait_for(&lock_in_clock, 1, 10000), "shard 1 never read the clock");
		pthread_t t;
		cr_assert_eq(pthread_create(&t, NULL, add_on_shard_1, NULL), 0);
		sleep_us(100000); /* the add takes the lock and waits for shard 1 */
		atomic_store(&lock_go, 1);
		cr_assert(
		    wait_for(&lock_clock_done, 1, 10000) && wait_for(&lock_add_done, 1, 10000),
		    "round %u: the clock's remove and the frontend's add waited for good", round);
		pthread_join(t, NULL);
		atomic_store(&armed, 0);
		cr_assert_eq(lock_add_rc, 0, "%d", lock_add_rc);
		/* Refused when the add was waiting for shard 1 (nearly always after 100 ms); else
		 * the remove went first. */
		struct kvr_rank_stats st;
		if (lock_clock_rc == KVR_EBUSY) {
			cr_assert(strstr(lock_clock_detail,
			                 "kvr_rank_remove: called on a shard's thread") ==
			              lock_clock_detail,
			          "detail \"%s\"", lock_clock_detail);
			cr_assert_eq(kvr_rank_get_stats(xr, (struct kvr_rank_id){0, 0}, &st), 0);
			refused++;
		} else {
			cr_assert_eq(lock_clock_rc, 0, "%d (%s)", lock_clock_rc, lock_clock_detail);
		}
		cr_assert_eq(kvr_rank_get_stats(xr, (struct kvr_rank_id){1, 1}, &st), 0);
		cr_assert_eq(kvr_request_finish(xr, d.attempt), 0);
		cr_assert_eq(kvr_router_sync(xr, 5000), 0);
		kvr_router_destroy(xr);
	}
	cr_assert_geq(refused, 1, "the add never waited for shard 1 while the clock called");
}

/* kvr_router_sync from the clock on a shard: it would wait for that shard to go idle, inside the
 * task that read the clock.  Refused with KVR_EBUSY and a detail naming the call; before, the
 * runtime's refusal came back as KVR_EINVAL, "kvr_router_sync: invalid argument", a code its
 * header does not list, for a call whose arguments were valid. */
static atomic_int sync_in_clock;
static int sync_clock_rc = 1;
static char sync_clock_detail[256];

static uint64_t clock_syncs(void *ctx)
{
	(void)ctx;
	if (atomic_load(&armed) && kvr_shard_current() && !atomic_exchange(&sync_in_clock, 1)) {
		sync_clock_rc = kvr_router_sync(xr, 100);
		snprintf(sync_clock_detail, sizeof(sync_clock_detail), "%s", kvr_last_error());
		atomic_store(&done, 1);
	}
	return mono_ns();
}

Test(shard_cycle, a_clock_syncing_the_router_is_refused, .timeout = 60)
{
	atomic_store(&done, 0);
	atomic_store(&sync_in_clock, 0);
	make_router(clock_syncs, 0, 0);
	const struct kvr_rank_id pin = {0, 0};
	struct kvr_decision d;
	cr_assert_eq(route_salt_pinned(xr, &pin, 7, 64, &d), 0);
	cr_assert(wait_for(&done, 1, 10000), "no shard read the clock");
	atomic_store(&armed, 0);
	cr_assert_eq(sync_clock_rc, KVR_EBUSY, "%d (%s)", sync_clock_rc, sync_clock_detail);
	cr_assert(strstr(sync_clock_detail, "kvr_router_sync: called on a shard thread") ==
	              sync_clock_detail,
	          "detail \"%s\"", sync_clock_detail);
	/* The router goes on. */
	cr_assert_eq(kvr_request_finish(xr, d.attempt), 0);
	cr_assert_eq(kvr_router_sync(xr, 5000), 0);
	kvr_router_destroy(xr);
}
