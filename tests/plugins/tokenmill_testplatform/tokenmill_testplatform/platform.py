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

    def decode_programs(self) -> list[str]:
        return ["none"]

    def decode_program(self, config):
        from tokenmill.platforms.interface import DecodeProgram, choose_decode_program
        choose_decode_program(config, self.name, self.decode_programs(), "none")
        return DecodeProgram()
