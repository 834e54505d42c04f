/*
 * perf/bench_flood.c - hash flooding: prompts crafted so that their block hashes share the
 * placement bits of the index's tables, against prompts with random hashes.
 *
 * The hashes are public (XXH3, seed 1337), so if a table placed a key by a fixed function of
 * its hash, prompts found offline whose first blocks' hashes land on one home would pile into
 * one probe cluster that every insert and every miss near it walks: O(crafted) per operation.
 * This bench crafts first-block hashes against the unkeyed placement the index used before
 * (the top 8 bits of seq pick one of the run table's segments, the top bits of
 * seq x 0x9e3779b97f4a7c15 the home in it, and the tops tables' too), routes
 * them as prompts given by their hashes (seq[0] = local[0], so crafting costs nothing here; from
 * tokens each crafted block costs ~2^(bits + 8) hashes), and times:
 *   insert   the wall time of routing all of them and the shard's bookings (kvr_router_sync),
 *            per prompt (the shard's writes walk a cluster: its cost grows along)
 *   miss     a query-only route of a fresh random prompt afterwards (a lookup that misses)
 *   hit      a query-only route of one of the prompts routed (a lookup that hits)
 * for a router fed the crafted prompts and one fed random ones, in one run, alternating.
 * Prints SUMMARY lines with the crafted / random ratios (1.0: flooding does nothing).
 *
 * Usage: bench_flood [--n 20000] [--bits 20] [--rounds 3]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "perf/bench_util.h"

static uint64_t rng_state = 0x1234567;

static uint64_t rnd(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* The inverse of an odd a modulo 2^64 (Newton's iteration). */
static uint64_t inverse(uint64_t a)
{
	uint64_t x = a;
	for (int i = 0; i < 6; i++)
		x *= 2 - a * x;
	return x;
}

#define BS     16u
#define BLOCKS 4u

static struct kvr_router *make(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.block_size = BS;
	c.n_shards = 1;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r)) {
		fprintf(stderr, "create: %s\n", kvr_last_error());
		exit(1);
	}
	for (uint64_t w = 0; w < 8; w++)
		if (kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 0, 1u << 20, 1ull << 24)) {
			fprintf(stderr, "rank_add: %s\n", kvr_last_error());
			exit(1);
		}
	return r;
}

/* Routes the prompt whose block hashes are h[0..BLOCKS); returns wall ns. */
static uint64_t route(struct kvr_router *r, const uint64_t *h, uint32_t flags)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.local_hashes = h;
	q.n_hashes = BLOCKS;
	q.n_tokens = BLOCKS * BS;
	q.flags = flags;
	struct kvr_decision d;
	uint64_t t0 = now_ns();
	if (kvr_route(r, &q, &d)) {
		fprintf(stderr, "route: %s\n", kvr_last_error());
		exit(1);
	}
	uint64_t t = now_ns() - t0;
	if (!(flags & KVR_ROUTE_QUERY_ONLY))
		kvr_request_finish(r, d.attempt); /* its blocks stay predicted */
	return t;
}

static double median(uint64_t *v, size_t n)
{
	qsort(v, n, sizeof(*v), cmp_u64);
	return (double)v[n / 2];
}

int main(int argc, char **argv)
{
	size_t n = 20000;
	unsigned bits = 20, rounds = 3;
	/* usage: bench_flood [--n N>0] [--bits 1..32] [--rounds R] */
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--n"))
			n = opt_u64(argc, argv, i, 1, 100000000);
		else if (!strcmp(argv[i], "--bits"))
			bits = (unsigned)opt_u64(argc, argv, i, 1, 32);
		else if (!strcmp(argv[i], "--rounds"))
			rounds = (unsigned)opt_u64(argc, argv, i, 0, 1000000);
		else
			opt_unknown(argv, i);
	}
	const uint64_t ginv = inverse(0x9e3779b97f4a7c15ull);
	uint64_t *crafted = malloc(n * BLOCKS * 8), *random = malloc(n * BLOCKS * 8);
	uint64_t *t_miss = malloc(n * 8), *t_hit = malloc(n * 8);
	if (!crafted || !random || !t_miss || !t_hit)
		return 1;
	pin(0);
	printf("# %zu prompts of %u blocks; crafted first-block hashes share their top 8 bits "
	       "(the index's segment) and the top %u bits of seq x 0x9e3779b97f4a7c15\n",
	       n, BLOCKS, bits);
	for (unsigned round = 0; round < rounds; round++) {
		const uint64_t target = rnd() >> (64 - bits);
		for (size_t i = 0; i < n * BLOCKS; i++) {
			random[i] = rnd();
			crafted[i] = rnd();
		}
		const uint64_t seg = rnd() >> 56;
		for (size_t i = 0; i < n;
		     i++) { /* seq[0] = local[0]: its mix has the target bits */
			uint64_t x;
			do /* and the index's segment (its top 8 bits) is seg: 1 in 256 */
				x = (target << (64 - bits) | (rnd() >> bits)) * ginv;
			while (x >> 56 != seg);
			crafted[i * BLOCKS] = x;
		}
		double ins[2], miss[2], hit[2];
		for (int k = 0; k < 2; k++) {
			const uint64_t *set = k ? random : crafted;
			struct kvr_router *r = make();
			uint64_t t0 = now_ns();
			for (size_t i = 0; i < n; i++)
				route(r, set + i * BLOCKS, 0);
			if (kvr_router_sync(r, 600000)) {
				fprintf(stderr, "sync: %s\n", kvr_last_error());
				return 1;
			}
			ins[k] = (double)(now_ns() - t0) / (double)n;
			for (size_t i = 0; i < n; i++) {
				uint64_t fresh[BLOCKS];
				for (unsigned b = 0; b < BLOCKS; b++)
					fresh[b] = rnd();
				t_miss[i] = route(r, fresh, KVR_ROUTE_QUERY_ONLY);
				t_hit[i] =
				    route(r, set + (rnd() % n) * BLOCKS, KVR_ROUTE_QUERY_ONLY);
			}
			miss[k] = median(t_miss, n);
			hit[k] = median(t_hit, n);
			kvr_router_destroy(r);
		}
		printf("SUMMARY bench=flood round=%u n=%zu bits=%u insert_ns_crafted=%.0f "
		       "insert_ns_random=%.0f insert_ratio=%.2f miss_p50_ns_crafted=%.0f "
		       "miss_p50_ns_random=%.0f miss_ratio=%.2f hit_p50_ns_crafted=%.0f "
		       "hit_p50_ns_random=%.0f hit_ratio=%.2f\n",
		       round, n, bits, ins[0], ins[1], ins[0] / ins[1], miss[0], miss[1],
		       miss[0] / miss[1], hit[0], hit[1], hit[0] / hit[1]);
		fflush(stdout);
	}
	free(crafted);
	free(random);
	free(t_miss);
	free(t_hit);
	return 0;
}
