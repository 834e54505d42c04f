/*
 * tests/unit/bus_hog.h - two queueing routers on the replica bus (replica_bus.h), A's request
 * holding rank X on both, B's own request waiting: A's finish, applied by B's replica apply
 * thread, admits B's request and runs B's on_admit on that thread.  The tests of what a
 * router callback there may call (test_destroy_callbacks, test_feed_crossdestroy,
 * test_feed_replicawait) share it.
 */
#ifndef KVR_TESTS_UNIT_BUS_HOG_H
#define KVR_TESTS_UNIT_BUS_HOG_H

#include <criterion/criterion.h>
#include <string.h>

#include "kvrouter.h"
#include "tests/common/pinned_router.h"
#include "tests/unit/replica_bus.h"

/* r[0] = A, r[1] = B (its on_admit on_admit_b), both queue_router()s attached to the bus. */
static inline void bus_hog_pair(struct kvr_router **r,
                                void (*on_admit_b)(void *, uint64_t, const struct kvr_decision *))
{
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[0] = queue_router(NULL);
	r[1] = queue_router(on_admit_b);
	bus_attach(0, r[0]);
	bus_attach(1, r[1]);
}

/* A's 200-token request, mirrored on B, saturates X there: B's own request waits.  Returns A's
 * attempt, whose finish admits B's. */
static inline uint64_t bus_hog(struct kvr_router **r)
{
	struct kvr_decision hog, q;
	cr_assert_eq(route_pinned(r[0], 1, 200, &hog), 0);
	cr_assert_eq(hog.status, KVR_DECIDED);
	bus_quiet(r, 2);
	cr_assert_eq(route_pinned(r[1], 2, 64, &q), 0);
	cr_assert_eq(q.status, KVR_QUEUED, "B did not see A's load");
	return hog.attempt;
}

#endif
