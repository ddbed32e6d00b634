"""`testcpu`: a platform that runs on the CPU under its own name, with its own attention backend."""
from __future__ import annotations

import os

from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.interface import Availability


class TestCpuPlatform(CpuPlatform):
    """Third-party test platform: the CPU under another name, with the testcpu_paged backend."""
    name = "testcpu"
    torch_device = "cpu"
    priority = -10           # never chosen by --device auto over the real cpu platform
    dispatch_key = "cpu"     # attention backends that support "cpu" apply

    @classmethod
    def probe(cls) -> Availability:
        return Availability.yes(f"runs on the CPU ({os.cpu_count()} cores), from tokenmill-testplatform")

    def attention_backends(self) -> list[str]:
        return ["testcpu_paged"]

    def graph_capture_strategies(self) -> list[str]:
        return ["none"]

    def graph_capture(self, config):
        from tokenmill.platforms.interface import GraphCapture, choose_graph_capture
        choose_graph_capture(config, self.name, self.graph_capture_strategies(), "none")
        return GraphCapture()
