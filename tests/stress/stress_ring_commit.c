/*
 * stress_ring_commit: sync/ring.h's kvr_ring_commit_nowait (the lanes' commit) and
 * kvr_ring_commit_or_tag (the replica sender's) never wait for another producer.
 *
 * 1. Held reservation: a slot reserved and not yet committed (a producer descheduled between
 *    its reserve and its commit) must not stall a later producer's commit (the ordered commit
 *    spun and then yielded until the earlier one committed: two frontends on one core made a
 *    convoy of it, docs/measurements.md "Finish tails with two frontends").  A second thread
 *    commits behind the held slot and must return within 2 s; the consumer sees nothing until
 *    the held slot commits, then both in ticket order; the held slot's commit, which publishes
 *    the tagged one, returns the wake level the tagger left (sync/ring.h: the wake a tagged slot
 *    needs), and the tagger's returns none.
 * 2. Racing commits: P producer threads post numbered messages, a third of them pausing between
 *    reserve and commit (sched_yield, or a 20-50 us sleep), while one consumer drains.  Every
 *    message must arrive exactly once, each producer's in order, with its length and fields
 *    intact, and none may stay behind p_tail once the producers are done (the helping commits'
 *    store-buffering pair: a lost race would leave a published slot unconsumed).
 * Both parts run twice: with the lanes' kvr_ring_commit_nowait, then with the replica sender's
 * kvr_ring_commit_or_tag, whose consumer passes the tagged slots (kvr_ring_pass_tagged: in part
 * 1 once the held slot is taken, in part 2 whenever the ring looks empty and after the producers
 * are done).  An ordered commit (ck's, waiting for p_tail; the lanes' before lifetail) fails part 1
 * (it waits the 2 s).
 * argv[1] = duration of part 2 in ms, both runs (default 1500).  Exit 0 pass, 1 fail.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sync/ring.h"
#include "tests/common/mono_clock.h"

#define P 4
#ifndef CAP
#define CAP 64 /* small: wraps often, so lap tags are exercised */
#endif

static struct kvr_ring ring;
static int stop;
/* The commit tested: 0 kvr_ring_commit_nowait, 1 kvr_ring_commit_or_tag (the replica sender's,
 * whose tagged slots the consumer passes).  Written between the runs only. */
static int or_tag;
static int failures;

static void fail(const char *what)
{
	if (__atomic_fetch_add(&failures, 1, __ATOMIC_RELAXED) < 5)
		fprintf(stderr, "stress_ring_commit: %s\n", what);
}

/* ------------------------------------------------------------------ 1: held reservation */

static int later_done;

static void *later_producer(void *arg)
{
	(void)arg;
	uint32_t v = 2, ticket;
	struct kvr_msg *slot = kvr_ring_reserve(&ring, &ticket);
	if (!slot) {
		fail("held: the later post found the ring full");
		return NULL;
	}
	kvr_ring_write(slot, NULL, &v, sizeof(v), 2);
	/* Left tagged with the most urgent wake level: the held commit must report it. */
	if (or_tag)
		kvr_ring_commit_or_tag(&ring, ticket);
	else if (kvr_ring_commit_nowait(&ring, ticket, KVR_RING_WAKE_MAX) != 0)
		fail("held: a commit that published no other slot reported a wake");
	__atomic_store_n(&later_done, 1, __ATOMIC_RELEASE);
	return NULL;
}

static void held_reservation(void)
{
	if (kvr_ring_init(&ring, CAP)) {
		fail("held: init");
		return;
	}
	__atomic_store_n(&later_done, 0, __ATOMIC_RELAXED);
	uint32_t ticket;
	struct kvr_msg *slot = kvr_ring_reserve(&ring, &ticket);
	if (!slot) {
		fail("held: reserve");
		return;
	}
	pthread_t th;
	pthread_create(&th, NULL, later_producer, NULL);
	uint64_t t0 = mono_ns();
	while (!__atomic_load_n(&later_done, __ATOMIC_ACQUIRE) && mono_ns() - t0 < 2000000000ull)
		sched_yield();
	if (!__atomic_load_n(&later_done, __ATOMIC_ACQUIRE)) {
		/* The ordered commit: it waits for us.  Commit, so it can return and be joined. */
		fail("held: a commit behind a held reservation waited for it (2 s)");
	}
	struct kvr_msg m;
	if (__atomic_load_n(&later_done, __ATOMIC_ACQUIRE) && kvr_ring_dequeue(&ring, &m))
		fail("held: the consumer took a message past the unpublished slot");
	uint32_t v = 1;
	kvr_ring_write(slot, NULL, &v, sizeof(v), 1);
	uint32_t woke = KVR_RING_WAKE_MAX;
	if (or_tag)
		kvr_ring_commit_or_tag(&ring, ticket); /* publishes its own slot only */
	else
		woke = kvr_ring_commit_nowait(&ring, ticket, 0);
	pthread_join(th, NULL);
	if (__atomic_load_n(&later_done, __ATOMIC_ACQUIRE) && woke != KVR_RING_WAKE_MAX)
		fail("held: the commit that published a tagged slot did not report its wake");
	for (uint32_t want = 1; want <= 2; want++) {
		/* The tagged slot is the consumer's to pass (kvr_ring_commit_or_tag). */
		if (want == 2 && or_tag && !kvr_ring_depth(&ring) &&
		    kvr_ring_pass_tagged(&ring) != 1)
			fail("held: the consumer found no tagged slot to pass");
		if (!kvr_ring_dequeue(&ring, &m)) {
			fail("held: a committed message is missing");
			break;
		}
		memcpy(&v, m.payload, sizeof(v));
		if (m.aux != want || v != want || m.len != sizeof(v))
			fail("held: messages out of ticket order or damaged");
	}
	if (kvr_ring_dequeue(&ring, &m) || kvr_ring_depth(&ring))
		fail("held: the ring is not empty at the end");
	kvr_ring_fini(&ring);
}

/* ------------------------------------------------------------------ 2: racing commits */

struct item {
	uint32_t producer, seq;
	unsigned char fill[40];
};

static uint64_t sent[P];

static void *producer(void *arg)
{
	uint32_t p = (uint32_t)(uintptr_t)arg;
	uint64_t s = 0x9e3779b97f4a7c15ull * (p + 1);
	uint32_t seq = 0;
	while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		uint32_t ticket;
		struct kvr_msg *slot = kvr_ring_reserve(&ring, &ticket);
		if (!slot) {
			sched_yield();
			continue;
		}
		struct item it = {.producer = p, .seq = seq};
		memset(it.fill, (int)(seq & 0xff), sizeof(it.fill));
		uint32_t len = 8 + (uint32_t)(s % 41); /* 8..48: every length the tag sits above */
		kvr_ring_write(slot, (void (*)(void))(uintptr_t)(p + 1), &it, len, ~seq);
		switch (s % 64) {
		case 0 ... 15:
			sched_yield(); /* descheduled between reserve and commit */
			break;
		case 16:
		case 17: {
			struct timespec ts = {0, 20000 + (long)(s % 30000)};
			nanosleep(&ts, NULL);
			break;
		}
		default:
			break;
		}
		/* Every wake level, so the bits above the tag travel with it (the lengths are
		 * checked intact at the consumer). */
		if (or_tag)
			kvr_ring_commit_or_tag(&ring, ticket);
		else
			kvr_ring_commit_nowait(&ring, ticket,
			                       (uint32_t)(s >> 32) & KVR_RING_WAKE_MAX);
		seq++;
	}
	__atomic_store_n(&sent[p], seq, __ATOMIC_RELEASE);
	return NULL;
}

static uint64_t got[P];
static int64_t last[P];

static bool take_one(void)
{
	struct kvr_msg b[16];
	uint32_t n = kvr_ring_dequeue_burst(&ring, b, 16);
	if (!n && or_tag && kvr_ring_pass_tagged(&ring))
		n = kvr_ring_dequeue_burst(&ring, b, 16);
	for (uint32_t i = 0; i < n; i++) {
		struct item it = {0};
		memcpy(&it, b[i].payload, b[i].len < sizeof(it) ? b[i].len : sizeof(it));
		uint32_t p = it.producer;
		if (b[i].len < 8 || b[i].len > 48 || p >= P ||
		    (uintptr_t)b[i].fn != (uintptr_t)(p + 1) || b[i].aux != ~it.seq) {
			fail("race: a message's fields or length were damaged");
			continue;
		}
		if ((int64_t)it.seq != last[p] + 1)
			fail("race: a producer's messages out of order (or lost, or twice)");
		for (uint32_t k = 0; k + 8 < b[i].len; k++)
			if (it.fill[k] != (unsigned char)(it.seq & 0xff)) {
				fail("race: payload damaged");
				break;
			}
		last[p] = it.seq;
		got[p]++;
	}
	return n > 0;
}

static void racing_commits(uint64_t ms)
{
	if (kvr_ring_init(&ring, CAP)) {
		fail("race: init");
		return;
	}
	__atomic_store_n(&stop, 0, __ATOMIC_RELAXED);
	for (int p = 0; p < P; p++) {
		last[p] = -1;
		got[p] = 0;
		sent[p] = 0;
	}
	pthread_t th[P];
	for (int p = 0; p < P; p++)
		pthread_create(&th[p], NULL, producer, (void *)(uintptr_t)p);
	uint64_t end = mono_ns() + ms * 1000000ull;
	while (mono_ns() < end)
		if (!take_one())
			sched_yield();
	__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	for (int p = 0; p < P; p++)
		pthread_join(th[p], NULL);
	/* Every producer is done: whatever is left is published and p_tail must be past it. */
	while (take_one())
		;
	if (kvr_ring_depth(&ring) || !kvr_ring_unreserved(&ring))
		fail("race: published messages left behind p_tail");
	uint64_t total = 0;
	for (int p = 0; p < P; p++) {
		total += got[p];
		if (got[p] != __atomic_load_n(&sent[p], __ATOMIC_ACQUIRE)) {
			fprintf(stderr, "producer %d: sent %llu, received %llu\n", p,
			        (unsigned long long)sent[p], (unsigned long long)got[p]);
			fail("race: a message was lost or delivered twice");
		}
	}
	printf("stress_ring_commit: %s: %llu messages from %d producers, capacity %d\n",
	       or_tag ? "commit_or_tag" : "commit_nowait", (unsigned long long)total, P, CAP);
	kvr_ring_fini(&ring);
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 1500;
	held_reservation();
	if (!failures)
		racing_commits(ms / 2);
	or_tag = 1;
	if (!failures)
		held_reservation();
	if (!failures)
		racing_commits(ms - ms / 2);
	if (failures) {
		fprintf(stderr, "stress_ring_commit: FAIL (%d)\n", failures);
		return 1;
	}
	printf("stress_ring_commit: pass\n");
	return 0;
}
