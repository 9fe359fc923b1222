"""Which rules of a grammar can never finish (no finite string derives from them).

A grammar such as `root ::= "(" root ")"`, or a JSON schema whose required property refers back
to the schema itself, admits no finite output, yet xgrammar compiles it, and its jump-forward
search (`find_jump_forward_string`) then follows the one forced path forever, growing without
bound. So every grammar is checked before it is compiled: all rules reachable from `root` must
be productive.

Input is xgrammar's normalized grammar text (`str(xgrammar.Grammar)`): one rule per line,
`name ::= body`, the body made of string literals, character classes, rule names, parentheses,
`|`, the postfix operators `*`, `+`, `?`, `{m, n}` (n = -1: unbounded), built-in terminals such as
`Regex("...", json_string=true)` (a JSON schema's `pattern`), and an optional lookahead
`(= ...)` at the end, which constrains what may follow but derives nothing and is skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r'''
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<call>[A-Za-z_]\w*\((?:"(?:[^"\\]|\\.)*"|[^()"])*\))
  | (?P<look>\(=)
  | (?P<rep>\{\s*(?P<lo>-?\d+)\s*(?:,\s*(?P<hi>-?\d+)\s*)?\})
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<op>[()|*+?])
  | (?P<ws>\s+)
''', re.VERBOSE)


@dataclass
class _Node:
    """kind: "lit" (always productive), "ref" (a rule), "seq" (all), "alt" (any),
    "opt" (optional: always productive), "rep1" (at least one of `items[0]`)."""

    kind: str
    name: str = ""
    items: list["_Node"] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks: list[tuple[str, str, str | None]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ValueError(f"cannot read the grammar at {text[pos:pos + 20]!r}")
            pos = m.end()
            kind = m.lastgroup
            if kind == "ws":
                continue
            if kind in ("lo", "hi"):
                kind = "rep"
            self.toks.append((kind, m.group(0), m.group("lo")))
        self.i = 0

    def peek(self) -> tuple[str, str, str | None] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def alt(self) -> _Node:
        options = [self.seq()]
        while (t := self.peek()) is not None and t[1] == "|":
            self.i += 1
            options.append(self.seq())
        return options[0] if len(options) == 1 else _Node("alt", items=options)

    def seq(self) -> _Node:
        items = []
        while (t := self.peek()) is not None and t[1] not in ("|", ")") and t[0] != "look":
            items.append(self.postfix())
        return _Node("seq", items=items)

    def postfix(self) -> _Node:
        node = self.atom()
        while (t := self.peek()) is not None and (t[1] in ("*", "+", "?") or t[0] == "rep"):
            self.i += 1
            if t[1] == "+" or (t[0] == "rep" and int(t[2] or 0) > 0):
                node = _Node("rep1", items=[node])
            else:
                node = _Node("opt", items=[node])
        return node

    def atom(self) -> _Node:
        t = self.peek()
        if t is None:
            raise ValueError("the grammar ends inside a rule")
        self.i += 1
        if t[0] in ("str", "cls", "call"):
            return _Node("lit")
        if t[0] == "name":
            return _Node("ref", name=t[1])
        if t[1] == "(":
            inner = self.alt()
            if (c := self.peek()) is None or c[1] != ")":
                raise ValueError("unbalanced parentheses in the grammar")
            self.i += 1
            return inner
        raise ValueError(f"unexpected {t[1]!r} in the grammar")


def _parse(grammar_text: str) -> dict[str, _Node]:
    rules: dict[str, _Node] = {}
    for line in grammar_text.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition("::=")
        if not sep:
            raise ValueError(f"not a rule: {line[:40]!r}")
        rules[name.strip()] = _Parser(body).alt()  # a trailing lookahead is left unread
    return rules


def _refs(node: _Node) -> list[str]:
    if node.kind == "ref":
        return [node.name]
    return [r for item in node.items for r in _refs(item)]


def _productive(node: _Node, known: set[str]) -> bool:
    if node.kind in ("lit", "opt"):
        return True
    if node.kind == "ref":
        return node.name in known
    if node.kind == "alt":
        return any(_productive(i, known) for i in node.items)
    return all(_productive(i, known) for i in node.items)  # seq, rep1


def unproductive_rules(grammar_text: str, root: str = "root") -> list[str]:
    """The rules reachable from `root` from which no finite string derives, in grammar order
    (empty: every reachable rule can finish). Raises ValueError for text it cannot read."""
    rules = _parse(grammar_text)
    if root not in rules:
        raise ValueError(f"the grammar has no {root!r} rule")
    reachable, todo = {root}, [root]
    while todo:
        for ref in _refs(rules[todo.pop()]):
            if ref in rules and ref not in reachable:
                reachable.add(ref)
                todo.append(ref)
    known: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name in reachable - known:
            if _productive(rules[name], known):
                known.add(name)
                changed = True
    return [name for name in rules if name in reachable and name not in known]
