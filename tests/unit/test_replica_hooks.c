/* core/replica_hooks: a router's notes, applied to a second router through kvr_repl_admit and
 * the public calls (with kvr_repl_applying set), make the second router's predicted caches and
 * loads equal the first's; notes are not re-emitted while applying; detach stops the notes.
 * And the replica core (sync/replica*.c) over an in-process bus: output reported through
 * kvr_request_output_ex reaches peers with its finality, on the stream and in snapshots. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/limits.h"
#include "core/replica_hooks.h"
#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h"
#include "sync/replica_msg.h"
#include "tests/common/oom_loop.h"
#include "tests/unit/replica_bus.h"

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

static void on_progress(void *ctx, uint64_t attempt, int op, const uint32_t *t, size_t n,
                        bool not_final)
{
	struct mirror *m = ctx;
	m->notes++;
	uint64_t b = map(m, attempt);
	cr_assert_neq(b, 0);
	kvr_repl_applying = true;
	int rc = op == KVR_OP_PREFILL_DONE ? kvr_request_prefill_done(m->dst, b)
	         : op == KVR_OP_OUTPUT
	             ? kvr_request_output_ex(m->dst, b, t, n, not_final ? 0 : KVR_OUTPUT_FINAL)
	         : op == KVR_OP_FINISH ? kvr_request_finish(m->dst, b)
	                               : kvr_request_abort(m->dst, b);
	kvr_repl_applying = false;
	cr_assert_eq(rc, 0);
}

static void on_rank(void *ctx, int op, struct kvr_rank_id rank, uint64_t inc, uint64_t cap,
                    uint32_t mbt, struct kvr_rank_life life)
{
	(void)life;
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

/* One lifecycle call on r's attempt: output (plain, not final or final, by how), or its end
 * (finish when how == 3, else abort). */
static void step(struct kvr_router *r, uint64_t attempt, bool output, int how, const uint32_t *out,
                 size_t n)
{
	if (output)
		cr_assert_eq(how == 0 ? kvr_request_output(r, attempt, out, n)
		                      : kvr_request_output_ex(r, attempt, out, n,
		                                              how == 1 ? 0 : KVR_OUTPUT_FINAL),
		             0);
	else
		cr_assert_eq(
		    how == 3 ? kvr_request_finish(r, attempt) : kvr_request_abort(r, attempt), 0);
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
				size_t n = 1 + (size_t)(rand() % 40);
				/* plain, not final, final */
				step(a, live[k], true, rand() % 3, out, n);
			} else if (what == 1) {
				cr_assert_eq(kvr_request_prefill_done(a, live[k]), 0);
			} else {
				step(a, live[k], false, what == 2 ? 3 : 0, NULL, 0);
				live[k] = 0;
			}
			continue;
		}
		size_t n = 40 + (size_t)(rand() % 500);
		uint32_t fam = (uint32_t)(rand() % 12);
		for (size_t j = 0; j < n; j++)
			t[j] = j < 300 ? fam * 100000u + (uint32_t)j : (uint32_t)rand();
		live[k] = route(a, t, n).attempt;
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

/* ------------------------------------------------------------------------------------------
 * The replica core (sync/replica.c) over the in-process bus (replica_bus.h): what
 * kvr_request_output_ex said about the last output token (final or not) reaches the peers, on the
 * stream and in a snapshot, so their predicted caches equal the origin's. */

Test(replica_hooks, output_not_final_replicates, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	/* Prompt 2B + 5, then B - 5 output tokens, the last known not to be final: the origin
	 * counts the third block at once (one step behind, it would wait for a later token). */
	const uint32_t B = KVR_DEFAULT_BLOCK_SIZE;
	struct kvr_decision d1 = bus_route(r[0], 1, 2 * B + 5);
	struct kvr_rank_id rk1 = d1.rank;
	bus_quiet(r, 2);
	size_t before = n_blocks(r[0], rk1);
	uint32_t out[64];
	for (uint32_t j = 0; j < 64; j++)
		out[j] = 777000u + j;
	cr_assert_eq(kvr_request_output_ex(r[0], d1.attempt, out, B - 5, 0), 0);
	/* A second request whose not-final token opens a block (3B + 1 tokens, 3 complete) */
	struct kvr_decision d2 = bus_route(r[0], 2, 3 * B - 4);
	cr_assert_eq(kvr_request_output_ex(r[0], d2.attempt, out, 5, 0), 0);
	bus_quiet(r, 2);
	cr_assert_eq(n_blocks(r[0], rk1), before + 1, "the origin counts the not-final token");
	all_agree(r, 2, "stream, not final");
	/* A third replica joins: it learns the attempts from a snapshot, output flag included. */
	r[2] = bus_router(2);
	bus_quiet(r, 3);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(bus.rep[2], &st);
	cr_assert_eq(st.snapshots_applied, 1);
	all_agree(r, 3, "snapshot, not final");
	/* A final token after them: held back and dropped at finish everywhere. */
	cr_assert_eq(kvr_request_output_ex(r[0], d1.attempt, out + 10, B, KVR_OUTPUT_FINAL), 0);
	cr_assert_eq(kvr_request_output(r[0], d2.attempt, out + 20, 2 * B - 1), 0);
	bus_quiet(r, 3);
	all_agree(r, 3, "stream, final");
	cr_assert_eq(kvr_request_finish(r[0], d1.attempt), 0);
	cr_assert_eq(kvr_request_finish(r[0], d2.attempt), 0);
	bus_quiet(r, 3);
	all_agree(r, 3, "finished");
	bus_teardown(r, BUS_N);
}

/* Own attempts whose end reaches the sender before their admission (a posted booking dropped
 * for memory is told as an expiry at once, a rank's end as KVR_OP_RANK_ENDED: both on the shard
 * thread, sync/replica_early.c): 200 of them pending at once,
 * the admissions noted afterwards in reverse order.  None may be published, or the peer mirrors
 * it for good: with the former 64-entry ring 136 stayed live on the peer.  A control attempt
 * noted in order is mirrored, then released by its end. */
static void early_note(struct kvr_replica *rep, uint64_t attempt, const uint64_t *local)
{
	struct kvr_repl_admission a = {
	    .rank = {0, 0},
	    .incarnation = 7,
	    .attempt = attempt,
	    .local = local,
	    .n = 2,
	    .prompt_tokens = 2 * KVR_DEFAULT_BLOCK_SIZE,
	    .expected_output = 64,
	    .chain_known = false,
	};
	kvr_rep_note_admit(rep, &a);
}

static uint64_t peer_requests(struct kvr_router *r)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){0, 0}, &s), 0);
	return s.active_requests;
}

Test(replica_hooks, early_ends_overflow, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 2);
	enum { N = 200 };
	const uint64_t base = 1ull << 40;
	uint64_t local[2] = {0x1234, 0x5678};
	for (uint64_t i = 0; i < N; i++)
		kvr_rep_note_progress(bus.rep[0], base + i,
		                      i % 2 ? KVR_OP_EXPIRED : KVR_OP_RANK_ENDED, NULL, 0, false);
	early_note(bus.rep[0], base + N, local); /* the control */
	for (uint64_t i = N; i-- > 0;)
		early_note(bus.rep[0], base + i, local);
	bus_quiet(r, 2);
	pthread_mutex_lock(&bus.rep[0]->mu);
	uint32_t left = bus.rep[0]->early_n;
	uint64_t lost = bus.rep[0]->st.early_lost;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert_eq(left, 0, "every early end matched its admission: %u left", left);
	cr_assert_eq(lost, 0);
	cr_assert_eq(peer_requests(r[1]), 1, "only the control is mirrored: %lu",
	             (unsigned long)peer_requests(r[1]));
	kvr_rep_note_progress(bus.rep[0], base + N, KVR_OP_ABORT, NULL, 0, false);
	bus_quiet(r, 2);
	cr_assert_eq(peer_requests(r[1]), 0);
	bus_teardown(r, 2);
}

/* Attempts routed before the replica attached were never noted (peers never saw them), so their
 * ends find no record on the sender.  They were kept in the early set as if their admission
 * were still to come, for 60 s each (a review's probe: 500 entries): a caller's finish or abort
 * comes after its admission's note, never before, so with no record it is dropped.  An attempt
 * routed after the attach is mirrored and released as ever. */
Test(replica_hooks, ends_of_attempts_admitted_before_attach_are_not_kept, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[1] = bus_router(1);
	r[0] = bus_ranks_router();
	enum { N = 200 };
	static uint64_t pre[N];
	static uint32_t t[64];
	for (uint32_t i = 0; i < N; i++) {
		for (uint32_t k = 0; k < 64; k++)
			t[k] = i * 64 + k;
		pre[i] = route(r[0], t, 64).attempt;
	}
	bus_attach(0, r[0]);
	for (uint32_t k = 0; k < 64; k++)
		t[k] = 900000 + k;
	uint64_t post = route(r[0], t, 64).attempt;
	for (uint32_t i = 0; i < N; i++)
		cr_assert_eq(
		    i % 2 ? kvr_request_abort(r[0], pre[i]) : kvr_request_finish(r[0], pre[i]), 0);
	bus_quiet(r, 2);
	pthread_mutex_lock(&bus.rep[0]->mu);
	uint32_t left = bus.rep[0]->early_n;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert_eq(left, 0, "ends of attempts admitted before attach kept: %u", left);
	cr_assert_eq(bus_active_requests(r[1]), 1, "the one routed after attach is mirrored");
	cr_assert_eq(kvr_request_finish(r[0], post), 0);
	bus_quiet(r, 2);
	cr_assert_eq(bus_active_requests(r[1]), 0);
	pthread_mutex_lock(&bus.rep[0]->mu);
	left = bus.rep[0]->early_n;
	pthread_mutex_unlock(&bus.rep[0]->mu);
	cr_assert_eq(left, 0);
	bus_teardown(r, 2);
}

/* The early-end set itself (sync/replica_early.c), on a bare replica struct: it grows past
 * its first 63 instead of overwriting, and shrinks back once emptied; leftovers older than 60 s
 * go when it would grow; full and out of memory, it gives up the oldest, counted; every entry
 * kept is found once. */
Test(replica_hooks, early_set_bounds)
{
	struct kvr_replica *rep = calloc(1, sizeof(*rep));
	pthread_mutex_init(&rep->mu, NULL);
	pthread_mutex_init(&rep->qmu, NULL);
	cr_assert_eq(kvr_rep_early_init(rep), 0);
	uint32_t cap0 = rep->early_cap;
	const uint64_t t0 = 1000000000000ull;
	for (uint64_t a = 1; a <= 1000; a++)
		kvr_rep_early_add(rep, a * 8 + 3, t0 + a);
	cr_assert_eq(rep->early_n, 1000);
	cr_assert_eq(rep->st.early_lost, 0);
	cr_assert_gt(rep->early_cap, cap0);
	for (uint64_t a = 1000; a >= 1; a--)
		cr_assert(kvr_rep_early_take(rep, a * 8 + 3), "entry %lu", (unsigned long)a);
	cr_assert_eq(rep->early_n, 0);
	cr_assert_eq(rep->early_cap, cap0, "emptied, it gives back what it grew: %u slots",
	             rep->early_cap);
	cr_assert(!kvr_rep_early_take(rep, 11));
	/* Leftovers 61 s old are pruned rather than grown over. */
	uint32_t cap = rep->early_cap;
	for (uint64_t a = 1; a <= cap / 2; a++) /* half full: the next one would grow it */
		kvr_rep_early_add(rep, a, t0);
	kvr_rep_early_add(rep, 99999, t0 + 61000000000ull);
	cr_assert_eq(rep->early_cap, cap);
	cr_assert_eq(rep->early_n, 1);
	cr_assert(kvr_rep_early_take(rep, 99999));
	/* Young entries, no memory: it fills to cap - 1, then gives up the oldest. */
	for (uint64_t a = 1; a < cap; a++) {
		kvr_alloc_fail_after(1);
		kvr_rep_early_add(rep, a, t0 + a);
	}
	kvr_alloc_fail_after(0);
	cr_assert_eq(rep->early_cap, cap);
	cr_assert_eq(rep->early_n, cap - 1);
	cr_assert_eq(rep->st.early_lost, 0);
	kvr_alloc_fail_after(1);
	kvr_rep_early_add(rep, cap, t0 + cap);
	kvr_alloc_fail_after(0);
	cr_assert_eq(rep->st.early_lost, 1);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.early_lost, 1, "exported in kvr_sync_stats");
	cr_assert(!kvr_rep_early_take(rep, 1), "the oldest was given up");
	for (uint64_t a = 2; a <= cap; a++)
		cr_assert(kvr_rep_early_take(rep, a), "entry %lu", (unsigned long)a);
	cr_assert_eq(rep->early_n, 0);
	kvr_rep_early_fini(rep);
	pthread_mutex_destroy(&rep->mu);
	pthread_mutex_destroy(&rep->qmu);
	free(rep);
}

/* early_lost on a running replica: kvr_sync_stats.early_lost and
 * kvr_sync_events_total{what="early_end_lost"} count the ends given up (the set full of young
 * entries, no memory to grow).  The sender is held off by mu while the set fills; another
 * thread may take an armed failure (the set then grows and the filling goes on). */
Test(replica_hooks, early_lost_exported, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	bus_start(r, 1);
	const char *key = "kvr_sync_events_total{what=\"early_end_lost\"} ";
	cr_assert_eq(metric(r[0], key), 0);
	struct kvr_replica *rep = bus.rep[0];
	const uint64_t t0 = kvr_rep_mono_ns();
	pthread_mutex_lock(&rep->mu);
	for (uint64_t a = 1ull << 41; rep->st.early_lost < 3 && a < (1ull << 41) + 100000; a++) {
		kvr_alloc_fail_after(1);
		kvr_rep_early_add(rep, a, t0);
		kvr_alloc_fail_after(0);
	}
	uint64_t lost = rep->st.early_lost;
	pthread_mutex_unlock(&rep->mu);
	cr_assert_eq(lost, 3);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.early_lost, 3);
	cr_assert_eq(metric(r[0], key), 3);
	bus_teardown(r, 1);
}

/* kvr_replica_create under allocation failure (sync/replica.c, sync/replica_out.c,
 * sync/replica_early.c): the Nth allocation fails for N = 1, 2, ... until it succeeds; each
 * failure returns KVR_ENOMEM, leaves *out NULL and every byte given back. */
struct create_ctx {
	struct kvr_router *r;
	struct kvr_replica_config c;
	struct kvr_replica_transport t;
	struct kvr_replica *rep;
};

static int create_call(void *p)
{
	struct create_ctx *x = p;
	x->rep = (struct kvr_replica *)x; /* not NULL: a failure must set it */
	return kvr_replica_create(x->r, &x->c, &x->t, &x->rep);
}

static void create_check(void *p, uint64_t nth)
{
	cr_assert_null(((struct create_ctx *)p)->rep, "nth %lu", (unsigned long)nth);
}

Test(replica_hooks, create_out_of_memory)
{
	struct create_ctx x = {
	    .r = make(),
	    .c = {.replica_id = 1, .heartbeat_ms = 50, .dead_after = 10},
	    .t = {.ctx = &port[0], .publish = bus_publish},
	};
	int64_t live0 = kvr_alloc_live_bytes();
	uint64_t failed;
	cr_assert_eq(kvr_oom_loop(create_call, create_check, &x, &failed), 0);
	kvr_replica_destroy(x.rep);
	cr_assert_eq(kvr_alloc_live_bytes(), live0);
	cr_assert_geq(failed, 4, "the record, the ring, the slabs, the early set: %lu",
	              (unsigned long)failed);
	kvr_router_destroy(x.r);
}

/* The wire: OUTPUT's flags word (bit0 not final) and ATTEMPT's bit3 (out counted). */
static int output_msg(uint32_t n, uint32_t flags, struct kvr_wmsg *m)
{
	static struct kvr_msg_buf b;
	b.len = 0;
	size_t off = kvr_msg_begin(&b, KVR_MSG_OUTPUT, 3, 4, 5);
	kvr_msg_put_u64(&b, 9);
	kvr_msg_put_u32(&b, n);
	kvr_msg_put_u32(&b, flags);
	for (uint32_t i = 0; i < n; i++)
		kvr_msg_put_u32(&b, 100 + i);
	kvr_msg_end(&b, off);
	cr_assert(!b.oom);
	return kvr_msg_decode(b.p, b.len, m);
}

static int attempt_msg(uint32_t n_out, uint32_t flags, struct kvr_wmsg *m)
{
	static struct kvr_msg_buf b;
	b.len = 0;
	size_t off = kvr_msg_begin(&b, KVR_MSG_ATTEMPT, 3, 4, 0);
	kvr_msg_put_u64(&b, 1); /* worker */
	kvr_msg_put_u32(&b, 0); /* dp rank */
	kvr_msg_put_u32(&b, flags);
	kvr_msg_put_u64(&b, 7);  /* incarnation */
	kvr_msg_put_u64(&b, 9);  /* attempt */
	kvr_msg_put_u64(&b, 32); /* prompt tokens */
	kvr_msg_put_u64(&b, 0);  /* lora */
	kvr_msg_put_u32(&b, 0);  /* overlap */
	kvr_msg_put_u32(&b, 64); /* expected output */
	kvr_msg_put_u32(&b, 2);  /* blocks */
	kvr_msg_put_u32(&b, 0);  /* tail */
	kvr_msg_put_u32(&b, n_out);
	kvr_msg_put_u32(&b, 0);
	kvr_msg_put_u64(&b, 11);
	kvr_msg_put_u64(&b, 12);
	for (uint32_t i = 0; i < n_out; i++)
		kvr_msg_put_u32(&b, 100 + i);
	kvr_msg_end(&b, off);
	cr_assert(!b.oom);
	return kvr_msg_decode(b.p, b.len, m);
}

Test(replica_hooks, wire_output_finality)
{
	struct kvr_wmsg m;
	cr_assert_eq(output_msg(3, 0, &m), 0);
	cr_assert_eq(m.flags, 0);
	cr_assert_eq(output_msg(3, KVR_MSG_OUT_NOT_FINAL, &m), 0);
	cr_assert_eq(m.flags, KVR_MSG_OUT_NOT_FINAL);
	cr_assert_eq(m.n_out, 3);
	cr_assert_eq(output_msg(3, 2, &m), KVR_EINVAL);                     /* unknown flag */
	cr_assert_eq(output_msg(0, KVR_MSG_OUT_NOT_FINAL, &m), KVR_EINVAL); /* no token */
	cr_assert_eq(attempt_msg(4, KVR_MSG_F_CHAIN_KNOWN | KVR_MSG_F_OUT_COUNTED, &m), 0);
	cr_assert_eq(m.flags & KVR_MSG_F_OUT_COUNTED, KVR_MSG_F_OUT_COUNTED);
	cr_assert_eq(attempt_msg(0, KVR_MSG_F_CHAIN_KNOWN | KVR_MSG_F_OUT_COUNTED, &m), KVR_EINVAL);
	cr_assert_eq(attempt_msg(4, 16, &m), KVR_EINVAL);
}

static uint64_t index_write_errors(struct kvr_router *r)
{
	return metric(r, "kvr_shard_errors_total{what=\"index_write\"} ");
}

/* The index equals the predicted cache whatever the order of admissions, outputs and ends on a
 * rank: prompts and outputs of a few families share blocks (an output block is the next prompt
 * block of its family), so admissions hit other leases' copies, outputs duplicate resident
 * blocks, and a small capacity evicts between them.  A failed index write
 * (kvr_shard_errors_total{what="index_write"}) leaves the predicted cache with blocks the
 * index lacks: resident_blocks != indexed_blocks. */
Test(replica_hooks, index_follows_predicted_cache_any_order)
{
	for (unsigned seed = 1; seed <= 24; seed++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.sync_booking = seed & 1;
		c.block_size = 4;
		struct kvr_router *r;
		cr_assert_eq(kvr_router_create(&c, &r), 0);
		struct kvr_rank_id rk = {0, 0};
		cr_assert_eq(kvr_rank_add(r, rk, 1, 6 + seed % 30, 4096), 0);
		srand(seed);
		uint64_t live[8] = {0};
		uint32_t pos[8] = {0}, fam[8] = {0};
		uint32_t t[64];
		for (int i = 0; i < 3000; i++) {
			int k = rand() % 8;
			if (live[k]) {
				int what = rand() % 5;
				if (what < 3) {
					uint32_t out[12];
					size_t n = 1 + (size_t)(rand() % 12);
					for (size_t j = 0; j < n; j++)
						out[j] = fam[k] * 1000u + pos[k] + (uint32_t)j;
					pos[k] += (uint32_t)n;
					step(r, live[k], true, rand() % 3, out, n);
				} else {
					step(r, live[k], false, what, NULL, 0);
					live[k] = 0;
				}
				continue;
			}
			size_t n = 1 + (size_t)(rand() % 40);
			fam[k] = (uint32_t)(rand() % 2);
			for (size_t j = 0; j < n; j++)
				t[j] = fam[k] * 1000u + (uint32_t)j;
			pos[k] = (uint32_t)n;
			live[k] = route(r, t, n).attempt;
		}
		cr_assert_eq(kvr_router_sync(r, 5000), 0);
		struct kvr_rank_stats s;
		cr_assert_eq(kvr_rank_get_stats(r, rk, &s), 0);
		cr_assert_eq(index_write_errors(r), 0, "seed %u", seed);
		cr_assert_eq(s.resident_blocks, s.indexed_blocks,
		             "seed %u: predicted %lu, indexed %lu", seed,
		             (unsigned long)s.resident_blocks, (unsigned long)s.indexed_blocks);
		kvr_router_destroy(r);
	}
}

/* An index write that ran out of memory leaves the predicted cache with blocks the index lacks;
 * the next admission extending that chain finds its parent missing from the index and stores
 * the whole prompt from the root instead, which puts the index back in step.  That retry once
 * re-read the shard's scratch below the new blocks without writing it: the blocks of whatever
 * prompt was stored before (here x), so the index got x's chain with the new block under it
 * instead of the prompt's. */
Test(replica_hooks, failed_index_write_healed_by_the_extension)
{
	bool seen = false;
	for (uint64_t nth = 1; nth < 400 && !seen; nth++) {
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_shards = 1;
		c.sync_booking = true;
		c.block_size = 4;
		struct kvr_router *r;
		cr_assert_eq(kvr_router_create(&c, &r), 0);
		struct kvr_rank_id rk = {0, 0};
		cr_assert_eq(kvr_rank_add(r, rk, 1, 1000, 4096), 0);
		uint32_t a[16], x[16];
		for (uint32_t j = 0; j < 16; j++) {
			a[j] = 100 + j;
			x[j] = 900 + j;
		}
		kvr_alloc_fail_after(nth);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = a;
		q.n_tokens = 8; /* blocks a0 a1 */
		struct kvr_decision d;
		int rc = kvr_route(r, &q, &d);
		/* The booking is posted (the shard keeps room to track it): applied under the
		 * same countdown. */
		(void)kvr_router_sync(r, 5000);
		kvr_alloc_fail_after(0);
		struct kvr_rank_stats s;
		cr_assert_eq(kvr_router_sync(r, 5000), 0);
		cr_assert_eq(kvr_rank_get_stats(r, rk, &s), 0);
		if (rc == 0 && d.status == KVR_DECIDED && index_write_errors(r) == 1 &&
		    s.resident_blocks == 2 && s.indexed_blocks < 2) {
			seen = true;
			cr_assert_eq(route(r, x, 12).status, KVR_DECIDED); /* x0 x1 x2 */
			cr_assert_eq(route(r, a, 12).status, KVR_DECIDED); /* a0 a1 + a2 */
			cr_assert_eq(kvr_router_sync(r, 5000), 0);
			cr_assert_eq(kvr_rank_get_stats(r, rk, &s), 0);
			cr_assert_eq(index_write_errors(r), 1, "nth %lu", (unsigned long)nth);
			cr_assert_eq(s.resident_blocks, 6);
			cr_assert_eq(s.indexed_blocks, 6, "nth %lu: indexed %lu",
			             (unsigned long)nth, (unsigned long)s.indexed_blocks);
			static uint64_t h[64], want[6];
			size_t nh = 0;
			cr_assert_eq(kvr_rank_blocks(r, rk, h, 64, &nh), 0);
			cr_assert_eq(kvr_hash_blocks(a, 12, 4, NULL, NULL, want), 3);
			cr_assert_eq(kvr_hash_blocks(x, 12, 4, NULL, NULL, want + 3), 3);
			qsort(h, nh, 8, cmp);
			qsort(want, 6, 8, cmp);
			cr_assert_eq(nh, 6);
			cr_assert_eq(memcmp(h, want, sizeof(want)), 0);
		}
		kvr_router_destroy(r);
	}
	cr_assert(seen, "no allocation failure left the index short of the predicted cache");
}

/* A peer's silence bound, dead_after x heartbeat_ms in ns, overflowed 64 bits for allowed
 * settings (heartbeat_ms 1..60000, dead_after >= 2): 3,782,740,474 periods of 43,889 ms wrapped
 * to 35 us, so every peer was given up (its attempts released here) after 35 us of silence; a
 * huge dead_after is how a caller says "never".  The replica is not started: this thread plays
 * its apply thread and judges at a time it chooses (kvr_rep_heartbeat). */
Test(replica_hooks, silence_bound_does_not_wrap)
{
	struct kvr_router *r = make();
	struct kvr_replica_config c = {
	    .replica_id = 1, .heartbeat_ms = 43889, .dead_after = 3782740474u};
	struct kvr_replica_transport t = {.ctx = &port[0], .publish = bus_publish};
	struct kvr_replica *rep;
	cr_assert_eq(kvr_replica_create(r, &c, &t, &rep), 0);
	struct kvr_msg_buf b = {0};
	size_t off = kvr_msg_begin(&b, KVR_MSG_HEARTBEAT, 2, 1, 0);
	kvr_msg_put_u64(&b, 0); /* its live attempts */
	kvr_msg_end(&b, off);
	cr_assert(!b.oom);
	kvr_rep_handle(rep, b.p, b.len, NULL);
	struct kvr_sync_stats st;
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.peers_alive, 1, "the heartbeat made peer 2 known");
	kvr_rep_heartbeat(rep, kvr_rep_mono_ns() + 1000000000ull, 0); /* 1 s of silence */
	kvr_replica_get_stats(rep, &st);
	cr_assert_eq(st.peers_alive, 1, "given up after 1 s of a bound of 5 million years");
	kvr_msg_buf_fini(&b);
	kvr_replica_stop(rep);
	kvr_replica_destroy(rep);
	kvr_router_destroy(r);
}

/* The journal's default budget, twice the rank's capacity, wrapped for a capacity of 2^63 or
 * more (a registration in bytes, or "as much as it has" short of KVR_CAPACITY_NONE) to 0 or a
 * few blocks: the journal kept one finished attempt, and snapshots lost the rest. */
Test(replica_hooks, journal_budget_does_not_wrap, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[0] = bus_router(0);
	struct kvr_rank_id id = {5, 0};
	cr_assert_eq(kvr_rank_add(r[0], id, 1, 1ull << 63, 4096), 0);
	uint32_t t[64];
	for (int k = 0; k < 3; k++) {
		for (int i = 0; i < 64; i++)
			t[i] = (uint32_t)(k * 1000 + i);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = t;
		q.n_tokens = 64;
		q.pinned = &id;
		struct kvr_decision d;
		cr_assert_eq(kvr_route(r[0], &q, &d), 0);
		cr_assert_eq(kvr_request_finish(r[0], d.attempt), 0);
	}
	bus_quiet(r, 1);
	struct kvr_replica *rep = bus.rep[0];
	pthread_mutex_lock(&rep->mu);
	struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
	int n = 0;
	for (struct kvr_rep_rec *x = e ? e->jhead : NULL; x; x = x->next)
		n++;
	pthread_mutex_unlock(&rep->mu);
	cr_assert_eq(n, 3, "the journal keeps %d of 3 finished attempts", n);
	bus_teardown(r, 1);
}

static uint64_t active_on_rank(struct kvr_router *r, struct kvr_rank_id rk)
{
	struct kvr_rank_stats s;
	cr_assert_eq(kvr_rank_get_stats(r, rk, &s), 0);
	return s.active_requests;
}

static int route_seeded(struct kvr_router *r, uint32_t seed, size_t n, struct kvr_decision *d)
{
	static uint32_t t[4096];
	cr_assert(n <= 4096);
	for (size_t j = 0; j < n; j++)
		t[j] = seed * 1000003u + (uint32_t)j;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = n;
	q.expected_output_tokens = 64;
	return kvr_route(r, &q, d);
}

/* Two replicas on the bus; r[0] queues (sync_booking, threshold 1.0, on_admit as given) and
 * holds only rank a, which d0 (2000 prefill tokens > 1.0 x 1000) saturates, so d1 queues. */
static void one_queued(struct kvr_router **r,
                       void (*on_admit)(void *, uint64_t, const struct kvr_decision *),
                       struct kvr_decision *d0, struct kvr_decision *d1)
{
	memset(&bus.rep, 0, sizeof(bus.rep));
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	c.queue_threshold = 1.0;
	c.on_admit = on_admit;
	cr_assert_eq(kvr_router_create(&c, &r[0]), 0);
	const struct kvr_rank_id a = {0, 0};
	cr_assert_eq(kvr_rank_add(r[0], a, 7, 100000, 1000), 0);
	bus_attach(0, r[0]);
	r[1] = make();
	bus_attach(1, r[1]);
	bus_quiet(r, 2);
	cr_assert_eq(route_seeded(r[0], 1, 2000, d0), 0);
	cr_assert_eq(d0->status, KVR_DECIDED);
	cr_assert_eq(route_seeded(r[0], 2, 64, d1), 0);
	cr_assert_eq(d1->status, KVR_QUEUED, "status %d", (int)d1->status);
	bus_quiet(r, 2);
	cr_assert_eq(active_on_rank(r[1], a), 1, "the first request is mirrored (control)");
}

/* An own queued request admitted by a queue pass that a peer's change runs on the replica's
 * apply thread (kvr_rank_add pumps the queue: core/ranks.c; so do a mirror's finish and abort
 * with sync_booking) is published like any other: the pass routes this router's own requests,
 * and kvr_repl_applying, set on that thread for the peer's change, made kvr_route decide not to
 * note them; no peer carried that load (the review's probe: 0 active on the peer, 1 on the
 * origin). */
Test(replica_hooks, a_queued_request_admitted_by_a_peers_rank_add_is_mirrored, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	struct kvr_decision d0, d1;
	one_queued(r, NULL, &d0, &d1);
	const struct kvr_rank_id b = {1, 0};
	/* The peer adds rank b; r[0]'s apply thread adds it there and pumps the queue. */
	cr_assert_eq(kvr_rank_add(r[1], b, 7, 100000, 1000), 0);
	bus_quiet(r, 2);
	/* Admitted already, before any call of this thread's could pump: by r[0]'s apply thread. */
	cr_assert_eq(active_on_rank(r[0], b), 1, "admitted on rank b by the apply thread's pass");
	struct kvr_decision w;
	cr_assert_eq(kvr_route_wait(r[0], d1.ticket, 0, &w), 0);
	cr_assert_eq(w.status, KVR_DECIDED);
	bus_quiet(r, 2);
	cr_assert_eq(active_on_rank(r[0], b), 1, "admitted on rank b");
	uint64_t m = active_on_rank(r[1], b);
	cr_assert_eq(m, 1,
	             "an own attempt admitted by a queue pass run on the apply thread (a peer's "
	             "rank add) is not mirrored on the peer: %lu active there, 1 on the origin",
	             (unsigned long)m);
	cr_assert_eq(kvr_request_finish(r[0], w.attempt), 0);
	cr_assert_eq(kvr_request_finish(r[0], d0.attempt), 0);
	bus_quiet(r, 2);
	bus_teardown(r, 2);
}

/* The review's probe: on_admit runs inside the pass, so a pass run on the
 * replica's apply thread (a peer's rank add) runs the user's callback there.  The user's own
 * calls in it are the user's, not the peer's: a finish made in on_admit is published like any
 * other, and the peer's mirror of the attempt it ends goes.  Also the admission on_admit is
 * told of is mirrored, and is published before that callback's calls. */
static struct {
	struct kvr_router *r;
	uint64_t finish_in_callback;
	uint64_t admitted;
	int rc;
	int calls;
} probe_cb;

static void probe_on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	(void)ticket;
	probe_cb.calls++;
	probe_cb.admitted = d->status == KVR_DECIDED ? d->attempt : 0;
	probe_cb.rc = kvr_request_finish(probe_cb.r, probe_cb.finish_in_callback);
}

Test(replica_hooks, on_admit_on_the_apply_thread_publishes_the_users_calls, .timeout = 60)
{
	struct kvr_router *r[BUS_N];
	memset(&probe_cb, 0, sizeof(probe_cb));
	struct kvr_decision d0, d1;
	one_queued(r, probe_on_admit, &d0, &d1);
	probe_cb.r = r[0];
	const struct kvr_rank_id a = {0, 0}, b = {1, 0};
	probe_cb.finish_in_callback = d0.attempt; /* the user ends the first one in on_admit */
	cr_assert_eq(kvr_rank_add(r[1], b, 7, 100000, 1000), 0);
	bus_quiet(r, 2);
	cr_assert_eq(probe_cb.calls, 1, "on_admit ran %d times", probe_cb.calls);
	cr_assert_neq(probe_cb.admitted, 0);
	cr_assert_eq(probe_cb.rc, 0, "the finish in on_admit: %d", probe_cb.rc);
	cr_assert_eq(active_on_rank(r[0], a), 0);
	bus_quiet(r, 2);
	uint64_t left = active_on_rank(r[1], a);
	cr_assert_eq(left, 0,
	             "a finish the user made in on_admit, run on the apply thread, is not "
	             "published: the peer still mirrors %lu on rank a",
	             (unsigned long)left);
	cr_assert_eq(active_on_rank(r[1], b), 1, "the admission on_admit was told of is mirrored");
	cr_assert_eq(kvr_request_finish(r[0], probe_cb.admitted), 0);
	bus_quiet(r, 2);
	cr_assert_eq(active_on_rank(r[1], b), 0);
	bus_teardown(r, 2);
}
