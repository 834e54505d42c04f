/*
 * tests/unit/test_sim_pool.c - the simulator's block pool against hand-worked vLLM v1
 * scenarios (tail-first release, lazy eviction, hits leaving the free queue, several copies of
 * one hash, reset) and a differential test against an array-based reference model.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "tests/common/xorshift.h"
#include "tools/sim/block_pool.h"

static struct sim_pool *mk(uint32_t n)
{
	struct sim_pool *p = NULL;
	cr_assert_eq(sim_pool_create(n, &p), 0);
	return p;
}

static void expect_order(const struct sim_pool *p, const uint32_t *want, size_t n)
{
	uint32_t got[64];
	cr_assert_eq(sim_pool_free_order(p, got, 64), n);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(got[i], want[i], "free queue[%zu]: got %u want %u", i, got[i],
		             want[i]);
}

Test(sim_pool, create_rejects_bad_args)
{
	struct sim_pool *p = NULL;
	cr_assert_eq(sim_pool_create(0, &p), KVR_EINVAL);
	cr_assert_eq(sim_pool_create(4, NULL), KVR_EINVAL);
	sim_pool_destroy(NULL);
}

Test(sim_pool, initial_queue_in_block_order_and_alloc_from_head)
{
	struct sim_pool *p = mk(6);
	expect_order(p, (uint32_t[]){0, 1, 2, 3, 4, 5}, 6);
	uint32_t b[3];
	size_t ne = 99;
	cr_assert_eq(sim_pool_alloc(p, 3, b, NULL, &ne), 0);
	cr_assert_eq(ne, 0);
	cr_assert(b[0] == 0 && b[1] == 1 && b[2] == 2);
	cr_assert_eq(sim_pool_num_free(p), 3);
	cr_assert_eq(sim_pool_block(p, 1)->ref, 1);
	/* Too many: refused, nothing changed. */
	uint32_t big[4];
	cr_assert_eq(sim_pool_alloc(p, 4, big, NULL, NULL), KVR_EAGAIN);
	expect_order(p, (uint32_t[]){3, 4, 5}, 3);
	sim_pool_destroy(p);
}

/* vLLM frees a finished request's blocks in reverse, so its tail is evicted first. */
Test(sim_pool, release_is_tail_first_and_eviction_is_lazy)
{
	struct sim_pool *p = mk(6);
	uint32_t b[4];
	cr_assert_eq(sim_pool_alloc(p, 4, b, NULL, NULL), 0);
	for (uint32_t i = 0; i < 4; i++)
		cr_assert(sim_pool_cache_block(p, b[i], 100 + i, 200 + i));
	sim_pool_release(p, b, 4);
	expect_order(p, (uint32_t[]){4, 5, 3, 2, 1, 0}, 6);
	/* Released blocks keep their hashes: still a hit. */
	cr_assert_eq(sim_pool_num_cached(p), 4);
	cr_assert_eq(sim_pool_lookup(p, 103), 3);

	/* Allocating 3 pops 4, 5 (unhashed) and 3: exactly one removal, the tail block. */
	uint32_t c[3];
	struct sim_evicted ev[3];
	size_t ne = 0;
	cr_assert_eq(sim_pool_alloc(p, 3, c, ev, &ne), 0);
	cr_assert(c[0] == 4 && c[1] == 5 && c[2] == 3);
	cr_assert_eq(ne, 1);
	cr_assert_eq(ev[0].seq, 103);
	cr_assert_eq(ev[0].local, 203);
	cr_assert(ev[0].last_copy);
	cr_assert_eq(sim_pool_lookup(p, 103), SIM_NO_BLOCK);
	cr_assert_eq(sim_pool_lookup(p, 102), 2);
	cr_assert_not(sim_pool_block(p, 3)->hashed);
	uint64_t hs[8];
	cr_assert_eq(sim_pool_cached_hashes(p, hs, 8), 3);
	sim_pool_destroy(p);
}

/* A hit on a free cached block takes it out of the queue; releasing puts it at the tail. */
Test(sim_pool, hit_takes_block_out_of_free_queue)
{
	struct sim_pool *p = mk(4);
	uint32_t b[2];
	cr_assert_eq(sim_pool_alloc(p, 2, b, NULL, NULL), 0);
	sim_pool_cache_block(p, b[0], 7, 70);
	sim_pool_cache_block(p, b[1], 8, 80);
	sim_pool_release(p, b, 2);
	expect_order(p, (uint32_t[]){2, 3, 1, 0}, 4);

	uint32_t hit[2];
	cr_assert_eq(sim_pool_match_prefix(p, (uint64_t[]){7, 8, 9}, 3, hit), 2);
	cr_assert_eq(sim_pool_count_free(p, hit, 2), 2);
	sim_pool_touch(p, hit, 1); /* only block 0 (hash 7) */
	cr_assert_eq(sim_pool_num_free(p), 3);
	cr_assert_eq(sim_pool_block(p, 0)->ref, 1);
	cr_assert_not(sim_pool_block(p, 0)->queued);
	expect_order(p, (uint32_t[]){2, 3, 1}, 3);
	cr_assert_eq(sim_pool_count_free(p, hit, 2), 1);

	/* A second hit on a held block only counts a reference. */
	sim_pool_touch(p, hit, 1);
	cr_assert_eq(sim_pool_block(p, 0)->ref, 2);
	cr_assert_eq(sim_pool_num_free(p), 3);
	sim_pool_release(p, hit, 1);
	cr_assert_eq(sim_pool_num_free(p), 3);
	sim_pool_release(p, hit, 1);
	expect_order(p, (uint32_t[]){2, 3, 1, 0}, 4);
	sim_pool_destroy(p);
}

/* Two requests computing the same block concurrently leave two physical copies. */
Test(sim_pool, duplicate_copies_of_one_hash)
{
	struct sim_pool *p = mk(4);
	uint32_t a, b;
	cr_assert_eq(sim_pool_alloc(p, 1, &a, NULL, NULL), 0);
	cr_assert_eq(sim_pool_alloc(p, 1, &b, NULL, NULL), 0);
	cr_assert(sim_pool_cache_block(p, a, 42, 1));
	cr_assert_not(sim_pool_cache_block(p, b, 42, 1));
	cr_assert_eq(sim_pool_num_cached(p), 1);
	cr_assert_eq(sim_pool_lookup(p, 42), a, "lookup returns the oldest copy");
	/* Caching an already-hashed block is a no-op. */
	cr_assert_not(sim_pool_cache_block(p, a, 43, 1));
	cr_assert_eq(sim_pool_block(p, a)->seq, 42);

	sim_pool_release(p, &a, 1);
	sim_pool_release(p, &b, 1);
	expect_order(p, (uint32_t[]){2, 3, 0, 1}, 4);
	uint32_t c[3];
	struct sim_evicted ev[3];
	size_t ne;
	cr_assert_eq(sim_pool_alloc(p, 3, c, ev, &ne), 0);
	cr_assert_eq(ne, 1);
	cr_assert_eq(ev[0].seq, 42);
	cr_assert_not(ev[0].last_copy, "another copy survives");
	cr_assert_eq(sim_pool_lookup(p, 42), b);
	uint32_t d;
	cr_assert_eq(sim_pool_alloc(p, 1, &d, ev, &ne), 0);
	cr_assert_eq(d, b);
	cr_assert_eq(ne, 1);
	cr_assert(ev[0].last_copy);
	cr_assert_eq(sim_pool_num_cached(p), 0);
	sim_pool_destroy(p);
}

Test(sim_pool, reset_only_when_nothing_is_held)
{
	struct sim_pool *p = mk(3);
	uint32_t b;
	sim_pool_alloc(p, 1, &b, NULL, NULL);
	sim_pool_cache_block(p, b, 5, 5);
	cr_assert_eq(sim_pool_reset(p), KVR_EBUSY);
	cr_assert_eq(sim_pool_num_cached(p), 1);
	sim_pool_release(p, &b, 1);
	cr_assert_eq(sim_pool_reset(p), 0);
	cr_assert_eq(sim_pool_num_cached(p), 0);
	cr_assert_eq(sim_pool_lookup(p, 5), SIM_NO_BLOCK);
	cr_assert_eq(sim_pool_num_free(p), 3);
	sim_pool_destroy(p);
}

/* ---------------------------------------------------------------- differential test */

#define RN   24 /* blocks */
#define RSEQ 10 /* distinct hashes: plenty of duplicates */
#define RREQ 8

struct ref {
	uint32_t ref[RN];
	bool hashed[RN];
	uint64_t seq[RN];
	uint64_t stamp[RN]; /* when cached: copies are found oldest first */
	uint64_t clock;
	uint32_t q[RN];
	size_t qn;
};

struct held {
	uint32_t ids[64];
	size_t n;
};

static uint32_t ref_lookup(const struct ref *m, uint64_t seq)
{
	uint32_t best = SIM_NO_BLOCK;
	for (uint32_t i = 0; i < RN; i++)
		if (m->hashed[i] && m->seq[i] == seq &&
		    (best == SIM_NO_BLOCK || m->stamp[i] < m->stamp[best]))
			best = i;
	return best;
}

static void ref_unqueue(struct ref *m, uint32_t id)
{
	for (size_t i = 0; i < m->qn; i++)
		if (m->q[i] == id) {
			memmove(&m->q[i], &m->q[i + 1], (m->qn - i - 1) * sizeof(m->q[0]));
			m->qn--;
			return;
		}
	cr_assert_fail("block %u not queued", id);
}

static void check_same(const struct sim_pool *p, const struct ref *m, uint64_t seed, int op)
{
	uint32_t q[RN];
	cr_assert_eq(sim_pool_free_order(p, q, RN), m->qn, "seed %llu op %d",
	             (unsigned long long)seed, op);
	for (size_t i = 0; i < m->qn; i++)
		cr_assert_eq(q[i], m->q[i], "seed %llu op %d queue[%zu]", (unsigned long long)seed,
		             op, i);
	size_t keys = 0;
	for (uint64_t s = 0; s < RSEQ; s++) {
		uint32_t want = ref_lookup(m, s);
		keys += want != SIM_NO_BLOCK;
		cr_assert_eq(sim_pool_lookup(p, s), want, "seed %llu op %d seq %llu",
		             (unsigned long long)seed, op, (unsigned long long)s);
	}
	cr_assert_eq(sim_pool_num_cached(p), keys);
	for (uint32_t i = 0; i < RN; i++)
		cr_assert_eq(sim_pool_block(p, i)->ref, m->ref[i]);
}

/* Both free orders (kvrouter.h, enum kvr_free_order): in fresh-first (vLLM's 2026
 * free_blocks), a release puts its blocks without a hash at the queue's head, deepest first
 * (prepend_n of the reversed list), and appends the rest; in tail-first all are appended. */
static void differential(bool tail_first)
{
	for (uint64_t seed = 1; seed <= 40; seed++) {
		uint64_t s = seed * 0x9e3779b97f4a7c15ULL;
		struct sim_pool *p = mk(RN);
		sim_pool_set_tail_first(p, tail_first);
		struct ref m = {.qn = RN};
		for (uint32_t i = 0; i < RN; i++)
			m.q[i] = i;
		struct held req[RREQ] = {0};
		for (int op = 0; op < 400; op++) {
			struct held *h = &req[xorshift64(&s) % RREQ];
			switch (xorshift64(&s) % 4) {
			case 0: { /* allocate */
				size_t k = 1 + xorshift64(&s) % 4;
				if (h->n + k > 64)
					break;
				uint32_t out[4];
				struct sim_evicted ev[4];
				size_t ne = 0;
				int rc = sim_pool_alloc(p, k, out, ev, &ne);
				if (k > m.qn) {
					cr_assert_eq(rc, KVR_EAGAIN);
					break;
				}
				cr_assert_eq(rc, 0);
				size_t ke = 0;
				for (size_t i = 0; i < k; i++) {
					uint32_t id = m.q[0];
					ref_unqueue(&m, id);
					cr_assert_eq(out[i], id, "seed %llu op %d",
					             (unsigned long long)seed, op);
					if (m.hashed[id]) {
						m.hashed[id] = false;
						cr_assert(ke < ne);
						cr_assert_eq(ev[ke].seq, m.seq[id]);
						cr_assert_eq(ev[ke].last_copy,
						             ref_lookup(&m, m.seq[id]) ==
						                 SIM_NO_BLOCK);
						ke++;
					}
					m.ref[id] = 1;
					h->ids[h->n++] = id;
				}
				cr_assert_eq(ke, ne);
				break;
			}
			case 1: { /* prefix-cache hit on one hash */
				uint64_t sq = xorshift64(&s) % RSEQ;
				uint32_t id = ref_lookup(&m, sq);
				if (id == SIM_NO_BLOCK || h->n >= 64)
					break;
				if (m.ref[id] == 0)
					ref_unqueue(&m, id);
				m.ref[id]++;
				sim_pool_touch(p, &id, 1);
				h->ids[h->n++] = id;
				break;
			}
			case 2: { /* cache one of the held blocks */
				if (h->n == 0)
					break;
				uint32_t id = h->ids[xorshift64(&s) % h->n];
				uint64_t sq = xorshift64(&s) % RSEQ;
				bool want = !m.hashed[id] && ref_lookup(&m, sq) == SIM_NO_BLOCK;
				bool got = sim_pool_cache_block(p, id, sq, sq + 1000);
				cr_assert_eq(got, want);
				if (!m.hashed[id]) {
					m.hashed[id] = true;
					m.seq[id] = sq;
					m.stamp[id] = ++m.clock;
				}
				break;
			}
			case 3: { /* release a request, tail first */
				sim_pool_release(p, h->ids, h->n);
				uint32_t fresh[64];
				size_t nf = 0;
				for (size_t i = h->n; i-- > 0;) {
					uint32_t id = h->ids[i];
					if (--m.ref[id] != 0)
						continue;
					if (!tail_first && !m.hashed[id])
						fresh[nf++] = id;
					else
						m.q[m.qn++] = id;
				}
				memmove(&m.q[nf], m.q, m.qn * sizeof(m.q[0]));
				memcpy(m.q, fresh, nf * sizeof(m.q[0]));
				m.qn += nf;
				h->n = 0;
				break;
			}
			}
			check_same(p, &m, seed, op);
		}
		sim_pool_destroy(p);
	}
}

Test(sim_pool, differential_against_reference_model_fresh_first)
{
	differential(false);
}

Test(sim_pool, differential_against_reference_model_tail_first)
{
	differential(true);
}

/* Fresh-first (the default): a released block without a hash is reused before any cached
 * one is evicted; tail-first, it waits behind the cached blocks freed before it. */
Test(sim_pool, a_released_block_without_a_hash_is_reused_first)
{
	for (int tf = 0; tf < 2; tf++) {
		struct sim_pool *p = mk(4);
		sim_pool_set_tail_first(p, tf);
		uint32_t a[2], b[2];
		cr_assert_eq(sim_pool_alloc(p, 2, a, NULL, NULL), 0);
		cr_assert(sim_pool_cache_block(p, a[0], 100, 200)); /* a[1]: partial, no hash */
		sim_pool_release(p, a, 2);
		cr_assert_eq(sim_pool_alloc(p, 2, b, NULL, NULL), 0);
		cr_assert(sim_pool_cache_block(p, b[0], 101, 201)); /* b[1]: partial */
		sim_pool_release(p, b, 2);
		/* Two blocks for a third request: fresh-first takes the two partial ones, and both
		 * cached blocks stay; tail-first takes the queue's head, a[1] then a[0], evicting
		 * the first request's cached block. */
		uint32_t c[2];
		struct sim_evicted ev[2];
		size_t ne = 0;
		cr_assert_eq(sim_pool_alloc(p, 2, c, ev, &ne), 0);
		if (!tf) {
			cr_assert_eq(ne, 0, "fresh-first evicted %zu cached blocks", ne);
			cr_assert_neq(sim_pool_lookup(p, 100), SIM_NO_BLOCK);
		} else {
			cr_assert_eq(ne, 1);
			cr_assert_eq(ev[0].seq, 100);
		}
		cr_assert_neq(sim_pool_lookup(p, 101), SIM_NO_BLOCK);
		sim_pool_destroy(p);
	}
}

Test(sim_pool, no_leak)
{
	int64_t before = kvr_alloc_live_bytes();
	struct sim_pool *p = mk(100);
	sim_pool_destroy(p);
	cr_assert_eq(kvr_alloc_live_bytes(), before);
}
