/*
 * tests/fuzz/fuzz_api.c - the public API as a whole, fuzzed against a reference model of what
 * kvrouter.h promises.
 *
 * One input is one program: its first bytes choose a configuration (every mode, block size,
 * shards, max_ranks, queue on or off, policy, on_admit or not, booking, lease interval), the rest
 * is a sequence of API calls, each decoded from a few bytes: rank add / remove / set_capacity /
 * reset / stats / blocks, routes (tokens or hashes, LoRA, pinned, allow lists, query-only,
 * KVR_ROUTE_WAIT, overrides, and malformed requests), queue waits and cancels, prefill done /
 * output (kvr_request_output, and _ex with and without KVR_OUTPUT_FINAL) / finish / abort on live,
 * ended, stale and made-up attempt ids, engine truth (kvr_request_cached, kvr_rank_observe), KV
 * events (well formed and malformed, in every mode), metrics, syncs, virtual clock steps, the
 * hash functions, config validation, and NULL arguments.
 * Every call is executed on a real router (virtual time) and its return code is checked against the
 * set the header documents for that call, and so is what it left in kvr_last_error() (API(): a
 * failure's detail names the function, a success leaves the detail as it was; fuzz_api.h,
 * fuzz_err_verdict), and where the model knows the answer exactly (rank
 * membership, incarnations, attempt state, queue tickets, events-mode block sets), against that
 * answer.  The outcomes the queue keeps for a collector nobody calls (kvr_queue_uncollected)
 * never outnumber the model's tickets that may have one, and go by themselves once of no use:
 * after a call that left every such admission's attempt ended (track_uncollected), and at the end,
 * before the cancels that would take them, as the clock moves (check_uncollected_end).  At the end
 * every attempt is finished, every ticket cancelled or collected, the router synced, and then: all
 * load is zero on every rank, resident <= capacity on every capacity-bounded LRU rank, every ended
 * attempt is still stale, and after destroy the library's allocation counter is back where it
 * started (no leak).
 *
 * What the model does not predict, it bounds: which rank a decision picks (it must be eligible),
 * whether a request queues (only when the queue is on), when a lease expires (never before one
 * scan interval without progress), and when the queue admits (a ticket has one outcome, reported
 * once).
 *
 * Two switches, off by default (each then runs other programs from the same bytes): --craft
 * (FUZZ_API_CRAFT=1) crafts hash-given prompts (craft_hashes); --events (FUZZ_API_EVENTS=1) puts
 * every router in events mode and has the events name their blocks as engines do (events_ext:
 * the router's own sequence hash, an engine hash per rank life as vLLM's random hash seed gives,
 * or a hash another block holds) and probes the index with query-only routes whose overlap the
 * model knows exactly (op_ev_probe).
 *
 * Built two ways (tests/meson.build, tests/fuzz/meson.build): as a libFuzzer target
 * (-Dfuzz=true, clang), and linked with fuzz_api_main.c as a seeded driver
 * (fuzz_api_seeds --seeds N --first S; a failing seed is printed and replays alone with
 * --first S --seeds 1).
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "core/hash.h"
#include "core/router_internal.h" /* kvr_queue_depth, kvr_queue_uncollected: the gauges */
#include "fuzz_api.h"
#include "kvrouter.h"
#include "tests/common/fresh_thread.h"
#include "tests/common/splitmix.h"

/* ---------------------------------------------------------------- failure report */

static _Thread_local const char *cur_call = "";
static _Thread_local size_t cur_op;
static _Thread_local char cur_detail[256];
static bool trace_on;           /* FUZZ_API_TRACE */
uint64_t fuzz_api_current_seed; /* set by the seeded driver, printed on failure */
bool fuzz_api_craft;            /* fuzz_api_seeds --craft: crafted hash-given prompts */
bool fuzz_api_events;           /* fuzz_api_seeds --events: events mode as vLLM feeds it */
bool fuzz_api_limits;           /* fuzz_api_seeds --limits: config values at their limits */
bool fuzz_api_clock_back;       /* fuzz_api_seeds --clock-back: the clock also steps back */
bool fuzz_api_slow_admit;       /* fuzz_api_seeds --slow-admit: on_admit off the program's thread
                                   takes a millisecond */
bool fuzz_api_stall_admit;      /* fuzz_api_seeds --stall-admit: the admission thread's clock
                                   reads take a millisecond (vclock) */

#define FAIL(...)                                                                                  \
	do {                                                                                       \
		fprintf(stderr, "fuzz_api: seed %" PRIu64 " op %zu (%s): ", fuzz_api_current_seed, \
		        cur_op, cur_call);                                                         \
		fprintf(stderr, __VA_ARGS__);                                                      \
		fprintf(stderr, "\nfuzz_api: model: %s\n", cur_detail);                            \
		abort();                                                                           \
	} while (0)
#define CHECK(c, ...)                                                                              \
	do {                                                                                       \
		if (!(c))                                                                          \
			FAIL(__VA_ARGS__);                                                         \
	} while (0)

/* Every int-returning call of the API goes through API(fn, args...) (or API_OR, for a call whose
 * failure may carry another function's name): it returns fn(args...), after checking what the
 * call left in kvr_last_error() (fuzz_api.h, fuzz_err_verdict). */
static int api_checked(const char *fn, const char *alt, int rc)
{
	const char *why = fuzz_err_verdict(fn, alt, rc);
	CHECK(!why, "kvr_last_error(): %s", why);
	return rc;
}
#define API(fn, ...)         api_checked(#fn, NULL, (fuzz_err_arm(#fn, NULL), fn(__VA_ARGS__)))
#define API_OR(fn, alt, ...) api_checked(#fn, alt, (fuzz_err_arm(#fn, alt), fn(__VA_ARGS__)))
/* The calls that return no code (void, a count, a hash) must leave the detail as it was: a
 * successful call does not write it, and these have no failure to report (kvr_hash_blocks: "use
 * kvr_hash_extend() to get an error code"). */
static void api_untouched(const char *fn)
{
	const char *why = fuzz_err_untouched(fn);
	CHECK(!why, "kvr_last_error(): %s", why);
}
#define API_VOID(fn, ...)                                                                          \
	do {                                                                                       \
		fuzz_err_arm(#fn, NULL);                                                           \
		fn(__VA_ARGS__);                                                                   \
		api_untouched(#fn);                                                                \
	} while (0)
#define API_VAL(fn, ...)                                                                           \
	({                                                                                         \
		fuzz_err_arm(#fn, NULL);                                                           \
		__typeof__(fn(__VA_ARGS__)) api_v_ = fn(__VA_ARGS__);                              \
		api_untouched(#fn);                                                                \
		api_v_;                                                                            \
	})

struct fuzz_api_stats fuzz_api_totals;

/* ---------------------------------------------------------------- input */

struct src {
	const uint8_t *p;
	size_t n, i;
};

static bool src_done(const struct src *s)
{
	return s->i >= s->n;
}

static uint32_t u8(struct src *s)
{
	return s->i < s->n ? s->p[s->i++] : 0;
}

static uint32_t u16(struct src *s)
{
	return u8(s) | u8(s) << 8;
}

static uint64_t u64(struct src *s)
{
	uint64_t v = 0;
	for (int k = 0; k < 8; k++)
		v |= (uint64_t)u8(s) << (8 * k);
	return v;
}

/* ---------------------------------------------------------------- model */

#define N_IDS   8 /* rank ids: workers 0..3 x dp 0..1 */
#define MAX_ATT 1024
#define MAX_END 64
#define MAX_TIX 64
#define MAX_BLK 64
#define MAX_TOK 2048
#define NO_IDX  (-1)
#define BAD_PIN (-2) /* pinned to a rank id outside the model's: never eligible */

enum { A_LIVE, A_ENDED };
enum { T_QUEUED, T_DONE };

struct mblk {
	uint64_t ext, node; /* node: the router's sequence hash of the block (its whole prefix) */
	uint32_t copies;    /* events mode counts copies: vLLM may hold two of one hash */
};

struct mrank {
	bool present;
	uint64_t inc;
	uint64_t cap; /* as given */
	uint32_t mbt;
	uint64_t life; /* bumped whenever its attempts become stale */
	bool cap_finite_lru;
	/* engine truth (op_heal): kvr_rank_observe's resident count raises the capacity the
	 * prediction evicts at (so resident <= max(cap, the largest observed)); a
	 * kvr_request_cached report may prove it larger by an amount the model does not follow */
	uint64_t cap_seen;
	bool cap_proved;
	/* events mode */
	bool have_ev, ev_unknown;
	uint64_t last_ev;
	struct mblk blk[MAX_BLK];
	int nblk;
	bool blk_unknown; /* overflowed the model: stop comparing */
};

struct matt {
	uint64_t id;
	int rank;
	uint64_t life;
	uint64_t touch;   /* virtual time of the last progress */
	uint64_t nreq;    /* the decision's required_blocks (the prompt has at least as many) */
	bool maybe_stale; /* admitted from the queue around a rank change: 0 or KVR_ESTALE */
};

struct mtick {
	uint64_t t;
	int state;
	bool waited;
	int pinned;           /* rank index or NO_IDX */
	uint8_t allow;        /* bit set of rank indexes, 0 = any */
	bool allow_some;      /* an allow list was given */
	uint64_t enq;         /* virtual time it was queued: the earliest its admission can be */
	uint64_t life[N_IDS]; /* each rank's life when it was queued */
	bool clock_back;      /* the clock stepped back while it was pending (op_clock) */
	bool told;            /* wait or cancel found it gone: on_admit's report is on its way */
	bool settled;         /* out of the waiting list (the queue's depth read 0 since) */
	bool may_fail;        /* had no eligible rank while waiting (kept or not then): a failed
	                         outcome may be kept for it (track_uncollected) */
};

struct prog {
	struct kvr_router *r;
	struct kvr_config cfg;
	uint64_t now;
	uint64_t now_hw; /* the highest reading the clock gave (--clock-back steps below it) */
	struct src in;
	struct mrank rk[N_IDS];
	struct matt att[MAX_ATT];
	int n_att;
	uint64_t ended[MAX_END]; /* recently ended attempt ids: must stay stale */
	int n_ended, ended_pos;
	/* Attempts admitted from the queue onto a rank removed since, their booking posted
	 * (sync_booking off): their calls return 0 or KVR_ESTALE until the rank's shard has seen
	 * the booking (kvrouter.h, kvr_route), which a kvr_router_sync makes sure of; then ended.
	 */
	uint64_t late_gone[MAX_END];
	int n_late_gone;
	struct mtick tix[MAX_TIX];
	int n_tix;
	uint64_t max_ticket, max_attempt_seen;
	/* A kept outcome's attempt may live on the rank's current life (see track_uncollected) */
	bool kept_live[N_IDS];
	/* on_admit reports, drained after every call */
	pthread_mutex_t mu;
	uint64_t adm_ticket[MAX_TIX];
	struct kvr_decision adm_d[MAX_TIX];
	bool adm_late[MAX_TIX]; /* reported off the program's thread (the admission thread) */
	int n_adm;
	pthread_t self; /* the thread that runs the program */
	uint64_t gaps_reported;
	uint32_t toks[MAX_TOK];
	uint64_t hashes[MAX_TOK];
	uint64_t seqs[MAX_TOK]; /* their sequence hashes (kvr_request.seq_hashes) */
	uint64_t calls;
	uint64_t routes; /* kvr_route calls so far */
	/* fuzz_api_craft: the last prompt's honest chain, and interior hashes of earlier ones */
	uint64_t prev_l[MAX_TOK], prev_s[MAX_TOK];
	size_t prev_nb;
	uint64_t hist[256];
	unsigned n_hist, hist_pos;
	/* fuzz_api_events: every block an event stored (any rank), to build prompts from */
	struct dblk {
		uint64_t seq, parent, local; /* parent: its sequence hash, 0 = a root */
	} dict[256];
	unsigned n_dict, dict_pos;
};

static struct kvr_rank_id rid(int i)
{
	return (struct kvr_rank_id){.worker_id = (uint64_t)(i / 2), .dp_rank = (uint32_t)(i % 2)};
}

static int rindex_of(struct kvr_rank_id id)
{
	if (id.worker_id >= N_IDS / 2 || id.dp_rank > 1)
		return NO_IDX;
	return (int)(id.worker_id * 2 + id.dp_rank);
}

static int n_present(const struct prog *p)
{
	int n = 0;
	for (int i = 0; i < N_IDS; i++)
		n += p->rk[i].present;
	return n;
}

/* --stall-admit: the router's admission thread ("kvr-admit", core/queue_thread.c) sleeps 1 ms in
 * every clock read.  Its pass reads the clock right after each admission, off the queue's lock and
 * before it counts the request out of the queue (core/queue.c, kvr_queue_pump): the preemption
 * there that a loaded machine makes, during which a route finds the queue full. */
static bool on_admission_thread(void)
{
	char name[16] = "";
	return prctl(PR_GET_NAME, name) == 0 && !strcmp(name, "kvr-admit");
}

static uint64_t vclock(void *ctx)
{
	if (fuzz_api_stall_admit && on_admission_thread())
		usleep(1000);
	return __atomic_load_n((uint64_t *)ctx, __ATOMIC_RELAXED);
}

/* A report on the program's thread comes from the call that just returned, which admitted it
 * after the model's change (drain_admits); one on another thread, the router's admission thread,
 * from a pass that a shard woke at any time since the request was queued, and that may still be
 * running when the program's next call returns: the report comes late, told with the model's
 * state of a later call.  --slow-admit makes those late on purpose, as a slow embedder's
 * callback would (or a preemption between the admission and the report). */
static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	struct prog *p = ctx;
	bool late = !pthread_equal(pthread_self(), p->self);
	if (late && fuzz_api_slow_admit)
		usleep(1000);
	pthread_mutex_lock(&p->mu);
	CHECK(p->n_adm < MAX_TIX, "on_admit: more reports than tickets");
	p->adm_ticket[p->n_adm] = ticket;
	p->adm_late[p->n_adm] = late;
	p->adm_d[p->n_adm++] = *d;
	pthread_mutex_unlock(&p->mu);
}

static void on_gap(void *ctx, uint64_t w, uint32_t dp, uint64_t expected, uint64_t got)
{
	struct prog *p = ctx;
	(void)w;
	(void)dp;
	CHECK(got > expected, "on_event_gap: got %" PRIu64 " <= expected %" PRIu64, got, expected);
	__atomic_add_fetch(&p->gaps_reported, 1, __ATOMIC_RELAXED);
}

static void end_attempt(struct prog *p, int k)
{
	p->ended[p->ended_pos] = p->att[k].id;
	p->ended_pos = (p->ended_pos + 1) % MAX_END;
	if (p->n_ended < MAX_END)
		p->n_ended++;
	p->att[k] = p->att[--p->n_att];
}

/* A rank's attempts become stale (remove, reset, new incarnation). */
static void rank_new_life(struct prog *p, int i)
{
	p->rk[i].life++;
	p->kept_live[i] = false; /* track_uncollected sets it again for a ticket still waiting */
	for (int k = 0; k < p->n_att;)
		if (p->att[k].rank == i)
			end_attempt(p, k);
		else
			k++;
}

static void rank_forget_blocks(struct mrank *m)
{
	m->nblk = 0;
	m->blk_unknown = false;
}

static bool eligible(const struct prog *p, int ri, int pinned, uint8_t allow, bool allow_some)
{
	if (ri == NO_IDX || pinned == BAD_PIN || !p->rk[ri].present)
		return false;
	if (pinned != NO_IDX && ri != pinned)
		return false;
	if (allow_some && !(allow & (1u << ri)))
		return false;
	return true;
}

static bool any_eligible(const struct prog *p, int pinned, uint8_t allow, bool allow_some)
{
	for (int i = 0; i < N_IDS; i++)
		if (eligible(p, i, pinned, allow, allow_some))
			return true;
	return false;
}

static void add_attempt_at(struct prog *p, const struct kvr_decision *d, uint64_t touch)
{
	CHECK(d->attempt != 0, "admitted decision without an attempt");
	int ri = rindex_of(d->rank);
	CHECK(ri != NO_IDX && p->rk[ri].present, "admitted on an absent rank");
	for (int k = 0; k < p->n_att; k++)
		CHECK(p->att[k].id != d->attempt, "attempt id %" PRIu64 " issued twice",
		      d->attempt);
	for (int k = 0; k < p->n_ended; k++)
		CHECK(p->ended[k] != d->attempt, "ended attempt id %" PRIu64 " reissued",
		      d->attempt);
	if (p->n_att == MAX_ATT) {
		/* the model is full: finish the oldest for real */
		cur_call = "finish (model full)";
		int rc = API(kvr_request_finish, p->r, p->att[0].id);
		CHECK(rc == 0 || rc == KVR_ESTALE, "rc %d", rc);
		end_attempt(p, 0);
	}
	p->att[p->n_att++] = (struct matt){.id = d->attempt,
	                                   .rank = ri,
	                                   .life = p->rk[ri].life,
	                                   .touch = touch,
	                                   .nreq = d->required_blocks};
	if (trace_on)
		fprintf(stderr, " [+attempt %" PRIx64 " rank %d ticket %" PRIu64 "]", d->attempt,
		        ri, d->ticket);
}

static void add_attempt(struct prog *p, const struct kvr_decision *d)
{
	add_attempt_at(p, d, p->now);
}

static struct mtick *ticket_find(struct prog *p, uint64_t t)
{
	for (int k = 0; k < p->n_tix; k++)
		if (p->tix[k].t == t)
			return &p->tix[k];
	return NULL;
}

static void ticket_drop(struct prog *p, struct mtick *m)
{
	*m = p->tix[--p->n_tix];
}

static bool admission_error_ok(int rc)
{
	return rc == KVR_ENOENT || rc == KVR_ENOMEM || rc == KVR_ERANGE;
}

/* A queued request's outcome: `now` when the call that just returned admitted it (on_admit on the
 * program's thread); else (kvr_route_wait, or on_admit on the admission thread: see on_admit) the
 * admission may have happened any time since it was queued, on a rank eligible then, and its
 * lease has been running since. */
static void ticket_outcome(struct prog *p, struct mtick *m, int rc, const struct kvr_decision *d,
                           bool now)
{
	CHECK(d->ticket == m->t, "outcome for ticket %" PRIu64 " names %" PRIu64, m->t, d->ticket);
	if (rc == 0 && d->status == KVR_DECIDED) {
		int ri = rindex_of(d->rank);
		if (now) {
			CHECK(eligible(p, ri, m->pinned, m->allow, m->allow_some),
			      "queued request admitted on an ineligible rank");
			add_attempt(p, d);
		} else {
			/* Admitted some time since it was queued, on a rank eligible then. */
			CHECK(ri != NO_IDX && (m->pinned == NO_IDX || ri == m->pinned) &&
			          (!m->allow_some || (m->allow & (1u << ri))),
			      "queued request admitted on an ineligible rank");
			if (!p->rk[ri].present && !p->cfg.sync_booking &&
			    p->n_late_gone < MAX_END) {
				/* removed since, maybe before the shard saw the booking: stale from
				 * the next sync on (ASan, --events --limits --clock-back seed
				 * 3460000220: an output on it returned 0, 1 run in ~50) */
				p->late_gone[p->n_late_gone++] = d->attempt;
			} else if (!p->rk[ri].present) {
				/* removed since: stale either way */
				p->ended[p->ended_pos] = d->attempt;
				p->ended_pos = (p->ended_pos + 1) % MAX_END;
				if (p->n_ended < MAX_END)
					p->n_ended++;
			} else {
				add_attempt_at(p, d, m->enq);
				/* Admitted at a reading the clock may since have gone below: as
				 * for the attempts live at the step (op_clock), the reaper may
				 * find it expired sooner than one interval after now. */
				if (p->rk[ri].life != m->life[ri] || m->clock_back)
					p->att[p->n_att - 1].maybe_stale = true;
			}
		}
	} else {
		CHECK(d->status == KVR_FAILED, "outcome status %d rc %d", d->status, rc);
		CHECK(admission_error_ok(d->error), "failed admission error %d", d->error);
		CHECK(d->attempt == 0, "failed admission with an attempt");
	}
	ticket_drop(p, m);
}

/* Drains on_admit reports: each names a ticket that was queued, nobody waits on, and that has
 * not been reported before.  Returns how many came from the admission thread for tickets the
 * model held open (not told): those may have been admitted while the call before the drain ran,
 * after it looked at the queue. */
static int drain_admits(struct prog *p)
{
	/* Copied under the lock: the admission thread's next report goes to slot 0 as soon as
	 * the count is reset, and read in place it overwrote one not judged yet (seen under
	 * ASan: --craft seed 271, "attempt id ... issued twice", 1 run in ~50). */
	uint64_t ticket[MAX_TIX];
	struct kvr_decision d[MAX_TIX];
	bool late[MAX_TIX];
	pthread_mutex_lock(&p->mu);
	int n = p->n_adm;
	p->n_adm = 0;
	memcpy(ticket, p->adm_ticket, (size_t)n * sizeof(ticket[0]));
	memcpy(d, p->adm_d, (size_t)n * sizeof(d[0]));
	memcpy(late, p->adm_late, (size_t)n * sizeof(late[0]));
	pthread_mutex_unlock(&p->mu);
	int late_open = 0;
	for (int k = 0; k < n; k++) {
		struct mtick *m = ticket_find(p, ticket[k]);
		CHECK(m, "on_admit for ticket %" PRIu64 " that is not queued", ticket[k]);
		CHECK(m->state == T_QUEUED && !m->waited,
		      "on_admit for ticket %" PRIu64 " in state %d waited %d", m->t, m->state,
		      m->waited);
		late_open += late[k] && !m->told;
		ticket_outcome(p, m, d[k].status == KVR_FAILED ? d[k].error : 0, &d[k], !late[k]);
	}
	return late_open;
}

/* Can the admission of queued requests be unknown to the model right now?  (Then per-rank
 * active counts cannot be compared.)  Whenever one is held: besides a waited or uncollected one,
 * the admission thread may be admitting any of them this moment (a shard woke it: a lease
 * expiry, a posted lifecycle message applied), its attempt counted before on_admit tells it. */
static bool admissions_unknown(const struct prog *p)
{
	return p->n_tix > 0;
}

/* Ticket m is gone from the queue (wait or cancel said KVR_ENOENT) with nobody waiting on it:
 * with on_admit, only because the admission thread took it to report (it unlinks an entry before
 * on_admit runs, off the queue's lock), and the report comes later; without, its outcome, kept
 * for a collector, was reclaimed (its attempt ended, or, failed, it outlived two lease
 * intervals).  Returns true when the model is to drop it. */
static bool ticket_gone(struct prog *p, struct mtick *m)
{
	if (m->waited || !p->cfg.on_admit)
		return true;
	m->told = true;
	return false;
}

/* The report of ticket t, told to on_admit on the admission thread (ticket_gone), is drained
 * once it comes.  An on_admit that never comes would be a lost outcome: a generous bound
 * instead of a hang. */
static void await_report(struct prog *p, uint64_t t)
{
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		drain_admits(p);
		if (!ticket_find(p, t))
			return;
		clock_gettime(CLOCK_MONOTONIC, &t1);
		CHECK(t1.tv_sec - t0.tv_sec < 30, "on_admit never told ticket %" PRIu64, t);
		usleep(100);
	}
}

/* ---------------------------------------------------------------- outcomes nobody collects */

/* Whether ticket m's outcome, once admitted (or failed), is kept in the queue for a collector
 * (core/queue.c, "An outcome nobody collects"): a kvr_route_wait caller's (one that timed out),
 * or anyone's without on_admit.  Those are what kvr_queue_uncollected counts; an on_admit
 * report is not kept. */
static bool kept_outcome(const struct prog *p, const struct mtick *m)
{
	return !m->told && (m->waited || !p->cfg.on_admit);
}

static double real_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Polls kvr_queue_uncollected, with nothing else called, until it reads 0 or `seconds` of real
 * time passed; returns its last reading. */
static size_t uncollected_after(struct prog *p, double seconds)
{
	size_t n = kvr_queue_uncollected(p->r);
	for (double t0 = real_s(); n && real_s() - t0 < seconds; n = kvr_queue_uncollected(p->r))
		usleep(1000);
	return n;
}

/* After every call, on a router with a queue: what the model knows of the outcomes kept for a
 * collector (kept_outcome), and, where it knows each has become of no use, that the queue let
 * them go.  An admitted one is of no use once its attempt ended (nobody was told the attempt,
 * so only a lease expiry or a new life of its rank ends it); kvr_queue_uncollected must then
 * come back to 0 on an idle router, where nothing else comes back for it (a reset that left one
 * for good: test_regress an_uncollected_admission_goes_when_a_reset_ends_its_attempt).  The
 * model does not know when a waiting ticket is admitted, nor on which rank: while a kept one
 * waits (not `settled`), an admission may put an attempt on the current life of each rank
 * eligible for it (kept_live); a new life of the rank ends it (rank_new_life); a reading of the
 * queue's depth at 0 settles every ticket.  A ticket that had no eligible rank while it waited
 * may have failed, and a failed outcome is kept two lease scan intervals: no check while a kept
 * one may be held.  Kept or not at that moment: with on_admit, a ticket nobody waited on yet
 * is not kept, but a pass may decide its failure then (no rank left) and link the outcome only
 * after its clock read, off the queue's lock, with the depth still counting it; a
 * kvr_route_wait that times out meanwhile, after a rank came back, makes it a kept one.  The
 * model marked only kept tickets, so it took that failure (kept at its done_ns, the virtual
 * clock standing still) for an admission whose attempt a later removal had ended: --limits seed
 * 20, "kvr_queue_uncollected 1 on an idle router after every kept admission's attempt ended"
 * once on a loaded machine (the pass's thread preempted between its decision at op 41's
 * removal of the only rank and its link after op 53), every few hundred runs with sleeps in
 * the pass.
 * So with the depth at 0, no kept_live rank and no such ticket, every kept outcome is of no
 * use, and the gauge must read 0 (at once, as a rank's new life reclaims them; a bounded poll
 * for margin).  And always, every kept outcome is one of the model's tickets: the gauge never
 * exceeds their number. */
static void track_uncollected(struct prog *p)
{
	if (!(p->cfg.queue_threshold > 0))
		return;
	int kept = 0;
	bool may_fail = false;
	for (int k = 0; k < p->n_tix; k++) {
		struct mtick *m = &p->tix[k];
		/* Whether kept or not yet: a pass that found no eligible rank decides the failure
		 * then, and links it only after its clock read, off the queue's lock; a wait that
		 * comes meanwhile makes the outcome a kept one (see above). */
		if (!m->settled && !any_eligible(p, m->pinned, m->allow, m->allow_some))
			m->may_fail = true;
		if (!kept_outcome(p, m))
			continue;
		kept++;
		if (!m->settled)
			for (int i = 0; i < N_IDS; i++)
				if (eligible(p, i, m->pinned, m->allow, m->allow_some))
					p->kept_live[i] = true;
		may_fail |= m->may_fail;
	}
	/* The depth first: an outcome counted uncollected was waiting before (one lock section) */
	size_t depth = kvr_queue_depth(p->r);
	size_t n = kvr_queue_uncollected(p->r);
	CHECK(n <= (size_t)kept, "kvr_queue_uncollected %zu with %d outcomes kept for a collector",
	      n, kept);
	if (depth != 0)
		return;
	for (int k = 0; k < p->n_tix; k++)
		p->tix[k].settled = true;
	if (may_fail || n == 0)
		return;
	for (int i = 0; i < N_IDS; i++)
		if (p->kept_live[i])
			return;
	n = uncollected_after(p, 2.0);
	CHECK(n == 0,
	      "kvr_queue_uncollected %zu on an idle router after every kept admission's attempt "
	      "ended (%d kept)",
	      n, kept);
}

/* --limits' lanes of a few messages: a posted call may find its lane full for 10 ms while
 * the shard is slow (a loaded machine), and returns KVR_EAGAIN (kvrouter.h, "lane capacity"). */
static bool lane_may_fill(const struct prog *p)
{
	return p->cfg.lane_capacity < 64;
}

static bool expiry_possible(const struct prog *p, const struct matt *a)
{
	return a->maybe_stale || p->now - a->touch >= p->cfg.lease_scan_interval_ns;
}

/* ---------------------------------------------------------------- generators */

/* A prompt from a small family of shared prefixes, so decisions see overlap. */
static size_t gen_tokens(struct prog *p, uint32_t *t, size_t cap)
{
	uint32_t bs = p->cfg.block_size;
	uint32_t fam = u8(&p->in) % 6;
	uint32_t kind = u8(&p->in);
	size_t n;
	if (kind < 8)
		n = 1 + u8(&p->in) % (bs > 1 ? bs - 1 : 1); /* shorter than a block */
	else if (kind < 16)
		n = cap < 2000 ? cap : 2000;
	else
		n = (size_t)(u8(&p->in) % 16) * bs + u8(&p->in) % (bs + 1);
	if (n == 0)
		n = 1;
	if (n > cap)
		n = cap;
	size_t shared = (size_t)(u8(&p->in) % 17) * bs;
	uint32_t salt = u16(&p->in);
	for (size_t i = 0; i < n; i++)
		t[i] =
		    i < shared ? fam * 100003u + (uint32_t)i : salt * 7919u + (uint32_t)i * 13u + 1;
	return n;
}

static const char *gen_lora(struct prog *p)
{
	static const char *names[] = {NULL, NULL, NULL, NULL, "", "lora-a", "b"};
	return names[u8(&p->in) % 7];
}

static int gen_rank_index(struct prog *p)
{
	return (int)(u8(&p->in) % N_IDS);
}

/* ---------------------------------------------------------------- checks of one call */

static _Thread_local int last_rc;
static void expect(int rc, int want, const char *what)
{
	last_rc = rc;
	CHECK(rc == want, "%s: returned %d (%s), expected %d (%s)", what, rc, kvr_strerror(rc),
	      want, kvr_strerror(want));
}

/* A call on an attempt the model does not hold: one it ended must stay stale (`what` says
 * which call), one never issued is stale or unknown. */
static void expect_gone(const struct prog *p, uint64_t a, int rc, const char *what)
{
	for (int j = 0; j < p->n_late_gone; j++)
		if (p->late_gone[j] == a) {
			CHECK(rc == 0 || rc == KVR_ESTALE,
			      "%s (its rank removed before its booking "
			      "ran): rc %d",
			      what, rc);
			return;
		}
	bool ended = false;
	for (int j = 0; j < p->n_ended; j++)
		ended |= p->ended[j] == a;
	if (ended)
		expect(rc, KVR_ESTALE, what);
	else
		CHECK(rc == KVR_ESTALE || rc == KVR_ENOENT, "made-up attempt: rc %d", rc);
}

static void check_stats(struct prog *p, int i, const struct kvr_rank_stats *s)
{
	struct mrank *m = &p->rk[i];
	CHECK(s->incarnation == m->inc, "stats incarnation %" PRIu64 " model %" PRIu64,
	      s->incarnation, m->inc);
	if (p->cfg.mode == KVR_MODE_EVENTS) {
		if (!m->blk_unknown)
			CHECK(s->indexed_blocks == (uint64_t)m->nblk,
			      "events: indexed %" PRIu64 " model %d", s->indexed_blocks, m->nblk);
	}
	bool ambiguous = admissions_unknown(p);
	uint64_t live = 0;
	for (int k = 0; k < p->n_att; k++)
		if (p->att[k].rank == i) {
			live++;
			ambiguous |= expiry_possible(p, &p->att[k]);
		}
	if (!ambiguous)
		CHECK(s->active_requests == live,
		      "rank %d active_requests %" PRIu64 " model %" PRIu64, i, s->active_requests,
		      live);
	else
		CHECK(s->active_requests <= live + (uint64_t)p->n_tix,
		      "rank %d active_requests %" PRIu64 " > model bound", i, s->active_requests);
	if (s->active_requests == 0) {
		CHECK(s->active_prefill_tokens == 0, "no request but %" PRIu64 " prefill tokens",
		      s->active_prefill_tokens);
		CHECK(s->active_blocks == 0, "no request but %" PRIu64 " active blocks",
		      s->active_blocks);
	}
}

static void check_blocks(struct prog *p, int i)
{
	struct mrank *m = &p->rk[i];
	uint64_t out[MAX_BLK * 2 + 8];
	size_t n = 0;
	size_t cap = u8(&p->in) % 8 == 0 ? u8(&p->in) % 4 : sizeof(out) / sizeof(out[0]);
	cur_call = "kvr_rank_blocks";
	int rc = API(kvr_rank_blocks, p->r, rid(i), cap ? out : NULL, cap, &n);
	if (!m->present) {
		expect(rc, KVR_ENOENT, "blocks of an absent rank");
		return;
	}
	CHECK(rc == 0 || rc == KVR_ERANGE, "rc %d", rc);
	CHECK(rc == 0 ? n <= cap : n > cap, "rc %d n %zu cap %zu", rc, n, cap);
	if (p->cfg.mode != KVR_MODE_EVENTS || m->blk_unknown || rc)
		return;
	if (n != (size_t)m->nblk) {
		int o = snprintf(cur_detail, sizeof(cur_detail), "real:");
		for (size_t j = 0; j < n && o < 120; j++)
			o += snprintf(cur_detail + o, sizeof(cur_detail) - (size_t)o, " %" PRIx64,
			              out[j]);
		o += snprintf(cur_detail + o, sizeof(cur_detail) - (size_t)o, " model:");
		for (int j = 0; j < m->nblk && o < 240; j++)
			o += snprintf(cur_detail + o, sizeof(cur_detail) - (size_t)o, " %" PRIx64,
			              m->blk[j].ext);
	}
	CHECK(n == (size_t)m->nblk, "events: rank %d holds %zu blocks, model %d", i, n, m->nblk);
	for (int k = 0; k < m->nblk; k++) {
		bool f = false;
		for (size_t j = 0; j < n && !f; j++)
			f = out[j] == m->blk[k].ext;
		CHECK(f, "events: block %" PRIx64 " missing", m->blk[k].ext);
	}
}

/* ---------------------------------------------------------------- operations */

static void op_rank_add(struct prog *p)
{
	int i = gen_rank_index(p);
	static const uint64_t caps[] = {KVR_CAPACITY_NONE, 0, 1, 4, 16, 64, 1024, 100000};
	static const uint32_t mbts[] = {0, 16, 64, 1000};
	uint64_t cap = caps[u8(&p->in) % 8];
	uint32_t mbt = mbts[u8(&p->in) % 4];
	uint64_t inc = u8(&p->in) % 4;
	cur_call = "kvr_rank_add";
	snprintf(cur_detail, sizeof(cur_detail),
	         "rank %d inc %" PRIu64 " cap %" PRIu64 " mbt %u mode %d max_ranks %u", i, inc, cap,
	         mbt, (int)p->cfg.mode, p->cfg.max_ranks);
	int rc = API(kvr_rank_add, p->r, rid(i), inc, cap, mbt);
	struct mrank *m = &p->rk[i];
	if (m->present)
		expect(rc, KVR_EEXIST, "add of a present rank");
	else if (n_present(p) >= (int)p->cfg.max_ranks)
		expect(rc, KVR_ERANGE, "add beyond max_ranks");
	else {
		expect(rc, 0, "add");
		uint64_t life = m->life;
		memset(m, 0, sizeof(*m));
		m->life = life + 1;
		m->present = true;
		m->inc = inc;
		m->cap = cap;
		m->mbt = mbt;
		m->cap_finite_lru =
		    p->cfg.mode == KVR_MODE_APPROX_LRU && cap != 0 && cap != KVR_CAPACITY_NONE;
		m->cap_seen = cap;
	}
	drain_admits(p); /* it pumped the queue: admissions come after the model's change */
}

static void op_rank_remove(struct prog *p)
{
	int i = gen_rank_index(p);
	cur_call = "kvr_rank_remove";
	snprintf(cur_detail, sizeof(cur_detail), "rank %d", i);
	int rc = API(kvr_rank_remove, p->r, rid(i));
	if (!p->rk[i].present) {
		expect(rc, KVR_ENOENT, "remove of an absent rank");
		return;
	}
	expect(rc, 0, "remove");
	rank_new_life(p, i);
	p->rk[i].present = false;
	rank_forget_blocks(&p->rk[i]);
}

static void op_set_capacity(struct prog *p)
{
	int i = gen_rank_index(p);
	struct mrank *m = &p->rk[i];
	static const uint64_t caps[] = {KVR_CAPACITY_NONE, 0, 1, 4, 16, 64, 1024};
	uint64_t cap = caps[u8(&p->in) % 7];
	uint32_t k = u8(&p->in) % 4;
	uint64_t inc = k == 0 && m->inc ? m->inc - 1 : k == 3 ? m->inc + 1 : m->inc;
	cur_call = "kvr_rank_set_capacity";
	snprintf(cur_detail, sizeof(cur_detail),
	         "rank %d inc %" PRIu64 " -> %" PRIu64 " cap %" PRIu64 " -> %" PRIu64 " mode %d", i,
	         m->inc, inc, m->cap, cap, (int)p->cfg.mode);
	int rc = API(kvr_rank_set_capacity, p->r, rid(i), inc, cap);
	if (!m->present) {
		expect(rc, KVR_ENOENT, "set_capacity of an absent rank");
		return;
	}
	if (inc < m->inc) {
		expect(rc, KVR_ESTALE, "set_capacity with an older incarnation");
		return;
	}
	bool finite_now = cap != 0 && cap != KVR_CAPACITY_NONE;
	expect(rc, 0, "set_capacity");
	if (inc != m->inc) {
		rank_new_life(p, i);
		rank_forget_blocks(m);
		m->ev_unknown = true;
	}
	m->inc = inc;
	m->cap = cap;
	m->cap_finite_lru = p->cfg.mode == KVR_MODE_APPROX_LRU && finite_now;
	m->cap_seen = cap; /* "kvr_rank_set_capacity resets it" (kvr_request_cached) */
	m->cap_proved = false;
	drain_admits(p); /* it pumped the queue: admissions come after the model's change */
}

static void op_rank_reset(struct prog *p)
{
	int i = gen_rank_index(p);
	struct mrank *m = &p->rk[i];
	uint32_t k = u8(&p->in) % 3;
	uint64_t inc = k == 0 && m->inc ? m->inc - 1 : k == 1 ? m->inc : m->inc + 1;
	cur_call = "kvr_rank_reset";
	snprintf(cur_detail, sizeof(cur_detail), "rank %d inc %" PRIu64 " -> %" PRIu64, i, m->inc,
	         inc);
	int rc = API(kvr_rank_reset, p->r, rid(i), inc);
	if (!m->present) {
		expect(rc, KVR_ENOENT, "reset of an absent rank");
		return;
	}
	if (inc < m->inc) {
		expect(rc, KVR_ESTALE, "reset to an older incarnation");
		return;
	}
	expect(rc, 0, "reset");
	rank_new_life(p, i);
	rank_forget_blocks(m);
	m->ev_unknown = true;
	m->inc = inc;
	drain_admits(p); /* it pumped the queue: admissions come after the model's change */
}

static void op_stats(struct prog *p)
{
	int i = gen_rank_index(p);
	struct kvr_rank_stats s;
	cur_call = "kvr_rank_get_stats";
	int rc = API(kvr_rank_get_stats, p->r, rid(i), &s);
	if (!p->rk[i].present) {
		expect(rc, KVR_ENOENT, "stats of an absent rank");
		return;
	}
	expect(rc, 0, "stats");
	check_stats(p, i, &s);
}

/* fuzz_api_craft (fuzz_api_seeds --craft, FUZZ_API_CRAFT=1): a hash-given prompt is abused as
 * the header allows ("Not checked: hashes that are not the chain of the prompt route the prompt
 * they name"): a root whose local hash is another chain's interior sequence hash, followed by that
 * chain's own local hashes (the chain's suffix stored as a root: the index's crafted-root case,
 * core/index_tops.c, core/index_blocks.c), sequence hashes that repeat within the prompt or name
 * other chains' blocks, or a few values over and over.  The model bounds nothing about overlaps,
 * so what judges these is every call's documented code and the end checks: no load, resident <=
 * capacity, no byte left.  Off, no input byte is read here: every seed runs as before. */
static void craft_hashes(struct prog *p, struct kvr_request *q, size_t n_tok)
{
	uint32_t bs = p->cfg.block_size;
	uint32_t v = u8(&p->in);
	/* the honest chain of this prompt, remembered for later prompts */
	static _Thread_local uint64_t l[MAX_TOK], sq[MAX_TOK];
	size_t nb = API_VAL(kvr_hash_blocks, p->toks, n_tok < MAX_TOK ? n_tok : MAX_TOK, bs,
	                    q->lora_name, l, sq);
	size_t nh = q->local_hashes ? q->n_hashes : 0;
	if (nh && p->prev_nb > 1 && p->n_hist) {
		uint64_t *lh = (uint64_t *)q->local_hashes, *sh = (uint64_t *)q->seq_hashes;
		switch (v % 8) {
		case 0: { /* the previous chain's suffix from depth d, as a root */
			size_t d = 1 + u8(&p->in) % (p->prev_nb - 1);
			for (size_t k = 0; k < nh && d + k < p->prev_nb; k++) {
				lh[k] = k ? p->prev_l[d + k] : p->prev_s[d];
				if (sh)
					sh[k] = p->prev_s[d + k];
			}
			break;
		}
		case 1: /* a root on an earlier chain's interior hash, the rest chained from it */
			lh[0] = p->hist[u8(&p->in) % p->n_hist];
			if (sh)
				sh[0] = lh[0];
			break;
		case 2: /* a sequence hash repeating an earlier one of the prompt */
			if (sh && nh > 1) {
				size_t k = 1 + u8(&p->in) % (nh - 1);
				sh[k] = sh[u8(&p->in) % k];
			}
			break;
		case 3: /* a sequence hash naming another chain's block */
			if (sh)
				sh[u8(&p->in) % nh] = p->hist[u8(&p->in) % p->n_hist];
			break;
		case 4: /* three values over and over */
			if (sh)
				for (size_t k = 0; k < nh; k++)
					sh[k] = 0x5eed0000u + (k + v / 8) % 3;
			break;
		default: /* honest */
			break;
		}
	}
	if (nb) {
		memcpy(p->prev_l, l, nb * sizeof(*l));
		memcpy(p->prev_s, sq, nb * sizeof(*sq));
		p->prev_nb = nb;
		for (size_t k = 1; k < nb; k += 1 + nb / 8)
			p->hist[p->hist_pos++ % 256] = sq[k];
		p->n_hist = p->hist_pos < 256 ? p->hist_pos : 256;
	}
}

/* Builds a request; *defect says which documented error it must get (0: none). */
static void gen_request(struct prog *p, struct kvr_request *q, struct kvr_rank_id *pin,
                        struct kvr_rank_id *allow, int *pinned, uint8_t *allow_set,
                        bool *allow_some, int *defect, bool *erange9)
{
	API_VOID(kvr_request_init, q);
	uint32_t bs = p->cfg.block_size;
	*defect = 0;
	*erange9 = false;
	*pinned = NO_IDX;
	*allow_set = 0;
	*allow_some = false;
	size_t n = gen_tokens(p, p->toks, MAX_TOK);
	q->lora_name = gen_lora(p);
	if (u8(&p->in) % 4 == 0) {
		/* precomputed local hashes of the same prompt, and sometimes their sequence
		 * hashes */
		size_t nb =
		    API_VAL(kvr_hash_blocks, p->toks, n, bs, q->lora_name, p->hashes, p->seqs);
		q->local_hashes = p->hashes;
		if (u8(&p->in) % 2)
			q->seq_hashes = p->seqs;
		q->n_hashes = nb ? nb - u8(&p->in) % (nb + 1) % 2 : 0;
		q->n_tokens = n;
		if (u8(&p->in) % 16 == 0) /* huge, hash-given: at the limit or past it */
			q->n_tokens = KVR_MAX_PROMPT_TOKENS + (u8(&p->in) % 2 ? 0 : 1 + u8(&p->in));
	} else {
		q->tokens = p->toks;
		q->n_tokens = n;
		if (u8(&p->in) % 8 == 0) { /* tokens with every complete block's hashes */
			q->n_hashes = API_VAL(kvr_hash_blocks, p->toks, n, bs, q->lora_name,
			                      p->hashes, p->seqs);
			q->local_hashes = p->hashes;
			q->seq_hashes = p->seqs;
		}
	}
	if (fuzz_api_craft)
		craft_hashes(p, q, n);
	q->request_id = u16(&p->in);
	q->expected_output_tokens = u8(&p->in) % 4 == 0 ? u16(&p->in) : 0;
	uint32_t pk = u8(&p->in);
	if (pk % 5 == 0) {
		*pin = rid(gen_rank_index(p));
		if (u8(&p->in) % 8 == 0)
			pin->worker_id += 1000; /* unknown rank */
		q->pinned = pin;
		*pinned = rindex_of(*pin);
		if (*pinned == NO_IDX)
			*pinned = BAD_PIN;
	}
	if (pk % 7 == 1) {
		size_t na = 1 + u8(&p->in) % 4;
		for (size_t k = 0; k < na; k++) {
			allow[k] = rid(gen_rank_index(p));
			if (u8(&p->in) % 8 == 0)
				allow[k].dp_rank = 7; /* unknown */
			int ri = rindex_of(allow[k]);
			if (ri != NO_IDX)
				*allow_set |= (uint8_t)(1u << ri);
		}
		if (q->pinned && u8(&p->in) % 2)
			allow[0] = *pin;
		if (q->pinned) {
			int ri = rindex_of(allow[0]);
			if (ri != NO_IDX)
				*allow_set |= (uint8_t)(1u << ri);
		}
		q->allow = allow;
		q->n_allow = na;
		*allow_some = true;
		if (na > p->cfg.max_ranks)
			*erange9 = true;
		if (q->pinned) {
			bool in = false;
			for (size_t k = 0; k < na; k++)
				in |= allow[k].worker_id == pin->worker_id &&
				      allow[k].dp_rank == pin->dp_rank;
			if (!in)
				*defect = KVR_EINVAL;
		}
	}
	uint32_t fl = u8(&p->in);
	if (fl % 6 == 0)
		q->flags |= KVR_ROUTE_QUERY_ONLY;
	if (fl % 5 == 1) {
		q->flags |= KVR_ROUTE_WAIT;
		q->deadline_ns = p->now - (fl & 1); /* never in the future: time is virtual */
	}
	uint32_t ov = u8(&p->in);
	if (ov % 8 == 0)
		q->temperature = (double)(ov % 5) * 0.5;
	if (ov % 8 == 1)
		q->overlap_credit = (double)(ov % 3);
	if (ov % 8 == 2)
		q->prefill_load_scale = 0.25 * (double)(ov % 9);
	/* At most one malformation, so the expected code is clear. */
	switch (u8(&p->in) % 24) {
	case 0:
		q->tokens = p->toks;
		q->local_hashes = p->hashes; /* both, without sequence hashes */
		q->seq_hashes = NULL;
		*defect = KVR_EINVAL;
		break;
	case 1:
		q->tokens = NULL;
		q->local_hashes = NULL; /* neither (sequence hashes alone are no prompt either) */
		q->seq_hashes = u8(&p->in) % 2 ? p->seqs : NULL;
		*defect = KVR_EINVAL;
		break;
	case 2:
		q->n_tokens = 0;
		*defect = KVR_EINVAL;
		break;
	case 3:
		if (q->local_hashes) {
			q->n_hashes = q->n_tokens / bs + 1;
			*defect = KVR_EINVAL;
		}
		break;
	case 4:
		q->allow = NULL;
		q->n_allow = 1 + u8(&p->in) % 3;
		*defect = KVR_EINVAL;
		break;
	case 5:
		q->temperature = NAN;
		*defect = KVR_EINVAL;
		break;
	case 6:
		q->overlap_credit = INFINITY;
		*defect = KVR_EINVAL;
		break;
	case 7:
		q->flags |= 1u << (2 + u8(&p->in) % 30);
		*defect = KVR_EINVAL;
		break;
	case 8: {
		/* a long allow list repeating one rank: more entries than max_ranks */
		int ri = gen_rank_index(p);
		size_t na = p->cfg.max_ranks + 1 + u8(&p->in) % 3;
		if (na > 16)
			na = 16;
		for (size_t k = 0; k < na; k++)
			allow[k] = rid(ri);
		q->allow = allow;
		q->n_allow = na;
		q->pinned = NULL;
		*pinned = NO_IDX;
		*allow_set = (uint8_t)(1u << ri);
		*allow_some = true;
		*erange9 = na > p->cfg.max_ranks;
		break;
	}
	default:
		break;
	}
}

static void ticket_new(struct prog *p, uint64_t t, bool waited, int pinned, uint8_t aset,
                       bool asome)
{
	struct mtick *m = &p->tix[p->n_tix++];
	*m = (struct mtick){.t = t,
	                    .state = T_QUEUED,
	                    .waited = waited,
	                    .pinned = pinned,
	                    .allow = aset,
	                    .allow_some = asome,
	                    .enq = p->now};
	for (int i = 0; i < N_IDS; i++)
		m->life[i] = p->rk[i].life;
}

static void op_route(struct prog *p)
{
	/* --limits' queue of up to 2^32 - 1 requests outgrows the model's tickets: no route
	 * that may queue while they are full (the bound on the queue is checked at capacity 1) */
	if (fuzz_api_limits && p->cfg.queue_threshold > 0 && p->n_tix >= MAX_TIX - 1)
		return;
	struct kvr_request q;
	struct kvr_rank_id pin, allow[16];
	int pinned, defect;
	uint8_t aset;
	bool asome, erange9;
	gen_request(p, &q, &pin, allow, &pinned, &aset, &asome, &defect, &erange9);
	/* Recompute malformations from the request itself (the generator may combine them). */
	uint32_t bs = p->cfg.block_size;
	bool prompt_ok = q.seq_hashes
	                     ? q.local_hashes && (!q.tokens || q.n_hashes == q.n_tokens / bs)
	                     : (q.tokens != NULL) != (q.local_hashes != NULL);
	bool bad = !prompt_ok || q.n_tokens == 0 || q.n_tokens > KVR_MAX_PROMPT_TOKENS ||
	           q.n_tokens / bs > UINT32_MAX ||
	           (q.local_hashes && q.n_hashes > q.n_tokens / bs) || (q.n_allow && !q.allow) ||
	           isnan(q.temperature) || isinf(q.overlap_credit) ||
	           (q.flags & ~(uint32_t)(KVR_ROUTE_QUERY_ONLY | KVR_ROUTE_WAIT));
	if (q.pinned && q.n_allow && q.allow) {
		bool in = false;
		for (size_t k = 0; k < q.n_allow; k++)
			in |= q.allow[k].worker_id == q.pinned->worker_id &&
			      q.allow[k].dp_rank == q.pinned->dp_rank;
		bad |= !in;
	}
	struct kvr_decision d;
	memset(&d, 0xa5, sizeof(d));
	cur_call = "kvr_route";
	p->routes++;
	unsigned present = 0;
	for (int i = 0; i < N_IDS; i++)
		present |= (unsigned)p->rk[i].present << i;
	snprintf(
	    cur_detail, sizeof(cur_detail),
	    "present %02x pinned %d allow %02x/%d n_allow %zu flags %x ntok %zu nh %zu hashes %d",
	    present, pinned, aset, asome, q.n_allow, q.flags, q.n_tokens, q.n_hashes,
	    q.local_hashes != NULL);
	/* With KVR_ROUTE_WAIT a failure of the wait reads as kvr_route_wait's (kvrouter.h) */
	/* Reports in before the call are of admissions counted out of the queue before it (see
	 * the refusal's check below). */
	drain_admits(p);
	int rc =
	    API_OR(kvr_route, q.flags & KVR_ROUTE_WAIT ? "kvr_route_wait" : NULL, p->r, &q, &d);
	/* A queued request's own report may already be in: the admission thread (its pass running
	 * when the request was pushed) admits it at once.  It is drained once the ticket is held.
	 */
	bool queued = rc == 0 && d.status == KVR_QUEUED;
	/* --stall-admit: the program is preempted after a refusal, for longer than the admission
	 * thread's stalled clock read (vclock), so that the report of an admission that pass was
	 * making during the call comes before the drain. */
	if (fuzz_api_stall_admit && rc == KVR_EAGAIN)
		usleep(3000);
	int late_open = queued ? 0 : drain_admits(p);
	(void)erange9; /* allow lists of any length are fine (issue 12 item 9) */
	if (bad) {
		expect(rc, KVR_EINVAL, "malformed request");
		return;
	}
	if (!any_eligible(p, pinned, aset, asome)) {
		expect(rc, KVR_ENOENT, "no eligible rank");
		return;
	}
	bool queue_on = p->cfg.queue_threshold > 0;
	bool qo = q.flags & KVR_ROUTE_QUERY_ONLY;
	if (rc == KVR_EAGAIN && lane_may_fill(p))
		return; /* the chosen rank's lane stayed full for 10 ms: nothing admitted */
	if (rc == KVR_EAGAIN) {
		/* The queue was full when the push looked: the requests the model holds open, and
		 * those whose admission the admission thread reported during the call (drained
		 * above).  Such a pass counts a request out of the queue only after its admission,
		 * off the queue's lock (core/queue.c, kvr_queue_pump), and reports it after that:
		 * a route whose push came between them is refused, and the report is in by the
		 * drain.  Counted as they were after the drain, a loaded machine's preemptions
		 * (the pass's, then the program's) made that "at most 0 of 1 queued" (--limits
		 * seed 62208646, once in some 500 runs; in most runs with --stall-admit).  Those
		 * reported on the program's thread are not counted: the call's own pass, before
		 * its push, admitted them.  (A report on its way before the call, counted out
		 * before it, is counted too: the model cannot tell it apart.) */
		int open = late_open;
		for (int k = 0; k < p->n_tix; k++)
			open += p->tix[k].state != T_DONE && !p->tix[k].told;
		CHECK(queue_on && !qo, "KVR_EAGAIN without a queue");
		CHECK(open >= (int)p->cfg.queue_capacity, "KVR_EAGAIN with at most %d of %u queued",
		      open, p->cfg.queue_capacity);
		return;
	}
	if (rc == KVR_ETIMEDOUT) {
		CHECK(queue_on && !qo && (q.flags & KVR_ROUTE_WAIT),
		      "KVR_ETIMEDOUT without waiting");
		CHECK(d.status == KVR_QUEUED && d.ticket != 0, "timed out without a ticket");
		CHECK(p->n_tix < MAX_TIX, "model tickets full");
		CHECK(!ticket_find(p, d.ticket), "ticket %" PRIu64 " reissued", d.ticket);
		ticket_new(p, d.ticket, true, pinned, aset, asome);
		return;
	}
	if (rc != 0) {
		char *o = cur_detail + strlen(cur_detail);
		for (int i = 0; i < N_IDS; i++) {
			struct kvr_rank_stats st;
			int src = API(kvr_rank_get_stats, p->r, rid(i), &st);
			o += snprintf(o, 8, " %d:%d", i, src);
		}
	}
	expect(rc, 0, "route");
	size_t nb = q.tokens ? q.n_tokens / bs : q.n_hashes;
	if (d.status == KVR_QUEUED) {
		CHECK(queue_on && !qo, "queued without a queue (or query-only)");
		CHECK(!(q.flags & KVR_ROUTE_WAIT), "KVR_ROUTE_WAIT returned a queued decision");
		CHECK(d.ticket != 0 && d.ticket > p->max_ticket, "ticket %" PRIu64 " not new",
		      d.ticket);
		p->max_ticket = d.ticket;
		CHECK(p->n_tix < MAX_TIX, "model tickets full");
		ticket_new(p, d.ticket, false, pinned, aset, asome);
		drain_admits(p);
		return;
	}
	CHECK(d.status == KVR_DECIDED, "status %d", d.status);
	CHECK(eligible(p, rindex_of(d.rank), pinned, aset, asome), "decided on an ineligible rank");
	CHECK(d.required_blocks == nb, "required_blocks %u expected %zu", d.required_blocks, nb);
	CHECK(d.overlap_blocks <= d.required_blocks, "overlap %u > required %u", d.overlap_blocks,
	      d.required_blocks);
	CHECK(d.cached_tokens == (uint64_t)d.overlap_blocks * bs, "cached_tokens");
	if (qo) {
		CHECK(d.attempt == 0, "query-only decision with an attempt");
		return;
	}
	if (d.ticket && (q.flags & KVR_ROUTE_WAIT)) {
		/* queued, then admitted within the wait */
		CHECK(!ticket_find(p, d.ticket), "ticket reissued");
	}
	add_attempt(p, &d);
}

/* A ticket to wait on or cancel, from the input: mostly one the model holds, else 0 or one
 * never issued. */
static uint64_t pick_ticket(struct prog *p)
{
	uint32_t k = u8(&p->in);
	if (p->n_tix && k % 4)
		return p->tix[k % (uint32_t)p->n_tix].t;
	return k % 8 == 0 ? 0 : p->max_ticket + 1 + k;
}

/* The model's ticket t, on which a call returned rc, or NULL when that call was a refusal, checked:
 * ticket 0 (KVR_EINVAL) or an unknown or collected one (KVR_ENOENT).  on: "wait on",
 * "cancel of". */
static struct mtick *held_ticket(struct prog *p, uint64_t t, int rc, const char *on)
{
	char what[64];
	if (t == 0) {
		snprintf(what, sizeof(what), "%s ticket 0", on);
		expect(rc, KVR_EINVAL, what);
		return NULL;
	}
	struct mtick *m = ticket_find(p, t);
	if (!m) {
		snprintf(what, sizeof(what), "%s an unknown or collected ticket", on);
		expect(rc, KVR_ENOENT, what);
	}
	return m;
}

static void op_wait(struct prog *p)
{
	uint64_t t = pick_ticket(p);
	struct kvr_decision d;
	memset(&d, 0xa5, sizeof(d));
	cur_call = "kvr_route_wait";
	int rc = API(kvr_route_wait, p->r, t, p->now ? p->now : 1, &d);
	drain_admits(p);
	struct mtick *m = held_ticket(p, t, rc, "wait on");
	if (!m)
		return;
	if (m->told) {
		expect(rc, KVR_ENOENT, "wait on a ticket told to on_admit");
		return;
	}
	if (rc == KVR_ENOENT && d.status == (int)0xa5a5a5a5) {
		if (ticket_gone(p, m))
			ticket_drop(p, m);
		return;
	}
	m->waited = true;
	if (rc == KVR_ETIMEDOUT) {
		CHECK(m->state == T_QUEUED, "timed out on an admitted ticket");
		return;
	}
	if (rc == 0) {
		CHECK(d.status == KVR_DECIDED, "wait: status %d", d.status);
		ticket_outcome(p, m, 0, &d, false);
		return;
	}
	CHECK(admission_error_ok(rc) && d.status == KVR_FAILED && d.error == rc,
	      "wait: rc %d status %d error %d", rc, d.status, d.error);
	ticket_outcome(p, m, rc, &d, false);
}

static void op_cancel(struct prog *p)
{
	uint64_t t = pick_ticket(p);
	cur_call = "kvr_route_cancel";
	int rc = API(kvr_route_cancel, p->r, t);
	drain_admits(p);
	struct mtick *m = held_ticket(p, t, rc, "cancel of");
	if (!m)
		return;
	if (m->told) {
		expect(rc, KVR_ENOENT, "cancel of a ticket told to on_admit");
		return;
	}
	/* 0: queued, or admitted (or failed) with nobody told: the cancel ended that attempt. */
	if (rc == 0) {
		ticket_drop(p, m);
		return;
	}
	expect(rc, KVR_ENOENT, "cancel");
	if (ticket_gone(p, m))
		ticket_drop(p, m);
}

static uint64_t pick_attempt(struct prog *p, int *k_out)
{
	uint32_t k = u8(&p->in);
	*k_out = -1;
	if (p->n_att && k % 8 < 5) {
		*k_out = (int)(k % (uint32_t)p->n_att);
		return p->att[*k_out].id;
	}
	if (p->n_ended && k % 8 < 7)
		return p->ended[k % (uint32_t)p->n_ended];
	switch (k % 4) {
	case 0:
		return 0;
	case 1:
		return u64(&p->in); /* made up */
	case 2:
		return (u64(&p->in) << 16) | (k % p->cfg.max_ranks); /* a plausible slot */
	default:
		/* an id of a later decision: every route mints at most one sequence number */
		return ((p->routes + 4096) << 16) | (k % p->cfg.max_ranks);
	}
}

static void op_lifecycle(struct prog *p, int op)
{
	int k;
	uint64_t a = pick_attempt(p, &k);
	int rc;
	size_t n = 0;
	bool null_tokens = false, bad_flags = false;
	switch (op) {
	case 0:
		cur_call = "kvr_request_prefill_done";
		rc = API(kvr_request_prefill_done, p->r, a);
		break;
	case 1:
		cur_call = "kvr_request_output";
		n = u8(&p->in) % 40;
		null_tokens = n && u8(&p->in) % 16 == 0;
		for (size_t i = 0; i < n; i++)
			p->toks[i] = u16(&p->in);
		uint8_t how = u8(&p->in);
		if (how % 4 == 0) {
			rc = API(kvr_request_output, p->r, a, null_tokens ? NULL : p->toks, n);
			break;
		}
		/* finality known: not final, final, or (rarely) an unknown flag */
		cur_call = "kvr_request_output_ex";
		uint32_t flags = how % 4 == 1 ? KVR_OUTPUT_FINAL : 0;
		bad_flags = how % 32 == 2;
		if (bad_flags)
			flags |= 2u << (how % 31);
		rc = API(kvr_request_output_ex, p->r, a, null_tokens ? NULL : p->toks, n, flags);
		break;
	case 2:
		cur_call = "kvr_request_finish";
		rc = API(kvr_request_finish, p->r, a);
		break;
	default:
		cur_call = "kvr_request_abort";
		rc = API(kvr_request_abort, p->r, a);
		break;
	}
	drain_admits(p);
	if (a == 0 || null_tokens || bad_flags) {
		expect(rc, KVR_EINVAL, "attempt 0, NULL tokens or unknown flags");
		return;
	}
	if (k < 0) {
		expect_gone(p, a, rc, "call on an ended attempt");
		return;
	}
	/* k may have moved if drain_admits added attempts (appends only): find it again */
	for (k = 0; k < p->n_att && p->att[k].id != a; k++)
		;
	if (k == p->n_att)
		return; /* finished by add_attempt to make room in the model */
	snprintf(cur_detail, sizeof(cur_detail),
	         "attempt %" PRIx64 " rank %d life %" PRIu64 "/%" PRIu64 " touch %" PRIu64
	         " now %" PRIu64 " scan %" PRIu64,
	         a, p->att[k].rank, p->att[k].life, p->rk[p->att[k].rank].life, p->att[k].touch,
	         p->now, p->cfg.lease_scan_interval_ns);
	if (rc == KVR_ESTALE && expiry_possible(p, &p->att[k])) {
		end_attempt(p, k); /* the lease expired */
		return;
	}
	if (rc == KVR_EAGAIN && op < 2 && lane_may_fill(p))
		return; /* the lane stayed full for 10 ms: nothing changed */
	expect(rc, 0, "call on a live attempt");
	if (op >= 2)
		end_attempt(p, k);
	else
		p->att[k].touch = p->now;
}

/* Engine truth: kvr_request_cached on live, ended, made-up attempts, and kvr_rank_observe with
 * good and bad flags, incarnations, resident counts and watermarks (a block of a recent prompt,
 * or not one).  Return codes as the header gives them; what they evict is judged by the end
 * checks (no load left, resident within the capacity the calls allow). */
static void op_heal(struct prog *p)
{
	uint32_t bs = p->cfg.block_size;
	if (u8(&p->in) % 2) {
		int k;
		uint64_t a = pick_attempt(p, &k);
		uint32_t how = u8(&p->in) % 4;
		uint64_t req = k >= 0 ? p->att[k].nreq : 0;
		/* at most the hashed blocks (never above the prompt), or above any prompt */
		uint64_t cached = how == 3   ? KVR_MAX_PROMPT_TOKENS + 1 + u8(&p->in)
		                  : how == 2 ? req * bs
		                             : (uint64_t)(u8(&p->in) % (req + 1)) * bs +
		                                   (bs > 1 ? u8(&p->in) % bs : 0) * (req > 0);
		if (cached > req * bs && how != 3)
			cached = req * bs;
		cur_call = "kvr_request_cached";
		snprintf(cur_detail, sizeof(cur_detail),
		         "attempt %" PRIx64 " k %d cached %" PRIu64 " blocks %" PRIu64, a, k,
		         cached, req);
		int rc = API(kvr_request_cached, p->r, a, cached);
		drain_admits(p);
		if (a == 0) {
			expect(rc, KVR_EINVAL, "cached for attempt 0");
			return;
		}
		if (k < 0) {
			expect_gone(p, a, rc, "cached on an ended attempt");
			return;
		}
		for (k = 0; k < p->n_att && p->att[k].id != a; k++)
			;
		if (k == p->n_att)
			return;
		if (rc == KVR_ESTALE && expiry_possible(p, &p->att[k])) {
			end_attempt(p, k);
			return;
		}
		expect(rc, how == 3 ? KVR_EINVAL : 0, "cached on a live attempt");
		if (rc == 0)
			p->rk[p->att[k].rank].cap_proved = true;
		return;
	}
	int i = gen_rank_index(p);
	struct mrank *m = &p->rk[i];
	struct kvr_rank_observation o;
	memset(&o, 0, sizeof(o));
	uint32_t fk = u8(&p->in) % 16;
	o.flags = fk < 5     ? KVR_OBSERVE_RESIDENT
	          : fk < 9   ? KVR_OBSERVE_WATERMARK
	          : fk < 14  ? KVR_OBSERVE_RESIDENT | KVR_OBSERVE_WATERMARK
	          : fk == 14 ? 0
	                     : KVR_OBSERVE_RESIDENT | 4u << (u8(&p->in) % 29);
	uint32_t ik = u8(&p->in) % 8;
	o.incarnation = ik == 0 ? m->inc + 1 : ik == 1 && m->inc ? m->inc - 1 : m->inc;
	static const uint64_t res[] = {0, 1, 3, 16, 64, 1000, 100000, UINT64_MAX};
	uint32_t rk = u8(&p->in) % 10;
	o.resident_blocks = rk < 8 ? res[rk]
	                    : rk == 8 && m->cap != KVR_CAPACITY_NONE
	                        ? m->cap + u8(&p->in) % 3
	                        : (m->cap != KVR_CAPACITY_NONE && m->cap ? m->cap - 1 : 2);
	/* p->toks holds the last prompt (or output) drawn: its blocks are often predicted */
	uint32_t wk = u8(&p->in) % 4;
	uint64_t sq[64];
	size_t nb =
	    API_VAL(kvr_hash_blocks, p->toks, 64 * (size_t)bs < MAX_TOK ? 64 * (size_t)bs : MAX_TOK,
	            bs, NULL, NULL, sq);
	o.watermark_hash = wk < 3 && nb ? sq[u8(&p->in) % nb] : u64(&p->in);
	cur_call = "kvr_rank_observe";
	snprintf(cur_detail, sizeof(cur_detail),
	         "rank %d flags %x inc %" PRIu64 " (model %" PRIu64 ") resident %" PRIu64
	         " wm %" PRIx64,
	         i, o.flags, o.incarnation, m->inc, o.resident_blocks, o.watermark_hash);
	bool null = u8(&p->in) % 64 == 0;
	int rc = API(kvr_rank_observe, p->r, rid(i), null ? NULL : &o);
	drain_admits(p);
	const uint32_t known = KVR_OBSERVE_RESIDENT | KVR_OBSERVE_WATERMARK;
	if (null || !(o.flags & known) || (o.flags & ~known)) {
		expect(rc, KVR_EINVAL, "observe: NULL or bad flags");
		return;
	}
	if (!m->present) {
		expect(rc, KVR_ENOENT, "observe an absent rank");
		return;
	}
	if (o.incarnation != m->inc) {
		expect(rc, KVR_ESTALE, "observe another incarnation");
		return;
	}
	expect(rc, 0, "observe");
	if ((o.flags & KVR_OBSERVE_RESIDENT) && o.resident_blocks > m->cap_seen)
		m->cap_seen = o.resident_blocks;
}

/* Events: well-formed ones follow the model's chains; malformed ones are each one defect. */
/* The router's sequence hash of a block with this local hash below parent_node (0: a root),
 * as kvrouter.h defines it (seq[0] = local[0], then the XXH3 chain). */
static uint64_t node_of(uint64_t parent_node, uint64_t local)
{
	uint64_t s;
	kvr_hash_chain_locals(parent_node ? &parent_node : NULL, &local, 1, &s);
	return s;
}

static int blk_find_ext(const struct mrank *m, uint64_t ext)
{
	for (int k = 0; k < m->nblk; k++)
		if (m->blk[k].ext == ext)
			return k;
	return -1;
}

static int blk_find_node(const struct mrank *m, uint64_t node)
{
	for (int k = 0; k < m->nblk; k++)
		if (m->blk[k].node == node)
			return k;
	return -1;
}

/* fuzz_api_events: remembers a block some event stored, for op_ev_probe's prompts. */
static void dict_note(struct prog *p, uint64_t seq, uint64_t parent, uint64_t local)
{
	for (unsigned k = 0; k < p->n_dict; k++)
		if (p->dict[k].seq == seq)
			return;
	p->dict[p->dict_pos++ % 256] = (struct dblk){.seq = seq, .parent = parent, .local = local};
	p->n_dict = p->dict_pos < 256 ? p->dict_pos : 256;
}

static const struct dblk *dict_find(const struct prog *p, uint64_t seq)
{
	for (unsigned k = 0; k < p->n_dict; k++)
		if (p->dict[k].seq == seq)
			return &p->dict[k];
	return NULL;
}

/* An engine's per-process hash seed (vLLM's PYTHONHASHSEED-less default is random per
 * process): one per rank life, so a reset or re-added rank names the same blocks anew. */
static uint64_t engine_ext(const struct prog *p, int i, uint64_t seq)
{
	uint64_t x = seq ^ ((uint64_t)i << 56) ^ (p->rk[i].life * 0x2545f4914f6cdd1dull);
	return splitmix64(&x);
}

/* fuzz_api_events: the external hashes of an event's blocks as real engines send them: the
 * router's own sequence hash (an engine configured to share it), an engine hash of its own
 * that differs per rank and per rank life (vLLM's random seed), a sequence hash another block
 * holds (crafted: the block then has two names or a name is reused), or small numbers. */
static void events_ext(struct prog *p, int i, const struct kvr_event *ev, struct kvr_event_block *b,
                       size_t nb)
{
	const struct mrank *m = &p->rk[i];
	uint32_t bs = p->cfg.block_size;
	uint32_t kind = u8(&p->in) % 8;
	uint64_t parent = 0;
	if (ev->has_parent) {
		int f = blk_find_ext(m, ev->parent_ext_hash);
		parent = f >= 0 ? m->blk[f].node : 0;
	}
	for (size_t k = 0; k < nb; k++) {
		uint64_t local;
		if (b[k].tokens)
			API_VAL(kvr_hash_blocks, b[k].tokens, bs, bs, ev->lora_name, &local, NULL);
		else
			local = b[k].local_hash;
		uint64_t seq = node_of(parent, local);
		uint32_t kk = kind == 7 ? u8(&p->in) % 7 : kind;
		switch (kk) {
		case 0:
		case 1:
			b[k].ext_hash = seq;
			break;
		case 2:
		case 3:
		case 4:
			b[k].ext_hash = engine_ext(p, i, seq);
			break;
		case 5:
			if (p->n_dict)
				b[k].ext_hash = p->dict[u8(&p->in) % p->n_dict].seq;
			break;
		default: /* the small numbers op_event drew */
			break;
		}
		parent = seq;
	}
}

static void op_event(struct prog *p)
{
	int i = gen_rank_index(p);
	struct kvr_rank_id id = rid(i);
	struct mrank *m = &p->rk[i];
	uint32_t bs = p->cfg.block_size;
	struct kvr_event ev;
	memset(&ev, 0, sizeof(ev));
	struct kvr_event_block b[8];
	uint64_t rm[8];
	uint32_t kind = u8(&p->in);
	ev.type = kind % 16 < 10   ? KVR_EVENT_STORED
	          : kind % 16 < 14 ? KVR_EVENT_REMOVED
	                           : KVR_EVENT_CLEARED;
	uint32_t idk = u8(&p->in) % 8;
	ev.event_id = idk == 0   ? 0
	              : idk < 6  ? m->last_ev + 1
	              : idk == 6 ? m->last_ev + 3
	                         : m->last_ev;
	if (idk == 7 && m->last_ev == 0)
		ev.event_id = 0;
	int defect = 0;
	size_t nb = 1 + u8(&p->in) % 6;
	uint64_t ext_base = (u8(&p->in) % 32) << 8;
	if (ev.type == KVR_EVENT_STORED) {
		if (m->nblk && u8(&p->in) % 3) {
			ev.has_parent = true;
			ev.parent_ext_hash = m->blk[u8(&p->in) % (uint32_t)m->nblk].ext;
		} else if (u8(&p->in) % 8 == 0) {
			ev.has_parent = true;
			ev.parent_ext_hash = 0xdead0000 + u8(&p->in); /* not held */
		}
		ev.lora_name = gen_lora(p);
		for (size_t k = 0; k < nb; k++) {
			b[k].ext_hash = ext_base + k + 1 + (u8(&p->in) % 4 == 0 ? 7 : 0);
			/* Token blocks up to 64 tokens (--limits' larger block sizes name theirs
			 * by local hash: a made-up local hash of 0 would chain as no parent). */
			if (u8(&p->in) % 2 && bs <= 64) {
				for (uint32_t t = 0; t < bs && t < 64; t++)
					p->toks[k * 64 + t] = (uint32_t)(b[k].ext_hash * 31 + t);
				b[k].tokens = bs <= 64 ? &p->toks[k * 64] : NULL;
				b[k].n_tokens = bs;
				b[k].local_hash = 0;
			} else {
				b[k].tokens = NULL;
				b[k].local_hash = b[k].ext_hash * 0x100000001b3ull;
				b[k].n_tokens = 0;
			}
		}
		ev.blocks = b;
		ev.n_blocks = nb;
		if (fuzz_api_events)
			events_ext(p, i, &ev, b, nb);
		if (ev.has_parent && b[0].ext_hash == ev.parent_ext_hash)
			defect = KVR_EINVAL; /* drawn as its own parent */
		for (size_t k = 1; k < nb; k++)
			if (b[k].ext_hash == b[k - 1].ext_hash)
				defect = KVR_EINVAL; /* events_ext named a block after its parent */
		switch (u8(&p->in) % 12) {
		case 0:
			ev.n_blocks = 0;
			defect = KVR_EINVAL;
			break;
		case 1:
			ev.blocks = NULL;
			defect = KVR_EINVAL;
			break;
		case 2:
			if (b[0].tokens) {
				b[0].n_tokens = bs + 1;
				defect = KVR_EINVAL;
			}
			break;
		case 3:
			if (nb > 1) {
				b[1].ext_hash = b[0].ext_hash; /* self-parent */
				defect = KVR_EINVAL;
			} else if (ev.has_parent) {
				b[0].ext_hash = ev.parent_ext_hash;
				defect = KVR_EINVAL;
			}
			break;
		default:
			break;
		}
	} else if (ev.type == KVR_EVENT_REMOVED) {
		size_t nr = 1 + u8(&p->in) % 4;
		for (size_t k = 0; k < nr; k++) {
			rm[k] = m->nblk && u8(&p->in) % 4
			            ? m->blk[u8(&p->in) % (uint32_t)m->nblk].ext
			            : 0xbeef0000 + u8(&p->in);
			/* a held block's sequence hash (not its name when the engine's differs),
			 * or a block another rank holds */
			if (fuzz_api_events && p->n_dict && u8(&p->in) % 4 == 0)
				rm[k] = p->dict[u8(&p->in) % p->n_dict].seq;
		}
		ev.removed = rm;
		ev.n_removed = nr;
		if (u8(&p->in) % 10 == 0) {
			ev.removed = NULL;
			defect = KVR_EINVAL;
		} else if (u8(&p->in) % 10 == 0) {
			ev.n_removed = 0;
			defect = KVR_EINVAL;
		}
	}
	if (u8(&p->in) % 40 == 0) {
		ev.type = 3 + u8(&p->in) % 5; /* unknown type */
		defect = KVR_EINVAL;
	}
	cur_call = "kvr_events_apply";
	{
		int o = snprintf(cur_detail, sizeof(cur_detail),
		                 "rank %d type %d id %" PRIu64 " parent %d:%" PRIx64 " n %zu:", i,
		                 ev.type, ev.event_id, ev.has_parent, ev.parent_ext_hash,
		                 ev.type == KVR_EVENT_STORED ? ev.n_blocks : ev.n_removed);
		for (size_t k = 0; k < 6 && o < 200; k++) {
			if (ev.type == KVR_EVENT_STORED && ev.blocks && k < ev.n_blocks)
				o += snprintf(cur_detail + o, sizeof(cur_detail) - (size_t)o,
				              " %" PRIx64, ev.blocks[k].ext_hash);
			if (ev.type == KVR_EVENT_REMOVED && ev.removed && k < ev.n_removed)
				o += snprintf(cur_detail + o, sizeof(cur_detail) - (size_t)o,
				              " -%" PRIx64, ev.removed[k]);
		}
	}
	int rc = API(kvr_events_apply, p->r, id, &ev);
	if (p->cfg.mode != KVR_MODE_EVENTS) {
		expect(rc, KVR_EINVAL, "event outside events mode");
		return;
	}
	if (defect) {
		expect(rc, defect, "malformed event");
		return;
	}
	if (!m->present) {
		expect(rc, KVR_ENOENT, "event for an absent rank");
		return;
	}
	/* Event ids: after a reset or new incarnation the model does not assume the cursor. */
	if (ev.event_id) {
		if (m->ev_unknown) {
			if (rc == KVR_ESTALE)
				return;
		} else if (m->have_ev && ev.event_id <= m->last_ev) {
			expect(rc, KVR_ESTALE, "event id at or below the last applied");
			return;
		}
		m->have_ev = true;
		m->ev_unknown = false;
		m->last_ev = ev.event_id;
	}
	if (ev.type == KVR_EVENT_CLEARED) {
		expect(rc, 0, "cleared");
		for (int j = 0; j < N_IDS; j++)
			if (rid(j).worker_id == id.worker_id && p->rk[j].present)
				rank_forget_blocks(&p->rk[j]);
		return;
	}
	if (ev.type == KVR_EVENT_REMOVED) {
		expect(rc, 0, "removed");
		for (size_t k = 0; k < ev.n_removed; k++) {
			int f = blk_find_ext(m, ev.removed[k]);
			if (f >= 0 && --m->blk[f].copies == 0) /* leaves with its last copy */
				m->blk[f] = m->blk[--m->nblk];
		}
		return;
	}
	/* stored: refused whole first if the rank could exceed its bound (kvr_events_apply; every
	 * block counted as new), before its parent is looked for */
	uint64_t bound = m->cap == 0 || m->cap == KVR_CAPACITY_NONE ? p->cfg.events_max_blocks
	                 : m->cap > (UINT64_MAX - 1024) / 2         ? UINT64_MAX
	                                                            : 2 * m->cap + 1024;
	if (!m->blk_unknown && (uint64_t)m->nblk + ev.n_blocks > bound) {
		expect(rc, KVR_ERANGE, "stored past the rank's bound");
		return;
	}
	uint64_t parent_node = 0;
	if (ev.has_parent) {
		int f = blk_find_ext(m, ev.parent_ext_hash);
		if (f < 0) {
			if (!m->blk_unknown)
				expect(rc, KVR_ENOENT,
				       "stored below a parent the rank does not hold");
			return;
		}
		parent_node = m->blk[f].node;
	}
	int want = 0;
	for (size_t k = 0; k < ev.n_blocks; k++) {
		uint64_t local;
		if (b[k].tokens)
			API_VAL(kvr_hash_blocks, b[k].tokens, bs, bs, ev.lora_name, &local, NULL);
		else
			local = b[k].local_hash;
		uint64_t node = node_of(parent_node, local);
		int fe = blk_find_ext(m, b[k].ext_hash), fn = blk_find_node(m, node);
		if (fe >= 0 || fn >= 0) {
			if (fe >= 0 && fe == fn) {
				m->blk[fe].copies++; /* re-storing what it holds: one more copy */
				parent_node = node;
				continue;
			}
			want = KVR_EINVAL; /* ext reused for another block, or block under another
			                      ext */
			break;
		}
		if (m->nblk == MAX_BLK) {
			m->blk_unknown = true;
			break;
		}
		m->blk[m->nblk++] = (struct mblk){.ext = b[k].ext_hash, .node = node, .copies = 1};
		dict_note(p, node, parent_node, local);
		parent_node = node;
	}
	if (m->blk_unknown) {
		CHECK(rc == 0 || rc == KVR_EINVAL || rc == KVR_ENOENT || rc == KVR_ERANGE,
		      "stored: rc %d", rc);
		return;
	}
	expect(rc, want, "stored");
}

/* fuzz_api_events: a query-only route of a prompt built from blocks events stored (the chain
 * of one, up to its root, and a few more blocks), pinned to a rank or not.  In events mode
 * only events write the index, and they apply before kvr_events_apply returns, so the
 * decision's overlap on its rank is exactly the gap-free prefix the model holds there. */
static void op_ev_probe(struct prog *p)
{
	uint32_t bs = p->cfg.block_size;
	uint64_t local[40], seq[40], up[32];
	size_t n = 0;
	if (p->n_dict) {
		const struct dblk *d = &p->dict[u8(&p->in) % p->n_dict];
		while (d && n < 32) {
			up[n++] = d->local;
			d = d->parent ? dict_find(p, d->parent) : NULL;
		}
		if (d) /* deeper than the model keeps: probe the top 32 only as a root */
			n = 0;
	}
	for (size_t k = 0; k < n; k++)
		local[k] = up[n - 1 - k];
	if (u8(&p->in) % 4 == 0 && n) /* a prefix of it */
		n = 1 + u8(&p->in) % n;
	for (uint32_t extra = u8(&p->in) % 4; extra; extra--)
		local[n++] = 0xfeed000000ull + u8(&p->in);
	if (!n)
		return;
	kvr_hash_chain_locals(NULL, local, n, seq);
	int pin = u8(&p->in) % 2 ? gen_rank_index(p) : NO_IDX;
	struct kvr_rank_id pid = pin == NO_IDX ? rid(0) : rid(pin);
	struct kvr_request q;
	API_VOID(kvr_request_init, &q);
	q.local_hashes = local;
	q.n_hashes = n;
	if (u8(&p->in) % 2)
		q.seq_hashes = seq;
	q.n_tokens = n * bs + u8(&p->in) % bs;
	q.flags = KVR_ROUTE_QUERY_ONLY;
	q.pinned = pin == NO_IDX ? NULL : &pid;
	struct kvr_decision d;
	memset(&d, 0, sizeof(d));
	cur_call = "kvr_route (events probe)";
	snprintf(cur_detail, sizeof(cur_detail), "pinned %d blocks %zu seq0 %" PRIx64, pin, n,
	         seq[0]);
	int rc = API(kvr_route, p->r, &q, &d);
	p->routes++;
	if (pin != NO_IDX && !p->rk[pin].present) {
		expect(rc, KVR_ENOENT, "probe pinned to an absent rank");
		return;
	}
	if (!n_present(p)) {
		expect(rc, KVR_ENOENT, "probe with no rank");
		return;
	}
	CHECK(rc == 0 || rc == KVR_EAGAIN, "probe: rc %d", rc);
	if (rc || d.status != KVR_DECIDED)
		return; /* queued (a full rank): the model does not say when */
	int i = rindex_of(d.rank);
	CHECK(i != NO_IDX && p->rk[i].present && (pin == NO_IDX || i == pin),
	      "probe decided on rank (%" PRIu64 ", %u)", d.rank.worker_id, d.rank.dp_rank);
	CHECK(d.required_blocks == n, "probe: required %u, %zu blocks", d.required_blocks, n);
	const struct mrank *m = &p->rk[i];
	if (m->blk_unknown)
		return;
	uint32_t depth = 0;
	while (depth < n && blk_find_node(m, seq[depth]) >= 0)
		depth++;
	snprintf(cur_detail, sizeof(cur_detail), "rank %d pinned %d blocks %zu depth %u", i, pin, n,
	         depth);
	if (d.overlap_blocks != depth) {
		int o =
		    snprintf(cur_detail, sizeof(cur_detail), "rank %d pinned %d chain:", i, pin);
		for (size_t k = 0; k < n && o < 200; k++)
			o += snprintf(cur_detail + o, sizeof(cur_detail) - (size_t)o,
			              " %" PRIx64 "%s", seq[k],
			              blk_find_node(m, seq[k]) >= 0 ? "*" : "");
	}
	CHECK(d.overlap_blocks == depth, "probe: overlap %u on rank %d, the model holds %u",
	      d.overlap_blocks, i, depth);
}

static void op_metrics(struct prog *p)
{
	static char buf[1 << 16];
	size_t len = 0;
	size_t cap = u8(&p->in) % 4 == 0 ? u8(&p->in) : sizeof(buf);
	/* kvr_router_get_memory reads every rank on its shard: in every op_metrics it made the
	 * suite's fuzz_api runs use a quarter more CPU, so one in eight (no input byte read) */
	if (p->calls % 8 == 0) {
		cur_call = "kvr_router_get_memory";
		struct kvr_memory mem;
		expect(API(kvr_router_get_memory, p->r, &mem), 0, "get_memory");
	}
	cur_call = "kvr_metrics_render";
	int rc = API(kvr_metrics_render, p->r, cap ? buf : NULL, cap, &len);
	/* *len_out is the size the text needs, its NUL included. */
	if (rc == 0) {
		CHECK(len >= 1 && len <= cap && buf[len - 1] == 0 && strlen(buf) == len - 1,
		      "metrics: size %zu cap %zu strlen %zu", len, cap, strlen(buf));
	} else {
		expect(rc, KVR_ERANGE, "metrics");
		CHECK(len > cap, "metrics: ERANGE with size %zu <= cap %zu", len, cap);
		if (cap)
			CHECK(memchr(buf, 0, cap) != NULL, "metrics: not NUL-terminated");
	}
}

/* After a kvr_router_sync every booking posted before it has run: the attempts admitted onto a
 * rank removed since are stale from now on. */
static void late_gone_settled(struct prog *p)
{
	for (int j = 0; j < p->n_late_gone; j++) {
		p->ended[p->ended_pos] = p->late_gone[j];
		p->ended_pos = (p->ended_pos + 1) % MAX_END;
		if (p->n_ended < MAX_END)
			p->n_ended++;
	}
	p->n_late_gone = 0;
}

static void op_clock(struct prog *p)
{
	uint32_t k = u8(&p->in) % 8;
	uint64_t step = k < 4   ? (uint64_t)(k + 1) * 1000000ull
	                : k < 6 ? p->cfg.lease_scan_interval_ns / 2 + 1
	                : k < 7 ? p->cfg.lease_scan_interval_ns + 1
	                        : p->cfg.ttl_ns + 1;
	if (p->now + step < p->now)
		step = 0; /* --limits: a ttl or scan interval near 2^64; the clock never wraps */
	if (fuzz_api_clock_back && u8(&p->in) % 3 == 0) {
		/* Back by the step, never below the start (queue deadlines are now - 1, which must
		 * not become 0 = forever).  The reaper armed its next scan one interval after its
		 * last reading, which may now lie ahead of the clock: a lease may expire up to the
		 * step sooner than one interval after its last progress (kvrouter.h, now_ns), so
		 * every live attempt may now be found expired. */
		uint64_t back = p->now - 1000 < step ? p->now - 1000 : step;
		__atomic_store_n(&p->now, p->now - back, __ATOMIC_RELAXED);
		for (int k = 0; k < p->n_att; k++)
			p->att[k].maybe_stale = true;
		for (int k = 0; k < p->n_tix; k++)
			p->tix[k].clock_back = true; /* admitted before the step, maybe */
	} else {
		__atomic_store_n(&p->now, p->now + step, __ATOMIC_RELAXED);
		if (p->now > p->now_hw)
			p->now_hw = p->now;
	}
	if (u8(&p->in) % 2) {
		cur_call = "kvr_router_sync";
		int rc = API(kvr_router_sync, p->r, 10000);
		drain_admits(p);
		expect(rc, 0, "sync");
		late_gone_settled(p);
	}
}

static void op_sync(struct prog *p)
{
	cur_call = "kvr_router_sync";
	int rc = API(kvr_router_sync, p->r, 10000);
	drain_admits(p);
	expect(rc, 0, "sync");
	late_gone_settled(p);
}

static void op_hash(struct prog *p)
{
	uint32_t bs = u8(&p->in) % 3 == 0 ? 0 : 1 + u8(&p->in) % 32;
	size_t n = u8(&p->in);
	for (size_t i = 0; i < n; i++)
		p->toks[i] = u16(&p->in);
	const char *lora = gen_lora(p);
	uint64_t l1[256], s1[256], l2[256], s2[256];
	bool null_tok = n && u8(&p->in) % 8 == 0;
	cur_call = "kvr_hash_blocks";
	size_t nb = API_VAL(kvr_hash_blocks, null_tok ? NULL : p->toks, n, bs, lora, l1, s1);
	if (bs == 0 || null_tok) {
		CHECK(nb == 0, "hash_blocks on bad arguments wrote %zu", nb);
	} else {
		CHECK(nb == n / bs, "hash_blocks %zu blocks of %zu tokens / %u", nb, n, bs);
	}
	size_t nb2 = 99;
	cur_call = "kvr_hash_extend";
	int rc = API(kvr_hash_extend, NULL, null_tok ? NULL : p->toks, n, bs, lora, l2, s2, &nb2);
	if (bs == 0 || null_tok) {
		expect(rc, KVR_EINVAL, "hash_extend bad arguments");
	} else {
		expect(rc, 0, "hash_extend");
		CHECK(nb2 == nb && !memcmp(l1, l2, nb * 8) && !memcmp(s1, s2, nb * 8),
		      "hash_extend(NULL parent) differs from hash_blocks");
		/* chaining: hashing a prefix then extending equals hashing the whole */
		if (nb >= 2) {
			size_t cut = (nb / 2) * bs;
			size_t nb3;
			uint64_t l3[256], s3[256];
			CHECK(API(kvr_hash_extend, &s1[nb / 2 - 1], p->toks + cut, n - cut, bs,
			          lora, l3, s3, &nb3) == 0,
			      "extend");
			CHECK(nb3 == nb - nb / 2 && !memcmp(s3, s1 + nb / 2, nb3 * 8),
			      "extend does not continue the chain");
		}
	}
	CHECK(API(kvr_hash_extend, NULL, p->toks, n, bs ? bs : 1, lora, NULL, NULL, NULL) ==
	          KVR_EINVAL,
	      "hash_extend without n_blocks_out");
	uint64_t seed = API_VAL(kvr_hash_lora_seed, lora);
	if (!lora || !*lora)
		CHECK(seed == KVR_HASH_SEED, "lora seed of no adapter");
}

static void op_config(struct prog *p)
{
	struct kvr_config c;
	API_VOID(kvr_config_init, &c);
	int want = 0;
	switch (u8(&p->in) % 14) {
	case 0:
		c.block_size = u8(&p->in) % 2 ? 0 : 65537;
		want = KVR_ERANGE;
		break;
	case 1:
		c.n_shards = 257 + u8(&p->in);
		want = KVR_ERANGE;
		break;
	case 2:
		c.n_cpus = 1;
		want = KVR_EINVAL;
		break;
	case 3:
		c.mode = (enum kvr_mode)(3 + u8(&p->in) % 9);
		want = KVR_EINVAL;
		break;
	case 4:
		c.overlap_credit = -0.5;
		want = KVR_EINVAL;
		break;
	case 5:
		c.queue_threshold = NAN;
		want = KVR_EINVAL;
		break;
	case 6:
		c.ttl_ns = 0;
		want = KVR_EINVAL;
		break;
	case 7:
		c.queue_policy = (enum kvr_queue_policy)(2 + u8(&p->in) % 5);
		want = KVR_EINVAL;
		break;
	case 8:
		c.queue_capacity = 0;
		want = KVR_ERANGE;
		break;
	case 9:
		c.max_ranks = u8(&p->in) % 2 ? 0 : 65537;
		want = KVR_ERANGE;
		break;
	case 10:
		c.lane_capacity = u8(&p->in) % 2 ? 1 : (1u << 22) + 1;
		want = KVR_ERANGE;
		break;
	case 11:
		c.maint_every_ns = 0;
		want = KVR_EINVAL;
		break;
	case 12:
		c.block_size = 1 + u16(&p->in);
		c.max_ranks = 1 + u16(&p->in);
		c.temperature = u8(&p->in);
		break;
	default:
		break;
	}
	cur_call = "kvr_config_validate";
	expect(API(kvr_config_validate, &c), want, "config_validate");
	if (want) {
		struct kvr_router *r = (struct kvr_router *)&c;
		cur_call = "kvr_router_create (bad config)";
		expect(API(kvr_router_create, &c, &r), want, "create with a bad config");
		CHECK(r == NULL, "create failed but *out was not cleared");
	}
	expect(API(kvr_config_validate, NULL), KVR_EINVAL, "validate NULL");
	API_VOID(kvr_config_init, NULL);
	CHECK(kvr_strerror((int)u8(&p->in) - 200) != NULL, "strerror NULL");
	CHECK(kvr_version() && !strcmp(kvr_version(), KVR_VERSION_STRING), "version");
}

static void op_null_args(struct prog *p)
{
	struct kvr_decision d;
	struct kvr_rank_stats s;
	struct kvr_config c;
	size_t n;
	uint32_t k = u8(&p->in) % 14;
	cur_call = "NULL arguments";
	switch (k) {
	case 0:
		expect(API(kvr_route, NULL, NULL, &d), KVR_EINVAL, "route(NULL)");
		break;
	case 1:
		expect(API(kvr_route, p->r, NULL, &d), KVR_EINVAL, "route(req NULL)");
		break;
	case 2: {
		struct kvr_request q;
		API_VOID(kvr_request_init, &q);
		q.tokens = p->toks;
		q.n_tokens = 1;
		expect(API(kvr_route, p->r, &q, NULL), KVR_EINVAL, "route(d NULL)");
		break;
	}
	case 3:
		expect(API(kvr_rank_get_stats, p->r, rid(0), NULL), KVR_EINVAL, "stats(out NULL)");
		break;
	case 4:
		expect(API(kvr_rank_blocks, p->r, rid(0), NULL, 0, NULL), KVR_EINVAL,
		       "blocks(n NULL)");
		expect(API(kvr_rank_blocks, p->r, rid(0), NULL, 4, &n), KVR_EINVAL,
		       "blocks(out NULL)");
		break;
	case 5:
		expect(API(kvr_router_get_config, NULL, &c), KVR_EINVAL, "get_config(NULL)");
		expect(API(kvr_router_get_config, p->r, NULL), KVR_EINVAL, "get_config(out NULL)");
		break;
	case 6:
		CHECK(API_VAL(kvr_router_now, NULL) == 0, "now(NULL)");
		CHECK(API_VAL(kvr_router_now, p->r) == p->now, "now");
		break;
	case 7:
		expect(API(kvr_router_get_config, p->r, &c), 0, "get_config");
		CHECK(c.block_size == p->cfg.block_size && c.mode == p->cfg.mode &&
		          c.max_ranks == p->cfg.max_ranks &&
		          c.queue_capacity == p->cfg.queue_capacity &&
		          c.n_shards == p->cfg.n_shards && c.cpu_list == NULL,
		      "get_config differs");
		break;
	case 8:
		expect(API(kvr_route_wait, NULL, 1, 0, &d), KVR_EINVAL, "wait(NULL)");
		expect(API(kvr_route_wait, p->r, 1, 0, NULL), KVR_EINVAL, "wait(d NULL)");
		expect(API(kvr_route_cancel, NULL, 1), KVR_EINVAL, "cancel(NULL)");
		break;
	case 9:
		expect(API(kvr_request_finish, NULL, 1), KVR_EINVAL, "finish(NULL)");
		expect(API(kvr_request_prefill_done, NULL, 1), KVR_EINVAL, "prefill_done(NULL)");
		expect(API(kvr_request_abort, NULL, 1), KVR_EINVAL, "abort(NULL)");
		expect(API(kvr_request_output, NULL, 1, p->toks, 1), KVR_EINVAL, "output(NULL)");
		expect(API(kvr_request_output_ex, NULL, 1, p->toks, 1, 0), KVR_EINVAL,
		       "output_ex(NULL)");
		break;
	case 10:
		expect(API(kvr_events_apply, p->r, rid(0), NULL), KVR_EINVAL, "events(NULL)");
		expect(API(kvr_events_apply, NULL, rid(0), NULL), KVR_EINVAL, "events(r NULL)");
		break;
	case 11:
		expect(API(kvr_rank_add, NULL, rid(0), 1, 1, 1), KVR_EINVAL, "add(NULL)");
		expect(API(kvr_rank_remove, NULL, rid(0)), KVR_EINVAL, "remove(NULL)");
		expect(API(kvr_rank_reset, NULL, rid(0), 1), KVR_EINVAL, "reset(NULL)");
		expect(API(kvr_rank_set_capacity, NULL, rid(0), 1, 1), KVR_EINVAL,
		       "set_capacity(NULL)");
		expect(API(kvr_rank_get_stats, NULL, rid(0), &s), KVR_EINVAL, "stats(NULL)");
		expect(API(kvr_router_sync, NULL, 1), KVR_EINVAL, "sync(NULL)");
		break;
	case 12: {
		expect(API(kvr_metrics_render, NULL, NULL, 0, NULL), KVR_EINVAL, "metrics(NULL)");
		struct kvr_memory mem;
		expect(API(kvr_router_get_memory, NULL, &mem), KVR_EINVAL, "get_memory(NULL)");
		expect(API(kvr_router_get_memory, p->r, NULL), KVR_EINVAL, "get_memory(out NULL)");
		API_VOID(kvr_router_destroy, NULL);
		API_VOID(kvr_request_init, NULL);
		/* The replica calls' refusals (no NATS server here, so no handle): each is a
		 * function of the header that returns int, so its detail is checked too.  No input
		 * byte is read: every seed runs the program it ran before. */
		struct kvr_sync_config sc;
		API_VOID(kvr_sync_config_init, &sc);
		sc.replica_id = 0; /* refused before any connection is tried */
		struct kvr_sync *rs = (struct kvr_sync *)p;
#ifdef KVR_HAVE_NATS
		expect(API(kvr_sync_attach, p->r, &sc, &rs), KVR_EINVAL, "sync_attach(replica 0)");
		CHECK(rs == NULL, "a failed kvr_sync_attach left *out set");
		expect(API(kvr_sync_attach, p->r, NULL, &rs), KVR_EINVAL,
		       "sync_attach(config NULL)");
#else
		expect(API(kvr_sync_attach, p->r, &sc, &rs), KVR_ENOTSUP, "sync_attach, no nats");
		CHECK(rs == NULL, "a failed kvr_sync_attach left *out set");
#endif
		struct kvr_sync_stats sst;
		uint64_t seq;
		expect(API(kvr_sync_wait_ready, NULL, 0), KVR_EINVAL, "sync_wait_ready(NULL)");
		expect(API(kvr_sync_drain, NULL, 0), KVR_EINVAL, "sync_drain(NULL)");
		expect(API(kvr_sync_peer_seq, NULL, 1, &seq), KVR_EINVAL, "sync_peer_seq(NULL)");
		expect(API(kvr_sync_get_stats, NULL, &sst), KVR_EINVAL, "sync_get_stats(NULL)");
		API_VOID(kvr_sync_detach, NULL);
		break;
	}
	default: {
		/* unknown rank ids everywhere */
		struct kvr_rank_id bad = {.worker_id = 1000 + u8(&p->in), .dp_rank = u8(&p->in)};
		expect(API(kvr_rank_remove, p->r, bad), KVR_ENOENT, "remove(unknown)");
		expect(API(kvr_rank_reset, p->r, bad, 5), KVR_ENOENT, "reset(unknown)");
		expect(API(kvr_rank_set_capacity, p->r, bad, 5, 5), KVR_ENOENT,
		       "set_capacity(unknown)");
		expect(API(kvr_rank_get_stats, p->r, bad, &s), KVR_ENOENT, "stats(unknown)");
		expect(API(kvr_rank_blocks, p->r, bad, NULL, 0, &n), KVR_ENOENT, "blocks(unknown)");
		break;
	}
	}
}

/* The KV event feed (kvr_feed_*): every call with good and bad arguments.  No publisher runs, so
 * an endpoint only connects in the background; what the model checks is the return codes. */
static void op_feed(struct prog *p)
{
	struct kvr_feed_config fc;
	API_VOID(kvr_feed_config_init, NULL);
	API_VOID(kvr_feed_config_init, &fc);
	uint32_t k = u8(&p->in);
	int want = p->cfg.mode == KVR_MODE_EVENTS ? 0 : KVR_EINVAL;
	if (k % 5 == 0) {
		fc.replay_timeout_ms = 0;
		want = KVR_EINVAL;
	} else if (k % 5 == 1) {
		fc.max_msg_bytes = 1023;
		want = KVR_EINVAL;
	}
	struct kvr_feed *f = (struct kvr_feed *)p;
	if (k % 7 == 3) /* NULL: the defaults */
		want = p->cfg.mode == KVR_MODE_EVENTS ? 0 : KVR_EINVAL;
	cur_call = "kvr_feed_create";
	int rc = API(kvr_feed_create, p->r, k % 7 == 3 ? NULL : &fc, &f);
#ifdef KVR_HAVE_ZMQ
	struct kvr_feed *probe = (struct kvr_feed *)p; /* a failed create sets it to NULL */
	expect(API(kvr_feed_create, NULL, &fc, &probe), KVR_EINVAL, "feed_create(NULL)");
	CHECK(probe == NULL, "feed_create(NULL) left *out set");
#else
	/* Without zmq every feed call says so, whatever its arguments (kvrouter.h). */
	struct kvr_feed *probe = (struct kvr_feed *)p;
	expect(API(kvr_feed_create, NULL, &fc, &probe), KVR_ENOTSUP, "feed_create(NULL), no zmq");
	CHECK(probe == NULL, "feed_create(NULL), no zmq, left *out set");
#endif
	if (rc == KVR_ENOTSUP) /* built without zmq */
		return;
	expect(rc, want, "feed_create");
	if (rc) {
		API_VOID(kvr_feed_destroy, NULL);
		return;
	}
	cur_call = "kvr_feed_add";
	struct kvr_feed_endpoint ep = {.endpoint = "ipc:///nonexistent/kvr-fuzz-api",
	                               .topic = k % 2 ? "" : NULL,
	                               .worker_id = (uint64_t)(k % 4),
	                               .dp_rank = k % 3 == 0 ? KVR_FEED_DP_FROM_BATCH : 0};
	uint32_t id = 77;
	expect(API(kvr_feed_add, f, &ep, &id), 0, "feed_add");
	expect(API(kvr_feed_add, f, NULL, NULL), KVR_EINVAL, "feed_add(NULL)");
	struct kvr_feed_endpoint bad = {.endpoint = NULL};
	expect(API(kvr_feed_add, f, &bad, NULL), KVR_EINVAL, "feed_add(endpoint NULL)");
	bad.endpoint = "";
	expect(API(kvr_feed_add, f, &bad, NULL), KVR_EINVAL, "feed_add(endpoint empty)");
	bad.endpoint = "nonsense://x";
	expect(API(kvr_feed_add, f, &bad, NULL), KVR_EINVAL, "feed_add(endpoint refused)");
	struct kvr_feed_stats st;
	cur_call = "kvr_feed_get_stats";
	expect(API(kvr_feed_get_stats, f, id, &st), 0, "feed_get_stats");
	CHECK(st.batches == 0 && st.events == 0, "feed: events applied without a publisher");
	expect(API(kvr_feed_get_stats, f, KVR_FEED_ALL, &st), 0, "feed_get_stats(all)");
	expect(API(kvr_feed_get_stats, f, id + 1000, &st), KVR_ENOENT, "feed_get_stats(unknown)");
	expect(API(kvr_feed_get_stats, f, id, NULL), KVR_EINVAL, "feed_get_stats(NULL)");
	expect(API(kvr_feed_get_stats, NULL, id, &st), KVR_EINVAL, "feed_get_stats(feed NULL)");
	/* No publisher: no block on another medium, on any dp rank */
	uint64_t other[4];
	size_t n_other = 99;
	cur_call = "kvr_feed_other_medium_blocks";
	expect(API(kvr_feed_other_medium_blocks, f, id, k % 2, other, 4, &n_other), 0,
	       "other_medium_blocks");
	CHECK(n_other == 0, "other_medium_blocks: %zu blocks without a publisher", n_other);
	expect(API(kvr_feed_other_medium_blocks, f, id + 1000, 0, other, 4, &n_other), KVR_ENOENT,
	       "other_medium_blocks(unknown)");
	expect(API(kvr_feed_other_medium_blocks, f, id, 0, NULL, 4, &n_other), KVR_EINVAL,
	       "other_medium_blocks(out NULL, cap 4)");
	expect(API(kvr_feed_other_medium_blocks, f, id, 0, other, 4, NULL), KVR_EINVAL,
	       "other_medium_blocks(n_out NULL)");
	expect(API(kvr_feed_other_medium_blocks, NULL, id, 0, other, 4, &n_other), KVR_EINVAL,
	       "other_medium_blocks(feed NULL)");
	cur_call = "kvr_feed_remove";
	expect(API(kvr_feed_remove, f, id + 1000), KVR_ENOENT, "feed_remove(unknown)");
	if (k % 3)
		expect(API(kvr_feed_remove, f, id), 0, "feed_remove");
	if (k % 3 == 1)
		expect(API(kvr_feed_remove, f, id), KVR_ENOENT, "feed_remove twice");
	expect(API(kvr_feed_remove, NULL, id), KVR_EINVAL, "feed_remove(NULL)");
	cur_call = "kvr_feed_destroy";
	API_VOID(kvr_feed_destroy, f);
}

/* ---------------------------------------------------------------- program */

/* --limits: some fields at the ends of their documented ranges (0, 1, the maximum, near
 * 2^32 or 2^64), each drawn from the input.  The model holds for any of them: it never
 * predicts which rank is picked, and bounds expiry by the lease scan interval. */
static void limit_config(struct prog *p)
{
	struct kvr_config *c = &p->cfg;
	struct src *in = &p->in;
	static const uint32_t bss[] = {3, 7, 1000, 65536};
	static const uint64_t big[] = {UINT64_MAX, UINT64_MAX - 1, UINT64_MAX / 2,
	                               (uint64_t)1 << 62};
	static const double dbl[] = {0, 1e-300, 1e300, 1.7976931348623157e308};
	uint32_t mask = u16(in);
	if (mask & 1)
		c->block_size = bss[u8(in) % 4];
	if (mask & 2)
		c->lane_capacity = 2 + u8(in) % 3;
	if (mask & 4)
		c->lane_soft_depth = u8(in) % 2 ? 1 : (1u << 22);
	if (mask & 8)
		c->maint_every_tasks = u8(in) % 2 ? 1 : UINT32_MAX;
	if (mask & 16)
		c->maint_every_ns = u8(in) % 2 ? 1 : big[u8(in) % 4];
	if (mask & 32)
		c->booking_lazy_ns = u8(in) % 2 ? 0 : 1000000;
	if (mask & 64)
		c->ttl_ns =
		    u8(in) % 2 ? 1 : big[2 + u8(in) % 2]; /* the clock may step by ttl + 1 */
	if (mask & 128)
		c->lease_scan_interval_ns = u8(in) % 2 ? 1 : big[2 + u8(in) % 2];
	if (mask & 256)
		c->expected_prefill_ns = u8(in) % 2 ? 1 : big[u8(in) % 4];
	if (mask & 512)
		c->max_ranks = u8(in) % 2 ? 1 : 65536;
	if (mask & 1024)
		c->queue_capacity = u8(in) % 2 ? 1 : UINT32_MAX;
	if (mask & 2048)
		c->overlap_credit = dbl[u8(in) % 4];
	if (mask & 4096)
		c->prefill_load_scale = dbl[u8(in) % 4];
	if (mask & 8192)
		c->temperature = dbl[u8(in) % 4];
	if (mask & 16384)
		c->queue_threshold = dbl[u8(in) % 4];
	if (mask & 32768)
		c->seed = u8(in) % 2 ? 0 : UINT64_MAX;
}

static bool make_router(struct prog *p)
{
	struct kvr_config *c = &p->cfg;
	API_VOID(kvr_config_init, c);
	struct src *in = &p->in;
	static const uint32_t bss[] = {1, 2, 4, 16};
	c->mode = (enum kvr_mode)(u8(in) % 3);
	if (fuzz_api_events)
		c->mode = KVR_MODE_EVENTS;
	c->block_size = bss[u8(in) % 4];
	c->n_shards = 1 + u8(in) % 2;
	c->max_ranks = 1 + u8(in) % 6;
	uint32_t qk = u8(in) % 4;
	c->queue_threshold = qk == 0 ? 0 : qk == 1 ? 0.5 : qk == 2 ? 1.0 : 4.0;
	c->queue_policy = (enum kvr_queue_policy)(u8(in) % 2);
	c->queue_capacity = 1 + u8(in) % 6;
	c->sync_booking = u8(in) % 2;
	c->lease_scan_interval_ns = (uint64_t)(1 + u8(in) % 4) * 1000000000ull;
	c->ttl_ns = (uint64_t)(1 + u8(in) % 8) * 500000000ull;
	c->expected_prefill_ns = u8(in) % 3 == 0 ? 50000000ull : 0;
	c->temperature = u8(in) % 4 == 0 ? 0.5 : 0;
	c->seed = u64(in);
	/* One router in two bounds a rank without a capacity at 1..16 blocks, so programs reach
	 * the stored-block bound (within MAX_BLK, where the model knows what a rank holds).  Drawn
	 * from the seed, not the input: every program's bytes decode as before. */
	if ((c->seed & 1) == 0)
		c->events_max_blocks = 1 + (c->seed >> 8) % 16;
	c->shard_idle_spin_ns = 0; /* park at once: the fuzzer runs many routers */
	if (fuzz_api_limits)
		limit_config(p);
	c->now_ns = vclock;
	c->clock_ctx = &p->now;
	c->callback_ctx = p;
	c->on_event_gap = on_gap;
	if (u8(in) % 3)
		c->on_admit = on_admit;
	cur_call = "kvr_router_create";
	int rc = API(kvr_router_create, c, &p->r);
	expect(rc, 0, "create");
	struct kvr_config got;
	API(kvr_router_get_config, p->r, &got);
	c->n_shards = got.n_shards;
	return true;
}

/* Another router's handle given this router's ids, and this router given the other's: every
 * call must be refused and change nothing (the routers of a process issue different attempt
 * ids and tickets; each once counted from 1, and a finish given the wrong router's handle ended
 * the attempt that router had issued under the same number).  In one program in four (drawn
 * from the seed: no input is read, so every program's bytes decode as before), before the end. */
static bool foreign_refused(int rc)
{
	return rc == KVR_ESTALE || rc == KVR_ENOENT;
}

static void check_foreign_handles(struct prog *p)
{
	if ((p->cfg.seed >> 4) % 4 != 0)
		return;
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = p->cfg.mode;
	c.block_size = p->cfg.block_size;
	c.n_shards = 1;
	c.shard_idle_spin_ns = 0;
	struct kvr_router *o;
	cur_call = "kvr_router_create (foreign)";
	expect(API(kvr_router_create, &c, &o), 0, "the other router");
	cur_call = "kvr_rank_add (foreign)";
	expect(API(kvr_rank_add, o, (struct kvr_rank_id){0, 0}, 1, 4096, 0), 0, "its rank");
	uint32_t toks[64];
	for (uint32_t i = 0; i < 64; i++)
		toks[i] = i;
	struct kvr_request q;
	kvr_request_init(&q);
	q.tokens = toks;
	q.n_tokens = 64;
	struct kvr_decision d;
	cur_call = "kvr_route (foreign)";
	expect(API(kvr_route, o, &q, &d), 0, "a route on the other router");
	for (int k = 0; k < p->n_att; k++) {
		const uint64_t a = p->att[k].id;
		cur_call = "this router's attempt on the other";
		CHECK(foreign_refused(API(kvr_request_prefill_done, o, a)), "prefill_done");
		CHECK(foreign_refused(API(kvr_request_output, o, a, toks, 16)), "output");
		CHECK(foreign_refused(API(kvr_request_finish, o, a)), "finish");
		CHECK(foreign_refused(API(kvr_request_abort, o, a)), "abort");
	}
	for (int k = 0; k < p->n_tix; k++) {
		struct kvr_decision w;
		cur_call = "this router's ticket on the other";
		CHECK(API(kvr_route_cancel, o, p->tix[k].t) == KVR_ENOENT, "cancel");
		CHECK(API(kvr_route_wait, o, p->tix[k].t, 1, &w) == KVR_ENOENT, "wait");
	}
	cur_call = "the other router's attempt here";
	CHECK(foreign_refused(API(kvr_request_prefill_done, p->r, d.attempt)), "prefill_done");
	CHECK(foreign_refused(API(kvr_request_finish, p->r, d.attempt)), "finish");
	CHECK(foreign_refused(API(kvr_request_abort, p->r, d.attempt)), "abort");
	cur_call = "the other router's own finish";
	expect(API(kvr_request_finish, o, d.attempt), 0, "its attempt was left alone");
	kvr_router_destroy(o);
}

/* Finishes every attempt the model knows, with the reports that come meanwhile. */
static void finish_all(struct prog *p)
{
	while (p->n_att) {
		cur_call = "finish (end of program)";
		int rc = API(kvr_request_finish, p->r, p->att[0].id);
		CHECK(rc == 0 || (rc == KVR_ESTALE && expiry_possible(p, &p->att[0])),
		      "finish of a live attempt at the end: rc %d", rc);
		end_attempt(p, 0);
		drain_admits(p);
	}
}

/* The end of a program, before its cancels (which take every outcome left): the outcomes kept
 * for a collector nobody calls must go by themselves (core/queue.c, "An outcome nobody
 * collects").  With every attempt the model knows finished, the only attempts left are kept
 * admissions' (nobody was told them, so each is idle): as the clock moves, each lease expires
 * (kvrouter.h: one scan interval without progress, claimed at the reaper's next scan), which
 * lowers the load (the queue's waiting requests are admitted, kept or reported) and reclaims
 * the outcome; a failed one is reclaimed two lease scan intervals after it failed.  So with the
 * clock stepped a lease scan interval every millisecond and nothing else called but finishes
 * of the attempts reported meanwhile, the depth and kvr_queue_uncollected both reach 0, and
 * no report is left to come, within a bound of real time (the admission thread parks up to a
 * second while a failed outcome waits: core/queue_thread.c).  Skipped where the clock would
 * wrap (--limits' intervals near 2^64); nothing is stepped where all is collected already. */
static void check_uncollected_end(struct prog *p)
{
	if (!(p->cfg.queue_threshold > 0))
		return;
	uint64_t scan = p->cfg.lease_scan_interval_ns;
	uint64_t step = scan < 1000000 ? 1000000 : scan + 1;
	/* --clock-back: the shards' time never goes back (shards/runtime.c: a timed task runs at
	 * the highest reading its shard ran at, time_hw), so a reaper scan armed one interval after
	 * a reading the clock has since gone below fires only once the clock passes that reading
	 * again: the leases the scans expire wait up to the step back more (kvrouter.h, now_ns,
	 * says lease scans go by the clock's readings as they come).  Steps back are as large as
	 * the steps forward were (op_clock): with --limits, a ttl_ns + 1 near 2^62 ns, which a scan
	 * interval a millisecond would take 2^62 / scan_interval ms to make up (seed 3200002410
	 * --limits --clock-back: "after 10 s with the clock moving: kvr_queue_uncollected 3").  So
	 * the clock moves forward to its highest reading first, then a scan interval a
	 * millisecond: the expiry that the check waits for is then one or two intervals away, as
	 * on a clock that never went back. */
	if (p->now < p->now_hw)
		__atomic_store_n(&p->now, p->now_hw, __ATOMIC_RELAXED);
	if (scan > ((uint64_t)1 << 40) || p->now > UINT64_MAX / 2)
		return;
	double t0 = real_s();
	for (;;) {
		finish_all(p);
		track_uncollected(p);
		bool reports = false;
		for (int k = 0; k < p->n_tix; k++)
			reports |= !kept_outcome(p, &p->tix[k]);
		size_t depth = kvr_queue_depth(p->r), n = kvr_queue_uncollected(p->r);
		if (!depth && !n && !reports && !p->n_att)
			return;
		cur_call = "idle end of program";
		CHECK(real_s() - t0 < 10.0,
		      "after 10 s with the clock moving: kvr_queue_uncollected %zu, depth %zu, %s",
		      n, depth, reports ? "on_admit reports missing" : "all reported");
		__atomic_store_n(&p->now, p->now + step, __ATOMIC_RELAXED);
		usleep(1000);
		drain_admits(p);
	}
}

/* Finish everything, empty the queue, sync; then every invariant of an idle router. */
static void quiesce_and_check(struct prog *p)
{
	check_foreign_handles(p);
	finish_all(p);
	check_uncollected_end(p);
	for (int round = 0; round < 64; round++) {
		finish_all(p);
		while (p->n_tix) {
			uint64_t t = p->tix[0].t;
			cur_call = "cancel (end of program)";
			int rc = API(kvr_route_cancel, p->r, t);
			drain_admits(p);
			struct mtick *m = ticket_find(p, t);
			if (!m)
				continue; /* reported by on_admit during the cancel's pump */
			/* 0: queued, or admitted with nobody told (the cancel ended the attempt);
			 * KVR_ENOENT: its outcome was reclaimed, or is being told to on_admit
			 * (ticket_gone). */
			CHECK(rc == KVR_ENOENT || (rc == 0 && !m->told), "cancel rc %d", rc);
			if (rc == 0 || ticket_gone(p, m))
				ticket_drop(p, m);
			else
				await_report(p, t);
		}
		cur_call = "sync (end of program)";
		expect(API(kvr_router_sync, p->r, 10000), 0, "sync");
		drain_admits(p);
		if (!p->n_att && !p->n_tix)
			break;
	}
	CHECK(!p->n_att && !p->n_tix, "could not drain the router");
	for (int i = 0; i < N_IDS; i++) {
		if (!p->rk[i].present)
			continue;
		struct kvr_rank_stats s;
		cur_call = "stats (idle)";
		expect(API(kvr_rank_get_stats, p->r, rid(i), &s), 0, "stats");
		CHECK(s.active_requests == 0 && s.active_prefill_tokens == 0 &&
		          s.active_blocks == 0,
		      "idle rank %d: requests %" PRIu64 " prefill %" PRIu64 " blocks %" PRIu64, i,
		      s.active_requests, s.active_prefill_tokens, s.active_blocks);
		if (p->rk[i].cap_finite_lru && !p->rk[i].cap_proved)
			CHECK(s.resident_blocks <= p->rk[i].cap_seen,
			      "idle rank %d: resident %" PRIu64 " > capacity %" PRIu64
			      " (registered %" PRIu64 ")",
			      i, s.resident_blocks, p->rk[i].cap_seen, p->rk[i].cap);
		check_stats(p, i, &s);
		check_blocks(p, i);
	}
	/* stale stays stale */
	for (int k = 0; k < p->n_ended; k++) {
		cur_call = "finish of an ended attempt (end)";
		expect(API(kvr_request_finish, p->r, p->ended[k]), KVR_ESTALE, "ended attempt");
	}
}

struct run_arg {
	const uint8_t *data;
	size_t size;
	uint64_t calls;
	uint64_t routes; /* kvr_route calls so far */
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
	p->in = (struct src){.p = ra->data, .n = ra->size};
	p->now = p->now_hw = 1000;
	pthread_mutex_init(&p->mu, NULL);
	p->self = pthread_self();
	make_router(p);
	/* FUZZ_API_MAX_OPS cuts a program short (to bisect a failure); FUZZ_API_TRACE prints the
	 * operation codes. */
	const char *mo = getenv("FUZZ_API_MAX_OPS");
	size_t max_ops = mo ? (size_t)strtoull(mo, NULL, 0) : 4096;
	bool trace = getenv("FUZZ_API_TRACE") != NULL;
	trace_on = trace;
	if (getenv("FUZZ_API_CRAFT"))
		fuzz_api_craft = true;
	if (getenv("FUZZ_API_EVENTS"))
		fuzz_api_events = true;
	if (getenv("FUZZ_API_LIMITS"))
		fuzz_api_limits = true;
	if (getenv("FUZZ_API_CLOCK_BACK"))
		fuzz_api_clock_back = true;
	if (getenv("FUZZ_API_SLOW_ADMIT"))
		fuzz_api_slow_admit = true;
	if (getenv("FUZZ_API_STALL_ADMIT"))
		fuzz_api_stall_admit = true;
	for (cur_op = 0; !src_done(&p->in) && cur_op < max_ops; cur_op++) {
		uint32_t op = u8(&p->in) % 32;
		if (trace)
			fprintf(stderr, "fuzz_api: op %zu code %u", cur_op, op);
		last_rc = 1;
		switch (op) {
		case 0:
		case 1:
		case 2:
			op_rank_add(p);
			break;
		case 3:
			op_rank_remove(p);
			break;
		case 4:
			op_set_capacity(p);
			break;
		case 5:
			op_rank_reset(p);
			break;
		case 6:
			op_stats(p);
			break;
		case 7: {
			int i = gen_rank_index(p);
			check_blocks(p, i);
			break;
		}
		case 8:
		case 9:
		case 10:
		case 11:
		case 12:
			op_route(p);
			break;
		case 13:
			op_wait(p);
			break;
		case 14:
			op_cancel(p);
			break;
		case 15:
		case 16:
			op_lifecycle(p, 0);
			break;
		case 17:
		case 18:
			op_lifecycle(p, 1);
			break;
		case 19:
		case 20:
			op_lifecycle(p, 2);
			break;
		case 21:
			op_lifecycle(p, 3);
			break;
		case 22:
		case 23:
		case 24:
			op_event(p);
			break;
		case 25:
			op_metrics(p);
			break;
		case 26:
			op_clock(p);
			break;
		case 27:
			op_sync(p);
			break;
		case 28:
			if (fuzz_api_events)
				op_ev_probe(p);
			else
				op_hash(p);
			break;
		case 29:
			if (fuzz_api_events)
				op_ev_probe(p);
			else if (u8(&p->in) % 8 == 0)
				op_feed(p);
			else
				op_config(p);
			break;
		case 31:
			op_heal(p);
			break;
		default:
			op_null_args(p);
			break;
		}
		drain_admits(p); /* any call may have pumped the queue */
		track_uncollected(p);
		p->calls++;
		if (trace)
			fprintf(stderr, " %s rc %d [%s]\n", cur_call, last_rc, cur_detail);
		for (int k = 0; k < p->n_att; k++)
			if (p->att[k].id > p->max_attempt_seen)
				p->max_attempt_seen = p->att[k].id;
	}
	quiesce_and_check(p);
	cur_call = "kvr_router_destroy";
	API_VOID(kvr_router_destroy, p->r);
	ra->calls = p->calls;
	pthread_mutex_destroy(&p->mu);
	free(p);
	return NULL;
}

void fuzz_api_run(const uint8_t *data, size_t size, uint64_t *calls)
{
	struct run_arg ra = {.data = data, .size = size};
	int64_t leak = kvr_test_run_fresh_thread(run_program, &ra);
	if (leak) {
		fprintf(stderr,
		        "fuzz_api: seed %" PRIu64 ": leak: %" PRId64 " bytes still allocated\n",
		        fuzz_api_current_seed, leak);
		if (!getenv("FUZZ_API_LEAK_REPORT"))
			abort(); /* else let LeakSanitizer name the allocation at exit */
	}
	if (calls)
		*calls += ra.calls;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fuzz_api_run(data, size, &fuzz_api_totals.calls);
	return 0;
}
