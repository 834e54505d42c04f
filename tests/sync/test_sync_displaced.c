/*
 * tests/sync/test_sync_displaced.c - a replica id taken while its holder was reconnecting, over a
 * real nats-server (kvr_sync_stats.displaced).
 *
 * kvr_sync_attach refuses an id whose holder answers on <cluster>.id.<id>, but a holder that is
 * reconnecting cannot answer: the id is given again.  Replica A reaches the server through a
 * relay in this program; the relay cuts A off (and refuses its reconnects), B attaches under
 * A's id straight to the server (accepted: nobody answers for the id), then the relay lets A
 * back.  Now two replicas publish under one id.  Peers follow the newer life (the larger epoch:
 * B's) and drop A's messages, so A's decisions no longer reach them.  Checked:
 *  - A reports displaced (and displacements 1) once back, B does not; each counts the other's
 *    messages as forged;
 *  - peer C mirrors B's attempts, not A's;
 *  - at B's detach (its goodbye) A is no longer displaced, and C mirrors A's attempts again (a
 *    new life of the id, re-announced on C's request).
 * Before, nothing but the forged counters said so, and not which of the two to detach.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"
#include "tests/common/check.h"
#include "tests/common/mono_clock.h"
#include "tests/common/nats_server.h"

/* ---------------------------------------------------------------- a relay that can cut */

#define MAX_PAIRS 8

static struct {
	int listen_fd;
	int server_port;
	int cut; /* set: relayed connections are closed, new ones refused (closed at once) */
	int stop;
	pthread_t thread;
	int pairs[MAX_PAIRS][2]; /* client, server; -1 unused */
} relay;

static int connect_server(void)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_in a = {.sin_family = AF_INET,
	                        .sin_port = htons((uint16_t)relay.server_port)};
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0)
		return fd;
	if (fd >= 0)
		close(fd);
	return -1;
}

static void close_pair(int i)
{
	close(relay.pairs[i][0]);
	close(relay.pairs[i][1]);
	relay.pairs[i][0] = relay.pairs[i][1] = -1;
}

static void *relay_main(void *arg)
{
	(void)arg;
	char buf[65536];
	while (!__atomic_load_n(&relay.stop, __ATOMIC_ACQUIRE)) {
		bool cut = __atomic_load_n(&relay.cut, __ATOMIC_ACQUIRE);
		struct pollfd p[1 + 2 * MAX_PAIRS];
		int who[1 + 2 * MAX_PAIRS];
		int n = 0;
		p[n] = (struct pollfd){.fd = relay.listen_fd, .events = POLLIN};
		who[n++] = -1;
		for (int i = 0; i < MAX_PAIRS; i++) {
			if (relay.pairs[i][0] < 0)
				continue;
			if (cut) {
				close_pair(i);
				continue;
			}
			for (int k = 0; k < 2; k++) {
				p[n] = (struct pollfd){.fd = relay.pairs[i][k], .events = POLLIN};
				who[n++] = 2 * i + k;
			}
		}
		if (poll(p, (nfds_t)n, 20) <= 0)
			continue;
		for (int j = 0; j < n; j++) {
			if (!(p[j].revents & (POLLIN | POLLHUP | POLLERR)))
				continue;
			if (who[j] < 0) {
				int c = accept4(relay.listen_fd, NULL, NULL, SOCK_CLOEXEC);
				if (c < 0)
					continue;
				int s = cut ? -1 : connect_server();
				int slot = -1;
				for (int i = 0; i < MAX_PAIRS && s >= 0; i++)
					if (relay.pairs[i][0] < 0) {
						slot = i;
						break;
					}
				if (slot < 0) {
					close(c);
					if (s >= 0)
						close(s);
					continue;
				}
				relay.pairs[slot][0] = c;
				relay.pairs[slot][1] = s;
				continue;
			}
			int i = who[j] / 2, k = who[j] % 2;
			if (relay.pairs[i][0] < 0)
				continue;
			ssize_t got = read(relay.pairs[i][k], buf, sizeof(buf));
			bool ok = got > 0;
			for (ssize_t off = 0; ok && off < got;) {
				ssize_t w =
				    write(relay.pairs[i][1 - k], buf + off, (size_t)(got - off));
				if (w <= 0 && errno != EINTR)
					ok = false;
				off += w > 0 ? w : 0;
			}
			if (!ok)
				close_pair(i);
		}
	}
	for (int i = 0; i < MAX_PAIRS; i++)
		if (relay.pairs[i][0] >= 0)
			close_pair(i);
	return NULL;
}

/* Starts the relay to the test server; writes its URL to url. */
static bool relay_start(char *url, size_t room)
{
	const char *s = kvr_test_nats_url(); /* nats://127.0.0.1:PORT */
	const char *colon = strrchr(s, ':');
	relay.server_port = colon ? atoi(colon + 1) : 0;
	for (int i = 0; i < MAX_PAIRS; i++)
		relay.pairs[i][0] = relay.pairs[i][1] = -1;
	relay.listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_in a = {.sin_family = AF_INET};
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	socklen_t len = sizeof(a);
	if (relay.listen_fd < 0 || bind(relay.listen_fd, (struct sockaddr *)&a, sizeof(a)) ||
	    listen(relay.listen_fd, 8) || getsockname(relay.listen_fd, (struct sockaddr *)&a, &len))
		return false;
	snprintf(url, room, "nats://127.0.0.1:%d", ntohs(a.sin_port));
	return pthread_create(&relay.thread, NULL, relay_main, NULL) == 0;
}

static void relay_stop(void)
{
	__atomic_store_n(&relay.stop, 1, __ATOMIC_RELEASE);
	pthread_join(relay.thread, NULL);
	close(relay.listen_fd);
}

/* ---------------------------------------------------------------- replicas */

static struct kvr_router *make_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r = NULL;
	CHECK(kvr_router_create(&c, &r) == 0, "router");
	for (uint64_t w = 0; w < 4; w++)
		kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 100000, 8192);
	return r;
}

static struct kvr_sync *attach(struct kvr_router *r, const char *servers, uint64_t id, int *rc)
{
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = servers;
	c.cluster = "disp";
	c.replica_id = id;
	struct kvr_sync *s = NULL;
	*rc = kvr_sync_attach(r, &c, &s);
	return s;
}

static struct kvr_sync_stats stats(struct kvr_sync *s)
{
	struct kvr_sync_stats st;
	memset(&st, 0, sizeof(st));
	kvr_sync_get_stats(s, &st);
	return st;
}

/* Routes one distinct 64-token request on r (kept live); returns its attempt. */
static uint64_t route_one(struct kvr_router *r, uint32_t k)
{
	uint32_t t[64];
	for (uint32_t i = 0; i < 64; i++)
		t[i] = k * 7919u + i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = 64;
	struct kvr_decision d;
	CHECK(kvr_route(r, &q, &d) == 0, "route");
	return d.attempt;
}

/* Waits up to ms for cond(s) to hold. */
#define WAIT_FOR(ms, cond)                                                                         \
	do {                                                                                       \
		double t0_ = (double)now_ms();                                                     \
		while (!(cond) && (double)now_ms() - t0_ < (ms))                                   \
			usleep(10000);                                                             \
	} while (0)

int main(void)
{
	if (!kvr_test_nats_installed()) {
		printf("nats-server not installed: skipped\n");
		return 77;
	}
	check_deadline(110);
	signal(SIGPIPE, SIG_IGN);
	if (kvr_test_nats_start()) {
		fprintf(stderr, "could not start nats-server\n");
		return 1;
	}
	char via[64];
	CHECK(relay_start(via, sizeof(via)), "relay");
	int rc;
	struct kvr_router *ra = make_router(), *rb = make_router(), *rc_ = make_router();
	struct kvr_sync *a = attach(ra, via, 7, &rc);
	CHECK(rc == 0, "A attaches through the relay: %s", kvr_strerror(rc));
	struct kvr_sync *c = attach(rc_, kvr_test_nats_url(), 9, &rc);
	CHECK(rc == 0, "C attaches: %s", kvr_strerror(rc));
	struct kvr_sync *b = attach(rb, kvr_test_nats_url(), 7, &rc);
	CHECK(rc == KVR_EEXIST && !b, "B under A's id while A is heard: %s", kvr_strerror(rc));

	/* A is cut off and cannot reconnect. */
	__atomic_store_n(&relay.cut, 1, __ATOMIC_RELEASE);
	WAIT_FOR(5000, !stats(a).connected);
	CHECK(!stats(a).connected, "A noticed the cut");
	b = attach(rb, kvr_test_nats_url(), 7, &rc);
	CHECK(rc == 0 && b, "B under A's id while A reconnects (nobody answers): %s",
	      kvr_strerror(rc));
	__atomic_store_n(&relay.cut, 0, __ATOMIC_RELEASE);
	WAIT_FOR(5000, stats(a).connected);
	CHECK(stats(a).connected, "A is back");
	double back = (double)now_ms();
	/* A's first request after the reconnect, a snapshot, may go to B, which declines it at
	 * once (our id on it is forged there) so that A asks again; before, B dropped it and A's
	 * messages waited out snapshot_timeout_ms (2 s) behind it. */
	WAIT_FOR(8000, stats(a).displaced);
	double took = (double)now_ms() - back;
	struct kvr_sync_stats sa = stats(a), sb = b ? stats(b) : (struct kvr_sync_stats){0};
	CHECK(sa.displaced && sa.displacements == 1, "A displaced %d (%lu times)", sa.displaced,
	      (unsigned long)sa.displacements);
	CHECK(!sb.displaced && sb.displacements == 0, "B displaced %d", sb.displaced);
	WAIT_FOR(2000, stats(b).forged > 0);
	sa = stats(a);
	sb = stats(b);
	CHECK(sa.forged > 0 && sb.forged > 0, "forged: A %lu, B %lu", (unsigned long)sa.forged,
	      (unsigned long)sb.forged);
	printf("displaced: A told in %.0f ms; forged A %lu B %lu\n", took, (unsigned long)sa.forged,
	       (unsigned long)sb.forged);

	/* C follows B: B's attempt is mirrored there, A's is not. */
	uint64_t xa = route_one(ra, 1), xb = route_one(rb, 2);
	WAIT_FOR(3000, stats(c).mirrored >= 1);
	usleep(300000); /* room for A's admission to arrive too, if it were taken */
	struct kvr_sync_stats sc = stats(c);
	CHECK(sc.mirrored == 1, "C mirrors %u attempts (B's only)", sc.mirrored);

	/* B leaves: A is no longer displaced, and C takes A up again. */
	kvr_request_finish(rb, xb);
	kvr_sync_detach(b);
	WAIT_FOR(3000, !stats(a).displaced);
	CHECK(!stats(a).displaced, "A still displaced after B's goodbye");
	/* B's finish leaves C; A's attempt comes in A's re-announce, which C asks for when it
	 * hears A's stream again as a new life of the id. */
	WAIT_FOR(5000, stats(c).mirrored == 1 && stats(c).peers_lost >= 1);
	usleep(300000);
	sc = stats(c);
	CHECK(sc.mirrored == 1, "C mirrors %u attempts after B left (A's one)", sc.mirrored);
	kvr_request_finish(ra, xa);
	WAIT_FOR(3000, stats(c).mirrored == 0);
	CHECK(stats(c).mirrored == 0, "C still mirrors %u after A's finish", stats(c).mirrored);

	kvr_sync_detach(a);
	kvr_sync_detach(c);
	relay_stop();
	kvr_router_destroy(ra);
	kvr_router_destroy(rb);
	kvr_router_destroy(rc_);
	kvr_test_nats_stop();
	printf("%s (%d failures)\n", failures ? "FAIL" : "PASS", failures);
	return failures ? 1 : 0;
}
