"""Every bad input of the comm layer raises the right exception type with a message naming the argument and the
offending value: the process-group-bound entries on 2 gloo ranks (bad_input_cases.py), the others in-process."""

from __future__ import annotations

import logging

import pytest

from tests.distributed.bad_input_cases import BAD_CASES, WORLD, BadCase
from tests.distributed.spawned import suite_results
from tritonrec.dist.comm import get_local_rank, get_local_size, get_num_groups, is_leader
from tritonrec.dist.comm_checks import check_codecs, check_size_table, check_sizes, resolve_group
from tritonrec.dist.comm_timeout import collective_timeout, get_collective_timeout, set_collective_timeout

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("case", BAD_CASES, ids=[case.name for case in BAD_CASES])
def test_bad_input_on_ranks(case: BadCase) -> None:
    for rank, outcomes in enumerate(suite_results("bad_input", WORLD)):
        error_name, message = outcomes[case.name]
        assert error_name == case.error.__name__, f"rank {rank}: raised {error_name}: {message}"
        for fragment in case.fragments:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"


@pytest.mark.parametrize(
    ("call", "error", "fragments"),
    [
        (lambda: set_collective_timeout(-1), ValueError, ("seconds must be a positive finite number", "seconds=-1")),
        (lambda: set_collective_timeout(float("inf")), ValueError, ("seconds=inf",)),
        (lambda: set_collective_timeout("5"), ValueError, ("seconds='5'",)),
        (lambda: check_sizes(3, "splits"), TypeError, ("splits must be a list of ints", "int: 3")),
        (lambda: check_sizes([1, True], "splits"), TypeError, ("splits[1] must be an int", "splits[1]=True")),
        (lambda: check_size_table([[1], 2], "table", 2), TypeError, ("table[1] must be a list of ints", "int: 2")),
        (lambda: check_codecs("fp16"), TypeError, ("codecs must be QuantizedCommCodecs",)),
        (lambda: resolve_group(None), ValueError, ("group is None and torch.distributed is not initialised",)),
        (
            lambda: is_leader(None, leader_rank=-1),
            ValueError,
            ("leader_rank must be a non-negative int", "leader_rank=-1"),
        ),
        (lambda: get_local_size(world_size=0), ValueError, ("world_size must be an int >= 1", "world_size=0")),
        (lambda: get_local_rank(world_size=2, rank=-1), ValueError, ("rank must be an int >= 0", "rank=-1")),
    ],
)
def test_bad_input_in_process(call: object, error: type, fragments: tuple[str, ...]) -> None:
    with pytest.raises(error) as raised:
        call()  # type: ignore[operator]
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_local_size_env_that_does_not_divide_the_world_falls_back_to_one_node(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrec's get_local_size: warn and use the whole world (one node)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for raw in ("3", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", raw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tritonrec.dist.comm"):
            assert get_local_size(world_size=4) == 4
        assert f"LOCAL_WORLD_SIZE={raw} does not divide the world size 4; falling back to one node" in caplog.text
        assert get_local_rank(world_size=4, rank=3) == 3 and get_num_groups(world_size=4) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert get_local_size(world_size=4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE must be an int, got LOCAL_WORLD_SIZE='two'"):
        get_local_size(world_size=4)


def test_collective_timeout_context_restores() -> None:
    assert get_collective_timeout() is None
    with collective_timeout(2.5):
        assert get_collective_timeout() == 2.5
    assert get_collective_timeout() is None
