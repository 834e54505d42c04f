/* core/error.c - messages for KVR_* codes, and the per-call detail (core/error.h). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "kvrouter.h"

/* The calling thread's detail of its latest failing call ("" before the first).  Fixed, so
 * setting it never allocates; static TLS, so it needs no key, no constructor and no
 * destructor, and a thread that never fails never touches it. */
static _Thread_local char detail[KVR_ERROR_DETAIL_MAX];

/* A detail too long for the buffer keeps its start (the function, the field) and its end
 * (what is allowed, which details put last), with MIDDLE between, each cut between UTF-8
 * characters.  Before, the first 255 bytes were kept: a detail quoting a long user string (a
 * servers list, an endpoint) lost what it said was wrong, and could end inside a character.
 * HEAD + MIDDLE + TAIL fill the buffer; the formatting room covers the longest quoted input
 * (kvr_sync_config.servers: 2,047 characters).  On the stack: this path never allocates. */
#define MIDDLE       " ... "
#define HEAD         128
#define TAIL         (KVR_ERROR_DETAIL_MAX - 1 - HEAD - (sizeof(MIDDLE) - 1))
#define FORMAT_ROOM  4096
#define CONTINUES(c) (((unsigned char)(c)&0xc0) == 0x80) /* a UTF-8 continuation byte */

/* The length of s[0, len) without a last UTF-8 character that len cuts short. */
static size_t whole_chars(const char *s, size_t len)
{
	size_t start = len;
	while (start > 0 && CONTINUES(s[start - 1]))
		start--;
	if (start == 0)
		return len;
	unsigned char lead = (unsigned char)s[start - 1];
	size_t need = lead < 0xc0 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : 4;
	return len - (start - 1) < need ? start - 1 : len;
}

int kvr_fail(int code, const char *fmt, ...)
{
	char full[FORMAT_ROOM];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(full, sizeof(full), fmt, ap);
	va_end(ap);
	if (n < 0)
		full[0] = '\0';
	size_t len = strlen(full);
	if (n > 0 && (size_t)n >= sizeof(full)) /* cut at the room: no partial last character */
		len = whole_chars(full, len);
	full[len] = '\0';
	if (len < sizeof(detail)) {
		memcpy(detail, full, len + 1);
		return code;
	}
	size_t head = HEAD, tail = len - TAIL;
	while (head > 0 && CONTINUES(full[head]))
		head--; /* full[head] starts a character: the head ends before it */
	while (tail < len && CONTINUES(full[tail]))
		tail++;
	memcpy(detail, full, head);
	memcpy(detail + head, MIDDLE, sizeof(MIDDLE) - 1);
	memcpy(detail + head + sizeof(MIDDLE) - 1, full + tail, len - tail + 1);
	return code;
}

int kvr_fail_code(int code, const char *fn)
{
	return kvr_fail(code, "%s: %s", fn, kvr_strerror(code));
}

void kvr_error_restore(const char *saved)
{
	size_t len = strnlen(saved, sizeof(detail) - 1);
	memmove(detail, saved, len);
	detail[len] = '\0';
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
