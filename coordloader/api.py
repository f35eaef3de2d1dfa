"""The path-taking entry points in front of the pure planner: they read what lies on disk
(the checkpoint's headers, a rule file), then hand plain data to `planning`."""
from __future__ import annotations

import os
from typing import Any, Mapping

from coordloader.checkpoint.metadata import CheckpointMeta, with_other_config
from coordloader.checkpoint.reader import (
    MAX_CONFIG,
    MAX_JSON_FILE,
    checkpoint_path,
    read_checkpoint,
    read_json_document,
)
from coordloader.errors import CheckpointError, PlanError
from coordloader.layout import Layout
from coordloader.planning.model import Plan
from coordloader.planning.planner import build_plan
from coordloader.planning.rules import PRESETS
from coordloader.planning.rules.names import near_preset
from coordloader.planning.rules.ruleset import parse_rule_file


def read_json_file(path: str, what: str, limit: int = MAX_JSON_FILE) -> Any:
    """The JSON document in ``path``; a PlanError naming ``what`` and the file otherwise."""
    try:
        # a regular file, opened without blocking: a FIFO given as --rules waited forever
        return read_json_document(path, path, what, limit)
    except CheckpointError as e:
        raise PlanError(f"cannot read {what} {path}: {e.message}") from None
    except UnicodeDecodeError as e:
        raise PlanError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:   # bad syntax, a duplicate key, NaN
        raise PlanError(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise PlanError(f"{what} {path} is nested too deeply (expected a list of rules or an "
                        f"object)") from None


def read_rules(rules: Any) -> Any:
    """``rules`` with a rule-file path replaced by the file's parsed content (the source name
    kept for messages); anything else as given."""
    if isinstance(rules, os.PathLike):   # a path as config= and the checkpoint take it
        rules = os.fspath(rules)
    if isinstance(rules, (bytes, bytearray)):   # not a list of rules of one byte each
        raise PlanError(f"rules= must be a preset name, a rule file path (str or os.PathLike) "
                        f"or the rules themselves, got {type(rules).__name__}")
    if isinstance(rules, str) and rules not in PRESETS:
        if not os.path.lexists(rules):
            # read as a missing rule file, a preset's typo (qwen3-moe) named no preset
            raise PlanError(f"rules {rules!r} is neither a rule file nor a preset (presets: "
                            f"{', '.join(PRESETS)}){near_preset(rules)}")
        return parse_rule_file(read_json_file(rules, "rule file"), rules)
    return rules


def read_config(config: Any) -> dict | None:
    """``config=``: None, a dict, a path to a config.json, or a directory holding one."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise PlanError(f"config must be a dict or a path to config.json, got "
                        f"{type(config).__name__}")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    doc = read_json_file(path, "config file", MAX_CONFIG)
    if not isinstance(doc, dict):
        raise PlanError(f"config file {path} holds a JSON {type(doc).__name__}; expected an object")
    return doc


def with_config(meta: CheckpointMeta, config: Any) -> CheckpointMeta:
    """``meta`` planned with ``config`` in place of its own config.json (when given)."""
    doc = read_config(config)
    return meta if doc is None else with_other_config(meta, doc)


def make_plan(checkpoint: str | CheckpointMeta, layout: Layout, rules: Any = None, *,
              replicate_unmatched: bool = False, config: Any = None) -> Plan:
    """Plan which slice of which tensor every rank of ``layout`` holds.

    ``checkpoint``: a directory (read with coordloader.read_checkpoint) or its
    CheckpointMeta. ``rules``: None (preset detected from config.json), a preset name, a
    rule-file path, a list of rules, or a RuleSet. Tensors no rule matches are an error
    unless ``replicate_unmatched``. ``config``: the model's config (a dict, or a path to
    config.json) when the checkpoint directory has none, or to use instead of its own.
    Raises PlanError naming tensor, size and layout."""
    meta = checkpoint if isinstance(checkpoint, CheckpointMeta) else read_checkpoint(
        checkpoint_path(checkpoint))   # a str or os.PathLike, as load() takes
    meta = with_config(meta, config)
    return build_plan(meta, layout, read_rules(rules), replicate_unmatched=replicate_unmatched)
