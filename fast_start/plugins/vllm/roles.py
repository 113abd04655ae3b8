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


def tell(role: str) -> None:
    """Tell the daemon of each lease this process holds that its engine is now `role`."""
    for weights in _held:
        tell_role(weights, role)
