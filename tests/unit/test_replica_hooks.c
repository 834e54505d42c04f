/* core/replica_hooks: a router's notes, applied to a second router through kvr_repl_admit and
 * the public calls (with kvr_repl_applying set), make the second router's predicted caches and
 * loads equal the first's; notes are not re-emitted while applying; detach stops the notes. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/replica_hooks.h"
#include "kvrouter.h"

struct mirror {
	struct kvr_router *dst;
	uint64_t from[4096], to[4096];
	size_t n;
	unsigned notes;
};

static uint64_t map(struct mirror *m, uint64_t a)
{
	for (size_t i = 0; i < m->n; i++)
		if (m->from[i] == a)
			return m->to[i];
	return 0;
}

static void on_admit(void *ctx, const struct kvr_repl_admission *a)
{
	struct mirror *m = ctx;
	m->notes++;
	struct kvr_repl_admission c = *a;
	kvr_repl_applying = true;
	cr_assert_eq(kvr_repl_admit(m->dst, &c), 0);
	kvr_repl_applying = false;
	cr_assert(m->n < 4096);
	m->from[m->n] = a->attempt;
	m->to[m->n++] = c.attempt;
}

static void on_progress(void *ctx, uint64_t attempt, int op, const uint32_t *t, size_t n)
{
	struct mirror *m = ctx;
	m->notes++;
	uint64_t b = map(m, attempt);
	cr_assert_neq(b, 0);
	kvr_repl_applying = true;
	int rc = op == KVR_OP_PREFILL_DONE ? kvr_request_prefill_done(m->dst, b)
	         : op == KVR_OP_OUTPUT     ? kvr_request_output(m->dst, b, t, n)
	         : op == KVR_OP_FINISH     ? kvr_request_finish(m->dst, b)
	                                   : kvr_request_abort(m->dst, b);
	kvr_repl_applying = false;
	cr_assert_eq(rc, 0);
}

static void on_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t inc, uint64_t cap,
                    uint32_t mbt)
{
	struct mirror *m = ctx;
	m->notes++;
	kvr_repl_applying = true;
	int rc = op == KVR_REPL_RANK_ADD        ? kvr_rank_add(m->dst, rank, inc, cap, mbt)
	         : op == KVR_REPL_RANK_CAPACITY ? kvr_rank_set_capacity(m->dst, rank, inc, cap)
	         : op == KVR_REPL_RANK_RESET    ? kvr_rank_reset(m->dst, rank, inc)
	                                        : kvr_rank_remove(m->dst, rank);
	kvr_repl_applying = false;
	cr_assert_eq(rc, 0);
}

static struct kvr_router *make(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	return r;
}

static int cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void same_blocks(struct kvr_router *a, struct kvr_router *b, struct kvr_rank_id rk)
{
	static uint64_t x[1 << 16], y[1 << 16];
	size_t nx, ny;
	cr_assert_eq(kvr_rank_blocks(a, rk, x, 1 << 16, &nx), 0);
	cr_assert_eq(kvr_rank_blocks(b, rk, y, 1 << 16, &ny), 0);
	cr_assert_eq(nx, ny, "rank %lu: %zu vs %zu blocks", (unsigned long)rk.worker_id, nx, ny);
	qsort(x, nx, 8, cmp);
	qsort(y, ny, 8, cmp);
	cr_assert_eq(memcmp(x, y, nx * 8), 0);
}

Test(replica_hooks, mirrored_router_agrees)
{
	struct kvr_router *a = make(), *b = make();
	static struct mirror m;
	memset(&m, 0, sizeof(m));
	m.dst = b;
	static struct mirror back; /* b's notes must stay silent while applying */
	memset(&back, 0, sizeof(back));
	back.dst = a;
	struct kvr_repl_hooks ha = {
	    .ctx = &m, .admitted = on_admit, .progressed = on_progress, .rank_changed = on_rank};
	struct kvr_repl_hooks hb = {
	    .ctx = &back, .admitted = on_admit, .progressed = on_progress, .rank_changed = on_rank};
	cr_assert_eq(kvr_repl_set_hooks(a, &ha), 0);
	cr_assert_eq(kvr_repl_set_hooks(a, &hb), KVR_EBUSY);
	cr_assert_eq(kvr_repl_set_hooks(b, &hb), 0);
	for (uint64_t w = 0; w < 4; w++)
		cr_assert_eq(kvr_rank_add(a, (struct kvr_rank_id){w, 0}, 7, 200, 4096), 0);
	cr_assert_eq(kvr_rank_set_capacity(a, (struct kvr_rank_id){3, 0}, 7, 150), 0);
	srand(5);
	uint64_t live[64] = {0};
	uint32_t t[600];
	for (int i = 0; i < 2000; i++) {
		int k = rand() % 64;
		if (live[k]) {
			int what = rand() % 4;
			if (what == 0) {
				uint32_t out[40];
				for (int j = 0; j < 40; j++)
					out[j] = (uint32_t)rand();
				cr_assert_eq(kvr_request_output(a, live[k], out, 1 + rand() % 40),
				             0);
			} else if (what == 1) {
				cr_assert_eq(kvr_request_prefill_done(a, live[k]), 0);
			} else {
				cr_assert_eq(what == 2 ? kvr_request_finish(a, live[k])
				                       : kvr_request_abort(a, live[k]),
				             0);
				live[k] = 0;
			}
			continue;
		}
		size_t n = 40 + (size_t)(rand() % 500);
		uint32_t fam = (uint32_t)(rand() % 12);
		for (size_t j = 0; j < n; j++)
			t[j] = j < 300 ? fam * 100000u + (uint32_t)j : (uint32_t)rand();
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = n;
		q.expected_output_tokens = 64;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(a, &q, &d), 0);
		live[k] = d.attempt;
	}
	cr_assert_eq(back.notes, 0, "applying must not re-emit");
	cr_assert_eq(kvr_router_sync(a, 5000), 0);
	cr_assert_eq(kvr_router_sync(b, 5000), 0);
	for (uint64_t w = 0; w < 4; w++) {
		struct kvr_rank_id rk = {w, 0};
		same_blocks(a, b, rk);
		struct kvr_rank_stats sa, sb;
		cr_assert_eq(kvr_rank_get_stats(a, rk, &sa), 0);
		cr_assert_eq(kvr_rank_get_stats(b, rk, &sb), 0);
		cr_assert_eq(sa.active_requests, sb.active_requests);
		cr_assert_eq(sa.active_blocks, sb.active_blocks);
		cr_assert_eq(sa.active_prefill_tokens, sb.active_prefill_tokens);
		cr_assert_eq(sa.capacity_blocks, sb.capacity_blocks);
	}
	cr_assert_eq(kvr_rank_remove(a, (struct kvr_rank_id){2, 0}), 0);
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(b, (struct kvr_rank_id){2, 0}, &s), KVR_ENOENT);
	cr_assert_eq(kvr_repl_set_hooks(a, NULL), 0);
	unsigned before = m.notes;
	cr_assert_eq(kvr_rank_reset(a, (struct kvr_rank_id){1, 0}, 8), 0);
	cr_assert_eq(m.notes, before, "no notes after detach");
	kvr_router_destroy(a);
	kvr_router_destroy(b);
}

Test(replica_hooks, admit_refuses_bad_input)
{
	struct kvr_router *r = make();
	cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 3, 100, 0), 0);
	uint64_t h[2] = {1, 2};
	struct kvr_repl_admission m = {
	    .rank = {1, 0}, .incarnation = 3, .local = h, .n = 2, .prompt_tokens = 32};
	cr_assert_eq(kvr_repl_admit(r, &m), 0);
	cr_assert_neq(m.attempt, 0);
	m.incarnation = 4;
	cr_assert_eq(kvr_repl_admit(r, &m), KVR_ESTALE);
	m.incarnation = 3;
	m.rank.worker_id = 9;
	cr_assert_eq(kvr_repl_admit(r, &m), KVR_ENOENT);
	m.rank.worker_id = 1;
	m.local = NULL;
	cr_assert_eq(kvr_repl_admit(r, &m), KVR_EINVAL);
	m.local = h;
	m.tail_n = 16;
	uint32_t tail[16] = {0};
	m.tail = tail;
	cr_assert_eq(kvr_repl_admit(r, &m), KVR_EINVAL); /* a tail is shorter than a block */
	kvr_router_destroy(r);
}
