/* A router callback on a shard (the clock) finishing an attempt whose shard's lane is full.  A
 * finish is claimed on the caller's thread and its work posted; on a full lane an ordinary
 * thread waits for room (the end is never dropped).  On shard 0's thread that wait is a wait for
 * shard 1, and shard 1's clock may be waiting for shard 0 meanwhile (a call on one of its
 * ranks): before, both waited for good (stress_admin_clock hung that way, once in ~30 runs
 * under load).  Now a claimed end on a shard's thread never waits for room: the post is kept by
 * that thread and made from its loop once there is room (shards/runtime.c,
 * kvr_shard_post_later), so the finish returns 0 at once, shard 0 answers shard 1's call, and
 * the end is applied once shard 1 has worked through its lane.  Its own lane full: the same.
 * With sync_booking (the _sync cases) the end is a timed post, refused the same way and kept. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "core/router_internal.h"
#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/mono_clock.h"
#include "tests/common/router_prompts.h"

static struct kvr_router *xr;
static atomic_int armed, a_in, a_go, a_done, b_calling, b_done;
static uint64_t victim;       /* the attempt shard 0's clock finishes (on finish_shard's rank) */
static unsigned finish_shard; /* 1: the other shard's lane; 0: its own */
static int a_rc = 1, b_rc = 1;
static char a_detail[256];

static bool wait_for(atomic_int *v, int ms)
{
	for (int t = 0; t < ms && !atomic_load(v); t++)
		sleep_us(1000);
	return atomic_load(v);
}

/* Shard 0's clock, once armed: waits for the go, then finishes the victim.  Shard 1's clock
 * (other-lane case): calls on rank 0 (shard 0's), waiting for shard 0. */
static uint64_t clk(void *ctx)
{
	(void)ctx;
	struct kvr_shard *sh = kvr_shard_current();
	if (!atomic_load(&armed) || !sh)
		return mono_ns();
	if (kvr_shard_index(sh) == 0 && !atomic_exchange(&a_in, 1)) {
		wait_for(&a_go, 10000);
		a_rc = kvr_request_finish(xr, victim);
		snprintf(a_detail, sizeof(a_detail), "%s", a_rc ? kvr_last_error() : "");
		atomic_store(&a_done, 1);
	} else if (kvr_shard_index(sh) == 1 && finish_shard == 1 &&
	           !atomic_exchange(&b_calling, 1)) {
		struct kvr_rank_stats st;
		b_rc = kvr_rank_get_stats(xr, (struct kvr_rank_id){0, 0}, &st);
		atomic_store(&b_done, 1);
	}
	return mono_ns();
}

static uint32_t active(uint64_t w)
{
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(xr, (struct kvr_rank_id){w, 0}, &st), 0);
	return st.active_requests;
}

/* A router on two shards with rank {w, 0} on shard w, lanes of 16 messages, the victim routed
 * to rank {target, 0} and booked; then the clocks are armed. */
static void begin(unsigned target, bool sync)
{
	atomic_store(&armed, 0);
	atomic_store(&a_in, 0);
	atomic_store(&a_go, 0);
	atomic_store(&a_done, 0);
	atomic_store(&b_calling, 0);
	atomic_store(&b_done, 0);
	finish_shard = target;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.now_ns = clk;
	c.sync_booking = sync;
	c.lane_capacity = 16;
	c.lane_soft_depth = 0;
	cr_assert_eq(kvr_router_create(&c, &xr), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_add(xr, (struct kvr_rank_id){w, 0}, 1, 4096, 0), 0);
	struct kvr_decision d;
	cr_assert_eq(route_salt_pinned(xr, &(struct kvr_rank_id){target, 0}, 1, 64, &d), 0);
	victim = d.attempt;
	cr_assert_eq(kvr_router_sync(xr, 5000), 0);
	atomic_store(&armed, 1);
}

static void full_lane(unsigned target)
{
	begin(target, false);
	const struct kvr_rank_id on[2] = {{0, 0}, {1, 0}};
	struct kvr_decision d;
	/* Shard 0 into its clock (a booking reads it), where it waits for the go. */
	cr_assert_eq(route_salt_pinned(xr, &on[0], 2, 64, &d), 0);
	uint64_t trigger = d.attempt;
	cr_assert(wait_for(&a_in, 10000), "shard 0 never read the clock");
	uint64_t fillers[64];
	size_t n = 0;
	if (target == 1) {
		/* Shard 1 into its call on shard 0, which answers nothing while in its clock. */
		cr_assert_eq(route_salt_pinned(xr, &on[1], 3, 64, &d), 0);
		fillers[n++] = d.attempt;
		cr_assert(wait_for(&b_calling, 10000), "shard 1 never read the clock");
		sleep_us(50000);
	}
	/* The target's lane filled with bookings (shard 1 waits for shard 0; shard 0 is in its
	 * clock): routes until one finds it full. */
	int rc = 0;
	for (uint32_t salt = 10; n < 64 && rc == 0; salt++) {
		rc = route_salt_pinned(xr, &on[target], salt, 64, &d);
		if (rc == 0)
			fillers[n++] = d.attempt;
	}
	cr_assert_eq(rc, KVR_EAGAIN, "the lane never filled (%zu routes)", n);
	atomic_store(&a_go, 1);
	cr_assert(wait_for(&a_done, 10000), "shard 0's finish never returned");
	cr_assert_eq(a_rc, 0, "the finish returned %d (%s)", a_rc, a_detail);
	if (target == 1) {
		cr_assert(wait_for(&b_done, 10000), "shard 1's call on shard 0 never returned");
		cr_assert_eq(b_rc, 0);
	}
	atomic_store(&armed, 0);
	/* The end was claimed once: a second finish is stale; it is applied once there is room. */
	cr_assert_eq(kvr_request_finish(xr, victim), KVR_ESTALE);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(kvr_request_finish(xr, fillers[i]), 0);
	cr_assert_eq(kvr_request_finish(xr, trigger), 0);
	for (uint64_t w = 0; w < 2; w++) {
		uint32_t left = 1;
		for (int t = 0; t < 5000 && (left = active(w)) != 0; t++)
			sleep_us(1000);
		cr_assert_eq(left, 0, "rank %u: %u attempts still live", (unsigned)w, left);
	}
	cr_assert_eq(kvr_router_sync(xr, 5000), 0);
	kvr_router_destroy(xr);
}

Test(shard_fulllane, a_clock_finishes_on_a_full_lane_whose_shard_waits_for_it, .timeout = 60)
{
	full_lane(1);
}

Test(shard_fulllane, a_clock_finishes_on_its_own_full_lane, .timeout = 60)
{
	full_lane(0);
}

/* ---------------------------------------------------------------- with sync_booking */

/* Every call of an ordinary thread settles first (waits for the timed work posted to any
 * shard), so the shards are driven from helper threads here, and the test's own thread only
 * reads the lanes' counters until shard 0's finish has returned. */
enum { FILL = 40 };
static uint64_t fill_attempts[FILL];
static int fill_rc[FILL];

static void *stats_of(void *arg) /* makes shard w read the clock (a call on rank {w, 0}) */
{
	struct kvr_rank_stats st;
	(void)kvr_rank_get_stats(xr, (struct kvr_rank_id){(uintptr_t)arg, 0}, &st);
	return NULL;
}

static void *fill(void *arg) /* a booking, or a settle's call, in finish_shard's lane */
{
	uintptr_t i = (uintptr_t)arg;
	const struct kvr_rank_id on = {finish_shard, 0};
	struct kvr_decision d;
	fill_rc[i] = route_salt_pinned(xr, &on, 100 + (uint32_t)i, 64, &d);
	fill_attempts[i] = fill_rc[i] == 0 ? d.attempt : 0;
	return NULL;
}

static uint64_t stalls(unsigned w)
{
	struct kvr_shard_stats st;
	kvr_shard_get_stats(kvr_shards_get(xr->shards, w), &st);
	return st.stalls[KVR_LANE_ROUTING];
}

static void full_lane_sync(unsigned target)
{
	begin(target, true);
	pthread_t t[2], f[FILL];
	cr_assert_eq(pthread_create(&t[0], NULL, stats_of, (void *)0), 0);
	cr_assert(wait_for(&a_in, 10000), "shard 0 never read the clock");
	if (target == 1) {
		cr_assert_eq(pthread_create(&t[1], NULL, stats_of, (void *)1), 0);
		cr_assert(wait_for(&b_calling, 10000), "shard 1 never read the clock");
		sleep_us(50000);
	}
	uint64_t stalls0 = stalls(target);
	for (uintptr_t i = 0; i < FILL; i++)
		cr_assert_eq(pthread_create(&f[i], NULL, fill, (void *)i), 0);
	for (int ms = 0; ms < 10000 && stalls(target) == stalls0; ms++)
		sleep_us(1000);
	cr_assert_gt(stalls(target), stalls0, "shard %u's lane never filled", target);
	atomic_store(&a_go, 1);
	cr_assert(wait_for(&a_done, 10000), "shard 0's finish never returned");
	cr_assert_eq(a_rc, 0, "the finish returned %d (%s)", a_rc, a_detail);
	if (target == 1)
		cr_assert(wait_for(&b_done, 10000), "shard 1's call on shard 0 never returned");
	atomic_store(&armed, 0);
	for (int i = 0; i < (target == 1 ? 2 : 1); i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < FILL; i++) {
		pthread_join(f[i], NULL);
		cr_assert_eq(fill_rc[i], 0, "fill %d: %d", i, fill_rc[i]);
		cr_assert_eq(kvr_request_finish(xr, fill_attempts[i]), 0);
	}
	cr_assert_eq(kvr_request_finish(xr, victim), KVR_ESTALE);
	cr_assert_eq(kvr_router_sync(xr, 5000), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(active(w), 0, "rank %u: attempts still live", (unsigned)w);
	kvr_router_destroy(xr);
}

Test(shard_fulllane, sync_a_clock_finishes_on_a_full_lane_whose_shard_waits_for_it, .timeout = 60)
{
	full_lane_sync(1);
}

Test(shard_fulllane, sync_a_clock_finishes_on_its_own_full_lane, .timeout = 60)
{
	full_lane_sync(0);
}
