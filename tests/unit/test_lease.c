/* Request leases (shards/lease): attempt ids, the CLOCK reaper, exactly-once claim, stale and
 * unknown handles, slot reuse. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "shards/lease.h"

#define S 1000000000ull

Test(lease, attempt_ids_unique_and_bounded)
{
	struct kvr_attempt_ids ids;
	kvr_attempt_ids_init(&ids);
	cr_assert_eq(kvr_attempt_id_next(&ids), 1);
	cr_assert_eq(kvr_attempt_id_next(&ids), 2);
	ids.next = KVR_ATTEMPT_MAX - 1;
	cr_assert_eq(kvr_attempt_id_next(&ids), KVR_ATTEMPT_MAX - 1);
	cr_assert_eq(kvr_attempt_id_next(&ids), 0, "exhausted, never wraps");
	cr_assert_eq(kvr_attempt_id_next(&ids), 0);
}

Test(lease, begin_duplicate_and_invalid)
{
	struct kvr_lease_table *t;
	uint32_t s;
	cr_assert_eq(kvr_lease_table_create(0, 0, &t), KVR_EINVAL);
	cr_assert_eq(kvr_lease_table_create(120 * S, 0, &t), 0);
	cr_assert_eq(kvr_lease_begin(t, 0, &s), KVR_EINVAL);
	cr_assert_eq(kvr_lease_begin(t, KVR_ATTEMPT_MAX, &s), KVR_EINVAL);
	cr_assert_eq(kvr_lease_begin(t, 5, &s), 0);
	cr_assert_eq(kvr_lease_state(t, s, 5), KVR_LEASE_TOUCHED, "new leases start TOUCHED");
	cr_assert_eq(kvr_lease_begin(t, 5, &s), KVR_EEXIST);
	cr_assert_eq(kvr_lease_count(t), 1);
	cr_assert_eq(kvr_lease_claim(t, 999999, 5), KVR_ENOENT, "slot never allocated");
	cr_assert_eq(kvr_lease_touch(t, KVR_LEASE_MAX_SLOTS, 5), KVR_ENOENT);
	cr_assert_eq(kvr_lease_claim(t, s, 6), KVR_ESTALE, "wrong attempt for the slot");
	kvr_lease_table_destroy(t);
	kvr_lease_table_destroy(NULL);
}

Test(lease, clock_reaps_idle_after_one_to_two_scans)
{
	struct kvr_lease_table *t;
	struct kvr_lease_expired exp[8];
	size_t n;
	uint32_t a, b;
	kvr_lease_table_create(10, 0, &t);
	kvr_lease_begin(t, 1, &a);
	kvr_lease_begin(t, 2, &b);
	cr_assert_eq(kvr_lease_tick(t, 5, exp, 8, &n), 0);
	cr_assert_eq(n, 0, "no scan before the interval");
	cr_assert_eq(kvr_lease_state(t, a, 1), KVR_LEASE_TOUCHED);
	cr_assert_eq(kvr_lease_tick(t, 10, exp, 8, &n), 0); /* scan 1: both QUIET */
	cr_assert_eq(n, 0);
	cr_assert_eq(kvr_lease_state(t, a, 1), KVR_LEASE_QUIET);
	cr_assert_eq(kvr_lease_touch(t, b, 2), 0); /* progress on 2 */
	cr_assert_eq(kvr_lease_state(t, b, 2), KVR_LEASE_TOUCHED);
	cr_assert_eq(kvr_lease_touch(t, b, 2), 0, "touching TOUCHED is a no-op");
	cr_assert_eq(kvr_lease_tick(t, 15, exp, 8, &n), 0);
	cr_assert_eq(n, 0, "next scan is at 20");
	cr_assert_eq(kvr_lease_tick(t, 20, exp, 8, &n), 0); /* scan 2: 1 expires, 2 QUIET */
	cr_assert_eq(n, 1);
	cr_assert_eq(exp[0].attempt, 1);
	cr_assert_eq(exp[0].slot, a);
	cr_assert_eq(kvr_lease_state(t, a, 1), KVR_LEASE_CLAIMED);
	cr_assert_eq(kvr_lease_state(t, b, 2), KVR_LEASE_QUIET);
	/* The expiry won: finish and abort afterwards are stale and change nothing. */
	cr_assert_eq(kvr_lease_claim(t, a, 1), KVR_ESTALE);
	cr_assert_eq(kvr_lease_touch(t, a, 1), KVR_ESTALE);
	cr_assert_eq(kvr_lease_end(t, 1), 0);
	cr_assert_eq(kvr_lease_end(t, 1), KVR_ENOENT);
	cr_assert_eq(kvr_lease_claim(t, a, 1), KVR_ESTALE, "ended: stale forever");
	uint32_t s;
	cr_assert_eq(kvr_lease_find(t, 1, &s), KVR_ESTALE);
	cr_assert_eq(kvr_lease_find(t, 77, &s), KVR_ENOENT);
	cr_assert_eq(kvr_lease_find(t, 2, &s), 0);
	cr_assert_eq(s, b);
	cr_assert_eq(kvr_lease_tick(t, 30, exp, 8, &n), 0);
	cr_assert_eq(n, 1);
	cr_assert_eq(exp[0].attempt, 2);
	kvr_lease_table_destroy(t);
}

Test(lease, finish_beats_expiry_and_end_needs_claim)
{
	struct kvr_lease_table *t;
	struct kvr_lease_expired exp[4];
	size_t n;
	uint32_t a;
	kvr_lease_table_create(10, 0, &t);
	kvr_lease_begin(t, 3, &a);
	cr_assert_eq(kvr_lease_end(t, 3), KVR_EBUSY, "must be claimed first");
	kvr_lease_scan(t, exp, 4, &n);
	cr_assert_eq(kvr_lease_claim(t, a, 3), 0, "finish wins");
	cr_assert_eq(kvr_lease_claim(t, a, 3), KVR_ESTALE, "abort loses");
	kvr_lease_scan(t, exp, 4, &n);
	cr_assert_eq(n, 0, "expiry loses");
	cr_assert_eq(kvr_lease_end(t, 3), 0);
	/* The slot is reused by a new attempt: the old handle stays stale. */
	uint32_t b;
	cr_assert_eq(kvr_lease_begin(t, 4, &b), 0);
	cr_assert_eq(b, a, "slot recycled");
	cr_assert_eq(kvr_lease_claim(t, a, 3), KVR_ESTALE);
	cr_assert_eq(kvr_lease_touch(t, a, 3), KVR_ESTALE);
	cr_assert_eq(kvr_lease_state(t, b, 4), KVR_LEASE_TOUCHED);
	kvr_lease_table_destroy(t);
}

Test(lease, scan_bounded_by_max)
{
	struct kvr_lease_table *t;
	struct kvr_lease_expired exp[3];
	size_t n;
	uint32_t s;
	kvr_lease_table_create(10, 0, &t);
	for (uint64_t i = 1; i <= 10000; i++) /* crosses chunk boundaries */
		cr_assert_eq(kvr_lease_begin(t, i, &s), 0);
	kvr_lease_scan(t, exp, 3, &n);
	cr_assert_eq(n, 0);
	size_t total = 0;
	for (int pass = 0; pass < 5000 && total < 10000; pass++) {
		kvr_lease_scan(t, exp, 3, &n);
		for (size_t i = 0; i < n; i++)
			cr_assert_eq(kvr_lease_end(t, exp[i].attempt), 0);
		total += n;
	}
	cr_assert_eq(total, 10000);
	cr_assert_eq(kvr_lease_count(t), 0);
	kvr_lease_table_destroy(t);
}

/* Claims from several threads: every attempt is claimed exactly once. */
#define N_LEASES  2048
#define N_THREADS 4
struct race {
	struct kvr_lease_table *t;
	uint32_t slot[N_LEASES];
	int wins[N_LEASES];
};

static void *claimer(void *arg)
{
	struct race *r = arg;
	for (int i = 0; i < N_LEASES; i++)
		if (kvr_lease_claim(r->t, r->slot[i], (uint64_t)i + 1) == 0)
			__atomic_add_fetch(&r->wins[i], 1, __ATOMIC_RELAXED);
	return NULL;
}

Test(lease, threads_claim_exactly_once)
{
	static struct race r;
	kvr_lease_table_create(10, 0, &r.t);
	for (int i = 0; i < N_LEASES; i++)
		cr_assert_eq(kvr_lease_begin(r.t, (uint64_t)i + 1, &r.slot[i]), 0);
	pthread_t th[N_THREADS];
	for (int i = 0; i < N_THREADS; i++)
		pthread_create(&th[i], NULL, claimer, &r);
	struct kvr_lease_expired exp[64];
	size_t n;
	for (int pass = 0; pass < 4; pass++) {
		kvr_lease_scan(r.t, exp, 64, &n);
		for (size_t i = 0; i < n; i++)
			__atomic_add_fetch(&r.wins[exp[i].attempt - 1], 1, __ATOMIC_RELAXED);
	}
	for (int i = 0; i < N_THREADS; i++)
		pthread_join(th[i], NULL);
	for (int i = 0; i < N_LEASES; i++)
		cr_assert_eq(r.wins[i], 1, "attempt %d won %d times", i + 1, r.wins[i]);
	kvr_lease_table_destroy(r.t);
}

/* Differential: random begin / touch / claim (finish, abort) / scan / end / clock ticks
 * against an array model; seed printed on failure (LEASE_DIFF_SEED=<seed> reruns one). */
#define U 48
struct mlease {
	int state; /* 0 = not live */
	uint32_t slot;
	bool ever;
};

static uint64_t rng(uint64_t *s)
{
	uint64_t x = *s += 0x9E3779B97F4A7C15ull;
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
	x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
	return x ^ (x >> 31);
}

static void lease_seed(uint64_t seed, int steps)
{
	uint64_t r = seed, next = 1, now = 0, next_scan = 10;
	static struct mlease m[4096];
	memset(m, 0, sizeof(m));
	struct kvr_lease_table *t;
	cr_assert_eq(kvr_lease_table_create(10, 0, &t), 0);
	struct kvr_lease_expired exp[U];
	for (int step = 0; step < steps && next < 4000; step++) {
		uint64_t op = rng(&r) % 12;
		uint64_t a = next > 1 ? 1 + rng(&r) % (next - 1) : 1;
		struct mlease *q = &m[a];
		int rc, want;
		if (op < 3) {
			uint32_t s;
			bool dup = rng(&r) % 8 == 0 && q->state;
			uint64_t id = dup ? a : next++;
			rc = kvr_lease_begin(t, id, &s);
			want = dup ? KVR_EEXIST : 0;
			if (!dup)
				m[id] = (struct mlease){
				    .state = KVR_LEASE_TOUCHED, .slot = s, .ever = 1};
		} else if (op < 5) {
			rc = q->ever ? kvr_lease_touch(t, q->slot, a) : 0;
			want = (!q->ever)                                         ? 0
			       : (q->state == 0 || q->state == KVR_LEASE_CLAIMED) ? KVR_ESTALE
			                                                          : 0;
			if (q->state == KVR_LEASE_QUIET)
				q->state = KVR_LEASE_TOUCHED;
		} else if (op < 7) {
			rc = q->ever ? kvr_lease_claim(t, q->slot, a) : 0;
			want = (!q->ever)                                         ? 0
			       : (q->state == 0 || q->state == KVR_LEASE_CLAIMED) ? KVR_ESTALE
			                                                          : 0;
			if (q->state && q->state != KVR_LEASE_CLAIMED)
				q->state = KVR_LEASE_CLAIMED;
		} else if (op < 9) {
			rc = kvr_lease_end(t, a);
			want = q->state == 0                   ? KVR_ENOENT
			       : q->state != KVR_LEASE_CLAIMED ? KVR_EBUSY
			                                       : 0;
			if (want == 0)
				q->state = 0;
		} else if (op < 10) {
			uint32_t s;
			rc = kvr_lease_find(t, a, &s);
			want = q->state ? 0 : q->ever ? KVR_ESTALE : KVR_ENOENT;
			if (rc == 0)
				cr_assert_eq(s, q->slot);
		} else {
			now += rng(&r) % 15;
			size_t n;
			size_t max = 1 + rng(&r) % 6;
			cr_assert_eq(kvr_lease_tick(t, now, exp, max, &n), 0);
			rc = want = 0;
			if (now >= next_scan) {
				/* Model scan: slots in ascending order, TOUCHED -> QUIET, QUIET ->
				 * CLAIMED while fewer than U were claimed. */
				next_scan = now + 10;
				size_t k = 0;
				for (uint32_t slot = 0; slot < (uint32_t)next; slot++)
					for (uint64_t i = 1; i < next; i++) {
						if (!m[i].state || m[i].slot != slot)
							continue;
						if (m[i].state == KVR_LEASE_TOUCHED) {
							m[i].state = KVR_LEASE_QUIET;
						} else if (m[i].state == KVR_LEASE_QUIET &&
						           k < max) {
							m[i].state = KVR_LEASE_CLAIMED;
							cr_assert(k < n && exp[k].attempt == i &&
							              exp[k].slot == slot,
							          "seed %llu step %d: expired[%zu]",
							          (unsigned long long)seed, step,
							          k);
							k++;
						}
					}
				cr_assert_eq(n, k, "seed %llu step %d", (unsigned long long)seed,
				             step);
			} else {
				cr_assert_eq(n, 0);
			}
		}
		cr_assert_eq(rc, want, "seed %llu step %d op %llu: rc %d want %d",
		             (unsigned long long)seed, step, (unsigned long long)op, rc, want);
		size_t live = 0;
		for (uint64_t i = 1; i < next; i++)
			if (m[i].state) {
				live++;
				cr_assert_eq(kvr_lease_state(t, m[i].slot, i), m[i].state,
				             "seed %llu step %d attempt %llu",
				             (unsigned long long)seed, step, (unsigned long long)i);
			}
		cr_assert_eq(kvr_lease_count(t), live);
	}
	kvr_lease_table_destroy(t);
}

Test(lease, differential_against_model)
{
	const char *env = getenv("LEASE_DIFF_SEED");
	if (env) {
		lease_seed(strtoull(env, NULL, 0), 3000);
		return;
	}
	for (uint64_t seed = 1; seed <= 200; seed++)
		lease_seed(seed, 400);
}
