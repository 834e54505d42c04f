/*
 * stress_shard_cycle: shards calling each other synchronously (kvr_shard_call from a task on
 * another shard, as a router callback on a shard calling the API does) in random graphs while
 * outside threads call the same shards.  Each round, a random subset of the shards each runs a
 * task that waits until all of the subset are in their tasks, then calls its target (another
 * shard of the subset, or none).  Every shard of the subset is then inside its task while it
 * calls, so a cycle of targets is a cycle of waits:
 *  - a round whose target graph has a cycle must see at least one call refused (KVR_EBUSY) and
 *    must finish (before, those shards waited for good);
 *  - a round without one must see no call refused (no edge set can form a cycle), and every
 *    call answered by its target;
 *  - the outside threads' calls are never refused (they are no shard) and always answered.
 * A quarter of the callers go the way kvr_rank_add does: an intent (kvr_shard_wait_intent),
 * a refusable call, then a call that cannot be refused (kvr_shard_call_always, its rollback),
 * then the intent's end.  Between the two calls the caller posts its target a task that calls
 * the caller back: that call closes a cycle with the intent and must be refused (the intent's
 * edge stands through the first call; before, the first call's end dropped it, the late call
 * waited for the caller and the caller's second call for the late call's shard, for good).
 * The test fails if a round does not finish within 5 s.  argv[1] = duration in ms (default
 * 1500).  Exit 0 pass, 1 fail.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"
#include "shards/runtime.h"
#include "tests/common/mono_clock.h"

enum { N = 6, OUTSIDE = 2 };

static struct kvr_shards *shards;
static int stop, failed; /* atomic */

struct round {
	uint32_t k;           /* shards in the round */
	uint32_t who[N];      /* their indexes */
	int target[N];        /* per shard index: the shard it calls, -1 none */
	uint32_t delay_us[N]; /* per shard index: before its call */
	bool intent[N];       /* per shard index: calls under an intent, then calls always */
	int late_rc[N];       /* per shard index: the intent caller's target calling it back */
	int arrived, done;    /* atomic */
	int rc[N];            /* per shard index; read after done == k (acquire) */
};

static int answer(struct kvr_shard *sh, void *arg)
{
	(void)arg;
	return 100 + (int)kvr_shard_index(sh);
}

/* Posted by an intent caller to its target: calls the caller back (a cycle with the intent). */
struct late_call {
	struct round *g;
	uint32_t caller;
};

static void late_task(struct kvr_shard *sh, void *p)
{
	(void)sh;
	struct late_call lc;
	memcpy(&lc, p, sizeof(lc));
	lc.g->late_rc[lc.caller] =
	    kvr_shard_call(kvr_shards_get(shards, lc.caller), KVR_LANE_ROUTING, answer, NULL);
}

static void round_task(struct kvr_shard *sh, void *p)
{
	struct round *g;
	memcpy(&g, p, sizeof(g));
	uint32_t i = kvr_shard_index(sh);
	__atomic_add_fetch(&g->arrived, 1, __ATOMIC_SEQ_CST);
	uint64_t until = mono_ns() + 5000000000ull;
	while (__atomic_load_n(&g->arrived, __ATOMIC_SEQ_CST) < (int)g->k && mono_ns() < until)
		sched_yield();
	if (g->delay_us[i])
		sleep_us(g->delay_us[i]);
	int rc = 0;
	struct kvr_shard *t =
	    g->target[i] >= 0 ? kvr_shards_get(shards, (uint32_t)g->target[i]) : NULL;
	if (t && g->intent[i]) {
		/* Refused at the intent or at the first call (then nothing more), else both calls
		 * answered. */
		if ((rc = kvr_shard_wait_intent(t)) == 0) {
			rc = kvr_shard_call(t, KVR_LANE_ROUTING, answer, NULL);
			if (rc != KVR_EBUSY) {
				/* Lanes are FIFO: the late call has run when the second call is
				 * answered. */
				const struct late_call lc = {g, i};
				if (kvr_shard_post(t, KVR_LANE_ROUTING, late_task, &lc, sizeof(lc)))
					g->late_rc[i] = -1; /* "not KVR_EBUSY": reported */
				int again =
				    kvr_shard_call_always(t, KVR_LANE_ROUTING, answer, NULL);
				rc = again == rc ? rc : -1000 - again;
			}
			kvr_shard_wait_intent_end();
		}
	} else if (t) {
		rc = kvr_shard_call(t, KVR_LANE_ROUTING, answer, NULL);
	}
	g->rc[i] = rc;
	__atomic_add_fetch(&g->done, 1, __ATOMIC_RELEASE);
}

static bool cyclic(const struct round *g)
{
	for (uint32_t a = 0; a < g->k; a++) {
		int p = (int)g->who[a];
		for (uint32_t step = 0; step <= g->k && p >= 0; step++) {
			p = g->target[p];
			if (p == (int)g->who[a])
				return true;
		}
	}
	return false;
}

static void *outside(void *arg)
{
	uint32_t rnd = (uint32_t)(uintptr_t)arg * 2654435761u + 7;
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
		rnd = rnd * 1103515245u + 12345u;
		uint32_t s = (rnd >> 16) % N;
		int rc = kvr_shard_call(kvr_shards_get(shards, s), KVR_LANE_ROUTING, answer, NULL);
		if (rc != 100 + (int)s) {
			fprintf(stderr, "FAIL: an outside call on shard %u returned %d\n", s, rc);
			__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
		}
		sleep_us(50);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 1500;
	struct kvr_shards_config c = {0};
	c.n_shards = N;
	c.lane_capacity = 64;
	if (kvr_shards_create(&c, &shards)) {
		fprintf(stderr, "FAIL: kvr_shards_create\n");
		return 1;
	}
	pthread_t out[OUTSIDE];
	for (uintptr_t t = 0; t < OUTSIDE; t++)
		pthread_create(&out[t], NULL, outside, (void *)t);
	uint32_t rnd = 12345;
	uint64_t end = mono_ns() + ms * 1000000ull, rounds = 0, cyc = 0, refusals = 0;
	while (mono_ns() < end && !__atomic_load_n(&failed, __ATOMIC_RELAXED)) {
		struct round *g = calloc(1, sizeof(*g));
		uint32_t perm[N];
		for (uint32_t i = 0; i < N; i++)
			perm[i] = i;
		for (uint32_t i = N - 1; i > 0; i--) {
			rnd = rnd * 1103515245u + 12345u;
			uint32_t j = (rnd >> 16) % (i + 1), x = perm[i];
			perm[i] = perm[j];
			perm[j] = x;
		}
		rnd = rnd * 1103515245u + 12345u;
		g->k = 2 + (rnd >> 16) % (N - 1);
		for (uint32_t i = 0; i < N; i++) {
			g->target[i] = -1;
			g->late_rc[i] = KVR_EBUSY; /* no late call: nothing to report */
		}
		for (uint32_t a = 0; a < g->k; a++) {
			g->who[a] = perm[a];
			rnd = rnd * 1103515245u + 12345u;
			uint32_t r = rnd >> 16;
			if (r % 5 != 0) { /* calls someone of the round, not itself */
				uint32_t b = (a + 1 + (r / 5) % (g->k - 1)) % g->k;
				g->target[perm[a]] = (int)perm[b];
			}
			g->delay_us[perm[a]] = (r >> 8) % 3 ? 0 : (r >> 10) % 300;
			g->intent[perm[a]] = (r >> 4) % 4 == 0;
		}
		bool has_cycle = cyclic(g);
		struct round *p = g;
		for (uint32_t a = 0; a < g->k; a++)
			if (kvr_shard_post_wait(kvr_shards_get(shards, g->who[a]), KVR_LANE_ROUTING,
			                        round_task, &p, sizeof(p), 1000000000ull)) {
				fprintf(stderr, "FAIL: post\n");
				return 1;
			}
		uint64_t until = mono_ns() + 5000000000ull;
		while (__atomic_load_n(&g->done, __ATOMIC_ACQUIRE) < (int)g->k && mono_ns() < until)
			sleep_us(100);
		if (__atomic_load_n(&g->done, __ATOMIC_ACQUIRE) < (int)g->k) {
			fprintf(stderr, "FAIL: round %llu (%u shards, cycle %d) never finished\n",
			        (unsigned long long)rounds, g->k, has_cycle);
			_exit(1); /* shards waiting for good: no orderly teardown */
		}
		int refused = 0;
		for (uint32_t a = 0; a < g->k; a++) {
			uint32_t i = g->who[a];
			int want = g->target[i] < 0 ? 0 : 100 + g->target[i];
			if (g->late_rc[i] != KVR_EBUSY) {
				fprintf(stderr,
				        "FAIL: shard %u's target calling it back under its intent "
				        "returned %d\n",
				        i, g->late_rc[i]);
				__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
			}
			if (g->rc[i] == KVR_EBUSY && g->target[i] >= 0)
				refused++;
			else if (g->rc[i] != want) {
				fprintf(stderr, "FAIL: shard %u's call returned %d, not %d\n", i,
				        g->rc[i], want);
				__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
			}
		}
		if (has_cycle ? refused == 0 : refused != 0) {
			fprintf(stderr, "FAIL: round %llu: cycle %d, %d calls refused\n",
			        (unsigned long long)rounds, has_cycle, refused);
			__atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
		}
		rounds++;
		cyc += has_cycle;
		refusals += (uint64_t)refused;
		free(g);
	}
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
	for (int t = 0; t < OUTSIDE; t++)
		pthread_join(out[t], NULL);
	kvr_shards_destroy(shards);
	printf("stress_shard_cycle: %llu rounds, %llu with a cycle, %llu calls refused\n",
	       (unsigned long long)rounds, (unsigned long long)cyc, (unsigned long long)refusals);
	if (!failed && cyc == 0) {
		fprintf(stderr, "FAIL: no round had a cycle\n");
		return 1;
	}
	return failed ? 1 : 0;
}
