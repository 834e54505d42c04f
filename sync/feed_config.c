/*
 * sync/feed_config.c - kvr_feed_config's defaults, one copy for both builds: with ZeroMQ
 * (sync/feed.c) and without it (sync/feed_none.c), so that a program filling its config sees
 * the same defaults whichever build it links.
 */
#include <inttypes.h>
#include <string.h>

#include "core/error.h"
#include "kvrouter.h"
#include "sync/addr.h"
#include "sync/feed_config.h"

void kvr_feed_config_init(struct kvr_feed_config *cfg)
{
	if (!cfg)
		return;
	*cfg = (struct kvr_feed_config){.replay_timeout_ms = 1000,
	                                .max_msg_bytes = 64u << 20,
	                                .rcv_hwm = 100000,
	                                .idle_spin_ns = 0};
}

int kvr_feed_config_check(const struct kvr_feed_config *c, const char *fn)
{
	if (c->replay_timeout_ms == 0)
		return kvr_fail(KVR_EINVAL, "%s: config.replay_timeout_ms is 0; it must be >= 1",
		                fn);
	if (c->max_msg_bytes < 1024 || c->max_msg_bytes > INT64_MAX)
		return kvr_fail(KVR_EINVAL,
		                "%s: config.max_msg_bytes %" PRIu64
		                " is out of range [1024, %" PRId64 "]",
		                fn, c->max_msg_bytes, INT64_MAX);
	if (c->rcv_hwm == 0)
		return kvr_fail(KVR_EINVAL, "%s: config.rcv_hwm is 0; it must be >= 1", fn);
	return 0;
}

int kvr_feed_endpoint_check(const char *endpoint, const char *what, const char *fn)
{
	static const char tcp[] = "tcp://";
	if (!endpoint || strncmp(endpoint, tcp, sizeof(tcp) - 1) != 0)
		return 0;
	const char *a = endpoint + sizeof(tcp) - 1, *semi = strchr(a, ';');
	const char *end = a + strlen(a);
	bool ok =
	    semi ? kvr_addr_port_ok(a, semi, 0, true) && kvr_addr_port_ok(semi + 1, end, 1, false)
	         : kvr_addr_port_ok(a, end, 1, false);
	if (!ok)
		return kvr_fail(KVR_EINVAL,
		                "%s: %s \"%s\" has a port that is not a number in 1..65535 (ZeroMQ "
		                "would connect to another port)",
		                fn, what, endpoint);
	return 0;
}
