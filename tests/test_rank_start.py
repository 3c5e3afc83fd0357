"""Ranks forked from the rank server see the launcher's environment of their launch, and a failed
run blames the rank that failed, not the peer that lost it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from testbed.faults import NonFiniteLoss
from testbed.launch import rank_server
from testbed.launch.job import blame, failure_cause
from testbed.launch.spawn import RankFailure, spawn_world
from testbed.ps.client import PsError
from testbed.rank_failure import lost_peer, record_failure, root_cause
from testbed.stall import StallError


def environment_of_rank(keys: list[str]) -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in keys}


def test_forked_ranks_see_each_launchs_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ["TESTBED_PROBE", "TESTBED_JOB", "RANK", "WORLD_SIZE"]
    monkeypatch.setenv("TESTBED_PROBE", "first")
    first = spawn_world(environment_of_rank, (keys,), 2, tmp_path / "a", env={"TESTBED_JOB": "a"})
    # The server started with the first launch; a later change must still reach the ranks.
    monkeypatch.setenv("TESTBED_PROBE", "second")
    second = spawn_world(environment_of_rank, (keys,), 2, tmp_path / "b")
    assert [first[r] for r in (0, 1)] == [
        {"TESTBED_PROBE": "first", "TESTBED_JOB": "a", "RANK": str(r), "WORLD_SIZE": "2"} for r in (0, 1)
    ]
    assert [second[r] for r in (0, 1)] == [
        {"TESTBED_PROBE": "second", "TESTBED_JOB": None, "RANK": str(r), "WORLD_SIZE": "2"} for r in (0, 1)
    ]
    assert os.environ.get("TESTBED_JOB") is None, "a launch's additions are the ranks' alone"


@pytest.mark.unit
def test_adopting_the_launchers_environment_keeps_what_the_agent_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_server, "SERVER_ENVIRON", {"PATH": "/bin", "STALE": "1"})
    monkeypatch.setattr(os, "environ", {"PATH": "/bin", "STALE": "1", "RANK": "3"})  # the agent added RANK
    rank_server.adopt_environment({"PATH": "/usr/bin", "FRESH": "2"})
    assert os.environ == {"PATH": "/usr/bin", "FRESH": "2", "RANK": "3"}


@pytest.mark.unit
def test_the_root_cause_is_the_earliest_failure_that_is_not_a_lost_peer(tmp_path: Path) -> None:
    reset = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:9424: Connection reset by peer"
    assert lost_peer(reset) and lost_peer("OSError: [Errno 32] Broken pipe") and not lost_peer("NonFiniteLoss: nan")
    assert root_cause(tmp_path) is None
    record_failure(tmp_path, 0, RuntimeError(reset.split(": ", 1)[1]))
    assert root_cause(tmp_path) is None, "a lost peer's report is never the cause"
    record_failure(tmp_path, 2, ValueError("later"))
    record_failure(tmp_path, 1, ValueError("first"))
    facts = {r: json.loads((tmp_path / f"failure-rank{r}.json").read_text()) for r in (1, 2)}
    facts[1]["time"] = facts[2]["time"] - 1.0  # rank 1 failed a second before rank 2
    (tmp_path / "failure-rank1.json").write_text(json.dumps(facts[1]))
    assert root_cause(tmp_path) == {**facts[1], "message": "ValueError: first"}


@pytest.mark.unit
def test_a_failures_kind_and_facts_come_from_its_class(tmp_path: Path) -> None:
    record_failure(tmp_path, 1, NonFiniteLoss("rank 1: loss is nan at step 3"))
    record_failure(tmp_path, 2, PsError(1, "127.0.0.1:7000", "Push: UNAVAILABLE: timeout while connecting"))
    record_failure(tmp_path, 3, StallError(4, [0], {0: 3}, RuntimeError("Timed out waiting 8000ms for recv")))
    record_failure(tmp_path, 4, ValueError("optimizer refused the step"))
    record_failure(tmp_path, 5, RuntimeError("[unbound_buffer.cc:78] Timed out waiting 2000ms for recv"))

    def error(rank: int, message: str = "exited with code 1") -> dict:
        return failure_cause(blame(tmp_path, RankFailure(rank, message)))

    assert error(1)["kind"] == "nonfinite_loss" and error(1)["message"] == "NonFiniteLoss: rank 1: loss is nan at step 3"
    assert error(2) == {"message": "PsError: ps shard 1 at 127.0.0.1:7000: Push: UNAVAILABLE: timeout while connecting",
                        "rank": 2, "kind": "parameter_server", "shard": 1}  # not a timeout: a lost shard
    stall = error(3)
    assert (stall["kind"], stall["rank"], stall["missing"], stall["reporter"]) == ("stall", 0, [0], 3)
    assert error(4)["kind"] == "error" and error(5)["kind"] == "timeout"
    killed = failure_cause(blame(tmp_path, RankFailure(6, "killed by signal SIGKILL (pid 1)", killed=True)))
    assert killed == {"message": "killed by signal SIGKILL (pid 1)", "rank": 6, "kind": "killed"}
    lost = "PsError: ps shard 0 at 127.0.0.1:7001: Push: UNAVAILABLE: Connection reset by peer (104)"
    record_failure(tmp_path / "ps", 0, PsError(0, "127.0.0.1:7001", "Push: UNAVAILABLE: Connection reset by peer (104)"))
    alone = failure_cause(blame(tmp_path / "ps", RankFailure(0, lost)))  # no other cause: its own record
    assert (alone["kind"], alone["shard"]) == ("parameter_server", 0)
    unrecorded = error(7, "SyntaxError: bad")  # no record of its own: the agent's word, an error
    assert (unrecorded["kind"], unrecorded["message"]) == ("error", "SyntaxError: bad")
