/*
 * tests/unit/test_thread_limit.c - the library in a process that cannot start another thread
 * (a container at its pids.max, RLIMIT_NPROC): every call that starts one returns an error, and
 * nothing aborts, hangs or leaks.
 *
 * The test interposes pthread_create (this program's definition comes first in the lookup) and
 * fails, in a forked child each time, either the nth thread the library tries to start
 * ("once") or the nth and every one after it ("from").  The child creates a router, routes and
 * finishes requests, creates an events-mode router with a KV event feed, and destroys both; a
 * create that fails must say KVR_ENOMEM with a detail naming the thread, and the same create
 * again (once) must succeed.  With every thread refused, the library's deferred frees must
 * still run (kvr_rcu_barrier runs them on the caller's thread).
 *
 * ZeroMQ's threads are not refused by count (libzmq aborts when it cannot start one, and the nth
 * start after the feed's check would be refused however many threads run).  A third injection
 * caps the live threads instead, ZeroMQ's counted, as a container's pids.max does: for every
 * cap an events router and a feed are created; each create works or fails cleanly.  Before,
 * the caps that left room for the router but not for ZeroMQ's reaper or I/O thread died of
 * SIGABRT in kvr_feed_create ("Resource temporarily unavailable (src/thread.cpp:269)"); now the
 * feed checks that two more threads can run before ZeroMQ starts (sync/feed.c, spare_threads).
 *
 * Before: the first thread the library starts in a process was liburcu's call_rcu thread, and
 * liburcu calls abort() when pthread_create fails (the child died of SIGABRT in
 * kvr_router_create); a shard thread refused gave KVR_EBUSY, a code kvr_router_create does not
 * document, with "busy setting up the router's tables and shards".
 *
 * Exit 0 pass, 1 fail.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/common/exit_check.h"
#include "kvrouter.h"
#include "sync/rcu.h"

/* The injection: 0 = off; else the nth pthread_create from arming fails, and with
 * fail_persist every later one too.  Counted with atomics: the library's threads start
 * threads too (none today, but the count must not race). */
static unsigned fail_nth, fail_persist, calls, refused;
/* The other injection, a capacity (a container's pids.max): with cap_on, a thread is refused
 * while `cap` threads started through pthread_create are alive, ZeroMQ's included. */
static unsigned cap_on, cap, live;

struct tramp {
	void *(*fn)(void *);
	void *arg;
};

static void *tramp_main(void *p)
{
	struct tramp t = *(struct tramp *)p;
	free(p);
	void *ret = t.fn(t.arg);
	__atomic_sub_fetch(&live, 1, __ATOMIC_RELAXED);
	return ret;
}

int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg)
{
	static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
	if (!real)
		*(void **)&real = dlsym(RTLD_NEXT, "pthread_create");
	if (__atomic_load_n(&cap_on, __ATOMIC_RELAXED)) {
		if (__atomic_add_fetch(&live, 1, __ATOMIC_RELAXED) > cap) {
			__atomic_sub_fetch(&live, 1, __ATOMIC_RELAXED);
			__atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
			return EAGAIN;
		}
		struct tramp *tr = malloc(sizeof(*tr));
		if (tr) {
			tr->fn = fn;
			tr->arg = arg;
		}
		int rc = tr ? real(t, a, tramp_main, tr) : EAGAIN;
		if (rc) {
			free(tr);
			__atomic_sub_fetch(&live, 1, __ATOMIC_RELAXED);
		}
		return rc;
	}
	unsigned nth = __atomic_load_n(&fail_nth, __ATOMIC_RELAXED);
	/* ZeroMQ's own threads (its I/O and reaper threads, started with a feed's sockets) are
	 * left alone: libzmq aborts when it cannot start one (kvrouter.h, kvr_feed_create). */
	Dl_info who;
	if (nth && dladdr((void *)fn, &who) && who.dli_fname && strstr(who.dli_fname, "libzmq"))
		nth = 0;
	if (nth) {
		unsigned c = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
		if (c == nth || (fail_persist && c > nth)) {
			__atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
			return EAGAIN;
		}
	}
	return real(t, a, fn, arg);
}

/* A create that failed must have failed for a thread, cleanly. */
static void check_refused(int rc, const char *what)
{
	CHECK(rc == KVR_ENOMEM, "%s returned %d (%s), not KVR_ENOMEM", what, rc, kvr_last_error());
	CHECK(strstr(kvr_last_error(), "thread") != NULL, "%s: the detail names no thread: %s",
	      what, kvr_last_error());
}

static struct kvr_router *router(enum kvr_mode mode, bool persist)
{
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.n_shards = 2;
	cfg.mode = mode;
	/* The approximate router has a queue, and so its admission thread (core/queue_thread.c):
	 * refused, the create fails cleanly too. */
	if (mode == KVR_MODE_APPROX_LRU)
		cfg.queue_threshold = 1.0;
	struct kvr_router *r = NULL;
	int rc = kvr_router_create(&cfg, &r);
	if (rc) {
		check_refused(rc, "kvr_router_create");
		CHECK(r == NULL, "a failed create set *out");
		if (persist)
			return NULL;
		rc = kvr_router_create(&cfg, &r); /* the limit is gone */
		CHECK(rc == 0, "kvr_router_create again: %d (%s)", rc, kvr_last_error());
	}
	for (uint32_t w = 0; w < 8; w++) {
		struct kvr_rank_id id = {.worker_id = w, .dp_rank = 0};
		rc = kvr_rank_add(r, id, 1, 4096, 8192);
		CHECK(rc == 0, "kvr_rank_add: %d (%s)", rc, kvr_last_error());
	}
	return r;
}

static int freed;
static void count_free(void *p)
{
	(void)p;
	__atomic_add_fetch(&freed, 1, __ATOMIC_RELAXED);
}

/* Creates a feed on ev and destroys it, or checks that the create failed for a thread.
 * Returns false when the feed is not built in. */
static bool feed_once(struct kvr_router *ev)
{
	struct kvr_feed *f = NULL;
	int rc = kvr_feed_create(ev, NULL, &f);
	if (rc == KVR_ENOTSUP)
		return false;
	if (rc)
		check_refused(rc, "kvr_feed_create");
	else
		kvr_feed_destroy(f);
	return true;
}

/* One child's run; returns 0, or 3 when nothing was refused (n past the last thread). */
static int scenario(unsigned nth, bool persist)
{
	__atomic_store_n(&fail_persist, persist, __ATOMIC_RELAXED);
	__atomic_store_n(&fail_nth, nth, __ATOMIC_RELAXED);
	struct kvr_router *r = router(KVR_MODE_APPROX_LRU, persist);
	if (r) {
		kvr_test_route_finish(r, 64, 1024);
		CHECK(kvr_router_sync(r, 10000) == 0, "kvr_router_sync: %s", kvr_last_error());
		kvr_router_destroy(r);
	}
	struct kvr_router *ev = router(KVR_MODE_EVENTS, persist);
	if (ev) {
		feed_once(ev);
		kvr_router_destroy(ev);
	}
	if (persist) {
		/* No thread at all from here: a deferred free still runs at the barrier. */
		CHECK(kvr_rcu_thread_online() == 0, "RCU registration");
		int before = __atomic_load_n(&freed, __ATOMIC_RELAXED);
		kvr_rcu_defer_free(&freed, count_free);
		kvr_rcu_barrier();
		CHECK(__atomic_load_n(&freed, __ATOMIC_RELAXED) == before + 1,
		      "a deferred free did not run at the barrier");
	}
	return __atomic_load_n(&refused, __ATOMIC_RELAXED) ? 0 : 3;
}

/* An events router and a feed under a cap of live threads (ZeroMQ's counted): every create
 * either works or fails cleanly.  Before, with a cap that left room for the router but not for
 * ZeroMQ's reaper or I/O thread, libzmq aborted in kvr_feed_create. */
static int cap_scenario(void *arg)
{
	__atomic_store_n(&cap, (unsigned)(uintptr_t)arg, __ATOMIC_RELAXED);
	__atomic_store_n(&cap_on, 1, __ATOMIC_RELAXED);
	struct kvr_router *ev = router(KVR_MODE_EVENTS, true);
	if (!ev)
		return 0; /* refused cleanly (router checks) */
	bool built = feed_once(ev);
	kvr_router_destroy(ev);
	return built && __atomic_load_n(&refused, __ATOMIC_RELAXED) ? 0 : 3;
}

struct run {
	unsigned nth;
	bool persist;
};

static int scenario_of(void *arg)
{
	const struct run *c = arg;
	return scenario(c->nth, c->persist);
}

/* Checks a child's wait status: it exited, with 0 or 3 (nothing refused); returns the code. */
static int child_code(int st, const char *what, unsigned n)
{
	CHECK(WIFEXITED(st), "%s %u: the child died of signal %d", what, n,
	      WIFSIGNALED(st) ? WTERMSIG(st) : -1);
	CHECK(WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 3, "%s %u: the child failed (%d)", what, n,
	      WEXITSTATUS(st));
	return WEXITSTATUS(st);
}

/*
 * Two barriers on the callers' threads (no reclaimer can start) and a fork between two slices
 * of the first one's batch: the first barrier's caller lets the fork in (sync/rcu.c, run_batch)
 * and the second caller, already waiting for the lock, gets it before the fork does.  Before,
 * the second caller took its own batch over the first one's rest (in_hand): the rest never ran
 * and the first caller waited for its barrier for good.
 */
enum { SPLIT_FREES = 2000 };
static int split_stage, split_freed;
static void split_wait(int stage)
{
	while (__atomic_load_n(&split_stage, __ATOMIC_ACQUIRE) < stage)
		usleep(1000);
}
static void split_set(int stage)
{
	__atomic_store_n(&split_stage, stage, __ATOMIC_RELEASE);
}
static void split_first(void *p)
{
	(void)p;
	split_set(1); /* the batch is under way, the lock held */
	split_wait(4);
	__atomic_add_fetch(&split_freed, 1, __ATOMIC_RELAXED);
}
static void split_count(void *p)
{
	(void)p;
	__atomic_add_fetch(&split_freed, 1, __ATOMIC_RELAXED);
}
static int split_b_done, split_a_done;
static void *split_a(void *arg)
{
	(void)arg;
	split_wait(0);
	kvr_rcu_defer_free(&split_freed, split_first);
	for (int i = 1; i < SPLIT_FREES; i++)
		kvr_rcu_defer_free(&split_freed, split_count);
	kvr_rcu_barrier(); /* runs the batch here */
	__atomic_store_n(&split_a_done, 1, __ATOMIC_RELEASE);
	return NULL;
}
static void *split_b(void *arg)
{
	(void)arg;
	split_wait(2);
	kvr_rcu_defer_free(&split_freed, split_count);
	kvr_rcu_barrier(); /* waits for the lock the first barrier's caller holds */
	__atomic_store_n(&split_b_done, 1, __ATOMIC_RELEASE);
	return NULL;
}
static void *split_fork(void *arg)
{
	(void)arg;
	split_wait(3);
	pid_t pid = fork(); /* waits for the lock too, after the second caller */
	if (pid == 0)
		_exit(0);
	int st = 0;
	if (pid > 0)
		waitpid(pid, &st, 0);
	return NULL;
}
static int split_scenario(void *arg)
{
	(void)arg;
	/* Threads first (this child's); then no thread may start, the reclaimer's included. */
	pthread_t t[3];
	void *(*fn[3])(void *) = {split_a, split_b, split_fork};
	for (int i = 0; i < 3; i++)
		CHECK(pthread_create(&t[i], NULL, fn[i], NULL) == 0, "pthread_create");
	__atomic_store_n(&calls, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&fail_persist, 1, __ATOMIC_RELAXED);
	__atomic_store_n(&fail_nth, 1, __ATOMIC_RELAXED);
	split_wait(1);
	split_set(2);
	usleep(100000); /* the second caller waits for the lock */
	split_set(3);
	usleep(100000); /* the fork waits for it, after the second caller */
	split_set(4);
	for (int i = 0; i < 1000 && !(__atomic_load_n(&split_a_done, __ATOMIC_ACQUIRE) &&
	                              __atomic_load_n(&split_b_done, __ATOMIC_ACQUIRE));
	     i++)
		usleep(10000);
	CHECK(__atomic_load_n(&split_a_done, __ATOMIC_ACQUIRE),
	      "the first barrier never returned (%d of %d frees ran)",
	      __atomic_load_n(&split_freed, __ATOMIC_RELAXED), SPLIT_FREES + 1);
	CHECK(__atomic_load_n(&split_b_done, __ATOMIC_ACQUIRE),
	      "the second barrier never returned");
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	CHECK(__atomic_load_n(&split_freed, __ATOMIC_RELAXED) == SPLIT_FREES + 1,
	      "%d of %d deferred frees ran", __atomic_load_n(&split_freed, __ATOMIC_RELAXED),
	      SPLIT_FREES + 1);
	return 0;
}

/* A router first (the fork handlers are registered with it), then, in a child of this process
 * (no reclaimer there), the split batch. */
static int split_outer(void *arg)
{
	(void)arg;
	struct kvr_router *r = router(KVR_MODE_APPROX_LRU, false);
	kvr_router_destroy(r);
	return child_code(kvr_test_run_child(split_scenario, NULL), "split", 0);
}

/* Runs scenario(nth, persist) in a child; returns its exit status (3: nothing refused). */
static int in_child(unsigned nth, bool persist)
{
	struct run c = {nth, persist};
	return child_code(kvr_test_run_child(scenario_of, &c), persist ? "from" : "once", nth);
}

int main(void)
{
	unsigned runs = 0;
	for (unsigned i = 0; i < 5; i++, runs++)
		child_code(kvr_test_run_child(split_outer, NULL), "split", i);
	for (int persist = 0; persist < 2; persist++) {
		unsigned nth = 1;
		for (; nth <= 64; nth++, runs++)
			if (in_child(nth, persist) == 3)
				break;
		CHECK(nth > 1 && nth <= 64, "%s: %u threads", persist ? "from" : "once", nth);
	}
	unsigned c = 0;
	for (; c <= 64; c++, runs++)
		if (child_code(kvr_test_run_child(cap_scenario, (void *)(uintptr_t)c), "cap", c) ==
		    3)
			break;
	CHECK(c > 1 && c <= 64, "cap: %u threads", c);
	printf("test_thread_limit: ok (%u children, each refused a thread)\n", runs);
	return 0;
}
