/*
 * stress_replica_rank_ends - attempts ended by their rank's end while routing threads go on (run
 * under TSan in CI).  Two replicas over an in-process bus, each router routed to by FRONTENDS
 * threads (route, sometimes output, then finish or abort: 0, or KVR_ESTALE when the rank's end
 * won the claim first) until a churn thread has made CHANGES rank changes: it removes and re-adds,
 * resets, or gives a new incarnation to one rank after another, on either router (a peer's change
 * reaches the other through its apply thread, whose router's shards then end that router's own
 * attempts).
 *
 * What it races: a shard's rank end telling an own attempt (kvr_owner_ctx.on_rank_end,
 * KVR_OP_RANK_ENDED) against the caller's finish of it, against its admission note still to
 * come (the early set), and against the sender holding records; a peer's mirror ended by the
 * origin's ABORT while the peer applies the same rank change.
 *
 * Checks: once every thread stopped and every attempt it holds ended, and both replicas
 * drained: no own record is live and nothing is mirrored on either replica, and no load is left
 * on either router (before the fix, every attempt a rank's end ended stayed: test_replica_ranks
 * attempts_ended_by_a_rank_removal_or_reset_leave_no_record).
 *
 * usage: stress_replica_rank_ends   exit 0 pass, 1 fail
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h" /* the live list, to count own records */
#include "tests/common/replica_pair.h"

#define FRONTENDS 4 /* two a router */
#define RANKS     3
#define LIVE      8   /* attempts a thread holds at once */
#define CHANGES   200 /* rank changes made (or tried) before the threads stop */
#define CHURN_NS  1000000L

static struct kvr_router *r[2];
static atomic_int failures;
static atomic_int stop;
static atomic_ulong incarnation = 10; /* every change's, rising across both routers */
static atomic_ulong stale, ended, changes;

#define CHECK(c, ...)                                                                              \
	do {                                                                                       \
		if (!(c)) {                                                                        \
			fprintf(stderr, "stress_replica_rank_ends: " __VA_ARGS__);                 \
			fprintf(stderr, "\n");                                                     \
			atomic_fetch_add(&failures, 1);                                            \
		}                                                                                  \
	} while (0)

static struct kvr_router *make_router(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	/* SRE_SYNC=1: sync_booking, whose posted booking can find its rank's generation moved
	 * after the post (kvr_admit's KVR_ENOENT: the route decides again and notes the attempt
	 * withdrawn, which pairs with the shard's rank end in the early set). */
	c.sync_booking = getenv("SRE_SYNC") != NULL;
	struct kvr_router *x;
	if (kvr_router_create(&c, &x))
		exit(1);
	for (uint64_t w = 0; w < RANKS; w++)
		if (kvr_rank_add(x, (struct kvr_rank_id){w, 0}, 7, 1u << 16, 4096))
			exit(1);
	return x;
}

struct frontend {
	int id;
	struct kvr_router *r;
	uint64_t att[LIVE];
};

static void end_one(struct frontend *f, int k, bool finish)
{
	if (!f->att[k])
		return;
	int rc = finish ? kvr_request_finish(f->r, f->att[k]) : kvr_request_abort(f->r, f->att[k]);
	CHECK(rc == 0 || rc == KVR_ESTALE, "frontend %d: end: %d", f->id, rc);
	atomic_fetch_add(rc ? &stale : &ended, 1);
	f->att[k] = 0;
}

static void *frontend_main(void *arg)
{
	struct frontend *f = arg;
	uint32_t t[96], out[4];
	for (uint32_t i = 0; !atomic_load(&stop); i++) {
		int k = (int)(i % LIVE);
		end_one(f, k, i % 3 != 0);
		for (uint32_t j = 0; j < 96; j++)
			t[j] = (uint32_t)f->id * 100000000u + (i % 64) * 1000u + j;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 96;
		q.expected_output_tokens = 16;
		struct kvr_decision d;
		int rc = kvr_route(f->r, &q, &d);
		/* every rank may be between its removal and its add for a moment */
		CHECK(rc == 0 || rc == KVR_ENOENT || rc == KVR_EAGAIN, "frontend %d: route: %d",
		      f->id, rc);
		if (rc || d.status != KVR_DECIDED)
			continue;
		f->att[k] = d.attempt;
		if (i % 2) {
			for (int j = 0; j < 4; j++)
				out[j] = i * 4u + (uint32_t)j;
			rc = kvr_request_output(f->r, d.attempt, out, 4);
			/* KVR_EAGAIN: the shard's lane stayed full for 10 ms (TSan's slowness) */
			CHECK(rc == 0 || rc == KVR_ESTALE || rc == KVR_EAGAIN,
			      "frontend %d: output: %d", f->id, rc);
		}
	}
	for (int k = 0; k < LIVE; k++)
		end_one(f, k, true);
	return NULL;
}

static void *churn_main(void *arg)
{
	(void)arg;
	for (uint32_t i = 0; i < CHANGES; i++) {
		struct kvr_router *x = r[i % 2];
		struct kvr_rank_id id = {(i / 2) % RANKS, 0};
		uint64_t inc = atomic_fetch_add(&incarnation, 1) + 1;
		int rc;
		switch (i / (2 * RANKS) % 3) {
		case 0:
			rc = kvr_rank_remove(x, id);
			if (rc == 0 || rc == KVR_ENOENT)
				rc = kvr_rank_add(x, id, inc, 1u << 16, 4096);
			break;
		case 1:
			rc = kvr_rank_reset(x, id, inc);
			break;
		default:
			rc = kvr_rank_set_capacity(x, id, inc, 1u << 16);
			break;
		}
		/* The other router's change may not have reached this one yet, or crossed it:
		 * refusals are fine, the routers converge by the versions. */
		if (rc == 0)
			atomic_fetch_add(&changes, 1);
		nanosleep(&(struct timespec){0, CHURN_NS}, NULL);
	}
	atomic_store(&stop, 1);
	return NULL;
}

static size_t own_live(struct kvr_replica *x, size_t *in_map, uint32_t *early)
{
	size_t n = 0;
	pthread_mutex_lock(&x->mu);
	for (const struct kvr_rep_rec *y = x->live_head; y; y = y->next)
		n += y->origin == x->c.replica_id;
	*in_map = x->map_n;
	*early = x->early_n;
	pthread_mutex_unlock(&x->mu);
	return n;
}

static void quiet(void)
{
	for (int pass = 0; pass < 2; pass++)
		for (int i = 0; i < 2; i++)
			CHECK(kvr_replica_drain(atomic_load(&pair_rep[i]), 60000) == 0, "drain %d",
			      i);
	for (int i = 0; i < 2; i++)
		CHECK(kvr_router_sync(r[i], 60000) == 0, "sync %d", i);
}

int main(void)
{
	r[0] = make_router();
	r[1] = make_router();
	for (int i = 0; i < 2; i++) {
		struct kvr_replica_config c = pair_config(i);
		pair_attach(i, r[i], &c);
	}
	pthread_t th[FRONTENDS], ch;
	struct frontend f[FRONTENDS];
	for (int i = 0; i < FRONTENDS; i++) {
		memset(&f[i], 0, sizeof(f[i]));
		f[i].id = i;
		f[i].r = r[i % 2];
		if (pthread_create(&th[i], NULL, frontend_main, &f[i]))
			exit(1);
	}
	if (pthread_create(&ch, NULL, churn_main, NULL))
		exit(1);
	pthread_join(ch, NULL);
	for (int i = 0; i < FRONTENDS; i++)
		pthread_join(th[i], NULL);
	quiet();
	/* The routers converge on the ranks (versions), then every record must be gone. */
	size_t own[2] = {0}, map[2] = {0};
	uint32_t early[2] = {0};
	struct kvr_sync_stats st[2];
	for (int k = 0; k < 500; k++) {
		quiet();
		bool clean = true;
		for (int i = 0; i < 2; i++) {
			own[i] = own_live(atomic_load(&pair_rep[i]), &map[i], &early[i]);
			kvr_replica_get_stats(atomic_load(&pair_rep[i]), &st[i]);
			clean = clean && !own[i] && !map[i] && !st[i].mirrored && !early[i];
		}
		if (clean)
			break;
		nanosleep(&(struct timespec){0, 20000000}, NULL);
	}
	for (int i = 0; i < 2; i++) {
		CHECK(own[i] == 0 && map[i] == 0 && st[i].mirrored == 0,
		      "replica %d: %zu own records live, %zu in its map, %u mirrored", i + 1,
		      own[i], map[i], (unsigned)st[i].mirrored);
		/* Every end the shard told was paired with its admission or its withdrawal: the
		 * replicas attached before the first route (test_replica_early). */
		CHECK(early[i] == 0, "replica %d: %u ends left in the early set", i + 1, early[i]);
		for (uint64_t w = 0; w < RANKS; w++) {
			struct kvr_rank_stats s;
			if (kvr_rank_get_stats(r[i], (struct kvr_rank_id){w, 0}, &s))
				continue; /* removed last */
			CHECK(s.active_requests == 0 && s.active_blocks == 0,
			      "router %d rank %" PRIu64 ": %" PRIu64 " requests, %" PRIu64
			      " blocks still active",
			      i, w, (uint64_t)s.active_requests, (uint64_t)s.active_blocks);
		}
	}
	printf("stress_replica_rank_ends: %lu ended, %lu stale (their rank's end won), %lu rank "
	       "changes, %d failures\n",
	       atomic_load(&ended), atomic_load(&stale), atomic_load(&changes),
	       atomic_load(&failures));
	pair_detach();
	kvr_router_destroy(r[1]);
	kvr_router_destroy(r[0]);
	return atomic_load(&failures) ? 1 : 0;
}
