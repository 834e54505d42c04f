#!/bin/bash
# perf/offcpu.sh - why did a thread not run?  Records the scheduler's switches and wake-ups
# (tracefs, clock mono: aligns with bench_sync's "phase 2 began at CLOCK_MONOTONIC") around a
# command, then prints every interval of at least MS ms in which a thread whose name matches
# NAMES was off its CPU: the state it left in (S: asleep, waiting for a wake-up; R: runnable,
# preempted; D: uninterruptible), whether any CPU was idle meanwhile (a runnable thread with an
# idle CPU, or a sleeper with its work queued, would be our bug: a lost or late wake-up), and
# who had the CPUs (other processes on a shared machine show up here, which a per-process
# `perf record` cannot show).  Lighter than `perf record -e sched:sched_switch -g` (no stacks).
# Needs root (tracefs).  Keeps the raw trace in OUT.trace.
# usage: perf/offcpu.sh [-n NAMES (comma-separated, default A:shard,B:shard)] [-m MS (20)]
#                       [-o OUT (/tmp/offcpu)] -- COMMAND...
# e.g.   perf/offcpu.sh -- build/perf/bench_sync --stages --rate 5000 --seconds 8
set -e
names=A:shard,B:shard ms=20 out=/tmp/offcpu
while [ $# -gt 0 ]; do
	case $1 in
	-n) names=$2; shift 2 ;;
	-m) ms=$2; shift 2 ;;
	-o) out=$2; shift 2 ;;
	--) shift; break ;;
	*) break ;;
	esac
done
T=/sys/kernel/tracing
[ -w $T/tracing_on ] || { echo "offcpu.sh: $T not writable (root?)" >&2; exit 77; }
old_kb=$(sed 's/ .*//' $T/buffer_size_kb)
old_clock=$(sed 's/.*\[\(.*\)\].*/\1/' $T/trace_clock) # the selected one is in brackets
restore() {
	echo 0 > $T/tracing_on; echo 0 > $T/events/enable; echo > $T/trace
	echo "$old_kb" > $T/buffer_size_kb
	echo "$old_clock" > $T/trace_clock
}
trap restore EXIT
echo 0 > $T/tracing_on; echo > $T/trace; echo 65536 > $T/buffer_size_kb; echo mono > $T/trace_clock
echo 0 > $T/events/enable
echo 1 > $T/events/sched/sched_switch/enable
echo 1 > $T/events/sched/sched_wakeup/enable
echo 1 > $T/tracing_on
rc=0
"$@" || rc=$?
echo 0 > $T/tracing_on
cat $T/trace > "$out.trace"
grep -q 'LOST\|overrun' "$out.trace" && echo "offcpu.sh: the trace lost events" >&2
python3 - "$out.trace" "$names" "$ms" <<'EOF'
import collections, re, sys
path, names, ms = sys.argv[1], set(sys.argv[2].split(',')), float(sys.argv[3]) / 1e3
sw = re.compile(r'^\s*.*?-\d+\s+\[(\d+)\]\s+\S+\s+([\d.]+): sched_switch: prev_comm=(.*?) '
                r'prev_pid=(\d+) .*prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)')
off = {}       # pid -> (since, state, name)
cur = {}       # cpu -> (since, "comm:pid")
hist = collections.deque()  # (cpu, start, end, who): who ran where, the last WINDOW s
WINDOW = 1.0
n = 0
for line in open(path):
    m = sw.match(line)
    if not m:
        continue
    cpu, t = int(m.group(1)), float(m.group(2))
    pc, pp, st, nc, np = m.group(3), int(m.group(4)), m.group(5), m.group(6), int(m.group(7))
    if cpu in cur:
        hist.append((cpu, cur[cpu][0], t, cur[cpu][1]))
        while hist[0][2] < t - WINDOW:
            hist.popleft()
    cur[cpu] = (t, 'idle' if np == 0 else f'{nc}:{np}')
    if pc in names:
        off[pp] = (t, st, pc)
    if nc in names and np in off:
        t0, st0, name = off.pop(np)
        if t - t0 < ms:
            continue
        n += 1
        who = collections.Counter()
        for c, a, b, w in hist:
            if b > t0 and a < t:
                who[w] += min(b, t) - max(a, t0)
        idle = who.pop('idle', 0.0)
        top = ', '.join(f'{w} {v * 1e3:.0f}' for w, v in who.most_common(4))
        note = f' (the last {WINDOW:.0f} s)' if t - t0 > WINDOW else ''
        print(f'{name}:{np} off {(t - t0) * 1e3:6.1f} ms from {t0:.6f} state {st0} '
              f'idle_cpu_ms {idle * 1e3:.1f}{note} ran: {top}')
print(f'offcpu: {n} intervals of at least {ms * 1e3:.0f} ms off the CPU for {sorted(names)}')
EOF
exit $rc
