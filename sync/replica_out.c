/*
 * sync/replica_out.c - replica sync, outbound (issue 14): the router's notes (admissions,
 * lifecycle, rank changes; queued by sync/replica_note.c) become stream messages with this
 * replica's sequence numbers; after an outage or when a peer asks, the replica re-announces its
 * state.  The table update, the sequence number and the publish happen under `mu` together, so a
 * snapshot served under `mu` is exactly "this replica's stream up to its fence".
 */
#include <sched.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"
#include "sync/thread.h"

void kvr_rep_encode_attempt(struct kvr_msg_buf *b, unsigned type, uint64_t replica, uint64_t epoch,
                            uint64_t seq, const struct kvr_rep_rec *x, bool finished,
                            size_t max_len, uint64_t *truncated)
{
	const bool attempt = type == KVR_MSG_ATTEMPT;
	uint32_t n_blocks = x->n_blocks, tail_n = x->tail_n, n_out = attempt ? x->n_out : 0;
	bool chain_known = x->chain_known;
	const uint64_t whole = KVR_MSG_HEADER + KVR_MSG_ADMIT_FIXED + (uint64_t)n_blocks * 8 +
	                       (uint64_t)tail_n * 4 + (uint64_t)n_out * 4;
	/* Over the transport's limit (a server's max_payload: 8,179 blocks at 64 KiB), the whole
	 * message could never go: it was not sent, and peers did not mirror the attempt at all
	 * (no load, no prefix).  Cut, it is an admission whose chain the caller gave (as with
	 * seq_hashes): the prefix and the load are mirrored, the output's blocks are not hashed
	 * there (their chain's start is not known), and no peer over-credits the rank. */
	const bool cut =
	    max_len && whole > max_len && max_len >= KVR_MSG_HEADER + KVR_MSG_ADMIT_FIXED;
	if (cut) {
		size_t fit = (max_len - KVR_MSG_HEADER - KVR_MSG_ADMIT_FIXED) / 8;
		n_blocks = fit < n_blocks ? (uint32_t)fit : n_blocks;
		tail_n = 0;
		n_out = 0;
		chain_known = false;
		(*truncated)++;
	}
	size_t off = kvr_msg_begin(b, type, replica, epoch, seq);
	kvr_msg_put_u64(b, x->rank.worker_id);
	kvr_msg_put_u32(b, x->rank.dp_rank);
	uint32_t flags = (chain_known ? KVR_MSG_F_CHAIN_KNOWN : 0);
	if (attempt)
		flags |= (x->prefilled ? KVR_MSG_F_PREFILLED : 0) |
		         (finished ? KVR_MSG_F_FINISHED : 0) |
		         (x->out_counted && n_out ? KVR_MSG_F_OUT_COUNTED : 0);
	kvr_msg_put_u32(b, flags);
	kvr_msg_put_u64(b, x->incarnation);
	kvr_msg_put_u64(b, x->oattempt);
	kvr_msg_put_u64(b, x->prompt_tokens);
	kvr_msg_put_u64(b, x->lora_seed);
	kvr_msg_put_u32(b, x->overlap > n_blocks ? n_blocks : x->overlap);
	kvr_msg_put_u32(b, x->expected);
	kvr_msg_put_u32(b, n_blocks);
	kvr_msg_put_u32(b, tail_n);
	kvr_msg_put_u32(b, n_out);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u64s(b, x->blocks, n_blocks);
	kvr_msg_put_u32s(b, x->tail, tail_n);
	if (attempt)
		kvr_msg_put_u32s(b, x->out, n_out);
	kvr_msg_end(b, off);
}

/* ---------------------------------------------------------------- the stream batch
 *
 * Stream messages are appended to rep->sbuf, each with the next sequence number, and go out
 * together (wire version 2: one transport message, the messages back to back) when the sender's
 * burst ends, at the end of a re-announce, or once STREAM_BATCH_BYTES are waiting.  So a burst
 * of notes costs one publish (one write, one server hop, one wake-up of each receiver) instead
 * of one per note: at 5000 admissions/s the sender's bursts usually hold an admission and its
 * finish.  A batch that cannot be sent gives its numbers back (seq -= n), exactly as a failed
 * single send never took one; every batch is flushed before `mu` is released, so whoever takes
 * `mu` (heartbeats, snapshots) sees seq = what was published. */

#define STREAM_BATCH_BYTES (256u * 1024u)

bool kvr_rep_stream_flush(struct kvr_replica *rep)
{
	uint32_t n = rep->sbatch_n;
	bool sent = true;
	if (!n)
		goto out;
	if (rep->connected && !rep->sbuf.oom &&
	    rep->t.publish(rep->t.ctx, rep->sbuf.p, rep->sbuf.len) == 0) {
		rep->st.published += n;
		rep->st.batches++;
	} else {
		sent = false;
		rep->st.unpublished += n;
		rep->seq -= n;
		/* Connected, yet not sent (no memory to encode, the transport refused): the peers
		 * see no gap (the numbers are given back) and no reconnect will re-announce, so a
		 * lost end would leave its attempt mirrored on every peer for good.  The apply
		 * thread re-announces instead (RESET, then the live attempts). */
		if (rep->connected)
			rep->want_reannounce = true;
	}
out:
	rep->sbuf.len = 0;
	rep->sbuf.oom = false;
	rep->sbatch_n = 0;
	rep->sbuf_mark = 0;
	return sent;
}

/* The message just appended to sbuf (at sbuf_mark; its header says seq + 1) is the next of the
 * stream.  With a transport limit (max_msg): a message over it on its own is taken back, not
 * sent and counted (it could never go, and a send that fails is re-announced, where it would
 * fail again, for ever: a server with max_payload 64 KiB and a 128k-token admission published
 * 2 of 119 messages in 3 s); one that would take its batch over it sends the batch before it
 * first. */
static void stream_added(struct kvr_replica *rep)
{
	size_t at = rep->sbuf_mark, len = rep->sbuf.len - at;
	if (rep->max_msg && !rep->sbuf.oom && len > rep->max_msg) {
		rep->sbuf.len = at;
		rep->st.oversized++;
		return;
	}
	rep->seq++;
	rep->sbatch_n++;
	rep->sbuf_mark = rep->sbuf.len;
	if (rep->max_msg && !rep->sbuf.oom && rep->sbuf.len > rep->max_msg) {
		/* The batch before it goes alone; if it cannot, the message goes down with it
		 * (the numbers given back, a re-announce asked), as in one failed send. */
		rep->sbuf.len = at;
		rep->sbatch_n--;
		rep->sbuf_mark = at;
		bool sent = kvr_rep_stream_flush(rep);
		if (!sent) {
			rep->seq--;
			rep->st.unpublished++;
			return;
		}
		memmove(rep->sbuf.p, rep->sbuf.p + at, len);
		rep->sbuf.len = len;
		rep->sbuf_mark = len;
		rep->sbatch_n = 1;
	}
	if (rep->sbuf.len >= STREAM_BATCH_BYTES)
		kvr_rep_stream_flush(rep);
}

static void send_simple(struct kvr_replica *rep, unsigned type, uint64_t attempt)
{
	size_t off = kvr_msg_begin(&rep->sbuf, type, rep->c.replica_id, rep->epoch, rep->seq + 1);
	kvr_msg_put_u64(&rep->sbuf, attempt);
	kvr_msg_end(&rep->sbuf, off);
	stream_added(rep);
}

void kvr_rep_encode_rank(struct kvr_msg_buf *b, uint64_t replica, uint64_t epoch, uint64_t seq,
                         unsigned op, const struct kvr_rep_rank *e)
{
	const struct kvr_rep_ver v = op == KVR_REPL_RANK_RESET ? e->reset_ver : e->ver;
	size_t off = kvr_msg_begin(b, KVR_MSG_RANK, replica, epoch, seq);
	kvr_msg_put_u32(b, op);
	kvr_msg_put_u32(b, e->mbt);
	kvr_msg_put_u64(b, e->id.worker_id);
	kvr_msg_put_u32(b, e->id.dp_rank);
	kvr_msg_put_u32(b, v.clock ? KVR_MSG_RANK_VERSIONED : 0);
	kvr_msg_put_u64(b, e->incarnation);
	kvr_msg_put_u64(b, e->capacity);
	if (v.clock) {
		kvr_msg_put_u64(b, v.clock);
		kvr_msg_put_u64(b, v.writer);
	}
	kvr_msg_end(b, off);
}

void kvr_rep_tell_rank(struct kvr_replica *rep, unsigned op, const struct kvr_rep_rank *e)
{
	kvr_rep_encode_rank(&rep->sbuf, rep->c.replica_id, rep->epoch, rep->seq + 1, op, e);
	stream_added(rep);
}

void kvr_rep_encode_tomb(struct kvr_msg_buf *b, uint64_t replica, uint64_t epoch, uint64_t seq,
                         const struct kvr_rep_tomb *t)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_RANK, replica, epoch, seq);
	kvr_msg_put_u32(b, KVR_REPL_RANK_REMOVE);
	kvr_msg_put_u32(b, t->mbt);
	kvr_msg_put_u64(b, t->worker_id);
	kvr_msg_put_u32(b, t->dp_rank);
	kvr_msg_put_u32(b, t->ver.clock ? KVR_MSG_RANK_VERSIONED : 0);
	kvr_msg_put_u64(b, t->incarnation);
	kvr_msg_put_u64(b, KVR_CAPACITY_NONE);
	if (t->ver.clock) {
		kvr_msg_put_u64(b, t->ver.clock);
		kvr_msg_put_u64(b, t->ver.writer);
	}
	kvr_msg_end(b, off);
}

void kvr_rep_tell_tomb(struct kvr_replica *rep, const struct kvr_rep_tomb *t)
{
	kvr_rep_encode_tomb(&rep->sbuf, rep->c.replica_id, rep->epoch, rep->seq + 1, t);
	stream_added(rep);
}

/* ---------------------------------------------------------------- the sender (mu held) */

#define OUT_BURST        32
#define OUT_POLL_NS      100000ull
#define OUT_LINGER_NS    1000000ull
#define OUT_OOM_TRIES    10
#define OUT_OOM_PAUSE_NS 1000000L

/* The sender out of memory for a note (its record, the record's room for output): a note it
 * drops is lost for good, since its own tables never have it (no re-announce or snapshot can
 * carry it), so it tries again after a pause, OUT_OOM_TRIES times at most.  The pause is taken
 * without mu (the apply thread, heartbeats and snapshots go on), the batch flushed first (mu is
 * released only with the stream flushed).  Returns false once the tries are spent.  Before, the
 * note was dropped at the first failure (test_replica_notes
 * admission_mirrored_when_the_senders_record_fails: "nth 1: the peer never mirrored it").
 * Context: the sender, mu held (released and taken again). */
static bool sender_pause(struct kvr_replica *rep, int *tries)
{
	if (++*tries > OUT_OOM_TRIES)
		return false;
	kvr_rep_stream_flush(rep);
	pthread_mutex_unlock(&rep->mu);
	struct timespec ts = {0, OUT_OOM_PAUSE_NS};
	nanosleep(&ts, NULL);
	pthread_mutex_lock(&rep->mu);
	return true;
}

/* An own admission joins the tables and goes out, unless the attempt ended already: then its
 * record and its end would have crossed (the end found no record, the admission made one that
 * nothing ends), and every peer would have mirrored it for good (test_sync_nats test_oom;
 * sync/replica_early.c says how). */
static void out_admit(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	x->jmark = rep->jmarks; /* in the notes' order: before a later change's clear */
	if (kvr_rep_early_take(rep, x->oattempt)) {
		kvr_rep_rec_free(x);
		return;
	}
	for (int tries = 0; kvr_rep_map_insert(rep, x);) {
		if (!sender_pause(rep, &tries)) {
			kvr_rep_rec_free(x);
			rep->st.unpublished++;
			return;
		}
	}
	kvr_rep_live_link(rep, x);
	kvr_rep_encode_attempt(&rep->sbuf, KVR_MSG_ADMIT, rep->c.replica_id, rep->epoch,
	                       rep->seq + 1, x, false, rep->max_msg, &rep->st.truncated);
	if (kvr_rep_tracing(rep->c.replica_id)) {
		kvr_rep_trace_stamp(x->oattempt, KVR_TR_POP, rep->burst_ns);
		kvr_rep_trace_stamp(x->oattempt, KVR_TR_ENCODED, 0);
	}
	stream_added(rep);
}

/* Own attempt x ended (type: FINISH or ABORT): told, and it joins its rank's journal. */
static void out_end(struct kvr_replica *rep, struct kvr_rep_rec *x, unsigned type)
{
	send_simple(rep, type, x->oattempt);
	kvr_rep_map_remove(rep, x);
	kvr_rep_live_unlink(rep, x);
	kvr_rep_journal_add(rep, x);
}

/* Own attempt x ended with its rank's life (a removal, a reset, a new incarnation), or its
 * posted booking was dropped for the rank gone: the shard that ended it won its lease's claim
 * and said so (kvr_owner_ctx.on_rank_end, KVR_OP_RANK_ENDED), since the frontend's finish now
 * returns KVR_ESTALE and no lease expiry comes.  Before, no message ever ended it: its record
 * stayed in the map and the live list (told in every snapshot, re-announce and heartbeat
 * count) until the replica went, and every peer kept its mirror (test_replica_ranks
 * attempts_ended_by_a_rank_removal_or_reset_leave_no_record; perf/soak_router --phases
 * ranks,replica).  Told as an abort, so that each peer ends its mirror when it arrives: a peer
 * never drops a mirror on its own reading of a rank change, which may differ from the origin's
 * (a change the origin refused for an older version; an admission on the rank's new life
 * crossing it), only on the origin's word.  Ended here, on the sender, where every record of an
 * own attempt is made and freed (never under a record the sender holds across sender_pause),
 * and in the notes' order: a finish or abort a caller won before the rank's end was noted
 * before it and went out as itself (test_replica_ranks
 * an_attempt_finished_before_its_ranks_removal_still_tells_its_finish).  Not journaled: the
 * life it ran on ended, its blocks with it, on every replica that applies the change. */
static void out_rank_ended(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	send_simple(rep, KVR_MSG_ABORT, x->oattempt);
	kvr_rep_map_remove(rep, x);
	kvr_rep_live_unlink(rep, x);
	kvr_rep_rec_free(x);
}

/* OUTPUT messages of at most max_msg bytes each: a cut between two parts needs no flag (the
 * last token of a part is held back until the next part's first comes, as between two calls),
 * the last part has the call's. */
static void send_output(struct kvr_replica *rep, uint64_t attempt, const uint32_t *tokens, size_t n,
                        bool not_final)
{
	size_t per = n;
	if (rep->max_msg > KVR_MSG_HEADER + KVR_MSG_OUTPUT_FIXED + 4)
		per = (rep->max_msg - KVR_MSG_HEADER - KVR_MSG_OUTPUT_FIXED) / 4;
	do {
		size_t k = n < per ? n : per;
		bool last = k == n;
		size_t off = kvr_msg_begin(&rep->sbuf, KVR_MSG_OUTPUT, rep->c.replica_id,
		                           rep->epoch, rep->seq + 1);
		kvr_msg_put_u64(&rep->sbuf, attempt);
		kvr_msg_put_u32(&rep->sbuf, (uint32_t)k);
		kvr_msg_put_u32(&rep->sbuf, last && not_final ? KVR_MSG_OUT_NOT_FINAL : 0);
		kvr_msg_put_u32s(&rep->sbuf, tokens, k);
		kvr_msg_end(&rep->sbuf, off);
		stream_added(rep);
		tokens += k;
		n -= k;
	} while (n);
}

static void out_progress(struct kvr_replica *rep, uint64_t attempt, int op, const uint32_t *tokens,
                         size_t n, bool not_final)
{
	if (op == KVR_OP_WITHDRAWN) { /* never admitted: it pairs with its end (replica_early.c) */
		kvr_rep_early_pair(rep, attempt, kvr_rep_mono_ns());
		return;
	}
	struct kvr_rep_rec *x = kvr_rep_map_find(rep, rep->c.replica_id, attempt);
	if (!x) {
		/* An end told by the shard (an expiry, a rank's end) may come before the
		 * admission's note (sync/replica_early.c): it waits in the early set.  A caller's
		 * finish or abort never does: the caller had the id from kvr_route (or the queue's
		 * admission), which noted the admission before it returned, so the end's note is
		 * dequeued after it (sync/replica_note.c: Order).  With no record, its admission
		 * was never noted (the attempt was admitted before this replica attached: peers
		 * never saw it) or made no record (lost, counted unpublished): nothing to end, and
		 * nothing will take it out of the set, where it sat until the 60 s prune
		 * (test_replica_hooks ends_of_attempts_admitted_before_attach_are_not_kept).  A
		 * shard's end with no record may also be that of a withdrawn attempt, whose
		 * withdrawal came first: paired, it is taken out. */
		if (op == KVR_OP_EXPIRED || op == KVR_OP_RANK_ENDED)
			kvr_rep_early_pair(rep, attempt, kvr_rep_mono_ns());
		return;
	}
	switch (op) {
	case KVR_OP_PREFILL_DONE:
		x->prefilled = true;
		send_simple(rep, KVR_MSG_PREFILL_DONE, attempt);
		break;
	case KVR_OP_OUTPUT:
		if (x->out_gap) { /* output of it was dropped past the cap (kept_reconcile) */
			if (!x->prefilled) /* what output says of it besides its tokens */
				send_simple(rep, KVR_MSG_PREFILL_DONE, attempt);
			x->prefilled = true;
			break;
		}
		x->prefilled = true;
		not_final = not_final && n > 0; /* no token: nothing changes */
		/* No room in the record for memory: published all the same (the peers' chains
		 * stay whole), and the record keeps the prefix it holds (out_short). */
		for (int tries = 0;
		     !x->out_short && kvr_rep_rec_append_out(x, tokens, n, not_final);)
			if (!sender_pause(rep, &tries))
				x->out_short = true;
		send_output(rep, attempt, tokens, n, not_final);
		break;
	case KVR_OP_RANK_ENDED:
		out_rank_ended(rep, x);
		break;
	default: /* finish, abort, expiry (told as an abort: kvr_repl_note_expire) */
		out_end(rep, x, op == KVR_OP_FINISH ? KVR_MSG_FINISH : KVR_MSG_ABORT);
		break;
	}
}

/* An own rank change: the table takes it with a new version (sync/replica_ranks.c), then the
 * stream tells it.  Whether it went out needs no tracking: every re-announce (after an outage,
 * a failed publish, or a peer's request) tells the whole table again, tombstones and resets
 * included, and versions make that harmless.  Before, a removal was dropped from the table once
 * its publish returned and a reset marked told, so one the connection lost after the publish
 * (dead, not yet noticed) was never told again (test_replica_ranks
 * rank_changes_lost_after_their_publish_reach_the_peers). */
static void out_rank(struct kvr_replica *rep, int op, struct kvr_rank_id rank, uint64_t incarnation,
                     uint64_t capacity, uint32_t mbt, struct kvr_rank_life life)
{
	kvr_rep_rank_changed(rep, op, rank, incarnation, capacity, mbt, life);
}

static uint64_t out_one(struct kvr_replica *rep, const struct kvr_msg *m);

/* Handles the kept notes, oldest first, once the queue is empty and no slot of it is reserved
 * (every note made before them is handled by then, and every note made after them was kept
 * too).  An empty dequeue alone does not say so: a producer descheduled between its reserve and
 * its commit holds back the notes committed behind its slot, and a caller's end kept meanwhile
 * was handled before its own admission, found no record and was dropped, and the admission
 * then made a record nothing ended (test_replica_notes
 * a_kept_end_waits_for_its_admission_behind_an_uncommitted_slot).  Once a note is kept every
 * later one is kept too, so the wait is only for commits already under way.  Returns the highest
 * flush ticket among them (0 if none).  Context: the sender, mu held. */
static uint64_t kept_drain(struct kvr_replica *rep)
{
	struct kvr_rep_kept *k = __atomic_exchange_n(&rep->kept, NULL, __ATOMIC_ACQUIRE),
	                    *old = NULL;
	while (k) { /* reverse: oldest first */
		struct kvr_rep_kept *nx = k->next;
		k->next = old;
		old = k;
		k = nx;
	}
	uint64_t ticket = 0;
	while (old) {
		struct kvr_rep_kept *nx = old->next;
		uint64_t t = out_one(rep, &old->m);
		if (t > ticket)
			ticket = t;
		kvr_rep_kept_free(rep, old);
		old = nx;
	}
	return ticket;
}

/* After notes were dropped past the cap (note_keep), once the sender has handled every note
 * made before: own attempts that ended meanwhile (their end may be among the dropped; the
 * router's lease says) are told as aborts, so that no peer mirrors them for good; if output was
 * among the dropped (output_lost), the live ones take no more output (out_progress), since some
 * of theirs may be lost and what follows would land out of place in their chains on the peers.
 * Context: the sender, mu held (the lease reads are single acquire loads, no router call that
 * waits). */
static void kept_reconcile(struct kvr_replica *rep, bool output_lost)
{
	for (struct kvr_rep_rec *x = rep->live_head, *nx; x; x = nx) {
		nx = x->next;
		if (x->origin != rep->c.replica_id)
			continue;
		if (!kvr_repl_attempt_ended(rep->r, x->oattempt)) {
			x->out_gap |= output_lost;
			continue;
		}
		out_end(rep, x, KVR_MSG_ABORT);
		rep->st.ends_reconciled++;
	}
}

/* Handles one dequeued message; returns a flush ticket it carries (0 if none).  mu held. */
static uint64_t out_one(struct kvr_replica *rep, const struct kvr_msg *m)
{
	switch (m->aux) {
	case OUT_ADMIT: {
		struct kvr_rep_rec *x;
		memcpy(&x, m->payload, sizeof(x));
		out_admit(rep, x);
		return 0;
	}
	case OUT_ADMIT_SLAB: { /* the record is made here, off the routing path */
		uint64_t slabs;
		memcpy(&slabs, m->payload, sizeof(slabs));
		struct kvr_rep_rec *x;
		for (int tries = 0;
		     !(x = kvr_rep_rec_of_slabs(rep, slabs)) && sender_pause(rep, &tries);)
			;
		kvr_rep_slab_put(rep, slabs);
		if (x)
			out_admit(rep, x);
		else
			rep->st.unpublished++;
		return 0;
	}
	case OUT_PROGRESS: {
		struct kvr_rep_out_progress p;
		memcpy(&p, m->payload, sizeof(p));
		out_progress(rep, p.attempt, p.op, p.n > OUT_INLINE ? p.t.heap : p.t.inl, p.n,
		             p.not_final);
		if (p.n > OUT_INLINE)
			kvr_free(p.t.heap, (size_t)p.n * 4);
		return 0;
	}
	case OUT_RANK: {
		struct kvr_rep_out_rank k;
		memcpy(&k, m->payload, sizeof(k));
		out_rank(rep, k.op, (struct kvr_rank_id){k.worker_id, k.dp_rank}, k.incarnation,
		         k.capacity, k.mbt, (struct kvr_rank_life){k.life_slot, k.life_gen});
		return 0;
	}
	case OUT_NONE:
		return 0;
	case OUT_BOOT: /* the ranks read after the marker, at its place (kvr_replica_start) */
		for (size_t i = 0; i < rep->n_boot; i++) {
			const struct kvr_rep_out_rank *k = &rep->boot[i];
			if (k->op != KVR_REPL_RANK_ADD)
				continue; /* gone between the list and its stats */
			out_rank(rep, k->op, (struct kvr_rank_id){k->worker_id, k->dp_rank},
			         k->incarnation, k->capacity, k->mbt,
			         (struct kvr_rank_life){k->life_slot, k->life_gen});
		}
		kvr_free(rep->boot, rep->n_boot * sizeof(*rep->boot));
		rep->boot = NULL;
		rep->n_boot = 0;
		return 0;
	case OUT_FLUSH: {
		uint64_t ticket;
		memcpy(&ticket, m->payload, sizeof(ticket));
		return ticket;
	}
	}
	return 0;
}

/* Answers the flushes up to ticket (0: none): their waiters (kvr_rep_out_flush) return. */
static void flush_answered(struct kvr_replica *rep, uint64_t ticket)
{
	if (!ticket)
		return;
	pthread_mutex_lock(&rep->qmu);
	if (ticket > rep->flush_done)
		rep->flush_done = ticket;
	pthread_cond_broadcast(&rep->donecv);
	pthread_mutex_unlock(&rep->qmu);
}

static void *out_main(void *arg)
{
	struct kvr_replica *rep = arg;
	/* Poll sleeps of OUT_POLL_NS, not the default 50 us of slack on top. */
	prctl(PR_SET_TIMERSLACK, 1000UL);
	prctl(PR_SET_NAME, "kvr-sync-out");
	/* scoped test failures (core/alloc.h) */
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_REPLICA | KVR_ALLOC_ROLE_SENDER);
	struct kvr_msg batch[OUT_BURST];
	uint64_t idle_since = 0;
	/* Nothing handled (so nothing published, no record made) before the start has succeeded:
	 * a start that fails after this thread started drops the notes instead (kvr_replica_start).
	 * The wakes are kvr_rep_out_go's and kvr_rep_out_stop's (the notes' wake us in vain). */
	while (!__atomic_load_n(&rep->out_go, __ATOMIC_ACQUIRE)) {
		if (__atomic_load_n(&rep->out_stop, __ATOMIC_ACQUIRE))
			return NULL;
		kvr_parker_prepare_asym(&rep->out_park);
		if (__atomic_load_n(&rep->out_go, __ATOMIC_ACQUIRE) ||
		    __atomic_load_n(&rep->out_stop, __ATOMIC_ACQUIRE)) {
			kvr_parker_cancel(&rep->out_park);
			continue;
		}
		kvr_parker_wait(&rep->out_park, UINT64_MAX);
	}
	for (;;) {
		if (kvr_rep_sender_stalled(rep, kvr_rep_mono_ns())) { /* kvr_replica_stall */
			struct timespec ts = {0, 2000000};
			nanosleep(&ts, NULL);
			continue;
		}
		uint32_t n = kvr_ring_dequeue_burst(&rep->outq, batch, OUT_BURST);
		/* Notes left tagged by producers that found an earlier slot unpublished: ours to
		 * pass (sync/ring.h kvr_ring_commit_or_tag), looked at only when the ring seems
		 * empty. */
		if (!n && kvr_ring_pass_tagged(&rep->outq))
			n = kvr_ring_dequeue_burst(&rep->outq, batch, OUT_BURST);
		bool kept = !n && kvr_rep_keeping(rep) && kvr_ring_unreserved(&rep->outq);
		if (n || kept) {
			uint64_t ticket = 0;
			if (kvr_rep_tracing(rep->c.replica_id))
				rep->burst_ns = kvr_rep_mono_ns();
			pthread_mutex_lock(&rep->mu);
			if (kept) {
				ticket = kept_drain(rep);
				/* acq_rel: pairs with note_keep's RMWs of kept_over */
				uint32_t over =
				    __atomic_exchange_n(&rep->kept_over, 0, __ATOMIC_ACQ_REL);
				if (over)
					kept_reconcile(rep, over & KEPT_OVER_OUTPUT);
			}
			for (uint32_t i = 0; i < n; i++) {
				uint64_t t = out_one(rep, &batch[i]);
				if (t > ticket)
					ticket = t;
			}
			kvr_rep_stream_flush(rep);
			pthread_mutex_unlock(&rep->mu);
			flush_answered(rep, ticket);
			idle_since = 0;
			continue;
		}
		if (__atomic_load_n(&rep->out_stop, __ATOMIC_ACQUIRE))
			break; /* the hooks are gone and the ring is empty: nothing more comes */
		uint64_t now = kvr_rep_mono_ns();
		if (!idle_since)
			idle_since = now;
		if (now - idle_since < OUT_LINGER_NS) {
			struct timespec ts = {0, (long)OUT_POLL_NS};
			nanosleep(&ts, NULL);
			continue;
		}
		kvr_parker_prepare_asym(&rep->out_park);
		/* A tagger wakes after its tag: this re-check sees the tag or its wake sees us. */
		if (kvr_ring_pass_tagged(&rep->outq) || kvr_ring_depth(&rep->outq) ||
		    (kvr_rep_keeping(rep) && kvr_ring_unreserved(&rep->outq)) ||
		    __atomic_load_n(&rep->out_stop, __ATOMIC_ACQUIRE)) {
			kvr_parker_cancel(&rep->out_park);
			continue;
		}
		kvr_parker_wait(&rep->out_park, UINT64_MAX);
		idle_since = 0;
	}
	return NULL;
}

int kvr_rep_out_init(struct kvr_replica *rep)
{
	/* 16384 notes queued at most (1 MiB): far more than a sender that keeps up holds. */
	if (kvr_ring_init(&rep->outq, 16384))
		return KVR_ENOMEM;
	rep->slabs = kvr_alloc_aligned(OUT_SLABS * sizeof(*rep->slabs));
	rep->kept_spare = kvr_alloc(KEPT_SPARE * sizeof(*rep->kept_spare));
	if (!rep->slabs || !rep->kept_spare || kvr_rep_early_init(rep)) {
		kvr_free_aligned(rep->slabs, OUT_SLABS * sizeof(*rep->slabs));
		rep->slabs = NULL;
		kvr_free(rep->kept_spare, KEPT_SPARE * sizeof(*rep->kept_spare));
		rep->kept_spare = NULL;
		kvr_ring_fini(&rep->outq);
		return KVR_ENOMEM;
	}
	rep->slab_free = OUT_SLABS == 64 ? ~0ull : (1ull << OUT_SLABS) - 1;
	rep->kept_spare_free = KEPT_SPARE == 64 ? ~0ull : (1ull << KEPT_SPARE) - 1;
	kvr_parker_init(&rep->out_park);
	kvr_parker_asym_init();
	return 0;
}

int kvr_rep_out_start(struct kvr_replica *rep)
{
	/* A failed start's stop left out_stop set: the retried start's sender exited at once. */
	__atomic_store_n(&rep->out_stop, false, __ATOMIC_RELAXED);
	__atomic_store_n(&rep->out_go, false, __ATOMIC_RELAXED);
	if (kvr_thread_start(&rep->out_thread, false, out_main, rep))
		return KVR_ENOMEM;
	rep->out_started = true;
	return 0;
}

void kvr_rep_out_go(struct kvr_replica *rep)
{
	__atomic_store_n(&rep->out_go, true, __ATOMIC_RELEASE);
	kvr_parker_wake(&rep->out_park);
}

void kvr_rep_out_stop(struct kvr_replica *rep)
{
	if (!rep->out_started)
		return;
	__atomic_store_n(&rep->out_stop, true, __ATOMIC_RELEASE);
	kvr_parker_wake(&rep->out_park);
	pthread_join(rep->out_thread, NULL);
	rep->out_started = false;
}

int kvr_rep_out_flush(struct kvr_replica *rep, uint64_t deadline_ns)
{
	if (!rep->out_started || __atomic_load_n(&rep->out_stop, __ATOMIC_ACQUIRE))
		return 0;
	uint64_t ticket = __atomic_add_fetch(&rep->flush_req, 1, __ATOMIC_RELAXED);
	kvr_rep_out_push(rep, OUT_FLUSH, &ticket, sizeof(ticket));
	int rc = 0;
	pthread_mutex_lock(&rep->qmu);
	while (rep->flush_done < ticket) {
		if (!kvr_rep_wait_deadline(&rep->donecv, &rep->qmu, deadline_ns)) {
			rc = KVR_ETIMEDOUT;
			break;
		}
	}
	pthread_mutex_unlock(&rep->qmu);
	return rc;
}

/* The flush ticket a dropped note carries (0 if none): its waiter (kvr_rep_out_flush) is
 * answered as if it had been handled, or a drain made in a failed start's window waited out its
 * whole deadline once a retried start succeeded (the review's probe, test_replica_start
 * a_drain_across_a_failed_then_retried_start_returns). */
static uint64_t drop_one(struct kvr_replica *rep, struct kvr_msg *m)
{
	uint64_t ticket = 0;
	if (m->aux == OUT_FLUSH)
		memcpy(&ticket, m->payload, sizeof(ticket));
	kvr_rep_out_discard(rep, m);
	return ticket;
}

void kvr_rep_out_drop(struct kvr_replica *rep)
{
	struct kvr_msg m;
	uint64_t ticket = 0, t;
	kvr_ring_pass_tagged(&rep->outq); /* every producer is done: the rest are tagged */
	while (kvr_ring_dequeue(&rep->outq, &m))
		if ((t = drop_one(rep, &m)) > ticket)
			ticket = t;
	/* Taken as the sender takes it (kept_drain): a flush's pusher is no hook, so the hooks'
	 * grace period does not order its keep before this, and TSan does not see the grace
	 * period's order for the notes' keeps either. */
	struct kvr_rep_kept *k = __atomic_exchange_n(&rep->kept, NULL, __ATOMIC_ACQUIRE);
	for (struct kvr_rep_kept *nx; k; k = nx) {
		nx = k->next;
		if ((t = drop_one(rep, &k->m)) > ticket)
			ticket = t;
		kvr_rep_kept_free(rep, k);
	}
	/* What was dropped past the cap concerned the dropped notes only: nothing to heal. */
	__atomic_store_n(&rep->kept_over, 0, __ATOMIC_RELAXED);
	flush_answered(rep, ticket);
}

void kvr_rep_out_fini(struct kvr_replica *rep)
{
	if (!rep->outq.buf)
		return;
	kvr_rep_out_drop(rep);
	kvr_ring_fini(&rep->outq);
	kvr_free_aligned(rep->slabs, OUT_SLABS * sizeof(*rep->slabs));
	rep->slabs = NULL;
	kvr_free(rep->kept_spare, KEPT_SPARE * sizeof(*rep->kept_spare));
	rep->kept_spare = NULL;
	kvr_rep_early_fini(rep);
}

/* Asks peer `id` (on the stream) to send RESET and its live attempts again: we released them
 * when it fell silent, and only it knows them for sure (the others may have released them too).
 * Context: mu held. */
void kvr_rep_ask_reannounce(struct kvr_replica *rep, uint64_t id, uint64_t window_ms)
{
	if (!rep->connected)
		return;
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	size_t off =
	    kvr_msg_begin(&rep->obuf, KVR_MSG_SNAP_REQ, rep->c.replica_id, rep->epoch, window_ms);
	kvr_msg_put_u64(&rep->obuf, id);
	kvr_msg_end(&rep->obuf, off);
	if (!rep->obuf.oom)
		rep->t.publish(rep->t.ctx, rep->obuf.p, rep->obuf.len);
}

/* After a reconnect: RESET, the rank table (kvr_rep_rank_told: every entry, tombstones and
 * resets included, versioned, so that peers ignore what they hold newer), then every own live
 * attempt and every own attempt finished since the outage began, so peers rebuild what they hold of
 * us.  Own means of this life: a fresh replica takes the finished attempts of its id's earlier
 * lives from a snapshot as history (apply_snapshot), stamped finished as it applies them, and
 * announced them again as its own: every restart under one id sent its peers the whole journal
 * (~500 attempts a restart with 1,000-block ranks), which they booked, finished and journaled again
 * as new, so old history came back as the most recent in their LRUs (test_replica_epoch
 * a_new_life_does_not_announce_its_earlier_lives_history). */
void kvr_rep_reannounce(struct kvr_replica *rep, uint64_t since_ns)
{
	pthread_mutex_lock(&rep->mu);
	rep->want_reannounce = false;
	rep->reannounce_ms = 0;
	rep->connected = true;
	size_t off =
	    kvr_msg_begin(&rep->sbuf, KVR_MSG_RESET, rep->c.replica_id, rep->epoch, rep->seq + 1);
	kvr_msg_end(&rep->sbuf, off);
	stream_added(rep);
	for (size_t i = 0; i < rep->n_tombs; i++)
		kvr_rep_tell_tomb(rep, &rep->tombs[i]);
	for (size_t i = 0; i < rep->n_ranks; i++) {
		const struct kvr_rep_rank *e = &rep->ranks[i];
		unsigned ops[3];
		for (size_t k = 0, n = kvr_rep_rank_told(e, ops); k < n; k++)
			kvr_rep_tell_rank(rep, ops[k], e);
		for (struct kvr_rep_rec *x = e->jhead; x; x = x->next) {
			if (!since_ns || x->origin != rep->c.replica_id ||
			    x->oepoch != rep->epoch || x->fin_ns < since_ns)
				continue;
			kvr_rep_encode_attempt(&rep->sbuf, KVR_MSG_ATTEMPT, rep->c.replica_id,
			                       rep->epoch, rep->seq + 1, x, true, rep->max_msg,
			                       &rep->st.truncated);
			stream_added(rep);
		}
	}
	for (struct kvr_rep_rec *x = rep->live_head; x; x = x->next) {
		if (x->origin != rep->c.replica_id)
			continue;
		kvr_rep_encode_attempt(&rep->sbuf, KVR_MSG_ATTEMPT, rep->c.replica_id, rep->epoch,
		                       rep->seq + 1, x, false, rep->max_msg, &rep->st.truncated);
		stream_added(rep);
	}
	kvr_rep_stream_flush(rep); /* a failure asks for the next re-announce */
	pthread_mutex_unlock(&rep->mu);
}
