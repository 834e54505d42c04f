/* Differential test of shards/lru against an obviously-correct reference model: plain arrays,
 * linear scans, eviction by searching the minimum of (epoch asc, position desc, copy id asc).
 * Random sequences of acquire / materialize / release / set_capacity / reset; every command's
 * outputs (stored and evicted, in order), return code, stats and overlap must agree.
 * The seed and step are printed on failure; rerun one seed with LRU_DIFF_SEED=<seed>. */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "shards/lru.h"
#include "lru_out_util.h"

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

static void check_stats(uint64_t seed, int step, struct model *m, struct kvr_lru *lru)
{
	struct kvr_lru_stats st;
	kvr_lru_stats(lru, &st);
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

static uint64_t rng_next(uint64_t *s)
{
	uint64_t x = *s += 0x9E3779B97F4A7C15ull;
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
	x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
	return x ^ (x >> 31);
}

/* Prompts drawn from 6 "documents" of 16 chained blocks each, sometimes starting mid-document
 * (a miss followed by hashes that exist), so sharing, misses and duplicate copies all happen. */
static int gen_prompt(uint64_t *r, uint64_t *seq)
{
	int n = (int)(rng_next(r) % 17);
	uint64_t doc = rng_next(r) % 6;
	int skip = (rng_next(r) % 5 == 0) ? (int)(rng_next(r) % 4) : 0;
	for (int i = 0; i < n; i++)
		seq[i] = doc * 100 + (uint64_t)(i + skip);
	if (n > 2 && rng_next(r) % 4 == 0) /* diverge: the tail belongs to another document */
		for (int i = n / 2; i < n; i++)
			seq[i] = ((doc + 1) % 6) * 100 + (uint64_t)i;
	return n;
}

static void run_seed(uint64_t seed, int steps)
{
	static struct model m;
	uint64_t r = seed;
	uint64_t cap = rng_next(&r) % 48;
	m_reset(&m, cap);
	struct kvr_lru *lru;
	struct kvr_lru_out out;
	kvr_lru_out_init(&out);
	cr_assert_eq(kvr_lru_create(cap, &lru), 0);
	uint64_t next_attempt = 1;
	uint64_t seq[MAXLEN];
	struct kvr_lru_block b[MAXLEN];
	for (int step = 0; step < steps; step++) {
		uint64_t op = rng_next(&r) % 100;
		int rc = 0, mrc = 0;
		if (m.nc > MAXC - 200 || m.nl > MAXL - 2) { /* keep the model's arrays bounded */
			op = 99;
		}
		if (op < 35) {
			int n = gen_prompt(&r, seq);
			for (int i = 0; i < n; i++)
				b[i] = (struct kvr_lru_block){.local = seq[i] ^ 7, .seq = seq[i]};
			uint32_t pb = (uint32_t)(rng_next(&r) % 3);
			uint64_t a =
			    (rng_next(&r) % 10 == 0 && next_attempt > 1)
			        ? 1 + rng_next(&r) % (next_attempt - 1) /* maybe duplicate */
			        : next_attempt++;
			rc = kvr_lru_acquire(lru, a, b, (size_t)n, pb, &out);
			mrc = m_acquire(&m, a, seq, n, pb);
		} else if (op < 55) {
			uint64_t a = 1 + rng_next(&r) % next_attempt;
			struct mlease *l = m_lease(&m, a);
			uint64_t parent =
			    (l && l->n) ? m.c[l->c[l->n - 1]].seq : rng_next(&r) % 600;
			if (rng_next(&r) % 8 == 0)
				parent ^= 1; /* wrong parent */
			int n = (int)(rng_next(&r) % 3);
			if (l && l->n + n > MAXLEN * 4)
				n = 0;
			for (int i = 0; i < n; i++) {
				seq[i] = (rng_next(&r) % 3 == 0)
				             ? rng_next(&r) % 600
				             : 1000 + (uint64_t)step * 4 + (uint64_t)i;
				b[i] = (struct kvr_lru_block){.local = seq[i], .seq = seq[i]};
			}
			uint32_t start = l ? (uint32_t)l->n : 0;
			uint32_t pb = (uint32_t)(rng_next(&r) % 2);
			rc = kvr_lru_materialize(lru, a, parent, b, (size_t)n, start, pb, &out);
			mrc = m_materialize(&m, a, parent, seq, n, start, pb);
		} else if (op < 90) {
			uint64_t a = 1 + rng_next(&r) % next_attempt;
			rc = kvr_lru_release(lru, a, &out);
			mrc = m_release(&m, a);
		} else if (op < 97) {
			uint64_t c = rng_next(&r) % 48;
			rc = kvr_lru_set_capacity(lru, c, &out);
			m.ns = m.ne = 0;
			m.cap = c;
			m_reconcile(&m);
		} else {
			/* reset: a fresh instance (what rank_state does on a new incarnation) */
			kvr_lru_destroy(lru);
			cap = rng_next(&r) % 48;
			cr_assert_eq(kvr_lru_create(cap, &lru), 0);
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
		cr_assert_eq(kvr_lru_overlap(lru, seq, (size_t)n), ov, "seed %llu step %d: overlap",
		             (unsigned long long)seed, step);
	}
	kvr_lru_destroy(lru);
	kvr_lru_out_fini(&out);
}

Test(lru_diff, random_against_model, .timeout = 60)
{
	const char *env = getenv("LRU_DIFF_SEED");
	if (env) {
		run_seed(strtoull(env, NULL, 0), 2000);
		return;
	}
	for (uint64_t seed = 1; seed <= 1000; seed++)
		run_seed(seed, 400);
}
