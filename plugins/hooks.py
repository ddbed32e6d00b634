"""The pluggy PluginManager of the lifecycle and config-validation hooks, and the two calls the
engine makes through it.

Registered, in this order: tokenmill's own subscribers (the config validator always; the
request log when TOKENMILL_LOG_REQUESTS=1), anything passed to `register_builtin`, then every
entry point of the group `tokenmill.hooks`. An entry point that fails to import, states another
`api_version` than HOOK_API_VERSION, or implements a hook not in hookspecs.py is refused and
reported, like any other extension.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import logging
import os
from typing import Any, Callable, Optional

import pluggy

from . import registry
from .hookspecs import HOOK_API_VERSION, HOOK_NAMES, PROJECT, RequestEvent, TokenmillHookSpecs
from .kinds import HOOK_GROUP

logger = logging.getLogger("tokenmill.plugins")

# Registered by code rather than by entry point: name -> object, kept across clear_caches().
_EXTRA_BUILTINS: dict[str, Any] = {}


def _default_builtins() -> dict[str, Any]:
    from .config_check import ConfigSanity
    from .request_log import RequestLog

    builtins: dict[str, Any] = {"config_sanity": ConfigSanity()}
    if os.environ.get("TOKENMILL_LOG_REQUESTS", "") == "1":   # not registered at all otherwise: zero cost
        builtins["request_log"] = RequestLog()
    return builtins


class _HookState:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(TokenmillHookSpecs)
        self.reports: list[registry.ExtensionReport] = []
        for name, obj in {**_default_builtins(), **_EXTRA_BUILTINS}.items():
            report = registry.ExtensionReport(name=name, kind="hook", entry_point=_describe(obj),
                                              package=registry.BUILTIN_PACKAGE, package_version=_tokenmill_version())
            self._register(report, obj)
        loaded, failures = registry._extensions(HOOK_GROUP)
        for ep, exc in failures:
            report = self._entry_report(ep)
            report.reason = f"failed to import {ep.value}: {registry.error_text(exc)}"
            self.reports.append(report)
        for ep, obj in loaded:
            self._register(self._entry_report(ep), obj)
        for report in self.reports:
            if not report.loaded:
                logger.warning("hook plugin %r (%s) refused: %s", report.name, report.package, report.reason)

    @staticmethod
    def _entry_report(ep: Any) -> registry.ExtensionReport:
        package, version = registry.package_of(HOOK_GROUP, ep.name, ep.value)
        return registry.ExtensionReport(name=ep.name, kind="hook", entry_point=ep.value, package=package,
                                        package_version=version)

    def _register(self, report: registry.ExtensionReport, obj: Any) -> None:
        self.reports.append(report)
        if self.pm.has_plugin(report.name):
            report.reason = f"name clash: hook plugin {report.name!r} is already registered"
            return
        try:
            plugin = obj() if inspect.isclass(obj) else obj
            stated = getattr(plugin, "api_version", HOOK_API_VERSION)
            report.api_version = stated
            if stated != HOOK_API_VERSION:
                report.reason = f"built for hook API version {stated}; this tokenmill speaks version {HOOK_API_VERSION}"
                return
            self.pm.register(plugin, name=report.name)
            unknown = sorted(hc.name for hc in (self.pm.get_hookcallers(plugin) or []) if hc.spec is None)
            if unknown:
                self.pm.unregister(plugin)
                report.reason = f"implements hooks this tokenmill does not define: {', '.join(unknown)}"
                return
        except Exception as exc:
            report.reason = f"failed to register: {registry.error_text(exc)}"
            return
        report.state = "loaded"
        hooks = [h for h in HOOK_NAMES
                 if any(i.plugin_name == report.name for i in getattr(self.pm.hook, h).get_hookimpls())]
        report.detail = "hooks: " + (", ".join(hooks) or "none")


def _describe(obj: Any) -> str:
    target = obj if inspect.isclass(obj) or inspect.ismodule(obj) else type(obj)
    return f"{target.__module__}:{target.__qualname__}" if inspect.isclass(target) else target.__name__


def _tokenmill_version() -> str:
    try:
        return importlib.metadata.version(registry.BUILTIN_PACKAGE)
    except importlib.metadata.PackageNotFoundError:   # run from a source tree, not installed
        return "?"


@functools.lru_cache(maxsize=None)
def _state() -> _HookState:
    return _HookState()


def plugin_manager() -> pluggy.PluginManager:
    """The PluginManager with every hook implementation registered."""
    return _state().pm


def hook_reports() -> list[registry.ExtensionReport]:
    return [dataclasses.replace(r) for r in _state().reports]


def register_builtin(obj: Any, name: str) -> None:
    """Register one of tokenmill's own hook implementations (a module, class or object) under
    `name`; it stays registered across clear_caches(). Emitters made before miss it."""
    _EXTRA_BUILTINS[name] = obj
    state = _state()
    if not state.pm.has_plugin(name):
        state._register(registry.ExtensionReport(name=name, kind="hook", entry_point=_describe(obj),
                                                 package=registry.BUILTIN_PACKAGE,
                                                 package_version=_tokenmill_version()), obj)


def _impls(hook_name: str) -> list[Any]:
    # pluggy calls implementations last-registered first; these calls keep registration order.
    return list(reversed(getattr(plugin_manager().hook, hook_name).get_hookimpls()))


def request_event_emitter() -> Optional[Callable[[RequestEvent], None]]:
    """The function the engine calls with each RequestEvent, or None when nothing subscribes
    (then the engine's hot path pays nothing). Each subscriber runs in turn; one that raises is
    logged once and does not stop the others."""
    impls = _impls("tokenmill_request_event")
    if not impls:
        return None
    calls = [(impl.plugin_name, impl.function, bool(impl.argnames)) for impl in impls]
    failed: set[str] = set()

    def emit(event: RequestEvent) -> None:
        for name, function, takes_event in calls:
            try:
                function(event) if takes_event else function()
            except Exception as exc:
                if name not in failed:
                    failed.add(name)
                    logger.warning("hook plugin %r: tokenmill_request_event raised %s (logged once)",
                                   name, registry.error_text(exc))
    return emit


def validate_config(config: Any) -> None:
    """Ask every validator; ValueError listing every problem found. A validator that raises is a
    bug in that plugin, not a problem with the configuration: logged and skipped."""
    problems: list[str] = []
    for impl in _impls("tokenmill_validate_config"):
        try:
            found = impl.function(config) if impl.argnames else impl.function()
        except Exception as exc:
            logger.warning("hook plugin %r: tokenmill_validate_config raised %s", impl.plugin_name,
                           registry.error_text(exc))
            continue
        problems.extend(str(p) for p in (found or []))
    if problems:
        raise ValueError("invalid configuration: " + "; ".join(problems))


def clear_caches() -> None:
    _state.cache_clear()
