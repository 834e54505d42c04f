/*
 * sync/feed_none.c - the KV event feed API in a build without ZeroMQ (-Dzmq=disabled): every
 * call says so with KVR_ENOTSUP, so embedders link the same symbols either way.
 */
#include "core/error.h"
#include "core/fork.h"
#include "kvrouter.h"
#include "sync/replica_internal.h"

int kvr_feed_create(struct kvr_router *r, const struct kvr_feed_config *cfg, struct kvr_feed **out)
{
	(void)r;
	(void)cfg;
	if (out)
		*out = NULL;
	return kvr_fail(KVR_ENOTSUP, "kvr_feed_create: built without ZeroMQ (-Dzmq=disabled)");
}

int kvr_feed_add(struct kvr_feed *f, const struct kvr_feed_endpoint *ep, uint32_t *id_out)
{
	(void)f;
	(void)ep;
	(void)id_out;
	return kvr_fail(KVR_ENOTSUP, "kvr_feed_add: built without ZeroMQ (-Dzmq=disabled)");
}

int kvr_feed_remove(struct kvr_feed *f, uint32_t id)
{
	(void)f;
	(void)id;
	return kvr_fail(KVR_ENOTSUP, "kvr_feed_remove: built without ZeroMQ (-Dzmq=disabled)");
}

int kvr_feed_get_stats(struct kvr_feed *f, uint32_t id, struct kvr_feed_stats *out)
{
	(void)f;
	(void)id;
	(void)out;
	return kvr_fail(KVR_ENOTSUP, "kvr_feed_get_stats: built without ZeroMQ (-Dzmq=disabled)");
}

int kvr_feed_other_medium_blocks(struct kvr_feed *f, uint32_t id, uint32_t dp_rank, uint64_t *out,
                                 size_t cap, size_t *n_out)
{
	(void)f;
	(void)id;
	(void)dp_rank;
	(void)out;
	(void)cap;
	if (n_out)
		*n_out = 0;
	return kvr_fail(KVR_ENOTSUP,
	                "kvr_feed_other_medium_blocks: built without ZeroMQ (-Dzmq=disabled)");
}

void kvr_feed_destroy(struct kvr_feed *f)
{
	(void)f;
}

/* No feed threads: no feed waits for a replica. */
int kvr_feed_wait_replica_begin(const struct kvr_replica *rep)
{
	(void)rep;
	return 0;
}

void kvr_feed_wait_replica_end(void)
{
}

void kvr_feed_fork(bool before)
{
	(void)before; /* no feeds: no lock to hold */
}

void kvr_feeds_orphan(struct kvr_router *r)
{
	(void)r; /* no feed can be created here */
}

void kvr_feeds_rank_added(struct kvr_router *r)
{
	(void)r; /* no feed to tell */
}
