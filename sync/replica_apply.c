/*
 * sync/replica_apply.c - replica sync, inbound (issue 14): a delivered message is decoded and
 * checked (forged id, version, an origin's stream position: duplicate, next, or a gap that asks
 * the origin to re-announce), then applied to this router as if it had routed it; and the
 * peers' liveness (heartbeats, giving up a silent peer, which releases its attempts here).
 * Runs on the apply thread; router calls are made without `mu`.
 */
#include <string.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"

/* Builds a record from a decoded ADMIT/ATTEMPT. */
static struct kvr_rep_rec *rec_from_msg(const struct kvr_wmsg *m)
{
	struct kvr_rep_rec *x = kvr_rep_rec_new(m->n_blocks, m->tail_n);
	if (!x)
		return NULL;
	x->origin = m->h.replica;
	x->oepoch = m->h.epoch;
	x->oattempt = m->attempt;
	x->rank = (struct kvr_rank_id){m->worker_id, m->dp_rank};
	x->incarnation = m->incarnation;
	x->prompt_tokens = m->prompt_tokens;
	x->lora_seed = m->lora_seed;
	x->overlap = m->overlap;
	x->expected = m->expected_output;
	x->chain_known = m->flags & KVR_MSG_F_CHAIN_KNOWN;
	x->prefilled = m->flags & KVR_MSG_F_PREFILLED;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	if (m->n_blocks) /* the wire is little-endian */
		memcpy(x->blocks, m->blocks, (size_t)m->n_blocks * 8);
	if (m->tail_n)
		memcpy(x->tail, m->tail, (size_t)m->tail_n * 4);
#else
	for (uint32_t i = 0; i < m->n_blocks; i++)
		x->blocks[i] = kvr_msg_u64(m->blocks, i);
	for (uint32_t i = 0; i < m->tail_n; i++)
		x->tail[i] = kvr_msg_u32(m->tail, i);
#endif
	return x;
}

/* Asks peer p to re-announce (RESET, its live attempts, those finished in the last
 * GAP_WINDOW_MS) after a loss on our side, at most once per two heartbeat periods: the answer
 * normally comes within one, and the losses that ask (a dropped output, an attempt not booked
 * for memory, a heartbeat ahead of the stream) tend to come in runs; one held back, or whose
 * answer is lost, is asked again at the peer's heartbeats until its RESET comes.  Returns whether
 * it asked.  mu held. */
static bool ask_heal(struct kvr_replica *rep, struct kvr_rep_peer *p)
{
	uint64_t now = kvr_rep_mono_ns(), period = 2ull * rep->c.heartbeat_ms * 1000000ull;
	p->heal_pending = true; /* until its RESET comes: asked again at its heartbeats */
	if (p->heal_ns && now - p->heal_ns < period)
		return false;
	p->heal_ns = now;
	kvr_rep_ask_reannounce(rep, p->id, GAP_WINDOW_MS);
	return true;
}

/* Tokens converted from the wire per router call, on the stack. */
#define OUT_CHUNK 256
/* Tries of a call that found its rank's lane full (each waits up to 10 ms: kvr_request_output). */
#define OUT_TRIES 10

/* Output tokens of peer attempt x (the local attempt a; n little-endian u32 at w), applied as
 * its origin applied them: not_final (the last token's slot counted at once) exactly when the
 * origin was told so.  x->out stays exactly what this router was told, so that a catch-up
 * (an ATTEMPT for a known attempt) applies what lies past it.  No allocation on the way but
 * the record's room, taken first: the tokens go to the router in chunks converted on the
 * stack, the ones before the last as not final (a token follows them), which is what one
 * call would have counted.  What cannot be applied for memory (the record's room, the
 * router's KVR_ENOMEM) or for room (the rank's lane still full after OUT_TRIES waits) is
 * dropped and counted (st.output_dropped); x then takes no more output (x->out_gap: a later
 * message would land out of place in its chain) and its origin is asked to re-announce, which
 * books the attempt again with all of it.  Tokens of an attempt the router no longer has
 * (stale: its rank went; its end is on the way) are not counted.  Context: the apply thread
 * (the only writer of peers' records), mu not held. */
static void apply_output(struct kvr_replica *rep, struct kvr_rep_rec *x, const uint8_t *w,
                         uint32_t n, bool not_final)
{
	if (!n)
		return;
	pthread_mutex_lock(&rep->mu);
	bool ok = !x->out_gap && kvr_rep_rec_reserve_out(x, n) == 0; /* a gap: wait for it */
	pthread_mutex_unlock(&rep->mu);
	uint32_t done = 0;
	int rc = ok ? 0 : KVR_ENOMEM;
	while (ok && done < n) {
		uint32_t t[OUT_CHUNK], k = n - done < OUT_CHUNK ? n - done : OUT_CHUNK;
		for (uint32_t i = 0; i < k; i++)
			t[i] = kvr_msg_u32(w, done + i);
		bool nf = done + k < n || not_final;
		for (int tries = 0; tries < OUT_TRIES; tries++) {
			rc = APPLYING(kvr_request_output_ex(rep->r, x->local, t, k,
			                                    nf ? 0 : KVR_OUTPUT_FINAL));
			if (rc != KVR_EAGAIN)
				break;
		}
		if (rc)
			break;
		pthread_mutex_lock(&rep->mu);
		kvr_rep_rec_append_out(x, t, k, nf); /* room reserved: cannot fail */
		pthread_mutex_unlock(&rep->mu);
		done += k;
	}
	if (done == n || (rc != KVR_ENOMEM && rc != KVR_EAGAIN))
		return;
	pthread_mutex_lock(&rep->mu);
	rep->st.output_dropped += n - done;
	x->out_gap = true;
	struct kvr_rep_peer *p = kvr_rep_peer_find(rep, x->origin);
	if (p)
		ask_heal(rep, p);
	pthread_mutex_unlock(&rep->mu);
}

/* Books x on the router as a peer's admission; then its prefill state and output so far.
 * Returns 0 or the router's refusal. */
static int book(struct kvr_replica *rep, struct kvr_rep_rec *x, const struct kvr_wmsg *m)
{
	struct kvr_repl_admission a = {
	    .rank = x->rank,
	    .incarnation = x->incarnation,
	    .local = x->blocks,
	    .n = x->n_blocks,
	    .prompt_tokens = x->prompt_tokens,
	    .overlap = x->overlap,
	    .expected_output = x->expected,
	    .lora_seed = x->lora_seed,
	    .tail = x->tail,
	    .tail_n = x->tail_n,
	    .chain_known = x->chain_known,
	};
	int rc = APPLYING(kvr_repl_admit(rep->r, &a));
	if (rc)
		return rc;
	x->local = a.attempt;
	if (x->prefilled)
		APPLYING(kvr_request_prefill_done(rep->r, x->local));
	if (m)
		apply_output(rep, x, m->out, m->n_out, m->flags & KVR_MSG_F_OUT_COUNTED);
	return 0;
}

/* Counts an attempt of peer `origin` that this router did not take (rc: why).  One refused for
 * memory or room (KVR_ENOMEM; KVR_EAGAIN: the rank's lane stayed full) is asked for again as a
 * dropped output is: nothing else would bring it back (a re-announce's RESET released the copy
 * we had and answered the heal), and its load would stay missing here for good.  A refusal
 * for what the attempt says (its rank unknown or of another incarnation) is not: it would be
 * refused again.  mu not held. */
static void refused(struct kvr_replica *rep, uint64_t origin, int rc)
{
	pthread_mutex_lock(&rep->mu);
	rep->st.refused++;
	struct kvr_rep_peer *p =
	    rc == KVR_ENOMEM || rc == KVR_EAGAIN ? kvr_rep_peer_find(rep, origin) : NULL;
	if (p)
		ask_heal(rep, p);
	pthread_mutex_unlock(&rep->mu);
}

/* Whether admission m was cut into blocks of bs tokens.  The wire has no block size, but an
 * admission shows its sender's: a known chain is n_blocks x bs + tail_n tokens with tail_n < bs
 * (kvr_route's own and kvr_repl_admit's rule), and an unknown one (hashes the caller gave) has
 * no more blocks than its prompt holds.  A prompt shorter than either block size fits both:
 * it has no block to get wrong. */
static bool fits_block_size(const struct kvr_wmsg *m, uint32_t bs)
{
	const uint64_t full = (uint64_t)m->n_blocks * bs;
	if (m->tail_n >= bs)
		return false;
	return m->flags & KVR_MSG_F_CHAIN_KNOWN ? full + m->tail_n == m->prompt_tokens
	                                        : full <= m->prompt_tokens;
}

/* A peer's admission (live) or a ghost (finished: replay its blocks, then release). */
void kvr_rep_apply_attempt(struct kvr_replica *rep, const struct kvr_wmsg *m)
{
	if (!fits_block_size(m, rep->bs)) {
		/* Booked, its hashes would name other prefixes here and its load count other
		 * blocks; its lifecycle messages then find no attempt (orphans). */
		pthread_mutex_lock(&rep->mu);
		rep->st.block_size_mismatch++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	struct kvr_rep_rec *x = rec_from_msg(m);
	if (!x) {
		refused(rep, m->h.replica, KVR_ENOMEM);
		return;
	}
	bool ghost = m->flags & KVR_MSG_F_FINISHED;
	pthread_mutex_lock(&rep->mu);
	/* Read before the booking: a change that ends what it books (a reset, a new incarnation,
	 * the rank removed and back) then clears the journal after this read, and the attempt
	 * joins no journal (kvr_rep_journal_add).  Read after it, a change landing in between
	 * could be missed.  A change made here just before the booking whose note the sender has
	 * yet to take drops the attempt's blocks from the journal too: a prediction missing, never
	 * one of blocks nobody holds. */
	x->jmark = rep->jmarks;
	struct kvr_rep_rec *old = ghost ? NULL : kvr_rep_map_find(rep, x->origin, x->oattempt);
	bool other_life = old && old->oepoch != x->oepoch;
	if (other_life) {
		/* The map's key has no epoch, and a restarted peer reuses attempt ids: a record of
		 * its earlier life (one that no new-life check released) is not this attempt.
		 * Caught up, this attempt was never booked on its own rank, and the old one's load
		 * stayed on the old rank. */
		kvr_rep_map_remove(rep, old);
		kvr_rep_live_unlink(rep, old);
		rep->st.mirrored--;
		rep->st.released++;
	}
	pthread_mutex_unlock(&rep->mu);
	if (other_life) {
		APPLYING(kvr_request_abort(rep->r, old->local));
		pthread_mutex_lock(&rep->mu);
		kvr_rep_journal_add(rep, old);
		pthread_mutex_unlock(&rep->mu);
		old = NULL;
	}
	if (old) { /* known already (resync, re-announce): catch up on what it did since */
		bool pre = !old->prefilled && x->prefilled;
		uint32_t have = old->n_out;
		old->seen = true;
		kvr_rep_rec_free(x);
		if (pre)
			APPLYING(kvr_request_prefill_done(rep->r, old->local));
		pthread_mutex_lock(&rep->mu);
		old->prefilled |= pre || m->n_out > have;
		old->out_gap = false; /* what it missed comes now, in place */
		pthread_mutex_unlock(&rep->mu);
		if (m->n_out > have)
			apply_output(rep, old, m->out + (size_t)have * 4, m->n_out - have,
			             m->flags & KVR_MSG_F_OUT_COUNTED);
		return;
	}
	int rc = book(rep, x, m);
	if (rc) {
		kvr_rep_rec_free(x);
		refused(rep, m->h.replica, rc);
		return;
	}
	if (ghost)
		APPLYING(kvr_request_finish(rep->r, x->local));
	pthread_mutex_lock(&rep->mu);
	if (ghost) {
		kvr_rep_journal_add(rep, x);
	} else if ((rc = kvr_rep_map_insert(rep, x))) {
		pthread_mutex_unlock(&rep->mu);
		APPLYING(kvr_request_abort(rep->r, x->local));
		kvr_rep_rec_free(x);
		refused(rep, m->h.replica, rc);
		return;
	} else {
		x->seen = true;
		kvr_rep_live_link(rep, x);
		rep->st.mirrored++;
	}
	pthread_mutex_unlock(&rep->mu);
}

static void apply_progress(struct kvr_replica *rep, const struct kvr_wmsg *m)
{
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_rec *x = kvr_rep_map_find(rep, m->h.replica, m->attempt);
	if (!x || x->origin == rep->c.replica_id) {
		rep->st.orphans++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	bool ends = m->h.type == KVR_MSG_FINISH || m->h.type == KVR_MSG_ABORT;
	if (ends) {
		kvr_rep_map_remove(rep, x);
		kvr_rep_live_unlink(rep, x);
		rep->st.mirrored--;
	}
	pthread_mutex_unlock(&rep->mu);
	uint64_t a = x->local;
	switch (m->h.type) {
	case KVR_MSG_PREFILL_DONE:
		x->prefilled = true;
		APPLYING(kvr_request_prefill_done(rep->r, a));
		return;
	case KVR_MSG_OUTPUT:
		pthread_mutex_lock(&rep->mu);
		x->prefilled = true;
		pthread_mutex_unlock(&rep->mu);
		apply_output(rep, x, m->out, m->n_out, m->flags & KVR_MSG_OUT_NOT_FINAL);
		return;
	default:
		APPLYING(m->h.type == KVR_MSG_FINISH ? kvr_request_finish(rep->r, a)
		                                     : kvr_request_abort(rep->r, a));
		pthread_mutex_lock(&rep->mu);
		kvr_rep_journal_add(rep, x);
		pthread_mutex_unlock(&rep->mu);
		return;
	}
}

/* Releases the attempts mirrored from origin (every origin but self when origin is 0): their
 * blocks stay predicted (journal), their load goes.  Returns how many. */
uint64_t kvr_rep_release_mirrors(struct kvr_replica *rep, uint64_t origin)
{
	return kvr_rep_release_mirrors_if(rep, origin, false);
}

uint64_t kvr_rep_release_mirrors_if(struct kvr_replica *rep, uint64_t origin, bool unseen_only)
{
	uint64_t n = 0;
	for (;;) {
		struct kvr_rep_rec *batch = NULL;
		pthread_mutex_lock(&rep->mu);
		for (struct kvr_rep_rec *x = rep->live_head, *nx; x; x = nx) {
			nx = x->next;
			if (x->origin == rep->c.replica_id || (origin && x->origin != origin) ||
			    (unseen_only && x->seen))
				continue;
			kvr_rep_map_remove(rep, x);
			kvr_rep_live_unlink(rep, x);
			rep->st.mirrored--;
			x->next = batch;
			batch = x;
		}
		pthread_mutex_unlock(&rep->mu);
		if (!batch)
			return n;
		while (batch) {
			struct kvr_rep_rec *x = batch;
			batch = x->next;
			APPLYING(kvr_request_abort(rep->r, x->local));
			pthread_mutex_lock(&rep->mu);
			kvr_rep_journal_add(rep, x);
			pthread_mutex_unlock(&rep->mu);
			n++;
		}
	}
}

/* Gives peer p up (left: it said goodbye), releasing what it mirrored here. */
static void peer_gone(struct kvr_replica *rep, struct kvr_rep_peer *p, bool left)
{
	pthread_mutex_lock(&rep->mu);
	p->alive = false;
	p->lost = true;
	p->left = left;
	p->lost_ns = kvr_rep_mono_ns();
	uint64_t id = p->id;
	pthread_mutex_unlock(&rep->mu);
	uint64_t n = kvr_rep_release_mirrors(rep, id);
	pthread_mutex_lock(&rep->mu);
	rep->st.peers_lost++;
	rep->st.released += n;
	pthread_mutex_unlock(&rep->mu);
}

/* A message in our own id from a newer life (a larger epoch) was heard: another replica holds
 * our id, one that kvr_sync_attach could not see (its holder was reconnecting when the other
 * attached, or both attached at once).  Peers follow the larger epoch and drop an older life's
 * messages (kvr_rep_handle's epoch check below), so this replica's decisions and load no longer
 * reach them: kvr_sync_stats.displaced says so while the newer life is heard, and clears at its
 * goodbye or after the liveness bound without it (then peers take this one up again).  mu
 * held. */
static void note_displaced(struct kvr_replica *rep, bool heard)
{
	if (heard && !rep->displaced_ns)
		rep->st.displacements++;
	rep->displaced_ns = heard ? kvr_rep_mono_ns() | 1 : 0;
}

/* Handles one decoded message (rc: its decoding error, or 0).  mu held on entry; released. */
static void handle_one(struct kvr_replica *rep, struct kvr_wmsg m, int rc, const char *reply);

void kvr_rep_handle(struct kvr_replica *rep, const uint8_t *data, size_t len, const char *reply)
{
	struct kvr_wmsg m = {0};
	if (reply) { /* a snapshot request: one message, never a batch */
		int rc = kvr_msg_decode(data, len, &m);
		pthread_mutex_lock(&rep->mu);
		rep->st.received++;
		handle_one(rep, m, rc, reply);
		return;
	}
	/* The stream: a batch (wire version 2), applied only when every message in it decodes
	 * and all come from one peer (not us); else the whole batch is dropped (counted once). */
	size_t n = 0, pos = 0;
	int rc = kvr_msg_batch_check(data, len, &n);
	uint64_t from = 0;
	bool forged = false;
	int newer = 0;
	while (rc == 0 && kvr_msg_batch_next(data, len, &pos, &m) == 1) {
		if (!from)
			from = m.h.replica;
		if (m.h.replica != from || m.h.type == KVR_MSG_SNAP_CHUNK ||
		    m.h.type == KVR_MSG_FENCE) {
			rc = KVR_EINVAL; /* one sender per batch; not stream messages */
		} else if (m.h.replica == rep->c.replica_id) {
			forged = true; /* our id, not from us (no echo) */
			if (m.h.epoch > rep->epoch)
				newer = m.h.type == KVR_MSG_GOODBYE ? -1 : 1;
		}
	}
	pthread_mutex_lock(&rep->mu);
	if (rc == 0 && newer)
		note_displaced(rep, newer > 0);
	if (rc || forged) {
		rep->st.received++;
		rep->st.forged += forged;
		rep->st.dropped++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	rep->st.received += n;
	pthread_mutex_unlock(&rep->mu);
	pos = 0;
	while (kvr_msg_batch_next(data, len, &pos, &m) == 1) {
		pthread_mutex_lock(&rep->mu);
		handle_one(rep, m, 0, NULL);
	}
}

static void handle_one(struct kvr_replica *rep, struct kvr_wmsg m, int rc, const char *reply)
{
	if (rc == 0 && m.h.replica == rep->c.replica_id) {
		rep->st.forged++; /* our id, not from us (no echo) */
		if (m.h.epoch > rep->epoch)
			note_displaced(rep, m.h.type != KVR_MSG_GOODBYE);
		if (m.h.type == KVR_MSG_SNAP_REQ && reply) {
			/* A twin under our id asks (note_displaced): decline at once, so that it
			 * asks again and the queue group may pick another replica, rather than
			 * waiting out its snapshot_timeout_ms for an answer that never comes. */
			rep->st.dropped++;
			pthread_mutex_unlock(&rep->mu);
			kvr_rep_snapshot_give_up(rep, reply, 0);
			return;
		}
		rc = KVR_EINVAL;
	}
	if (rc == 0 && (m.h.type == KVR_MSG_SNAP_CHUNK || m.h.type == KVR_MSG_FENCE))
		rc = KVR_EINVAL; /* not stream messages */
	if (rc) {
		rep->st.dropped++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	if (m.h.type == KVR_MSG_SNAP_REQ && !reply) { /* on the stream: a peer asks us */
		if (m.target == rep->c.replica_id) {
			rep->want_reannounce = true;
			if (m.h.seq > rep->reannounce_ms)
				rep->reannounce_ms = m.h.seq < 3600000 ? m.h.seq : 3600000;
		}
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	if (m.h.type == KVR_MSG_SNAP_REQ) {
		pthread_mutex_unlock(&rep->mu);
		kvr_rep_serve_snapshot(rep, reply);
		return;
	}
	struct kvr_rep_peer *p = kvr_rep_peer_get(rep, m.h.replica);
	if (!p) {
		rep->st.dropped++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	/* An epoch is the wall clock at the replica's creation, so a new life's may be smaller
	 * than the last one's (a clock behind: another node, a step back between two short lives).
	 * While the life we know is heard, a smaller epoch is an older life's; once it is gone
	 * (goodbye, or given up), any other epoch is a new life.  Before, a smaller one was always
	 * dropped, and a replica back with a clock behind was never heard again
	 * (tests/unit/test_replica_epoch.c). */
	if (p->epoch && m.h.epoch < p->epoch && !p->lost) { /* an older life of the peer */
		rep->st.duplicates++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	bool new_life = p->epoch && m.h.epoch != p->epoch;
	pthread_mutex_unlock(&rep->mu);
	if (new_life) /* the peer restarted: what it had is gone */
		peer_gone(rep, p, false);
	pthread_mutex_lock(&rep->mu);
	if (new_life || !p->epoch) {
		p->epoch = m.h.epoch;
		p->last_seq = 0;
	}
	bool revived = !p->alive && p->lost;
	p->alive = true;
	p->left = false;
	p->last_seen = kvr_rep_mono_ns();
	rep->heard_ns = p->last_seen;
	if (m.h.type == KVR_MSG_HEARTBEAT) {
		p->hb_seq = m.h.seq;
		p->live = m.live;
		if (revived) { /* we released its attempts: ask it to announce them again */
			p->lost = false;
			kvr_rep_ask_reannounce(rep, p->id,
			                       (kvr_rep_mono_ns() - p->lost_ns) / 1000000 +
			                           GIVEN_UP_MARGIN_MS);
		} else if (m.h.seq > p->last_seq || p->heal_pending) {
			/* One subject keeps the peer's order, and a heartbeat carries the stream
			 * position it was sent at: messages up to it that were not applied were
			 * lost on the way (a delivery dropped for memory, a batch dropped as
			 * malformed). Without this, losing a peer's last messages (a finish) would
			 * go unnoticed until it sends again, and their attempts stay mirrored
			 * meanwhile. */
			bool behind = m.h.seq > p->last_seq;
			rep->st.gaps += ask_heal(rep, p) && behind;
		}
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	if (m.h.type == KVR_MSG_GOODBYE) {
		pthread_mutex_unlock(&rep->mu);
		peer_gone(rep, p, true);
		return;
	}
	/* A stream message. */
	if (m.h.seq <= p->last_seq) {
		rep->st.duplicates++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	if (m.h.seq != p->last_seq + 1 && m.h.type != KVR_MSG_RESET) {
		rep->st.gaps++;
		/* Messages of this origin were lost (e.g. sent while we were reconnecting): only
		 * it knows for sure what they said, so ask it to announce its state again. */
		kvr_rep_ask_reannounce(rep, p->id, GAP_WINDOW_MS);
	} else if (revived && m.h.type != KVR_MSG_RESET) {
		kvr_rep_ask_reannounce(
		    rep, p->id, (kvr_rep_mono_ns() - p->lost_ns) / 1000000 + GIVEN_UP_MARGIN_MS);
	}
	p->lost = false;
	if (m.h.type == KVR_MSG_RESET)
		p->heal_pending = false; /* the re-announce comes: everything of it is rebuilt */
	p->last_seq = m.h.seq;
	if (p->hb_seq < m.h.seq)
		p->hb_seq = m.h.seq;
	rep->st.applied++;
	pthread_mutex_unlock(&rep->mu);
	switch (m.h.type) {
	case KVR_MSG_ADMIT:
	case KVR_MSG_ATTEMPT:
		if (rep->handle_rx_ns && kvr_rep_tracing(m.h.replica)) {
			kvr_rep_trace_stamp(m.attempt, KVR_TR_RECEIVED, rep->handle_rx_ns);
			kvr_rep_trace_stamp(m.attempt, KVR_TR_HANDLE, 0);
			kvr_rep_apply_attempt(rep, &m);
			kvr_rep_trace_stamp(m.attempt, KVR_TR_POSTED, 0);
			break;
		}
		kvr_rep_apply_attempt(rep, &m);
		break;
	case KVR_MSG_OUTPUT:
	case KVR_MSG_PREFILL_DONE:
	case KVR_MSG_FINISH:
	case KVR_MSG_ABORT:
		apply_progress(rep, &m);
		break;
	case KVR_MSG_RANK:
		kvr_rep_apply_rank(rep, &m);
		break;
	case KVR_MSG_RESET:
		kvr_rep_release_mirrors(rep, m.h.replica);
		break;
	default:
		break;
	}
}

void kvr_rep_heartbeat(struct kvr_replica *rep, uint64_t now, uint64_t deaf_ns)
{
	/* Messages delivered but not handled yet, or held by the transport: the silent peers'
	 * may be among them, so they are handled before anyone is judged. */
	pthread_mutex_lock(&rep->qmu);
	bool waiting = rep->qhead != NULL;
	pthread_mutex_unlock(&rep->qmu);
	if (!waiting && rep->t.pending)
		waiting = rep->t.pending(rep->t.ctx) > 0;
	pthread_mutex_lock(&rep->mu);
	uint64_t live = 0;
	for (struct kvr_rep_rec *x = rep->live_head; x; x = x->next)
		live += x->origin == rep->c.replica_id;
	if (rep->connected) {
		rep->obuf.len = 0;
		rep->obuf.oom = false;
		size_t off = kvr_msg_begin(&rep->obuf, KVR_MSG_HEARTBEAT, rep->c.replica_id,
		                           rep->epoch, rep->seq);
		kvr_msg_put_u64(&rep->obuf, live);
		kvr_msg_end(&rep->obuf, off);
		if (!rep->obuf.oom)
			rep->t.publish(rep->t.ctx, rep->obuf.p, rep->obuf.len);
	}
	kvr_rep_ranks_expire(rep, now);
	/* Saturating, and twice it too (kvr_rep_silence_bound). */
	uint64_t bound = kvr_rep_silence_bound(rep);
	struct kvr_rep_peer *dead[MAX_PEERS];
	size_t nd = 0;
	for (size_t i = 0; i < rep->n_peers; i++) {
		struct kvr_rep_peer *p = &rep->peers[i];
		if (!p->alive)
			continue;
		/* Silence counts only while we listened: the time we did not run is credited. */
		p->last_seen = p->last_seen + deaf_ns < now ? p->last_seen + deaf_ns : now;
		uint64_t quiet = now - p->last_seen;
		/* Unhandled input defers the verdict, for one more bound at most (a steady flood
		 * from the others must not keep a dead peer alive). */
		if (quiet > bound && (!waiting || quiet > 2 * bound))
			dead[nd++] = p;
	}
	pthread_mutex_unlock(&rep->mu);
	for (size_t i = 0; i < nd; i++)
		peer_gone(rep, dead[i], false);
}
