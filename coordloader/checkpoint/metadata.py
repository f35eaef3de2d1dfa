"""Frozen checkpoint metadata: what the reader returns and the planner consumes.

A tensor is described by one or more *source pieces*: boxes of the global tensor stored
contiguously (row-major) in some file. A plain HF checkpoint has one piece per tensor
covering the whole box; coordloader's own sharded format (``coordloader.save``) stores a
tensor as several pieces in several files. The planner maps target slices onto source
pieces the same way in both cases, so resharding needs no special path.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import compress, repeat
from math import prod
from operator import ne
from typing import NamedTuple

import numpy as np

from coordloader.errors import CheckpointError
from coordloader.gcpause import gc_paused

Box = tuple[tuple[int, int], ...]  # one [start, stop) pair per dim


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, s) for s in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return prod(b - a for a, b in box)


def piece_key(name: str, box: Box, shape: tuple[int, ...]) -> str:
    """Key under which coordloader's sharded format stores a piece of tensor ``name``: the
    name itself for a whole tensor, else ``name@a:b,c:d``. The writer's naming rule (and
    the reader's check of an index against it), not a way to find a stored piece: other
    formats store pieces under other keys (torch DCP under the plain name), so readers of
    bytes use ``SourcePiece.key``."""
    if tuple(box) == full_box(tuple(shape)):
        return name
    return name + "@" + ",".join(f"{a}:{b}" for a, b in box)


@dataclass(frozen=True)
class FileInfo:
    name: str            # path relative to the checkpoint directory (no separators)
    size: int            # bytes on disk
    header_len: int      # N, the little-endian u64 at the start of the file
    header_sha256: str   # hash of the raw header bytes: part of the fingerprint
    metadata: tuple[tuple[str, str], ...] = ()  # the file's __metadata__, sorted

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


@dataclass(frozen=True, slots=True)
class SourcePiece:
    file: str    # FileInfo.name
    box: Box     # region of the global tensor this piece holds
    start: int   # absolute byte offset in the file
    end: int     # absolute byte offset one past the last byte
    # the key the file's header stores this piece under: the tensor's name in a plain HF
    # checkpoint and in torch DCP's per-rank files (so (file, key) is unique, key alone
    # is not), ``name@a:b,c:d`` for a part in coordloader's sharded format
    key: str


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str                 # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]     # global shape
    pieces: tuple[SourcePiece, ...]

    @property
    def file(self) -> str:
        """File of the first piece (the only one in a plain HF checkpoint)."""
        return self.pieces[0].file

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def is_whole(self) -> bool:
        return len(self.pieces) == 1 and self.pieces[0].box == full_box(self.shape)


_UNMADE = object()


def _field_setters(cls) -> tuple:
    """The slot setters of a frozen slotted dataclass, in field order."""
    return tuple(cls.__dict__[f.name].__set__ for f in fields(cls))


_PIECE_SETTERS = _field_setters(SourcePiece)
_RECORD_SETTERS = _field_setters(TensorInfo)


class _Source(NamedTuple):
    """What a ``TensorMap``'s unmade records are made from: the header entries ``(key,
    dtype, shape, start, end)`` by row, each one's file, its row by name, and the boxes
    shared per shape. Never changed once made: a reader holds it whole."""
    entries: list
    files: list[str]
    rows: dict[str, int]
    boxes: dict


class TensorMap(Mapping):
    """A checkpoint's tensors by name, read-only: what the planner and cover read of them
    as columns (``TensorTable``) cannot drift from the records.

    A plain checkpoint's records are made from its header entries when first read
    (``of_entries``): every rank assembles the metadata of all 92 k tensors of
    DeepSeek-V3, while a load reads the records of the tensors it reads. Reading all of
    them (``values``, ``items``, equality, pickling) makes the rest at once, in the
    tensors' order. Safe to read from several threads, in a forked child and from a
    collector callback: no lock, each record is published with one ``dict.setdefault``,
    so every reader gets the first one made."""
    __slots__ = ("_rows", "_made", "_source", "_sealed")

    def __init__(self, *args, **kwargs):
        if getattr(self, "_sealed", False):
            self._read_only()
        made = dict(*args, **kwargs)
        # each record under its own name: the planner places a tensor by its key, other
        # readers by the record's name
        named = map(getattr, made.values(), repeat("name"), made)
        for key in compress(made, map(ne, made, named)):
            raise CheckpointError(f"the record of tensor {made[key].name!r} is listed under "
                                  f"{key!r}; expected each tensor's record under its own "
                                  f"name", tensor=key)
        self._made = self._rows = made
        self._source = None         # while some records are unmade: their _Source
        self._sealed = True

    @classmethod
    def of_entries(cls, rows: dict[str, int], entries: list, files: list[str]) -> TensorMap:
        """The records of header entries ``(key, dtype, shape, start, end)`` stored whole
        each, in file ``files[row]``, named by their keys (``rows``: key -> row, in the
        tensors' order), made when first read."""
        m = cls()
        m._rows, m._made, m._source = rows, {}, _Source(entries, files, rows, {})
        return m

    def _read_only(self, *args, **kwargs):
        raise TypeError("a checkpoint's tensors are read-only; expected a new CheckpointMeta "
                        "(dataclasses.replace(meta, tensors=...)) for other tensors")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __getitem__(self, name: str) -> TensorInfo:
        t = self.get(name, _UNMADE)
        if t is _UNMADE:
            raise KeyError(name)
        return t

    def get(self, name, default=None):
        # the source first: once it is gone (_all), every record is in _made
        src = self._source
        t = self._made.get(name, _UNMADE)
        if t is _UNMADE:
            row = None if src is None else src.rows.get(name)
            if row is None:
                return default
            t = self._made.setdefault(name, _make(src, (row,))[0])
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, without making its record (the planner places
        thousands of tensors by name and shape); KeyError for a name it lacks."""
        src = self._source
        return self[name].shape if src is None else src.entries[src.rows[name]][2]

    def header_entries(self) -> tuple[list, list[str]] | None:
        """The header entries ``(key, dtype, shape, start, end)`` by row and each one's
        file, each a tensor stored whole under its own name, while this map makes its
        records when first read (a plain checkpoint's); None for a map of records.
        Reading them makes no record: a reader of every tensor's dtype and shape (the
        instanttensor engine checks each streamed tensor) need not make 92 k of them."""
        src = self._source
        return None if src is None else (src.entries, src.files)

    def __contains__(self, name) -> bool:
        return name in self._rows

    def __iter__(self):
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def keys(self):
        return self._rows.keys()

    def values(self):
        return self._all().values()

    def items(self):
        return self._all().items()

    def __eq__(self, other) -> bool:
        if isinstance(other, TensorMap):
            other = other._all()
        return self._all() == other if isinstance(other, Mapping) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self):
        return TensorMap, (self._all(),)

    def _all(self) -> dict[str, TensorInfo]:
        """Every record, in the tensors' order: the unmade ones made at once, each
        published as a single read would be (another thread's, made first, is kept)."""
        src = self._source
        if src is None:
            return self._made
        made, rows = self._made, src.rows
        unmade = [k for k in rows if k not in made] if made else list(rows)
        with gc_paused():   # ~180 k objects, all kept: nothing to collect
            deque(map(made.setdefault, unmade, _make(src, map(rows.__getitem__, unmade))), 0)
            out = dict(zip(rows, map(made.__getitem__, rows)))
        # every record is in made before the source goes: a reader that finds no source
        # finds its record (in made, or in out once it is published)
        self._made = self._rows = out
        self._source = None
        return out


def _make(src: _Source, rows: Iterable[int]) -> list[TensorInfo]:
    """The records of ``rows``: TensorInfo(key, dtype, shape, (SourcePiece(file, box,
    start, end, key),)) each, through the slotted records' setters (no __init__ frame, no
    object.__setattr__ per field)."""
    new, entries, files, boxes = object.__new__, src.entries, src.files, src.boxes
    p_file, p_box, p_start, p_end, p_key = _PIECE_SETTERS
    t_name, t_dtype, t_shape, t_pieces = _RECORD_SETTERS
    out = []
    for row in rows:
        key, dtype, shape, start, end = entries[row]
        box = boxes.get(shape)
        if box is None:
            box = boxes.setdefault(shape, full_box(shape))
        p = new(SourcePiece)
        p_file(p, files[row])
        p_box(p, box)
        p_start(p, start)
        p_end(p, end)
        p_key(p, key)
        t = new(TensorInfo)
        t_name(t, key)
        t_dtype(t, dtype)
        t_shape(t, shape)
        t_pieces(t, (p,))
        out.append(t)
    return out


class TensorTable(NamedTuple):
    """A checkpoint's tensors as columns, in ``CheckpointMeta.tensors``' order, so that the
    planner and cover read a field of all 92 k tensors of DeepSeek-V3 in C. The first
    stored piece's file, start and end; ``whole``: the tensor is stored as that one piece,
    over its whole box (the others are read from their records). Arrays are read-only."""
    names: list[str]
    shapes: tuple[tuple[int, ...], ...]   # the distinct shapes
    shape: np.ndarray                     # index into shapes
    dtypes: tuple[str, ...]               # the distinct dtypes
    dtype: np.ndarray                     # index into dtypes
    file: np.ndarray                      # index into CheckpointMeta.files; -1: none
    start: np.ndarray
    end: np.ndarray
    whole: np.ndarray


def tensor_table(names: list[str], shapes: list[tuple[int, ...]], dtypes: list[str],
                 files: Iterable[int], starts: Iterable[int], ends: Iterable[int],
                 whole: list[bool] | None) -> TensorTable:
    """The table of columns given per tensor (``files`` as indexes into the checkpoint's
    files; ``whole`` None when every tensor is stored whole in one piece). Each start and
    end is an integer, 0 <= start <= end < 2**63 (what the reader checks of a header)."""
    n = len(names)
    shape_of = {s: i for i, s in enumerate(dict.fromkeys(shapes))}
    dtype_of = {d: i for i, d in enumerate(dict.fromkeys(dtypes))}
    cols = (np.fromiter(map(shape_of.__getitem__, shapes), dtype=np.int32, count=n),
            np.fromiter(map(dtype_of.__getitem__, dtypes), dtype=np.int32, count=n),
            np.array(files, dtype=np.int32).reshape(n),
            np.fromiter(starts, dtype=np.int64, count=n), np.fromiter(ends, dtype=np.int64, count=n),
            np.ones(n, dtype=bool) if whole is None else np.array(whole, dtype=bool).reshape(n))
    for c in cols:
        c.flags.writeable = False
    return TensorTable(names, tuple(shape_of), cols[0], tuple(dtype_of), *cols[1:])


def with_table(meta: CheckpointMeta, table: TensorTable) -> CheckpointMeta:
    """``meta`` holding ``table``, which the reader built from the very headers it built the
    records from (cheaper than ``_table_of_records``)."""
    if meta._table or table.names != list(meta.tensors):
        raise ValueError("a tensor table for metadata that has one, or of other tensors")
    meta._table.append(table)
    return meta


def with_other_config(meta: CheckpointMeta, config: Mapping | None) -> CheckpointMeta:
    """``meta`` with ``config`` as its config.json: the same tensors, so the table it has,
    if any (one built again from the records would make every record)."""
    out = dataclasses.replace(meta, config=config)
    out._table.extend(meta._table)
    return out


def _table_of_records(meta: CheckpointMeta) -> TensorTable:
    """The table of ``meta``'s tensor records (the reader builds it from the headers). A
    first piece whose offsets are no integers with 0 <= start <= end < 2**63 is left out
    (file -1): the records' own checks name it."""
    infos = list(meta.tensors.values())
    index = {f.name: i for i, f in enumerate(meta.files)}
    files, starts, ends, whole = [], [], [], []
    for t in infos:
        if not isinstance(t.shape, tuple):   # the table's shape ids key on it
            raise CheckpointError(f"shape {t.shape!r} is a {type(t.shape).__name__}; expected "
                                  f"a tuple", file=t.pieces[0].file if t.pieces else None,
                                  tensor=t.name)
        p = t.pieces[0] if t.pieces else None
        fits = (p is not None and type(p.start) is int and type(p.end) is int
                and 0 <= p.start <= p.end < 2 ** 63)
        files.append(index.get(p.file, -1) if fits else -1)
        starts.append(p.start if fits else 0)
        ends.append(p.end if fits else 0)
        whole.append(fits and len(t.pieces) == 1 and p.box == full_box(t.shape)
                     and files[-1] >= 0)
    return tensor_table(list(meta.tensors), [t.shape for t in infos], [t.dtype for t in infos],
                        files, starts, ends, whole)


@dataclass(frozen=True)
class CheckpointMeta:
    root: str                              # absolute checkpoint directory
    files: tuple[FileInfo, ...]            # sorted by name
    tensors: Mapping[str, TensorInfo]      # insertion order: file, then offset; read-only
    config: Mapping | None = None          # parsed config.json, if present
    source_layout: Mapping | None = None   # coordloader sharded format: saving layout
    # torch DCP's per-rank output records no global shapes: each is the extent of the
    # pieces present, so one missing last-rank file shrinks tensors instead of leaving gaps
    shapes_from_extents: bool = False
    # fingerprint and table caches; init=False so dataclasses.replace() does not carry them
    # over
    _fp: list = field(default_factory=list, init=False, repr=False, compare=False)
    _table: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        if type(self.tensors) is not TensorMap:
            object.__setattr__(self, "tensors", TensorMap(self.tensors))

    def __setstate__(self, state: dict) -> None:
        # a copy or unpickled metadata keeps its table, read-only as the original's
        self.__dict__.update(state)
        for table in self._table:
            for column in table:
                if isinstance(column, np.ndarray):
                    column.flags.writeable = False

    def table(self) -> TensorTable:
        """The tensors as columns (``TensorTable``): built by the reader from the headers,
        else from the records on first use."""
        if not self._table:
            self._table.append(_table_of_records(self))
        return self._table[0]

    def fingerprint(self) -> str:
        """sha256 over file names, sizes and header hashes: changes whenever any
        header or file size changes, independent of the directory's path."""
        if not self._fp:
            h = hashlib.sha256()
            for f in self.files:
                h.update(json.dumps([f.name, f.size, f.header_sha256]).encode())
            self._fp.append(h.hexdigest())
        return self._fp[0]

    def file(self, name: str) -> FileInfo:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(p.end - p.start for t in self.tensors.values() for p in t.pieces)


# Tensors whose dim 0 config.json states outright: (name suffix, config key).
_CONFIG_SIZED = ((".embed_tokens.weight", "vocab_size"), ("lm_head.weight", "vocab_size"),
                 ("input_layernorm.weight", "hidden_size"),
                 ("post_attention_layernorm.weight", "hidden_size"),
                 ("model.norm.weight", "hidden_size"))


def _cfg_int(cfg: Mapping, key: str) -> int | None:
    v = cfg.get(key)
    return v if type(v) is int and v > 0 else None


# transformers' own num_key_value_heads where config.json leaves it out, by model_type:
# vLLM reads the config through transformers, so a preset that took num_attention_heads
# instead would split K/V heads of another size than vLLM (silently: the pieces still
# tile). Model types not listed default to num_attention_heads, as LlamaConfig does.
# An explicit null is num_attention_heads, as those classes read it. tests/test_presets_hf.py
# compares both with the installed transformers.
KV_HEADS_DEFAULT = {"mistral": 8, "mixtral": 8, "qwen2": 32, "qwen2_moe": 16, "qwen3": 32,
                    "qwen3_moe": 4, "gemma3_text": 4, "glm4_moe": 8, "gpt_oss": 8,
                    "llama4_text": 8, "qwen3_next": 2, "deepseek_v3": 128}


def kv_heads_default(config: Mapping, heads: int | None) -> int | None:
    """num_key_value_heads of a config.json without it (see ``KV_HEADS_DEFAULT``). An
    explicit null is another matter: transformers' classes read it as
    num_attention_heads."""
    mt = config.get("model_type")
    if "num_key_value_heads" in config or not isinstance(mt, str):
        return heads
    return KV_HEADS_DEFAULT.get(mt, heads)


# model types whose config class takes a head_dim left out (or null) as hidden_size //
# num_attention_heads; others default to a constant of their own, and only a head_dim
# config.json states is known
HEAD_DIM_FROM_HIDDEN = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe"})


def config_head_dim(config: Mapping) -> int | None:
    """The rows each attention head holds, where config.json fixes them: its head_dim, or
    hidden_size // num_attention_heads for ``HEAD_DIM_FROM_HIDDEN``; else None."""
    hd = _cfg_int(config, "head_dim")
    mt = config.get("model_type")
    if hd is None and isinstance(mt, str) and mt in HEAD_DIM_FROM_HIDDEN:
        H, hidden = _cfg_int(config, "num_attention_heads"), _cfg_int(config, "hidden_size")
        hd = hidden // H if H and hidden else None
    return hd


def _heads(cfg: Mapping, key: str, gated: bool = False) -> tuple[str, int] | None:
    """(label, size) of ``key`` heads times head_dim (llama-style attention only: MLA
    configs size their projections otherwise). ``gated``: q_proj, which Qwen3-Next's
    gated attention makes twice as wide (queries and the output gate)."""
    if any(k in cfg for k in ("kv_lora_rank", "qk_nope_head_dim")):
        return None
    if gated and cfg.get("model_type") == "qwen3_next":
        got = _heads(cfg, key)
        return (got[0] + "*2", got[1] * 2) if got else None
    n, H = _cfg_int(cfg, key), _cfg_int(cfg, "num_attention_heads")
    if key == "num_key_value_heads" and n is None:
        n = kv_heads_default(cfg, H)   # the class default, as the presets read it
    hd = config_head_dim(cfg)
    return (f"{key}*head_dim", n * hd) if n and hd else None


def _key(key: str):
    return lambda cfg: (key, _cfg_int(cfg, key)) if _cfg_int(cfg, key) else None


# config.json's count of routed experts, under the names the model families give it
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def _experts(cfg: Mapping) -> tuple[str, int] | None:
    return next(((k, cfg[k]) for k in EXPERT_COUNT_KEYS if _cfg_int(cfg, k)), None)


def _embed_width(cfg: Mapping) -> tuple[str, int] | None:
    # OPT's embeddings and head are word_embed_proj_dim wide, projected to hidden_size
    return _key("word_embed_proj_dim")(cfg) or _key("hidden_size")(cfg)


# The other dims config.json fixes, in particular the dims tensor parallelism shards (q/k/v
# and gate/up on dim 0, o/down on dim 1): a missing rank's file shrinks those, not dim 0
# of the tensors above. (name suffix, dim, cfg -> (label, size) or None)
_CONFIG_DIMS = (
    (".embed_tokens.weight", 1, _embed_width), ("lm_head.weight", 1, _embed_width),
    ("self_attn.q_proj.weight", 0, lambda c: _heads(c, "num_attention_heads", True)),
    ("self_attn.q_proj.bias", 0, lambda c: _heads(c, "num_attention_heads", True)),
    ("self_attn.k_proj.weight", 0, lambda c: _heads(c, "num_key_value_heads")),
    ("self_attn.k_proj.bias", 0, lambda c: _heads(c, "num_key_value_heads")),
    ("self_attn.v_proj.weight", 0, lambda c: _heads(c, "num_key_value_heads")),
    ("self_attn.v_proj.bias", 0, lambda c: _heads(c, "num_key_value_heads")),
    ("self_attn.o_proj.weight", 1, lambda c: _heads(c, "num_attention_heads")),
    ("self_attn.o_proj.weight", 0, _key("hidden_size")),
    (".mlp.gate_proj.weight", 0, _key("intermediate_size")),
    (".mlp.up_proj.weight", 0, _key("intermediate_size")),
    (".mlp.down_proj.weight", 1, _key("intermediate_size")),
    (".mlp.down_proj.weight", 0, _key("hidden_size")),
    # transformers 5 holds a layer's experts fused, split by EP on dim 0
    (".experts.gate_up_proj", 0, _experts), (".experts.down_proj", 0, _experts),
)
_CONFIG_SUFFIXES = tuple(row[0] for row in _CONFIG_DIMS)
# a vision or audio tower's tensors (Qwen2.5-VL's model.visual.blocks.N.mlp.*, MiniCPM-V's
# vpm.*), and the projector into the text model (InternVL's mlp1, Idefics3's connector,
# MiniCPM-V's resampler, DeepSeek-VL2's projector): config.json sizes them in a sub-config
# (vision_config), also where it states the text model's sizes at its top level, as the
# Hub's flat VLM configs do
_TOWER = re.compile(r"(?:^|\.)(?:visual|vision\w*|audio\w*|image_\w*|multi_modal_projector|"
                    r"mm_projector|vpm|vit|mlp1|connector|resampler|projector)\.")


def is_tower(name: str) -> bool:
    """A vision or audio tower's tensor (``_TOWER``): config.json's text sizes and head
    counts are not its own."""
    return _TOWER.search(name) is not None


def extent_mismatch(meta: CheckpointMeta, config: Mapping | None = None
                    ) -> tuple[str, str, int, int, int] | None:
    """For metadata whose shapes are the extents of the pieces present (torch DCP), the
    first (tensor, config key, config value, extent, dim) where config.json (``config``,
    else the checkpoint's own) states a size the pieces do not reach or exceed; None when
    all agree (or nothing compares)."""
    config = meta.config if config is None else config
    if not meta.shapes_from_extents:
        return None
    return config_mismatch({name: t.shape for name, t in meta.tensors.items()}, config)


def config_sized_mismatch(shapes: Mapping[str, Sequence[int]], config: Mapping | None
                          ) -> tuple[str, str, int, int, int] | None:
    """``config_mismatch`` on dim 0 of the tensors config.json sizes outright (the
    embedding's and head's vocab rows, the norms' hidden size): the dim an FSDP shard
    cuts. A draft head (``draft_vocab_size``, EAGLE-3) has its own vocabulary."""
    if not isinstance(config, Mapping):
        return None
    for name, shape in shapes.items():
        for suffix, key in _CONFIG_SIZED:
            if key == "vocab_size" and suffix == "lm_head.weight" and "draft_vocab_size" in config:
                key = "draft_vocab_size"
            want = config.get(key)
            if (name.endswith(suffix) and type(want) is int and shape and shape[0] != want
                    and not is_tower(name)):
                return name, key, want, shape[0], 0
    return None


def config_mismatch(shapes: Mapping[str, Sequence[int]], config: Mapping | None
                    ) -> tuple[str, str, int, int, int] | None:
    """The first (tensor, config key, config value, size, dim) where config.json states a
    size of a dim that the tensor's global shape in ``shapes`` does not have; None when
    all agree (or nothing compares). Used on the extents of DCP's pieces
    (``extent_mismatch``)."""
    if not isinstance(config, Mapping):
        return None
    bad = config_sized_mismatch(shapes, config)
    if bad is not None:
        return bad
    for name, shape in shapes.items():
        if not name.endswith(_CONFIG_SUFFIXES) or is_tower(name):   # C-level first
            continue
        for suffix, dim, size in _CONFIG_DIMS:
            if name.endswith(suffix) and len(shape) > dim:
                got = size(config)
                if got is not None and shape[dim] != got[1]:
                    return name, got[0], got[1], shape[dim], dim
    return None


def check_extents(meta: CheckpointMeta, config: Mapping | None = None) -> None:
    """CheckpointError naming the file and tensor where ``extent_mismatch`` finds one."""
    bad = extent_mismatch(meta, config)
    if bad is not None:
        name, key, want, got, dim = bad
        if got > want:
            # pieces past the config's size: no file is missing, the config is not these
            # weights'
            raise CheckpointError(f"torch DCP's per-rank shards reach {got} along dim {dim} of "
                                  f"this tensor, past the {key}={want} config.json says: the "
                                  f"config does not fit the weights (another model's config, "
                                  f"or a vocabulary padded in training); pass the config the "
                                  f"model was trained with (config= / --config)",
                                  file=meta.tensors[name].pieces[-1].file, tensor=name)
        raise CheckpointError(f"torch DCP's per-rank shards reach {got} along dim {dim} of this "
                              f"tensor, but config.json says {key}={want}: DCP records no "
                              f"global shape, so a missing rank's file shrinks the tensors; "
                              f"expected every rank's shard-*.safetensors file",
                              file=meta.tensors[name].pieces[-1].file, tensor=name)
