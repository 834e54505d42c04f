/*
 * tests/unit/test_queue_lane.c - the admission pass and a shard's full routing lane.
 *
 * A queued request's booking posts to its chosen rank's shard as any route's does; a lane that
 * stays full for 10 ms refuses it on the admission thread's pass, a full lane at once on a
 * frontend's (KVR_EAGAIN inside the pass, core/route.c kvr_admit), and the request stays queued
 * for a later pass.  What the pass does next decides the order: an
 * unrestricted request may use every live rank, so a later request admitted in the same pass,
 * on another shard's rank, took a rank the first could have had (kvrouter.h, queue_policy:
 * requests that share ranks are admitted in the policy's order).
 *
 * The scene, on two shards: rank A (shard of worker 0) and B (worker 1), each saturated by a
 * pinned hog.  Queued, in ticket order (and, all fully cached, WSPT's: every key 0): p, pinned
 * to B with a prefix of B's hog's prompt; u1, unrestricted, with A's hog's prompt (cached on
 * A); u2, unrestricted, with B's hog's prompt.  B's hog ends: the admission thread's pass
 * admits p onto B and stops in on_admit, told p.  Meanwhile A's hog ends, and A's shard is
 * stalled by a task of the test, its routing lane then filled.  on_admit returns: the pass
 * looks at u1 (A free, its prompt cached there: it chooses A), whose booking waits 10 ms on
 * the full lane and is refused; then u2 (B free: B, its prompt's rank).  The lane is released
 * after 300 ms.  u1 must be admitted before u2.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/router_internal.h"
#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/metric.h"
#include "tests/common/mono_clock.h"
#include "tests/common/router_prompts.h"

static struct {
	pthread_mutex_t mu;
	uint64_t ticket[8];
	struct kvr_decision d[8];
	int n;
	uint64_t hold; /* on_admit told this ticket waits for `go` */
	int in, go;    /* atomics */
	int stalled, release;
	uint64_t left_ns; /* atomic: when on_admit told `hold` returned (CLOCK_MONOTONIC) */
} lt = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void sleep_ms(int ms)
{
	sleep_us((long)ms * 1000);
}

static bool wait_flag(int *v, int ms)
{
	for (int t = 0; t < ms && !__atomic_load_n(v, __ATOMIC_ACQUIRE); t++)
		sleep_ms(1);
	return __atomic_load_n(v, __ATOMIC_ACQUIRE);
}

static void lt_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	pthread_mutex_lock(&lt.mu);
	if (lt.n < 8) {
		lt.ticket[lt.n] = ticket;
		lt.d[lt.n] = *d;
	}
	lt.n++;
	pthread_mutex_unlock(&lt.mu);
	if (ticket == lt.hold) {
		__atomic_store_n(&lt.in, 1, __ATOMIC_RELEASE);
		wait_flag(&lt.go, 10000);
		__atomic_store_n(&lt.left_ns, mono_ns(), __ATOMIC_RELEASE);
	}
}

/* Where ticket was told in on_admit's order (its decision in *d), or -1. */
static int told_at(uint64_t ticket, struct kvr_decision *d)
{
	int at = -1;
	pthread_mutex_lock(&lt.mu);
	for (int i = 0; i < lt.n && i < 8; i++)
		if (lt.ticket[i] == ticket) {
			at = i;
			if (d)
				*d = lt.d[i];
		}
	pthread_mutex_unlock(&lt.mu);
	return at;
}

/* Waits up to 10 s until each of the n tickets tk[] was told in on_admit. */
static void wait_told(int n, const uint64_t *tk)
{
	for (int ms = 0; ms < 10000; ms++) {
		int i = 0;
		while (i < n && told_at(tk[i], NULL) >= 0)
			i++;
		if (i == n)
			return;
		sleep_ms(1);
	}
}

/* on_admit, told `ticket`, waits for lt.go. */
static void hold_in_on_admit(uint64_t ticket)
{
	pthread_mutex_lock(&lt.mu);
	lt.hold = ticket;
	pthread_mutex_unlock(&lt.mu);
}

static void stall(struct kvr_shard *sh, void *p)
{
	(void)sh;
	(void)p;
	__atomic_store_n(&lt.stalled, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&lt.release, __ATOMIC_ACQUIRE))
		sleep_ms(1);
}

static void noop(struct kvr_shard *sh, void *p)
{
	(void)sh;
	(void)p;
}

static uint64_t active(struct kvr_router *r, struct kvr_rank_id id)
{
	struct kvr_rank_stats st;
	cr_assert_eq(kvr_rank_get_stats(r, id, &st), 0);
	return st.active_requests;
}

/* Routes the prompt tokens[0, n) (pinned to *pinned unless NULL, with flags): kvr_route's code,
 * its decision in *d. */
static int route_tokens(struct kvr_router *r, const uint32_t *tokens, size_t n,
                        const struct kvr_rank_id *pinned, uint32_t flags, struct kvr_decision *d)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tokens;
	q.n_tokens = n;
	q.pinned = pinned;
	q.flags = flags;
	return kvr_route(r, &q, d);
}

/* route_tokens that must queue: the request's ticket. */
static uint64_t queue_tokens(struct kvr_router *r, const uint32_t *tokens, size_t n,
                             const struct kvr_rank_id *pinned)
{
	struct kvr_decision d;
	cr_assert_eq(route_tokens(r, tokens, n, pinned, 0, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED);
	return d.ticket;
}

/* The admission thread stopped, so that the next pass is the calling thread's route's; it
 * can be started again (kvr_admitter_start). */
static void admitter_pause(struct kvr_router *r)
{
	kvr_admitter_stop(r);
	__atomic_store_n(&r->admitter.stop, 0, __ATOMIC_RELEASE);
}

/* The scene both tests share: the test's state reset, a router of two shards whose lanes hold
 * 16 messages and whose leases never expire (the hogs stay), and ranks a = (0, 0) and b = (1, 0),
 * each with a 16-token prefill budget. */
static struct kvr_router *lane_scene(enum kvr_queue_policy pol)
{
	pthread_mutex_lock(&lt.mu);
	lt.n = 0;
	lt.hold = 0;
	pthread_mutex_unlock(&lt.mu);
	__atomic_store_n(&lt.in, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&lt.go, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&lt.stalled, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&lt.release, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&lt.left_ns, 0, __ATOMIC_RELEASE);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.queue_policy = pol;
	c.on_admit = lt_admit;
	c.lane_capacity = 16;
	c.lane_soft_depth = 0;
	c.lease_scan_interval_ns = 1000000000000000ull;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 100000, 16), 0);
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 100000, 16), 0);
	return r;
}

/* lane_scene with rank A ({0, 0}) and B ({1, 0}) on different shards, each saturated by a
 * pinned hog (64 prefill tokens > 16) until it ends; the hogs' bookings applied. */
struct lane_hogs {
	struct kvr_rank_id a, b;
	struct kvr_shard *sha; /* A's */
	struct kvr_decision ha, hb;
};

static struct kvr_router *lane_scene_hogs(enum kvr_queue_policy pol, struct lane_hogs *h)
{
	struct kvr_router *r = lane_scene(pol);
	h->a = (struct kvr_rank_id){0, 0};
	h->b = (struct kvr_rank_id){1, 0};
	uint32_t sa, sb;
	cr_assert_eq(kvr_router_find_rank(r, h->a, &sa), 0);
	cr_assert_eq(kvr_router_find_rank(r, h->b, &sb), 0);
	h->sha = kvr_router_shard_of(r, sa);
	cr_assert_neq(kvr_shard_index(h->sha), kvr_shard_index(kvr_router_shard_of(r, sb)),
	              "A and B on different shards");
	cr_assert_eq(route_salt_pinned(r, &h->a, 41000, 64, &h->ha), 0);
	cr_assert_eq(route_salt_pinned(r, &h->b, 41001, 64, &h->hb), 0);
	cr_assert_eq(h->ha.status, KVR_DECIDED);
	cr_assert_eq(h->hb.status, KVR_DECIDED);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	return r;
}

/* A hog ends: its request finished, its rank's load back to 0 (the read runs after the finish on
 * the rank's shard). */
static void hog_ends(struct kvr_router *r, const struct kvr_decision *hog, struct kvr_rank_id id)
{
	cr_assert_eq(kvr_request_finish(r, hog->attempt), 0);
	cr_assert_eq(active(r, id), 0);
}

/* Both hogs end (A's, then B's), then both ranks' loads are back to 0. */
static void both_hogs_end(struct kvr_router *r, const struct lane_hogs *h)
{
	cr_assert_eq(kvr_request_finish(r, h->ha.attempt), 0);
	cr_assert_eq(kvr_request_finish(r, h->hb.attempt), 0);
	cr_assert_eq(active(r, h->a), 0);
	cr_assert_eq(active(r, h->b), 0);
}

/* A's shard stalls (until lt.release) and its routing lane fills. */
static void stall_and_fill(struct kvr_shard *sha)
{
	cr_assert_eq(kvr_shard_post(sha, KVR_LANE_ROUTING, stall, NULL, 0), 0);
	cr_assert(wait_flag(&lt.stalled, 10000), "A's shard never ran the stall");
	int n = 0, rc = 0;
	while (n < 100000 && (rc = kvr_shard_post(sha, KVR_LANE_ROUTING, noop, NULL, 0)) == 0)
		n++;
	cr_assert_eq(rc, KVR_EAGAIN, "A's lane never filled (%d posts)", n);
}

static void a_full_lane_does_not_let_a_later_request_go_first(enum kvr_queue_policy pol)
{
	struct lane_hogs h;
	struct kvr_router *r = lane_scene_hogs(pol, &h);
	/* p (B's hog's first block, pinned to B), u1 (A's hog's prompt), u2 (B's). */
	static uint32_t tp[16], tu1[64], tu2[64];
	prompt(tp, 16, 41001);
	prompt(tu1, 64, 41000);
	prompt(tu2, 64, 41001);
	const uint64_t tkp = queue_tokens(r, tp, 16, &h.b);
	const uint64_t tk1 = queue_tokens(r, tu1, 64, NULL);
	const uint64_t tk2 = queue_tokens(r, tu2, 64, NULL);
	hold_in_on_admit(tkp);
	/* B's hog ends: a pass admits p and stops in on_admit. */
	cr_assert_eq(kvr_request_finish(r, h.hb.attempt), 0);
	cr_assert(wait_flag(&lt.in, 10000), "p was never admitted");
	/* A's hog ends (applied: the call below runs after it on A's shard), then A's shard
	 * stalls and its routing lane fills. */
	hog_ends(r, &h.ha, h.a);
	stall_and_fill(h.sha);
	/* The pass goes on: u1's booking on A is refused (10 ms), u2 may use B. */
	__atomic_store_n(&lt.go, 1, __ATOMIC_RELEASE);
	sleep_ms(300);
	int early = told_at(tk2, NULL);
	__atomic_store_n(&lt.release, 1, __ATOMIC_RELEASE);
	wait_told(2, (const uint64_t[]){tk1, tk2});
	struct kvr_decision d1, d2;
	int at1 = told_at(tk1, &d1), at2 = told_at(tk2, &d2);
	cr_assert_geq(at1, 0, "u1 was never admitted");
	cr_assert_geq(at2, 0, "u2 was never admitted");
	cr_assert_eq(d1.status, KVR_DECIDED);
	cr_assert_eq(d2.status, KVR_DECIDED);
	cr_assert_eq(d1.rank.worker_id, h.a.worker_id, "u1 chose A, where its prompt is cached");
	cr_assert_eq(d2.rank.worker_id, h.b.worker_id, "u2 chose B, where its prompt is cached");
	cr_assert_lt(at1, at2,
	             "u2 (ticket %llu) was admitted on B %s u1 (ticket %llu), before it, whose "
	             "booking on A found the lane full",
	             (unsigned long long)tk2,
	             early >= 0 ? "while A's lane stayed full, ahead of" : "ahead of",
	             (unsigned long long)tk1);
	kvr_router_destroy(r);
}

Test(queue_lane, fcfs_a_full_lane_does_not_let_a_later_request_go_first, .timeout = 60)
{
	a_full_lane_does_not_let_a_later_request_go_first(KVR_QUEUE_FCFS);
}

Test(queue_lane, wspt_a_full_lane_does_not_let_a_later_request_go_first, .timeout = 60)
{
	a_full_lane_does_not_let_a_later_request_go_first(KVR_QUEUE_WSPT);
}

/* Issue 11: routing never waits without bound on a shard.  A frontend's kvr_route that holds
 * the pump (its pass is the one running) met an unrestricted request whose chosen rank's lane
 * stays full: its booking waits 10 ms and is refused, which ends the pass; but any call that
 * asked for a pump meanwhile (another frontend's route, the admission thread woken by the
 * refusal) makes the pass run again (q->again), so the route retried the full lane every 10 ms
 * for as long as it stayed full.  The retry is the admission thread's: the route returns after
 * one refused booking.  And that booking does not wait either: a frontend's pass posts it
 * without the bounded wait (refused at once on the full lane, core/route.c kvr_admit), and
 * only the admission thread's retry waits (before, the route paid one 10 ms wait: it came back
 * 10.3-21.2 ms after on_admit returned).
 *
 * The scene: rank A (shard X) and B (shard Y), each saturated by a pinned hog; p (pinned to B)
 * and u (unrestricted, A's hog's prompt) queued.  The admission thread is stopped while B's hog
 * ends, so that the pass that admits p is this thread's kvr_route, held in on_admit; it is
 * started again, A's hog ends, A's shard stalls and its lane fills, a second frontend routes
 * (query only) in a loop, and on_admit returns.  The route's pass then tries u on A: it must
 * return at once (under 5 ms: its work is microseconds, the margin is for preemption on a
 * loaded machine) while the lane stays full (1 s). */
static struct {
	struct kvr_router *r;
	struct lane_hogs h;
	const uint32_t *tokens;
	int stop;                   /* atomic: the hammer returns */
	uint64_t go_ns, release_ns; /* atomics */
	long routes, failed;
} fr;

static void *hammer(void *arg)
{
	(void)arg;
	while (!__atomic_load_n(&fr.stop, __ATOMIC_ACQUIRE)) {
		struct kvr_decision d;
		fr.failed += route_tokens(fr.r, fr.tokens, 64, NULL, KVR_ROUTE_QUERY_ONLY, &d) != 0;
		fr.routes++;
	}
	return NULL;
}

/* While main's route is held in on_admit: A's hog ends, A's lane fills, the hammer starts; then
 * on_admit is let go, and the lane stays full for 1 s. */
static void *scene(void *arg)
{
	pthread_t *h = arg;
	cr_assert(wait_flag(&lt.in, 10000), "p was never admitted");
	cr_assert_eq(kvr_admitter_start(fr.r), 0);
	hog_ends(fr.r, &fr.h.ha, fr.h.a);
	stall_and_fill(fr.h.sha);
	cr_assert_eq(pthread_create(h, NULL, hammer, NULL), 0);
	sleep_ms(20);
	__atomic_store_n(&fr.go_ns, mono_ns(), __ATOMIC_RELEASE);
	__atomic_store_n(&lt.go, 1, __ATOMIC_RELEASE);
	sleep_ms(1000);
	__atomic_store_n(&fr.release_ns, mono_ns(), __ATOMIC_RELEASE);
	__atomic_store_n(&lt.release, 1, __ATOMIC_RELEASE);
	return NULL;
}

Test(queue_lane, a_route_that_pumps_does_not_retry_a_full_lane_while_it_stays_full, .timeout = 60)
{
	struct kvr_router *r = lane_scene_hogs(KVR_QUEUE_FCFS, &fr.h);
	fr.r = r;
	static uint32_t tp[16], tu[64], tq[64];
	prompt(tp, 16, 41001);
	prompt(tu, 64, 41000);
	prompt(tq, 64, 41002);
	fr.tokens = tq;
	hold_in_on_admit(queue_tokens(r, tp, 16, &fr.h.b));
	const uint64_t tku = queue_tokens(r, tu, 64, NULL);
	/* No admission thread while B's hog ends: the next pass is this thread's route's. */
	admitter_pause(r);
	hog_ends(r, &fr.h.hb, fr.h.b);
	pthread_t sc, h;
	cr_assert_eq(pthread_create(&sc, NULL, scene, &h), 0);
	/* This route pumps: it admits p, held in on_admit. */
	struct kvr_decision d;
	cr_assert_eq(route_tokens(r, tq, 64, NULL, KVR_ROUTE_QUERY_ONLY, &d), 0);
	uint64_t back = mono_ns();
	pthread_join(sc, NULL);
	__atomic_store_n(&fr.stop, 1, __ATOMIC_RELEASE);
	pthread_join(h, NULL);
	uint64_t go = __atomic_load_n(&fr.go_ns, __ATOMIC_ACQUIRE);
	uint64_t rel = __atomic_load_n(&fr.release_ns, __ATOMIC_ACQUIRE);
	uint64_t left = __atomic_load_n(&lt.left_ns, __ATOMIC_ACQUIRE);
	cr_assert_neq(left, 0);
	cr_log_info("route back %.3f ms after on_admit returned (lane released %.1f ms after "
	            "on_admit was let go), %ld hammer routes",
	            (back - left) / 1e6, (rel - go) / 1e6, fr.routes);
	cr_assert_lt(
	    back, go + 200000000ull,
	    "the route came back %.1f ms after on_admit returned, with A's lane full for "
	    "%.1f ms: it retried u's booking on the full lane for as long as it stayed full",
	    (back - go) / 1e6, (rel - go) / 1e6);
	cr_assert_lt(back, left + 5000000ull,
	             "the route came back %.3f ms after on_admit returned, with A's lane full: "
	             "its pass waited on the full lane for u's booking",
	             (back - left) / 1e6);
	/* u is admitted once the lane is free (the admission thread's retry, or this pump). */
	for (int ms = 0; ms < 10000 && told_at(tku, NULL) < 0; ms++) {
		sleep_ms(1);
		if (ms % 100 == 0)
			(void)kvr_router_sync(r, 5000);
	}
	cr_assert_geq(told_at(tku, NULL), 0, "u was never admitted");
	/* Every route call above returned 0 (the hammer's: fr.failed): a pass's refused bookings
	 * are no failed calls for kvr_route_errors_total ("Route calls that failed"); each
	 * counted before (~90 in this second). */
	unsigned long long errors = kvr_test_metric(r, "kvr_route_errors_total");
	cr_assert_eq(errors, (unsigned long long)fr.failed,
	             "kvr_route_errors_total %llu, with %ld route calls failed", errors, fr.failed);
	kvr_router_destroy(r);
}

/* A frontend's pass that ends at a refused booking (its chosen rank's lane full) hands the
 * retry to the admission thread; the same kvr_route then routed its own request as if nobody
 * waited (its pump ran, so it did not ask whether a waiting request could be admitted), and
 * that later request took another shard's free rank while the earlier one, which may use it
 * too, waited (kvrouter.h, queue_policy: requests that share ranks are admitted in the
 * policy's order).  It queues behind it now.  (With the 10 ms wait the pass made before the
 * refusal, a lane that drained within it let the pass admit the earlier one first; refused at
 * once, only the order of the queue keeps it first.)
 *
 * The scene: rank A (shard X) and B (shard Y), each saturated by a pinned hog; u queued
 * (unrestricted, A's hog's prompt: it chooses A).  No admission thread, so that the next pass
 * is this thread's kvr_route.  Both hogs end, A's shard stalls and its lane fills.  A new
 * request v (unrestricted, B's hog's prompt: it would choose B) is routed: its pass refuses u's
 * booking on A, and v must queue behind u, which is admitted first once the lane is free. */
static void a_route_whose_pass_met_a_full_lane_queues_behind(enum kvr_queue_policy pol)
{
	struct lane_hogs h;
	struct kvr_router *r = lane_scene_hogs(pol, &h);
	static uint32_t tu[64], tv[64];
	prompt(tu, 64, 41000);
	prompt(tv, 64, 41001);
	const uint64_t tku = queue_tokens(r, tu, 64, NULL);
	/* No admission thread while the hogs end: the next pass is this thread's route's. */
	admitter_pause(r);
	both_hogs_end(r, &h);
	stall_and_fill(h.sha);
	struct kvr_decision d;
	cr_assert_eq(route_tokens(r, tv, 64, NULL, 0, &d), 0);
	const int v_status = d.status;
	const uint64_t tkv = d.ticket;
	const struct kvr_rank_id v_rank = d.rank;
	cr_assert_lt(told_at(tku, NULL), 0, "u was admitted on A with its lane full");
	/* The lane frees; the admission thread (started again) retries u. */
	cr_assert_eq(kvr_admitter_start(r), 0);
	__atomic_store_n(&lt.release, 1, __ATOMIC_RELEASE);
	kvr_admitter_wake(r);
	wait_told(v_status == KVR_QUEUED ? 2 : 1, (const uint64_t[]){tku, tkv});
	int atu = told_at(tku, NULL);
	cr_assert_geq(atu, 0, "u was never admitted");
	cr_assert_eq(v_status, KVR_QUEUED,
	             "v, routed after u, was decided at once (on worker %llu) while u waited for "
	             "A's full lane: it went first",
	             (unsigned long long)v_rank.worker_id);
	int atv = told_at(tkv, NULL);
	cr_assert_geq(atv, 0, "v was never admitted");
	cr_assert_lt(atu, atv, "u before v");
	kvr_router_destroy(r);
}

Test(queue_lane, fcfs_a_route_whose_pass_met_a_full_lane_queues_behind, .timeout = 60)
{
	a_route_whose_pass_met_a_full_lane_queues_behind(KVR_QUEUE_FCFS);
}

Test(queue_lane, wspt_a_route_whose_pass_met_a_full_lane_queues_behind, .timeout = 60)
{
	a_route_whose_pass_met_a_full_lane_queues_behind(KVR_QUEUE_WSPT);
}

/* A frontend's pass refuses a queued request's booking on a full lane at once (no wait), and
 * the admission thread retries it.  That refusal was counted nowhere: not in
 * kvr_lane_full_waits_total (it did not wait) nor in kvr_lane_full_drops_total (nothing was
 * given up after the bounded wait).  Had the lane drained before the admission thread's retry,
 * which then found room and waited for nothing, an operator saw no sign that a lane was ever
 * full.  It is kvr_lane_full_refusals_total's.
 *
 * The scene of a_route_whose_pass_met_a_full_lane_queues_behind: u queued (it chooses A), no
 * admission thread, both hogs end, A's shard stalls and its lane fills; v's route runs the
 * pass, which refuses u's booking.  The lane is released and drained before the admission
 * thread starts again, so that its retry finds room. */
static uint64_t metric_or_zero(const char *buf, const char *name)
{
	char key[128];
	snprintf(key, sizeof(key), "\n%s ", name);
	const char *p = strstr(buf, key);
	return p ? strtoull(p + strlen(key), NULL, 10) : 0;
}

Test(queue_lane, a_frontends_refused_booking_on_a_full_lane_is_counted, .timeout = 60)
{
	struct lane_hogs h;
	struct kvr_router *r = lane_scene_hogs(KVR_QUEUE_FCFS, &h);
	static uint32_t tu[64], tv[64];
	static char buf[1 << 16];
	prompt(tu, 64, 41000);
	prompt(tv, 64, 41001);
	const uint64_t tku = queue_tokens(r, tu, 64, NULL);
	admitter_pause(r);
	both_hogs_end(r, &h);
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf), NULL), 0);
	const uint64_t refused0 = metric_or_zero(buf, "kvr_lane_full_refusals_total");
	stall_and_fill(h.sha);
	/* v's route: its pass refuses u's booking on A. */
	struct kvr_decision d;
	cr_assert_eq(route_tokens(r, tv, 64, NULL, 0, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED, "v queued behind u");
	cr_assert_lt(told_at(tku, NULL), 0, "u was admitted on A with its lane full");
	/* The lane drains (the sync runs after the stall and every filler), then the admission
	 * thread retries u and finds room. */
	__atomic_store_n(&lt.release, 1, __ATOMIC_RELEASE);
	cr_assert_eq(kvr_router_sync(r, 5000), 0);
	cr_assert_eq(kvr_admitter_start(r), 0);
	kvr_admitter_wake(r);
	wait_told(1, &tku);
	cr_assert_geq(told_at(tku, NULL), 0, "u was never admitted");
	cr_assert_eq(kvr_metrics_render(r, buf, sizeof(buf), NULL), 0);
	const uint64_t waits = metric_or_zero(buf, "kvr_lane_full_waits_total");
	const uint64_t drops = metric_or_zero(buf, "kvr_lane_full_drops_total");
	const uint64_t refused = metric_or_zero(buf, "kvr_lane_full_refusals_total") - refused0;
	cr_log_info("lane full: %llu refusals, %llu waits, %llu drops", (unsigned long long)refused,
	            (unsigned long long)waits, (unsigned long long)drops);
	cr_assert_eq(refused0, 0);
	cr_assert_geq(refused, 1,
	              "u's booking, refused at once on A's full lane in v's pass, was counted "
	              "nowhere (kvr_lane_full_refusals_total %llu, kvr_lane_full_waits_total %llu, "
	              "kvr_lane_full_drops_total %llu)",
	              (unsigned long long)refused, (unsigned long long)waits,
	              (unsigned long long)drops);
	/* One refusal a pass that met the full lane: v's route ran at most two (before and
	 * after its push). */
	cr_assert_leq(refused, 2);
	cr_assert_eq(drops, 0, "nothing was given up");
	kvr_router_destroy(r);
}
