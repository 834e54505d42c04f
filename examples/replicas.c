/*
 * examples/replicas.c - README.md "Router replicas sharing load and predictions over NATS", as a
 * whole program: two routers in front of the same rank, each attached as a replica; an
 * admission on one is booked on the other, its finish releases it there, and a replica that
 * detaches with an attempt still live has it released on its peer at once (its goodbye).
 *
 * Built against kvrouter.h and the shared library, plus the test suite's throwaway nats-server
 * (tests/common/nats_server.c: a free 127.0.0.1 port, killed with this process); exit 77
 * (skipped) without a nats-server binary.  The marked regions, read in order (each without its
 * indentation), are README.md's replica C block word for word (examples/check_excerpts.py).
 * Exit 0 when every check holds, 1 otherwise.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <kvrouter.h>

#include "check.h"

#include "nats_server.h"

static const struct kvr_rank_id rank = {.worker_id = 7, .dp_rank = 0};

static struct kvr_router *router_new(void)
{
	struct kvr_router *r = NULL;
	if (kvr_router_create(NULL, &r) != 0 || kvr_rank_add(r, rank, 1, 65536, 8192) != 0) {
		fprintf(stderr, "router: %s\n", kvr_last_error());
		kvr_router_destroy(r);
		return NULL;
	}
	return r;
}

/* Waits up to 5 s (propagation is asynchronous) until r's rank has `want` live attempts. */
static bool wait_active(struct kvr_router *r, uint64_t want)
{
	struct kvr_rank_stats st = {0};
	for (int i = 0; i < 500; i++) {
		if (kvr_router_sync(r, 1000) == 0 && kvr_rank_get_stats(r, rank, &st) == 0 &&
		    st.active_requests == want)
			return true;
		nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
	}
	fprintf(stderr, "active requests %llu, want %llu\n", (unsigned long long)st.active_requests,
	        (unsigned long long)want);
	return false;
}

static uint64_t route_one(struct kvr_router *r, const uint32_t *tokens, size_t n)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tokens;
	q.n_tokens = n;
	struct kvr_decision d;
	memset(&d, 0, sizeof(d));
	int rc = kvr_route(r, &q, &d);
	CHECK(rc == 0 && d.status == KVR_DECIDED, "kvr_route: %d", rc);
	return d.attempt;
}

int main(void)
{
	if (!kvr_test_nats_installed()) {
		printf("examples/replicas: no nats-server on PATH, skipped\n");
		return 77;
	}
	if (kvr_test_nats_start() != 0) {
		fprintf(stderr, "examples/replicas: nats-server did not start\n");
		return 1;
	}
	const char *servers = kvr_test_nats_url();
	static uint32_t prompt[64];
	for (size_t i = 0; i < 64; i++)
		prompt[i] = 77 + (uint32_t)i;

	struct kvr_router *router = router_new(), *peer_router = router_new();
	if (!router || !peer_router)
		return 1;
	/* The peer: replica 4 of the same cluster. */
	struct kvr_sync_config pc;
	kvr_sync_config_init(&pc);
	pc.servers = servers;
	pc.cluster = "prod";
	pc.replica_id = 4;
	pc.dead_after = 100; /* 10 s of silence: only a goodbye releases within the 5 s waited */
	struct kvr_sync *peer = NULL;
	CHECK(kvr_sync_attach(peer_router, &pc, &peer) == 0, "peer attach");
	CHECK(kvr_sync_wait_ready(peer, 5000) == 0, "peer ready");
	int rc;

	// clang-format off
	/* README.md excerpt */
	struct kvr_sync_config sc;
	kvr_sync_config_init(&sc);
	sc.servers = servers;                 /* "nats://10.0.0.5:4222,nats://10.0.0.6:4222";
	                                         user/password/token/creds_file/TLS fields too */
	sc.cluster = "prod";                  /* subject prefix shared by the replicas */
	sc.replica_id = 3;                    /* unique per replica */
	struct kvr_sync *s;
	rc = kvr_sync_attach(router, &sc, &s); /* asks a live peer for a snapshot in the background */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "kvr_sync_attach: %d", rc);
	if (rc != 0)
		return 1;
	// clang-format off
	/* README.md excerpt */
	rc = kvr_sync_wait_ready(s, 2000);
	/* route, report output and end requests on router as usual: every replica books them */
	/* README.md excerpt end */
	// clang-format on
	CHECK(rc == 0, "kvr_sync_wait_ready: %d", rc);

	/* An admission on this replica is booked on its peer; its finish releases it there. */
	uint64_t a = route_one(router, prompt, 64);
	CHECK(wait_active(peer_router, 1), "the peer did not mirror the admission");
	CHECK(kvr_request_finish(router, a) == 0, "finish");
	CHECK(wait_active(peer_router, 0), "the peer kept the finished attempt");
	struct kvr_sync_stats ss;
	CHECK(kvr_sync_get_stats(s, &ss) == 0 && ss.connected && ss.published >= 2,
	      "stats: connected %d, published %llu", (int)ss.connected,
	      (unsigned long long)ss.published);

	/* An attempt left live when this replica detaches is released on the peer at once (well
	 * before dead_after heartbeats of silence would release it). */
	(void)route_one(router, prompt, 64);
	CHECK(wait_active(peer_router, 1), "the peer did not mirror the second admission");
	// clang-format off
	/* README.md excerpt */
	kvr_sync_detach(s);                   /* goodbye: peers release this replica's attempts */
	/* README.md excerpt end */
	// clang-format on
	CHECK(wait_active(peer_router, 0), "the peer kept the detached replica's attempt");

	kvr_sync_detach(peer);
	kvr_router_destroy(router);
	kvr_router_destroy(peer_router);
	kvr_test_nats_stop();
	if (fails)
		fprintf(stderr, "examples/replicas: %d checks failed\n", fails);
	else
		printf("examples/replicas: ok\n");
	return fails ? 1 : 0;
}
