/*
 * sync/feed_config.c - kvr_feed_config's defaults, one copy for both builds: with ZeroMQ
 * (sync/feed.c) and without it (sync/feed_none.c), so that a program filling its config sees
 * the same defaults whichever build it links.
 */
#include "kvrouter.h"

void kvr_feed_config_init(struct kvr_feed_config *cfg)
{
	if (!cfg)
		return;
	*cfg = (struct kvr_feed_config){.replay_timeout_ms = 1000,
	                                .max_msg_bytes = 64u << 20,
	                                .rcv_hwm = 100000,
	                                .idle_spin_ns = 0};
}
