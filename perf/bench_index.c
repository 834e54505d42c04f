/*
 * bench_index - the RCU radix index (core/index) on the Mooncake conversation trace.
 *
 * Load: every request's hash_ids become blocks (local hash = XXH3 of the id, ext hash = the
 * chained XXH3 of the locals, like an engine's), stored from the root on rank
 * hash(first id) % 64.  Then queries (the same requests' local hashes, shuffled) run on R reader
 * threads inside RCU read sections, with W writer threads applying removed + stored events flat
 * out (drop the back half of a random request on its rank, store it again).  Same run, same keys:
 *  - floor: a bare open-addressing probe per query block (no concurrency, no rank sets);
 *  - baseline: a simple tree (one hash map of (parent, local) -> node with a 64-bit rank mask)
 *    under one mutex, same readers and writer.
 * Prints one SUMMARY line per (readers, writers); never asserts timings.
 *
 * usage: bench_index [trace.jsonl] [--ms N] [--max-requests N] [--writer-iters N]
 *   --writer-iters N: after the load, run N writer iterations (removed + stored events) on this
 *   thread in writer_iters() and exit: a deterministic workload for
 *   valgrind --tool=callgrind --toggle-collect=writer_iters (instructions per block op).
 *   --reader-iters N: likewise N find_matches queries in reader_iters().
 *   trace default /work/shared/traces/mooncake/conversation_trace.jsonl, falling back to
 *   data/traces/mooncake/conversation_sample.jsonl.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/hash.h"
#include "core/index.h"
#include "kvrouter.h"
#include "perf/bench_util.h"
#include "sync/rcu.h"

enum { RANKS = 64, MAXT = 4 };

struct req {
	uint64_t *local;
	uint64_t *seq; /* the sequence hashes find_matches takes */
	struct kvr_index_block *b;
	size_t n;
	uint32_t rank;
};

static struct req *reqs;
static size_t nreq, total_blocks;
static struct kvr_index *idx;
static uint32_t slots[RANKS];
static int go, stop;
static double ms = 1000;

/* ---------------------------------------------------------------- trace */

static int load_trace(const char *path, size_t max_req)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	size_t cap = 1024;
	reqs = calloc(cap, sizeof(*reqs));
	char *line = NULL;
	size_t lcap = 0;
	uint64_t ids[65536];
	while (getline(&line, &lcap, f) > 0 && nreq < max_req) {
		char *p = strstr(line, "\"hash_ids\"");
		if (!p || !(p = strchr(p, '[')))
			continue;
		size_t n = 0;
		for (p++; *p && *p != ']';) {
			if (*p >= '0' && *p <= '9') {
				uint64_t v = strtoull(p, &p, 10);
				if (n < 65536)
					ids[n++] = v;
			} else {
				p++;
			}
		}
		if (!n)
			continue;
		if (nreq == cap)
			reqs = realloc(reqs, (cap *= 2) * sizeof(*reqs));
		struct req *r = &reqs[nreq++];
		r->n = n;
		r->local = malloc(n * sizeof(uint64_t));
		r->b = malloc(n * sizeof(*r->b));
		uint64_t ext = 0;
		for (size_t i = 0; i < n; i++) {
			r->local[i] = XXH3_64bits(&ids[i], sizeof(ids[i]));
			uint64_t pair[2] = {ext, r->local[i]};
			ext = XXH3_64bits_withSeed(pair, sizeof(pair), 1337);
			r->b[i] = (struct kvr_index_block){ext, r->local[i]};
		}
		r->seq = malloc(n * sizeof(uint64_t));
		kvr_hash_chain_locals(NULL, r->local, n, r->seq);
		r->rank = (uint32_t)(XXH3_64bits(&ids[0], sizeof(ids[0])) % RANKS);
		total_blocks += n;
	}
	free(line);
	fclose(f);
	return nreq ? 0 : -1;
}

/* ---------------------------------------------------------------- latency samples */

#define MAXS (1u << 21)
struct lat {
	uint32_t *ns;
	size_t n;
	uint64_t ops;
} __attribute__((aligned(64)));

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static void pct(struct lat *l, int nl, double *p50, double *p99, double *p999)
{
	size_t tot = 0;
	for (int i = 0; i < nl; i++)
		tot += l[i].n;
	uint32_t *all = malloc((tot ? tot : 1) * sizeof(uint32_t));
	size_t k = 0;
	for (int i = 0; i < nl; i++) {
		memcpy(all + k, l[i].ns, l[i].n * sizeof(uint32_t));
		k += l[i].n;
	}
	qsort(all, tot, sizeof(uint32_t), cmp_u32);
	*p50 = tot ? all[tot / 2] : 0;
	*p99 = tot ? all[tot * 99 / 100] : 0;
	*p999 = tot ? all[tot * 999 / 1000] : 0;
	free(all);
}

/* ---------------------------------------------------------------- floor: bare probe */

static uint64_t *floor_tab;
static uint64_t floor_mask;

static void floor_build(void)
{
	uint64_t cap = 1;
	while (cap < total_blocks * 2)
		cap <<= 1;
	floor_tab = calloc(cap, sizeof(uint64_t));
	floor_mask = cap - 1;
	for (size_t r = 0; r < nreq; r++)
		for (size_t i = 0; i < reqs[r].n; i++) {
			uint64_t k = reqs[r].b[i].ext_hash | 1;
			uint64_t j = k & floor_mask;
			while (floor_tab[j] && floor_tab[j] != k)
				j = (j + 1) & floor_mask;
			floor_tab[j] = k;
		}
}

static volatile uint64_t sink;

static double floor_p99(void)
{
	struct lat l = {.ns = malloc(MAXS * sizeof(uint32_t))};
	uint64_t end = now_ns() + (uint64_t)(ms * 1e6 / 2);
	uint64_t rng = 7;
	while (now_ns() < end && l.n < MAXS) {
		rng = rng * 6364136223846793005ull + 1;
		const struct req *r = &reqs[(rng >> 33) % nreq];
		uint64_t t0 = now_ns(), acc = 0;
		for (size_t i = 0; i < r->n; i++) {
			/* The query's keys, one probe each (chained ext keys computed up front like
			 * the index's prefix keys). */
			uint64_t k = r->b[i].ext_hash | 1;
			uint64_t j = k & floor_mask;
			while (floor_tab[j] && floor_tab[j] != k)
				j = (j + 1) & floor_mask;
			acc += floor_tab[j] != 0;
		}
		sink += acc;
		l.ns[l.n++] = (uint32_t)(now_ns() - t0);
	}
	double a, b, c;
	pct(&l, 1, &a, &b, &c);
	free(l.ns);
	return b;
}

/* ---------------------------------------------------------------- baseline: tree + mutex */

struct bnode {
	uint64_t key; /* (parent id, local) mixed; 0 = empty */
	uint32_t parent;
	uint64_t local;
	uint64_t ranks;
};
static struct bnode *btab;
static uint64_t bmask;
static pthread_mutex_t bmu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t bkey(uint32_t parent, uint64_t local)
{
	return (XXH3_64bits_withSeed(&local, 8, parent) | 1);
}

/* Returns the node index of (parent, local); creates it if asked.  Context: bmu held. */
static int64_t bfind(uint32_t parent, uint64_t local, int create)
{
	uint64_t k = bkey(parent, local);
	for (uint64_t j = k & bmask;; j = (j + 1) & bmask) {
		struct bnode *n = &btab[j];
		if (!n->key) {
			if (!create)
				return -1;
			*n = (struct bnode){k, parent, local, 0};
			return (int64_t)j;
		}
		if (n->key == k && n->parent == parent && n->local == local)
			return (int64_t)j;
	}
}

static void bstore(const struct req *r, size_t from)
{
	uint32_t p = UINT32_MAX;
	for (size_t i = 0; i < r->n; i++) {
		p = (uint32_t)bfind(p, r->local[i], 1);
		if (i >= from)
			btab[p].ranks |= 1ull << r->rank;
	}
}

static void bremove(const struct req *r, size_t from)
{
	uint32_t p = UINT32_MAX;
	for (size_t i = 0; i < r->n; i++) {
		int64_t x = bfind(p, r->local[i], 0);
		if (x < 0)
			return;
		p = (uint32_t)x;
		if (i >= from)
			btab[p].ranks &= ~(1ull << r->rank);
	}
}

static size_t bmatch(const struct req *r, uint32_t *score)
{
	pthread_mutex_lock(&bmu);
	uint32_t p = UINT32_MAX;
	uint64_t active = ~0ull;
	size_t nr = 0;
	for (size_t i = 0; i < r->n && active; i++) {
		int64_t x = bfind(p, r->local[i], 0);
		if (x < 0)
			break;
		uint64_t now = active & btab[x].ranks;
		for (uint64_t d = i ? active & ~now : 0; d; d &= d - 1)
			score[nr++] = (uint32_t)i;
		active = now;
		p = (uint32_t)x;
	}
	pthread_mutex_unlock(&bmu);
	return nr + (size_t)__builtin_popcountll(active);
}

/* ---------------------------------------------------------------- threads */

struct targ {
	int id, baseline;
	struct lat lat;
	uint64_t block_ops;
	double secs;
};

static void wait_go(void)
{
	while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE))
		sched_yield();
}

static void *reader(void *a)
{
	struct targ *t = a;
	pin(t->id);
	kvr_rcu_thread_online();
	struct kvr_index_match out[RANKS];
	uint32_t score[RANKS];
	uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(t->id + 1);
	wait_go();
	uint64_t t_start = now_ns();
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
		rng = rng * 6364136223846793005ull + 1;
		const struct req *r = &reqs[(rng >> 33) % nreq];
		size_t n = 0;
		uint64_t t0 = now_ns();
		if (t->baseline) {
			n = bmatch(r, score);
		} else {
			kvr_rcu_read_lock();
			kvr_index_find_matches(idx, r->seq, r->n, NULL, out, RANKS, &n);
			kvr_rcu_read_unlock();
		}
		uint64_t t1 = now_ns();
		sink += n;
		if (t->lat.n < MAXS)
			t->lat.ns[t->lat.n++] = (uint32_t)(t1 - t0);
		t->lat.ops++;
	}
	t->secs = (double)(now_ns() - t_start) * 1e-9;
	kvr_rcu_thread_offline();
	return NULL;
}

static void *writer(void *a)
{
	struct targ *t = a;
	pin(t->id);
	kvr_rcu_thread_online();
	uint64_t rng = 12345 + (uint64_t)t->id, ops = 0;
	uint64_t *ext = malloc(65536 * sizeof(uint64_t));
	wait_go();
	uint64_t t_start = now_ns();
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
		rng = rng * 6364136223846793005ull + 1;
		const struct req *r = &reqs[(rng >> 33) % nreq];
		size_t from = r->n / 2;
		if (t->baseline) {
			pthread_mutex_lock(&bmu);
			bremove(r, from);
			bstore(r, from);
			pthread_mutex_unlock(&bmu);
		} else {
			for (size_t i = from; i < r->n; i++)
				ext[i - from] = r->b[i].ext_hash;
			kvr_index_remove(idx, slots[r->rank], ext, r->n - from, NULL);
			kvr_index_store(idx, slots[r->rank], NULL, r->b, r->n);
		}
		ops += 2 * (r->n - from);
	}
	t->secs = (double)(now_ns() - t_start) * 1e-9;
	t->block_ops = ops;
	free(ext);
	kvr_rcu_thread_offline();
	return NULL;
}

/* The writer loop without threads or clocks, a fixed number of iterations; returns block ops. */
static __attribute__((noinline)) uint64_t writer_iters(uint64_t iters)
{
	uint64_t rng = 12345, ops = 0;
	uint64_t *ext = malloc(65536 * sizeof(uint64_t));
	for (uint64_t it = 0; it < iters; it++) {
		rng = rng * 6364136223846793005ull + 1;
		const struct req *r = &reqs[(rng >> 33) % nreq];
		size_t from = r->n / 2;
		for (size_t i = from; i < r->n; i++)
			ext[i - from] = r->b[i].ext_hash;
		kvr_index_remove(idx, slots[r->rank], ext, r->n - from, NULL);
		kvr_index_store(idx, slots[r->rank], NULL, r->b, r->n);
		ops += 2 * (r->n - from);
	}
	free(ext);
	return ops;
}

/* N find_matches queries without threads or clocks; returns the query blocks walked. */
static __attribute__((noinline)) uint64_t reader_iters(uint64_t iters)
{
	struct kvr_index_match out[RANKS];
	uint64_t rng = 0x9e3779b97f4a7c15ull, blocks = 0;
	kvr_rcu_read_lock();
	for (uint64_t it = 0; it < iters; it++) {
		rng = rng * 6364136223846793005ull + 1;
		const struct req *r = &reqs[(rng >> 33) % nreq];
		size_t n = 0;
		kvr_index_find_matches(idx, r->seq, r->n, NULL, out, RANKS, &n);
		sink += n;
		blocks += r->n;
	}
	kvr_rcu_read_unlock();
	return blocks;
}

/* Runs R readers and W writers for ms; returns reader ops/s, fills percentiles. */
static double run(int nr, int nw, int baseline, double *p50, double *p99, double *p999,
                  double *wrate)
{
	pthread_t th[MAXT];
	struct targ ta[MAXT];
	memset(ta, 0, sizeof(ta));
	__atomic_store_n(&go, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&stop, 0, __ATOMIC_RELAXED);
	for (int i = 0; i < nr + nw; i++) {
		ta[i].id = i;
		ta[i].baseline = baseline;
		if (i < nr)
			ta[i].lat.ns = malloc(MAXS * sizeof(uint32_t));
		pthread_create(&th[i], NULL, i < nr ? reader : writer, &ta[i]);
	}
	__atomic_store_n(&go, 1, __ATOMIC_RELEASE);
	struct timespec ts = {(time_t)(ms / 1000), (long)(ms * 1e6) % 1000000000};
	nanosleep(&ts, NULL);
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
	double ops = 0;
	*wrate = 0;
	struct lat l[MAXT];
	for (int i = 0; i < nr + nw; i++) {
		pthread_join(th[i], NULL);
		if (i < nr) {
			ops += (double)ta[i].lat.ops / ta[i].secs;
			l[i] = ta[i].lat;
		} else {
			*wrate += (double)ta[i].block_ops / ta[i].secs / nw;
		}
	}
	pct(l, nr, p50, p99, p999);
	for (int i = 0; i < nr; i++)
		free(ta[i].lat.ns);
	return ops;
}

int main(int argc, char **argv)
{
	const char *path = NULL;
	size_t max_req = SIZE_MAX;
	uint64_t witers = 0, riters = 0;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--ms"))
			ms = opt_f64(argc, argv, i++, 1e-3, 1e9);
		else if (!strcmp(argv[i], "--max-requests"))
			max_req = (size_t)opt_u64(argc, argv, i++, 1, SIZE_MAX);
		else if (!strcmp(argv[i], "--writer-iters"))
			witers = opt_u64(argc, argv, i++, 0, UINT64_MAX);
		else if (!strcmp(argv[i], "--reader-iters"))
			riters = opt_u64(argc, argv, i++, 0, UINT64_MAX);
		else if (argv[i][0] == '-' || path) /* one trace, options before or after it */
			opt_unknown(argv, i);
		else
			path = argv[i];
	}
	int ok = -1;
	if (path)
		ok = load_trace(path, max_req);
	else if ((ok = load_trace("/work/shared/traces/mooncake/conversation_trace.jsonl",
	                          max_req)) != 0)
		ok = load_trace("data/traces/mooncake/conversation_sample.jsonl", max_req);
	if (ok != 0) {
		fprintf(stderr, "bench_index: cannot read a trace\n");
		return 1;
	}
	kvr_rcu_thread_online();
	pin(0);
	if (kvr_index_create(RANKS, &idx) != 0)
		return 1;
	for (uint32_t i = 0; i < RANKS; i++)
		kvr_index_rank_add(idx, 1000 + i, 0, &slots[i]);

	/* Load: stored events, one writer thread (this one). */
	uint64_t t0 = now_ns();
	for (size_t r = 0; r < nreq; r++)
		kvr_index_store(idx, slots[reqs[r].rank], NULL, reqs[r].b, reqs[r].n);
	double load_s = (double)(now_ns() - t0) * 1e-9;
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	double load_rate = (double)total_blocks / load_s;
	double bpb = (double)st.bytes_shared / (double)st.nodes;
	double bpc = (double)st.bytes_per_rank / (double)st.copies;
	printf("# requests=%zu blocks=%zu distinct=%lu copies=%lu load_block_ops_s=%.0f "
	       "mem_total=%lu shared=%lu per_rank=%lu\n",
	       nreq, total_blocks, (unsigned long)st.nodes, (unsigned long)st.copies, load_rate,
	       (unsigned long)kvr_index_memory_bytes(idx), (unsigned long)st.bytes_shared,
	       (unsigned long)st.bytes_per_rank);

	if (riters) {
		uint64_t t1 = now_ns();
		uint64_t nb = reader_iters(riters);
		double s = (double)(now_ns() - t1) * 1e-9;
		floor_build();
		struct lat l = {.ns = malloc(MAXS * sizeof(uint32_t))};
		struct kvr_index_match out[RANKS];
		uint64_t rng = 7;
		kvr_rcu_read_lock();
		for (uint64_t it = 0; it < riters && l.n < MAXS; it++) {
			rng = rng * 6364136223846793005ull + 1;
			const struct req *r = &reqs[(rng >> 33) % nreq];
			size_t n = 0;
			uint64_t q0 = now_ns();
			kvr_index_find_matches(idx, r->seq, r->n, NULL, out, RANKS, &n);
			l.ns[l.n++] = (uint32_t)(now_ns() - q0);
		}
		kvr_rcu_read_unlock();
		double p50, p99, p999;
		pct(&l, 1, &p50, &p99, &p999);
		free(l.ns);
		double fp99 = floor_p99();
		printf("# reader_iters=%lu blocks=%lu ns_per_query=%.0f p50_ns=%.0f p99_ns=%.0f "
		       "floor_p99_ns=%.0f ratio=%.2f\n",
		       (unsigned long)riters, (unsigned long)nb, s * 1e9 / (double)riters, p50, p99,
		       fp99, p99 / fp99);
		kvr_index_destroy(idx);
		return 0;
	}
	if (witers) {
		uint64_t t1 = now_ns();
		uint64_t ops = writer_iters(witers);
		double s = (double)(now_ns() - t1) * 1e-9;
		printf("# writer_iters=%lu block_ops=%lu apply_block_ops_s=%.0f\n",
		       (unsigned long)witers, (unsigned long)ops, (double)ops / s);
		kvr_index_destroy(idx);
		return 0;
	}
	uint64_t cap = 1;
	while (cap < total_blocks * 2)
		cap <<= 1;
	btab = calloc(cap, sizeof(*btab));
	bmask = cap - 1;
	for (size_t r = 0; r < nreq; r++)
		bstore(&reqs[r], 0);
	floor_build();

	/* Steady-state apply rate: one writer alone (removed + stored events). */
	double d1, d2, d3, solo_rate;
	run(0, 1, 0, &d1, &d2, &d3, &solo_rate);
	printf("# writer alone: apply_block_ops_s=%.0f (cold load: %.0f)\n", solo_rate, load_rate);
	for (int nw = 0; nw <= 1; nw++)
		for (int nr = 1; nr <= 2; nr++) {
			double p50, p99, p999, wr, bp50, bp99, bp999, bwr;
			double fp99 = floor_p99(); /* right before: the machine is shared */
			double ops = run(nr, nw, 0, &p50, &p99, &p999, &wr);
			double bops = run(nr, nw, 1, &bp50, &bp99, &bp999, &bwr);
			printf("SUMMARY bench=index readers=%d writers=%d p50_ns=%.0f p99_ns=%.0f "
			       "p999_ns=%.0f ops_s=%.0f floor_p99_ns=%.0f baseline_ops_s=%.0f "
			       "apply_block_ops_s=%.0f bytes_per_block=%.1f bytes_per_copy=%.1f\n",
			       nr, nw, p50, p99, p999, ops, fp99, bops, nw ? wr : solo_rate, bpb,
			       bpc);
			fflush(stdout);
		}
	kvr_index_destroy(idx);
	for (size_t r = 0; r < nreq; r++) {
		free(reqs[r].local);
		free(reqs[r].b);
	}
	free(reqs);
	free(btab);
	free(floor_tab);
	return 0;
}
