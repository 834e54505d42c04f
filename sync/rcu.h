/*
 * sync/rcu.h - the one place kvrouter touches liburcu.
 *
 * Flavour: urcu-memb (liburcu-memb).  Why not the others:
 *  - QSBR has the cheapest read side, but every registered thread must announce quiescent
 *    states, and a reader that goes idle without doing so stalls every grace period.  Our
 *    readers are the embedder's frontend threads; we cannot impose that contract on them.
 *  - urcu-mb puts a full memory barrier in every rcu_read_lock(); urcu-signal takes a signal
 *    from the embedder's process; urcu-bp auto-registers but pays a heavier read side.
 *  - urcu-memb reads cost two thread-local updates and compiler barriers; the writer pays with
 *    the membarrier(2) syscall, and writers (shard threads) are off the request path.
 * Reader threads must be registered: kvr_rcu_thread_online() does it lazily, once per thread,
 * and a pthread key unregisters the thread when it exits.
 *
 * ThreadSanitizer: TSan cannot see the ordering that membarrier(2) and liburcu's inline
 * assembly provide.  So (1) kvrouter publishes and reads RCU pointers with C11-style atomics
 * (kvr_rcu_publish / kvr_rcu_deref: release store / acquire load, which compile to plain moves
 * on x86), and (2) every read-side unlock and every call_rcu hand-off is a TSan release on one
 * token and every deferred callback starts with an acquire on it, which is exactly the
 * grace-period guarantee (and the queue hand-off to liburcu's callback thread).  Without TSan the
 * annotations compile to nothing.
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
#include <urcu/urcu-memb.h>

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

/* Registers the calling thread as an RCU reader if it is not yet.  Returns 0 or KVR_ENOMEM.
 * Context: any thread, outside a read-side section.  Cheap after the first call. */
int kvr_rcu_thread_online(void);

/* Unregisters the calling thread now (it is also done automatically at thread exit).
 * Context: outside a read-side section. */
void kvr_rcu_thread_offline(void);

/* Read-side critical section.  Nestable.  Context: a thread made online. */
static inline void kvr_rcu_read_lock(void)
{
	urcu_memb_read_lock();
}

static inline void kvr_rcu_read_unlock(void)
{
#ifdef KVR_TSAN
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
#endif
	urcu_memb_read_unlock();
}

/*
 * Frees mem with free_fn(mem) after a grace period, without blocking the caller.
 * Allocates a small record (kvr_alloc); if that fails, it falls back to waiting for a grace
 * period synchronously, so memory is never leaked nor freed early.
 * Context: a registered thread, outside a read-side section.
 */
void kvr_rcu_defer_free(void *mem, void (*free_fn)(void *));

/*
 * call_rcu on an rcu_head embedded in the caller's object (no extra allocation).  fn must start
 * with KVR_RCU_CALLBACK_ENTER() so ThreadSanitizer sees the grace period.
 * Context: a registered thread (shard threads are), outside a read-side section.
 */
static inline void kvr_rcu_call(struct rcu_head *head, void (*fn)(struct rcu_head *))
{
	/* The hand-off to liburcu's call_rcu thread is invisible to TSan: publish our writes. */
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	urcu_memb_call_rcu(head, fn);
}
#define KVR_RCU_CALLBACK_ENTER() KVR_TSAN_ACQUIRE(&kvr_rcu_tsan_token)

/* Waits for a grace period.  Context: registered or not, outside a read-side section. */
void kvr_rcu_synchronize(void);

/* Waits until every deferred free queued so far has run (used at shutdown and in tests).
 * Context: outside a read-side section. */
void kvr_rcu_barrier(void);

#endif /* KVR_SYNC_RCU_H */
