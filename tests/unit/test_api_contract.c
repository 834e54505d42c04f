/*
 * tests/unit/test_api_contract.c - the public header's promises, checked as an embedder reads
 * them: every KVR_API function called with each bad input its comment (or README.md, "Bad
 * input") documents, the code it must return, and kvr_strerror's message for that code (the
 * library's one message API: static, per code), which must be non-empty, not "unknown error",
 * and name the problem.  The calls documented as no-ops (destroy(NULL), init(NULL)) must be
 * no-ops.  The optional subsystems are checked in whichever build this is: with ZeroMQ and NATS
 * their argument checks, without them the stubs' documented KVR_ENOTSUP (sync/feed_none.c,
 * sync/replica_none.c).  Table-driven: one row per (call, bad input); a row lists the codes the
 * header allows for it (two where it says "KVR_ENOENT or KVR_ESTALE").  After every failing row
 * kvr_last_error() must name the function that failed, and two rows that fail one function
 * with one code for different reasons must say different things (the detail is what tells an
 * embedder which of a dozen KVR_EINVALs it got).
 */
#include <criterion/criterion.h>
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvrouter.h"
#ifdef KVR_HAVE_NATS
#include "tests/common/nats_server.h"
#endif

/* ---------------------------------------------------------------- messages */

/* What each code's message must say: a word that names the problem. */
static const struct {
	int code;
	const char *word;
} words[] = {
    {KVR_EINVAL, "invalid"},     {KVR_ENOMEM, "memory"},         {KVR_ENOENT, "no such"},
    {KVR_ESTALE, "stale"},       {KVR_EAGAIN, "overloaded"},     {KVR_EEXIST, "already exists"},
    {KVR_EBUSY, "busy"},         {KVR_ERANGE, "range"},          {KVR_ETIMEDOUT, "deadline"},
    {KVR_ESHUTDOWN, "shutting"}, {KVR_ENOTSUP, "not supported"},
};
#define N_WORDS (sizeof(words) / sizeof(words[0]))

/* Checks kvr_strerror(code): set, specific, and naming the problem; what names the call. */
static void expect_message(int code, const char *what)
{
	const char *m = kvr_strerror(code);
	cr_expect_not_null(m, "%s: kvr_strerror(%d) is NULL", what, code);
	if (!m)
		return;
	cr_expect_gt(strlen(m), 3, "%s: kvr_strerror(%d) is empty", what, code);
	if (code == KVR_OK)
		return;
	cr_expect_str_neq(m, "unknown error", "%s: code %d has no message", what, code);
	for (size_t i = 0; i < N_WORDS; i++)
		if (words[i].code == code)
			cr_expect(strstr(m, words[i].word),
			          "%s: kvr_strerror(%d) = \"%s\" lacks \"%s\"", what, code, m,
			          words[i].word);
}

Test(api_contract, every_code_has_its_own_message)
{
	for (size_t i = 0; i < N_WORDS; i++) {
		expect_message(words[i].code, "table");
		for (size_t j = 0; j < i; j++)
			cr_expect_str_neq(kvr_strerror(words[i].code), kvr_strerror(words[j].code),
			                  "codes %d and %d share a message", words[i].code,
			                  words[j].code);
	}
	cr_expect_str_eq(kvr_strerror(KVR_ENOTSUP - 1), "unknown error");
	cr_expect_str_eq(kvr_strerror(1), "unknown error");
	cr_expect_str_eq(kvr_strerror(INT32_MIN), "unknown error");
	cr_expect_str_eq(kvr_version(), KVR_VERSION_STRING);
}

/* ---------------------------------------------------------------- the table's machinery */

#define BS    16u
#define NTOK  64u
#define RANK  ((struct kvr_rank_id){1, 0})
#define RANK2 ((struct kvr_rank_id){2, 0})
#define UNK   ((struct kvr_rank_id){77, 3})
#define INC   5u
/* An attempt id whose slot bits name no slot of a 2-rank router: never issued. */
#define FOREIGN_ATTEMPT UINT64_MAX

/* What the rows call on: a router in approx_lru with two ranks (max_ranks 2), a live and an
 * ended attempt on it, an empty router, and an events-mode router with one rank. */
struct fx {
	struct kvr_router *r, *empty, *ev;
	uint64_t live, ended;
	uint32_t tok[NTOK];
	uint64_t local[NTOK / BS], seq[NTOK / BS];
	struct kvr_request q; /* a valid request; rows copy and spoil it */
	struct kvr_decision d;
	struct kvr_config cfg;
	struct kvr_memory mem;
	struct kvr_rank_stats st;
	uint64_t blocks[64];
	size_t n;
	char buf[32];
};

/* Not a KVR_* code: what a row returns when the call left an output set that it must clear
 * (*out after a failed create or attach), or succeeded where it must fail. */
#define LEFT_OUT_SET 1001
#define SUCCEEDED    1002

struct row {
	const char *what;
	int want, alt; /* alt: a second code the header allows (else the same as want) */
	int (*call)(struct fx *f);
	const char *expr; /* the row's call as written: which function it tests */
};

/* The public function a row's expression tests: the last kvr_ call in it, or the one behind
 * this file's helper it calls. */
static void row_function(const char *expr, char *fn, size_t cap)
{
	static const char *const helpers[][2] = {
	    {"route_bad(", "kvr_route"},    {"observe(", "kvr_rank_observe"},
	    {"event(", "kvr_events_apply"}, {"feed_create(", "kvr_feed_create"},
	    {"feed_add(", "kvr_feed_add"},  {"attach(", "kvr_sync_attach"},
	};
	fn[0] = '\0';
	for (const char *p = expr; (p = strstr(p, "kvr_")); p++) {
		size_t k = 0;
		while (isalnum((unsigned char)p[k]) || p[k] == '_')
			k++;
		if (p[k] == '(' && k < cap) {
			memcpy(fn, p, k);
			fn[k] = '\0';
		}
	}
	for (size_t i = 0; !fn[0] && i < sizeof(helpers) / sizeof(helpers[0]); i++)
		if (!strncmp(expr, helpers[i][0], strlen(helpers[i][0])))
			snprintf(fn, cap, "%s", helpers[i][1]);
	cr_assert(fn[0], "%s: which function does it test?", expr);
}

/* Checks kvr_last_error() after a failed call of fn: set, naming fn ("fn: ..."). */
static void expect_detail(const char *fn, const char *what)
{
	const char *m = kvr_last_error();
	cr_assert_not_null(m, "%s: kvr_last_error() is NULL", what);
	size_t k = strlen(fn);
	cr_expect(!strncmp(m, fn, k) && m[k] == ':' && strlen(m) > k + 3,
	          "%s: kvr_last_error() = \"%s\" does not start \"%s: \" and say why", what, m, fn);
}

static void run_rows(struct fx *f, const struct row *rows, size_t n)
{
	static struct {
		char fn[64], detail[256];
		int rc;
	} seen[256];
	cr_assert_leq(n, sizeof(seen) / sizeof(seen[0]));
	for (size_t i = 0; i < n; i++) {
		int rc = rows[i].call(f);
		cr_expect_neq(rc, LEFT_OUT_SET, "%s: a failed call left *out set", rows[i].what);
		cr_expect_neq(rc, SUCCEEDED, "%s: succeeded", rows[i].what);
		cr_expect(rc == rows[i].want || rc == rows[i].alt,
		          "%s: returned %d (%s), the header says %d (%s)", rows[i].what, rc,
		          kvr_strerror(rc), rows[i].want, kvr_strerror(rows[i].want));
		expect_message(rc, rows[i].what);
		row_function(rows[i].expr, seen[i].fn, sizeof(seen[i].fn));
		seen[i].rc = rc;
		seen[i].detail[0] = '\0';
		if (rc == 0 || rc == LEFT_OUT_SET || rc == SUCCEEDED)
			continue;
		expect_detail(seen[i].fn, rows[i].what);
		snprintf(seen[i].detail, sizeof(seen[i].detail), "%s", kvr_last_error());
	}
	/* Different causes, different details: every pair of rows failing one function with one
	 * code.  Exempt: KVR_ENOTSUP (a stub has one cause: it was not built), and a row that
	 * repeats an earlier one's cause (its name says "again"). */
	for (size_t i = 0; i < n; i++)
		for (size_t j = 0; j < i; j++)
			if (seen[i].detail[0] && seen[j].detail[0] && seen[i].rc == seen[j].rc &&
			    seen[i].rc != KVR_ENOTSUP && !strcmp(seen[i].fn, seen[j].fn) &&
			    !strstr(rows[i].what, "again") && !strstr(rows[j].what, "again"))
				cr_expect_str_neq(seen[i].detail, seen[j].detail,
				                  "%s and %s: two causes, one detail \"%s\"",
				                  rows[j].what, rows[i].what, seen[i].detail);
}

/* ROWS(X) lists X(name, want, alt, expression on f); DEF makes each a function, ENT a row. */
#define DEF(name, want, alt, expr)                                                                 \
	static int row_##name(struct fx *f)                                                        \
	{                                                                                          \
		(void)f;                                                                           \
		return (expr);                                                                     \
	}
#define ENT(name, want, alt, expr) {#name, want, alt, row_##name, #expr},

static struct kvr_router *router(enum kvr_mode mode, uint32_t max_ranks, uint64_t events_max)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.mode = mode;
	c.max_ranks = max_ranks;
	c.sync_booking = true;
	c.events_max_blocks = events_max;
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	return r;
}

static void fx_init(struct fx *f)
{
	memset(f, 0, sizeof(*f));
	for (uint32_t i = 0; i < NTOK; i++)
		f->tok[i] = i * 7 + 3;
	cr_assert_eq(kvr_hash_blocks(f->tok, NTOK, BS, NULL, f->local, f->seq), NTOK / BS);
	f->r = router(KVR_MODE_APPROX_LRU, 2, 1u << 21);
	f->empty = router(KVR_MODE_APPROX_LRU, 2, 1u << 21);
	f->ev = router(KVR_MODE_EVENTS, 2, 4);
	cr_assert_eq(kvr_rank_add(f->r, RANK, INC, 1000, 0), 0);
	cr_assert_eq(kvr_rank_add(f->r, RANK2, INC, 1000, 0), 0);
	cr_assert_eq(kvr_rank_add(f->ev, RANK, INC, KVR_CAPACITY_NONE, 0), 0);
	kvr_request_init(&f->q);
	f->q.tokens = f->tok;
	f->q.n_tokens = NTOK;
	f->q.pinned = &RANK;
	cr_assert_eq(kvr_route(f->r, &f->q, &f->d), 0);
	f->ended = f->d.attempt;
	cr_assert_eq(kvr_request_finish(f->r, f->ended), 0);
	cr_assert_eq(kvr_route(f->r, &f->q, &f->d), 0);
	f->live = f->d.attempt;
	cr_assert_eq(f->d.status, KVR_DECIDED);
	f->q.pinned = NULL;
}

static void fx_fini(struct fx *f)
{
	kvr_router_destroy(f->r);
	kvr_router_destroy(f->empty);
	kvr_router_destroy(f->ev);
}

/* kvr_route with f->q spoiled one way (which); the request stays valid otherwise. */
static int route_bad(struct fx *f, int which)
{
	struct kvr_request q = f->q;
	static const struct kvr_rank_id allow_other[1] = {{2, 0}};
	static const struct kvr_rank_id allow_unknown[2] = {{77, 3}, {78, 0}};
	static const struct kvr_rank_id rank = {1, 0}, unknown = {77, 3}; /* outlive the switch */
	switch (which) {
	case 0: /* no prompt */
		q.tokens = NULL;
		break;
	case 1: /* both tokens and local hashes, without sequence hashes */
		q.local_hashes = f->local;
		q.n_hashes = NTOK / BS;
		break;
	case 2:
		q.n_tokens = 0;
		break;
	case 3:
		q.n_tokens = (size_t)KVR_MAX_PROMPT_TOKENS + 1;
		break;
	case 4: /* more hashes than the prompt has blocks */
		q.tokens = NULL;
		q.local_hashes = f->local;
		q.n_hashes = NTOK / BS;
		q.n_tokens = NTOK - 1;
		break;
	case 5:
		q.allow = NULL;
		q.n_allow = 1;
		break;
	case 6:
		q.overlap_credit = NAN;
		break;
	case 7:
		q.temperature = INFINITY;
		break;
	case 8:
		q.prefill_load_scale = -INFINITY;
		break;
	case 9:
		q.flags = 1u << 9;
		break;
	case 10: /* pinned outside the allow list */
		q.pinned = &rank;
		q.allow = allow_other;
		q.n_allow = 1;
		break;
	case 11: /* sequence hashes without local ones */
		q.seq_hashes = f->seq;
		q.n_hashes = NTOK / BS;
		break;
	case 12: /* with tokens, hashes of fewer blocks than the tokens have */
		q.local_hashes = f->local;
		q.seq_hashes = f->seq;
		q.n_hashes = NTOK / BS - 1;
		break;
	case 13:
		q.pinned = &unknown;
		break;
	case 14:
		q.allow = allow_unknown;
		q.n_allow = 2;
		break;
	case 15:
		return kvr_route(f->r, NULL, &f->d);
	case 16:
		return kvr_route(f->r, &q, NULL);
	case 17:
		return kvr_route(NULL, &q, &f->d);
	case 18:
		return kvr_route(f->empty, &q, &f->d);
	}
	return kvr_route(f->r, &q, &f->d);
}

static int observe(struct fx *f, struct kvr_router *r, struct kvr_rank_id id, uint32_t flags,
                   uint64_t inc)
{
	(void)f;
	struct kvr_rank_observation o = {
	    .flags = flags, .incarnation = inc, .resident_blocks = 1, .watermark_hash = 9};
	return kvr_rank_observe(r, id, &o);
}

/* ---------------------------------------------------------------- the router's calls */

#define ROUTER_ROWS(X)                                                                             \
	X(config_validate_null, KVR_EINVAL, KVR_EINVAL, kvr_config_validate(NULL))                 \
	X(router_create_out_null, KVR_EINVAL, KVR_EINVAL, kvr_router_create(NULL, NULL))           \
	X(get_config_r_null, KVR_EINVAL, KVR_EINVAL, kvr_router_get_config(NULL, &f->cfg))         \
	X(get_config_out_null, KVR_EINVAL, KVR_EINVAL, kvr_router_get_config(f->r, NULL))          \
	X(router_sync_r_null, KVR_EINVAL, KVR_EINVAL, kvr_router_sync(NULL, 100))                  \
	X(router_sync_timeout_0, KVR_ETIMEDOUT, 0, kvr_router_sync(f->r, 0))                       \
	X(get_memory_r_null, KVR_EINVAL, KVR_EINVAL, kvr_router_get_memory(NULL, &f->mem))         \
	X(get_memory_out_null, KVR_EINVAL, KVR_EINVAL, kvr_router_get_memory(f->r, NULL))          \
	X(metrics_r_null, KVR_EINVAL, KVR_EINVAL, kvr_metrics_render(NULL, f->buf, 32, &f->n))     \
	X(metrics_buf_null_cap, KVR_EINVAL, KVR_EINVAL, kvr_metrics_render(f->r, NULL, 32, &f->n)) \
	X(metrics_cap_small, KVR_ERANGE, KVR_ERANGE, kvr_metrics_render(f->r, f->buf, 32, &f->n))  \
	X(metrics_size_query, KVR_ERANGE, KVR_ERANGE, kvr_metrics_render(f->r, NULL, 0, &f->n))    \
	X(rank_add_r_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_add(NULL, UNK, 1, 10, 0))              \
	X(rank_add_present, KVR_EEXIST, KVR_EEXIST, kvr_rank_add(f->r, RANK, INC, 10, 0))          \
	X(rank_add_max_ranks, KVR_ERANGE, KVR_ERANGE, kvr_rank_add(f->r, UNK, 1, 10, 0))           \
	X(set_capacity_r_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_set_capacity(NULL, RANK, INC, 9))  \
	X(set_capacity_unknown, KVR_ENOENT, KVR_ENOENT, kvr_rank_set_capacity(f->r, UNK, INC, 9))  \
	X(set_capacity_older, KVR_ESTALE, KVR_ESTALE, kvr_rank_set_capacity(f->r, RANK, 4, 9))     \
	X(reset_r_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_reset(NULL, RANK, INC))                   \
	X(reset_unknown, KVR_ENOENT, KVR_ENOENT, kvr_rank_reset(f->r, UNK, INC))                   \
	X(reset_older, KVR_ESTALE, KVR_ESTALE, kvr_rank_reset(f->r, RANK, 4))                      \
	X(remove_r_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_remove(NULL, RANK))                      \
	X(remove_unknown, KVR_ENOENT, KVR_ENOENT, kvr_rank_remove(f->r, UNK))                      \
	X(stats_r_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_get_stats(NULL, RANK, &f->st))            \
	X(stats_out_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_get_stats(f->r, RANK, NULL))            \
	X(stats_unknown, KVR_ENOENT, KVR_ENOENT, kvr_rank_get_stats(f->r, UNK, &f->st))            \
	X(blocks_r_null, KVR_EINVAL, KVR_EINVAL,                                                   \
	  kvr_rank_blocks(NULL, RANK, f->blocks, 64, &f->n))                                       \
	X(blocks_n_out_null, KVR_EINVAL, KVR_EINVAL,                                               \
	  kvr_rank_blocks(f->r, RANK, f->blocks, 64, NULL))                                        \
	X(blocks_out_null_cap, KVR_EINVAL, KVR_EINVAL,                                             \
	  kvr_rank_blocks(f->r, RANK, NULL, 64, &f->n))                                            \
	X(blocks_unknown, KVR_ENOENT, KVR_ENOENT,                                                  \
	  kvr_rank_blocks(f->r, UNK, f->blocks, 64, &f->n))                                        \
	X(blocks_cap_small, KVR_ERANGE, KVR_ERANGE,                                                \
	  kvr_rank_blocks(f->r, RANK, f->blocks, 1, &f->n))                                        \
	X(route_no_prompt, KVR_EINVAL, KVR_EINVAL, route_bad(f, 0))                                \
	X(route_tokens_and_hashes, KVR_EINVAL, KVR_EINVAL, route_bad(f, 1))                        \
	X(route_n_tokens_0, KVR_EINVAL, KVR_EINVAL, route_bad(f, 2))                               \
	X(route_n_tokens_over_max, KVR_EINVAL, KVR_EINVAL, route_bad(f, 3))                        \
	X(route_too_many_hashes, KVR_EINVAL, KVR_EINVAL, route_bad(f, 4))                          \
	X(route_allow_null, KVR_EINVAL, KVR_EINVAL, route_bad(f, 5))                               \
	X(route_nan_credit, KVR_EINVAL, KVR_EINVAL, route_bad(f, 6))                               \
	X(route_inf_temperature, KVR_EINVAL, KVR_EINVAL, route_bad(f, 7))                          \
	X(route_inf_scale, KVR_EINVAL, KVR_EINVAL, route_bad(f, 8))                                \
	X(route_unknown_flag, KVR_EINVAL, KVR_EINVAL, route_bad(f, 9))                             \
	X(route_pinned_outside_allow, KVR_EINVAL, KVR_EINVAL, route_bad(f, 10))                    \
	X(route_seq_without_local, KVR_EINVAL, KVR_EINVAL, route_bad(f, 11))                       \
	X(route_hashes_short_of_tokens, KVR_EINVAL, KVR_EINVAL, route_bad(f, 12))                  \
	X(route_pinned_unknown, KVR_ENOENT, KVR_ENOENT, route_bad(f, 13))                          \
	X(route_allow_all_unknown, KVR_ENOENT, KVR_ENOENT, route_bad(f, 14))                       \
	X(route_req_null, KVR_EINVAL, KVR_EINVAL, route_bad(f, 15))                                \
	X(route_d_null, KVR_EINVAL, KVR_EINVAL, route_bad(f, 16))                                  \
	X(route_r_null, KVR_EINVAL, KVR_EINVAL, route_bad(f, 17))                                  \
	X(route_no_rank, KVR_ENOENT, KVR_ENOENT, route_bad(f, 18))                                 \
	X(route_wait_r_null, KVR_EINVAL, KVR_EINVAL, kvr_route_wait(NULL, 1, 0, &f->d))            \
	X(route_wait_d_null, KVR_EINVAL, KVR_EINVAL, kvr_route_wait(f->r, 1, 0, NULL))             \
	X(route_wait_ticket_0, KVR_EINVAL, KVR_EINVAL, kvr_route_wait(f->r, 0, 0, &f->d))          \
	X(route_wait_unknown, KVR_ENOENT, KVR_ENOENT, kvr_route_wait(f->r, 12345, 1, &f->d))       \
	X(cancel_r_null, KVR_EINVAL, KVR_EINVAL, kvr_route_cancel(NULL, 1))                        \
	X(cancel_ticket_0, KVR_EINVAL, KVR_EINVAL, kvr_route_cancel(f->r, 0))                      \
	X(cancel_unknown, KVR_ENOENT, KVR_ENOENT, kvr_route_cancel(f->r, 12345))                   \
	X(prefill_r_null, KVR_EINVAL, KVR_EINVAL, kvr_request_prefill_done(NULL, f->live))         \
	X(prefill_attempt_0, KVR_EINVAL, KVR_EINVAL, kvr_request_prefill_done(f->r, 0))            \
	X(prefill_ended, KVR_ESTALE, KVR_ESTALE, kvr_request_prefill_done(f->r, f->ended))         \
	X(prefill_foreign, KVR_ENOENT, KVR_ESTALE,                                                 \
	  kvr_request_prefill_done(f->r, FOREIGN_ATTEMPT))                                         \
	X(prefill_never_issued, KVR_ENOENT, KVR_ESTALE, kvr_request_prefill_done(f->r, 1u << 20))  \
	X(output_r_null, KVR_EINVAL, KVR_EINVAL, kvr_request_output(NULL, f->live, f->tok, 1))     \
	X(output_attempt_0, KVR_EINVAL, KVR_EINVAL, kvr_request_output(f->r, 0, f->tok, 1))        \
	X(output_tokens_null, KVR_EINVAL, KVR_EINVAL, kvr_request_output(f->r, f->live, NULL, 1))  \
	X(output_too_many, KVR_EINVAL, KVR_EINVAL,                                                 \
	  kvr_request_output(f->r, f->live, f->tok, (size_t)UINT32_MAX + 1))                       \
	X(output_ended, KVR_ESTALE, KVR_ESTALE, kvr_request_output(f->r, f->ended, f->tok, 1))     \
	X(output_foreign, KVR_ENOENT, KVR_ESTALE,                                                  \
	  kvr_request_output(f->r, FOREIGN_ATTEMPT, f->tok, 1))                                    \
	X(output_ex_r_null, KVR_EINVAL, KVR_EINVAL,                                                \
	  kvr_request_output_ex(NULL, f->live, f->tok, 1, 0))                                      \
	X(output_ex_attempt_0, KVR_EINVAL, KVR_EINVAL,                                             \
	  kvr_request_output_ex(f->r, 0, f->tok, 1, 0))                                            \
	X(output_ex_tokens_null, KVR_EINVAL, KVR_EINVAL,                                           \
	  kvr_request_output_ex(f->r, f->live, NULL, 1, 0))                                        \
	X(output_ex_unknown_flag, KVR_EINVAL, KVR_EINVAL,                                          \
	  kvr_request_output_ex(f->r, f->live, f->tok, 1, 2))                                      \
	X(output_ex_ended, KVR_ESTALE, KVR_ESTALE,                                                 \
	  kvr_request_output_ex(f->r, f->ended, f->tok, 1, KVR_OUTPUT_FINAL))                      \
	X(output_ex_n_0, 0, 0, kvr_request_output_ex(f->r, f->live, NULL, 0, KVR_OUTPUT_FINAL))    \
	X(cached_r_null, KVR_EINVAL, KVR_EINVAL, kvr_request_cached(NULL, f->live, 0))             \
	X(cached_attempt_0, KVR_EINVAL, KVR_EINVAL, kvr_request_cached(f->r, 0, 0))                \
	X(cached_above_prompt, KVR_EINVAL, KVR_EINVAL,                                             \
	  kvr_request_cached(f->r, f->live, NTOK + 1))                                             \
	X(cached_ended, KVR_ESTALE, KVR_ESTALE, kvr_request_cached(f->r, f->ended, 0))             \
	X(cached_foreign, KVR_ENOENT, KVR_ESTALE, kvr_request_cached(f->r, FOREIGN_ATTEMPT, 0))    \
	X(cached_never_issued, KVR_ENOENT, KVR_ESTALE, kvr_request_cached(f->r, 1u << 20, 0))      \
	X(observe_r_null, KVR_EINVAL, KVR_EINVAL,                                                  \
	  observe(f, NULL, RANK, KVR_OBSERVE_RESIDENT, INC))                                       \
	X(observe_obs_null, KVR_EINVAL, KVR_EINVAL, kvr_rank_observe(f->r, RANK, NULL))            \
	X(observe_no_flag, KVR_EINVAL, KVR_EINVAL, observe(f, f->r, RANK, 0, INC))                 \
	X(observe_unknown_flag, KVR_EINVAL, KVR_EINVAL, observe(f, f->r, RANK, 4 | 1, INC))        \
	X(observe_unknown_rank, KVR_ENOENT, KVR_ENOENT, observe(f, f->r, UNK, 1, INC))             \
	X(observe_other_life, KVR_ESTALE, KVR_ESTALE, observe(f, f->r, RANK, 1, INC + 1))          \
	X(observe_watermark_unknown, 0, 0, observe(f, f->r, RANK, KVR_OBSERVE_WATERMARK, INC))     \
	X(events_not_events_mode, KVR_EINVAL, KVR_EINVAL,                                          \
	  kvr_events_apply(f->r, RANK, &(struct kvr_event){.type = KVR_EVENT_CLEARED}))            \
	X(finish_r_null, KVR_EINVAL, KVR_EINVAL, kvr_request_finish(NULL, f->live))                \
	X(finish_attempt_0, KVR_EINVAL, KVR_EINVAL, kvr_request_finish(f->r, 0))                   \
	X(finish_ended, KVR_ESTALE, KVR_ESTALE, kvr_request_finish(f->r, f->ended))                \
	X(finish_foreign, KVR_ENOENT, KVR_ESTALE, kvr_request_finish(f->r, FOREIGN_ATTEMPT))       \
	X(abort_r_null, KVR_EINVAL, KVR_EINVAL, kvr_request_abort(NULL, f->live))                  \
	X(abort_attempt_0, KVR_EINVAL, KVR_EINVAL, kvr_request_abort(f->r, 0))                     \
	X(abort_ended, KVR_ESTALE, KVR_ESTALE, kvr_request_abort(f->r, f->ended))                  \
	X(abort_foreign, KVR_ENOENT, KVR_ESTALE, kvr_request_abort(f->r, FOREIGN_ATTEMPT))         \
	X(abort_live_then_finish, KVR_ESTALE, KVR_ESTALE,                                          \
	  (kvr_request_abort(f->r, f->live), kvr_request_finish(f->r, f->live)))

ROUTER_ROWS(DEF)
static const struct row router_rows[] = {ROUTER_ROWS(ENT)};

Test(api_contract, router_calls)
{
	struct fx f;
	fx_init(&f);
	run_rows(&f, router_rows, sizeof(router_rows) / sizeof(router_rows[0]));
	fx_fini(&f);
}

/* The outputs the header promises along with the codes. */
Test(api_contract, outputs_with_the_codes)
{
	struct fx f;
	fx_init(&f);
	/* kvr_metrics_render: too small: the size needed, and buf NUL-terminated. */
	memset(f.buf, 'x', sizeof(f.buf));
	cr_expect_eq(kvr_metrics_render(f.r, f.buf, sizeof(f.buf), &f.n), KVR_ERANGE);
	cr_expect_gt(f.n, sizeof(f.buf));
	cr_expect_eq(f.buf[sizeof(f.buf) - 1], '\0');
	/* kvr_rank_blocks: cap too small: *n_out says how many. */
	cr_expect_eq(kvr_rank_blocks(f.r, RANK, f.blocks, 1, &f.n), KVR_ERANGE);
	cr_expect_eq(f.n, NTOK / BS);
	cr_expect_eq(kvr_rank_blocks(f.r, RANK, NULL, 0, &f.n), KVR_ERANGE, "a size query");
	cr_expect_eq(f.n, NTOK / BS);
	/* kvr_router_create with a bad config: the code, and *out NULL. */
	struct kvr_config c;
	kvr_config_init(&c);
	c.block_size = 0;
	struct kvr_router *r = (struct kvr_router *)&c;
	cr_expect_eq(kvr_router_create(&c, &r), KVR_ERANGE);
	cr_expect_null(r);
	/* kvr_route_wait on an unknown ticket leaves d unwritten. */
	struct kvr_decision d;
	memset(&d, 0x5a, sizeof(d));
	cr_expect_eq(kvr_route_wait(f.r, 99, 1, &d), KVR_ENOENT);
	cr_expect_eq(d.status, 0x5a5a5a5a);
	/* Events mode: kvr_request_cached changes nothing and says 0. */
	struct kvr_request q = f.q;
	cr_assert_eq(kvr_route(f.ev, &q, &d), 0);
	cr_expect_eq(kvr_request_cached(f.ev, d.attempt, BS), 0);
	fx_fini(&f);
}

/* kvr_config_validate / kvr_router_create: each impossible value, with the documented code. */
Test(api_contract, config_values)
{
	static const int cpus[1] = {-1}, cpus_big[1] = {4096};
	struct {
		const char *what;
		int want;
		struct kvr_config c;
	} t[32];
	size_t n = 0;
#define CASE(what_, want_, stmt)                                                                   \
	do {                                                                                       \
		t[n].what = what_;                                                                 \
		t[n].want = want_;                                                                 \
		kvr_config_init(&t[n].c);                                                          \
		struct kvr_config *c = &t[n].c;                                                    \
		stmt;                                                                              \
		n++;                                                                               \
	} while (0)
	CASE("block_size 0", KVR_ERANGE, c->block_size = 0);
	CASE("block_size 65537", KVR_ERANGE, c->block_size = 65537);
	CASE("n_shards 257", KVR_ERANGE, c->n_shards = 257);
	CASE("max_ranks 0", KVR_ERANGE, c->max_ranks = 0);
	CASE("max_ranks 65537", KVR_ERANGE, c->max_ranks = 65537);
	CASE("queue_capacity 0", KVR_ERANGE, c->queue_capacity = 0);
	CASE("lane_capacity 1", KVR_ERANGE, c->lane_capacity = 1);
	CASE("lane_capacity 2^22+1", KVR_ERANGE, c->lane_capacity = (1u << 22) + 1);
	CASE("lane_soft_depth 2^22+1", KVR_ERANGE, c->lane_soft_depth = (1u << 22) + 1);
	CASE("cpu_list entry -1", KVR_ERANGE, (c->cpu_list = cpus, c->n_cpus = 1));
	CASE("cpu_list entry 4096", KVR_ERANGE, (c->cpu_list = cpus_big, c->n_cpus = 1));
	CASE("booking_lazy_ns 1 ms + 1", KVR_ERANGE, c->booking_lazy_ns = 1000001);
	CASE("events_max_blocks 0", KVR_ERANGE, c->events_max_blocks = 0);
	CASE("n_cpus without cpu_list", KVR_EINVAL, c->n_cpus = 2);
	CASE("unknown mode", KVR_EINVAL, c->mode = (enum kvr_mode)7);
	CASE("unknown queue_policy", KVR_EINVAL, c->queue_policy = (enum kvr_queue_policy)7);
	CASE("overlap_credit -1", KVR_EINVAL, c->overlap_credit = -1);
	CASE("prefill_load_scale NaN", KVR_EINVAL, c->prefill_load_scale = NAN);
	CASE("temperature inf", KVR_EINVAL, c->temperature = INFINITY);
	CASE("queue_threshold -0.5", KVR_EINVAL, c->queue_threshold = -0.5);
	CASE("ttl_ns 0", KVR_EINVAL, c->ttl_ns = 0);
	CASE("lease_scan_interval_ns 0", KVR_EINVAL, c->lease_scan_interval_ns = 0);
	CASE("maint_every_tasks 0", KVR_EINVAL, c->maint_every_tasks = 0);
	CASE("maint_every_ns 0", KVR_EINVAL, c->maint_every_ns = 0);
	static char detail[32][256];
	for (size_t i = 0; i < n; i++) {
		cr_expect_eq(kvr_config_validate(&t[i].c), t[i].want, "validate: %s: %d (%s)",
		             t[i].what, kvr_config_validate(&t[i].c),
		             kvr_strerror(kvr_config_validate(&t[i].c)));
		/* The detail names the call and the field: "...: config.<field> ..." */
		expect_detail("kvr_config_validate", t[i].what);
		cr_expect(strstr(kvr_last_error(), ": config."), "%s: \"%s\" names no field",
		          t[i].what, kvr_last_error());
		snprintf(detail[i], sizeof(detail[i]), "%s", kvr_last_error());
		for (size_t j = 0; j < i; j++)
			cr_expect_str_neq(detail[i], detail[j], "%s and %s: one detail", t[j].what,
			                  t[i].what);
		struct kvr_router *r = (struct kvr_router *)&t[i];
		int rc = kvr_router_create(&t[i].c, &r);
		cr_expect_eq(rc, t[i].want, "create: %s: %d", t[i].what, rc);
		cr_expect_null(r, "create: %s: *out not NULL", t[i].what);
		expect_message(rc, t[i].what);
		expect_detail("kvr_router_create", t[i].what);
		cr_expect_str_eq(strchr(kvr_last_error(), ':'), strchr(detail[i], ':'),
		                 "%s: create and validate say different things", t[i].what);
		if (rc == 0)
			kvr_router_destroy(r);
	}
	/* The example of kvrouter.h. */
	cr_expect_eq(kvr_router_create(&t[0].c, &(struct kvr_router *){NULL}), KVR_ERANGE);
	cr_expect_str_eq(kvr_last_error(),
	                 "kvr_router_create: config.block_size 0 is out of range [1, 65536]");
}

/* ---------------------------------------------------------------- KV events */

static int event(struct fx *f, struct kvr_router *r, struct kvr_rank_id id, int which)
{
	(void)f;
	static const uint32_t tok3[3] = {1, 2, 3};
	struct kvr_event_block b[5] = {{.ext_hash = 101, .local_hash = 1},
	                               {.ext_hash = 102, .local_hash = 2},
	                               {.ext_hash = 103, .local_hash = 3},
	                               {.ext_hash = 104, .local_hash = 4},
	                               {.ext_hash = 105, .local_hash = 5}};
	uint64_t rm[1] = {101};
	struct kvr_event e = {.type = KVR_EVENT_STORED, .blocks = b, .n_blocks = 1};
	switch (which) {
	case 0:
		return kvr_events_apply(r, id, NULL);
	case 1:
		e.type = 9;
		break;
	case 2:
		e.n_blocks = 0;
		break;
	case 3:
		e.blocks = NULL;
		break;
	case 4: /* a block's tokens not block_size of them */
		b[0].tokens = tok3;
		b[0].n_tokens = 3;
		break;
	case 5: /* a block that is its own parent */
		e.has_parent = true;
		e.parent_ext_hash = 101;
		break;
	case 6:
		e.type = KVR_EVENT_REMOVED;
		e.removed = rm;
		e.n_removed = 0;
		break;
	case 7:
		e.type = KVR_EVENT_REMOVED;
		e.removed = NULL;
		e.n_removed = 1;
		break;
	case 8: /* below a parent the rank does not hold */
		e.has_parent = true;
		e.parent_ext_hash = 999;
		break;
	case 9: /* an id at or below the last applied one (10, applied by case 10 first) */
		e.event_id = 10;
		break;
	case 10: /* past the bound (events_max_blocks 4, no capacity) */
		e.event_id = 10;
		e.n_blocks = 5;
		break;
	case 11: /* within the bound: applied */
		e.event_id = 11;
		e.n_blocks = 2;
		break;
	case 12: /* an external hash the rank holds (case 11) for another block */
		e.event_id = 12;
		b[0].local_hash = 9;
		break;
	case 13: /* removed hashes the rank does not hold: skipped */
		e.type = KVR_EVENT_REMOVED;
		e.event_id = 13;
		rm[0] = 555;
		e.removed = rm;
		e.n_removed = 1;
		break;
	}
	return kvr_events_apply(r, id, &e);
}

#define EVENT_ROWS(X)                                                                              \
	X(ev_r_null, KVR_EINVAL, KVR_EINVAL, event(f, NULL, RANK, 1))                              \
	X(ev_null, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 0))                               \
	X(ev_unknown_type, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 1))                       \
	X(ev_stored_no_blocks, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 2))                   \
	X(ev_stored_blocks_null, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 3))                 \
	X(ev_block_size_mismatch, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 4))                \
	X(ev_self_parent, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 5))                        \
	X(ev_removed_none, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 6))                       \
	X(ev_removed_null, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 7))                       \
	X(ev_unknown_rank, KVR_ENOENT, KVR_ENOENT, event(f, f->ev, UNK, 11))                       \
	X(ev_parent_not_held, KVR_ENOENT, KVR_ENOENT, event(f, f->ev, RANK, 8))                    \
	X(ev_past_the_bound, KVR_ERANGE, KVR_ERANGE, event(f, f->ev, RANK, 10))                    \
	X(ev_id_not_above_last, KVR_ESTALE, KVR_ESTALE, event(f, f->ev, RANK, 9))                  \
	X(ev_within_the_bound, 0, 0, event(f, f->ev, RANK, 11))                                    \
	X(ev_ext_hash_of_another_block, KVR_EINVAL, KVR_EINVAL, event(f, f->ev, RANK, 12))         \
	X(ev_removed_not_held, 0, 0, event(f, f->ev, RANK, 13))                                    \
	X(ev_observe_events_mode, 0, 0, observe(f, f->ev, RANK, KVR_OBSERVE_RESIDENT, INC))

EVENT_ROWS(DEF)
static const struct row event_rows[] = {EVENT_ROWS(ENT)};

Test(api_contract, events_calls)
{
	struct fx f;
	fx_init(&f);
	run_rows(&f, event_rows, sizeof(event_rows) / sizeof(event_rows[0]));
	fx_fini(&f);
}

/* ---------------------------------------------------------------- hashing */

Test(api_contract, hashing)
{
	uint32_t t[32] = {0};
	uint64_t l[2], s[2];
	size_t n = 77;
	cr_expect_eq(kvr_hash_blocks(NULL, 32, BS, NULL, l, s), 0, "tokens NULL with a length");
	cr_expect_eq(kvr_hash_blocks(t, 32, 0, NULL, l, s), 0, "block_size 0");
	cr_expect_eq(kvr_hash_blocks(NULL, 0, BS, NULL, NULL, NULL), 0, "nothing to hash");
	cr_expect_eq(kvr_hash_blocks(t, 32, BS, "", NULL, NULL), 2, "outputs may be NULL");
	static const char *const what[3] = {"extend: n_blocks_out NULL",
	                                    "extend: tokens NULL with a length",
	                                    "extend: block_size 0"};
	char detail[3][256];
	for (int i = 0; i < 3; i++) {
		int rc = i == 0   ? kvr_hash_extend(NULL, t, 32, BS, NULL, l, s, NULL)
		         : i == 1 ? kvr_hash_extend(NULL, NULL, 32, BS, NULL, l, s, &n)
		                  : kvr_hash_extend(NULL, t, 32, 0, NULL, l, s, &n);
		cr_expect_eq(rc, KVR_EINVAL, "%s: %d", what[i], rc);
		expect_message(rc, what[i]);
		expect_detail("kvr_hash_extend", what[i]);
		snprintf(detail[i], sizeof(detail[i]), "%s", kvr_last_error());
		for (int j = 0; j < i; j++)
			cr_expect_str_neq(detail[i], detail[j]);
	}
	cr_expect_eq(kvr_hash_lora_seed(NULL), KVR_HASH_SEED);
	cr_expect_eq(kvr_hash_lora_seed(""), KVR_HASH_SEED);
	cr_expect_neq(kvr_hash_lora_seed("adapter"), KVR_HASH_SEED);
}

/* ---------------------------------------------------------------- documented no-ops */

Test(api_contract, documented_no_ops)
{
	kvr_config_init(NULL);
	kvr_request_init(NULL);
	kvr_feed_config_init(NULL);
	kvr_sync_config_init(NULL);
	kvr_router_destroy(NULL);
	kvr_feed_destroy(NULL);
	kvr_sync_detach(NULL);
	cr_expect_eq(kvr_router_now(NULL), 0);
	/* The init functions fill what they promise. */
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	cr_expect_eq(fc.replay_timeout_ms, 1000);
	cr_expect_eq(fc.max_msg_bytes, 64u << 20);
	cr_expect_eq(fc.rcv_hwm, 100000);
	struct kvr_sync_config sc;
	kvr_sync_config_init(&sc);
	cr_expect_str_eq(sc.servers, "nats://127.0.0.1:4222");
	cr_expect_str_eq(sc.cluster, "kvr");
	cr_expect_eq(sc.replica_id, 0);
	cr_expect_eq(sc.heartbeat_ms, 100);
	cr_expect_eq(sc.dead_after, 5);
}

/* ---------------------------------------------------------------- the KV event feed */

#ifdef KVR_HAVE_ZMQ
static int feed_create(struct fx *f, struct kvr_router *r, int which)
{
	(void)f;
	struct kvr_feed_config c;
	kvr_feed_config_init(&c);
	struct kvr_feed *out = (struct kvr_feed *)&c, **pout = &out;
	switch (which) {
	case 0:
		pout = NULL;
		break;
	case 1:
		c.replay_timeout_ms = 0;
		break;
	case 2:
		c.max_msg_bytes = 1023;
		break;
	case 3:
		c.rcv_hwm = 0;
		break;
	}
	int rc = kvr_feed_create(r, &c, pout);
	if (rc == 0) {
		kvr_feed_destroy(out);
		return SUCCEEDED;
	}
	if (pout)
		cr_expect_null(out, "kvr_feed_create left *out set on failure (%d)", rc);
	return rc;
}

static struct kvr_feed *the_feed;

static int feed_add(struct fx *f, struct kvr_feed *fd, const char *endpoint, bool no_ep)
{
	(void)f;
	struct kvr_feed_endpoint ep = {.endpoint = endpoint, .worker_id = 1};
	uint32_t id;
	return kvr_feed_add(fd, no_ep ? NULL : &ep, &id);
}

static struct kvr_feed_stats fstats;

#define FEED_ROWS(X)                                                                               \
	X(feed_create_r_null, KVR_EINVAL, KVR_EINVAL, feed_create(f, NULL, -1))                    \
	X(feed_create_out_null, KVR_EINVAL, KVR_EINVAL, feed_create(f, f->ev, 0))                  \
	X(feed_create_not_events, KVR_EINVAL, KVR_EINVAL, feed_create(f, f->r, -1))                \
	X(feed_create_replay_0, KVR_EINVAL, KVR_EINVAL, feed_create(f, f->ev, 1))                  \
	X(feed_create_msg_1023, KVR_EINVAL, KVR_EINVAL, feed_create(f, f->ev, 2))                  \
	X(feed_create_hwm_0, KVR_EINVAL, KVR_EINVAL, feed_create(f, f->ev, 3))                     \
	X(feed_add_f_null, KVR_EINVAL, KVR_EINVAL, feed_add(f, NULL, "tcp://127.0.0.1:1", false))  \
	X(feed_add_ep_null, KVR_EINVAL, KVR_EINVAL, feed_add(f, the_feed, NULL, true))             \
	X(feed_add_endpoint_null, KVR_EINVAL, KVR_EINVAL, feed_add(f, the_feed, NULL, false))      \
	X(feed_add_endpoint_empty, KVR_EINVAL, KVR_EINVAL, feed_add(f, the_feed, "", false))       \
	X(feed_add_endpoint_refused, KVR_EINVAL, KVR_EINVAL,                                       \
	  feed_add(f, the_feed, "bogus://x", false))                                               \
	X(feed_add_port_99999, KVR_EINVAL, KVR_EINVAL,                                             \
	  feed_add(f, the_feed, "tcp://127.0.0.1:99999", false))                                   \
	X(feed_add_port_0, KVR_EINVAL, KVR_EINVAL,                                                 \
	  feed_add(f, the_feed, "tcp://127.0.0.1:0", false))                                       \
	X(feed_add_port_5x, KVR_EINVAL, KVR_EINVAL,                                                \
	  feed_add(f, the_feed, "tcp://127.0.0.1:5x", false))                                      \
	X(feed_add_port_source_70000, KVR_EINVAL, KVR_EINVAL,                                      \
	  feed_add(f, the_feed, "tcp://127.0.0.1:70000;127.0.0.1:5557", false))                    \
	X(feed_remove_f_null, KVR_EINVAL, KVR_EINVAL, kvr_feed_remove(NULL, 0))                    \
	X(feed_remove_unknown, KVR_ENOENT, KVR_ENOENT, kvr_feed_remove(the_feed, 99))              \
	X(feed_stats_f_null, KVR_EINVAL, KVR_EINVAL, kvr_feed_get_stats(NULL, 0, &fstats))         \
	X(feed_stats_out_null, KVR_EINVAL, KVR_EINVAL, kvr_feed_get_stats(the_feed, 0, NULL))      \
	X(feed_stats_unknown, KVR_ENOENT, KVR_ENOENT, kvr_feed_get_stats(the_feed, 99, &fstats))   \
	X(feed_stats_all, 0, 0, kvr_feed_get_stats(the_feed, KVR_FEED_ALL, &fstats))               \
	X(feed_other_f_null, KVR_EINVAL, KVR_EINVAL,                                               \
	  kvr_feed_other_medium_blocks(NULL, 0, 0, f->blocks, 64, &f->n))                          \
	X(feed_other_n_out_null, KVR_EINVAL, KVR_EINVAL,                                           \
	  kvr_feed_other_medium_blocks(the_feed, 0, 0, f->blocks, 64, NULL))                       \
	X(feed_other_out_null_cap, KVR_EINVAL, KVR_EINVAL,                                         \
	  kvr_feed_other_medium_blocks(the_feed, 0, 0, NULL, 64, &f->n))                           \
	X(feed_other_unknown, KVR_ENOENT, KVR_ENOENT,                                              \
	  kvr_feed_other_medium_blocks(the_feed, 99, 0, f->blocks, 64, &f->n))                     \
	X(feed_add_valid, 0, 0, feed_add(f, the_feed, "tcp://127.0.0.1:1", false))                 \
	X(feed_other_known, 0, 0,                                                                  \
	  kvr_feed_other_medium_blocks(the_feed, 0, 0, f->blocks, 64, &f->n))                      \
	X(feed_remove_known, 0, 0, kvr_feed_remove(the_feed, 0))                                   \
	X(feed_remove_again, KVR_ENOENT, KVR_ENOENT, kvr_feed_remove(the_feed, 0))

FEED_ROWS(DEF)
static const struct row feed_rows[] = {FEED_ROWS(ENT)};

Test(api_contract, feed_calls)
{
	struct fx f;
	fx_init(&f);
	cr_assert_eq(kvr_feed_create(f.ev, NULL, &the_feed), 0);
	run_rows(&f, feed_rows, sizeof(feed_rows) / sizeof(feed_rows[0]));
	/* vLLM's default endpoint is where its publisher binds: the detail says what to connect. */
	cr_expect_eq(feed_add(&f, the_feed, "tcp://*:5557", false), KVR_EINVAL);
	cr_expect(strstr(kvr_last_error(), "tcp://HOST:5557") != NULL, "detail: %s",
	          kvr_last_error());
	kvr_feed_destroy(the_feed);
	fx_fini(&f);
}

/* An endpoint id given to the wrong feed (of this router or another) must not remove or report
 * that feed's own endpoint: every feed numbered its endpoints from 0. */
Test(api_contract, endpoint_ids_of_another_feed_are_refused)
{
	struct fx f;
	fx_init(&f);
	struct kvr_feed *f1, *f2;
	cr_assert_eq(kvr_feed_create(f.ev, NULL, &f1), 0);
	cr_assert_eq(kvr_feed_create(f.ev, NULL, &f2), 0);
	struct kvr_feed_endpoint e1 = {.endpoint = "tcp://127.0.0.1:1", .worker_id = 1};
	struct kvr_feed_endpoint e2 = {.endpoint = "tcp://127.0.0.1:2", .worker_id = 2};
	uint32_t id1, id2;
	cr_assert_eq(kvr_feed_add(f1, &e1, &id1), 0);
	cr_assert_eq(kvr_feed_add(f2, &e2, &id2), 0);
	struct kvr_feed_stats st;
	cr_expect_eq(kvr_feed_get_stats(f2, id1, &st), KVR_ENOENT, "f1's id named f2's endpoint");
	cr_expect_eq(kvr_feed_remove(f2, id1), KVR_ENOENT, "f1's id removed f2's endpoint");
	cr_expect_eq(kvr_feed_remove(f1, id2), KVR_ENOENT, "f2's id removed f1's endpoint");
	cr_expect_eq(kvr_feed_remove(f1, id1), 0);
	cr_expect_eq(kvr_feed_remove(f2, id2), 0);
	kvr_feed_destroy(f1);
	kvr_feed_destroy(f2);
	fx_fini(&f);
}
#else
/* Without ZeroMQ (sync/feed_none.c): every call says KVR_ENOTSUP, and the outputs it could
 * leave half-set are cleared. */
Test(api_contract, feed_not_built)
{
	struct fx f;
	fx_init(&f);
	struct kvr_feed *out = (struct kvr_feed *)&f;
	struct kvr_feed_endpoint ep = {.endpoint = "tcp://127.0.0.1:1"};
	struct kvr_feed_stats st;
	uint32_t id;
	f.n = 99;
	static const char *const what[] = {"kvr_feed_create",    "kvr_feed_create",
	                                   "kvr_feed_add",       "kvr_feed_remove",
	                                   "kvr_feed_get_stats", "kvr_feed_other_medium_blocks"};
	for (int i = 0; i < 6; i++) {
		int rc = i == 0   ? kvr_feed_create(f.ev, NULL, &out)
		         : i == 1 ? kvr_feed_create(NULL, NULL, NULL)
		         : i == 2 ? kvr_feed_add(NULL, &ep, &id)
		         : i == 3 ? kvr_feed_remove(NULL, 0)
		         : i == 4 ? kvr_feed_get_stats(NULL, KVR_FEED_ALL, &st)
		                  : kvr_feed_other_medium_blocks(NULL, 0, 0, f.blocks, 64, &f.n);
		cr_expect_eq(rc, KVR_ENOTSUP, "%s: %d (%s)", what[i], rc, kvr_strerror(rc));
		expect_message(rc, what[i]);
		expect_detail(what[i], what[i]);
		cr_expect(strstr(kvr_last_error(), "built without ZeroMQ"), "%s: \"%s\"", what[i],
		          kvr_last_error());
	}
	cr_expect_null(out);
	cr_expect_eq(f.n, 0);
	kvr_feed_destroy(NULL);
	fx_fini(&f);
}
#endif

/* ---------------------------------------------------------------- replica sync */

static char many_servers[33 * 24];

/* kvr_sync_attach with its config spoiled one way (which); a nothing-listens server otherwise
 * (port 1: refused at once), so a config that passes its checks fails with KVR_ETIMEDOUT. */
static int attach(struct fx *f, struct kvr_router *r, int which)
{
	(void)f;
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = "nats://127.0.0.1:1";
	c.replica_id = 7;
	struct kvr_sync *s = (struct kvr_sync *)&c, **ps = &s;
	const struct kvr_sync_config *pc = &c;
	switch (which) {
	case 0:
		ps = NULL;
		break;
	case 1:
		pc = NULL;
		break;
	case 2:
		c.replica_id = 0;
		break;
	case 3:
		c.servers = NULL;
		break;
	case 4:
		c.cluster = "";
		break;
	case 5:
		c.cluster = "a.b";
		break;
	case 6:
		c.cluster = "a123456789b123456789c123456789d123456789e123456789f123456789g1234";
		break;
	case 7:
		c.heartbeat_ms = 0;
		break;
	case 8:
		c.heartbeat_ms = 60001;
		break;
	case 9:
		c.dead_after = 1;
		break;
	case 10:
		c.servers = " , ";
		break;
	case 11: /* 33 servers: nats.c took the first 32, the rest were dropped unsaid */
		c.servers = many_servers;
		break;
	case 12: /* nats.c connected to port 34463 (the low 16 bits) */
		c.servers = "nats://127.0.0.1:1, nats://u:p@127.0.0.1:99999";
		break;
	case 13:
		c.servers = "tls://[::1]:0";
		break;
	}
	int rc = kvr_sync_attach(r, pc, ps);
	if (rc == 0) {
		kvr_sync_detach(s);
		return SUCCEEDED;
	}
	if (ps && s != NULL)
		return LEFT_OUT_SET; /* a failed attach must leave *out NULL */
	return rc;
}

static struct kvr_sync_stats sstats;
static uint64_t sseq;

#ifdef KVR_HAVE_NATS
#define SYNC_ATTACH_BAD  KVR_EINVAL
#define SYNC_UNREACHABLE KVR_ETIMEDOUT
#else
/* Without the `nats` feature (sync/replica_none.c) attach says so whatever its arguments. */
#define SYNC_ATTACH_BAD  KVR_ENOTSUP
#define SYNC_UNREACHABLE KVR_ENOTSUP
#endif

#define SYNC_ROWS(X)                                                                               \
	X(sync_attach_r_null, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, NULL, -1))               \
	X(sync_attach_out_null, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 0))              \
	X(sync_attach_cfg_null, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 1))              \
	X(sync_attach_id_0, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 2))                  \
	X(sync_attach_servers_null, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 3))          \
	X(sync_attach_cluster_empty, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 4))         \
	X(sync_attach_cluster_dot, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 5))           \
	X(sync_attach_cluster_65, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 6))            \
	X(sync_attach_heartbeat_0, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 7))           \
	X(sync_attach_heartbeat_60001, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 8))       \
	X(sync_attach_dead_after_1, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 9))          \
	X(sync_attach_servers_blank, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 10))        \
	X(sync_attach_servers_33, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 11))           \
	X(sync_attach_servers_port_99999, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 12))   \
	X(sync_attach_servers_port_0, SYNC_ATTACH_BAD, SYNC_ATTACH_BAD, attach(f, f->r, 13))       \
	X(sync_attach_unreachable, SYNC_UNREACHABLE, SYNC_UNREACHABLE, attach(f, f->r, -1))        \
	X(sync_attach_unreachable_again, SYNC_UNREACHABLE, SYNC_UNREACHABLE, attach(f, f->r, -1))  \
	X(sync_wait_ready_null, KVR_EINVAL, KVR_EINVAL, kvr_sync_wait_ready(NULL, 10))             \
	X(sync_drain_null, KVR_EINVAL, KVR_EINVAL, kvr_sync_drain(NULL, 10))                       \
	X(sync_peer_seq_null, KVR_EINVAL, KVR_EINVAL, kvr_sync_peer_seq(NULL, 1, &sseq))           \
	X(sync_get_stats_null, KVR_EINVAL, KVR_EINVAL, kvr_sync_get_stats(NULL, &sstats))

SYNC_ROWS(DEF)
static const struct row sync_rows[] = {SYNC_ROWS(ENT)};

Test(api_contract, sync_calls)
{
	struct fx f;
	fx_init(&f);
	for (int i = 0; i < 33; i++) /* nothing listens on port 1 */
		snprintf(many_servers + strlen(many_servers),
		         sizeof(many_servers) - strlen(many_servers), "%snats://127.0.0.%d:1",
		         i ? "," : "", i + 1);
	run_rows(&f, sync_rows, sizeof(sync_rows) / sizeof(sync_rows[0]));
	/* A failed attach leaves the router free to be attached (not KVR_EBUSY) and to route. */
	struct kvr_decision d;
	cr_expect_eq(kvr_route(f.r, &f.q, &d), 0);
	fx_fini(&f);
}

/* ---------------------------------------------------------------- the waiting queue */

/* kvr_route / kvr_route_wait / kvr_route_cancel on a router that queues: the documented codes
 * of a full queue, a passed deadline, and a ticket that is no longer queued. */
Test(api_contract, queue_calls)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.queue_threshold = 1.0;
	c.queue_capacity = 1;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_rank_add(r, RANK, INC, 1000, BS), 0);
	uint32_t t[NTOK];
	for (uint32_t i = 0; i < NTOK; i++)
		t[i] = i + 11;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = NTOK;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_DECIDED, "an idle rank admits");
	uint64_t first = d.attempt;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
	cr_assert_eq(d.status, KVR_QUEUED, "the rank is saturated: queued");
	uint64_t ticket = d.ticket;
	int rc = kvr_route(r, &q, &d);
	cr_expect_eq(rc, KVR_EAGAIN, "queue full: %d", rc);
	expect_message(rc, "route, queue full");
	expect_detail("kvr_route", "route, queue full");
	cr_expect(strstr(kvr_last_error(), "queue"), "%s", kvr_last_error());
	rc = kvr_route_wait(r, ticket, kvr_router_now(r) + 1000000, &d);
	cr_expect_eq(rc, KVR_ETIMEDOUT, "route_wait past its deadline: %d", rc);
	expect_message(rc, "route_wait, deadline");
	expect_detail("kvr_route_wait", "route_wait, deadline");
	cr_expect_eq(kvr_route_cancel(r, ticket), 0, "still queued after the timeout");
	rc = kvr_route_cancel(r, ticket);
	cr_expect_eq(rc, KVR_ENOENT, "cancelled twice: %d", rc);
	expect_message(rc, "route_cancel, cancelled");
	expect_detail("kvr_route_cancel", "route_cancel, cancelled");
	rc = kvr_route_wait(r, ticket, 1, &d);
	cr_expect_eq(rc, KVR_ENOENT, "waiting on a cancelled ticket: %d", rc);
	expect_detail("kvr_route_wait", "route_wait, cancelled");
	/* KVR_ROUTE_WAIT with a deadline: KVR_ETIMEDOUT, d->ticket names the queued request. */
	q.flags = KVR_ROUTE_WAIT;
	q.deadline_ns = kvr_router_now(r) + 1000000;
	memset(&d, 0, sizeof(d));
	rc = kvr_route(r, &q, &d);
	cr_expect_eq(rc, KVR_ETIMEDOUT, "KVR_ROUTE_WAIT past its deadline: %d", rc);
	expect_detail("kvr_route_wait", "KVR_ROUTE_WAIT, deadline");
	cr_expect_neq(d.ticket, 0);
	cr_expect_eq(kvr_route_cancel(r, d.ticket), 0, "it stays queued");
	cr_expect_eq(kvr_request_finish(r, first), 0);
	kvr_router_destroy(r);
}

/* ---------------------------------------------------------------- calls from the callbacks */

/* kvr_config.on_event_gap and on_admit: "no router lock held: the API may be called from it".
 * What an embedder does there: read the rank, resync it (a cleared event, a reset), end the
 * admitted attempt.  Every call must answer (no deadlock) with a documented code. */
struct cb_seen {
	struct kvr_router *r;
	int gaps, admits;
	int stats_rc, clear_rc, reset_rc, finish_rc, route_rc;
};

static void gap_cb(void *ctx, uint64_t worker_id, uint32_t dp_rank, uint64_t expected, uint64_t got)
{
	(void)expected;
	(void)got;
	struct cb_seen *s = ctx;
	struct kvr_rank_id id = {worker_id, dp_rank};
	struct kvr_rank_stats st;
	s->gaps++;
	s->stats_rc = kvr_rank_get_stats(s->r, id, &st);
	s->clear_rc = kvr_events_apply(s->r, id, &(struct kvr_event){.type = KVR_EVENT_CLEARED});
	s->reset_rc = kvr_rank_reset(s->r, id, INC + 1);
}

static void admit_cb(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ticket;
	struct cb_seen *s = ctx;
	struct kvr_rank_stats st;
	s->admits++;
	s->stats_rc = kvr_rank_get_stats(s->r, d->rank, &st);
	s->finish_rc = kvr_request_finish(s->r, d->attempt);
	uint32_t t[NTOK] = {0};
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = NTOK;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	struct kvr_decision qd;
	s->route_rc = kvr_route(s->r, &q, &qd);
}

Test(api_contract, calls_from_callbacks)
{
	struct cb_seen s = {0};
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	c.mode = KVR_MODE_EVENTS;
	c.on_event_gap = gap_cb;
	c.callback_ctx = &s;
	cr_assert_eq(kvr_router_create(&c, &s.r), 0);
	cr_assert_eq(kvr_rank_add(s.r, RANK, INC, KVR_CAPACITY_NONE, 0), 0);
	struct kvr_event_block b = {.ext_hash = 1, .local_hash = 1};
	struct kvr_event e = {.type = KVR_EVENT_STORED, .event_id = 1, .blocks = &b, .n_blocks = 1};
	cr_assert_eq(kvr_events_apply(s.r, RANK, &e), 0);
	e.event_id = 5;
	b = (struct kvr_event_block){.ext_hash = 2, .local_hash = 2};
	int rc = kvr_events_apply(s.r, RANK, &e);
	cr_expect_eq(rc, 0, "a gap is applied: %d", rc);
	cr_expect_eq(s.gaps, 1);
	cr_expect_eq(s.stats_rc, 0, "stats from on_event_gap: %d", s.stats_rc);
	cr_expect_eq(s.clear_rc, 0, "a cleared event from on_event_gap: %d", s.clear_rc);
	cr_expect_eq(s.reset_rc, 0, "kvr_rank_reset from on_event_gap: %d", s.reset_rc);
	kvr_router_destroy(s.r);

	memset(&s, 0, sizeof(s));
	kvr_config_init(&c);
	c.n_shards = 1;
	c.sync_booking = true;
	c.queue_threshold = 1.0;
	c.on_admit = admit_cb;
	c.callback_ctx = &s;
	cr_assert_eq(kvr_router_create(&c, &s.r), 0);
	cr_assert_eq(kvr_rank_add(s.r, RANK, INC, 1000, BS), 0);
	uint32_t t[NTOK];
	for (uint32_t i = 0; i < NTOK; i++)
		t[i] = i + 5;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = t;
	q.n_tokens = NTOK;
	struct kvr_decision d1, d2;
	cr_assert_eq(kvr_route(s.r, &q, &d1), 0);
	cr_assert_eq(d1.status, KVR_DECIDED);
	cr_assert_eq(kvr_route(s.r, &q, &d2), 0);
	cr_assert_eq(d2.status, KVR_QUEUED);
	cr_expect_eq(kvr_request_finish(s.r, d1.attempt), 0, "finish admits the queued one");
	cr_expect_eq(s.admits, 1);
	cr_expect_eq(s.stats_rc, 0, "stats from on_admit: %d", s.stats_rc);
	cr_expect_eq(s.finish_rc, 0, "finish from on_admit: %d", s.finish_rc);
	cr_expect_eq(s.route_rc, 0, "a query-only route from on_admit: %d", s.route_rc);
	kvr_router_destroy(s.r);
}

/* ---------------------------------------------------------------- kvr_last_error */

/* kvrouter.h: "" before a thread's first failure; a success writes nothing (the last failure's
 * detail stays); the pointer is the thread's own. */
Test(api_contract, last_error_convention)
{
	struct fx f;
	fx_init(&f); /* its calls all succeed */
	cr_expect_str_eq(kvr_last_error(), "", "before any failure: \"%s\"", kvr_last_error());
	const char *p = kvr_last_error();
	cr_expect_eq(route_bad(&f, 2), KVR_EINVAL);
	cr_expect_str_eq(kvr_last_error(),
	                 "kvr_route: req.n_tokens is 0; a prompt needs at least one token");
	cr_expect_eq(kvr_last_error(), p, "one buffer per thread");
	struct kvr_decision d;
	struct kvr_request q = f.q;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	cr_expect_eq(kvr_route(f.r, &q, &d), 0);
	cr_expect_eq(kvr_request_prefill_done(f.r, f.live), 0);
	cr_expect_str_eq(kvr_last_error(),
	                 "kvr_route: req.n_tokens is 0; a prompt needs at least one token",
	                 "a success changed it: \"%s\"", kvr_last_error());
	fx_fini(&f);
}

/* Two threads failing different calls at once: each reads its own detail, every time. */
struct detail_thread {
	struct fx *f;
	int which; /* 0: kvr_route with n_tokens 0; 1: kvr_rank_get_stats of an unknown rank */
	int mixed, failed;
	pthread_barrier_t *go;
};

static void *detail_main(void *arg)
{
	struct detail_thread *t = arg;
	const char *want = t->which ? "kvr_rank_get_stats: no rank (worker 77, dp 3)"
	                            : "kvr_route: req.n_tokens is 0; a prompt needs at least one "
	                              "token";
	pthread_barrier_wait(t->go);
	for (int i = 0; i < 2000; i++) {
		struct kvr_rank_stats st;
		int rc = t->which ? kvr_rank_get_stats(t->f->r, UNK, &st) : route_bad(t->f, 2);
		t->failed += rc != 0;
		t->mixed += strcmp(kvr_last_error(), want) != 0;
	}
	return NULL;
}

Test(api_contract, last_error_per_thread)
{
	struct fx f;
	fx_init(&f);
	pthread_barrier_t go;
	pthread_barrier_init(&go, NULL, 2);
	struct detail_thread t[2] = {{&f, 0, 0, 0, &go}, {&f, 1, 0, 0, &go}};
	pthread_t th[2];
	for (int i = 0; i < 2; i++)
		cr_assert_eq(pthread_create(&th[i], NULL, detail_main, &t[i]), 0);
	for (int i = 0; i < 2; i++)
		pthread_join(th[i], NULL);
	for (int i = 0; i < 2; i++) {
		cr_expect_eq(t[i].failed, 2000, "thread %d: calls failed %d times", i, t[i].failed);
		cr_expect_eq(t[i].mixed, 0, "thread %d read another's detail %d times", i,
		             t[i].mixed);
	}
	cr_expect_str_eq(kvr_last_error(), "", "the threads' failures showed here: \"%s\"",
	                 kvr_last_error());
	pthread_barrier_destroy(&go);
	fx_fini(&f);
}

#ifdef KVR_HAVE_NATS
/* The calls on a live replica handle (a throwaway nats-server): a second attachment, an unknown
 * peer, NULL outputs; and the waits of a replica alone in its cluster. */
Test(api_contract, sync_handle_calls)
{
	if (!kvr_test_nats_installed())
		cr_skip_test("no nats-server");
	cr_assert_eq(kvr_test_nats_start(), 0);
	struct kvr_router *r = router(KVR_MODE_APPROX_LRU, 2, 1u << 21);
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = kvr_test_nats_url();
	c.cluster = "apicontract";
	c.replica_id = 1;
	c.snapshot_timeout_ms = 200;
	struct kvr_sync *s = NULL, *s2 = (struct kvr_sync *)&c;
	cr_assert_eq(kvr_sync_attach(r, &c, &s), 0);
	c.replica_id = 2;
	int rc = kvr_sync_attach(r, &c, &s2);
	cr_expect_eq(rc, KVR_EBUSY, "a second attachment: %d", rc);
	cr_expect_null(s2);
	expect_message(rc, "sync_attach, attached");
	expect_detail("kvr_sync_attach", "sync_attach, attached");
	cr_expect_eq(kvr_sync_wait_ready(s, 5000), 0, "alone in the cluster: ready");
	cr_expect_eq(kvr_sync_drain(s, 5000), 0);
	uint64_t seq = 7;
	struct kvr_sync_stats st;
	static const struct {
		const char *what, *fn;
		int want;
	} rows[] = {
	    {"peer_seq, unknown peer", "kvr_sync_peer_seq", KVR_ENOENT},
	    {"peer_seq, seq NULL", "kvr_sync_peer_seq", KVR_EINVAL},
	    {"get_stats, out NULL", "kvr_sync_get_stats", KVR_EINVAL},
	    {"get_stats", "kvr_sync_get_stats", 0},
	};
	for (int i = 0; i < 4; i++) {
		int rc = i == 0   ? kvr_sync_peer_seq(s, 99, &seq)
		         : i == 1 ? kvr_sync_peer_seq(s, 99, NULL)
		         : i == 2 ? kvr_sync_get_stats(s, NULL)
		                  : kvr_sync_get_stats(s, &st);
		cr_expect_eq(rc, rows[i].want, "%s: %d (%s)", rows[i].what, rc, kvr_strerror(rc));
		expect_message(rc, rows[i].what);
		if (rc)
			expect_detail(rows[i].fn, rows[i].what);
	}
	cr_expect(st.connected && st.ready);
	kvr_sync_detach(s);
	kvr_router_destroy(r);
	kvr_test_nats_stop();
}
#endif
