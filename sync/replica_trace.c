/*
 * sync/replica_trace.c - the stage stamp table of sync/replica_trace.h.  Relaxed atomics: the
 * stamps of one attempt are written by several threads (router, sender, NATS, apply) and read
 * by the benchmark after it drained the traffic; a torn view only ever costs one sample.
 */
#include <time.h>

#include "sync/replica_trace.h"

uint64_t kvr_rep_trace_origin;
struct kvr_rep_trace_slot kvr_rep_trace[KVR_REP_TRACE_SLOTS];

/* Attempt ids are not dense (they carry a slot and a generation), so slots are found by a
 * mixed hash and linear probing; the first stamp (NOTE) claims a free slot.  A full probe
 * window drops the sample. */
#define PROBES 64

static struct kvr_rep_trace_slot *find(uint64_t attempt, bool claim)
{
	uint64_t key = attempt + 1, h = key * 0x9e3779b97f4a7c15ull;
	for (uint32_t i = 0; i < PROBES; i++) {
		struct kvr_rep_trace_slot *sl =
		    &kvr_rep_trace[((h >> 40) + i) % KVR_REP_TRACE_SLOTS];
		uint64_t k = __atomic_load_n(&sl->attempt, __ATOMIC_ACQUIRE);
		if (k == key)
			return sl;
		if (k == 0) {
			if (!claim)
				return NULL;
			if (__atomic_compare_exchange_n(&sl->attempt, &k, key, false,
			                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) ||
			    k == key)
				return sl;
		}
	}
	return NULL;
}

void kvr_rep_trace_stamp(uint64_t attempt, enum kvr_rep_stage s, uint64_t t_ns)
{
	if (!t_ns) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		t_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	}
	struct kvr_rep_trace_slot *sl = find(attempt, s == KVR_TR_NOTE);
	if (sl)
		__atomic_store_n(&sl->t[s], t_ns, __ATOMIC_RELAXED);
}

int kvr_rep_trace_get(uint64_t attempt, uint64_t t[KVR_TR_N])
{
	const struct kvr_rep_trace_slot *sl = find(attempt, false);
	if (!sl)
		return -1;
	for (int i = 0; i < KVR_TR_N; i++)
		t[i] = __atomic_load_n(&sl->t[i], __ATOMIC_RELAXED);
	return 0;
}
