"""How kvbench reports an exception in one line: bad input ends with one line on stderr (and exit code 2), and
messages that quote a library's error quote only its first line.

A module of its own below every package (tests/test_layers.py), so model loading, the run, the report, the bench
and the CLI all say it the same way.
"""

from __future__ import annotations


def error_line(e: BaseException, with_type: bool = False) -> str:
    """The first line of `e`'s message, surrounding whitespace stripped (a message that starts with blank lines
    gives its first non-blank one), or the exception's type name when the message is empty. `with_type`: prefixed
    with the type name, "ValueError: first line" (still just the type name for an empty message)."""
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    name = type(e).__name__
    if not first:
        return name
    return f"{name}: {first}" if with_type else first
