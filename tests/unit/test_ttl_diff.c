/* Differential test: shards/ttl (runs) against tests/ref/ttl_ref.c (the per-block store it
 * replaced, the oracle), on chained hashes as the router produces them: a tree of blocks grown
 * from a 3-token alphabet (most steps take token 0, so prompts share long prefixes and branch),
 * records of whole prompts from the root (acquire) and of any stretch of one at its own
 * position (materialize: outputs, retries that materialize the same blocks in other pieces,
 * blocks that outlive their parent), expiry, a clock that mostly advances and sometimes steps
 * back.  After every command: return code, stored ranges (exact), evicted hashes (as a set;
 * the oracle's order is per block, ours per run, and the index removes them in any order),
 * every evicted run a chain (parent first), count, next expiry, overlap of several prompts, and
 * expiry and position of the prompt's blocks (of every block every 64 steps).
 * And every invariant of the store (kvr_ttl_check: each held block found in the map, exact
 * counts, the map's migration state), half the seeds with the map's migration slowed down.
 * The seed and step are printed on failure; rerun one seed with TTL_DIFF_SEED=<seed>, a range
 * of seeds at 5000 steps with TTL_DIFF_SEEDS=<first>-<last>. */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "../ref/ttl_ref.h"
#include "shards/ttl.h"
#include "tests/common/splitmix.h"

#define MAXN   4096
#define MAXLEN 48
#define HSLOTS 16384

struct node {
	uint64_t seq;
	int parent, depth;
	int child[3];
};

struct tree {
	struct node n[MAXN];
	int nn;
	uint64_t hkey[HSLOTS]; /* seq -> node, open addressing (0 = empty) */
	int hval[HSLOTS];
};

static int node_of(const struct tree *t, uint64_t seq)
{
	for (size_t h = seq % HSLOTS;; h = (h + 1) % HSLOTS) {
		if (t->hkey[h] == seq)
			return t->hval[h];
		if (t->hkey[h] == 0)
			return -1;
	}
}

/* The child of node p by token tok, grown if the tree has room; -1 if not. */
static int child(struct tree *t, int p, int tok)
{
	if (t->n[p].child[tok] >= 0)
		return t->n[p].child[tok];
	if (t->nn == MAXN)
		return -1;
	uint64_t s = t->n[p].seq * 31 + (uint64_t)tok + 7;
	uint64_t seq = splitmix64(&s) | 1; /* never 0 */
	int i = t->nn++;
	t->n[i] = (struct node){seq, p, t->n[p].depth + 1, {-1, -1, -1}};
	t->n[p].child[tok] = i;
	size_t h = seq % HSLOTS;
	while (t->hkey[h])
		h = (h + 1) % HSLOTS;
	t->hkey[h] = seq;
	t->hval[h] = i;
	return i;
}

/* A prompt from the root: up to MAXLEN blocks. */
static size_t prompt(struct tree *t, uint64_t *r, uint64_t *seq)
{
	size_t len = splitmix64(r) % MAXLEN, n = 0;
	int p = 0;
	while (n < len) {
		uint64_t d = splitmix64(r) % 10;
		int c = child(t, p, d < 7 ? 0 : d < 9 ? 1 : 2);
		if (c < 0)
			break;
		seq[n++] = t->n[c].seq;
		p = c;
	}
	return n;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

#define CHECK(cond, ...) cr_assert(cond, "seed %llu step %d: " __VA_ARGS__)

static void check_block(struct kvr_ttl *t, struct ref_ttl *ref, uint64_t seq, uint64_t seed,
                        int step)
{
	uint64_t x1 = 0, x2 = 0;
	uint32_t p1 = 0, p2 = 0;
	int r1 = kvr_ttl_lookup(t, seq, &x1, &p1), r2 = ref_ttl_lookup(ref, seq, &x2, &p2);
	CHECK(r1 == r2 && x1 == x2 && p1 == p2, "lookup %llx: %d %llu %u vs ref %d %llu %u",
	      (unsigned long long)seed, step, (unsigned long long)seq, r1, (unsigned long long)x1,
	      p1, r2, (unsigned long long)x2, p2);
}

/* Steps that ended with the map mid-migration (shards/ttl_map.c), over all seeds. */
static uint64_t steps_growing;

static void run_seed(struct tree *tr, uint64_t seed, int steps)
{
	/* every other seed: a migration slice of 1 unit per call, so tables stay mid-migration
	 * through many commands */
	kvr_ttl_mig_per_call = seed % 2 ? 64 : 1;
	/* every fourth seed: no burials, so stale entries fill the map and it purges them by
	 * migrating (at the same size where the held blocks fill at most half of it) */
	kvr_ttl_bury_on = seed % 4 != 3;
	memset(tr, 0, sizeof(*tr));
	tr->n[0] = (struct node){0, -1, 0, {-1, -1, -1}};
	tr->nn = 1;
	uint64_t r = seed, ttl = 1 + splitmix64(&r) % 500,
	         bucket = splitmix64(&r) % 3 ? splitmix64(&r) % 100 : 0;
	struct kvr_ttl *t;
	struct ref_ttl *ref;
	struct kvr_lru_out o1, o2;
	kvr_lru_out_init(&o1);
	kvr_lru_out_init(&o2);
	cr_assert_eq(kvr_ttl_create(ttl, bucket, &t), 0);
	cr_assert_eq(ref_ttl_create(ttl, bucket, &ref), 0);
	uint64_t now = 1000, seq[MAXLEN], q[MAXLEN];
	struct kvr_lru_block b[MAXLEN];
	size_t n = 0;
	for (int step = 0; step < steps; step++) {
		uint64_t op = splitmix64(&r) % 20;
		if (op < 12) {
			n = prompt(tr, &r, seq);
			size_t s = 0, e = n;
			if (op >= 7 && n > 0) { /* a stretch at its own position */
				s = splitmix64(&r) % n;
				e = s + 1 + splitmix64(&r) % (n - s);
			}
			for (size_t i = s; i < e; i++)
				b[i - s] =
				    (struct kvr_lru_block){.local = seq[i] ^ 5, .seq = seq[i]};
			int r1 = kvr_ttl_record(t, b, e - s, (uint32_t)s, now, &o1);
			int r2 = ref_ttl_record(ref, b, e - s, (uint32_t)s, now, &o2);
			CHECK(r1 == 0 && r2 == 0, "record rc %d vs ref %d",
			      (unsigned long long)seed, step, r1, r2);
			CHECK(o1.n_stored == o2.n_stored && o1.n_stored_runs == o2.n_stored_runs,
			      "stored %zu in %zu runs vs ref %zu in %zu", (unsigned long long)seed,
			      step, o1.n_stored, o1.n_stored_runs, o2.n_stored, o2.n_stored_runs);
			for (size_t i = 0; i < o1.n_stored_runs; i++)
				CHECK(o1.stored[i].first == o2.stored[i].first &&
				          o1.stored[i].n == o2.stored[i].n,
				      "stored run %zu", (unsigned long long)seed, step, i);
		} else if (op < 16) {
			int r1 = kvr_ttl_expire(t, now, &o1), r2 = ref_ttl_expire(ref, now, &o2);
			CHECK(r1 == 0 && r2 == 0, "expire rc %d vs ref %d",
			      (unsigned long long)seed, step, r1, r2);
			CHECK(o1.n_evicted == o2.n_evicted, "evicted %zu vs ref %zu",
			      (unsigned long long)seed, step, o1.n_evicted, o2.n_evicted);
			size_t base = 0;
			for (size_t k = 0; k < o1.n_evicted_runs; k++) {
				for (size_t j = 1; j < o1.evicted_run_len[k]; j++) {
					int c = node_of(tr, o1.evicted_seq[base + j]);
					int p = node_of(tr, o1.evicted_seq[base + j - 1]);
					CHECK(c >= 0 && tr->n[c].parent == p,
					      "evicted run %zu not a chain",
					      (unsigned long long)seed, step, k);
				}
				base += o1.evicted_run_len[k];
			}
			CHECK(base == o1.n_evicted, "run lengths", (unsigned long long)seed, step);
			if (o1.n_evicted) { /* nothing evicted: the arrays may be NULL */
				qsort(o1.evicted_seq, o1.n_evicted, sizeof(uint64_t), cmp_u64);
				qsort(o2.evicted_seq, o2.n_evicted, sizeof(uint64_t), cmp_u64);
				CHECK(!memcmp(o1.evicted_seq, o2.evicted_seq,
				              o1.n_evicted * sizeof(uint64_t)),
				      "evicted sets differ", (unsigned long long)seed, step);
			}
		} else if (splitmix64(&r) % 20 == 0 && now > 200) {
			now -= splitmix64(&r) % 200;
		} else {
			now += splitmix64(&r) % 150;
		}
		CHECK(kvr_ttl_count(t) == ref_ttl_count(ref), "count %zu vs ref %zu",
		      (unsigned long long)seed, step, kvr_ttl_count(t), ref_ttl_count(ref));
		CHECK(kvr_ttl_next_expiry(t) == ref_ttl_next_expiry(ref), "next expiry",
		      (unsigned long long)seed, step);
		for (int j = 0; j < 3; j++) {
			size_t m = j == 0 ? n : prompt(tr, &r, q);
			const uint64_t *p = j == 0 ? seq : q;
			for (size_t cut = m; cut + 1 > 0; cut = cut / 2 ? cut / 2 : (size_t)-1) {
				size_t a = kvr_ttl_overlap(t, p, cut),
				       c = ref_ttl_overlap(ref, p, cut);
				CHECK(a == c, "overlap(%zu) %zu vs ref %zu",
				      (unsigned long long)seed, step, cut, a, c);
				if (cut == 0)
					break;
			}
		}
		int bad = kvr_ttl_check(t);
		CHECK(bad == 0, "invariant at shards/ttl.c:%d", (unsigned long long)seed, step,
		      bad);
		struct kvr_ttl_stats st;
		kvr_ttl_stats(t, &st);
		steps_growing += st.growing;
		for (size_t i = 0; i < n; i++)
			check_block(t, ref, seq[i], seed, step);
		if (step % 64 == 63)
			for (int i = 1; i < tr->nn; i++)
				check_block(t, ref, tr->n[i].seq, seed, step);
	}
	kvr_ttl_destroy(t);
	ref_ttl_destroy(ref);
	kvr_lru_out_fini(&o1);
	kvr_lru_out_fini(&o2);
}

Test(ttl_diff, runs_against_ref)
{
	struct tree *tr = malloc(sizeof(*tr));
	cr_assert_not_null(tr);
	const char *env = getenv("TTL_DIFF_SEED"), *range = getenv("TTL_DIFF_SEEDS");
	unsigned long long lo, hi;
	if (env) {
		run_seed(tr, strtoull(env, NULL, 0), 5000);
	} else if (range && sscanf(range, "%llu-%llu", &lo, &hi) == 2) {
		for (uint64_t seed = lo; seed <= hi; seed++) /* long runs: TTL_DIFF_SEEDS=1-2000 */
			run_seed(tr, seed, 5000);
	} else {
		for (uint64_t seed = 1; seed <= 300; seed++)
			run_seed(tr, seed, 400);
		cr_expect(steps_growing > 0, "no command ended with the map mid-migration");
	}
	kvr_ttl_mig_per_call = 64;
	kvr_ttl_bury_on = true;
	free(tr);
}
