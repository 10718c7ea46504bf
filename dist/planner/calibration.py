"""The perf model's machine coefficients: how fast the lookup kernels and the collectives run here.

``python -m tritonrec.dist.planner.calibrate`` measures them and writes a JSON file (schema below);
:func:`load_perf_coefficients` reads it. Without a file the planner uses :data:`DEFAULT_COEFFICIENTS`: for CPU the
values calibrate measured on a small shared 2-core host (gloo, 2 ranks), for GPU order-of-magnitude values for
NCCL over NVLink. Coefficients hold for the world size they were measured at (``measured_on``); calibrate at the
world size you train with.

Where the planner looks (first found wins): the path given (``Topology(calibration=...)``), the file named by
``$TRITONREC_PLANNER_CALIBRATION``, ``~/.cache/tritonrec/planner_calibration_<cpu|cuda>.json`` (what ``calibrate``
writes by default), then the defaults.

The model (see :mod:`~tritonrec.dist.planner.shard_estimators`): a lookup call costs
``call_s + tables x table_s + bags x bag_s + ids x id_s + bytes / bytes_per_s`` forward and again backward (the fused
update), where ``bytes`` is ids x shard columns x element size (the per-id term is what a column split does not
divide: every column shard handles every id; the per-table and per-bag terms are what a row split does not divide:
every row shard of a table produces a partial bag for every sample), measured with every rank of the host computing
at once; ``alone_speedup`` is how much faster a rank computes while its host's other ranks are idle (shared cores and
memory bandwidth, see :mod:`~tritonrec.dist.planner.perf_models`); a collective costs
``latency_s + wire bytes / (link bandwidth x efficiency)``, where the link bandwidth is the topology's
``intra_host_bw`` or ``inter_host_bw`` and ``efficiency`` is that collective's measured bandwidth relative to
all-to-all's (1.0 for all-to-all itself). The sparse input dist (a KJT all-to-all: one collective for the splits, one
per tensor) costs ``input_dist.latency_s`` per call plus ``input_dist.id_s`` per id received (unpacking and
regrouping by key) on top of its wire bytes; row-split types first bucketize each rank's ids by row block
(``bucketize_call_s + ids x bucketize_id_s``).

JSON schema (version 2; a version 1 file, without ``input_dist``, reads with zero input-dist terms)::

    {"version": 2, "compute_device": "cpu",
     "lookup": {"fwd_bytes_per_s": 2e9, "fwd_call_s": 5e-5, "fwd_id_s": 2e-8, "fwd_bag_s": 1e-8, "fwd_table_s": 1e-5,
                "bwd_bytes_per_s": 1e9, "bwd_call_s": 1e-4, "bwd_id_s": 1e-7, "bwd_bag_s": 1e-8, "bwd_table_s": 1e-5,
                "alone_speedup": 1.5},
     "comms": {"all_to_all": {"latency_s": 1e-4, "bytes_per_s": 1e9}, "reduce_scatter": {...},
               "all_gather": {...}, "all_reduce": {...}},
     "input_dist": {"latency_s": 3e-4, "id_s": 5e-9, "bucketize_call_s": 1e-4, "bucketize_id_s": 2e-8},
     "group_step_s": {"table_wise": {"fwd_s": 3e-3, "bwd_s": 2e-3}, "row_wise": {...}, ...},
     "inter_host_bw": 1.25e9,
     "measured_on": {"host": "...", "threads": 2, "torch": "2.13.0", "backend": "gloo", "date": "..."}}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_VAR = "TRITONREC_PLANNER_CALIBRATION"
SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "column_wise",
    "row_wise",
    "table_row_wise",
    "table_column_wise",
    "grid_shard",
)
COLLECTIVES = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")
SCHEMA_VERSION = 2
KJT_ALL_TO_ALL_CALLS = 3  # splits, lengths, values: a version 1 file's input-dist latency is 3 all-to-all latencies
READABLE_VERSIONS = (1, 2)

__all__ = [
    "COLLECTIVES",
    "DEFAULT_COEFFICIENTS",
    "ENV_VAR",
    "CommCoefficients",
    "InputDistCoefficients",
    "LookupCoefficients",
    "PerfCoefficients",
    "default_calibration_path",
    "load_perf_coefficients",
]


def _positive(where: str, value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{where} must be a positive finite number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _non_negative(where: str, value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:  # type: ignore[arg-type]
        raise ValueError(f"{where} must be a non-negative finite number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _at_least_one(where: str, value: object) -> float:
    number = _positive(where, value)
    if number < 1.0:
        raise ValueError(f"{where} must be >= 1 (a rank alone is not slower), got {value!r}")
    return number


@dataclass(frozen=True)
class LookupCoefficients:
    """Table-batched lookup cost: a fixed cost per call, per table, per bag and per id, and bytes of embedding rows
    per second."""

    fwd_bytes_per_s: float
    fwd_call_s: float
    bwd_bytes_per_s: float
    bwd_call_s: float
    fwd_id_s: float = 0.0
    bwd_id_s: float = 0.0
    fwd_bag_s: float = 0.0
    bwd_bag_s: float = 0.0
    fwd_table_s: float = 0.0
    bwd_table_s: float = 0.0
    alone_speedup: float = 1.0  # how much faster a rank computes while its host's other ranks are idle


@dataclass(frozen=True)
class CommCoefficients:
    """One collective: fixed latency per call, and the per-rank wire bandwidth it reached."""

    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class InputDistCoefficients:
    """The sparse input dist beyond its wire bytes: the KJT all-to-all's fixed cost per call (all its collectives
    together) and per id received, and the row-block bucketizing of row-split types (per call and per id)."""

    latency_s: float = 0.0
    id_s: float = 0.0
    bucketize_call_s: float = 0.0
    bucketize_id_s: float = 0.0


@dataclass(frozen=True)
class PerfCoefficients:
    """Everything the perf model reads about the machine (see module docstring)."""

    compute_device: str
    lookup: LookupCoefficients
    comms: dict[str, CommCoefficients]
    inter_host_bw: float
    measured_on: dict[str, Any] = field(default_factory=dict)
    input_dist: InputDistCoefficients = field(default_factory=InputDistCoefficients)
    group_step_s: dict[str, tuple[float, float]] = field(default_factory=dict)

    def efficiency(self, collective: str) -> float:
        """``collective``'s bandwidth relative to all-to-all's on this machine."""
        return self.comms[collective].bytes_per_s / self.comms["all_to_all"].bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "compute_device": self.compute_device,
            "lookup": dict(vars(self.lookup)),
            "comms": {name: dict(vars(c)) for name, c in self.comms.items()},
            "input_dist": dict(vars(self.input_dist)),
            "group_step_s": {kind: {"fwd_s": f, "bwd_s": b} for kind, (f, b) in self.group_step_s.items()},
            "inter_host_bw": self.inter_host_bw,
            "measured_on": dict(self.measured_on),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "calibration") -> PerfCoefficients:
        """Parse and check a :meth:`to_json` dict; errors name ``source`` and the offending field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"{source}: version must be one of {READABLE_VERSIONS}, got {data.get('version')!r}")
        device = data.get("compute_device")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{source}: compute_device must be 'cpu' or 'cuda', got {device!r}")
        try:
            lookup_data, comms_data = data["lookup"], data["comms"]
            optional = lambda name: _non_negative(f"{source}: lookup.{name}", lookup_data.get(name, 0.0))
            lookup = LookupCoefficients(
                fwd_bytes_per_s=_positive(f"{source}: lookup.fwd_bytes_per_s", lookup_data["fwd_bytes_per_s"]),
                fwd_call_s=_non_negative(f"{source}: lookup.fwd_call_s", lookup_data["fwd_call_s"]),
                bwd_bytes_per_s=_positive(f"{source}: lookup.bwd_bytes_per_s", lookup_data["bwd_bytes_per_s"]),
                bwd_call_s=_non_negative(f"{source}: lookup.bwd_call_s", lookup_data["bwd_call_s"]),
                fwd_id_s=_non_negative(f"{source}: lookup.fwd_id_s", lookup_data["fwd_id_s"]),
                bwd_id_s=_non_negative(f"{source}: lookup.bwd_id_s", lookup_data["bwd_id_s"]),
                **{name: optional(name) for name in ("fwd_bag_s", "bwd_bag_s", "fwd_table_s", "bwd_table_s")},
                alone_speedup=_at_least_one(f"{source}: lookup.alone_speedup", lookup_data.get("alone_speedup", 1.0)),
            )
            comms = {
                name: CommCoefficients(
                    latency_s=_non_negative(f"{source}: comms.{name}.latency_s", comms_data[name]["latency_s"]),
                    bytes_per_s=_positive(f"{source}: comms.{name}.bytes_per_s", comms_data[name]["bytes_per_s"]),
                )
                for name in COLLECTIVES
            }
            if data["version"] == 1:
                input_data = {"latency_s": KJT_ALL_TO_ALL_CALLS * comms["all_to_all"].latency_s}
            else:
                input_data = data["input_dist"]
            input_dist = InputDistCoefficients(
                **{
                    name: _non_negative(f"{source}: input_dist.{name}", input_data.get(name, 0.0))
                    for name in ("latency_s", "id_s", "bucketize_call_s", "bucketize_id_s")
                }
            )
            inter = _positive(f"{source}: inter_host_bw", data["inter_host_bw"])
            groups = {}
            for kind, times in dict(data.get("group_step_s", {})).items():
                if kind not in SHARDING_TYPES:
                    raise ValueError(f"{source}: group_step_s has an unknown sharding type {kind!r}")
                groups[kind] = (
                    _non_negative(f"{source}: group_step_s.{kind}.fwd_s", times["fwd_s"]),
                    _non_negative(f"{source}: group_step_s.{kind}.bwd_s", times["bwd_s"]),
                )
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source}: missing or malformed field {err}") from None
        return cls(device, lookup, comms, inter, dict(data.get("measured_on", {})), input_dist, groups)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a file
        return path


def _comms(latency_s: float, all_to_all: float, reduce_scatter: float, all_gather: float, all_reduce: float) -> dict:
    rates = {"all_to_all": all_to_all, "reduce_scatter": reduce_scatter, "all_gather": all_gather}
    rates["all_reduce"] = all_reduce
    return {name: CommCoefficients(latency_s, rate) for name, rate in rates.items()}


DEFAULT_COEFFICIENTS: dict[str, PerfCoefficients] = {
    # Measured by `python -m tritonrec.dist.planner.calibrate` (two runs, rounded means): an x86_64 VM with 2 cores
    # and 24 GiB, shared with other jobs (load average 3.5-4 during the runs), torch 2.13 CPU, torch twins,
    # 2 ranks x 1 thread on gloo over loopback TCP. A quiet or larger host is faster and its ranks slow each
    # other down less (alone_speedup nearer 1): calibrate it.
    "cpu": PerfCoefficients(
        "cpu",
        LookupCoefficients(
            7.5e9,
            3.0e-4,
            1.07e9,
            6.9e-4,
            fwd_id_s=0.0,
            bwd_id_s=6.7e-8,
            fwd_bag_s=2.2e-8,
            bwd_bag_s=5.0e-8,
            fwd_table_s=4.5e-5,
            bwd_table_s=4.8e-5,
            alone_speedup=1.9,
        ),
        {
            "all_to_all": CommCoefficients(7.2e-4, 3.8e8),
            "reduce_scatter": CommCoefficients(8.0e-4, 3.5e8),
            "all_gather": CommCoefficients(7.0e-4, 2.2e8),
            "all_reduce": CommCoefficients(1.65e-4, 1.2e9),
        },
        inter_host_bw=1.25e9,  # 10 Gb/s Ethernet (not measured: one host)
        measured_on={"source": "documented defaults (2-core VM, gloo, 2 ranks x 1 thread, loaded)"},
        input_dist=InputDistCoefficients(latency_s=2.5e-3, id_s=4e-9, bucketize_call_s=6e-5, bucketize_id_s=4.1e-8),
        group_step_s={
            "data_parallel": (0.93e-3, 3.5e-3),
            "table_wise": (4.4e-3, 1.65e-3),
            "column_wise": (5.3e-3, 5.75e-3),
            "row_wise": (5.67e-3, 2.4e-3),
            "table_row_wise": (7.66e-3, 3.2e-3),
            "table_column_wise": (5.3e-3, 5.8e-3),
            "grid_shard": (7.0e-3, 3.0e-3),
        },
    ),
    # one GPU per rank, Triton kernels, NCCL over NVLink inside a host (not measured: order-of-magnitude values; the
    # KJT all-to-all is 3 collectives' latencies)
    "cuda": PerfCoefficients(
        "cuda",
        LookupCoefficients(1e12, 1e-5, 5e11, 2e-5, fwd_id_s=1e-11, bwd_id_s=5e-11),
        _comms(2e-5, all_to_all=1.5e11, reduce_scatter=1.5e11, all_gather=1.5e11, all_reduce=1.5e11),
        inter_host_bw=1.25e10,  # 100 Gb/s RDMA
        measured_on={"source": "documented defaults"},
        input_dist=InputDistCoefficients(latency_s=KJT_ALL_TO_ALL_CALLS * 2e-5),
    ),
}


def default_calibration_path(compute_device: str) -> Path:
    """Where ``calibrate`` writes by default and the planner looks: ``~/.cache/tritonrec/...``."""
    return Path.home() / ".cache" / "tritonrec" / f"planner_calibration_{compute_device}.json"


def load_perf_coefficients(path: str | Path | None = None, compute_device: str = "cpu") -> PerfCoefficients:
    """Coefficients from ``path``, else ``$TRITONREC_PLANNER_CALIBRATION``, else the default file, else
    :data:`DEFAULT_COEFFICIENTS` (see module docstring). An explicit path that does not exist is an error; a file
    measured on another device type is one too."""
    if compute_device not in DEFAULT_COEFFICIENTS:
        raise ValueError(f"compute_device must be 'cpu' or 'cuda', got compute_device={compute_device!r}")
    explicit = path if path is not None else os.environ.get(ENV_VAR) or None
    candidate = Path(explicit) if explicit is not None else default_calibration_path(compute_device)
    if not candidate.is_file():
        if explicit is not None:
            raise FileNotFoundError(f"calibration file {str(candidate)!r} does not exist")
        return DEFAULT_COEFFICIENTS[compute_device]
    try:
        data = json.loads(candidate.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"calibration file {str(candidate)!r} is not valid JSON: {err}") from None
    coefficients = PerfCoefficients.from_json(data, source=f"calibration file {str(candidate)!r}")
    if coefficients.compute_device != compute_device:
        raise ValueError(
            f"calibration file {str(candidate)!r} was measured on {coefficients.compute_device}, "
            f"the topology computes on {compute_device}"
        )
    return coefficients
