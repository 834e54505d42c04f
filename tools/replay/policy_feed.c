/*
 * tools/replay/policy_feed.c - the events policy through the real KV event feed
 * (kvr-replay --policies events_feed).
 *
 * Same router, same decisions as the `events` policy (tools/replay/policy_router.c, whose
 * operations this one calls), but the simulated engines' KV events do not reach the router by
 * a function call: each simulated rank publishes them the way vLLM does (a PUB socket - XPUB,
 * the same wire - on tcp://127.0.0.1, frames [topic, seq, msgpack batch] in vLLM's current map
 * form, encoded with msgpack-c) and a kvr_feed subscribed to every rank decodes and applies
 * them on its own thread.  Event lag is therefore real: a decision taken right after an event
 * was published may not see it yet, and the replay (which runs virtual time much faster than
 * wall time) keeps routing while the feed catches up.  Comparing its hit rate with `events`
 * measures what that lag costs.  As vLLM does, a rank publishes one batch per engine step
 * with every event of the step (the simulator stamps a step's events with its time): a step's
 * batch goes out when the rank's next event belongs to a later step, or when the cluster's
 * time has moved past it (route, first token, sync).  sync() (before every agreement sample and
 * when the cluster idles) waits until the feed has applied everything published, so the agreement
 * samples check the whole wire path for exactness, lag aside.
 *
 * vLLM sends token ids, not the router's local hashes, so the publisher needs each stored
 * block's tokens: it learns them from what the router sees (every routed prompt's complete
 * blocks, then each request's output tokens completing blocks after its prompt tail), in a
 * map local hash -> block tokens.  An output block's last tokens reach the policy after the
 * engine caches it, so a stored event with unknown tokens waits (with every later event of its
 * rank, order kept) until output() brings them (at the request's finish at the latest: the
 * wait is the few decode steps between the block's caching and the policy's next output
 * chunk).  Only at the end is what still waits published short, a chain stopping at its first
 * block of unknown tokens (counted as token misses).
 */
#include <inttypes.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "shards/u64map.h"
#include "sync/feed_encode.h"
#include "tools/replay/policy.h"

struct tail {
	uint64_t handle;
	uint32_t n;    /* tokens in tok (< block size) */
	uint32_t *tok; /* the request's partial last block */
	bool used;
};

/* A stored event whose blocks' tokens the policy has not seen yet (an output block's last
 * tokens reach the policy after the engine caches it), and every later event of its rank,
 * wait here in order until the tokens are known, or until sync() (then published short). */
struct dev {
	struct sim_kv_event ev; /* seq and local point to owned copies */
};

struct dq {
	struct dev *q;
	size_t head, n, cap;
};

/* The events of one engine step of one rank, encoded as they come: vLLM publishes one batch
 * per scheduler step with everything the step stored and removed. */
struct step {
	struct kvr_fenc ev; /* the events, back to back */
	uint32_t n;
	uint64_t time_ns; /* the step's (every event of a step carries its time) */
};

struct pf {
	void *inner; /* the events policy's state */
	struct kvr_router *r;
	struct kvr_feed *feed;
	void *zctx;
	uint32_t n_ranks, bs;
	void **pub;
	uint32_t *ep_id;
	uint64_t *seq;
	struct kvr_u64map tokmap; /* local hash -> index of its block in pool */
	uint32_t *pool;
	size_t n_pool, cap_pool;   /* blocks */
	struct kvr_u64map handles; /* attempt handle -> index in tails */
	struct tail *tails;
	size_t n_tails, cap_tails;
	struct kvr_fenc out; /* the batch being sent */
	struct step *open;   /* per rank: the batch of the engine step being published */
	struct dq *defer;    /* per rank */
	uint64_t token_misses, batches, blocks, deferred;
};

static double wall_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* a (*cap items of sz bytes) doubled, or first items while empty: the new array with *cap
 * updated, or NULL with a and *cap unchanged. */
static void *grow(void *a, size_t *cap, size_t first, size_t sz)
{
	size_t nc = *cap ? *cap * 2 : first;
	void *na = realloc(a, nc * sz);
	if (na)
		*cap = nc;
	return na;
}

/* Remembers the tokens of one complete block. */
static int learn(struct pf *p, const uint32_t *tok)
{
	uint64_t local;
	kvr_hash_blocks(tok, p->bs, p->bs, NULL, &local, NULL);
	if (kvr_u64map_find(&p->tokmap, local))
		return 0;
	if (p->n_pool == p->cap_pool) {
		uint32_t *np = grow(p->pool, &p->cap_pool, 4096, p->bs * sizeof(uint32_t));
		if (!np)
			return KVR_ENOMEM;
		p->pool = np;
	}
	if (kvr_u64map_reserve(&p->tokmap, 1))
		return KVR_ENOMEM;
	memcpy(p->pool + p->n_pool * p->bs, tok, p->bs * sizeof(uint32_t));
	kvr_u64map_insert(&p->tokmap, local, (uint32_t)p->n_pool++);
	return 0;
}

static void feed_log(void *ctx, int level, const char *msg)
{
	(void)ctx;
	fprintf(stderr, "events_feed [%d]: %s\n", level, msg);
}

static void pf_destroy(void *state);
static int undefer(struct pf *p, bool force);
static int close_steps(struct pf *p, uint64_t before_ns);
static void dev_free(struct dev *d);
static int pf_setup(struct pf *p, const struct replay_env *env);

static int pf_create(const struct replay_env *env, void **state)
{
	struct pf *p = calloc(1, sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	int rc = pf_setup(p, env);
	if (rc) {
		pf_destroy(p);
		return rc;
	}
	*state = p;
	return 0;
}

static int pf_setup(struct pf *p, const struct replay_env *env)
{
	kvr_u64map_init(&p->tokmap);
	kvr_u64map_init(&p->handles);
	kvr_fenc_init(&p->out);
	int rc = replay_policy_events.create(env, &p->inner);
	if (rc)
		return rc;
	p->r = replay_policy_router(p->inner);
	p->n_ranks = env->n_ranks;
	p->bs = env->block_size;
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.rcv_hwm = 1u << 30; /* the replay publishes in bursts: never drop */
	if (getenv("KVR_FEED_LOG"))
		fc.log = feed_log;
	p->pub = calloc(env->n_ranks, sizeof(*p->pub));
	p->ep_id = calloc(env->n_ranks, sizeof(*p->ep_id));
	p->seq = calloc(env->n_ranks, sizeof(*p->seq));
	p->defer = calloc(env->n_ranks, sizeof(*p->defer));
	p->open = calloc(env->n_ranks, sizeof(*p->open));
	p->zctx = zmq_ctx_new();
	if (!p->pub || !p->ep_id || !p->seq || !p->defer || !p->open || !p->zctx)
		return KVR_ENOMEM;
	for (uint32_t i = 0; i < env->n_ranks; i++)
		kvr_fenc_init(&p->open[i].ev);
	if ((rc = kvr_feed_create(p->r, &fc, &p->feed)))
		return rc;
	for (uint32_t i = 0; i < env->n_ranks; i++) {
		void *s = zmq_socket(p->zctx, ZMQ_XPUB);
		int zero = 0;
		if (!s)
			return KVR_ENOMEM;
		p->pub[i] = s;
		zmq_setsockopt(s, ZMQ_SNDHWM, &zero, sizeof(zero));
		zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
		if (zmq_bind(s, "tcp://127.0.0.1:*"))
			return KVR_EINVAL;
		char ep[256];
		size_t len = sizeof(ep);
		zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len);
		struct kvr_feed_endpoint e = {.endpoint = ep, .worker_id = i, .dp_rank = 0};
		if ((rc = kvr_feed_add(p->feed, &e, &p->ep_id[i])))
			return rc;
		char sub[64];
		if (zmq_recv(s, sub, sizeof(sub), 0) <
		    1) /* subscribed: nothing published is lost */
			return KVR_EINVAL;
	}
	return 0;
}

static void pf_destroy(void *state)
{
	struct pf *p = state;
	if (!p)
		return;
	if (p->feed && p->defer && p->open)
		undefer(p, true);
	if (p->feed && p->open)
		close_steps(p, UINT64_MAX);
	for (uint32_t r = 0; p->open && r < p->n_ranks; r++)
		kvr_fenc_fini(&p->open[r].ev);
	free(p->open);
	for (uint32_t r = 0; p->defer && r < p->n_ranks; r++) {
		for (size_t i = p->defer[r].head; i < p->defer[r].n; i++)
			dev_free(&p->defer[r].q[i]);
		free(p->defer[r].q);
	}
	free(p->defer);
	if (p->feed) {
		struct kvr_feed_stats st;
		if (kvr_feed_get_stats(p->feed, KVR_FEED_ALL, &st) == 0)
			fprintf(stderr,
			        "events_feed: published %" PRIu64 " batches, %" PRIu64
			        " blocks; feed applied %" PRIu64 " batches, malformed %" PRIu64
			        ", refused %" PRIu64 ", gaps %" PRIu64 "; token misses %" PRIu64
			        "\n",
			        p->batches, p->blocks, st.batches, st.malformed, st.refused,
			        st.gaps, p->token_misses);
	}
	kvr_feed_destroy(p->feed); /* before the router the events policy destroys */
	for (uint32_t i = 0; p->pub && i < p->n_ranks; i++)
		if (p->pub[i])
			zmq_close(p->pub[i]);
	if (p->zctx)
		zmq_ctx_term(p->zctx);
	if (p->inner)
		replay_policy_events.destroy(p->inner);
	for (size_t i = 0; i < p->n_tails; i++)
		free(p->tails[i].tok);
	free(p->tails);
	kvr_u64map_fini(&p->tokmap);
	kvr_u64map_fini(&p->handles);
	free(p->pool);
	free(p->pub);
	free(p->ep_id);
	free(p->seq);
	kvr_fenc_fini(&p->out);
	free(p);
}

static struct tail *tail_of(struct pf *p, uint64_t handle, bool create)
{
	uint32_t *ix = kvr_u64map_find(&p->handles, handle);
	if (ix)
		return &p->tails[*ix];
	if (!create)
		return NULL;
	size_t i = 0;
	while (i < p->n_tails && p->tails[i].used)
		i++;
	if (i == p->n_tails) {
		if (p->n_tails == p->cap_tails) {
			struct tail *nt = grow(p->tails, &p->cap_tails, 256, sizeof(*nt));
			if (!nt)
				return NULL;
			p->tails = nt;
		}
		p->tails[p->n_tails] = (struct tail){.tok = malloc(p->bs * sizeof(uint32_t))};
		if (!p->tails[p->n_tails].tok)
			return NULL;
		p->n_tails++;
	}
	if (kvr_u64map_reserve(&p->handles, 1))
		return NULL;
	struct tail *t = &p->tails[i];
	t->used = true;
	t->handle = handle;
	t->n = 0;
	kvr_u64map_insert(&p->handles, handle, (uint32_t)i);
	return t;
}

static void tail_drop(struct pf *p, uint64_t handle)
{
	uint32_t *ix = kvr_u64map_find(&p->handles, handle);
	if (!ix)
		return;
	p->tails[*ix].used = false;
	kvr_u64map_remove(&p->handles, handle);
}

static int pf_route(void *state, const struct replay_route_req *q, struct replay_route_out *out)
{
	struct pf *p = state;
	int rc = close_steps(p, q->now_ns);
	if (rc)
		return rc;
	size_t nb = q->n_tokens / p->bs;
	for (size_t i = 0; i < nb; i++)
		if ((rc = learn(p, q->tokens + i * p->bs)))
			return rc;
	rc = replay_policy_events.route(p->inner, q, out);
	if (rc || out->queued)
		return rc; /* a queued request's tail is not followed (its outputs may miss) */
	struct tail *t = tail_of(p, out->handle, true);
	if (!t)
		return KVR_ENOMEM;
	t->n = (uint32_t)(q->n_tokens % p->bs);
	memcpy(t->tok, q->tokens + nb * p->bs, t->n * sizeof(uint32_t));
	return 0;
}

static int pf_output(void *state, uint64_t handle, const uint32_t *tokens, size_t n, bool final)
{
	struct pf *p = state;
	struct tail *t = tail_of(p, handle, false);
	for (size_t i = 0; t && i < n; i++) {
		t->tok[t->n++] = tokens[i];
		if (t->n == p->bs) {
			int rc = learn(p, t->tok);
			if (rc)
				return rc;
			t->n = 0;
		}
	}
	int rc = undefer(p, false);
	if (rc)
		return rc;
	return replay_policy_events.output(p->inner, handle, tokens, n, final);
}

static int pf_finished(void *state, uint64_t handle, const struct sim_finish_info *info)
{
	struct pf *p = state;
	tail_drop(p, handle);
	return replay_policy_events.finished(p->inner, handle, info);
}

static int pf_aborted(void *state, uint64_t handle)
{
	struct pf *p = state;
	tail_drop(p, handle);
	return replay_policy_events.aborted(p->inner, handle);
}

/* Sends rank r's open step as one batch (map form, stamped with the wall clock now). */
static int close_step(struct pf *p, uint32_t r)
{
	struct step *o = &p->open[r];
	if (!o->n)
		return 0;
	kvr_fenc_begin(&p->out, wall_s(), o->n);
	msgpack_sbuffer_write(&p->out.sb, o->ev.sb.data, o->ev.sb.size);
	kvr_fenc_end(&p->out, 0);
	msgpack_sbuffer_clear(&o->ev.sb);
	o->n = 0;
	if (kvr_fenc_send(p->pub[r], p->seq[r]++, p->out.sb.data, p->out.sb.size))
		return KVR_EAGAIN;
	p->batches++;
	return 0;
}

/* Sends every open step older than before_ns: an engine step is over once the cluster's time
 * has moved past it (a step's events all carry its time and come in one engine call, so
 * nothing is cut in two). */
static int close_steps(struct pf *p, uint64_t before_ns)
{
	for (uint32_t r = 0; r < p->n_ranks; r++)
		if (p->open[r].n && p->open[r].time_ns < before_ns) {
			int rc = close_step(p, r);
			if (rc)
				return rc;
		}
	return 0;
}

struct blk_tokens {
	struct pf *p;
	const uint64_t *local;
};

static const uint32_t *pool_tokens(void *ctx, size_t i)
{
	struct blk_tokens *c = ctx;
	return c->p->pool + (size_t)*kvr_u64map_find(&c->p->tokmap, c->local[i]) * c->p->bs;
}

/* Adds one simulated event to its rank's open step (sending the step before if the event
 * belongs to a later one); a stored chain stops at its first block of unknown tokens (the rest
 * counted as token misses). */
static int publish(struct pf *p, const struct sim_kv_event *ev)
{
	size_t n = ev->n;
	if (ev->kind == SIM_EV_STORED) {
		for (size_t i = 0; i < ev->n; i++)
			if (!kvr_u64map_find(&p->tokmap, ev->local[i])) {
				p->token_misses += ev->n - i;
				n = i;
				break;
			}
		if (n == 0)
			return 0;
	}
	struct step *o = &p->open[ev->rank];
	if (o->n && o->time_ns != ev->time_ns) {
		int rc = close_step(p, ev->rank);
		if (rc)
			return rc;
	}
	o->time_ns = ev->time_ns;
	switch (ev->kind) {
	case SIM_EV_STORED: {
		struct blk_tokens c = {.p = p, .local = ev->local};
		kvr_fenc_stored(&o->ev, ev->seq, n, ev->has_parent ? &ev->parent_seq : NULL, p->bs,
		                pool_tokens, &c);
		p->blocks += n;
		break;
	}
	case SIM_EV_REMOVED:
		kvr_fenc_removed(&o->ev, ev->seq, n);
		break;
	case SIM_EV_CLEARED:
		kvr_fenc_cleared(&o->ev);
		break;
	}
	o->n++;
	return 0;
}

static bool publishable(struct pf *p, const struct sim_kv_event *ev)
{
	if (ev->kind != SIM_EV_STORED)
		return true;
	for (size_t i = 0; i < ev->n; i++)
		if (!kvr_u64map_find(&p->tokmap, ev->local[i]))
			return false;
	return true;
}

static void dev_free(struct dev *d)
{
	free((void *)d->ev.seq);
	free((void *)d->ev.local);
}

/* Publishes what waits on each rank, in order: while the head's tokens are known, or all of it
 * (short where tokens are missing) when force is set. */
static int undefer(struct pf *p, bool force)
{
	for (uint32_t r = 0; r < p->n_ranks; r++) {
		struct dq *d = &p->defer[r];
		while (d->head < d->n && (force || publishable(p, &d->q[d->head].ev))) {
			int rc = publish(p, &d->q[d->head].ev);
			dev_free(&d->q[d->head]);
			d->head++;
			if (rc)
				return rc;
		}
		if (d->head == d->n)
			d->head = d->n = 0;
	}
	return 0;
}

static int pf_kv_event(void *state, const struct sim_kv_event *ev)
{
	struct pf *p = state;
	if (ev->rank >= p->n_ranks)
		return KVR_EINVAL;
	struct dq *d = &p->defer[ev->rank];
	if (d->head == d->n && publishable(p, ev))
		return publish(p, ev);
	if (d->n == d->cap) {
		struct dev *nq = grow(d->q, &d->cap, 64, sizeof(*nq));
		if (!nq)
			return KVR_ENOMEM;
		d->q = nq;
	}
	struct dev *e = &d->q[d->n];
	e->ev = *ev;
	uint64_t *seq = malloc((ev->n + 1) * sizeof(uint64_t));
	uint64_t *local = malloc((ev->n + 1) * sizeof(uint64_t));
	if (!seq || !local) {
		free(seq);
		free(local);
		return KVR_ENOMEM;
	}
	if (ev->n) {
		memcpy(seq, ev->seq, ev->n * sizeof(uint64_t));
		if (ev->local)
			memcpy(local, ev->local, ev->n * sizeof(uint64_t));
	}
	e->ev.seq = seq;
	e->ev.local = ev->local ? local : NULL;
	if (!ev->local)
		free(local);
	d->n++;
	p->deferred++;
	return 0;
}

/* Waits until the feed has applied everything published (events waiting for their tokens
 * excepted), then the router's own sync. */
static int pf_sync(void *state, uint64_t now_ns)
{
	struct pf *p = state;
	int rc = undefer(p, false); /* what waits for tokens keeps waiting: no chain cut short */
	if (rc || (rc = close_steps(p, UINT64_MAX)))
		return rc;
	for (uint32_t i = 0; i < p->n_ranks; i++) {
		struct kvr_feed_stats st;
		int tries = 0;
		for (;;) {
			rc = kvr_feed_get_stats(p->feed, p->ep_id[i], &st);
			if (rc)
				return rc;
			if (st.next_seq >= p->seq[i])
				break;
			if (++tries > 600000) /* 60 s */
				return KVR_ETIMEDOUT;
			usleep(100);
		}
	}
	return replay_policy_events.sync(p->inner, now_ns);
}

static int pf_dequeue(void *state, uint64_t *id, struct replay_route_out *out)
{
	struct pf *p = state;
	return replay_policy_events.dequeue(p->inner, id, out);
}

static int pf_first_token(void *state, uint64_t handle, uint32_t rank, uint64_t time_ns)
{
	struct pf *p = state;
	int rc = close_steps(p, time_ns);
	if (rc)
		return rc;
	return replay_policy_events.first_token(p->inner, handle, rank, time_ns);
}

static int pf_resident(void *state, uint32_t rank, uint64_t *blocks)
{
	struct pf *p = state;
	return replay_policy_events.resident(p->inner, rank, blocks);
}

static int pf_predict(void *state, uint32_t rank, const uint64_t *local, size_t n,
                      uint32_t *overlap)
{
	struct pf *p = state;
	return replay_policy_events.predict(p->inner, rank, local, n, overlap);
}

static int pf_blocks(void *state, uint32_t rank, uint64_t **out, size_t *n)
{
	struct pf *p = state;
	return replay_policy_events.blocks(p->inner, rank, out, n);
}

const struct replay_policy_ops replay_policy_events_feed = {
    .name = "events_feed",
    .predicts = true,
    .wants_events = true,
    .create = pf_create,
    .destroy = pf_destroy,
    .route = pf_route,
    .kv_event = pf_kv_event,
    .first_token = pf_first_token,
    .output = pf_output,
    .finished = pf_finished,
    .aborted = pf_aborted,
    .sync = pf_sync,
    .dequeue = pf_dequeue,
    .resident = pf_resident,
    .predict = pf_predict,
    .blocks = pf_blocks,
};
