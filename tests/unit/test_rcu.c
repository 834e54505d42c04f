/* sync/rcu.h: the read side's nesting, counted by kvrouter (only the outermost lock and unlock
 * reach liburcu), keeps liburcu's contract: a grace period waits for the outermost unlock. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "sync/rcu.h"

static void sleep_ms(long ms)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

Test(rcu, nesting_is_counted)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	cr_assert_eq(kvr_rcu_thread_online(), 0, "a second call is a no-op");
	cr_assert(!kvr_rcu_read_ongoing());
	kvr_rcu_read_lock();
	cr_assert(kvr_rcu_read_ongoing());
	kvr_rcu_read_lock();
	kvr_rcu_read_unlock();
	cr_assert(kvr_rcu_read_ongoing(), "the outer section is still open");
	kvr_rcu_read_unlock();
	cr_assert(!kvr_rcu_read_ongoing());
	kvr_rcu_synchronize(); /* no section of ours left open: returns */
	kvr_rcu_thread_offline();
}

static atomic_int synced;

static void *synchronizer(void *arg)
{
	(void)arg;
	kvr_rcu_synchronize();
	atomic_store(&synced, 1);
	return NULL;
}

/* A reader inside two nested sections: the grace period outlasts the inner unlock and ends
 * with the outer one.  (With the nesting miscounted, the inner unlock would end liburcu's
 * section and the grace period with it, while the outer section still reads.) */
Test(rcu, grace_period_waits_for_the_outermost_unlock)
{
	cr_assert_eq(kvr_rcu_thread_online(), 0);
	kvr_rcu_read_lock();
	kvr_rcu_read_lock();
	pthread_t th;
	atomic_store(&synced, 0);
	cr_assert_eq(pthread_create(&th, NULL, synchronizer, NULL), 0);
	sleep_ms(50);
	cr_assert_eq(atomic_load(&synced), 0, "a grace period ended inside two sections");
	kvr_rcu_read_unlock();
	sleep_ms(50);
	cr_assert_eq(atomic_load(&synced), 0, "a grace period ended inside the outer section");
	kvr_rcu_read_unlock();
	pthread_join(th, NULL);
	cr_assert_eq(atomic_load(&synced), 1);
	kvr_rcu_thread_offline();
}
