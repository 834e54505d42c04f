/*
 * bench_lru - the per-rank approximate LRU at capacity pressure: acquire + release of N-block
 * requests with a few requests in flight, so every acquire evicts, with and without prefix
 * sharing (shared: the first half of each request is one of 256 common prefixes).
 * Single-threaded by design (one shard thread owns a rank).
 * Two implementations run the SAME request stream in the same process: shards/lru.c (segments
 * of consecutive copies) and the per-block LRU it replaced (tests/ref/lru_ref.c, the baseline).
 * Each SUMMARY line gives both, and the ratios seg/ref for acquire and release p50 and for
 * bytes per held block (live copies; the memory the instance holds divided by them).  The
 * floor, measured in the same run: a bare hash probe of the request's hashes in a table of the
 * same size (shards/u64map.h); acquire_ratio = segment acquire p50 / floor p50.  The two
 * implementations must evict the same number of copies (same_evictions=yes).
 * Prints one SUMMARY line per mode; never asserts timings.  A third line (bench=load) does the
 * same for the pinned set of the active load (shards/load.c vs tests/ref/load_ref.c), a fourth
 * (bench=ttl) for TTL retention (shards/ttl.c, runs, vs tests/ref/ttl_ref.c, per block).
 *
 * usage: bench_lru [--ms N per mode and implementation (default 1500)]
 *                  [--capacity BLOCKS (65536)] [--blocks N (64)] [--inflight N (8)]
 *                  [--cpu N (pin; default none)] [--only lru|load|ttl|ttl-runs]
 *                  [--turns N (TTL turns; default 12.8M / (blocks + 1), 5k-200k)]
 *                  [--clock wall|cpu (the TTL mode's per-call times; default wall)]
 * --only ttl-runs: shards/ttl.c alone (for callgrind: instructions per call of kvr_ttl_record
 * and kvr_ttl_expire), one SUMMARY line bench=ttl_runs.
 */
#include <pthread.h>
#include <stdbool.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"
#include "perf/bench_util.h"
#include "../tests/ref/load_ref.h"
#include "../tests/ref/lru_ref.h"
#include "../tests/ref/ttl_ref.h"
#include "core/alloc.h"
#include "shards/load.h"
#include "shards/lru.h"
#include "shards/ttl.h"
#include "shards/u64map.h"
#include "../tests/common/splitmix.h"

#define MAX_SAMPLES (1u << 21)

static uint64_t clock_ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The TTL mode's per-call clock: wall time, or with --clock cpu this thread's CPU time (a
 * shared machine's preemptions do not count; each reading is a system call, ~0.2 us). */
static clockid_t ttl_clock = CLOCK_MONOTONIC;

static uint64_t call_ns(void)
{
	return clock_ns(ttl_clock);
}

/* a / b, or a when b is 0 (the ratios of the SUMMARY lines). */
static double ratio(double a, double b)
{
	return a / (b > 0 ? b : 1);
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static uint32_t pct(uint32_t *v, size_t n, double p)
{
	if (n == 0)
		return 0;
	size_t i = (size_t)(p * (double)(n - 1));
	return v[i];
}

static volatile uint64_t sink;

/* One implementation under test. */
struct impl {
	const char *name;
	void *(*create)(uint64_t capacity);
	void (*destroy)(void *);
	int (*acquire)(void *, uint64_t, const struct kvr_lru_block *, size_t, uint32_t,
	               struct kvr_lru_out *);
	int (*release)(void *, uint64_t, struct kvr_lru_out *);
	void (*stats)(const void *, struct kvr_lru_stats *);
	double (*bytes_per_copy)(const void *);
};

/* The adapters of one LRU (struct pfx, functions pfx_*: kvr_lru or ref_lru, which take the same
 * arguments), as the struct impl `var` named `label`. */
#define LRU_IMPL(var, label, pfx)                                                                  \
	static void *var##_create(uint64_t cap)                                                    \
	{                                                                                          \
		struct pfx *l = NULL;                                                              \
		return pfx##_create(cap, &l) ? NULL : l;                                           \
	}                                                                                          \
	static void var##_destroy(void *l)                                                         \
	{                                                                                          \
		pfx##_destroy(l);                                                                  \
	}                                                                                          \
	static int var##_acquire(void *l, uint64_t a, const struct kvr_lru_block *b, size_t n,     \
	                         uint32_t p, struct kvr_lru_out *o)                                \
	{                                                                                          \
		return pfx##_acquire(l, a, b, n, p, o);                                            \
	}                                                                                          \
	static int var##_release(void *l, uint64_t a, struct kvr_lru_out *o)                       \
	{                                                                                          \
		return pfx##_release(l, a, o);                                                     \
	}                                                                                          \
	static void var##_stats(const void *l, struct kvr_lru_stats *st)                           \
	{                                                                                          \
		pfx##_stats(l, st);                                                                \
	}                                                                                          \
	static double var##_bpc(const void *l)                                                     \
	{                                                                                          \
		return pfx##_bytes_per_copy(l);                                                    \
	}                                                                                          \
	static const struct impl var = {label,         var##_create, var##_destroy, var##_acquire, \
	                                var##_release, var##_stats,  var##_bpc}

LRU_IMPL(SEG, "segments", kvr_lru);
LRU_IMPL(REF, "per_block", ref_lru);

/* The request stream every LRU run replays (the same for both implementations, so that their
 * evictions can be compared): chained, a shared prefix (one of 256) when shared, then unique
 * blocks. */
static void next_request(uint64_t *r, uint64_t *uniq, int shared, struct kvr_lru_block *b,
                         size_t nb)
{
	uint64_t prefix = splitmix64(r) % 256;
	for (size_t i = 0; i < nb; i++) {
		uint64_t s = (shared && i < nb / 2) ? (prefix << 20) + i + 1 : (*uniq)++;
		b[i].seq = s * 0x9E3779B97F4A7C15ull;
		b[i].local = s;
	}
}

struct result {
	double ops_s, evictions_per_acquire, bytes_per_block;
	uint32_t acq50, acq99, acq999, rel50, rel99, rel999, floor50;
	uint64_t evictions;
};

static void run(const struct impl *im, int shared, double ms, uint64_t capacity, size_t nb,
                size_t inflight, struct result *res)
{
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	void *lru = im->create(capacity);
	if (!lru)
		return;
	struct kvr_lru_block *b = malloc(nb * sizeof(*b));
	uint64_t *ring = calloc(inflight, sizeof(uint64_t));
	uint32_t *acq = malloc(MAX_SAMPLES * sizeof(uint32_t));
	uint32_t *rel = malloc(MAX_SAMPLES * sizeof(uint32_t));
	uint32_t *flo = malloc(MAX_SAMPLES * sizeof(uint32_t));
	struct kvr_u64map floor_map;
	kvr_u64map_init(&floor_map);
	kvr_u64map_reserve(&floor_map, capacity);
	uint64_t r = 42, attempt = 0, uniq = 1ull << 40;
	for (uint64_t i = 0; i < capacity; i++)
		kvr_u64map_insert(&floor_map, splitmix64(&r), 1);
	r = 7; /* the same request stream for every implementation */
	size_t na = 0, nr = 0, nf = 0;
	uint64_t warm = capacity / nb * 2, done = 0;
	uint64_t t_start = 0, t_end_target = 0;
	for (;;) {
		next_request(&r, &uniq, shared, b, nb);
		size_t slot = attempt % inflight;
		uint64_t t0, t1;
		if (ring[slot]) {
			t0 = now_ns();
			im->release(lru, ring[slot], &out);
			t1 = now_ns();
			if (done > warm && nr < MAX_SAMPLES)
				rel[nr++] = (uint32_t)(t1 - t0);
		}
		attempt++;
		t0 = now_ns();
		im->acquire(lru, attempt, b, nb, 1, &out);
		t1 = now_ns();
		ring[slot] = attempt;
		if (done > warm && na < MAX_SAMPLES)
			acq[na++] = (uint32_t)(t1 - t0);
		if (done > warm && (done & 7) == 0 && nf < MAX_SAMPLES) {
			t0 = now_ns();
			uint64_t hits = 0;
			for (size_t i = 0; i < nb; i++)
				hits += kvr_u64map_find(&floor_map, b[i].seq) != NULL;
			t1 = now_ns();
			sink += hits;
			flo[nf++] = (uint32_t)(t1 - t0);
		}
		done++;
		if (done == warm) {
			t_start = now_ns();
			t_end_target = t_start + (uint64_t)(ms * 1e6);
		}
		if (done > warm && (done & 63) == 0 && now_ns() >= t_end_target)
			break;
	}
	double secs = (double)(now_ns() - t_start) / 1e9;
	uint64_t ops = done - warm;
	qsort(acq, na, sizeof(uint32_t), cmp_u32);
	qsort(rel, nr, sizeof(uint32_t), cmp_u32);
	qsort(flo, nf, sizeof(uint32_t), cmp_u32);
	struct kvr_lru_stats st;
	im->stats(lru, &st);
	res->ops_s = (double)ops / secs;
	res->acq50 = pct(acq, na, 0.5);
	res->acq99 = pct(acq, na, 0.99);
	res->acq999 = pct(acq, na, 0.999);
	res->rel50 = pct(rel, nr, 0.5);
	res->rel99 = pct(rel, nr, 0.99);
	res->rel999 = pct(rel, nr, 0.999);
	res->floor50 = pct(flo, nf, 0.5);
	res->evictions_per_acquire = (double)st.evictions / (double)attempt;
	res->evictions = st.evictions;
	res->bytes_per_block = im->bytes_per_copy(lru);
	kvr_u64map_fini(&floor_map);
	free(acq);
	free(rel);
	free(flo);
	free(ring);
	free(b);
	im->destroy(lru);
	kvr_lru_out_fini(&out);
}

/* Evictions after the same number of requests, to check the two agree. */
static uint64_t evictions_after(const struct impl *im, int shared, uint64_t capacity, size_t nb,
                                size_t inflight, uint64_t requests)
{
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	void *lru = im->create(capacity);
	struct kvr_lru_block *b = malloc(nb * sizeof(*b));
	uint64_t *ring = calloc(inflight, sizeof(uint64_t));
	uint64_t r = 7, uniq = 1ull << 40;
	for (uint64_t attempt = 1; attempt <= requests; attempt++) {
		next_request(&r, &uniq, shared, b, nb);
		size_t slot = attempt % inflight;
		if (ring[slot])
			im->release(lru, ring[slot], &out);
		im->acquire(lru, attempt, b, nb, 1, &out);
		ring[slot] = attempt;
	}
	struct kvr_lru_stats st;
	im->stats(lru, &st);
	free(ring);
	free(b);
	im->destroy(lru);
	kvr_lru_out_fini(&out);
	return st.evictions;
}

static void mode(int shared, double ms, uint64_t capacity, size_t nb, size_t inflight)
{
	struct result s = {0}, x = {0};
	run(&SEG, shared, ms, capacity, nb, inflight, &s);
	run(&REF, shared, ms, capacity, nb, inflight, &x);
	uint64_t req = capacity / nb * 4;
	int same = evictions_after(&SEG, shared, capacity, nb, inflight, req) ==
	           evictions_after(&REF, shared, capacity, nb, inflight, req);
	printf("SUMMARY bench=lru sharing=%s blocks=%zu capacity=%llu inflight=%zu "
	       "seg_ops_s=%.0f ref_ops_s=%.0f seg_acquire_p50_ns=%u seg_acquire_p99_ns=%u "
	       "seg_acquire_p999_ns=%u ref_acquire_p50_ns=%u ref_acquire_p99_ns=%u "
	       "seg_release_p50_ns=%u seg_release_p99_ns=%u ref_release_p50_ns=%u "
	       "ref_release_p99_ns=%u evictions_per_acquire=%.1f same_evictions=%s "
	       "floor_probe_p50_ns=%u acquire_ratio=%.2f seg_bytes_per_block=%.1f "
	       "ref_bytes_per_block=%.1f acquire_p50_seg_over_ref=%.3f "
	       "release_p50_seg_over_ref=%.3f bytes_seg_over_ref=%.3f\n",
	       shared ? "yes" : "no", nb, (unsigned long long)capacity, inflight, s.ops_s, x.ops_s,
	       s.acq50, s.acq99, s.acq999, x.acq50, x.acq99, s.rel50, s.rel99, x.rel50, x.rel99,
	       s.evictions_per_acquire, same ? "yes" : "NO", s.floor50, ratio(s.acq50, s.floor50),
	       s.bytes_per_block, x.bytes_per_block, ratio(s.acq50, x.acq50),
	       ratio(s.rel50, x.rel50), ratio(s.bytes_per_block, x.bytes_per_block));
}

/*
 * The pinned set (shards/load.c, runs) against the per-block tracker it replaced
 * (tests/ref/load_ref.c) on the same stream: add (pin the prompt) + finish (unpin) of N-block
 * requests, `inflight` at once, half of each request one of 256 shared prefixes.  Prints one
 * SUMMARY line: add/finish p50 of both, their ratios, bytes per pinned block.
 */
struct load_impl {
	void *(*create)(void);
	void (*destroy)(void *);
	int (*add)(void *, uint64_t, const uint64_t *, size_t);
	int (*finish)(void *, uint64_t);
	uint64_t (*pinned)(const void *);
};
static void *ld_create(void)
{
	struct kvr_load *l = NULL;
	return kvr_load_create(0, &l) ? NULL : l;
}
static void ld_destroy(void *l)
{
	kvr_load_destroy(l);
}
static int ld_add(void *l, uint64_t a, const uint64_t *s, size_t n)
{
	return kvr_load_add(l, a, s, 1, n, 100, 0);
}
static int ld_finish(void *l, uint64_t a)
{
	return kvr_load_finish(l, a);
}
static uint64_t ld_pinned(const void *l)
{
	struct kvr_load_stats st;
	kvr_load_stats(l, &st);
	return st.active_blocks;
}
static void *lr_create(void)
{
	struct ref_load *l = NULL;
	return ref_load_create(0, &l) ? NULL : l;
}
static void lr_destroy(void *l)
{
	ref_load_destroy(l);
}
static int lr_add(void *l, uint64_t a, const uint64_t *s, size_t n)
{
	return ref_load_add(l, a, s, n, 100, 0);
}
static int lr_finish(void *l, uint64_t a)
{
	return ref_load_finish(l, a);
}
static uint64_t lr_pinned(const void *l)
{
	struct kvr_load_stats st;
	ref_load_stats(l, &st);
	return st.active_blocks;
}
static const struct load_impl LD = {ld_create, ld_destroy, ld_add, ld_finish, ld_pinned};
static const struct load_impl LR = {lr_create, lr_destroy, lr_add, lr_finish, lr_pinned};

static void load_run(const struct load_impl *im, size_t nb, size_t inflight, uint64_t ops,
                     uint32_t *add50, uint32_t *fin50, uint64_t *pinned, void **keep)
{
	void *l = im->create();
	uint64_t *seq = malloc(nb * sizeof(uint64_t));
	uint64_t *ring = calloc(inflight, sizeof(uint64_t));
	uint32_t *ad = malloc(ops * sizeof(uint32_t)), *fi = malloc(ops * sizeof(uint32_t));
	size_t na = 0, nf = 0;
	uint64_t r = 11, uniq = 1ull << 40;
	for (uint64_t a = 1; a <= ops; a++) {
		uint64_t prefix = splitmix64(&r) % 256;
		for (size_t i = 0; i < nb; i++)
			seq[i] = ((i < nb / 2) ? (prefix << 20) + i + 1 : uniq++) *
			         0x9E3779B97F4A7C15ull;
		size_t slot = a % inflight;
		uint64_t t0, t1;
		if (ring[slot]) {
			t0 = now_ns();
			im->finish(l, ring[slot]);
			t1 = now_ns();
			fi[nf++] = (uint32_t)(t1 - t0);
		}
		t0 = now_ns();
		im->add(l, a, seq, nb);
		t1 = now_ns();
		ad[na++] = (uint32_t)(t1 - t0);
		ring[slot] = a;
	}
	qsort(ad, na, sizeof(uint32_t), cmp_u32);
	qsort(fi, nf, sizeof(uint32_t), cmp_u32);
	*add50 = pct(ad, na, 0.5);
	*fin50 = pct(fi, nf, 0.5);
	*pinned = im->pinned(l);
	*keep = l; /* measured by the caller, then destroyed */
	free(ad);
	free(fi);
	free(ring);
	free(seq);
}

static void load_mode(size_t nb, size_t inflight)
{
	uint64_t ops = 20000000 / (nb + 1);
	if (ops > 200000)
		ops = 200000;
	if (ops < 200)
		ops = 200;
	uint32_t sa, sf, xa, xf;
	uint64_t sp, xp;
	void *sl, *xl;
	load_run(&LD, nb, inflight, ops, &sa, &sf, &sp, &sl);
	load_run(&LR, nb, inflight, ops, &xa, &xf, &xp, &xl);
	/* Bytes: the run tracker reports its own; the per-block one holds a map slot (16 bytes,
	 * load <= 0.7) per pinned hash plus an 8-byte copy per request block. */
	double sb = (double)kvr_load_bytes(sl) / (double)(sp ? sp : 1);
	printf("SUMMARY bench=load blocks=%zu inflight=%zu seg_add_p50_ns=%u ref_add_p50_ns=%u "
	       "seg_finish_p50_ns=%u ref_finish_p50_ns=%u add_p50_seg_over_ref=%.3f "
	       "finish_p50_seg_over_ref=%.3f same_pinned=%s seg_bytes_per_pinned_block=%.1f\n",
	       nb, inflight, sa, xa, sf, xf, ratio(sa, xa), ratio(sf, xf), sp == xp ? "yes" : "NO",
	       sb);
	LD.destroy(sl);
	LR.destroy(xl);
}

/*
 * TTL retention: shards/ttl.c (runs) against the per-block store it replaced
 * (tests/ref/ttl_ref.c) on the same session stream: 256 sessions; a turn records the session's
 * whole prompt from the root (the previous prompt and its output, a cached prefix, then
 * blocks/4 new ones; a session restarts from one of 64 shared system prompts of blocks/2
 * blocks when it would pass 4 * blocks), then 2 output blocks at their position; the virtual
 * clock advances 1 ms a turn (ttl 3 s, 100 ms buckets) and expiry runs every turn.  Prints
 * record p50 of both, expiry ns per evicted block, the mean time of a whole turn (both records and
 * the expiry: the total work, wherever it is done), bytes per held block (kvr_alloc's live
 * bytes over held blocks) and their ratios runs/ref; same_held: both hold as many blocks and
 * evicted as many.  A second line (bench=ttl_calls) gives the per-call tail, p99.9 and max of
 * every record call and of every expiry: what a routing task queued behind one call waits
 * (a table growth done in one call shows there, not in the p50).
 */
struct ttl_impl {
	void *(*create)(void);
	void (*destroy)(void *);
	int (*record)(void *, const struct kvr_lru_block *, size_t, uint32_t, uint64_t,
	              struct kvr_lru_out *);
	int (*expire)(void *, uint64_t, struct kvr_lru_out *);
	size_t (*count)(const void *);
};
/* The adapters of one TTL store (struct pfx, functions pfx_*: kvr_ttl or ref_ttl, which take
 * the same arguments; ttl 3 s), as the struct ttl_impl `var`. */
#define TTL_IMPL(var, pfx)                                                                         \
	static void *var##_create(void)                                                            \
	{                                                                                          \
		struct pfx *t = NULL;                                                              \
		return pfx##_create(3000000000ull, KVR_TTL_BUCKET_NS, &t) ? NULL : t;              \
	}                                                                                          \
	static void var##_destroy(void *t)                                                         \
	{                                                                                          \
		pfx##_destroy(t);                                                                  \
	}                                                                                          \
	static int var##_record(void *t, const struct kvr_lru_block *b, size_t n, uint32_t p,      \
	                        uint64_t now, struct kvr_lru_out *o)                               \
	{                                                                                          \
		return pfx##_record(t, b, n, p, now, o);                                           \
	}                                                                                          \
	static int var##_expire(void *t, uint64_t now, struct kvr_lru_out *o)                      \
	{                                                                                          \
		return pfx##_expire(t, now, o);                                                    \
	}                                                                                          \
	static size_t var##_count(const void *t)                                                   \
	{                                                                                          \
		return pfx##_count(t);                                                             \
	}                                                                                          \
	static const struct ttl_impl var = {var##_create, var##_destroy, var##_record,             \
	                                    var##_expire, var##_count}

TTL_IMPL(TR, kvr_ttl);
TTL_IMPL(TX, ref_ttl);

struct ttl_result {
	uint32_t rec50, rec999, recmax, exp999, expmax;
	double expire_ns_per_block, bytes_per_block, turn_ns;
	size_t held;
	uint64_t evicted;
	struct kvr_ttl_stats st; /* shards/ttl.c only */
};

static uint64_t chain_next(uint64_t parent, uint64_t token)
{
	uint64_t s = parent ^ (token * 0xD6E8FEB86659FD93ull);
	return splitmix64(&s);
}

static void ttl_run(const struct ttl_impl *im, size_t nb, uint64_t turns, struct ttl_result *res)
{
	enum { SESSIONS = 256 };
	size_t maxlen = 4 * nb + 2;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	int64_t base = kvr_alloc_live_bytes();
	void *t = im->create();
	uint64_t *ses = calloc(SESSIONS * maxlen, sizeof(uint64_t));
	size_t *len = calloc(SESSIONS, sizeof(size_t));
	struct kvr_lru_block *b = malloc(maxlen * sizeof(*b));
	uint32_t *rec = malloc(turns * sizeof(uint32_t)), *rec2 = malloc(turns * sizeof(uint32_t));
	uint32_t *exp = malloc(turns * sizeof(uint32_t));
	uint64_t r = 5, uniq = 1, now = 0, exp_ns = 0, all_ns = 0;
	res->evicted = 0;
	for (uint64_t turn = 0; turn < turns; turn++) {
		size_t s = splitmix64(&r) % SESSIONS, add = nb / 4 ? nb / 4 : 1;
		uint64_t *q = ses + s * maxlen;
		if (len[s] == 0 || len[s] + add + 2 > maxlen) {
			uint64_t sys = splitmix64(&r) % 64, h = 0;
			for (len[s] = 0; len[s] < nb / 2; len[s]++)
				q[len[s]] = h = chain_next(h, (sys << 20) + len[s] + 1);
		}
		for (size_t i = 0; i < add; i++, len[s]++)
			q[len[s]] = chain_next(len[s] ? q[len[s] - 1] : 0, (uniq++) << 8);
		for (size_t i = 0; i < len[s]; i++)
			b[i] = (struct kvr_lru_block){.local = i, .seq = q[i]};
		uint64_t t0 = call_ns();
		im->record(t, b, len[s], 0, now, &out);
		rec[turn] = (uint32_t)(call_ns() - t0);
		all_ns += rec[turn];
		for (size_t i = 0; i < 2; i++, len[s]++) {
			q[len[s]] = chain_next(q[len[s] - 1], (uniq++) << 8);
			b[i] = (struct kvr_lru_block){.local = i, .seq = q[len[s]]};
		}
		t0 = call_ns();
		im->record(t, b, 2, (uint32_t)(len[s] - 2), now, &out);
		rec2[turn] = (uint32_t)(call_ns() - t0);
		all_ns += rec2[turn];
		now += 1000000;
		t0 = call_ns();
		im->expire(t, now, &out);
		exp[turn] = (uint32_t)(call_ns() - t0);
		exp_ns += exp[turn];
		all_ns += exp[turn];
		res->evicted += out.n_evicted;
	}
	qsort(rec, turns, sizeof(uint32_t), cmp_u32);
	res->rec50 = pct(rec, turns, 0.5);
	/* Per call, both records of a turn (the prompt and the output blocks) together. */
	uint32_t *all = malloc(2 * turns * sizeof(uint32_t));
	memcpy(all, rec, turns * sizeof(uint32_t));
	memcpy(all + turns, rec2, turns * sizeof(uint32_t));
	qsort(all, 2 * turns, sizeof(uint32_t), cmp_u32);
	res->rec999 = pct(all, 2 * turns, 0.999);
	res->recmax = all[2 * turns - 1];
	qsort(exp, turns, sizeof(uint32_t), cmp_u32);
	res->exp999 = pct(exp, turns, 0.999);
	res->expmax = exp[turns - 1];
	free(all);
	res->expire_ns_per_block = (double)exp_ns / (double)(res->evicted ? res->evicted : 1);
	res->turn_ns = (double)all_ns / (double)turns;
	res->held = im->count(t);
	if (im == &TR)
		kvr_ttl_stats(t, &res->st);
	int64_t outb =
	    (int64_t)(out.cap_stored_runs * sizeof(*out.stored) +
	              out.cap_evicted * sizeof(uint64_t) + out.cap_evicted_runs * sizeof(uint32_t));
	res->bytes_per_block =
	    (double)(kvr_alloc_live_bytes() - base - outb) / (double)(res->held ? res->held : 1);
	im->destroy(t);
	kvr_lru_out_fini(&out);
	free(exp);
	free(rec2);
	free(rec);
	free(b);
	free(len);
	free(ses);
}

static void ttl_mode(size_t nb, uint64_t turns, bool ref)
{
	if (turns == 0) {
		turns = 12800000 / (nb + 1);
		if (turns > 200000)
			turns = 200000;
		if (turns < 5000)
			turns = 5000;
	}
	struct ttl_result a, x;
	ttl_run(&TR, nb, turns, &a);
	if (!ref) { /* --ttl-runs-only: one implementation (callgrind counts) */
		printf("SUMMARY bench=ttl_runs blocks=%zu turns=%llu record_p50_ns=%u "
		       "record_p999_ns=%u record_max_ns=%u expire_p999_ns=%u expire_max_ns=%u "
		       "bytes_per_held_block=%.1f held=%zu map_slots=%zu map_growths=%llu "
		       "max_migration_units_per_call=%zu\n",
		       nb, (unsigned long long)turns, a.rec50, a.rec999, a.recmax, a.exp999,
		       a.expmax, a.bytes_per_block, a.held, a.st.map_slots,
		       (unsigned long long)a.st.growths, a.st.max_step_units);
		return;
	}
	ttl_run(&TX, nb, turns, &x);
	printf(
	    "SUMMARY bench=ttl blocks=%zu turns=%llu runs_record_p50_ns=%u ref_record_p50_ns=%u "
	    "record_p50_runs_over_ref=%.3f runs_expire_ns_per_block=%.1f "
	    "ref_expire_ns_per_block=%.1f expire_runs_over_ref=%.3f runs_bytes_per_held_block=%.1f "
	    "ref_bytes_per_held_block=%.1f bytes_runs_over_ref=%.3f runs_turn_mean_ns=%.0f "
	    "ref_turn_mean_ns=%.0f turn_runs_over_ref=%.3f held=%zu same_held=%s\n",
	    nb, (unsigned long long)turns, a.rec50, x.rec50, ratio(a.rec50, x.rec50),
	    a.expire_ns_per_block, x.expire_ns_per_block,
	    a.expire_ns_per_block / x.expire_ns_per_block, a.bytes_per_block, x.bytes_per_block,
	    a.bytes_per_block / x.bytes_per_block, a.turn_ns, x.turn_ns, a.turn_ns / x.turn_ns,
	    a.held, a.held == x.held && a.evicted == x.evicted ? "yes" : "NO");
	/* Per call (every record, every expiry): the latency a shard's queue sees behind one
	 * call, e.g. a table growth done at once. */
	printf("SUMMARY bench=ttl_calls blocks=%zu turns=%llu runs_record_p999_ns=%u "
	       "runs_record_max_ns=%u ref_record_p999_ns=%u ref_record_max_ns=%u "
	       "record_max_runs_over_ref=%.3f runs_expire_p999_ns=%u runs_expire_max_ns=%u "
	       "ref_expire_p999_ns=%u ref_expire_max_ns=%u expire_max_runs_over_ref=%.3f\n",
	       nb, (unsigned long long)turns, a.rec999, a.recmax, x.rec999, x.recmax,
	       ratio(a.recmax, x.recmax), a.exp999, a.expmax, x.exp999, x.expmax,
	       ratio(a.expmax, x.expmax));
}

int main(int argc, char **argv)
{
	double ms = 1500;
	uint64_t capacity = 65536;
	size_t nb = 64, inflight = 8;
	int cpu = -1;
	const char *only = NULL;
	uint64_t turns = 0;
	for (int i = 1; i < argc; i += 2) {
		const char *v = opt_str(argc, argv, i);
		if (!strcmp(argv[i], "--ms"))
			ms = opt_f64(argc, argv, i, 1e-3, 1e9);
		else if (!strcmp(argv[i], "--capacity"))
			capacity = opt_u64(argc, argv, i, 1, 1ull << 40);
		else if (!strcmp(argv[i], "--blocks"))
			nb = opt_u64(argc, argv, i, 1, 1u << 24);
		else if (!strcmp(argv[i], "--inflight"))
			inflight = opt_u64(argc, argv, i, 1, 1u << 24);
		else if (!strcmp(argv[i], "--cpu"))
			cpu = (int)opt_u64(argc, argv, i, 0, CPU_SETSIZE - 1);
		else if (!strcmp(argv[i], "--only") &&
		         (!strcmp(v, "lru") || !strcmp(v, "load") || !strcmp(v, "ttl") ||
		          !strcmp(v, "ttl-runs")))
			only = v;
		else if (!strcmp(argv[i], "--only"))
			opt_bad(argv, i, "lru, load, ttl or ttl-runs", v);
		else if (!strcmp(argv[i], "--turns"))
			turns = opt_u64(argc, argv, i, 0, 1ull << 40);
		else if (!strcmp(argv[i], "--clock") && (!strcmp(v, "cpu") || !strcmp(v, "wall")))
			ttl_clock = !strcmp(v, "cpu") ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
		else if (!strcmp(argv[i], "--clock"))
			opt_bad(argv, i, "cpu or wall", v);
		else
			opt_unknown(argv, i);
	}
	if (nb == 0 || inflight == 0 || capacity < nb * inflight) {
		fprintf(stderr, "need blocks > 0, inflight > 0, capacity >= blocks * inflight\n");
		return 2;
	}
	if (cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	if (!only || !strcmp(only, "lru")) {
		mode(0, ms, capacity, nb, inflight);
		mode(1, ms, capacity, nb, inflight);
	}
	if (!only || !strcmp(only, "load"))
		load_mode(nb, inflight);
	if (!only || !strcmp(only, "ttl") || !strcmp(only, "ttl-runs"))
		ttl_mode(nb, turns, !only || strcmp(only, "ttl-runs"));
	return 0;
}
