/*
 * core/index_write.c - the run index's events: stored, removed, cleared.
 *
 * Every call takes the index's writer mutex (readers never do), so the table, the runs, the
 * holder sets and the per-rank records below change under one owner at a time.  What a reader
 * may be looking at is changed only by release stores of whole words (a run's len, a holder's
 * cut, a table entry) or by publishing a new copy (holder sets, sequence arrays, table arrays);
 * the old copy goes to the retire batch.  Design essay and invariants: core/index.c; the parts
 * this file composes: core/index_run.c (runs), core/index_hold.c (holders), core/index_xmap.c
 * (ext maps).
 *
 * A store walks the chain block by block keeping (run, position) of the previous block, so a
 * block that extends it is placed without a probe: already there (P_EXISTS / P_HELD), appended
 * at a run's end with no child there (P_APPEND), re-extending a trimmed run (P_REEXTEND), or a
 * new child run (P_FORK).  A stretch of blocks that go on along the run the previous one sits
 * in (appended at its end, or existing blocks another rank stored) is applied in one step
 * (extend_run: one memcpy, one len release, one cut scan, the locator's entries prefetched),
 * exactly as block by block, wherever that needs no allocation; the rest, and so every
 * allocation and failure, goes block by block.  Each block is applied atomically: first everything
 * that needs memory is obtained (table room, a grown sequence array, a new run, a holder record and
 * set, map room), then it is committed with no failure possible; on KVR_ENOMEM what the call
 * applied is removed again, newest first, so a failed write changes nothing.  Removals never need
 * memory: they clear bits, lower cuts and let kvr_index_run_check trim or free what nobody needs.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/index_internal.h"
#include "core/index_tops.h"
#include "kvrouter.h"

/* Where the parent block pseq sits (a position below hw): where the last store ended, when it
 * is there (a sequence hash sits at one position of the tree, so this is what locate finds),
 * else locate's answer. */
static bool parent_at(const struct kvr_index *idx, uint64_t pseq, struct idx_run **r, uint32_t *pos)
{
	struct idx_run *lr = idx->last_run; /* alive: cleared when it dies */
	if (lr && idx_seq_visible(idx, lr) && idx->last_pos < idx_run_hw(lr) &&
	    idx_run_hash(lr, idx->last_pos) == pseq) {
		*r = lr;
		*pos = idx->last_pos;
		return true;
	}
	return idx_locate(idx, pseq, NULL, 0, r, pos);
}

/* Words of the store scratch kept between calls (512 KiB): enough for a store of 32,768 blocks
 * (its sequence hashes and the rollback list; a 512k-token prompt at 16 tokens a block), so the
 * router's stores reuse it; a longer store's array is freed when it returns.  It was kept
 * whatever its size, and kvr_index_memory_bytes did not count it: one store of 100,000 blocks
 * left 2 MiB that no counter showed, for the index's life. */
#define SCRATCH_KEEP (1u << 16)

/* Sets the scratch array (cap words).  Ordering: relaxed store of the capacity, read by
 * kvr_index_memory_bytes (a count, no content behind it). */
static void scratch_set(struct kvr_index *idx, uint64_t *p, size_t cap)
{
	kvr_free(idx->scratch, idx->scratch_cap * sizeof(uint64_t));
	idx->scratch = p;
	__atomic_store_n(&idx->scratch_cap, cap, __ATOMIC_RELAXED);
}

static bool ensure_scratch(struct kvr_index *idx, size_t n)
{
	if (idx->scratch_cap >= n)
		return true;
	size_t cap = idx->scratch_cap ? idx->scratch_cap : IDX_SCRATCH_MIN;
	while (cap < n)
		cap *= 2;
	uint64_t *p = kvr_alloc(cap * sizeof(uint64_t));
	if (!p)
		return false;
	scratch_set(idx, p, cap);
	return true;
}

/* Whether the slot holds the block with sequence hash s under ext hash s (size: the blocks it
 * holds now, its exact size plus what this call added): held, and not under an alias. */
static bool holds_plain(struct kvr_index *idx, const struct idx_rank *rk, uint32_t slot, uint64_t s,
                        uint64_t size)
{
	struct idx_run *r;
	struct idx_hold *h;
	uint32_t pos;
	if (size == rk->xmap.count) /* every held block is aliased: nothing plain */
		return false;
	if (idx->no_locator) {
		if (!kvr_index_find_held(idx, slot, s, NULL, 0, &r, &pos, &h))
			return false;
	} else {
		if (!idx_locate(idx, s, NULL, 0, &r, &pos))
			return false;
		h = kvr_index_hold_of(r, slot);
		if (!(h && idx_hold_bit(h, pos)) &&
		    !kvr_index_blk_other_held(idx, s, slot, &r, &pos, &h))
			return false;
	}
	return !idx_alias_bit(rk, h, pos);
}

/* Where the slot holds the parent block pseq: *r, *pos, its record *h, or false.  path (np
 * sequence hashes from the root, stride apart, the last one pseq): found by a walk from the root
 * unless the last store ended there. */
static bool parent_held(struct kvr_index *idx, uint32_t slot, uint64_t pseq, const uint64_t *path,
                        size_t stride, size_t np, struct idx_run **r, uint32_t *pos,
                        struct idx_hold **h)
{
	if (idx->no_locator && !path)
		return kvr_index_find_held(idx, slot, pseq, idx->last_run, idx->last_pos, r, pos,
		                           h);
	struct idx_run *lr = idx->last_run;
	if (path && !(lr && idx_seq_visible(idx, lr) && idx->last_pos < idx_run_hw(lr) &&
	              idx_run_hash(lr, idx->last_pos) == pseq)) {
		if (!kvr_index_walk(idx, path, stride, np, r, pos))
			return false;
	} else if (!parent_at(idx, pseq, r, pos)) {
		return false;
	}
	*h = kvr_index_hold_of(*r, slot);
	if (*h && idx_hold_bit(*h, *pos))
		return true;
	/* A walk's answer is exact; a lookup's may be a crafted root's copy of the hash. */
	return !path && kvr_index_blk_other_held(idx, pseq, slot, r, pos, h);
}

/* Where block s below (R, p) sits in the tree (R NULL: the root): *C, *q, or false.  With the
 * locator, R's own next position first when R is not located (the locator does not hold it; a
 * located R's is the locator's first guess anyway): s names its prefix, so below (R, p) it can
 * only be there or a child's first block (the run table).  A copy of s inside another run that is
 * not located (a crafted root's hash, core/index_blocks.c) is not seen. */
static bool next_block(const struct kvr_index *idx, const struct idx_run *R, uint32_t p, uint64_t s,
                       struct idx_run **C, uint32_t *q)
{
	if (idx->no_locator)
		return kvr_index_next_at(idx, R, p, s, C, q);
	if (R && !idx_run_located(R) && p + 1 < idx_run_hw(R) && idx_run_hash(R, p + 1) == s) {
		*C = (struct idx_run *)(uintptr_t)R;
		*q = p + 1;
		return true;
	}
	return idx_locate(idx, s, R, p, C, q);
}

enum place { P_HELD, P_EXISTS, P_REEXTEND, P_APPEND, P_FORK };

/*
 * The fast path of a chain going on along R from its block at p, held there by the record h:
 * how many of blocks i.. (sequence hashes seq[]) it stored, each exactly as the block-by-block
 * path would, in one step.  Two cases, *appended telling which: R's blocks p+1.. already exist
 * and the rank does not hold them (P_EXISTS: another rank stored this prefix: bits set, one cut
 * scan), or p is R's last block with no child at or past it (P_APPEND: one memcpy of the
 * hashes, one release of the len, the locator entries inserted with their home chunks
 * prefetched ahead).  Only for blocks whose ext hash is the sequence hash and names nothing of
 * the rank, not in a rank whose blocks are all aliased (it needs its alias bits made), and only
 * while the block-by-block path would allocate nothing (the record's bitmap,
 * R's array and id large enough, the locator below its growth threshold; a migration in
 * progress is paid k reserves' share at once): every allocation, and so every growth and
 * KVR_ENOMEM, stays in that path, at the same block.  Returns 0 when block i does not qualify.
 * Context: kvr_index_store, wlock held.
 */
static size_t extend_run(struct kvr_index *idx, const struct idx_rank *rk,
                         const struct kvr_index_block *blocks, const uint64_t *seq, size_t i,
                         size_t n, struct idx_run *R, uint32_t p, struct idx_hold *h, uint64_t prev,
                         bool has_prev, bool *appended)
{
	if (!R || !h || n - i < 2)
		return 0; /* a last block: the block-by-block path costs no more */
	if (rk->xmap.count && !rk->amap.e)
		return 0; /* a plain block into an all-aliased rank: its alias bits first */
	if (!idx->no_locator && !idx_run_located(R))
		return 0; /* a plain block makes R located: its locator entries first */
	const uint32_t len = idx_run_len(R), hw = idx_run_hw(R), q = p + 1;
	const bool app = q == len;
	uint64_t room;
	if (app) {
		if (hw != len || idx_run_mco(R) > p || (!idx->no_locator && idx_run_id(R) == 0))
			return 0;
		room = idx_run_cap(R) - hw; /* cap <= IDX_RUN_MAX */
	} else {
		room = len - q;
	}
	const uint32_t bits = idx_hold_nwords(h) * 64; /* > p: h holds p */
	if (room > bits - q)
		room = bits - q;
	if (room > n - i)
		room = n - i;
	const uint64_t *rs = idx_run_seqs(R);
	size_t k = 0;
	for (; k < room; k++) {
		const uint64_t e = blocks[i + k].ext_hash;
		if (e != seq[i + k] || (has_prev && e == prev) || idx_xmap_get(&rk->xmap, e, NULL))
			break; /* an alias, a self-parent or an ext hash in use: block by block */
		if (!app && (rs[q + k] != e || idx_hold_bit(h, q + (uint32_t)k)))
			break; /* a fork, or a block the rank holds */
		prev = e;
		has_prev = true;
	}
	if (k == 0)
		return 0;
	if (idx->no_locator && !kvr_index_tops_room(idx, idx_hold_slot(h), 1))
		return 0; /* the end map must grow: block by block */
	if (app) {
		if (!idx->no_locator && (k = kvr_index_blk_reserve_upto(idx, k)) == 0)
			return 0;
		uint64_t *s = idx_run_seqs(R);
		memcpy(&s[hw], &seq[i], k * sizeof(uint64_t));
		idx_run_set_hw(R, hw + (uint32_t)k);
		/* Ordering: release; pairs with the acquire load of sl in find_matches. */
		idx_run_set_len(R, len + (uint32_t)k);
		if (!idx->no_locator)
			kvr_index_blk_insert_many(idx, &seq[i], k, R);
	}
	struct idx_tkey k0;
	idx_tops_before(idx, h, &k0);
	kvr_index_hold_set_range(h, q, (uint32_t)k);
	idx_tops_after(idx, h, &k0);
	*appended = app;
	return k;
}

/* kvr_index_store, or with path (np > 0 sequence hashes from the root, stride words apart)
 * kvr_index_store_path: the parent is path's last block, found by a walk from the root. */
static int store(struct kvr_index *idx, uint32_t slot, const uint64_t *parent_ext,
                 const uint64_t *path, size_t stride, size_t np,
                 const struct kvr_index_block *blocks, size_t n)
{
	if (!idx || (!blocks && n > 0))
		return KVR_EINVAL;
	struct idx_rank *rk;
	int rc = idx_write_begin(idx, slot, n, &rk);
	if (rc <= 0)
		return rc;
	rc = 0;
	uint64_t added = 0, copies = 0, nodes = 0;
	uint64_t *applied = NULL; /* ext hashes added or copied, for a rollback */
	size_t napplied = 0;
	struct idx_hold *pub = NULL; /* a record whose cut is not yet mirrored into its hset */
	struct idx_run *R = NULL;    /* where the previous block sits; NULL = the root */
	uint32_t p = 0;
	struct idx_hold *h = NULL; /* slot's record of R (cached) */
	uint64_t pseq = 0, prev = 0;
	const uint64_t key = kvr_place_key(); /* the prefetches' homes, below */
	bool has_prev = parent_ext != NULL;
	if (has_prev) {
		prev = *parent_ext;
		if (path && rk->xmap.count)
			path = NULL; /* aliases: the parent's ext hash may name another block */
		bool ok;
		if (idx_ext_place(rk, prev, &R, &p)) { /* an alias: its place */
			h = kvr_index_hold_of(R, slot);
			pseq = idx_run_hash(R, p);
			ok = h && idx_hold_bit(h, p); /* ALWAYS: the map holds held blocks */
		} else {
			/* Named by its sequence hash, a block the rank holds under an alias is
			 * unknown. */
			pseq = prev;
			ok = parent_held(idx, slot, pseq, path, stride, np, &R, &p, &h) &&
			     !idx_alias_bit(rk, h, p);
		}
		if (!ok) {
			idx_count(&idx->c_parent_nf, 1);
			rc = KVR_ENOENT;
			goto out;
		}
	}
	if (!ensure_scratch(idx, 2 * n)) {
		rc = KVR_ENOMEM;
		goto out;
	}
	uint64_t *seq = idx->scratch;
	applied = idx->scratch + n;
	/* The router's chain (core/hash.c), computed in place: kvr_hash_chain_locals reads
	 * local[i] before it writes seq_out[i]. */
	for (size_t i = 0; i < n; i++)
		seq[i] = blocks[i].local_hash;
	kvr_hash_chain_locals(has_prev ? &pseq : NULL, seq, n, seq);
	for (size_t i = 0; i < n; i++) {
		bool app = false;
		const size_t k =
		    extend_run(idx, rk, blocks, seq, i, n, R, p, h, prev, has_prev, &app);
		if (k) { /* blocks i .. i+k-1 stored at R's positions p+1 .. p+k */
			if (pub != h) {
				if (pub)
					kvr_index_publish_cut(pub);
				pub = h;
			}
			memcpy(&applied[napplied], &seq[i], k * sizeof(uint64_t)); /* ext == seq */
			napplied += k;
			added += k;
			nodes += app ? k : 0;
			p += (uint32_t)k;
			prev = seq[i + k - 1];
			has_prev = true;
			i += k - 1;
			continue;
		}
		const uint64_t e = blocks[i].ext_hash, s = seq[i];
		if (i + 8 < n && idx->blk.e)
			__builtin_prefetch(
			    &idx->blk.e[idx_blk_home_k(seq[i + 8], idx->blk.cap, key)]);
		if (has_prev && e == prev) {
			rc = KVR_EINVAL; /* self-parent */
			break;
		}
		const bool alias = e != s;
		struct idx_run *vr;
		uint32_t vp;
		bool via_e = idx_ext_place(rk, e, &vr, &vp);
		if (via_e && (!alias || idx_run_hash(vr, vp) != s)) {
			rc = KVR_EINVAL; /* e names another block of the rank */
			break;
		}
		if (alias && !via_e && holds_plain(idx, rk, slot, e, rk->size + added)) {
			rc =
			    KVR_EINVAL; /* e is the sequence hash (and ext) of another held block */
			break;
		}
		/* Where does s go? */
		struct idx_run *C = NULL;
		uint32_t q = 0;
		enum place pl;
		const uint32_t Rlen = R ? idx_run_len(R) : 0, Rhw = R ? idx_run_hw(R) : 0;
		if (R && p + 1 < Rlen && idx_run_seqs(R)[p + 1] == s) {
			C = R;
			q = p + 1;
			pl = P_EXISTS;
		} else if (R && p + 1 == Rlen && Rhw == Rlen && idx_run_mco(R) <= p &&
		           Rhw < IDX_RUN_MAX) {
			/* Extending a run at its end with no child there: s, which names its
			 * prefix, cannot be in the tree (no probe). */
			pl = P_APPEND;
		} else if (next_block(idx, R, p, s, &C, &q)) {
			bool ok;
			if (q >=
			    idx_run_len(C)) { /* trimmed off R's end, its entry kept: re-extend */
				ok = C == R && q == p + 1;
				pl = P_REEXTEND;
			} else {
				ok = q > 0 ? (C == R && q == p + 1)
				           : C->po == idx_po(R, R ? p + 1 : 0);
				pl = P_EXISTS;
			}
			struct idx_run *o;
			if (!ok && !R && (o = kvr_index_tab_first(idx, s)) && !idx_run_parent(o)) {
				/* A root block whose hash the locator met first inside a chain (its
				 * first look: the runs' ends): a crafted root's hash equal to an
				 * interior block's, the root stored first, the chain appended onto
				 * it without a probe.  The root run is there: the block's place. */
				C = o;
				q = 0;
				pl = P_EXISTS;
				ok = true;
			}
			if (!ok) {
				rc = KVR_EINVAL; /* a 64-bit sequence hash collision */
				break;
			}
		} else if (R && p + 1 == Rlen && Rhw == Rlen && Rhw < IDX_RUN_MAX) {
			pl = P_APPEND;
		} else {
			pl = P_FORK;
		}
		struct idx_hold *ch = NULL; /* slot's record of the block's run */
		if (pl == P_EXISTS) {
			ch = C == R ? h : kvr_index_hold_of(C, slot);
			if (ch && idx_hold_bit(ch, q))
				pl = P_HELD;
		}
		if (pl == P_HELD) {
			if (!via_e && (alias || idx_alias_bit(rk, ch, q))) {
				rc = KVR_EINVAL; /* held under another ext hash */
				break;
			}
			if (idx->count_copies) {
				if (kvr_index_copy_reserve(idx, ch, q) != 0) {
					rc = KVR_ENOMEM;
					break;
				}
				kvr_index_copy_inc(idx, ch, q);
				copies++;
				applied[napplied++] = e;
			}
			goto step;
		}
		if (via_e) { /* NEVER: e maps to s, so the rank holds s */
			rc = KVR_EINVAL;
			break;
		}
		/* The run a plain block makes located (with the locator): its positions go into
		 * the locator with this block.  One whose positions clash with a located run's (a
		 * crafted root's hash that an unlocated run has inside, and a chain copied below
		 * that root: core/index_blocks.c) is refused as a collision. */
		struct idx_run *lc = NULL;
		if (!idx->no_locator && !alias && pl != P_FORK) {
			struct idx_run *t = pl == P_EXISTS ? C : R;
			if (!idx_run_located(t)) {
				if (kvr_index_blk_clash(idx, t)) {
					rc = KVR_EINVAL;
					break;
				}
				lc = t;
			}
		}
		const uint32_t nloc =
		    lc ? idx_run_hw(lc) - 1 : 0; /* its positions past the first */
		/* Obtain everything that needs memory; nothing visible changes before commit. */
		if ((alias && kvr_index_xmap_reserve(idx, &rk->xmap)) ||
		    kvr_index_alias_reserve(idx, rk, alias, rk->size + added)) {
			rc = KVR_ENOMEM;
			break;
		}
		if (pl == P_FORK && kvr_index_tab_reserve(idx, s) != 0) {
			rc = KVR_ENOMEM;
			break;
		}
		/* Without the locator, room for the record's end-map entry (its top moves). */
		if (idx->no_locator && kvr_index_tops_reserve(idx, slot, 1) != 0) {
			if (pl == P_FORK)
				kvr_index_tab_unreserve(idx, s);
			rc = KVR_ENOMEM;
			break;
		}
		/* A located run's positions past the first are in the block locator; it gets its
		 * id there when it has two positions (after an append, or now: lc). */
		struct idx_run *idr = NULL; /* the run given an id here */
		const bool loc_app =
		    pl == P_APPEND && !idx->no_locator && (lc || idx_run_located(R));
		if (pl == P_APPEND && !loc_app) {
			if (kvr_index_run_grow(idx, R, n - i) != 0) {
				rc = KVR_ENOMEM;
				break;
			}
		} else if (loc_app || nloc) {
			struct idx_run *t = lc ? lc : R;
			int e2 = kvr_index_blk_reserve(idx, nloc + (loc_app ? 1 : 0));
			if (!e2 && loc_app)
				e2 = kvr_index_run_grow(idx, R, n - i);
			if (!e2 && idx_run_id(t) == 0 && (e2 = kvr_index_blk_id_new(idx, t)) == 0)
				idr = t;
			if (e2) {
				kvr_index_blk_unreserve(idx);
				rc = e2; /* KVR_ENOMEM, or KVR_ERANGE: no run id left */
				break;
			}
		}
		struct idx_run *nr = NULL;
		if (pl == P_FORK) {
			size_t cap = n - i < IDX_RUN_MAX ? n - i : IDX_RUN_MAX;
			nr = kvr_index_run_new(idx, R, R ? p + 1 : 0, (uint32_t)cap, s);
			if (!nr) {
				kvr_index_tab_unreserve(idx, s);
				rc = KVR_ENOMEM;
				break;
			}
			C = nr;
			q = 0;
		} else if (pl != P_EXISTS) {
			C = R;
			q = p + 1;
			ch = h;
		}
		bool new_hold = false;
		if (ch) {
			if (kvr_index_hold_reserve(idx, ch, q) != 0) {
				rc = KVR_ENOMEM;
			}
		} else {
			ch = kvr_index_hold_new(idx, C, slot, q);
			if (!ch || kvr_index_hs_add(idx, C, ch) != 0) {
				if (ch)
					kvr_index_hold_free(idx, ch);
				rc = KVR_ENOMEM;
			}
			new_hold = true;
		}
		if (rc) {
			if (pl == P_FORK)
				kvr_index_tab_unreserve(idx, s);
			if (idr)
				kvr_index_blk_id_free(idx, idr);
			if (!idx->no_locator)
				kvr_index_blk_unreserve(idx);
			if (nr) {
				/* hs_add may have published a set on the unpublished run */
				struct idx_hset *nhs = idx_run_set(nr);
				if (nhs) {
					idx_count(&idx->bytes_rank,
					          -idx_real(idx_bytes_hset(nhs->cap)));
					kvr_free(nhs, idx_bytes_hset(nhs->cap));
				}
				kvr_index_run_free(idx, nr);
			}
			break;
		}
		/* Commit: no failure from here. */
		if (lc) { /* into the locator: its entries reserved, its id given */
			if (nloc)
				kvr_index_blk_insert_many(idx, idx_run_seqs(lc) + 1, nloc, lc);
			idx_run_set_located(lc);
		}
		switch (pl) {
		case P_FORK:
			nr->sl |= 1ull << IDX_HI_SHIFT; /* len 1: not published yet */
			if (!idx->no_locator && !alias)
				idx_run_set_located(nr);
			kvr_index_link_child(R, nr);
			kvr_index_tab_insert(idx, nr);
			break;
		case P_APPEND:
			idx_run_seqs(R)[Rhw] = s;
			idx_run_set_hw(R, Rhw + 1);
			/* Ordering: release; pairs with the acquire load of sl in find_matches. */
			idx_run_set_len(R, Rlen + 1);
			if (loc_app)
				kvr_index_blk_insert(idx, s, R);
			break;
		case P_REEXTEND: /* the locator entry was kept by the trim */
			idx_run_set_len(R, Rlen + 1);
			break;
		default:
			break;
		}
		if (pl != P_EXISTS)
			nodes++;
		if (new_hold)
			kvr_index_rank_link_hold(idx, ch);
		struct idx_tkey k0;
		idx_tops_before(idx, ch, &k0);
		kvr_index_hold_set(ch, q);
		idx_tops_after(idx, ch, &k0);
		if (pub != ch) { /* cuts are published once per run and call */
			if (pub)
				kvr_index_publish_cut(pub);
			pub = ch;
		}
		if (alias) {
			idx_ext_put(rk, e, C, q);
			kvr_index_alias_set(rk, ch, q);
		}
		added++;
		applied[napplied++] = e;
	step: /* the block is at C's position q (held already, or added): the next one's parent */
		R = C;
		p = q;
		h = ch;
		prev = e;
		has_prev = true;
	}
out:
	if (pub)
		kvr_index_publish_cut(pub);
	if (rc == 0 && R) { /* the next store's likely parent */
		idx->last_run = R;
		idx->last_pos = p;
	}
	/* The tree size once per call, not per block, and published in steps (idx_size_set):
	 * readers (find_matches' tie-break) load it for every rank holding the query's first
	 * block, and each store makes their next query miss on its line. */
	if (added)
		idx_size_set(idx, rk, slot, rk->size + added);
	if (nodes) /* once per call: an atomic add per block cost more than the block */
		idx_count(&idx->c_nodes, (int64_t)nodes);
	if (rc == KVR_ENOMEM || rc == KVR_ERANGE) {
		/* A failed write changes nothing: take back what this call applied, newest
		 * first (a removal never needs memory), and the map room it reserved. */
		size_t removed = 0, dropped = 0;
		for (size_t i = napplied; i-- > 0;)
			kvr_index_remove_locked(idx, rk, slot, &applied[i], 1, NULL, 0, &removed,
			                        &dropped);
		kvr_index_xmap_shrink(idx, &rk->xmap);
		kvr_index_alias_settle(idx, rk);
		kvr_index_xmap_shrink(idx, &rk->cmap);
		if (idx->no_locator)
			kvr_index_tops_shrink(idx, slot);
		added = copies = 0;
	}
	if (rc == KVR_EINVAL)
		idx_count(&idx->c_invalid, 1);
	if (added + copies) {
		idx_count(&idx->c_stored, (int64_t)(added + copies));
		idx_count(&idx->c_copies, (int64_t)(added + copies));
	}
	if (idx->scratch_cap > SCRATCH_KEEP) /* done with it, rollback included */
		scratch_set(idx, NULL, 0);
	idx_flush_if_due(idx);
	pthread_mutex_unlock(&idx->wlock);
	return rc;
}

int kvr_index_store(struct kvr_index *idx, uint32_t slot, const uint64_t *parent_ext,
                    const struct kvr_index_block *blocks, size_t n)
{
	return store(idx, slot, parent_ext, NULL, 0, 0, blocks, n);
}

int kvr_index_store_path(struct kvr_index *idx, uint32_t slot, const uint64_t *path, size_t stride,
                         size_t np, const struct kvr_index_block *blocks, size_t n)
{
	if (np > 0 && (!path || stride == 0))
		return KVR_EINVAL;
	return store(idx, slot, np ? &path[(np - 1) * stride] : NULL, np ? path : NULL, stride, np,
	             blocks, n);
}

int kvr_index_set_locator(struct kvr_index *idx, bool on)
{
	if (!idx)
		return KVR_EINVAL;
	pthread_mutex_lock(&idx->wlock);
	int rc = 0;
	if (idx->no_locator == !on)
		rc = 0;
	else if (__atomic_load_n(&idx->c_nodes, __ATOMIC_RELAXED) != 0)
		rc = KVR_EBUSY; /* the index holds blocks the other way of finding them lacks */
	else
		idx->no_locator = !on;
	pthread_mutex_unlock(&idx->wlock);
	return rc;
}
