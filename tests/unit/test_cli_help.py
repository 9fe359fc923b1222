"""`python -m srt.server --help` prints every flag with its help text (argparse formats help
strings with %, so a literal one must not break it)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from srt.server_args import ServerArgs


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="srt.server")
    ServerArgs.add_cli_args(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(ServerArgs):
        if f.metadata.get("cli") is not False:
            assert "--" + f.name.replace("_", "-") in out, f.name
    assert "0.9% of long-prompt throughput" in " ".join(out.split())
