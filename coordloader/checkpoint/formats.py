"""File names that say what a directory is. The reader decides from these names alone
which kind of checkpoint it is looking at, and the writers (``handoff/``) use the same
constants, so the two can never drift apart.

A coordloader *sharded* save is deliberately named unlike a Hugging Face checkpoint: no
``model*.safetensors`` and no ``*.safetensors.index.json``. transformers opens only those
names and vLLM globs ``*.safetensors``; a directory of ``.coordloader-shard`` files under
``coordloader-index.json`` gives them no weights file at all, so they refuse it instead of
loading pieces keyed ``name@a:b`` as if they were whole tensors (format version 1 was
named like HF and transformers loaded it with every split tensor randomly initialised).
"""
from __future__ import annotations

import re

CONFIG_NAME = "config.json"
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_INDEX_SUFFIX = ".safetensors.index.json"

# coordloader sharded format, version 2 (current)
SHARDED_INDEX = "coordloader-index.json"
SHARD_SUFFIX = ".coordloader-shard"
SHARDED_FORMAT = "coordloader-sharded"
SHARDED_VERSION = 2
# version 1 (read, never written): an HF-named index with a "coordloader" section
V1_VERSION = 1
V1_SHARD_RE = re.compile(r"model-rank-\d{5}-part-\d{5}\.safetensors\Z")

# --dump DIR: one rank's local tensors (its slices, under the checkpoint's names) per file,
# these keys in its __metadata__
DUMP_PLAN_DIGEST = "coordloader.plan_digest"
DUMP_RANK = "coordloader.rank"
# the identity (sizes, headers, sampled data blocks) of the checkpoint files a dump was loaded from
DUMP_SOURCE = "coordloader.source"

# torch DCP's HuggingFaceStorageWriter(save_distributed=True): one file per rank, plain
# tensor names, each piece's offsets in the file's __metadata__ under this key (no index,
# no global shapes)
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
DCP_SAVED_OFFSETS = "saved_offsets"
# shard-S-model-K-of-M: S is the writing rank + 1; K is the file the writer's
# fqn_to_index_mapping gives a tensor (1 without one) and M the mapping's largest, the same
# for every rank. A rank writes one file per K it holds tensors of, none when it holds none
DCP_SHARD_RE = re.compile(r"shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors\Z")
# numbered shards: the name says how many files the set has, which is all there is to go
# on when the index is missing. Any widths: transformers pads to 5 digits
# (model-00001-of-00004), DeepSeek-V3's own shards pad the count to 6
# (model-00001-of-000163), and other writers number from 0 or do not pad
NUMBERED_SHARD_RE = re.compile(r"(.*)-(\d+)-of-(\d+)\.safetensors\Z", re.ASCII)

# Weights in the formats transformers falls back to when a directory has no safetensors
# (pickle; TF and Flax in older versions), single, numbered shards, or their index: beside
# a new checkpoint they would be loaded in its place
OTHER_HF_WEIGHTS_RE = re.compile(
    r"(pytorch_model|tf_model|flax_model)(-\d{5}-of-\d{5})?\.(bin|h5|msgpack)(\.index\.json)?\Z")

# Present from the first visible change of a publish to its last: while it exists the
# directory mixes two checkpoints, and every coordloader reader refuses it.
PUBLISH_MARKER = "coordloader-publishing.json"
STAGING_PREFIX = ".coordloader-staging-"

# per-tensor content digests beside the checkpoint (coordloader.verify.manifest)
MANIFEST_NAME = "coordloader.manifest.json"


def shard_name(rank: int, part: int) -> str:
    return f"rank-{rank:05d}-part-{part:05d}{SHARD_SUFFIX}"


def interrupted_message(directory: str) -> str:
    """What every reader says about a directory holding the publish marker."""
    return (f"a save into this directory was interrupted while publishing ({PUBLISH_MARKER} "
            f"is present): its files mix the previous checkpoint and the new one. Every file of "
            f"the new checkpoint is on disk: finish it with coordloader.recover_save("
            f"{directory!r}), or run the save again with overwrite=True")
