/*
 * sync/replica.c - router replica sync: every replica applies its peers' admissions, output,
 * prefill done, finish/abort and rank changes to its own router as if it had routed them
 * (issue 14).  Transport-agnostic: NATS (sync/replica_nats.c) or an in-process bus
 * (sync/replica_bus.c) deliver bytes; the wire format is sync/replica_msg.h.
 *
 * The idea.  Dynamo replicates load (ActiveSequenceEvent) but not the approximate-LRU
 * prediction, so each router predicts only from its own share of the traffic.  Here the unit of
 * replication is the admission itself: the rank the origin chose, the prompt's local block
 * hashes, prompt tokens, predicted cached prefix and expected output.  A peer books exactly that
 * on exactly that rank (kvr_repl_admit: the same shard path as kvr_route's admission, no
 * selection), so its predicted cache, index and load go through the same state machine with
 * the same inputs; lifecycle messages then name the origin's attempt, which a map
 * (origin replica, origin attempt) -> local attempt turns into the local calls.
 *
 * Streams and positions.  Each replica numbers its stream messages 1, 2, ... within an epoch
 * (its start time: a restart with the same id is a new epoch).  A peer applies an origin's
 * message only if it is the next one; an old one is a duplicate (dropped), a jump ahead is a gap
 * (messages were lost): applied, counted, and the origin is asked (SNAP_REQ on the stream) to
 * send RESET and its live attempts again, plus what it finished during its last outage.  NATS keeps
 * one publisher's order on one subject, so in a healthy cluster there are no gaps.
 *
 * Snapshots.  A new replica subscribes to the stream first, then asks any ready peer (a NATS
 * queue group) for a snapshot: FENCE records (each origin's stream position the snapshot
 * includes), RANK records, ghost ATTEMPTs (recently finished attempts, per rank in release
 * order: replaying admit + output + finish rebuilds the predicted LRU content and order), and
 * live ATTEMPTs (with prefill state and output so far).  The snapshot is built on the provider's
 * apply thread, the only thread that applies peers' messages, under the table lock that its own
 * notes take with their sequence numbers, so it is exactly "every origin's stream up to its
 * fence".  The receiver collects every chunk first (never half-applied), releases what it
 * mirrored before, applies the records, sets the fences, then handles the messages queued
 * meanwhile: those at or below a fence are duplicates.
 *
 * Liveness.  Heartbeats every heartbeat_ms carry the sender's stream position (lag).  A peer
 * silent for dead_after periods, or saying goodbye, is gone: its mirrored attempts are aborted
 * on this router (their blocks stay predicted, as on the engine), so every replica releases
 * them within dead_after * heartbeat_ms plus delivery.  A peer heard again after that is
 * resynced (its attempts were released here).
 *
 * Outage.  While disconnected, notes are not sent (counted as unpublished) and routing goes on
 * on local knowledge.  On reconnect the replica sends RESET (peers drop what they mirror of it),
 * re-announces its live attempts and the attempts it finished during the outage (as ATTEMPTs),
 * then resyncs from a peer's snapshot to learn what it missed.
 *
 * Threads and locks.  Notes run on frontend threads (inside the router's RCU read section) and
 * take `mu` briefly: sequence number, send, table update.  One apply thread per replica handles
 * everything delivered (a queue under `qmu`), heartbeats and snapshots; it calls the router
 * WITHOUT holding `mu` (router calls may wait for grace periods, which a note blocked on `mu`
 * inside its read section would prevent), then updates the tables under `mu`.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/replica_hooks.h"
#include "sync/replica.h"
#include "sync/replica_msg.h"
#include "sync/rcu.h"

#define MAX_PEERS   256
#define CHUNK_BYTES (256u * 1024u)
/* After an outage a replica re-announces the attempts it finished since this long before the
 * disconnect was noticed: messages written to the socket just before the server went may never
 * have reached it, and replaying a finished attempt twice only refreshes its blocks. */
#define OUTAGE_MARGIN_NS 2000000000ull
/* A re-announce asked for after a gap covers attempts finished this long ago; one asked for by a
 * peer that had given us up covers the time since, plus this margin. */
#define GAP_WINDOW_MS      10000u
#define GIVEN_UP_MARGIN_MS 2000u

struct item {
	struct item *next;
	size_t len;
	char *reply;
	uint8_t data[];
};

/* One attempt this replica knows: its own (origin = self) or a peer's mirrored here. */
struct rec {
	struct rec *hnext;       /* map chain */
	struct rec *prev, *next; /* the live list, or its rank's journal once finished */
	uint64_t origin, oepoch, oattempt, local;
	struct kvr_rank_id rank;
	uint64_t incarnation, prompt_tokens, lora_seed, fin_no, fin_ns;
	uint32_t overlap, expected, n_blocks, tail_n, n_out, out_cap;
	bool chain_known, prefilled;
	bool seen; /* resync: named by the snapshot */
	uint64_t *blocks;
	uint32_t *tail;
	uint32_t *out;
	size_t size;
};

struct rank_ent {
	struct kvr_rank_id id;
	uint64_t incarnation, capacity;
	uint32_t mbt;
	struct rec *jhead, *jtail; /* finished attempts, oldest first */
	uint64_t jblocks;
};

struct peer {
	uint64_t id, epoch, last_seq, hb_seq, last_seen;
	bool alive, lost;
	uint64_t lost_ns; /* when it was given up */
	uint64_t live;
};

struct kvr_replica {
	struct kvr_router *r;
	struct kvr_replica_config c;
	struct kvr_replica_transport t;
	struct kvr_repl_hooks hooks;
	uint64_t epoch;
	uint32_t bs;

	pthread_mutex_t mu; /* everything below up to the queue */
	uint64_t seq;       /* own stream position */
	bool connected;
	struct kvr_msg_buf obuf;
	struct rec **map;
	size_t map_cap, map_n;
	struct rec *live_head, *live_tail;
	struct rank_ent *ranks;
	size_t n_ranks, ranks_cap;
	struct peer peers[MAX_PEERS];
	size_t n_peers;
	uint64_t fin_no, outage_ns; /* outage_ns: when the last disconnect was seen */
	struct kvr_sync_stats st;

	pthread_mutex_t qmu;
	pthread_cond_t qcv, donecv;
	struct item *qhead, *qtail;
	uint64_t q_in, q_done;
	bool stop, want_reconnect, want_resync, ready;
	bool want_reannounce;   /* under mu: a peer asked (SNAP_REQ on the stream) */
	uint64_t reannounce_ms; /* under mu: how far back the askers need finished attempts */
	uint64_t reconnect_ns;  /* apply thread: when the last outage ended */
	pthread_t thread;
	bool thread_started;
};

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---------------------------------------------------------------- records and tables (mu) */

static size_t hslot(const struct kvr_replica *rep, uint64_t origin, uint64_t attempt)
{
	uint64_t h = (origin * 0x9e3779b97f4a7c15ull) ^ (attempt * 0xc2b2ae3d27d4eb4full);
	h ^= h >> 29;
	return (size_t)(h & (rep->map_cap - 1));
}

static struct rec *map_find(struct kvr_replica *rep, uint64_t origin, uint64_t attempt)
{
	if (!rep->map_cap)
		return NULL;
	for (struct rec *x = rep->map[hslot(rep, origin, attempt)]; x; x = x->hnext)
		if (x->origin == origin && x->oattempt == attempt)
			return x;
	return NULL;
}

static int map_insert(struct kvr_replica *rep, struct rec *x)
{
	if (rep->map_n + 1 > rep->map_cap / 2) {
		size_t nc = rep->map_cap ? rep->map_cap * 2 : 1024;
		struct rec **nm = kvr_calloc(nc, sizeof(*nm));
		if (!nm)
			return KVR_ENOMEM;
		struct rec **old = rep->map;
		size_t oc = rep->map_cap;
		rep->map = nm;
		rep->map_cap = nc;
		for (size_t i = 0; i < oc; i++)
			for (struct rec *y = old[i], *nx; y; y = nx) {
				nx = y->hnext;
				size_t k = hslot(rep, y->origin, y->oattempt);
				y->hnext = nm[k];
				nm[k] = y;
			}
		kvr_free(old, oc * sizeof(*old));
	}
	size_t k = hslot(rep, x->origin, x->oattempt);
	x->hnext = rep->map[k];
	rep->map[k] = x;
	rep->map_n++;
	return 0;
}

static void map_remove(struct kvr_replica *rep, struct rec *x)
{
	struct rec **pp = &rep->map[hslot(rep, x->origin, x->oattempt)];
	while (*pp && *pp != x)
		pp = &(*pp)->hnext;
	if (*pp) {
		*pp = x->hnext;
		rep->map_n--;
	}
}

static void live_link(struct kvr_replica *rep, struct rec *x)
{
	x->next = NULL;
	x->prev = rep->live_tail;
	if (rep->live_tail)
		rep->live_tail->next = x;
	else
		rep->live_head = x;
	rep->live_tail = x;
}

static void live_unlink(struct kvr_replica *rep, struct rec *x)
{
	if (x->prev)
		x->prev->next = x->next;
	else
		rep->live_head = x->next;
	if (x->next)
		x->next->prev = x->prev;
	else
		rep->live_tail = x->prev;
	x->prev = x->next = NULL;
}

static void rec_free(struct rec *x)
{
	if (!x)
		return;
	kvr_free(x->out, (size_t)x->out_cap * sizeof(uint32_t));
	kvr_free(x, x->size);
}

/* A record with room for n blocks and tail_n tail tokens (copied from the arguments). */
static struct rec *rec_new(uint32_t n, uint32_t tail_n)
{
	size_t size = sizeof(struct rec) + (size_t)n * 8 + (size_t)tail_n * 4;
	struct rec *x = kvr_alloc(size); /* the arrays are filled by the caller */
	if (!x)
		return NULL;
	memset(x, 0, sizeof(*x));
	x->size = size;
	x->n_blocks = n;
	x->tail_n = tail_n;
	x->blocks = (uint64_t *)(void *)(x + 1);
	x->tail = (uint32_t *)(void *)(x->blocks + n);
	return x;
}

static int rec_append_out(struct rec *x, const uint32_t *t, size_t n)
{
	if (!n)
		return 0;
	if (x->n_out + n > KVR_MSG_MAX_BLOCKS)
		return KVR_ERANGE;
	if (x->n_out + n > x->out_cap) {
		size_t nc = x->out_cap ? x->out_cap : 64;
		while (nc < x->n_out + n)
			nc *= 2;
		uint32_t *p = kvr_realloc(x->out, (size_t)x->out_cap * 4, nc * 4);
		if (!p)
			return KVR_ENOMEM;
		x->out = p;
		x->out_cap = (uint32_t)nc;
	}
	memcpy(x->out + x->n_out, t, n * 4);
	x->n_out += (uint32_t)n;
	return 0;
}

static struct rank_ent *rank_find(struct kvr_replica *rep, struct kvr_rank_id id)
{
	for (size_t i = 0; i < rep->n_ranks; i++)
		if (rep->ranks[i].id.worker_id == id.worker_id &&
		    rep->ranks[i].id.dp_rank == id.dp_rank)
			return &rep->ranks[i];
	return NULL;
}

static struct rank_ent *rank_get(struct kvr_replica *rep, struct kvr_rank_id id)
{
	struct rank_ent *e = rank_find(rep, id);
	if (e)
		return e;
	if (rep->n_ranks == rep->ranks_cap) {
		size_t nc = rep->ranks_cap ? rep->ranks_cap * 2 : 16;
		struct rank_ent *p =
		    kvr_realloc(rep->ranks, rep->ranks_cap * sizeof(*p), nc * sizeof(*p));
		if (!p)
			return NULL;
		rep->ranks = p;
		rep->ranks_cap = nc;
	}
	e = &rep->ranks[rep->n_ranks++];
	memset(e, 0, sizeof(*e));
	e->id = id;
	e->capacity = KVR_CAPACITY_NONE;
	return e;
}

static void journal_clear(struct rank_ent *e)
{
	for (struct rec *x = e->jhead, *nx; x; x = nx) {
		nx = x->next;
		rec_free(x);
	}
	e->jhead = e->jtail = NULL;
	e->jblocks = 0;
}

static void rank_drop(struct kvr_replica *rep, struct kvr_rank_id id)
{
	struct rank_ent *e = rank_find(rep, id);
	if (!e)
		return;
	journal_clear(e);
	*e = rep->ranks[--rep->n_ranks];
}

static uint64_t rec_blocks(const struct kvr_replica *rep, const struct rec *x)
{
	return x->n_blocks + (x->tail_n + x->n_out) / rep->bs;
}

/* A finished attempt joins its rank's journal (the blocks it leaves in the predicted cache);
 * the oldest go when the journal exceeds its budget.  Takes x (freed if it has no place). */
static void journal_add(struct kvr_replica *rep, struct rec *x)
{
	struct rank_ent *e = rank_find(rep, x->rank);
	if (!e) {
		rec_free(x);
		return;
	}
	x->fin_no = ++rep->fin_no;
	x->fin_ns = mono_ns();
	x->next = NULL;
	x->prev = e->jtail;
	if (e->jtail)
		e->jtail->next = x;
	else
		e->jhead = x;
	e->jtail = x;
	e->jblocks += rec_blocks(rep, x);
	uint64_t budget = rep->c.journal_blocks;
	if (!budget)
		budget = e->capacity && e->capacity != KVR_CAPACITY_NONE ? 2 * e->capacity : 65536;
	while (e->jblocks > budget && e->jhead != e->jtail) {
		struct rec *o = e->jhead;
		e->jhead = o->next;
		e->jhead->prev = NULL;
		e->jblocks -= rec_blocks(rep, o);
		rec_free(o);
	}
}

static struct peer *peer_find(struct kvr_replica *rep, uint64_t id)
{
	for (size_t i = 0; i < rep->n_peers; i++)
		if (rep->peers[i].id == id)
			return &rep->peers[i];
	return NULL;
}

static struct peer *peer_get(struct kvr_replica *rep, uint64_t id)
{
	struct peer *p = peer_find(rep, id);
	if (p || rep->n_peers == MAX_PEERS)
		return p;
	p = &rep->peers[rep->n_peers++];
	memset(p, 0, sizeof(*p));
	p->id = id;
	return p;
}

/* ---------------------------------------------------------------- sending (mu held) */

static void encode_attempt(struct kvr_msg_buf *b, unsigned type, uint64_t replica, uint64_t epoch,
                           uint64_t seq, const struct rec *x, bool finished)
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

static void send_rank(struct kvr_replica *rep, unsigned op, const struct rank_ent *e)
{
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	size_t off =
	    kvr_msg_begin(&rep->obuf, KVR_MSG_RANK, rep->c.replica_id, rep->epoch, rep->seq + 1);
	kvr_msg_put_u32(&rep->obuf, op);
	kvr_msg_put_u32(&rep->obuf, e->mbt);
	kvr_msg_put_u64(&rep->obuf, e->id.worker_id);
	kvr_msg_put_u32(&rep->obuf, e->id.dp_rank);
	kvr_msg_put_u32(&rep->obuf, 0);
	kvr_msg_put_u64(&rep->obuf, e->incarnation);
	kvr_msg_put_u64(&rep->obuf, e->capacity);
	kvr_msg_end(&rep->obuf, off);
	send_stream(rep);
}

/* ---------------------------------------------------------------- notes (frontend threads) */

static void note_admit(void *ctx, const struct kvr_repl_admission *a)
{
	struct kvr_replica *rep = ctx;
	struct rec *x = rec_new(a->n, a->tail_n);
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
	if (map_insert(rep, x)) {
		rec_free(x);
		rep->st.unpublished++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	live_link(rep, x);
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	encode_attempt(&rep->obuf, KVR_MSG_ADMIT, rep->c.replica_id, rep->epoch, rep->seq + 1, x,
	               false);
	send_stream(rep);
	pthread_mutex_unlock(&rep->mu);
}

static void note_progress(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n)
{
	struct kvr_replica *rep = ctx;
	pthread_mutex_lock(&rep->mu);
	struct rec *x = map_find(rep, rep->c.replica_id, attempt);
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
		if (rec_append_out(x, tokens, n)) {
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
		map_remove(rep, x);
		live_unlink(rep, x);
		journal_add(rep, x);
		break;
	}
	pthread_mutex_unlock(&rep->mu);
}

static void note_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t incarnation,
                      uint64_t capacity, uint32_t mbt)
{
	struct kvr_replica *rep = ctx;
	pthread_mutex_lock(&rep->mu);
	struct rank_ent *e = rank_get(rep, rank);
	if (e) {
		if (op == KVR_REPL_RANK_ADD) {
			e->incarnation = incarnation;
			e->capacity = capacity;
			e->mbt = mbt;
		} else if (op == KVR_REPL_RANK_CAPACITY) {
			if (incarnation != e->incarnation)
				journal_clear(e);
			e->incarnation = incarnation;
			e->capacity = capacity;
		} else if (op == KVR_REPL_RANK_RESET) {
			journal_clear(e);
			e->incarnation = incarnation;
		}
		struct rank_ent copy = *e;
		if (op == KVR_REPL_RANK_REMOVE)
			rank_drop(rep, rank);
		send_rank(rep, (unsigned)op, &copy);
	}
	pthread_mutex_unlock(&rep->mu);
}

/* ---------------------------------------------------------------- applying (apply thread) */

/* Runs a router call as a peer's: no note goes out.  No lock held. */
#define APPLYING(expr)                                                                             \
	({                                                                                         \
		kvr_repl_applying = true;                                                          \
		int rc_ = (expr);                                                                  \
		kvr_repl_applying = false;                                                         \
		rc_;                                                                               \
	})

/* Builds a record from a decoded ADMIT/ATTEMPT. */
static struct rec *rec_from_msg(const struct kvr_wmsg *m)
{
	struct rec *x = rec_new(m->n_blocks, m->tail_n);
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
	for (uint32_t i = 0; i < m->n_blocks; i++)
		x->blocks[i] = kvr_msg_u64(m->blocks, i);
	for (uint32_t i = 0; i < m->tail_n; i++)
		x->tail[i] = kvr_msg_u32(m->tail, i);
	return x;
}

/* Books x on the router as a peer's admission; then its prefill state and output so far.
 * Returns 0 or the router's refusal. */
static int book(struct kvr_replica *rep, struct rec *x, const struct kvr_wmsg *m)
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
	if (m && m->n_out) {
		uint32_t *t = kvr_alloc((size_t)m->n_out * 4);
		if (t) {
			for (uint32_t i = 0; i < m->n_out; i++)
				t[i] = kvr_msg_u32(m->out, i);
			APPLYING(kvr_request_output(rep->r, x->local, t, m->n_out));
			rec_append_out(x, t, m->n_out);
			kvr_free(t, (size_t)m->n_out * 4);
		}
	}
	return 0;
}

/* A peer's admission (live) or a ghost (finished: replay its blocks, then release). */
static void apply_attempt(struct kvr_replica *rep, const struct kvr_wmsg *m)
{
	struct rec *x = rec_from_msg(m);
	if (!x) {
		pthread_mutex_lock(&rep->mu);
		rep->st.refused++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	bool ghost = m->flags & KVR_MSG_F_FINISHED;
	pthread_mutex_lock(&rep->mu);
	struct rec *old = ghost ? NULL : map_find(rep, x->origin, x->oattempt);
	pthread_mutex_unlock(&rep->mu);
	if (old) { /* known already (resync, re-announce): catch up on what it did since */
		bool pre = !old->prefilled && x->prefilled;
		uint32_t have = old->n_out;
		uint64_t a = old->local;
		old->seen = true;
		rec_free(x);
		if (pre)
			APPLYING(kvr_request_prefill_done(rep->r, a));
		if (m->n_out > have) {
			size_t k = m->n_out - have;
			uint32_t *t = kvr_alloc(k * 4);
			if (t) {
				for (size_t i = 0; i < k; i++)
					t[i] = kvr_msg_u32(m->out, have + i);
				APPLYING(kvr_request_output(rep->r, a, t, k));
				pthread_mutex_lock(&rep->mu);
				old->prefilled = true;
				rec_append_out(old, t, k);
				pthread_mutex_unlock(&rep->mu);
				kvr_free(t, k * 4);
			}
		} else if (pre) {
			pthread_mutex_lock(&rep->mu);
			old->prefilled = true;
			pthread_mutex_unlock(&rep->mu);
		}
		return;
	}
	int rc = book(rep, x, m);
	if (rc == 0 && ghost)
		APPLYING(kvr_request_finish(rep->r, x->local));
	pthread_mutex_lock(&rep->mu);
	if (rc) {
		rep->st.refused++;
		rec_free(x);
	} else if (ghost) {
		journal_add(rep, x);
	} else if (map_insert(rep, x)) {
		rep->st.refused++;
		pthread_mutex_unlock(&rep->mu);
		APPLYING(kvr_request_abort(rep->r, x->local));
		rec_free(x);
		return;
	} else {
		x->seen = true;
		live_link(rep, x);
		rep->st.mirrored++;
	}
	pthread_mutex_unlock(&rep->mu);
}

static void apply_progress(struct kvr_replica *rep, const struct kvr_wmsg *m)
{
	pthread_mutex_lock(&rep->mu);
	struct rec *x = map_find(rep, m->h.replica, m->attempt);
	if (!x || x->origin == rep->c.replica_id) {
		rep->st.orphans++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	bool ends = m->h.type == KVR_MSG_FINISH || m->h.type == KVR_MSG_ABORT;
	if (ends) {
		map_remove(rep, x);
		live_unlink(rep, x);
		rep->st.mirrored--;
	}
	pthread_mutex_unlock(&rep->mu);
	uint64_t a = x->local;
	switch (m->h.type) {
	case KVR_MSG_PREFILL_DONE:
		x->prefilled = true;
		APPLYING(kvr_request_prefill_done(rep->r, a));
		return;
	case KVR_MSG_OUTPUT: {
		uint32_t *t = kvr_alloc(((size_t)m->n_out ? m->n_out : 1) * 4);
		if (!t)
			return;
		for (uint32_t i = 0; i < m->n_out; i++)
			t[i] = kvr_msg_u32(m->out, i);
		APPLYING(kvr_request_output(rep->r, a, t, m->n_out));
		pthread_mutex_lock(&rep->mu);
		x->prefilled = true;
		rec_append_out(x, t, m->n_out);
		pthread_mutex_unlock(&rep->mu);
		kvr_free(t, ((size_t)m->n_out ? m->n_out : 1) * 4);
		return;
	}
	default:
		APPLYING(m->h.type == KVR_MSG_FINISH ? kvr_request_finish(rep->r, a)
		                                     : kvr_request_abort(rep->r, a));
		pthread_mutex_lock(&rep->mu);
		journal_add(rep, x);
		pthread_mutex_unlock(&rep->mu);
		return;
	}
}

static void apply_rank(struct kvr_replica *rep, const struct kvr_wmsg *m)
{
	struct kvr_rank_id id = {m->worker_id, m->dp_rank};
	struct kvr_router *r = rep->r;
	switch (m->op) {
	case KVR_REPL_RANK_ADD: {
		int rc = APPLYING(
		    kvr_rank_add(r, id, m->incarnation, m->capacity, m->max_batched_tokens));
		if (rc == KVR_EEXIST) {
			struct kvr_rank_stats s;
			if (kvr_rank_get_stats(r, id, &s) == 0 &&
			    (s.incarnation != m->incarnation || s.capacity_blocks != m->capacity))
				APPLYING(kvr_rank_set_capacity(r, id, m->incarnation, m->capacity));
		}
		break;
	}
	case KVR_REPL_RANK_REMOVE:
		APPLYING(kvr_rank_remove(r, id));
		break;
	case KVR_REPL_RANK_CAPACITY:
		APPLYING(kvr_rank_set_capacity(r, id, m->incarnation, m->capacity));
		break;
	case KVR_REPL_RANK_RESET:
		APPLYING(kvr_rank_reset(r, id, m->incarnation));
		break;
	}
	pthread_mutex_lock(&rep->mu);
	if (m->op == KVR_REPL_RANK_REMOVE) {
		rank_drop(rep, id);
	} else {
		struct rank_ent *e = rank_get(rep, id);
		if (e) {
			if (e->incarnation != m->incarnation)
				journal_clear(e);
			e->incarnation = m->incarnation;
			if (m->op != KVR_REPL_RANK_RESET)
				e->capacity = m->capacity;
			if (m->op == KVR_REPL_RANK_ADD)
				e->mbt = m->max_batched_tokens;
		}
	}
	pthread_mutex_unlock(&rep->mu);
}

/* Releases the attempts mirrored from origin (every origin but self when origin is 0): their
 * blocks stay predicted (journal), their load goes.  Returns how many. */
static uint64_t release_mirrors_if(struct kvr_replica *rep, uint64_t origin, bool unseen_only);

static uint64_t release_mirrors(struct kvr_replica *rep, uint64_t origin)
{
	return release_mirrors_if(rep, origin, false);
}

static uint64_t release_mirrors_if(struct kvr_replica *rep, uint64_t origin, bool unseen_only)
{
	uint64_t n = 0;
	for (;;) {
		struct rec *batch = NULL;
		pthread_mutex_lock(&rep->mu);
		for (struct rec *x = rep->live_head, *nx; x; x = nx) {
			nx = x->next;
			if (x->origin == rep->c.replica_id || (origin && x->origin != origin) ||
			    (unseen_only && x->seen))
				continue;
			map_remove(rep, x);
			live_unlink(rep, x);
			rep->st.mirrored--;
			x->next = batch;
			batch = x;
		}
		pthread_mutex_unlock(&rep->mu);
		if (!batch)
			return n;
		while (batch) {
			struct rec *x = batch;
			batch = x->next;
			APPLYING(kvr_request_abort(rep->r, x->local));
			pthread_mutex_lock(&rep->mu);
			journal_add(rep, x);
			pthread_mutex_unlock(&rep->mu);
			n++;
		}
	}
}

static void peer_gone(struct kvr_replica *rep, struct peer *p)
{
	pthread_mutex_lock(&rep->mu);
	p->alive = false;
	p->lost = true;
	p->lost_ns = mono_ns();
	uint64_t id = p->id;
	pthread_mutex_unlock(&rep->mu);
	uint64_t n = release_mirrors(rep, id);
	pthread_mutex_lock(&rep->mu);
	rep->st.peers_lost++;
	rep->st.released += n;
	pthread_mutex_unlock(&rep->mu);
}

/* ---------------------------------------------------------------- snapshots */

/* Serves a snapshot to `to`: FENCEs, RANKs, ghosts, live attempts, in chunks. */
static void serve_snapshot(struct kvr_replica *rep, const char *to)
{
	if (!to || !rep->t.reply)
		return;
	struct kvr_msg_buf recs = {0}, rec1 = {0}, chunk = {0};
	uint32_t n_chunk = 0, n_rec = 0;
	bool failed = false;
	pthread_mutex_lock(&rep->mu);
	/* One record at a time into rec1, appended framed into recs; a full recs is sent. */
#define FLUSH(last)                                                                                \
	do {                                                                                       \
		chunk.len = 0;                                                                     \
		size_t off_ =                                                                      \
		    kvr_msg_begin(&chunk, KVR_MSG_SNAP_CHUNK, rep->c.replica_id, rep->epoch, 0);   \
		kvr_msg_put_u32(&chunk, n_chunk++);                                                \
		kvr_msg_put_u32(&chunk, (last) ? 1u : 0u);                                         \
		kvr_msg_put_u32(&chunk, n_rec);                                                    \
		kvr_msg_put_u32(&chunk, 0);                                                        \
		kvr_msg_put_bytes(&chunk, recs.p, recs.len);                                       \
		kvr_msg_end(&chunk, off_);                                                         \
		if (chunk.oom || recs.oom || rep->t.reply(rep->t.ctx, to, chunk.p, chunk.len))     \
			failed = true;                                                             \
		recs.len = 0;                                                                      \
		n_rec = 0;                                                                         \
	} while (0)
#define ADD_REC()                                                                                  \
	do {                                                                                       \
		if (recs.len + rec1.len + 4 > CHUNK_BYTES && n_rec)                                \
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
	for (size_t i = 0; i < rep->n_ranks && !failed; i++) {
		struct rank_ent *e = &rep->ranks[i];
		size_t off = kvr_msg_begin(&rec1, KVR_MSG_RANK, rep->c.replica_id, rep->epoch, 0);
		kvr_msg_put_u32(&rec1, KVR_REPL_RANK_ADD);
		kvr_msg_put_u32(&rec1, e->mbt);
		kvr_msg_put_u64(&rec1, e->id.worker_id);
		kvr_msg_put_u32(&rec1, e->id.dp_rank);
		kvr_msg_put_u32(&rec1, 0);
		kvr_msg_put_u64(&rec1, e->incarnation);
		kvr_msg_put_u64(&rec1, e->capacity);
		kvr_msg_end(&rec1, off);
		ADD_REC();
		for (struct rec *x = e->jhead; x && !failed; x = x->next) {
			encode_attempt(&rec1, KVR_MSG_ATTEMPT, x->origin, x->oepoch, 0, x, true);
			ADD_REC();
		}
	}
	for (struct rec *x = rep->live_head; x && !failed; x = x->next) {
		encode_attempt(&rec1, KVR_MSG_ATTEMPT, x->origin, x->oepoch, 0, x, false);
		ADD_REC();
	}
	if (!failed)
		FLUSH(true);
	if (!failed)
		rep->st.snapshots_served++;
	pthread_mutex_unlock(&rep->mu);
#undef FLUSH
#undef ADD_REC
	kvr_msg_buf_fini(&recs);
	kvr_msg_buf_fini(&rec1);
	kvr_msg_buf_fini(&chunk);
}

struct snap_rx {
	struct kvr_replica *rep;
	struct item *chunks, *tail;
	uint32_t next;
	uint64_t provider;
};

static int on_chunk(void *cb, const void *buf, size_t len)
{
	struct snap_rx *rx = cb;
	struct kvr_wmsg m;
	if (kvr_msg_decode(buf, len, &m) || m.h.type != KVR_MSG_SNAP_CHUNK || m.chunk != rx->next ||
	    (rx->next && m.h.replica != rx->provider) || m.h.replica == rx->rep->c.replica_id) {
		pthread_mutex_lock(&rx->rep->mu);
		rx->rep->st.dropped++;
		pthread_mutex_unlock(&rx->rep->mu);
		return KVR_EINVAL;
	}
	rx->provider = m.h.replica;
	struct item *it = kvr_alloc(sizeof(*it) + len);
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
	return (m.chunk_flags & 1) ? 1 : 0;
}

static void handle(struct kvr_replica *rep, const uint8_t *data, size_t len, const char *reply);
static void ask_reannounce(struct kvr_replica *rep, uint64_t id, uint64_t window_ms);
static void poll_requests(void *cb);

/* Applies a complete snapshot: ranks; ghosts (only on a fresh replica: one that has routed or
 * applied anything already holds that history, and replaying it again would only reorder its
 * LRU); live attempts reconciled with the mirrors held (kept if named, caught up on output,
 * booked if missing, released if the snapshot does not name them); then the fences. */
static bool taken(const uint64_t *t, size_t n, uint64_t id)
{
	for (size_t i = 0; i < n; i++)
		if (t[i] == id)
			return true;
	return false;
}

static void apply_snapshot(struct kvr_replica *rep, struct item *chunks)
{
	/* Origins whose part of the snapshot is taken: those where the snapshot is not behind
	 * what we applied already (a fence never moves back: the messages between would be lost),
	 * or that we had given up (we released what we held of them).  FENCE records come first. */
	uint64_t take[MAX_PEERS], jump[MAX_PEERS];
	size_t n_take = 0, n_jump = 0;
	pthread_mutex_lock(&rep->mu);
	bool fresh =
	    rep->st.applied == 0 && rep->st.snapshots_applied == 0 && rep->seq <= rep->n_ranks;
	for (struct rec *x = rep->live_head; x; x = x->next)
		x->seen = false;
	pthread_mutex_unlock(&rep->mu);
	for (struct item *it = chunks; it; it = it->next) {
		struct kvr_wmsg c;
		if (kvr_msg_decode(it->data, it->len, &c))
			continue; /* checked in on_chunk */
		size_t pos = 0, rl;
		const uint8_t *rp;
		while (kvr_msg_next_record(&c, &pos, &rp, &rl)) {
			struct kvr_wmsg m;
			if (kvr_msg_decode(rp, rl, &m))
				continue; /* checked by the chunk's decode */
			if (m.h.type == KVR_MSG_RANK) {
				apply_rank(rep, &m);
			} else if (m.h.type == KVR_MSG_ATTEMPT) {
				/* History: all of it on a fresh replica; else only that of origins
				 * whose fence skips messages we never applied (their finished
				 * attempts are not in the live part, and their messages up to the
				 * fence are gone). */
				bool ghost = m.flags & KVR_MSG_F_FINISHED;
				if (ghost ? !fresh && !taken(jump, n_jump, m.h.replica)
				          : !taken(take, n_take, m.h.replica))
					continue; /* history we hold; origins we are ahead on; us */
				apply_attempt(rep, &m);
			} else if (m.h.type == KVR_MSG_FENCE &&
			           m.fence_replica != rep->c.replica_id && n_take < MAX_PEERS) {
				pthread_mutex_lock(&rep->mu);
				struct peer *p = peer_find(rep, m.fence_replica);
				bool ok = !p || !p->epoch || p->lost || p->epoch < m.fence_epoch ||
				          (p->epoch == m.fence_epoch && p->last_seq <= m.fence_seq);
				if (ok && (p || (p = peer_get(rep, m.fence_replica)))) {
					if (p->epoch != m.fence_epoch || p->last_seq < m.fence_seq)
						jump[n_jump++] = m.fence_replica;
					p->epoch = m.fence_epoch;
					p->last_seq = m.fence_seq;
					if (p->hb_seq < p->last_seq)
						p->hb_seq = p->last_seq;
					p->alive = true;
					p->lost = false;
					p->last_seen = mono_ns();
					take[n_take++] = m.fence_replica;
				}
				pthread_mutex_unlock(&rep->mu);
			}
		}
	}
	pthread_mutex_lock(&rep->mu);
	for (struct rec *x = rep->live_head; x; x = x->next)
		if (!taken(take, n_take, x->origin))
			x->seen = true; /* not this snapshot's to judge */
	pthread_mutex_unlock(&rep->mu);
	uint64_t n = release_mirrors_if(rep, 0, true);
	pthread_mutex_lock(&rep->mu);
	rep->st.released += n;
	pthread_mutex_unlock(&rep->mu);
}

/* Asks a peer for a snapshot and applies it.  Returns 0 (applied), KVR_ENOENT (no peer). */
static int resync(struct kvr_replica *rep)
{
	if (!rep->t.request)
		return KVR_ENOENT;
	pthread_mutex_lock(&rep->mu);
	rep->st.resyncs++;
	rep->obuf.len = 0;
	rep->obuf.oom = false;
	size_t off = kvr_msg_begin(&rep->obuf, KVR_MSG_SNAP_REQ, rep->c.replica_id, rep->epoch, 0);
	kvr_msg_put_u64(&rep->obuf, 0);
	kvr_msg_end(&rep->obuf, off);
	struct kvr_msg_buf req = {0};
	kvr_msg_put_bytes(&req, rep->obuf.p, rep->obuf.len);
	pthread_mutex_unlock(&rep->mu);
	int rc = KVR_ENOMEM;
	struct snap_rx rx = {.rep = rep};
	if (!req.oom)
		rc = rep->t.request(rep->t.ctx, req.p, req.len,
		                    (uint64_t)rep->c.snapshot_timeout_ms * 1000000ull, on_chunk,
		                    poll_requests, &rx);
	kvr_msg_buf_fini(&req);
	if (rc == 0) {
		apply_snapshot(rep, rx.chunks);
		pthread_mutex_lock(&rep->mu);
		rep->st.snapshots_applied++;
		pthread_mutex_unlock(&rep->mu);
	}
	while (rx.chunks) {
		struct item *it = rx.chunks;
		rx.chunks = it->next;
		kvr_free(it, sizeof(*it) + it->len);
	}
	return rc;
}

/* ---------------------------------------------------------------- the apply thread */

static void handle(struct kvr_replica *rep, const uint8_t *data, size_t len, const char *reply)
{
	struct kvr_wmsg m;
	pthread_mutex_lock(&rep->mu);
	rep->st.received++;
	int rc = kvr_msg_decode(data, len, &m);
	if (rc == 0 && m.h.replica == rep->c.replica_id) {
		rep->st.forged++; /* our id, not from us (no echo) */
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
		serve_snapshot(rep, reply);
		return;
	}
	struct peer *p = peer_get(rep, m.h.replica);
	if (!p) {
		rep->st.dropped++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	if (p->epoch && m.h.epoch < p->epoch) { /* an older life of the peer */
		rep->st.duplicates++;
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	bool new_life = p->epoch && m.h.epoch > p->epoch;
	pthread_mutex_unlock(&rep->mu);
	if (new_life) /* the peer restarted: what it had is gone */
		peer_gone(rep, p);
	pthread_mutex_lock(&rep->mu);
	if (new_life || !p->epoch) {
		p->epoch = m.h.epoch;
		p->last_seq = 0;
	}
	bool revived = !p->alive && p->lost;
	p->alive = true;
	p->last_seen = mono_ns();
	if (m.h.type == KVR_MSG_HEARTBEAT) {
		p->hb_seq = m.h.seq;
		p->live = m.live;
		if (revived) { /* we released its attempts: ask it to announce them again */
			p->lost = false;
			ask_reannounce(rep, p->id,
			               (mono_ns() - p->lost_ns) / 1000000 + GIVEN_UP_MARGIN_MS);
		}
		pthread_mutex_unlock(&rep->mu);
		return;
	}
	if (m.h.type == KVR_MSG_GOODBYE) {
		pthread_mutex_unlock(&rep->mu);
		peer_gone(rep, p);
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
		ask_reannounce(rep, p->id, GAP_WINDOW_MS);
	} else if (revived && m.h.type != KVR_MSG_RESET) {
		ask_reannounce(rep, p->id, (mono_ns() - p->lost_ns) / 1000000 + GIVEN_UP_MARGIN_MS);
	}
	p->lost = false;
	p->last_seq = m.h.seq;
	if (p->hb_seq < m.h.seq)
		p->hb_seq = m.h.seq;
	rep->st.applied++;
	pthread_mutex_unlock(&rep->mu);
	switch (m.h.type) {
	case KVR_MSG_ADMIT:
	case KVR_MSG_ATTEMPT:
		apply_attempt(rep, &m);
		break;
	case KVR_MSG_OUTPUT:
	case KVR_MSG_PREFILL_DONE:
	case KVR_MSG_FINISH:
	case KVR_MSG_ABORT:
		apply_progress(rep, &m);
		break;
	case KVR_MSG_RANK:
		apply_rank(rep, &m);
		break;
	case KVR_MSG_RESET:
		release_mirrors(rep, m.h.replica);
		break;
	default:
		break;
	}
}

/* Asks peer `id` (on the stream) to send RESET and its live attempts again: we released them
 * when it fell silent, and only it knows them for sure (the others may have released them too).
 * Context: mu held. */
static void ask_reannounce(struct kvr_replica *rep, uint64_t id, uint64_t window_ms)
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

/* Serves the snapshot requests waiting in the queue (while this replica waits for its own). */
static void poll_requests(void *cb)
{
	struct kvr_replica *rep = ((struct snap_rx *)cb)->rep;
	for (;;) {
		struct item *found = NULL;
		pthread_mutex_lock(&rep->qmu);
		for (struct item **pp = &rep->qhead; *pp; pp = &(*pp)->next) {
			struct kvr_wmsg m;
			if ((*pp)->reply && (*pp)->len >= KVR_MSG_HEADER &&
			    (*pp)->data[3] == KVR_MSG_SNAP_REQ &&
			    kvr_msg_decode((*pp)->data, (*pp)->len, &m) == 0) {
				found = *pp;
				*pp = found->next;
				if (rep->qtail == found) {
					rep->qtail = NULL;
					for (struct item *y = rep->qhead; y; y = y->next)
						rep->qtail = y;
				}
				break;
			}
		}
		pthread_mutex_unlock(&rep->qmu);
		if (!found)
			return;
		handle(rep, found->data, found->len, found->reply);
		pthread_mutex_lock(&rep->qmu);
		rep->q_done++;
		pthread_cond_broadcast(&rep->donecv);
		pthread_mutex_unlock(&rep->qmu);
		kvr_free(found->reply, found->reply ? strlen(found->reply) + 1 : 0);
		kvr_free(found, sizeof(*found) + found->len);
	}
}

static void heartbeat(struct kvr_replica *rep, uint64_t now)
{
	pthread_mutex_lock(&rep->mu);
	uint64_t live = 0;
	for (struct rec *x = rep->live_head; x; x = x->next)
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
	uint64_t bound = (uint64_t)rep->c.dead_after * rep->c.heartbeat_ms * 1000000ull;
	struct peer *dead[MAX_PEERS];
	size_t nd = 0;
	for (size_t i = 0; i < rep->n_peers; i++)
		if (rep->peers[i].alive && now - rep->peers[i].last_seen > bound)
			dead[nd++] = &rep->peers[i];
	pthread_mutex_unlock(&rep->mu);
	for (size_t i = 0; i < nd; i++)
		peer_gone(rep, dead[i]);
}

/* After a reconnect: RESET, then every own live attempt and every own attempt finished since
 * the outage began, so peers rebuild what they hold of us. */
static void reannounce(struct kvr_replica *rep, uint64_t since_ns)
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
		for (struct rec *x = rep->ranks[i].jhead; x; x = x->next) {
			if (!since_ns || x->origin != rep->c.replica_id || x->fin_ns < since_ns)
				continue;
			rep->obuf.len = 0;
			rep->obuf.oom = false;
			encode_attempt(&rep->obuf, KVR_MSG_ATTEMPT, rep->c.replica_id, rep->epoch,
			               rep->seq + 1, x, true);
			send_stream(rep);
		}
	}
	for (struct rec *x = rep->live_head; x; x = x->next) {
		if (x->origin != rep->c.replica_id)
			continue;
		rep->obuf.len = 0;
		rep->obuf.oom = false;
		encode_attempt(&rep->obuf, KVR_MSG_ATTEMPT, rep->c.replica_id, rep->epoch,
		               rep->seq + 1, x, false);
		send_stream(rep);
	}
	pthread_mutex_unlock(&rep->mu);
}

static void *apply_main(void *arg)
{
	struct kvr_replica *rep = arg;
	kvr_rcu_thread_online();
	uint64_t hb_ns = (uint64_t)rep->c.heartbeat_ms * 1000000ull;
	uint64_t next_hb = mono_ns();
	bool first = true;
	for (;;) {
		uint64_t now = mono_ns();
		if (now >= next_hb) {
			heartbeat(rep, now);
			next_hb = now + hb_ns;
		}
		if (first) {
			first = false;
			resync(rep); /* KVR_ENOENT: no peer, we start the cluster's knowledge */
			pthread_mutex_lock(&rep->qmu);
			rep->ready = true;
			pthread_cond_broadcast(&rep->donecv);
			pthread_mutex_unlock(&rep->qmu);
			if (rep->t.ready)
				rep->t.ready(rep->t.ctx);
			continue;
		}
		pthread_mutex_lock(&rep->qmu);
		while (!rep->stop && !rep->qhead && !rep->want_reconnect && !rep->want_resync) {
			uint64_t t = mono_ns();
			if (t >= next_hb)
				break;
			uint64_t wait = next_hb - t;
			struct timespec ts;
			clock_gettime(CLOCK_REALTIME, &ts);
			uint64_t ns = (uint64_t)ts.tv_nsec + wait;
			ts.tv_sec += (time_t)(ns / 1000000000ull);
			ts.tv_nsec = (long)(ns % 1000000000ull);
			pthread_cond_timedwait(&rep->qcv, &rep->qmu, &ts);
		}
		if (rep->stop) {
			pthread_mutex_unlock(&rep->qmu);
			break;
		}
		bool rec = rep->want_reconnect, rsy = rep->want_resync;
		rep->want_reconnect = rep->want_resync = false;
		struct item *it = rep->qhead;
		if (it && !rec && !rsy) {
			rep->qhead = it->next;
			if (!rep->qhead)
				rep->qtail = NULL;
		} else {
			it = NULL;
		}
		pthread_mutex_unlock(&rep->qmu);
		if (rec) {
			rep->reconnect_ns = mono_ns();
			pthread_mutex_lock(&rep->mu);
			uint64_t since = rep->outage_ns > OUTAGE_MARGIN_NS
			                     ? rep->outage_ns - OUTAGE_MARGIN_NS
			                     : 1;
			pthread_mutex_unlock(&rep->mu);
			reannounce(rep, since);
		}
		if (rec || rsy) {
			resync(rep);
			continue;
		}
		if (it) {
			handle(rep, it->data, it->len, it->reply);
			pthread_mutex_lock(&rep->mu);
			bool again = rep->want_reannounce && rep->connected;
			uint64_t back = rep->reannounce_ms * 1000000ull, now = mono_ns();
			pthread_mutex_unlock(&rep->mu);
			/* The asker missed our messages for a while (it gave us up, or lost some):
			 * it needs the attempts we finished in that window as well as the live
			 * ones. */
			if (again)
				reannounce(rep, back ? (now > back ? now - back : 1) : 0);
			kvr_free(it->reply, it->reply ? strlen(it->reply) + 1 : 0);
			kvr_free(it, sizeof(*it) + it->len);
			pthread_mutex_lock(&rep->qmu);
			rep->q_done++;
			pthread_cond_broadcast(&rep->donecv);
			pthread_mutex_unlock(&rep->qmu);
		}
	}
	kvr_rcu_thread_offline();
	return NULL;
}

/* ---------------------------------------------------------------- public side */

void kvr_replica_deliver(struct kvr_replica *rep, const void *buf, size_t len, const char *reply_to)
{
	struct item *it = kvr_alloc(sizeof(*it) + len);
	if (!it)
		return;
	it->next = NULL;
	it->len = len;
	it->reply = NULL;
	if (len)
		memcpy(it->data, buf, len);
	if (reply_to) {
		size_t rl = strlen(reply_to) + 1;
		it->reply = kvr_alloc(rl);
		if (!it->reply) {
			kvr_free(it, sizeof(*it) + len);
			return;
		}
		memcpy(it->reply, reply_to, rl);
	}
	pthread_mutex_lock(&rep->qmu);
	if (rep->qtail)
		rep->qtail->next = it;
	else
		rep->qhead = it;
	rep->qtail = it;
	rep->q_in++;
	pthread_cond_signal(&rep->qcv);
	pthread_mutex_unlock(&rep->qmu);
}

void kvr_replica_disconnected(struct kvr_replica *rep)
{
	pthread_mutex_lock(&rep->mu);
	if (rep->connected) {
		rep->connected = false;
		rep->outage_ns = mono_ns();
		rep->st.disconnects++;
	}
	pthread_mutex_unlock(&rep->mu);
}

void kvr_replica_reconnected(struct kvr_replica *rep)
{
	pthread_mutex_lock(&rep->mu);
	rep->st.reconnects++;
	pthread_mutex_unlock(&rep->mu);
	pthread_mutex_lock(&rep->qmu);
	rep->want_reconnect = true;
	pthread_cond_signal(&rep->qcv);
	pthread_mutex_unlock(&rep->qmu);
}

static int wait_until(struct kvr_replica *rep, uint32_t timeout_ms, bool ready_only)
{
	uint64_t deadline = mono_ns() + (uint64_t)timeout_ms * 1000000ull;
	pthread_mutex_lock(&rep->qmu);
	uint64_t target = rep->q_in;
	int rc = 0;
	while (ready_only ? !rep->ready : (rep->q_done < target || !rep->ready || rep->qhead)) {
		uint64_t t = mono_ns();
		if (t >= deadline) {
			rc = KVR_ETIMEDOUT;
			break;
		}
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		uint64_t ns = (uint64_t)ts.tv_nsec +
		              (deadline - t < 10000000ull ? deadline - t : 10000000ull);
		ts.tv_sec += (time_t)(ns / 1000000000ull);
		ts.tv_nsec = (long)(ns % 1000000000ull);
		pthread_cond_timedwait(&rep->donecv, &rep->qmu, &ts);
	}
	pthread_mutex_unlock(&rep->qmu);
	return rc;
}

int kvr_replica_wait_ready(struct kvr_replica *rep, uint32_t timeout_ms)
{
	return wait_until(rep, timeout_ms, true);
}

int kvr_replica_drain(struct kvr_replica *rep, uint32_t timeout_ms)
{
	return wait_until(rep, timeout_ms, false);
}

void kvr_replica_get_stats(struct kvr_replica *rep, struct kvr_sync_stats *out)
{
	pthread_mutex_lock(&rep->mu);
	*out = rep->st;
	out->seq = rep->seq;
	out->connected = rep->connected;
	out->peers_alive = 0;
	out->lag_messages = 0;
	for (size_t i = 0; i < rep->n_peers; i++) {
		const struct peer *p = &rep->peers[i];
		if (!p->alive)
			continue;
		out->peers_alive++;
		if (p->hb_seq > p->last_seq)
			out->lag_messages += p->hb_seq - p->last_seq;
	}
	pthread_mutex_unlock(&rep->mu);
	pthread_mutex_lock(&rep->qmu);
	out->ready = rep->ready;
	pthread_mutex_unlock(&rep->qmu);
}

int kvr_replica_peer_seq(struct kvr_replica *rep, uint64_t id, uint64_t *seq)
{
	pthread_mutex_lock(&rep->mu);
	struct peer *p = peer_find(rep, id);
	int rc = p && p->alive ? 0 : KVR_ENOENT;
	if (p)
		*seq = p->last_seq;
	pthread_mutex_unlock(&rep->mu);
	return rc;
}

static size_t render(void *ctx, char *buf, size_t room)
{
	struct kvr_replica *rep = ctx;
	struct kvr_sync_stats s;
	kvr_replica_get_stats(rep, &s);
	int n = snprintf(
	    buf, room,
	    "# HELP kvr_sync_messages_total Replica sync messages, by what happened to them\n"
	    "# TYPE kvr_sync_messages_total counter\n"
	    "kvr_sync_messages_total{what=\"published\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"unpublished\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"received\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"applied\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"dropped\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"forged\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"duplicate\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"refused\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"orphan\"} %" PRIu64 "\n"
	    "# HELP kvr_sync_events_total Replica sync events\n"
	    "# TYPE kvr_sync_events_total counter\n"
	    "kvr_sync_events_total{what=\"gap\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"resync\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"snapshot_applied\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"snapshot_served\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"disconnect\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"reconnect\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"peer_lost\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"attempt_released\"} %" PRIu64 "\n"
	    "# HELP kvr_sync_peers_alive Peers heard within the liveness bound\n"
	    "# TYPE kvr_sync_peers_alive gauge\nkvr_sync_peers_alive %u\n"
	    "# HELP kvr_sync_mirrored_attempts Peers' live attempts mirrored here\n"
	    "# TYPE kvr_sync_mirrored_attempts gauge\nkvr_sync_mirrored_attempts %u\n"
	    "# HELP kvr_sync_lag_messages Stream messages peers sent that are not applied yet\n"
	    "# TYPE kvr_sync_lag_messages gauge\nkvr_sync_lag_messages %" PRIu64 "\n"
	    "# HELP kvr_sync_connected 1 while connected to NATS\n"
	    "# TYPE kvr_sync_connected gauge\nkvr_sync_connected %d\n",
	    s.published, s.unpublished, s.received, s.applied, s.dropped, s.forged, s.duplicates,
	    s.refused, s.orphans, s.gaps, s.resyncs, s.snapshots_applied, s.snapshots_served,
	    s.disconnects, s.reconnects, s.peers_lost, s.released, s.peers_alive, s.mirrored,
	    s.lag_messages, s.connected ? 1 : 0);
	return n > 0 ? (size_t)n : 0;
}

static void router_destroyed(void *ctx);

int kvr_replica_create(struct kvr_router *r, const struct kvr_replica_config *c,
                       const struct kvr_replica_transport *t, struct kvr_replica **out)
{
	if (!r || !c || !t || !t->publish || !out || !c->replica_id || !c->heartbeat_ms ||
	    c->dead_after < 2)
		return KVR_EINVAL;
	*out = NULL;
	struct kvr_replica *rep = kvr_calloc(1, sizeof(*rep));
	if (!rep)
		return KVR_ENOMEM;
	rep->r = r;
	rep->c = *c;
	rep->t = *t;
	struct kvr_config rc;
	kvr_router_get_config(r, &rc);
	rep->bs = rc.block_size;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	rep->epoch = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	rep->connected = true;
	pthread_mutex_init(&rep->mu, NULL);
	pthread_mutex_init(&rep->qmu, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_cond_init(&rep->qcv, &ca);
	pthread_cond_init(&rep->donecv, &ca);
	pthread_condattr_destroy(&ca);
	rep->hooks = (struct kvr_repl_hooks){
	    .ctx = rep,
	    .admitted = note_admit,
	    .progressed = note_progress,
	    .rank_changed = note_rank,
	    .render = render,
	    .router_destroyed = router_destroyed,
	};
	*out = rep;
	return 0;
}

int kvr_replica_start(struct kvr_replica *rep)
{
	struct kvr_router *r = rep->r;
	int rc_ = kvr_repl_set_hooks(r, &rep->hooks);
	if (rc_)
		return rc_;
	/* The ranks the router has already: known to peers from the start. */
	struct kvr_rank_id ids[256];
	uint32_t mbt[256];
	size_t n_ids = kvr_repl_list_ranks(r, ids, mbt, 256);
	for (size_t i = 0; i < n_ids && i < 256; i++) {
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(r, ids[i], &s) == 0)
			note_rank(rep, KVR_REPL_RANK_ADD, ids[i], s.incarnation, s.capacity_blocks,
			          mbt[i]);
	}
	if (pthread_create(&rep->thread, NULL, apply_main, rep)) {
		kvr_repl_set_hooks(r, NULL);
		return KVR_EBUSY;
	}
	rep->thread_started = true;
	return 0;
}

static void teardown(struct kvr_replica *rep, bool router_alive)
{
	if (!rep->r || !rep->thread_started) {
		rep->r = NULL;
		return;
	}
	pthread_mutex_lock(&rep->mu);
	if (rep->connected) {
		rep->obuf.len = 0;
		rep->obuf.oom = false;
		size_t off = kvr_msg_begin(&rep->obuf, KVR_MSG_GOODBYE, rep->c.replica_id,
		                           rep->epoch, rep->seq);
		kvr_msg_end(&rep->obuf, off);
		if (!rep->obuf.oom)
			rep->t.publish(rep->t.ctx, rep->obuf.p, rep->obuf.len);
	}
	pthread_mutex_unlock(&rep->mu);
	pthread_mutex_lock(&rep->qmu);
	rep->stop = true;
	pthread_cond_signal(&rep->qcv);
	pthread_mutex_unlock(&rep->qmu);
	if (rep->thread_started)
		pthread_join(rep->thread, NULL);
	kvr_repl_set_hooks(rep->r, NULL);
	if (router_alive)
		release_mirrors(rep, 0);
	rep->r = NULL;
}

static void free_all(struct kvr_replica *rep)
{
	while (rep->qhead) {
		struct item *it = rep->qhead;
		rep->qhead = it->next;
		kvr_free(it->reply, it->reply ? strlen(it->reply) + 1 : 0);
		kvr_free(it, sizeof(*it) + it->len);
	}
	for (struct rec *x = rep->live_head, *nx; x; x = nx) {
		nx = x->next;
		rec_free(x);
	}
	for (size_t i = 0; i < rep->n_ranks; i++)
		journal_clear(&rep->ranks[i]);
	kvr_free(rep->ranks, rep->ranks_cap * sizeof(*rep->ranks));
	kvr_free(rep->map, rep->map_cap * sizeof(*rep->map));
	kvr_msg_buf_fini(&rep->obuf);
	pthread_mutex_destroy(&rep->mu);
	pthread_mutex_destroy(&rep->qmu);
	pthread_cond_destroy(&rep->qcv);
	pthread_cond_destroy(&rep->donecv);
	kvr_free(rep, sizeof(*rep));
}

/* kvr_router_destroy with the layer attached: stop using the router now.  The transport (which
 * owns rep) frees the rest when its handle is destroyed; see sync/replica_nats.c. */
static void router_destroyed(void *ctx)
{
	struct kvr_replica *rep = ctx;
	teardown(rep, false);
}

void kvr_replica_stop(struct kvr_replica *rep)
{
	if (rep)
		teardown(rep, true);
}

void kvr_replica_destroy(struct kvr_replica *rep)
{
	if (!rep)
		return;
	teardown(rep, true);
	free_all(rep);
}
