/*
 * sync/replica_trace.h - stage timestamps of sampled admissions on their way from one replica
 * to another (issue 14's propagation target), for perf/bench_sync --stages.
 *
 * Off by default: every stamp point costs one relaxed load of kvr_rep_trace_origin and a
 * branch.  A benchmark sets kvr_rep_trace_origin to the replica id it follows; the stamps of
 * that origin's admissions are then written into a table keyed by the origin's attempt id
 * (KVR_REP_TRACE_SLOTS slots, never recycled: a benchmark traces fewer attempts than that in
 * one process's life).  Replicas in one process share the table, which
 * is what a loopback benchmark needs; across processes each sees only its own stages.
 */
#ifndef KVR_SYNC_REPLICA_TRACE_H
#define KVR_SYNC_REPLICA_TRACE_H

#include <stdbool.h>
#include <stdint.h>

enum kvr_rep_stage {
	KVR_TR_NOTE,     /* origin: the routing thread pushed the note into the sender ring */
	KVR_TR_POP,      /* origin: the sender thread dequeued it */
	KVR_TR_ENCODED,  /* origin: the sender encoded it, about to publish */
	KVR_TR_RECEIVED, /* peer: the NATS subscription callback got it */
	KVR_TR_HANDLE,   /* peer: the apply thread began handling it */
	KVR_TR_POSTED,   /* peer: kvr_repl_admit returned (booking posted to the shard) */
	KVR_TR_N
};

#define KVR_REP_TRACE_SLOTS 65536

struct kvr_rep_trace_slot {
	uint64_t attempt; /* origin attempt + 1 of the stamps below (0: none) */
	uint64_t t[KVR_TR_N];
};

/* The origin replica id being traced (0: tracing off).  Context: set before traffic. */
extern uint64_t kvr_rep_trace_origin;
extern struct kvr_rep_trace_slot kvr_rep_trace[KVR_REP_TRACE_SLOTS];

/* Whether origin's admissions are traced.  Context: any thread. */
static inline bool kvr_rep_tracing(uint64_t origin)
{
	uint64_t o = __atomic_load_n(&kvr_rep_trace_origin, __ATOMIC_RELAXED);
	return __builtin_expect(o != 0, 0) && o == origin;
}

/* Stamps stage s of attempt with t_ns (CLOCK_MONOTONIC; 0: now).  Call only when
 * kvr_rep_tracing(origin).  Context: any thread. */
void kvr_rep_trace_stamp(uint64_t attempt, enum kvr_rep_stage s, uint64_t t_ns);

/* Reads slot attempt's stamps into t[KVR_TR_N]; returns 0, or -1 if they are another
 * attempt's.  Context: after the traced traffic has been drained. */
int kvr_rep_trace_get(uint64_t attempt, uint64_t t[KVR_TR_N]);

#endif
