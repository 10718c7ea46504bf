"""Worker batches through shared-memory rings: a packed batch unpacks to the same tensors (every field, odd shapes,
empty bags), the ring travels with batches only until the main process has freed a slot, a full ring or an oversize
batch falls back to a buffer of its own, a new iteration reclaims every slot, a batch the main process drops unread
frees its slot (a resumed loader's replayed batches), and loaders with workers give the same batches as without,
epoch after epoch, also when an epoch is left early."""

from __future__ import annotations

import itertools

import pytest
import torch

import tritonrec.data.worker_transfer as wt
from tritonrec.data import KeyedJaggedTensor, SyntheticRecSource, make_rank_loader
from tritonrec.data.batch import Batch


def _batch(rows: int, seed: int, weights: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * rows,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"], values, torch.rand(values.shape, generator=g) if weights else None, lengths=lengths
    )
    dense = torch.randn(rows, 3, generator=g)[:, ::2]  # non-contiguous: packed as a copy
    return Batch(dense, kjt, torch.rand(rows, generator=g), torch.rand(rows, generator=g) > 0.2)


def _same(a: Batch, b: Batch) -> None:
    for x, y in ((a.dense_features, b.dense_features), (a.labels, b.labels), (a.valid_mask, b.valid_mask)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    ka, kb = a.sparse_features, b.sparse_features
    assert ka.keys() == kb.keys() and ka.stride() == kb.stride() and ka.length_per_key() == kb.length_per_key()
    assert torch.equal(ka.values(), kb.values()) and torch.equal(ka.lengths(), kb.lengths())
    assert (ka.weights_or_none() is None) == (kb.weights_or_none() is None)
    if ka.weights_or_none() is not None:
        assert torch.equal(ka.weights(), kb.weights())


def test_ring_round_trip_and_the_ring_travels_until_a_slot_is_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wt, "_RINGS", {})
    packer = wt.WorkerPacker()
    originals = [_batch(5, 0, weights=True), _batch(5, 1), _batch(1, 2), _batch(4, 3)]
    first, second = packer.pack(originals[0]), packer.pack(originals[1])
    assert isinstance(first, wt.RingBatch) and first.ring is not None and second.ring is not None
    _same(first.unpack(), originals[0])  # the main process copies slot 0 and frees it
    third = packer.pack(originals[2])  # the worker now knows the main process holds the ring
    assert third.ring is None and third.slot == first.slot
    _same(second.unpack(), originals[1])
    _same(third.unpack(), originals[2])
    unpacked = packer.pack(originals[3]).unpack()
    originals[3].labels.fill_(-1)  # the unpacked batch owns its memory
    assert not torch.equal(unpacked.labels, originals[3].labels)


def test_a_full_ring_or_an_oversize_batch_falls_back_and_a_new_iteration_reclaims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wt, "_RINGS", {})
    monkeypatch.setattr(wt, "_WAIT_S", 0.01)
    packer = wt.WorkerPacker()
    held = [packer.pack(_batch(6, seed)) for seed in range(wt._SLOTS)]  # never copied: every slot stays busy
    assert all(isinstance(b, wt.RingBatch) for b in held) and len({b.slot for b in held}) == wt._SLOTS
    full = packer.pack(_batch(6, 10))
    assert isinstance(full, wt.PackedBatch)
    _same(full.unpack(), _batch(6, 10))
    oversize = packer.pack(_batch(60, 11))
    assert isinstance(oversize, wt.PackedBatch)
    _same(oversize.unpack(), _batch(60, 11))
    packer.new_iteration()  # the main process dropped the held batches when it reset its iterator
    again = packer.pack(_batch(6, 12))
    assert isinstance(again, wt.RingBatch) and again.ring is not None  # no slot was ever freed by the main process
    _same(again.unpack(), _batch(6, 12))


def _received(sent: wt.RingBatch) -> wt.RingBatch:
    """The main process's copy of a RingBatch the worker sent (what unpickling it gives, sharing the ring)."""
    rebuild, fields = sent.__reduce__()
    return rebuild(*fields)


def test_a_received_batch_dropped_unread_frees_its_slot_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The main process's copy frees its slot when dropped unread (as torchdata drops the batches it replays on
    resume); the worker's own copy never does; a batch of a finished iteration dropped late frees nothing the
    worker packed since, and reading it raises instead of returning the newer batch's bytes."""
    monkeypatch.setattr(wt, "_RINGS", {})
    packer = wt.WorkerPacker()
    sent = packer.pack(_batch(5, 0))
    received = _received(sent)
    ring, slot = packer.ring, sent.slot
    del sent  # the worker drops its copy once it is on the queue
    assert not ring.free_slots()[slot]
    del received
    assert ring.free_slots()[slot] and ring.id in wt._RINGS  # freed, and the ring it carried is kept
    stale = _received(packer.pack(_batch(5, 1)))
    packer.new_iteration()  # the worker reclaims every slot ...
    again = packer.pack(_batch(5, 2))  # ... and packs the same slot again
    assert again.slot == stale.slot and not ring.free_slots()[again.slot]
    with pytest.raises(RuntimeError, match=f"ring slot {stale.slot} no longer holds this batch"):
        stale.unpack()
    del stale  # a drop after the slot was packed again must not free it under the new batch
    assert not ring.free_slots()[again.slot]
    _same(_received(again).unpack(), _batch(5, 2))
    assert ring.free_slots()[again.slot]


def test_a_late_release_of_an_old_batch_cannot_undo_a_newer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The main process writes only its own tokens and the worker only its own, so the interleaving that a
    check-then-clear scheme loses (an old batch's release landing after the worker re-packed the slot) leaves the
    newer batch's slot busy until that batch is read."""
    monkeypatch.setattr(wt, "_RINGS", {})
    packer = wt.WorkerPacker()
    old = _received(packer.pack(_batch(5, 0)))
    ring, slot = packer.ring, old.slot
    wt._register(ring.id, (ring.slots, ring.tokens, 0))
    packer.new_iteration()
    new = _received(packer.pack(_batch(5, 1)))
    assert new.slot == slot
    ring.tokens[1, slot] = old.token  # the old batch's release, as if its check had passed just before the re-pack
    assert not ring.free_slots()[slot]  # the newer batch still holds the slot
    _same(new.unpack(), _batch(5, 1))
    assert ring.free_slots()[slot]
    old._owner = False  # its release already "happened" above


def test_a_resumed_loader_frees_the_slots_of_the_batches_it_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchdata restores a loader with workers from its last worker snapshot (every 16 batches by default) and
    replays the batches since, dropping them: their slots must come free, or every later batch waits _WAIT_S for a
    slot and travels as a standalone buffer (the ring's whole point lost until the next iteration, which an endless
    stream never starts)."""
    monkeypatch.setattr(wt, "_WAIT_S", 0.02)  # the forked workers inherit it: a full ring shows in milliseconds

    def loader() -> object:
        source = SyntheticRecSource([50], num_dense=2, num_samples=400, chunk_size=8, seed=5)
        return make_rank_loader(source, 4, num_workers=2, num_passes=None, multiprocessing_context="fork")

    original = loader()
    stream = iter(original)
    for _ in range(14):  # 14 batches past the snapshot: 7 replayed per worker, more than its 4 slots
        next(stream)
    state = original.state_dict()
    expected = [next(stream) for _ in range(20)]
    del stream, original
    resumed = loader()
    resumed.load_state_dict(state)
    before = wt.standalone_batches
    again = list(itertools.islice(iter(resumed), 20))
    assert wt.standalone_batches == before  # every batch after the resume came through a ring slot
    for a, b in zip(expected, again, strict=True):
        _same(a, b)


def test_loaders_with_workers_give_torchs_own_transfer_batches_every_epoch() -> None:
    """Against the same loader sending its batches the DataLoader's own way (one shared segment per tensor)."""
    source = SyntheticRecSource([50, 20], num_dense=4, num_samples=90, chunk_size=16, seed=3)
    ringed = make_rank_loader(source, 8, num_workers=2, multiprocessing_context="fork")
    plain = make_rank_loader(source, 8, num_workers=2, multiprocessing_context="fork")
    plain.dataset.pack_in_workers = False
    before = wt.standalone_batches
    for epoch in range(5):
        count, left_early = 0, epoch in (1, 2, 3)
        for count, (a, b) in enumerate(zip(ringed, plain, strict=True), start=1):
            _same(a, b)
            if left_early and count == 3:
                break  # an epoch left early: its in-flight batches are dropped, their slots reclaimed
        assert count == (3 if left_early else 12), epoch
    assert wt.standalone_batches == before  # every batch came through a ring slot (slots were reclaimed)


def test_the_main_process_lets_go_of_rings_whose_worker_exited(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess
    import sys

    monkeypatch.setattr(wt, "_RINGS", {})
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    ring = (torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32))
    wt._register("gone", (*ring, exited.pid))
    wt._register("mine", (*ring, os.getpid()))
    assert list(wt._RINGS) == ["mine"]
    wt._register("later", (*ring, os.getpid()))
    assert sorted(wt._RINGS) == ["later", "mine"]


_EXIT_WITH_AN_OPEN_ITERATOR = """
from tritonrec.data import SyntheticRecSource, make_rank_loader
loader = make_rank_loader(SyntheticRecSource([50] * 3, num_dense=2, num_samples=90, chunk_size=16), 4,
                          num_workers=2, multiprocessing_context="fork")
sizes = [len(batch.labels) for batch in loader]
stream = iter(loader)
next(stream)  # a script that ends here (an endless loader's last step) leaves batches in flight
"""


def test_a_script_that_ends_with_batches_in_flight_exits_cleanly() -> None:
    """Ring batches dropped at interpreter exit freed their slots while torch's objects were torn down, which aborted
    the process (an internal assert in THPVariable_clear) in about 3 runs of 8: now they leave them."""
    import subprocess
    import sys

    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", _EXIT_WITH_AN_OPEN_ITERATOR], capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
