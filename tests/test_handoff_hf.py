"""The handoff as transformers sees it: a sharded save is refused by
``from_pretrained`` (format 1 was loaded with every split tensor randomly initialised),
and its consolidated output loads with logits bit-equal to the source model's."""
from __future__ import annotations

import os

import pytest
import torch

import coordloader as cl
from coordloader.layout import Layout

from hfmodels import write_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    src = write_llama(str(base / "src"), dtype=torch.float32)
    layout = Layout(tp=2)
    plan = cl.make_plan(src, layout)
    for r in range(2):
        cl.save(str(base / "sharded"), cl.load(src, layout, rank=r), plan, rank=r, config=src)
    return src, str(base / "sharded"), base


def test_transformers_refuses_the_sharded_save(saved):
    src, sharded, _ = saved
    with pytest.raises(OSError, match="no file named model.safetensors"):
        transformers.AutoModelForCausalLM.from_pretrained(sharded)
    # and the save carries what from_pretrained needs once consolidated
    assert os.path.exists(os.path.join(sharded, "generation_config.json"))


def test_consolidated_save_gives_bit_equal_logits(saved):
    src, sharded, base = saved
    hf = str(base / "hf")
    cl.consolidate(sharded, hf)
    assert {"config.json", "generation_config.json"} <= set(os.listdir(hf))
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src)(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(hf)(ids).logits
    assert torch.equal(want, got)
