#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_replica_apply (tests/fuzz/corpus/replica_apply): sequences of
deliveries and snapshots from peers, in the target's framing (a config byte, then frames
[kind u8][len u16 LE][bytes], an odd kind a snapshot).  The messages are the wire format of
sync/replica_msg.h (version 2), built with make_replica_corpus.py's helpers: a peer's rank,
admissions with output, prefill done, finish and abort; a batch; a gap; a heartbeat ahead of the
stream; a reset; a goodbye; a new life of the peer; a snapshot with a live attempt and a ghost;
a snapshot declined by a provider that resyncs itself, then one served."""
import os, struct, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_replica_corpus import admit, chunk, given_up, msg  # noqa: E402

def frame(data, snapshot=False, fail=None):
    """A frame; fail=N: handled with its Nth allocation failed (N >= 1)."""
    kind = (1 if snapshot else 0) | (2 | (fail - 1) << 2 if fail else 0)
    return struct.pack('<BH', kind, len(data)) + data

def rank(op=1, worker=5, seq=1, replica=7, inc=1, cap=400):
    return msg(6, struct.pack('<IIQIIQQ', op, 8192, worker, 0, 0, inc, cap), replica=replica, seq=seq)

def rank_v(op, clock, worker=5, seq=1, replica=7, inc=1, cap=400, writer=7):
    """A versioned RANK (flags bit0): the change's version is (clock, writer)."""
    return msg(6, struct.pack('<IIQIIQQQQ', op, 8192, worker, 0, 1, inc, cap, clock, writer),
               replica=replica, seq=seq)

def simple(t, attempt, seq, replica=7):
    return msg(t, struct.pack('<Q', attempt), replica=replica, seq=seq)

def output(attempt, n, seq, flags=0, replica=7):
    return msg(2, struct.pack('<QII', attempt, n, flags) + b''.join(struct.pack('<I', 7 + i) for i in range(n)),
               replica=replica, seq=seq)

def heartbeat(seq, live, replica=7):
    return msg(7, struct.pack('<Q', live), replica=replica, seq=seq)

def fence(replica, epoch, seq):
    return msg(13, struct.pack('<QQQ', replica, epoch, seq), seq=0)

A, B = 0x10001, 0x10002
seeds = {
    'lifecycle': [rank(seq=1), admit(seq=2, attempt=A), output(A, 20, 3, 1), simple(3, A, 4),
                  output(A, 300, 5), simple(4, A, 6)],
    'two_peers': [admit(seq=1, attempt=A), admit(seq=1, attempt=A, replica=8, worker=1),
                  output(A, 40, 2, 1, replica=8), simple(5, A, 2), heartbeat(9, 1, replica=8)],
    'batch': [admit(seq=1, attempt=A) + admit(seq=2, attempt=B, base=0x2222) + output(B, 17, 3, 1)
              + simple(4, A, 4)],
    'gap_and_reset': [admit(seq=1, attempt=A), admit(seq=5, attempt=B), msg(9, b'', seq=6),
                      admit(12, 3, 4, 0, 5, seq=7, attempt=B)],
    'heartbeat_ahead': [admit(seq=1, attempt=A), heartbeat(3, 1)],
    'goodbye': [admit(seq=1, attempt=A), output(A, 9, 2, 1), msg(8, b'', seq=2)],
    'new_life': [admit(seq=1, attempt=A), struct.pack('<B', 0)],
    'rank_changes': [rank(seq=1, worker=9), admit(seq=2, attempt=A, worker=9),
                     rank(op=3, worker=9, seq=3, cap=2), rank(op=4, worker=9, seq=4, inc=2),
                     rank(op=2, worker=9, seq=5)],
    # versioned: a removal, the older add told again (ignored), a reset told twice, a re-add
    'rank_versions': [rank_v(1, 10, worker=9, seq=1), rank_v(2, 30, worker=9, seq=2),
                      rank_v(1, 20, worker=9, seq=3), rank_v(1, 40, worker=9, seq=4, inc=2),
                      rank_v(4, 50, worker=9, seq=5, inc=2), rank_v(4, 50, worker=9, seq=6, inc=2),
                      (chunk([fence(7, 99, 6), rank_v(2, 60, worker=9)]), True)],
    'snapshot': [(chunk([fence(7, 99, 3), rank(), admit(12, 7, 2, 1, 3, attempt=B),
                         admit(12, 3, 4, 0, 5, attempt=A)]), True), simple(4, A, 4)],
    # declined (given up, flags bit3: the provider resyncs itself), then served
    'snapshot_declined': [(given_up(8), True),
                          (chunk([fence(7, 99, 3), rank(), admit(12, 3, 4, 0, 5, attempt=A)]), True),
                          simple(4, A, 4)],
}

def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), 'corpus', 'replica_apply')
    os.makedirs(out, exist_ok=True)
    for name, frames in seeds.items():
        for config in (0, 1):  # posted and synchronous booking
            data = bytes([config])
            for f in frames:
                if isinstance(f, tuple):
                    data += frame(f[0], True)
                elif len(f) == 1:  # a new life: the next admission under another epoch
                    data += frame(msg(1, admit(seq=1, attempt=B)[32:], epoch=100, seq=1))
                else:
                    data += frame(f)
            with open(os.path.join(out, '%s_%d' % (name, config)), 'wb') as fh:
                fh.write(data)
    # Allocation failures while output is applied (the mirror's record, the router's copy)
    # and while a snapshot is applied.
    for n in (1, 2, 3, 5):
        data = bytes([1]) + frame(admit(seq=1, attempt=A)) + frame(output(A, 300, 2, 1), fail=n)
        data += frame(output(A, 5, 3)) + frame(simple(4, A, 4))
        with open(os.path.join(out, 'output_oom_%d' % n), 'wb') as fh:
            fh.write(data)
    snap = chunk([fence(7, 99, 3), rank(), admit(12, 3, 4, 0, 300, attempt=A)])
    for n in (1, 3, 6):
        with open(os.path.join(out, 'snapshot_oom_%d' % n), 'wb') as fh:
            fh.write(bytes([0]) + frame(snap, True, fail=n) + frame(simple(4, A, 4)))

if __name__ == '__main__':
    main()
