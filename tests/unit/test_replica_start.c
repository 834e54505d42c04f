/*
 * kvr_replica_start announces the ranks its router holds already (an add each, in its rank table
 * and to the peers), reading them while the router's own rank changes go on: those are noted
 * (the hooks are installed first) and pushed to the replica's sender as they land.  A change
 * landing after the start read a rank but before it pushed that rank's add went out first, and
 * the start's older add then came after it with a newer version: a rank removed meanwhile was
 * told added (the peers added it, the table served it), a reset's incarnation was overwritten
 * by the one read before it.
 *
 * The window is forced: kvr_rank_get_stats is wrapped (ld --wrap, tests/meson.build) to do what
 * another thread's admin call would do right after the start's real read of rank 3 returned:
 * remove it, or reset it to a new incarnation.  Over the in-process bus
 * (tests/unit/replica_bus.h), replica 2 listening.
 */
#include "sync/replica_internal.h"
#include "tests/unit/replica_bus.h"

int __real_kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                              struct kvr_rank_stats *out);
int __wrap_kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                              struct kvr_rank_stats *out);

enum change { NONE, REMOVE, RESET };
static enum change armed;
static pthread_t armed_on; /* the start's thread: the peers' apply threads read stats too */
static bool fired;
static const struct kvr_rank_id three = {3, 0};

int __wrap_kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                              struct kvr_rank_stats *out)
{
	int rc = __real_kvr_rank_get_stats(r, rank, out);
	if (armed != NONE && pthread_equal(pthread_self(), armed_on) &&
	    rank.worker_id == three.worker_id && rc == 0) {
		enum change c = armed;
		armed = NONE;
		fired = true;
		if (c == REMOVE)
			cr_assert_eq(kvr_rank_remove(r, three), 0);
		else
			cr_assert_eq(kvr_rank_reset(r, three, 9), 0);
	}
	return rc;
}

static bool has_rank(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	return __real_kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s) == 0;
}

static uint64_t incarnation(struct kvr_router *r, uint64_t w)
{
	struct kvr_rank_stats s;
	cr_assert_eq(__real_kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &s), 0);
	return s.incarnation;
}

/* Replica 2 (port 1) ready with the bus's two ranks; replica 1 (port 0) created for a router that
 * holds rank 3 too, and started with change c armed.  r[0] is replica 1's router. */
static void start_with(struct kvr_router **r, enum change c)
{
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	cr_assert_eq(kvr_rank_add(r[0], three, 7, 1000, 4096), 0);
	bus_create_as(0, r[0], 1);
	armed_on = pthread_self();
	fired = false;
	armed = c;
	cr_assert_eq(kvr_replica_start(bus.rep[0]), 0);
	armed = NONE;
	cr_assert(fired, "the start did not read rank 3's stats: the test missed its window");
	cr_assert_eq(kvr_replica_wait_ready(bus.rep[0], 10000), 0);
	bus_quiet(r, 2);
	bus_quiet(r, 2);
}

Test(replica_start, a_rank_removed_while_the_replica_starts_is_not_announced, .timeout = 60)
{
	struct kvr_router *r[2];
	start_with(r, REMOVE);
	cr_assert(!has_rank(r[0], 3));
	pthread_mutex_lock(&bus.rep[0]->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(bus.rep[0], three);
	bool listed = e != NULL;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert(!listed, "replica 1's table holds rank 3, which its router removed");
	cr_assert(!has_rank(r[1], 3), "the peer added rank 3, removed while replica 1 started");
	bus_teardown(r, 2);
}

Test(replica_start, a_rank_reset_while_the_replica_starts_keeps_its_new_incarnation, .timeout = 60)
{
	struct kvr_router *r[2];
	start_with(r, RESET);
	cr_assert_eq(incarnation(r[0], 3), 9);
	pthread_mutex_lock(&bus.rep[0]->mu);
	const struct kvr_rep_rank *e = kvr_rep_rank_find(bus.rep[0], three);
	uint64_t inc = e ? e->incarnation : 0;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert_eq(inc, 9, "replica 1's table holds rank 3 at incarnation %lu, its router at 9",
	             (unsigned long)inc);
	cr_assert(has_rank(r[1], 3));
	cr_assert_eq(incarnation(r[1], 3), 9, "the peer holds rank 3 at incarnation %lu, not 9",
	             (unsigned long)incarnation(r[1], 3));
	bus_teardown(r, 2);
}

/* A router holding more than 256 ranks when its replica starts: the start read the first 256
 * only (a fixed array), so the rest were never announced, and a peer never had them. */
Test(replica_start, every_rank_is_announced_past_256, .timeout = 60)
{
	struct kvr_router *r[2];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	for (uint64_t w = 2; w < 300; w++)
		cr_assert_eq(kvr_rank_add(r[0], (struct kvr_rank_id){w, 0}, 7, 1000, 4096), 0);
	bus_attach(0, r[0]);
	bus_quiet(r, 2);
	uint64_t missing = 0, first = 0;
	for (uint64_t w = 300; w-- > 0;)
		if (!has_rank(r[1], w)) {
			missing++;
			first = w;
		}
	cr_assert_eq(missing, 0, "the peer lacks %lu of the 300 ranks (worker %lu first)",
	             (unsigned long)missing, (unsigned long)first);
	bus_teardown(r, 2);
}
