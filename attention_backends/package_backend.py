"""The shared base of attention backends that wrap an optional third-party package.

flash_attn, flashinfer, ipex and pallas each call into a package that is installed only on some
machines. They must still load everywhere (plugin discovery imports every built-in backend), and
where the package is missing they must say so through `probe`/`validate` rather than raise, so
that backend selection passes over them with a readable reason. The try-import-and-describe
logic and the "check the machine only once everything else fits" order live here, once; each
backend keeps its capability declaration, what it imports, and its own machine checks.
"""
from __future__ import annotations

import importlib
from typing import ClassVar, Optional

from .interface import AttentionBackend, AttentionConfig


class PackageBackend(AttentionBackend):
    """An AttentionBackend that can run only where `package` (and what it needs of it) imports.

    Subclasses declare only the capabilities in which they differ from AttentionBackend's
    defaults (which include: GQA supported, no sliding window or soft-cap, KV cache "auto" only,
    no graph capture), so each declaration reads as what is particular to that kernel.
    """
    # The top-level module the backend wraps; the default `import_package` imports it.
    package: ClassVar[str] = ""
    # How the package is named in the "not importable" reason; None = `package`. Callers (the
    # attention-matrix harness, tests, users reading a selection error) match on this text.
    package_label: ClassVar[Optional[str]] = None

    @classmethod
    def import_package(cls) -> None:
        """Import everything `forward` will need, raising whatever the import raises.

        Override when the backend needs a name from inside the package: a package can import yet
        lack the kernel (an old or partial build), and that must count as missing too.
        """
        importlib.import_module(cls.package)

    @classmethod
    def probe(cls) -> Optional[str]:
        # Any exception, not only ImportError: a package built against another torch or CUDA
        # often fails at import with OSError/RuntimeError, and probe must never raise.
        try:
            cls.import_package()
        except Exception as exc:
            text = str(exc).strip().splitlines()
            return (f"{cls.package_label or cls.package} is not importable "
                    f"({type(exc).__name__}: {text[0] if text else ''})")
        return None

    @classmethod
    def validate(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate(config)
        # Only once the package imports and the config fits the declared capabilities: the
        # machine checks may touch the device (CUDA init), and on a config that cannot run
        # anyway they would only add noise to the list of reasons.
        if not reasons:
            reasons.extend(cls.runtime_reasons(config))
        return reasons

    @classmethod
    def runtime_reasons(cls, config: AttentionConfig) -> list[str]:
        """Why this machine cannot run `config` although the package imports and the config is
        supported (no device present, too old a GPU, an environment variable unset). Override."""
        return []
