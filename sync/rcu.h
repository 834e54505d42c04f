/*
 * sync/rcu.h - the one place kvrouter touches liburcu.
 *
 * Flavour: urcu-bp (liburcu-bp).  Why not the others:
 *  - QSBR has the cheapest read side, but every registered thread must announce quiescent
 *    states, and a reader that goes idle without doing so stalls every grace period.  Our
 *    readers are the embedder's frontend threads; we cannot impose that contract on them.
 *  - urcu-mb puts a full memory barrier in every rcu_read_lock(); urcu-signal takes a signal
 *    from the embedder's process.
 *  - urcu-memb (the flavour until 2026-12-04) reads as cheaply, but its registry links each
 *    reader's thread-local record: after fork(2) the child keeps the records of the parent's
 *    other threads, glibc hands their stacks (and the records in them) to the child's new
 *    threads, a new registration links a record twice, and the child's first grace period
 *    loops for good (a pre-fork server creating its router in each worker hung in
 *    kvr_router_destroy; liburcu's README: every registration must end before a fork, except
 *    with urcu-bp).  urcu-bp keeps the records in its own arena and prunes the other threads'
 *    from a forked child (urcu_bp_after_fork_child, run from core/fork.c's handlers).
 *  - urcu-bp reads cost one thread-local pointer load more than urcu-memb (the record is
 *    reached through it) and the same updates; with membarrier(2) (checked at start) neither
 *    fences; the writer pays with the syscall, and writers (shard threads) are off the request
 *    path.  Measured: kvr_route 14,040 instructions a call against urcu-memb's 14,078 (the
 *    same within a run's spread); docs/measurements.md, "Fork".
 * Reader threads register themselves on their first read section; kvr_rcu_thread_online()
 * does it once per thread (and keeps kvrouter's own per-thread state), and liburcu-bp
 * unregisters a thread when it exits.
 *
 * ThreadSanitizer: TSan cannot see the ordering that membarrier(2) and liburcu's inline
 * assembly provide.  So (1) kvrouter publishes and reads RCU pointers with C11-style atomics
 * (kvr_rcu_publish / kvr_rcu_deref: release store / acquire load, which compile to plain moves
 * on x86), and (2) every read-side unlock and every call_rcu hand-off is a TSan release on one
 * token and every deferred callback starts with an acquire on it, which is exactly the
 * grace-period guarantee (and the queue hand-off to the reclaimer thread, sync/rcu.c).  Without
 * TSan the annotations compile to nothing.
 *
 * Licence note: liburcu's static-inline fast paths (_LGPL_SOURCE) are not used by default, so
 * the library only links against LGPL code; meson option urcu_inline=true turns them on.
 */
#ifndef KVR_SYNC_RCU_H
#define KVR_SYNC_RCU_H

#include <stddef.h>

#ifdef KVR_URCU_INLINE
#define _LGPL_SOURCE 1
#endif
#include <urcu/urcu-bp.h>

#if defined(__SANITIZE_THREAD__)
#define KVR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVR_TSAN 1
#endif
#endif

#ifdef KVR_TSAN
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
extern char kvr_rcu_tsan_token;
#define KVR_TSAN_RELEASE(a) __tsan_release(a)
#define KVR_TSAN_ACQUIRE(a) __tsan_acquire(a)
#else
#define KVR_TSAN_RELEASE(a) ((void)0)
#define KVR_TSAN_ACQUIRE(a) ((void)0)
#endif

/* Publish an RCU-protected pointer: every store before it is visible to a reader that sees it.
 * Ordering: release; pairs with kvr_rcu_deref(). */
#define kvr_rcu_publish(slot, val) __atomic_store_n((slot), (val), __ATOMIC_RELEASE)
/* Read an RCU-protected pointer inside a read-side section.
 * Ordering: acquire (free on x86/ARM64 data-dependent loads in practice); pairs with
 * kvr_rcu_publish(). */
#define kvr_rcu_deref(slot) __atomic_load_n((slot), __ATOMIC_ACQUIRE)

/* The first kvr_rcu_thread_online of a thread (out of line). */
int kvr_rcu_thread_register(void);

/* Takes the calling thread offline now (it is also done automatically at thread exit): the next
 * kvr_rcu_thread_online registers it again.  liburcu-bp keeps its own record of the thread
 * until the thread exits (urcu_bp_unregister_thread does nothing); outside a read section that
 * record holds up no grace period.  Context: outside a read-side section. */
void kvr_rcu_thread_offline(void);

/* The calling thread's read-side nesting depth (kvr_rcu_read_lock) and whether it is registered
 * (kvr_rcu_thread_online).  Ours, not liburcu's: liburcu keeps its reader state in a
 * thread-local of liburcu-bp.so, reached only through its out-of-line urcu_bp_read_lock /
 * unlock, each a call and a __tls_get_addr (~22 instructions a lock and ~18 an unlock, their
 * own, plus the __tls_get_addr; urcu-memb's were ~16 and ~29: callgrind, bench_route at 2k
 * tokens).  Counting the nesting here makes every section opened inside
 * another a thread-local increment and decrement, so a caller can open one real section around
 * a stretch of work whose callees open their own (kvr_route: the lookup, the choice and the
 * post).  Initial-exec: one %fs-relative access even in libkvrouter.so (the default model
 * for a shared library's thread-local is a __tls_get_addr call per function); a library
 * loaded with dlopen takes these 8 bytes from glibc's reserve of static TLS for such
 * libraries.  Context: the owning thread only. */
struct kvr_rcu_thread {
	unsigned nest;
	int online;
};
extern _Thread_local struct kvr_rcu_thread kvr_rcu_self __attribute__((tls_model("initial-exec")));

/* Read-side critical section.  Nestable: only the outermost lock and unlock reach liburcu
 * (urcu_bp_read_lock / unlock, which nest too: the counts are the same).  Context: a thread
 * made online.
 *
 * liburcu's inline forms of these (_LGPL_SOURCE, urcu/static/urcu-bp.h) stay behind meson's
 * urcu_inline option, off: kvrouter is Apache-2.0, and liburcu's README asks for _LGPL_SOURCE
 * only from LGPL- or GPL-compatible code (URCU_INLINE_SMALL_FUNCTIONS, allowed under any
 * licence, inlines rcu_dereference and rcu_assign_pointer only).  So the outermost section
 * pays the calls (~80 instructions with their __tls_get_addr), the inner ones ~4. */
static inline void kvr_rcu_read_lock(void)
{
	if (kvr_rcu_self.nest++ == 0)
		urcu_bp_read_lock();
}

static inline void kvr_rcu_read_unlock(void)
{
#ifdef KVR_TSAN
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
#endif
	if (--kvr_rcu_self.nest == 0)
		urcu_bp_read_unlock();
}

/* The calling thread's read-side nesting depth (0: outside any section).  Context: any
 * thread. */
static inline unsigned kvr_rcu_read_depth(void)
{
	return kvr_rcu_self.nest;
}

/* Whether the calling thread is inside a read-side section (kvr_rcu_read_lock).  For asserts.
 * Context: any thread. */
static inline int kvr_rcu_read_ongoing(void)
{
	return kvr_rcu_self.nest != 0;
}

/* Registers the calling thread as an RCU reader if it is not yet.  Returns 0 or KVR_ENOMEM.
 * Context: any thread, outside a read-side section.  After the first call, one thread-local
 * test (kvr_route calls it twice a route). */
static inline int kvr_rcu_thread_online(void)
{
	return __builtin_expect(kvr_rcu_self.online, 1) ? 0 : kvr_rcu_thread_register();
}

/*
 * Frees mem with free_fn(mem) after a grace period, without blocking the caller.
 * Allocates a small record (kvr_alloc); if that fails, or the calling thread cannot be registered
 * (kvr_rcu_thread_online fails), it falls back to waiting for a grace period synchronously, so
 * memory is never leaked nor freed early.
 * Context: any thread (registered here if it is not yet), outside a read-side section.
 */
void kvr_rcu_defer_free(void *mem, void (*free_fn)(void *));

/*
 * call_rcu on an rcu_head embedded in the caller's object (no extra allocation), run by
 * kvrouter's reclaimer thread (sync/rcu.c; not liburcu's call_rcu: it aborts where it cannot
 * start a thread), oldest first, after a grace period.  Never waits.  fn must start
 * with KVR_RCU_CALLBACK_ENTER() so ThreadSanitizer sees the grace period.
 * Context: a registered thread (shard threads are), outside a read-side section.
 */
void kvr_rcu_call(struct rcu_head *head, void (*fn)(struct rcu_head *));
#define KVR_RCU_CALLBACK_ENTER() KVR_TSAN_ACQUIRE(&kvr_rcu_tsan_token)

/* Waits for a grace period.  Context: registered or not, outside a read-side section. */
void kvr_rcu_synchronize(void);

/* Waits until every deferred free queued so far has run (used at shutdown and in tests).
 * Context: outside a read-side section. */
void kvr_rcu_barrier(void);

/*
 * Starts the reclaimer, the thread that runs kvr_rcu_call's callbacks (sync/rcu.c says why it is
 * kvrouter's, not liburcu's call_rcu), if this process has none yet; kvr_rcu_call and
 * kvr_rcu_barrier start it too when needed.  Returns 0 or pthread_create's error (nothing
 * started; what is queued waits for a later start, or a barrier runs it).
 * Context: any thread, outside a read-side section.
 */
int kvr_rcu_start(void);

/*
 * fork(2), in the order core/fork.c runs them (its handlers):
 *  - kvr_rcu_fork_reclaimer: before, the reclaimer is held between batches (the callbacks free
 *    kvrouter's memory and must not hold an allocator's lock across the fork); after, the
 *    parent's goes on, and the child's state is reset (no reclaimer there: the child starts one
 *    with its first router or deferred free; the callbacks queued in the parent and not run run
 *    there).  Queueing threads never wait: the queue is pushed with one compare-and-swap.
 *  - kvr_rcu_fork_registry: liburcu-bp's grace-period and registry locks held across the fork;
 *    the child's registry keeps the forking thread only.
 * Context: core/fork.c's pthread_atfork handlers only.
 */
enum kvr_fork_phase { KVR_FORK_PREPARE, KVR_FORK_PARENT, KVR_FORK_CHILD };
void kvr_rcu_fork_reclaimer(enum kvr_fork_phase phase);
void kvr_rcu_fork_registry(enum kvr_fork_phase phase);
#endif /* KVR_SYNC_RCU_H */
