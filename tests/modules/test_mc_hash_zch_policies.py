"""HashZchManagedCollisionModule's eviction policies and opt-in (torchrec 1.8 / fbgemm 1.8.0 semantics):
``PER_FEATURE_TTL_EVICTION`` (per-id expiry from the id's feature), ``LRU_EVICTION`` (after all probes miss, the
expired probe expiring first) and ``opt_in_prob`` / ``percent_reserved_slots`` (reserved tail rows per bucket),
batch by batch against a plain-Python loop of the probing rounds; lookups of the states we insert against
torchrec 1.8's module on CPU (fbgemm-gpu-cpu's read-only ``zero_collision_hash``); bad configurations named."""

from __future__ import annotations

import pytest
import torch

from tests.modules.test_mc_hash_zch import _py_murmur
from tritonrec.data import JaggedTensor
from tritonrec.modules import HashZchEvictionConfig, HashZchEvictionPolicyName, HashZchManagedCollisionModule

_TTL = HashZchEvictionPolicyName.SINGLE_TTL_EVICTION
_PER_FEATURE = HashZchEvictionPolicyName.PER_FEATURE_TTL_EVICTION
_LRU = HashZchEvictionPolicyName.LRU_EVICTION


class _Ref:
    """The algorithm as loops over ids (``input_hash_size`` 0: bucket ``x % buckets``). A batch acts as its distinct
    ids in first-occurrence order, each with its repeats' largest expiry and smallest opt-in draw; the opted out
    (draw >= prob and not in their chain) take their reserved row; then probe rounds (hits first, then each free
    row, or with threshold eviction each expired row, to the id first in the batch); then, with LRU, rounds in
    which each id still unplaced proposes its expired probe expiring first and each row goes to the first id."""

    def __init__(self, zch: int, buckets: int, probe: int, lru: bool = False, prob: int = -1, reserved: int = -1,
                 fallback: bool = True) -> None:  # fmt: skip
        self.ident, self.meta = [-1] * zch, [-1] * zch
        self.buckets, self.width, self.probe, self.lru, self.prob = buckets, zch // buckets, probe, lru, prob
        self.reserved, self.fallback = reserved, fallback
        self.block = self.width - reserved if reserved > 0 else self.width

    def _place(self, x: int) -> tuple[int, int, int]:
        """-> (bucket offset, hash, first probe)."""
        h = _py_murmur(x)
        return (x % self.buckets) * self.width, h, h % self.block

    def _rows(self, x: int) -> list[int]:
        off, _, first = self._place(x)
        return [off + (first + k) % self.block for k in range(self.probe)]

    def _miss(self, x: int) -> int:
        off, h, _ = self._place(x)
        return off + (self.block + h % self.reserved if self.reserved > 0 else h % self.width)

    def _in_chain(self, x: int) -> bool:
        for row in self._rows(x):
            if self.ident[row] in (x, -1):
                return self.ident[row] == x
        return False

    def lookup(self, xs: list[int], rands: list[int] | None = None) -> list[int]:
        out = []
        for i, x in enumerate(xs):
            if rands is not None and rands[i] >= self.prob and not self._in_chain(x):
                out.append(self._miss(x))
                continue
            rows = [r for r in self._rows(x) if self.ident[r] == x]
            out.append(rows[0] if rows else (self._miss(x) if self.fallback else -1))
        return out

    def insert(self, xs: list[int], now: int = 0, expiry: list[int] | None = None,
               rands: list[int] | None = None) -> tuple[list[int], list[int]]:  # fmt: skip
        distinct = list(dict.fromkeys(xs))
        exp = {x: max(e for y, e in zip(xs, expiry, strict=True) if y == x) for x in distinct} if expiry else {}
        draw = {x: min(r for y, r in zip(xs, rands, strict=True) if y == x) for x in distinct} if rands else {}
        chain = {x: self._in_chain(x) for x in distinct}
        found: dict[int, int] = {}
        evicted: list[int] = []

        def take(x: int, row: int) -> None:
            if self.ident[row] != -1 and self.ident[row] != x:
                evicted.append(row)
            self.ident[row], found[x] = x, row
            if exp:
                self.meta[row] = max(self.meta[row], exp[x])

        for x in distinct:
            if draw and draw[x] >= self.prob and not chain[x]:
                found[x] = self._miss(x)
                if exp:
                    self.meta[found[x]] = max(self.meta[found[x]], exp[x])
        for k in range(self.probe):
            for x in distinct:
                row = self._rows(x)[k]
                if x not in found and self.ident[row] == x:
                    found[x] = row
                    if exp:
                        self.meta[row] = max(self.meta[row], exp[x])
            claimed: set[int] = set()
            for x in distinct:
                row = self._rows(x)[k]
                if x in found or row in claimed:
                    continue
                meta = self.meta[row]
                expired = bool(exp) and not self.lru and not chain[x] and now > meta and meta < exp[x]
                if self.ident[row] == -1 or expired:
                    claimed.add(row)
                    take(x, row)
        pending = [x for x in distinct if x not in found] if self.lru and exp else []
        while pending:
            proposals = {}
            for x in pending:
                candidates = [(self.meta[r], k, r) for k, r in enumerate(self._rows(x))
                              if now > self.meta[r] and self.meta[r] < exp[x]]  # fmt: skip
                if candidates:
                    proposals[x] = min(candidates)[2]
            claimed = set()
            for x, row in proposals.items():
                if row not in claimed:
                    claimed.add(row)
                    take(x, row)
            pending = [x for x in proposals if x not in found]
        return [found.get(x, self._miss(x) if self.fallback else -1) for x in xs], evicted


def _module(zch: int = 16, buckets: int = 2, probe: int = 4, **kw: object) -> HashZchManagedCollisionModule:
    return HashZchManagedCollisionModule(zch_size=zch, device="cpu", total_num_buckets=buckets, max_probe=probe, **kw)


def _jt(ids: list[int] | torch.Tensor) -> dict[str, JaggedTensor]:
    values = torch.as_tensor(ids, dtype=torch.int64)
    return {"t": JaggedTensor(values=values, lengths=torch.ones_like(values))}


def _pin(module: HashZchManagedCollisionModule, hour: int, rands: torch.Tensor | None = None) -> None:
    module._current_hour = lambda: hour  # type: ignore[method-assign]
    if rands is not None:
        module._opt_in_rands = lambda count: rands[:count]  # type: ignore[method-assign]


def _check_step(module: HashZchManagedCollisionModule, ref: _Ref, rows: torch.Tensor, expected: list[int],
                evicted: list[int]) -> int:  # fmt: skip
    assert rows.tolist() == expected
    assert module._hash_zch_identities.view(-1).tolist() == ref.ident
    if module._hash_zch_metadata is not None:
        assert module._hash_zch_metadata.view(-1).tolist() == ref.meta
    got = module.evict()
    assert (got.tolist() if got is not None else []) == sorted(set(evicted))
    return len(evicted)


def test_lru_eviction_matches_reference_and_differs_from_threshold_eviction() -> None:
    config = HashZchEvictionConfig(["t"], single_ttl=1)
    lru, ttl = _module(eviction_policy_name=_LRU, eviction_config=config), _module(eviction_policy_name=_TTL,
                                                                                   eviction_config=config)  # fmt: skip
    ref = _Ref(16, 2, 4, lru=True)
    g = torch.Generator().manual_seed(5)
    total, differs = 0, False
    for hour in range(10):
        _pin(lru, hour), _pin(ttl, hour)
        # a few ids of the previous hours renew their rows at different hours: the expiries differ
        ids = torch.cat([torch.randint(0, hour * 100 + 30, (4,), generator=g),
                         torch.randint(hour * 100, hour * 100 + 30, (20,), generator=g)])  # fmt: skip
        expected, evicted = ref.insert(ids.tolist(), now=hour, expiry=[hour + 1] * ids.numel())
        total += _check_step(lru, ref, lru(_jt(ids))["t"].values(), expected, evicted)
        ttl(_jt(ids)), ttl.evict()
        differs |= not torch.equal(ttl._hash_zch_identities, lru._hash_zch_identities)
    assert total > 0 and differs  # the stream evicts, and LRU picks other rows than the first expired probe


def test_lru_contested_row_goes_to_the_first_id_and_the_loser_takes_its_next_candidate() -> None:
    module = _module(4, 1, 4, eviction_policy_name=_LRU, eviction_config=HashZchEvictionConfig(["t"], single_ttl=5))
    ref = _Ref(4, 1, 4, lru=True)
    _pin(module, 0)
    module(_jt([1, 2, 3, 4])), ref.insert([1, 2, 3, 4], now=0, expiry=[5] * 4)
    # at hour 9 the rows of 3 and 4 expired at 5, of 1 at 8, of 2 at 9 (not before now): 10 takes one row of 3 and
    # 4, 11 (losing it) the other, 12 (losing twice) the row of 1
    for hour, ids in ((3, [1]), (4, [2]), (9, [10, 11, 12])):
        _pin(module, hour)
        expected, evicted = ref.insert(ids, now=hour, expiry=[hour + 5] * len(ids))
        _check_step(module, ref, module(_jt(ids))["t"].values(), expected, evicted)
    assert sorted(ref.ident) == [2, 10, 11, 12]


def test_per_feature_ttl_matches_reference() -> None:
    config = HashZchEvictionConfig(["a", "b"], per_feature_ttl=[1, 3])
    bags, per_feature = (_module(eviction_policy_name=_PER_FEATURE, eviction_config=config) for _ in range(2))
    ref = _Ref(16, 2, 4)
    g = torch.Generator().manual_seed(7)
    total = 0
    for hour in range(8):
        _pin(bags, hour), _pin(per_feature, hour)
        lengths = torch.randint(0, 4, (6,), generator=g)  # 3 bags of feature a, then 3 of feature b
        values = torch.randint(hour * 50, hour * 50 + 40, (int(lengths.sum()),), generator=g)
        count_a = int(lengths[:3].sum())
        expiry = [hour + (1 if i < count_a else 3) for i in range(values.numel())]
        expected, evicted = ref.insert(values.tolist(), now=hour, expiry=expiry)
        weights = torch.rand(values.numel())
        out = bags({"t": JaggedTensor(values=values, lengths=lengths, weights=weights)})["t"]
        total += _check_step(bags, ref, out.values(), expected, evicted)
        assert torch.equal(out.weights(), weights) and torch.equal(out.lengths(), lengths)
        # the sharded collection's form: one bag per feature
        out = per_feature({"t": JaggedTensor(values=values, lengths=torch.tensor([count_a, values.numel() - count_a]))})
        assert out["t"].values().tolist() == expected
        assert torch.equal(per_feature._hash_zch_metadata, bags._hash_zch_metadata)
        per_feature.evict()
    assert total > 0


@pytest.mark.parametrize("policy", [None, _TTL, _LRU])
@pytest.mark.parametrize("prob", [30, 100])
def test_opt_in_matches_reference(policy: HashZchEvictionPolicyName | None, prob: int) -> None:
    config = HashZchEvictionConfig(["t"], single_ttl=1) if policy else None
    module = _module(32, 2, 3, eviction_policy_name=policy, eviction_config=config, opt_in_prob=prob,
                     percent_reserved_slots=25)  # fmt: skip
    ref = _Ref(32, 2, 3, lru=policy is _LRU, prob=prob, reserved=4)  # floor(32 * 25 / 100 / 2) rows per bucket
    g = torch.Generator().manual_seed(prob)
    seen = torch.randint(0, 10**6, (12,), generator=g)
    for hour in range(6):
        ids = torch.cat([seen[torch.randint(0, 12, (6,), generator=g)], torch.randint(0, 10**6, (18,), generator=g)])
        rands = torch.randint(0, 100, (ids.numel(),), generator=g, dtype=torch.int32)
        _pin(module, hour, rands)
        expiry = [hour + 1] * ids.numel() if policy else None
        drawn = rands.tolist() if prob < 100 else None
        expected, evicted = ref.insert(ids.tolist(), now=hour, expiry=expiry, rands=drawn)
        _check_step(module, ref, module(_jt(ids))["t"].values(), expected, evicted)
        # a read-only feature in training draws too, and writes nothing
        out = module({"t_readonly": JaggedTensor(values=ids, lengths=torch.ones_like(ids))})["t_readonly"]
        assert out.values().tolist() == ref.lookup(ids.tolist(), drawn)
    assert all(i == -1 for b in (0, 16) for i in ref.ident[b + 12 : b + 16])  # reserved rows hold no identity
    module.eval()
    assert module(_jt(seen))["t"].values().tolist() == ref.lookup(seen.tolist())


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # inside torchrec's constructor
@pytest.mark.parametrize(
    "policy, prob, disable_fallback",
    [(_LRU, -1, False), (_PER_FEATURE, -1, True), (_TTL, 30, False), (_TTL, 30, True), (_LRU, 100, False),
     (None, 60, True)],
)  # fmt: skip
def test_lookups_of_inserted_states_match_torchrec(
    policy: HashZchEvictionPolicyName | None, prob: int, disable_fallback: bool
) -> None:
    hash_mc = pytest.importorskip("torchrec.modules.hash_mc_modules")
    torchrec_jt = pytest.importorskip("torchrec.sparse.jagged_tensor").JaggedTensor
    config = None
    if policy is not None:
        ttl = {"per_feature_ttl": [1]} if policy is _PER_FEATURE else {"single_ttl": 1}
        config = HashZchEvictionConfig(["t"], **ttl)  # type: ignore[arg-type]
    opt_in = {"opt_in_prob": prob, "percent_reserved_slots": 20 if prob > 0 else 0}
    module = _module(40, 2, 3, eviction_policy_name=policy, eviction_config=config, disable_fallback=disable_fallback,
                     **opt_in)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    for hour in range(5):  # a stream that fills the table, evicts, and (prob < 100) opts ids out
        ids = torch.randint(0, 300, (30,), generator=g)
        _pin(module, hour, torch.randint(0, 100, (30,), generator=g, dtype=torch.int32))
        module(_jt(ids)), module.evict()
    theirs = hash_mc.HashZchManagedCollisionModule(zch_size=40, device=torch.device("cpu"), total_num_buckets=2,
                                                   max_probe=3, is_inference=True, disable_fallback=disable_fallback,
                                                   **opt_in)  # fmt: skip
    theirs.load_state_dict(module.state_dict())  # a training checkpoint: metadata dropped, as ours
    queries = torch.arange(0, 320)
    ours = module.eval()(_jt(queries))["t"]
    got = theirs({"t": torchrec_jt(values=queries, lengths=torch.ones_like(queries))})["t"]
    assert ours.values().tolist() == got.values().tolist()
    assert ours.lengths().tolist() == got.lengths().tolist()
    assert (module._hash_zch_identities != -1).sum() > 20  # the stream did fill the table


_TWO = ["a", "b"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"eviction_policy_name": _PER_FEATURE, "eviction_config": HashZchEvictionConfig(_TWO, single_ttl=1)},
         ValueError, r"PER_FEATURE_TTL_EVICTION needs eviction_config.per_feature_ttl .*per_feature_ttl=None"),
        ({"eviction_policy_name": _PER_FEATURE, "eviction_config": HashZchEvictionConfig(_TWO, per_feature_ttl=[1])},
         ValueError, r"one TTL per feature .*per_feature_ttl=\[1\]"),
        ({"eviction_policy_name": _PER_FEATURE,
          "eviction_config": HashZchEvictionConfig(_TWO, per_feature_ttl=[1, -2])},
         ValueError, r"eviction_config\.per_feature_ttl\[1\] .*-2"),
        ({"eviction_policy_name": _PER_FEATURE,
          "eviction_config": HashZchEvictionConfig(_TWO, per_feature_ttl=[1, 2.5])},  # type: ignore[list-item]
         TypeError, r"eviction_config\.per_feature_ttl\[1\].*2\.5"),
        ({"eviction_policy_name": _LRU, "eviction_config": HashZchEvictionConfig(["t"], per_feature_ttl=[1])},
         ValueError, r"LRU_EVICTION needs eviction_config\.single_ttl"),
        ({"opt_in_prob": 0, "percent_reserved_slots": 10}, ValueError, r"opt_in_prob=0"),
        ({"opt_in_prob": 101, "percent_reserved_slots": 10}, ValueError, r"opt_in_prob.*101"),
        ({"opt_in_prob": 2.5, "percent_reserved_slots": 10}, TypeError, r"opt_in_prob.*2\.5"),
        ({"opt_in_prob": 50, "percent_reserved_slots": 100}, ValueError, r"percent_reserved_slots=100"),
        ({"opt_in_prob": 50, "percent_reserved_slots": "5"}, TypeError, r"percent_reserved_slots .*'5'"),
        ({"percent_reserved_slots": 10}, ValueError, r"percent_reserved_slots=10 needs opt_in_prob"),
        ({"opt_in_prob": 50, "percent_reserved_slots": 5}, ValueError, r"percent_reserved_slots=5: 0 reserved slots"),
        ({"opt_in_prob": 50, "percent_reserved_slots": 50, "output_segments": [0, 2, 8]}, ValueError,
         r"2 reserved slots per bucket .*smallest bucket has 2 rows"),
    ],
)  # fmt: skip
def test_bad_configurations_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _module(8, 2, 2, **kwargs)


def test_bad_per_feature_inputs_are_named() -> None:
    config = HashZchEvictionConfig(_TWO, per_feature_ttl=[0, 5])
    module = _module(8, 2, 2, eviction_policy_name=_PER_FEATURE, eviction_config=config)
    with pytest.raises(ValueError, match=r"features\['t'\]\.lengths\(\) has 3 bags, not a multiple of the 2 features"):
        module({"t": JaggedTensor(values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))})
    _pin(module, 2**31 - 3)  # the clock moved on: 5 hours past it overflow the int32 expiry
    with pytest.raises(ValueError, match=r"eviction_config\.per_feature_ttl\[1\]=5 \+ current hour 2147483645"):
        module(_jt([1, 2]))


def test_per_feature_ttl_refuses_features_with_other_batch_sizes_in_a_collection() -> None:
    """A variable batch per feature would put another feature's bags in a feature's block (its TTL): refused by the
    collection, naming the table and the bag counts, before the module inserts anything."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagConfig, ManagedCollisionCollection

    config = HashZchEvictionConfig(_TWO, per_feature_ttl=[1, 100])
    module = _module(16, 2, 4, eviction_policy_name=_PER_FEATURE, eviction_config=config)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=16, embedding_dim=4, feature_names=_TWO)]
    inverse = (_TWO, torch.zeros(2, 3, dtype=torch.int64))
    kjt = KeyedJaggedTensor(keys=_TWO, values=torch.tensor([10, 20, 21, 22]), lengths=torch.ones(4, dtype=torch.int64),
                            stride_per_key_per_rank=[[1], [3]], inverse_indices=inverse)  # fmt: skip
    with pytest.raises(ValueError, match=r"table 't': PER_FEATURE_TTL_EVICTION .* have \[1, 3\] bags"):
        ManagedCollisionCollection({"t": module}, tables)(kjt)
    assert (module._hash_zch_identities == -1).all()


def test_open_slots_leave_out_the_reserved_tails() -> None:
    module = _module(40, 2, 4, opt_in_prob=100, percent_reserved_slots=25)  # 5 reserved rows per bucket
    assert module.open_slots().item() == 30
    module(_jt(list(range(10_000))))
    assert module.open_slots().item() == 0
