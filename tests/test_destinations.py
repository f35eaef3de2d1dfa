"""Destinations handed in (``load_into`` targets, ``out=``) that cannot hold the load
correctly are refused with a LoadError naming the target, the tensor and the rank, never
mis-filled in silence."""
from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file

import coordloader as cl
from coordloader.engines import select_engine
from coordloader.errors import LoadError
from coordloader.layout import Layout
from coordloader.planning.model import ByteRun

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
    # to_empty(), the way out the message once gave, leaves a module's computed buffers
    # (rotary inv_freq) as whatever memory held: a loaded model with garbage rotary tables
    assert str(e.value) == ("rank 0, tensor 'b': target 'b' is on the meta device and has no "
                            "memory to load into; build the module on the device to fill "
                            "(e.g. under `with torch.device('cpu'):`): module.to_empty() "
                            "would leave the buffers it computes itself (rotary tables) "
                            "uninitialised")


@pytest.mark.parametrize("rank", [True, 1.0, 1.5, "1"], ids=repr)
def test_a_rank_that_is_no_integer_is_refused_before_any_read(ab, tmp_path, monkeypatch, rank):
    """rank=np.int64(1) loaded, then failed in verify with a bare TypeError; "1" and 1.0
    failed deep in the load with bare TypeErrors; save(rank=1.5) saved rank 1's share."""
    import os

    import numpy as np
    plan = cl.make_plan(ab, Layout(tp=2), replicate_unmatched=True)
    want = cl.load_detailed(ab, Layout(tp=2), rank=1, replicate_unmatched=True).tensors
    got = cl.load_detailed(ab, Layout(tp=2), rank=np.int64(1), replicate_unmatched=True).tensors
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    monkeypatch.setattr(os, "preadv", None)   # any read: a TypeError, not the message
    msg = f"rank= must be an integer, got {rank!r} ({type(rank).__name__})"
    for call in (lambda: cl.load_detailed(ab, Layout(tp=2), rank=rank, replicate_unmatched=True),
                 lambda: cl.load_into({"a": torch.zeros(4), "b": torch.zeros(4)}, ab,
                                      Layout(tp=2), rank=rank, replicate_unmatched=True)):
        with pytest.raises(LoadError) as e:
            call()
        assert str(e.value) == msg
    with pytest.raises(cl.SaveError) as e:
        cl.save(str(tmp_path / "s"), {"a": torch.zeros(2)}, plan, rank=rank,
                config={"model_type": "llama"})
    assert str(e.value) == msg and not (tmp_path / "s").exists()


def test_load_into_refuses_out(ab):
    """out= was taken and ignored: the caller's tensors left as they were."""
    other = {"a": torch.zeros(4), "b": torch.zeros(4)}
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(LoadError) as e:
        cl.load_into(target, ab, Layout(), out=other, **ONE)
    assert str(e.value) == "rank 0: load_into takes no out=: its target is where the tensors go"
    assert not any(t.any() for t in [*other.values(), *target.values()])


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
@pytest.mark.parametrize("how", ["overlapping", "same"])
def test_out_destinations_sharing_memory_are_refused(ab, engine, how):
    """out= with two destinations over the same bytes: 'a' came back holding 'b''s first
    values (0, 1, 100, 101), and verify passed."""
    buf = torch.full((6,), -1.0)
    out = ({"a": buf[0:4], "b": buf[2:6]} if how == "overlapping" else
           {"a": buf[0:4], "b": buf[0:4]})
    with pytest.raises(LoadError) as e:
        cl.load_detailed(ab, Layout(), engine=engine, out=out, **ONE)
    assert str(e.value) == ("rank 0, tensor 'b': destinations of 'a' and 'b' share memory; "
                            "each needs memory of its own (aliased or overlapping views; tied "
                            "weights: map one of the two names to None)")
    assert buf.tolist() == [-1.0] * 6     # refused before any read


def test_load_into_targets_sharing_memory_are_refused(ab):
    """Non-contiguous targets go through a copy after the load: two of them interleaved
    over the same bytes were filled one after the other, the second winning."""
    buf = torch.full((4, 3), -1.0)
    with pytest.raises(LoadError) as e:
        cl.load_into({"a": buf[:, 1], "b": buf.t()[1]}, ab, Layout(), **ONE)
    assert str(e.value) == ("rank 0, tensor 'b': targets of 'a' and 'b' share memory; "
                            "each needs memory of its own (aliased or overlapping views; tied "
                            "weights: map one of the two names to None)")
    assert buf.tolist() == [[-1.0] * 3] * 4
    # an expanded target: every element is one float
    with pytest.raises(LoadError) as e:
        cl.load_into({"a": torch.zeros(1).expand(4)}, ab, Layout(), strict=False, **ONE)
    assert str(e.value) == ("rank 0, tensor 'a': target has elements that share memory (an "
                            "expanded or overlapping view); it needs memory of its own")


@pytest.fixture()
def m23(tmp_path):
    """One file: F32 ``m`` = [[0, 1, 2], [3, 4, 5]]."""
    save_file({"m": torch.arange(6.0).reshape(2, 3)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_a_target_whose_rows_overlap_is_refused(m23):
    """An as_strided target whose rows overlap by one element: torch calls its overlap
    "too hard" to tell, so it passed; rows written one after the other left 'm' unequal
    to the checkpoint, with verify="full" passing."""
    base = torch.full((5,), -1.0)
    for call in (lambda t: cl.load_into({"m": t}, m23, Layout(), verify="full", **ONE),
                 lambda t: cl.load_detailed(m23, Layout(), out={"m": t}, **ONE)):
        with pytest.raises(LoadError) as e:
            call(base.as_strided((2, 3), (2, 1)))
        assert str(e.value).startswith("rank 0, tensor 'm': ") and str(e.value).endswith(
            " has elements that share memory (an expanded or overlapping view); it needs "
            "memory of its own"), str(e.value)
        assert base.tolist() == [-1.0] * 5   # refused before any read


@pytest.mark.parametrize("how", ["transposed", "stepped", "interleaved"])
def test_targets_of_unusual_strides_that_do_not_overlap_load(m23, how):
    """Views torch calls too hard to judge, but whose elements each have their own memory
    (a stepped slice; rows of stride 3 over columns of stride 2, which interleave), load
    byte-exact, leaving the rest of their buffer alone."""
    base = torch.full((12,), -1.0)
    t = {"transposed": lambda: base[:6].view(3, 2).t(),
         "stepped": lambda: base.view(2, 6)[:, ::2],
         "interleaved": lambda: base.as_strided((2, 3), (3, 2))}[how]()
    cl.load_into({"m": t}, m23, Layout(), verify="full", **ONE)
    assert t.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert (base == -1).sum().item() == 12 - 6   # nothing written outside the view


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_a_one_element_target_of_any_stride_loads(tmp_path, engine):
    """torch calls a one-element view contiguous whatever its stride (``buf[1::2]`` of a
    2-vector, a parameter made so): the cpu engine's byte view refused it with torch's
    raw "stride(-1) must be 1"."""
    save_file({"b": torch.tensor([5.0], dtype=torch.float16)}, str(tmp_path / "model.safetensors"))
    for call in ("out", "into"):
        buf = torch.zeros(2, dtype=torch.float16)
        dest = buf[1::2]
        assert dest.stride() == (2,) and dest.is_contiguous()
        if call == "out":
            got = cl.load_detailed(str(tmp_path), Layout(), out={"b": dest}, engine=engine, **ONE)
            assert got.tensors["b"].data_ptr() == dest.data_ptr()
        else:
            cl.load_into({"b": dest}, str(tmp_path), Layout(), engine=engine, **ONE)
        assert buf.tolist() == [0.0, 5.0], (call, buf)


def test_tied_targets_are_refused_and_load_with_one_name_dropped(ab):
    """A state_dict of tied weights names one tensor twice: the error says how to load it,
    and dropping one name loads both, as one tensor."""
    tied = torch.full((4,), -1.0)
    with pytest.raises(LoadError, match="tied weights: map one of the two names to None"):
        cl.load_into({"a": tied, "b": tied}, ab, Layout(), **ONE)
    got = cl.load_into({"a": tied, "b": tied}, ab, Layout(), name_map={"b": None}, **ONE)
    assert got.loaded == ["a"] and got.skipped == ["b"]


def test_interleaved_targets_that_do_not_share_memory_load(ab):
    """Column views of one buffer span the same addresses without sharing a byte: they
    load, each with its own tensor's bytes."""
    buf = torch.full((4, 3), -1.0)
    res = cl.load_into({"a": buf[:, 0], "b": buf[:, 2]}, ab, Layout(), **ONE)
    assert sorted(res.loaded) == ["a", "b"]
    assert buf.tolist() == [[i, -1.0, 100.0 + i] for i in range(4)]


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
@pytest.mark.parametrize("device", ["banana", "xpu:3", "meta", "privateuseone"]
                         + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
def test_unusable_device_is_a_load_error(ab, engine, device):
    """A device this machine lacks failed after the whole rank was read, with torch's
    bare AssertionError ("Torch not compiled with CUDA enabled") or RuntimeError. The
    meta device was read in full and returned tensors without data as a passing load."""
    for call in (lambda: cl.load_detailed(ab, Layout(), engine=engine, device=device, **ONE),
                 lambda: cl.load_into({"a": torch.zeros(4), "b": torch.zeros(4)}, ab, Layout(),
                                      engine=engine, device=device, **ONE)):
        with pytest.raises(LoadError) as e:
            call()
        assert str(e.value).startswith(f"rank 0: device {device!r} is not usable here: "), \
            str(e.value)
        assert e.value.rank == 0
        if device == "meta":
            assert "the meta device holds no data" in str(e.value)


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_out_parameters_requiring_grad_are_filled(tmp_path, engine):
    """out= holding nn.Parameters (requires_grad): the safetensors engine, and the cpu
    engine on a slice with padding rows to zero, failed with autograd's bare RuntimeError
    about an in-place operation on a leaf."""
    from coordloader.planning.model import Piece, RankPlan, TensorSlice
    save_file({"w": torch.arange(6.0).reshape(3, 2)}, str(tmp_path / "model.safetensors"))
    meta = cl.read_checkpoint(str(tmp_path))
    sp = meta.tensors["w"].pieces[0]
    # rows 0..2 of w, padded to 4 rows (the last one zero)
    ts = TensorSlice("w", sp.file, "F32", (3, 2), (4, 2), (Piece(((0, 3), (0, 2)), (0, 0)),), 0,
                     (ByteRun(sp.file, sp.start, 24, 0),))
    p = torch.nn.Parameter(torch.full((4, 2), 9.0))
    got, _ = select_engine(engine).load_rank(meta, RankPlan(0, {}, (ts,)), "cpu", out={"w": p})
    assert got["w"].data_ptr() == p.data_ptr() and p.requires_grad
    assert p.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [0.0, 0.0]]


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
@pytest.mark.parametrize("how", ["load_into", "out"])
def test_a_graph_that_saved_a_target_refuses_to_backpropagate_after_the_load(ab, engine, how):
    """The cpu engine writes a destination with preadv and numpy, behind autograd's back:
    a graph built on the old weight backpropagated through the new bytes (x.grad [[100,
    100]] where the graph saw 1s), while copy_ (the safetensors engine) is refused."""
    w = torch.nn.Parameter(torch.ones(4))
    x = torch.ones(4, requires_grad=True)
    y = (x * w).sum()
    if how == "load_into":
        cl.load_into({"b": w}, ab, Layout(), engine=engine, strict=False, **ONE)
    else:
        cl.load_detailed(ab, Layout(), engine=engine, out={"b": w}, **ONE)
    assert w.tolist() == [100.0, 101.0, 102.0, 103.0]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()

@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
@pytest.mark.parametrize("bad", ["shape", "dtype", "missing", "meta", "two-for-one", "sparse",
                                 "csr", "nested"])
def test_a_refused_target_leaves_every_target_unwritten(ab, engine, bad):
    """Targets were matched to the loaded tensors after the load: 'a' (contiguous, filled
    by the engine in place) already held the checkpoint's bytes when 'b' was refused, so
    the call raised with the model half overwritten. Now every target is checked against
    the plan before any read."""
    a = torch.full((4,), -1.0)
    b = {"shape": torch.zeros(5), "dtype": torch.zeros(4, dtype=torch.float64),
         "missing": None, "meta": torch.empty(4, device="meta"), "two-for-one": None,
         # a sparse COO target was refused as sharing memory; CSR and nested ones failed
         # in torch, untyped
         "sparse": torch.zeros(4).to_sparse(), "csr": None, "nested": None}[bad]
    with warnings.catch_warnings():   # torch's beta/prototype notices for these layouts
        warnings.simplefilter("ignore")
        if bad == "csr":
            b = torch.zeros(1, 4).to_sparse_csr()
        elif bad == "nested":
            b = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)])
    target = {"a": a} if b is None else {"a": a, "b": b}
    name_map = {"b": "a"} if bad == "two-for-one" else None
    want = {
        "shape": "target 'b' is torch.float32 [5], this rank's slice is torch.float32 [4]",
        "dtype": "target 'b' is torch.float64 [4], this rank's slice is torch.float32 [4]",
        "missing": "no target entry 'b' for this checkpoint tensor",
        "meta": "target 'b' is on the meta device",
        "two-for-one": "checkpoint tensors 'a' and 'b' both map to the target 'a'",
        "sparse": "target 'b' is a sparse_coo tensor; expected a dense (strided) tensor",
        "csr": "target 'b' is a sparse_csr tensor; expected a dense (strided) tensor",
        "nested": "target 'b' is a nested tensor; expected a dense (strided) tensor",
    }[bad]
    with pytest.raises(LoadError) as e:
        cl.load_into(target, ab, Layout(), engine=engine, name_map=name_map, **ONE)
    assert str(e.value).startswith(f"rank 0, tensor 'b': {want}"), str(e.value)
    assert a.tolist() == [-1.0] * 4   # refused before any read: nothing written


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_a_wrapper_subclass_target_is_refused_before_any_read(ab, engine):
    """A tensor subclass that wraps others (TwoTensor) failed inside the cpu engine with
    '.numpy() is not supported for tensor subclasses', and the safetensors engine wrote
    into it and reported it loaded."""
    from torch.testing._internal.two_tensor import TwoTensor
    a = torch.full((4,), -1.0)
    b = TwoTensor(torch.zeros(4), torch.zeros(4))
    with pytest.raises(LoadError) as e:
        cl.load_into({"a": a, "b": b}, ab, Layout(), engine=engine, **ONE)
    assert str(e.value).startswith(
        "rank 0, tensor 'b': target 'b' is a TwoTensor, a tensor subclass that wraps others; "
        "expected a tensor whose own storage holds its values"), str(e.value)
    assert a.tolist() == [-1.0] * 4   # refused before any read: nothing written


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_a_wrapper_subclass_out_destination_is_refused_before_any_read(ab, engine):
    """The same through ``out=``: the cpu engine raised torch's bare '.numpy() is not
    supported for tensor subclasses', and once it read at the tensor's address, read to
    address 0 (a wrapper has no storage: an EFAULT, or a crash in the strided copy)."""
    from torch.testing._internal.two_tensor import TwoTensor
    a = torch.full((4,), -1.0)
    b = TwoTensor(torch.zeros(4), torch.zeros(4))
    with pytest.raises(LoadError) as e:
        cl.load_detailed(ab, Layout(), out={"a": a, "b": b}, engine=engine, **ONE)
    assert str(e.value) == (
        "rank 0, tensor 'b': destination is a TwoTensor, a tensor subclass that wraps "
        "others; expected a tensor whose own storage holds its values (its local tensor, or "
        "a plain tensor to convert after)")
    assert a.tolist() == [-1.0] * 4   # refused before any read: nothing written


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_out_destinations_are_refused_in_plan_order_wrappers_included(ab, engine):
    """The wrapper check ran over every destination before the others' checks: a float or
    a sparse tensor for 'a' was named after a wrapper for 'b', unlike before it and unlike
    load_into, which names the first bad target in plan order."""
    from torch.testing._internal.two_tensor import TwoTensor
    for a, said in ((1.5, "destination is a float, not a torch.Tensor"),
                    (torch.zeros(4).to_sparse(), "destination is a sparse_coo tensor")):
        b = TwoTensor(torch.zeros(4), torch.zeros(4))
        with pytest.raises(LoadError) as e:
            cl.load_detailed(ab, Layout(), out={"a": a, "b": b}, engine=engine, **ONE)
        assert str(e.value).startswith(f"rank 0, tensor 'a': {said}"), str(e.value)
    with pytest.raises(LoadError) as e:
        cl.load_detailed(ab, Layout(), out={"a": TwoTensor(torch.zeros(4), torch.zeros(4)),
                                            "b": torch.zeros(4).to_sparse()},
                         engine=engine, **ONE)
    assert str(e.value).startswith("rank 0, tensor 'a': destination is a TwoTensor"), str(e.value)


def test_a_wrapper_target_of_another_shape_is_named_as_a_wrapper(ab):
    """A wrapper's shape is not its storage's (a DTensor states its global shape): the
    shape refusal came first and named a shape mismatch, hiding why it cannot be filled."""
    from torch.testing._internal.two_tensor import TwoTensor
    b = TwoTensor(torch.zeros(8), torch.zeros(8))
    with pytest.raises(LoadError) as e:
        cl.load_into({"a": torch.zeros(4), "b": b}, ab, Layout(), **ONE)
    assert "target 'b' is a TwoTensor, a tensor subclass that wraps others" in str(e.value)


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_inference_targets_load_outside_inference_mode(ab, engine):
    """Inference tensors (made under torch.inference_mode()) as targets, the call outside
    it: a non-contiguous one, filled by copy_ after the last phase, raised torch's bare
    RuntimeError on its rank alone while the others returned as loaded; padding rows and
    the safetensors engine's narrowed copies failed the same way inside the load. Every
    write into one is made in inference mode now: they load, as under it."""
    with torch.inference_mode():
        a, b = torch.zeros(4), torch.zeros(8)[::2]
        padded = torch.full((8,), 7.0)
    cl.load_into({"a": a, "b": b}, ab, Layout(), engine=engine, **ONE)
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and b.tolist() == [100.0, 101.0, 102.0, 103.0]
    rules = [{"pattern": "a", "strategy": "vocab", "params": {"pad_to": 8}},
             {"pattern": "b", "strategy": "replicate"}]
    cl.load_into({"a": padded, "b": torch.zeros(4)}, ab, Layout(), rules=rules, engine=engine,
                 **ONE)
    assert padded.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    with torch.inference_mode():   # and under it, as before
        c = torch.zeros(8)[::2]
        cl.load_into({"a": torch.zeros(4), "b": c}, ab, Layout(), engine=engine, **ONE)
    assert c.tolist() == [100.0, 101.0, 102.0, 103.0]
    # load(out=) writes into them alike
    with torch.inference_mode():
        o = torch.zeros(4)
    got = cl.load_detailed(ab, Layout(), engine=engine, out={"a": o}, **ONE).tensors
    assert o.tolist() == [0.0, 1.0, 2.0, 3.0] and got["a"].data_ptr() == o.data_ptr()


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_a_parameter_subclass_over_its_own_storage_loads(ab, engine):
    """A Parameter subclass (vLLM's parameters are) holds its values in its own storage:
    it was refused with the wrapper subclasses, which it is not."""
    class MyParam(torch.nn.Parameter):
        pass
    a, b = MyParam(torch.zeros(4)), torch.zeros(4).as_subclass(type("T", (torch.Tensor,), {}))
    cl.load_into({"a": a, "b": b}, ab, Layout(), engine=engine, **ONE)
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and b.tolist() == [100.0, 101.0, 102.0, 103.0]


@pytest.mark.parametrize("as_module", [False, True])
def test_strict_refuses_a_target_no_tensor_fills(ab, as_module):
    """A target the checkpoint has no tensor for (a DCP save that lost a rank's file takes
    whole tensors with it) kept what it held, listed in not_loaded only: the model looked
    loaded. Under strict it is refused before any read; strict=False loads the rest. A
    module's non-persistent buffers (rotary tables are computed) are not required."""
    a, c = torch.full((4,), -1.0), torch.full((3,), -1.0)
    if as_module:
        target = torch.nn.Module()
        target.a, target.c = torch.nn.Parameter(a), torch.nn.Parameter(c)
        target.register_buffer("inv_freq", torch.zeros(2), persistent=False)
    else:
        target = {"a": a, "c": c}
    with pytest.raises(LoadError) as e:
        cl.load_into(target, ab, Layout(), name_map={"b": None}, **ONE)
    assert str(e.value) == ("rank 0: no checkpoint tensor of this rank fills the target 'c': the "
                            "checkpoint lacks it (a file missing?), the layout gives it to "
                            "other ranks (another pipeline stage or expert owner: build only "
                            "this rank's part of the model), or name_map sends it elsewhere; "
                            "pass strict=False to load the rest (LoadIntoResult.not_loaded "
                            "then lists them)")
    assert a.tolist() == [-1.0] * 4          # refused before any read
    got = cl.load_into(target, ab, Layout(), name_map={"b": None}, strict=False, **ONE)
    assert got.loaded == ["a"] and "c" in got.not_loaded and a.tolist() == [0.0, 1.0, 2.0, 3.0]
    if as_module:   # the buffer alone unfilled: loaded under strict
        del target.c
        assert cl.load_into(target, ab, Layout(), name_map={"b": None}, **ONE).loaded == ["a"]


def test_strict_follows_what_transformers_leaves_out_and_empty_targets(ab):
    """strict required every parameter: a model's parameters transformers leaves out of
    its saves (Marian's sinusoidal embed_positions, ``_keys_to_ignore_on_save``) or lets
    be missing (``_keys_to_ignore_on_load_missing``), and zero-size ones (an EP rank a
    map gives no experts), were refused though there is nothing to load."""
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.full((4,), -1.0))
    m.pos = torch.nn.Parameter(torch.zeros(3))        # computed at init, never saved
    m.temperature = torch.nn.Parameter(torch.zeros(1))
    m.none = torch.nn.Parameter(torch.zeros(0, 4))    # nothing to hold
    m._keys_to_ignore_on_save = ["pos"]
    m._keys_to_ignore_on_load_missing = [r"temp\w+"]
    got = cl.load_into(m, ab, Layout(), name_map={"b": None}, **ONE)
    assert got.loaded == ["a"] and m.a.tolist() == [0.0, 1.0, 2.0, 3.0]
    del m._keys_to_ignore_on_load_missing
    with pytest.raises(LoadError, match="fills the target 'temperature'"):
        cl.load_into(m, ab, Layout(), name_map={"b": None}, **ONE)


def test_a_name_map_giving_no_name_is_a_load_error(ab):
    """A name_map returning something that is not a name (7) failed inside transformers'
    renaming regex with a bare TypeError."""
    with pytest.raises(LoadError) as e:
        cl.load_into({"a": torch.zeros(4)}, ab, Layout(), name_map=lambda n: 7, **ONE)
    assert str(e.value) == ("rank 0, tensor 'a': name_map gave 7 for this checkpoint tensor; "
                            "expected a target name (a str) or None")


def test_aliases_counted_as_filled_are_not_reported_unloaded(ab):
    """A tied state dict's second name (one tensor, two names) is filled with the first:
    not_loaded listed it all the same."""
    tied = torch.zeros(4)
    got = cl.load_into({"a": tied, "b": tied}, ab, Layout(), name_map={"b": None}, **ONE)
    assert got.loaded == ["a"] and got.not_loaded == []


@pytest.mark.parametrize("value", [1.0, [0.0, 1.0, 2.0, 3.0]], ids=["float", "list"])
def test_a_destination_that_is_no_tensor_is_a_load_error(ab, value):
    """A float or list among the targets raised a bare AttributeError ('float' object has
    no attribute 'shape'), from load_into and from out=."""
    with pytest.raises(LoadError) as e:
        cl.load_into({"a": value, "b": torch.zeros(4)}, ab, Layout(), **ONE)
    kind = type(value).__name__
    assert str(e.value) == (f"rank 0, tensor 'a': target 'a' is a {kind}, not a torch.Tensor; "
                            f"expected a tensor to load into")
    with pytest.raises(LoadError) as e:
        cl.load_detailed(ab, Layout(), out={"a": value}, **ONE)
    assert str(e.value) == (f"rank 0, tensor 'a': destination is a {kind}, not a "
                            f"torch.Tensor; expected a tensor to load into")


LAZY = ("is an UninitializedParameter (a lazy module's, before its first forward); run "
        "the module once or initialize it first")


@pytest.mark.parametrize("as_module", [True, False], ids=["module", "mapping"])
def test_a_lazy_target_is_refused_naming_it(tmp_path, as_module):
    """A lazy module's parameter before its first forward (nn.LazyLinear) has no shape:
    load_into failed with torch's bare ValueError from numel(), naming no target and no
    rank; out= did the same."""
    save_file({"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.arange(3.0)},
              str(tmp_path / "model.safetensors"))
    lazy = torch.nn.LazyLinear(3)
    target = lazy if as_module else {"bias": torch.zeros(3), "weight": lazy.weight}
    with pytest.raises(LoadError) as e:
        cl.load_into(target, str(tmp_path), Layout(), **ONE)
    assert str(e.value) == f"rank 0: target 'weight' {LAZY}"
    with pytest.raises(LoadError) as e:
        cl.load_detailed(str(tmp_path), Layout(), out={"weight": lazy.weight}, **ONE)
    assert str(e.value) == f"rank 0, tensor 'weight': destination {LAZY}"
    lazy(torch.zeros(1, 4))   # once materialized, it loads
    res = cl.load_into(lazy, str(tmp_path), Layout(), **ONE)
    assert sorted(res.loaded) == ["bias", "weight"]
    assert torch.equal(lazy.weight, torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested", "negative-bit"])
@pytest.mark.parametrize("api", ["out", "load_into"])
def test_a_sparse_or_nested_out_destination_is_refused_naming_it(ab, kind, api):
    """out= took them as load_into once did: a COO destination refused as sharing
    memory, a CSR or nested one failing in torch, untyped; a contiguous tensor with
    torch's negative bit (x.conj().imag, _neg_view) failed in the cpu engine's byte view,
    untyped, through both."""
    with warnings.catch_warnings():   # torch's beta/prototype notices for these layouts
        warnings.simplefilter("ignore")
        b = {"sparse_coo": lambda: torch.zeros(4).to_sparse(),
             "sparse_csr": lambda: torch.zeros(1, 4).to_sparse_csr(),
             "nested": lambda: torch.nested.nested_tensor([torch.zeros(2)]),
             "negative-bit": lambda: torch._neg_view(torch.zeros(4))}[kind]()
    a = torch.full((4,), -1.0)
    with pytest.raises(LoadError) as e:
        if api == "out":
            cl.load_detailed(ab, Layout(), out={"a": a, "b": b}, **ONE)
        else:
            cl.load_into({"a": a, "b": b}, ab, Layout(), engine="cpu", **ONE)
    what = "destination" if api == "out" else "target 'b'"
    assert str(e.value) == (f"rank 0, tensor 'b': {what} is a {kind} tensor; expected a "
                            f"dense (strided) tensor (load into a dense one, then convert it)")
    assert a.tolist() == [-1.0] * 4   # refused before any read


def test_entries_no_tensor_fills_may_be_anything(ab):
    """TransformerEngine and Megatron put ``_extra_state`` entries (None, BytesIO) in
    state_dict(); a first check of every entry refused such a mapping."""
    import io
    target = {"a": torch.zeros(4), "b": torch.zeros(4), "layer._extra_state": None,
              "other._extra_state": io.BytesIO()}
    rep = cl.load_into(target, ab, Layout(), strict=False, **ONE)
    assert target["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert target["b"].tolist() == [100.0, 101.0, 102.0, 103.0]
    assert sorted(rep.not_loaded) == ["layer._extra_state", "other._extra_state"]


@pytest.mark.parametrize("held", [None, "bytes"])
def test_an_entry_holding_no_tensor_that_a_checkpoint_tensor_maps_to(ab, held):
    """The checkpoint carries 'b' (as TransformerEngine saves _extra_state, a uint8
    tensor) and the target's entry holds None or a BytesIO: strict=False skipped None but
    refused a BytesIO; strict named None 'no target entry'. Both are skipped without
    strict, and strict names what the entry holds."""
    import io
    value = None if held is None else io.BytesIO()
    target = {"a": torch.zeros(4), "b": value}
    rep = cl.load_into(target, ab, Layout(), strict=False, **ONE)
    assert target["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and target["b"] is value
    assert rep.skipped == ["b"]
    with pytest.raises(LoadError) as e:
        cl.load_into(target, ab, Layout(), **ONE)
    kind = type(value).__name__
    assert str(e.value) == (f"rank 0, tensor 'b': target 'b' is a {kind}, not a torch.Tensor; "
                            f"expected a tensor to load into")


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
@pytest.mark.parametrize("api", ["out", "load_into"])
@pytest.mark.parametrize("how", ["freed", "shrunk", "freed-view"])
def test_a_destination_whose_memory_was_freed_or_shrunk_is_refused(ab, engine, api, how):
    """FSDP frees a resharded parameter's memory with ``untyped_storage().resize_(0)``,
    keeping its shape: every check passed, the cpu engine read into a private buffer
    (data pointer 0) and reported the target loaded, a shrunk one was written past its
    end (heap corruption), and the safetensors engine and a view's copy crashed the
    process. Refused before any read, naming it."""
    a = torch.full((4,), -1.0)
    if how == "freed-view":   # every other element of a [4, 2]: filled through a copy
        base = torch.zeros(4, 2)
        b = base[:, 0]
        base.untyped_storage().resize_(0)
        have, need = 0, 28
    else:
        b = torch.zeros(4)
        have, need = (8, 16) if how == "shrunk" else (0, 16)
        b.untyped_storage().resize_(have)
    with pytest.raises(LoadError) as e:
        if api == "out":
            cl.load_detailed(ab, Layout(), out={"a": a, "b": b}, engine=engine, **ONE)
        else:
            cl.load_into({"a": a, "b": b}, ab, Layout(), engine=engine, **ONE)
    what = "destination" if api == "out" else "target"
    assert str(e.value) == (f"rank 0, tensor 'b': {what} 'b' holds {have} bytes of memory, "
                            f"but its shape [4] (torch.float32) at storage offset 0 needs "
                            f"{need} (its storage was freed or resized, as FSDP frees a "
                            f"resharded parameter's); expected memory that holds the tensor")
    assert a.tolist() == [-1.0] * 4   # refused before any read: nothing written


def test_a_modules_buffers_load_as_its_state_dict_holds_them(tmp_path):
    """Every buffer was a target: a non-persistent one (computed by the module, a rotary
    table; from_pretrained never loads one) was overwritten by a checkpoint tensor of its
    name, and a persistent one (DeepSeek-V3's router e_score_correction_bias) missing
    from the checkpoint kept its stale value under strict, listed in not_loaded only."""
    save_file({"w": torch.arange(4.0), "bias": torch.full((2,), 7.0),
               "table": torch.full((3,), 9.0)}, str(tmp_path / "model.safetensors"))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))
            self.register_buffer("bias", torch.full((2,), 123.0))
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    m = M()
    got = cl.load_into(m, str(tmp_path), Layout(), **ONE)
    assert sorted(got.loaded) == ["bias", "w"] and got.skipped == ["table"]
    assert got.not_loaded == []
    assert m.table.tolist() == [0.0, 1.0, 2.0] and m.bias.tolist() == [7.0, 7.0]
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    m = M()
    with pytest.raises(LoadError) as e:
        cl.load_into(m, str(tmp_path), Layout(), **ONE)
    assert str(e.value).startswith("rank 0: no checkpoint tensor of this rank fills the "
                                   "target 'bias': the checkpoint lacks it")
    got = cl.load_into(m, str(tmp_path), Layout(), strict=False, **ONE)
    assert got.loaded == ["w"] and got.not_loaded == ["bias"]


def test_buffers_as_torch_and_the_caller_name_them(tmp_path):
    """A name_map naming a computed buffer fills it (the caller's mapping, not a
    checkpoint name that happens to match); a shared submodule's computed buffer is
    skipped under every name it has; a norm's num_batches_tracked may be missing under
    strict, as torch's own load_state_dict(strict=True) lets it be."""
    save_file({"rope": torch.full((3,), 9.0), "b.table": torch.full((3,), 5.0),
               "n.weight": torch.full((2,), 2.0), "n.bias": torch.zeros(2),
               "n.running_mean": torch.ones(2), "n.running_var": torch.ones(2)},
              str(tmp_path / "model.safetensors"))

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    m = torch.nn.Module()
    m.a = m.b = Rope()   # one submodule under two names
    m.n = torch.nn.BatchNorm1d(2)
    got = cl.load_into(m, str(tmp_path), Layout(), name_map={"rope": "a.table"}, **ONE)
    assert m.a.table.tolist() == [9.0, 9.0, 9.0] and "a.table" in got.loaded
    assert got.skipped == ["b.table"] and got.not_loaded == ["n.num_batches_tracked"]
    assert m.n.weight.tolist() == [2.0, 2.0]
    torch.nn.BatchNorm1d(2).load_state_dict(   # torch's own strict load agrees
        {k: v for k, v in m.n.state_dict().items() if k != "num_batches_tracked"}, strict=True)


@pytest.mark.parametrize("out", [["a"], "a", 5])
def test_out_that_is_no_mapping_is_a_load_error(ab, out):
    """out= a list, a str or an int raised a bare TypeError from the engine."""
    with pytest.raises(LoadError) as e:
        cl.load_detailed(ab, Layout(), out=out, **ONE)
    assert str(e.value) == (f"rank 0: out= must be a mapping of checkpoint name to tensor, "
                            f"got {type(out).__name__}")


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_out_as_a_parameter_dict_is_filled(ab, engine):
    """nn.ParameterDict is a mapping in all but its type: refused once out= had to be one."""
    pd = torch.nn.ParameterDict({"b": torch.nn.Parameter(torch.zeros(4))})
    cl.load_detailed(ab, Layout(), engine=engine, out=pd, **ONE)
    assert pd["b"].tolist() == [100.0, 101.0, 102.0, 103.0]


def test_a_module_tying_a_tensor_the_checkpoint_ships_twice_is_named(ab):
    """A module whose second parameter is its first (a tied lm_head), and a checkpoint
    holding both with other values: "no target entry 'b'" advised strict=False, which
    left the second holding the first's values, where from_pretrained loads the
    checkpoint's own."""
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(4))
    m.b = m.a   # tied: named_parameters() lists it once, as 'a'
    with pytest.raises(LoadError) as ei:
        cl.load_into(m, ab, Layout(), **ONE)
    assert str(ei.value) == (
        "rank 0, tensor 'b': target 'b' is tied to 'a' (one tensor, tie_word_embeddings), and "
        "the checkpoint ships 'b' beside 'a': a second copy of the tied tensor (pass "
        "name_map={'b': None} to load the one tensor from 'a'), or a tensor of its own (build "
        "the module untied to load both); strict=False leaves 'b' holding 'a''s values")
    assert torch.equal(m.a.detach(), torch.zeros(4))   # refused before any read
    # the advice, taken (T5's encoder and decoder embed_tokens: copies of shared.weight)
    cl.load_into(m, ab, Layout(), name_map={"b": None}, **ONE)
    assert m.a.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_tied_tensor_shipped_under_its_alias_alone_fills_it(tmp_path):
    """A tied model's checkpoint holding the head but no embedding: from_pretrained fills
    the one tensor from the head; load_into refused it, advising to build the module
    untied, which then lacked the embedding."""
    save_file({"b": torch.arange(4.0) + 100}, str(tmp_path / "model.safetensors"))
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(4))
    m.b = m.a
    got = cl.load_into(m, str(tmp_path), Layout(), **ONE)
    assert m.a.tolist() == [100.0, 101.0, 102.0, 103.0] and got.loaded == ["a"]


def test_a_tied_pair_both_shipped_is_refused_on_every_pipeline_stage(tmp_path):
    """Review of the alias rule: at pp=2 the last stage's plan holds the head but not the
    embedding, so the head filled the one tied tensor there (the checkpoint's embedding
    on stage 0, its head on stage 1) where pp=1 refuses. "Ships the alias alone" is read
    from the whole checkpoint. And two aliases shipped without the primary (T5's
    encoder and decoder embed_tokens, no shared.weight) are named, not both redirected."""
    import json
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4),
               "model.layers.0.w": torch.ones(4), "model.layers.1.w": torch.ones(4),
               "lm_head.weight": torch.full((8, 4), 7.0)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2,
                                                      "tie_word_embeddings": True}))

    def module(layer):
        m = torch.nn.Module()
        m.model = torch.nn.Module()
        m.model.embed_tokens = torch.nn.Embedding(8, 4)
        m.model.layers = torch.nn.ParameterDict({str(layer): torch.nn.Parameter(torch.zeros(4))})
        m.lm_head = torch.nn.Linear(4, 8, bias=False)
        m.lm_head.weight = m.model.embed_tokens.weight
        return m
    for rank in (0, 1):
        m = module(rank)
        if rank == 0:   # its stage holds the embedding alone: loaded from it
            cl.load_into(m, str(tmp_path), Layout(pp=2), rank=0, replicate_unmatched=True,
                         name_map=lambda n: n.replace("layers.0.w", "layers.0"))
            assert m.model.embed_tokens.weight.eq(0).all()
            continue
        with pytest.raises(LoadError, match="ships 'lm_head.weight' beside "
                                            "'model.embed_tokens.weight'"):
            cl.load_into(m, str(tmp_path), Layout(pp=2), rank=1, replicate_unmatched=True,
                         name_map=lambda n: n.replace("layers.1.w", "layers.1"))
    t5 = tmp_path / "t5"
    t5.mkdir()
    save_file({"enc": torch.ones(4), "dec": torch.ones(4)}, str(t5 / "model.safetensors"))
    m = torch.nn.Module()
    m.shared = torch.nn.Parameter(torch.zeros(4))
    m.enc = m.dec = m.shared
    with pytest.raises(LoadError) as e:
        cl.load_into(m, str(t5), Layout(), **ONE)
    assert "which the checkpoint ships under several names ('dec', 'enc'), none of them " \
           "'shared': map all but one of them to None" in str(e.value)
    cl.load_into(m, str(t5), Layout(), name_map={"dec": None}, **ONE)
    assert m.shared.tolist() == [1.0] * 4


def test_an_identity_name_map_entry_fills_a_computed_buffer(tmp_path):
    """docs/api.md: a checkpoint tensor named as a computed (non-persistent) buffer is
    skipped, "a name_map entry naming one fills it"; an entry mapping it to its own name
    was still skipped."""
    save_file({"inv": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    m = torch.nn.Module()
    m.register_buffer("inv", torch.zeros(4), persistent=False)
    got = cl.load_into(m, str(tmp_path), Layout(), strict=False, **ONE)
    assert m.inv.tolist() == [0.0] * 4 and got.skipped == ["inv"]
    cl.load_into(m, str(tmp_path), Layout(), name_map={"inv": "inv"}, **ONE)
    assert m.inv.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_name_map_that_raises_is_named_with_the_tensor(ab):
    """A name_map callable raising came out as the bare KeyError."""
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(LoadError) as ei:
        cl.load_into(m, ab, Layout(), name_map=lambda n: {}[n], **ONE)
    assert str(ei.value) == ("rank 0, tensor 'a': name_map raised KeyError: 'a' for this "
                             "checkpoint tensor")


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_an_engine_that_fills_tensors_of_its_own_for_out_is_refused(ab, monkeypatch, engine):
    """verify checks the tensors an engine returns: one that loaded into fresh tensors of
    its own, leaving the out= destinations as they were, passed verify="full" (a fault
    injected where the engines learn they fill the destinations themselves)."""
    import coordloader.engines.cpu as cpu_engine
    import coordloader.engines.safetensors_engine as st_engine
    from coordloader.engines import host_out

    def dropped(out, rank_plan, device, *, rank=None):
        host_out(out, rank_plan, device, rank=rank)
        return None
    monkeypatch.setattr(cpu_engine if engine == "cpu" else st_engine, "host_out", dropped)
    out = {"a": torch.full((4,), 7.0), "b": torch.full((4,), 7.0)}
    with pytest.raises(LoadError) as e:
        cl.load_detailed(ab, Layout(), out=out, engine=engine, verify="full", **ONE)
    assert str(e.value) == (f"rank 0, tensor 'a': the {engine} engine did not load into the "
                            f"out= destination (it returned a tensor of its own), which keeps "
                            f"what it held")
    monkeypatch.undo()
    got = cl.load_detailed(ab, Layout(), out=out, engine=engine, verify="full", **ONE)
    assert got.tensors["a"].data_ptr() == out["a"].data_ptr()
    assert out["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
