/* Rank lifecycle and fencing (shards/rank_state): incarnations, capacity none -> TTL, shrink,
 * reset, and every refusal (stale incarnation, unknown rank, released attempt) changing nothing
 * and emitting nothing. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/rank_state.h"
#include "lru_out_util.h"
#include "tests/common/splitmix.h"

#define TTL 1000

static struct kvr_lru_block B[4] = {{1, 10}, {2, 11}, {3, 12}, {4, 13}};

static struct kvr_rank_state *rs;
static struct kvr_lru_out out;

static void setup(void)
{
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_rank_state_create(TTL, 0, &rs), 0);
}

static void teardown(void)
{
	kvr_rank_state_destroy(rs);
	kvr_lru_out_fini(&out);
}

static void assert_empty_out(void)
{
	cr_assert(out.n_stored == 0 && out.n_evicted == 0 && !out.cleared);
}

TestSuite(rank_state, .init = setup, .fini = teardown);

Test(rank_state, unknown_rank_refused_and_not_resurrected)
{
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_ABSENT);
	cr_assert_eq(kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 0, &out), KVR_ENOENT);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_materialize(rs, 1, 1, 0, B, 1, 0, 0, 0, &out), KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_ABSENT, "never resurrected");
	uint64_t q[1] = {10};
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 1), 0);
}

Test(rank_state, lru_lifecycle_and_stale_incarnation)
{
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 7, 3, &out), 0);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_LRU);
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 1, B, 4, 0, 0, &out), 0);
	cr_assert_eq(out.n_stored, 4);
	cr_assert_eq(kvr_rank_state_acquire(rs, 6, 2, B, 2, 0, 0, &out), KVR_ESTALE);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 1, B, 2, 0, 0, &out), KVR_EEXIST);
	cr_assert_eq(kvr_rank_state_materialize(rs, 6, 1, 13, B, 1, 4, 0, 0, &out), KVR_ESTALE);
	cr_assert_eq(kvr_rank_state_release(rs, 8, 1, &out), KVR_ESTALE);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_release(rs, 7, 1, &out), 0);
	cr_assert_eq(out.n_evicted, 1, "4 blocks over capacity 3: the deepest goes");
	cr_assert_eq(out_evicted(&out, 0), 13);
	cr_assert_eq(kvr_rank_state_release(rs, 7, 1, &out), KVR_ENOENT, "released attempt");
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 7, 1, &out), 0, "shrinking evicts");
	cr_assert_eq(out.n_evicted, 2);
	cr_assert_not(out.cleared);
	uint64_t q[3] = {10, 11, 12};
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 3), 1);
	/* A new incarnation clears the rank and starts fresh. */
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 8, 5, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_incarnation(rs), 8);
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 3), 0);
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 3, B, 1, 0, 0, &out), KVR_ESTALE);
	assert_empty_out();
	/* Renewed in the same incarnation (a rank reset): empty, its leases gone with it. */
	cr_assert_eq(kvr_rank_state_acquire(rs, 8, 3, B, 2, 0, 0, &out), 0);
	cr_assert_eq(kvr_rank_state_renew(rs, 8, 5, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_LRU);
	cr_assert_eq(kvr_rank_state_overlap(rs, q, 3), 0);
	cr_assert_eq(kvr_rank_state_release(rs, 8, 3, &out), KVR_ENOENT,
	             "leases of the old store are gone");
}

/* A failed renew (out of memory) leaves the rank exactly as it was: owner_ranks.c's new_life
 * renews before it ends any attempt, so a failed kvr_rank_set_capacity or kvr_rank_reset
 * changes nothing (tests/fuzz/oom_api.c found the attempts ended and the rank ABSENT). */
Test(rank_state, renew_out_of_memory_changes_nothing)
{
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 7, 8, &out), 0);
	cr_assert_eq(kvr_rank_state_acquire(rs, 7, 1, B, 3, 0, 0, &out), 0);
	uint64_t q[3] = {10, 11, 12};
	for (uint64_t cap = 0; cap <= 8; cap += 8) { /* to TTL, to an LRU */
		kvr_alloc_fail_after(1);
		cr_assert_eq(kvr_rank_state_renew(rs, 9, cap, &out), KVR_ENOMEM);
		kvr_alloc_fail_after(0);
		cr_assert_not(out.cleared);
		cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_LRU);
		cr_assert_eq(kvr_rank_state_incarnation(rs), 7);
		cr_assert_eq(kvr_rank_state_overlap(rs, q, 3), 3);
	}
	cr_assert_eq(kvr_rank_state_release(rs, 7, 1, &out), 0, "the lease is still held");
	cr_assert_eq(kvr_rank_state_renew(rs, 9, 0, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_incarnation(rs), 9);
}

Test(rank_state, capacity_none_runs_ttl_until_reset)
{
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 0, &out), 0);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 100, &out), 0);
	cr_assert_eq(out.n_stored, 2);
	cr_assert_eq(kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 100, &out), KVR_EEXIST);
	cr_assert_eq(kvr_rank_state_materialize(rs, 1, 1, 11, B + 2, 1, 2, 0, 200, &out), 0);
	cr_assert_eq(out.n_stored, 1);
	cr_assert_eq(kvr_rank_state_materialize(rs, 1, 9, 11, B + 3, 1, 3, 0, 200, &out),
	             KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 100, &out), KVR_EBUSY);
	assert_empty_out();
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 0, &out), 0);
	cr_assert_eq(kvr_rank_state_next_deadline(rs), 100 + TTL);
	cr_assert_eq(kvr_rank_state_tick(rs, 100 + TTL, &out), 0);
	cr_assert_eq(out.n_evicted, 2);
	cr_assert_eq(kvr_rank_state_tick(rs, 200 + TTL, &out), 0);
	cr_assert_eq(out.n_evicted, 1);
	cr_assert_eq(out_evicted(&out, 0), 12);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), 0);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), KVR_ENOENT);
	cr_assert_eq(kvr_rank_state_release(rs, 2, 1, &out), KVR_ESTALE);
	/* Renewed (a reset, or a new incarnation), the rank may come back with a capacity. */
	cr_assert_eq(kvr_rank_state_renew(rs, 1, 100, &out), 0);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_LRU);
	cr_assert(out.cleared, "the TTL store's blocks leave the index");
}

Test(rank_state, lru_to_capacity_zero_clears_to_ttl)
{
	kvr_rank_state_set_capacity(rs, 1, 10, &out);
	kvr_rank_state_acquire(rs, 1, 1, B, 2, 0, 0, &out);
	cr_assert_eq(kvr_rank_state_set_capacity(rs, 1, 0, &out), 0);
	cr_assert(out.cleared);
	cr_assert_eq(kvr_rank_state_mode(rs), KVR_RANK_TTL);
	cr_assert_eq(kvr_rank_state_release(rs, 1, 1, &out), KVR_ENOENT,
	             "leases of the LRU are gone with it");
	cr_assert_eq(kvr_rank_state_tick(rs, 5, &out), 0);
	cr_assert_eq(kvr_rank_state_next_deadline(rs), UINT64_MAX);
	cr_assert_eq(kvr_rank_state_set_capacity(NULL, 1, 0, &out), KVR_EINVAL);
	kvr_rank_state_destroy(NULL);
}

/* Differential: random set_capacity / reset / acquire / materialize / release / clock ticks
 * against a model of the fencing layer (capacities large enough that the LRU never evicts, so
 * presence is a plain set; eviction order is test_lru_diff's job).  Seed printed on failure;
 * RANK_DIFF_SEED=<seed> reruns one. */
#define H 32
#define A 16
struct rmodel {
	enum kvr_rank_mode mode;
	uint64_t inc;
	bool present[H];
	uint64_t expiry[H];
	bool live[A];
	bool has_last[A];
	uint64_t last[A];
};

static void m_clear(struct rmodel *m)
{
	memset(m->present, 0, sizeof(m->present));
	memset(m->live, 0, sizeof(m->live));
	memset(m->has_last, 0, sizeof(m->has_last));
}

/* Records blocks in the model; returns the expected stored list. */
static size_t m_add(struct rmodel *m, const struct kvr_lru_block *b, size_t n, uint64_t now,
                    uint64_t *stored)
{
	size_t ns = 0;
	for (size_t i = 0; i < n; i++) {
		if (!m->present[b[i].seq])
			stored[ns++] = b[i].seq;
		m->present[b[i].seq] = true;
		m->expiry[b[i].seq] = now + TTL;
	}
	return ns;
}

static void rank_seed(uint64_t seed, int steps)
{
	uint64_t r = seed, now = 0;
	struct rmodel m;
	memset(&m, 0, sizeof(m));
	struct kvr_lru_block b[8];
	uint64_t stored[8];
	for (int step = 0; step < steps; step++) {
		uint64_t op = splitmix64(&r) % 14, inc = 1 + splitmix64(&r) % 3,
		         a = splitmix64(&r) % A;
		/* Mostly the current incarnation, so commands get through. */
		if (splitmix64(&r) % 4 && m.mode != KVR_RANK_ABSENT)
			inc = m.inc;
		/* Chained hashes, as the router makes them (the LRU relies on it): hash h's parent
		 * is h / 2, hash 1 hangs below the root; a materialize continues the lease. */
		size_t n = splitmix64(&r) % 6, ns = 0;
		uint64_t h0 = 1;
		if (op >= 7 && op < 9 && m.has_last[a])
			h0 = 2 * m.last[a] + splitmix64(&r) % 2;
		for (size_t i = 0; i < n; i++) {
			uint64_t h = i == 0 ? h0 : 2 * b[i - 1].seq + splitmix64(&r) % 2;
			if (h >= H) {
				n = i;
				break;
			}
			b[i] = (struct kvr_lru_block){.local = 0, .seq = h};
		}
		int rc, want = 0;
		bool cleared = false;
		bool fenced = m.mode == KVR_RANK_ABSENT || inc != m.inc;
		int fence_rc = m.mode == KVR_RANK_ABSENT ? KVR_ENOENT : KVR_ESTALE;
		if (op < 2) {
			uint64_t cap = (splitmix64(&r) % 3) * 1000;
			rc = kvr_rank_state_set_capacity(rs, inc, cap, &out);
			if (m.mode == KVR_RANK_ABSENT || inc != m.inc ||
			    (m.mode == KVR_RANK_LRU && cap == 0)) {
				cleared = m.mode != KVR_RANK_ABSENT;
				m_clear(&m);
				m.mode = cap ? KVR_RANK_LRU : KVR_RANK_TTL;
				m.inc = inc;
			} else if (m.mode == KVR_RANK_TTL && cap) {
				want = KVR_EBUSY;
			}
		} else if (op < 3) {
			/* a rank reset or new life: a fresh store, whatever the mode */
			uint64_t cap = (splitmix64(&r) % 3) * 1000;
			rc = kvr_rank_state_renew(rs, inc, cap, &out);
			cleared = m.mode != KVR_RANK_ABSENT;
			m_clear(&m);
			m.mode = cap ? KVR_RANK_LRU : KVR_RANK_TTL;
			m.inc = inc;
		} else if (op < 7) {
			rc = kvr_rank_state_acquire(rs, inc, a, b, n, 1, now, &out);
			if (fenced)
				want = fence_rc;
			else if (m.live[a])
				want = KVR_EEXIST;
			else {
				ns = m_add(&m, b, n, now, stored);
				m.live[a] = true;
				m.has_last[a] = n > 0;
				if (n)
					m.last[a] = b[n - 1].seq;
			}
		} else if (op < 9) {
			uint64_t parent = m.has_last[a] ? m.last[a] : 99;
			if (splitmix64(&r) % 6 == 0)
				parent = 98;
			/* The first block's position is its depth, as the router gives it (hash
			 * h sits at depth log2(h)). */
			uint32_t sp = n ? (uint32_t)(63 - __builtin_clzll(b[0].seq)) : 0;
			rc = kvr_rank_state_materialize(rs, inc, a, parent, b, n, sp, 0, now, &out);
			/* TTL: output below a parent no longer held is not predicted. */
			bool orphan = m.mode == KVR_RANK_TTL && n && sp &&
			              (parent >= H || !m.present[parent]);
			if (fenced)
				want = fence_rc;
			else if (!m.live[a] ||
			         (m.mode == KVR_RANK_LRU && m.has_last[a] && m.last[a] != parent))
				want = KVR_ENOENT;
			else {
				if (!orphan)
					ns = m_add(&m, b, n, now, stored);
				if (n) {
					m.has_last[a] = true;
					m.last[a] = b[n - 1].seq;
				}
			}
		} else if (op < 12) {
			rc = kvr_rank_state_release(rs, inc, a, &out);
			if (fenced)
				want = fence_rc;
			else if (!m.live[a])
				want = KVR_ENOENT;
			else
				m.live[a] = m.has_last[a] = false;
		} else {
			now += splitmix64(&r) % 400;
			rc = kvr_rank_state_tick(rs, now, &out);
			size_t ne = 0;
			if (m.mode == KVR_RANK_TTL)
				for (int h = 0; h < H; h++)
					if (m.present[h] && m.expiry[h] <= now) {
						m.present[h] = false;
						ne++;
					}
			cr_assert_eq(out.n_evicted, ne, "seed %llu step %d: expired",
			             (unsigned long long)seed, step);
			for (size_t i = 0; i < out.n_evicted; i++)
				cr_assert_not(m.present[out_evicted(&out, i)]);
		}
		cr_assert_eq(rc, want, "seed %llu step %d op %llu: rc %d want %d",
		             (unsigned long long)seed, step, (unsigned long long)op, rc, want);
		cr_assert_eq(out.cleared, cleared, "seed %llu step %d", (unsigned long long)seed,
		             step);
		cr_assert_eq(out.n_stored, ns, "seed %llu step %d: n_stored",
		             (unsigned long long)seed, step);
		for (size_t i = 0; i < ns; i++)
			cr_assert_eq(out_stored(&out, b, i)->seq, stored[i]);
		if (op < 12)
			cr_assert_eq(out.n_evicted, 0, "seed %llu step %d",
			             (unsigned long long)seed, step);
		cr_assert_eq(kvr_rank_state_mode(rs), m.mode);
		for (uint64_t h = 1; h < H; h++) {
			/* LRU: presence of h = its whole path from the root is present. */
			uint64_t path[8];
			size_t np = 0;
			for (uint64_t x = h; x; x /= 2)
				np++;
			for (uint64_t x = h, k = np; x; x /= 2)
				path[--k] = x;
			bool lru = m.mode == KVR_RANK_LRU;
			size_t ov = kvr_rank_state_overlap(rs, lru ? path : &h, lru ? np : 1);
			cr_assert_eq(ov == (lru ? np : 1), m.present[h],
			             "seed %llu step %d: hash %llu", (unsigned long long)seed, step,
			             (unsigned long long)h);
		}
	}
}

Test(rank_state, differential_against_model)
{
	const char *env = getenv("RANK_DIFF_SEED");
	uint64_t first = env ? strtoull(env, NULL, 0) : 1, last = env ? first : 200;
	for (uint64_t seed = first; seed <= last; seed++) {
		kvr_rank_state_destroy(rs);
		kvr_lru_out_fini(&out);
		setup();
		rank_seed(seed, env ? 5000 : 300);
	}
}
