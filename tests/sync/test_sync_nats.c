/*
 * Replica sync over a real nats-server (issue 14).  A plain program (exit 0 pass, 1 fail, 77 skip
 * when nats-server is not installed): it starts nats-server on a free 127.0.0.1 port and stops it.
 *
 *  1. three replicas in this process route an interleaved share of one request stream; at every
 *     quiet point each rank's load is the same on every replica and the predicted caches agree
 *     (Jaccard >= 0.99); once drained every load is zero.  The same under eviction pressure:
 *     loads agree, the predictions' Jaccard is printed (it depends on apply order).
 *  1b. false death (kvr_replica_stall: a replica's threads stop past the liveness bound while
 *     everyone routes): those who listened give it up and, once it is heard again, have it
 *     re-announce; a stalled replica gives up nobody (its own deafness is not its peers'
 *     silence), nor does a process starved at a quiet point; loads equal, Jaccard >= 0.99.
 *  2. three replica processes route; one is killed with SIGKILL while it sends: the other two
 *     release its attempts within the liveness bound and agree on every rank's load; a replica
 *     attached afterwards agrees with the others after its snapshot.
 *  2c. two replicas route while allocations fail now and then: once the failures stop they
 *     settle, every mirror released, every load zero.
 *  2d. a delivery lost for memory while the receiver queues (its apply thread stalled): counted,
 *     and healed by the sender's re-announce; the replicas agree again.
 *  2b. a replica's lease reaper expires its idle attempts: its peers release their mirrors at
 *     once (told, as for an abort), and a replica attached afterwards does not mirror them.
 *  3. nats-server is stopped and restarted mid-stream: no crash, the counters show the outage
 *     (disconnects, reconnects, unpublished), and loads and predictions agree again; the new
 *     connections' sockets have FD_CLOEXEC as the first ones (test 11).
 *  4. stage tracing (sync/replica_trace.h, what bench_sync --stages reads): with replica A
 *     traced, each of A's admissions carries all six stamps, in pipeline order; untraced ones
 *     carry none.
 *  5. bad input on the wire (through the server): the old wire version, a batch with a truncated
 *     message, a batch in our own name are counted and dropped whole; a good batch is applied.
 *  6. on_admit on the thread that applies a peer's finish (nats.c's subscription thread, handling
 *     inline, or the apply thread): kvr_sync_drain there returns KVR_EBUSY at once,
 *     kvr_sync_wait_ready 0, and kvr_sync_detach and kvr_router_destroy do nothing there.
 *  7. an attach at the process's file-descriptor limit (forked children leaving 0-3 descriptors
 *     free): it works, or fails with KVR_ENOMEM naming the limit; before, nats.c's "No server
 *     available for connection" came back as KVR_ETIMEDOUT, as if the server were down.
 *  8. attach, route, drain and detach on a thread two 50 us interval timers interrupt (a
 *     profiler's SIGPROF, a SIGALRM): every call answers as without them.  Before, nats.c took
 *     the EINTR in its connect for a broken connection: 18 of 20 attaches failed ("IO Error",
 *     "Protocol Error"); and the threads nats.c started then took process-directed signals.
 *  9. the router destroyed before its replica's handle (kvrouter.h allows it): the calls on the
 *     handle return KVR_ESHUTDOWN and kvr_sync_detach disconnects and frees; a peer sees the
 *     goodbye.  Before, every call on the handle, the detach included, read the NULL router.
 * 10. the snapshot wait at attach: a replica alone in its cluster is ready at once (nats.c says
 *     "no responders" as a status, which was taken for a failed try and retried for the whole
 *     snapshot_timeout_ms: 1.93 s at the default, 14 retries), and a detach or router destroy
 *     while a peer that never answers is asked returns without waiting the wait out (it sat
 *     out the whole snapshot_timeout_ms).  snapshot_timeout_ms is 20 s here; each call must
 *     return within 8.
 * 11. a program the host spawns while a replica is attached (system, posix_spawn) does not keep
 *     the replica's server connection: a replica process spawns `sleep 30` and dies of SIGKILL;
 *     a replica attached afterwards in its cluster is ready at once (no one answers for the dead
 *     one).  Before, nats.c's sockets had no FD_CLOEXEC: the sleep held the dead replica's
 *     connection, its snapshot subscription with it, the server kept routing snapshot requests
 *     there and the new replica waited the whole snapshot_timeout_ms (20 s here; the check
 *     allows 8).  Also: an attach leaves no socket without FD_CLOEXEC in this process.
 * 12. a replica id already in use in the cluster: kvr_sync_attach returns KVR_EEXIST naming it
 *     (the holder answers on C.id.<id>), *out NULL, nothing left behind; a connection holding
 *     the id's subject that does not answer counts as a holder; the same id in another cluster,
 *     or once the holder detached, attaches.  Before, both attached and each dropped the
 *     other's messages as forged, and a third replica took the two streams for one peer's
 *     (its mirrored attempts and loads wrong, a detach of one releasing the other's).
 * 13. a server that refuses the credentials (a nats-server with users): kvr_sync_attach without
 *     them or with a wrong password returns KVR_EINVAL naming the credentials, with them 0; a
 *     user the server does not permit to subscribe to the stream, to publish on the id
 *     subject, to subscribe to reply inboxes or to publish on them (its answers to peers'
 *     snapshot requests): KVR_EINVAL saying so (before, the first two attached deaf or came
 *     back KVR_EEXIST, the third attached without snapshots, the fourth attached and every
 *     peer that asked it for a snapshot waited its whole budget, then went on without); a user that
 *     may not publish on the stream attaches, and its refused publishes are counted (denied).
 *     Also tls asked of a server without TLS: KVR_EINVAL naming TLS.  Before, KVR_ETIMEDOUT
 *     ("no server reachable") for all of them, which reads as worth retrying.  auth_cluster:
 *     a user under allow_responses attaches every time on a cluster of two servers (its
 *     answer probe's connection may be on the other one).
 * 14. a server with max_payload 64 KiB: eight admissions of 2,500 blocks (20 KB each) routed at
 *     once, and 40,000 output tokens in one call, reach the peer (batches and output cut to fit;
 *     per-rank active blocks equal); an admission of 8,192 blocks (over 64 KiB alone) goes
 *     with the 8,179 blocks that fit as an unknown chain (counted truncated): the peer mirrors
 *     it, its load and that prefix; a replica attached afterwards gets a snapshot (chunks cut to
 *     fit; the attempt with 160 KB of output, too big for one chunk, goes cut too) and mirrors
 *     all ten.  Before, every batch over the limit failed, was re-announced and failed again,
 *     for ever: the peer mirrored nothing and the joiner was never ready; and later the big
 *     admission was not sent at all (counted oversized: no load, no prefix on the peers).
 * 15. kvr_sync_detach while the server is down: no flush wait (it waited 500 ms for a flush that
 *     could not happen; the check allows 450).
 * usage: test_sync_nats [seed [pace_us [test]]]  (test: three, pressure, false_death, kill, ...)
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include <nats/nats.h>

#include "sync/replica.h"
#include "sync/replica_msg.h"
#include "sync/replica_trace.h"
#include "tests/common/mono_clock.h"
#include "tests/common/nats_server.h"
#include "tests/common/replica_wire.h"
#include "tests/common/router_prompts.h"
#include "tests/common/xorshift.h"

#define N_RANKS 8
#define HB_MS   100
#define DEAD    10

static int fails;
#define CHECK(c, ...)                                                                              \
	do {                                                                                       \
		if (!(c)) {                                                                        \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                       \
			fprintf(stderr, __VA_ARGS__);                                              \
			fprintf(stderr, "\n");                                                     \
			fails++;                                                                   \
		}                                                                                  \
	} while (0)

static void sleep_ms(unsigned ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static int attach_id(struct kvr_router *r, const char *cluster, uint64_t id, struct kvr_sync **s)
{
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = kvr_test_nats_url();
	c.cluster = cluster;
	c.replica_id = id;
	return kvr_sync_attach(r, &c, s);
}

/* Sockets of this process without FD_CLOEXEC. */
static int sockets_inherited(void)
{
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return -1;
	int n = 0;
	for (struct dirent *e; (e = readdir(d));) {
		int fd = atoi(e->d_name);
		struct stat sb;
		if (e->d_name[0] != '.' && fd != dirfd(d) && fstat(fd, &sb) == 0 &&
		    S_ISSOCK(sb.st_mode) && !(fcntl(fd, F_GETFD) & FD_CLOEXEC))
			n++;
	}
	closedir(d);
	return n;
}

/* ---------------------------------------------------------------- replicas */

struct replica {
	uint64_t id;
	struct kvr_router *r;
	struct kvr_sync *s;
	uint64_t live[256];
	size_t n_live;
};

/* Blocks per rank.  Big by default: the predictions then depend only on WHAT each replica
 * applied, which must be the same everywhere (Jaccard 1).  With eviction pressure they also
 * depend on the ORDER in which each replica applied concurrent requests (its own at once, the
 * others' a delivery later), so they may differ; test_pressure measures by how much. */
static uint64_t cap = 100000;
static uint64_t lease_ns; /* 0: the default lease scan interval (120 s) */

static struct kvr_router *make_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.shard_idle_spin_ns = 1000;
	if (lease_ns)
		c.lease_scan_interval_ns = lease_ns;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r))
		return NULL;
	for (uint64_t w = 0; w < N_RANKS; w++)
		kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, cap, 8192);
	return r;
}

/* The liveness bound attach gives, in heartbeats (DEAD; test_false_death's is longer). */
static unsigned dead_after = DEAD;

static int attach(struct replica *x, uint64_t id)
{
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = kvr_test_nats_url();
	c.cluster = "t";
	c.replica_id = id;
	c.heartbeat_ms = HB_MS;
	c.dead_after = dead_after;
	x->id = id;
	int rc = kvr_sync_attach(x->r, &c, &x->s);
	if (rc == 0)
		rc = kvr_sync_wait_ready(x->s, 5000);
	return rc;
}

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void)
{
	return xorshift64(&rng);
}

/* One step on replica x: finish an old request, or route a new one from a family of shared
 * prefixes, or send output. */
static void step(struct replica *x)
{
	uint32_t t[1200];
	int what = (int)(next() % 10);
	if (x->n_live >= 24 || (x->n_live && what < 3)) {
		size_t k = next() % x->n_live;
		uint64_t a = x->live[k];
		x->live[k] = x->live[--x->n_live];
		if (what == 0)
			kvr_request_abort(x->r, a);
		else
			kvr_request_finish(x->r, a);
		return;
	}
	if (x->n_live && what < 5) {
		uint32_t out[40];
		for (int i = 0; i < 40; i++)
			out[i] = (uint32_t)next();
		kvr_request_output(x->r, x->live[next() % x->n_live], out, 1 + next() % 40);
		return;
	}
	size_t n = 100 + next() % 1000;
	uint32_t fam = (uint32_t)(next() % 40);
	for (size_t i = 0; i < n; i++)
		t[i] = i < 600 ? fam * 1000003u + (uint32_t)i : (uint32_t)next();
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.expected_output_tokens = 100;
	struct kvr_decision d;
	if (kvr_route(x->r, &q, &d) == 0 && d.status == KVR_DECIDED)
		x->live[x->n_live++] = d.attempt;
}

static int cmpu(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static double jaccard(struct kvr_router *a, struct kvr_router *b, uint64_t w)
{
	static uint64_t x[1 << 16], y[1 << 16];
	size_t nx = 0, ny = 0;
	struct kvr_rank_id id = {w, 0};
	if (kvr_rank_blocks(a, id, x, 1 << 16, &nx) || kvr_rank_blocks(b, id, y, 1 << 16, &ny))
		return -1;
	qsort(x, nx, 8, cmpu);
	qsort(y, ny, 8, cmpu);
	size_t i = 0, j = 0, both = 0;
	while (i < nx && j < ny) {
		if (x[i] == y[j]) {
			both++;
			i++;
			j++;
		} else if (x[i] < y[j]) {
			i++;
		} else {
			j++;
		}
	}
	size_t uni = nx + ny - both;
	return uni ? (double)both / (double)uni : 1.0;
}

/* Waits until every replica has applied everything its peers sent: every queue drained, every
 * replica mirrors exactly the live attempts of the others (extra_live: those of replicas in
 * other processes), and no replica applied anything more over two heartbeat periods. */
static int quiet_x(struct replica *xs, size_t n, size_t extra_live)
{
	uint64_t t0 = now_ms(), last_sum = UINT64_MAX;
	size_t total = extra_live;
	for (size_t i = 0; i < n; i++)
		total += xs[i].n_live;
	for (;;) {
		sleep_ms(2 * HB_MS);
		bool done = true;
		uint64_t sum = 0;
		for (size_t i = 0; i < n; i++) {
			struct kvr_sync_stats s;
			done &= kvr_sync_drain(xs[i].s, 2000) == 0;
			kvr_sync_get_stats(xs[i].s, &s);
			done &= s.ready && s.connected && s.mirrored == total - xs[i].n_live;
			sum += s.applied;
			/* exact: replica i applied every other replica's stream up to its end */
			for (size_t j = 0; j < n; j++) {
				struct kvr_sync_stats sj;
				uint64_t at = 0;
				if (j == i)
					continue;
				kvr_sync_get_stats(xs[j].s, &sj);
				done &=
				    kvr_sync_peer_seq(xs[i].s, xs[j].id, &at) == 0 && at == sj.seq;
			}
		}
		if (done && sum == last_sum)
			break;
		last_sum = sum;
		if (now_ms() - t0 > 30000) {
			for (size_t i = 0; i < n; i++) {
				struct kvr_sync_stats s;
				kvr_sync_get_stats(xs[i].s, &s);
				fprintf(stderr,
				        "  not quiet: replica %zu live %zu mirrored %u (want %zu) "
				        "applied %lu "
				        "recv %lu gaps %lu resyncs %lu snaps %lu/%lu lost %lu "
				        "released %lu "
				        "refused %lu orphans %lu dup %lu\n",
				        i, xs[i].n_live, s.mirrored, total - xs[i].n_live,
				        (unsigned long)s.applied, (unsigned long)s.received,
				        (unsigned long)s.gaps, (unsigned long)s.resyncs,
				        (unsigned long)s.snapshots_applied,
				        (unsigned long)s.snapshots_served,
				        (unsigned long)s.peers_lost, (unsigned long)s.released,
				        (unsigned long)s.refused, (unsigned long)s.orphans,
				        (unsigned long)s.duplicates);
			}
			return -1;
		}
	}
	for (size_t i = 0; i < n; i++)
		kvr_router_sync(xs[i].r, 5000);
	return 0;
}

static int quiet(struct replica *xs, size_t n)
{
	return quiet_x(xs, n, 0);
}

/* Every pair agrees: load per rank equal, Jaccard >= 0.99.  Returns the worst Jaccard. */
static double agree_min(struct replica *xs, size_t n, const char *when, double min)
{
	double worst = 1.0;
	for (uint64_t w = 0; w < N_RANKS; w++) {
		struct kvr_rank_stats s0;
		kvr_rank_get_stats(xs[0].r, (struct kvr_rank_id){w, 0}, &s0);
		for (size_t i = 1; i < n; i++) {
			struct kvr_rank_stats si;
			kvr_rank_get_stats(xs[i].r, (struct kvr_rank_id){w, 0}, &si);
			CHECK(si.active_requests == s0.active_requests &&
			          si.active_prefill_tokens == s0.active_prefill_tokens &&
			          si.active_blocks == s0.active_blocks,
			      "%s: rank %lu load differs on replica %zu: requests %lu/%lu prefill "
			      "%lu/%lu blocks %lu/%lu",
			      when, (unsigned long)w, i, (unsigned long)s0.active_requests,
			      (unsigned long)si.active_requests,
			      (unsigned long)s0.active_prefill_tokens,
			      (unsigned long)si.active_prefill_tokens,
			      (unsigned long)s0.active_blocks, (unsigned long)si.active_blocks);
			double j = jaccard(xs[0].r, xs[i].r, w);
			if (j < min) {
				size_t na = 0, nb = 0;
				kvr_rank_blocks(xs[0].r, (struct kvr_rank_id){w, 0}, NULL, 0, &na);
				kvr_rank_blocks(xs[i].r, (struct kvr_rank_id){w, 0}, NULL, 0, &nb);
				fprintf(stderr,
				        "  rank %lu: replica 0 holds %zu blocks, replica %zu %zu\n",
				        (unsigned long)w, na, i, nb);
			}
			if (j < worst)
				worst = j;
		}
	}
	CHECK(worst >= min, "%s: predicted-cache Jaccard %.4f < %.2f", when, worst, min);
	if (worst < min || fails)
		for (size_t i = 0; i < n; i++) {
			struct kvr_sync_stats s;
			kvr_sync_get_stats(xs[i].s, &s);
			fprintf(
			    stderr,
			    "  replica %zu: pub %lu unpub %lu recv %lu applied %lu dropped %lu dup "
			    "%lu "
			    "refused %lu orphans %lu gaps %lu resyncs %lu snaps %lu/%lu lost %lu "
			    "released %lu mirrored %u lag %lu\n",
			    i, (unsigned long)s.published, (unsigned long)s.unpublished,
			    (unsigned long)s.received, (unsigned long)s.applied,
			    (unsigned long)s.dropped, (unsigned long)s.duplicates,
			    (unsigned long)s.refused, (unsigned long)s.orphans,
			    (unsigned long)s.gaps, (unsigned long)s.resyncs,
			    (unsigned long)s.snapshots_applied, (unsigned long)s.snapshots_served,
			    (unsigned long)s.peers_lost, (unsigned long)s.released, s.mirrored,
			    (unsigned long)s.lag_messages);
		}
	return worst;
}

static double agree(struct replica *xs, size_t n, const char *when)
{
	return agree_min(xs, n, when, 0.99);
}

/* Requests arrive every PACE_US: replicas apply each other's messages within about a
 * millisecond, so two arrivals closer than that may be applied in different orders on different
 * replicas, which under eviction pressure makes their LRU predictions differ (measured by the
 * Jaccard lines: 1.0 without eviction). */
static unsigned pace_us = 2000;

static void stream(struct replica *xs, size_t n, int steps)
{
	for (int i = 0; i < steps; i++) {
		step(&xs[i % n]);
		if (pace_us) {
			struct timespec ts = {0, (long)pace_us * 1000L};
			nanosleep(&ts, NULL);
		}
	}
}

static void drain_all(struct replica *xs, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		while (xs[i].n_live)
			kvr_request_finish(xs[i].r, xs[i].live[--xs[i].n_live]);
	}
}

/* ---------------------------------------------------------------- 1 */

static void test_three(void)
{
	struct replica xs[3] = {0};
	for (int i = 0; i < 3; i++) {
		xs[i].r = make_router();
		CHECK(attach(&xs[i], (uint64_t)i + 1) == 0, "attach %d", i);
	}
	for (int round = 0; round < 4; round++) {
		stream(xs, 3, 600);
		CHECK(quiet(xs, 3) == 0, "quiet point %d not reached", round);
		double j = agree(xs, 3, "three replicas");
		printf("test_three: quiet point %d: worst Jaccard %.4f\n", round, j);
	}
	drain_all(xs, 3);
	CHECK(quiet(xs, 3) == 0, "final quiet point");
	agree(xs, 3, "drained");
	for (int i = 0; i < 3; i++)
		for (uint64_t w = 0; w < N_RANKS; w++) {
			struct kvr_rank_stats s;
			kvr_rank_get_stats(xs[i].r, (struct kvr_rank_id){w, 0}, &s);
			CHECK(s.active_requests == 0 && s.active_prefill_tokens == 0 &&
			          s.active_blocks == 0,
			      "drained: replica %d rank %lu still loaded", i, (unsigned long)w);
		}
	struct kvr_sync_stats st;
	kvr_sync_get_stats(xs[0].s, &st);
	printf("test_three: replica 1 published %lu applied %lu dropped %lu gaps %lu resyncs %lu "
	       "peers lost %lu\n",
	       (unsigned long)st.published, (unsigned long)st.applied, (unsigned long)st.dropped,
	       (unsigned long)st.gaps, (unsigned long)st.resyncs, (unsigned long)st.peers_lost);
	CHECK(st.gaps == 0 && st.dropped == 0, "no gap and nothing dropped on a healthy cluster");
	char buf[1 << 16];
	size_t len;
	CHECK(kvr_metrics_render(xs[0].r, buf, sizeof(buf), &len) == 0 &&
	          strstr(buf, "kvr_sync_messages_total{what=\"published\"}"),
	      "metrics show sync counters");
	for (int i = 0; i < 3; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
}

/* Under eviction pressure (400 blocks per rank, about a tenth of the working set): loads must
 * still agree exactly; the predictions' agreement is measured and printed. */
static void test_pressure(void)
{
	uint64_t saved = cap;
	cap = 400;
	struct replica xs[3] = {0};
	for (int i = 0; i < 3; i++) {
		xs[i].r = make_router();
		CHECK(attach(&xs[i], (uint64_t)i + 31) == 0, "attach %d", i);
	}
	double worst = 1.0;
	for (int round = 0; round < 3; round++) {
		stream(xs, 3, 600);
		CHECK(quiet(xs, 3) == 0, "quiet point %d not reached", round);
		double j = agree_min(xs, 3, "eviction pressure", 0.0);
		if (j < worst)
			worst = j;
	}
	printf("test_pressure: capacity 400 blocks/rank, pace %u us: worst Jaccard %.4f\n", pace_us,
	       worst);
	drain_all(xs, 3);
	for (int i = 0; i < 3; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
	cap = saved;
}

/* Active requests over all ranks of r. */
static uint64_t active_requests(struct kvr_router *r)
{
	uint64_t n = 0;
	for (uint64_t w = 0; w < N_RANKS; w++) {
		struct kvr_rank_stats s;
		kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s);
		n += s.active_requests;
	}
	return n;
}

/* ---------------------------------------------------------------- 1b. false death */

/* Routes on every replica for ms milliseconds (a step per replica every pace_us). */
static void stream_for(struct replica *xs, size_t n, unsigned ms)
{
	uint64_t t0 = now_ms();
	for (int i = 0; now_ms() - t0 < ms; i++) {
		step(&xs[(size_t)i % n]);
		struct timespec ts = {0, (long)(pace_us ? pace_us : 1000) * 1000L};
		nanosleep(&ts, NULL);
	}
}

/* Peers given up, per replica. */
static void lost_of(struct replica *xs, size_t n, uint64_t *lost)
{
	for (size_t i = 0; i < n; i++) {
		struct kvr_sync_stats s;
		kvr_sync_get_stats(xs[i].s, &s);
		lost[i] = s.peers_lost;
	}
}

/* test_false_death's liveness bound, in heartbeats: longer than DEAD, so that only the stalled
 * replica is silent past it.  At DEAD (a second) a loaded machine starved a replica that was not
 * stalled for as long, and the others gave it up too ("replica 2 gave up 2 peers (want 1)", 1 of
 * 25 runs under 4 CPU burners).  The longest a stall that must be noticed may last. */
#define FD_DEAD      30
#define STALL_MAX_MS 20000

/* A replica that was only slow, not gone (kvr_replica_stall: for (FD_DEAD + 5) heartbeats, or
 * until its peers gave it up, its own threads do nothing, as in a starved process), while
 * routing goes on everywhere and every replica keeps live attempts.  stalled: a bit per
 * replica; sender: the stall holds its sender too (nothing published: its peers cannot tell it
 * from a dead one).  idle: the stall comes at a quiet point, nobody routes during it
 * (test_three's failure on a loaded CI machine: the whole process starved between the quiet
 * point and the load check).  want_lost: how many times each replica must have given up a
 * peer.  A stalled replica never gives up the others (the time it did not run is not their
 * silence); whoever gave up a peer hears it again and asks it to re-announce.  Then every
 * replica must agree: loads exactly, predictions with Jaccard >= 0.99
 * (20 seeds, 4-5 checks per case: all 1.0 but two in one run, 0.9985 and 0.9987, 2 blocks of
 * ~1350 on one rank, in the apply-side stall with no peer given up.  Not the apply order: the
 * index's block locator lost the entries of runs created while a growth migration was zeroing
 * its new array (core/index_blocks.c, fixed), so a held block could not be found as a parent
 * and the index write failed; after the fix 8 runs of this test gave 1.0 everywhere). */
static void false_death(uint64_t first_id, unsigned stalled, bool sender, bool idle,
                        const uint64_t want_lost[3], const char *what)
{
	dead_after = FD_DEAD;
	struct replica xs[3] = {0};
	for (int i = 0; i < 3; i++) {
		xs[i].r = make_router();
		CHECK(attach(&xs[i], first_id + (uint64_t)i) == 0, "attach %d", i);
	}
	stream(xs, 3, 300);
	CHECK(quiet(xs, 3) == 0, "%s: quiet before the stall", what);
	agree(xs, 3, what);
	unsigned stall_ms = (FD_DEAD + 5) * HB_MS;
	/* A stall whose peers must give it up lasts until they have (STALL_MAX_MS at most): the
	 * listeners' verdict may come later than the bound (their own starved spells are credited,
	 * unhandled input defers it), and at a fixed (DEAD + 5) heartbeats it came after the
	 * stall on a loaded machine ("replica 0 gave up 0 peers (want 1)"). */
	bool until_lost = false;
	for (int i = 0; i < 3; i++)
		until_lost |= want_lost[i] != 0;
	for (int i = 0; i < 3; i++)
		if (stalled >> i & 1)
			kvr_replica_stall(kvr_sync_replica(xs[i].s),
			                  until_lost ? STALL_MAX_MS : stall_ms, sender);
	uint64_t lost[3];
	if (until_lost) {
		uint64_t t0 = now_ms();
		bool all = false;
		while (!all && now_ms() - t0 < STALL_MAX_MS - 2 * HB_MS) {
			stream_for(xs, 3, HB_MS);
			lost_of(xs, 3, lost);
			all = true;
			for (int i = 0; i < 3; i++)
				all &= lost[i] >= want_lost[i];
		}
		for (int i = 0; i < 3; i++)
			if (stalled >> i & 1) /* over: it runs again from now */
				kvr_replica_stall(kvr_sync_replica(xs[i].s), 0, sender);
		CHECK(all, "%s: the stalled replica not given up in %u ms", what, STALL_MAX_MS);
		stream(xs, 3, 300);
	} else if (idle) {
		/* test_three's check came right after the starved spell: loads must agree at once
		 * (before this fix every replica had given up every peer and was re-booking them:
		 * "requests 4/6 prefill 544/474 blocks 144/266"). */
		sleep_ms(stall_ms + HB_MS);
		for (int i = 0; i < 3; i++) {
			CHECK(kvr_sync_drain(xs[i].s, 5000) == 0, "%s: drain %d", what, i);
			kvr_router_sync(xs[i].r, 5000);
		}
		agree(xs, 3, "right after the starved spell");
	} else {
		stream_for(xs, 3, stall_ms + 2 * HB_MS);
		stream(xs, 3, 300);
	}
	CHECK(quiet(xs, 3) == 0, "%s: quiet after the stall", what);
	lost_of(xs, 3, lost);
	for (int i = 0; i < 3; i++)
		CHECK(lost[i] == want_lost[i], "%s: replica %d gave up %lu peers (want %lu)", what,
		      i, (unsigned long)lost[i], (unsigned long)want_lost[i]);
	double j = agree(xs, 3, what);
	printf("test_false_death: %s: peers given up %lu/%lu/%lu, worst Jaccard %.4f\n", what,
	       (unsigned long)lost[0], (unsigned long)lost[1], (unsigned long)lost[2], j);
	stream(xs, 3, 300);
	CHECK(quiet(xs, 3) == 0, "%s: quiet after more traffic", what);
	agree(xs, 3, what);
	drain_all(xs, 3);
	CHECK(quiet(xs, 3) == 0, "%s: drained", what);
	agree(xs, 3, what);
	for (int i = 0; i < 3; i++) {
		CHECK(active_requests(xs[i].r) == 0, "%s: drained: replica %d still loaded", what,
		      i);
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
	dead_after = DEAD;
}

static void test_false_death(void)
{
	/* Replica 1 silent: 0 and 2 give it up (its attempts released), it gives up nobody. */
	false_death(91, 1u << 1, true, false, (uint64_t[3]){1, 0, 1}, "one replica stalled");
	/* Its apply thread only: its stream keeps it alive; its deafness is not their silence. */
	false_death(94, 1u << 1, false, false, (uint64_t[3]){0, 0, 0},
	            "one replica's apply side stalled");
	/* The whole process starved at a quiet point: nobody gives up anybody. */
	false_death(97, 7u, true, true, (uint64_t[3]){0, 0, 0}, "all stalled at a quiet point");
}

/* ---------------------------------------------------------------- 2 */

/* Waits until replica s mirrors exactly want peer attempts; returns the time it did, 0 if not
 * within timeout_ms. */
static uint64_t wait_mirrored(struct kvr_sync *s, size_t want, unsigned timeout_ms)
{
	uint64_t t0 = now_ms();
	for (;;) {
		struct kvr_sync_stats st;
		kvr_sync_get_stats(s, &st);
		if (st.mirrored == want)
			return now_ms();
		if (now_ms() - t0 > timeout_ms)
			return 0;
		sleep_ms(5);
	}
}

/* What the surviving child replica reports to the parent. */
struct survivor_report {
	uint64_t released_at; /* CLOCK_MONOTONIC ms, the same clock in every process; 0: never */
	uint64_t ok_before;   /* it mirrored the killed replica's attempts before the kill */
	uint64_t quiet;       /* it reached a quiet point after the release */
	uint64_t load[N_RANKS][3];
};

static bool rd(int fd, void *p, size_t n)
{
	char *c = p;
	while (n) {
		ssize_t k = read(fd, c, n);
		if (k <= 0)
			return false;
		c += k;
		n -= (size_t)k;
	}
	return true;
}

static bool wr(int fd, const void *p, size_t n)
{
	return write(fd, p, n) == (ssize_t)n;
}

static void rank_load(struct kvr_router *r, uint64_t load[N_RANKS][3])
{
	for (uint64_t w = 0; w < N_RANKS; w++) {
		struct kvr_rank_stats s;
		kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s);
		load[w][0] = s.active_requests;
		load[w][1] = s.active_prefill_tokens;
		load[w][2] = s.active_blocks;
	}
}

/* A replica in its own process admits requests and leaves some live.  The survivor (up, down
 * pipes) then follows the parent's orders; the victim sends outputs until it is killed. */
static void child_replica(uint64_t id, int up, int down, bool victim)
{
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	char go;
	if (!rd(down, &go, 1))
		_exit(2);
	rng ^= id * 0x9E3779B97F4A7C15ull; /* its own stream, not a copy of the parent's */
	struct replica c = {0};
	c.r = make_router();
	if (!c.r || attach(&c, id))
		_exit(3);
	stream(&c, 1, 200);
	for (int k = 0; k < 200 && c.n_live < 8; k++)
		step(&c); /* leave some attempts live */
	uint64_t nl = c.n_live;
	if (!wr(up, &nl, sizeof(nl)))
		_exit(4);
	if (victim) { /* mid-stream: outputs on its live attempts until SIGKILL */
		for (;;) {
			uint32_t out[8];
			for (int i = 0; i < 8; i++)
				out[i] = (uint32_t)next();
			if (c.n_live)
				kvr_request_output(c.r, c.live[next() % c.n_live], out, 8);
			sleep_ms(2);
		}
	}
	uint64_t want[2]; /* mirrored before the kill, after it */
	struct survivor_report rep = {0};
	if (!rd(down, want, sizeof(want)))
		_exit(5);
	rep.ok_before = wait_mirrored(c.s, want[0], 30000) != 0;
	char ack = (char)rep.ok_before;
	if (!wr(up, &ack, 1))
		_exit(6);
	rep.released_at = wait_mirrored(c.s, want[1], 15000);
	uint64_t t0 = now_ms(), last = UINT64_MAX;
	while (now_ms() - t0 < 15000) { /* nothing more is sent: wait until all of it is applied */
		struct kvr_sync_stats st;
		kvr_sync_drain(c.s, 2000);
		sleep_ms(2 * HB_MS);
		kvr_sync_get_stats(c.s, &st);
		if (st.applied == last && st.mirrored == want[1]) {
			rep.quiet = 1;
			break;
		}
		last = st.applied;
	}
	kvr_router_sync(c.r, 5000);
	rank_load(c.r, rep.load);
	if (!wr(up, &rep, sizeof(rep)))
		_exit(7);
	char done;
	(void)rd(down, &done, 1); /* stays in the cluster until the parent's checks are done */
	kvr_sync_detach(c.s);
	kvr_router_destroy(c.r);
	_exit(0);
}

/* The children are forked at the start, before this process initialises the NATS client library
 * (its threads do not survive a fork, and a child that inherits the library's state crashed in
 * detach); each waits for a byte on its down pipe before it starts. */
static int s_up[2], s_down[2], v_up[2], v_down[2];
static pid_t surv, vict;

static int kill_fork(void)
{
	if (pipe(s_up) || pipe(s_down) || pipe(v_up) || pipe(v_down))
		return -1;
	fflush(stdout);
	surv = fork();
	if (surv == 0) { /* each process keeps only its own pipe ends: a dead peer reads as EOF */
		close(s_up[0]);
		close(s_down[1]);
		close(v_up[0]);
		close(v_up[1]);
		close(v_down[0]);
		close(v_down[1]);
		child_replica(62, s_up[1], s_down[0], false);
	}
	vict = fork();
	if (vict == 0) {
		close(s_up[0]);
		close(s_up[1]);
		close(s_down[0]);
		close(s_down[1]);
		close(v_up[0]);
		close(v_down[1]);
		child_replica(63, v_up[1], v_down[0], true);
	}
	close(s_up[1]);
	close(s_down[0]);
	close(v_up[1]);
	close(v_down[0]);
	return surv > 0 && vict > 0 ? 0 : -1;
}

/* Three replica processes: this one (P), a survivor (S) and a victim (V), all routing.  V is
 * killed with SIGKILL while it sends: P and S release its attempts within the liveness bound and
 * then agree on every rank's load; a replica attached afterwards (J, in this process) agrees
 * with P after its snapshot, and again after more traffic. */
static void test_kill(void)
{
	char go = 1;
	CHECK(wr(s_down[1], &go, 1) && wr(v_down[1], &go, 1), "start the child replicas");
	struct replica xs[2] = {0}; /* P, then the joiner J */
	xs[0].r = make_router();
	CHECK(attach(&xs[0], 61) == 0, "attach P");
	stream(xs, 1, 200);
	for (int k = 0; k < 200 && xs[0].n_live < 4; k++)
		step(&xs[0]);
	uint64_t n_s = 0, n_v = 0;
	bool up = rd(s_up[0], &n_s, sizeof(n_s)) && rd(v_up[0], &n_v, sizeof(n_v));
	CHECK(up && n_v > 0, "child replicas started (survivor %lu live, victim %lu live)",
	      (unsigned long)n_s, (unsigned long)n_v);
	if (!up) {
		kill(surv, SIGKILL);
		kill(vict, SIGKILL);
		waitpid(surv, NULL, 0);
		waitpid(vict, NULL, 0);
		kvr_sync_detach(xs[0].s);
		kvr_router_destroy(xs[0].r);
		return;
	}
	/* P routes nothing more until the release is checked: its live set is what S must keep. */
	uint64_t want[2] = {xs[0].n_live + n_v, xs[0].n_live};
	CHECK(wr(s_down[1], want, sizeof(want)), "orders to the survivor");
	CHECK(wait_mirrored(xs[0].s, n_s + n_v, 30000), "P mirrors both children's attempts");
	char ack = 0;
	CHECK(rd(s_up[0], &ack, 1) && ack == 1,
	      "the survivor mirrors P's and the victim's attempts");
	uint64_t t0 = now_ms();
	kill(vict, SIGKILL);
	waitpid(vict, NULL, 0);
	uint64_t p_at = wait_mirrored(xs[0].s, n_s, 15000);
	struct survivor_report rep = {0};
	CHECK(rd(s_up[0], &rep, sizeof(rep)), "the survivor's report");
	/* dead_after heartbeats, one more for the check's period, and 2 s for scheduling delays
	 * on a loaded machine (the figures printed below are what was measured). */
	uint64_t bound = (uint64_t)(DEAD + 1) * HB_MS + 2000;
	CHECK(p_at && p_at - t0 <= bound, "P released the victim's attempts in %ld ms (bound %lu)",
	      p_at ? (long)(p_at - t0) : -1L, (unsigned long)bound);
	CHECK(rep.released_at && rep.released_at - t0 <= bound,
	      "the survivor released the victim's attempts in %ld ms (bound %lu)",
	      rep.released_at ? (long)(rep.released_at - t0) : -1L, (unsigned long)bound);
	printf("test_kill: 3 processes, victim had %lu live: released %ld ms (this process) and "
	       "%ld ms (survivor process) after SIGKILL (bound %lu ms)\n",
	       (unsigned long)n_v, p_at ? (long)(p_at - t0) : -1L,
	       rep.released_at ? (long)(rep.released_at - t0) : -1L, (unsigned long)bound);
	CHECK(quiet_x(xs, 1, n_s) == 0, "quiet after the kill");
	CHECK(rep.quiet, "the survivor reached a quiet point after the kill");
	uint64_t load[N_RANKS][3];
	rank_load(xs[0].r, load);
	for (int w = 0; w < N_RANKS; w++)
		CHECK(memcmp(load[w], rep.load[w], sizeof(load[w])) == 0,
		      "after kill: rank %d load differs between P and the survivor: requests "
		      "%lu/%lu prefill %lu/%lu blocks %lu/%lu",
		      w, (unsigned long)load[w][0], (unsigned long)rep.load[w][0],
		      (unsigned long)load[w][1], (unsigned long)rep.load[w][1],
		      (unsigned long)load[w][2], (unsigned long)rep.load[w][2]);
	/* A new replica joins: after its snapshot it agrees. */
	xs[1].r = make_router();
	CHECK(attach(&xs[1], 64) == 0, "attach the new replica");
	struct kvr_sync_stats sn;
	kvr_sync_get_stats(xs[1].s, &sn);
	CHECK(sn.snapshots_applied == 1, "the new replica applied a snapshot (%lu)",
	      (unsigned long)sn.snapshots_applied);
	CHECK(quiet_x(xs, 2, n_s) == 0, "quiet after the join");
	double j = agree(xs, 2, "after join");
	printf("test_kill: joiner's worst Jaccard after its snapshot %.4f\n", j);
	stream(xs, 2, 400);
	CHECK(quiet_x(xs, 2, n_s) == 0, "quiet after more traffic");
	agree(xs, 2, "joined + traffic");
	drain_all(xs, 2);
	char done = 1;
	CHECK(wr(s_down[1], &done, 1), "release the survivor");
	int st = -1;
	waitpid(surv, &st, 0);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the survivor exited cleanly (status %d)", st);
	for (int i = 0; i < 2; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
}

/* ---------------------------------------------------------------- 2b */

/* ---------------------------------------------------------------- 2c */

/* Two replicas route while the library's allocations fail now and then (a failure armed a few
 * allocations ahead before a third of the steps).  Once the failures stop and every request
 * ended, the replicas settle (every mirror released, each has applied the other's whole stream)
 * and every load is zero on both.  Predictions are not compared: a failed index write or booking
 * is counted and heals later, on its own replica only.  It found two ways a mirror stayed live
 * for good: a posted booking dropped for memory made the attempt stale at its origin, whose
 * finish (KVR_ESTALE) then told nobody (1-13 mirrors per run), and when that drop was told as an
 * expiry it could reach the sender before the admission did (1-4).
 * Two kinds of arm, half each.  Process-wide (scope 0) on purpose: the failures replica sync
 * must survive include the router's own on its shard threads (a dropped booking, an index
 * write), where both finds above came from; scoping them away would lose them.  But the shards
 * take most of an unscoped arm's failures, so the other half is scoped (kvr_alloc_fail_scope)
 * to this thread (routes, notes) and replica sync's threads (the sender, the apply thread and
 * nats.c's delivering thread, which applies inline).  Over 10 runs each, all arms one kind:
 * process-wide, 356 failed index writes and 261 stale calls; scoped, none, and the receiving
 * side's failures went up: refused admissions 53 -> 145, orphans 27 -> 123, output not applied
 * 455 -> 759.  A delivery lost for memory (dropped) is reached by neither: most deliveries are
 * applied inline, with no copy to allocate (test_queued_drop reaches it). */
static void test_oom(void)
{
	struct replica xs[2] = {0};
	for (int i = 0; i < 2; i++) {
		xs[i].r = make_router();
		CHECK(xs[i].r && attach(&xs[i], 700 + (uint64_t)i) == 0, "oom: attach %d", i);
		if (!xs[i].r || !xs[i].s)
			return;
	}
	uint64_t armed[2] = {0}; /* process-wide, scoped */
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_CALLER);
	for (int k = 0; k < 400; k++) {
		if (kvr_alloc_fail_pending() == 0 && next() % 3 == 0) {
			/* disarmed (fired or cancelled): the scope may change */
			int scoped = (int)(next() % 2);
			kvr_alloc_fail_scope(scoped ? KVR_ALLOC_ROLE_CALLER | KVR_ALLOC_ROLE_REPLICA
			                            : 0);
			kvr_alloc_fail_after(1 + next() % 8);
			armed[scoped]++;
		}
		step(&xs[k % 2]);
		if (next() % 2)
			kvr_alloc_fail_after(0);
		sleep_ms(1);
	}
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
	kvr_alloc_thread_role(0);
	drain_all(xs, 2);
	CHECK(quiet(xs, 2) == 0, "oom: the replicas did not settle after the failures");
	for (int i = 0; i < 2; i++) {
		struct kvr_sync_stats s;
		kvr_sync_get_stats(xs[i].s, &s);
		printf("oom: replica %d published %lu unpublished %lu dropped %lu gaps %lu resyncs "
		       "%lu refused %lu orphans %lu output_dropped %lu early_lost %lu\n",
		       i, (unsigned long)s.published, (unsigned long)s.unpublished,
		       (unsigned long)s.dropped, (unsigned long)s.gaps, (unsigned long)s.resyncs,
		       (unsigned long)s.refused, (unsigned long)s.orphans,
		       (unsigned long)s.output_dropped, (unsigned long)s.early_lost);
		static char mbuf[1 << 20];
		kvr_metrics_render(xs[i].r, mbuf, sizeof(mbuf), NULL);
		for (char *l = strtok(mbuf, "\n"); l; l = strtok(NULL, "\n"))
			if (strstr(l, "errors_total{") || strstr(l, "stale_bookings") ||
			    strstr(l, "stale_calls"))
				printf("  %s\n", l);
	}
	for (uint64_t w = 0; w < N_RANKS; w++)
		for (int i = 0; i < 2; i++) {
			struct kvr_rank_stats s;
			kvr_rank_get_stats(xs[i].r, (struct kvr_rank_id){w, 0}, &s);
			CHECK(s.active_requests == 0 && s.active_prefill_tokens == 0 &&
			          s.active_blocks == 0,
			      "oom: replica %d rank %lu idle with requests %lu prefill %lu blocks "
			      "%lu",
			      i, (unsigned long)w, (unsigned long)s.active_requests,
			      (unsigned long)s.active_prefill_tokens,
			      (unsigned long)s.active_blocks);
		}
	for (int i = 0; i < 2; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
	printf("oom: %lu failures armed over 400 steps (%lu process-wide, %lu scoped)\n",
	       (unsigned long)(armed[0] + armed[1]), (unsigned long)armed[0],
	       (unsigned long)armed[1]);
}

/* A delivery lost for memory on the queued path: B's apply thread stalled (kvr_replica_stall,
 * half the liveness bound), nats.c's thread queues what it delivers instead of applying it
 * inline, and every allocation of replica sync's threads fails (scoped: the routers' threads
 * allocate untouched) while A ends attempts.  Each copy fails, and the drop is counted; once
 * the failures stop and B runs again, A's next heartbeat shows B the gap, A re-announces, and
 * B mirrors exactly A's live attempts, with equal loads and predictions, and none once all
 * end.  No test reached this drop before (test_oom's deliveries are nearly all inline). */
static void test_queued_drop(void)
{
	struct replica xs[2] = {0};
	for (int i = 0; i < 2; i++) {
		xs[i].r = make_router();
		CHECK(xs[i].r && attach(&xs[i], 750 + (uint64_t)i) == 0, "queued_drop: attach %d",
		      i);
		if (!xs[i].r || !xs[i].s)
			return;
	}
	for (int k = 0; k < 400 && xs[0].n_live < 16; k++)
		step(&xs[0]);
	CHECK(quiet(xs, 2) == 0, "queued_drop: not quiet before");
	struct kvr_sync_stats b0, b1, a0, a1;
	kvr_sync_get_stats(xs[1].s, &b0);
	kvr_sync_get_stats(xs[0].s, &a0);
	kvr_replica_stall(kvr_sync_replica(xs[1].s), DEAD * HB_MS / 2, false);
	sleep_ms(20);
	kvr_alloc_fail_scope(KVR_ALLOC_ROLE_REPLICA);
	kvr_alloc_fail_from(1);
	for (int k = 0; k < 8 && xs[0].n_live; k++)
		kvr_request_finish(xs[0].r, xs[0].live[--xs[0].n_live]);
	sleep_ms(100);
	kvr_alloc_fail_after(0);
	kvr_alloc_fail_scope(0);
	kvr_sync_get_stats(xs[1].s, &b1);
	kvr_sync_get_stats(xs[0].s, &a1);
	CHECK(b1.dropped > b0.dropped, "queued_drop: no delivery dropped (%lu)",
	      (unsigned long)(b1.dropped - b0.dropped));
	CHECK(a1.unpublished == a0.unpublished, "queued_drop: A lost %lu notes itself",
	      (unsigned long)(a1.unpublished - a0.unpublished));
	uint64_t t0 = now_ms();
	CHECK(quiet(xs, 2) == 0, "queued_drop: B did not heal");
	kvr_sync_get_stats(xs[1].s, &b1);
	printf("queued_drop: %lu deliveries dropped on B, healed (gaps %lu -> %lu) %lu ms after "
	       "the failures\n",
	       (unsigned long)(b1.dropped - b0.dropped), (unsigned long)b0.gaps,
	       (unsigned long)b1.gaps, (unsigned long)(now_ms() - t0));
	agree(xs, 2, "queued_drop");
	drain_all(xs, 2);
	CHECK(quiet(xs, 2) == 0, "queued_drop: not quiet after");
	for (int i = 0; i < 2; i++)
		CHECK(active_requests(xs[i].r) == 0, "queued_drop: replica %d keeps requests", i);
	for (int i = 0; i < 2; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
}

/* A's lease reaper (1 s scan) expires its idle attempts; B's (the default 120 s) would not for
 * minutes: B releases its mirrors at once because A tells it, and a replica attached afterwards
 * mirrors none of them (A dropped its records: its snapshot does not name them). */
static void test_expire(void)
{
	struct replica xs[3] = {0};
	lease_ns = 1000000000;
	xs[0].r = make_router();
	lease_ns = 0;
	xs[1].r = make_router();
	CHECK(attach(&xs[0], 71) == 0 && attach(&xs[1], 72) == 0, "attach");
	for (int k = 0; k < 200 && xs[0].n_live < 8; k++)
		step(&xs[0]);
	size_t n = xs[0].n_live;
	CHECK(n > 0 && wait_mirrored(xs[1].s, n, 10000), "B mirrors A's %zu attempts", n);
	uint64_t t0 = now_ms(), gone = 0;
	while (now_ms() - t0 < 10000 && !gone) {
		if (active_requests(xs[0].r) == 0)
			gone = now_ms();
		else
			sleep_ms(5);
	}
	CHECK(gone, "A's reaper expired its idle attempts");
	uint64_t at = wait_mirrored(xs[1].s, 0, 5000);
	CHECK(at, "B released the mirrors of A's expired attempts");
	CHECK(kvr_router_sync(xs[1].r, 5000) == 0 && active_requests(xs[1].r) == 0,
	      "B's ranks carry no load of A's expired attempts");
	printf("test_expire: %zu attempts expired on A %lu ms after admission; B released them "
	       "%ld ms later (its own lease: 120 s)\n",
	       n, (unsigned long)(gone - t0), at ? (long)(at - gone) : -1L);
	xs[2].r = make_router();
	CHECK(attach(&xs[2], 73) == 0, "attach the joiner");
	struct kvr_sync_stats sj;
	kvr_sync_get_stats(xs[2].s, &sj);
	CHECK(sj.snapshots_applied == 1 && sj.mirrored == 0,
	      "the joiner's snapshot names none of A's expired attempts (snapshots %lu, mirrored "
	      "%u)",
	      (unsigned long)sj.snapshots_applied, sj.mirrored);
	xs[0].n_live = 0; /* expired: finishing them now is a no-op */
	for (int i = 0; i < 3; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
}

/* ---------------------------------------------------------------- 3 */

static void test_outage(void)
{
	struct replica xs[3] = {0};
	int inherited = sockets_inherited();
	for (int i = 0; i < 3; i++) {
		xs[i].r = make_router();
		CHECK(attach(&xs[i], (uint64_t)i + 21) == 0, "attach %d", i);
	}
	stream(xs, 3, 300);
	kvr_test_nats_stop();
	sleep_ms(100);
	stream(xs, 3, 600); /* routing goes on, on local knowledge */
	CHECK(kvr_test_nats_start() == 0, "nats-server restarted");
	uint64_t t0 = now_ms();
	while (now_ms() - t0 < 10000) {
		bool all = true;
		for (int i = 0; i < 3; i++) {
			struct kvr_sync_stats s;
			kvr_sync_get_stats(xs[i].s, &s);
			all &= s.reconnects >= 1 && s.connected;
		}
		if (all)
			break;
		sleep_ms(20);
	}
	stream(xs, 3, 300);
	CHECK(quiet(xs, 3) == 0, "quiet after the outage");
	CHECK(
	    sockets_inherited() == inherited,
	    "the reconnected sockets lack FD_CLOEXEC (%d sockets more a spawned program inherits)",
	    sockets_inherited() - inherited);
	for (int i = 0; i < 3; i++) {
		struct kvr_sync_stats s;
		kvr_sync_get_stats(xs[i].s, &s);
		printf("test_outage: replica %d disconnects %lu reconnects %lu unpublished %lu "
		       "resyncs %lu\n",
		       i, (unsigned long)s.disconnects, (unsigned long)s.reconnects,
		       (unsigned long)s.unpublished, (unsigned long)s.resyncs);
		CHECK(s.disconnects >= 1 && s.reconnects >= 1 && s.unpublished > 0,
		      "counters show the outage on replica %d", i);
	}
	/* After the reconnect every replica re-announced its live attempts and the ones it finished
	 * since shortly before the outage (and again, on request, to a peer that missed that);
	 * loads agree exactly and the predictions converge. */
	double j = agree(xs, 3, "right after the outage");
	printf("test_outage: worst Jaccard right after reconnect %.4f\n", j);
	stream(xs, 3, 900);
	CHECK(quiet(xs, 3) == 0, "quiet after more traffic");
	j = agree(xs, 3, "after the outage and more traffic");
	printf("test_outage: worst Jaccard after 900 more requests %.4f\n", j);
	drain_all(xs, 3);
	CHECK(quiet(xs, 3) == 0, "drained after the outage");
	agree(xs, 3, "drained after the outage");
	for (int i = 0; i < 3; i++) {
		kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
}

/* ---------------------------------------------------------------- 4 */

static void test_trace(void)
{
	struct replica a = {0}, b = {0};
	a.r = make_router();
	b.r = make_router();
	CHECK(attach(&a, 51) == 0 && attach(&b, 52) == 0, "attach");
	uint64_t traced[16], untraced = 0;
	uint32_t t[256];
	for (int k = 0; k < 17; k++) {
		/* the first one untraced; tracing stays on until every stage is behind us */
		if (k == 1) {
			CHECK(kvr_sync_drain(a.s, 5000) == 0, "drain a");
			__atomic_store_n(&kvr_rep_trace_origin, a.id, __ATOMIC_RELAXED);
		}
		for (size_t i = 0; i < 256; i++)
			t[i] = (uint32_t)(7000000u + (uint32_t)k * 1000u + (uint32_t)i);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 256;
		struct kvr_decision d;
		CHECK(kvr_route(a.r, &q, &d) == 0, "route %d", k);
		if (k)
			traced[k - 1] = d.attempt;
		else
			untraced = d.attempt;
	}
	CHECK(kvr_sync_drain(a.s, 5000) == 0, "drain a");
	uint64_t t0 = now_ms();
	for (;;) { /* B applied A's stream up to A's last message */
		struct kvr_sync_stats st;
		uint64_t at = 0;
		kvr_sync_get_stats(a.s, &st);
		if (kvr_sync_peer_seq(b.s, a.id, &at) == 0 && at >= st.seq)
			break;
		if (now_ms() - t0 > 5000)
			break;
		sleep_ms(2);
	}
	CHECK(kvr_sync_drain(b.s, 5000) == 0, "drain b");
	__atomic_store_n(&kvr_rep_trace_origin, 0, __ATOMIC_RELAXED);
	for (int k = 0; k < 16; k++) {
		uint64_t s[KVR_TR_N];
		if (kvr_rep_trace_get(traced[k], s)) {
			CHECK(0, "admission %d: no stamps", k);
			continue;
		}
		bool all = true;
		for (int i = 0; i < KVR_TR_N; i++)
			all = all && s[i];
		CHECK(all, "admission %d: a stage was not stamped (%lu %lu %lu %lu %lu %lu)", k,
		      (unsigned long)s[0], (unsigned long)s[1], (unsigned long)s[2],
		      (unsigned long)s[3], (unsigned long)s[4], (unsigned long)s[5]);
		CHECK(s[KVR_TR_NOTE] <= s[KVR_TR_POP] && s[KVR_TR_POP] <= s[KVR_TR_ENCODED] &&
		          s[KVR_TR_NOTE] <= s[KVR_TR_RECEIVED] &&
		          s[KVR_TR_RECEIVED] <= s[KVR_TR_HANDLE] &&
		          s[KVR_TR_HANDLE] <= s[KVR_TR_POSTED],
		      "admission %d: stamps out of pipeline order", k);
	}
	uint64_t s[KVR_TR_N];
	CHECK(kvr_rep_trace_get(untraced, s) != 0, "an untraced admission has stamps");
	for (int k = 0; k < 16; k++)
		kvr_request_finish(a.r, traced[k]);
	kvr_request_finish(a.r, untraced);
	kvr_sync_detach(a.s);
	kvr_sync_detach(b.s);
	kvr_router_destroy(a.r);
	kvr_router_destroy(b.r);
	printf("test_trace: %s\n", fails ? "failures above" : "16 traced admissions, every stage");
}

/* ---------------------------------------------------------------- 5. bad input on the wire */

/* Appends a RANK add of worker w from replica `from` to b (stream position seq). */
static void put_rank(struct kvr_msg_buf *b, uint64_t from, uint64_t seq, uint64_t w)
{
	kvr_test_put_rank(b, from, 5, seq, w);
}

static bool has_rank(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats st;
	return kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &st) == 0;
}

/* Raw transport messages on the stream subject, through the server: the old wire version 1, a
 * batch whose second message is truncated, a batch carrying our own id, each counted and
 * dropped whole (none of their ranks appears); then a good batch of two is applied. */
static void test_wire(void)
{
	struct replica a = {0};
	a.r = make_router();
	CHECK(attach(&a, 61) == 0, "attach");
	natsConnection *nc = NULL;
	CHECK(natsConnection_ConnectTo(&nc, kvr_test_nats_url()) == NATS_OK, "raw connection");
	struct kvr_msg_buf b = {0};
	/* version 1 (the layout is the same; only the version byte says it is old) */
	put_rank(&b, 77, 1, 900);
	b.p[2] = 1;
	natsConnection_Publish(nc, "t.stream", b.p, (int)b.len);
	/* a batch: a good RANK, then a FINISH cut short */
	b.len = 0;
	put_rank(&b, 77, 1, 901);
	size_t off = kvr_msg_begin(&b, KVR_MSG_FINISH, 77, 5, 2);
	kvr_msg_put_u64(&b, 3);
	kvr_msg_end(&b, off);
	natsConnection_Publish(nc, "t.stream", b.p, (int)b.len - 3);
	/* a batch in our own name (forged: a replica never hears itself) */
	b.len = 0;
	put_rank(&b, a.id, 1, 902);
	put_rank(&b, a.id, 2, 905);
	natsConnection_Publish(nc, "t.stream", b.p, (int)b.len);
	/* a good batch of two */
	b.len = 0;
	put_rank(&b, 77, 1, 903);
	put_rank(&b, 77, 2, 904);
	natsConnection_Publish(nc, "t.stream", b.p, (int)b.len);
	natsConnection_FlushTimeout(nc, 2000);
	struct kvr_sync_stats st = {0};
	uint64_t t0 = now_ms();
	do {
		sleep_ms(10);
		kvr_sync_drain(a.s, 1000);
		kvr_sync_get_stats(a.s, &st);
	} while (st.applied < 2 && now_ms() - t0 < 5000);
	kvr_router_sync(a.r, 5000);
	CHECK(st.dropped == 3 && st.forged == 1 && st.applied == 2,
	      "dropped %lu (want 3), forged %lu (want 1), applied %lu (want 2)",
	      (unsigned long)st.dropped, (unsigned long)st.forged, (unsigned long)st.applied);
	CHECK(!has_rank(a.r, 900) && !has_rank(a.r, 901) && !has_rank(a.r, 902) &&
	          !has_rank(a.r, 905),
	      "a dropped message or batch was applied (in part)");
	CHECK(has_rank(a.r, 903) && has_rank(a.r, 904), "the good batch was not applied");
	kvr_msg_buf_fini(&b);
	natsConnection_Destroy(nc);
	kvr_sync_detach(a.s);
	kvr_router_destroy(a.r);
	printf("test_wire: dropped %lu forged %lu applied %lu\n", (unsigned long)st.dropped,
	       (unsigned long)st.forged, (unsigned long)st.applied);
}

/* ---------------------------------------------------------------- 6 */

static struct replica cb_x[2];
static int cb_done, cb_drain_rc = 1, cb_ready_rc = 1;
static uint64_t cb_drain_ms;
static char cb_thread[17];
static pthread_t cb_main;
static bool cb_on_main;

static void cb_on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx, (void)ticket, (void)d;
	prctl(PR_GET_NAME, cb_thread);
	cb_on_main = pthread_equal(pthread_self(), cb_main);
	uint64_t t0 = now_ms();
	cb_drain_rc = kvr_sync_drain(cb_x[1].s, 3000);
	cb_drain_ms = now_ms() - t0;
	cb_ready_rc = kvr_sync_wait_ready(cb_x[1].s, 3000);
	kvr_sync_detach(cb_x[1].s);    /* does nothing here */
	kvr_router_destroy(cb_x[1].r); /* nor this */
	__atomic_store_n(&cb_done, 1, __ATOMIC_RELEASE);
}

/* One shard, the queue on, rank {0, 0} with a 100-token budget: a 200-token request (A's,
 * mirrored on B) saturates it, and B's own next request waits until A's finish is applied. */
static struct kvr_router *cb_router(bool with_cb)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.queue_threshold = 1.0;
	c.sync_booking = true;
	c.on_admit = with_cb ? cb_on_admit : NULL;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r))
		return NULL;
	kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, 1000, 100);
	return r;
}

static int cb_route(struct kvr_router *r, uint32_t salt, size_t n, struct kvr_decision *d)
{
	static const struct kvr_rank_id x = {0, 0};
	return route_salt_pinned(r, &x, salt, n, d);
}

static void test_callbacks(void)
{
	cb_main = pthread_self();
	for (int i = 0; i < 2; i++) {
		cb_x[i].r = cb_router(i == 1);
		CHECK(cb_x[i].r && attach(&cb_x[i], 790 + (uint64_t)i) == 0, "callbacks: attach %d",
		      i);
		if (!cb_x[i].r || !cb_x[i].s)
			return;
	}
	struct kvr_decision hog, q;
	CHECK(cb_route(cb_x[0].r, 1, 200, &hog) == 0 && hog.status == KVR_DECIDED,
	      "callbacks: A's request");
	/* A's admission out, then applied on B: drain only says A sent it and B has nothing
	 * queued, not that it arrived (nats-server in between), so wait for B's mirror of it. */
	CHECK(kvr_sync_drain(cb_x[0].s, 5000) == 0, "callbacks: A not quiet");
	CHECK(wait_mirrored(cb_x[1].s, 1, 5000) != 0, "callbacks: B never mirrored A's attempt");
	for (int i = 0; i < 2; i++)
		CHECK(kvr_sync_drain(cb_x[i].s, 5000) == 0 && kvr_router_sync(cb_x[i].r, 5000) == 0,
		      "callbacks: %d not quiet", i);
	CHECK(cb_route(cb_x[1].r, 2, 64, &q) == 0 && q.status == KVR_QUEUED,
	      "callbacks: B's request did not wait (status %d)", q.status);
	kvr_request_finish(cb_x[0].r, hog.attempt);
	for (int t = 0; t < 1000 && !__atomic_load_n(&cb_done, __ATOMIC_ACQUIRE); t++)
		sleep_ms(10);
	CHECK(cb_done, "callbacks: on_admit never returned");
	CHECK(!cb_on_main, "callbacks: on_admit ran on the test's thread");
	CHECK(cb_drain_rc == KVR_EBUSY && cb_drain_ms < 1000,
	      "callbacks: kvr_sync_drain from on_admit: %d after %lu ms", cb_drain_rc,
	      (unsigned long)cb_drain_ms);
	CHECK(cb_ready_rc == 0, "callbacks: kvr_sync_wait_ready from on_admit: %d", cb_ready_rc);
	printf("callbacks: on_admit on thread '%s' (%s): drain %d in %lu ms, detach and destroy "
	       "returned\n",
	       cb_thread, strcmp(cb_thread, "kvr-sync-apply") ? "nats.c's, inline" : "apply",
	       cb_drain_rc, (unsigned long)cb_drain_ms);
	/* Both still work: B drains and routes, then everything goes from here. */
	CHECK(kvr_sync_drain(cb_x[1].s, 5000) == 0, "callbacks: B does not drain after");
	struct kvr_decision d;
	CHECK(cb_route(cb_x[1].r, 3, 16, &d) == 0, "callbacks: B does not route after");
	for (int i = 0; i < 2; i++) {
		kvr_sync_detach(cb_x[i].s);
		kvr_router_destroy(cb_x[i].r);
	}
}

/* 7: in forked children, before this process starts nats.c (its threads would not follow). */
static void test_fd_limit(void)
{
	for (int spare = 0; spare < 4; spare++) {
		fflush(stdout);
		pid_t p = fork();
		if (p == 0) {
			struct kvr_router *r = make_router();
			if (!r)
				_exit(2);
			/* Every descriptor number up to the limit taken, then `spare` given back.
			 */
			struct rlimit rl;
			getrlimit(RLIMIT_NOFILE, &rl);
			rl.rlim_cur = 256;
			if (setrlimit(RLIMIT_NOFILE, &rl))
				_exit(3);
			int held[256], n = 0, fd;
			while (n < 256 && (fd = open("/dev/null", O_RDONLY)) >= 0)
				held[n++] = fd;
			for (int j = 0; j < spare && n > 0; j++)
				close(held[--n]);
			struct kvr_sync_config c;
			kvr_sync_config_init(&c);
			c.servers = kvr_test_nats_url();
			c.cluster = "fd";
			c.replica_id = 1;
			struct kvr_sync *s;
			int rc = kvr_sync_attach(r, &c, &s);
			const char *why = rc ? kvr_last_error() : "attached";
			printf("fd_limit: %d spare: %s (%s)\n", spare, kvr_strerror(rc), why);
			int ok = rc == 0 || (rc == KVR_ENOMEM && strstr(why, "file descriptors"));
			if (rc == 0)
				kvr_sync_detach(s);
			kvr_router_destroy(r);
			fflush(stdout);
			_exit(ok ? 0 : 1);
		}
		int st = 0;
		if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			printf("FAIL fd_limit: %d spare: status %d\n", spare, st);
			fails++;
		}
	}
}

/* 8: threads of this process other than the main one that do not block SIGTERM (nats.c's
 * are started by the attach: a process-directed signal must not land on them, sync/thread.h). */
static int unblocked_threads(void)
{
	int n = 0;
	char path[300], line[256];
	DIR *d = opendir("/proc/self/task");
	struct dirent *e;
	while (d && (e = readdir(d))) {
		if (e->d_name[0] == '.' || atoi(e->d_name) == getpid())
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/status", e->d_name);
		FILE *f = fopen(path, "r");
		while (f && fgets(line, sizeof(line), f))
			if (strncmp(line, "SigBlk:", 7) == 0 &&
			    !(strtoull(line + 7, NULL, 16) & (1ull << (SIGTERM - 1))))
				n++;
		if (f)
			fclose(f);
	}
	if (d)
		closedir(d);
	return n;
}

static void on_timer(int sig)
{
	(void)sig;
}

static void test_signals(void)
{
	struct sigaction sa, old_prof, old_alrm;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_timer; /* no SA_RESTART: interrupted system calls return EINTR */
	sigaction(SIGPROF, &sa, &old_prof);
	sigaction(SIGALRM, &sa, &old_alrm);
	struct itimerval it = {{0, 50}, {0, 50}}, off = {{0, 0}, {0, 0}};
	setitimer(ITIMER_PROF, &it, NULL);
	setitimer(ITIMER_REAL, &it, NULL);
	int bad = 0;
	for (int round = 0; round < 5; round++) {
		struct replica x[2] = {{0}};
		for (int i = 0; i < 2; i++) {
			x[i].r = make_router();
			int rc =
			    x[i].r ? attach(&x[i], 80 + (uint64_t)round * 2 + (uint64_t)i) : -1;
			if (rc) {
				printf("FAIL signals: attach: %s (%s)\n", kvr_strerror(rc),
				       kvr_last_error());
				bad++;
			}
		}
		int open = unblocked_threads();
		if (open) {
			printf("FAIL signals: %d threads besides the main one take SIGTERM\n",
			       open);
			bad++;
		}
		if (x[0].s && x[1].s) {
			stream(x, 2, 200);
			drain_all(x, 2);
			for (int i = 0; i < 2; i++) {
				int rc = kvr_sync_drain(x[i].s, 5000);
				if (rc) {
					printf("FAIL signals: drain: %s (%s)\n", kvr_strerror(rc),
					       kvr_last_error());
					bad++;
				}
			}
		}
		for (int i = 0; i < 2; i++) {
			if (x[i].s)
				kvr_sync_detach(x[i].s);
			kvr_router_destroy(x[i].r);
		}
	}
	setitimer(ITIMER_PROF, &off, NULL);
	setitimer(ITIMER_REAL, &off, NULL);
	sigaction(SIGPROF, &old_prof, NULL);
	sigaction(SIGALRM, &old_alrm, NULL);
	printf("signals: 10 attaches under 50 us timers, %d failed\n", bad);
	fails += bad;
}

/* 9 */
static void test_router_first(void)
{
	struct replica x[2] = {{0}};
	for (int i = 0; i < 2; i++) {
		x[i].r = make_router();
		if (!x[i].r || attach(&x[i], 90 + (uint64_t)i)) {
			printf("FAIL router_first: attach\n");
			fails++;
			return;
		}
	}
	stream(x, 2, 100);
	kvr_router_destroy(x[0].r); /* with its replica attached, live attempts and all */
	struct kvr_sync_stats st;
	uint64_t seq;
	int rc[4] = {kvr_sync_get_stats(x[0].s, &st), kvr_sync_drain(x[0].s, 100),
	             kvr_sync_wait_ready(x[0].s, 100), kvr_sync_peer_seq(x[0].s, 91, &seq)};
	for (int k = 0; k < 4; k++)
		if (rc[k] != KVR_ESHUTDOWN) {
			printf("FAIL router_first: call %d on the handle: %s\n", k,
			       kvr_strerror(rc[k]));
			fails++;
		}
	kvr_sync_detach(x[0].s);
	/* The peer heard the goodbye: it mirrors nothing of replica 90 any more. */
	drain_all(&x[1], 1);
	int q = quiet(&x[1], 1);
	if (q) {
		printf("FAIL router_first: the survivor did not settle (%d)\n", q);
		fails++;
	}
	kvr_sync_detach(x[1].s);
	kvr_router_destroy(x[1].r);
	printf("router_first: ok unless said\n");
}

/* 10 */
static double mono_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int attach_slow_snapshots(struct kvr_router *r, const char *cluster, struct kvr_sync **s)
{
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = kvr_test_nats_url();
	c.cluster = cluster;
	c.replica_id = 1;
	c.snapshot_timeout_ms = 20000;
	return kvr_sync_attach(r, &c, s);
}

static void test_snapshot_wait(void)
{
	/* Alone: ready at once, after one request. */
	struct kvr_router *r = make_router();
	struct kvr_sync *s = NULL;
	CHECK(r && attach_slow_snapshots(r, "lone", &s) == 0, "attach alone");
	if (!s)
		return;
	double t0 = mono_ms();
	int rc = kvr_sync_wait_ready(s, 8000);
	double ready_ms = mono_ms() - t0;
	struct kvr_sync_stats st;
	kvr_sync_get_stats(s, &st);
	CHECK(rc == 0, "a lone replica not ready after 8 s: %s", kvr_strerror(rc));
	CHECK(st.resyncs == 1, "a lone replica asked %llu times", (unsigned long long)st.resyncs);
	kvr_sync_detach(s);
	kvr_router_destroy(r);
	/* A peer that takes snapshot requests and never answers (a raw subscription). */
	natsConnection *nc = NULL;
	natsSubscription *mute = NULL;
	CHECK(natsConnection_ConnectTo(&nc, kvr_test_nats_url()) == NATS_OK, "raw connection");
	if (!nc)
		return;
	CHECK(natsConnection_SubscribeSync(&mute, nc, "mute.snap") == NATS_OK &&
	          natsConnection_Flush(nc) == NATS_OK,
	      "the mute peer");
	double took[2] = {0, 0};
	for (int how = 0; how < 2; how++) { /* 0: detach, 1: router destroy, then detach */
		r = make_router();
		s = NULL;
		CHECK(r && attach_slow_snapshots(r, "mute", &s) == 0,
		      "attach beside the mute peer");
		if (!s)
			break;
		t0 = mono_ms();
		if (how == 0)
			kvr_sync_detach(s);
		else
			kvr_router_destroy(r);
		took[how] = mono_ms() - t0;
		CHECK(took[how] < 8000, "%s waited %.0f ms for the mute peer",
		      how ? "kvr_router_destroy" : "kvr_sync_detach", took[how]);
		if (how == 0)
			kvr_router_destroy(r);
		else
			kvr_sync_detach(s);
	}
	natsSubscription_Destroy(mute);
	/* A member of the snapshot queue group that never answers, alone in it: the request is
	 * sent again (same inbox) every eighth of the budget while nobody answers, so that the
	 * group may pick another member.  Before, it was sent once and the budget waited out. */
	mute = NULL;
	CHECK(natsConnection_QueueSubscribeSync(&mute, nc, "hedge.snap", "kvr-snap") == NATS_OK &&
	          natsConnection_Flush(nc) == NATS_OK,
	      "the mute member");
	r = make_router();
	s = NULL;
	struct kvr_sync_config hc;
	kvr_sync_config_init(&hc);
	hc.servers = kvr_test_nats_url();
	hc.cluster = "hedge";
	hc.replica_id = 1;
	hc.snapshot_timeout_ms = 1600; /* sent again every 200 ms */
	CHECK(r && mute && kvr_sync_attach(r, &hc, &s) == 0, "attach beside the mute member");
	int asked = 0, inboxes = 0;
	char first[128] = "";
	for (double h0 = mono_ms(); s && mono_ms() - h0 < 1400;) {
		natsMsg *m = NULL;
		if (natsSubscription_NextMsg(&m, mute, 50) != NATS_OK)
			continue;
		const char *to = natsMsg_GetReply(m);
		if (to && !first[0])
			snprintf(first, sizeof(first), "%s", to);
		asked++;
		inboxes += !to || strcmp(to, first) != 0;
		natsMsg_Destroy(m);
	}
	CHECK(asked >= 4, "the mute member was asked %d times in 1.4 s of a 1.6 s budget", asked);
	CHECK(inboxes == 0, "%d of the requests sent again had another inbox", inboxes);
	if (s)
		kvr_sync_detach(s);
	kvr_router_destroy(r);
	natsSubscription_Destroy(mute);
	natsConnection_Destroy(nc);
	printf("snapshot_wait: alone ready in %.1f ms; beside a mute peer detach %.1f ms, router "
	       "destroy %.1f ms; a mute member alone asked %d times in 1.4 s\n",
	       ready_ms, took[0], took[1], asked);
}

/* Replies chunk c (flags, records recs: n of them) from provider 7 to `to`. */
static void reply_chunk(natsConnection *nc, const char *to, uint32_t c, uint32_t flags,
                        const struct kvr_msg_buf *recs, uint32_t n)
{
	struct kvr_msg_buf b = {0};
	kvr_test_put_chunk(&b, 7, 300, c, flags, recs, n);
	CHECK(!b.oom && natsConnection_Publish(nc, to, b.p, (int)b.len) == NATS_OK &&
	          natsConnection_Flush(nc) == NATS_OK,
	      "reply chunk %u", c);
	kvr_msg_buf_fini(&b);
}

/* A joiner (replica 1 of `cluster`, snapshot_timeout_ms budget_ms) beside one member of the
 * snapshot queue group, a raw subscription on its own connection: the member's answers are the
 * test's to write. */
struct member_scene {
	natsConnection *nc;
	natsSubscription *m;
	struct kvr_router *r;
	struct kvr_sync *s;
};

static void member_scene_open(struct member_scene *sc, const char *cluster, uint32_t budget_ms)
{
	*sc = (struct member_scene){0};
	char subj[64];
	snprintf(subj, sizeof(subj), "%s.snap", cluster);
	CHECK(natsConnection_ConnectTo(&sc->nc, kvr_test_nats_url()) == NATS_OK &&
	          natsConnection_QueueSubscribeSync(&sc->m, sc->nc, subj, "kvr-snap") == NATS_OK &&
	          natsConnection_Flush(sc->nc) == NATS_OK,
	      "the member");
	sc->r = make_router();
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = kvr_test_nats_url();
	c.cluster = cluster;
	c.replica_id = 1;
	c.snapshot_timeout_ms = budget_ms;
	CHECK(sc->m && sc->r && kvr_sync_attach(sc->r, &c, &sc->s) == 0, "attach");
}

/* The joiner's next request's reply inbox, copied to `to` (false: none within 2 s). */
static bool member_scene_request(struct member_scene *sc, char *to, size_t cap)
{
	natsMsg *q = NULL;
	bool got =
	    sc->s && natsSubscription_NextMsg(&q, sc->m, 2000) == NATS_OK && natsMsg_GetReply(q);
	if (got)
		snprintf(to, cap, "%s", natsMsg_GetReply(q));
	natsMsg_Destroy(q);
	CHECK(got, "no request");
	return got;
}

/* Provider 7's snapshot to `to`: its fence, then a RANK add of worker w (the last chunk). */
static void reply_snapshot(natsConnection *nc, const char *to, uint64_t w)
{
	struct kvr_msg_buf recs = {0}, rec = {0};
	kvr_test_put_fence(&rec, 7, 300, 7, 300, 0);
	kvr_test_put_record(&recs, &rec);
	reply_chunk(nc, to, 0, 0, &recs, 1);
	recs.len = rec.len = 0;
	kvr_test_put_rank(&rec, 7, 300, 0, w);
	kvr_test_put_record(&recs, &rec);
	reply_chunk(nc, to, 1, KVR_MSG_CHUNK_LAST, &recs, 1);
	kvr_msg_buf_fini(&recs);
	kvr_msg_buf_fini(&rec);
}

/* The joiner is ready, with provider 7's snapshot applied (worker w on its router). */
static void member_scene_applied(struct member_scene *sc, uint64_t w)
{
	int rc = sc->s ? kvr_sync_wait_ready(sc->s, 5000) : KVR_EINVAL;
	struct kvr_sync_stats st = {0};
	if (sc->s)
		kvr_sync_get_stats(sc->s, &st);
	struct kvr_rank_stats rs;
	CHECK(rc == 0, "not ready: %s", kvr_strerror(rc));
	CHECK(st.snapshots_applied == 1, "%llu snapshots applied",
	      (unsigned long long)st.snapshots_applied);
	CHECK(sc->r && kvr_rank_get_stats(sc->r, (struct kvr_rank_id){w, 0}, &rs) == 0,
	      "the snapshot's rank is missing");
}

static void member_scene_close(struct member_scene *sc)
{
	if (sc->s)
		kvr_sync_detach(sc->s);
	kvr_router_destroy(sc->r);
	natsSubscription_Destroy(sc->m);
	natsConnection_Destroy(sc->nc);
}

/* A joiner's snapshot request reaches the one member of the queue group, which answers late:
 * the copy sent again after an eighth of the budget reaches it too, and it declines that copy
 * at once (as a provider resyncing itself declines a joiner), then answers the first with a
 * snapshot naming worker 55.  The decline does not end the request: the snapshot is applied.
 * Before, the decline ended it, the answer went to an inbox nobody read, and the member, asked
 * again, said nothing more: the budget ran out with nothing applied. */
static void test_snapshot_decline(void)
{
	struct member_scene sc;
	member_scene_open(&sc, "decline", 1600); /* sent again every 200 ms */
	char first[128] = "";
	int copies = 0;
	for (double t0 = mono_ms(); sc.s && copies < 2 && mono_ms() - t0 < 1400;) {
		natsMsg *q = NULL;
		if (natsSubscription_NextMsg(&q, sc.m, 50) != NATS_OK)
			continue;
		const char *to = natsMsg_GetReply(q);
		if (to && copies++ == 0)
			snprintf(first, sizeof(first), "%s", to);
		else if (to)
			reply_chunk(sc.nc, to, 0, KVR_MSG_CHUNK_GIVEN_UP, NULL, 0);
		natsMsg_Destroy(q);
	}
	CHECK(copies == 2, "the member got %d copies", copies);
	if (copies == 2) {
		struct timespec ts = {0, 100000000};
		nanosleep(&ts, NULL);
		reply_snapshot(sc.nc, first, 55);
	}
	member_scene_applied(&sc, 55);
	member_scene_close(&sc);
}

/* A joiner's snapshot request reaches the one member of the queue group, which then leaves the
 * group before answering: the copy sent again after an eighth of the budget finds nobody (the
 * server's "no responders").  The first copy is still with the member, which answers it with a
 * snapshot naming worker 56: applied.  Before, the copy that found nobody ended the request
 * with KVR_ENOENT ("no peer is ready"), and the joiner started the cluster's knowledge alone,
 * the answer going to an inbox nobody read. */
static void test_snapshot_no_responders(void)
{
	struct member_scene sc;
	member_scene_open(&sc, "nobody", 1600); /* sent again every 200 ms */
	char to[128];
	if (member_scene_request(&sc, to, sizeof(to))) {
		CHECK(natsSubscription_Unsubscribe(sc.m) == NATS_OK &&
		          natsConnection_Flush(sc.nc) == NATS_OK,
		      "the member leaves");
		struct timespec ts = {0, 400000000}; /* past the copy sent again */
		nanosleep(&ts, NULL);
		reply_snapshot(sc.nc, to, 56);
	}
	member_scene_applied(&sc, 56);
	member_scene_close(&sc);
}

struct spam {
	natsConnection *nc;
	char to[128];
	atomic_bool stop;
};

/* Provider 8's first chunk to the inbox, every 5 ms until stopped: a provider not taken,
 * its replies closer together than the wait's 20 ms step. */
static void *spam_chunks(void *arg)
{
	struct spam *sp = arg;
	struct kvr_msg_buf b = {0};
	kvr_test_put_chunk(&b, 8, 300, 0, 0, NULL, 0);
	while (!atomic_load(&sp->stop) && !b.oom) {
		natsConnection_Publish(sp->nc, sp->to, b.p, (int)b.len);
		struct timespec ts = {0, 5000000};
		nanosleep(&ts, NULL);
	}
	kvr_msg_buf_fini(&b);
	return NULL;
}

/* The member answers a joiner's request with a first chunk, then nothing more; another
 * provider's chunks keep coming to the same inbox (ignored: provider 7 was taken).  They do
 * not restart the wait for provider 7's next chunk: the request ends within the budget.
 * Before, each of them restarted it, and the joiner waited as long as they came. */
static void test_snapshot_ignored(void)
{
	struct member_scene sc;
	member_scene_open(&sc, "ignored", 1000);
	struct spam sp = {.nc = sc.nc};
	pthread_t th;
	bool spamming = false;
	double t0 = mono_ms();
	if (member_scene_request(&sc, sp.to, sizeof(sp.to))) {
		struct kvr_msg_buf recs = {0}, rec = {0};
		kvr_test_put_fence(&rec, 7, 300, 7, 300, 0);
		kvr_test_put_record(&recs, &rec);
		reply_chunk(sc.nc, sp.to, 0, 0, &recs, 1);
		kvr_msg_buf_fini(&recs);
		kvr_msg_buf_fini(&rec);
		spamming = pthread_create(&th, NULL, spam_chunks, &sp) == 0;
	}
	int rc = sc.s ? kvr_sync_wait_ready(sc.s, 10000) : KVR_EINVAL;
	double ms = mono_ms() - t0;
	atomic_store(&sp.stop, true);
	if (spamming)
		pthread_join(th, NULL);
	CHECK(rc == 0, "not ready: %s", kvr_strerror(rc));
	/* The budget is 1 s; the spam goes on for as long as the joiner waits. */
	CHECK(ms < 4000, "ready after %.0f ms of another provider's chunks", ms);
	member_scene_close(&sc);
	printf("snapshot_ignored: ready %.0f ms after the first chunk of a 1,000 ms budget\n", ms);
}

static void test_dup_id(void)
{
	struct kvr_router *a = make_router(), *b = make_router();
	struct kvr_sync *sa = NULL, *sb = (struct kvr_sync *)1;
	CHECK(a && b && attach_id(a, "dupid", 5, &sa) == 0, "attach the first replica 5");
	int rc = attach_id(b, "dupid", 5, &sb);
	CHECK(rc == KVR_EEXIST && sb == NULL, "a second replica 5 in the cluster: %s (%s)",
	      kvr_strerror(rc), kvr_last_error());
	CHECK(rc != KVR_EEXIST || strstr(kvr_last_error(), "5"), "the detail names the id: %s",
	      kvr_last_error());
	if (rc == 0)
		kvr_sync_detach(sb);
	sb = NULL;
	struct kvr_sync *again = (struct kvr_sync *)1;
	rc = attach_id(a, "dupid", 5, &again);
	CHECK(rc == KVR_EBUSY && again == NULL, "the first router attached again: %s (%s)",
	      kvr_strerror(rc), kvr_last_error());
	CHECK(attach_id(b, "dupid2", 5, &sb) == 0, "replica 5 in another cluster");
	kvr_sync_detach(sb);
	sb = NULL;
	kvr_sync_detach(sa);
	CHECK(attach_id(b, "dupid", 5, &sb) == 0, "replica 5 again once the first detached");
	kvr_sync_detach(sb);
	/* A connection that holds the id's subject and never answers. */
	natsConnection *nc = NULL;
	natsSubscription *mute = NULL;
	CHECK(natsConnection_ConnectTo(&nc, kvr_test_nats_url()) == NATS_OK &&
	          natsConnection_SubscribeSync(&mute, nc, "dupid.id.9") == NATS_OK &&
	          natsConnection_Flush(nc) == NATS_OK,
	      "the mute holder");
	sb = NULL;
	double t0 = mono_ms();
	rc = attach_id(b, "dupid", 9, &sb);
	double took = mono_ms() - t0;
	CHECK(rc == KVR_EEXIST && sb == NULL, "replica 9 beside a mute holder: %s",
	      kvr_strerror(rc));
	if (rc == 0)
		kvr_sync_detach(sb);
	natsSubscription_Destroy(mute);
	natsConnection_Destroy(nc);
	kvr_router_destroy(a);
	kvr_router_destroy(b);
	printf("dup_id: refused beside a mute holder in %.0f ms\n", took);
}

/* Restarts the test's nats-server with this configuration, written to a temporary file made
 * from the mkstemp template path (restart_plain removes it).  Returns whether it runs with it. */
static bool restart_with(const char *conf, char *path)
{
	int fd = mkstemp(path);
	size_t n = strlen(conf);
	bool ok = fd >= 0 && write(fd, conf, n) == (ssize_t)n;
	if (fd >= 0)
		close(fd);
	kvr_test_nats_stop();
	kvr_test_nats_conf(ok ? path : NULL);
	return kvr_test_nats_start() == 0 && ok;
}

static void restart_plain(const char *path)
{
	kvr_test_nats_stop();
	kvr_test_nats_conf(NULL);
	unlink(path);
	CHECK(kvr_test_nats_start() == 0, "nats-server restarted without a configuration");
}

/* A replica of cluster "auth" on the current server, as user (NULL: none) with pass. */
static void auth_config(struct kvr_sync_config *c, uint64_t id, const char *user, const char *pass)
{
	kvr_sync_config_init(c);
	c->servers = kvr_test_nats_url();
	c->cluster = "auth";
	c->replica_id = id;
	c->user = user;
	c->password = pass;
}

/* One attach as replica 1 of cluster "auth" (auth_config). */
static int attach_as(const char *user, const char *pass, bool tls)
{
	struct kvr_router *r = make_router();
	struct kvr_sync_config c;
	auth_config(&c, 1, user, pass);
	c.tls = tls;
	struct kvr_sync *s = NULL;
	int rc = kvr_sync_attach(r, &c, &s);
	if (rc == 0)
		kvr_sync_detach(s);
	kvr_router_destroy(r);
	return rc;
}

/* A third party's answers to every question on the answer probe's subject (test_auth). */
static void third_party_answers(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                                void *closure)
{
	(void)sub, (void)closure;
	const char *reply = natsMsg_GetReply(msg);
	for (int i = 0; reply && i < 2; i++)
		natsConnection_Publish(nc, reply, "", 0);
	natsMsg_Destroy(msg);
}

/* A third party that republishes every question it sees on the answer probe's subject, with
 * its reply subject, 2,000 times (test_auth): each copy delivered to the answering connection
 * renews the server's allowance for that reply. */
static void third_party_copies(natsConnection *nc, natsSubscription *sub, natsMsg *msg,
                               void *closure)
{
	(void)sub, (void)closure;
	const char *reply = natsMsg_GetReply(msg);
	for (int i = 0; reply && i < 2000; i++)
		natsConnection_PublishRequest(nc, natsMsg_GetSubject(msg), reply, "", 0);
	natsMsg_Destroy(msg);
}

/* Unsubscribed, flushed, then destroyed: nats.c 3.4.1 can abort taking a message for a
 * subscription being destroyed (nats.c#637; sync/replica_nats.c sub_close). */
static void third_party_close(natsConnection *tp, natsSubscription *sub)
{
	if (sub && natsSubscription_Unsubscribe(sub) == NATS_OK)
		natsConnection_FlushTimeout(tp, 2000);
	natsSubscription_Destroy(sub);
}

static void test_auth(void)
{
	static const char conf[] =
	    "authorization {\n"
	    "  users = [\n"
	    "    {user: kvr, password: secret}\n"
	    "    {user: deaf, password: p, permissions: {subscribe: {deny: [\"auth.stream\"]}}}\n"
	    "    {user: mute, password: p, permissions: {publish: {deny: [\"auth.id.>\"]}}}\n"
	    "    {user: noinbox, password: p, permissions: {subscribe: {deny: [\"_INBOX.>\"]}}}\n"
	    "    {user: hoarse, password: p, permissions: {publish: {deny: [\"auth.stream\"]}}}\n"
	    "    {user: noreply, password: p, permissions: {publish: {deny: [\"_INBOX.>\"]}}}\n"
	    "    {user: responder, password: p, permissions: {publish: {allow: [\"auth.>\"]}, "
	    "subscribe: {allow: [\"auth.>\", \"_INBOX.>\"]}, "
	    "allow_responses: {max: 100000, expires: \"1m\"}}}\n"
	    "    {user: oneanswer, password: p, permissions: {publish: {allow: [\"auth.>\"]}, "
	    "subscribe: {allow: [\"auth.>\", \"_INBOX.>\"]}, allow_responses: true}}\n"
	    "  ]\n"
	    "}\n";
	char path[] = "/tmp/kvr-nats-conf-XXXXXX";
	CHECK(restart_with(conf, path), "nats-server with users");
	static const struct {
		const char *user, *pass, *detail;
	} cases[] = {
	    {NULL, NULL, "credentials"},
	    {"kvr", "wrong", "credentials"},
	    {"deaf", "p", "does not permit"},
	    {"mute", "p", "does not permit"},
	    {"noinbox", "p", "does not permit"},
	    {"noreply", "p", "does not permit"},
	    /* May answer what it is asked (allow_responses, up to 100,000 messages an ask: a
	     * snapshot's chunks), never publish on an inbox unasked: what a replica needs. */
	    {"responder", "p", NULL},
	    /* allow_responses: true is one message an ask: a snapshot of two chunks would lose
	     * its second. */
	    {"oneanswer", "p", "does not permit"},
	    {"kvr", "secret", NULL},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		double t0 = mono_ms();
		int rc = attach_as(cases[i].user, cases[i].pass, false);
		double took = mono_ms() - t0;
		int want = cases[i].detail ? KVR_EINVAL : 0;
		CHECK(rc == want && (!rc || strstr(kvr_last_error(), cases[i].detail)),
		      "attach as %s/%s: %s (%s), want %s", cases[i].user ? cases[i].user : "nobody",
		      cases[i].pass ? cases[i].pass : "-", kvr_strerror(rc),
		      rc ? kvr_last_error() : "", kvr_strerror(want));
		printf("auth: as %s/%s: %s in %.0f ms\n", cases[i].user ? cases[i].user : "nobody",
		       cases[i].pass ? cases[i].pass : "-", kvr_strerror(rc), took);
	}
	/* A third party that answers the attach's answer probe (any connection allowed to
	 * subscribe on <cluster>.probe.> and publish on inboxes): its answers must not stand in
	 * for the ones the server refused the user.  Before, the probe counted the answers it
	 * received, and one of ours plus one of the third party's let a user under
	 * allow_responses: true (one message an ask) attach. */
	{
		natsOptions *o = NULL;
		natsConnection *tp = NULL;
		natsSubscription *sub = NULL;
		CHECK(natsOptions_Create(&o) == NATS_OK &&
		          natsOptions_SetUserInfo(o, "kvr", "secret") == NATS_OK &&
		          natsOptions_SetURL(o, kvr_test_nats_url()) == NATS_OK &&
		          /* Without it the copier heard its own copies and copied them again,
		           * without end, and nats.c 3.4.1 aborted when the subscription was
		           * destroyed under that storm (nats.c#637: 3 runs in ~40 under load). */
		          natsOptions_SetNoEcho(o, true) == NATS_OK &&
		          natsConnection_Connect(&tp, o) == NATS_OK &&
		          natsConnection_Subscribe(&sub, tp, "auth.probe.>", third_party_answers,
		                                   NULL) == NATS_OK &&
		          natsConnection_FlushTimeout(tp, 2000) == NATS_OK,
		      "the third party listens on the probe's subject");
		int rc = attach_as("oneanswer", "p", false);
		CHECK(rc == KVR_EINVAL && strstr(kvr_last_error(), "does not permit"),
		      "attach as oneanswer with a third party answering the probe: %s (%s)",
		      kvr_strerror(rc), rc ? kvr_last_error() : "");
		rc = attach_as("responder", "p", false);
		CHECK(rc == 0,
		      "attach as responder with a third party answering the probe: %s (%s)",
		      kvr_strerror(rc), rc ? kvr_last_error() : "");
		printf("auth: with a third party answering the probe: oneanswer refused, responder "
		       "attached\n");
		/* One that copies our questions instead: a copy delivered between the two answers
		 * renewed the allowance, and before, 9 of 50 attaches as oneanswer went through
		 * (the review's probe); now a copy seen leaves no verdict (refused). */
		third_party_close(tp, sub);
		sub = NULL;
		CHECK(natsConnection_Subscribe(&sub, tp, "auth.probe.>", third_party_copies,
		                               NULL) == NATS_OK &&
		          natsConnection_FlushTimeout(tp, 2000) == NATS_OK,
		      "the copier listens");
		int let_in = 0;
		for (int i = 0; i < 30; i++)
			let_in += attach_as("oneanswer", "p", false) == 0;
		CHECK(let_in == 0,
		      "a third party copying the probe's questions let oneanswer attach "
		      "%d times of 30",
		      let_in);
		printf(
		    "auth: with a third party copying the probe's questions: oneanswer attached 0 "
		    "of 30\n");
		third_party_close(tp, sub);
		natsConnection_Destroy(tp);
		natsOptions_Destroy(o);
	}
	/* Publishing on the stream refused after the attach: counted. */
	struct kvr_router *r = make_router();
	struct kvr_sync_config c;
	auth_config(&c, 2, "hoarse", "p");
	struct kvr_sync *s = NULL;
	CHECK(r && kvr_sync_attach(r, &c, &s) == 0, "attach as hoarse: %s", kvr_last_error());
	struct kvr_sync_stats st = {0};
	for (int k = 0; s && k < 250 && !st.denied; k++) {
		sleep_ms(20); /* its heartbeats are refused */
		kvr_sync_get_stats(s, &st);
	}
	CHECK(st.denied >= 1, "publishes the server refused not counted (%llu)",
	      (unsigned long long)st.denied);
	static char page[1 << 20];
	size_t len = 0;
	CHECK(kvr_metrics_render(r, page, sizeof(page), &len) == 0 &&
	          strstr(page, "kvr_sync_events_total{what=\"denied\"} "),
	      "the metrics page shows denied");
	printf("auth: as hoarse: %llu publishes refused, counted\n", (unsigned long long)st.denied);
	kvr_sync_detach(s);
	kvr_router_destroy(r);
	restart_plain(path);
	/* TLS asked of a server that offers none. */
	int rc = attach_as(NULL, NULL, true);
	CHECK(rc == KVR_EINVAL && strstr(kvr_last_error(), "TLS"), "attach with tls: %s (%s)",
	      kvr_strerror(rc), rc ? kvr_last_error() : "");
}

/* Whether a message published on server a reaches a subscriber on server b within 5 s: both
 * listen and the route between them is up (as user responder, who may publish and subscribe
 * auth.>). */
static bool routed(const char *a, const char *b)
{
	natsConnection *na = NULL, *nb = NULL;
	natsSubscription *sub = NULL;
	natsOptions *o = NULL;
	bool ok = false;
	if (natsOptions_Create(&o) != NATS_OK || natsOptions_SetUserInfo(o, "responder", "p") ||
	    natsOptions_SetURL(o, a) || natsConnection_Connect(&na, o) ||
	    natsOptions_SetURL(o, b) || natsConnection_Connect(&nb, o) ||
	    natsConnection_SubscribeSync(&sub, nb, "auth.route") ||
	    natsConnection_FlushTimeout(nb, 2000))
		goto out;
	for (int i = 0; i < 100 && !ok; i++) {
		natsMsg *m = NULL;
		natsConnection_PublishString(na, "auth.route", "");
		ok = natsSubscription_NextMsg(&m, sub, 50) == NATS_OK;
		natsMsg_Destroy(m);
	}
out:
	natsSubscription_Destroy(sub);
	natsConnection_Destroy(nb);
	natsConnection_Destroy(na);
	natsOptions_Destroy(o);
	return ok;
}

/* A user under allow_responses (no publish on _INBOX.>) on a cluster of two servers.  The
 * attach's answer probe (answer_check) asks a second connection of the user, which may land on
 * the other server: its subscription reaches the replica's server over the route a moment
 * after its own server has it, and a question asked meanwhile found nobody ("no responders"):
 * the attach refused a user that works, KVR_EINVAL in ~18 ms, 4 to 7 of 600 attaches
 * (nats-server 2.9.10, two servers on loopback). */
static void test_auth_cluster(void)
{
	static const char users[] =
	    "authorization {\n"
	    "  users = [\n"
	    "    {user: responder, password: p, permissions: {publish: {allow: [\"auth.>\"]}, "
	    "subscribe: {allow: [\"auth.>\", \"_INBOX.>\"]}, "
	    "allow_responses: {max: 100000, expires: \"1m\"}}}\n"
	    "  ]\n"
	    "}\n";
	int ra = kvr_test_free_port(), rb = kvr_test_free_port(), pb = kvr_test_free_port();
	CHECK(ra > 0 && rb > 0 && pb > 0, "free ports");
	char conf_a[1024], conf_b[1024], url_b[64], servers[160];
	snprintf(conf_a, sizeof(conf_a),
	         "%scluster { name: kvr, listen: \"127.0.0.1:%d\", routes: "
	         "[\"nats://127.0.0.1:%d\"] }\n",
	         users, ra, rb);
	snprintf(conf_b, sizeof(conf_b),
	         "%scluster { name: kvr, listen: \"127.0.0.1:%d\", routes: "
	         "[\"nats://127.0.0.1:%d\"] }\n",
	         users, rb, ra);
	snprintf(url_b, sizeof(url_b), "nats://127.0.0.1:%d", pb);
	char path_a[] = "/tmp/kvr-nats-conf-XXXXXX", path_b[] = "/tmp/kvr-nats-conf-XXXXXX";
	CHECK(restart_with(conf_a, path_a), "nats-server A of the cluster");
	snprintf(servers, sizeof(servers), "%s,%s", kvr_test_nats_url(), url_b);
	int fd = mkstemp(path_b);
	CHECK(fd >= 0 && write(fd, conf_b, strlen(conf_b)) == (ssize_t)strlen(conf_b),
	      "server B's configuration");
	if (fd >= 0)
		close(fd);
	char port_b[16];
	snprintf(port_b, sizeof(port_b), "%d", pb);
	pid_t b = fork();
	if (b == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		int dn = open("/dev/null", O_WRONLY);
		dup2(dn, 1);
		dup2(dn, 2);
		execlp("nats-server", "nats-server", "-c", path_b, "-a", "127.0.0.1", "-p", port_b,
		       (char *)NULL);
		_exit(127);
	}
	bool up = false; /* B listening, and the route up both ways */
	for (int i = 0; b > 0 && i < 50 && !up; i++) {
		up = routed(kvr_test_nats_url(), url_b) && routed(url_b, kvr_test_nats_url());
		if (!up)
			sleep_ms(100);
	}
	CHECK(up, "nats-server B did not start or route to A");
	/* 200 attaches or 8 s, whichever comes first: under ThreadSanitizer an attach takes
	 * ~100 ms, and the whole binary must stay within its 180 s (before the fix 200 attaches
	 * met the refusal in most runs: 4 to 7 in 600). */
	int refused = 0, n = 0;
	double t0 = mono_ms();
	for (int i = 0; up && i < 200 && mono_ms() - t0 < 8000; i++, n++) {
		struct kvr_router *r = make_router();
		struct kvr_sync_config c;
		auth_config(&c, 1000 + (uint64_t)i, "responder", "p");
		c.servers = servers;
		struct kvr_sync *s = NULL;
		int rc = kvr_sync_attach(r, &c, &s);
		if (rc && refused++ == 0)
			fprintf(stderr, "auth_cluster: attach %d: %s (%s)\n", i, kvr_strerror(rc),
			        kvr_last_error());
		if (rc == 0)
			kvr_sync_detach(s);
		kvr_router_destroy(r);
	}
	CHECK(refused == 0,
	      "a user under allow_responses on two servers: %d of %d attaches refused", refused, n);
	printf("auth_cluster: %d of %d attaches refused\n", refused, n);
	if (b > 0) {
		kill(b, SIGKILL);
		waitpid(b, NULL, 0);
	}
	unlink(path_b);
	restart_plain(path_a);
}

static uint64_t active_blocks(struct kvr_router *r, uint64_t *reqs)
{
	uint64_t b = 0;
	*reqs = 0;
	for (uint64_t w = 0; w < N_RANKS; w++) {
		struct kvr_rank_stats st;
		if (kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &st) == 0) {
			b += st.active_blocks;
			*reqs += st.active_requests;
		}
	}
	return b;
}

static void test_max_payload(void)
{
	static const char conf[] = "max_payload: 65536\n";
	char path[] = "/tmp/kvr-nats-conf-XXXXXX";
	CHECK(restart_with(conf, path), "nats-server with max_payload 64 KiB");
	struct replica xs[3] = {0};
	for (int i = 0; i < 2; i++) {
		xs[i].r = make_router();
		CHECK(attach(&xs[i], (uint64_t)i + 81) == 0, "attach %d", i);
	}
	static uint32_t t[131072], out[40000];
	uint64_t att[10] = {0};
	struct kvr_request q;
	struct kvr_decision d;
	for (int k = 0; k < 8; k++) { /* 2,500 blocks each: one batch of them is 160 KB */
		prompt(t, 40000, 9100u + (uint32_t)k);
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 40000;
		CHECK(kvr_route(xs[0].r, &q, &d) == 0, "route %d", k);
		att[k] = d.attempt;
	}
	for (size_t i = 0; i < 40000; i++)
		out[i] = 500000u + (uint32_t)i;
	CHECK(kvr_request_output(xs[0].r, att[0], out, 40000) == 0, "40,000 output tokens");
	CHECK(kvr_sync_drain(xs[0].s, 5000) == 0 && kvr_router_sync(xs[0].r, 5000) == 0, "drain A");
	uint64_t ra = 0, rb = 0, ba = 0, bb = 0;
	for (int k = 0; k < 250; k++) {
		kvr_sync_drain(xs[1].s, 100);
		kvr_router_sync(xs[1].r, 1000);
		ba = active_blocks(xs[0].r, &ra);
		bb = active_blocks(xs[1].r, &rb);
		if (ra == rb && ba == bb)
			break;
		sleep_ms(20);
	}
	CHECK(ra == 8 && rb == 8 && ba == bb,
	      "the peer's load: A %llu requests %llu blocks, B %llu requests %llu blocks",
	      (unsigned long long)ra, (unsigned long long)ba, (unsigned long long)rb,
	      (unsigned long long)bb);
	/* 8,192 blocks: 64 KiB of hashes alone. */
	prompt(t, 131072, 9200u);
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 131072;
	CHECK(kvr_route(xs[0].r, &q, &d) == 0, "route the big one");
	att[8] = d.attempt;
	prompt(t, 64, 9300u);
	q.n_tokens = 64;
	CHECK(kvr_route(xs[0].r, &q, &d) == 0, "route a small one after it");
	att[9] = d.attempt;
	struct kvr_sync_stats sa = {0}, sb = {0};
	for (int k = 0; k < 250 && sb.mirrored < 10; k++) {
		sleep_ms(20);
		kvr_sync_get_stats(xs[0].s, &sa);
		kvr_sync_get_stats(xs[1].s, &sb);
	}
	CHECK(sa.truncated == 1 && sa.oversized == 0 && sb.mirrored == 10,
	      "the big admission: A truncated %llu oversized %llu, B mirrors %u (want 10)",
	      (unsigned long long)sa.truncated, (unsigned long long)sa.oversized, sb.mirrored);
	static char page[1 << 20];
	size_t plen = 0;
	CHECK(kvr_metrics_render(xs[0].r, page, sizeof(page), &plen) == 0 &&
	          strstr(page, "kvr_sync_events_total{what=\"truncated\"} 1\n"),
	      "A's metrics page shows the truncated admission");
	/* What B holds of it: the prefix that fit, no more (an unknown chain: no tail). */
	uint64_t ra2 = 0, rb2 = 0;
	kvr_router_sync(xs[1].r, 1000);
	uint64_t ba2 = active_blocks(xs[0].r, &ra2), bb2 = active_blocks(xs[1].r, &rb2);
	const uint64_t fit = (65536 - 32 - 72) / 8; /* 8,179 */
	CHECK(ra2 == 10 && rb2 == 10 && bb2 == ba2 - (8192 - fit),
	      "after the big one: A %llu requests %llu blocks, B %llu requests %llu blocks (want "
	      "A's less %llu)",
	      (unsigned long long)ra2, (unsigned long long)ba2, (unsigned long long)rb2,
	      (unsigned long long)bb2, (unsigned long long)(8192 - fit));
	/* A joiner's snapshot: attempt 0 (20 KB of hashes and 160 KB of output) and the big one
	 * fit no chunk whole. */
	xs[2].r = make_router();
	double t0 = mono_ms();
	int rc = attach(&xs[2], 83);
	double took = mono_ms() - t0;
	struct kvr_sync_stats sc = {0};
	if (rc == 0)
		kvr_sync_get_stats(xs[2].s, &sc);
	CHECK(rc == 0 && sc.mirrored == 10, "the joiner: %s, mirrors %u (want 10)",
	      kvr_strerror(rc), sc.mirrored);
	printf("max_payload: peer mirrors %u, %llu blocks on both before the big one (%llu of A's "
	       "%llu after it); big one truncated %llu; joiner ready in %.0f ms mirroring %u\n",
	       sb.mirrored, (unsigned long long)bb, (unsigned long long)bb2,
	       (unsigned long long)ba2, (unsigned long long)sa.truncated, took, sc.mirrored);
	for (int k = 0; k < 10; k++)
		kvr_request_finish(xs[0].r, att[k]);
	/* Every attempt, cut or whole, ends on the peers as on A. */
	uint64_t left[3] = {1, 1, 1}, lb[3] = {0};
	for (int k = 0; k < 250 && (left[1] || left[2]); k++) {
		sleep_ms(20);
		for (int i = 1; i < 3; i++) {
			kvr_router_sync(xs[i].r, 1000);
			lb[i] = active_blocks(xs[i].r, &left[i]);
		}
	}
	CHECK(left[1] == 0 && left[2] == 0 && lb[1] == 0 && lb[2] == 0,
	      "after the finishes: B %llu requests %llu blocks, the joiner %llu, %llu",
	      (unsigned long long)left[1], (unsigned long long)lb[1], (unsigned long long)left[2],
	      (unsigned long long)lb[2]);
	for (int i = 0; i < 3; i++) {
		if (xs[i].s)
			kvr_sync_detach(xs[i].s);
		kvr_router_destroy(xs[i].r);
	}
	restart_plain(path);
}

static void test_detach_down(void)
{
	struct replica x = {0};
	x.r = make_router();
	CHECK(attach(&x, 91) == 0, "attach");
	kvr_test_nats_stop();
	struct kvr_sync_stats st = {.connected = true};
	for (int k = 0; k < 250 && st.connected; k++) {
		sleep_ms(20);
		kvr_sync_get_stats(x.s, &st);
	}
	CHECK(!st.connected, "the replica saw the server go");
	double t0 = mono_ms();
	kvr_sync_detach(x.s);
	double took = mono_ms() - t0;
	CHECK(took < 450, "kvr_sync_detach with the server down took %.0f ms", took);
	kvr_router_destroy(x.r);
	CHECK(kvr_test_nats_start() == 0, "nats-server restarted");
	/* The server gone while the replica asks for its snapshot or subscribes for its peers'
	 * requests: a flush begun then waited nats.c's 10 s default, and the detach with it.  What
	 * is left is nats.c's close waiting out its reconnect thread's pause (reconnect wait 100 ms
	 * plus up to 100 ms of jitter): 20-200 ms. */
	double worst = 0;
	for (int round = 0; round < 8; round++) {
		struct replica y = {0};
		y.r = make_router();
		CHECK(y.r && attach_id(y.r, "t", 92, &y.s) == 0, "attach");
		sleep_ms(round / 2); /* 0-3 ms: before, during and after its first request */
		kvr_test_nats_stop();
		t0 = mono_ms();
		kvr_sync_detach(y.s);
		double t = mono_ms() - t0;
		worst = t > worst ? t : worst;
		CHECK(t < 450, "round %d: kvr_sync_detach just after the server went took %.0f ms",
		      round, t);
		kvr_router_destroy(y.r);
		CHECK(kvr_test_nats_start() == 0, "nats-server restarted");
	}
	printf("detach_down: %.1f ms once it saw the server go, %.1f ms at worst as it went\n",
	       took, worst);
}

extern char **environ;

/* The replica process of test_spawn (test_sync_nats --spawn-victim URL): attaches alone in
 * cluster "spawn", spawns `sleep 30` as a host would run a program, prints its pid and dies. */
static int spawn_victim(const char *url)
{
	struct kvr_router *r = make_router();
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = url;
	c.cluster = "spawn";
	c.replica_id = 7;
	struct kvr_sync *s = NULL;
	if (!r || kvr_sync_attach(r, &c, &s) != 0 || kvr_sync_wait_ready(s, 8000) != 0)
		return 1;
	pid_t kid;
	char *av[] = {"sleep", "30", NULL};
	if (posix_spawnp(&kid, "sleep", NULL, NULL, av, environ) != 0)
		return 1;
	printf("%d\n", (int)kid);
	fflush(stdout);
	raise(SIGKILL);
	return 1;
}

static void test_spawn(void)
{
	int before = sockets_inherited();
	struct kvr_router *r = make_router();
	struct kvr_sync *s = NULL;
	CHECK(r && attach_slow_snapshots(r, "spawn-self", &s) == 0, "attach");
	int after = sockets_inherited();
	CHECK(after == before, "the attach left %d sockets a spawned program inherits",
	      after - before);
	kvr_sync_detach(s);
	kvr_router_destroy(r);

	int p[2];
	CHECK(pipe(p) == 0, "pipe");
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, p[1], 1);
	posix_spawn_file_actions_addclose(&fa, p[0]);
	char *av[] = {"test_sync_nats", "--spawn-victim", (char *)kvr_test_nats_url(), NULL};
	pid_t victim;
	int rc = posix_spawn(&victim, "/proc/self/exe", &fa, NULL, av, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(p[1]);
	CHECK(rc == 0, "spawn the replica process: %s", strerror(rc));
	if (rc) {
		close(p[0]);
		return;
	}
	FILE *f = fdopen(p[0], "r");
	int kid = 0;
	bool got = f && fscanf(f, "%d", &kid) == 1 && kid > 0;
	if (f)
		fclose(f);
	int ws = 0;
	waitpid(victim, &ws, 0);
	CHECK(got && WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL,
	      "the replica process spawned its program and died (status %#x)", ws);
	if (!got)
		return;
	r = make_router();
	s = NULL;
	double took = -1;
	CHECK(r && attach_slow_snapshots(r, "spawn", &s) == 0, "attach after the dead one");
	if (s) {
		double t0 = mono_ms();
		rc = kvr_sync_wait_ready(s, 8000);
		took = mono_ms() - t0;
		CHECK(rc == 0, "not ready after 8 s beside the dead replica's spawned program: %s",
		      kvr_strerror(rc));
		kvr_sync_detach(s);
	}
	kvr_router_destroy(r);
	kill(kid, SIGKILL);
	printf("spawn: %d sockets inherited after an attach; ready beside a dead replica's spawned "
	       "program in %.1f ms\n",
	       after - before, took);
}

int main(int argc, char **argv)
{
	if (argc > 2 && strcmp(argv[1], "--spawn-victim") == 0)
		return spawn_victim(argv[2]);
	if (argc > 1)
		rng = strtoull(argv[1], NULL, 0) | 1;
	if (argc > 2)
		pace_us = (unsigned)atoi(argv[2]);
	if (!kvr_test_nats_installed()) {
		printf("nats-server not installed: skipped\n");
		return 77;
	}
	signal(SIGPIPE, SIG_IGN);
	if (kvr_test_nats_start()) {
		fprintf(stderr, "could not start nats-server\n");
		kvr_test_nats_stop();
		return 1;
	}
	printf("seed %lu, nats-server on %s\n", (unsigned long)rng, kvr_test_nats_url());
	if (!(argc > 3) || strcmp(argv[3], "fd_limit") == 0)
		test_fd_limit();
	if (kill_fork()) {
		fprintf(stderr, "fork failed\n");
		kvr_test_nats_stop();
		return 1;
	}
	const char *only = argc > 3 ? argv[3] : NULL; /* one test by name: "false_death" */
#define RUN(name)                                                                                  \
	do {                                                                                       \
		if (!only || strcmp(only, #name) == 0)                                             \
			test_##name();                                                             \
	} while (0)
	RUN(three);
	RUN(pressure);
	RUN(false_death);
	RUN(kill);
	RUN(expire);
	RUN(oom);
	RUN(queued_drop);
	RUN(outage);
	RUN(trace);
	RUN(wire);
	RUN(callbacks);
	RUN(signals);
	RUN(router_first);
	RUN(snapshot_wait);
	RUN(snapshot_decline);
	RUN(snapshot_no_responders);
	RUN(snapshot_ignored);
	RUN(spawn);
	RUN(dup_id);
	RUN(auth);
	RUN(auth_cluster);
	RUN(max_payload);
	RUN(detach_down);
#undef RUN
	kvr_test_nats_stop();
	printf("%s (%d failures)\n", fails ? "FAIL" : "PASS", fails);
	return fails ? 1 : 0;
}
