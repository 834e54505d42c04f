#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_replica_msg (tests/fuzz/corpus/replica): one valid message of
every type of the replica sync wire format (sync/replica_msg.h, version 2), a batch (version 2
stream messages back to back), the output finality flags (OUTPUT bit0, ATTEMPT bit3), plus a few
broken ones (an unknown and the old version 1, a truncated message and batch, an unknown OUTPUT
flag, ATTEMPT bit3 without output), and versioned RANKs (flags bit0: clock and writer follow),
valid and not (the flag without the version, the version without the flag), a snapshot chunk
with its provider's rank floor (flags bit2), a given-up chunk with and without why (flags bit3,
resyncing: valid only with given up), and a snapshot request that wants a settled table (bit1)."""
import os, struct, sys

def msg(t, body, replica=7, epoch=99, seq=1, version=2):
    return struct.pack('<HBBIQQQ', 0x534b, version, t, len(body), replica, epoch, seq) + body

def admit(t=1, flags=1, n=3, tail=2, nout=0, seq=1, attempt=0x10001, worker=5, replica=7, base=0x1111,
          prompt=None):
    """An ADMIT (t=1) or ATTEMPT (t=12); prompt_tokens defaults to n blocks of 16 tokens and the
    tail, as a peer with the fuzz router's block size sends (one of another size is not booked)."""
    if prompt is None:
        prompt = n * 16 + tail
    body = struct.pack('<QIIQQQQIIIIII', worker, 0, flags, 1, attempt, prompt, 1337, 1, 64, n, tail, nout, 0)
    body += b''.join(struct.pack('<Q', base * (i + 1)) for i in range(n))
    body += b''.join(struct.pack('<I', 40 + i) for i in range(tail))
    body += b''.join(struct.pack('<I', 90 + i) for i in range(nout))
    return msg(t, body, replica=replica, seq=seq)

def chunk(recs, floor=None, more=0):
    """A SNAP_CHUNK (the last) holding the records recs; with floor (clock, writer), flags bit2
    and the provider's rank floor before the records; more: other flags."""
    flags = 1 | (4 if floor else 0) | more
    body = struct.pack('<IIII', 0, flags, len(recs), 0)
    if floor:
        body += struct.pack('<QQ', *floor)
    body += b''.join(struct.pack('<I', len(r)) + r for r in recs)
    return msg(11, body, seq=0)

def given_up(why=0):
    """A given-up SNAP_CHUNK (flags bit1), with why (bit3 resyncing) or not: no records."""
    return msg(11, struct.pack('<IIII', 0, 2 | why, 0, 0), seq=0)

def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), 'corpus', 'replica')
    os.makedirs(out, exist_ok=True)

    fence = msg(13, struct.pack('<QQQ', 3, 4, 5), seq=0)
    rank = msg(6, struct.pack('<IIQIIQQ', 1, 8192, 5, 0, 0, 1, 400))
    rank_v = msg(6, struct.pack('<IIQIIQQQQ', 2, 8192, 5, 0, 1, 1, 400, 1700000000000000000, 7))
    recs = [admit(12, 7, 2, 1, 3), rank, rank_v, fence]
    seeds = {
        'admit': admit(),
        'attempt': admit(12, 3, 4, 0, 5),
        'ghost': admit(12, 7, 2, 1, 3),
        'output': msg(2, struct.pack('<QII', 0x10001, 3, 0) + struct.pack('<III', 1, 2, 3)),
        # OUTPUT flags bit0: the last token is not final (kvr_request_output_ex); bit1 is unknown
        'output_not_final': msg(2, struct.pack('<QII', 0x10001, 3, 1) + struct.pack('<III', 1, 2, 3)),
        'output_bad_flags': msg(2, struct.pack('<QII', 0x10001, 3, 2) + struct.pack('<III', 1, 2, 3)),
        # ATTEMPT flags bit3: the last output token's slot is counted (only with output)
        'attempt_out_counted': admit(12, 11, 4, 0, 5),
        'attempt_out_counted_no_out': admit(12, 11, 4, 0, 0),
        'prefill': msg(3, struct.pack('<Q', 0x10001)),
        'finish': msg(4, struct.pack('<Q', 0x10001)),
        'abort': msg(5, struct.pack('<Q', 0x10001)),
        'rank': rank,
        # RANK flags bit0: versioned, (clock, writer) after the fixed part
        'rank_versioned': rank_v,
        'rank_flag_no_version': msg(6, struct.pack('<IIQIIQQ', 1, 8192, 5, 0, 1, 1, 400)),
        'rank_version_no_flag': msg(6, struct.pack('<IIQIIQQQQ', 1, 8192, 5, 0, 0, 1, 400, 9, 7)),
        'heartbeat': msg(7, struct.pack('<Q', 12), seq=40),
        'goodbye': msg(8, b''),
        'reset': msg(9, b''),
        'snapreq': msg(10, struct.pack('<Q', 0), seq=0),
        'chunk': chunk(recs),
        # SNAP_CHUNK flags bit2: the provider's rank floor (clock, writer) before the records
        'chunk_floor': chunk(recs, (1700000000000000000, 7)),
        # SNAP_CHUNK flags bit1 given up; bit3: because the provider resyncs itself (only
        # with given up); SNAP_REQ bit1: the asker wants a provider that is not resyncing
        'chunk_given_up': given_up(),
        'chunk_given_up_resyncing': given_up(8),
        'chunk_resyncing_not_given_up': chunk(recs, more=8),
        'snapreq_settled': msg(10, struct.pack('<Q', 3), seq=0),
        'fence': fence,
        'bad_version': msg(4, struct.pack('<Q', 1), version=3),
        'old_version': msg(4, struct.pack('<Q', 1), version=1),
        'batch': admit() + msg(4, struct.pack('<Q', 0x10001), seq=2) + msg(7, struct.pack('<Q', 1), seq=2),
        'batch_truncated': (admit() + msg(4, struct.pack('<Q', 0x10001), seq=2))[:-3],
        'batch_old_version': admit() + msg(4, struct.pack('<Q', 0x10001), seq=2, version=1),
        'truncated': admit()[:-5],
        'garbage': bytes(range(64)),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), 'wb') as f:
            f.write(data)

if __name__ == '__main__':
    main()
