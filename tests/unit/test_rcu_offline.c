/* A thread that cannot be registered as an RCU reader (kvr_rcu_thread_online returns KVR_ENOMEM:
 * sync/rcu.c fails only when pthread_setspecific or pthread_key_create does) gets KVR_ENOMEM from
 * every index writer, with nothing changed, and a router whose shard threads cannot register is
 * not created.  Before, the removals, clears and rank adds ignored the failure and went on to
 * call_rcu from an unregistered thread (whose read sections a grace period does not wait for).
 *
 * The out-of-memory machinery (core/alloc.c's kvr_alloc_fail_after) cannot reach this path: the
 * registration allocates nothing of ours.  So this file interposes pthread_setspecific (the
 * executable's definition wins over libc's for the library's calls too) and fails it, as glibc
 * does when it cannot allocate a thread's second-level key block, for kvrouter's key only:
 * the value sync/rcu.c stores is the calling thread's &kvr_rcu_self. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RTLD_NEXT */
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>

#include "core/index.h"
#include "kvrouter.h"
#include "sync/rcu.h"

static _Thread_local int fail_this_thread;
static atomic_int fail_other_threads; /* every thread but main_thread */
static pthread_t main_thread;

int pthread_setspecific(pthread_key_t key, const void *value)
{
	static int (*real)(pthread_key_t, const void *);
	if (!real)
		real =
		    (int (*)(pthread_key_t, const void *))dlsym(RTLD_NEXT, "pthread_setspecific");
	if (value && value == (const void *)&kvr_rcu_self &&
	    (fail_this_thread ||
	     (atomic_load(&fail_other_threads) && !pthread_equal(pthread_self(), main_thread))))
		return ENOMEM;
	return real(key, value);
}

struct fixture {
	struct kvr_index *idx;
	uint32_t slot;
	uint64_t ext[4];
	int rc_online, rc_remove, rc_remove_runs, rc_clear, rc_clear_worker, rc_rank_remove,
	    rc_rank_add, rc_store, rc_find;
};

static void *offline_writer(void *arg)
{
	struct fixture *f = arg;
	fail_this_thread = 1;
	f->rc_online = kvr_rcu_thread_online();
	size_t nf = 99;
	f->rc_remove = kvr_index_remove(f->idx, f->slot, f->ext, 2, &nf);
	uint32_t run_len[1] = {2};
	f->rc_remove_runs = kvr_index_remove_runs(f->idx, f->slot, f->ext + 2, 2, run_len, 1, NULL);
	f->rc_clear = kvr_index_clear_rank(f->idx, f->slot);
	f->rc_clear_worker = kvr_index_clear_worker(f->idx, 7);
	f->rc_rank_remove = kvr_index_rank_remove(f->idx, f->slot);
	uint32_t s2 = 12345;
	f->rc_rank_add = kvr_index_rank_add(f->idx, 8, 0, &s2);
	struct kvr_index_block b = {.ext_hash = 1000, .local_hash = 1000};
	f->rc_store = kvr_index_store(f->idx, f->slot, NULL, &b, 1);
	f->rc_find = kvr_index_rank_find(f->idx, 7, 0, &s2);
	return NULL;
}

Test(rcu_offline, index_writers_report_enomem_and_change_nothing)
{
	struct fixture f = {0};
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	cr_assert_eq(kvr_index_create(4, &f.idx), 0);
	cr_assert_eq(kvr_index_rank_add(f.idx, 7, 0, &f.slot), 0);
	struct kvr_index_block b[4];
	for (int i = 0; i < 4; i++) {
		b[i] = (struct kvr_index_block){.ext_hash = 100 + i, .local_hash = 100 + i};
		f.ext[i] = 100 + i;
	}
	cr_assert_eq(kvr_index_store(f.idx, f.slot, NULL, b, 4), 0);
	cr_assert_eq(kvr_index_rank_blocks(f.idx, f.slot, NULL, 0), 4);

	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, offline_writer, &f), 0);
	pthread_join(th, NULL);
	cr_assert_eq(f.rc_online, KVR_ENOMEM, "the injection did not reach sync/rcu.c");
	cr_assert_eq(f.rc_remove, KVR_ENOMEM, "remove: %d", f.rc_remove);
	cr_assert_eq(f.rc_remove_runs, KVR_ENOMEM, "remove_runs: %d", f.rc_remove_runs);
	cr_assert_eq(f.rc_clear, KVR_ENOMEM, "clear_rank: %d", f.rc_clear);
	cr_assert_eq(f.rc_clear_worker, KVR_ENOMEM, "clear_worker: %d", f.rc_clear_worker);
	cr_assert_eq(f.rc_rank_remove, KVR_ENOMEM, "rank_remove: %d", f.rc_rank_remove);
	cr_assert_eq(f.rc_rank_add, KVR_ENOMEM, "rank_add: %d", f.rc_rank_add);
	cr_assert_eq(f.rc_store, KVR_ENOMEM, "store: %d", f.rc_store);
	cr_assert_eq(f.rc_find, KVR_ENOMEM, "rank_find: %d", f.rc_find);

	/* Nothing changed: the four blocks, the rank, and no rank 8. */
	uint64_t got[8];
	cr_assert_eq(kvr_index_rank_blocks(f.idx, f.slot, got, 8), 4);
	uint32_t s;
	cr_assert_eq(kvr_index_rank_find(f.idx, 7, 0, &s), 0);
	cr_assert_eq(s, f.slot);
	cr_assert_eq(kvr_index_rank_find(f.idx, 8, 0, &s), KVR_ENOENT);
	/* A registered thread still can. */
	cr_assert_eq(kvr_index_remove(f.idx, f.slot, f.ext, 2, NULL), 0);
	cr_assert_eq(kvr_index_rank_blocks(f.idx, f.slot, NULL, 0), 2);
	cr_assert_eq(kvr_index_clear_rank(f.idx, f.slot), 0);
	cr_assert_eq(kvr_index_rank_blocks(f.idx, f.slot, NULL, 0), 0);
	kvr_index_destroy(f.idx);
	kvr_rcu_thread_offline();
}

/* The deferred free on a thread that cannot register: a grace period waited for there instead
 * (the function returns void), the memory freed once, not leaked.  A registered reader holds a
 * section open meanwhile, so that a free queued to liburcu (before: call_rcu from the
 * unregistered thread) cannot have run when kvr_rcu_defer_free returns. */
static atomic_int freed, reading, release_reader;
static void count_free(void *p)
{
	(void)p;
	atomic_fetch_add(&freed, 1);
}

static void *reader(void *arg)
{
	(void)arg;
	kvr_rcu_thread_online();
	kvr_rcu_read_lock();
	atomic_store(&reading, 1);
	while (!atomic_load(&release_reader))
		;
	struct timespec ts = {0, 100 * 1000000L};
	nanosleep(&ts, NULL);
	kvr_rcu_read_unlock();
	kvr_rcu_thread_offline();
	return NULL;
}

static void *offline_defer(void *arg)
{
	int *freed_at_return = arg;
	fail_this_thread = 1;
	static int token;
	atomic_store(&release_reader, 1);
	kvr_rcu_defer_free(&token, count_free);
	*freed_at_return = atomic_load(&freed);
	return NULL;
}

Test(rcu_offline, defer_free_without_registration_waits_instead)
{
	pthread_t rd, th;
	cr_assert_eq(pthread_create(&rd, NULL, reader, NULL), 0);
	while (!atomic_load(&reading))
		;
	int at_return = -1;
	cr_assert_eq(pthread_create(&th, NULL, offline_defer, &at_return), 0);
	pthread_join(th, NULL);
	pthread_join(rd, NULL);
	cr_assert_eq(at_return, 1, "freed %d times when kvr_rcu_defer_free returned", at_return);
	kvr_rcu_barrier();
	cr_assert_eq(atomic_load(&freed), 1);
}

/* Shard threads that cannot register: the router is not created (KVR_ENOMEM), rather than
 * shards writing the index from unregistered threads. */
Test(rcu_offline, router_with_unregistrable_shards_is_not_created)
{
	main_thread = pthread_self();
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	struct kvr_router *r = NULL;
	atomic_store(&fail_other_threads, 1);
	int rc = kvr_router_create(&c, &r);
	atomic_store(&fail_other_threads, 0);
	cr_assert_eq(rc, KVR_ENOMEM, "kvr_router_create: %d", rc);
	cr_assert_null(r);
	/* And it is the registration, not the router: created once it can. */
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	kvr_router_destroy(r);
	kvr_rcu_thread_offline();
}
