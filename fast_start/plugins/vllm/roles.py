"""An engine's role, told to its daemon: serving, or a standby asleep in vLLM's sleep mode.

The supervisor's standby (`fast_start.standby`) puts its second engine to sleep and wakes it when
the serving engine dies. Each worker tells the daemon of each lease it holds what its engine does
(`client.tell_role`): standby once asleep, waking as it wakes, serving once awake. So `fast-start
status` shows every engine's role, and the daemon times each failover from the serving engine's
death to the standby awake (`leases.Leases.assign`).
"""
from __future__ import annotations

from ...client import Weights, tell_role

_held: list[Weights] = []       # this process's cache weights (a draft's too)


def holding(weights: Weights) -> None:
    """This process holds `weights`' lease: its role is told from now on."""
    _held.append(weights)


def wrap(worker) -> None:
    """The worker class's `sleep` and `wake_up`, each followed (or preceded) by the role it gives."""
    worker.sleep = _telling(worker.sleep, after="standby")
    worker.wake_up = _telling(worker.wake_up, before="waking", after="serving")


def _tell(role: str) -> None:
    for weights in _held:
        tell_role(weights, role)


def _telling(method, after: str, before: str = ""):
    def told(self, *args, **kwargs):
        if before:
            _tell(before)
        result = method(self, *args, **kwargs)
        _tell(after)
        return result
    return told
