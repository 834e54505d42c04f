/*
 * tests/fuzz/oom_api.c - the public API under allocation failure: random call sequences while
 * the allocator seam (core/alloc.h, kvr_alloc_fail_after) fails an allocation every few calls.
 *
 *   oom_api [--first S] [--seeds N] [--ops K] [--threads T]
 *                                       (a failure prints its seed; --first S --seeds 1
 *                                        replays it alone; --threads 2 or 3: the threaded
 *                                        mode of tests/fuzz/oom_api_threads.c)
 *
 * The SQLite-style loops of the unit tests fail the Nth allocation of one scripted sequence;
 * fuzz_api.c checks the whole API against a model but never runs out of memory.  This program
 * is the product of the two: each seed chooses a configuration (mode, block size, shards,
 * synchronous or posted booking, the queue on or off) and a sequence of rank commands, routes,
 * lifecycle calls, KV events, syncs, stats, metrics and clock steps, and arms a failure a few
 * allocations ahead before about a third of the calls, half of them persistent (every later
 * allocation fails too until disarmed, after the call or later).  An armed failure that the
 * call does not use stays armed, so it also lands in the shard threads' work (bookings, index
 * writes, output blocks, evictions) at whatever point they reach it.
 *
 * What it checks, from kvrouter.h:
 *  - every return code is one the header documents for that call; KVR_ENOMEM only where it is
 *    documented (reset, remove, finish, abort, prefill_done, stats, sync never need memory);
 *  - every failing call leaves its detail in kvr_last_error() ("<function>: ...", KVR_ENOMEM's
 *    too), every succeeding one leaves it as it was (API(); fuzz_api.h, fuzz_err_verdict);
 *  - "nothing was changed" on KVR_ENOMEM: a failed rank_add leaves no rank, a failed
 *    set_capacity leaves incarnation and capacity as they were, a failed create leaks nothing;
 *  - an attempt kvr_route admitted is live until its end: finish or abort is 0 unless its rank
 *    was removed, reset or given a new incarnation (the lease interval is never reached);
 *  - once the failures stop and every attempt has ended: every rank's load is zero (requests,
 *    prefill tokens, pinned blocks), a capacity-bounded LRU rank holds at most its capacity,
 *    the router still routes, and after destroy the allocation counter is back where it was.
 * It does not predict which rank a decision picks nor what a shard-side failure drops from the
 * predicted caches (the healing tests cover that); only that nothing leaks and nothing crashes.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "fuzz_api.h"
#include "kvrouter.h"
#include "oom_api_threads.h"
#include "tests/common/fresh_thread.h"
#include "tests/common/splitmix.h"

#define N_RANKS       4
#define MAX_ATT       256
#define MAX_TIX       32
#define MAX_TOK       600
#define MAX_EV_BLOCKS 128

static uint64_t cur_seed;
static char cur_detail[160]; /* what the trace prints after the call */
static const char *cur_call = "";
static int cur_op;

#define FAIL(...)                                                                                  \
	do {                                                                                       \
		fprintf(stderr, "oom_api: seed %" PRIu64 " op %d (%s): ", cur_seed, cur_op,        \
		        cur_call);                                                                 \
		fprintf(stderr, __VA_ARGS__);                                                      \
		fprintf(stderr, " [%s]\n", cur_detail);                                            \
		abort();                                                                           \
	} while (0)
#define CHECK(c, ...)                                                                              \
	do {                                                                                       \
		if (!(c))                                                                          \
			FAIL(__VA_ARGS__);                                                         \
	} while (0)

/* Every int-returning call of the API goes through API(fn, args...): it returns fn(args...),
 * after checking what the call left in kvr_last_error() (fuzz_api.h, fuzz_err_verdict): a
 * KVR_ENOMEM carries its detail too, and each thread reads only its own. */
static int api_checked(const char *fn, int rc)
{
	const char *why = fuzz_err_verdict(fn, NULL, rc);
	CHECK(!why, "kvr_last_error(): %s", why);
	return rc;
}
#define API(fn, ...) api_checked(#fn, (fuzz_err_arm(#fn, NULL), fn(__VA_ARGS__)))

struct matt {
	uint64_t id;
	int rank;
	uint64_t life;  /* the rank's life when admitted: another one makes the attempt stale */
	uint64_t ntok;  /* prompt tokens */
	uint64_t epoch; /* the sync epoch of its admission (posted bookings) */
	bool booking_failed_maybe; /* its epoch ended with a failure armed in it */
};

struct prog {
	uint64_t rng;
	uint64_t now; /* virtual clock, ns */
	struct kvr_config cfg;
	struct kvr_router *r;
	bool present[N_RANKS];
	uint64_t inc[N_RANKS], cap[N_RANKS], life[N_RANKS];
	/* kvr_request_cached may prove a rank's engine larger than registered: its prediction then
	 * holds more than cap until the next set_capacity */
	bool healed[N_RANKS];
	struct matt att[MAX_ATT];
	int n_att;
	struct {
		uint64_t t, ntok;
	} tix[MAX_TIX];
	int n_tix;
	uint32_t toks[MAX_TOK];
	/* Posted bookings (no sync_booking) run on the shard after kvr_route returned: one that
	 * runs out of memory is dropped and its attempt is stale (kvr_route's contract).  Which
	 * booking an armed failure hits is unknown until a kvr_router_sync: an attempt admitted
	 * in an epoch (between two syncs) in which a failure was armed may be stale. */
	uint64_t epoch;
	bool epoch_failed; /* a failure was armed some time in this epoch */
};

static uint32_t rnd(struct prog *p, uint32_t n)
{
	return (uint32_t)(splitmix64(&p->rng) % n);
}

static uint64_t vclock(void *ctx)
{
	return __atomic_load_n((uint64_t *)ctx, __ATOMIC_RELAXED);
}

static struct kvr_rank_id rid(int i)
{
	return (struct kvr_rank_id){.worker_id = (uint64_t)i, .dp_rank = 0};
}

static int rank_of(struct kvr_rank_id id)
{
	return id.dp_rank == 0 && id.worker_id < N_RANKS ? (int)id.worker_id : -1;
}

static bool any_present(const struct prog *p)
{
	for (int i = 0; i < N_RANKS; i++)
		if (p->present[i])
			return true;
	return false;
}

/* A prompt from one of a few shared prefixes (so decisions see overlap and outputs extend
 * cached chains). */
static size_t gen_tokens(struct prog *p, uint32_t *t, size_t cap)
{
	uint32_t fam = rnd(p, 4), salt = rnd(p, 1u << 16);
	size_t n = 1 + rnd(p, (uint32_t)cap);
	size_t shared = rnd(p, (uint32_t)n + 1);
	for (size_t i = 0; i < n; i++)
		t[i] =
		    i < shared ? fam * 100003u + (uint32_t)i : salt * 7919u + (uint32_t)i * 13u + 1;
	return n;
}

/* Arms the nth allocation from now to fail; half the time persistently (kvr_alloc_fail_from:
 * that one and every later one fail until disarmed, as in the threaded mode), so a clean-up
 * that allocates after a failure fails as well, which one-shot failures on one thread never
 * reach. */
static void arm(struct prog *p, uint64_t nth)
{
	if (rnd(p, 2))
		kvr_alloc_fail_from(nth);
	else
		kvr_alloc_fail_after(nth);
}

/* Failures: armed a few allocations ahead before about a third of the calls, left armed (it
 * then fires in a later call or on a shard thread) or disarmed after the call. */
static void maybe_arm(struct prog *p)
{
	if (kvr_alloc_fail_pending() == 0 && rnd(p, 3) == 0)
		arm(p, 1 + rnd(p, 8));
	if (kvr_alloc_fail_pending())
		p->epoch_failed = true;
}

static void maybe_disarm(struct prog *p)
{
	if (rnd(p, 2))
		kvr_alloc_fail_after(0);
}

static void end_attempt(struct prog *p, int k)
{
	p->att[k] = p->att[--p->n_att];
}

/* Stale only when the rank's life changed since the admission, or a posted booking may have
 * run out of memory. */
static bool may_be_stale(const struct prog *p, const struct matt *a)
{
	return !p->present[a->rank] || p->life[a->rank] != a->life ||
	       (!p->cfg.sync_booking &&
	        (a->booking_failed_maybe || (a->epoch == p->epoch && p->epoch_failed)));
}

/* queued: admitted from the queue some time since it was queued, when the rank may have been
 * in another life (or gone since): the model cannot tell whether the attempt is stale. */
static void add_attempt(struct prog *p, const struct kvr_decision *d, uint64_t ntok, bool queued)
{
	int ri = rank_of(d->rank);
	CHECK(ri >= 0 && (p->present[ri] || queued), "decided on rank %" PRIu64 "/%u, not present",
	      d->rank.worker_id, d->rank.dp_rank);
	CHECK(d->attempt != 0, "decision without an attempt");
	for (int k = 0; k < p->n_att; k++)
		CHECK(p->att[k].id != d->attempt, "attempt %" PRIu64 " issued twice", d->attempt);
	if (p->n_att == MAX_ATT) {
		cur_call = "finish (model full)";
		int rc = API(kvr_request_finish, p->r, p->att[0].id);
		CHECK(rc == 0 || (rc == KVR_ESTALE && may_be_stale(p, &p->att[0])), "rc %d", rc);
		end_attempt(p, 0);
	}
	p->att[p->n_att++] = (struct matt){.id = d->attempt,
	                                   .rank = ri,
	                                   .life = queued ? UINT64_MAX : p->life[ri],
	                                   .ntok = ntok,
	                                   .epoch = p->epoch};
}

static void rank_new_life(struct prog *p, int i)
{
	p->life[i]++;
}

static void op_rank_add(struct prog *p)
{
	int i = (int)rnd(p, N_RANKS);
	static const uint64_t caps[] = {KVR_CAPACITY_NONE, 0, 1, 8, 64, 4096};
	uint64_t cap = caps[rnd(p, 6)], inc = rnd(p, 3);
	cur_call = "kvr_rank_add";
	int rc = API(kvr_rank_add, p->r, rid(i), inc, cap, rnd(p, 2) ? 0 : 64);
	snprintf(cur_detail, sizeof(cur_detail), "rank %d inc %" PRIu64 " cap %" PRIu64 ": %d", i,
	         inc, cap, rc);
	if (p->present[i]) {
		CHECK(rc == KVR_EEXIST, "add of a present rank: %d", rc);
		return;
	}
	CHECK(rc == 0 || rc == KVR_ENOMEM, "add: %d", rc);
	if (rc == KVR_ENOMEM) {
		struct kvr_rank_stats s;
		kvr_alloc_fail_after(0);
		CHECK(API(kvr_rank_get_stats, p->r, rid(i), &s) == KVR_ENOENT,
		      "a failed add left the rank behind");
		return;
	}
	p->present[i] = true;
	p->healed[i] = false;
	p->inc[i] = inc;
	p->cap[i] = cap;
	rank_new_life(p, i);
}

/* The answer to a command on rank i (remove, set_capacity, reset): KVR_ENOENT for an absent
 * rank, else 0 or KVR_ENOMEM, after which the failures stop and the rank is still there as the
 * model has it (incarnation, capacity; its attempts stay live, as the model keeps them).
 * Returns true when the command took effect. */
static bool rank_command_done(struct prog *p, int i, int rc)
{
	if (!p->present[i]) {
		CHECK(rc == KVR_ENOENT, "command on an absent rank: %d", rc);
		return false;
	}
	CHECK(rc == 0 || rc == KVR_ENOMEM, "rc %d", rc);
	if (rc == 0)
		return true;
	struct kvr_rank_stats s;
	kvr_alloc_fail_after(0);
	CHECK(API(kvr_rank_get_stats, p->r, rid(i), &s) == 0, "a failed command removed the rank");
	CHECK(s.incarnation == p->inc[i] &&
	          (s.capacity_blocks == p->cap[i] ||
	           (p->cap[i] == 0 && s.capacity_blocks == KVR_CAPACITY_NONE)),
	      "a failed command changed the rank: inc %" PRIu64 " cap %" PRIu64 " (was %" PRIu64
	      " %" PRIu64 ")",
	      s.incarnation, s.capacity_blocks, p->inc[i], p->cap[i]);
	return false;
}

static void op_rank_remove(struct prog *p)
{
	int i = (int)rnd(p, N_RANKS);
	cur_call = "kvr_rank_remove";
	int rc = API(kvr_rank_remove, p->r, rid(i));
	snprintf(cur_detail, sizeof(cur_detail), "rank %d: %d", i, rc);
	if (rank_command_done(p, i, rc)) {
		p->present[i] = false;
		rank_new_life(p, i);
	}
}

static void op_set_capacity(struct prog *p)
{
	int i = (int)rnd(p, N_RANKS);
	static const uint64_t caps[] = {KVR_CAPACITY_NONE, 0, 1, 8, 64, 4096};
	uint64_t cap = caps[rnd(p, 6)];
	uint64_t inc = p->inc[i] + (rnd(p, 4) == 0);
	cur_call = "kvr_rank_set_capacity";
	int rc = API(kvr_rank_set_capacity, p->r, rid(i), inc, cap);
	snprintf(cur_detail, sizeof(cur_detail),
	         "rank %d inc %" PRIu64 " -> %" PRIu64 " cap %" PRIu64 " -> %" PRIu64 ": %d", i,
	         p->inc[i], inc, p->cap[i], cap, rc);
	if (rank_command_done(p, i, rc)) {
		if (inc != p->inc[i])
			rank_new_life(p, i);
		p->inc[i] = inc;
		p->cap[i] = cap;
		p->healed[i] = false;
	}
}

static void op_rank_reset(struct prog *p)
{
	int i = (int)rnd(p, N_RANKS);
	uint64_t inc = p->inc[i] + rnd(p, 2);
	cur_call = "kvr_rank_reset";
	int rc = API(kvr_rank_reset, p->r, rid(i), inc);
	snprintf(cur_detail, sizeof(cur_detail), "rank %d inc %" PRIu64 " -> %" PRIu64 ": %d", i,
	         p->inc[i], inc, rc);
	if (rank_command_done(p, i, rc)) {
		p->inc[i] = inc;
		p->healed[i] = false;
		rank_new_life(p, i);
	}
}

static void op_route(struct prog *p)
{
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = p->toks;
	q.n_tokens = gen_tokens(p, p->toks, MAX_TOK);
	q.expected_output_tokens = rnd(p, 64);
	static const char *loras[] = {NULL, NULL, "lora-a", ""};
	q.lora_name = loras[rnd(p, 4)];
	static uint64_t local[MAX_TOK];
	if (rnd(p, 4) == 0) { /* the prompt as local hashes, no tokens (the queue copies them) */
		q.n_hashes = kvr_hash_blocks(p->toks, q.n_tokens, p->cfg.block_size, q.lora_name,
		                             local, NULL);
		q.local_hashes = local;
		q.tokens = NULL;
	}
	struct kvr_rank_id pin = rid((int)rnd(p, N_RANKS));
	bool pinned = rnd(p, 6) == 0;
	if (pinned)
		q.pinned = &pin;
	struct kvr_rank_id allow[3];
	unsigned allowed = (1u << N_RANKS) - 1;
	if (rnd(p, 5) == 0) { /* an allow list (with the pinned rank in it) */
		allowed = 0;
		q.n_allow = 1 + rnd(p, 3);
		for (size_t k = 0; k < q.n_allow; k++) {
			allow[k] = k == 0 && pinned ? pin : rid((int)rnd(p, N_RANKS));
			allowed |= 1u << allow[k].worker_id;
		}
		q.allow = allow;
	}
	if (pinned)
		allowed &= 1u << pin.worker_id;
	if (rnd(p, 8) == 0)
		q.flags |= KVR_ROUTE_QUERY_ONLY;
	struct kvr_decision d;
	memset(&d, 0xa5, sizeof(d));
	cur_call = "kvr_route";
	int rc = API(kvr_route, p->r, &q, &d);
	snprintf(cur_detail, sizeof(cur_detail),
	         "rc %d status %d rank %" PRIu64 " attempt %" PRIx64, rc, d.status,
	         d.rank.worker_id, d.attempt);
	bool eligible = false;
	for (int i = 0; i < N_RANKS; i++)
		eligible |= p->present[i] && (allowed & (1u << i));
	if (!eligible) {
		/* (which check comes first is not promised: KVR_ENOMEM may come before) */
		CHECK(rc == KVR_ENOENT || rc == KVR_ENOMEM, "route without an eligible rank: %d",
		      rc);
		return;
	}
	CHECK(rc == 0 || rc == KVR_ENOMEM || rc == KVR_EAGAIN, "route: %d", rc);
	if (rc == KVR_EAGAIN)
		CHECK(p->cfg.queue_threshold > 0, "KVR_EAGAIN without a queue");
	if (rc)
		return;
	if (d.status == KVR_QUEUED) {
		CHECK(p->cfg.queue_threshold > 0 && !(q.flags & KVR_ROUTE_QUERY_ONLY),
		      "queued without a queue");
		CHECK(d.ticket != 0, "queued without a ticket");
		if (p->n_tix == MAX_TIX) {
			cur_call = "kvr_route_cancel (model full)";
			(void)API(kvr_route_cancel, p->r, d.ticket);
			struct kvr_decision w;
			rc = API(kvr_route_wait, p->r, d.ticket, p->now ? p->now : 1, &w);
			if (rc == 0 && w.status == KVR_DECIDED)
				add_attempt(p, &w, q.n_tokens, true);
			return;
		}
		p->tix[p->n_tix].t = d.ticket;
		p->tix[p->n_tix++].ntok = q.n_tokens;
		return;
	}
	CHECK(d.status == KVR_DECIDED, "status %d", d.status);
	if (q.flags & KVR_ROUTE_QUERY_ONLY) {
		CHECK(d.attempt == 0, "query-only with an attempt");
		return;
	}
	CHECK(rank_of(d.rank) >= 0 && (allowed & (1u << rank_of(d.rank))),
	      "decided on rank %" PRIu64 ", not an eligible one", d.rank.worker_id);
	add_attempt(p, &d, q.n_tokens, d.ticket != 0);
}

static void op_lifecycle(struct prog *p)
{
	if (!p->n_att)
		return;
	int k = (int)rnd(p, (uint32_t)p->n_att);
	struct matt *a = &p->att[k];
	uint32_t what = rnd(p, 8);
	int rc;
	snprintf(cur_detail, sizeof(cur_detail), "attempt %" PRIx64 " rank %d", a->id, a->rank);
	if (what < 3) {
		cur_call = "kvr_request_output";
		size_t n = 1 + rnd(p, 40);
		uint32_t out[40];
		for (size_t i = 0; i < n; i++)
			out[i] = (uint32_t)(a->id * 31 + i);
		rc = rnd(p, 2) ? API(kvr_request_output, p->r, a->id, out, n)
		               : API(kvr_request_output_ex, p->r, a->id, out, n,
		                     rnd(p, 2) ? KVR_OUTPUT_FINAL : 0);
		CHECK(rc == 0 || rc == KVR_ENOMEM || rc == KVR_EAGAIN ||
		          (rc == KVR_ESTALE && may_be_stale(p, a)),
		      "output: %d", rc);
		return;
	}
	if (what < 4) {
		cur_call = "kvr_request_prefill_done";
		rc = API(kvr_request_prefill_done, p->r, a->id);
		CHECK(rc == 0 || rc == KVR_EAGAIN || (rc == KVR_ESTALE && may_be_stale(p, a)),
		      "prefill_done: %d", rc);
		return;
	}
	if (what < 5) {
		cur_call = "kvr_request_cached";
		uint64_t cached = rnd(p, (uint32_t)a->ntok + 2);
		rc = API(kvr_request_cached, p->r, a->id, cached);
		p->healed[a->rank] = true;
		if (cached > a->ntok)
			CHECK(rc == KVR_EINVAL || (rc == KVR_ESTALE && may_be_stale(p, a)),
			      "cached above the prompt: %d", rc);
		else
			CHECK(rc == 0 || rc == KVR_ENOMEM ||
			          (rc == KVR_ESTALE && may_be_stale(p, a)),
			      "cached: %d", rc);
		return;
	}
	cur_call = what < 7 ? "kvr_request_finish" : "kvr_request_abort";
	rc = what < 7 ? API(kvr_request_finish, p->r, a->id) : API(kvr_request_abort, p->r, a->id);
	CHECK(rc == 0 || (rc == KVR_ESTALE && may_be_stale(p, a)), "end: %d", rc);
	end_attempt(p, k);
}

static void op_event(struct prog *p)
{
	int i = (int)rnd(p, N_RANKS);
	uint32_t bs = p->cfg.block_size;
	static struct kvr_event_block blk[MAX_EV_BLOCKS];
	static uint32_t toks[MAX_EV_BLOCKS * 16];
	static uint64_t removed[MAX_EV_BLOCKS];
	struct kvr_event ev = {.event_id = rnd(p, 2) ? 0 : p->now / 1000 + rnd(p, 4)};
	uint32_t kind = rnd(p, 6);
	size_t nb =
	    1 + rnd(p, rnd(p, 4) ? 8 : MAX_EV_BLOCKS); /* over 64: the event's arrays grow */
	uint32_t fam = rnd(p, 4);
	if (kind < 4) {
		ev.type = KVR_EVENT_STORED;
		for (size_t b = 0; b < nb; b++) {
			for (uint32_t t = 0; t < bs; t++)
				toks[b * bs + t] = fam * 100003u + (uint32_t)(b * bs + t);
			blk[b] = (struct kvr_event_block){.ext_hash = fam * 1000 + b + 1,
			                                  .tokens = toks + b * bs,
			                                  .n_tokens = bs};
		}
		ev.blocks = blk;
		ev.n_blocks = nb;
	} else if (kind < 5) {
		ev.type = KVR_EVENT_REMOVED;
		for (size_t b = 0; b < nb; b++)
			removed[b] = fam * 1000 + rnd(p, (uint32_t)nb) + 1;
		ev.removed = removed;
		ev.n_removed = nb;
	} else {
		ev.type = KVR_EVENT_CLEARED;
	}
	cur_call = "kvr_events_apply";
	int rc = API(kvr_events_apply, p->r, rid(i), &ev);
	if (p->cfg.mode != KVR_MODE_EVENTS) {
		CHECK(rc == KVR_EINVAL, "event outside events mode: %d", rc);
		return;
	}
	if (!p->present[i]) {
		CHECK(rc == KVR_ENOENT, "event of an absent rank: %d", rc);
		return;
	}
	CHECK(rc == 0 || rc == KVR_ESTALE || rc == KVR_ENOMEM, "event: %d", rc);
}

static void op_read(struct prog *p)
{
	uint32_t k = rnd(p, 4);
	int i = (int)rnd(p, N_RANKS);
	if (k == 0) {
		struct kvr_rank_stats s;
		cur_call = "kvr_rank_get_stats";
		int rc = API(kvr_rank_get_stats, p->r, rid(i), &s);
		CHECK(rc == (p->present[i] ? 0 : KVR_ENOENT), "stats: %d", rc);
		if (rc == 0)
			CHECK(s.incarnation == p->inc[i],
			      "incarnation %" PRIu64 " expected %" PRIu64, s.incarnation,
			      p->inc[i]);
	} else if (k == 1) {
		static char buf[1 << 16];
		size_t len;
		cur_call = "kvr_metrics_render";
		int rc = API(kvr_metrics_render, p->r, buf, rnd(p, 4) ? sizeof(buf) : 64, &len);
		CHECK(rc == 0 || rc == KVR_ERANGE, "metrics: %d", rc);
	} else if (k == 2) {
		uint64_t out[64];
		size_t n;
		cur_call = "kvr_rank_blocks";
		int rc = API(kvr_rank_blocks, p->r, rid(i), out, 64, &n);
		CHECK(p->present[i] ? rc == 0 || rc == KVR_ERANGE : rc == KVR_ENOENT,
		      "blocks (present %d): %d", p->present[i], rc);
	} else {
		struct kvr_memory m;
		cur_call = "kvr_router_get_memory";
		int rc = API(kvr_router_get_memory, p->r, &m);
		CHECK(rc == 0 || rc == KVR_ENOMEM, "get_memory: %d", rc);
	}
}

static void op_sync(struct prog *p)
{
	cur_call = "kvr_router_sync";
	int rc = API(kvr_router_sync, p->r, 20000);
	CHECK(rc == 0, "sync: %d", rc);
	if (p->epoch_failed)
		for (int k = 0; k < p->n_att; k++)
			if (p->att[k].epoch == p->epoch)
				p->att[k].booking_failed_maybe = true;
	p->epoch++;
	p->epoch_failed = kvr_alloc_fail_pending() != 0; /* still armed: the next bookings */
}

static void op_clock(struct prog *p)
{
	/* TTL expiry (ttl_ns 0.5-2 s), never a lease interval (1000 s). */
	__atomic_store_n(&p->now, p->now + (uint64_t)rnd(p, 2000) * 1000000ull, __ATOMIC_RELAXED);
}

static void collect_tickets(struct prog *p)
{
	while (p->n_tix) {
		p->n_tix--;
		uint64_t t = p->tix[p->n_tix].t, ntok = p->tix[p->n_tix].ntok;
		cur_call = "kvr_route_cancel (end)";
		int rc = API(kvr_route_cancel, p->r, t);
		CHECK(rc == 0 || rc == KVR_ENOENT, "cancel: %d", rc);
		if (rc == 0)
			continue;
		struct kvr_decision d;
		cur_call = "kvr_route_wait (end)";
		rc = API(kvr_route_wait, p->r, t, p->now ? p->now : 1, &d);
		CHECK(rc != KVR_ETIMEDOUT, "not queued, yet the wait timed out");
		if (rc == 0 && d.status == KVR_DECIDED) {
			add_attempt(p, &d, ntok, true);
		} else {
			CHECK(rc == KVR_ENOENT || rc == KVR_ENOMEM || rc == KVR_ERANGE,
			      "collect: %d", rc);
		}
	}
}

static void run_ops(struct prog *p, int n_ops)
{
	bool trace = getenv("OOM_API_TRACE") != NULL; /* prints each call and the armed failure */
	if (trace)
		fprintf(stderr, "mode %d block_size %u shards %u sync_booking %d queue %.1f\n",
		        (int)p->cfg.mode, p->cfg.block_size, p->cfg.n_shards, p->cfg.sync_booking,
		        p->cfg.queue_threshold);
	for (cur_op = 0; cur_op < n_ops; cur_op++) {
		maybe_arm(p);
		uint64_t armed = kvr_alloc_fail_pending();
		uint32_t op = rnd(p, 20);
		if (op < 2)
			op_rank_add(p);
		else if (op < 3)
			rnd(p, 3) ? op_set_capacity(p) : op_rank_remove(p);
		else if (op < 4)
			op_rank_reset(p);
		else if (op < 9)
			op_route(p);
		else if (op < 14)
			op_lifecycle(p);
		else if (op < 16)
			op_event(p);
		else if (op < 17)
			op_read(p);
		else if (op < 18)
			op_sync(p);
		else if (op < 19)
			op_clock(p);
		else if (p->n_tix) {
			int tk = (int)rnd(p, (uint32_t)p->n_tix);
			uint64_t t = p->tix[tk].t, ntok = p->tix[tk].ntok;
			struct kvr_decision d;
			cur_call = "kvr_route_wait";
			int rc = API(kvr_route_wait, p->r, t, p->now ? p->now : 1, &d);
			snprintf(cur_detail, sizeof(cur_detail),
			         "ticket %" PRIu64 " rc %d status %d attempt %" PRIx64, t, rc,
			         d.status, rc == 0 ? d.attempt : 0);
			if (rc != KVR_ETIMEDOUT)
				p->tix[tk] = p->tix[--p->n_tix];
			if (rc == KVR_ETIMEDOUT)
				;
			else if (rc == 0 && d.status == KVR_DECIDED)
				add_attempt(p, &d, ntok, true);
			else
				CHECK(rc == KVR_ENOENT || rc == KVR_ENOMEM || rc == KVR_ERANGE,
				      "wait: %d", rc);
		}
		if (trace)
			fprintf(stderr, "op %d %s: failure armed %" PRIu64 " -> %" PRIu64 " %s\n",
			        cur_op, cur_call, armed, kvr_alloc_fail_pending(), cur_detail);
		cur_detail[0] = '\0';
		maybe_disarm(p);
	}
	kvr_alloc_fail_after(0);
}

/* No failures from here: everything ends, and the router must be idle and still work. */
static void drain_and_check(struct prog *p)
{
	collect_tickets(p);
	while (p->n_att) {
		cur_call = "finish (end)";
		int rc = API(kvr_request_finish, p->r, p->att[0].id);
		CHECK(rc == 0 || (rc == KVR_ESTALE && may_be_stale(p, &p->att[0])),
		      "finish of a live attempt at the end: %d", rc);
		end_attempt(p, 0);
	}
	collect_tickets(p);
	op_sync(p);
	for (int i = 0; i < N_RANKS; i++) {
		if (!p->present[i])
			continue;
		struct kvr_rank_stats s;
		cur_call = "kvr_rank_get_stats (idle)";
		CHECK(API(kvr_rank_get_stats, p->r, rid(i), &s) == 0, "stats");
		CHECK(s.active_requests == 0 && s.active_prefill_tokens == 0 &&
		          s.active_blocks == 0,
		      "idle rank %d: requests %" PRIu64 " prefill %" PRIu64 " blocks %" PRIu64, i,
		      s.active_requests, s.active_prefill_tokens, s.active_blocks);
		if (p->cfg.mode == KVR_MODE_APPROX_LRU && p->cap[i] != 0 &&
		    p->cap[i] != KVR_CAPACITY_NONE && !p->healed[i])
			CHECK(s.resident_blocks <= p->cap[i],
			      "idle rank %d: resident %" PRIu64 " > capacity %" PRIu64, i,
			      s.resident_blocks, p->cap[i]);
	}
	if (!any_present(p))
		return;
	/* Still routes (a rank that failed nothing takes the request) and ends it. */
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = p->toks;
	q.n_tokens = gen_tokens(p, p->toks, MAX_TOK);
	struct kvr_decision d;
	cur_call = "kvr_route (after)";
	int rc = API(kvr_route, p->r, &q, &d);
	CHECK(rc == 0, "route after the failures: %d", rc);
	if (d.status == KVR_QUEUED) {
		cur_call = "kvr_route_cancel (after)";
		rc = API(kvr_route_cancel, p->r, d.ticket);
		CHECK(rc == 0, "cancel after the failures: %d", rc);
		return;
	}
	cur_call = "kvr_request_finish (after)";
	rc = API(kvr_request_finish, p->r, d.attempt);
	CHECK(rc == 0, "finish after the failures: %d", rc);
	op_sync(p);
}

static void make_config(struct prog *p)
{
	struct kvr_config *c = &p->cfg;
	kvr_config_init(c);
	static const uint32_t bss[] = {1, 4, 16};
	c->mode = (enum kvr_mode)rnd(p, 3);
	c->block_size = bss[rnd(p, 3)];
	c->n_shards = 1 + rnd(p, 2);
	c->max_ranks = N_RANKS + rnd(p, 4);
	c->sync_booking = rnd(p, 2);
	c->queue_threshold = rnd(p, 3) == 0 ? 1.0 : 0;
	c->queue_capacity = 1 + rnd(p, 8);
	c->lease_scan_interval_ns = 1000ull * 1000000000ull;
	c->ttl_ns = (uint64_t)(1 + rnd(p, 4)) * 500000000ull;
	c->shard_idle_spin_ns = 0; /* park at once: many routers */
	c->seed = splitmix64(&p->rng);
	c->now_ns = vclock;
	c->clock_ctx = &p->now;
}

struct run_arg {
	uint64_t seed;
	int ops;
};

static void *run_program(void *arg)
{
	struct run_arg *ra = arg;
	/* A fresh thread: its detail is "" before its first failure (kvrouter.h) */
	CHECK(!strcmp(kvr_last_error(), ""), "kvr_last_error() on a new thread: \"%s\"",
	      kvr_last_error());
	struct prog *p = calloc(1, sizeof(*p));
	if (!p)
		abort();
	p->rng = ra->seed;
	p->now = 1000;
	make_config(p);
	/* Creation under failure: KVR_ENOMEM, no router, nothing left allocated. */
	if (rnd(p, 2)) {
		int64_t before = kvr_alloc_live_bytes();
		arm(p, 1 + rnd(p, 40)); /* create makes ~30 allocations */
		cur_call = "kvr_router_create (failing)";
		int rc = API(kvr_router_create, &p->cfg, &p->r);
		kvr_alloc_fail_after(0);
		if (rc) {
			CHECK(rc == KVR_ENOMEM && p->r == NULL, "create: %d", rc);
			CHECK(kvr_alloc_live_bytes() == before,
			      "a failed create kept %" PRId64 " bytes",
			      kvr_alloc_live_bytes() - before);
		} else {
			kvr_router_destroy(p->r);
			p->r = NULL;
		}
	}
	cur_call = "kvr_router_create";
	int rc = API(kvr_router_create, &p->cfg, &p->r);
	CHECK(rc == 0, "create: %d", rc);
	run_ops(p, ra->ops);
	drain_and_check(p);
	cur_call = "kvr_router_destroy";
	kvr_router_destroy(p->r);
	free(p);
	return NULL;
}

static void run_seed(uint64_t seed, int ops)
{
	cur_seed = seed;
	struct run_arg ra = {.seed = seed, .ops = ops};
	int64_t leak = kvr_test_run_fresh_thread(run_program, &ra);
	if (leak) {
		fprintf(stderr, "oom_api: seed %" PRIu64 ": leak: %" PRId64 " bytes\n", seed, leak);
		abort();
	}
}

int main(int argc, char **argv)
{
	uint64_t first = 1, seeds = 20;
	int ops = 300, threads = 0;
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(argv[i], "--first") && v)
			first = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--seeds") && v)
			seeds = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--ops") && v)
			ops = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--threads") && v)
			threads = atoi(argv[++i]);
		else {
			fprintf(stderr,
			        "usage: %s [--first S] [--seeds N] [--ops K] [--threads T]\n",
			        argv[0]);
			return 2;
		}
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (threads)
		oom_api_threads(first, seeds, ops, threads);
	else
		for (uint64_t s = first; s < first + seeds; s++)
			run_seed(s, ops);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	printf("oom_api: %" PRIu64 " seeds (%" PRIu64 "..%" PRIu64
	       "), %d operations each%s, %.1f s\n",
	       seeds, first, first + seeds - 1, ops,
	       threads == 3 ? " on 3 threads"
	       : threads    ? " on 2 threads"
	                    : "",
	       (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
	return 0;
}
