/*
 * sync/thread.h - starting the library's own threads (shards, the RCU reclaimer, a feed's and a
 * replica's threads).
 *
 * Every such thread starts with the asynchronous signals blocked.  A process-directed signal
 * (kill(2): SIGTERM, SIGINT, SIGUSR1, SIGCHLD, ...) goes to any thread that does not block it,
 * and a library's threads are not where the embedder expects it: a server that blocks SIGTERM
 * in its threads and reads it with sigwait or signalfd got it delivered to a shard thread, which
 * did not block it (created earlier), and the default action ended the process; a handler ran
 * on a shard thread in the middle of a booking.  liburcu's, ZeroMQ's and jemalloc's own threads
 * block signals the same way.  The synchronous ones a thread raises itself stay unblocked
 * (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS): blocked, the kernel would reset them to
 * their default action and the embedder's crash handler (a stack-trace printer) would miss a
 * crash on a library thread.
 */
#ifndef KVR_SYNC_THREAD_H
#define KVR_SYNC_THREAD_H

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>

/* pthread_create(t, attributes: detached or joinable, fn, arg) with the signals above blocked
 * in the new thread (the caller's mask is restored before this returns).  Returns 0 or
 * pthread_create's error.  Context: any thread. */
int kvr_thread_start(pthread_t *t, bool detached, void *(*fn)(void *), void *arg);

/* Blocks the asynchronous signals on the calling thread (*old gets its mask) around a
 * third-party library's blocking I/O that does not retry EINTR: nats.c's connect took a
 * profiler's SIGPROF for a broken connection ("IO Error", "Protocol Error").  What arrives
 * meanwhile stays pending and is delivered at kvr_thread_restore_signals (one of each kind).
 * Context: any thread. */
void kvr_thread_defer_signals(sigset_t *old);
void kvr_thread_restore_signals(const sigset_t *old);

#endif
