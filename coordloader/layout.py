"""Parallel layout: world = pp * dp * tp, TP innermost; MoE groups, expert placement and
pipeline stages. Pure arithmetic, no torch.distributed (see docs/layout.md)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property

from coordloader.errors import CoordloaderError, PlanError
from coordloader.text import MAX_NAME_CHARS, clip


@dataclass(frozen=True)
class Coords:
    rank: int
    tp: int
    dp: int
    pp: int
    ep: int        # rank inside the expert-parallel dimension of its MoE group
    moe_tp: int    # rank inside the TP split of each expert it owns
    moe_group: int  # index in the MoE group (m)

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp, "ep": self.ep, "moe_tp": self.moe_tp}


# The most ranks one layout may have (tp * pp * dp, so each of tp, pp, dp, ep too). Far
# above any real deployment; it exists so a typo such as tp=1000000000 fails at once
# instead of building per-rank tables of that size (docs/layout.md).
MAX_WORLD_SIZE = 1 << 16


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def as_rank(value, error: type[CoordloaderError]) -> int:
    """A caller's ``rank=`` as an int; ``error`` for anything but an integer (numpy's is
    one). ``int()`` would make 1.5 or True rank 1, and a float or str otherwise fails deep
    in the load, after the reads."""
    if not _is_int(value):
        raise error(f"rank= must be an integer, got {clip(repr(value))} "
                    f"({type(value).__name__})")
    return int(value)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    ep_spans_dp: bool = False
    # "linear" | "round_robin" | explicit map: one tuple of logical expert ids per ep rank
    expert_placement: str | tuple[tuple[int, ...], ...] = "linear"
    pp_layers: tuple[int, ...] | None = None  # layers per stage, explicit
    allow_uneven: bool = False
    include_mtp: bool = False

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "ep"):
            v = getattr(self, k)
            if not _is_int(v) or v < 1:
                raise PlanError(f"layout: {k} must be a positive integer, got {clip(repr(v), 200)}"
                                f" ({type(v).__name__})")
            # numpy's integers are integers (a layout computed from an array); the rest of
            # the code, JSON and the plan digest take Python ints
            object.__setattr__(self, k, int(v))
            if v > MAX_WORLD_SIZE:
                raise PlanError(f"layout: {k}={v} exceeds the maximum of {MAX_WORLD_SIZE} ranks")
        for k in ("ep_spans_dp", "allow_uneven", "include_mtp"):
            v = getattr(self, k)
            if not isinstance(v, bool):
                # a string "false" would be truthy: a layout silently other than the one asked
                raise PlanError(f"layout: {k} must be true or false, got {clip(repr(v), 200)}")
        if self.world_size > MAX_WORLD_SIZE:
            raise PlanError(f"layout: world size tp*pp*dp = {self.world_size} exceeds the maximum "
                            f"of {MAX_WORLD_SIZE} ranks")
        if isinstance(self.expert_placement, (list, tuple)):
            if not all(isinstance(ids, (list, tuple)) and all(_is_int(e) for e in ids)
                       for ids in self.expert_placement):
                # int() would turn 0.9 into expert 0 and True into expert 1
                raise PlanError(f"layout: an explicit expert map is a list of integer expert "
                                f"ids per ep rank, got {clip(repr(self.expert_placement), 200)}")
            m = tuple(tuple(int(e) for e in ids) for ids in self.expert_placement)
            object.__setattr__(self, "expert_placement", m)
            if len(m) != self.ep:
                raise PlanError(f"layout: explicit expert map has {len(m)} entries, expected one per "
                                f"ep rank (ep={self.ep})")
            if any(e < 0 for ids in m for e in ids):
                raise PlanError("layout: explicit expert map holds a negative expert id")
            for q, ids in enumerate(m):
                if len(set(ids)) != len(ids):
                    # a fused expert tensor would hold it twice, per-expert tensors once
                    dup = next(e for e in ids if ids.count(e) > 1)
                    raise PlanError(f"layout: explicit expert map lists expert {dup} twice on "
                                    f"ep rank {q} ({list(ids)}); a replica goes on another ep rank")
        elif self.expert_placement not in ("linear", "round_robin"):
            raise PlanError(f"layout: expert_placement must be 'linear', 'round_robin' or an explicit "
                            f"map, got {self.expert_placement!r}")
        if self.pp_layers is not None:
            if not isinstance(self.pp_layers, (list, tuple)) or not all(
                    _is_int(x) for x in self.pp_layers):
                # a string "11" would be read as (1, 1)
                raise PlanError(f"layout: pp_layers must be a list of integer layer counts, "
                                f"got {clip(repr(self.pp_layers), 200)}")
            pl = tuple(int(x) for x in self.pp_layers)
            object.__setattr__(self, "pp_layers", pl)
            if len(pl) != self.pp or any(x < 0 for x in pl):
                raise PlanError(f"layout: pp_layers {list(pl)} must give a non-negative layer count "
                                f"for each of the pp={self.pp} stages (it gives {len(pl)} "
                                f"count(s))")
        if self.ep > self.moe_group_size:
            hint = ("; experts spread over the TP x DP ranks (vLLM's --data-parallel-size "
                    "with --enable-expert-parallel) need ep_spans_dp=True"
                    if not self.ep_spans_dp and self.dp > 1 and (self.tp * self.dp) % self.ep == 0
                    else "")
            raise PlanError(f"layout: ep={self.ep} exceeds the MoE group size {self.moe_group_size} "
                            f"({self._moe_group_desc()}){hint}")
        if self.moe_group_size % self.ep:
            raise PlanError(f"layout: ep={self.ep} does not divide the MoE group size "
                            f"{self.moe_group_size} ({self._moe_group_desc()})")

    def _moe_group_desc(self) -> str:
        return f"tp={self.tp} x dp={self.dp}, ep_spans_dp" if self.ep_spans_dp else f"tp={self.tp}"

    # -- sizes ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def moe_group_size(self) -> int:
        return self.tp * self.dp if self.ep_spans_dp else self.tp

    @property
    def moe_tp(self) -> int:
        return self.moe_group_size // self.ep

    @property
    def sequence_parallel_moe(self) -> bool:
        """vLLM's expert parallelism over TP x DP with tp > 1 and dp > 1 (every expert
        whole on one rank): vLLM then runs the MoE on a sequence-parallel split of the
        tokens (``ParallelConfig.use_sequence_parallel_moe``, on with its default all2all
        backends) and some models keep their shared experts whole on every rank."""
        return (self.ep_spans_dp and self.ep > 1 and self.moe_tp == 1 and self.tp > 1
                and self.dp > 1)

    # -- coordinates ---------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise PlanError(f"layout: rank {rank} outside world of size {self.world_size} ({self})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        m = dp_rank * self.tp + tp_rank if self.ep_spans_dp else tp_rank
        return Coords(rank, tp_rank, dp_rank, pp_rank, m // self.moe_tp, m % self.moe_tp, m)

    # -- experts -------------------------------------------------------------
    def experts_of(self, ep_rank: int, num_experts: int) -> tuple[int, ...]:
        """Logical expert ids owned by ``ep_rank`` (in local order)."""
        if not _is_int(ep_rank) or not 0 <= ep_rank < self.ep:
            raise PlanError(f"layout: ep rank {ep_rank!r} outside 0..{self.ep - 1} ({self})")
        self.check_experts(num_experts)
        if self.expert_placement == "linear":
            base, rem = divmod(num_experts, self.ep)
            start = ep_rank * base + min(ep_rank, rem)
            return tuple(range(start, start + base + (ep_rank < rem)))
        if self.expert_placement == "round_robin":
            return tuple(range(ep_rank, num_experts, self.ep))
        return self.expert_placement[ep_rank]

    def local_order(self, ep_rank: int | None, ids) -> list[int]:
        """``ids``, experts ``ep_rank`` owns, in its local order (that of ``experts_of``,
        the slots of a fused expert tensor), without the expert count: an explicit map
        lists them in slot order; linear and round_robin ascend."""
        pl = self.expert_placement
        if isinstance(pl, tuple) and ep_rank is not None and 0 <= ep_rank < len(pl):
            pos = {e: i for i, e in enumerate(pl[ep_rank])}
            if all(e in pos for e in ids):
                return sorted(ids, key=pos.__getitem__)
        return sorted(ids)

    def owners_of(self, expert: int, num_experts: int) -> tuple[int, ...]:
        """ep ranks holding ``expert`` (several only with a redundant explicit map)."""
        if not _is_int(num_experts) or not _is_int(expert) or not 0 <= expert < num_experts:
            raise PlanError(f"layout: expert {expert!r} outside the {num_experts!r} experts")
        if isinstance(self.expert_placement, str) and self.ep > num_experts:
            raise PlanError(f"layout: ep={self.ep} exceeds the expert count {num_experts}")
        if self.expert_placement == "linear":
            base, rem = divmod(num_experts, self.ep)
            # first `rem` ranks own base+1 experts
            cut = rem * (base + 1)
            q = expert // (base + 1) if expert < cut else rem + (expert - cut) // base
            return (q,)
        if self.expert_placement == "round_robin":
            return (expert % self.ep,)
        return self._map_owners.get(expert, ())

    @cached_property
    def _map_owners(self) -> dict[int, tuple[int, ...]]:
        # the planner asks once per expert tensor: a scan of the map each time was
        # O(ep) per call, 7 s at ep=1024 on DeepSeek-V3
        owners: dict[int, dict[int, None]] = {}
        for q, ids in enumerate(self.expert_placement):
            for e in ids:
                owners.setdefault(e, {})[q] = None
        return {e: tuple(qs) for e, qs in owners.items()}

    def check_experts(self, num_experts: int) -> None:
        if isinstance(self.expert_placement, tuple):
            seen = {e for ids in self.expert_placement for e in ids}
            missing = sorted(set(range(num_experts)) - seen)
            if missing:
                raise PlanError(f"layout: explicit expert map misses experts {missing[:16]}"
                                f"{' ...' if len(missing) > 16 else ''} of {num_experts}")
            extra = sorted(e for e in seen if e >= num_experts)
            if extra:
                raise PlanError(f"layout: explicit expert map names experts {extra[:16]} but the "
                                f"checkpoint has {num_experts}")
        elif self.ep > num_experts:
            raise PlanError(f"layout: ep={self.ep} exceeds the expert count {num_experts}")

    # -- pipeline ------------------------------------------------------------
    def stage_layers(self, num_layers: int) -> list[range]:
        """Layer ranges per pp stage, like vLLM's get_pp_indices (or the explicit list)."""
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise PlanError(f"layout: pp_layers {list(self.pp_layers)} sum to {sum(self.pp_layers)}, "
                                f"but the model has {num_layers} layers")
            counts = list(self.pp_layers)
        else:
            if self.pp > num_layers:
                raise PlanError(f"layout: pp={self.pp} exceeds the layer count {num_layers}")
            counts = [num_layers // self.pp] * self.pp
            rem = num_layers % self.pp
            # the remainder goes to the stages before the last, from the second to last back
            for i in range(rem):
                counts[self.pp - 2 - i if self.pp > 1 else 0] += 1
        out, s = [], 0
        for c in counts:
            out.append(range(s, s + c))
            s += c
        return out

    def to_dict(self) -> dict:
        ep_pl = self.expert_placement
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep,
                "ep_spans_dp": self.ep_spans_dp,
                "expert_placement": ep_pl if isinstance(ep_pl, str) else [list(x) for x in ep_pl],
                "pp_layers": list(self.pp_layers) if self.pp_layers is not None else None,
                "allow_uneven": self.allow_uneven, "include_mtp": self.include_mtp}

    @staticmethod
    def from_dict(d: dict) -> "Layout":
        return Layout(**d)   # __post_init__ turns JSON lists into tuples

    def __str__(self) -> str:
        s = f"tp={self.tp} pp={self.pp} dp={self.dp} ep={self.ep}"
        if self.ep_spans_dp:
            s += " ep_spans_dp"
        # the fields a refusal may come from, when not the default (a plan error printed
        # the layout without the expert map that caused it)
        if self.expert_placement != "linear":
            p = self.expert_placement
            shown = p if isinstance(p, str) else ",".join(
                "[" + " ".join(map(str, q)) + "]" for q in p)
            s += f" expert_placement={clip(shown, MAX_NAME_CHARS)}"
        if self.pp_layers is not None:
            s += " pp_layers=" + ",".join(map(str, self.pp_layers))
        return s
