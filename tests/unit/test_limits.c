/* Configuration values at the ends of their documented ranges, and what they must not break.
 *
 * idle_spin_never_delays_the_reaper: shard_idle_spin_ns has no upper bound ("polls this long
 * before it parks"), and a latency-minded embedder with a core to spare sets it huge.  The
 * spin polled the lanes only, never the timers: an idle shard spun for the whole setting
 * before it looked at its timers again, so the lease reaper (and TTL expiry) did not run while
 * no message came; an abandoned attempt kept its lease and its load for good.  The spin now
 * ends at the next timer.
 *
 * idle_spin_max_is_not_no_spin: the shard runtime's "no spin" is UINT64_MAX, the router's is 0;
 * a shard_idle_spin_ns of UINT64_MAX (the longest spin there is) was passed through and read as
 * "park at once". */
#include <criterion/criterion.h>
#include <time.h>

#include "core/router_internal.h"
#include "kvrouter.h"

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
}

/* A one-shard router (lease scans every 10 ms) with one rank, and one 64-token route on it. */
static struct kvr_router *one_route(uint64_t idle_spin_ns, struct kvr_decision *d)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.shard_idle_spin_ns = idle_spin_ns;
	c.lease_scan_interval_ns = 10 * 1000 * 1000;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_rank_id id = {1, 0};
	cr_assert_eq(kvr_rank_add(r, id, 1, 1000, 0), 0);
	uint32_t tok[64];
	for (int i = 0; i < 64; i++)
		tok[i] = (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = 64;
	cr_assert_eq(kvr_route(r, &q, d), 0);
	return r;
}

Test(limits, idle_spin_never_delays_the_reaper, .timeout = 60)
{
	struct kvr_decision d;
	struct kvr_router *r = one_route(UINT64_MAX - 1 /* the real clock */, &d);
	/* No progress for 100 scan intervals: the attempt must have expired (one to two
	 * intervals).  kvr_request_finish claims it on this thread, without asking the shard
	 * (which would run the timers first). */
	sleep_ms(1000);
	cr_assert_eq(kvr_request_finish(r, d.attempt), KVR_ESTALE,
	             "an attempt idle for 100 lease scan intervals did not expire");
	kvr_router_destroy(r);
}

/* The shard's polling CPU time after one route and 100 ms idle (timers every 10 ms end each
 * spin, so at least one spin has been counted). */
static uint64_t spin_after_idle(uint64_t idle_spin_ns)
{
	struct kvr_decision d;
	struct kvr_router *r = one_route(idle_spin_ns, &d);
	cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	sleep_ms(100);
	struct kvr_shard_stats st;
	kvr_shard_get_stats(kvr_shards_get(r->shards, 0), &st);
	kvr_router_destroy(r);
	return st.spin_ns;
}

Test(limits, idle_spin_max_is_not_no_spin, .timeout = 60)
{
	cr_assert_eq(spin_after_idle(0), 0, "shard_idle_spin_ns 0 (park at once) spun");
	cr_assert_gt(spin_after_idle(UINT64_MAX), 0,
	             "shard_idle_spin_ns UINT64_MAX parked at once, as if it were 0");
}
