/* sync/replica_config.h - kvr_sync_config's checks, for kvr_sync_attach (sync/replica_nats.c). */
#ifndef KVR_SYNC_REPLICA_CONFIG_H
#define KVR_SYNC_REPLICA_CONFIG_H

#include "kvrouter.h"

/* kvr_sync_config.servers: at most this many comma-separated URLs (blanks around them ignored)
 * in a string shorter than KVR_SYNC_SERVERS_LEN (sync/replica_nats.c copies it to split it). */
#define KVR_SYNC_SERVERS_MAX 32
#define KVR_SYNC_SERVERS_LEN 2048

/* 0, or KVR_EINVAL with the detail (kvr_last_error) of the first field out of its range, named
 * as fn's.  c must not be NULL.  Context: any thread. */
int kvr_sync_config_check(const struct kvr_sync_config *c, const char *fn);

#endif
