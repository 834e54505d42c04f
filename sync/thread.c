/*
 * sync/thread.c - see thread.h.
 */
#include "sync/thread.h"

#include <signal.h>

int kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg)
{
	sigset_t block, old;
	sigfillset(&block);
	static const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS};
	for (unsigned i = 0; i < sizeof(faults) / sizeof(faults[0]); i++)
		sigdelset(&block, faults[i]);
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
