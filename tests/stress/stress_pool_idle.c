/*
 * stress_pool_idle - the recycled attempt records (shards/owner_attempts.c) given back by an idle
 * shard (kvr_owner_shard_idle, 100 ms after its last task) while other threads take records from
 * the pool and shards put them back.  Two frontends route prompts of 64..1024 blocks (pooled size
 * classes) to ranks on two shards in bursts separated by pauses of 0-250 ms, so a shard whose
 * ranks got nothing for 100 ms empties the pool while the other frontend's routes reserve from
 * it and the other shard returns records.  At the end every attempt has finished, every rank's
 * load is zero, and once the router has been idle the pool holds nothing (its byte count back to
 * the empty pool's: every record counted in was counted out).  Run under TSan in CI.
 *
 * usage: stress_pool_idle [duration_ms (2000)]   exit 0 pass, 1 fail
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvrouter.h"

#define FRONTENDS 2
#define RANKS     4
#define MAX_TOK   (1024 * 16)

static struct kvr_router *router;
static uint64_t deadline_ns;
static atomic_int failed;

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(uint64_t ms)
{
	struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static void *frontend(void *arg)
{
	uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(uintptr_t)arg + 1;
	static _Thread_local uint32_t tok[MAX_TOK];
	while (now_ns() < deadline_ns && !failed) {
		int burst = 1 + (int)(s % 8);
		for (int b = 0; b < burst; b++) {
			s ^= s << 13, s ^= s >> 7, s ^= s << 17;
			size_t n = (64u << (s % 5)) * 16u; /* 64..1024 blocks */
			for (size_t i = 0; i < n; i++)
				tok[i] = (uint32_t)(s >> 20) + (uint32_t)i;
			struct kvr_request q;
			kvr_request_init(&q);
			q.tokens = tok;
			q.n_tokens = n;
			struct kvr_decision d;
			int rc = kvr_route(router, &q, &d);
			if (rc == KVR_EAGAIN)
				continue;
			if (rc || d.status != KVR_DECIDED) {
				fprintf(stderr, "route: %s\n", kvr_strerror(rc));
				failed = 1;
				break;
			}
			if ((rc = kvr_request_finish(router, d.attempt))) {
				fprintf(stderr, "finish: %s\n", kvr_strerror(rc));
				failed = 1;
				break;
			}
		}
		sleep_ms(s % 251); /* long enough, often, for a shard's idle trim */
	}
	return NULL;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	if (kvr_router_create(&c, &router))
		return 1;
	for (uint64_t w = 0; w < RANKS; w++)
		if (kvr_rank_add(router, (struct kvr_rank_id){w, 0}, 1, 1u << 20, 0))
			return 1;
	struct kvr_memory m0, m1;
	if (kvr_router_get_memory(router, &m0))
		return 1;
	deadline_ns = now_ns() + ms * 1000000ull;
	pthread_t t[FRONTENDS];
	for (uintptr_t i = 0; i < FRONTENDS; i++)
		pthread_create(&t[i], NULL, frontend, (void *)(i + 1));
	for (int i = 0; i < FRONTENDS; i++)
		pthread_join(t[i], NULL);
	if (kvr_router_sync(router, 60000))
		failed = 1;
	for (uint64_t w = 0; w < RANKS && !failed; w++) {
		struct kvr_rank_stats st;
		if (kvr_rank_get_stats(router, (struct kvr_rank_id){w, 0}, &st) ||
		    st.active_requests || st.active_blocks || st.active_prefill_tokens) {
			fprintf(stderr, "rank %llu: load left\n", (unsigned long long)w);
			failed = 1;
		}
	}
	/* Idle: each shard empties the pool 100 ms after its last task (a reading is a task). */
	for (int i = 0; i < 40 && !failed; i++) {
		sleep_ms(250);
		if (kvr_router_get_memory(router, &m1))
			failed = 1;
		else if (m1.attempt_pool == m0.attempt_pool)
			break;
	}
	if (!failed && m1.attempt_pool != m0.attempt_pool) {
		fprintf(stderr, "pool bytes %llu, empty %llu\n",
		        (unsigned long long)m1.attempt_pool, (unsigned long long)m0.attempt_pool);
		failed = 1;
	}
	kvr_router_destroy(router);
	printf("stress_pool_idle: %s\n", failed ? "FAIL" : "ok");
	return failed ? 1 : 0;
}
