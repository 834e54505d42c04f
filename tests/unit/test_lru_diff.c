/* Two differential tests.
 * 1. segments_against_ref: shards/lru (segments) against tests/ref/lru_ref.c (the per-block
 *    LRU it replaced, the oracle), in BOTH keep_private modes (the router runs either:
 * kvr_config.free_order), on chained hashes as the router produces them: prompts from a few
 * documents with divergence, duplicate attempts, output blocks from a 2-token alphabet so that
 * several leases make several copies of one hash.  Every command's return code, stored blocks,
 * evicted hashes in exact per-block eviction order, stats and overlap must agree, and every evicted
 * run must be a chain (parent first).  Rerun one seed with LRU_SEG_SEED=<seed> LRU_SEG_KEEP=0|1.
 * 2. ref_against_model: the oracle itself against an obviously-correct reference model: plain
 * arrays, linear scans, eviction by searching the minimum of (epoch asc, position desc, copy id
 * asc). Random sequences of acquire / materialize / release / set_capacity / reset; every command's
 * outputs (stored and evicted, in order), return code, stats and overlap must agree.
 * The seed and step are printed on failure; rerun one seed with LRU_DIFF_SEED=<seed>. */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "../ref/lru_ref.h"
#include "shards/lru.h"
#include "lru_out_util.h"
#include "tests/common/splitmix.h"

#define MAXC   4096
#define MAXL   64
#define MAXLEN 40

struct mcopy {
	uint64_t seq, id, epoch;
	uint32_t refs, pos;
	bool alive;
};
struct mlease {
	uint64_t attempt;
	int c[MAXLEN * 4];
	int n;
	uint32_t priv;
	bool live;
};
struct model {
	uint64_t cap, priv, epoch, next_id, evictions;
	struct mcopy c[MAXC];
	int nc;
	struct mlease l[MAXL];
	int nl;
	uint64_t stored[MAXC], evicted[MAXC];
	int ns, ne;
};

static void m_reset(struct model *m, uint64_t cap)
{
	memset(m, 0, sizeof(*m));
	m->cap = cap;
	m->next_id = 1;
}

static int m_first_copy(struct model *m, uint64_t seq)
{
	int best = -1;
	for (int i = 0; i < m->nc; i++)
		if (m->c[i].alive && m->c[i].seq == seq && (best < 0 || m->c[i].id < m->c[best].id))
			best = i;
	return best;
}

static uint64_t m_copies(struct model *m)
{
	uint64_t n = 0;
	for (int i = 0; i < m->nc; i++)
		n += m->c[i].alive;
	return n;
}

static struct mlease *m_lease(struct model *m, uint64_t attempt)
{
	for (int i = 0; i < m->nl; i++)
		if (m->l[i].live && m->l[i].attempt == attempt)
			return &m->l[i];
	return NULL;
}

static int m_new_copy(struct model *m, uint64_t seq, uint32_t pos)
{
	if (m_first_copy(m, seq) < 0)
		m->stored[m->ns++] = seq;
	int i = m->nc++;
	m->c[i] = (struct mcopy){.seq = seq, .id = m->next_id++, .refs = 1, .pos = pos, .alive = 1};
	return i;
}

static void m_reconcile(struct model *m)
{
	while (m_copies(m) + m->priv > m->cap) {
		int v = -1;
		for (int i = 0; i < m->nc; i++) {
			struct mcopy *c = &m->c[i];
			if (!c->alive || c->refs)
				continue;
			if (v < 0)
				v = i;
			else {
				struct mcopy *b = &m->c[v];
				if (c->epoch < b->epoch ||
				    (c->epoch == b->epoch &&
				     (c->pos > b->pos || (c->pos == b->pos && c->id < b->id))))
					v = i;
			}
		}
		if (v < 0)
			break;
		m->c[v].alive = false;
		m->evictions++;
		if (m_first_copy(m, m->c[v].seq) < 0)
			m->evicted[m->ne++] = m->c[v].seq;
	}
}

static int m_acquire(struct model *m, uint64_t attempt, const uint64_t *seq, int n, uint32_t pb)
{
	m->ns = m->ne = 0;
	if (m_lease(m, attempt))
		return KVR_EEXIST;
	struct mlease *l = &m->l[m->nl++];
	memset(l, 0, sizeof(*l));
	l->attempt = attempt;
	l->live = true;
	l->priv = pb;
	bool miss = false;
	for (int i = 0; i < n; i++) {
		int c = miss ? -1 : m_first_copy(m, seq[i]);
		if (c < 0) {
			miss = true;
			c = m_new_copy(m, seq[i], (uint32_t)i);
		} else {
			m->c[c].refs++;
			m->c[c].pos = (uint32_t)i;
		}
		l->c[l->n++] = c;
	}
	m->priv += pb;
	m_reconcile(m);
	return 0;
}

static int m_materialize(struct model *m, uint64_t attempt, uint64_t parent, const uint64_t *seq,
                         int n, uint32_t start, uint32_t pb)
{
	m->ns = m->ne = 0;
	struct mlease *l = m_lease(m, attempt);
	if (!l || (l->n > 0 && m->c[l->c[l->n - 1]].seq != parent))
		return KVR_ENOENT;
	for (int i = 0; i < n; i++)
		l->c[l->n++] = m_new_copy(m, seq[i], start + (uint32_t)i);
	m->priv = m->priv - l->priv + pb;
	l->priv = pb;
	m_reconcile(m);
	return 0;
}

static int m_release(struct model *m, uint64_t attempt)
{
	m->ns = m->ne = 0;
	struct mlease *l = m_lease(m, attempt);
	if (!l)
		return KVR_ENOENT;
	m->epoch++;
	m->priv -= l->priv;
	for (int i = 0; i < l->n; i++)
		if (--m->c[l->c[i]].refs == 0)
			m->c[l->c[i]].epoch = m->epoch;
	l->live = false;
	m_reconcile(m);
	return 0;
}

static void check_out(uint64_t seed, int step, struct model *m, struct kvr_lru_out *o,
                      const struct kvr_lru_block *b)
{
	cr_assert_eq(o->n_stored, (size_t)m->ns, "seed %llu step %d: n_stored %zu vs %d",
	             (unsigned long long)seed, step, o->n_stored, m->ns);
	for (int i = 0; i < m->ns; i++)
		cr_assert_eq(out_stored(o, b, i)->seq, m->stored[i], "seed %llu step %d stored[%d]",
		             (unsigned long long)seed, step, i);
	cr_assert_eq(o->n_evicted, (size_t)m->ne, "seed %llu step %d: n_evicted %zu vs %d",
	             (unsigned long long)seed, step, o->n_evicted, m->ne);
	for (int i = 0; i < m->ne; i++)
		cr_assert_eq(out_evicted(o, i), m->evicted[i], "seed %llu step %d evicted[%d]",
		             (unsigned long long)seed, step, i);
}

static void check_stats(uint64_t seed, int step, struct model *m, struct ref_lru *lru)
{
	struct kvr_lru_stats st;
	ref_lru_stats(lru, &st);
	uint64_t inactive = 0, live = 0;
	for (int i = 0; i < m->nc; i++)
		inactive += m->c[i].alive && m->c[i].refs == 0;
	for (int i = 0; i < m->nl; i++)
		live += m->l[i].live;
	cr_assert(st.copies == m_copies(m) && st.private_blocks == m->priv &&
	              st.inactive == inactive && st.leases == live &&
	              st.evictions == m->evictions && st.capacity == m->cap,
	          "seed %llu step %d: stats differ", (unsigned long long)seed, step);
}

/* Prompts drawn from 6 "documents" of 16 chained blocks each, sometimes starting mid-document
 * (a miss followed by hashes that exist), so sharing, misses and duplicate copies all happen. */
static int gen_prompt(uint64_t *r, uint64_t *seq)
{
	int n = (int)(splitmix64(r) % 17);
	uint64_t doc = splitmix64(r) % 6;
	int skip = (splitmix64(r) % 5 == 0) ? (int)(splitmix64(r) % 4) : 0;
	for (int i = 0; i < n; i++)
		seq[i] = doc * 100 + (uint64_t)(i + skip);
	if (n > 2 && splitmix64(r) % 4 == 0) /* diverge: the tail belongs to another document */
		for (int i = n / 2; i < n; i++)
			seq[i] = ((doc + 1) % 6) * 100 + (uint64_t)i;
	return n;
}

static void run_seed(uint64_t seed, int steps)
{
	static struct model m;
	uint64_t r = seed;
	uint64_t cap = splitmix64(&r) % 48;
	m_reset(&m, cap);
	struct ref_lru *lru;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	cr_assert_eq(ref_lru_create(cap, &lru), 0);
	uint64_t next_attempt = 1;
	uint64_t seq[MAXLEN];
	struct kvr_lru_block b[MAXLEN];
	for (int step = 0; step < steps; step++) {
		uint64_t op = splitmix64(&r) % 100;
		int rc = 0, mrc = 0;
		if (m.nc > MAXC - 200 || m.nl > MAXL - 2) { /* keep the model's arrays bounded */
			op = 99;
		}
		if (op < 35) {
			int n = gen_prompt(&r, seq);
			for (int i = 0; i < n; i++)
				b[i] = (struct kvr_lru_block){.local = seq[i] ^ 7, .seq = seq[i]};
			uint32_t pb = (uint32_t)(splitmix64(&r) % 3);
			uint64_t a =
			    (splitmix64(&r) % 10 == 0 && next_attempt > 1)
			        ? 1 + splitmix64(&r) % (next_attempt - 1) /* maybe duplicate */
			        : next_attempt++;
			rc = ref_lru_acquire(lru, a, b, (size_t)n, pb, &out);
			mrc = m_acquire(&m, a, seq, n, pb);
		} else if (op < 55) {
			uint64_t a = 1 + splitmix64(&r) % next_attempt;
			struct mlease *l = m_lease(&m, a);
			uint64_t parent =
			    (l && l->n) ? m.c[l->c[l->n - 1]].seq : splitmix64(&r) % 600;
			if (splitmix64(&r) % 8 == 0)
				parent ^= 1; /* wrong parent */
			int n = (int)(splitmix64(&r) % 3);
			if (l && l->n + n > MAXLEN * 4)
				n = 0;
			for (int i = 0; i < n; i++) {
				seq[i] = (splitmix64(&r) % 3 == 0)
				             ? splitmix64(&r) % 600
				             : 1000 + (uint64_t)step * 4 + (uint64_t)i;
				b[i] = (struct kvr_lru_block){.local = seq[i], .seq = seq[i]};
			}
			uint32_t start = l ? (uint32_t)l->n : 0;
			uint32_t pb = (uint32_t)(splitmix64(&r) % 2);
			rc = ref_lru_materialize(lru, a, parent, b, (size_t)n, start, pb, &out);
			mrc = m_materialize(&m, a, parent, seq, n, start, pb);
		} else if (op < 90) {
			uint64_t a = 1 + splitmix64(&r) % next_attempt;
			rc = ref_lru_release(lru, a, &out);
			mrc = m_release(&m, a);
		} else if (op < 97) {
			uint64_t c = splitmix64(&r) % 48;
			rc = ref_lru_set_capacity(lru, c, &out);
			m.ns = m.ne = 0;
			m.cap = c;
			m_reconcile(&m);
		} else {
			/* reset: a fresh instance (what rank_state does on a new incarnation) */
			ref_lru_destroy(lru);
			cap = splitmix64(&r) % 48;
			cr_assert_eq(ref_lru_create(cap, &lru), 0);
			m_reset(&m, cap);
			kvr_lru_out_reset(&out);
		}
		cr_assert_eq(rc, mrc, "seed %llu step %d: rc %d vs model %d",
		             (unsigned long long)seed, step, rc, mrc);
		check_out(seed, step, &m, &out, b);
		check_stats(seed, step, &m, lru);
		int n = gen_prompt(&r, seq);
		size_t ov = 0;
		while ((int)ov < n && m_first_copy(&m, seq[ov]) >= 0)
			ov++;
		cr_assert_eq(ref_lru_overlap(lru, seq, (size_t)n), ov, "seed %llu step %d: overlap",
		             (unsigned long long)seed, step);
	}
	ref_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

Test(lru_diff, ref_against_model, .timeout = 60)
{
	const char *env = getenv("LRU_DIFF_SEED");
	if (env) {
		run_seed(strtoull(env, NULL, 0), 2000);
		return;
	}
	for (uint64_t seed = 1; seed <= 1000; seed++)
		run_seed(seed, 400);
}

/* ------------------------------------------------------------------ segments vs per-block */

/* Coverage counters, printed with LRU_SEG_COV=1 (so a weakened generator shows). */
static uint64_t cov_enomem, cov_dup_steps, cov_evicted, cov_phantoms, cov_multi_runs, cov_steps,
    cov_stored;

#define PTAB (1u << 16)
static uint64_t ptab_key[PTAB], ptab_par[PTAB];
static bool ptab_used[PTAB];

static void parent_put(uint64_t seq, uint64_t par)
{
	uint32_t i = (uint32_t)(seq * 0x9E3779B97F4A7C15ull >> 48);
	while (ptab_used[i] && ptab_key[i] != seq)
		i = (i + 1) & (PTAB - 1);
	ptab_used[i] = true;
	ptab_key[i] = seq;
	ptab_par[i] = par;
}

static bool parent_get(uint64_t seq, uint64_t *par)
{
	uint32_t i = (uint32_t)(seq * 0x9E3779B97F4A7C15ull >> 48);
	while (ptab_used[i]) {
		if (ptab_key[i] == seq) {
			*par = ptab_par[i];
			return true;
		}
		i = (i + 1) & (PTAB - 1);
	}
	return false;
}

#define ROOT 0x5EEDull

static uint64_t chain(uint64_t parent, uint64_t token)
{
	uint64_t x = parent ^ (token * 0xD6E8FEB86659FD93ull);
	x = (x ^ (x >> 32)) * 0xD6E8FEB86659FD93ull;
	x ^= x >> 29;
	parent_put(x, parent);
	return x;
}

/* A prompt: document doc's tokens, sometimes diverging into another document or random
 * tokens; chained from the root. */
static int gen_chain(uint64_t *r, struct kvr_lru_block *b)
{
	/* Few lengths, so that leases often end on the same block (then their output blocks
	 * are copies of one hash). */
	int n = splitmix64(r) % 4 ? (int)(splitmix64(r) % 5) * 4 : (int)(splitmix64(r) % 17);
	uint64_t doc = splitmix64(r) % 6;
	int div = (splitmix64(r) % 3 == 0) ? (int)(splitmix64(r) % 17) : 99;
	uint64_t alt = splitmix64(r) % 8;
	uint64_t p = ROOT;
	for (int i = 0; i < n; i++) {
		uint64_t tok =
		    i < div ? doc * 1000 + (uint64_t)i : 100000 + alt * 1000 + (uint64_t)i;
		p = chain(p, tok);
		b[i] = (struct kvr_lru_block){.local = tok, .seq = p};
	}
	return n;
}

#define MAXA 4096
#define HIST 64

/* Every attempt's chain (prompt, then output blocks), for multi-turn prompts. */
static struct kvr_lru_block hist[MAXA][HIST];

static void seg_check_out(uint64_t seed, int step, const struct kvr_lru_out *o,
                          const struct kvr_lru_out *x, const struct kvr_lru_block *b)
{
	cr_assert_eq(o->n_stored, x->n_stored, "seed %llu step %d: n_stored %zu vs ref %zu",
	             (unsigned long long)seed, step, o->n_stored, x->n_stored);
	for (size_t i = 0; i < o->n_stored; i++)
		cr_assert_eq(out_stored(o, b, i)->seq, out_stored(x, b, i)->seq,
		             "seed %llu step %d: stored[%zu]", (unsigned long long)seed, step, i);
	cr_assert_eq(o->n_evicted, x->n_evicted, "seed %llu step %d: n_evicted %zu vs ref %zu",
	             (unsigned long long)seed, step, o->n_evicted, x->n_evicted);
	for (size_t i = 0; i < o->n_evicted; i++)
		cr_assert_eq(out_evicted(o, i), out_evicted(x, i),
		             "seed %llu step %d: evicted[%zu]", (unsigned long long)seed, step, i);
	/* Each run is a chain, parent first. */
	size_t base = 0;
	for (size_t k = 0; k < o->n_evicted_runs; k++) {
		for (size_t j = base + 1; j < base + o->evicted_run_len[k]; j++) {
			uint64_t par = 0;
			cr_assert(parent_get(o->evicted_seq[j], &par) &&
			              par == o->evicted_seq[j - 1],
			          "seed %llu step %d: evicted run %zu is not a chain",
			          (unsigned long long)seed, step, k);
		}
		base += o->evicted_run_len[k];
	}
	cr_assert_eq(o->cleared, x->cleared);
	cov_evicted += o->n_evicted;
	cov_stored += o->n_stored;
	for (size_t k = 0; k < o->n_evicted_runs; k++)
		cov_multi_runs += o->evicted_run_len[k] > 1;
}

static void seg_check_stats(uint64_t seed, int step, struct kvr_lru *lru, struct ref_lru *ref)
{
	struct kvr_lru_stats a, e;
	kvr_lru_stats(lru, &a);
	ref_lru_stats(ref, &e);
	cov_steps++;
	cov_dup_steps += a.copies > a.hashes;
	cov_phantoms += a.phantoms > 0;
	cr_assert(a.capacity == e.capacity && a.resident == e.resident && a.copies == e.copies &&
	              a.hashes == e.hashes && a.private_blocks == e.private_blocks &&
	              a.phantoms == e.phantoms && a.inactive == e.inactive &&
	              a.leases == e.leases && a.evictions == e.evictions && a.epoch == e.epoch,
	          "seed %llu step %d: stats differ (resident %llu/%llu copies %llu/%llu hashes "
	          "%llu/%llu inactive %llu/%llu evictions %llu/%llu)",
	          (unsigned long long)seed, step, (unsigned long long)a.resident,
	          (unsigned long long)e.resident, (unsigned long long)a.copies,
	          (unsigned long long)e.copies, (unsigned long long)a.hashes,
	          (unsigned long long)e.hashes, (unsigned long long)a.inactive,
	          (unsigned long long)e.inactive, (unsigned long long)a.evictions,
	          (unsigned long long)e.evictions);
}

/* With oom: each command first runs with one of its first allocations failing; a KVR_ENOMEM
 * must change nothing observable (stats, outputs), then the command is retried. */
#define SEG_CALL(call)                                                                             \
	do {                                                                                       \
		if (oom) {                                                                         \
			struct kvr_lru_stats s0, s1;                                               \
			kvr_lru_stats(lru, &s0);                                                   \
			kvr_alloc_fail_after(1 + splitmix64(&r) % 5);                              \
			rc = (call);                                                               \
			kvr_alloc_fail_after(0);                                                   \
			if (rc == KVR_ENOMEM) {                                                    \
				cov_enomem++;                                                      \
				kvr_lru_stats(lru, &s1);                                           \
				cr_assert(!memcmp(&s0, &s1, sizeof(s0)) && out.n_stored == 0 &&    \
				              out.n_evicted == 0,                                  \
				          "seed %llu step %d: ENOMEM changed something",           \
				          (unsigned long long)seed, step);                         \
				rc = (call);                                                       \
			}                                                                          \
		} else {                                                                           \
			rc = (call);                                                               \
		}                                                                                  \
	} while (0)

/* capmax bounds the capacities drawn: 64 keeps the segment array small, larger ones let it grow
 * past the size kvr_lru_settle shrinks from and then shrink when a capacity cut evicts. */
static void seg_run(uint64_t seed, int steps, bool keep, bool oom, uint64_t capmax)
{
	static uint64_t last[MAXA];
	static uint32_t nblk[MAXA];
	memset(last, 0, sizeof(last));
	memset(nblk, 0, sizeof(nblk));
	uint64_t r = seed * 7919 + keep;
	uint64_t cap = splitmix64(&r) % capmax;
	struct kvr_lru *lru;
	struct ref_lru *ref;
	struct kvr_lru_out out, xo;
	kvr_lru_out_init(&out);
	kvr_lru_out_init(&xo);
	cr_assert_eq(kvr_lru_create(cap, &lru), 0);
	cr_assert_eq(ref_lru_create(cap, &ref), 0);
	kvr_lru_set_keep_private(lru, keep);
	ref_lru_set_keep_private(ref, keep);
	uint64_t next_attempt = 1;
	struct kvr_lru_block b[MAXLEN];
	for (int step = 0; step < steps && next_attempt < MAXA - 1; step++) {
		uint64_t op = splitmix64(&r) % 100;
		int rc = 0, xrc = 0;
		int n = 0;
		if (op < 35) {
			n = gen_chain(&r, b);
			uint64_t from = 1 + splitmix64(&r) % next_attempt;
			if (splitmix64(&r) % 5 < 2 && from < next_attempt && nblk[from]) {
				/* A follow-up: a prefix of an earlier chain (output blocks
				 * included, so hits meet several copies of one hash), then maybe
				 * new blocks. */
				n = 1 + (int)(splitmix64(&r) % nblk[from]);
				if (n > MAXLEN - 2)
					n = MAXLEN - 2;
				memcpy(b, hist[from], (size_t)n * sizeof(b[0]));
				for (int extra = (int)(splitmix64(&r) % 3); extra > 0;
				     extra--, n++) {
					uint64_t tok = 7000000 + splitmix64(&r) % 2;
					b[n] = (struct kvr_lru_block){
					    .local = tok, .seq = chain(b[n - 1].seq, tok)};
				}
			}
			uint32_t pb = (uint32_t)(splitmix64(&r) % 3);
			uint64_t a = (splitmix64(&r) % 10 == 0 && next_attempt > 1)
			                 ? 1 + splitmix64(&r) % (next_attempt - 1)
			                 : next_attempt++;
			SEG_CALL(kvr_lru_acquire(lru, a, b, (size_t)n, pb, &out));
			xrc = ref_lru_acquire(ref, a, b, (size_t)n, pb, &xo);
			if (xrc == 0) {
				last[a] = n ? b[n - 1].seq : 0;
				nblk[a] = (uint32_t)n;
				memcpy(hist[a], b, (size_t)n * sizeof(b[0]));
			}
		} else if (op < 58) {
			/* Mostly recent (live) attempts. */
			uint64_t back =
			    1 + splitmix64(&r) % (splitmix64(&r) % 2 ? 6 : next_attempt);
			uint64_t a = back < next_attempt ? next_attempt - back : 1;
			uint64_t parent = nblk[a] ? last[a] : ROOT;
			if (splitmix64(&r) % 10 == 0)
				parent ^= 1; /* wrong parent */
			n = (int)(splitmix64(&r) % 3);
			uint64_t p = nblk[a] ? parent : ROOT;
			for (int i = 0; i < n; i++) {
				uint64_t tok = 7000000 + splitmix64(&r) % 2;
				p = chain(p, tok);
				b[i] = (struct kvr_lru_block){.local = tok, .seq = p};
			}
			uint32_t pb = (uint32_t)(splitmix64(&r) % 2);
			SEG_CALL(
			    kvr_lru_materialize(lru, a, parent, b, (size_t)n, nblk[a], pb, &out));
			xrc = ref_lru_materialize(ref, a, parent, b, (size_t)n, nblk[a], pb, &xo);
			if (xrc == 0 && n) {
				last[a] = b[n - 1].seq;
				for (int i = 0; i < n && nblk[a] + (uint32_t)i < HIST; i++)
					hist[a][nblk[a] + (uint32_t)i] = b[i];
				nblk[a] += (uint32_t)n;
			}
		} else if (op < 91) {
			uint64_t a = 1 + splitmix64(&r) % next_attempt;
			SEG_CALL(kvr_lru_release(lru, a, &out));
			xrc = ref_lru_release(ref, a, &xo);
		} else if (op < 98) {
			uint64_t c = splitmix64(&r) % capmax;
			SEG_CALL(kvr_lru_set_capacity(lru, c, &out));
			xrc = ref_lru_set_capacity(ref, c, &xo);
		} else {
			kvr_lru_destroy(lru);
			ref_lru_destroy(ref);
			cap = splitmix64(&r) % capmax;
			cr_assert_eq(kvr_lru_create(cap, &lru), 0);
			cr_assert_eq(ref_lru_create(cap, &ref), 0);
			kvr_lru_set_keep_private(lru, keep);
			ref_lru_set_keep_private(ref, keep);
			kvr_lru_out_reset(&out);
			kvr_lru_out_reset(&xo);
			memset(nblk, 0, sizeof(nblk));
		}
		cr_assert_eq(rc, xrc, "seed %llu keep %d step %d: rc %d vs ref %d",
		             (unsigned long long)seed, keep, step, rc, xrc);
		seg_check_out(seed, step, &out, &xo, b);
		seg_check_stats(seed, step, lru, ref);
		uint64_t q[MAXLEN];
		int qn = gen_chain(&r, b);
		for (int i = 0; i < qn; i++)
			q[i] = b[i].seq;
		cr_assert_eq(
		    kvr_lru_overlap(lru, q, (size_t)qn), ref_lru_overlap(ref, q, (size_t)qn),
		    "seed %llu keep %d step %d: overlap", (unsigned long long)seed, keep, step);
	}
	kvr_lru_destroy(lru);
	ref_lru_destroy(ref);
	kvr_lru_out_fini(&out);
	kvr_lru_out_fini(&xo);
}

Test(lru_diff, segments_against_ref, .timeout = 120)
{
	const char *env = getenv("LRU_SEG_SEED");
	if (env) {
		const char *k = getenv("LRU_SEG_KEEP"), *o = getenv("LRU_SEG_OOM");
		seg_run(strtoull(env, NULL, 0), 3000, k && *k == '1', o && *o == '1', 64);
		return;
	}
	for (uint64_t seed = 1; seed <= 600; seed++) {
		seg_run(seed, 500, true, false, 64);
		seg_run(seed, 500, false, false, 64);
	}
	if (getenv("LRU_SEG_COV"))
		fprintf(stderr,
		        "steps %llu dup_steps %llu phantom_steps %llu evicted %llu multi_runs %llu "
		        "stored %llu\n",
		        (unsigned long long)cov_steps, (unsigned long long)cov_dup_steps,
		        (unsigned long long)cov_phantoms, (unsigned long long)cov_evicted,
		        (unsigned long long)cov_multi_runs, (unsigned long long)cov_stored);
}

/* The two LRUs side by side, for the hand-built sequences below: every command is given to both
 * and must agree (return code, outputs, stats). */
struct both {
	struct kvr_lru *lru;
	struct ref_lru *ref;
	struct kvr_lru_out out, xo;
	int keep, step;
};

static void both_init(struct both *t, uint64_t cap, int keep)
{
	memset(t, 0, sizeof(*t));
	t->keep = keep;
	kvr_lru_out_init(&t->out);
	kvr_lru_out_init(&t->xo);
	cr_assert_eq(kvr_lru_create(cap, &t->lru), 0);
	cr_assert_eq(ref_lru_create(cap, &t->ref), 0);
	kvr_lru_set_keep_private(t->lru, keep);
	ref_lru_set_keep_private(t->ref, keep);
}

static void both_fini(struct both *t)
{
	kvr_lru_destroy(t->lru);
	ref_lru_destroy(t->ref);
	kvr_lru_out_fini(&t->out);
	kvr_lru_out_fini(&t->xo);
}

static void both_check(struct both *t, const struct kvr_lru_block *b)
{
	seg_check_out((uint64_t)t->keep, t->step, &t->out, &t->xo, b);
	seg_check_stats((uint64_t)t->keep, t->step, t->lru, t->ref);
	t->step++;
}

static void both_acquire(struct both *t, uint64_t a, const struct kvr_lru_block *b, size_t n,
                         uint32_t priv)
{
	cr_assert_eq(kvr_lru_acquire(t->lru, a, b, n, priv, &t->out),
	             ref_lru_acquire(t->ref, a, b, n, priv, &t->xo), "keep %d step %d", t->keep,
	             t->step);
	both_check(t, b);
}

static void both_release(struct both *t, uint64_t a, const struct kvr_lru_block *b)
{
	cr_assert_eq(kvr_lru_release(t->lru, a, &t->out), ref_lru_release(t->ref, a, &t->xo),
	             "keep %d step %d", t->keep, t->step);
	both_check(t, b);
}

static void both_set_capacity(struct both *t, uint64_t cap, const struct kvr_lru_block *b)
{
	cr_assert_eq(kvr_lru_set_capacity(t->lru, cap, &t->out),
	             ref_lru_set_capacity(t->ref, cap, &t->xo));
	both_check(t, b);
}

static void both_overlap(struct both *t, const struct kvr_lru_block *b, size_t n)
{
	uint64_t q[16];
	cr_assert_leq(n, 16);
	for (size_t i = 0; i < n; i++)
		q[i] = b[i].seq;
	cr_assert_eq(kvr_lru_overlap(t->lru, q, n), ref_lru_overlap(t->ref, q, n));
}

/* Attempt a's prompt: a chain of len blocks of its own (a segment each when acquired whole). */
static void own_chain(struct kvr_lru_block *b, uint64_t a, int len)
{
	uint64_t p = ROOT;
	for (int i = 0; i < len; i++) {
		p = chain(p, a * 10 + (uint64_t)i);
		b[i] = (struct kvr_lru_block){.local = a * 10 + (uint64_t)i, .seq = p};
	}
}

/* The segment array grows past the size kvr_lru_settle shrinks from, a capacity cut evicts
 * most segments while every tenth attempt still holds its copies (spread over the array, so
 * the shrink moves held segments and redirects their leases), and everything after must agree
 * with the per-block LRU: the held attempts' releases, re-acquires that hit, and evictions. */
Test(lru_diff, segment_array_shrinks_against_ref)
{
	enum { N = 600, LEN = 3 };
	static struct kvr_lru_block b[N][LEN];
	for (int keep = 0; keep < 2; keep++) {
		struct both t;
		both_init(&t, N * LEN, keep);
		for (uint64_t a = 1; a <= N; a++) { /* distinct chains: a segment each */
			own_chain(b[a - 1], a, LEN);
			both_acquire(&t, a, b[a - 1], LEN, 0);
		}
		for (uint64_t a = 1; a <= N; a++)
			if (a % 10 != 0)
				both_release(&t, a, b[a - 1]);
		size_t before = kvr_lru_bytes(t.lru);
		both_set_capacity(&t, N / 10 * LEN + 30, b[0]);
		/* The 540 evicted segments' hash arrays are ~17 KB; the array of 1,024 48-byte
		 * slots shrinks to fit the 60 held segments: ~40 KB more. */
		cr_assert_lt(kvr_lru_bytes(t.lru) + 40000, before,
		             "the segment array was not given back");
		for (uint64_t a = 10; a <= N; a += 10)
			both_release(&t, a, b[a - 1]);
		for (uint64_t a = 1; a <= N; a += 7) {
			both_acquire(&t, N + a, b[a - 1], LEN, 0);
			both_overlap(&t, b[a - 1], LEN);
		}
		both_fini(&t);
	}
}

/* Held pieces that span several segments when the array shrinks: every tenth attempt's segment
 * is split by a second attempt hitting its first half (the right half, a new segment high in
 * the array, is the piece's second segment), a capacity cut evicts the rest, and the shrink
 * moves the right halves down: the piece's split-chain link must follow them (the releases
 * walk it).  Everything must agree with the per-block LRU. */
Test(lru_diff, shrink_moves_split_pieces_against_ref)
{
	enum { N = 600, LEN = 4 };
	static struct kvr_lru_block b[N][LEN];
	for (int keep = 0; keep < 2; keep++) {
		struct both t;
		both_init(&t, N * LEN, keep);
		for (uint64_t a = 1; a <= N; a++) {
			own_chain(b[a - 1], a, LEN);
			both_acquire(&t, a, b[a - 1], LEN, 1);
		}
		for (uint64_t a = 10; a <= N; a += 10) { /* split the held ones */
			both_acquire(&t, 2 * N + a, b[a - 1], LEN / 2, 0);
			both_release(&t, 2 * N + a, b[a - 1]);
		}
		for (uint64_t a = 1; a <= N; a++)
			if (a % 10 != 0)
				both_release(&t, a, b[a - 1]);
		size_t before = kvr_lru_bytes(t.lru);
		both_set_capacity(&t, N / 10 * (LEN + 1) + 30, b[0]);
		cr_assert_lt(kvr_lru_bytes(t.lru) + 20000, before,
		             "the segment array did not shrink");
		for (uint64_t a = 10; a <= N; a += 10)
			both_release(&t, a, b[a - 1]);
		for (uint64_t a = 10; a <= N; a += 10) {
			both_acquire(&t, 3 * N + a, b[a - 1], LEN, 0);
			both_overlap(&t, b[a - 1], LEN);
		}
		both_fini(&t);
	}
}

/* Released private blocks (keep_private) sit in a ring: evictions advance its head, more
 * releases wrap it around and grow it (the copy must keep the order), and a capacity cut one
 * block at a time shows every phantom's place in the eviction order against the per-block LRU. */
Test(lru_diff, phantom_ring_wraps_and_grows_against_ref)
{
	enum { N = 60 };
	static struct kvr_lru_block b[N][1];
	struct both t;
	both_init(&t, 4 * N, 1);
	for (uint64_t a = 1; a <= N; a++)
		own_chain(b[a - 1], a, 1);
	for (uint64_t a = 1; a <= 10; a++) { /* 10 phantoms, each before its release's block */
		both_acquire(&t, a, b[a - 1], 1, 1);
		both_release(&t, a, b[a - 1]);
	}
	both_set_capacity(&t, 10, b[0]); /* the 5 oldest releases go: the ring's head moves */
	both_set_capacity(&t, 4 * N, b[0]);
	for (uint64_t a = 11; a <= N; a++) { /* wraps at 16 entries, then grows */
		both_acquire(&t, a, b[a - 1], 1, 1 + (uint32_t)(a % 3 == 0));
		both_release(&t, a, b[a - 1]);
	}
	for (uint64_t cap = 2 * N; cap-- > 0;)
		both_set_capacity(&t, cap, b[0]);
	both_fini(&t);
}

/* The same sequences with allocation failures injected into the segment LRU. */
Test(lru_diff, segments_against_ref_oom, .timeout = 120)
{
	for (uint64_t seed = 1; seed <= 150; seed++)
		seg_run(seed, 400, true, true, 64);
	cr_assert_gt(cov_enomem, 1000, "the injected failures must hit commands (%llu did)",
	             (unsigned long long)cov_enomem);
}
