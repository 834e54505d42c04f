/*
 * sync/replica_internal.h - what the files of the replica sync core share (issue 14): the
 * replica's state, its tables, and the functions each file offers the others.  The protocol is
 * described in sync/replica.c; the jobs are split by file:
 *   sync/replica.c        the apply thread, create/start/stop, the public side (deliver, stats)
 *   sync/replica_table.c  records, the attempt map, the live list, ranks' journals, peers
 *   sync/replica_note.c   outbound, the routing threads' side: notes into the queue, kept notes
 *   sync/replica_out.c    outbound, the sender: encoding, the stream, re-announces
 *   sync/replica_apply.c  inbound: stream positions, applying peers' messages, liveness
 *   sync/replica_snap.c   snapshots: serving, collecting, applying
 *   sync/replica_ranks.c  the rank table's versions: own and peers' rank changes, tombstones
 * Locks: `hmu` is held by whoever handles deliveries; `mu` guards the tables, the stream position
 * and the counters; `qmu` the delivery queue.  Order: hmu, then mu or qmu.
 * Router calls are never made under `mu` (see sync/replica.c, "Threads and locks").
 */
#ifndef KVR_SYNC_REPLICA_INTERNAL_H
#define KVR_SYNC_REPLICA_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "core/replica_hooks.h"
#include "kvrouter.h"
#include "sync/cond.h"
#include "sync/park.h"
#include "sync/replica.h"
#include "sync/replica_msg.h"
#include "sync/replica_trace.h"
#include "sync/ring.h"

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

struct kvr_rep_item {
	struct kvr_rep_item *next;
	uint64_t rx_ns; /* when delivered, if tracing (sync/replica_trace.h); else 0 */
	size_t len;
	char *reply;
	uint8_t data[];
};

/* One attempt this replica knows: its own (origin = self) or a peer's mirrored here. */
struct kvr_rep_rec {
	struct kvr_rep_rec *hnext;       /* map chain */
	struct kvr_rep_rec *prev, *next; /* the live list, or its rank's journal once finished */
	uint64_t origin, oepoch, oattempt, local;
	struct kvr_rank_id rank;
	uint64_t incarnation, prompt_tokens, lora_seed, fin_no, fin_ns;
	/* rep->jmarks when it was booked here (a peer's: read before the booking) or its admission
	 * taken by the sender (an own): ended after a clear of its rank's journal, it joins none
	 * (kvr_rep_journal_add). */
	uint64_t jmark;
	uint32_t overlap, expected, n_blocks, tail_n, n_out, out_cap;
	bool chain_known, prefilled;
	bool out_counted; /* the last output token's slot is counted (it came as not final) */
	/* A peer's attempt whose output this router could not take (sync/replica_apply.c,
	 * apply_output): out holds what it was told, and later output waits for the origin's
	 * re-announce instead of landing out of place in the chain. */
	bool out_gap;
	/* An own attempt whose output could not be copied into out for memory (sync/replica_out.c,
	 * out_progress): its output is still published, but out stops there (a re-announce or a
	 * snapshot carries what it holds, a prefix of the chain). */
	bool out_short;
	bool seen; /* resync: named by the snapshot */
	uint64_t *blocks;
	uint32_t *tail;
	uint32_t *out;
	size_t size;
};

/* A note kept aside because the outbound queue was full (sync/replica_note.c: note_keep): the
 * queue message it would have been, owning what that owns. */
struct kvr_rep_kept {
	struct kvr_rep_kept *next;
	size_t bytes; /* counted in rep->kept_bytes: the node and what its note owns */
	bool spare;   /* one of rep->kept_spare (memory was short), not allocated */
	struct kvr_msg m;
};

/* Kept-note nodes set aside when the replica is made, for a note kept while memory is short:
 * an end lost then would leave its attempt mirrored on every peer for good. */
#define KEPT_SPARE 64 /* at most 64: one bit each in kept_spare_free */

/* An own attempt whose end came before its admission, or whose withdrawal (KVR_OP_WITHDRAWN)
 * came before its end (sync/replica_early.c). */
struct kvr_rep_early {
	uint64_t a;  /* the attempt; 0: an empty slot */
	uint64_t ns; /* when it was handled (CLOCK_MONOTONIC) */
};

/* A rank change's version (sync/replica_ranks.c): a hybrid logical clock (wall-clock ns, or
 * one past the highest clock made or seen here, whichever is larger) and the replica that made
 * the change.  Ordered by clock, then writer.  {0, 0}: none (a change an older peer told
 * unversioned). */
struct kvr_rep_ver {
	uint64_t clock, writer;
};

static inline int kvr_rep_ver_cmp(struct kvr_rep_ver a, struct kvr_rep_ver b)
{
	if (a.clock != b.clock)
		return a.clock < b.clock ? -1 : 1;
	return a.writer < b.writer ? -1 : a.writer > b.writer;
}

struct kvr_rep_rank {
	struct kvr_rank_id id;
	uint64_t incarnation, capacity;
	uint32_t mbt;
	struct kvr_rep_rec *jhead, *jtail; /* finished attempts, oldest first */
	uint64_t jblocks;
	/* rep->jmarks after the journal's last clear (a reset, a new incarnation) or the entry's
	 * making for a rank back from a tombstone (0: neither, the rank's first life here). */
	uint64_t jmark;
	/* The version of the change that made the entry what it is (an add, a capacity change, a
	 * reset, a removal), and of the last reset ({0, 0}: none).  The reset has its own: told
	 * again, it must reset only a replica that has not heard it, whatever came after. */
	struct kvr_rep_ver ver, reset_ver;
	bool listed; /* resync: named by the snapshot being applied (sync/replica_snap.c) */
	/* A snapshot judged the rank gone at this version and its removal from the router failed
	 * (no memory): the heartbeats try again while ver is still this ({0, 0}: none;
	 * sync/replica_ranks.c, remove_judged), of the router's life of the rank it judged
	 * (kvr_repl_rank_life) and of no other. */
	struct kvr_rep_ver doomed;
	uint32_t doomed_slot;
	uint64_t doomed_gen;
	/* The router's life of the rank this entry describes (its add's, told by the add's note or
	 * read after a peer's add was applied); gen 0: not known (judged_life reads the router's
	 * then).  Context: mu held. */
	struct kvr_rank_life life;
};

/* A tombstone: rank id was removed at version ver (incarnation: the removal's, told with it: a
 * receiver holding a newer life refuses it), removed_ns (CLOCK_MONOTONIC) ago.  Kept
 * c.tombstone_ms so that an older add told again (a cut-off peer's re-announce, a snapshot
 * served before its provider heard the removal) loses to it, and told in every re-announce
 * and snapshot meanwhile.  Only what that needs, and what a re-add of the rank keeps (the
 * last reset's version, max batched tokens), in a table of its own: an hour of churn's
 * tombstones were whole entries (168 bytes; 64 now), and the entries' lookups walked them. */
struct kvr_rep_tomb {
	uint64_t worker_id;
	uint32_t dp_rank, mbt;
	uint64_t incarnation, removed_ns;
	struct kvr_rep_ver ver, reset_ver;
};

/* An index by rank id over a table's positions (sync/replica_table.c): the entries', the
 * tombstones'. */
struct kvr_rep_ix {
	uint32_t *slot; /* a position in the table + 1; 0: empty */
	size_t cap;     /* slots: a power of two, at least twice the table's elements, or 0 */
};

struct kvr_rep_peer {
	uint64_t id, epoch, last_seq, hb_seq, last_seen;
	bool alive, lost;
	/* Lost by its goodbye: it left the cluster, so a resync no longer waits for its answer
	 * (sync/replica_snap.c, all_busy); cleared when its id is heard again (a new life). */
	bool left;
	uint64_t lost_ns; /* when it was given up (a resync weighs it: sync/replica_snap.c) */
	uint64_t live;
	uint64_t heal_ns;  /* when it was last asked to re-announce for a loss (rate limit) */
	bool heal_pending; /* asked, and its RESET has not come yet */
};

/* A staging slab (sync/replica_note.c): a routing thread copies an admission here, into memory
 * that stays warm because slabs are reused lowest index first, instead of allocating a record
 * (cold memory) on the routing path; the sender builds the record and frees the slab.  64:
 * in bench_sync --rate 5000 (part 1 routes back to back) 16-25% of admissions found all of 32
 * slabs queued (the sender behind), 6-15% of 64. */
#define OUT_SLABS       64 /* at most 64: one bit each in slab_free */
#define OUT_SLAB_BLOCKS 2048u
#define OUT_SLAB_TAIL   256u
struct kvr_rep_slab {
	struct kvr_repl_admission a; /* its pointers are the caller's: not used after the note */
	uint64_t blocks[OUT_SLAB_BLOCKS];
	uint32_t tail[OUT_SLAB_TAIL];
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
	/* When a newer life of our own id (a forged message with a larger epoch) was last heard,
	 * kvr_rep_mono_ns; 0: none, or it said goodbye (kvr_sync_stats.displaced). */
	uint64_t displaced_ns;
	struct kvr_msg_buf obuf; /* one message outside the stream (heartbeat, goodbye, requests) */
	struct kvr_msg_buf sbuf; /* stream messages not sent yet (sync/replica_out.c: a batch) */
	uint32_t sbatch_n;       /* how many; each already took its sequence number */
	size_t sbuf_mark;        /* where the last message appended to sbuf starts */
	size_t max_msg;          /* the transport's largest message (0: no limit) */
	struct kvr_rep_rec **map;
	size_t map_cap, map_n;
	struct kvr_rep_rec *live_head, *live_tail;
	struct kvr_rep_rank *ranks; /* the ranks (no tombstone) */
	size_t n_ranks, ranks_cap;
	struct kvr_rep_ix rix;      /* their index by id (sync/replica_table.c) */
	struct kvr_rep_tomb *tombs; /* the removals remembered, in no order */
	size_t n_tombs, tombs_cap;
	struct kvr_rep_ix tix; /* their index by id: room for every tombstone and entry's */
	/* What the ranks' journals hold (each record with its arrays, at the sizes asked for),
	 * kept as records join and leave them so that kvr_memory.replica_ranks costs no walk. */
	uint64_t jbytes;
	struct kvr_rep_peer peers[MAX_PEERS];
	size_t n_peers;
	/* outage_ns: when the disconnect that began the open outage was seen (see outage_open).
	 * A reconnect re-announces the attempts finished from OUTAGE_MARGIN_NS before it: notes
	 * made while disconnected are not sent, so that is how peers learn of them.  Taken again
	 * at a second disconnect after a connection back for a moment (its re-announce lost, its
	 * resync applying nothing), it left out those finished before it, which the peers then
	 * held released as aborted or never saw (test_replica_serve
	 * a_flapping_reconnect_still_reannounces_what_was_finished_in_the_outage).  The price of
	 * keeping it: an outage left open by a resync that found nobody (a lone replica) is
	 * re-announced whole at the first reconnect that has peers, again to any that heard it. */
	uint64_t fin_no, outage_ns;
	uint64_t jmarks;     /* journal clears so far, of every rank (kvr_rep_rank.jmark) */
	uint64_t rank_clock; /* the highest rank version clock made or seen */
	/* When a peer's message was last handled (0: never), and what that was when the last
	 * disconnect was seen: when this replica last heard the cluster before its own outage,
	 * which a reconnect's resync weighs its given-up peers against (sync/replica_snap.c,
	 * all_busy).  Not outage_ns: a connection that died unnoticed is found only by the
	 * client's pings, long after the silence began and the peers were given up for it.
	 * outage_heard_ns is kept while outage_open: from a disconnect until a reconnect's resync
	 * applied a snapshot with no disconnect between.  A connection back for a moment (its
	 * resync found nobody, or the link dropped during it) did not end the outage; taken again
	 * at the next disconnect, after a peer was heard in that moment, it made the peers given
	 * up in the outage too old to count (test_replica_serve
	 * a_flapping_reconnect_still_waits_for_the_peers_given_up_in_the_outage). */
	uint64_t heard_ns, outage_heard_ns;
	bool outage_open;
	/* The newest removal whose tombstone this replica forgot, or a snapshot's provider had
	 * ({0, 0}: none); and the clock of this replica's own rank changes from OUTAGE_MARGIN_NS
	 * before the disconnect that began the open outage on (0: none; kept as outage_ns is),
	 * which a snapshot applied after it does not judge (sync/replica_ranks.c, "Forgetting"). */
	struct kvr_rep_ver rank_floor;
	uint64_t outage_clock;
	struct kvr_sync_stats st;

	/* Held by whoever handles deliveries, heartbeats and resyncs: the apply thread, or a
	 * transport thread handling a message inline (kvr_replica_deliver_inline).  Order: hmu
	 * before qmu (the inline path only trylocks hmu under qmu). */
	pthread_mutex_t hmu;

	pthread_mutex_t qmu;
	pthread_cond_t qcv, donecv;
	struct kvr_rep_item *qhead, *qtail;
	uint64_t q_in, q_done;
	bool stop, want_reconnect, ready;
	bool want_reannounce;   /* under mu: a peer asked (SNAP_REQ on the stream) */
	uint64_t reannounce_ms; /* under mu: how far back the askers need finished attempts */
	uint64_t reconnect_ns;  /* hmu: when the last outage ended */
	uint64_t handle_rx_ns;  /* hmu: the handled item's rx_ns (tracing) */
	pthread_t thread;
	bool thread_started;
	uint64_t flush_done; /* under qmu: the highest outbound flush ticket the sender passed */
	uint64_t stall_until_ns; /* atomic: kvr_replica_stall (CLOCK_MONOTONIC); 0 = none */
	bool stall_sender;       /* atomic: the stall holds the sender too */

	/* The outbound queue (sync/replica_note.c, replica_out.c): notes from routing threads to
	 * the sender. */
	struct kvr_ring outq;
	struct kvr_parker out_park;
	uint64_t burst_ns; /* sender thread: when the current burst was dequeued (tracing) */
	pthread_t out_thread;
	bool out_started;
	bool out_stop;        /* atomic: the sender exits once the ring is empty */
	bool out_go;          /* atomic: kvr_replica_start succeeded: the sender handles notes */
	uint64_t flush_req;   /* atomic: outbound flush tickets handed out */
	uint64_t out_dropped; /* atomic: notes lost before the queue (no memory, ring full) */
	uint64_t in_dropped;  /* atomic: deliveries lost for memory (kvr_replica_deliver) */
	struct kvr_rep_kept *kept; /* atomic: notes kept aside (the queue was full), newest first */
	uint64_t kept_bytes; /* atomic: what they hold (at most c.kept_bytes_max, but ranks) */
	uint32_t kept_over;  /* atomic: notes are dropped past the cap; the sender heals */
	uint64_t over_cap;   /* atomic: notes dropped past the cap */
	struct kvr_rep_kept *kept_spare; /* [KEPT_SPARE] */
	uint64_t kept_spare_free;        /* atomic: a bit per free one */
	struct kvr_rep_slab *slabs;      /* [OUT_SLABS] */
	/* The ranks the router held at kvr_replica_start, read after its OUT_BOOT marker was
	 * pushed, each told as an add by the sender at the marker's place (sync/replica.c); written
	 * before the sender starts, then the sender's, which frees them. */
	struct kvr_rep_out_rank *boot;
	size_t n_boot;
	/* Under mu (the sender): own attempts whose end was noted before their admission (a
	 * posted booking the shard dropped at once, told as an expiry while the routing thread
	 * had yet to note the admission), so that the admission is not published; a set that
	 * grows (sync/replica_early.c). */
	struct kvr_rep_early *early;
	uint32_t early_cap, early_n; /* entries given up: st.early_lost */
	/* Free slabs, atomic bitmaps, each padded onto a line of its own (the allocation is not
	 * 64-aligned): slab_free is written by the sender (slabs it is done with), slab_mine by
	 * producers (slabs taken from slab_free in one exchange, handed out one per note). */
	char slab_pad0[64];
	uint64_t slab_free;
	char slab_pad1[64];
	uint64_t slab_mine;
	char slab_pad2[64];
};

static inline uint64_t kvr_rep_mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* dead_after x heartbeat_ms in ns, saturating at half of 64 bits: the product overflows 64
 * bits for allowed settings (3,782,740,474 x 43,889 ms wrapped to 35 us: every peer given up at
 * once; test_replica_hooks silence_bound_does_not_wrap). */
static inline uint64_t kvr_rep_silence_bound(const struct kvr_replica *rep)
{
	unsigned __int128 b = (unsigned __int128)rep->c.dead_after * rep->c.heartbeat_ms * 1000000u;
	return b > UINT64_MAX / 2 ? UINT64_MAX / 2 : (uint64_t)b;
}

/* Waits on cv (kvr_cond_init: on CLOCK_MONOTONIC, so a wall clock stepped back does not stop
 * the heartbeats; mu held) at most wait_ns; callers loop and re-check. */
static inline void kvr_rep_timedwait(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t wait_ns)
{
	kvr_cond_wait_ns(cv, mu, wait_ns);
}

/* For a wait with a deadline (CLOCK_MONOTONIC ns): false when it has passed, else waits on cv
 * at most 10 ms (a waiter that misses a broadcast re-checks soon) and returns true. */
static inline bool kvr_rep_wait_deadline(pthread_cond_t *cv, pthread_mutex_t *mu,
                                         uint64_t deadline_ns)
{
	uint64_t t = kvr_rep_mono_ns();
	if (t >= deadline_ns)
		return false;
	kvr_rep_timedwait(cv, mu, deadline_ns - t < 10000000ull ? deadline_ns - t : 10000000ull);
	return true;
}

/* Whether kvr_replica_stall holds this replica's threads now. */
static inline bool kvr_rep_stalled(struct kvr_replica *rep, uint64_t now)
{
	return now < __atomic_load_n(&rep->stall_until_ns, __ATOMIC_ACQUIRE);
}
static inline bool kvr_rep_sender_stalled(struct kvr_replica *rep, uint64_t now)
{
	if (!__atomic_load_n(&rep->stall_sender, __ATOMIC_RELAXED))
		return false;
	return now < __atomic_load_n(&rep->stall_until_ns, __ATOMIC_ACQUIRE);
}

/* Runs a router call as a peer's: no note goes out.  No lock held. */
#define APPLYING(expr)                                                                             \
	({                                                                                         \
		kvr_repl_applying = true;                                                          \
		int rc_ = (expr);                                                                  \
		kvr_repl_applying = false;                                                         \
		rc_;                                                                               \
	})

/* ---------------------------------------------------------------- sync/replica_table.c
 * Context for all: mu held (records not yet published to the tables: any thread). */

/* A record with room for n blocks and tail_n tail tokens (the caller fills the arrays), or NULL. */
struct kvr_rep_rec *kvr_rep_rec_new(uint32_t n, uint32_t tail_n);
/* Frees x and its output; NULL is a no-op. */
void kvr_rep_rec_free(struct kvr_rep_rec *x);
/* Makes room for n more output tokens in x (nothing else changes).  0, KVR_ERANGE,
 * KVR_ENOMEM. */
int kvr_rep_rec_reserve_out(struct kvr_rep_rec *x, size_t n);
/* Appends n output tokens to x; n > 0 sets x->out_counted to not_final (the last token's
 * slot is counted).  0, KVR_ERANGE, KVR_ENOMEM; none after kvr_rep_rec_reserve_out(x, n). */
int kvr_rep_rec_append_out(struct kvr_rep_rec *x, const uint32_t *t, size_t n, bool not_final);
/* The map (origin, origin attempt) -> record of the live attempts. */
struct kvr_rep_rec *kvr_rep_map_find(struct kvr_replica *rep, uint64_t origin, uint64_t attempt);
int kvr_rep_map_insert(struct kvr_replica *rep, struct kvr_rep_rec *x); /* 0 or KVR_ENOMEM */
void kvr_rep_map_remove(struct kvr_replica *rep, struct kvr_rep_rec *x);
/* The live list, oldest first (what snapshots and re-announces walk). */
void kvr_rep_live_link(struct kvr_replica *rep, struct kvr_rep_rec *x);
void kvr_rep_live_unlink(struct kvr_replica *rep, struct kvr_rep_rec *x);
/* Ranks known to the cluster and their journals of finished attempts, and the tombstones of
 * those removed.  find: the rank's entry, NULL if none (a tombstone is none); get: the same,
 * made if need be (from its tombstone, if any: its versions, incarnation and max batched
 * tokens kept, the tombstone forgotten) with room for its own tombstone, NULL for memory (the
 * tombstone kept); drop: forgets the entry.  tomb_find: the rank's tombstone, NULL if none;
 * bury: the rank's entry becomes its tombstone at version v, removed now (its last reset and
 * max batched tokens kept, its incarnation or the removal's, the higher; a tombstone there
 * already is renewed; made if neither), journal freed, the tombstone copied into *told (may be
 * NULL): false when it could not be kept for memory, which only a rank with neither can meet
 * (not kept, nothing else changed); tomb_drop: forgets the tombstone.  Entries and tombstones move
 * when others go: their addresses last until the next get, drop, bury or tomb_drop. */
struct kvr_rep_rank *kvr_rep_rank_find(struct kvr_replica *rep, struct kvr_rank_id id);
struct kvr_rep_rank *kvr_rep_rank_get(struct kvr_replica *rep, struct kvr_rank_id id);
void kvr_rep_rank_drop(struct kvr_replica *rep, struct kvr_rank_id id);
struct kvr_rep_tomb *kvr_rep_tomb_find(struct kvr_replica *rep, struct kvr_rank_id id);
bool kvr_rep_rank_bury(struct kvr_replica *rep, struct kvr_rank_id id, struct kvr_rep_ver v,
                       uint64_t incarnation, struct kvr_rep_tomb *told);
void kvr_rep_tomb_drop(struct kvr_replica *rep, struct kvr_rank_id id);
/* The bytes the rank table holds (kvr_memory.replica_ranks): its entries', tombstones' and
 * indexes' arrays, and its journals' records, at the sizes asked for.  O(1).  mu held. */
uint64_t kvr_rep_ranks_bytes(const struct kvr_replica *rep);
/* Frees entry e's journal. */
void kvr_rep_journal_clear(struct kvr_replica *rep, struct kvr_rep_rank *e);
/* A finished attempt joins its rank's journal (takes x; freed when it has no place). */
void kvr_rep_journal_add(struct kvr_replica *rep, struct kvr_rep_rec *x);
struct kvr_rep_peer *kvr_rep_peer_find(struct kvr_replica *rep, uint64_t id);
struct kvr_rep_peer *kvr_rep_peer_get(struct kvr_replica *rep,
                                      uint64_t id); /* NULL: MAX_PEERS alive */

/* ---------------------------------------------------------------- sync/replica_early.c */

/* The set starts with room for 63 (no allocation after this).  0 or KVR_ENOMEM.
 * Context: create, before the sender starts. */
int kvr_rep_early_init(struct kvr_replica *rep);
/* Context: destroy, after the sender stopped. */
void kvr_rep_early_fini(struct kvr_replica *rep);
/* Remembers that own attempt a ended with no record (now: CLOCK_MONOTONIC ns).  Context: mu. */
void kvr_rep_early_add(struct kvr_replica *rep, uint64_t a, uint64_t now);
/* Whether own attempt a ended already; forgets it.  Context: mu held. */
bool kvr_rep_early_take(struct kvr_replica *rep, uint64_t a);
/* One of the two notes of an own attempt that is never admitted (its end with no record, or
 * its withdrawal, KVR_OP_WITHDRAWN): the other is taken out if it came first, else this one
 * waits for it.  Context: mu held. */
void kvr_rep_early_pair(struct kvr_replica *rep, uint64_t a, uint64_t now);

/* ---------------------------------------------------------------- sync/replica_out.c */

/* Appends x as an ADMIT or ATTEMPT message to b (finished: the ATTEMPT's finished flag).  With
 * max_len (0: none) a message that would be longer carries only the chain's first blocks that
 * fit, as an unknown chain (no tail, no output): peers then mirror the attempt, its load and that
 * prefix, rather than nothing; *truncated counts it.  Context: the owner of b and of *truncated
 * (mu held for rep->st). */
void kvr_rep_encode_attempt(struct kvr_msg_buf *b, unsigned type, uint64_t replica, uint64_t epoch,
                            uint64_t seq, const struct kvr_rep_rec *x, bool finished,
                            size_t max_len, uint64_t *truncated);
/* Appends a RANK message (op, e's fields) to b, versioned with e's version (its reset's for a
 * reset; unversioned when it has none).  Context: as kvr_rep_encode_attempt. */
void kvr_rep_encode_rank(struct kvr_msg_buf *b, uint64_t replica, uint64_t epoch, uint64_t seq,
                         unsigned op, const struct kvr_rep_rank *e);
/* The same for tombstone t: a REMOVE, its capacity KVR_CAPACITY_NONE (a removal's is read by
 * nobody). */
void kvr_rep_encode_tomb(struct kvr_msg_buf *b, uint64_t replica, uint64_t epoch, uint64_t seq,
                         const struct kvr_rep_tomb *t);
/* Sends the stream messages waiting in sbuf as one transport message (published += n), or
 * counts them unpublished and gives their sequence numbers back; true when sent (or none
 * waited).  Context: mu held; every writer of the stream calls it before releasing mu. */
bool kvr_rep_stream_flush(struct kvr_replica *rep);
/* The router's notes (struct kvr_repl_hooks): copied into the outbound queue for the sender
 * thread.  Context: frontend or shard threads, inside the router's RCU read section; no lock,
 * no syscall unless the sender is parked (or the queue is full). */
void kvr_rep_note_admit(void *ctx, const struct kvr_repl_admission *a);
void kvr_rep_note_progress(void *ctx, uint64_t attempt, int op, const uint32_t *tokens, size_t n,
                           bool not_final);
void kvr_rep_note_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t incarnation,
                       uint64_t capacity, uint32_t mbt, struct kvr_rank_life life);
/* Makes the outbound queue and the staging slabs.  0 or KVR_ENOMEM.  Context: create. */
int kvr_rep_out_init(struct kvr_replica *rep);
/* Starts the sender thread, which handles no note until kvr_rep_out_go.  0 or KVR_ENOMEM.
 * Context: kvr_replica_start. */
int kvr_rep_out_start(struct kvr_replica *rep);
/* Lets the started sender handle the notes.  Context: kvr_replica_start, once it succeeded. */
void kvr_rep_out_go(struct kvr_replica *rep);
/* Publishes what is queued (once let go: else nothing), then stops the sender.  Context:
 * teardown or a failed start, after the hooks are gone (nothing is queued any more). */
void kvr_rep_out_stop(struct kvr_replica *rep);
/* Waits until every note queued before the call has been handled (published or counted) or
 * deadline_ns (CLOCK_MONOTONIC) passes.  0 or KVR_ETIMEDOUT.  Context: any thread but the
 * sender, not holding mu or qmu. */
int kvr_rep_out_flush(struct kvr_replica *rep, uint64_t deadline_ns);
/* Frees the queued and kept notes, and what they own, without handling them.  Context: the
 * sender not running and no note in flight (the hooks gone). */
void kvr_rep_out_drop(struct kvr_replica *rep);
/* Frees what is left in the queue and the queue.  Context: destroy, the sender stopped. */
void kvr_rep_out_fini(struct kvr_replica *rep);
/* Asks peer id on the stream to re-announce (RESET + its attempts, finished ones of the last
 * window_ms too).  Context: mu held. */
void kvr_rep_ask_reannounce(struct kvr_replica *rep, uint64_t id, uint64_t window_ms);
/* Appends a RANK message (op, e's fields and version) to the stream.  The caller flushes
 * (kvr_rep_stream_flush) before releasing mu.  Context: mu held. */
void kvr_rep_tell_rank(struct kvr_replica *rep, unsigned op, const struct kvr_rep_rank *e);
/* The same for tombstone t: a REMOVE, versioned with t's version. */
void kvr_rep_tell_tomb(struct kvr_replica *rep, const struct kvr_rep_tomb *t);
/* Sends RESET, the rank table (kvr_rep_rank_told: tombstones and resets included, versioned),
 * own attempts finished since since_ns (0: none) and own live attempts.  Context: the apply
 * thread; takes mu. */
void kvr_rep_reannounce(struct kvr_replica *rep, uint64_t since_ns);

/* ---------------------------------------------------------------- sync/replica_note.c
 * The outbound queue's messages: what a note becomes in the ring (its kind in kvr_msg.aux). */

enum {
	OUT_ADMIT = 1,
	OUT_PROGRESS = 2,
	OUT_RANK = 3,
	OUT_FLUSH = 4,
	OUT_ADMIT_SLAB = 5,
	OUT_NONE = 6, /* a reserved slot left empty (no memory: the note went through the slabs) */
	OUT_BOOT = 7  /* kvr_replica_start's announce of the ranks held before (kvr_replica.boot) */
};

#define OUT_INLINE 8 /* output tokens carried in the ring message itself */

struct kvr_rep_out_progress {
	uint64_t attempt;
	int16_t op;
	uint16_t not_final;
	uint32_t n;
	union {
		uint32_t inl[OUT_INLINE];
		uint32_t *heap; /* n > OUT_INLINE: a kvr_alloc'd copy the sender frees */
	} t;
};

struct kvr_rep_out_rank {
	uint64_t worker_id, incarnation, capacity, life_gen;
	uint32_t dp_rank, mbt, life_slot;
	int32_t op;
};

_Static_assert(sizeof(struct kvr_rep_out_progress) <= KVR_MSG_PAYLOAD, "fits a ring message");
_Static_assert(sizeof(struct kvr_rep_out_rank) <= KVR_MSG_PAYLOAD, "fits a ring message");

/* kvr_replica.kept_over: notes are dropped past the cap; output was among them. */
#define KEPT_OVER        1u
#define KEPT_OVER_OUTPUT 2u

/* Pushes a note into the ring (waiting OUT_FULL_WAIT_NS for room, then keeping it aside), or
 * keeps it aside at once while notes are kept.  Context: any thread but the sender. */
void kvr_rep_out_push(struct kvr_replica *rep, unsigned kind, const void *payload, uint32_t len);
/* Whether notes are kept aside (or dropped past the cap): a note made now goes after them.
 * Context: any thread. */
bool kvr_rep_keeping(const struct kvr_replica *rep);
/* Frees what a queued message owns (it is not going out).  Context: any thread owning m. */
void kvr_rep_out_discard(struct kvr_replica *rep, const struct kvr_msg *m);
/* Frees a kept note's node (a spare goes back).  Context: the sender (or teardown). */
void kvr_rep_kept_free(struct kvr_replica *rep, struct kvr_rep_kept *k);
/* Gives the staging slabs of mask back.  Context: the sender, or a producer giving back its
 * own. */
void kvr_rep_slab_put(struct kvr_replica *rep, uint64_t slabs);
/* The record of an admission staged in the slabs of mask, or NULL (no memory).  Context: the
 * sender. */
struct kvr_rep_rec *kvr_rep_rec_of_slabs(const struct kvr_replica *rep, uint64_t mask);

/* ---------------------------------------------------------------- sync/replica_apply.c
 * Context for all: the apply thread (kvr_rep_release_mirrors: also teardown, once it stopped),
 * mu not held (they take it around table updates). */

/* Handles one delivered message (reply: where a snapshot request wants its chunks). */
void kvr_rep_handle(struct kvr_replica *rep, const uint8_t *data, size_t len, const char *reply);
/* Books a peer's ADMIT/ATTEMPT (or catches a known one up; a finished one is replayed). */
void kvr_rep_apply_attempt(struct kvr_replica *rep, const struct kvr_wmsg *m);
/* Releases the attempts mirrored from origin (every origin but self when 0; with unseen_only
 * only those a snapshot did not name): their blocks stay predicted, their load goes.  Returns
 * how many. */
uint64_t kvr_rep_release_mirrors_if(struct kvr_replica *rep, uint64_t origin, bool unseen_only);
uint64_t kvr_rep_release_mirrors(struct kvr_replica *rep, uint64_t origin);
/* Sends our heartbeat and gives up the peers silent beyond the liveness bound while this
 * replica was listening: deaf_ns is how long it was not (its apply thread did not run), added to
 * every peer's silence allowance first; no peer is given up while delivered or transport-held
 * messages wait to be handled (for at most one more bound). */
void kvr_rep_heartbeat(struct kvr_replica *rep, uint64_t now, uint64_t deaf_ns);

/* ---------------------------------------------------------------- sync/replica_snap.c
 * Context: the apply thread, mu not held. */

/* Serves a snapshot to reply subject `to`. */
void kvr_rep_serve_snapshot(struct kvr_replica *rep, const char *to);
/* Asks a peer for a snapshot and applies it (asked again, within snapshot_timeout_ms, when
 * the provider gives it up).  0 (applied), KVR_ENOENT (no peer), or an error. */
int kvr_rep_resync(struct kvr_replica *rep);
/* Tells the asker at reply subject `to` that its snapshot is given up (it cannot be served
 * whole for memory: its request was lost, or its building failed) with chunk number `chunk`,
 * the next the asker expects, so that it asks again at once instead of waiting out
 * snapshot_timeout_ms.  Encoded on the stack: allocates nothing.  Best effort (a transport
 * that refused a chunk may refuse this too; then the asker waits).  Context: any thread (reads
 * only what is set at create). */
void kvr_rep_snapshot_give_up(struct kvr_replica *rep, const char *to, uint32_t chunk);

/* ---------------------------------------------------------------- sync/replica_ranks.c */

/* A peer's rank change (a stream message, a snapshot's record), applied to the router unless
 * the entry holds a newer version, then the table follows the router.  Context: the apply
 * thread, mu not held. */
void kvr_rep_apply_rank(struct kvr_replica *rep, const struct kvr_wmsg *m);
/* An own rank change (the router made it): the entry (a removal: the tombstone) takes it with
 * a new version, and the stream tells it; for memory, not (lost).  Context: the sender, mu
 * held. */
void kvr_rep_rank_changed(struct kvr_replica *rep, int op, struct kvr_rank_id rank,
                          uint64_t incarnation, uint64_t capacity, uint32_t mbt,
                          struct kvr_rank_life life);
/* The RANK ops that tell entry e whole, in order, into ops[3]; returns how many: its add, then
 * its last reset (a tombstone is told as its removal: kvr_rep_tell_tomb).  Context: mu held. */
size_t kvr_rep_rank_told(const struct kvr_rep_rank *e, unsigned ops[3]);
/* Forgets the tombstones older than c.tombstone_ms (now: CLOCK_MONOTONIC ns), raising
 * rank_floor to the newest of them.  Context: mu held. */
void kvr_rep_ranks_expire(struct kvr_replica *rep, uint64_t now);
/* The start of the next own disconnection: own rank changes from OUTAGE_MARGIN_NS before now
 * on are not judged by the snapshot that follows the reconnect.  Context: mu held. */
void kvr_rep_ranks_outage(struct kvr_replica *rep);
/* A snapshot's rank records: begin before applying them (no entry listed), listed for each
 * record applied (its rank's entry is named), end after them with the provider's floor
 * ({0, 0}: none): ranks the snapshot does not name and older than the floor are gone, or told
 * again (sync/replica_ranks.c, "Forgetting").  Context: the apply thread; begin and listed
 * with mu held, end without (it calls the router). */
void kvr_rep_ranks_snapshot_begin(struct kvr_replica *rep);
void kvr_rep_ranks_listed(struct kvr_replica *rep, struct kvr_rank_id id);
void kvr_rep_ranks_snapshot_end(struct kvr_replica *rep, struct kvr_rep_ver floor);
/* Tries again to remove the ranks a snapshot judged gone whose removal failed (no memory),
 * unchanged since; each counted in rank_stale once gone.  Context: the apply thread (its
 * heartbeat), mu not held (it calls the router). */
void kvr_rep_ranks_retry(struct kvr_replica *rep);

/* ---------------------------------------------------------------- with the feeds (sync/feed.c) */

/* The replica whose deliveries the calling thread handles now (its apply thread, or a transport
 * thread inside kvr_replica_deliver_inline), NULL if none.  Context: any thread. */
const struct kvr_replica *kvr_replica_handling_now(void);

/* A wait for rep (kvr_replica_drain, kvr_replica_wait_ready) begins on the calling thread: on a
 * feed's thread (one of its callbacks), KVR_EBUSY if rep's handling thread is waiting in a call
 * on that feed (each would wait for the other: sync/feed.c, "A feed's callback waiting for a
 * replica"), else recorded, for such a call to see, until kvr_feed_wait_replica_end; 0 on any
 * other thread.  Defined in sync/feed.c (sync/feed_none.c without ZeroMQ: 0, nothing). */
int kvr_feed_wait_replica_begin(const struct kvr_replica *rep);
void kvr_feed_wait_replica_end(void);

#endif
