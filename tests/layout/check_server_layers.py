#!/usr/bin/env python3
"""server/'s layering: a file includes only from its own folder and the folders below it.

    common/  <  core/  <  ops/  <  grpc/, http/  <  server/ itself (the composition root)

grpc/ and http/ are peers: neither includes the other. On top of the order, the edges reach the
runner and the scheduler only through ops/ (Ops is the one door): no file of grpc/ or http/ may
include the headers of ops/'s doors (DOORS), which ops/ops.h only forward-declares.

Usage: check_server_layers.py <repository root>   exits 1 naming each offending line.
       check_server_layers.py --self-test          runs the checker on synthetic trees, one good
                                                   and one with each kind of bad include, and
                                                   fails unless it tells them apart.
"""

import os
import re
import sys
import tempfile

# Folder (the first component under server/; "" for server/ itself) -> its layer.
LAYERS = {"common": 0, "core": 1, "ops": 2, "grpc": 3, "http": 3, "": 4}
# What the edges may not include: they reach these through ops/.
EDGES = {"grpc", "http"}
DOORS = {"server/core/scheduler.h", "server/core/replicated_runner.h", "runner/model_runner.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def folder_of(rel):
    """server/a/b.h -> "a"; server/b.h -> ""."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 else ""


def check(root):
    """The offences under root/server, as 'path:line: reason' strings."""
    offences = []
    server = os.path.join(root, "server")
    for dirpath, _, names in sorted(os.walk(server)):
        for name in sorted(names):
            if not name.endswith((".h", ".cc")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            here = folder_of(rel)
            if here not in LAYERS:
                offences.append(f"{rel}:1: folder server/{here}/ has no layer in {__file__}")
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    target = m.group(1)
                    where = f"{rel}:{number}: includes \"{target}\""
                    if here in EDGES and target in DOORS:
                        offences.append(f"{where}: an edge reaches the core only through ops/")
                        continue
                    if not target.startswith("server/"):
                        continue
                    there = folder_of(target)
                    if there not in LAYERS:
                        offences.append(f"{where}: server/{there}/ is no layer")
                    elif there != here and LAYERS[there] >= LAYERS[here]:
                        what = "a peer" if LAYERS[there] == LAYERS[here] else "a higher layer"
                        offences.append(f"{where}: server/{here or '.'}/ may not include {what}")
    return offences


def self_test():
    """The checker passes a good tree and names each bad include of a bad one."""
    good = {
        "server/common/a.h": '#include "absl/status/status.h"\n',
        "server/core/b.h": '#include "server/common/a.h"\n',
        "server/ops/c.h": '#include "server/core/scheduler.h"\n#include "server/core/b.h"\n',
        "server/grpc/d.cc": '#include "server/ops/c.h"\n#include "server/grpc/d.h"\n',
        "server/http/e.cc": '#include "server/ops/c.h"\n#include "server/core/b.h"\n',
        "server/top.cc": '#include "server/grpc/d.h"\n#include "server/http/e.h"\n',
    }
    bad = {  # file -> text; each line is one offence
        "server/core/b.h": '#include "server/ops/c.h"\n',  # up
        "server/common/a.h": '  #  include "server/core/b.h"\n',  # up, spaced
        "server/grpc/d.cc": '#include "server/http/e.h"\n',  # peer
        "server/http/e.cc": '#include "server/core/scheduler.h"\n',  # past the door
        "server/grpc/f.cc": '#include "runner/model_runner.h"\n',  # past the door
        "server/ops/g.cc": '#include "server/top.h"\n',  # the root
        "server/extra/h.h": "\n",  # a folder with no layer
    }

    def run(files):
        with tempfile.TemporaryDirectory() as root:
            for rel, text in files.items():
                path = os.path.join(root, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            return check(root)

    failures = []
    if run(good):
        failures.append(f"a good tree was refused: {run(good)}")
    found = run(bad)
    for rel in bad:
        if not any(o.startswith(rel + ":") for o in found):
            failures.append(f"not caught: {rel}: {bad[rel].strip()}")
    if len(found) != len(bad):
        failures.append(f"expected {len(bad)} offences, got {len(found)}: {found}")
    for f in failures:
        print(f"self-test: {f}", file=sys.stderr)
    return 1 if failures else 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    offences = check(argv[1])
    for o in offences:
        print(o, file=sys.stderr)
    if offences:
        print(f"{len(offences)} include(s) break server/'s layering (docs/server.md, Layout)",
              file=sys.stderr)
    return 1 if offences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
