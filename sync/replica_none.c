/*
 * sync/replica_none.c - the kvr_sync_* API in a build without the `nats` feature: attach says
 * KVR_ENOTSUP, everything else KVR_EINVAL (no handle can exist).  kvr_sync_config_init is
 * shared with the nats build (sync/replica_config.c).
 */
#include "core/error.h"
#include "kvrouter.h"

int kvr_sync_attach(struct kvr_router *r, const struct kvr_sync_config *c, struct kvr_sync **out)
{
	(void)r;
	(void)c;
	if (out)
		*out = NULL;
	return kvr_fail(KVR_ENOTSUP, "kvr_sync_attach: built without NATS (-Dnats=disabled)");
}

void kvr_sync_detach(struct kvr_sync *s)
{
	(void)s;
}

int kvr_sync_wait_ready(struct kvr_sync *s, uint32_t timeout_ms)
{
	(void)s;
	(void)timeout_ms;
	return kvr_fail(KVR_EINVAL, "kvr_sync_wait_ready: no replica handle exists in a build "
	                            "without NATS (-Dnats=disabled)");
}

int kvr_sync_drain(struct kvr_sync *s, uint32_t timeout_ms)
{
	(void)s;
	(void)timeout_ms;
	return kvr_fail(
	    KVR_EINVAL,
	    "kvr_sync_drain: no replica handle exists in a build without NATS (-Dnats=disabled)");
}

int kvr_sync_get_stats(struct kvr_sync *s, struct kvr_sync_stats *out)
{
	(void)s;
	(void)out;
	return kvr_fail(KVR_EINVAL, "kvr_sync_get_stats: no replica handle exists in a build "
	                            "without NATS (-Dnats=disabled)");
}

int kvr_sync_peer_seq(struct kvr_sync *s, uint64_t replica_id, uint64_t *seq)
{
	(void)s;
	(void)replica_id;
	(void)seq;
	return kvr_fail(KVR_EINVAL, "kvr_sync_peer_seq: no replica handle exists in a build "
	                            "without NATS (-Dnats=disabled)");
}
