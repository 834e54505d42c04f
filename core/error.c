/* core/error.c - messages for KVR_* codes, and the per-call detail (core/error.h). */
#include <stdarg.h>
#include <stdio.h>

#include "core/error.h"
#include "kvrouter.h"

/* The calling thread's detail of its latest failing call ("" before the first).  Fixed, so
 * setting it never allocates; static TLS, so it needs no key, no constructor and no
 * destructor, and a thread that never fails never touches it. */
static _Thread_local char detail[KVR_ERROR_DETAIL_MAX];

int kvr_fail(int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	(void)vsnprintf(detail, sizeof(detail), fmt, ap); /* truncates; always terminated */
	va_end(ap);
	return code;
}

int kvr_fail_code(int code, const char *fn)
{
	return kvr_fail(code, "%s: %s", fn, kvr_strerror(code));
}

const char *kvr_last_error(void)
{
	return detail;
}

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
