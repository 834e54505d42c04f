/*
 * sync/rcu.c - reader registration and deferred free on urcu-bp (see rcu.h for the why).
 */
#include "sync/rcu.h"

#include <pthread.h>
#include <sched.h>

#include "core/alloc.h"
#include "kvrouter.h"

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

/* Enqueues under way (each holds one), and the fork's state (enum below).  seq_cst, as a Dekker
 * pair: an enqueuer counts itself, then reads the state; the fork sets the state, then reads
 * the count, so one of the two sees the other. */
enum { ENQ_OPEN, ENQ_FORKING, ENQ_CHILD, ENQ_CHILD_SETTLING };
static uint32_t enq_count, enq_state;
/* Callbacks enqueued while a fork was under way, kept here instead (a stack linked through
 * their rcu_head's queue word, pushed with one compare-and-swap: consistent at every instant,
 * so in the child too), handed to liburcu after the fork. */
static struct rcu_head *held;

static void hold(struct rcu_head *head, void (*fn)(struct rcu_head *))
{
	head->func = fn;
	struct rcu_head *top = __atomic_load_n(&held, __ATOMIC_RELAXED);
	do
		head->next.next = (struct cds_wfcq_node *)top;
	while (!__atomic_compare_exchange_n(&held, &top, head, true, __ATOMIC_RELEASE,
	                                    __ATOMIC_RELAXED));
}

static void release_held(void)
{
	struct rcu_head *h = __atomic_exchange_n(&held, NULL, __ATOMIC_ACQUIRE);
	while (h) {
		struct rcu_head *next = (struct rcu_head *)h->next.next;
		urcu_bp_call_rcu(h, h->func);
		h = next;
	}
}

/* A forked child's first use of call_rcu: liburcu's after-fork step for its call_rcu threads
 * (kvr_rcu_fork_callbacks says why it waits until now), then what was held at the fork.
 * Context: any thread of the child. */
static void settle_child(void)
{
	uint32_t st = ENQ_CHILD;
	if (__atomic_compare_exchange_n(&enq_state, &st, ENQ_CHILD_SETTLING, false,
	                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
		urcu_bp_call_rcu_after_fork_child();
		release_held();
		__atomic_store_n(&enq_state, ENQ_OPEN, __ATOMIC_SEQ_CST);
		return;
	}
	while (__atomic_load_n(&enq_state, __ATOMIC_SEQ_CST) == ENQ_CHILD_SETTLING)
		sched_yield();
}

void kvr_rcu_call(struct rcu_head *head, void (*fn)(struct rcu_head *))
{
	/* The hand-off to liburcu's call_rcu thread is invisible to TSan: publish our writes. */
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	for (;;) {
		__atomic_add_fetch(&enq_count, 1, __ATOMIC_SEQ_CST);
		uint32_t st = __atomic_load_n(&enq_state, __ATOMIC_SEQ_CST);
		if (__builtin_expect(st == ENQ_OPEN, 1))
			break;
		__atomic_sub_fetch(&enq_count, 1, __ATOMIC_SEQ_CST);
		if (st != ENQ_FORKING) {
			settle_child();
			continue;
		}
		/* Nobody waits for the fork (a shard waiting here stalled its lanes for the
		 * fork's ~10-20 ms, and frontends' bounded waits failed with KVR_EAGAIN).  No
		 * call_rcu thread gets here: they are paused before the state is set. */
		hold(head, fn);
		return;
	}
	urcu_bp_call_rcu(head, fn);
	__atomic_sub_fetch(&enq_count, 1, __ATOMIC_SEQ_CST);
}

void kvr_rcu_fork_enqueues(enum kvr_fork_phase phase)
{
	switch (phase) {
	case KVR_FORK_PREPARE:
		__atomic_store_n(&enq_state, ENQ_FORKING, __ATOMIC_SEQ_CST);
		while (__atomic_load_n(&enq_count, __ATOMIC_SEQ_CST)) /* a few instructions each */
			sched_yield();
		break;
	case KVR_FORK_PARENT:
		__atomic_store_n(&enq_state, ENQ_OPEN, __ATOMIC_SEQ_CST);
		release_held();
		break;
	case KVR_FORK_CHILD:
		/* The parent's enqueuers are not here, and none was under way. */
		__atomic_store_n(&enq_count, 0, __ATOMIC_SEQ_CST);
		__atomic_store_n(&enq_state, ENQ_CHILD, __ATOMIC_SEQ_CST);
		break;
	}
}

void kvr_rcu_synchronize(void)
{
	urcu_bp_synchronize_rcu();
}

void kvr_rcu_barrier(void)
{
	if (__atomic_load_n(&enq_state, __ATOMIC_SEQ_CST) >= ENQ_CHILD)
		settle_child(); /* the barrier takes liburcu's lock the settling releases */
	urcu_bp_barrier();
}

void kvr_rcu_fork_callbacks(enum kvr_fork_phase phase)
{
	switch (phase) {
	case KVR_FORK_PREPARE:
		/* A child forking again before its first call_rcu: liburcu's lock is still held
		 * from the first fork; settle first. */
		if (__atomic_load_n(&enq_state, __ATOMIC_SEQ_CST) >= ENQ_CHILD)
			settle_child();
		urcu_bp_call_rcu_before_fork();
		break;
	case KVR_FORK_PARENT:
		urcu_bp_call_rcu_after_fork_parent();
		break;
	case KVR_FORK_CHILD:
		break; /* at the child's first call_rcu or barrier (settle_child) */
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

void kvr_rcu_fork_ready(void)
{
	(void)urcu_bp_get_default_call_rcu_data();
}
