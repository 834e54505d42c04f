/* core/error.c - messages for KVR_* codes. */
#include "kvrouter.h"

const char *kvr_strerror(int code)
{
	switch (code) {
	case KVR_OK:
		return "success";
	case KVR_EINVAL:
		return "invalid argument";
	case KVR_ENOMEM:
		return "out of memory";
	case KVR_ENOENT:
		return "no such rank, attempt, block or object";
	case KVR_ESTALE:
		return "stale incarnation or attempt already ended";
	case KVR_EAGAIN:
		/* Not only the waiting queue: a shard's lane that stayed full, or 2^20 live
		 * attempts, say the same (kvr_route, the lifecycle calls). */
		return "router overloaded (queue or lane full), try again";
	case KVR_EEXIST:
		return "already exists";
	case KVR_EBUSY:
		return "busy";
	case KVR_ERANGE:
		return "value out of range";
	case KVR_ETIMEDOUT:
		return "deadline passed";
	case KVR_ESHUTDOWN:
		return "router is shutting down";
	case KVR_ENOTSUP:
		return "not supported by this build";
	default:
		return "unknown error";
	}
}

const char *kvr_version(void)
{
	return KVR_VERSION_STRING;
}
