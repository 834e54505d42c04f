#!/usr/bin/python3
"""A KV event publisher that puts on the wire exactly what vLLM's ZmqEventPublisher
(vllm/distributed/kv_events.py) does, driven line by line from stdin (JSON commands, one JSON
reply line each) by tests/feed/test_feed.c.

Wire: PUB frames [topic, seq (8 bytes big-endian, from 0), msgpack payload]; a ROUTER replay
socket answers [client, "", start_seq] with [client, "", seq, payload] per buffered batch with
seq >= start_seq, then [client, "", -1 (8 bytes), ""].  Payload: the batch as a map
{ts, events, data_parallel_rank} with events as tagged maps {"type": ..., fields} (current vLLM,
omit_defaults), or as arrays [ts, events, dp] with events as tagged arrays (legacy array_like).

One deviation that changes nothing on the wire: the socket is an XPUB instead of a PUB, so the
test can wait until the subscriber is connected instead of sleeping ("wait_sub").

Commands: start {endpoint, replay?, topic?, buffer?} -> {endpoint, replay}; publish {form, events,
dp?, drop?, ts?} -> {seq}; raw {frames: [hex...]} -> {}; wait_sub {timeout_ms} -> {ok};
stop -> {}; exit.
Events: {"t": "stored", hashes: [int | hex string for a bin digest], parent, tokens, bs, lora_id?,
lora_name?, medium?} | {"t": "removed", hashes, medium?} | {"t": "cleared"} | {"t": "other"}.
"""
import json
import sys
import time
from collections import deque

import msgpack
import zmq

ctx = zmq.Context.instance()
pub = None
rep = None
topic = b""
seq = 0
buf = deque(maxlen=10000)


def h(x):
    return bytes.fromhex(x) if isinstance(x, str) else x


def ev_map(e):
    t = e["t"]
    if t == "stored":
        d = {"type": "BlockStored", "block_hashes": [h(x) for x in e["hashes"]],
             "parent_block_hash": h(e.get("parent")), "token_ids": e["tokens"],
             "block_size": e["bs"], "lora_id": e.get("lora_id"),
             "medium": e.get("medium", "GPU"), "lora_name": e.get("lora_name")}
        if "group_idx" in e:
            d["group_idx"] = e["group_idx"]
        return d
    if t == "removed":
        return {"type": "BlockRemoved", "block_hashes": [h(x) for x in e["hashes"]],
                "medium": e.get("medium", "GPU")}
    if t == "cleared":
        return {"type": "AllBlocksCleared"}
    return {"type": "BlockPinned", "block_hashes": [1, 2, 3], "why": "a type vLLM may add"}


def ev_array(e):
    t = e["t"]
    if t == "stored":
        a = ["BlockStored", [h(x) for x in e["hashes"]], h(e.get("parent")), e["tokens"],
             e["bs"], e.get("lora_id")]
        if e.get("legacy_short"):
            return a  # the oldest form: no medium, no lora_name
        return a + [e.get("medium", "GPU"), e.get("lora_name")]
    if t == "removed":
        return ["BlockRemoved", [h(x) for x in e["hashes"]], e.get("medium", "GPU")]
    if t == "cleared":
        return ["AllBlocksCleared"]
    return ["BlockPinned", [1, 2, 3]]


def service_replay():
    while rep is not None and rep.poll(0):
        frames = rep.recv_multipart()
        if len(frames) != 3:
            continue
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for s, payload in buf:
            if s >= start:
                rep.send_multipart((client, b"", s.to_bytes(8, "big"), payload))
        rep.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))


def bind(sock, endpoint):
    # A restart rebinds the address just closed: the close completes asynchronously.
    for _ in range(200):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.01)
    sock.bind(endpoint)


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def handle(cmd):
    global pub, rep, topic, seq, buf
    op = cmd["op"]
    if op == "start":
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(100000)
        bind(pub, cmd["endpoint"])
        out = {"endpoint": pub.getsockopt(zmq.LAST_ENDPOINT).decode()}
        if cmd.get("replay"):
            rep = ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            bind(rep, cmd["replay"])
            out["replay"] = rep.getsockopt(zmq.LAST_ENDPOINT).decode()
        topic = cmd.get("topic", "").encode()
        seq = 0
        buf = deque(maxlen=cmd.get("buffer", 10000))
        return out
    if op == "wait_sub":
        deadline = time.time() + cmd.get("timeout_ms", 5000) / 1000
        while time.time() < deadline:
            if pub.poll(20):
                msg = pub.recv()
                if msg[:1] == b"\x01":
                    return {"ok": True}
            service_replay()
        return {"ok": False}
    if op == "publish":
        events = cmd["events"]
        dp = cmd.get("dp", 0)
        ts = cmd.get("ts", time.time())
        if cmd.get("form", "map") == "map":
            batch = {"ts": ts, "events": [ev_map(e) for e in events], "data_parallel_rank": dp}
        else:
            batch = [ts, [ev_array(e) for e in events], dp]
        payload = msgpack.packb(batch, use_bin_type=True)
        s = seq
        seq += 1
        if not cmd.get("drop"):
            pub.send_multipart((topic, s.to_bytes(8, "big"), payload))
        buf.append((s, payload))
        return {"seq": s}
    if op == "raw":
        pub.send_multipart([bytes.fromhex(x) for x in cmd["frames"]])
        return {}
    if op == "stop":
        pub.close(0)
        pub = None
        if rep is not None:
            rep.close(0)
            rep = None
        return {}
    raise ValueError(op)


def main():
    poller = zmq.Poller()
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    while True:
        if rep is not None:
            poller.register(rep, zmq.POLLIN)
        ready = dict(poller.poll(1000))
        if rep is not None:
            poller.unregister(rep)
        service_replay()
        if sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                return
            reply(handle(cmd))


if __name__ == "__main__":
    main()
