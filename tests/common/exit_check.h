/*
 * tests/common/exit_check.h - for the plain test programs that fork children and check their
 * exit status (test_dlopen, test_signals, test_thread_limit): a CHECK that ends the process at
 * once (_exit: safe in a forked child of a threaded process), a child runner, and a router
 * workload.
 */
#ifndef KVR_TESTS_COMMON_EXIT_CHECK_H
#define KVR_TESTS_COMMON_EXIT_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvrouter.h"

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                            \
			fprintf(stderr, __VA_ARGS__);                                              \
			fputc('\n', stderr);                                                       \
			_exit(1);                                                                  \
		}                                                                                  \
	} while (0)

/* Runs fn(arg) in a forked child under a 60 s alarm (a wait for good ends it with SIGALRM);
 * returns the child's wait status.  Context: the parent's main thread. */
static inline int kvr_test_run_child(int (*fn)(void *), void *arg)
{
	fflush(NULL);
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		alarm(60);
		_exit(fn(arg));
	}
	int st = 0;
	CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	return st;
}

/* Routes and finishes n prompts of n_tokens (at most 1024), the first half of each shared. */
static inline void kvr_test_route_finish(struct kvr_router *r, int n, size_t n_tokens)
{
	uint32_t tok[1024];
	CHECK(n_tokens <= 1024, "n_tokens %zu", n_tokens);
	for (int i = 0; i < n; i++) {
		for (size_t t = 0; t < n_tokens; t++)
			tok[t] = t < n_tokens / 2 ? (uint32_t)t : (uint32_t)(i * 7919 + (int)t);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n_tokens;
		struct kvr_decision d;
		int rc = kvr_route(r, &q, &d);
		CHECK(rc == 0, "kvr_route: %d (%s)", rc, kvr_last_error());
		rc = kvr_request_finish(r, d.attempt);
		CHECK(rc == 0, "kvr_request_finish: %d (%s)", rc, kvr_last_error());
	}
}

#endif
