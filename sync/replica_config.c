/*
 * sync/replica_config.c - kvr_sync_config's defaults, one copy for both builds: with the `nats`
 * feature (sync/replica_nats.c) and without it (sync/replica_none.c), so that a program filling
 * its config sees the same defaults whichever build it links.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "core/error.h"
#include "kvrouter.h"
#include "sync/addr.h"
#include "sync/replica_config.h"

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

/* Whether the URL [u, end) ("[scheme://][user[:password]@]host[:port]") has no port or a
 * decimal one in 1..65535 (sync/addr.h: nats.c takes "host:99999" for port 34463). */
static bool url_port_ok(const char *u, const char *end)
{
	for (const char *p = u; p + 2 < end; p++)
		if (p[0] == ':' && p[1] == '/' && p[2] == '/') {
			u = p + 3;
			break;
		}
	for (const char *p = end; p > u; p--)
		if (p[-1] == '@') {
			u = p;
			break;
		}
	while (end > u && end[-1] == ' ') /* blanks after a URL, before the comma */
		end--;
	return kvr_addr_port_ok(u, end, 1, false);
}

int kvr_sync_config_check(const struct kvr_sync_config *c, const char *fn)
{
	if (!c->replica_id)
		return kvr_fail(KVR_EINVAL, "%s: config.replica_id is 0; it must be >= 1", fn);
	if (!c->servers)
		return kvr_fail(KVR_EINVAL, "%s: config.servers is NULL", fn);
	size_t len = strlen(c->servers), urls = 0;
	if (len >= KVR_SYNC_SERVERS_LEN)
		return kvr_fail(KVR_EINVAL, "%s: config.servers is %zu characters; at most %d", fn,
		                len, KVR_SYNC_SERVERS_LEN - 1);
	for (const char *p = c->servers; *p;) { /* as replica_nats.c's set_servers splits it */
		while (*p == ' ')
			p++;
		const char *u = p;
		while (*p && *p != ',')
			p++;
		if (u != p && ++urls && !url_port_ok(u, p))
			return kvr_fail(
			    KVR_EINVAL,
			    "%s: config.servers \"%s\": URL %zu has a port that is not a "
			    "number in 1..65535 (nats.c would connect to another port)",
			    fn, c->servers, urls);
		p += *p == ',';
	}
	if (urls < 1 || urls > KVR_SYNC_SERVERS_MAX)
		return kvr_fail(KVR_EINVAL, "%s: config.servers \"%s\" lists %zu URLs; 1 to %d", fn,
		                c->servers, urls, KVR_SYNC_SERVERS_MAX);
	/* The cluster names NATS subjects ("<cluster>.stream"): one token of them. */
	size_t n = c->cluster ? strlen(c->cluster) : 0;
	if (n < 1 || n > 64)
		return kvr_fail(KVR_EINVAL, "%s: config.cluster %s%s%s is %zu characters; 1 to 64",
		                fn, c->cluster ? "\"" : "", c->cluster ? c->cluster : "NULL",
		                c->cluster ? "\"" : "", n);
	for (size_t i = 0; i < n; i++) {
		char ch = c->cluster[i];
		if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
		      (ch >= '0' && ch <= '9') || ch == '_' || ch == '-'))
			return kvr_fail(KVR_EINVAL,
			                "%s: config.cluster \"%s\" has '%c' at %zu; only letters, "
			                "digits, '_' and '-'",
			                fn, c->cluster, ch, i);
	}
	if (!c->heartbeat_ms || c->heartbeat_ms > 60000)
		return kvr_fail(KVR_EINVAL,
		                "%s: config.heartbeat_ms %" PRIu32 " is out of range [1, 60000]",
		                fn, c->heartbeat_ms);
	if (c->dead_after < 2)
		return kvr_fail(KVR_EINVAL, "%s: config.dead_after %" PRIu32 " is below 2", fn,
		                c->dead_after);
	return 0;
}
