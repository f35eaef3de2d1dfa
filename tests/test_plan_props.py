"""Property tests: random layouts x random small architectures."""
import collections
import pickle
from itertools import chain

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordloader.api import make_plan
from coordloader.checkpoint.metadata import box_numel
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.cover import validate_cover
from coordloader.planning.planner import meta_from_specs


@st.composite
def arch(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    hd = draw(st.sampled_from([2, 4]))
    H = heads * hd
    I = draw(st.sampled_from([4, 8, 12, 16]))
    E = draw(st.sampled_from([0, 2, 3, 4, 8]))
    nl = draw(st.integers(1, 4))
    V = draw(st.integers(3, 130))
    tie = draw(st.booleans())
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": heads,
           "num_key_value_heads": kv, "num_hidden_layers": nl, "tie_word_embeddings": tie}
    if E:
        cfg["num_experts"] = E
    specs = [("model.embed_tokens.weight", "BF16", (V, H)), ("model.norm.weight", "F32", (H,))]
    if not tie:
        specs.append(("lm_head.weight", "BF16", (V, H)))
    mtp = draw(st.integers(0, 1))
    if mtp:    # an MTP extra layer, which the config declares
        cfg["num_nextn_predict_layers"] = mtp
    for l in range(nl + mtp):
        p = f"model.layers.{l}."
        specs += [(p + "input_layernorm.weight", "F32", (H,)),
                  (p + "self_attn.q_proj.weight", "BF16", (heads * hd, H)),
                  (p + "self_attn.k_proj.weight", "BF16", (kv * hd, H)),
                  (p + "self_attn.v_proj.weight", "BF16", (kv * hd, H)),
                  (p + "self_attn.o_proj.weight", "BF16", (H, heads * hd))]
        if E:
            specs.append((p + "mlp.gate.weight", "F32", (E, H)))
            for e in range(E):
                specs += [(p + f"mlp.experts.{e}.gate_proj.weight", "BF16", (I, H)),
                          (p + f"mlp.experts.{e}.up_proj.weight", "BF16", (I, H)),
                          (p + f"mlp.experts.{e}.down_proj.weight", "BF16", (H, I))]
        else:
            specs += [(p + "mlp.gate_proj.weight", "BF16", (I, H)),
                      (p + "mlp.down_proj.weight", "BF16", (H, I))]
    return cfg, specs, draw(st.integers(1, 3))


@st.composite
def layout(draw, nl=4, experts=8, heads=8):
    """A layout, mostly one the architecture admits (so the invariants get checked), now and
    then one it does not (so PlanError stays the only way a bad layout fails)."""
    wild = draw(st.integers(0, 9)) == 0
    tp = draw(st.sampled_from([1, 2, 3, 4, 8] if wild else
                              [t for t in (1, 2, 4, 8) if heads % t == 0 or t <= 2]))
    dp = draw(st.integers(1, 3))
    pp = draw(st.integers(1, 3 if wild else max(1, min(3, nl))))
    spans = draw(st.booleans())
    G = tp * dp if spans else tp
    divisors = sorted(d for d in range(1, G + 1) if G % d == 0
                      and (wild or not experts or d <= experts))
    ep = draw(st.integers(1, 9)) if wild else draw(st.sampled_from(divisors))
    pl = draw(st.sampled_from(["linear", "round_robin", "map"]))
    if pl == "map":
        E = max(1, experts) if not wild else draw(st.integers(1, 8))
        owner = [draw(st.integers(0, ep - 1)) for _ in range(E)]   # every expert placed once
        extra = draw(st.lists(st.tuples(st.integers(0, ep - 1), st.integers(0, E - 1)), max_size=4))
        pl = tuple(tuple(sorted({e for e in range(E) if owner[e] == q}
                                | {e for r, e in extra if r == q})) for q in range(ep))
    return dict(tp=tp, dp=dp, pp=pp, ep=ep, ep_spans_dp=spans, expert_placement=pl,
                allow_uneven=draw(st.booleans()), include_mtp=draw(st.booleans()))


@st.composite
def case(draw):
    a = draw(arch())
    cfg = a[0]
    return a, draw(layout(cfg["num_hidden_layers"], cfg.get("num_experts", 0),
                          cfg["num_attention_heads"]))


EXAMPLES = 300
# Random layouts are often invalid for the random architecture (ep not dividing the group,
# heads not dividing tp, ...): those cases only prove that PlanError is the one error. The
# invariants below must really have been checked on a fair share of the cases.
MIN_VALID_SHARE = 0.5


def test_plan_properties():
    reached = collections.Counter()
    check = settings(deadline=None, max_examples=EXAMPLES, database=None,
                     suppress_health_check=[HealthCheck.too_slow])(given(case())(
                         lambda c: reached.update([_check_plan(*c)])))
    check()
    total = sum(reached.values())
    assert total >= EXAMPLES * 0.9, reached
    assert reached["valid"] >= MIN_VALID_SHARE * total, (
        f"only {reached['valid']} of {total} generated cases reached the invariants")


def _check_plan(a, lkw) -> str:
    cfg, specs, files = a
    meta = meta_from_specs(cfg, specs, files=files)
    try:
        L = Layout(**lkw)
        plan = make_plan(meta, L)
    except PlanError:
        event("PlanError")
        return "PlanError"                      # invalid layouts: PlanError and nothing else
    event("valid")
    validate_cover(plan, meta)
    assert plan.world_size == L.world_size
    E = cfg.get("num_experts", 0)
    for rp in plan.ranks:
        c = L.coords(rp.rank)
        for s in rp.tensors:
            # pieces fit the local shape; without padding they fill it exactly
            assert s.covered_numel <= s.local_numel
            assert sum(box_numel(p.src) for p in s.pieces) == s.covered_numel
            if s.strategy != "vocab":
                assert s.covered_numel == s.local_numel or L.allow_uneven
            if ".experts." in s.name:
                e = int(s.name.split(".")[5])
                assert c.ep in L.owners_of(e, E) and e in L.experts_of(c.ep, E)
    # every expert appears on exactly the ranks the placement formula names
    if E:
        for rp in plan.ranks:
            c = L.coords(rp.rank)
            held = {int(s.name.split(".")[5]) for s in rp.tensors if ".experts." in s.name}
            if held:
                assert held == set(L.experts_of(c.ep, E))
    # replicas are identical boxes of a primary
    prim = {}
    for rp in plan.ranks:
        for s in rp.tensors:
            if s.replica == 0:
                prim.setdefault(s.name, set()).add(tuple(p.src for p in s.pieces))
    for rp in plan.ranks:
        for s in rp.tensors:
            if s.replica:
                assert tuple(p.src for p in s.pieces) in prim[s.name]
    # digest: deterministic, survives pickling, sensitive to the layout
    d = plan.digest()
    assert make_plan(meta, L).digest() == d
    assert pickle.loads(pickle.dumps(plan)).digest() == d
    return "valid"


@st.composite
def keyed_places(draw):
    """Keys of a template's names in name order: runs that repeat a period of distinct keys
    (each layer's experts, a run per stage), with odd keys between, and their places."""
    keys, repeats = [], False
    for _ in range(draw(st.integers(1, 4))):
        period = draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True))
        times = draw(st.integers(1, 4))
        keys += period * times
        repeats |= times > 1
        keys += draw(st.lists(st.sampled_from("abcxyz"), max_size=3))
    places = sorted(draw(st.sets(st.integers(0, 10_000), min_size=len(keys), max_size=len(keys))))
    return keys, places, repeats


def test_family_grouping_is_grouping_by_key():
    """``_by_key`` (strided slices over periodic runs, a dict for the rest) puts each
    place under its own key, each once, in ascending order within a group."""
    from coordloader.planning.planner import _by_key
    reached = collections.Counter()

    def check(case):
        keys, places, repeats = case
        parts: dict = {}
        _by_key(parts, "h", keys, places)
        got = {k: sorted(chain.from_iterable(v)) for k, v in parts.items()}
        want: dict = {}
        for k, i in zip(keys, places):
            want.setdefault(("h", k), []).append(i)
        assert got == want
        assert all(g == sorted(g) for v in parts.values() for g in v)
        reached["a period repeats" if repeats else "other"] += 1

    settings(deadline=None, max_examples=EXAMPLES, database=None)(given(keyed_places())(check))()
    assert reached["a period repeats"] >= EXAMPLES // 2, reached
