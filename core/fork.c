/*
 * core/fork.c - routers across fork(2): see fork.h.
 *
 * The handlers (pthread_atfork, registered with the first router) in the order they must run:
 *   prepare: kvrouter's RCU reclaimer between batches (sync/rcu.c: the deferred frees it runs
 *            may need the locks below), then kvrouter's process-wide locks (this file's list,
 *            the metrics registries, the feeds' wait-for graph), then liburcu-bp's
 *            grace-period and registry locks (a thread holding one of ours may be waiting for
 *            a grace period, never the other way round);
 *   parent:  all of it released in the reverse order;
 *   child:   liburcu-bp's registry pruned to this thread and its locks released, every router
 *            live at the fork marked inherited (its shards refuse every post), kvrouter's locks
 *            released, the reclaimer's state reset (its thread stayed in the parent; the child
 *            starts its own with its first router, or its first deferred free).
 * glibc runs these prepare handlers before it takes its allocator's locks for the fork, and
 * jemalloc's (registered before ours, at its initialisation) after ours, so the reclaimer, held
 * between batches, never holds an allocator lock the fork needs.  A thread queueing a deferred
 * free meanwhile does not wait: its one compare-and-swap leaves the queue whole in both
 * processes.
 */
#include "core/fork.h"

#include <pthread.h>

#include "core/router_internal.h"
#include "sync/rcu.h"

static pthread_once_t handlers_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t fork_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kvr_router *tracked; /* live routers, under fork_lock, through fork_next */
/* This process's generation: 0 in the process that first loaded the library, +1 in each
 * child of a fork.  A router records it at creation. */
static uint32_t fork_gen;

static void on_prepare(void)
{
	kvr_rcu_fork_reclaimer(KVR_FORK_PREPARE);
	pthread_mutex_lock(&fork_lock);
	kvr_metrics_fork(true);
	kvr_feed_fork(true);
	kvr_rcu_fork_registry(KVR_FORK_PREPARE);
}

static void on_parent(void)
{
	kvr_rcu_fork_registry(KVR_FORK_PARENT);
	kvr_feed_fork(false);
	kvr_metrics_fork(false);
	pthread_mutex_unlock(&fork_lock);
	kvr_rcu_fork_reclaimer(KVR_FORK_PARENT);
}

static void on_child(void)
{
	kvr_rcu_fork_registry(KVR_FORK_CHILD);
	__atomic_store_n(&fork_gen, fork_gen + 1, __ATOMIC_RELAXED);
	for (struct kvr_router *r = tracked; r; r = r->fork_next) {
		__atomic_store_n(&r->shutting_down, 1, __ATOMIC_RELEASE);
		kvr_shards_orphan(r->shards);
		kvr_metrics_fork_forget(r->metrics);
	}
	tracked = NULL; /* the parent's: nothing here destroys them */
	kvr_feed_fork(false);
	kvr_metrics_fork(false);
	pthread_mutex_unlock(&fork_lock);
	kvr_rcu_fork_reclaimer(KVR_FORK_CHILD);
}

static void register_handlers(void)
{
	/* Fails only without memory for glibc's handler record; a process that never forks does
	 * not need them, and one that does finds its inherited routers unmarked (as before). */
	(void)pthread_atfork(on_prepare, on_parent, on_child);
}

void kvr_fork_track(struct kvr_router *r)
{
	pthread_once(&handlers_once, register_handlers);
	pthread_mutex_lock(&fork_lock);
	r->fork_gen = __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
	r->fork_next = tracked;
	tracked = r;
	pthread_mutex_unlock(&fork_lock);
}

void kvr_fork_untrack(struct kvr_router *r)
{
	pthread_mutex_lock(&fork_lock);
	for (struct kvr_router **pp = &tracked; *pp; pp = &(*pp)->fork_next) {
		if (*pp == r) {
			*pp = r->fork_next;
			break;
		}
	}
	pthread_mutex_unlock(&fork_lock);
}

bool kvr_fork_inherited(const struct kvr_router *r)
{
	return r->fork_gen != __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
}

const char *kvr_router_gone(const struct kvr_router *r)
{
	return r && kvr_fork_inherited(r)
	           ? "the router was created before this process forked (its shard threads "
	             "stayed in the parent): a forked child creates its own"
	           : "the router is being destroyed";
}
