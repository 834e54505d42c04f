/*
 * shards/ttl.c - TTL retention of one rank (issue 5, part B), kept in runs (issue 11 item 3).
 *
 * The idea.  Every entry of one store has the same ttl, so expiries are issued in time order:
 * a FIFO list ordered by expiry is already a perfect priority queue.  A refresh unlinks the entry
 * (O(1), doubly linked) and appends it with its new expiry; expiry pops from the head.  No heap,
 * no timing wheel.
 *
 * Runs.  An entry is a RUN: consecutive blocks of one chain (positions pos, pos + 1, ...) with
 * one expiry.  The blocks a record adds are one run per stretch of new blocks; a record that
 * refreshes a part of a run splits it there (the refreshed part moves to the tail with the new
 * expiry, the rest keeps its place and its own expiry).  Expiry pops whole runs from the head
 * and emits each as one evicted run (a chain, parent first).  Because sequence hashes are
 * chained (core/hash: a hash names its whole prefix), a record or an overlap walks a run with
 * ONE compare at its far end and a binary search where it differs (shards/chain.h), so a record
 * costs O(runs it touches * log) plus the new blocks, an overlap O(runs * log): no per-block
 * work for the refreshed part of a prompt, which is most of a long cached one.
 *
 * Finding a block.  seq -> run in shards/u64map.h, for EVERY held block: a record may start
 * inside a run (an output block materialized again, in other pieces) or find a run after a
 * gap (a block refreshed by output outlives its parent), and a per-block map finds both in
 * O(1).  Entering a new block costs one insert, like copying its hash in.  The offset of a
 * block in its run is its position minus the run's (chained hashes have one position); where
 * the caller's position disagrees, a scan of the run finds it (only for bad input).
 *
 * Lazy deletion.  Expiry does not touch the map: it frees whole runs, so it costs O(runs) plus
 * copying the hashes out (it did one map removal per block, 89 % of its instructions).  A map
 * entry carries its run slot's generation (the slot's spare word), and freeing a slot bumps
 * it, so the entries of an expired run are stale: a lookup that finds one treats the block as
 * absent (and the record's plan removes it where it would insert the key anyway).  The expired
 * run goes to a grave (a FIFO of runs, keeping the blob with their hashes) and records remove
 * its entries with bounded work each: BURY_PER_NEW per new block plus BURY_PER_CALL, more than
 * expiry makes stale in a steady state, where every block expires once after it was new.  A
 * full table buries a bounded number more (BURY_FULL_*), then grows for the live blocks only,
 * as it did when expiry removed them (same memory), dropping stale entries on the way.
 * Between burials stale entries lengthen the probes of absent keys a little.
 *
 * Growth.  The map (shards/ttl_map.c) grows incrementally: a new table, then the entries move a
 * slice per call (each record pays for its new blocks, every record and expiry a little more),
 * lookups probe both tables.  No call rehashes the table or buries every pending grave at once
 * (issue 11 item 3: at 600k held blocks that was a 10 ms record).  Nor is anything else copied
 * whole: run slots come in fixed chunks of RUN_CHUNK (a directory of chunk pointers, 8 bytes
 * per chunk, is the only array that doubles), the graves in a FIFO of chunks.  Invariant: exactly
 * one entry per held block, live (map count - live blocks = stale entries, all of them in graves).
 * After 2^32 reuses of one slot a stale generation could match again: a live entry's run must
 * also hold the hash (offset_of), so such an entry is seen as stale.
 *
 * Hashes.  A record's new hashes are copied into one blob (refcounted); its runs, and the
 * pieces splits make of them, point into it.  A split allocates nothing and copies no hash: it
 * rewrites the map entries of the smaller piece, which gets the new run id (O(smaller side),
 * so a block is moved O(log) times over its life).  A blob is freed with its last run, so a
 * blob whose runs mostly expired keeps its dead hashes until the last one goes (bounded by
 * the record that made it).
 *
 * Buckets.  Expiries are rounded up to a multiple of bucket_ns (default 100 ms).  Two effects:
 * the owner's timer fires at most once per bucket (kvr_ttl_next_expiry() is always a bucket
 * boundary), and a run routed again within the same bucket costs a lookup and nothing else.
 *
 * Invariant: list order == non-decreasing expiry.  A clock that steps backwards (virtual time,
 * tests) could break it, so a new expiry is clamped to at least the tail's.  Split pieces sit
 * next to each other in the list, with the same expiry.
 *
 * All-or-nothing: a record plans first (lookups and compares only), reserves every slot, map
 * entry, output and the blob, then applies without failing.  The per-block store it replaced
 * is tests/ref/ttl_ref.c, the oracle of tests/unit/test_ttl_diff.c.
 */
#include "shards/ttl.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/chain.h"
#include "shards/ttl_map.h"

#define NIL UINT32_MAX

/* Map entries of expired runs a record removes, per new block it enters and per call: more
 * than expiry makes stale in a steady state (each block expires once, after it was new). */
#define BURY_PER_NEW  2
#define BURY_PER_CALL 32
/* ... and, when the map is full and holds such entries, before it grows: enough to make room
 * in a steady state, still bounded by the call's size. */
#define BURY_FULL_PER_NEW  4
#define BURY_FULL_PER_CALL 128
/* Units of the map's migration (shards/ttl_map.c) every record and expiry pays, on top of its
 * inserts' share: a migration ends even while few new blocks come.  Tests lower it to keep
 * tables migrating longer. */
size_t kvr_ttl_mig_per_call = 64;
/* Burials happen (tests turn them off so that tables fill with stale entries and purge). */
bool kvr_ttl_bury_on = true;
#define MIG_PER_CALL kvr_ttl_mig_per_call

struct blob {
	uint32_t refs, cap;
	uint64_t h[];
};

struct run {
	uint64_t expiry;
	uint64_t *h; /* the run's hashes, inside blob */
	struct blob *blob;
	uint32_t pos, len;
	uint32_t prev, next; /* expiry list; next doubles as the free list */
	uint32_t gen;        /* the slot's generation: +1 each time it is freed (never copied) */
	uint32_t seen;       /* the plan that last took it (plan: crafted hashes) */
};

/* An expired run waiting for its map entries to be removed: it keeps its blob's reference. */
struct grave {
	struct blob *blob;
	const uint64_t *h;
	uint32_t pos, len;
};

/* One step of a record's plan: blocks b[k .. k + n) are new (run == NIL) or run's [off, off+n). */
struct step {
	uint32_t k, n, run, off;
};

/* Run slots come in chunks that never move (growth adds one; no copy of the runs, issue 11
 * item 3), found through a directory of chunk pointers (8 bytes per RUN_CHUNK slots). */
#define RUN_SHIFT 8
#define RUN_CHUNK (1u << RUN_SHIFT)
#define RUN_MAX   ((NIL / RUN_CHUNK) * RUN_CHUNK) /* slot ids stay below NIL */

/* Expired runs in a FIFO of chunks (oldest first): a push never copies the queue. */
#define GR_CHUNK 127
struct grave_chunk {
	struct grave_chunk *next;
	struct grave g[GR_CHUNK];
};

struct kvr_ttl {
	uint64_t ttl, bucket;
	struct run **rc; /* chunks of RUN_CHUNK run slots */
	size_t cap, rc_n, rc_cap;
	uint32_t runs, free_head;
	uint32_t head, tail;
	size_t live; /* blocks */
	struct kvr_ttl_map by_seq;
	/* Expired runs whose map entries are still to remove, oldest first: gr_first[gr_hi] is
	 * the oldest, gr_last[gr_ti - 1] the newest; `done` hashes of the oldest are removed
	 * already, `pending` hashes are left in all.  gr_spare: empty chunks reserved. */
	struct grave_chunk *gr_first, *gr_last, *gr_spare;
	size_t gr_hi, gr_ti, gr_n, gr_spare_n, done, pending;
	struct step *plan;
	size_t plan_cap;
	uint32_t plan_id; /* the current plan (struct run's seen) */
};

static bool entry_live(const void *ctx, const struct kvr_u64map_slot *s);

static inline struct run *run_at(const struct kvr_ttl *t, uint32_t i)
{
	return &t->rc[i >> RUN_SHIFT][i & (RUN_CHUNK - 1)];
}

/* kvr_chain_agree's stride over struct kvr_lru_block's seq fields. */
#define BSTRIDE (sizeof(struct kvr_lru_block) / sizeof(uint64_t))

int kvr_ttl_create(uint64_t ttl_ns, uint64_t bucket_ns, struct kvr_ttl **out)
{
	if (!out || ttl_ns == 0)
		return KVR_EINVAL;
	struct kvr_ttl *t = kvr_calloc(1, sizeof(*t));
	if (!t)
		return KVR_ENOMEM;
	t->ttl = ttl_ns;
	t->bucket = bucket_ns;
	t->free_head = NIL;
	t->head = t->tail = NIL;
	kvr_ttl_map_init(&t->by_seq, entry_live, t, &t->live);
	*out = t;
	return 0;
}

static void blob_unref(struct blob *b)
{
	if (--b->refs == 0)
		kvr_free(b, sizeof(*b) + (size_t)b->cap * sizeof(uint64_t));
}

void kvr_ttl_destroy(struct kvr_ttl *t)
{
	if (!t)
		return;
	for (uint32_t i = t->head; i != NIL; i = run_at(t, i)->next)
		blob_unref(run_at(t, i)->blob);
	for (struct grave_chunk *c = t->gr_first, *nx; c; c = nx) {
		nx = c->next;
		size_t lo = c == t->gr_first ? t->gr_hi : 0,
		       hi = c == t->gr_last ? t->gr_ti : GR_CHUNK;
		for (size_t k = lo; k < hi; k++)
			blob_unref(c->g[k].blob);
		kvr_free(c, sizeof(*c));
	}
	for (struct grave_chunk *c = t->gr_spare, *nx; c; c = nx) {
		nx = c->next;
		kvr_free(c, sizeof(*c));
	}
	for (size_t k = 0; k < t->rc_n; k++)
		kvr_free(t->rc[k], RUN_CHUNK * sizeof(struct run));
	kvr_free(t->rc, t->rc_cap * sizeof(*t->rc));
	kvr_free(t->plan, t->plan_cap * sizeof(struct step));
	kvr_ttl_map_fini(&t->by_seq);
	kvr_free(t, sizeof(*t));
}

/* Room for `more` run slots: a chunk at a time (O(more), the directory grows by doubling). */
static int reserve_runs(struct kvr_ttl *t, size_t more)
{
	size_t need = (size_t)t->runs + more;
	if (need > RUN_MAX)
		return KVR_ERANGE;
	while (need > t->cap) {
		if (t->rc_n == t->rc_cap) {
			size_t nc = t->rc_cap ? t->rc_cap * 2 : 4;
			struct run **d =
			    kvr_realloc(t->rc, t->rc_cap * sizeof(*d), nc * sizeof(*d));
			if (!d)
				return KVR_ENOMEM; /* chunks added so far stay: more room, no change
				                    */
			t->rc = d;
			t->rc_cap = nc;
		}
		struct run *c = kvr_alloc(RUN_CHUNK * sizeof(*c));
		if (!c)
			return KVR_ENOMEM;
		for (uint32_t k = RUN_CHUNK; k-- > 0;) { /* lowest id first */
			c[k].next = t->free_head;
			c[k].gen = 0;
			t->free_head = (uint32_t)(t->cap + k);
		}
		t->rc[t->rc_n++] = c;
		t->cap += RUN_CHUNK;
	}
	return 0;
}

static uint32_t take_slot(struct kvr_ttl *t)
{
	uint32_t i = t->free_head;
	t->free_head = run_at(t, i)->next;
	t->runs++;
	return i;
}

/* Frees slot i; the map entries that still name it go stale (lazy deletion). */
static void free_slot(struct kvr_ttl *t, uint32_t i)
{
	run_at(t, i)->gen++;
	run_at(t, i)->next = t->free_head;
	t->free_head = i;
	t->runs--;
}

static void unlink_run(struct kvr_ttl *t, uint32_t i)
{
	struct run *e = run_at(t, i);
	if (e->prev != NIL)
		run_at(t, e->prev)->next = e->next;
	else
		t->head = e->next;
	if (e->next != NIL)
		run_at(t, e->next)->prev = e->prev;
	else
		t->tail = e->prev;
}

/* Links run i after run `after` (NIL: at the head). */
static void link_after(struct kvr_ttl *t, uint32_t i, uint32_t after)
{
	struct run *e = run_at(t, i);
	e->prev = after;
	e->next = after != NIL ? run_at(t, after)->next : t->head;
	if (e->next != NIL)
		run_at(t, e->next)->prev = i;
	else
		t->tail = i;
	if (after != NIL)
		run_at(t, after)->next = i;
	else
		t->head = i;
}

static uint64_t expiry_at(const struct kvr_ttl *t, uint64_t now)
{
	uint64_t x = now + t->ttl;
	if (x < now)
		x = UINT64_MAX; /* saturate */
	if (t->bucket > 1 && x % t->bucket) {
		uint64_t up = x + (t->bucket - x % t->bucket);
		x = up > x ? up : UINT64_MAX;
	}
	if (t->tail != NIL && run_at(t, t->tail)->expiry > x)
		x = run_at(t, t->tail)->expiry;
	return x;
}

/* offset_of() where the caller's position disagrees (bad input) or the entry is stale after
 * 2^32 reuses of its slot: a scan of the run. */
static __attribute__((noinline, cold)) uint32_t offset_scan(const struct run *e, uint64_t seq)
{
	for (uint32_t o = 0; o < e->len; o++)
		if (e->h[o] == seq)
			return o;
	return NIL;
}

/* The offset of hash seq in run i, expected at position pos; NIL if the run does not hold it. */
static inline uint32_t offset_of(const struct kvr_ttl *t, uint32_t i, uint64_t seq, uint64_t pos)
{
	const struct run *e = run_at(t, i);
	if (pos >= e->pos && pos - e->pos < e->len && e->h[pos - e->pos] == seq)
		return (uint32_t)(pos - e->pos);
	return offset_scan(e, seq);
}

/* Where held hash seq is (expected at position pos): its run in *run and the offset, or NIL
 * (not held).  *stale: the map has an entry for seq all the same, left by an expired run. */
static inline __attribute__((always_inline)) uint32_t
locate_entry(const struct kvr_ttl *t, uint64_t seq, uint64_t pos, uint32_t *run, bool *stale)
{
	const struct kvr_u64map_slot *s = kvr_ttl_map_find(&t->by_seq, seq);
	*stale = false;
	if (!s)
		return NIL;
	uint32_t off = run_at(t, s->val)->gen == s->spare ? offset_of(t, s->val, seq, pos) : NIL;
	*stale = off == NIL;
	*run = s->val;
	return off;
}

static uint32_t locate(const struct kvr_ttl *t, uint64_t seq, uint64_t pos, uint32_t *run)
{
	bool stale;
	return locate_entry(t, seq, pos, run, &stale);
}

/* locate(), dropping a stale entry (the record's plan: it is found where a live one would be
 * looked up anyway, and the record may insert the key). */
static inline __attribute__((always_inline)) uint32_t locate_drop(struct kvr_ttl *t, uint64_t seq,
                                                                  uint64_t pos, uint32_t *run)
{
	bool stale;
	uint32_t off = locate_entry(t, seq, pos, run, &stale);
	if (stale)
		kvr_ttl_map_remove_slot(&t->by_seq, kvr_ttl_map_find(&t->by_seq, seq));
	return off;
}

static bool entry_live(const void *ctx, const struct kvr_u64map_slot *s)
{
	const struct kvr_ttl *t = ctx;
	return run_at(t, s->val)->gen == s->spare;
}

/* Room for `more` graves: empty chunks reserved (O(more)). */
static int reserve_graves(struct kvr_ttl *t, size_t more)
{
	size_t room = (t->gr_last ? GR_CHUNK - t->gr_ti : 0) + t->gr_spare_n * GR_CHUNK;
	for (; room < more; room += GR_CHUNK) {
		struct grave_chunk *c = kvr_alloc(sizeof(*c));
		if (!c)
			return KVR_ENOMEM; /* chunks reserved so far stay: no change */
		c->next = t->gr_spare;
		t->gr_spare = c;
		t->gr_spare_n++;
	}
	return 0;
}

/* Queues an expired run (room reserved). */
static void grave_push(struct kvr_ttl *t, struct grave g)
{
	if (!t->gr_last || t->gr_ti == GR_CHUNK) {
		struct grave_chunk *c = t->gr_spare;
		t->gr_spare = c->next;
		t->gr_spare_n--;
		c->next = NULL;
		if (t->gr_last)
			t->gr_last->next = c;
		else
			t->gr_first = c, t->gr_hi = 0;
		t->gr_last = c;
		t->gr_ti = 0;
	}
	t->gr_last->g[t->gr_ti++] = g;
	t->gr_n++;
}

/* Drops the oldest grave (its map entries are gone): a chunk emptied is kept as the one spare
 * (steady expiry reuses it) or freed. */
static void grave_pop(struct kvr_ttl *t)
{
	t->gr_n--;
	if (++t->gr_hi < GR_CHUNK && (t->gr_first != t->gr_last || t->gr_hi < t->gr_ti))
		return;
	struct grave_chunk *c = t->gr_first;
	t->gr_first = c->next;
	if (!t->gr_first)
		t->gr_last = NULL, t->gr_ti = 0;
	t->gr_hi = 0;
	if (t->gr_spare_n == 0) {
		c->next = NULL;
		t->gr_spare = c;
		t->gr_spare_n = 1;
	} else {
		kvr_free(c, sizeof(*c));
	}
}

/* Removes up to `budget` map entries of expired runs, oldest first.  An entry found live was
 * recorded again since (a new run holds the hash) and stays; one already dropped (by a plan or
 * a growth) is simply not found. */
static void bury(struct kvr_ttl *t, size_t budget)
{
	struct kvr_ttl_map *m = &t->by_seq;
	while (budget > 0 && t->gr_n > 0) {
		const struct grave *g = &t->gr_first->g[t->gr_hi];
		size_t k = t->done, end = g->len - k > budget ? k + budget : g->len;
		for (; k < end; k++) { /* locals: the map's stores cannot alias them */
			uint64_t seq = g->h[k];
			struct kvr_u64map_slot *s = kvr_ttl_map_find(m, seq);
			if (s && (run_at(t, s->val)->gen != s->spare ||
			          offset_of(t, s->val, seq, (uint64_t)g->pos + k) == NIL))
				kvr_ttl_map_remove_slot(m, s);
		}
		budget -= k - t->done;
		t->pending -= k - t->done;
		t->done = k;
		if (k < g->len)
			break;
		blob_unref(g->blob);
		grave_pop(t);
		t->done = 0;
	}
}

/* Room for `extra` more map entries, with bounded work (shards/ttl_map.c: the map grows a
 * slice per call).  While migrating, the call pays its share first.  A full map that holds
 * entries of expired runs buries a bounded number of them; if that does not make room it
 * migrates into a table sized for the live blocks, dropping the stale entries on the way:
 * twice the size, or the same size (a purge) where the live ones fill at most half of it (a
 * purge of a fuller table would have too little slack to pace, ttl_map.c). */
static int reserve_map(struct kvr_ttl *t, size_t extra)
{
	struct kvr_ttl_map *m = &t->by_seq;
	if (kvr_ttl_map_migrating(m)) {
		kvr_ttl_map_step(m, kvr_ttl_map_due(m, extra) + MIG_PER_CALL);
		if (kvr_ttl_map_room(m, extra))
			return 0;
		/* NEVER by the pace, unless this record inserts more than the slack: the rest at
		 * once (the call is a good fraction of the table already). */
		kvr_ttl_map_step(m, SIZE_MAX);
	}
	if (kvr_ttl_map_room(m, extra))
		return 0;
	if (kvr_ttl_map_count(m) > t->live) {
		size_t b = kvr_ttl_bury_on ? BURY_FULL_PER_NEW * extra + BURY_FULL_PER_CALL : 0;
		bury(t, b < t->pending ? b : t->pending);
		if (kvr_ttl_map_room(m, extra))
			return 0;
	}
	for (int pass = 0; pass < 2; pass++) {
		/* pass 1 (NEVER): entries kept as live that were not (a generation matched again
		 * after 2^32 reuses of a slot): size for every entry */
		size_t need = (pass ? kvr_ttl_map_count(m) : t->live) + extra;
		size_t cur = m->cur.cap, cap = cur ? cur : 16;
		while (need * 10 > cap * 7)
			cap *= 2;
		if (cap == cur && need * 2 > cap)
			cap *= 2;
		int rc = kvr_ttl_map_start(m, cap, extra);
		if (rc)
			return rc;
		kvr_ttl_map_step(m, kvr_ttl_map_due(m, extra) + MIG_PER_CALL);
		if (kvr_ttl_map_room(m, extra))
			return 0;
		kvr_ttl_map_step(m, SIZE_MAX); /* NEVER: start sized the pace for `extra` */
		if (kvr_ttl_map_room(m, extra))
			return 0;
	}
	return KVR_ENOMEM; /* NEVER */
}

/* Splits run i before off (0 < off < len) into two runs with its expiry, side by side in the
 * list; the smaller piece gets a new slot (reserved) and its map entries.  *left and *right
 * receive the pieces' ids. */
static void split(struct kvr_ttl *t, uint32_t i, uint32_t off, uint32_t *left, uint32_t *right)
{
	uint32_t m = take_slot(t);
	struct run *e = run_at(t, i), *n = run_at(t, m);
	uint32_t gen_m = n->gen; /* a slot keeps its generation */
	*n = *e;
	n->gen = gen_m;
	e->blob->refs++;
	uint32_t len = e->len;
	struct run *lo, *hi;
	if (len - off <= off) { /* the right piece is smaller: it moves to m */
		lo = e, hi = n;
		*left = i, *right = m;
	} else {
		lo = n, hi = e;
		*left = m, *right = i;
	}
	lo->len = off;
	hi->h = e->h + off; /* e->h is still the whole run's start here */
	hi->pos = lo->pos + off;
	hi->len = len - off;
	lo->h = hi->h - off;
	const struct run *moved = run_at(t, m);
	for (uint32_t j = 0; j < moved->len; j++) {
		struct kvr_u64map_slot *ms = kvr_ttl_map_find(&t->by_seq, moved->h[j]);
		ms->val = m;
		ms->spare = moved->gen;
	}
	link_after(t, m, i);
}

/* Plans a record: the steps, the run slots they need, the new blocks. */
static int plan(struct kvr_ttl *t, const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                size_t *nsteps, size_t *slots, size_t *fresh)
{
	*nsteps = *slots = *fresh = 0;
	if (++t->plan_id == 0) /* after a wrap a stale mark only ends a record early */
		t->plan_id = 1;
	size_t k = 0;
	while (k < n) {
		if (*nsteps == t->plan_cap) {
			size_t nc = t->plan_cap ? t->plan_cap * 2 : 16;
			struct step *p =
			    kvr_realloc(t->plan, t->plan_cap * sizeof(*p), nc * sizeof(*p));
			if (!p)
				return KVR_ENOMEM;
			t->plan = p;
			t->plan_cap = nc;
		}
		struct step *s = &t->plan[(*nsteps)++];
		s->k = (uint32_t)k;
		uint32_t ix, off = locate_drop(t, b[k].seq, (uint64_t)start_pos + k, &ix), u;
		if (off == NIL) {
			size_t e = k + 1;
			while (e < n &&
			       locate_drop(t, b[e].seq, (uint64_t)start_pos + e, &u) == NIL)
				e++;
			*s = (struct step){(uint32_t)k, (uint32_t)(e - k), NIL, 0};
			*fresh += e - k;
			(*slots)++;
			k = e;
			continue;
		}
		struct run *e = run_at(t, ix);
		if (e->seen == t->plan_id) { /* taken by this plan already: crafted (see record) */
			(*nsteps)--;
			break;
		}
		e->seen = t->plan_id;
		uint32_t cnt = 1 + kvr_chain_agree(e->h + off, e->len - 1 - off, &b[k].seq, BSTRIDE,
		                                   n - 1 - k);
		*s = (struct step){(uint32_t)k, cnt, ix, off};
		*slots += (off > 0) + (off + cnt < e->len);
		k += cnt;
	}
	return 0;
}

int kvr_ttl_record(struct kvr_ttl *t, const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                   uint64_t now, struct kvr_lru_out *out)
{
	if (!t || !out || (n > 0 && !b))
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	if (t->live + n >= NIL)
		return KVR_ERANGE;
	size_t nsteps, slots, fresh;
	int rc;
	if ((rc = plan(t, b, n, start_pos, &nsteps, &slots, &fresh)) ||
	    (rc = reserve_runs(t, slots)) || (rc = reserve_map(t, fresh)) ||
	    (rc = kvr_lru_out_reserve(out, slots, 0)))
		return rc;
	struct blob *blob = NULL;
	if (fresh) {
		blob = kvr_alloc(sizeof(*blob) + fresh * sizeof(uint64_t));
		if (!blob)
			return KVR_ENOMEM;
		blob->refs = 0;
		blob->cap = (uint32_t)fresh;
	}
	uint64_t x = expiry_at(t, now);
	uint32_t used = 0;
	for (size_t si = 0; si < nsteps; si++) {
		const struct step *s = &t->plan[si];
		uint32_t i;
		if (s->run == NIL) {
			i = take_slot(t);
			struct run *e = run_at(t, i);
			*e = (struct run){.expiry = x,
			                  .h = blob->h + used,
			                  .blob = blob,
			                  .pos = start_pos + s->k,
			                  .len = s->n,
			                  .gen = e->gen};
			/* A hash already entered by this record: only a crafted prompt repeats one
			 * (kvr_request does not check that a caller's hashes chain).  Entered
			 * twice, the map held two entries for one key and the store lost count of
			 * its blocks (kvr_ttl_check broken, then an expiry reserving ~2^35 bytes:
			 * test_ttl crafted_record_repeating_a_hash).  The record ends there: its
			 * later blocks are not predicted. */
			uint32_t j = 0;
			while (j < s->n &&
			       kvr_ttl_map_insert_absent(&t->by_seq, b[s->k + j].seq, i, e->gen)) {
				e->h[j] = b[s->k + j].seq;
				j++;
			}
			if (j == 0) {
				free_slot(t, i);
				break;
			}
			e->len = j;
			used += j;
			blob->refs++;
			t->live += j;
			link_after(t, i, t->tail);
			kvr_lru_out_stored(out, s->k, j);
			if (j < s->n)
				break;
			continue;
		}
		uint32_t l;
		i = s->run;
		if (s->off > 0)
			split(t, i, s->off, &l, &i);
		if (s->n < run_at(t, i)->len)
			split(t, i, s->n, &i, &l);
		struct run *e = run_at(t, i);
		e->pos = start_pos + s->k;
		if (e->expiry != x) {
			unlink_run(t, i);
			e->expiry = x;
			link_after(t, i, t->tail);
		}
	}
	if (blob && blob->refs == 0) /* ended (crafted) before its first new run */
		kvr_free(blob, sizeof(*blob) + (size_t)blob->cap * sizeof(uint64_t));
	if (kvr_ttl_bury_on)
		bury(t, BURY_PER_NEW * fresh + BURY_PER_CALL);
	return 0;
}

int kvr_ttl_expire(struct kvr_ttl *t, uint64_t now, struct kvr_lru_out *out)
{
	if (!t || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	size_t n = 0, runs = 0;
	for (uint32_t i = t->head; i != NIL && run_at(t, i)->expiry <= now;
	     i = run_at(t, i)->next, runs++)
		n += run_at(t, i)->len;
	int rc;
	if ((rc = kvr_lru_out_reserve(out, 0, n)) || (rc = reserve_graves(t, runs)))
		return rc;
	while (t->head != NIL && run_at(t, t->head)->expiry <= now) {
		uint32_t i = t->head;
		struct run *e = run_at(t, i);
		unlink_run(t, i);
		kvr_lru_out_evicted_run(out, e->h, e->len);
		t->live -= e->len;
		/* its map entries go stale; the grave keeps the blob's reference until they go */
		grave_push(
		    t, (struct grave){.blob = e->blob, .h = e->h, .pos = e->pos, .len = e->len});
		t->pending += e->len;
		free_slot(t, i);
	}
	kvr_ttl_map_step(&t->by_seq, MIG_PER_CALL);
	return 0;
}

uint64_t kvr_ttl_next_expiry(const struct kvr_ttl *t)
{
	return (t && t->head != NIL) ? run_at(t, t->head)->expiry : UINT64_MAX;
}

size_t kvr_ttl_overlap(const struct kvr_ttl *t, const uint64_t *seq, size_t n)
{
	if (!t || !seq)
		return 0;
	size_t k = 0;
	uint32_t ix, off;
	while (k < n && (off = locate(t, seq[k], k, &ix)) != NIL) {
		const struct run *e = run_at(t, ix);
		k += 1 + kvr_chain_agree(e->h + off, e->len - 1 - off, seq + k, 1, n - 1 - k);
	}
	return k;
}

bool kvr_ttl_holds_at(const struct kvr_ttl *t, uint64_t seq, uint32_t pos)
{
	uint32_t ix;
	return t && locate(t, seq, pos, &ix) != NIL;
}

size_t kvr_ttl_count(const struct kvr_ttl *t)
{
	return t ? t->live : 0;
}

int kvr_ttl_lookup(const struct kvr_ttl *t, uint64_t seq, uint64_t *expiry, uint32_t *pos)
{
	if (!t)
		return KVR_EINVAL;
	uint32_t ix, off = locate(t, seq, UINT64_MAX, &ix); /* no position: scans the run */
	if (off == NIL)
		return KVR_ENOENT;
	const struct run *e = run_at(t, ix);
	if (expiry)
		*expiry = e->expiry;
	if (pos)
		*pos = e->pos + off;
	return 0;
}

void kvr_ttl_stats(const struct kvr_ttl *t, struct kvr_ttl_stats *out)
{
	const struct kvr_ttl_map *m = &t->by_seq;
	*out = (struct kvr_ttl_stats){.map_entries = kvr_ttl_map_count(m),
	                              .map_slots = kvr_ttl_map_slots(m),
	                              .pending = t->pending,
	                              .growths = m->migrations,
	                              .max_step_units = m->max_units,
	                              .growing = kvr_ttl_map_migrating(m)};
}

#define CHECK(cond)                                                                                \
	do {                                                                                       \
		if (!(cond))                                                                       \
			return __LINE__;                                                           \
	} while (0)

/* The entries of one table: counted, reachable by a lookup, live ones counted apart. */
static int check_table(const struct kvr_ttl *t, const struct kvr_u64map *tb, size_t below,
                       size_t *live)
{
	const struct kvr_ttl_map *m = &t->by_seq;
	size_t n = 0;
	/* the old table's slots below the migration cursor are copied (and may have been given
	 * back to the system): not read */
	for (size_t i = below; i < tb->cap; i++) {
		const struct kvr_u64map_slot *s = &tb->slots[i];
		if (s->val == KVR_U64MAP_EMPTY || s->val == KVR_TTL_MAP_TOMB)
			continue;
		CHECK(kvr_ttl_map_find(m, s->key) == s);
		CHECK(s->val < t->cap);
		n++;
		if (run_at(t, s->val)->gen ==
		    s->spare) /* the run walk found the held blocks' ones */
			(*live)++;
	}
	CHECK(n == tb->count);
	return 0;
}

int kvr_ttl_check(const struct kvr_ttl *t)
{
	const struct kvr_ttl_map *m = &t->by_seq;
	size_t blocks = 0, runs = 0, live = 0;
	uint64_t x = 0;
	for (uint32_t i = t->head, prev = NIL; i != NIL; prev = i, i = run_at(t, i)->next, runs++) {
		const struct run *e = run_at(t, i);
		CHECK(e->prev == prev && e->len > 0 && e->expiry >= x);
		x = e->expiry;
		blocks += e->len;
		for (uint32_t j = 0; j < e->len; j++) {
			const struct kvr_u64map_slot *s = kvr_ttl_map_find(m, e->h[j]);
			CHECK(s && s->val == i && s->spare == e->gen);
		}
	}
	CHECK(runs == t->runs && blocks == t->live);
	bool zeroing = kvr_ttl_map_migrating(m) && m->zeroed < m->cur.cap;
	if (!zeroing) {
		int rc = check_table(t, &m->cur, 0, &live);
		if (rc)
			return rc;
	}
	if (kvr_ttl_map_migrating(m)) {
		int rc = check_table(t, &m->old, zeroing ? 0 : m->mig, &live);
		if (rc)
			return rc;
	}
	CHECK(live == t->live); /* one live entry per held block, no other */
	CHECK(kvr_ttl_map_count(m) - live <= t->pending); /* every stale entry in a grave */
	return 0;
}
