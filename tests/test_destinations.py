"""Destinations handed in (``load_into`` targets, ``out=``) that cannot hold the load
correctly are refused with a LoadError naming the target, the tensor and the rank, never
mis-filled in silence."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import coordloader as cl
from coordloader.errors import LoadError
from coordloader.layout import Layout

ONE = dict(rank=0, replicate_unmatched=True)


@pytest.fixture()
def ab(tmp_path):
    """One file: F32 ``a`` = 0..3, ``b`` = 100..103."""
    save_file({"a": torch.arange(4.0), "b": torch.arange(4.0) + 100},
              str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_load_into_refuses_targets_on_the_meta_device(ab, engine):
    """copy_ into a meta tensor does nothing: a model built on the meta device was
    reported as fully loaded while holding no weights."""
    target = {"a": torch.zeros(4), "b": torch.empty(4, device="meta")}
    with pytest.raises(LoadError) as e:
        cl.load_into(target, ab, Layout(), engine=engine, **ONE)
    assert str(e.value) == ("rank 0, tensor 'b': target 'b' is on the meta device and has no "
                            "memory to load into; materialize it first (e.g. "
                            "module.to_empty(device=...))")
