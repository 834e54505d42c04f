#!/usr/bin/env python3
"""Keeps README.md true to the code (meson test readme_excerpts).

usage: check_excerpts.py SOURCE_ROOT [BUILD_ROOT]

1. Every ```c block of README.md is an excerpt of a program in examples/ that the suite builds
   and runs: the line right above the fence names it, `<!-- excerpt: examples/basic.c -->`, and
   the file's regions between `/* README.md excerpt */` and `/* README.md excerpt end */` lines,
   read in order, each without the indentation its lines share, are the block line for line
   (trailing blanks ignored).  A C block without the marker fails too, so no snippet goes
   untested.
2. Every repository path README.md names in code (`core/route.c`, `tests/fuzz/corpus/trace`,
   globs) or links to exists.
3. Every program README.md runs from the build directory (`build/perf/bench_route ...`, or
   `kvr-replay ...` by its name) exists in BUILD_ROOT, and every --flag given to it is spelled
   in its binary (the string the program compares its arguments with).  Programs of a part not
   built (-Dperf=false), and missing ones in a build without -Dzmq or -Dnats, are skipped.

Exit 0 when all holds, 1 with one line per problem otherwise.
"""
import difflib
import glob
import json
import os
import re
import sys

EXCERPT_MARK = re.compile(r"^<!-- excerpt: (\S+) -->$")
REGION_BEGIN = "/* README.md excerpt */"
REGION_END = "/* README.md excerpt end */"
# First components of the repository paths worth checking (what a reader would open).
REPO_DIRS = ("core", "shards", "sync", "tests", "perf", "tools", "data", "docs", "examples",
             ".ci")
# Where the build puts the programs README.md runs by name.
PROGRAM_DIRS = ("perf", "tools", "tools/replay", "tests")

problems = []


def problem(line, text):
    problems.append("README.md:%d: %s" % (line, text))


def dedent(lines):
    """The lines without the leading whitespace all their non-blank lines share."""
    body = [l for l in lines if l.strip()]
    if not body:
        return ["" for _ in lines]
    prefix = os.path.commonprefix([re.match(r"[ \t]*", l).group(0) for l in body])
    return [l[len(prefix):].rstrip() if l.strip() else "" for l in lines]


def regions(path):
    """The marked regions of an example file, concatenated, each dedented; None if none."""
    out, cur, found = [], None, False
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f.read().split("\n"), 1):
            s = raw.strip()
            if s == REGION_BEGIN:
                if cur is not None:
                    problems.append("%s:%d: region begins inside a region" % (path, n))
                cur, found = [], True
            elif s == REGION_END:
                if cur is None:
                    problems.append("%s:%d: region end without a begin" % (path, n))
                else:
                    out += dedent(cur)
                cur = None
            elif cur is not None:
                cur.append(raw)
    if cur is not None:
        problems.append("%s: a region is not closed" % path)
    return out if found else None


def parse_readme(text):
    """Fenced blocks (lang, first line number, lines, marker) and prose lines (number, text)."""
    blocks, prose = [], []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            start = i + 1
            j = start
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            prev = lines[i - 1] if i > 0 else ""
            mark = EXCERPT_MARK.match(prev.strip())
            blocks.append((m.group(1), start + 1, lines[start:j], mark.group(1) if mark else None))
            i = j + 1
            continue
        prose.append((i + 1, lines[i]))
        i += 1
    return blocks, prose


def check_excerpts(root, blocks):
    used = {}
    for lang, line, body, mark in blocks:
        if lang != "c":
            continue
        if not mark:
            problem(line - 1, "a C block without an <!-- excerpt: examples/FILE.c --> marker "
                    "above it (every C block is an excerpt of a tested example)")
            continue
        if mark in used:
            problem(line - 1, "%s is already the excerpt of the block at line %d" %
                    (mark, used[mark]))
            continue
        used[mark] = line
        path = os.path.join(root, mark)
        if not os.path.isfile(path):
            problem(line - 1, "excerpt file %s does not exist" % mark)
            continue
        got = regions(path)
        if got is None:
            problem(line - 1, "%s has no /* README.md excerpt */ region" % mark)
            continue
        want = [l.rstrip() for l in body]
        if got != want:
            diff = difflib.unified_diff(want, got, "README.md (line %d)" % line,
                                        mark + " (its regions)", lineterm="", n=1)
            problem(line, "the C block differs from %s:\n%s" % (mark, "\n".join(diff)))
    for path in sorted(glob.glob(os.path.join(root, "examples", "*.c"))):
        rel = os.path.relpath(path, root)
        if rel not in used and regions(path) is not None:
            problems.append("%s: has README.md excerpt regions but no README.md block names it"
                            % rel)


def code_spans(line):
    return re.findall(r"`([^`]+)`", line)


def check_paths(root, blocks, prose):
    def check(line, token):
        token = token.strip("\"'(),;:.")
        if token.startswith("./"):
            token = token[2:]
        first = token.split("/")[0]
        if "/" not in token or first not in REPO_DIRS:
            return
        if not glob.glob(os.path.join(root, token)):
            problem(line, "no such path in the repository: %s" % token)

    for n, text in prose:
        for span in code_spans(text):
            for tok in span.split():
                check(n, tok)
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" not in target:
                check(n, target)
    for lang, line, body, _ in blocks:
        if lang in ("sh", "c"):
            for k, text in enumerate(body):
                if lang == "sh":
                    text = text.split("#")[0]
                    if text.startswith("ninja "):
                        continue  # its arguments are build targets, not repository paths
                for tok in text.split():
                    check(line + k, tok)


def programs(build):
    """name -> path of every executable in the build's program directories."""
    found = {}
    for d in PROGRAM_DIRS:
        full = os.path.join(build, d)
        if not os.path.isdir(full):
            continue
        for name in os.listdir(full):
            p = os.path.join(full, name)
            if os.path.isfile(p) and os.access(p, os.X_OK) and not name.endswith(".so"):
                found.setdefault(name, p)
    return found


def all_features_on(build):
    """Whether the build has the optional parts (-Dzmq, -Dnats) that some programs need."""
    try:
        with open(os.path.join(build, "meson-info", "intro-buildoptions.json")) as f:
            opts = {o["name"]: o["value"] for o in json.load(f)}
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return all(opts.get(name, "enabled") == "enabled" for name in ("zmq", "nats"))


def check_commands(build, blocks, prose):
    progs = programs(build)
    binaries = {}
    # Without -Dzmq or -Dnats some programs are not built: their absence is not README's fault.
    strict = all_features_on(build)

    def spelled(path, flag):
        if path not in binaries:
            with open(path, "rb") as f:
                binaries[path] = f.read()
        data = binaries[path]
        name = flag.split("=")[0]
        return name.encode() in data or (name[2:].encode() + b"\0") in data

    def check_command(line, text):
        tokens = text.split()
        prog = None
        for tok in tokens:
            if tok in ("&&", "||", "|", ";", "--"):
                prog = None
                continue
            t = tok[2:] if tok.startswith("./") else tok
            if t.startswith("build/") and not t.endswith("/"):
                rel = t[len("build/"):]
                part = rel.split("/")[0]
                path = os.path.join(build, rel)
                if "/" in rel and not os.path.isdir(os.path.join(build, part)):
                    prog = None  # a part this build leaves out (-Dperf=false)
                    continue
                if not os.path.exists(path):
                    if strict:
                        problem(line, "no such file in the build: %s" % t)
                    prog = None
                    continue
                prog = path if os.access(path, os.X_OK) and os.path.isfile(path) else None
                continue
            if tok in progs and prog is None:
                prog = progs[tok]
                continue
            if prog and re.match(r"^--[a-z][a-z0-9-]*(=.*)?$", tok):
                if not spelled(prog, tok):
                    problem(line, "%s takes no %s" % (os.path.relpath(prog, build), tok))

    for lang, line, body, _ in blocks:
        if lang != "sh":
            continue
        joined, first = "", None
        for k, text in enumerate(body):
            text = text.split(" #")[0] if not text.startswith("#") else ""
            if first is None:
                first = line + k
            if text.rstrip().endswith("\\"):
                joined += text.rstrip()[:-1] + " "
                continue
            check_command(first, joined + text)
            joined, first = "", None
    for n, text in prose:
        for span in code_spans(text):
            check_command(n, span)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        blocks, prose = parse_readme(f.read())
    check_excerpts(root, blocks)
    check_paths(root, blocks, prose)
    if len(sys.argv) > 2:
        check_commands(sys.argv[2], blocks, prose)
    for p in problems:
        print(p)
    if problems:
        print("check_excerpts: %d problems" % len(problems))
        return 1
    print("check_excerpts: README.md agrees with examples/ and the build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
