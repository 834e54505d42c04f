/*
 * sync/replica.c - router replica sync: every replica applies its peers' admissions, output,
 * prefill done, finish/abort and rank changes to its own router as if it had routed them
 * (issue 14).  Transport-agnostic: NATS (sync/replica_nats.c) or an in-process bus
 * (tools/replay/policy_replicas.c) deliver bytes; the wire format is sync/replica_msg.h.
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
 * Attempts a rank's end ended.  A rank removed, reset or given a new incarnation ends every
 * attempt live on it (their calls return KVR_ESTALE from then on, no lease expiry comes).  The
 * shard that ends one of this router's own attempts that way, having won its lease's claim,
 * notes it (KVR_OP_RANK_ENDED); the sender publishes an ABORT and drops the record
 * (sync/replica_out.c, out_rank_ended), and each peer ends its mirror when the ABORT arrives.
 * Attempts a caller finished first are told by the caller's own note, and a peer never drops a
 * mirror on its own reading of a rank change, only on its origin's word.
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
 * them within dead_after * heartbeat_ms plus delivery.  Silence is counted only while this
 * replica listened: time its apply thread did not run (the loop comes round every heartbeat
 * period; a longer gap is a starved process, a slow router call, a snapshot wait) is credited
 * to every peer, and nobody is judged while delivered messages, or messages the transport
 * holds (nats.c's subscription queue), wait to be handled (for one more bound at most).  Before
 * that, a process starved for longer than the bound gave up every peer when it ran again,
 * though their heartbeats were waiting unread: test_three failed on a loaded CI machine,
 * its load check landing while every replica released and re-booked its peers' attempts.
 *
 * False death.  A peer that was only slow (its process stopped, its connection stalled) is
 * still given up by those who listened; when they hear it again (a heartbeat or any stream
 * message) they ask it (SNAP_REQ on the stream) to send RESET, its live attempts and those it
 * finished since shortly before it was given up, and rebuild what they hold of it from that.
 * Its messages sent meanwhile are applied in order as usual (lifecycle messages for released
 * attempts are orphans), so once it re-announced every replica holds its live attempts exactly
 * once and the loads agree again (tests/sync/test_sync_nats.c, test_false_death, stalls a
 * replica with kvr_replica_stall).  In between, routers that gave it up route without its
 * load.
 *
 * Outage.  While disconnected, notes are not sent (counted as unpublished) and routing goes on
 * on local knowledge.  On reconnect the replica sends RESET (peers drop what they mirror of it),
 * its rank table, re-announces its live attempts and the attempts it finished during the outage
 * (as ATTEMPTs), then resyncs from a peer's snapshot to learn what it missed.  Rank changes are
 * versioned (sync/replica_ranks.c): the table it tells again may be older than the peers' (a
 * rank removed meanwhile), and so may a snapshot; the newer change wins either way, and after
 * an outage longer than removals' tombstones are kept, their forgotten versions (a floor that
 * snapshots carry) still tell an old add from a new one.
 *
 * Threads and locks.  Notes run on frontend threads (inside the router's RCU read section): they
 * copy what happened into a record and push it into a lock-free ring, nothing more.  The sender
 * thread takes `mu` to update the tables, number, encode and publish (sync/replica_out.c): the
 * notes of one burst go out as one transport message (wire version 2).  One apply thread per
 * replica handles what is delivered (a queue under `qmu`, taken in batches), heartbeats and
 * snapshots; it calls the router WITHOUT holding `mu` (router calls may wait for grace periods),
 * then updates the tables under `mu`.  Whoever handles holds `hmu`, so handling stays serial and
 * in order: a transport thread that delivers the stream in order (nats.c's subscription thread)
 * handles a message itself when the queue is empty and `hmu` is free
 * (kvr_replica_deliver_inline), which spares the apply thread's wake-up, a copy and an
 * allocation per message; else it queues.  kvr_replica_drain first waits for the sender to pass
 * every note made before it.
 *
 * Files, one job each (sync/replica_internal.h lists what they share): this one runs the apply
 * thread and the public side; replica_table.c the tables, replica_note.c the notes into the
 * outbound queue, replica_out.c the outbound stream, replica_apply.c the inbound stream and
 * liveness, replica_snap.c snapshots, replica_ranks.c the rank table's versions.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "core/alloc.h"
#include "sync/rcu.h"
#include "sync/replica_internal.h"
#include "sync/thread.h"

/* The replica whose deliveries the calling thread handles: its apply thread, or a transport
 * thread inside kvr_replica_deliver_inline.  Router callbacks made while applying (on_admit)
 * run there, and a call from them that waits for the handling (drain, stop) would wait for
 * itself. */
static _Thread_local const struct kvr_replica *handling_self;

bool kvr_replica_handling(const struct kvr_replica *rep)
{
	return rep && handling_self == rep;
}

const struct kvr_replica *kvr_replica_handling_now(void)
{
	return handling_self;
}

/* Delivered messages the apply thread takes per wake-up: one qmu round trip and one wake of the
 * drain waiters per batch, and the heartbeat is checked between batches. */
#define APPLY_BATCH 64

/* Handles one delivered transport message, then the re-announce a peer may have asked for in
 * it.  hmu held. */
static void handle_item(struct kvr_replica *rep, const uint8_t *data, size_t len, const char *reply,
                        uint64_t rx_ns)
{
	rep->handle_rx_ns = rx_ns;
	kvr_rep_handle(rep, data, len, reply);
	rep->handle_rx_ns = 0;
	pthread_mutex_lock(&rep->mu);
	bool again = rep->want_reannounce && rep->connected;
	uint64_t back = rep->reannounce_ms * 1000000ull, now = kvr_rep_mono_ns();
	pthread_mutex_unlock(&rep->mu);
	/* The asker missed our messages for a while (it gave us up, or lost some): it needs the
	 * attempts we finished in that window as well as the live ones. */
	if (again)
		kvr_rep_reannounce(rep, back ? (now > back ? now - back : 1) : 0);
}

static void *apply_main(void *arg)
{
	struct kvr_replica *rep = arg;
	prctl(PR_SET_NAME, "kvr-sync-apply");
	handling_self = rep;
	kvr_router_cb_self = rep->r;                   /* kvr_router_destroy refuses to run here */
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_REPLICA); /* scoped test failures (core/alloc.h) */
	kvr_rcu_thread_online();
	uint64_t hb_ns = (uint64_t)rep->c.heartbeat_ms * 1000000ull;
	uint64_t next_hb = kvr_rep_mono_ns(), top = 0, deaf = 0;
	bool first = true;
	for (;;) {
		uint64_t now = kvr_rep_mono_ns();
		if (kvr_rep_stalled(rep, now)) { /* kvr_replica_stall: as if never scheduled */
			struct timespec ts = {0, 2000000};
			nanosleep(&ts, NULL);
			continue;
		}
		/* This loop comes round at least every heartbeat period (it waits for next_hb at
		 * most) plus one batch's handling; a longer gap is time this replica did not run
		 * (a starved process, a slow router call, a snapshot wait): deaf, not a silence of
		 * its peers.  The liveness check credits it (sync/replica_apply.c). */
		if (top && now - top > 2 * hb_ns)
			deaf += now - top - hb_ns;
		top = now;
		pthread_mutex_lock(&rep->hmu);
		if (now >= next_hb) {
			kvr_rep_heartbeat(rep, now, deaf);
			kvr_rep_ranks_retry(rep);
			deaf = 0;
			next_hb = now + hb_ns;
		}
		if (first) {
			first = false;
			kvr_rep_resync(
			    rep); /* KVR_ENOENT: no peer, we start the cluster's knowledge */
			pthread_mutex_unlock(&rep->hmu);
			/* Answering snapshot requests before kvr_replica_wait_ready returns: a
			 * joiner attached after it finds this replica.  It came after, and a test
			 * that stopped the server once ready saw its detach wait for this
			 * callback's flush (test_sync_nats detach_down). */
			if (rep->t.ready)
				rep->t.ready(rep->t.ctx);
			pthread_mutex_lock(&rep->qmu);
			rep->ready = true;
			pthread_cond_broadcast(&rep->donecv);
			pthread_mutex_unlock(&rep->qmu);
			continue;
		}
		pthread_mutex_unlock(&rep->hmu);
		pthread_mutex_lock(&rep->qmu);
		while (!rep->stop && !rep->qhead && !rep->want_reconnect) {
			uint64_t t = kvr_rep_mono_ns();
			if (t >= next_hb)
				break;
			kvr_rep_timedwait(&rep->qcv, &rep->qmu, next_hb - t);
		}
		if (rep->stop) {
			pthread_mutex_unlock(&rep->qmu);
			break;
		}
		/* hmu before qmu, and held from taking the batch until it is handled: an inline
		 * delivery (which needs an empty queue and hmu) cannot overtake it. */
		pthread_mutex_unlock(&rep->qmu);
		pthread_mutex_lock(&rep->hmu);
		pthread_mutex_lock(&rep->qmu);
		bool rec = rep->want_reconnect;
		rep->want_reconnect = false;
		struct kvr_rep_item *batch = NULL;
		uint64_t n_batch = 0;
		if (!rec && rep->qhead) {
			batch = rep->qhead;
			struct kvr_rep_item *last = batch;
			for (n_batch = 1; n_batch < APPLY_BATCH && last->next; n_batch++)
				last = last->next;
			rep->qhead = last->next;
			last->next = NULL;
			if (!rep->qhead)
				rep->qtail = NULL;
		}
		pthread_mutex_unlock(&rep->qmu);
		if (rec) {
			rep->reconnect_ns = kvr_rep_mono_ns();
			pthread_mutex_lock(&rep->mu);
			uint64_t since = rep->outage_ns > OUTAGE_MARGIN_NS
			                     ? rep->outage_ns - OUTAGE_MARGIN_NS
			                     : 1;
			const uint64_t disconnects = rep->st.disconnects; /* before the resync */
			pthread_mutex_unlock(&rep->mu);
			kvr_rep_reannounce(rep, since);
			/* The outage ends with a snapshot applied, and only if no disconnect came
			 * meanwhile (outage_open, sync/replica_internal.h). */
			if (kvr_rep_resync(rep) == 0) {
				pthread_mutex_lock(&rep->mu);
				if (rep->st.disconnects == disconnects)
					rep->outage_open = false;
				pthread_mutex_unlock(&rep->mu);
			}
			pthread_mutex_unlock(&rep->hmu);
			continue;
		}
		while (batch) {
			struct kvr_rep_item *it = batch;
			batch = it->next;
			handle_item(rep, it->data, it->len, it->reply, it->rx_ns);
			kvr_free(it->reply, it->reply ? strlen(it->reply) + 1 : 0);
			kvr_free(it, sizeof(*it) + it->len);
		}
		pthread_mutex_unlock(&rep->hmu);
		if (n_batch) {
			pthread_mutex_lock(&rep->qmu);
			rep->q_done += n_batch;
			pthread_cond_broadcast(&rep->donecv);
			pthread_mutex_unlock(&rep->qmu);
		}
	}
	kvr_rcu_thread_offline();
	return NULL;
}

/* ---------------------------------------------------------------- public side */

/* A delivery lost for memory: counted as dropped; a stream message's sender shows the gap at its
 * next heartbeat, and a snapshot request's asker is told at once (it asks again). */
static void deliver_lost(struct kvr_replica *rep, const uint8_t *buf, size_t len,
                         const char *reply_to)
{
	__atomic_add_fetch(&rep->in_dropped, 1, __ATOMIC_RELAXED);
	if (reply_to && len >= KVR_MSG_HEADER && buf[3] == KVR_MSG_SNAP_REQ)
		kvr_rep_snapshot_give_up(rep, reply_to, 0);
}

void kvr_replica_deliver(struct kvr_replica *rep, const void *buf, size_t len, const char *reply_to)
{
	struct kvr_rep_item *it = kvr_alloc(sizeof(*it) + len);
	if (!it) {
		deliver_lost(rep, buf, len, reply_to);
		return;
	}
	it->next = NULL;
	it->rx_ns =
	    __atomic_load_n(&kvr_rep_trace_origin, __ATOMIC_RELAXED) ? kvr_rep_mono_ns() : 0;
	it->len = len;
	it->reply = NULL;
	if (len)
		memcpy(it->data, buf, len);
	if (reply_to) {
		size_t rl = strlen(reply_to) + 1;
		it->reply = kvr_alloc(rl);
		if (!it->reply) {
			kvr_free(it, sizeof(*it) + len);
			deliver_lost(rep, buf, len, reply_to);
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

void kvr_replica_deliver_inline(struct kvr_replica *rep, const void *buf, size_t len)
{
	uint64_t rx_ns =
	    __atomic_load_n(&kvr_rep_trace_origin, __ATOMIC_RELAXED) ? kvr_rep_mono_ns() : 0;
	pthread_mutex_lock(&rep->qmu);
	bool here = rep->ready && !rep->stop && !rep->qhead && !rep->want_reconnect &&
	            !kvr_rep_stalled(rep, kvr_rep_mono_ns()) &&
	            pthread_mutex_trylock(&rep->hmu) == 0;
	if (here)
		rep->q_in++;
	pthread_mutex_unlock(&rep->qmu);
	if (!here) {
		kvr_replica_deliver(rep, buf, len, NULL);
		return;
	}
	const struct kvr_replica *prev = handling_self;
	handling_self = rep;
	const struct kvr_router *prev_r = kvr_router_callback_enter(rep->r);
	handle_item(rep, buf, len, NULL, rx_ns);
	kvr_router_callback_leave(prev_r);
	handling_self = prev;
	pthread_mutex_unlock(&rep->hmu);
	pthread_mutex_lock(&rep->qmu);
	rep->q_done++;
	pthread_cond_broadcast(&rep->donecv);
	pthread_mutex_unlock(&rep->qmu);
}

void kvr_replica_set_max_msg(struct kvr_replica *rep, size_t bytes)
{
	pthread_mutex_lock(&rep->mu);
	rep->max_msg = bytes;
	pthread_mutex_unlock(&rep->mu);
}

void kvr_replica_denied(struct kvr_replica *rep)
{
	pthread_mutex_lock(&rep->mu);
	rep->st.denied++;
	pthread_mutex_unlock(&rep->mu);
}

void kvr_replica_disconnected(struct kvr_replica *rep)
{
	pthread_mutex_lock(&rep->mu);
	if (rep->connected) {
		rep->connected = false;
		if (!rep->outage_open) { /* else a reconnect between did not resync: one outage */
			rep->outage_ns = kvr_rep_mono_ns();
			rep->outage_heard_ns = rep->heard_ns;
			kvr_rep_ranks_outage(rep);
		}
		rep->outage_open = true;
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
	if (handling_self == rep) { /* it would wait for this very thread (replica.h) */
		if (!ready_only)
			return KVR_EBUSY;
		pthread_mutex_lock(&rep->qmu);
		bool ready = rep->ready;
		pthread_mutex_unlock(&rep->qmu);
		return ready ? 0 : KVR_EBUSY;
	}
	if (ready_only) {
		pthread_mutex_lock(&rep->qmu);
		bool ready = rep->ready;
		pthread_mutex_unlock(&rep->qmu);
		if (ready)
			return 0; /* no wait: nothing for the check below to refuse */
	}
	/* From a feed's callback: refused while this replica's handling thread waits in a call on
	 * that feed (which waits for the callback to return), else recorded, so that such a call
	 * made during the wait is refused instead (sync/feed.c).  Each would otherwise wait for
	 * the other until this wait's timeout. */
	int rc = kvr_feed_wait_replica_begin(rep);
	if (rc)
		return rc;
	uint64_t deadline = kvr_rep_mono_ns() + (uint64_t)timeout_ms * 1000000ull;
	/* Our own notes first: what this router did must be on its way to the peers. */
	if (!ready_only && kvr_rep_out_flush(rep, deadline)) {
		kvr_feed_wait_replica_end();
		return KVR_ETIMEDOUT;
	}
	pthread_mutex_lock(&rep->qmu);
	uint64_t target = rep->q_in;
	while (ready_only ? !rep->ready : (rep->q_done < target || !rep->ready || rep->qhead)) {
		if (!kvr_rep_wait_deadline(&rep->donecv, &rep->qmu, deadline)) {
			rc = KVR_ETIMEDOUT;
			break;
		}
	}
	pthread_mutex_unlock(&rep->qmu);
	kvr_feed_wait_replica_end();
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
	out->unpublished += __atomic_load_n(&rep->out_dropped, __ATOMIC_RELAXED);
	out->dropped += __atomic_load_n(&rep->in_dropped, __ATOMIC_RELAXED);
	out->notes_over_cap = __atomic_load_n(&rep->over_cap, __ATOMIC_RELAXED);
	out->peers_alive = 0;
	out->lag_messages = 0;
	out->displaced = rep->displaced_ns &&
	                 kvr_rep_mono_ns() - rep->displaced_ns <= kvr_rep_silence_bound(rep);
	for (size_t i = 0; i < rep->n_peers; i++) {
		const struct kvr_rep_peer *p = &rep->peers[i];
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

void kvr_replica_stall(struct kvr_replica *rep, uint32_t ms, bool sender)
{
	__atomic_store_n(&rep->stall_sender, sender, __ATOMIC_RELAXED);
	__atomic_store_n(&rep->stall_until_ns, kvr_rep_mono_ns() + (uint64_t)ms * 1000000ull,
	                 __ATOMIC_RELEASE);
}

int kvr_replica_peer_seq(struct kvr_replica *rep, uint64_t id, uint64_t *seq)
{
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_peer *p = kvr_rep_peer_find(rep, id);
	int rc = p && p->alive ? 0 : KVR_ENOENT;
	/* A gone peer's position is no answer: *seq untouched, as for an unknown one. */
	if (rc == 0)
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
	    "kvr_sync_messages_total{what=\"block_size_mismatch\"} %" PRIu64 "\n"
	    "kvr_sync_messages_total{what=\"rank_stale\"} %" PRIu64 "\n"
	    "# HELP kvr_sync_batches_total Transport messages the published stream went out in\n"
	    "# TYPE kvr_sync_batches_total counter\nkvr_sync_batches_total %" PRIu64 "\n"
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
	    "kvr_sync_events_total{what=\"early_end_lost\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"note_over_cap\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"end_reconciled\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"denied\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"oversized\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"truncated\"} %" PRIu64 "\n"
	    "kvr_sync_events_total{what=\"displaced\"} %" PRIu64 "\n"
	    "# HELP kvr_sync_output_dropped_tokens_total Peers' output tokens not applied here "
	    "(memory, a full lane): their attempts wait for a re-announce\n"
	    "# TYPE kvr_sync_output_dropped_tokens_total counter\n"
	    "kvr_sync_output_dropped_tokens_total %" PRIu64 "\n"
	    "# HELP kvr_sync_peers_alive Peers heard within the liveness bound\n"
	    "# TYPE kvr_sync_peers_alive gauge\nkvr_sync_peers_alive %u\n"
	    "# HELP kvr_sync_mirrored_attempts Peers' live attempts mirrored here\n"
	    "# TYPE kvr_sync_mirrored_attempts gauge\nkvr_sync_mirrored_attempts %u\n"
	    "# HELP kvr_sync_lag_messages Stream messages peers sent that are not applied yet\n"
	    "# TYPE kvr_sync_lag_messages gauge\nkvr_sync_lag_messages %" PRIu64 "\n"
	    "# HELP kvr_sync_connected 1 while connected to NATS\n"
	    "# TYPE kvr_sync_connected gauge\nkvr_sync_connected %d\n"
	    "# HELP kvr_sync_displaced 1 while a newer replica holds this one's id (peers follow "
	    "it)\n"
	    "# TYPE kvr_sync_displaced gauge\nkvr_sync_displaced %d\n",
	    s.published, s.unpublished, s.received, s.applied, s.dropped, s.forged, s.duplicates,
	    s.refused, s.orphans, s.block_size_mismatch, s.rank_stale, s.batches, s.gaps, s.resyncs,
	    s.snapshots_applied, s.snapshots_served, s.disconnects, s.reconnects, s.peers_lost,
	    s.released, s.early_lost, s.notes_over_cap, s.ends_reconciled, s.denied, s.oversized,
	    s.truncated, s.displacements, s.output_dropped, s.peers_alive, s.mirrored,
	    s.lag_messages, s.connected ? 1 : 0, s.displaced ? 1 : 0);
	return n > 0 ? (size_t)n : 0;
}

/* kvr_memory.replica_ranks.  Context: kvr_router_get_memory's thread, inside its RCU read
 * section, as the notes (mu is never held across a grace period). */
static uint64_t memory(void *ctx)
{
	struct kvr_replica *rep = ctx;
	pthread_mutex_lock(&rep->mu);
	uint64_t n = kvr_rep_ranks_bytes(rep);
	pthread_mutex_unlock(&rep->mu);
	return n;
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
	if (!rep->c.kept_bytes_max)
		rep->c.kept_bytes_max = KVR_REP_KEPT_BYTES_DEFAULT;
	rep->t = *t;
	struct kvr_config rc;
	kvr_router_get_config(r, &rc);
	rep->bs = rc.block_size;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	rep->epoch = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	rep->connected = true;
	if (kvr_rep_out_init(rep)) {
		kvr_free(rep, sizeof(*rep));
		return KVR_ENOMEM;
	}
	pthread_mutex_init(&rep->mu, NULL);
	pthread_mutex_init(&rep->hmu, NULL);
	pthread_mutex_init(&rep->qmu, NULL);
	kvr_cond_init(&rep->qcv);
	kvr_cond_init(&rep->donecv);
	rep->hooks = (struct kvr_repl_hooks){
	    .ctx = rep,
	    .admitted = kvr_rep_note_admit,
	    .progressed = kvr_rep_note_progress,
	    .rank_changed = kvr_rep_note_rank,
	    .render = render,
	    .memory = memory,
	    .router_destroyed = router_destroyed,
	};
	*out = rep;
	return 0;
}

/* The ranks r holds now, read for kvr_replica_start's announce into rep->boot (an add each).
 * Returns 0 or KVR_ENOMEM.  Context: kvr_replica_start, the sender not started yet. */
static int read_boot_ranks(struct kvr_replica *rep)
{
	struct kvr_router *r = rep->r;
	kvr_free(rep->boot, rep->n_boot * sizeof(*rep->boot)); /* a failed start's */
	rep->boot = NULL;
	rep->n_boot = 0;
	struct kvr_rank_id *ids = NULL;
	uint32_t *mbt = NULL;
	size_t cap = 0, n;
	/* Every rank (before, the first 256 only: test_replica_start
	 * every_rank_is_announced_past_256); ranks added meanwhile make the list longer. */
	while ((n = kvr_repl_list_ranks(r, ids, mbt, cap)) > cap) {
		kvr_free(ids, cap * sizeof(*ids));
		kvr_free(mbt, cap * sizeof(*mbt));
		cap = n + 16;
		ids = kvr_alloc(cap * sizeof(*ids));
		mbt = kvr_alloc(cap * sizeof(*mbt));
		if (!ids || !mbt) {
			kvr_free(ids, ids ? cap * sizeof(*ids) : 0);
			kvr_free(mbt, mbt ? cap * sizeof(*mbt) : 0);
			return KVR_ENOMEM;
		}
	}
	struct kvr_rep_out_rank *boot = n ? kvr_alloc(n * sizeof(*boot)) : NULL;
	if (n && !boot) {
		kvr_free(ids, cap * sizeof(*ids));
		kvr_free(mbt, cap * sizeof(*mbt));
		return KVR_ENOMEM;
	}
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		struct kvr_rank_stats s;
		struct kvr_rank_life life = {0, 0};
		if (kvr_repl_rank_life(r, ids[i], &life.slot, &life.gen))
			life = (struct kvr_rank_life){0, 0}; /* judged by the router's then */
		if (kvr_rank_get_stats(r, ids[i], &s) == 0)
			boot[k++] = (struct kvr_rep_out_rank){
			    .worker_id = ids[i].worker_id,
			    .incarnation = s.incarnation,
			    .capacity = s.capacity_blocks,
			    .life_gen = life.gen,
			    .dp_rank = ids[i].dp_rank,
			    .mbt = mbt[i],
			    .life_slot = life.slot,
			    .op = KVR_REPL_RANK_ADD,
			};
	}
	kvr_free(ids, cap * sizeof(*ids));
	kvr_free(mbt, cap * sizeof(*mbt));
	rep->boot = boot;
	rep->n_boot = n; /* the allocation's count: the sender frees that much */
	for (size_t i = k; i < n; i++)
		boot[i].op = 0; /* gone between the list and its stats: not told */
	return 0;
}

/*
 * The ranks the router holds already are announced (an add each).  The router's own rank
 * changes go on meanwhile: their notes (the hooks are installed first) are pushed to the sender
 * as they land, and each carries what the change made.  The ranks are read after a marker
 * (OUT_BOOT) is pushed, and the sender tells them at the marker's place, so a note pushed after
 * it is told after them: a change that landed before the read is in the read (its note, told
 * before or after, says the same again), one that landed after it is told after the read.
 * Before, each rank's add was pushed after its read, and a change landing between the two (an
 * admin thread's remove or reset) was told first, then overwritten by the older read with a
 * newer version: a removed rank told added, a reset's incarnation lost (test_replica_start).
 */
/*
 * A start that fails has had the hooks set: routes made meanwhile noted their admissions, and
 * their ends, made once the hooks are gone, are noted nowhere.  Published (by a retried start
 * that succeeds, or by a sender already running), each admission left its attempt mirrored on
 * every peer for good (test_replica_start
 * a_failed_start_retried_publishes_no_admission_without_its_end).  So nothing the window noted
 * goes out: the sender handles no note until the start has succeeded (kvr_rep_out_go, the last
 * step, after the apply thread started, so nothing that can fail comes after it), and a failed
 * start drops the queued and kept notes once the hooks are unset (no note in flight after it).
 * The sender never ran, so it made no record (attempt map, live list, early set) of them.
 */
static void start_failed(struct kvr_replica *rep)
{
	kvr_repl_set_hooks(rep->r, NULL);
	kvr_rep_out_stop(rep); /* if started: it exits without handling a note */
	kvr_rep_out_drop(rep);
	kvr_free(rep->boot, rep->n_boot * sizeof(*rep->boot));
	rep->boot = NULL;
	rep->n_boot = 0;
}

int kvr_replica_start(struct kvr_replica *rep)
{
	struct kvr_router *r = rep->r;
	int rc_ = kvr_repl_set_hooks(r, &rep->hooks);
	if (rc_)
		return rc_;
	const uint64_t marker = 0;
	kvr_rep_out_push(rep, OUT_BOOT, &marker, sizeof(marker));
	/* A thread that cannot be started (the process's thread limit): KVR_ENOMEM, as for
	 * memory (KVR_EBUSY says "already attached"). */
	if (read_boot_ranks(rep) || kvr_rep_out_start(rep) ||
	    kvr_thread_start(&rep->thread, false, apply_main, rep)) {
		start_failed(rep);
		return KVR_ENOMEM;
	}
	rep->thread_started = true;
	kvr_rep_out_go(rep);
	return 0;
}

static void teardown(struct kvr_replica *rep, bool router_alive)
{
	if (!rep->r || !rep->thread_started) {
		rep->r = NULL;
		return;
	}
	/* No note after this; what was noted goes out before the goodbye. */
	kvr_repl_set_hooks(rep->r, NULL);
	kvr_rep_out_stop(rep);
	pthread_mutex_lock(&rep->qmu);
	rep->stop = true;
	pthread_cond_signal(&rep->qcv);
	pthread_mutex_unlock(&rep->qmu);
	if (rep->thread_started)
		pthread_join(rep->thread, NULL);
	/* A transport thread still handling a message inline finishes first (later ones see
	 * `stop` and are only queued). */
	pthread_mutex_lock(&rep->hmu);
	pthread_mutex_unlock(&rep->hmu);
	/* The goodbye is the last word: sent before the handling threads stopped, a heartbeat
	 * or a re-announce made meanwhile (waiting for mu while it went out) followed it, and the
	 * peers took this replica up again, and its live attempts with a re-announce, until the
	 * liveness bound (test_replica_epoch nothing_follows_the_goodbye). */
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
	if (router_alive)
		kvr_rep_release_mirrors(rep, 0);
	rep->r = NULL;
}

static void free_all(struct kvr_replica *rep)
{
	while (rep->qhead) {
		struct kvr_rep_item *it = rep->qhead;
		rep->qhead = it->next;
		kvr_free(it->reply, it->reply ? strlen(it->reply) + 1 : 0);
		kvr_free(it, sizeof(*it) + it->len);
	}
	for (struct kvr_rep_rec *x = rep->live_head, *nx; x; x = nx) {
		nx = x->next;
		kvr_rep_rec_free(x);
	}
	for (size_t i = 0; i < rep->n_ranks; i++)
		kvr_rep_journal_clear(rep, &rep->ranks[i]);
	kvr_free(rep->ranks, rep->ranks_cap * sizeof(*rep->ranks));
	kvr_free(rep->tombs, rep->tombs_cap * sizeof(*rep->tombs));
	kvr_free(rep->rix.slot, rep->rix.cap * sizeof(*rep->rix.slot));
	kvr_free(rep->tix.slot, rep->tix.cap * sizeof(*rep->tix.slot));
	kvr_free(rep->map, rep->map_cap * sizeof(*rep->map));
	kvr_msg_buf_fini(&rep->obuf);
	kvr_msg_buf_fini(&rep->sbuf);
	kvr_free(rep->boot, rep->n_boot * sizeof(*rep->boot)); /* a start that failed after it */
	kvr_rep_out_fini(rep);
	pthread_mutex_destroy(&rep->mu);
	pthread_mutex_destroy(&rep->hmu);
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

/* On a feed's thread (its callback) the teardown joins the threads handling rep's deliveries,
 * which may be waiting in a call on that feed, i.e. for this callback: kvr_feed_wait_replica_begin
 * refuses then, and the stop does nothing; else the wait is recorded, so that their calls on the
 * feed meanwhile are refused instead (sync/feed.c, "A feed's callback waiting for a replica"). */
void kvr_replica_stop(struct kvr_replica *rep)
{
	if (!rep || handling_self == rep || kvr_feed_wait_replica_begin(rep))
		return;
	teardown(rep, true);
	kvr_feed_wait_replica_end();
}

void kvr_replica_destroy(struct kvr_replica *rep)
{
	/* On a thread handling rep's deliveries it would join that thread, or wait for hmu, which
	 * this thread holds, then free what the handling still uses: nothing is done there
	 * (replica.h); nor on a feed's thread while a handling thread waits in a call on that feed.
	 */
	if (!rep || handling_self == rep || kvr_feed_wait_replica_begin(rep))
		return;
	teardown(rep, true);
	kvr_feed_wait_replica_end();
	free_all(rep);
}
