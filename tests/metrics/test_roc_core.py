"""The ROC core shared by metrics' AUC and the training job's auroc: its area against the pairwise definition, the
dtype it accumulates in, and the two callers' conventions (0.5 float32 vs NaN float64) on top of the same curve."""

from __future__ import annotations

import math

import pytest
import torch

from tests.metrics.reference import auc as pairwise_auc
from tritonrec.dist.train.metrics import auroc
from tritonrec.metrics.auc import compute_auc, roc_area


def _tie_heavy(seed: int, n: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (n,), generator=gen).double() / levels
    labels = torch.randint(0, 2, (n,), generator=gen).double()
    weights = torch.rand(n, generator=gen, dtype=torch.float64) * (torch.rand(n, generator=gen) > 0.2)
    return scores, labels, weights


@pytest.mark.parametrize(("seed", "n", "levels"), [(0, 1, 2), (1, 7, 3), (2, 40, 5), (3, 129, 1000)])
def test_area_over_class_weights_is_the_pairwise_auc(seed: int, n: int, levels: int) -> None:
    scores, labels, weights = _tie_heavy(seed, n, levels)
    area, positive, negative = roc_area(scores[None], labels[None], weights[None])
    assert area.dtype == positive.dtype == negative.dtype == torch.float64  # accumulates in the inputs' dtype
    assert float(positive) == pytest.approx(float((labels * weights).sum()), abs=1e-12)
    assert float(negative) == pytest.approx(float(((1 - labels) * weights).sum()), abs=1e-12)
    if float(positive) * float(negative) > 0:
        assert float(area) / (float(positive) * float(negative)) == pytest.approx(
            pairwise_auc(scores, labels, weights), abs=1e-12
        )


def test_no_samples_give_zero_area_and_weights() -> None:
    area, positive, negative = roc_area(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0))
    assert area.shape == positive.shape == negative.shape == (3,)
    assert not area.any() and not positive.any() and not negative.any()


@pytest.mark.parametrize("seed", range(4))
def test_both_callers_agree_where_auc_is_defined(seed: int) -> None:
    scores, labels, weights = _tie_heavy(seed, 50, 6)
    metric_auc = compute_auc(scores.float()[None], labels.float()[None], weights.float()[None])
    assert metric_auc.dtype == torch.float32
    assert float(metric_auc) == pytest.approx(auroc(scores, labels, weights), abs=1e-6)


def test_one_class_input_keeps_each_callers_convention() -> None:
    scores, labels = torch.rand(5), torch.ones(5)
    assert float(compute_auc(scores[None], labels[None], torch.ones(1, 5))) == 0.5  # torchrec's
    assert math.isnan(auroc(scores, labels))  # the job's: undefined
