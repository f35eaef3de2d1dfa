"""Placement: which stages hold a tensor, and how its Strategy splits it into classes.

``Placer`` is the ``PlacementContext`` that ``strategies``' placement functions read: the
layout, and helpers that share classes across same-shaped tensors and name the tensor
and layout in their errors. The planner makes one per plan, after the layers and the
rule of every tensor are known."""
from __future__ import annotations

import re
from itertools import chain
from operator import itemgetter
from typing import Callable, Mapping, NamedTuple

from coordloader.checkpoint.metadata import CheckpointMeta, full_box, is_tower
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.model import Piece
from coordloader.planning.rules import Rule, num_experts_of
from coordloader.planning.strategies import (
    EXPERT_ID_REGEX,
    STRATEGIES,
    Everyone,
    TensorShape,
    dim_classes,
    fused_gate_up,
)

# a block scale's default weight: its own name without this suffix
SCALE_SUFFIX = "_scale_inv"
# a block scale's name (or digit template) -> its default weight's
scaled_weight = itemgetter(slice(0, -len(SCALE_SUFFIX)))
EXPERT_RE = re.compile(EXPERT_ID_REGEX)
# EXPERT_RE over names joined by newlines (when no name holds one)
EXPERT_LINE_RE = re.compile(EXPERT_ID_REGEX, re.MULTILINE)
_EVERYONE = Everyone()


def chunk_ranges(n: int, parts: int, uneven: bool, what: str) -> list[tuple[int, int]]:
    """[start, stop) per part: an even split, or torch.chunk semantics when ``uneven``
    (chunk size ceil(n/parts); trailing parts may be short or empty)."""
    if parts == 1:
        return [(0, n)]
    if n % parts == 0:
        c = n // parts
        return [(i * c, i * c + c) for i in range(parts)]
    if not uneven:
        raise PlanError(f"{what}: size {n} is not divisible by {parts}")
    c = -(-n // parts)
    return [(min(i * c, n), min(i * c + c, n)) for i in range(parts)]


LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer index in a tensor's name, or None for a tensor of no decoder
    layer. A vision or audio tower's blocks are no decoder layers: they are neither
    counted against num_hidden_layers nor spread over the pipeline stages by their block
    index."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m and not tower_blocks(name, m.start()) else None


def tower_blocks(name: str, at: int) -> bool:
    """Whether the layer index LAYER_RE found at ``at`` in ``name`` (a name or digit
    template) numbers a tower's blocks: the tower is named before it. A decoder layer's
    own vision weights (CogVLM's ``layers.N.mlp.vision_mlp``) are named after it."""
    return is_tower(name[:at + 1])


class Layers(NamedTuple):
    """The checkpoint's layers as the planner found them."""
    layer_of: Callable[[str], int | None]   # tensor name -> layer index (layer_index)
    num_layers: int            # config.json's num_hidden_layers (MTP layers are past it)
    stage_of: list[int]        # layer index -> pipeline stage


class Placer:
    """Places the tensors of one plan: ``place(name)`` -> (stages, selector, classes,
    strategy), or None for a tensor left out. Classes are shared across same-shaped
    tensors, and a weight with a block scale is placed once for both."""

    def __init__(self, meta: CheckpointMeta, layout: Layout, config: Mapping,
                 match: Mapping[str, tuple[Rule, dict]], layers: Layers, tied: bool,
                 mtp_prefix: str | None = None,
                 templates: Mapping[str, list[str]] | None = None, untemplated=()):
        self.meta = meta
        self.L = layout
        self.config = config
        self.match = match              # tensor name -> (its rule, the rule's params)
        self.layer_of, self.num_layers, self.stage_of = (layers.layer_of, layers.num_layers,
                                                         layers.stage_of)
        self.tied = tied                # the lm_head reads the input embedding
        self.mtp_prefix = mtp_prefix    # names of MTP draft tensors (MTP_PREFIX)
        self._placed: dict[str, tuple] = {}
        # the weights that have a block scale (whose placement the scale looks up again);
        # SCALE_SUFFIX holds no digit, so a template ends with it where its names do
        self._scaled = (set(chain.from_iterable(map(scaled_weight, members) for t, members
                                                in templates.items() if t.endswith(SCALE_SUFFIX)))
                        if templates is not None else
                        {scaled_weight(n) for n in meta.tensors if n.endswith(SCALE_SUFFIX)})
        self._scale_memo: dict = {}
        self._owners: dict = {}
        self._id_res: dict[str, re.Pattern] = {}
        self._named_experts: dict[str, int] = {}   # id_regex -> largest id in names + 1
        # digit template -> its names, and the names of no template (planner's groups)
        self._templates, self._untemplated = templates, untemplated
        self._checked_E: set[int] = set()
        self._config_E = num_experts_of(config)
        self._wcache: dict = {}
        self._scache: dict = {}

    def err(self, msg: str, name: str) -> PlanError:
        return PlanError(f"{msg} (layout {self.L})", tensor=name)

    def compiled(self, pattern: str) -> re.Pattern:
        rx = self._id_res.get(pattern)
        if rx is None:
            rx = self._id_res[pattern] = re.compile(pattern)
        return rx

    def config_num_experts(self) -> int | None:
        return self._config_E

    def _stages(self, n: str, params: Mapping) -> tuple[int, ...] | None:
        """Stages holding tensor ``n``; None = excluded (MTP layers)."""
        pp = self.L.pp
        if self.mtp_prefix and n.startswith(self.mtp_prefix):
            return (pp - 1,)   # the planner left them out unless include_mtp
        st = params.get("stage")
        li = self.layer_of(n)
        if li is not None and li >= self.num_layers and not self.L.include_mtp:
            return None   # an MTP layer, whatever stage a rule gives it
        if li is not None and li < self.num_layers:
            # a decoder layer's tensors go where the layer runs, whatever stage a rule
            # gives: a rule meant for a non-layer tensor (`*norm*` for model.norm, stage
            # last) left the other stages without their layers' norms
            return (self.stage_of[li],)
        if li is not None and st in (None, "layer"):
            return (pp - 1,)
        if st == "all":
            return tuple(range(pp))
        tower = is_tower(n)
        if st == "layer":
            # a non-layer tensor has no layer to follow: it went to the last stage unasked
            raise self.err("rule says stage 'layer' but " + (
                "the tensor is a vision or audio tower's, whose blocks are no decoder layers"
                if tower else "the tensor's name holds no layer index (layers.N., layer.N., "
                "h.N. or blocks.N.)") + "; give it 'first', 'last' or 'all'", n)
        if st is None:
            if tower:
                # vLLM builds the tower on every stage (only the first runs it), and its
                # loaders must fill every stage's copy
                return tuple(range(pp))
            st = "first" if "embed" in n else "last"
        if st == "first":
            if self.tied and li is None and n.endswith("embed_tokens.weight") and pp > 1:
                return (0, pp - 1)   # tied embeddings: the last stage's lm_head reads it too
            return (0,)
        return (pp - 1,)

    def place(self, n: str):
        """-> (stages, selector, classes, strategy) or None when excluded. Memoised: scale
        tensors reuse their weight's placement."""
        got = self._placed.get(n)
        if got is not None or n in self._placed:
            return got
        rule, params = self.match[n]
        t = TensorShape(n, self.meta.tensors.shape(n))
        strategy = rule.strategy
        if STRATEGIES[strategy].place is None:   # a block scale: follows its weight
            res = self.scale(t, params)
        else:
            stages = self._stages(n, params)
            if stages is None:
                res = None
            else:
                selector, classes = STRATEGIES[strategy].place(self, t, params)
                res = (stages, selector, classes, strategy)
        # only weights that have a scale are looked up again; keep memory modest
        if n in self._scaled:
            self._placed[n] = res
        return res

    def whole(self, t: TensorShape):
        # classes depend only on the shape: share them (and their Piece objects) across the
        # thousands of same-shaped tensors (experts)
        c = self._wcache.get(t.shape)
        if c is None:
            c = self._wcache[t.shape] = [(t.shape, (Piece(full_box(t.shape),
                                                          (0,) * len(t.shape)),))]
        return _EVERYONE, c

    def split_dim(self, t: TensorShape, dim: int, parts: int, what: str):
        """Classes of an even (or chunked) split of ``dim`` into ``parts`` (shared per shape)."""
        key = (t.shape, dim, parts)
        c = self._scache.get(key)
        if c is None:
            c = self._scache[key] = self._split_dim_new(t, dim, parts, what)
        return c

    def chunks(self, t: TensorShape, n: int, parts: int, what: str) -> list[tuple[int, int]]:
        """``chunk_ranges`` of ``n`` into ``parts``, its error naming the tensor and layout."""
        try:
            return chunk_ranges(n, parts, self.L.allow_uneven, what)
        except PlanError as e:
            raise self.err(e.message, t.name) from None

    def _split_dim_new(self, t: TensorShape, dim: int, parts: int, what: str):
        if dim >= len(t.shape):
            raise self.err(f"split dim {dim} out of range for shape {list(t.shape)}", t.name)
        return dim_classes(t.shape, dim, self.chunks(t, t.shape[dim], parts,
                                                       f"{what} of dim {dim} (shape {list(t.shape)})"))

    def head_split(self, n_size: int, heads: int, kv: bool, name: str, what: str):
        """-> (g: tp rank -> class, ranges per class) for whole-head splitting of a dim of
        ``n_size`` holding ``heads`` heads."""
        tp = self.L.tp
        if n_size % heads:
            raise self.err(f"{what}: size {n_size} is not a multiple of num_heads={heads}", name)
        hd = n_size // heads
        if tp <= heads:
            if heads % tp:
                raise self.err(f"{what}: {heads} heads are not divisible by tp={tp}", name)
            per = heads // tp
            return tuple(range(tp)), [(j * per * hd, (j + 1) * per * hd) for j in range(tp)]
        if not kv:
            raise self.err(f"{what}: tp={tp} exceeds the {heads} heads", name)
        if tp % heads:
            raise self.err(f"{what}: tp={tp} is not a multiple of the {heads} K/V heads, so they "
                            f"cannot be replicated evenly", name)
        rep = tp // heads
        return tuple(t // rep for t in range(tp)), [(h * hd, (h + 1) * hd) for h in range(heads)]

    def experts_count(self, t: TensorShape, p) -> int:
        E = p.get("num_experts")
        if E is None:
            E = self._config_E
        if E in self._checked_E:   # every tensor of an expert rule asks: checked once per E
            return E
        rx = p.get("id_regex", EXPERT_ID_REGEX)
        named = self._named_experts.get(rx)
        if named is None:
            # the largest expert id in the names + 1; for the default pattern one scan of
            # all names joined (a search per name cost more than the rest of the expert
            # placements together), for a rule's own the names that rule matches
            named = self._named_experts[rx] = 1 + (self._largest_expert_id()
                                                    if rx == EXPERT_ID_REGEX else
                                                    self._largest_id_of(rx))
        if E is None:
            E = named
        elif named and E > named:
            # config.json (or a rule) claiming more experts than the names hold would leave
            # ranks without experts; checked before the placement tables, sized by E
            raise self.err(f"config.json / rule says {E} experts but the checkpoint's tensor "
                            f"names hold expert ids 0..{named - 1} only", t.name)
        if E not in self._checked_E:
            try:
                self.L.check_experts(E)
            except PlanError as e:
                raise self.err(e.message, t.name) from None
            self._checked_E.add(E)
        return E

    def _largest_id_of(self, pattern: str) -> int:
        """The largest expert id a rule's own ``id_regex`` reads from the names matched by
        a rule of that pattern, -1 for none."""
        rx = self.compiled(pattern)
        top = -1
        for n in self.match:
            if self.match[n][1].get("id_regex") == pattern:
                m = rx.search(n)
                g = m.group(1) if m else None
                if g is not None and g.isdigit() and g.isascii():
                    top = max(top, int(g))
        return top

    def _largest_expert_id(self) -> int:
        """The largest expert id in the checkpoint's names (EXPERT_RE, every match), -1
        for none. EXPERT_RE has no digit literal, so it matches a digit template where it
        matches each of its names, and the largest id of a match is the largest of its
        digit strings (of one width in a template); the names outside the templates are
        scanned joined."""
        names = self.meta.tensors
        groups, rest = self._templates, self._untemplated
        if groups is None or sum(map(len, groups.values())) + len(rest) != len(names):
            groups, rest = {}, names
        top = -1
        for t, members in groups.items():
            for m in EXPERT_RE.finditer(t):
                a, b = m.span(1)
                top = max(top, int(max(map(itemgetter(slice(a, b)), members))))
        joined = "\n".join(rest)
        if joined.count("\n") == max(len(rest) - 1, 0):   # no name holds a newline
            ids = EXPERT_LINE_RE.findall(joined)
        else:
            ids = [m.group(1) for n in rest for m in EXPERT_RE.finditer(n)]
        return max(top, max(map(int, ids), default=-1))

    def expert_owners(self, e: int, E: int) -> tuple[int, ...]:
        """``L.owners_of(e, E)``, memoised: asked once per expert tensor."""
        k = (e, E)
        o = self._owners.get(k)
        if o is None:
            o = self._owners[k] = self.L.owners_of(e, E)
        return o

    def packed_ranges(self, t: TensorShape, tdim: int, size: int, p, what: str):
        """Per moe_tp rank, the [start, stop) ranges of dim ``tdim`` (of ``size``) it holds,
        in local order, as the rule declares the packing inside each expert:
        ``num_blocks`` equal blocks (gate and up halves: each block split on its own, the
        parts concatenated), or runs of ``interleaved`` consecutive rows (gate/up pairs: the
        split moves by whole runs, so every rank keeps both members of its pairs).
        ``split_unit`` makes the split move by that many runs (rows, without interleaving)
        at a time: MXFP4 storage splits the intermediate dim only on its 32-element blocks,
        i.e. 32 gate/up pairs.
        A gate_up tensor declared neither way is refused: a plain split would hand a rank
        gate rows only, or pairs cut in half."""
        nb = p.get("num_blocks") or 1
        k = p.get("interleaved") or 1
        unit = p.get("split_unit") or 1
        if nb == 1 and k == 1 and fused_gate_up(t.name):
            raise self.err(f"fused expert tensor packs gate and up on dim {tdim}; splitting "
                            f"it over moe_tp={self.L.moe_tp} needs the rule to declare how "
                            f"(param num_blocks=2 for halves, interleaved=2 for pairs)", t.name)
        if size % nb:
            raise self.err(f"dim {tdim} of size {size} does not hold {nb} equal packed "
                            f"blocks", t.name)
        bs = size // nb
        step = k * unit
        if bs % step:
            raise self.err(f"dim {tdim} of size {size} does not hold whole split units of "
                            f"{step} rows (interleaved={k} x split_unit={unit}, per block of "
                            f"{bs})", t.name)
        per = self.chunks(t, bs // step, self.L.moe_tp,
                           f"{what}: {bs // step} units of {step} rows per packed block "
                           f"({nb} blocks) over moe_tp={self.L.moe_tp}")
        return [tuple((j * bs + a * step, j * bs + b * step) for j in range(nb))
                for a, b in per]

    @staticmethod
    def scale_weight(n: str, p) -> str | None:
        """The weight whose placement the block scale ``n`` (rule params ``p``) follows."""
        return p.get("weight") or (scaled_weight(n) if n.endswith(SCALE_SUFFIX) else None)

    def scale(self, t: TensorShape, p):
        n = t.name
        wname = self.scale_weight(n, p)
        if wname is None or wname not in self.meta.tensors:
            raise self.err(f"block scale without its weight {wname!r}", n)
        if wname not in self.match:
            raise self.err(f"weight {wname!r} of this scale has no rule", n)
        if self.match[wname][0].strategy == "scale":
            raise self.err(f"weight {wname!r} of this scale is itself a scale", n)
        wp = self.place(wname)
        if wp is None:
            return None
        stages, selector, wclasses, _ = wp
        w = TensorShape(wname, self.meta.tensors.shape(wname))
        # the scale's classes follow from the weight's classes and the two shapes: shared,
        # like the weight's, across the same-shaped tensors of a rule. The memo holds the
        # weight's classes and the params it is keyed by: a weight named by a rule's
        # "weight" param is not kept in _placed, and an id is unique only while its
        # object lives
        key = (id(wclasses), w.shape, t.shape, id(p))
        got = self._scale_memo.get(key)
        if got is None:
            got = self._scale_memo[key] = (wclasses, p, self._scale_classes(t, p, w, wclasses))
        return stages, selector, got[2], "scale"

    def _scale_classes(self, t: TensorShape, p, w: TensorShape, wclasses):
        n, wname = t.name, w.name
        nd = len(w.shape)
        if len(t.shape) != nd:
            raise self.err(f"scale shape {list(t.shape)} does not match weight {wname!r} shape "
                            f"{list(w.shape)}", n)
        blk = list(p["block"])
        if len(blk) > nd:
            blk = blk[-nd:] if nd else []
        B = [1] * (nd - len(blk)) + blk
        want = tuple(-(-w.shape[i] // B[i]) for i in range(nd))
        if tuple(t.shape) != want:
            raise self.err(f"scale shape {list(t.shape)} is not weight {wname!r} shape "
                            f"{list(w.shape)} in {B} blocks (expected {list(want)})", n)
        if wclasses is self._wcache.get(w.shape):
            return self.whole(t)[1]
        classes = []
        for ls, pieces in wclasses:
            sp = []
            for pc in pieces:
                box = []
                for i, (a, b) in enumerate(pc.src):
                    if a % B[i] or (b % B[i] and b != w.shape[i]) or pc.dst[i] % B[i]:
                        raise self.err(
                            f"weight {wname!r} (shape {list(w.shape)}) is split into per-rank "
                            f"size {b - a} at offset {a} along dim {i}, not a multiple of the "
                            f"{B[i]}-element quantisation block, so its scale {list(t.shape)} "
                            f"cannot follow", n)
                    box.append((a // B[i], -(-b // B[i])))
                sp.append(Piece(tuple(box), tuple(pc.dst[i] // B[i] for i in range(nd)), pc.copy))
            for i in range(nd):
                if ls[i] % B[i] and any(pc.dst[i] + pc.src[i][1] - pc.src[i][0] != ls[i] for pc in pieces):
                    raise self.err(f"weight {wname!r} local size {ls[i]} along dim {i} is not a "
                                    f"multiple of the {B[i]}-element block", n)
            classes.append((tuple(-(-ls[i] // B[i]) for i in range(nd)), tuple(sp)))
        return classes
