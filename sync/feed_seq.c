/*
 * sync/feed_seq.c - the stream of one endpoint: receiving its messages, the sequence rules,
 * gaps healed by replay, publisher restarts.
 *
 * The stream, per endpoint (vllm/distributed/kv_events.py, ZmqEventPublisher):
 *   PUB:    [topic, seq (8 bytes BE, 0.. from publisher start), payload]
 *   ROUTER: a DEALER sends ["", start_seq]; the publisher answers one message per buffered batch
 *           with seq >= start_seq, ["", seq, payload] (or ["", topic, seq, payload]), then the
 *           end marker ["", seq = -1 (0xFF x 8), ""].  It keeps the last buffer_steps batches.
 *
 * Sequence rules.  Two cursors per endpoint: next_seq (the next batch to apply, whatever its
 * source) and last_live (the last seq the SUB socket delivered).  ZeroMQ delivers one
 * publisher's messages in order, so a live seq at or below last_live can only mean a new
 * publisher: the rank is cleared and the stream starts over.  Below next_seq but above
 * last_live is a batch a replay already applied: dropped.  Above next_seq is a gap: replay from
 * next_seq (the replay also returns everything after, including this batch, which is then
 * applied from the replay and the live copies dropped as duplicates).  Whatever a replay
 * cannot cover - no replay endpoint, the buffer starts later, no answer within
 * replay_timeout_ms - is reported through on_event_gap and the rank is cleared: a router that
 * missed removals would credit ranks with blocks they no longer hold, and that is worse than
 * knowing nothing (the rank refills with the next stores).  A stream first seen at seq > 0 is a
 * gap from 0 (the router started after the publisher): a replay usually covers it.
 *
 * Restarts across a reconnection.  A restarted vLLM publisher counts from 0 again, but the
 * subscriber reconnects only after ZMQ_RECONNECT_IVL (100 ms) and a PUB socket drops what it
 * sends before then: the first seq the feed sees from the new publisher may lie above the old
 * one's, which the rules above would take for a gap and "heal" by replaying the new stream's
 * batches on top of the old stream's state.  So a monitor on the SUB socket reports
 * disconnections (ZMQ_EVENT_DISCONNECTED), and the first live batch of the new connection
 * decides: exactly next_seq continues the old stream (the same publisher, nothing lost); any
 * other is taken for a restart: the ranks are cleared and the stream starts over from 0 (a
 * replay from 0 then rebuilds the new publisher's state, or the gap is reported).  The cost of
 * that choice: the same publisher losing messages during a network outage is also cleared and
 * rebuilt, from 0, if its replay buffer still reaches back that far, else the ranks refill as
 * events come - never a state mixed from two streams.
 *
 * Which batch is the new connection's first.  ZeroMQ orders nothing between the monitor and
 * the SUB socket, and a connect()ed SUB keeps one queue across reconnections: the old
 * connection's last batches and the new one's first wait in it in order, with no mark between
 * them.  Before, the feed read the monitor only between drains, so a drain that outlasted the
 * reconnection (a replay's wait, a slow on_event_gap) applied the new publisher's batches by
 * the old stream's rules, and the disconnection read afterwards had the new stream's next
 * batch decide (test_feed_restart a_restart_queued_behind_the_old_streams_tail_is_a_restart).
 * What libzmq 4.3's engine does give (stream_engine_base.cpp, session_base.cpp):
 *  1. the old connection's batches are in the queue before its DISCONNECTED is on the monitor
 *     (each read is flushed to the queue before the engine reads the end of the stream);
 *  2. the new connection's HANDSHAKE_SUCCEEDED is on the monitor before its first batch is in
 *     the queue, and that handshake comes at least ZMQ_RECONNECT_IVL after the DISCONNECTED.
 * So (ep.reconn): while draining, the monitor is read after a batch is received whenever
 * FEED_MON_EVERY_MS (20 ms, well within the 100 ms of 2.) have passed since the last look: a
 * batch received before a look that shows no disconnection is the old connection's.  A
 * DISCONNECTED makes RC_TAIL: what the queue holds is the old connection's (1.), applied by the
 * rules above, and the monitor is read after every batch; the queue found empty then means the
 * tail is read: RC_NEXT, and the next batch is the new connection's first, which decides.  A
 * HANDSHAKE_SUCCEEDED seen in RC_TAIL (the feed read the disconnection only after the
 * reconnection) makes RC_MIXED: the old tail, then the new connection's batches, the boundary
 * unknowable from ZeroMQ; until the queue is found empty each batch that does not continue
 * next_seq is taken for a restart (a continuing one is right under either reading), so that a
 * new stream is never applied on the old one's state; the price, only after a late read, is an
 * old tail that itself skipped a batch taken for a restart too (cleared and rebuilt from 0, as
 * above).
 *
 * Replays take turns.  A replay holds the feed's thread until it ends (up to FEED_REPLAY_ASKS x
 * max(replay_timeout_ms, FEED_REPLAY_END_MIN_MS), 8 s by default), serving no other endpoint
 * and no call meanwhile.  Before, one round of the loop asked for every replay it found, each
 * where it was found: each endpoint's gap in its drain, each rank added late in
 * kvr_feed_resync_added, one after the other, so N slow replayers held the thread N replays'
 * ends, a live batch on another endpoint and a stats call waiting behind all of them
 * (test_feed_replay_turns).  Now a round first serves every endpoint's batches and every call,
 * and ends with one replay at most (kvr_feed_turn): a live batch that needs a replay (its gap,
 * or its rank's resync: kvr_feed_batch_resyncs) is held (ep.held, nothing after it received
 * meanwhile) and goes through the sequence rules at its turn, replayed or reported exactly as
 * it would have been; a rank added late stays missed until its turn (a batch for it the hold
 * did not foresee is dropped as missed, and the resync's replay brings it:
 * kvr_feed_apply_batch).  So a batch or a call waits for the replay in progress at most, not N.
 * Whatever waits takes a ticket (f->tickets), and the turn goes to the oldest, a held gap or
 * the ranks added late (one ticket for them all, f->resync_ticket), so that an endpoint that
 * gaps every round, or a row of resyncs, cannot keep another waiting for good; the next round
 * does not block while any waits.  Nothing is lost by waiting: the gap is the same gap, and a
 * replay that then does not bring it is reported as before.  A remove of the endpoint and the
 * thread's end take a held batch at once (kvr_feed_take_held), as the old code handled a gap
 * before any command.
 */
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <zmq.h>

#include "core/alloc.h"
#include "core/events.h"
#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "shards/u64map.h"
#include "sync/feed_decode.h"
#include "sync/feed_internal.h"

#define END_SEQ UINT64_MAX

/* ---------------------------------------------------------------- the sequence rules */

/* A resync's replay (kvr_feed_resync): the rank added late, the batches it missed, and how far
 * the answer has brought them whole. */
struct resync {
	uint32_t dp;
	uint64_t to;   /* the batches before to are the replay's; the live stream brings the rest */
	uint64_t next; /* the next seq the answer must bring for the range to stay whole */
	bool held;     /* a batch of the rank was applied since the rank was last cleared */
};

/* How one answer to a replay request ended. */
enum answer_end {
	ANS_END,   /* its end marker came */
	ANS_HOLE,  /* a batch inside it was missing: nothing after the hole was taken */
	ANS_LATE,  /* no end marker within replay_timeout_ms */
	ANS_QUIET, /* nothing more for FEED_REPLAY_QUIET_MS after it brought something */
	ANS_FAIL,  /* the request could not be sent, or the socket failed */
	ANS_DROP,  /* a destroy waits for this thread */
};

static enum answer_end replay(struct kvr_feed *f, struct ep *e, uint64_t start, uint64_t target,
                              struct resync *rs);

/* Whether a destroy waits for the feed's thread (kvr_feed_destroy, kvr_router_destroy, or one
 * from a callback): a replay then ends at once, and what it did not bring is no gap.
 * Context: the feed's thread. */
static bool going(const struct kvr_feed *f)
{
	return __atomic_load_n(&f->stopping, __ATOMIC_ACQUIRE) || kvr_feed_dying(f);
}

static void report_gap(struct kvr_feed *f, struct ep *e, uint64_t expected, uint64_t got,
                       const struct kvr_feed_batch *b)
{
	e->st.gaps++;
	kvr_feed_count(f, KVR_C_FEED_GAPS, 1);
	kvr_feed_log(f, e, LK_GAP, KVR_LOG_WARN,
	             "seq gap: expected %" PRIu64 ", got %" PRIu64 "; rank cleared", expected, got);
	/* The rank this batch is for (known even on first contact), and any seen before.  One
	 * the router does not have is remembered as missed from the gap's start (at most
	 * MISSED_MAX such ranks: its resync, once added, replays or reports the gap); remembered
	 * as fed, every batch naming a new dp rank after a gap added a state kept for good, and
	 * each later gap reported all of them (test_feed_hostile gaps_naming_unknown_ranks: 600
	 * batches, 180,300 callbacks).
	 *
	 * An endpoint that takes each batch's dp rank (KVR_FEED_DP_FROM_BATCH) clears only the
	 * ranks it has state of (fed, or named by this batch): a rank (worker_id, d) it never fed
	 * cannot be known to be its own.  vLLM runs one publisher per dp rank, and an embedder may
	 * add each as KVR_FEED_DP_FROM_BATCH under the same worker_id, in this feed or another:
	 * (worker_id, d) is then a sibling endpoint's, healthy, and clearing it (and reporting a
	 * gap for it) at every gap of every sibling would wipe ranks nothing was missed for
	 * (test_feed_takeover a_dp_from_batch_gap_leaves_a_sibling_endpoints_rank).  What the
	 * rank may hold from an earlier feed of this publisher (which the gap may have removed)
	 * goes at the first moment the rank is known to be this endpoint's: its first batch from
	 * it, which clears it before applying (kvr_feed_apply_batch, since == SINCE_NONE;
	 * test_feed_takeover ..._without_replay_clears_each_rank_at_its_first_batch). */
	if (b || e->dp_rank != KVR_FEED_DP_FROM_BATCH) {
		uint32_t dp = kvr_feed_dp_of(e, b), slot;
		if (kvr_router_find_rank(f->r, (struct kvr_rank_id){e->worker_id, dp}, &slot))
			kvr_feed_note_missed(f, e, dp, expected);
		else
			kvr_feed_rstate(e, dp);
	}
	for (uint32_t i = 0; i < e->n_rs; i++) {
		if (f->r->cfg.on_event_gap)
			f->r->cfg.on_event_gap(f->r->cfg.callback_ctx, e->worker_id, e->rs[i].dp,
			                       expected, got);
		kvr_feed_clear_rank(f, e, &e->rs[i], got);
	}
}

/* A gap (expected..got-1, or batch got itself lost for memory) whose replay a destroy ended
 * short of what it needed: not reported (on_event_gap, gaps), since the feed going away missed
 * nothing of the publisher's; but the ranks report_gap would clear are cleared, silently.  The
 * index holds them as of batch expected - 1, and the batches the replay did not bring may have
 * removed blocks: with the feed gone no later event corrects that, and events mode has no TTL,
 * so the router would credit the rank with those blocks until the embedder removed or cleared
 * it.  Before, the rank was left as the replay had left it (test_feed_replay_stop
 * a_heal_a_destroy_ends_leaves_no_removed_block).  The clears go to the shards as any of the
 * feed's events do, and are applied before the feed's thread ends (kvr_feed_destroy from an
 * ordinary thread returns after that; kvr_router_destroy stops the feed before the shards).
 * Context: the feed's thread, a destroy waiting for it. */
static void abandoned_gap(struct kvr_feed *f, struct ep *e, uint64_t expected, uint64_t got,
                          const struct kvr_feed_batch *b)
{
	kvr_feed_log(f, e, LK_GAP, KVR_LOG_INFO,
	             "seq %" PRIu64 "..%" PRIu64
	             " not replayed: the feed is being destroyed; rank cleared",
	             expected, got);
	/* The batch's rank too, as report_gap: one the router has and this feed never fed may
	 * hold what an earlier feed of the same publisher applied. */
	if (b || e->dp_rank != KVR_FEED_DP_FROM_BATCH) {
		uint32_t dp = kvr_feed_dp_of(e, b), slot;
		if (!kvr_router_find_rank(f->r, (struct kvr_rank_id){e->worker_id, dp}, &slot))
			kvr_feed_rstate(e, dp);
	}
	for (uint32_t i = 0; i < e->n_rs; i++)
		kvr_feed_clear_rank(f, e, &e->rs[i], got);
}

/* A live batch's seq against the stream so far: a restart (seq back, or not next_seq after a
 * reconnection) clears the ranks and starts the stream over. */
static void live_seq(struct kvr_feed *f, struct ep *e, uint64_t seq)
{
	bool back = e->have_live && seq <= e->last_live;
	/* After a reconnection the same publisher goes on at next_seq (it published
	 * every batch before it, live or replayed); anything else is a new one, below
	 * next_seq too when a replay ran ahead of the live stream (it was taken for
	 * duplicates: the new stream's first batches dropped, the rest applied on the
	 * old stream's state). */
	bool ahead = false;
	if (e->reconn == RC_NEXT || e->reconn == RC_MIXED) {
		ahead = e->have_seq && seq != e->next_seq;
		if (e->reconn == RC_NEXT)
			e->reconn = RC_NONE;
		else if (ahead)
			e->reconn_judged = true;
	}
	if (back || ahead) {
		e->st.restarts++;
		kvr_feed_count(f, KVR_C_FEED_RESTARTS, 1);
		kvr_feed_log(f, e, LK_GAP, KVR_LOG_WARN,
		             "publisher restarted (seq %" PRIu64 " after %" PRIu64
		             "%s); rank cleared",
		             seq, e->last_live, back ? "" : ", across a reconnection");
		kvr_feed_clear_all(f, e, 0); /* the new stream's, from its start */
		e->have_seq = false;
		for (uint32_t i = 0; i < e->n_rs; i++)
			if (e->rs[i].missed)
				e->rs[i].missed_from = 0; /* the new stream's, from its start */
	}
	e->have_live = true;
	e->last_live = seq;
}

/* One batch (b NULL: its payload was malformed, or with oom could not be decoded for lack of
 * memory) with sequence number seq, from the live SUB socket (live_seq taken already) or from a
 * replay, by the sequence rules.  false (may_wait only): a live batch that needs a replay (its
 * gap, or its rank's resync), which waits for the round's turn ("Replays take turns"); nothing
 * of it done, the caller holds it. */
static bool seq_rules(struct kvr_feed *f, struct ep *e, uint64_t seq,
                      const struct kvr_feed_batch *b, bool replayed, bool oom, bool may_wait)
{
	if (e->have_seq && seq < e->next_seq) {
		e->st.duplicates++;
		kvr_feed_count(f, KVR_C_FEED_DUPLICATES, 1);
		return true;
	}
	uint64_t expected = e->have_seq ? e->next_seq : 0;
	bool dropped = false; /* a destroy ended the replay short of what it needed */
	/* A replay this batch needs (its gap, or its rank's resync) waits for the round's turn,
	 * the batch held; a destroy waiting takes it now (replay() gives it up at once,
	 * abandoned_gap). */
	if (may_wait && !going(f) &&
	    (((seq > expected || oom) && e->replay) || (b && kvr_feed_batch_resyncs(f, e, seq, b))))
		return false;
	/* A gap, or this batch lost for memory: the replay brings it again (decoded anew). */
	if ((seq > expected || oom) && !replayed && e->replay) {
		/* The answer must bring every batch before this one, and this one too if it
		 * could not be decoded. */
		enum answer_end a = replay(f, e, expected, oom ? seq + 1 : seq, NULL);
		if (e->have_seq && seq < e->next_seq)
			return true; /* the replay applied it */
		expected = e->have_seq ? e->next_seq : 0;
		/* A destroy waits: what the replay did not bring is no gap, but the ranks are
		 * cleared (abandoned_gap).  One that brought everything before this batch left
		 * nothing missed: the batch is applied as usual.  Before, it was dropped, and a
		 * rank short of the batches never brought was left as it was. */
		dropped = a == ANS_DROP && (seq > expected || oom);
	}
	if (dropped)
		abandoned_gap(f, e, expected, seq, b);
	else if (seq > expected)
		report_gap(f, e, expected, seq, b);
	if (b)
		kvr_feed_apply_batch(f, e, seq, b);
	else if (oom && !dropped) /* no replay brought it: reported and cleared as a gap of one */
		kvr_feed_lost_batch(f, e, seq, NULL);
	e->next_seq = seq + 1;
	e->have_seq = true;
	return true;
}

/* Receives one multipart message into frames[0..max); returns the frame count (more frames
 * than max are drained and reported as max + 1), 0 when nothing was waiting, -1 on error. */
static int recv_frames(void *sock, zmq_msg_t *frames, int max)
{
	int n = 0;
	for (;;) {
		zmq_msg_t tmp, *m = n < max ? &frames[n] : &tmp;
		zmq_msg_init(m);
		if (zmq_msg_recv(m, sock, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
			zmq_msg_close(m);
			for (int i = 0; i < n && i < max; i++)
				zmq_msg_close(&frames[i]);
			return n == 0 && zmq_errno() == EAGAIN ? 0 : -1;
		}
		bool more = zmq_msg_more(m);
		if (m == &tmp)
			zmq_msg_close(m);
		n++;
		if (!more)
			return n <= max ? n : max + 1;
	}
}

static void close_frames(zmq_msg_t *frames, int n)
{
	for (int i = 0; i < n; i++)
		zmq_msg_close(&frames[i]);
}

static bool read_seq(zmq_msg_t *m, uint64_t *seq)
{
	if (zmq_msg_size(m) != 8)
		return false;
	const uint8_t *p = zmq_msg_data(m);
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v = v << 8 | p[i];
	*seq = v;
	return true;
}

static void malformed(struct kvr_feed *f, struct ep *e, const char *why)
{
	e->st.malformed++;
	kvr_feed_count(f, KVR_C_FEED_MALFORMED, 1);
	kvr_feed_log(f, e, LK_MALFORMED, KVR_LOG_WARN, "malformed message skipped: %s", why);
}

/* Decodes a payload into b; NULL if malformed (counted) or, *oom set, for lack of memory (the
 * caller's to count: a replay may bring it again). */
static const struct kvr_feed_batch *decode(struct kvr_feed *f, struct ep *e,
                                           struct kvr_feed_batch *b, zmq_msg_t *m, bool *oom)
{
	int rc = kvr_feed_decode(b, zmq_msg_data(m), zmq_msg_size(m));
	*oom = rc == KVR_ENOMEM;
	if (rc == 0)
		return b;
	if (!*oom)
		malformed(f, e, "payload is not a vLLM KV event batch");
	return NULL;
}

/* Reads what e's monitor holds into e->reconn (see the top of the file). */
static void read_monitor(struct kvr_feed *f, struct ep *e)
{
	e->mon_ns = kvr_feed_mono_ns();
	for (;;) {
		zmq_msg_t fr[2];
		int n = recv_frames(e->mon, fr, 2);
		if (n <= 0)
			return;
		uint16_t ev = 0;
		if (n == 2 && zmq_msg_size(&fr[0]) >= sizeof(ev))
			memcpy(&ev, zmq_msg_data(&fr[0]), sizeof(ev));
		close_frames(fr, n > 2 ? 2 : n);
		if (ev == ZMQ_EVENT_DISCONNECTED) {
			/* In RC_MIXED the queue may still hold the old tail: it stays mixed. */
			if (e->reconn != RC_MIXED)
				e->reconn = RC_TAIL;
			kvr_feed_log(f, e, LK_GAP, KVR_LOG_INFO,
			             "publisher disconnected after seq %" PRIu64, e->last_live);
		} else if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED && e->reconn == RC_TAIL) {
			e->reconn = RC_MIXED;
			e->reconn_judged = false;
		}
	}
}

void kvr_feed_monitor(struct kvr_feed *f, struct ep *e)
{
	read_monitor(f, e);
	/* The old connection's tail, read at once: found empty, the next batch is the new
	 * connection's first. */
	if (e->reconn == RC_TAIL || e->reconn == RC_MIXED)
		kvr_feed_drain(f, e);
}

/* What a resync's replay did not bring, [rs->next, got): counted and reported as a gap; if the
 * rank took batches before it, it is cleared (what it holds may have been removed in the hole),
 * and what comes after the hole rebuilds it: a subset of the engine's cache, never more. */
static void resync_hole(struct kvr_feed *f, struct ep *e, struct resync *rs, uint64_t got)
{
	e->st.gaps++;
	kvr_feed_count(f, KVR_C_FEED_GAPS, 1);
	kvr_feed_log(f, e, LK_GAP, KVR_LOG_WARN,
	             "rank (%" PRIu64 ", %u) missed seq %" PRIu64 "..%" PRIu64
	             " before it was added, and no replay has them%s",
	             e->worker_id, rs->dp, rs->next, got, rs->held ? "; rank cleared" : "");
	if (f->r->cfg.on_event_gap)
		f->r->cfg.on_event_gap(f->r->cfg.callback_ctx, e->worker_id, rs->dp, rs->next, got);
	/* The resync's own state: found (it exists while the resync runs), never allocated.  What
	 * it holds begins after the hole either way (held or not, a replay from before would
	 * report the hole again). */
	struct rstate *s = kvr_feed_rstate(e, rs->dp);
	if (s && rs->held)
		kvr_feed_clear_rank(f, e, s, got);
	else if (s)
		s->since = got;
	rs->held = false;
}

/* The next seq a replay must bring for what it applied to stay whole. */
static uint64_t replay_at(const struct ep *e, const struct resync *rs)
{
	return rs ? rs->next : e->have_seq ? e->next_seq : 0;
}

/* Asks e's replay endpoint for every batch from start on and reads the answer.  rs NULL: each
 * batch goes through the sequence rules (a gap being healed).  Else (a resync) only the batches
 * before rs->to for rank rs->dp are applied, the rest ignored (the live stream brings them), and
 * a batch missing from the answer is a hole (resync_hole).  A batch missing inside the answer
 * (not at its start: there the publisher's buffer begins later, a gap no ask mends) ends the
 * read when stop_at_hole, the batches after it not taken (ANS_HOLE: the caller asks again);
 * else the hole is reported and what follows applied.  An answer that brought every batch
 * before target, or (when stop_at_hole) some of them, and then nothing for FEED_REPLAY_QUIET_MS
 * ends the read (ANS_QUIET): its tail, end marker and all, was dropped (a publisher sends an
 * answer at once); else the wait goes on to replay_timeout_ms.  Before, an answer that lacked
 * only its end marker held the feed's thread for the whole replay_timeout_ms (a minute in
 * stress_feed_rank_churn, whose catching up then failed with SFC_ROUTER_HWM=1).  A destroy
 * waiting for this thread ends the wait at once: it waited out the whole replay_timeout_ms
 * before (test_feed_replay_stop); the wait is looked at every 20 ms. */
static enum answer_end read_answer(struct kvr_feed *f, struct ep *e, uint64_t start,
                                   uint64_t target, struct resync *rs, bool stop_at_hole,
                                   uint64_t until, uint64_t *brought)
{
	*brought = 0;
	if (!e->dealer && kvr_feed_dealer_open(f, e) != 0)
		return ANS_FAIL;
	uint8_t req[8];
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(start >> (56 - 8 * i));
	if (zmq_send(e->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(e->dealer, req, 8, ZMQ_DONTWAIT) < 0)
		return ANS_FAIL;
	uint64_t last = kvr_feed_mono_ns(),
	         deadline = last + (uint64_t)f->cfg.replay_timeout_ms * 1000000u;
	if (deadline > until)
		deadline = until; /* the replay's own end (replay()) */
	bool first = true;
	for (;;) {
		uint64_t now = kvr_feed_mono_ns();
		if (now >= deadline)
			return ANS_LATE;
		if (going(f)) {
			kvr_feed_log(f, e, LK_GAP, KVR_LOG_INFO,
			             "replay from %" PRIu64
			             " abandoned: the feed is being destroyed",
			             start);
			return ANS_DROP;
		}
		zmq_pollitem_t it = {.socket = e->dealer, .events = ZMQ_POLLIN};
		long ms = (long)((deadline - now + 999999) / 1000000);
		if (ms > 20)
			ms = 20;
		if (zmq_poll(&it, 1, ms) < 0 && zmq_errno() != EINTR)
			return ANS_FAIL;
		if (!(it.revents & ZMQ_POLLIN)) {
			/* Quiet is the publisher's: looked at only once a poll found nothing.
			 * Before, the time since the last batch was received counted whatever the
			 * DEALER held, so a feed's thread held 100 ms (a slow on_event_gap, a large
			 * batch, a thread descheduled) cut an answer that was all there, and the
			 * ask again could find the publisher's buffer moved on: a gap reported for
			 * batches in hand (test_feed_replay_reask,
			 * ..._waiting_while_the_feed_is_slow_...). */
			uint64_t at = replay_at(e, rs);
			if ((at >= target ||
			     ((stop_at_hole || *brought >= FEED_REPLAY_ASK_GAIN) && at > start)) &&
			    kvr_feed_mono_ns() - last >= FEED_REPLAY_QUIET_MS * 1000000ull)
				return ANS_QUIET;
			continue;
		}
		zmq_msg_t fr[4];
		int n = recv_frames(e->dealer, fr, 4);
		if (n <= 0)
			continue;
		last = kvr_feed_mono_ns();
		uint64_t seq, at;
		/* ["", seq, payload] or ["", topic, seq, payload] */
		int si = n == 3 ? 1 : 2;
		if ((n != 3 && n != 4) || zmq_msg_size(&fr[0]) != 0 || !read_seq(&fr[si], &seq)) {
			close_frames(fr, n > 4 ? 4 : n); /* n > 4: the first 4 are held */
			malformed(f, e, "bad replay reply");
			continue;
		}
		if (seq == END_SEQ) {
			close_frames(fr, n);
			e->st.replays++;
			kvr_feed_count(f, KVR_C_FEED_REPLAYS, 1);
			return ANS_END;
		}
		/* Past the next seq the replay needs, after the answer's first batch: a ROUTER
		 * past its send bound drops what it cannot queue, without a word (ZeroMQ's
		 * default ZMQ_SNDHWM, 1,000, which vLLM's publisher keeps), while the publisher
		 * still holds the batch.  For a resync, only before rs->to. */
		at = replay_at(e, rs);
		if (seq == at && (!rs || seq < rs->to))
			++*brought; /* the next one needed: progress, not a jump */
		bool hole = !first && seq > at && (!rs || at < rs->to);
		first = false;
		if (hole && stop_at_hole) {
			close_frames(fr, n);
			return ANS_HOLE;
		}
		bool oom;
		const struct kvr_feed_batch *b = decode(f, e, &f->rep, &fr[si + 1], &oom);
		bool applies = !(e->have_seq && seq < e->next_seq);
		if (rs) {
			/* In order and whole: a batch skipped (a replayer that dropped one, or
			 * answered from later on) is a hole, and one at or below a batch taken is
			 * not taken twice. */
			applies = false;
			if (seq < rs->to && seq >= rs->next) {
				if (seq > rs->next)
					resync_hole(f, e, rs, seq);
				rs->next = seq + 1;
				applies = b && kvr_feed_dp_of(e, b) == rs->dp;
				if (applies) {
					kvr_feed_apply_batch(f, e, seq, b);
					rs->held = true;
				} else if (oom) { /* it may have been the rank's: cleared */
					kvr_feed_lost_batch(f, e, seq, &rs->dp);
					rs->held = false;
				}
			}
		} else {
			seq_rules(f, e, seq, b, true, oom, false); /* (never held) */
		}
		if (applies && b) {
			e->st.replayed_batches++;
			kvr_feed_count(f, KVR_C_FEED_REPLAYED_BATCHES, 1);
		}
		close_frames(fr, n);
	}
}

/* A replay of the batches from start on until the one before target (see read_answer for rs).
 * An answer with a hole inside it, or short of target (its end marker, or its wait, came first),
 * is asked for again from the first batch missing, each ask after an answer that brought
 * something, up to FEED_REPLAY_ASKS asks that brought fewer than FEED_REPLAY_ASK_GAIN batches
 * in order, and within FEED_REPLAY_ASKS x max(replay_timeout_ms, FEED_REPLAY_END_MIN_MS) in all
 * (before, any 8
 * asks: behind a ROUTER at the default bound, 1,000, an answer of 10,563 batches ended in a gap
 * after 8 asks of 1,000 each, stress_feed_rank_churn_router_hwm in CI, and test_feed_replay_reask
 * a_long_*_answer_cut_at_a_bound_is_asked_until_whole failed): a ROUTER drops at its send bound
 * what the publisher still holds (stress_feed_rank_churn 1500 with SFC_ROUTER_HWM=1: before, 6 runs
 * of 10 failed, a gap reported inside a long answer or the feed's thread waiting out the replay
 * timeout for a dropped tail; asking again, and ending the wait once an answer goes quiet, none of
 * 8). Before, such a hole was reported and the rank cleared (test_feed_replay_reask).  Each ask
 * waits replay_timeout_ms at most.  Once FEED_REPLAY_ASKS - 1 asks brought little, what an ask
 * lacks is a hole as before: reported once, the batches after it applied.  An answer that starts
 * later than asked is the publisher's buffer beginning later: reported, never asked for again.
 * Returns how the last answer ended: ANS_END when its end marker came; ANS_DROP when a destroy
 * waits for this thread (then the caller reports no gap: the feed going away missed nothing of the
 * publisher's, and before, its abandoned replay was reported through on_event_gap and counted:
 * test_feed_replay_stop; a rank the replay left short of what the publisher sent is cleared,
 * unreported: abandoned_gap); ANS_FAIL also when another replay is being read.  Context: the feed's
 * thread. */
static enum answer_end replay(struct kvr_feed *f, struct ep *e, uint64_t start, uint64_t target,
                              struct resync *rs)
{
	if (f->in_replay)
		return ANS_FAIL; /* one at a time: the DEALER carries one answer */
	/* A later gap of the same drain, once a destroy waits: not even asked. */
	if (going(f))
		return ANS_DROP;
	kvr_feed_flush(f); /* what arrived before the gap is not held back by the wait */
	f->in_replay = true;
	f->replayed = true; /* this round's turn ("Replays take turns") */
	enum answer_end a;
	int small = 0; /* asks that brought fewer than FEED_REPLAY_ASK_GAIN batches */
	/* However much each ask brings, the replay holds the feed's thread no longer than the
	 * 8 asks of replay_timeout_ms it could before asks that bring much were free (or 8 s,
	 * for a timeout below FEED_REPLAY_END_MIN_MS: an ask cut at a send bound costs
	 * FEED_REPLAY_QUIET_MS whatever the timeout, and with 100 ms an honest answer of 10,000
	 * batches behind a bound of 1,000 was cut at 8,000).  Without an end, a replayer
	 * answering a little each time (or slowly) held it for as long as it went on
	 * (test_feed_replay_bound). */
	uint64_t per_ask_ms = f->cfg.replay_timeout_ms > FEED_REPLAY_END_MIN_MS
	                          ? f->cfg.replay_timeout_ms
	                          : FEED_REPLAY_END_MIN_MS;
	const uint64_t until = kvr_feed_mono_ns() + FEED_REPLAY_ASKS * per_ask_ms * 1000000u;
	for (int ask = 1;; ask++) {
		uint64_t from = ask == 1 ? start : replay_at(e, rs);
		/* The ask that would be the last small one reads past a hole: what it lacks is
		 * reported, what follows applied (an ask that brings a lot all the same is
		 * followed by another, from where it ended). */
		uint64_t brought;
		a = read_answer(f, e, from, target, rs, small < FEED_REPLAY_ASKS - 1, until,
		                &brought);
		/* Anything but the end marker: the socket goes, so that what is still on its
		 * way of this answer cannot be taken for the next request's. */
		if (a != ANS_END && e->dealer) {
			zmq_close(e->dealer);
			e->dealer = NULL;
		}
		uint64_t at = replay_at(e, rs);
		if (at > from && brought < FEED_REPLAY_ASK_GAIN)
			small++;
		if (a == ANS_FAIL || a == ANS_DROP || at >= target || at <= from ||
		    small == FEED_REPLAY_ASKS || kvr_feed_mono_ns() >= until) {
			/* A warning only when the replay is given up short of target (what it
			 * lacks becomes a gap); an ask that the next one mends is told at INFO,
			 * below.  Before, every ask that failed or timed out was a warning, also
			 * when the next ask healed it (test_feed_replay_reask,
			 * ..._logs_no_warning). */
			if (a == ANS_LATE || a == ANS_FAIL)
				kvr_feed_log(
				    f, e, LK_GAP, at < target ? KVR_LOG_WARN : KVR_LOG_INFO,
				    "replay from %" PRIu64 " failed or timed out%s", from,
				    at < target ? "" : " after it brought every batch it needed");
			break;
		}
		e->st.reasks++;
		kvr_feed_count(f, KVR_C_FEED_REPLAY_REASKS, 1);
		kvr_feed_log(f, e, LK_REASK, KVR_LOG_INFO,
		             "replay from %" PRIu64 " %s at seq %" PRIu64 " of %" PRIu64
		             "; asking again",
		             from,
		             a == ANS_HOLE    ? "skipped a batch"
		             : a == ANS_END   ? "ended"
		             : a == ANS_QUIET ? "went quiet"
		                              : "timed out",
		             at, target);
	}
	f->in_replay = false;
	return a;
}

void kvr_feed_resync(struct kvr_feed *f, struct ep *e, struct rstate *s)
{
	uint32_t dp = s->dp;
	/* What was posted for the rank before is collected first: events of its earlier life
	 * refused because it went (complete()) must not mark it missed again once the resync has
	 * begun.  complete() makes no state, so s stays where it is. */
	kvr_feed_settle(f);
	uint64_t from = s->missed_from, to = e->have_seq ? e->next_seq : 0;
	s->missed = false;
	s->has_life = false; /* the replay's first batch finds the life it rebuilds */
	f->n_missed--;
	kvr_feed_log(f, e, LK_RANK, KVR_LOG_INFO,
	             "rank (%" PRIu64 ", %u) added: replaying what it missed from seq %" PRIu64,
	             e->worker_id, dp, from);
	kvr_feed_clear_rank(f, e, s, from); /* anything of an earlier life of the rank */
	if (from >= to)
		return;
	/* The rank holds what the answer brought whole: from its start, or from the last hole
	 * on (a subset of the engine's cache: stores and removals alike from there on).  The
	 * answer's end short of `to` (a timeout, a replayer that stopped early) is a hole too:
	 * before, the batches it had brought stayed, and the removals after them were lost. */
	struct resync rs = {.dp = dp, .to = to, .next = from};
	/* The ranks added late had their turn: those still waiting take a new ticket. */
	if (e->replay)
		f->resync_ticket = 0;
	/* Whatever else replay() returns: an answer whose end marker did not come (a replayer's
	 * ROUTER past its send bound drops what follows) but that brought every batch up to `to`
	 * left no hole.  Before, its timeout was reported as a gap of nothing (to..to) and the
	 * rank, rebuilt whole, cleared (test_feed_rank_gone,
	 * ..._lacks_only_its_end_marker_is_whole). */
	if (e->replay && replay(f, e, from, to, &rs) == ANS_DROP) {
		/* The feed is going away: no hole reported for what the replay did not bring.  But
		 * a rank rebuilt in part holds the blocks stored in the batches brought, without
		 * the removals of those that were not, and no later event of this feed corrects
		 * it: cleared (abandoned_gap).  Before, it was left half-rebuilt
		 * (test_feed_replay_stop a_resync_a_destroy_ends_leaves_no_removed_block).  One
		 * rebuilt whole, or not begun (empty since its clear above), is kept. */
		struct rstate *t = kvr_feed_rstate(e, dp); /* found (it exists), never made */
		if (rs.next < to && rs.held && t) {
			kvr_feed_log(f, e, LK_GAP, KVR_LOG_INFO,
			             "rank (%" PRIu64 ", %u): seq %" PRIu64 "..%" PRIu64
			             " not replayed: the feed is being destroyed; rank cleared",
			             e->worker_id, dp, rs.next, to);
			kvr_feed_clear_rank(f, e, t, to);
		}
		kvr_feed_flush(f);
		return;
	}
	if (rs.next < to)
		resync_hole(f, e, &rs, to);
	kvr_feed_flush(f);
}

/* Whether the resync of rank s of e asks for a replay: it missed batches the stream has had,
 * and e has a replay endpoint (else it only clears the rank and reports the hole). */
static bool resync_replays(const struct ep *e, const struct rstate *s)
{
	return e->replay && s->missed_from < (e->have_seq ? e->next_seq : 0);
}

bool kvr_feed_resync_waits(struct kvr_feed *f, const struct ep *e, const struct rstate *s)
{
	return resync_replays(e, s) && !going(f) && !f->forced && (!f->turn || f->replayed);
}

void kvr_feed_resync_added(struct kvr_feed *f)
{
	/* One replay a round: the ranks whose replay must wait stay missed until a later round
	 * (the loop looks again every 10 ms while any is missed), all under one ticket, taken
	 * when the first is turned away and given up when one is served (the rest then take a
	 * new one: after whatever came meanwhile).  A resync that asks for no replay takes no
	 * turn. */
	bool waits = false;
	for (uint32_t i = 0; i < f->n_eps && f->n_missed; i++) {
		struct ep *e = f->eps[i];
		for (uint32_t k = 0; k < e->n_rs; k++) {
			uint32_t slot;
			struct rstate *s = &e->rs[k];
			if (!s->missed ||
			    kvr_router_find_rank(f->r, (struct kvr_rank_id){e->worker_id, s->dp},
			                         &slot))
				continue;
			if (kvr_feed_resync_waits(f, e, s)) {
				waits = true;
				continue;
			}
			kvr_feed_resync(f, e, s);
		}
	}
	if (!waits)
		f->resync_ticket = 0;
	else if (!f->resync_ticket)
		f->resync_ticket = ++f->tickets;
}

void kvr_feed_note_lives(struct kvr_feed *f)
{
	for (uint32_t i = 0; i < f->n_eps; i++) {
		struct ep *e = f->eps[i];
		for (uint32_t k = 0; k < e->n_rs; k++) {
			struct rstate *s = &e->rs[k];
			uint32_t slot;
			uint64_t gen;
			/* (A rank never fed, or missed already, has no life to compare.) */
			if (s->missed || !s->has_life ||
			    kvr_router_find_rank_gen(
			        f->r, (struct kvr_rank_id){e->worker_id, s->dp}, &slot, &gen) ||
			    (slot == s->slot && gen == s->gen))
				continue;
			/* s exists: nothing made, so e->rs stays where it is. */
			kvr_feed_note_missed(f, e, s->dp, s->since);
		}
	}
}

/* Keeps e's live batch seq (its payload m, moved; bad: found malformed; oom: not decoded for
 * memory) until its replay's turn, with the next ticket. */
static void hold(struct kvr_feed *f, struct ep *e, uint64_t seq, zmq_msg_t *m, bool bad, bool oom)
{
	zmq_msg_init(&e->held_msg);
	zmq_msg_move(&e->held_msg, m);
	e->held = true;
	e->held_bad = bad;
	e->held_oom = oom;
	e->held_seq = seq;
	e->held_ticket = ++f->tickets;
}

/* e's held batch through the sequence rules, its replay asked for now (decoded anew: the
 * decode buffer is the next message's). */
static void take_held(struct kvr_feed *f, struct ep *e)
{
	bool oom = e->held_oom;
	const struct kvr_feed_batch *b =
	    e->held_bad || oom ? NULL : decode(f, e, &f->live, &e->held_msg, &oom);
	e->held = false; /* (first: its ticket is served) */
	seq_rules(f, e, e->held_seq, b, false, oom, false);
	zmq_msg_close(&e->held_msg);
	kvr_feed_flush(f);
}

void kvr_feed_take_held(struct kvr_feed *f, struct ep *e)
{
	if (e->held) {
		/* (the caller waits as it did before turns).  Forced: the batch's rank resynced
		 * here, as before turns; waiting for a turn, it was counted unknown_rank and
		 * dropped with the endpoint, no replay asked, no gap reported
		 * (test_feed_replay_turns
		 * an_endpoint_removed_with_a_batch_held_for_its_ranks_resync_replays_it). */
		f->forced = true;
		take_held(f, e);
		f->forced = false;
	}
}

void kvr_feed_turn(struct kvr_feed *f)
{
	/* One replay a round: one asked for out of turn (a remove taking a held batch) took it. */
	if (f->replayed)
		return;
	struct ep *held = NULL;
	uint64_t oldest = f->resync_ticket ? f->resync_ticket : UINT64_MAX;
	for (uint32_t i = 0; i < f->n_eps; i++)
		if (f->eps[i]->held && f->eps[i]->held_ticket < oldest) {
			oldest = f->eps[i]->held_ticket;
			held = f->eps[i];
		}
	if (oldest == UINT64_MAX)
		return;
	f->turn = true;
	if (held)
		take_held(f, held);
	else
		kvr_feed_resync_added(f);
	f->turn = false;
}

/* Drains what the endpoint's SUB socket holds (bounded, so one busy endpoint cannot starve
 * the others or the control socket); nothing once the feed is destroyed (a callback of the
 * batch just applied may have done it).  Nothing while a batch is held for its replay turn:
 * what follows it waits in the socket until kvr_feed_turn has taken it. */
static void drain_some(struct kvr_feed *f, struct ep *e)
{
	if (e->held)
		return; /* until its turn (kvr_feed_turn) */
	for (int k = 0; k < 256 && !kvr_feed_dying(f); k++) {
		zmq_msg_t fr[3];
		int n = recv_frames(e->sub, fr, 3);
		if (n == 0) {
			/* Empty after a disconnection: the old connection's tail is read (1. at the
			 * top of the file).  After a mixed queue, the next batch is the new
			 * connection's first unless one was taken for a restart already. */
			if (e->reconn == RC_TAIL || (e->reconn == RC_MIXED && !e->reconn_judged))
				e->reconn = RC_NEXT;
			else if (e->reconn == RC_MIXED)
				e->reconn = RC_NONE;
			return;
		}
		/* After the receive: a batch received before a look that shows no disconnection,
		 * or no new connection after one, is the old connection's. */
		if (e->reconn == RC_TAIL ||
		    kvr_feed_mono_ns() - e->mon_ns >= FEED_MON_EVERY_MS * 1000000ull)
			read_monitor(f, e);
		e->st.messages++;
		kvr_feed_count(f, KVR_C_FEED_MESSAGES, 1);
		if (n < 0) {
			malformed(f, e, "receive failed");
			return;
		}
		uint64_t seq = 0; /* read by the reason below when read_seq fails */
		/* END_SEQ ends a replay; as a live batch's seq it left next_seq wrapped to 0 (every
		 * later batch a gap from 0), and a gap or a loss there could not be reported (its
		 * end, one past it, does not fit). */
		if (n != 3 || !read_seq(&fr[1], &seq) || seq == END_SEQ) {
			close_frames(fr, n > 3 ? 3 : n); /* n > 3: the first 3 are held */
			malformed(f, e,
			          n != 3           ? "not 3 frames"
			          : seq != END_SEQ ? "seq frame is not 8 bytes"
			                           : "seq is 2^64 - 1 (a replay's end mark)");
			continue;
		}
		bool oom;
		const struct kvr_feed_batch *b = decode(f, e, &f->live, &fr[2], &oom);
		live_seq(f, e, seq);
		if (!seq_rules(f, e, seq, b, false, oom, true)) {
			hold(f, e, seq, &fr[2], !b && !oom, oom);
			close_frames(fr, 3); /* (fr[2] moved: empty) */
			return;
		}
		close_frames(fr, 3);
	}
}

void kvr_feed_drain(struct kvr_feed *f, struct ep *e)
{
	drain_some(f, e);
	kvr_feed_flush(f); /* everything this drain accepted, in one round trip */
}
