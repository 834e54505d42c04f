#!/usr/bin/env python3
"""Compares two policies' decisions in a kvr-replay --decisions FILE (tools/replay/decisions.h).

  usage: decisions.py FILE [POLICY_A [POLICY_B]]   (default approx_lru+feedback,
                                                    approx_lru+watermark)

Per seed in the file: each policy's cached prompt blocks on the rank chosen (its own requests),
the gap A - B in points of the prompt blocks, the three requests that contribute most to it and
the gap without them, and how many requests differ at all; then, per policy, the blocks its
healing reports evicted and how many of them the engine still held (evicted wrongly)."""
import sys


def main():
    path = sys.argv[1]
    a = sys.argv[2] if len(sys.argv) > 2 else "approx_lru+feedback"
    b = sys.argv[3] if len(sys.argv) > 3 else "approx_lru+watermark"
    dec = {}  # seed -> request -> policy -> (cached on chosen rank, prompt blocks)
    healed = {}  # (seed, policy) -> [reports, evicted, still held]
    with open(path) as f:
        for line in f:
            w = line.split()
            if w[0] == "R":
                pol, seed, req, rank = w[1], w[2], int(w[3]), int(w[4])
                parts = line.split("|")
                eng = [int(x) for x in parts[1].split()]
                dec.setdefault(seed, {}).setdefault(req, {})[pol] = (eng[rank], int(parts[3]))
            elif w[0] == "H":
                h = healed.setdefault((w[2], w[1]), [0, 0, 0])
                h[0] += 1
                h[1] += int(w[5])
                h[2] += int(w[6])
    for seed in sorted(dec, key=int):
        both = [v for v in dec[seed].values() if a in v and b in v]
        if not both:
            continue
        prompt = sum(v[a][1] for v in both)
        d = sorted(((v[a][0] - v[b][0]) for v in both), key=lambda x: -abs(x))
        gap = sum(d)
        print("seed %s: cached blocks %s %d, %s %d; gap %+.2f points of %d prompt blocks; "
              "top 3 requests %s; without them %+.2f points; %d of %d requests differ" %
              (seed, a, sum(v[a][0] for v in both), b, sum(v[b][0] for v in both),
               100.0 * gap / prompt, prompt, d[:3], 100.0 * sum(d[3:]) / prompt,
               sum(1 for x in d if x), len(d)))
        for pol in (a, b):
            h = healed.get((seed, pol))
            if h:
                print("  %s: %d healing reports evicted %d predicted blocks, %d (%.2f %%) of "
                      "them still in the engine" %
                      (pol, h[0], h[1], h[2], 100.0 * h[2] / h[1] if h[1] else 0))


if __name__ == "__main__":
    main()
