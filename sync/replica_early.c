/*
 * sync/replica_early.c - own attempts whose end reached the sender before their admission note
 * (issue 14; sync/replica_out.c: out_progress, out_admit).
 *
 * How an end can come first.  kvr_route posts the booking to the shard (kvr_admit), then notes
 * the admission (core/route.c).  A posted booking the shard drops for memory is told to replica
 * sync at once, on the shard thread, as an expiry (KVR_OP_EXPIRED: shards/owner_attempts.c,
 * tell_dropped); its ring ticket can be taken while the routing thread has yet to take
 * the admission's; so can a rank's end that ended the attempt, booked or not (a rank removed,
 * reset or given a new incarnation: kvr_owner_ctx.on_rank_end, KVR_OP_RANK_ENDED) while the
 * routing thread had yet to note it.  The sender then sees the end with no record, and the
 * admission later: had it published the admission, every peer would have mirrored the attempt for
 * good.  So the end is remembered here and the admission, when it comes, takes it out and is not
 * published.
 *
 * A withdrawal.  A sync_booking route whose posted booking found the rank's generation moved
 * (kvr_admit's KVR_ENOENT after the post) decides again and never notes that attempt, while
 * the shard, which alone can claim it, tells its end.  The routing thread notes the withdrawal
 * (KVR_OP_WITHDRAWN) instead of an admission, and whichever of the two comes first waits here
 * for the other (kvr_rep_early_pair: an entry taken if there, else put): an attempt is either
 * admitted or withdrawn, never both, and has one end told, so an entry is only ever taken by
 * its own pair.  Before, the end waited here for an admission that never came, until the prune
 * (test_replica_early a_sync_booking_route_that_decides_again_leaves_nothing_kept).
 *
 * How many can be pending.  One per routing thread at most (a thread is in that window for one
 * route at a time), and routing threads are the embedder's: there is no bound to size a table
 * by.  Only ends the shard tells land here (KVR_OP_EXPIRED, KVR_OP_RANK_ENDED), and
 * withdrawals: a caller's finish or abort is noted after its admission's note (out_progress),
 * so with no record it is dropped.  The shard tells an end only for an attempt whose admission
 * its router noted, or will (kvr_admit_args.noted, decided before the booking is posted:
 * core/route.c), so the ends of attempts routed before attach no longer land here either
 * (they did, one per attempt live at the attach: test_replica_early
 * *_routed_before_attach_are_not_kept).  What still lands here, never to be taken out: the
 * shard's ends of attempts whose admission note was lost (no memory, a full ring:
 * out_dropped, unpublished), and of attempts noted to a replica that detached, when another
 * attached before their end (core/route.c, `noted`).  A caller's ends of attempts admitted
 * before attach used to land here too (a review's probe: 500 entries), and lease expiries of
 * mirrors (the reaper told the local attempt id, which is no own record).  The previous
 * 64-entry ring let such leftovers push a pending end out unseen, and its admission then went
 * out with no end (test_replica_hooks early_ends_overflow: 136 of 200 live on the peer).
 *
 * So: an open-addressing set (linear probing, backward-shift deletion, load at most one half)
 * that grows instead of overwriting.  Entries older than EARLY_KEEP_NS are dropped only when
 * the set would otherwise grow: a pending end waits for its routing thread's next few
 * statements, so one that old is a leftover; memory stays bounded by the rate of leftovers
 * times EARLY_KEEP_NS.  Only when the set is full (cap - 1 entries, all younger than
 * EARLY_KEEP_NS) and cannot grow for memory is the oldest entry given up, counted in
 * rep->st.early_lost (kvr_sync_stats): the one case left in which a mirror can stay live on the
 * peers.  Emptied, a set that grew gives its storage back (shrink_if_empty).  Context for all:
 * mu held (the sender).
 */
#include <string.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"

#define EARLY_INIT    128u           /* preallocated: 63 entries before any allocation */
#define EARLY_KEEP_NS 60000000000ull /* 60 s */

static uint32_t eslot(uint64_t a, uint32_t cap)
{
	uint64_t h = a * 0x9e3779b97f4a7c15ull;
	return (uint32_t)(h >> 32) & (cap - 1);
}

int kvr_rep_early_init(struct kvr_replica *rep)
{
	rep->early = kvr_calloc(EARLY_INIT, sizeof(*rep->early));
	if (!rep->early)
		return KVR_ENOMEM;
	rep->early_cap = EARLY_INIT;
	rep->early_n = 0;
	return 0;
}

void kvr_rep_early_fini(struct kvr_replica *rep)
{
	kvr_free(rep->early, (size_t)rep->early_cap * sizeof(*rep->early));
	rep->early = NULL;
	rep->early_cap = rep->early_n = 0;
}

/* Empties slot i, moving later entries of its probe run back (no tombstones). */
static void erase_at(struct kvr_rep_early *e, uint32_t cap, uint32_t i)
{
	uint32_t m = cap - 1;
	for (uint32_t j = (i + 1) & m; e[j].a; j = (j + 1) & m) {
		uint32_t home = eslot(e[j].a, cap);
		/* e[j] may move to i if i lies on its probe path: home..j, cyclically */
		if (((j - home) & m) >= ((j - i) & m)) {
			e[i] = e[j];
			i = j;
		}
	}
	e[i].a = 0;
	e[i].ns = 0;
}

static void put(struct kvr_rep_early *e, uint32_t cap, uint64_t a, uint64_t ns)
{
	uint32_t i = eslot(a, cap);
	while (e[i].a)
		i = (i + 1) & (cap - 1);
	e[i].a = a;
	e[i].ns = ns;
}

/* An empty set that grew goes back to EARLY_INIT slots: a burst of leftovers (a rank's end
 * with thousands of attempts admitted before attach) kept its storage, 16 B a slot, for the
 * replica's life.  Out of memory it keeps the larger one (empty, and as good). */
static void shrink_if_empty(struct kvr_replica *rep)
{
	if (rep->early_n || rep->early_cap <= EARLY_INIT)
		return;
	struct kvr_rep_early *ne = kvr_calloc(EARLY_INIT, sizeof(*ne));
	if (!ne)
		return;
	kvr_free(rep->early, (size_t)rep->early_cap * sizeof(*rep->early));
	rep->early = ne;
	rep->early_cap = EARLY_INIT;
}

/* Drops the entries older than EARLY_KEEP_NS. */
static void prune(struct kvr_replica *rep, uint64_t now)
{
	for (uint32_t i = 0; i < rep->early_cap;) {
		struct kvr_rep_early *x = &rep->early[i];
		if (x->a && now - x->ns > EARLY_KEEP_NS) {
			erase_at(rep->early, rep->early_cap, i);
			rep->early_n--;
			continue; /* an entry may have moved into i */
		}
		i++;
	}
	shrink_if_empty(rep);
}

/* Doubles the set; false for memory (nothing changed). */
static bool grow(struct kvr_replica *rep)
{
	if (rep->early_cap > UINT32_MAX / 2)
		return false;
	uint32_t nc = rep->early_cap * 2;
	struct kvr_rep_early *ne = kvr_calloc(nc, sizeof(*ne));
	if (!ne)
		return false;
	for (uint32_t i = 0; i < rep->early_cap; i++)
		if (rep->early[i].a)
			put(ne, nc, rep->early[i].a, rep->early[i].ns);
	kvr_free(rep->early, (size_t)rep->early_cap * sizeof(*rep->early));
	rep->early = ne;
	rep->early_cap = nc;
	return true;
}

/* Gives up the oldest entry (the set is full and cannot grow). */
static void drop_oldest(struct kvr_replica *rep)
{
	uint32_t best = 0;
	for (uint32_t i = 1; i < rep->early_cap; i++)
		if (rep->early[i].a &&
		    (!rep->early[best].a || rep->early[i].ns < rep->early[best].ns))
			best = i;
	erase_at(rep->early, rep->early_cap, best);
	rep->early_n--;
	rep->st.early_lost++;
}

void kvr_rep_early_add(struct kvr_replica *rep, uint64_t a, uint64_t now)
{
	if (!a || !rep->early)
		return;
	if (rep->early_n + 1 > rep->early_cap / 2) {
		prune(rep, now);
		if (rep->early_n + 1 > rep->early_cap / 2 && !grow(rep) &&
		    rep->early_n + 1 >= rep->early_cap)
			drop_oldest(rep); /* full (one slot stays empty: probes end) */
	}
	put(rep->early, rep->early_cap, a, now);
	rep->early_n++;
}

void kvr_rep_early_pair(struct kvr_replica *rep, uint64_t a, uint64_t now)
{
	if (!kvr_rep_early_take(rep, a))
		kvr_rep_early_add(rep, a, now);
}

bool kvr_rep_early_take(struct kvr_replica *rep, uint64_t a)
{
	if (!rep->early_n || !a)
		return false;
	uint32_t m = rep->early_cap - 1;
	for (uint32_t i = eslot(a, rep->early_cap); rep->early[i].a; i = (i + 1) & m)
		if (rep->early[i].a == a) {
			erase_at(rep->early, rep->early_cap, i);
			rep->early_n--;
			shrink_if_empty(rep);
			return true;
		}
	return false;
}
