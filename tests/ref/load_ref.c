/*
 * tests/ref/load_ref.c - the per-block load tracker (one map entry per pinned hash, a copy of
 * every request's hashes): the oracle of test_load's differential test against shards/load.c,
 * which keeps the pinned set in runs (issue 11 item 3).  Functions renamed ref_load_*; it
 * shares the types of shards/load.h.
 *
 * Original essay follows.
 *
 * The idea (after Dynamo's ActiveSequences).  Decode load is the KV blocks the running requests
 * hold; two requests sharing a prefix hold its blocks once, so blocks are deduplicated with a
 * reference count per sequence hash (shards/u64map.h: seq -> pins).  The number of distinct
 * pinned hashes is the map's size.  Prefill load is the tokens still to be prefilled; requests
 * in prefill form a FIFO in admission order, and when an expected prefill duration is known the
 * head (the oldest, the one the engine is working on) decays linearly to zero over it, so a rank
 * deep into a long prefill does not look as busy as one that has just started it.
 *
 * Invariants: active_blocks == number of keys in `pins`; sum of pins == total pinned entries
 * over active requests; prefill_sum == sum of tokens of requests on the prefill list.
 * Storage: requests in a dense array (swap-remove) indexed by attempt through a u64map; each
 * keeps a copy of the hashes it pinned (to unpin them at finish).
 */
#include "load_ref.h"

#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/u64map.h"

#define NIL UINT32_MAX

struct req {
	uint64_t attempt;
	uint64_t *seq; /* pinned hashes (owned) */
	size_t n, cap;
	uint64_t tokens; /* prefill tokens, 0 once done */
	uint64_t start;  /* admission time */
	uint64_t order;  /* admission counter: the prefill FIFO order */
	uint32_t in_prefill;
};

struct ref_load {
	uint64_t expected_prefill;
	struct req *r;
	uint32_t n_req, cap_req;
	struct kvr_u64map by_attempt;
	struct kvr_u64map pins; /* seq -> pin count */
	uint64_t prefill_sum, n_prefill, next_order;
	/* Oldest in-prefill request, cached: the attempt (valid while oldest_valid). */
	uint64_t oldest_attempt;
	int oldest_valid;
};

int ref_load_create(uint64_t expected_prefill_ns, struct ref_load **out)
{
	if (!out)
		return KVR_EINVAL;
	struct ref_load *l = kvr_calloc(1, sizeof(*l));
	if (!l)
		return KVR_ENOMEM;
	l->expected_prefill = expected_prefill_ns;
	kvr_u64map_init(&l->by_attempt);
	kvr_u64map_init(&l->pins);
	*out = l;
	return 0;
}

void ref_load_destroy(struct ref_load *l)
{
	if (!l)
		return;
	for (uint32_t i = 0; i < l->n_req; i++)
		kvr_free(l->r[i].seq, l->r[i].cap * sizeof(uint64_t));
	kvr_free(l->r, (size_t)l->cap_req * sizeof(struct req));
	kvr_u64map_fini(&l->by_attempt);
	kvr_u64map_fini(&l->pins);
	kvr_free(l, sizeof(*l));
}

static struct req *find(const struct ref_load *l, uint64_t attempt)
{
	uint32_t *ix = kvr_u64map_find(&l->by_attempt, attempt);
	return ix ? &l->r[*ix] : NULL;
}

static int reserve_seq(struct req *q, size_t n)
{
	if (q->n + n <= q->cap)
		return 0;
	size_t nc = q->cap * 2 > q->n + n ? q->cap * 2 : q->n + n;
	uint64_t *p = kvr_realloc(q->seq, q->cap * sizeof(uint64_t), nc * sizeof(uint64_t));
	if (!p)
		return KVR_ENOMEM;
	q->seq = p;
	q->cap = nc;
	return 0;
}

static void pin(struct ref_load *l, struct req *q, const uint64_t *seq, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t *c = kvr_u64map_find(&l->pins, seq[i]);
		if (c)
			(*c)++;
		else
			kvr_u64map_insert(&l->pins, seq[i], 1);
		q->seq[q->n++] = seq[i];
	}
}

int ref_load_add(struct ref_load *l, uint64_t attempt, const uint64_t *seq, size_t n,
                 uint64_t prefill_tokens, uint64_t now)
{
	if (!l || (n > 0 && !seq))
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
	if ((rc = kvr_u64map_reserve(&l->by_attempt, 1)) ||
	    (rc = kvr_u64map_reserve(&l->pins, n)) || (rc = reserve_seq(q, n)))
		return rc; /* reserve_seq is last: on any failure q owns no memory */
	q->attempt = attempt;
	q->tokens = prefill_tokens;
	q->start = now;
	q->order = l->next_order++;
	q->in_prefill = 1;
	kvr_u64map_insert(&l->by_attempt, attempt, l->n_req++);
	pin(l, q, seq, n);
	l->prefill_sum += prefill_tokens;
	l->n_prefill++;
	if (!l->oldest_valid) { /* nobody else is in prefill */
		l->oldest_attempt = attempt;
		l->oldest_valid = 1;
	}
	return 0;
}

/* Recomputes the oldest in-prefill request (O(requests); only when the oldest leaves). */
static void refresh_oldest(struct ref_load *l)
{
	const struct req *best = NULL;
	for (uint32_t i = 0; i < l->n_req; i++)
		if (l->r[i].in_prefill && (!best || l->r[i].order < best->order))
			best = &l->r[i];
	l->oldest_valid = best != NULL;
	l->oldest_attempt = best ? best->attempt : 0;
}

static void end_prefill(struct ref_load *l, struct req *q)
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

int ref_load_prefill_done(struct ref_load *l, uint64_t attempt)
{
	if (!l)
		return KVR_EINVAL;
	struct req *q = find(l, attempt);
	if (!q)
		return KVR_ENOENT;
	end_prefill(l, q);
	return 0;
}

int ref_load_add_output(struct ref_load *l, uint64_t attempt, const uint64_t *seq, size_t n)
{
	if (!l || (n > 0 && !seq))
		return KVR_EINVAL;
	struct req *q = find(l, attempt);
	if (!q)
		return KVR_ENOENT;
	int rc;
	if ((rc = kvr_u64map_reserve(&l->pins, n)) || (rc = reserve_seq(q, n)))
		return rc;
	pin(l, q, seq, n);
	return 0;
}

int ref_load_finish(struct ref_load *l, uint64_t attempt)
{
	if (!l)
		return KVR_EINVAL;
	uint32_t *ix = kvr_u64map_find(&l->by_attempt, attempt);
	if (!ix)
		return KVR_ENOENT;
	uint32_t i = *ix;
	struct req *q = &l->r[i];
	for (size_t k = 0; k < q->n; k++) {
		uint32_t *c = kvr_u64map_find(&l->pins, q->seq[k]);
		if (--(*c) == 0)
			kvr_u64map_remove(&l->pins, q->seq[k]);
	}
	kvr_u64map_remove(&l->by_attempt, attempt);
	/* Swap the last request into slot i before recomputing the oldest. */
	uint64_t *seq = q->seq;
	size_t cap = q->cap;
	int was_prefill = q->in_prefill;
	uint64_t tokens = q->tokens;
	uint32_t last = --l->n_req;
	if (i != last) {
		l->r[i] = l->r[last];
		*kvr_u64map_find(&l->by_attempt, l->r[i].attempt) = i;
	}
	kvr_free(seq, cap * sizeof(uint64_t));
	if (was_prefill) {
		l->prefill_sum -= tokens;
		l->n_prefill--;
		if (l->oldest_valid && l->oldest_attempt == attempt)
			refresh_oldest(l);
	}
	return 0;
}

uint64_t ref_load_prefill_tokens(const struct ref_load *l, uint64_t now)
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

int ref_load_potential(const struct ref_load *l, const uint64_t *seq, size_t n,
                       uint64_t uncached_tokens, uint64_t now, struct kvr_load_potential *out)
{
	if (!l || !out || (n > 0 && !seq))
		return KVR_EINVAL;
	uint64_t fresh = 0;
	for (size_t i = 0; i < n; i++)
		fresh += kvr_u64map_find(&l->pins, seq[i]) == NULL;
	out->decode_blocks = l->pins.count + fresh;
	out->prefill_tokens = ref_load_prefill_tokens(l, now) + uncached_tokens;
	return 0;
}

void ref_load_stats(const struct ref_load *l, struct kvr_load_stats *st)
{
	memset(st, 0, sizeof(*st));
	if (!l)
		return;
	st->active_blocks = l->pins.count;
	st->prefill_tokens = l->prefill_sum;
	st->active_requests = l->n_req;
	st->in_prefill = l->n_prefill;
}
