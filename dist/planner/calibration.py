"""The perf model's machine coefficients: how fast the lookup kernels and the collectives run here.

``python -m tritonrec.dist.planner.calibrate`` measures them and writes a JSON file (schema below);
:func:`load_perf_coefficients` reads it. Without a file the planner uses :data:`DEFAULT_COEFFICIENTS`, documented
values for a CPU host on gloo and a GPU on NCCL that are right to within a small factor on common machines.

Where the planner looks (first found wins): the path given (``Topology(calibration=...)``), the file named by
``$TRITONREC_PLANNER_CALIBRATION``, ``~/.cache/tritonrec/planner_calibration_<cpu|cuda>.json`` (what ``calibrate``
writes by default), then the defaults.

The model (see :mod:`~tritonrec.dist.planner.shard_estimators`): a lookup costs
``call_s + ids x id_s + bytes / bytes_per_s`` forward and again backward (the fused update), where ``bytes`` is ids x
shard columns x element size (the per-id term is what a column split does not divide: every column shard handles
every id); a collective costs ``latency_s + wire bytes / (link bandwidth x efficiency)``, where the link
bandwidth is the topology's ``intra_host_bw`` or ``inter_host_bw`` and ``efficiency`` is that collective's measured
bandwidth relative to all-to-all's (1.0 for all-to-all itself).

JSON schema (version 1)::

    {"version": 1, "compute_device": "cpu",
     "lookup": {"fwd_bytes_per_s": 2e9, "fwd_call_s": 5e-5, "fwd_id_s": 2e-8,
                "bwd_bytes_per_s": 1e9, "bwd_call_s": 1e-4, "bwd_id_s": 1e-7},
     "comms": {"all_to_all": {"latency_s": 1e-4, "bytes_per_s": 1e9}, "reduce_scatter": {...},
               "all_gather": {...}, "all_reduce": {...}},
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
COLLECTIVES = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")
SCHEMA_VERSION = 1

__all__ = [
    "COLLECTIVES",
    "DEFAULT_COEFFICIENTS",
    "ENV_VAR",
    "CommCoefficients",
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


@dataclass(frozen=True)
class LookupCoefficients:
    """Table-batched lookup cost: a fixed cost per call, a cost per id, and bytes of embedding rows per second."""

    fwd_bytes_per_s: float
    fwd_call_s: float
    bwd_bytes_per_s: float
    bwd_call_s: float
    fwd_id_s: float = 0.0
    bwd_id_s: float = 0.0


@dataclass(frozen=True)
class CommCoefficients:
    """One collective: fixed latency per call, and the per-rank wire bandwidth it reached."""

    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class PerfCoefficients:
    """Everything the perf model reads about the machine (see module docstring)."""

    compute_device: str
    lookup: LookupCoefficients
    comms: dict[str, CommCoefficients]
    inter_host_bw: float
    measured_on: dict[str, Any] = field(default_factory=dict)

    def efficiency(self, collective: str) -> float:
        """``collective``'s bandwidth relative to all-to-all's on this machine."""
        return self.comms[collective].bytes_per_s / self.comms["all_to_all"].bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "compute_device": self.compute_device,
            "lookup": dict(vars(self.lookup)),
            "comms": {name: dict(vars(c)) for name, c in self.comms.items()},
            "inter_host_bw": self.inter_host_bw,
            "measured_on": dict(self.measured_on),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "calibration") -> PerfCoefficients:
        """Parse and check a :meth:`to_json` dict; errors name ``source`` and the offending field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("version") != SCHEMA_VERSION:
            raise ValueError(f"{source}: version must be {SCHEMA_VERSION}, got {data.get('version')!r}")
        device = data.get("compute_device")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{source}: compute_device must be 'cpu' or 'cuda', got {device!r}")
        try:
            lookup_data, comms_data = data["lookup"], data["comms"]
            lookup = LookupCoefficients(
                fwd_bytes_per_s=_positive(f"{source}: lookup.fwd_bytes_per_s", lookup_data["fwd_bytes_per_s"]),
                fwd_call_s=_non_negative(f"{source}: lookup.fwd_call_s", lookup_data["fwd_call_s"]),
                bwd_bytes_per_s=_positive(f"{source}: lookup.bwd_bytes_per_s", lookup_data["bwd_bytes_per_s"]),
                bwd_call_s=_non_negative(f"{source}: lookup.bwd_call_s", lookup_data["bwd_call_s"]),
                fwd_id_s=_non_negative(f"{source}: lookup.fwd_id_s", lookup_data["fwd_id_s"]),
                bwd_id_s=_non_negative(f"{source}: lookup.bwd_id_s", lookup_data["bwd_id_s"]),
            )
            comms = {
                name: CommCoefficients(
                    latency_s=_non_negative(f"{source}: comms.{name}.latency_s", comms_data[name]["latency_s"]),
                    bytes_per_s=_positive(f"{source}: comms.{name}.bytes_per_s", comms_data[name]["bytes_per_s"]),
                )
                for name in COLLECTIVES
            }
            inter = _positive(f"{source}: inter_host_bw", data["inter_host_bw"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source}: missing or malformed field {err}") from None
        return cls(device, lookup, comms, inter, dict(data.get("measured_on", {})))

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
    # a few-core CPU host, torch twins, gloo over loopback TCP
    "cpu": PerfCoefficients(
        "cpu",
        LookupCoefficients(2e9, 5e-5, 1e9, 1e-4, fwd_id_s=2e-8, bwd_id_s=1e-7),
        _comms(1e-4, all_to_all=1e9, reduce_scatter=5e8, all_gather=1e9, all_reduce=5e8),
        inter_host_bw=1.25e9,  # 10 Gb/s Ethernet
        measured_on={"source": "documented defaults"},
    ),
    # one GPU per rank, Triton kernels, NCCL over NVLink inside a host
    "cuda": PerfCoefficients(
        "cuda",
        LookupCoefficients(1e12, 1e-5, 5e11, 2e-5, fwd_id_s=1e-11, bwd_id_s=5e-11),
        _comms(2e-5, all_to_all=1.5e11, reduce_scatter=1.5e11, all_gather=1.5e11, all_reduce=1.5e11),
        inter_host_bw=1.25e10,  # 100 Gb/s RDMA
        measured_on={"source": "documented defaults"},
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
