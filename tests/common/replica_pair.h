/*
 * tests/common/replica_pair.h - two replicas of sync/replica over an in-process bus, for the
 * stress programs that race routing threads against replica sync: replica i's publish is
 * delivered straight to replica 1 - i on the publishing thread (no transport, no loss, no
 * delay).  pair_rep[i] is NULL while replica i is not there (before pair_attach, after
 * pair_detach): a message published to it meanwhile is dropped, as one to a peer not yet
 * subscribed.
 */
#ifndef KVR_TESTS_COMMON_REPLICA_PAIR_H
#define KVR_TESTS_COMMON_REPLICA_PAIR_H

#include <stdatomic.h>
#include <stdlib.h>

#include "kvrouter.h"
#include "sync/replica.h"

static struct kvr_replica *_Atomic pair_rep[2];
static int pair_port[2] = {0, 1};

static inline int pair_publish(void *ctx, const void *buf, size_t len)
{
	struct kvr_replica *to = atomic_load(&pair_rep[1 - *(int *)ctx]);
	if (to)
		kvr_replica_deliver(to, buf, len, NULL);
	return 0;
}

/* The programs' common configuration of replica i; the caller may change fields before
 * pair_attach. */
static inline struct kvr_replica_config pair_config(int i)
{
	return (struct kvr_replica_config){
	    .replica_id = (uint64_t)i + 1,
	    .heartbeat_ms = 50,
	    .dead_after = 100000, /* nobody is given up under TSan or a loaded machine */
	    .snapshot_timeout_ms = 1000,
	};
}

/* Replica i of router x on the bus, started and ready; the program exits 1 if it cannot be. */
static inline struct kvr_replica *pair_attach(int i, struct kvr_router *x,
                                              const struct kvr_replica_config *c)
{
	struct kvr_replica_transport t = {.ctx = &pair_port[i], .publish = pair_publish};
	struct kvr_replica *p;
	if (kvr_replica_create(x, c, &t, &p))
		exit(1);
	atomic_store(&pair_rep[i], p);
	if (kvr_replica_start(p) || kvr_replica_wait_ready(p, 10000))
		exit(1);
	return p;
}

/* Both replicas stopped (no thread of theirs publishes any more), then gone: a later pair's
 * first replica publishes to nobody. */
static inline void pair_detach(void)
{
	for (int i = 0; i < 2; i++)
		kvr_replica_stop(atomic_load(&pair_rep[i]));
	for (int i = 1; i >= 0; i--) {
		struct kvr_replica *p = atomic_load(&pair_rep[i]);
		atomic_store(&pair_rep[i], NULL);
		kvr_replica_destroy(p);
	}
}

#endif
