/*
 * core/error.h - the per-call error detail behind kvr_last_error() (kvrouter.h).
 *
 * A failing entry point says which argument was wrong by returning through kvr_fail(), which
 * formats into a fixed thread-local buffer and hands the code back:
 *
 *     return kvr_fail(KVR_EINVAL, "kvr_route: n_tokens %zu exceeds %u", n, max);
 *
 * Both functions are cold and noinline: a call site is a branch the success path never takes
 * to a call it never makes, so the success path writes nothing and stays the code it was
 * (callgrind per kvr_route: docs/measurements.md, "per-call error detail").  Nothing here
 * allocates (vsnprintf into a stack buffer; a detail longer than KVR_ERROR_DETAIL_MAX - 1 bytes
 * keeps its start and its end, error.c says why), so a detail can be set on an out-of-memory
 * path, inside a router callback, on any thread.
 *
 * The rule that keeps a detail from outliving its call: every failing return of an API entry
 * point goes through one of the two, a specific kvr_fail() where the entry point knows the
 * cause (argument and configuration checks) and kvr_fail_code() for a code that comes up from
 * below (a shard's answer, an allocation), which says "<function>: <kvr_strerror(code)>".
 * Internal layers below the API never call them; a code they return is the entry point's to
 * explain.  Base layer: usable from core/, shards/ and sync/.
 */
#ifndef KVR_CORE_ERROR_H
#define KVR_CORE_ERROR_H

#define KVR_ERROR_DETAIL_MAX 256

/* Formats the detail ("<kvr_ function>: <what was wrong>") into the calling thread's buffer
 * and returns code.  Context: any thread; the failing return of an API entry point only. */
__attribute__((cold, noinline, format(printf, 2, 3))) int kvr_fail(int code, const char *fmt, ...);

/* kvr_fail(code, "%s: %s", fn, kvr_strerror(code)): the detail of a code the entry point fn
 * passes up without knowing more.  Context: as kvr_fail. */
__attribute__((cold, noinline)) int kvr_fail_code(int code, const char *fn);

/* Puts back a detail copied from kvr_last_error() before an inner API call: an entry point that
 * returns 0 although a call it made failed (kvr_route_cancel's abort of an attempt that expired
 * meanwhile) leaves the caller's detail as it was, as every successful call does.  Context: the
 * thread that saved it. */
__attribute__((cold, noinline)) void kvr_error_restore(const char *saved);

#endif
