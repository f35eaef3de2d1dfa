"""Sharding rules: architecture presets and user rule files (the strategy vocabulary they
name is `coordloader.planning.strategies`)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from coordloader.errors import PlanError
from coordloader.planning.rules.presets import PRESETS, detect_preset, num_experts_of, preset_rules
from coordloader.planning.rules.ruleset import (
    Rule,
    RuleFile,
    RuleSet,
    checked_rule,
    make_rule,
    parse_rule_file,
    rule_from_dict,
)
from coordloader.planning.strategies import STRATEGIES, check_params

__all__ = ["Rule", "RuleFile", "RuleSet", "STRATEGIES", "PRESETS", "detect_preset", "preset_rules",
           "resolve_rules", "make_rule", "num_experts_of", "check_params"]


def resolve_rules(config: Mapping | None, rules: Any = None) -> RuleSet:
    """Build the RuleSet the planner uses.

    ``rules``: None (preset detected from config.json), a preset name, a parsed rule file (a
    Mapping), a RuleSet, or a list of rules (dicts or Rule) that extend the detected preset.
    A rule file's path is read by ``coordloader.api.read_rules`` first: planning does no
    I/O."""
    if isinstance(rules, RuleSet):
        # a RuleSet the user built holds Rule objects no parser saw
        checked = [checked_rule(r, "RuleSet", i) for i, r in enumerate(rules.rules)]
        if checked == list(rules.rules):
            return rules
        return RuleSet(checked, user_count=rules.user_count, preset=rules.preset)
    user: list[Rule] = []
    preset: str | None = "auto"
    mode = "extend"
    if rules is None:
        pass
    elif isinstance(rules, str) and rules in PRESETS:
        preset = rules
    elif isinstance(rules, RuleFile):
        user, preset, mode = rules
    elif isinstance(rules, str):
        raise PlanError(f"unknown preset {rules!r} (presets: {', '.join(sorted(PRESETS))}); a "
                        f"rule file path is read by coordloader.make_plan, not by the planner")
    elif isinstance(rules, Mapping):
        user, preset, mode = parse_rule_file(dict(rules), "rules")
    elif isinstance(rules, Sequence):
        for i, r in enumerate(rules):
            user.append(checked_rule(r, "rules", i) if isinstance(r, Rule)
                        else rule_from_dict(r, "rules", i))
    else:
        raise PlanError(f"rules must be a preset name, a rule file path, a list of rules or a "
                        f"RuleSet, got {type(rules).__name__}")
    if mode == "replace":
        preset = None
    if preset == "auto":
        preset = detect_preset(config)
    base = preset_rules(preset, config) if preset is not None else []   # checks the name
    return RuleSet(user + base, user_count=len(user), preset=preset)
