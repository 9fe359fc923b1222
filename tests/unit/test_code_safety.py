"""Fails the build if srt/ uses pickle (or a pickle-based loader), eval/exec, pyzmq's pickling
send/recv, or torch.load without weights_only=True: each turns data into code."""

from __future__ import annotations

import ast
import os

SRT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "srt")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve",
                  "marshal"}
BANNED_CALLS = {"eval", "exec", "send_pyobj", "recv_pyobj", "loads_pyobj"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def violations(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLE_MODULES:
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            last = name.rsplit(".", 1)[-1]
            kwargs = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec", "builtins.eval", "builtins.exec") or (
                    last in BANNED_CALLS and last not in ("eval", "exec")):
                found.append(f"{where}: {name}(...)")
            if name == "torch.load" or name.endswith(".torch.load"):
                if not _true(kwargs.get("weights_only")):
                    found.append(f"{where}: torch.load without weights_only=True")
            if last == "load" and name.split(".")[0] in ("np", "numpy") and _true(
                    kwargs.get("allow_pickle")):
                found.append(f"{where}: numpy load with allow_pickle=True")
    return found


def test_scanner_finds_each_pattern() -> None:
    bad = """
import pickle
from cloudpickle import loads
import torch
x = eval(s)
exec(code)
sock.recv_pyobj()
torch.load(path)
torch.load(path, weights_only=False)
np.load(f, allow_pickle=True)
"""
    found = violations(bad, "bad.py")
    assert len(found) == 8, found
    good = "import torch\nm = model.eval()\nw = torch.load(p, weights_only=True)\n"
    assert violations(good, "good.py") == []


def test_srt_has_no_code_from_data() -> None:
    found = []
    for root, _, files in os.walk(SRT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    found += violations(fh.read(), os.path.relpath(path, SRT))
    assert not found, "\n".join(found)
