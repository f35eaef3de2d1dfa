"""The docs say what the code does.

- docs/cli.md and the generated sections of docs/*.md equal what tools/docgen.py
  produces from the code now (drift test; fix: ``python tools/docgen.py``);
- every signature in docs/api.md matches the real function (names, kinds, defaults);
- every shell block (```bash / ```sh / ```console) and python block in docs/*.md and
  README.md runs, in a fresh temporary directory per document (blocks of one document run
  in order and share it, like a tutorial). A block preceded by an HTML comment
  ``<!-- not-run: reason -->`` is skipped. Two policies keep the test from acting on the
  machine: ``pip install ...`` steps are dropped (the package is already installed here),
  and a block that runs the test suite itself is skipped (it would recurse).
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from coordloader.dist.collective import free_port
from tools import docgen

pytestmark = pytest.mark.slow   # every doc block runs in a fresh interpreter

REPO = docgen.REPO
DOC_FILES = sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "README.md")]
BLOCK_RE = re.compile(r"(?P<pre>(?:<!--(?P<comment>.*?)-->\s*\n)?)"
                      r"```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)```",
                      re.S)
SHELL = {"bash", "sh", "console", "shell"}
BLOCK_TIMEOUT_S = 60   # a long example must be marked not-run; keeps the docs test bounded


def _rel(p: str) -> str:
    return os.path.relpath(p, REPO)


# --------------------------------------------------------------------------- drift

def test_cli_reference_matches_argparse():
    diffs = docgen.check(["cli"])
    assert not diffs, ("docs/cli.md differs from the argparse definitions; run "
                       "`python tools/docgen.py`:\n" + "\n".join(diffs)[:6000])


def test_cli_reference_does_not_depend_on_the_machine(monkeypatch):
    # manifest --jobs defaulted to min(8, CPUs) computed at parse time, so docs/cli.md
    # (made on a 2-CPU machine) drifted on every machine with another CPU count
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    diffs = docgen.check(["cli"])
    assert not diffs, "\n".join(diffs)[:6000]


def test_generated_sections_match_code():
    diffs = docgen.check(list(docgen.SECTIONS))
    assert not diffs, ("generated doc sections differ from what the code computes; run "
                       "`python tools/docgen.py`:\n" + "\n".join(diffs)[:6000])


def test_docgen_captures_parsers_without_build_parser():
    # synth builds its parser inside main(); docgen must get it without running anything
    p, src = docgen.get_parser("coordloader.cli.synth")
    assert p is not None and "--arch" in p._option_string_actions, src


def test_replace_section_keeps_the_rest():
    text = "a\n<!-- docgen:begin x -->\nold\n<!-- docgen:end x -->\nb\n"
    assert docgen.replace_section(text, "x", "new") == \
        "a\n<!-- docgen:begin x -->\nnew\n<!-- docgen:end x -->\nb\n"
    with pytest.raises(ValueError):
        docgen.replace_section("no markers", "x", "new")


# --------------------------------------------------------------------------- api.md

def _api_signatures() -> list[str]:
    with open(os.path.join(REPO, "docs", "api.md"), encoding="utf-8") as f:
        text = f.read()
    sigs = []
    for m in BLOCK_RE.finditer(text):
        if m.group("lang") == "text":
            sigs += [ln.strip() for ln in m.group("body").splitlines()
                     if re.match(r"coordloader(\.\w+)+\(", ln.strip())]
    return sigs


def test_api_doc_lists_signatures():
    names = {s.split("(")[0] for s in _api_signatures()}
    for must in ("coordloader.Layout", "coordloader.make_plan", "coordloader.load",
                 "coordloader.load_into", "coordloader.save", "coordloader.verify_rank",
                 "coordloader.digest", "coordloader.read_checkpoint"):
        assert must in names, f"docs/api.md does not document {must}"


@pytest.mark.parametrize("sig", _api_signatures(), ids=lambda s: s.split("(")[0])
def test_api_signature_matches_code(sig):
    name = sig.split("(")[0]
    assert docgen.signature_text(name) == sig, (
        f"docs/api.md shows\n  {sig}\nthe code has\n  {docgen.signature_text(name)}")


# --------------------------------------------------------------------------- runnable blocks

def _blocks(path: str) -> list[tuple[int, str, str, str | None]]:
    """[(line, lang, body, skip reason or None)] of the runnable blocks of a document."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in BLOCK_RE.finditer(text):
        lang = m.group("lang").lower()
        if lang not in SHELL and lang != "python":
            continue
        line = text.count("\n", 0, m.start("lang")) + 1
        comment = (m.group("comment") or "").strip()
        skip = comment if comment.startswith("not-run") else None
        body = m.group("body")
        if lang == "console":   # commands are the "$ " lines; the rest is output
            body = "\n".join(ln[2:] for ln in body.splitlines() if ln.startswith("$ "))
        if skip is None and re.search(r"(^|[\s;&|])(python -m )?pytest\b", body):
            skip = "runs the test suite (would recurse)"
        out.append((line, "python" if lang == "python" else "bash", body, skip))
    return out


def _drop_pip(body: str) -> str:
    """Remove `pip install ...` steps (joined by && or on their own line)."""
    lines = []
    for ln in body.splitlines():
        parts = [p for p in re.split(r"\s*&&\s*", ln) if not re.match(r"\s*(python -m )?pip3? install\b", p)]
        if parts:
            lines.append(" && ".join(parts))
    return "\n".join(lines)


def _docs_with_blocks():
    return [p for p in DOC_FILES if os.path.exists(p) and _blocks(p)]


# Consecutive python blocks run in one interpreter (each in fresh globals, in order):
# importing torch once per document instead of once per block keeps the test fast.
_DRIVER = """
import json, sys, traceback
for line, body in json.load(sys.stdin):
    try:
        exec(compile(body, f"<block at line {line}>", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"DOCBLOCK-FAILED {line}", file=sys.stderr)
        sys.exit(1)
"""


def _runs(path: str):
    """Blocks to run, as (first line, lang, payload): a shell body, or a list of
    (line, body) python blocks that follow one another."""
    out = []
    for line, lang, body, skip in _blocks(path):
        if skip:
            continue
        if lang == "python" and out and out[-1][1] == "python":
            out[-1][2].append((line, body))
        elif lang == "python":
            out.append((line, "python", [(line, body)]))
        else:
            out.append((line, "bash", body))
    return out


@pytest.mark.parametrize("path", _docs_with_blocks(), ids=_rel)
def test_doc_blocks_run(path, tmp_path):
    import json
    runs = _runs(path)
    if not runs:
        pytest.skip("every block is marked not-run")
    for line, lang, payload in runs:
        # the interpreter running the tests comes first on PATH: a bash block's `python`,
        # `torchrun` and `pip` are this environment's even when its venv is not activated
        bindir = os.path.dirname(sys.executable)
        env = dict(os.environ, PET_MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        if lang == "bash":
            cmd, stdin, shown = ["bash", "-e", "-o", "pipefail", "-c", _drop_pip(payload)], None, payload
        else:
            cmd, stdin = [sys.executable, "-c", _DRIVER], json.dumps(payload)
            shown = "\n".join(b for _, b in payload)
        timeout = BLOCK_TIMEOUT_S * (len(payload) if lang == "python" else 1)
        try:
            r = subprocess.run(cmd, cwd=tmp_path, env=env, input=stdin, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{_rel(path)}:{line}: {lang} block ran past {timeout} s "
                        f"(mark it <!-- not-run: ... --> if it is long):\n{shown}\n"
                        f"{(e.stderr or b'')[-2000:]!r}")
        if r.returncode != 0 and lang == "python":
            m = re.search(r"DOCBLOCK-FAILED (\d+)", r.stderr)
            if m:
                line = int(m.group(1))
                shown = dict(payload)[line]
        assert r.returncode == 0, (f"{_rel(path)}:{line}: {lang} block failed (exit "
                                   f"{r.returncode}):\n{shown}\n--- stdout\n{r.stdout[-3000:]}"
                                   f"\n--- stderr\n{r.stderr[-3000:]}")


def test_block_parser_honours_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("<!-- not-run: needs GPU -->\n```bash\nexit 1\n```\n\n```console\n$ echo hi\nhi\n```\n"
                   "```bash\npip install foo && echo ok\n```\n```bash\npython -m pytest -q\n```\n")
    b = _blocks(str(doc))
    assert [s is not None for *_, s in b] == [True, False, False, True]
    assert b[1][2] == "echo hi"
    assert _drop_pip(b[2][2]) == "echo ok"
