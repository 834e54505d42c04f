/*
 * sync/feed.c - vLLM KV events over ZeroMQ: one thread per feed, every endpoint's SUB socket
 * in one zmq_poll, each batch decoded completely (sync/feed_decode.c) before any of it is
 * applied, then applied through the validation and shard function of kvr_events_apply.
 *
 * Applying.  Everything one drain of the sockets accepts for a rank is applied with ONE shard
 * round trip (kvr_events_apply_many, core/events.c), local hashes computed here on the feed
 * thread.  A round trip per event capped the feed at the shard's wake-up rate: 87k blocks/s on
 * a loaded 2-core machine, against 1.26-1.75M blocks/s batched (perf/bench_feed).  At low rates
 * a drain holds one message, so batching adds no lag.
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
 * Copies.  vLLM can hold two physical copies of one hash (the same prefix computed twice before
 * the first copy was cached, or one per KV cache group of a hybrid model) and sends a
 * BlockRemoved per copy.  The router's index counts copies per (rank, block) in events mode
 * (kvr_index_set_count_copies, core/index.h), so the feed forwards every store and every
 * removal as it comes; a block leaves the index with its last copy.  Blocks on another medium
 * (the offloading connector's "CPU") are counted here, per rank and hash, never in the GPU
 * index.
 *
 * Threading.  Only the feed thread touches the sockets and the endpoint state.  The API calls
 * (add, remove, stats, destroy) send a pointer to a command over an inproc PAIR socket and wait
 * for the answer, under a mutex so commands from several threads take turns.  Stats are
 * therefore exact snapshots, read on the thread that writes them.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "core/alloc.h"
#include "core/events.h"
#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "shards/u64map.h"
#include "sync/feed_decode.h"
#include "sync/rcu.h"

#define END_SEQ UINT64_MAX

/* What the feed knows of one rank fed by an endpoint. */
struct rstate {
	uint32_t dp;
	struct kvr_u64map other; /* other-medium hash -> copies held */
};

struct ep {
	uint32_t id;
	char *endpoint, *topic, *replay; /* owned copies */
	uint64_t worker_id;
	uint32_t dp_rank;
	void *sub, *dealer;
	bool have_seq, have_live;
	uint64_t next_seq, last_live;
	struct rstate *rs;
	uint32_t n_rs, cap_rs;
	struct kvr_feed_stats st;
	uint64_t logged[8]; /* per log kind: last count logged (powers of two) */
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
	uint32_t next_id;
	zmq_pollitem_t *items;
	uint32_t cap_items;
	struct kvr_feed_batch live, rep; /* decode scratch: live messages, replayed ones */
	struct pending pend;
	struct kvr_metrics_block *mb;
	bool stop;
};

enum log_kind { LK_MALFORMED, LK_BLOCK_SIZE, LK_TOKENS, LK_LORA, LK_RANK, LK_INDEX, LK_GAP };

static void flog(struct kvr_feed *f, struct ep *e, int kind, int level, const char *fmt, ...)
{
	if (!f->cfg.log)
		return;
	if (e) {
		uint64_t n = ++e->logged[kind];
		if (n & (n - 1))
			return; /* thin repeats out: 1, 2, 4, 8, ... */
	}
	char msg[512];
	int off = e ? snprintf(msg, sizeof(msg), "kvr feed %s: ", e->endpoint) : 0;
	if (off < 0)
		off = 0;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg + off, sizeof(msg) - (size_t)off, fmt, ap);
	va_end(ap);
	f->cfg.log(f->cfg.log_ctx, level, msg);
}

static void count(struct kvr_feed *f, enum kvr_counter c, uint64_t v)
{
	kvr_metrics_add(f->mb, c, v);
}

static char *dupstr(const char *s)
{
	if (!s)
		return NULL;
	size_t n = strlen(s) + 1;
	char *p = kvr_alloc(n);
	if (p)
		memcpy(p, s, n);
	return p;
}

static void freestr(char *s)
{
	if (s)
		kvr_free(s, strlen(s) + 1);
}

static int grow(void **arr, uint32_t *cap, uint64_t need, size_t item)
{
	if (need <= *cap)
		return 0;
	if (need > UINT32_MAX / 2)
		return KVR_ENOMEM;
	uint32_t nc = *cap ? *cap : 16;
	while (nc < need)
		nc *= 2;
	void *p = kvr_realloc(*arr, (size_t)*cap * item, (size_t)nc * item);
	if (!p)
		return KVR_ENOMEM;
	*arr = p;
	*cap = nc;
	return 0;
}

/* ---------------------------------------------------------------- per-rank state */

static struct rstate *rstate_get(struct ep *e, uint32_t dp)
{
	for (uint32_t i = 0; i < e->n_rs; i++)
		if (e->rs[i].dp == dp)
			return &e->rs[i];
	if (grow((void **)&e->rs, &e->cap_rs, (uint64_t)e->n_rs + 1, sizeof(*e->rs)))
		return NULL;
	struct rstate *s = &e->rs[e->n_rs++];
	s->dp = dp;
	kvr_u64map_init(&s->other);
	return s;
}

static uint64_t other_blocks(const struct ep *e)
{
	uint64_t n = 0;
	for (uint32_t i = 0; i < e->n_rs; i++)
		n += e->rs[i].other.count;
	return n;
}

static int grow(void **arr, uint32_t *cap, uint64_t need, size_t item);
static void refuse(struct kvr_feed *f, struct ep *e);

/* Applies the pending events (one shard round trip). */
static void flush(struct kvr_feed *f)
{
	struct pending *p = &f->pend;
	if (!p->n_ev)
		return;
	struct ep *e = p->ep;
	if (grow((void **)&p->out, &p->cap_out, p->n_ev, sizeof(*p->out)) ||
	    grow((void **)&p->rcs, &p->cap_rcs, p->n_ev, sizeof(*p->rcs))) {
		for (uint32_t i = 0; i < p->n_ev; i++)
			refuse(f, e);
		p->n_ev = p->n_blk = p->n_rm = 0;
		return;
	}
	for (uint32_t i = 0; i < p->n_ev; i++) {
		const struct pev *v = &p->ev[i];
		struct kvr_event *o = &p->out[i];
		*o = (struct kvr_event){.type = v->type};
		if (v->type == KVR_EVENT_STORED) {
			o->has_parent = v->has_parent;
			o->parent_ext_hash = v->parent;
			o->blocks = p->blk + v->off;
			o->n_blocks = v->n;
		} else if (v->type == KVR_EVENT_REMOVED) {
			o->removed = p->rm + v->off;
			o->n_removed = v->n;
		}
	}
	int rc = kvr_events_apply_many(f->r, (struct kvr_rank_id){e->worker_id, p->dp}, p->out,
	                               p->n_ev, p->rcs);
	for (uint32_t i = 0; i < p->n_ev; i++) {
		int r = rc ? rc : p->rcs[i];
		if (!r)
			continue;
		refuse(f, e);
		flog(f, e, LK_INDEX, KVR_LOG_WARN, "%s for rank (%" PRIu64 ", %u) not applied: %s",
		     p->ev[i].type == KVR_EVENT_STORED    ? "BlockStored"
		     : p->ev[i].type == KVR_EVENT_REMOVED ? "BlockRemoved"
		                                          : "clear",
		     e->worker_id, p->dp, kvr_strerror(r));
	}
	p->n_ev = p->n_blk = p->n_rm = 0;
}

/* Room for one more event of (e, dp) with nblk blocks (stored) or hashes (removed); flushes
 * first when another rank's events are pending or the batch is full.  NULL without memory. */
static struct pev *pend_event(struct kvr_feed *f, struct ep *e, uint32_t dp, uint32_t nblk,
                              bool removed)
{
	struct pending *p = &f->pend;
	if (p->n_ev &&
	    (p->ep != e || p->dp != dp || p->n_blk + p->n_rm + nblk > PENDING_MAX_BLOCKS))
		flush(f);
	p->ep = e;
	p->dp = dp;
	if (grow((void **)&p->ev, &p->cap_ev, (uint64_t)p->n_ev + 1, sizeof(*p->ev)) ||
	    (!removed &&
	     grow((void **)&p->blk, &p->cap_blk, (uint64_t)p->n_blk + nblk, sizeof(*p->blk))) ||
	    (removed &&
	     grow((void **)&p->rm, &p->cap_rm, (uint64_t)p->n_rm + nblk, sizeof(*p->rm))))
		return NULL;
	struct pev *v = &p->ev[p->n_ev];
	*v = (struct pev){.off = removed ? p->n_rm : p->n_blk};
	return v;
}

/* Forgets the rank: the index's blocks for it (after what is pending), its other medium. */
static void clear_rank(struct kvr_feed *f, struct ep *e, struct rstate *s)
{
	kvr_u64map_clear(&s->other);
	struct pev *v = pend_event(f, e, s->dp, 0, false);
	if (v) {
		v->type = KVR_EVENT_CLEARED;
		f->pend.n_ev++;
		return;
	}
	/* No memory to queue it: apply what is pending, then clear directly. */
	flush(f);
	int rc = kvr_events_clear_rank(f->r, (struct kvr_rank_id){e->worker_id, s->dp});
	if (rc && rc != KVR_ENOENT)
		flog(f, e, LK_INDEX, KVR_LOG_ERROR, "clearing rank (%" PRIu64 ", %u) failed: %s",
		     e->worker_id, s->dp, kvr_strerror(rc));
}

/* The ranks the endpoint feeds now: the fixed one, or every dp rank seen so far. */
static void clear_all(struct kvr_feed *f, struct ep *e)
{
	if (e->dp_rank != KVR_FEED_DP_FROM_BATCH && !rstate_get(e, e->dp_rank))
		return;
	for (uint32_t i = 0; i < e->n_rs; i++)
		clear_rank(f, e, &e->rs[i]);
}

static uint32_t dp_of(const struct ep *e, const struct kvr_feed_batch *b)
{
	if (e->dp_rank != KVR_FEED_DP_FROM_BATCH)
		return e->dp_rank;
	return b && b->has_dp ? b->dp : 0;
}

/* ---------------------------------------------------------------- applying a batch */

static uint64_t wall_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void refuse(struct kvr_feed *f, struct ep *e)
{
	e->st.refused++;
	count(f, KVR_C_FEED_REFUSED, 1);
}

static void apply_stored(struct kvr_feed *f, struct ep *e, struct rstate *s,
                         const struct kvr_feed_batch *b, const struct kvr_fev *v)
{
	uint32_t bs = f->r->cfg.block_size;
	const uint64_t *h = b->hashes + v->hash_off;
	if (v->has_block_size && v->block_size != bs) {
		refuse(f, e);
		flog(f, e, LK_BLOCK_SIZE, KVR_LOG_ERROR,
		     "BlockStored with block_size %u refused: the router's is %u", v->block_size,
		     bs);
		return;
	}
	if (!v->gpu) {
		if (kvr_u64map_reserve(&s->other, v->n_hashes)) {
			refuse(f, e);
			return;
		}
		for (uint32_t i = 0; i < v->n_hashes; i++) {
			uint32_t *c = kvr_u64map_find(&s->other, h[i]);
			if (c)
				++*c;
			else
				kvr_u64map_insert(&s->other, h[i], 1);
		}
		count(f, KVR_C_FEED_OTHER_MEDIUM, v->n_hashes);
		e->st.events++;
		count(f, KVR_C_FEED_EVENTS, 1);
		return;
	}
	if (v->n_hashes == 0 || (uint64_t)v->n_tokens != (uint64_t)v->n_hashes * bs) {
		refuse(f, e);
		flog(f, e, LK_TOKENS, KVR_LOG_ERROR,
		     "BlockStored refused: %u token ids for %u blocks of %u", v->n_tokens,
		     v->n_hashes, bs);
		return;
	}
	const char *lora = v->lora_off >= 0 ? b->strs + v->lora_off : NULL;
	if (!lora && v->has_lora_id) {
		refuse(f, e);
		flog(f, e, LK_LORA, KVR_LOG_WARN,
		     "BlockStored refused: lora_id %" PRIu64 " without lora_name", v->lora_id);
		return;
	}
	struct pending *p = &f->pend;
	struct pev *pv = pend_event(f, e, s->dp, v->n_hashes, false);
	if (!pv || grow((void **)&p->local, &p->cap_local, v->n_hashes, sizeof(*p->local))) {
		refuse(f, e);
		return;
	}
	/* Local hashes now, as kvr_events_apply would on this thread: the token buffer is the
	 * decoder's, and the next message reuses it. */
	kvr_hash_blocks(b->tokens + v->tok_off, (size_t)v->n_hashes * bs, bs, lora, p->local, NULL);
	for (uint32_t i = 0; i < v->n_hashes; i++)
		p->blk[p->n_blk + i] =
		    (struct kvr_event_block){.ext_hash = h[i], .local_hash = p->local[i]};
	pv->type = KVR_EVENT_STORED;
	pv->has_parent = v->has_parent;
	pv->parent = v->parent;
	pv->n = v->n_hashes;
	p->n_blk += v->n_hashes;
	p->n_ev++;
	e->st.events++;
	e->st.blocks_stored += v->n_hashes;
	count(f, KVR_C_FEED_EVENTS, 1);
	count(f, KVR_C_FEED_BLOCKS_STORED, v->n_hashes);
}

static void apply_removed(struct kvr_feed *f, struct ep *e, struct rstate *s,
                          const struct kvr_feed_batch *b, const struct kvr_fev *v)
{
	const uint64_t *h = b->hashes + v->hash_off;
	e->st.events++;
	count(f, KVR_C_FEED_EVENTS, 1);
	if (!v->gpu) {
		for (uint32_t i = 0; i < v->n_hashes; i++) {
			uint32_t *c = kvr_u64map_find(&s->other, h[i]);
			if (c && *c > 1)
				--*c; /* another copy stays */
			else if (c)
				kvr_u64map_remove(&s->other, h[i]);
		}
		return;
	}
	/* Every copy's removal goes to the index, which counts copies (events mode). */
	uint32_t n = v->n_hashes;
	struct pev *pv = pend_event(f, e, s->dp, n, true);
	if (!pv) {
		refuse(f, e);
		return;
	}
	memcpy(f->pend.rm + f->pend.n_rm, h, (size_t)n * sizeof(*h));
	e->st.blocks_removed += n;
	count(f, KVR_C_FEED_BLOCKS_REMOVED, n);
	if (!n)
		return;
	pv->type = KVR_EVENT_REMOVED;
	pv->n = n;
	f->pend.n_rm += n;
	f->pend.n_ev++;
}

static void apply_batch(struct kvr_feed *f, struct ep *e, const struct kvr_feed_batch *b)
{
	uint32_t dp = dp_of(e, b);
	uint32_t slot;
	if (kvr_router_find_rank(f->r, (struct kvr_rank_id){e->worker_id, dp}, &slot)) {
		e->st.unknown_rank++;
		count(f, KVR_C_FEED_UNKNOWN_RANK, 1);
		flog(f, e, LK_RANK, KVR_LOG_WARN,
		     "batch for rank (%" PRIu64 ", %u) unknown to the router", e->worker_id, dp);
		return;
	}
	struct rstate *s = rstate_get(e, dp);
	if (!s) {
		e->st.malformed++; /* no memory for its state: dropped like bad input */
		count(f, KVR_C_FEED_MALFORMED, 1);
		return;
	}
	for (uint32_t i = 0; i < b->n_ev; i++) {
		const struct kvr_fev *v = &b->ev[i];
		switch (v->type) {
		case KVR_FEV_STORED:
			apply_stored(f, e, s, b, v);
			break;
		case KVR_FEV_REMOVED:
			apply_removed(f, e, s, b, v);
			break;
		case KVR_FEV_CLEARED:
			clear_rank(f, e, s);
			e->st.events++;
			count(f, KVR_C_FEED_EVENTS, 1);
			break;
		}
	}
	if (b->n_unknown) {
		e->st.unknown_events += b->n_unknown;
		flog(f, e, LK_MALFORMED, KVR_LOG_INFO, "%u events of unknown type skipped",
		     b->n_unknown);
	}
	e->st.batches++;
	count(f, KVR_C_FEED_BATCHES, 1);
	double ts_ns = b->ts * 1e9;
	uint64_t now = wall_ns();
	if (ts_ns > 0 && ts_ns < 1.8e19) {
		uint64_t lag = now > (uint64_t)ts_ns ? now - (uint64_t)ts_ns : 0;
		e->st.last_lag_ns = lag;
		kvr_metrics_observe(f->mb, KVR_H_FEED_LAG_NS, lag);
	}
}

/* ---------------------------------------------------------------- the sequence rules */

static void replay(struct kvr_feed *f, struct ep *e, uint64_t start);

static void report_gap(struct kvr_feed *f, struct ep *e, uint64_t expected, uint64_t got,
                       const struct kvr_feed_batch *b)
{
	e->st.gaps++;
	count(f, KVR_C_FEED_GAPS, 1);
	flog(f, e, LK_GAP, KVR_LOG_WARN,
	     "seq gap: expected %" PRIu64 ", got %" PRIu64 "; rank cleared", expected, got);
	/* The rank this batch is for (known even on first contact), and any seen before. */
	if (b || e->dp_rank != KVR_FEED_DP_FROM_BATCH)
		rstate_get(e, dp_of(e, b));
	for (uint32_t i = 0; i < e->n_rs; i++) {
		if (f->r->cfg.on_event_gap)
			f->r->cfg.on_event_gap(f->r->cfg.callback_ctx, e->worker_id, e->rs[i].dp,
			                       expected, got);
		clear_rank(f, e, &e->rs[i]);
	}
}

/* One batch (b NULL: its payload was malformed) with sequence number seq, from the live SUB
 * socket or from a replay. */
static void on_batch(struct kvr_feed *f, struct ep *e, uint64_t seq, const struct kvr_feed_batch *b,
                     bool replayed)
{
	if (!replayed) {
		if (e->have_live && seq <= e->last_live) {
			e->st.restarts++;
			count(f, KVR_C_FEED_RESTARTS, 1);
			flog(f, e, LK_GAP, KVR_LOG_WARN,
			     "publisher restarted (seq %" PRIu64 " after %" PRIu64
			     "); rank cleared",
			     seq, e->last_live);
			clear_all(f, e);
			e->have_seq = false;
		}
		e->have_live = true;
		e->last_live = seq;
	}
	if (e->have_seq && seq < e->next_seq) {
		e->st.duplicates++;
		count(f, KVR_C_FEED_DUPLICATES, 1);
		return;
	}
	uint64_t expected = e->have_seq ? e->next_seq : 0;
	if (seq > expected && !replayed && e->replay) {
		replay(f, e, expected);
		if (e->have_seq && seq < e->next_seq)
			return; /* the replay applied it */
		expected = e->have_seq ? e->next_seq : 0;
	}
	if (seq > expected)
		report_gap(f, e, expected, seq, b);
	if (b)
		apply_batch(f, e, b);
	e->next_seq = seq + 1;
	e->have_seq = true;
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
	count(f, KVR_C_FEED_MALFORMED, 1);
	flog(f, e, LK_MALFORMED, KVR_LOG_WARN, "malformed message skipped: %s", why);
}

/* Decodes a payload into b; NULL if malformed (counted). */
static const struct kvr_feed_batch *decode(struct kvr_feed *f, struct ep *e,
                                           struct kvr_feed_batch *b, zmq_msg_t *m)
{
	int rc = kvr_feed_decode(b, zmq_msg_data(m), zmq_msg_size(m));
	if (rc == 0)
		return b;
	malformed(f, e,
	          rc == KVR_ENOMEM ? "no memory to decode the payload"
	                           : "payload is not a vLLM KV event batch");
	return NULL;
}

/* Asks the replay endpoint for every batch from start on and applies them in order. */
static void replay(struct kvr_feed *f, struct ep *e, uint64_t start)
{
	flush(f); /* what arrived before the gap is not held back by the wait */
	if (!e->dealer) {
		e->dealer = zmq_socket(f->zctx, ZMQ_DEALER);
		int zero = 0;
		if (!e->dealer)
			return;
		zmq_setsockopt(e->dealer, ZMQ_LINGER, &zero, sizeof(zero));
		zmq_setsockopt(e->dealer, ZMQ_MAXMSGSIZE, &f->cfg.max_msg_bytes,
		               sizeof(f->cfg.max_msg_bytes));
		if (zmq_connect(e->dealer, e->replay) != 0) {
			zmq_close(e->dealer);
			e->dealer = NULL;
			return;
		}
	}
	uint8_t req[8];
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(start >> (56 - 8 * i));
	if (zmq_send(e->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(e->dealer, req, 8, ZMQ_DONTWAIT) < 0)
		goto fail;
	uint64_t deadline = wall_ns() + (uint64_t)f->cfg.replay_timeout_ms * 1000000u;
	for (;;) {
		uint64_t now = wall_ns();
		if (now >= deadline)
			goto fail;
		zmq_pollitem_t it = {.socket = e->dealer, .events = ZMQ_POLLIN};
		long ms = (long)((deadline - now + 999999) / 1000000);
		if (zmq_poll(&it, 1, ms) < 0 && zmq_errno() != EINTR)
			goto fail;
		if (!(it.revents & ZMQ_POLLIN))
			continue;
		zmq_msg_t fr[4];
		int n = recv_frames(e->dealer, fr, 4);
		if (n <= 0)
			continue;
		uint64_t seq;
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
			count(f, KVR_C_FEED_REPLAYS, 1);
			return;
		}
		const struct kvr_feed_batch *b = decode(f, e, &f->rep, &fr[si + 1]);
		bool applies = !(e->have_seq && seq < e->next_seq);
		on_batch(f, e, seq, b, true);
		if (applies && b) {
			e->st.replayed_batches++;
			count(f, KVR_C_FEED_REPLAYED_BATCHES, 1);
		}
		close_frames(fr, n);
	}
fail:
	/* No answer in time (or the socket failed): drop the socket so a late answer cannot be
	 * taken for the next request's. */
	flog(f, e, LK_GAP, KVR_LOG_WARN, "replay from %" PRIu64 " failed or timed out", start);
	zmq_close(e->dealer);
	e->dealer = NULL;
}

/* Drains what the endpoint's SUB socket holds (bounded, so one busy endpoint cannot starve
 * the others or the control socket). */
static void drain_some(struct kvr_feed *f, struct ep *e)
{
	for (int k = 0; k < 256; k++) {
		zmq_msg_t fr[3];
		int n = recv_frames(e->sub, fr, 3);
		if (n == 0)
			return;
		e->st.messages++;
		count(f, KVR_C_FEED_MESSAGES, 1);
		if (n < 0) {
			malformed(f, e, "receive failed");
			return;
		}
		uint64_t seq;
		if (n != 3 || !read_seq(&fr[1], &seq)) {
			close_frames(fr, n > 3 ? 3 : n); /* n > 3: the first 3 are held */
			malformed(f, e, n != 3 ? "not 3 frames" : "seq frame is not 8 bytes");
			continue;
		}
		const struct kvr_feed_batch *b = decode(f, e, &f->live, &fr[2]);
		on_batch(f, e, seq, b, false);
		close_frames(fr, 3);
	}
}

static void drain(struct kvr_feed *f, struct ep *e)
{
	drain_some(f, e);
	flush(f); /* everything this drain accepted, in one round trip */
}

/* ---------------------------------------------------------------- endpoints */

static void ep_free(struct ep *e)
{
	if (!e)
		return;
	if (e->sub)
		zmq_close(e->sub);
	if (e->dealer)
		zmq_close(e->dealer);
	freestr(e->endpoint);
	freestr(e->topic);
	freestr(e->replay);
	for (uint32_t i = 0; i < e->n_rs; i++) {
		kvr_u64map_fini(&e->rs[i].other);
	}
	kvr_free(e->rs, (size_t)e->cap_rs * sizeof(*e->rs));
	kvr_free(e, sizeof(*e));
}

static int ep_add(struct kvr_feed *f, const struct kvr_feed_endpoint *p, uint32_t *id)
{
	if (grow((void **)&f->eps, &f->cap_eps, (uint64_t)f->n_eps + 1, sizeof(*f->eps)) ||
	    grow((void **)&f->items, &f->cap_items, (uint64_t)f->n_eps + 2, sizeof(*f->items)))
		return KVR_ENOMEM;
	struct ep *e = kvr_calloc(1, sizeof(*e));
	if (!e)
		return KVR_ENOMEM;
	e->worker_id = p->worker_id;
	e->dp_rank = p->dp_rank;
	e->endpoint = dupstr(p->endpoint);
	e->topic = dupstr(p->topic ? p->topic : "");
	e->replay = p->replay_endpoint && p->replay_endpoint[0] ? dupstr(p->replay_endpoint) : NULL;
	if (!e->endpoint || !e->topic ||
	    (p->replay_endpoint && p->replay_endpoint[0] && !e->replay)) {
		ep_free(e);
		return KVR_ENOMEM;
	}
	e->sub = zmq_socket(f->zctx, ZMQ_SUB);
	if (!e->sub) {
		ep_free(e);
		return KVR_ENOMEM;
	}
	int zero = 0, hwm = (int)(f->cfg.rcv_hwm > INT32_MAX ? INT32_MAX : f->cfg.rcv_hwm);
	int64_t maxsz = (int64_t)f->cfg.max_msg_bytes;
	zmq_setsockopt(e->sub, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(e->sub, ZMQ_RCVHWM, &hwm, sizeof(hwm));
	zmq_setsockopt(e->sub, ZMQ_MAXMSGSIZE, &maxsz, sizeof(maxsz));
	if (zmq_setsockopt(e->sub, ZMQ_SUBSCRIBE, e->topic, strlen(e->topic)) != 0 ||
	    zmq_connect(e->sub, e->endpoint) != 0) {
		ep_free(e);
		return KVR_EINVAL;
	}
	if (e->replay) {
		/* Check the address now (the socket itself is made on the first gap). */
		void *d = zmq_socket(f->zctx, ZMQ_DEALER);
		int ok = d && zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof(zero)) == 0 &&
		         zmq_connect(d, e->replay) == 0;
		if (!ok) {
			if (d)
				zmq_close(d);
			ep_free(e);
			return KVR_EINVAL;
		}
		zmq_setsockopt(d, ZMQ_MAXMSGSIZE, &maxsz, sizeof(maxsz));
		e->dealer = d;
	}
	e->id = f->next_id++;
	f->eps[f->n_eps++] = e;
	*id = e->id;
	return 0;
}

static struct ep *ep_find(struct kvr_feed *f, uint32_t id, uint32_t *at)
{
	for (uint32_t i = 0; i < f->n_eps; i++)
		if (f->eps[i]->id == id) {
			if (at)
				*at = i;
			return f->eps[i];
		}
	return NULL;
}

static void stats_of(const struct ep *e, struct kvr_feed_stats *st)
{
	*st = e->st;
	st->other_medium_blocks = other_blocks(e);
	st->next_seq = e->have_seq ? e->next_seq : 0;
}

static void run_cmd(struct kvr_feed *f, struct cmd *c)
{
	uint32_t at;
	struct ep *e;
	switch (c->op) {
	case CMD_ADD:
		c->rc = ep_add(f, c->ep, &c->id);
		break;
	case CMD_REMOVE:
		if (!(e = ep_find(f, c->id, &at))) {
			c->rc = KVR_ENOENT;
			break;
		}
		ep_free(e);
		memmove(&f->eps[at], &f->eps[at + 1], (f->n_eps - at - 1) * sizeof(*f->eps));
		f->n_eps--;
		c->rc = 0;
		break;
	case CMD_STATS:
		if (c->id == KVR_FEED_ALL) {
			struct kvr_feed_stats sum = {0}, one;
			uint64_t lag = 0;
			for (uint32_t i = 0; i < f->n_eps; i++) {
				stats_of(f->eps[i], &one);
				uint64_t *d = (uint64_t *)&sum;
				const uint64_t *s = (const uint64_t *)&one;
				for (size_t k = 0; k < sizeof(sum) / sizeof(uint64_t); k++)
					d[k] += s[k];
				lag = one.last_lag_ns > lag ? one.last_lag_ns : lag;
			}
			sum.last_lag_ns = lag; /* the largest, not a sum */
			sum.next_seq = 0;
			*c->stats = sum;
			c->rc = 0;
		} else if ((e = ep_find(f, c->id, NULL))) {
			stats_of(e, c->stats);
			c->rc = 0;
		} else {
			c->rc = KVR_ENOENT;
		}
		break;
	case CMD_OTHER:
		if (!(e = ep_find(f, c->id, NULL))) {
			c->rc = KVR_ENOENT;
			break;
		}
		c->n = 0;
		c->rc = 0;
		for (uint32_t i = 0; i < e->n_rs; i++) {
			const struct kvr_u64map *m = &e->rs[i].other;
			if (e->rs[i].dp != c->dp)
				continue;
			for (size_t k = 0; k < m->cap; k++)
				if (m->slots[k].val != KVR_U64MAP_EMPTY) {
					if (c->n < c->cap)
						c->out[c->n] = m->slots[k].key;
					c->n++;
				}
		}
		if (c->n > c->cap)
			c->rc = KVR_ERANGE;
		break;
	case CMD_STOP:
		f->stop = true;
		c->rc = 0;
		break;
	default:
		c->rc = KVR_EINVAL;
	}
}

static void *feed_main(void *arg)
{
	struct kvr_feed *f = arg;
	f->mb = kvr_metrics_local(f->r->metrics);
	while (!f->stop) {
		f->items[0] = (zmq_pollitem_t){.socket = f->ctl_server, .events = ZMQ_POLLIN};
		for (uint32_t i = 0; i < f->n_eps; i++)
			f->items[i + 1] =
			    (zmq_pollitem_t){.socket = f->eps[i]->sub, .events = ZMQ_POLLIN};
		uint32_t n = f->n_eps + 1;
		/* Poll without blocking for idle_spin_ns first: the next batch then costs no
		 * wake-up of this thread (the shards do the same, shard_idle_spin_ns). */
		int ready = 0;
		if (f->cfg.idle_spin_ns) {
			uint64_t end = wall_ns() + f->cfg.idle_spin_ns;
			while ((ready = zmq_poll(f->items, (int)n, 0)) == 0 && wall_ns() < end)
				;
		}
		if (ready == 0 && zmq_poll(f->items, (int)n, -1) < 0) {
			if (zmq_errno() == ETERM)
				break;
			continue;
		}
		/* Endpoints first: a command may remove one and reshuffle the array. */
		for (uint32_t i = 1; i < n; i++)
			if (f->items[i].revents & ZMQ_POLLIN)
				drain(f, f->eps[i - 1]);
		if (f->items[0].revents & ZMQ_POLLIN) {
			struct cmd *c;
			if (zmq_recv(f->ctl_server, &c, sizeof(c), 0) == (int)sizeof(c) &&
			    __atomic_load_n(&c->posted, __ATOMIC_ACQUIRE)) {
				run_cmd(f, c);
				__atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);
				zmq_send(f->ctl_server, "", 0, 0);
			}
		}
	}
	kvr_rcu_thread_offline();
	return NULL;
}

static int call(struct kvr_feed *f, struct cmd *c)
{
	pthread_mutex_lock(&f->ctl_lock);
	int rc = KVR_ESHUTDOWN;
	char ack;
	__atomic_store_n(&c->posted, 1, __ATOMIC_RELEASE);
	if (zmq_send(f->ctl_client, &c, sizeof(c), 0) == (int)sizeof(c) &&
	    zmq_recv(f->ctl_client, &ack, 1, 0) >= 0 && __atomic_load_n(&c->done, __ATOMIC_ACQUIRE))
		rc = c->rc;
	pthread_mutex_unlock(&f->ctl_lock);
	return rc;
}

/* ---------------------------------------------------------------- API */

void kvr_feed_config_init(struct kvr_feed_config *cfg)
{
	if (!cfg)
		return;
	*cfg = (struct kvr_feed_config){.replay_timeout_ms = 1000,
	                                .max_msg_bytes = 64u << 20,
	                                .rcv_hwm = 100000,
	                                .idle_spin_ns = 0};
}

int kvr_feed_create(struct kvr_router *r, const struct kvr_feed_config *cfg, struct kvr_feed **out)
{
	if (!r || !out || r->cfg.mode != KVR_MODE_EVENTS)
		return KVR_EINVAL;
	struct kvr_feed_config c;
	if (cfg)
		c = *cfg;
	else
		kvr_feed_config_init(&c);
	if (c.replay_timeout_ms == 0 || c.max_msg_bytes < 1024 || c.max_msg_bytes > INT64_MAX ||
	    c.rcv_hwm == 0)
		return KVR_EINVAL;
	struct kvr_feed *f = kvr_calloc(1, sizeof(*f));
	if (!f)
		return KVR_ENOMEM;
	f->r = r;
	f->cfg = c;
	pthread_mutex_init(&f->ctl_lock, NULL);
	if (grow((void **)&f->items, &f->cap_items, 1, sizeof(*f->items)))
		goto fail;
	if (!(f->zctx = zmq_ctx_new()))
		goto fail;
	char name[64];
	snprintf(name, sizeof(name), "inproc://kvr-feed-%p", (void *)f);
	f->ctl_server = zmq_socket(f->zctx, ZMQ_PAIR);
	f->ctl_client = zmq_socket(f->zctx, ZMQ_PAIR);
	if (!f->ctl_server || !f->ctl_client || zmq_bind(f->ctl_server, name) != 0 ||
	    zmq_connect(f->ctl_client, name) != 0)
		goto fail;
	if (pthread_create(&f->thread, NULL, feed_main, f) != 0)
		goto fail;
	f->started = true;
	*out = f;
	return 0;
fail:
	kvr_feed_destroy(f);
	return KVR_ENOMEM;
}

int kvr_feed_add(struct kvr_feed *f, const struct kvr_feed_endpoint *ep, uint32_t *id_out)
{
	if (!f || !ep || !ep->endpoint || !ep->endpoint[0])
		return KVR_EINVAL;
	struct cmd c = {.op = CMD_ADD, .ep = ep};
	int rc = call(f, &c);
	if (rc == 0 && id_out)
		*id_out = c.id;
	return rc;
}

int kvr_feed_remove(struct kvr_feed *f, uint32_t id)
{
	if (!f)
		return KVR_EINVAL;
	struct cmd c = {.op = CMD_REMOVE, .id = id};
	return call(f, &c);
}

int kvr_feed_get_stats(struct kvr_feed *f, uint32_t id, struct kvr_feed_stats *out)
{
	if (!f || !out)
		return KVR_EINVAL;
	struct cmd c = {.op = CMD_STATS, .id = id, .stats = out};
	return call(f, &c);
}

int kvr_feed_other_medium_blocks(struct kvr_feed *f, uint32_t id, uint32_t dp_rank, uint64_t *out,
                                 size_t cap, size_t *n_out)
{
	if (!f || !n_out || (!out && cap))
		return KVR_EINVAL;
	struct cmd c = {.op = CMD_OTHER, .id = id, .dp = dp_rank, .out = out, .cap = cap};
	int rc = call(f, &c);
	if (rc == 0 || rc == KVR_ERANGE)
		*n_out = c.n;
	return rc;
}

void kvr_feed_destroy(struct kvr_feed *f)
{
	if (!f)
		return;
	if (f->started) {
		struct cmd c = {.op = CMD_STOP};
		call(f, &c);
		pthread_join(f->thread, NULL);
	}
	for (uint32_t i = 0; i < f->n_eps; i++)
		ep_free(f->eps[i]);
	if (f->ctl_client)
		zmq_close(f->ctl_client);
	if (f->ctl_server)
		zmq_close(f->ctl_server);
	if (f->zctx)
		zmq_ctx_term(f->zctx);
	kvr_feed_batch_fini(&f->live);
	kvr_feed_batch_fini(&f->rep);
	kvr_free(f->eps, (size_t)f->cap_eps * sizeof(*f->eps));
	kvr_free(f->items, (size_t)f->cap_items * sizeof(*f->items));
	struct pending *p = &f->pend;
	kvr_free(p->ev, (size_t)p->cap_ev * sizeof(*p->ev));
	kvr_free(p->blk, (size_t)p->cap_blk * sizeof(*p->blk));
	kvr_free(p->rm, (size_t)p->cap_rm * sizeof(*p->rm));
	kvr_free(p->local, (size_t)p->cap_local * sizeof(*p->local));
	kvr_free(p->out, (size_t)p->cap_out * sizeof(*p->out));
	kvr_free(p->rcs, (size_t)p->cap_rcs * sizeof(*p->rcs));
	pthread_mutex_destroy(&f->ctl_lock);
	kvr_free(f, sizeof(*f));
}
