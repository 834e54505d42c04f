/*
 * sync/feed_internal.h - what the files of the vLLM KV event feed share: the feed, its
 * endpoints and their per-rank state, the events pending for a shard.  sync/feed.c (sockets,
 * thread, commands, API), sync/feed_seq.c (the stream: sequence rules, gaps, replays,
 * restarts), sync/feed_apply.c (a decoded batch into the index).
 *
 * Context: everything here belongs to the feed thread, except where a field says otherwise.
 */
#ifndef KVR_SYNC_FEED_INTERNAL_H
#define KVR_SYNC_FEED_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>
#include <zmq.h>

#include "core/events.h"
#include "core/metrics.h"
#include "kvrouter.h"
#include "shards/u64map.h"
#include "sync/feed_decode.h"

/* What the feed knows of one rank fed by an endpoint. */
struct rstate {
	uint32_t dp;
	struct kvr_u64map other; /* other-medium hash -> copies held */
	/* The router did not know the rank when a batch for it came: batches from missed_from
	 * on were dropped, and the rank is resynced by replay once it is added (feed_seq.c). */
	bool missed;
	uint64_t missed_from;
	/* Where what the index holds of the rank began: the batches from since on, replayed onto
	 * the rank emptied, bring back at least that much.  Its last clear (an AllBlocksCleared,
	 * the end of a gap or of a resync's hole, a restart's new stream, events lost for memory:
	 * from their batch) or a resync's start; else the batch that first fed it; SINCE_NONE
	 * before any.  A removal takes the rank's blocks out of the index: a rank the feed fed is
	 * then missed from here, not from the first batch it missed (kvr_feed_note_missed), and
	 * rebuilt by the resync once added back. */
	uint64_t since;
	/* The rank's life the feed's events go to (kvr_router_find_rank_gen: slot and
	 * generation, as kvr_feed_apply_batch found it); has_life false before the first batch
	 * and from a resync's start.  Another life found, or events refused because the rank went
	 * (rank_gone), means removed (and maybe added back) meanwhile: missed from since. */
	bool has_life;
	uint32_t slot;
	uint64_t gen;
};

#define SINCE_NONE UINT64_MAX

/* The longest wait between a SUB's or DEALER's connection attempts to an absent publisher, ms
 * (ZMQ_RECONNECT_IVL_MAX: ZeroMQ doubles the wait from ZMQ_RECONNECT_IVL, 100 ms, up to it).
 * Without it every socket to a publisher that is down tries again every 100 ms for as long as
 * it is down: /tmp/lead/probe/feedidle3.c, 64 silent endpoints (128 sockets), 115 ms of CPU in
 * 3 s of an otherwise idle process (~0.3 ms a second per socket, ZeroMQ's I/O thread), which
 * a cluster with hundreds of workers down would make a core's worth.  The cost: a publisher
 * back after a long absence is connected up to 1 s later, and what it sent before that is
 * replayed or reported as a gap, as for any first connection (feed_seq.c). */
#define FEED_RECONNECT_IVL_MAX_MS 1000

/* ZMQ_RECONNECT_IVL of a SUB socket, ms (ZeroMQ's default, set explicitly because the feed
 * relies on it): a new connection's first batch is queued at least this long after the old
 * one's disconnection is on the monitor, so a look at the monitor every FEED_MON_EVERY_MS
 * while draining sees the disconnection before any batch of the new connection (feed_seq.c). */
#define FEED_RECONNECT_IVL_MS 100
#define FEED_MON_EVERY_MS     20
_Static_assert(FEED_MON_EVERY_MS * 2 <= FEED_RECONNECT_IVL_MS,
               "the monitor is read well within a reconnection's wait");

/* Asks for one replay that bring little (sync/feed_seq.c, replay()): an answer with a hole inside
 * it or short of its end is asked for again from the first batch missing, as long as the answer
 * brought something; what the last ask still lacks is reported as a gap.  Only an ask that
 * brought fewer than FEED_REPLAY_ASK_GAIN batches in order (each the next one needed) counts: a
 * ROUTER past its send bound (ZeroMQ's default 1,000, vLLM's) brings about that bound each time, so
 * an answer of thousands of batches takes as many asks as it needs.  The whole replay ends within
 * FEED_REPLAY_ASKS x replay_timeout_ms (x FEED_REPLAY_END_MIN_MS for a shorter timeout), however
 * much each ask brings: the longest it could hold the feed's thread before asks that bring much
 * were free. */
#define FEED_REPLAY_ASKS       8
#define FEED_REPLAY_ASK_GAIN   64
#define FEED_REPLAY_END_MIN_MS 1000
/* An answer that brought what a replay needs, or part of it (FEED_REPLAY_ASK_GAIN batches in
 * order at least, or anything while asks that bring little may still follow), and then nothing
 * for this long lost its tail (end marker and all): the wait ends before replay_timeout_ms, and
 * what is missing is asked for again.  A publisher sends an answer in one go (vLLM: one loop of
 * send_multipart); one that pauses longer mid-answer costs an ask, never a gap (an ask that may
 * be the last waits the whole replay_timeout_ms for what it lacks). */
#define FEED_REPLAY_QUIET_MS 100

/* ep.reconn (sync/feed_seq.c, "Restarts across a reconnection"). */
enum {
	RC_NONE,  /* no disconnection pending */
	RC_TAIL,  /* disconnected, no new connection yet: what sub holds is the old one's */
	RC_MIXED, /* disconnected and reconnected before the old tail was read: sub holds the old
	           * connection's last batches, then the new one's, the boundary unknown */
	RC_NEXT,  /* the old connection's batches are all read: the next is the new one's first */
};

struct kvr_feed;
struct ep;
/* Makes e's replay DEALER (e->dealer) and connects it to e->replay.  0, KVR_ENOMEM (no socket
 * or descriptor left) or KVR_EINVAL (an address ZeroMQ refuses).  Context: the feed's thread. */
int kvr_feed_dealer_open(struct kvr_feed *f, struct ep *e);

/* Ranks unknown to the router tracked per endpoint (a publisher naming dp ranks the router
 * never adds cannot grow the feed's state without bound). */
#define MISSED_MAX 64

/* The most lag a batch's ts may show and still be taken for a lag (feed_apply.c, complete): a
 * day.  Beyond, the publisher's ts is not this host's wall clock. */
#define KVR_FEED_LAG_PLAUSIBLE_NS (86400ull * 1000000000ull)

struct ep {
	uint32_t id;
	char *endpoint, *topic, *replay; /* owned copies */
	uint64_t worker_id;
	uint32_t dp_rank;
	void *sub, *dealer;
	void *mon;      /* PAIR: sub's monitor events (disconnections, handshakes) */
	bool monitored; /* zmq_socket_monitor started on sub */
	/* Where sub's queue stands against its last disconnection (RC_*, sync/feed_seq.c,
	 * "Restarts across a reconnection"); mon_ns: when mon was last read (kvr_feed_mono_ns). */
	uint8_t reconn;
	bool reconn_judged; /* RC_MIXED: a batch was taken for a restart */
	uint64_t mon_ns;
	bool have_seq, have_live;
	uint64_t next_seq, last_live;
	struct rstate *rs;
	uint32_t n_rs, cap_rs;
	/* A live batch whose replay waits for its turn (sync/feed_seq.c, "Replays take turns"):
	 * its seq, ticket, payload (moved out of its message), and whether that payload was found
	 * malformed (counted already) or could not be decoded for memory (the replay brings it
	 * again, as it did before turns).  Nothing after it is received before it is taken. */
	bool held, held_bad, held_oom;
	uint64_t held_seq, held_ticket;
	zmq_msg_t held_msg;
	struct kvr_feed_stats st;
	uint64_t logged[12]; /* per log kind (LK_COUNT): last count logged (powers of two) */
};

/* Events accepted for one rank and not yet applied: everything one drain of the sockets
 * brings goes to the rank's shard in one kvr_events_apply_many call (a round trip per event
 * would cap the feed at the shard's wake-up rate).  Stored blocks carry their local hashes,
 * computed when accepted (the decode buffers are reused by the next message). */
struct pev {
	int type; /* enum kvr_event_type */
	bool has_parent;
	uint64_t parent;
	uint32_t off, n; /* blocks (stored) or removed hashes */
};

struct kvr_replica;

struct pending {
	struct ep *ep;
	uint32_t dp;
	struct pev *ev;
	uint32_t n_ev, cap_ev;
	struct kvr_event_block *blk;
	uint32_t n_blk, cap_blk;
	uint64_t *rm;
	uint32_t n_rm, cap_rm;
	uint64_t *local; /* scratch of kvr_hash_blocks */
	uint32_t cap_local;
	struct kvr_event *out; /* built at flush */
	uint32_t cap_out;
	int *rcs;
	uint32_t cap_rcs;
	struct pending_lag {
		struct ep *ep;
		uint64_t ts_ns; /* the batch's ts */
	} * lag;                /* batches accepted since the last flush: lag taken at the flush */
	uint32_t n_lag, cap_lag;
	struct kvr_events_post post; /* in flight from kvr_feed_flush to complete() */
	int post_rc;                 /* kvr_events_post_many's, for the whole post */
	uint64_t seq0, seq1;         /* the batches its events came from, first and last */
};

/* Blocks pending before a flush is forced (bounds the batch a shard applies in one go). */
#define PENDING_MAX_BLOCKS 16384

enum cmd_op { CMD_ADD, CMD_REMOVE, CMD_STATS, CMD_OTHER, CMD_STOP };

struct cmd {
	/* Ordering: ZeroMQ's inproc pipe orders the hand-over both ways; these two flags make it
	 * visible to ThreadSanitizer (libzmq is not instrumented).  posted: release in call(),
	 * acquire on the feed thread; done: release on the feed thread, acquire in call(). */
	int posted, done;
	int op;
	const struct kvr_feed_endpoint *ep;
	uint32_t id;
	struct kvr_feed_stats *stats;
	uint32_t dp;   /* CMD_OTHER */
	uint64_t *out; /* CMD_OTHER: up to cap hashes */
	size_t cap, n;
	int rc;
	/* A call from another feed's thread (one of its callbacks), through the target's box
	 * instead of the control socket (sync/feed.c, "Calls between feeds"): from is the calling
	 * feed, woken when done is set; next links the target's box or deferred list. */
	struct kvr_feed *from;
	struct cmd *next;
};

struct kvr_feed {
	struct kvr_router *r;
	struct kvr_feed_config cfg;
	void *zctx;
	void *ctl_client, *ctl_server;
	pthread_mutex_t ctl_lock;
	pthread_t thread;
	bool started;
	/* feed thread only */
	struct ep **eps;
	uint32_t n_eps, cap_eps;
	uint64_t n_monitors; /* names the SUB sockets' monitors */
	zmq_pollitem_t *items;
	uint32_t cap_items;
	struct kvr_feed_batch live, rep; /* decode scratch: live messages, replayed ones */
	struct pending bufs[2];          /* one filled while the other may be in flight */
	struct pending *pend;            /* the one being filled */
	struct kvr_metrics_block *mb;
	uint32_t n_missed; /* ranks with rstate.missed, all endpoints */
	bool in_replay;    /* a replay is being read (no other may start) */
	/* Replays take turns (sync/feed_seq.c): turn, the round's turn is running (kvr_feed_turn);
	 * replayed, a replay was asked for in this round of the feed's loop (cleared by
	 * feed_main); tickets, the last ticket handed to a replay that waits for its turn
	 * (ep.held_ticket, or resync_ticket for the ranks added late; 0: none), the oldest served
	 * first; forced, a held batch is taken out of turn (kvr_feed_take_held: its endpoint is
	 * going), so a resync it needs runs now rather than wait for a turn it will not have. */
	bool turn, replayed, forced;
	uint64_t tickets, resync_ticket;
	/* A destroy (kvr_feed_destroy, or kvr_router_destroy of a feed still alive) waits for the
	 * thread: a replay wait gives up at once (sync/feed_seq.c).  Atomic: set by the destroying
	 * thread, read by the feed's. */
	int stopping;
	uint64_t seq; /* the batch kvr_feed_apply_batch is applying */
	bool stop;
	/* kvr_feed_destroy was called from this feed's own thread (one of its callbacks) or from
	 * another thread the library runs: the feed's thread frees the feed itself once back in its
	 * loop, detached (sync/feed.c).  Atomic: written by whichever thread destroys, read by the
	 * feed's (kvr_feed_dying). */
	int dying;
	/* Calls from other feeds' threads (sync/feed.c, "Calls between feeds").  box: pushed
	 * commands, newest first, under box_lock, which is a leaf lock held for a few stores only;
	 * box_closed (under box_lock): the feed's thread left its loop, a push fails with
	 * KVR_ESHUTDOWN.  efd: an eventfd, in the loop's poll and in this feed's own waits for
	 * another feed, written under box_lock (a push, a call of this feed's answered, a
	 * destroy's wake-up), so that whoever writes it is out of the feed once the lock is
	 * taken after it. */
	pthread_mutex_t box_lock;
	struct cmd *box;
	bool box_closed;
	int efd;
	/* feed thread only: add / remove from other feeds that arrived while this feed's thread
	 * waited in a callback, oldest first, run once it is back in its loop. */
	struct cmd *deferred, **deferred_tail;
	/* The feed whose thread holds this feed's call deferred (its caller waits for that feed's
	 * loop); NULL when none.  Under sync/feed.c's wait_lock: the wait-for graph these edges
	 * form is kept acyclic. */
	struct kvr_feed *blocked_on;
	/* Under wait_lock, the other edges of that graph (sync/feed.c, "A feed's callback waiting
	 * for a replica"): the feed this feed's thread waits on in call_from_feed (NULL: none) and
	 * whether that call is a read (served even while the target waits in such a call of its
	 * own); the replica whose drain, wait_ready or stop this feed's thread waits in (NULL:
	 * none). */
	struct kvr_feed *calling;
	bool calling_read;
	const struct kvr_replica *waits_replica;
	/* The router's list of feeds not yet destroyed (under r->feeds_lock); orphaned: the router
	 * was destroyed first and released everything but this handle (kvr_feeds_orphan), r is
	 * NULL and every call but kvr_feed_destroy returns KVR_ESHUTDOWN. */
	struct kvr_feed *live_next, **live_pprev;
	bool orphaned;
	/* A rank was added to the router since the feed's thread last looked (kvr_feeds_rank_added:
	 * set, then efd written).  Ordering: the release store there pairs with the acquire load
	 * and exchange in feed_main, which polls without blocking while it is set, so that a
	 * wake-up whose eventfd count another read took (serve_box, a wait in call_from_feed) is
	 * not lost. */
	int ranks_added;
};

/* Whether f is being torn down by its own thread (kvr_feed_destroy deferred): it takes no more
 * messages and calls its log no more.  Ordering: acquire; pairs with the release store in
 * sync/feed.c's mark_dying.  Context: any thread. */
static inline bool kvr_feed_dying(const struct kvr_feed *f)
{
	return __atomic_load_n(&f->dying, __ATOMIC_ACQUIRE) != 0;
}

enum log_kind {
	LK_MALFORMED,
	LK_BLOCK_SIZE,
	LK_TOKENS,
	LK_LORA,
	LK_RANK,
	LK_INDEX,
	LK_GAP,
	LK_MEMORY,
	LK_BOUND,
	LK_RUN_IDS, /* the index's run-id space is full */
	LK_PARENT,  /* a stored event's parent not held */
	LK_REASK,   /* a replay answer with a hole asked for again */
	LK_COUNT
};
_Static_assert(sizeof(((struct ep *)0)->logged) == LK_COUNT * sizeof(uint64_t),
               "ep.logged: one count per log kind");

/* Logs through kvr_feed_config.log (fmt as printf), repeats of one kind per endpoint thinned
 * to counts 1, 2, 4, 8, ...; e NULL: not thinned, no endpoint prefix.  Context: feed thread. */
void kvr_feed_log(struct kvr_feed *f, struct ep *e, int kind, int level, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static inline void kvr_feed_count(struct kvr_feed *f, enum kvr_counter c, uint64_t v)
{
	kvr_metrics_add(f->mb, c, v);
}

/* CLOCK_REALTIME, ns: vLLM stamps batches with the publisher's wall clock (the lag is measured
 * on it, nothing else). */
static inline uint64_t kvr_feed_wall_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* CLOCK_MONOTONIC, ns: for the feed thread's own deadlines (a replay's wait, the idle spin),
 * which a wall clock stepped back would stretch by the step, the thread serving nothing
 * meanwhile. */
static inline uint64_t kvr_feed_mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- sync/feed_apply.c.  Context of all: the feed thread. */

/* The state of rank dp fed by e (made on first use), or NULL without memory. */
struct rstate *kvr_feed_rstate(struct ep *e, uint32_t dp);
/* Blocks e's ranks hold on another medium than GPU. */
uint64_t kvr_feed_other_blocks(const struct ep *e);
/* The rank a batch is for: e's fixed rank, or the batch's dp rank (b NULL or none: 0). */
uint32_t kvr_feed_dp_of(const struct ep *e, const struct kvr_feed_batch *b);
/* Validates batch seq's events (b) and queues them for their rank's shard (applied at the
 * next flush).  A rank the router does not know: dropped, counted, remembered (rstate.missed)
 * for a resync once it is added. */
void kvr_feed_apply_batch(struct kvr_feed *f, struct ep *e, uint64_t seq,
                          const struct kvr_feed_batch *b);
/* Whether applying batch seq (b) of e would first resync its rank with a replay
 * (kvr_feed_apply_batch: a rank missed, or another life than the one fed, now known to the
 * router), which then waits for its turn: the batch is held. */
bool kvr_feed_batch_resyncs(struct kvr_feed *f, struct ep *e, uint64_t seq,
                            const struct kvr_feed_batch *b);
/* Ranks of e with rstate.missed. */
uint32_t kvr_feed_missed(const struct ep *e);
/* Remembers rank dp of e, which the router does not know (or no longer knows as the life the
 * feed fed), as missed from batch `from` on, or from its since if the feed fed it (its blocks
 * went with its removal), for a resync once added (at most MISSED_MAX ranks not fed before; one
 * already remembered keeps its start).  Allocates only for a rank e has no state of. */
void kvr_feed_note_missed(struct kvr_feed *f, struct ep *e, uint32_t dp, uint64_t from);
/* Batch seq of e could not be decoded or applied for memory (its events unknown) and no replay
 * brought it: counted (lost), reported through on_event_gap, and the rank cleared (*dp; NULL:
 * e's fixed rank, or every rank e fed so far), as after a gap. */
void kvr_feed_lost_batch(struct kvr_feed *f, struct ep *e, uint64_t seq, const uint32_t *dp);
/* Posts what is queued to its shard (one task, applied in order after earlier posts) and goes
 * on without waiting; results (refusals, lag) are collected when the buffer is next needed. */
void kvr_feed_flush(struct kvr_feed *f);
/* Flushes and waits until everything posted is applied: the index shows it, the stats count
 * it (before every API command, replay and destroy). */
void kvr_feed_settle(struct kvr_feed *f);
/* Forgets rank s of e (queued after what is pending): its blocks in the index, its other
 * medium; what follows fills it from batch since on (rstate.since). */
void kvr_feed_clear_rank(struct kvr_feed *f, struct ep *e, struct rstate *s, uint64_t since);
/* Every rank e feeds now: the fixed one, or every dp rank seen so far. */
void kvr_feed_clear_all(struct kvr_feed *f, struct ep *e, uint64_t since);
/* Frees the pending buffers (kvr_feed_destroy). */
void kvr_feed_pending_fini(struct pending *p);

/* ---- sync/feed_seq.c.  Context of all: the feed thread. */

/* Receives what e's SUB socket holds (bounded) and applies it by the sequence rules. */
void kvr_feed_drain(struct kvr_feed *f, struct ep *e);
/* Rank s of e, missed until now, is known to the router: clears it and replays the batches
 * it missed (missed_from up to next_seq), applying only its own; what the replay cannot cover
 * is reported through on_event_gap. */
void kvr_feed_resync(struct kvr_feed *f, struct ep *e, struct rstate *s);
/* Resyncs every missed rank the router knows by now; those whose replay must wait for its turn
 * stay missed, resynced in later rounds. */
void kvr_feed_resync_added(struct kvr_feed *f);
/* Whether the resync of rank s of e would ask for a replay that must wait for its turn (the
 * rank then stays missed, resynced by kvr_feed_resync_added at its turn). */
bool kvr_feed_resync_waits(struct kvr_feed *f, const struct ep *e, const struct rstate *s);
/* The round's replay turn, after every endpoint and call was served: the oldest replay waiting
 * (a held gap, or the ranks added late) is asked for, at most one a round. */
void kvr_feed_turn(struct kvr_feed *f);
/* e's batch held for the next replay turn, taken through the sequence rules now whatever the
 * turn (its replay asked for, or given up at once when a destroy waits): before a remove
 * frees e, and as the thread leaves its loop. */
void kvr_feed_take_held(struct kvr_feed *f, struct ep *e);
/* After a rank add (kvr_feeds_rank_added): every rank the feed fed that the router holds as
 * another life than the one fed (removed and added back with nothing of it in between: no batch,
 * no refusal) is remembered as missed from where what the index held of it began, for
 * kvr_feed_resync_added to rebuild.  A rank the router does not hold is left as it is (its add
 * wakes the feed again). */
void kvr_feed_note_lives(struct kvr_feed *f);
/* Reads e's monitor events (disconnections, new connections' handshakes) into e->reconn, and
 * after a disconnection drains what the old connection delivered (its first live batch after
 * those decides restart or not). */
void kvr_feed_monitor(struct kvr_feed *f, struct ep *e);

#endif
