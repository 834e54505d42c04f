/*
 * tests/stress/stress_queue_churn.c - the admission queue while its ranks churn, for
 * ThreadSanitizer: restricted and unrestricted requests queued on saturated ranks that an admin
 * thread removes, re-adds (the same ids and new ones), resets and resizes meanwhile.
 *
 * Six rank ids (workers 1-6, 2 shards; 5 and 6 absent at the start) with a budget of 48 to 96
 * prefill tokens each, so that one or two 40-120 token prompts saturate a rank and most
 * requests queue.  Frontend threads route requests that are unrestricted, pinned to one of the
 * six, or allow-listed to 2-3 of them (four lists drawn often, so that their groups repeat,
 * and eight more); half with KVR_ROUTE_WAIT and a deadline of 0-3 ms, the rest left to on_admit
 * (a fifth of those cancelled, by the frontend at once or handed to an ender).  Ender threads,
 * which never route, end the attempts that kvr_route, on_admit and the waits return (prefill_done
 * first for some, then finish or abort), collect or cancel the tickets whose waits timed out,
 * and cancel the tickets handed to them.  An admin thread removes and re-adds ranks (keeping one
 * of workers 1-4 live, so an unrestricted request never fails), adds fresh ids (workers 7 and up)
 * and removes them, resets ranks (kvr_rank_reset) and changes their capacity (with the same
 * incarnation or a new one), and re-adds with another budget.  A third round runs without
 * on_admit: every queued ticket is then collected by kvr_route_wait or cancelled.
 *
 * What it exercises: a push that finds its restricted ranks gone is refused with KVR_ENOENT
 * (110c098); groups of restricted requests looked at again after a call lowered load
 * (3cf5dd8); a failed booking's post waking the admission thread (a8396c3); the admission
 * thread reaping outcomes nobody collects once their attempts ended without a call, as a
 * removal or a reset ends them (4ed3b30).
 *
 * Checked.  Every ticket is resolved exactly once: admitted (by kvr_route itself, on_admit or a
 * wait, its attempt then ended by an ender), failed with KVR_ENOENT (restricted requests only,
 * their ranks gone: told by on_admit, a wait or kvr_route), cancelled (a cancel that returned
 * 0), or, waited on and given up, dropped (its admission reaped once its attempt ended:
 * KVR_ENOENT to the wait or cancel that came later; not checked per ticket: the test does not
 * see the attempt a reap ended); on_admit never names a ticket twice, nor
 * one that a wait or a cancel resolved or that was waited on, and every ticket whose cancel said
 * KVR_ENOENT is told to on_admit.  No attempt id is returned twice.  Once the frontends and the
 * admin stopped (every rank re-added) and the enders paused: no request stays queued while a
 * rank it may use has room (its active prefill tokens at most its budget), within 2 s.  Once
 * every attempt is ended: nothing queued, nothing uncollected (kvr_queue_depth,
 * kvr_queue_uncollected), and every rank idle (no request, prefill token or block).
 * It found a KVR_ROUTE_WAIT request admitted, and its attempt ended by a reset or removal,
 * between kvr_route's settle and its own wait: the reap dropped the outcome and kvr_route returned
 * KVR_ENOENT with d still KVR_QUEUED (once in 13 TSan runs before the fix; test_route_wait_held
 * forces that window).
 * Exit 0 pass, 1 fail.  argv[1]: duration of each round in ms (default 700); argv[2]: frontend
 * threads (3); argv[3]: seed.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "core/router_internal.h"
#include "tests/common/mono_clock.h"
#include "tests/common/xorshift.h"

#define MAXT    (1u << 20) /* tickets of the whole run (one process-wide counter, from 1) */
#define MAXA    (1u << 20) /* attempts of a round */
#define NIDS    6          /* workers 1..NIDS the requests name */
#define NFRESH  64         /* workers NIDS+1.. the admin adds once each and removes */
#define NENDERS 2

/* How a ticket was resolved (state[]): one exchange from R_NONE, so a second one is seen. */
enum {
	R_NONE,
	R_ROUTE_OK,   /* kvr_route queued it and admitted it before returning */
	R_ROUTE_FAIL, /* kvr_route (KVR_ROUTE_WAIT) told its failed admission */
	R_CB_OK,      /* on_admit: admitted */
	R_CB_FAIL,    /* on_admit: failed */
	R_WAIT_OK,    /* kvr_route_wait collected the admission */
	R_WAIT_FAIL,  /* kvr_route_wait told the failed admission */
	R_CANCEL,     /* kvr_route_cancel returned 0 */
	R_DROP,       /* waited on, then KVR_ENOENT: reaped once its attempt ended */
};
static const char *const rname[] = {"none",        "route",           "route-failed",
                                    "on_admit",    "on_admit-failed", "wait",
                                    "wait-failed", "cancel",          "dropped"};

/* How a ticket was issued (kind[]). */
enum { K_NONE, K_CB, K_WAITED };

static struct kvr_router *R;
static bool with_cb;
static _Atomic uint8_t state[MAXT], kind[MAXT], restr[MAXT], cancel_enoent[MAXT];
static _Atomic int16_t fail_err[MAXT];
static atomic_int stop_front, stop_admin, stop_enders, failed;
static atomic_uint_fast64_t n_issued, n_resolved, n_refused_gone, n_full, n_direct, n_ended,
    n_stale, n_res[9];

#define FAIL(...)                                                                                  \
	do {                                                                                       \
		fprintf(stderr, "stress_queue_churn: " __VA_ARGS__);                               \
		fputc('\n', stderr);                                                               \
		atomic_store(&failed, 1);                                                          \
	} while (0)

/* ---------------------------------------------------------------- restrictions */

/* restr[t]: 0 unrestricted; 1..NIDS pinned to that worker; 16 + i allow-list i. */
#define NLISTS 12
static const uint8_t lists[NLISTS][3] = {
    {1, 2, 0}, {2, 3, 4}, {4, 5, 0}, {5, 6, 1}, /* drawn often: their groups repeat */
    {3, 6, 0}, {1, 5, 0}, {2, 6, 3}, {6, 4, 0}, {3, 1, 5}, {2, 5, 0}, {4, 1, 6}, {6, 5, 0},
};

static size_t restriction_ids(uint8_t code, uint8_t *out)
{
	if (code == 0)
		return 0;
	if (code <= NIDS) {
		out[0] = code;
		return 1;
	}
	const uint8_t *l = lists[code - 16];
	size_t n = 0;
	for (int i = 0; i < 3 && l[i]; i++)
		out[n++] = l[i];
	return n;
}

static struct kvr_rank_id rid(uint64_t w)
{
	return (struct kvr_rank_id){w, 0};
}

/* ---------------------------------------------------------------- tickets */

static uint64_t tslot(uint64_t t)
{
	if (t == 0 || t >= MAXT) {
		FAIL("ticket %" PRIu64 " out of range", t);
		return 0;
	}
	return t;
}

static void resolve(uint64_t t, uint8_t how, int err)
{
	uint64_t i = tslot(t);
	uint8_t prev = atomic_exchange(&state[i], how);
	if (prev != R_NONE)
		FAIL("ticket %" PRIu64 ": resolved %s after %s", t, rname[how], rname[prev]);
	atomic_store(&fail_err[i], (int16_t)err);
	atomic_fetch_add(&n_res[how], 1);
	atomic_fetch_add(&n_resolved, 1);
}

static void issue(uint64_t t, uint8_t k, uint8_t code)
{
	uint64_t i = tslot(t);
	uint8_t prev = atomic_exchange(&kind[i], k);
	if (prev != K_NONE)
		FAIL("ticket %" PRIu64 " issued twice", t);
	atomic_store(&restr[i], code);
	atomic_fetch_add(&n_issued, 1);
}

/* ---------------------------------------------------------------- shared lists */

/* A bag under a mutex, never held across a library call (on_admit pushes into one). */
struct bag {
	pthread_mutex_t mu;
	uint64_t *v;
	size_t n, cap;
};
static struct bag attempts, waited, to_cancel;
static uint64_t *all_attempts; /* every attempt returned this round, for duplicates */
static atomic_size_t n_all_attempts;

static void bag_init(struct bag *b, size_t cap)
{
	pthread_mutex_init(&b->mu, NULL);
	b->v = calloc(cap, sizeof(uint64_t));
	b->n = 0;
	b->cap = cap;
}

static void bag_push(struct bag *b, uint64_t v)
{
	pthread_mutex_lock(&b->mu);
	if (b->n < b->cap)
		b->v[b->n++] = v;
	else
		FAIL("a bag overflowed: %zu", b->cap);
	pthread_mutex_unlock(&b->mu);
}

static bool bag_pop(struct bag *b, uint64_t *seed, uint64_t *v)
{
	pthread_mutex_lock(&b->mu);
	bool ok = b->n > 0;
	if (ok) {
		size_t i = (size_t)(xorshift64(seed) % b->n);
		*v = b->v[i];
		b->v[i] = b->v[--b->n];
	}
	pthread_mutex_unlock(&b->mu);
	return ok;
}

static size_t bag_count(struct bag *b)
{
	pthread_mutex_lock(&b->mu);
	size_t n = b->n;
	pthread_mutex_unlock(&b->mu);
	return n;
}

/* An attempt to end: bit 63 once its prefill_done was called. */
#define PREFILLED (1ull << 63)

static void got_attempt(uint64_t a)
{
	if (a == 0 || a & PREFILLED) {
		FAIL("attempt id %" PRIx64, a);
		return;
	}
	size_t i = atomic_fetch_add(&n_all_attempts, 1);
	if (i < MAXA)
		all_attempts[i] = a;
	bag_push(&attempts, a);
}

/* ---------------------------------------------------------------- on_admit */

static void on_admit(void *ctx, uint64_t ticket, const struct kvr_decision *d)
{
	(void)ctx;
	if (d->ticket != ticket)
		FAIL("on_admit: ticket %" PRIu64 " with a decision naming %" PRIu64, ticket,
		     d->ticket);
	if (d->status == KVR_DECIDED) {
		resolve(ticket, R_CB_OK, 0);
		got_attempt(d->attempt);
	} else if (d->status == KVR_FAILED) {
		resolve(ticket, R_CB_FAIL, d->error);
	} else {
		FAIL("on_admit: ticket %" PRIu64 " status %d", ticket, d->status);
	}
}

/* ---------------------------------------------------------------- frontends */

static const struct kvr_decision unwritten = {.status = 99};

/* A kvr_route refused before anything queued: d zeroed, KVR_FAILED with the code, no ticket
 * (kvrouter.h; it was left unwritten, or reading the decision whose booking failed). */
static bool refused(const struct kvr_decision *d, int rc)
{
	return d->status == KVR_FAILED && d->ticket == 0 && d->error == rc && d->attempt == 0;
}

static void *frontend(void *arg)
{
	uint64_t seed = (uint64_t)(uintptr_t)arg * 0x9e3779b97f4a7c15ull + 1;
	uint32_t tok[128];
	struct kvr_rank_id ids[3];
	while (!atomic_load(&stop_front)) {
		/* A bounded backlog, so that the drain stays short. */
		if ((int64_t)(atomic_load(&n_issued) - atomic_load(&n_resolved)) > 64 ||
		    bag_count(&attempts) > 256) {
			sleep_us(100);
			continue;
		}
		size_t n = 40 + xorshift64(&seed) % 81;
		for (size_t i = 0; i < n; i++)
			tok[i] = (uint32_t)xorshift64(&seed);
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = n;
		q.expected_output_tokens = 8;
		uint8_t code = 0;
		unsigned r = (unsigned)(xorshift64(&seed) % 10);
		if (r < 3) {
			code = (uint8_t)(1 + xorshift64(&seed) % NIDS);
		} else if (r < 6) {
			unsigned l = (unsigned)(xorshift64(&seed) % 3 ? xorshift64(&seed) % 4
			                                              : xorshift64(&seed) % NLISTS);
			code = (uint8_t)(16 + l);
		}
		uint8_t w[3];
		size_t nw = restriction_ids(code, w);
		for (size_t i = 0; i < nw; i++)
			ids[i] = rid(w[i]);
		if (code && code <= NIDS)
			q.pinned = &ids[0];
		else if (code) {
			q.allow = ids;
			q.n_allow = nw;
		}
		bool wait = !with_cb || xorshift64(&seed) % 2;
		if (wait && with_cb) {
			q.flags = KVR_ROUTE_WAIT;
			q.deadline_ns = kvr_router_now(R) + xorshift64(&seed) % 3000000;
		}
		struct kvr_decision d = unwritten;
		int rc = kvr_route(R, &q, &d);
		if (rc == 0 && d.status == KVR_DECIDED) {
			if (d.ticket) { /* queued, then admitted before kvr_route returned */
				issue(d.ticket, wait ? K_WAITED : K_CB, code);
				resolve(d.ticket, R_ROUTE_OK, 0);
			} else {
				atomic_fetch_add(&n_direct, 1);
			}
			got_attempt(d.attempt);
		} else if (rc == 0 && d.status == KVR_QUEUED && !(q.flags & KVR_ROUTE_WAIT)) {
			uint64_t t = d.ticket;
			if (!with_cb) {
				issue(t, K_WAITED, code);
				bag_push(&waited, t);
				continue;
			}
			issue(t, K_CB, code);
			unsigned c = (unsigned)(xorshift64(&seed) % 10);
			if (c == 0) { /* cancelled at once */
				rc = kvr_route_cancel(R, t);
				if (rc == 0)
					resolve(t, R_CANCEL, 0);
				else if (rc == KVR_ENOENT)
					atomic_store(&cancel_enoent[t], 1); /* on_admit's */
				else
					FAIL("cancel %" PRIu64 ": %d", t, rc);
			} else if (c == 1) {
				bag_push(&to_cancel, t); /* an ender cancels it */
			}
		} else if (rc == KVR_ETIMEDOUT && d.status == KVR_QUEUED && d.ticket) {
			issue(d.ticket, K_WAITED, code);
			bag_push(&waited, d.ticket);
		} else if (rc && d.status == KVR_FAILED && d.ticket) {
			issue(d.ticket, K_WAITED, code);
			if (d.error != rc)
				FAIL("kvr_route: rc %d, error %d", rc, d.error);
			resolve(d.ticket, R_ROUTE_FAIL, rc);
		} else if (rc == KVR_ENOENT && refused(&d, rc)) {
			/* Its pin or allowed ranks are gone (looked at by kvr_route, or by the
			 * push: 110c098); never an unrestricted one (a worker of 1-4 is live). */
			if (!code)
				FAIL("unrestricted kvr_route: KVR_ENOENT (%s)", kvr_last_error());
			atomic_fetch_add(&n_refused_gone, 1);
		} else if (rc == KVR_EAGAIN && refused(&d, rc)) {
			atomic_fetch_add(&n_full, 1);
		} else {
			FAIL("kvr_route: rc %d (%s), status %d, ticket %" PRIu64, rc,
			     kvr_last_error(), d.status, d.ticket);
		}
	}
	return NULL;
}

/* ---------------------------------------------------------------- enders */

static void end_attempt(uint64_t a, uint64_t *seed)
{
	uint64_t id = a & ~PREFILLED;
	int rc;
	if (!(a & PREFILLED) && xorshift64(seed) % 3 == 0) {
		rc = kvr_request_prefill_done(R, id);
		if (rc == 0) {
			bag_push(&attempts, a | PREFILLED);
			return;
		}
	} else {
		rc = xorshift64(seed) % 2 ? kvr_request_finish(R, id) : kvr_request_abort(R, id);
	}
	if (rc == KVR_ESTALE) /* its rank was removed or reset: ended already */
		atomic_fetch_add(&n_stale, 1);
	else if (rc)
		FAIL("ending attempt %" PRIu64 ": %d (%s)", id, rc, kvr_last_error());
	atomic_fetch_add(&n_ended, 1);
}

/* Collects or gives up on waited ticket t (its wait timed out before): true when resolved. */
static bool settle_waited(uint64_t t, uint64_t deadline, bool cancel)
{
	int rc;
	if (cancel) {
		rc = kvr_route_cancel(R, t);
		if (rc == 0)
			resolve(t, R_CANCEL, 0);
		else if (rc == KVR_ENOENT)
			resolve(t, R_DROP, 0);
		else
			FAIL("cancel of waited %" PRIu64 ": %d", t, rc);
		return true;
	}
	struct kvr_decision d = unwritten;
	rc = kvr_route_wait(R, t, deadline, &d);
	if (rc == KVR_ETIMEDOUT)
		return false;
	if (rc == 0 && d.status == KVR_DECIDED && d.ticket == t) {
		resolve(t, R_WAIT_OK, 0);
		got_attempt(d.attempt);
	} else if (rc && d.status == KVR_FAILED && d.ticket == t && d.error == rc) {
		resolve(t, R_WAIT_FAIL, rc);
	} else if (rc == KVR_ENOENT && d.status == unwritten.status) {
		resolve(t, R_DROP, 0);
	} else {
		FAIL("wait %" PRIu64 ": rc %d status %d ticket %" PRIu64, t, rc, d.status,
		     d.ticket);
		return true;
	}
	return true;
}

static void *ender(void *arg)
{
	uint64_t seed = (uint64_t)(uintptr_t)arg * 0x2545f4914f6cdd1dull + 7;
	while (!atomic_load(&stop_enders)) {
		uint64_t v;
		unsigned op = (unsigned)(xorshift64(&seed) % 8);
		if (op < 5) {
			if (bag_pop(&attempts, &seed, &v))
				end_attempt(v, &seed);
			else
				sleep_us(50);
		} else if (op < 7) {
			if (bag_pop(&waited, &seed, &v) &&
			    !settle_waited(v, kvr_router_now(R) + xorshift64(&seed) % 2000000,
			                   xorshift64(&seed) % 4 == 0))
				bag_push(&waited, v);
		} else if (bag_pop(&to_cancel, &seed, &v)) {
			int rc = kvr_route_cancel(R, v);
			if (rc == 0)
				resolve(v, R_CANCEL, 0);
			else if (rc == KVR_ENOENT)
				atomic_store(&cancel_enoent[v], 1); /* on_admit's */
			else
				FAIL("cancel %" PRIu64 ": %d", v, rc);
		}
		sleep_us(20); /* a slower drain than the frontends' routes: the ranks saturate */
	}
	return NULL;
}

/* ---------------------------------------------------------------- admin */

/* Only the admin thread changes ranks while it runs; main reads these after joining it. */
static bool live[NIDS + 1 + NFRESH];
static uint64_t inc[NIDS + 1 + NFRESH];
static uint32_t mbt[NIDS + 1 + NFRESH];
static const uint32_t budgets[3] = {48, 64, 96};

static void admin_add(uint64_t w, uint32_t budget)
{
	int rc = kvr_rank_add(R, rid(w), ++inc[w], 1000, budget);
	if (rc)
		FAIL("kvr_rank_add %" PRIu64 ": %d (%s)", w, rc, kvr_last_error());
	live[w] = true;
	mbt[w] = budget;
}

static void admin_remove(uint64_t w)
{
	int rc = kvr_rank_remove(R, rid(w));
	if (rc)
		FAIL("kvr_rank_remove %" PRIu64 ": %d (%s)", w, rc, kvr_last_error());
	live[w] = false;
}

static void *admin(void *arg)
{
	uint64_t seed = (uint64_t)(uintptr_t)arg | 1;
	uint64_t fresh = NIDS + 1;
	while (!atomic_load(&stop_admin)) {
		sleep_us(1000 + (long)(xorshift64(&seed) % 2000));
		uint64_t w = 1 + xorshift64(&seed) % NIDS;
		unsigned op = (unsigned)(xorshift64(&seed) % 10);
		if (op < 3) { /* remove, keeping a worker of 1-4 live; or re-add */
			unsigned base = 0;
			for (uint64_t i = 1; i <= 4; i++)
				base += live[i];
			if (!live[w])
				admin_add(w, budgets[xorshift64(&seed) % 3]);
			else if (w > 4 || base > 1)
				admin_remove(w);
		} else if (op < 5) { /* re-add at once: the same id, another life */
			if (live[w] && (w > 4 || live[1] + live[2] + live[3] + live[4] > 1)) {
				admin_remove(w);
				admin_add(w, budgets[xorshift64(&seed) % 3]);
			}
		} else if (op < 7) {
			if (live[w]) {
				int rc = kvr_rank_reset(R, rid(w), ++inc[w]);
				if (rc)
					FAIL("kvr_rank_reset %" PRIu64 ": %d (%s)", w, rc,
					     kvr_last_error());
			}
		} else if (op < 9) {
			if (live[w]) {
				bool life = xorshift64(&seed) % 3 == 0;
				uint64_t cap = xorshift64(&seed) % 4 == 0
				                   ? KVR_CAPACITY_NONE
				                   : 200 + xorshift64(&seed) % 2000;
				int rc =
				    kvr_rank_set_capacity(R, rid(w), life ? ++inc[w] : inc[w], cap);
				if (rc)
					FAIL("kvr_rank_set_capacity %" PRIu64 ": %d (%s)", w, rc,
					     kvr_last_error());
			}
		} else { /* a fresh id, removed at the next such turn */
			if (fresh > NIDS + 1 && live[fresh - 1])
				admin_remove(fresh - 1);
			if (fresh < NIDS + 1 + NFRESH)
				admin_add(fresh++, budgets[xorshift64(&seed) % 3]);
		}
	}
	/* Every rank of 1-NIDS re-added, the fresh ones gone. */
	for (uint64_t w = 1; w <= NIDS; w++)
		if (!live[w])
			admin_add(w, budgets[xorshift64(&seed) % 3]);
	for (uint64_t w = NIDS + 1; w < NIDS + 1 + NFRESH; w++)
		if (live[w])
			admin_remove(w);
	return NULL;
}

/* ---------------------------------------------------------------- the checks */

/* Whether worker w has room now: its active prefill tokens at most its budget (threshold 1). */
static bool has_room(uint64_t w, uint64_t *load)
{
	struct kvr_rank_stats s;
	if (kvr_rank_get_stats(R, rid(w), &s)) {
		FAIL("rank %" PRIu64 " gone at the end", w);
		return false;
	}
	*load = s.active_prefill_tokens;
	return s.active_prefill_tokens <= mbt[w];
}

/* The tickets still waiting whose restriction has a rank with room (waited ones looked at with
 * a past deadline: an admission is collected, still waiting is KVR_ETIMEDOUT); one of them named
 * in *t_out.  Context: main, with the frontends, enders and admin joined. */
static size_t queued_with_room(uint64_t max_t, uint64_t *t_out, uint64_t *load_out)
{
	size_t n = bag_count(&waited), bad = 0;
	uint64_t seed = 3, t;
	uint64_t keep[256];
	size_t n_keep = 0;
	for (size_t k = 0; k < n && bag_pop(&waited, &seed, &t); k++)
		if (!settle_waited(t, 1, false)) {
			if (n_keep < 256)
				keep[n_keep++] = t;
			else
				bag_push(&waited, t);
		}
	for (size_t k = 0; k < n_keep; k++)
		bag_push(&waited, keep[k]);
	for (uint64_t i = 1; i <= max_t && i < MAXT; i++) {
		if (atomic_load(&kind[i]) == K_NONE || atomic_load(&state[i]) != R_NONE)
			continue;
		uint8_t w[3];
		size_t nw = restriction_ids(atomic_load(&restr[i]), w);
		bool room = false;
		uint64_t load = 0;
		if (nw == 0) {
			for (uint64_t x = 1; x <= NIDS && !room; x++)
				room = has_room(x, &load);
		} else {
			for (size_t j = 0; j < nw && !room; j++)
				room = has_room(w[j], &load);
		}
		if (room && bad++ == 0) {
			*t_out = i;
			*load_out = load;
		}
	}
	return bad;
}

static uint64_t max_ticket_seen(void)
{
	uint64_t m = 0;
	for (uint64_t i = 1; i < MAXT; i++)
		if (atomic_load(&kind[i]) != K_NONE)
			m = i;
	return m;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void check_tickets(uint64_t lo, uint64_t hi)
{
	unsigned shown = 0;
	for (uint64_t i = lo; i <= hi && i < MAXT; i++) {
		uint8_t k = atomic_load(&kind[i]), s = atomic_load(&state[i]);
		uint8_t code = atomic_load(&restr[i]);
		int err = atomic_load(&fail_err[i]);
		const char *why = NULL;
		if (k == K_NONE && s != R_NONE)
			why = "resolved, never issued";
		else if (k == K_NONE)
			continue;
		else if (s == R_NONE)
			why = "never resolved";
		else if (k == K_WAITED && (s == R_CB_OK || s == R_CB_FAIL))
			why = "waited on, told to on_admit";
		else if (k == K_CB &&
		         (s == R_WAIT_OK || s == R_WAIT_FAIL || s == R_DROP || s == R_ROUTE_FAIL))
			why = "left to on_admit, resolved otherwise";
		else if (atomic_load(&cancel_enoent[i]) && s != R_CB_OK && s != R_CB_FAIL)
			why = "its cancel said KVR_ENOENT, on_admit never told it";
		else if ((s == R_CB_FAIL || s == R_WAIT_FAIL || s == R_ROUTE_FAIL) &&
		         (err != KVR_ENOENT || code == 0))
			why = "failed, not a restricted request's KVR_ENOENT";
		if (why && shown++ < 8)
			FAIL("ticket %" PRIu64
			     " (kind %u, restriction %u, resolved %s, error %d): %s",
			     i, k, code, rname[s], err, why);
		else if (why)
			atomic_store(&failed, 1);
	}
}

/* ---------------------------------------------------------------- a round */

static int round_run(const char *name, enum kvr_queue_policy pol, bool cb, unsigned ms, unsigned nf,
                     uint64_t seed)
{
	uint64_t t0 = now_ms();
	with_cb = cb;
	atomic_store(&stop_front, 0);
	atomic_store(&stop_admin, 0);
	atomic_store(&stop_enders, 0);
	atomic_store(&n_all_attempts, 0);
	memset(live, 0, sizeof(live));
	memset(inc, 0, sizeof(inc));
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.queue_threshold = 1.0;
	c.queue_capacity = 96;
	c.queue_policy = pol;
	c.on_admit = cb ? on_admit : NULL;
	if (kvr_router_create(&c, &R)) {
		fprintf(stderr, "kvr_router_create: %s\n", kvr_last_error());
		return 1;
	}
	for (uint64_t w = 1; w <= 4; w++)
		admin_add(w, budgets[w % 3]);
	uint64_t first = max_ticket_seen() + 1;
	uint64_t res0[9];
	for (int i = 0; i < 9; i++)
		res0[i] = atomic_load(&n_res[i]);
	uint64_t issued0 = atomic_load(&n_issued), gone0 = atomic_load(&n_refused_gone);

	pthread_t fr[8], en[NENDERS], ad;
	for (unsigned i = 0; i < nf; i++)
		pthread_create(&fr[i], NULL, frontend, (void *)(uintptr_t)(seed + i + 1));
	for (unsigned i = 0; i < NENDERS; i++)
		pthread_create(&en[i], NULL, ender, (void *)(uintptr_t)(seed + 100 + i));
	pthread_create(&ad, NULL, admin, (void *)(uintptr_t)(seed + 200));
	sleep_us((long)ms * 1000);
	atomic_store(&stop_front, 1);
	for (unsigned i = 0; i < nf; i++)
		pthread_join(fr[i], NULL);
	atomic_store(&stop_admin, 1);
	pthread_join(ad, NULL);
	atomic_store(&stop_enders, 1);
	for (unsigned i = 0; i < NENDERS; i++)
		pthread_join(en[i], NULL);
	uint64_t last = max_ticket_seen();

	/* Quiet: nothing ends an attempt now; whatever waits must have no rank with room. */
	kvr_router_sync(R, 2000);
	uint64_t q0 = now_ms(), t = 0, load = 0;
	size_t bad = 1;
	unsigned looks = 0;
	while (bad && now_ms() - q0 < 2000) {
		bad = queued_with_room(last, &t, &load);
		looks++;
		if (bad)
			sleep_us(1000);
	}
	size_t depth_quiet = kvr_queue_depth(R);
	if (bad) {
		uint8_t code = atomic_load(&restr[t]);
		FAIL("%s: %zu requests queued for 2 s with a rank they may use free, e.g. ticket "
		     "%" PRIu64 " (restriction %u; that rank's prefill load %" PRIu64 ")",
		     name, bad, t, code, load);
	}

	/* Drain: end every attempt, collect every waited ticket. */
	uint64_t d0 = now_ms(), s = seed | 1;
	size_t depth = 1, unc = 1;
	uint64_t open = 1;
	while ((depth || unc || open || bag_count(&attempts) || bag_count(&waited)) &&
	       now_ms() - d0 < 10000) {
		uint64_t v;
		while (bag_pop(&attempts, &s, &v))
			end_attempt(v | PREFILLED, &s);
		size_t n = bag_count(&waited);
		for (size_t k = 0; k < n && bag_pop(&waited, &s, &v); k++)
			if (!settle_waited(v, kvr_router_now(R) + 100000, false))
				bag_push(&waited, v);
		kvr_router_sync(R, 1000);
		depth = kvr_queue_depth(R);
		unc = kvr_queue_uncollected(R);
		open = atomic_load(&n_issued) - atomic_load(&n_resolved); /* all returned now */
		if (depth || unc || open)
			sleep_us(500);
	}
	if (depth || unc || open)
		FAIL("%s: after the drain: %zu queued, %zu uncollected, %" PRIu64 " tickets open",
		     name, depth, unc, open);
	check_tickets(first, last);

	/* Every rank idle. */
	for (uint64_t w = 1; w <= NIDS; w++) {
		struct kvr_rank_stats st;
		if (kvr_rank_get_stats(R, rid(w), &st)) {
			FAIL("%s: rank %" PRIu64 " gone", name, w);
			continue;
		}
		if (st.active_requests || st.active_prefill_tokens || st.active_blocks)
			FAIL("%s: rank %" PRIu64 " not idle: %" PRIu64 " requests, %" PRIu64
			     " prefill tokens, %" PRIu64 " blocks",
			     name, w, st.active_requests, st.active_prefill_tokens,
			     st.active_blocks);
	}
	/* No attempt id twice. */
	size_t na = atomic_load(&n_all_attempts);
	if (na > MAXA)
		na = MAXA;
	qsort(all_attempts, na, sizeof(uint64_t), cmp_u64);
	for (size_t i = 1; i < na; i++)
		if (all_attempts[i] == all_attempts[i - 1])
			FAIL("%s: attempt %" PRIu64 " returned twice", name, all_attempts[i]);
	kvr_router_destroy(R);
	R = NULL;

	uint64_t r[9];
	for (int i = 0; i < 9; i++)
		r[i] = atomic_load(&n_res[i]) - res0[i];
	uint64_t issued = atomic_load(&n_issued) - issued0;
	printf("stress_queue_churn %s: %" PRIu64 " queued: %" PRIu64 " admitted in kvr_route, "
	       "%" PRIu64 "+%" PRIu64 " by on_admit (ok+failed), %" PRIu64 "+%" PRIu64
	       " by a wait, %" PRIu64 " failed in kvr_route, %" PRIu64 " cancelled, %" PRIu64
	       " dropped; %" PRIu64 " refused with their ranks gone; %zu queued when quiet "
	       "(%u looks); %zu attempts; %" PRIu64 " ms\n",
	       name, issued, r[R_ROUTE_OK], r[R_CB_OK], r[R_CB_FAIL], r[R_WAIT_OK], r[R_WAIT_FAIL],
	       r[R_ROUTE_FAIL], r[R_CANCEL], r[R_DROP], atomic_load(&n_refused_gone) - gone0,
	       depth_quiet, looks, na, now_ms() - t0);
	if (issued == 0)
		FAIL("%s: nothing queued: the round tested nothing", name);
	return 0;
}

int main(int argc, char **argv)
{
	unsigned ms = argc > 1 ? (unsigned)atoi(argv[1]) : 700;
	unsigned nf = argc > 2 ? (unsigned)atoi(argv[2]) : 3;
	uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 0) : (uint64_t)mono_ns();
	if (nf < 1 || nf > 8)
		nf = 3;
	printf("stress_queue_churn: seed %" PRIu64 "\n", seed);
	bag_init(&attempts, 1 << 16);
	bag_init(&waited, 1 << 16);
	bag_init(&to_cancel, 1 << 16);
	all_attempts = calloc(MAXA, sizeof(uint64_t));
	if (!all_attempts)
		return 1;
	round_run("fcfs", KVR_QUEUE_FCFS, true, ms, nf, seed);
	round_run("wspt", KVR_QUEUE_WSPT, true, ms, nf, seed + 1000);
	round_run("no_on_admit", KVR_QUEUE_FCFS, false, ms, nf, seed + 2000);
	printf("stress_queue_churn: %s\n", atomic_load(&failed) ? "FAIL" : "ok");
	return atomic_load(&failed) ? 1 : 0;
}
