/*
 * sync/replica_nats.c - the NATS transport of replica sync and the public kvr_sync_* API
 * (issue 14), on nats.c (libnats 3.x).
 *
 * Subjects, for cluster C:
 *   C.stream   every replica's stream (admissions, lifecycle, ranks), heartbeats, goodbyes.
 *              One subject, so NATS's per-publisher order covers everything one replica sends.
 *   C.snap     snapshot requests, a queue group ("kvr-snap") of the replicas that are ready:
 *              exactly one of them answers, with chunks sent to the requester's inbox.
 *   C.id.N     replica N answers every request here: an attach asks it first (id_check), so a
 *              second replica under an id in use is refused instead of joining the cluster
 *              as a forger of the first's messages.
 * The connection uses no echo (a replica never hears itself: a message with our id is forged),
 * unlimited reconnects every 100 ms, and a 1 s ping so a dead server is noticed quickly.  nats.c
 * buffers publishes made while reconnecting; the core does not rely on that (it stops publishing
 * when told of the disconnect and resends its state after the reconnect).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nats/nats.h>

#include "core/alloc.h"
#include "core/error.h"
#include "core/fork.h"
#include "core/router_internal.h"
#include "sync/replica.h"
#include "sync/replica_config.h"
#include "sync/replica_internal.h"
#include "sync/replica_msg.h"
#include "sync/nats_cloexec.h"
#include "sync/nocancel.h"
#include "sync/thread.h"

struct kvr_sync {
	struct kvr_replica *rep;
	natsConnection *nc;
	natsSubscription *stream_sub, *snap_sub, *id_sub;
	char subj_stream[96], subj_snap[96], subj_id[96];
	/* nats.c delivers connection callbacks on its own thread, in order, the closed callback
	 * last, and natsConnection_Destroy does not wait for them: detach waits for `closed` before
	 * it frees what the callbacks touch (ASan found on_disconnected reading freed memory). */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool closed;
};

static void on_stream(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
	(void)nc;
	(void)sub;
	struct kvr_sync *s = closure;
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_REPLICA); /* nats.c's thread: scoped test failures */
	/* nats.c's subscription thread delivers the stream in order and holds no lock of ours:
	 * it handles the message itself when nothing is queued (no copy, no wake-up of the apply
	 * thread). */
	kvr_replica_deliver_inline(s->rep, natsMsg_GetData(msg),
	                           (size_t)natsMsg_GetDataLength(msg));
	natsMsg_Destroy(msg);
}

static void on_snapreq(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
	(void)nc;
	(void)sub;
	struct kvr_sync *s = closure;
	kvr_alloc_thread_role(KVR_ALLOC_ROLE_REPLICA); /* nats.c's thread: scoped test failures */
	const char *reply = natsMsg_GetReply(msg);
	if (reply)
		kvr_replica_deliver(s->rep, natsMsg_GetData(msg),
		                    (size_t)natsMsg_GetDataLength(msg), reply);
	natsMsg_Destroy(msg);
}

/* "Replica N is here": any answer will do, the asker only looks at whether one came. */
static void on_idreq(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
	(void)sub;
	(void)closure;
	const char *reply = natsMsg_GetReply(msg);
	if (reply)
		natsConnection_Publish(nc, reply, "", 0);
	natsMsg_Destroy(msg);
}

/* nats.c's asynchronous errors: a permission violation (the server's -ERR for a publish or
 * subscription it does not permit) is counted; the others it handles itself (slow consumer:
 * counted by the stream's gaps; a broken connection: reconnects). */
static void on_error(natsConnection *nc, natsSubscription *sub, natsStatus err, void *closure)
{
	(void)nc;
	(void)sub;
	struct kvr_sync *s = closure;
	if (err == NATS_NOT_PERMITTED && s->rep)
		kvr_replica_denied(s->rep);
}

static void on_disconnected(natsConnection *nc, void *closure)
{
	(void)nc;
	struct kvr_sync *s = closure;
	if (s->rep)
		kvr_replica_disconnected(s->rep);
}

static void on_closed(natsConnection *nc, void *closure)
{
	(void)nc;
	struct kvr_sync *s = closure;
	pthread_mutex_lock(&s->mu);
	s->closed = true;
	pthread_cond_broadcast(&s->cv);
	pthread_mutex_unlock(&s->mu);
}

/* The server's max_payload (nats.c refuses a larger publish): what a replica message may be. */
static size_t max_payload(natsConnection *nc)
{
	int64_t m = natsConnection_GetMaxPayload(nc);
	return m > 0 ? (size_t)m : 0;
}

static void on_reconnected(natsConnection *nc, void *closure)
{
	struct kvr_sync *s = closure;
	kvr_nats_cloexec(nc); /* a new socket, opened as the first without FD_CLOEXEC */
	if (s->rep) {
		/* maybe another server of the cluster, with another limit */
		kvr_replica_set_max_msg(s->rep, max_payload(nc));
		kvr_replica_reconnected(s->rep);
	}
}

static int t_publish(void *ctx, const void *buf, size_t len)
{
	struct kvr_sync *s = ctx;
	if (natsConnection_Status(s->nc) != NATS_CONN_STATUS_CONNECTED)
		return KVR_EAGAIN;
	return natsConnection_Publish(s->nc, s->subj_stream, buf, (int)len) == NATS_OK ? 0
	                                                                               : KVR_EAGAIN;
}

static int t_reply(void *ctx, const char *to, const void *buf, size_t len)
{
	struct kvr_sync *s = ctx;
	return natsConnection_Publish(s->nc, to, buf, (int)len) == NATS_OK ? 0 : KVR_EAGAIN;
}

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A snapshot request's wait (t_request): its deadline, when the next copy is due, when the
 * deadline and a stop were last looked at, and the copies sent. */
struct wait {
	uint64_t deadline, hedge_at, checked;
	unsigned sent;
};

#define WAIT_STEP_NS 20000000ull /* the deadline and a stop are looked at this often */

/* Unsubscribes, lets the server confirm it (a flush), then destroys: nats.c 3.4.1's read loop
 * can take a message for a subscription being destroyed at that moment (nats.c#637) and crash
 * (SEGV in natsConn_processMsg: test_sync_nats auth_cluster under ASan, 4 runs of 8, when the
 * answers crossing a route back to us were still on their way).  After the flush's PONG
 * nothing more comes for it. */
static void sub_close(natsConnection *nc, natsSubscription *sub, int64_t flush_ms)
{
	if (sub && natsSubscription_Unsubscribe(sub) == NATS_OK && flush_ms > 0 &&
	    natsConnection_Status(nc) == NATS_CONN_STATUS_CONNECTED) /* else no read loop runs */
		natsConnection_FlushTimeout(nc, flush_ms);
	natsSubscription_Destroy(sub);
}

/* What the wait does when no reply came for WAIT_STEP_NS, or every WAIT_STEP_NS while replies
 * that are no progress keep coming: KVR_ESHUTDOWN when poll says the replica stops (a detach or
 * router destroy waits for this thread), KVR_ETIMEDOUT past the deadline, else 0, a copy of the
 * request sent again if one is due. */
static int between_waits(struct kvr_sync *s, const char *inbox, const void *req, size_t len,
                         uint64_t hedge_ns, bool (*poll)(void *cb), void *cb, struct wait *w)
{
	if (poll && poll(cb))
		return KVR_ESHUTDOWN;
	uint64_t now = mono_ns();
	w->checked = now;
	if (now >= w->deadline)
		return KVR_ETIMEDOUT;
	/* Nobody answered yet: the group may pick another member this time.  A failed send is
	 * the next hedge's to make up. */
	if (now >= w->hedge_at) {
		if (natsConnection_PublishRequest(s->nc, s->subj_snap, inbox, req, (int)len) ==
		    NATS_OK)
			w->sent++;
		w->hedge_at = now + hedge_ns;
	}
	return 0;
}

static int t_request(void *ctx, const void *req, size_t len, uint64_t timeout_ns, uint64_t hedge_ns,
                     int (*on_chunk)(void *cb, const void *buf, size_t len), bool (*poll)(void *cb),
                     void *cb)
{
	struct kvr_sync *s = ctx;
	natsInbox *inbox = NULL;
	natsSubscription *sub = NULL;
	int rc = KVR_EAGAIN;
	if (natsInbox_Create(&inbox) != NATS_OK)
		return KVR_ENOMEM;
	if (natsConnection_SubscribeSync(&sub, s->nc, inbox) != NATS_OK)
		goto out;
	natsSubscription_SetPendingLimits(sub, 1 << 20, 1 << 30);
	/* No flush: the inbox's subscription goes before the request on this connection, and
	 * the wait below polls for a stop.  nats.c's flush of a request made while reconnecting
	 * waited its whole 10 s default for a PONG no server would send, and a detach with it. */
	if (natsConnection_PublishRequest(s->nc, s->subj_snap, inbox, req, (int)len) != NATS_OK)
		goto out;
	struct wait w = {.deadline = mono_ns() + timeout_ns,
	                 .hedge_at = hedge_ns ? mono_ns() + hedge_ns : UINT64_MAX,
	                 .checked = mono_ns(),
	                 .sent = 1};
	/* Copies declined, and found by nobody (no responders). */
	unsigned declined = 0, unheard = 0;
	for (;;) {
		natsMsg *msg = NULL;
		natsStatus st = natsSubscription_NextMsg(&msg, sub, 20);
		if (st == NATS_TIMEOUT) {
			if ((rc = between_waits(s, inbox, req, len, hedge_ns, poll, cb, &w)))
				break;
			continue;
		}
		bool nobody = st == NATS_NO_RESPONDERS;
		if (st == NATS_OK && natsMsg_IsNoResponders(msg)) {
			natsMsg_Destroy(msg);
			nobody = true;
		}
		if (nobody) {
			/* No subscriber took a copy (nats.c gives the server's "no responders" as
			 * this status, or as a message): no peer is ready, if no copy is out.  It
			 * was taken for a failed try and asked again for the whole
			 * snapshot_timeout_ms, so a lone replica was ready only after it
			 * (test_sync_nats snapshot_wait). But a copy sent before may be with a
			 * member that left the group since, its answer still to come: ended at
			 * once, the asker started alone and the answer was lost (test_sync_nats
			 * snapshot_no_responders). */
			if (declined + ++unheard < w.sent)
				continue;
			rc = declined ? KVR_EAGAIN : KVR_ENOENT;
			break;
		}
		if (st != NATS_OK) {
			rc = KVR_EAGAIN;
			break;
		}
		int r = on_chunk(cb, natsMsg_GetData(msg), (size_t)natsMsg_GetDataLength(msg));
		natsMsg_Destroy(msg);
		if (r == KVR_REP_CHUNK_DECLINED && ++declined + unheard >= w.sent) {
			rc = KVR_EAGAIN;
			break;
		}
		if (r != KVR_REP_CHUNK_MORE && r != KVR_REP_CHUNK_IGNORED &&
		    r != KVR_REP_CHUNK_DECLINED) {
			rc = r == KVR_REP_CHUNK_LAST ? 0 : r;
			break;
		}
		/* Only a chunk taken is progress: neither a reply not taken (IGNORED) nor a copy
		 * declined while another may be with a peer that answers later (DECLINED) moves
		 * the deadline, and the hedge goes on after them. */
		if (r == KVR_REP_CHUNK_MORE) {
			w.hedge_at = UINT64_MAX;
			w.deadline = mono_ns() + timeout_ns; /* the deadline is per chunk */
		}
		/* And the deadline and a stop are looked at every WAIT_STEP_NS whatever comes: an
		 * unbroken stream of replies held both off for as long as it lasted (test_sync_nats
		 * snapshot_ignored, another provider's reply every 5 ms). */
		if (mono_ns() - w.checked >= WAIT_STEP_NS &&
		    (rc = between_waits(s, inbox, req, len, hedge_ns, poll, cb, &w)))
			break;
	}
out:
	/* Replies of other providers may still be on their way.  Not on a detach (nor longer
	 * than 500 ms): a server that froze looks connected, and the flush held the detach
	 * 2 s more (2,700 ms against 1,500, the review's probe_rev3_freeze). */
	sub_close(s->nc, sub, rc == KVR_ESHUTDOWN ? 0 : 500);
	natsInbox_Destroy(inbox);
	return rc;
}

static size_t t_pending(void *ctx)
{
	struct kvr_sync *s = ctx;
	int msgs = 0, bytes = 0;
	if (!s->stream_sub || natsSubscription_GetPending(s->stream_sub, &msgs, &bytes) != NATS_OK)
		return 0;
	return msgs > 0 ? (size_t)msgs : 0;
}

/* Waits at most limit_ms for the server to have what was sent, and only while connected.
 * nats.c wakes a flush when the connection drops, but one begun while it reconnects (the PING
 * kept for the next server) waits its whole timeout: a replica's first flush after the server
 * went down held its apply thread, and a detach joining it, for nats.c's 10 s default (CI,
 * test_sync_nats detach_down).  Slices of 50 ms bound what a drop between the check and the
 * PING costs. */
static void flush_while_connected(natsConnection *nc, int64_t limit_ms)
{
	for (int64_t spent = 0; spent < limit_ms; spent += 50) {
		if (natsConnection_Status(nc) != NATS_CONN_STATUS_CONNECTED ||
		    natsConnection_FlushTimeout(nc, 50) != NATS_TIMEOUT)
			return;
	}
}

static void t_ready(void *ctx)
{
	struct kvr_sync *s = ctx;
	if (natsConnection_QueueSubscribe(&s->snap_sub, s->nc, s->subj_snap, "kvr-snap", on_snapreq,
	                                  s) == NATS_OK)
		flush_while_connected(s->nc, 1000); /* a joiner's request finds us from now on */
}

/* Splits the comma-separated server list into natsOptions_SetServers. */
static natsStatus set_servers(natsOptions *o, const char *list)
{
	char buf[KVR_SYNC_SERVERS_LEN];
	const char *v[KVR_SYNC_SERVERS_MAX];
	int n = 0;
	if (strlen(list) >= sizeof(buf))
		return NATS_INVALID_ARG;
	strcpy(buf, list);
	for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && n < KVR_SYNC_SERVERS_MAX;
	     t = strtok_r(NULL, ",", &save)) {
		while (*t == ' ')
			t++;
		if (*t)
			v[n++] = t;
	}
	if (!n)
		return NATS_INVALID_ARG;
	return natsOptions_SetServers(o, v, n);
}

static void sync_free(struct kvr_sync *s)
{
	if (!s)
		return;
	kvr_replica_stop(s->rep);
	sigset_t sigs; /* nats.c's flush and close, as the attach's connect */
	kvr_thread_defer_signals(&sigs);
	/* The goodbye out before the close; not while reconnecting, where nothing can go and the
	 * flush waited its whole 500 ms (a detach with the server down took 501 ms, 1 now). */
	/* Unsubscribed before that flush, destroyed after it: a message the server sent before
	 * it read the unsubscription is read before the flush's PONG, and none comes after
	 * (nats.c 3.4.1's read loop can take one for a subscription being destroyed: sub_close). */
	natsSubscription *subs[] = {s->snap_sub, s->stream_sub, s->id_sub};
	for (size_t i = 0; s->nc && i < sizeof(subs) / sizeof(subs[0]); i++)
		if (subs[i])
			natsSubscription_Unsubscribe(subs[i]);
	if (s->nc)
		flush_while_connected(s->nc, 500);
	if (s->snap_sub)
		natsSubscription_Destroy(s->snap_sub);
	if (s->stream_sub)
		natsSubscription_Destroy(s->stream_sub);
	if (s->id_sub)
		natsSubscription_Destroy(s->id_sub);
	if (s->nc) {
		natsConnection_Close(s->nc);
		/* Bounded: a closed callback that never comes must not hang the caller. */
		uint64_t dl = kvr_rep_mono_ns() + 5000000000ull;
		pthread_mutex_lock(&s->mu);
		while (!s->closed && kvr_rep_wait_deadline(&s->cv, &s->mu, dl))
			;
		pthread_mutex_unlock(&s->mu);
		natsConnection_Destroy(s->nc);
	}
	kvr_thread_restore_signals(&sigs);
	kvr_replica_destroy(s->rep);
	pthread_cond_destroy(&s->cv);
	pthread_mutex_destroy(&s->mu);
	kvr_free(s, sizeof(*s));
}

/* Whether another connection holds C.id.N (our own does not hear itself: no echo).  Asked once
 * our subscription is on the server, so of two replicas attaching under one id at once each sees
 * the other (both are refused) rather than neither.  The server says "no responders" at once when
 * nobody holds it; a holder that does not answer within two tries of 1 s (a stopped process whose
 * connection the server has not dropped yet) holds it all the same.  A server without headers
 * cannot say "no responders": there silence is no holder. */
static natsStatus id_check(struct kvr_sync *s, bool *taken, bool *answered)
{
	*taken = *answered = false;
	for (int t = 0; t < 2; t++) {
		natsMsg *m = NULL;
		natsStatus st = natsConnection_Request(&m, s->nc, s->subj_id, "", 0, 1000);
		if (st == NATS_NO_RESPONDERS) {
			*taken = false; /* the holder that did not answer has gone */
			return NATS_OK;
		}
		if (st == NATS_TIMEOUT) {
			const char *why;
			if (natsConnection_GetLastError(s->nc, &why) == NATS_NOT_PERMITTED)
				return NATS_NOT_PERMITTED; /* the question itself was refused */
			*taken = natsConnection_HasHeaderSupport(s->nc) == NATS_OK;
			continue;
		}
		if (st != NATS_OK)
			return st;
		*taken = *answered = !natsMsg_IsNoResponders(m);
		natsMsg_Destroy(m);
		return NATS_OK;
	}
	return NATS_OK;
}

/* The servers, credentials and TLS of c: the replica's connection's, and the answer probe's. */
static natsStatus set_identity(natsOptions *o, const struct kvr_sync_config *c)
{
	natsStatus st = set_servers(o, c->servers);
	if (st == NATS_OK && (c->user || c->password))
		st = natsOptions_SetUserInfo(o, c->user, c->password);
	if (st == NATS_OK && c->token)
		st = natsOptions_SetToken(o, c->token);
	if (st == NATS_OK && c->creds_file)
		st = natsOptions_SetUserCredentialsFromFiles(o, c->creds_file, NULL);
	if (st == NATS_OK && c->tls)
		st = natsOptions_SetSecure(o, true);
	if (st == NATS_OK && c->tls_ca_file)
		st = natsOptions_LoadCATrustedCertificates(o, c->tls_ca_file);
	if (st == NATS_OK && (c->tls_cert_file || c->tls_key_file))
		st = natsOptions_LoadCertificatesChain(o, c->tls_cert_file, c->tls_key_file);
	return st;
}

#define PROBE_ANSWERS 2

/* Takes every message queued on sub (non-blocking); returns whether one had reply subject
 * `reply` (NULL: none looked for). */
static bool drain_queued(natsSubscription *sub, const char *reply)
{
	bool seen = false;
	uint64_t n = 0;
	/* At most what was queued when it began (and nats.c's 65,536 cap): a flood on the
	 * subject does not keep it here. */
	if (natsSubscription_QueuedMsgs(sub, &n) != NATS_OK)
		return false;
	for (uint64_t left = n; left > 0; left--) {
		natsMsg *m = NULL;
		if (natsSubscription_NextMsg(&m, sub, 1) != NATS_OK)
			break;
		const char *r = natsMsg_GetReply(m);
		seen |= reply && r && strcmp(r, reply) == 0;
		natsMsg_Destroy(m);
	}
	return seen;
}

/* Whether this user may answer what it is asked with more than one message, when it may not
 * publish on inboxes at will: a server's allow_responses permits a connection to publish on the
 * reply subject of a message it was delivered (up to its max, one by default), which is all a
 * replica needs if it lets a snapshot's chunks through.  A second connection of the same user
 * (ours has no echo: it cannot ask itself) takes our question on <cluster>.probe.<id> and
 * answers it with PROBE_ANSWERS messages; the server's verdict is its own: a refused answer is an
 * asynchronous -ERR that comes before its flush's PONG.  Before, the asker counted the answers it
 * received, so a third party answering on the probe's subject made up for the ones the server
 * refused, and a user under allow_responses: true (one message an ask) attached (test_sync_nats
 * auth).  Questions whose reply is not one of our inbox's are not answered.  The server renews a
 * reply's allowance each time it delivers a message with that reply, so a copy of our question
 * delivered between our answers (a third party republishing it) would let the second through:
 * copies already queued are dropped before we answer, and one queued by the flush's PONG (the
 * server delivered it before it read our PING, so maybe between the answers) leaves no verdict:
 * refused (a third party that copies our questions can keep a user from attaching, never let
 * one in).  The question is asked again every PROBE_REASK_MS with a new reply subject until it
 * arrives: the second connection's interest may reach our server over a route a moment after
 * its own server has it, and a third party's interest in the subject would hide that no one of
 * ours was there yet (a valid user refused 2 attaches of 200 on two servers).  One thread does
 * both sides (synchronous subscriptions): no callback outlives the check.  Returns NATS_OK,
 * NATS_NOT_PERMITTED, or what failed otherwise.  Only a user refused the plain probe pays for
 * it. */
#define PROBE_REASK_MS 20
static natsStatus answer_check(struct kvr_sync *s, const struct kvr_sync_config *c)
{
	natsOptions *o = NULL;
	natsConnection *nc = NULL;
	natsSubscription *sub = NULL, *inbox_sub = NULL;
	natsInbox *inbox = NULL;
	char subj[128], wild[160], reply[160];
	snprintf(subj, sizeof(subj), "%s.probe.%llu", c->cluster,
	         (unsigned long long)c->replica_id);
	natsStatus st = natsOptions_Create(&o);
	if (st == NATS_OK)
		st = set_identity(o, c);
	if (st == NATS_OK)
		st = natsOptions_SetTimeout(o, 2000);
	if (st == NATS_OK)
		st = natsOptions_SetAllowReconnect(o, false);
	if (st == NATS_OK)
		st = natsConnection_Connect(&nc, o);
	if (st == NATS_OK)
		kvr_nats_cloexec(nc);
	if (st == NATS_OK)
		st = natsConnection_SubscribeSync(&sub, nc, subj);
	if (st == NATS_OK)
		st = natsConnection_FlushTimeout(nc, 2000);
	const char *why;
	if (st == NATS_OK && natsConnection_GetLastError(nc, &why) == NATS_NOT_PERMITTED)
		st = NATS_NOT_PERMITTED; /* may not hear the probe's subject */
	if (st == NATS_OK)
		st = natsInbox_Create(&inbox);
	size_t plen = inbox ? strlen(inbox) + 1 : 0; /* "<inbox>." */
	if (st == NATS_OK) {
		snprintf(wild, sizeof(wild), "%s.*", inbox);
		st = natsConnection_SubscribeSync(&inbox_sub, s->nc, wild);
	}
	bool answered = false;
	uint64_t t0 = mono_ns(), end = t0 + 1000000000ull, next_ask = t0;
	for (unsigned k = 0; st == NATS_OK && !answered;) {
		uint64_t now = mono_ns();
		if (now >= end) {
			st = NATS_TIMEOUT;
			break;
		}
		if (now >= next_ask) {
			snprintf(reply, sizeof(reply), "%s.%u", inbox, k++);
			st = natsConnection_PublishRequest(s->nc, subj, reply, "", 0);
			next_ask = now + PROBE_REASK_MS * 1000000ull;
			drain_queued(inbox_sub, NULL); /* answers, "no responders": not looked at */
			continue;
		}
		natsMsg *q = NULL;
		natsStatus qs = natsSubscription_NextMsg(&q, sub, 5);
		if (qs == NATS_TIMEOUT)
			continue;
		if (qs != NATS_OK) {
			st = qs;
			break;
		}
		const char *r = natsMsg_GetReply(q);
		if (r && strlen(r) < sizeof(reply) && strncmp(r, wild, plen) == 0) {
			char mine[160];
			snprintf(mine, sizeof(mine), "%s", r);
			drain_queued(sub, NULL); /* copies so far renewed nothing yet to be used */
			for (int i = 0; st == NATS_OK && i < PROBE_ANSWERS; i++)
				st = natsConnection_Publish(nc, mine, "", 0);
			if (st == NATS_OK)
				st = natsConnection_FlushTimeout(nc, 2000);
			if (st == NATS_OK &&
			    natsConnection_GetLastError(nc, &why) == NATS_NOT_PERMITTED)
				st = NATS_NOT_PERMITTED;
			if (st == NATS_OK && drain_queued(sub, mine))
				st = NATS_NOT_PERMITTED; /* a copy may have renewed the allowance */
			/* One dropped past nats.c's queue bound (a flood on the subject) may have
			 * been such a copy: no verdict either. */
			int64_t dropped = 0;
			if (st == NATS_OK &&
			    (natsSubscription_GetDropped(sub, &dropped) != NATS_OK || dropped > 0))
				st = NATS_NOT_PERMITTED;
			answered = true;
		}
		natsMsg_Destroy(q);
	}
	if (st == NATS_TIMEOUT && !answered)
		st =
		    NATS_NOT_PERMITTED; /* the question never reached the user's other connection */
	sub_close(s->nc, inbox_sub, 500);
	natsInbox_Destroy(inbox);
	sub_close(nc, sub, 500);
	natsConnection_Destroy(nc);
	natsOptions_Destroy(o);
	return st;
}

/* Whether the server lets this user publish on a reply inbox (_INBOX.>): a replica answers its
 * peers' snapshot requests and id questions on the asker's inbox.  Refused, every peer that asks
 * it for a snapshot waits its whole snapshot_timeout_ms and is then ready without the table,
 * and only this side's denied counter says why.  A server's "allow_responses" does not permit
 * this probe (it is no answer to a request): answer_check then asks the way a peer would.  The
 * refusal, like a subscription's, is an asynchronous -ERR that comes before the flush's PONG. */
static natsStatus reply_check(struct kvr_sync *s)
{
	natsInbox *inbox = NULL;
	natsStatus st = natsInbox_Create(&inbox);
	if (st == NATS_OK)
		st = natsConnection_Publish(s->nc, inbox, NULL, 0); /* nobody listens there */
	if (st == NATS_OK)
		st = natsConnection_FlushTimeout(s->nc, 2000);
	natsInbox_Destroy(inbox);
	const char *why;
	if (st == NATS_OK && natsConnection_GetLastError(s->nc, &why) == NATS_NOT_PERMITTED)
		st = NATS_NOT_PERMITTED;
	return st;
}

/* Whether the process is out of file descriptors (its RLIMIT_NOFILE, or the system's): nats.c
 * reports a socket it could not open as "No server available for connection", which read as a
 * server that was down (KVR_ETIMEDOUT). */
static bool fds_exhausted(void)
{
	int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		close(fd);
		return false;
	}
	return errno == EMFILE || errno == ENFILE;
}

int kvr_sync_attach(struct kvr_router *r, const struct kvr_sync_config *c, struct kvr_sync **out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (out)
		*out = NULL; /* on every failure, as kvr_router_create and sync/replica_none.c */
	static const char fn[] = "kvr_sync_attach";
	if (!r || !c || !out)
		return kvr_fail(KVR_EINVAL, "%s: %s is NULL", fn,
		                !r   ? "router"
		                : !c ? "config"
		                     : "out");
	int ret = kvr_sync_config_check(c, fn);
	if (ret)
		return ret;
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "%s: %s", fn, kvr_router_gone(r));
	/* Before connecting: a second attach of one router under its own id would otherwise meet
	 * its first in the id check (KVR_EEXIST) instead of being told it is attached already
	 * (kvr_replica_start's check below stays for two attaches at once). */
	if (__atomic_load_n(&r->repl, __ATOMIC_ACQUIRE))
		return kvr_fail(KVR_EBUSY, "%s: the router has a replica attached already", fn);
	struct kvr_sync *s = kvr_calloc(1, sizeof(*s));
	if (!s)
		return kvr_fail(KVR_ENOMEM, "%s: out of memory for the replica handle", fn);
	pthread_mutex_init(&s->mu, NULL);
	kvr_cond_init(&s->cv);
	snprintf(s->subj_stream, sizeof(s->subj_stream), "%s.stream", c->cluster);
	snprintf(s->subj_snap, sizeof(s->subj_snap), "%s.snap", c->cluster);
	snprintf(s->subj_id, sizeof(s->subj_id), "%s.id.%llu", c->cluster,
	         (unsigned long long)c->replica_id);
	struct kvr_replica_config rc = {
	    .replica_id = c->replica_id,
	    .heartbeat_ms = c->heartbeat_ms,
	    .dead_after = c->dead_after,
	    .snapshot_timeout_ms = c->snapshot_timeout_ms ? c->snapshot_timeout_ms : 2000,
	    .journal_blocks = c->journal_blocks,
	    .kept_bytes_max = c->kept_bytes_max,
	};
	struct kvr_replica_transport t = {
	    .ctx = s,
	    .publish = t_publish,
	    .reply = t_reply,
	    .request = t_request,
	    .ready = t_ready,
	    .pending = t_pending,
	};
	ret = kvr_replica_create(r, &rc, &t, &s->rep);
	if (ret) {
		pthread_cond_destroy(&s->cv);
		pthread_mutex_destroy(&s->mu);
		kvr_free(s, sizeof(*s));
		if (ret == KVR_ENOMEM)
			return kvr_fail(
			    ret, "%s: out of memory, or a replica thread could not start", fn);
		return kvr_fail_code(ret, fn);
	}
	/* nats.c's connect, subscribe and flush block in I/O on this thread, and nats.c takes an
	 * EINTR there for a broken connection: under a profiler's SIGPROF, 18 of 20 attaches failed
	 * with "IO Error" or "Protocol Error" (docs/measurements.md).  The caller's asynchronous
	 * signals wait until they are done (their 2 s timeouts: kvrouter.h gives the bound), and
	 * the threads nats.c starts meanwhile (its library threads at the first natsOptions_Create,
	 * then the connection's) inherit the blocked mask, as the library's own do (sync/thread.h:
	 * a process-directed signal must not land on them). */
	sigset_t sigs;
	kvr_thread_defer_signals(&sigs);
	natsOptions *o = NULL;
	char name[64];
	snprintf(name, sizeof(name), "kvr-%s-%llu", c->cluster, (unsigned long long)c->replica_id);
	natsStatus st = natsOptions_Create(&o);
	if (st == NATS_OK)
		st = natsOptions_SetName(o, name);
	if (st == NATS_OK)
		st = natsOptions_SetNoEcho(o, true);
	if (st == NATS_OK)
		st = natsOptions_SetMaxReconnect(o, -1);
	if (st == NATS_OK)
		st = natsOptions_SetReconnectWait(o, 100);
	if (st == NATS_OK)
		st = natsOptions_SetPingInterval(o, 1000);
	if (st == NATS_OK)
		st = natsOptions_SetMaxPingsOut(o, 2);
	if (st == NATS_OK)
		st = natsOptions_SetTimeout(o, 2000);
	/* Send as soon as published: every publish comes from the replica's own threads (the
	 * sender, the apply thread), never from a routing thread, so the write belongs there.  By
	 * default nats.c hands writes to its flusher thread, which first waits 1 ms "to accumulate
	 * more requests" (nats.c conn.c _flusher): 1 ms added to every propagation.  The 1 MiB
	 * buffer still holds what is published while reconnecting. */
	if (st == NATS_OK)
		st = natsOptions_SetIOBufSize(o, 1 << 20);
	if (st == NATS_OK)
		st = natsOptions_SetSendAsap(o, true);
	if (st == NATS_OK)
		st = natsOptions_SetDisconnectedCB(o, on_disconnected, s);
	if (st == NATS_OK)
		st = natsOptions_SetReconnectedCB(o, on_reconnected, s);
	if (st == NATS_OK)
		st = natsOptions_SetClosedCB(o, on_closed, s);
	if (st == NATS_OK)
		st = natsOptions_SetErrorHandler(o, on_error, s);
	if (st == NATS_OK)
		st = set_identity(o, c);
	if (st != NATS_OK) {
		natsOptions_Destroy(o);
		kvr_thread_restore_signals(&sigs);
		sync_free(s);
		if (st == NATS_NO_MEMORY)
			return kvr_fail(KVR_ENOMEM, "%s: out of memory setting up the NATS options",
			                fn);
		return kvr_fail(KVR_EINVAL,
		                "%s: NATS refused the options (servers \"%s\", credentials or TLS "
		                "files): %s",
		                fn, c->servers, natsStatus_GetText(st));
	}
	st = natsConnection_Connect(&s->nc, o);
	natsOptions_Destroy(o);
	bool connected = st == NATS_OK;
	if (connected) {
		kvr_nats_cloexec(s->nc); /* before a program the host spawns can inherit it */
		kvr_replica_set_max_msg(s->rep, max_payload(s->nc));
	}
	if (st == NATS_OK)
		st = natsConnection_Subscribe(&s->id_sub, s->nc, s->subj_id, on_idreq, NULL);
	if (st == NATS_OK)
		st = natsConnection_Subscribe(&s->stream_sub, s->nc, s->subj_stream, on_stream, s);
	if (st == NATS_OK)
		natsSubscription_SetPendingLimits(s->stream_sub, 1 << 22, 1 << 30);
	if (st == NATS_OK)
		st = natsConnection_FlushTimeout(s->nc, 2000); /* the server has our subscription */
	/* The server refuses a subscription it does not permit with an asynchronous -ERR, which
	 * comes before the flush's PONG; nats.c keeps it as the connection's last error.  A
	 * replica that cannot hear the stream would run deaf. */
	const char *why = NULL;
	if (st == NATS_OK && natsConnection_GetLastError(s->nc, &why) == NATS_NOT_PERMITTED)
		st = NATS_NOT_PERMITTED;
	bool taken = false, answered = false;
	if (st == NATS_OK && (st = id_check(s, &taken, &answered)) == NATS_NOT_PERMITTED)
		natsConnection_GetLastError(s->nc, &why); /* the id question's refusal */
	if (st == NATS_OK && !taken && (st = reply_check(s)) == NATS_NOT_PERMITTED) {
		natsConnection_GetLastError(s->nc, &why); /* a reply's refusal */
		/* allow_responses lets answers through (NATS_OK), or not; anything else (a server
		 * that did not answer a flush, no memory) is told as itself, not as a refusal. */
		natsStatus ac = answer_check(s, c);
		if (ac != NATS_NOT_PERMITTED)
			st = ac;
	}
	kvr_thread_restore_signals(&sigs);
	if (!connected) {
		s->nc = NULL;
		sync_free(s);
		if (st == NATS_NO_MEMORY)
			return kvr_fail(KVR_ENOMEM, "%s: out of memory connecting to NATS", fn);
		if (fds_exhausted())
			return kvr_fail(
			    KVR_ENOMEM,
			    "%s: too many open file descriptors (the process's "
			    "RLIMIT_NOFILE, or the system's): the NATS connection needs one",
			    fn);
		/* The server answered and refused us: retrying the same config will not help, so
		 * not KVR_ETIMEDOUT ("no server reachable"). */
		if (st == NATS_CONNECTION_AUTH_FAILED || st == NATS_NOT_PERMITTED)
			return kvr_fail(KVR_EINVAL,
			                "%s: NATS servers \"%s\" refused the credentials (config "
			                "user, password, token or creds_file): %s",
			                fn, c->servers, natsStatus_GetText(st));
		if (st == NATS_SECURE_CONNECTION_WANTED || st == NATS_SECURE_CONNECTION_REQUIRED ||
		    st == NATS_SSL_ERROR)
			return kvr_fail(KVR_EINVAL,
			                "%s: TLS with NATS servers \"%s\" failed (config tls, "
			                "tls_ca_file, tls_cert_file, tls_key_file): %s",
			                fn, c->servers, natsStatus_GetText(st));
		return kvr_fail(KVR_ETIMEDOUT, "%s: could not connect to NATS servers \"%s\": %s",
		                fn, c->servers, natsStatus_GetText(st));
	}
	if (st == NATS_NOT_PERMITTED) {
		char detail[256];
		snprintf(detail, sizeof(detail), "%s", why ? why : natsStatus_GetText(st));
		sync_free(s);
		return kvr_fail(KVR_EINVAL,
		                "%s: the NATS server does not permit this user what a replica of "
		                "cluster \"%s\" needs (publish and subscribe %s.> and _INBOX.>, or "
		                "allow_responses with more than one response): %s",
		                fn, c->cluster, c->cluster, detail);
	}
	if (st != NATS_OK) {
		sync_free(s);
		return kvr_fail(KVR_ETIMEDOUT, "%s: subscribing to \"%s.stream\" on NATS: %s", fn,
		                c->cluster, natsStatus_GetText(st));
	}
	if (taken) {
		sync_free(s);
		return kvr_fail(KVR_EEXIST,
		                "%s: replica id %llu is in use in cluster \"%s\" (%s): ids must be "
		                "unique in a cluster",
		                fn, (unsigned long long)c->replica_id, c->cluster,
		                answered
		                    ? "a replica attached under it answered"
		                    : "a connection holds its subject and did not answer in 2 s");
	}
	if ((ret = kvr_replica_start(s->rep))) {
		sync_free(s);
		if (ret == KVR_EBUSY)
			return kvr_fail(ret,
			                "%s: the router has a replica attached already (or the "
			                "replica's threads could not start)",
			                fn);
		return kvr_fail_code(ret, fn);
	}
	*out = s;
	return 0;
}

struct kvr_replica *kvr_sync_replica(struct kvr_sync *s)
{
	return s ? s->rep : NULL;
}

/* Whether s was attached before this process forked (core/fork.h): its connection's and
 * apply threads stayed in the parent. */
static bool inherited(const struct kvr_sync *s)
{
	return s && s->rep->r && kvr_fork_inherited(s->rep->r);
}

/* kvr_router_destroy ran first (kvrouter.h allows it: it stopped the replica's use of the
 * router, which left rep->r NULL): only kvr_sync_detach may follow.  Before, every call on s
 * then read the NULL router (kvr_fork_inherited) and crashed, kvr_sync_detach included. */
static __attribute__((cold, noinline)) int sync_router_gone(const char *fn)
{
	return kvr_fail(KVR_ESHUTDOWN,
	                "%s: the replica's router was destroyed (only kvr_sync_detach, which "
	                "disconnects and frees, may follow)",
	                fn);
}

/* The detail of a call on such a replica. */
static __attribute__((cold, noinline)) int sync_inherited(const char *fn)
{
	return kvr_fail(
	    KVR_ESHUTDOWN,
	    "%s: the replica was attached before this process forked (its threads "
	    "stayed in the parent): a forked child creates its own router and attaches it",
	    fn);
}

void kvr_sync_detach(struct kvr_sync *s)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (inherited(s))
		return; /* left as it is, as its router is */
	/* From a router callback the replica's apply thread or nats.c's subscription thread runs
	 * (on_admit): closing the connection and joining the apply thread would wait for the very
	 * call that runs the callback.  kvrouter.h: it does nothing there. */
	if (s && kvr_replica_handling(s->rep))
		return;
	/* From a feed's callback while a replica thread waits in a call on that feed: joining it
	 * would wait for good, so nothing is done (kvrouter.h); else that thread's calls on the
	 * feed are refused until the replica is down (kvr_feed_wait_replica_begin). */
	if (s && kvr_feed_wait_replica_begin(s->rep))
		return;
	sync_free(s);
	kvr_feed_wait_replica_end();
}

/* The detail of a wait that failed (core/error.h). */
static __attribute__((cold, noinline)) int wait_fail(const struct kvr_sync *s, int rc,
                                                     const char *fn, uint32_t timeout_ms)
{
	if (rc == KVR_ETIMEDOUT)
		return kvr_fail(rc, "%s: not done within timeout_ms %" PRIu32, fn, timeout_ms);
	if (rc == KVR_EBUSY && kvr_replica_handling(s->rep))
		return kvr_fail(rc,
		                "%s: called from a router callback the replica's own thread runs, "
		                "which this wait would wait for",
		                fn);
	if (rc == KVR_EBUSY) /* kvr_feed_wait_replica_begin refused it (sync/feed.c) */
		return kvr_fail(
		    rc,
		    "%s: called from a feed's callback while the replica's thread waits "
		    "in a call on that feed (or on another feed whose callback waits for "
		    "this one), which waits for this callback to return",
		    fn);
	return kvr_fail_code(rc, fn);
}

int kvr_sync_wait_ready(struct kvr_sync *s, uint32_t timeout_ms)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!s)
		return kvr_fail(KVR_EINVAL, "kvr_sync_wait_ready: s is NULL");
	if (inherited(s))
		return sync_inherited("kvr_sync_wait_ready");
	if (!s->rep->r)
		return sync_router_gone("kvr_sync_wait_ready");
	int rc = kvr_replica_wait_ready(s->rep, timeout_ms);
	return rc ? wait_fail(s, rc, "kvr_sync_wait_ready", timeout_ms) : 0;
}

int kvr_sync_drain(struct kvr_sync *s, uint32_t timeout_ms)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!s)
		return kvr_fail(KVR_EINVAL, "kvr_sync_drain: s is NULL");
	if (inherited(s))
		return sync_inherited("kvr_sync_drain");
	if (!s->rep->r)
		return sync_router_gone("kvr_sync_drain");
	int rc = kvr_replica_drain(s->rep, timeout_ms);
	return rc ? wait_fail(s, rc, "kvr_sync_drain", timeout_ms) : 0;
}

int kvr_sync_get_stats(struct kvr_sync *s, struct kvr_sync_stats *out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!s || !out)
		return kvr_fail(KVR_EINVAL, "kvr_sync_get_stats: %s is NULL", !s ? "s" : "out");
	if (inherited(s))
		return sync_inherited("kvr_sync_get_stats");
	if (!s->rep->r)
		return sync_router_gone("kvr_sync_get_stats");
	kvr_replica_get_stats(s->rep, out);
	return 0;
}

int kvr_sync_peer_seq(struct kvr_sync *s, uint64_t replica_id, uint64_t *seq)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!s || !seq)
		return kvr_fail(KVR_EINVAL, "kvr_sync_peer_seq: %s is NULL", !s ? "s" : "seq");
	if (inherited(s))
		return sync_inherited("kvr_sync_peer_seq");
	if (!s->rep->r)
		return sync_router_gone("kvr_sync_peer_seq");
	int rc = kvr_replica_peer_seq(s->rep, replica_id, seq);
	if (rc == KVR_ENOENT)
		return kvr_fail(rc, "kvr_sync_peer_seq: replica %" PRIu64 " is not a live peer",
		                replica_id);
	return rc ? kvr_fail_code(rc, "kvr_sync_peer_seq") : 0;
}
