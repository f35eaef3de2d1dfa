"""The planner: checkpoint metadata + layout + rules -> Plan (pure: no I/O, no
torch.distributed; ``coordloader.make_plan`` reads the headers of a path first).

For each tensor the planner derives a *placement*: the pipeline stages that hold it, a
*selector* mapping every rank of those stages to a *class* (or to nothing), and per class
the local shape and the pieces (source box -> destination offset). Ranks of one class hold
identical pieces; the lowest such rank holds the primary copy (replica 0), the others
replicas 1, 2, ... in rank order. Selectors repeat across tensors, so the rank groups of a
(stages, selector) pair are computed once and shared, and byte runs are computed once per
class and shared by every replica. Ranks that fall in the same class of every tensor (DP
replicas without ep_spans_dp, redundant expert copies, ...) form a *rank class* and share
one SharedSlices: cost grows with the distinct slices, not with the world size.
"""
from __future__ import annotations

import re
import warnings
from itertools import accumulate, chain, compress, repeat
from math import prod
from operator import add, attrgetter, eq, itemgetter, sub
from typing import Any, Mapping, NamedTuple

import numpy as np

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.metadata import (
    CheckpointMeta,
    TensorInfo,
    check_extents,
    full_box,
)
from coordloader.errors import PlanError
from coordloader.gcpause import gc_paused
from coordloader.layout import Layout
from coordloader.planning.model import (
    Form,
    LoadGroup,
    Plan,
    SharedRankPlan,
    SharedSlices,
    SliceColumns,
)
from coordloader.planning.placement import (
    EXPERT_RE,
    LAYER_RE,
    SCALE_SUFFIX,
    Layers,
    Placer,
    layer_index,
    scaled_weight,
    tower_blocks,
)
from coordloader.planning.rankgroups import RankGroups, dedupe, rank_classes
from coordloader.planning.rules import Rule, RuleSet, make_rule, resolve_rules
from coordloader.planning.rules.presets import MTP_PREFIX, missing_config_error, storage_problem
from coordloader.planning.rules.ruleset import digit_template, digit_templates
from coordloader.planning.runs import slice_runs
from coordloader.planning.store import SliceStore
from coordloader.planning.strategies import EXPERT_ID_REGEX, TensorShape
from coordloader.text import MAX_NAME_CHARS, clip

_REPLICATE = make_rule("*", "replicate", source="replicate_unmatched")
# a family key's head: the names' layer index start, rule, shape, dtype, stage (or "s" for
# a block scale, whose weight's key says its stage)
_KEY_HEAD = "{}|{}|{!r}|{!r}|{}|"


def build_plan(meta: CheckpointMeta, layout: Layout, rules: Any = None, *,
               replicate_unmatched: bool = False) -> Plan:
    """Plan which slice of which tensor every rank of ``layout`` holds. Pure: the checkpoint
    comes as its metadata and a rule file as its parsed content (``coordloader.make_plan``
    takes paths and reads them first).

    ``rules``: None (preset detected from config.json), a preset name, a parsed rule file
    (Mapping), a list of rules, or a RuleSet. Tensors no rule matches are an error unless
    ``replicate_unmatched``. Raises PlanError naming tensor, size and layout."""
    if not isinstance(meta, CheckpointMeta):
        raise PlanError(f"checkpoint metadata must be a CheckpointMeta, got "
                        f"{type(meta).__name__} (coordloader.make_plan takes a path)")
    if not isinstance(layout, Layout):
        raise PlanError(f"layout must be a coordloader.Layout, got {type(layout).__name__}")
    if meta.config is not None and not isinstance(meta.config, Mapping):
        raise PlanError(f"config.json must hold a JSON object, got {type(meta.config).__name__}")
    check_extents(meta)
    ruleset = resolve_rules(meta.config, rules)
    # The planner allocates hundreds of thousands of small objects that all stay alive;
    # the cyclic GC would rescan them over and over (it was a third of planning time).
    with gc_paused():
        return _Planner(meta, layout, ruleset, replicate_unmatched).run()


class _ByTemplate(Mapping):
    """Tensor name -> (its rule, the rule's params) for the planned names, when no rule
    reads digits: one entry per digit template, read through the name's template (a dict
    of every name cost more than the rest of rule matching)."""

    def __init__(self, of_template: dict, names: list[str], tensors: Mapping,
                 left_out: str | None):
        self._of, self._names, self._tensors, self._left_out = of_template, names, tensors, left_out

    def __contains__(self, name) -> bool:
        # the planned names: the checkpoint's, less those left out under a prefix (MTP)
        return (isinstance(name, str) and name in self._tensors
                and not (self._left_out is not None and name.startswith(self._left_out)))

    def __getitem__(self, name: str) -> tuple[Rule, dict]:
        if name not in self:
            raise KeyError(name)
        return self._of[digit_template(name)]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class Family(NamedTuple):
    """Tensors placed alike (``_Planner._families``), placed once: a layer family, or
    one tensor on its own. Same shape and dtype throughout."""
    names: list[str]         # its tensors, in name order
    places: list[int]        # their places in the plan's names
    classes: list            # per class: (local shape, pieces)
    table: int               # replica table index
    strategy: str


class Placed(NamedTuple):
    """What pass 1 of the planner found."""
    excluded: list[str]      # tensors left out on purpose (MTP layers), in name order
    families: list[Family]   # in the order of their first names
    tables: list             # replica table index -> rank groups of its classes


class _Planner:
    def __init__(self, meta: CheckpointMeta, layout: Layout, rules: RuleSet, replicate_unmatched: bool):
        self.meta = meta
        self.L = layout
        self.rules = rules
        self.replicate_unmatched = replicate_unmatched
        self.config = dict(meta.config or {})
        self.world = layout.world_size
        self.table = meta.table()
        if layout.tp > 1:
            # checked before RankGroups' per-rank table, which is proportional to tp
            big = max(map(max, filter(None, self.table.shapes)), default=0)
            if layout.tp > big:
                raise PlanError(f"layout: tp={layout.tp} exceeds the largest dim of any tensor "
                                f"of the checkpoint ({big}): no tensor can be split that many ways")
        self.rank_groups = RankGroups(layout)
        self._rule_params = [r.param_dict for r in rules.rules]

    # -- driver --------------------------------------------------------------
    def run(self) -> Plan:
        rows = self.table.names
        row = sorted(range(len(rows)), key=rows.__getitem__)   # place -> its table row
        names = list(map(rows.__getitem__, row))
        mtp = MTP_PREFIX.get(self.rules.preset)
        left_out = []   # MTP draft tensors under a prefix: left out before rule matching
        if mtp and not self.L.include_mtp:
            left_out = [n for n in names if n.startswith(mtp)]
            if left_out:
                kept = [not n.startswith(mtp) for n in names]
                names, row = list(compress(names, kept)), list(compress(row, kept))
        self.row = np.array(row, dtype=np.intp)
        templates = digit_templates(names)
        places: dict[str, list[int]] = {}   # digit template -> its names' places in names
        for i, t in enumerate(templates):
            places.setdefault(t, []).append(i)
        # digit template -> its names, in name order
        groups = {t: list(map(names.__getitem__, p)) for t, p in places.items()}
        layers, spans = self._find_layers(groups)
        tied = self._tied()
        # match rules first: unmatched names fail before any work
        match = self._match_rules(names, places, mtp if left_out else None)
        bad = storage_problem(self.rules.preset, self.config, names)
        if bad and match[bad[0]][0].source.startswith("preset:"):
            raise PlanError(f"{bad[1]}: vLLM loads the experts by the config's storage, and the "
                            f"preset splits them so; a config of the other storage would split "
                            f"gate/up and down_proj on different intermediate ranges. Give this "
                            f"checkpoint's own config.json (layout {self.L})",
                            file="config.json", tensor=bad[0])
        placer = Placer(self.meta, self.L, self.config, match, layers, tied, mtp, groups,
                        left_out)
        families = self._families(names, groups, places, spans, placer, layers)
        placed = self._place_all(names, placer, families)
        if left_out:
            placed = placed._replace(excluded=sorted(placed.excluded + left_out))
        return self._assemble(placed)

    def _find_layers(self, groups: dict[str, list[str]]) -> tuple[Layers, dict[str, tuple[int, int]]]:
        """The number of layers and each layer's stage, checking config.json's
        num_hidden_layers against the names and the layout; and per digit template of layer
        tensors the [start, stop) of the layer index in its names. LAYER_RE has no digit
        literal, so it matches a template where it matches each of its names: the index is
        found once per template, and its largest value is the largest of the digit strings
        (of one width in a template)."""
        spans: dict[str, tuple[int, int]] = {}
        search = LAYER_RE.search
        max_layer = -1
        for t, members in groups.items():
            m = search(t)
            if m and not tower_blocks(t, m.start()):   # no decoder layers
                a, b = spans[t] = m.span(1)
                max_layer = max(max_layer, int(max(map(itemgetter(slice(a, b)), members))))
        any_layer = bool(spans)
        nl = self.config.get("num_hidden_layers")
        if nl is None and not any_layer:
            nl = 0
        if nl is None:
            nl = max_layer + 1
        if isinstance(nl, bool) or not isinstance(nl, int) or nl < 0:
            raise PlanError(f"config.json: num_hidden_layers must be a non-negative integer, got "
                            f"{clip(repr(nl), MAX_NAME_CHARS)}")
        if any_layer and nl > max_layer + 1:
            # checked before stage_of, which is proportional to nl
            raise PlanError(f"config.json: num_hidden_layers={nl} but the checkpoint's tensor "
                            f"names hold layers 0..{max_layer} only; expected at most "
                            f"{max_layer + 1}")
        mtp = self.config.get("num_nextn_predict_layers") or 0
        if any_layer and max_layer + 1 > nl + (mtp if type(mtp) is int and mtp > 0 else 0):
            # layers past num_hidden_layers are left out as multi-token-prediction layers;
            # without num_nextn_predict_layers saying so, that would drop real layers
            raise PlanError(f"config.json: num_hidden_layers={nl} (num_nextn_predict_layers="
                            f"{mtp}) but the checkpoint's tensor names hold layers "
                            f"0..{max_layer}; expected the config of this checkpoint (layers "
                            f"past num_hidden_layers are only left out as MTP layers when "
                            f"num_nextn_predict_layers covers them)")
        # no layer tensors: nothing reads stage_of, but the layout checks (pp vs layers) hold
        stage_of = [0] * nl if any_layer else []
        if nl:
            for s, rg in enumerate(self.L.stage_layers(nl)):
                for li in rg if any_layer else ():
                    stage_of[li] = s
        elif self.L.pp > 1 and any_layer:
            raise PlanError(f"layout: pp={self.L.pp} but config.json says num_hidden_layers=0")
        return Layers(layer_index, nl, stage_of), spans

    def _tied(self) -> bool:
        """Whether the input embedding is also the lm_head (the last stage reads it too)."""
        tie = self.config.get("tie_word_embeddings", True)
        if tie is not None and not isinstance(tie, bool):   # null: not tied, as before
            raise PlanError(f"config.json: tie_word_embeddings must be true or false, got "
                            f"{clip(repr(tie), MAX_NAME_CHARS)}")
        return bool(self.rules.preset != "bert" and tie and "lm_head.weight" not in self.meta.tensors)

    def _match_rules(self, names: list[str], places: dict[str, list[int]],
                     left_out: str | None) -> Mapping[str, tuple[Rule, dict]]:
        """Tensor name -> (its rule, the rule's params); raises naming the unmatched tensors,
        warns of user rules that match nothing. When no rule reads digits, each digit
        template is matched once, and a name's rule is its template's (``_ByTemplate``)."""
        rules = self.rules
        pair = dict(enumerate(zip(rules.rules, self._rule_params)))
        pair[None] = (_REPLICATE, {})
        if rules.digit_blind:
            found = {t: rules.match(t) for t in places}
            hits = set(found.values())
            unmatched = ([names[i] for i in sorted(chain.from_iterable(
                places[t] for t, k in found.items() if k is None))] if None in hits else [])
            match = _ByTemplate({t: pair[k] for t, k in found.items()}, names, self.meta.tensors,
                                left_out)
        else:
            found = rules.match_all(names)   # name by name: a rule reads digits
            hits = set(found)
            unmatched = [n for n, k in zip(names, found) if k is None] if None in hits else []
            match = dict(zip(names, map(pair.__getitem__, found)))
        hits.discard(None)
        if self.replicate_unmatched:
            unmatched = []
        if unmatched and not self.meta.config and self.rules.preset is None:
            raise missing_config_error(None, tensor=unmatched[0], config=self.meta.config)
        if unmatched:
            more = (f" (and {len(unmatched) - 1} more: {', '.join(unmatched[1:4])}...)"
                    if len(unmatched) > 1 else "")
            raise PlanError(f"no sharding rule matches this tensor{more}; preset "
                            f"{self.rules.preset or 'none detected'}; add a rule (rules=...), or pass "
                            f"replicate_unmatched=True / --replicate-unmatched only if every "
                            f"unmatched tensor should be held whole on every rank (not split; "
                            f"layout {self.L})",
                            tensor=unmatched[0])
        for i in range(self.rules.user_count):
            if i not in hits:
                r = self.rules.rules[i]
                rx = re.compile(r.regex_text)
                won = next(filter(rx.fullmatch, names), None)
                if won is None:
                    why = "matches no tensor of the checkpoint"
                else:   # first match wins: an earlier rule took every tensor it matches
                    w = self.rules.rules[self.rules.match(won)]
                    why = (f"takes no tensor: an earlier rule, {clip(repr(w.pattern), MAX_NAME_CHARS)} "
                           f"({w.strategy}), matches the tensors it matches (e.g. "
                           f"{clip(won, MAX_NAME_CHARS)}) first")
                warnings.warn(f"sharding rule {clip(repr(r.pattern), MAX_NAME_CHARS)} "
                              f"({r.strategy}, from {clip(str(r.source), MAX_NAME_CHARS)}) "
                              f"{why}", stacklevel=4)
        return match

    def _place_all(self, names: list[str], placer: Placer, families: list[list[int]]) -> Placed:
        """Pass 1: each family's classes and rank groups, placed through its first name; a
        replica table per distinct rank-groups object (selectors repeat, so there are
        few). DeepSeek-V3's 92 k tensors are 155 families at ep=8."""
        excluded: list[str] = []
        placed = []
        table_of: dict[int, int] = {}
        tables: list = []          # rank groups per table
        dedupe_memo: dict = {}
        for at in families:
            members = list(map(names.__getitem__, at))
            pl = placer.place(members[0])
            if pl is None:
                excluded += members
                continue
            stages, selector, classes, strategy = pl
            classes, groups = dedupe(classes, self.rank_groups(stages, selector, len(classes)),
                                      dedupe_memo)
            k = table_of.get(id(groups))
            if k is None:
                k = table_of[id(groups)] = len(tables)
                tables.append(groups)
            placed.append(Family(members, at, classes, k, strategy))
        excluded.sort()
        return Placed(excluded, placed, tables)

    def _families(self, names: list[str], groups: dict[str, list[str]],
                  places: dict[str, list[int]], spans: dict[str, tuple[int, int]],
                  placer: Placer, layers: Layers) -> list[list[int]]:
        """The tensors placed alike, as their places in ``names`` (ascending), in the
        order of their first places; a name of no family is one on its own.

        A placement reads the tensor's rule, shape and name, and the stage of its layer;
        the name only around the layer index (strategies match "embed", "gate_up" and the
        default expert id pattern, none of which spans a layer's digits). So the same
        tensor of different layers in one stage, matched by the same rule, is placed
        alike: a family's key is the name around its layer index, the rule, shape, dtype
        and stage. Not so for a user's expert ``id_regex`` (it may read the layer's
        digits). A block scale follows its weight: its family is its weight's family
        and its own rule, shape and dtype (a rule may single out one layer's weight; a
        weight placed on its own places its scale on its own). Families are found a
        digit template at a time (``_by_key``), per-expert tensors by the ranks owning
        their expert (``_by_owners``); a template whose names match different rules (a
        rule that reads digits) is placed name by name."""
        match = placer.match
        nl, stage_of = layers.num_layers, layers.stage_of
        one_stage = self.L.pp == 1
        blind = self.rules.digit_blind   # a template's names match one rule
        parts: dict = {}   # family key -> the places of its members, a list per template
        scales = []
        for t, (a, b) in spans.items():
            members = groups[t]
            rule, params = match[members[0]]
            if not blind:   # a rule that reads digits may match some names only
                rules = list(map(id, map(itemgetter(0), map(match.__getitem__, members))))
                if rules.count(id(rule)) != len(rules):
                    continue
            strategy = rule.strategy
            if strategy == "expert" and params["id_regex"] != EXPERT_ID_REGEX:
                continue
            if strategy == "scale":
                if not params.get("weight") and t.endswith(SCALE_SUFFIX):
                    scales.append((t, rule))
                continue
            at = places[t]
            shapes, dtypes = self._shapes_dtypes(at)
            digits = list(map(itemgetter(slice(a, b)), members))
            if one_stage and int(max(digits)) < nl:
                stages = None   # every name's is 0
            else:   # -1: past num_hidden_layers (MTP layers)
                stage_at = {}   # per layer's digits (a template holds a few layers)
                for d in set(digits):
                    li = int(d)
                    stage_at[d] = stage_of[li] if li < nl else -1
                stages = list(map(stage_at.__getitem__, digits))
            if type(shapes) is not list and strategy == "expert" and self._by_owners(
                    parts, (a, id(rule), shapes, dtypes), t, a, b, members, at, stages,
                    placer, params):
                continue
            rest = _name_rest(t, a, b, members)
            if type(shapes) is not list:   # one shape and dtype
                if stages is None:
                    _by_key(parts, _KEY_HEAD.format(a, id(rule), shapes, dtypes, 0), rest, at)
                    continue
                head_of = {st: _KEY_HEAD.format(a, id(rule), shapes, dtypes, st)
                           for st in set(stages)}
                heads = list(map(head_of.__getitem__, stages))
            else:
                heads = list(map(_KEY_HEAD.format, repeat(a), repeat(id(rule)), shapes, dtypes,
                                 stages or repeat(0)))
            _by_key(parts, None, list(zip(heads, rest if type(rest) is list else repeat(rest))),
                    at)
        families = [p[0] if len(p) == 1 else sorted(chain.from_iterable(p))
                    for p in parts.values()]
        if scales:
            families += self._scale_families(names, groups, places, spans, scales, families)
        in_family = np.zeros(len(names), dtype=bool)
        if families:
            in_family[np.fromiter(chain.from_iterable(families), dtype=np.intp)] = True
        families += [[i] for i in np.flatnonzero(~in_family).tolist()]
        families.sort(key=itemgetter(0))
        return families

    def _by_owners(self, parts: dict, head: tuple, t: str, a: int, b: int,
                   members: list[str], at: list[int], stages: list[int] | None,
                   placer: Placer, params: Mapping) -> bool:
        """Add the places ``at`` of template ``t``'s per-expert tensors to ``parts``
        (``_families``) keyed by ``head`` (layer index start, rule, shape, dtype) with the
        stage, the name less its layer and expert ids, and the ranks owning the expert.
        Experts of one owner set place alike (``ByExpertOwner``), so a family holds every
        expert of an owner set, not one expert (DeepSeek-V3's 1.5 k expert families at ep=8
        are 96). False (keyed by name, as any template) where an id or the expert count is
        wrong: its placement raises there, naming the tensor."""
        m = EXPERT_RE.search(t)
        if m is None:
            return False
        ea, eb = m.span(1)
        digits = list(map(itemgetter(slice(ea, eb)), members))
        try:
            E = placer.experts_count(TensorShape(members[0], self.meta.tensors.shape(members[0])),
                                     params)
        except PlanError:
            return False
        sets: dict[tuple[int, ...], int] = {}   # owner set -> its index
        set_of = {}   # expert id digits -> its owner set's index
        for d in set(digits):
            e = int(d)
            o = placer.expert_owners(e, E) if e < E else None
            if not o:
                return False
            set_of[d] = sets.setdefault(o, len(sets))
        code = np.fromiter(map(set_of.__getitem__, digits), dtype=np.intp, count=len(digits))
        (i, j), (k, n) = sorted(((a, b), (ea, eb)))
        if "0" in t[:i] + t[j:k] + t[n:]:   # other digits: the name part is each one's own
            index: dict[str, int] = {}
            code += np.array([index.setdefault(c, len(index)) for c in map(add, map(add, map(
                itemgetter(slice(0, i)), members), map(itemgetter(slice(j, k)), members)), map(
                itemgetter(slice(n, None)), members))], dtype=np.intp) * len(sets)
            cut = list(index)
        else:
            cut = [members[0][:i] + members[0][j:k] + members[0][n:]]
        span = len(sets) * len(cut)
        if stages is not None:   # -1: MTP layers
            code += (np.array(stages, dtype=np.intp) + 1) * span
        owners = list(sets)
        for c, got in _grouped(code, at):
            st, c = divmod(c, span)
            key = (_KEY_HEAD.format(*head, st - 1 if stages is not None else 0),
                   (cut[c // len(sets)], owners[c % len(sets)]))
            parts.setdefault(key, []).append(got)
        return True

    def _shapes_dtypes(self, at: list[int]) -> tuple:
        """The shape and dtype of the tensors at places ``at`` when they share them, else
        a list of each one's."""
        t = self.table
        rows = self.row[at]
        shape, dtype = t.shape[rows], t.dtype[rows]
        if (shape == shape[0]).all() and (dtype == dtype[0]).all():
            return t.shapes[shape[0]], t.dtypes[dtype[0]]
        return (list(map(t.shapes.__getitem__, shape.tolist())),
                list(map(t.dtypes.__getitem__, dtype.tolist())))

    def _scale_families(self, names, groups, places, spans, scales, families) -> list:
        """The families of block scales (``_families``): those of one weight family and
        one rule, shape and dtype; a scale whose weight has no family has none."""
        family_of = np.full(len(names), -1, dtype=np.intp)   # place -> its family
        family_of[np.fromiter(chain.from_iterable(families), dtype=np.intp)] = np.repeat(
            np.arange(len(families)), list(map(len, families)))
        place_of = None
        parts: dict = {}
        for t, rule in scales:
            a, _ = spans[t]
            members = groups[t]
            weights = list(map(scaled_weight, members))
            wt = scaled_weight(t)
            if groups.get(wt) == weights:   # the weights are a template's names, in order
                wat = places[wt]
            else:   # some weights have no scale, or some scales no weight
                if place_of is None:
                    place_of = dict(zip(names, range(len(names))))
                wat = list(map(place_of.get, weights, repeat(-1)))
            at = places[t]
            # -1: a weight placed on its own, or not planned
            wfam = np.where(np.array(wat) >= 0, family_of[wat], -1).tolist()
            if -1 in wfam:   # then its scale is placed on its own
                keep = list(map((-1).__ne__, wfam))
                at, wfam = list(compress(at, keep)), list(compress(wfam, keep))
                if not at:
                    continue
            shapes, dtypes = self._shapes_dtypes(at)
            # the weight's family holds its stage and the name around its layer index
            if type(shapes) is not list:
                _by_code(parts, _KEY_HEAD.format(a, id(rule), shapes, dtypes, "s"),
                         np.array(wfam, dtype=np.intp), at)
                continue
            else:
                keys = list(zip(map(_KEY_HEAD.format, repeat(a), repeat(id(rule)), shapes, dtypes,
                                    repeat("s")), wfam))
            _by_key(parts, None, keys, at)
        return [p[0] if len(p) == 1 else sorted(chain.from_iterable(p)) for p in parts.values()]

    def _assemble(self, placed: Placed) -> Plan:
        """Pass 2: one slice per (tensor, class), written a family class at a time as
        columns (SliceStore) and listed by each rank class holding it; each rank class's
        slices are put in name order, and its ranks share one SharedSlices."""
        excluded, families, tables = placed
        rc_of, rc_ranks, holders, replicas = rank_classes(self.world, tables)
        n_rc = len(rc_ranks)
        store = SliceStore()
        # per rank class: its sids, their names' places in ``names`` and replica tables
        sids: list[list[int]] = [[] for _ in range(n_rc)]
        places: list[list[int]] = [[] for _ in range(n_rc)]
        slot_tables: list[list[int]] = [[] for _ in range(n_rc)]
        meta, L = self.meta, self.L
        cols = _family_columns(self.table, self.row, families, meta.files)
        isz_of: dict[str, int] = {}
        full_boxes: dict = {}
        held: list[tuple[int, ...]] = []   # per block of the store: its rank classes
        form_of: dict = {}   # (dtype, shape, local shape, id(pieces), strategy) -> form
        for j, (members, at, classes, k, strategy) in enumerate(families):
            lo, hi = cols.bounds[j], cols.bounds[j + 1]
            shape, dtype = cols.shapes[j], cols.dtypes[j]
            isz = isz_of.get(dtype)
            if isz is None:
                isz = isz_of[dtype] = itemsize(dtype)
            full = full_boxes.get(shape)
            if full is None:
                full = full_boxes[shape] = full_box(shape)
            groups = tables[k]
            for c, (lshape, pieces) in enumerate(classes):
                if not groups[c]:
                    continue
                fk = (dtype, shape, lshape, id(pieces), strategy)
                f = form_of.get(fk)
                if f is None:
                    f = form_of[fk] = len(store.forms)
                    store.forms.append(Form(dtype, shape, lshape, pieces, strategy))
                rows = cols.rows[lo:hi]
                if (cols.whole[j] and len(pieces) == 1 and lshape == shape
                        and pieces[0].src == full):
                    # each tensor whole, stored as one piece: one run each, as columns
                    got = store.add(members, rows, f, cols.files[lo:hi], None,
                                    cols.starts[lo:hi], cols.lengths[lo:hi])
                elif cols.whole[j]:
                    # the same runs at each tensor's place: worked out for the first one
                    rl = slice_runs(meta.tensors[members[0]], pieces, lshape, isz, full_boxes)
                    files, starts = cols.files[lo:hi], cols.starts[lo:hi]
                    got = store.add(members, rows, f, files,
                                    list(map(rl.moved, files, map(sub, starts, repeat(starts[0])))))
                else:
                    infos = list(map(meta.tensors.__getitem__, members))
                    runs = [slice_runs(t, pieces, lshape, isz, full_boxes) for t in infos]
                    got = store.add(members, rows, f, [r.groups[0][0] if r.groups else t.file
                                                       for r, t in zip(runs, infos)], runs)
                held.append(holders[k][c])
                for rc in holders[k][c]:
                    sids[rc] += got
                    places[rc] += at
                    slot_tables[rc] += repeat(k, len(members))
        store.freeze()
        shares = []
        for i in range(n_rc):
            # name order (places are distinct: one slice per tensor in a rank class)
            order = np.argsort(np.array(places[i], dtype=np.intp), kind="stable")
            shares.append(SharedSlices(
                SliceColumns(store, tuple(np.array(sids[i], dtype=np.intp)[order].tolist())),
                tuple(np.array(slot_tables[i], dtype=np.intp)[order].tolist()),
                replicas, rc_ranks[i]))
        rank_plans = tuple(SharedRankPlan.make(r, L.coords(r).as_dict(), shares[rc_of[r]])
                           for r in range(self.world))
        groups = load_groups(L, meta, store, held, rc_of, n_rc)
        return Plan(L, meta.fingerprint(), rank_plans, tuple(excluded), groups)


class _FamilyColumns(NamedTuple):
    """The table's columns for the families' tensors, families one after another (family
    ``j``'s are ``[bounds[j], bounds[j + 1])``)."""
    bounds: list[int]
    rows: list[int]          # table rows
    shapes: list             # per family: its tensors' shape
    dtypes: list[str]        # ... and dtype
    whole: list[bool]        # per family: every tensor stored whole in one piece
    files: list              # the first stored piece's file name
    starts: list[int]        # ... start
    lengths: list[int]       # ... length


def _family_columns(table, row: np.ndarray, families: list[Family], files) -> _FamilyColumns:
    sizes = list(map(len, map(_PLACES, families)))
    bounds = [0]
    bounds += accumulate(sizes)
    rows = row[np.fromiter(chain.from_iterable(map(_PLACES, families)), dtype=np.intp,
                           count=bounds[-1])]
    first = rows[bounds[:-1]]
    whole = (np.logical_and.reduceat(table.whole[rows], bounds[:-1]).tolist()
             if families else [])
    names = np.array([f.name for f in files] + [None], dtype=object)   # -1: no file
    start = table.start[rows]
    return _FamilyColumns(bounds, rows.tolist(),
                          list(map(table.shapes.__getitem__, table.shape[first].tolist())),
                          list(map(table.dtypes.__getitem__, table.dtype[first].tolist())),
                          whole, names[table.file[rows]].tolist(), start.tolist(),
                          (table.end[rows] - start).tolist())


_PLACES = attrgetter("places")


def _name_rest(template: str, a: int, b: int, members: list[str]):
    """Each name without its layer index (``[a, b)``): the part before it + the part after
    it; one string for all when neither part holds digits in the template."""
    n0 = members[0]
    pre = n0[:a] if "0" not in template[:a] else list(map(itemgetter(slice(0, a)), members))
    post = n0[b:] if "0" not in template[b:] else list(map(itemgetter(slice(b, None)), members))
    if type(pre) is str and type(post) is str:
        return pre + post
    return list(map(add, repeat(pre) if type(pre) is str else pre,
                    repeat(post) if type(post) is str else post))


def _grouped(code: np.ndarray, at: list[int]):
    """-> (code, the places of ``at`` with that code, ascending) per distinct code."""
    order = np.argsort(code, kind="stable")
    code = code[order]
    edge = (np.flatnonzero(code[1:] != code[:-1]) + 1).tolist()
    return zip(code[[0] + edge].tolist(), map(np.ndarray.tolist, np.split(np.array(at)[order], edge)))


def _by_code(parts: dict, head: str, code: np.ndarray, at: list[int]) -> None:
    """``_by_key`` for integer keys, grouped by numpy: the places with one code go to
    ``parts`` under (head, code)."""
    for c, got in _grouped(code, at):
        parts.setdefault((head, c), []).append(got)


# periodic runs _by_key looks for before it groups the rest by a dict: a run per stage
# of a template's layers (and one for its MTP layers) takes one each
_PERIODIC_RUNS = 64


def _by_key(parts: dict, head: str | None, keys, at: list[int]) -> None:
    """Add the places ``at`` to ``parts`` (family key -> lists of places) under their
    ``keys`` ((head, key) when a head is given; one key for all when ``keys`` is a
    string). A template's names come in order of their digits, so their keys most often
    repeat with a period (the experts of each layer) over runs of names (the layers of a
    stage): such a run's groups are strided slices of its places, found by comparing the
    keys with themselves a period on, with no step per name in Python. The rest is
    grouped by a dict."""
    if type(keys) is not list:
        parts.setdefault(keys if head is None else (head, keys), []).append(at)
        return
    lo, n = 0, len(keys)
    for _ in range(_PERIODIC_RUNS):
        if lo == n:
            return
        try:
            k = keys.index(keys[lo], lo + 1) - lo
        except ValueError:
            k = n - lo
        # the longest run from lo where keys[i] == keys[i - k]: in it, the key at i is the
        # one at lo + (i - lo) % k (a key twice in a period gets two slices: both its own)
        same = list(map(eq, keys[lo + k:], keys[lo:n - k]))
        hi = lo + k + (same.index(False) if False in same else len(same))
        for j, key in enumerate(keys[lo:lo + k]):
            parts.setdefault(key if head is None else (head, key), []).append(at[lo + j:hi:k])
        lo = hi
    grouped: dict = {}
    for key, i in zip(keys[lo:], at[lo:]):
        got = grouped.get(key)
        if got is None:
            grouped[key] = [i]
        else:
            got.append(i)
    for key, got in grouped.items():
        parts.setdefault(key if head is None else (head, key), []).append(got)



# -- load groups (instanttensor engine cost model) -------------------------------------------
# Group mode reads each file once across the stage's ranks and all-gathers it: per rank
# about size/n from storage plus size over the interconnect. Filtered mode reads only the
# rank's own tensors (whole, since tensor_filter selects by name). Filtered wins when a
# rank needs a small share of a file: fraction f < 1/n + STORAGE_TO_NET, the storage
# bandwidth relative to the interconnect bandwidth (NVMe/GPUDirect ~ 10% of NVLink).
STORAGE_TO_NET = 0.1


def load_groups(L: Layout, meta: CheckpointMeta, store: SliceStore,
                holders_of: list[tuple[int, ...]], rank_class: list[int],
                n_rc: int) -> tuple[LoadGroup, ...]:
    """The load groups of a plan whose slices are ``store``'s, block ``b`` held by the rank
    classes ``holders_of[b]``, rank ``r`` in ``rank_class[r]``. A file's bytes needed by a
    stage are the stored bytes there of the tensors its representative ranks hold, times
    the slices of each they hold; its size, the stored bytes of all its tensors. Counted
    per (block, file) with numpy, then weighted per stage by the representative ranks of
    the rank classes holding each block."""
    files, size, index = _stored_files(meta)
    nf, nb = len(files), len(store.blocks)
    blocks, runs = store.blocks, store.runs
    one = [b for b in range(nb) if runs[blocks[b].start] is None]
    # per (block, file): the stored bytes of its tensors there, and whether one of them
    # has a part there (a tensor of no bytes still makes its file needed)
    need = np.zeros(nb * nf, dtype=np.int64)
    there = np.zeros(nb * nf, dtype=bool)
    if one:
        # a block of one run each holds its tensors whole, each stored as that one run
        spans = [blocks[b] for b in one]
        fid = np.fromiter(map(index.__getitem__, chain.from_iterable(
            map(store.files.__getitem__, map(_as_slice, spans)))), dtype=np.int64)
        key = np.repeat(np.array(one, dtype=np.int64) * nf, list(map(len, spans))) + fid
        nbytes = np.fromiter(chain.from_iterable(map(store.lengths.__getitem__,
                                                     map(_as_slice, spans))), dtype=np.int64)
        need += np.rint(np.bincount(key, weights=nbytes, minlength=nb * nf)).astype(np.int64)
        there[key] = True
    other = sorted(set(range(nb)).difference(one))
    if other:
        # the other blocks' tensors: those stored whole in one piece from the table (the
        # store's tensor column is the planner's own table row), the rest from their
        # records
        table = meta.table()
        spans = [blocks[b] for b in other]
        row = np.fromiter(chain.from_iterable(map(store.tensor.__getitem__, map(_as_slice, spans))),
                          dtype=np.intp)
        block = np.repeat(np.array(other, dtype=np.int64), list(map(len, spans)))
        whole = table.whole[row]
        stored = np.array([index.get(f.name, -1) for f in meta.files], dtype=np.int64)
        r = row[whole]
        key = block[whole] * nf + stored[table.file[r]]
        np.add.at(need, key, table.end[r] - table.start[r])
        there[key] = True
        parts: dict[int, int] = {}   # key -> bytes
        tensors = meta.tensors
        for b, at in zip(block[~whole].tolist(), row[~whole].tolist()):
            for sp in tensors[table.names[at]].pieces:
                k = b * nf + index[sp.file]
                parts[k] = parts.get(k, 0) + sp.end - sp.start
        if parts:
            need[list(parts)] += list(parts.values())
            there[list(parts)] = True
    need, there = need.reshape(nb, nf), there.reshape(nb, nf).astype(np.int64)
    holders = np.zeros((nb, n_rc), dtype=np.int64)
    holders[np.repeat(np.arange(nb), list(map(len, holders_of))),
            np.fromiter(chain.from_iterable(holders_of), dtype=np.intp)] = 1
    S = L.tp * L.dp
    out = []
    for s in range(L.pp):
        ranks = tuple(range(s * S, (s + 1) * S))
        # representative ranks: one DP replica unless experts span DP
        reps = ranks if L.ep_spans_dp else ranks[:L.tp]
        m = np.bincount([rank_class[r] for r in reps], minlength=n_rc).astype(np.int64)
        w = holders @ m   # per block: the representative ranks holding it
        on = np.flatnonzero(w)   # (a stage's ranks hold a few of the blocks)
        got, held = (w[on] @ need[on]).tolist(), (w[on] @ there[on]).tolist()
        grp, filt = [], []
        for f in range(nf):
            if not held[f]:
                continue
            frac = (got[f] / len(reps)) / size[f] if size[f] else 1.0
            (filt if frac < 1 / len(ranks) + STORAGE_TO_NET else grp).append(files[f])
        if grp:
            out.append(LoadGroup(tuple(grp), ranks, "group"))
        if filt:
            out.append(LoadGroup(tuple(filt), ranks, "filtered"))
    return tuple(out)


def _stored_files(meta: CheckpointMeta) -> tuple[list[str], list[int], dict[str, int]]:
    """The files that store a part of some tensor, by name; the bytes of all the parts
    each stores; each one's index. Whole tensors from the table, the others from their
    records."""
    table = meta.table()
    whole = table.whole
    ids = table.file[whole]
    got = np.rint(np.bincount(ids, weights=(table.end - table.start)[whole],
                              minlength=len(meta.files))).astype(np.int64).tolist()
    size = {meta.files[i].name: got[i] for i in np.unique(ids).tolist()}
    for row in np.flatnonzero(~whole).tolist():
        for sp in meta.tensors[table.names[row]].pieces:
            size[sp.file] = size.get(sp.file, 0) + sp.end - sp.start
    files = sorted(size)
    return files, [size[f] for f in files], dict(zip(files, range(len(files))))


def _as_slice(r: range) -> slice:
    return slice(r.start, r.stop)




def meta_from_specs(config: Mapping | None, specs, *, files: int = 1,
                    root: str = "<memory>") -> CheckpointMeta:
    """An in-memory CheckpointMeta for ``[(name, dtype, shape), ...]`` laid out as a plain
    HF checkpoint over ``files`` shards (no I/O): for tests and planner benchmarks."""
    import hashlib

    from coordloader.checkpoint.metadata import FileInfo, SourcePiece, full_box
    specs = list(specs)
    nf = max(1, min(files, len(specs) or 1))
    per = -(-len(specs) // nf) if specs else 0
    tensors, finfos = {}, []
    for fi in range(nf):
        fname = f"model-{fi + 1:05d}-of-{nf:05d}.safetensors"
        chunk = specs[fi * per:(fi + 1) * per]
        hlen = 8 * (16 + 16 * len(chunk))  # any plausible header size; offsets follow it
        off = 8 + hlen
        h = hashlib.sha256(fname.encode())
        for name, dt, shape in chunk:
            shape = tuple(int(x) for x in shape)
            nbytes = prod(shape) * itemsize(dt)
            tensors[name] = TensorInfo(name, dt, shape,
                                       (SourcePiece(fname, full_box(shape), off, off + nbytes,
                                                    name),))
            h.update(f"{name}|{dt}|{shape}|{off}".encode())
            off += nbytes
        finfos.append(FileInfo(fname, off, hlen, h.hexdigest()))
    return CheckpointMeta(root, tuple(finfos), tensors, dict(config) if config else None)
