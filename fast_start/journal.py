"""The daemon's log: into the journal with priorities and fields where systemd runs it, else stderr.

Under systemd (stderr is the journal's stream: `JOURNAL_STREAM` names its device and inode) each
record goes through journald's native protocol with python-systemd's `journal` module (Debian's
python3-systemd), with its priority and the fields `FAST_START_GPU`, and where a line is about one
model `FAST_START_MODEL` and `FAST_START_FINGERPRINT` (pass them as `extra=fields(...)`): so that
`journalctl -p err -u fast-start@0` shows why a start failed, and alerts can filter by model.
Without that module each line is prefixed with its syslog priority (`<3>`), which journald reads
from a service's stderr. Elsewhere (a terminal, a test) lines are plain.

A message may quote what a client sent (a file name in its request): every record's message is
made one printable line of at most `MAX_MESSAGE` characters (`printable`), so that no peer can
forge a record (a newline and `<0>`), write control characters to a terminal, or flood the log.
"""
from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"
MAX_MESSAGE = 4096
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def priority(level: int) -> int:
    """The syslog priority of a logging level (levels between take the next more severe one)."""
    return next((p for lv, p in sorted(_PRIORITY.items()) if level <= lv), 2)


def under_journal() -> bool:
    """Whether stderr is the journal's stream, as systemd connects a service's."""
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return os.environ.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}"


def printable(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` as one line: control characters (newlines, NULs, escapes) written as escapes, and cut
    to `limit` characters, saying how many more there were."""
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text) - limit} more characters)"
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class _OneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = printable(record.getMessage()), ()
        return True


def fields(model: str, fingerprint: str = "") -> dict[str, str]:
    """A record's journal fields for one model (`log.info(..., extra=fields(name, digest))`)."""
    return {"FAST_START_MODEL": model, **({"FAST_START_FINGERPRINT": fingerprint} if fingerprint else {})}


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"      # on every line: journald reads each on its own
        return prefix + super().format(record).replace("\n", "\n" + prefix)


def setup(gpu: int | None = None) -> None:
    """The root logger's one handler, as above; `gpu` becomes every record's FAST_START_GPU."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in root.handlers[:]:
        root.removeHandler(h)
    handler: logging.Handler | None = None
    if under_journal():
        try:
            from systemd import journal
            handler = journal.JournalHandler(SYSLOG_IDENTIFIER="fast-start",
                                             **({"FAST_START_GPU": str(gpu)} if gpu is not None else {}))
            handler.setFormatter(logging.Formatter("%(message)s"))
        except ImportError:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(_Prefixed(FORMAT))
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_OneLine())
    root.addHandler(handler)


def error_line(text: str) -> str:
    """The CLI's one-line error as it goes to stderr: at priority err where that is the journal."""
    return f"<3>{text}" if under_journal() else text
