/*
 * sync/rcu.c - reader registration on urcu-bp, and deferred frees on a reclaimer thread of our
 * own (see rcu.h for the why).
 */
#include "sync/rcu.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/park.h"
#include "sync/thread.h"

#ifdef KVR_TSAN
char kvr_rcu_tsan_token;
#endif

struct deferred {
	struct rcu_head head;
	void *mem;
	void (*free_fn)(void *);
};

static pthread_key_t online_key;
static pthread_once_t online_once = PTHREAD_ONCE_INIT;
static int online_key_err;
_Thread_local struct kvr_rcu_thread kvr_rcu_self __attribute__((tls_model("initial-exec")));

/* Runs at thread exit for a thread that came online through kvr_rcu_thread_online(). */
static void thread_exit_offline(void *unused)
{
	(void)unused;
	if (kvr_rcu_self.online) {
		urcu_bp_unregister_thread();
		kvr_rcu_self.online = 0;
	}
}

static void make_key(void)
{
	online_key_err = pthread_key_create(&online_key, thread_exit_offline);
}

int kvr_rcu_thread_register(void)
{
	if (kvr_rcu_self.online)
		return 0;
	pthread_once(&online_once, make_key);
	if (online_key_err)
		return KVR_ENOMEM;
	/* Any non-NULL value makes the destructor run at thread exit. */
	if (pthread_setspecific(online_key, &kvr_rcu_self) != 0)
		return KVR_ENOMEM;
	urcu_bp_register_thread();
	kvr_rcu_self.online = 1;
	return 0;
}

void kvr_rcu_thread_offline(void)
{
	if (!kvr_rcu_self.online)
		return;
	urcu_bp_unregister_thread();
	kvr_rcu_self.online = 0;
	pthread_setspecific(online_key, NULL);
}

static void run_deferred(struct rcu_head *head)
{
	struct deferred *d = caa_container_of(head, struct deferred, head);
	KVR_TSAN_ACQUIRE(&kvr_rcu_tsan_token);
	d->free_fn(d->mem);
	kvr_free(d, sizeof(*d));
}

void kvr_rcu_defer_free(void *mem, void (*free_fn)(void *))
{
	if (!mem)
		return;
	/* call_rcu requires a registered caller (shard threads are, for life).  A thread that
	 * cannot be registered (pthread keys exhausted) takes the synchronous path, which needs no
	 * registration: this returns void, and waiting is neither a leak nor an early free. */
	struct deferred *d = kvr_rcu_thread_online() == 0 ? kvr_alloc(sizeof(*d)) : NULL;
	if (!d) {
		/* No memory for the record: pay a grace period here instead of leaking. */
		urcu_bp_synchronize_rcu();
		KVR_TSAN_ACQUIRE(&kvr_rcu_tsan_token);
		free_fn(mem);
		return;
	}
	d->mem = mem;
	d->free_fn = free_fn;
	kvr_rcu_call(&d->head, run_deferred);
}

/*
 * The reclaimer: one thread per process, kvrouter's own, runs the deferred callbacks after a
 * grace period.  liburcu's call_rcu did until 2026-12-04; why not any more:
 *  - liburcu creates its call_rcu threads itself and calls abort() when pthread_create fails
 *    (urcu_die): a process at its thread limit (a container's pids.max) died in the first
 *    kvr_router_create instead of getting an error, and a forked child at its first free.
 *    Here kvr_router_create starts the thread (kvr_rcu_start) and reports a failure; a callback
 *    queued while no thread runs waits for the next start, and kvr_rcu_barrier runs the queue
 *    itself when no thread can be started.
 *  - Across fork(2) liburcu's call_rcu threads pause between callbacks after their 10 ms
 *    gathering sleep, which a fork waited for (fork() of a busy parent 8-9 -> 20-23 ms), and
 *    its wait-free queue can be copied half-linked (rcu.h, kvr_rcu_fork_reclaimer): both took
 *    a dance of their own.  Here the queue is a stack pushed with one compare-and-swap
 *    (consistent at every instant, so in a child too) and a fork waits only for the slice of
 *    a batch under way (the lock rec_run, REC_SLICE callbacks).
 * What is kept from liburcu's: one grace period per batch (urcu_bp_synchronize_rcu), callbacks
 * run oldest first, and batches gathered for REC_GATHER_NS after each (so a busy router pays a
 * grace period per 10 ms, not per free); the wake-up is kvrouter's parker (sync/park.h): a
 * queueing thread wakes the reclaimer only when it sleeps without a bound.
 */
#define REC_GATHER_NS 10000000ull

enum { REC_NONE, REC_RUNNING };
static struct rcu_head *pending;   /* queued callbacks, newest first, linked through next */
static struct kvr_parker rec_park; /* the reclaimer sleeps here */
static uint32_t rec_state;         /* REC_*: a reclaimer thread runs in this process */
/* Held across a batch (so a fork finds no callback running) and by a barrier that runs the
 * queue itself; rec_start serialises starts.  Both are re-made in a forked child. */
static pthread_mutex_t rec_run = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t rec_start = PTHREAD_MUTEX_INITIALIZER;

static void push(struct rcu_head *head, void (*fn)(struct rcu_head *))
{
	head->func = fn;
	struct rcu_head *top = __atomic_load_n(&pending, __ATOMIC_RELAXED);
	do
		head->next.next = (struct cds_wfcq_node *)top;
	while (!__atomic_compare_exchange_n(&pending, &top, head, true, __ATOMIC_SEQ_CST,
	                                    __ATOMIC_RELAXED));
}

/* Callbacks run per slice of a batch: between slices the reclaimer lets a waiting fork in. */
#define REC_SLICE 256u

/* The batch under way, oldest first: what its slices have not run yet.  Under rec_run; a fork
 * between two slices copies it into the child (kvr_rcu_fork_reclaimer). */
static struct rcu_head *in_hand;
/* Forks waiting for rec_run (atomic): the reclaimer lets them in between slices. */
static uint32_t forks_waiting;
/* Barriers queued and not run yet (atomic; an upper bound: counted before the push, counted out
 * once the callback, no longer linked, runs): a forked child that inherits none leaves the
 * queue as it is (kvr_rcu_fork_reclaimer).  Ordering: seq_cst, before the push's seq_cst
 * compare-and-swap, so that a child whose copy holds a barrier's entry holds its count too. */
static uint32_t barriers_queued;

/* Runs the batch under way (in_hand) to its end, in slices of REC_SLICE callbacks, rec_run
 * released between two slices when a fork waits for it: before, a fork waited for the whole
 * batch, which grows while the reclaimer lags (probe: a thread queueing frees flat out, fork()
 * p50 350-385 ms, max 0.9 s).  Whoever holds rec_run next goes on with in_hand: the thread that
 * let the fork in, or another thread that runs batches (a barrier's caller with no reclaimer),
 * which must finish this older batch before it takes its own.
 * Context: holds rec_run (released and taken back), outside a read-side section. */
static void run_in_hand(void)
{
	for (unsigned n = 1; in_hand; n++) {
		struct rcu_head *cur = in_hand;
		in_hand = (struct rcu_head *)cur->next.next; /* cur may be freed */
		cur->func(cur);
		if (n % REC_SLICE == 0 && in_hand &&
		    __atomic_load_n(&forks_waiting, __ATOMIC_RELAXED)) {
			pthread_mutex_unlock(&rec_run);
			/* Until the forking thread has it (it counts itself out once it holds
			 * rec_run): the mutex is not fair, and this thread would take it back. */
			while (__atomic_load_n(&forks_waiting, __ATOMIC_RELAXED))
				sched_yield();
			pthread_mutex_lock(&rec_run);
		}
	}
}

/* Runs what is queued now, oldest first, after one grace period; false if nothing was.  First
 * the rest of a batch another thread left for a fork (run_in_hand): it is older, and a barrier
 * in it waits for its caller's thread, which may now wait for rec_run behind this one.
 * Context: holds rec_run, outside a read-side section. */
static bool run_batch(void)
{
	bool ran = in_hand != NULL;
	run_in_hand();
	struct rcu_head *h = __atomic_exchange_n(&pending, NULL, __ATOMIC_ACQUIRE);
	if (!h)
		return ran;
	urcu_bp_synchronize_rcu();
	struct rcu_head *fifo = NULL;
	while (h) {
		struct rcu_head *next = (struct rcu_head *)h->next.next;
		h->next.next = (struct cds_wfcq_node *)fifo;
		fifo = h;
		h = next;
	}
	in_hand = fifo;
	run_in_hand();
	return true;
}

static void *reclaimer_main(void *arg)
{
	(void)arg;
	for (;;) {
		pthread_mutex_lock(&rec_run);
		bool ran = run_batch();
		pthread_mutex_unlock(&rec_run);
		if (ran) { /* gather the next batch; a barrier's wake ends this early */
			kvr_parker_prepare_bounded(&rec_park);
			(void)kvr_parker_wait(&rec_park, REC_GATHER_NS);
			continue;
		}
		kvr_parker_prepare(&rec_park);
		if (__atomic_load_n(&pending, __ATOMIC_SEQ_CST)) {
			kvr_parker_cancel(&rec_park);
			continue;
		}
		(void)kvr_parker_wait(&rec_park, UINT64_MAX);
	}
	return NULL;
}

int kvr_rcu_start(void)
{
	if (__atomic_load_n(&rec_state, __ATOMIC_ACQUIRE) == REC_RUNNING)
		return 0;
	int err = 0;
	pthread_mutex_lock(&rec_start);
	if (__atomic_load_n(&rec_state, __ATOMIC_RELAXED) != REC_RUNNING) {
		kvr_parker_init(&rec_park);
		pthread_t th;
		err = kvr_thread_start(&th, true, reclaimer_main, NULL);
		if (!err)
			__atomic_store_n(&rec_state, REC_RUNNING, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&rec_start);
	return err;
}

void kvr_rcu_call(struct rcu_head *head, void (*fn)(struct rcu_head *))
{
	/* The hand-off to the reclaimer passes through a grace period TSan cannot see. */
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	push(head, fn);
	if (__builtin_expect(__atomic_load_n(&rec_state, __ATOMIC_ACQUIRE) == REC_RUNNING, 1)) {
		kvr_barrier_after_rmw(); /* the push's compare-and-swap */
		(void)kvr_parker_wake_lazy_fenced(&rec_park);
		return;
	}
	/* No reclaimer in this process yet (the index used without a router, or a forked child
	 * before its first router): start one.  If that fails the callback waits in the queue for
	 * the next start or barrier. */
	if (kvr_rcu_start() == 0)
		kvr_parker_wake(&rec_park);
}

void kvr_rcu_synchronize(void)
{
	urcu_bp_synchronize_rcu();
}

struct barrier_head {
	struct rcu_head head;
	struct kvr_reply done;
};

static void barrier_cb(struct rcu_head *h)
{
	struct barrier_head *b = caa_container_of(h, struct barrier_head, head);
	__atomic_fetch_sub(&barriers_queued, 1, __ATOMIC_SEQ_CST); /* unlinked already */
	kvr_reply_post(&b->done, 0); /* b is the waiter's: not touched after this */
}

void kvr_rcu_barrier(void)
{
	struct barrier_head b;
	kvr_reply_init(&b.done);
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	__atomic_fetch_add(&barriers_queued, 1, __ATOMIC_SEQ_CST);
	push(&b.head, barrier_cb); /* runs after everything queued before it */
	if (kvr_rcu_start() == 0) {
		kvr_parker_wake(&rec_park); /* also from its gathering sleep */
	} else {
		/* No thread can be started: run the queue here (what is queued from now on waits
		 * for a later start). */
		pthread_mutex_lock(&rec_run);
		(void)run_batch();
		pthread_mutex_unlock(&rec_run);
	}
	(void)kvr_reply_wait(&b.done, 0, NULL);
}

void kvr_rcu_fork_reclaimer(enum kvr_fork_phase phase)
{
	switch (phase) {
	case KVR_FORK_PREPARE:
		pthread_mutex_lock(&rec_start);
		__atomic_fetch_add(&forks_waiting, 1, __ATOMIC_RELAXED);
		pthread_mutex_lock(&rec_run);
		__atomic_fetch_sub(&forks_waiting, 1, __ATOMIC_RELAXED);
		break;
	case KVR_FORK_PARENT:
		pthread_mutex_unlock(&rec_run);
		pthread_mutex_unlock(&rec_start);
		break;
	case KVR_FORK_CHILD: {
		/* The reclaimer stayed in the parent; the queue (the parent's callbacks not yet
		 * run) runs when this process starts its own, but for the barriers in it: each
		 * lives on the stack of a parent's thread that waits for it, which does not exist
		 * here, and glibc hands such stacks to the child's new threads, so running one
		 * later called through a live frame (SIGSEGV) or hung the child's own barrier.
		 * Every other entry is heap memory the child has its copy of.  The rest of a batch
		 * the fork came in the middle of (in_hand, oldest first) stays where it is: the
		 * child's first batch runs it before the queue, as it is older.
		 * Only a barrier's predecessor is written (it is unlinked), and with no barrier
		 * queued nothing is walked: before, every entry was relinked, so each page holding
		 * one was copied into the child before fork() returned there, 1-2.5 s for the
		 * millions of entries a thread queueing frees flat out left (test_fork
		 * a_child_does_not_copy_its_parents_queue_of_deferred_frees: ~3,100 pages copied
		 * for 400,000 entries). */
		if (__atomic_load_n(&barriers_queued, __ATOMIC_RELAXED)) {
			struct rcu_head **lists[] = {&pending, &in_hand};
			for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++) {
				struct rcu_head *prev = NULL;
				for (struct rcu_head *h = *lists[i], *next; h; h = next) {
					next = (struct rcu_head *)h->next.next;
					if (h->func != barrier_cb)
						prev = h;
					else if (prev)
						prev->next.next = (struct cds_wfcq_node *)next;
					else
						*lists[i] = next;
				}
			}
			__atomic_store_n(&barriers_queued, 0, __ATOMIC_RELAXED);
		}
		pthread_mutex_init(&rec_run, NULL);
		pthread_mutex_init(&rec_start, NULL);
		kvr_parker_init(&rec_park);
		__atomic_store_n(&rec_state, REC_NONE, __ATOMIC_RELAXED);
		break;
	}
	}
}

void kvr_rcu_fork_registry(enum kvr_fork_phase phase)
{
	switch (phase) {
	case KVR_FORK_PREPARE:
		urcu_bp_before_fork();
		break;
	case KVR_FORK_PARENT:
		urcu_bp_after_fork_parent();
		break;
	case KVR_FORK_CHILD:
		urcu_bp_after_fork_child();
		break;
	}
}
