"""``KeyedJaggedTensor.dist_labels / dist_splits / dist_tensors / dist_init``: torchrec's KJT all-to-all protocol.

Each case simulates the all-to-all in one process (every destination receives, per label, the chunks the sources cut
with ``dist_splits``, concatenated in source order) and compares what ``dist_init`` rebuilds with a plain-loop
reference: per key of the destination, the bags of that key from every source, in (staggered) source order.
"""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import KeyedJaggedTensor

KEYS = ["a", "b", "c", "d", "e"]


def _source_order(num_workers: int, stagger: int) -> list[int]:
    """torchrec's recat source order, written out: rank ``x + (W / stagger) * y`` for x outer, y inner."""
    group = num_workers // stagger
    order = []
    for x in range(group):
        for y in range(stagger):
            order.append(x + group * y)
    return order


def _recat(local_keys: int, num_workers: int, stagger: int, batch_per_source: list[int] | None) -> torch.Tensor:
    """torchrec's ``_get_recat``, written as loops: output segment (key t, source s) takes input segment
    ``s * local_keys + t``; with unequal batches per source, expanded to single bags."""
    segments = [t + s * local_keys for t in range(local_keys) for s in _source_order(num_workers, stagger)]
    if batch_per_source is None or len(set(batch_per_source)) == 1:
        return torch.tensor(segments, dtype=torch.int32)
    bags = [batch_per_source[s] for s in range(num_workers) for _ in range(local_keys)]
    starts = [sum(bags[:i]) for i in range(len(bags))]
    return torch.tensor([starts[seg] + b for seg in segments for b in range(bags[seg])], dtype=torch.int32)


def _source_kjt(gen: torch.Generator, bags: list[int], weighted: bool, vbe: bool) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (sum(bags),), generator=gen, dtype=torch.int32)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape[0], generator=gen) if weighted else None
    if vbe:
        return KeyedJaggedTensor(KEYS, values, weights, lengths=lengths, stride_per_key_per_rank=[[b] for b in bags])
    return KeyedJaggedTensor(KEYS, values, weights, lengths=lengths, stride=bags[0])


def _bags(kjt: KeyedJaggedTensor, key: str) -> list[tuple[list[int], list[float] | None]]:
    jt = kjt[key]
    weights = jt.to_dense_weights()
    return [(v.tolist(), None if weights is None else weights[i].tolist()) for i, v in enumerate(jt.to_dense())]


CASES = {
    "fixed, equal batch, weighted": dict(num_workers=3, key_splits=[2, 1, 2], batch=[3, 3, 3], weighted=True),
    "fixed, equal batch, stagger 2": dict(num_workers=4, key_splits=[1, 2, 0, 2], batch=[2] * 4, stagger=2),
    "fixed, batch per source": dict(num_workers=3, key_splits=[2, 2, 1], batch=[1, 4, 2], weighted=True),
    "fixed, one worker, no recat": dict(num_workers=1, key_splits=[5], batch=[3], weighted=True, recat=False),
    "vbe, weighted": dict(
        num_workers=3, key_splits=[2, 1, 2], weighted=True, vbe=True,
        batch=[[1, 2, 3, 0, 2], [2, 2, 1, 1, 3], [0, 1, 4, 2, 2]],
    ),
    "vbe, stagger 2": dict(
        num_workers=4, key_splits=[2, 1, 1, 1], vbe=True, stagger=2,
        batch=[[1, 2, 3, 0, 2], [2, 2, 1, 1, 3], [0, 1, 4, 2, 2], [3, 1, 1, 1, 1]],
    ),
    "vbe, one worker, no recat": dict(num_workers=1, key_splits=[5], vbe=True, batch=[[1, 0, 2, 3, 1]], recat=False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_dist_round_trip(case: str) -> None:
    spec = CASES[case]
    workers, key_splits, batch = spec["num_workers"], spec["key_splits"], spec["batch"]
    weighted, vbe, stagger = spec.get("weighted", False), spec.get("vbe", False), spec.get("stagger", 1)
    gen = torch.Generator().manual_seed(len(case))
    sources = [_source_kjt(gen, batch[s] if vbe else [batch[s]] * len(KEYS), weighted, vbe) for s in range(workers)]
    labels = ["lengths", "values", *(["strides"] if vbe else []), *(["weights"] if weighted else [])]
    assert all(src.dist_labels() == labels for src in sources)
    bounds = [sum(key_splits[:d]) for d in range(workers + 1)]

    def per_dest(numbers: list[int]) -> list[int]:
        return [sum(numbers[bounds[d] : bounds[d + 1]]) for d in range(workers)]

    for src in sources:  # splits: bags, values (, one stride per key) (, values) per destination
        expected = [per_dest(src.stride_per_key()), per_dest(src.length_per_key())]
        expected += [key_splits] if vbe else []
        expected += [per_dest(src.length_per_key())] if weighted else []
        assert src.dist_splits(key_splits) == expected
        tensors = src.dist_tensors()
        assert len(tensors) == len(labels) and torch.equal(tensors[0], src.lengths())
        if vbe:
            assert tensors[2].tolist() == src.stride_per_key() and tensors[2].dtype == torch.int64
    splits = [src.dist_splits(key_splits) for src in sources]
    sent = [src.dist_tensors() for src in sources]
    order = _source_order(workers, stagger)
    for dest in range(workers):
        local = KEYS[sum(key_splits[:dest]) : sum(key_splits[: dest + 1])]
        received = [
            torch.cat([sent[s][i].split(splits[s][i])[dest] for s in range(workers)]) for i in range(len(labels))
        ]
        per_source = None if vbe else list(batch)
        recat = _recat(len(local), workers, stagger, per_source) if spec.get("recat", True) and local else None
        out = KeyedJaggedTensor.dist_init(local, received, vbe, workers, recat, per_source, stagger)
        assert out.keys() == local
        assert (out.weights_or_none() is not None) == weighted
        for key in local:
            assert _bags(out, key) == [bag for s in order for bag in _bags(sources[s], key)], key
        if vbe:
            index = {k: i for i, k in enumerate(KEYS)}
            assert out.stride_per_key_per_rank() == [[batch[s][index[k]] for s in order] for k in local]
        else:
            assert not out.variable_stride_per_key() and out.stride() == sum(batch)


def _received(vbe: bool = False, weighted: bool = False) -> list[torch.Tensor]:
    kjt = _source_kjt(torch.Generator().manual_seed(0), [2, 1, 3, 1, 2] if vbe else [2] * 5, weighted, vbe)
    return kjt.dist_tensors()


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        (dict(keys="abcde"), TypeError, "keys"),
        (dict(tensors=_received()[:1]), ValueError, "tensors"),
        (dict(tensors=[*_received(weighted=True), torch.ones(1)]), ValueError, "tensors"),
        (dict(tensors=[_received()[0].float(), _received()[1]]), TypeError, "tensors[0] (lengths)"),
        (dict(variable_stride_per_key=1), TypeError, "variable_stride_per_key"),
        (dict(num_workers=0), ValueError, "num_workers"),
        (dict(num_workers=2, stride_per_rank=[1, 1], stagger=3), ValueError, "stagger"),
        (dict(stride_per_rank=None), ValueError, "stride_per_rank"),
        (dict(stride_per_rank=[2, 2]), ValueError, "stride_per_rank"),
        (dict(stride_per_rank=[3]), ValueError, "sum(stride_per_rank)"),
        (dict(recat=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "recat"),
        (dict(tensors=_received(vbe=True), variable_stride_per_key=True, num_workers=2), ValueError, "strides"),
    ],
)
def test_dist_init_bad_input(kwargs: dict, error: type[Exception], named: str) -> None:
    args = dict(
        keys=KEYS, tensors=_received(), variable_stride_per_key=False, num_workers=1, recat=None, stride_per_rank=[2]
    )
    args.update(kwargs)
    with pytest.raises(error, match=named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        KeyedJaggedTensor.dist_init(**args)


def test_dist_splits_bad_input() -> None:
    kjt = _source_kjt(torch.Generator().manual_seed(0), [2] * 5, False, False)
    with pytest.raises(ValueError, match="key_splits must sum to the number of keys"):
        kjt.dist_splits([2, 2])
    with pytest.raises(ValueError, match=r"key_splits\[1\]"):
        kjt.dist_splits([6, -1])
    with pytest.raises(TypeError, match="key_splits"):
        kjt.dist_splits(5)


def test_dist_tensors_drop_slack_tail() -> None:
    """Values past the last bag are not sent: the chunks must match dist_splits."""
    kjt = KeyedJaggedTensor(["x"], torch.arange(5), torch.rand(5), lengths=torch.tensor([1, 2]))
    _, values, weights = kjt.dist_tensors()
    assert values.tolist() == [0, 1, 2] and weights.shape == (3,) and kjt.dist_splits([1]) == [[2], [3], [3]]
