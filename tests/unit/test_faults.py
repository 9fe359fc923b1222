"""SRT_FAULT parsing, when a fault point fires, and where the setting comes from."""

from __future__ import annotations

import time

import pytest

from srt.faults import FaultPoint, FaultSpec, InjectedFault, fault_point
from srt.server_args import ServerArgs
from srt.watchdog import Heartbeat


@pytest.mark.parametrize("text,expected", [
    ("router:raise", FaultSpec("router", "raise", 0)),
    ("model:exit:7", FaultSpec("model0", "exit", 7)),
    ("model1:stall:0", FaultSpec("model1", "stall", 0)),
    ("http:raise:3", FaultSpec("http", "raise", 3)),
    ("detokenizer:exit", FaultSpec("detokenizer", "exit", 0)),
])
def test_parse(text: str, expected: FaultSpec) -> None:
    assert FaultSpec.parse(text) == expected


@pytest.mark.parametrize("text", ["router", "router:crash", "gpu:raise", "router2:raise",
                                  "model:raise:-1", "model:raise:x", "a:b:c:d", ""])
def test_parse_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="SRT_FAULT"):
        FaultSpec.parse(text)


def test_fires_once_after_n_units() -> None:
    point = fault_point("router:raise:2", "router")
    point.tick()
    point.tick()
    with pytest.raises(InjectedFault):
        point.tick()
    point.tick()  # fired once; later units run normally


def test_other_processes_get_no_fault() -> None:
    for process in ("http", "detokenizer", "model0", "model1"):
        assert fault_point("router:raise", process).spec is None
    assert fault_point(None, "router").spec is None
    assert fault_point("model1:exit", "model1").spec == FaultSpec("model1", "exit", 0)
    FaultPoint(None).tick()  # no fault: nothing happens


def test_server_args_read_srt_fault_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SRT_FAULT", "detokenizer:stall:5")
    args = ServerArgs(model_path="/m").resolve()
    assert args.fault == "detokenizer:stall:5"
    monkeypatch.setenv("SRT_FAULT", "nonsense")
    with pytest.raises(ValueError, match="SRT_FAULT"):
        ServerArgs(model_path="/m").resolve()
    # not a command-line flag
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--fault", "router:raise"])


def test_heartbeat_ages_and_beats() -> None:
    hb = Heartbeat()
    time.sleep(0.05)
    assert hb.age() >= 0.05
    hb.beat()
    assert hb.age() < 0.05
