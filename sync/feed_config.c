/*
 * sync/feed_config.c - kvr_feed_config's defaults, one copy for both builds: with ZeroMQ
 * (sync/feed.c) and without it (sync/feed_none.c), so that a program filling its config sees
 * the same defaults whichever build it links.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "core/error.h"
#include "kvrouter.h"
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

/* Whether the port of address [a, end) ("host:port") is a decimal number in lo..65535 (or '*'
 * when star).  No ':' at all is left to ZeroMQ (which refuses it). */
static bool port_ok(const char *a, const char *end, unsigned lo, bool star)
{
	const char *c = NULL;
	for (const char *p = a; p < end; p++)
		if (*p == ':')
			c = p;
	if (!c)
		return true;
	const char *d = c + 1;
	if (star && end - d == 1 && *d == '*')
		return true;
	if (d == end || end - d > 5)
		return false;
	unsigned v = 0;
	for (; d < end; d++) {
		if (*d < '0' || *d > '9')
			return false;
		v = v * 10 + (unsigned)(*d - '0');
	}
	return v >= lo && v <= 65535;
}

int kvr_feed_endpoint_check(const char *endpoint, const char *what, const char *fn)
{
	static const char tcp[] = "tcp://";
	if (!endpoint || strncmp(endpoint, tcp, sizeof(tcp) - 1) != 0)
		return 0;
	const char *a = endpoint + sizeof(tcp) - 1, *semi = strchr(a, ';');
	const char *end = a + strlen(a);
	bool ok = semi ? port_ok(a, semi, 0, true) && port_ok(semi + 1, end, 1, false)
	               : port_ok(a, end, 1, false);
	if (!ok)
		return kvr_fail(KVR_EINVAL,
		                "%s: %s \"%s\" has a port that is not a number in 1..65535 (ZeroMQ "
		                "would connect to another port)",
		                fn, what, endpoint);
	return 0;
}
