/*
 * A replay answer with a hole the publisher may not have meant: a ROUTER past its send bound
 * (ZMQ_SNDHWM, ZeroMQ's default 1,000, which vLLM's publisher keeps) drops what it cannot queue,
 * without a word, so a long answer can skip batches or stop short of its end while the
 * publisher's buffer holds every one of them (stress_feed_rank_churn SFC_ROUTER_HWM=1).  Before,
 * such a hole was reported through on_event_gap and the rank cleared, for a loss that asking
 * again would have mended.  Now the feed asks again from the first batch missing (each ask after an
 * answer that brought something; at most FEED_REPLAY_ASKS asks per replay that brought fewer
 * than FEED_REPLAY_ASK_GAIN batches), applies
 * nothing of an answer past its hole (the rank's state follows the engine's order), and only
 * what the last ask still lacks is reported, once.
 *
 * The engine: batch i stores block S(i) and removes S(i - 2): after N batches it holds
 * S(N - 2) and S(N - 1).  A batch applied out of order, or skipped, leaves a block the engine
 * removed.  Two paths ask for a replay: a rank added after its batches went by (the resync,
 * kvr_feed_resync) and a gap in the live stream (healed through the sequence rules).  The test
 * answers the feed's replay requests itself, as a scripted replayer.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "kvrouter.h"
#include "sync/feed_encode.h"
#include "sync/feed_internal.h"
#include "tests/common/feed_pub.h"
#include "tests/common/feed_replayer.h"
#include "tests/common/mono_clock.h"

/* Long enough for an answer that a bound cuts into more than FEED_REPLAY_ASKS asks of
 * FEED_REPLAY_ASK_GAIN batches each. */
enum { N = 640 };
_Static_assert(N > (FEED_REPLAY_ASKS + 1) * FEED_REPLAY_ASK_GAIN, "N spans more asks than the cap");

static atomic_int gap_calls;
static _Atomic uint64_t gap_from, gap_to; /* the last gap reported */
static atomic_int gap_sleep_ms;           /* how long on_gap holds the feed's thread */
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t from, uint64_t to)
{
	(void)ctx, (void)worker, (void)dp;
	atomic_store(&gap_from, from);
	atomic_store(&gap_to, to);
	atomic_fetch_add(&gap_calls, 1);
	if (atomic_load(&gap_sleep_ms))
		sleep_ms(atomic_load(&gap_sleep_ms));
}

/* The feed's log since the world's replay began (log_reset): how many WARN lines, all of them
 * kept (as far as they fit), and whether an ask was logged as having timed out. */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static int log_warns;
static bool log_timed_out;
static char log_warn_text[2048];
static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx;
	pthread_mutex_lock(&log_mu);
	if (level <= KVR_LOG_WARN) {
		log_warns++;
		size_t n = strlen(log_warn_text);
		snprintf(log_warn_text + n, sizeof(log_warn_text) - n, "[%s] ", msg);
	}
	if (strstr(msg, "timed out"))
		log_timed_out = true;
	pthread_mutex_unlock(&log_mu);
}

static void log_reset(void)
{
	pthread_mutex_lock(&log_mu);
	log_warns = 0;
	log_timed_out = false;
	log_warn_text[0] = 0;
	pthread_mutex_unlock(&log_mu);
}

static uint64_t block_of(uint64_t i)
{
	return 0x5000 + i;
}

struct world {
	struct test_replayer t; /* the publisher, the replay endpoint the test answers, r, f */
	struct kvr_fenc enc[N];
};

/* A router with no rank, a feed with a replay endpoint (replay_timeout_ms), the N batches
 * encoded. */
static void open_world(struct world *w, uint32_t replay_timeout_ms)
{
	atomic_store(&gap_calls, 0);
	atomic_store(&gap_sleep_ms, 0);
	memset(w, 0, sizeof(*w));
	test_replayer_open(&w->t, on_gap, replay_timeout_ms, on_log);
	for (uint64_t i = 0; i < N; i++) {
		uint64_t s = block_of(i), old = block_of(i - 2);
		kvr_fenc_init(&w->enc[i]);
		kvr_fenc_begin(&w->enc[i], 1.0, i >= 2 ? 2 : 1);
		kvr_fenc_stored(&w->enc[i], &s, 1, NULL, TEST_BLOCK_TOKENS, test_block_tokens, &s);
		if (i >= 2)
			kvr_fenc_removed(&w->enc[i], &old, 1);
		kvr_fenc_end(&w->enc[i], 0);
	}
}

static void live(struct world *w, uint64_t seq)
{
	test_pub_send(&w->t.pub, seq, (const uint8_t *)w->enc[seq].sb.data, w->enc[seq].sb.size);
}

/* Waits until the feed took every batch before seq next. */
static void feed_at(struct world *w, uint64_t next)
{
	test_replayer_feed_at(&w->t, next);
}

static void add_rank(struct world *w)
{
	cr_assert_eq(kvr_rank_add(w->t.r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0), 0);
}

/* The resync path: all N batches go by before rank (0, 0) exists, then it is added: the feed
 * asks for seq 0 on. */
static void open_resync(struct world *w, uint32_t replay_timeout_ms)
{
	open_world(w, replay_timeout_ms);
	for (uint64_t i = 0; i < N; i++)
		live(w, i);
	feed_at(w, N);
	log_reset(); /* the batches for a rank the router lacks are logged */
	add_rank(w);
}

/* The healing path: rank (0, 0) takes batch 0, then the live stream skips to N - 1: the feed
 * asks for seq 1 on (and holds N - 1 itself). */
static void open_heal(struct world *w, uint32_t replay_timeout_ms)
{
	open_world(w, replay_timeout_ms);
	add_rank(w);
	live(w, 0);
	feed_at(w, 1);
	log_reset();
	live(w, N - 1);
}

/* The next replay request, within ms; its start in *from.  false: none came. */
static bool next_ask(struct world *w, int ms, uint64_t *from)
{
	return test_replayer_next_ask(&w->t, ms, from);
}

/* Asserts that the feed asks (again) from seq from. */
static void asked_from(struct world *w, uint64_t from)
{
	uint64_t got = UINT64_MAX;
	cr_assert(next_ask(w, 5000, &got), "expected ask %d, from seq %" PRIu64, w->t.asks + 1,
	          from);
	cr_assert_eq(got, from, "ask %d is from seq %" PRIu64 ", not %" PRIu64, w->t.asks, got,
	             from);
}

/* One message of the answer to the last ask: batch seq, or the end marker (UINT64_MAX). */
static void answer(struct world *w, uint64_t seq)
{
	if (seq == UINT64_MAX)
		test_replayer_answer(&w->t, seq, NULL, 0);
	else
		test_replayer_answer(&w->t, seq, w->enc[seq].sb.data, w->enc[seq].sb.size);
}

/* Batches from..N-1 but those in skip[0..n_skip), then the end marker if end. */
static void answer_from(struct world *w, uint64_t from, const uint64_t *skip, int n_skip, bool end)
{
	for (uint64_t q = from; q < N; q++) {
		bool skipped = false;
		for (int k = 0; k < n_skip; k++)
			skipped |= skip[k] == q;
		if (!skipped)
			answer(w, q);
	}
	if (end)
		answer(w, UINT64_MAX);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Asserts that rank (0, 0) holds what the engine does, S(N - 2) and S(N - 1), once the feed is
 * through (a stats call waits for the feed's thread, which is in the replay until it ends). */
static void rank_is_engine(struct world *w)
{
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w->t.f, w->t.id, &st), 0);
	cr_assert_eq(st.next_seq, N);
	cr_assert_eq(kvr_router_sync(w->t.r, 1000), 0);
	uint64_t got[N];
	size_t n = 0;
	cr_assert_eq(kvr_rank_blocks(w->t.r, (struct kvr_rank_id){0, 0}, got, N, &n), 0);
	qsort(got, n, sizeof(*got), cmp_u64);
	char s[256] = "";
	for (size_t i = 0; i < n && strlen(s) < 200; i++)
		snprintf(s + strlen(s), sizeof(s) - strlen(s), " S(%" PRIu64 ")", got[i] - 0x5000);
	cr_assert(n == 2 && got[0] == block_of(N - 2) && got[1] == block_of(N - 1),
	          "the engine holds S(%d) S(%d); the rank holds%s", N - 2, N - 1, s);
}

static void close_world(struct world *w)
{
	test_replayer_close(&w->t);
	for (int i = 0; i < N; i++)
		kvr_fenc_fini(&w->enc[i]);
}

/* The replays were asked again n times in all: the endpoint's stats (reasks) and the router's
 * metrics (kvr_feed_replay_reasks_total) say so. */
static void reasked(struct world *w, uint64_t n)
{
	struct kvr_feed_stats st;
	cr_assert_eq(kvr_feed_get_stats(w->t.f, w->t.id, &st), 0);
	cr_assert_eq(st.reasks, n, "reasks %" PRIu64 ", not %" PRIu64, st.reasks, n);
	static char text[1 << 16];
	size_t len;
	cr_assert_eq(kvr_metrics_render(w->t.r, text, sizeof(text), &len), 0);
	char want[64];
	snprintf(want, sizeof(want), "\nkvr_feed_replay_reasks_total %" PRIu64 "\n", n);
	cr_assert_not_null(strstr(text, want), "the metrics lack \"%s\"", want + 1);
}

/* No more asks (within 300 ms) and no gap: the rank is its engine. */
static void whole(struct world *w)
{
	uint64_t from;
	cr_assert(!next_ask(w, 300, &from), "no ask after the whole answer (one from %" PRIu64 ")",
	          from);
	rank_is_engine(w);
	cr_assert_eq(atomic_load(&gap_calls), 0, "a gap %" PRIu64 "..%" PRIu64 " reported",
	             atomic_load(&gap_from), atomic_load(&gap_to));
}

Test(feed_replay_reask, a_resync_answer_with_dropped_batches_is_asked_again, .timeout = 60)
{
	struct world w;
	open_resync(&w, 5000);
	asked_from(&w, 0);
	answer_from(&w, 0, (const uint64_t[]){5, 6, 11}, 3, true);
	asked_from(&w, 5); /* the first batch missing; what came after it was not taken */
	answer_from(&w, 5, NULL, 0, true);
	whole(&w);
	reasked(&w, 1);
	close_world(&w);
}

Test(feed_replay_reask, a_healing_answer_with_dropped_batches_is_asked_again, .timeout = 60)
{
	struct world w;
	open_heal(&w, 5000);
	asked_from(&w, 1);
	answer_from(&w, 1, (const uint64_t[]){4, 9}, 2, true);
	asked_from(&w, 4);
	answer_from(&w, 4, NULL, 0, true);
	whole(&w);
	reasked(&w, 1);
	close_world(&w);
}

/* The tail dropped, end marker and all: once the answer goes quiet (FEED_REPLAY_QUIET_MS), well
 * before replay_timeout_ms (a minute here), what is missing is asked for again. */
Test(feed_replay_reask, a_resync_answer_cut_short_without_its_end_is_asked_again, .timeout = 60)
{
	struct world w;
	open_resync(&w, 60000);
	asked_from(&w, 0);
	for (uint64_t q = 0; q < 10; q++)
		answer(&w, q);
	asked_from(&w, 10);
	answer_from(&w, 10, NULL, 0, true);
	whole(&w);
	close_world(&w);
}

/* Every batch the resync needs came, but not the end marker (the ROUTER dropped it): the feed
 * is through once the answer goes quiet, not after replay_timeout_ms (a minute here; before, the
 * feed's thread waited it out), with no gap and no second ask. */
Test(feed_replay_reask, a_whole_answer_without_its_end_holds_the_feed_no_longer_than_its_quiet,
     .timeout = 120)
{
	struct world w;
	open_resync(&w, 60000);
	asked_from(&w, 0);
	uint64_t t0 = now_ms();
	answer_from(&w, 0, NULL, 0, false);
	struct kvr_feed_stats st; /* returns once the feed's thread is out of the replay */
	cr_assert_eq(kvr_feed_get_stats(w.t.f, w.t.id, &st), 0);
	uint64_t ms = now_ms() - t0;
	cr_assert_lt(ms, 5000, "the feed's thread waited %" PRIu64 " ms for the end marker", ms);
	whole(&w);
	close_world(&w);
}

Test(feed_replay_reask, a_healing_answer_ending_short_is_asked_again, .timeout = 60)
{
	struct world w;
	open_heal(&w, 5000);
	asked_from(&w, 1);
	for (uint64_t q = 1; q < 7; q++)
		answer(&w, q);
	answer(&w, UINT64_MAX);
	asked_from(&w, 7);
	answer_from(&w, 7, NULL, 0, true);
	whole(&w);
	close_world(&w);
}

/* A replayer behind a ROUTER whose send bound is FEED_REPLAY_ASK_GAIN batches: each answer
 * brings that many and then nothing, end marker and all, so the replay takes more than
 * FEED_REPLAY_ASKS asks; every ask brought a bound's worth, so none counts toward the cap and
 * the rank is rebuilt whole.  Before, the eighth ask was the last and the rest a gap (in CI,
 * stress_feed_rank_churn_router_hwm: 10,563 batches behind ZeroMQ's default bound, 1,000,
 * gap 9000..10561). */
static void cut_at_a_bound(struct world *w, uint64_t start)
{
	int asks = 0;
	for (uint64_t from = start;; from += FEED_REPLAY_ASK_GAIN) {
		asked_from(w, from);
		asks++;
		if (from + FEED_REPLAY_ASK_GAIN >= N) {
			answer_from(w, from, NULL, 0, true);
			break;
		}
		for (uint64_t q = from; q < from + FEED_REPLAY_ASK_GAIN; q++)
			answer(w, q);
	}
	cr_assert_gt(asks, FEED_REPLAY_ASKS);
	whole(w);
	reasked(w, (uint64_t)asks - 1);
}

Test(feed_replay_reask, a_long_resync_answer_cut_at_a_bound_is_asked_until_whole, .timeout = 60)
{
	struct world w;
	open_resync(&w, 60000);
	cut_at_a_bound(&w, 0);
	close_world(&w);
}

Test(feed_replay_reask, a_long_healing_answer_cut_at_a_bound_is_asked_until_whole, .timeout = 60)
{
	struct world w;
	open_heal(&w, 60000);
	cut_at_a_bound(&w, 1);
	close_world(&w);
}

/* A replayer that drops the second batch of every answer: each ask brings one batch more, and
 * the feed stops after FEED_REPLAY_ASKS asks; the last answer's hole is reported once, as a gap
 * always was (the rank cleared, what follows the hole applied), and nothing is asked after. */
static void keeps_dropping(struct world *w, uint64_t start)
{
	for (int k = 0; k < FEED_REPLAY_ASKS; k++) {
		asked_from(w, start + (uint64_t)k);
		answer_from(w, start + (uint64_t)k, (const uint64_t[]){start + (uint64_t)k + 1}, 1,
		            true);
	}
	uint64_t from;
	cr_assert(!next_ask(w, 500, &from), "no ask %d (one from %" PRIu64 ")",
	          FEED_REPLAY_ASKS + 1, from);
	rank_is_engine(w);
	cr_assert_eq(atomic_load(&gap_calls), 1, "the hole left is reported once");
	cr_assert_eq(atomic_load(&gap_from), start + FEED_REPLAY_ASKS);
	cr_assert_eq(atomic_load(&gap_to), start + FEED_REPLAY_ASKS + 1);
	reasked(w, FEED_REPLAY_ASKS - 1);
}

Test(feed_replay_reask, a_resync_replayer_that_keeps_dropping_is_asked_a_bounded_number_of_times,
     .timeout = 60)
{
	struct world w;
	open_resync(&w, 5000);
	keeps_dropping(&w, 0);
	close_world(&w);
}

Test(feed_replay_reask, a_healing_replayer_that_keeps_dropping_is_asked_a_bounded_number_of_times,
     .timeout = 60)
{
	struct world w;
	open_heal(&w, 5000);
	keeps_dropping(&w, 1);
	close_world(&w);
}

/* A replayer that has nothing more when asked again: one more ask, then the gap, once. */
Test(feed_replay_reask, an_answer_short_of_what_the_publisher_has_left_is_reported_once,
     .timeout = 60)
{
	struct world w;
	open_resync(&w, 5000);
	asked_from(&w, 0);
	answer_from(&w, 0, (const uint64_t[]){7, 8}, 2, true);
	asked_from(&w, 7);
	answer(&w, 9); /* the publisher's buffer now starts at 9: a real gap */
	answer_from(&w, 10, NULL, 0, true);
	uint64_t from;
	cr_assert(!next_ask(&w, 300, &from), "no third ask (one from %" PRIu64 ")", from);
	rank_is_engine(&w);
	cr_assert_eq(atomic_load(&gap_calls), 1);
	cr_assert_eq(atomic_load(&gap_from), 7);
	cr_assert_eq(atomic_load(&gap_to), 9);
	close_world(&w);
}

/* The answer's quiet is the publisher's, not the feed's own time: an answer whose every batch
 * already waits on the DEALER while the feed's thread is held (here on_event_gap, for the real
 * gap at the answer's start, takes 250 ms; a descheduled thread or a large batch alike) is read
 * to its end, not cut and asked for again.  Before, the quiet rule looked at the time since the
 * last batch was received, whatever the socket held: the answer was dropped (the DEALER closed)
 * and asked for again - a publisher whose buffer moved on meanwhile, or that does not answer as
 * here, then had a second gap reported and the rank cleared, for batches the feed had in hand. */
static void slow_feed_whole_answer(struct world *w, uint64_t asked, uint64_t gap_from_seq)
{
	atomic_store(&gap_sleep_ms, 250);
	asked_from(w, asked);
	answer_from(w, 3, NULL, 0, true); /* the buffer begins at 3: a real gap, reported */
	uint64_t from;
	cr_assert(!next_ask(w, 1000, &from),
	          "no second ask: the whole answer was waiting (one from %" PRIu64 ")", from);
	rank_is_engine(w);
	cr_assert_eq(atomic_load(&gap_calls), 1,
	             "one gap, not %d (the last %" PRIu64 "..%" PRIu64 ")", atomic_load(&gap_calls),
	             atomic_load(&gap_from), atomic_load(&gap_to));
	cr_assert_eq(atomic_load(&gap_from), gap_from_seq);
	cr_assert_eq(atomic_load(&gap_to), 3);
}

Test(feed_replay_reask, a_resync_answer_waiting_while_the_feed_is_slow_is_not_asked_again,
     .timeout = 60)
{
	struct world w;
	open_resync(&w, 2000);
	slow_feed_whole_answer(&w, 0, 0);
	close_world(&w);
}

Test(feed_replay_reask, a_healing_answer_waiting_while_the_feed_is_slow_is_not_asked_again,
     .timeout = 60)
{
	struct world w;
	open_heal(&w, 2000);
	slow_feed_whole_answer(&w, 1, 1);
	close_world(&w);
}

/* An ask that times out after bringing something is asked again; when the next ask brings the
 * rest, nothing was lost and nothing is logged as a warning (the ask's timeout is told at INFO).
 * Before, every ask that timed out logged "replay from X failed or timed out" at WARN, though
 * the next one healed it.  The answer trickles in (a batch every 20 ms, well inside
 * FEED_REPLAY_QUIET_MS) so that it times out (replay_timeout_ms 300) rather than go quiet. */
static void timed_out_then_whole(struct world *w, uint64_t start)
{
	asked_from(w, start);
	uint64_t q = start, from;
	for (;;) { /* (next_ask forgets the asker when none comes) */
		zmq_pollitem_t it = {.socket = w->t.router, .events = ZMQ_POLLIN};
		cr_assert_geq(zmq_poll(&it, 1, 20), 0);
		if (it.revents & ZMQ_POLLIN)
			break;
		cr_assert_lt(q, N, "no second ask after the first answer timed out");
		answer(w, q++);
	}
	cr_assert(next_ask(w, 1000, &from));
	cr_assert_gt(from, start, "the second ask is from the first batch missing");
	answer_from(w, from, NULL, 0, true);
	whole(w);
	pthread_mutex_lock(&log_mu);
	bool timed_out = log_timed_out;
	int warns = log_warns;
	pthread_mutex_unlock(&log_mu);
	cr_assert(timed_out, "the first ask timed out (and it is logged)");
	cr_assert_eq(warns, 0, "nothing lost, yet %d warnings: %s", warns, log_warn_text);
	reasked(w, 1);
}

Test(feed_replay_reask, a_resync_ask_timed_out_then_healed_logs_no_warning, .timeout = 60)
{
	struct world w;
	open_resync(&w, 300);
	timed_out_then_whole(&w, 0);
	close_world(&w);
}

Test(feed_replay_reask, a_healing_ask_timed_out_then_healed_logs_no_warning, .timeout = 60)
{
	struct world w;
	open_heal(&w, 300);
	timed_out_then_whole(&w, 1);
	close_world(&w);
}

/* A replay given up (the replayer never answers) is still a warning, naming the replay. */
static void never_answered(struct world *w, uint64_t start)
{
	asked_from(w, start);
	uint64_t from;
	cr_assert(!next_ask(w, 1000, &from),
	          "no second ask after an empty answer (one from %" PRIu64 ")", from);
	struct kvr_feed_stats st; /* the feed's thread is through with the replay */
	cr_assert_eq(kvr_feed_get_stats(w->t.f, w->t.id, &st), 0);
	cr_assert_eq(atomic_load(&gap_calls), 1, "the gap is reported");
	char want[64];
	snprintf(want, sizeof(want), "replay from %" PRIu64, start);
	pthread_mutex_lock(&log_mu);
	bool warned = strstr(log_warn_text, want) != NULL;
	pthread_mutex_unlock(&log_mu);
	cr_assert(warned, "a WARN names the replay given up; the warnings: %s", log_warn_text);
	reasked(w, 0); /* an ask that brought nothing is not asked again */
}

Test(feed_replay_reask, a_resync_replay_given_up_logs_a_warning, .timeout = 60)
{
	struct world w;
	open_resync(&w, 300);
	never_answered(&w, 0);
	close_world(&w);
}

Test(feed_replay_reask, a_healing_replay_given_up_logs_a_warning, .timeout = 60)
{
	struct world w;
	open_heal(&w, 300);
	never_answered(&w, 1);
	close_world(&w);
}
