/*
 * sync/replica.h - router replica sync, transport-agnostic core (issue 14).  The NATS transport
 * (sync/replica_nats.c) and the in-process bus of kvr-replay (tools/replay/policy_replicas.c)
 * plug in through struct kvr_replica_transport.  See sync/replica.c for the protocol.
 */
#ifndef KVR_SYNC_REPLICA_H
#define KVR_SYNC_REPLICA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvrouter.h"

struct kvr_replica;

/* What the core needs from a transport.  Every function may be called from the core's apply
 * thread; publish also from any frontend thread (under the core's lock). */
/* What on_chunk (struct kvr_replica_transport's request) makes of one reply. */
enum {
	KVR_REP_CHUNK_MORE = 0,     /* a chunk taken, more to come: the timeout starts again */
	KVR_REP_CHUNK_LAST = 1,     /* the last chunk taken: the request is done */
	KVR_REP_CHUNK_DECLINED = 2, /* a provider declined its copy: wait on while other copies
	                               are out (one slower may still answer), else KVR_EAGAIN */
	KVR_REP_CHUNK_IGNORED = 3,  /* another provider's reply once one was taken */
};

struct kvr_replica_transport {
	void *ctx;
	/* Sends one message on the cluster's stream subject.  0 or a negative error. */
	int (*publish)(void *ctx, const void *buf, size_t len);
	/* Sends one message to a reply subject (a snapshot chunk). */
	int (*reply)(void *ctx, const char *to, const void *buf, size_t len);
	/* Asks any ready peer for a snapshot (req is a SNAP_REQ) and passes each reply message to
	 * on_chunk, which returns a KVR_REP_CHUNK_* code or an error (below); poll is called
	 * between waits, at least every 20 ms (the core serves its own pending snapshot requests
	 * there), and when it returns true the replica is stopping: return KVR_ESHUTDOWN at once.
	 * While no provider has been taken, the request is sent again every hedge_ns (0: never)
	 * with the same reply subject, so that another peer may take it (a queue group picks one
	 * at random) when the first one picked is alive but does not answer; on_chunk takes the
	 * first provider that answers and ignores the others.  A transport that cannot may send
	 * it once.  Ends with 0 (on_chunk said LAST), KVR_ENOENT (every copy sent reached
	 * nobody: nobody ready), KVR_EAGAIN (every copy sent was DECLINED or reached nobody, one
	 * at least DECLINED), KVR_ETIMEDOUT (timeout_ns passed
	 * with no chunk taken: IGNORED and DECLINED replies do not restart it), KVR_ESHUTDOWN, or
	 * on_chunk's error.  NULL = no snapshots (in-process bus: every replica starts
	 * together). */
	int (*request)(void *ctx, const void *req, size_t len, uint64_t timeout_ns,
	               uint64_t hedge_ns, int (*on_chunk)(void *cb, const void *buf, size_t len),
	               bool (*poll)(void *cb), void *cb);
	/* This replica is about to be ready: start answering snapshot requests.  Called on the
	 * apply thread before kvr_replica_wait_ready returns; a stop joins that thread, so it
	 * waits a bounded time at most.  May be NULL. */
	void (*ready)(void *ctx);
	/* How many stream messages the transport holds for this replica, received but not yet
	 * delivered (nats.c's subscription queue).  While some wait, no peer is given up: the
	 * silent one may be among them.  May be NULL (delivery is immediate). */
	size_t (*pending)(void *ctx);
};

/* Notes kept aside while the sender is stalled, bytes at most, by default (kvr_sync_config's
 * kept_bytes_max documents it). */
#define KVR_REP_KEPT_BYTES_DEFAULT (64ull << 20)

struct kvr_replica_config {
	uint64_t replica_id; /* nonzero */
	uint32_t heartbeat_ms;
	/* A peer is given up after dead_after heartbeat periods of silence, counted only while
	 * this replica was listening (sync/replica_apply.c, "Liveness"). */
	uint32_t dead_after;
	uint32_t snapshot_timeout_ms;
	uint64_t journal_blocks; /* 0 = 2 x capacity per rank (65536 without capacity) */
	uint64_t kept_bytes_max; /* 0 = KVR_REP_KEPT_BYTES_DEFAULT (kvr_sync_config) */
	/* How long a removed rank's tombstone is kept (sync/replica_ranks.c); 0 =
	 * KVR_REP_TOMBSTONE_MS_DEFAULT. */
	uint64_t tombstone_ms;
};

/* One hour.  What is left of a forgotten tombstone is its version: the floor below which a
 * rank nobody names is taken for removed (sync/replica_ranks.c, "Forgetting"). */
#define KVR_REP_TOMBSTONE_MS_DEFAULT 3600000ull

/* Creates the core for router r; nothing is sent or attached yet, but deliveries are queued.
 * t is copied.  Returns 0, KVR_EINVAL, KVR_ENOMEM.  Context: any thread. */
int kvr_replica_create(struct kvr_router *r, const struct kvr_replica_config *c,
                       const struct kvr_replica_transport *t, struct kvr_replica **out);

/* Attaches to the router (notes), announces its ranks (every one, read in order with the
 * router's own rank changes meanwhile: sync/replica.c), starts the apply thread, which first
 * asks for a snapshot.  The transport must already deliver the stream (subscribe first, so
 * nothing after the snapshot's fences is missed).  Returns 0, KVR_EBUSY (router already
 * attached), KVR_ENOMEM (no memory for the ranks' list, or no thread).  Context: any thread. */
int kvr_replica_start(struct kvr_replica *rep);

/* Says goodbye, stops the thread, detaches, releases the peers' attempts mirrored on the
 * router.  Idempotent.  Deliveries after it are queued and freed by destroy.
 * Context: any thread but one handling rep's deliveries (kvr_replica_handling: from a router
 * callback there, e.g. on_admit, it does nothing: it would join or wait for that thread).  On a
 * feed's thread (its callback) while a thread handling rep's deliveries waits in a call on that
 * feed, it does nothing either (it would join that thread, which waits for this callback);
 * otherwise such calls on the feed are refused (KVR_EBUSY) while it stops. */
void kvr_replica_stop(struct kvr_replica *rep);

/* kvr_replica_stop, then frees.  The transport must deliver nothing once this starts.
 * NULL is a no-op; so is a call where kvr_replica_stop does nothing (a thread handling rep's
 * deliveries, a feed's thread one of them waits for). */
void kvr_replica_destroy(struct kvr_replica *rep);

/* Whether the calling thread is handling rep's deliveries (rep's apply thread, or a transport
 * thread inside kvr_replica_deliver_inline): the router calls that apply peers' messages, and
 * the callbacks they make (on_admit), run there.  Context: any thread. */
bool kvr_replica_handling(const struct kvr_replica *rep);

/* A message from the transport (copied).  reply_to (may be NULL, copied) is where a SNAP_REQ
 * wants its chunks.  Context: transport threads. */
void kvr_replica_deliver(struct kvr_replica *rep, const void *buf, size_t len,
                         const char *reply_to);

/*
 * A stream message from the transport, handled on the calling thread when it can be without
 * changing the order: the replica is ready and running, nothing delivered before is still
 * queued, and no other thread is handling deliveries (the apply thread's heartbeat, a resync);
 * otherwise queued as kvr_replica_deliver does.  Saves the apply thread's wake-up, a copy and an
 * allocation per message when the stream is steady.  The calling thread then makes the router
 * calls that apply the message (it registers with RCU) and may block as the apply thread would
 * (a full shard lane).  Context: a transport thread that delivers the stream in order (nats.c's
 * subscription thread), holding no lock of ours or of the router's; not for a transport that
 * delivers from a replica's own threads (an in-process bus publishing under `mu`).
 */
void kvr_replica_deliver_inline(struct kvr_replica *rep, const void *buf, size_t len);

/* Connection state changes seen by the transport.  Context: transport threads. */
void kvr_replica_disconnected(struct kvr_replica *rep);

/* The largest message the transport carries (NATS: the server's max_payload; 0: no limit).
 * Stream batches and snapshot chunks are cut to fit, output is split, and a message that
 * cannot fit alone (an admission of a prompt with more blocks than fit) is not sent and counted
 * (kvr_sync_stats.oversized).  Context: any thread, e.g. the transport after a (re)connect. */
void kvr_replica_set_max_msg(struct kvr_replica *rep, size_t bytes);

/* The transport's server refused a publish or subscription for lack of permission (counted:
 * kvr_sync_stats.denied).  Context: transport threads. */
void kvr_replica_denied(struct kvr_replica *rep);
void kvr_replica_reconnected(struct kvr_replica *rep);

/* Waits until the first snapshot (or the decision that there is none) is applied.
 * 0 or KVR_ETIMEDOUT; on a thread handling rep's deliveries (kvr_replica_handling), which the
 * wait would be for, 0 at once if ready, else KVR_EBUSY. */
int kvr_replica_wait_ready(struct kvr_replica *rep, uint32_t timeout_ms);

/* Waits until every message delivered so far has been handled.  0 or KVR_ETIMEDOUT; KVR_EBUSY
 * at once on a thread handling rep's deliveries (kvr_replica_handling): the message it is
 * handling is among those waited for. */
int kvr_replica_drain(struct kvr_replica *rep, uint32_t timeout_ms);

void kvr_replica_get_stats(struct kvr_replica *rep, struct kvr_sync_stats *out);
int kvr_replica_peer_seq(struct kvr_replica *rep, uint64_t id, uint64_t *seq);

/*
 * Fault injection (tests): for the next ms the replica's own threads do nothing, as when its
 * process is starved: no heartbeat is sent and no peer judged, nothing is published (the
 * router's notes wait in the outbound queue), nothing delivered is handled (it is queued).
 * Routing goes on.  Peers give it up after dead_after heartbeats; when it resumes, it first
 * judges its peers by what it had handled before the stall, so it gives them up too: a false
 * death on both sides.  Context: any thread.
 */
void kvr_replica_stall(struct kvr_replica *rep, uint32_t ms, bool sender);

/* The replica core of a NATS attachment (sync/replica_nats.c), for tests.  Context: any. */
struct kvr_sync;
struct kvr_replica *kvr_sync_replica(struct kvr_sync *s);

#endif
