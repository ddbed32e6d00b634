"""Finding platforms, attention backends, model architectures and quantization methods.

* Platforms: stevedore over the entry-point group `tokenmill.platforms`. The six built-in
  platforms are registered by tokenmill's own pyproject exactly like a third-party one; the
  origin of each entry point ("built-in" or the distribution that declares it) comes from the
  installed distributions' metadata.
* General plugins: stevedore over `tokenmill.plugins`, each registered into a pluggy
  PluginManager whose hookspecs (plugins/hookspecs.py) let it contribute model architectures,
  attention backends, quantization methods, tool and reasoning parsers.
* Nothing here is fatal to the others: a plugin that fails to import, names something that is
  not a Platform, was built for another API version, or whose hook raises is reported
  (discover_platforms(), plugin_reports(), attention_backend_errors()) and skipped.

Public functions (the contract the engine uses): resolve_platform, discover_platforms,
attention_backend_classes, attention_backend_errors, select_attention_backend,
extra_model_architectures, quantization_methods, tool_parsers, reasoning_parsers,
plugin_manager, plugin_reports, clear_caches.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

logger = logging.getLogger("tokenmill.plugins")

PLATFORM_GROUP = "tokenmill.platforms"
PLUGIN_GROUP = "tokenmill.plugins"
BUILTIN_DISTRIBUTION = "tokenmill"
BUILTIN_ORIGIN = "built-in"

# Built-in attention backends, by "module:Class". When the module has no such attribute (or only
# "module" is given), the AttentionBackend subclass defined there whose `name` matches is used.
# Modules that do not exist yet or fail to import are reported (attention_backend_errors), not fatal.
BUILTIN_ATTENTION_BACKENDS = {
    "reference": "tokenmill.attention_backends.reference:ReferenceAttention",
    "cpu_sdpa": "tokenmill.attention_backends.cpu_sdpa:CpuSdpaAttention",
    "triton_paged": "tokenmill.attention_backends.triton_paged:TritonPagedAttention",
    "flash_attn": "tokenmill.attention_backends.flash_attn:FlashAttentionBackend",
    "flashinfer": "tokenmill.attention_backends.flashinfer:FlashInferBackend",
    "ipex": "tokenmill.attention_backends.ipex:IpexPagedAttention",
    "pallas": "tokenmill.attention_backends.pallas:PallasPagedAttention",
}
# Built-in quantization methods, same form. (Filled by the quantization package's owner.)
BUILTIN_QUANTIZATION_METHODS: dict[str, str] = {}


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _canonical(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


@functools.lru_cache(maxsize=None)
def _entry_point_origins(group: str) -> dict[tuple[str, str], str]:
    """(entry-point name, value) -> declaring distribution's name, for one group."""
    origins: dict[tuple[str, str], str] = {}
    for dist in importlib.metadata.distributions():
        try:
            name = dist.metadata["Name"] or "?"
            for ep in dist.entry_points:
                if ep.group == group:
                    origins.setdefault((ep.name, ep.value), name)
        except Exception:   # a broken installed distribution must not break discovery
            continue
    return origins


def _origin(group: str, ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    if not name:
        name = _entry_point_origins(group).get((ep.name, ep.value), "unknown distribution")
    return BUILTIN_ORIGIN if _canonical(name) == BUILTIN_DISTRIBUTION else name


def _extensions(group: str) -> tuple[list[tuple[Any, Any]], list[tuple[Any, BaseException]]]:
    """Loaded (entry_point, object) pairs and (entry_point, error) failures for one group."""
    from stevedore import ExtensionManager

    failures: list[tuple[Any, BaseException]] = []

    def on_failure(_manager, entrypoint, exc):
        failures.append((entrypoint, exc))

    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=on_failure)
    loaded = [(ext.entry_point, ext.plugin) for ext in manager.extensions]
    return loaded, failures


# ----------------------------------------------------------------------------------- platforms

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
    load_error: Optional[str] = None  # set when the plugin was skipped

    @property
    def usable(self) -> bool:
        return self.load_error is None and self.available

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def _platform_table() -> tuple[tuple[PlatformReport, ...], dict[str, type]]:
    from tokenmill.platforms.interface import PLATFORM_API_VERSION, Platform

    loaded, failures = _extensions(PLATFORM_GROUP)
    entries: list[tuple[int, PlatformReport, Optional[type]]] = []
    for ep, exc in failures:
        report = PlatformReport(name=ep.name, origin=_origin(PLATFORM_GROUP, ep), entry_point=ep.value,
                                reason=f"failed to load: {_error_text(exc)}",
                                load_error=f"failed to import {ep.value}: {_error_text(exc)}")
        entries.append((0 if report.origin == BUILTIN_ORIGIN else 1, report, None))
    for ep, obj in loaded:
        report = PlatformReport(name=ep.name, origin=_origin(PLATFORM_GROUP, ep), entry_point=ep.value)
        cls: Optional[type] = None
        if not (inspect.isclass(obj) and issubclass(obj, Platform)):
            report.load_error = f"{ep.value} is not a tokenmill Platform subclass (got {obj!r})"
        else:
            report.api_version = getattr(obj, "api_version", None)
            report.priority = int(getattr(obj, "priority", 0))
            if report.api_version != PLATFORM_API_VERSION:
                report.load_error = (f"built for platform API version {report.api_version}; this tokenmill "
                                     f"speaks version {PLATFORM_API_VERSION}")
            else:
                cls = obj
        if report.load_error:
            report.reason = f"skipped: {report.load_error}"
        entries.append((0 if report.origin == BUILTIN_ORIGIN else 1, report, cls))

    # Built-ins first (they win name clashes), then by priority, highest first.
    entries.sort(key=lambda e: (e[0], -(e[1].priority if e[1].priority is not None else -10**9), e[1].name))
    reports: list[PlatformReport] = []
    classes: dict[str, type] = {}
    seen: dict[str, PlatformReport] = {}
    for _, report, cls in entries:
        if report.name in seen and report.load_error is None:
            report.load_error = f"platform name {report.name!r} is already provided by {seen[report.name].origin}"
            report.reason = f"skipped: {report.load_error}"
            cls = None
        if cls is not None:
            if getattr(cls, "name", "") and cls.name != report.name:
                logger.warning("platform entry point %r names class %s whose name is %r; using %r",
                               report.name, cls.__qualname__, cls.name, report.name)
            availability = _safe_probe(cls)
            report.available, report.reason = availability
            report.description = _safe_describe(cls)
            classes[report.name] = cls
            seen.setdefault(report.name, report)
        else:
            logger.warning("platform plugin %r (%s) skipped: %s", report.name, report.origin, report.load_error)
        reports.append(report)
    return tuple(reports), classes


def _safe_probe(cls: type) -> tuple[bool, str]:
    try:
        availability = cls.probe()
        return bool(availability.available), str(availability.reason)
    except Exception as exc:   # probe must never raise; a plugin that does is still only reported
        return False, f"probe raised {_error_text(exc)}"


def _safe_describe(cls: type) -> Optional[dict[str, Any]]:
    try:
        return dict(cls().describe())
    except Exception as exc:
        return {"error": f"describe() raised {_error_text(exc)}"}


def discover_platforms() -> list[PlatformReport]:
    """Every platform entry point found: loaded or not, available or not, and why."""
    reports, _ = _platform_table()
    return [PlatformReport(**r.to_dict()) for r in reports]   # copies: callers may not edit the cache


def platform_class(name: str) -> type:
    """The class registered for `name` (usable or not); KeyError if none loaded."""
    return _platform_table()[1][name]


def _why_not(report: PlatformReport) -> str:
    if report.load_error:
        return report.load_error
    return f"unavailable: {report.reason}"


def resolve_platform(device: str = "auto"):
    """The platform instance for `device` ("auto" = highest-priority available).

    ValueError with the specific reason when the device is unknown, was skipped, or is unavailable.
    """
    device = (device or "auto").strip()
    reports, classes = _platform_table()
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


# ----------------------------------------------------------------------------- general plugins

@dataclass
class PluginReport:
    name: str
    origin: str
    entry_point: str
    loaded: bool = False
    hooks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _PluginState:
    def __init__(self) -> None:
        import pluggy

        from .hookspecs import HOOK_NAMES, PLUGIN_API_VERSION, PROJECT, TokenmillHookSpecs

        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(TokenmillHookSpecs)
        self.reports: dict[str, PluginReport] = {}
        self.order: list[str] = []
        self._collected: dict[str, tuple[dict[str, tuple[Any, str]], list[str]]] = {}
        loaded, failures = _extensions(PLUGIN_GROUP)
        for ep, exc in failures:
            self._add(PluginReport(ep.name, _origin(PLUGIN_GROUP, ep), ep.value,
                                   errors=[f"failed to import {ep.value}: {_error_text(exc)}"]))
        for ep, obj in loaded:
            report = PluginReport(ep.name, _origin(PLUGIN_GROUP, ep), ep.value)
            name = self._unique(ep.name)
            try:
                plugin = obj() if inspect.isclass(obj) else obj
                self.pm.register(plugin, name=name)
                unknown = sorted(hc.name for hc in (self.pm.get_hookcallers(plugin) or []) if hc.spec is None)
                if unknown:
                    self.pm.unregister(plugin)
                    raise ValueError(f"implements hooks this tokenmill does not define: {', '.join(unknown)} "
                                     f"(plugin API version {PLUGIN_API_VERSION})")
                report.loaded = True
                report.hooks = [h for h in HOOK_NAMES
                                if any(i.plugin_name == name for i in getattr(self.pm.hook, h).get_hookimpls())]
            except Exception as exc:
                report.errors.append(f"failed to register: {_error_text(exc)}")
            report.name = name
            self._add(report)
        for report in self.reports.values():
            for error in report.errors:
                logger.warning("plugin %r (%s): %s", report.name, report.origin, error)

    def _unique(self, name: str) -> str:
        candidate, i = name, 2
        while candidate in self.reports:
            candidate, i = f"{name}#{i}", i + 1
        return candidate

    def _add(self, report: PluginReport) -> None:
        report.name = self._unique(report.name) if report.name in self.reports else report.name
        self.reports[report.name] = report
        self.order.append(report.name)

    def collect(self, hook_name: str, check: Optional[Callable[[Any], Optional[str]]] = None
                ) -> tuple[dict[str, tuple[Any, str]], list[str]]:
        """name -> (object, plugin name) from every implementation of one hook, in load order.
        Computed once per hook (errors are recorded once)."""
        if hook_name not in self._collected:
            self._collected[hook_name] = self._collect(hook_name, check)
        found, errors = self._collected[hook_name]
        return dict(found), list(errors)

    def _collect(self, hook_name: str, check: Optional[Callable[[Any], Optional[str]]]
                 ) -> tuple[dict[str, tuple[Any, str]], list[str]]:
        impls = {i.plugin_name: i for i in getattr(self.pm.hook, hook_name).get_hookimpls()}
        found: dict[str, tuple[Any, str]] = {}
        errors: list[str] = []
        for plugin_name in self.order:
            impl = impls.get(plugin_name)
            if impl is None:
                continue
            report = self.reports[plugin_name]

            def reject(message: str, warn: bool = True) -> None:
                report.errors.append(message)
                errors.append(f"{plugin_name}: {message}")
                if warn:
                    logger.warning("plugin %r: %s", plugin_name, message)

            try:
                contributed = impl.function() or {}
                if not isinstance(contributed, dict):
                    raise TypeError(f"{hook_name} must return a dict, got {type(contributed).__name__}")
            except Exception as exc:
                reject(f"{hook_name} raised {_error_text(exc)}")
                continue
            for key, value in contributed.items():
                try:
                    obj = _load(value) if isinstance(value, str) else value
                    problem = check(obj) if check else None
                    if problem:
                        raise TypeError(problem)
                except Exception as exc:
                    reject(f"{hook_name}[{key!r}]: {_error_text(exc)}")
                    continue
                if key in found:
                    reject(f"{hook_name}[{key!r}] already contributed by plugin {found[key][1]!r}; ignored",
                           warn=False)
                    continue
                found[key] = (obj, plugin_name)
        return found, errors


@functools.lru_cache(maxsize=None)
def _plugins() -> _PluginState:
    return _PluginState()


def plugin_manager():
    """The pluggy PluginManager with every general plugin registered."""
    return _plugins().pm


def plugin_reports() -> list[PluginReport]:
    state = _plugins()
    return [PluginReport(**state.reports[n].to_dict()) for n in state.order]


# --------------------------------------------------------------------------- attention backends

def _is_backend_class(obj: Any) -> Optional[str]:
    from tokenmill.attention_backends.interface import AttentionBackend
    if inspect.isclass(obj) and issubclass(obj, AttentionBackend):
        return None
    return f"{obj!r} is not an AttentionBackend subclass"


def _load_builtin_backend(name: str, target: str) -> type:
    from tokenmill.attention_backends.interface import AttentionBackend
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if attr and hasattr(module, attr):
        return getattr(module, attr)
    candidates = [obj for obj in vars(module).values()
                  if inspect.isclass(obj) and issubclass(obj, AttentionBackend) and obj is not AttentionBackend
                  and obj.__module__ == module.__name__ and getattr(obj, "name", "") == name]
    if not candidates:
        raise ImportError(f"{module_name} defines no AttentionBackend named {name!r}")
    return candidates[0]


@functools.lru_cache(maxsize=None)
def _backend_table() -> tuple[dict[str, type], dict[str, str]]:
    classes: dict[str, type] = {}
    errors: dict[str, str] = {}
    for name, target in BUILTIN_ATTENTION_BACKENDS.items():
        try:
            classes[name] = _load_builtin_backend(name, target)
        except Exception as exc:
            errors[name] = f"failed to load {target}: {_error_text(exc)}"
            logger.debug("attention backend %r: %s", name, errors[name])
    found, _ = _plugins().collect("tokenmill_attention_backends", _is_backend_class)
    for name, (cls, plugin_name) in found.items():
        if name in classes:
            message = f"attention backend {name!r} from plugin {plugin_name!r} clashes with the built-in one; ignored"
            _plugins().reports[plugin_name].errors.append(message)
            logger.warning(message)
            continue
        classes[name] = cls
        errors.pop(name, None)
    return classes, errors


def attention_backend_classes() -> dict[str, type]:
    """Every attention backend that loaded: built-ins and those contributed by plugins."""
    return dict(_backend_table()[0])


def attention_backend_errors() -> dict[str, str]:
    """Backends that are registered but failed to load: name -> error."""
    return dict(_backend_table()[1])


def select_attention_backend(platform, attn_config, requested: Optional[str] = None):
    """The backend class to use: the requested one (ValueError with reasons if it cannot run),
    else the first of the platform's preferences that validates."""
    backends, errors = _backend_table()
    if requested:
        if requested not in backends:
            if requested in errors:
                raise ValueError(f"attention backend {requested!r} is unavailable: {errors[requested]}")
            raise ValueError(f"unknown attention backend {requested!r}; known: {sorted(backends)}")
        reasons = backends[requested].validate(attn_config)
        if reasons:
            hint = ""
            if any(r.startswith("graph capture") for r in reasons):
                hint = " (add --enforce-eager, or pick another --graph-capture, to run it without graph capture)"
            raise ValueError(f"attention backend {requested!r} cannot run here: " + "; ".join(reasons) + hint)
        return backends[requested]
    try:
        return _first_valid(platform, attn_config, backends, errors)
    except ValueError as first_error:
        if getattr(attn_config, "graph_capture", "none") == "none":
            raise
        # No preferred backend can be captured: run eagerly rather than not at all. The platform's
        # graph capture checks the bound backend's supported_graph_modes and skips itself.
        eager = dataclasses.replace(attn_config, graph_capture="none")
        try:
            cls = _first_valid(platform, eager, backends, errors)
        except ValueError:
            raise first_error from None
        logger.warning("no attention backend of %s supports graph capture %r; using %s without graph capture",
                       getattr(platform, "name", platform), attn_config.graph_capture, cls.name)
        return cls


def _first_valid(platform, attn_config, backends: dict[str, type], errors: dict[str, str]) -> type:
    tried = []
    for name in platform.attention_backends():
        cls = backends.get(name)
        if cls is None:
            tried.append(f"{name}: {errors.get(name, 'not installed')}")
            continue
        reasons = cls.validate(attn_config)
        if not reasons:
            if tried:
                logger.info("attention backend %s chosen; passed over: %s", name, " | ".join(tried))
            return cls
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise ValueError("no attention backend can run this model here: " + " | ".join(tried))


# ------------------------------------------------------------------- other plugin contributions

def _is_class(obj: Any) -> Optional[str]:
    return None if inspect.isclass(obj) else f"{obj!r} is not a class"


def extra_model_architectures() -> dict[str, type]:
    """Architectures contributed by plugins: HF architecture name -> model class."""
    found, _ = _plugins().collect("tokenmill_model_architectures", _is_class)
    return {name: obj for name, (obj, _) in found.items()}


def quantization_methods() -> dict[str, Any]:
    """Built-in quantization methods plus those contributed by plugins (built-ins win clashes)."""
    methods: dict[str, Any] = {}
    for name, target in BUILTIN_QUANTIZATION_METHODS.items():
        try:
            methods[name] = _load(target)
        except Exception as exc:
            logger.warning("quantization method %r failed to load: %s", name, _error_text(exc))
    found, _ = _plugins().collect("tokenmill_quantization_methods")
    for name, (obj, _) in found.items():
        methods.setdefault(name, obj)
    return methods


def tool_parsers() -> dict[str, Any]:
    return {name: obj for name, (obj, _) in _plugins().collect("tokenmill_tool_parsers")[0].items()}


def reasoning_parsers() -> dict[str, Any]:
    return {name: obj for name, (obj, _) in _plugins().collect("tokenmill_reasoning_parsers")[0].items()}


def clear_caches() -> None:
    """Forget everything discovered (tests; after installing a plugin in a running process)."""
    for cached in (_platform_table, _plugins, _backend_table, _entry_point_origins):
        cached.cache_clear()
