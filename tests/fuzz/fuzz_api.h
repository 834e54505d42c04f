/* tests/fuzz/fuzz_api.h - the API fuzzer's entry points, shared by the libFuzzer target and the
 * seeded driver (fuzz_api_main.c). */
#ifndef KVR_TESTS_FUZZ_API_H
#define KVR_TESTS_FUZZ_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvrouter.h"

struct fuzz_api_stats {
	uint64_t calls;
};

extern struct fuzz_api_stats fuzz_api_totals;
extern uint64_t fuzz_api_current_seed;
/* Crafted hash-given prompts (fuzz_api.c, craft_hashes; also FUZZ_API_CRAFT=1): off by default,
 * so a seed or a corpus file runs the same program as before. */
extern bool fuzz_api_craft;
/* Events mode as engines feed it (fuzz_api.c, events_ext and op_ev_probe; also
 * FUZZ_API_EVENTS=1): every router in events mode, engine hashes equal to the router's, per rank
 * and per rank life, or crafted, and query-only routes whose overlap the model knows.  Off by
 * default, like fuzz_api_craft. */
extern bool fuzz_api_events;
/* Configuration values at their limits (fuzz_api.c, limit_config; also FUZZ_API_LIMITS=1): block
 * sizes 3..65536, lanes of 2-4 messages, scheduler and time settings of 1 ns or near 2^64, one or
 * 65536 ranks, extreme selection weights.  Off by default, like fuzz_api_craft. */
extern bool fuzz_api_limits;
/* A clock that also steps back (fuzz_api.c, op_clock; also FUZZ_API_CLOCK_BACK=1): a third of the
 * clock steps go back instead of forward, as a wall clock or a rewound virtual clock would.  The
 * model then expects nothing of when leases expire, and everything else as before: nothing lost
 * or leaked, every attempt ended once, all load back to zero.  Off by default, like
 * fuzz_api_craft. */
extern bool fuzz_api_clock_back;
/* A slow on_admit off the program's thread (fuzz_api.c, on_admit; also FUZZ_API_SLOW_ADMIT=1): it
 * sleeps 1 ms before it reports, so the admission thread's reports come after later calls, as an
 * embedder's slow callback or a preemption makes them.  The same programs as without it; the
 * model must not tell them apart. */
extern bool fuzz_api_slow_admit;
/* A stalled admission (fuzz_api.c, vclock; also FUZZ_API_STALL_ADMIT=1): the router's clock, read
 * on its admission thread, sleeps 1 ms, so the pass holds an admission it made for that long
 * before it counts the request out of the queue; and the program pauses 3 ms after a route that
 * returned KVR_EAGAIN, so that admission's report comes before the model judges the refusal.  The
 * preemptions of both threads a loaded machine makes, rarely together (--limits seed 62208646:
 * "KVR_EAGAIN with at most 0 of 1 queued", once in some 500 runs).  The same programs as without
 * it. */
extern bool fuzz_api_stall_admit;

/* Runs one program (on a fresh thread); aborts with a message on any violation.  *calls (may be
 * NULL) is increased by the number of API operations it ran. */
void fuzz_api_run(const uint8_t *data, size_t size, uint64_t *calls);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * kvr_last_error()'s contract (kvrouter.h), checked around every int-returning call of the API
 * fuzzers (fuzz_api.c, oom_api.c, oom_api_threads.c; each wraps these in its own API() macro so
 * that a violation is reported with its seed):
 *  - rc < 0: the calling thread's detail begins with "<function>: " and says something after it;
 *    if what it says is a kvr_strerror() text, it is rc's, not another code's;
 *  - rc >= 0: the detail is byte for byte what it was before the call (errno's convention).
 * fuzz_err_arm() runs just before the call: it copies the detail (at most 255 bytes, the
 * library's buffer) and, when the detail already names the function about to be called (the
 * same call failing twice in a row), first replaces it by a failure of another, stateless call,
 * so that a failing call that writes nothing cannot pass on its predecessor's text.  Per thread,
 * no allocation: it runs with an allocation failure armed too.  Context: the calling thread.
 */
static _Thread_local char fuzz_err_before[256];
static _Thread_local char fuzz_err_why[768];
static _Thread_local const char *fuzz_err_ptr; /* the thread's first kvr_last_error() */

static inline bool fuzz_err_names(const char *detail, const char *fn)
{
	size_t n = strlen(fn);
	return !strncmp(detail, fn, n) && detail[n] == ':' && detail[n + 1] == ' ';
}

/* fn: the function about to be called; alt: another function whose name its failure may carry
 * (kvr_route with KVR_ROUTE_WAIT reports its wait's failure as kvr_route_wait's), or NULL. */
static inline void fuzz_err_arm(const char *fn, const char *alt)
{
	const char *e = kvr_last_error();
	if (!fuzz_err_ptr)
		fuzz_err_ptr = e;
	if (e && (fuzz_err_names(e, fn) || (alt && fuzz_err_names(e, alt)))) {
		if (strcmp(fn, "kvr_hash_extend"))
			(void)kvr_hash_extend(NULL, NULL, 0, 0, NULL, NULL, NULL, NULL);
		else
			(void)kvr_config_validate(NULL);
		e = kvr_last_error();
	}
	size_t n = e ? strnlen(e, sizeof(fuzz_err_before) - 1) : 0;
	memcpy(fuzz_err_before, e ? e : "", n);
	fuzz_err_before[n] = 0;
}

/* A function that returns no code (void, a count, a hash) never writes the detail: NULL when it
 * is as it was, else what is wrong. */
static inline const char *fuzz_err_untouched(const char *fn)
{
	const char *e = kvr_last_error();
	if (e && !strcmp(e, fuzz_err_before))
		return NULL;
	snprintf(fuzz_err_why, sizeof(fuzz_err_why),
	         "%s (no return code) changed kvr_last_error() from \"%s\" to \"%s\"", fn,
	         fuzz_err_before, e ? e : "(NULL)");
	return fuzz_err_why;
}

/* NULL when the detail after the call keeps the contract for rc, else what is wrong. */
static inline const char *fuzz_err_verdict(const char *fn, const char *alt, int rc)
{
	const char *e = kvr_last_error();
	if (!e)
		return "kvr_last_error() returned NULL";
	if (e != fuzz_err_ptr) /* "The pointer stays valid until the thread ends" */
		return "kvr_last_error() returned another pointer than before on this thread";
	if (rc >= 0) {
		if (!strcmp(e, fuzz_err_before))
			return NULL;
		snprintf(fuzz_err_why, sizeof(fuzz_err_why),
		         "%s returned %d, yet kvr_last_error() changed from \"%s\" to \"%s\"", fn,
		         rc, fuzz_err_before, e);
		return fuzz_err_why;
	}
	const char *name = fuzz_err_names(e, fn) ? fn : alt && fuzz_err_names(e, alt) ? alt : NULL;
	const char *what = name ? e + strlen(name) + 2 : NULL;
	const char *wrong = NULL;
	if (what)
		for (int c = KVR_ENOTSUP; c < 0 && !wrong; c++)
			if (c != rc && !strcmp(what, kvr_strerror(c)))
				wrong = kvr_strerror(c);
	if (what && *what && !wrong)
		return NULL;
	snprintf(fuzz_err_why, sizeof(fuzz_err_why),
	         "%s returned %d (%s), yet kvr_last_error() is \"%s\" (before the call \"%s\"): %s",
	         fn, rc, kvr_strerror(rc), e, fuzz_err_before,
	         !what    ? "it does not begin with the function's name and \": \""
	         : !*what ? "it says nothing after the function's name"
	                  : "it gives another code's text");
	return fuzz_err_why;
}

#endif
