/*
 * bench_hashstage - kvr_route's hashing stage against its floor, without the rest of the route.
 *
 * The question: what does hashing a prompt into an attempt record (the lines another core, the
 * booking shard, last read) cost against kvr_hash_blocks into a warm buffer, and which way of
 * writing the record costs least?  kvr_route hashes the prompt's first HEAD blocks into its
 * scratch while the pool's line comes in, takes a record, then hashes the rest into the record
 * with streaming stores (core/hash.h) while keeping the sequence hashes in its scratch.
 *
 * One frontend thread (pinned to --cpus' first CPU) and one "shard" thread (the second CPU):
 * records come from a LIFO stack of --records records (the router's pool is one: the record
 * taken is the one the shard gave back last), are handed to the shard through a ring after each
 * hashing, and the shard reads every (local, seq) pair, as a booking does, before it gives the
 * record back.  Per iteration the variants run in turn on the same prompt (so a regime change of
 * the machine hits them all), each after the shard has given back every record (its reads do
 * not overlap the span), each timed with the TSC (lfence; rdtsc ... rdtscp):
 *   floor       kvr_hash_blocks into two warm arrays (the floor);
 *   route       what kvr_route does: asks for the stack's line and its top's (as
 *               kvr_owner_attempt_prefetch), the first HEAD blocks into the scratch
 *               (kvr_hash_chain_tokens), the take, the head's pairs streamed
 *               (kvr_hash_pairs_stream_part), the rest streamed into the record with the
 *               sequence hashes kept in the scratch (kvr_hash_chain_tokens_stream_part);
 *   route_line  the same, the top's address read from the stack's own line (which the shard
 *               writes at every give), as kvr_owner_attempt_prefetch did before hashstage:
 *               the prefetch waits for that load, and the hashing behind it for the prefetch;
 *   ordinary    hashed into the scratch, then the pairs copied into the record with
 *               ordinary stores (each store first takes its line back from the shard's core).
 * The take from the stack and the ring post are outside the timed span, except the routes'
 * take, which sits where kvr_route has it (a locked exchange on a line the shard wrote).
 * Built against another tree's library (the same source), "route" is that tree's hashing stage:
 * alternate two binaries for an A/B of core/hash.c.
 *
 * SUMMARY per prompt length: each variant's p50 in TSC ticks and its ratio to the floor's p50.
 *
 * usage: bench_hashstage [--iters N] [--lengths 2048,8192] [--cpus F,S] [--records N]
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/hash.h"
#include "kvrouter.h"
#include "perf/bench_util.h"

#if !defined(__x86_64__)
int main(void)
{
	printf("bench_hashstage: x86-64 only (TSC timing)\n");
	return 0;
}
#else
#include <x86intrin.h>

#define HEAD     32 /* core/route.c HEAD_BLOCKS */
#define RING     1024
#define VARIANTS 4

static const char *const names[VARIANTS] = {"floor", "route", "route_line", "ordinary"};

/* The record stack (a try-lock as the pool's) and the ring to the shard. */
struct rec_stack {
	_Atomic uint32_t lock;
	uint32_t n;
	uint64_t **rec;
};
static struct rec_stack stack __attribute__((aligned(64)));
static _Atomic(uint64_t *) ring[RING];
static _Atomic uint32_t ring_head, ring_tail;
static atomic_int stop;
static _Atomic uint64_t given; /* records the shard has read and given back */
static uint64_t posted;        /* records handed to the shard (the frontend's count) */
static size_t n_blocks;
static int cpus[2] = {1, 0};
static volatile uint64_t sink;
/* stack.rec again, on a line of its own that nobody writes */
static struct {
	uint64_t **base;
	char pad[64 - sizeof(uint64_t **)];
} ro __attribute__((aligned(64)));

static void lock(void)
{
	while (atomic_exchange_explicit(&stack.lock, 1, memory_order_acquire))
		_mm_pause();
}

static void unlock(void)
{
	atomic_store_explicit(&stack.lock, 0, memory_order_release);
}

static void give(uint64_t *r)
{
	lock();
	stack.rec[stack.n++] = r;
	unlock();
}

static uint64_t *take(void)
{
	for (;;) {
		lock();
		uint64_t *r = stack.n ? stack.rec[--stack.n] : NULL;
		unlock();
		if (r)
			return r;
		_mm_pause();
	}
}

/* The shard: reads every pair of each record posted, as a booking does, and gives it back. */
static void *shard(void *arg)
{
	(void)arg;
	pin(cpus[1]);
	uint64_t s = 0;
	for (;;) { /* until stopped with the ring empty: every record back on the stack */
		bool stopping = atomic_load_explicit(&stop, memory_order_acquire);
		uint32_t t = atomic_load_explicit(&ring_tail, memory_order_relaxed);
		if (t == atomic_load_explicit(&ring_head, memory_order_acquire)) {
			if (stopping)
				break;
			_mm_pause();
			continue;
		}
		uint64_t *r = atomic_load_explicit(&ring[t % RING], memory_order_relaxed);
		atomic_store_explicit(&ring_tail, t + 1, memory_order_release);
		for (size_t i = 0; i < 2 * n_blocks; i++)
			s += r[i];
		give(r);
		atomic_fetch_add_explicit(&given, 1, memory_order_release);
	}
	sink += s;
	return NULL;
}

static void post(uint64_t *r)
{
	uint32_t h = atomic_load_explicit(&ring_head, memory_order_relaxed);
	while (h - atomic_load_explicit(&ring_tail, memory_order_acquire) >= RING - 1)
		_mm_pause();
	atomic_store_explicit(&ring[h % RING], r, memory_order_relaxed);
	atomic_store_explicit(&ring_head, h + 1, memory_order_release);
}

/* Hashed into the scratch (seq[0..n), local at seq[n..2n)), the pairs copied into out[] with
 * ordinary stores. */
static void hash_ordinary(const uint32_t *tok, size_t n, uint64_t *out, uint64_t *seq)
{
	kvr_hash_blocks(tok, n * 16, 16, NULL, seq + n, seq);
	for (size_t i = 0; i < n; i++) {
		out[2 * i] = seq[n + i];
		out[2 * i + 1] = seq[i];
	}
}

static void run(size_t tokens, size_t iters, size_t records)
{
	n_blocks = tokens / 16;
	const size_t nb = n_blocks, head = nb < HEAD ? nb : HEAD;
	uint32_t *tok = malloc(tokens * sizeof(*tok));
	uint64_t *fl = malloc(nb * 8), *fs = malloc(nb * 8);
	uint64_t *sl = malloc(nb * 8), *ss = malloc(2 * nb * 8); /* the route's scratch */
	uint64_t *t[VARIANTS];
	stack.rec = malloc(records * sizeof(*stack.rec));
	if (!tok || !fl || !fs || !sl || !ss || !stack.rec) {
		fprintf(stderr, "bench_hashstage: out of memory\n");
		exit(1);
	}
	for (size_t i = 0; i < tokens; i++)
		tok[i] = (uint32_t)(i * 2654435761u) & 0x7ffff;
	for (size_t i = 0; i < records; i++) {
		stack.rec[i] = aligned_alloc(64, (2 * nb * 8 + 63) & ~(size_t)63);
		memset(stack.rec[i], 0, 2 * nb * 8);
	}
	stack.n = (uint32_t)records;
	ro.base = stack.rec;
	const size_t top_hint = records - 1;
	for (int v = 0; v < VARIANTS; v++)
		t[v] = malloc(iters * sizeof(uint64_t));
	atomic_store(&stop, 0);
	atomic_store(&given, 0);
	posted = 0;
	pthread_t th;
	pthread_create(&th, NULL, shard, NULL);
	pin(cpus[0]);
	const uint64_t seed = kvr_hash_lora_seed(NULL);
	for (size_t it = 0; it < iters; it++) {
		for (int v = 0; v < VARIANTS; v++) {
			/* The shard done with every record: its reads of the last one (whose lines
			 * this core may hold) do not overlap the next variant's span. */
			while (atomic_load_explicit(&given, memory_order_acquire) != posted)
				_mm_pause();
			uint64_t s = 0;
			for (size_t i = 0; i < tokens; i += 16) /* warm tokens, as bench_route's */
				s += tok[i];
			sink += s;
			uint64_t *r = v == 3 ? take() : NULL;
			unsigned aux;
			_mm_lfence();
			uint64_t a = __rdtsc();
			switch (v) {
			case 0:
				kvr_hash_blocks(tok, tokens, 16, NULL, fl, fs);
				break;
			case 1: /* the stack's address from a line nobody writes */
			case 2: /* ... from the stack's own line, which the shard writes */
				__builtin_prefetch(&stack, 1, 3);
				__builtin_prefetch(&(v == 1 ? ro.base : stack.rec)[top_hint], 0, 3);
				kvr_hash_chain_tokens(NULL, tok, head, 16, seed, sl, ss);
				r = take();
				kvr_hash_pairs_stream_part(sl, ss, head, r);
				kvr_hash_chain_tokens_stream_part(&ss[head - 1], tok + head * 16,
				                                  nb - head, 16, seed, r + 2 * head,
				                                  NULL, ss + head);
				break;
			case 3:
				hash_ordinary(tok, nb, r, ss);
				break;
			}
			uint64_t b = __rdtscp(&aux);
			t[v][it] = b - a;
			kvr_hash_stream_fence();
			if (r) {
				post(r);
				posted++;
			}
		}
	}
	atomic_store(&stop, 1);
	pthread_join(th, NULL);
	if (stack.n != records) {
		fprintf(stderr, "bench_hashstage: %u of %zu records came back\n", stack.n, records);
		exit(1);
	}
	uint64_t p50[VARIANTS];
	for (int v = 0; v < VARIANTS; v++) {
		qsort(t[v], iters, sizeof(uint64_t), cmp_u64);
		p50[v] = t[v][iters / 2];
	}
	printf("SUMMARY bench=hashstage tokens=%zu blocks=%zu iters=%zu records=%zu", tokens, nb,
	       iters, records);
	for (int v = 0; v < VARIANTS; v++)
		printf(" %s_p50_tsc=%llu", names[v], (unsigned long long)p50[v]);
	for (int v = 1; v < VARIANTS; v++)
		printf(" %s_ratio=%.3f", names[v], (double)p50[v] / (double)p50[0]);
	printf("\n");
	for (size_t i = 0; i < records; i++)
		free(stack.rec[i]);
	free(stack.rec);
	for (int v = 0; v < VARIANTS; v++)
		free(t[v]);
	free(tok);
	free(fl);
	free(fs);
	free(sl);
	free(ss);
}

int main(int argc, char **argv)
{
	size_t iters = 20000, records = 64;
	uint64_t lengths[16] = {2048, 8192};
	size_t n_lengths = 2;
	for (int i = 1; i < argc; i += 2) {
		if (!strcmp(argv[i], "--iters"))
			iters = opt_u64(argc, argv, i, 2, 1000000000);
		else if (!strcmp(argv[i], "--records"))
			records = opt_u64(argc, argv, i, 2, 1000000);
		else if (!strcmp(argv[i], "--lengths"))
			n_lengths = opt_list(argc, argv, i, 0, 1u << 24, lengths, 16);
		else if (!strcmp(argv[i], "--cpus")) {
			uint64_t c[2] = {(uint64_t)cpus[0], (uint64_t)cpus[1]};
			opt_list(argc, argv, i, 0, 4095, c, 2); /* one: the shard's stays */
			cpus[0] = (int)c[0];
			cpus[1] = (int)c[1];
		} else
			opt_unknown(argv, i);
	}
	for (size_t k = 0; k < n_lengths; k++)
		if (lengths[k] >= 16 * 2)
			run(lengths[k], iters, records);
	return 0;
}
#endif
