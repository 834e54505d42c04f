#!/usr/bin/python3
"""Writes the seed corpus of fuzz_feed: vLLM KV event payloads in both wire forms, encoded with
python3-msgpack the way vLLM's msgspec encoder lays them out.  usage: make_feed_corpus.py DIR"""
import os
import sys

import msgpack

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
H = [2**64 - 1, 2**63, 12345, 2**63 + 17]
TOK = list(range(64))


def w(name, obj):
    with open(os.path.join(out, name), "wb") as f:
        f.write(msgpack.packb(obj, use_bin_type=True))


def stored_map(hashes, parent, toks, bs=16, medium="GPU", lora=None, **extra):
    d = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": toks, "block_size": bs, "lora_id": None, "medium": medium,
         "lora_name": lora}
    d.update(extra)
    return d


w("map_stored.mp", {"ts": 1.5, "events": [stored_map(H, None, TOK)], "data_parallel_rank": 0})
w("map_mixed.mp", {"ts": 2.0, "data_parallel_rank": 3, "events": [
    stored_map(H[:2], 7, TOK[:32], lora="adapter-a", group_idx=1, extra_keys=[None, ["x", 1]]),
    {"block_hashes": [H[0]], "medium": "CPU", "type": "BlockRemoved"},
    {"type": "AllBlocksCleared"},
    {"type": "SomethingNew", "x": [1, 2, {"y": b"z"}]}]})
w("map_bin_hashes.mp", {"ts": 3.0, "events": [
    stored_map([bytes(range(32)), bytes(range(16))], bytes(32), TOK[:32])]})
w("array_legacy_v0.mp", [1.0, [["BlockStored", H[:2], None, TOK[:32], 16, None],
                               ["BlockRemoved", [H[0]]], ["AllBlocksCleared"]]])
w("array_legacy_dp.mp", [1.0, [["BlockStored", H, 99, TOK, 16, 5, "GPU", "lora-x", None, 0],
                               ["BlockRemoved", H[:1], "GPU", 0]], 2])
w("array_cpu.mp", [1.0, [["BlockStored", H[:1], None, TOK[:16], 16, None, "CPU", None]], None])
w("negative_hash.mp", [0.5, [["BlockStored", [-1, -2**63], None, TOK[:32], 16, None]], 0])
w("empty_events.mp", [0.0, [], 0])
with open(os.path.join(out, "truncated.mp"), "wb") as f:
    f.write(msgpack.packb([1.0, [["BlockStored", H, None, TOK, 16, None]], 0])[:-9])
