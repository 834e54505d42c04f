/*
 * shards/timer.c - binary min-heap timers with O(1) stale-cancel detection (see timer.h).
 *
 * Id layout: (generation << 32) | (slab index + 1).  A record's generation is bumped whenever
 * it is freed, so an id of a fired or cancelled timer never matches again; a record at the last
 * generation is retired instead of freed (remove_at).
 */
#include "shards/timer.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"

#define NONE UINT32_MAX

struct kvr_timer_rec {
	uint64_t deadline;
	uint64_t seq;
	kvr_timer_fn fn;
	void *arg;
	uint32_t heap_pos; /* index in heap while pending; next free while free */
	uint32_t gen;
};

void kvr_timers_init(struct kvr_timers *t)
{
	memset(t, 0, sizeof(*t));
	t->free_head = NONE;
}

void kvr_timers_fini(struct kvr_timers *t)
{
	kvr_free(t->rec, (size_t)t->cap * sizeof(*t->rec));
	kvr_free(t->heap, (size_t)t->cap * sizeof(*t->heap));
	kvr_timers_init(t);
}

static int before(const struct kvr_timers *t, uint32_t a, uint32_t b)
{
	const struct kvr_timer_rec *x = &t->rec[a], *y = &t->rec[b];
	return x->deadline < y->deadline || (x->deadline == y->deadline && x->seq < y->seq);
}

static void place(struct kvr_timers *t, uint32_t pos, uint32_t r)
{
	t->heap[pos] = r;
	t->rec[r].heap_pos = pos;
}

static void sift_up(struct kvr_timers *t, uint32_t pos)
{
	uint32_t r = t->heap[pos];
	while (pos > 0) {
		uint32_t parent = (pos - 1) / 2;
		if (!before(t, r, t->heap[parent]))
			break;
		place(t, pos, t->heap[parent]);
		pos = parent;
	}
	place(t, pos, r);
}

static void sift_down(struct kvr_timers *t, uint32_t pos)
{
	uint32_t r = t->heap[pos];
	for (;;) {
		uint32_t c = 2 * pos + 1;
		if (c >= t->n_heap)
			break;
		if (c + 1 < t->n_heap && before(t, t->heap[c + 1], t->heap[c]))
			c++;
		if (!before(t, t->heap[c], r))
			break;
		place(t, pos, t->heap[c]);
		pos = c;
	}
	place(t, pos, r);
}

static int grow(struct kvr_timers *t)
{
	uint32_t ncap = t->cap ? t->cap * 2 : 16;
	if (ncap <= t->cap)
		return KVR_ENOMEM;
	struct kvr_timer_rec *rec = kvr_alloc((size_t)ncap * sizeof(*rec));
	uint32_t *heap = kvr_alloc((size_t)ncap * sizeof(*heap));
	if (!rec || !heap) {
		kvr_free(rec, rec ? (size_t)ncap * sizeof(*rec) : 0);
		kvr_free(heap, heap ? (size_t)ncap * sizeof(*heap) : 0);
		return KVR_ENOMEM;
	}
	if (t->cap) {
		memcpy(rec, t->rec, (size_t)t->cap * sizeof(*rec));
		memcpy(heap, t->heap, (size_t)t->n_heap * sizeof(*heap));
	}
	kvr_free(t->rec, (size_t)t->cap * sizeof(*t->rec));
	kvr_free(t->heap, (size_t)t->cap * sizeof(*t->heap));
	t->rec = rec;
	t->heap = heap;
	for (uint32_t i = ncap; i-- > t->cap;) {
		rec[i].gen = 1;
		rec[i].fn = NULL;
		rec[i].heap_pos = t->free_head;
		t->free_head = i;
	}
	t->cap = ncap;
	return 0;
}

int kvr_timers_add(struct kvr_timers *t, uint64_t deadline_ns, kvr_timer_fn fn, void *arg,
                   uint64_t *id_out)
{
	if (!fn)
		return KVR_EINVAL;
	if (t->free_head == NONE) {
		int rc = grow(t);
		if (rc)
			return rc;
	}
	uint32_t r = t->free_head;
	struct kvr_timer_rec *rec = &t->rec[r];
	t->free_head = rec->heap_pos;
	rec->deadline = deadline_ns;
	rec->seq = ++t->seq;
	rec->fn = fn;
	rec->arg = arg;
	t->heap[t->n_heap] = r;
	sift_up(t, t->n_heap++);
	if (id_out)
		*id_out = ((uint64_t)rec->gen << 32) | (uint64_t)(r + 1);
	return 0;
}

/* Removes heap entry pos and returns its record to the free list. */
static void remove_at(struct kvr_timers *t, uint32_t pos)
{
	uint32_t r = t->heap[pos];
	uint32_t last = t->heap[--t->n_heap];
	if (pos < t->n_heap) {
		place(t, pos, last);
		sift_down(t, pos);
		sift_up(t, t->rec[last].heap_pos);
	}
	struct kvr_timer_rec *rec = &t->rec[r];
	rec->fn = NULL;
	/* A record whose generations are used up is retired, not reused: wrapping to 1 gave the
	 * ids of its first life back after 2^32 - 1 reuses (33 s of add and cancel), and a cancel
	 * of such a stale id cancelled the live timer that had its number.  One record (40 bytes)
	 * per 2^32 timers. */
	if (rec->gen == UINT32_MAX) {
		rec->heap_pos = NONE;
		return;
	}
	rec->gen++;
	rec->heap_pos = t->free_head;
	t->free_head = r;
}

int kvr_timers_cancel(struct kvr_timers *t, uint64_t id)
{
	uint64_t idx = (id & 0xffffffffu);
	if (idx == 0 || idx > t->cap)
		return KVR_ENOENT;
	struct kvr_timer_rec *rec = &t->rec[idx - 1];
	if (rec->fn == NULL || rec->gen != (uint32_t)(id >> 32))
		return KVR_ENOENT;
	remove_at(t, rec->heap_pos);
	return 0;
}

uint32_t kvr_timers_run(struct kvr_timers *t, uint64_t now_ns, struct kvr_shard *owner,
                        uint32_t max_fire)
{
	uint32_t n = 0;
	while (n < max_fire && t->n_heap && t->rec[t->heap[0]].deadline <= now_ns) {
		struct kvr_timer_rec *rec = &t->rec[t->heap[0]];
		kvr_timer_fn fn = rec->fn;
		void *arg = rec->arg;
		remove_at(t, 0); /* before the call: the callback may re-add or grow the slab */
		t->fired++;
		n++;
		fn(owner, arg);
	}
	return n;
}

uint64_t kvr_timers_next(const struct kvr_timers *t)
{
	return t->n_heap ? t->rec[t->heap[0]].deadline : UINT64_MAX;
}
