/*
 * shards/lru_heal.c - healing the predicted cache from engine ground truth (issue 15).
 *
 * Ground truth from the engine corrects the prediction, using the one thing that makes a single
 * fact informative: eviction is ORDERED.  If the engine no longer held a block that we had on
 * the inactive list at key K (order, depth), it evicted everything ordered before K too (vLLM
 * pops its free queue from the head), so all of that goes from the prediction at once.
 * The inactive list is sorted by key, so each rule is a walk from the head.  None of these
 * allocates beyond the output buffer.
 *
 * The one rule that does not evict: an engine that holds MORE blocks than the registered
 * capacity proves the capacity too small (an under-registered rank evicts in the prediction
 * what the engine still holds, so it under-predicts hits and routes them away).  The resident
 * count is a lower bound on the true capacity, so the capacity estimate (lru_cap.c) is raised
 * to it; a later registration (kvr_rank_set_capacity) replaces it.  Cached-tokens answers also
 * bound the capacity, through lru_cap.c's ghosts: see there.
 *
 * A resident count is compared with what the engine can hold NOW: a request this router has
 * routed but the engine has not finished prefilling (queued behind others, or part way
 * through a chunked prefill) has its new blocks in the prediction (the acquire put them there
 * at routing) but not yet in the engine.  The caller passes those blocks (unallocated) and the
 * rule evicts only down to resident + unallocated.  Measured in kvr-replay: without it the
 * rule evicted cached copies at the right capacity (99.8 % exact, MAE 0.37 blocks; exact with
 * --serial, where nothing waits).
 */
#include <string.h>

#include "kvrouter.h"
#include "shards/lru_internal.h"

/* Evicts, from the head, every inactive copy whose key is at most (ord, depth) in eviction
 * order: an older order, or the same order (split siblings of one released segment) at that
 * depth or deeper.  Returns the copies (and phantom blocks) evicted. */
static uint64_t evict_through(struct kvr_lru *lru, uint64_t ord, uint32_t depth,
                              struct kvr_lru_out *out)
{
	uint64_t n = 0;
	for (;;) {
		struct phantom *p = kvr_lru_phantom_next(lru);
		if (p) {
			if (p->order > ord)
				break;
			n += p->len;
			kvr_lru_phantom_evict(lru, p->len);
			continue;
		}
		uint32_t i = lru->inact_head;
		if (i == NIL)
			break;
		struct seg *g = &lru->s[i];
		if (g->order > ord)
			break;
		if (g->order == ord && g->depth < depth) {
			/* Only its blocks at depth and deeper (its tail) are ordered first. */
			uint64_t end = (uint64_t)g->depth + g->len;
			if (end > depth) {
				uint32_t m = (uint32_t)(end - depth);
				n += m;
				kvr_lru_trim(lru, i, m, out);
			}
			break;
		}
		n += g->len;
		kvr_lru_trim(lru, i, g->len, out);
	}
	return n;
}

/* The hash of the lease's block at depth d (< nblocks). */
static uint64_t lease_hash_at(const struct kvr_lru *lru, const struct lease *l, uint32_t d)
{
	uint32_t at = 0;
	for (uint32_t k = 0;; k++) {
		if (d < at + l->p[k].len) {
			uint32_t i = l->p[k].seg, off = d - at;
			while (off >= lru->s[i].len) {
				off -= lru->s[i].len;
				i = lru->s[i].snext;
			}
			return seq_of(lru, &lru->s[i])[off];
		}
		at += l->p[k].len;
	}
}

/* What the ghosts say about an answer (lru_cap.c): the oldest ghost among the blocks the engine
 * proved cached, and the ghost of the first block it missed. */
struct ghost_scan {
	uint32_t true_depth;
	uint32_t proven, missed; /* ghost slots, or NIL */
};

/* Calls visit for the hash of each of the lease's blocks at depths [from, to). */
static void lease_scan(struct kvr_lru *lru, const struct lease *l, uint32_t from, uint32_t to,
                       void (*visit)(struct kvr_lru *, uint64_t, uint32_t, void *), void *ctx)
{
	uint32_t at = 0;
	for (uint32_t k = 0; k < l->n && at < to; k++) {
		uint32_t i = l->p[k].seg, left = l->p[k].len;
		while (left && at < to) {
			const struct seg *g = &lru->s[i];
			uint32_t take = left < g->len ? left : g->len;
			for (uint32_t j = at < from ? (from - at < take ? from - at : take) : 0;
			     j < take && at + j < to; j++)
				visit(lru, seq_of(lru, g)[j], at + j, ctx);
			at += take;
			left -= take;
			i = g->snext;
		}
	}
}

static void see_ghost(struct kvr_lru *lru, uint64_t h, uint32_t d, void *ctx)
{
	struct ghost_scan *gs = ctx;
	uint32_t s = kvr_lru_ghost_slot(lru, h);
	if (s == NIL)
		return;
	if (d == gs->true_depth)
		gs->missed = s;
	else if (d < gs->true_depth &&
	         (gs->proven == NIL || kvr_lru_ghost_older(lru, s, gs->proven)))
		gs->proven = s;
}

static void kill_ghost(struct kvr_lru *lru, uint64_t h, uint32_t d, void *ctx)
{
	(void)d;
	(void)ctx;
	kvr_lru_ghost_kill(lru, h);
}

/* Not at the acquire: an answer reads the ghosts of the blocks its request brought back (their
 * recency is what it proves).  But an answer may never come (the engine answers some requests,
 * or none after one), and until the block is evicted again its ghost stayed live while the
 * prediction held it: counted twice in the recency of every block evicted before it, which
 * raised the lower bounds that later answers proved.  So the release kills them too; the blocks
 * an answer already did are not looked up again. */
void kvr_lru_heal_unghost(struct kvr_lru *lru, struct lease *l)
{
	uint32_t from = l->unghosted > l->hit ? l->unghosted : l->hit;
	if (lru->gh.cap && from < l->nblocks)
		lease_scan(lru, l, from, l->nblocks, kill_ghost, NULL);
	l->unghosted = l->nblocks;
}

static uint64_t sub_sat(uint64_t a, uint64_t b)
{
	return a > b ? a - b : 0;
}

int kvr_lru_heal_cached(struct kvr_lru *lru, uint64_t attempt, uint32_t true_depth,
                        uint64_t unallocated, struct kvr_lru_heal *res, struct kvr_lru_out *out)
{
	if (!lru || !out || !res)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	memset(res, 0, sizeof(*res));
	struct lease *l = kvr_lru_find_lease(lru, attempt);
	if (!l)
		return KVR_ENOENT;
	if (true_depth > l->nblocks)
		return KVR_EINVAL;
	/* The output's room first: it is no state, whereas ghosts turned on by a call that then
	 * failed would record every later eviction, and the next answer would prove a bound that
	 * answer alone cannot (KVR_ENOMEM changes nothing). */
	int rc;
	if ((rc = kvr_lru_out_reserve(out, 0, lru->n_inactive)) || (rc = kvr_lru_ghosts_fit(lru)))
		return rc;
	/* From here on nothing fails. */
	res->predicted = l->hit;
	res->actual = true_depth;
	uint64_t before = lru->copies + lru->n_phantom;
	/* The engine's blocks the prediction also holds: not the ones it has not allocated, nor
	 * this attempt's new ones (the answer is about the moment before they were allocated). */
	uint64_t own = (uint64_t)(l->nblocks - l->hit) + l->priv;
	uint64_t resident = lru->copies + lru->n_phantom + lru->priv;
	uint64_t base = sub_sat(resident, unallocated + own);
	struct ghost_scan gs = {true_depth, NIL, NIL};
	/* The block at true_depth is the one the engine missed only if it is a prompt block: a
	 * whole prompt cached says nothing of the output after it, whose first block (a ghost
	 * once evicted) was taken for a miss and gave a wrong upper bound on the capacity. */
	if (true_depth >= l->hit)
		lease_scan(lru, l, l->hit, true_depth < l->nprompt ? true_depth + 1 : true_depth,
		           see_ghost, &gs);
	uint64_t lo = 0, hi = 0;
	if (gs.proven != NIL)
		lo = base + kvr_lru_ghosts_newer(lru, gs.proven, true);
	if (gs.missed != NIL)
		hi = resident + kvr_lru_ghosts_newer(lru, gs.missed, false);
	if (true_depth < l->hit) {
		/* The copy the acquire hit at depth true_depth: the engine had evicted it. */
		uint64_t ord = 0;
		for (uint32_t k = 0, at = 0; k < l->n; at += l->p[k].len, k++)
			if (true_depth < at + l->p[k].len) {
				ord = l->p[k].ord;
				break;
			}
		if (ord == 0) {
			res->unprovable = true; /* it was held by another request then */
		} else {
			uint32_t depth = true_depth;
			/* The engine had no copy of that hash at all: if we still keep others, the
			 * newest of them bounds what went (rare: only hashes with several copies).
			 */
			uint64_t h = lease_hash_at(lru, l, true_depth);
			if (kvr_u64map_find(&lru->dups, h)) {
				for (uint32_t i = lru->inact_head; i != NIL; i = lru->s[i].next) {
					const struct seg *g = &lru->s[i];
					const uint64_t *q = seq_of(lru, g);
					for (uint32_t j = 0; j < g->len; j++)
						if (q[j] == h &&
						    (g->order > ord ||
						     (g->order == ord && g->depth + j < depth))) {
							ord = g->order;
							depth = g->depth + j;
						}
				}
			}
			evict_through(lru, ord, depth, out);
			/* What is left is ordered after the missed block (or held by live
			 * requests), and the engine has all of it but the attempt's own copies
			 * from the missed one on: the engine held no more than that. */
			hi = sub_sat(lru->copies + lru->n_phantom + lru->priv, l->hit - true_depth);
		}
	}
	/* The attempt holds its new blocks now: they are no ghosts any more. */
	kvr_lru_heal_unghost(lru, l);
	kvr_lru_cap_bound(lru, lo, hi, out);
	res->lower = lo;
	res->upper = hi;
	res->capacity = lru->capacity;
	res->evicted = before - (lru->copies + lru->n_phantom);
	kvr_lru_settle(lru);
	return 0;
}

uint64_t kvr_lru_lease_unallocated(const struct kvr_lru *lru, uint64_t attempt)
{
	const struct lease *l = lru ? kvr_lru_find_lease(lru, attempt) : NULL;
	/* Before any output the lease holds its prompt blocks only (materialize comes after). */
	return l ? (uint64_t)(l->nblocks - l->hit) + l->priv : 0;
}

int kvr_lru_heal_resident(struct kvr_lru *lru, uint64_t resident, uint64_t unallocated,
                          uint64_t *evicted, bool *raised, struct kvr_lru_out *out)
{
	if (!lru || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	if (raised)
		*raised = false;
	if (resident > lru->capacity) {
		/* The engine holds more than the registered capacity: it can, so the capacity was
		 * under-registered.  Adopt the observed count; growing evicts nothing, and the
		 * prediction (at most the old capacity with an inactive copy left) needs no trim.
		 */
		lru->capacity = resident; /* an estimate (lru_cap.c); the registration stays */
		lru->explore = false;     /* the count is direct evidence: no need to explore */
		if (raised)
			*raised = true;
		if (evicted)
			*evicted = 0;
		return 0;
	}
	int rc = kvr_lru_out_reserve(out, 0, lru->n_inactive);
	if (rc)
		return rc;
	/* A count within the estimate: the engine shows no more room than it, so stop exploring
	 * above it (lru_cap.c; a later cached-tokens answer may prove more again). */
	lru->explore = false;
	uint64_t before = lru->copies + lru->n_phantom;
	/* Saturating: a count near 2^64 (above any real one, within an estimate it raised)
	 * wrapped to a few blocks and evicted everything cached (test_heal
	 * absurd_resident_counts_cost_no_memory_and_evict_nothing). */
	uint64_t keep = resident + unallocated < resident ? UINT64_MAX : resident + unallocated;
	kvr_lru_evict_to(lru, keep, out);
	if (evicted)
		*evicted = before - (lru->copies + lru->n_phantom);
	kvr_lru_settle(lru);
	return 0;
}

int kvr_lru_heal_watermark(struct kvr_lru *lru, uint64_t seq, uint64_t *evicted,
                           struct kvr_lru_out *out)
{
	if (!lru || !out)
		return KVR_EINVAL;
	kvr_lru_out_reset(out);
	/* Find the inactive copy of seq nearest the head (the engine's oldest block is near the
	 * head of our list when the prediction is close; the scan stops there). */
	uint32_t found = NIL, off = 0;
	for (uint32_t i = lru->inact_head; i != NIL && found == NIL; i = lru->s[i].next) {
		const struct seg *g = &lru->s[i];
		const uint64_t *q = seq_of(lru, g);
		for (uint32_t j = g->len; j-- > 0;) /* deepest first: the eviction order */
			if (q[j] == seq) {
				found = i;
				off = j;
				break;
			}
	}
	if (found == NIL)
		return KVR_ENOENT;
	int rc = kvr_lru_out_reserve(out, 0, lru->n_inactive);
	if (rc)
		return rc;
	uint64_t before = lru->copies + lru->n_phantom;
	/* Everything ordered before it goes: the segments ahead of it in the list, and the
	 * phantoms of older releases (orders are unique to a phantom). */
	while (lru->inact_head != found)
		kvr_lru_trim(lru, lru->inact_head, lru->s[lru->inact_head].len, out);
	for (struct phantom *p; (p = kvr_lru_phantom_next(lru)) && p->order < lru->s[found].order;)
		kvr_lru_phantom_evict(lru, p->len);
	/* The blocks of its segment deeper than the watermark went before it. */
	if (lru->s[found].len - 1 - off > 0)
		kvr_lru_trim(lru, found, lru->s[found].len - 1 - off, out);
	if (evicted)
		*evicted = before - (lru->copies + lru->n_phantom);
	kvr_lru_settle(lru);
	return 0;
}
