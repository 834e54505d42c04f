/*
 * sync/rcu.c - reader registration and deferred free on urcu-memb (see rcu.h for the why).
 */
#include "sync/rcu.h"

#include <pthread.h>

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
		urcu_memb_unregister_thread();
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
	urcu_memb_register_thread();
	kvr_rcu_self.online = 1;
	return 0;
}

void kvr_rcu_thread_offline(void)
{
	if (!kvr_rcu_self.online)
		return;
	urcu_memb_unregister_thread();
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
		urcu_memb_synchronize_rcu();
		KVR_TSAN_ACQUIRE(&kvr_rcu_tsan_token);
		free_fn(mem);
		return;
	}
	d->mem = mem;
	d->free_fn = free_fn;
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	urcu_memb_call_rcu(&d->head, run_deferred);
}

void kvr_rcu_synchronize(void)
{
	urcu_memb_synchronize_rcu();
}

void kvr_rcu_barrier(void)
{
	urcu_memb_barrier();
}
