/*
 * tests/ref/ttl_ref.c - the per-block TTL store (one entry per held hash): the oracle of
 * test_ttl_diff's differential test against shards/ttl.c, which keeps runs (issue 11 item 3).
 * Functions renamed ref_ttl_*; it shares the types of shards/lru.h.
 *
 * Original essay follows.
 *
 * shards/ttl.c - TTL retention of one rank (issue 5, part B).
 *
 * The idea.  Every entry of one store has the same ttl, so expiries are issued in time order:
 * a FIFO list ordered by expiry is already a perfect priority queue.  A refresh unlinks the entry
 * (O(1), doubly linked) and appends it with its new expiry; expiry pops from the head.  No heap,
 * no timing wheel.
 *
 * Buckets.  Expiries are rounded up to a multiple of bucket_ns (default 100 ms).  Two effects:
 * the owner's timer fires at most once per bucket (ref_ttl_next_expiry() is always a bucket
 * boundary), and a block routed again within the same bucket costs a hash lookup and nothing
 * else (its expiry does not change, so it is not moved).
 *
 * Invariant: list order == non-decreasing expiry.  A clock that steps backwards (virtual time,
 * tests) could break it, so a new expiry is clamped to at least the tail's.
 *
 * Storage: entries in a slab with a free list (indices stable), seq -> index in shards/u64map.h.
 */
#include "ttl_ref.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/u64map.h"

#define NIL UINT32_MAX

struct entry {
	uint64_t seq;
	uint64_t expiry;
	uint32_t pos;
	uint32_t prev, next; /* expiry list; next doubles as the free list */
	uint32_t pad;
};

struct ref_ttl {
	uint64_t ttl, bucket;
	struct entry *e;
	uint32_t cap, live, free_head;
	uint32_t head, tail;
	struct kvr_u64map by_seq;
};

int ref_ttl_create(uint64_t ttl_ns, uint64_t bucket_ns, struct ref_ttl **out)
{
	if (!out || ttl_ns == 0)
		return KVR_EINVAL;
	struct ref_ttl *t = kvr_calloc(1, sizeof(*t));
	if (!t)
		return KVR_ENOMEM;
	t->ttl = ttl_ns;
	t->bucket = bucket_ns;
	t->free_head = NIL;
	t->head = t->tail = NIL;
	kvr_u64map_init(&t->by_seq);
	*out = t;
	return 0;
}

void ref_ttl_destroy(struct ref_ttl *t)
{
	if (!t)
		return;
	kvr_free(t->e, (size_t)t->cap * sizeof(struct entry));
	kvr_u64map_fini(&t->by_seq);
	kvr_free(t, sizeof(*t));
}

static int reserve(struct ref_ttl *t, size_t n)
{
	if ((size_t)t->live + n >= NIL)
		return KVR_ERANGE;
	if ((size_t)t->live + n > t->cap) {
		size_t nc = (size_t)t->cap * 2;
		if (nc < (size_t)t->live + n)
			nc = (size_t)t->live + n;
		if (nc < 64)
			nc = 64;
		if (nc >= NIL)
			nc = NIL - 1;
		struct entry *e = kvr_realloc(t->e, (size_t)t->cap * sizeof(*e), nc * sizeof(*e));
		if (!e)
			return KVR_ENOMEM;
		for (size_t i = nc; i-- > t->cap;) {
			e[i].next = t->free_head;
			t->free_head = (uint32_t)i;
		}
		t->e = e;
		t->cap = (uint32_t)nc;
	}
	return kvr_u64map_reserve(&t->by_seq, n);
}

static void unlink_entry(struct ref_ttl *t, uint32_t i)
{
	struct entry *e = &t->e[i];
	if (e->prev != NIL)
		t->e[e->prev].next = e->next;
	else
		t->head = e->next;
	if (e->next != NIL)
		t->e[e->next].prev = e->prev;
	else
		t->tail = e->prev;
}

static void append_entry(struct ref_ttl *t, uint32_t i)
{
	struct entry *e = &t->e[i];
	e->next = NIL;
	e->prev = t->tail;
	if (t->tail != NIL)
		t->e[t->tail].next = i;
	else
		t->head = i;
	t->tail = i;
}

static uint64_t expiry_at(const struct ref_ttl *t, uint64_t now)
{
	uint64_t x = now + t->ttl;
	if (x < now)
		x = UINT64_MAX; /* saturate */
	if (t->bucket > 1 && x % t->bucket) {
		uint64_t up = x + (t->bucket - x % t->bucket);
		x = up > x ? up : UINT64_MAX;
	}
	if (t->tail != NIL && t->e[t->tail].expiry > x)
		x = t->e[t->tail].expiry;
	return x;
}

int ref_ttl_record(struct ref_ttl *t, const struct kvr_lru_block *b, size_t n, uint32_t start_pos,
                   uint64_t now, struct kvr_lru_out *out)
{
	if (!t || !out || (n > 0 && !b))
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	int rc;
	if ((rc = reserve(t, n)) || (rc = kvr_lru_out_reserve(out, n, 0)))
		return rc;
	uint64_t x = expiry_at(t, now);
	for (size_t k = 0; k < n; k++) {
		uint32_t *ix = kvr_u64map_find(&t->by_seq, b[k].seq);
		uint32_t i;
		if (ix) {
			i = *ix;
			t->e[i].pos = start_pos + (uint32_t)k;
			if (t->e[i].expiry == x)
				continue; /* same bucket: nothing moves */
			unlink_entry(t, i);
		} else {
			i = t->free_head;
			t->free_head = t->e[i].next;
			t->live++;
			t->e[i].seq = b[k].seq;
			t->e[i].pos = start_pos + (uint32_t)k;
			kvr_u64map_insert(&t->by_seq, b[k].seq, i);
			kvr_lru_out_stored(out, (uint32_t)k, 1);
		}
		t->e[i].expiry = x;
		append_entry(t, i);
	}
	return 0;
}

int ref_ttl_expire(struct ref_ttl *t, uint64_t now, struct kvr_lru_out *out)
{
	if (!t || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	size_t n = 0;
	for (uint32_t i = t->head; i != NIL && t->e[i].expiry <= now; i = t->e[i].next)
		n++;
	int rc = kvr_lru_out_reserve(out, 0, n);
	if (rc)
		return rc;
	while (n--) {
		uint32_t i = t->head;
		unlink_entry(t, i);
		kvr_u64map_remove(&t->by_seq, t->e[i].seq);
		kvr_lru_out_evicted_run(out, &t->e[i].seq, 1);
		t->e[i].next = t->free_head;
		t->free_head = i;
		t->live--;
	}
	return 0;
}

uint64_t ref_ttl_next_expiry(const struct ref_ttl *t)
{
	return (t && t->head != NIL) ? t->e[t->head].expiry : UINT64_MAX;
}

size_t ref_ttl_overlap(const struct ref_ttl *t, const uint64_t *seq, size_t n)
{
	if (!t || !seq)
		return 0;
	size_t i = 0;
	while (i < n && kvr_u64map_find(&t->by_seq, seq[i]))
		i++;
	return i;
}

size_t ref_ttl_count(const struct ref_ttl *t)
{
	return t ? t->live : 0;
}

int ref_ttl_lookup(const struct ref_ttl *t, uint64_t seq, uint64_t *expiry, uint32_t *pos)
{
	if (!t)
		return KVR_EINVAL;
	uint32_t *ix = kvr_u64map_find(&t->by_seq, seq);
	if (!ix)
		return KVR_ENOENT;
	if (expiry)
		*expiry = t->e[*ix].expiry;
	if (pos)
		*pos = t->e[*ix].pos;
	return 0;
}
