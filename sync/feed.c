/*
 * sync/feed.c - vLLM KV events over ZeroMQ: one thread per feed, every endpoint's SUB socket
 * in one zmq_poll, each batch decoded completely (sync/feed_decode.c) before any of it is
 * applied, then applied through the validation and shard function of kvr_events_apply.
 *
 * Threading.  Only the feed thread touches the sockets and the endpoint state.  The API calls
 * (add, remove, stats, destroy) send a pointer to a command over an inproc PAIR socket and wait
 * for the answer, under a mutex so commands from several threads take turns.  Stats are
 * therefore exact snapshots, read on the thread that writes them.
 *
 * Calls between feeds.  A feed's callbacks (its log, the router's on_event_gap) run on its
 * thread, which serves nothing while they run.  A call from them on the feed itself is served
 * inline (reads) or refused (add, remove: KVR_EBUSY).  A call on ANOTHER feed cannot simply wait
 * for that feed's thread: two feeds' callbacks calling each other (or A -> B -> C -> A) each
 * waited for a thread that waited for them, for good; and waiting for the target's ctl_lock
 * could wait for an ordinary caller that itself waits for the calling feed.  So such a call
 * takes no ctl_lock and uses no socket: it pushes its command onto the target's box (a list
 * under a leaf lock) and wakes the target through its eventfd; while it waits for the answer
 * the calling thread serves its OWN box, as a feed thread in a callback can:
 *  - reads (stats, other medium) at once, as of now (what is pending for the shards is not
 *    counted yet), as a feed's own callbacks get them;
 *  - add and remove, which would change the endpoints under the callback's caller, are
 *    deferred: run when this thread is back in its loop; their caller keeps waiting.  A
 *    deferred call is an edge of a wait-for graph (the caller's feed blocked_on this one);
 *    edges are added under one global lock (wait_lock), each after a walk that checks it closes
 *    no cycle: a deferral that would (A's add waits for B's loop while B's add waits for A's,
 *    directly or through other feeds) is answered KVR_EBUSY at once instead.  The callers of
 *    the commands a loop has taken from its box are edges too while they run (serve_box): the
 *    settle before each may run the feed's callbacks, whose calls then see that wait.
 * Reads and add / remove from a replica's thread that handles peers' messages (on_admit there)
 * wait for the feed's loop as from any thread, unless the feed's callback waits for that very
 * replica, directly or through other feeds: then the wait that closes the cycle is refused ("A
 * feed's callback waiting for a replica" below); a feed's callback waiting for a replica serves
 * nothing, so a call on it from another feed's callback waits for that replica too.
 * Why this cannot hang: a feed thread waiting in such a call waits only for its answer, and
 * every feed thread answers what its box holds whenever it is in its loop or in such a wait;
 * the only answers that wait longer are deferred ones, which wait for the target to get back to
 * its loop, i.e. for the target's own call to be answered; following these waits from one to
 * the next never comes back to where it started (the graph is acyclic), so the last one waits
 * for a feed thread that is in its loop, or running the embedder's code (which is the
 * embedder's to finish).  Ordinary threads keep the control socket and get exact answers from
 * the loop; a feed thread waiting in a callback does not serve them (they wait for the callback
 * to return, as before), and no feed thread waits for them: kvr_feed_destroy from a library
 * thread marks and wakes through the box too.  A target torn down answers what its box and
 * deferred list hold with KVR_ESHUTDOWN and closes the box (box_closed) before it is freed.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "core/alloc.h"
#include "core/events.h"
#include "core/fork.h"
#include "core/metrics.h"
#include "core/router_internal.h"
#include "kvrouter.h"
#include "shards/u64map.h"
#include "sync/feed_config.h"
#include "sync/feed_decode.h"
#include "sync/feed_internal.h"
#include "sync/rcu.h"
#include "sync/replica_internal.h"
#include "sync/thread.h"
#include "sync/nocancel.h"

void kvr_feed_log(struct kvr_feed *f, struct ep *e, int kind, int level, const char *fmt, ...)
{
	/* Not after a kvr_feed_destroy from a callback: its caller may free log_ctx once that
	 * call returned. */
	if (!f->cfg.log || kvr_feed_dying(f))
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

/* ---------------------------------------------------------------- endpoints */

static void ep_free(struct ep *e)
{
	if (!e)
		return;
	if (e->monitored)
		zmq_socket_monitor(e->sub, NULL, 0);
	if (e->mon)
		zmq_close(e->mon);
	if (e->sub)
		zmq_close(e->sub);
	if (e->dealer)
		zmq_close(e->dealer);
	if (e->held)
		zmq_msg_close(&e->held_msg);
	freestr(e->endpoint);
	freestr(e->topic);
	freestr(e->replay);
	for (uint32_t i = 0; i < e->n_rs; i++) {
		kvr_u64map_fini(&e->rs[i].other);
	}
	kvr_free(e->rs, (size_t)e->cap_rs * sizeof(*e->rs));
	kvr_free(e, sizeof(*e));
}

/* Endpoints added to any feed of this process: the next one's id. */
static uint32_t endpoints_added;

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

/* Why ZeroMQ failed to make a socket or to connect one: no socket or descriptor left (its
 * context's ZMQ_MAX_SOCKETS, 1,023, which a burst of adds and removes can reach since ZeroMQ
 * closes a removed endpoint's sockets in the background; the process's RLIMIT_NOFILE) is
 * KVR_ENOMEM, anything else an address it refuses (KVR_EINVAL).  Both were reported as a
 * refused address ("not a tcp://, ipc:// or inproc:// address"): 1,577 adds and removes of a
 * valid tcp:// endpoint in a tight loop failed so. */
static int zmq_fail_code(void)
{
	int e = zmq_errno();
	return e == EMFILE || e == ENFILE || e == ENOMEM || e == ENOBUFS ? KVR_ENOMEM : KVR_EINVAL;
}

/* What the feed's receiving sockets (the SUB, the replay DEALER) share: no linger, the
 * receive bound cfg.rcv_hwm (a uint32_t, clamped to ZeroMQ's int), the message size bound
 * cfg.max_msg_bytes.  Context: the feed's thread. */
static void set_rcv_bounds(const struct kvr_feed *f, void *sock)
{
	const int zero = 0, hwm = (int)(f->cfg.rcv_hwm > INT32_MAX ? INT32_MAX : f->cfg.rcv_hwm);
	const int64_t maxsz = (int64_t)f->cfg.max_msg_bytes;
	zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
	zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &maxsz, sizeof(maxsz));
}

int kvr_feed_dealer_open(struct kvr_feed *f, struct ep *e)
{
	void *d = zmq_socket(f->zctx, ZMQ_DEALER);
	if (!d)
		return KVR_ENOMEM;
	const int ivl_max = FEED_RECONNECT_IVL_MAX_MS;
	/* A replay answer's bound, the SUB's (ZeroMQ's default, 1,000, before): a DEALER that
	 * stops reading its connection at its bound leaves the rest of a long answer in the
	 * publisher's ROUTER, whose own bound (ZMQ_SNDHWM, 1,000, which vLLM keeps) drops it
	 * without a word.  Not enough alone: the ROUTER learns what was taken from its queue only
	 * every half bound (libzmq's pipe low-water mark), and in stress_feed_rank_churn with
	 * SFC_ROUTER_HWM=1 it still dropped (5 runs of 6 failed with this alone), so replay() asks
	 * again for what a hole lost (sync/feed_seq.c).  The feed's thread reads an answer as it
	 * comes: the bound costs memory only while that thread is slower than the answer. */
	set_rcv_bounds(f, d);
	zmq_setsockopt(d, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof(ivl_max));
	if (zmq_connect(d, e->replay) != 0) {
		int rc = zmq_fail_code();
		zmq_close(d);
		return rc;
	}
	e->dealer = d;
	return 0;
}

static int ep_add(struct kvr_feed *f, const struct kvr_feed_endpoint *p, uint32_t *id)
{
	/* items: [control, every SUB, every monitor, the box's eventfd] */
	if (kvr_feed_grow((void **)&f->eps, &f->cap_eps, (uint64_t)f->n_eps + 1, sizeof(*f->eps)) ||
	    kvr_feed_grow((void **)&f->items, &f->cap_items, 2 * (uint64_t)f->n_eps + 4,
	                  sizeof(*f->items)))
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
	/* The SUB socket's disconnections, through a monitor (sync/feed_seq.c: a publisher
	 * restarted while the connection was down can be told from a gap only this way). */
	char mon[96];
	/* A name never used before, even after a failed add (an address is released only
	 * when ZeroMQ's reaper gets to the closed socket). */
	snprintf(mon, sizeof(mon), "inproc://kvr-feed-mon-%p-%" PRIu64, (void *)f, f->n_monitors++);
	e->sub = zmq_socket(f->zctx, ZMQ_SUB);
	if (!e->sub) {
		ep_free(e);
		return KVR_ENOMEM;
	}
	e->monitored =
	    zmq_socket_monitor(e->sub, mon,
	                       ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED) == 0;
	if (!e->monitored || !(e->mon = zmq_socket(f->zctx, ZMQ_PAIR)) ||
	    zmq_connect(e->mon, mon) != 0) {
		ep_free(e);
		return KVR_ENOMEM;
	}
	set_rcv_bounds(f, e->sub);
	const int ivl = FEED_RECONNECT_IVL_MS, ivl_max = FEED_RECONNECT_IVL_MAX_MS;
	zmq_setsockopt(e->sub, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
	zmq_setsockopt(e->sub, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof(ivl_max));
	if (zmq_setsockopt(e->sub, ZMQ_SUBSCRIBE, e->topic, strlen(e->topic)) != 0 ||
	    zmq_connect(e->sub, e->endpoint) != 0) {
		int rc = zmq_fail_code();
		ep_free(e);
		return rc;
	}
	if (e->replay) { /* checks the address now (its socket may be remade by a replay) */
		int rc = kvr_feed_dealer_open(f, e);
		if (rc) {
			ep_free(e);
			return rc;
		}
	}
	/* One count for the whole process, not per feed: with a count per feed, two feeds numbered
	 * their endpoints alike and a remove given the wrong feed's handle removed that feed's own
	 * endpoint (test_api_contract endpoint_ids_of_another_feed_are_refused).  After 2^32 adds
	 * the count wraps: an id still in use by this feed is skipped, and so is KVR_FEED_ALL. */
	do
		e->id = __atomic_fetch_add(&endpoints_added, 1, __ATOMIC_RELAXED);
	while (e->id == KVR_FEED_ALL || ep_find(f, e->id, NULL));
	f->eps[f->n_eps++] = e;
	*id = e->id;
	return 0;
}

static void stats_of(const struct ep *e, struct kvr_feed_stats *st)
{
	*st = e->st;
	st->other_medium_blocks = kvr_feed_other_blocks(e);
	st->next_seq = e->have_seq ? e->next_seq : 0;
}

static void exec_cmd(struct kvr_feed *f, struct cmd *c)
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
		/* A gap held for a replay turn is handled first, as it was before turns (the
		 * ranks are replayed, or reported and cleared), and what that posts applied
		 * before e is freed. */
		if (e->held) {
			kvr_feed_take_held(f, e);
			kvr_feed_settle(f);
			e = ep_find(f, c->id, &at); /* (callbacks cannot add or remove: found) */
		}
		f->n_missed -= kvr_feed_missed(e);
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

static void run_cmd(struct kvr_feed *f, struct cmd *c)
{
	/* What is posted is applied and counted before any command: stats are exact, and no
	 * posted buffer points at an endpoint a remove frees. */
	kvr_feed_settle(f);
	exec_cmd(f, c);
}

/* The feed whose thread this is: its callbacks (log, and the router's on_event_gap for the
 * gaps it reports) run here, and a call from them must not wait for this very thread. */
static _Thread_local struct kvr_feed *feed_self;

static void feed_free(struct kvr_feed *f);
static int feed_orphaned(const char *fn);
static void live_link(struct kvr_router *r, struct kvr_feed *f);
static void live_unlink(struct kvr_router *r, struct kvr_feed *f);

/* ---------------------------------------------------------------- calls between feeds */

/* Guards every feed's blocked_on: the wait-for graph of deferred calls (top of file), and the
 * records of waits between feeds' callbacks and replicas ("A feed's callback waiting for a
 * replica").  Taken only to add or remove one edge or record, never while waiting, and with no
 * other lock held but, in call(), the target's ctl_lock (taken first). */
static pthread_mutex_t wait_lock = PTHREAD_MUTEX_INITIALIZER;

void kvr_feed_fork(bool before)
{
	if (before)
		pthread_mutex_lock(&wait_lock);
	else
		pthread_mutex_unlock(&wait_lock);
}

/* A replica's handling thread (on_admit there) waiting in a call on feed; on its stack, in
 * rep_waiters while it waits.  A replica may have several such threads. */
struct rep_waiter {
	const struct kvr_replica *rep;
	const struct kvr_feed *feed;
	struct rep_waiter *next;
};
static struct rep_waiter *rep_waiters; /* under wait_lock */

/* Steps a walk of the graph takes at most.  Every edge a walk follows was added after a walk
 * that found it closes no cycle, so walks end; the bound only makes sure of it (a walk cut
 * short answers "not reached": whatever cycle lies ahead is another thread's to find). */
#define WAIT_WALK_MAX 4096u

static bool feed_walk(const struct kvr_feed *x, const void *target, unsigned *steps);

/* Whether a thread handling rep's deliveries waits, through the recorded edges, for target (a
 * feed's thread or a replica's handling).  Context: wait_lock held. */
static bool rep_walk(const struct kvr_replica *rep, const void *target, unsigned *steps)
{
	if ((const void *)rep == target)
		return true;
	for (const struct rep_waiter *w = rep_waiters; w && *steps < WAIT_WALK_MAX; w = w->next)
		if (w->rep == rep && feed_walk(w->feed, target, steps))
			return true;
	return false;
}

/* Whether x's thread waits, through the recorded edges, for target.  A feed's thread waits for
 * the replica it drains or stops; for the feed that holds its call (blocked_on: deferred, or
 * taken by that feed's loop); for the feed its call is pushed to, unless the call is a read and
 * that feed waits in a call of its own (serve_waiting answers reads at once).  Context:
 * wait_lock held. */
static bool feed_walk(const struct kvr_feed *x, const void *target, unsigned *steps)
{
	while (x && ++*steps < WAIT_WALK_MAX) {
		if ((const void *)x == target)
			return true;
		if (x->waits_replica)
			return rep_walk(x->waits_replica, target, steps);
		const struct kvr_feed *next = x->blocked_on;
		if (!next && (next = x->calling) && x->calling_read && next->calling)
			return false;
		x = next;
	}
	return false;
}

static bool feed_waits_for(const struct kvr_feed *x, const void *target)
{
	unsigned steps = 0;
	return feed_walk(x, target, &steps);
}

static bool rep_waits_for(const struct kvr_replica *rep, const void *target)
{
	unsigned steps = 0;
	return rep_walk(rep, target, &steps);
}

/* Reads (stats, other medium) are answered even by a feed waiting in a call of its own. */
static bool cmd_is_read(const struct cmd *c)
{
	return c->op == CMD_STATS || c->op == CMD_OTHER;
}

/* Wakes f's thread (its loop's poll, or its wait in call_from_feed).  Context: f->box_lock
 * held, so f is not freed under the write (its teardown takes the lock after box_closed). */
static void box_wake(struct kvr_feed *f)
{
	uint64_t one = 1;
	/* EAGAIN only at a count of 2^64 - 2: the fd is readable anyway */
	(void)!write(f->efd, &one, sizeof(one));
}

/* Hands c (pushed by another feed's thread) back to its caller with c->rc.  c may be gone once
 * this returns.  Ordering: done's release pairs with the acquire in call_from_feed; the caller
 * takes from->box_lock after it saw done, so this thread is out of `from` by then.  Context:
 * the target feed's thread, no lock held. */
static void box_answer(struct cmd *c)
{
	struct kvr_feed *from = c->from;
	/* Its caller waits for nobody now: the edge goes before the answer can be seen (once
	 * answered, this feed may be freed, and no walk may follow an edge to it). */
	pthread_mutex_lock(&wait_lock);
	from->calling = NULL;
	pthread_mutex_unlock(&wait_lock);
	pthread_mutex_lock(&from->box_lock);
	__atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);
	box_wake(from);
	pthread_mutex_unlock(&from->box_lock);
}

/* Takes everything f's box holds, oldest first (after clearing the eventfd: a push after the
 * read writes it again, so nothing pushed is left unseen).  Context: f's thread. */
static struct cmd *box_take(struct kvr_feed *f)
{
	uint64_t n;
	(void)!read(f->efd, &n, sizeof(n));
	pthread_mutex_lock(&f->box_lock);
	struct cmd *c = f->box, *fifo = NULL;
	f->box = NULL;
	pthread_mutex_unlock(&f->box_lock);
	while (c) {
		struct cmd *next = c->next;
		c->next = fifo;
		fifo = c;
		c = next;
	}
	return fifo;
}

/* Drops the edge of c's caller (its call is answered now). */
static void unblock(struct cmd *c)
{
	pthread_mutex_lock(&wait_lock);
	c->from->blocked_on = NULL;
	pthread_mutex_unlock(&wait_lock);
}

/* The box's commands, f's thread in its loop: run as from an ordinary thread (settled, exact).
 * Their callers wait for this loop from the moment it takes them, as deferred callers do, and
 * the graph says so: run_cmd's settle can run f's callbacks (a refusal logged, a loss reported
 * through on_event_gap), and an add or remove from there on one of these callers must be
 * refused (KVR_EBUSY), not deferred to a loop that waits for f's answer (it was: both waited
 * for good; test_feed_crossserve).  No cycle is closed here: f is in its loop, waiting for
 * nobody (f->blocked_on is NULL).  Context: f's thread, in feed_main's loop. */
static void serve_box(struct kvr_feed *f)
{
	struct cmd *fifo = box_take(f);
	if (!fifo)
		return;
	pthread_mutex_lock(&wait_lock);
	for (struct cmd *c = fifo; c; c = c->next)
		c->from->blocked_on = f;
	pthread_mutex_unlock(&wait_lock);
	for (struct cmd *c = fifo, *next; c; c = next) {
		next = c->next;
		run_cmd(f, c);
		unblock(c);
		box_answer(c);
	}
}

/* Runs what was deferred while f's thread waited in a callback.  Context: f's thread, back in
 * feed_main's loop. */
static void run_deferred(struct kvr_feed *f)
{
	while (f->deferred) {
		struct cmd *c = f->deferred;
		if (!(f->deferred = c->next))
			f->deferred_tail = &f->deferred;
		run_cmd(f, c);
		unblock(c);
		box_answer(c);
	}
}

/* The box's commands while f's thread, in one of its callbacks, waits for another feed: reads
 * at once, as a self-call; add and remove deferred to the loop unless that would close a cycle
 * of deferred calls (then KVR_EBUSY).  Context: f's thread, in call_from_feed. */
static void serve_waiting(struct kvr_feed *f)
{
	for (struct cmd *c = box_take(f), *next; c; c = next) {
		next = c->next;
		if (cmd_is_read(c)) {
			exec_cmd(f, c);
			box_answer(c);
			continue;
		}
		/* c->from would wait for f's loop, which waits for f's own call: for the feed that
		 * holds it deferred, and so on.  If that chain reaches c->from, nobody would ever
		 * move.  The graph is acyclic before (every edge was added this way, under the
		 * lock), so the walk ends. */
		pthread_mutex_lock(&wait_lock);
		bool cycle = feed_waits_for(f, c->from);
		if (!cycle)
			c->from->blocked_on = f;
		pthread_mutex_unlock(&wait_lock);
		if (cycle) {
			c->rc = KVR_EBUSY;
			box_answer(c);
			continue;
		}
		c->next = NULL;
		*f->deferred_tail = c;
		f->deferred_tail = &c->next;
	}
}

/* f's thread leaves its loop for good: what its box and deferred list hold, and whatever is
 * pushed later, is answered KVR_ESHUTDOWN.  Context: f's thread, after its loop. */
static void box_close(struct kvr_feed *f)
{
	pthread_mutex_lock(&f->box_lock);
	f->box_closed = true;
	pthread_mutex_unlock(&f->box_lock);
	for (struct cmd *c = box_take(f), *next; c; c = next) {
		next = c->next;
		c->rc = KVR_ESHUTDOWN;
		box_answer(c);
	}
	while (f->deferred) {
		struct cmd *c = f->deferred;
		f->deferred = c->next;
		c->rc = KVR_ESHUTDOWN;
		unblock(c);
		box_answer(c);
	}
	f->deferred_tail = &f->deferred;
}

/* call_from_feed's wait for c's answer, serving self's box meanwhile. */
static int call_wait(struct kvr_feed *self, struct cmd *c)
{
	struct pollfd p = {.fd = self->efd, .events = POLLIN};
	/* Ordering: acquire; pairs with box_answer's release. */
	while (!__atomic_load_n(&c->done, __ATOMIC_ACQUIRE)) {
		poll(&p, 1, -1); /* EINTR: look again */
		serve_waiting(self);
	}
	/* box_answer sets done under self's box_lock: once this thread has had it, the answering
	 * thread is out of self and c. */
	pthread_mutex_lock(&self->box_lock);
	pthread_mutex_unlock(&self->box_lock);
	return c->rc;
}

/* A call on f from the thread of another feed, self (in one of self's callbacks): pushed to f's
 * box, its answer awaited while self's box is served (serve_waiting).  Returns c->rc, or
 * KVR_ESHUTDOWN when f's thread has left its loop.  Context: self's thread. */
static int call_from_feed(struct kvr_feed *self, struct kvr_feed *f, struct cmd *c)
{
	c->from = self;
	/* The edge first, and refused if it closes a cycle: f waits for a replica whose handling
	 * thread waits for this feed, directly or through other feeds.  A read that f, waiting in a
	 * call of its own, answers at once waits for nobody. */
	bool read = cmd_is_read(c);
	pthread_mutex_lock(&wait_lock);
	self->calling = f;
	self->calling_read = read;
	bool cycle = !(read && f->calling) && feed_waits_for(f, self);
	if (cycle)
		self->calling = NULL;
	pthread_mutex_unlock(&wait_lock);
	if (cycle)
		return KVR_EBUSY;
	pthread_mutex_lock(&f->box_lock);
	bool open = !f->box_closed;
	if (open) {
		c->next = f->box;
		f->box = c;
		box_wake(f);
	} else {
		/* f may be freed once box_lock is let go: the edge goes first (box_answer drops it
		 * for a call that was pushed).  The only place wait_lock is taken under another
		 * feed lock than ctl_lock. */
		pthread_mutex_lock(&wait_lock);
		self->calling = NULL;
		pthread_mutex_unlock(&wait_lock);
	}
	pthread_mutex_unlock(&f->box_lock);
	return open ? call_wait(self, c) : KVR_ESHUTDOWN;
}

/* Whether the loop is to end: a kvr_feed_destroy (CMD_STOP, or marked by a destroy that does
 * not wait for this thread). */
static bool halted(const struct kvr_feed *f)
{
	return f->stop || kvr_feed_dying(f);
}

/* ZeroMQ's blocking calls return -1 with EINTR when a signal interrupts them, having done
 * nothing: on an embedder's thread that takes signals (a profiler's SIGPROF at 100 Hz or more,
 * a SIGALRM timer), call() took that for an answer.  A stop never sent left kvr_feed_destroy
 * joining a thread that never stopped; an answer never read left the feed's thread writing the
 * reply into the caller's returned stack frame, and the next call reading the stale answer
 * (tests/unit/test_signal_storm.c).  These retry. */
static int z_send(void *sock, const void *buf, size_t len)
{
	int n;
	do
		n = zmq_send(sock, buf, len, 0);
	while (n < 0 && zmq_errno() == EINTR);
	return n;
}

/* zmq_bind or zmq_connect (op), which first process the socket's pending commands and return
 * EINTR, having bound nothing, when a signal interrupts that: kvr_feed_create failed under
 * signals as if ZeroMQ could not start. */
static int z_bind(void *sock, const char *addr, int (*op)(void *, const char *))
{
	int rc;
	do
		rc = op(sock, addr);
	while (rc != 0 && zmq_errno() == EINTR);
	return rc;
}

static int z_recv(void *sock, void *buf, size_t len, int flags)
{
	int n;
	do
		n = zmq_recv(sock, buf, len, flags);
	while (n < 0 && zmq_errno() == EINTR);
	return n;
}

static void *feed_main(void *arg)
{
	struct kvr_feed *f = arg;
	feed_self = f;
	kvr_router_cb_self = f->r; /* kvr_router_destroy refuses to run here */
	f->mb = kvr_metrics_local(f->r->metrics);
	while (!halted(f)) {
		/* Other feeds' add / remove that came while a callback of this one waited. */
		run_deferred(f);
		/* A new round, ended by one replay at most (sync/feed_seq.c, "Replays take
		 * turns"). */
		f->replayed = false;
		/* [control, every SUB, every SUB's monitor, the box] */
		uint32_t ne = f->n_eps, n = 2 * ne + 2;
		/* A replay waits for its turn (the next round's end): no blocking. */
		bool held = f->resync_ticket != 0;
		f->items[0] = (zmq_pollitem_t){.socket = f->ctl_server, .events = ZMQ_POLLIN};
		for (uint32_t i = 0; i < ne; i++) {
			held |= f->eps[i]->held;
			f->items[1 + i] =
			    (zmq_pollitem_t){.socket = f->eps[i]->sub, .events = ZMQ_POLLIN};
			f->items[1 + ne + i] =
			    (zmq_pollitem_t){.socket = f->eps[i]->mon, .events = ZMQ_POLLIN};
		}
		f->items[n - 1] = (zmq_pollitem_t){.fd = f->efd, .events = ZMQ_POLLIN};
		/* Poll without blocking for idle_spin_ns first: the next batch then costs no
		 * wake-up of this thread (the shards do the same, shard_idle_spin_ns). */
		int ready = 0;
		/* A rank added since the last look: no blocking (its eventfd count may have been
		 * taken by another read of efd). */
		bool added = __atomic_load_n(&f->ranks_added, __ATOMIC_ACQUIRE) != 0;
		if (f->cfg.idle_spin_ns && !added && !held) {
			/* At most until the next look for added ranks (below), and saturated: a
			 * spin of hours, which the setting allows, kept ranks added while the
			 * publisher was quiet from their resync (test_feed_limits). */
			uint64_t spin = f->cfg.idle_spin_ns, t0 = kvr_feed_mono_ns();
			if (f->n_missed && spin > 10000000u)
				spin = 10000000u;
			uint64_t end = t0 + spin < t0 ? UINT64_MAX : t0 + spin;
			while ((ready = zmq_poll(f->items, (int)n, 0)) == 0 &&
			       kvr_feed_mono_ns() < end)
				;
		}
		/* While ranks wait to be added, look every 10 ms too: an add wakes the feed
		 * (kvr_feeds_rank_added); the look is the fallback it was before, and costs only
		 * while some rank is missed. */
		long wait_ms = added || held ? 0 : f->n_missed ? 10 : -1;
		if (ready == 0 && zmq_poll(f->items, (int)n, wait_ms) < 0) {
			if (zmq_errno() == ETERM)
				break;
			continue;
		}
		/* Read now: a command below may grow (move) items. */
		bool box_ready = f->items[n - 1].revents & ZMQ_POLLIN;
		/* Endpoints first: a command may remove one and reshuffle the array.  A
		 * disconnection before the messages (kvr_feed_monitor drains what came before
		 * it; sync/feed_seq.c, "Restarts across a reconnection"). */
		for (uint32_t i = 0; i < ne && !halted(f); i++) {
			if (f->items[1 + ne + i].revents & ZMQ_POLLIN)
				kvr_feed_monitor(f, f->eps[i]);
			if (f->items[1 + i].revents & ZMQ_POLLIN)
				kvr_feed_drain(f, f->eps[i]);
		}
		/* Ranks removed and added back while their publisher was quiet: nothing but the
		 * add tells the feed (the flag taken before the look: an add during it sets it
		 * again, and the next poll does not block). */
		if (__atomic_load_n(&f->ranks_added, __ATOMIC_RELAXED) &&
		    __atomic_exchange_n(&f->ranks_added, 0, __ATOMIC_ACQUIRE) && !halted(f))
			kvr_feed_note_lives(f);
		if ((f->n_missed || f->resync_ticket) && !halted(f))
			kvr_feed_resync_added(f);
		if (f->items[0].revents & ZMQ_POLLIN && !halted(f)) {
			struct cmd *c;
			if (z_recv(f->ctl_server, &c, sizeof(c), 0) == (int)sizeof(c) &&
			    __atomic_load_n(&c->posted, __ATOMIC_ACQUIRE)) {
				run_cmd(f, c);
				__atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);
				z_send(f->ctl_server, "", 0);
			}
		}
		if (box_ready && !halted(f))
			serve_box(f);
		/* Everything served: the round's replay, if one waits (a gap's batch held, ranks
		 * added late). */
		if (!halted(f))
			kvr_feed_turn(f);
	}
	/* A gap held for a replay turn: given up as any replay a destroy ends (the ranks it may
	 * have left short cleared, unreported), and applied before the thread ends, as what a
	 * stop command found posted was (run_cmd). */
	for (uint32_t i = 0; i < f->n_eps; i++)
		if (f->eps[i]->held) {
			kvr_feed_take_held(f, f->eps[i]);
			kvr_feed_settle(f);
		}
	/* Other feeds' calls still waiting get KVR_ESHUTDOWN, as do later ones. */
	box_close(f);
	if (kvr_feed_dying(f)) {
		/* Destroyed from one of its callbacks, or from another thread of the library that
		 * must not wait for this one: nobody joins this thread.  What was posted
		 * to the shards is applied first (their tasks point into f's buffers, and the
		 * router must outlive them); then the router is let go, and f freed. */
		pthread_detach(pthread_self());
		kvr_feed_settle(f);
		/* A call from another thread racing the destroy (kvrouter.h forbids it) waits
		 * inside call() for an answer: it gets KVR_ESHUTDOWN rather than a freed socket.
		 * Taking ctl_lock also orders every call that returned before the free (the
		 * inproc pipe's ordering is invisible to ThreadSanitizer).  (A destroy from a
		 * library thread is ordered by box_close, which took box_lock after it.) */
		while (pthread_mutex_trylock(&f->ctl_lock) != 0) {
			struct cmd *c;
			/* (an empty message is not a call) */
			if (z_recv(f->ctl_server, &c, sizeof(c), ZMQ_DONTWAIT) == (int)sizeof(c) &&
			    __atomic_load_n(&c->posted, __ATOMIC_ACQUIRE)) {
				c->rc = KVR_ESHUTDOWN;
				__atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);
				z_send(f->ctl_server, "", 0);
			}
			struct timespec ts = {0, 1000000};
			nanosleep(&ts, NULL);
		}
		pthread_mutex_unlock(&f->ctl_lock);
		struct kvr_router *r = f->r;
		f->started = false;
		feed_free(f);
		/* Ordering: release, this thread's last access to the router; pairs with the
		 * acquire in kvr_router_destroy. */
		__atomic_sub_fetch(&r->feeds_closing, 1, __ATOMIC_RELEASE);
	}
	kvr_rcu_thread_offline();
	return NULL;
}

/* ---------------------------------------------------------------- a feed's callback waiting for a
 * replica */

/*
 * A feed's callback may wait for a replica (kvr_sync_drain, kvr_sync_wait_ready: until the
 * replica's handling thread has applied what it received; kvr_sync_detach, kvr_replica_stop /
 * _destroy: until it has ended), and that thread's callbacks (on_admit there) may call on a
 * feed: from an ordinary thread, so the call waits for that feed's loop.  On this feed, it waits
 * for the callback to return: each waited for the other until the drain's timeout (for good:
 * the stop).  Through other feeds too: the handling thread's call on feed G waits for G's loop
 * while G's callback calls this feed, whose thread serves nothing while it waits for the
 * replica (test_feed_replicacycle).  So these waits are edges of the wait-for graph the deferred
 * calls form (top of file), under wait_lock: a feed's thread waiting for a replica
 * (waits_replica), a handling thread waiting in a call on a feed (a rep_waiter), and a feed's
 * thread waiting in a call on another feed (calling; not an edge when it is a read and that
 * feed waits in a call of its own, which answers reads).  Each is added after a walk from its
 * target (feed_waits_for): one that would reach the waiting thread again is refused with
 * KVR_EBUSY at once, and the others go on once it has returned.  A replica's thread waiting for
 * anything else (another replica, a shard) is not an edge here.  kvr_sync_detach and
 * kvr_replica_stop / _destroy, which have no code to return, do nothing when refused
 * (sync/replica.c).
 */
int kvr_feed_wait_replica_begin(const struct kvr_replica *rep)
{
	struct kvr_feed *f = feed_self;
	if (!f)
		return 0;
	pthread_mutex_lock(&wait_lock);
	bool busy = rep_waits_for(rep, f);
	if (!busy)
		f->waits_replica = rep;
	pthread_mutex_unlock(&wait_lock);
	return busy ? KVR_EBUSY : 0;
}

void kvr_feed_wait_replica_end(void)
{
	struct kvr_feed *f = feed_self;
	if (!f)
		return;
	pthread_mutex_lock(&wait_lock);
	f->waits_replica = NULL;
	pthread_mutex_unlock(&wait_lock);
}

/* A call on w->feed from a thread handling w->rep's deliveries: refused (false) while that
 * feed's thread waits for the replica, directly or through other feeds and replicas, else w
 * recorded until rep_unwait.  Context: the calling thread. */
static bool rep_wait(struct rep_waiter *w)
{
	pthread_mutex_lock(&wait_lock);
	bool ok = !feed_waits_for(w->feed, w->rep);
	if (ok) {
		w->next = rep_waiters;
		rep_waiters = w;
	}
	pthread_mutex_unlock(&wait_lock);
	return ok;
}

static void rep_unwait(struct rep_waiter *w)
{
	pthread_mutex_lock(&wait_lock);
	struct rep_waiter **p = &rep_waiters;
	while (*p != w)
		p = &(*p)->next;
	*p = w->next;
	pthread_mutex_unlock(&wait_lock);
}

static int call(struct kvr_feed *f, struct cmd *c)
{
	if (feed_self == f) {
		/* From one of its callbacks: waiting for the feed thread would wait for ever.
		 * Reads run here, as of now (what is pending for the shards not yet counted);
		 * add and remove would change the endpoints under the caller's feet. */
		if (!cmd_is_read(c))
			return KVR_EBUSY;
		exec_cmd(f, c);
		return c->rc;
	}
	if (feed_self)
		return call_from_feed(feed_self, f, c); /* another feed's callback */
	/* A shard thread (the router's clock runs there): f's loop settles before every command,
	 * i.e. waits for the shards to apply what it posted them, this one included, which would
	 * wait for this call: refused, as a feed's callback's call that would close a cycle. */
	if (kvr_shard_current())
		return KVR_EBUSY;
	/* A replica's handling thread (on_admit there): not while f's callback waits for that
	 * replica ("A feed's callback waiting for a replica" above). */
	struct rep_waiter w = {.rep = kvr_replica_handling_now(), .feed = f};
	if (w.rep && !rep_wait(&w))
		return KVR_EBUSY;
	pthread_mutex_lock(&f->ctl_lock);
	int rc = KVR_ESHUTDOWN;
	char ack;
	__atomic_store_n(&c->posted, 1, __ATOMIC_RELEASE);
	if (z_send(f->ctl_client, &c, sizeof(c)) == (int)sizeof(c) &&
	    z_recv(f->ctl_client, &ack, 1, 0) >= 0 && __atomic_load_n(&c->done, __ATOMIC_ACQUIRE))
		rc = c->rc;
	/* Before ctl_lock: a feed tearing itself down frees f once it has that lock. */
	if (w.rep)
		rep_unwait(&w);
	pthread_mutex_unlock(&f->ctl_lock);
	return rc;
}

/* ---------------------------------------------------------------- API */

/* The detail of a code the feed's thread answered (core/error.h); ep: kvr_feed_add's. */
static __attribute__((cold, noinline)) int feed_fail(int rc, const char *fn, uint32_t id,
                                                     const struct kvr_feed_endpoint *ep)
{
	switch (rc) {
	case KVR_EINVAL: /* add: ZeroMQ refused an address */
		if (!ep)
			break;
		return kvr_fail(
		    rc,
		    "%s: ZeroMQ refused endpoint \"%s\"%s%s%s (not a tcp://, ipc:// "
		    "or inproc:// address it can connect to%s)",
		    fn, ep->endpoint, ep->replay_endpoint ? " or replay_endpoint \"" : "",
		    ep->replay_endpoint ? ep->replay_endpoint : "", ep->replay_endpoint ? "\"" : "",
		    /* vLLM binds its publisher to tcp://(star):5557 by default */
		    strstr(ep->endpoint, "://*") ||
		            (ep->replay_endpoint && strstr(ep->replay_endpoint, "://*"))
		        ? "; '*' is where a publisher binds: connect to the worker's "
		          "host, e.g. tcp://HOST:5557"
		        : "");
	case KVR_ENOMEM: /* add: memory, or ZeroMQ's sockets (zmq_fail_code) */
		if (!ep)
			break;
		return kvr_fail(rc,
		                "%s: out of memory or of sockets: ZeroMQ allows 1,023 a feed (it "
		                "closes removed endpoints' in the background: retry), within the "
		                "process's descriptor limit (RLIMIT_NOFILE)",
		                fn);
	case KVR_ENOENT:
		return kvr_fail(rc, "%s: the feed has no endpoint id %" PRIu32, fn, id);
	case KVR_EBUSY:
		return kvr_fail(rc,
		                "%s: waiting would close a cycle: from the feed's own callback "
		                "(add, remove), from a thread its callback waits for (a feed's "
		                "callback, a replica's thread, directly or not), or on a shard "
		                "thread (the router's clock)",
		                fn);
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "%s: the feed is being destroyed (or was, under this call)",
		                fn);
	}
	return kvr_fail_code(rc, fn);
}

/* The detail of a call on a feed inherited through fork (core/fork.h). */
static __attribute__((cold, noinline)) int feed_inherited(const char *fn)
{
	return kvr_fail(KVR_ESHUTDOWN,
	                "%s: the feed was created before this process forked (its threads stayed "
	                "in the parent): a forked child creates its own router and feed",
	                fn);
}

/*
 * Descriptors ZeroMQ takes when a context starts (at its first socket): its term, reaper and I/O
 * thread mailboxes (eventfds), the reaper's and the I/O thread's epoll, the feed's two control
 * sockets' mailboxes: 7 with libzmq 4.3, and some room for other versions.  libzmq calls abort()
 * when its poller's epoll_create1 fails ("Too many open files (src/epoll.cpp:65)"): a process at
 * its RLIMIT_NOFILE died in kvr_feed_create (tests/unit/test_fd_limit.c).
 */
#define ZMQ_START_FDS 12

/* True if ZMQ_START_FDS more descriptors can be opened now (each a dup of fd, all closed again).
 * Another thread may take them before ZeroMQ does: this turns a process that is at its limit
 * into an error, not every race with one that is reaching it. */
static bool spare_fds(int fd)
{
	int fds[ZMQ_START_FDS], n = 0;
	while (n < ZMQ_START_FDS && (fds[n] = fcntl(fd, F_DUPFD_CLOEXEC, 0)) >= 0)
		n++;
	for (int i = 0; i < n; i++)
		close(fds[i]);
	return n == ZMQ_START_FDS;
}

/* ZeroMQ's reaper and I/O threads, started with its context: libzmq calls abort() when
 * pthread_create fails for one ("Resource temporarily unavailable (src/thread.cpp:...)"), so a
 * process at its thread limit (a container's pids.max) died in kvr_feed_create. */
#define ZMQ_START_THREADS 2

static void *probe_main(void *arg)
{
	pthread_mutex_t *m = arg; /* held by spare_threads until every probe has started */
	pthread_mutex_lock(m);
	pthread_mutex_unlock(m);
	return NULL;
}

/* True if ZMQ_START_THREADS more threads can run at once now: started together, held until all
 * are up, then joined.  Like spare_fds, it catches a process at its limit, not a race. */
static bool spare_threads(void)
{
	pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
	pthread_t t[ZMQ_START_THREADS];
	int n = 0;
	pthread_mutex_lock(&m);
	while (n < ZMQ_START_THREADS && kvr_thread_start(&t[n], false, probe_main, &m) == 0)
		n++;
	pthread_mutex_unlock(&m);
	for (int i = 0; i < n; i++)
		pthread_join(t[i], NULL);
	pthread_mutex_destroy(&m);
	return n == ZMQ_START_THREADS;
}

int kvr_feed_create(struct kvr_router *r, const struct kvr_feed_config *cfg, struct kvr_feed **out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (out)
		*out = NULL; /* as kvr_router_create and kvr_sync_attach: NULL on every failure */
	if (!r || !out || r->cfg.mode != KVR_MODE_EVENTS)
		return kvr_fail(KVR_EINVAL, "kvr_feed_create: %s",
		                !r     ? "router is NULL"
		                : !out ? "out is NULL"
		                       : "the router's mode is not KVR_MODE_EVENTS (a feed applies "
		                         "engine events)");
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "kvr_feed_create: %s", kvr_router_gone(r));
	struct kvr_feed_config c;
	if (cfg)
		c = *cfg;
	else
		kvr_feed_config_init(&c);
	if (c.replay_timeout_ms == 0 || c.max_msg_bytes < 1024 || c.max_msg_bytes > INT64_MAX ||
	    c.rcv_hwm == 0)
		return kvr_feed_config_check(&c, "kvr_feed_create");
	struct kvr_feed *f = kvr_calloc(1, sizeof(*f));
	if (!f)
		return kvr_fail(KVR_ENOMEM, "kvr_feed_create: out of memory for the feed");
	f->r = r;
	f->pend = &f->bufs[0];
	f->cfg = c;
	pthread_mutex_init(&f->ctl_lock, NULL);
	pthread_mutex_init(&f->box_lock, NULL);
	f->deferred_tail = &f->deferred;
	f->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if ((f->efd < 0 && (errno == EMFILE || errno == ENFILE)) ||
	    (f->efd >= 0 && !spare_fds(f->efd))) {
		kvr_feed_destroy(f);
		return kvr_fail(KVR_ENOMEM,
		                "kvr_feed_create: too many open file descriptors (the process's "
		                "RLIMIT_NOFILE, or the system's): a feed takes %d (ZeroMQ's start, "
		                "which aborts without them, and its own)",
		                ZMQ_START_FDS + 1);
	}
	if (f->efd < 0 || kvr_feed_grow((void **)&f->items, &f->cap_items, 2, sizeof(*f->items)))
		goto fail;
	if (!spare_threads()) {
		kvr_feed_destroy(f);
		return kvr_fail(KVR_ENOMEM,
		                "kvr_feed_create: could not start a thread (the process's thread "
		                "limit): ZeroMQ's start takes %d, and aborts without them",
		                ZMQ_START_THREADS);
	}
	/* ZeroMQ starts its I/O and reaper threads at the context's first socket, with this
	 * thread's signal mask, and blocks signals only once each runs: a process-directed signal
	 * meanwhile (the embedder's SIGTERM, blocked on its own threads) could land on one and end
	 * the process (test_signals, once in CI on a loaded machine).  Started with every
	 * asynchronous signal blocked instead, as the library's own threads (sync/thread.h). */
	sigset_t sigs;
	kvr_thread_defer_signals(&sigs);
	f->zctx = zmq_ctx_new();
	char name[64];
	snprintf(name, sizeof(name), "inproc://kvr-feed-%p", (void *)f);
	f->ctl_server = f->zctx ? zmq_socket(f->zctx, ZMQ_PAIR) : NULL;
	f->ctl_client = f->zctx ? zmq_socket(f->zctx, ZMQ_PAIR) : NULL;
	kvr_thread_restore_signals(&sigs);
	if (!f->zctx)
		goto fail;
	if (!f->ctl_server || !f->ctl_client || z_bind(f->ctl_server, name, zmq_bind) != 0 ||
	    z_bind(f->ctl_client, name, zmq_connect) != 0)
		goto fail;
	if (kvr_thread_start(&f->thread, false, feed_main, f) != 0)
		goto fail;
	f->started = true;
	live_link(r, f);
	*out = f;
	return 0;
fail:
	kvr_feed_destroy(f);
	return kvr_fail(KVR_ENOMEM,
	                "kvr_feed_create: out of memory, or ZeroMQ or the feed's thread could "
	                "not start");
}

int kvr_feed_add(struct kvr_feed *f, const struct kvr_feed_endpoint *ep, uint32_t *id_out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!f || !ep || !ep->endpoint || !ep->endpoint[0])
		return kvr_fail(KVR_EINVAL, "kvr_feed_add: %s",
		                !f              ? "feed is NULL"
		                : !ep           ? "ep is NULL"
		                : !ep->endpoint ? "ep->endpoint is NULL"
		                                : "ep->endpoint is \"\"");
	int bad = kvr_feed_endpoint_check(ep->endpoint, "ep->endpoint", "kvr_feed_add");
	if (!bad)
		bad = kvr_feed_endpoint_check(ep->replay_endpoint, "ep->replay_endpoint",
		                              "kvr_feed_add");
	if (bad)
		return bad;
	if (f->orphaned)
		return feed_orphaned("kvr_feed_add");
	if (kvr_fork_inherited(f->r))
		return feed_inherited("kvr_feed_add");
	struct cmd c = {.op = CMD_ADD, .ep = ep};
	int rc = call(f, &c);
	if (rc == 0 && id_out)
		*id_out = c.id;
	return rc ? feed_fail(rc, "kvr_feed_add", 0, ep) : 0;
}

int kvr_feed_remove(struct kvr_feed *f, uint32_t id)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!f)
		return kvr_fail(KVR_EINVAL, "kvr_feed_remove: feed is NULL");
	if (f->orphaned)
		return feed_orphaned("kvr_feed_remove");
	if (kvr_fork_inherited(f->r))
		return feed_inherited("kvr_feed_remove");
	struct cmd c = {.op = CMD_REMOVE, .id = id};
	int rc = call(f, &c);
	return rc ? feed_fail(rc, "kvr_feed_remove", id, NULL) : 0;
}

int kvr_feed_get_stats(struct kvr_feed *f, uint32_t id, struct kvr_feed_stats *out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!f || !out)
		return kvr_fail(KVR_EINVAL, "kvr_feed_get_stats: %s is NULL", !f ? "feed" : "out");
	if (f->orphaned)
		return feed_orphaned("kvr_feed_get_stats");
	if (kvr_fork_inherited(f->r))
		return feed_inherited("kvr_feed_get_stats");
	struct cmd c = {.op = CMD_STATS, .id = id, .stats = out};
	int rc = call(f, &c);
	return rc ? feed_fail(rc, "kvr_feed_get_stats", id, NULL) : 0;
}

int kvr_feed_other_medium_blocks(struct kvr_feed *f, uint32_t id, uint32_t dp_rank, uint64_t *out,
                                 size_t cap, size_t *n_out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!f || !n_out || (!out && cap))
		return kvr_fail(KVR_EINVAL, "kvr_feed_other_medium_blocks: %s",
		                !f       ? "feed is NULL"
		                : !n_out ? "n_out is NULL"
		                         : "out is NULL with cap > 0");
	*n_out = 0; /* as kvr_rank_blocks and the build without ZeroMQ: none on a failure */
	if (f->orphaned)
		return feed_orphaned("kvr_feed_other_medium_blocks");
	if (kvr_fork_inherited(f->r))
		return feed_inherited("kvr_feed_other_medium_blocks");
	struct cmd c = {.op = CMD_OTHER, .id = id, .dp = dp_rank, .out = out, .cap = cap};
	int rc = call(f, &c);
	if (rc == 0 || rc == KVR_ERANGE)
		*n_out = c.n;
	if (rc == KVR_ERANGE)
		return kvr_fail(rc, "kvr_feed_other_medium_blocks: cap %zu is below the %zu blocks",
		                cap, c.n);
	return rc ? feed_fail(rc, "kvr_feed_other_medium_blocks", id, NULL) : 0;
}

/* Hands f's teardown to its own thread (feed_main frees it, detached): counted in the router's
 * feeds_closing first, which kvr_router_destroy waits for.  Context: the destroying thread. */
static void mark_dying(struct kvr_feed *f)
{
	/* Ordering: relaxed: a kvr_router_destroy after kvr_feed_destroy is ordered after it by
	 * whatever told its caller that the destroy had returned; the feed thread's decrement
	 * follows its acquire of dying, so it comes after this increment. */
	__atomic_add_fetch(&f->r->feeds_closing, 1, __ATOMIC_RELAXED);
	/* Ordering: release; pairs with kvr_feed_dying's acquire on the feed's thread. */
	__atomic_store_n(&f->dying, 1, __ATOMIC_RELEASE);
}

/* Stops f's thread (what it posted is applied first) and joins it.  The flag ends a replay it
 * may be waiting for, which does not read the stop command (sync/feed_seq.c).  Context: a
 * thread the library does not run (the destroy's caller). */
static void stop_and_join(struct kvr_feed *f)
{
	__atomic_store_n(&f->stopping, 1, __ATOMIC_RELEASE);
	struct cmd c = {.op = CMD_STOP};
	call(f, &c);
	pthread_join(f->thread, NULL);
}

/* Whether the calling thread is one the library runs (a feed's, a replica's, a shard's) or is
 * inside a router callback.  A destroy there must not wait for a feed's thread: that thread may
 * be waiting for this one (two feeds' callbacks destroying each other; a feed thread's callback
 * draining the replica whose apply thread calls; a feed thread settling what it posted to the
 * shard that calls).  Context: any thread. */
static bool on_library_thread(void)
{
	return feed_self || kvr_router_cb_self || kvr_shard_current();
}

void kvr_feed_destroy(struct kvr_feed *f)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!f)
		return;
	if (f->orphaned) { /* released by kvr_router_destroy: the handle is all that is left */
		kvr_free(f, sizeof(*f));
		return;
	}
	/* Created before this process forked (core/fork.h): its thread and ZeroMQ's stayed in
	 * the parent; left as it is, as its router is. */
	if (kvr_fork_inherited(f->r))
		return;
	live_unlink(f->r, f);
	if (feed_self == f) {
		/* From one of its callbacks, on its own thread: it cannot join itself, and its
		 * caller still runs on f.  So mark it; the thread stops taking messages and
		 * commands, returns through the callback's caller to its loop, and frees f there
		 * (feed_main).  A second call from a callback meanwhile is a no-op. */
		if (!kvr_feed_dying(f)) {
			f->stop = true;
			mark_dying(f);
		}
		return;
	}
	if (f->started && on_library_thread()) {
		/* From another feed's thread, a replica's, a shard's or a router callback: f's
		 * thread may be waiting for this one (kvrouter.h), so it is not joined either.
		 * Marked, and its poll woken through its box's eventfd (under box_lock, a leaf:
		 * not ctl_lock, which an ordinary caller waiting for f may hold while f waits for
		 * this thread); it tears itself down as above once it is back in its loop (at once
		 * if idle; after the callback or replay it is running otherwise). */
		pthread_mutex_lock(&f->box_lock);
		if (!kvr_feed_dying(f)) {
			mark_dying(f);
			box_wake(f);
		}
		pthread_mutex_unlock(&f->box_lock);
		return;
	}
	if (f->started)
		stop_and_join(f);
	feed_free(f);
}

/* Everything but the thread (stopped, or this one exiting) and the handle itself. */
static void feed_release(struct kvr_feed *f)
{
	for (uint32_t i = 0; i < f->n_eps; i++)
		ep_free(f->eps[i]);
	if (f->ctl_client)
		zmq_close(f->ctl_client);
	if (f->ctl_server)
		zmq_close(f->ctl_server);
	/* Restartable: EINTR under a signal left the context (its two threads) behind. */
	while (f->zctx && zmq_ctx_term(f->zctx) != 0 && zmq_errno() == EINTR)
		;
	kvr_feed_batch_fini(&f->live);
	kvr_feed_batch_fini(&f->rep);
	kvr_free(f->eps, (size_t)f->cap_eps * sizeof(*f->eps));
	kvr_free(f->items, (size_t)f->cap_items * sizeof(*f->items));
	kvr_feed_pending_fini(&f->bufs[0]);
	kvr_feed_pending_fini(&f->bufs[1]);
	pthread_mutex_destroy(&f->ctl_lock);
	pthread_mutex_destroy(&f->box_lock);
	if (f->efd >= 0)
		close(f->efd);
}

static void feed_free(struct kvr_feed *f)
{
	feed_release(f);
	kvr_free(f, sizeof(*f));
}

/* f joins (r: its router) or leaves the router's list of feeds not destroyed yet. */
static void live_link(struct kvr_router *r, struct kvr_feed *f)
{
	pthread_mutex_lock(&r->feeds_lock);
	f->live_next = r->feeds;
	if (r->feeds)
		r->feeds->live_pprev = &f->live_next;
	f->live_pprev = &r->feeds;
	r->feeds = f;
	pthread_mutex_unlock(&r->feeds_lock);
}

static void live_unlink(struct kvr_router *r, struct kvr_feed *f)
{
	pthread_mutex_lock(&r->feeds_lock);
	if (f->live_pprev) {
		*f->live_pprev = f->live_next;
		if (f->live_next)
			f->live_next->live_pprev = f->live_pprev;
		f->live_pprev = NULL;
		f->live_next = NULL;
	}
	pthread_mutex_unlock(&r->feeds_lock);
}

/* A feed in r's list is not released yet (kvr_feed_destroy and kvr_feeds_orphan unlink it
 * before): its efd is open while feeds_lock is held. */
void kvr_feeds_rank_added(struct kvr_router *r)
{
	pthread_mutex_lock(&r->feeds_lock);
	for (struct kvr_feed *f = r->feeds; f; f = f->live_next) {
		__atomic_store_n(&f->ranks_added, 1, __ATOMIC_RELEASE);
		uint64_t one = 1;
		/* EAGAIN only at a count of 2^64 - 2: the fd is readable anyway */
		(void)!write(f->efd, &one, sizeof(one));
	}
	pthread_mutex_unlock(&r->feeds_lock);
}

/* Its stop, as kvr_feed_destroy's from an ordinary thread (what it posted is applied first,
 * run_cmd), then everything but the handle.  Before, a feed left alive read the freed router
 * (its metrics, its shards) and kvr_feed_destroy read it too (tests/unit/test_feed_orphan.c).
 * Left: a router destroyed from another router's feed callback with feeds of its own still
 * alive joins them from that feed's thread, which one of them may be waiting for (two
 * contract breaches at once; kvr_feed_destroy there hands the teardown to the feed's thread
 * instead, which frees the handle, so it cannot serve here). */
void kvr_feeds_orphan(struct kvr_router *r)
{
	for (;;) {
		pthread_mutex_lock(&r->feeds_lock);
		struct kvr_feed *f = r->feeds;
		pthread_mutex_unlock(&r->feeds_lock);
		if (!f)
			return;
		live_unlink(r, f);
		if (f->started) {
			stop_and_join(f);
			f->started = false;
		}
		feed_release(f);
		f->r = NULL;
		f->orphaned = true;
	}
}

/* The detail of a call on a feed whose router was destroyed first (core/error.h). */
static __attribute__((cold, noinline)) int feed_orphaned(const char *fn)
{
	return kvr_fail(KVR_ESHUTDOWN,
	                "%s: the feed's router was destroyed before it (its thread is stopped); "
	                "only kvr_feed_destroy may follow",
	                fn);
}
