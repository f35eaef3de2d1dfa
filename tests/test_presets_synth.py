"""Every preset plans every synthesized architecture at common layouts, with exact cover."""
import pytest

import coordloader as cl
from coordloader.planning.planner import meta_from_specs
from coordloader.synth.archs import arch_tensors

ARCHS = ["llama", "qwen2", "qwen3_moe", "mixtral", "deepseek_v3", "bert"]
LAYOUTS = [dict(tp=2), dict(tp=4, ep=2), dict(tp=2, pp=2), dict(tp=2, dp=2, ep=4, ep_spans_dp=True)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("size", ["tiny", pytest.param("full", marks=pytest.mark.slow)])
def test_preset_plans_with_exact_cover(arch, size):
    config, specs = arch_tensors(arch, size)
    meta = meta_from_specs(config, specs)
    layouts = LAYOUTS if size == "tiny" else LAYOUTS[:1]
    for kw in layouts:
        plan = cl.make_plan(meta, cl.Layout(**kw))
        cl.validate_cover(plan, meta)
        held = {t.name for r in plan.ranks for t in r.tensors}
        assert held | set(plan.excluded) == set(meta.tensors), kw


def test_bert_pretraining_heads_replicated_on_last_stage():
    config, specs = arch_tensors("bert", "tiny")
    meta = meta_from_specs(config, specs)
    plan = cl.make_plan(meta, cl.Layout(tp=2, pp=2))
    for r in plan.ranks:
        names = {t.name: t for t in r.tensors}
        has_cls = any(n.startswith("cls.") for n in names)
        assert has_cls == (r.coords["pp"] == 1)
        if has_cls:
            t = names["cls.predictions.bias"]
            assert t.local_shape == t.global_shape
