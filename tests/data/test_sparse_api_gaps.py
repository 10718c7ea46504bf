"""torchrec 1.8 names added to the sparse types: ``size_in_bytes``, ``copy_``, ``empty_like(device)``,
``clear_storage``, ``regroup_kts`` / ``permute_multi_embedding``, ``ComputeKJTToJTDict`` / ``ComputeJTDictToKJT`` and
``flatten_kjt_list`` / ``unflatten_kjt_list``, each against a reference written out here, plus bad input by name."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    UnknownKeyError,
    flatten_kjt_list,
    jt_is_equal,
    kjt_is_equal,
    permute_multi_embedding,
    regroup_kts,
    unflatten_kjt_list,
)

LENGTHS = torch.tensor([2, 0, 1, 1, 1, 3], dtype=torch.int32)
VALUES = torch.arange(8)
WEIGHTS = torch.linspace(0.1, 0.8, 8)


def _kjt(vbe: bool = False, weighted: bool = True, **kwargs: object) -> KeyedJaggedTensor:
    strides = dict(stride_per_key_per_rank=[[1, 2], [2, 1]]) if vbe else dict(stride=3)
    return KeyedJaggedTensor(["x", "y"], VALUES.clone(), WEIGHTS.clone() if weighted else None,
                             lengths=LENGTHS.clone(), **strides, **kwargs)  # fmt: skip


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# --------------------------------------------------------------------------------------------------- storage
@pytest.mark.parametrize("vbe", [False, True])
def test_kjt_size_in_bytes_copy_and_clear_storage(vbe: bool) -> None:
    kjt = _kjt(vbe)
    strides = 4 * 4 if vbe else 0  # torchrec stores the [T, W] = [2, 2] stride table as int32
    assert kjt.size_in_bytes() == _nbytes(VALUES, WEIGHTS, LENGTHS) + strides
    kjt.offsets()  # a derived tensor counts once it is cached
    assert kjt.size_in_bytes() == _nbytes(VALUES, WEIGHTS, LENGTHS, kjt.offsets()) + strides
    target = KeyedJaggedTensor.empty_like(kjt, "cpu")
    assert target.keys() == kjt.keys() and target.values().shape == kjt.values().shape
    assert target.size_in_bytes() == kjt.size_in_bytes()
    assert target.copy_(kjt) is target
    assert kjt_is_equal(target, kjt) and torch.equal(target.offsets(), kjt.offsets())
    assert target.stride_per_key_per_rank() == kjt.stride_per_key_per_rank()
    assert target.to_dict()["y"].values().data_ptr() == target.values()[3:].data_ptr()  # views of its own tensors
    assert target.clear_storage() == _nbytes(VALUES, WEIGHTS, LENGTHS, kjt.offsets())
    assert target.values().untyped_storage().nbytes() == 0 and target.weights().untyped_storage().nbytes() == 0
    assert kjt.values().untyped_storage().nbytes() > 0  # the source keeps its memory


def test_kjt_copy_bad_input() -> None:
    kjt = _kjt()
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        kjt.copy_(kjt.to_dict()["x"])
    other = KeyedJaggedTensor(["x", "z"], VALUES, WEIGHTS, lengths=LENGTHS)
    with pytest.raises(ValueError, match=r"keys \['x', 'z'\]"):
        kjt.copy_(other)
    with pytest.raises(ValueError, match="weights"):
        kjt.copy_(_kjt(weighted=False))
    longer = KeyedJaggedTensor(["x", "y"], torch.arange(9), torch.rand(9), lengths=torch.tensor([2, 0, 1, 1, 1, 4]))
    with pytest.raises(ValueError, match=r"values has shape \(9,\)"):
        kjt.copy_(longer)
    with pytest.raises(ValueError, match="device"):
        KeyedJaggedTensor.empty_like(kjt, "no-such-device")


def test_kjt_empty_like_without_device_keeps_old_behaviour() -> None:
    empty = KeyedJaggedTensor.empty_like(_kjt())
    assert empty.keys() == [] and empty.stride() == 3 and empty.weights().dtype == WEIGHTS.dtype


def test_jagged_tensor_size_empty_like_copy() -> None:
    jt = JaggedTensor(VALUES.float(), WEIGHTS, lengths=LENGTHS)
    assert jt.size_in_bytes() == _nbytes(VALUES.float(), WEIGHTS, LENGTHS)
    empty = JaggedTensor.empty_like(jt)
    assert empty.values().numel() == 0 and empty.weights().dtype == WEIGHTS.dtype
    assert empty.lengths().dtype == torch.int32 and empty.values().dtype == torch.float32
    target = JaggedTensor.empty_like(jt, torch.device("cpu"))
    assert target.values().shape == (8,) and target.offsets_or_none() is None  # jt holds no offsets yet
    assert target.copy_(jt) is target and jt_is_equal(target, jt)
    with pytest.raises(ValueError, match=r"lengths has shape \(2,\)"):
        target.copy_(JaggedTensor(torch.arange(8.0), WEIGHTS, lengths=torch.tensor([4, 4])))
    with pytest.raises(ValueError, match="weights"):
        target.copy_(JaggedTensor(torch.arange(8.0), lengths=LENGTHS))
    with pytest.raises(TypeError, match="JaggedTensor"):
        target.copy_(VALUES)
    with pytest.raises(TypeError, match="jt must be a JaggedTensor"):
        JaggedTensor.empty_like(VALUES)


# --------------------------------------------------------------------------------------------- KeyedTensor
SPECS = [(["a", "b"], [2, 3]), (["c"], [1]), (["d", "e"], [4, 2])]


def _kts(requires_grad: bool = False) -> list[KeyedTensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, sum(w), generator=gen).requires_grad_(requires_grad) for _, w in SPECS]
    return [KeyedTensor(keys, widths, t) for (keys, widths), t in zip(SPECS, tensors, strict=True)]


def _reference(kts: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
    """Plain loops: every key's block from to_dict, concatenated per group."""
    blocks = {}
    for kt in kts:
        blocks.update(kt.to_dict())
    return [torch.cat([blocks[key] for key in group], dim=1) if group else torch.zeros(4, 0) for group in groups]


def test_keyed_tensor_size_in_bytes() -> None:
    assert [kt.size_in_bytes() for kt in _kts()] == [4 * 5 * 4, 4 * 1 * 4, 4 * 6 * 4]


@pytest.mark.parametrize("regroup", [regroup_kts, permute_multi_embedding])
@pytest.mark.parametrize(
    "groups", [[["a", "c"], ["e", "b", "d"]], [["a", "b", "c", "d", "e"]], [["d", "a"], ["a", "c"], [], ["e", "d"]]]
)
def test_regroup_matches_reference(regroup: object, groups: list[list[str]]) -> None:
    kts, ref_kts = _kts(requires_grad=True), _kts(requires_grad=True)
    out, expected = regroup(kts, groups), _reference(ref_kts, groups)
    assert len(out) == len(expected)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    cotangents = [torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for t in expected]
    torch.autograd.backward([t for t in out if t.numel()], [c for c in cotangents if c.numel()])
    torch.autograd.backward([t for t in expected if t.numel()], [c for c in cotangents if c.numel()])
    for a, b in zip(kts, ref_kts, strict=True):  # repeated keys add up their gradients
        torch.testing.assert_close(a.values().grad, b.values().grad)


@pytest.mark.parametrize(
    ("kts", "groups", "error", "named"),
    [
        (lambda: _kts(), [["a", "zz"]], UnknownKeyError, "'zz'"),
        (lambda: _kts(), "ab", TypeError, "groups"),
        (lambda: [], [["a"]], ValueError, "keyed_tensors"),
        (lambda: [_kts()[0], "kt"], [["a"]], TypeError, r"keyed_tensors\[1\]"),
        (lambda: [_kts()[0], _kts()[0]], [["a"]], ValueError, r"'a' is held by keyed_tensors\[0\] and keyed_tensors"),
        (lambda: [_kts()[0], KeyedTensor(["z"], [1], torch.ones(3, 1))], [["a"]], ValueError, r"keyed_tensors\[1\]"),
        (lambda: [_kts()[0], KeyedTensor(["z"], [1], torch.ones(4, 1, dtype=torch.float64))], [["z"]], ValueError,
         "float64"),
    ],
)  # fmt: skip
def test_regroup_bad_input(kts: object, groups: object, error: type[Exception], named: str) -> None:
    for regroup in (regroup_kts, permute_multi_embedding):
        with pytest.raises(error, match=named):
            regroup(kts(), groups)


# ------------------------------------------------------------------------------------ modules, flat list form
@pytest.mark.parametrize("vbe", [False, True])
def test_kjt_jt_dict_modules(vbe: bool) -> None:
    kjt = _kjt(vbe)
    jt_dict = ComputeKJTToJTDict()(kjt)
    assert list(jt_dict) == ["x", "y"]
    start = 0
    for t, key in enumerate(["x", "y"]):  # reference: walk lengths per key
        bags = kjt.stride_per_key()[t]
        lengths = LENGTHS[start : start + bags].tolist()
        first = int(LENGTHS[:start].sum())
        assert jt_dict[key].lengths().tolist() == lengths
        assert torch.equal(jt_dict[key].values(), VALUES[first : first + sum(lengths)])
        assert torch.equal(jt_dict[key].weights(), WEIGHTS[first : first + sum(lengths)])
        start += bags
    back = ComputeJTDictToKJT()(jt_dict)
    assert kjt_is_equal(back, kjt) and back.variable_stride_per_key() == (kjt.stride_per_key() != [3, 3])
    with pytest.raises(TypeError, match="keyed_jagged_tensor"):
        ComputeKJTToJTDict()(jt_dict)
    with pytest.raises(TypeError, match="jt_dict"):
        ComputeJTDictToKJT()(kjt)


def test_kjt_jt_dict_modules_trace_to_one_node() -> None:
    for module in (ComputeKJTToJTDict(), ComputeJTDictToKJT()):
        graph = torch.fx.symbolic_trace(module).graph
        assert [n.op for n in graph.nodes] == ["placeholder", "call_function", "output"]
    traced = torch.fx.symbolic_trace(ComputeKJTToJTDict())
    assert jt_is_equal(traced(_kjt())["y"], _kjt()["y"])


def test_flatten_unflatten_kjt_list() -> None:
    inverse = (["x", "y"], torch.tensor([[0, 1, 0], [1, 0, 1]]))
    kjts = [_kjt(), _kjt(vbe=True, weighted=False, inverse_indices=inverse), KeyedJaggedTensor.empty()]
    kjts[0].offsets()
    flat, contexts = flatten_kjt_list(kjts)
    assert contexts == [["x", "y"], ["x", "y"], []] and len(flat) == 18
    values, weights, lengths, offsets, strides, inv = flat[:6]  # torchrec's field order
    assert values is kjts[0].values() and weights is kjts[0].weights() and lengths is kjts[0].lengths()
    assert offsets is kjts[0].offsets() and strides is None and inv is None
    assert flat[7] is None and flat[9] is None  # no weights, no offsets computed
    assert flat[10].dtype == torch.int32 and flat[10].tolist() == [[1, 2], [2, 1]] and flat[11] is inverse[1]
    back = unflatten_kjt_list(flat, contexts)
    for a, b in zip(back, kjts, strict=True):
        assert kjt_is_equal(a, b) and a.stride_per_key_per_rank() == b.stride_per_key_per_rank()
    assert back[1].inverse_indices()[0] == ["x", "y"] and back[1].inverse_indices()[1] is inverse[1]


def test_flatten_unflatten_bad_input() -> None:
    flat, contexts = flatten_kjt_list([_kjt()])
    with pytest.raises(ValueError, match="6 entries per KeyedJaggedTensor"):
        unflatten_kjt_list(flat[:5], contexts)
    with pytest.raises(TypeError, match="contexts"):
        unflatten_kjt_list(flat, ["x", "y"])
    with pytest.raises(ValueError, match=r"values\[0\]"):
        unflatten_kjt_list([None, *flat[1:]], contexts)
    with pytest.raises(TypeError, match=r"kjt_arr\[1\]"):
        flatten_kjt_list([_kjt(), "kjt"])
    with pytest.raises(TypeError, match="kjt_arr"):
        flatten_kjt_list(_kjt())
    kjt = _kjt(vbe=True, inverse_indices=(["y"], torch.tensor([[0, 1, 0]])))
    with pytest.raises(ValueError, match=r"kjt_arr\[0\] has inverse_indices keyed \['y'\]"):
        flatten_kjt_list([kjt])
