/*
 * bench_index_runs - the run-compressed index (core/index) on the workloads of issue 10.
 *
 * Prompts of L = 32, 512, 8192 blocks (16 random tokens each, hashed by kvr_hash_blocks; ext
 * hash = the sequence hash, as the approximate modes store), P such prompts per index so the
 * tables are not all in L1, 64 ranks, three holder patterns per prompt:
 *   a  one rank holds the whole path;
 *   b  the 64 ranks each hold a random depth of the path (one store each);
 *   c  b, then every rank removes 2 % of its blocks at random interior positions (holes);
 *   d  sessions (bench_route's shape, deterministic): prompt i > 0 keeps a 50-100 % prefix of
 *      a random earlier prompt and has fresh tokens after it, and rank i % 64 stores it whole,
 *      so every rank holding a prompt holds the hot prefix (the first half of prompt 0) and a
 *      query walks several runs with many holders (--cg 128 d is a 2k-token route's lookup).
 *   e  turns (the coding-agent session traces' shape, tools/replay): rank i % 64 stores
 *      prompt i turn by turn, T turns (4 at L = 32, 16 at 512, 64 at 8192), each turn's prompt
 *      extending the last and followed by its reply (8 fresh blocks below the prompt's end, as
 *      the replay stores output blocks); so a query of the whole prompt crosses T runs, each
 *      going on past the point where the query leaves it (the reply).  On the 24 session
 *      traces a path crossed 42 runs on average (kvr-replay, ~8,700 blocks).
 *   f  d with each prompt stored by 4 ranks (i, i + 16, i + 32, i + 48 mod 64), as a router
 *      spreads a hot conversation: a query's later runs have several holders each (at L = 128,
 *      ~60 later-run holder words a query, as bench_route's 2k prompts; d has ~15).  Only the
 *      single-pattern modes (--cg, --tput, --tail, --depths-ab) take it.
 * For each (L, pattern), in one run:
 *   match_p50/p90/p99/p999_ns  find_matches on a random one of the P prompts (inside a read
 *                     section), the prompt's hashes read just before, after one warm-up query
 *                     per prompt (match_lat says why);
 *   first_p50/p99_ns  those warm-up queries: each prompt's first query after the build;
 *   hash_p50_ns       kvr_hash_blocks on the same prompt (tokens -> local + sequence hashes);
 *   ratio             match_p99 / hash_p50 (issue 10 target: <= 0.25 for L >= 512);
 *   bytes_per_held_block  (index bytes - empty index bytes) / held (block, rank) pairs, every
 *                         allocation at the allocator's real size (jemalloc's size class:
 *                         kvr_index_memory_bytes counts nallocx(size), not the size asked);
 *   runs_per_path     runs a prompt's walk crosses (kvr_index_path_runs), mean over the P.
 * Memory by shape: runs of 16 / 512 blocks with 1, 2, 4 holders, and the worst case (every run
 * one block long, one holder); with the locator, without it, and then (ext=rank) with the
 * locator and engine hashes: each rank names a block by a mix of its sequence hash and the rank
 * (vLLM's per-process random seed makes the engine's hash differ from the router's, and between
 * ranks), so the index keeps its per-rank ext maps (events mode); the '# where:' line then adds
 * ext_maps.  --ext-hashes: --mem-only prints those lines only, --apply-only stores and removes
 * by engine hashes (ext=rank in the SUMMARY).
 * Apply: one writer stores 1024-block chains in calls of 16 (or 1) blocks below the previous
 * call's last block and removes them again tail first in chain order; block ops per second.
 * Reader under a writer: 1 reader (L = 512, pattern b) alone, then with 1 writer flat out
 * (removes and re-stores the tails of random ranks' paths in the same index); p99 ratio.
 * Timings are wall clock on a shared machine: compare the ratios, which come from one run.
 *
 * Churn (issues 10, 14: the tombstone locator's purges were O(table) stalls): 8 ranks of 65,536
 * blocks each hold 128 prompts of 512 random blocks; each admission evicts a rank's oldest
 * prompt (one remove call) and stores a new one (one store call).  Per-call time max / p99.9 /
 * p99 and block ops per second, with the locator's rebuilds done at once in one call
 * (kvr_index_blk_step_min huge: the old rebuild) and incrementally (the default), in one run,
 * and incrementally with the previous defaults (growth at load 0.85 to 0.57, least slice 2), with
 * the locator's bytes per held block averaged over the admissions, its rebuilds during the
 * admissions (0 at this steady live count) and the wrong runs a lookup scans.  Before them, a
 * '# fill' line: the fill's store calls (the locator grows from empty, ~40 migrations), their
 * CPU time max / p99 / p50 and the locator's bytes per entry averaged over them (both arrays
 * while migrating).
 *
 * Memory sweep (--mem-sweep): runs of 16 blocks with one holder at 97 index sizes, so the
 * locator's load over its growth cycle shows (mean, min, max), with the default growth policy
 * and the previous defaults, in one run.
 *
 * --no-locator: every index without the block locator (kvr_index_set_locator: the approximate
 * modes' index); --mem-only prints both.  Options count wherever they stand (every option is
 * read before the one mode runs); an unknown option or a bad value is an error, exit 2.
 * usage: bench_index_runs [--ms N] [--quick] [--no-locator] [--ext-hashes]
 *          [--apply-only [--per N] | --rw-only | --cg L PAT
 *          | --tail L PAT [--touch] (what the slow 1 % of the match calls are)
 *          | --tput L PAT (find_matches, find_depths, and find_depths cold and warm) | --mem-only
 *          | --depths-ab L PAT [N] (find_depths' AVX2 and base loops, alternated in one process)
 *          | --mem-sweep | --scan-cost
 *          | --churn [N admissions per mode, default 4000] [--churn-mode once|incr|old]]
 */
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/hash.h"
#include "core/index.h"
#include "core/index_internal.h"
#include "core/index_match.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "sync/rcu.h"
#include "tests/common/xorshift.h"

enum { RANKS = 64, BS = 16 };

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
	return xorshift64(&rng);
}

static uint64_t pctl(uint64_t *v, size_t n, int per_mille)
{
	qsort(v, n, sizeof(*v), cmp_u64);
	return n ? v[n * (size_t)per_mille / 1000] : 0;
}

struct path {
	size_t L;
	uint32_t *tok;
	uint64_t *local, *seq;
	struct kvr_index_block *b;
	size_t depth[RANKS]; /* per rank, patterns b and c */
};

static void make_path(struct path *p, size_t L)
{
	p->L = L;
	p->tok = malloc(L * BS * sizeof(uint32_t));
	p->local = malloc(L * sizeof(uint64_t));
	p->seq = malloc(L * sizeof(uint64_t));
	p->b = malloc(L * sizeof(*p->b));
	for (size_t i = 0; i < L * BS; i++)
		p->tok[i] = (uint32_t)(rnd() % 128000);
	kvr_hash_blocks(p->tok, L * BS, BS, NULL, p->local, p->seq);
	for (size_t i = 0; i < L; i++)
		p->b[i] =
		    (struct kvr_index_block){.ext_hash = p->seq[i], .local_hash = p->local[i]};
}

static void free_path(struct path *p)
{
	free(p->tok);
	free(p->local);
	free(p->seq);
	free(p->b);
}

enum { TURN_REPLY = 8 };

static size_t turns_for(size_t L)
{
	return L >= 8192 ? 64 : L >= 512 ? 16 : 4;
}

/* Pattern e for one path: turn t stores the prompt's first L * t / T blocks (what an earlier
 * turn stored is held already), then its reply below the last of them. */
static void apply_turns(struct kvr_index *idx, uint32_t slot, const struct path *p)
{
	const size_t T = turns_for(p->L);
	for (size_t t = 1; t <= T; t++) {
		const size_t end = p->L * t / T;
		if (kvr_index_store(idx, slot, NULL, p->b, end) != 0)
			abort();
		uint64_t local[TURN_REPLY], seq[TURN_REPLY];
		struct kvr_index_block rb[TURN_REPLY];
		for (int j = 0; j < TURN_REPLY; j++)
			local[j] = rnd();
		kvr_hash_chain_locals(&p->seq[end - 1], local, TURN_REPLY, seq);
		for (int j = 0; j < TURN_REPLY; j++)
			rb[j] =
			    (struct kvr_index_block){.ext_hash = seq[j], .local_hash = local[j]};
		if (kvr_index_store(idx, slot, &p->seq[end - 1], rb, TURN_REPLY) != 0)
			abort();
	}
}

/* Applies pattern (0 = a, 1 = b, 2 = c, 3 = d: path i of make_sessions, 4 = e) for one path;
 * returns the (block, rank) pairs held. */
static uint64_t apply_pattern(struct kvr_index *idx, const uint32_t *slot, struct path *p, int pat,
                              int i)
{
	if (pat == 4) { /* held pairs: counted by the caller (the replies) */
		apply_turns(idx, slot[i % RANKS], p);
		return 0;
	}
	if (pat == 3 || pat == 5) { /* held pairs: counted by the caller (prompts overlap) */
		for (int c = 0; c < (pat == 5 ? 4 : 1); c++)
			if (kvr_index_store(idx, slot[(i + c * RANKS / 4) % RANKS], NULL, p->b,
			                    p->L) != 0)
				abort();
		return 0;
	}
	if (pat == 0) {
		if (kvr_index_store(idx, slot[0], NULL, p->b, p->L) != 0)
			abort();
		return p->L;
	}
	uint64_t held = 0;
	for (int r = 0; r < RANKS; r++) {
		size_t d = 1 + rnd() % p->L;
		p->depth[r] = d;
		if (kvr_index_store(idx, slot[r], NULL, p->b, d) != 0)
			abort();
		held += d;
	}
	if (pat == 2) {
		for (int r = 0; r < RANKS; r++) {
			size_t d = p->depth[r], k = d * 2 / 100;
			for (size_t j = 0; j < k && d > 2; j++) {
				uint64_t e = p->b[1 + rnd() % (d - 2)].ext_hash;
				size_t nf = 0;
				kvr_index_remove(idx, slot[r], &e, 1, &nf);
				held -= 1 - nf;
			}
		}
	}
	return held;
}

/* Pattern d's paths: prompt i > 0 keeps a 50-100 % prefix (in blocks) of a random earlier
 * prompt, then fresh tokens; rehashed in place. */
static void make_sessions(struct path *ps, int np)
{
	for (int i = 1; i < np; i++) {
		struct path *p = &ps[i];
		const struct path *o = &ps[rnd() % (uint64_t)i];
		size_t keep = p->L / 2 + rnd() % (p->L - p->L / 2 + 1);
		memcpy(p->tok, o->tok, keep * BS * sizeof(uint32_t));
		kvr_hash_blocks(p->tok, p->L * BS, BS, NULL, p->local, p->seq);
		for (size_t j = 0; j < p->L; j++)
			p->b[j] = (struct kvr_index_block){.ext_hash = p->seq[j],
			                                   .local_hash = p->local[j]};
	}
}

/* Prompts per index: enough that the tables are not all in L1; pattern d gives every rank
 * prompts. */
static int prompts_for(size_t L, int pat)
{
	if (pat >= 3)
		return L <= 512 ? 128 : 64;
	return L <= 32 ? 1024 : L <= 512 ? 64 : 8;
}

/* (block, rank) pairs held: the ranks' tree sizes. */
static uint64_t held_pairs(const struct kvr_index *idx, const uint32_t *slot)
{
	uint64_t h = 0;
	for (int r = 0; r < RANKS; r++)
		h += kvr_index_tree_size(idx, slot[r]);
	return h;
}

/* np prompts of L blocks for pattern pat (0 = a .. 3 = d). */
static struct path *make_prompts(size_t L, int pat, int np)
{
	struct path *ps = calloc((size_t)np, sizeof(*ps));
	for (int i = 0; i < np; i++)
		make_path(&ps[i], L);
	if (pat == 3 || pat == 5)
		make_sessions(ps, np);
	return ps;
}

static uint64_t hash_p50(const struct path *p, int reps)
{
	uint64_t *lat = malloc((size_t)reps * sizeof(uint64_t));
	uint64_t *l = malloc(p->L * sizeof(uint64_t)), *s = malloc(p->L * sizeof(uint64_t));
	for (int i = 0; i < reps; i++) {
		uint64_t t0 = now_ns();
		kvr_hash_blocks(p->tok, p->L * BS, BS, NULL, l, s);
		lat[i] = now_ns() - t0;
	}
	uint64_t r = pctl(lat, (size_t)reps, 500);
	free(lat);
	free(l);
	free(s);
	return r;
}

/* match_lat's percentiles (ns): of the timed calls, and of the untimed warm-up's first query of
 * each prompt, timed apart. */
struct match_pct {
	uint64_t p50, p90, p99, p999, first_p50, first_p99;
};

/* Reads a prompt's hashes, as kvr_route has just done when it calls the index (it hashed the
 * prompt into them). */
static uint64_t touch_hashes(const struct path *p)
{
	uint64_t s = 0;
	for (size_t j = 0; j < p->L; j++)
		s += __atomic_load_n(&p->seq[j], __ATOMIC_RELAXED);
	return s;
}

/* One find_matches call on p inside a read section, its prompt's hashes read just before (see
 * match_lat); returns its wall time. */
static uint64_t match_once(const struct kvr_index *idx, const struct path *p, uint64_t *sink)
{
	struct kvr_index_match out[RANKS];
	size_t n = 0;
	*sink += touch_hashes(p);
	uint64_t t0 = now_ns();
	kvr_rcu_read_lock();
	kvr_index_find_matches(idx, p->seq, p->L, NULL, out, RANKS, &n);
	kvr_rcu_read_unlock();
	return now_ns() - t0;
}

/*
 * find_matches on reps random prompts of ps[0..np).  Two things this loop did not do before
 * (--tail L PAT shows both; branch matchtail):
 *  - each call is preceded by a read of its prompt's hashes.  kvr_route calls the index right
 *    after it hashed the prompt into them; here they were last written by make_path, before
 *    the index was built, so a prompt's first query also paid their misses (L = 512, pattern a:
 *    first queries p50 411 -> 60 ns with the read; the index's own lines are not touched).
 *  - every prompt is queried once, untimed in the percentiles, before the timed calls.  The first
 *    query of a prompt after the build walks lines the build left in L3 or memory (p50 300-400
 *    ns at L = 512 patterns b, d, e, 3-4x a later query's); with np of 64-128 prompts for 5,000
 *    calls those first queries were 1.3-2.6 % of the samples, more than the 1 % above the p99, so
 *    the p99 WAS the first-touch latency (47-49 of the 49 calls above it, --tail), and it was
 *    the steady p99 wherever np / reps < 1 % (L = 8,192: 8 prompts, 1,000 calls).  What the p99
 *    measured depended on np / reps, not on find_matches.  The first queries are timed apart
 *    (first_p50 / first_p99: one sample per prompt), so the cold walk stays in the SUMMARY.
 */
static void match_lat(struct kvr_index *idx, struct path *ps, int np, int reps, struct match_pct *r)
{
	uint64_t *lat = malloc((size_t)reps * sizeof(uint64_t));
	uint64_t *first = malloc((size_t)np * sizeof(uint64_t)), sink = 0;
	for (int i = 0; i < np; i++)
		first[i] = match_once(idx, &ps[i], &sink);
	for (int i = 0; i < reps; i++)
		lat[i] = match_once(idx, &ps[rnd() % (uint64_t)np], &sink);
	r->p50 = pctl(lat, (size_t)reps, 500);
	r->p90 = pctl(lat, (size_t)reps, 900);
	r->p99 = pctl(lat, (size_t)reps, 990);
	r->p999 = pctl(lat, (size_t)reps, 999);
	r->first_p50 = pctl(first, (size_t)np, 500);
	r->first_p99 = pctl(first, (size_t)np, 990);
	if (sink == 1)
		printf("#\n"); /* keeps the reads */
	free(lat);
	free(first);
}

static bool no_locator; /* --no-locator: indexes without the block locator */
static bool ext_hashes; /* --ext-hashes: every rank names blocks by an engine hash of its own */

/* An engine's block hash for seq on the rank in slot: vLLM hashes a block with a per-process
 * random seed (NONE_HASH), so its name differs from the router's sequence hash and between
 * ranks; a mix of seq and the slot models that (the index stores ext != seq: events mode). */
static uint64_t ext_of(uint64_t seq, uint32_t slot)
{
	uint64_t x = seq ^ (0x9e3779b97f4a7c15ull * (slot + 1));
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* b[0..n) as the rank in slot names them: ext_of() of each sequence hash (written to out). */
static void ext_blocks(const struct kvr_index_block *b, const uint64_t *seq, size_t n,
                       uint32_t slot, struct kvr_index_block *out)
{
	for (size_t i = 0; i < n; i++)
		out[i] = (struct kvr_index_block){.ext_hash = ext_of(seq[i], slot),
		                                  .local_hash = b[i].local_hash};
}

/* Bytes of the ranks' ext maps (events mode: ext != seq), at the allocator's real sizes. */
static uint64_t ext_map_bytes(const struct kvr_index *idx, const uint32_t *slot)
{
	uint64_t b = 0;
	for (uint32_t r = 0; r < RANKS; r++) {
		const struct idx_rank *rk = &idx->rank[slot[r]];
		if (rk->xmap.e)
			b += kvr_alloc_real_size(rk->xmap.cap * sizeof(struct idx_xent));
		if (rk->amap.e)
			b += kvr_alloc_real_size(rk->amap.cap * sizeof(struct idx_xent));
	}
	return b;
}

static struct kvr_index *new_index(uint32_t *slot)
{
	struct kvr_index *idx;
	if (kvr_index_create(RANKS, &idx) != 0 || kvr_index_set_locator(idx, !no_locator) != 0)
		abort();
	for (uint32_t r = 0; r < RANKS; r++)
		if (kvr_index_rank_add(idx, r, 0, &slot[r]) != 0)
			abort();
	return idx;
}

/* An index of the (L, pattern) workload for the single-pattern modes (--tail, --cg, --tput):
 * its prompts in *ps (*np of them), quiesced. */
static struct kvr_index *pattern_index(size_t L, int pat, int *np, struct path **ps)
{
	uint32_t slot[RANKS];
	*np = prompts_for(L, pat);
	*ps = make_prompts(L, pat, *np);
	struct kvr_index *idx = new_index(slot);
	for (int i = 0; i < *np; i++)
		apply_pattern(idx, slot, &(*ps)[i], pat, i);
	kvr_index_quiesce(idx);
	return idx;
}

static void free_prompts(struct path *ps, int np)
{
	for (int i = 0; i < np; i++)
		free_path(&ps[i]);
	free(ps);
}

/* --tail L PAT [--touch]: what the slow 1 % of the timed calls are.  match_lat's loop as it was
 * before its warm-up (two passes of reps queries, no warm-up; --touch: each prompt's hashes read
 * before its call, as match_lat does now), each sample tagged with whether it was its prompt's
 * first query; percentiles of the first pass (what match_lat timed), of the second pass, of
 * first and later queries apart, and of an empty read section timed the same way (the clock's
 * overhead and steps, and the VM's interruptions). */
static void tail_print(const char *what, uint64_t *v, size_t n)
{
	if (!n) {
		printf("  %-26s n=0\n", what);
		return;
	}
	qsort(v, n, sizeof(*v), cmp_u64);
	printf("  %-26s n=%-6zu p50=%-5lu p90=%-5lu p95=%-5lu p99=%-5lu p99.9=%-6lu max=%lu\n",
	       what, n, (unsigned long)v[n / 2], (unsigned long)v[n * 90 / 100],
	       (unsigned long)v[n * 95 / 100], (unsigned long)v[n * 99 / 100],
	       (unsigned long)v[n * 999 / 1000], (unsigned long)v[n - 1]);
}

/* Evicts from every cache the lines find_matches reads of p's path (each run's table home slot,
 * header, hashes and holder set), keeping their TLB entries (clflush translates the address):
 * the walk's misses with no page walk, to weigh against a first query's.  Returns the runs. */
static size_t flush_path(const struct kvr_index *idx, const struct path *p)
{
	size_t runs = 0;
#if defined(__x86_64__)
	const struct idx_run *R = idx_find_run(idx, p->seq[0], NULL, 0);
	size_t q = 0;
	while (R) {
		const uint64_t seq0 = R->first;
		const uintptr_t v = idx->view[seq0 >> (64 - IDX_SEGS_BITS)];
		const uint64_t *t = (const uint64_t *)(v & ~(uintptr_t)63);
		__builtin_ia32_clflush(&t[idx_tab_home(seq0, idx_tab_cap(v & 63))]);
		const uint64_t sl = R->sl, hv = R->hs;
		const uint64_t *sq = (const uint64_t *)(uintptr_t)idx_lo_ptr(sl);
		const size_t len = (size_t)idx_hi(sl), m = len < p->L - q ? len : p->L - q;
		size_t k = 1;
		while (k < m && sq[k] == p->seq[q + k])
			k++;
		for (size_t j = 0; sq != &R->first && j < len; j += 8)
			__builtin_ia32_clflush(&sq[j]);
		if (hv & IDX_HS_SET) {
			const struct idx_hset *hs =
			    (const struct idx_hset *)(uintptr_t)idx_lo_ptr(hv);
			const char *e = (const char *)&hs->e[hs->n];
			for (const char *c = (const char *)hs; c < e + 63; c += 64)
				__builtin_ia32_clflush(c);
		}
		const struct idx_run *C =
		    q + k < p->L ? idx_find_child(idx, p->seq[q + k], R, (uint32_t)k) : NULL;
		__builtin_ia32_clflush(R);
		__builtin_ia32_clflush((const char *)R + sizeof(*R) - 1);
		runs++;
		q += k;
		R = C;
	}
	__builtin_ia32_mfence();
#else
	(void)idx;
	(void)p;
#endif
	return runs;
}

static void tail_mode(size_t L, int pat, int reps, bool touch)
{
	int np;
	struct path *ps;
	struct kvr_index *idx = pattern_index(L, pat, &np, &ps);
	const uint64_t h50 = hash_p50(&ps[0], reps);
	uint64_t *all = malloc(2 * (size_t)reps * sizeof(uint64_t));
	uint64_t *first = malloc((size_t)np * sizeof(uint64_t));
	uint64_t *later = malloc(2 * (size_t)reps * sizeof(uint64_t));
	uint64_t *p2 = malloc((size_t)reps * sizeof(uint64_t));
	uint64_t *empty = malloc((size_t)reps * sizeof(uint64_t));
	uint64_t *flushed = malloc((size_t)reps * sizeof(uint64_t));
	bool *seen = calloc((size_t)np, sizeof(bool));
	size_t nf = 0, nl = 0, slow_first = 0;
	struct kvr_index_match out[RANKS];
	int *who = malloc(2 * (size_t)reps * sizeof(int));
	uint64_t sink = 0;
	struct rusage ru0, ru1;
	getrusage(RUSAGE_THREAD, &ru0);
	for (int i = 0; i < 2 * reps; i++) {
		const int pi = (int)(rnd() % (uint64_t)np);
		const struct path *p = &ps[pi];
		size_t n = 0;
		if (touch)
			sink += touch_hashes(p);
		uint64_t t0 = now_ns();
		kvr_rcu_read_lock();
		kvr_index_find_matches(idx, p->seq, p->L, NULL, out, RANKS, &n);
		kvr_rcu_read_unlock();
		all[i] = now_ns() - t0;
		who[i] = seen[pi] ? 1 : 0;
		if (!seen[pi])
			first[nf++] = all[i];
		else
			later[nl++] = all[i];
		if (i >= reps)
			p2[i - reps] = all[i];
		seen[pi] = true;
	}
	getrusage(RUSAGE_THREAD, &ru1);
	for (int i = 0; i < reps; i++) {
		uint64_t t0 = now_ns();
		kvr_rcu_read_lock();
		__asm__ volatile("" ::: "memory");
		kvr_rcu_read_unlock();
		empty[i] = now_ns() - t0;
	}
	/* The path's lines flushed before each call (TLB warm): misses without page walks. */
	size_t fruns = 0;
	for (int i = 0; i < reps; i++) {
		const struct path *p = &ps[rnd() % (uint64_t)np];
		size_t n = 0;
		sink += touch_hashes(p);
		fruns += flush_path(idx, p);
		uint64_t t0 = now_ns();
		kvr_rcu_read_lock();
		kvr_index_find_matches(idx, p->seq, p->L, NULL, out, RANKS, &n);
		kvr_rcu_read_unlock();
		flushed[i] = now_ns() - t0;
	}
	/* The slow 1 % of the first pass (what match_lat times): how many were first queries. */
	uint64_t *c = malloc((size_t)reps * sizeof(uint64_t));
	memcpy(c, all, (size_t)reps * sizeof(uint64_t));
	qsort(c, (size_t)reps, sizeof(*c), cmp_u64);
	const uint64_t thr = c[(size_t)reps * 99 / 100];
	size_t slow = 0;
	for (int i = 0; i < reps; i++)
		if (all[i] > thr) {
			slow++;
			slow_first += who[i] == 0;
		}
	printf("tail L=%zu pattern=%c prompts=%d reps=%d%s hash_p50_ns=%lu; pass 1's calls above "
	       "its p99 (%lu ns): %zu, of them first queries of their prompt: %zu\n",
	       L, "abcdef"[pat], np, reps, touch ? " (hashes read first)" : "", (unsigned long)h50,
	       (unsigned long)thr, slow, slow_first);
	printf("  page faults in both passes: %ld minor, %ld major\n",
	       ru1.ru_minflt - ru0.ru_minflt, ru1.ru_majflt - ru0.ru_majflt);
	tail_print("pass 1 (no warm-up)", c, (size_t)reps);
	if (sink == 42)
		printf("!\n");
	tail_print("pass 2", p2, (size_t)reps);
	tail_print("first query of a prompt", first, nf);
	tail_print("later queries", later, nl);
	tail_print("empty timed call", empty, (size_t)reps);
	printf("  (path's lines flushed before each call, hashes read: %.1f runs a path)\n",
	       (double)fruns / reps);
	tail_print("flushed lines, TLB warm", flushed, (size_t)reps);
	fflush(stdout);
	kvr_index_destroy(idx);
	free_prompts(ps, np);
	free(all);
	free(first);
	free(later);
	free(p2);
	free(empty);
	free(flushed);
	free(seen);
	free(who);
	free(c);
}

static void bench_match(bool quick)
{
	static const size_t Ls[] = {32, 512, 8192};
	for (int li = 0; li < 3; li++) {
		size_t L = Ls[li];
		int reps = quick ? 200 : (L == 8192 ? 1000 : 5000);
		for (int pat = 0; pat < 5; pat++) {
			int np = prompts_for(L, pat);
			struct path *ps = make_prompts(L, pat, np);
			uint64_t h50 = hash_p50(&ps[0], reps);
			uint32_t slot[RANKS];
			struct kvr_index *idx = new_index(slot);
			uint64_t mem0 = kvr_index_memory_bytes(idx), held = 0;
			for (int i = 0; i < np; i++)
				held += apply_pattern(idx, slot, &ps[i], pat, i);
			if (pat >= 3)
				held = held_pairs(idx, slot);
			kvr_index_quiesce(idx);
			uint64_t mem1 = kvr_index_memory_bytes(idx);
			struct kvr_index_stats st;
			kvr_index_stats_get(idx, &st);
			uint64_t runs = 0;
			struct match_pct m;
			match_lat(idx, ps, np, reps, &m);
			kvr_rcu_read_lock();
			for (int i = 0; i < np; i++)
				runs += kvr_index_path_runs(idx, ps[i].seq, ps[i].L);
			kvr_rcu_read_unlock();
			printf("SUMMARY bench=index_match L=%zu pattern=%c prompts=%d held=%lu "
			       "blocks=%lu match_p50_ns=%lu match_p90_ns=%lu match_p99_ns=%lu "
			       "match_p999_ns=%lu hash_p50_ns=%lu ratio=%.3f first_p50_ns=%lu "
			       "first_p99_ns=%lu bytes_per_held_block=%.1f runs_per_path=%.1f\n",
			       L, "abcdef"[pat], np, (unsigned long)held, (unsigned long)st.nodes,
			       (unsigned long)m.p50, (unsigned long)m.p90, (unsigned long)m.p99,
			       (unsigned long)m.p999, (unsigned long)h50,
			       h50 ? (double)m.p99 / (double)h50 : 0.0, (unsigned long)m.first_p50,
			       (unsigned long)m.first_p99, (double)(mem1 - mem0) / (double)held,
			       (double)runs / np);
			fflush(stdout);
			kvr_index_destroy(idx);
			free_prompts(ps, np);
		}
	}
}

/* Memory per held (block, rank) by run shape: np distinct paths of `len` blocks (each one run),
 * each stored whole by `holders` ranks. */
static double bench_memory(size_t len, int holders, int np, bool print)
{
	uint32_t slot[RANKS];
	struct kvr_index *idx = new_index(slot);
	uint64_t mem0 = kvr_index_memory_bytes(idx), held = 0;
	struct path p;
	struct kvr_index_block *eb = ext_hashes ? malloc(len * sizeof(*eb)) : NULL;
	for (int i = 0; i < np; i++) {
		make_path(&p, len);
		for (int h = 0; h < holders; h++) {
			const uint32_t s = slot[(i + h) % RANKS];
			if (ext_hashes)
				ext_blocks(p.b, p.seq, len, s, eb);
			if (kvr_index_store(idx, s, NULL, ext_hashes ? eb : p.b, len) != 0)
				abort();
			held += len;
		}
		free_path(&p);
	}
	free(eb);
	kvr_index_quiesce(idx);
	uint64_t mem1 = kvr_index_memory_bytes(idx);
	const double per = (double)(mem1 - mem0) / (double)held;
	if (!print) {
		kvr_index_destroy(idx);
		return per;
	}
	if (ext_hashes)
		printf("SUMMARY bench=index_memory locator=%s ext=rank run_blocks=%zu holders=%d "
		       "held=%lu bytes_per_held_block=%.1f\n",
		       no_locator ? "off" : "on", len, holders, (unsigned long)held, per);
	else
		printf("SUMMARY bench=index_memory locator=%s run_blocks=%zu holders=%d held=%lu "
		       "bytes_per_held_block=%.1f\n",
		       no_locator ? "off" : "on", len, holders, (unsigned long)held, per);
	/* Where the bytes go, per held block: the run table, the block locator (and the array
	 * a migration has not finished leaving), its id directory, the ranks' end maps (without
	 * the locator), and the rest (runs, their hashes, holder records and sets). */
	uint64_t tab = 0, ends = 0, nends = 0;
	for (uint32_t r = 0; r < RANKS; r++) {
		const struct idx_tmap *m = &idx->rank[slot[r]].tops;
		ends += m->e ? kvr_alloc_real_size((size_t)m->cap * 8) : 0;
		nends += m->count;
	}
	for (uint32_t i = 0; i < IDX_SEGS; i++)
		if (idx->seg[i].tab)
			tab += kvr_alloc_real_size_aligned(idx_bytes_tab(idx->seg[i].cap)) +
			       kvr_alloc_real_size(sizeof(struct idx_tret));
	const struct idx_blocks *b = &idx->blk;
	const uint64_t loc = kvr_alloc_real_size(idx_blk_bytes(b->cap)),
	               old = kvr_alloc_real_size(idx_blk_bytes(b->old_cap)),
	               dir = kvr_alloc_real_size((size_t)b->dir_cap * 8);
	const double h = (double)held;
	const uint64_t xm = ext_map_bytes(idx, slot);
	printf("# where: run_table=%.2f locator=%.2f (load %.2f) locator_old=%.2f locator_dir=%.2f "
	       "end_maps=%.2f (%lu entries) runs_hashes_holders=%.2f",
	       (double)tab / h, (double)loc / h, b->cap ? (double)b->count / (double)b->cap : 0.0,
	       (double)old / h, (double)dir / h, (double)ends / h, (unsigned long)nends,
	       (double)(mem1 - mem0 - tab - loc - old - dir - ends - xm) / h);
	if (ext_hashes) /* the plain lines stay as they were (ext maps empty there) */
		printf(" ext_maps=%.2f", (double)xm / h);
	printf("\n");
	fflush(stdout);
	kvr_index_destroy(idx);
	return per;
}

/* The memory lines: runs of 16 and 512 blocks with 1, 2, 4 holders, and the worst case, with
 * the block locator and without (kvr_index_set_locator: the approximate modes' index). */
static void mem_shapes(void)
{
	static const size_t lens[] = {16, 512};
	for (int li = 0; li < 2; li++)
		for (int h = 1; h <= 4; h *= 2)
			bench_memory(lens[li], h, lens[li] == 16 ? 8192 : 256, true);
	bench_memory(1, 1, 65536, true); /* worst case: every run one block long */
}

/* Then the same shapes in events mode (the locator on) with engine hashes (ext=rank): what a
 * router fed by vLLM pays, the ext maps included; and last those without the locator (what
 * events mode would pay without it: --scan-cost gives the price).  only_ext (--ext-hashes):
 * the ext=rank lines only. */
static void mem_all(bool only_ext)
{
	const bool nl = no_locator, eh = ext_hashes;
	for (int mode = only_ext ? 2 : 0; mode < 4; mode++) {
		no_locator = mode == 1 || mode == 3;
		ext_hashes = mode >= 2;
		mem_shapes();
	}
	no_locator = nl;
	ext_hashes = eh;
}

/* Runs of 16 blocks, one holder, at 97 index sizes from 4,096 to 16,384 runs (1.0145x apart):
 * where one size lands in the locator's growth cycle decides its load, so the sweep gives the
 * range and the mean over the cycle, with the locator growing at grow_at to grow_to. */
static void mem_sweep(uint64_t grow_at, uint64_t grow_to, uint64_t step_min)
{
	const uint64_t ga = kvr_index_blk_grow_at, gt = kvr_index_blk_grow_to,
	               sm = kvr_index_blk_step_min;
	kvr_index_blk_grow_at = grow_at;
	kvr_index_blk_grow_to = grow_to;
	kvr_index_blk_step_min = step_min;
	double lo = 1e9, hi = 0, sum = 0;
	int n = 0;
	for (double np = 4096; np <= 16384; np *= 1.0145, n++) {
		double v = bench_memory(16, 1, (int)np, false);
		lo = v < lo ? v : lo;
		hi = v > hi ? v : hi;
		sum += v;
	}
	printf("SUMMARY bench=index_memory_sweep run_blocks=16 holders=1 runs=4096..16384 sizes=%d "
	       "grow_at=%.2f grow_to=%.2f step_min=%lu bytes_per_held_block_mean=%.2f min=%.2f "
	       "max=%.2f\n",
	       n, (double)grow_at / 1000, (double)grow_to / 1000, (unsigned long)step_min, sum / n,
	       lo, hi);
	fflush(stdout);
	kvr_index_blk_grow_at = ga;
	kvr_index_blk_grow_to = gt;
	kvr_index_blk_step_min = sm;
}

/* What a write naming a block away from a record's ends costs (--scan-cost): one rank holds n
 * blocks in root chains of 16; then K calls each remove an interior block (position 7 of a
 * random chain) and store it back (its parent named by hash, position 6: also interior), and K
 * calls remove a hash the rank does not hold (a duplicate or stale removal).  Without the
 * locator both look past the end maps and scan the rank's records (kvr_index_stats.rank_scans);
 * with it, one locator probe.  CPU time per call, p50 and p99, microseconds. */
static void bench_scan_cost(size_t n)
{
	enum { K = 400, CL = 16 };
	uint32_t slot[RANKS];
	struct kvr_index *idx = new_index(slot);
	const size_t nc = n / CL;
	struct path *ps = malloc(nc * sizeof(*ps));
	for (size_t i = 0; i < nc; i++) {
		make_path(&ps[i], CL);
		if (kvr_index_store(idx, slot[0], NULL, ps[i].b, CL) != 0)
			abort();
	}
	kvr_index_quiesce(idx);
	uint64_t in[K], miss[K];
	for (int k = 0; k < K; k++) {
		const struct path *p = &ps[rnd() % nc];
		const uint64_t x = p->b[7].ext_hash, t0 = cpu_ns();
		size_t nf = 1;
		kvr_index_remove(idx, slot[0], &x, 1, &nf);
		if (nf != 0 || kvr_index_store(idx, slot[0], &p->b[6].ext_hash, &p->b[7], 1))
			abort();
		in[k] = cpu_ns() - t0;
		const uint64_t y = rnd() | 1, t1 = cpu_ns();
		kvr_index_remove(idx, slot[0], &y, 1, NULL);
		miss[k] = cpu_ns() - t1;
	}
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	printf("SUMMARY bench=index_scan_cost locator=%s rank_blocks=%zu interior_us_p50=%.1f "
	       "interior_us_p99=%.1f miss_us_p50=%.1f miss_us_p99=%.1f rank_scans=%lu\n",
	       no_locator ? "off" : "on", n, (double)pctl(in, K, 500) / 1e3,
	       (double)pctl(in, K, 990) / 1e3, (double)pctl(miss, K, 500) / 1e3,
	       (double)pctl(miss, K, 990) / 1e3, (unsigned long)st.rank_scans);
	fflush(stdout);
	kvr_index_destroy(idx);
	for (size_t i = 0; i < nc; i++)
		free_path(&ps[i]);
	free(ps);
}

static uint64_t apply_ops;

/* One writer: store CH-block chains in calls of `per` blocks, then remove them tail first in
 * chain order, `per` blocks a call.  Returns block ops per second. */
static double bench_apply(size_t per, int ms)
{
	enum { CH = 1024, NP = 16 };
	uint32_t slot[RANKS];
	struct kvr_index *idx = new_index(slot);
	struct path ps[NP], bg[NP];
	/* --ext-hashes: path i as the 4 writers name it (eb[i][k]: slot[k]'s engine hashes) */
	struct kvr_index_block *eb[NP][4] = {{NULL}};
	for (int i = 0; i < NP; i++) {
		make_path(&ps[i], CH);
		make_path(&bg[i], CH); /* steady state: other ranks hold other chains */
		if (ext_hashes) {
			for (int k = 0; k < 4; k++) {
				eb[i][k] = malloc(CH * sizeof(struct kvr_index_block));
				ext_blocks(ps[i].b, ps[i].seq, CH, slot[k], eb[i][k]);
			}
			ext_blocks(bg[i].b, bg[i].seq, CH, slot[8 + i], bg[i].b);
		}
		if (kvr_index_store(idx, slot[8 + i], NULL, bg[i].b, CH) != 0)
			abort();
	}
	uint64_t ops = 0, t0 = now_ns(), end = t0 + (uint64_t)ms * 1000000ull;
	for (int it = 0; now_ns() < end; it++) {
		const struct path *p = &ps[it % NP];
		uint32_t s = slot[it % 4];
		const struct kvr_index_block *b = ext_hashes ? eb[it % NP][it % 4] : p->b;
		for (size_t i = 0; i < CH; i += per) {
			size_t n = CH - i < per ? CH - i : per;
			if (kvr_index_store(idx, s, i ? &b[i - 1].ext_hash : NULL, b + i, n))
				abort();
		}
		uint64_t ext[CH];
		for (size_t i = CH; i > 0;) {
			size_t n = i < per ? i : per;
			i -= n;
			for (size_t j = 0; j < n; j++)
				ext[j] = b[i + j].ext_hash;
			kvr_index_remove(idx, s, ext, n, NULL);
		}
		ops += 2 * CH;
	}
	double secs = (double)(now_ns() - t0) / 1e9;
	kvr_index_destroy(idx);
	for (int i = 0; i < NP; i++) {
		free_path(&ps[i]);
		free_path(&bg[i]);
		for (int k = 0; k < 4; k++)
			free(eb[i][k]);
	}
	apply_ops = ops;
	return (double)ops / secs;
}

/* ---------------------------------------------------------------- reader under a writer */

static struct kvr_index *rw_idx, *rw_idx2;
static struct path *rw_ps;
static int rw_np;
static uint32_t rw_slot[RANKS];
static int rw_stop;

static uint64_t rw_iters; /* the writer's remove + store pairs (atomic relaxed) */

/* The writer flat out on arg (rw_idx: the readers' index; rw_idx2: a copy nobody reads, so
 * the same work shares no line with the reader). */
static void *rw_writer(void *arg)
{
	struct kvr_index *idx = arg;
	pin(1);
	kvr_rcu_thread_online();
	uint64_t r = 0x1234567ull, it = 0;
	while (!__atomic_load_n(&rw_stop, __ATOMIC_RELAXED)) {
		r ^= r << 13;
		r ^= r >> 7;
		r ^= r << 17;
		struct path *p = &rw_ps[r % (uint64_t)rw_np];
		int k = (int)((r >> 20) % RANKS);
		size_t d = p->depth[k], t = d < 16 ? d : 16;
		uint64_t ext[16];
		for (size_t j = 0; j < t; j++)
			ext[j] = p->b[d - t + j].ext_hash;
		kvr_index_remove(idx, rw_slot[k], ext, t, NULL);
		kvr_index_store(idx, rw_slot[k], d > t ? &p->b[d - t - 1].ext_hash : NULL,
		                p->b + d - t, t);
		it++;
	}
	__atomic_add_fetch(&rw_iters, it, __ATOMIC_RELAXED);
	kvr_rcu_thread_offline();
	return NULL;
}

/* One reader phase's latencies (ns): p50, p90, p99, p99.9, and the mean. */
struct rw_pct {
	uint64_t p[4];
	double mean;
	size_t n; /* queries */
};

/* Evicts from every cache what one writer iteration on p would change for the next query of
 * p: one rank's holder word in p's run and that rank's tree size (the lines, as a miss to
 * memory instead of to the writer's cache).  x86-64 only (clflush); elsewhere nothing. */
static void flush_written(const struct path *p)
{
#if defined(__x86_64__)
	const struct idx_run *R = idx_find_run(rw_idx, p->seq[0], NULL, 0);
	const uint64_t hv = R ? __atomic_load_n(&R->hs, __ATOMIC_RELAXED) : 0;
	const uint64_t k = rnd() % RANKS;
	if (hv & IDX_HS_SET) {
		const struct idx_hset *hs = (const struct idx_hset *)(uintptr_t)idx_lo_ptr(hv);
		if (k < hs->n)
			__builtin_ia32_clflush(&hs->e[k]);
	}
	__builtin_ia32_clflush(&rw_idx->tsize[rw_slot[k]]);
	__builtin_ia32_mfence();
#else
	(void)p;
#endif
}

/* The reader: find_matches (the public query, with each rank's tree size) or find_depths (the
 * router's lookup: the same walk, no tree sizes). */
static struct rw_pct reader_lat(int ms, bool depths, bool flush)
{
	size_t cap = 1 << 20, n = 0;
	uint64_t *lat = malloc(cap * sizeof(uint64_t)), sum = 0;
	struct kvr_index_match out[RANKS];
	uint32_t depth[RANKS] = {0}, slots[2 * RANKS], best;
	uint64_t end = now_ns() + (uint64_t)ms * 1000000ull;
	while (n < cap && now_ns() < end) {
		const struct path *p = &rw_ps[rnd() % (uint64_t)rw_np];
		size_t k = 0;
		if (flush)
			flush_written(p);
		uint64_t t0 = now_ns();
		kvr_rcu_read_lock();
		if (depths)
			k = kvr_index_find_depths(rw_idx, p->seq, p->L, depth, slots, &best);
		else
			kvr_index_find_matches(rw_idx, p->seq, p->L, NULL, out, RANKS, &k);
		kvr_rcu_read_unlock();
		lat[n] = now_ns() - t0;
		sum += lat[n++];
		if (depths)
			for (size_t j = 0; j < k; j++)
				depth[slots[j]] = 0;
	}
	struct rw_pct r = {.mean = n ? (double)sum / (double)n : 0, .n = n};
	static const int pm[4] = {500, 900, 990, 999};
	for (int i = 0; i < 4; i++)
		r.p[i] = pctl(lat, n, pm[i]);
	free(lat);
	return r;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* The median over rounds of each percentile and of the mean. */
static struct rw_pct rw_median(struct rw_pct *v, int n)
{
	struct rw_pct m;
	uint64_t t[16];
	double d[16];
	for (int i = 0; i < 4; i++) {
		for (int r = 0; r < n; r++)
			t[r] = v[r].p[i];
		m.p[i] = pctl(t, (size_t)n, 500);
	}
	for (int r = 0; r < n; r++)
		d[r] = v[r].mean;
	qsort(d, (size_t)n, sizeof(*d), cmp_double);
	m.mean = d[n / 2];
	return m;
}

/* What one line the writer changed costs the reader, without the index: the writer's core
 * stores a counter into a line every ~0.5 us, the reader (this thread) loads it after a pause
 * and keeps the times of the loads that saw a new value (the line came from the writer's
 * cache), and of loads of a line only it writes (a hit).  Returns the p50 difference (ns): what
 * a query pays for a line the writer changed since its previous query of the path (its
 * answer), where nothing else in the query overlaps the miss. */
static struct {
	uint64_t w __attribute__((aligned(64)));
	uint64_t mine __attribute__((aligned(64)));
	int stop __attribute__((aligned(64)));
} xf;

static void *xfer_writer(void *arg)
{
	(void)arg;
	pin(1);
	for (uint64_t i = 1; !__atomic_load_n(&xf.stop, __ATOMIC_RELAXED); i++) {
		__atomic_store_n(&xf.w, i, __ATOMIC_RELAXED);
		for (volatile int k = 0; k < 300; k++)
			;
	}
	return NULL;
}

static uint64_t line_transfer_ns(int ms)
{
	enum { N = 20000 };
	uint64_t *miss = malloc(N * sizeof(uint64_t)), *hit = malloc(N * sizeof(uint64_t));
	size_t nm = 0, nh = 0;
	uint64_t last = 0, end = now_ns() + (uint64_t)ms * 1000000ull;
	__atomic_store_n(&xf.stop, 0, __ATOMIC_RELAXED);
	pthread_t th;
	pthread_create(&th, NULL, xfer_writer, NULL);
	while ((nm < N || nh < N) && now_ns() < end) {
		for (volatile int k = 0; k < 400; k++)
			;
		uint64_t t0 = now_ns();
		uint64_t v = __atomic_load_n(&xf.w, __ATOMIC_RELAXED);
		uint64_t t1 = now_ns();
		if (v != last && nm < N)
			miss[nm++] = t1 - t0;
		last = v;
		t0 = now_ns();
		v = __atomic_load_n(&xf.mine, __ATOMIC_RELAXED);
		t1 = now_ns();
		__atomic_store_n(&xf.mine, v + 1, __ATOMIC_RELAXED);
		if (nh < N)
			hit[nh++] = t1 - t0;
	}
	__atomic_store_n(&xf.stop, 1, __ATOMIC_RELAXED);
	pthread_join(th, NULL);
	const uint64_t m = pctl(miss, nm, 500), h = pctl(hit, nh, 500);
	free(miss);
	free(hit);
	return m > h ? m - h : 0;
}

/* One phase of queries with the writer running on idx. */
static struct rw_pct reader_with_writer(int ms, bool depths, struct kvr_index *idx, uint64_t *iters)
{
	__atomic_store_n(&rw_stop, 0, __ATOMIC_RELAXED);
	const uint64_t i0 = __atomic_load_n(&rw_iters, __ATOMIC_RELAXED);
	pthread_t th;
	pthread_create(&th, NULL, rw_writer, idx);
	struct rw_pct r = reader_lat(ms, depths, false);
	__atomic_store_n(&rw_stop, 1, __ATOMIC_RELAXED);
	pthread_join(th, NULL);
	*iters += __atomic_load_n(&rw_iters, __ATOMIC_RELAXED) - i0;
	return r;
}

static void bench_reader_writer(int ms)
{
	pin(0);
	rw_np = 64;
	rw_ps = calloc((size_t)rw_np, sizeof(*rw_ps));
	rw_idx = new_index(rw_slot);
	uint32_t slot2[RANKS];
	rw_idx2 = new_index(slot2);
	for (int i = 0; i < rw_np; i++) {
		make_path(&rw_ps[i], 512);
		apply_pattern(rw_idx, rw_slot, &rw_ps[i], 1, i);
		for (int r = 0; r < RANKS; r++) /* the same holders in the copy */
			if (slot2[r] != rw_slot[r] ||
			    kvr_index_store(rw_idx2, slot2[r], NULL, rw_ps[i].b, rw_ps[i].depth[r]))
				abort();
	}
	/* Alternate alone / with a writer, R rounds each, and take the median round: the
	 * machine's load drifts, so back-to-back phases compare like with like.  Both readers:
	 * find_matches also reads each matched rank's tree size, a counter the writer changes on
	 * every call (so a query after a write misses on its line); the router's lookup
	 * (find_depths) reads no tree size.  The p50, p90 and p99.9 and the mean are printed too:
	 * the clock's 10 ns steps make one p99 of ~100 ns a coarse ratio, and where in the
	 * distribution the writer's cost sits says what it is.  A third phase runs the same writer
	 * on a copy of the index that the reader does not read (elsewhere): what a busy writer
	 * costs the reader without sharing a line with it (the other core's memory traffic, RCU
	 * grace periods, the VM); and writer_iters_per_100_queries is how many remove + store
	 * pairs the writer did per 100 queries: each pair changes lines of one path (its rank's
	 * holder word, its tree size), which the next query of that path reads from the writer's
	 * cache, so above ~1 a p99 includes such a miss.  A fourth phase, alone again, flushes
	 * before each query the two lines one writer iteration on its path would change
	 * (flush_written): the cost of that miss (to memory here) without a second thread, which
	 * the machine's load does not blur.  line_transfer_ns is what one line the writer's core
	 * changed costs a load here (line_transfer_ns()), and p99_alone_plus_transfer_ratio the
	 * ratio a p99 with one such miss fully exposed would give (a query overlaps part of it
	 * with its other loads): what exact answers cost while more than 1 % of the queries read
	 * a line changed since their previous query of the path (valgrind lackey on this writer:
	 * ~30 % of queries, 0.36 holder-word lines per query). */
	enum { R = 5 };
	const uint64_t xfer = line_transfer_ns(ms / 10 > 50 ? ms / 10 : 50);
	for (int depths = 0; depths < 2; depths++) {
		struct rw_pct al[R], wi[R], el[R], fl[R];
		uint64_t iters = 0, queries = 0;
		for (int round = 0; round < R; round++) {
			al[round] = reader_lat(ms / R / 4, depths, false);
			wi[round] = reader_with_writer(ms / R / 4, depths, rw_idx, &iters);
			queries += wi[round].n;
			uint64_t ie = 0;
			el[round] = reader_with_writer(ms / R / 4, depths, rw_idx2, &ie);
			fl[round] = reader_lat(ms / R / 4, depths, true);
		}
		const struct rw_pct a = rw_median(al, R), w = rw_median(wi, R),
		                    e = rw_median(el, R), fm = rw_median(fl, R);
		printf(
		    "SUMMARY bench=index_rw L=512 pattern=b reader=%s reader_p99_alone_ns=%lu "
		    "reader_p99_with_writer_ns=%lu ratio=%.2f reader_p99_writer_elsewhere_ns=%lu "
		    "ratio_elsewhere=%.2f writer_iters_per_100_queries=%.2f "
		    "alone_flushed_p50/p99_ns=%lu/%lu "
		    "alone_p50/p90/p999_ns=%lu/%lu/%lu with_p50/p90/p999_ns=%lu/%lu/%lu "
		    "mean_ns_alone=%.1f mean_ns_with=%.1f line_transfer_ns=%lu "
		    "p99_alone_plus_transfer_ratio=%.2f\n",
		    depths ? "find_depths" : "find_matches", (unsigned long)a.p[2],
		    (unsigned long)w.p[2], a.p[2] ? (double)w.p[2] / (double)a.p[2] : 0,
		    (unsigned long)e.p[2], a.p[2] ? (double)e.p[2] / (double)a.p[2] : 0,
		    queries ? 100.0 * (double)iters / (double)queries : 0, (unsigned long)fm.p[0],
		    (unsigned long)fm.p[2], (unsigned long)a.p[0], (unsigned long)a.p[1],
		    (unsigned long)a.p[3], (unsigned long)w.p[0], (unsigned long)w.p[1],
		    (unsigned long)w.p[3], a.mean, w.mean, (unsigned long)xfer,
		    a.p[2] ? (double)(a.p[2] + xfer) / (double)a.p[2] : 0);
	}
	kvr_index_destroy(rw_idx);
	kvr_index_destroy(rw_idx2);
	for (int i = 0; i < rw_np; i++)
		free_path(&rw_ps[i]);
	free(rw_ps);
}

/* n find_depths queries (kvr_route's lookup) on random prompts of ps[0..np), each inside a
 * read section, the depth array cleared after each as the router does. */
static void depths_queries(const struct kvr_index *idx, const struct path *ps, int np, long n)
{
	uint32_t depth[RANKS] = {0}, slots[RANKS], best;
	for (long i = 0; i < n; i++) {
		const struct path *p = &ps[rnd() % (uint64_t)np];
		kvr_rcu_read_lock();
		size_t k = kvr_index_find_depths(idx, p->seq, p->L, depth, slots, &best);
		kvr_rcu_read_unlock();
		for (size_t j = 0; j < k; j++)
			depth[slots[j]] = 0;
	}
}

/* --cg L PAT: build one (L, pattern) index and run 1000 queries of each reader and 1000
 * hashes, for valgrind --tool=callgrind (instructions per call of kvr_index_find_matches,
 * kvr_index_find_depths and kvr_hash_blocks, the noise-free form of the match/hash ratio). */
static void cg_mode(size_t L, int pat)
{
	int np;
	struct path *ps;
	struct kvr_index *idx = pattern_index(L, pat, &np, &ps);
	struct match_pct m;
	match_lat(idx, ps, np, 1000, &m);
	depths_queries(idx, ps, np, 1000);
	uint64_t h = hash_p50(&ps[0], 1000);
	printf("cg L=%zu pattern=%c (timings under valgrind are meaningless: %lu %lu)\n", L,
	       "abcdef"[pat], (unsigned long)m.p99, (unsigned long)h);
	kvr_index_destroy(idx);
	free_prompts(ps, np);
}

/* The latency view of find_depths: back-to-back queries (tput) overlap one query's misses
 * with the next's work and find every line in L1/L2; kvr_route's lookup finds the index's
 * lines elsewhere (the shards rewrote them while it hashed), so its time is the chain of
 * dependent misses.  Here each query runs after a walk over a 4 MiB buffer (twice L2) evicted
 * the index from L1 and L2 (into L3), the prompt's hashes touched again (kvr_route has just
 * written them), and is timed alone (cold), then repeated at once (warm).  p50 / p99 each. */
static void cold_lat(const struct kvr_index *idx, const struct path *ps, int np, int pat, int reps)
{
	enum { EVICT = 4 << 20 };
	volatile uint64_t *buf = calloc(EVICT / 8, 8);
	uint64_t *cold = malloc((size_t)reps * sizeof(uint64_t));
	uint64_t *warm = malloc((size_t)reps * sizeof(uint64_t));
	uint32_t depth[RANKS] = {0}, slots[RANKS], best;
	uint64_t sink = 0;
	for (int i = 0; i < reps; i++) {
		const struct path *p = &ps[rnd() % (uint64_t)np];
		for (size_t j = 0; j < EVICT / 8; j += 8)
			buf[j] += 1;
		for (size_t j = 0; j < p->L; j++)
			sink += p->seq[j];
		for (int w = 0; w < 2; w++) {
			uint64_t t0 = now_ns();
			kvr_rcu_read_lock();
			size_t k = kvr_index_find_depths(idx, p->seq, p->L, depth, slots, &best);
			kvr_rcu_read_unlock();
			(w ? warm : cold)[i] = now_ns() - t0;
			for (size_t j = 0; j < k; j++)
				depth[slots[j]] = 0;
		}
	}
	const uint64_t c50 = pctl(cold, (size_t)reps, 500), c99 = pctl(cold, (size_t)reps, 990);
	const uint64_t w50 = pctl(warm, (size_t)reps, 500), w99 = pctl(warm, (size_t)reps, 990);
	printf("SUMMARY bench=index_lat_depths L=%zu pattern=%c queries=%d cold_p50_ns=%lu "
	       "cold_p99_ns=%lu warm_p50_ns=%lu warm_p99_ns=%lu (%lu)\n",
	       ps[0].L, "abcdef"[pat], reps, (unsigned long)c50, (unsigned long)c99,
	       (unsigned long)w50, (unsigned long)w99, (unsigned long)(sink & 1));
	free((void *)buf);
	free(cold);
	free(warm);
}

/* One find_depths call with the given loops, timed in TSC ticks (rdtscp after, lfence before). */
static uint64_t depths_ticks(const struct kvr_index *idx, const struct path *p, uint32_t *depth,
                             uint32_t *slots, uint32_t *best, size_t *k,
                             enum kvr_index_depths_impl impl)
{
#if defined(__x86_64__)
	unsigned aux;
	__builtin_ia32_lfence();
	const uint64_t t0 = __builtin_ia32_rdtsc();
	__builtin_ia32_lfence();
	*k = kvr_index_find_depths_impl(idx, p->seq, p->L, depth, slots, best, impl);
	const uint64_t t1 = __builtin_ia32_rdtscp(&aux);
	__builtin_ia32_lfence();
	return t1 - t0;
#else
	const uint64_t t0 = now_ns();
	*k = kvr_index_find_depths_impl(idx, p->seq, p->L, depth, slots, best, impl);
	return now_ns() - t0;
#endif
}

/* --depths-ab L PAT [N]: find_depths with its AVX2 loops (KVR_INDEX_DEPTHS_AUTO) and without
 * (BASE) on the same index and prompts, in one process, so the machine's load falls on both.
 * N random prompts (default 20,000), each read first (kvr_route has just hashed it), then
 * queried by both, in alternating order: each impl's "first" samples are those where it ran
 * first on its prompt (the path's lines as the previous prompt's query left them, as in
 * kvr_route), "second" right after the other (the path in L1).  Ticks of the TSC.  The two
 * answers are compared (depths, slots, best): a difference aborts.  Then the mean over
 * back-to-back queries (7 rounds, alternated, best round of each). */
static void depths_ab(size_t L, int pat, long reps)
{
	int np;
	struct path *ps;
	struct kvr_index *idx = pattern_index(L, pat, &np, &ps);
	uint64_t *lat[2][2];
	size_t nl[2][2] = {{0}};
	for (int a = 0; a < 2; a++)
		for (int b = 0; b < 2; b++)
			lat[a][b] = malloc((size_t)reps * sizeof(uint64_t));
	uint32_t depth[2][RANKS] = {{0}}, slots[2][RANKS], best[2];
	uint64_t sink = 0;
	for (long i = 0; i < reps; i++) {
		const struct path *p = &ps[rnd() % (uint64_t)np];
		sink += touch_hashes(p);
		size_t k[2];
		kvr_rcu_read_lock();
		for (int o = 0; o < 2; o++) {
			const int im = (int)((i + o) & 1); /* 0: AUTO, 1: BASE */
			lat[im][o][nl[im][o]++] =
			    depths_ticks(idx, p, depth[im], slots[im], &best[im], &k[im],
			                 im ? KVR_INDEX_DEPTHS_BASE : KVR_INDEX_DEPTHS_AUTO);
		}
		kvr_rcu_read_unlock();
		if (k[0] != k[1] || best[0] != best[1] ||
		    memcmp(depth[0], depth[1], sizeof(depth[0])) != 0 ||
		    memcmp(slots[0], slots[1], k[0] * sizeof(uint32_t)) != 0) {
			fprintf(stderr, "depths-ab: the two loops disagree on prompt %ld\n",
			        (long)(p - ps));
			abort();
		}
		for (int im = 0; im < 2; im++)
			for (size_t j = 0; j < k[im]; j++)
				depth[im][slots[im][j]] = 0;
	}
	double tput[2] = {1e30, 1e30};
	const long nq = L >= 8192 ? 10000 : 50000;
	for (int round = 0; round < 14; round++) {
		const int im = round & 1;
		uint32_t b;
		const uint64_t t0 = now_ns();
		for (long q = 0; q < nq; q++) {
			kvr_rcu_read_lock();
			size_t k = kvr_index_find_depths_impl(
			    idx, ps[q % np].seq, L, depth[0], slots[0], &b,
			    im ? KVR_INDEX_DEPTHS_BASE : KVR_INDEX_DEPTHS_AUTO);
			kvr_rcu_read_unlock();
			for (size_t j = 0; j < k; j++)
				depth[0][slots[0][j]] = 0;
		}
		const double d = (double)(now_ns() - t0) / (double)nq;
		tput[im] = d < tput[im] ? d : tput[im];
	}
	for (int im = 0; im < 2; im++)
		printf("SUMMARY bench=index_depths_ab L=%zu pattern=%c impl=%s queries=%ld "
		       "first_p50_ticks=%lu first_p90_ticks=%lu second_p50_ticks=%lu "
		       "second_p90_ticks=%lu tput_ns=%.1f (%lu)\n",
		       L, "abcdef"[pat], im ? "base" : "auto", reps,
		       (unsigned long)pctl(lat[im][0], nl[im][0], 500),
		       (unsigned long)pctl(lat[im][0], nl[im][0], 900),
		       (unsigned long)pctl(lat[im][1], nl[im][1], 500),
		       (unsigned long)pctl(lat[im][1], nl[im][1], 900), tput[im],
		       (unsigned long)(sink & 1));
	for (int a = 0; a < 2; a++)
		for (int b = 0; b < 2; b++)
			free(lat[a][b]);
	kvr_index_destroy(idx);
	free_prompts(ps, np);
}

/* --tput L PAT: mean find_matches time over back-to-back queries (the best of 7 rounds of Q
 * queries over the P prompts): where a change moves a query by a few ns, the p50 of single
 * timed calls (10 ns clock steps here) cannot show it. */
static void tput_mode(size_t L, int pat)
{
	int np;
	long nq = L == 8192 ? 10000 : 100000;
	struct path *ps;
	struct kvr_index *idx = pattern_index(L, pat, &np, &ps);
	struct kvr_index_match out[RANKS];
	uint64_t best = UINT64_MAX;
	for (int round = 0; round < 7; round++) {
		uint64_t t0 = now_ns();
		for (long q = 0; q < nq; q++) {
			size_t n = 0;
			kvr_rcu_read_lock();
			kvr_index_find_matches(idx, ps[q % np].seq, L, NULL, out, RANKS, &n);
			kvr_rcu_read_unlock();
		}
		uint64_t d = now_ns() - t0;
		best = d < best ? d : best;
	}
	printf("SUMMARY bench=index_tput L=%zu pattern=%c queries=%ld mean_ns_per_query=%.1f\n", L,
	       "abcdef"[pat], nq, (double)best / (double)nq);
	best = UINT64_MAX;
	for (int round = 0; round < 7; round++) {
		uint64_t t0 = now_ns();
		depths_queries(idx, ps, np, nq);
		uint64_t d = now_ns() - t0;
		best = d < best ? d : best;
	}
	printf("SUMMARY bench=index_tput_depths L=%zu pattern=%c queries=%ld "
	       "mean_ns_per_query=%.1f\n",
	       L, "abcdef"[pat], nq, (double)best / (double)nq);
	cold_lat(idx, ps, np, pat, L == 8192 ? 1000 : 3000);
	kvr_index_destroy(idx);
	free_prompts(ps, np);
}

enum { CH_RANKS = 8, CH_L = 512, CH_HELD = 128 };

/* One churn run (see the header); step_min: the locator's least migration slice, grow_at: the
 * locator load (per mille) that starts a growth, grow_to: the load it grows to. */
static void bench_churn(int adm, uint64_t step_min, uint64_t grow_at, uint64_t grow_to,
                        const char *mode)
{
	kvr_index_blk_step_min = step_min;
	kvr_index_blk_grow_at = grow_at;
	kvr_index_blk_grow_to = grow_to;
	rng = 0x9e3779b97f4a7c15ull; /* the same prompts in every mode */
	uint32_t slot[RANKS];
	struct kvr_index *idx = new_index(slot);
	struct kvr_index_block *held = malloc((size_t)CH_RANKS * CH_HELD * CH_L * sizeof(*held));
	uint64_t *lat = malloc((size_t)adm * 2 * sizeof(*lat)), ext[CH_L];
	uint64_t *cpu = malloc((size_t)adm * 2 * sizeof(*cpu));
	if (!held || !lat || !cpu)
		abort();
	struct path p;
	enum { NFILL = CH_RANKS * CH_HELD };
	uint64_t fcpu[NFILL];
	double floc = 0;                  /* locator bytes per entry after each fill call, summed */
	for (int i = 0; i < NFILL; i++) { /* fill: the locator grows (migrations) */
		make_path(&p, CH_L);
		memcpy(&held[(size_t)i * CH_L], p.b, CH_L * sizeof(*held));
		free_path(&p);
		const uint64_t c0 = cpu_ns();
		if (kvr_index_store(idx, slot[i % CH_RANKS], NULL, &held[(size_t)i * CH_L], CH_L))
			abort();
		fcpu[i] = cpu_ns() - c0;
		floc += (double)(idx_blk_bytes(idx->blk.cap) + idx_blk_bytes(idx->blk.old_cap)) /
		        (double)(idx->blk.count + idx->blk.old_count);
	}
	qsort(fcpu, NFILL, sizeof(*fcpu), cmp_u64);
	printf("# fill (%d stores of %d blocks from empty): cpu_max_us=%.1f cpu_p99_us=%.1f "
	       "cpu_p50_us=%.1f locator_bytes_per_entry_mean=%.2f migrations=%lu\n",
	       NFILL, CH_L, (double)fcpu[NFILL - 1] / 1e3, (double)fcpu[NFILL * 99 / 100] / 1e3,
	       (double)fcpu[NFILL / 2] / 1e3, floc / NFILL, (unsigned long)idx->blk.rebuilds);
	uint64_t t_all = 0, loc = 0;
	const uint64_t rebuilds0 = idx->blk.rebuilds, f0 = idx->blk.finds,
	               fc0 = idx->blk.false_cands;
	for (int a = 0; a < adm; a++) {
		loc += idx_blk_bytes(idx->blk.cap) + idx_blk_bytes(idx->blk.old_cap); /* sampled */
		const int r = a % CH_RANKS, k = (a / CH_RANKS) % CH_HELD;
		struct kvr_index_block *h = &held[((size_t)k * CH_RANKS + (size_t)r) * CH_L];
		make_path(&p, CH_L);
		for (size_t j = 0; j < CH_L; j++)
			ext[j] = h[j].ext_hash;
		uint64_t c0 = cpu_ns(), t0 = now_ns();
		kvr_index_remove(idx, slot[r], ext, CH_L, NULL);
		uint64_t t1 = now_ns(), c1 = cpu_ns(), t1b = now_ns();
		if (kvr_index_store(idx, slot[r], NULL, p.b, CH_L))
			abort();
		uint64_t t2 = now_ns(), c2 = cpu_ns();
		cpu[2 * a] = c1 - c0;
		cpu[2 * a + 1] = c2 - c1;
		memcpy(h, p.b, CH_L * sizeof(*h));
		free_path(&p);
		lat[2 * a] = t1 - t0;
		lat[2 * a + 1] = t2 - t1b;
		t_all += t2 - t1b + t1 - t0;
	}
	const size_t n = (size_t)adm * 2;
	qsort(lat, n, sizeof(*lat), cmp_u64);
	qsort(cpu, n, sizeof(*cpu), cmp_u64);
	printf("SUMMARY bench=index_churn mode=%s grow_at=%.2f calls=%zu max_us=%.1f p999_us=%.1f "
	       "p99_us=%.1f p50_us=%.1f block_ops_per_s=%.0f locator_bytes_per_block=%.2f "
	       "cpu_max_us=%.1f cpu_p999_us=%.1f cpu_p99_us=%.1f locator_rebuilds=%lu "
	       "false_cands_per_find=%.4f\n",
	       mode, (double)grow_at / 1000, n, (double)lat[n - 1] / 1e3,
	       (double)lat[n * 999 / 1000] / 1e3, (double)lat[n * 99 / 100] / 1e3,
	       (double)lat[n / 2] / 1e3, (double)n * CH_L / ((double)t_all / 1e9),
	       (double)loc / adm / ((double)CH_RANKS * CH_HELD * CH_L), (double)cpu[n - 1] / 1e3,
	       (double)cpu[n * 999 / 1000] / 1e3, (double)cpu[n * 99 / 100] / 1e3,
	       (unsigned long)(idx->blk.rebuilds - rebuilds0),
	       (double)(idx->blk.false_cands - fc0) /
	           (double)(idx->blk.finds - f0 + !(idx->blk.finds - f0)));
	fflush(stdout);
	kvr_index_destroy(idx);
	free(held);
	free(lat);
	free(cpu);
}

/* The pattern letter of a single-pattern mode's option argv[i] (its k-th value), or exit 2. */
static int opt_pat(int argc, char **argv, int i, int k)
{
	const char *v = opt_arg(argc, argv, i, k);
	if (v[0] < 'a' || v[0] > 'f' || v[1])
		opt_bad(argv, i, "a pattern a..f after its L", v);
	return v[0] - 'a';
}

/* The single mode a command line asks for, run after every option is read (a mode ran where
 * it stood and what followed was never read: --rw-only --ms 2000 ran 400 ms). */
enum run_mode {
	RUN_MAIN,
	RUN_APPLY,
	RUN_CG,
	RUN_DEPTHS_AB,
	RUN_TPUT,
	RUN_TAIL,
	RUN_RW,
	RUN_CHURN,
	RUN_MEM,
	RUN_SCAN,
	RUN_SWEEP
};

int main(int argc, char **argv)
{
	int ms = 400;
	bool quick = false, touch = false, sweep_policy = false;
	size_t per = 16, L = 0;
	int pat = 0, adm = 4000;
	long reps = 20000;
	uint64_t sweep_at = 0, sweep_to = 0;
	const char *churn_only = NULL;
	enum run_mode mode = RUN_MAIN;
	for (int i = 1; i < argc; i++) {
		const enum run_mode was = mode;
		if (!strcmp(argv[i], "--ms"))
			ms = (int)opt_u64(argc, argv, i++, 1, 100000000);
		else if (!strcmp(argv[i], "--per"))
			per = (size_t)opt_u64(argc, argv, i++, 1, 1u << 20);
		else if (!strcmp(argv[i], "--grow")) {
			/* the locator's growth policy (per mille) */
			kvr_index_blk_grow_at = opt_arg_u64(argc, argv, i, 1, 1, 1000);
			kvr_index_blk_grow_to = opt_arg_u64(argc, argv, i, 2, 1, 1000);
			i += 2;
		} else if (!strcmp(argv[i], "--xgrow")) /* the ext maps' growth target (per cent) */
			kvr_index_xmap_grow_to = opt_u64(argc, argv, i++, 1, 100);
		else if (!strcmp(argv[i], "--quick"))
			quick = true;
		else if (!strcmp(argv[i], "--no-locator"))
			no_locator = true; /* every index without the block locator */
		else if (!strcmp(argv[i], "--ext-hashes"))
			ext_hashes = true; /* engine hashes: --mem-only, --apply-only */
		else if (!strcmp(argv[i], "--cg") || !strcmp(argv[i], "--depths-ab") ||
		         !strcmp(argv[i], "--tput") || !strcmp(argv[i], "--tail")) {
			mode = argv[i][2] == 'c'   ? RUN_CG
			       : argv[i][2] == 'd' ? RUN_DEPTHS_AB
			       : argv[i][3] == 'p' ? RUN_TPUT
			                           : RUN_TAIL;
			L = (size_t)opt_arg_u64(argc, argv, i, 1, 1, 1u << 16);
			pat = opt_pat(argc, argv, i, 2);
			int j = i;
			i += 2;
			if (mode == RUN_DEPTHS_AB && i + 1 < argc && argv[i + 1][0] != '-')
				reps = (long)opt_arg_u64(argc, argv, j, 3, 1, 1000000000), i++;
			if (mode == RUN_TAIL && i + 1 < argc && !strcmp(argv[i + 1], "--touch"))
				touch = true, i++;
		} else if (!strcmp(argv[i], "--rw-only"))
			mode = RUN_RW;
		else if (!strcmp(argv[i], "--churn")) {
			/* --churn [N] [--churn-mode once|incr|old] */
			mode = RUN_CHURN;
			int j = i;
			if (i + 1 < argc && argv[i + 1][0] != '-')
				adm = (int)opt_arg_u64(argc, argv, j, 1, 1, 100000000), i++;
			if (i + 1 < argc && !strcmp(argv[i + 1], "--churn-mode")) {
				churn_only = opt_str(argc, argv, ++i);
				if (strcmp(churn_only, "once") && strcmp(churn_only, "incr") &&
				    strcmp(churn_only, "old"))
					opt_bad(argv, i, "once, incr or old", churn_only);
				i++;
			}
		} else if (!strcmp(argv[i], "--mem-only"))
			mode = RUN_MEM;
		else if (!strcmp(argv[i], "--scan-cost"))
			mode = RUN_SCAN;
		else if (!strcmp(argv[i], "--mem-sweep")) {
			/* --mem-sweep [AT TO]: a growth policy (per mille) to weigh against the
			 * defaults */
			mode = RUN_SWEEP;
			if (i + 1 < argc && argv[i + 1][0] != '-') {
				sweep_at = opt_arg_u64(argc, argv, i, 1, 1, 1000);
				sweep_to = opt_arg_u64(argc, argv, i, 2, 1, 1000);
				sweep_policy = true;
				i += 2;
			}
		} else if (!strcmp(argv[i], "--apply-only"))
			mode = RUN_APPLY; /* for valgrind --tool=callgrind */
		else
			opt_unknown(argv, i);
		if (was != RUN_MAIN && mode != was) {
			fprintf(stderr, "bench_index_runs: one mode at a time (%s)\n", argv[i]);
			return 2;
		}
	}
	if (kvr_rcu_thread_online() != 0)
		return 1;
	switch (mode) {
	case RUN_MAIN:
	case RUN_APPLY:
		break;
	case RUN_CG:
		cg_mode(L, pat);
		return 0;
	case RUN_DEPTHS_AB:
		depths_ab(L, pat, reps);
		return 0;
	case RUN_TPUT:
		tput_mode(L, pat);
		return 0;
	case RUN_TAIL:
		tail_mode(L, pat, L == 8192 ? 1000 : 5000, touch);
		return 0;
	case RUN_RW:
		bench_reader_writer(ms);
		return 0;
	case RUN_CHURN: {
		const uint64_t dflt = kvr_index_blk_step_min, g = kvr_index_blk_grow_at,
		               gt = kvr_index_blk_grow_to;
		if (!churn_only || !strcmp(churn_only, "once"))
			bench_churn(adm, (uint64_t)1 << 60, g, gt, "once");
		if (!churn_only || !strcmp(churn_only, "incr"))
			bench_churn(adm, dflt, g, gt, "incremental");
		if (!churn_only || !strcmp(churn_only, "old"))
			bench_churn(adm, 2, 850, 567, "incremental_0.85_to_0.57_step2");
		return 0;
	}
	case RUN_MEM:
		mem_all(ext_hashes);
		return 0;
	case RUN_SCAN: {
		const bool nl = no_locator;
		for (size_t n = 25600; n <= 409600; n *= 4)
			for (int m = 0; m < 2; m++) {
				no_locator = m == 1;
				bench_scan_cost(n);
			}
		no_locator = nl;
		return 0;
	}
	case RUN_SWEEP:
		if (sweep_policy)
			mem_sweep(sweep_at, sweep_to, kvr_index_blk_step_min);
		mem_sweep(kvr_index_blk_grow_at, kvr_index_blk_grow_to, kvr_index_blk_step_min);
		mem_sweep(850, 567, 2); /* the previous defaults */
		return 0;
	}
	const bool apply_only = mode == RUN_APPLY;
	if (apply_only) {
		double r = bench_apply(per ? per : 1, ms);
		if (ext_hashes)
			printf("SUMMARY bench=index_apply ext=rank blocks_per_call=%zu "
			       "block_ops_per_s=%.0f ops=%lu\n",
			       per ? per : 1, r, (unsigned long)apply_ops);
		else
			printf("SUMMARY bench=index_apply blocks_per_call=%zu block_ops_per_s=%.0f "
			       "ops=%lu\n",
			       per ? per : 1, r, (unsigned long)apply_ops);
		return 0;
	}
	bench_match(quick);
	mem_all(false);
	double a16 = bench_apply(16, ms), a1 = bench_apply(1, ms);
	printf("SUMMARY bench=index_apply blocks_per_call=16 block_ops_per_s=%.0f\n", a16);
	printf("SUMMARY bench=index_apply blocks_per_call=1 block_ops_per_s=%.0f\n", a1);
	fflush(stdout);
	bench_reader_writer(ms);
	return 0;
}
