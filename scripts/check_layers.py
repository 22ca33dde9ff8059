#!/usr/bin/env python3
"""Checks the layer rule of docs/architecture.md against the code (ctest `layer_rule`).

The rule's table lives in docs/architecture.md between the `layer-table` markers: per layer the
layers it calls, the public headers (include/shardsync/) it owns, and the internal headers it
exports to later layers. A layer may use its own files, the public headers of the layers it calls
(directly or through them), and those layers' exported headers; nothing else. Checked:
  * the table's order is CMakeLists.txt's SHARDSYNC_LAYER_ORDER and a layer calls only earlier ones;
  * every public header has one owner, and includes only what its owner may;
  * every `#include "x/..."` of every file under src/<layer>/;
  * the DEPS of every src/<layer>/CMakeLists.txt.
`--self-test` also plants violations into a copy of the tree and fails unless each is caught.
Exit 1 with one line per violation.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

BEGIN = "<!-- layer-table begin"
END = "<!-- layer-table end -->"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cc", ".cu", ".cuh")


class Table:
    def __init__(self, root):
        text = open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8").read()
        if BEGIN not in text or END not in text:
            raise SystemExit("check_layers: docs/architecture.md has no layer-table markers")
        body = text[text.index(BEGIN) : text.index(END)]
        self.order, self.calls, self.owns, self.exports = [], {}, {}, {}
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 4 or not re.fullmatch(r"[a-z]+", cells[0]) or cells[0] == "layer":
                continue
            name = cells[0]
            words = lambda c: [w.strip("`,") for w in c.split() if w.strip("`,") not in ("", "-")]
            self.order.append(name)
            self.calls[name] = words(cells[1])
            self.owns[name] = words(cells[2])
            self.exports[name] = words(cells[3])
        self.owner = {}
        for layer, headers in self.owns.items():
            for h in headers:
                self.owner.setdefault(h, []).append(layer)

    def closure(self, layer):
        seen, todo = set(), list(self.calls.get(layer, []))
        while todo:
            l = todo.pop()
            if l not in seen:
                seen.add(l)
                todo.extend(self.calls.get(l, []))
        return seen


def files_under(d):
    for base, _, names in os.walk(d):
        for n in sorted(names):
            if n.endswith(SOURCES):
                yield os.path.join(base, n)


def check(root, stats=None):
    t = Table(root)
    bad = []
    rel = lambda p: os.path.relpath(p, root)
    # The table itself.
    cmake = open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read()
    m = re.search(r"set\(SHARDSYNC_LAYER_ORDER ([^)]*)\)", cmake)
    if not m or m.group(1).split() != t.order:
        bad.append("docs/architecture.md: layer table order %s != CMakeLists.txt "
                   "SHARDSYNC_LAYER_ORDER %s" % (t.order, m.group(1).split() if m else None))
    for i, layer in enumerate(t.order):
        for c in t.calls[layer]:
            if c not in t.order[:i]:
                bad.append("docs/architecture.md: layer %s calls %s, not an earlier layer"
                           % (layer, c))
    for d in sorted(os.listdir(os.path.join(root, "src"))):
        if os.path.isdir(os.path.join(root, "src", d)) and d not in t.calls:
            bad.append("src/%s: a layer missing from the table in docs/architecture.md" % d)
    pub = os.path.join(root, "include", "shardsync")
    for h in sorted(os.listdir(pub)):
        owners = t.owner.get(h, [])
        if len(owners) != 1:
            bad.append("include/shardsync/%s: owned by %s in the layer table (needs exactly one)"
                       % (h, owners or "no layer"))
    for h, owners in t.owner.items():
        if not os.path.exists(os.path.join(pub, h)):
            bad.append("docs/architecture.md: layer %s owns include/shardsync/%s, which does not "
                       "exist" % (owners[0], h))
    for layer, exported in t.exports.items():
        for e in exported:
            if not os.path.exists(os.path.join(root, "src", layer, e)):
                bad.append("docs/architecture.md: layer %s exports src/%s/%s, which does not exist"
                           % (layer, layer, e))

    def allowed(layer, inc):
        """None if `layer` may include `inc`, else why not."""
        if "/" not in inc:
            return None  # a system or same-folder header
        top, rest = inc.split("/", 1)
        may = t.closure(layer) | {layer}
        if top == "shardsync":
            owners = t.owner.get(rest)
            if not owners:
                return "public header %s has no owner in the layer table" % inc
            if owners[0] not in may:
                return "%s belongs to layer %s, which %s does not call" % (inc, owners[0], layer)
            return None
        if top not in t.calls:
            return "%s is no layer's header" % inc
        if top == layer:
            return None
        if top not in may:
            return "%s belongs to layer %s, which %s does not call" % (inc, top, layer)
        if rest not in t.exports[top]:
            return "%s is internal to layer %s (not in its exports)" % (inc, top)
        return None

    cross = 0
    for h in sorted(os.listdir(pub)):
        owners = t.owner.get(h)
        if not owners:
            continue
        for inc in INCLUDE.findall(open(os.path.join(pub, h), encoding="utf-8").read()):
            why = allowed(owners[0], inc)
            if why:
                bad.append("include/shardsync/%s: %s" % (h, why))
    for layer in t.order:
        d = os.path.join(root, "src", layer)
        if not os.path.isdir(d):
            continue
        for f in files_under(d):
            for inc in INCLUDE.findall(open(f, encoding="utf-8", errors="replace").read()):
                if "/" in inc and inc.split("/", 1)[0] not in (layer, "shardsync"):
                    cross += 1
                why = allowed(layer, inc)
                if why:
                    bad.append("%s: #include \"%s\": %s" % (rel(f), inc, why))
        cm = os.path.join(d, "CMakeLists.txt")
        if os.path.exists(cm):
            text = open(cm, encoding="utf-8").read()
            for deps in re.findall(r"\bDEPS\b(.*?)(?=\b(?:SOURCES|LIBS|PRIVATE_LIBS)\b|\))", text,
                                   re.S):
                for dep in re.findall(r"\bss_([a-z]+)\b", deps):
                    if dep != layer and dep not in t.closure(layer):
                        bad.append("%s: DEPS ss_%s: layer %s does not call %s"
                                   % (rel(cm), dep, layer, dep))
    if stats is not None:
        stats["cross_layer_includes"] = cross
        stats["layers"] = len(t.order)
    return bad


def plant(root, path, find, replace):
    p = os.path.join(root, path)
    s = open(p, encoding="utf-8").read()
    if find not in s:
        raise SystemExit("check_layers self-test: %s no longer holds %r" % (path, find))
    open(p, "w", encoding="utf-8").write(s.replace(find, replace, 1))


def self_test(root):
    stats = {}
    if check(root, stats):
        return ["self-test: the tree itself fails"]
    fails = []
    # Cannot pass trivially: it must see the layers and the known cross-layer internal includes
    # (cuda -> transport/shm_segment.h, sync -> plan/plan_hash.h, common/trace.h, ...).
    if stats["layers"] < 12 or stats["cross_layer_includes"] < 8:
        fails.append("self-test: the checker saw %s layers and %s cross-layer internal includes"
                     % (stats["layers"], stats["cross_layer_includes"]))
    plants = [
        # cuda includes the sync layer's public header (the violation this check was made for).
        ("src/cuda/device/cuda_packer.cc", '#include "shardsync/gpu.h"\n',
         '#include "shardsync/gpu.h"\n#include "shardsync/session.h"\n', "session.h belongs to layer sync"),
        # job reaches into a sync internal.
        ("src/job/rank.cc", '#include "job/internal.h"\n',
         '#include "job/internal.h"\n#include "sync/context.h"\n', "internal to layer sync"),
        # an earlier layer links a later one.
        ("src/store/CMakeLists.txt", "DEPS ss_common", "DEPS ss_common ss_transport",
         "DEPS ss_transport"),
        # a public header of an earlier layer includes a later one's.
        ("include/shardsync/plan.h", '#include "shardsync/status.h"\n',
         '#include "shardsync/status.h"\n#include "shardsync/store.h"\n', "plan.h: shardsync/store.h"),
        # the table and CMake's layer order disagree.
        ("CMakeLists.txt", "common topology model", "topology common model", "layer table order"),
    ]
    for path, find, replace, expect in plants:
        with tempfile.TemporaryDirectory() as tmp:
            for d in ("src", "include", "docs"):
                shutil.copytree(os.path.join(root, d), os.path.join(tmp, d))
            shutil.copy(os.path.join(root, "CMakeLists.txt"), tmp)
            plant(tmp, path, find, replace)
            found = check(tmp)
            if not any(expect in v for v in found):
                fails.append("self-test: planting %r in %s was not caught (got %s)"
                             % (replace.strip(), path, found))
    return fails


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    bad = self_test(root) if a.self_test else check(root)
    for b in bad:
        print(b, file=sys.stderr)
    if not bad:
        print("layer rule: ok" + (" (self-test: every planted violation caught)"
                                  if a.self_test else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
