/*
 * shards/load.c - active load of one rank (issue 5, part D), the pinned set kept in RUNS
 * (issue 11 item 3).
 *
 * The idea (after Dynamo's ActiveSequences).  Decode load is the KV blocks the running requests
 * hold; two requests sharing a prefix hold its blocks once, so blocks are deduplicated with a
 * pin count per sequence hash.  Prefill load is the tokens still to be prefilled; requests in
 * prefill form a FIFO in admission order, and when an expected prefill duration is known the
 * head (the oldest, the one the engine is working on) decays linearly to zero over it, so a rank
 * deep into a long prefill does not look as busy as one that has just started it.
 *
 * Runs.  A request pins its whole chain from the root, so the pinned set is prefix-closed along
 * every request's chain and a block's pin count never exceeds its parent's.  The set is kept as
 * RUNS of consecutive chain blocks with one pin count each (an 8-byte hash per block, no map
 * entry per block): pinning walks the request's chain along the runs (a sequential compare,
 * probing a head map only at run tails), splits the run where the request leaves it, bumps one
 * count per run and makes one new run of the blocks nobody pinned; unpinning drops one count per
 * run and frees the runs reaching zero, which form a tail of the chain.  A request keeps its
 * pieces as (first run, length); a later split keeps the first part in place and links the rest
 * behind it (the split chain), as shards/lru.c does.  Why the head map need only be probed at
 * tails: a run's head is created below a tail (a new run continues the hit prefix or the
 * request's last piece; a split ends its left part there), runs never merge, and a parent stays
 * pinned while its child is, so that tail stays.  Each hash is pinned at most once, so there is
 * one run per head hash.
 *
 * Publishing (kvr_load_publish).  Routers need each rank's pinned depth of a prompt without a
 * round trip (the deduplicated decode load, issue 11 item 4).  Every run then has a copy in the
 * shared shards/pinmap.h table (head hash, rank, array, length), made when the run is made,
 * shrunk in place when it is split, unlinked when it is freed and freed with its array after a
 * grace period (one call_rcu per finish).  The array is shared, not copied: a run's array is
 * immutable and owned by exactly one run at a time (a split moves it to the side that keeps it).
 * So publishing costs O(1) per run made, split or freed - no per-block work.
 *
 * Invariants: active_blocks == sum of run lengths; a run's pins == requests whose pieces cover
 * it; prefill_sum == sum of tokens of requests on the prefill list.
 * Requirement: chained sequence hashes (a seq hash names its whole prefix: core/hash), and
 * add_output continues the request's chain.  tests/ref/load_ref.c is the per-block version, the
 * oracle of tests/unit/test_load.c.
 *
 * Crafted hashes.  The router does not check that a caller's hashes chain (kvr_request: a
 * prompt given as local hashes has its first local hash as its root's sequence hash, and
 * seq_hashes are taken as given), so a hash can come at two places: a root on another chain's
 * interior hash, or a prompt repeating a hash.  Then a split can make a head that another run
 * already has, and a walk can come back to a run it already took.  Both broke the structure (a
 * second head entry, removed for the wrong run, left the map naming a freed run: a shard thread's
 * SEGV; a second hit in one run split the first hit's run after it was counted, so a finish
 * unpinned runs it never pinned).  So a head already in the map is not entered again (that run
 * is found by no walk: it is pinned and freed by its own requests, never shared or split), a
 * run's entry is removed only if it is that run's, and a walk stops at a run it already took
 * this walk (the rest becomes a run of its own).  Honest chains never get there: each hash is
 * pinned at most once.  The load of a crafted prompt is then an upper bound (less sharing).
 * Failure model: splits first (no observable change), then every reservation, then mutation.
 */
#include "shards/load.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/chain.h"
#include "shards/pinmap.h"
#include "shards/u64map.h"

#define NIL UINT32_MAX

struct run {
	uint64_t *mem;
	uint32_t start, len, cap;
	uint32_t pins;
	uint32_t sprev, snext;  /* split chain */
	uint32_t next;          /* free list */
	uint32_t seen;          /* the walk that last took it (walk: crafted hashes) */
	struct kvr_pinrun *pub; /* its published copy (when the load publishes), owns mem */
};

struct piece {
	uint32_t run, len;
};

struct req {
	uint64_t attempt;
	struct piece *p;
	uint32_t n, cap;
	uint32_t nblocks;
	uint32_t in_prefill;
	uint64_t last_seq; /* valid when nblocks > 0 */
	uint64_t tokens;   /* prefill tokens, 0 once done */
	uint64_t start;    /* admission time */
	uint64_t order;    /* admission counter: the prefill FIFO order */
};

struct kvr_load {
	uint64_t expected_prefill;
	struct req *r;
	uint32_t n_req, cap_req;
	struct kvr_u64map by_attempt;
	struct run *runs;
	uint32_t runs_cap, runs_live, free_head;
	struct kvr_u64map heads; /* head hash -> run (the first run made with that head) */
	uint32_t walk_id;        /* the current pin's walk (struct run's seen) */
	uint64_t pinned;         /* distinct pinned hashes */
	uint64_t prefill_sum, n_prefill, next_order;
	/* Oldest in-prefill request, cached: the attempt (valid while oldest_valid). */
	uint64_t oldest_attempt;
	int oldest_valid;
	struct kvr_run_hit *hits;
	size_t hits_cap;
	/* Publishing for routers (kvr_load_publish): the map, this rank's slot, the runs freed
	 * by the current command (freed after a grace period), publish failures. */
	struct kvr_pinmap *pm;
	uint32_t pm_slot;
	struct kvr_pinrun_retire retired;
	uint64_t publish_errors;
};

static inline uint64_t *seq_of(const struct run *g)
{
	return g->mem + g->start;
}

int kvr_load_create(uint64_t expected_prefill_ns, struct kvr_load **out)
{
	if (!out)
		return KVR_EINVAL;
	struct kvr_load *l = kvr_calloc(1, sizeof(*l));
	if (!l)
		return KVR_ENOMEM;
	l->expected_prefill = expected_prefill_ns;
	l->free_head = NIL;
	kvr_u64map_init(&l->by_attempt);
	kvr_u64map_init(&l->heads);
	*out = l;
	return 0;
}

void kvr_load_destroy(struct kvr_load *l)
{
	if (!l)
		return;
	for (uint32_t i = 0; i < l->n_req; i++)
		kvr_free(l->r[i].p, l->r[i].cap * sizeof(struct piece));
	for (uint32_t i = 0; i < l->runs_cap; i++) {
		struct run *g = &l->runs[i];
		if (g->pub) { /* readers may still walk it: it goes after a grace period */
			kvr_pinmap_del(l->pm, g->pub);
			kvr_pinrun_retire(&l->retired, g->pub);
		} else {
			kvr_free_transient(g->mem, (size_t)g->cap * sizeof(uint64_t));
		}
	}
	kvr_pinrun_retire_flush(&l->retired);
	kvr_free(l->runs, (size_t)l->runs_cap * sizeof(struct run));
	kvr_free(l->r, (size_t)l->cap_req * sizeof(struct req));
	kvr_free(l->hits, l->hits_cap * sizeof(struct kvr_run_hit));
	kvr_u64map_fini(&l->by_attempt);
	kvr_u64map_fini(&l->heads);
	kvr_free(l, sizeof(*l));
}

static struct req *find(const struct kvr_load *l, uint64_t attempt)
{
	uint32_t *ix = kvr_u64map_find(&l->by_attempt, attempt);
	return ix ? &l->r[*ix] : NULL;
}

int kvr_load_publish(struct kvr_load *l, struct kvr_pinmap *pm, uint32_t slot)
{
	if (!l || !pm || l->runs_live)
		return KVR_EINVAL;
	l->pm = pm;
	l->pm_slot = slot;
	return 0;
}

/* A published copy for a run about to be made (NULL when the load does not publish).
 * false: no memory. */
static bool pub_reserve(const struct kvr_load *l, struct kvr_pinrun **d)
{
	*d = NULL;
	return !l->pm || (*d = kvr_calloc_transient(1, sizeof(**d))) != NULL;
}

/* Fills d from run g (which owns g->mem) and publishes it. */
static void pub_make(struct kvr_load *l, struct run *g, struct kvr_pinrun *d)
{
	g->pub = d;
	if (!d)
		return;
	d->head = seq_of(g)[0];
	d->slot = l->pm_slot;
	d->len = g->len;
	d->seqs = seq_of(g);
	d->mem = g->mem;
	d->mem_cap = g->cap;
	if (kvr_pinmap_add(l->pm, d))
		l->publish_errors++;
}

/* ---------------------------------------------------------------- runs */

static int reserve_runs(struct kvr_load *l, size_t n)
{
	size_t need = (size_t)l->runs_live + n;
	if (need >= NIL)
		return KVR_ERANGE;
	if (need <= l->runs_cap)
		return 0;
	size_t nc = (size_t)l->runs_cap * 2 > need ? (size_t)l->runs_cap * 2 : need;
	if (nc < 16)
		nc = 16;
	if (nc >= NIL)
		nc = NIL - 1;
	struct run *g = kvr_realloc(l->runs, (size_t)l->runs_cap * sizeof(*g), nc * sizeof(*g));
	if (!g)
		return KVR_ENOMEM;
	for (size_t i = nc; i-- > l->runs_cap;) {
		g[i].mem = NULL;
		g[i].cap = 0;
		g[i].pub = NULL;
		g[i].next = l->free_head;
		l->free_head = (uint32_t)i;
	}
	l->runs = g;
	l->runs_cap = (uint32_t)nc;
	return 0;
}

static uint32_t run_new(struct kvr_load *l)
{
	uint32_t i = l->free_head;
	struct run *g = &l->runs[i];
	l->free_head = g->next;
	l->runs_live++;
	memset(g, 0, sizeof(*g));
	g->sprev = g->snext = g->next = NIL;
	return i;
}

static void run_free(struct kvr_load *l, uint32_t i)
{
	struct run *g = &l->runs[i];
	kvr_u64map_remove_val(&l->heads, seq_of(g)[0], i); /* only its own (crafted hashes) */
	if (g->sprev != NIL)
		l->runs[g->sprev].snext = g->snext;
	if (g->snext != NIL)
		l->runs[g->snext].sprev = g->sprev;
	if (g->pub) { /* routers may be walking it: freed with its array after a grace period */
		kvr_pinmap_del(l->pm, g->pub);
		kvr_pinrun_retire(&l->retired, g->pub);
		g->pub = NULL;
	} else {
		kvr_free_transient(g->mem, (size_t)g->cap * sizeof(uint64_t));
	}
	g->mem = NULL;
	g->cap = 0;
	g->next = l->free_head;
	l->free_head = i;
	l->runs_live--;
}

/* Splits run i before off (0 < off < len), as shards/lru.c's split: the smaller side is
 * copied, the new right part joins the split chain after i.  0 or KVR_ENOMEM/ERANGE (no
 * change). */
static int split(struct kvr_load *l, uint32_t i, uint32_t off)
{
	int rc;
	if ((rc = reserve_runs(l, 1)) || (rc = kvr_u64map_reserve(&l->heads, 1)))
		return rc;
	struct run *a = &l->runs[i];
	uint32_t len = a->len, rest = len - off;
	size_t ncopy = kvr_hashes_split_copy(len, off);
	uint64_t *m = kvr_alloc_transient(ncopy * sizeof(uint64_t));
	struct kvr_pinrun *d;
	if (!m || !pub_reserve(l, &d)) {
		kvr_free_transient(m, m ? ncopy * sizeof(uint64_t) : 0);
		return KVR_ENOMEM;
	}
	uint32_t j = run_new(l);
	a = &l->runs[i];
	struct run *b = &l->runs[j];
	struct kvr_hashes ha = {a->mem, a->start, a->cap}, hb;
	kvr_hashes_split(&ha, &hb, len, off, m);
	a->mem = ha.mem, a->start = ha.start, a->cap = ha.cap;
	b->mem = hb.mem, b->start = hb.start, b->cap = hb.cap;
	a->len = off;
	b->len = rest;
	b->pins = a->pins;
	b->sprev = i;
	b->snext = a->snext;
	if (a->snext != NIL)
		l->runs[a->snext].sprev = j;
	a->snext = j;
	kvr_u64map_insert_absent(&l->heads, seq_of(b)[0], j); /* crafted: may be there */
	/* Readers: the right part is published first, then the left one shrinks (len first, then
	 * its array, maybe a copy: pinmap.h), so a walk sees the whole run either way.  The array a
	 * owned belongs to b's copy when b kept it. */
	struct kvr_pinrun *p = a->pub;
	pub_make(l, b, p ? d : NULL);
	if (p) {
		__atomic_store_n(&p->len, off, __ATOMIC_RELEASE);
		__atomic_store_n(&p->seqs, (const uint64_t *)seq_of(a), __ATOMIC_RELEASE);
		p->mem = a->mem;
		p->mem_cap = a->cap;
	} else {
		kvr_free_transient(d, d ? sizeof(*d) : 0);
	}
	return 0;
}

/*
 * Walks seq[0], seq[stride], ... (n hashes) from the root (tail == NIL) or from the tail of run
 * `tail`: returns how many leading hashes are pinned; records the runs they lie in as hits (room
 * for hcap: *nh = SIZE_MAX when that is not enough), each run once: with hits, a run already
 * taken by this walk (a crafted prompt repeating a hash) ends it, and runs are marked taken
 * (seen = l->walk_id, which the caller made new).  Without hits nothing is written.
 */
static size_t walk(const struct kvr_load *l, const uint64_t *seq, size_t stride, size_t n,
                   uint32_t tail, struct kvr_run_hit *hits, size_t hcap, size_t *nh)
{
	size_t k = 0;
	uint32_t i = tail;
	uint32_t o = tail == NIL ? 0 : l->runs[tail].len - 1;
	while (k < n) {
		if (i == NIL || o + 1 >= l->runs[i].len) { /* root or a tail: the head map */
			uint32_t *v = kvr_u64map_find(&l->heads, seq[k * stride]);
			if (!v)
				break;
			i = *v;
			o = 0;
			if (hits) {
				struct run *g = (struct run *)&l->runs[i]; /* l is the caller's */
				if (g->seen == l->walk_id)
					break; /* taken already: a hash repeated (crafted) */
				g->seen = l->walk_id;
			}
		} else if (seq_of(&l->runs[i])[o + 1] == seq[k * stride]) {
			o++;
		} else {
			break; /* nothing hangs below an interior block */
		}
		const struct run *g = &l->runs[i];
		uint32_t more = kvr_chain_agree(seq_of(g) + o, g->len - 1 - o, seq + k * stride,
		                                stride, n - k - 1);
		uint32_t take = 1 + more;
		o += more;
		if (hits) {
			struct kvr_run_hit *last = *nh ? &hits[*nh - 1] : NULL;
			if (last && last->run == i && last->off + last->len == o + 1 - take) {
				last->len += take;
			} else if (*nh == hcap) {
				*nh = SIZE_MAX;
				return k;
			} else {
				hits[(*nh)++] = (struct kvr_run_hit){i, o + 1 - take, take};
			}
		}
		k += take;
	}
	return k;
}

/* The last run of a request's last piece (its split chain walked for the piece's length). */
static uint32_t piece_last(const struct kvr_load *l, const struct piece *p)
{
	uint32_t i = p->run, left = p->len;
	while (left > l->runs[i].len) {
		left -= l->runs[i].len;
		i = l->runs[i].snext;
	}
	return i;
}

static int reserve_pieces(struct req *q, size_t n)
{
	if ((size_t)q->n + n <= q->cap)
		return 0;
	size_t nc = (size_t)q->cap * 2 > (size_t)q->n + n ? (size_t)q->cap * 2 : (size_t)q->n + n;
	if (nc < 4)
		nc = 4;
	if (nc >= NIL)
		return KVR_ERANGE;
	struct piece *p = kvr_realloc(q->p, q->cap * sizeof(*p), nc * sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	q->p = p;
	q->cap = (uint32_t)nc;
	return 0;
}

/* Runs as a run store, for kvr_hits_whole. */
static uint32_t run_len(const void *l, uint32_t i)
{
	return ((const struct kvr_load *)l)->runs[i].len;
}
static uint32_t run_next(const void *l, uint32_t i)
{
	return ((const struct kvr_load *)l)->runs[i].snext;
}
static int run_split(void *l, uint32_t i, uint32_t off)
{
	return split(l, i, off);
}
static const struct kvr_run_ops run_ops = {run_len, run_next, run_split};

/*
 * Pins seq[0], seq[stride], ... (n hashes) for request q, continuing its chain (from the root if
 * it has no blocks): splits, reserves, then pins (a new run is published).  0, KVR_ERANGE or
 * KVR_ENOMEM (nothing observable changed).
 */
static int pin(struct kvr_load *l, struct req *q, const uint64_t *seq, size_t stride, size_t n)
{
	if (n == 0)
		return 0;
	if ((size_t)q->nblocks + n >= NIL)
		return KVR_ERANGE;
	uint32_t tail = q->nblocks ? piece_last(l, &q->p[q->n - 1]) : NIL;
	/* The hit pieces: a few, not one per block (room for n kept 32-64 KiB a rank at 2,048
	 * blocks: 1.5 B per (block, rank) in bench_footprint at 32k prompts, as shards/lru.c's
	 * acquire did); grown when a walk needs more and walked again. */
	size_t nh, hit, need = 1;
	int rc;
	for (;;) {
		if ((rc = kvr_grow((void **)&l->hits, &l->hits_cap, need, sizeof(*l->hits))))
			return rc;
		nh = 0;
		l->walk_id++; /* after a wrap a stale mark only ends a walk early: less sharing */
		hit = walk(l, seq, stride, n, tail, l->hits, l->hits_cap, &nh);
		if (nh != SIZE_MAX)
			break;
		need = l->hits_cap + 1;
	}
	if ((rc = kvr_hits_whole(l, &run_ops, l->hits, nh)))
		return rc;
	uint32_t nnew = (uint32_t)(n - hit);
	uint64_t *m = NULL;
	if ((rc = reserve_runs(l, 1)) || (rc = kvr_u64map_reserve(&l->heads, 1)) ||
	    (rc = reserve_pieces(q, nh + 1)))
		return rc;
	struct kvr_pinrun *d = NULL;
	if (nnew && !(m = kvr_alloc_transient((size_t)nnew * sizeof(uint64_t))))
		return KVR_ENOMEM;
	if (nnew && !pub_reserve(l, &d)) {
		kvr_free_transient(m, (size_t)nnew * sizeof(uint64_t));
		return KVR_ENOMEM;
	}
	/* From here on nothing fails. */
	for (size_t k = 0; k < nh; k++) {
		l->runs[l->hits[k].run].pins++;
		q->p[q->n++] = (struct piece){l->hits[k].run, l->hits[k].len};
	}
	if (nnew) {
		for (size_t k = 0; k < nnew; k++)
			m[k] = seq[(hit + k) * stride];
		uint32_t i = run_new(l);
		struct run *g = &l->runs[i];
		g->mem = m;
		g->cap = g->len = nnew;
		g->pins = 1;
		kvr_u64map_insert_absent(&l->heads, m[0], i); /* crafted: may be there */
		q->p[q->n++] = (struct piece){i, nnew};
		l->pinned += nnew;
		pub_make(l, g, d);
	}
	q->nblocks += (uint32_t)n;
	q->last_seq = seq[(n - 1) * stride];
	return 0;
}

/* ---------------------------------------------------------------- commands */

int kvr_load_add(struct kvr_load *l, uint64_t attempt, const uint64_t *seq, size_t stride, size_t n,
                 uint64_t prefill_tokens, uint64_t now)
{
	if (!l || (n > 0 && (!seq || !stride)))
		return KVR_EINVAL;
	if (find(l, attempt))
		return KVR_EEXIST;
	if (l->n_req == l->cap_req) {
		size_t nc = l->cap_req ? (size_t)l->cap_req * 2 : 16;
		struct req *r = kvr_realloc(l->r, (size_t)l->cap_req * sizeof(*r), nc * sizeof(*r));
		if (!r)
			return KVR_ENOMEM;
		l->r = r;
		l->cap_req = (uint32_t)nc;
	}
	struct req *q = &l->r[l->n_req];
	memset(q, 0, sizeof(*q));
	int rc;
	if ((rc = kvr_u64map_reserve(&l->by_attempt, 1)) || (rc = pin(l, q, seq, stride, n))) {
		kvr_free(q->p, q->cap * sizeof(struct piece));
		return rc;
	}
	q->attempt = attempt;
	q->tokens = prefill_tokens;
	q->start = now;
	q->order = l->next_order++;
	q->in_prefill = 1;
	kvr_u64map_insert(&l->by_attempt, attempt, l->n_req++);
	l->prefill_sum += prefill_tokens;
	l->n_prefill++;
	if (!l->oldest_valid) { /* nobody else is in prefill */
		l->oldest_attempt = attempt;
		l->oldest_valid = 1;
	}
	return 0;
}

/* Recomputes the oldest in-prefill request (O(requests); only when the oldest leaves). */
static void refresh_oldest(struct kvr_load *l)
{
	const struct req *best = NULL;
	for (uint32_t i = 0; i < l->n_req; i++)
		if (l->r[i].in_prefill && (!best || l->r[i].order < best->order))
			best = &l->r[i];
	l->oldest_valid = best != NULL;
	l->oldest_attempt = best ? best->attempt : 0;
}

static void end_prefill(struct kvr_load *l, struct req *q)
{
	if (!q->in_prefill)
		return;
	q->in_prefill = 0;
	l->prefill_sum -= q->tokens;
	l->n_prefill--;
	q->tokens = 0;
	if (l->oldest_valid && l->oldest_attempt == q->attempt)
		refresh_oldest(l);
}

int kvr_load_prefill_done(struct kvr_load *l, uint64_t attempt)
{
	if (!l)
		return KVR_EINVAL;
	struct req *q = find(l, attempt);
	if (!q)
		return KVR_ENOENT;
	end_prefill(l, q);
	return 0;
}

int kvr_load_add_output(struct kvr_load *l, uint64_t attempt, const uint64_t *seq, size_t stride,
                        size_t n)
{
	if (!l || (n > 0 && (!seq || !stride)))
		return KVR_EINVAL;
	struct req *q = find(l, attempt);
	if (!q)
		return KVR_ENOENT;
	return pin(l, q, seq, stride, n);
}

int kvr_load_finish(struct kvr_load *l, uint64_t attempt)
{
	if (!l)
		return KVR_EINVAL;
	uint32_t *ix = kvr_u64map_find(&l->by_attempt, attempt);
	if (!ix)
		return KVR_ENOENT;
	uint32_t i = *ix;
	struct req *q = &l->r[i];
	/* The runs reaching 0 pins form a tail of the chain; finish never allocates. */
	for (uint32_t k = 0; k < q->n; k++) {
		uint32_t g = q->p[k].run, left = q->p[k].len;
		while (left) {
			struct run *x = &l->runs[g];
			uint32_t next = x->snext, len = x->len;
			left -= len;
			if (--x->pins == 0) {
				l->pinned -= len;
				run_free(l, g);
			}
			g = next;
		}
	}
	kvr_pinrun_retire_flush(&l->retired);
	kvr_u64map_remove(&l->by_attempt, attempt);
	kvr_free(q->p, q->cap * sizeof(struct piece));
	int was_prefill = q->in_prefill;
	uint64_t tokens = q->tokens;
	uint32_t last = --l->n_req;
	if (i != last) {
		l->r[i] = l->r[last];
		*kvr_u64map_find(&l->by_attempt, l->r[i].attempt) = i;
	}
	if (was_prefill) {
		l->prefill_sum -= tokens;
		l->n_prefill--;
		if (l->oldest_valid && l->oldest_attempt == attempt)
			refresh_oldest(l);
	}
	return 0;
}

uint64_t kvr_load_prefill_tokens(const struct kvr_load *l, uint64_t now)
{
	if (!l)
		return 0;
	uint64_t sum = l->prefill_sum;
	if (l->expected_prefill == 0 || !l->oldest_valid)
		return sum;
	const struct req *q = find(l, l->oldest_attempt);
	uint64_t el = now > q->start ? now - q->start : 0;
	uint64_t d = l->expected_prefill;
	uint64_t kept = el >= d ? 0 : (uint64_t)((unsigned __int128)q->tokens * (d - el) / d);
	return sum - q->tokens + kept;
}

uint64_t kvr_load_decay_end(const struct kvr_load *l)
{
	if (!l || l->expected_prefill == 0 || !l->oldest_valid)
		return 0;
	const struct req *q = find(l, l->oldest_attempt);
	uint64_t end = q->start + l->expected_prefill;
	return end < q->start ? UINT64_MAX : end;
}

size_t kvr_load_pinned_depth(const struct kvr_load *l, const uint64_t *seq, size_t n)
{
	if (!l || !seq)
		return 0;
	return walk(l, seq, 1, n, NIL, NULL, 0, NULL);
}

int kvr_load_potential(const struct kvr_load *l, const uint64_t *seq, size_t n,
                       uint64_t uncached_tokens, uint64_t now, struct kvr_load_potential *out)
{
	if (!l || !out || (n > 0 && !seq))
		return KVR_EINVAL;
	out->decode_blocks = l->pinned + (n - kvr_load_pinned_depth(l, seq, n));
	out->prefill_tokens = kvr_load_prefill_tokens(l, now) + uncached_tokens;
	return 0;
}

void kvr_load_stats(const struct kvr_load *l, struct kvr_load_stats *st)
{
	memset(st, 0, sizeof(*st));
	if (!l)
		return;
	st->active_blocks = l->pinned;
	st->prefill_tokens = l->prefill_sum;
	st->active_requests = l->n_req;
	st->in_prefill = l->n_prefill;
	st->publish_errors = l->publish_errors;
}

size_t kvr_load_bytes(const struct kvr_load *l)
{
	if (!l)
		return 0;
	size_t b = sizeof(*l) + (size_t)l->runs_cap * sizeof(struct run) +
	           (l->heads.cap + l->by_attempt.cap) * sizeof(struct kvr_u64map_slot) +
	           (size_t)l->cap_req * sizeof(struct req) +
	           l->hits_cap * sizeof(struct kvr_run_hit);
	for (uint32_t i = 0; i < l->runs_cap; i++)
		b += (size_t)l->runs[i].cap * sizeof(uint64_t);
	for (uint32_t i = 0; i < l->n_req; i++)
		b += l->r[i].cap * sizeof(struct piece);
	if (l->pm)
		b += (size_t)l->runs_live * sizeof(struct kvr_pinrun);
	return b;
}
