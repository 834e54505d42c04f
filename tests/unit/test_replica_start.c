/*
 * kvr_replica_start announces the ranks its router holds already (an add each, in its rank table
 * and to the peers), reading them while the router's own rank changes go on: those are noted
 * (the hooks are installed first) and pushed to the replica's sender as they land.  A change
 * landing after the start read a rank but before it pushed that rank's add went out first, and
 * the start's older add then came after it with a newer version: a rank removed meanwhile was
 * told added (the peers added it, the table served it), a reset's incarnation was overwritten
 * by the one read before it.
 *
 * The window is forced: kvr_rank_get_stats is wrapped (ld --wrap, tests/meson.build) to do what
 * another thread's admin call would do right after the start's real read of rank 3 returned:
 * remove it, or reset it to a new incarnation.  Over the in-process bus
 * (tests/unit/replica_bus.h), replica 2 listening.
 */
#include "core/alloc.h"
#include "core/router_internal.h"
#include "sync/replica_internal.h"
#include "sync/thread.h"
#include "tests/unit/replica_bus.h"

int __real_kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                              struct kvr_rank_stats *out);
int __wrap_kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                              struct kvr_rank_stats *out);
int __real_kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg);
int __wrap_kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg);

enum change { NONE, REMOVE, RESET };
static enum change armed;
static pthread_t armed_on; /* the start's thread: the peers' apply threads read stats too */
static bool fired;
static const struct kvr_rank_id three = {3, 0};

int __wrap_kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                              struct kvr_rank_stats *out)
{
	int rc = __real_kvr_rank_get_stats(r, rank, out);
	if (armed != NONE && pthread_equal(pthread_self(), armed_on) &&
	    rank.worker_id == three.worker_id && rc == 0) {
		enum change c = armed;
		armed = NONE;
		fired = true;
		if (c == REMOVE)
			cr_assert_eq(kvr_rank_remove(r, three), 0);
		else
			cr_assert_eq(kvr_rank_reset(r, three, 9), 0);
	}
	return rc;
}

static bool has_rank(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	return __real_kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s) == 0;
}

static uint64_t incarnation(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	cr_assert_eq(__real_kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0);
	return s.incarnation;
}

/* Replica 2 (port 1) ready with the bus's two ranks; replica 1 (port 0) created for a router that
 * holds rank 3 too, and started with change c armed.  r[0] is replica 1's router. */
static void start_with(struct kvr_router **r, enum change c)
{
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	cr_assert_eq(kvr_rank_add(r[0], three, 7, 1000, 4096), 0);
	bus_create_as(0, r[0], 1);
	armed_on = pthread_self();
	fired = false;
	armed = c;
	cr_assert_eq(kvr_replica_start(bus.rep[0]), 0);
	armed = NONE;
	cr_assert(fired, "the start did not read rank 3's stats: the test missed its window");
	cr_assert_eq(kvr_replica_wait_ready(bus.rep[0], 10000), 0);
	bus_quiet(r, 2);
	bus_quiet(r, 2);
}

Test(replica_start, a_rank_removed_while_the_replica_starts_is_not_announced, .timeout = 60)
{
	struct kvr_router *r[2];
	start_with(r, REMOVE);
	cr_assert(!has_rank(r[0], 3));
	pthread_mutex_lock(&bus.rep[0]->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(bus.rep[0], three);
	bool listed = e != NULL;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert(!listed, "replica 1's table holds rank 3, which its router removed");
	cr_assert(!has_rank(r[1], 3), "the peer added rank 3, removed while replica 1 started");
	bus_teardown(r, 2);
}

Test(replica_start, a_rank_reset_while_the_replica_starts_keeps_its_new_incarnation, .timeout = 60)
{
	struct kvr_router *r[2];
	start_with(r, RESET);
	cr_assert_eq(incarnation(r[0], 3), 9);
	pthread_mutex_lock(&bus.rep[0]->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(bus.rep[0], three);
	uint64_t inc = e ? e->incarnation : 0;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert_eq(inc, 9, "replica 1's table holds rank 3 at incarnation %lu, its router at 9",
	             (unsigned long)inc);
	cr_assert(has_rank(r[1], 3));
	cr_assert_eq(incarnation(r[1], 3), 9, "the peer holds rank 3 at incarnation %lu, not 9",
	             (unsigned long)incarnation(r[1], 3));
	bus_teardown(r, 2);
}

/* A router holding more than 256 ranks when its replica starts: the start read the first 256
 * only (a fixed array), so the rest were never announced, and a peer never had them. */
Test(replica_start, every_rank_is_announced_past_256, .timeout = 60)
{
	struct kvr_router *r[2];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	for (uint64_t w = 2; w < 300; w++)
		cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){w, 0}, 7, 1000, 4096), 0);
	bus_attach(0, r[0]);
	bus_quiet(r, 2);
	uint64_t missing = 0, first = 0;
	for (uint64_t w = 300; w-- > 0;)
		if (!has_rank(r[1], w)) {
			missing++;
			first = w;
		}
	cr_assert_eq(missing, 0, "the peer lacks %lu of the 300 ranks (worker %lu first)",
	             (unsigned long)missing, (unsigned long)first);
	bus_teardown(r, 2);
}

/* ---------------------------------------------------------------- a failed start, retried
 *
 * kvr_replica_start sets the hooks first, then fails (no memory for the boot ranks, or a thread
 * that cannot be started) and unsets them.  A route that read kvr_repl_attached as true in that
 * window noted its admission into the replica's out queue; its caller's finish, made once the
 * hooks were gone, was noted nowhere.  The admission stayed queued until a later start
 * succeeded and published it (or, when the apply thread failed to start, the sender already
 * running published it), and no end ever followed: the peer mirrored the attempt for good.
 * (The reviewer's probe; it failed 5 of 8 runs.) */
static struct kvr_router *fs_r;
static int fs_stop;
static uint64_t fs_routes, fs_seen_attached;
/* kvr_thread_start calls made by the thread fs_on to fail: the fs_fail_nth one of each start
 * (1: the sender, 2: the apply thread); 0: none. */
static pthread_t fs_on;
static int fs_fail_nth, fs_calls;

/* Probes (review s28-rev-start): on the fs_window_nth call made by fs_on, fs_window runs first
 * (the start's window: hooks set, the sender started but not let go). */
static int fs_window_nth;
static void (*fs_window)(void);

int __wrap_kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg)
{
	bool mine = pthread_equal(pthread_self(), fs_on);
	int nth = mine ? ++fs_calls : 0;
	if (mine && fs_window_nth && nth == fs_window_nth && fs_window)
		fs_window();
	if (fs_fail_nth && mine && nth == fs_fail_nth)
		return KVR_ENOMEM;
	return __real_kvr_thread_start(t, detached, fn, arg);
}

static int route_tokens(struct kvr_router *r, uint32_t seed, size_t n, struct kvr_decision *d)
{
	static uint32_t t[64];
	cr_assert(n <= 64);
	for (size_t j = 0; j < n; j++)
		t[j] = seed * 1000003u + (uint32_t)j;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.expected_output_tokens = 64;
	return kvr_route(r, &q, d);
}

static void *fs_router_thread(void *arg)
{
	(void)arg;
	uint32_t seed = 5000000;
	while (!__atomic_load_n(&fs_stop, __ATOMIC_ACQUIRE)) {
		struct kvr_decision d;
		bool att = __atomic_load_n(&fs_r->repl, __ATOMIC_ACQUIRE) != NULL;
		if (route_tokens(fs_r, seed++, 64, &d) == 0 && d.status == KVR_DECIDED) {
			(void)kvr_request_finish(fs_r, d.attempt);
			fs_routes++;
			fs_seen_attached += att;
		}
	}
	return NULL;
}

enum fs_failure { FS_MEMORY, FS_SENDER, FS_APPLY };

/* The started replica works: an attempt routed on r[0] now is mirrored on r[1], and so is its
 * end. */
static void expect_mirrored_with_its_end(struct kvr_router **r)
{
	struct kvr_decision d;
	cr_assert_eq(route_tokens(r[0], 1, 64, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 1, "an attempt routed after the start is mirrored");
	cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 0, "and its end");
}

/* `starts` failed starts of replica 1 (r[0]) while a thread routes and finishes on its router,
 * then one that succeeds: the peer must mirror no attempt once all is quiet. */
static void failed_starts_then_one(enum fs_failure how, int starts)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	fs_stop = 0;
	fs_routes = fs_seen_attached = 0;
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	fs_r = r[0];
	bus_create_as(0, r[0], 1);
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, fs_router_thread, NULL), 0);
	if (how == FS_MEMORY) {
		kvr_alloc_fail_scope(KVR_ALLOC_ROLE_CALLER);
		kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	}
	fs_on = pthread_self();
	int failed = 0;
	for (int i = 0; i < starts; i++) {
		if (how == FS_MEMORY)
			kvr_alloc_fail_after(1);
		fs_calls = 0;
		fs_fail_nth = how == FS_SENDER ? 1 : how == FS_APPLY ? 2 : 0;
		int rc = kvr_replica_start(bus.rep[0]);
		fs_fail_nth = 0;
		if (how == FS_MEMORY)
			kvr_alloc_fail_after(0);
		cr_assert_eq(rc, KVR_ENOMEM, "start %d: rc %d", i, rc);
		failed++;
	}
	__atomic_store_n(&fs_stop, 1, __ATOMIC_RELEASE);
	pthread_join(th, NULL);
	if (how == FS_MEMORY) {
		kvr_alloc_thread_role(0);
		kvr_alloc_fail_scope(0);
	}
	bus_start_one(0);
	bus_quiet(r, 2);
	/* Heartbeats (50 ms) and whatever else would reconcile the peer have time to. */
	struct timespec ts = {1, 0};
	nanosleep(&ts, NULL);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[0]), 0, "every attempt finished on the origin");
	uint64_t m = bus_active_requests(r[1]);
	cr_assert_eq(
	    m, 0,
	    "%lu attempts mirrored on the peer for good, finished on the origin (%d failed "
	    "starts, %lu routes, %lu begun while hooks were set)",
	    (unsigned long)m, failed, (unsigned long)fs_routes, (unsigned long)fs_seen_attached);
	/* The retried start works: an attempt routed now is mirrored, and so is its end. */
	expect_mirrored_with_its_end(r);
	bus_teardown(r, 2);
}

Test(replica_start, a_failed_start_retried_publishes_no_admission_without_its_end, .timeout = 120)
{
	failed_starts_then_one(FS_MEMORY, 20000);
}

/* The sender could not be started: as above, the admissions waited in the queue. */
Test(replica_start, a_start_whose_sender_failed_publishes_no_admission_without_its_end,
     .timeout = 120)
{
	failed_starts_then_one(FS_SENDER, 5000);
}

/* The apply thread could not be started: the sender, started before it with the hooks set,
 * published the window's admissions at once; and it was stopped for good (a retried start's
 * sender exited at once). */
Test(replica_start, a_start_whose_apply_thread_failed_publishes_no_admission_without_its_end,
     .timeout = 120)
{
	failed_starts_then_one(FS_APPLY, 2000);
}

/* ---------------------------------------------------------------- the review's probes
 *
 * The start's window held open (fs_window sleeps in the wrapped kvr_thread_start) while a thread
 * routes: the sender, waiting for kvr_rep_out_go, handles nothing, so the ring fills and notes
 * are kept aside (note_keep), admissions past the 64 staging slabs allocate records. */
static uint64_t pr_kept_seen;
static struct kvr_replica *pr_rep;

static void pr_hold_window(void)
{
	struct timespec ts = {3, 0};
	nanosleep(&ts, NULL);
	pr_kept_seen += kvr_rep_keeping(pr_rep);
}

static void pr_assert_clean(struct kvr_replica *rep, const char *when)
{
	cr_assert_null(__atomic_load_n(&rep->kept, __ATOMIC_ACQUIRE), "%s: kept notes left", when);
	cr_assert_eq(__atomic_load_n(&rep->kept_bytes, __ATOMIC_ACQUIRE), 0, "%s: kept_bytes %lu",
	             when, (unsigned long)rep->kept_bytes);
	cr_assert_eq(__atomic_load_n(&rep->kept_over, __ATOMIC_ACQUIRE), 0, "%s: kept_over", when);
	cr_assert_eq(__atomic_load_n(&rep->kept_spare_free, __ATOMIC_ACQUIRE), ~0ull,
	             "%s: spare kept nodes lost: %016lx", when,
	             (unsigned long)rep->kept_spare_free);
	uint64_t slabs = __atomic_load_n(&rep->slab_free, __ATOMIC_ACQUIRE) |
	                 __atomic_load_n(&rep->slab_mine, __ATOMIC_ACQUIRE);
	cr_assert_eq(slabs, ~0ull, "%s: staging slabs lost: %016lx", when, (unsigned long)slabs);
	cr_assert(kvr_ring_unreserved(&rep->outq), "%s: ring not empty", when);
}

static void pr_full_window(enum fs_failure how, int starts)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	fs_stop = 0;
	fs_routes = fs_seen_attached = 0;
	pr_kept_seen = 0;
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	fs_r = r[0];
	bus_create_as(0, r[0], 1);
	pr_rep = bus.rep[0];
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, fs_router_thread, NULL), 0);
	fs_on = pthread_self();
	for (int i = 0; i < starts; i++) {
		fs_calls = 0;
		fs_fail_nth = how == FS_SENDER ? 1 : 2;
		fs_window_nth = fs_fail_nth;
		fs_window = pr_hold_window;
		int rc = kvr_replica_start(bus.rep[0]);
		fs_fail_nth = fs_window_nth = 0;
		cr_assert_eq(rc, KVR_ENOMEM, "start %d: rc %d", i, rc);
	}
	__atomic_store_n(&fs_stop, 1, __ATOMIC_RELEASE);
	pthread_join(th, NULL);
	cr_assert_gt(
	    pr_kept_seen, 0,
	    "the window never kept a note (probe did not reach note_keep): %lu routes, %lu "
	    "attached, dropped %lu",
	    (unsigned long)fs_routes, (unsigned long)fs_seen_attached,
	    (unsigned long)bus.rep[0]->out_dropped);
	pr_assert_clean(bus.rep[0], "after the failed starts");
	bus_start_one(0);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 0, "the peer mirrors nothing of the windows");
	expect_mirrored_with_its_end(r);
	bus_teardown(r, 2);
}

Test(replica_start, apply_failed_with_a_full_ring_leaves_the_queue_clean, .timeout = 120)
{
	pr_full_window(FS_APPLY, 2);
}

Test(replica_start, sender_failed_with_a_full_ring_leaves_the_queue_clean, .timeout = 120)
{
	pr_full_window(FS_SENDER, 2);
}

/* A second start (EBUSY) made in a successful start's window, and a drain waiting there: the
 * second drops none of the first's notes (an attempt routed in the window, unfinished, is
 * mirrored once the first start is through), and the drain returns. */
static struct kvr_router *pr_r;
static struct kvr_decision pr_d;
static int pr_second_rc = -1, pr_drain_rc = -1;
static uint64_t pr_drain_ms;

static void *pr_drain_thread(void *arg)
{
	(void)arg;
	uint64_t t0 = kvr_rep_mono_ns();
	pr_drain_rc = kvr_replica_drain(pr_rep, 5000);
	pr_drain_ms = (kvr_rep_mono_ns() - t0) / 1000000;
	return NULL;
}

static void *pr_second_thread(void *arg)
{
	(void)arg;
	cr_assert_eq(route_tokens(pr_r, 77, 64, &pr_d), 0);
	pr_second_rc = kvr_replica_start(pr_rep);
	return NULL;
}

static pthread_t pr_drainer;

static void pr_second_in_window(void)
{
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, pr_second_thread, NULL), 0);
	pthread_join(t, NULL);
	cr_assert_eq(pthread_create(&pr_drainer, NULL, pr_drain_thread, NULL), 0);
	struct timespec ts = {0, 200000000};
	nanosleep(&ts, NULL);
}

Test(replica_start, a_second_start_in_the_window_drops_none_of_the_firsts_notes, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	pr_r = r[0];
	bus_create_as(0, r[0], 1);
	pr_rep = bus.rep[0];
	fs_on = pthread_self();
	fs_calls = 0;
	fs_window_nth = 2; /* before the apply thread: the sender is started, not let go */
	fs_window = pr_second_in_window;
	cr_assert_eq(kvr_replica_start(bus.rep[0]), 0);
	fs_window_nth = 0;
	cr_assert_eq(pr_second_rc, KVR_EBUSY);
	cr_assert_eq(pr_d.status, KVR_DECIDED);
	pthread_join(pr_drainer, NULL);
	cr_assert_eq(pr_drain_rc, 0, "a drain made in the window: rc %d after %lu ms", pr_drain_rc,
	             (unsigned long)pr_drain_ms);
	cr_assert_eq(kvr_replica_wait_ready(bus.rep[0], 5000), 0);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 1, "the window's attempt is mirrored");
	cr_assert_eq(kvr_request_finish(r[0], pr_d.attempt), 0);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 0, "and its end");
	bus_teardown(r, 2);
}

/* A drain made while a start fails after the sender started (the apply thread could not be),
 * then the start retried at once and succeeding: the failed start drops the drain's ticket with
 * the window's notes, and answers it as handled; before (5540f82 alone), no later ticket came
 * and the drain waited out its whole timeout though the replica was ready and quiet. */
static void pr_drain_in_window(void)
{
	cr_assert_eq(pthread_create(&pr_drainer, NULL, pr_drain_thread, NULL), 0);
	struct timespec ts = {0, 200000000}; /* the drain's ticket is queued */
	nanosleep(&ts, NULL);
}

Test(replica_start, a_drain_across_a_failed_then_retried_start_returns, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	bus_create_as(0, r[0], 1);
	pr_rep = bus.rep[0];
	fs_on = pthread_self();
	fs_calls = 0;
	fs_fail_nth = fs_window_nth = 2;
	fs_window = pr_drain_in_window;
	cr_assert_eq(kvr_replica_start(bus.rep[0]), KVR_ENOMEM);
	fs_fail_nth = fs_window_nth = 0;
	bus_start_one(0);
	pthread_join(pr_drainer, NULL);
	cr_assert_eq(
	    pr_drain_rc, 0,
	    "a drain made in a failed start's window, the start retried: rc %d after %lu ms "
	    "(timeout 5000)",
	    pr_drain_rc, (unsigned long)pr_drain_ms);
	bus_teardown(r, 2);
}
