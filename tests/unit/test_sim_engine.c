/*
 * tests/unit/test_sim_engine.c - the simulated vLLM rank and cluster: step-time and TTFT
 * accounting worked by hand, chunked prefill, prefix hits at admission (with vLLM's
 * recompute-the-last-token cap), output tokens completing hashed blocks, preemption of the
 * newest request with tail-first release, events in the router's hash terms, determinism.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "tests/common/xorshift.h"
#include "tools/sim/cluster.h"

#define MAXREC 256

struct ev_rec {
	enum sim_event_kind kind;
	uint32_t rank;
	uint64_t time, parent;
	bool has_parent;
	size_t n;
	uint64_t seq[16];
};

struct rec {
	uint64_t digest;
	size_t n_ev, n_admit, n_first, n_fin;
	struct ev_rec ev[MAXREC];
	struct sim_admit_info admit[MAXREC];
	uint64_t first_id[MAXREC], first_t[MAXREC];
	struct sim_finish_info fin[MAXREC];
};

static void mixin(struct rec *r, uint64_t v)
{
	r->digest = (r->digest ^ v) * 0x100000001b3ULL;
}

static void on_event(void *ctx, const struct sim_kv_event *ev)
{
	struct rec *r = ctx;
	mixin(r, ev->kind);
	mixin(r, ev->rank);
	mixin(r, ev->time_ns);
	mixin(r, ev->event_id);
	mixin(r, ev->has_parent ? ev->parent_seq : 1);
	for (size_t i = 0; i < ev->n; i++) {
		mixin(r, ev->seq[i]);
		mixin(r, ev->local[i]);
	}
	if (r->n_ev < MAXREC) {
		struct ev_rec *e = &r->ev[r->n_ev++];
		*e = (struct ev_rec){.kind = ev->kind,
		                     .rank = ev->rank,
		                     .time = ev->time_ns,
		                     .parent = ev->parent_seq,
		                     .has_parent = ev->has_parent,
		                     .n = ev->n};
		for (size_t i = 0; i < ev->n && i < 16; i++)
			e->seq[i] = ev->seq[i];
	}
}

static void on_admit(void *ctx, const struct sim_admit_info *a)
{
	struct rec *r = ctx;
	mixin(r, a->id);
	mixin(r, a->time_ns);
	mixin(r, a->hit_blocks);
	if (r->n_admit < MAXREC)
		r->admit[r->n_admit++] = *a;
}

static void on_first(void *ctx, uint32_t rank, uint64_t id, void *user, uint64_t t)
{
	struct rec *r = ctx;
	(void)user;
	mixin(r, rank);
	mixin(r, id);
	mixin(r, t);
	if (r->n_first < MAXREC) {
		r->first_id[r->n_first] = id;
		r->first_t[r->n_first++] = t;
	}
}

static void on_finish(void *ctx, const struct sim_finish_info *f)
{
	struct rec *r = ctx;
	mixin(r, f->id);
	mixin(r, f->finish_ns);
	mixin(r, f->preemptions);
	if (r->n_fin < MAXREC)
		r->fin[r->n_fin++] = *f;
}

static uint32_t out_tok(void *user, uint64_t id, uint32_t i)
{
	(void)user;
	return (uint32_t)(1000000 + id * 1000 + i);
}

static struct sim_callbacks cbs(struct rec *r)
{
	return (struct sim_callbacks){.ctx = r,
	                              .kv_event = on_event,
	                              .admitted = on_admit,
	                              .first_token = on_first,
	                              .finished = on_finish,
	                              .output_token = out_tok};
}

static struct sim_cluster_config small_cfg(uint32_t ranks, uint32_t blocks, uint32_t bs)
{
	struct sim_cluster_config c;
	sim_cluster_config_init(&c);
	c.n_ranks = ranks;
	c.engine.n_blocks = blocks;
	c.engine.block_size = bs;
	c.engine.step_base_ns = 1000;
	c.engine.step_per_token_ns = 10;
	return c;
}

/* A cluster of cfg recording into r (emptied first); asserts it was created. */
static struct sim_cluster *start(struct rec *r, const struct sim_cluster_config *cfg)
{
	memset(r, 0, sizeof(*r));
	struct sim_callbacks cb = cbs(r);
	struct sim_cluster *c = NULL;
	cr_assert_eq(sim_cluster_create(cfg, &cb, &c), 0);
	return c;
}

static void fill(uint32_t *t, size_t n, uint32_t base)
{
	for (size_t i = 0; i < n; i++)
		t[i] = base + (uint32_t)i;
}

static struct sim_request req(uint64_t id, const uint32_t *p, uint32_t n, uint32_t out)
{
	return (struct sim_request){.id = id, .prompt = p, .prompt_len = n, .output_len = out};
}

static const struct sim_finish_info *fin_of(const struct rec *r, uint64_t id)
{
	for (size_t i = 0; i < r->n_fin; i++)
		if (r->fin[i].id == id)
			return &r->fin[i];
	cr_assert_fail("request %llu did not finish", (unsigned long long)id);
	return NULL;
}

Test(sim_engine, defaults_and_bad_config)
{
	struct sim_cluster_config c;
	sim_cluster_config_init(&c);
	cr_assert_eq(c.n_ranks, 8);
	cr_assert_eq(c.engine.block_size, 16);
	cr_assert_eq(c.engine.max_batched_tokens, 8192);
	cr_assert(c.engine.chunked_prefill);
	struct sim_cluster *cl = NULL;
	c.n_ranks = 0;
	cr_assert_eq(sim_cluster_create(&c, NULL, &cl), KVR_EINVAL);
	c.n_ranks = 1;
	c.engine.block_size = 0;
	cr_assert_eq(sim_cluster_create(&c, NULL, &cl), KVR_EINVAL);
	sim_cluster_destroy(NULL);
}

/* One request alone: step = a + b*tokens; TTFT is the end of the prefill step. */
Test(sim_engine, step_time_and_ttft_single_request)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 16);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t p[64];
	fill(p, 64, 1);
	struct sim_request q = req(7, p, 64, 3);
	cr_assert_eq(sim_cluster_submit(c, 0, &q), 0);
	cr_assert_eq(sim_cluster_next_time(c), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);

	cr_assert_eq(r.n_first, 1);
	cr_assert_eq(r.first_t[0], 1000 + 64 * 10);
	const struct sim_finish_info *f = fin_of(&r, 7);
	cr_assert_eq(f->finish_ns, 1640 + 1010 + 1010);
	cr_assert_eq(f->first_token_ns - f->arrival_ns, 1640);
	cr_assert_eq(f->prompt_blocks, 4);
	cr_assert_eq(f->hit_blocks, 0);
	struct sim_engine_stats st;
	cr_assert_eq(sim_cluster_stats(c, 0, &st), 0);
	cr_assert_eq(st.steps, 3);
	cr_assert_eq(st.tokens, 66);
	cr_assert_eq(st.prefill_tokens, 64);
	cr_assert_eq(st.busy_ns, 3660);
	cr_assert_eq(st.free_blocks, 64);
	cr_assert_eq(st.running + st.waiting, 0);

	/* One stored event: the prompt's 4 blocks, a root chain, in the router's hashes. */
	uint64_t seq[4], local[4];
	cr_assert_eq(kvr_hash_blocks(p, 64, 16, NULL, local, seq), 4);
	cr_assert_eq(r.n_ev, 1);
	cr_assert_eq(r.ev[0].kind, SIM_EV_STORED);
	cr_assert_not(r.ev[0].has_parent);
	cr_assert_eq(r.ev[0].n, 4);
	for (int i = 0; i < 4; i++)
		cr_assert_eq(r.ev[0].seq[i], seq[i]);
	/* The cached set is exactly the prompt's blocks (the last token's KV is never made). */
	uint64_t got[8];
	cr_assert_eq(sim_cluster_cached_hashes(c, 0, got, 8), 4);
	for (int i = 0; i < 4; i++)
		cr_assert(sim_cluster_is_cached(c, 0, seq[i]));
	sim_cluster_destroy(c);
}

/* The KV read term: each step also costs c per KV block its scheduled requests' attention
 * reads, up to the end of what each computes in the step (4 blocks for the 64-token prefill,
 * 5 for each decode step past token 64). */
Test(sim_engine, step_time_counts_the_kv_blocks_read)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 16);
	cfg.engine.step_per_kv_block_ns = 100;
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t p[64];
	fill(p, 64, 1);
	struct sim_request q = req(7, p, 64, 3);
	cr_assert_eq(sim_cluster_submit(c, 0, &q), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(r.n_first, 1);
	cr_assert_eq(r.first_t[0], 1000 + 64 * 10 + 4 * 100);
	const struct sim_finish_info *f = fin_of(&r, 7);
	cr_assert_eq(f->finish_ns, 2040 + 2 * (1000 + 10 + 5 * 100));
	sim_cluster_destroy(c);
	cfg.engine.step_per_kv_block_ns = -1;
	cr_assert_eq(sim_cluster_create(&cfg, NULL, &c), KVR_EINVAL);
	/* A longest step over an hour (virtual time is 64-bit nanoseconds): refused. */
	cfg.engine.step_per_kv_block_ns = 3.6e12 / 64; /* 64 blocks: 3.6e12 + a + b x 8192 */
	cr_assert_eq(sim_cluster_create(&cfg, NULL, &c), KVR_EINVAL);
	cfg.engine.step_per_kv_block_ns = INFINITY;
	cr_assert_eq(sim_cluster_create(&cfg, NULL, &c), KVR_EINVAL);
	cfg.engine.step_per_kv_block_ns = 1e9; /* 64 s: allowed */
	cr_assert_eq(sim_cluster_create(&cfg, NULL, &c), 0);
	sim_cluster_destroy(c);
}

/* A request arriving during a step waits for the step boundary, then shares a step. */
Test(sim_engine, arrival_during_step_waits_for_boundary)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 16);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t a[64], b[32];
	fill(a, 64, 1);
	fill(b, 32, 5000);
	struct sim_request qa = req(1, a, 64, 2), qb = req(2, b, 32, 1);
	cr_assert_eq(sim_cluster_submit(c, 0, &qa), 0);
	cr_assert_eq(sim_cluster_run_until(c, 500), 0);
	cr_assert_eq(sim_cluster_submit(c, 0, &qb), 0);
	cr_assert_eq(sim_cluster_run_until(c, 100), KVR_EINVAL, "time never goes back");
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(r.n_admit, 2);
	cr_assert_eq(r.admit[1].id, 2);
	cr_assert_eq(r.admit[1].time_ns, 1640);
	/* Step 2 = A's decode + B's 32 prompt tokens = 33 tokens. */
	const struct sim_finish_info *fb = fin_of(&r, 2);
	cr_assert_eq(fb->first_token_ns, 1640 + 1000 + 330);
	cr_assert_eq(fb->first_token_ns - fb->arrival_ns, 2470);
	cr_assert_eq(fin_of(&r, 1)->finish_ns, 2970);
	sim_cluster_destroy(c);
}

/* Requests submitted at the same instant are scheduled in one step. */
Test(sim_engine, same_instant_arrivals_share_a_step)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(2, 64, 16);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t a[32], b[48];
	fill(a, 32, 1);
	fill(b, 48, 900);
	struct sim_request qa = req(1, a, 32, 1), qb = req(2, b, 48, 1);
	cr_assert_eq(sim_cluster_run_until(c, 10000), 0);
	cr_assert_eq(sim_cluster_submit(c, 1, &qa), 0);
	cr_assert_eq(sim_cluster_submit(c, 1, &qb), 0);
	cr_assert_eq(sim_cluster_submit(c, 2, &qb), KVR_ENOENT);
	cr_assert_eq(sim_cluster_drain(c), 0);
	struct sim_engine_stats st;
	sim_cluster_stats(c, 1, &st);
	cr_assert_eq(st.steps, 1);
	cr_assert_eq(st.tokens, 80);
	cr_assert_eq(fin_of(&r, 1)->finish_ns, 10000 + 1000 + 800);
	cr_assert_eq(fin_of(&r, 2)->finish_ns, 11800);
	sim_cluster_stats(c, 0, &st);
	cr_assert_eq(st.steps, 0);
	sim_cluster_destroy(c);
}

/* Chunked prefill: the budget splits a prompt; each chunk stores the blocks it completes. */
Test(sim_engine, chunked_prefill_steps_and_events)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 16);
	cfg.engine.max_batched_tokens = 32;
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t p[100];
	fill(p, 100, 3);
	uint64_t seq[6];
	kvr_hash_blocks(p, 100, 16, NULL, NULL, seq);
	struct sim_request q = req(1, p, 100, 1);
	cr_assert_eq(sim_cluster_submit(c, 0, &q), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(r.first_t[0], 4 * 1000 + 100 * 10);
	cr_assert_eq(r.n_ev, 3);
	for (int k = 0; k < 3; k++) {
		cr_assert_eq(r.ev[k].kind, SIM_EV_STORED);
		cr_assert_eq(r.ev[k].n, 2);
		cr_assert_eq(r.ev[k].seq[0], seq[2 * k]);
		cr_assert_eq(r.ev[k].has_parent, k > 0);
		if (k > 0)
			cr_assert_eq(r.ev[k].parent, seq[2 * k - 1]);
	}
	cr_assert_eq(r.ev[1].time, 1320);
	sim_cluster_destroy(c);

	/* Without chunked prefill, a prompt over the budget could never run. */
	cfg.engine.chunked_prefill = false;
	cr_assert_eq(sim_cluster_create(&cfg, NULL, &c), 0);
	cr_assert_eq(sim_cluster_submit(c, 0, &q), KVR_ERANGE);
	sim_cluster_destroy(c);
}

/* Prefix hits at admission; a fully cached prompt still recomputes its last block, which
 * makes a second physical copy of that block (vLLM does the same). */
static void run_hits(bool dedup)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 16);
	cfg.engine.dedup_events = dedup;
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t p[80];
	fill(p, 80, 11);
	uint64_t seq[5];
	kvr_hash_blocks(p, 80, 16, NULL, NULL, seq);
	struct sim_request a = req(1, p, 64, 1), b = req(2, p, 80, 1), d = req(3, p, 64, 1);
	cr_assert_eq(sim_cluster_submit(c, 0, &a), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(sim_cluster_submit(c, 0, &b), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(r.admit[1].cached_blocks, 4);
	cr_assert_eq(r.admit[1].hit_blocks, 4);
	cr_assert_eq(r.ev[1].n, 1);
	cr_assert_eq(r.ev[1].seq[0], seq[4]);
	cr_assert(r.ev[1].has_parent);
	cr_assert_eq(r.ev[1].parent, seq[3]);
	/* B's step: 16 tokens only. */
	cr_assert_eq(fin_of(&r, 2)->first_token_ns - fin_of(&r, 2)->arrival_ns, 1160);

	cr_assert_eq(sim_cluster_submit(c, 0, &d), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(r.admit[2].cached_blocks, 4);
	cr_assert_eq(r.admit[2].hit_blocks, 3, "the last token is always recomputed");
	cr_assert_eq(fin_of(&r, 3)->hit_blocks, 3);
	if (dedup) {
		cr_assert_eq(r.n_ev, 2, "a second copy is not announced");
	} else {
		cr_assert_eq(r.n_ev, 3);
		cr_assert_eq(r.ev[2].n, 1);
		cr_assert_eq(r.ev[2].seq[0], seq[3]);
		cr_assert_eq(r.ev[2].parent, seq[2]);
	}
	struct sim_engine_stats st;
	sim_cluster_stats(c, 0, &st);
	cr_assert_eq(st.cached_hashes, 5);
	cr_assert_eq(st.stored_blocks, 6, "5 hashes, one of them twice");
	cr_assert_eq(st.hit_blocks, 7);
	cr_assert_eq(st.prompt_blocks, 4 + 5 + 4);
	sim_cluster_destroy(c);
}

Test(sim_engine, prefix_hits_and_duplicate_copy)
{
	run_hits(false);
}

Test(sim_engine, prefix_hits_dedup_events)
{
	run_hits(true);
}

/* Output tokens extend the chain: completed blocks are hashed like prompt blocks. */
Test(sim_engine, output_tokens_complete_hashed_blocks)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 4);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t all[14];
	fill(all, 6, 77);
	for (uint32_t i = 0; i < 8; i++)
		all[6 + i] = out_tok(NULL, 9, i);
	uint64_t seq[3];
	cr_assert_eq(kvr_hash_blocks(all, 14, 4, NULL, NULL, seq), 3);
	struct sim_request q = req(9, all, 6, 8);
	cr_assert_eq(sim_cluster_submit(c, 0, &q), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	/* 6 + 7 computed tokens: three full blocks cached, announced in order with parents. */
	uint64_t got[4];
	cr_assert_eq(sim_cluster_cached_hashes(c, 0, got, 4), 3);
	for (int i = 0; i < 3; i++)
		cr_assert(sim_cluster_is_cached(c, 0, seq[i]), "block %d", i);
	cr_assert_eq(r.n_ev, 3);
	cr_assert_eq(r.ev[2].seq[0], seq[2]);
	cr_assert_eq(r.ev[2].parent, seq[1]);
	sim_cluster_destroy(c);
}

/* vLLM's rule worked by hand at B = 16: the final sampled token is never fed back, so it has no
 * KV; after P prompt + O output tokens floor((P + O - 1) / 16) blocks are cached. */
static size_t sim_cached_after(uint32_t p, uint32_t o)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 64, 16);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t prompt[64];
	fill(prompt, p, 500);
	struct sim_request q = req(3, prompt, p, o);
	cr_assert_eq(sim_cluster_submit(c, 0, &q), 0);
	cr_assert_eq(sim_cluster_drain(c), 0);
	uint64_t got[8];
	size_t n = sim_cluster_cached_hashes(c, 0, got, 8);
	sim_cluster_destroy(c);
	return n;
}

Test(sim_engine, final_token_has_no_kv)
{
	cr_assert_eq(sim_cached_after(10, 6), 0, "P + O = 16: the only block waits for the final");
	cr_assert_eq(sim_cached_after(10, 7), 1);
	cr_assert_eq(sim_cached_after(32, 1), 2);
	cr_assert_eq(sim_cached_after(32, 17), 3);
	cr_assert_eq(sim_cached_after(5, 60), 4);
}

/* Blocks run out: the newest running request is preempted, its blocks freed tail first (so
 * its last block is the first evicted), and it recomputes later; the oldest is never hit. */
Test(sim_engine, preemption_newest_first)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 7, 4);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t p[3][8];
	uint64_t seq[3][2];
	struct sim_request q[3];
	for (int i = 0; i < 3; i++) {
		fill(p[i], 8, 100u * (i + 1));
		kvr_hash_blocks(p[i], 8, 4, NULL, NULL, seq[i]);
		q[i] = req(i + 1, p[i], 8, 10);
		cr_assert_eq(sim_cluster_submit(c, 0, &q[i]), 0);
	}
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(r.n_fin, 3);
	struct sim_engine_stats st;
	sim_cluster_stats(c, 0, &st);
	cr_assert_geq(st.preemptions, 1);
	cr_assert_eq(fin_of(&r, 1)->preemptions, 0, "the oldest request is never preempted");
	cr_assert_geq(fin_of(&r, 3)->preemptions, 1);
	/* The first removal: request 3's last prompt block, taken by request 2 in step 2. */
	size_t k = 0;
	while (k < r.n_ev && r.ev[k].kind != SIM_EV_REMOVED)
		k++;
	cr_assert_lt(k, r.n_ev);
	cr_assert_eq(r.ev[k].seq[0], seq[2][1]);
	cr_assert_eq(r.ev[k].time, 1000 + 24 * 10);
	/* Re-admissions report the preemption count. */
	bool readmit = false;
	for (size_t i = 0; i < r.n_admit; i++)
		readmit |= r.admit[i].id == 3 && r.admit[i].preemptions >= 1;
	cr_assert(readmit);
	cr_assert_eq(st.free_blocks, 7);
	sim_cluster_destroy(c);
}

/* Several preemptions in one step each put a request back at the front of the waiting queue;
 * the queue's ring kept one spare slot, enough for one.  Four decoders on a full 4-block pool
 * cross a block boundary together: the first preempts the fourth, the second the third, both
 * while 63 later arrivals fill the ring to its last slot (an assertion failure, and without
 * asserts a waiting request overwritten: never run). */
Test(sim_engine, preemptions_in_one_step_keep_every_waiting_request)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 4, 4);
	cfg.engine.max_num_seqs = 4;
	struct sim_cluster *c = start(&r, &cfg);
	static uint32_t p[67][4];
	for (uint32_t i = 0; i < 67; i++) {
		fill(p[i], 4, 1000u * (i + 1));
		struct sim_request q = req(i, p[i], 4, 6);
		if (i == 4) /* the first step (4 x 4 tokens) runs until 1160 ns */
			cr_assert_eq(sim_cluster_run_until(c, 1), 0);
		cr_assert_eq(sim_cluster_submit(c, 0, &q), 0);
	}
	cr_assert_eq(sim_cluster_drain(c), 0);
	struct sim_engine_stats st;
	sim_cluster_stats(c, 0, &st);
	cr_assert_geq(st.preemptions, 2);
	cr_assert_eq(r.n_fin, 67, "every request finishes once");
	for (uint64_t i = 0; i < 67; i++)
		fin_of(&r, i);
	cr_assert_eq(st.free_blocks, 4);
	sim_cluster_destroy(c);
}

Test(sim_engine, oversized_request_and_reset)
{
	static struct rec r;
	struct sim_cluster_config cfg = small_cfg(1, 4, 16);
	struct sim_cluster *c = start(&r, &cfg);
	uint32_t p[64];
	fill(p, 64, 1);
	struct sim_request big = req(1, p, 64, 2), ok = req(2, p, 63, 2);
	cr_assert_eq(sim_cluster_submit(c, 0, &big), KVR_ERANGE);
	struct sim_request bad = req(3, NULL, 4, 1);
	cr_assert_eq(sim_cluster_submit(c, 0, &bad), KVR_EINVAL);
	cr_assert_eq(sim_cluster_submit(c, 0, &ok), 0);
	cr_assert_eq(sim_cluster_step(c), 0);
	cr_assert_eq(sim_cluster_reset_cache(c, 0), KVR_EBUSY);
	cr_assert_eq(sim_cluster_drain(c), 0);
	cr_assert_eq(sim_cluster_step(c), KVR_ENOENT);
	cr_assert_gt(sim_cluster_cached_hashes(c, 0, NULL, 0), 0);
	cr_assert_eq(sim_cluster_reset_cache(c, 0), 0);
	cr_assert_eq(sim_cluster_cached_hashes(c, 0, NULL, 0), 0);
	cr_assert_eq(r.ev[r.n_ev - 1].kind, SIM_EV_CLEARED);
	sim_cluster_destroy(c);
}

/* ---------------------------------------------------------------- determinism */

/* A random workload over shared prefixes, under block pressure; returns the digest of every
 * callback and checks that every request finished and every block came back. */
static uint64_t workload(uint64_t seed, struct rec *r)
{
	struct sim_cluster_config cfg = small_cfg(4, 96, 16);
	cfg.engine.max_batched_tokens = 256;
	struct sim_cluster *c = start(r, &cfg);
	uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
	uint32_t tok[512];
	uint64_t t = 0;
	const int n = 300;
	for (int i = 0; i < n; i++) {
		t += xorshift64(&s) % 4000;
		uint32_t prefix = (uint32_t)(xorshift64(&s) % 6); /* one of 6 shared documents */
		uint32_t shared = 16 * (uint32_t)(xorshift64(&s) % 20);
		uint32_t own = 1 + (uint32_t)(xorshift64(&s) % 100);
		for (uint32_t k = 0; k < shared; k++)
			tok[k] = prefix * 100000 + k;
		for (uint32_t k = 0; k < own; k++)
			tok[shared + k] = 1u << 30 | (uint32_t)i << 8 | k;
		struct sim_request q =
		    req(i, tok, shared + own, 1 + (uint32_t)(xorshift64(&s) % 40));
		cr_assert_eq(sim_cluster_run_until(c, t), 0);
		cr_assert_eq(sim_cluster_submit(c, (uint32_t)(xorshift64(&s) % 4), &q), 0);
	}
	cr_assert_eq(sim_cluster_drain(c), 0);
	uint64_t preempt = 0, fin = 0;
	for (uint32_t k = 0; k < 4; k++) {
		struct sim_engine_stats st;
		sim_cluster_stats(c, k, &st);
		cr_assert_eq(st.free_blocks, 96);
		cr_assert_eq(st.submitted, st.finished);
		cr_assert_leq(st.hit_blocks, st.prompt_blocks);
		preempt += st.preemptions;
		fin += st.finished;
	}
	cr_assert_eq(fin, (uint64_t)n);
	cr_assert_gt(preempt, 0, "the workload must exercise preemption");
	sim_cluster_destroy(c);
	return r->digest;
}

Test(sim_engine, deterministic_under_seed)
{
	static struct rec r1, r2;
	int64_t live = kvr_alloc_live_bytes();
	uint64_t a = workload(1, &r1), b = workload(1, &r2), d = workload(2, &r2);
	cr_assert_eq(a, b, "same seed, same outputs");
	cr_assert_neq(a, d, "a different workload must change the digest");
	cr_assert_eq(kvr_alloc_live_bytes(), live, "no leak");
}
