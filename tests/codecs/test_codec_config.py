"""QCommsConfig (torchrec's fields and defaults plus ours) and the codec factories."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritonrec.dist.error_feedback import ErrorFeedbackCodec
from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec
from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs, get_qcomm_codecs_registry
from tritonrec.dist.qcomm_protocol import CommOp, NoOpQuantizedCommCodec, RoundingMode

TORCHREC_DEFAULTS = {
    "forward_precision": CommType.FP32,
    "backward_precision": CommType.FP32,
    "forward_loss_scale": None,
    "backward_loss_scale": None,
    "fp8_quantize_dim": None,
    "fp8_quantize_dim_bwd": None,
    "fp8_bwd_uses_143": False,
    "mx4_quantize_dim": None,
    "mx4_quantize_dim_bwd": None,
    "mx4_rounding_mode": None,
}


def test_torchrec_fields_and_defaults():
    config = QCommsConfig()
    for name, default in TORCHREC_DEFAULTS.items():
        assert getattr(config, name) == default, name
    ours = {f.name for f in dataclasses.fields(QCommsConfig)} - set(TORCHREC_DEFAULTS)
    assert ours == {"output_dtype", "stochastic_rounding", "seed", "error_feedback", "nonfinite"}


def test_strings_from_yaml_and_backward_dims_default_to_forward():
    config = QCommsConfig(forward_precision="fp8", backward_precision="MX4", fp8_quantize_dim=16, mx4_quantize_dim=64)
    assert config.forward_precision == CommType.FP8 and config.backward_precision == CommType.MX4
    assert config.mx4_quantize_dim_bwd == 64
    both_fp8 = QCommsConfig(forward_precision=CommType.FP8, backward_precision=CommType.FP8, fp8_quantize_dim=16)
    assert both_fp8.fp8_quantize_dim_bwd == 16


def test_get_qcomm_codecs_builds_each_direction():
    codecs = get_qcomm_codecs(
        QCommsConfig(forward_precision=CommType.FP8, backward_precision=CommType.FP8, fp8_quantize_dim=16)
    )
    assert isinstance(codecs.forward, TritonQuantizedCommCodec) and codecs.forward.row_dim == 16
    x = torch.linspace(0.01, 1.0, 16)
    fwd = codecs.forward.decode(codecs.forward.encode(x))
    bwd = codecs.backward.decode(codecs.backward.encode(x))
    assert (fwd - x).abs().max() < (bwd - x).abs().max()  # E4M3 forward, E5M2 backward
    e4m3_bwd = get_qcomm_codecs(
        QCommsConfig(forward_precision=CommType.FP8, backward_precision=CommType.FP8, fp8_bwd_uses_143=True)
    )
    assert torch.equal(e4m3_bwd.backward.encode(x.repeat(2)), e4m3_bwd.forward.encode(x.repeat(2)))
    assert isinstance(get_qcomm_codecs(QCommsConfig()).forward, NoOpQuantizedCommCodec)
    assert isinstance(get_qcomm_codecs(None).backward, NoOpQuantizedCommCodec)
    wrapped = get_qcomm_codecs(QCommsConfig(forward_precision=CommType.INT8, error_feedback=True))
    assert isinstance(wrapped.forward, ErrorFeedbackCodec) and isinstance(wrapped.backward, NoOpQuantizedCommCodec)
    mx4 = get_qcomm_codecs(QCommsConfig(backward_precision=CommType.MX4, mx4_rounding_mode=RoundingMode.stochastic))
    assert mx4.backward.stochastic_rounding


def test_seeds_differ_by_rank_op_and_direction():
    config = QCommsConfig(forward_precision=CommType.INT8, backward_precision=CommType.INT8, stochastic_rounding=True)
    x = torch.randn(64)

    def wire(codecs, forward=True):
        return (codecs.forward if forward else codecs.backward).encode(x)

    base = get_qcomm_codecs(config, rank=0)
    assert torch.equal(wire(base), wire(get_qcomm_codecs(config, rank=0)))
    assert not torch.equal(wire(get_qcomm_codecs(config, rank=0)), wire(get_qcomm_codecs(config, rank=1)))
    assert not torch.equal(wire(get_qcomm_codecs(config, rank=0)), wire(get_qcomm_codecs(config, rank=0), False))
    other_op = get_qcomm_codecs(config, rank=0, comm_op=CommOp.ALL_GATHER)
    assert not torch.equal(wire(get_qcomm_codecs(config, rank=0)), wire(other_op))


def test_registry():
    assert get_qcomm_codecs_registry(QCommsConfig()) is None
    config = QCommsConfig(forward_precision=CommType.MX4, backward_precision=CommType.INT8)
    registry = get_qcomm_codecs_registry(config, device=torch.device("cpu"))
    assert set(registry) == {
        "POOLED_EMBEDDINGS_ALL_TO_ALL",
        "POOLED_EMBEDDINGS_REDUCE_SCATTER",
        "SEQUENCE_EMBEDDINGS_ALL_TO_ALL",
    }
    for codecs in registry.values():  # reduce-scatter included: it sums after decoding, so any format works
        assert codecs.forward.comm_precision == CommType.MX4 and codecs.backward.comm_precision == CommType.INT8
    gather = get_qcomm_codecs_registry(config, comm_ops=[CommOp.ALL_GATHER])
    assert set(gather) == {"ALL_GATHER"} and gather["ALL_GATHER"].backward.comm_precision == CommType.INT8
    a2a = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward
    assert a2a is not registry["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"].forward  # each op its own codec (and residuals)


def test_bad_configs_raise_naming_the_field():
    with pytest.raises(ValueError, match="forward_precision"):
        QCommsConfig(forward_precision="fp4")
    with pytest.raises(ValueError, match="forward_loss_scale applies to FP16/BF16 only"):
        QCommsConfig(forward_precision=CommType.INT8, forward_loss_scale=2.0)
    with pytest.raises(ValueError, match="loss_scale"):
        QCommsConfig(backward_precision=CommType.BF16, backward_loss_scale=0.0)
    with pytest.raises(ValueError, match="fp8_quantize_dim"):
        QCommsConfig(forward_precision=CommType.FP8, fp8_quantize_dim=0)
    with pytest.raises(ValueError, match="mx4_quantize_dim must be an even int"):
        QCommsConfig(forward_precision=CommType.MX4, mx4_quantize_dim=33)
    with pytest.raises(ValueError, match="mx4_rounding_mode"):
        QCommsConfig(forward_precision=CommType.MX4, mx4_rounding_mode=RoundingMode.ceil)
    with pytest.raises(ValueError, match="output_dtype"):
        QCommsConfig(output_dtype=CommType.MX4)
    with pytest.raises(TypeError, match="stochastic_rounding"):
        QCommsConfig(stochastic_rounding=1)
    with pytest.raises(ValueError, match="seed"):
        QCommsConfig(seed=-3)
    with pytest.raises(ValueError, match="nonfinite"):
        QCommsConfig(nonfinite="zero")
    with pytest.raises(TypeError, match="qcomms_config"):
        get_qcomm_codecs({"forward_precision": "fp16"})
    with pytest.raises(TypeError, match="comm_ops"):
        get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16), comm_ops=["all_gather"])
    with pytest.raises(TypeError, match="device"):
        get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16), device="cpu")
    with pytest.raises(ValueError, match="rank"):
        get_qcomm_codecs(QCommsConfig(), rank=-1)
