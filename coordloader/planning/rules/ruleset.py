"""Ordered sharding rules: ``{pattern, strategy, params}``; the first rule whose pattern
matches the whole tensor name wins. Patterns are globs (``*`` matches any run of
characters, dots included) unless the rule says ``"regex": true`` or the pattern starts
with ``re:``.

Rule files (JSON) are either a list of rules, or an object::

    {"preset": "llama" | "auto" | null, "mode": "extend" | "replace", "rules": [...]}

With ``extend`` (the default) the file's rules are tried before the preset's, so they
override it for the names they match and the preset still covers the rest; ``replace``
drops the preset."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from coordloader.errors import PlanError
from coordloader.planning.rules.names import PRESETS, near_preset
from coordloader.planning.strategies import check_params
from coordloader.text import clip


@dataclass(frozen=True)
class Rule:
    pattern: str
    strategy: str
    params: tuple[tuple[str, Any], ...] = ()
    regex: bool = False
    source: str = "preset"          # "preset:<name>" or the rule file; for messages/warnings

    @property
    def param_dict(self) -> dict:
        return dict(self.params)

    @property
    def regex_text(self) -> str:
        if self.regex:
            return self.pattern
        # fnmatch.translate anchors with \Z and wraps in (?s:...); strip the anchor, we
        # fullmatch anyway and want to combine patterns into one alternation.
        t = fnmatch.translate(self.pattern)
        return t[:-2] if t.endswith(r"\Z") else t

    def to_dict(self) -> dict:
        d = {"pattern": self.pattern, "strategy": self.strategy, "params": _jsonable(self.param_dict)}
        if self.regex:
            d["regex"] = True
        return d


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def make_rule(pattern: str, strategy: str, params: dict | None = None, *, regex: bool | None = None,
              source: str = "preset", where: str | None = None) -> Rule:
    where = where or f"rule {pattern!r} ({source})"
    if not isinstance(pattern, str) or not pattern:
        raise PlanError(f"{where}: pattern must be a non-empty string")
    if regex is not None and not isinstance(regex, bool):
        # a truthy string ("false") would make a glob a regular expression
        raise PlanError(f"{where}: 'regex' must be true or false, got {clip(repr(regex), 80)}")
    if regex is False and pattern.startswith("re:"):
        raise PlanError(f"{where}: the pattern starts with 're:' (a regular expression) but "
                        f"'regex' is false; drop one of them")
    if regex is None:
        regex = pattern.startswith("re:")
    if pattern.startswith("re:"):
        pattern = pattern[3:]
        regex = True
    p = check_params(strategy, {} if params is None else params, where)
    if regex:
        try:
            re.compile(pattern)
        except re.error as e:
            raise PlanError(f"{where}: bad regular expression: {e}") from None
    return Rule(pattern, strategy, tuple(sorted(p.items())), bool(regex), source)


def rule_from_dict(d: Any, source: str, index: int) -> Rule:
    where = f"{source}: rule #{index}"
    if not isinstance(d, dict):
        raise PlanError(f"{where}: expected an object with pattern, strategy, params")
    extra = set(d) - {"pattern", "strategy", "params", "regex", "comment"}
    if extra:
        raise PlanError(f"{where}: unknown keys {sorted(extra)}")
    for k in ("pattern", "strategy"):
        if k not in d:
            raise PlanError(f"{where}: missing {k!r}")
    params = d.get("params")
    return make_rule(d["pattern"], d["strategy"], {} if params is None else params,
                     regex=d.get("regex"), source=source, where=f"{where} ({d['pattern']!r})")


def checked_rule(r: Rule, source: str, index: int) -> Rule:
    """A Rule object of the user's made again as a rule of a file is (``make_rule``): its
    params checked and normalised as a dict rule's are, a ``re:`` pattern a regular
    expression, and the source its own where it names none."""
    try:
        params = dict(r.params)
    except (TypeError, ValueError):
        raise PlanError(f"{source}: rule #{index} ({clip(repr(r.pattern), 80)}): params must "
                        f"be (name, value) pairs or a dict, got {type(r.params).__name__}") from None
    src = source if r.source == "preset" else r.source   # the dataclass default
    return make_rule(r.pattern, r.strategy, params, regex=r.regex or None, source=src,
                     where=f"{source}: rule #{index} ({clip(repr(r.pattern), 80)})")


# ASCII digits read as 0: str.translate is fast on one long (ASCII) string but pays a
# mapping lookup per call on a name, which a bytes translation of its UTF-8 form does not
# (no other character's UTF-8 bytes fall in the ASCII range)
_DIGITS = "123456789"
_AS_ZERO = str.maketrans(_DIGITS, "0" * len(_DIGITS))
_AS_ZERO_BYTES = bytes.maketrans(_DIGITS.encode(), b"0" * len(_DIGITS))


def digit_template(name: str) -> str:
    """``name`` with every ASCII digit read as 0 (``digit_templates`` of one name)."""
    return (name.encode("utf-8", "surrogatepass").translate(_AS_ZERO_BYTES)
            .decode("utf-8", "surrogatepass"))


def digit_templates(names: Sequence[str]) -> list[str]:
    """Each name with every ASCII digit read as 0: names of one template differ only in
    their digits, which sit at the same positions with the same run lengths."""
    joined = "\n".join(names).translate(_AS_ZERO)
    if joined.count("\n") == max(len(names) - 1, 0):   # no name holds a newline
        return joined.split("\n") if names else []
    return list(map(digit_template, names))


_DIGIT_CODES = range(ord("0"), ord("9") + 1)


def _digit_blind(regex_text: str) -> bool:
    """Whether the regex matches a name exactly when it matches the name with every ASCII
    digit read as 0: true when each of its character atoms accepts all ten digits or none
    (no digit literal, no class such as [1-5]) and it has no back-reference (which could
    compare two digits). Then matching runs alike, position by position, on either name.
    False for anything it does not recognise."""
    try:
        from re import _parser
        tree = _parser.parse(regex_text)
    except Exception:   # a private module: any change in it only costs the shortcut
        return False
    return _blind(tree, _parser)


def _blind(seq, P) -> bool:
    for op, av in seq:
        if op in (P.LITERAL, P.NOT_LITERAL):
            if av in _DIGIT_CODES:
                return False
        elif op is P.IN:
            hits = {_class_has(av, d, P) for d in _DIGIT_CODES}
            if len(hits) != 1 or None in hits:
                return False
        elif op in (P.ANY, P.AT):
            continue
        elif op is P.BRANCH:
            if not all(_blind(b, P) for b in av[1]):
                return False
        elif op is P.SUBPATTERN:
            if not _blind(av[3], P):
                return False
        elif op in (P.MAX_REPEAT, P.MIN_REPEAT, getattr(P, "POSSESSIVE_REPEAT", None)):
            if not _blind(av[2], P):
                return False
        elif op in (P.ASSERT, P.ASSERT_NOT):
            if not _blind(av[1], P):
                return False
        elif op is getattr(P, "ATOMIC_GROUP", None):
            if not _blind(av, P):
                return False
        else:   # back-references, conditionals, anything new
            return False
    return True


def _class_has(items, code: int, P) -> bool | None:
    """Whether the character class ``items`` (an IN node's) holds the digit ``code``; None
    for an item it does not know."""
    with_digits = {P.CATEGORY_DIGIT, P.CATEGORY_WORD, P.CATEGORY_NOT_SPACE,
                   P.CATEGORY_NOT_LINEBREAK, P.CATEGORY_LOC_WORD, P.CATEGORY_UNI_DIGIT,
                   P.CATEGORY_UNI_WORD, P.CATEGORY_UNI_NOT_SPACE, P.CATEGORY_UNI_NOT_LINEBREAK}
    without = {P.CATEGORY_NOT_DIGIT, P.CATEGORY_NOT_WORD, P.CATEGORY_SPACE,
               P.CATEGORY_LINEBREAK, P.CATEGORY_LOC_NOT_WORD, P.CATEGORY_UNI_NOT_DIGIT,
               P.CATEGORY_UNI_NOT_WORD, P.CATEGORY_UNI_SPACE, P.CATEGORY_UNI_LINEBREAK}
    neg = False
    hit = False
    for op, av in items:
        if op is P.NEGATE:
            neg = True
        elif op is P.LITERAL:
            hit = hit or av == code
        elif op is P.RANGE:
            hit = hit or av[0] <= code <= av[1]
        elif op is P.CATEGORY and av in with_digits:
            hit = True
        elif not (op is P.CATEGORY and av in without):
            return None
    return hit != neg


class RuleSet:
    """Ordered rules with a fast first-match lookup (one combined regex)."""

    def __init__(self, rules: Sequence[Rule], *, user_count: int = 0, preset: str | None = None):
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.user_count = user_count          # the first `user_count` rules came from the user
        self.preset = preset
        # One alternation of named wrappers: fullmatch tries the alternatives in order, so
        # the first rule that matches the whole name wins. Back-references, conditionals
        # ((?(1)a|b) tests a group by number) and named groups inside user regexes would
        # shift, so those rule sets fall back to a loop.
        self._combined = None
        if self.rules and not any(re.search(r"\\\d|\(\?P[<=]|\(\?\(", r.regex_text)
                                  for r in self.rules):
            alt = "|".join(f"(?P<r{i}>{r.regex_text})" for i, r in enumerate(self.rules))
            try:
                self._combined = re.compile(alt)
            except (re.error, AssertionError, OverflowError):  # e.g. too many groups
                self._combined = None
        self._group_index = {f"r{i}": i for i in range(len(self.rules))}
        # the one-by-one fallback (patterns were checked to compile in make_rule)
        self._compiled = [] if self._combined is not None else [re.compile(r.regex_text)
                                                                for r in self.rules]
        self._digit_blind: bool | None = None   # computed on first match_all

    def match_all(self, names: Sequence[str],
                  templates: Sequence[str] | None = None) -> list[int | None]:
        """``match`` of each name. When no rule can tell one ASCII digit from another
        (``_digit_blind``), names equal up to their digits match alike, so each distinct
        *digit template* (``digit_templates``; given when the caller has them) is matched
        once: DeepSeek-V3's 92 k names are a few hundred templates."""
        if not self.digit_blind:
            return list(map(self.match, names))
        if templates is None:
            templates = digit_templates(names)
        found = {t: self.match(t) for t in set(templates)}
        return list(map(found.__getitem__, templates))

    @property
    def digit_blind(self) -> bool:
        """Whether no rule can tell one ASCII digit from another: then names of one digit
        template match one rule."""
        if self._digit_blind is None:
            self._digit_blind = all(_digit_blind(r.regex_text) for r in self.rules)
        return self._digit_blind

    def match(self, name: str) -> int | None:
        """Index of the first rule matching ``name``, or None."""
        if self._combined is not None:
            m = self._combined.fullmatch(name)
            if m is None:
                return None
            # the wrapper group of the matching alternative closes last
            return self._group_index[m.lastgroup]
        for i, c in enumerate(self._compiled):
            if c.fullmatch(name):
                return i
        return None

    def __len__(self):
        return len(self.rules)

    def __repr__(self):
        return f"RuleSet(preset={self.preset!r}, {len(self.rules)} rules, {self.user_count} user)"

    def to_list(self) -> list[dict]:
        return [r.to_dict() for r in self.rules]


class RuleFile(NamedTuple):
    """A parsed rule file: its rules, the preset they extend ('auto', a name, or None) and
    the mode ('extend' the preset or 'replace' it)."""
    rules: list[Rule]
    preset: str | None
    mode: str


def parse_rule_file(data: Any, source: str) -> RuleFile:
    if isinstance(data, list):
        return RuleFile([rule_from_dict(d, source, i) for i, d in enumerate(data)], "auto", "extend")
    if not isinstance(data, dict):
        raise PlanError(f"{source}: a rule file is a JSON list of rules or an object with 'rules'")
    extra = set(data) - {"preset", "mode", "rules", "comment"}
    if extra:
        raise PlanError(f"{source}: unknown keys {sorted(extra)}")
    mode = data.get("mode", "extend")
    if mode not in ("extend", "replace"):
        raise PlanError(f"{source}: mode must be 'extend' or 'replace', got {mode!r}")
    rules = data.get("rules", [])
    if not isinstance(rules, list):
        raise PlanError(f"{source}: 'rules' must be a list")
    preset = data.get("preset", "auto")
    if preset not in ("auto", None):
        if not isinstance(preset, str) or preset not in PRESETS:
            raise PlanError(f"{source}: unknown preset {clip(repr(preset), 80)} (presets: "
                            f"{', '.join(PRESETS)}){near_preset(preset)}")
    return RuleFile([rule_from_dict(d, source, i) for i, d in enumerate(rules)], preset, mode)
