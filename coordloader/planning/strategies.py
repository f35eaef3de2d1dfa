"""The strategy registry: every strategy declared once, with the parameters it accepts, their
check, and its placement.

A rule maps tensor names to one strategy plus parameters. The rule checker
(``rules.ruleset``, through ``check_params``) validates a rule's params against its
Strategy when a rule file is read, so a bad rule fails at load time with the offending
rule named; the planner (``placement.Placer``) calls the Strategy's ``place`` for each
tensor. Adding a strategy is one ``Strategy(...)`` entry in ``STRATEGIES`` here (and its
section in docs/rules.md).

A placement turns (tensor, params) into a *selector* (which class each rank of the
tensor's stages holds) and the *classes* (per class: local shape and pieces). It reads
the layout and shared helpers through ``PlacementContext`` (``placement.Placer``), so
this module imports nothing of the planner."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Protocol

from coordloader.checkpoint.metadata import is_tower
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.model import Piece

STAGES = ("first", "last", "all", "layer")
# the expert rule's default id pattern: it reads the digits after an "experts" name
# component, never a layer's (the planner relies on that to place a layer's tensors once
# for every layer)
EXPERT_ID_REGEX = r"(?:^|\.)experts\.(\d+)\."

# Selectors: which class of a tensor's placement each rank of its stages falls in. They
# are hashable (rank groups are memoised per (stages, selector)) and compare by value.
class Everyone(NamedTuple):
    """Every rank holds class 0 (replicated)."""


class ByTp(NamedTuple):
    """A rank holds class ``classes[tp_rank]``."""
    classes: tuple[int, ...]


class ByExpertOwner(NamedTuple):
    """Only the ep ranks in ``owners`` hold it: class ``moe_tp_rank`` when ``split`` over
    moe_tp, else class 0."""
    owners: tuple[int, ...]
    split: bool


class ByExpertSet(NamedTuple):
    """A fused expert tensor: class ``ep_rank * moe_tp + moe_tp_rank`` when ``split``,
    else ``ep_rank`` (each ep rank holds its set of experts)."""
    split: bool


Selector = Everyone | ByTp | ByExpertOwner | ByExpertSet

# per class: (local shape, pieces); a placement's classes, indexed by its selector
Classes = list[tuple[tuple[int, ...], tuple[Piece, ...]]]


class TensorShape(NamedTuple):
    """What a placement reads of a tensor: its name and global shape (from the header
    entries, without making the tensor's record)."""
    name: str
    shape: tuple[int, ...]


class PlacementContext(Protocol):
    """What a placement reads of the planner: the layout, and helpers that share classes
    across same-shaped tensors and name the tensor and layout in their errors."""
    L: Layout

    def err(self, msg: str, name: str) -> PlanError: ...
    def whole(self, t: TensorShape) -> tuple[Selector, Classes]: ...
    def split_dim(self, t: TensorShape, dim: int, parts: int, what: str) -> Classes: ...
    def chunks(self, t: TensorShape, n: int, parts: int, what: str) -> list[tuple[int, int]]: ...
    def head_split(self, n_size: int, heads: int, kv: bool, name: str, what: str): ...
    def experts_count(self, t: TensorShape, p: Mapping) -> int: ...
    def expert_owners(self, e: int, E: int) -> tuple[int, ...]: ...
    def packed_ranges(self, t: TensorShape, tdim: int, size: int, p: Mapping, what: str): ...
    def compiled(self, pattern: str) -> re.Pattern: ...
    def config_num_experts(self) -> int | None: ...


Placement = Callable[[PlacementContext, TensorShape, Mapping], tuple[Selector, Classes]]


@dataclass(frozen=True)
class Strategy:
    name: str
    params: frozenset[str]                    # accepted params (all optional unless checked)
    check: Callable[[dict, str], None] | None  # validates/normalises params in place
    # None: the tensor follows another's placement (a block scale follows its weight:
    # Placer.scale), so it needs the other placed first
    place: Placement | None


# -- placements -----------------------------------------------------------------------

def _place_replicate(ctx: PlacementContext, t: TensorShape, p: Mapping):
    return ctx.whole(t)

def fused_gate_up(name: str) -> bool:
    """Whether the tensor's name says it packs gate and up projections (``gate_up_proj``)."""
    return any("gate_up" in c for c in name.split(".")[-2:])


def _place_colwise(ctx: PlacementContext, t: TensorShape, p: Mapping, dim=None):
    if dim is None and fused_gate_up(t.name):
        # refused at every layout, as the expert strategy's: a plain split hands a rank
        # gate rows only (vLLM's MergedColumnParallelLinear splits each half)
        raise ctx.err("fused tensor packs gate and up; a plain colwise split would hand a "
                      "rank gate rows only: give it strategy 'packed' with num_blocks=2 "
                      "(halves, as vLLM splits them)", t.name)
    dim = p.get("dim", 0) if dim is None else dim
    if not t.shape or ctx.L.tp == 1 or (p.get("shared_expert") and ctx.L.sequence_parallel_moe):
        return ctx.whole(t)
    classes = ctx.split_dim(t, dim, ctx.L.tp, f"split over tp={ctx.L.tp}")
    return ByTp(tuple(range(ctx.L.tp))), classes

def _place_rowwise(ctx: PlacementContext, t: TensorShape, p: Mapping):
    dim = p.get("dim", 1)
    if len(t.shape) <= dim:
        if len(t.shape) <= 1:     # the bias of a row-parallel layer is replicated
            return ctx.whole(t)
        # a matrix held whole on every rank because of a dim past its rank: a typo in
        # the rule, which would load a layout other than the one it names
        raise ctx.err(f"rowwise split dim {dim} out of range for shape {list(t.shape)} (only "
                      f"a 1-D bias is held whole)", t.name)
    return _place_colwise(ctx, t, p, dim)

def _place_vocab(ctx: PlacementContext, t: TensorShape, p: Mapping):
    if not t.shape:
        raise ctx.err("vocab strategy needs a tensor with a row dim", t.name)
    V, pad, tp = t.shape[0], p["pad_to"], ctx.L.tp
    Vp = -(-V // pad) * pad
    rngs = ctx.chunks(t, Vp, tp, f"vocab {V} padded to {Vp} (multiple of {pad}) split "
                                   f"over tp={tp}")
    zero = (0,) * len(t.shape)
    rest = tuple((0, s) for s in t.shape[1:])
    classes = []
    for a, b in rngs:
        pieces = (Piece(((a, min(b, V)),) + rest, zero),) if a < V else ()
        classes.append(((b - a,) + t.shape[1:], pieces))
    if tp == 1 and Vp == V:
        return Everyone(), classes
    return ByTp(tuple(range(tp))), classes

def _place_heads(ctx: PlacementContext, t: TensorShape, p: Mapping):
    dim = p.get("dim", 0)
    if dim >= len(t.shape):
        raise ctx.err(f"heads split dim {dim} out of range for shape {list(t.shape)}", t.name)
    g, rngs = ctx.head_split(t.shape[dim], p["num_heads"], p["kv"], t.name,
                               f"heads split of dim {dim} (shape {list(t.shape)})")
    hd = p.get("head_dim")
    if (hd is not None and ctx.L.tp > 1 and t.shape[dim] != p["num_heads"] * hd
            and not is_tower(t.name)):
        # num_heads from the config.json of another model (other K/V heads) would cut heads
        # apart, or hold several where one is replicated; a vision tower's heads are not
        # the text model's. Where tp is 1 every tensor is whole, whatever its heads
        raise ctx.err(f"heads split of dim {dim}: size {t.shape[dim]} is not num_heads="
                      f"{p['num_heads']} times head_dim={hd} ({p['num_heads'] * hd}); expected "
                      f"the config.json of this checkpoint", t.name)
    if len(rngs) == 1:
        return ctx.whole(t)
    return ByTp(g), dim_classes(t.shape, dim, rngs)

def _place_packed(ctx: PlacementContext, t: TensorShape, p: Mapping):
    dim = p.get("dim", 0)
    if dim >= len(t.shape):
        raise ctx.err(f"packed split dim {dim} out of range for shape {list(t.shape)}", t.name)
    size = t.shape[dim]
    tp = ctx.L.tp
    if "blocks" in p:
        blocks = list(p["blocks"])
        if sum(blocks) != size:
            raise ctx.err(f"packed blocks {blocks} sum to {sum(blocks)}, but dim {dim} has "
                            f"size {size}", t.name)
    else:
        nb = p["num_blocks"]
        if size % nb:
            raise ctx.err(f"dim {dim} of size {size} does not hold {nb} equal packed blocks", t.name)
        blocks = [size // nb] * nb
    heads = p.get("heads")
    kvs = p.get("kv") or (False,) * len(blocks)
    per_block = []   # (g, ranges) per block
    for bi, bs in enumerate(blocks):
        what = f"packed block {bi} (size {bs}) of dim {dim}"
        if heads:
            per_block.append(ctx.head_split(bs, heads[bi], kvs[bi], t.name, what))
        else:
            per_block.append((tuple(range(tp)), ctx.chunks(t, bs, tp, what + f" over tp={tp}")))
    offs = [0]
    for bs in blocks:
        offs.append(offs[-1] + bs)
    keys, classes, g = {}, [], []
    for r in range(tp):
        key = tuple(pb[0][r] for pb in per_block)
        if key not in keys:
            keys[key] = len(classes)
            pieces, loc = [], 0
            for bi, (gb, rngs) in enumerate(per_block):
                a, b = rngs[key[bi]]
                if b > a:
                    box = [(0, s) for s in t.shape]
                    box[dim] = (offs[bi] + a, offs[bi] + b)
                    dst = [0] * len(t.shape)
                    dst[dim] = loc
                    pieces.append(Piece(tuple(box), tuple(dst)))
                loc += b - a
            ls = list(t.shape)
            ls[dim] = loc
            classes.append((tuple(ls), tuple(pieces)))
        g.append(keys[key])
    if len(classes) == 1:
        return Everyone(), classes
    return ByTp(tuple(g)), mark_copies(classes)


def mark_copies(classes) -> list:
    """``classes`` with every piece whose box an earlier, different class already holds
    marked as a copy (``Piece.copy``): a packed qkv whose K/V blocks replicate (tp >
    num_kv_heads) gives each TP rank its own class (its q rows), so the same K/V box sits
    in several classes and only the first holds it as primary. Classes equal to an
    earlier one (empty uneven chunks) stay equal to it, copies marked alike, so that
    ``rankgroups.dedupe`` still merges them into replicas. Without a shared box the
    classes are returned as they are."""
    held: set = set()   # boxes an earlier distinct class holds
    seen: dict = {}     # (shape, pieces) as placed -> that class, copies marked
    out = []
    marked = False
    for c in classes:
        got = seen.get(c)
        if got is not None:
            out.append(got)
            continue
        ls, pieces = c
        if any(p.src in held for p in pieces):
            c = (ls, tuple(Piece(p.src, p.dst, True) if p.src in held else p for p in pieces))
            marked = True
        held.update(p.src for p in pieces)
        seen[(ls, pieces)] = c
        out.append(c)
    return out if marked else classes

def _place_expert(ctx: PlacementContext, t: TensorShape, p: Mapping):
    rx = ctx.compiled(p["id_regex"])
    m = rx.search(t.name)
    dim = p.get("dim")
    L = ctx.L
    if m:
        g = m.group(1)
        if g is None or not g.isdigit() or not g.isascii():
            raise ctx.err(f"expert id_regex {p['id_regex']!r} matches, but its group 1 is "
                            f"{g!r}, not an expert id (decimal digits)", t.name)
        e = int(g)
        E = ctx.experts_count(t, p)
        if e >= E:
            raise ctx.err(f"expert id {e} is outside the {E} experts", t.name)
        owners = ctx.expert_owners(e, E)
        if not owners:
            raise ctx.err(f"expert {e} has no owner in the expert placement", t.name)
        # the dim is checked at every layout: a rule that only fails where moe_tp > 1
        # would pass its tests at one layout and fail at another
        if dim is not None and t.shape and dim >= len(t.shape):
            raise ctx.err(f"expert split dim {dim} out of range for shape {list(t.shape)}", t.name)
        if dim is None or L.moe_tp == 1 or not t.shape:
            _, classes = ctx.whole(t)
            return ByExpertOwner(owners, False), classes
        if _is_packed(t, p):
            classes = packed_dim_classes(t.shape, dim, ctx.packed_ranges(
                t, dim, t.shape[dim], p, f"expert split of dim {dim} (shape {list(t.shape)})"))
        else:
            classes = ctx.split_dim(t, dim, L.moe_tp, f"expert split over moe_tp={L.moe_tp}")
        return ByExpertOwner(owners, True), classes
    # fused: the leading dim indexes the experts
    if not t.shape:
        raise ctx.err("expert tensor has no expert id in its name and no expert dim", t.name)
    E = p.get("num_experts") or ctx.config_num_experts() or t.shape[0]
    if t.shape[0] != E:
        raise ctx.err(f"fused expert tensor has leading dim {t.shape[0]}, expected the "
                        f"{E} experts", t.name)
    E = ctx.experts_count(t, {"num_experts": E})
    sets = [L.experts_of(q, E) for q in range(L.ep)]
    if not isinstance(L.expert_placement, str):
        seen = {}
        for q, ids in enumerate(sets):
            for e in ids:
                if e in seen and sets[seen[e]] != ids:
                    raise ctx.err(f"expert {e} is placed on ep ranks {seen[e]} and {q} with "
                                    f"different expert sets; a fused expert tensor can only be "
                                    f"replicated as a whole set", t.name)
                seen.setdefault(e, q)
    if dim is not None and dim + 1 >= len(t.shape):
        raise ctx.err(f"expert split dim {dim} out of range for fused shape "
                        f"{list(t.shape)}", t.name)
    split = dim is not None and L.moe_tp > 1
    if split:
        rngs = ctx.packed_ranges(t, dim + 1, t.shape[dim + 1], p,
                                   f"fused expert split of dim {dim + 1} (shape "
                                   f"{list(t.shape)})")
    else:
        rngs = [((0, t.shape[dim + 1]),)] if dim is not None else [None]
    classes = []
    for q in range(L.ep):
        for rg in (rngs if split else rngs[:1]):
            pieces = []
            for i, e in enumerate(sets[q]):
                loc = 0
                for a, b in (rg if rg is not None else ((None, None),)):
                    box = [(e, e + 1)] + [(0, s) for s in t.shape[1:]]
                    dst = [i] + [0] * (len(t.shape) - 1)
                    if rg is not None:
                        box[dim + 1] = (a, b)
                        dst[dim + 1] = loc
                        loc += b - a
                    if rg is None or b > a:
                        pieces.append(Piece(tuple(box), tuple(dst)))
            ls = [len(sets[q])] + list(t.shape[1:])
            if rg is not None:
                ls[dim + 1] = sum(b - a for a, b in rg)
            classes.append((tuple(ls), tuple(pieces)))
    return ByExpertSet(split), classes


def dim_classes(shape, dim: int, rngs) -> list:
    """Classes of a split of ``dim`` into the [start, stop) ranges ``rngs``: per range the
    local shape and its one piece (none for an empty range)."""
    return packed_dim_classes(shape, dim, [((a, b),) for a, b in rngs])


def packed_dim_classes(shape, dim: int, per_class) -> list:
    """Classes of a split of ``dim`` where each class holds several [start, stop) ranges,
    concatenated in order along ``dim`` (a packed tensor's parts); empty ranges hold no
    piece."""
    full = [(0, s) for s in shape]
    classes = []
    for rngs in per_class:
        pieces, loc = [], 0
        for a, b in rngs:
            if b > a:
                box = list(full)
                box[dim] = (a, b)
                dst = [0] * len(shape)
                dst[dim] = loc
                pieces.append(Piece(tuple(box), tuple(dst)))
            loc += b - a
        ls = list(shape)
        ls[dim] = loc
        classes.append((tuple(ls), tuple(pieces)))
    return classes


def _is_packed(t: TensorShape, p) -> bool:
    """Whether an expert tensor's split goes through the packed ranges (declared packing,
    or a gate_up name that must be refused without one)."""
    return bool(p.get("num_blocks") or p.get("interleaved") or p.get("split_unit")
                or fused_gate_up(t.name))


# -- param checks ---------------------------------------------------------------------
# Each runs after the common checks of check_params (known params, stage, dim) and may
# normalise ``p`` in place (defaults, tuples for lists).

def _pos_int(p: dict, k: str, where: str, allow_none: bool = False) -> None:
    v = p.get(k)
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanError(f"{where}: param {k!r} must be a positive integer, got {v!r}")


def _nonneg_int(p: dict, k: str, where: str) -> None:
    v = p.get(k)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PlanError(f"{where}: param {k!r} must be a non-negative integer, got {v!r}")



def _check_vocab(p: dict, where: str) -> None:
    p.setdefault("pad_to", 64)
    _pos_int(p, "pad_to", where)


def _bool(p: dict, k: str, where: str) -> None:
    v = p.get(k, False)
    if not isinstance(v, bool):
        # bool("false") is True: a rule file's string would select the other split
        raise PlanError(f"{where}: param {k!r} must be true or false, got {v!r}")
    p[k] = v


def _check_split(p: dict, where: str) -> None:
    if "shared_expert" in p:
        _bool(p, "shared_expert", where)


def _check_heads(p: dict, where: str) -> None:
    if "num_heads" not in p:
        raise PlanError(f"{where}: strategy 'heads' needs param 'num_heads'")
    _pos_int(p, "num_heads", where)
    if "head_dim" in p:
        _pos_int(p, "head_dim", where)
    _bool(p, "kv", where)


def _check_packed(p: dict, where: str) -> None:
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
        _pos_int(p, "num_blocks", where)
    if "heads" in p:
        h = p["heads"]
        n = len(p["blocks"]) if "blocks" in p else p["num_blocks"]
        if not isinstance(h, (list, tuple)) or len(h) != n or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in h):
            raise PlanError(f"{where}: param 'heads' must list one positive head count per "
                            f"block ({n}), got {h!r}")
        p["heads"] = tuple(h)
        kv = p.get("kv", [False] * n)
        if not isinstance(kv, (list, tuple)) or len(kv) != n or any(
                not isinstance(x, bool) for x in kv):
            raise PlanError(f"{where}: param 'kv' must list one boolean (true or false) per "
                            f"block ({n}), got {kv!r}")
        p["kv"] = tuple(kv)
    elif "kv" in p:
        raise PlanError(f"{where}: param 'kv' of 'packed' needs 'heads'")


def _check_expert(p: dict, where: str) -> None:
    if "num_experts" in p:
        _pos_int(p, "num_experts", where)
    for k in ("num_blocks", "interleaved", "split_unit"):
        if k in p:
            _pos_int(p, k, where)
    if p.get("num_blocks", 1) > 1 and p.get("interleaved", 1) > 1:
        # one packing per split dim: halves of pairs is not a layout any loader uses
        raise PlanError(f"{where}: params 'num_blocks' and 'interleaved' are exclusive "
                        f"(block halves or interleaved pairs, not both)")
    if any(k in p for k in ("num_blocks", "interleaved", "split_unit")) and p.get("dim") is None:
        raise PlanError(f"{where}: packing params need the split 'dim' inside the expert")
    p.setdefault("dim", None)
    p.setdefault("id_regex", EXPERT_ID_REGEX)
    if not isinstance(p["id_regex"], str):
        raise PlanError(f"{where}: param 'id_regex' must be a string")
    try:
        groups = re.compile(p["id_regex"]).groups
    except re.error as e:
        raise PlanError(f"{where}: param 'id_regex' is a bad regular expression: {e}") from None
    if groups < 1:
        raise PlanError(f"{where}: param 'id_regex' must capture the expert id in group 1, "
                        f"got {p['id_regex']!r} without a group")


def _check_scale(p: dict, where: str) -> None:
    b = p.get("block", [128, 128])
    if not isinstance(b, (list, tuple)) or not b or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
        raise PlanError(f"{where}: param 'block' must be a list of positive integers, got {b!r}")
    p["block"] = tuple(b)
    if "weight" in p and not isinstance(p["weight"], str):
        raise PlanError(f"{where}: param 'weight' must be a tensor name")


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("replicate", frozenset({"stage"}), None, _place_replicate),
    Strategy("colwise", frozenset({"dim", "stage", "shared_expert"}), _check_split,
             _place_colwise),
    Strategy("rowwise", frozenset({"dim", "stage", "shared_expert"}), _check_split,
             _place_rowwise),
    Strategy("vocab", frozenset({"pad_to", "stage"}), _check_vocab, _place_vocab),
    Strategy("heads", frozenset({"num_heads", "head_dim", "kv", "dim", "stage"}), _check_heads,
             _place_heads),
    Strategy("packed", frozenset({"dim", "blocks", "num_blocks", "heads", "kv", "stage"}),
             _check_packed, _place_packed),
    Strategy("expert", frozenset({"num_experts", "dim", "id_regex", "num_blocks", "interleaved",
                                  "split_unit", "stage"}), _check_expert, _place_expert),
    Strategy("scale", frozenset({"block", "weight", "stage"}), _check_scale, None),
)}


def check_params(strategy: str, params: dict, where: str) -> dict:
    """Validate and normalise one rule's params; raise PlanError naming ``where``."""
    if not isinstance(strategy, str):
        raise PlanError(f"{where}: strategy must be a string, one of {', '.join(STRATEGIES)}; "
                        f"got {type(strategy).__name__}")
    s = STRATEGIES.get(strategy)
    if s is None:
        raise PlanError(f"{where}: unknown strategy {strategy!r}; expected one of "
                        f"{', '.join(STRATEGIES)}")
    if not isinstance(params, dict):
        raise PlanError(f"{where}: params must be an object, got {type(params).__name__}")
    unknown = set(params) - s.params
    if unknown:
        raise PlanError(f"{where}: strategy {strategy!r} does not take params {sorted(unknown)}; "
                        f"accepted: {sorted(s.params)}")
    p = dict(params)
    if "stage" in p and p["stage"] not in STAGES:
        raise PlanError(f"{where}: param 'stage' must be one of {STAGES}, got {p['stage']!r}")
    if "dim" in p and not (strategy == "expert" and p["dim"] is None):
        _nonneg_int(p, "dim", where)
    if s.check is not None:
        s.check(p, where)
    return p
