/*
 * core/fork.h - routers across fork(2).
 *
 * A router's shard threads (and the library's RCU reclaimer) are not copied into a child: a
 * router live at the fork is the parent's, and in the child every call on it fails with
 * KVR_ESHUTDOWN at once (a call would otherwise wait for a shard that is not there, or book
 * work nobody runs), and kvr_router_destroy leaves it (its memory is the parent's copy; joining
 * threads that are not there would wait for good).  A router created in the child is the
 * child's and works as any.  What must hold across the fork for that, the handlers do: the
 * process-wide locks kvrouter and liburcu-bp take are held across it (so none is copied held
 * by a thread that is not there), and the child's RCU registry keeps the forking thread only.
 */
#ifndef KVR_CORE_FORK_H
#define KVR_CORE_FORK_H

#include <stdbool.h>

struct kvr_router;

/* Registers the fork handlers (once per process) and r as live: a child forked from now on
 * inherits it.  Context: kvr_router_create, before r has threads. */
void kvr_fork_track(struct kvr_router *r);

/* r is gone (kvr_router_destroy); untracked routers are left alone by the handlers. */
void kvr_fork_untrack(struct kvr_router *r);

/* Whether r was created in another process (this one's parent, before a fork).  One relaxed
 * load.  Context: any thread. */
bool kvr_fork_inherited(const struct kvr_router *r);

/* Why calls on r fail with KVR_ESHUTDOWN, for their detail: "the router is being destroyed",
 * or, inherited, what to do instead.  Context: any thread. */
const char *kvr_router_gone(const struct kvr_router *r);

/* The process-wide locks other modules hold (core/metrics.c, sync/feed.c), taken before a fork
 * and released after it, in both processes.  Context: the fork handlers only. */
void kvr_metrics_fork(bool before);
/* In the child, with the metrics lock held (kvr_metrics_fork(true)): an inherited router's
 * registry leaves the process's list. */
struct kvr_metrics;
void kvr_metrics_fork_forget(struct kvr_metrics *m);
void kvr_feed_fork(bool before);

#endif /* KVR_CORE_FORK_H */
