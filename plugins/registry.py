"""The one loader of every extension point: stevedore over each kind's entry-point group.

Every entry point is checked (imports, subclasses the kind's interface, states the kind's API
version, does not take a name already taken) and reported, loaded or refused and why. Nothing
is fatal: a refused extension is logged once and left out. Built-ins (distribution "tokenmill")
are ordered first, so they win name clashes; other packages follow in name order.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from .kinds import HOOK_GROUP, KINDS, RETIRED_GROUP

logger = logging.getLogger("tokenmill.plugins")

BUILTIN_PACKAGE = "tokenmill"
UNKNOWN_PACKAGE = "unknown distribution"


@dataclass
class ExtensionReport:
    """One entry point of one kind, as `tokenmill plugins` shows it."""
    name: str
    kind: str
    entry_point: str                  # "module:Attr"
    package: str                      # the declaring distribution; "tokenmill" for built-ins
    package_version: str
    api_version: Optional[int] = None
    state: str = "refused"            # "loaded" or "refused"
    reason: str = ""                  # why refused
    detail: str = ""                  # extra facts (a hook subscriber's hooks, ...)

    @property
    def loaded(self) -> bool:
        return self.state == "loaded"

    @property
    def builtin(self) -> bool:
        return self.package == BUILTIN_PACKAGE

    def to_dict(self) -> dict[str, Any]:
        # `version` and `loaded` spelled out too: what a script reading `--json` looks for first.
        return {**asdict(self), "version": self.package_version, "loaded": self.loaded}


def error_text(exc: BaseException) -> str:
    """One line naming the exception: what a report shows."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _canonical(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


@functools.lru_cache(maxsize=None)
def _declaring_packages() -> dict[tuple[str, str, str], tuple[str, str]]:
    """(group, name, value) -> (distribution, version). stevedore's cached entry points carry no
    distribution, so it is looked up in the installed metadata."""
    groups = {kind.group for kind in KINDS.values()} | {HOOK_GROUP, RETIRED_GROUP}
    found: dict[tuple[str, str, str], tuple[str, str]] = {}
    for dist in importlib.metadata.distributions():
        try:
            ours = [ep for ep in dist.entry_points if ep.group in groups]
            if not ours:     # parsing every installed METADATA file would slow start-up visibly
                continue
            name, version = dist.metadata["Name"] or UNKNOWN_PACKAGE, dist.version or "?"
            for ep in ours:
                found.setdefault((ep.group, ep.name, ep.value), (name, version))
        except Exception:   # a broken installed distribution must not break discovery
            continue
    return found


def package_of(group: str, name: str, value: str) -> tuple[str, str]:
    package, version = _declaring_packages().get((group, name, value), (UNKNOWN_PACKAGE, "?"))
    return (BUILTIN_PACKAGE if _canonical(package) == BUILTIN_PACKAGE else package), version


def _extensions(group: str) -> tuple[list[tuple[Any, Any]], list[tuple[Any, BaseException]]]:
    """Loaded (entry_point, object) pairs and (entry_point, error) failures of one group.
    The one place entry points are read (tests replace it to add fake ones)."""
    from stevedore import ExtensionManager

    failures: list[tuple[Any, BaseException]] = []

    def on_failure(_manager, entrypoint, exc):
        failures.append((entrypoint, exc))

    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=on_failure)
    return [(ext.entry_point, ext.plugin) for ext in manager.extensions], failures


def _report(kind: str, group: str, ep: Any) -> ExtensionReport:
    package, version = package_of(group, ep.name, ep.value)
    return ExtensionReport(name=ep.name, kind=kind, entry_point=ep.value, package=package,
                           package_version=version)


@functools.lru_cache(maxsize=None)
def _load_kind(kind_name: str) -> tuple[dict[str, Any], tuple[ExtensionReport, ...]]:
    kind = KINDS[kind_name]
    loaded, failures = _extensions(kind.group)
    candidates: list[tuple[ExtensionReport, Any]] = []
    for ep, exc in failures:
        report = _report(kind.name, kind.group, ep)
        report.reason = f"failed to import {ep.value}: {error_text(exc)}"
        candidates.append((report, None))
    for ep, obj in loaded:
        report = _report(kind.name, kind.group, ep)
        try:
            report.api_version, problem = kind.check(obj)
        except Exception as exc:   # the kind's interface itself failed to import
            problem = f"cannot check it: {error_text(exc)}"
        report.reason = problem or ""
        candidates.append((report, None if problem else obj))
    candidates.sort(key=lambda c: (not c[0].builtin, _canonical(c[0].package), c[0].name))
    objects: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for report, obj in candidates:
        if obj is not None and report.name in objects:
            obj, report.reason = None, (f"name clash: {kind.name} {report.name!r} is already provided "
                                        f"by {owners[report.name]}")
        if obj is None:
            logger.warning("%s %r (%s) refused: %s", kind.name, report.name, report.package, report.reason)
            continue
        report.state = "loaded"
        objects[report.name] = obj
        owners[report.name] = report.package
    return objects, tuple(report for report, _ in candidates)


def load(kind: str) -> dict[str, Any]:
    """name -> loaded object (a class) of one kind; refused entries left out (see reports)."""
    return dict(_load_kind(kind)[0])


def reports(kind: str) -> list[ExtensionReport]:
    """Every entry point of one kind, loaded or refused, in precedence order."""
    return [replace(r) for r in _load_kind(kind)[1]]   # copies: the cache stays


def refused(kind: str) -> dict[str, str]:
    """name -> why, for the entry points of one kind that were refused (first reason per name)."""
    out: dict[str, str] = {}
    for r in _load_kind(kind)[1]:
        if not r.loaded:
            out.setdefault(r.name, r.reason)
    return out


@functools.lru_cache(maxsize=None)
def retired_reports() -> tuple[ExtensionReport, ...]:
    """What is still registered under the retired `tokenmill.plugins` group: refused, with where
    it belongs now (its entry points are not even imported)."""
    from importlib.metadata import entry_points

    out = []
    for ep in entry_points(group=RETIRED_GROUP):
        report = _report("retired", RETIRED_GROUP, ep)
        report.reason = ("the tokenmill.plugins group is no longer read: register each extension under its "
                         "own group (tokenmill.attention_backends, tokenmill.model_architectures, ...) and "
                         "hook implementations under tokenmill.hooks")
        logger.warning("%s (%s): %s", ep.name, report.package, report.reason)
        out.append(report)
    return tuple(out)


def clear_caches() -> None:
    """Forget what was discovered (after installing a plugin into a running process; tests)."""
    from stevedore import ExtensionManager

    importlib.invalidate_caches()
    # stevedore keeps each group's entry points for the life of the process: forget ours.
    for group in [k.group for k in KINDS.values()] + [HOOK_GROUP]:
        ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    for cached in (_load_kind, _declaring_packages, retired_reports):
        cached.cache_clear()
