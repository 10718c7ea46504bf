"""HashZchManagedCollisionModule: remapped ids and identities/metadata batch by batch against a plain-Python loop of
the probing algorithm (murmur3 written with Python ints), lookups against numbers recorded from torchrec 1.8 on
CPU (fbgemm-gpu-cpu 1.8.0 only implements read-only lookups), state-dict round trip, sharding by buckets, use in
ManagedCollisionCollection / MC-EBC, bad input."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    HashZchManagedCollisionModule,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
)
from tritonrec.modules.mc_hash_zch import murmur_hash3_2x64

_M64 = 2**64 - 1
_TTL = HashZchEvictionPolicyName.SINGLE_TTL_EVICTION


def _py_murmur(x: int) -> int:
    """fbgemm's murmur_hash3_2x64(x, 0, 0) as a uint64, written out from the MurmurHash3 x64-128 definition."""

    def rotl(v: int, r: int) -> int:
        return ((v << r) | (v >> (64 - r))) & _M64

    def fmix(k: int) -> int:
        k ^= k >> 33
        k = (k * 0xFF51AFD7ED558CCD) & _M64
        k ^= k >> 33
        k = (k * 0xC4CEB9FE1A85EC53) & _M64
        return k ^ (k >> 33)

    c1, c2 = 0x87C37B91114253D5, 0x4CF5AD432745937F
    h1 = h2 = 0
    k1 = rotl((x & _M64) * c1 & _M64, 31) * c2 & _M64
    h1 = (rotl(h1 ^ k1, 27) + h2) & _M64
    h1 = (h1 * 5 + 0x52DCE729) & _M64
    k2 = rotl(0 * c2 & _M64, 33) * c1 & _M64
    h2 = (rotl(h2 ^ k2, 31) + h1) & _M64
    h2 = (h2 * 5 + 0x38495AB5) & _M64
    h1, h2 = h1 ^ 16, h2 ^ 16
    h1 = (h1 + h2) & _M64
    h2 = (h2 + h1) & _M64
    h1, h2 = fmix(h1), fmix(h2)
    h1 = (h1 + h2) & _M64
    h2 = (h2 + h1) & _M64
    return h1 ^ h2


class _RefZch:
    """The algorithm as a loop over ids: insert in probe rounds (hits first, then each free or expired row to the
    id seen first in the batch), read-only lookups over all probes, first-probe fallback or -1."""

    def __init__(self, zch: int, buckets: int, probe: int, ihs: int = 0, fallback: bool = True, ttl: int | None = None,
                 div: bool = False) -> None:  # fmt: skip
        self.ident, self.meta = [-1] * zch, [-1] * zch
        self.width, self.buckets, self.probe, self.ihs = zch // buckets, buckets, probe, ihs
        self.fallback, self.ttl, self.div = fallback, ttl, div

    def _place(self, x: int) -> tuple[int, int, int]:
        """-> (identity, bucket offset, first probe)."""
        if self.ihs == 0:
            b, v = x % self.buckets, (x // self.buckets if self.div else x)
        else:
            blk = -(-self.ihs // self.buckets)
            b, v = x // blk, (x % blk if self.div else x)
        return v, b * self.width, _py_murmur(v) % self.width

    def _row(self, off: int, first: int, k: int) -> int:
        return off + (first + k) % self.width

    def lookup(self, xs: list[int]) -> list[int]:
        out = []
        for x in xs:
            v, off, first = self._place(x)
            rows = [self._row(off, first, k) for k in range(self.probe) if self.ident[self._row(off, first, k)] == v]
            out.append(rows[0] if rows else (off + first if self.fallback else -1))
        return out

    def insert(self, xs: list[int], now: int = 0) -> tuple[list[int], list[int]]:
        distinct = list(dict.fromkeys(self._place(x) for x in xs))  # first-occurrence order
        expiry = None if self.ttl is None else now + self.ttl
        in_chain = set()
        for i, (v, off, first) in enumerate(distinct):
            for k in range(self.probe):
                held = self.ident[self._row(off, first, k)]
                if held == v:
                    in_chain.add(i)
                if held in (v, -1):
                    break
        found: dict[int, int] = {}
        evicted: list[int] = []
        for k in range(self.probe):
            for i, (v, off, first) in enumerate(distinct):
                row = self._row(off, first, k)
                if i not in found and self.ident[row] == v:
                    found[i] = row
                    if expiry is not None:
                        self.meta[row] = max(self.meta[row], expiry)
            claimed: set[int] = set()
            for i, (v, off, first) in enumerate(distinct):
                row = self._row(off, first, k)
                if i in found or row in claimed:
                    continue
                held, meta = self.ident[row], self.meta[row]
                expired = expiry is not None and i not in in_chain and now > meta and meta < expiry
                if held == -1 or expired:
                    claimed.add(row)
                    if held != -1:
                        evicted.append(row)
                    self.ident[row], found[i] = v, row
                    if expiry is not None:
                        self.meta[row] = expiry
        rows = []
        for x in xs:
            i = distinct.index(self._place(x))
            v, off, first = distinct[i]
            rows.append(found.get(i, off + first if self.fallback else -1))
        return rows, evicted


def _jt(ids: list[int] | torch.Tensor) -> dict[str, JaggedTensor]:
    values = torch.as_tensor(ids, dtype=torch.int64)
    return {"t": JaggedTensor(values=values, lengths=torch.ones_like(values))}


def _module(zch: int = 32, buckets: int = 2, probe: int = 4, **kw: object) -> HashZchManagedCollisionModule:
    return HashZchManagedCollisionModule(zch_size=zch, device="cpu", total_num_buckets=buckets, max_probe=probe, **kw)


def test_murmur_matches_python_and_fbgemm() -> None:
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)]), torch.randint(-(2**62), 2**62, (200,), generator=g)])
    got = [h & _M64 for h in murmur_hash3_2x64(xs).tolist()]
    assert got == [_py_murmur(x) for x in xs.tolist()]
    # torch.ops.fbgemm.murmur_hash3 on CPU (it cannot return hashes >= 2**63)
    fbgemm = {3: 1573190477316769101, 12345: 5616442658200909733, 42: 5430222864781560104, 99: 3008630583530183730}
    assert murmur_hash3_2x64(torch.tensor(list(fbgemm))).tolist() == list(fbgemm.values())


@pytest.mark.parametrize(
    "zch, buckets, probe, ihs, fallback, div",
    [(32, 1, 4, 0, True, False), (32, 2, 3, 0, False, False), (64, 4, 8, 10_000, True, False),
     (48, 3, 2, 999, False, True), (16, 2, 16, 0, True, True), (1, 1, 1, 0, True, False)],
)  # fmt: skip
def test_stream_matches_reference(zch: int, buckets: int, probe: int, ihs: int, fallback: bool, div: bool) -> None:
    module = _module(zch, buckets, probe, input_hash_size=ihs, disable_fallback=not fallback,
                     inference_dispatch_div_train_world_size=div, no_bag=True)  # fmt: skip
    ref = _RefZch(zch, buckets, probe, ihs, fallback, div=div)
    g = torch.Generator().manual_seed(zch + probe)
    high = ihs or 10**9
    seen = torch.randint(0, high, (zch,), generator=g)
    for _ in range(6):  # repeats (hits), duplicates in a batch and new ids; collisions at these load factors
        ids = torch.cat(
            [seen[torch.randint(0, zch, (zch // 2,), generator=g)], torch.randint(0, high, (zch,), generator=g)]
        )
        rows = module(_jt(ids))["t"].values()
        expected, _ = ref.insert(ids.tolist())
        assert rows.tolist() == [max(r, 0) for r in expected]  # no_bag: a dropped id reads row 0
        assert module._hash_zch_identities.view(-1).tolist() == ref.ident
    module.eval()
    queries = torch.cat([seen, torch.randint(0, high, (zch,), generator=g)])
    rows = module(_jt(queries))["t"].values()
    assert rows.tolist() == [max(r, 0) for r in ref.lookup(queries.tolist())]
    assert module._hash_zch_identities.view(-1).tolist() == ref.ident  # eval changes nothing


def test_ttl_eviction_matches_reference() -> None:
    module = _module(16, 2, 4, eviction_policy_name=_TTL, eviction_config=HashZchEvictionConfig(["t"], single_ttl=2))
    ref = _RefZch(16, 2, 4, ttl=2)
    g = torch.Generator().manual_seed(3)
    total_evicted = 0
    for hour in range(8):
        module._current_hour = lambda hour=hour: hour  # type: ignore[method-assign]
        ids = torch.randint(hour * 1000, hour * 1000 + 40, (24,), generator=g)  # a new id population per hour
        rows = module(_jt(ids))["t"].values()
        expected, evicted = ref.insert(ids.tolist(), now=hour)
        assert rows.tolist() == expected
        assert module._hash_zch_identities.view(-1).tolist() == ref.ident
        assert module._hash_zch_metadata.view(-1).tolist() == ref.meta
        got = module.evict()
        assert (got.tolist() if got is not None else []) == sorted(set(evicted))
        total_evicted += len(evicted)
    assert total_evicted > 0  # the stream does exercise eviction


_TABLE = [7, -1, 42, 13, -1, 9, 30, 44, 55, 99, -1, 60, 77, 51, -1, 88]
_QUERY = [7, 42, 13, 9, 30, 44, 55, 99, 60, 77, 51, 88, 0, 1, 25, 49, 50, 75, 98]


@pytest.mark.parametrize(
    "ihs, disable_fallback, probe, values, lengths",
    [  # torchrec 1.8 HashZchManagedCollisionModule(zch_size=16, total_num_buckets=2).eval(), identities = _TABLE
        (100, False, 3, [4, 2, 7, 1, 6, 1, 11, 10, 8, 12, 10, 11, 0, 5, 7, 4, 10, 10, 11], [1] * 19),
        (100, False, 16, [0, 2, 3, 5, 6, 7, 8, 9, 11, 12, 13, 15, 0, 5, 7, 4, 10, 10, 11], [1] * 19),
        (100, True, 3, [2, 6, 12], [0, 1, 0, 0, 1, 0, 0, 0, 0, 1] + [0] * 9),
        (100, True, 16, [0, 2, 3, 5, 6, 7, 8, 9, 11, 12, 13, 15], [1] * 12 + [0] * 7),
        (0, False, 4, [12, 2, 15, 9, 6, 1, 11, 10, 0, 12, 13, 3, 0, 13, 15, 12, 2, 10, 3], [1] * 19),
    ],
)
def test_lookup_matches_torchrec(ihs: int, disable_fallback: bool, probe: int, values: list, lengths: list) -> None:
    module = _module(16, 2, probe, input_hash_size=ihs, disable_fallback=disable_fallback).eval()
    module._hash_zch_identities.data.copy_(torch.tensor(_TABLE).view(-1, 1))
    out = module(_jt(_QUERY))["t"]
    assert out.values().tolist() == values
    assert out.lengths().tolist() == lengths


def test_disable_fallback_drops_ids_per_bag_and_readonly_suffix() -> None:
    module = _module(2, 1, 1, disable_fallback=True)
    ids = torch.arange(10, 30)
    out = module({"t": JaggedTensor(values=ids, lengths=torch.tensor([5, 0, 15]))})["t"]
    ref = _RefZch(2, 1, 1, fallback=False)
    rows, _ = ref.insert(ids.tolist())
    assert out.values().tolist() == [r for r in rows if r >= 0]
    assert out.lengths().tolist() == [sum(r >= 0 for r in rows[:5]), 0, sum(r >= 0 for r in rows[5:])]
    fresh = _module(8, 1, 2)
    fresh({"f_readonly": JaggedTensor(values=ids, lengths=torch.tensor([20]))})
    assert fresh.open_slots().tolist() == [8]  # read-only features insert nothing


def test_state_dict_round_trip_and_sharding() -> None:
    config = HashZchEvictionConfig(["t"], single_ttl=3)
    module = _module(32, 4, 4, input_hash_size=400, eviction_policy_name=_TTL, eviction_config=config)
    module._current_hour = lambda: 5  # type: ignore[method-assign]
    ids = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(1))
    module(_jt(ids))
    state = module.state_dict()
    assert sorted(state) == ["_hash_zch_bucket", "_hash_zch_identities", "_hash_zch_metadata"]
    other = _module(32, 4, 4, input_hash_size=400, eviction_policy_name=_TTL, eviction_config=config)
    other.load_state_dict(state)
    module.eval(), other.eval()
    assert torch.equal(module(_jt(ids))["t"].values(), other(_jt(ids))["t"].values())
    inference = _module(32, 4, 4, input_hash_size=400, is_inference=True)
    inference.load_state_dict(state)  # a training checkpoint: metadata dropped
    assert torch.equal(inference(_jt(ids))["t"].values(), module(_jt(ids))["t"].values())
    # shard owning buckets 2..3 (rows 16..31): same global rows as the whole table for its ids
    shard = _module(32, 4, 4, input_hash_size=400).rebuild_with_output_id_range((16, 32))
    whole = _module(32, 4, 4, input_hash_size=400)
    mine = ids[ids >= 200]
    assert torch.equal(shard(_jt(mine))["t"].values(), whole(_jt(mine))["t"].values())
    assert shard.output_size() == 16 and shard.is_sharded and int(shard(_jt(mine))["t"].values().min()) >= 16


def test_in_collection_and_mc_ebc() -> None:
    configs = [EmbeddingBagConfig(name="t0", num_embeddings=16, embedding_dim=3, feature_names=["f1", "f2"])]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(configs, device="cpu", backend="torch")
    mcc = ManagedCollisionCollection({"t0": _module(16, 2, 4, name="t0")}, configs)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True)
    ref = _RefZch(16, 2, 4)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        lengths = torch.randint(0, 4, (4,), generator=g)
        values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=values, lengths=lengths)
        pooled, remapped = mc_ebc(kjt)
        assert remapped is not None
        assert remapped.values().tolist() == ref.insert(values.tolist())[0]  # one id stream per table
        assert torch.equal(pooled.values(), ebc(remapped).values())
    dropping = ManagedCollisionCollection({"t0": _module(16, 2, 1, disable_fallback=True)}, configs)
    out = dropping(KeyedJaggedTensor(keys=["f1", "f2"], values=torch.arange(100, 140), lengths=torch.tensor([20, 20])))
    assert int(out.lengths().sum()) == out.values().numel() < 40  # misses dropped, lengths shortened


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        ({"zch_sizee": 3}, TypeError, "'zch_sizee': 3"),
        ({"zch_size": 10, "total_num_buckets": 3}, ValueError, "zch_size=10"),
        ({"zch_size": 0}, ValueError, "zch_size"),
        ({"max_probe": 0}, ValueError, "max_probe"),
        ({"output_segments": [0, 8, 4]}, ValueError, "output_segments"),
        ({"opt_in_prob": 50}, ValueError, "opt_in_prob=50 with percent_reserved_slots=0"),
        ({"eviction_policy_name": HashZchEvictionPolicyName.LRU_EVICTION}, ValueError, "LRU_EVICTION needs"),
        ({"eviction_policy_name": _TTL}, ValueError, "single_ttl"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, names: str) -> None:
    args = {"zch_size": 8, "device": "cpu", "total_num_buckets": 2} | kwargs
    with pytest.raises(error, match=names):
        HashZchManagedCollisionModule(**args)


def test_bad_inputs() -> None:
    module = _module(8, 2, 2, input_hash_size=100)
    with pytest.raises(ValueError, match=r"features\['t'\].values\(\).*= 100 .*input_hash_size=100"):
        module(_jt([1, 100]))
    with pytest.raises(ValueError, match=r"= -3 "):
        module(_jt([-3]))
    with pytest.raises(TypeError, match="int32 or int64"):
        module({"t": JaggedTensor(values=torch.tensor([1.0]), lengths=torch.tensor([1]))})
    with pytest.raises(ValueError, match="mutate_miss_lengths=False"):
        _module(8, 2, 1, disable_fallback=True)(_jt(list(range(20))), mutate_miss_lengths=False)
    with pytest.raises(ValueError, match=r"output_id_range=\(3, 8\)"):
        module.rebuild_with_output_id_range((3, 8))
