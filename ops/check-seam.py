#!/usr/bin/env python3
"""Check that pool and staging memory is reached only through the memory seam.

Every byte the daemon or libkvstash moves in pool or staging memory goes
through a backend's kv_ops table (kernels/ops.h), so that a device backend
can implement it (docs/architecture.md). This check fails when a file of the
daemon, or libkvstash's kvstash.c, calls a kernel of kernels.h directly:
only the host-side helpers below, which compute offsets, counts and hashes
or compare host copies, are allowed there.

    ops/check-seam.py ROOT          (the repository root)
    ops/check-seam.py --self-test   (the checker finds a planted call)

Exits 0 when clean; otherwise prints FILE:LINE: the call, and exits 1.
"""
import os
import re
import sys

# Pure host computations over no pool memory.
ALLOWED = {
    "kv_block_bytes", "kv_key_offset", "kv_segments_tokens", "kv_int8_tokens_per_block",
    "kv_int8_block_bytes", "kv_int8_code_offset", "kv_int8_scale_offset",
    "kv_sketch_hash", "kv_sketch_hash_list", "kv_elt_load", "kv_elt_store",
    "kv_ops_find", "kv_shadow_map", "kv_shadow_unmap", "kv_shadow_real",
    "kv_lowbit_group", "kv_lowbit_tokens_per_block", "kv_lowbit_block_bytes",
    "kv_lowbit_code_offset", "kv_lowbit_key_params_offset", "kv_lowbit_value_params_offset",
}
# Where a device arena is made, lent, imported and released (kernels/devmem.h)
# and which device kv_ops_cuda runs on (and waiting for it, the ordering
# contract): the backends' and libkvstash's job, and none of them moves a
# byte of pool memory.
ALLOWED |= {
    "kv_devmem_probe", "kv_devmem_alloc", "kv_devmem_export", "kv_devmem_import",
    "kv_devmem_release", "kv_devmem_kind_name", "kv_devmem_strerror",
    "kv_ops_cuda_set_device", "kv_ops_cuda_device", "kv_ops_cuda_last_error",
    "kv_ops_cuda_synchronize",
}
CALL = re.compile(r"\b(kv_[a-z0-9_]+)\s*\(")


COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')


def code_only(text):
    """The text with comments and string literals blanked, lines kept."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return STRING.sub(blank, COMMENT.sub(blank, text))


def violations(path, text):
    out = []
    lines = text.splitlines()
    for n, code in enumerate(code_only(text).splitlines(), 1):
        for name in CALL.findall(code):
            if name not in ALLOWED:
                out.append(f"{path}:{n}: {name}() called outside the ops: {lines[n - 1].strip()}")
    return out


def files(root):
    daemon = os.path.join(root, "daemon")
    for name in sorted(os.listdir(daemon)):
        if name.endswith(".c"):
            yield os.path.join(daemon, name)
    yield os.path.join(root, "client", "kvstash.c")


def self_test():
    bad = violations("x.c", "void f(void) {\n    kv_gather(&l, pool, s, 1, k, v);\n}\n")
    good = violations("y.c", "size_t b = kv_block_bytes(&l); /* kv_gather(...) in a comment */\n")
    ok = len(bad) == 1 and "kv_gather" in bad[0] and good == []
    print("self-test", "passed" if ok else f"FAILED: {bad} {good}")
    return 0 if ok else 1


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = []
    for path in files(argv[1]):
        with open(path, encoding="utf-8") as f:
            found += violations(os.path.relpath(path, argv[1]), f.read())
    for v in found:
        print(v)
    print(f"memory seam: {len(found)} direct kernel calls")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
