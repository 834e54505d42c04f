/* sync/replica_config.h - kvr_sync_config's checks, for kvr_sync_attach (sync/replica_nats.c). */
#ifndef KVR_SYNC_REPLICA_CONFIG_H
#define KVR_SYNC_REPLICA_CONFIG_H

#include "kvrouter.h"

/* 0, or KVR_EINVAL with the detail (kvr_last_error) of the first field out of its range, named
 * as fn's.  c must not be NULL.  Context: any thread. */
int kvr_sync_config_check(const struct kvr_sync_config *c, const char *fn);

#endif
