/*
 * tools/replay/policy_replicas.c - N approx_lru router replicas behind one policy (kvr-replay
 * --routers N, issue 14): arrivals are dealt round-robin to the replicas (a frontend each),
 * every happening of a request goes to the replica that routed it.
 *
 *  - replicas_sync: the replicas share their admissions, lifecycle and rank changes through the
 *    replica sync core (sync/replica.c) on an in-process bus: each replica's messages are
 *    delivered to the others' queues, and after every call the policy waits until every replica
 *    has applied everything, so the replay stays deterministic (the sync is "instant", the best
 *    case of a real NATS deployment, whose delivery takes well under a millisecond).
 *  - replicas_nosync: the same replicas without sync; each predicts from its own share only.
 * Compare with approx_lru (one router that sees everything) to see what sync buys.
 */
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "tools/replay/policy.h"

#define MAX_REPLICAS 16

uint32_t replay_n_routers = 2; /* set by kvr-replay --routers N */

struct rs {
	uint32_t n;
	bool synced;
	void *st[MAX_REPLICAS];
	struct kvr_replica *rep[MAX_REPLICAS];
	struct bus_port {
		struct rs *rs;
		uint32_t i;
	} port[MAX_REPLICAS];
	/* outer handle - 1 -> (replica, inner handle) */
	uint32_t *owner;
	uint64_t *inner;
	size_t n_h, cap_h;
};

static const struct replay_policy_ops *base = &replay_policy_approx_lru;

/* The in-process bus: a message from replica i goes to every other replica's queue. */
static int bus_publish(void *ctx, const void *buf, size_t len)
{
	struct bus_port *p = ctx;
	for (uint32_t j = 0; j < p->rs->n; j++)
		if (j != p->i && p->rs->rep[j])
			kvr_replica_deliver(p->rs->rep[j], buf, len, NULL);
	return 0;
}

static void settle(struct rs *s)
{
	if (!s->synced)
		return;
	/* Twice: what replica j applied may not make anyone publish (peers never republish), but
	 * a message delivered while another replica drained is caught by the second pass. */
	for (int pass = 0; pass < 2; pass++)
		for (uint32_t j = 0; j < s->n; j++)
			kvr_replica_drain(s->rep[j], 60000);
}

static void rs_destroy(void *state)
{
	struct rs *s = state;
	if (!s)
		return;
	for (uint32_t i = 0; i < s->n; i++)
		kvr_replica_stop(s->rep[i]);
	for (uint32_t i = 0; i < s->n; i++) {
		kvr_replica_destroy(s->rep[i]);
		if (s->st[i])
			base->destroy(s->st[i]);
	}
	free(s->owner);
	free(s->inner);
	free(s);
}

static int create(const struct replay_env *env, void **state, bool synced)
{
	struct rs *s = calloc(1, sizeof(*s));
	if (!s)
		return KVR_ENOMEM;
	s->n = replay_n_routers < 1              ? 1
	       : replay_n_routers > MAX_REPLICAS ? MAX_REPLICAS
	                                         : replay_n_routers;
	s->synced = synced;
	int rc = 0;
	for (uint32_t i = 0; i < s->n && !rc; i++) {
		struct replay_env e = *env;
		e.seed = env->seed + i; /* each frontend breaks ties its own way */
		rc = base->create(&e, &s->st[i]);
	}
	for (uint32_t i = 0; i < s->n && !rc && synced; i++) {
		s->port[i] = (struct bus_port){s, i};
		struct kvr_replica_config c = {
		    .replica_id = i + 1,
		    .heartbeat_ms = 1000,
		    .dead_after = 1000000, /* virtual time: wall-clock silence means nothing */
		    .snapshot_timeout_ms = 1000,
		};
		struct kvr_replica_transport t = {.ctx = &s->port[i], .publish = bus_publish};
		rc = kvr_replica_create(replay_policy_router(s->st[i]), &c, &t, &s->rep[i]);
	}
	for (uint32_t i = 0; i < s->n && !rc && synced; i++) {
		rc = kvr_replica_start(s->rep[i]);
		if (rc == 0)
			rc = kvr_replica_wait_ready(s->rep[i], 10000);
	}
	settle(s);
	if (rc) {
		rs_destroy(s);
		return rc;
	}
	*state = s;
	return 0;
}

static int create_sync(const struct replay_env *env, void **state)
{
	return create(env, state, true);
}

static int create_nosync(const struct replay_env *env, void **state)
{
	return create(env, state, false);
}

static int rs_route(void *state, const struct replay_route_req *q, struct replay_route_out *out)
{
	struct rs *s = state;
	uint32_t i = (uint32_t)(q->id % s->n);
	if (s->n_h == s->cap_h) {
		size_t nc = s->cap_h ? 2 * s->cap_h : 1024;
		uint32_t *o = realloc(s->owner, nc * sizeof(*o));
		if (o)
			s->owner = o;
		uint64_t *h = realloc(s->inner, nc * sizeof(*h));
		if (h)
			s->inner = h;
		if (!o || !h)
			return KVR_ENOMEM;
		s->cap_h = nc;
	}
	int rc = base->route(s->st[i], q, out);
	if (rc)
		return rc;
	if (out->queued)
		return KVR_EINVAL; /* queueing is not supported with replicas */
	s->owner[s->n_h] = i;
	s->inner[s->n_h] = out->handle;
	out->handle = ++s->n_h;
	settle(s);
	return 0;
}

#define FORWARD(NAME, ...)                                                                         \
	do {                                                                                       \
		struct rs *s = state;                                                              \
		if (handle == 0 || handle > s->n_h)                                                \
			return KVR_ENOENT;                                                         \
		if (!base->NAME)                                                                   \
			return 0;                                                                  \
		int rc =                                                                           \
		    base->NAME(s->st[s->owner[handle - 1]], s->inner[handle - 1], __VA_ARGS__);    \
		settle(s);                                                                         \
		return rc;                                                                         \
	} while (0)

static int rs_first_token(void *state, uint64_t handle, uint32_t rank, uint64_t time_ns)
{
	FORWARD(first_token, rank, time_ns);
}

static int rs_output(void *state, uint64_t handle, const uint32_t *tokens, size_t n, bool final)
{
	FORWARD(output, tokens, n, final);
}

static int rs_finished(void *state, uint64_t handle, const struct sim_finish_info *info)
{
	FORWARD(finished, info);
}

static int rs_aborted(void *state, uint64_t handle)
{
	struct rs *s = state;
	if (handle == 0 || handle > s->n_h)
		return KVR_ENOENT;
	int rc =
	    base->aborted ? base->aborted(s->st[s->owner[handle - 1]], s->inner[handle - 1]) : 0;
	settle(s);
	return rc;
}

static int rs_sync(void *state, uint64_t now_ns)
{
	struct rs *s = state;
	int rc = 0;
	for (uint32_t i = 0; i < s->n && base->sync; i++)
		if (!rc)
			rc = base->sync(s->st[i], now_ns);
	settle(s);
	return rc;
}

/* Agreement introspection: replica 0's prediction. */
static int rs_resident(void *state, uint32_t rank, uint64_t *blocks)
{
	return base->resident(((struct rs *)state)->st[0], rank, blocks);
}

static int rs_predict(void *state, uint32_t rank, const uint64_t *local, size_t n,
                      uint32_t *overlap)
{
	return base->predict(((struct rs *)state)->st[0], rank, local, n, overlap);
}

static int rs_blocks(void *state, uint32_t rank, uint64_t **out, size_t *n)
{
	return base->blocks(((struct rs *)state)->st[0], rank, out, n);
}

#define REPLICA_POLICY(NAME, CREATE)                                                               \
	{                                                                                          \
		.name = NAME, .predicts = true, .wants_events = false, .create = CREATE,           \
		.destroy = rs_destroy, .route = rs_route, .first_token = rs_first_token,           \
		.output = rs_output, .finished = rs_finished, .aborted = rs_aborted,               \
		.sync = rs_sync, .resident = rs_resident, .predict = rs_predict,                   \
		.blocks = rs_blocks,                                                               \
	}

const struct replay_policy_ops replay_policy_replicas_sync =
    REPLICA_POLICY("replicas_sync", create_sync);
const struct replay_policy_ops replay_policy_replicas_nosync =
    REPLICA_POLICY("replicas_nosync", create_nosync);
