/*
 * tests/feed/test_feed.c - the KV event feed against a real publisher: tests/feed/
 * vllm_publisher.py (python3-zmq + python3-msgpack) puts on the wire what vLLM's
 * ZmqEventPublisher does, over tcp://127.0.0.1:<free port> and ipc://.  This program drives it,
 * keeps its own model of each engine's cache (hash -> copies), and after every scenario checks
 * that the router's index (kvr_rank_blocks) equals the model's blocks.
 *
 * Scenarios: both event forms; hashes >= 2^63 and bin digests; duplicate copies and one
 * removal per copy; AllBlocksCleared; CPU-medium blocks kept apart; block size mismatch refused
 * and logged; a gap healed by replay; a gap without replay (reported, rank cleared); a
 * publisher restart; a router (feed) started after the publisher; garbage messages between
 * good ones; dp rank taken from the batch; a replay shorter than the gap; a replay that never
 * answers.
 * Plain program: exit 0 pass, 1 fail, 77 skip (no python3 with zmq and msgpack).
 * usage: test_feed PYTHON PUBLISHER_SCRIPT
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvrouter.h"
#include "tests/common/check.h"
#include "shards/u64map.h"
#include "tests/common/mono_clock.h"

#define BS 16

/* ---------------------------------------------------------------- the publisher process */

struct pubproc {
	pid_t pid;
	FILE *in, *out;
};

static int pub_spawn(struct pubproc *p, const char *python, const char *script)
{
	int to[2], from[2];
	if (pipe(to) || pipe(from))
		return -1;
	p->pid = fork();
	if (p->pid < 0)
		return -1;
	if (p->pid == 0) {
		dup2(to[0], 0);
		dup2(from[1], 1);
		close(to[1]);
		close(from[0]);
		execl(python, python, script, (char *)NULL);
		_exit(127);
	}
	close(to[0]);
	close(from[1]);
	p->in = fdopen(to[1], "w");
	p->out = fdopen(from[0], "r");
	return p->in && p->out ? 0 : -1;
}

static void pub_exit(struct pubproc *p)
{
	fprintf(p->in, "{\"op\":\"exit\"}\n");
	fflush(p->in);
	fclose(p->in);
	fclose(p->out);
	int st;
	waitpid(p->pid, &st, 0);
}

/* Sends one JSON command; returns the reply line (static buffer). */
static char reply[1 << 16];
static const char *pub_cmd(struct pubproc *p, const char *json)
{
	fprintf(p->in, "%s\n", json);
	fflush(p->in);
	if (!fgets(reply, sizeof(reply), p->out)) {
		fprintf(stderr, "publisher died on: %.200s\n", json);
		exit(1);
	}
	return reply;
}

/* A growable string for building commands. */
struct sb {
	char *s;
	size_t len, cap;
};

static void sbf(struct sb *b, const char *fmt, ...)
{
	va_list ap;
	for (;;) {
		va_start(ap, fmt);
		int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
		va_end(ap);
		if (b->s && b->len + (size_t)n < b->cap) {
			b->len += (size_t)n;
			return;
		}
		b->cap = (b->cap + (size_t)n + 1) * 2;
		b->s = realloc(b->s, b->cap);
		if (!b->s)
			abort();
	}
}

static uint64_t json_u64(const char *s, const char *key)
{
	char pat[64];
	snprintf(pat, sizeof(pat), "\"%s\": ", key);
	const char *p = strstr(s, pat);
	return p ? strtoull(p + strlen(pat), NULL, 10) : UINT64_MAX;
}

static void json_str(const char *s, const char *key, char *out, size_t cap)
{
	char pat[64];
	snprintf(pat, sizeof(pat), "\"%s\": \"", key);
	const char *p = strstr(s, pat);
	out[0] = 0;
	if (!p)
		return;
	p += strlen(pat);
	size_t n = strcspn(p, "\"");
	if (n >= cap)
		n = cap - 1;
	memcpy(out, p, n);
	out[n] = 0;
}

/* ---------------------------------------------------------------- the engine model */

struct engine {
	struct kvr_u64map gpu; /* hash -> copies */
	uint64_t cpu;          /* CPU-medium copies held */
};

static void model_store(struct engine *m, const uint64_t *h, size_t n)
{
	kvr_u64map_reserve(&m->gpu, n);
	for (size_t i = 0; i < n; i++) {
		uint32_t *c = kvr_u64map_find(&m->gpu, h[i]);
		if (c)
			++*c;
		else
			kvr_u64map_insert(&m->gpu, h[i], 1);
	}
}

static void model_remove(struct engine *m, const uint64_t *h, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t *c = kvr_u64map_find(&m->gpu, h[i]);
		if (c && *c > 1)
			--*c;
		else if (c)
			kvr_u64map_remove(&m->gpu, h[i]);
	}
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static struct kvr_router *R;
static struct kvr_feed *F;

/* The router's index for the rank equals the model's GPU blocks. */
static void check_equal(struct kvr_rank_id rank, const struct engine *m, const char *what)
{
	uint64_t got[4096], want[4096];
	size_t n = 0, w = 0;
	int rc = kvr_rank_blocks(R, rank, got, 4096, &n);
	CHECK(rc == 0, "%s: kvr_rank_blocks %d", what, rc);
	for (size_t i = 0; i < m->gpu.cap; i++)
		if (m->gpu.slots[i].val != KVR_U64MAP_EMPTY)
			want[w++] = m->gpu.slots[i].key;
	qsort(got, n, sizeof(*got), cmp_u64);
	qsort(want, w, sizeof(*want), cmp_u64);
	CHECK(n == w && memcmp(got, want, n * sizeof(*got)) == 0,
	      "%s: index holds %zu blocks, the engine %zu", what, n, w);
	if (n != w || memcmp(got, want, n * sizeof(*got))) {
		for (size_t i = 0; i < n || i < w; i++)
			fprintf(stderr, "  %zu: index %016" PRIx64 "  engine %016" PRIx64 "\n", i,
			        i < n ? got[i] : 0, i < w ? want[i] : 0);
	}
}

/* Waits until the endpoint has consumed batch seq (next_seq > seq). */
static void wait_seq(uint32_t id, uint64_t seq, const char *what)
{
	uint64_t end = now_ms() + 10000;
	struct kvr_feed_stats st;
	do {
		if (kvr_feed_get_stats(F, id, &st) == 0 && st.next_seq > seq)
			return;
		usleep(1000);
	} while (now_ms() < end);
	CHECK(0, "%s: feed stuck at next_seq %" PRIu64 ", want > %" PRIu64, what, st.next_seq, seq);
}

static struct kvr_feed_stats stats(uint32_t id)
{
	struct kvr_feed_stats st = {0};
	CHECK(kvr_feed_get_stats(F, id, &st) == 0, "stats");
	return st;
}

/* ---------------------------------------------------------------- building events */

static void tokens_for(struct sb *b, const uint64_t *h, size_t n)
{
	sbf(b, "[");
	for (size_t i = 0; i < n; i++)
		for (int j = 0; j < BS; j++) {
			uint64_t x =
			    (h[i] ^ (uint64_t)j * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
			sbf(b, "%s%u", i || j ? "," : "", (unsigned)(x >> 44));
		}
	sbf(b, "]");
}

static void hashes_json(struct sb *b, const uint64_t *h, size_t n)
{
	sbf(b, "[");
	for (size_t i = 0; i < n; i++)
		sbf(b, "%s%" PRIu64, i ? "," : "", h[i]);
	sbf(b, "]");
}

/* Appends a stored event (comma handled by the caller through *first). */
static void ev_stored(struct sb *b, bool *first, const uint64_t *h, size_t n,
                      const uint64_t *parent, const char *extra)
{
	sbf(b, "%s{\"t\":\"stored\",\"hashes\":", *first ? "" : ",");
	hashes_json(b, h, n);
	if (parent)
		sbf(b, ",\"parent\":%" PRIu64, *parent);
	sbf(b, ",\"bs\":%d,\"tokens\":", BS);
	tokens_for(b, h, n);
	sbf(b, "%s}", extra ? extra : "");
	*first = false;
}

static void ev_removed(struct sb *b, bool *first, const uint64_t *h, size_t n, const char *extra)
{
	sbf(b, "%s{\"t\":\"removed\",\"hashes\":", *first ? "" : ",");
	hashes_json(b, h, n);
	sbf(b, "%s}", extra ? extra : "");
	*first = false;
}

/* Publishes the events in ev (a JSON array body); returns the seq. */
static uint64_t publish(struct pubproc *p, const char *form, uint32_t dp, bool drop, const char *ev)
{
	struct sb b = {0};
	sbf(&b, "{\"op\":\"publish\",\"form\":\"%s\",\"dp\":%u,\"drop\":%s,\"events\":[%s]}", form,
	    dp, drop ? "true" : "false", ev);
	uint64_t seq = json_u64(pub_cmd(p, b.s), "seq");
	free(b.s);
	return seq;
}

/* Starts the publisher on endpoint (replay endpoint optional); returns the bound endpoints. */
static void start(struct pubproc *p, const char *endpoint, const char *replay, char *ep_out,
                  char *rep_out)
{
	char cmd[512];
	snprintf(cmd, sizeof(cmd), "{\"op\":\"start\",\"endpoint\":\"%s\"%s%s%s,\"topic\":\"kv\"}",
	         endpoint, replay ? ",\"replay\":\"" : "", replay ? replay : "",
	         replay ? "\"" : "");
	const char *r = pub_cmd(p, cmd);
	json_str(r, "endpoint", ep_out, 256);
	if (rep_out)
		json_str(r, "replay", rep_out, 256);
}

static void wait_sub(struct pubproc *p)
{
	const char *r = pub_cmd(p, "{\"op\":\"wait_sub\",\"timeout_ms\":5000}");
	CHECK(strstr(r, "true") != NULL, "subscriber never connected");
}

/* ---------------------------------------------------------------- callbacks */

static int gaps_reported;
static uint64_t gap_expected, gap_got;
static void on_gap(void *ctx, uint64_t worker, uint32_t dp, uint64_t expected, uint64_t got)
{
	(void)ctx;
	(void)worker;
	(void)dp;
	__atomic_add_fetch(&gaps_reported, 1, __ATOMIC_RELAXED);
	gap_expected = expected;
	gap_got = got;
}

static int logs_block_size;
static void on_log(void *ctx, int level, const char *msg)
{
	(void)ctx;
	(void)level;
	if (strstr(msg, "block_size"))
		__atomic_add_fetch(&logs_block_size, 1, __ATOMIC_RELAXED);
	if (getenv("FEED_TEST_VERBOSE"))
		fprintf(stderr, "log: %s\n", msg);
}

static uint32_t add_ep(const char *ep, const char *replay, uint64_t worker, uint32_t dp)
{
	struct kvr_feed_endpoint e = {.endpoint = ep,
	                              .topic = "kv",
	                              .replay_endpoint = replay,
	                              .worker_id = worker,
	                              .dp_rank = dp};
	uint32_t id = 0;
	int rc = kvr_feed_add(F, &e, &id);
	CHECK(rc == 0, "kvr_feed_add %s: %d", ep, rc);
	return id;
}

/* A chain of n hashes from base (>= 2^63 when base is). */
static void chain(uint64_t *h, size_t n, uint64_t base)
{
	for (size_t i = 0; i < n; i++)
		h[i] = base + i * 0x1000003ull;
}

/* ---------------------------------------------------------------- scenarios */

/* Both forms, big hashes, copies, CPU medium, AllBlocksCleared, block size refusal, lora. */
static void scenario_forms(struct pubproc *p, const char *bind, const char *form, uint64_t worker)
{
	char ep[256], rep[256];
	struct kvr_rank_id rank = {worker, 0};
	struct engine m = {0};
	kvr_u64map_init(&m.gpu);
	start(p, bind, NULL, ep, rep);
	uint32_t id = add_ep(ep, NULL, worker, 0);
	wait_sub(p);
	uint64_t a[8], b2[4], c[4];
	chain(a, 8, 0x8000000000000000ull + worker * 0x100000000ull);
	chain(b2, 4, 0xF000000000000000ull + worker * 0x100000000ull);
	chain(c, 4, 0x1000 + worker * 0x100000000ull);
	struct sb e = {0};
	bool first = true;
	/* a[0..4) root chain, then a[4..8) below a[3], in one batch */
	ev_stored(&e, &first, a, 4, NULL, NULL);
	ev_stored(&e, &first, a + 4, 4, &a[3], NULL);
	/* a second physical copy of a[2..4) */
	ev_stored(&e, &first, a + 2, 2, &a[1], NULL);
	uint64_t s = publish(p, form, 0, false, e.s);
	model_store(&m, a, 8);
	model_store(&m, a + 2, 2);
	wait_seq(id, s, form);
	check_equal(rank, &m, "stored with a second copy");
	/* one removal per copy: the first leaves the blocks indexed */
	e.len = 0;
	first = true;
	ev_removed(&e, &first, a + 2, 2, NULL);
	ev_removed(&e, &first, a + 6, 2, NULL);
	s = publish(p, form, 0, false, e.s);
	model_remove(&m, a + 2, 2);
	model_remove(&m, a + 6, 2);
	wait_seq(id, s, form);
	check_equal(rank, &m, "first copy removed");
	e.len = 0;
	first = true;
	ev_removed(&e, &first, a + 2, 2, NULL);
	s = publish(p, form, 0, false, e.s);
	model_remove(&m, a + 2, 2);
	wait_seq(id, s, form);
	check_equal(rank, &m, "last copy removed");
	/* CPU medium: kept apart; wrong block size: refused and logged; lora: indexed */
	int logs0 = __atomic_load_n(&logs_block_size, __ATOMIC_RELAXED);
	struct kvr_feed_stats st0 = stats(id);
	e.len = 0;
	first = true;
	ev_stored(&e, &first, c, 4, NULL, ",\"medium\":\"CPU\"");
	sbf(&e, ",{\"t\":\"stored\",\"hashes\":[77],\"bs\":32,\"tokens\":[");
	for (int i = 0; i < 32; i++)
		sbf(&e, "%s%d", i ? "," : "", i);
	sbf(&e, "]}");
	ev_stored(&e, &first, b2, 4, NULL, ",\"lora_name\":\"adapter-x\"");
	s = publish(p, form, 0, false, e.s);
	model_store(&m, b2, 4);
	wait_seq(id, s, form);
	check_equal(rank, &m, "cpu medium, refused block size, lora");
	struct kvr_feed_stats st = stats(id);
	CHECK(st.other_medium_blocks == 4, "other medium %" PRIu64, st.other_medium_blocks);
	uint64_t cpu[8];
	size_t ncpu = 0;
	CHECK(kvr_feed_other_medium_blocks(F, id, 0, cpu, 2, &ncpu) == KVR_ERANGE && ncpu == 4,
	      "other medium list: %zu", ncpu);
	CHECK(kvr_feed_other_medium_blocks(F, id, 0, cpu, 8, &ncpu) == 0 && ncpu == 4, "list");
	qsort(cpu, ncpu, sizeof(*cpu), cmp_u64);
	CHECK(ncpu == 4 && !memcmp(cpu, c, sizeof(c)), "other medium hashes differ");
	/* CPU removals touch only the other medium */
	e.len = 0;
	first = true;
	ev_removed(&e, &first, c, 2, ",\"medium\":\"CPU\"");
	s = publish(p, form, 0, false, e.s);
	wait_seq(id, s, form);
	check_equal(rank, &m, "cpu medium removal");
	CHECK(kvr_feed_other_medium_blocks(F, id, 0, cpu, 8, &ncpu) == 0 && ncpu == 2 &&
	          (cpu[0] == c[2] || cpu[0] == c[3]),
	      "after CPU removal: %zu", ncpu);
	CHECK(st.refused == st0.refused + 1, "refused %" PRIu64, st.refused);
	CHECK(__atomic_load_n(&logs_block_size, __ATOMIC_RELAXED) > logs0, "no block_size log");
	/* the lora blocks match a prompt with the adapter's name, not one without */
	uint32_t tok[4 * BS];
	for (int i = 0; i < 4; i++)
		for (int j = 0; j < BS; j++) {
			uint64_t x =
			    (b2[i] ^ (uint64_t)j * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
			tok[i * BS + j] = (uint32_t)(x >> 44);
		}
	struct kvr_request rq;
	kvr_request_init(&rq);
	rq.tokens = tok;
	rq.n_tokens = 4 * BS;
	rq.flags = KVR_ROUTE_QUERY_ONLY;
	rq.pinned = &rank;
	struct kvr_decision d;
	rq.lora_name = "adapter-x";
	CHECK(kvr_route(R, &rq, &d) == 0 && d.overlap_blocks == 4, "lora overlap %u",
	      d.overlap_blocks);
	rq.lora_name = NULL;
	CHECK(kvr_route(R, &rq, &d) == 0 && d.overlap_blocks == 0, "base overlap %u",
	      d.overlap_blocks);
	/* AllBlocksCleared of this rank; then a fresh root chain in the oldest legacy form */
	e.len = 0;
	first = true;
	sbf(&e, "{\"t\":\"cleared\"},{\"t\":\"other\"}");
	first = false;
	ev_stored(&e, &first, c, 2, NULL, ",\"legacy_short\":true");
	s = publish(p, form, 0, false, e.s);
	kvr_u64map_clear(&m.gpu);
	model_store(&m, c, 2);
	wait_seq(id, s, form);
	check_equal(rank, &m, "cleared then stored");
	st = stats(id);
	CHECK(st.unknown_events == 1, "unknown events %" PRIu64, st.unknown_events);
	CHECK(st.gaps == 0 && st.malformed == 0, "gaps %" PRIu64 " malformed %" PRIu64, st.gaps,
	      st.malformed);
	/* a batch whose ts is not wall-clock seconds (a monotonic clock's 12,345 s): no lag of
	 * 54 years (before, last_lag_ns read ~1.7e18) */
	char cmd[160];
	snprintf(cmd, sizeof(cmd),
	         "{\"op\":\"publish\",\"form\":\"%s\",\"dp\":0,\"drop\":false,\"events\":[],"
	         "\"ts\":12345.5}",
	         form);
	s = json_u64(pub_cmd(p, cmd), "seq");
	wait_seq(id, s, "ts not wall clock");
	st = stats(id);
	CHECK(st.last_lag_ns < 86400ull * 1000000000ull, "last_lag_ns %" PRIu64, st.last_lag_ns);
	CHECK(kvr_feed_remove(F, id) == 0, "remove");
	pub_cmd(p, "{\"op\":\"stop\"}");
	free(e.s);
	kvr_u64map_fini(&m.gpu);
}

/* A scenario's publisher (started, with a replay endpoint or not), the feed's endpoint for it,
 * the model of its engine and an event buffer. */
struct scen {
	char ep[256], rep[256];
	struct engine m;
	uint32_t id;
	struct sb e;
};

static void scen_begin(struct pubproc *p, struct scen *s, uint64_t worker, uint32_t dp,
                       bool with_replay)
{
	*s = (struct scen){0};
	kvr_u64map_init(&s->m.gpu);
	start(p, "tcp://127.0.0.1:*", with_replay ? "tcp://127.0.0.1:*" : NULL, s->ep, s->rep);
	s->id = add_ep(s->ep, with_replay ? s->rep : NULL, worker, dp);
	wait_sub(p);
}

static void scen_end(struct pubproc *p, struct scen *s)
{
	CHECK(kvr_feed_remove(F, s->id) == 0, "remove");
	pub_cmd(p, "{\"op\":\"stop\"}");
	free(s->e.s);
	kvr_u64map_fini(&s->m.gpu);
}

/* Publishes one batch of one event: stored (n blocks of h under parent) or removed; returns
 * its seq. */
static uint64_t pub_one(struct pubproc *p, struct scen *s, bool stored, const uint64_t *h, size_t n,
                        const uint64_t *parent, uint32_t dp, bool drop)
{
	bool first = true;
	s->e.len = 0;
	if (stored)
		ev_stored(&s->e, &first, h, n, parent, NULL);
	else
		ev_removed(&s->e, &first, h, n, NULL);
	return publish(p, "map", dp, drop, s->e.s);
}

/* Exactly one gap [expected, got) reported through on_event_gap since the count was gaps0. */
static void check_gap(int gaps0, uint64_t expected, uint64_t got)
{
	CHECK(__atomic_load_n(&gaps_reported, __ATOMIC_RELAXED) == gaps0 + 1 &&
	          gap_expected == expected && gap_got == got,
	      "gap callbacks %d (want %d), expected %" PRIu64 " got %" PRIu64, gaps_reported,
	      gaps0 + 1, gap_expected, gap_got);
}

/* Gaps: healed by replay; without replay (reported, cleared); a publisher restart; garbage. */
static void scenario_gaps(struct pubproc *p, uint64_t worker, bool with_replay)
{
	struct scen sc;
	struct kvr_rank_id rank = {worker, 0};
	scen_begin(p, &sc, worker, 0, with_replay);
	struct engine m = sc.m;
	uint32_t id = sc.id;
	const char *ep = sc.ep, *rep = sc.rep;
	uint64_t a[12], b[4];
	chain(a, 12, 0xA000000000000000ull + worker * 0x100000000ull);
	chain(b, 4, 0xB000000000000000ull + worker * 0x100000000ull);
	struct sb e = {0};
	bool first = true;
	ev_stored(&e, &first, a, 4, NULL, NULL);
	uint64_t s = publish(p, "map", 0, false, e.s);
	model_store(&m, a, 4);
	wait_seq(id, s, "gaps: first");
	/* batches s+1 (a[4..8)) and s+2 (removal of a[0]... no: a[7]) are lost on the wire */
	e.len = 0;
	first = true;
	ev_stored(&e, &first, a + 4, 4, &a[3], NULL);
	publish(p, "array", 0, true, e.s);
	e.len = 0;
	first = true;
	ev_removed(&e, &first, a + 7, 1, NULL);
	publish(p, "map", 0, true, e.s);
	int gaps0 = __atomic_load_n(&gaps_reported, __ATOMIC_RELAXED);
	/* garbage between good messages: one frame, a short seq, a bad payload, 4 frames, the
	 * end mark's seq */
	pub_cmd(p, "{\"op\":\"raw\",\"frames\":[\"6b76\"]}");
	pub_cmd(p, "{\"op\":\"raw\",\"frames\":[\"6b76\",\"0001\",\"90\"]}");
	pub_cmd(p, "{\"op\":\"raw\",\"frames\":[\"6b76\",\"0000000000000000\",\"c1c1\",\"00\"]}");
	/* a good (empty) batch at seq 2^64 - 1, the replay's end mark: its next seq wrapped to 0 */
	pub_cmd(p, "{\"op\":\"raw\",\"frames\":[\"6b76\",\"ffffffffffffffff\","
	           "\"92cb000000000000000090\"]}");
	/* the next good batch: a[8..12) below a[6] (held only if the lost batch is replayed),
	 * b as a new root */
	e.len = 0;
	first = true;
	ev_stored(&e, &first, b, 4, NULL, NULL);
	ev_stored(&e, &first, a + 8, 4, &a[6], NULL);
	s = publish(p, "map", 0, false, e.s);
	wait_seq(id, s, "gaps: after the gap");
	struct kvr_feed_stats st = stats(id);
	if (with_replay) {
		model_store(&m, a + 4, 4);
		model_remove(&m, a + 7, 1);
		model_store(&m, b, 4);
		model_store(&m, a + 8, 4);
		CHECK(st.replays >= 1 && st.replayed_batches >= 2,
		      "replays %" PRIu64 " batches %" PRIu64, st.replays, st.replayed_batches);
		CHECK(st.gaps == 0, "gaps %" PRIu64, st.gaps);
		CHECK(__atomic_load_n(&gaps_reported, __ATOMIC_RELAXED) == gaps0, "gap reported");
		check_equal(rank, &m, "gap healed by replay");
	} else {
		/* reported, cleared; then the batch applied: b is a root, a[8..12)'s parent is
		 * gone, so the index refuses them (the engine's cache is what it is: the router
		 * knows only b) */
		kvr_u64map_clear(&m.gpu);
		model_store(&m, b, 4);
		CHECK(st.gaps == 1, "gaps %" PRIu64, st.gaps);
		check_gap(gaps0, 1, 3);
		check_equal(rank, &m, "gap without replay");
		/* the model of the engine itself goes on: it does hold a[..] */
	}
	CHECK(st.malformed == 4, "malformed %" PRIu64, st.malformed);
	/* the 4-frame message had seq 0: it is counted malformed before any seq rule applies */
	CHECK(st.restarts == 0, "restarts %" PRIu64, st.restarts);
	/* publisher restart on the same endpoints: seq from 0, an empty engine */
	pub_cmd(p, "{\"op\":\"stop\"}");
	char cmd[600];
	snprintf(cmd, sizeof(cmd), "{\"op\":\"start\",\"endpoint\":\"%s\"%s%s%s,\"topic\":\"kv\"}",
	         ep, with_replay ? ",\"replay\":\"" : "", with_replay ? rep : "",
	         with_replay ? "\"" : "");
	pub_cmd(p, cmd);
	wait_sub(p);
	e.len = 0;
	first = true;
	ev_stored(&e, &first, a, 2, NULL, NULL);
	s = publish(p, "array", 0, false, e.s);
	CHECK(s == 0, "restarted seq %" PRIu64, s);
	kvr_u64map_clear(&m.gpu);
	model_store(&m, a, 2);
	uint64_t end = now_ms() + 10000;
	do {
		st = stats(id);
		usleep(1000);
	} while (st.restarts == 0 && now_ms() < end);
	wait_seq(id, s, "restart");
	st = stats(id);
	CHECK(st.restarts == 1, "restarts %" PRIu64, st.restarts);
	check_equal(rank, &m, "publisher restart");
	free(e.s);
	sc.m = m;
	scen_end(p, &sc);
}

/* The publisher runs (and publishes) before the feed subscribes; replay brings the router up
 * to date.  Also: the dp rank taken from the batch, and bin (sha256-sized) hashes. */
static void scenario_late(struct pubproc *p, uint64_t worker)
{
	char ep[256], rep[256];
	struct kvr_rank_id rank = {worker, 2};
	struct engine m = {0};
	kvr_u64map_init(&m.gpu);
	char ipc[128], ipcr[128];
	snprintf(ipc, sizeof(ipc), "ipc:///tmp/kvr-test-feed-%d.ipc", (int)getpid());
	snprintf(ipcr, sizeof(ipcr), "ipc:///tmp/kvr-test-feed-%d-replay.ipc", (int)getpid());
	start(p, ipc, ipcr, ep, rep);
	uint64_t a[6];
	chain(a, 6, 0xC000000000000000ull + worker * 0x100000000ull);
	struct sb e = {0};
	bool first = true;
	for (int i = 0; i < 6; i++) {
		e.len = 0;
		first = true;
		ev_stored(&e, &first, a + i, 1, i ? &a[i - 1] : NULL, NULL);
		publish(p, i & 1 ? "array" : "map", 2, false, e.s); /* nobody listens */
		model_store(&m, a + i, 1);
	}
	uint32_t id = add_ep(ep, rep, worker, KVR_FEED_DP_FROM_BATCH);
	wait_sub(p);
	/* bin digests: the router folds them to their last 8 bytes big-endian */
	uint64_t d[2];
	e.len = 0;
	sbf(&e, "{\"t\":\"stored\",\"hashes\":[");
	for (int k = 0; k < 2; k++) {
		sbf(&e, "%s\"", k ? "," : "");
		d[k] = 0;
		for (int i = 0; i < 32; i++) {
			unsigned byte = (unsigned)((i * 37 + k * 101 + (int)worker) & 0xff);
			sbf(&e, "%02x", byte);
			if (i >= 24)
				d[k] = d[k] << 8 | byte;
		}
		sbf(&e, "\"");
	}
	sbf(&e, "],\"parent\":%" PRIu64 ",\"bs\":%d,\"tokens\":", a[5], BS);
	tokens_for(&e, d, 2);
	sbf(&e, "}");
	uint64_t s = publish(p, "map", 2, false, e.s);
	model_store(&m, d, 2);
	wait_seq(id, s, "late");
	struct kvr_feed_stats st = stats(id);
	CHECK(st.replays == 1 && st.gaps == 0, "replays %" PRIu64 " gaps %" PRIu64, st.replays,
	      st.gaps);
	check_equal(rank, &m, "router started after the publisher");
	CHECK(kvr_feed_remove(F, id) == 0, "remove");
	pub_cmd(p, "{\"op\":\"stop\"}");
	free(e.s);
	kvr_u64map_fini(&m.gpu);
	unlink(ipc + 6);
	unlink(ipcr + 6);
}

/* Replays that cannot cover the gap: the publisher's buffer starts after it (the rest of the
 * replay is applied after the rank is cleared), then a replay endpoint that never answers
 * (replay_timeout_ms, then the gap is reported). */
static void scenario_short_replay(struct pubproc *p, uint64_t worker)
{
	char ep[256], rep[256];
	struct kvr_rank_id rank = {worker, 0};
	struct engine m = {0};
	kvr_u64map_init(&m.gpu);
	const char *r = pub_cmd(p, "{\"op\":\"start\",\"endpoint\":\"tcp://127.0.0.1:*\","
	                           "\"replay\":\"tcp://127.0.0.1:*\",\"topic\":\"kv\","
	                           "\"buffer\":2}");
	json_str(r, "endpoint", ep, sizeof(ep));
	json_str(r, "replay", rep, sizeof(rep));
	uint32_t id = add_ep(ep, rep, worker, 0);
	wait_sub(p);
	uint64_t a[5];
	chain(a, 5, 0xD000000000000000ull + worker * 0x100000000ull);
	struct sb e = {0};
	bool first;
	/* seq 0 arrives; 1, 2, 3 are lost; the buffer keeps only 3 and 4 */
	for (int i = 0; i < 5; i++) {
		e.len = 0;
		first = true;
		ev_stored(&e, &first, a + i, 1, NULL, NULL); /* each a root */
		uint64_t s = publish(p, "map", 0, i >= 1 && i <= 3, e.s);
		if (i == 0)
			wait_seq(id, s, "short replay: first");
	}
	wait_seq(id, 4, "short replay");
	/* the gap [1, 3) is reported and the rank cleared; 3 (replayed) and 4 are applied */
	model_store(&m, a + 3, 2);
	struct kvr_feed_stats st = stats(id);
	CHECK(st.gaps == 1 && st.replays == 1 && st.replayed_batches == 2,
	      "gaps %" PRIu64 " replays %" PRIu64 " replayed %" PRIu64, st.gaps, st.replays,
	      st.replayed_batches);
	CHECK(gap_expected == 1 && gap_got == 3, "gap %" PRIu64 "..%" PRIu64, gap_expected,
	      gap_got);
	check_equal(rank, &m, "replay shorter than the gap");
	CHECK(kvr_feed_remove(F, id) == 0, "remove");
	pub_cmd(p, "{\"op\":\"stop\"}");
	/* a replay endpoint nobody serves: the feed waits replay_timeout_ms, then reports */
	start(p, "tcp://127.0.0.1:*", NULL, ep, NULL);
	id = add_ep(ep, "tcp://127.0.0.1:9", worker, 0);
	wait_sub(p);
	e.len = 0;
	first = true;
	ev_stored(&e, &first, a, 1, NULL, NULL);
	publish(p, "map", 0, false, e.s);
	publish(p, "map", 0, true, e.s);
	e.len = 0;
	first = true;
	ev_stored(&e, &first, a + 1, 1, NULL, NULL);
	uint64_t s = publish(p, "array", 0, false, e.s);
	wait_seq(id, s, "replay timeout");
	kvr_u64map_clear(&m.gpu);
	model_store(&m, a + 1, 1);
	st = stats(id);
	CHECK(st.gaps == 1 && st.replays == 0, "gaps %" PRIu64 " replays %" PRIu64, st.gaps,
	      st.replays);
	check_equal(rank, &m, "replay timed out");
	CHECK(kvr_feed_remove(F, id) == 0, "remove");
	pub_cmd(p, "{\"op\":\"stop\"}");
	free(e.s);
	kvr_u64map_fini(&m.gpu);
}

/* A publisher restarted while the subscriber was disconnected, which sent past the old
 * stream's last seq before the subscriber reconnected (a PUB drops what it sends before then):
 * a restart, not a gap - the new stream is rebuilt from 0 by replay, or reported. */
static void scenario_restart_ahead(struct pubproc *p, uint64_t worker, bool with_replay)
{
	struct scen s;
	struct kvr_rank_id rank = {worker, 0};
	scen_begin(p, &s, worker, 0, with_replay);
	uint64_t a[3], b[5];
	chain(a, 3, 0xE000000000000000ull + worker * 0x100000000ull);
	chain(b, 5, 0xF000000000000000ull + worker * 0x100000000ull);
	for (int i = 0; i < 3; i++) { /* the old stream: seq 0..2 */
		pub_one(p, &s, true, a + i, 1, NULL, 0, false);
		model_store(&s.m, a + i, 1);
	}
	wait_seq(s.id, 2, "restart ahead: old stream");
	check_equal(rank, &s.m, "restart ahead: old stream");
	int gaps0 = __atomic_load_n(&gaps_reported, __ATOMIC_RELAXED);
	/* restart: an empty engine, whose seq 0..3 go out before the subscriber is back */
	char ep2[256], rep2[256];
	pub_cmd(p, "{\"op\":\"stop\"}");
	start(p, s.ep, with_replay ? s.rep : NULL, ep2, rep2);
	kvr_u64map_clear(&s.m.gpu);
	for (int i = 0; i < 4; i++) {
		pub_one(p, &s, true, b + i, 1, NULL, 0, true);
		model_store(&s.m, b + i, 1);
	}
	wait_sub(p);
	/* seq 4, the first the feed sees of the new stream: above the old stream's next (3) */
	uint64_t seq = pub_one(p, &s, true, b + 4, 1, NULL, 0, false);
	CHECK(seq == 4, "restarted publisher's seq %" PRIu64, seq);
	model_store(&s.m, b + 4, 1);
	wait_seq(s.id, seq, "restart ahead");
	struct kvr_feed_stats st = stats(s.id);
	CHECK(st.restarts == 1, "restarts %" PRIu64, st.restarts);
	if (with_replay) {
		/* replayed from 0: exactly the new engine's blocks, none of the old stream's */
		CHECK(st.gaps == 0 && st.replays == 1, "gaps %" PRIu64 " replays %" PRIu64, st.gaps,
		      st.replays);
		CHECK(__atomic_load_n(&gaps_reported, __ATOMIC_RELAXED) == gaps0, "gap reported");
		check_equal(rank, &s.m, "restart ahead, replayed from 0");
	} else {
		/* seq 0..3 of the new stream are lost: reported as the gap [0, 4) */
		CHECK(st.gaps == 1, "gaps %" PRIu64, st.gaps);
		check_gap(gaps0, 0, 4);
		kvr_u64map_clear(&s.m.gpu);
		model_store(&s.m, b + 4, 1);
		check_equal(rank, &s.m, "restart ahead without replay");
	}
	scen_end(p, &s);
}

/* Batches for a rank the router does not know yet are dropped and counted; when the rank is
 * added, the feed replays what it missed (only that rank's batches), so its index is right.
 * Without a replay endpoint the missed range is reported and the rank holds what came after. */
static void scenario_rank_added(struct pubproc *p, uint64_t worker, bool with_replay)
{
	struct scen s;
	struct kvr_rank_id rank = {worker, 0};
	scen_begin(p, &s, worker, KVR_FEED_DP_FROM_BATCH, with_replay);
	uint64_t a[3], b[2], c[2];
	chain(a, 3, 0x9000000000000000ull + worker * 0x100000000ull);
	chain(b, 2, 0x9800000000000000ull + worker * 0x100000000ull);
	chain(c, 2, 0x9C00000000000000ull + worker * 0x100000000ull);
	/* seq 0: a stored; 1: a[2] removed; 2: b stored on dp 1 (another rank, also unknown);
	 * 3: c[0] stored -- all while the router knows neither (worker, 0) nor (worker, 1) */
	pub_one(p, &s, true, a, 3, NULL, 0, false);
	pub_one(p, &s, false, a + 2, 1, NULL, 0, false);
	pub_one(p, &s, true, b, 2, NULL, 1, false);
	uint64_t seq = pub_one(p, &s, true, c, 1, NULL, 0, false);
	wait_seq(s.id, seq, "rank added: unknown");
	struct kvr_feed_stats st = stats(s.id);
	CHECK(st.unknown_rank == 4 && st.batches == 0, "unknown %" PRIu64 " batches %" PRIu64,
	      st.unknown_rank, st.batches);
	int gaps0 = __atomic_load_n(&gaps_reported, __ATOMIC_RELAXED);
	CHECK(kvr_rank_add(R, rank, 1, KVR_CAPACITY_NONE, 0) == 0, "rank add");
	/* at once a live batch for it (whichever comes first, it or the feed's own look at the
	 * added ranks, resyncs the rank first) */
	seq = pub_one(p, &s, true, c + 1, 1, c, 0, false);
	wait_seq(s.id, seq, "rank added: live");
	uint64_t end = now_ms() + 10000;
	do {
		st = stats(s.id);
		usleep(1000);
	} while (st.replays + st.gaps == 0 && now_ms() < end);
	if (with_replay) {
		model_store(&s.m, a, 3);
		model_remove(&s.m, a + 2, 1);
		model_store(&s.m, c, 2);
		CHECK(st.replays == 1 && st.replayed_batches == 3 && st.gaps == 0,
		      "replays %" PRIu64 " replayed %" PRIu64 " gaps %" PRIu64, st.replays,
		      st.replayed_batches, st.gaps);
		CHECK(__atomic_load_n(&gaps_reported, __ATOMIC_RELAXED) == gaps0, "gap reported");
		check_equal(rank, &s.m, "rank added: resynced by replay");
	} else {
		/* [0, 4) missed and reported; c[1]'s parent c[0] is unknown to the index: it holds
		 * nothing */
		CHECK(st.gaps == 1, "gaps %" PRIu64, st.gaps);
		check_gap(gaps0, 0, 4);
		seq = pub_one(p, &s, true, b, 2, NULL, 0, false);
		wait_seq(s.id, seq, "rank added: after");
		model_store(&s.m, b, 2);
		check_equal(rank, &s.m, "rank added without replay");
	}
	CHECK(kvr_rank_remove(R, rank) == 0, "rank remove");
	scen_end(p, &s);
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: test_feed PYTHON PUBLISHER_SCRIPT\n");
		return 1;
	}
	char probe[512];
	snprintf(probe, sizeof(probe), "%s -c 'import zmq, msgpack' 2>/dev/null", argv[1]);
	if (system(probe) != 0) {
		fprintf(stderr, "test_feed: %s lacks python3-zmq or python3-msgpack: skipped\n",
		        argv[1]);
		return 77;
	}
	signal(SIGPIPE, SIG_IGN);
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.mode = KVR_MODE_EVENTS;
	cfg.block_size = BS;
	cfg.n_shards = 2;
	cfg.on_event_gap = on_gap;
	if (kvr_router_create(&cfg, &R) != 0)
		return 1;
	for (uint64_t w = 1; w <= 8; w++)
		for (uint32_t dp = 0; dp < 3; dp++)
			kvr_rank_add(R, (struct kvr_rank_id){w, dp}, 1, KVR_CAPACITY_NONE, 0);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.log = on_log;
	fc.replay_timeout_ms = 2000;
	int rc = kvr_feed_create(R, &fc, &F);
	if (rc) {
		fprintf(stderr, "kvr_feed_create: %s\n", kvr_strerror(rc));
		return rc == KVR_ENOTSUP ? 77 : 1;
	}
	struct pubproc p;
	if (pub_spawn(&p, argv[1], argv[2]) != 0)
		return 1;
	char ipc[128];
	snprintf(ipc, sizeof(ipc), "ipc:///tmp/kvr-test-feed-%d-forms.ipc", (int)getpid());
	/* FEED_TEST_ONLY=N runs scenario N alone (debugging). */
	int only = getenv("FEED_TEST_ONLY") ? atoi(getenv("FEED_TEST_ONLY")) : 0;
	if (!only || only == 1)
		scenario_forms(&p, "tcp://127.0.0.1:*", "map", 1);
	if (!only || only == 2)
		scenario_forms(&p, ipc, "array", 2);
	unlink(ipc + 6);
	if (!only || only == 3)
		scenario_gaps(&p, 3, true);
	if (!only || only == 4)
		scenario_gaps(&p, 4, false);
	if (!only || only == 5)
		scenario_late(&p, 5);
	if (!only || only == 6)
		scenario_short_replay(&p, 6);
	if (!only || only == 7)
		scenario_restart_ahead(&p, 7, true);
	if (!only || only == 8)
		scenario_restart_ahead(&p, 8, false);
	if (!only || only == 9)
		scenario_rank_added(&p, 9, true);
	if (!only || only == 10)
		scenario_rank_added(&p, 10, false);
	pub_exit(&p);
	char text[1 << 16];
	size_t len;
	CHECK(kvr_metrics_render(R, text, sizeof(text), &len) == 0, "render");
	CHECK(only || (strstr(text, "kvr_feed_batches_total ") &&
	               strstr(text, "kvr_feed_replays_total 5") &&
	               strstr(text, "kvr_feed_gaps_total 5") &&
	               strstr(text, "kvr_feed_lag_seconds_count")),
	      "feed metrics missing");
	kvr_feed_destroy(F);
	kvr_router_destroy(R);
	if (failures) {
		fprintf(stderr, "test_feed: %d failures\n", failures);
		return 1;
	}
	printf("test_feed: all scenarios passed\n");
	return 0;
}
