"""``python -m coordloader.bench``: coordloader's planner, engines and verification
measured against baselines on the machine at hand (see docs/benchmarks.md).

Modules: cli (arguments, sections), load_bench / verify_bench / save_bench / plan_bench
(the sections), methods (the per-rank load methods, engines and baselines), worker and
runner (one process per rank, released together), report (markdown, JSON, headline),
plots (PNG, optional matplotlib).
"""


def main(argv=None) -> int:
    from coordloader.bench.cli import main as _main
    return _main(argv)


__all__ = ["main"]
