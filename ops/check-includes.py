#!/usr/bin/env python3
"""Check that the module include graph of each directory is a DAG.

A module is x.c plus x.h (either may be missing), plus x_internal.h, the
module's private header (its structures, for its own files and the few that
are part of it, e.g. store_internal.h for store*.c). Module A depends on module
B when any of A's files has `#include "b.h"` and b.h is in the same directory
(system headers and other directories' headers are not modules here). A cycle
means two modules cannot be understood, tested or replaced one without the
other (docs/architecture.md).

    ops/check-includes.py [DIR ...]        (default: daemon policies)
    ops/check-includes.py --self-test      (the checker finds a planted cycle)

Exits 0 when every directory is acyclic; otherwise prints each cycle found,
as `a -> b -> a` with the include lines that make each edge, and exits 1.
Python 3 standard library only: CI runs it as the ctest test
`lint/include-dag`.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def module_of(name):
    """The module a file name belongs to: x for x.c, x.h and x_internal.h."""
    stem = os.path.splitext(name)[0]
    return stem[: -len("_internal")] if stem.endswith("_internal") else stem


def modules(directory):
    """{module: [file names]} for the .c and .h files of `directory`."""
    out = {}
    for name in sorted(os.listdir(directory)):
        ext = os.path.splitext(name)[1]
        if ext in (".c", ".h") and os.path.isfile(os.path.join(directory, name)):
            out.setdefault(module_of(name), []).append(name)
    return out


def edges(directory, mods):
    """{module: {dependency: "file:line"}} from the quoted includes."""
    graph = {m: {} for m in mods}
    for mod, files in mods.items():
        for name in files:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if m is None:
                        continue
                    target = m.group(1)
                    if "/" in target or not target.endswith(".h"):
                        continue
                    dep = module_of(target)
                    if dep in mods and dep != mod:
                        graph[mod].setdefault(dep, "%s:%d" % (name, lineno))
    return graph


def cycles(graph):
    """The cycles a depth-first search meets (at least one if there is any)."""
    found, seen = [], set()
    state = {m: 0 for m in graph}  # 0 new, 1 on the stack, 2 done
    stack = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state[dep] == 1:
                cyc = stack[stack.index(dep):] + [dep]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    found.append(cyc)
            elif state[dep] == 0:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m)
    return found


def check(directory):
    mods = modules(directory)
    graph = edges(directory, mods)
    found = cycles(graph)
    for cyc in found:
        print("%s: include cycle: %s" % (directory, " -> ".join(cyc)))
        for a, b in zip(cyc, cyc[1:]):
            print("    %s -> %s  (%s/%s)" % (a, b, directory, graph[a][b]))
    return not found


def self_test():
    """A planted cycle a.c -> b.h, b.c -> c.h, c.h -> a.h must be found, and
    no other; without its last edge the same tree must pass."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        files = {"a.c": '#include "a.h"\n#include "b.h"\n', "a.h": "",
                 "b.c": '#include "c.h"\n#include <stdio.h>\n', "b.h": "",
                 "c.h": '#include "a.h"\n#include "kvstash_ring.h"\n',
                 # a private header is part of its module: no cycle d -> d
                 "d.c": '#include "d_internal.h"\n', "d_internal.h": '#include "d.h"\n',
                 "d.h": '#include "b.h"\n'}
        for name, text in files.items():
            with open(os.path.join(d, name), "w", encoding="utf-8") as f:
                f.write(text)
        found = cycles(edges(d, modules(d)))
        if [sorted(c) for c in found] != [["a", "a", "b", "c"]]:
            print("self-test: expected the cycle a -> b -> c -> a, found %r" % found)
            return 1
        with open(os.path.join(d, "c.h"), "w", encoding="utf-8") as f:
            f.write('#include "kvstash_ring.h"\n')
        if not check(d):
            print("self-test: an acyclic tree was reported")
            return 1
    print("self-test: ok")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = argv[1:] or [os.path.join(root, "daemon"), os.path.join(root, "policies")]
    ok = True
    for d in dirs:
        if not os.path.isdir(d):
            print("%s: not a directory" % d)
            ok = False
            continue
        ok = check(d) and ok
    if ok:
        print("include graph is a DAG: %s" % ", ".join(os.path.relpath(d, root) for d in dirs))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
