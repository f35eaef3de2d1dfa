"""The strategy vocabulary: names, accepted parameters and their validation.

A rule maps tensor names to one strategy plus parameters. The planner (coordloader.plan)
turns (strategy, params, tensor, layout) into per-rank slices; this module only says what
is allowed, so a bad rule file fails at load time with the offending rule named."""
from __future__ import annotations

from coordloader.errors import PlanError

# strategy -> accepted params (all optional unless noted in the docs)
STRATEGIES: dict[str, frozenset[str]] = {
    "replicate": frozenset({"stage"}),
    "colwise": frozenset({"dim", "stage"}),
    "rowwise": frozenset({"dim", "stage"}),
    "vocab": frozenset({"pad_to", "stage"}),
    "heads": frozenset({"num_heads", "kv", "dim", "stage"}),
    "packed": frozenset({"dim", "blocks", "num_blocks", "heads", "kv", "stage"}),
    "expert": frozenset({"num_experts", "dim", "id_regex", "num_blocks", "interleaved",
                         "split_unit", "stage"}),
    "scale": frozenset({"block", "weight", "stage"}),
}

STAGES = ("first", "last", "all", "layer")


def check_params(strategy: str, params: dict, where: str) -> dict:
    """Validate and normalise one rule's params; raise PlanError naming ``where``."""
    if strategy not in STRATEGIES:
        raise PlanError(f"{where}: unknown strategy {strategy!r}; expected one of "
                        f"{', '.join(STRATEGIES)}")
    if not isinstance(params, dict):
        raise PlanError(f"{where}: params must be an object, got {type(params).__name__}")
    unknown = set(params) - STRATEGIES[strategy]
    if unknown:
        raise PlanError(f"{where}: strategy {strategy!r} does not take params {sorted(unknown)}; "
                        f"accepted: {sorted(STRATEGIES[strategy])}")
    p = dict(params)

    def pos_int(k, allow_none=False):
        v = p.get(k)
        if v is None and allow_none:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{where}: param {k!r} must be a positive integer, got {v!r}")

    def nonneg_int(k):
        v = p.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"{where}: param {k!r} must be a non-negative integer, got {v!r}")

    if "stage" in p and p["stage"] not in STAGES:
        raise PlanError(f"{where}: param 'stage' must be one of {STAGES}, got {p['stage']!r}")
    if "dim" in p and not (strategy == "expert" and p["dim"] is None):
        nonneg_int("dim")
    if strategy == "vocab":
        p.setdefault("pad_to", 64)
        pos_int("pad_to")
    if strategy == "heads":
        if "num_heads" not in p:
            raise PlanError(f"{where}: strategy 'heads' needs param 'num_heads'")
        pos_int("num_heads")
        p["kv"] = bool(p.get("kv", False))
    if strategy == "packed":
        if ("blocks" in p) == ("num_blocks" in p):
            raise PlanError(f"{where}: strategy 'packed' needs exactly one of 'blocks' (sizes) or "
                            f"'num_blocks'")
        if "blocks" in p:
            b = p["blocks"]
            if not isinstance(b, (list, tuple)) or not b or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
                raise PlanError(f"{where}: param 'blocks' must be a non-empty list of positive "
                                f"integers, got {b!r}")
            p["blocks"] = tuple(b)
        else:
            pos_int("num_blocks")
        if "heads" in p:
            h = p["heads"]
            n = len(p["blocks"]) if "blocks" in p else p["num_blocks"]
            if not isinstance(h, (list, tuple)) or len(h) != n or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in h):
                raise PlanError(f"{where}: param 'heads' must list one positive head count per "
                                f"block ({n}), got {h!r}")
            p["heads"] = tuple(h)
            kv = p.get("kv", [False] * n)
            if not isinstance(kv, (list, tuple)) or len(kv) != n:
                raise PlanError(f"{where}: param 'kv' must list one boolean per block ({n})")
            p["kv"] = tuple(bool(x) for x in kv)
        elif "kv" in p:
            raise PlanError(f"{where}: param 'kv' of 'packed' needs 'heads'")
    if strategy == "expert":
        if "num_experts" in p:
            pos_int("num_experts")
        for k in ("num_blocks", "interleaved", "split_unit"):
            if k in p:
                pos_int(k)
        if p.get("num_blocks", 1) > 1 and p.get("interleaved", 1) > 1:
            # one packing per split dim: halves of pairs is not a layout any loader uses
            raise PlanError(f"{where}: params 'num_blocks' and 'interleaved' are exclusive "
                            f"(block halves or interleaved pairs, not both)")
        if any(k in p for k in ("num_blocks", "interleaved", "split_unit")) and p.get("dim") is None:
            raise PlanError(f"{where}: packing params need the split 'dim' inside the expert")
        p.setdefault("dim", None)
        p.setdefault("id_regex", r"(?:^|\.)experts\.(\d+)\.")
        if not isinstance(p["id_regex"], str):
            raise PlanError(f"{where}: param 'id_regex' must be a string")
    if strategy == "scale":
        b = p.get("block", [128, 128])
        if not isinstance(b, (list, tuple)) or not b or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
            raise PlanError(f"{where}: param 'block' must be a list of positive integers, got {b!r}")
        p["block"] = tuple(b)
        if "weight" in p and not isinstance(p["weight"], str):
            raise PlanError(f"{where}: param 'weight' must be a tensor name")
    return p
