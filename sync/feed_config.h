/* sync/feed_config.h - kvr_feed_config's checks, shared by the feed (sync/feed.c). */
#ifndef KVR_SYNC_FEED_CONFIG_H
#define KVR_SYNC_FEED_CONFIG_H

#include "kvrouter.h"

/* 0, or KVR_EINVAL with the detail (kvr_last_error) of the first field out of its range,
 * named as fn's.  Context: any thread. */
int kvr_feed_config_check(const struct kvr_feed_config *c, const char *fn);

/* 0, or KVR_EINVAL with the detail: endpoint (kvr_feed_endpoint's field `what`) is a tcp://
 * address whose port is not a number in 1..65535 (a source address before ';' may also have 0
 * or '*').  libzmq 4.3 takes "tcp://h:99999" for port 34463 (the number's low 16 bits) and
 * "tcp://h:5x" for port 5, and connects there without a word: a feed on another worker's
 * events.  Other transports and the rest of the address are ZeroMQ's to judge.  Context: any
 * thread. */
int kvr_feed_endpoint_check(const char *endpoint, const char *what, const char *fn);

#endif
