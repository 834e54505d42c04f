/*
 * stress_replica_start - kvr_replica_start while an admin thread changes the router's ranks (run
 * under TSan in CI).  Each round creates a replica for the router and starts it while the admin
 * thread removes, adds again and resets ranks at random; then the thread stops, the replica's
 * sender is drained, and its rank table must say what the router holds: every rank the router
 * has is in the table at the router's incarnation, and the table holds no rank the router lacks
 * (a removal or reset noted while the start read the ranks was overwritten by the start's older
 * read: test_replica_start forces that window; here, before, 5 mismatches within 50 to 130
 * rounds, "router lacks it, table lists it" and "router has it (incarnation 108), table lists it
 * (incarnation 102)").  Under TSan: no data race between the start and the admin calls.
 *
 * usage: stress_replica_start [rounds]   exit 0 pass, 1 fail
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h" /* the rank table */

#define RANKS 12

static struct kvr_router *r;
static atomic_int stop;
static int failures;

static int publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx;
	(void)buf;
	(void)len;
	return 0;
}

static void *admin_main(void *arg)
{
	uint64_t x = (uint64_t)(uintptr_t)arg | 1, inc = 100;
	while (!atomic_load(&stop)) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		struct kvr_rank_id id = {x % RANKS, 0};
		switch ((x >> 8) % 3) {
		case 0:
			(void)kvr_rank_remove(r, id);
			break;
		case 1:
			(void)kvr_rank_add(r, id, inc++, 1000, 4096);
			break;
		case 2:
			(void)kvr_rank_reset(r, id, inc++);
			break;
		}
	}
	return NULL;
}

static void check_round(struct kvr_replica *rep, int round)
{
	pthread_mutex_lock(&rep->mu);
	for (uint64_t w = 0; w < RANKS; w++) {
		struct kvr_rank_id id = {w, 0};
		struct kvr_rank_stats s;
		bool has = kvr_rank_get_stats(r, id, &s) == 0;
		const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
		bool listed = e != NULL;
		if (has != listed || (has && e->incarnation != s.incarnation)) {
			fprintf(stderr,
			        "stress_replica_start: round %d rank %lu: router %s (incarnation "
			        "%lu), table %s (incarnation %lu)\n",
			        round, (unsigned long)w, has ? "has it" : "lacks it",
			        has ? (unsigned long)s.incarnation : 0ul,
			        listed ? "lists it" : "not",
			        listed ? (unsigned long)e->incarnation : 0ul);
			failures++;
		}
	}
	pthread_mutex_unlock(&rep->mu);
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 200;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	if (kvr_router_create(&c, &r))
		return 1;
	for (uint64_t w = 0; w < RANKS; w++)
		if (kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 7, 1000, 4096))
			return 1;
	int port = 0;
	for (int round = 0; round < rounds && failures < 5; round++) {
		struct kvr_replica_config rc = {
		    .replica_id = 1,
		    .heartbeat_ms = 50,
		    .dead_after = 1000,
		    .snapshot_timeout_ms = 1000,
		};
		struct kvr_replica_transport t = {.ctx = &port, .publish = publish};
		struct kvr_replica *rep;
		if (kvr_replica_create(r, &rc, &t, &rep))
			return 1;
		atomic_store(&stop, 0);
		pthread_t admin;
		if (pthread_create(&admin, NULL, admin_main, (void *)(uintptr_t)(round * 7919 + 1)))
			return 1;
		int rc_ = kvr_replica_start(rep);
		atomic_store(&stop, 1);
		pthread_join(admin, NULL);
		if (rc_ || kvr_replica_wait_ready(rep, 10000)) {
			fprintf(stderr, "stress_replica_start: start %d\n", rc_);
			return 1;
		}
		/* Every note made is handled by the sender: its table is final. */
		if (kvr_replica_drain(rep, 10000)) {
			fprintf(stderr, "stress_replica_start: drain timed out\n");
			return 1;
		}
		check_round(rep, round);
		kvr_replica_stop(rep);
		kvr_replica_destroy(rep);
	}
	kvr_router_destroy(r);
	printf("stress_replica_start: %d rounds, %d mismatches\n", rounds, failures);
	return failures ? 1 : 0;
}
