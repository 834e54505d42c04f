/*
 * tests/unit/test_signal_storm.c - the API on a thread that signals interrupt all the time.
 *
 * Frontends take signals on their own threads: a sampling profiler's SIGPROF (gperftools,
 * ITIMER_PROF at 100 Hz and more), a SIGALRM timer, a handler installed without SA_RESTART.
 * Each blocking system call they interrupt returns EINTR.  Here two interval timers fire every
 * 50 us on the calling thread while it routes (queueing, with KVR_ROUTE_WAIT), finishes,
 * removes and adds ranks, syncs, renders metrics and reads memory, and in events mode creates
 * a KV event feed, adds, reads and removes endpoints, and destroys it.  Every call must answer
 * as without signals.  Before, the feed's calls took ZeroMQ's EINTR for an answer: a stop never
 * sent left kvr_feed_destroy joining a thread that never stopped (the watchdog's 100 s), and an
 * answer never read let the feed's thread write into the caller's returned stack frame.
 * A plain program: exit 0 pass, 1 fail.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"

static _Atomic int hits; /* lock-free: async-signal-safe */
static void on_signal(int sig)
{
	(void)sig;
	atomic_fetch_add_explicit(&hits, 1, memory_order_relaxed);
}

static void *watchdog(void *arg)
{
	(void)arg;
	sleep(100);
	static const char m[] = "FAIL: a call waited for good under signals (100 s)\n";
	(void)!write(2, m, sizeof(m) - 1);
	_exit(1);
}

static uint64_t mono_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int bad;
#define EXPECT(call, ok)                                                                           \
	do {                                                                                       \
		int rc_ = (call);                                                                  \
		if (!(ok)) {                                                                       \
			fprintf(stderr, "FAIL %s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,    \
			        kvr_strerror(rc_), kvr_last_error());                              \
			bad++;                                                                     \
		}                                                                                  \
	} while (0)

#ifdef KVR_HAVE_ZMQ
static void feed_round(struct kvr_router *r)
{
	struct kvr_feed *f = NULL;
	EXPECT(kvr_feed_create(r, NULL, &f), rc_ == 0);
	if (!f)
		return;
	for (int i = 0; i < 10; i++) {
		struct kvr_feed_endpoint ep = {.endpoint = "tcp://127.0.0.1:5999", .worker_id = 1};
		uint32_t id = 0;
		struct kvr_feed_stats st;
		EXPECT(kvr_feed_add(f, &ep, &id), rc_ == 0);
		EXPECT(kvr_feed_get_stats(f, id, &st), rc_ == 0);
		EXPECT(kvr_feed_remove(f, id), rc_ == 0);
	}
	kvr_feed_destroy(f);
}
#endif

static void round_of(int round)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.mode = round % 2 ? KVR_MODE_EVENTS : KVR_MODE_APPROX_LRU;
	struct kvr_router *r;
	EXPECT(kvr_router_create(&c, &r), rc_ == 0);
	for (uint64_t w = 0; w < 8; w++)
		EXPECT(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 100000, 2048), rc_ == 0);
#ifdef KVR_HAVE_ZMQ
	if (c.mode == KVR_MODE_EVENTS)
		feed_round(r);
#endif
	static uint32_t tok[2048];
	uint64_t live[16];
	int n_live = 0;
	for (int k = 0; k < 150; k++) {
		for (int i = 0; i < 2048; i++)
			tok[i] = (uint32_t)(i * 3 + k % 11);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 2048;
		q.flags = KVR_ROUTE_WAIT;
		q.deadline_ns = mono_ns() + 1000000;
		struct kvr_decision d;
		int rc = kvr_route(r, &q, &d);
		if (rc == 0 && d.status == KVR_DECIDED)
			live[n_live++] = d.attempt;
		else if (rc == KVR_ETIMEDOUT)
			EXPECT(kvr_route_cancel(r, d.ticket), rc_ == 0 || rc_ == KVR_ENOENT);
		else
			EXPECT(rc, 0);
		if (n_live == 16 || k % 3 == 0) {
			for (int j = 0; j < n_live; j++) /* a removed rank's: stale */
				EXPECT(kvr_request_finish(r, live[j]),
				       rc_ == 0 || rc_ == KVR_ESTALE);
			n_live = 0;
		}
		if (k % 50 == 0) {
			size_t len;
			struct kvr_memory m;
			EXPECT(kvr_router_sync(r, 10000), rc_ == 0);
			EXPECT(kvr_metrics_render(r, NULL, 0, &len), rc_ == KVR_ERANGE);
			EXPECT(kvr_router_get_memory(r, &m), rc_ == 0);
			EXPECT(kvr_rank_remove(r, (struct kvr_rank_id){7, 0}), rc_ == 0);
			EXPECT(kvr_rank_add(r, (struct kvr_rank_id){7, 0}, 1, 100000, 2048),
			       rc_ == 0);
		}
	}
	for (int j = 0; j < n_live; j++)
		EXPECT(kvr_request_finish(r, live[j]), rc_ == 0 || rc_ == KVR_ESTALE);
	kvr_router_destroy(r);
}

int main(void)
{
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old); /* the watchdog takes none */
	pthread_t w;
	pthread_create(&w, NULL, watchdog, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal; /* no SA_RESTART: interrupted calls return EINTR */
	sigaction(SIGPROF, &sa, NULL);
	sigaction(SIGALRM, &sa, NULL);
	struct itimerval it = {{0, 50}, {0, 50}};
	setitimer(ITIMER_PROF, &it, NULL);
	setitimer(ITIMER_REAL, &it, NULL);
	for (int round = 0; round < 8; round++)
		round_of(round);
	struct itimerval off = {{0, 0}, {0, 0}};
	setitimer(ITIMER_PROF, &off, NULL);
	setitimer(ITIMER_REAL, &off, NULL);
	printf("test_signal_storm: %d signals taken, %d unexpected results\n", atomic_load(&hits),
	       bad);
	return bad != 0;
}
