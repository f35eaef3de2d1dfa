"""Sharding rules: strategy vocabulary, architecture presets, user rule files."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import PlanError
from .presets import PRESETS, detect_preset, num_experts_of, preset_rules
from .ruleset import Rule, RuleSet, load_rule_file, make_rule, parse_rule_file, rule_from_dict
from .strategies import STRATEGIES, check_params

__all__ = ["Rule", "RuleSet", "STRATEGIES", "PRESETS", "detect_preset", "preset_rules",
           "resolve_rules", "load_rule_file", "make_rule", "num_experts_of", "check_params"]


def resolve_rules(config: Mapping | None, rules: Any = None) -> RuleSet:
    """Build the RuleSet the planner uses.

    ``rules``: None (preset detected from config.json), a preset name, a path to a JSON rule
    file, a RuleSet, or a list of rules (dicts or Rule) that extend the detected preset."""
    if isinstance(rules, RuleSet):
        return rules
    user: list[Rule] = []
    preset: str | None = "auto"
    mode = "extend"
    if rules is None:
        pass
    elif isinstance(rules, str) and rules in PRESETS:
        preset = rules
    elif isinstance(rules, str):
        user, preset, mode = load_rule_file(rules)
    elif isinstance(rules, Mapping):
        user, preset, mode = parse_rule_file(dict(rules), "rules")
    elif isinstance(rules, Sequence):
        for i, r in enumerate(rules):
            user.append(r if isinstance(r, Rule) else rule_from_dict(r, "rules", i))
    else:
        raise PlanError(f"rules must be a preset name, a rule file path, a list of rules or a "
                        f"RuleSet, got {type(rules).__name__}")
    if mode == "replace":
        preset = None
    if preset == "auto":
        preset = detect_preset(config)
    base = preset_rules(preset, config) if preset is not None else []   # checks the name
    return RuleSet(user + base, user_count=len(user), preset=preset)
