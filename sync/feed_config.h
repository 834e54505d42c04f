/* sync/feed_config.h - kvr_feed_config's checks, shared by the feed (sync/feed.c). */
#ifndef KVR_SYNC_FEED_CONFIG_H
#define KVR_SYNC_FEED_CONFIG_H

#include "kvrouter.h"

/* 0, or KVR_EINVAL with the detail (kvr_last_error) of the first field out of its range,
 * named as fn's.  Context: any thread. */
int kvr_feed_config_check(const struct kvr_feed_config *c, const char *fn);

#endif
