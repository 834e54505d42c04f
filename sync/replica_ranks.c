/*
 * sync/replica_ranks.c - the replica's rank table as a versioned register per rank (issue 14):
 * own rank changes take a version, peers' are applied only when newer than what the entry
 * holds, and a removal leaves a tombstone.
 *
 * Why.  Any replica may add, remove, reset or resize a rank, and a replica tells its whole rank
 * table again after an outage or a loss (its re-announce: the changes whose publish may not
 * have arrived) and in every snapshot it serves.  What it tells may then be older than what the
 * receiver holds: a replica cut off while another removed a rank re-announced its add, and the
 * rank came back on every replica; a snapshot served before its provider applied a removal
 * brought the rank back to the replica that took it (test_replica_ranks).  Without an order, a
 * stale add and a real re-add read alike.  And without tombstones a removal could not be told
 * again at all: it was dropped from the table once published, so one lost after the publish (a
 * connection that died unnoticed) or missed by a joiner stayed lost.
 *
 * The idea: last writer wins.  Every entry carries the version of the change that made it what
 * it is, (clock, writer replica id), ordered by clock then writer; a change told with an older
 * or equal version than the entry's is ignored, so telling anything again is harmless, and
 * re-announces and snapshots tell every entry, tombstones included.  A reset has a version of
 * its own (reset_ver): told again, it resets only a replica that has not heard it, whatever
 * came after it.  The clock is hybrid (Kulkarni et al., "Logical Physical Clocks", 2014): the
 * wall clock's ns, or one past the highest clock made or seen here if that is larger.  Lamport's
 * rule (above everything seen) orders a change after every change its writer had heard of; the
 * wall clock orders changes made without hearing each other (a replica restarted with a rank in
 * its router is a real re-add now, not an old add), so what was done last, as far as the clocks
 * agree, wins.
 *
 * Tombstones are kept c.tombstone_ms (an hour by default) after the removal, not for good: the
 * table would grow with every worker ever removed.  A tombstone holds what the version check
 * and its telling need (struct kvr_rep_tomb: 64 bytes; a whole entry is 160), in a table of its
 * own, so that the ranks' lookups do not walk an hour of removals, with an index by id of its
 * own (sync/replica_table.c); both tables are counted in kvr_memory.replica_ranks and shrink as
 * they empty.  Each entry holds its tombstone's room in
 * the tombstones' table and its index (72 bytes a live rank), so that a removal of a rank known
 * here needs no memory: one that could not be kept was forgotten at once, raising the floor below
 * for every rank to the removal's version (a peer's add made a moment before and still on its way
 * was refused for good).  Only a removal of a rank known here by nothing can find no room: not
 * kept, as a replica that never heard it (kvr_rep_rank_bury).
 *
 * Forgetting.  Once a tombstone is forgotten nobody remembers the removal, so a replica cut off
 * for longer than the keep came back and re-announced its older add, which every peer took for
 * a rank it had not heard of yet; and the snapshot it resynced from, not naming the rank, could
 * not take it away (test_replica_ranks
 * a_rank_removed_during_an_outage_longer_than_its_tombstone_stays_removed).  What is left of a
 * forgotten removal is its version: each replica keeps the newest it forgot, its floor
 * (rank_floor), and a snapshot carries the provider's (replica_msg.h, SNAP_CHUNK flags bit2),
 * which the asker adopts, so that a joiner knows what the cluster forgot before it came.  Then:
 *  - a change no newer than the floor, for a rank this replica holds nothing of, is stale: the
 *    rank was, as far as anyone can tell, removed after it and forgotten;
 *  - after a snapshot, a rank it does not name whose version is no newer than the floor was
 *    known to the cluster (older than a removal the provider heard) and is gone there: removed
 *    here too.  A rank the snapshot does not name but newer than the floor is one the provider
 *    has not heard yet (a change made while cut off): kept, as before.
 * The one ambiguity is a replica's own change made while it was cut off and older than the
 * floor (made before a removal elsewhere, the outage outlasting the keep): the cluster never
 * heard it, so the snapshot's silence says nothing of it, and the peers refuse it as too old.
 * Such a change (its own, made since OUTAGE_MARGIN_NS before the disconnect that began its
 * outage was noticed: outage_clock; a connection back for a moment whose resync applied nothing
 * does not end the outage, its re-announce may have died with it) is kept and told again with a
 * new version: it is what this replica's router holds, and nothing the cluster remembers is
 * newer.  The margin is the re-announce's: publishes made just before a disconnect is noticed
 * may have died with the connection (before, an own add made then was judged forgotten and
 * removed from this router, though no peer ever heard it: test_replica_ranks
 * a_rank_added_just_before_an_unnoticed_disconnect_is_kept).  Own only (the version's writer): a
 * peer's change held here was heard by the cluster.  A fresh replica's own ranks count as such
 * (outage_clock 0).
 * Versions compare wall clocks across replicas, so a writer whose clock runs ahead widens that
 * window: its removal's floor covers other replicas' changes made up to its lead later; these are
 * refused or judged gone when they were never heard by the cluster and the floor covers them.
 *
 * A clock far ahead.  The wire takes clocks up to 2^63 - 1, and a replica's own clock runs one
 * past the highest it has seen: a faulty peer's change versioned 2^63 - 1 (or a snapshot's floor
 * that high) made every own version after it 2^63, which peers refuse as malformed (with the
 * batch it came in), so no rank change of that replica reached anyone any more (test_replica_ranks
 * a_version_at_the_clock_limit_does_not_stop_the_rank_changes).  Saturating would not do: own
 * changes would tie, and a tie is stale.  So a version whose clock is over CLOCK_AHEAD_MAX_NS
 * ahead of this replica's wall clock is a faulty clock's: the change is refused (counted in
 * dropped, as a malformed message) and a floor that high is not adopted, and neither moves the
 * local clock.  Clocks then stay within that lead of the wall clock (plus one per change), 2^63
 * ns being the year 2262.  An hour is far beyond the skew of clocks kept by NTP, and bounds how
 * far a faulty peer pushes the cluster's clocks ahead (which widens the window described above,
 * and which the wall clocks catch up within that hour).  The price: a replica whose wall clock
 * runs more than an hour ahead of a peer's has its rank changes refused by that peer (counted,
 * so that it shows); and one whose clock a faulty peer pushed to just under the bound makes
 * versions just over a slower peer's bound for as long as their skew (its next changes fall
 * inside once the peer's wall clock moved on).
 *
 * Messages without a version (an older peer's) are applied as before, unconditionally, and
 * leave the entry's versions as they are.  The router stays the truth of a rank's values: the
 * entry takes what the router holds after a change, and the change's version only when the
 * router took it (a refused change would otherwise win over the one the router kept).
 *
 * Context: everything here runs with `mu` held, but kvr_rep_apply_rank, which calls the router
 * without it (sync/replica.c, "Threads and locks").
 */
#include <time.h>

#include "sync/rcu.h"
#include "sync/replica_internal.h"

static uint64_t wall_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* See "A clock far ahead". */
#define CLOCK_AHEAD_MAX_NS (3600ull * 1000000000ull)

/* Whether a peer's version clock is within reach of ours (not a faulty clock's). */
static bool clock_plausible(uint64_t clock)
{
	return clock <= wall_ns() + CLOCK_AHEAD_MAX_NS;
}

/* A new version for an own change.  mu held. */
static struct kvr_rep_ver ver_next(struct kvr_replica *rep)
{
	uint64_t wall = wall_ns();
	rep->rank_clock = wall > rep->rank_clock ? wall : rep->rank_clock + 1;
	return (struct kvr_rep_ver){rep->rank_clock, rep->c.replica_id};
}

void kvr_rep_ranks_outage(struct kvr_replica *rep)
{
	uint64_t wall = wall_ns();
	if (wall > rep->rank_clock)
		rep->rank_clock = wall;
	/* ver_next's next clock, at least, less the margin in which publishes may have been lost
	 * unnoticed (see "Forgetting"). */
	const uint64_t next = rep->rank_clock + 1;
	rep->outage_clock = next > OUTAGE_MARGIN_NS ? next - OUTAGE_MARGIN_NS : 1;
}

void kvr_rep_rank_changed(struct kvr_replica *rep, int op, struct kvr_rank_id rank,
                          uint64_t incarnation, uint64_t capacity, uint32_t mbt,
                          struct kvr_rank_life life)
{
	if (op == KVR_REPL_RANK_REMOVE) {
		struct kvr_rep_tomb t;
		(void)kvr_rep_rank_bury(rep, rank, ver_next(rep), incarnation,
		                        &t); /* told, kept or not */
		kvr_rep_tell_tomb(rep, &t);
		return;
	}
	struct kvr_rep_rank *e = kvr_rep_rank_get(rep, rank);
	if (!e)
		return;
	const struct kvr_rep_ver v = ver_next(rep);
	e->ver = v;
	switch (op) {
	case KVR_REPL_RANK_ADD:
		e->incarnation = incarnation;
		e->capacity = capacity;
		e->mbt = mbt;
		e->life = life;
		break;
	case KVR_REPL_RANK_CAPACITY:
		if (incarnation != e->incarnation)
			kvr_rep_journal_clear(rep, e);
		e->incarnation = incarnation;
		e->capacity = capacity;
		break;
	case KVR_REPL_RANK_RESET:
		kvr_rep_journal_clear(rep, e);
		e->incarnation = incarnation;
		e->reset_ver = v;
		break;
	}
	kvr_rep_tell_rank(rep, (unsigned)op, e);
}

size_t kvr_rep_rank_told(const struct kvr_rep_rank *e, unsigned ops[3])
{
	size_t n = 0;
	ops[n++] = KVR_REPL_RANK_ADD;
	if (e->reset_ver.clock) /* after the add: a replica that lacked the rank has it to reset */
		ops[n++] = KVR_REPL_RANK_RESET;
	return n;
}

void kvr_rep_ranks_expire(struct kvr_replica *rep, uint64_t now)
{
	uint64_t keep_ms = rep->c.tombstone_ms ? rep->c.tombstone_ms : KVR_REP_TOMBSTONE_MS_DEFAULT;
	uint64_t keep = keep_ms > UINT64_MAX / 1000000u ? UINT64_MAX : keep_ms * 1000000u;
	for (size_t i = rep->n_tombs; i-- > 0;) { /* a drop moves the last one into i */
		const struct kvr_rep_tomb *t = &rep->tombs[i];
		if (now - t->removed_ns > keep) {
			if (kvr_rep_ver_cmp(t->ver, rep->rank_floor) > 0)
				rep->rank_floor = t->ver;
			kvr_rep_tomb_drop(rep, (struct kvr_rank_id){t->worker_id, t->dp_rank});
		}
	}
}

void kvr_rep_ranks_snapshot_begin(struct kvr_replica *rep)
{
	for (size_t i = 0; i < rep->n_ranks; i++)
		rep->ranks[i].listed = false;
}

void kvr_rep_ranks_listed(struct kvr_replica *rep, struct kvr_rank_id id)
{
	struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
	if (e)
		e->listed = true;
}

/* A rank that the snapshot just applied does not name, versioned no newer than floor f, not yet
 * judged; NULL if none.  mu held. */
static struct kvr_rep_rank *unlisted_older(struct kvr_replica *rep, struct kvr_rep_ver f)
{
	for (size_t i = 0; i < rep->n_ranks; i++) {
		struct kvr_rep_rank *e = &rep->ranks[i];
		if (!e->listed && e->ver.clock && kvr_rep_ver_cmp(e->ver, f) <= 0)
			return e;
	}
	return NULL;
}

/* Whether e is a rank a snapshot judged gone whose removal failed, unchanged since.  mu held. */
static bool doomed(const struct kvr_rep_rank *e)
{
	return e->doomed.clock && kvr_rep_ver_cmp(e->doomed, e->ver) == 0;
}

/* The router's life of the rank of entry e, which a snapshot judges gone now: the one the entry
 * describes (its add's note said which, or it was read after a peer's add), not the router's
 * now.  A remove and re-add of this router whose notes had not reached the table yet is
 * already the new life in the router, which nobody judged: read from there, the removal took
 * it (test_replica_ranks a_rank_added_again_before_the_judgement_keeps_its_new_life); the
 * entry's names the old one, which its removal finds gone (KVR_ESTALE).  An entry whose life is
 * not known (an add whose life could not be read) takes the router's now.  A rank the router
 * lacks gets a slot no rank has: its removal then says KVR_ENOENT, or KVR_ESTALE for a rank
 * added since.  mu held (the router's lookup takes no lock). */
static void judged_life(struct kvr_replica *rep, const struct kvr_rep_rank *e, uint32_t *slot,
                        uint64_t *gen)
{
	if (e->life.gen) {
		*slot = e->life.slot;
		*gen = e->life.gen;
		return;
	}
	if (kvr_repl_rank_life(rep->r, e->id, slot, gen)) {
		*slot = UINT32_MAX;
		*gen = 0;
	}
}

/* Removes the rank of entry e, which a snapshot judged gone, from the router, then forgets the
 * entry unless an own change came meanwhile (a re-add: a newer version).  Counted in rank_stale
 * once the rank is gone, not before: kvr_rank_remove may fail (KVR_ENOMEM, the rank left as it
 * was), and the count said removed of a rank still routed to (test_replica_ranks
 * a_stale_rank_whose_removal_failed_is_not_counted); and only when this removal took it, not
 * when the rank was gone already (KVR_ENOENT).  Such an entry is marked (doomed) and
 * the heartbeats try again (kvr_rep_ranks_retry), as long as it holds the judged version: the
 * next snapshot alone would have left it until the next reconnect, served meanwhile in this
 * replica's snapshots and re-announces.
 *
 * Only the life of the rank judged (slot, gen: judged_life, read with mu held) is removed.  The
 * router is called with mu released, and this router's own remove and re-add of the rank may
 * land meanwhile (its notes reach the table only after the router's change, with mu taken
 * then): a removal by id removed the new life, which nobody judged, and every heartbeat's retry
 * opened that window again (test_replica_ranks
 * a_stale_rank_removed_and_added_again_meanwhile_keeps_its_new_life).  The new life is left
 * alone (KVR_ESTALE), not counted: the judged one went by another hand, whose note follows.
 * mu held, released meanwhile (the router is called without it, the stream flushed first); e
 * is not valid after. */
static void remove_judged(struct kvr_replica *rep, struct kvr_rep_rank *e, uint32_t slot,
                          uint64_t gen)
{
	const struct kvr_rank_id id = e->id;
	const struct kvr_rep_ver v = e->ver;
	kvr_rep_stream_flush(rep);
	pthread_mutex_unlock(&rep->mu);
	int rc = APPLYING(kvr_repl_rank_remove_life(rep->r, id, slot, gen));
	uint32_t now_slot;
	uint64_t now_gen;
	int lr = kvr_repl_rank_life(rep->r, id, &now_slot, &now_gen);
	/* The judged life still routed; a lookup that could not tell (no memory) says so too. */
	bool present = lr == 0 ? now_slot == slot && now_gen == gen : lr != KVR_ENOENT;
	pthread_mutex_lock(&rep->mu);
	e = kvr_rep_rank_find(rep, id);
	bool same = e && kvr_rep_ver_cmp(e->ver, v) == 0;
	if (rc == KVR_ESTALE) {
		if (same)
			e->doomed = (struct kvr_rep_ver){0, 0}; /* that life is gone */
	} else if (!present) {
		/* Counted only when this removal took it: a rank already gone (KVR_ENOENT: removed
		 * by another hand, its note on its way) was not removed because of the snapshot
		 * (test_replica_ranks a_judged_rank_already_gone_is_not_counted). */
		rep->st.rank_stale += rc == 0;
		if (same)
			kvr_rep_rank_drop(rep, id);
	} else if (same) {
		e->doomed = v;
		e->doomed_slot = slot;
		e->doomed_gen = gen;
	}
}

void kvr_rep_ranks_snapshot_end(struct kvr_replica *rep, struct kvr_rep_ver floor)
{
	/* judged_life reads the router with mu held: registering this thread there would wait
	 * for liburcu's registry, which a grace period holds while it waits for readers, and a
	 * reader inside a note waits for mu.  (The apply thread is online already: a no-op.) */
	(void)kvr_rcu_thread_online();
	pthread_mutex_lock(&rep->mu);
	if (floor.clock && !clock_plausible(floor.clock)) {
		/* A faulty provider's floor: ours judges ("A clock far ahead"). */
		rep->st.dropped++;
		floor = (struct kvr_rep_ver){0, 0};
	}
	if (kvr_rep_ver_cmp(floor, rep->rank_floor) > 0)
		rep->rank_floor = floor;
	if (rep->rank_floor.clock > rep->rank_clock) /* own changes from now on are newer */
		rep->rank_clock = rep->rank_floor.clock;
	const struct kvr_rep_ver f = rep->rank_floor;
	for (struct kvr_rep_rank *e; f.clock && (e = unlisted_older(rep, f));) {
		e->listed = true; /* judged */
		if (e->ver.writer == rep->c.replica_id && e->ver.clock >= rep->outage_clock) {
			/* Own, made while cut off (or just before it was noticed): the peers refuse
			 * it as older than the floor. */
			e->ver = ver_next(rep);
			kvr_rep_tell_rank(rep, KVR_REPL_RANK_ADD, e);
			continue;
		}
		uint32_t slot;
		uint64_t gen;
		judged_life(rep, e, &slot, &gen);
		remove_judged(rep, e, slot, gen);
	}
	kvr_rep_stream_flush(rep);
	pthread_mutex_unlock(&rep->mu);
}

void kvr_rep_ranks_retry(struct kvr_replica *rep)
{
	/* The ids first: the table changes while mu is released for the router.  Those past
	 * the first 16 wait for the next heartbeat. */
	struct kvr_rank_id ids[16];
	size_t n = 0;
	pthread_mutex_lock(&rep->mu);
	for (size_t i = 0; i < rep->n_ranks && n < 16; i++)
		if (doomed(&rep->ranks[i]))
			ids[n++] = rep->ranks[i].id;
	for (size_t i = 0; i < n; i++) {
		struct kvr_rep_rank *e = kvr_rep_rank_find(rep, ids[i]);
		if (e && doomed(e))
			remove_judged(rep, e, e->doomed_slot, e->doomed_gen);
	}
	kvr_rep_stream_flush(rep);
	pthread_mutex_unlock(&rep->mu);
}

/* Whether two capacities are the same setting (0 and KVR_CAPACITY_NONE are both TTL retention;
 * the router reports the second). */
static bool same_capacity(uint64_t a, uint64_t b)
{
	return a == b || ((a == 0 || a == KVR_CAPACITY_NONE) && (b == 0 || b == KVR_CAPACITY_NONE));
}

/* Whether the entry of rank id holds a version newer than or equal to v for op: the change is
 * stale.  A reset is judged by the last reset's version, or by a tombstone's.  With no entry,
 * a change but a removal no newer than the floor is stale ("Forgetting"); a removal leaves a
 * tombstone.  mu held. */
static bool stale(struct kvr_replica *rep, struct kvr_rank_id id, uint32_t op, struct kvr_rep_ver v)
{
	const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
	if (e)
		return kvr_rep_ver_cmp(op == KVR_REPL_RANK_RESET ? e->reset_ver : e->ver, v) >= 0;
	const struct kvr_rep_tomb *t = kvr_rep_tomb_find(rep, id);
	if (t)
		return kvr_rep_ver_cmp(t->ver, v) >= 0;
	return op != KVR_REPL_RANK_REMOVE && rep->rank_floor.clock &&
	       kvr_rep_ver_cmp(v, rep->rank_floor) <= 0;
}

/* A peer's rank change, applied to the router; then the table takes what the router holds
 * now, not what the message said: a change the router refused (an older incarnation:
 * KVR_ESTALE; an add of a present rank is a capacity change, refused alike) was written into
 * the table all the same, journal cleared, and the snapshots this replica served and its
 * re-announces carried the refused incarnation: a fresh joiner added the rank at it and refused
 * every admission at the rank's real one (test_replica_ranks
 * a_refused_rank_change_is_not_served).  The journal goes with the rank's predicted cache: at a
 * new incarnation, or a reset the router took. */
void kvr_rep_apply_rank(struct kvr_replica *rep, const struct kvr_wmsg *m)
{
	struct kvr_rank_id id = {m->worker_id, m->dp_rank};
	const struct kvr_rep_ver v = {m->rank_clock, m->rank_writer};
	const bool versioned = v.clock != 0;
	if (versioned) {
		pthread_mutex_lock(&rep->mu);
		if (!clock_plausible(v.clock)) { /* "A clock far ahead" */
			rep->st.dropped++;
			pthread_mutex_unlock(&rep->mu);
			return;
		}
		if (v.clock > rep->rank_clock)
			rep->rank_clock = v.clock;
		bool old = stale(rep, id, m->op, v);
		rep->st.rank_stale += old;
		pthread_mutex_unlock(&rep->mu);
		if (old)
			return;
	}
	struct kvr_router *r = rep->r;
	int rc = 0;
	switch (m->op) {
	case KVR_REPL_RANK_ADD: {
		rc = APPLYING(
		    kvr_rank_add(r, id, m->incarnation, m->capacity, m->max_batched_tokens));
		if (rc == KVR_EEXIST) {
			struct kvr_rank_stats s;
			if (kvr_rank_get_stats(r, id, &s) == 0 &&
			    (s.incarnation != m->incarnation || s.capacity_blocks != m->capacity))
				APPLYING(kvr_rank_set_capacity(r, id, m->incarnation, m->capacity));
		}
		break;
	}
	case KVR_REPL_RANK_REMOVE: {
		/* A removal told late (re-announced after its origin's outage) must not remove a
		 * newer life of the rank, added meanwhile. */
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(r, id, &s) == 0 && s.incarnation > m->incarnation)
			rc = KVR_ESTALE;
		else
			rc = APPLYING(kvr_rank_remove(r, id));
		break;
	}
	case KVR_REPL_RANK_CAPACITY:
		rc = APPLYING(kvr_rank_set_capacity(r, id, m->incarnation, m->capacity));
		break;
	case KVR_REPL_RANK_RESET:
		rc = APPLYING(kvr_rank_reset(r, id, m->incarnation));
		break;
	}
	struct kvr_rank_stats s;
	bool present = kvr_rank_get_stats(r, id, &s) == 0;
	/* The life the entry describes from now on (see judged_life): read after the change, so a
	 * local remove and re-add landing in between names the new life until its notes come. */
	struct kvr_rank_life life = {0, 0};
	if (present && kvr_repl_rank_life(r, id, &life.slot, &life.gen))
		life = (struct kvr_rank_life){0, 0};
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
	if (!present) {
		if (versioned && m->op == KVR_REPL_RANK_REMOVE) {
			/* A tombstone, even for a rank this router never had (a removal that came
			 * before the snapshot or re-announce still listing the rank): the older
			 * add told later loses to it. */
			(void)kvr_rep_rank_bury(rep, id, v, m->incarnation, NULL);
		} else if (e) {
			kvr_rep_rank_drop(rep, id);
		}
	} else {
		bool known = e != NULL;
		e = kvr_rep_rank_get(rep, id);
		if (e) {
			if (e->incarnation != s.incarnation ||
			    (m->op == KVR_REPL_RANK_RESET && rc == 0))
				kvr_rep_journal_clear(rep, e);
			e->incarnation = s.incarnation;
			e->capacity = s.capacity_blocks;
			if ((m->op == KVR_REPL_RANK_ADD && rc == 0) || !e->life.gen)
				e->life = life;
			/* The router keeps the first add's; ours too unless the rank is new here.
			 */
			if (m->op == KVR_REPL_RANK_ADD && (rc == 0 || !known))
				e->mbt = m->max_batched_tokens;
			/* The version only with the change: one the router refused (an older
			 * incarnation) must not win over what it kept. */
			bool took = m->op == KVR_REPL_RANK_RESET
			                ? rc == 0
			                : m->op != KVR_REPL_RANK_REMOVE &&
			                      s.incarnation == m->incarnation &&
			                      same_capacity(s.capacity_blocks, m->capacity);
			if (versioned && took) {
				if (m->op == KVR_REPL_RANK_RESET)
					e->reset_ver = v;
				if (kvr_rep_ver_cmp(v, e->ver) > 0)
					e->ver = v;
			}
		}
	}
	pthread_mutex_unlock(&rep->mu);
}
