/*
 * tests/unit/test_signals.c - process-directed signals go to the embedder's threads, never to
 * the library's own (sync/thread.h).
 *
 * In a forked child: routers (approx_lru; events mode with a KV event feed where built) are
 * created first, with every thread's signals unblocked, as when a library initialises before the
 * program sets up its signals.  Then the program does what a server does:
 *  - it blocks SIGTERM and SIGUSR1 and takes them with sigtimedwait (the signalfd / sigwait
 *    pattern); each kill(2) of the process must reach it;
 *  - it blocks SIGUSR2 in the main thread and leaves a thread of its own to take it with a
 *    handler; the handler must run on that thread, every time.
 * Before: the library's threads did not block signals, so the kernel gave the blocked ones to a
 * shard thread (the default action of SIGTERM / SIGUSR1 ended the process: the child died of
 * the signal) and ran the SIGUSR2 handler there.
 *
 * Exit 0 pass, 1 fail.
 */
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/common/exit_check.h"
#include "kvrouter.h"

#define ROUNDS 50

static pid_t gettid_(void)
{
	return (pid_t)syscall(SYS_gettid);
}

static struct kvr_router *router(enum kvr_mode mode)
{
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.n_shards = 2;
	cfg.mode = mode;
	struct kvr_router *r = NULL;
	int rc = kvr_router_create(&cfg, &r);
	CHECK(rc == 0, "kvr_router_create: %d (%s)", rc, kvr_last_error());
	for (uint32_t w = 0; w < 8; w++) {
		struct kvr_rank_id id = {.worker_id = w, .dp_rank = 0};
		rc = kvr_rank_add(r, id, 1, 4096, 8192);
		CHECK(rc == 0, "kvr_rank_add: %d (%s)", rc, kvr_last_error());
	}
	return r;
}

/* Written by the handler (on the taker) and read by the main thread: lock-free atomics, which a
 * handler may use. */
static atomic_int handled_tid, handled_n;
static void on_usr2(int sig)
{
	(void)sig;
	handled_tid = gettid_();
	handled_n++;
}

static atomic_int taker_tid, taker_stop;
static void *taker(void *arg)
{
	(void)arg;
	taker_tid = gettid_();
	while (!taker_stop)
		usleep(1000);
	return NULL;
}

/* The threads of this process, but the calling one, that do not block SIGTERM or SIGUSR1 now
 * (/proc/self/task/TID/status, SigBlk), their count; -1 when /proc cannot be read. */
static int threads_taking_signals(void)
{
	DIR *d = opendir("/proc/self/task");
	if (!d)
		return -1;
	int n = 0;
	const unsigned long long want = (1ull << (SIGTERM - 1)) | (1ull << (SIGUSR1 - 1));
	for (struct dirent *e; (e = readdir(d));) {
		if (e->d_name[0] == '.' || atoi(e->d_name) == (int)gettid_())
			continue;
		char path[300], line[256];
		snprintf(path, sizeof(path), "/proc/self/task/%s/status", e->d_name);
		FILE *f = fopen(path, "r");
		if (!f)
			continue; /* gone meanwhile */
		unsigned long long blk = ~0ull;
		while (fgets(line, sizeof(line), f))
			if (sscanf(line, "SigBlk: %llx", &blk) == 1)
				break;
		fclose(f);
		if ((blk & want) != want) {
			fprintf(stderr, "thread %s does not block SIGTERM/SIGUSR1 (SigBlk %llx)\n",
			        e->d_name, blk);
			n++;
		}
	}
	closedir(d);
	return n;
}

static int child(void *arg)
{
	(void)arg;
	/* The library first, every signal unblocked. */
	struct kvr_router *r = router(KVR_MODE_APPROX_LRU);
	struct kvr_router *ev = router(KVR_MODE_EVENTS);
	struct kvr_feed *f = NULL;
	int rc = kvr_feed_create(ev, NULL, &f);
	CHECK(rc == 0 || rc == KVR_ENOTSUP, "kvr_feed_create: %d (%s)", rc, kvr_last_error());
	/* At once, not only once ZeroMQ's threads have run: they start with the signals blocked
	 * (they blocked them only once running, and a signal before that ended the process). */
	int open_threads = threads_taking_signals();
	CHECK(open_threads == 0, "%d threads would take a process-directed SIGTERM", open_threads);
	kvr_test_route_finish(r, 100, 512);

	/* The program's signal set-up, after. */
	sigset_t waited;
	sigemptyset(&waited);
	sigaddset(&waited, SIGTERM);
	sigaddset(&waited, SIGUSR1);
	CHECK(pthread_sigmask(SIG_BLOCK, &waited, NULL) == 0, "pthread_sigmask");
	struct timespec timeout = {.tv_sec = 2};
	for (int i = 0; i < ROUNDS; i++) {
		int sig = i % 2 ? SIGTERM : SIGUSR1;
		CHECK(kill(getpid(), sig) == 0, "kill");
		int got = sigtimedwait(&waited, NULL, &timeout);
		CHECK(got == sig, "round %d: sigtimedwait got %d, not %d", i, got, sig);
		kvr_test_route_finish(r, 5, 512); /* the shards busy meanwhile */
	}
	kvr_feed_destroy(f);
	kvr_router_destroy(ev);
	kvr_router_destroy(r);
	return 0;
}

/* The SIGUSR2 half runs in the taker's set-up: the taker unblocks it itself. */
static void *taker_unblocking(void *arg)
{
	sigset_t usr2;
	sigemptyset(&usr2);
	sigaddset(&usr2, SIGUSR2);
	pthread_sigmask(SIG_UNBLOCK, &usr2, NULL);
	return taker(arg);
}

static int child_handler(void *arg)
{
	(void)arg;
	struct kvr_router *r = router(KVR_MODE_APPROX_LRU);
	kvr_test_route_finish(r, 100, 512);
	sigset_t usr2;
	sigemptyset(&usr2);
	sigaddset(&usr2, SIGUSR2);
	CHECK(pthread_sigmask(SIG_BLOCK, &usr2, NULL) == 0, "pthread_sigmask");
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_usr2;
	CHECK(sigaction(SIGUSR2, &sa, NULL) == 0, "sigaction");
	pthread_t th;
	CHECK(pthread_create(&th, NULL, taker_unblocking, NULL) == 0, "pthread_create");
	while (!taker_tid)
		usleep(100);
	for (int i = 0; i < ROUNDS; i++) {
		int before = handled_n;
		CHECK(kill(getpid(), SIGUSR2) == 0, "kill");
		for (int w = 0; handled_n == before && w < 2000; w++)
			usleep(1000);
		CHECK(handled_n != before, "round %d: the handler did not run", i);
		CHECK(handled_tid == taker_tid, "round %d: the handler ran on thread %d, not %d", i,
		      (int)handled_tid, (int)taker_tid);
		kvr_test_route_finish(r, 5, 512);
	}
	taker_stop = 1;
	pthread_join(th, NULL);
	kvr_router_destroy(r);
	return 0;
}

static void run(int (*fn)(void *), const char *what)
{
	int st = kvr_test_run_child(fn, NULL);
	CHECK(WIFEXITED(st), "%s: the child died of signal %d (%s)", what,
	      WIFSIGNALED(st) ? WTERMSIG(st) : -1, WIFSIGNALED(st) ? strsignal(WTERMSIG(st)) : "");
	CHECK(WEXITSTATUS(st) == 0, "%s: the child failed", what);
}

/* Under ThreadSanitizer the handler half failed 2 of 8 runs ("round 0: the handler did not run"
 * within 2 s): its runtime takes every signal in a handler of its own and defers the program's
 * handler, and a thread of its own (not blocking signals) is the likely taker.  Left out there;
 * the sigtimedwait half runs in every build. */
#if defined(__SANITIZE_THREAD__)
#define HANDLER_HALF 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define HANDLER_HALF 0
#endif
#endif
#ifndef HANDLER_HALF
#define HANDLER_HALF 1
#endif

int main(void)
{
	run(child, "sigtimedwait");
	if (HANDLER_HALF)
		run(child_handler, "handler");
	printf("test_signals: ok (%d signals%s)\n", ROUNDS,
	       HANDLER_HALF ? " each way" : ", sigtimedwait only under TSan");
	return 0;
}
