/*
 * libFuzzer target: what peers send a replica, APPLIED (sync/replica_apply.c, replica_snap.c),
 * not only decoded (fuzz_replica_msg.c does that): the messages of hostile or broken peers
 * reach the router through kvr_repl_admit and the lifecycle calls, and a snapshot's records
 * through the same path.  Each input runs on a fresh router (2 shards, ranks (1,0) and (5,0) of
 * incarnation 1, the corpus's) with a replica that is never started: this thread plays its apply
 * thread.
 *
 * Input: a config byte (bit0: sync_booking, bit1: approx_ttl instead of approx_lru), then frames
 * [kind u8][len u16 little-endian][len bytes]: an even kind is one transport delivery (a stream
 * batch, or one message), an odd kind a snapshot answered with that frame as its only chunk;
 * with bit1 set the frame is handled with the (kind >> 2) + 1-th allocation from there failed
 * (on whichever thread makes it: this one, or a shard working for it).  A frame longer than
 * what is left takes the rest.  (tests/fuzz/make_replica_apply_corpus.py
 * writes the seed corpus: admissions, output, ends, ranks, gaps, resets, goodbyes, snapshots.)
 *
 * Properties: no crash, no undefined behaviour, no out-of-bounds access (ASan, UBSan), whatever
 * runs out of memory; once every peer's attempts are released (as when the peers go), no rank
 * the messages named keeps any load, and the replica mirrors nothing.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "sync/replica.h"
#include "sync/replica_internal.h"
#include "sync/replica_msg.h"

#define MAX_SEEN 64

static const uint8_t *snap;
static size_t snap_len;

static int t_publish(void *ctx, const void *buf, size_t len)
{
	(void)ctx, (void)buf, (void)len;
	return 0;
}

static int t_reply(void *ctx, const char *to, const void *buf, size_t len)
{
	(void)ctx, (void)to, (void)buf, (void)len;
	return 0;
}

static int t_request(void *ctx, const void *req, size_t len, uint64_t timeout_ns, uint64_t hedge_ns,
                     int (*on_chunk)(void *cb, const void *buf, size_t len), bool (*poll)(void *cb),
                     void *cb)
{
	(void)ctx, (void)req, (void)len, (void)timeout_ns, (void)hedge_ns, (void)poll;
	int rc = on_chunk(cb, snap, snap_len);
	return rc == 1 ? 0 : rc ? rc : KVR_ETIMEDOUT;
}

/* The ranks the input names (those it adds, and those its attempts use). */
static struct kvr_rank_id seen[MAX_SEEN];
static size_t n_seen;

static void note_rank(uint64_t worker, uint32_t dp)
{
	for (size_t i = 0; i < n_seen; i++)
		if (seen[i].worker_id == worker && seen[i].dp_rank == dp)
			return;
	if (n_seen < MAX_SEEN)
		seen[n_seen++] = (struct kvr_rank_id){worker, dp};
}

static void note_msg(const struct kvr_wmsg *m)
{
	if (m->h.type == KVR_MSG_ADMIT || m->h.type == KVR_MSG_ATTEMPT || m->h.type == KVR_MSG_RANK)
		note_rank(m->worker_id, m->dp_rank);
}

static void note_delivery(const uint8_t *p, size_t len)
{
	struct kvr_wmsg m;
	size_t pos = 0;
	while (kvr_msg_batch_next(p, len, &pos, &m) == 1) {
		note_msg(&m);
		if (m.h.type != KVR_MSG_SNAP_CHUNK)
			continue;
		size_t rp = 0, rl;
		const uint8_t *rec;
		struct kvr_wmsg r;
		while (kvr_msg_next_record(&m, &rp, &rec, &rl) == 1)
			if (kvr_msg_decode(rec, rl, &r) == 0)
				note_msg(&r);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = data[0] & 1;
	c.mode = data[0] & 2 ? KVR_MODE_APPROX_TTL : KVR_MODE_APPROX_LRU;
	c.shard_idle_spin_ns = 0;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r))
		abort();
	n_seen = 0;
	note_rank(1, 0);
	note_rank(5, 0);
	for (size_t i = 0; i < 2; i++)
		if (kvr_rank_add(r, seen[i], 1, 4096, 0))
			abort();
	struct kvr_replica_config rc = {
	    .replica_id = 1, .heartbeat_ms = 100, .dead_after = 5, .snapshot_timeout_ms = 100};
	struct kvr_replica_transport t = {
	    .publish = t_publish, .reply = t_reply, .request = t_request};
	struct kvr_replica *rep;
	if (kvr_replica_create(r, &rc, &t, &rep))
		abort();
	size_t pos = 1;
	while (pos + 3 <= size) {
		uint8_t kind = data[pos];
		size_t len = (size_t)data[pos + 1] | (size_t)data[pos + 2] << 8;
		pos += 3;
		if (len > size - pos)
			len = size - pos;
		const uint8_t *p = data + pos;
		pos += len;
		note_delivery(p, len);
		if (kind & 2)
			kvr_alloc_fail_after(1 + (kind >> 2));
		if (kind & 1) {
			snap = p;
			snap_len = len;
			kvr_rep_resync(rep);
		} else {
			kvr_rep_handle(rep, p, len, NULL);
		}
		kvr_alloc_fail_after(0);
	}
	struct kvr_sync_stats st;
	if (getenv("FUZZ_REPLICA_APPLY_TRACE")) { /* what the input did, for writing corpora */
		kvr_replica_get_stats(rep, &st);
		fprintf(
		    stderr,
		    "applied %lu dropped %lu refused %lu orphans %lu gaps %lu duplicates %lu "
		    "snapshots %lu released %lu mirrored %u output_dropped %lu "
		    "block_size_mismatch %lu\n",
		    (unsigned long)st.applied, (unsigned long)st.dropped, (unsigned long)st.refused,
		    (unsigned long)st.orphans, (unsigned long)st.gaps, (unsigned long)st.duplicates,
		    (unsigned long)st.snapshots_applied, (unsigned long)st.released, st.mirrored,
		    (unsigned long)st.output_dropped, (unsigned long)st.block_size_mismatch);
	}
	kvr_rep_release_mirrors(rep, 0);
	kvr_replica_get_stats(rep, &st);
	if (st.mirrored)
		abort();
	if (kvr_router_sync(r, 10000))
		abort();
	for (size_t i = 0; i < n_seen; i++) {
		struct kvr_rank_stats s;
		if (kvr_rank_get_stats(r, seen[i], &s))
			continue; /* not added, or removed */
		if (s.active_requests || s.active_blocks || s.active_prefill_tokens)
			abort(); /* a mirror's load outlived every peer */
	}
	kvr_replica_stop(rep);
	kvr_replica_destroy(rep);
	kvr_router_destroy(r);
	return 0;
}
