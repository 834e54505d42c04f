/*
 * core/index_internal.h - the index's data structures, shared by core/index*.c only.
 * The design essay is at the top of core/index.c.
 */
#ifndef KVR_CORE_INDEX_INTERNAL_H
#define KVR_CORE_INDEX_INTERNAL_H

#include <ck_pr.h>
#include <stdint.h>

#include "core/index.h"
#include "sync/rcu.h"

#define IDX_CACHELINE 64
#define IDX_SEGS_BITS 8
#define IDX_SEGS      (1u << IDX_SEGS_BITS)
#define IDX_ROOT_SEQ  0x6a09e667f3bcc909ull

/* ---- spinlock (writers only; readers never touch it).  Bit 0 = locked, bit 1 = node dead. */
#define IDX_LOCKED 1u
#define IDX_DEAD   2u

static inline void idx_lock(uint32_t *w)
{
	for (;;) {
		uint32_t v = __atomic_load_n(w, __ATOMIC_RELAXED);
		/* Ordering: acquire; pairs with the release in idx_unlock(). */
		if (!(v & IDX_LOCKED) &&
		    __atomic_compare_exchange_n(w, &v, v | IDX_LOCKED, true, __ATOMIC_ACQUIRE,
		                                __ATOMIC_RELAXED))
			return;
		ck_pr_stall(); /* portable relax: pause on x86, yield on aarch64 */
	}
}

static inline void idx_unlock(uint32_t *w)
{
	__atomic_fetch_and(w, ~IDX_LOCKED, __ATOMIC_RELEASE);
}

/*
 * A tree node = one distinct prefix (block path from the root).  32 bytes.
 * seq:      H(parent->seq, local hash); the node-table key.  Immutable.
 * parent:   immutable while live; reused as the retire-list link once dead (readers compare it,
 *           never dereference it, so they access it atomically).
 * ranks:    tagged: 0 = none, (slot << 1 | 1) = exactly one rank, else a struct idx_rset *
 *           (copy on write, RCU-published).
 * lock:     IDX_LOCKED | IDX_DEAD; guards ranks and death.
 * nchildren: live children (atomic); a node with no rank and no child is reclaimed.
 */
struct idx_node {
	uint64_t seq;
	struct idx_node *parent;
	uintptr_t ranks;
	uint32_t lock;
	uint32_t nchildren;
};

/* A sorted rank-slot array, n >= 2 entries (may hold adjacent duplicates after an in-place
 * removal done without memory).  Immutable once published, except that fallback. */
struct idx_rset {
	uint32_t n;   /* entries in use */
	uint32_t cap; /* entries allocated (the size to free) */
	struct idx_rset *next_free;
	uint32_t slot[];
};

/* Node-table entry.  node: NULL = never used (ends a probe), IDX_TOMB = deleted. */
struct idx_ent {
	uint64_t seq;
	struct idx_node *node;
};
#define IDX_TOMB ((struct idx_node *)(uintptr_t)1)

struct idx_tab {
	uint64_t mask;
	struct idx_tab *next_free;
	struct idx_ent e[];
};

/* One of IDX_SEGS independently locked open-addressing tables; the segment is seq's top bits.
 * Writers use tab under the lock; readers use kvr_index.view[], kept apart so that writer
 * traffic on this line never invalidates what readers read. */
struct idx_seg {
	struct idx_tab *tab; /* the writers' copy of view[] (64-byte aligned) */
	uint32_t lock;
	uint32_t count;
	uint32_t tombs;
} __attribute__((aligned(IDX_CACHELINE)));

/* Per-rank map ext hash -> node: linear probing, backward-shift deletion, node NULL = empty.
 * Private to the slot's writer thread. */
struct idx_xent {
	uint64_t ext;
	struct idx_node *node;
	uint64_t extra; /* copies beyond the first (count_copies mode) */
};

struct idx_xmap {
	struct idx_xent *e;
	uint64_t mask; /* capacity - 1, or 0 with e NULL */
	uint64_t count;
};

/* Objects retired by writer calls; freed together after one grace period. */
struct idx_retire {
	struct idx_node *nodes;
	struct idx_rset *sets;
	struct idx_tab *tabs;
	uint32_t n; /* objects on the lists */
};

enum { SLOT_FREE = 0, SLOT_ACTIVE = 1, SLOT_RETIRING = 2 };

struct idx_rank {
	uint64_t worker_id; /* atomic relaxed: read by lock-free rank_find */
	uint32_t dp_rank;
	uint32_t state;
	uint64_t tree_size; /* atomic relaxed: blocks held; read by find_matches */
	struct idx_xmap map;
	struct idx_retire pend; /* retired by this slot's writer, not yet handed to call_rcu */
	uint32_t next_free;     /* free-slot list link */
} __attribute__((aligned(IDX_CACHELINE)));

/* Lookup (worker, dp) -> slot: open addressing of slot+1 (0 empty, UINT32_MAX deleted). */
struct idx_rtab {
	uint32_t mask;
	uint32_t tombs;
	uint32_t used;
	uint32_t pad;
	uint32_t e[];
};

struct kvr_index {
	/* Readers' view of the segments: (table | log2(capacity)), 0 = empty; RCU-published. */
	uintptr_t view[IDX_SEGS] __attribute__((aligned(IDX_CACHELINE)));
	struct idx_seg seg[IDX_SEGS];
	struct idx_node root;
	uint32_t max_ranks;
	struct idx_rank *rank;
	struct idx_rtab *rtab; /* RCU-published */
	uint32_t rank_lock;
	uint32_t free_head; /* UINT32_MAX = none */
	uint64_t active_ranks;
	/* counters (atomic relaxed) */
	uint64_t c_parent_nf, c_block_nf, c_invalid, c_stored, c_removed, c_nodes, c_copies;
	uint64_t bytes_shared, bytes_rank;
	uint64_t pending;  /* queued call_rcu callbacks (atomic) */
	bool count_copies; /* kvr_index_set_count_copies() */
};

/* Node-table key of the child with local hash `local` below a node with key `pseq`.  Bijective
 * in local for a fixed pseq (xor, odd multiply and xorshift each are), so (parent, seq) names
 * the local hash.  Kept short (one multiply): readers compute it once per hop in a chain.
 * Context: any. */
static inline uint64_t idx_seq(uint64_t pseq, uint64_t local)
{
	uint64_t x = (pseq ^ local) * 0x9e3779b97f4a7c15ull;
	return x ^ (x >> 29);
}

static inline struct idx_seg *idx_seg_of(const struct kvr_index *idx, uint64_t seq)
{
	return (struct idx_seg *)&idx->seg[seq >> (64 - IDX_SEGS_BITS)];
}

/* Entry index of seq in a table (segment bits excluded). */
static inline uint64_t idx_home(const struct idx_tab *t, uint64_t seq)
{
	return seq & t->mask; /* seq is already a mixed hash; the segment used its top bits */
}

static inline uint64_t idx_bytes_tab(uint64_t mask)
{
	return sizeof(struct idx_tab) + (mask + 1) * sizeof(struct idx_ent);
}

static inline uint64_t idx_bytes_rset(uint32_t cap)
{
	return sizeof(struct idx_rset) + (uint64_t)cap * sizeof(uint32_t);
}

/* Finds the live-or-dying node (parent, seq) in the node table.  Context: inside a read section
 * (readers and writers).  Ordering: acquire load of the view and of each entry's node; pairs
 * with the release stores in seg_rebuild() and kvr_index_table_insert(). */
static inline struct idx_node *idx_lookup(const struct kvr_index *idx,
                                          const struct idx_node *parent, uint64_t seq)
{
	uintptr_t v = __atomic_load_n(&idx->view[seq >> (64 - IDX_SEGS_BITS)], __ATOMIC_ACQUIRE);
	if (!v)
		return NULL;
	const struct idx_tab *t = (const struct idx_tab *)(v & ~(uintptr_t)63);
	uint64_t mask = ((uint64_t)1 << (v & 63)) - 1;
	for (uint64_t i = seq & mask;; i = (i + 1) & mask) {
		struct idx_node *n = __atomic_load_n(&t->e[i].node, __ATOMIC_ACQUIRE);
		if (!n)
			return NULL;
		if (n == IDX_TOMB || __atomic_load_n(&t->e[i].seq, __ATOMIC_RELAXED) != seq)
			continue;
		if (n->seq == seq && __atomic_load_n(&n->parent, __ATOMIC_RELAXED) == parent)
			return n;
	}
}

/* The home entry of seq in the readers' view, or NULL (prefetch hints only). */
static inline const struct idx_ent *idx_home_entry(const struct kvr_index *idx, uint64_t seq)
{
	uintptr_t v = __atomic_load_n(&idx->view[seq >> (64 - IDX_SEGS_BITS)], __ATOMIC_ACQUIRE);
	if (!v)
		return NULL;
	const struct idx_tab *t = (const struct idx_tab *)(v & ~(uintptr_t)63);
	return &t->e[seq & (((uint64_t)1 << (v & 63)) - 1)];
}

/* Inserts n (seq set) into its segment; Context: writer inside a read section, holding no
 * segment lock.  If a live node with the same (parent, seq) is there, returns it instead and
 * inserts nothing; returns n when inserted; NULL on ENOMEM. */
struct idx_node *kvr_index_table_insert(struct kvr_index *idx, struct idx_node *n,
                                        struct idx_retire *rt);
/* Deletes n from its segment.  Context: writer in a read section, holding n's lock. */
void kvr_index_table_delete(struct kvr_index *idx, struct idx_node *n, struct idx_retire *rt);
/* Hands the batch to call_rcu.  Context: writer, OUTSIDE the read section. */
#define IDX_RETIRE_BATCH                                                                           \
	256 /* objects a slot's writer gathers per call_rcu (fewer grace periods,                  \
	     * so fewer membarrier IPIs on the readers' CPUs) */
void kvr_index_retire_flush(struct kvr_index *idx, struct idx_retire *rt);
/* Slot of an active rank, or NULL.  Context: writer thread of the slot. */
struct idx_rank *kvr_index_rank_get_active(struct kvr_index *idx, uint32_t slot);

static inline void idx_count(uint64_t *c, int64_t d)
{
	__atomic_add_fetch(c, (uint64_t)d, __ATOMIC_RELAXED);
}

#endif /* KVR_CORE_INDEX_INTERNAL_H */
