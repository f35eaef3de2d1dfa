"""The package's folders are its pipeline; this test keeps the imports flowing one way.

checkpoint -> planning -> engines -> verify, with dist beside them; handoff, the loader
and the api use them all; only cli/ and the `python -m` shims import cli/. Every import
counts, function-local ones included, and no import cycle is allowed between modules.
"""
from __future__ import annotations

import ast
import os

import pytest

PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coordloader")

BASE = {"coordloader.errors", "coordloader.layout", "coordloader.gcpause", "coordloader.text"}
SHIMS = {"coordloader.load", "coordloader.plan", "coordloader.manifest",
         "coordloader.consolidate", "coordloader.synth.__main__"}
# the stage a module belongs to -> the stages (and base modules) it may import
ALLOWED = {
    "checkpoint": {"checkpoint"},
    "planning": {"checkpoint.metadata", "checkpoint.dtypes", "checkpoint.tiling", "planning"},
    "engines": {"checkpoint", "planning", "engines"},
    "verify": {"checkpoint", "planning", "engines", "verify", "dist"},
    "dist": {"dist"},
    "handoff": {"checkpoint", "planning", "engines", "verify", "dist", "handoff", "api"},
    "synth": {"checkpoint", "synth"},
    "api": {"checkpoint", "planning", "api"},
    "loader": {"checkpoint", "planning", "engines", "verify", "dist", "api", "loader"},
    # adapters to serving engines: read the plan and the loaded tensors, never the reverse
    "integrations": {"checkpoint", "planning", "engines", "verify", "dist", "api", "loader",
                     "integrations"},
}
# modules planning may never reach, even through a stage it is allowed (no I/O, no group)
PLANNING_FORBIDDEN_EXTERNAL = ("torch.distributed", "os", "io", "socket", "subprocess")


def module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def package_modules(pkg_dir: str = PKG_DIR) -> dict[str, str]:
    root = os.path.dirname(pkg_dir)
    out = {}
    for d, _, files in os.walk(pkg_dir):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out[module_name(p, root)] = p
    return out


def imports_of(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """Every module `name` imports, resolved to absolute names (relative imports and
    `from pkg import submodule` included)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules)
    out.discard(name)
    return out


def stage_of(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def _within(target: str, allowed: set[str]) -> bool:
    rest = target[len("coordloader."):]
    return any(rest == a or rest.startswith(a + ".") for a in allowed)


def violations(modules: dict[str, str]) -> list[str]:
    found = []
    for name, path in sorted(modules.items()):
        stage = stage_of(name)
        for target in sorted(imports_of(name, path, modules)):
            if stage == "planning" and any(target == x or target.startswith(x + ".")
                                           for x in PLANNING_FORBIDDEN_EXTERNAL):
                found.append(f"{name} imports {target}: planning does no I/O and forms no group")
            if not target.startswith("coordloader.") or target in BASE:
                continue
            if stage_of(target) == "cli":
                if stage != "cli" and name not in SHIMS:
                    found.append(f"{name} imports {target}: only cli/ and the -m shims import cli/")
            elif stage in ALLOWED and not _within(target, ALLOWED[stage]):
                found.append(f"{name} imports {target}: {stage} may import only "
                             f"{', '.join(sorted(ALLOWED[stage]))} (and errors/layout/gcpause/text)")
    return found


def cycles(modules: dict[str, str]) -> list[list[str]]:
    graph = {n: sorted(t for t in imports_of(n, p, modules) if t in modules and t != n
                       and not n.startswith(t + "."))   # a module importing its own package
             for n, p in modules.items()}
    found, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def test_imports_follow_the_stage_order():
    assert violations(package_modules()) == []


def test_no_import_cycles():
    assert cycles(package_modules()) == []


@pytest.mark.parametrize("where,line,expect", [
    ("checkpoint/reader.py", "from coordloader.planning.model import Plan", "checkpoint may import only"),
    ("planning/planner.py", "import torch.distributed", "planning does no I/O"),
    ("planning/cover.py", "from coordloader.checkpoint.reader import read_checkpoint",
     "planning may import only"),
    ("engines/cpu.py", "from coordloader.verify import digest", "engines may import only"),
    ("handoff/save.py", "from coordloader.cli.plan import human", "only cli/ and the -m shims"),
])
def test_a_planted_wrong_way_import_is_caught(tmp_path, where, line, expect):
    """The check is real: the package copied, one wrong-way import planted, named."""
    import shutil
    pkg = tmp_path / "coordloader"
    shutil.copytree(PKG_DIR, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = pkg / where
    target.write_text(target.read_text() + "\n\ndef _planted():\n    " + line + "\n")
    found = violations(package_modules(str(pkg)))
    assert any(expect in v and module_name(str(target), str(tmp_path)) in v for v in found), found


def test_a_planted_cycle_is_caught(tmp_path):
    import shutil
    pkg = tmp_path / "coordloader"
    shutil.copytree(PKG_DIR, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (pkg / "checkpoint" / "metadata.py").write_text(
        (pkg / "checkpoint" / "metadata.py").read_text()
        + "\n\ndef _planted():\n    from coordloader.checkpoint import reader\n")
    found = cycles(package_modules(str(pkg)))
    assert any("coordloader.checkpoint.metadata" in c and "coordloader.checkpoint.reader" in c
               for c in found), found
