/*
 * core/index_match.c - find_matches, the index's read side.
 *
 * The walk: the ranks of block 0's node start the active set (kept sorted by slot in the front
 * of the caller's out array); at every hop the set is intersected exactly with the next node's
 * rank set; a rank that drops out at hop i scored i and moves to the back of out.  The walk
 * stops when the set is empty, a node is missing, the query ends, or (early exit) one rank is
 * left.
 *
 * Prefetch pipeline.  All node-table keys are known up front (seq[i] = H(seq[i-1], qseq[i]),
 * core/index.c), so while hop i is intersected, the table entry of hop i+PF_ENT and the node
 * of hop i+PF_NODE (read from its entry, prefetched earlier) are already on their way.  A third
 * stage for multi-rank arrays (PF_SET) measured no better: it stalls on the node.  A guess that
 * misses (a probe collision, a node replaced meanwhile) costs only a wasted prefetch:
 * correctness comes from the exact lookup at hop i.
 *
 * Context: any registered thread inside kvr_rcu_read_lock(); no lock, no allocation, no wait.
 */
#include <string.h>

#include "core/index_internal.h"
#include "kvrouter.h"

#ifndef PF_ENT
#define PF_ENT 20
#endif
#ifndef PF_NODE
#define PF_NODE 8
#endif
#ifndef PF_SET
#define PF_SET 0 /* 0 = off */
#endif
#define RING 32 /* > PF_ENT + 1, power of two */

static inline const struct idx_node *peek_node(const struct kvr_index *idx, uint64_t seq)
{
	const struct idx_ent *e = idx_home_entry(idx, seq);
	if (!e)
		return NULL;
	const struct idx_node *n = __atomic_load_n(&e->node, __ATOMIC_ACQUIRE);
	return (uintptr_t)n > (uintptr_t)IDX_TOMB ? n : NULL;
}

/* Keeps in out[0..a) the entries whose slot is in rank word v (order kept); the others are
 * moved to out[cap-*f-d .. cap-*f) with score `score`.  Returns the new active count. */
static size_t intersect(struct kvr_index_match *out, size_t a, uintptr_t v, uint32_t score,
                        size_t cap, size_t *f)
{
	size_t keep = 0;
	if (v & 1) {
		uint32_t s = (uint32_t)(v >> 1);
		for (size_t k = 0; k < a; k++) {
			if (out[k].slot == s) {
				struct kvr_index_match t = out[keep];
				out[keep++] = out[k];
				out[k] = t;
			}
		}
	} else if (v) {
		const struct idx_rset *r = (const struct idx_rset *)v;
		uint32_t j = 0, n = r->n;
		for (size_t k = 0; k < a && j < n; k++) {
			uint32_t want = out[k].slot, have;
			/* Relaxed: an entry may be rewritten in place by rank_del's no-memory path.
			 */
			while (j < n &&
			       (have = __atomic_load_n(&r->slot[j], __ATOMIC_RELAXED)) < want)
				j++;
			if (j < n && have == want) {
				struct kvr_index_match t = out[keep];
				out[keep++] = out[k];
				out[k] = t;
			}
		}
	}
	size_t d = a - keep;
	if (d) {
		for (size_t k = keep; k < a; k++)
			out[k].score = score;
		memmove(&out[cap - *f - d], &out[keep], d * sizeof(*out));
		*f += d;
	}
	return keep;
}

int kvr_index_find_matches(const struct kvr_index *idx, const uint64_t *qseq, size_t n,
                           const struct kvr_index_match_opts *opts, struct kvr_index_match *out,
                           size_t cap, size_t *n_out)
{
	if (!idx || !n_out || (!qseq && n > 0) || (!out && cap > 0))
		return KVR_EINVAL;
	*n_out = 0;
	if (n == 0)
		return 0;
	const bool early = opts && opts->early_exit;
	uint64_t seq[RING];
	size_t ahead = n < PF_ENT + 1 ? n : PF_ENT + 1; /* seq[0..ahead) computed */
	for (size_t i = 0; i < ahead; i++)
		seq[i] = qseq[i];
	for (size_t i = 1; i < ahead; i++)
		__builtin_prefetch(idx_home_entry(idx, seq[i]));
	uint64_t last = seq[ahead - 1];

	const struct idx_node *x = idx_lookup(idx, &idx->root, seq[0]);
	if (!x)
		return 0;
	/* Ordering: acquire; pairs with the release publish in rank_add/rank_del. */
	uintptr_t v = __atomic_load_n(&x->ranks, __ATOMIC_ACQUIRE);
	size_t a = 0;
	if (v & 1) {
		if (cap < 1) {
			*n_out = 1;
			return KVR_ERANGE;
		}
		out[a++].slot = (uint32_t)(v >> 1);
	} else if (v) {
		const struct idx_rset *r = (const struct idx_rset *)v;
		for (uint32_t j = 0; j < r->n; j++) {
			uint32_t s = __atomic_load_n(&r->slot[j], __ATOMIC_RELAXED);
			if (a > 0 && out[a - 1].slot == s)
				continue;
			if (a == cap) {
				*n_out = r->n;
				return KVR_ERANGE;
			}
			out[a++].slot = s;
		}
	}
	/* Hop 0 waited for its entry and node; meanwhile the next entries arrived: start the
	 * node prefetches of the hops the loop's own node stage will not cover. */
	for (size_t j = 1; j <= PF_NODE && j < ahead; j++)
		__builtin_prefetch(peek_node(idx, seq[j]));
	size_t f = 0;
	uint32_t matched = a ? 1 : 0;
	for (size_t i = 1; i < n && a > 0; i++) {
		if (early && a == 1)
			break;
		/* Keep the pipeline full: keys ahead, then entries, nodes and rank sets. */
		if (ahead < n) {
			last = qseq[ahead];
			seq[ahead % RING] = last;
			__builtin_prefetch(idx_home_entry(idx, last));
			ahead++;
		}
		if (i + PF_NODE < ahead)
			__builtin_prefetch(peek_node(idx, seq[(i + PF_NODE) % RING]));
		if (PF_SET && i + PF_SET < ahead) {
			const struct idx_node *pn = peek_node(idx, seq[(i + PF_SET) % RING]);
			if (pn) {
				uintptr_t pv = __atomic_load_n(&pn->ranks, __ATOMIC_RELAXED);
				if (pv && !(pv & 1))
					__builtin_prefetch((const void *)pv);
			}
		}
		const struct idx_node *c = idx_lookup(idx, x, seq[i % RING]);
		if (!c)
			break;
		v = __atomic_load_n(&c->ranks, __ATOMIC_ACQUIRE);
		if (a == 1 && (v & 1) && (uint32_t)(v >> 1) == out[0].slot)
			; /* the common case: one rank, still there */
		else
			a = intersect(out, a, v, (uint32_t)i, cap, &f);
		if (a)
			matched = (uint32_t)(i + 1);
		x = c;
	}
	for (size_t k = 0; k < a; k++)
		out[k].score = matched;
	if (f)
		memmove(&out[a], &out[cap - f], f * sizeof(*out));
	*n_out = a + f;
	for (size_t k = 0; k < a + f; k++)
		out[k].tree_size =
		    __atomic_load_n(&idx->rank[out[k].slot].tree_size, __ATOMIC_RELAXED);
	return 0;
}
