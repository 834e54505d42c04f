#!/usr/bin/env python3
"""Writes a synthetic Mooncake-format trace with hot prefixes, for kvr-replay tuning sweeps.

Most requests start with one of a few long shared system prompts (hot prefixes, skewed
popularity), followed by a prompt of their own; the rest share nothing.  A cache-greedy router
sends every request of the hottest prefix to the one rank that holds it: this is the workload
where overlap_credit and temperature trade hit rate against load balance (tools/replay/TUNING.md).

Deterministic: the same arguments give the same file.  Block size 512 tokens (Mooncake's).

usage: gen_hot_prefix.py [--requests N] [--rate R/s] [--seed S] > hot.jsonl
"""
import argparse
import json
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefixes", type=int, default=4, help="hot system prompts")
    ap.add_argument("--prefix-blocks", type=int, default=8, help="blocks of 512 tokens each")
    ap.add_argument("--shared", type=float, default=0.85, help="share of requests with one")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    weights = [1.0 / (k + 1) ** 1.2 for k in range(a.prefixes)]  # Zipf-like popularity
    next_id = a.prefixes * a.prefix_blocks
    t = 0.0
    for _ in range(a.requests):
        t += rng.expovariate(a.rate)
        ids = []
        if rng.random() < a.shared:
            k = rng.choices(range(a.prefixes), weights)[0]
            ids = list(range(k * a.prefix_blocks, (k + 1) * a.prefix_blocks))
        own = rng.randint(1, 6)
        ids += list(range(next_id, next_id + own))
        next_id += own
        tokens = len(ids) * 512 - rng.randint(0, 511)
        print(json.dumps({"timestamp": int(t * 1000), "input_length": tokens,
                          "output_length": rng.randint(50, 400), "hash_ids": ids}))


if __name__ == "__main__":
    main()
