"""The errors fast-start raises.

Every error names the thing that is wrong and how to fix it: `str(err)` is one line an operator
can act on, and `err.fix` holds the fix alone. The CLI maps these classes to exit codes in one
place; anything that is not a `FastStartError` is a bug in fast-start.
"""
from __future__ import annotations


class FastStartError(Exception):
    """Base class: `what` is the problem, `fix` is what to do about it."""

    def __init__(self, what: str, fix: str = ""):
        self.what = what
        self.fix = fix
        super().__init__(f"{what} (fix: {fix})" if fix else what)


class ConfigError(FastStartError):
    """The config file (or the socket directory it names) is unusable; the message names the key."""


class CheckpointError(FastStartError):
    """A checkpoint folder, index, config.json or safetensors file is unusable."""


class QuantizationError(FastStartError):
    """A quantization method cannot be applied to this checkpoint or is not allowed."""


class ShardError(FastStartError):
    """A tensor cannot be cut for the requested tensor-parallel layout."""


class ArenaError(FastStartError):
    """An arena or its manifest is inconsistent, or cannot be created or mapped."""


class LoadError(FastStartError):
    """Weights do not fit the module they are loaded into."""


class CacheMiss(FastStartError):
    """The cache could not serve a fetch and fallback was disabled.

    `fields` lists the fingerprint fields that differ (empty when the reason is something else,
    such as no daemon).
    """

    def __init__(self, what: str, fix: str = "", fields: tuple[str, ...] = ()):
        super().__init__(what + (f"; differing fields: {', '.join(fields)}" if fields else ""), fix)
        self.what, self.fields = what, tuple(fields)


class NoDaemon(FastStartError):
    """No daemon could be reached (or trusted) where one was expected."""


class Refused(NoDaemon):
    """A daemon runs but does not let this user in (or not for this request)."""


class StartError(FastStartError):
    """The daemon could not start, for a reason it names that a restart would not cure (another
    daemon holds the GPU, a fill worker that cannot run): the unit ends failed, not restarting."""


class NoRoom(FastStartError):
    """The device has too little free memory for a fill; `short` is by how many bytes."""

    def __init__(self, what: str, fix: str, short: int):
        super().__init__(what, fix)
        self.short = short


def is_config(e: FastStartError) -> bool:
    """Whether `e` says the configuration asks for what cannot be: a TP size the model does not
    divide into, a quantization it cannot take, more than the budget. Restarting cannot help."""
    return isinstance(e, (ConfigError, ShardError, QuantizationError))
