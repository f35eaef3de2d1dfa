"""Rank groups and rank classes: which ranks hold each class of a placement, and which
ranks hold the same slices of every tensor.

A placement (``strategies``) says, through its selector, which class of a tensor each
rank of the tensor's stages holds; ``RankGroups`` turns that into the ranks of each
class, ``dedupe`` merges classes that are replicas of one another, and ``rank_classes``
finds the ranks that fall in the same class of every tensor: they share one
``SharedSlices`` in the plan."""
from __future__ import annotations

from typing import NamedTuple

from coordloader.layout import Layout
from coordloader.planning.strategies import ByExpertOwner, ByExpertSet, ByTp, Everyone, Selector

# per class: the ranks holding it, ascending
RankGroupsOf = tuple[tuple[int, ...], ...]


class RankGroups:
    """The rank groups of (stages, selector) pairs for one layout."""

    def __init__(self, layout: Layout):
        self.L = layout
        # stage-local index i -> (tp, dp, ep, moe_tp); identical for every stage
        self.local = []
        # ep rank -> its stage-local indices and moe_tp ranks: an expert's owners are a few
        # ep ranks, so their groups are built from those members, not from every rank
        self.of_ep: dict[int, list[tuple[int, int]]] = {}
        for i in range(layout.tp * layout.dp):
            c = layout.coords(i)
            self.local.append((c.tp, c.dp, c.ep, c.moe_tp))
            self.of_ep.setdefault(c.ep, []).append((i, c.moe_tp))
        self._groups: dict = {}

    def __call__(self, stages: tuple[int, ...], selector: Selector, ncls: int) -> RankGroupsOf:
        """Per class of a placement over ``stages``, the ranks holding it, ascending;
        memoised: selectors repeat across tensors, and the planner keys its replica tables
        by the returned object."""
        key = (stages, type(selector), selector, ncls)   # NamedTuples of equal fields compare equal
        g = self._groups.get(key)
        if g is not None:
            return g
        out = [[] for _ in range(ncls)]
        S = self.L.tp * self.L.dp
        moe_tp = self.L.moe_tp
        for s in stages:
            base = s * S
            if type(selector) is ByExpertOwner:   # owners' members only (owners distinct)
                split = selector.split
                for q in selector.owners:
                    for i, mtr in self.of_ep.get(q, ()):
                        out[mtr if split else 0].append(base + i)
                continue
            for i, (tpr, dpr, epr, mtr) in enumerate(self.local):
                match selector:
                    case Everyone():
                        c = 0
                    case ByTp(classes):
                        c = classes[tpr]
                    case ByExpertSet(split):
                        c = epr * moe_tp + mtr if split else epr
                out[c].append(base + i)
        g = tuple(tuple(sorted(x)) for x in out)
        self._groups[key] = g
        return g


def dedupe(classes, groups, memo=None):
    """Merge classes with identical pieces and local shape (e.g. empty chunks, or an
    explicit expert map listing the same set twice): they are replicas of one another.
    ``memo`` keeps one merged groups object per (groups, merge pattern), so the tensors
    that merge alike share one replica table."""
    if len(classes) == 1:
        return classes, groups
    seen: dict = {}
    for i, c in enumerate(classes):
        seen.setdefault(c, []).append(i)
    if len(seen) == len(classes):
        return classes, groups
    key = (id(groups), tuple(tuple(idx) for idx in seen.values()))
    ng = None if memo is None else memo.get(key)
    if ng is None:
        ng = tuple(tuple(sorted(r for i in idx for r in groups[i])) for idx in seen.values())
        if memo is not None:
            memo[key] = ng
    return list(seen), ng


class RankClasses(NamedTuple):
    rank_class: list[int]                  # rank -> its rank class
    ranks: list[tuple[int, ...]]           # rank class -> its ranks, ascending
    holders: list[list[tuple[int, ...]]]   # [table][class] -> rank classes holding it
    replicas: tuple[tuple[int, ...], ...]  # [table][rank] -> replica id, -1 when not held


def rank_classes(world: int, tables) -> RankClasses:
    """Ranks that fall in the same class of every replica table hold the same slices: they
    form one rank class. ``tables``: per table, the rank groups of its classes."""
    assign, replicas = [], []
    for groups in tables:
        a = [-1] * world
        rep = [-1] * world
        for c, g in enumerate(groups):
            for i, r in enumerate(g):
                a[r] = c
                rep[r] = i
        assign.append(a)
        replicas.append(tuple(rep))
    ids: dict = {}
    rank_class = []
    ranks: list[list[int]] = []
    for r, sig in enumerate(zip(*assign) if assign else [()] * world):
        i = ids.get(sig)
        if i is None:
            i = ids[sig] = len(ranks)
            ranks.append([])
        rank_class.append(i)
        ranks[i].append(r)
    holders = []
    for groups in tables:
        holders.append([tuple(sorted({rank_class[r] for r in g})) for g in groups])
    return RankClasses(rank_class, [tuple(x) for x in ranks], holders, tuple(replicas))
