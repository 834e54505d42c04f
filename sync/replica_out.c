/*
 * sync/replica_out.c - replica sync, outbound (issue 14): the router's notes (admissions,
 * lifecycle, rank changes) become stream messages with this replica's sequence numbers; after
 * an outage or when a peer asks, the replica re-announces its state.  The table update, the
 * sequence number and the publish happen under `mu` together, so a snapshot served under `mu`
 * is exactly "this replica's stream up to its fence".
 */
#include <sched.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

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
		flags |= (x->prefilled ? KVR_MSG_F_PREFILLED : 0) |
		         (finished ? KVR_MSG_F_FINISHED : 0) |
		         (x->out_counted && x->n_out ? KVR_MSG_F_OUT_COUNTED : 0);
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

void kvr_rep_stream_flush(struct kvr_replica *rep)
{
	uint32_t n = rep->sbatch_n;
	if (!n)
		return;
	if (rep->connected && !rep->sbuf.oom &&
	    rep->t.publish(rep->t.ctx, rep->sbuf.p, rep->sbuf.len) == 0) {
		rep->st.published += n;
		rep->st.batches++;
	} else {
		rep->st.unpublished += n;
		rep->seq -= n;
		/* Connected, yet not sent (no memory to encode, the transport refused): the peers
		 * see no gap (the numbers are given back) and no reconnect will re-announce, so a
		 * lost end would leave its attempt mirrored on every peer for good.  The apply
		 * thread re-announces instead (RESET, then the live attempts). */
		if (rep->connected)
			rep->want_reannounce = true;
	}
	rep->sbuf.len = 0;
	rep->sbuf.oom = false;
	rep->sbatch_n = 0;
}

/* The message just appended to sbuf (its header says seq + 1) is the next of the stream. */
static void stream_added(struct kvr_replica *rep)
{
	rep->seq++;
	rep->sbatch_n++;
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
	kvr_rep_encode_rank(&rep->sbuf, rep->c.replica_id, rep->epoch, rep->seq + 1, op, e);
	stream_added(rep);
}

/* ---------------------------------------------------------------- the sender (mu held) */

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
	                       rep->seq + 1, x, false);
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

static void out_progress(struct kvr_replica *rep, uint64_t attempt, int op, const uint32_t *tokens,
                         size_t n, bool not_final)
{
	struct kvr_rep_rec *x = kvr_rep_map_find(rep, rep->c.replica_id, attempt);
	if (!x) { /* admitted before attach (peers never saw it), or its admission is to come */
		if (op == KVR_OP_FINISH || op == KVR_OP_ABORT)
			kvr_rep_early_add(rep, attempt, kvr_rep_mono_ns());
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
		size_t off = kvr_msg_begin(&rep->sbuf, KVR_MSG_OUTPUT, rep->c.replica_id,
		                           rep->epoch, rep->seq + 1);
		kvr_msg_put_u64(&rep->sbuf, attempt);
		kvr_msg_put_u32(&rep->sbuf, (uint32_t)n);
		kvr_msg_put_u32(&rep->sbuf, not_final ? KVR_MSG_OUT_NOT_FINAL : 0);
		kvr_msg_put_u32s(&rep->sbuf, tokens, n);
		kvr_msg_end(&rep->sbuf, off);
		stream_added(rep);
		break;
	default: /* finish, abort (a lease expiry comes as an abort: kvr_repl_note_expire) */
		out_end(rep, x, op == KVR_OP_FINISH ? KVR_MSG_FINISH : KVR_MSG_ABORT);
		break;
	}
}

static void out_rank(struct kvr_replica *rep, int op, struct kvr_rank_id rank, uint64_t incarnation,
                     uint64_t capacity, uint32_t mbt)
{
	struct kvr_rep_rank *e = kvr_rep_rank_get(rep, rank);
	if (!e)
		return;
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

/* ---------------------------------------------------------------- the outbound queue
 *
 * A note must cost the routing path as little as possible: what the router did is copied once
 * into a record (an admission's hashes into the record that the tables keep) and pushed into an
 * MPSC ring (sync/ring.h, Concurrency Kit); the sender thread takes the table lock, numbers,
 * encodes and publishes.  Order: ring tickets are committed in ticket order, so a note made
 * after another note returned (an attempt's lifecycle after its admission, on any thread) is
 * dequeued after it, and the sender publishes in dequeue order.  Snapshots stay exact: a
 * note still in the ring is neither in the tables nor published, so it lands after the fence.
 *
 * The routing thread's cost is what it writes into lines the sender holds (the slab it copies
 * the hashes into, the ring slot) and any full barrier after those writes, which makes it wait
 * until every line has come over.  So an admission takes its slab and ring slot (the locked
 * instructions) before it copies, commits with a plain store, and wakes the sender with
 * kvr_parker_wake_asym: no fence (the sender pays a membarrier(2) when it parks instead).
 * Before (fence per note, slab copy drained by the ring's CAS) perf put kvr_repl_note_route_slow
 * at ~8% of an attached route's samples, after ~5% (bench_sync, perf record -g; README).
 *
 * Waking the sender: a producer's kvr_parker_wake_asym makes no syscall unless the sender is
 * parked.  After the ring runs dry the sender keeps polling every OUT_POLL_NS for OUT_LINGER_NS
 * before it parks, so a steady stream of notes never pays a FUTEX_WAKE on the routing path;
 * an idle router's sender sleeps (a note after a quiet spell pays one wake-up).  Parking after
 * 300 us of empty polls instead was tried (ad882f6): at 1000 admissions/s it spared most of the
 * ten empty polls per admission, but every admission then paid the wake-up on the routing
 * thread: bench_sync sync_route_paced p50 8.7-9.8 us -> 14.0-18.9 us (3 runs each, loaded
 * machine), so the routing path keeps the linger.
 *
 * A full queue.  The sender stalled (a publish blocked on a stalled connection; nothing else
 * holds it: while disconnected it takes notes and counts them unpublished) leaves notes no
 * room.  A note waits OUT_FULL_WAIT_NS for room, then is kept aside (note_keep: a list the
 * sender takes whole once the queue is empty), and so is every note made while any is kept, so
 * they stay in order: a note made after another returned is handled after it.  Before, every
 * note but an end was dropped (counted unpublished) after its wait, and nothing healed it: the
 * origin's tables never saw it either, so neither a re-announce nor a snapshot carried it (a
 * lost admission was never mirrored, lost output or prefill left the peers' load short for the
 * attempt's life, a lost rank change stayed lost for good: test_replica_oom
 * notes_not_dropped_by_a_full_queue).  What is kept, 80 B a note plus what it owns (an
 * admission's record, output tokens beyond OUT_INLINE), is capped at c.kept_bytes_max (64 MiB
 * by default): past it notes are dropped until the sender has caught up, then the attempts
 * whose end was among them are told as aborts and, if output was, the live ones take no more output
 * (kept_reconcile; before, a connection stalled for good grew it for good:
 * test_replica_notes kept_notes_capped_and_healed).  A note that cannot be kept for memory takes
 * one of KEPT_SPARE nodes set aside when the replica was made (an end lost then would leave its
 * attempt mirrored on every peer for good: end_kept_when_memory_is_short); only with those in use
 * too is it dropped (counted unpublished). */

enum {
	OUT_ADMIT = 1,
	OUT_PROGRESS = 2,
	OUT_RANK = 3,
	OUT_FLUSH = 4,
	OUT_ADMIT_SLAB = 5,
	OUT_NONE = 6 /* a reserved slot left empty (no memory: the note went through the slabs) */
};

#define OUT_INLINE       8 /* output tokens carried in the ring message itself */
#define OUT_BURST        32
#define OUT_POLL_NS      100000ull
#define OUT_LINGER_NS    1000000ull
#define OUT_FULL_WAIT_NS 100000000ull /* a full ring waits this long, then the note is kept */

struct out_progress {
	uint64_t attempt;
	int16_t op;
	uint16_t not_final;
	uint32_t n;
	union {
		uint32_t inl[OUT_INLINE];
		uint32_t *heap; /* n > OUT_INLINE: a kvr_alloc'd copy the sender frees */
	} t;
};

struct out_rank {
	uint64_t worker_id, incarnation, capacity;
	uint32_t dp_rank, mbt;
	int32_t op;
};

_Static_assert(sizeof(struct out_progress) <= KVR_MSG_PAYLOAD, "fits a ring message");
_Static_assert(sizeof(struct out_rank) <= KVR_MSG_PAYLOAD, "fits a ring message");

/* Frees what a queued message owns (it is not going out). */
static void slab_put(struct kvr_replica *rep, uint64_t slabs);

static void out_discard(struct kvr_replica *rep, const struct kvr_msg *m)
{
	if (m->aux == OUT_ADMIT_SLAB) {
		uint64_t slabs;
		memcpy(&slabs, m->payload, sizeof(slabs));
		slab_put(rep, slabs);
	} else if (m->aux == OUT_ADMIT) {
		struct kvr_rep_rec *x;
		memcpy(&x, m->payload, sizeof(x));
		kvr_rep_rec_free(x);
	} else if (m->aux == OUT_PROGRESS) {
		struct out_progress p;
		memcpy(&p, m->payload, sizeof(p));
		if (p.n > OUT_INLINE)
			kvr_free(p.t.heap, (size_t)p.n * 4);
	}
}

static uint64_t out_one(struct kvr_replica *rep, const struct kvr_msg *m);

/* A spare kept-note node (memory is short), or NULL if all are in use. */
static struct kvr_rep_kept *spare_get(struct kvr_replica *rep)
{
	uint64_t f = __atomic_load_n(&rep->kept_spare_free, __ATOMIC_RELAXED);
	while (f) {
		int i = __builtin_ctzll(f);
		if (__atomic_compare_exchange_n(&rep->kept_spare_free, &f, f & ~(1ull << i), true,
		                                __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
			rep->kept_spare[i].spare = true;
			return &rep->kept_spare[i];
		}
	}
	return NULL;
}

static void kept_free(struct kvr_replica *rep, struct kvr_rep_kept *k)
{
	__atomic_sub_fetch(&rep->kept_bytes, k->bytes, __ATOMIC_RELAXED);
	if (k->spare)
		__atomic_fetch_or(&rep->kept_spare_free, 1ull << (k - rep->kept_spare),
		                  __ATOMIC_RELEASE);
	else
		kvr_free(k, sizeof(*k));
}

/* What a kept note holds: its node and what the queue message owns (an admission's record,
 * output tokens past the inline ones; slabs are set aside at create and not counted). */
static size_t kept_bytes(unsigned kind, const void *payload)
{
	size_t b = sizeof(struct kvr_rep_kept);
	if (kind == OUT_ADMIT) {
		struct kvr_rep_rec *x;
		memcpy(&x, payload, sizeof(x));
		b += x->size;
	} else if (kind == OUT_PROGRESS) {
		struct out_progress p;
		memcpy(&p, payload, sizeof(p));
		if (p.n > OUT_INLINE)
			b += (size_t)p.n * 4;
	}
	return b;
}

#define KEPT_OVER        1u
#define KEPT_OVER_OUTPUT 2u

/* Whether a queued OUT_PROGRESS payload is output. */
static bool progress_is_output(const void *payload)
{
	struct out_progress p;
	memcpy(&p, payload, sizeof(p));
	return p.op == KVR_OP_OUTPUT;
}

/* Keeps a note aside (Treiber stack; the sender takes the whole stack at once, so there is no
 * ABA), in a spare node if memory is short, or drops it (counted unpublished) when none is
 * left either.  Past c.kept_bytes_max (a sender stalled for long), and from then on until the
 * sender has handled what is kept, notes are dropped (counted: over_cap) and the sender heals
 * what it can once it runs (kept_reconcile); rank changes (rare, small, and not recoverable
 * otherwise) and flush tickets (a drain waits for them) are kept whatever they hold. */
static void note_keep(struct kvr_replica *rep, unsigned kind, const void *payload, uint32_t len)
{
	size_t bytes = kept_bytes(kind, payload);
	bool always = kind == OUT_RANK || kind == OUT_FLUSH;
	struct kvr_rep_kept *k = NULL;
	/* kept_over: KEPT_OVER while notes are dropped, with KEPT_OVER_OUTPUT once output was.
	 * Read by an RMW, not a load: a note dropped here must be seen by the sender's reconcile
	 * (the router's end of its attempt, made before, happens before the sender's exchange
	 * that reads this; a plain load of 1 could be older than the exchange). */
	uint32_t lost = kind == OUT_PROGRESS && progress_is_output(payload) ? KEPT_OVER_OUTPUT : 0;
	uint32_t over = always ? 0 : __atomic_fetch_or(&rep->kept_over, 0, __ATOMIC_ACQ_REL);
	while (over && lost && !(over & lost) &&
	       !__atomic_compare_exchange_n(&rep->kept_over, &over, over | lost, true,
	                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
		; /* cleared meanwhile (over 0): the sender caught up, the note is kept */
	if (always || (!over && __atomic_add_fetch(&rep->kept_bytes, bytes, __ATOMIC_RELAXED) <=
	                            rep->c.kept_bytes_max)) {
		if (always)
			__atomic_add_fetch(&rep->kept_bytes, bytes, __ATOMIC_RELAXED);
		k = kvr_alloc(sizeof(*k));
		if (k)
			k->spare = false;
		else
			k = spare_get(rep);
		if (!k)
			__atomic_sub_fetch(&rep->kept_bytes, bytes, __ATOMIC_RELAXED);
	} else if (!over) { /* past the cap: from now on, until the sender has caught up */
		__atomic_sub_fetch(&rep->kept_bytes, bytes, __ATOMIC_RELAXED);
		over = __atomic_fetch_or(&rep->kept_over, KEPT_OVER | lost, __ATOMIC_ACQ_REL) | 1;
	}
	if (!k) {
		struct kvr_msg m = {.aux = kind};
		memcpy(m.payload, payload, len);
		out_discard(rep, &m);
		__atomic_add_fetch(&rep->out_dropped, 1, __ATOMIC_RELAXED);
		if (over)
			__atomic_add_fetch(&rep->over_cap, 1, __ATOMIC_RELAXED);
		return;
	}
	k->bytes = bytes;
	k->m.fn = NULL;
	k->m.len = len;
	k->m.aux = kind;
	memcpy(k->m.payload, payload, len);
	k->next = __atomic_load_n(&rep->kept, __ATOMIC_RELAXED);
	while (!__atomic_compare_exchange_n(&rep->kept, &k->next, k, true, __ATOMIC_RELEASE,
	                                    __ATOMIC_RELAXED))
		;
	kvr_parker_wake_asym(&rep->out_park);
}

/* Handles the kept notes, oldest first, once the queue is empty (every note made before them is
 * handled by then, and every note made after them was kept too).  Returns the highest flush
 * ticket among them (0 if none).  Context: the sender, mu held. */
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
		kept_free(rep, old);
		old = nx;
	}
	return ticket;
}

/* Whether notes are kept aside: a note made now is kept too, after them.  Relaxed: a note
 * made after a keep returned (on any thread, ordered by the caller) reads the kept stack or
 * the sender's exchange that took it, which handles the taken notes before it dequeues again. */
static bool keeping(const struct kvr_replica *rep)
{
	return __atomic_load_n(&rep->kept, __ATOMIC_RELAXED) != NULL ||
	       __atomic_load_n(&rep->kept_over, __ATOMIC_RELAXED);
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

static void out_push(struct kvr_replica *rep, unsigned kind, const void *payload, uint32_t len)
{
	uint64_t t0 = 0;
	while (keeping(rep) || !kvr_ring_enqueue(&rep->outq, NULL, payload, len, kind)) {
		/* Full: the sender is far behind (a stalled connection).  Wait a while, then keep
		 * the note aside for the sender rather than stall routing for good. */
		uint64_t now = kvr_rep_mono_ns();
		if (!t0 && !keeping(rep)) {
			t0 = now;
		} else if (keeping(rep) || now - t0 > OUT_FULL_WAIT_NS) {
			note_keep(rep, kind, payload, len);
			return;
		}
		kvr_parker_wake_asym(&rep->out_park);
		sched_yield();
	}
	kvr_parker_wake_asym(&rep->out_park);
}

/* An own admission's record (blocks and tail copied from the arguments; not filled when
 * NULL), or NULL. */
static struct kvr_rep_rec *rec_of(const struct kvr_replica *rep, const struct kvr_repl_admission *a,
                                  const uint64_t *blocks, const uint32_t *tail)
{
	struct kvr_rep_rec *x = kvr_rep_rec_new(a->n, a->tail_n);
	if (!x)
		return NULL;
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
	if (a->n && blocks)
		memcpy(x->blocks, blocks, (size_t)a->n * 8);
	if (a->tail_n && tail)
		memcpy(x->tail, tail, (size_t)a->tail_n * 4);
	return x;
}

/* The record of an admission staged in the slabs of mask: the lowest holds the admission and
 * the first part of its blocks and tail, each next one the next part (note_admit_slabs).  NULL
 * when out of memory.  Context: the sender. */
static struct kvr_rep_rec *rec_of_slabs(const struct kvr_replica *rep, uint64_t mask)
{
	const struct kvr_rep_slab *first = &rep->slabs[__builtin_ctzll(mask)];
	if (!(mask & (mask - 1)))
		return rec_of(rep, &first->a, first->blocks, first->tail);
	struct kvr_rep_rec *x = rec_of(rep, &first->a, NULL, NULL);
	if (!x)
		return NULL;
	uint32_t nb = 0, nt = 0;
	for (uint64_t m = mask; m; m &= m - 1) {
		const struct kvr_rep_slab *sl = &rep->slabs[__builtin_ctzll(m)];
		uint32_t kb =
		    x->n_blocks - nb < OUT_SLAB_BLOCKS ? x->n_blocks - nb : OUT_SLAB_BLOCKS;
		uint32_t kt = x->tail_n - nt < OUT_SLAB_TAIL ? x->tail_n - nt : OUT_SLAB_TAIL;
		memcpy(x->blocks + nb, sl->blocks, (size_t)kb * 8);
		memcpy(x->tail + nt, sl->tail, (size_t)kt * 4);
		nb += kb;
		nt += kt;
	}
	return x;
}

/* Moves the lowest SLAB_BATCH free slabs from slab_free (the sender's line) to slab_mine
 * (the producers' line); returns slab_mine after, or 0 if none was free.  A small batch keeps
 * the slabs in use few (warm in the routing thread's cache: at 1 note per sender poll they are
 * back before the next refill), and costs the sender's line one RMW per SLAB_BATCH notes. */
#define SLAB_BATCH 8
static uint64_t slab_refill(struct kvr_replica *rep)
{
	uint64_t f = __atomic_load_n(&rep->slab_free, __ATOMIC_RELAXED), take;
	do {
		if (!f)
			return 0;
		take = 0;
		uint64_t x = f;
		for (int j = 0; j < SLAB_BATCH && x; j++) {
			take |= x & (~x + 1);
			x &= x - 1;
		}
	} while (!__atomic_compare_exchange_n(&rep->slab_free, &f, f & ~take, true,
	                                      __ATOMIC_ACQUIRE, __ATOMIC_RELAXED));
	return __atomic_fetch_or(&rep->slab_mine, take, __ATOMIC_RELEASE) | take;
}

/* Takes a free staging slab, lowest index first (the recently used ones are warm in cache).
 * Returns its index or -1.  Two bitmaps on two lines: the sender returns slabs into
 * slab_free; producers take from slab_mine, refilled by slab_refill only when empty.  So a
 * note's CAS is on a line that only producers write.  Ordering: the sender's release
 * (slab_put) -> the refill's acquire CAS -> its release fetch_or -> the taker's acquire CAS:
 * the sender's reads of a slab happen before our writes. */
static int slab_get(struct kvr_replica *rep)
{
	uint64_t m = __atomic_load_n(&rep->slab_mine, __ATOMIC_RELAXED);
	for (;;) {
		if (!m && !(m = slab_refill(rep)))
			return -1;
		int i = __builtin_ctzll(m);
		if (__atomic_compare_exchange_n(&rep->slab_mine, &m, m & ~(1ull << i), true,
		                                __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
			return i;
	}
}

/* Gives the slabs of mask back.  Context: the sender, or a producer giving back slabs it took. */
static void slab_put(struct kvr_replica *rep, uint64_t slabs)
{
	__atomic_fetch_or(&rep->slab_free, slabs, __ATOMIC_RELEASE);
}

/* An admission through a staging slab, in this order: take a slab and reserve the ring slot
 * (both locked instructions), copy into the slab (or, with no slab free, into a record), then
 * commit (a plain store) and wake the sender (asymmetric: no fence).  No locked instruction
 * follows the copy on this thread, so its stores (into lines the sender read last time) drain
 * while the route goes on instead of stalling it.  Returns 1 (queued), 0 if the ring is full
 * (nothing taken), -1 if no slab was free and no record could be allocated (the slot holds
 * nothing: the caller waits for slabs). */
static int note_admit_reserved(struct kvr_replica *rep, const struct kvr_repl_admission *a)
{
	int i = slab_get(rep);
	uint32_t ticket;
	struct kvr_msg *slot = kvr_ring_reserve(&rep->outq, &ticket);
	if (!slot) {
		if (i >= 0)
			slab_put(rep, 1ull << i);
		return 0;
	}
	struct kvr_msg m = {.aux = OUT_ADMIT_SLAB};
	if (i >= 0) {
		struct kvr_rep_slab *sl = &rep->slabs[i];
		sl->a = *a;
		if (a->n)
			memcpy(sl->blocks, a->local, (size_t)a->n * 8);
		if (a->tail_n)
			memcpy(sl->tail, a->tail, (size_t)a->tail_n * 4);
		uint64_t slabs = 1ull << i;
		memcpy(m.payload, &slabs, sizeof(slabs));
	} else { /* every slab is queued (the sender is behind): the record itself */
		struct kvr_rep_rec *x = rec_of(rep, a, a->local, a->tail);
		m.aux = x ? OUT_ADMIT : OUT_NONE; /* none: the caller waits for slabs */
		memcpy(m.payload, &x, sizeof(x));
	}
	if (kvr_rep_tracing(rep->c.replica_id))
		kvr_rep_trace_stamp(a->attempt, KVR_TR_NOTE, 0);
	KVR_RING_IGNORE_BEGIN();
	slot->fn = NULL;
	slot->aux = m.aux;
	slot->len = sizeof(void *);
	memcpy(slot->payload, m.payload, sizeof(void *));
	KVR_RING_IGNORE_END();
	kvr_ring_commit(&rep->outq, ticket);
	kvr_parker_wake_asym(&rep->out_park);
	return m.aux == OUT_NONE ? -1 : 1;
}

/* An admission whose record cannot be allocated on the routing thread (memory is short): it
 * goes through the staging slabs instead, as many as it needs (its blocks and tail cut in
 * slab-sized parts, in the slabs' index order; rec_of_slabs joins them), waited for while the
 * sender hands slabs back, at most OUT_FULL_WAIT_NS.  Before, the admission was dropped
 * (counted unpublished) and nothing healed it: its origin's tables never had it, so neither a
 * re-announce nor a snapshot carried it, and every peer's load and prediction stayed short of
 * the origin's (test_replica_notes long_admission_mirrored_when_its_record_fails).  Returns
 * false when the slabs do not come: the prompt needs more than all of them (OUT_SLABS x
 * OUT_SLAB_BLOCKS blocks, 2M tokens at 16 a block), or the sender stays stalled with them
 * queued; the caller counts it. */
static bool note_admit_slabs(struct kvr_replica *rep, const struct kvr_repl_admission *a)
{
	uint32_t k = (a->n + OUT_SLAB_BLOCKS - 1) / OUT_SLAB_BLOCKS,
	         kt = (a->tail_n + OUT_SLAB_TAIL - 1) / OUT_SLAB_TAIL;
	k = k > kt ? k : kt;
	k = k ? k : 1;
	if (k > OUT_SLABS)
		return false;
	uint64_t mask = 0, t0 = kvr_rep_mono_ns();
	for (uint32_t got = 0; got < k;) {
		int i = slab_get(rep);
		if (i >= 0) {
			mask |= 1ull << i;
			got++;
			continue;
		}
		if (kvr_rep_mono_ns() - t0 > OUT_FULL_WAIT_NS) {
			if (mask)
				slab_put(rep, mask);
			return false;
		}
		kvr_parker_wake_asym(&rep->out_park);
		sched_yield();
	}
	uint32_t nb = 0, nt = 0;
	rep->slabs[__builtin_ctzll(mask)].a = *a;
	for (uint64_t m = mask; m; m &= m - 1) {
		struct kvr_rep_slab *sl = &rep->slabs[__builtin_ctzll(m)];
		uint32_t kb = a->n - nb < OUT_SLAB_BLOCKS ? a->n - nb : OUT_SLAB_BLOCKS;
		uint32_t kk = a->tail_n - nt < OUT_SLAB_TAIL ? a->tail_n - nt : OUT_SLAB_TAIL;
		if (kb)
			memcpy(sl->blocks, a->local + nb, (size_t)kb * 8);
		if (kk)
			memcpy(sl->tail, a->tail + nt, (size_t)kk * 4);
		nb += kb;
		nt += kk;
	}
	if (kvr_rep_tracing(rep->c.replica_id))
		kvr_rep_trace_stamp(a->attempt, KVR_TR_NOTE, 0);
	out_push(rep, OUT_ADMIT_SLAB, &mask, sizeof(mask));
	return true;
}

void kvr_rep_note_admit(void *ctx, const struct kvr_repl_admission *a)
{
	struct kvr_replica *rep = ctx;
	int rc = 0;
	if (a->n <= OUT_SLAB_BLOCKS && a->tail_n <= OUT_SLAB_TAIL && !keeping(rep) &&
	    (rc = note_admit_reserved(rep, a)) > 0)
		return;
	/* Too large for a slab, the ring is full or notes are kept: a record; out_push waits for
	 * room or keeps it.  No memory for it: the slabs. */
	struct kvr_rep_rec *x = rc < 0 ? NULL : rec_of(rep, a, a->local, a->tail);
	if (!x) {
		if (!note_admit_slabs(rep, a))
			__atomic_add_fetch(&rep->out_dropped, 1, __ATOMIC_RELAXED);
		return;
	}
	if (kvr_rep_tracing(rep->c.replica_id))
		kvr_rep_trace_stamp(a->attempt, KVR_TR_NOTE, 0);
	out_push(rep, OUT_ADMIT, &x, sizeof(x));
}

/* Output whose copy cannot be allocated (memory is short) goes out in notes of OUT_INLINE
 * tokens each, the ones before the last as not final (a token follows them): what one call
 * counted, as a peer applies it (sync/replica_apply.c apply_output cuts it the same way).
 * Before, it was dropped (counted unpublished) and nothing healed it: the origin's record never
 * had it either, so a re-announce did not carry it, and the peers' decode blocks stayed short
 * (test_replica_notes long_output_mirrored_when_its_copy_fails).  Consecutive notes of one
 * call: a note of another call for the attempt made after this returns comes after them. */
static void note_output_inline(struct kvr_replica *rep, uint64_t attempt, const uint32_t *tokens,
                               uint32_t n, bool not_final)
{
	for (uint32_t done = 0; done < n;) {
		uint32_t k = n - done < OUT_INLINE ? n - done : OUT_INLINE;
		struct out_progress p = {.attempt = attempt,
		                         .op = KVR_OP_OUTPUT,
		                         .not_final = done + k < n || not_final,
		                         .n = k};
		memcpy(p.t.inl, tokens + done, (size_t)k * 4);
		out_push(rep, OUT_PROGRESS, &p, sizeof(p));
		done += k;
	}
}

void kvr_rep_note_progress(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n,
                           bool not_final)
{
	struct kvr_replica *rep = ctx;
	struct out_progress p = {
	    .attempt = attempt, .op = (int16_t)op, .not_final = not_final, .n = (uint32_t)n};
	if (op != KVR_OP_OUTPUT || n > UINT32_MAX)
		p.n = 0;
	if (p.n > OUT_INLINE) {
		p.t.heap = kvr_alloc((size_t)p.n * 4);
		if (!p.t.heap) {
			note_output_inline(rep, attempt, tokens, p.n, not_final);
			return;
		}
		memcpy(p.t.heap, tokens, (size_t)p.n * 4);
	} else if (p.n) {
		memcpy(p.t.inl, tokens, (size_t)p.n * 4);
	}
	out_push(rep, OUT_PROGRESS, &p, sizeof(p));
}

void kvr_rep_note_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t incarnation,
                       uint64_t capacity, uint32_t mbt)
{
	struct kvr_replica *rep = ctx;
	struct out_rank k = {
	    .worker_id = rank.worker_id,
	    .incarnation = incarnation,
	    .capacity = capacity,
	    .dp_rank = rank.dp_rank,
	    .mbt = mbt,
	    .op = op,
	};
	out_push(rep, OUT_RANK, &k, sizeof(k));
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
		for (int tries = 0; !(x = rec_of_slabs(rep, slabs)) && sender_pause(rep, &tries);)
			;
		slab_put(rep, slabs);
		if (x)
			out_admit(rep, x);
		else
			rep->st.unpublished++;
		return 0;
	}
	case OUT_PROGRESS: {
		struct out_progress p;
		memcpy(&p, m->payload, sizeof(p));
		out_progress(rep, p.attempt, p.op, p.n > OUT_INLINE ? p.t.heap : p.t.inl, p.n,
		             p.not_final);
		if (p.n > OUT_INLINE)
			kvr_free(p.t.heap, (size_t)p.n * 4);
		return 0;
	}
	case OUT_RANK: {
		struct out_rank k;
		memcpy(&k, m->payload, sizeof(k));
		out_rank(rep, k.op, (struct kvr_rank_id){k.worker_id, k.dp_rank}, k.incarnation,
		         k.capacity, k.mbt);
		return 0;
	}
	case OUT_NONE:
		return 0;
	case OUT_FLUSH: {
		uint64_t ticket;
		memcpy(&ticket, m->payload, sizeof(ticket));
		return ticket;
	}
	}
	return 0;
}

static void *out_main(void *arg)
{
	struct kvr_replica *rep = arg;
	/* Poll sleeps of OUT_POLL_NS, not the default 50 us of slack on top. */
	prctl(PR_SET_TIMERSLACK, 1000UL);
	prctl(PR_SET_NAME, "kvr-sync-out");
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_REPLICA); /* scoped test failures (core/alloc.h) */
	struct kvr_msg batch[OUT_BURST];
	uint64_t idle_since = 0;
	for (;;) {
		if (kvr_rep_sender_stalled(rep, kvr_rep_mono_ns())) { /* kvr_replica_stall */
			struct timespec ts = {0, 2000000};
			nanosleep(&ts, NULL);
			continue;
		}
		uint32_t n = kvr_ring_dequeue_burst(&rep->outq, batch, OUT_BURST);
		bool kept = !n && keeping(rep); /* the queue is empty: their turn */
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
			if (ticket) {
				pthread_mutex_lock(&rep->qmu);
				if (ticket > rep->flush_done)
					rep->flush_done = ticket;
				pthread_cond_broadcast(&rep->donecv);
				pthread_mutex_unlock(&rep->qmu);
			}
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
		if (kvr_ring_depth(&rep->outq) || keeping(rep) ||
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
	if (pthread_create(&rep->out_thread, NULL, out_main, rep))
		return KVR_EBUSY;
	rep->out_started = true;
	return 0;
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
	out_push(rep, OUT_FLUSH, &ticket, sizeof(ticket));
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

void kvr_rep_out_fini(struct kvr_replica *rep)
{
	struct kvr_msg m;
	if (!rep->outq.buf)
		return;
	while (kvr_ring_dequeue(&rep->outq, &m))
		out_discard(rep, &m);
	for (struct kvr_rep_kept *k = rep->kept, *nx; k; k = nx) {
		nx = k->next;
		out_discard(rep, &k->m);
		kept_free(rep, k);
	}
	rep->kept = NULL;
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

/* After a reconnect: RESET, then every own live attempt and every own attempt finished since
 * the outage began, so peers rebuild what they hold of us. */
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
	for (size_t i = 0; i < rep->n_ranks; i++) {
		send_rank(rep, KVR_REPL_RANK_ADD, &rep->ranks[i]);
		for (struct kvr_rep_rec *x = rep->ranks[i].jhead; x; x = x->next) {
			if (!since_ns || x->origin != rep->c.replica_id || x->fin_ns < since_ns)
				continue;
			kvr_rep_encode_attempt(&rep->sbuf, KVR_MSG_ATTEMPT, rep->c.replica_id,
			                       rep->epoch, rep->seq + 1, x, true);
			stream_added(rep);
		}
	}
	for (struct kvr_rep_rec *x = rep->live_head; x; x = x->next) {
		if (x->origin != rep->c.replica_id)
			continue;
		kvr_rep_encode_attempt(&rep->sbuf, KVR_MSG_ATTEMPT, rep->c.replica_id, rep->epoch,
		                       rep->seq + 1, x, false);
		stream_added(rep);
	}
	kvr_rep_stream_flush(rep);
	pthread_mutex_unlock(&rep->mu);
}
