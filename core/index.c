/*
 * core/index.c - the RCU radix index: node table, deferred reclamation, rank slots.
 *
 * The idea.  The index is a radix tree over block paths (Dynamo's RadixTree): a node is one
 * distinct prefix, reached from its parent by the block's local hash, and carries the set of
 * ranks that cache that prefix.  Instead of a children map in every node we keep ONE node table
 * keyed by a prefix key seq = H(parent.seq, local) (H bijective in local), with the parent
 * pointer stored in the node: a child lookup is "entry with this seq whose node's parent is the
 * node I came from", which is exact (no reliance on 64-bit hashes not colliding) and - the point
 * of it - lets a reader compute the keys of ALL its hops up front from the query's local hashes.
 * find_matches therefore prefetches the table entry of hop i+20 and the node of hop i+8
 * while it intersects hop i, so a long lookup is bound by memory-level
 * parallelism instead of one dependent cache miss per block (core/index_match.c).
 *
 * Memory.  A node is 32 bytes (seq, parent, tagged rank set, lock word, child count); a node
 * with exactly one rank stores it inline in the tagged word, so the common chain costs no rank
 * array.  Table entries are 16 bytes at load <= 1/2 (tombstones included: short probes for
 * the writers' unsuccessful lookups and inserts, 10% more apply rate than 3/4).  Each rank keeps a
 * private ext hash -> node map (linear probing, backward-shift deletion, load <= 0.8), 16 bytes per
 * entry: that map plus rank-set entries is the per-copy cost.
 *
 * Why not liburcu's rculfhash or ck_hs.  rculfhash would give a lock-free resizable node table,
 * but its split-ordered lists make a lookup a chain walk whose addresses cannot be computed
 * before the previous load returns (no prefetch ahead), it adds 16 bytes per node, and it is
 * uninstrumented inline code (ThreadSanitizer reports every reader).  ck_hs stores bare pointers
 * and would need an allocation per (ext, node) pair for the private ext maps, which no other
 * thread reads anyway.  So: IDX_SEGS segments, each an open-addressing table with a spinlock for
 * writers and an RCU-published array for readers (insert writes key then releases the node
 * pointer; delete leaves a tombstone; growth and tombstone purges copy to a new array and retire
 * the old one), and plain private linear-probing maps per rank.
 *
 * Invariants.
 *  - A node is live while it has a rank or a live child; the writer that leaves it with neither
 *    (holding its lock) marks it dead and deletes it from the table, then decrements the parent's
 *    child count; whoever takes a count to zero locks the parent and re-checks: the cascade.
 *  - A node a rank holds cannot die (only the rank's own writer removes the rank), so a writer
 *    walking down its own chain needs no lock on the parent; a child found in the table is
 *    locked and checked not dead before a rank is added to it.
 *  - Lock order: node lock, then segment lock.  Readers never lock.
 *  - Everything unlinked (nodes, rank sets, tables) is retired into a per-call batch and freed by
 *    one call_rcu callback after the writer leaves its read section, so no reader (nor another
 *    writer, who also works inside a read section) ever touches freed memory.
 *  - Rank slots are reused only after a grace period (rank_remove queues the slot's release).
 * Reference: Dynamo lib/kv-router/src/radix_tree.rs (semantics); McKenney, "Is Parallel
 * Programming Hard" ch. 9 (RCU); liburcu call_rcu(3).
 */
#include "core/index_internal.h"

#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "kvrouter.h"

#define TAB_MIN 16

/* ---------------------------------------------------------------- node table */

/* Copies the live entries of s->tab into a new array of cap entries and publishes it.
 * Context: writer holding s->lock.  Returns 0 or KVR_ENOMEM (nothing changed). */
static int seg_rebuild(struct kvr_index *idx, struct idx_seg *s, uint64_t cap,
                       struct idx_retire *rt)
{
	struct idx_tab *nt = kvr_alloc_aligned(idx_bytes_tab(cap - 1)); /* zeroed */
	if (!nt)
		return KVR_ENOMEM;
	nt->mask = cap - 1;
	struct idx_tab *ot = s->tab;
	if (ot) {
		for (uint64_t i = 0; i <= ot->mask; i++) {
			struct idx_node *n = ot->e[i].node;
			if (!n || n == IDX_TOMB)
				continue;
			uint64_t j = idx_home(nt, ot->e[i].seq);
			while (nt->e[j].node)
				j = (j + 1) & nt->mask;
			nt->e[j] = ot->e[i];
		}
		ot->next_free = rt->tabs;
		rt->tabs = ot;
		rt->n++;
	}
	idx_count(&idx->bytes_shared, (int64_t)idx_bytes_tab(nt->mask));
	s->tombs = 0;
	s->tab = nt;
	/* Ordering: release; pairs with the acquire load of view[] in idx_lookup(). */
	kvr_rcu_publish(&idx->view[s - idx->seg], (uintptr_t)nt | (uintptr_t)__builtin_ctzll(cap));
	return 0;
}

static uint64_t cap_for(uint64_t count)
{
	uint64_t cap = TAB_MIN;
	while (cap < count * 2 + 2)
		cap <<= 1;
	return cap;
}

struct idx_node *kvr_index_table_insert(struct kvr_index *idx, struct idx_node *n,
                                        struct idx_retire *rt)
{
	struct idx_seg *s = idx_seg_of(idx, n->seq);
	idx_lock(&s->lock);
	struct idx_tab *t = s->tab;
	uint64_t slot = UINT64_MAX;
	if (t) {
		for (uint64_t i = idx_home(t, n->seq);; i = (i + 1) & t->mask) {
			struct idx_node *m = t->e[i].node;
			if (!m) {
				if (slot == UINT64_MAX)
					slot = i;
				break;
			}
			if (m == IDX_TOMB) {
				if (slot == UINT64_MAX)
					slot = i;
				continue;
			}
			if (t->e[i].seq == n->seq && m->seq == n->seq &&
			    __atomic_load_n(&m->parent, __ATOMIC_RELAXED) == n->parent) {
				idx_unlock(&s->lock);
				return m;
			}
		}
	}
	uint64_t used = (uint64_t)s->count + s->tombs + 1;
	if (!t || (slot != UINT64_MAX && t->e[slot].node == NULL && used * 2 > t->mask + 1)) {
		if (seg_rebuild(idx, s, cap_for(s->count + 1), rt) != 0) {
			idx_unlock(&s->lock);
			return NULL;
		}
		t = s->tab;
		slot = idx_home(t, n->seq);
		while (t->e[slot].node)
			slot = (slot + 1) & t->mask;
	}
	if (t->e[slot].node == IDX_TOMB)
		s->tombs--;
	__atomic_store_n(&t->e[slot].seq, n->seq, __ATOMIC_RELAXED);
	/* Ordering: release; pairs with the acquire load in kvr_index_lookup(): a reader that sees
	 * the node sees its fields and the entry's seq. */
	__atomic_store_n(&t->e[slot].node, n, __ATOMIC_RELEASE);
	s->count++;
	idx_unlock(&s->lock);
	return n;
}

void kvr_index_table_delete(struct kvr_index *idx, struct idx_node *n, struct idx_retire *rt)
{
	struct idx_seg *s = idx_seg_of(idx, n->seq);
	idx_lock(&s->lock);
	struct idx_tab *t = s->tab;
	for (uint64_t i = idx_home(t, n->seq);; i = (i + 1) & t->mask) {
		struct idx_node *m = t->e[i].node;
		if (!m)
			break; /* NEVER: a live node is in its segment */
		if (m == n) {
			__atomic_store_n(&t->e[i].node, IDX_TOMB, __ATOMIC_RELAXED);
			s->count--;
			s->tombs++;
			break;
		}
	}
	/* Give memory back after mass removal; keep the old array if the new one fails. */
	if (s->count == 0) {
		s->tab = NULL;
		kvr_rcu_publish(&idx->view[s - idx->seg], (uintptr_t)0);
		s->tombs = 0;
		t->next_free = rt->tabs;
		rt->tabs = t;
		rt->n++;
	} else if (t->mask + 1 > TAB_MIN && (uint64_t)s->count * 8 < t->mask + 1)
		(void)seg_rebuild(idx, s, cap_for(s->count), rt);
	idx_unlock(&s->lock);
}

/* ---------------------------------------------------------------- deferred free */

/*
 * Every call_rcu the index makes goes through one record type and one counter, `pending`, so
 * that kvr_index_quiesce() and destroy can wait for exactly this index's callbacks without
 * rcu_barrier(): liburcu is uninstrumented, and counting with C11 atomics lets
 * ThreadSanitizer see the order (submit: TSan release on the RCU token after the record is
 * filled; callback: acquire on entry, release-decrement of pending as its last access).
 */
enum cb_kind { CB_BATCH, CB_SLOT, CB_RTAB };

struct idx_cb {
	struct rcu_head head;
	struct kvr_index *idx;
	enum cb_kind kind;
	uint32_t slot;
	struct idx_rtab *rtab;
	struct idx_retire rt;
};

static void free_batch(struct kvr_index *idx, struct idx_retire *rt)
{
	int64_t shared = 0, ranks = 0;
	for (struct idx_node *n = rt->nodes, *next; n; n = next) {
		next = __atomic_load_n(&n->parent, __ATOMIC_RELAXED);
		kvr_free(n, sizeof(*n));
		shared += (int64_t)sizeof(*n);
	}
	for (struct idx_rset *r = rt->sets, *next; r; r = next) {
		next = r->next_free;
		ranks += (int64_t)idx_bytes_rset(r->cap);
		kvr_free(r, idx_bytes_rset(r->cap));
	}
	for (struct idx_tab *t = rt->tabs, *next; t; t = next) {
		next = t->next_free;
		shared += (int64_t)idx_bytes_tab(t->mask);
		kvr_free_aligned(t, idx_bytes_tab(t->mask));
	}
	idx_count(&idx->bytes_shared, -shared);
	idx_count(&idx->bytes_rank, -ranks);
}

static void release_slot(struct kvr_index *idx, uint32_t slot);
static size_t rtab_bytes(uint32_t mask);

static void run_cb(struct idx_cb *cb)
{
	struct kvr_index *idx = cb->idx;
	switch (cb->kind) {
	case CB_BATCH:
		free_batch(idx, &cb->rt);
		break;
	case CB_SLOT:
		release_slot(idx, cb->slot);
		break;
	case CB_RTAB:
		kvr_free(cb->rtab, rtab_bytes(cb->rtab->mask));
		break;
	}
}

static void idx_cb_fn(struct rcu_head *head)
{
	KVR_RCU_CALLBACK_ENTER();
	struct idx_cb *cb = caa_container_of(head, struct idx_cb, head);
	struct kvr_index *idx = cb->idx;
	run_cb(cb);
	kvr_free(cb, sizeof(*cb));
	/* Ordering: release, the callback's last access to idx; pairs with the acquire in
	 * kvr_index_quiesce(). */
	__atomic_sub_fetch(&idx->pending, 1, __ATOMIC_RELEASE);
}

/* Runs cb's work after a grace period.  cb is a filled stack template; a heap copy is queued,
 * or, without memory, the grace period is waited for here.  Context: a writer, outside a read
 * section. */
static void idx_defer(struct idx_cb *tmpl)
{
	struct idx_cb *cb = kvr_alloc(sizeof(*cb));
	if (!cb) {
		kvr_rcu_synchronize();
		KVR_RCU_CALLBACK_ENTER();
		run_cb(tmpl);
		return;
	}
	*cb = *tmpl;
	__atomic_add_fetch(&cb->idx->pending, 1, __ATOMIC_RELAXED);
	kvr_rcu_thread_online();
	KVR_TSAN_RELEASE(&kvr_rcu_tsan_token);
	kvr_rcu_call(&cb->head, idx_cb_fn);
}

void kvr_index_retire_flush(struct kvr_index *idx, struct idx_retire *rt)
{
	if (!rt->nodes && !rt->sets && !rt->tabs)
		return;
	struct idx_cb t = {.idx = idx, .kind = CB_BATCH, .rt = *rt};
	idx_defer(&t);
	memset(rt, 0, sizeof(*rt));
}

void kvr_index_quiesce(struct kvr_index *idx)
{
	if (!idx)
		return;
	/* Ordering: acquire; pairs with the release decrement in idx_cb_fn(). */
	while (__atomic_load_n(&idx->pending, __ATOMIC_ACQUIRE) != 0) {
		struct timespec ts = {0, 100000};
		nanosleep(&ts, NULL);
	}
}

/* ---------------------------------------------------------------- create / destroy */

static uint32_t rtab_cap(uint32_t max_ranks)
{
	uint32_t cap = 16;
	while (cap < max_ranks * 2u)
		cap <<= 1;
	return cap;
}

static size_t rtab_bytes(uint32_t mask)
{
	return sizeof(struct idx_rtab) + ((size_t)mask + 1) * sizeof(uint32_t);
}

int kvr_index_create(uint32_t max_ranks, struct kvr_index **out)
{
	if (!out)
		return KVR_EINVAL;
	*out = NULL;
	if (max_ranks == 0 || max_ranks > KVR_INDEX_MAX_RANKS)
		return KVR_ERANGE;
	struct kvr_index *idx = kvr_alloc_aligned(sizeof(*idx));
	if (!idx)
		return KVR_ENOMEM;
	memset(idx, 0, sizeof(*idx));
	idx->max_ranks = max_ranks;
	idx->root.seq = IDX_ROOT_SEQ;
	idx->rank = kvr_alloc_aligned(sizeof(struct idx_rank) * max_ranks);
	uint32_t cap = rtab_cap(max_ranks);
	idx->rtab = kvr_calloc(1, rtab_bytes(cap - 1));
	if (!idx->rank || !idx->rtab) {
		kvr_free_aligned(idx->rank, sizeof(struct idx_rank) * max_ranks);
		kvr_free(idx->rtab, idx->rtab ? rtab_bytes(cap - 1) : 0);
		kvr_free_aligned(idx, sizeof(*idx));
		return KVR_ENOMEM;
	}
	idx->rtab->mask = cap - 1;
	memset(idx->rank, 0, sizeof(struct idx_rank) * max_ranks);
	for (uint32_t i = 0; i < max_ranks; i++)
		idx->rank[i].next_free = i + 1 < max_ranks ? i + 1 : UINT32_MAX;
	idx->free_head = 0;
	*out = idx;
	return 0;
}

void kvr_index_destroy(struct kvr_index *idx)
{
	if (!idx)
		return;
	/* Pending callbacks (retired batches, slot releases) point at idx. */
	kvr_index_quiesce(idx);
	for (uint32_t i = 0; i < IDX_SEGS; i++) {
		struct idx_tab *t = idx->seg[i].tab;
		if (!t)
			continue;
		for (uint64_t j = 0; j <= t->mask; j++) {
			struct idx_node *n = t->e[j].node;
			if (!n || n == IDX_TOMB)
				continue;
			if (!(n->ranks & 1) && n->ranks) {
				struct idx_rset *r = (struct idx_rset *)n->ranks;
				kvr_free(r, idx_bytes_rset(r->cap));
			}
			kvr_free(n, sizeof(*n));
		}
		kvr_free_aligned(t, idx_bytes_tab(t->mask));
	}
	for (uint32_t i = 0; i < idx->max_ranks; i++)
		free_batch(idx, &idx->rank[i].pend); /* nobody reads them any more */
	for (uint32_t i = 0; i < idx->max_ranks; i++)
		kvr_free(idx->rank[i].map.e,
		         idx->rank[i].map.e ? (idx->rank[i].map.mask + 1) * sizeof(struct idx_xent)
		                            : 0);
	kvr_free(idx->rtab, rtab_bytes(idx->rtab->mask));
	kvr_free_aligned(idx->rank, sizeof(struct idx_rank) * idx->max_ranks);
	kvr_free_aligned(idx, sizeof(*idx));
}

/* ---------------------------------------------------------------- rank slots */

static uint64_t rank_hash(uint64_t worker_id, uint32_t dp_rank)
{
	uint64_t x = worker_id ^ ((uint64_t)dp_rank * 0x9e3779b97f4a7c15ull);
	x ^= x >> 31;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 29;
	return x;
}

static bool rank_is(const struct idx_rank *r, uint64_t worker_id, uint32_t dp_rank)
{
	return __atomic_load_n(&r->worker_id, __ATOMIC_RELAXED) == worker_id &&
	       __atomic_load_n(&r->dp_rank, __ATOMIC_RELAXED) == dp_rank &&
	       __atomic_load_n(&r->state, __ATOMIC_RELAXED) == SLOT_ACTIVE;
}

/* Probe for (worker, dp); returns the entry index or UINT32_MAX.  Context: any, with the table
 * pinned (read section or rank_lock). */
static uint32_t rtab_find(const struct kvr_index *idx, const struct idx_rtab *t, uint64_t worker_id,
                          uint32_t dp_rank)
{
	for (uint32_t i = (uint32_t)rank_hash(worker_id, dp_rank) & t->mask;;
	     i = (i + 1) & t->mask) {
		/* Ordering: acquire; pairs with the release store in rank_add. */
		uint32_t v = __atomic_load_n(&t->e[i], __ATOMIC_ACQUIRE);
		if (v == 0)
			return UINT32_MAX;
		if (v != UINT32_MAX && rank_is(&idx->rank[v - 1], worker_id, dp_rank))
			return i;
	}
}

/* Rebuilds the slot lookup table without tombstones.  Context: rank_lock held. */
static void rtab_purge(struct kvr_index *idx)
{
	struct idx_rtab *ot = idx->rtab;
	struct idx_rtab *nt = kvr_calloc(1, rtab_bytes(ot->mask));
	if (!nt)
		return; /* keep the tombstones; lookups stay correct, only slower */
	nt->mask = ot->mask;
	for (uint32_t i = 0; i <= ot->mask; i++) {
		uint32_t v = ot->e[i];
		if (v == 0 || v == UINT32_MAX)
			continue;
		const struct idx_rank *r = &idx->rank[v - 1];
		uint32_t j = (uint32_t)rank_hash(r->worker_id, r->dp_rank) & nt->mask;
		while (nt->e[j])
			j = (j + 1) & nt->mask;
		nt->e[j] = v;
		nt->used++;
	}
	kvr_rcu_publish(&idx->rtab, nt);
	struct idx_cb cb = {.idx = idx, .kind = CB_RTAB, .rtab = ot};
	idx_defer(&cb);
}

int kvr_index_rank_add(struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank, uint32_t *slot)
{
	if (!idx || !slot)
		return KVR_EINVAL;
	kvr_rcu_thread_online();
	int rc = 0;
	idx_lock(&idx->rank_lock);
	struct idx_rtab *t = idx->rtab;
	uint32_t at = rtab_find(idx, t, worker_id, dp_rank);
	if (at != UINT32_MAX) {
		*slot = t->e[at] - 1;
		rc = KVR_EEXIST;
	} else if (idx->free_head == UINT32_MAX) {
		rc = KVR_ERANGE;
	} else {
		uint32_t s = idx->free_head;
		struct idx_rank *r = &idx->rank[s];
		idx->free_head = r->next_free;
		__atomic_store_n(&r->worker_id, worker_id, __ATOMIC_RELAXED);
		__atomic_store_n(&r->dp_rank, dp_rank, __ATOMIC_RELAXED);
		__atomic_store_n(&r->tree_size, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&r->state, SLOT_ACTIVE, __ATOMIC_RELAXED);
		memset(&r->map, 0, sizeof(r->map));
		if (t->used + 1 > (t->mask + 1) / 4 * 3) {
			rtab_purge(idx);
			t = idx->rtab;
		}
		uint32_t i = (uint32_t)rank_hash(worker_id, dp_rank) & t->mask;
		while (t->e[i] != 0 && t->e[i] != UINT32_MAX)
			i = (i + 1) & t->mask;
		if (t->e[i] == 0)
			t->used++;
		/* Ordering: release; pairs with the acquire in rtab_find(). */
		__atomic_store_n(&t->e[i], s + 1, __ATOMIC_RELEASE);
		idx_count(&idx->active_ranks, 1);
		*slot = s;
	}
	idx_unlock(&idx->rank_lock);
	return rc;
}

int kvr_index_rank_find(const struct kvr_index *idx, uint64_t worker_id, uint32_t dp_rank,
                        uint32_t *slot)
{
	if (!idx || !slot)
		return KVR_EINVAL;
	if (kvr_rcu_thread_online() != 0)
		return KVR_ENOMEM;
	kvr_rcu_read_lock();
	const struct idx_rtab *t = kvr_rcu_deref((struct idx_rtab **)&idx->rtab);
	uint32_t at = rtab_find(idx, t, worker_id, dp_rank);
	int rc = KVR_ENOENT;
	if (at != UINT32_MAX) {
		*slot = __atomic_load_n(&t->e[at], __ATOMIC_RELAXED) - 1;
		rc = 0;
	}
	kvr_rcu_read_unlock();
	return rc;
}

int kvr_index_rank_get(const struct kvr_index *idx, uint32_t slot, uint64_t *worker_id,
                       uint32_t *dp_rank)
{
	if (!idx || slot >= idx->max_ranks)
		return KVR_EINVAL;
	const struct idx_rank *r = &idx->rank[slot];
	if (__atomic_load_n(&r->state, __ATOMIC_RELAXED) != SLOT_ACTIVE)
		return KVR_ENOENT;
	if (worker_id)
		*worker_id = __atomic_load_n(&r->worker_id, __ATOMIC_RELAXED);
	if (dp_rank)
		*dp_rank = __atomic_load_n(&r->dp_rank, __ATOMIC_RELAXED);
	return 0;
}

struct idx_rank *kvr_index_rank_get_active(struct kvr_index *idx, uint32_t slot)
{
	if (!idx || slot >= idx->max_ranks)
		return NULL;
	struct idx_rank *r = &idx->rank[slot];
	return __atomic_load_n(&r->state, __ATOMIC_RELAXED) == SLOT_ACTIVE ? r : NULL;
}

static void release_slot(struct kvr_index *idx, uint32_t slot)
{
	idx_lock(&idx->rank_lock);
	struct idx_rank *r = &idx->rank[slot];
	__atomic_store_n(&r->state, SLOT_FREE, __ATOMIC_RELAXED);
	r->next_free = idx->free_head;
	idx->free_head = slot;
	idx_unlock(&idx->rank_lock);
}

int kvr_index_rank_remove(struct kvr_index *idx, uint32_t slot)
{
	if (!idx)
		return KVR_EINVAL;
	int rc = kvr_index_clear_rank(idx, slot);
	if (rc != 0)
		return rc;
	struct idx_rank *r = &idx->rank[slot];
	idx_lock(&idx->rank_lock);
	struct idx_rtab *t = idx->rtab;
	uint32_t at = rtab_find(idx, t, r->worker_id, r->dp_rank);
	if (at != UINT32_MAX) {
		__atomic_store_n(&t->e[at], UINT32_MAX, __ATOMIC_RELAXED);
		t->tombs++;
	}
	__atomic_store_n(&r->state, SLOT_RETIRING, __ATOMIC_RELAXED);
	idx_count(&idx->active_ranks, -1);
	idx_unlock(&idx->rank_lock);
	struct idx_cb cb = {.idx = idx, .kind = CB_SLOT, .slot = slot};
	idx_defer(&cb);
	return 0;
}

/* ---------------------------------------------------------------- stats */

uint64_t kvr_index_tree_size(const struct kvr_index *idx, uint32_t slot)
{
	if (!idx || slot >= idx->max_ranks)
		return 0;
	return __atomic_load_n(&idx->rank[slot].tree_size, __ATOMIC_RELAXED);
}

size_t kvr_index_rank_blocks(struct kvr_index *idx, uint32_t slot, uint64_t *out, size_t cap)
{
	struct idx_rank *rk = idx ? kvr_index_rank_get_active(idx, slot) : NULL;
	if (!rk || !rk->map.e)
		return 0;
	size_t n = 0;
	for (uint64_t i = 0; i <= rk->map.mask; i++) {
		if (!rk->map.e[i].node)
			continue;
		if (n < cap && out)
			out[n] = rk->map.e[i].ext;
		n++;
	}
	return n;
}

static uint64_t ld(const uint64_t *p)
{
	return __atomic_load_n(p, __ATOMIC_RELAXED);
}

void kvr_index_stats_get(const struct kvr_index *idx, struct kvr_index_stats *st)
{
	if (!st)
		return;
	memset(st, 0, sizeof(*st));
	if (!idx)
		return;
	st->parent_not_found = ld(&idx->c_parent_nf);
	st->block_not_found = ld(&idx->c_block_nf);
	st->invalid = ld(&idx->c_invalid);
	st->stored_blocks = ld(&idx->c_stored);
	st->removed_blocks = ld(&idx->c_removed);
	st->nodes = ld(&idx->c_nodes);
	st->copies = ld(&idx->c_copies);
	st->ranks = ld(&idx->active_ranks);
	st->bytes_shared = ld(&idx->bytes_shared);
	st->bytes_per_rank = ld(&idx->bytes_rank);
}

uint64_t kvr_index_memory_bytes(const struct kvr_index *idx)
{
	if (!idx)
		return 0;
	return ld(&idx->bytes_shared) + ld(&idx->bytes_rank) + sizeof(*idx) +
	       sizeof(struct idx_rank) * idx->max_ranks +
	       rtab_bytes(rtab_cap(idx->max_ranks) - 1); /* purges keep the size */
}
