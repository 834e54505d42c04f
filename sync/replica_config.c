/*
 * sync/replica_config.c - kvr_sync_config's defaults, one copy for both builds: with the `nats`
 * feature (sync/replica_nats.c) and without it (sync/replica_none.c), so that a program filling
 * its config sees the same defaults whichever build it links.
 */
#include <string.h>

#include "kvrouter.h"

void kvr_sync_config_init(struct kvr_sync_config *c)
{
	if (!c)
		return;
	memset(c, 0, sizeof(*c));
	c->servers = "nats://127.0.0.1:4222";
	c->cluster = "kvr";
	c->heartbeat_ms = 100;
	c->dead_after = 5;
	c->snapshot_timeout_ms = 2000;
}
