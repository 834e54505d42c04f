/*
 * sync/feed_apply.c - a decoded vLLM KV event batch into the router's index: validation, local
 * hashes, the events queued per rank and applied through kvr_events_apply's shard function.
 *
 * Applying.  Everything one drain of the sockets accepts for a rank goes to the rank's shard
 * as ONE task (kvr_events_post_many, core/events.c), local hashes computed here on the feed
 * thread.  A round trip per event capped the feed at the shard's wake-up rate: 87k blocks/s on
 * a loaded 2-core machine, against 1.26-1.75M blocks/s batched (perf/bench_feed).  At low rates
 * a drain holds one message, so batching adds no lag.  The feed does not wait for the task: it
 * goes back to its sockets while the shard applies, filling the other of two buffers; it waits
 * only when that buffer's own task is still running (the shard is two drains behind), and
 * before an API command (stats must count what is visible).  Waiting for every task made the
 * thread pay a futex wake-up per drain before it could read on; on a loaded machine (publisher
 * at 10k batches/s, bench_feed without --rt, same minute) the feed's applied-lag p50 fell
 * behind by 0.40-1.88 s that way, by 0.13-0.34 s without the wait.
 *
 * Copies.  vLLM can hold two physical copies of one hash (the same prefix computed twice before
 * the first copy was cached, or one per KV cache group of a hybrid model) and sends a
 * BlockRemoved per copy.  The router's index counts copies per (rank, block) in events mode
 * (kvr_index_set_count_copies, core/index.h), so the feed forwards every store and every
 * removal as it comes; a block leaves the index with its last copy.  Blocks on another medium
 * (the offloading connector's "CPU") are counted here, per rank and hash, never in the GPU
 * index.
 */
#include <inttypes.h>
#include <string.h>

#include "core/alloc.h"
#include "core/events.h"
#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "shards/u64map.h"
#include "sync/feed_decode.h"
#include "sync/feed_internal.h"

/* ---------------------------------------------------------------- per-rank state */

static struct rstate *rstate_find(struct ep *e, uint32_t dp)
{
	for (uint32_t i = 0; i < e->n_rs; i++)
		if (e->rs[i].dp == dp)
			return &e->rs[i];
	return NULL;
}

struct rstate *kvr_feed_rstate(struct ep *e, uint32_t dp)
{
	struct rstate *s = rstate_find(e, dp);
	if (s)
		return s;
	if (kvr_feed_grow((void **)&e->rs, &e->cap_rs, (uint64_t)e->n_rs + 1, sizeof(*e->rs)))
		return NULL;
	s = &e->rs[e->n_rs++];
	*s = (struct rstate){.dp = dp, .since = SINCE_NONE};
	kvr_u64map_init(&s->other);
	return s;
}

uint64_t kvr_feed_other_blocks(const struct ep *e)
{
	uint64_t n = 0;
	for (uint32_t i = 0; i < e->n_rs; i++)
		n += e->rs[i].other.count;
	return n;
}

static void refuse(struct kvr_feed *f, struct ep *e);
static void lost(struct kvr_feed *f, struct ep *e, uint32_t dp, uint64_t seq0, uint64_t seq1,
                 uint64_t n, bool direct);

/* Posts the pending events of p to their rank's shard (kvr_events_post_many: the feed goes on
 * reading while the shard applies them; complete() collects the results, a failure to post
 * too).  Allocates nothing: pend_event gave out and rcs their room with the event. */
static void post_pending(struct kvr_feed *f, struct pending *p)
{
	if (!p->n_ev)
		return;
	struct ep *e = p->ep;
	for (uint32_t i = 0; i < p->n_ev; i++) { /* out and rcs have room (pend_event) */
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
	p->post_rc = kvr_events_post_many(f->r, (struct kvr_rank_id){e->worker_id, p->dp}, p->out,
	                                  p->n_ev, p->rcs, &p->post);
}

/* Logs why the shard refused p's stored event i (code r), in the words of kvr_events_apply's
 * detail (core/events.c event_fail): kvr_strerror's would say "no such rank" for a parent the
 * rank does not hold, "invalid argument" for blocks that contradict the rank's.  The refusals
 * that leave the rank out of sync (its bound, the index's run ids) are reported lost through
 * on_event_gap by the shard, once per episode (kvr_events_post_wait).  Valid only when the post
 * was made (p->post.args). */
static void refused_store(struct kvr_feed *f, const struct pending *p, uint32_t i, int r)
{
	const struct pev *v = &p->ev[i];
	const uint64_t w = p->ep->worker_id;
	const uint32_t dp = p->dp;
	/* Both refusals for room are KVR_ERANGE; the shard says which (index_full). */
	if (r == KVR_ERANGE && p->post.args[i].index_full)
		kvr_feed_log(f, p->ep, LK_RUN_IDS, KVR_LOG_ERROR,
		             "BlockStored for rank (%" PRIu64
		             ", %u) not applied: the index holds the most runs it can name "
		             "(2^25 - 1 of two blocks or more; kvr_events_apply)",
		             w, dp);
	else if (r == KVR_ERANGE)
		kvr_feed_log(f, p->ep, LK_BOUND, KVR_LOG_WARN,
		             "BlockStored for rank (%" PRIu64
		             ", %u) not applied: the rank is at its stored-block bound "
		             "(kvr_events_apply)",
		             w, dp);
	else if (r == KVR_ENOENT && v->has_parent)
		/* Its own kind: after a gap or a lost store it repeats, and would thin out the
		 * other index refusals' lines.  (A rank removed meanwhile is complete()'s.) */
		kvr_feed_log(f, p->ep, LK_PARENT, KVR_LOG_WARN,
		             "BlockStored for rank (%" PRIu64
		             ", %u) not applied: the rank does not hold its parent %#" PRIx64
		             " (never stored, or refused or lost before)",
		             w, dp, v->parent);
	else if (r == KVR_EINVAL && !p->post.args[i].ev) /* validate()'s, before the shard */
		kvr_feed_log(f, p->ep, LK_INDEX, KVR_LOG_WARN,
		             "BlockStored for rank (%" PRIu64
		             ", %u) refused: a block hash is its own parent's (repeated)",
		             w, dp);
	else if (r == KVR_EINVAL)
		kvr_feed_log(f, p->ep, LK_INDEX, KVR_LOG_WARN,
		             "BlockStored for rank (%" PRIu64
		             ", %u) not applied: it contradicts the rank's blocks (a hash held for "
		             "another block, or a sequence hash collision); the blocks before it "
		             "stay applied",
		             w, dp);
	else
		kvr_feed_log(f, p->ep, LK_INDEX, KVR_LOG_WARN,
		             "BlockStored for rank (%" PRIu64 ", %u) not applied: %s", w, dp,
		             kvr_strerror(r));
}

/* Whether p's events went to a life of their rank other than the one the feed fed (removed
 * and added back between kvr_feed_apply_batch's lookup and the post's), or found it gone at the
 * post.  Valid after kvr_events_post_wait. */
static bool post_missed_life(const struct pending *p, const struct rstate *s)
{
	if (!p->n_ev || !s)
		return false;
	if (p->post_rc)
		return p->post_rc == KVR_ENOENT;
	const struct kvr_event_args *a = &p->post.args[0];
	return s->has_life && (a->slot != s->slot || a->gen != s->gen);
}

/* Waits for p's post (if any), counts and logs what the shard refused, takes the lag of the
 * batches it completed, and empties p for reuse.  A rank whose events found it removed (or
 * another life of it) is remembered as missed from where what its index held began
 * (kvr_feed_note_missed), so that it is rebuilt by replay if it is added back: before, those
 * events were lost for good, and the rank added back held neither them nor anything before. */
static void complete(struct kvr_feed *f, struct pending *p)
{
	kvr_events_post_wait(&p->post);
	uint64_t done = p->post.done_ns, n_lost = 0;
	/* Found, never made: a caller up the stack (kvr_feed_apply_batch) may hold a state of
	 * p->ep, which growing the array would move. */
	struct rstate *s = p->n_ev ? rstate_find(p->ep, p->dp) : NULL;
	bool gone = post_missed_life(p, s);
	for (uint32_t i = 0; i < p->n_ev; i++) {
		int r = p->post_rc ? p->post_rc : p->rcs[i];
		if (r == KVR_ENOMEM) {
			n_lost++;
			continue;
		}
		if (!r)
			continue;
		refuse(f, p->ep);
		if (r == KVR_ENOENT && (p->post_rc || p->post.args[i].rank_gone)) {
			/* Said apart from a parent not held (also KVR_ENOENT), which it read as
			 * before; counted on the router too (kvr_events_total{status="rank_gone"})
			 * when the shard found it gone, not when the post did (post_rc: the rank
			 * kvr_feed_apply_batch found was gone by the post's lookup). */
			gone = true;
			kvr_feed_log(f, p->ep, LK_RANK, KVR_LOG_WARN,
			             "%s for rank (%" PRIu64
			             ", %u) not applied: the rank was removed meanwhile; if it is "
			             "added back, what it held is replayed",
			             p->ev[i].type == KVR_EVENT_STORED    ? "BlockStored"
			             : p->ev[i].type == KVR_EVENT_REMOVED ? "BlockRemoved"
			                                                  : "clear",
			             p->ep->worker_id, p->dp);
			continue;
		}
		if (!p->post_rc && p->ev[i].type == KVR_EVENT_STORED) {
			refused_store(f, p, i, r);
			continue;
		}
		kvr_feed_log(f, p->ep, LK_INDEX, KVR_LOG_WARN,
		             "%s for rank (%" PRIu64 ", %u) not applied: %s",
		             p->ev[i].type == KVR_EVENT_STORED    ? "BlockStored"
		             : p->ev[i].type == KVR_EVENT_REMOVED ? "BlockRemoved"
		                                                  : "clear",
		             p->ep->worker_id, p->dp, kvr_strerror(r));
	}
	if (gone && s)
		kvr_feed_note_missed(f, p->ep, p->dp, p->seq0); /* s exists: nothing made */
	/* Everything accepted is posted by now (kvr_feed_flush posts before it completes the
	 * other buffer): the rank is cleared after all of it, without queueing. */
	if (n_lost)
		lost(f, p->ep, p->dp, p->seq0, p->seq1, n_lost, true);
	if (!p->n_ev || p->post_rc)
		done = kvr_feed_wall_ns();
	for (uint32_t i = 0; i < p->n_lag; i++) {
		uint64_t ts = p->lag[i].ts_ns, lag = done > ts ? done - ts : 0;
		/* vLLM's ts is the publisher's time.time(); one that is not wall-clock seconds (a
		 * monotonic clock, another epoch) read as ~54 years of lag a batch, which left the
		 * gauge and the histogram's sum meaningless.  Not a lag, then: skipped. */
		if (lag > KVR_FEED_LAG_PLAUSIBLE_NS)
			continue;
		p->lag[i].ep->st.last_lag_ns = lag;
		kvr_metrics_observe(f->mb, KVR_H_FEED_LAG_NS, lag);
	}
	p->n_ev = p->n_blk = p->n_rm = p->n_lag = 0;
	p->post_rc = 0;
	p->post.done_ns = 0;
}

/* Room for one more event of (e, dp) with nblk blocks (stored) or hashes (removed), and for
 * what post_pending builds of it; flushes first when another rank's events are pending or the
 * batch is full.  NULL without memory (nothing pending changed). */
static struct pev *pend_event(struct kvr_feed *f, struct ep *e, uint32_t dp, uint32_t nblk,
                              bool removed)
{
	struct pending *p = f->pend;
	if (p->n_ev &&
	    (p->ep != e || p->dp != dp || p->n_blk + p->n_rm + nblk > PENDING_MAX_BLOCKS)) {
		kvr_feed_flush(f);
		p = f->pend;
	}
	if (!p->n_ev)
		p->seq0 = f->seq;
	p->seq1 = f->seq;
	p->ep = e;
	p->dp = dp;
	if (kvr_feed_grow((void **)&p->ev, &p->cap_ev, (uint64_t)p->n_ev + 1, sizeof(*p->ev)) ||
	    kvr_feed_grow((void **)&p->out, &p->cap_out, (uint64_t)p->n_ev + 1, sizeof(*p->out)) ||
	    kvr_feed_grow((void **)&p->rcs, &p->cap_rcs, (uint64_t)p->n_ev + 1, sizeof(*p->rcs)) ||
	    (!removed && kvr_feed_grow((void **)&p->blk, &p->cap_blk, (uint64_t)p->n_blk + nblk,
	                               sizeof(*p->blk))) ||
	    (removed &&
	     kvr_feed_grow((void **)&p->rm, &p->cap_rm, (uint64_t)p->n_rm + nblk, sizeof(*p->rm))))
		return NULL;
	struct pev *v = &p->ev[p->n_ev];
	*v = (struct pev){.off = removed ? p->n_rm : p->n_blk};
	return v;
}

/* Forgets the rank: the index's blocks for it (after what is pending), its other medium. */
void kvr_feed_clear_rank(struct kvr_feed *f, struct ep *e, struct rstate *s, uint64_t since)
{
	s->since = since;
	kvr_u64map_clear(&s->other);
	if (s->missed)
		return; /* nothing of it in the index (its resync clears it first) */
	struct pev *v = pend_event(f, e, s->dp, 0, false);
	if (v) {
		v->type = KVR_EVENT_CLEARED;
		f->pend->n_ev++;
		return;
	}
	/* No memory to queue it: apply what is pending, then clear directly. */
	kvr_feed_flush(f);
	int rc = kvr_events_clear_rank(f->r, (struct kvr_rank_id){e->worker_id, s->dp});
	if (rc && rc != KVR_ENOENT)
		kvr_feed_log(f, e, LK_INDEX, KVR_LOG_ERROR,
		             "clearing rank (%" PRIu64 ", %u) failed: %s", e->worker_id, s->dp,
		             kvr_strerror(rc));
}

/* The ranks the endpoint feeds now: the fixed one, or every dp rank seen so far. */
void kvr_feed_clear_all(struct kvr_feed *f, struct ep *e, uint64_t since)
{
	if (e->dp_rank != KVR_FEED_DP_FROM_BATCH && !kvr_feed_rstate(e, e->dp_rank))
		return;
	for (uint32_t i = 0; i < e->n_rs; i++)
		kvr_feed_clear_rank(f, e, &e->rs[i], since);
}

uint32_t kvr_feed_dp_of(const struct ep *e, const struct kvr_feed_batch *b)
{
	if (e->dp_rank != KVR_FEED_DP_FROM_BATCH)
		return e->dp_rank;
	return b && b->has_dp ? b->dp : 0;
}

static void refuse(struct kvr_feed *f, struct ep *e)
{
	e->st.refused++;
	kvr_feed_count(f, KVR_C_FEED_REFUSED, 1);
}

/* What a loss of events for memory does to rank (e, dp), from batches seq0..seq1: reported as
 * a gap of those batches (on_event_gap), and the rank's index cleared after everything accepted
 * before them, so that what it holds of the rank stays a subset of the engine's cache, as after
 * any gap: a lost removal or clear would otherwise credit the rank with blocks it no longer
 * holds, for good.  What follows refills it.  direct: everything accepted is posted already
 * and nothing may be queued (complete(), inside a flush): the clear is a shard call of its own,
 * behind the posts on the rank's lane.  Else kvr_feed_clear_rank queues it (or flushes and
 * calls, without memory). */
static void lost_rank(struct kvr_feed *f, struct ep *e, uint32_t dp, uint64_t seq0, uint64_t seq1,
                      bool direct)
{
	kvr_feed_log(f, e, LK_MEMORY, KVR_LOG_ERROR,
	             "rank (%" PRIu64 ", %u): events of seq %" PRIu64 "..%" PRIu64
	             " not applied for lack of memory; rank cleared",
	             e->worker_id, dp, seq0, seq1);
	if (f->r->cfg.on_event_gap)
		f->r->cfg.on_event_gap(f->r->cfg.callback_ctx, e->worker_id, dp, seq0, seq1 + 1);
	struct rstate *s = rstate_find(e, dp);
	if (s && s->missed)
		return; /* nothing of it in the index (its resync clears it first) */
	/* Rebuilt (a rank removed and added back) from the lost batches on: a replay may bring
	 * them. */
	if (s && !direct) {
		kvr_feed_clear_rank(f, e, s, seq0);
		return;
	}
	if (s)
		s->since = seq0;
	if (!direct)
		kvr_feed_flush(f);
	int rc = kvr_events_clear_rank(f->r, (struct kvr_rank_id){e->worker_id, dp});
	if (rc && rc != KVR_ENOENT)
		kvr_feed_log(f, e, LK_INDEX, KVR_LOG_ERROR,
		             "clearing rank (%" PRIu64 ", %u) failed: %s", e->worker_id, dp,
		             kvr_strerror(rc));
}

static void count_lost(struct kvr_feed *f, struct ep *e, uint64_t n)
{
	e->st.lost += n;
	kvr_feed_count(f, KVR_C_FEED_LOST, n);
}

/* n events of rank (e, dp), from batches seq0..seq1, not applied for memory: counted, and the
 * rank cleared and reported (lost_rank). */
static void lost(struct kvr_feed *f, struct ep *e, uint32_t dp, uint64_t seq0, uint64_t seq1,
                 uint64_t n, bool direct)
{
	count_lost(f, e, n);
	lost_rank(f, e, dp, seq0, seq1, direct);
}

void kvr_feed_lost_batch(struct kvr_feed *f, struct ep *e, uint64_t seq, const uint32_t *dp)
{
	count_lost(f, e, 1);
	if (dp || e->dp_rank != KVR_FEED_DP_FROM_BATCH) {
		lost_rank(f, e, dp ? *dp : e->dp_rank, seq, seq, false);
		return;
	}
	/* Its dp rank is in the payload that could not be read: any rank of e's. */
	for (uint32_t i = 0; i < e->n_rs; i++)
		lost_rank(f, e, e->rs[i].dp, seq, seq, false);
	if (!e->n_rs) /* none yet: nothing to clear or report, but the loss is said */
		kvr_feed_log(f, e, LK_MEMORY, KVR_LOG_ERROR,
		             "batch of seq %" PRIu64
		             " not applied for lack of memory; its dp rank is unknown (in the "
		             "payload not decoded) and this endpoint has fed none yet",
		             seq);
}

static void apply_stored(struct kvr_feed *f, struct ep *e, struct rstate *s,
                         const struct kvr_feed_batch *b, const struct kvr_fev *v)
{
	uint32_t bs = f->r->cfg.block_size;
	const uint64_t *h = b->hashes + v->hash_off;
	if (v->has_block_size && v->block_size != bs) {
		refuse(f, e);
		kvr_feed_log(f, e, LK_BLOCK_SIZE, KVR_LOG_ERROR,
		             "BlockStored with block_size %u refused: the router's is %u",
		             v->block_size, bs);
		return;
	}
	if (!v->gpu) {
		/* The same bound as a rank without a capacity in the GPU index (kvr_events_apply):
		 * an offload tier's size is not registered, and a publisher whose removals are
		 * lost, or a hostile one, must not grow this set until the process runs out of
		 * memory.  Every hash is counted as new, so an oversized event is refused before
		 * anything grows. */
		uint64_t bound = f->r->cfg.events_max_blocks;
		if (v->n_hashes > bound || s->other.count > bound - v->n_hashes) {
			refuse(f, e);
			kvr_feed_log(
			    f, e, LK_BOUND, KVR_LOG_ERROR,
			    "rank (%" PRIu64 ", %u): other-medium BlockStored of %u blocks "
			    "refused: %" PRIu64 " held, the bound is %" PRIu64
			    " (kvr_config.events_max_blocks)",
			    e->worker_id, s->dp, v->n_hashes, (uint64_t)s->other.count, bound);
			return;
		}
		if (kvr_u64map_reserve(&s->other, v->n_hashes)) {
			/* Counted and logged; nothing to clear: the other medium's counts can then
			 * only be short (its removals need no memory). */
			count_lost(f, e, 1);
			kvr_feed_log(f, e, LK_MEMORY, KVR_LOG_ERROR,
			             "rank (%" PRIu64
			             ", %u): other-medium BlockStored of seq %" PRIu64
			             " not applied for lack of memory",
			             e->worker_id, s->dp, f->seq);
			return;
		}
		/* A copy count saturates (one that wrapped would forget copies) one below the
		 * map's free-slot mark: at the mark (UINT32_MAX, after 2^32 - 1 copies of one hash)
		 * the slot read as free under the map's count, the hash was inserted again and
		 * other_medium_blocks stayed wrong for good. */
		for (uint32_t i = 0; i < v->n_hashes; i++) {
			uint32_t *c = kvr_u64map_find(&s->other, h[i]);
			if (!c)
				kvr_u64map_insert(&s->other, h[i], 1);
			else if (*c < KVR_U64MAP_EMPTY - 1)
				++*c;
		}
		kvr_feed_count(f, KVR_C_FEED_OTHER_MEDIUM, v->n_hashes);
		e->st.events++;
		kvr_feed_count(f, KVR_C_FEED_EVENTS, 1);
		return;
	}
	if (v->n_hashes == 0 || (uint64_t)v->n_tokens != (uint64_t)v->n_hashes * bs) {
		refuse(f, e);
		kvr_feed_log(f, e, LK_TOKENS, KVR_LOG_ERROR,
		             "BlockStored refused: %u token ids for %u blocks of %u", v->n_tokens,
		             v->n_hashes, bs);
		return;
	}
	const char *lora = v->lora_off >= 0 ? b->strs + v->lora_off : NULL;
	if (!lora && v->has_lora_id) {
		refuse(f, e);
		kvr_feed_log(f, e, LK_LORA, KVR_LOG_WARN,
		             "BlockStored refused: lora_id %" PRIu64 " without lora_name",
		             v->lora_id);
		return;
	}
	struct pev *pv = pend_event(f, e, s->dp, v->n_hashes, false);
	struct pending *p = f->pend; /* after pend_event: a flush switches buffers */
	if (!pv ||
	    kvr_feed_grow((void **)&p->local, &p->cap_local, v->n_hashes, sizeof(*p->local))) {
		lost(f, e, s->dp, f->seq, f->seq, 1, false);
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
	kvr_feed_count(f, KVR_C_FEED_EVENTS, 1);
	kvr_feed_count(f, KVR_C_FEED_BLOCKS_STORED, v->n_hashes);
}

static void apply_removed(struct kvr_feed *f, struct ep *e, struct rstate *s,
                          const struct kvr_feed_batch *b, const struct kvr_fev *v)
{
	const uint64_t *h = b->hashes + v->hash_off;
	if (!v->gpu) {
		e->st.events++;
		kvr_feed_count(f, KVR_C_FEED_EVENTS, 1);
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
		lost(f, e, s->dp, f->seq, f->seq, 1, false);
		return;
	}
	e->st.events++;
	kvr_feed_count(f, KVR_C_FEED_EVENTS, 1);
	memcpy(f->pend->rm + f->pend->n_rm, h, (size_t)n * sizeof(*h));
	e->st.blocks_removed += n;
	kvr_feed_count(f, KVR_C_FEED_BLOCKS_REMOVED, n);
	if (!n)
		return;
	pv->type = KVR_EVENT_REMOVED;
	pv->n = n;
	f->pend->n_rm += n;
	f->pend->n_ev++;
}

uint32_t kvr_feed_missed(const struct ep *e)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < e->n_rs; i++)
		n += e->rs[i].missed;
	return n;
}

/* A batch for a rank the router does not know (yet): dropped, and the rank remembered from
 * this seq on, so that adding it later resyncs it (kvr_feed_resync). */
static void missed(struct kvr_feed *f, struct ep *e, uint32_t dp, uint64_t seq)
{
	e->st.unknown_rank++;
	kvr_feed_count(f, KVR_C_FEED_UNKNOWN_RANK, 1);
	kvr_feed_log(f, e, LK_RANK, KVR_LOG_WARN,
	             "batch for rank (%" PRIu64 ", %u) unknown to the router", e->worker_id, dp);
	kvr_feed_note_missed(f, e, dp, seq);
}

void kvr_feed_note_missed(struct kvr_feed *f, struct ep *e, uint32_t dp, uint64_t from)
{
	struct rstate *s = rstate_find(e, dp);
	if (!s && kvr_feed_missed(e) < MISSED_MAX && !(s = kvr_feed_rstate(e, dp)))
		kvr_feed_log(f, e, LK_MEMORY, KVR_LOG_ERROR,
		             "rank (%" PRIu64 ", %u) not remembered for a resync: no memory (if it "
		             "is added, it fills from the events that follow)",
		             e->worker_id, dp);
	if (s && !s->missed) {
		s->missed = true;
		/* A rank the feed fed was removed: its blocks went with it, so it missed everything
		 * from where they began, not only the batches after the removal. */
		s->missed_from = s->since < from ? s->since : from;
		f->n_missed++;
	}
}

bool kvr_feed_batch_resyncs(struct kvr_feed *f, struct ep *e, uint64_t seq,
                            const struct kvr_feed_batch *b)
{
	uint32_t dp = kvr_feed_dp_of(e, b), slot;
	uint64_t gen, from;
	struct rstate *s = rstate_find(e, dp);
	if (!e->replay || !s ||
	    kvr_router_find_rank_gen(f->r, (struct kvr_rank_id){e->worker_id, dp}, &slot, &gen))
		return false;
	if (s->missed)
		from = s->missed_from;
	else if (s->has_life && (s->slot != slot || s->gen != gen))
		from = s->since < seq ? s->since : seq; /* as kvr_feed_note_missed */
	else
		return false;
	return from < (e->have_seq ? e->next_seq : 0); /* as kvr_feed_resync's replay */
}

void kvr_feed_apply_batch(struct kvr_feed *f, struct ep *e, uint64_t seq,
                          const struct kvr_feed_batch *b)
{
	uint32_t dp = kvr_feed_dp_of(e, b);
	uint32_t slot;
	uint64_t gen;
	if (kvr_router_find_rank_gen(f->r, (struct kvr_rank_id){e->worker_id, dp}, &slot, &gen)) {
		missed(f, e, dp, seq);
		return;
	}
	f->seq = seq;
	struct rstate *s = kvr_feed_rstate(e, dp);
	if (!s) { /* no memory for its state: the batch is lost (no state: nothing to clear) */
		kvr_feed_lost_batch(f, e, seq, &dp);
		return;
	}
	/* Another life than the one fed: the rank was removed and added back since its last
	 * batch, and its removal took its blocks (the feed saw no batch while it was gone). */
	if (!s->missed && s->has_life && (s->slot != slot || s->gen != gen))
		kvr_feed_note_missed(f, e, dp, seq);
	if (s->missed) {
		/* Added since it missed batches: those first (not from inside another replay,
		 * nor out of its turn, sync/feed_seq.c "Replays take turns": this batch then
		 * counts as missed too, and the feed loop resyncs the rank, its replay bringing
		 * this batch; a live batch that needs it is held for its turn instead,
		 * kvr_feed_batch_resyncs). */
		if (f->in_replay || kvr_feed_resync_waits(f, e, s)) {
			e->st.unknown_rank++;
			kvr_feed_count(f, KVR_C_FEED_UNKNOWN_RANK, 1);
			return;
		}
		kvr_feed_resync(f, e, s);
		f->seq = seq; /* the replay's batches set theirs: this batch's losses name it */
		if (!(s = kvr_feed_rstate(e, dp)))
			return;
	}
	/* First fed by this endpoint: what the rank holds came from elsewhere (an earlier feed or
	 * endpoint of the same publisher, whose stores this stream brings again from the
	 * publisher's start, or kvr_events_apply), and events mode counts copies: cleared, so that
	 * the stream rebuilds it.  Before, a successor's replay from 0 counted every block twice
	 * and a block the engine then removed stayed credited (test_feed_successor). */
	if (s->since == SINCE_NONE)
		kvr_feed_clear_rank(f, e, s,
		                    seq); /* since = seq: the batches before were none of its */
	s->has_life = true;
	s->slot = slot;
	s->gen = gen;
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
			kvr_feed_clear_rank(f, e, s, seq);
			e->st.events++;
			kvr_feed_count(f, KVR_C_FEED_EVENTS, 1);
			break;
		}
	}
	if (b->n_unknown) {
		e->st.unknown_events += b->n_unknown;
		kvr_feed_log(f, e, LK_MALFORMED, KVR_LOG_INFO, "%u events of unknown type skipped",
		             b->n_unknown);
	}
	e->st.batches++;
	kvr_feed_count(f, KVR_C_FEED_BATCHES, 1);
	/* Its lag is taken when it is visible, at the flush that applies it. */
	double ts_ns = b->ts * 1e9;
	struct pending *p = f->pend;
	if (ts_ns > 0 && ts_ns < 1.8e19 &&
	    !kvr_feed_grow((void **)&p->lag, &p->cap_lag, (uint64_t)p->n_lag + 1, sizeof(*p->lag)))
		p->lag[p->n_lag++] = (struct pending_lag){.ep = e, .ts_ns = (uint64_t)ts_ns};
}

void kvr_feed_flush(struct kvr_feed *f)
{
	/* Post this buffer; fill the other one next, once its own post is done (the shard has
	 * usually applied it long before). */
	struct pending *p = f->pend, *q = p == &f->bufs[0] ? &f->bufs[1] : &f->bufs[0];
	if (!p->n_ev && !p->n_lag)
		return;
	post_pending(f, p);
	complete(f, q);
	f->pend = q;
}

void kvr_feed_settle(struct kvr_feed *f)
{
	kvr_feed_flush(f);
	complete(f, &f->bufs[0]);
	complete(f, &f->bufs[1]);
}

void kvr_feed_pending_fini(struct pending *p)
{
	kvr_free(p->ev, (size_t)p->cap_ev * sizeof(*p->ev));
	kvr_free(p->blk, (size_t)p->cap_blk * sizeof(*p->blk));
	kvr_free(p->rm, (size_t)p->cap_rm * sizeof(*p->rm));
	kvr_free(p->local, (size_t)p->cap_local * sizeof(*p->local));
	kvr_free(p->out, (size_t)p->cap_out * sizeof(*p->out));
	kvr_free(p->rcs, (size_t)p->cap_rcs * sizeof(*p->rcs));
	kvr_free(p->lag, (size_t)p->cap_lag * sizeof(*p->lag));
	kvr_events_post_fini(&p->post);
}
