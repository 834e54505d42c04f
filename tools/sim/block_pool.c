/*
 * tools/sim/block_pool.c - vLLM v1's prefix-caching block pool (vllm/v1/core/block_pool.py and
 * FreeKVCacheBlockQueue in kv_cache_utils.py), re-implemented from its documented behaviour.
 *
 * The idea.  Physical blocks live in one array.  A free block (ref == 0) is linked into the
 * free queue, a doubly-linked list through prev/next indices, so that a hit can unlink a block
 * from the middle in O(1) (vLLM builds the same list for the same reason).  Cached blocks are
 * found through an open-addressing map seq -> (oldest copy, newest copy); the copies of one
 * hash are chained through copy_prev/copy_next, oldest first, like vLLM's
 * {hash: {block_id: block}} dict whose first entry get_cached_block returns.
 *
 * Invariants (checked by the tests):
 *  - queued <=> ref == 0; the queue holds exactly the free blocks, n_free of them;
 *  - hashed <=> the block is on the copy chain of its seq in the map; a map entry's chain is
 *    non-empty; n_keys = number of map entries;
 *  - a block loses its hash only when sim_pool_alloc() pops it (lazy eviction), or on reset.
 *
 * Modelled from vLLM: initial queue in block-id order; popleft for allocation; eviction of
 * the hash at pop time with one BlockRemoved per physical copy (the caller emits it; we report
 * whether it was the last copy, so a consumer can choose per-copy or per-hash semantics);
 * touch on hit; free in reverse request order, the blocks with a hash appended at the tail and,
 * in fresh-first order (vLLM's 2026 free_blocks, the default), those without one put at the
 * head, reused first (in tail-first order, vLLM's of 2025, appended with the rest); several copies
 * per hash; reset only when nothing is held.
 * Simplified: no null block (vLLM reserves block 0 as a placeholder for sliding-window and
 * skipped slots; full attention never uses it, so the pool here has all n blocks usable); one
 * KV cache group; no eviction-by-id (KV connectors), no metrics collector.
 *
 * Map: linear probing over a power-of-two table at most half full (at most n_blocks keys), with
 * backward-shift deletion so no tombstones accumulate.  XXH3 outputs are uniform, but a mixer
 * is applied anyway so hand-picked test hashes (1, 2, 3...) spread too.
 */
#include "tools/sim/block_pool.h"

#include <assert.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"

#define NIL SIM_NO_BLOCK

struct slot {
	uint64_t key;
	uint32_t head; /* oldest copy; NIL = empty slot */
	uint32_t tail; /* newest copy */
};

struct sim_pool {
	struct sim_block *blocks;
	uint32_t n_blocks;
	uint32_t n_free;
	uint32_t q_head, q_tail; /* free queue ends */
	bool tail_first;         /* a release appends its unhashed blocks too (vLLM of 2025) */
	struct slot *map;
	size_t map_mask;
	size_t n_keys;
};

static size_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	return (size_t)x;
}

/* Slot index holding key, or the empty slot where it would go. */
static size_t map_find(const struct sim_pool *p, uint64_t key)
{
	size_t i = mix(key) & p->map_mask;
	while (p->map[i].head != NIL && p->map[i].key != key)
		i = (i + 1) & p->map_mask;
	return i;
}

static void map_delete_at(struct sim_pool *p, size_t i)
{
	/* Backward-shift: move later members of the probe run into the hole when their home
	 * position does not lie cyclically in (hole, j]. */
	size_t j = i;
	for (;;) {
		j = (j + 1) & p->map_mask;
		if (p->map[j].head == NIL)
			break;
		size_t home = mix(p->map[j].key) & p->map_mask;
		bool in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
		if (in_range)
			continue;
		p->map[i] = p->map[j];
		i = j;
	}
	p->map[i].head = NIL;
	p->map[i].tail = NIL;
	p->n_keys--;
}

static void queue_push_tail(struct sim_pool *p, uint32_t id)
{
	struct sim_block *b = &p->blocks[id];
	assert(!b->queued);
	b->prev = p->q_tail;
	b->next = NIL;
	if (p->q_tail != NIL)
		p->blocks[p->q_tail].next = id;
	else
		p->q_head = id;
	p->q_tail = id;
	b->queued = true;
	p->n_free++;
}

static void queue_push_head(struct sim_pool *p, uint32_t id)
{
	struct sim_block *b = &p->blocks[id];
	assert(!b->queued);
	b->next = p->q_head;
	b->prev = NIL;
	if (p->q_head != NIL)
		p->blocks[p->q_head].prev = id;
	else
		p->q_tail = id;
	p->q_head = id;
	b->queued = true;
	p->n_free++;
}

static void queue_unlink(struct sim_pool *p, uint32_t id)
{
	struct sim_block *b = &p->blocks[id];
	assert(b->queued);
	if (b->prev != NIL)
		p->blocks[b->prev].next = b->next;
	else
		p->q_head = b->next;
	if (b->next != NIL)
		p->blocks[b->next].prev = b->prev;
	else
		p->q_tail = b->prev;
	b->prev = b->next = NIL;
	b->queued = false;
	p->n_free--;
}

/* Removes block id from its hash's copy chain; returns true if it was the last copy. */
static bool unhash(struct sim_pool *p, uint32_t id)
{
	struct sim_block *b = &p->blocks[id];
	size_t i = map_find(p, b->seq);
	assert(p->map[i].head != NIL);
	if (b->copy_prev != NIL)
		p->blocks[b->copy_prev].copy_next = b->copy_next;
	else
		p->map[i].head = b->copy_next;
	if (b->copy_next != NIL)
		p->blocks[b->copy_next].copy_prev = b->copy_prev;
	else
		p->map[i].tail = b->copy_prev;
	b->copy_prev = b->copy_next = NIL;
	b->hashed = false;
	bool last = p->map[i].head == NIL;
	if (last)
		map_delete_at(p, i);
	return last;
}

int sim_pool_create(uint32_t n_blocks, struct sim_pool **out)
{
	if (!out || n_blocks == 0 || n_blocks > (1u << 30))
		return KVR_EINVAL;
	struct sim_pool *p = kvr_calloc(1, sizeof(*p));
	if (!p)
		return KVR_ENOMEM;
	size_t cap = 2;
	while (cap < (size_t)n_blocks * 2)
		cap <<= 1;
	p->blocks = kvr_calloc(n_blocks, sizeof(*p->blocks));
	p->map = kvr_alloc(cap * sizeof(*p->map));
	if (!p->blocks || !p->map) {
		kvr_free(p->map, p->map ? cap * sizeof(*p->map) : 0);
		kvr_free(p->blocks, n_blocks * sizeof(*p->blocks));
		kvr_free(p, sizeof(*p));
		return KVR_ENOMEM;
	}
	for (size_t i = 0; i < cap; i++)
		p->map[i] = (struct slot){.key = 0, .head = NIL, .tail = NIL};
	p->map_mask = cap - 1;
	p->n_blocks = n_blocks;
	p->q_head = p->q_tail = NIL;
	for (uint32_t i = 0; i < n_blocks; i++) {
		p->blocks[i].copy_prev = p->blocks[i].copy_next = NIL;
		queue_push_tail(p, i);
	}
	*out = p;
	return 0;
}

void sim_pool_destroy(struct sim_pool *p)
{
	if (!p)
		return;
	kvr_free(p->map, (p->map_mask + 1) * sizeof(*p->map));
	kvr_free(p->blocks, (size_t)p->n_blocks * sizeof(*p->blocks));
	kvr_free(p, sizeof(*p));
}

uint32_t sim_pool_size(const struct sim_pool *p)
{
	return p->n_blocks;
}

uint32_t sim_pool_num_free(const struct sim_pool *p)
{
	return p->n_free;
}

size_t sim_pool_num_cached(const struct sim_pool *p)
{
	return p->n_keys;
}

const struct sim_block *sim_pool_block(const struct sim_pool *p, uint32_t id)
{
	return id < p->n_blocks ? &p->blocks[id] : NULL;
}

uint32_t sim_pool_lookup(const struct sim_pool *p, uint64_t seq)
{
	return p->map[map_find(p, seq)].head;
}

size_t sim_pool_match_prefix(const struct sim_pool *p, const uint64_t *seq, size_t n,
                             uint32_t *blocks_out)
{
	size_t i = 0;
	for (; i < n; i++) {
		uint32_t id = sim_pool_lookup(p, seq[i]);
		if (id == NIL)
			break;
		if (blocks_out)
			blocks_out[i] = id;
	}
	return i;
}

size_t sim_pool_count_free(const struct sim_pool *p, const uint32_t *blocks, size_t n)
{
	size_t c = 0;
	for (size_t i = 0; i < n; i++)
		c += p->blocks[blocks[i]].ref == 0;
	return c;
}

void sim_pool_touch(struct sim_pool *p, const uint32_t *blocks, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		struct sim_block *b = &p->blocks[blocks[i]];
		if (b->ref == 0)
			queue_unlink(p, blocks[i]);
		b->ref++;
	}
}

int sim_pool_alloc(struct sim_pool *p, size_t n, uint32_t *out, struct sim_evicted *evicted,
                   size_t *n_evicted)
{
	size_t ne = 0;
	if (n > p->n_free)
		return KVR_EAGAIN;
	for (size_t i = 0; i < n; i++) {
		uint32_t id = p->q_head;
		struct sim_block *b = &p->blocks[id];
		queue_unlink(p, id);
		assert(b->ref == 0);
		if (b->hashed) {
			uint64_t seq = b->seq, local = b->local;
			bool last = unhash(p, id);
			if (evicted)
				evicted[ne] = (struct sim_evicted){seq, local, last};
			ne++;
		}
		b->ref = 1;
		out[i] = id;
	}
	if (n_evicted)
		*n_evicted = ne;
	return 0;
}

bool sim_pool_cache_block(struct sim_pool *p, uint32_t id, uint64_t seq, uint64_t local)
{
	struct sim_block *b = &p->blocks[id];
	if (b->hashed)
		return false;
	assert(b->ref > 0);
	size_t i = map_find(p, seq);
	bool first = p->map[i].head == NIL;
	b->seq = seq;
	b->local = local;
	b->hashed = true;
	b->copy_next = NIL;
	if (first) {
		p->map[i] = (struct slot){.key = seq, .head = id, .tail = id};
		b->copy_prev = NIL;
		p->n_keys++;
	} else {
		b->copy_prev = p->map[i].tail;
		p->blocks[p->map[i].tail].copy_next = id;
		p->map[i].tail = id;
	}
	return first;
}

void sim_pool_release(struct sim_pool *p, const uint32_t *blocks, size_t n)
{
	/* vLLM's prepend_n puts the fresh blocks at the head in the order freed: pushed at the head
	 * in the opposite order (which of them goes first matters to nothing: none holds a hash).
	 */
	for (size_t k = 0; k < n; k++) {
		struct sim_block *b = &p->blocks[blocks[k]];
		assert(b->ref > 0);
		if (!p->tail_first && b->ref == 1 && !b->hashed) {
			b->ref = 0;
			queue_push_head(p, blocks[k]);
		}
	}
	for (size_t k = n; k-- > 0;) {
		struct sim_block *b = &p->blocks[blocks[k]];
		if (b->queued)
			continue; /* a fresh one, at the head already */
		assert(b->ref > 0);
		if (--b->ref == 0)
			queue_push_tail(p, blocks[k]);
	}
}

void sim_pool_set_tail_first(struct sim_pool *p, bool on)
{
	p->tail_first = on;
}

int sim_pool_reset(struct sim_pool *p)
{
	if (p->n_free != p->n_blocks)
		return KVR_EBUSY;
	for (uint32_t i = 0; i < p->n_blocks; i++) {
		struct sim_block *b = &p->blocks[i];
		b->hashed = false;
		b->copy_prev = b->copy_next = NIL;
	}
	for (size_t i = 0; i <= p->map_mask; i++)
		p->map[i].head = p->map[i].tail = NIL;
	p->n_keys = 0;
	return 0;
}

size_t sim_pool_cached_hashes(const struct sim_pool *p, uint64_t *out, size_t cap)
{
	size_t k = 0;
	for (size_t i = 0; i <= p->map_mask; i++) {
		if (p->map[i].head == NIL)
			continue;
		if (k < cap)
			out[k] = p->map[i].key;
		k++;
	}
	return k;
}

size_t sim_pool_free_order(const struct sim_pool *p, uint32_t *out, size_t cap)
{
	size_t k = 0;
	for (uint32_t id = p->q_head; id != NIL; id = p->blocks[id].next) {
		if (k < cap)
			out[k] = id;
		k++;
	}
	return k;
}

bool sim_pool_oldest_cached(const struct sim_pool *p, uint64_t *seq)
{
	for (uint32_t i = p->q_head; i != SIM_NO_BLOCK; i = p->blocks[i].next)
		if (p->blocks[i].hashed) {
			*seq = p->blocks[i].seq;
			return true;
		}
	return false;
}
