/*
 * The placement key of the tables a prompt chooses the keys of (core/place.h).
 *
 * Before, the index's run table placed a run by the top bits of seq x 0x9e3779b97f4a7c15 (in
 * the segment of seq's top 8 bits): prompts crafted so that their first blocks' hashes share
 * those bits piled into one probe cluster (20,000 of them: a cluster of ~20,000 slots that
 * every insert and lookup in it walked; perf/bench_flood: the shard's bookings 11-14x and the
 * lookups 20-40x slower than for random prompts).  Now every such table multiplies by a key
 * drawn at random once per process.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/index_internal.h"
#include "core/place.h"
#include "core/router_internal.h"
#include "kvrouter.h"

static void *draw(void *arg)
{
	*(uint64_t *)arg = kvr_place_key();
	return NULL;
}

/* The key is odd, drawn once: threads racing on its first use all get the winner's. */
Test(place, one_key_per_process)
{
	cr_assert_eq(__atomic_load_n(&kvr_place_key_, __ATOMIC_RELAXED), 0,
	             "nothing used the key yet in this test's process");
	pthread_t t[8];
	uint64_t k[8];
	for (int i = 0; i < 8; i++)
		cr_assert_eq(pthread_create(&t[i], NULL, draw, &k[i]), 0);
	for (int i = 0; i < 8; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < 8; i++) {
		cr_assert_eq(k[i], k[0], "thread %d saw another key", i);
		cr_assert_eq(k[i], kvr_place_key());
	}
	cr_assert(k[0] & 1, "the key is odd");
	cr_assert_eq(kvr_place(3), 3 * k[0]);
}

/* Two processes draw different keys (a fork before the first use; after it, the child keeps
 * its parent's, with the tables it inherits). */
Test(place, processes_draw_their_own)
{
	uint64_t k[2];
	for (int i = 0; i < 2; i++) {
		int fd[2];
		cr_assert_eq(pipe(fd), 0);
		pid_t pid = fork();
		cr_assert_neq(pid, -1);
		if (!pid) {
			uint64_t key = kvr_place_key();
			_exit(write(fd[1], &key, sizeof(key)) == sizeof(key) ? 0 : 1);
		}
		cr_assert_eq(read(fd[0], &k[i], sizeof(k[i])), (ssize_t)sizeof(k[i]));
		int st;
		cr_assert_eq(waitpid(pid, &st, 0), pid);
		close(fd[0]);
		close(fd[1]);
	}
	cr_assert_neq(k[0], k[1], "two processes, one key %#lx", (unsigned long)k[0]);
	uint64_t mine = kvr_place_key();
	pid_t pid = fork();
	if (!pid)
		_exit(kvr_place_key() == mine ? 0 : 1);
	int st;
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "a child keeps its parent's key");
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

/* The longest distance from an entry's home to its slot in segment s's run table. */
static uint64_t longest_probe(const struct kvr_index *idx, unsigned s, uint32_t *count)
{
	const struct idx_seg *g = &idx->seg[s];
	uint64_t most = 0;
	*count = g->count;
	for (uint64_t i = 0; g->tab && i < g->cap; i++) {
		const uint64_t e = g->tab[i];
		if (!e || e == IDX_TOMB)
			continue;
		const uint64_t h = idx_tab_home(idx_ent_run(e)->first, g->cap);
		const uint64_t d = i >= h ? i - h : i + g->cap - h;
		most = d > most ? d : most;
	}
	return most;
}

/* 20,000 prompts whose first-block hashes collide in the fixed placement (one segment, the top
 * 20 bits of seq x 0x9e3779b97f4a7c15 equal) do not make a cluster. */
Test(place, crafted_hashes_spread, .timeout = 120)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	/* Back to back, 40,000 calls: without it a busy CI machine's shard fell behind and a route
	 * met its full lane (KVR_EAGAIN after the bounded wait). */
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 0, 1u << 20, 1ull << 24),
		             0);
	uint64_t ginv = 0x9e3779b97f4a7c15ull;
	for (int i = 0; i < 6; i++) /* its inverse modulo 2^64 (Newton) */
		ginv *= 2 - 0x9e3779b97f4a7c15ull * ginv;
	const unsigned seg = 77;
	const uint64_t target = 0xabcdeull;
	const uint32_t n = 20000;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t h[2];
		do
			h[0] = (target << 44 | (rnd() >> 20)) * ginv;
		while (h[0] >> 56 != seg);
		cr_assert_eq((h[0] * 0x9e3779b97f4a7c15ull) >> 44, target);
		h[1] = rnd();
		struct kvr_request q;
		kvr_request_init(&q);
		q.local_hashes = h;
		q.n_hashes = 2;
		q.n_tokens = 2 * c.block_size;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r, &q, &d), 0);
		cr_assert_eq(kvr_request_finish(r, d.attempt), 0);
	}
	cr_assert_eq(kvr_router_sync(r, 60000), 0);
	uint32_t count;
	const uint64_t most = longest_probe(r->index, seg, &count);
	cr_log_info("segment %u: %u runs, the longest probe %lu slots", seg, count,
	            (unsigned long)most);
	cr_assert_geq(count, n, "every crafted prompt's first run is in segment %u", seg);
	cr_assert_lt(most, 1000, "a probe cluster of %lu slots", (unsigned long)most);
	kvr_router_destroy(r);
}
