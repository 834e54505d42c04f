/*
 * sync/replica_out.c - replica sync, outbound (issue 14): the router's notes (admissions,
 * lifecycle, rank changes) become stream messages with this replica's sequence numbers; after
 * an outage or when a peer asks, the replica re-announces its state.  The table update, the
 * sequence number and the publish happen under `mu` together, so a snapshot served under `mu`
 * is exactly "this replica's stream up to its fence".
 */
#include <string.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"

void kvr_rep_encode_attempt(struct kvr_msg_buf *b, unsigned type, uint64_t replica, uint64_t epoch,
                            uint64_t seq, const struct kvr_rep_rec *x, bool finished)
{
	size_t off = kvr_msg_begin(b, type, replica, epoch, seq);
	kvr_msg_put_u64(b, x->rank.worker_id);
	kvr_msg_put_u32(b, x->rank.dp_rank);
	uint32_t flags = (x->chain_known ? KVR_MSG_F_CHAIN_KNOWN : 0);
	if (type == KVR_MSG_ATTEMPT)
		flags |=
		    (x->prefilled ? KVR_MSG_F_PREFILLED : 0) | (finished ? KVR_MSG_F_FINISHED : 0);
	kvr_msg_put_u32(b, flags);
	kvr_msg_put_u64(b, x->incarnation);
	kvr_msg_put_u64(b, x->oattempt);
	kvr_msg_put_u64(b, x->prompt_tokens);
	kvr_msg_put_u64(b, x->lora_seed);
	kvr_msg_put_u32(b, x->overlap);
	kvr_msg_put_u32(b, x->expected);
	kvr_msg_put_u32(b, x->n_blocks);
	kvr_msg_put_u32(b, x->tail_n);
	kvr_msg_put_u32(b, type == KVR_MSG_ATTEMPT ? x->n_out : 0);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u64s(b, x->blocks, x->n_blocks);
	kvr_msg_put_u32s(b, x->tail, x->tail_n);
	if (type == KVR_MSG_ATTEMPT)
		kvr_msg_put_u32s(b, x->out, x->n_out);
	kvr_msg_end(b, off);
}

/* Sends obuf[0..len) as the next stream message (its header already says seq + 1). */
static void send_stream(struct kvr_replica *rep)
{
	if (!rep->connected || rep->obuf.oom) {
		rep->st.unpublished++;
		return;
	}
	if (rep->t.publish(rep->t.ctx, rep->obuf.p, rep->obuf.len) == 0) {
		rep->seq++;
		rep->st.published++;
	} else {
		rep->st.unpublished++;
	}
}

static void send_simple(struct kvr_replica *rep, unsigned type, uint64_t attempt)
{
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	size_t off = kvr_msg_begin(&rep->obuf, type, rep->c.replica_id, rep->epoch, rep->seq + 1);
	kvr_msg_put_u64(&rep->obuf, attempt);
	kvr_msg_end(&rep->obuf, off);
	send_stream(rep);
}

void kvr_rep_encode_rank(struct kvr_msg_buf *b, uint64_t replica, uint64_t epoch, uint64_t seq,
                         unsigned op, const struct kvr_rep_rank *e)
{
	size_t off = kvr_msg_begin(b, KVR_MSG_RANK, replica, epoch, seq);
	kvr_msg_put_u32(b, op);
	kvr_msg_put_u32(b, e->mbt);
	kvr_msg_put_u64(b, e->id.worker_id);
	kvr_msg_put_u32(b, e->id.dp_rank);
	kvr_msg_put_u32(b, 0);
	kvr_msg_put_u64(b, e->incarnation);
	kvr_msg_put_u64(b, e->capacity);
	kvr_msg_end(b, off);
}

static void send_rank(struct kvr_replica *rep, unsigned op, const struct kvr_rep_rank *e)
{
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	kvr_rep_encode_rank(&rep->obuf, rep->c.replica_id, rep->epoch, rep->seq + 1, op, e);
	send_stream(rep);
}

/* ---------------------------------------------------------------- notes (frontend threads) */

void kvr_rep_note_admit(void *ctx, const struct kvr_repl_admission *a)
{
	struct kvr_replica *rep = ctx;
	struct kvr_rep_rec *x = kvr_rep_rec_new(a->n, a->tail_n);
	pthread_mutex_lock(&rep->mu);
	if (!x) {
		rep->st.unpublished++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	x->origin = rep->c.replica_id;
	x->oepoch = rep->epoch;
	x->oattempt = x->local = a->attempt;
	x->rank = a->rank;
	x->incarnation = a->incarnation;
	x->prompt_tokens = a->prompt_tokens;
	x->lora_seed = a->lora_seed;
	x->overlap = a->overlap;
	x->expected = a->expected_output;
	x->chain_known = a->chain_known;
	memcpy(x->blocks, a->local, (size_t)a->n * 8);
	if (a->tail_n)
		memcpy(x->tail, a->tail, (size_t)a->tail_n * 4);
	if (kvr_rep_map_insert(rep, x)) {
		kvr_rep_rec_free(x);
		rep->st.unpublished++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	kvr_rep_live_link(rep, x);
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	kvr_rep_encode_attempt(&rep->obuf, KVR_MSG_ADMIT, rep->c.replica_id, rep->epoch,
	                       rep->seq + 1, x, false);
	send_stream(rep);
	pthread_mutex_unlock(&rep->mu);
}

void kvr_rep_note_progress(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n)
{
	struct kvr_replica *rep = ctx;
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_rec *x = kvr_rep_map_find(rep, rep->c.replica_id, attempt);
	if (!x) { /* admitted before attach: peers never saw it */
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	switch (op) {
	case KVR_OP_PREFILL_DONE:
		x->prefilled = true;
		send_simple(rep, KVR_MSG_PREFILL_DONE, attempt);
		break;
	case KVR_OP_OUTPUT:
		x->prefilled = true;
		if (kvr_rep_rec_append_out(x, tokens, n)) {
			rep->st.unpublished++;
			break;
		}
		rep->obuf.len = 0;
		rep->obuf.oom = false;
		size_t off = kvr_msg_begin(&rep->obuf, KVR_MSG_OUTPUT, rep->c.replica_id,
		                           rep->epoch, rep->seq + 1);
		kvr_msg_put_u64(&rep->obuf, attempt);
		kvr_msg_put_u32(&rep->obuf, (uint32_t)n);
		kvr_msg_put_u32(&rep->obuf, 0);
		kvr_msg_put_u32s(&rep->obuf, tokens, n);
		kvr_msg_end(&rep->obuf, off);
		send_stream(rep);
		break;
	default: /* finish, abort (a lease expiry comes as an abort: kvr_repl_note_expire) */
		send_simple(rep, op == KVR_OP_FINISH ? KVR_MSG_FINISH : KVR_MSG_ABORT, attempt);
		kvr_rep_map_remove(rep, x);
		kvr_rep_live_unlink(rep, x);
		kvr_rep_journal_add(rep, x);
		break;
	}
	pthread_mutex_unlock(&rep->mu);
}

void kvr_rep_note_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t incarnation,
                       uint64_t capacity, uint32_t mbt)
{
	struct kvr_replica *rep = ctx;
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_rank *e = kvr_rep_rank_get(rep, rank);
	if (e) {
		if (op == KVR_REPL_RANK_ADD) {
			e->incarnation = incarnation;
			e->capacity = capacity;
			e->mbt = mbt;
		} else if (op == KVR_REPL_RANK_CAPACITY) {
			if (incarnation != e->incarnation)
				kvr_rep_journal_clear(e);
			e->incarnation = incarnation;
			e->capacity = capacity;
		} else if (op == KVR_REPL_RANK_RESET) {
			kvr_rep_journal_clear(e);
			e->incarnation = incarnation;
		}
		struct kvr_rep_rank copy = *e;
		if (op == KVR_REPL_RANK_REMOVE)
			kvr_rep_rank_drop(rep, rank);
		send_rank(rep, (unsigned)op, &copy);
	}
	pthread_mutex_unlock(&rep->mu);
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

/* After a reconnect: RESET, then every own live attempt and every own attempt finished since
 * the outage began, so peers rebuild what they hold of us. */
void kvr_rep_reannounce(struct kvr_replica *rep, uint64_t since_ns)
{
	pthread_mutex_lock(&rep->mu);
	rep->want_reannounce = false;
	rep->reannounce_ms = 0;
	rep->connected = true;
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	size_t off =
	    kvr_msg_begin(&rep->obuf, KVR_MSG_RESET, rep->c.replica_id, rep->epoch, rep->seq + 1);
	kvr_msg_end(&rep->obuf, off);
	send_stream(rep);
	for (size_t i = 0; i < rep->n_ranks; i++) {
		send_rank(rep, KVR_REPL_RANK_ADD, &rep->ranks[i]);
		for (struct kvr_rep_rec *x = rep->ranks[i].jhead; x; x = x->next) {
			if (!since_ns || x->origin != rep->c.replica_id || x->fin_ns < since_ns)
				continue;
			rep->obuf.len = 0;
			rep->obuf.oom = false;
			kvr_rep_encode_attempt(&rep->obuf, KVR_MSG_ATTEMPT, rep->c.replica_id,
			                       rep->epoch, rep->seq + 1, x, true);
			send_stream(rep);
		}
	}
	for (struct kvr_rep_rec *x = rep->live_head; x; x = x->next) {
		if (x->origin != rep->c.replica_id)
			continue;
		rep->obuf.len = 0;
		rep->obuf.oom = false;
		kvr_rep_encode_attempt(&rep->obuf, KVR_MSG_ATTEMPT, rep->c.replica_id, rep->epoch,
		                       rep->seq + 1, x, false);
		send_stream(rep);
	}
	pthread_mutex_unlock(&rep->mu);
}
