/*
 * stress_index - readers and writers on one core/index for a bounded time.
 *
 * 16 ranks (worker w, dp 0), 2 writer threads (writer t owns the ranks w % 2 == t), 2 readers.
 * 64 chain families of 24 blocks; the first 2 blocks of family k are shared by all families
 * with the same k % 4, the rest are its own.  Rank w only ever stores families k with
 * k % 8 == w % 8, with ext hash = f(rank salt, path), like an engine.  Ranks 0..7 pin their
 * own family w for the whole run (stored first, never removed); everything else churns: whole
 * families stored (sometimes split in two events through a parent), blocks removed, ranks 8..15
 * cleared and removed/re-added (new slots, reused after grace periods).
 * Readers check, inside one read section: a pinned rank scores its full chain (never less), and
 * every rank reported has a worker that may hold that family (w % 4 == k % 4 for the shared
 * prefix, w % 8 == k % 8 beyond it) - so no block is credited to a rank that never stored it,
 * even across slot reuse.  At the end all ranks are removed and no node, copy or byte remains.
 *
 * Runs under ThreadSanitizer: liburcu is uninstrumented, sync/rcu.h's annotations stand in for
 * the grace period (read unlock = release, call_rcu callback = acquire); the index uses only
 * C11 atomics otherwise.  Leaks: LeakSanitizer in the ASan build.
 * Half the time on an index with the block locator, half on one without (core/index_tops.c).
 * usage: stress_index [duration_ms]   (default 1500)
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/hash.h"
#include "core/index.h"
#include "kvrouter.h"
#include "sync/rcu.h"
#include "tests/common/xorshift.h"

enum { NR = 16, NW = 2, NRD = 2, K = 64, L = 24 };

static struct kvr_index *idx;
static uint32_t slot_of[NR]; /* atomic: current slot of rank w (UINT32_MAX while re-adding) */
static int stop, failed;
static uint64_t reads, checks, writes;

static uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

static uint64_t local_of(int k, int i)
{
	return mix(((uint64_t)(i < 2 ? k % 4 : k) << 8 | (uint64_t)i) + 12345);
}

/* Ext hash of block i of family k on rank w: odd ranks use the router's sequence hash (as the
 * approximate modes store), even ranks a hash of the path salted per rank (an engine's). */
static uint64_t ext_of(int w, int k, int i)
{
	if (w % 2) {
		uint64_t loc[L], seq[L];
		for (int j = 0; j <= i; j++)
			loc[j] = local_of(k, j);
		kvr_hash_chain_locals(NULL, loc, (size_t)i + 1, seq);
		return seq[i];
	}
	uint64_t h = 0;
	for (int j = 0; j <= i; j++)
		h = mix(h ^ local_of(k, j));
	return mix(h ^ ((uint64_t)w * 0x9e3779b97f4a7c15ull));
}

static void fail(const char *what, int k, uint32_t slot, uint32_t score)
{
	fprintf(stderr, "stress_index: FAIL %s (family %d slot %u score %u)\n", what, k, slot,
	        score);
	__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
}

static int store_family(int w, uint32_t slot, int k, uint64_t *rng)
{
	struct kvr_index_block b[L];
	for (int i = 0; i < L; i++)
		b[i] = (struct kvr_index_block){ext_of(w, k, i), local_of(k, i)};
	int cut = (int)(xorshift64(rng) % L);
	if (cut == 0 || xorshift64(rng) % 2)
		return kvr_index_store(idx, slot, NULL, b, L);
	int rc = kvr_index_store(idx, slot, NULL, b, (size_t)cut);
	if (rc)
		return rc;
	return kvr_index_store(idx, slot, &b[cut - 1].ext_hash, b + cut, (size_t)(L - cut));
}

static void *writer(void *arg)
{
	int t = (int)(intptr_t)arg;
	uint64_t rng = 0x1234567ull + (uint64_t)t * 77;
	kvr_rcu_thread_online();
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
		int w = (int)(xorshift64(&rng) % (NR / NW)) * NW + t;
		uint32_t slot = __atomic_load_n(&slot_of[w], __ATOMIC_RELAXED);
		int k = (int)(xorshift64(&rng) % (K / 8)) * 8 + w % 8;
		uint32_t op = (uint32_t)(xorshift64(&rng) % 100);
		int rc = 0;
		if (op < 45) {
			rc = store_family(w, slot, k, &rng);
		} else if (op < 90) {
			if (w < 8 && k == w)
				continue; /* the pinned family is never touched */
			uint64_t e[L];
			size_t n = 0;
			for (int i = 2; i < L; i++)
				if (xorshift64(&rng) % 3 == 0)
					e[n++] = ext_of(w, k, i);
			rc = kvr_index_remove(idx, slot, e, n, NULL);
		} else if (w >= 8 && op < 95) {
			rc = kvr_index_clear_rank(idx, slot);
		} else if (w >= 8) {
			__atomic_store_n(&slot_of[w], UINT32_MAX, __ATOMIC_RELAXED);
			rc = kvr_index_rank_remove(idx, slot);
			uint32_t ns;
			int a;
			while ((a = kvr_index_rank_add(idx, (uint64_t)w, 0, &ns)) == KVR_ERANGE)
				kvr_rcu_synchronize();
			if (a)
				rc = a;
			__atomic_store_n(&slot_of[w], ns, __ATOMIC_RELAXED);
		}
		if (rc && rc != KVR_ENOMEM)
			fail("writer call failed", k, slot, (uint32_t)-rc);
		__atomic_add_fetch(&writes, 1, __ATOMIC_RELAXED);
	}
	return NULL;
}

static void *reader(void *arg)
{
	uint64_t rng = 0xabcdefull + (uint64_t)(intptr_t)arg;
	uint64_t q[L + 1];
	struct kvr_index_match out[NR * 2];
	kvr_rcu_thread_online();
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
		int pinned = (int)(xorshift64(&rng) % 8);
		int k = xorshift64(&rng) % 2 ? pinned : (int)(xorshift64(&rng) % K);
		for (int i = 0; i < L; i++)
			q[i] = local_of(k, i);
		q[L] = xorshift64(&rng);
		size_t n;
		kvr_rcu_read_lock();
		uint64_t qs[L + 1];
		kvr_hash_chain_locals(NULL, q, L + 1, qs);
		int rc = kvr_index_find_matches(idx, qs, L + 1, NULL, out, NR * 2, &n);
		if (rc)
			fail("find_matches failed", k, 0, (uint32_t)-rc);
		bool seen_pinned = false;
		uint32_t pslot = __atomic_load_n(&slot_of[pinned], __ATOMIC_RELAXED);
		for (size_t j = 0; j < n; j++) {
			uint64_t w;
			if (out[j].score > L)
				fail("score beyond the chain", k, out[j].slot, out[j].score);
			if (k == pinned && out[j].slot == pslot) {
				seen_pinned = true;
				if (out[j].score != L)
					fail("pinned rank scored less than it holds", k,
					     out[j].slot, out[j].score);
			}
			if (kvr_index_rank_get(idx, out[j].slot, &w, NULL) != 0)
				continue; /* being removed */
			if ((int)(w % 4) != k % 4 || (out[j].score > 2 && (int)(w % 8) != k % 8))
				fail("a rank credited with blocks it never stored", k, out[j].slot,
				     out[j].score);
			__atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED);
		}
		kvr_rcu_read_unlock();
		if (k == pinned && !seen_pinned)
			fail("pinned rank missing", k, pslot, 0);
		__atomic_add_fetch(&reads, 1, __ATOMIC_RELAXED);
	}
	return NULL;
}

/* One run of ms milliseconds on a new index, with or without its block locator. */
static int run(long ms, bool locator)
{
	__atomic_store_n(&stop, 0, __ATOMIC_RELAXED);
	reads = checks = writes = 0; /* no thread of a previous run is left */
	if (kvr_index_create(NR * 2, &idx) != 0 || kvr_index_set_locator(idx, locator) != 0)
		return 1;
	uint64_t rng = 99;
	for (int w = 0; w < NR; w++) {
		if (kvr_index_rank_add(idx, (uint64_t)w, 0, &slot_of[w]) != 0)
			return 1;
		if (w < 8 && store_family(w, slot_of[w], w, &rng) != 0)
			return 1;
	}
	pthread_t th[NW + NRD];
	for (int i = 0; i < NW; i++)
		pthread_create(&th[i], NULL, writer, (void *)(intptr_t)i);
	for (int i = 0; i < NRD; i++)
		pthread_create(&th[NW + i], NULL, reader, (void *)(intptr_t)i);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
	for (int i = 0; i < NW + NRD; i++)
		pthread_join(th[i], NULL);

	for (int w = 0; w < NR; w++)
		if (kvr_index_rank_remove(idx, slot_of[w]) != 0)
			fail("final remove", 0, slot_of[w], 0);
	kvr_index_quiesce(idx);
	struct kvr_index_stats st;
	kvr_index_stats_get(idx, &st);
	if (st.nodes || st.copies || st.bytes_shared || st.bytes_per_rank)
		fail("memory left after removing every rank", (int)st.nodes, (uint32_t)st.copies,
		     (uint32_t)st.bytes_shared);
	printf("stress_index (locator %s): %lu reads, %lu rank checks, %lu writer calls, %lu "
	       "stored, %lu removed, invalid %lu, rank scans %lu: %s\n",
	       locator ? "on" : "off", (unsigned long)reads, (unsigned long)checks,
	       (unsigned long)writes, (unsigned long)st.stored_blocks,
	       (unsigned long)st.removed_blocks, (unsigned long)st.invalid,
	       (unsigned long)st.rank_scans, failed ? "FAIL" : "ok");
	kvr_index_destroy(idx);
	return failed ? 1 : 0;
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 1500;
	if (kvr_rcu_thread_online() != 0)
		return 1;
	/* Half the time with the block locator, half without (kvr_index_set_locator). */
	if (run(ms / 2, true) != 0)
		return 1;
	return run(ms - ms / 2, false);
}
