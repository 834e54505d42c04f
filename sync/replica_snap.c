/*
 * sync/replica_snap.c - replica sync snapshots (issue 14): serving one (FENCEs, RANKs, ghost
 * and live ATTEMPTs, built under `mu` so it is exactly every origin's stream up to its fence,
 * sent in chunks to the asker's inbox), and asking for one, collecting every chunk (never
 * half-applied) and applying it.  See sync/replica.c, "Snapshots".
 *
 * Serving while resyncing.  A replica resyncing after a reconnect waits for its provider's
 * chunks on its apply thread and serves the snapshot requests that come meanwhile
 * (poll_requests): its table is then the one from before the outage it is resyncing for.  A
 * joiner takes everything from its snapshot (history too), so one served then started with a
 * table the cluster had moved on from (a rank removed meanwhile still there, the attempts
 * finished meanwhile missing: test_replica_serve
 * a_joiner_is_not_served_a_table_from_before_the_providers_resync).  Such a replica declines a
 * joiner's request (a given-up chunk): the joiner asks again after a pause, reaching another
 * peer of the queue group or this one once its resync is over.  A request from a replica that
 * serves snapshots itself (it resyncs after its own reconnect: KVR_MSG_SNAP_ASKER_SERVES) was
 * answered at once, with what this replica had: both hold tables of their own, which the
 * fences and the rank versions keep from going back.  But the asker takes the snapshot for what
 * the cluster holds: a rank it names is kept, one it does not name is judged gone.  Two
 * replicas cut off together and back together served each other their tables from before the
 * outage, and a rank removed meanwhile stayed routable on both until their streams told them,
 * ~100 ms later (resyncing_replicas_do_not_serve_each_other_a_stale_table).
 *
 * So a resyncing asker asks for a settled table first (KVR_MSG_SNAP_SETTLED_ONLY): a provider
 * resyncing itself declines it, saying why (KVR_MSG_CHUNK_RESYNCING), and the asker asks again
 * after BUSY_PAUSE_NS; the queue group spreads its requests over the ready peers, so one that
 * is not resyncing, if any, answers soon.  Refusals alone could not end when every replica
 * resyncs at once (the server came back): each would wait for the others
 * (replicas_resyncing_from_each_other_all_get_a_snapshot).  So once every peer it knows (live,
 * or given up in its own outage: all_busy) has declined as resyncing, or after BUSY_ROUNDS
 * such declines (a peer it knows may have left the queue group, and the group picks at
 * random), the asker asks without the flag and takes what a resyncing provider has: nobody
 * has better then, and the fences and rank versions keep it from going back
 * (replicas_all_resyncing_settle_once_every_peer_declined).
 * Joiners still wait for a provider's resync to end, and nobody waits for a joiner (it serves
 * nothing before it is ready): no cycle of refusals.
 */
#include <string.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"

/* An asker's snapshot requests given up (KVR_MSG_CHUNK_GIVEN_UP) or failed for memory are asked
 * again after RETRY_FIRST_NS, doubling up to RETRY_MAX_NS, within snapshot_timeout_ms. */
#define RETRY_FIRST_NS 5000000ull
#define RETRY_MAX_NS   200000000ull
/* A resyncing asker declined by resyncing providers (KVR_MSG_CHUNK_RESYNCING) asks again after
 * BUSY_PAUSE_NS, and takes a resyncing provider's table once every peer it knows declined so,
 * or after BUSY_ROUNDS such declines.  The rounds are what bounds a miss while a settled peer
 * exists, and over NATS they bound it less than a fair pick would: nats-server (2.9) picks a
 * queue member from a random start and walks on past the asker's own subscription (no echo),
 * so the member after the asker in the group's list takes its share too.  Measured with 3
 * members: 2/3 and 1/3 of one asker's requests, not 1/2 each; an asker whose next member
 * resyncs misses the settled third with (2/3)^rounds: ~4% at 8 rounds, ~1 in 17,000 at 24
 * (with k peers picked fairly, one settled: ((k-1)/k)^rounds, 10% at 8 for k = 4, 0.1% at 24).
 * The group cannot be steered (asking a chosen peer would take a request subject per peer,
 * which the protocol does not have), so only more rounds lower it.  They cost time only while
 * a peer the asker knows does not answer, or while many peers resync at once (every one must
 * have declined: some 8 rounds for 4 peers, 18 for 7, picked fairly), and since a peer given
 * up before the asker's own outage no longer counts (all_busy), that is a peer lost in the
 * outage itself that is gone, or a cluster resyncing whole.  A round is the pause and a
 * resyncing provider's answer: all 24 rounds measured 500 ms on the in-process bus (8: 173
 * ms), and a round over NATS 25-33 ms (nats.c's request polls every 20 ms), ~0.6-0.8 s for 24.
 * Within half of snapshot_timeout_ms at most: past it the asker settles too, whatever the rounds
 * (a shorter setting than the rounds take gave the resync up with nothing applied). */
#define BUSY_PAUSE_NS 10000000ull
#define BUSY_ROUNDS   24u
/* A snapshot request that no reply answered within 1/HEDGE_PART of snapshot_timeout_ms (and
 * HEDGE_MIN_NS) is sent again with the same reply subject (kvr_rep_resync).  The price: a
 * provider that answers later than that (its apply thread queued behind other work) may be
 * asked again, and builds the snapshot once more for nobody; one that answers sooner, the
 * usual case (a few ms over NATS), costs nothing more. */
#define HEDGE_PART   8u
#define HEDGE_MIN_NS 20000000ull

/* A given-up chunk, with `why` (0 or KVR_MSG_CHUNK_RESYNCING) in its flags. */
static void give_up(struct kvr_replica *rep, const char *to, uint32_t chunk, uint32_t why)
{
	uint8_t mem[KVR_MSG_HEADER + 16];
	struct kvr_msg_buf b = {.p = mem, .cap = sizeof(mem)}; /* never grows: never freed */
	size_t off = kvr_msg_begin(&b, KVR_MSG_SNAP_CHUNK, rep->c.replica_id, rep->epoch, 0);
	kvr_msg_put_u32(&b, chunk);
	kvr_msg_put_u32(&b, KVR_MSG_CHUNK_GIVEN_UP | why);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_end(&b, off);
	if (!b.oom)
		(void)rep->t.reply(rep->t.ctx, to, b.p, b.len);
}

void kvr_rep_snapshot_give_up(struct kvr_replica *rep, const char *to, uint32_t chunk)
{
	give_up(rep, to, chunk, 0);
}

/* Serves a snapshot to `to`: FENCEs, RANKs, ghosts, live attempts, in chunks; or, if it cannot
 * be built whole, the chunks that could and a given-up chunk (no last one). */
void kvr_rep_serve_snapshot(struct kvr_replica *rep, const char *to)
{
	if (!to || !rep->t.reply)
		return;
	struct kvr_msg_buf recs = {0}, rec1 = {0}, chunk = {0};
	uint32_t n_chunk = 0, n_rec = 0;
	bool failed = false;
	pthread_mutex_lock(&rep->mu);
	/* A chunk's records take at most `room` bytes: CHUNK_BYTES, or less to fit the transport's
	 * largest message with the chunk's header and fields (a chunk over it was refused, the
	 * snapshot given up and asked for again, for ever). */
	size_t room = CHUNK_BYTES;
	const size_t fixed = 16 + 16; /* the chunk's fields, and the last one's floor */
	if (rep->max_msg && rep->max_msg < CHUNK_BYTES + KVR_MSG_HEADER + fixed)
		room = rep->max_msg > KVR_MSG_HEADER + fixed ? rep->max_msg - KVR_MSG_HEADER - fixed
		                                             : 0;
	/* The last chunk carries the floor, if any (sync/replica_ranks.c, "Forgetting"). */
	const struct kvr_rep_ver floor = rep->rank_floor;
	/* An attempt's record takes its 4-byte length too; one over it alone goes cut. */
	const size_t rec_max = room > 4 ? room - 4 : 1;
	/* One record at a time into rec1, appended framed into recs; a full recs is sent. */
#define FLUSH(last)                                                                                \
	do {                                                                                       \
		chunk.len = 0;                                                                     \
		size_t off_ =                                                                      \
		    kvr_msg_begin(&chunk, KVR_MSG_SNAP_CHUNK, rep->c.replica_id, rep->epoch, 0);   \
		kvr_msg_put_u32(&chunk, n_chunk++);                                                \
		const bool floor_ = (last) && floor.clock;                                         \
		kvr_msg_put_u32(&chunk, ((last) ? KVR_MSG_CHUNK_LAST : 0u) |                       \
		                            (floor_ ? KVR_MSG_CHUNK_FLOOR : 0u));                  \
		kvr_msg_put_u32(&chunk, n_rec);                                                    \
		kvr_msg_put_u32(&chunk, 0);                                                        \
		if (floor_) {                                                                      \
			kvr_msg_put_u64(&chunk, floor.clock);                                      \
			kvr_msg_put_u64(&chunk, floor.writer);                                     \
		}                                                                                  \
		kvr_msg_put_bytes(&chunk, recs.p, recs.len);                                       \
		kvr_msg_end(&chunk, off_);                                                         \
		if (chunk.oom || recs.oom || rep->t.reply(rep->t.ctx, to, chunk.p, chunk.len)) {   \
			failed = true;                                                             \
			n_chunk--; /* not sent: the number the asker expects next */               \
		}                                                                                  \
		recs.len = 0;                                                                      \
		n_rec = 0;                                                                         \
	} while (0)
#define ADD_REC()                                                                                  \
	do {                                                                                       \
		if (rec1.oom) { /* cut short: the snapshot is not finished (no last chunk) */      \
			failed = true;                                                             \
			break;                                                                     \
		}                                                                                  \
		if (rec1.len + 4 > room) { /* alone over the transport's limit: left out */        \
			rep->st.oversized++;                                                       \
			rec1.len = 0;                                                              \
			break;                                                                     \
		}                                                                                  \
		if (recs.len + rec1.len + 4 > room && n_rec)                                       \
			FLUSH(false);                                                              \
		kvr_msg_put_u32(&recs, (uint32_t)rec1.len);                                        \
		kvr_msg_put_bytes(&recs, rec1.p, rec1.len);                                        \
		n_rec++;                                                                           \
		rec1.len = 0;                                                                      \
	} while (0)
	/* Fences: self, then every peer alive. */
	for (size_t i = 0; i <= rep->n_peers && !failed; i++) {
		uint64_t id = i == 0 ? rep->c.replica_id : rep->peers[i - 1].id;
		uint64_t ep = i == 0 ? rep->epoch : rep->peers[i - 1].epoch;
		uint64_t sq = i == 0 ? rep->seq : rep->peers[i - 1].last_seq;
		if (i > 0 && (!rep->peers[i - 1].alive || !ep))
			continue;
		size_t off = kvr_msg_begin(&rec1, KVR_MSG_FENCE, rep->c.replica_id, rep->epoch, 0);
		kvr_msg_put_u64(&rec1, id);
		kvr_msg_put_u64(&rec1, ep);
		kvr_msg_put_u64(&rec1, sq);
		kvr_msg_end(&rec1, off);
		ADD_REC();
	}
	/* Every entry: a tombstone as its removal (the asker may hold the rank from an older
	 * snapshot, or be told its add later by a peer that missed the removal); a rank as its
	 * add and last reset (sync/replica_ranks.c), then its journal. */
	for (size_t i = 0; i < rep->n_tombs && !failed; i++) {
		kvr_rep_encode_tomb(&rec1, rep->c.replica_id, rep->epoch, 0, &rep->tombs[i]);
		ADD_REC();
	}
	for (size_t i = 0; i < rep->n_ranks && !failed; i++) {
		struct kvr_rep_rank *e = &rep->ranks[i];
		unsigned ops[3];
		for (size_t k = 0, n = kvr_rep_rank_told(e, ops); k < n && !failed; k++) {
			kvr_rep_encode_rank(&rec1, rep->c.replica_id, rep->epoch, 0, ops[k], e);
			ADD_REC();
		}
		for (struct kvr_rep_rec *x = e->jhead; x && !failed; x = x->next) {
			kvr_rep_encode_attempt(&rec1, KVR_MSG_ATTEMPT, x->origin, x->oepoch, 0, x,
			                       true, rec_max, &rep->st.truncated);
			ADD_REC();
		}
	}
	for (struct kvr_rep_rec *x = rep->live_head; x && !failed; x = x->next) {
		kvr_rep_encode_attempt(&rec1, KVR_MSG_ATTEMPT, x->origin, x->oepoch, 0, x, false,
		                       rec_max, &rep->st.truncated);
		ADD_REC();
	}
	if (!failed)
		FLUSH(true);
	if (!failed)
		rep->st.snapshots_served++;
	else
		kvr_rep_snapshot_give_up(rep, to, n_chunk);
	pthread_mutex_unlock(&rep->mu);
#undef FLUSH
#undef ADD_REC
	kvr_msg_buf_fini(&recs);
	kvr_msg_buf_fini(&rec1);
	kvr_msg_buf_fini(&chunk);
}

static bool taken(const uint64_t *t, size_t n, uint64_t id)
{
	for (size_t i = 0; i < n; i++)
		if (t[i] == id)
			return true;
	return false;
}

/* Providers that declined one request's copies as resyncing themselves, at most this many kept
 * (a request sends at most HEDGE_PART + 1 copies). */
#define DECLINERS_MAX 16u

struct snap_rx {
	struct kvr_replica *rep;
	struct kvr_rep_item *chunks, *tail;
	uint32_t next;
	uint64_t provider;
	/* Those that declined because they resync themselves (KVR_MSG_CHUNK_RESYNCING). */
	uint64_t busy[DECLINERS_MAX];
	uint32_t n_busy;
	/* From then on (kvr_rep_mono_ns) a decline ends the request (kvr_rep_resync settles). */
	uint64_t settle_at;
};

static int on_chunk(void *cb, const void *buf, size_t len)
{
	struct snap_rx *rx = cb;
	struct kvr_wmsg m;
	int bad = kvr_msg_decode(buf, len, &m);
	/* A decline of one copy: the transport waits on while other copies are out.  Taken for
	 * the end of the try, a resyncing peer's quick decline of a copy sent again lost the
	 * answer of a settled peer slower than the hedge, try after try, and the asker settled for
	 * the resyncing peer's table (test_replica_serve
	 * a_quick_decline_does_not_lose_a_slower_settled_providers_answer). */
	if (!bad && m.h.type == KVR_MSG_SNAP_CHUNK && m.chunk == 0 && rx->next == 0 &&
	    (m.chunk_flags & KVR_MSG_CHUNK_GIVEN_UP)) {
		/* A twin under our id (replica_apply.c), or the provider could not build it, or
		 * it resyncs itself: ask again. */
		if (m.h.replica != rx->rep->c.replica_id &&
		    (m.chunk_flags & KVR_MSG_CHUNK_RESYNCING) && rx->n_busy < DECLINERS_MAX &&
		    !taken(rx->busy, rx->n_busy, m.h.replica))
			rx->busy[rx->n_busy++] = m.h.replica;
		/* Past half the resync's budget the asker no longer waits for a settled table
		 * (kvr_rep_resync): the decline ends the request, and the asker settles.  Waited
		 * on, a copy held by a peer that never answers (stuck, or gone with it) ran out the
		 * whole budget, nothing applied (test_replica_serve
		 * a_stuck_peer_does_not_keep_a_resync_from_settling). */
		if (kvr_rep_mono_ns() >= rx->settle_at)
			return KVR_EAGAIN;
		return KVR_REP_CHUNK_DECLINED;
	}
	/* Another provider's answer to the same request sent again (the transport's hedge):
	 * the first one to answer is taken, whole.  A twin under our id reached by a copy
	 * declines it too, maybe between the taken provider's chunks: not one of its chunks out
	 * of place (the provider is never us), ignored as well.  Taken for one, it ended the
	 * resync with KVR_EINVAL and nothing applied (test_replica_hedge
	 * a_twins_decline_between_the_providers_chunks_is_ignored).  Ignored, it does not
	 * restart the transport's wait for the taken provider's next chunk. */
	if (!bad && m.h.type == KVR_MSG_SNAP_CHUNK && rx->next && m.h.replica != rx->provider)
		return KVR_REP_CHUNK_IGNORED;
	if (bad || m.h.type != KVR_MSG_SNAP_CHUNK || m.chunk != rx->next ||
	    m.h.replica == rx->rep->c.replica_id) {
		pthread_mutex_lock(&rx->rep->mu);
		rx->rep->st.dropped++;
		pthread_mutex_unlock(&rx->rep->mu);
		return KVR_EINVAL;
	}
	/* The taken provider gave it up midway (it could not build the rest, or a reply failed:
	 * a given-up chunk numbered past 0, kvr_rep_serve_snapshot): nothing more comes, ask
	 * again.  Taken for its next chunk, the transport waited out its timeout for more
	 * (test_replica_serve a_snapshot_given_up_midway_is_asked_again). */
	if (m.chunk_flags & KVR_MSG_CHUNK_GIVEN_UP)
		return KVR_EAGAIN;
	rx->provider = m.h.replica;
	struct kvr_rep_item *it = kvr_alloc(sizeof(*it) + len);
	if (!it)
		return KVR_ENOMEM;
	it->next = NULL;
	it->len = len;
	it->reply = NULL;
	memcpy(it->data, buf, len);
	if (rx->tail)
		rx->tail->next = it;
	else
		rx->chunks = it;
	rx->tail = it;
	rx->next++;
	return (m.chunk_flags & KVR_MSG_CHUNK_LAST) ? KVR_REP_CHUNK_LAST : KVR_REP_CHUNK_MORE;
}

/* Applies a complete snapshot: ranks; ghosts (only on a fresh replica: one that has routed or
 * applied anything already holds that history, and replaying it again would only reorder its
 * LRU); live attempts reconciled with the mirrors held (kept if named, caught up on output,
 * booked if missing, released if the snapshot does not name them); then the fences. */
static void apply_snapshot(struct kvr_replica *rep, struct kvr_rep_item *chunks)
{
	/* Origins whose part of the snapshot is taken: those where the snapshot is not behind
	 * what we applied already (a fence never moves back: the messages between would be lost),
	 * or that we had given up (we released what we held of them).  FENCE records come first. */
	uint64_t take[MAX_PEERS], jump[MAX_PEERS];
	size_t n_take = 0, n_jump = 0;
	struct kvr_rep_ver floor = {0, 0};
	pthread_mutex_lock(&rep->mu);
	kvr_rep_ranks_snapshot_begin(rep);
	bool fresh = rep->st.applied == 0 && rep->st.snapshots_applied == 0 &&
	             rep->seq <= rep->n_ranks + rep->n_tombs;
	for (struct kvr_rep_rec *x = rep->live_head; x; x = x->next)
		x->seen = false;
	pthread_mutex_unlock(&rep->mu);
	for (struct kvr_rep_item *it = chunks; it; it = it->next) {
		struct kvr_wmsg c;
		if (kvr_msg_decode(it->data, it->len, &c))
			continue; /* checked in on_chunk */
		/* Our providers put it on the last chunk alone; from any other, several floors
		 * mean the highest (a floor only ever rises), not the last one read. */
		struct kvr_rep_ver f = {c.floor_clock, c.floor_writer};
		if ((c.chunk_flags & KVR_MSG_CHUNK_FLOOR) && kvr_rep_ver_cmp(f, floor) > 0)
			floor = f;
		size_t pos = 0, rl;
		const uint8_t *rp;
		while (kvr_msg_next_record(&c, &pos, &rp, &rl)) {
			struct kvr_wmsg m;
			if (kvr_msg_decode(rp, rl, &m))
				continue; /* checked by the chunk's decode */
			if (m.h.type == KVR_MSG_RANK) {
				kvr_rep_apply_rank(rep, &m);
				pthread_mutex_lock(&rep->mu);
				kvr_rep_ranks_listed(rep,
				                     (struct kvr_rank_id){m.worker_id, m.dp_rank});
				pthread_mutex_unlock(&rep->mu);
			} else if (m.h.type == KVR_MSG_ATTEMPT) {
				/* History: all of it on a fresh replica; else only that of origins
				 * whose fence skips messages we never applied (their finished
				 * attempts are not in the live part, and their messages up to the
				 * fence are gone). */
				bool ghost = m.flags & KVR_MSG_F_FINISHED;
				if (ghost ? !fresh && !taken(jump, n_jump, m.h.replica)
				          : !taken(take, n_take, m.h.replica))
					continue; /* history we hold; origins we are ahead on; us */
				kvr_rep_apply_attempt(rep, &m);
			} else if (m.h.type == KVR_MSG_FENCE &&
			           m.fence_replica != rep->c.replica_id && n_take < MAX_PEERS) {
				pthread_mutex_lock(&rep->mu);
				struct kvr_rep_peer *p = kvr_rep_peer_find(rep, m.fence_replica);
				/* A life whose goodbye we heard has ended, whatever a provider that
				 * has not heard it yet says: taken, it was a live peer here again
				 * and its attempts were booked again, until the liveness bound gave
				 * it up (a_snapshot_does_not_bring_back_a_peer_that_left).  So has
				 * every life before it (one id, one life at a time): a provider cut
				 * off through the later life named an earlier one alive, and it
				 * came back the same way (..._an_earlier_life_of_a_peer_that_left).
				 * A new life whose epoch is smaller (a clock behind) is not taken
				 * from here either: its stream, once heard, is a new life
				 * (handle_one), which asks it to announce its attempts again. */
				bool ended = p && p->left && m.fence_epoch <= p->epoch;
				bool ok =
				    !ended &&
				    (!p || !p->epoch || p->lost || p->epoch < m.fence_epoch ||
				     (p->epoch == m.fence_epoch && p->last_seq <= m.fence_seq));
				bool new_life = false;
				if (ok && (p || (p = kvr_rep_peer_get(rep, m.fence_replica)))) {
					if (p->epoch != m.fence_epoch || p->last_seq < m.fence_seq)
						jump[n_jump++] = m.fence_replica;
					/* The peer restarted while we did not hear it: what we
					 * mirror of its earlier life is gone with that life, as at
					 * a new life on the stream (handle_one).  Kept, its records
					 * would take the new life's attempts that reuse their ids
					 * (a new process mints the same ids) for themselves. */
					new_life = p->epoch && p->epoch != m.fence_epoch;
					if (new_life)
						p->hb_seq = 0; /* the old life's position */
					p->epoch = m.fence_epoch;
					p->last_seq = m.fence_seq;
					if (p->hb_seq < p->last_seq)
						p->hb_seq = p->last_seq;
					p->alive = true;
					p->lost = false;
					p->left = false;
					p->last_seen = kvr_rep_mono_ns();
					take[n_take++] = m.fence_replica;
				}
				pthread_mutex_unlock(&rep->mu);
				/* FENCE records come first: released before any record of the
				 * new life is applied. */
				if (new_life) {
					uint64_t k = kvr_rep_release_mirrors(rep, m.fence_replica);
					pthread_mutex_lock(&rep->mu);
					rep->st.released += k;
					pthread_mutex_unlock(&rep->mu);
				}
			}
		}
	}
	/* Ranks the snapshot does not name: gone, or not heard yet (sync/replica_ranks.c). */
	kvr_rep_ranks_snapshot_end(rep, floor);
	pthread_mutex_lock(&rep->mu);
	for (struct kvr_rep_rec *x = rep->live_head; x; x = x->next)
		if (!taken(take, n_take, x->origin))
			x->seen = true; /* not this snapshot's to judge */
	pthread_mutex_unlock(&rep->mu);
	uint64_t n = kvr_rep_release_mirrors_if(rep, 0, true);
	pthread_mutex_lock(&rep->mu);
	rep->st.released += n;
	pthread_mutex_unlock(&rep->mu);
}

static bool poll_requests(void *cb);

/* Asks a peer for a snapshot once, waiting at most timeout_ns between chunks, and applies it;
 * a reconnect's request asks for a settled provider's table if `settled_only`.  A decline from
 * settle_at on (kvr_rep_mono_ns) ends the request, copies out or not.  Returns 0
 * (applied), KVR_ENOENT (no peer), KVR_EAGAIN (the providers gave it up; *busy_seen if one
 * declined because it resyncs itself, such providers added to the n_busy ids in busy, at most
 * MAX_PEERS), KVR_ENOMEM, KVR_ETIMEDOUT, KVR_EINVAL (a chunk out of place). */
static int resync_once(struct kvr_replica *rep, uint64_t timeout_ns, uint64_t hedge_ns,
                       uint64_t settle_at, bool settled_only, bool *busy_seen, uint64_t *busy,
                       size_t *n_busy)
{
	*busy_seen = false;
	pthread_mutex_lock(&rep->qmu);
	const uint64_t flags = rep->ready ? KVR_MSG_SNAP_ASKER_SERVES | /* a reconnect's */
	                                        (settled_only ? KVR_MSG_SNAP_SETTLED_ONLY : 0)
	                                  : 0;
	pthread_mutex_unlock(&rep->qmu);
	pthread_mutex_lock(&rep->mu);
	rep->st.resyncs++;
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	size_t off = kvr_msg_begin(&rep->obuf, KVR_MSG_SNAP_REQ, rep->c.replica_id, rep->epoch, 0);
	kvr_msg_put_u64(&rep->obuf, flags);
	kvr_msg_end(&rep->obuf, off);
	struct kvr_msg_buf req = {0};
	kvr_msg_put_bytes(&req, rep->obuf.p, rep->obuf.len);
	pthread_mutex_unlock(&rep->mu);
	int rc = KVR_ENOMEM;
	struct snap_rx rx = {.rep = rep, .settle_at = settle_at};
	if (!req.oom)
		rc = rep->t.request(rep->t.ctx, req.p, req.len, timeout_ns, hedge_ns, on_chunk,
		                    poll_requests, &rx);
	kvr_msg_buf_fini(&req);
	if (rc > 0) /* not a code a transport returns (sync/replica.h): a transport that does not
	               know DECLINED or IGNORED sent the request once */
		rc = rc == KVR_REP_CHUNK_LAST       ? 0
		     : rc == KVR_REP_CHUNK_DECLINED ? KVR_EAGAIN
		                                    : KVR_ETIMEDOUT;
	if (rc == KVR_EAGAIN && rx.n_busy) {
		*busy_seen = true;
		for (uint32_t i = 0; i < rx.n_busy; i++)
			if (!taken(busy, *n_busy, rx.busy[i]) && *n_busy < MAX_PEERS)
				busy[(*n_busy)++] = rx.busy[i];
	}
	if (rc == 0) {
		apply_snapshot(rep, rx.chunks);
		pthread_mutex_lock(&rep->mu);
		rep->st.snapshots_applied++;
		pthread_mutex_unlock(&rep->mu);
	}
	while (rx.chunks) {
		struct kvr_rep_item *it = rx.chunks;
		rx.chunks = it->next;
		kvr_free(it, sizeof(*it) + it->len);
	}
	return rc;
}

/* Whether every peer this replica knows is among the n ids in `busy` (all declined as resyncing
 * themselves).  Known: alive, or given up in this replica's own outage.  Those count: a
 * replica cut off for long gave up every peer, the settled ones too, and must not settle for a
 * resyncing one's table because it heard only that one
 * (test_replica_serve a_replica_cut_off_waits_for_the_peers_it_gave_up_in_its_outage).
 * A peer given up before the outage, while this replica went on hearing the others, does not:
 * it crashed or is cut off itself, and this replica knows no more of its table than of a peer
 * it never heard.  Counted, it made every asker of a cluster resyncing at once wait out
 * BUSY_ROUNDS declines until its slot was reused
 * (a_peer_crashed_before_the_outage_is_not_waited_for).  Nor does one that said goodbye: it
 * left (a_peer_that_left_is_not_waited_for_one_back_is).  In the outage means given up at most
 * one liveness bound before this replica last heard the cluster (outage_heard_ns): those
 * silenced by the outage were given up a bound after it, and the slack takes in a peer the
 * same trouble silenced a little before the others.  With no disconnect seen, every give-up
 * counts, as before.  Context: the asker (hmu held). */
static bool all_busy(struct kvr_replica *rep, const uint64_t *busy, size_t n)
{
	bool all = true;
	pthread_mutex_lock(&rep->mu);
	const uint64_t heard = rep->outage_heard_ns, slack = kvr_rep_silence_bound(rep);
	const uint64_t since = heard > slack ? heard - slack : 0;
	for (size_t i = 0; i < rep->n_peers && all; i++) {
		const struct kvr_rep_peer *p = &rep->peers[i];
		bool known = p->alive || (p->lost && !p->left && p->lost_ns >= since);
		if (known && !taken(busy, n, p->id))
			all = false;
	}
	pthread_mutex_unlock(&rep->mu);
	return all;
}

/* Asks a peer for a snapshot and applies it.  A snapshot given up by its provider (it could not
 * build it whole) or lost here for memory is asked for again after a short pause (serving the
 * snapshot requests waiting meanwhile), within snapshot_timeout_ms in all: before, a given-up
 * snapshot sent nothing more and the asker waited out the whole timeout, then went on without
 * it (test_replica_oom snapshot_given_up_asked_again).  A reconnect's resync asks for a settled
 * provider's table until resyncing providers have declined it enough (see "Serving while
 * resyncing" above).  Returns 0 (applied), KVR_ENOENT (no peer), or the last attempt's
 * failure. */
int kvr_rep_resync(struct kvr_replica *rep)
{
	if (!rep->t.request)
		return KVR_ENOENT;
	uint64_t timeout = (uint64_t)rep->c.snapshot_timeout_ms * 1000000ull;
	/* A request nobody answered within 1/HEDGE_PART of the budget is sent again, up to
	 * HEDGE_PART - 1 times a request: the queue group picks at random, and a peer alive but
	 * stuck (its apply thread busy for longer than the budget) took the whole budget when
	 * picked and the resync applied nothing (test_replica_serve
	 * a_peer_that_does_not_answer_does_not_cost_the_whole_resync). */
	const uint64_t hedge =
	    timeout / HEDGE_PART > HEDGE_MIN_NS ? timeout / HEDGE_PART : HEDGE_MIN_NS;
	uint64_t start = kvr_rep_mono_ns(), pause = RETRY_FIRST_NS;
	uint64_t busy[MAX_PEERS];
	size_t n_busy = 0;
	unsigned busy_rounds = 0;
	bool settled_only = true;
	for (;;) {
		uint64_t spent = kvr_rep_mono_ns() - start;
		bool busy_seen;
		int rc = resync_once(rep, timeout > spent ? timeout - spent : 1, hedge,
		                     start + timeout / 2, settled_only, &busy_seen, busy, &n_busy);
		if (rc != KVR_EAGAIN && rc != KVR_ENOMEM)
			return rc;
		uint64_t wait = pause;
		if (busy_seen) { /* declined: they resync too */
			/* Or once half the deadline went on declines: BUSY_ROUNDS rounds need not
			 * fit a short snapshot_timeout_ms (24 of 20-33 ms over NATS), and running
			 * out of it applied nothing, not even a resyncing provider's table. */
			if (++busy_rounds >= BUSY_ROUNDS || all_busy(rep, busy, n_busy) ||
			    kvr_rep_mono_ns() - start >= timeout / 2)
				settled_only = false; /* nobody has better: take what they have */
			wait = BUSY_PAUSE_NS;
		} else {
			pause = pause * 2 < RETRY_MAX_NS ? pause * 2 : RETRY_MAX_NS;
		}
		uint64_t until = kvr_rep_mono_ns() + wait;
		if (until - start >= timeout)
			return rc;
		struct snap_rx rx = {.rep = rep};
		for (uint64_t now; (now = kvr_rep_mono_ns()) < until;) {
			if (poll_requests(&rx))
				return KVR_ESHUTDOWN;
			uint64_t step = until - now < 2000000 ? until - now : 2000000;
			struct timespec ts = {0, (long)step};
			nanosleep(&ts, NULL);
		}
	}
}

/* Serves the snapshot requests waiting in the queue (while this replica waits for its own), but
 * a joiner's and a settled-only asker's, declined (see "Serving while resyncing" above).
 * Returns true when the replica is stopping (kvr_sync_detach, kvr_router_destroy): the wait ends
 * then instead of running out its snapshot_timeout_ms while they wait for this thread. */
static bool poll_requests(void *cb)
{
	struct kvr_replica *rep = ((struct snap_rx *)cb)->rep;
	for (;;) {
		struct kvr_rep_item *found = NULL;
		bool joiner = false, settled_only = false;
		pthread_mutex_lock(&rep->qmu);
		for (struct kvr_rep_item **pp = &rep->qhead; *pp; pp = &(*pp)->next) {
			struct kvr_wmsg m;
			if ((*pp)->reply && (*pp)->len >= KVR_MSG_HEADER &&
			    (*pp)->data[3] == KVR_MSG_SNAP_REQ &&
			    kvr_msg_decode((*pp)->data, (*pp)->len, &m) == 0) {
				found = *pp;
				joiner = !(m.target & KVR_MSG_SNAP_ASKER_SERVES);
				settled_only = m.target & KVR_MSG_SNAP_SETTLED_ONLY;
				*pp = found->next;
				if (rep->qtail == found) {
					rep->qtail = NULL;
					for (struct kvr_rep_item *y = rep->qhead; y; y = y->next)
						rep->qtail = y;
				}
				break;
			}
		}
		bool stop = rep->stop;
		pthread_mutex_unlock(&rep->qmu);
		if (!found)
			return stop;
		if (joiner || settled_only) {
			pthread_mutex_lock(&rep->mu);
			rep->st.received++;
			pthread_mutex_unlock(&rep->mu);
			give_up(rep, found->reply, 0, joiner ? 0 : KVR_MSG_CHUNK_RESYNCING);
		} else {
			kvr_rep_handle(rep, found->data, found->len, found->reply);
		}
		pthread_mutex_lock(&rep->qmu);
		rep->q_done++;
		pthread_cond_broadcast(&rep->donecv);
		pthread_mutex_unlock(&rep->qmu);
		kvr_free(found->reply, found->reply ? strlen(found->reply) + 1 : 0);
		kvr_free(found, sizeof(*found) + found->len);
	}
}
