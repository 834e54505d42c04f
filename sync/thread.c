/*
 * sync/thread.c - see thread.h.
 */
#include "sync/thread.h"

#include <signal.h>

/* Every signal but the synchronous ones a thread raises itself (thread.h says why). */
static void async_signals(sigset_t *set)
{
	sigfillset(set);
	static const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS};
	for (unsigned i = 0; i < sizeof(faults) / sizeof(faults[0]); i++)
		sigdelset(set, faults[i]);
}

void kvr_thread_defer_signals(sigset_t *old)
{
	sigset_t block;
	async_signals(&block);
	pthread_sigmask(SIG_BLOCK, &block, old);
}

void kvr_thread_restore_signals(const sigset_t *old)
{
	pthread_sigmask(SIG_SETMASK, old, NULL);
}

int kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg)
{
	sigset_t block, old;
	async_signals(&block);
	pthread_attr_t attr;
	int err = pthread_attr_init(&attr);
	if (err)
		return err;
	if (detached)
		(void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	/* The new thread inherits the creator's mask: block, create, restore. */
	pthread_sigmask(SIG_BLOCK, &block, &old);
	err = pthread_create(t, &attr, fn, arg);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	return err;
}
