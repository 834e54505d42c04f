/* The router's clock calling the queue's blocking calls on a ticket that is being admitted.
 *
 * An admission pass reads the clock while its entry is being admitted (in kvr_admit, and
 * between entries), on the thread that runs the pass; with sync_booking the pass then waits
 * for the chosen rank's shard, whose tasks read the clock too.  kvr_route_cancel waits for an
 * entry being admitted to come out of its admission, and kvr_route_wait waits for an outcome:
 * from the pass's own thread, or from the shard the pass waits for, each waited for itself.
 * Before, a clock that cancelled on its K-th reading after the finish that runs the pass hung
 * at K = 2 and 3 (the audit's probe: gdb showed kvr_route_cancel's condition wait under
 * clock <- kvr_admit <- kvr_queue_pump).  Now both calls return KVR_EBUSY there (nothing done:
 * the ticket stays as it is), and kvr_route with KVR_ROUTE_WAIT there returns a request that
 * queues as KVR_QUEUED with its ticket (the wait's refusal alone left it queued for nobody:
 * a queue depth of 1 at the end).  Every K runs in a child under an alarm, so a hang fails that K
 * instead of the whole binary. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"

enum call { CALL_CANCEL, CALL_WAIT, CALL_ROUTE_WAIT };

static struct kvr_router *R;
static uint64_t ticket;
static pthread_t runner;
static enum call which;
static bool on_shard; /* the clock calls from the shards' threads, not the pass's */
static bool no_admit; /* CALL_ROUTE_WAIT without on_admit: tickets are collected by waits */
static atomic_int armed, readings, in_call, rcs_seen;
static int at_reading;
static int call_rc = 1;
static struct kvr_decision routed; /* CALL_ROUTE_WAIT's decision */
static uint32_t third[64];         /* CALL_ROUTE_WAIT's prompt */

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t clock_calls_queue(void *ctx)
{
	(void)ctx;
	bool mine = pthread_equal(pthread_self(), runner);
	if (atomic_load(&armed) && mine != on_shard &&
	    atomic_fetch_add(&readings, 1) + 1 == at_reading && !atomic_exchange(&in_call, 1)) {
		struct kvr_decision d;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = third;
		q.n_tokens = 64;
		q.flags = KVR_ROUTE_WAIT;
		call_rc = which == CALL_CANCEL ? kvr_route_cancel(R, ticket)
		          : which == CALL_WAIT ? kvr_route_wait(R, ticket, 0, &d)
		                               : kvr_route(R, &q, &routed);
		atomic_store(&rcs_seen, 1);
	}
	return mono_ns();
}

static uint64_t gauge(const char *name);

/* on_admit (CALL_ROUTE_WAIT's scenes): the tickets told, and their attempts to finish. */
static _Atomic uint64_t told_ticket[8], told_attempt[8];
static atomic_int n_told;

static void told(void *ctx, uint64_t t, const struct kvr_decision *d)
{
	(void)ctx;
	int i = atomic_fetch_add(&n_told, 1);
	if (i < 8) {
		atomic_store(&told_attempt[i], d->status == KVR_DECIDED ? d->attempt : 0);
		atomic_store(&told_ticket[i], t);
	}
}

/* Scenes (children) whose clock's route came back KVR_QUEUED and was then told (or, without
 * on_admit, collected by a wait): the path CALL_ROUTE_WAIT's scenes are for, counted across
 * the fork (shared memory). */
static atomic_int *queued_told;

/* Finishes what on_admit told until nothing is queued or uncollected and, when the clock's
 * route queued, its ticket was told: 0, or the step that failed.  Gives up after 2 s, well
 * inside the child's 5 s alarm, so a ticket never told fails as such (22), not as a hang. */
static int drain_told(void)
{
	int finished = 0;
	for (uint64_t end = mono_ns() + 2000000000ull; mono_ns() < end;) {
		for (; finished < atomic_load(&n_told) && finished < 8; finished++) {
			while (!atomic_load(&told_ticket[finished]))
				;
			uint64_t at = atomic_load(&told_attempt[finished]);
			if (at)
				kvr_request_finish(R, at);
		}
		bool seen = !(call_rc == 0 && routed.status == KVR_QUEUED);
		for (int i = 0; i < finished; i++)
			seen |= atomic_load(&told_ticket[i]) == routed.ticket;
		if (kvr_router_sync(R, 10000))
			return 15;
		if (seen && gauge("kvr_queue_depth") == 0 && gauge("kvr_queue_uncollected") == 0) {
			if (call_rc == 0 && routed.status == KVR_QUEUED)
				atomic_fetch_add(queued_told, 1);
			return 0;
		}
		usleep(1000);
	}
	return 22; /* the clock's queued route was never told (held for a wait that never came) */
}

/* An unlabelled gauge of R as kvr_metrics_render prints it; UINT64_MAX if not there. */
static uint64_t gauge(const char *name)
{
	static char buf[1 << 16];
	size_t len = 0;
	char key[128];
	snprintf(key, sizeof(key), "\n%s ", name);
	if (kvr_metrics_render(R, buf, sizeof(buf), &len))
		return UINT64_MAX;
	const char *p = strstr(buf, key);
	return p ? strtoull(p + strlen(key), NULL, 10) : UINT64_MAX;
}

/* One router (one shard, one rank that takes one request), a request admitted and a second one
 * queued behind it; the finish of the first runs the pass that admits the second, with the
 * clock armed.  The child's exit code: 0, or the step that failed. */
static int scene(void)
{
	runner = pthread_self();
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = clock_calls_queue;
	c.sync_booking = true;
	c.queue_threshold = 1.0;
	if (which == CALL_ROUTE_WAIT && !no_admit)
		c.on_admit = told;
	if (kvr_router_create(&c, &R))
		return 10;
	if (kvr_rank_add(R, (struct kvr_rank_id){7, 0}, 1, 1000, 16))
		return 11;
	uint32_t toks[64];
	for (int i = 0; i < 64; i++)
		toks[i] = (uint32_t)i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = toks;
	q.n_tokens = 64;
	struct kvr_decision a, b;
	if (kvr_route(R, &q, &a) || a.status != KVR_DECIDED)
		return 12;
	toks[0] = 999;
	if (kvr_route(R, &q, &b) || b.status != KVR_QUEUED)
		return 13;
	ticket = b.ticket;
	atomic_store(&armed, 1);
	int rc = kvr_request_finish(R, a.attempt);
	atomic_store(&armed, 0);
	if (rc)
		return 14;
	if (kvr_router_sync(R, 10000))
		return 15;
	/* What the clock's call said is what happened: cancelled (never served), refused (the
	 * ticket as it was: admitted by the pass, its outcome still to collect), collected by the
	 * wait, or not queued any more. */
	if (which == CALL_ROUTE_WAIT && !no_admit) {
		/* Routed (admitted, or queued with its ticket and told by on_admit as without the
		 * flag: the wait does not sleep there), or refused inside the pass that would admit
		 * it, nothing queued. */
		if (atomic_load(&rcs_seen) && call_rc != 0 && call_rc != KVR_EBUSY)
			return 19;
		if (atomic_load(&rcs_seen) && call_rc == 0 && routed.status == KVR_DECIDED)
			kvr_request_finish(R, routed.attempt);
		int rc2 = drain_told();
		if (rc2)
			return rc2;
		kvr_router_destroy(R);
		return 0;
	}
	struct kvr_decision d;
	int after = kvr_route_wait(R, ticket, 1, &d);
	if (atomic_load(&rcs_seen)) {
		if (call_rc == 0 && which == CALL_CANCEL && after != KVR_ENOENT)
			return 16; /* cancelled, yet its ticket is still there */
		if (call_rc == KVR_EBUSY && after != 0)
			return 17; /* refused, so the pass admitted it: its outcome is there */
		if (call_rc != 0 && call_rc != KVR_EBUSY && call_rc != KVR_ENOENT)
			return 18;
	}
	if (after == 0 && d.status == KVR_DECIDED)
		kvr_request_finish(R, d.attempt);
	if (which == CALL_ROUTE_WAIT && atomic_load(&rcs_seen) && call_rc == 0) {
		/* Without on_admit, a route that queued inside the router is kept for its collector
		 * as a plain queued request is: a wait from outside collects it (its attempt alive,
		 * nothing reclaims it). */
		if (routed.status == KVR_QUEUED) {
			if (kvr_route_wait(R, routed.ticket, kvr_router_now(R) + 2000000000ull,
			                   &routed) ||
			    routed.status != KVR_DECIDED)
				return 21;
			atomic_fetch_add(queued_told, 1);
		}
		kvr_request_finish(R, routed.attempt);
	}
	if (kvr_router_sync(R, 10000))
		return 15;
	/* Nothing left queued or uncollected. */
	if (gauge("kvr_queue_depth") != 0 || gauge("kvr_queue_uncollected") != 0)
		return 20;
	kvr_router_destroy(R);
	return 0;
}

static void each_reading(enum call w, bool shard)
{
	which = w;
	on_shard = shard;
	int hung = 0, failed = 0;
	queued_told = mmap(NULL, sizeof(*queued_told), PROT_READ | PROT_WRITE,
	                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert_neq(queued_told, MAP_FAILED, "mmap failed");
	atomic_store(queued_told, 0);
	for (int i = 0; i < 64; i++)
		third[i] = 5000u + (uint32_t)i;
	for (at_reading = 1; at_reading <= 12; at_reading++) {
		fflush(NULL);
		pid_t pid = fork();
		cr_assert_geq(pid, 0, "fork failed");
		if (pid == 0) {
			alarm(5);
			_exit(scene());
		}
		int st = 0;
		cr_assert_eq(waitpid(pid, &st, 0), pid);
		if (WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM) {
			hung++;
			fprintf(stderr, "%s from the %s: the clock's reading %d: hung\n",
			        w == CALL_CANCEL ? "kvr_route_cancel"
			        : w == CALL_WAIT ? "kvr_route_wait"
			                         : "kvr_route with KVR_ROUTE_WAIT",
			        shard ? "shard" : "pass's thread", at_reading);
		} else if (!WIFEXITED(st) || WEXITSTATUS(st)) {
			failed++;
			fprintf(stderr, "reading %d: child status %d (exit code %d)\n", at_reading,
			        st, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
		}
	}
	cr_expect_eq(hung, 0, "%d of 12 scenes hung", hung);
	cr_expect_eq(failed, 0, "%d of 12 scenes failed", failed);
	/* Else every scene was refused inside the pass, routed at once, or made no call: the
	 * queued route that on_admit must tell was never there to check. */
	if (w == CALL_ROUTE_WAIT)
		cr_expect_gt(atomic_load(queued_told), 0,
		             "no scene's route from the clock queued and was told");
	munmap(queued_told, sizeof(*queued_told));
}

Test(queue_clock_calls, a_cancel_from_the_clock_of_the_pass_that_admits_the_ticket, .timeout = 120)
{
	each_reading(CALL_CANCEL, false);
}

Test(queue_clock_calls, a_wait_from_the_clock_of_the_pass_that_admits_the_ticket, .timeout = 120)
{
	each_reading(CALL_WAIT, false);
}

Test(queue_clock_calls, a_cancel_from_the_clock_of_the_shard_the_pass_waits_for, .timeout = 120)
{
	each_reading(CALL_CANCEL, true);
}

Test(queue_clock_calls, a_wait_from_the_clock_of_the_shard_the_pass_waits_for, .timeout = 120)
{
	each_reading(CALL_WAIT, true);
}

Test(queue_clock_calls, a_waited_route_from_the_clock_of_the_pass, .timeout = 120)
{
	each_reading(CALL_ROUTE_WAIT, false);
}

Test(queue_clock_calls, a_waited_route_from_the_clock_of_the_shard_the_pass_waits_for,
     .timeout = 120)
{
	each_reading(CALL_ROUTE_WAIT, true);
}

Test(queue_clock_calls, a_waited_route_from_the_clock_without_on_admit_is_collected_by_a_wait,
     .timeout = 120)
{
	no_admit = true; /* each Test runs in its own process */
	each_reading(CALL_ROUTE_WAIT, true);
}

/* KVR_ROUTE_WAIT inside the router with a deadline already passed: the wait would not sleep
 * (kvr_route_wait honours a passed deadline there), so the route answers as outside:
 * KVR_ETIMEDOUT, d KVR_QUEUED with its ticket, which stays queued for a later wait.  Before,
 * it came back 0 with KVR_QUEUED, as a route without the flag. */
static atomic_int late_armed;
static int late_rc = 1;
static struct kvr_decision late_d;

static uint64_t clock_routes_late(void *ctx)
{
	(void)ctx;
	if (atomic_exchange(&late_armed, 0)) {
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = third;
		q.n_tokens = 64;
		q.flags = KVR_ROUTE_WAIT;
		q.deadline_ns = 1; /* passed: the clock reads mono_ns() */
		late_rc = kvr_route(R, &q, &late_d);
	}
	return mono_ns();
}

Test(queue_clock_calls, a_waited_route_from_the_clock_past_its_deadline_times_out)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.now_ns = clock_routes_late;
	c.queue_threshold = 1.0;
	cr_assert_eq(kvr_router_create(&c, &R), 0);
	cr_assert_eq(kvr_rank_add(R, (struct kvr_rank_id){7, 0}, 1, 1000, 16), 0);
	uint32_t toks[64];
	for (int i = 0; i < 64; i++) {
		toks[i] = (uint32_t)i;
		third[i] = 5000u + (uint32_t)i;
	}
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = toks;
	q.n_tokens = 64;
	struct kvr_decision a, d;
	cr_assert_eq(kvr_route(R, &q, &a), 0);
	cr_assert_eq(a.status, KVR_DECIDED); /* the rank is saturated now */
	atomic_store(&late_armed, 1);
	(void)kvr_router_now(R); /* the clock routes, inside the router */
	cr_assert_eq(atomic_load(&late_armed), 0, "the clock was not read");
	cr_expect_eq(late_rc, KVR_ETIMEDOUT, "the route returned %d (%s), status %d", late_rc,
	             kvr_strerror(late_rc), late_d.status);
	cr_assert_eq(late_d.status, KVR_QUEUED);
	cr_assert_neq(late_d.ticket, 0);
	/* It stays queued for a wait: the finish frees the rank, the wait collects it. */
	cr_assert_eq(kvr_request_finish(R, a.attempt), 0);
	cr_assert_eq(kvr_route_wait(R, late_d.ticket, kvr_router_now(R) + 5000000000ull, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	cr_assert_eq(kvr_request_finish(R, d.attempt), 0);
	kvr_router_destroy(R);
}
