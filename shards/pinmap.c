/*
 * shards/pinmap.c - every rank's pinned runs in one RCU hash table, for routing threads.
 *
 * The idea.  shards/load.c keeps a rank's pinned set as runs of consecutive chain blocks, split
 * where a request leaves a run and never merged, so (per rank) a run's head hangs right below
 * another run's tail, never below an interior block, and each hash heads at most one run.
 * Publishing those runs keyed by head hash is therefore enough to walk a prompt's chain per
 * rank: probe the head of the prompt, follow the run while the prompt agrees (a sequence hash
 * names its whole prefix, so one compare at the run's far end decides the whole overlap, and a
 * binary search finds the divergence otherwise), and where the prompt leaves the run's tail,
 * probe the next head.  All ranks walk together: one probe per distinct boundary position
 * returns every rank's run starting there (a list per head), so a prompt no rank pins costs one
 * probe.  Shard work is O(1) per run created, split or freed, instead of one table write per
 * pinned block in the general index (core/index.c) this replaced for pinned blocks.
 *
 * Table.  Open addressing over pointers to runs (the group head; other ranks' runs with the
 * same head hang off ->next), tombstones on delete, rebuilt into a new array on growth, heavy
 * tombstones or a shrink, the old array freed after a grace period.  Load stays in (0.125, 0.7]
 * between rebuilds, so a map that empties and fills again (every request pins, then unpins) does
 * not rebuild on every cycle.
 *
 * Ordering.  Writers hold pm->lock.  A run is fully initialised before the release store that
 * links it (a table entry or a predecessor's ->next); readers load links with acquire.  A split
 * links the right part first, then shrinks the left run in place (so a walk finds the blocks in
 * one or the other, never in neither; for that, a walk reloads the table at each boundary: the
 * right part may be in a table rebuilt after the walk began): len is stored (release) before
 * seqs, and readers load
 * seqs (acquire) before len, so a reader that sees the new, shorter array also sees the shorter
 * len; one that sees the old array may see either len, and the old array is immutable and alive
 * until a grace period after the run owning it goes.  Unlinked runs and arrays are freed through
 * call_rcu.  A reader racing with a pin thus answers as of just before or just after it (the new
 * run is linked last); racing a finish, which unlinks its runs one at a time, anything between
 * (the decision is a prediction either way; tests/stress/stress_pinmap.c checks both).  It never
 * reads freed or unwritten memory.
 */
#include "shards/pinmap.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "core/alloc.h"
#include "core/place.h"
#include "kvrouter.h"
#include "shards/chain.h"

#define TAB_MIN 64
#define TOMB    ((struct kvr_pinrun *)1)

struct tab {
	struct rcu_head rcu;
	uint64_t mask;
	struct kvr_pinrun *e[];
};

struct kvr_pinmap {
	/* Read by every decision, written only on a rebuild: on a line of its own, away from the
	 * writers' lock and counters (shared with them, every pin and unpin cost each routing
	 * thread a cache miss on it). */
	struct tab *view __attribute__((aligned(64))); /* published (RCU) */
	pthread_mutex_t lock __attribute__((aligned(64)));
	size_t count, tombs; /* groups, tombstones (writer) */
	size_t runs;         /* published runs (atomic: kvr_pinmap_runs reads it) */
};

static inline uint64_t home(uint64_t h)
{
	h ^= h >> 29;
	return kvr_place(h) >> 17;
}

static size_t tab_bytes(uint64_t cap)
{
	return sizeof(struct tab) + cap * sizeof(struct kvr_pinrun *);
}

int kvr_pinmap_create(struct kvr_pinmap **out)
{
	if (!out)
		return KVR_EINVAL;
	struct kvr_pinmap *pm = kvr_alloc_aligned(sizeof(*pm)); /* zeroed */
	if (!pm)
		return KVR_ENOMEM;
	if (pthread_mutex_init(&pm->lock, NULL)) {
		kvr_free_aligned(pm, sizeof(*pm));
		return KVR_ENOMEM;
	}
	*out = pm;
	return 0;
}

void kvr_pinmap_destroy(struct kvr_pinmap *pm)
{
	if (!pm)
		return;
	if (pm->view)
		kvr_free(pm->view, tab_bytes(pm->view->mask + 1));
	pthread_mutex_destroy(&pm->lock);
	kvr_free_aligned(pm, sizeof(*pm));
}

static void tab_cb(struct rcu_head *h)
{
	KVR_RCU_CALLBACK_ENTER();
	struct tab *t = caa_container_of(h, struct tab, rcu);
	kvr_free(t, tab_bytes(t->mask + 1));
}

/* Smallest capacity with load <= 0.4. */
static uint64_t cap_for(size_t count)
{
	uint64_t cap = TAB_MIN;
	while ((uint64_t)count * 5 > cap * 2)
		cap <<= 1;
	return cap;
}

/* Copies the live groups into a new array of cap entries and publishes it; the old one is freed
 * after a grace period.  Context: pm->lock held.  0 or KVR_ENOMEM (nothing changed). */
static int rebuild(struct kvr_pinmap *pm, uint64_t cap)
{
	struct tab *nt = kvr_calloc(1, tab_bytes(cap));
	if (!nt)
		return KVR_ENOMEM;
	nt->mask = cap - 1;
	struct tab *ot = pm->view;
	if (ot) {
		for (uint64_t i = 0; i <= ot->mask; i++) {
			struct kvr_pinrun *g = ot->e[i];
			if (!g || g == TOMB)
				continue;
			uint64_t j = home(g->head) & nt->mask;
			while (nt->e[j])
				j = (j + 1) & nt->mask;
			nt->e[j] = g;
		}
	}
	pm->tombs = 0;
	/* Ordering: release; pairs with the acquire in kvr_pinmap_depths(). */
	kvr_rcu_publish(&pm->view, nt);
	if (ot) {
		if (kvr_rcu_thread_online() == 0) {
			kvr_rcu_call(&ot->rcu, tab_cb);
		} else {
			kvr_rcu_synchronize();
			kvr_free(ot, tab_bytes(ot->mask + 1));
		}
	}
	return 0;
}

int kvr_pinmap_add(struct kvr_pinmap *pm, struct kvr_pinrun *r)
{
	pthread_mutex_lock(&pm->lock);
	struct tab *t = pm->view;
	if ((!t || (pm->count + pm->tombs + 1) * 10 > (t->mask + 1) * 7) &&
	    rebuild(pm, cap_for(pm->count + 1))) {
		pthread_mutex_unlock(&pm->lock);
		return KVR_ENOMEM;
	}
	t = pm->view;
	uint64_t i = home(r->head) & t->mask, free_at = UINT64_MAX;
	for (;; i = (i + 1) & t->mask) {
		struct kvr_pinrun *g = t->e[i];
		if (!g)
			break;
		if (g == TOMB) {
			if (free_at == UINT64_MAX)
				free_at = i;
			continue;
		}
		if (g->head == r->head) { /* another rank's run starts here: r heads the group */
			__atomic_store_n(&r->next, g, __ATOMIC_RELAXED);
			/* Ordering: release; pairs with the acquire in group(). */
			__atomic_store_n(&t->e[i], r, __ATOMIC_RELEASE);
			r->published = 1;
			__atomic_store_n(&pm->runs, pm->runs + 1, __ATOMIC_RELAXED);
			pthread_mutex_unlock(&pm->lock);
			return 0;
		}
	}
	if (free_at != UINT64_MAX) {
		i = free_at;
		pm->tombs--;
	}
	__atomic_store_n(&r->next, NULL, __ATOMIC_RELAXED);
	/* Ordering: release; pairs with the acquire in group(). */
	__atomic_store_n(&t->e[i], r, __ATOMIC_RELEASE);
	pm->count++;
	r->published = 1;
	__atomic_store_n(&pm->runs, pm->runs + 1, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&pm->lock);
	return 0;
}

void kvr_pinmap_del(struct kvr_pinmap *pm, struct kvr_pinrun *r)
{
	if (!r->published)
		return;
	pthread_mutex_lock(&pm->lock);
	struct tab *t = pm->view;
	for (uint64_t i = home(r->head) & t->mask;; i = (i + 1) & t->mask) {
		struct kvr_pinrun *g = t->e[i];
		if (!g)
			break; /* NEVER: a published run is in its group */
		if (g == TOMB || g->head != r->head)
			continue;
		struct kvr_pinrun *nx = r->next;
		if (g == r) {
			/* Empty, not a tombstone, when no probe passes this entry (the next one is
			 * empty): a map that fills and empties then never needs a purge. */
			bool end = !t->e[(i + 1) & t->mask];
			/* Ordering: release (a reader at r still follows r->next: r lives on). */
			__atomic_store_n(&t->e[i], nx ? nx : end ? NULL : TOMB, __ATOMIC_RELEASE);
			if (!nx) {
				pm->count--;
				pm->tombs += end ? 0 : 1;
				/* Tombstones just before a now-empty entry end no probe either. */
				for (uint64_t j = (i - 1) & t->mask; end && t->e[j] == TOMB;
				     j = (j - 1) & t->mask) {
					__atomic_store_n(&t->e[j], NULL, __ATOMIC_RELEASE);
					pm->tombs--;
				}
			}
		} else {
			while (g->next != r)
				g = g->next;
			__atomic_store_n(&g->next, nx, __ATOMIC_RELEASE);
		}
		break;
	}
	r->published = 0;
	__atomic_store_n(&pm->runs, pm->runs - 1, __ATOMIC_RELAXED);
	uint64_t cap = t->mask + 1;
	if ((cap > TAB_MIN && (uint64_t)pm->count * 8 < cap) || (uint64_t)pm->tombs * 4 > cap)
		(void)rebuild(pm, cap_for(pm->count)); /* on failure the old array stays: fine */
	pthread_mutex_unlock(&pm->lock);
}

size_t kvr_pinmap_runs(const struct kvr_pinmap *pm)
{
	return pm ? __atomic_load_n(&pm->runs, __ATOMIC_RELAXED) : 0;
}

static void retire_cb(struct rcu_head *h)
{
	KVR_RCU_CALLBACK_ENTER();
	struct kvr_pinrun *r = caa_container_of(h, struct kvr_pinrun, rcu);
	while (r) {
		struct kvr_pinrun *nx = r->retire_nxt;
		kvr_free_transient(r->mem, r->mem_cap * sizeof(uint64_t));
		kvr_free_transient(r, sizeof(*r));
		r = nx;
	}
}

void kvr_pinrun_retire(struct kvr_pinrun_retire *b, struct kvr_pinrun *r)
{
	r->retire_nxt = b->head;
	b->head = r;
}

void kvr_pinrun_retire_flush(struct kvr_pinrun_retire *b)
{
	struct kvr_pinrun *r = b->head;
	if (!r)
		return;
	b->head = NULL;
	if (kvr_rcu_thread_online() == 0) {
		kvr_rcu_call(&r->rcu, retire_cb);
	} else { /* no memory to register: wait for the grace period here instead */
		kvr_rcu_synchronize();
		retire_cb(&r->rcu);
	}
}

/* The runs (of every rank) whose first hash is h, or NULL.  Context: read section. */
static const struct kvr_pinrun *group(const struct tab *t, uint64_t h)
{
	for (uint64_t i = home(h) & t->mask;; i = (i + 1) & t->mask) {
		/* Ordering: acquire; pairs with the release stores in kvr_pinmap_add/del. */
		const struct kvr_pinrun *g = __atomic_load_n(&t->e[i], __ATOMIC_ACQUIRE);
		if (!g)
			return NULL;
		if (g != TOMB && g->head == h)
			return g;
	}
}

/* How many leading hashes of q[0..m) (m >= 1, q[0] == g->head) run g holds; *full says the
 * match reached g's last block. */
static uint32_t extent(const struct kvr_pinrun *g, const uint64_t *q, size_t m, bool *full)
{
	/* Ordering: seqs before len (see the essay). */
	const uint64_t *a = __atomic_load_n(&g->seqs, __ATOMIC_ACQUIRE);
	uint32_t len = __atomic_load_n(&g->len, __ATOMIC_ACQUIRE);
	if (len == 0)
		return *full = false;
	uint32_t e = 1 + kvr_chain_agree(a, len - 1, q, 1, m - 1);
	*full = e == len;
	return e;
}

void kvr_pinmap_prefetch(const struct kvr_pinmap *pm, uint64_t seq0)
{
	/* Ordering: acquire; pairs with the release in rebuild() (the array is read, not the
	 * entry: no ordering needed for a hint, but the pointer must be a published one). */
	const struct tab *t = pm ? __atomic_load_n(&pm->view, __ATOMIC_ACQUIRE) : NULL;
	if (t)
		__builtin_prefetch(&t->e[home(seq0) & t->mask], 0, 3);
}

size_t kvr_pinmap_depths(const struct kvr_pinmap *pm, const uint64_t *seq, size_t n,
                         uint32_t *depth, uint32_t *slots)
{
	if (!pm || n == 0 || n >= KVR_PIN_OPEN)
		return 0;
	/* Ordering: acquire; pairs with the release in rebuild(). */
	const struct tab *t = __atomic_load_n(&pm->view, __ATOMIC_ACQUIRE);
	if (!t)
		return 0;
	size_t ns = 0;
	uint32_t k = 0;
	for (;;) {
		/* The table as of now, not as of the walk's start: a split publishes its right part
		 * (maybe into a table rebuilt for it), then shrinks the left run, which this walk
		 * reads in place.  Having seen the shorter len (acquire), a fresh load of the view
		 * sees that table or a newer one, so the right part is found; the table loaded at
		 * the start may predate it, and the walk stopped at the split (tests/stress/
		 * stress_pinmap.c: a pinned depth of 32 of 64, 3 runs in 120 at load 5). */
		if (k)
			t = __atomic_load_n(&pm->view, __ATOMIC_ACQUIRE);
		/* Every rank whose walk reached position k (open at k) continues with its run
		 * headed by seq[k], if it has one. */
		for (const struct kvr_pinrun *g = group(t, seq[k]); g;
		     g = __atomic_load_n(&g->next, __ATOMIC_ACQUIRE)) {
			uint32_t s = g->slot;
			if (k == 0) {
				if (depth[s])
					continue; /* a racing writer's duplicate: the first one
					             counts */
				slots[ns++] = s;
			} else if (depth[s] != (k | KVR_PIN_OPEN)) {
				continue;
			}
			bool full;
			uint32_t d = k + extent(g, seq + k, n - k, &full);
			depth[s] = d | (full && d < n ? KVR_PIN_OPEN : 0);
		}
		/* Ranks still open at k have no run there: their depth is k.  Next: the nearest
		 * position where some rank is open. */
		uint32_t next = UINT32_MAX;
		for (size_t i = 0; i < ns; i++) {
			uint32_t v = depth[slots[i]];
			if (!(v & KVR_PIN_OPEN))
				continue;
			uint32_t d = v & ~KVR_PIN_OPEN;
			if (d == k)
				depth[slots[i]] = d;
			else if (d < next)
				next = d;
		}
		if (next == UINT32_MAX)
			return ns;
		k = next;
	}
}
