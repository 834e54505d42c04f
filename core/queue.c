/*
 * core/queue.c - the admission queue: when every eligible rank is saturated (active prefill
 * tokens above queue_threshold x its max batched tokens), a request waits instead of piling
 * more prefill onto a rank that cannot start it.
 *
 * It is a bounded list under one mutex: it is only touched when the cluster is saturated, never
 * on the unsaturated routing path.  Order: FCFS (ticket order) or WSPT (weighted shortest
 * processing time: fewest predicted uncached prompt tokens first, all weights 1; ties by ticket);
 * the list is kept in that order.
 *
 * What a queued route costs.  Every frontend that queues while the cluster is saturated takes
 * this mutex for a push, a pass before and after it, and a settle by ticket; so none of those
 * may walk the queue (they did: ~0.5 ms a queued route at 8,000 waiting, 0.8-2 ms at 16,000,
 * perf/bench_queue).  So an entry is on one of three kinds of lists, on its next/prev links: a
 * waiting list (Q_WAITING and Q_ADMITTING, in the policy's order: the unrestricted entries', or
 * the group's of the entries with the same restriction, below), the admitted outcomes nobody
 * collected yet (admission order), or the failed ones (done_ns order); and every entry is in a
 * ticket table (chained, doubled at a load of one, halved at a quarter), so a wait, a cancel or
 * a settle finds its ticket in O(1).  A waiting list is a skip list (Pugh 1990) whose level 0 is
 * that doubly linked list: under FCFS every entry has level 0 only and goes at the tail (O(1)),
 * under WSPT an entry has another level with odds 1/4 each, so its insertion is O(log n) expected
 * and it still walks in order.  An unlink is O(1) at level 0 (every FCFS entry, 3 in 4 WSPT ones)
 * and O(log n) otherwise.  Why not a library: the build has liburcu and ck, whose hash tables
 * are concurrent (RCU, SPMC) and none of whose structures is ordered; shards/u64map.h holds
 * 32-bit values and reserves before it inserts; an intrusive skip list and chain need no
 * allocation beyond the entry's own (its levels are allocated with it), so a push fails only
 * where it did (KVR_ENOMEM before anything changed), and a table that cannot grow just has
 * longer chains.  A pass goes on after an admission from where it was (the entry it routed
 * stays linked while the lock is dropped; a cursor follows a cancel of its successor), and
 * from the head only when a WSPT push landed before that place meanwhile: so it visits an entry
 * it passed over once a pass, not once an admission as it did, and never the outcomes waiting
 * for their collector, which are on their own lists now.
 *
 * Restricted entries wait in groups.  Whether an entry is saturated depends on its restriction
 * only (its pin, else its allow-list, else every live rank), so the entries restricted alike
 * wait together: a group per restriction (the same pin; the same allow-list, the same ids in
 * the same order), found by a chained table, holding its entries in the policy's order.  A pass
 * merges the unrestricted list with the groups' lists, and looks at a group's saturation once,
 * at its first entry: a group passed over costs a pass O(1), however many entries it holds
 * (they each cost one look a pass, and every route made while requests wait runs a pass and
 * the admissible check: ~340 us a route behind 8,000 pinned to a saturated rank).  So a pass or
 * an admissible check costs O(groups + admissions), where the groups number at most the
 * distinct restrictions waiting: exact for pins (at most one group a rank id), and for
 * allow-lists as long as they repeat; requests each with their own allow-list still cost one
 * look each.  The order is the one the single list gave: the merge visits entries in the
 * policy's order, and skipping a saturated group's later entries skips only what the walk found
 * saturated one by one.
 *
 * A request waits only while every rank it may use (its pin, its allow-list, or every live rank)
 * is saturated.  A pass of the pump walks the list in order and admits each entry that has a
 * rank that is not; an entry whose ranks are all saturated is passed over, as it could take
 * nothing now (before, the pass stopped at it: a request pinned to a busy rank held back every
 * later request, even one for an idle rank, while a new arrival for that idle rank went straight
 * in).  Requests that share ranks are still served in the policy's order: an entry passed over
 * has only saturated ranks, and a later one admitted onto one of them only loads it more.  When
 * one unrestricted entry (every live rank) is saturated, so is every entry after it, and the pass
 * ends without looking at them; one whose booking was refused (its chosen rank's lane stayed
 * full) ends it too, as every later entry could only take a rank it may use.  Which entries are
 * saturated is read before routing them (the candidates' load words), so a pass costs one routing
 * decision per admission, not per entry.
 *
 * A new request goes straight in only when nobody waiting could be admitted: kvr_route pumps
 * first, and while another thread is pumping it joins the queue (kvr_queue_pump says so) instead
 * of taking a rank that the pass has not reached yet; the pass then walks the list again.
 * After queueing one, kvr_route pumps once more: the pass that lowered the load may have
 * ended before the push.  The shards lower load after the call that asked for it returned (no
 * lifecycle call waits for its shard, core/lifecycle.c) and pump nothing: every posted lifecycle
 * message once applied, and load the shards lower on their own (a lease expiry, a decay step),
 * wake the router's admission thread, which pumps (core/queue_thread.c).  A route that read the
 * load before such work was applied and queued meets the shard's hook in a Dekker pair
 * (kvr_queue_catch_up's fence after the push against the hook's after the load): either its own
 * pass sees the lowered load or the hook sees it queued.
 *
 * Admission happens in kvr_queue_pump(), run by the frontend threads that route or change ranks
 * (a rank added or resized, kvr_router_sync), by a lifecycle call with sync_booking (its work is
 * applied before the pass), and by the admission thread after a shard lowered load: never on a
 * shard thread, so a shard never waits for
 * this mutex.  One thread pumps at a time; another that asks meanwhile makes it walk the list once
 * more (q->again) and returns. The frontend learns the outcome through on_admit (called without any
 * router lock held) or by collecting the ticket with kvr_route_wait.  Requests are copied in
 * (tokens, allow list, LoRA name) since the caller's buffers are borrowed for the kvr_route call
 * only.
 *
 * An outcome nobody collects.  An admission reported to nobody stays in the list for its
 * collector: a kvr_route_wait, its own kvr_route, or (with no on_admit) a caller that never
 * waited.  The common way to give up (wait with a deadline, then cancel) used to leave one record
 * per lost race for good: the admission landed between the timeout and the cancel, the cancel
 * said KVR_ENOENT, and its attempt held the rank's load until its lease expired (probe: 500
 * rounds left 500 records and 174 live attempts).  Two rules bound it now, and end every attempt
 * exactly once.  A cancel that finds the request admitted and uncollected takes the outcome
 * and aborts the attempt (the lease's claim makes it exactly once against the reaper), and
 * returns 0: nobody was told the attempt, so nobody else can end it, and its caller has said it
 * does not want it.  An outcome nobody collects is freed once of no use (reap): an admission
 * once its attempt ended (its lease expired, its rank went: every call on it is KVR_ESTALE), a
 * failed one after two lease scan intervals (as long as an idle attempt lives).  The reap runs
 * on every push (where the list grows) and on the admission thread, which a shard's expiry
 * wakes while outcomes wait (kvr_queue_uncollected), and which times its own wake for the
 * failed ones, whose reclaim no expiry marks (an idle router kept one for good); so the
 * admitted records number at most the live leases, and each keeps its decision only (the
 * request's copies go at admission).  A push's reap looks only where one can be due: the
 * failed ones due are a prefix of their list (done_ns order), and the admitted ones end in
 * about admission order (each idle from its admission, claimed at the CLOCK hand's second
 * scan), so it checks the oldest until a live one, plus two at a cursor that goes round the
 * list for those that ended out of order (another shard's scan first, a rank reset): O(1)
 * amortised.  The admission thread's reap (and a rank's removal) checks every admitted one, as
 * before, off the routing path (see reap()).
 *
 * Tickets are numbered by one counter for the whole process, not per queue: with a count per
 * queue, two routers (one per model, or a router and the one created to replace it) issued the
 * same tickets, and a cancel or wait given the wrong router's handle cancelled or collected that
 * router's own request (tests/unit/test_router.c: tickets_of_another_router_are_refused).  The
 * counter is taken under the queue's lock, so each queue's tickets still grow in enqueue order,
 * and it is touched only when a request queues.
 */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "core/select.h"
#include "sync/cond.h"
#include "sync/rcu.h"
#include "sync/nocancel.h"

/* Q_WAITING -> Q_ADMITTING (the pump routes it with the lock dropped) -> Q_ADMITTED, or back to
 * Q_WAITING when its candidates are still saturated.  An entry in Q_ADMITTING belongs to the
 * pump: kvr_route_cancel waits for the outcome instead of freeing it under the pump's feet. */
enum { Q_WAITING, Q_ADMITTING, Q_ADMITTED };

/* Levels of the WSPT skip list: with a level's odds 1/4, 4^16 entries before the top one
 * crowds (the queue holds queue_capacity, a uint32_t, waiting at most). */
#define QLEVELS 16

struct qentry {
	uint64_t ticket;
	uint64_t key; /* WSPT: predicted uncached tokens */
	uint64_t enq_ns;
	int state;
	int rc;
	bool waited;          /* a kvr_route_wait caller will collect it */
	bool held;            /* held for its kvr_route until kvr_queue_settle, or a waiting one
	                       * until its kvr_route_wait watches it: never reclaimed */
	uint8_t height;       /* its levels in the waiting list's skip list (1: level 0 only) */
	uint32_t watched;     /* kvr_route_wait calls inside their loop for it: never reclaimed */
	uint64_t done_ns;     /* Q_ADMITTED: when (router clock), for a failed outcome's reclaim */
	uint64_t passed;      /* the pump's pass that found its ranks saturated */
	struct qgroup *group; /* waiting and restricted: its group (NULL: unrestricted) */
	struct kvr_decision d;
	struct kvr_request req;
	struct kvr_rank_id pinned;
	size_t tok_bytes, hash_bytes, allow_bytes, lora_bytes;
	/* Level 0 of the list it is on: the waiting list (Q_WAITING, Q_ADMITTING) or, once
	 * Q_ADMITTED, the admitted or the failed outcomes'. */
	struct qentry *next, *prev;
	struct qentry *hnext; /* the ticket table's chain */
	struct qentry *up[];  /* levels 1 .. height - 1 of the waiting list */
};

/* A list of outcomes waiting for their collector, on the entries' next/prev. */
struct olist {
	struct qentry *head, *tail;
};

/* A waiting list in the policy's order: level 0 of a skip list (levels above it only under
 * WSPT), its ends, and the heads of levels 1 and up. */
struct wlist {
	struct qentry *head, *tail;
	struct qentry *top[QLEVELS - 1];
};

/* The waiting entries of one restriction: pinned to one rank, or allowed the same list of
 * ranks (as given: the same ids in the same order).  Every entry of a group is saturated when
 * one is (entry_saturated reads only the restriction), so a pass and the admissible check look
 * at a group once, at its first entry, instead of at each of its entries.  Freed once empty,
 * but not while a pass runs (its active groups point at them): the pass frees those it left
 * empty. */
struct qgroup {
	struct wlist w;             /* its waiting entries, in the policy's order */
	struct qgroup *hnext;       /* the group table's chain */
	struct qgroup *next, *prev; /* every group (q->groups) */
	struct qgroup *anext;       /* the running pass's groups not passed over */
	uint64_t hash;
	uint64_t passed; /* the pump's pass that found its ranks saturated */
	size_t n;        /* its waiting entries */
	bool pinned;     /* ids[0] is the pin; else ids are the allow-list */
	bool listed;     /* on the running pass's list of groups (anext) */
	size_t n_ids;
	struct kvr_rank_id ids[];
};

struct kvr_queue {
	struct kvr_router *r;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	/* The unrestricted waiting entries (Q_WAITING, Q_ADMITTING) in the policy's order; the
	 * restricted ones are in their groups' lists. */
	struct wlist w;
	/* The groups of restricted waiting entries: a list, and a table by restriction (chains
	 * of hnext, 2^(64 - gtab_shift) of them). */
	struct qgroup *groups;
	struct qgroup **gtab;
	unsigned gtab_shift;
	size_t gtab_n;
	struct qentry *admitting; /* the entry the pass routes with the lock dropped, or NULL */
	struct olist ok;          /* admitted outcomes nobody collected yet, in admission order */
	struct olist bad;         /* failed ones, in done_ns order (then admission order) */
	struct qentry *sweep;     /* where a push's reap looks next in ok (NULL: its head) */
	/* Every entry by ticket: chains of hnext, 2^(64 - tab_shift) of them. */
	struct qentry **tab;
	unsigned tab_shift;
	size_t tab_n;
	uint64_t coins; /* the WSPT levels' draws (splitmix64 of a counter) */
	/* Entries in Q_WAITING or Q_ADMITTING.  Written under lock (atomic store), read anywhere
	 * (atomic load). */
	size_t waiting;
	/* Entries in Q_ADMITTED (outcomes nobody collected yet); the same discipline. */
	size_t uncollected;
	uint32_t waiters; /* threads inside kvr_route_wait */
	bool pumping;
	pthread_t pumper; /* the thread running the pass, while pumping */
	bool again;       /* asked to pump while a pass ran: walk the list once more */
	uint64_t wakes;   /* those asks, counted: the pass looks again at the groups passed over */
	/* Where the pass stands on q->w (see kvr_queue_pump): while `resume` is set (the pass
	 * runs), an unlink of `cursor` moves it to its successor and a push that lands before it
	 * raises `restart` (the pass then walks from the head, skipping what it passed over). */
	struct qentry *cursor;
	bool resume, restart;
	bool full; /* a rank went: the next pass looks at every restricted group */
	bool closing;
	uint64_t pass; /* the pump's passes, counted: an entry passed over keeps its number */
};

/* Tickets issued in this process (every router's queue): the last one. */
static uint64_t tickets_issued;

/* The ticket table's first size (chains), and how to place a ticket: tickets are consecutive,
 * and Fibonacci hashing spreads a run of them over every chain. */
#define TAB_MIN_SHIFT (64 - 6)

static size_t tab_slot(uint64_t ticket, unsigned shift)
{
	return (size_t)((ticket * 0x9e3779b97f4a7c15ull) >> shift);
}

static size_t tab_size(unsigned shift)
{
	return (size_t)1 << (64 - shift);
}

int kvr_queue_create(struct kvr_router *r, struct kvr_queue **out)
{
	struct kvr_queue *q = kvr_calloc(1, sizeof(*q));
	if (!q)
		return KVR_ENOMEM;
	q->tab_shift = TAB_MIN_SHIFT;
	q->tab = kvr_calloc(tab_size(q->tab_shift), sizeof(*q->tab));
	q->gtab_shift = TAB_MIN_SHIFT;
	q->gtab = kvr_calloc(tab_size(q->gtab_shift), sizeof(*q->gtab));
	if (!q->tab || !q->gtab) {
		kvr_free(q->tab, tab_size(q->tab_shift) * sizeof(*q->tab));
		kvr_free(q->gtab, tab_size(q->gtab_shift) * sizeof(*q->gtab));
		kvr_free(q, sizeof(*q));
		return KVR_ENOMEM;
	}
	q->r = r;
	pthread_mutex_init(&q->lock, NULL);
	kvr_cond_init(&q->cond); /* its waits are timed (kvr_route_wait) */
	*out = q;
	return 0;
}

static size_t entry_size(unsigned height)
{
	return sizeof(struct qentry) + (height - 1) * sizeof(struct qentry *);
}

/* Frees e's copy of its request: once admitted, only its outcome (e->d) is kept, so that an
 * outcome waiting to be collected holds one record, not the prompt. */
static void drop_request(struct qentry *e)
{
	kvr_free((void *)e->req.tokens, e->tok_bytes);
	kvr_free((void *)e->req.local_hashes, e->hash_bytes);
	kvr_free((void *)e->req.allow, e->allow_bytes);
	kvr_free((void *)e->req.lora_name, e->lora_bytes);
	e->req.tokens = NULL;
	e->req.local_hashes = NULL;
	e->req.allow = NULL;
	e->req.lora_name = NULL;
	e->tok_bytes = e->hash_bytes = e->allow_bytes = e->lora_bytes = 0;
}

static void entry_free(struct qentry *e)
{
	drop_request(e);
	kvr_free(e, entry_size(e->height));
}

/* The ticket table.  Context: all four under q->lock. */

/* Rehashes the ticket table into 2^(64 - shift) chains.  Without the memory it stays as it is:
 * longer chains or a larger table, slower or bigger, never wrong. */
static void tab_resize(struct kvr_queue *q, unsigned shift)
{
	struct qentry **t = kvr_calloc(tab_size(shift), sizeof(*t));
	if (!t)
		return;
	for (size_t i = 0; i < tab_size(q->tab_shift); i++) {
		for (struct qentry *x = q->tab[i], *n; x; x = n) {
			n = x->hnext;
			size_t s = tab_slot(x->ticket, shift);
			x->hnext = t[s];
			t[s] = x;
		}
	}
	kvr_free(q->tab, tab_size(q->tab_shift) * sizeof(*q->tab));
	q->tab = t;
	q->tab_shift = shift;
}

static void tab_insert(struct kvr_queue *q, struct qentry *e)
{
	/* Doubled at a load of one (amortised O(1) a push). */
	if (q->tab_n >= tab_size(q->tab_shift) && q->tab_shift > 1)
		tab_resize(q, q->tab_shift - 1);
	size_t s = tab_slot(e->ticket, q->tab_shift);
	e->hnext = q->tab[s];
	q->tab[s] = e;
	q->tab_n++;
}

static void tab_remove(struct kvr_queue *q, struct qentry *e)
{
	struct qentry **pp = &q->tab[tab_slot(e->ticket, q->tab_shift)];
	while (*pp != e)
		pp = &(*pp)->hnext;
	*pp = e->hnext;
	q->tab_n--;
	/* Halved at a load of a quarter, to its first size at least: it never shrank, and after a
	 * burst of 16,000 queued its 256 KB of chains stayed for the router's life
	 * (test_queue_many: the_queue_gives_back_a_bursts_memory).  Halved, it is half full: it
	 * doubles again only after as many pushes as it holds, and halves again only after half
	 * as many removals (amortised O(1) either way). */
	if (q->tab_shift < TAB_MIN_SHIFT && q->tab_n < tab_size(q->tab_shift) / 4)
		tab_resize(q, q->tab_shift + 1);
}

static struct qentry *find(struct kvr_queue *q, uint64_t ticket)
{
	struct qentry *e = q->tab[tab_slot(ticket, q->tab_shift)];
	while (e && e->ticket != ticket)
		e = e->hnext;
	return e;
}

/* The groups of restricted entries (struct qgroup).  Context: all under q->lock, but
 * restriction_hash. */

/* The restriction of request q: its pin (the allow-list does not matter then: entry_saturated
 * reads the pin only), else its allow-list; false for an unrestricted request. */
static bool restriction(const struct kvr_request *q, bool *pinned, const struct kvr_rank_id **ids,
                        size_t *n)
{
	*pinned = q->pinned != NULL;
	*ids = q->pinned ? q->pinned : q->allow;
	*n = q->pinned ? 1 : q->n_allow;
	return *n > 0;
}

static uint64_t restriction_hash(bool pinned, const struct kvr_rank_id *ids, size_t n)
{
	uint64_t h = pinned ? 1 : 2 + n;
	for (size_t i = 0; i < n; i++) {
		h ^= ids[i].worker_id;
		h = kvr_rand64(&h);
		h ^= ids[i].dp_rank;
		h = kvr_rand64(&h);
	}
	return h;
}

static size_t group_bytes(size_t n_ids)
{
	return sizeof(struct qgroup) + n_ids * sizeof(struct kvr_rank_id);
}

static void gtab_resize(struct kvr_queue *q, unsigned shift)
{
	struct qgroup **t = kvr_calloc(tab_size(shift), sizeof(*t));
	if (!t)
		return; /* longer chains or a larger table: never wrong */
	for (size_t i = 0; i < tab_size(q->gtab_shift); i++) {
		for (struct qgroup *g = q->gtab[i], *n; g; g = n) {
			n = g->hnext;
			size_t s = tab_slot(g->hash, shift);
			g->hnext = t[s];
			t[s] = g;
		}
	}
	kvr_free(q->gtab, tab_size(q->gtab_shift) * sizeof(*q->gtab));
	q->gtab = t;
	q->gtab_shift = shift;
}

/* The group of request req's restriction (hash h), or NULL. */
static struct qgroup *group_find(struct kvr_queue *q, const struct kvr_request *req, uint64_t h)
{
	bool pinned;
	const struct kvr_rank_id *ids;
	size_t n;
	(void)restriction(req, &pinned, &ids, &n);
	for (struct qgroup *g = q->gtab[tab_slot(h, q->gtab_shift)]; g; g = g->hnext) {
		if (g->hash != h || g->pinned != pinned || g->n_ids != n)
			continue;
		size_t i = 0;
		while (i < n && g->ids[i].worker_id == ids[i].worker_id &&
		       g->ids[i].dp_rank == ids[i].dp_rank)
			i++;
		if (i == n)
			return g;
	}
	return NULL;
}

/* Into the table and the list of groups: g, made by group_make. */
static void group_insert(struct kvr_queue *q, struct qgroup *g)
{
	if (q->gtab_n >= tab_size(q->gtab_shift) && q->gtab_shift > 1)
		gtab_resize(q, q->gtab_shift - 1);
	size_t s = tab_slot(g->hash, q->gtab_shift);
	g->hnext = q->gtab[s];
	q->gtab[s] = g;
	q->gtab_n++;
	g->prev = NULL;
	g->next = q->groups;
	if (g->next)
		g->next->prev = g;
	q->groups = g;
}

/* Frees empty group g, out of the table and the list. */
static void group_free(struct kvr_queue *q, struct qgroup *g)
{
	assert(g->n == 0 && !g->w.head);
	struct qgroup **pp = &q->gtab[tab_slot(g->hash, q->gtab_shift)];
	while (*pp != g)
		pp = &(*pp)->hnext;
	*pp = g->hnext;
	q->gtab_n--;
	if (q->gtab_shift < TAB_MIN_SHIFT && q->gtab_n < tab_size(q->gtab_shift) / 4)
		gtab_resize(q, q->gtab_shift + 1); /* as the ticket table */
	if (g->prev)
		g->prev->next = g->next;
	else
		q->groups = g->next;
	if (g->next)
		g->next->prev = g->prev;
	kvr_free(g, group_bytes(g->n_ids));
}

/* A group for request req's restriction (hash h), not yet in the table: made off the lock, so
 * a push fails for memory before anything changed.  NULL for no memory. */
static struct qgroup *group_make(const struct kvr_request *req, uint64_t h)
{
	bool pinned;
	const struct kvr_rank_id *ids;
	size_t n;
	(void)restriction(req, &pinned, &ids, &n);
	struct qgroup *g = kvr_calloc(1, group_bytes(n));
	if (!g)
		return NULL;
	g->hash = h;
	g->pinned = pinned;
	g->n_ids = n;
	memcpy(g->ids, ids, n * sizeof(*ids));
	return g;
}

/* Whether waiting entry a comes before waiting entry b in the policy's order. */
static bool before(const struct kvr_queue *q, const struct qentry *a, const struct qentry *b)
{
	if (q->r->cfg.queue_policy == KVR_QUEUE_WSPT && a->key != b->key)
		return a->key < b->key;
	return a->ticket < b->ticket;
}

/* The waiting lists: skip lists (Pugh, "Skip lists: a probabilistic alternative to balanced
 * trees", CACM 1990) on (key, ticket) under WSPT, whose level 0 is doubly linked and is the
 * order the pass walks; under FCFS every entry has level 0 only and goes at the tail.  So a
 * push is O(1) (FCFS) or O(log n) expected (WSPT), an unlink O(1) for a level-0 entry (every
 * FCFS one, 3 in 4 WSPT ones) and O(log n) for the others.  The unrestricted entries are on
 * q->w, each restricted one on its group's.  The link of level l after p, the list's head for p
 * NULL.  Context: these four under q->lock. */
static struct qentry **wlink(struct wlist *w, struct qentry *p, unsigned l)
{
	if (!p)
		return l ? &w->top[l - 1] : &w->head;
	return l ? &p->up[l - 1] : &p->next;
}

static struct wlist *wlist_of(struct kvr_queue *q, const struct qentry *e)
{
	return e->group ? &e->group->w : &q->w;
}

/* After every waiting entry of its list whose key is not larger: ties stay in ticket order, as
 * e's ticket is the newest.  Its group, if restricted, is e->group. */
static void wait_link(struct kvr_queue *q, struct qentry *e)
{
	struct wlist *w = wlist_of(q, e);
	struct qentry *p = w->tail;
	if (q->r->cfg.queue_policy == KVR_QUEUE_WSPT) {
		p = NULL;
		for (unsigned l = QLEVELS; l-- > 0;) {
			struct qentry *n;
			while ((n = *wlink(w, p, l)) && n->key <= e->key)
				p = n;
			if (l > 0 && l < e->height) {
				e->up[l - 1] = n;
				*wlink(w, p, l) = e;
			}
		}
	}
	e->prev = p;
	e->next = *wlink(w, p, 0);
	*wlink(w, p, 0) = e;
	if (e->next)
		e->next->prev = e;
	else
		w->tail = e;
	if (e->group) {
		e->group->n++;
		return; /* a pass takes a group's first entry wherever it stands */
	}
	/* Before the pass's place (only under WSPT: e's ticket is the newest, so it lands before
	 * the cursor only with a smaller key), or with the pass at the list's end: the pass must
	 * see it, from the head. */
	if (q->resume &&
	    (!q->cursor || (q->r->cfg.queue_policy == KVR_QUEUE_WSPT && e->key < q->cursor->key)))
		q->restart = true;
}

/* Off its waiting list; its group, left empty, is freed unless a pass runs (which frees it). */
static void wait_unlink(struct kvr_queue *q, struct qentry *e)
{
	struct wlist *w = wlist_of(q, e);
	if (e->height > 1) {
		/* Its predecessors on the upper levels, found from the top: the list is in (key,
		 * ticket) order. */
		struct qentry *p = NULL;
		for (unsigned l = QLEVELS - 1; l > 0; l--) {
			struct qentry *n;
			while ((n = *wlink(w, p, l)) && n != e &&
			       (n->key < e->key || (n->key == e->key && n->ticket < e->ticket)))
				p = n;
			if (l < e->height) {
				assert(n == e);
				*wlink(w, p, l) = e->up[l - 1];
			}
		}
	}
	if (q->resume && q->cursor == e)
		q->cursor = e->next; /* a cancel while the pass has the lock dropped */
	*wlink(w, e->prev, 0) = e->next;
	if (e->next)
		e->next->prev = e->prev;
	else
		w->tail = e->prev;
	e->next = e->prev = NULL;
	struct qgroup *g = e->group;
	e->group = NULL;
	if (g && --g->n == 0 && !q->pumping)
		group_free(q, g);
}
/* The outcome lists.  Context: under q->lock. */
static void olist_unlink(struct olist *l, struct qentry *e)
{
	if (e->prev)
		e->prev->next = e->next;
	else
		l->head = e->next;
	if (e->next)
		e->next->prev = e->prev;
	else
		l->tail = e->prev;
	e->next = e->prev = NULL;
}

/* Admitted entry e, kept for its collector, onto its outcome list: an admission at the tail of
 * ok, a failure into bad by done_ns, looked for from the tail (where it goes unless the router's
 * clock went back).  Context: under q->lock. */
static void outcome_link(struct kvr_queue *q, struct qentry *e)
{
	struct olist *l = e->rc == 0 ? &q->ok : &q->bad;
	struct qentry *p = l->tail;
	while (e->rc != 0 && p && p->done_ns > e->done_ns)
		p = p->prev;
	e->prev = p;
	e->next = p ? p->next : l->head;
	if (p)
		p->next = e;
	else
		l->head = e;
	if (e->next)
		e->next->prev = e;
	else
		l->tail = e;
}

/* Takes e off whatever list holds it and out of the ticket table.  Context: under q->lock. */
static void unlink_entry(struct kvr_queue *q, struct qentry *e)
{
	if (e->state != Q_ADMITTED) {
		wait_unlink(q, e);
	} else {
		if (q->sweep == e)
			q->sweep = e->next;
		olist_unlink(e->rc == 0 ? &q->ok : &q->bad, e);
	}
	tab_remove(q, e);
}

/* The first waiting entry in the policy's order: the first of q->w's and the groups' first
 * ones.  O(groups).  Context: under q->lock. */
static struct qentry *first_waiting(struct kvr_queue *q)
{
	struct qentry *e = q->w.head;
	for (struct qgroup *g = q->groups; g; g = g->next)
		if (g->w.head && (!e || before(q, g->w.head, e)))
			e = g->w.head;
	return e;
}

void kvr_queue_destroy(struct kvr_queue *q)
{
	if (!q)
		return;
	pthread_mutex_lock(&q->lock);
	q->closing = true;
	pthread_cond_broadcast(&q->cond);
	while (q->waiters || q->pumping)
		pthread_cond_wait(&q->cond, &q->lock);
	pthread_mutex_unlock(&q->lock);
	struct kvr_router *r = q->r;
	for (;;) {
		/* Off every list and the ticket table before on_admit: a wait or a cancel it makes
		 * finds the ticket gone (KVR_ENOENT), as it found it off the list before. */
		pthread_mutex_lock(&q->lock);
		struct qentry *e = first_waiting(q);
		if (e)
			unlink_entry(q, e);
		pthread_mutex_unlock(&q->lock);
		if (!e)
			break;
		/* A request still queued that no waiter collects is answered through on_admit, as
		 * one that could not be admitted (KVR_ESHUTDOWN): dropped silently, its ticket
		 * never resolved for a frontend that counts them.  Calls back into the router
		 * from there return KVR_ESHUTDOWN. */
		if (e->state == Q_WAITING && !e->waited && r->cfg.on_admit) {
			struct kvr_decision d;
			memset(&d, 0, sizeof(d));
			d.status = KVR_FAILED;
			d.error = KVR_ESHUTDOWN;
			d.ticket = e->ticket;
			const struct kvr_router *prev = kvr_router_callback_enter(r);
			r->cfg.on_admit(r->cfg.callback_ctx, e->ticket, &d);
			kvr_router_callback_leave(prev);
		}
		entry_free(e);
	}
	/* Outcomes nobody collected: nobody is told (nobody was before either). */
	struct olist *lists[] = {&q->ok, &q->bad};
	for (size_t i = 0; i < 2; i++) {
		for (struct qentry *e = lists[i]->head, *n; e; e = n) {
			n = e->next;
			entry_free(e);
		}
	}
	assert(!q->groups); /* freed with their last entries (nobody pumps) */
	kvr_free(q->tab, tab_size(q->tab_shift) * sizeof(*q->tab));
	kvr_free(q->gtab, tab_size(q->gtab_shift) * sizeof(*q->gtab));
	pthread_cond_destroy(&q->cond);
	pthread_mutex_destroy(&q->lock);
	kvr_free(q, sizeof(*q));
}

bool kvr_queue_saturated(struct kvr_router *r, const uint32_t *slots, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		const struct kvr_rank_pub *p = &r->ranks[slots[i]];
		/* Atomic: a re-add stores it on the rank's shard while routers read it here. */
		uint32_t mbt = __atomic_load_n(&p->max_batched_tokens, __ATOMIC_RELAXED);
		if (mbt == 0)
			return false; /* unknown budget: never saturated */
		/* booked + provisional */
		double load = (double)kvr_rank_load_prefill(&r->load[slots[i]], &r->prov[slots[i]]);
		if (load <= r->cfg.queue_threshold * (double)mbt)
			return false;
	}
	return true;
}

static void *dup_bytes(const void *src, size_t bytes)
{
	if (!src || !bytes)
		return NULL;
	void *p = kvr_alloc(bytes);
	if (p)
		memcpy(p, src, bytes);
	return p;
}

static uint64_t reap(struct kvr_queue *q, uint64_t now, bool all);

/* Whether request q may use a live rank: restricted (pinned, or allow-listed), one index lookup
 * a named rank until one is found; unrestricted, whether the live list holds any (every live
 * rank is its).  Context: under q->lock (kvr_queue_push says why); the caller is registered
 * with RCU. */
static bool request_live(struct kvr_router *r, const struct kvr_request *q, bool restricted)
{
	uint32_t s;
	if (!restricted) {
		kvr_rcu_read_lock();
		bool any = kvr_live_n(kvr_rcu_deref(&r->live)) > 0;
		kvr_rcu_read_unlock();
		return any;
	}
	if (q->pinned)
		return kvr_router_find_rank(r, *q->pinned, &s) == 0;
	for (size_t i = 0; i < q->n_allow; i++)
		if (kvr_router_find_rank(r, q->allow[i], &s) == 0)
			return true;
	return false;
}

int kvr_queue_push(struct kvr_router *r, const struct kvr_request *req, uint64_t key,
                   struct kvr_decision *d)
{
	struct kvr_queue *q = r->queue;
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	/* Its levels in the WSPT skip list: one more with odds 1/4 each (drawn off the lock, from
	 * a counter's splitmix64, so the entry is allocated with them). */
	unsigned height = 1;
	if (r->cfg.queue_policy == KVR_QUEUE_WSPT) {
		uint64_t coin = __atomic_add_fetch(&q->coins, 1, __ATOMIC_RELAXED);
		for (uint64_t x = kvr_rand64(&coin); height < QLEVELS && (x & 3) == 0; x >>= 2)
			height++;
	}
	struct qentry *e = kvr_calloc(1, entry_size(height));
	if (!e)
		return KVR_ENOMEM;
	e->height = (uint8_t)height;
	e->req = *req;
	e->req.flags &= ~(uint32_t)KVR_ROUTE_WAIT;
	e->tok_bytes = req->tokens ? req->n_tokens * sizeof(uint32_t) : 0;
	/* A hash-given prompt with n_hashes = 0 (shorter than one block) keeps a non-NULL (one
	 * element) copy: the request must still name local_hashes, and no memcpy sees NULL. */
	e->hash_bytes = req->local_hashes && !req->tokens
	                    ? (req->n_hashes ? req->n_hashes : 1) * sizeof(uint64_t)
	                    : 0;
	e->allow_bytes = req->n_allow * sizeof(struct kvr_rank_id);
	e->lora_bytes = req->lora_name ? strlen(req->lora_name) + 1 : 0;
	e->req.tokens = dup_bytes(req->tokens, e->tok_bytes);
	if (e->hash_bytes) {
		uint64_t *h = kvr_calloc(1, e->hash_bytes);
		if (h && req->n_hashes)
			memcpy(h, req->local_hashes, req->n_hashes * sizeof(uint64_t));
		e->req.local_hashes = h;
	} else {
		e->req.local_hashes = NULL; /* tokens given too (with seq_hashes): hashed again */
	}
	e->req.seq_hashes = NULL; /* not copied: hashed or chained again at admission */
	e->req.allow = dup_bytes(req->allow, e->allow_bytes);
	e->req.lora_name = dup_bytes(req->lora_name, e->lora_bytes);
	if (req->pinned) {
		e->pinned = *req->pinned;
		e->req.pinned = &e->pinned;
	}
	if ((e->tok_bytes && !e->req.tokens) || (e->hash_bytes && !e->req.local_hashes) ||
	    (e->allow_bytes && !e->req.allow) || (e->lora_bytes && !e->req.lora_name)) {
		entry_free(e);
		return KVR_ENOMEM;
	}
	e->key = key;
	e->enq_ns = kvr_clock_now(&r->clock);
	e->state = Q_WAITING;
	/* A restricted request waits in its restriction's group, made for the first of it off the
	 * lock (the lock is dropped for the allocation, and the group looked for again after), so
	 * that the push fails for memory before anything changed.  Looked for first: a push into a
	 * group that exists allocates nothing for it (it made one before the lock and freed it
	 * then, an allocation and a free a restricted queued route: test_queue_alloc). */
	bool pin;
	const struct kvr_rank_id *ids;
	size_t n_ids;
	uint64_t gh = 0;
	struct qgroup *g = NULL, *spare = NULL;
	const bool restricted = restriction(&e->req, &pin, &ids, &n_ids);
	if (restricted)
		gh = restriction_hash(pin, ids, n_ids);
	pthread_mutex_lock(&q->lock);
	if (restricted && !(g = group_find(q, &e->req, gh))) {
		pthread_mutex_unlock(&q->lock);
		if (!(spare = group_make(&e->req, gh))) {
			entry_free(e);
			return KVR_ENOMEM;
		}
		pthread_mutex_lock(&q->lock);
		g = group_find(q, &e->req, gh); /* made meanwhile: the spare goes */
	}
	/* The list grows here: outcomes nobody will collect go first (those that can be due). */
	(void)reap(q, e->enq_ns, false);
	/* Refused in this order: a closing router first; then a request whose ranks are gone,
	 * which has nothing to wait for, KVR_ENOENT whatever room the queue has (before, a full
	 * queue's KVR_EAGAIN told it to try again, and the retry got KVR_ENOENT: test_regress
	 * *_removed_before_its_push_into_a_full_queue_fails_enoent, and for an unrestricted one
	 * whose every rank went, an_unrestricted_request_whose_ranks_all_went_*); then a full
	 * queue.
	 *
	 * kvr_route found its ranks live, but they may have gone since, and with them the pass
	 * that fails the requests restricted to them (kvr_queue_rank_gone's, which looks past a
	 * saturated unrestricted entry): every later pass ends at such an entry, so a request
	 * pushed after it waited there until that entry was admitted or another rank went
	 * (test_regress: *_removed_before_its_push_fails_at_once).  It fails now instead, as if
	 * its ranks had gone before the call.  Looked at under the lock, in the critical section
	 * that links it: kvr_rank_remove takes the rank off the live list and clears its live
	 * word before kvr_queue_rank_gone takes this lock to ask for that pass, so either this
	 * look comes after (it sees the rank gone) or the entry is on the list before that pass
	 * starts (which fails it).  The request's own ranks only (an unrestricted one's: the live
	 * list's length): no walk of the queue.  An unrestricted request finds the queue full
	 * with its ranks all gone only while that removal runs (its pass fails every waiting
	 * request, none of which has a rank left), but it was then told to try again for a retry
	 * that could only get KVR_ENOENT. */
	int refused = 0;
	if (q->closing)
		refused = KVR_ESHUTDOWN;
	else if (!request_live(r, &e->req, restricted))
		refused = KVR_ENOENT;
	else if (q->waiting >= r->cfg.queue_capacity)
		refused = KVR_EAGAIN;
	if (refused) {
		pthread_mutex_unlock(&q->lock);
		entry_free(e);
		if (spare)
			kvr_free(spare, group_bytes(spare->n_ids));
		kvr_metrics_add(
		    mb, refused == KVR_ENOENT ? KVR_C_ROUTE_ERRORS : KVR_C_QUEUE_REJECTED, 1);
		return refused;
	}
	e->ticket = __atomic_add_fetch(&tickets_issued, 1, __ATOMIC_RELAXED);
	/* Held for kvr_route, which pumps after this push and then settles the ticket
	 * (kvr_queue_settle): no on_admit names it before kvr_route returned it. */
	e->waited = true;
	e->held = true;
	if (restricted) {
		/* Found above, under the lock held since: a group is freed under it only. */
		if (!g) {
			group_insert(q, spare);
			g = spare;
			spare = NULL;
		}
		e->group = g;
	}
	/* In the policy's order: FCFS at the tail; WSPT before the first larger key (ties stay in
	 * ticket order). */
	wait_link(q, e);
	tab_insert(q, e);
	__atomic_store_n(&q->waiting, q->waiting + 1, __ATOMIC_RELAXED);
	q->again |= q->pumping; /* a running pass may have walked past its place */
	/* Read under the lock: once it is dropped, a concurrent pump may admit the entry and, with
	 * on_admit set, free it. */
	uint64_t ticket = e->ticket;
	pthread_mutex_unlock(&q->lock);
	if (spare)
		kvr_free(spare, group_bytes(spare->n_ids));
	memset(d, 0, sizeof(*d));
	d->status = KVR_QUEUED;
	d->ticket = ticket;
	kvr_metrics_add(mb, KVR_C_QUEUED, 1);
	return 0;
}

/* Whether every rank e may use is saturated, read from the candidates' load words without
 * routing it.  A request with no routable candidate (its pin or allowed ranks gone, no live
 * rank) is not: routing it delivers that failure.  Context: under q->lock; the caller is an RCU
 * reader (kvr_queue_pump). */
static bool entry_saturated(struct kvr_router *r, const struct qentry *e, bool *unrestricted)
{
	const struct kvr_request *q = &e->req;
	bool sat = true, any = false;
	uint32_t s;
	*unrestricted = !q->pinned && !q->n_allow;
	kvr_rcu_read_lock();
	if (q->pinned) {
		any = kvr_router_find_rank(r, *q->pinned, &s) == 0 &&
		      __atomic_load_n(&r->ranks[s].live, __ATOMIC_ACQUIRE);
		sat = any && kvr_queue_saturated(r, &s, 1);
	} else if (q->n_allow) {
		for (size_t i = 0; i < q->n_allow && sat; i++) {
			if (kvr_router_find_rank(r, q->allow[i], &s) ||
			    !__atomic_load_n(&r->ranks[s].live, __ATOMIC_ACQUIRE))
				continue;
			any = true;
			sat = kvr_queue_saturated(r, &s, 1);
		}
	} else {
		const struct kvr_live *live = kvr_rcu_deref(&r->live);
		size_t n = kvr_live_n(live);
		any = n > 0;
		sat = any && kvr_queue_saturated(r, live->slot, n);
	}
	kvr_rcu_read_unlock();
	return any && sat;
}

/* The first entry of q->w from e on that this pass has not passed over.  Context: under
 * q->lock. */
static struct qentry *next_waiting(struct kvr_queue *q, struct qentry *e)
{
	for (; e; e = e->next)
		if (e->state == Q_WAITING && e->passed != q->pass)
			return e;
	return NULL;
}

/* Puts on the running pass's list of groups (*active) every group with waiting entries whose
 * ranks are not saturated now, and marks every other one passed over by this pass.  At the
 * pass's start, and again after a call that may have lowered a load asked for a pump while the
 * pass ran (q->wakes): a group passed over is then looked at again, so that one unloaded before
 * its turn is admitted at its turn, ahead of the later requests that share its ranks.
 * Context: under q->lock; the caller is an RCU reader (kvr_queue_pump). */
static void groups_look(struct kvr_queue *q, struct qgroup **active)
{
	for (struct qgroup *g = q->groups; g; g = g->next) {
		bool unrestricted;
		if (g->listed && g->passed != q->pass)
			continue; /* on the list, not passed over */
		if (g->w.head && !entry_saturated(q->r, g->w.head, &unrestricted)) {
			g->passed = 0; /* no pass's number */
			if (!g->listed) {
				g->anext = *active;
				*active = g;
				g->listed = true;
			}
		} else {
			g->passed = q->pass;
		}
	}
}

/* Whether admitted entry e's outcome can be of no use to anyone any more: its attempt ended
 * (its lease expired, its rank was removed or reset: every call on it is KVR_ESTALE), or, a
 * failed admission (no attempt), it is older than keep_ns.  Context: under q->lock. */
static bool outcome_stale(struct kvr_router *r, const struct qentry *e, uint64_t now,
                          uint64_t keep_ns)
{
	if (e->rc == 0) {
		int st = kvr_lease_state(r->leases, e->d.attempt);
		return st < 0 || st == KVR_LEASE_CLAIMED; /* claimed: its end is under way */
	}
	return now >= e->done_ns && now - e->done_ns >= keep_ns;
}

/* Frees admitted entry e, an outcome nobody will collect.  Context: under q->lock. */
static void drop_outcome(struct kvr_queue *q, struct qentry *e)
{
	unlink_entry(q, e);
	__atomic_store_n(&q->uncollected, q->uncollected - 1, __ATOMIC_RELAXED);
	entry_free(e);
}

/* Admitted outcomes a push's reap checks where its cursor stands, besides the oldest ones. */
#define REAP_SWEEP_STEP 2

/* Frees the outcomes nobody will collect (see the top): an admission once its attempt ended, a
 * failed one after two lease scan intervals (as long as an idle attempt lives).  Never one held
 * for its kvr_route.  Returns when (router clock) the next failed outcome left comes due, now
 * for one due but held or watched (its holder collects it soon), UINT64_MAX for none: nothing
 * else wakes anyone for it (kvr_queue_reap).
 *
 * The failed ones are in done_ns order, so those due are a prefix of their list: exact, and
 * O(1 + freed + due but held).  The admitted ones end by their lease's expiry (nobody was told
 * their attempts, so nothing else ends them, but a rank's removal or reset): in about admission
 * order, as every one is idle from its admission and the CLOCK hand claims an idle lease at its
 * second scan.  With all false (a push) the oldest are checked until a live one, and
 * REAP_SWEEP_STEP more at a cursor that goes round the list, for the ones that ended out of
 * order (another shard's scan first, a reset rank): O(1 + freed) amortised, every ended one
 * found within (admitted outcomes / REAP_SWEEP_STEP) pushes.  With all true (the admission
 * thread, after a shard lowered load; a rank's removal) every admitted one is checked, as
 * before: that keeps their number at most the live leases, off the routing path.
 * Context: under q->lock; now is the router clock read off it. */
static uint64_t reap(struct kvr_queue *q, uint64_t now, bool all)
{
	uint64_t next = UINT64_MAX;
	if (q->uncollected == 0)
		return next;
	struct kvr_router *r = q->r;
	uint64_t scan = r->cfg.lease_scan_interval_ns;
	uint64_t keep = scan > UINT64_MAX / 2 ? UINT64_MAX : 2 * scan;
	for (struct qentry *e = q->bad.head, *n; e; e = n) {
		n = e->next;
		if (!outcome_stale(r, e, now, keep)) {
			uint64_t due =
			    e->done_ns > UINT64_MAX - keep ? UINT64_MAX : e->done_ns + keep;
			due = due < now ? now : due;
			next = due < next ? due : next;
			break;
		}
		if (e->held || e->watched)
			next = now;
		else
			drop_outcome(q, e);
	}
	for (struct qentry *e = q->ok.head, *n; e; e = n) {
		n = e->next;
		if (e->held || e->watched)
			continue;
		if (outcome_stale(r, e, now, keep))
			drop_outcome(q, e);
		else if (!all)
			break;
	}
	for (unsigned k = 0; !all && k < REAP_SWEEP_STEP && q->ok.head; k++) {
		struct qentry *e = q->sweep ? q->sweep : q->ok.head;
		q->sweep = e->next;
		if (!e->held && !e->watched && outcome_stale(r, e, now, keep))
			drop_outcome(q, e);
	}
	return next;
}

uint64_t kvr_queue_reap(struct kvr_router *r, uint64_t *now_out)
{
	struct kvr_queue *q = r->queue;
	if (kvr_queue_uncollected(r) == 0)
		return UINT64_MAX;
	/* Off the lock: a clock that makes a lifecycle call pumps, which takes it. */
	uint64_t now = kvr_clock_now(&r->clock), next = UINT64_MAX;
	pthread_mutex_lock(&q->lock);
	if (!q->closing)
		next = reap(q, now, true);
	pthread_mutex_unlock(&q->lock);
	if (now_out)
		*now_out = now;
	return next;
}

static bool pump(struct kvr_router *r);

/* The pass routes this router's own queued requests, whoever runs it: also a peer's change
 * applied on the replica's apply thread (kvr_rank_add and kvr_rank_reset pump; so do a
 * mirror's finish and abort with sync_booking), where kvr_repl_applying marks the thread's calls
 * as the peer's.  Admitted under that mark, an own request's admission was never published
 * (kvr_route decides to note it with kvr_repl_attached), and no peer carried its load
 * (test_replica_hooks a_queued_request_admitted_by_a_peers_rank_add_is_mirrored). */
bool kvr_queue_pump(struct kvr_router *r)
{
	const bool applying = kvr_repl_applying;
	kvr_repl_applying = false;
	bool done = pump(r);
	kvr_repl_applying = applying;
	return done;
}

static bool pump(struct kvr_router *r)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	struct kvr_queue *q = r->queue;
	struct kvr_metrics_block *mb = kvr_metrics_local(r->metrics);
	/* The pump routes on this thread, inside RCU read sections: the thread must be a reader
	 * even when it never called the library before (kvr_router_sync, an admin call).  Without
	 * memory to register it, leave the queue to the next pump. */
	if (kvr_rcu_thread_online())
		return true;
	pthread_mutex_lock(&q->lock);
	if (q->closing || q->waiting == 0) {
		pthread_mutex_unlock(&q->lock);
		return true;
	}
	if (q->pumping) {
		/* The running pass may have gone past the entries this caller's call made
		 * admissible (it lowered a load) or added: it walks the list again. */
		q->again = true;
		q->wakes++;
		pthread_mutex_unlock(&q->lock);
		return false;
	}
	q->pumping = true;
	q->pumper = pthread_self();
	bool kept_failed = false;
	/* A booking refused on a frontend's pass (kvr_route, a lifecycle or rank call): the pass
	 * ends there and does not run again for q->again; the admission thread (woken) takes the
	 * retry.  Such a booking is refused at once on a full lane now (kvr_admit's full_wait: only
	 * the admission thread's retry waits, the bounded 10 ms; test_queue_lane
	 * a_route_that_pumps_*: the route paid that wait, 10.3-21.2 ms).  Before this hand-off,
	 * each refusal waited 10 ms on a full lane, and every call that asked for a pump
	 * meanwhile (another route, the admission thread woken by the refusal) made the pass run
	 * again: the frontend retried the lane every 10 ms for as long as it stayed full (issue 11:
	 * routing never waits without bound on a shard; test_queue_lane
	 * a_route_that_pumps_does_not_retry_a_full_lane_while_it_stays_full: 1,000 ms before). */
	bool hand_off = false;
	do {
		q->again = false;
		q->pass++;
		/* sync_booking: the saturation read below must see the work posted before (the
		 * routing itself settles too).  Off the lock: a shard's task may read a clock
		 * that makes a lifecycle call, which pumps. */
		if (r->cfg.sync_booking) {
			pthread_mutex_unlock(&q->lock);
			kvr_router_settle(r);
			pthread_mutex_lock(&q->lock);
		}
		/* Once an unrestricted entry is saturated, every live rank is, and so are every
		 * later entry's: the pass ends there, unless a rank went since the last full pass,
		 * when a later entry restricted to ranks that are all gone is routed (it fails, and
		 * is told so) and every other is passed over.  (A request whose ranks went after
		 * kvr_route looked at them, and before its push, is refused by the push: it may
		 * come after that pass.)
		 *
		 * The restricted entries wait in groups by restriction (struct qgroup), each in
		 * the policy's order, the unrestricted ones on q->w: the pass merges q->w with the
		 * groups whose ranks are not saturated, read once a pass at a group's first entry,
		 * so that a group passed over costs a pass one look, not one per member.  (Every
		 * route made while requests wait runs a pass and the admissible check: behind
		 * 8,000 requests pinned to a saturated rank each cost ~340 us, 100 times as much as
		 * behind none; perf/bench_queue --restricted pin, test_queue_many:
		 * a_route_does_not_walk_the_requests_pinned_to_a_saturated_rank.)  A group found
		 * saturated (at the pass's start, at its turn, or by its entry's KVR_EAGAIN) is
		 * passed over until a call that may have lowered a load asks for a pump while the
		 * pass runs (q->wakes: a lifecycle call, on_admit's included, a rank change, the
		 * admission thread after a shard's hook): the pass then looks at the groups it
		 * passed over again before its next admission (groups_look), so a group read
		 * saturated at the start is not overtaken at its turn by a later request onto its
		 * unloaded rank.  The ask also makes the pass run again (q->again), and so does a
		 * push. */
		bool full = q->full, all_saturated = false;
		q->full = false;
		struct qgroup *active = NULL;
		for (struct qgroup *g = q->groups; g; g = g->next)
			g->listed = false;
		groups_look(q, &active);
		uint64_t wakes = q->wakes;
		/* Where the pass stands on q->w: the entry it routes, or the next one it looks
		 * at.  While `resume` is set an unlink of it moves it to its successor, and a push
		 * that lands before it raises `restart` (the pass then looks from q->w's head, over
		 * what it passed over). */
		q->cursor = q->w.head;
		q->resume = true;
		q->restart = false;
		for (;;) {
			if (q->restart) {
				q->restart = false;
				q->cursor = q->w.head;
			}
			/* A call that may have lowered a load asked for a pump while the lock was
			 * dropped (on_admit's own calls included): what this pass read saturated
			 * may not be any more.  The groups it passed over are looked at again
			 * before anything later is admitted, as a pass that looked at each entry at
			 * its turn did (before, a group read saturated at the pass's start stayed
			 * passed over, and a later request took its unloaded rank first:
			 * test_queue_many *_a_group_unloaded_before_its_turn_goes_first). */
			if (q->wakes != wakes) {
				wakes = q->wakes;
				all_saturated = false;
				if (r->cfg.sync_booking) { /* as at the pass's start */
					pthread_mutex_unlock(&q->lock);
					kvr_router_settle(r);
					pthread_mutex_lock(&q->lock);
				}
				groups_look(q, &active);
			}
			q->cursor = next_waiting(q, q->cursor);
			/* The first of q->w's and the active groups' first entries: of the groups'
			 * only while every live rank is read saturated (the cursor then waits at
			 * the first unrestricted entry for a wake, see below). */
			struct qentry *e = all_saturated ? NULL : q->cursor;
			struct qgroup *eg = NULL;
			for (struct qgroup **pg = &active, *g; (g = *pg);) {
				if (g->passed == q->pass || !g->w.head) {
					*pg = g->anext; /* passed over, or left empty */
					g->listed = false;
					continue;
				}
				if (!e || before(q, g->w.head, e)) {
					e = g->w.head;
					eg = g;
				}
				pg = &g->anext;
			}
			if (!e)
				break;
			bool unrestricted;
			if (entry_saturated(r, e, &unrestricted)) {
				if (eg) {
					eg->passed = q->pass;
					continue;
				}
				if (!full)
					break;
				/* Every live rank is saturated, so is every unrestricted entry: the
				 * pass goes on with the groups only, the cursor left at e, which a
				 * wake (all_saturated cleared) makes the merge's again at its turn.
				 * Before, e and every unrestricted entry after it were marked
				 * passed over until the next pass: after an unload before a later
				 * entry's turn, that entry (unrestricted, or restricted to one of
				 * e's ranks) took the rank first and e waited behind it
				 * (test_queue_many:
				 * *_an_unrestricted_request_unloaded_in_a_full_pass_goes_first). */
				all_saturated = true;
				continue;
			}
			/* Ours while the lock is dropped: cancel waits for the outcome (see
			 * Q_ADMITTING), so it stays on its list, and the pass goes on from it.
			 * Every entry before it was passed over this pass, unless a push lands
			 * there meanwhile (restart).  Before, the pass walked from the head after
			 * every admission, over every entry it had passed over: 1,000 admissions
			 * behind 8,000 requests pinned to a saturated rank took ~0.5 s under this
			 * lock (test_queue_many:
			 * a_pass_does_not_walk_again_over_what_it_passed_over). */
			e->state = Q_ADMITTING;
			q->admitting = e;
			pthread_mutex_unlock(&q->lock);
			struct kvr_decision d;
			int rc = kvr_route_internal(r, &e->req, &d, KVR_QUEUE_FROM_PUMP);
			/* Read off the lock: a clock that makes a lifecycle call pumps, which takes
			 * it. */
			uint64_t now = kvr_clock_now(&r->clock);
			pthread_mutex_lock(&q->lock);
			q->admitting = NULL;
			if (rc == KVR_QUEUE_SATURATED || rc == KVR_EAGAIN) {
				/* Saturated after all (load rose meanwhile: KVR_QUEUE_SATURATED),
				 * or its booking refused (its rank's lane stayed full for 10 ms on
				 * the admission thread's pass, was full on a frontend's, or too
				 * many attempts live: KVR_EAGAIN): it waits for a later pass. Never
				 * left on a free rank past this pass: a refused booking wakes the
				 * admission thread (kvr_admit), whose pump makes this pass run
				 * again or runs the next; load that rose leaves its ranks saturated
				 * until an unload, and every unload asks for a pump.
				 *
				 * A group is passed over for the rest of the pass (looked at again
				 * on a wake), and so is an unrestricted entry saturated after all:
				 * a later entry can go first only if the load that refused it falls
				 * again before the pass ends, a race of three threads.  An
				 * unrestricted entry whose booking was refused ends the pass
				 * instead, the next one starting from it: it may use every live
				 * rank (only its chosen one's lane was full), so any entry admitted
				 * after it in this pass took a rank it could have had.  Before, it
				 * was passed over, and a later entry went to another shard's free
				 * rank first (test_queue_lane:
				 * *_a_full_lane_does_not_let_a_later_request_go_first).  Its retry
				 * comes with the next pass, as before, and the entries after it
				 * wait for it, as behind a saturated one.  A removal's pass (full)
				 * hands its look at every group on to the next, so that those
				 * whose ranks all went still fail then. */
				e->state = Q_WAITING;
				pthread_cond_broadcast(&q->cond);
				hand_off = rc == KVR_EAGAIN && kvr_admitter_of != r;
				if ((!e->group && rc == KVR_EAGAIN) || hand_off) {
					q->full |= full;
					break;
				}
				if (e->group)
					e->group->passed = q->pass;
				else
					e->passed = q->pass;
				continue;
			}
			wait_unlink(q, e); /* off the waiting list, before it is Q_ADMITTED */
			e->state = Q_ADMITTED;
			e->rc = rc;
			e->done_ns = now;
			if (rc == 0) {
				e->d = d;
			} else {
				/* Not admitted (its pinned or allowed ranks went away, no memory):
				 * the outcome is still delivered, through on_admit or
				 * kvr_route_wait. */
				memset(&e->d, 0, sizeof(e->d));
				e->d.status = KVR_FAILED;
				e->d.error = rc;
			}
			e->d.ticket = e->ticket;
			__atomic_store_n(&q->waiting, q->waiting - 1, __ATOMIC_RELAXED);
			if (rc == 0) {
				kvr_metrics_observe(mb, KVR_H_QUEUE_WAIT_NS,
				                    now > e->enq_ns ? now - e->enq_ns : 0);
				kvr_metrics_add(mb, KVR_C_QUEUE_ADMITTED, 1);
			}
			if (!e->waited && r->cfg.on_admit) {
				tab_remove(q, e);
				pthread_mutex_unlock(&q->lock);
				const struct kvr_router *prev = kvr_router_callback_enter(r);
				r->cfg.on_admit(r->cfg.callback_ctx, e->ticket, &e->d);
				kvr_router_callback_leave(prev);
				entry_free(e);
				pthread_mutex_lock(&q->lock);
			} else {
				/* Kept for its collector (kvr_route_wait, kvr_route_cancel, or its
				 * own kvr_route), or reclaimed once useless (reap). */
				drop_request(e);
				outcome_link(q, e);
				__atomic_store_n(&q->uncollected, q->uncollected + 1,
				                 __ATOMIC_RELAXED);
				kept_failed |= rc != 0;
				/* Its lease may have expired since the admission (the clock read
				 * above runs off the lock): that expiry's hook saw nothing
				 * uncollected yet, and no later one comes for it, so it is judged
				 * now.  The fence pairs with the hook's (after the lease ended,
				 * before it reads the count): one of the two sees the other. */
				__atomic_thread_fence(__ATOMIC_SEQ_CST);
				if (rc == 0 && !e->held && !e->watched &&
				    outcome_stale(r, e, now, UINT64_MAX))
					drop_outcome(q, e);
			}
			pthread_cond_broadcast(&q->cond);
		}
		q->resume = false;
		q->cursor = NULL;
	} while (q->again && !q->closing && !hand_off);
	/* The groups left empty while the pass ran (its active groups pointed at them). */
	for (struct qgroup *g = q->groups, *n; g; g = n) {
		n = g->next;
		if (g->n == 0)
			group_free(q, g);
	}
	q->pumping = false;
	pthread_cond_broadcast(&q->cond);
	pthread_mutex_unlock(&q->lock);
	/* No attempt's expiry wakes anyone for a failed one: the admission thread times its reap
	 * (on an idle router nothing else would, and it stayed for good). */
	if (kept_failed)
		kvr_admitter_note_failed(r);
	/* The refusal woke it, but its pump may have found this pass running (q->again) and
	 * parked since: woken again, it runs the next pass. */
	if (hand_off)
		kvr_admitter_wake(r);
	/* Handed off: the refused entry may still be admissible (only its rank's lane was full),
	 * so a kvr_route that pumped asks (kvr_queue_admissible) and queues behind it, as behind
	 * another thread's pass, instead of taking a rank the entry may use first (test_queue_lane
	 * *_a_route_whose_pass_met_a_full_lane_queues_behind). */
	return !hand_off;
}

bool kvr_queue_pumped_here(struct kvr_router *r)
{
	struct kvr_queue *q = r->queue;
	pthread_mutex_lock(&q->lock);
	bool here = q->pumping && pthread_equal(q->pumper, pthread_self());
	pthread_mutex_unlock(&q->lock);
	return here;
}

void kvr_queue_rank_gone(struct kvr_router *r)
{
	struct kvr_queue *q = r->queue;
	pthread_mutex_lock(&q->lock);
	q->full = true;
	pthread_mutex_unlock(&q->lock);
	kvr_queue_pump(r);
	(void)kvr_queue_reap(r, NULL); /* the rank's attempts ended with it */
}

bool kvr_queue_admissible(struct kvr_router *r)
{
	struct kvr_queue *q = r->queue;
	bool found = false;
	kvr_router_settle(r); /* sync_booking: as in a pass */
	pthread_mutex_lock(&q->lock);
	/* Whether an entry is being admitted, or could be, before the first unrestricted one if
	 * that is saturated (every entry after it is then saturated too).  The first unrestricted
	 * entry is q->w's head; a restricted one before it is saturated as its group's first
	 * entry is, looked at once: O(groups), not O(restricted entries) (see the pass).  A full
	 * queue has no room behind anyone: the caller routes as if nobody waited. */
	bool unrestricted;
	struct qentry *u = q->w.head;
	if (q->waiting >= r->cfg.queue_capacity)
		found = false;
	else if (u && (u->state == Q_ADMITTING || !entry_saturated(r, u, &unrestricted)))
		found = true; /* the pump is admitting it, or could */
	else if (q->admitting && (!u || before(q, q->admitting, u)))
		found = true;
	else
		for (struct qgroup *g = q->groups; g && !found; g = g->next)
			found = g->w.head && (!u || before(q, g->w.head, u)) &&
			        !entry_saturated(r, g->w.head, &unrestricted);
	pthread_mutex_unlock(&q->lock);
	return found;
}

/* Takes admitted entry e's outcome into *d and frees it; returns its admission's code.
 * Context: under q->lock. */
static int collect(struct kvr_queue *q, struct qentry *e, struct kvr_decision *d)
{
	*d = e->d;
	int rc = e->rc;
	unlink_entry(q, e);
	__atomic_store_n(&q->uncollected, q->uncollected - 1, __ATOMIC_RELAXED);
	entry_free(e);
	return rc;
}

void kvr_queue_catch_up(void)
{
	/* Pairs with the shard hook's fence between the lowered load and its read of the depth
	 * (kvr_admitter_note_unloaded), and with a sync_booking lifecycle call's after its post:
	 * either this route's pass reads the lowered load or the other side sees the request
	 * queued and pumps. */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
}

int kvr_queue_settle(struct kvr_router *r, uint64_t ticket, bool wait, struct kvr_decision *d)
{
	struct kvr_queue *q = r->queue;
	int rc = 0;
	pthread_mutex_lock(&q->lock);
	struct qentry *e = find(q, ticket);
	if (e && e->state == Q_ADMITTED) {
		rc = collect(q, e, d);
	} else if (e) {
		/* A KVR_ROUTE_WAIT request stays held until kvr_route's own wait watches it: a pass
		 * may admit it meanwhile and a reset or removal end its attempt, and the reap took
		 * such an outcome from the call about to collect it (kvr_route returned KVR_ENOENT,
		 * "not queued", with d still KVR_QUEUED: test_route_wait_held). */
		e->waited = wait;
		e->held = wait;
	}
	pthread_mutex_unlock(&q->lock);
	return rc;
}

uint32_t kvr_queue_waiters(struct kvr_router *r)
{
	struct kvr_queue *q = r->queue;
	if (!q)
		return 0;
	pthread_mutex_lock(&q->lock);
	uint32_t n = q->waiters;
	pthread_mutex_unlock(&q->lock);
	return n;
}

size_t kvr_queue_uncollected(struct kvr_router *r)
{
	/* No lock: the shards' hook asks (kvr_admitter_note_unloaded). */
	return r->queue ? __atomic_load_n(&r->queue->uncollected, __ATOMIC_RELAXED) : 0;
}

size_t kvr_queue_depth(struct kvr_router *r)
{
	/* No lock: kvr_route asks on every call whether anyone is waiting. */
	return r->queue ? __atomic_load_n(&r->queue->waiting, __ATOMIC_RELAXED) : 0;
}

/* The detail of a ticket given to fn (kvr_route_wait, kvr_route_cancel) on a router that
 * queues nothing, so issued no ticket (core/error.h). */
static __attribute__((cold, noinline)) int no_queue(const char *fn, uint64_t ticket)
{
	return kvr_fail(KVR_ENOENT,
	                "%s: ticket %" PRIu64
	                " is unknown: this router has no queue (queue_threshold 0)",
	                fn, ticket);
}

/* The detail of a wait that ended without an admission (core/error.h). */
static __attribute__((cold, noinline)) int wait_failed(const struct kvr_router *r, int rc,
                                                       uint64_t ticket, uint64_t deadline_ns,
                                                       bool admission)
{
	if (admission) /* its own code (its ranks went away: KVR_ENOENT, no memory) */
		return kvr_fail(rc, "kvr_route_wait: ticket %" PRIu64 "'s admission failed: %s",
		                ticket, kvr_strerror(rc));
	switch (rc) {
	case KVR_ENOENT:
		return kvr_fail(rc,
		                "kvr_route_wait: ticket %" PRIu64
		                " was collected or cancelled by another thread meanwhile, or its "
		                "attempt ended before anyone collected its admission",
		                ticket);
	case KVR_ESHUTDOWN:
		return kvr_fail(rc, "kvr_route_wait: %s", kvr_router_gone(r));
	case KVR_ETIMEDOUT:
		return kvr_fail(rc,
		                "kvr_route_wait: deadline_ns %" PRIu64 " passed; ticket %" PRIu64
		                " stays queued",
		                deadline_ns, ticket);
	default:
		return kvr_fail(rc, "kvr_route_wait: ticket %" PRIu64 "'s admission failed: %s",
		                ticket, kvr_strerror(rc));
	}
}

int kvr_route_wait(struct kvr_router *r, uint64_t ticket, uint64_t deadline_ns,
                   struct kvr_decision *d)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!r || !d || ticket == 0)
		return kvr_fail(KVR_EINVAL, "kvr_route_wait: %s",
		                !r   ? "router is NULL"
		                : !d ? "d is NULL"
		                     : "ticket is 0");
	if (kvr_fork_inherited(r)) /* its queue's lock may be held by a thread of the parent */
		return kvr_fail(KVR_ESHUTDOWN, "kvr_route_wait: %s", kvr_router_gone(r));
	if (!r->queue)
		return no_queue("kvr_route_wait", ticket);
	/* The clock is read off the queue's lock: a clock that makes a lifecycle call pumps the
	 * queue, which takes the lock (it waited for itself). */
	return kvr_queue_wait(r, ticket, deadline_ns,
	                      deadline_ns && kvr_clock_now(&r->clock) >= deadline_ns, d);
}

int kvr_queue_wait(struct kvr_router *r, uint64_t ticket, uint64_t deadline_ns, bool late,
                   struct kvr_decision *d)
{
	/* Its own, for kvr_route's wait: the condition wait below is a cancellation point, and a
	 * thread cancelled there ended holding the queue's lock (test_cancel hung). */
	KVR_NOCANCEL(); /* sync/nocancel.h */
	struct kvr_queue *q = r->queue;
	pthread_mutex_lock(&q->lock);
	struct qentry *e = find(q, ticket);
	if (!e) {
		pthread_mutex_unlock(&q->lock);
		return kvr_fail(KVR_ENOENT,
		                "kvr_route_wait: ticket %" PRIu64
		                " is not queued (unknown, collected, cancelled, or its admission "
		                "dropped uncollected once its attempt ended)",
		                ticket);
	}
	/* Inside the admission pass (on_admit): only that pass admits it, and it waits for this
	 * call (before, the wait ran out its deadline, for good without one). */
	if (e->state != Q_ADMITTED && q->pumping && pthread_equal(q->pumper, pthread_self())) {
		pthread_mutex_unlock(&q->lock);
		return kvr_fail(
		    KVR_EBUSY,
		    "kvr_route_wait: called inside the queue's admission pass (on_admit): "
		    "only that pass admits ticket %" PRIu64
		    ", which stays queued (on_admit tells its outcome unless a wait "
		    "collects it)",
		    ticket);
	}
	/* From inside the router (its clock, a callback, one of its threads or shards): a wait
	 * there can wait for the very call it runs in: the admission pass that read the clock,
	 * the finish whose pass would admit the ticket, the shard a sync_booking pass waits for
	 * (before, each waited for good without a deadline; test_queue_clock_calls).  It takes an
	 * outcome that is there and honours a deadline that has passed; it never sleeps. */
	if (e->state != Q_ADMITTED && !late && kvr_router_runs_thread(r)) {
		pthread_mutex_unlock(&q->lock);
		return kvr_fail(
		    KVR_EBUSY,
		    "kvr_route_wait: called inside the router (its clock, a callback, or "
		    "one of its threads), where a wait could wait for the call it runs "
		    "in: ticket %" PRIu64 " is not admitted yet and stays queued",
		    ticket);
	}
	e->waited = true;
	e->watched++;    /* its outcome is this wait's (or another's) to collect: kept till then */
	e->held = false; /* a KVR_ROUTE_WAIT's: watched now (kvr_queue_settle) */
	q->waiters++;
	int rc;
	bool admission = false;
	for (;;) {
		/* Found again after every sleep: another waiter may have collected the ticket or a
		 * cancel freed it meanwhile. */
		if (!(e = find(q, ticket))) {
			rc = KVR_ENOENT;
			break;
		}
		if (e->state == Q_ADMITTED) {
			rc = collect(q, e, d);
			admission = rc != 0;
			break;
		}
		if (q->closing) {
			e->watched--;
			rc = KVR_ESHUTDOWN;
			break;
		}
		if (late) {
			e->watched--;
			rc = KVR_ETIMEDOUT;
			kvr_metrics_add(kvr_metrics_local(r->metrics), KVR_C_QUEUE_TIMEOUTS, 1);
			break;
		}
		/* The router clock may be virtual: wake every millisecond to re-read it. */
		kvr_cond_wait_ns(&q->cond, &q->lock, 1000000);
		/* And pump: the shards lower load on their own threads (a finish applied after
		 * its call returned, a lease expired, a rank removed), which pump nothing, so a
		 * request stayed queued on an idle rank until some later call pumped (a finish
		 * then a route at once: the wait timed out every time). */
		pthread_mutex_unlock(&q->lock);
		kvr_queue_pump(r);
		late = deadline_ns && kvr_clock_now(&r->clock) >= deadline_ns;
		pthread_mutex_lock(&q->lock);
	}
	/* The detail is written while this wait still holds the router: a destroy frees it once
	 * the last waiter has left (it read the freed router for KVR_ESHUTDOWN's detail). */
	int ret = rc ? wait_failed(r, rc, ticket, deadline_ns, admission) : 0;
	q->waiters--;
	pthread_cond_broadcast(&q->cond);
	pthread_mutex_unlock(&q->lock);
	return ret;
}

int kvr_route_cancel(struct kvr_router *r, uint64_t ticket)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!r || ticket == 0)
		return kvr_fail(KVR_EINVAL, "kvr_route_cancel: %s",
		                !r ? "router is NULL" : "ticket is 0");
	if (kvr_fork_inherited(r))
		return kvr_fail(KVR_ESHUTDOWN, "kvr_route_cancel: %s", kvr_router_gone(r));
	struct kvr_queue *q = r->queue;
	if (!q)
		return no_queue("kvr_route_cancel", ticket);
	const bool inside = kvr_router_runs_thread(r);
	pthread_mutex_lock(&q->lock);
	struct qentry *e = find(q, ticket);
	/* Being admitted, and called inside the router (its clock read by the pass that admits
	 * the ticket, or by the shard a sync_booking pass waits for): waiting for the outcome
	 * would wait for itself (before, it did, for good; test_queue_clock_calls). */
	if (e && e->state == Q_ADMITTING && !q->closing && inside) {
		pthread_mutex_unlock(&q->lock);
		return kvr_fail(
		    KVR_EBUSY,
		    "kvr_route_cancel: ticket %" PRIu64
		    " is being admitted and the call comes from inside the router (its "
		    "clock, a callback, or one of its threads), which that admission may "
		    "be waiting for: nothing cancelled",
		    ticket);
	}
	q->waiters++;
	/* The pump is routing it right now: wait for the outcome (one routing decision).  Admitted,
	 * it is not queued any more (KVR_ENOENT); still saturated, it is waiting again. */
	while ((e = find(q, ticket)) && e->state == Q_ADMITTING && !q->closing)
		pthread_cond_wait(&q->cond, &q->lock);
	int rc = KVR_ENOENT;
	struct kvr_decision d;
	bool end = false;
	if (e && e->state == Q_WAITING && !q->closing) {
		unlink_entry(q, e);
		__atomic_store_n(&q->waiting, q->waiting - 1, __ATOMIC_RELAXED);
		entry_free(e);
		rc = 0;
	} else if (e && e->state == Q_ADMITTED && !q->closing) {
		/* Admitted, and nobody collected it: its caller gave up on it (a wait timed out,
		 * then the admission won the race with this cancel).  Nobody was told its attempt,
		 * so the cancel takes the outcome and ends the attempt, instead of leaving both for
		 * a collection that the cancel's caller will not make (the record stayed in the
		 * list for good, the attempt's load until its lease expired). */
		end = collect(q, e, &d) == 0;
		rc = 0;
	}
	q->waiters--;
	pthread_cond_broadcast(&q->cond);
	pthread_mutex_unlock(&q->lock);
	/* Off the lock: an abort pumps the queue.  It ends the attempt unless its lease expired
	 * or its rank went meanwhile (KVR_ESTALE: ended already), exactly once either way; a
	 * failure to post (no memory to register this thread) leaves it to its lease's expiry. */
	if (end) {
		char saved[KVR_ERROR_DETAIL_MAX];
		memcpy(saved, kvr_last_error(), sizeof(saved));
		if (kvr_request_abort(r, d.attempt)) /* its detail is not this call's */
			kvr_error_restore(saved);
	}
	if (rc)
		return kvr_fail(rc,
		                "kvr_route_cancel: ticket %" PRIu64
		                " is not queued (its outcome told to on_admit or collected, "
		                "cancelled, dropped uncollected, unknown, or the router is being "
		                "destroyed)",
		                ticket);
	return 0;
}
