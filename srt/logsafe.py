"""Log lines that user input cannot forge or corrupt.

`escape` writes control characters (C0 but tab, DEL, C1, U+2028/U+2029) as `\\xNN` / `\\uNNNN`.
`SafeFormatter` applies it to every formatted record, newlines included except that a newline of
a multi-line record (a traceback, a child's start-up error) is kept and the line after it is
indented: a record can never produce a line that passes for a record of its own.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _code(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape(text: str) -> str:
    """`text` with every control character (newlines too) written as an escape."""
    return _CONTROL.sub(_code, text)


class SafeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = _CONTROL_BUT_NEWLINE.sub(_code, super().format(record))
        return text.replace("\n", "\n    ")
