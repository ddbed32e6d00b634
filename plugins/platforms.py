"""Platform discovery and resolution on top of the registry: probe, describe, choose one.

The registry has already refused what failed to import, is not a Platform or speaks another
API version; here every loaded platform is probed (a probe that raises counts as unavailable)
and described, and `resolve_platform` picks the one `--device` names, or for "auto" the
available one of highest priority, logging why each other one was passed over.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass
from typing import Any, Optional

from . import registry

logger = logging.getLogger("tokenmill.plugins")

BUILTIN_ORIGIN = "built-in"


@dataclass
class PlatformReport:
    """One discovered platform entry point, usable or not."""
    name: str
    origin: str                       # "built-in" or the distribution name
    entry_point: str                  # "module:Class"
    api_version: Optional[int] = None
    priority: Optional[int] = None
    available: bool = False
    reason: str = ""                  # why not available (or detail when available)
    description: Optional[dict[str, Any]] = None   # Platform.describe()
    load_error: Optional[str] = None  # set when the registry refused it

    @property
    def usable(self) -> bool:
        return self.load_error is None and self.available

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def safe_probe(cls: type) -> tuple[bool, str]:
    """(available, reason) from cls.probe(); a probe that raises is reported, not propagated."""
    try:
        availability = cls.probe()
        return bool(availability.available), str(availability.reason)
    except Exception as exc:
        return False, f"probe raised {registry.error_text(exc)}"


def safe_describe(cls: type) -> dict[str, Any]:
    try:
        return dict(cls().describe())
    except Exception as exc:
        return {"error": f"describe() raised {registry.error_text(exc)}"}


@functools.lru_cache(maxsize=None)
def _platform_table() -> tuple[PlatformReport, ...]:
    classes = registry.load("platform")
    out = []
    for ext in registry.reports("platform"):
        report = PlatformReport(name=ext.name, origin=BUILTIN_ORIGIN if ext.builtin else ext.package,
                                entry_point=ext.entry_point, api_version=ext.api_version)
        cls = classes.get(ext.name) if ext.loaded else None
        if cls is None:
            report.load_error = ext.reason
            report.reason = f"skipped: {ext.reason}"
        else:
            if getattr(cls, "name", "") and cls.name != ext.name:
                logger.warning("platform entry point %r names class %s whose name is %r; using %r",
                               ext.name, cls.__qualname__, cls.name, ext.name)
            report.priority = int(getattr(cls, "priority", 0))
            report.available, report.reason = safe_probe(cls)
            report.description = safe_describe(cls)
        out.append(report)
    return tuple(out)


def discover_platforms() -> list[PlatformReport]:
    """Every platform entry point found: loaded or not, available or not, and why."""
    return [PlatformReport(**r.to_dict()) for r in _platform_table()]   # copies: the cache stays


def platform_class(name: str) -> type:
    """The class registered for `name` (available or not); KeyError if none was loaded."""
    return registry.load("platform")[name]


def _why_not(report: PlatformReport) -> str:
    return report.load_error or f"unavailable: {report.reason}"


def resolve_platform(device: str = "auto") -> Any:
    """The platform instance for `device` ("auto" = highest-priority available).

    ValueError with the specific reason when the device is unknown, was refused, or is unavailable.
    """
    device = (device or "auto").strip()
    reports = _platform_table()
    classes = registry.load("platform")
    if device == "auto":
        usable = sorted((r for r in reports if r.usable), key=lambda r: -(r.priority or 0))
        if not usable:
            raise ValueError("no platform is available: " +
                             "; ".join(f"{r.name}: {_why_not(r)}" for r in reports))
        chosen = usable[0]
        passed = []
        for r in reports:
            if r is chosen:
                continue
            why = (_why_not(r) if not r.usable else
                   f"lower priority {r.priority} than {chosen.name}'s {chosen.priority}")
            passed.append(f"{r.name} ({why})")
        logger.info("device auto: chose %s (priority %s; %s); passed over: %s", chosen.name, chosen.priority,
                    chosen.reason, "; ".join(passed) or "nothing else")
        return classes[chosen.name]()
    matches = [r for r in reports if r.name == device]
    if not matches:
        known = sorted({r.name for r in reports})
        raise ValueError(f"unknown device {device!r}; discovered platforms: {', '.join(known)} (or 'auto')")
    report = next((r for r in matches if r.load_error is None), matches[0])
    if report.load_error:
        raise ValueError(f"device {device!r} ({report.origin}) cannot be used: {report.load_error}")
    if not report.available:
        raise ValueError(f"device {device!r} is not available: {report.reason}")
    return classes[device]()


def clear_caches() -> None:
    _platform_table.cache_clear()
