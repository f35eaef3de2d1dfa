"""Run the real vLLM on checkpoints with several load formats, one after another in one
process (each vLLM start costs tens of seconds; the imports are paid once), and write
what each gave: greedy tokens, a digest of every parameter on every worker, the bytes
each worker read from storage, coordloader's per-rank report, or the error. Used by
tests/test_vllm_e2e.py and ``python -m coordloader.bench vllm``; needs an environment
where ``import vllm`` works.

    python -m coordloader.bench.vllm_driver JOBS.json OUT.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import sys
import time
import traceback

PROMPTS = [[1, 17, 42, 99, 7, 250], [5, 6, 7, 8]]
NEW_TOKENS = 16


def _read_bytes() -> int | None:
    """Bytes this process caused to be fetched from storage (page-cache misses)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def _worker_state(worker):
    """Runs on each vLLM worker: parameter digests, storage reads, coordloader's report."""
    import torch
    model = worker.model_runner.model
    params = {}
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
        params[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]
    report = getattr(model, "coordloader_report", None)
    return {"params": params, "report": dict(report) if report is not None else None,
            "read_bytes": _read_bytes()}


def run_format(ckpt: str, fmt: str, tp: int, pp: int, ep: bool, extra: dict | None,
               generate: bool, cold: bool = False, engine_args: dict | None = None) -> dict:
    from vllm import LLM, SamplingParams
    if cold:
        from coordloader.bench.common import evict_files
        evict_files(os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors"))
    kw = dict(model=ckpt, load_format=fmt, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128,
              enable_expert_parallel=ep, **(engine_args or {}))
    # vLLM's "auto" thread binding refuses 2 workers on a 2-core machine
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp * pp == 2 else "auto"
    if extra is not None and fmt == "coordloader":
        kw["model_loader_extra_config"] = extra
    t = time.perf_counter()
    llm = None
    try:
        llm = LLM(**kw)
        out = {"seconds_init": time.perf_counter() - t}
        out["workers"] = llm.collective_rpc(_worker_state)
        if generate:
            sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
            out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
        return out
    except Exception as e:  # noqa: BLE001 - the test reads the failure from the report
        return {"error": {"type": type(e).__name__, "message": str(e),
                          "traceback": traceback.format_exc()[-4000:]}}
    finally:
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        del llm
        gc.collect()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", help="JSON file: a list of {name, checkpoint, format, tp, pp, ep, "
                                 "extra, generate, cold, engine_args}")
    ap.add_argument("out", help="JSON file: name -> result, rewritten after each job")
    a = ap.parse_args(argv)
    with open(a.jobs) as f:
        jobs = json.load(f)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc(callable)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = {}
    for job in jobs:
        log = f"{a.out}.{job['name']}.log"
        with _output_to(log):
            r = run_format(job["checkpoint"], job["format"], job.get("tp", 1), job.get("pp", 1),
                           job.get("ep", False), job.get("extra"), job.get("generate", True),
                           job.get("cold", False), job.get("engine_args"))
        if "error" in r:
            # vLLM reports a worker's exception in the worker's own output; the engine's
            # exception only says that initialisation failed
            with open(log, errors="replace") as f:
                r["error"]["log_tail"] = f.read()[-LOG_TAIL:]
        results[job["name"]] = r
        with open(a.out, "w") as f:
            json.dump(results, f)
    return 0


LOG_TAIL = 40000


@contextlib.contextmanager
def _output_to(path: str):
    """stdout and stderr of this process, and of every process it starts (vLLM's engine
    core and workers inherit the descriptors), go to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for x in saved + [fd]:
            os.close(x)


if __name__ == "__main__":
    sys.exit(main())
