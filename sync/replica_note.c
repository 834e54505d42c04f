/*
 * sync/replica_note.c - replica sync, the routing threads' side of the outbound queue (issue
 * 14): the router's notes (struct kvr_repl_hooks) copied into the ring for the sender
 * (sync/replica_out.c), through the staging slabs, and kept aside while the ring is full.
 *
 * A note must cost the routing path as little as possible: what the router did is copied once
 * into a record (an admission's hashes into the record that the tables keep) and pushed into an
 * MPSC ring (sync/ring.h, Concurrency Kit); the sender thread takes the table lock, numbers,
 * encodes and publishes.  Order: ring tickets are published in ticket order (a note whose
 * earlier slot is not committed within a short spin tags its own and leaves it to the sender:
 * sync/ring.h kvr_ring_commit_or_tag), so a note made after another note returned (an attempt's
 * lifecycle after its admission, on any thread) is dequeued after it, and the sender publishes in
 * dequeue order.  Snapshots stay exact: a
 * note still in the ring is neither in the tables nor published, so it lands after the fence.
 *
 * The routing thread's cost is what it writes into lines the sender holds (the slab it copies
 * the hashes into, the ring slot) and any full barrier after those writes, which makes it wait
 * until every line has come over.  So an admission takes its slab and ring slot (the locked
 * instructions) before it copies, commits with a plain store, and wakes the sender with
 * kvr_parker_wake_asym: no fence (the sender pays a membarrier(2) when it parks instead).
 * Before (fence per note, slab copy drained by the ring's CAS) perf put kvr_repl_note_route_slow
 * at ~8% of an attached route's samples, after ~5% (bench_sync, perf record -g;
 * docs/measurements.md).
 *
 * Waking the sender: a producer's kvr_parker_wake_asym makes no syscall unless the sender is
 * parked.  After the ring runs dry the sender keeps polling every OUT_POLL_NS for OUT_LINGER_NS
 * (sync/replica_out.c)
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

#include <sched.h>
#include <string.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"

#define OUT_FULL_WAIT_NS 100000000ull /* a full ring waits this long, then the note is kept */

void kvr_rep_out_discard(struct kvr_replica *rep, const struct kvr_msg *m)
{
	if (m->aux == OUT_ADMIT_SLAB) {
		uint64_t slabs;
		memcpy(&slabs, m->payload, sizeof(slabs));
		kvr_rep_slab_put(rep, slabs);
	} else if (m->aux == OUT_ADMIT) {
		struct kvr_rep_rec *x;
		memcpy(&x, m->payload, sizeof(x));
		kvr_rep_rec_free(x);
	} else if (m->aux == OUT_PROGRESS) {
		struct kvr_rep_out_progress p;
		memcpy(&p, m->payload, sizeof(p));
		if (p.n > OUT_INLINE)
			kvr_free(p.t.heap, (size_t)p.n * 4);
	}
}

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

void kvr_rep_kept_free(struct kvr_replica *rep, struct kvr_rep_kept *k)
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
		struct kvr_rep_out_progress p;
		memcpy(&p, payload, sizeof(p));
		if (p.n > OUT_INLINE)
			b += (size_t)p.n * 4;
	}
	return b;
}

/* Whether a queued OUT_PROGRESS payload is output. */
static bool progress_is_output(const void *payload)
{
	struct kvr_rep_out_progress p;
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
		kvr_rep_out_discard(rep, &m);
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

/* Whether notes are kept aside: a note made now is kept too, after them.  Relaxed: a note
 * made after a keep returned (on any thread, ordered by the caller) reads the kept stack or
 * the sender's exchange that took it, which handles the taken notes before it dequeues again. */
bool kvr_rep_keeping(const struct kvr_replica *rep)
{
	return __atomic_load_n(&rep->kept, __ATOMIC_RELAXED) != NULL ||
	       __atomic_load_n(&rep->kept_over, __ATOMIC_RELAXED);
}

void kvr_rep_out_push(struct kvr_replica *rep, unsigned kind, const void *payload, uint32_t len)
{
	uint64_t t0 = 0;
	while (kvr_rep_keeping(rep) || !kvr_ring_enqueue(&rep->outq, NULL, payload, len, kind)) {
		/* Full: the sender is far behind (a stalled connection).  Wait a while, then keep
		 * the note aside for the sender rather than stall routing for good. */
		uint64_t now = kvr_rep_mono_ns();
		if (!t0 && !kvr_rep_keeping(rep)) {
			t0 = now;
		} else if (kvr_rep_keeping(rep) || now - t0 > OUT_FULL_WAIT_NS) {
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
struct kvr_rep_rec *kvr_rep_rec_of_slabs(const struct kvr_replica *rep, uint64_t mask)
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
void kvr_rep_slab_put(struct kvr_replica *rep, uint64_t slabs)
{
	__atomic_fetch_or(&rep->slab_free, slabs, __ATOMIC_RELEASE);
}

/* An admission through a staging slab, in this order: take a slab and reserve the ring slot
 * (both locked instructions), copy into the slab (or, with no slab free, into a record), then
 * commit (a plain store; a tag, a locked exchange, only when an earlier note's producer is
 * slow) and wake the sender (asymmetric: no fence).  No locked instruction
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
			kvr_rep_slab_put(rep, 1ull << i);
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
	/* Atomic: the sender may read the slot's previous tag meanwhile (kvr_ring_pass_tagged). */
	__atomic_store_n(&slot->len, sizeof(void *), __ATOMIC_RELAXED);
	memcpy(slot->payload, m.payload, sizeof(void *));
	KVR_RING_IGNORE_END();
	kvr_ring_commit_or_tag(&rep->outq, ticket);
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
				kvr_rep_slab_put(rep, mask);
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
	kvr_rep_out_push(rep, OUT_ADMIT_SLAB, &mask, sizeof(mask));
	return true;
}

void kvr_rep_note_admit(void *ctx, const struct kvr_repl_admission *a)
{
	struct kvr_replica *rep = ctx;
	int rc = 0;
	if (a->n <= OUT_SLAB_BLOCKS && a->tail_n <= OUT_SLAB_TAIL && !kvr_rep_keeping(rep) &&
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
	kvr_rep_out_push(rep, OUT_ADMIT, &x, sizeof(x));
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
		struct kvr_rep_out_progress p = {.attempt = attempt,
		                                 .op = KVR_OP_OUTPUT,
		                                 .not_final = done + k < n || not_final,
		                                 .n = k};
		memcpy(p.t.inl, tokens + done, (size_t)k * 4);
		kvr_rep_out_push(rep, OUT_PROGRESS, &p, sizeof(p));
		done += k;
	}
}

void kvr_rep_note_progress(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n,
                           bool not_final)
{
	struct kvr_replica *rep = ctx;
	struct kvr_rep_out_progress p = {
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
	kvr_rep_out_push(rep, OUT_PROGRESS, &p, sizeof(p));
}

void kvr_rep_note_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t incarnation,
                       uint64_t capacity, uint32_t mbt, struct kvr_rank_life life)
{
	struct kvr_replica *rep = ctx;
	struct kvr_rep_out_rank k = {
	    .worker_id = rank.worker_id,
	    .incarnation = incarnation,
	    .capacity = capacity,
	    .life_gen = life.gen,
	    .dp_rank = rank.dp_rank,
	    .mbt = mbt,
	    .life_slot = life.slot,
	    .op = op,
	};
	kvr_rep_out_push(rep, OUT_RANK, &k, sizeof(k));
}
