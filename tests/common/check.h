/*
 * tests/common/check.h - the plain (non-Criterion) test programs' check: CHECK(cond, fmt, ...)
 * prints the failed condition with a message and counts it in `failures`, and the program goes
 * on; main returns failures != 0.  check_deadline(s) bounds the whole run: a call that waits for
 * good is reported and the program exits 1 after s seconds.
 */
#ifndef KVR_TESTS_COMMON_CHECK_H
#define KVR_TESTS_COMMON_CHECK_H

#include <signal.h>
#include <stdio.h>
#include <unistd.h>

static int failures;
#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);            \
			fprintf(stderr, __VA_ARGS__);                                              \
			fprintf(stderr, "\n");                                                     \
			failures++;                                                                \
		}                                                                                  \
	} while (0)

static inline void check_deadline_hit(int sig)
{
	(void)sig;
	static const char m[] = "FAIL: past the test's deadline: a call waited for good\n";
	(void)!write(2, m, sizeof(m) - 1);
	_exit(1);
}

/* SIGALRM after `seconds`: for programs that use no SIGALRM of their own. */
static inline void check_deadline(unsigned seconds)
{
	signal(SIGALRM, check_deadline_hit);
	alarm(seconds);
}

#endif
