/* kvr_router_get_memory: the parts of an empty router, how the index and the predicted caches
 * grow with the blocks routed and shrink when the ranks are removed, and bad input; the
 * allocator seam keeps long-lived and transient objects in arenas of their own. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVR_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "core/alloc.h"
#include "core/index.h"
#include "core/index_internal.h"
#include "core/router_internal.h"
#include "kvrouter.h"

static struct kvr_router *make(int n_ranks)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.block_size = 16;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (int w = 0; w < n_ranks; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 1, 4096, 0), 0);
	return r;
}

static struct kvr_memory mem(struct kvr_router *r)
{
	struct kvr_memory m;
	memset(&m, 0xab, sizeof(m));
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	cr_assert_eq(kvr_router_get_memory(r, &m), 0);
	return m;
}

/* Routes prompt p (n tokens, distinct per p) through tok[]. */
static struct kvr_decision route_prompt(struct kvr_router *r, uint32_t *tok, size_t n, int p)
{
	for (size_t i = 0; i < n; i++)
		tok[i] = (uint32_t)(p * 1000003u + i);
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = tok;
	q.n_tokens = n;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	return d;
}

Test(memory, empty_router_parts)
{
	struct kvr_router *r = make(4);
	struct kvr_memory m = mem(r);
	struct kvr_config c;
	cr_assert_eq(kvr_router_get_config(r, &c), 0);
	/* Two shards, each with a routing ring of the default capacity (4095 -> 4096 slots of
	 * 64 B) and a maintenance ring of 255 (256 slots). */
	cr_assert_geq(m.lanes, 2u * (4096u + 256u) * 64u);
	cr_assert_lt(m.lanes, 2u * (4096u + 256u) * 64u + 256u * 1024u);
	cr_assert_gt(m.rank_tables, 0);
	cr_assert_gt(m.index, 0);
	cr_assert_geq(m.library, m.lanes); /* the rings alone are allocated by the library */
	kvr_router_destroy(r);
}

Test(memory, grows_with_blocks_and_shrinks_on_removal)
{
	struct kvr_router *r = make(2);
	struct kvr_memory m0 = mem(r);
	uint32_t tok[16 * 200];
	for (int p = 0; p < 8; p++) {
		struct kvr_decision d = route_prompt(r, tok, sizeof(tok) / sizeof(tok[0]), p);
		cr_assert_eq(d.status, KVR_DECIDED);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	}
	struct kvr_memory m1 = mem(r);
	cr_assert_gt(m1.index, m0.index, "index %llu -> %llu", (unsigned long long)m0.index,
	             (unsigned long long)m1.index);
	cr_assert_gt(m1.caches, m0.caches);
	cr_assert_eq(m1.lanes, m0.lanes);
	cr_assert_eq(m1.rank_tables, m0.rank_tables);
	cr_assert_gt(m1.library, m0.library);
	cr_assert_eq(kvr_rank_remove(r, (struct kvr_rank_id){0, 0}), 0);
	cr_assert_eq(kvr_rank_remove(r, (struct kvr_rank_id){1, 0}), 0);
	struct kvr_memory m2 = mem(r);
	cr_assert_eq(m2.caches, 0); /* no rank left to hold a cache */
	cr_assert_eq(m2.load, 0);
	kvr_router_destroy(r);
}

/* The recycled attempt records are bounded in bytes: a class of 4096-block records (64k-token
 * prompts, 64 KB of hashes each) keeps 8 of the 12 that end together (512 KB of hashes a
 * class, shards/owner_attempts.c).  The empty pool is its classes' lines and stacks (6.7 KB, an
 * 8 KB size class). */
Test(memory, attempt_pool_bounded)
{
	struct kvr_router *r = make(2);
	struct kvr_memory m0 = mem(r);
	cr_assert_gt(m0.attempt_pool, 0); /* the pool itself */
	cr_assert_leq(m0.attempt_pool, 8192);
	static uint32_t tok[16 * 4096];
	uint64_t att[12];
	int n = 0;
	for (int p = 0; p < 12; p++) {
		struct kvr_decision d = route_prompt(r, tok, sizeof(tok) / sizeof(tok[0]), p);
		if (d.status == KVR_DECIDED)
			att[n++] = d.attempt;
	}
	cr_assert_geq(n, 9, "%d of 12 admitted", n);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	for (int i = 0; i < n; i++)
		cr_assert_eq(kvr_request_finish(r, att[i]), 0);
	struct kvr_memory m1 = mem(r);
	uint64_t rec = 4096u * 16u; /* hashes and sequence hashes, without the header */
	cr_assert_geq(m1.attempt_pool, m0.attempt_pool + rec, "pool %llu",
	              (unsigned long long)m1.attempt_pool);
	cr_assert_leq(m1.attempt_pool, m0.attempt_pool + 8 * (rec + 16384), "pool %llu",
	              (unsigned long long)m1.attempt_pool);
	cr_assert_geq(m1.library, m1.attempt_pool);
	kvr_router_destroy(r);
}

Test(memory, bad_input)
{
	struct kvr_router *r = make(1);
	struct kvr_memory m;
	cr_assert_eq(kvr_router_get_memory(NULL, &m), KVR_EINVAL);
	cr_assert_eq(kvr_router_get_memory(r, NULL), KVR_EINVAL);
	kvr_router_destroy(r);
}

#ifdef KVR_HAVE_JEMALLOC
static unsigned arena_of(void *p)
{
	unsigned a = 0;
	size_t sz = sizeof(a);
	cr_assert_eq(mallctl("arenas.lookup", &a, &sz, &p, sizeof(p)), 0);
	return a;
}

/* core/alloc.c: a long-lived object never comes from the transient arena or the embedder's heap
 * and the other way round, whatever was freed before it in the same size class (a thread cache
 * shared by the arenas would hand one's freed objects to the other), on a thread without caches
 * of its own and on one with them (kvr_alloc_thread_cache_begin, as the shards). */
Test(memory, arenas_apart)
{
	static const size_t sizes[] = {48, 320, 1280, 5120};
	enum { N = 64 };
	void *lg[N], *tr[N], *app[N];
	void *probe = kvr_alloc(8);
	unsigned a_long = arena_of(probe), a_tr = 0, a_app = 0;
	kvr_free(probe, 8);
	for (int cached = 0; cached < 2; cached++) {
		if (cached)
			kvr_alloc_thread_cache_begin();
		for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
			size_t z = sizes[k];
			for (int round = 0; round < 3; round++) {
				/* Each kind freed right before the others allocate its class. */
				for (int i = 0; i < N; i++) {
					app[i] = malloc(z);
					tr[i] = kvr_alloc_transient(z);
					cr_assert(app[i] && tr[i]);
				}
				for (int i = 0; i < N; i++) {
					free(app[i]);
					lg[i] = kvr_alloc(z);
					cr_assert(lg[i]);
					cr_assert_eq(arena_of(lg[i]), a_long, "size %zu", z);
				}
				for (int i = 0; i < N; i++) {
					kvr_free_transient(tr[i], z);
					app[i] = malloc(z);
				}
				for (int i = 0; i < N; i++) {
					kvr_free(lg[i], z);
					tr[i] = kvr_alloc_transient(z);
				}
				for (int i = 0; i < N; i++) {
					a_tr = a_tr ? a_tr : arena_of(tr[i]);
					a_app = arena_of(app[i]);
					cr_assert_eq(arena_of(tr[i]), a_tr, "size %zu", z);
					cr_assert_neq(a_app, a_long,
					              "size %zu: an embedder's object "
					              "from the library arena",
					              z);
					cr_assert_neq(a_app, a_tr, "size %zu", z);
					kvr_free_transient(tr[i], z);
					free(app[i]);
				}
			}
		}
		for (int i = 0; i < N; i++) {
			lg[i] = kvr_alloc(320);
			cr_assert_eq(arena_of(lg[i]), a_long);
		}
		for (int i = 0; i < N; i++)
			kvr_free(lg[i], 320);
		if (cached)
			kvr_alloc_thread_cache_end();
	}
	cr_assert_neq(a_long, a_tr);
}

/* core/alloc.c: what the memory counters count (kvr_alloc_real_size) is what jemalloc really
 * gives, for every size class the long-lived arena rounds to and through a resize both ways
 * (the sized free must name the size class the object has, or jemalloc frees it into the wrong
 * bin); and a large allocation starts on a page (its extra, cache-oblivious page stays
 * untouched: alloc.c's RSS note), an aligned one on a cache line. */
Test(memory, real_sizes_are_true_and_large_ones_page_aligned)
{
	long pg = sysconf(_SC_PAGESIZE);
	size_t page = pg > 0 ? (size_t)pg : 4096;
	for (size_t z = 1; z <= 70000; z += z < 1100 ? 1 : 37) {
		void *p = kvr_alloc(z);
		cr_assert(p);
		memset(p, 0x5a, z);
		size_t real = kvr_alloc_real_size(z);
		cr_assert_eq(sallocx(p, 0), real, "size %zu: %zu allocated, %zu counted", z,
		             sallocx(p, 0), real);
		cr_assert_geq(real, z);
		cr_assert_leq(real, z + z / 2 + 16, "size %zu rounded to %zu", z, real);
		if (real >= 16384)
			cr_assert_eq((uintptr_t)p % page, 0, "size %zu not page-aligned", z);
		size_t sizes[] = {z * 2 + 1, z / 2 + 1, z};
		for (int k = 0; k < 3; k++) {
			void *q = kvr_realloc(p, k ? sizes[k - 1] : z, sizes[k]);
			cr_assert(q);
			p = q;
			cr_assert_eq(sallocx(p, 0), kvr_alloc_real_size(sizes[k]),
			             "resize %zu -> %zu", k ? sizes[k - 1] : z, sizes[k]);
		}
		kvr_free(p, z);
		void *a = kvr_alloc_aligned(z);
		cr_assert(a);
		cr_assert_eq((uintptr_t)a % 64, 0);
		cr_assert_eq(sallocx(a, 0), kvr_alloc_real_size_aligned(z), "aligned size %zu", z);
		kvr_free_aligned(a, z);
	}
}
#endif

static bool churn_stop;
static uint64_t churn_failed;

static void *churn(void *arg)
{
	(void)arg;
	while (!__atomic_load_n(&churn_stop, __ATOMIC_RELAXED)) {
		void *p = kvr_alloc(16);
		if (p)
			kvr_free(p, 16);
		else
			__atomic_add_fetch(&churn_failed, 1, __ATOMIC_RELAXED);
	}
	return NULL;
}

/* The failure hook armed while other threads allocate (replica and shard threads do in the OOM
 * loops): exactly one allocation fails per arming, and the count never wraps below zero (two
 * threads that both read 1 took it to 2^64 - 1: the failure that fired read as pending). */
Test(memory, fail_after_with_threads_allocating, .timeout = 60)
{
	pthread_t t[3];
	for (int i = 0; i < 3; i++)
		cr_assert_eq(pthread_create(&t[i], NULL, churn, NULL), 0);
	/* Up to 1M rounds, but at most ~10 s: under ASan on a loaded 2-core machine (CI's
	 * sanitizer suite beside other tests) each round waits for a churn thread to be scheduled,
	 * and 1M rounds took past the 60 s timeout.  The spinner yields so the churners run. */
	uint64_t rounds;
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (rounds = 0; rounds < 1000000; rounds++) {
		if ((rounds & 1023) == 0 && rounds > 0) {
			clock_gettime(CLOCK_MONOTONIC, &t1);
			if (t1.tv_sec - t0.tv_sec >= 10)
				break;
		}
		kvr_alloc_fail_after(1);
		uint64_t left;
		for (unsigned spins = 0; (left = kvr_alloc_fail_pending()) == 1; spins++)
			if (spins >= 64)
				sched_yield();
		cr_assert_eq(left, 0, "round %lu: %lu allocations pending after the failure",
		             (unsigned long)rounds, (unsigned long)left);
	}
	__atomic_store_n(&churn_stop, true, __ATOMIC_RELAXED);
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	kvr_alloc_fail_after(0);
	cr_assert_eq(churn_failed, rounds);
}

/* The index's retired objects still waiting for a full batch, read under the writers' mutex
 * (no call on the router: a reading through the API is a shard task, which would itself make
 * the shard go idle once more). */
static unsigned retired_waiting(struct kvr_router *r)
{
	pthread_mutex_lock(&r->index->wlock);
	unsigned n = r->index->rt.n;
	pthread_mutex_unlock(&r->index->wlock);
	return n;
}

/* Waits up to 5 s (the shards' idle hook comes 100 ms after their last work) for the batch to
 * be handed to RCU; returns what is left. */
static unsigned retired_after_idle(struct kvr_router *r)
{
	unsigned n = retired_waiting(r);
	for (int i = 0; i < 50 && n; i++) {
		struct timespec ts = {0, 100 * 1000 * 1000};
		nanosleep(&ts, NULL);
		n = retired_waiting(r);
	}
	return n;
}

/* An events-mode router after a burst: 1,040 chains of 8 blocks stored, the last 40 removed.
 * *before: its memory before the removals. */
static struct kvr_router *burst_then_remove(struct kvr_memory *before)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	const struct kvr_rank_id R = {1, 0};
	cr_assert_eq(kvr_rank_add(r, R, 1, 0, 0), 0);
	uint64_t id = 1, h[8];
	struct kvr_event_block b[8];
	for (int k = 0; k < 1040; k++) {
		for (int i = 0; i < 8; i++) {
			h[i] = 1000003ull * (uint64_t)(k + 1) + (uint64_t)i + 1;
			b[i] = (struct kvr_event_block){
			    .ext_hash = h[i], .local_hash = 77ull * (uint64_t)(k + 1) + i};
		}
		struct kvr_event ev = {
		    .type = KVR_EVENT_STORED, .event_id = id++, .blocks = b, .n_blocks = 8};
		cr_assert_eq(kvr_events_apply(r, R, &ev), 0);
	}
	*before = mem(r);
	for (int k = 1000; k < 1040; k++) {
		for (int i = 0; i < 8; i++)
			h[i] = 1000003ull * (uint64_t)(k + 1) + (uint64_t)i + 1;
		struct kvr_event ev = {
		    .type = KVR_EVENT_REMOVED, .event_id = id++, .removed = h, .n_removed = 8};
		cr_assert_eq(kvr_events_apply(r, R, &ev), 0);
	}
	return r;
}

/* An events-mode burst (40 of 1,040 chains stored, then removed; the run table keeps its
 * arrays, so no table retire hands the batch over) leaves 80 retired objects (runs and hash
 * arrays) in the index's batch; the shard's idle hook hands them to RCU, and the index's
 * memory falls by them.  Before, they waited for the next write, for good on an idle router
 * (probe: kvr_memory.index 915,760 for 2 s of idleness, 910,000 once handed over). */
Test(memory, idle_router_hands_retired_index_objects_to_rcu)
{
	struct kvr_memory m0;
	struct kvr_router *r = burst_then_remove(&m0);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	cr_assert_eq(retired_after_idle(r), 0, "retired objects wait in the index's batch");
	/* Freed after a grace period: 40 runs and 40 hash arrays of 8 words at least. */
	struct kvr_memory m1 = mem(r);
	for (int i = 0; i < 50 && m1.index + 40 * 128 > m0.index; i++) {
		struct timespec ts = {0, 100 * 1000 * 1000};
		nanosleep(&ts, NULL);
		m1 = mem(r);
	}
	cr_assert_leq(m1.index + 40 * 128, m0.index, "index %llu -> %llu",
	              (unsigned long long)m0.index, (unsigned long long)m1.index);
	kvr_router_destroy(r);
}

/* The same burst, the index's writer mutex held by no shard (here the test, as the batch reads
 * above do) when the idle hook tries it 100 ms after the burst: the hook only tries, and its
 * missed try left the batch for the next write (CI, ASan: "retired objects wait in the index's
 * batch" after 5 s).  It tries again at the next idle period now. */
Test(memory, an_idle_hook_that_found_the_mutex_held_tries_again)
{
	struct kvr_memory m0;
	struct kvr_router *r = burst_then_remove(&m0);
	pthread_mutex_lock(&r->index->wlock);
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	struct timespec held = {0, 400 * 1000 * 1000}; /* past the hook, 100 ms after the work */
	nanosleep(&held, NULL);
	cr_assert_neq(r->index->rt.n, 0, "the batch was handed over under a held mutex");
	pthread_mutex_unlock(&r->index->wlock);
	cr_assert_eq(retired_after_idle(r), 0, "retired objects wait in the index's batch");
	kvr_router_destroy(r);
}

/* TTL expiry is a shard timer: it removes what a rank without capacity stopped using long after
 * the shard's idle hook ran for the burst that stored it, and the runs it retired must not wait
 * for the next write.  Five routed prompts expire 200 ms after the burst; a rank with capacity
 * keeps 1,000 others, so the run table keeps its arrays.  Before, the expiry's 10 retired objects
 * stayed in the batch (probe: 10 at 500 ms through 1,200 ms; the idle hook had run at 100 ms). */
Test(memory, ttl_expiry_after_idle_hands_retired_index_objects_to_rcu)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.ttl_ns = 200 * 1000 * 1000;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	const struct kvr_rank_id ttl = {2, 0}, lru = {1, 0};
	cr_assert_eq(kvr_rank_add(r, ttl, 1, 0, 0), 0); /* no capacity: TTL retention */
	cr_assert_eq(kvr_rank_add(r, lru, 1, 1000000, 0), 0);
	static uint32_t tok[64];
	for (int p = 0; p < 1005; p++) {
		for (int i = 0; i < 64; i++)
			tok[i] = (uint32_t)(p * 1000003u + (uint32_t)i);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 64;
		q.pinned = p < 1000 ? &lru : &ttl;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(d.status, KVR_DECIDED);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	}
	cr_assert_eq(kvr_router_sync(r, 10000), 0);
	uint32_t slot;
	cr_assert_eq(kvr_router_find_rank(r, ttl, &slot), 0);
	/* No call on the router from here: the expiry comes by itself. */
	for (int i = 0; i < 50 && kvr_index_tree_size(r->index, slot) != 0; i++) {
		struct timespec ts = {0, 100 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	cr_assert_eq(kvr_index_tree_size(r->index, slot), 0, "the prompts expired");
	cr_assert_eq(retired_after_idle(r), 0, "the expiry's retired objects wait in the batch");
	kvr_router_destroy(r);
}
