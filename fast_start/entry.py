"""A cached model shard as the daemon holds it: its arena fds, manifest and checkpoint identity,
and what it takes to send it (the tensor table, encoded once)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from . import table, watch
from .config import ModelConfig
from .manifest import Manifest


@dataclass
class Entry:
    model: ModelConfig
    manifest: Manifest
    fds: list[int]
    fill_seconds: float
    files: watch.Identity                               # the checkpoint files' identity at the fill
    filled_at: float = field(default_factory=time.time)
    names: list[str] = field(default_factory=list)     # its FDNAMEs in systemd's fd store
    pins: int = 0                                       # replies carrying its fds being sent
    retired: bool = False                               # evicted: fds close with the last pin
    adopted: bool = False                               # taken back from systemd's fd store, not filled

    def __post_init__(self):
        # Encoded once, sent to every engine: the tensor table and the rest of the manifest.
        self.manifest_dict = self.manifest.to_dict()
        self.table = table.encode(self.manifest)
        self.head = {k: v for k, v in self.manifest_dict.items() if k != "tensors"}

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.manifest.arenas)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)       # engines that mapped it keep it alive until they exit
        self.fds = []
