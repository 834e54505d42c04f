/*
 * core/metrics_render.c - kvr_metrics_render: every counter, histogram and per-rank gauge in
 * Prometheus text exposition format (version 0.0.4).  Histograms are emitted with one `le` bound
 * per power of two (the fine log-linear buckets merged), which keeps the text short and stable.
 * A bound is inclusive (Prometheus counts the observations <= le), and the fine buckets split at
 * powers of two, so each cumulative count holds the observations below 2^k, i.e. at most
 * 2^k - 1 (observations are integers: ns, blocks): that is the bound written.  (It read 2^k,
 * which left an observation of exactly 2^k out of its own bound: a decision with 1 block of
 * overlap counted under le="2", not le="1".)  Nanoseconds are written as exact decimal seconds
 * ("0.000001023"), as are the sums, which %.9g rounded.
 */
#include <inttypes.h>
#include <locale.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "sync/rcu.h"
#include "sync/nocancel.h"

struct out {
	char *buf;
	size_t cap, len;
};

static void put(struct out *o, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	size_t room = o->len < o->cap ? o->cap - o->len : 0;
	int n = vsnprintf(room ? o->buf + o->len : NULL, room, fmt, ap);
	va_end(ap);
	if (n > 0)
		o->len += (size_t)n;
}

/* ns as exact decimal seconds: "1.5", "0.000001023", "0".  Locale-free (no printf float). */
static void put_ns_seconds(struct out *o, uint64_t ns)
{
	char frac[16];
	snprintf(frac, sizeof(frac), "%09" PRIu64, ns % 1000000000u);
	size_t n = strlen(frac);
	while (n > 0 && frac[n - 1] == '0')
		n--;
	put(o, "%" PRIu64 "%s%.*s", ns / 1000000000u, n ? "." : "", (int)n, frac);
}

/* A histogram value v (a bound or the sum) as exposed: ns as seconds, else the integer. */
static void put_hist_value(struct out *o, bool ns, uint64_t v)
{
	if (ns)
		put_ns_seconds(o, v);
	else
		put(o, "%" PRIu64, v);
}

static const struct {
	enum kvr_counter c;
	const char *name, *help, *labels;
} counters[] = {
    {KVR_C_ROUTES, "kvr_routes_total", "Requests routed and admitted", ""},
    {KVR_C_ROUTE_ERRORS, "kvr_route_errors_total",
     "Route calls that failed, bad requests included (a full queue's refusals: "
     "kvr_queue_rejected_total)",
     ""},
    {KVR_C_ROUTES_QUERY_ONLY, "kvr_routes_query_only_total", "Query-only decisions", ""},
    {KVR_C_ROUTED_BLOCKS, "kvr_routed_blocks_total", "Prompt blocks of admitted requests", ""},
    {KVR_C_PREDICTED_OVERLAP_BLOCKS, "kvr_predicted_overlap_blocks_total",
     "Predicted cached prefix blocks on the chosen ranks", ""},
    {KVR_C_EV_STORED_OK, "kvr_events_total", "KV events applied", "type=\"stored\",status=\"ok\""},
    {KVR_C_EV_STORED_ERR, "kvr_events_total", NULL, "type=\"stored\",status=\"error\""},
    {KVR_C_EV_REMOVED_OK, "kvr_events_total", NULL, "type=\"removed\",status=\"ok\""},
    {KVR_C_EV_REMOVED_ERR, "kvr_events_total", NULL, "type=\"removed\",status=\"error\""},
    {KVR_C_EV_CLEARED_OK, "kvr_events_total", NULL, "type=\"cleared\",status=\"ok\""},
    {KVR_C_EV_CLEARED_ERR, "kvr_events_total", NULL, "type=\"cleared\",status=\"error\""},
    {KVR_C_EV_STALE, "kvr_events_total", NULL, "type=\"any\",status=\"stale\""},
    {KVR_C_EV_STORED_OVER, "kvr_events_total", NULL, "type=\"stored\",status=\"over_bound\""},
    {KVR_C_EV_STORED_FULL, "kvr_events_total", NULL, "type=\"stored\",status=\"index_full\""},
    {KVR_C_EV_RANK_GONE, "kvr_events_total", NULL, "type=\"any\",status=\"rank_gone\""},
    {KVR_C_EV_GAPS, "kvr_event_gaps_total", "Jumps in a rank's KV event ids", ""},
    {KVR_C_EV_BLOCK_NOT_FOUND, "kvr_event_block_not_found_total",
     "Removed hashes the rank did not hold", ""},
    {KVR_C_EV_PARENT_NOT_FOUND, "kvr_event_parent_not_found_total",
     "Stored events whose parent the rank did not hold", ""},
    {KVR_C_EV_OVER_BLOCKS, "kvr_event_over_bound_blocks_total",
     "Blocks of stored events refused because their rank would have held more than its bound "
     "(kvr_config.events_max_blocks, or twice its capacity plus 1,024)",
     ""},
    {KVR_C_EV_OVER_EPISODES, "kvr_event_over_bound_episodes_total",
     "Times a rank reached its stored-block bound (each reported once through on_event_gap)", ""},
    {KVR_C_EVICTIONS, "kvr_evictions_total", "Blocks evicted from the predicted caches", ""},
    {KVR_C_TTL_EXPIRIES, "kvr_ttl_expiries_total", "Blocks forgotten by TTL retention", ""},
    {KVR_C_LEASE_EXPIRIES, "kvr_lease_expiries_total", "Attempts expired by the reaper", ""},
    {KVR_C_FINISHED, "kvr_requests_ended_total", "Attempts ended", "how=\"finish\""},
    {KVR_C_ABORTED, "kvr_requests_ended_total", NULL, "how=\"abort\""},
    {KVR_C_STALE_CALLS, "kvr_stale_calls_total", "Calls on ended attempts (KVR_ESTALE)", ""},
    {KVR_C_QUEUED, "kvr_queue_enqueued_total", "Requests that waited in the queue", ""},
    {KVR_C_QUEUE_ADMITTED, "kvr_queue_admitted_total", "Queued requests admitted", ""},
    {KVR_C_QUEUE_REJECTED, "kvr_queue_rejected_total", "Requests refused by a full queue", ""},
    {KVR_C_QUEUE_TIMEOUTS, "kvr_queue_timeouts_total", "Waits that passed their deadline", ""},
    {KVR_C_SHARD_INDEX_WRITE_ERRORS, "kvr_shard_errors_total",
     "Shard work that failed and was counted, not lost", "what=\"index_write\""},
    {KVR_C_SHARD_TIMER_ERRORS, "kvr_shard_errors_total", NULL, "what=\"timer_arm\""},
    {KVR_C_SHARD_RELEASE_ERRORS, "kvr_shard_errors_total", NULL, "what=\"release\""},
    {KVR_C_LANE_FULL_WAITS, "kvr_lane_full_waits_total",
     "Posts to a shard lane that found it full and waited (bounded)", ""},
    {KVR_C_LANE_FULL_DROPS, "kvr_lane_full_drops_total",
     "Posts given up after the bounded wait (admission refused with KVR_EAGAIN, or lifecycle work "
     "left to the lease reaper)",
     ""},
    {KVR_C_LANE_FULL_REFUSALS, "kvr_lane_full_refusals_total",
     "Queued requests' bookings that a frontend's admission pass found on a full lane and refused "
     "at once, without the bounded wait (the request stays queued; the admission thread retries "
     "it, and its retry counts as any post)",
     ""},
    {KVR_C_LANE_SOFT_THROTTLES, "kvr_lane_soft_throttles_total",
     "Admissions that waited at a routing lane's soft depth while its shard was taking work", ""},
    {KVR_C_LANE_SOFT_SPILLS, "kvr_lane_soft_spills_total",
     "Admissions posted past a routing lane's soft depth: its shard had taken nothing for 50 us "
     "(a stall), or the wait reached 500 us",
     ""},
    {KVR_C_STALE_BOOKINGS, "kvr_stale_bookings_total",
     "Admissions whose rank was removed or reset before the booking (the attempt is stale)", ""},
    {KVR_C_SHARD_WAKES_DEFERRED, "kvr_shard_wakes_deferred_total",
     "Lifecycle calls that left an idle shard asleep (it wakes by itself within 1 ms and applies "
     "them)",
     ""},
    {KVR_C_BOOKING_WAITS, "kvr_booking_waits_total",
     "sync_booking admissions that waited for their shard's answer (no room made to track them "
     "without allocating)",
     ""},
    {KVR_C_OUTPUT_OVER_BOUND, "kvr_output_over_bound_total",
     "Attempts whose output reached twice their rank's capacity plus 1,024 blocks (approx_lru): "
     "the rest of their output is not predicted",
     ""},
    {KVR_C_FEED_MESSAGES, "kvr_feed_messages_total", "KV event feed: messages received live", ""},
    {KVR_C_FEED_BATCHES, "kvr_feed_batches_total", "KV event feed: batches applied", ""},
    {KVR_C_FEED_EVENTS, "kvr_feed_events_total", "KV event feed: events applied", ""},
    {KVR_C_FEED_BLOCKS_STORED, "kvr_feed_blocks_total", "KV event feed: block copies",
     "op=\"stored\",medium=\"gpu\""},
    {KVR_C_FEED_BLOCKS_REMOVED, "kvr_feed_blocks_total", NULL, "op=\"removed\",medium=\"gpu\""},
    {KVR_C_FEED_OTHER_MEDIUM, "kvr_feed_blocks_total", NULL, "op=\"stored\",medium=\"other\""},
    {KVR_C_FEED_MALFORMED, "kvr_feed_dropped_total", "KV event feed: input not applied",
     "why=\"malformed\""},
    {KVR_C_FEED_REFUSED, "kvr_feed_dropped_total", NULL, "why=\"refused_event\""},
    {KVR_C_FEED_UNKNOWN_RANK, "kvr_feed_dropped_total", NULL, "why=\"unknown_rank\""},
    {KVR_C_FEED_DUPLICATES, "kvr_feed_dropped_total", NULL, "why=\"duplicate\""},
    {KVR_C_FEED_GAPS, "kvr_feed_gaps_total", "KV event feed: seq gaps not healed (rank cleared)",
     ""},
    {KVR_C_FEED_REPLAYS, "kvr_feed_replays_total", "KV event feed: replays served", ""},
    {KVR_C_FEED_REPLAYED_BATCHES, "kvr_feed_replayed_batches_total",
     "KV event feed: batches applied from replays", ""},
    {KVR_C_FEED_RESTARTS, "kvr_feed_restarts_total",
     "KV event feed: publisher restarts (rank cleared)", ""},
    {KVR_C_FEED_LOST, "kvr_feed_lost_total",
     "KV event feed: events or batches not applied for lack of memory (rank cleared)", ""},
    {KVR_C_FEED_REPLAY_REASKS, "kvr_feed_replay_reasks_total",
     "KV event feed: replay requests asked again (an answer with a hole or cut short)", ""},
    {KVR_C_HEAL_FEEDBACK, "kvr_heal_feedback_total",
     "Engine cached-token reports applied (kvr_request_cached)", ""},
    {KVR_C_HEAL_OVER, "kvr_heal_over_predictions_total",
     "Cached-token reports below the predicted cached prefix", ""},
    {KVR_C_HEAL_UNDER, "kvr_heal_under_predictions_total",
     "Cached-token reports above the predicted cached prefix", ""},
    {KVR_C_HEAL_UNPROVABLE, "kvr_heal_unprovable_total",
     "Over-predictions whose first missing block was held by a live request (nothing evicted)", ""},
    {KVR_C_HEAL_OBSERVE, "kvr_heal_observations_total",
     "Rank observations applied (kvr_rank_observe)", ""},
    {KVR_C_HEAL_WM_UNKNOWN, "kvr_heal_watermark_unknown_total",
     "Watermarks with no inactive predicted copy (nothing provable)", ""},
    {KVR_C_HEAL_EVICTED, "kvr_heal_evicted_blocks_total",
     "Predicted blocks evicted by healing from engine ground truth", ""},
    {KVR_C_HEAL_CAP_RAISED, "kvr_heal_capacity_raised_total",
     "Rank observations whose resident blocks exceeded the capacity (capacity raised to them)", ""},
};

static const struct {
	enum kvr_hist h;
	const char *name, *help;
	bool ns; /* observed in ns, exposed in seconds; else exposed as observed */
} hists[] = {
    {KVR_H_ROUTE_NS, "kvr_route_seconds",
     "Whole route decision (sampled: 1 decision in 16 per thread)", true},
    {KVR_H_HASH_NS, "kvr_route_hash_seconds",
     "Route stage: block hashing (sampled: 1 decision in 16 per thread)", true},
    {KVR_H_MATCH_NS, "kvr_route_match_seconds",
     "Route stage: index lookup and pinned depths (sampled: 1 in 16)", true},
    {KVR_H_SELECT_NS, "kvr_route_select_seconds",
     "Route stage: scoring and choice (sampled: 1 in 16)", true},
    {KVR_H_ADMIT_NS, "kvr_route_admit_seconds",
     "Route stage: admission, the booking posted (sampled: 1 in 16)", true},
    {KVR_H_QUEUE_WAIT_NS, "kvr_queue_wait_seconds", "Time queued before admission", true},
    {KVR_H_OVERLAP_BLOCKS, "kvr_predicted_overlap_blocks", "Predicted overlap per decision", false},
    {KVR_H_FEED_LAG_NS, "kvr_feed_lag_seconds", "KV event feed: publish to applied", true},
};

static int render(struct kvr_router *r, char *buf, size_t cap, size_t *len_out)
{
	if (!r || (!buf && cap))
		return kvr_fail(KVR_EINVAL, "kvr_metrics_render: %s",
		                !r ? "router is NULL" : "buf is NULL with cap > 0");
	/* Inherited over a fork: its registries' locks may be held by the parent's threads.  buf
	 * is still terminated: the header promises it whenever cap > 0. */
	if (kvr_fork_inherited(r)) {
		if (cap)
			buf[0] = '\0';
		return kvr_fail(KVR_ESHUTDOWN, "kvr_metrics_render: %s", kvr_router_gone(r));
	}
	kvr_router_settle(r); /* sync_booking: counting what earlier calls posted */
	struct out o = {.buf = buf, .cap = cap};
	const char *last = "";
	for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
		if (strcmp(last, counters[i].name) != 0) {
			put(&o, "# HELP %s %s\n# TYPE %s counter\n", counters[i].name,
			    counters[i].help, counters[i].name);
			last = counters[i].name;
		}
		uint64_t v = kvr_metrics_counter(r->metrics, counters[i].c);
		if (counters[i].labels[0])
			put(&o, "%s{%s} %" PRIu64 "\n", counters[i].name, counters[i].labels, v);
		else
			put(&o, "%s %" PRIu64 "\n", counters[i].name, v);
	}
	uint64_t h[KVR_HIST_BUCKETS], sum;
	for (size_t i = 0; i < sizeof(hists) / sizeof(hists[0]); i++) {
		kvr_metrics_hist(r->metrics, hists[i].h, h, &sum);
		put(&o, "# HELP %s %s\n# TYPE %s histogram\n", hists[i].name, hists[i].help,
		    hists[i].name);
		uint64_t acc = 0, total = 0;
		for (unsigned b = 0; b < KVR_HIST_BUCKETS; b++)
			total += h[b];
		/* Bucket b holds values < low(b+1): the count of those < 2^k, i.e. <= 2^k - 1. */
		unsigned b = 0;
		for (unsigned k = 0; k < 40; k++) {
			uint64_t below = 1ull << k;
			while (b < KVR_HIST_BUCKETS && kvr_hist_bucket_low(b + 1) <= below) {
				acc += h[b];
				b++;
			}
			put(&o, "%s_bucket{le=\"", hists[i].name);
			put_hist_value(&o, hists[i].ns, below - 1);
			put(&o, "\"} %" PRIu64 "\n", acc);
		}
		put(&o, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n%s_sum ", hists[i].name, total,
		    hists[i].name);
		put_hist_value(&o, hists[i].ns, sum);
		put(&o, "\n%s_count %" PRIu64 "\n", hists[i].name, total);
	}
	put(&o, "# HELP kvr_queue_depth Requests waiting\n# TYPE kvr_queue_depth gauge\n");
	put(&o, "kvr_queue_depth %zu\n", kvr_queue_depth(r));
	put(&o, "# HELP kvr_queue_uncollected Queued requests admitted or failed whose outcome "
	        "kvr_route_wait has not collected\n# TYPE kvr_queue_uncollected gauge\n");
	put(&o, "kvr_queue_uncollected %zu\n", kvr_queue_uncollected(r));
	/* Which allocator: a process that loaded the library with dlopen, or did not link jemalloc,
	 * runs on the C library's, with about twice the memory per tracked block (README). */
	put(&o,
	    "# HELP kvr_allocator The allocator the library's structures come from (info)\n"
	    "# TYPE kvr_allocator gauge\nkvr_allocator{name=\"%s\"} 1\n",
	    kvr_alloc_name());
	static const char *gauges[][2] = {
	    {"kvr_rank_active_blocks", "Distinct blocks pinned by in-flight requests"},
	    {"kvr_rank_active_prefill_tokens", "Prefill tokens in flight"},
	    {"kvr_rank_active_requests", "Live attempts"},
	    {"kvr_rank_resident_blocks", "Blocks the rank is predicted (or known) to cache"},
	};
	if (kvr_rcu_thread_online()) {
		if (cap) /* the header promises a terminated buffer whenever cap > 0 */
			buf[o.len < cap ? o.len : cap - 1] = '\0';
		return kvr_fail(KVR_ENOMEM,
		                "kvr_metrics_render: this thread could not register with RCU");
	}
	for (int g = 0; g < 4; g++) {
		put(&o, "# HELP %s %s\n# TYPE %s gauge\n", gauges[g][0], gauges[g][1],
		    gauges[g][0]);
		kvr_rcu_read_lock();
		const struct kvr_live *live = kvr_rcu_deref(&r->live);
		for (uint32_t i = 0, n = kvr_live_n(live); i < n; i++) {
			const struct kvr_rank_pub *p = &r->ranks[live->slot[i]];
			const uint64_t *f[] = {&p->active_blocks, &p->prefill_tokens,
			                       &p->active_requests, &p->resident_blocks};
			put(&o, "%s{worker=\"%" PRIu64 "\",dp_rank=\"%u\"} %" PRIu64 "\n",
			    gauges[g][0], p->worker_id, p->dp_rank,
			    __atomic_load_n(f[g], __ATOMIC_RELAXED));
		}
		kvr_rcu_read_unlock();
	}
	/* Replica sync (issue 14): its counters, when a layer is attached. */
	o.len += kvr_repl_render(r, o.len < o.cap ? o.buf + o.len : NULL,
	                         o.len < o.cap ? o.cap - o.len : 0);
	if (len_out)
		*len_out = o.len + 1;
	if (cap)
		buf[o.len < cap ? o.len : cap - 1] = '\0';
	if (o.len >= cap)
		return kvr_fail(
		    KVR_ERANGE,
		    "kvr_metrics_render: cap %zu is below the %zu bytes needed (*len_out)", cap,
		    o.len + 1);
	return 0;
}

/* Prometheus' text format takes "0.5" only, and printf writes the process's locale's decimal
 * point: a program that called setlocale(LC_ALL, "") in a de_DE environment rendered le="1,6e-08"
 * bounds and "0,000123" sums, and its scrapes failed (tests/unit/test_locale.c).  The render
 * formats under the C locale, on this thread only (uselocale), whatever the process's is. */
int kvr_metrics_render(struct kvr_router *r, char *buf, size_t cap, size_t *len_out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	locale_t c = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
	if (!c) {
		if (buf && cap) /* terminated whenever cap > 0, as render's failures */
			buf[0] = '\0';
		return kvr_fail(KVR_ENOMEM, "kvr_metrics_render: out of memory for the C locale");
	}
	locale_t was = uselocale(c);
	int rc = render(r, buf, cap, len_out);
	uselocale(was);
	freelocale(c);
	return rc;
}
