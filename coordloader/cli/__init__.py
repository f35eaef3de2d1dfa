"""`coordloader <tool> ...`: one console script for the `python -m coordloader.<tool>` entry
points (each tool keeps its own parser; this only dispatches)."""
from __future__ import annotations

import sys
from importlib import import_module

from coordloader.text import MAX_NAME_CHARS, clip

# tool -> (module holding main(argv), one-line summary)
TOOLS = {
    "synth": ("coordloader.cli.synth", "write a synthetic checkpoint with real tensor names"),
    "plan": ("coordloader.cli.plan", "show which slices every rank holds (no tensor I/O)"),
    "load": ("coordloader.cli.load", "load this rank's slices (run under torchrun for a group)"),
    "manifest": ("coordloader.cli.manifest", "write per-tensor content digests next to a checkpoint"),
    "consolidate": ("coordloader.cli.consolidate", "turn a coordloader-sharded checkpoint into plain HF"),
    "bench": ("coordloader.bench.cli", "benchmark the engines and baselines side by side"),
}


def usage() -> str:
    lines = ["usage: coordloader <tool> [args...]   (same as python -m coordloader.<tool>)", "",
             "tools:"]
    lines += [f"  {name:<12} {summary}" for name, (_, summary) in TOOLS.items()]
    lines += ["", "`coordloader <tool> --help` shows a tool's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    tool, rest = argv[0], argv[1:]
    if tool not in TOOLS:
        print(f"coordloader: unknown tool {clip(repr(tool), MAX_NAME_CHARS)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    # import_module, not attribute access: `coordloader.load` is the library function
    mod = import_module(TOOLS[tool][0])
    rc = mod.main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
